//! Chunk-local quantities (spec section 4), batched over `N` chunks of `C = 64` rows.
//!
//! Exponents: `G` is the inclusive cumsum of the (natural-log) gate inside the chunk. Every
//! factor `exp(G_t - G_j)` is formed either per element inside a 16-row diagonal block (masked
//! to `j <= t` *before* `exp`), or as `exp(G_t - G_r) * exp(G_r - G_j)` with `r` the first row
//! of `t`'s block, both exponents `<= 0` for `g <= 0`. No positive exponent is formed, so
//! `g = -1000` (a hard reset) and `g = -5` per token stay finite and exact.

use super::ops::{causal_mask, index_mask, keep, keep_or_neg_inf, sum_last_keep};
use super::spec::{CHUNK, SUB};
use crate::hlo::{Cmp, ElemType, FnBuilder, Value};
use crate::Result;

const NB: i64 = (CHUNK / SUB) as i64;
const C: i64 = CHUNK as i64;
const S: i64 = SUB as i64;

/// The decay factors of a batch of chunks.
pub struct Decay {
    /// `exp(G)`, `[N, C, K]`.
    pub eg: Value,
    /// `exp(G_last - G)`, `[N, C, K]`.
    pub eg_rest: Value,
    /// `exp(G_last)`, `[N, K]`: the whole-chunk decay.
    pub eg_last: Value,
    /// `exp(G_t - G_j)` on the diagonal 16-blocks, 0 for `j > t`: `[N, 4, 16, 16, K]`.
    pub e_diag: Value,
    /// `exp(G_t - G_first(block of t))`, `[N, 4, 16, K]`.
    pub row: Value,
    /// `exp(G_first(I) - G_j)` for `j` in blocks `J < I`, else 0: `[N, 4(I), 4(J), 16, K]`.
    pub col: Value,
}

/// Builds the decay factors from the activated gate `g` `[N, C, K]` (0 at padding rows).
pub fn decay(b: &mut FnBuilder, g: Value) -> Result<Decay> {
    let (n, k) = (g.dims()[0], g.dims()[2]);
    let g4 = b.reshape(g, &[n * NB, S, k])?;
    let gl = super::ops::cumsum_rows(b, g4, false)?; // local cumsum inside each 16-block
    let gl = b.reshape(gl, &[n, NB, S, k])?;
    let block_tot = b.slice_axis(gl, 2, S - 1, S)?;
    let block_tot = b.reshape(block_tot, &[n, NB, k])?;
    let first = b.slice_axis(gl, 2, 0, 1)?; // G_r - G_(r-1): the first row of each block
    let incl = super::ops::cumsum_rows(b, block_tot, false)?;
    let excl = b.sub(incl, block_tot)?; // prefix of earlier blocks
    let last = b.slice_axis(incl, 1, NB - 1, NB)?;
    let last = b.reshape(last, &[n, k])?;
    // exp(G): G = gl + excl <= 0.
    let excl_b = b.broadcast_in_dim(excl, &[n, NB, S, k], &[0, 1, 3])?;
    let gfull = b.add(gl, excl_b)?;
    let eg = b.exp(gfull)?;
    let eg = b.reshape(eg, &[n, C, k])?;
    // exp(G_last - G) = exp((G_last - excl) - gl), the suffix of block totals minus gl.
    let last_b = b.broadcast_in_dim(last, &[n, NB, k], &[0, 2])?;
    let suffix = b.sub(last_b, excl)?;
    let suffix = b.broadcast_in_dim(suffix, &[n, NB, S, k], &[0, 1, 3])?;
    let rest = b.sub(suffix, gl)?;
    let eg_rest = b.exp(rest)?;
    let eg_rest = b.reshape(eg_rest, &[n, C, k])?;
    let eg_last = b.exp(last)?;
    // Diagonal blocks, per element: exp(gl_t - gl_j) for j <= t.
    let d5 = [n, NB, S, S, k];
    let gt = b.broadcast_in_dim(gl, &d5, &[0, 1, 2, 4])?;
    let gj = b.broadcast_in_dim(gl, &d5, &[0, 1, 3, 4])?;
    let diff = b.sub(gt, gj)?;
    let m = causal_mask(b, &d5, 2, 3, false)?;
    let diff = keep_or_neg_inf(b, m, diff)?;
    let e_diag = b.exp(diff)?;
    // Row factor: exp(gl_t - gl_first) <= 1.
    let first_b = b.broadcast_in_dim(first, &[n, NB, S, k], &[0, 1, 2, 3])?;
    let row = b.sub(gl, first_b)?;
    let row = b.exp(row)?;
    // Column factor for blocks J < I: exp((first_I + excl_I) - (excl_J + gl_j)) <= 1.
    let first_r = b.reshape(first, &[n, NB, k])?;
    let a = b.add(first_r, excl)?;
    let d5c = [n, NB, NB, S, k];
    let a = b.broadcast_in_dim(a, &d5c, &[0, 1, 4])?;
    let bj = b.add(gl, excl_b)?;
    let bj = b.broadcast_in_dim(bj, &d5c, &[0, 2, 3, 4])?;
    let e = b.sub(a, bj)?;
    let m = index_mask(b, &d5c, 2, Cmp::Lt, 1)?;
    let e = keep_or_neg_inf(b, m, e)?;
    let col = b.exp(e)?;
    Ok(Decay { eg, eg_rest, eg_last, e_diag, row, col })
}

/// `[N, C, D]` viewed as `[N, 4, 16, D]`.
fn blocks(b: &mut FnBuilder, x: Value) -> Result<Value> {
    let (n, d) = (x.dims()[0], x.dims()[2]);
    Ok(b.reshape(x, &[n, NB, S, d])?)
}

/// `M[t, j] = sum_i a_t[i] b_j[i] exp(G_t[i] - G_j[i])` for `j <= t` (`j < t` when `strict`),
/// else 0: `[N, C, C]`.
pub fn decayed_gram(b: &mut FnBuilder, dc: &Decay, x: Value, y: Value, strict: bool) -> Result<Value> {
    let (n, k) = (x.dims()[0], x.dims()[2]);
    let x4 = blocks(b, x)?;
    let y4 = blocks(b, y)?;
    let d5 = [n, NB, S, S, k];
    let xt = b.broadcast_in_dim(x4, &d5, &[0, 1, 2, 4])?;
    let yj = b.broadcast_in_dim(y4, &d5, &[0, 1, 3, 4])?;
    let p = b.mul(xt, yj)?;
    let p = b.mul(p, dc.e_diag)?;
    let diag = b.reduce_sum(p, &[4])?; // [N, 4, t, j]
    let diag = if strict {
        let m = causal_mask(b, &[n, NB, S, S], 2, 3, true)?;
        keep(b, m, diag)?
    } else {
        diag
    };
    // Off-diagonal blocks through the factored exponent.
    let xr = b.mul(x4, dc.row)?;
    let yc = b.broadcast_in_dim(y4, &[n, NB, NB, S, k], &[0, 2, 3, 4])?;
    let yc = b.mul(yc, dc.col)?;
    let yc = b.reshape(yc, &[n, NB, C, k])?;
    let off = b.dot_general(xr, yc, &[0, 1], &[0, 1], &[3], &[3], ElemType::F32)?; // [N, I, 16, 64]
    let de = b.broadcast_in_dim(diag, &[n, NB, S, NB, S], &[0, 1, 2, 4])?;
    let m = index_mask(b, &[n, NB, S, NB, S], 3, Cmp::Eq, 1)?;
    let de = keep(b, m, de)?;
    let de = b.reshape(de, &[n, NB, S, C])?;
    let full = b.add(off, de)?;
    Ok(b.reshape(full, &[n, C, C])?)
}

/// The diagonal 16-blocks of `M` `[N, C, C]` as `[N, 4, 16, 16]`.
fn diag_blocks(b: &mut FnBuilder, m: Value) -> Result<Value> {
    let n = m.dims()[0];
    let m5 = b.reshape(m, &[n, NB, S, NB, S])?;
    let mask = index_mask(b, &[n, NB, S, NB, S], 3, Cmp::Eq, 1)?;
    let m5 = keep(b, mask, m5)?;
    Ok(b.reduce_sum(m5, &[3])?)
}

/// Row side: `R_t = sum_{j <= t} M[t, j] x_j * exp(G_t - G_j)`, `[N, C, K]` (M causal).
pub fn row_side(b: &mut FnBuilder, dc: &Decay, m: Value, x: Value) -> Result<Value> {
    let (n, k) = (x.dims()[0], x.dims()[2]);
    let x4 = blocks(b, x)?;
    let d5 = [n, NB, S, S, k];
    let md = diag_blocks(b, m)?;
    let md = b.broadcast_in_dim(md, &d5, &[0, 1, 2, 3])?;
    let xj = b.broadcast_in_dim(x4, &d5, &[0, 1, 3, 4])?;
    let p = b.mul(md, xj)?;
    let p = b.mul(p, dc.e_diag)?;
    let diag = b.reduce_sum(p, &[3])?; // [N, I, t, K]
    let xc = b.broadcast_in_dim(x4, &[n, NB, NB, S, k], &[0, 2, 3, 4])?;
    let xc = b.mul(xc, dc.col)?;
    let xc = b.reshape(xc, &[n, NB, C, k])?;
    let rows = b.reshape(m, &[n, NB, S, C])?;
    let off = b.dot_general(rows, xc, &[0, 1], &[0, 1], &[3], &[2], ElemType::F32)?; // [N, I, 16, K]
    let off = b.mul(off, dc.row)?;
    let r = b.add(off, diag)?;
    Ok(b.reshape(r, &[n, C, k])?)
}

/// Column side: `C_j = sum_{t >= j} M[t, j] y_t * exp(G_t - G_j)`, `[N, C, K]` (M causal).
pub fn col_side(b: &mut FnBuilder, dc: &Decay, m: Value, y: Value) -> Result<Value> {
    let (n, k) = (y.dims()[0], y.dims()[2]);
    let y4 = blocks(b, y)?;
    let d5 = [n, NB, S, S, k];
    let md = diag_blocks(b, m)?;
    let md = b.broadcast_in_dim(md, &d5, &[0, 1, 2, 3])?;
    let yt = b.broadcast_in_dim(y4, &d5, &[0, 1, 2, 4])?;
    let p = b.mul(md, yt)?;
    let p = b.mul(p, dc.e_diag)?;
    let diag = b.reduce_sum(p, &[2])?; // [N, J, j, K]
    let yr = b.mul(y4, dc.row)?;
    let rows = b.reshape(m, &[n, NB, S, C])?;
    let z = b.dot_general(rows, yr, &[0, 1], &[0, 1], &[2], &[2], ElemType::F32)?; // [N, I, 64, K]
    let z = b.reshape(z, &[n, NB, NB, S, k])?;
    let z = b.mul(z, dc.col)?;
    let off = b.reduce_sum(z, &[1])?; // [N, J, j, K]
    let c = b.add(off, diag)?;
    Ok(b.reshape(c, &[n, C, k])?)
}

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
/// `g` `[N, C, K]` and `beta` `[N, C, 1]`.
pub fn chunk_terms(
    b: &mut FnBuilder,
    q: Value,
    k: Value,
    v: Value,
    g: Value,
    beta: Value,
    scale: f32,
) -> Result<ChunkTerms> {
    let dc = decay(b, g)?;
    let aqk = decayed_gram(b, &dc, q, k, false)?;
    let aqk = b.mul_const(aqk, scale)?;
    let kk = decayed_gram(b, &dc, k, k, true)?;
    let l = b.mul_bcast(kk, beta)?;
    let qg = b.mul(q, dc.eg)?;
    let keg = b.mul(k, dc.eg)?;
    let kg = b.mul(k, dc.eg_rest)?;
    let bv = b.mul_bcast(v, beta)?;
    let bk = b.mul_bcast(keg, beta)?;
    let vd = v.dims()[2];
    let rhs = b.concatenate(&[bv, bk], 2)?;
    let a = super::solve::unit_lower_inverse(b, l)?;
    let x = b.batch_matmul(a, rhs, false, false)?;
    let u = super::ops::last_axis(b, x, 0, vd)?;
    let w = super::ops::last_axis(b, x, vd, x.dims()[2])?;
    Ok(ChunkTerms { dc, aqk, kk, a, u, w, qg, keg, kg })
}

/// `sum over the last axis` of `x * y`, kept as width 1.
pub fn rowdot(b: &mut FnBuilder, x: Value, y: Value) -> Result<Value> {
    let p = b.mul(x, y)?;
    sum_last_keep(b, p)
}
