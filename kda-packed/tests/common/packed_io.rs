//! Native packed backward input: `do` comes in and gradients go out in the caller's packed layout
//! (head-first or batch-first); the chunk alignment stays internal.

use kda_core::{Cotangents, HostTensor, KdaError, KdaGradients, KdaInputs, Layout, Result};
use kda_packed::{compact_scalar_tensor, compact_tensor, load_scalar_tensor, load_tensor, SegmentPlan};

/// The per-token inputs in the aligned layout: `[H, NT, C, D]`, beta `[H, NT, C]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AlignedInputs {
    /// Queries `[H, NT, C, K]`.
    pub q: HostTensor,
    /// Keys `[H, NT, C, K]`.
    pub k: HostTensor,
    /// Values `[H, NT, C, V]`.
    pub v: HostTensor,
    /// Gates `[H, NT, C, K]`.
    pub g: HostTensor,
    /// Write strengths `[H, NT, C]`.
    pub beta: HostTensor,
}

/// Gradients as a chunked backward produces them: per-token ones aligned, the rest as is.
#[derive(Debug, Clone, PartialEq)]
pub struct AlignedGradients {
    /// dq `[H, NT, C, K]`.
    pub dq: HostTensor,
    /// dk `[H, NT, C, K]`.
    pub dk: HostTensor,
    /// dv `[H, NT, C, V]`.
    pub dv: HostTensor,
    /// dg `[H, NT, C, K]`.
    pub dg: HostTensor,
    /// dbeta `[H, NT, C]`.
    pub dbeta: HostTensor,
    /// dh0 `[B, N, H, K, V]`, passed through.
    pub dh0: Option<HostTensor>,
    /// da_log `[H]`, passed through.
    pub da_log: Option<HostTensor>,
    /// ddt_bias `[H*K]`, passed through.
    pub ddt_bias: Option<HostTensor>,
}

/// The caller's packed layout for one plan: aligns what comes in, compacts what goes out.
#[derive(Debug, Clone, Copy)]
pub struct PackedIo<'a> {
    plan: &'a SegmentPlan,
    layout: Layout,
}

impl<'a> PackedIo<'a> {
    /// The packed side of `plan` in `layout`.
    pub fn new(plan: &'a SegmentPlan, layout: Layout) -> Self {
        Self { plan, layout }
    }
    /// The plan.
    pub fn plan(&self) -> &SegmentPlan {
        self.plan
    }
    /// The caller's layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }
    /// Aligns a packed per-token tensor; errors name `arg`.
    pub fn align(&self, arg: &str, packed: &HostTensor) -> Result<HostTensor> {
        load_tensor(self.plan, self.layout, packed).map_err(|e| e.with_arg(arg))
    }
    /// Aligns a packed per-token scalar (beta-like, optional trailing 1) to `[H, NT, C]`.
    pub fn align_scalar(&self, arg: &str, packed: &HostTensor) -> Result<HostTensor> {
        load_scalar_tensor(self.plan, self.layout, packed).map_err(|e| e.with_arg(arg))
    }
    /// `do` in the aligned layout `[H, NT, C, V]`.
    pub fn align_do(&self, cotangents: &Cotangents) -> Result<HostTensor> {
        self.align("do", &cotangents.d_o)
    }
    /// q, k, v, g and beta in the aligned layout; the inputs' layout must be this one.
    pub fn align_inputs(&self, inputs: &KdaInputs) -> Result<AlignedInputs> {
        if inputs.config.layout != self.layout {
            return Err(KdaError::value(
                "layout",
                format!("the packed layout {}", self.layout),
                inputs.config.layout.to_string(),
            ));
        }
        Ok(AlignedInputs {
            q: self.align("q", &inputs.q)?,
            k: self.align("k", &inputs.k)?,
            v: self.align("v", &inputs.v)?,
            g: self.align("g", &inputs.g)?,
            beta: self.align_scalar("beta", &inputs.beta)?,
        })
    }
    /// An aligned `[H, NT, C, D]` result back in the caller's layout (padding tokens 0).
    pub fn packed(&self, arg: &str, aligned: &HostTensor) -> Result<HostTensor> {
        compact_tensor(self.plan, self.layout, aligned).map_err(|e| e.with_arg(arg))
    }
    /// An aligned `[H, NT, C]` scalar back in the caller's scalar shape `like` (e.g. beta's).
    pub fn packed_scalar(&self, arg: &str, aligned: &HostTensor, like: &[usize]) -> Result<HostTensor> {
        compact_scalar_tensor(self.plan, self.layout, aligned, like).map_err(|e| e.with_arg(arg))
    }
    /// All gradients in the caller's layout; dbeta takes `beta_shape` (a trailing 1 is kept).
    pub fn packed_gradients(&self, aligned: AlignedGradients, beta_shape: &[usize]) -> Result<KdaGradients> {
        Ok(KdaGradients {
            dq: self.packed("dq", &aligned.dq)?,
            dk: self.packed("dk", &aligned.dk)?,
            dv: self.packed("dv", &aligned.dv)?,
            dg: self.packed("dg", &aligned.dg)?,
            dbeta: self.packed_scalar("dbeta", &aligned.dbeta, beta_shape)?,
            dh0: aligned.dh0,
            da_log: aligned.da_log,
            ddt_bias: aligned.ddt_bias,
        })
    }
}
