//! Context parallelism for the host `Backend` calls ([`super::Split::Context`]): every row's
//! aligned chunks cut into one contiguous piece per device ([`kda_packed::PiecePlan`]), each
//! device given only its piece's tokens as a packed problem of its own, and one program per
//! call ([`crate::op::context_parallel`]) that hands each piece its true entering state
//! and ending `dh`. Results go back to the caller's token and segment positions.

use std::sync::Arc;

use kda_core::{
    validate_cotangent_shapes, BackwardStrategy, Cotangents, DType, HostTensor, KdaError, KdaGradients,
    KdaInputs, KdaOutputs, Problem, Result,
};
use kda_packed::PiecePlan;

use super::handle::{e, HostData, PjrtBackend, Upload};
use super::io::{DeviceGradients, DeviceOutputs};
use super::launch::{Arg, Part};
use super::options::Split;
use super::residuals::{ContextPlan, Gradtypes, Held, PjrtResiduals};
use crate::op::context_parallel::CP_ARGS;

/// Device `d`'s `cont` `[B]`, `carry` `[B, N]` and `piece` `[D]` (see `CP_ARGS`).
fn cp_args(plan: &ContextPlan, d: usize) -> Vec<(&'static str, Arg)> {
    let pieces = &plan.pieces;
    let (b, n, devices) = (pieces.parts.len(), pieces.n, plan.devices());
    let mut cont = vec![0f32; b];
    let mut carry = vec![0f32; b * n];
    for (row, parts) in pieces.parts.iter().enumerate() {
        let parts = &parts[d];
        if parts.first().is_some_and(|p| !p.starts) {
            cont[row] = 1.0;
        }
        if let Some((i, _)) = parts.iter().enumerate().next_back().filter(|(_, p)| !p.ends) {
            carry[row * n + i] = 1.0;
        }
    }
    let mut piece = vec![0f32; devices];
    piece[d] = 1.0;
    let ups = [
        Upload { data: HostData::F32(cont), dims: vec![b as i64] },
        Upload { data: HostData::F32(carry), dims: vec![b as i64, n as i64] },
        Upload { data: HostData::F32(piece), dims: vec![devices as i64] },
    ];
    CP_ARGS.into_iter().zip(ups.into_iter().map(Arg::Upload)).collect()
}

impl PjrtBackend {
    fn context_plan(&self, x: &KdaInputs, has_dht: bool) -> Result<(Problem, Arc<ContextPlan>)> {
        let p = x.view().validate()?;
        super::handle::supported(&p)?;
        x.check_values()?;
        let (pieces, locals) = PiecePlan::split(&p, self.device_count())?;
        let g_dtype = if x.g.dtype() == DType::BF16 { DType::BF16 } else { DType::F32 };
        let spec =
            crate::op::context_parallel::local_spec(&locals[0], has_dht, self.tuning, g_dtype).map_err(e)?;
        Ok((p, Arc::new(ContextPlan { pieces, locals, spec })))
    }

    /// Device `d`'s inputs by program name (`h0`: the starting segments' states).
    fn local_inputs(
        &self,
        x: &KdaInputs,
        p: &Problem,
        plan: &ContextPlan,
        d: usize,
    ) -> Result<Vec<(&'static str, Upload)>> {
        let lay = p.layout;
        let tok = |t: &HostTensor| plan.pieces.local_tokens(t, lay, d);
        let beta = tok(&x.beta)?;
        let mut ups = vec![
            ("q", Upload::owned(tok(&x.q)?)),
            ("k", Upload::owned(tok(&x.k)?)),
            ("v", Upload::owned(tok(&x.v)?)),
            ("g", Upload::owned(tok(&x.g)?)),
            ("beta", Upload::owned_as(beta, p.dtype)),
            ("h0", Upload::owned(plan.pieces.local_states(x.initial_state.as_ref(), d, true, p)?)),
        ];
        if let Some((a_log, dt)) = x.gate.params() {
            let a_log = a_log.ok_or_else(|| KdaError::missing("a_log", "an in-kernel gate needs a_log"))?;
            ups.push(("a_log", Upload::f32(a_log)));
            ups.extend(dt.map(|t| ("dt_bias", Upload::f32(t))));
        }
        Ok(ups)
    }

    fn local_cotangents(
        &self,
        c: &Cotangents,
        p: &Problem,
        plan: &ContextPlan,
        d: usize,
    ) -> Result<Vec<(&'static str, Arg)>> {
        let d_o = plan.pieces.local_tokens(&c.d_o, p.layout, d)?;
        let dht = plan.pieces.local_states(c.dht.as_ref(), d, false, p)?;
        Ok(vec![
            ("do", Arg::Upload(Upload::owned_as(d_o, p.dtype))),
            ("dht", Arg::Upload(Upload::owned(dht))),
        ])
    }

    fn gather_outputs(&self, p: &Problem, plan: &ContextPlan, outs: &[DeviceOutputs]) -> Result<KdaOutputs> {
        let d = p.dims;
        let mut o = HostTensor::try_zeros(&p.layout.token_shape(d.h, d.b, d.t, d.v), p.dtype)?;
        let mut fin = HostTensor::try_zeros(&d.state_shape(), DType::F32)?;
        for (dev, host) in self.to_host(&outs.to_vec())?.iter().enumerate() {
            plan.pieces.place_tokens(&host.o, dev, p.layout, &mut o)?;
            if let Some(f) = &host.final_state {
                plan.pieces.place_states(f, dev, false, &mut fin)?;
            }
        }
        Ok(KdaOutputs { o, final_state: p.output_final_state.then_some(fin) })
    }

    fn gather_gradients(
        &self,
        p: &Problem,
        plan: &ContextPlan,
        types: Option<Gradtypes>,
        grads: &[DeviceGradients],
    ) -> Result<KdaGradients> {
        let host = Gradtypes::download(self, types, grads)?;
        let first = host.first().ok_or_else(|| KdaError::backend("gather", "one device or more", "none"))?;
        let d = p.dims;
        let token = |f: fn(&KdaGradients) -> &HostTensor, width: usize| -> Result<HostTensor> {
            let mut shape = p.layout.token_shape(d.h, d.b, d.t, width);
            if width == 0 {
                shape = p.beta_shape.clone();
            }
            let mut out = HostTensor::try_zeros(&shape, f(first).dtype())?;
            for (dev, g) in host.iter().enumerate() {
                plan.pieces.place_tokens(f(g), dev, p.layout, &mut out)?;
            }
            Ok(out)
        };
        let dh0 = if p.has_initial_state {
            let mut out = HostTensor::try_zeros(&d.state_shape(), DType::F32)?;
            for (dev, g) in host.iter().enumerate() {
                if let Some(t) = &g.dh0 {
                    plan.pieces.place_states(t, dev, true, &mut out)?;
                }
            }
            Some(out)
        } else {
            None
        };
        Ok(KdaGradients {
            dq: token(|g| &g.dq, d.k)?,
            dk: token(|g| &g.dk, d.k)?,
            dv: token(|g| &g.dv, d.v)?,
            dg: token(|g| &g.dg, d.k)?,
            dbeta: token(|g| &g.dbeta, 0)?,
            dh0,
            // All-reduced in the program.
            da_log: first.da_log.clone(),
            ddt_bias: first.ddt_bias.clone(),
        })
    }

    /// The fused forward+VJP with every row split into one piece per device.
    pub(crate) fn forward_and_vjp_cp(
        &self,
        x: &KdaInputs,
        c: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        let (p, plan) = self.context_plan(x, true)?;
        validate_cotangent_shapes(&p, &c.d_o, c.dht.as_ref())?;
        c.check_values()?;
        let mut parts = Vec::with_capacity(plan.devices());
        for (d, local) in plan.locals.iter().enumerate() {
            let mut args: Vec<(&'static str, Arg)> =
                self.local_inputs(x, &p, &plan, d)?.into_iter().map(|(n, u)| (n, Arg::Upload(u))).collect();
            args.extend(self.local_cotangents(c, &p, &plan, d)?);
            args.extend(cp_args(&plan, d));
            parts.push(Part { device: d, problem: local.clone(), args });
        }
        let (outs, grads): (Vec<_>, Vec<_>) =
            self.fused_parts(&plan.spec, strategy, Split::Context, parts)?.into_iter().unzip();
        let types = Some(Gradtypes::of(x));
        Ok((self.gather_outputs(&p, &plan, &outs)?, self.gather_gradients(&p, &plan, types, &grads)?))
    }

    /// The forward with every row split into pieces; each device keeps its piece's residuals
    /// (its inputs, with the entering states the program found as `h0`, and the saved states).
    pub(crate) fn forward_cp(
        &self,
        x: &KdaInputs,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, PjrtResiduals)> {
        let (p, plan) = self.context_plan(x, false)?;
        let mut parts = Vec::with_capacity(plan.devices());
        for (d, local) in plan.locals.iter().enumerate() {
            let (names, ups): (Vec<_>, Vec<_>) = self.local_inputs(x, &p, &plan, d)?.into_iter().unzip();
            let kept = self.upload_to(d, ups)?;
            let mut args: Vec<(&'static str, Arg)> =
                names.into_iter().zip(kept).map(|(n, t)| (n, Arg::Tensor(t))).collect();
            args.extend(cp_args(&plan, d));
            parts.push(Part { device: d, problem: local.clone(), args });
        }
        let (outs, pieces): (Vec<_>, Vec<_>) =
            self.forward_parts(&plan.spec, strategy, Split::Context, parts)?.into_iter().unzip();
        let out = self.gather_outputs(&p, &plan, &outs)?;
        let (spec, held) = (plan.spec.clone(), Held::Pieces { plan, shards: pieces });
        Ok((out, PjrtResiduals { problem: p, strategy, spec, host_types: Some(Gradtypes::of(x)), held }))
    }

    /// The backward of [`PjrtBackend::forward_cp`]'s residuals.
    pub(crate) fn backward_cp(
        &self,
        res: &PjrtResiduals,
        plan: &ContextPlan,
        c: &Cotangents,
    ) -> Result<KdaGradients> {
        let p = &res.problem;
        validate_cotangent_shapes(p, &c.d_o, c.dht.as_ref())?;
        c.check_values()?;
        let mut args = Vec::with_capacity(plan.devices());
        for d in 0..plan.devices() {
            let mut a = self.local_cotangents(c, p, plan, d)?;
            a.extend(cp_args(plan, d));
            args.push(a);
        }
        let grads = self.backward_parts(res, Split::Context, args)?;
        self.gather_gradients(p, plan, res.host_types, &grads)
    }
}
