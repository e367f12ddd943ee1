//! The chunk-parallel kernel of the GPU forward: one program per (lane, chunk) computes the
//! chunk's terms from its own tokens alone, every decay an exponential of a direct sum of gates
//! at most 0 (no difference of cumulative sums, no factor above 1), so that strongly decayed
//! chunks keep f32 accuracy and every row reads only its own and earlier tokens.
//!
//! With `G` the chunk's inclusive sums of `g` and 16-token sub-chunks:
//! - a pair `j < t` in different sub-chunks factors at the last token `a` before `t`'s
//!   sub-chunk: `e^(G_t - G_a) e^(G_a - G_j)`, a row factor (the sum over `t`'s sub-chunk up to
//!   `t`) and a column factor per anchor (the sum after `j` up to `a`), each from a product of a
//!   0/1 coefficient mask with `g`; one product per anchor holds every such pair of the
//!   sub-chunk;
//! - a pair inside a sub-chunk (the diagonal `t = j` included for `Aqk`) takes its own exponent
//!   `sum_{j < s <= t} g_s`, accumulated over the 16 columns from the last back (each step adds
//!   the next gate on the left), and its term as a lane reduction, as fla does.

use kda_core::DType;

use crate::error::Result;
use crate::hlo::{Cmp, TensorType};
use crate::lang::{
    Binary, Body, Index, Kernel, KernelBuilder, MatPrecision, Operand, Reduction, Ref, Semantics, V,
};
use crate::op::tpu_kernels::terms::unit_lower_inverse;

use super::{Factors, ForwardShape, C, SUB};

/// The terms kernel's operands by name.
#[derive(Clone, Copy, Debug)]
pub struct TermRefs {
    /// `q`, `k` `[L, T, K]`, `v` `[L, T, V]` (the input dtype), `g` `[L, T, K]` f32 (the
    /// log-decay), `beta` `[L, T, 1]` (the input dtype).
    pub q: Ref,
    /// Keys.
    pub k: Ref,
    /// Values.
    pub v: Ref,
    /// Log-decay.
    pub g: Ref,
    /// Write strengths.
    pub beta: Ref,
    /// The results: what the recurrence reads.
    pub factors: Factors,
}

/// The terms kernel of `s`: grid (lanes, chunks), both parallel.
pub fn terms_kernel(s: &ForwardShape) -> Result<(Kernel, TermRefs)> {
    let (l, t, nt, k, v) = (s.lanes, s.t, s.t / C, s.k, s.v);
    let ty = |d: DType, dims: &[i64]| TensorType::new(d, dims);
    let at = || vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let mut kb = KernelBuilder::new("kda_gpu_terms");
    kb.grid(l, Semantics::Parallel).grid(nt, Semantics::Parallel);
    let tok = |kb: &mut KernelBuilder, name: &str, d: DType, w: i64| {
        kb.input(Operand::blocked(name, ty(d, &[l, t, w]), &[1, C, w], at()))
    };
    let (q, kk, vv) =
        (tok(&mut kb, "q", s.dtype, k), tok(&mut kb, "k", s.dtype, k), tok(&mut kb, "v", s.dtype, v));
    let g = tok(&mut kb, "g", DType::F32, k);
    let beta = tok(&mut kb, "beta", s.dtype, 1);
    let res = |kb: &mut KernelBuilder, name: &str, d: DType, w: i64| {
        kb.output(Operand::blocked(name, ty(d, &[l, t, w]), &[1, C, w], at()))
    };
    let fd = s.factor_dtype();
    let (w, u) = (res(&mut kb, "w", fd, k), res(&mut kb, "u", DType::F32, v));
    let (qg, kg, aqk) = (res(&mut kb, "qg", fd, k), res(&mut kb, "kg", fd, k), res(&mut kb, "aqk", fd, C));
    let eg = kb.output(Operand::blocked("eg", ty(DType::F32, &[l, nt, k]), &[1, 1, k], at()));
    kb.params(s.terms_launch);
    let refs = TermRefs { q, k: kk, v: vv, g, beta, factors: Factors { w, u, qg, kg, aqk, eg } };
    let kernel = kb.build(|b| chunk_terms(b, s, &refs))?;
    Ok((kernel, refs))
}

fn f32_block(b: &mut Body, r: Ref, w: i64) -> Result<V> {
    let x = b.load_all(r)?;
    let x = b.reshape(&x, &[C, w])?;
    b.to_dtype(&x, DType::F32)
}

/// Stores the `[C, w]` tile `x` into `r`'s block, in `r`'s element type.
fn store(b: &mut Body, r: Ref, x: &V, dtype: DType) -> Result<()> {
    let dims = x.ty.dims.clone();
    let x = b.to_dtype(x, dtype)?;
    let x = b.reshape(&x, &[1, dims[0], dims[1]])?;
    b.store_all(r, &x)
}

/// Index grids of a `dims` tile: its rows' tokens, their sub-chunks and positions inside them.
struct Rows {
    token: V,
    sub: V,
    local: V,
}

fn rows_of(b: &mut Body, dims: &[i64], axis: usize) -> Result<Rows> {
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

/// 1.0 where `cond` holds, else 0.0 (f32).
fn indicator(b: &mut Body, cond: &V) -> Result<V> {
    let dims = cond.ty.dims.clone();
    let (one, zero) = (b.splat(1.0, DType::F32, &dims)?, b.splat(0.0, DType::F32, &dims)?);
    b.select(cond, &one, &zero)
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

/// The body: one chunk's terms, inverse, `w`, `u` and the factors the recurrence reads.
fn chunk_terms(b: &mut Body, s: &ForwardShape, r: &TermRefs) -> Result<()> {
    let (k, v) = (s.k, s.v);
    let (p, fd) = (s.precision(), s.factor_dtype());
    let hi = MatPrecision::Highest;
    let (q, kx, g, beta) =
        (f32_block(b, r.q, k)?, f32_block(b, r.k, k)?, f32_block(b, r.g, k)?, f32_block(b, r.beta, 1)?);
    // Coefficient masks over (row t, column s), and their products with g: direct sums.
    let (mr, mc) = (rows_of(b, &[C, C], 0)?, rows_of(b, &[C, C], 1)?);
    let le = b.compare(Cmp::Le, &mc.token, &mr.token)?;
    let gt = b.compare(Cmp::Gt, &mc.token, &mr.token)?;
    let same = b.compare(Cmp::Eq, &mc.sub, &mr.sub)?;
    let sum = |b: &mut Body, cond: &V| -> Result<V> {
        let m = indicator(b, cond)?;
        b.matmul(&m, &g, (1, 0), hi)
    };
    let within = and(b, &le, &same)?;
    let rsum = sum(b, &within)?; // sum over t's sub-chunk up to t
                                 // Pairs in different sub-chunks: rows of sub-chunk i against columns before it, through the
                                 // anchor a = 16 i - 1.
    let er = b.exp(&rsum)?;
    let qr = b.mul(&q, &er)?;
    let wide_beta = b.broadcast(&beta, &[C, k])?;
    let bk = b.mul(&kx, &wide_beta)?;
    let kr = b.mul(&bk, &er)?;
    let zero = b.splat(0.0, DType::F32, &[C, C])?;
    let (mut aqk, mut l) = (zero.clone(), zero.clone());
    for i in 1..(C / SUB) {
        let anchor = b.splat((SUB * i - 1) as f64, DType::I32, &[C, C])?;
        let to_anchor = b.compare(Cmp::Le, &mc.token, &anchor)?;
        let cond = and(b, &gt, &to_anchor)?;
        let cs = sum(b, &cond)?; // sum_{j < s <= a} g_s, row j
        let ec = b.exp(&cs)?;
        let cols = b.mul(&kx, &ec)?;
        let block = b.splat(i as f64, DType::I32, &[C, C])?;
        let in_rows = b.compare(Cmp::Eq, &mr.sub, &block)?;
        let before = b.compare(Cmp::Lt, &mc.sub, &block)?;
        let keep = and(b, &in_rows, &before)?;
        let pq = b.matmul(&qr, &cols, (1, 1), p)?;
        aqk = b.select(&keep, &pq, &aqk)?;
        let pl = b.matmul(&kr, &cols, (1, 1), p)?;
        l = b.select(&keep, &pl, &l)?;
    }
    // Pairs inside a sub-chunk, column by column from the last: `d` holds
    // sum_{j < s <= t} g_s on the rows at or after position j.
    let rk = rows_of(b, &[C, k], 0)?;
    let d0 = b.splat(0.0, DType::F32, &[C, k])?;
    let outs = b.for_range(0, SUB, &[d0, aqk, l], |b, i, carried| {
        let last = b.index(SUB - 1)?;
        let j = b.index_op(Binary::Sub, &last, i)?;
        let one = b.index(1)?;
        let next = b.index_op(Binary::Add, &j, &one)?;
        let gn = sub_row(b, &g, &rk.local, &next)?;
        let nexts = b.broadcast(&next, &[C, k])?;
        let after = b.compare(Cmp::Ge, &rk.local, &nexts)?;
        let grown = b.add(&carried[0], &gn)?;
        let zk = b.splat(0.0, DType::F32, &[C, k])?;
        let d = b.select(&after, &grown, &zk)?;
        let f = b.exp(&d)?;
        let kj = sub_row(b, &kx, &rk.local, &j)?;
        let kf = b.mul(&kj, &f)?;
        let qa = b.mul(&q, &kf)?;
        let a_col = b.reduce(Reduction::Sum, &qa, 1)?;
        let la = b.mul(&kx, &kf)?;
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
        let bl = b.broadcast(&beta, &[C, C])?;
        let l_wide = b.mul(&l_wide, &bl)?;
        let l = b.select(&put_l, &l_wide, &carried[2])?;
        Ok(vec![d, aqk, l])
    })?;
    let (aqk, l) = (&outs[1], &outs[2]);
    let scale = b.splat(s.scale, DType::F32, &[C, C])?;
    let aqk = b.mul(aqk, &scale)?;
    store(b, r.factors.aqk, &aqk, fd)?;
    let a = unit_lower_inverse(b, l, p)?;
    // The whole-chunk sums last, so that they are not held across the loop above.
    let gc = sum(b, &le)?; // G_t = sum_{s <= t} g_s
    let gs = sum(b, &gt)?; // G_C - G_t = sum_{s > t} g_s
    let bk = b.mul(&kx, &wide_beta)?;
    let egc = b.exp(&gc)?;
    let kbg = b.mul(&bk, &egc)?;
    let wv = b.matmul(&a, &kbg, (1, 0), p)?;
    store(b, r.factors.w, &wv, fd)?;
    let vx = f32_block(b, r.v, v)?;
    let beta_v = b.broadcast(&beta, &[C, v])?;
    let bv = b.mul(&vx, &beta_v)?;
    let uv = b.matmul(&a, &bv, (1, 0), p)?;
    store(b, r.factors.u, &uv, DType::F32)?;
    let sk = b.splat(s.scale, DType::F32, &[C, k])?;
    let qg = b.mul(&q, &egc)?;
    let qg = b.mul(&qg, &sk)?;
    store(b, r.factors.qg, &qg, fd)?;
    let egs = b.exp(&gs)?;
    let kg = b.mul(&kx, &egs)?;
    store(b, r.factors.kg, &kg, fd)?;
    let total = b.slice(&gc, &[C - 1, 0], &[1, k])?;
    let eg = b.exp(&total)?;
    let eg = b.reshape(&eg, &[1, 1, k])?;
    b.store_all(r.factors.eg, &eg)?;
    Ok(())
}
