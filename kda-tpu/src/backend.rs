//! [`PjrtBackend`]: `kda_core::Backend` over the chunked programs, on any PJRT plugin.

use crate::kernels::{
    backward_program, forward_program, fused_program, on_device, KernelSpec, CHUNK, TPU_SLAB,
};
use crate::runtime::{CompileOptions, DeviceBuffer, Executable, Runtime, XlaOption};
use crate::TpuError;
use kda_core::{
    Backend, BackwardStrategy, Cotangents, DType, HostTensor, KdaError, KdaGradients, KdaInputs, KdaOutputs,
    Problem, Residuals, Result, TensorData,
};
use kda_packed::{StaticCapacity, SENTINEL};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

pub use crate::kernels::interface::ProgramKind;

/// The PJRT backend. Not `Send`: PJRT clients live on one thread.
///
/// ```
/// use kda_core::{Backend, BackwardStrategy, Cotangents, HostTensor, KdaInputs};
///
/// // Head-first [H, B, T, D] inputs: 1 head, 1 row, 70 tokens (two chunks), K = V = 16.
/// let x = |d: usize, f: f32| HostTensor::from_f32(&[1, 1, 70, d], (0..70 * d).map(|i| (i as f32 * f).sin() * 0.3).collect());
/// let g = HostTensor::from_f32(&[1, 1, 70, 16], vec![-0.2; 70 * 16])?;
/// let inputs = KdaInputs::new(x(16, 0.3)?, x(16, 0.7)?, x(16, 1.1)?, g, HostTensor::from_f32(&[1, 1, 70], vec![0.5; 70])?)
///     .with_layout(kda_core::Layout::HeadFirst);
/// let backend = kda_tpu::PjrtBackend::new()?; // the CPU plugin, or $KDA_PJRT_PLUGIN
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
/// # Ok::<(), kda_core::KdaError>(())
/// ```
pub struct PjrtBackend {
    rt: Runtime,
    programs: RefCell<HashMap<(String, ProgramKind), Rc<Executable>>>,
    slab: usize,
}

/// Device-resident residuals: the forward's input buffers (reused by the backward without a host
/// round trip) and, for the saved-state strategy, the state entering every chunk.
pub struct PjrtResiduals {
    problem: Problem,
    spec: KernelSpec,
    strategy: BackwardStrategy,
    inputs: Vec<DeviceBuffer>,
    h: Option<DeviceBuffer>,
    types: Gradtypes,
}

impl Residuals for PjrtResiduals {
    fn strategy(&self) -> BackwardStrategy {
        self.strategy
    }
    fn problem(&self) -> &Problem {
        &self.problem
    }
}

impl PjrtResiduals {
    /// Bytes held on the device by these residuals.
    pub fn device_bytes(&self) -> usize {
        self.inputs.iter().chain(self.h.iter()).map(|b| b.num_elements() * b.dtype().size_bytes()).sum()
    }
}

fn dims(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&x| x as i64).collect()
}

fn e(err: TpuError) -> KdaError {
    err.into()
}

impl PjrtBackend {
    /// A backend on the default plugin (`KDA_PJRT_PLUGIN`, else the one `cargo xtask setup` installed).
    pub fn new() -> Result<Self> {
        Ok(Self::with_runtime(Runtime::new().map_err(e)?))
    }
    /// A backend on an existing runtime. Fused programs run without slabs on the CPU plugin and
    /// in slabs of [`TPU_SLAB`] chunk positions elsewhere (see [`PjrtBackend::with_slab`]).
    pub fn with_runtime(rt: Runtime) -> Self {
        let slab = if rt.platform() == "cpu" { 0 } else { TPU_SLAB };
        Self { rt, programs: RefCell::new(HashMap::new()), slab }
    }
    /// Runs the fused forward+VJP programs in slabs of `chunks` chunk positions (0: all chunks at
    /// once). Slabs bound the live intermediates to one slab's (the memory figure that matters on
    /// TPU) at the cost of recomputing the chunk terms in the backward loop; results agree to f32
    /// rounding either way.
    pub fn with_slab(mut self, chunks: usize) -> Self {
        self.slab = chunks;
        self.programs.borrow_mut().clear();
        self
    }
    /// The slab size of the fused programs (0: no slabs).
    pub fn slab(&self) -> usize {
        self.slab
    }
    /// The runtime (plugin, client, compile cache).
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// The kernel spec of a call: [`PjrtBackend::spec`] with `g` read in its own dtype.
    fn call_spec(&self, x: &KdaInputs, p: &Problem, has_dht: bool) -> Result<KernelSpec> {
        Ok(self.spec(p, has_dht)?.with_g_dtype(x.g.dtype()))
    }

    /// The kernel spec of a validated problem whose inputs share one dtype (see
    /// [`KernelSpec::with_g_dtype`] for a `g` of another dtype).
    pub fn spec(&self, p: &Problem, has_dht: bool) -> Result<KernelSpec> {
        let packed = if p.segments.is_packed() {
            Some(StaticCapacity::new(p.dims.b, p.dims.t, p.dims.n, CHUNK)?.chunks())
        } else {
            None
        };
        Ok(KernelSpec::new(p, packed, has_dht).with_slab(self.slab))
    }

    /// The StableHLO text of a program.
    pub fn program_text(spec: &KernelSpec, kind: ProgramKind) -> Result<String> {
        let text = match kind {
            ProgramKind::Forward(keep_h) => forward_program(spec, keep_h),
            ProgramKind::Backward(s) => backward_program(spec, s),
            ProgramKind::Fused(s) => fused_program(spec, s),
        };
        text.map_err(e)
    }

    /// The XLA options a kernel program is compiled with. On the CPU plugin the forward
    /// programs use XLA's memory-optimized scheduler instead of its default
    /// concurrency-optimized one: at the primary shape that measured the forward 5-9% faster
    /// (medians of five alternating runs' medians, f32 19.4 -> 17.7 and 20.1 -> 19.1 ms) and its
    /// scratch smaller (f32 34.5 -> 26.3 MB); the fused programs measured 1-3% slower with it, so
    /// they keep the default. Other plugins get XLA's defaults.
    pub fn compile_options(&self, kind: ProgramKind) -> CompileOptions {
        let options = CompileOptions::default();
        if self.rt.platform() == "cpu" && matches!(kind, ProgramKind::Forward(_)) {
            options.with_xla_option(
                "xla_cpu_scheduler_type",
                XlaOption::Str("CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED".to_string()),
            )
        } else {
            options
        }
    }

    /// The compiled program (built and compiled once per spec and kind).
    pub fn executable(&self, spec: &KernelSpec, kind: ProgramKind) -> Result<Rc<Executable>> {
        let key = (format!("{spec:?}"), kind);
        if let Some(x) = self.programs.borrow().get(&key) {
            return Ok(x.clone());
        }
        let text = Self::program_text(spec, kind)?;
        let exe = self.rt.compile_with(&text, &self.compile_options(kind)).map_err(e)?;
        self.programs.borrow_mut().insert(key, exe.clone());
        Ok(exe)
    }

    fn upload(&self, t: &HostTensor) -> Result<DeviceBuffer> {
        let d = dims(t.shape());
        match t.data() {
            TensorData::F32(x) => self.rt.upload_f32(x, &d),
            TensorData::BF16(x) => self.rt.upload_bf16(x, &d),
            TensorData::F64(_) => self.rt.upload_f32(&t.to_f32_vec(), &d),
        }
        .map_err(e)
    }

    fn upload_as_f32(&self, t: &HostTensor) -> Result<DeviceBuffer> {
        self.rt.upload_f32(&t.to_f32_vec(), &dims(t.shape())).map_err(e)
    }

    fn download(&self, buf: &DeviceBuffer, shape: &[usize], dtype: DType) -> Result<HostTensor> {
        match dtype {
            DType::BF16 => HostTensor::from_bf16(shape, self.rt.download_bf16(buf).map_err(e)?),
            _ => HostTensor::from_f32(shape, self.rt.download_f32(buf).map_err(e)?),
        }
    }

    /// The forward inputs as device buffers, in program order.
    fn upload_inputs(&self, x: &KdaInputs, p: &Problem, spec: &KernelSpec) -> Result<Vec<DeviceBuffer>> {
        let mut bufs = Vec::new();
        for t in [&x.q, &x.k, &x.v, &x.g] {
            bufs.push(self.upload(t)?);
        }
        // beta in q's dtype (the program reads one element type for all per-token inputs).
        bufs.push(self.upload(&x.beta.cast(p.dtype))?);
        if let Some(h0) = &x.initial_state {
            bufs.push(self.upload_as_f32(h0)?);
        }
        if let Some((a_log, dt)) = x.gate.params() {
            let a_log = a_log.ok_or_else(|| KdaError::missing("a_log", "an in-kernel gate needs a_log"))?;
            bufs.push(self.upload_as_f32(a_log)?);
            if let Some(dt) = dt {
                bufs.push(self.upload_as_f32(dt)?);
            }
        }
        let nt = spec.chunks();
        let d = &p.dims;
        if let Some(cap) = spec.packed_chunks {
            let tables = StaticCapacity::new(d.b, d.t, d.n, CHUNK)?.plan(&p.segments)?.tables().clone();
            debug_assert_eq!(tables.capacity, cap);
            let fix = |v: &[i32], sentinel: i32| -> Vec<i32> {
                v.iter().map(|&x| if x == SENTINEL { sentinel } else { x }).collect()
            };
            let rt = &self.rt;
            bufs.push(rt.upload_i32(&tables.chunk_first, &[nt as i64]).map_err(e)?);
            bufs.push(rt.upload_i32(&tables.chunk_last, &[nt as i64]).map_err(e)?);
            bufs.push(rt.upload_i32(&fix(&tables.chunk_segment, 0), &[nt as i64]).map_err(e)?);
            let slot_token = fix(&tables.slot_token, (d.b * d.t) as i32);
            bufs.push(rt.upload_i32(&slot_token, &[(nt * CHUNK) as i64]).map_err(e)?);
            let token_slot = fix(&tables.token_slot, (nt * CHUNK) as i32);
            bufs.push(rt.upload_i32(&token_slot, &[(d.b * d.t) as i64]).map_err(e)?);
        } else {
            let mut first = vec![0; nt];
            let mut last = vec![0; nt];
            first[0] = 1;
            last[nt - 1] = 1;
            bufs.push(self.rt.upload_i32(&first, &[nt as i64]).map_err(e)?);
            bufs.push(self.rt.upload_i32(&last, &[nt as i64]).map_err(e)?);
            bufs.push(self.rt.upload_i32(&vec![0; nt], &[nt as i64]).map_err(e)?);
        }
        Ok(bufs)
    }

    fn outputs(&self, p: &Problem, outs: &[DeviceBuffer]) -> Result<KdaOutputs> {
        let d = &p.dims;
        let out = |i: usize| {
            outs.get(i)
                .ok_or_else(|| KdaError::backend("execute", "a program output per result", "too few outputs"))
        };
        let o = self.download(out(0)?, &p.layout.token_shape(d.h, d.b, d.t, d.v), p.dtype)?;
        let final_state = if p.output_final_state {
            Some(self.download(out(1)?, &d.state_shape(), DType::F32)?)
        } else {
            None
        };
        Ok(KdaOutputs { o, final_state })
    }

    fn gradients(&self, p: &Problem, x: &Gradtypes, outs: &[DeviceBuffer]) -> Result<KdaGradients> {
        let d = &p.dims;
        let lay = p.layout;
        let tk = lay.token_shape(d.h, d.b, d.t, d.k);
        let tv = lay.token_shape(d.h, d.b, d.t, d.v);
        let cast = |t: HostTensor, to: DType| if t.dtype() == to { t } else { t.cast(to) };
        let mut it = outs.iter();
        let mut next = || {
            it.next().ok_or_else(|| {
                KdaError::backend("execute", "a program output per gradient", "too few outputs")
            })
        };
        let dq = self.download(next()?, &tk, p.dtype)?;
        let dk = self.download(next()?, &tk, p.dtype)?;
        let dv = self.download(next()?, &tv, p.dtype)?;
        let dg = cast(self.download(next()?, &tk, on_device(x.g))?, x.g);
        let dbeta = cast(self.download(next()?, &p.beta_shape, p.dtype)?, x.beta);
        let dh0 = if p.has_initial_state {
            Some(self.download(next()?, &d.state_shape(), DType::F32)?)
        } else {
            None
        };
        let (mut da_log, mut ddt_bias) = (None, None);
        if p.gate != kda_core::GateKind::Preactivated {
            da_log = Some(cast(self.download(next()?, &[d.h], DType::F32)?, x.gate));
            if p.has_dt_bias {
                ddt_bias = Some(cast(self.download(next()?, &[d.h * d.k], DType::F32)?, x.dt_bias));
            }
        }
        Ok(KdaGradients { dq, dk, dv, dg, dbeta, dh0, da_log, ddt_bias })
    }

    fn problem(&self, inputs: &KdaInputs) -> Result<Problem> {
        let p = inputs.validate()?;
        self.supports(&p)?;
        Ok(p)
    }
}

/// The dtypes gradients come back in (their inputs').
#[derive(Debug, Clone, Copy)]
struct Gradtypes {
    g: DType,
    beta: DType,
    /// `a_log`'s dtype.
    gate: DType,
    /// `dt_bias`'s dtype.
    dt_bias: DType,
}

fn gradtypes(x: &KdaInputs) -> Gradtypes {
    let gate = x.gate.params().and_then(|(a, _)| a).map_or(DType::F32, |t| t.dtype());
    let dt_bias = x.gate.params().and_then(|(_, d)| d).map_or(DType::F32, |t| t.dtype());
    Gradtypes { g: x.g.dtype(), beta: x.beta.dtype(), gate, dt_bias }
}

impl Backend for PjrtBackend {
    type Residuals = PjrtResiduals;

    fn name(&self) -> String {
        format!("pjrt-{}", self.rt.platform())
    }

    fn supports(&self, p: &Problem) -> Result<()> {
        if p.dtype == DType::F64 {
            return Err(KdaError::unsupported("dtype", "f32 or bf16 inputs on PJRT", "f64"));
        }
        Ok(())
    }

    fn forward(&self, inputs: &KdaInputs, strategy: BackwardStrategy) -> Result<(KdaOutputs, PjrtResiduals)> {
        let p = self.problem(inputs)?;
        let spec = self.call_spec(inputs, &p, false)?;
        let keep_h = strategy == BackwardStrategy::SavedState;
        let exe = self.executable(&spec, ProgramKind::Forward(keep_h))?;
        let bufs = self.upload_inputs(inputs, &p, &spec)?;
        let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
        let mut outs = self.rt.execute(&exe, &refs).map_err(e)?;
        let out = self.outputs(&p, &outs)?;
        let h = if keep_h { outs.pop() } else { None };
        Ok((out, PjrtResiduals { problem: p, spec, strategy, inputs: bufs, h, types: gradtypes(inputs) }))
    }

    fn backward(&self, res: PjrtResiduals, cot: &Cotangents) -> Result<KdaGradients> {
        let p = &res.problem;
        cot.validate(p)?;
        let mut spec = res.spec.clone();
        spec.has_dht = cot.dht.is_some();
        let exe = self.executable(&spec, ProgramKind::Backward(res.strategy))?;
        let d_o = self.upload(&cot.d_o.cast(p.dtype))?;
        let dht = cot.dht.as_ref().map(|t| self.upload_as_f32(t)).transpose()?;
        let mut refs: Vec<&DeviceBuffer> = res.inputs.iter().collect();
        refs.extend(res.h.iter());
        refs.push(&d_o);
        refs.extend(dht.iter());
        let outs = self.rt.execute(&exe, &refs).map_err(e)?;
        self.gradients(p, &res.types, &outs)
    }

    fn forward_and_vjp(
        &self,
        inputs: &KdaInputs,
        cot: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        let p = self.problem(inputs)?;
        cot.validate(&p)?;
        let spec = self.call_spec(inputs, &p, cot.dht.is_some())?;
        let exe = self.executable(&spec, ProgramKind::Fused(strategy))?;
        let bufs = self.upload_inputs(inputs, &p, &spec)?;
        let d_o = self.upload(&cot.d_o.cast(p.dtype))?;
        let dht = cot.dht.as_ref().map(|t| self.upload_as_f32(t)).transpose()?;
        let mut refs: Vec<&DeviceBuffer> = bufs.iter().collect();
        refs.push(&d_o);
        refs.extend(dht.iter());
        let outs = self.rt.execute(&exe, &refs).map_err(e)?;
        let out = self.outputs(&p, &outs)?;
        let skip = 1 + usize::from(p.output_final_state);
        let grads = self.gradients(&p, &gradtypes(inputs), outs.get(skip..).unwrap_or_default())?;
        Ok((out, grads))
    }
}

/// A call's inputs (and cotangents) already on the device: what benchmarks time programs on.
pub struct DeviceCall {
    problem: Problem,
    spec: KernelSpec,
    inputs: Vec<DeviceBuffer>,
    cotangents: Vec<DeviceBuffer>,
}

impl DeviceCall {
    /// The validated problem.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }
    /// The kernel spec (with `has_dht` set from the cotangents given).
    pub fn spec(&self) -> &KernelSpec {
        &self.spec
    }
}

impl PjrtBackend {
    /// Validates and uploads a call once; `cot` is needed for backward and fused programs.
    pub fn upload_call(&self, inputs: &KdaInputs, cot: Option<&Cotangents>) -> Result<DeviceCall> {
        let p = self.problem(inputs)?;
        if let Some(c) = cot {
            c.validate(&p)?;
        }
        let spec = self.call_spec(inputs, &p, cot.is_some_and(|c| c.dht.is_some()))?;
        let bufs = self.upload_inputs(inputs, &p, &spec)?;
        let mut cbufs = Vec::new();
        if let Some(c) = cot {
            cbufs.push(self.upload(&c.d_o.cast(p.dtype))?);
            if let Some(dht) = &c.dht {
                cbufs.push(self.upload_as_f32(dht)?);
            }
        }
        Ok(DeviceCall { problem: p, spec, inputs: bufs, cotangents: cbufs })
    }

    /// Runs one program of the call on its device-resident buffers. Backward programs with the
    /// saved-state strategy need `h` (the forward's last output with `Forward(true)`).
    pub fn run_program(
        &self,
        call: &DeviceCall,
        kind: ProgramKind,
        h: Option<&DeviceBuffer>,
    ) -> Result<Vec<DeviceBuffer>> {
        let exe = self.executable(&call.spec, kind)?;
        let mut refs: Vec<&DeviceBuffer> = call.inputs.iter().collect();
        match kind {
            ProgramKind::Forward(_) => {}
            ProgramKind::Backward(s) => {
                if s == BackwardStrategy::SavedState {
                    refs.push(h.ok_or_else(|| {
                        KdaError::missing("h", "the saved-state backward reads the forward's states")
                    })?);
                }
                refs.extend(call.cotangents.iter());
            }
            ProgramKind::Fused(_) => refs.extend(call.cotangents.iter()),
        }
        self.rt.execute(&exe, &refs).map_err(e)
    }

    /// The staged baseline (spec section 5): the forward executable, its residuals handed back to
    /// the caller (downloaded to host memory), then a separate backward executable fed from them.
    pub fn run_staged(
        &self,
        call: &DeviceCall,
        strategy: BackwardStrategy,
    ) -> Result<(Vec<DeviceBuffer>, Vec<DeviceBuffer>)> {
        let saved = strategy == BackwardStrategy::SavedState;
        let mut fwd = self.run_program(call, ProgramKind::Forward(saved), None)?;
        let h = if saved {
            let dev = fwd.pop().ok_or_else(|| KdaError::backend("forward", "an h output", "none"))?;
            let host = self.rt.download_f32(&dev).map_err(e)?;
            Some(self.rt.upload_f32(&host, dev.dims()).map_err(e)?)
        } else {
            None
        };
        let bwd = self.run_program(call, ProgramKind::Backward(strategy), h.as_ref())?;
        Ok((fwd, bwd))
    }

    /// The compiler's memory statistics of one program of a spec on this runtime's device.
    pub fn memory_stats(&self, spec: &KernelSpec, kind: ProgramKind) -> Result<crate::MemoryStats> {
        let exe = self.executable(spec, kind)?;
        self.rt.memory_stats(&exe).map_err(e)
    }
}
