//! The GPU kernels of the KDA op, written in [`crate::lang`] and tiled for a GPU (lowered to
//! Triton for XLA's CUDA plugin, or through the interpret lowering on any plugin). So far the
//! fixed-row forward: a chunk-parallel terms kernel ([`terms`]: one program per lane and
//! chunk) and a state recurrence ([`recurrence`]: one program per lane and block of state
//! columns, looping over the chunks), wired by [`forward_module`].

pub mod recurrence;
pub mod terms;

use kda_core::DType;

use crate::error::{Result, TpuError};
use crate::hlo::{FnBuilder, Module, TensorType};
use crate::lang::{Lowering, MatPrecision, Ref, TritonParams};

/// Tokens per chunk.
pub use super::chunk::C;
/// Tokens per sub-chunk of the terms kernel.
pub const SUB: i64 = 16;
/// The widest block of state columns one recurrence program holds.
pub const MAX_BV: i64 = 64;

/// What the terms kernel hands the recurrence per chunk (`u` and `eg` in f32, the others in
/// [`ForwardShape::factor_dtype`]): its results, the recurrence's inputs.
#[derive(Clone, Copy, Debug)]
pub struct Factors {
    /// `w = A (beta k e^G)` `[L, T, K]`.
    pub w: Ref,
    /// `u = A (beta v)` `[L, T, V]`.
    pub u: Ref,
    /// `scale q e^G` `[L, T, K]`.
    pub qg: Ref,
    /// `k e^(G_C - G)` `[L, T, K]`.
    pub kg: Ref,
    /// `scale Aqk` `[L, T, C]`, each chunk's rows.
    pub aqk: Ref,
    /// `e^(G_C)` `[L, NT, K]`, each chunk's whole decay.
    pub eg: Ref,
}

impl Factors {
    /// The six, in order.
    pub fn all(&self) -> [Ref; 6] {
        [self.w, self.u, self.qg, self.kg, self.aqk, self.eg]
    }
}

/// The problem the GPU forward kernels take: `lanes` (heads x rows) of `t` tokens, fixed length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForwardShape {
    /// Heads times rows.
    pub lanes: i64,
    /// Tokens per lane, a multiple of 64.
    pub t: i64,
    /// Key width, a power of two up to 256.
    pub k: i64,
    /// Value width, a power of two up to 256.
    pub v: i64,
    /// The dtype of `q`, `k`, `v`, `beta` (f32 or bf16); `g` is f32.
    pub dtype: DType,
    /// Whether an initial state is given.
    pub h0: bool,
    /// The query scale.
    pub scale: f64,
    /// How the terms kernel launches on a GPU.
    pub terms_launch: TritonParams,
    /// How the recurrence launches on a GPU.
    pub recurrence_launch: TritonParams,
}

impl ForwardShape {
    /// `lanes` of `t` tokens, `k` and `v` wide, in `dtype`, scale `k^-1/2`, no initial state.
    /// The launches spill least at the primary shape (H200, bf16): 16 warps for a terms
    /// program (a whole chunk's tiles), 8 for a recurrence program; one pipeline stage (two
    /// asked 160 KiB of shared memory for the recurrence's loads and did not spill less).
    pub fn new(lanes: i64, t: i64, k: i64, v: i64, dtype: DType) -> Self {
        let launch = |num_warps| TritonParams { num_warps, num_stages: 1, ..TritonParams::default() };
        ForwardShape {
            lanes,
            t,
            k,
            v,
            dtype,
            h0: false,
            scale: 1.0 / (k as f64).sqrt(),
            terms_launch: launch(16),
            recurrence_launch: launch(8),
        }
    }

    /// The products' precision: one bf16 pass for bf16 inputs, full f32 for f32 ones.
    pub fn precision(&self) -> MatPrecision {
        match self.dtype {
            DType::BF16 => MatPrecision::Default,
            _ => MatPrecision::Highest,
        }
    }

    /// The type the terms kernel hands over the factors that only feed products (`w`, `qg`,
    /// `kg`, `aqk`): the input dtype, since a bf16 product rounds its operands to bf16 anyway
    /// (the same bits, half the traffic and registers); `u` and `eg` stay f32.
    pub fn factor_dtype(&self) -> DType {
        self.dtype
    }

    /// State columns per recurrence program.
    pub fn bv(&self) -> i64 {
        self.v.min(MAX_BV)
    }

    /// An `Unsupported` error naming the limit the shape is past.
    pub fn check(&self) -> Result<()> {
        let pow2 = |n: i64| n > 0 && n & (n - 1) == 0;
        let limit = if !(pow2(self.k) && pow2(self.v) && self.k <= 256 && self.v <= 256) {
            Some(format!("K = {}, V = {}: the GPU kernels take powers of two up to 256", self.k, self.v))
        } else if self.t < C || self.t % C != 0 {
            Some(format!("T = {}: the GPU kernels take whole 64-token chunks", self.t))
        } else if !matches!(self.dtype, DType::F32 | DType::BF16) {
            Some(format!("{}: the GPU kernels take f32 or bf16", self.dtype))
        } else if self.lanes < 1 {
            Some("no lanes".to_string())
        } else {
            None
        };
        match limit {
            Some(m) => Err(TpuError::unsupported("GPU forward kernels", m)),
            None => Ok(()),
        }
    }
}

/// A module whose `@main(q, k, v, g, beta[, h0])` (`[L, T, K]`, `[L, T, K]`, `[L, T, V]` in the
/// shape's dtype, `g` `[L, T, K]` f32, `beta` `[L, T, 1]`, `h0` `[L, K, V]` f32) returns
/// `(o [L, T, V], ht [L, K, V])` in f32, the two kernels lowered as `lowering` says.
pub fn forward_module(s: &ForwardShape, lowering: Lowering) -> Result<String> {
    s.check()?;
    let (l, t, k, v) = (s.lanes, s.t, s.k, s.v);
    let ty = |d: DType, dims: &[i64]| TensorType::new(d, dims);
    let mut f = FnBuilder::new("main", true);
    let q = f.arg(ty(s.dtype, &[l, t, k]))?;
    let kk = f.arg(ty(s.dtype, &[l, t, k]))?;
    let vv = f.arg(ty(s.dtype, &[l, t, v]))?;
    let g = f.arg(ty(DType::F32, &[l, t, k]))?;
    let beta = f.arg(ty(s.dtype, &[l, t, 1]))?;
    let h0 = if s.h0 { Some(f.arg(ty(DType::F32, &[l, k, v]))?) } else { None };
    let (tk, tr) = terms::terms_kernel(s)?;
    let mut a = tk.bindings();
    for (r, x) in [(tr.q, q), (tr.k, kk), (tr.v, vv), (tr.g, g), (tr.beta, beta)] {
        a.input(r, x)?;
    }
    let terms = tk.call(&mut f, &lowering, a)?;
    let (rk, rr) = recurrence::recurrence_kernel(s)?;
    let mut a = rk.bindings();
    for (r, from) in rr.factors.all().into_iter().zip(tr.factors.all()) {
        a.input(r, terms.get(from)?)?;
    }
    if let (Some(r), Some(x)) = (rr.h0, h0) {
        a.input(r, x)?;
    }
    let out = rk.call(&mut f, &lowering, a)?;
    f.ret(&[out.get(rr.o)?, out.get(rr.ht)?])?;
    let mut m = Module::new();
    m.add(f)?;
    Ok(m.to_text())
}
