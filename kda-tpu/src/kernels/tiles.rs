//! Decay factors `exp(G_t - G_j)` inside a chunk, in tiles (spec section 4).
//!
//! A chunk of 64 rows is 4 blocks of 16 rows, each 4 sub-blocks of 4 rows. For row `t` in
//! block `I` and column `j` in an earlier block, `exp(G_t - G_j)` factors through the row just
//! before block `I`: `exp(sum_{16I <= s <= t} g_s) * exp(sum_{j < s < 16I} g_s)`. Both exponents
//! are sums of `g <= 0`, each formed directly from the tokens it spans (never as a difference of
//! two long cumulative sums), so no positive exponent appears and nothing cancels. Every
//! off-diagonal tile is then one batched matmul over all earlier columns; the 16-row diagonal
//! blocks repeat the split with 4-row sub-blocks, and the 4x4 diagonal tiles use the pairwise
//! factors, masked before the exponential.

use super::ops::{f32t, index_mask, splat};
use crate::hlo::{Cmp, ElemType, FnBuilder, Value};
use crate::Result;

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
    /// Column factors per block `I = 1..3`: `exp(sum_{j < s < 16I} g_s)` for `j < 16I`, else 0,
    /// `[N, 3, 64, K]`.
    col1: Value,
    /// Row factors of sub-blocks 1..3 of every block, `[N, 4, 3, 4, K]`.
    row2: Value,
    /// Column factors per sub-block inside a block, `[N, 4, 3, 16, K]`.
    col2: Value,
    /// Pairwise factors of the 4x4 diagonal tiles: `exp(sum_{j < s <= t} g_s)` for `j <= t`,
    /// else 0, `[N, 16, 4, 4, K]`.
    diag: Value,
}

impl Decay {
    /// Every factor, for profiling.
    pub fn all(&self) -> Vec<Value> {
        vec![self.eg, self.eg_rest, self.eg_last, self.row1, self.col1, self.row2, self.col2, self.diag]
    }
}

/// Prefix (or, with `reverse`, suffix) sums along a short `axis`, inclusive or exclusive,
/// unrolled into slices and adds (XLA fuses them into one pass).
fn scan(b: &mut FnBuilder, x: Value, axis: usize, reverse: bool, exclusive: bool) -> Result<Value> {
    let n = x.dims()[axis];
    let parts: Vec<Value> = (0..n).map(|i| b.slice_axis(x, axis, i, i + 1)).collect::<Result<_>>()?;
    let order: Vec<usize> = if reverse { (0..n as usize).rev().collect() } else { (0..n as usize).collect() };
    let mut out: Vec<Option<Value>> = vec![None; n as usize];
    let mut acc: Option<Value> = None;
    for &i in &order {
        let incl = match acc {
            Some(a) => b.add(a, parts[i])?,
            None => parts[i],
        };
        out[i] = Some(if exclusive {
            match acc {
                Some(a) => a,
                None => splat(b, 0.0, parts[i].dims())?,
            }
        } else {
            incl
        });
        acc = Some(incl);
    }
    let out: Vec<Value> = out.into_iter().flatten().collect();
    b.concatenate(&out, axis)
}

/// Sums of the totals strictly between two blocks: `[.., 3 (I = 1..3), 4 (J), K]` from
/// `tot` `[.., 4, K]` (block axis `axis`), `sum_{J < L < I} tot_L` (0 when `J >= I - 1`).
fn between(b: &mut FnBuilder, tot: Value, axis: usize) -> Result<Value> {
    let blk: Vec<Value> = (0..NB).map(|i| b.slice_axis(tot, axis, i, i + 1)).collect::<Result<_>>()?;
    let zero = splat(b, 0.0, blk[0].dims())?;
    let t12 = b.add(blk[1], blk[2])?;
    let rows = [
        [zero, zero, zero, zero],   // I = 1
        [blk[1], zero, zero, zero], // I = 2
        [t12, blk[2], zero, zero],  // I = 3
    ];
    let mut rs = Vec::new();
    for r in rows {
        let row = b.concatenate(&r, axis)?; // [.., 4 (J), K]
        let mut d = row.dims().to_vec();
        d.insert(axis, 1);
        rs.push(b.reshape(row, &d)?);
    }
    b.concatenate(&rs, axis)
}

/// `exp(within + between)` masked to `J < I`: the column factors of one tiling level.
/// `within` `[.., 4 (J), r, K]` (exclusive in-tile suffix sums), `btw` `[.., 3, 4, K]`.
fn column_factors(b: &mut FnBuilder, within: Value, btw: Value, axis: usize) -> Result<Value> {
    let d = within.dims().to_vec();
    let r = d.len();
    let mut full = d;
    full.insert(axis, NB - 1); // [.., 3 (I), 4 (J), r, K]
    let wmap: Vec<i64> = (0..r as i64).map(|a| if a < axis as i64 { a } else { a + 1 }).collect();
    let w = b.broadcast_in_dim(within, &full, &wmap)?;
    let bmap: Vec<i64> = (0..r as i64).map(|a| if a <= axis as i64 + 1 { a } else { a + 1 }).collect();
    let bt = b.broadcast_in_dim(btw, &full, &bmap)?;
    let e = b.add(w, bt)?;
    let e = b.exp(e)?;
    // Block index I = i + 1; keep J <= i.
    let keep = index_mask(b, &full, axis + 1, Cmp::Le, axis)?;
    let z = splat(b, 0.0, &full)?;
    let e = b.select(keep, e, z)?;
    let mut shape = full.clone();
    shape.remove(axis + 1);
    shape[axis + 1] = NB * full[axis + 2];
    b.reshape(e, &shape)
}

/// Builds the decay factors from the activated gate `g` `[N, C, K]` (0 at padding rows).
pub fn decay(b: &mut FnBuilder, g: Value) -> Result<Decay> {
    let (n, k) = (g.dims()[0], g.dims()[2]);
    // Sub-block scans: [N, 4 (block), 4 (sub-block), 4 (row), K].
    let g5 = b.reshape(g, &[n, NB, NB, B4, k])?;
    let cin = scan(b, g5, 3, false, false)?;
    let suf = scan(b, g5, 3, true, true)?;
    let tot = b.reduce_sum(g5, &[3])?; // [N, 4, 4, K] sub-block totals
    let pre_b = scan(b, tot, 2, false, true)?;
    let suf_b = scan(b, tot, 2, true, true)?;
    let tot16 = b.reduce_sum(tot, &[2])?; // [N, 4, K] block totals
    let pre16 = scan(b, tot16, 1, false, true)?;
    let suf16 = scan(b, tot16, 1, true, true)?;
    let d5 = [n, NB, NB, B4, k];
    let pre_b5 = b.broadcast_in_dim(pre_b, &d5, &[0, 1, 2, 4])?;
    let suf_b5 = b.broadcast_in_dim(suf_b, &d5, &[0, 1, 2, 4])?;
    let cin16 = b.add(cin, pre_b5)?; // sum over the block up to t
    let suf16r = b.add(suf, suf_b5)?; // sum over the block after j
    let pre16_5 = b.broadcast_in_dim(pre16, &d5, &[0, 1, 4])?;
    let suf16_5 = b.broadcast_in_dim(suf16, &d5, &[0, 1, 4])?;
    let gc = b.add(cin16, pre16_5)?;
    let gc = b.reshape(gc, &[n, C, k])?;
    let eg = b.exp(gc)?;
    let rest = b.add(suf16r, suf16_5)?;
    let rest = b.reshape(rest, &[n, C, k])?;
    let eg_rest = b.exp(rest)?;
    let last = b.reduce_sum(tot16, &[1])?;
    let eg_last = b.exp(last)?;
    // Level 1: blocks of 16.
    let cin16 = b.reshape(cin16, &[n, NB, B16, k])?;
    let r1 = b.slice_axis(cin16, 1, 1, NB)?;
    let row1 = b.exp(r1)?;
    let suf16r = b.reshape(suf16r, &[n, NB, B16, k])?;
    let btw1 = between(b, tot16, 1)?; // [N, 3, 4, K]
    let col1 = column_factors(b, suf16r, btw1, 1)?; // [N, 3, 64, K]
                                                    // Level 2: sub-blocks of 4 inside every block.
    let r2 = b.slice_axis(cin, 2, 1, NB)?;
    let row2 = b.exp(r2)?; // [N, 4, 3, 4, K]
    let btw2 = between(b, tot, 2)?; // [N, 4, 3, 4, K]
    let col2 = column_factors(b, suf, btw2, 2)?; // [N, 4, 3, 16, K]
                                                 // Level 3: 4x4 diagonal tiles, pairwise; the exponent is masked to j <= t before exp.
    let c4 = b.reshape(cin, &[n, NB * NB, B4, k])?;
    let d6 = [n, NB * NB, B4, B4, k];
    let ct = b.broadcast_in_dim(c4, &d6, &[0, 1, 2, 4])?;
    let cj = b.broadcast_in_dim(c4, &d6, &[0, 1, 3, 4])?;
    let diff = b.sub(ct, cj)?;
    let causal = index_mask(b, &d6, 3, Cmp::Le, 2)?;
    let far = splat(b, -1.0e4, &d6)?;
    let expo = b.select(causal, diff, far)?;
    let diag = b.exp(expo)?;
    Ok(Decay { eg, eg_rest, eg_last, row1, col1, row2, col2, diag })
}

/// `[N, C, W]` viewed as blocks `[N, 4, 16, W]`, blocks 1..3 only.
fn later_blocks(b: &mut FnBuilder, x: Value) -> Result<Value> {
    let (n, w) = (x.dims()[0], x.dims()[2]);
    let x4 = b.reshape(x, &[n, NB, B16, w])?;
    b.slice_axis(x4, 1, 1, NB)
}

/// `[N, C, W]` viewed as sub-blocks `[N, 4, 4, 4, W]`, sub-blocks 1..3 of every block.
fn later_sub_blocks(b: &mut FnBuilder, x: Value) -> Result<Value> {
    let (n, w) = (x.dims()[0], x.dims()[2]);
    let x5 = b.reshape(x, &[n, NB, NB, B4, w])?;
    b.slice_axis(x5, 2, 1, NB)
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

/// `M[t, j] = sum_i x_t[i] y_j[i] exp(G_t[i] - G_j[i])` for `j <= t` (`j < t` for the second
/// result) for `x = xs[0]` and `x = xs[1]` with a shared `y`: `[N, C, C]` each. The causal
/// `q k` matrix and the strictly causal `k k` matrix of one chunk share their column factors.
pub fn grams(b: &mut FnBuilder, dc: &Decay, xs: [Value; 2], y: Value) -> Result<[Value; 2]> {
    let (n, k) = (y.dims()[0], y.dims()[2]);
    // Level 1: rows of blocks 1..3 against every earlier column.
    let mut lhs = Vec::new();
    for &x in &xs {
        let xl = later_blocks(b, x)?;
        lhs.push(b.mul(xl, dc.row1)?);
    }
    let lhs = b.concatenate(&lhs, 2)?; // [N, 3, 32, K]
    let yb = b.broadcast_in_dim(y, &[n, NB - 1, C, k], &[0, 2, 3])?;
    let yc = b.mul(yb, dc.col1)?;
    let off1 = b.dot_general(lhs, yc, &[0, 1], &[0, 1], &[3], &[3], ElemType::F32)?; // [N,3,32,64]
                                                                                     // Level 2: sub-block rows against earlier columns of the same block.
    let mut lhs2 = Vec::new();
    for &x in &xs {
        let xl = later_sub_blocks(b, x)?;
        lhs2.push(b.mul(xl, dc.row2)?);
    }
    let lhs2 = b.concatenate(&lhs2, 3)?; // [N, 4, 3, 8, K]
    let y16 = b.reshape(y, &[n, NB, B16, k])?;
    let y16 = b.broadcast_in_dim(y16, &[n, NB, NB - 1, B16, k], &[0, 1, 3, 4])?;
    let yc2 = b.mul(y16, dc.col2)?;
    let off2 = b.dot_general(lhs2, yc2, &[0, 1, 2], &[0, 1, 2], &[4], &[4], ElemType::F32)?; // [N,4,3,8,16]
                                                                                             // Level 3: 4x4 tiles, elementwise.
    let y4 = b.reshape(y, &[n, NB * NB, B4, k])?;
    let d5 = [n, NB * NB, B4, B4, k];
    let yj = b.broadcast_in_dim(y4, &d5, &[0, 1, 3, 4])?;
    let yd = b.mul(yj, dc.diag)?;
    let mut out = Vec::new();
    for (i, &x) in xs.iter().enumerate() {
        let i = i as i64;
        let x4 = b.reshape(x, &[n, NB * NB, B4, k])?;
        let xt = b.broadcast_in_dim(x4, &d5, &[0, 1, 2, 4])?;
        let p = b.mul(xt, yd)?;
        let mut t4 = b.reduce_sum(p, &[4])?; // [N, 16, 4, 4]
        if i == 1 {
            let strict = index_mask(b, t4.dims(), 3, Cmp::Lt, 2)?;
            let z = splat(b, 0.0, t4.dims())?;
            t4 = b.select(strict, t4, z)?;
        }
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

/// Row sides `R_t = sum_{j <= t} M[t, j] x_j exp(G_t - G_j)` for several causal `M`
/// `[N, C, C]` and one `x` `[N, C, K]`: `[N, C, K]` each.
pub fn row_sides(b: &mut FnBuilder, dc: &Decay, mats: &[Value], x: Value) -> Result<Vec<Value>> {
    let (n, k) = (x.dims()[0], x.dims()[2]);
    // Level 1.
    let mut lhs = Vec::new();
    for &mat in mats {
        lhs.push(later_blocks(b, mat)?); // [N, 3, 16, 64]
    }
    let lhs = b.concatenate(&lhs, 2)?;
    let xb = b.broadcast_in_dim(x, &[n, NB - 1, C, k], &[0, 2, 3])?;
    let xc = b.mul(xb, dc.col1)?;
    let r1 = b.dot_general(lhs, xc, &[0, 1], &[0, 1], &[3], &[2], ElemType::F32)?; // [N,3,16m,K]
                                                                                   // Level 2.
    let mut d16s = Vec::new();
    let mut lhs2 = Vec::new();
    for &mat in mats {
        let d16 = diag_blocks16(b, mat)?; // [N, 4, 16, 16]
        let d5 = b.reshape(d16, &[n, NB, NB, B4, B16])?;
        lhs2.push(b.slice_axis(d5, 2, 1, NB)?); // [N, 4, 3, 4, 16]
        d16s.push(d16);
    }
    let lhs2 = b.concatenate(&lhs2, 3)?;
    let x16 = b.reshape(x, &[n, NB, B16, k])?;
    let x16 = b.broadcast_in_dim(x16, &[n, NB, NB - 1, B16, k], &[0, 1, 3, 4])?;
    let xc2 = b.mul(x16, dc.col2)?;
    let r2 = b.dot_general(lhs2, xc2, &[0, 1, 2], &[0, 1, 2], &[4], &[3], ElemType::F32)?; // [N,4,3,4m,K]
                                                                                           // Level 3.
    let x4 = b.reshape(x, &[n, NB * NB, B4, k])?;
    let d5 = [n, NB * NB, B4, B4, k];
    let xj = b.broadcast_in_dim(x4, &d5, &[0, 1, 3, 4])?;
    let xd = b.mul(xj, dc.diag)?;
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
        let d4 = diag_tiles4(b, d16)?; // [N, 16, 4, 4]
        let d4 = b.broadcast_in_dim(d4, &d5, &[0, 1, 2, 3])?;
        let p = b.mul(d4, xd)?;
        let t3 = b.reduce_sum(p, &[3])?; // [N, 16, 4, K]
        let t3 = b.reshape(t3, &[n, C, k])?;
        let s = b.add(t1, t2)?;
        out.push(b.add(s, t3)?);
    }
    Ok(out)
}

/// Column side summed over pairs: `sum_p sum_{t >= j} M_p[t, j] y_p,t exp(G_t - G_j)`,
/// `[N, C, K]`, for causal `M_p` `[N, C, C]` and `y_p` `[N, C, K]`.
pub fn col_side_sum(b: &mut FnBuilder, dc: &Decay, pairs: &[(Value, Value)]) -> Result<Value> {
    let (n, k) = (pairs[0].1.dims()[0], pairs[0].1.dims()[2]);
    // Level 1: contract the rows of blocks 1..3 (all pairs at once).
    let mut lhs = Vec::new();
    let mut rhs = Vec::new();
    let mut lhs2 = Vec::new();
    let mut rhs2 = Vec::new();
    let d5 = [n, NB * NB, B4, B4, k];
    let mut t3: Option<Value> = None;
    for &(mat, y) in pairs {
        lhs.push(later_blocks(b, mat)?); // [N, 3, 16, 64]
        let yl = later_blocks(b, y)?;
        rhs.push(b.mul(yl, dc.row1)?); // [N, 3, 16, K]
        let d16 = diag_blocks16(b, mat)?;
        let d5m = b.reshape(d16, &[n, NB, NB, B4, B16])?;
        lhs2.push(b.slice_axis(d5m, 2, 1, NB)?); // [N, 4, 3, 4, 16]
        let yl2 = later_sub_blocks(b, y)?;
        rhs2.push(b.mul(yl2, dc.row2)?); // [N, 4, 3, 4, K]
        let d4 = diag_tiles4(b, d16)?; // [N, 16, 4(t), 4(j)]
        let d4 = b.broadcast_in_dim(d4, &d5, &[0, 1, 2, 3])?;
        let y4 = b.reshape(y, &[n, NB * NB, B4, k])?;
        let yt = b.broadcast_in_dim(y4, &d5, &[0, 1, 2, 4])?;
        let p = b.mul(d4, yt)?;
        let p = b.mul(p, dc.diag)?;
        let s = b.reduce_sum(p, &[2])?; // [N, 16, 4 (j), K]
        t3 = Some(match t3 {
            Some(a) => b.add(a, s)?,
            None => s,
        });
    }
    let lhs = b.concatenate(&lhs, 2)?;
    let rhs = b.concatenate(&rhs, 2)?;
    let c1 = b.dot_general(lhs, rhs, &[0, 1], &[0, 1], &[2], &[2], ElemType::F32)?; // [N, 3, 64, K]
    let c1 = b.mul(c1, dc.col1)?;
    let c1 = b.reduce_sum(c1, &[1])?; // [N, 64, K]
    let lhs2 = b.concatenate(&lhs2, 3)?;
    let rhs2 = b.concatenate(&rhs2, 3)?;
    let c2 = b.dot_general(lhs2, rhs2, &[0, 1, 2], &[0, 1, 2], &[3], &[3], ElemType::F32)?; // [N,4,3,16,K]
    let c2 = b.mul(c2, dc.col2)?;
    let c2 = b.reduce_sum(c2, &[2])?; // [N, 4, 16, K]
    let c2 = b.reshape(c2, &[n, C, k])?;
    let t3 = match t3 {
        Some(t) => b.reshape(t, &[n, C, k])?,
        None => splat(b, 0.0, &[n, C, k])?,
    };
    let s = b.add(c1, c2)?;
    b.add(s, t3)
}
