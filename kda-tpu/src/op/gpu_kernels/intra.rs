//! The intra-chunk kernel of the GPU forward: one program per (lane, chunk position) computes
//! the chunk's pair terms `Aqk` and the inverse `A = (I + L)^-1` from its own tokens alone,
//! every decay an exponential of a direct sum of gates at most 0 (no difference of running
//! sums, no factor above 1), so that strongly decayed chunks keep f32 accuracy and every row
//! reads only its own and earlier tokens.
//!
//! With 16-token sub-chunks:
//! - a pair `j < t` in different sub-chunks factors at the last token `a` before `t`'s
//!   sub-chunk: `e^(G_t - G_a) e^(G_a - G_j)`, a row factor (the segmented running sum over
//!   `t`'s sub-chunk up to `t`) and a column factor per anchor (the reverse exclusive running
//!   sum of the gates up to `a`); one product per anchor holds every such pair of a sub-chunk;
//! - a pair inside a sub-chunk (the diagonal `t = j` included for `Aqk`) takes its own exponent
//!   `sum_{j < s <= t} g_s`, accumulated over the 16 columns from the last back (each step adds
//!   the next gate on the left), and its term as a lane reduction, as fla does.

use kda_core::DType;

use crate::error::Result;
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Binary, Body, Index, Kernel, KernelBuilder, Operand, Reduction, Ref, Scan, Semantics, V};
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
    /// `A = (I + L)^-1` `[L, T, C]`, each chunk's rows, in the factors' dtype.
    pub a: Ref,
}

/// The intra kernel of `s`: grid (lanes, chunk positions), both parallel.
pub fn intra_kernel(s: &ForwardShape) -> Result<(Kernel, IntraRefs)> {
    let (l, t, nt) = (s.lanes, s.t, s.t / C);
    let mut kb = KernelBuilder::new("kda_gpu_intra");
    kb.grid(l, Semantics::Parallel).grid(nt, Semantics::Parallel);
    let tokens = tokens::declare(&mut kb, s, false);
    let at = vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let ty = TensorType::new(s.factor_dtype(), &[l, t, C]);
    let aqk = kb.output(Operand::blocked("aqk", ty.clone(), &[1, C, C], at.clone()));
    let a = kb.output(Operand::blocked("a", ty, &[1, C, C], at));
    kb.params(s.intra_launch);
    let refs = IntraRefs { tokens, aqk, a };
    let kernel = kb.build(|b| chunk_intra(b, s, &refs))?;
    Ok((kernel, refs))
}

/// Index grids of a `dims` tile: its rows' tokens, their sub-chunks and positions inside them.
pub(super) struct Rows {
    pub(super) token: V,
    pub(super) sub: V,
    pub(super) local: V,
}

pub(super) fn rows_of(b: &mut Body, dims: &[i64], axis: usize) -> Result<Rows> {
    let token = b.iota(dims, axis)?;
    let (zero, one) = (b.splat(0.0, DType::I32, dims)?, b.splat(1.0, DType::I32, dims)?);
    let mut sub = zero.clone();
    for edge in (SUB..C).step_by(SUB as usize) {
        let e = b.splat(edge as f64, DType::I32, dims)?;
        let past = b.compare(Cmp::Ge, &token, &e)?;
        let step = b.select(&past, &one, &zero)?;
        sub = b.add(&sub, &step)?;
    }
    let width = b.splat(SUB as f64, DType::I32, dims)?;
    let start = b.mul(&sub, &width)?;
    let local = b.sub(&token, &start)?;
    Ok(Rows { token, sub, local })
}

/// `x and y` of two i1 tiles.
fn and(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.select(x, y, x)
}

/// Row `idx` (a position inside a sub-chunk, i32 scalar) of each sub-chunk of `x` `[C, w]`,
/// stretched over that sub-chunk's rows; `-inf` rows where there is none (`idx` = 16). Exact:
/// a max over one value and `-inf`s.
fn sub_row(b: &mut Body, x: &V, local: &V, idx: &V) -> Result<V> {
    let w = x.ty.dims[1];
    let at = b.broadcast(idx, &[C, w])?;
    let hit = b.compare(Cmp::Eq, local, &at)?;
    let none = b.splat(f64::NEG_INFINITY, DType::F32, &[C, w])?;
    let kept = b.select(&hit, x, &none)?;
    let parts = b.reshape(&kept, &[C / SUB, SUB, w])?;
    let row = b.reduce(Reduction::Max, &parts, 1)?;
    let rows = b.broadcast(&row, &[C / SUB, SUB, w])?;
    b.reshape(&rows, &[C, w])
}

/// The pairs of `Aqk` and `L` in different sub-chunks, `[C, C]` each (zero elsewhere): rows of
/// sub-chunk `i` (read as `[16, K]` rows of the inputs) against the columns before it, through
/// the anchor `a = 16 i - 1`.
fn across_sub_chunks(
    b: &mut Body,
    s: &ForwardShape,
    r: &IntraRefs,
    x: &tokens::Chunk,
    rk: &Rows,
) -> Result<(V, V)> {
    let (k, p, fd) = (s.k, s.precision(), s.factor_dtype());
    let zero = b.splat(0.0, DType::F32, &[SUB, C])?;
    let (mut aqk, mut l) = (vec![zero.clone()], vec![zero]);
    let col = b.iota(&[SUB, C], 1)?;
    for i in 1..(C / SUB) {
        // Row factors: the running sums over the sub-chunk up to each row.
        let y = tokens::load_rows(b, s, &r.tokens, SUB * i, SUB)?;
        let rsum = b.cumsum(&y.g, 0, Scan { reverse: false, exclusive: false }, None)?;
        let er = b.exp(&rsum)?;
        let qr = b.mul(&y.q, &er)?;
        let qr = b.to_dtype(&qr, fd)?;
        let wide_beta = b.broadcast(&y.beta, &[SUB, k])?;
        let kr = b.mul(&y.k, &wide_beta)?;
        let kr = b.mul(&kr, &er)?;
        let kr = b.to_dtype(&kr, fd)?;
        // Column factors: sum_{j < s <= a} g_s on row j, the reverse exclusive sums of the gates
        // up to a.
        let anchor = b.splat((SUB * i - 1) as f64, DType::I32, &[C, k])?;
        let to_anchor = b.compare(Cmp::Le, &rk.token, &anchor)?;
        let zg = b.splat(0.0, DType::F32, &[C, k])?;
        let upto = b.select(&to_anchor, &x.g, &zg)?;
        let cs = b.cumsum(&upto, 0, Scan { reverse: true, exclusive: true }, None)?;
        let ec = b.exp(&cs)?;
        let cols = b.mul(&x.k, &ec)?;
        let cols = b.to_dtype(&cols, fd)?;
        let edge = b.splat((SUB * i) as f64, DType::I32, &[SUB, C])?;
        let before = b.compare(Cmp::Lt, &col, &edge)?;
        let zero = b.splat(0.0, DType::F32, &[SUB, C])?;
        let pq = b.matmul(&qr, &cols, (1, 1), p)?;
        aqk.push(b.select(&before, &pq, &zero)?);
        let pl = b.matmul(&kr, &cols, (1, 1), p)?;
        l.push(b.select(&before, &pl, &zero)?);
    }
    Ok((b.concat(&aqk, 0)?, b.concat(&l, 0)?))
}

/// The body: one chunk's `Aqk` and `A`.
fn chunk_intra(b: &mut Body, s: &ForwardShape, r: &IntraRefs) -> Result<()> {
    let (k, p, fd) = (s.k, s.precision(), s.factor_dtype());
    let x = tokens::load(b, s, &r.tokens)?;
    let (q, kx, g, beta) = (&x.q, &x.k, &x.g, &x.beta);
    let (aqk, l) = {
        let rk = rows_of(b, &[C, k], 0)?;
        across_sub_chunks(b, s, r, &x, &rk)?
    };
    // Pairs inside a sub-chunk, column by column from the last: `d` holds
    // sum_{j < s <= t} g_s on the rows at or after position j.
    let d0 = b.splat(0.0, DType::F32, &[C, k])?;
    let outs = b.for_range(0, SUB, &[d0, aqk, l], |b, i, carried| {
        // The index grids made here, not held across the loop.
        let (mr, mc, rk) = (rows_of(b, &[C, C], 0)?, rows_of(b, &[C, C], 1)?, rows_of(b, &[C, k], 0)?);
        let same = b.compare(Cmp::Eq, &mc.sub, &mr.sub)?;
        let last = b.index(SUB - 1)?;
        let j = b.index_op(Binary::Sub, &last, i)?;
        let one = b.index(1)?;
        let next = b.index_op(Binary::Add, &j, &one)?;
        let gn = sub_row(b, g, &rk.local, &next)?;
        let nexts = b.broadcast(&next, &[C, k])?;
        let after = b.compare(Cmp::Ge, &rk.local, &nexts)?;
        let grown = b.add(&carried[0], &gn)?;
        let zk = b.splat(0.0, DType::F32, &[C, k])?;
        let d = b.select(&after, &grown, &zk)?;
        let f = b.exp(&d)?;
        let kj = sub_row(b, kx, &rk.local, &j)?;
        let kf = b.mul(&kj, &f)?;
        let qa = b.mul(q, &kf)?;
        let a_col = b.reduce(Reduction::Sum, &qa, 1)?;
        let la = b.mul(kx, &kf)?;
        let l_col = b.reduce(Reduction::Sum, &la, 1)?;
        // Column 16 sb(t) + j of row t: at (t, j) with j at or before t (Aqk) or before it (L).
        let js = b.broadcast(&j, &[C, C])?;
        let col_here = b.compare(Cmp::Eq, &mc.local, &js)?;
        let col_here = and(b, &col_here, &same)?;
        let row_at = b.compare(Cmp::Ge, &mr.local, &js)?;
        let row_after = b.compare(Cmp::Gt, &mr.local, &js)?;
        let put_a = and(b, &col_here, &row_at)?;
        let put_l = and(b, &col_here, &row_after)?;
        let a_wide = b.broadcast(&a_col, &[C, C])?;
        let l_wide = b.broadcast(&l_col, &[C, C])?;
        let aqk = b.select(&put_a, &a_wide, &carried[1])?;
        let bl = b.broadcast(beta, &[C, C])?;
        let l_wide = b.mul(&l_wide, &bl)?;
        let l = b.select(&put_l, &l_wide, &carried[2])?;
        Ok(vec![d, aqk, l])
    })?;
    let scale = b.splat(s.scale, DType::F32, &[C, C])?;
    let aqk = b.mul(&outs[1], &scale)?;
    store(b, r.aqk, &aqk, fd)?;
    let a = unit_lower_inverse(b, &outs[2], p)?;
    store(b, r.a, &a, fd)
}
