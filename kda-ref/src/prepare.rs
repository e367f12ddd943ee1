//! Inputs in the reference's working form: f64, head-first, gates activated, q/k normalised.

use crate::gate::{self, GateParams};
use kda_core::{GateKind, HostTensor, KdaInputs, Layout, Problem, ProblemDims, Result, L2NORM_EPS};

/// Reads a per-token tensor of width `d` in `layout` into head-first `[H,B,T,d]` f64.
pub(crate) fn to_head_first(t: &HostTensor, layout: Layout, dims: &ProblemDims, d: usize) -> Vec<f64> {
    let mut out = vec![0.0; dims.h * dims.b * dims.t * d];
    for h in 0..dims.h {
        for b in 0..dims.b {
            for s in 0..dims.t {
                let base = ((h * dims.b + b) * dims.t + s) * d;
                for i in 0..d {
                    out[base + i] = t.get_f64(layout.index(dims, h, b, s, d, i));
                }
            }
        }
    }
    out
}

/// Writes head-first `[H,B,T,d]` f64 data back into `layout`, as `shape` and `dtype`.
pub(crate) fn from_head_first(
    data: &[f64],
    layout: Layout,
    dims: &ProblemDims,
    d: usize,
    shape: &[usize],
    dtype: kda_core::DType,
) -> Result<HostTensor> {
    let mut out = vec![0.0; data.len()];
    for h in 0..dims.h {
        for b in 0..dims.b {
            for s in 0..dims.t {
                let base = ((h * dims.b + b) * dims.t + s) * d;
                for i in 0..d {
                    out[layout.index(dims, h, b, s, d, i)] = data[base + i];
                }
            }
        }
    }
    HostTensor::from_f64_as(shape, &out, dtype)
}

/// The validated problem plus its tensors in working form.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    pub p: Problem,
    /// q after the optional L2 norm (not scaled), `[H,B,T,K]`.
    pub q: Vec<f64>,
    /// k after the optional L2 norm, `[H,B,T,K]`.
    pub k: Vec<f64>,
    /// `rsqrt(sum(q^2) + eps)` per token (1 without the norm), `[H,B,T]`.
    pub q_rstd: Vec<f64>,
    /// Same for k.
    pub k_rstd: Vec<f64>,
    /// `[H,B,T,V]`.
    pub v: Vec<f64>,
    /// The raw gate input, `[H,B,T,K]`.
    pub x: Vec<f64>,
    /// The activated log-decay, `[H,B,T,K]`.
    pub g: Vec<f64>,
    /// `[H,B,T]`.
    pub beta: Vec<f64>,
    /// `[B,N,H,K,V]`, zeros without an initial state.
    pub h0: Vec<f64>,
    /// `[H]` (zeros for the pre-activated gate).
    pub a_log: Vec<f64>,
    /// `[H*K]` (zeros when absent).
    pub dt_bias: Vec<f64>,
}

fn l2_normalise(x: &mut [f64], rstd: &mut [f64], d: usize) {
    for (row, r) in x.chunks_mut(d).zip(rstd.iter_mut()) {
        let ss: f64 = row.iter().map(|a| a * a).sum();
        *r = 1.0 / (ss + L2NORM_EPS).sqrt();
        row.iter_mut().for_each(|a| *a *= *r);
    }
}

impl Prepared {
    /// Validates and converts the inputs.
    pub fn new(inputs: &KdaInputs) -> Result<Self> {
        let p = inputs.validate()?;
        let d = p.dims;
        let lay = p.layout;
        let mut q = to_head_first(&inputs.q, lay, &d, d.k);
        let mut k = to_head_first(&inputs.k, lay, &d, d.k);
        let tokens = d.h * d.b * d.t;
        let mut q_rstd = vec![1.0; tokens];
        let mut k_rstd = vec![1.0; tokens];
        if p.use_qk_l2norm {
            l2_normalise(&mut q, &mut q_rstd, d.k);
            l2_normalise(&mut k, &mut k_rstd, d.k);
        }
        let v = to_head_first(&inputs.v, lay, &d, d.v);
        let x = to_head_first(&inputs.g, lay, &d, d.k);
        let beta = to_head_first(&inputs.beta, lay, &d, 1);
        let h0 = match &inputs.initial_state {
            Some(t) => t.to_f64_vec(),
            None => vec![0.0; d.b * d.n * d.h * d.k * d.v],
        };
        let (a_log, dt_bias) = match inputs.gate.params() {
            Some((a, dt)) => (
                a.map_or_else(|| vec![0.0; d.h], |t| t.to_f64_vec()),
                dt.map_or_else(|| vec![0.0; d.h * d.k], |t| t.to_f64_vec()),
            ),
            None => (vec![0.0; d.h], vec![0.0; d.h * d.k]),
        };
        let mut prepared = Self { p, q, k, q_rstd, k_rstd, v, g: Vec::new(), x, beta, h0, a_log, dt_bias };
        prepared.g = (0..prepared.x.len())
            .map(|idx| gate::activate(prepared.p.gate, prepared.x[idx], prepared.gate_params(idx)))
            .collect();
        Ok(prepared)
    }

    /// The gate parameters of flat head-first element `idx` of a `[H,B,T,K]` tensor.
    pub fn gate_params(&self, idx: usize) -> GateParams {
        let d = &self.p.dims;
        let i = idx % d.k;
        let h = idx / (d.k * d.t * d.b);
        GateParams { a_log: self.a_log[h], dt_bias: self.dt_bias[h * d.k + i] }
    }

    /// Whether the gate is computed in the kernel.
    pub fn in_kernel_gate(&self) -> bool {
        self.p.gate != GateKind::Preactivated
    }
}
