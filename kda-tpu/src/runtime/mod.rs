//! The PJRT runtime: one plugin, one client, one device, a compile cache, transfers and execution.
//!
//! Threading: pjrt's `Client`, `Buffer` and executables are `Rc`/raw-pointer based, so [`Runtime`],
//! [`DeviceBuffer`] and [`Executable`] are neither `Send` nor `Sync`: create and use a runtime on one
//! thread. [`crate::PjrtBackend`] does exactly that, on its own worker thread, and is shared freely.
//! Panics: every call into pjrt runs behind a `catch_unwind` boundary (see `guard`); `Drop` of
//! buffers and executables is not guarded (pjrt `expect`s the destroy call, which does not fail).

mod buffer;
mod compile;
pub mod disk_cache;
mod execute;
pub(crate) mod guard;
pub mod host_memory;
pub mod plugin;
#[allow(unsafe_code)]
pub(crate) mod raw;
mod signature;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use kda_core::DType;
use pjrt::{Api, Client, Device, LoadedExecutable, NamedValue, Program, ProgramFormat};
use pjrt_sys::PJRT_LoadedExecutable;

pub use buffer::DeviceBuffer;
pub use compile::{CompileOptions, Executable, XlaOption};
pub use raw::MemoryStats;
pub use signature::Signature;

use buffer::upload;
use compile::CacheKey;
use execute::{check_inputs, check_outputs, Borrowed};
use guard::guarded;
use plugin::{explain, PluginLocation};
use raw::{paired_ptr, Bf16Bits, RawApi};

use crate::error::{Result, TpuError};

/// A loaded PJRT plugin with one client and its first device. Not `Send`: see the module docs
/// ([`crate::PjrtBackend`] is the handle to share between threads).
///
/// ```
/// use kda_tpu::Runtime;
///
/// // A StableHLO program of one op: y = x + x.
/// let program = "module {
///   func.func public @main(%x: tensor<3xf32>) -> tensor<3xf32> {
///     %y = stablehlo.add %x, %x : tensor<3xf32>
///     return %y : tensor<3xf32>
///   }
/// }";
/// let rt = Runtime::new()?; // $KDA_PJRT_PLUGIN, else $KDA_HOME's CPU plugin
/// let exe = rt.compile(program)?; // compiled once; a second compile of the same text is a cache hit
/// let x = rt.upload_f32(&[1.0, 2.0, 3.0], &[3])?;
/// let y = rt.execute(&exe, &[&x])?;
/// assert_eq!(rt.download_f32(&y[0])?, vec![2.0, 4.0, 6.0]);
/// # Ok::<(), kda_tpu::TpuError>(())
/// ```
pub struct Runtime {
    api: Api,
    client: Client,
    /// The devices programs run on: the first `devices` addressable ones; uploads default to 0.
    devices: Vec<Device>,
    raw: RawApi,
    plugin_path: PathBuf,
    platform: String,
    device_kind: String,
    compute_capability: Option<String>,
    cache: RefCell<HashMap<CacheKey, Rc<Executable>>>,
    cache_hits: Cell<u64>,
    disk: Option<disk_cache::DiskCache>,
    disk_hits: Cell<u64>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runtime({} via {})", self.platform, self.plugin_path.display())
    }
}

impl Runtime {
    /// Loads `$KDA_PJRT_PLUGIN`, else `$KDA_HOME`'s CPU plugin (see [`plugin::default_plugin`]).
    pub fn new() -> Result<Self> {
        Self::from_location(&plugin::default_plugin())
    }

    /// Loads the plugin at `path`.
    pub fn with_plugin(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        Self::from_location(&PluginLocation { path, what: "PJRT plugin", hint: "check the path".to_string() })
    }

    /// Loads `$KDA_PJRT_PLUGIN` (else `$KDA_HOME`'s CPU plugin) with `devices` devices: the CPU
    /// plugin makes exactly that many; other plugins must have at least that many addressable
    /// devices, else an `Unsupported` error names both numbers.
    pub fn with_devices(devices: usize) -> Result<Self> {
        Self::from_location_on(&plugin::default_plugin(), devices)
    }

    pub(crate) fn from_location(loc: &PluginLocation) -> Result<Self> {
        Self::from_location_on(loc, 1)
    }

    pub(crate) fn from_location_on(loc: &PluginLocation, devices: usize) -> Result<Self> {
        if devices == 0 {
            return Err(TpuError::unsupported("devices", "at least 1 device"));
        }
        let (api, raw) = plugin::load(loc)?;
        let cpu_devices = devices as i64;
        guarded("client create", || {
            // The CPU plugin makes 4 devices by default; ask for the number wanted. It also runs each execution
            // on the calling thread (`asynchronous = false`): every call here waits for its
            // results anyway, and the scratch is then allocated from the caller's malloc arena
            // (kept warm, see `host_memory`) instead of a pool thread's, where blocks over 64 MiB
            // (the fused programs' scratch) came from fresh mmap pages on every run. Other
            // plugins reject these options (they check the names). The CUDA plugin would
            // reserve three quarters of the GPU's memory per client, which a second client in the same
            // process (the test harness makes one per test) could not get: it is asked to
            // allocate on demand. Any other plugin gets no options.
            let client = Client::builder(&api)
                .options(vec![
                    NamedValue::i64("cpu_device_count", cpu_devices),
                    NamedValue::bool("asynchronous", devices > 1),
                ])
                .build()
                .or_else(|_| {
                    Client::builder(&api)
                        .options(vec![NamedValue::i64("cpu_device_count", cpu_devices)])
                        .build()
                })
                .or_else(|_| {
                    Client::builder(&api).options(vec![NamedValue::bool("preallocate", false)]).build()
                })
                .or_else(|_| Client::builder(&api).build())
                .map_err(|e| {
                    explain(&api, &e, |m| TpuError::PluginLoad {
                        path: loc.path.display().to_string(),
                        message: m,
                    })
                })?;
            let all = client.addressable_devices();
            if all.is_empty() {
                return Err(TpuError::PluginLoad {
                    path: loc.path.display().to_string(),
                    message: "the plugin has no addressable device".to_string(),
                });
            }
            if all.len() < devices {
                return Err(TpuError::unsupported(
                    "devices",
                    format!("at most {} devices on this plugin, {devices} asked for", all.len()),
                ));
            }
            let devices: Vec<Device> = all.into_iter().take(devices).collect();
            let platform = client.platform_name().into_owned();
            let description = devices[0].description();
            let device_kind = description.kind().into_owned();
            // The attribute's value type is not exported by the crate: read its Debug form,
            // `String("9.0")`.
            let compute_capability = description.attributes().get("compute_capability").map(|v| {
                let text = format!("{v:?}");
                text.trim_start_matches("String(").trim_end_matches(')').trim_matches('"').to_string()
            });
            tracing::debug!(platform = %platform, plugin = %loc.path.display(), "PJRT runtime ready");
            Ok(Self {
                api: api.clone(),
                client,
                devices,
                raw,
                plugin_path: loc.path.clone(),
                platform,
                device_kind,
                compute_capability,
                cache: RefCell::new(HashMap::new()),
                cache_hits: Cell::new(0),
                disk: disk_cache::DiskCache::from_env(&loc.path, plugin::plugin_version(&api)),
                disk_hits: Cell::new(0),
            })
        })
    }

    /// How many devices programs run on (see [`Runtime::with_devices`]).
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The platform name the plugin reports (`cpu`, `tpu`, `cuda`).
    pub fn platform(&self) -> &str {
        &self.platform
    }
    /// The first device's kind (`NVIDIA H100 80GB HBM3`, `cpu`).
    pub fn device_kind(&self) -> &str {
        &self.device_kind
    }

    /// The first device's compute capability (`9.0`), where the plugin reports one (CUDA).
    pub fn compute_capability(&self) -> Option<&str> {
        self.compute_capability.as_deref()
    }

    /// The plugin file this runtime loaded.
    pub fn plugin_path(&self) -> &Path {
        &self.plugin_path
    }
    /// The plugin's PJRT C API version (major, minor).
    pub fn plugin_version(&self) -> (i32, i32) {
        plugin::plugin_version(&self.api)
    }

    /// Compiles StableHLO text with default options (cached).
    pub fn compile(&self, program: &str) -> Result<Rc<Executable>> {
        self.compile_with(program, &CompileOptions::default())
    }

    /// Compiles StableHLO text; a second call with the same text and options returns the cached one.
    pub fn compile_with(&self, program: &str, options: &CompileOptions) -> Result<Rc<Executable>> {
        if options.first_device() + options.replicas() > self.devices.len() {
            return Err(TpuError::unsupported(
                "replicas",
                format!(
                    "a program for {} replicas needs as many devices; this runtime has {}",
                    options.replicas(),
                    self.devices.len()
                ),
            ));
        }
        let key = CacheKey::new(program, options);
        if let Some(hit) = self.cache.borrow().get(&key).filter(|e| e.text == program) {
            self.cache_hits.set(self.cache_hits.get() + 1);
            return Ok(Rc::clone(hit));
        }
        let _span = tracing::info_span!("compile", bytes = program.len(), hash = key.text_hash).entered();
        let started = Instant::now();
        let ids = self.device_ids();
        let described = options.cache_description(&ids);
        let load = || {
            let disk = self.disk.as_ref()?;
            let bytes = disk.load(program, &described)?;
            guarded("load cached executable", || {
                self.client.load_executable(&bytes).map_err(|e| TpuError::Compile { message: e.to_string() })
            })
            .map_err(|e| tracing::debug!(error = %e, "compile cache entry not loadable; compiling"))
            .ok()
        };
        // A miss takes the entry's lock and looks again: another process may have compiled it
        // while this one waited.
        let mut from_disk = load();
        let _lock = match (&from_disk, &self.disk) {
            (None, Some(disk)) => {
                let lock = disk.lock(program, &described);
                from_disk = load();
                Some(lock)
            }
            _ => None,
        };
        let loaded: LoadedExecutable = match from_disk {
            Some(loaded) => {
                self.disk_hits.set(self.disk_hits.get() + 1);
                if let Some(disk) = &self.disk {
                    disk.record("hit", started.elapsed());
                }
                tracing::debug!("compile cache hit");
                loaded
            }
            None => {
                let loaded = guarded("compile", || {
                    let program = Program::new(ProgramFormat::MLIR, program);
                    self.client
                        .compile(&program, options.to_pjrt(&ids))
                        .map_err(|e| explain(&self.api, &e, |message| TpuError::Compile { message }))
                })?;
                if let Some(disk) = &self.disk {
                    disk.record("compile", started.elapsed());
                    match guarded("serialize", || Ok(loaded.executable().serialize().bytes().to_vec())) {
                        Ok(bytes) => disk.store(program, &described, &bytes),
                        Err(e) => tracing::debug!(error = %e, "executable not serializable; not cached"),
                    }
                }
                loaded
            }
        };
        let raw = paired_ptr::<LoadedExecutable, PJRT_LoadedExecutable>(&self.client, &loaded)?;
        let exe = Rc::new(Executable {
            loaded,
            raw,
            text: program.to_string(),
            signature: Signature::parse(program),
            compile_time: started.elapsed(),
        });
        tracing::debug!(ms = exe.compile_time.as_secs_f64() * 1e3, "compiled");
        self.cache.borrow_mut().insert(key, Rc::clone(&exe));
        Ok(exe)
    }

    /// The global ids of the runtime's devices, in order (the device assignment of replicas).
    fn device_ids(&self) -> Vec<i64> {
        self.devices.iter().map(|d| i64::from(d.description().id())).collect()
    }

    /// Runs a program compiled for `args.len()` replicas ([`CompileOptions::with_replicas`]):
    /// `args[d]` are replica `d`'s inputs, on device `d` ([`Runtime::upload_f32_on`] and
    /// friends); returns each replica's outputs. Inputs stay valid.
    pub fn execute_replicated(
        &self,
        exe: &Executable,
        args: &[Vec<&DeviceBuffer>],
    ) -> Result<Vec<Vec<DeviceBuffer>>> {
        let _span = tracing::info_span!("execute", replicas = args.len()).entered();
        if args.is_empty() || args.len() > self.devices.len() {
            return Err(TpuError::unsupported(
                "replicas",
                format!("1 to {} replicas on this runtime, {} given", self.devices.len(), args.len()),
            ));
        }
        for a in args {
            check_inputs(exe, a)?;
        }
        let num_outputs = match exe.num_outputs() {
            Some(n) => n,
            None => guarded("num outputs", || Ok(exe.loaded.executable().num_outputs()))?,
        };
        let ptrs: Vec<Vec<_>> = args.iter().map(|a| a.iter().map(|b| b.raw()).collect()).collect();
        let outputs = guarded("execute", || {
            let raw = self.raw.execute_replicated(exe.raw, &ptrs, num_outputs)?;
            raw.into_iter()
                .map(|dev| {
                    dev.into_iter()
                        .map(|p| DeviceBuffer::wrap(&self.client, pjrt::Buffer::wrap(&self.client, p)))
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()
        })?;
        for o in &outputs {
            check_outputs(exe, o)?;
        }
        Ok(outputs)
    }

    /// How many compiles were answered from the cache.
    pub fn cache_hits(&self) -> u64 {
        self.cache_hits.get()
    }
    /// How many compiles were answered from the on-disk compile cache.
    pub fn disk_cache_hits(&self) -> u64 {
        self.disk_hits.get()
    }
    /// Uses `dir` as the on-disk compile cache (`None`: none), overriding `KDA_COMPILE_CACHE`.
    /// See [`disk_cache`] for what is stored and when an entry is used.
    pub fn set_compile_cache(&mut self, dir: Option<PathBuf>) {
        self.disk = dir.map(|d| disk_cache::DiskCache::new(d, &self.plugin_path, self.plugin_version()));
    }

    /// How many programs the cache holds.
    pub fn cache_len(&self) -> usize {
        self.cache.borrow().len()
    }
    /// Drops every cached program (executables still held elsewhere stay alive).
    pub fn clear_cache(&self) {
        self.cache.borrow_mut().clear();
    }

    /// Runs `exe` on borrowed inputs (they stay valid and can be reused); one buffer per result.
    pub fn execute(&self, exe: &Executable, inputs: &[&DeviceBuffer]) -> Result<Vec<DeviceBuffer>> {
        let _span = tracing::info_span!("execute", inputs = inputs.len()).entered();
        check_inputs(exe, inputs)?;
        let outputs = guarded("execute", || {
            let mut per_device = exe
                .loaded
                .execution(Borrowed::new(inputs))
                .run_sync()
                .map_err(|e| explain(&self.api, &e, |message| TpuError::Execute { message }))?;
            if per_device.len() != 1 {
                return Err(TpuError::Execute {
                    message: format!("expected 1 device, got {}", per_device.len()),
                });
            }
            let bufs = per_device.swap_remove(0);
            bufs.into_iter().map(|b| DeviceBuffer::wrap(&self.client, b)).collect::<Result<Vec<_>>>()
        })?;
        check_outputs(exe, &outputs)?;
        Ok(outputs)
    }

    /// Compiler memory statistics of `exe`, including the peak (read through pjrt-sys directly).
    pub fn memory_stats(&self, exe: &Executable) -> Result<MemoryStats> {
        guarded("memory stats", || self.raw.loaded_memory_stats(exe.raw))
    }

    /// Uploads f32 data with row-major `dims`.
    pub fn upload_f32(&self, data: &[f32], dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec(data.to_vec(), dims)
    }
    /// Uploads bf16 data with row-major `dims` (as `PrimitiveType::BF16`).
    pub fn upload_bf16(&self, data: &[half::bf16], dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec(data.iter().map(|x| Bf16Bits(x.to_bits())).collect(), dims)
    }
    /// Uploads i32 data with row-major `dims` (`&[]` for a scalar).
    pub fn upload_i32(&self, data: &[i32], dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec(data.to_vec(), dims)
    }

    /// Uploads owned f32 data to device `device` (no copy on the host before the plugin's own).
    pub(crate) fn upload_f32_vec(&self, device: usize, data: Vec<f32>, dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec_on(device, data, dims)
    }
    /// Uploads owned bf16 data to device `device` (reinterpreted in place as the plugin's bf16).
    pub(crate) fn upload_bf16_vec(
        &self,
        device: usize,
        data: Vec<half::bf16>,
        dims: &[i64],
    ) -> Result<DeviceBuffer> {
        let bits: Vec<Bf16Bits> = match bytemuck::allocation::try_cast_vec(data) {
            Ok(bits) => bits,
            Err((_, data)) => data.iter().map(|x| Bf16Bits(x.to_bits())).collect(),
        };
        self.upload_vec_on(device, bits, dims)
    }
    /// Uploads owned i32 data to device `device`.
    pub(crate) fn upload_i32_vec(&self, device: usize, data: Vec<i32>, dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec_on(device, data, dims)
    }

    /// Uploads f32 data to device `device` (0 to [`Runtime::device_count`] - 1).
    pub fn upload_f32_on(&self, device: usize, data: &[f32], dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec_on(device, data.to_vec(), dims)
    }
    /// Uploads i32 data to device `device`.
    pub fn upload_i32_on(&self, device: usize, data: &[i32], dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec_on(device, data.to_vec(), dims)
    }

    fn upload_vec<E: pjrt::ElemType>(&self, data: Vec<E>, dims: &[i64]) -> Result<DeviceBuffer> {
        self.upload_vec_on(0, data, dims)
    }

    pub(crate) fn upload_vec_on<E: pjrt::ElemType>(
        &self,
        device: usize,
        data: Vec<E>,
        dims: &[i64],
    ) -> Result<DeviceBuffer> {
        let _span = tracing::info_span!("transfer", to = "device", device, elements = data.len()).entered();
        let target = self.devices.get(device).ok_or_else(|| {
            TpuError::unsupported(
                "device",
                format!("device {device} of a runtime with {} devices", self.devices.len()),
            )
        })?;
        guarded("upload", || upload(&self.client, target, data, dims))
    }

    /// Downloads an f32 buffer (error if it holds another dtype).
    pub fn download_f32(&self, buf: &DeviceBuffer) -> Result<Vec<f32>> {
        self.download(buf, DType::F32, "download_f32")
    }
    /// Downloads a bf16 buffer (error if it holds another dtype).
    pub fn download_bf16(&self, buf: &DeviceBuffer) -> Result<Vec<half::bf16>> {
        self.download(buf, DType::BF16, "download_bf16")
    }
    /// Downloads an i32 buffer (error if it holds another dtype).
    pub fn download_i32(&self, buf: &DeviceBuffer) -> Result<Vec<i32>> {
        self.download(buf, DType::I32, "download_i32")
    }

    fn download<T: bytemuck::Pod>(&self, buf: &DeviceBuffer, want: DType, arg: &str) -> Result<Vec<T>> {
        let _span = tracing::info_span!("transfer", to = "host", elements = buf.num_elements()).entered();
        if buf.dtype() != want || std::mem::size_of::<T>() != want.size_bytes() {
            return Err(kda_core::KdaError::dtype(arg, want.name(), buf.dtype().name()).into());
        }
        guarded("download", || self.raw.to_host_vec::<T>(buf.raw(), buf.num_elements())).map_err(
            |e| match e {
                TpuError::Panic { .. } => e,
                other => TpuError::Transfer { what: format!("{buf:?} to host"), message: other.to_string() },
            },
        )
    }
}
