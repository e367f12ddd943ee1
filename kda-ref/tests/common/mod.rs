//! Small seeded f64 inputs for the reference's own tests.
#![allow(dead_code)] // shared by several test files; each uses a part

use kda_core::{Cotangents, GateMode, HostTensor, KdaConfig, KdaInputs, Layout, Segments};

/// A seeded PCG-64 (the generator of every test input in the workspace).
pub struct Rng(rand_pcg::Pcg64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(rand_pcg::Pcg64::new(u128::from(seed), 0))
    }
    pub fn next_u64(&mut self) -> u64 {
        rand_core::Rng::next_u64(&mut self.0)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

/// Which gate the inputs use.
#[derive(Debug, Clone, Copy)]
pub enum Gate {
    Pre,
    Softplus,
    LowerBound,
}

/// A small problem description.
#[derive(Debug, Clone)]
pub struct Small {
    pub h: usize,
    pub b: usize,
    pub t: usize,
    pub k: usize,
    pub v: usize,
    pub layout: Layout,
    pub gate: Gate,
    pub l2norm: bool,
    pub h0: bool,
    pub cu: Option<Vec<Vec<i64>>>,
    pub seed: u64,
}

impl Small {
    pub fn new(h: usize, b: usize, t: usize, k: usize, v: usize) -> Self {
        Small {
            h,
            b,
            t,
            k,
            v,
            layout: Layout::HeadFirst,
            gate: Gate::Pre,
            l2norm: false,
            h0: true,
            cu: None,
            seed: 7,
        }
    }

    pub fn n(&self) -> usize {
        self.cu.as_ref().map_or(1, |c| c[0].len() - 1)
    }

    /// Inputs and cotangents (with `dht`, and final states requested).
    pub fn build(&self) -> (KdaInputs, Cotangents) {
        let mut r = Rng::new(self.seed);
        let (h, b, t, k, v) = (self.h, self.b, self.t, self.k, self.v);
        let tk = self.layout.token_shape(h, b, t, k);
        let tv = self.layout.token_shape(h, b, t, v);
        let ts = self.layout.scalar_shape(h, b, t);
        let n = h * b * t;
        let q = HostTensor::from_f64(&tk, r.vec(n * k, -1.0, 1.0)).unwrap();
        let kk = HostTensor::from_f64(&tk, r.vec(n * k, -0.6, 0.6)).unwrap();
        let vv = HostTensor::from_f64(&tv, r.vec(n * v, -1.0, 1.0)).unwrap();
        let (g, gate) = match self.gate {
            Gate::Pre => (r.vec(n * k, -1.5, -0.01), GateMode::Preactivated),
            Gate::Softplus => (
                r.vec(n * k, -2.0, 2.0),
                GateMode::softplus(
                    HostTensor::from_f64(&[h], r.vec(h, -1.0, 0.5)).unwrap(),
                    Some(HostTensor::from_f64(&[h * k], r.vec(h * k, -0.5, 0.5)).unwrap()),
                ),
            ),
            Gate::LowerBound => (
                r.vec(n * k, -2.0, 2.0),
                GateMode::lower_bound(
                    -5.0,
                    HostTensor::from_f64(&[h], r.vec(h, -1.0, 0.5)).unwrap(),
                    Some(HostTensor::from_f64(&[h * k], r.vec(h * k, -0.5, 0.5)).unwrap()),
                ),
            ),
        };
        let g = HostTensor::from_f64(&tk, g).unwrap();
        let beta = HostTensor::from_f64(&ts, r.vec(n, 0.1, 0.9)).unwrap();
        let nseg = self.n();
        let state = [b, nseg, h, k, v];
        let mut inputs = KdaInputs::new(q, kk, vv, g, beta).with_gate(gate).with_config(KdaConfig {
            layout: self.layout,
            scale: None,
            use_qk_l2norm: self.l2norm,
            output_final_state: true,
        });
        if self.h0 {
            let h0 = r.vec(b * nseg * h * k * v, -0.5, 0.5);
            inputs = inputs.with_initial_state(HostTensor::from_f64(&state, h0).unwrap());
        }
        if let Some(cu) = &self.cu {
            inputs = inputs.with_segments(Segments::CuSeqlens(cu.clone()));
        }
        let d_o = HostTensor::from_f64(&tv, r.vec(n * v, -1.0, 1.0)).unwrap();
        let dht = HostTensor::from_f64(&state, r.vec(b * nseg * h * k * v, -1.0, 1.0)).unwrap();
        (inputs, Cotangents { d_o, dht: Some(dht) })
    }
}

/// Returns a copy of `t` with element `i` moved by `delta`.
pub fn bump(t: &HostTensor, i: usize, delta: f64) -> HostTensor {
    let mut data = t.to_f64_vec();
    data[i] += delta;
    HostTensor::from_f64(t.shape(), data).unwrap()
}
