//! Chunk-local quantities (spec section 4), batched over `N` chunks of `C = 64` rows.
//!
//! Decay factors `exp(G_t - G_j)` (`G` the in-chunk cumulative log-decay) inside a chunk are
//! handled hierarchically: the causal `C x C` pattern splits into the lower-left quadrants of
//! diagonal blocks of size 2, 4, ..., 64. For the quadrant of a `2m` block with first lower row
//! `r`, `exp(G_t - G_j) = exp(sum_{r < s <= t} g_s) * exp(sum_{j < s <= r} g_s)`: both
//! exponents are sums of `g <= 0` (no positive exponent is ever formed), each computed as a
//! direct (prefix or suffix) sum of the tokens it spans, never as a difference of two long
//! cumulative sums, so nothing cancels. Every quadrant is then a batched matmul, and the
//! diagonal is `exp(0) = 1`. The work is one dense triangular matmul's worth plus two `[C, K]`
//! exponentials per level.

use super::ops::{cumsum_rows, index_mask, keep, splat, sum_last_keep};
use super::spec::CHUNK;
use crate::hlo::{Cmp, ElemType, FnBuilder, Value};
use crate::Result;

const C: i64 = CHUNK as i64;

/// The factors of one level: quadrants of `2m` blocks, `Q = C / 2m` of them per chunk.
pub struct Level {
    /// Half-block size.
    pub m: i64,
    /// `exp(sum_{r < s <= t} g_s)` for the lower-half rows `t`, `[N, Q, m, K]`.
    pub row: Value,
    /// `exp(sum_{j < s <= r} g_s)` for the upper-half rows `j`, `[N, Q, m, K]`.
    pub col: Value,
}

/// The decay factors of a batch of chunks.
pub struct Decay {
    /// `exp(G)`, `[N, C, K]`.
    pub eg: Value,
    /// `exp(G_last - G)`, `[N, C, K]`.
    pub eg_rest: Value,
    /// `exp(G_last)`, `[N, K]`: the whole-chunk decay.
    pub eg_last: Value,
    /// Levels `m = 1, 2, 4, ..., C/2`.
    pub levels: Vec<Level>,
}

/// Exclusive suffix sums along `axis` (1 or 2, of a rank 3 or 4 tensor): `sum_{s > t} x_s`.
fn suffix_exclusive(b: &mut FnBuilder, x: Value, axis: usize) -> Result<Value> {
    let n = x.dims()[axis];
    if n == 1 {
        return splat(b, 0.0, x.dims());
    }
    let incl = cumsum_axis(b, x, axis, true)?;
    let tail = b.slice_axis(incl, axis, 1, n)?;
    let zero = b.constant_f32(0.0, super::ops::f32t(&[]))?;
    let r = x.rank();
    let low = vec![0; r];
    let mut high = vec![0; r];
    high[axis] = 1;
    b.pad(tail, zero, &low, &high, &vec![0; r])
}

/// Levels with half-blocks up to this size use elementwise products and reductions instead of
/// batched matmuls: thousands of tiny matrices cost far more in per-matrix overhead than the
/// arithmetic.
const SMALL: i64 = 4;

/// Cumulative sum along `axis`: `reduce_window` for short axes, else a batched triangular
/// matmul ([`cumsum_rows`] on a reshape).
fn cumsum_axis(b: &mut FnBuilder, x: Value, axis: usize, reverse: bool) -> Result<Value> {
    let dims = x.dims().to_vec();
    if dims[axis] <= 2 * SMALL {
        return b.cumsum(x, axis, reverse);
    }
    let lead: i64 = dims[..axis].iter().product();
    let trail: i64 = dims[axis + 1..].iter().product();
    let x3 = b.reshape(x, &[lead, dims[axis], trail])?;
    let c = cumsum_rows(b, x3, reverse)?;
    b.reshape(c, &dims)
}

/// `sum over one axis` of `lhs[..., a, b] * rhs[..., c, K]` for the three quadrant products,
/// as a batched matmul or, for small `m`, an elementwise product and a reduction.
#[derive(Clone, Copy)]
enum Pair {
    /// `[N,Q,m,K] x [N,Q,m,K] -> [N,Q,m,m]`, contracting K.
    Gram,
    /// `[N,Q,t,j] x [N,Q,j,K] -> [N,Q,t,K]`, contracting j.
    Rows,
    /// `[N,Q,t,j] x [N,Q,t,K] -> [N,Q,j,K]`, contracting t.
    Cols,
}

fn quadrant_product(b: &mut FnBuilder, kind: Pair, lhs: Value, rhs: Value, m: i64) -> Result<Value> {
    if m > SMALL {
        return match kind {
            Pair::Gram => b.dot_general(lhs, rhs, &[0, 1], &[0, 1], &[3], &[3], ElemType::F32),
            Pair::Rows => b.dot_general(lhs, rhs, &[0, 1], &[0, 1], &[3], &[2], ElemType::F32),
            Pair::Cols => b.dot_general(lhs, rhs, &[0, 1], &[0, 1], &[2], &[2], ElemType::F32),
        };
    }
    let (n, q, k) = (rhs.dims()[0], rhs.dims()[1], rhs.dims()[3]);
    let (d5, lmap, rmap, axis): ([i64; 5], [i64; 4], [i64; 4], i64) = match kind {
        Pair::Gram => ([n, q, m, m, k], [0, 1, 2, 4], [0, 1, 3, 4], 4),
        Pair::Rows => ([n, q, m, m, k], [0, 1, 2, 3], [0, 1, 3, 4], 3),
        Pair::Cols => ([n, q, m, m, k], [0, 1, 3, 2], [0, 1, 3, 4], 3),
    };
    let l = b.broadcast_in_dim(lhs, &d5, &lmap)?;
    let r = b.broadcast_in_dim(rhs, &d5, &rmap)?;
    let p = b.mul(l, r)?;
    b.reduce_sum(p, &[axis])
}

/// `[N, C, D]` split into the halves of its `2m` blocks: `(upper, lower)`, each `[N, Q, m, D]`.
fn halves(b: &mut FnBuilder, x: Value, m: i64) -> Result<(Value, Value)> {
    let (n, d) = (x.dims()[0], x.dims()[2]);
    let q = C / (2 * m);
    let x5 = b.reshape(x, &[n, q, 2, m, d])?;
    let up = b.slice_axis(x5, 2, 0, 1)?;
    let lo = b.slice_axis(x5, 2, 1, 2)?;
    Ok((b.reshape(up, &[n, q, m, d])?, b.reshape(lo, &[n, q, m, d])?))
}

/// The inverse of [`halves`] with a zero upper (or lower) half: `[N, Q, m, D]` to `[N, C, D]`.
fn place_half(b: &mut FnBuilder, x: Value, lower: bool) -> Result<Value> {
    let (n, q, m, d) = (x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]);
    let z = splat(b, 0.0, &[n, q, m, d])?;
    let parts = if lower { [z, x] } else { [x, z] };
    let y = b.concatenate(&parts, 2)?;
    b.reshape(y, &[n, C, d])
}

/// Builds the decay factors from the activated gate `g` `[N, C, K]` (0 at padding rows).
pub fn decay(b: &mut FnBuilder, g: Value) -> Result<Decay> {
    let (n, k) = (g.dims()[0], g.dims()[2]);
    let gcum = cumsum_axis(b, g, 1, false)?;
    let eg = b.exp(gcum)?;
    let rest = suffix_exclusive(b, g, 1)?;
    let eg_rest = b.exp(rest)?;
    let last = b.slice_axis(gcum, 1, C - 1, C)?;
    let last = b.reshape(last, &[n, k])?;
    let eg_last = b.exp(last)?;
    let mut levels = Vec::new();
    let mut m = 1;
    while m < C {
        let q = C / (2 * m);
        let (up, lo) = halves(b, g, m)?;
        // Row side: prefix sums of the lower half with its first row left out.
        let iota = b.iota(crate::hlo::TensorType::new(ElemType::I32, &[n, q, m, k]), 2)?;
        let zero_i = b.constant_i32(0, crate::hlo::TensorType::new(ElemType::I32, &[n, q, m, k]))?;
        let not_first = b.compare(Cmp::Gt, iota, zero_i)?;
        let loz = keep(b, not_first, lo)?;
        let rowe = cumsum_axis(b, loz, 2, false)?;
        let row = b.exp(rowe)?;
        // Column side: g at the lower half's first row plus suffix sums of the upper half.
        let suf = suffix_exclusive(b, up, 2)?;
        let gr = b.slice_axis(lo, 2, 0, 1)?;
        let gr = b.reshape(gr, &[n, q, k])?;
        let gr = b.broadcast_in_dim(gr, &[n, q, m, k], &[0, 1, 3])?;
        let cole = b.add(suf, gr)?;
        let col = b.exp(cole)?;
        levels.push(Level { m, row, col });
        m *= 2;
    }
    Ok(Decay { eg, eg_rest, eg_last, levels })
}

/// The `2m` diagonal blocks' lower-left quadrants of `M` `[N, C, C]`: `[N, Q, m, m]`.
fn quadrants(b: &mut FnBuilder, mat: Value, m: i64) -> Result<Value> {
    let n = mat.dims()[0];
    let q = C / (2 * m);
    let m5 = b.reshape(mat, &[n, q, 2 * m, q, 2 * m])?;
    let mask = index_mask(b, &[n, q, 2 * m, q, 2 * m], 3, Cmp::Eq, 1)?;
    let m5 = keep(b, mask, m5)?;
    let blocks = b.reduce_sum(m5, &[3])?; // [N, Q, 2m, 2m]
    b.slice(blocks, &[0, 0, m, 0], &[n, q, 2 * m, m], &[1, 1, 1, 1])
}

/// The diagonal of `M` `[N, C, C]` as `[N, C, 1]`.
fn diagonal(b: &mut FnBuilder, mat: Value) -> Result<Value> {
    let eye = index_mask(b, mat.dims(), 1, Cmp::Eq, 2)?;
    let d = keep(b, eye, mat)?;
    sum_last_keep(b, d)
}

/// `M[t, j] = sum_i x_t[i] y_j[i] exp(G_t[i] - G_j[i])` for `j <= t` (`j < t` when `strict`),
/// else 0: `[N, C, C]`.
pub fn decayed_gram(b: &mut FnBuilder, dc: &Decay, x: Value, y: Value, strict: bool) -> Result<Value> {
    let n = x.dims()[0];
    // Blocks of size 1: the diagonal (decay factor 1).
    let d = if strict { splat(b, 0.0, &[n, C, 1])? } else { rowdot(b, x, y)? };
    let mut blocks = b.reshape(d, &[n, C, 1, 1])?;
    for lv in &dc.levels {
        let m = lv.m;
        let q = C / (2 * m);
        let (_, xl) = halves(b, x, m)?;
        let (yu, _) = halves(b, y, m)?;
        let xr = b.mul(xl, lv.row)?;
        let yc = b.mul(yu, lv.col)?;
        let off = quadrant_product(b, Pair::Gram, xr, yc, m)?; // [N, Q, m, m]
        let prev = b.reshape(blocks, &[n, q, 2, m, m])?;
        let upper = b.slice_axis(prev, 2, 0, 1)?;
        let upper = b.reshape(upper, &[n, q, m, m])?;
        let lower = b.slice_axis(prev, 2, 1, 2)?;
        let lower = b.reshape(lower, &[n, q, m, m])?;
        let z = splat(b, 0.0, &[n, q, m, m])?;
        let top = b.concatenate(&[upper, z], 3)?;
        let bottom = b.concatenate(&[off, lower], 3)?;
        blocks = b.concatenate(&[top, bottom], 2)?; // [N, Q, 2m, 2m]
    }
    b.reshape(blocks, &[n, C, C])
}

/// Row side: `R_t = sum_{j <= t} M[t, j] x_j * exp(G_t - G_j)`, `[N, C, K]` (M causal).
pub fn row_side(b: &mut FnBuilder, dc: &Decay, mat: Value, x: Value) -> Result<Value> {
    let dg = diagonal(b, mat)?;
    let mut r = b.mul_bcast(x, dg)?;
    for lv in &dc.levels {
        let mq = quadrants(b, mat, lv.m)?;
        let (xu, _) = halves(b, x, lv.m)?;
        let xc = b.mul(xu, lv.col)?;
        let t = quadrant_product(b, Pair::Rows, mq, xc, lv.m)?; // [N, Q, m, K]
        let t = b.mul(t, lv.row)?;
        let t = place_half(b, t, true)?;
        r = b.add(r, t)?;
    }
    Ok(r)
}

/// Column side: `C_j = sum_{t >= j} M[t, j] y_t * exp(G_t - G_j)`, `[N, C, K]` (M causal).
pub fn col_side(b: &mut FnBuilder, dc: &Decay, mat: Value, y: Value) -> Result<Value> {
    let dg = diagonal(b, mat)?;
    let mut c = b.mul_bcast(y, dg)?;
    for lv in &dc.levels {
        let mq = quadrants(b, mat, lv.m)?;
        let (_, yl) = halves(b, y, lv.m)?;
        let yr = b.mul(yl, lv.row)?;
        let t = quadrant_product(b, Pair::Cols, mq, yr, lv.m)?; // [N, Q, m(j), K]
        let t = b.mul(t, lv.col)?;
        let t = place_half(b, t, false)?;
        c = b.add(c, t)?;
    }
    Ok(c)
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
