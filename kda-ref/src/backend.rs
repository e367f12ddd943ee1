//! [`RefBackend`]: the f64 oracle behind the `kda_core::Backend` trait.

use crate::gate;
use crate::prepare::{from_head_first, to_head_first, Prepared};
use crate::recurrence::{self, RawGradients};
use kda_core::{
    Backend, BackwardStrategy, Cotangents, HostTensor, KdaGradients, KdaInputs, KdaOutputs, Problem,
    Residuals, Result,
};

/// The reference backend. Computes in f64 whatever the input dtype; results are rounded to the
/// input dtypes at the end (f64 inputs give f64 results).
#[derive(Debug, Clone, Copy, Default)]
pub struct RefBackend;

/// What the reference forward keeps: the prepared inputs and, for the saved-state strategy, the
/// state entering every 64-token chunk.
#[derive(Debug, Clone)]
pub struct RefResiduals {
    prepared: Prepared,
    inputs: KdaInputs,
    checkpoints: Option<Vec<Vec<Vec<f64>>>>,
    strategy: BackwardStrategy,
}

impl Residuals for RefResiduals {
    fn strategy(&self) -> BackwardStrategy {
        self.strategy
    }
    fn problem(&self) -> &Problem {
        &self.prepared.p
    }
}

fn outputs(p: &Prepared, fwd: &recurrence::ForwardResult) -> Result<KdaOutputs> {
    let pr = &p.p;
    let d = pr.dims;
    let o_shape = pr.layout.token_shape(d.h, d.b, d.t, d.v);
    let o = from_head_first(&fwd.o, pr.layout, &d, d.v, &o_shape, pr.dtype)?;
    let final_state = if pr.output_final_state {
        Some(HostTensor::from_f64_as(&d.state_shape(), &fwd.final_state, pr.state_dtype())?)
    } else {
        None
    };
    Ok(KdaOutputs { o, final_state })
}

/// The L2-norm backward `rstd * (dy - (dy . y) y)` applied in place, per token.
fn l2norm_backward(dy: &mut [f64], y: &[f64], rstd: &[f64], d: usize) {
    for ((dr, yr), r) in dy.chunks_mut(d).zip(y.chunks(d)).zip(rstd) {
        let dot: f64 = dr.iter().zip(yr).map(|(a, b)| a * b).sum();
        dr.iter_mut().zip(yr).for_each(|(a, b)| *a = r * (*a - dot * b));
    }
}

fn gradients(p: &Prepared, inputs: &KdaInputs, mut raw: RawGradients) -> Result<KdaGradients> {
    let pr = &p.p;
    let d = pr.dims;
    if pr.use_qk_l2norm {
        l2norm_backward(&mut raw.dq, &p.q, &p.q_rstd, d.k);
        l2norm_backward(&mut raw.dk, &p.k, &p.k_rstd, d.k);
    }
    let mut da_log = vec![0.0; d.h];
    let mut ddt_bias = vec![0.0; d.h * d.k];
    if p.in_kernel_gate() {
        for (idx, dg) in raw.dg.iter_mut().enumerate() {
            let params = p.gate_params(idx);
            let (dx, dalog) = gate::derivatives(pr.gate, p.x[idx], params);
            let h = idx / (d.k * d.t * d.b);
            da_log[h] += *dg * dalog;
            *dg *= dx;
            ddt_bias[h * d.k + idx % d.k] += *dg;
        }
    }
    let lay = pr.layout;
    let tok_k = lay.token_shape(d.h, d.b, d.t, d.k);
    let tok_v = lay.token_shape(d.h, d.b, d.t, d.v);
    let (da_log, ddt_bias) = match inputs.gate.params() {
        Some((a, dt)) => (
            a.map(|t| HostTensor::from_f64_as(t.shape(), &da_log, t.dtype())).transpose()?,
            dt.map(|t| HostTensor::from_f64_as(t.shape(), &ddt_bias, t.dtype())).transpose()?,
        ),
        None => (None, None),
    };
    let dh0 = if pr.has_initial_state {
        Some(HostTensor::from_f64_as(&d.state_shape(), &raw.dh0, pr.state_dtype())?)
    } else {
        None
    };
    Ok(KdaGradients {
        dq: from_head_first(&raw.dq, lay, &d, d.k, &tok_k, inputs.q.dtype())?,
        dk: from_head_first(&raw.dk, lay, &d, d.k, &tok_k, inputs.k.dtype())?,
        dv: from_head_first(&raw.dv, lay, &d, d.v, &tok_v, inputs.v.dtype())?,
        dg: from_head_first(&raw.dg, lay, &d, d.k, &tok_k, inputs.g.dtype())?,
        dbeta: from_head_first(&raw.dbeta, lay, &d, 1, &pr.beta_shape, inputs.beta.dtype())?,
        dh0,
        da_log,
        ddt_bias,
    })
}

impl Backend for RefBackend {
    type Residuals = RefResiduals;

    fn name(&self) -> String {
        "ref".to_string()
    }

    fn supports(&self, _problem: &Problem) -> Result<()> {
        Ok(())
    }

    fn forward(&self, inputs: &KdaInputs, strategy: BackwardStrategy) -> Result<(KdaOutputs, RefResiduals)> {
        let prepared = Prepared::new(inputs)?;
        let keep = strategy == BackwardStrategy::SavedState;
        let fwd = recurrence::forward(&prepared, keep);
        let out = outputs(&prepared, &fwd)?;
        let checkpoints = keep.then_some(fwd.checkpoints);
        Ok((out, RefResiduals { prepared, inputs: inputs.clone(), checkpoints, strategy }))
    }

    fn backward(&self, res: RefResiduals, cot: &Cotangents) -> Result<KdaGradients> {
        let p = &res.prepared;
        cot.validate(&p.p)?;
        let d = p.p.dims;
        let mut d_o = to_head_first(&cot.d_o, p.p.layout, &d, d.v);
        // Padding tokens have no output: their cotangent is ignored, their gradients are 0.
        for h in 0..d.h {
            for b in 0..d.b {
                for t in p.p.segments.real_tokens(b)..d.t {
                    d_o[((h * d.b + b) * d.t + t) * d.v..][..d.v].fill(0.0);
                }
            }
        }
        let dht = match &cot.dht {
            Some(t) => t.to_f64_vec(),
            None => vec![0.0; d.b * d.n * d.h * d.k * d.v],
        };
        let raw = recurrence::backward(p, &d_o, &dht, res.checkpoints.as_deref());
        gradients(p, &res.inputs, raw)
    }
}

/// The reference forward (no residuals kept).
pub fn forward(inputs: &KdaInputs) -> Result<KdaOutputs> {
    let prepared = Prepared::new(inputs)?;
    outputs(&prepared, &recurrence::forward(&prepared, false))
}

/// The reference forward and VJP.
pub fn forward_and_vjp(inputs: &KdaInputs, cot: &Cotangents) -> Result<(KdaOutputs, KdaGradients)> {
    RefBackend.forward_and_vjp(inputs, cot, BackwardStrategy::Rematerialize)
}

/// The loss `sum(o * do) + sum(final_state * dht)` in f64, for gradient checks. The cotangents
/// are validated first, as in the backward: a misshapen `do` or `dht` is an error.
pub fn loss(inputs: &KdaInputs, cot: &Cotangents) -> Result<f64> {
    let prepared = Prepared::new(inputs)?;
    cot.validate(&prepared.p)?;
    let fwd = recurrence::forward(&prepared, false);
    let d = prepared.p.dims;
    let d_o = to_head_first(&cot.d_o, prepared.p.layout, &d, d.v);
    let mut l: f64 = fwd.o.iter().zip(&d_o).map(|(a, b)| a * b).sum();
    if let Some(dht) = &cot.dht {
        l += fwd.final_state.iter().zip(dht.to_f64_vec()).map(|(a, b)| a * b).sum::<f64>();
    }
    Ok(l)
}
