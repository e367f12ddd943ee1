//! Building blocks of the KDA kernels, written once on a [`Body`] so that both lowerings share
//! them.

use kda_core::DType;

use super::body::{Binary, Body, MatPrecision, Offset, Ref, V};
use crate::error::{Result, TpuError};
use crate::hlo::Cmp;

/// Rows of a chunk and of its diagonal blocks.
const C: i64 = 64;
const S: i64 = 16;
/// Rows of the blocks of [`chunk_terms`] (its diagonal tiles are `T x T`).
const T: i64 = 8;

fn at(r: i64, c: i64) -> [Offset; 2] {
    [Offset::Const(r), Offset::Const(c)]
}

fn mm(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.matmul(x, y, (1, 0), MatPrecision::Highest)
}

/// The identity of `n x n`, f32.
fn eye(b: &mut Body, n: i64) -> Result<V> {
    let (r, c) = (b.iota(&[n, n], 0)?, b.iota(&[n, n], 1)?);
    let d = b.compare(Cmp::Eq, &r, &c)?;
    let (one, zero) = (b.splat(1.0, DType::F32, &[n, n])?, b.splat(0.0, DType::F32, &[n, n])?);
    b.select(&d, &one, &zero)
}

/// `(I + L)^-1` of a strictly lower 16x16 `l`: `(I - L)(I + L^2)(I + L^4)(I + L^8)`, exact for
/// a nilpotent `L` of that size.
fn diagonal_inverse(b: &mut Body, l: &V) -> Result<V> {
    let i = eye(b, S)?;
    let mut e = b.binary(Binary::Sub, &i, l)?;
    let mut p = l.clone();
    for _ in 0..3 {
        p = mm(b, &p, &p)?;
        let f = b.binary(Binary::Add, &i, &p)?;
        e = mm(b, &e, &f)?;
    }
    Ok(e)
}

/// `A = (I + L)^-1` of a strictly lower 64x64 f32 `l`, as the XLA programs build it: each
/// 16-row diagonal block inverted by repeated squaring, then inverses doubled in size (with
/// `E_u`, `E_l` the inverses of a block's diagonal halves, its inverse is
/// `[[E_u, 0], [-E_l L_lu E_u, E_l]]`), 16 -> 32 -> 64 rows. `work` and `out` are 64x64 f32
/// scratch buffers of the kernel (`out` holds `A` afterwards).
pub fn unit_lower_inverse(b: &mut Body, l: &V, work: Ref, out: Ref) -> Result<V> {
    if l.ty.elem != DType::F32 || l.ty.dims != [C, C] {
        return Err(TpuError::builder("mosaic unit_lower_inverse", format!("a 64x64 f32 L, not {:?}", l.ty)));
    }
    b.store_all(work, l)?;
    let zero = b.splat(0.0, DType::F32, &[C, C])?;
    b.store_all(out, &zero)?;
    for i in 0..C / S {
        let li = b.load(work, &at(i * S, i * S), &[S, S])?;
        let ei = diagonal_inverse(b, &li)?;
        b.store(out, &at(i * S, i * S), &ei)?;
    }
    // Doublings: blocks of `half` rows pair up into blocks of `2 * half`.
    for half in [S, 2 * S] {
        for top in (0..C).step_by((2 * half) as usize) {
            let eu = b.load(out, &at(top, top), &[half, half])?;
            let el = b.load(out, &at(top + half, top + half), &[half, half])?;
            let llu = b.load(work, &at(top + half, top), &[half, half])?;
            let t = mm(b, &el, &llu)?;
            let t = mm(b, &t, &eu)?;
            let z = b.splat(0.0, DType::F32, &[half, half])?;
            let off = b.binary(Binary::Sub, &z, &t)?;
            b.store(out, &at(top + half, top), &off)?;
        }
    }
    b.load_all(out)
}

/// The chunk-local terms of the chunked forward (docs/kda.md, Chunks) from one chunk's
/// `q`, `k` `[64, K]` f32, log-decays `g` `[64, K]` f32 (already floored) and `beta` `[64, 1]`:
/// `aqk` (`scale` included, causal with the diagonal), `l` (strictly lower, `beta` applied),
/// `qg = q e^G`, `kg = k e^(G_C - G)`, `kbg = beta k e^G` and `eg_last = e^(G_C)` `[1, K]`.
#[derive(Clone, Debug)]
pub struct ChunkTerms {
    /// `scale sum_i q_t[i] k_j[i] e^(G_t[i] - G_j[i])` for `j <= t`, `[64, 64]`.
    pub aqk: V,
    /// `beta_t sum_i k_t[i] k_j[i] e^(G_t[i] - G_j[i])` for `j < t`, `[64, 64]`.
    pub l: V,
    /// `q e^G`, `[64, K]`.
    pub qg: V,
    /// `k e^(G_C - G)`, `[64, K]`.
    pub kg: V,
    /// `beta k e^G`, `[64, K]`.
    pub kbg: V,
    /// `e^(G_C)`, the whole chunk's decay, `[1, K]`.
    pub eg_last: V,
}

/// A 0/1 f32 array of `dims` that is 1 where iota `a` compares `cmp` to iota `b`.
fn mask(b: &mut Body, dims: &[i64], a: usize, cmp: Cmp, c: usize) -> Result<V> {
    let (x, y) = (b.iota(dims, a)?, b.iota(dims, c)?);
    let m = b.compare(cmp, &x, &y)?;
    let (one, zero) = (b.splat(1.0, DType::F32, dims)?, b.splat(0.0, DType::F32, dims)?);
    b.select(&m, &one, &zero)
}

fn exp(b: &mut Body, v: &V) -> Result<V> {
    b.unary(super::body::Unary::Exp, v)
}

fn mul(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.binary(Binary::Mul, x, y)
}

fn add(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.binary(Binary::Add, x, y)
}

/// `[t, j] -> sum_i x[t, i] yf[t * 8 + j, i]` over an 8x8 tile, from the row selection
/// `sel_t` `[64, 8]` and the other operand already paired and decayed, `yf` `[64, K]`.
fn pair_products(b: &mut Body, sel_t: &V, x: &V, yf: &V, data: MatPrecision) -> Result<V> {
    let xr = b.matmul(sel_t, x, (1, 0), data)?;
    let p = mul(b, &xr, yf)?;
    let r = b.reduce(super::body::Reduction::Sum, &p, 1)?;
    b.reshape(&r, &[T, T])
}

/// Terms of one chunk, every exponent a direct sum of `g <= 0` (no positive exponent, no
/// difference of long cumulative sums). Rows of block `I` (8 rows) against columns of an
/// earlier block `J` factor through the block boundary,
/// `e^(G_t - G_j) = e^(sum_{8I <= s <= t} g_s) e^(sum_{j < s < 8I} g_s)`, one matmul per
/// tile; the diagonal tiles sum `g` over `j < s <= t` for each of their 64 pairs with a 0/1
/// matmul and contract over `K` elementwise. (8-row blocks: 352 k static cycles for the bf16
/// forward at the primary shape, against 392 k with 16 and 492 k with 4.) `work` is a `[64, K]` f32 scratch, `tiles` a
/// `[64, 64]` f32 scratch. The sums of `g` run at full precision; the products of q and k run
/// at `data` (`Default`, one bf16 pass, for bf16 inputs).
#[allow(clippy::too_many_arguments)]
pub fn chunk_terms(
    b: &mut Body,
    q: &V,
    k: &V,
    g: &V,
    beta: &V,
    scale: f64,
    (work, tiles): (Ref, Ref),
    data: MatPrecision,
) -> Result<ChunkTerms> {
    let kd = g.ty.dims.get(1).copied().unwrap_or(0);
    let ok = |v: &V, w: i64| v.ty.elem == DType::F32 && v.ty.dims == [C, w];
    if !ok(q, kd) || !ok(k, kd) || !ok(g, kd) || !ok(beta, 1) {
        return Err(TpuError::builder("mosaic chunk_terms", "q, k, g [64, K] and beta [64, 1], f32"));
    }
    let nb = (C / T) as usize;
    let blocks = |b: &mut Body, x: &V| -> Result<Vec<V>> {
        b.store_all(work, x)?;
        (0..nb).map(|i| b.load(work, &at(i as i64 * T, 0), &[T, kd])).collect()
    };
    let (gb, qb, kb) = (blocks(b, g)?, blocks(b, q)?, blocks(b, k)?);
    let wide_beta = b.broadcast(beta, &[C, kd])?;
    let bb = blocks(b, &wide_beta)?;
    // Per block: inclusive in-block sums `lc`, strict in-block suffix sums `sx`, totals `tot`.
    let lower = mask(b, &[T, T], 0, Cmp::Ge, 1)?;
    let upper = mask(b, &[T, T], 0, Cmp::Lt, 1)?;
    let ones = b.splat(1.0, DType::F32, &[1, T])?;
    let (mut lc, mut sx, mut tot) = (Vec::new(), Vec::new(), Vec::new());
    for gi in &gb {
        lc.push(mm(b, &lower, gi)?);
        sx.push(mm(b, &upper, gi)?);
        tot.push(mm(b, &ones, gi)?);
    }
    let zero_row = b.splat(0.0, DType::F32, &[1, kd])?;
    // The sum of whole blocks `from..to`, broadcast to a block's rows.
    let span = |b: &mut Body, from: usize, to: usize| -> Result<V> {
        let mut acc = zero_row.clone();
        for t in &tot[from..to] {
            acc = add(b, &acc, t)?;
        }
        b.broadcast(&acc, &[T, kd])
    };
    let all = {
        let mut acc = zero_row.clone();
        for t in &tot {
            acc = add(b, &acc, t)?;
        }
        acc
    };
    let eg_last = exp(b, &all)?;
    // qg, kg, kbg block by block, then whole.
    let (mut qg, mut kg, mut kbg) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..nb {
        let before = span(b, 0, i)?;
        let after = span(b, i + 1, nb)?;
        let eg = add(b, &lc[i], &before)?;
        let eg = exp(b, &eg)?;
        let rest = add(b, &sx[i], &after)?;
        let rest = exp(b, &rest)?;
        qg.push(mul(b, &qb[i], &eg)?);
        kg.push(mul(b, &kb[i], &rest)?);
        let kbi = mul(b, &kb[i], &bb[i])?;
        kbg.push(mul(b, &kbi, &eg)?);
    }
    let whole = |b: &mut Body, parts: &[V]| -> Result<V> {
        for (i, p) in parts.iter().enumerate() {
            b.store(work, &at(i as i64 * T, 0), p)?;
        }
        b.load_all(work)
    };
    let (qg, kg, kbg) = (whole(b, &qg)?, whole(b, &kg)?, whole(b, &kbg)?);
    // Pair selections and in-tile sums of the diagonal tiles.
    let eye = eye(b, T)?;
    let eye3 = b.reshape(&eye, &[T, 1, T])?;
    let sel_t = b.broadcast(&eye3, &[T, T, T])?;
    let sel_t = b.reshape(&sel_t, &[T * T, T])?;
    let sel_j = b.broadcast(&eye, &[T, T, T])?;
    let sel_j = b.reshape(&sel_j, &[T * T, T])?;
    let after_j = mask(b, &[T, T, T], 2, Cmp::Gt, 1)?;
    let upto_t = mask(b, &[T, T, T], 2, Cmp::Le, 0)?;
    let between_pair = mul(b, &after_j, &upto_t)?;
    let between_pair = b.reshape(&between_pair, &[T * T, T])?;
    let causal = mask(b, &[T, T], 0, Cmp::Ge, 1)?;
    let strict = mask(b, &[T, T], 0, Cmp::Gt, 1)?;
    // The causal tiles of `sum_i x[t, i] k[j, i] e^(G_t[i] - G_j[i])`, kept where `keep` is 1.
    // The factors Aqk and L share, formed once: per diagonal tile `(sel_j k) e^(sum_{j<s<=t} g)`,
    // per block the row factor `e^(lc)`, per earlier block the decayed key columns.
    let mut kf = Vec::with_capacity(nb);
    let mut er = Vec::with_capacity(nb);
    let mut kc: Vec<Vec<V>> = Vec::with_capacity(nb);
    for i in 0..nb {
        let d = mm(b, &between_pair, &gb[i])?;
        let f = exp(b, &d)?;
        let kr = b.matmul(&sel_j, &kb[i], (1, 0), data)?;
        kf.push(mul(b, &kr, &f)?);
        er.push(exp(b, &lc[i])?);
        let mut cols = Vec::with_capacity(i);
        for j in 0..i {
            let mid = span(b, j + 1, i)?;
            let ec = add(b, &sx[j], &mid)?;
            let ec = exp(b, &ec)?;
            cols.push(mul(b, &kb[j], &ec)?);
        }
        kc.push(cols);
    }
    // The causal tiles of `sum_i x[t, i] k[j, i] e^(G_t[i] - G_j[i])`, kept where `keep` is 1.
    let tiles_of = |b: &mut Body, left: &[V], keep: &V| -> Result<V> {
        let zero = b.splat(0.0, DType::F32, &[C, C])?;
        b.store_all(tiles, &zero)?;
        for i in 0..nb {
            let t = pair_products(b, &sel_t, &left[i], &kf[i], data)?;
            let t = mul(b, &t, keep)?;
            b.store(tiles, &at(i as i64 * T, i as i64 * T), &t)?;
            let xr = mul(b, &left[i], &er[i])?;
            for (j, c) in kc[i].iter().enumerate() {
                let a = b.matmul(&xr, c, (1, 1), data)?;
                b.store(tiles, &at(i as i64 * T, j as i64 * T), &a)?;
            }
        }
        b.load_all(tiles)
    };
    let aqk = tiles_of(b, &qb, &causal)?;
    let scale_c = b.splat(scale, DType::F32, &[C, C])?;
    let aqk = mul(b, &aqk, &scale_c)?;
    let lk = tiles_of(b, &kb, &strict)?;
    let beta_rows = b.broadcast(beta, &[C, C])?;
    let l = mul(b, &lk, &beta_rows)?;
    Ok(ChunkTerms { aqk, l, qg, kg, kbg, eg_last })
}
