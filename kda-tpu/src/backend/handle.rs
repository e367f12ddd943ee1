//! The handle itself: [`PjrtBackend`]'s fields, construction, transfers and compile options,
//! and the host arrays on their way to a device.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use kda_core::{bf16, DType, HostTensor, KdaError, Problem, TensorData, CHUNK};
use kda_packed::StaticCapacity;

use super::options::{PjrtOptions, Split};
use super::tensor::{DeviceProgram, DeviceTensor, TableCache, TransferStats};
use super::worker::{self, BufferInfo, RuntimeInfo, Shared, Worker};
use crate::error::{Result, TpuError};
use crate::op::{Implementation, ProgramKind, ProgramSpec, Tuning};
use crate::runtime::{CompileOptions, XlaOption};
use crate::MemoryStats;

/// The PJRT backend: a handle on one device of one plugin. `Send + Sync + Clone`: clones share
/// one client, one compile cache and one device worker (see the module docs for the guarantees).
///
/// ```
/// use kda_core::{Backend, BackwardStrategy, Cotangents, HostTensor, KdaInputs};
///
/// // Head-first [H, B, T, D] inputs: 1 head, 1 row, 70 tokens (two chunks), K = V = 16.
/// let x = |d: usize, f: f32| HostTensor::from_f32(&[1, 1, 70, d], (0..70 * d).map(|i| (i as f32 * f).sin() * 0.3).collect());
/// let g = HostTensor::from_f32(&[1, 1, 70, 16], vec![-0.2; 70 * 16])?;
/// let inputs = KdaInputs::new(x(16, 0.3)?, x(16, 0.7)?, x(16, 1.1)?, g, HostTensor::from_f32(&[1, 1, 70], vec![0.5; 70])?)
///     .with_layout(kda_core::Layout::HeadFirst);
/// let backend = kda_tpu::PjrtBackend::new()?; // $KDA_PJRT_PLUGIN, else $KDA_HOME's CPU plugin
/// let cot = Cotangents { d_o: x(16, 0.2)?, dht: None };
/// let (out, grads) = backend.forward_and_vjp(&inputs, &cot, BackwardStrategy::SavedState)?;
/// // The f64 reference on the same inputs agrees to f32 rounding.
/// let (want, want_grads) = kda_ref::forward_and_vjp(&inputs, &cot)?;
/// let rms = |a: &HostTensor, b: &HostTensor| {
///     let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
///     let d: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
///     (d / b.iter().map(|y| y * y).sum::<f64>()).sqrt()
/// };
/// assert!(rms(&out.o, &want.o) < 1e-5 && rms(&grads.dq, &want_grads.dq) < 1e-4);
///
/// // A clone is the same device, usable from another thread.
/// let other = backend.clone();
/// std::thread::spawn(move || other.forward_and_vjp(&inputs, &cot, BackwardStrategy::Rematerialize))
///     .join()
///     .expect("no panic")?;
/// # Ok::<(), kda_core::KdaError>(())
/// ```
#[derive(Clone)]
pub struct PjrtBackend {
    pub(super) shared: Arc<Shared>,
    pub(super) tuning: Tuning,
    pub(super) split: Split,
    xla: Arc<BTreeMap<String, XlaOption>>,
    /// Index tables already on the devices, shared by the clones.
    pub(super) tables: Arc<Mutex<TableCache>>,
}

impl std::fmt::Debug for PjrtBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PjrtBackend({} via {}, {:?})",
            self.shared.info.platform,
            self.shared.info.plugin_path.display(),
            self.tuning
        )
    }
}

pub(crate) fn e(err: TpuError) -> KdaError {
    err.into()
}

/// A host array on its way to the device.
pub(crate) enum HostData {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
    I32(Vec<i32>),
}

/// A host array with its dims.
pub(crate) struct Upload {
    pub(crate) data: HostData,
    pub(crate) dims: Vec<i64>,
}

impl Upload {
    /// A host tensor as it travels: bf16 stays bf16, f32 and f64 go as f32.
    pub(crate) fn of(t: &HostTensor) -> Self {
        Self::owned(t.clone())
    }
    /// Like [`Upload::of`], without copying an f32 or bf16 tensor's data again.
    pub(crate) fn owned(t: HostTensor) -> Self {
        let dims = t.shape().iter().map(|&d| d as i64).collect();
        let data = match t.into_data() {
            TensorData::F32(x) => HostData::F32(x),
            TensorData::BF16(x) => HostData::Bf16(x),
            TensorData::F64(x) => HostData::F32(x.iter().map(|&v| v as f32).collect()),
        };
        Upload { data, dims }
    }
    /// A host tensor as f32 (states and gate parameters travel in f32).
    pub(crate) fn f32(t: &HostTensor) -> Self {
        let dims = t.shape().iter().map(|&d| d as i64).collect();
        Upload { data: HostData::F32(t.to_f32_vec()), dims }
    }
    /// A host tensor as it travels in `dtype`: bf16, or f32 for any other dtype.
    pub(crate) fn cast(t: &HostTensor, dtype: DType) -> Self {
        let dims = t.shape().iter().map(|&d| d as i64).collect();
        let data = match (dtype, t.data()) {
            (DType::BF16, TensorData::BF16(x)) => HostData::Bf16(x.clone()),
            (DType::BF16, TensorData::F32(x)) => {
                HostData::Bf16(x.iter().map(|&v| bf16::from_f32(v)).collect())
            }
            (DType::BF16, TensorData::F64(x)) => {
                HostData::Bf16(x.iter().map(|&v| bf16::from_f64(v)).collect())
            }
            _ => HostData::F32(t.to_f32_vec()),
        };
        Upload { data, dims }
    }
    /// [`Upload::cast`] of an owned tensor, moving its data when it already has the dtype.
    pub(crate) fn owned_as(t: HostTensor, dtype: DType) -> Self {
        match (dtype, t.dtype()) {
            (DType::BF16, DType::BF16) | (DType::F32, DType::F32) => Self::owned(t),
            _ => Self::cast(&t, dtype),
        }
    }
    pub(crate) fn i32(data: Vec<i32>, dims: Vec<i64>) -> Self {
        Upload { data: HostData::I32(data), dims }
    }
    fn bytes(&self) -> u64 {
        let n = match &self.data {
            HostData::F32(x) => x.len() * 4,
            HostData::Bf16(x) => x.len() * 2,
            HostData::I32(x) => x.len() * 4,
        };
        n as u64
    }
}

impl Worker {
    /// Uploads one array (counted) to device `device` of the handle.
    pub(crate) fn upload_on(
        &mut self,
        counters: &worker::Counters,
        u: Upload,
        device: usize,
    ) -> Result<crate::DeviceBuffer> {
        counters.to_device.fetch_add(u.bytes(), std::sync::atomic::Ordering::Relaxed);
        match u.data {
            HostData::F32(x) => self.rt.upload_f32_vec(device, x, &u.dims),
            HostData::Bf16(x) => self.rt.upload_bf16_vec(device, x, &u.dims),
            HostData::I32(x) => self.rt.upload_i32_vec(device, x, &u.dims),
        }
    }

    /// Downloads a kept buffer as a host tensor of `shape` (same element count; counted);
    /// i32 buffers are an error.
    pub(crate) fn download(
        &self,
        counters: &worker::Counters,
        id: u64,
        shape: &[usize],
    ) -> Result<HostTensor> {
        let buf = self.buffer(id)?;
        let bytes = buf.num_elements() * buf.dtype().size_bytes();
        let t = match buf.dtype() {
            DType::BF16 => HostTensor::from_bf16(shape, self.rt.download_bf16(buf)?),
            DType::F32 => HostTensor::from_f32(shape, self.rt.download_f32(buf)?),
            other => {
                return Err(TpuError::Transfer {
                    what: "download".to_string(),
                    message: format!("a host tensor holds f32 or bf16, the buffer is {other}"),
                })
            }
        }
        .map_err(TpuError::Contract)?;
        counters.to_host.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(t)
    }
}

/// `Ok` when the table's row of `implementation` runs on the plugin of `info` (the Mosaic
/// kernels compile only through libtpu, the Triton kernels on a Hopper GPU).
fn check_implementation(implementation: Implementation, info: &RuntimeInfo) -> Result<()> {
    let row = crate::op::row(implementation)?;
    row.supported_on(&info.platform)?;
    row.supported_by(&info.device_kind, info.compute_capability.as_deref())
}

impl PjrtBackend {
    /// A backend with default [`PjrtOptions`]: `$KDA_PJRT_PLUGIN`, else `$KDA_HOME`'s CPU plugin.
    pub fn new() -> kda_core::Result<Self> {
        PjrtOptions::new().build()
    }

    pub(crate) fn start(options: PjrtOptions) -> Result<Self> {
        let xla = Arc::new(options.xla_choice()?);
        let shared = Shared::start(&options)?;
        let tuning = options.tuning_choice(&shared.info.platform)?;
        check_implementation(tuning.implementation, &shared.info)?;
        Ok(Self { shared, tuning, split: options.split_choice(), xla, tables: Arc::default() })
    }

    /// This handle tuned as `tuning` says ([`Tuning`]: the implementation, slabs, kernel
    /// steps, packed results' VMEM); other clones keep theirs. `Mosaic` on another platform
    /// than a TPU is an `Unsupported` error naming it.
    pub fn with_tuning(mut self, tuning: Tuning) -> kda_core::Result<Self> {
        check_implementation(tuning.implementation, &self.shared.info).map_err(e)?;
        self.tuning = tuning;
        Ok(self)
    }
    /// This handle's tuning.
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }
    /// The platform name the plugin reports (`cpu`, `tpu`, `cuda`).
    pub fn platform(&self) -> &str {
        &self.shared.info.platform
    }
    /// The plugin file loaded and its PJRT C API version (major, minor).
    pub fn plugin(&self) -> (&Path, (i32, i32)) {
        (&self.shared.info.plugin_path, self.shared.info.plugin_version)
    }
    /// How many devices this handle drives ([`PjrtOptions::devices`]).
    pub fn device_count(&self) -> usize {
        self.shared.info.devices
    }
    /// Bytes copied each way (and programs run) by this handle and its clones so far.
    pub fn transfer_stats(&self) -> TransferStats {
        TransferStats::read(&self.shared)
    }

    /// The kernel spec of a validated problem whose inputs share one dtype (see
    /// [`ProgramSpec::with_g_dtype`] for a `g` of another dtype).
    pub fn spec(&self, p: &Problem, has_dht: bool) -> kda_core::Result<ProgramSpec> {
        let packed = if p.segments.is_packed() {
            Some(StaticCapacity::new(p.dims.b, p.dims.t, p.dims.n, CHUNK)?.chunks())
        } else {
            None
        };
        Ok(ProgramSpec::new(p, packed, has_dht).with_tuning(self.tuning))
    }

    /// The XLA options a kernel program is compiled with ([`crate::op::program`] text). On the CPU plugin the forward
    /// programs use XLA's memory-optimized scheduler instead of its default
    /// concurrency-optimized one: at the primary shape it measured the forward faster and its
    /// scratch smaller, the fused programs slower (docs/performance.md, Design figures), so they
    /// keep the default. Other plugins get XLA's defaults. The options of
    /// [`PjrtOptions::xla_option`] (and `$KDA_XLA_OPT_LEVEL`) come on top.
    pub(crate) fn compile_options(&self, kind: ProgramKind) -> CompileOptions {
        self.xla.iter().fold(compile_options(&self.shared.info.platform, kind), |o, (name, value)| {
            o.with_xla_option(name.clone(), value.clone())
        })
    }

    /// Compiles the programs `kinds` of `spec` now, so the first call does not pay for it.
    pub fn prepare(&self, spec: &ProgramSpec, kinds: &[ProgramKind]) -> kda_core::Result<()> {
        for &kind in kinds {
            let (spec, options) = (spec.clone(), self.compile_options(kind));
            let _span = tracing::info_span!("kda_prepare", kind = ?kind).entered();
            self.shared
                .call("prepare", move |w| w.kernel(&spec, kind, &options, Split::Data).map(|_| ()))
                .map_err(e)?;
        }
        Ok(())
    }

    /// The compiler's memory statistics of one program of a spec on this handle's device.
    pub fn memory_stats(&self, spec: &ProgramSpec, kind: ProgramKind) -> kda_core::Result<MemoryStats> {
        let (spec, options) = (spec.clone(), self.compile_options(kind));
        self.shared
            .call("memory stats", move |w| {
                let (exe, _) = w.kernel(&spec, kind, &options, Split::Data)?;
                w.rt.memory_stats(&exe)
            })
            .map_err(e)
    }

    /// Uploads host tensors one job each, preparing (copying, casting) the next on this thread
    /// while the worker hands the previous one to the plugin: on two or more cores the host
    /// copy that owned uploads need costs little wall time.
    /// `meanwhile` runs on this thread after the last job is sent (value checks); its error
    /// wins, and the uploaded tensors are then freed. The tensors go to device `device`.
    pub(crate) fn upload_each<'t>(
        &self,
        device: usize,
        items: impl IntoIterator<Item = (&'t HostTensor, fn(&HostTensor) -> Upload, Option<Vec<i64>>)>,
        meanwhile: impl FnOnce() -> kda_core::Result<()>,
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        let mut pending = Vec::new();
        let mut shapes = Vec::new();
        for (t, prepare, held_as) in items {
            let (mut u, counters) = (prepare(t), self.shared.counters.clone());
            // Held in a program's form (same row-major elements), seen with the caller's shape.
            if let Some(dims) = held_as {
                u.dims = dims;
            }
            shapes.push(t.shape().to_vec());
            pending.push(
                self.shared
                    .submit("upload", move |w| {
                        let buf = w.upload_on(&counters, u, device)?;
                        Ok(w.keep_on(buf, device))
                    })
                    .map_err(e)?,
            );
        }
        let checked = meanwhile();
        let infos: Vec<Result<BufferInfo>> = pending.into_iter().map(|p| p.wait()).collect();
        let tensors: Vec<Result<DeviceTensor>> =
            infos.into_iter().map(|i| i.map(|i| DeviceTensor::wrap(&self.shared, i, None))).collect();
        checked?;
        let tensors = tensors.into_iter().collect::<Result<Vec<_>>>().map_err(e)?;
        tensors.into_iter().zip(shapes).map(|(t, shape)| t.reshaped(&shape)).collect()
    }

    /// Uploads host arrays to device `device` in one call to the worker and keeps them.
    pub(crate) fn upload_to(
        &self,
        device: usize,
        uploads: Vec<Upload>,
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        let counters = self.shared.counters.clone();
        let infos = self
            .shared
            .call("upload", move |w| {
                let mut out = Vec::with_capacity(uploads.len());
                for u in uploads {
                    let buf = w.upload_on(&counters, u, device)?;
                    out.push(w.keep_on(buf, device));
                }
                Ok(out)
            })
            .map_err(e)?;
        Ok(self.wrap(infos))
    }

    pub(crate) fn wrap(&self, infos: Vec<BufferInfo>) -> Vec<DeviceTensor> {
        infos.into_iter().map(|i| DeviceTensor::wrap(&self.shared, i, None)).collect()
    }

    /// Copies device tensors to the host in one call to the worker.
    pub(crate) fn download_all(&self, ts: &[&DeviceTensor]) -> kda_core::Result<Vec<HostTensor>> {
        for (i, t) in ts.iter().enumerate() {
            t.check_owner(&self.shared, &format!("tensor {i}")).map_err(e)?;
        }
        let wanted: Vec<(u64, Vec<usize>)> = ts.iter().map(|t| (t.id(), t.shape().to_vec())).collect();
        let counters = self.shared.counters.clone();
        self.shared
            .call("download", move |w| {
                wanted.iter().map(|(id, shape)| w.download(&counters, *id, shape)).collect()
            })
            .map_err(e)
    }

    /// Compiles a caller's StableHLO program (with `@main`) on this handle's device, through the
    /// same caches as the kernels. Build it with [`crate::hlo`] and [`crate::op::compose`].
    pub fn compile_program(&self, text: &str) -> kda_core::Result<DeviceProgram> {
        let text = text.to_string();
        let (id, sig) = self
            .shared
            .call("compile", move |w| {
                let exe = w.rt.compile(&text)?;
                let sig = exe.signature().cloned();
                Ok((w.keep_program(exe), sig))
            })
            .map_err(e)?;
        Ok(DeviceProgram::wrap(&self.shared, id, sig))
    }

    pub(crate) fn inject_worker_panic(&self) -> kda_core::Result<()> {
        self.shared.call("injected panic", |_| -> Result<()> { panic!("injected panic") }).map_err(e)
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

/// The compile options of a kernel program on `platform` (see [`PjrtBackend::compile_options`]).
fn compile_options(platform: &str, kind: ProgramKind) -> CompileOptions {
    let options = CompileOptions::default();
    if platform == "cpu" && matches!(kind, ProgramKind::Forward(_)) {
        options.with_xla_option(
            "xla_cpu_scheduler_type",
            XlaOption::Str("CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED".to_string()),
        )
    } else {
        options
    }
}

/// `Ok` when the PJRT programs run `p` (f32 or bf16 inputs).
pub(crate) fn supported(p: &Problem) -> kda_core::Result<()> {
    if p.dtype == DType::F64 {
        return Err(KdaError::unsupported("dtype", "f32 or bf16 inputs on PJRT", "f64"));
    }
    Ok(())
}

impl PjrtOptions {
    /// Starts the handle: a worker thread loads the plugin and owns the client. A failure is a
    /// `KdaError` whose source is the plugin's `TpuError`.
    pub fn build(self) -> kda_core::Result<PjrtBackend> {
        PjrtBackend::start(self).map_err(KdaError::from)
    }
}
