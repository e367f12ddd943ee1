//! The three operations, one call each: [`PjrtBackend::forward`], [`PjrtBackend::backward`]
//! and [`PjrtBackend::forward_and_vjp`] run where their tensors live: host tensors (spread over
//! the handle's devices as [`Split`] says), device tensors on any one device, or one shard per
//! device (data parallel). Every form ends in the same three steps below ([`PjrtBackend::launch`]).

use kda_core::{
    validate_cotangent_shapes, Backend, BackwardStrategy, Cotangents, DType, GateKind, HostTensor, KdaError,
    KdaGradients, KdaInputs, KdaOutputs, Layout, Problem, Result, Tensors,
};

use super::handle::supported;
use super::handle::{e, PjrtBackend, Upload};
use super::io::{DeviceCotangents, DeviceGradients, DeviceInputs, DeviceOutputs};
use super::launch::{check_on, tensor_args, Arg, Bound, Named, Part};
use super::options::Split;
use super::residuals::{Gradtypes, Held, Piece, PjrtResiduals};
use super::tensor::{DeviceTensor, Meta};
use crate::op::{ProgramKind, ProgramSpec};
use kda_packed::{join_problems, RowPlan};

/// Keeps [`CallInputs`] and [`CallCotangents`] to this crate's records.
pub trait Sealed {}
impl<T> Sealed for KdaInputs<T> {}
impl<T> Sealed for Cotangents<T> {}
impl<T> Sealed for [T] {}
impl<T> Sealed for Vec<T> {}

/// Inputs a call can run on, and what it returns for them: host [`KdaInputs`] (host results),
/// [`DeviceInputs`] on one device (results there), or a slice or `Vec` of `DeviceInputs`, one
/// shard per device in device order (each device's results there).
pub trait CallInputs: Sealed {
    /// What the forward returns.
    type Outputs;
    /// The cotangents of a fused call.
    type Cotangents: ?Sized;
    /// What the fused call's VJP returns.
    type Gradients;
    #[doc(hidden)]
    fn forward(
        b: &PjrtBackend,
        x: &Self,
        strategy: BackwardStrategy,
    ) -> Result<(Self::Outputs, PjrtResiduals)>;
    #[doc(hidden)]
    fn forward_and_vjp(
        b: &PjrtBackend,
        x: &Self,
        c: &Self::Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(Self::Outputs, Self::Gradients)>;
}

/// Cotangents a backward can take: host [`Cotangents`] (for residuals of any form; host
/// gradients), [`DeviceCotangents`] (one device's residuals) or one per device (data parallel).
pub trait CallCotangents: Sealed {
    /// What the backward returns.
    type Gradients;
    #[doc(hidden)]
    fn backward(b: &PjrtBackend, res: &PjrtResiduals, c: &Self) -> Result<Self::Gradients>;
}

impl PjrtBackend {
    /// The forward, where `x` lives; the residuals stay on the devices that ran it.
    pub fn forward<X: CallInputs + ?Sized>(
        &self,
        x: &X,
        strategy: BackwardStrategy,
    ) -> Result<(X::Outputs, PjrtResiduals)> {
        X::forward(self, x, strategy)
    }

    /// The backward from a forward's residuals (borrowed: a second backward may reuse them).
    pub fn backward<C: CallCotangents + ?Sized>(&self, res: &PjrtResiduals, c: &C) -> Result<C::Gradients> {
        C::backward(self, res, c)
    }

    /// The fused forward+VJP in one program, where `x` and `c` live.
    pub fn forward_and_vjp<X: CallInputs + ?Sized>(
        &self,
        x: &X,
        c: &X::Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(X::Outputs, X::Gradients)> {
        X::forward_and_vjp(self, x, c, strategy)
    }
}

fn span(op: &'static str, p: &Problem, kind: ProgramKind, devices: usize) -> tracing::Span {
    let d = &p.dims;
    let strategy = match kind {
        ProgramKind::Forward(s) | ProgramKind::Fused(s) | ProgramKind::Backward(s) => s.name(),
    };
    tracing::info_span!(
        "kda_call",
        op,
        kind = ?kind,
        strategy,
        devices,
        shape = %format_args!("H{} B{} T{} K{} V{} N{}", d.h, d.b, d.t, d.k, d.v, d.n),
        packed = p.segments.is_packed(),
        dtype = %p.dtype,
        cache = tracing::field::Empty,
    )
}

fn take(named: &mut Named, name: &str) -> Result<DeviceTensor> {
    let i = named.iter().position(|(n, _)| *n == name).ok_or_else(|| {
        KdaError::backend("execute", "a program output per result", format!("no output for {name}"))
    })?;
    Ok(named.remove(i).1)
}

/// A program's `o [final_state]`, shaped as the caller's tensors.
fn outputs(p: &Problem, named: &mut Named) -> Result<DeviceOutputs> {
    let d = &p.dims;
    let o = take(named, "o")?.reshaped(&p.layout.token_shape(d.h, d.b, d.t, d.v))?.with_layout(p.layout);
    let final_state = match p.output_final_state {
        true => Some(take(named, "final_state")?.reshaped(&d.state_shape())?),
        false => None,
    };
    Ok(DeviceOutputs { o, final_state })
}

/// A program's gradients, shaped as their inputs.
fn gradients(p: &Problem, named: &mut Named) -> Result<DeviceGradients> {
    let (lay, d) = (p.layout, &p.dims);
    let (tk, tv) = (lay.token_shape(d.h, d.b, d.t, d.k), lay.token_shape(d.h, d.b, d.t, d.v));
    let mut next = |name: &str, shape: &[usize]| take(named, name)?.reshaped(shape);
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

impl PjrtBackend {
    /// The forward on every part; each part's outputs and residuals stay on its device. A
    /// program that returns `h0` (the entering states a context-parallel piece found) has its
    /// backward read them in place of the given ones.
    pub(crate) fn forward_parts(
        &self,
        spec: &ProgramSpec,
        strategy: BackwardStrategy,
        split: Split,
        parts: Vec<Part>,
    ) -> Result<Vec<(DeviceOutputs, Piece)>> {
        let kind = ProgramKind::Forward(strategy);
        let span = span("forward", &parts[0].problem, kind, parts.len());
        let _entered = span.enter();
        let mut kept: Vec<Named> = Vec::with_capacity(parts.len());
        let mut meta = Vec::with_capacity(parts.len());
        let mut binds = Vec::with_capacity(parts.len());
        for part in parts {
            let k = part
                .args
                .iter()
                .filter_map(|(n, a)| match a {
                    Arg::Tensor(t) => Some((*n, t.clone())),
                    Arg::Upload(_) => None,
                })
                .collect();
            kept.push(k);
            meta.push((part.device, part.problem));
            binds.push(part.args);
        }
        let bound: Vec<Bound<'_>> = meta
            .iter()
            .zip(binds)
            .map(|((device, problem), args)| Bound { device: *device, problem, args })
            .collect();
        let results = self.launch(spec, kind, split, bound)?;
        let mut out = Vec::with_capacity(results.len());
        for ((mut named, (device, problem)), mut kept) in results.into_iter().zip(meta).zip(kept) {
            let o = outputs(&problem, &mut named)?;
            if strategy == BackwardStrategy::SavedState {
                kept.push(("h", take(&mut named, "h")?));
            }
            if let Some(i) = named.iter().position(|(n, _)| *n == "h0") {
                let d = &problem.dims;
                let h0 = named.remove(i).1.reshaped(&[d.b, d.n, d.h, d.k, d.v])?;
                kept.retain(|(n, _)| *n != "h0");
                kept.push(("h0", h0));
            }
            out.push((o, Piece { problem, device, kept }));
        }
        Ok(out)
    }

    /// The backward of `pieces` with each device's cotangent arguments (and any other
    /// arguments of the form, `extra`).
    pub(crate) fn backward_parts(
        &self,
        res: &PjrtResiduals,
        split: Split,
        cotangents: Vec<Vec<(&'static str, Arg)>>,
    ) -> Result<Vec<DeviceGradients>> {
        let pieces = res.pieces();
        let mut spec = res.spec.clone();
        spec.options.has_dht = cotangents.first().is_some_and(|c| c.iter().any(|(n, _)| *n == "dht"));
        let kind = ProgramKind::Backward(res.strategy);
        let span = span("backward", &res.problem, kind, pieces.len());
        let _entered = span.enter();
        let bound = pieces
            .iter()
            .zip(cotangents)
            .map(|(p, c)| {
                let mut args: Vec<(&'static str, Arg)> =
                    p.kept.iter().map(|(n, t)| (*n, Arg::Tensor(t.clone()))).collect();
                args.extend(c);
                Bound { device: p.device, problem: &p.problem, args }
            })
            .collect();
        let results = self.launch(&spec, kind, split, bound)?;
        results.into_iter().zip(pieces).map(|(mut named, p)| gradients(&p.problem, &mut named)).collect()
    }

    /// The fused forward+VJP on every part.
    pub(crate) fn fused_parts(
        &self,
        spec: &ProgramSpec,
        strategy: BackwardStrategy,
        split: Split,
        parts: Vec<Part>,
    ) -> Result<Vec<(DeviceOutputs, DeviceGradients)>> {
        let kind = ProgramKind::Fused(strategy);
        let span = span("fused", &parts[0].problem, kind, parts.len());
        let _entered = span.enter();
        let problems: Vec<Problem> = parts.iter().map(|p| p.problem.clone()).collect();
        let binds = parts
            .into_iter()
            .zip(&problems)
            .map(|(p, problem)| Bound { device: p.device, problem, args: p.args })
            .collect();
        let results = self.launch(spec, kind, split, binds)?;
        results
            .into_iter()
            .zip(&problems)
            .map(|(mut named, p)| Ok((outputs(p, &mut named)?, gradients(p, &mut named)?)))
            .collect()
    }

    /// Checks device inputs that must all live on `device` (handle, layout tags, shapes,
    /// dtypes) and returns the problem and the spec of its programs.
    pub(crate) fn validate_on(
        &self,
        device: usize,
        x: &DeviceInputs,
        has_dht: bool,
    ) -> Result<(Problem, ProgramSpec)> {
        for (name, t) in x.named() {
            t.check_owner(self.shared(), name).map_err(e)?;
            check_on(t, name, device)?;
            if let (Some(l), true) = (t.layout(), ["q", "k", "v", "g", "beta"].contains(&name)) {
                if l != x.config.layout {
                    return Err(KdaError::value(
                        name,
                        format!("a {} tensor (the config's layout)", layout_name(x.config.layout)),
                        format!("a tensor tagged {}", layout_name(l)),
                    ));
                }
            }
        }
        let meta: KdaInputs<Meta> = x.try_map(&mut |name, t| t.meta(name).map_err(e))?;
        let p = meta.view().validate()?;
        supported(&p)?;
        let want = |name: &str, t: &DeviceTensor, dtype: DType, why: &str| -> Result<()> {
            match t.dtype() {
                d if d == dtype => Ok(()),
                d => Err(KdaError::dtype(name, format!("{dtype} ({why})"), d.to_string())),
            }
        };
        want("beta", &x.beta, p.dtype, "q's dtype on the device")?;
        for (name, t) in x.named() {
            if ["initial_state", "a_log", "dt_bias"].contains(&name) {
                want(name, t, DType::F32, "states and gate parameters are f32 on the device")?;
            }
        }
        let g_dtype = x.g.dtype();
        if g_dtype == DType::F64 {
            return Err(KdaError::dtype("g", "f32 or bf16", "f64"));
        }
        let spec = self.spec(&p, has_dht)?.with_g_dtype(g_dtype);
        Ok((p, spec))
    }

    /// Checks device cotangents against a problem, on `device`.
    pub(crate) fn check_cotangents_on(&self, device: usize, p: &Problem, c: &DeviceCotangents) -> Result<()> {
        for (name, t) in c.named() {
            t.check_owner(self.shared(), name).map_err(e)?;
            check_on(t, name, device)?;
        }
        let meta: Cotangents<Meta> = c.try_map(&mut |name, t| t.meta(name).map_err(e))?;
        validate_cotangent_shapes(p, &meta.d_o, meta.dht.as_ref())?;
        if c.d_o.dtype() != p.dtype {
            return Err(KdaError::dtype("do", format!("{} like q", p.dtype), c.d_o.dtype().to_string()));
        }
        if let Some(t) = &c.dht {
            if t.dtype() != DType::F32 {
                return Err(KdaError::dtype("dht", "f32", t.dtype().to_string()));
            }
        }
        Ok(())
    }

    /// Host cotangents checked against `p` and uploaded to `device` for one run: `do` in the
    /// problem's dtype, `dht` in f32.
    pub(crate) fn cotangent_args(
        &self,
        c: &Cotangents,
        p: &Problem,
        device: usize,
    ) -> Result<Vec<(&'static str, Arg)>> {
        validate_cotangent_shapes(p, &c.d_o, c.dht.as_ref())?;
        let f32: fn(&HostTensor) -> Upload = Upload::f32;
        let d_o: fn(&HostTensor) -> Upload = match p.dtype {
            DType::BF16 => |t| Upload::cast(t, DType::BF16),
            _ => |t| Upload::cast(t, DType::F32),
        };
        let mut ups = vec![(&c.d_o, d_o, None)];
        ups.extend(c.dht.as_ref().map(|t| (t, f32, None)));
        let ts = self.upload_each(device, ups, || c.check_values())?;
        Ok(["do", "dht"].into_iter().zip(ts).map(|(n, t)| (n, Arg::Tensor(t))).collect())
    }

    /// One shard per device, all of one shape: their parts and the shared spec.
    fn shard_parts(&self, xs: &[DeviceInputs], has_dht: bool) -> Result<(Vec<Part>, ProgramSpec)> {
        let n = self.device_count();
        if xs.len() != n {
            return Err(KdaError::value(
                "inputs",
                format!("one shard per device ({n})"),
                format!("{} shards", xs.len()),
            ));
        }
        let mut parts: Vec<Part> = Vec::with_capacity(n);
        let mut first: Option<ProgramSpec> = None;
        for (d, x) in xs.iter().enumerate() {
            let (p, spec) = self.validate_on(d, x, has_dht)?;
            match &first {
                None => first = Some(spec),
                Some(s0) if *s0 == spec => {}
                Some(_) => {
                    let dims = |p: &Problem| {
                        let d = &p.dims;
                        format!("H{} B{} T{} K{} V{} N{}, {}", d.h, d.b, d.t, d.k, d.v, d.n, p.dtype)
                    };
                    return Err(KdaError::shape(
                        "inputs",
                        format!("every shard shaped as device 0's ({})", dims(&parts[0].problem)),
                        format!("device {d}: {}", dims(&p)),
                    ));
                }
            }
            parts.push(Part { device: d, problem: p, args: tensor_args(x) });
        }
        let spec = first.ok_or_else(|| KdaError::value("inputs", "one shard per device", "none"))?;
        Ok((parts, spec))
    }
}

fn layout_name(l: Layout) -> &'static str {
    match l {
        Layout::HeadFirst => "head-first",
        Layout::BatchFirst => "batch-first",
    }
}

fn one_device(
    problem: Problem,
    spec: ProgramSpec,
    strategy: BackwardStrategy,
    piece: Piece,
) -> PjrtResiduals {
    PjrtResiduals { problem, strategy, spec, host_types: None, held: Held::One(piece) }
}

impl CallInputs for KdaInputs {
    type Outputs = KdaOutputs;
    type Cotangents = Cotangents;
    type Gradients = KdaGradients;

    fn forward(b: &PjrtBackend, x: &Self, strategy: BackwardStrategy) -> Result<(KdaOutputs, PjrtResiduals)> {
        if b.device_count() > 1 {
            return match b.split {
                Split::Data => b.forward_rows(x, strategy),
                Split::Context => b.forward_cp(x, strategy),
            };
        }
        let dev = b.to_device(x, 0)?;
        let (out, mut res) = DeviceInputs::forward(b, &dev, strategy)?;
        res.host_types = Some(Gradtypes::of(x));
        Ok((b.to_host(&out)?, res))
    }

    fn forward_and_vjp(
        b: &PjrtBackend,
        x: &Self,
        c: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        if b.device_count() > 1 {
            return match b.split {
                Split::Data => b.forward_and_vjp_rows(x, c, strategy),
                Split::Context => b.forward_and_vjp_cp(x, c, strategy),
            };
        }
        let dev = b.to_device(x, 0)?;
        let (p, spec) = b.validate_on(0, &dev, c.dht.is_some())?;
        let mut args = tensor_args(&dev);
        args.extend(b.cotangent_args(c, &p, 0)?);
        let mut results =
            b.fused_parts(&spec, strategy, Split::Data, vec![Part { device: 0, problem: p, args }])?;
        let (out, grads) =
            results.pop().ok_or_else(|| KdaError::backend("fused", "one device's results", "none"))?;
        Ok((b.to_host(&out)?, Gradtypes::apply(Some(Gradtypes::of(x)), b.to_host(&grads)?)?))
    }
}

impl CallInputs for DeviceInputs {
    type Outputs = DeviceOutputs;
    type Cotangents = DeviceCotangents;
    type Gradients = DeviceGradients;

    fn forward(
        b: &PjrtBackend,
        x: &Self,
        strategy: BackwardStrategy,
    ) -> Result<(DeviceOutputs, PjrtResiduals)> {
        let device = x.q.device();
        let (p, spec) = b.validate_on(device, x, false)?;
        let part = Part { device, problem: p.clone(), args: tensor_args(x) };
        let (out, piece) = b
            .forward_parts(&spec, strategy, Split::Data, vec![part])?
            .pop()
            .ok_or_else(|| KdaError::backend("forward", "one device's results", "none"))?;
        Ok((out, one_device(p, spec, strategy, piece)))
    }

    fn forward_and_vjp(
        b: &PjrtBackend,
        x: &Self,
        c: &DeviceCotangents,
        strategy: BackwardStrategy,
    ) -> Result<(DeviceOutputs, DeviceGradients)> {
        let device = x.q.device();
        let (p, spec) = b.validate_on(device, x, c.dht.is_some())?;
        b.check_cotangents_on(device, &p, c)?;
        let mut args = tensor_args(x);
        args.extend(tensor_args(c));
        b.fused_parts(&spec, strategy, Split::Data, vec![Part { device, problem: p, args }])?
            .pop()
            .ok_or_else(|| KdaError::backend("fused", "one device's results", "none"))
    }
}

impl CallInputs for [DeviceInputs] {
    type Outputs = Vec<DeviceOutputs>;
    type Cotangents = [DeviceCotangents];
    type Gradients = Vec<DeviceGradients>;

    fn forward(
        b: &PjrtBackend,
        xs: &Self,
        strategy: BackwardStrategy,
    ) -> Result<(Vec<DeviceOutputs>, PjrtResiduals)> {
        let (parts, spec) = b.shard_parts(xs, false)?;
        let problem = join_problems(parts.iter().map(|p| &p.problem))?;
        let per = parts[0].problem.dims.b;
        let results = b.forward_parts(&spec, strategy, Split::Data, parts)?;
        let (outs, shards): (Vec<_>, Vec<_>) = results.into_iter().unzip();
        let plan = RowPlan::new(per * shards.len(), shards.len());
        Ok((
            outs,
            PjrtResiduals { problem, strategy, spec, host_types: None, held: Held::Rows { plan, shards } },
        ))
    }

    fn forward_and_vjp(
        b: &PjrtBackend,
        xs: &Self,
        cs: &[DeviceCotangents],
        strategy: BackwardStrategy,
    ) -> Result<(Vec<DeviceOutputs>, Vec<DeviceGradients>)> {
        let has_dht = shard_dht(cs, xs.len())?;
        let (mut parts, spec) = b.shard_parts(xs, has_dht)?;
        for (part, c) in parts.iter_mut().zip(cs) {
            b.check_cotangents_on(part.device, &part.problem, c)?;
            part.args.extend(tensor_args(c));
        }
        Ok(b.fused_parts(&spec, strategy, Split::Data, parts)?.into_iter().unzip())
    }
}

/// Whether one cotangent per device all carry `dht` (none or all may).
fn shard_dht(cs: &[DeviceCotangents], n: usize) -> Result<bool> {
    if cs.len() != n {
        return Err(KdaError::value("cotangents", format!("one per device ({n})"), cs.len().to_string()));
    }
    let some = cs.iter().any(|c| c.dht.is_some());
    if some != cs.iter().all(|c| c.dht.is_some()) {
        return Err(KdaError::value("dht", "on every device or on none", "on some"));
    }
    Ok(some)
}

/// A `Vec` of records calls as its slice.
impl<T> CallInputs for Vec<T>
where
    [T]: CallInputs,
{
    type Outputs = <[T] as CallInputs>::Outputs;
    type Cotangents = <[T] as CallInputs>::Cotangents;
    type Gradients = <[T] as CallInputs>::Gradients;

    fn forward(
        b: &PjrtBackend,
        xs: &Self,
        strategy: BackwardStrategy,
    ) -> Result<(Self::Outputs, PjrtResiduals)> {
        <[T]>::forward(b, xs, strategy)
    }

    fn forward_and_vjp(
        b: &PjrtBackend,
        xs: &Self,
        cs: &Self::Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(Self::Outputs, Self::Gradients)> {
        <[T]>::forward_and_vjp(b, xs, cs, strategy)
    }
}

impl CallCotangents for Cotangents {
    type Gradients = KdaGradients;

    fn backward(b: &PjrtBackend, res: &PjrtResiduals, c: &Self) -> Result<KdaGradients> {
        match &res.held {
            Held::One(piece) => {
                let args = b.cotangent_args(c, &res.problem, piece.device)?;
                let grads = b.backward_parts(res, Split::Data, vec![args])?;
                let g = grads
                    .first()
                    .ok_or_else(|| KdaError::backend("backward", "one device's results", "none"))?;
                Gradtypes::apply(res.host_types, b.to_host(g)?)
            }
            Held::Rows { plan, .. } => b.backward_rows(res, *plan, c),
            Held::Pieces { plan, .. } => b.backward_cp(res, plan, c),
        }
    }
}

impl CallCotangents for DeviceCotangents {
    type Gradients = DeviceGradients;

    fn backward(b: &PjrtBackend, res: &PjrtResiduals, c: &Self) -> Result<DeviceGradients> {
        let Held::One(piece) = &res.held else {
            return Err(KdaError::value(
                "cotangents",
                "one per device (a slice or Vec) for residuals of a call over several devices",
                "one device's cotangents",
            ));
        };
        b.check_cotangents_on(piece.device, &piece.problem, c)?;
        b.backward_parts(res, Split::Data, vec![tensor_args(c)])?
            .pop()
            .ok_or_else(|| KdaError::backend("backward", "one device's results", "none"))
    }
}

impl CallCotangents for [DeviceCotangents] {
    type Gradients = Vec<DeviceGradients>;

    fn backward(b: &PjrtBackend, res: &PjrtResiduals, cs: &Self) -> Result<Vec<DeviceGradients>> {
        let Held::Rows { shards, .. } = &res.held else {
            return Err(KdaError::value(
                "cotangents",
                "device cotangents per device only for residuals of a forward on one shard per device",
                "residuals of another form",
            ));
        };
        shard_dht(cs, shards.len())?;
        let mut args = Vec::with_capacity(cs.len());
        for (piece, c) in shards.iter().zip(cs) {
            b.check_cotangents_on(piece.device, &piece.problem, c)?;
            args.push(tensor_args(c));
        }
        b.backward_parts(res, Split::Data, args)
    }
}

/// A `Vec` of cotangents calls as its slice.
impl<T> CallCotangents for Vec<T>
where
    [T]: CallCotangents,
{
    type Gradients = <[T] as CallCotangents>::Gradients;

    fn backward(b: &PjrtBackend, res: &PjrtResiduals, cs: &Self) -> Result<Self::Gradients> {
        <[T]>::backward(b, res, cs)
    }
}

/// `kda_core::Backend`: the host-tensor calls above.
impl Backend for PjrtBackend {
    type Residuals = PjrtResiduals;

    fn name(&self) -> String {
        match self.tuning.implementation {
            i if i == crate::Implementation::default() => format!("pjrt-{}", self.platform()),
            other => format!("pjrt-{}-{}", self.platform(), other.name()),
        }
    }

    fn supports(&self, p: &Problem) -> Result<()> {
        supported(p)
    }

    fn forward(&self, inputs: &KdaInputs, strategy: BackwardStrategy) -> Result<(KdaOutputs, PjrtResiduals)> {
        PjrtBackend::forward(self, inputs, strategy)
    }

    fn backward(&self, res: PjrtResiduals, cot: &Cotangents) -> Result<KdaGradients> {
        PjrtBackend::backward(self, &res, cot)
    }

    fn forward_and_vjp(
        &self,
        inputs: &KdaInputs,
        cot: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        PjrtBackend::forward_and_vjp(self, inputs, cot, strategy)
    }
}
