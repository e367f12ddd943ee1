//! [`PjrtOptions`]: everything a handle is built from, in one place.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::error::Result;
use crate::op::{Implementation, Tuning};
use crate::runtime::{host_memory, plugin, Runtime, XlaOption};

/// The environment variable that sets the XLA backend optimization level of kernel compiles
/// (`xla_backend_optimization_level`, 0 to 3) when [`PjrtOptions::xla_option`] does not.
pub const OPT_LEVEL_ENV: &str = "KDA_XLA_OPT_LEVEL";

/// XLA's name for the backend (LLVM, on the CPU plugin) optimization level.
const OPT_LEVEL: &str = "xla_backend_optimization_level";

/// Where compiled programs are kept between processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CompileCache {
    /// `$KDA_COMPILE_CACHE` when set, else none (the default).
    #[default]
    FromEnv,
    /// This folder (see [`crate::runtime::disk_cache`]).
    Dir(PathBuf),
    /// No on-disk cache: every new program is compiled.
    Off,
}

/// How the host `Backend` calls of a handle with several devices spread a batch over them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Split {
    /// Data parallelism: whole rows per device, gate-parameter gradients all-reduced.
    #[default]
    Data,
    /// Context parallelism (docs/kda.md, Context parallelism): every row's chunks cut into one contiguous piece
    /// per device; each device holds only its piece's tokens, and the programs exchange the
    /// pieces' state transitions.
    Context,
}

/// How a [`PjrtBackend`](crate::PjrtBackend) is built: the plugin, the compile cache, host-memory tuning and the
/// program configuration. Every field has a default; nothing here changes the process until
/// [`PjrtOptions::build`].
///
/// ```no_run
/// use kda_tpu::{CompileCache, PjrtOptions};
///
/// let backend = PjrtOptions::new()
///     .plugin("/opt/pjrt/pjrt_c_api_cpu_plugin.so") // default: $KDA_PJRT_PLUGIN, else $KDA_HOME's CPU plugin
///     .compile_cache(CompileCache::Dir("/tmp/kda-cache".into()))
///     .retain_host_memory(true) // glibc tuning for the CPU plugin; process-wide, off by default
///     .build()?;
/// # Ok::<(), kda_core::KdaError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct PjrtOptions {
    plugin: Option<PathBuf>,
    compile_cache: CompileCache,
    retain_host_memory: bool,
    tuning: Option<Tuning>,
    devices: Option<usize>,
    split: Split,
    xla: BTreeMap<String, XlaOption>,
}

/// The environment variable that picks the implementation (`xla`, `mosaic`, `interpret`) when
/// [`PjrtOptions::tuning`] is not given (how `cargo xtask tpu-test --implementation` runs the
/// conformance suite through the kernels).
pub const IMPLEMENTATION_ENV: &str = "KDA_IMPLEMENTATION";

/// `$KDA_IMPLEMENTATION`'s implementation, else XLA (another value than `xla`, `mosaic` or
/// `interpret` there is an error naming the variable).
fn env_implementation() -> Result<Implementation> {
    match std::env::var(IMPLEMENTATION_ENV) {
        Ok(text) => Implementation::parse(text.trim()).ok_or_else(|| {
            crate::TpuError::contract(kda_core::KdaError::value(
                IMPLEMENTATION_ENV,
                "xla, mosaic or interpret",
                text.clone(),
            ))
        }),
        Err(_) => Ok(Implementation::default()),
    }
}

impl Tuning {
    /// The default tuning with the implementation `$KDA_IMPLEMENTATION` names (else XLA's):
    /// what a test or tool that tunes one knob starts from to keep the environment's choice.
    pub fn from_env() -> kda_core::Result<Tuning> {
        Ok(Tuning::default().with_implementation(env_implementation()?))
    }
}

impl PjrtOptions {
    /// The defaults: the plugin from the environment, `$KDA_COMPILE_CACHE`, no host-memory
    /// tuning, and the program configuration of the plugin's platform.
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads the PJRT plugin at `path` instead of `$KDA_PJRT_PLUGIN` (or `$KDA_HOME`'s CPU plugin).
    pub fn plugin(mut self, path: impl Into<PathBuf>) -> Self {
        self.plugin = Some(path.into());
        self
    }

    /// Where compiled programs are kept between processes.
    pub fn compile_cache(mut self, cache: CompileCache) -> Self {
        self.compile_cache = cache;
        self
    }

    /// Keeps freed host memory mapped on the CPU plugin (glibc `mallopt`, see
    /// [`crate::runtime::host_memory`]): about half the CPU time of a fused call at the benchmark
    /// shape goes to page faults without it. It changes the allocator of the whole process and
    /// keeps its high-water heap, so it is off unless asked for. No effect on other plugins.
    pub fn retain_host_memory(mut self, on: bool) -> Self {
        self.retain_host_memory = on;
        self
    }

    /// Drives `n` devices of the plugin (default 1): the CPU plugin makes `n` devices; other
    /// plugins need at least `n` addressable devices (else an `Unsupported` error naming both
    /// numbers). The host `Backend` calls then spread each batch's rows over the devices (data
    /// parallelism, or [`PjrtOptions::split`]); device-API calls run on device 0.
    pub fn devices(mut self, n: usize) -> Self {
        self.devices = Some(n);
        self
    }

    /// How the host `Backend` calls spread a batch over the devices (default [`Split::Data`]).
    pub fn split(mut self, split: Split) -> Self {
        self.split = split;
        self
    }

    /// Tunes the handle's programs as `tuning` says (see [`Tuning`]: what runs their chunk
    /// loops, slabs, kernel steps, packed results' VMEM); [`Implementation::Mosaic`] needs a TPU
    /// plugin, else [`PjrtOptions::build`] is an `Unsupported` error naming the platform.
    /// Without it: [`Tuning::for_platform`] with the implementation `$KDA_IMPLEMENTATION` names
    /// (how `cargo xtask tpu-test --implementation` runs the conformance suite through the
    /// kernels), else XLA's; [`Tuning::from_env`] gives the same to start from.
    pub fn tuning(mut self, tuning: Tuning) -> Self {
        self.tuning = Some(tuning);
        self
    }

    /// Adds an XLA debug option to every kernel program this handle compiles (part of the
    /// compile cache's key). `xla_backend_optimization_level` defaults to `$KDA_XLA_OPT_LEVEL`
    /// when that is set (else XLA's default, 3): level 0 compiles the CPU plugin's programs about
    /// 3x faster and runs them slower, with the same HLO passes, which is what `cargo xtask
    /// test` uses; benchmarks and the demo keep XLA's default.
    pub fn xla_option(mut self, name: impl Into<String>, value: XlaOption) -> Self {
        self.xla.insert(name.into(), value);
        self
    }

    /// The tuning asked for, else the platform's with `$KDA_IMPLEMENTATION`'s implementation.
    pub(crate) fn tuning_choice(&self, platform: &str) -> Result<Tuning> {
        match self.tuning {
            Some(t) => Ok(t),
            None => Ok(Tuning::for_platform(platform).with_implementation(env_implementation()?)),
        }
    }

    /// The split asked for.
    pub(crate) fn split_choice(&self) -> Split {
        self.split
    }

    /// The XLA options of every kernel compile: those asked for, and the optimization level
    /// from `$KDA_XLA_OPT_LEVEL` unless one was asked for (a value other than 0 to 3 is an error
    /// naming the variable).
    pub(crate) fn xla_choice(&self) -> Result<BTreeMap<String, XlaOption>> {
        let mut xla = self.xla.clone();
        if let (false, Ok(text)) = (xla.contains_key(OPT_LEVEL), std::env::var(OPT_LEVEL_ENV)) {
            xla.insert(OPT_LEVEL.to_string(), XlaOption::Int(opt_level(&text)?));
        }
        Ok(xla)
    }

    /// Loads the plugin and makes the runtime (on the worker thread).
    pub(crate) fn runtime(&self) -> Result<Runtime> {
        let devices = self.devices.unwrap_or(1);
        let location = match &self.plugin {
            Some(path) => plugin::PluginLocation {
                path: path.clone(),
                what: "PJRT plugin",
                hint: "check the path".to_string(),
            },
            None => plugin::default_plugin(),
        };
        let mut rt = Runtime::from_location_on(&location, devices)?;
        match &self.compile_cache {
            CompileCache::FromEnv => {}
            CompileCache::Dir(dir) => rt.set_compile_cache(Some(dir.clone())),
            CompileCache::Off => rt.set_compile_cache(None),
        }
        if self.retain_host_memory && rt.platform() == "cpu" {
            let kept = host_memory::retain();
            tracing::debug!(kept, "host memory retention for the CPU plugin");
        }
        Ok(rt)
    }
}

/// Reads an optimization level (0 to 3) given in `$KDA_XLA_OPT_LEVEL`.
fn opt_level(text: &str) -> Result<i64> {
    text.trim().parse::<i64>().ok().filter(|l| (0..=3).contains(l)).ok_or_else(|| {
        crate::TpuError::contract(kda_core::KdaError::value(OPT_LEVEL_ENV, "0, 1, 2 or 3", text.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case::zero("0", Some(0))]
    #[case::three_with_spaces(" 3\n", Some(3))]
    #[case::four("4", None)]
    #[case::negative("-1", None)]
    #[case::word("fast", None)]
    fn opt_level_accepts_zero_to_three(#[case] text: &str, #[case] want: Option<i64>) {
        match (opt_level(text), want) {
            (Ok(got), Some(want)) => assert_eq!(got, want),
            (Err(e), None) => assert!(e.to_string().contains(OPT_LEVEL_ENV), "{e}"),
            (got, want) => panic!("{text:?}: got {got:?}, want {want:?}"),
        }
    }
}
