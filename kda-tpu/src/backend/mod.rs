//! [`PjrtBackend`]: a handle on one PJRT device that many threads share, device-resident tensors
//! and the KDA programs on them, with `kda_core::Backend` as a thin host-tensor layer on top.
//!
//! Guarantees: every call blocks until its results exist on the device (downloads until they
//! are on the host). Calls from all clones of a handle run one at a time, in arrival order, on
//! the handle's worker thread; results are bitwise deterministic on one machine and plugin (the
//! same program on the same inputs gives the same bits, whichever thread called and whatever
//! ran before). A panic inside the plugin bindings becomes an error, and the handle then
//! refuses every later call (`TpuError::Poisoned`) instead of hanging.

mod context_parallel;
mod data_parallel;
mod device;
mod host;
mod options;
mod sharded;
mod tensor;
mod worker;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use kda_core::{HostTensor, KdaError, Problem, TensorData};
use kda_packed::StaticCapacity;

pub use device::{DeviceCotangents, DeviceGate, DeviceGradients, DeviceInputs, DeviceOutputs, PjrtResiduals};
pub use host::{program_text, DeviceCall, ProgramKind};
pub use options::{CompileCache, PjrtOptions, Split};
pub use tensor::{DeviceProgram, DeviceTensor, TransferStats};

use crate::error::{Result, TpuError};
use crate::kernels::{KernelSpec, CHUNK, TPU_SLAB};
use crate::runtime::{CompileOptions, XlaOption};
use crate::{ElementType, MemoryStats};
use worker::{BufferInfo, Shared, Worker};

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
    shared: Arc<Shared>,
    slab: usize,
    split: Split,
    xla: Arc<BTreeMap<String, XlaOption>>,
}

impl std::fmt::Debug for PjrtBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PjrtBackend({} via {}, slab {})",
            self.shared.info.platform,
            self.shared.info.plugin_path.display(),
            self.slab
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
    /// Uploads one array (counted) and returns the buffer, not yet kept.
    pub(crate) fn upload(&mut self, counters: &worker::Counters, u: Upload) -> Result<crate::DeviceBuffer> {
        self.upload_on(counters, u, 0)
    }

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
            ElementType::Bf16 => HostTensor::from_bf16(shape, self.rt.download_bf16(buf)?),
            ElementType::F32 => HostTensor::from_f32(shape, self.rt.download_f32(buf)?),
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

impl PjrtBackend {
    /// A backend with default [`PjrtOptions`]: `$KDA_PJRT_PLUGIN`, else `$KDA_HOME`'s CPU plugin.
    pub fn new() -> kda_core::Result<Self> {
        PjrtOptions::new().build().map_err(e)
    }

    /// The options builder ([`PjrtOptions::build`] makes the handle).
    pub fn options() -> PjrtOptions {
        PjrtOptions::new()
    }

    pub(crate) fn start(options: PjrtOptions) -> Result<Self> {
        let xla = Arc::new(options.xla_choice()?);
        let shared = Shared::start(&options)?;
        let slab = options.slab_choice().unwrap_or(if shared.info.platform == "cpu" { 0 } else { TPU_SLAB });
        Ok(Self { shared, slab, split: options.split_choice(), xla })
    }

    /// How host `Backend` calls spread over several devices ([`PjrtOptions::split`]).
    pub fn split(&self) -> Split {
        self.split
    }

    /// This handle with fused programs in slabs of `chunks` chunk positions (0: all chunks at
    /// once); other clones keep theirs. Slabs bound the live intermediates to one slab's (the
    /// memory figure that matters on TPU) at the cost of recomputing the chunk terms in the
    /// backward loop; results agree to f32 rounding either way.
    pub fn with_slab(mut self, chunks: usize) -> Self {
        self.slab = chunks;
        self
    }
    /// The slab size of the fused programs (0: no slabs).
    pub fn slab(&self) -> usize {
        self.slab
    }
    /// The platform name the plugin reports (`cpu`, `tpu`, `cuda`).
    pub fn platform(&self) -> &str {
        &self.shared.info.platform
    }
    /// The plugin file loaded.
    pub fn plugin_path(&self) -> &Path {
        &self.shared.info.plugin_path
    }
    /// The plugin's PJRT C API version (major, minor).
    pub fn plugin_version(&self) -> (i32, i32) {
        self.shared.info.plugin_version
    }
    /// Bytes copied each way (and programs run) by this handle and its clones so far.
    pub fn transfer_stats(&self) -> TransferStats {
        TransferStats::read(&self.shared)
    }

    /// The kernel spec of a validated problem whose inputs share one dtype (see
    /// [`KernelSpec::with_g_dtype`] for a `g` of another dtype).
    pub fn spec(&self, p: &Problem, has_dht: bool) -> kda_core::Result<KernelSpec> {
        let packed = if p.segments.is_packed() {
            Some(StaticCapacity::new(p.dims.b, p.dims.t, p.dims.n, CHUNK)?.chunks())
        } else {
            None
        };
        Ok(KernelSpec::new(p, packed, has_dht).with_slab(self.slab))
    }

    /// The StableHLO text of a program (see [`program_text`]).
    pub fn program_text(spec: &KernelSpec, kind: ProgramKind) -> kda_core::Result<String> {
        program_text(spec, kind).map_err(e)
    }

    /// The XLA options a kernel program is compiled with. On the CPU plugin the forward
    /// programs use XLA's memory-optimized scheduler instead of its default
    /// concurrency-optimized one: at the primary shape that measured the forward 5-9% faster
    /// (medians of five alternating runs' medians, f32 19.4 -> 17.7 and 20.1 -> 19.1 ms) and its
    /// scratch smaller (f32 34.5 -> 26.3 MB); the fused programs measured 1-3% slower with it, so
    /// they keep the default. Other plugins get XLA's defaults. The options of
    /// [`PjrtOptions::xla_option`] (and `$KDA_XLA_OPT_LEVEL`) come on top.
    pub fn compile_options(&self, kind: ProgramKind) -> CompileOptions {
        self.xla.iter().fold(compile_options(&self.shared.info.platform, kind), |o, (name, value)| {
            o.with_xla_option(name.clone(), value.clone())
        })
    }

    /// Compiles the programs `kinds` of `spec` now, so the first call does not pay for it.
    pub fn prepare(&self, spec: &KernelSpec, kinds: &[ProgramKind]) -> kda_core::Result<()> {
        for &kind in kinds {
            let (spec, options) = (spec.clone(), self.compile_options(kind));
            let _span = tracing::info_span!("kda_prepare", kind = ?kind).entered();
            self.shared.call("prepare", move |w| w.kernel(&spec, kind, &options).map(|_| ())).map_err(e)?;
        }
        Ok(())
    }

    /// The compiler's memory statistics of one program of a spec on this handle's device.
    pub fn memory_stats(&self, spec: &KernelSpec, kind: ProgramKind) -> kda_core::Result<MemoryStats> {
        let (spec, options) = (spec.clone(), self.compile_options(kind));
        self.shared
            .call("memory stats", move |w| {
                let (exe, _) = w.kernel(&spec, kind, &options)?;
                w.rt.memory_stats(&exe)
            })
            .map_err(e)
    }

    /// Copies a host tensor to the device (f64 travels as f32); a per-token tensor may then be
    /// tagged with its layout ([`DeviceTensor::with_layout`]).
    pub fn upload(&self, t: &HostTensor) -> kda_core::Result<DeviceTensor> {
        Ok(self.upload_all(vec![Upload::of(t)])?.remove(0))
    }

    /// Copies an i32 array (an index table of a composed program) to the device.
    pub fn upload_i32(&self, data: &[i32], dims: &[usize]) -> kda_core::Result<DeviceTensor> {
        let dims = dims.iter().map(|&d| d as i64).collect();
        Ok(self.upload_all(vec![Upload::i32(data.to_vec(), dims)])?.remove(0))
    }

    /// Uploads host tensors one job each, preparing (copying, casting) the next on this thread
    /// while the worker hands the previous one to the plugin: on two or more cores the host
    /// copy that owned uploads need costs little wall time.
    /// `meanwhile` runs on this thread after the last job is sent (value checks); its error
    /// wins, and the uploaded tensors are then freed. The tensors go to device `device`.
    pub(crate) fn upload_each<'t>(
        &self,
        device: usize,
        items: impl IntoIterator<Item = (&'t HostTensor, fn(&HostTensor) -> Upload)>,
        meanwhile: impl FnOnce() -> kda_core::Result<()>,
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        let mut pending = Vec::new();
        for (t, prepare) in items {
            let (u, counters) = (prepare(t), self.shared.counters.clone());
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
        tensors.into_iter().collect::<Result<Vec<_>>>().map_err(e)
    }

    pub(crate) fn upload_all(&self, uploads: Vec<Upload>) -> kda_core::Result<Vec<DeviceTensor>> {
        let counters = self.shared.counters.clone();
        let infos = self
            .shared
            .call("upload", move |w| {
                let mut out = Vec::with_capacity(uploads.len());
                for u in uploads {
                    let buf = w.upload(&counters, u)?;
                    out.push(w.keep(buf));
                }
                Ok(out)
            })
            .map_err(e)?;
        Ok(infos.into_iter().map(|i| DeviceTensor::wrap(&self.shared, i, None)).collect())
    }

    /// Copies a device tensor to the host.
    pub fn download(&self, t: &DeviceTensor) -> kda_core::Result<HostTensor> {
        Ok(self.download_all(&[t])?.remove(0))
    }

    /// Copies several device tensors to the host in one call to the worker.
    pub fn download_all(&self, ts: &[&DeviceTensor]) -> kda_core::Result<Vec<HostTensor>> {
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
    /// same caches as the kernels. Build it with [`crate::hlo`] and [`crate::kernels::compose`].
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

    /// Runs a compiled program on device tensors (borrowed: they stay valid); one new tensor
    /// per result.
    pub fn execute(
        &self,
        program: &DeviceProgram,
        args: &[&DeviceTensor],
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        if program.owner_id() != self.shared.id {
            return Err(KdaError::value(
                "program",
                "a program of this handle",
                "a program of another handle",
            ));
        }
        for (i, t) in args.iter().enumerate() {
            t.check_owner(&self.shared, &format!("argument {i}")).map_err(e)?;
        }
        let ids: Vec<u64> = args.iter().map(|t| t.id()).collect();
        let pid = program.id();
        let counters = self.shared.counters.clone();
        let infos = self
            .shared
            .call("execute", move |w| {
                let exe = w.user_programs.get(&pid).cloned().ok_or_else(|| TpuError::Execute {
                    message: format!("program {pid} is not held by this handle's worker"),
                })?;
                run(w, &counters, &exe, ids.into_iter().map(Arg::Id).collect())
            })
            .map_err(e)?;
        Ok(infos.into_iter().map(|i| DeviceTensor::wrap(&self.shared, i, None)).collect())
    }

    /// Runs one kernel program; returns its outputs and whether it was already compiled.
    pub(crate) fn run_kernel(
        &self,
        spec: &KernelSpec,
        kind: ProgramKind,
        args: Vec<Arg>,
    ) -> kda_core::Result<(Vec<BufferInfo>, bool)> {
        let (spec, options) = (spec.clone(), self.compile_options(kind));
        let counters = self.shared.counters.clone();
        self.shared
            .call("kernel", move |w| {
                let (exe, cached) = w.kernel(&spec, kind, &options)?;
                Ok((run(w, &counters, &exe, args)?, cached))
            })
            .map_err(e)
    }

    /// Runs one kernel program compiled for `args.len()` replicas: `args[d]` on device `d`
    /// (uploads in it go to device `d`); returns each device's outputs.
    pub(crate) fn run_kernel_replicated(
        &self,
        spec: &KernelSpec,
        kind: ProgramKind,
        form: worker::Form,
        args: Vec<Vec<Arg>>,
    ) -> kda_core::Result<Vec<Vec<BufferInfo>>> {
        let options = self.compile_options(kind).with_replicas(args.len());
        let (spec, counters) = (spec.clone(), self.shared.counters.clone());
        self.shared
            .call("kernel", move |w| {
                let (exe, _) = w.kernel_form(&spec, kind, &options, form)?;
                run_replicated(w, &counters, &exe, args)
            })
            .map_err(e)
    }

    /// Panics inside the worker, to test what callers see (an error, then a poisoned handle).
    #[doc(hidden)]
    pub fn inject_worker_panic(&self) -> kda_core::Result<()> {
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

/// A program argument: a kept buffer, or a host array uploaded for this run only.
pub(crate) enum Arg {
    Id(u64),
    Upload(Upload),
}

/// Executes `exe` on the worker and keeps its outputs.
fn run(
    w: &mut Worker,
    counters: &worker::Counters,
    exe: &crate::Executable,
    args: Vec<Arg>,
) -> Result<Vec<BufferInfo>> {
    let mut temps = Vec::new();
    let mut order = Vec::with_capacity(args.len());
    for a in args {
        match a {
            Arg::Id(id) => order.push(Ok(id)),
            Arg::Upload(u) => {
                order.push(Err(temps.len()));
                temps.push(w.upload(counters, u)?);
            }
        }
    }
    // A buffer stored under other dims than the program reads (a flat KDA result fed back as
    // an input) goes through a device-side reshape first.
    let wanted: Vec<Option<Vec<i64>>> = match exe.signature() {
        Some(sig) => sig.args.iter().map(|a| a.as_ref().map(|t| t.dims.clone())).collect(),
        None => Vec::new(),
    };
    for (i, o) in order.iter_mut().enumerate() {
        let Ok(id) = *o else { continue };
        let buf = w.buffer(id)?;
        let Some(Some(want)) = wanted.get(i) else { continue };
        let n: i64 = want.iter().product();
        if buf.dims() != want.as_slice() && buf.num_elements() as i64 == n {
            let text = reshape_program(buf.dtype(), buf.dims(), want);
            let reshape = w.rt.compile(&text)?;
            let mut out = w.rt.execute(&reshape, &[buf])?;
            *o = Err(temps.len());
            temps.push(
                out.pop().ok_or_else(|| TpuError::Execute { message: "reshape returned nothing".into() })?,
            );
        }
    }
    let mut refs = Vec::with_capacity(order.len());
    for o in &order {
        refs.push(match o {
            Ok(id) => w.buffer(*id)?,
            Err(i) => &temps[*i],
        });
    }
    let outs = w.rt.execute(exe, &refs)?;
    counters.executions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    drop(refs);
    drop(temps);
    Ok(outs.into_iter().map(|b| w.keep(b)).collect())
}

/// Executes `exe` once per device: `args[d]` are device `d`'s (its uploads go there); keeps
/// every device's outputs on their device.
fn run_replicated(
    w: &mut Worker,
    counters: &worker::Counters,
    exe: &crate::Executable,
    args: Vec<Vec<Arg>>,
) -> Result<Vec<Vec<BufferInfo>>> {
    let mut temps: Vec<Vec<crate::DeviceBuffer>> = Vec::with_capacity(args.len());
    let mut orders = Vec::with_capacity(args.len());
    for (d, device_args) in args.into_iter().enumerate() {
        let (mut t, mut order) = (Vec::new(), Vec::with_capacity(device_args.len()));
        for a in device_args {
            match a {
                Arg::Id(id) => order.push(Ok(id)),
                Arg::Upload(u) => {
                    order.push(Err(t.len()));
                    t.push(w.upload_on(counters, u, d)?);
                }
            }
        }
        temps.push(t);
        orders.push(order);
    }
    let outs = {
        let mut refs = Vec::with_capacity(orders.len());
        for (d, order) in orders.iter().enumerate() {
            let mut r = Vec::with_capacity(order.len());
            for o in order {
                r.push(match o {
                    Ok(id) => w.buffer(*id)?,
                    Err(i) => &temps[d][*i],
                });
            }
            refs.push(r);
        }
        w.rt.execute_replicated(exe, &refs)?
    };
    counters.executions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    drop(temps);
    Ok(outs
        .into_iter()
        .enumerate()
        .map(|(d, bufs)| bufs.into_iter().map(|b| w.keep_on(b, d)).collect())
        .collect())
}

/// A program that gives a buffer other dims (same elements, row-major).
fn reshape_program(dtype: ElementType, from: &[i64], to: &[i64]) -> String {
    let ty = |dims: &[i64]| crate::TensorType { dtype, dims: dims.to_vec() }.to_string();
    let (a, b) = (ty(from), ty(to));
    format!(
        "module {{\n  func.func public @main(%x: {a}) -> {b} {{\n    %y = stablehlo.reshape %x : ({a}) -> {b}\n    return %y : {b}\n  }}\n}}\n"
    )
}
