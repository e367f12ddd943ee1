//! Decay factors `exp(G_t - G_j)` inside a chunk, in tiles (docs/kda.md, Chunks).
//!
//! A chunk of 64 rows is 4 blocks of 16 rows, each 4 sub-blocks of 4 rows. For row `t` in
//! block `I` and column `j` in an earlier block, `exp(G_t - G_j)` factors through the row just
//! before block `I`: `exp(sum_{16I <= s <= t} g_s) * exp(sum_{j < s < 16I} g_s)`. Both exponents
//! are sums of `g <= 0`, each formed directly from the tokens it spans (never as a difference of
//! two long cumulative sums), so no positive exponent appears and nothing cancels. Every
//! off-diagonal tile is then one batched matmul over the earlier columns only (no zero padding is
//! materialised); the 16-row diagonal blocks repeat the split with 4-row sub-blocks, and inside
//! the 4x4 diagonal tiles each strictly causal sub-diagonal `d = t - j` (1 to 3) uses the factor
//! `exp(g_{j+1} + .. + g_{j+d}) = exp(g_{j+1}) .. exp(g_{j+d})`, a product of `d` per-token
//! factors formed inline from contiguous slices (XLA fuses it into the product that uses it;
//! nothing of that level is stored), and the diagonal has factor 1. Only causal entries are ever
//! stored: every factor tensor is at most 1.5 times the size of `g`. Long sums are split once
//! more: a factor is the product of the per-token `exp(g) <= 1` inside the token's 4-row
//! sub-block times exponentials of whole sub-block or block sums, so the one token-sized tensor
//! exponentiated is `g` itself (see [`decay`]).

use crate::hlo::{Cmp, FnBuilder, Value};
use crate::op::hlo_ops::{f32t, index_mask, splat, stored_transposes};
use crate::Result;
use kda_core::DType;

/// Rows per chunk, per block, per sub-block.
const C: i64 = 64;
const B16: i64 = 16;
const B4: i64 = 4;
/// Blocks per chunk and sub-blocks per block.
const NB: i64 = 4;

/// The decay factors of a batch of `N` chunks.
pub struct Decay {
    /// `exp(G)`, `[N, C, K]`.
    pub eg: Value,
    /// `exp(G_last - G)`, `[N, C, K]`.
    pub eg_rest: Value,
    /// `exp(G_last)`, `[N, K]`: the whole-chunk decay.
    pub eg_last: Value,
    /// Row factors of blocks 1..3: `exp(sum_{16I <= s <= t} g_s)`, `[N, 3, 16, K]`.
    row1: Value,
    /// Column factors of block `I = i + 1`: `exp(sum_{j < s < 16I} g_s)` for `j < 16I`,
    /// `[N, 16I, K]`.
    col1: Vec<Value>,
    /// Row factors of sub-blocks 1..3 of every block, `[N, 4, 3, 4, K]`.
    row2: Value,
    /// Column factors of sub-block `I' = i + 1` inside every block, `[N, 4, 4I', K]`.
    col2: Vec<Value>,
    /// By 4-row tile, `[N, 16, 4, K]`: `exp(g)` when `products`, else the gate; the sub-diagonal
    /// factors of the 4x4 diagonal tiles are formed from it where they are used ([`sub_factor`]).
    tile4: Value,
    /// Whether the in-sub-block factors are products of `exp(g)` (see [`decay`]).
    products: bool,
}

/// Profiling views of the factors (`op::parts`).
#[cfg(feature = "harness")]
impl Decay {
    /// Every factor, for profiling.
    pub fn all(&self) -> Vec<Value> {
        let mut all = self.factors();
        all.push(self.tile4);
        all
    }

    /// The stored factors (the same in both forms of [`decay`]).
    pub fn factors(&self) -> Vec<Value> {
        let mut all = vec![self.eg, self.eg_rest, self.eg_last, self.row1, self.row2];
        all.extend(self.col1.iter().chain(&self.col2));
        all
    }
}

/// Prefix (or, with `reverse`, suffix) sums along a short `axis`, inclusive or exclusive,
/// unrolled into slices and adds (XLA fuses them into one pass).
fn scan(b: &mut FnBuilder, x: Value, axis: usize, reverse: bool, exclusive: bool) -> Result<Value> {
    scan_with(b, x, axis, reverse, exclusive, false)
}

/// [`scan`] with products instead of sums when `mul` (the exclusive identity is then 1).
fn scan_with(
    b: &mut FnBuilder,
    x: Value,
    axis: usize,
    reverse: bool,
    exclusive: bool,
    mul: bool,
) -> Result<Value> {
    let n = x.dims()[axis];
    let parts: Vec<Value> = (0..n).map(|i| b.slice_axis(x, axis, i, i + 1)).collect::<Result<_>>()?;
    let order: Vec<usize> = if reverse { (0..n as usize).rev().collect() } else { (0..n as usize).collect() };
    let mut out: Vec<Option<Value>> = vec![None; n as usize];
    let mut acc: Option<Value> = None;
    for &i in &order {
        let incl = match acc {
            Some(a) if mul => b.mul(a, parts[i])?,
            Some(a) => b.add(a, parts[i])?,
            None => parts[i],
        };
        out[i] = Some(if exclusive {
            match acc {
                Some(a) => a,
                None => splat(b, if mul { 1.0 } else { 0.0 }, parts[i].dims())?,
            }
        } else {
            incl
        });
        acc = Some(incl);
    }
    let out: Vec<Value> = out.into_iter().flatten().collect();
    b.concatenate(&out, axis)
}

/// Column factors of every tiling block `I = 1..3` along `axis` (the block axis of `within`,
/// `[.., 4, r, K]`, the exponentials of the exclusive in-block suffix sums; `tot` `[.., 4, K]`
/// the block totals): `exp(within_j) exp(sum_{J < L < I} tot_L)` for the `r I` rows before
/// block `I`, `[.., rI, K]`. Only the small between-block sums are exponentiated here.
fn causal_columns(b: &mut FnBuilder, within: Value, tot: Value, axis: usize) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for i in 1..NB {
        let w = b.slice_axis(within, axis, 0, i)?; // [.., I, r, K]
        let t = b.slice_axis(tot, axis, 0, i)?; // [.., I, K]
        let btw = scan(b, t, axis, true, true)?; // sum over the blocks between J and I
        let btw = b.exp(btw)?;
        let mut map: Vec<i64> = (0..w.rank() as i64).collect();
        map.remove(axis + 1);
        let btw = b.broadcast_in_dim(btw, w.dims(), &map)?;
        let e = b.mul(w, btw)?;
        let mut d = e.dims().to_vec();
        d[axis] *= d[axis + 1];
        d.remove(axis + 1);
        out.push(b.reshape(e, &d)?);
    }
    Ok(out)
}

/// Builds the decay factors from the activated gate `g` `[N, C, K]` (0 at padding rows).
///
/// With `products` (the CPU configuration) the one token-sized exponential is `exp(g)` and the
/// factors inside a 4-row sub-block are products of at most four of its entries (a few ulps
/// from the exponential of the sum; each partial product lies above the final one, so nothing
/// underflows early): one exponential per gate element instead of five, and in a per-kernel
/// profile of the f32 forward on the CPU plugin the fusions that form the factors fell by a
/// third. It keeps one more token-sized tensor live, which raised the tpu7x peak of the packed
/// fused program in slabs, so the TPU
/// configuration exponentiates the in-sub-block sums (up to each token and after it) instead.
pub fn decay(b: &mut FnBuilder, g: Value, products: bool) -> Result<Decay> {
    let (n, k) = (g.dims()[0], g.dims()[2]);
    // Sub-block scans: [N, 4 (block), 4 (sub-block), 4 (row), K].
    let g5 = b.reshape(g, &[n, NB, NB, B4, k])?;
    let (e_cin, e_suf, tot, tile4) = if products {
        let e1 = b.exp(g5)?;
        let e_cin = scan_with(b, e1, 3, false, false, true)?; // exp(sum over the sub-block up to t)
        let e_suf = scan_with(b, e1, 3, true, true, true)?; // exp(sum over the sub-block after j)
                                                            // Sub-block totals [N, 4, 4, K] as four adds of gate rows (a reduction would make the
                                                            // CPU compiler store the gate again for its reduction library).
        let mut tot = b.slice_axis(g5, 3, 0, 1)?;
        for r in 1..B4 {
            let x = b.slice_axis(g5, 3, r, r + 1)?;
            tot = b.add(tot, x)?;
        }
        (e_cin, e_suf, tot, b.reshape(e1, &[n, NB * NB, B4, k])?)
    } else {
        let cin = scan(b, g5, 3, false, false)?;
        let suf = scan(b, g5, 3, true, true)?;
        // Sub-block totals: the inclusive scan's last row (a reduction would make the CPU
        // compiler store the gate again for its reduction library).
        let tot = b.slice_axis(cin, 3, B4 - 1, B4)?;
        (b.exp(cin)?, b.exp(suf)?, tot, b.reshape(g, &[n, NB * NB, B4, k])?)
    };
    let tot = b.reshape(tot, &[n, NB, NB, k])?;
    let pre_b = scan(b, tot, 2, false, true)?;
    let suf_b = scan(b, tot, 2, true, true)?;
    let tot16 = b.reduce_sum(tot, &[2])?; // [N, 4, K] block totals
    let pre16 = scan(b, tot16, 1, false, true)?;
    let suf16 = scan(b, tot16, 1, true, true)?;
    // Every other factor is one of the two sub-block products times exponentials of the small
    // per-sub-block or per-block sums. Each factor is <= 1 and each exponent a sum of gates, so
    // nothing overflows; products lose at most a few ulps.
    let d5 = [n, NB, NB, B4, k];
    let small = |b: &mut FnBuilder, x: Value, map: &[i64]| -> Result<Value> {
        let e = b.exp(x)?;
        b.broadcast_in_dim(e, &d5, map)
    };
    let e_pre_b = small(b, pre_b, &[0, 1, 2, 4])?;
    let e_suf_b = small(b, suf_b, &[0, 1, 2, 4])?;
    let e_cin16 = b.mul(e_cin, e_pre_b)?; // exp(sum over the block up to t)
    let e_suf16r = b.mul(e_suf, e_suf_b)?; // exp(sum over the block after j)
    let e_pre16 = small(b, pre16, &[0, 1, 4])?;
    let e_suf16 = small(b, suf16, &[0, 1, 4])?;
    let eg = b.mul(e_cin16, e_pre16)?;
    let eg = b.reshape(eg, &[n, C, k])?;
    let eg_rest = b.mul(e_suf16r, e_suf16)?;
    let eg_rest = b.reshape(eg_rest, &[n, C, k])?;
    let last = b.reduce_sum(tot16, &[1])?;
    let eg_last = b.exp(last)?;
    // Level 1: blocks of 16.
    let e_cin16 = b.reshape(e_cin16, &[n, NB, B16, k])?;
    let row1 = b.slice_axis(e_cin16, 1, 1, NB)?;
    let e_suf16r = b.reshape(e_suf16r, &[n, NB, B16, k])?;
    let col1 = causal_columns(b, e_suf16r, tot16, 1)?;
    // Level 2: sub-blocks of 4 inside every block.
    let row2 = b.slice_axis(e_cin, 2, 1, NB)?; // [N, 4, 3, 4, K]
    let col2 = causal_columns(b, e_suf, tot, 2)?;
    // Level 3: the sub-diagonals of the 4x4 tiles, formed where they are used.
    Ok(Decay { eg, eg_rest, eg_last, row1, col1, row2, col2, tile4, products })
}

/// The factors of sub-diagonal `d` (1 to 3) of every 4x4 diagonal tile, indexed by column:
/// `exp(g_{j+1} + .. + g_{j+d})` for `j < 4 - d`, `[N, 16, 4 - d, K]`: the product of `d`
/// contiguous slices of `exp(g)`, or the exponential of the sum of `d` gate slices (no
/// cumulative-sum difference either way), elementwise so XLA fuses it.
fn sub_factor(b: &mut FnBuilder, dc: &Decay, d: i64) -> Result<Value> {
    let mut acc = b.slice_axis(dc.tile4, 2, 1, B4 - d + 1)?;
    for s in 2..=d {
        let x = b.slice_axis(dc.tile4, 2, s, s + B4 - d)?;
        acc = if dc.products { b.mul(acc, x)? } else { b.add(acc, x)? };
    }
    if dc.products {
        Ok(acc)
    } else {
        b.exp(acc)
    }
}

/// Broadcasts per-entry scalars `[N, 16, r]` over the last axis of `like` `[N, 16, r, K]`.
fn over_k(b: &mut FnBuilder, x: Value, like: &[i64]) -> Result<Value> {
    b.broadcast_in_dim(x, like, &[0, 1, 2])
}

/// Puts `[.., 3, r, W]` (blocks 1..3) back as `[.., 4r, W]` with a zero block 0 (`axis` is
/// the block axis).
fn with_zero_first(b: &mut FnBuilder, x: Value, axis: usize) -> Result<Value> {
    let r = x.rank();
    let zero = b.constant_f32(0.0, f32t(&[]))?;
    let mut low = vec![0; r];
    low[axis] = 1;
    let p = b.pad(x, zero, &low, &vec![0; r], &vec![0; r])?;
    let mut d = p.dims().to_vec();
    d[axis + 1] *= d[axis];
    d.remove(axis);
    b.reshape(p, &d)
}

/// The 16-row diagonal blocks of `M` `[N, C, C]`: `[N, 4, 16, 16]`.
fn diag_blocks16(b: &mut FnBuilder, m: Value) -> Result<Value> {
    let n = m.dims()[0];
    let m5 = b.reshape(m, &[n, NB, B16, NB, B16])?;
    let eye = index_mask(b, m5.dims(), 1, Cmp::Eq, 3)?;
    let z = splat(b, 0.0, m5.dims())?;
    let m5 = b.select(eye, m5, z)?;
    b.reduce_sum(m5, &[3])
}

/// The 4-row diagonal tiles of 16-row blocks `[N, 4, 16, 16]`: `[N, 16, 4, 4]`.
fn diag_tiles4(b: &mut FnBuilder, m: Value) -> Result<Value> {
    let n = m.dims()[0];
    let m6 = b.reshape(m, &[n, NB, NB, B4, NB, B4])?;
    let eye = index_mask(b, m6.dims(), 2, Cmp::Eq, 4)?;
    let z = splat(b, 0.0, m6.dims())?;
    let m6 = b.select(eye, m6, z)?;
    let d = b.reduce_sum(m6, &[4])?;
    b.reshape(d, &[n, NB * NB, B4, B4])
}

/// Places diagonal tiles `[.., nb, r, r]` into a block-diagonal `[.., nb*r, nb*r]` added to
/// `off` (the same shape as the result).
fn add_block_diag(b: &mut FnBuilder, tiles: Value, off: Value) -> Result<Value> {
    let d = tiles.dims().to_vec();
    let lead = &d[..d.len() - 3];
    let (nb, r) = (d[d.len() - 3], d[d.len() - 2]);
    let mut full: Vec<i64> = lead.to_vec();
    full.extend_from_slice(&[nb, r, nb, r]);
    let l = lead.len() as i64;
    let mut map: Vec<i64> = (0..l).collect();
    map.extend_from_slice(&[l, l + 1, l + 3]);
    let t = b.broadcast_in_dim(tiles, &full, &map)?;
    let eye = index_mask(b, &full, l as usize, Cmp::Eq, l as usize + 2)?;
    let o = b.reshape(off, &full)?;
    let placed = b.select(eye, t, o)?;
    b.reshape(placed, off.dims())
}

/// Rows `lo..hi` of `[.., R, W]` along `axis`.
fn rows(b: &mut FnBuilder, x: Value, axis: usize, lo: i64, hi: i64) -> Result<Value> {
    b.slice_axis(x, axis, lo, hi)
}

/// Pads the last axis of `x` with zeros up to `width`.
fn pad_last(b: &mut FnBuilder, x: Value, width: i64) -> Result<Value> {
    let r = x.rank();
    let extra = width - x.dims()[r - 1];
    if extra == 0 {
        return Ok(x);
    }
    let zero = b.constant_f32(0.0, f32t(&[]))?;
    let mut high = vec![0; r];
    high[r - 1] = extra;
    b.pad(x, zero, &vec![0; r], &high, &vec![0; r])
}

/// Pads axis `axis` of `x` with zeros up to `len`.
fn pad_axis(b: &mut FnBuilder, x: Value, axis: usize, len: i64) -> Result<Value> {
    let r = x.rank();
    let extra = len - x.dims()[axis];
    if extra == 0 {
        return Ok(x);
    }
    let zero = b.constant_f32(0.0, f32t(&[]))?;
    let mut high = vec![0; r];
    high[axis] = extra;
    b.pad(x, zero, &vec![0; r], &high, &vec![0; r])
}

/// Inserts a unit axis at `axis`.
fn unit_axis(b: &mut FnBuilder, x: Value, axis: usize) -> Result<Value> {
    let mut d = x.dims().to_vec();
    d.insert(axis, 1);
    b.reshape(x, &d)
}

/// The 4x4 tiles `[N, 16, 4, 4]` from their diagonal `[N, 16, 4]` (zero when `None`) and
/// strictly causal sub-diagonals `subs[d - 1]` `[N, 16, 4 - d]` (entry `j` at `(j + d, j)`).
fn tiles_from_diagonals(b: &mut FnBuilder, diag: Option<Value>, subs: &[Value; 3]) -> Result<Value> {
    let (n, nt) = (subs[0].dims()[0], subs[0].dims()[1]);
    let zero = splat(b, 0.0, &[n, nt, 1])?;
    let mut parts = Vec::new();
    for t in 0..B4 {
        for j in 0..B4 {
            parts.push(if j == t {
                match diag {
                    Some(d) => b.slice_axis(d, 2, t, t + 1)?,
                    None => zero,
                }
            } else if t > j {
                b.slice_axis(subs[(t - j - 1) as usize], 2, j, j + 1)?
            } else {
                zero
            });
        }
    }
    let m = b.concatenate(&parts, 2)?;
    b.reshape(m, &[n, nt, B4, B4])
}

/// The strictly causal sub-diagonals `[N, 16, 4 - d]` (d = 1..3) of tiles `[N, 16, 4, 4]`.
fn tile_subdiagonals(b: &mut FnBuilder, tiles: Value) -> Result<[Value; 3]> {
    let (n, nt) = (tiles.dims()[0], tiles.dims()[1]);
    let flat = b.reshape(tiles, &[n, nt, B4 * B4])?;
    let line = |b: &mut FnBuilder, d: i64| -> Result<Value> {
        let at: Vec<Value> = (0..B4 - d)
            .map(|j| b.slice_axis(flat, 2, 4 * (j + d) + j, 4 * (j + d) + j + 1))
            .collect::<Result<_>>()?;
        b.concatenate(&at, 2)
    };
    Ok([line(b, 1)?, line(b, 2)?, line(b, 3)?])
}

/// Pads axis 2 of `[N, 16, 4 - d, K]` back to 4 rows: `low` zero rows before, the rest after.
fn pad_rows(b: &mut FnBuilder, x: Value, low: i64) -> Result<Value> {
    let zero = b.constant_f32(0.0, f32t(&[]))?;
    let high = B4 - x.dims()[2] - low;
    b.pad(x, zero, &[0, 0, low, 0], &[0, 0, high, 0], &[0, 0, 0, 0])
}

/// `M[t, j] = sum_i x_t[i] y_j[i] exp(G_t[i] - G_j[i])` for `j <= t` (`j < t` for the second
/// result) for `x = xs[0]` and `x = xs[1]` with a shared `y`: `[N, C, C]` each. The causal
/// `q k` matrix and the strictly causal `k k` matrix of one chunk share their column factors.
pub fn grams(b: &mut FnBuilder, dc: &Decay, xs: [Value; 2], y: Value) -> Result<[Value; 2]> {
    let (n, k) = (y.dims()[0], y.dims()[2]);
    let x16: Vec<Value> = xs.iter().map(|&x| b.reshape(x, &[n, NB, B16, k])).collect::<Result<_>>()?;
    let x5: Vec<Value> = xs.iter().map(|&x| b.reshape(x, &[n, NB, NB, B4, k])).collect::<Result<_>>()?;
    // Level 1: the rows of block I against the 16 I columns before it.
    let mut off1 = Vec::new();
    for i in 1..NB {
        let rf = rows(b, dc.row1, 1, i - 1, i)?;
        let rf = b.reshape(rf, &[n, B16, k])?;
        let mut lhs = Vec::new();
        for &x in &x16 {
            let xi = rows(b, x, 1, i, i + 1)?;
            let xi = b.reshape(xi, &[n, B16, k])?;
            lhs.push(b.mul(xi, rf)?);
        }
        let lhs = b.concatenate(&lhs, 1)?; // [N, 32, K]
        let yc = rows(b, y, 1, 0, B16 * i)?;
        let yc = b.mul(yc, dc.col1[i as usize - 1])?;
        let d = b.dot_general(lhs, yc, &[0], &[0], &[2], &[2], DType::F32)?; // [N, 32, 16I]
        let d = pad_last(b, d, C)?;
        off1.push(unit_axis(b, d, 1)?);
    }
    let off1 = b.concatenate(&off1, 1)?; // [N, 3, 32, 64]
                                         // Level 2: sub-block rows against the earlier columns of their block.
    let y16 = b.reshape(y, &[n, NB, B16, k])?;
    let mut off2 = Vec::new();
    for i in 1..NB {
        let rf = rows(b, dc.row2, 2, i - 1, i)?;
        let rf = b.reshape(rf, &[n, NB, B4, k])?;
        let mut lhs = Vec::new();
        for &x in &x5 {
            let xi = rows(b, x, 2, i, i + 1)?;
            let xi = b.reshape(xi, &[n, NB, B4, k])?;
            lhs.push(b.mul(xi, rf)?);
        }
        let lhs = b.concatenate(&lhs, 2)?; // [N, 4, 8, K]
        let yc = rows(b, y16, 2, 0, B4 * i)?;
        let yc = b.mul(yc, dc.col2[i as usize - 1])?;
        let d = b.dot_general(lhs, yc, &[0, 1], &[0, 1], &[3], &[3], DType::F32)?; // [N, 4, 8, 4I]
        let d = pad_last(b, d, B16)?;
        off2.push(unit_axis(b, d, 2)?);
    }
    let off2 = b.concatenate(&off2, 2)?; // [N, 4, 3, 8, 16]
                                         // Level 3: the pairs of the 4x4 tiles, elementwise, and the diagonal.
    let y4 = b.reshape(y, &[n, NB * NB, B4, k])?;
    let x4: Vec<Value> = xs.iter().map(|&x| b.reshape(x, &[n, NB * NB, B4, k])).collect::<Result<_>>()?;
    // Entry (j + d, j): x_{j+d} y_j exp(g_{j+1} + .. + g_{j+d}) for d = 1..3 and both grams
    // side by side ([N, 16, 12, K]), summed over K in one reduction. The products are stored
    // behind a barrier as one tensor: the CPU compiler's reduction library otherwise takes
    // the factor and both shifted operands, each stored on its own (twice the bytes).
    let mut parts = Vec::new();
    for &x in &x4 {
        for d in 1..B4 {
            let xd = b.slice_axis(x, 2, d, B4)?;
            let yd = b.slice_axis(y4, 2, 0, B4 - d)?;
            let f = sub_factor(b, dc, d)?;
            let p = b.mul(xd, yd)?;
            parts.push(b.mul(p, f)?);
        }
    }
    let prods = b.concatenate(&parts, 2)?;
    let prods = b.barrier(&[prods])?[0];
    let sums = b.reduce_sum(prods, &[3])?; // [N, 16, 12]

    // Sub-diagonal d of gram i: its 4 - d entries follow gram i's shorter d's, and each gram
    // spans `per_gram` entries.
    let per_gram: i64 = (1..B4).map(|d| B4 - d).sum();
    let mut out = Vec::new();
    for (i, &x4) in x4.iter().enumerate() {
        let i = i as i64;
        let mut at = per_gram * i;
        let mut subs = Vec::new();
        for d in 1..B4 {
            subs.push(b.slice_axis(sums, 2, at, at + B4 - d)?);
            at += B4 - d;
        }
        let diag = if i == 0 {
            let d = b.mul(x4, y4)?;
            Some(b.reduce_sum(d, &[3])?) // [N, 16, 4]
        } else {
            None
        };
        let t4 = tiles_from_diagonals(b, diag, &[subs[0], subs[1], subs[2]])?;
        let t4 = b.reshape(t4, &[n, NB, NB, B4, B4])?;
        let o2 = b.slice_axis(off2, 3, 4 * i, 4 * i + 4)?; // [N, 4, 3, 4, 16]
        let o2 = with_zero_first(b, o2, 2)?; // [N, 4, 16, 16]
        let blk = add_block_diag(b, t4, o2)?;
        let o1 = b.slice_axis(off1, 2, 16 * i, 16 * i + 16)?; // [N, 3, 16, 64]
        let o1 = with_zero_first(b, o1, 1)?; // [N, 64, 64]
        let full = add_block_diag(b, blk, o1)?;
        out.push(b.reshape(full, &[n, C, C])?);
    }
    Ok([out[0], out[1]])
}

/// Row sides `R_t = sum_{j < t} M[t, j] x_j exp(G_t - G_j)` for several strictly causal `M`
/// `[N, C, C]` (the diagonal is not read) and one `x` `[N, C, K]`: `[N, C, K]` each.
pub fn row_sides(b: &mut FnBuilder, dc: &Decay, mats: &[Value], x: Value) -> Result<Vec<Value>> {
    let (n, k) = (x.dims()[0], x.dims()[2]);
    // Level 1.
    let mut r1 = Vec::new();
    for i in 1..NB {
        let mut lhs = Vec::new();
        for &mat in mats {
            let mr = rows(b, mat, 1, B16 * i, B16 * (i + 1))?;
            lhs.push(rows(b, mr, 2, 0, B16 * i)?); // [N, 16, 16I]
        }
        let lhs = b.concatenate(&lhs, 1)?;
        let xc = rows(b, x, 1, 0, B16 * i)?;
        let xc = b.mul(xc, dc.col1[i as usize - 1])?;
        let r = b.dot_general(lhs, xc, &[0], &[0], &[2], &[1], DType::F32)?; // [N, 16m, K]
        r1.push(unit_axis(b, r, 1)?);
    }
    let r1 = b.concatenate(&r1, 1)?; // [N, 3, 16m, K]
                                     // Level 2.
    let d16s: Vec<Value> = mats.iter().map(|&mat| diag_blocks16(b, mat)).collect::<Result<_>>()?;
    let x16 = b.reshape(x, &[n, NB, B16, k])?;
    let mut r2 = Vec::new();
    for i in 1..NB {
        let mut lhs = Vec::new();
        for &d16 in &d16s {
            let mr = rows(b, d16, 2, B4 * i, B4 * (i + 1))?;
            lhs.push(rows(b, mr, 3, 0, B4 * i)?); // [N, 4, 4, 4I]
        }
        let lhs = b.concatenate(&lhs, 2)?;
        let xc = rows(b, x16, 2, 0, B4 * i)?;
        let xc = b.mul(xc, dc.col2[i as usize - 1])?;
        let r = b.dot_general(lhs, xc, &[0, 1], &[0, 1], &[3], &[2], DType::F32)?; // [N, 4, 4m, K]
        r2.push(unit_axis(b, r, 2)?);
    }
    let r2 = b.concatenate(&r2, 2)?; // [N, 4, 3, 4m, K]
                                     // Level 3.
    let x4 = b.reshape(x, &[n, NB * NB, B4, k])?;
    // x_j exp(g_{j+1} + .. + g_{j+d}) for every sub-diagonal d.
    let mut xe = Vec::new();
    for d in 1..B4 {
        let xj = b.slice_axis(x4, 2, 0, B4 - d)?;
        let f = sub_factor(b, dc, d)?;
        xe.push(b.mul(xj, f)?); // [N, 16, 4 - d, K]
    }
    let mut out = Vec::new();
    for (i, d16) in d16s.into_iter().enumerate() {
        let i = i as i64;
        let t = b.slice_axis(r1, 2, 16 * i, 16 * i + 16)?;
        let t = b.mul(t, dc.row1)?;
        let t1 = with_zero_first(b, t, 1)?; // [N, 64, K]
        let t = b.slice_axis(r2, 3, 4 * i, 4 * i + 4)?;
        let t = b.mul(t, dc.row2)?;
        let t2 = with_zero_first(b, t, 2)?; // [N, 4, 16, K]
        let t2 = b.reshape(t2, &[n, C, k])?;
        let d4 = diag_tiles4(b, d16)?;
        let subs = tile_subdiagonals(b, d4)?;
        let mut t3: Option<Value> = None;
        for (d, (&m, &xd)) in subs.iter().zip(&xe).enumerate() {
            let m = over_k(b, m, xd.dims())?;
            let term = b.mul(m, xd)?; // lands on row j + d
            let term = pad_rows(b, term, d as i64 + 1)?;
            t3 = Some(match t3 {
                Some(a) => b.add(a, term)?,
                None => term,
            });
        }
        let t3 = t3.map_or_else(|| splat(b, 0.0, x4.dims()), Ok)?;
        let t3 = b.reshape(t3, &[n, C, k])?;
        let s = b.add(t1, t2)?;
        out.push(b.add(s, t3)?);
    }
    Ok(out)
}

/// Column side summed over pairs: `sum_p sum_{t > j} M_p[t, j] y_p,t exp(G_t - G_j)`,
/// `[N, C, K]`, for strictly causal `M_p` `[N, C, C]` (the diagonal is not read) and `y_p`
/// `[N, C, K]`. The products contract over
/// `M`'s rows. With `stored` (the CPU configuration) they run as ordinary products on `M^T`
/// ([`stored_transposes`]): the CPU plugin's transposed-operand products are slower. Without it
/// (slabs, for TPU) they stay transposed-operand products, which TPUs take natively and which
/// keep the tpu7x peak lower.
pub fn col_side_sum(b: &mut FnBuilder, dc: &Decay, pairs: &[(Value, Value)], stored: bool) -> Result<Value> {
    let (n, k) = (pairs[0].1.dims()[0], pairs[0].1.dims()[2]);
    let mats: Vec<Value> = pairs.iter().map(|&(mat, _)| mat).collect();
    let d16s: Vec<Value> = mats.iter().map(|&mat| diag_blocks16(b, mat)).collect::<Result<_>>()?;
    // The matrices the level-1 and level-2 products read: M^T stored, or M itself.
    let (mts, d16ts) = if stored {
        let mts = stored_transposes(b, &mats)?;
        let d16ts = mts.iter().map(|&mt| diag_blocks16(b, mt)).collect::<Result<_>>()?;
        (mts, d16ts)
    } else {
        (mats, d16s.clone())
    };
    // Level 1: contract the rows of block I (all pairs at once) into the columns before it.
    let mut c1: Option<Value> = None;
    for i in 1..NB {
        let rf = rows(b, dc.row1, 1, i - 1, i)?;
        let rf = b.reshape(rf, &[n, B16, k])?;
        let mut lhs = Vec::new();
        let mut rhs = Vec::new();
        for (&mt, &(_, y)) in mts.iter().zip(pairs) {
            if stored {
                let mr = rows(b, mt, 1, 0, B16 * i)?;
                lhs.push(rows(b, mr, 2, B16 * i, B16 * (i + 1))?); // [N, 16I, 16]: M[I rows, :16I]^T
            } else {
                let mr = rows(b, mt, 1, B16 * i, B16 * (i + 1))?;
                lhs.push(rows(b, mr, 2, 0, B16 * i)?); // [N, 16, 16I]: M[I rows, :16I]
            }
            let yi = rows(b, y, 1, B16 * i, B16 * (i + 1))?;
            rhs.push(b.mul(yi, rf)?); // [N, 16, K]
        }
        let lc = if stored { 2 } else { 1 };
        let lhs = b.concatenate(&lhs, lc)?;
        let rhs = b.concatenate(&rhs, 1)?;
        let c = b.dot_general(lhs, rhs, &[0], &[0], &[lc as i64], &[1], DType::F32)?; // [N, 16I, K]
        let c = b.mul(c, dc.col1[i as usize - 1])?;
        let c = pad_axis(b, c, 1, C)?;
        c1 = Some(match c1 {
            Some(a) => b.add(a, c)?,
            None => c,
        });
    }
    // Level 2.
    let mut c2: Option<Value> = None;
    for i in 1..NB {
        let rf = rows(b, dc.row2, 2, i - 1, i)?;
        let rf = b.reshape(rf, &[n, NB, B4, k])?;
        let mut lhs = Vec::new();
        let mut rhs = Vec::new();
        for (&d16t, &(_, y)) in d16ts.iter().zip(pairs) {
            if stored {
                let mr = rows(b, d16t, 2, 0, B4 * i)?;
                lhs.push(rows(b, mr, 3, B4 * i, B4 * (i + 1))?); // [N, 4, 4I, 4]
            } else {
                let mr = rows(b, d16t, 2, B4 * i, B4 * (i + 1))?;
                lhs.push(rows(b, mr, 3, 0, B4 * i)?); // [N, 4, 4, 4I]
            }
            let y5 = b.reshape(y, &[n, NB, NB, B4, k])?;
            let yi = rows(b, y5, 2, i, i + 1)?;
            let yi = b.reshape(yi, &[n, NB, B4, k])?;
            rhs.push(b.mul(yi, rf)?); // [N, 4, 4, K]
        }
        let lc = if stored { 3 } else { 2 };
        let lhs = b.concatenate(&lhs, lc)?;
        let rhs = b.concatenate(&rhs, 2)?;
        let c = b.dot_general(lhs, rhs, &[0, 1], &[0, 1], &[lc as i64], &[2], DType::F32)?; // [N, 4, 4I, K]
        let c = b.mul(c, dc.col2[i as usize - 1])?;
        let c = pad_axis(b, c, 2, B16)?;
        c2 = Some(match c2 {
            Some(a) => b.add(a, c)?,
            None => c,
        });
    }
    // Level 3.
    let mut t3: Option<Value> = None;
    for (&d16, &(_, y)) in d16s.iter().zip(pairs) {
        let y4 = b.reshape(y, &[n, NB * NB, B4, k])?;
        let d4 = diag_tiles4(b, d16)?;
        let subs = tile_subdiagonals(b, d4)?;
        for (d, &m) in subs.iter().enumerate() {
            let d = d as i64 + 1;
            let yt = b.slice_axis(y4, 2, d, B4)?; // row j + d
            let f = sub_factor(b, dc, d)?;
            let m = over_k(b, m, yt.dims())?;
            let term = b.mul(m, yt)?;
            let term = b.mul(term, f)?; // lands on column j
            let term = pad_rows(b, term, 0)?;
            t3 = Some(match t3 {
                Some(a) => b.add(a, term)?,
                None => term,
            });
        }
    }
    let (c1, c2, t3) = match (c1, c2, t3) {
        (Some(a), Some(c), Some(t)) => (a, c, t),
        _ => return splat(b, 0.0, &[n, C, k]),
    };
    let c2 = b.reshape(c2, &[n, C, k])?;
    let t3 = b.reshape(t3, &[n, C, k])?;
    let s = b.add(c1, c2)?;
    b.add(s, t3)
}
