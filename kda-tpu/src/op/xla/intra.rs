//! Chunk-local quantities (docs/kda.md, Chunks), batched over `N` chunks of `C = 64` rows: the
//! causal products through the decay tiles of [`super::tiles`], the WY solve and the decayed
//! keys and queries.

pub use super::tiles::Decay;
use super::tiles::{decay, grams};
use crate::hlo::Transpose;
use crate::hlo::{FnBuilder, Value};
use crate::op::hlo_ops::sum_last_keep;
use crate::Result;

/// What the forward computes chunk-parallel (everything but the state recurrence).
pub struct ChunkTerms {
    /// Decay factors.
    pub dc: Decay,
    /// `scale * sum_i q k exp(..)`, causal, `[N, C, C]`.
    pub aqk: Value,
    /// `sum_i k k exp(..)`, strictly causal (L without beta), `[N, C, C]`.
    pub kk: Value,
    /// `A = (I + L)^-1`.
    pub a: Value,
    /// `u = A (beta V)`, `[N, C, V]`.
    pub u: Value,
    /// `w = A (beta K exp(G))`, `[N, C, K]`.
    pub w: Value,
    /// `q exp(G)`.
    pub qg: Value,
    /// `k exp(G)`.
    pub keg: Value,
    /// `k exp(G_last - G)`.
    pub kg: Value,
}

/// The chunk-parallel forward terms from f32 `q, k` `[N, C, K]`, `v` `[N, C, V]`, activated
/// `g` `[N, C, K]` and `beta` `[N, C, 1]`; `products` selects the CPU form of the decay
/// factors ([`decay`]).
#[allow(clippy::too_many_arguments)]
pub fn chunk_terms(
    b: &mut FnBuilder,
    q: Value,
    k: Value,
    v: Value,
    g: Value,
    beta: Value,
    scale: f32,
    products: bool,
) -> Result<ChunkTerms> {
    let dc = decay(b, g, products)?;
    let [aqk, kk] = grams(b, &dc, [q, k], k)?;
    let aqk = b.mul_const(aqk, scale)?;
    let l = b.mul_bcast(kk, beta)?;
    let qg = b.mul(q, dc.eg)?;
    let keg = b.mul(k, dc.eg)?;
    let kg = b.mul(k, dc.eg_rest)?;
    let bv = b.mul_bcast(v, beta)?;
    let bk = b.mul_bcast(keg, beta)?;
    let a = super::solve::unit_lower_inverse(b, l)?;
    // Two products rather than one over [bv | bk]: the concatenation and the slices after it
    // would each write another copy.
    let u = b.batch_matmul(a, bv, Transpose::None)?;
    let w = b.batch_matmul(a, bk, Transpose::None)?;
    Ok(ChunkTerms { dc, aqk, kk, a, u, w, qg, keg, kg })
}

/// `sum over the last axis` of `x * y`, kept as width 1.
pub fn rowdot(b: &mut FnBuilder, x: Value, y: Value) -> Result<Value> {
    let p = b.mul(x, y)?;
    sum_last_keep(b, p)
}
