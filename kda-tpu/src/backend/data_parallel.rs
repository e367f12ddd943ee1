//! Data parallelism for the host `Backend` calls of a handle with several devices
//! ([`super::PjrtOptions::devices`]): a batch's rows are spread over the devices in contiguous
//! blocks of `ceil(B / D)` rows, each row whole on one device (its segments never split); the
//! last blocks are padded with zero rows. Every device runs the same program, compiled once for
//! D replicas, on its own rows and index tables; the gate-parameter gradients are all-reduced
//! inside the program ([`crate::kernels::data_parallel_program`]). Results are gathered back
//! into the caller's batch order with the padding rows dropped. Zero rows with zero cotangents
//! contribute exactly nothing to any gradient, so the sums match the single-device program's.

use kda_core::{
    validate_cotangent_shapes, BackwardStrategy, Cotangents, DType, HostTensor, KdaError, KdaGradients,
    KdaInputs, KdaOutputs, Layout, Problem, Result, SegmentTable,
};

use super::device::{index_tables, DeviceGradients, DeviceOutputs, PjrtResiduals};
use super::host::{gradtypes, Gradtypes};
use super::tensor::DeviceTensor;
use super::worker::Form;
use super::{e, Arg, PjrtBackend, Upload};
use crate::kernels::KernelSpec;
use crate::ProgramKind;

/// The batch axis of per-token tensors and `beta` in `layout` (states: axis 0).
fn batch_axis(layout: Layout) -> usize {
    match layout {
        Layout::HeadFirst => 1,
        Layout::BatchFirst => 0,
    }
}

/// How B rows spread over D devices: `per` rows each, the real ones first.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowPlan {
    pub(crate) devices: usize,
    pub(crate) per: usize,
    b: usize,
}

impl RowPlan {
    pub(crate) fn new(b: usize, devices: usize) -> Self {
        Self { devices, per: b.div_ceil(devices), b }
    }
    fn start(&self, d: usize) -> usize {
        d * self.per
    }
    /// How many of device `d`'s rows are real (the rest are padding).
    pub(crate) fn real(&self, d: usize) -> usize {
        self.b.saturating_sub(self.start(d)).min(self.per)
    }
}

/// Device `d`'s problem: `per` rows, the global N (so every device runs one program), its rows'
/// segments, and one whole-row segment for each padding row.
fn shard_problem(p: &Problem, plan: RowPlan, d: usize) -> Result<Problem> {
    let mut q = p.clone();
    q.dims.b = plan.per;
    q.beta_shape[batch_axis(p.layout)] = plan.per;
    let t = p.dims.t;
    q.segments = if p.segments.is_packed() {
        // A padding row: one whole-row segment, then empty ones up to N.
        let padding: Vec<_> = std::iter::once(0..t).chain(std::iter::repeat_n(t..t, p.dims.n - 1)).collect();
        let rows = (0..plan.per)
            .map(|i| p.segments.rows().get(plan.start(d) + i).cloned().unwrap_or_else(|| padding.clone()))
            .collect();
        SegmentTable::from_ranges(t, rows)?
    } else {
        SegmentTable::fixed(plan.per, t)
    };
    Ok(q)
}

/// How a tensor travels in `dtype` (as [`PjrtBackend::upload_inputs`] sends it).
fn in_dtype(t: HostTensor, dtype: DType) -> Upload {
    if t.dtype() == dtype {
        Upload::owned(t)
    } else {
        Upload::owned(t.cast(dtype))
    }
}

/// One device's rows of the call's inputs, in the programs' argument order.
fn shard_inputs(x: &KdaInputs, p: &Problem, plan: RowPlan, d: usize) -> Result<Vec<Upload>> {
    let (ax, start, per) = (batch_axis(p.layout), plan.start(d), plan.per);
    let rows = |t: &HostTensor, axis: usize| t.slice_padded(axis, start, per);
    let mut ups = vec![
        Upload::owned(rows(&x.q, ax)?),
        Upload::owned(rows(&x.k, ax)?),
        Upload::owned(rows(&x.v, ax)?),
        Upload::owned(rows(&x.g, ax)?),
        in_dtype(rows(&x.beta, ax)?, p.dtype),
    ];
    if let Some(h0) = &x.initial_state {
        ups.push(Upload::f32(&rows(h0, 0)?));
    }
    if let Some((a_log, dt)) = x.gate.params() {
        let a_log = a_log.ok_or_else(|| KdaError::missing("a_log", "an in-kernel gate needs a_log"))?;
        ups.push(Upload::f32(a_log));
        ups.extend(dt.map(Upload::f32));
    }
    Ok(ups)
}

/// One device's rows of the cotangents: `do` in the problem's dtype, `dht` in f32.
fn shard_cotangents(c: &Cotangents, p: &Problem, plan: RowPlan, d: usize) -> Result<Vec<Upload>> {
    let (ax, start, per) = (batch_axis(p.layout), plan.start(d), plan.per);
    let mut ups = vec![in_dtype(c.d_o.slice_padded(ax, start, per)?, p.dtype)];
    if let Some(dht) = &c.dht {
        ups.push(Upload::f32(&dht.slice_padded(0, start, per)?));
    }
    Ok(ups)
}

/// Each device's real rows of `parts` (one tensor per device), joined along `axis`.
fn gather(parts: Vec<HostTensor>, axis: usize, plan: RowPlan) -> Result<HostTensor> {
    let kept = parts
        .iter()
        .enumerate()
        .filter(|(d, _)| plan.real(*d) > 0)
        .map(|(d, t)| t.slice_padded(axis, 0, plan.real(d)))
        .collect::<Result<Vec<_>>>()?;
    HostTensor::concat(&kept, axis)
}

fn gather_opt(parts: Vec<Option<HostTensor>>, axis: usize, plan: RowPlan) -> Result<Option<HostTensor>> {
    match parts.into_iter().collect::<Option<Vec<_>>>() {
        Some(ts) => Ok(Some(gather(ts, axis, plan)?)),
        None => Ok(None),
    }
}

impl PjrtBackend {
    /// How many devices this handle drives ([`super::PjrtOptions::devices`]).
    pub fn device_count(&self) -> usize {
        self.shared().info.devices
    }

    /// The shared spec of every device's program (dims of one shard; g in its own dtype).
    fn shard_spec(&self, x: &KdaInputs, shard: &Problem, has_dht: bool) -> Result<KernelSpec> {
        let g_dtype = if x.g.dtype() == DType::BF16 { DType::BF16 } else { DType::F32 };
        Ok(self.spec(shard, has_dht)?.with_g_dtype(g_dtype))
    }

    fn split_rows(&self, x: &KdaInputs) -> Result<(Problem, RowPlan, Vec<Problem>)> {
        let p = x.view().validate()?;
        kda_core::Backend::supports(self, &p)?;
        x.check_values()?;
        let plan = RowPlan::new(p.dims.b, self.device_count());
        let shards = (0..plan.devices).map(|d| shard_problem(&p, plan, d)).collect::<Result<Vec<_>>>()?;
        Ok((p, plan, shards))
    }

    fn download_outputs_dp(&self, p: &Problem, plan: RowPlan, outs: &[DeviceOutputs]) -> Result<KdaOutputs> {
        let (mut o, mut fin) = (Vec::new(), Vec::new());
        for out in outs {
            let host = self.download_outputs(out)?;
            o.push(host.o);
            fin.push(host.final_state);
        }
        Ok(KdaOutputs { o: gather(o, batch_axis(p.layout), plan)?, final_state: gather_opt(fin, 0, plan)? })
    }

    fn download_gradients_dp(
        &self,
        types: Option<Gradtypes>,
        p: &Problem,
        plan: RowPlan,
        grads: &[DeviceGradients],
    ) -> Result<KdaGradients> {
        let host = grads.iter().map(|g| self.download_gradients(g, types)).collect::<Result<Vec<_>>>()?;
        let ax = batch_axis(p.layout);
        let take = |f: fn(&KdaGradients) -> HostTensor| host.iter().map(f).collect::<Vec<_>>();
        let first = host.first().ok_or_else(|| KdaError::backend("gather", "one device or more", "none"))?;
        Ok(KdaGradients {
            dq: gather(take(|g| g.dq.clone()), ax, plan)?,
            dk: gather(take(|g| g.dk.clone()), ax, plan)?,
            dv: gather(take(|g| g.dv.clone()), ax, plan)?,
            dg: gather(take(|g| g.dg.clone()), ax, plan)?,
            dbeta: gather(take(|g| g.dbeta.clone()), ax, plan)?,
            dh0: gather_opt(host.iter().map(|g| g.dh0.clone()).collect(), 0, plan)?,
            // All-reduced in the program: every device holds the batch's total.
            da_log: first.da_log.clone(),
            ddt_bias: first.ddt_bias.clone(),
        })
    }

    /// The fused forward+VJP with the batch's rows spread over the handle's devices.
    pub(crate) fn forward_and_vjp_dp(
        &self,
        x: &KdaInputs,
        c: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        let (p, plan, shards) = self.split_rows(x)?;
        validate_cotangent_shapes(&p, &c.d_o, c.dht.as_ref())?;
        c.check_values()?;
        let spec = self.shard_spec(x, &shards[0], c.dht.is_some())?;
        let mut args = Vec::with_capacity(plan.devices);
        for (d, shard) in shards.iter().enumerate() {
            let mut a: Vec<Arg> = shard_inputs(x, &p, plan, d)?.into_iter().map(Arg::Upload).collect();
            a.extend(index_tables(&spec, shard)?.into_iter().map(Arg::Upload));
            a.extend(shard_cotangents(c, &p, plan, d)?.into_iter().map(Arg::Upload));
            args.push(a);
        }
        let per_device = self.run_kernel_replicated(&spec, ProgramKind::Fused(strategy), Form::Data, args)?;
        let (mut outs, mut grads) = (Vec::new(), Vec::new());
        for (infos, shard) in per_device.into_iter().zip(&shards) {
            let mut it = self.wrap(infos).into_iter();
            outs.push(self.outputs(shard, &mut it)?);
            grads.push(self.gradients(shard, &mut it)?);
        }
        Ok((
            self.download_outputs_dp(&p, plan, &outs)?,
            self.download_gradients_dp(Some(gradtypes(x)), &p, plan, &grads)?,
        ))
    }

    /// The forward with the batch's rows spread over the devices; each device keeps its rows'
    /// residuals.
    pub(crate) fn forward_dp(
        &self,
        x: &KdaInputs,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, PjrtResiduals)> {
        let (p, plan, shards) = self.split_rows(x)?;
        let spec = self.shard_spec(x, &shards[0], false)?;
        let mut kept = Vec::with_capacity(plan.devices);
        for d in 0..plan.devices {
            kept.push(self.upload_all_on(shard_inputs(x, &p, plan, d)?, d)?);
        }
        let keep_h = strategy == BackwardStrategy::SavedState;
        let mut args = Vec::with_capacity(plan.devices);
        for (inputs, shard) in kept.iter().zip(&shards) {
            let mut a: Vec<Arg> = inputs.iter().map(|t| Arg::Id(t.id())).collect();
            a.extend(index_tables(&spec, shard)?.into_iter().map(Arg::Upload));
            args.push(a);
        }
        let per_device = self.run_kernel_replicated(&spec, ProgramKind::Forward(keep_h), Form::Data, args)?;
        let (mut outs, mut parts) = (Vec::new(), Vec::new());
        for ((infos, shard), inputs) in per_device.into_iter().zip(shards).zip(kept) {
            let mut it = self.wrap(infos).into_iter();
            outs.push(self.outputs(&shard, &mut it)?);
            let h = if keep_h { it.next() } else { None };
            parts.push(PjrtResiduals::one_device(shard, spec.clone(), strategy, inputs, h));
        }
        let out = self.download_outputs_dp(&p, plan, &outs)?;
        let res = PjrtResiduals {
            problem: p,
            spec,
            strategy,
            inputs: Vec::new(),
            h: None,
            host_types: Some(gradtypes(x)),
            shards: parts,
            context: None,
        };
        Ok((out, res))
    }

    /// The backward of [`PjrtBackend::forward_dp`]'s residuals, on the devices that hold them.
    pub(crate) fn backward_dp(&self, res: &PjrtResiduals, c: &Cotangents) -> Result<KdaGradients> {
        let p = &res.problem;
        validate_cotangent_shapes(p, &c.d_o, c.dht.as_ref())?;
        c.check_values()?;
        let plan = RowPlan::new(p.dims.b, res.shards.len());
        let mut spec = res.spec.clone();
        spec.has_dht = c.dht.is_some();
        let mut args = Vec::with_capacity(plan.devices);
        for (d, shard) in res.shards.iter().enumerate() {
            let mut a: Vec<Arg> = shard.inputs.iter().map(|t| Arg::Id(t.id())).collect();
            a.extend(index_tables(&spec, &shard.problem)?.into_iter().map(Arg::Upload));
            a.extend(shard.h.iter().map(|t| Arg::Id(t.id())));
            a.extend(shard_cotangents(c, p, plan, d)?.into_iter().map(Arg::Upload));
            args.push(a);
        }
        let per_device =
            self.run_kernel_replicated(&spec, ProgramKind::Backward(res.strategy), Form::Data, args)?;
        let mut grads = Vec::new();
        for (infos, shard) in per_device.into_iter().zip(&res.shards) {
            grads.push(self.gradients(&shard.problem, &mut self.wrap(infos).into_iter())?);
        }
        self.download_gradients_dp(res.host_types, p, plan, &grads)
    }

    /// Uploads host arrays to device `device` and keeps them.
    pub(crate) fn upload_all_on(&self, uploads: Vec<Upload>, device: usize) -> Result<Vec<DeviceTensor>> {
        let counters = self.shared().counters.clone();
        let infos = self
            .shared()
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
}
