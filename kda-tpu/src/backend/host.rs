//! `kda_core::Backend` for [`PjrtBackend`]: host tensors uploaded, the device API, results
//! downloaded. Also the benchmark path ([`DeviceCall`]): one program at a time on inputs
//! uploaded once.

use kda_core::{
    Backend, BackwardStrategy, Cotangents, DType, HostTensor, KdaError, KdaGradients, KdaInputs, KdaOutputs,
    Problem, Result,
};

use super::device::{index_tables, DeviceGradients, DeviceOutputs, PjrtResiduals};
use super::tensor::DeviceTensor;
use super::{e, Arg, PjrtBackend, Split};
use crate::kernels::KernelSpec;

pub use crate::kernels::ProgramKind;

/// The StableHLO text of a program (with `@main`).
pub fn program_text(spec: &KernelSpec, kind: ProgramKind) -> crate::Result<String> {
    crate::kernels::program(spec, kind)
}

/// The host dtypes gradients come back in (their inputs').
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gradtypes {
    g: DType,
    beta: DType,
    /// `a_log`'s dtype.
    gate: DType,
    /// `dt_bias`'s dtype.
    dt_bias: DType,
}

pub(crate) fn gradtypes(x: &KdaInputs) -> Gradtypes {
    let gate = x.gate.params().and_then(|(a, _)| a).map_or(DType::F32, |t| t.dtype());
    let dt_bias = x.gate.params().and_then(|(_, d)| d).map_or(DType::F32, |t| t.dtype());
    Gradtypes { g: x.g.dtype(), beta: x.beta.dtype(), gate, dt_bias }
}

impl PjrtBackend {
    pub(crate) fn download_outputs(&self, out: &DeviceOutputs) -> Result<KdaOutputs> {
        let mut ts: Vec<&DeviceTensor> = vec![&out.o];
        ts.extend(out.final_state.iter());
        let mut host = self.download_all(&ts)?.into_iter();
        let o = host.next().ok_or_else(|| KdaError::backend("download", "o", "nothing"))?;
        Ok(KdaOutputs { o, final_state: host.next() })
    }

    pub(crate) fn download_gradients(
        &self,
        g: &DeviceGradients,
        types: Option<Gradtypes>,
    ) -> Result<KdaGradients> {
        let named = g.named();
        let ts: Vec<&DeviceTensor> = named.iter().map(|(_, t)| *t).collect();
        let mut host = self.download_all(&ts)?.into_iter();
        let mut next =
            || host.next().ok_or_else(|| KdaError::backend("download", "one tensor per gradient", "too few"));
        let mut grads = KdaGradients {
            dq: next()?,
            dk: next()?,
            dv: next()?,
            dg: next()?,
            dbeta: next()?,
            dh0: None,
            da_log: None,
            ddt_bias: None,
        };
        for ((name, _), t) in named.iter().skip(5).zip(host) {
            match *name {
                "dh0" => grads.dh0 = Some(t),
                "da_log" => grads.da_log = Some(t),
                _ => grads.ddt_bias = Some(t),
            }
        }
        if let Some(x) = types {
            let cast = |t: &mut HostTensor, to: DType| {
                if t.dtype() != to {
                    *t = t.cast(to);
                }
            };
            cast(&mut grads.dg, x.g);
            cast(&mut grads.dbeta, x.beta);
            if let Some(t) = &mut grads.da_log {
                cast(t, x.gate);
            }
            if let Some(t) = &mut grads.ddt_bias {
                cast(t, x.dt_bias);
            }
        }
        Ok(grads)
    }
}

impl Backend for PjrtBackend {
    type Residuals = PjrtResiduals;

    fn name(&self) -> String {
        format!("pjrt-{}", self.platform())
    }

    fn supports(&self, p: &Problem) -> Result<()> {
        if p.dtype == DType::F64 {
            return Err(KdaError::unsupported("dtype", "f32 or bf16 inputs on PJRT", "f64"));
        }
        Ok(())
    }

    fn forward(&self, inputs: &KdaInputs, strategy: BackwardStrategy) -> Result<(KdaOutputs, PjrtResiduals)> {
        if self.device_count() > 1 {
            return match self.split() {
                Split::Data => self.forward_dp(inputs, strategy),
                Split::Context => self.forward_cp(inputs, strategy),
            };
        }
        let dev = self.upload_inputs(inputs)?;
        let (out, mut res) = self.forward_device(&dev, strategy)?;
        res.host_types = Some(gradtypes(inputs));
        Ok((self.download_outputs(&out)?, res))
    }

    fn backward(&self, res: PjrtResiduals, cot: &Cotangents) -> Result<KdaGradients> {
        if let Some(plan) = res.context.clone() {
            return self.backward_cp(&res, &plan, cot);
        }
        if !res.shards.is_empty() {
            return self.backward_dp(&res, cot);
        }
        let c = self.upload_cotangents(cot, &res.problem)?;
        let grads = self.backward_device(&res, &c)?;
        self.download_gradients(&grads, res.host_types)
    }

    fn forward_and_vjp(
        &self,
        inputs: &KdaInputs,
        cot: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        if self.device_count() > 1 {
            return match self.split() {
                Split::Data => self.forward_and_vjp_dp(inputs, cot, strategy),
                Split::Context => self.forward_and_vjp_cp(inputs, cot, strategy),
            };
        }
        let dev = self.upload_inputs(inputs)?;
        let p = self.validate_device(&dev, cot.dht.is_some())?.0;
        let c = self.upload_cotangents(cot, &p)?;
        let (out, grads) = self.forward_and_vjp_device(&dev, &c, strategy)?;
        Ok((self.download_outputs(&out)?, self.download_gradients(&grads, Some(gradtypes(inputs)))?))
    }
}

/// A call's inputs, index tables and cotangents uploaded once: what benchmarks time programs on.
#[derive(Debug)]
pub struct DeviceCall {
    problem: Problem,
    spec: KernelSpec,
    inputs: Vec<DeviceTensor>,
    cotangents: Vec<DeviceTensor>,
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
    /// Validates and uploads a call once, index tables included; `cot` is needed for backward
    /// and fused programs.
    pub fn upload_call(&self, inputs: &KdaInputs, cot: Option<&Cotangents>) -> Result<DeviceCall> {
        let dev = self.upload_inputs(inputs)?;
        let (problem, spec) = self.validate_device(&dev, cot.is_some_and(|c| c.dht.is_some()))?;
        let tables = self.upload_all(index_tables(&spec, &problem)?)?;
        let mut all: Vec<DeviceTensor> = vec![dev.q, dev.k, dev.v, dev.g, dev.beta];
        all.extend(dev.initial_state);
        match dev.gate {
            super::DeviceGate::Preactivated => {}
            super::DeviceGate::Softplus { a_log, dt_bias }
            | super::DeviceGate::LowerBound { a_log, dt_bias, .. } => {
                all.push(a_log);
                all.extend(dt_bias);
            }
        }
        all.extend(tables);
        let mut cotangents = Vec::new();
        if let Some(c) = cot {
            let c = self.upload_cotangents(c, &problem)?;
            cotangents.push(c.d_o);
            cotangents.extend(c.dht);
        }
        Ok(DeviceCall { problem, spec, inputs: all, cotangents })
    }

    /// Runs one program of the call on its device-resident buffers. Backward programs with the
    /// saved-state strategy need `h` (the forward's last output with `Forward(true)`).
    pub fn run_program(
        &self,
        call: &DeviceCall,
        kind: ProgramKind,
        h: Option<&DeviceTensor>,
    ) -> Result<Vec<DeviceTensor>> {
        let mut args: Vec<Arg> = call.inputs.iter().map(|t| Arg::Id(t.id())).collect();
        match kind {
            ProgramKind::Forward(_) => {}
            ProgramKind::Backward(s) => {
                if s == BackwardStrategy::SavedState {
                    let h = h.ok_or_else(|| {
                        KdaError::missing("h", "the saved-state backward reads the forward's states")
                    })?;
                    h.check_owner(self.shared(), "h").map_err(e)?;
                    args.push(Arg::Id(h.id()));
                }
                args.extend(call.cotangents.iter().map(|t| Arg::Id(t.id())));
            }
            ProgramKind::Fused(_) => args.extend(call.cotangents.iter().map(|t| Arg::Id(t.id()))),
        }
        let (infos, _) = self.run_kernel(&call.spec, kind, args)?;
        Ok(infos.into_iter().map(|i| DeviceTensor::wrap(self.shared(), i, None)).collect())
    }

    /// The staged baseline (spec section 5): the forward executable, its residuals handed back to
    /// the caller (downloaded to host memory), then a separate backward executable fed from them.
    pub fn run_staged(
        &self,
        call: &DeviceCall,
        strategy: BackwardStrategy,
    ) -> Result<(Vec<DeviceTensor>, Vec<DeviceTensor>)> {
        let saved = strategy == BackwardStrategy::SavedState;
        let mut fwd = self.run_program(call, ProgramKind::Forward(saved), None)?;
        let h = if saved {
            let dev = fwd.pop().ok_or_else(|| KdaError::backend("forward", "an h output", "none"))?;
            let host = self.download(&dev)?;
            Some(self.upload(&host)?)
        } else {
            None
        };
        let bwd = self.run_program(call, ProgramKind::Backward(strategy), h.as_ref())?;
        Ok((fwd, bwd))
    }
}
