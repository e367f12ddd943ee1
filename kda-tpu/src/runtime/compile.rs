//! Compile options, the compiled-program handle, and the compile cache key.

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use pjrt::protos::xla::{
    device_assignment_proto, option_override_proto, DeviceAssignmentProto, OptionOverrideProto,
};
use pjrt::LoadedExecutable;
use pjrt_sys::PJRT_LoadedExecutable;

use super::signature::Signature;

/// The value of one XLA option override (`CompileOptionsProto.env_option_overrides`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum XlaOption {
    /// A boolean flag.
    Bool(bool),
    /// An integer flag.
    Int(i64),
    /// A string flag.
    Str(String),
}

/// Options of one compile; part of the cache key. The default is pjrt's (one replica, one partition).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    overrides: BTreeMap<String, XlaOption>,
    replicas: usize,
    first_device: usize,
}

impl CompileOptions {
    /// Sets an XLA debug option for this compile, e.g. `("xla_cpu_enable_fast_math", Bool(false))`.
    pub fn with_xla_option(mut self, name: impl Into<String>, value: XlaOption) -> Self {
        self.overrides.insert(name.into(), value);
        self
    }
    /// Compiles for `n` replicas, one per device of the runtime (`replica_id` tells them apart;
    /// collectives name them in their replica groups). The device assignment is the runtime's
    /// first `n` devices, in order. 0 and 1 both mean one device.
    pub fn with_replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }
    /// Assigns the replicas to the runtime's devices from `device` on (a one-replica program
    /// for device 3, say); 0, the default, leaves a one-replica program to pjrt's default
    /// device (the first).
    pub fn on_devices_from(mut self, device: usize) -> Self {
        self.first_device = device;
        self
    }
    /// The first device the replicas are assigned to.
    pub fn first_device(&self) -> usize {
        self.first_device
    }
    /// How many replicas the program is compiled for (at least 1).
    pub fn replicas(&self) -> usize {
        self.replicas.max(1)
    }
    /// The overrides set so far, by name.
    pub fn xla_options(&self) -> &BTreeMap<String, XlaOption> {
        &self.overrides
    }
    /// Everything in these options that can change the compiled code, as text for the on-disk
    /// cache's key: the XLA overrides, and the replica and partition counts, device ordinal,
    /// device assignment and partitioning mode of the build options.
    pub(crate) fn cache_description(&self, device_ids: &[i64]) -> String {
        let pjrt = self.to_pjrt(device_ids);
        let b = pjrt.proto().executable_build_options.clone().unwrap_or_default();
        format!(
            "overrides={:?} replicas={} partitions={} ordinal={} assignment={:?} spmd={}/{}",
            self.overrides,
            b.num_replicas,
            b.num_partitions,
            b.device_ordinal,
            b.device_assignment,
            b.use_spmd_partitioning,
            b.use_auto_spmd_partitioning
        )
    }

    /// pjrt's options: `CompileOptions::new()` plus the overrides and, for several replicas,
    /// their count and the assignment to `device_ids` (the runtime's devices, in order).
    pub(crate) fn to_pjrt(&self, device_ids: &[i64]) -> pjrt::CompileOptions {
        let mut options = pjrt::CompileOptions::new();
        if self.replicas() > 1 || self.first_device > 0 {
            let n = self.replicas();
            let build = options.proto_mut().executable_build_options.get_or_insert_with(Default::default);
            build.num_replicas = n as i64;
            build.num_partitions = 1;
            build.device_assignment = Some(DeviceAssignmentProto {
                replica_count: n as i32,
                computation_count: 1,
                computation_devices: vec![device_assignment_proto::ComputationDevice {
                    replica_device_ids: device_ids.iter().skip(self.first_device).take(n).copied().collect(),
                }],
            });
        }
        for (name, value) in &self.overrides {
            let value = match value {
                XlaOption::Bool(b) => option_override_proto::Value::BoolField(*b),
                XlaOption::Int(i) => option_override_proto::Value::IntField(*i),
                XlaOption::Str(s) => option_override_proto::Value::StringField(s.clone()),
            };
            options
                .proto_mut()
                .env_option_overrides
                .insert(name.clone(), OptionOverrideProto { value: Some(value) });
        }
        options
    }
}

/// Cache key: a hash of the program text plus the options (the text itself is compared on a hit).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct CacheKey {
    pub(crate) text_hash: u64,
    pub(crate) options: CompileOptions,
}

impl CacheKey {
    pub(crate) fn new(text: &str, options: &CompileOptions) -> Self {
        let mut h = DefaultHasher::new();
        text.hash(&mut h);
        Self { text_hash: h.finish(), options: options.clone() }
    }
}

/// A program compiled for the runtime's device. Shared through `Rc` by the compile cache.
pub struct Executable {
    pub(crate) loaded: LoadedExecutable,
    pub(crate) raw: *mut PJRT_LoadedExecutable,
    pub(crate) text: String,
    pub(crate) signature: Option<Signature>,
    pub(crate) compile_time: Duration,
}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Executable({} bytes of text, {:?})", self.text.len(), self.compile_time)
    }
}

impl Executable {
    /// `@main`'s types as read from the text (`None` if the text is not in the pretty form).
    pub fn signature(&self) -> Option<&Signature> {
        self.signature.as_ref()
    }
    /// The number of results `@main` declares, if known.
    pub fn num_outputs(&self) -> Option<usize> {
        self.signature.as_ref().map(|s| s.results.len())
    }
    /// How long the plugin took to compile it (or to load it from `KDA_COMPILE_CACHE`).
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }
    /// The StableHLO text it was compiled from.
    pub fn text(&self) -> &str {
        &self.text
    }
}
