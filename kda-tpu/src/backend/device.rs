//! The device API: KDA inputs, outputs, gradients and residuals as [`DeviceTensor`]s, so a
//! training loop keeps its activations on the device and only index tables cross per call.

use kda_core::{
    validate_cotangent_shapes, BackwardStrategy, Cotangents, DType, GateKind, GateMode, HostTensor,
    KdaConfig, KdaError, KdaInputs, Layout, Problem, Residuals, Segments,
};

use super::tensor::{DeviceTensor, Meta};
use super::worker::BufferInfo;
use super::{e, Arg, PjrtBackend, ProgramKind, Upload};
use crate::kernels::KernelSpec;

/// The gate of a device call: `g` used as given, or activated in the kernel from `a_log` `[H]`
/// and an optional `dt_bias` `[H*K]` (both f32 on the device).
#[derive(Debug, Clone, Default)]
pub enum DeviceGate {
    /// `g` is already the log-decay.
    #[default]
    Preactivated,
    /// `g = -exp(a_log) * softplus(g + dt_bias)`.
    Softplus {
        /// `[H]`, f32.
        a_log: DeviceTensor,
        /// `[H*K]`, f32.
        dt_bias: Option<DeviceTensor>,
    },
    /// `g = lb * sigmoid(exp(a_log) * (g + dt_bias))`, `lb` in `[-5, 0)`.
    LowerBound {
        /// The lower bound.
        lb: f64,
        /// `[H]`, f32.
        a_log: DeviceTensor,
        /// `[H*K]`, f32.
        dt_bias: Option<DeviceTensor>,
    },
}

impl DeviceGate {
    fn kind(&self) -> GateKind {
        match self {
            DeviceGate::Preactivated => GateKind::Preactivated,
            DeviceGate::Softplus { .. } => GateKind::Softplus,
            DeviceGate::LowerBound { lb, .. } => GateKind::LowerBound(*lb),
        }
    }
    fn params(&self) -> (Option<&DeviceTensor>, Option<&DeviceTensor>) {
        match self {
            DeviceGate::Preactivated => (None, None),
            DeviceGate::Softplus { a_log, dt_bias } | DeviceGate::LowerBound { a_log, dt_bias, .. } => {
                (Some(a_log), dt_bias.as_ref())
            }
        }
    }
}

/// The forward's inputs on the device, like [`KdaInputs`]: per-token tensors in
/// `config.layout`, all of q's dtype (f32 or bf16) except `g` (f32 or bf16); states and gate
/// parameters f32. Shapes and dtypes are checked on every call; values are not read (upload
/// through [`PjrtBackend::upload_inputs`] checks them once).
#[derive(Debug, Clone)]
pub struct DeviceInputs {
    /// Queries.
    pub q: DeviceTensor,
    /// Keys.
    pub k: DeviceTensor,
    /// Values.
    pub v: DeviceTensor,
    /// Log-decays (or gate pre-activations).
    pub g: DeviceTensor,
    /// Write strengths, in q's dtype.
    pub beta: DeviceTensor,
    /// Initial states `[B, N, H, K, V]`, f32.
    pub initial_state: Option<DeviceTensor>,
    /// The gate.
    pub gate: DeviceGate,
    /// Segment metadata (host-side: it becomes index tables uploaded with each call).
    pub segments: Option<Segments>,
    /// Scalar options.
    pub config: KdaConfig,
}

impl DeviceInputs {
    /// Fixed-length inputs with the default config (batch-first) and a given `g`.
    pub fn new(
        q: DeviceTensor,
        k: DeviceTensor,
        v: DeviceTensor,
        g: DeviceTensor,
        beta: DeviceTensor,
    ) -> Self {
        DeviceInputs {
            q,
            k,
            v,
            g,
            beta,
            initial_state: None,
            gate: DeviceGate::Preactivated,
            segments: None,
            config: KdaConfig::default(),
        }
    }
    /// With scalar options.
    pub fn with_config(mut self, config: KdaConfig) -> Self {
        self.config = config;
        self
    }
    /// With packed segments.
    pub fn with_segments(mut self, segments: Segments) -> Self {
        self.segments = Some(segments);
        self
    }
    /// With initial states.
    pub fn with_initial_state(mut self, h0: DeviceTensor) -> Self {
        self.initial_state = Some(h0);
        self
    }
    /// With an in-kernel gate.
    pub fn with_gate(mut self, gate: DeviceGate) -> Self {
        self.gate = gate;
        self
    }

    /// The program arguments before the index tables, in signature order, with their names.
    pub(crate) fn args(&self) -> Vec<(&'static str, &DeviceTensor)> {
        let mut a =
            vec![("q", &self.q), ("k", &self.k), ("v", &self.v), ("g", &self.g), ("beta", &self.beta)];
        if let Some(h0) = &self.initial_state {
            a.push(("initial_state", h0));
        }
        let (a_log, dt_bias) = self.gate.params();
        a.extend(a_log.map(|t| ("a_log", t)));
        a.extend(dt_bias.map(|t| ("dt_bias", t)));
        a
    }
}

/// The cotangents of a backward or fused call on the device: `do` in q's dtype, `dht` f32.
#[derive(Debug, Clone)]
pub struct DeviceCotangents {
    /// Cotangent of `o`.
    pub d_o: DeviceTensor,
    /// Cotangent of the final states.
    pub dht: Option<DeviceTensor>,
}

/// The forward's outputs on the device.
#[derive(Debug, Clone)]
pub struct DeviceOutputs {
    /// `o`, in q's dtype and the call's layout.
    pub o: DeviceTensor,
    /// Final states `[B, N, H, K, V]`, f32, when asked for.
    pub final_state: Option<DeviceTensor>,
}

/// The gradients on the device: `dq dk dv dbeta` in q's dtype, `dg` in g's, the rest f32.
#[derive(Debug, Clone)]
pub struct DeviceGradients {
    /// Gradient of q.
    pub dq: DeviceTensor,
    /// Gradient of k.
    pub dk: DeviceTensor,
    /// Gradient of v.
    pub dv: DeviceTensor,
    /// Gradient of g (of the gate pre-activation for an in-kernel gate).
    pub dg: DeviceTensor,
    /// Gradient of beta, shaped like beta.
    pub dbeta: DeviceTensor,
    /// Gradient of the initial states.
    pub dh0: Option<DeviceTensor>,
    /// Gradient of `a_log`.
    pub da_log: Option<DeviceTensor>,
    /// Gradient of `dt_bias`.
    pub ddt_bias: Option<DeviceTensor>,
}

impl DeviceGradients {
    /// `(name, tensor)` for every gradient present, in [`kda_core::KdaGradients::named`] order.
    pub fn named(&self) -> Vec<(&'static str, &DeviceTensor)> {
        let mut v = vec![
            ("dq", &self.dq),
            ("dk", &self.dk),
            ("dv", &self.dv),
            ("dg", &self.dg),
            ("dbeta", &self.dbeta),
        ];
        v.extend(self.dh0.as_ref().map(|t| ("dh0", t)));
        v.extend(self.da_log.as_ref().map(|t| ("da_log", t)));
        v.extend(self.ddt_bias.as_ref().map(|t| ("ddt_bias", t)));
        v
    }
}

/// What a forward keeps on the device for its backward: its inputs (shared, not copied) and,
/// for the saved-state strategy, the state entering every chunk. `Send`: a backward may run
/// on another thread than its forward.
#[derive(Debug, Clone)]
pub struct PjrtResiduals {
    pub(crate) problem: Problem,
    pub(crate) spec: KernelSpec,
    pub(crate) strategy: BackwardStrategy,
    pub(crate) inputs: Vec<DeviceTensor>,
    pub(crate) h: Option<DeviceTensor>,
    /// The host dtypes of g, beta, a_log and dt_bias, for gradients downloaded by the host API.
    pub(crate) host_types: Option<super::host::Gradtypes>,
    /// Under data parallelism, each device's residuals (its rows); the fields above then
    /// describe the whole batch and hold no tensors.
    pub(crate) shards: Vec<PjrtResiduals>,
    /// Under context parallelism, how the call's rows were cut into pieces.
    pub(crate) context: Option<std::sync::Arc<super::context_parallel::ContextPlan>>,
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
    /// The residuals of one device's program: its problem and spec, the inputs it read and,
    /// saved-state, its per-chunk states.
    pub(crate) fn one_device(
        problem: Problem,
        spec: KernelSpec,
        strategy: BackwardStrategy,
        inputs: Vec<DeviceTensor>,
        h: Option<DeviceTensor>,
    ) -> Self {
        Self { problem, spec, strategy, inputs, h, host_types: None, shards: Vec::new(), context: None }
    }

    /// Bytes held on the device by these residuals (inputs shared with the caller included).
    pub fn device_bytes(&self) -> usize {
        let own: usize = self.inputs.iter().chain(self.h.iter()).map(DeviceTensor::size_bytes).sum();
        own + self.shards.iter().map(PjrtResiduals::device_bytes).sum::<usize>()
    }
}

/// The index tables of a call, in signature order, as uploads.
pub(crate) fn index_tables(spec: &KernelSpec, p: &Problem) -> kda_core::Result<Vec<Upload>> {
    let tables = crate::kernels::index_tables_for(spec, &p.segments).map_err(e)?;
    Ok(tables.into_iter().map(|t| Upload::i32(t.data, t.dims)).collect())
}

/// How a tensor travels in `dtype` (f32 or bf16; a cast only when it differs).
fn cast_to(dtype: DType) -> fn(&HostTensor) -> Upload {
    match dtype {
        DType::BF16 => {
            |t| if t.dtype() == DType::BF16 { Upload::of(t) } else { Upload::owned(t.cast(DType::BF16)) }
        }
        _ => |t| if t.dtype() == DType::F32 { Upload::of(t) } else { Upload::owned(t.cast(DType::F32)) },
    }
}

fn layout_name(l: Layout) -> &'static str {
    match l {
        Layout::HeadFirst => "head-first",
        Layout::BatchFirst => "batch-first",
    }
}

impl PjrtBackend {
    /// Validates host inputs (values included) and copies them to the device: per-token tensors
    /// tagged with the config's layout, `beta` in q's dtype, states and gate parameters in f32.
    pub fn upload_inputs(&self, x: &KdaInputs) -> kda_core::Result<DeviceInputs> {
        self.upload_inputs_on(0, x)
    }

    /// [`PjrtBackend::upload_inputs`] to device `device` of the handle (one shard of a
    /// data-parallel batch, see [`PjrtBackend::forward_and_vjp_data_parallel`]).
    pub fn upload_inputs_on(&self, device: usize, x: &KdaInputs) -> kda_core::Result<DeviceInputs> {
        self.check_device_index(device)?;
        let p = x.view().validate()?;
        kda_core::Backend::supports(self, &p)?;
        let of: fn(&HostTensor) -> Upload = Upload::of;
        let f32: fn(&HostTensor) -> Upload = Upload::f32;
        let mut ups = vec![(&x.q, of), (&x.k, of), (&x.v, of), (&x.g, of), (&x.beta, cast_to(p.dtype))];
        ups.extend(x.initial_state.as_ref().map(|t| (t, f32)));
        let gate_params = x.gate.params();
        if let Some((a_log, dt)) = gate_params {
            let a_log = a_log.ok_or_else(|| KdaError::missing("a_log", "an in-kernel gate needs a_log"))?;
            ups.push((a_log, f32));
            ups.extend(dt.map(|t| (t, f32)));
        }
        let mut t = self.upload_each(device, ups, || x.check_values())?.into_iter();
        let mut next =
            || t.next().ok_or_else(|| KdaError::backend("upload", "one tensor per upload", "too few"));
        let lay = p.layout;
        let (q, k, v, g) = (
            next()?.with_layout(lay),
            next()?.with_layout(lay),
            next()?.with_layout(lay),
            next()?.with_layout(lay),
        );
        let beta = next()?.with_layout(lay);
        let initial_state = if x.initial_state.is_some() { Some(next()?) } else { None };
        let gate = match (&x.gate, gate_params) {
            (GateMode::Preactivated, _) | (_, None) => DeviceGate::Preactivated,
            (GateMode::Softplus { .. }, Some((_, dt))) => {
                let a_log = next()?;
                DeviceGate::Softplus { a_log, dt_bias: if dt.is_some() { Some(next()?) } else { None } }
            }
            (GateMode::LowerBound { lb, .. }, Some((_, dt))) => {
                let a_log = next()?;
                DeviceGate::LowerBound {
                    lb: *lb,
                    a_log,
                    dt_bias: if dt.is_some() { Some(next()?) } else { None },
                }
            }
        };
        Ok(DeviceInputs {
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            gate,
            segments: x.segments.clone(),
            config: x.config,
        })
    }

    /// Validates host cotangents against a problem and copies them to the device (`do` in the
    /// problem's dtype, `dht` in f32).
    pub fn upload_cotangents(&self, c: &Cotangents, p: &Problem) -> kda_core::Result<DeviceCotangents> {
        self.upload_cotangents_on(0, c, p)
    }

    /// [`PjrtBackend::upload_cotangents`] to device `device` of the handle.
    pub fn upload_cotangents_on(
        &self,
        device: usize,
        c: &Cotangents,
        p: &Problem,
    ) -> kda_core::Result<DeviceCotangents> {
        self.check_device_index(device)?;
        validate_cotangent_shapes(p, &c.d_o, c.dht.as_ref())?;
        let f32: fn(&HostTensor) -> Upload = Upload::f32;
        let mut ups = vec![(&c.d_o, cast_to(p.dtype))];
        ups.extend(c.dht.as_ref().map(|t| (t, f32)));
        let mut t = self.upload_each(device, ups, || c.check_values())?.into_iter();
        let d_o = t.next().ok_or_else(|| KdaError::backend("upload", "do", "nothing"))?.with_layout(p.layout);
        Ok(DeviceCotangents { d_o, dht: t.next() })
    }

    /// Checks device inputs (handle, layout tags, shapes, dtypes) and returns the problem and
    /// the spec of its programs.
    pub fn validate_device(
        &self,
        x: &DeviceInputs,
        has_dht: bool,
    ) -> kda_core::Result<(Problem, KernelSpec)> {
        self.validate_device_on(0, x, has_dht)
    }

    /// [`PjrtBackend::validate_device`] for inputs that must all live on device `device`.
    pub(crate) fn validate_device_on(
        &self,
        device: usize,
        x: &DeviceInputs,
        has_dht: bool,
    ) -> kda_core::Result<(Problem, KernelSpec)> {
        let args = x.args();
        for (name, t) in &args {
            t.check_owner(self.shared(), name).map_err(e)?;
            check_on(t, name, device)?;
        }
        for (name, t) in &args[..5] {
            if let Some(l) = t.layout() {
                if l != x.config.layout {
                    return Err(KdaError::value(
                        *name,
                        format!("a {} tensor (the config's layout)", layout_name(x.config.layout)),
                        format!("a tensor tagged {}", layout_name(l)),
                    ));
                }
            }
        }
        let meta = |name: &str, t: &DeviceTensor| -> kda_core::Result<Meta> { t.meta(name).map_err(e) };
        let (q, k, v, g, beta) =
            (meta("q", &x.q)?, meta("k", &x.k)?, meta("v", &x.v)?, meta("g", &x.g)?, meta("beta", &x.beta)?);
        let h0 = x.initial_state.as_ref().map(|t| meta("initial_state", t)).transpose()?;
        let (a_log, dt_bias) = x.gate.params();
        let a_log = a_log.map(|t| meta("a_log", t)).transpose()?;
        let dt_bias = dt_bias.map(|t| meta("dt_bias", t)).transpose()?;
        let view = kda_core::InputsView {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            initial_state: h0.as_ref(),
            gate: x.gate.kind(),
            a_log: a_log.as_ref(),
            dt_bias: dt_bias.as_ref(),
            segments: x.segments.as_ref(),
            config: &x.config,
        };
        let p = view.validate()?;
        kda_core::Backend::supports(self, &p)?;
        let want = |name: &str, t: &DeviceTensor, dtype: DType, why: &str| -> kda_core::Result<()> {
            match t.dtype() {
                Some(d) if d == dtype => Ok(()),
                _ => Err(KdaError::dtype(name, format!("{dtype} ({why})"), t.element_type().to_string())),
            }
        };
        want("beta", &x.beta, p.dtype, "q's dtype on the device")?;
        if let Some(h0) = &x.initial_state {
            want("initial_state", h0, DType::F32, "states are f32 on the device")?;
        }
        let (a_log, dt_bias) = x.gate.params();
        if let Some(a) = a_log {
            want("a_log", a, DType::F32, "gate parameters are f32 on the device")?;
        }
        if let Some(d) = dt_bias {
            want("dt_bias", d, DType::F32, "gate parameters are f32 on the device")?;
        }
        let g_dtype = x.g.dtype().unwrap_or(p.dtype);
        if g_dtype == DType::F64 {
            return Err(KdaError::dtype("g", "f32 or bf16", "f64"));
        }
        let spec = self.spec(&p, has_dht)?.with_g_dtype(g_dtype);
        Ok((p, spec))
    }

    fn check_cotangents(&self, p: &Problem, c: &DeviceCotangents) -> kda_core::Result<()> {
        self.check_cotangents_on(0, p, c)
    }

    /// [`PjrtBackend::check_cotangents`] for cotangents that must live on device `device`.
    pub(crate) fn check_cotangents_on(
        &self,
        device: usize,
        p: &Problem,
        c: &DeviceCotangents,
    ) -> kda_core::Result<()> {
        c.d_o.check_owner(self.shared(), "do").map_err(e)?;
        check_on(&c.d_o, "do", device)?;
        if let Some(t) = &c.dht {
            check_on(t, "dht", device)?;
        }
        let d_o = c.d_o.meta("do").map_err(e)?;
        let dht = match &c.dht {
            Some(t) => {
                t.check_owner(self.shared(), "dht").map_err(e)?;
                Some(t.meta("dht").map_err(e)?)
            }
            None => None,
        };
        validate_cotangent_shapes(p, &d_o, dht.as_ref())?;
        if c.d_o.dtype() != Some(p.dtype) {
            return Err(KdaError::dtype(
                "do",
                format!("{} like q", p.dtype),
                c.d_o.element_type().to_string(),
            ));
        }
        if let Some(t) = &c.dht {
            if t.dtype() != Some(DType::F32) {
                return Err(KdaError::dtype("dht", "f32", t.element_type().to_string()));
            }
        }
        Ok(())
    }

    fn span(op: &'static str, p: &Problem, kind: ProgramKind) -> tracing::Span {
        let d = &p.dims;
        let strategy = match kind {
            ProgramKind::Forward(true) | ProgramKind::Backward(BackwardStrategy::SavedState) => "saved-state",
            ProgramKind::Fused(s) | ProgramKind::Backward(s) => s.name(),
            ProgramKind::Forward(false) => "remat",
        };
        tracing::info_span!(
            "kda_call",
            op,
            kind = ?kind,
            strategy,
            shape = %format_args!("H{} B{} T{} K{} V{} N{}", d.h, d.b, d.t, d.k, d.v, d.n),
            packed = p.segments.is_packed(),
            dtype = %p.dtype,
            cache = tracing::field::Empty,
        )
    }

    pub(crate) fn wrap(&self, infos: Vec<BufferInfo>) -> Vec<DeviceTensor> {
        infos.into_iter().map(|i| DeviceTensor::wrap(self.shared(), i, None)).collect()
    }

    /// The forward on device tensors: outputs and residuals stay on the device.
    pub fn forward_device(
        &self,
        x: &DeviceInputs,
        strategy: BackwardStrategy,
    ) -> kda_core::Result<(DeviceOutputs, PjrtResiduals)> {
        let (p, spec) = self.validate_device(x, false)?;
        let keep_h = strategy == BackwardStrategy::SavedState;
        let kind = ProgramKind::Forward(keep_h);
        let span = Self::span("forward", &p, kind);
        let _entered = span.enter();
        let inputs: Vec<DeviceTensor> = x.args().into_iter().map(|(_, t)| t.clone()).collect();
        let mut args: Vec<Arg> = inputs.iter().map(|t| Arg::Id(t.id())).collect();
        args.extend(index_tables(&spec, &p)?.into_iter().map(Arg::Upload));
        let (infos, cached) = self.run_kernel(&spec, kind, args)?;
        span.record("cache", if cached { "hit" } else { "miss" });
        let mut outs = self.wrap(infos).into_iter();
        let out = self.outputs(&p, &mut outs)?;
        let h = if keep_h { Some(outs.next().ok_or_else(|| too_few("h"))?) } else { None };
        Ok((out, PjrtResiduals::one_device(p, spec, strategy, inputs, h)))
    }

    /// The backward from a forward's residuals (borrowed: a second backward may reuse them).
    pub fn backward_device(
        &self,
        res: &PjrtResiduals,
        c: &DeviceCotangents,
    ) -> kda_core::Result<DeviceGradients> {
        let p = &res.problem;
        self.check_cotangents(p, c)?;
        for t in res.inputs.iter().chain(res.h.iter()) {
            t.check_owner(self.shared(), "residuals").map_err(e)?;
            check_on(t, "residuals", 0)?;
        }
        let mut spec = res.spec.clone();
        spec.has_dht = c.dht.is_some();
        let kind = ProgramKind::Backward(res.strategy);
        let span = Self::span("backward", p, kind);
        let _entered = span.enter();
        let mut args: Vec<Arg> = res.inputs.iter().map(|t| Arg::Id(t.id())).collect();
        args.extend(index_tables(&spec, p)?.into_iter().map(Arg::Upload));
        args.extend(res.h.iter().map(|t| Arg::Id(t.id())));
        args.push(Arg::Id(c.d_o.id()));
        args.extend(c.dht.iter().map(|t| Arg::Id(t.id())));
        let (infos, cached) = self.run_kernel(&spec, kind, args)?;
        span.record("cache", if cached { "hit" } else { "miss" });
        self.gradients(p, &mut self.wrap(infos).into_iter())
    }

    /// The fused forward+VJP on device tensors: one program, outputs and gradients on the device.
    pub fn forward_and_vjp_device(
        &self,
        x: &DeviceInputs,
        c: &DeviceCotangents,
        strategy: BackwardStrategy,
    ) -> kda_core::Result<(DeviceOutputs, DeviceGradients)> {
        let (p, spec) = self.validate_device(x, c.dht.is_some())?;
        self.check_cotangents(&p, c)?;
        let kind = ProgramKind::Fused(strategy);
        let span = Self::span("fused", &p, kind);
        let _entered = span.enter();
        let mut args: Vec<Arg> = x.args().into_iter().map(|(_, t)| Arg::Id(t.id())).collect();
        args.extend(index_tables(&spec, &p)?.into_iter().map(Arg::Upload));
        args.push(Arg::Id(c.d_o.id()));
        args.extend(c.dht.iter().map(|t| Arg::Id(t.id())));
        let (infos, cached) = self.run_kernel(&spec, kind, args)?;
        span.record("cache", if cached { "hit" } else { "miss" });
        let mut outs = self.wrap(infos).into_iter();
        let out = self.outputs(&p, &mut outs)?;
        Ok((out, self.gradients(&p, &mut outs)?))
    }

    pub(crate) fn outputs(
        &self,
        p: &Problem,
        outs: &mut impl Iterator<Item = DeviceTensor>,
    ) -> kda_core::Result<DeviceOutputs> {
        let d = &p.dims;
        let o = outs.next().ok_or_else(|| too_few("o"))?;
        let o = o.reshaped(&p.layout.token_shape(d.h, d.b, d.t, d.v))?.with_layout(p.layout);
        let final_state = if p.output_final_state {
            Some(outs.next().ok_or_else(|| too_few("final_state"))?.reshaped(&d.state_shape())?)
        } else {
            None
        };
        Ok(DeviceOutputs { o, final_state })
    }

    pub(crate) fn gradients(
        &self,
        p: &Problem,
        outs: &mut impl Iterator<Item = DeviceTensor>,
    ) -> kda_core::Result<DeviceGradients> {
        let (lay, d) = (p.layout, &p.dims);
        let (tk, tv) = (lay.token_shape(d.h, d.b, d.t, d.k), lay.token_shape(d.h, d.b, d.t, d.v));
        let mut next = |name: &str, shape: &[usize]| -> kda_core::Result<DeviceTensor> {
            outs.next().ok_or_else(|| too_few(name))?.reshaped(shape)
        };
        let dq = next("dq", &tk)?.with_layout(lay);
        let dk = next("dk", &tk)?.with_layout(lay);
        let dv = next("dv", &tv)?.with_layout(lay);
        let dg = next("dg", &tk)?.with_layout(lay);
        let dbeta = next("dbeta", &p.beta_shape)?.with_layout(lay);
        let dh0 = if p.has_initial_state { Some(next("dh0", &d.state_shape())?) } else { None };
        let (mut da_log, mut ddt_bias) = (None, None);
        if p.gate != GateKind::Preactivated {
            da_log = Some(next("da_log", &[d.h])?);
            if p.has_dt_bias {
                ddt_bias = Some(next("ddt_bias", &[d.h * d.k])?);
            }
        }
        Ok(DeviceGradients { dq, dk, dv, dg, dbeta, dh0, da_log, ddt_bias })
    }
}

fn too_few(name: &str) -> KdaError {
    KdaError::backend("execute", "a program output per result", format!("no output for {name}"))
}

/// A tensor of a call that runs on device `device`: anywhere else is an error naming both.
pub(crate) fn check_on(t: &DeviceTensor, arg: &str, device: usize) -> kda_core::Result<()> {
    if t.device() == device {
        return Ok(());
    }
    let hint = if device == 0 {
        " (one-device calls run there; per-device tensors go to the *_data_parallel calls)"
    } else {
        " (its shard's device)"
    };
    Err(KdaError::value(
        arg,
        format!("a tensor on device {device}{hint}"),
        format!("a tensor on device {}", t.device()),
    ))
}
