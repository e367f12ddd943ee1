//! The intra-chunk kernel of the GPU forward: one program per (lane, chunk position) computes
//! the chunk's pair terms `Aqk` and the inverse `A = (I + L)^-1` from its own tokens alone,
//! sub-chunk by sub-chunk (`[16, K]` rows read for each), every decay an exponential of a
//! direct sum of gates at most 0 (running sums, never the difference of two; no factor above
//! 1), so that strongly decayed chunks keep f32 accuracy and every row reads only its own and
//! earlier tokens.
//!
//! For the rows of 16-token sub-chunk `i`:
//! - a pair with a column `j` of an earlier sub-chunk factors at the anchor `a = 16 i - 1`:
//!   `e^(G_t - G_a) e^(G_a - G_j)`, a row factor (the running sum over the sub-chunk up to `t`)
//!   and a column factor (the reverse exclusive running sum of the chunk's gates up to `a`);
//!   one `[16, K] x [K, 64]` product per side holds them all;
//! - a pair inside the sub-chunk (the diagonal included for `Aqk`) takes its own exponent
//!   `sum_{j < s <= t} g_s`, accumulated over the 16 columns from the last back (each step adds
//!   the next gate on the left), and its term as a lane reduction, as fla does.

use kda_core::DType;

use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType};
use crate::lang::{
    Binary, Body, Index, Kernel, KernelBuilder, MatPrecision, Offset, Operand, Reduction, Ref, Scan,
    Semantics, V,
};

use crate::op::tpu_kernels::terms::unit_lower_inverse;

use super::tokens::{self, store, TokenRefs};
use super::{ForwardShape, C, SUB};

/// The intra kernel's operands by name.
#[derive(Clone, Copy, Debug)]
pub struct IntraRefs {
    /// The per-token inputs.
    pub tokens: TokenRefs,
    /// `scale Aqk` `[L, T, C]`, each chunk's rows, in the factors' dtype.
    pub aqk: Ref,
    /// The result the WY kernel's `A` comes from: `A = (I + L)^-1` itself in the factors' dtype
    /// where one program makes the whole chunk, else `L` `[L, T, C]` f32 for [`super::inverse`].
    pub a: Ref,
}

/// The intra kernel of `s`: grid (lanes, chunk positions, [`ForwardShape::intra_programs`]),
/// all parallel.
pub fn intra_kernel(s: &ForwardShape) -> Result<(Kernel, IntraRefs)> {
    let (l, t, nt) = (s.lanes, s.t, s.t / C);
    let mut kb = KernelBuilder::new("kda_gpu_intra");
    kb.grid(l, Semantics::Parallel)
        .grid(nt, Semantics::Parallel)
        .grid(s.intra_programs(), Semantics::Parallel);
    let tokens = tokens::declare(&mut kb, s, false);
    let at = vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let aqk = kb.output(Operand::blocked(
        "aqk",
        TensorType::new(s.factor_dtype(), &[l, t, C]),
        &[1, C, C],
        at.clone(),
    ));
    let a = match s.intra_programs() {
        1 => kb.output(Operand::blocked("a", TensorType::new(s.factor_dtype(), &[l, t, C]), &[1, C, C], at)),
        _ => kb.output(Operand::blocked("l", TensorType::new(DType::F32, &[l, t, C]), &[1, C, C], at)),
    };
    kb.params(s.intra_launch);
    let refs = IntraRefs { tokens, aqk, a };
    let kernel = kb.build(|b| chunk_intra(b, s, &refs))?;
    Ok((kernel, refs))
}

/// `x and y` of two i1 tiles.
fn and(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.select(x, y, x)
}

/// Row `idx` (an i32 scalar) of the `[16, w]` tile `x`, stretched over its rows; `-inf` rows
/// where there is none (`idx` = 16). Exact: a max over one value and `-inf`s.
pub(super) fn row_of(b: &mut Body, x: &V, local: &V, idx: &V) -> Result<V> {
    let dims = x.ty.dims.clone();
    let at = b.broadcast(idx, &dims)?;
    let hit = b.compare(Cmp::Eq, local, &at)?;
    let none = b.splat(f64::NEG_INFINITY, DType::F32, &dims)?;
    let kept = b.select(&hit, x, &none)?;
    let row = b.reduce(Reduction::Max, &kept, 0)?;
    b.broadcast(&row, &dims)
}

/// The pairs of sub-chunk `y` (`[16, K]` rows) with itself, the diagonal included for `Aqk`:
/// `[16, 16]` blocks of `Aqk` and `L`. Column by column from the last, `d` holds
/// `sum_{j < s <= t} g_s` on the rows at or after position `j`; each column's terms are lane
/// reductions.
fn within_sub_chunk(b: &mut Body, k: i64, y: &tokens::Chunk) -> Result<(V, V)> {
    let d0 = b.splat(0.0, DType::F32, &[SUB, k])?;
    let z = b.splat(0.0, DType::F32, &[SUB, SUB])?;
    let outs = b.for_range(0, SUB, &[d0, z.clone(), z], |b, i, carried| {
        let local = b.iota(&[SUB, k], 0)?;
        let last = b.index(SUB - 1)?;
        let j = b.index_op(Binary::Sub, &last, i)?;
        let one = b.index(1)?;
        let next = b.index_op(Binary::Add, &j, &one)?;
        let gn = row_of(b, &y.g, &local, &next)?;
        let nexts = b.broadcast(&next, &[SUB, k])?;
        let after = b.compare(Cmp::Ge, &local, &nexts)?;
        let grown = b.add(&carried[0], &gn)?;
        let zk = b.splat(0.0, DType::F32, &[SUB, k])?;
        let d = b.select(&after, &grown, &zk)?;
        let f = b.exp(&d)?;
        let kj = row_of(b, &y.k, &local, &j)?;
        let kf = b.mul(&kj, &f)?;
        let qa = b.mul(&y.q, &kf)?;
        let a_col = b.reduce(Reduction::Sum, &qa, 1)?;
        let la = b.mul(&y.k, &kf)?;
        let l_col = b.reduce(Reduction::Sum, &la, 1)?;
        let l_col = b.mul(&l_col, &y.beta)?;
        // Column j of row t: with j at or before t (Aqk), before it (L).
        let (rows, cols) = (b.iota(&[SUB, SUB], 0)?, b.iota(&[SUB, SUB], 1)?);
        let js = b.broadcast(&j, &[SUB, SUB])?;
        let col_here = b.compare(Cmp::Eq, &cols, &js)?;
        let row_at = b.compare(Cmp::Ge, &rows, &js)?;
        let row_after = b.compare(Cmp::Gt, &rows, &js)?;
        let put_a = and(b, &col_here, &row_at)?;
        let put_l = and(b, &col_here, &row_after)?;
        let a_wide = b.broadcast(&a_col, &[SUB, SUB])?;
        let l_wide = b.broadcast(&l_col, &[SUB, SUB])?;
        let aqk = b.select(&put_a, &a_wide, &carried[1])?;
        let l = b.select(&put_l, &l_wide, &carried[2])?;
        Ok(vec![d, aqk, l])
    })?;
    Ok((outs[1].clone(), outs[2].clone()))
}

/// The pairs of sub-chunk `i` (its rows `y`) with the columns before it, through the anchor
/// `a = 16 i - 1`: `[16, 64]` rows of `Aqk` and `L` (zero from column `16 i` on). The row
/// factors are the running sums over the sub-chunk up to each row; the column factors
/// `sum_{j < s <= a} g_s` the reverse exclusive running sums of the chunk's gates up to `a`.
fn across_sub_chunks(
    b: &mut Body,
    s: &ForwardShape,
    i: i64,
    y: &tokens::Chunk,
    x: &tokens::Chunk,
) -> Result<(V, V)> {
    let (k, p, fd) = (y.g.ty.dims[1], s.precision(), s.factor_dtype());
    let rsum = b.cumsum(&y.g, 0, Scan { reverse: false, exclusive: false }, None)?;
    let er = b.exp(&rsum)?;
    let qr = b.mul(&y.q, &er)?;
    let qr = b.to_dtype(&qr, fd)?;
    let wide_beta = b.broadcast(&y.beta, &[SUB, k])?;
    let kr = b.mul(&y.k, &wide_beta)?;
    let kr = b.mul(&kr, &er)?;
    let kr = b.to_dtype(&kr, fd)?;
    let token = b.iota(&[C, k], 0)?;
    let anchor = b.splat((SUB * i - 1) as f64, DType::I32, &[C, k])?;
    let to_anchor = b.compare(Cmp::Le, &token, &anchor)?;
    let zg = b.splat(0.0, DType::F32, &[C, k])?;
    let upto = b.select(&to_anchor, &x.g, &zg)?;
    let cs = b.cumsum(&upto, 0, Scan { reverse: true, exclusive: true }, None)?;
    let ec = b.exp(&cs)?;
    let cols = b.mul(&x.k, &ec)?;
    let cols = b.to_dtype(&cols, fd)?;
    let col = b.iota(&[SUB, C], 1)?;
    let edge = b.splat((SUB * i) as f64, DType::I32, &[SUB, C])?;
    let before = b.compare(Cmp::Lt, &col, &edge)?;
    let zero = b.splat(0.0, DType::F32, &[SUB, C])?;
    let pq = b.matmul(&qr, &cols, (1, 1), p)?;
    let pl = b.matmul(&kr, &cols, (1, 1), p)?;
    Ok((b.select(&before, &pq, &zero)?, b.select(&before, &pl, &zero)?))
}

/// `[16, 64]` rows with `block` `[16, 16]` at column block `i`, zero elsewhere.
fn placed(b: &mut Body, block: &V, i: i64) -> Result<V> {
    let z = b.splat(0.0, DType::F32, &[SUB, SUB])?;
    let parts: Vec<V> = (0..C / SUB).map(|c| if c == i { block.clone() } else { z.clone() }).collect();
    b.concat(&parts, 1)
}

/// `x + y`, or `y` alone where there is no `x` yet.
fn summed(b: &mut Body, x: Option<V>, y: V) -> Result<V> {
    match x {
        Some(x) => b.add(&x, &y),
        None => Ok(y),
    }
}

/// The body: one chunk's `Aqk` and `A` where one program makes the chunk (bf16: the inverse
/// by one-pass `[64, 64]` products, which fit the registers); else program `i` of grid axis 2
/// makes the rows of sub-chunk `i` of `Aqk` and `L` (f32: [`super::inverse`] inverts `L`).
fn chunk_intra(b: &mut Body, s: &ForwardShape, r: &IntraRefs) -> Result<()> {
    let fd = s.factor_dtype();
    let norms = if s.bk() < s.k { tokens::norms(b, s, &r.tokens)? } else { None };
    let norms = norms.as_ref();
    if s.intra_programs() == 1 {
        let (mut aqk, mut l) = (Vec::new(), Vec::new());
        for i in 0..(C / SUB) {
            let rows = sub_chunk_rows(b, s, r, i, norms)?;
            l.push(l_rows(b, &rows, i)?);
            aqk.push(rows.aqk);
        }
        let (aqk, l) = (b.concat(&aqk, 0)?, b.concat(&l, 0)?);
        store(b, r.aqk, &aqk, fd)?;
        let a = unit_lower_inverse(b, &l, s.precision())?;
        return store(b, r.a, &a, fd);
    }
    let at = b.program_id(2)?;
    for i in 0..(C / SUB) {
        let here = b.index(i)?;
        let here = b.compare(Cmp::Eq, &at, &here)?;
        b.when(&here, |b| {
            let rows = sub_chunk_rows(b, s, r, i, norms)?;
            store_rows(b, r.aqk, SUB * i, &rows.aqk, fd)?;
            let l = l_rows(b, &rows, i)?;
            store_rows(b, r.a, SUB * i, &l, DType::F32)
        })?;
    }
    Ok(())
}

/// Sub-chunk `i`'s `[16, 64]` rows of `L`.
fn l_rows(b: &mut Body, rows: &SubChunkRows, i: i64) -> Result<V> {
    let l = placed(b, &rows.l_diagonal, i)?;
    match &rows.l_before {
        Some(lo) => b.add(&l, lo),
        None => Ok(l),
    }
}

/// Stores the `[16, 64]` rows `x` at row `at` of `r`'s `[1, C, C]` block, in `dtype`.
fn store_rows(b: &mut Body, r: Ref, at: i64, x: &V, dtype: DType) -> Result<()> {
    let x = b.to_dtype(x, dtype)?;
    let x = b.reshape(&x, &[1, SUB, C])?;
    b.store(r, &[Offset::Const(0), Offset::Const(at), Offset::Const(0)], &x)
}

/// The rows of sub-chunk `i` of the chunk's terms.
struct SubChunkRows {
    /// `scale Aqk` `[16, 64]`.
    aqk: V,
    /// `L`'s diagonal block `[16, 16]`.
    l_diagonal: V,
    /// `L` left of the diagonal block `[16, 64]` (zero from column `16 i`), past sub-chunk 0.
    l_before: Option<V>,
}

/// Sub-chunk `i`'s rows of `scale Aqk` and `L`, each pair term summed over blocks of `BK` key
/// columns.
fn sub_chunk_rows(
    b: &mut Body,
    s: &ForwardShape,
    r: &IntraRefs,
    i: i64,
    norms: Option<&tokens::Norms>,
) -> Result<SubChunkRows> {
    let (k, bk) = (s.k, s.bk());
    let (mut a_row, mut l_diag, mut l_before) = (None, None, None);
    for col in (0..k).step_by(bk as usize) {
        let y = tokens::load_tile(b, s, &r.tokens, (SUB * i, SUB), (col, bk), norms)?;
        let (ad, ld) = within_sub_chunk(b, bk, &y)?;
        let mut ad = placed(b, &ad, i)?;
        l_diag = Some(summed(b, l_diag, ld)?);
        if i > 0 {
            let x = tokens::load_tile(b, s, &r.tokens, (0, C), (col, bk), norms)?;
            let (ao, lo) = across_sub_chunks(b, s, i, &y, &x)?;
            ad = b.add(&ad, &ao)?;
            l_before = Some(summed(b, l_before, lo)?);
        }
        a_row = Some(summed(b, a_row, ad)?);
    }
    let internal = || TpuError::builder("kda_gpu_intra", "internal: no key columns");
    let aqk = a_row.ok_or_else(internal)?;
    let scale = b.splat(s.scale, DType::F32, &[SUB, C])?;
    let aqk = b.mul(&aqk, &scale)?;
    Ok(SubChunkRows { aqk, l_diagonal: l_diag.ok_or_else(internal)?, l_before })
}

/// `A = (I + L)^-1` of the chunk's strictly lower `L` given as its `[16, 16]` blocks (`l[i][j]`,
/// `j <= i`), as `[16, 64]` row blocks: each diagonal block's inverse `D_i` by the nilpotent
/// series `(I - L_ii)(I + L_ii^2)(I + L_ii^4)(I + L_ii^8)`, then block forward substitution
/// `A_ij = -D_i sum_{j <= m < i} L_im A_mj`. Every product is `[16, 16] x [16, 16]`, so that no
/// operand of a three-pass f32 product outgrows the registers.
pub(super) fn block_inverse(b: &mut Body, l: &[Vec<V>], p: MatPrecision) -> Result<Vec<V>> {
    let rows = b.iota(&[SUB, SUB], 0)?;
    let cols = b.iota(&[SUB, SUB], 1)?;
    let on = b.compare(Cmp::Eq, &rows, &cols)?;
    let (one, zero) = (b.splat(1.0, DType::F32, &[SUB, SUB])?, b.splat(0.0, DType::F32, &[SUB, SUB])?);
    let eye = b.select(&on, &one, &zero)?;
    let mut a: Vec<Vec<V>> = Vec::new();
    for (i, li) in l.iter().enumerate() {
        let mut d = b.sub(&eye, &li[i])?;
        let mut pow = li[i].clone();
        for _ in 0..3 {
            pow = b.matmul(&pow, &pow, (1, 0), p)?;
            let f = b.add(&eye, &pow)?;
            d = b.matmul(&d, &f, (1, 0), p)?;
        }
        let mut row = Vec::new();
        for j in 0..i {
            let mut sum = None;
            for (lim, am) in li[j..i].iter().zip(&a[j..i]) {
                let x = b.matmul(lim, &am[j], (1, 0), p)?;
                sum = Some(summed(b, sum, x)?);
            }
            let sum =
                sum.ok_or_else(|| TpuError::builder("kda_gpu_intra", "internal: an empty block sum"))?;
            let x = b.matmul(&d, &sum, (1, 0), p)?;
            row.push(b.neg(&x)?);
        }
        row.push(d);
        a.push(row);
    }
    a.into_iter()
        .map(|mut row| {
            while row.len() < (C / SUB) as usize {
                row.push(zero.clone());
            }
            b.concat(&row, 1)
        })
        .collect()
}
