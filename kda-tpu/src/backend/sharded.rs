//! The device API over several devices, data parallel: the caller keeps one shard of the batch
//! on each device ([`PjrtBackend::upload_inputs_on`]), every shard of the same shape, and one
//! call runs the program compiled for that many replicas on all of them. Each device's outputs,
//! residuals and gradients stay on that device; the gate-parameter gradients (`da_log`,
//! `ddt_bias`) are all-reduced in the program, so every device holds the whole batch's sums.
//!
//! Shards are whole rows (segments never cross devices) and share dims, segment count and
//! dtypes: a short shard is padded by the caller (a zero row with zero cotangents adds nothing
//! to any gradient). Context parallelism takes host tensors ([`super::Split::Context`]): its
//! pieces are planned from the whole batch's segments.

use kda_core::{BackwardStrategy, KdaError, Problem, Result};

use super::device::{check_on, index_tables, DeviceCotangents, DeviceGradients, DeviceInputs, DeviceOutputs};
use super::worker::Form;
use super::{e, Arg, PjrtBackend, PjrtResiduals};
use crate::kernels::KernelSpec;
use crate::ProgramKind;

impl PjrtBackend {
    /// A device index of this handle, or an error naming the handle's device count.
    pub(crate) fn check_device_index(&self, device: usize) -> Result<()> {
        let n = self.device_count();
        match device < n {
            true => Ok(()),
            false => Err(KdaError::value(
                "device",
                format!("a device index below {n} (this handle drives {n}; see PjrtOptions::devices)"),
                device.to_string(),
            )),
        }
    }

    /// One shard per device, all of one shape: their problems and the shared spec.
    fn shard_specs(&self, xs: &[DeviceInputs], has_dht: bool) -> Result<(Vec<Problem>, KernelSpec)> {
        let n = self.device_count();
        if xs.len() != n {
            return Err(KdaError::value(
                "inputs",
                format!("one shard per device ({n})"),
                format!("{} shards", xs.len()),
            ));
        }
        let mut problems = Vec::with_capacity(n);
        let mut first: Option<KernelSpec> = None;
        for (d, x) in xs.iter().enumerate() {
            let (p, spec) = self.validate_device_on(d, x, has_dht)?;
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
                        format!("every shard shaped as device 0's ({})", dims(&problems[0])),
                        format!("device {d}: {}", dims(&p)),
                    ));
                }
            }
            problems.push(p);
        }
        let spec = first.ok_or_else(|| KdaError::value("inputs", "one shard per device", "none"))?;
        Ok((problems, spec))
    }

    fn check_shard_cotangents(&self, problems: &[Problem], cs: &[DeviceCotangents]) -> Result<()> {
        if cs.len() != problems.len() {
            return Err(KdaError::value(
                "cotangents",
                format!("one per device ({})", problems.len()),
                cs.len().to_string(),
            ));
        }
        if cs.iter().any(|c| c.dht.is_some()) != cs.iter().all(|c| c.dht.is_some()) {
            return Err(KdaError::value("dht", "on every device or on none", "on some"));
        }
        for (d, (p, c)) in problems.iter().zip(cs).enumerate() {
            self.check_cotangents_on(d, p, c)?;
        }
        Ok(())
    }

    /// The fused forward+VJP on one shard per device: `xs[d]` and `cs[d]` on device `d`
    /// ([`PjrtBackend::upload_inputs_on`]); returns each device's outputs and gradients, there.
    /// `da_log` and `ddt_bias` are the sums over every shard, on every device.
    ///
    /// ```
    /// use kda_core::{BackwardStrategy, Cotangents, HostTensor, KdaInputs};
    /// use kda_tpu::PjrtOptions;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let backend = PjrtOptions::new().devices(2).build()?; // the CPU plugin makes 2 devices
    /// let x = |d: &[usize], v: f32| HostTensor::from_f32(d, vec![v; d.iter().product()]);
    /// let (mut xs, mut cs) = (Vec::new(), Vec::new());
    /// for device in 0..2 {
    ///     // This device's rows: [B, T, H, K] = [1, 64, 2, 16] (batch-first).
    ///     let v = 0.1 * (device + 1) as f32;
    ///     let inputs = KdaInputs::new(x(&[1, 64, 2, 16], v)?, x(&[1, 64, 2, 16], v)?, x(&[1, 64, 2, 16], v)?,
    ///                                 x(&[1, 64, 2, 16], -0.1)?, x(&[1, 64, 2], 0.5)?);
    ///     let problem = inputs.view().validate()?;
    ///     let cot = Cotangents { d_o: x(&[1, 64, 2, 16], 1.0)?, dht: None };
    ///     xs.push(backend.upload_inputs_on(device, &inputs)?);
    ///     cs.push(backend.upload_cotangents_on(device, &cot, &problem)?);
    /// }
    /// let results = backend.forward_and_vjp_data_parallel(&xs, &cs, BackwardStrategy::SavedState)?;
    /// assert_eq!(results[1].1.dq.device(), 1); // device 1's gradients stay on device 1
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward_and_vjp_data_parallel(
        &self,
        xs: &[DeviceInputs],
        cs: &[DeviceCotangents],
        strategy: BackwardStrategy,
    ) -> Result<Vec<(DeviceOutputs, DeviceGradients)>> {
        let has_dht = cs.first().is_some_and(|c| c.dht.is_some());
        let (problems, spec) = self.shard_specs(xs, has_dht)?;
        self.check_shard_cotangents(&problems, cs)?;
        let mut args = Vec::with_capacity(xs.len());
        for ((x, c), p) in xs.iter().zip(cs).zip(&problems) {
            let mut a: Vec<Arg> = x.args().into_iter().map(|(_, t)| Arg::Id(t.id())).collect();
            a.extend(index_tables(&spec, p)?.into_iter().map(Arg::Upload));
            a.push(Arg::Id(c.d_o.id()));
            a.extend(c.dht.iter().map(|t| Arg::Id(t.id())));
            args.push(a);
        }
        let per_device = self.run_kernel_replicated(&spec, ProgramKind::Fused(strategy), Form::Data, args)?;
        per_device
            .into_iter()
            .zip(&problems)
            .map(|(infos, p)| {
                let mut it = self.wrap(infos).into_iter();
                Ok((self.outputs(p, &mut it)?, self.gradients(p, &mut it)?))
            })
            .collect()
    }

    /// The forward on one shard per device; each device keeps its outputs and residuals.
    pub fn forward_data_parallel(
        &self,
        xs: &[DeviceInputs],
        strategy: BackwardStrategy,
    ) -> Result<Vec<(DeviceOutputs, PjrtResiduals)>> {
        let (problems, spec) = self.shard_specs(xs, false)?;
        let keep_h = strategy == BackwardStrategy::SavedState;
        let mut args = Vec::with_capacity(xs.len());
        for (x, p) in xs.iter().zip(&problems) {
            let mut a: Vec<Arg> = x.args().into_iter().map(|(_, t)| Arg::Id(t.id())).collect();
            a.extend(index_tables(&spec, p)?.into_iter().map(Arg::Upload));
            args.push(a);
        }
        let per_device = self.run_kernel_replicated(&spec, ProgramKind::Forward(keep_h), Form::Data, args)?;
        per_device
            .into_iter()
            .zip(problems)
            .zip(xs)
            .map(|((infos, p), x)| {
                let mut it = self.wrap(infos).into_iter();
                let out = self.outputs(&p, &mut it)?;
                let h = if keep_h { it.next() } else { None };
                let inputs = x.args().into_iter().map(|(_, t)| t.clone()).collect();
                let res = PjrtResiduals::one_device(p, spec.clone(), strategy, inputs, h);
                Ok((out, res))
            })
            .collect()
    }

    /// The backward of [`PjrtBackend::forward_data_parallel`]'s residuals (`res[d]` and `cs[d]`
    /// on device `d`); returns each device's gradients, there.
    pub fn backward_data_parallel(
        &self,
        res: &[PjrtResiduals],
        cs: &[DeviceCotangents],
    ) -> Result<Vec<DeviceGradients>> {
        let n = self.device_count();
        if res.len() != n {
            return Err(KdaError::value("residuals", format!("one per device ({n})"), res.len().to_string()));
        }
        let problems: Vec<Problem> = res.iter().map(|r| r.problem.clone()).collect();
        self.check_shard_cotangents(&problems, cs)?;
        let strategy = res[0].strategy;
        let mut spec = res[0].spec.clone();
        spec.has_dht = cs[0].dht.is_some();
        let mut args = Vec::with_capacity(n);
        for (d, (r, c)) in res.iter().zip(cs).enumerate() {
            if r.spec != res[0].spec || r.strategy != strategy || !r.shards.is_empty() || r.context.is_some()
            {
                return Err(KdaError::value(
                    "residuals",
                    "one shard each of one forward_data_parallel call",
                    format!("device {d}'s residuals from another call"),
                ));
            }
            for t in r.inputs.iter().chain(r.h.iter()) {
                t.check_owner(self.shared(), "residuals").map_err(e)?;
                check_on(t, "residuals", d)?;
            }
            let mut a: Vec<Arg> = r.inputs.iter().map(|t| Arg::Id(t.id())).collect();
            a.extend(index_tables(&spec, &r.problem)?.into_iter().map(Arg::Upload));
            a.extend(r.h.iter().map(|t| Arg::Id(t.id())));
            a.push(Arg::Id(c.d_o.id()));
            a.extend(c.dht.iter().map(|t| Arg::Id(t.id())));
            args.push(a);
        }
        let per_device =
            self.run_kernel_replicated(&spec, ProgramKind::Backward(strategy), Form::Data, args)?;
        per_device
            .into_iter()
            .zip(&problems)
            .map(|(infos, p)| self.gradients(p, &mut self.wrap(infos).into_iter()))
            .collect()
    }
}
