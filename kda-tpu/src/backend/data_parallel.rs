//! Data parallelism for the host `Backend` calls of a handle with several devices
//! ([`super::PjrtOptions::devices`]): a batch's rows are spread over the devices in contiguous
//! blocks of `ceil(B / D)` rows, each row whole on one device (its segments never split); the
//! last blocks are padded with zero rows. Every device runs the same program, compiled once for
//! D replicas, on its own rows and index tables; the gate-parameter gradients are all-reduced
//! inside the program ([`crate::op::data_parallel_program`]). Results are gathered back
//! into the caller's batch order with the padding rows dropped. Zero rows with zero cotangents
//! contribute exactly nothing to any gradient, so the sums match the single-device program's.

use kda_core::{
    BackwardStrategy, Cotangents, DType, HostTensor, KdaError, KdaGradients, KdaInputs, KdaOutputs, Problem,
    Result, Tensors,
};

use super::handle::{PjrtBackend, Upload};
use super::launch::{arg_name, Arg, Part};
use super::options::Split;
use super::residuals::{Gradtypes, Held, PjrtResiduals};
use crate::op::ProgramSpec;
use kda_packed::{batch_axis, RowPlan};

/// One device's rows of the call's inputs, by program name: per-token tensors and `beta` (in
/// q's dtype) along the batch axis, initial states along theirs, gate parameters whole (f32).
fn shard_inputs(x: &KdaInputs, p: &Problem, plan: RowPlan, d: usize) -> Result<Vec<(&'static str, Upload)>> {
    let (ax, start, per) = (batch_axis(p.layout), plan.start(d), plan.per);
    let mut ups = Vec::new();
    for (name, t) in x.named() {
        let up = match name {
            "beta" => Upload::owned_as(t.slice_padded(ax, start, per)?, p.dtype),
            "initial_state" => Upload::f32(&t.slice_padded(0, start, per)?),
            "a_log" | "dt_bias" => Upload::f32(t),
            _ => Upload::owned(t.slice_padded(ax, start, per)?),
        };
        ups.push((arg_name(name), up));
    }
    Ok(ups)
}

/// One device's rows of the cotangents: `do` in the problem's dtype, `dht` in f32.
fn shard_cotangents(
    c: &Cotangents,
    p: &Problem,
    plan: RowPlan,
    d: usize,
) -> Result<Vec<(&'static str, Arg)>> {
    let (ax, start, per) = (batch_axis(p.layout), plan.start(d), plan.per);
    let mut ups = vec![("do", Arg::Upload(Upload::owned_as(c.d_o.slice_padded(ax, start, per)?, p.dtype)))];
    if let Some(dht) = &c.dht {
        ups.push(("dht", Arg::Upload(Upload::f32(&dht.slice_padded(0, start, per)?))));
    }
    Ok(ups)
}

impl PjrtBackend {
    /// The shared spec of every device's program (dims of one shard; g in its own dtype).
    fn shard_spec(&self, x: &KdaInputs, shard: &Problem, has_dht: bool) -> Result<ProgramSpec> {
        let g_dtype = if x.g.dtype() == DType::BF16 { DType::BF16 } else { DType::F32 };
        Ok(self.spec(shard, has_dht)?.with_g_dtype(g_dtype))
    }

    fn split_rows(&self, x: &KdaInputs) -> Result<(Problem, RowPlan, Vec<Problem>)> {
        let p = x.view().validate()?;
        super::handle::supported(&p)?;
        x.check_values()?;
        let plan = RowPlan::new(p.dims.b, self.device_count());
        let shards = (0..plan.devices).map(|d| plan.shard(&p, d)).collect::<Result<Vec<_>>>()?;
        Ok((p, plan, shards))
    }

    fn gather_outputs_rows(
        &self,
        p: &Problem,
        plan: RowPlan,
        outs: &[super::io::DeviceOutputs],
    ) -> Result<KdaOutputs> {
        let host = self.to_host(&outs.to_vec())?;
        let (o, fin): (Vec<_>, Vec<_>) = host.into_iter().map(|h| (h.o, h.final_state)).unzip();
        Ok(KdaOutputs { o: plan.gather(o, batch_axis(p.layout))?, final_state: plan.gather_opt(fin, 0)? })
    }

    fn gather_gradients_rows(
        &self,
        types: Option<Gradtypes>,
        p: &Problem,
        plan: RowPlan,
        grads: &[super::io::DeviceGradients],
    ) -> Result<KdaGradients> {
        let host = Gradtypes::download(self, types, grads)?;
        let ax = batch_axis(p.layout);
        let take = |f: fn(&KdaGradients) -> HostTensor| host.iter().map(f).collect::<Vec<_>>();
        let first = host.first().ok_or_else(|| KdaError::backend("gather", "one device or more", "none"))?;
        Ok(KdaGradients {
            dq: plan.gather(take(|g| g.dq.clone()), ax)?,
            dk: plan.gather(take(|g| g.dk.clone()), ax)?,
            dv: plan.gather(take(|g| g.dv.clone()), ax)?,
            dg: plan.gather(take(|g| g.dg.clone()), ax)?,
            dbeta: plan.gather(take(|g| g.dbeta.clone()), ax)?,
            dh0: plan.gather_opt(host.iter().map(|g| g.dh0.clone()).collect(), 0)?,
            // All-reduced in the program: every device holds the batch's total.
            da_log: first.da_log.clone(),
            ddt_bias: first.ddt_bias.clone(),
        })
    }

    /// The fused forward+VJP with the batch's rows spread over the handle's devices.
    pub(crate) fn forward_and_vjp_rows(
        &self,
        x: &KdaInputs,
        c: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        let (p, plan, shards) = self.split_rows(x)?;
        kda_core::validate_cotangent_shapes(&p, &c.d_o, c.dht.as_ref())?;
        c.check_values()?;
        let spec = self.shard_spec(x, &shards[0], c.dht.is_some())?;
        let mut parts = Vec::with_capacity(plan.devices);
        for (d, shard) in shards.into_iter().enumerate() {
            let mut args: Vec<(&'static str, Arg)> =
                shard_inputs(x, &p, plan, d)?.into_iter().map(|(n, u)| (n, Arg::Upload(u))).collect();
            args.extend(shard_cotangents(c, &p, plan, d)?);
            parts.push(Part { device: d, problem: shard, args });
        }
        let (outs, grads): (Vec<_>, Vec<_>) =
            self.fused_parts(&spec, strategy, Split::Data, parts)?.into_iter().unzip();
        Ok((
            self.gather_outputs_rows(&p, plan, &outs)?,
            self.gather_gradients_rows(Some(Gradtypes::of(x)), &p, plan, &grads)?,
        ))
    }

    /// The forward with the batch's rows spread over the devices; each device keeps its rows'
    /// residuals.
    pub(crate) fn forward_rows(
        &self,
        x: &KdaInputs,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, PjrtResiduals)> {
        let (p, plan, shards) = self.split_rows(x)?;
        let spec = self.shard_spec(x, &shards[0], false)?;
        let mut parts = Vec::with_capacity(plan.devices);
        for (d, shard) in shards.into_iter().enumerate() {
            let (names, ups): (Vec<_>, Vec<_>) = shard_inputs(x, &p, plan, d)?.into_iter().unzip();
            let kept = self.upload_to(d, ups)?;
            let args = names.into_iter().zip(kept).map(|(n, t)| (n, Arg::Tensor(t))).collect();
            parts.push(Part { device: d, problem: shard, args });
        }
        let (outs, pieces): (Vec<_>, Vec<_>) =
            self.forward_parts(&spec, strategy, Split::Data, parts)?.into_iter().unzip();
        let out = self.gather_outputs_rows(&p, plan, &outs)?;
        let held = Held::Rows { plan, shards: pieces };
        Ok((out, PjrtResiduals { problem: p, strategy, spec, host_types: Some(Gradtypes::of(x)), held }))
    }

    /// The backward of residuals held one shard of rows per device, from host cotangents.
    pub(crate) fn backward_rows(
        &self,
        res: &PjrtResiduals,
        plan: RowPlan,
        c: &Cotangents,
    ) -> Result<KdaGradients> {
        let p = &res.problem;
        kda_core::validate_cotangent_shapes(p, &c.d_o, c.dht.as_ref())?;
        c.check_values()?;
        let args = (0..plan.devices).map(|d| shard_cotangents(c, p, plan, d)).collect::<Result<Vec<_>>>()?;
        let grads = self.backward_parts(res, Split::Data, args)?;
        self.gather_gradients_rows(res.host_types, p, plan, &grads)
    }
}
