//! The WY gradient of the GPU backward (fla's `wy_dqkg_fused` and `dAv`): one program per
//! (lane, chunk position) forms every gradient of the chunk that runs through the states and
//! the WY solve, from the forward's `A`, the entering state `h`, the state gradient's `dh` and
//! `dv'`, `v_new = u - w h` and `dO`, `BK` key columns and `BV` value columns at a time:
//!
//! - `dv = beta (A^T dv')`, `dbeta` from `A^T dv' . v` and `-A^T dw . k e^G`;
//! - `dq = scale (dO h^T) e^G`, `dk = (v_new dh^T) e^(G_C - G) - beta (-A^T dw) e^G`, both with
//!   `Aqk`'s diagonal `scale dO . v_new` (whose gate terms cancel exactly, so it goes here);
//! - the gate gradient of these terms, summed within the chunk as the library forms it
//!   (docs/kernels/gate-gradient.md): a suffix sum of the row terms, an exclusive prefix sum of
//!   the `kg` terms and the whole-chunk decay's term on every row;
//! - the pair gradients the intra-gradient kernel ([`super::intra_grad`]) takes on: `scale dO
//!   v_new^T` and `dL`, both strictly causal. `dL = -(A^T dw) w^T - (A^T dv') u^T` with
//!   `dw = -dv' h^T` is `(A^T dv') (w h - u)^T = -(A^T dv') v_new^T`: one product on the value
//!   side, nothing summed over key blocks, and no difference of `u` and `w h` formed.

use kda_core::DType;

use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, FnBuilder, TensorType, Value};
use crate::lang::{
    Binary, Bindings, Body, Index, Kernel, KernelBuilder, Lower, Offset, Operand, Reduction, Ref, Scan,
    Semantics, V,
};
use crate::op::chunk::mul_const;

use super::tokens::{self, f32_tile, store_columns, ChunkRows, TokenRefs};
use super::{ForwardShape, C};

/// The WY-gradient kernel's operands by name (`[L, T, D]` lane-major tokens).
#[derive(Clone, Copy, Debug)]
pub struct WyGradRefs {
    /// The per-token inputs (`v` included).
    pub tokens: TokenRefs,
    /// The forward's `A = (I + L)^-1` `[L, T, C]`, in [`ForwardShape::factor_dtype`].
    pub a: Ref,
    /// `v_new = u - w h` `[L, T, V]`, as the forward's recurrence writes it.
    pub v_new: Ref,
    /// The state entering each chunk `[L, NT, K, V]` in [`ForwardShape::h_dtype`].
    pub h: Ref,
    /// `dh` leaving each chunk `[L, NT, K, V]` in the factors' dtype.
    pub dh: Ref,
    /// `dv'` `[L, T, V]` f32.
    pub dv_new: Ref,
    /// `dO` `[L, T, V]` in the input dtype, in the tokens' layout.
    pub d_o: Ref,
    /// `dv` `[L, T, V]` in the input dtype, in the tokens' layout.
    pub dv: Ref,
    /// This kernel's part of `dq` `[L, T, K]` f32.
    pub dq: Ref,
    /// Its part of `dk` `[L, T, K]` f32.
    pub dk: Ref,
    /// Its part of `dg`, summed within the chunk, `[L, T, K]` f32.
    pub dg: Ref,
    /// Its terms of `dbeta` `[L, T, K / BK + 1]` f32: one per key block, then the value side's.
    pub dbeta: Ref,
    /// `scale dO v_new^T`, strictly causal, `[L, T, C]` f32.
    pub daqk: Ref,
    /// `dL = -(A^T dv') v_new^T`, strictly causal, `[L, T, C]` f32.
    pub dl: Ref,
}

/// The WY-gradient kernel of `s`: grid (lanes, chunk positions,
/// [`ForwardShape::wy_grad_parts`]), all parallel: per chunk a program per block of
/// [`ForwardShape::wy_grad_bk`] key columns, then the value side's.
pub fn wy_grad_kernel(s: &ForwardShape) -> Result<(Kernel, WyGradRefs)> {
    let (l, t, nt, k, v) = (s.lanes, s.t, s.t / C, s.k, s.v);
    let mut kb = KernelBuilder::new("kda_gpu_wy_grad");
    let parts = s.wy_grad_parts();
    kb.grid(l, Semantics::Parallel).grid(nt, Semantics::Parallel).grid(parts, Semantics::Parallel);
    let tokens = tokens::declare(&mut kb, s, true);
    let ty = |d: DType, dims: &[i64]| TensorType::new(d, dims);
    let at = || vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let chunk = |name: &str, d: DType, w: i64| Operand::blocked(name, ty(d, &[l, t, w]), &[1, C, w], at());
    let state = |name: &str, d: DType| {
        let at = vec![Index::Grid(0), Index::Grid(1), Index::Const(0), Index::Const(0)];
        Operand::blocked(name, ty(d, &[l, nt, k, v]), &[1, 1, k, v], at)
    };
    let fd = s.factor_dtype();
    let a = kb.input(chunk("a", fd, C));
    let v_new = kb.input(chunk("v_new", fd, v));
    let h = kb.input(state("h", s.h_dtype));
    let dh = kb.input(state("dh", fd));
    let dv_new = kb.input(chunk("dv_new", DType::F32, v));
    let token = |name: &str| tokens::operand(name, s, s.dtype, v, (C, Index::Grid(1)), (v, Index::Const(0)));
    let d_o = kb.input(token("do"));
    let dv = kb.output(token("dv"));
    let dq = kb.output(chunk("dq", DType::F32, k));
    let dk = kb.output(chunk("dk", DType::F32, k));
    let dg = kb.output(chunk("dg", DType::F32, k));
    let dbeta = kb.output(chunk("dbeta", DType::F32, k / s.wy_grad_bk() + 1));
    let daqk = kb.output(chunk("daqk", DType::F32, C));
    let dl = kb.output(chunk("dl", DType::F32, C));
    kb.params(s.wy_grad_launch);
    let refs = WyGradRefs { tokens, a, v_new, h, dh, dv_new, d_o, dv, dq, dk, dg, dbeta, daqk, dl };
    let kernel = kb.build(|b| chunk_wy_grad(b, s, &refs))?;
    Ok((kernel, refs))
}

/// Rows `0..C` and columns `col..col + w` of `r`'s `[1, C, D]` block.
fn tile(b: &mut Body, r: Ref, col: i64, w: i64) -> Result<V> {
    tokens::tile(b, r, &ChunkRows::LANE_BLOCK, (0, C), (Offset::Const(col), w))
}

/// Rows `row..row + bk` and columns `col..col + bv` of a state block `[1, 1, K, V]`, in f32.
fn state_tile(b: &mut Body, r: Ref, (row, bk): (i64, i64), (col, bv): (i64, i64)) -> Result<V> {
    let z = Offset::Const(0);
    let x = b.load(r, &[z.clone(), z, Offset::Const(row), Offset::Const(col)], &[1, 1, bk, bv])?;
    let x = b.reshape(&x, &[bk, bv])?;
    b.to_dtype(&x, DType::F32)
}

/// `x y` contracting `contract`, the operands in the factors' dtype at the shape's precision.
pub(super) fn product(b: &mut Body, s: &ForwardShape, x: &V, y: &V, contract: (usize, usize)) -> Result<V> {
    let fd = s.factor_dtype();
    let (x, y) = (b.to_dtype(x, fd)?, b.to_dtype(y, fd)?);
    b.matmul(&x, &y, contract, s.precision())
}

/// `x` (a chunk's pairs) where the pair `(t, j)` has `t > j`, else 0.
fn strictly_causal(b: &mut Body, x: &V) -> Result<V> {
    let dims = x.ty.dims.clone();
    let (rows, cols) = (b.iota(&dims, 0)?, b.iota(&dims, 1)?);
    let below = b.compare(Cmp::Gt, &rows, &cols)?;
    let zero = b.splat(0.0, DType::F32, &dims)?;
    b.select(&below, x, &zero)
}

/// `acc + x`, or `x` where there is no `acc` yet.
pub(super) fn plus(b: &mut Body, acc: Option<V>, x: V) -> Result<V> {
    match acc {
        Some(a) => b.add(&a, &x),
        None => Ok(x),
    }
}

/// The body: program `i` of grid axis 2 takes key block `i`, the next the value side's pairs
/// (`dO v_new^T`), the last what runs through `A^T dv'`; each holds its own accumulators.
fn chunk_wy_grad(b: &mut Body, s: &ForwardShape, r: &WyGradRefs) -> Result<()> {
    let rows = r.tokens.rows(b)?;
    let beta = f32_tile(b, r.tokens.beta, &rows, (0, C), (0, 1))?;
    let at = b.program_id(2)?;
    let blocks = s.k / s.wy_grad_bk();
    let norms = if s.wy_grad_bk() < s.k { tokens::norms(b, s, &r.tokens)? } else { None };
    let program = |b: &mut Body, i: i64| -> Result<V> {
        let i = b.index(i)?;
        b.compare(Cmp::Eq, &at, &i)
    };
    for i in 0..blocks {
        let here = program(b, i)?;
        b.when(&here, |b| key_block(b, s, r, &beta, norms.as_ref(), i))?;
    }
    let here = program(b, blocks)?;
    b.when(&here, |b| value_pairs(b, s, r))?;
    let here = program(b, blocks + 1)?;
    b.when(&here, |b| value_solve(b, s, r, &beta))
}

/// The chunk's `A` as a `[C, C]` tile.
fn load_a(b: &mut Body, r: &WyGradRefs) -> Result<V> {
    let a = b.load_all(r.a)?;
    b.reshape(&a, &[C, C])
}

/// `scale dO v_new^T`, strictly causal, for the intra gradient.
fn value_pairs(b: &mut Body, s: &ForwardShape, r: &WyGradRefs) -> Result<()> {
    let (v, bv) = (s.v, s.bv());
    let rows = r.tokens.rows(b)?;
    let mut da = None;
    for j in 0..v / bv {
        let vc = j * bv;
        let d_o = tokens::tile(b, r.d_o, &rows, (0, C), (Offset::Const(vc), bv))?;
        let vn = tile(b, r.v_new, vc, bv)?;
        let x = product(b, s, &d_o, &vn, (1, 1))?;
        da = Some(plus(b, da, x)?);
    }
    let da = da.ok_or_else(|| TpuError::builder("kda_gpu_wy_grad", "internal: no value columns"))?;
    let da = strictly_causal(b, &da)?;
    let da = mul_const(b, &da, s.scale)?;
    store_columns(b, r.daqk, 0, &da, DType::F32)
}

/// Through `A^T dv'`: `dv = beta (A^T dv')`, `dL = -(A^T dv') v_new^T` (strictly causal, for
/// the intra gradient) and `(A^T dv') . v` (a term of `dbeta`). The value blocks run as a loop:
/// unrolled, their loads were hoisted together and f32 spilled.
fn value_solve(b: &mut Body, s: &ForwardShape, r: &WyGradRefs, beta: &V) -> Result<()> {
    let (v, bv) = (s.v, s.bv());
    let internal = |what: &str| TpuError::builder("kda_gpu_wy_grad", format!("internal: {what}"));
    let v_in = r.tokens.v.ok_or_else(|| internal("no v operand"))?;
    let rows = r.tokens.rows(b)?;
    let lanes = ChunkRows::LANE_BLOCK;
    let a = load_a(b, r)?;
    let init = [b.splat(0.0, DType::F32, &[C, C])?, b.splat(0.0, DType::F32, &[C, 1])?];
    let out = b.for_range(0, v / bv, &init, |b, j, acc| {
        let width = b.index(bv)?;
        let vc = b.index_op(Binary::Mul, j, &width)?;
        let cols = (Offset::Dyn(vc.clone(), bv), bv);
        let dvn = tokens::tile(b, r.dv_new, &lanes, (0, C), cols.clone())?;
        let vn = tokens::tile(b, r.v_new, &lanes, (0, C), cols.clone())?;
        let xu = product(b, s, &a, &dvn, (0, 0))?;
        let dv = b.mul(&xu, beta)?;
        tokens::store_tile(b, r.dv, &rows, (0, cols.0.clone()), &dv, s.dtype)?;
        let vx = tokens::tile(b, v_in, &rows, (0, C), cols)?;
        let vx = b.to_dtype(&vx, DType::F32)?;
        let x = b.mul(&xu, &vx)?;
        let x = b.reduce(Reduction::Sum, &x, 1)?;
        let db = b.add(&acc[1], &x)?;
        let x = product(b, s, &xu, &vn, (1, 1))?;
        let dl = b.sub(&acc[0], &x)?;
        Ok(vec![dl, db])
    })?;
    let (dl, db) = match out.as_slice() {
        [dl, db] => (dl.clone(), db.clone()),
        _ => return Err(internal("loop values")),
    };
    store_columns(b, r.dbeta, s.k / s.wy_grad_bk(), &db, DType::F32)?;
    let dl = strictly_causal(b, &dl)?;
    store_columns(b, r.dl, 0, &dl, DType::F32)
}

/// Key block `i` (`BK` key columns) with the value blocks inside: `dq`, `dk` and `dg` (their
/// parts) and `-(-A^T dw) . k e^G` (a term of `dbeta`).
fn key_block(
    b: &mut Body,
    s: &ForwardShape,
    r: &WyGradRefs,
    beta: &V,
    norms: Option<&tokens::Norms>,
    i: i64,
) -> Result<()> {
    let (v, bk, bv) = (s.v, s.wy_grad_bk(), s.bv());
    let internal = |what: &str| TpuError::builder("kda_gpu_wy_grad", format!("internal: {what}"));
    {
        let col = i * bk;
        let rows = r.tokens.rows(b)?;
        let (mut dqg, mut dkg, mut ndw, mut hd, mut diag) = (None, None, None, None, None);
        for j in 0..v / bv {
            let vc = j * bv;
            let d_o = tokens::tile(b, r.d_o, &rows, (0, C), (Offset::Const(vc), bv))?;
            let d_o = b.to_dtype(&d_o, DType::F32)?;
            let dvn = tile(b, r.dv_new, vc, bv)?;
            let h = state_tile(b, r.h, (col, bk), (vc, bv))?;
            let dh = state_tile(b, r.dh, (col, bk), (vc, bv))?;
            let vn = tile(b, r.v_new, vc, bv)?;
            let vn = b.to_dtype(&vn, DType::F32)?;
            let x = product(b, s, &d_o, &h, (1, 1))?;
            dqg = Some(plus(b, dqg, x)?);
            let x = product(b, s, &vn, &dh, (1, 1))?;
            dkg = Some(plus(b, dkg, x)?);
            let x = product(b, s, &dvn, &h, (1, 1))?;
            ndw = Some(plus(b, ndw, x)?);
            let x = b.mul(&h, &dh)?;
            let x = b.reduce(Reduction::Sum, &x, 1)?;
            let x = b.reshape(&x, &[1, bk])?;
            hd = Some(plus(b, hd, x)?);
            // Aqk's diagonal: scale dO_t . v_new_t.
            let x = b.mul(&d_o, &vn)?;
            let x = b.reduce(Reduction::Sum, &x, 1)?;
            diag = Some(plus(b, diag, x)?);
        }
        let (dqg, dkg, ndw, hd, diag) = match (dqg, dkg, ndw, hd, diag) {
            (Some(a), Some(b), Some(c), Some(d), Some(e)) => (a, b, c, d, e),
            _ => return Err(internal("no value columns")),
        };
        let diag = mul_const(b, &diag, s.scale)?;
        // In the order that ends each accumulator's life soonest: nw = -A^T dw (dw = -dv' h^T)
        // first, then dq (and dqg's gate term), then dk.
        let a = load_a(b, r)?;
        let nw = product(b, s, &a, &ndw, (0, 0))?;
        let x = tokens::load_tile(b, s, &r.tokens, (0, C), (col, bk), norms)?;
        let gc = b.cumsum(&x.g, 0, Scan { reverse: false, exclusive: false }, None)?; // G_t
        let eg = b.exp(&gc)?;
        let dqg = mul_const(b, &dqg, s.scale)?;
        let dq = b.mul(&dqg, &eg)?;
        let t = b.mul(&x.k, &diag)?;
        let dq = b.add(&dq, &t)?;
        store_columns(b, r.dq, col, &dq, DType::F32)?;
        let qeg = b.mul(&x.q, &eg)?;
        let dgg = b.mul(&dqg, &qeg)?;
        let keg = b.mul(&x.k, &eg)?;
        let db = b.mul(&nw, &keg)?;
        let db = b.reduce(Reduction::Sum, &db, 1)?;
        let db = b.neg(&db)?;
        store_columns(b, r.dbeta, i, &db, DType::F32)?;
        let bnw = b.mul(&nw, beta)?;
        let t = b.mul(&bnw, &keg)?;
        let dgg = b.sub(&dgg, &t)?;
        let gs = b.cumsum(&x.g, 0, Scan { reverse: true, exclusive: true }, None)?; // G_C - G_t
        let eg_rest = b.exp(&gs)?;
        let dk = b.mul(&dkg, &eg_rest)?;
        let t = b.mul(&bnw, &eg)?;
        let dk = b.sub(&dk, &t)?;
        let t = b.mul(&x.q, &diag)?;
        let dk = b.add(&dk, &t)?;
        store_columns(b, r.dk, col, &dk, DType::F32)?;
        // dg_s = sum_{t >= s} dgg_t + sum_{t < s} t2_t + hd (no last-row total cancelled).
        let kg = b.mul(&x.k, &eg_rest)?;
        let t2 = b.mul(&dkg, &kg)?;
        let suffix = b.cumsum(&dgg, 0, Scan { reverse: true, exclusive: false }, None)?;
        let before = b.cumsum(&t2, 0, Scan { reverse: false, exclusive: true }, None)?;
        let total = b.slice(&gc, &[C - 1, 0], &[1, bk])?;
        let eg_last = b.exp(&total)?;
        let hd = b.mul(&hd, &eg_last)?;
        let dg = b.add(&suffix, &before)?;
        let dg = b.add(&dg, &hd)?;
        store_columns(b, r.dg, col, &dg, DType::F32)
    }
}

/// The WY-gradient kernel's operands as values of the calling function (shapes as in
/// [`WyGradRefs`]; the per-token inputs and tables as the forward takes them).
#[derive(Clone, Copy, Debug)]
pub struct WyGradInputs {
    /// `A`.
    pub a: Value,
    /// `v_new`.
    pub v_new: Value,
    /// The entering states.
    pub h: Value,
    /// `dh`.
    pub dh: Value,
    /// `dv'`.
    pub dv_new: Value,
    /// `dO`.
    pub d_o: Value,
}

/// What the WY-gradient kernel returns (shapes as in [`WyGradRefs`]).
#[derive(Clone, Copy, Debug)]
pub struct WyGradOutputs {
    /// `dv`.
    pub dv: Value,
    /// The kernel's parts of `dq`, `dk`, `dg` and `dbeta`.
    pub dq: Value,
    /// See `dq`.
    pub dk: Value,
    /// See `dq`.
    pub dg: Value,
    /// The terms of `dbeta`.
    pub dbeta: Value,
    /// `scale dO v_new^T`, strictly causal.
    pub daqk: Value,
    /// `dL`, strictly causal.
    pub dl: Value,
}

/// Calls the WY-gradient kernel of `s` in `f` on the forward's per-token inputs `fx` and `x`,
/// lowered by `lowering`.
pub fn call_wy_grad(
    f: &mut FnBuilder,
    s: &ForwardShape,
    fx: &super::ForwardInputs,
    x: &WyGradInputs,
    lowering: &dyn Lower,
) -> Result<WyGradOutputs> {
    s.check()?;
    let (kernel, r) = wy_grad_kernel(s)?;
    let mut a: Bindings = kernel.bindings();
    super::bind_tokens(&mut a, &r.tokens, fx)?;
    for (at, v) in
        [(r.a, x.a), (r.v_new, x.v_new), (r.h, x.h), (r.dh, x.dh), (r.dv_new, x.dv_new), (r.d_o, x.d_o)]
    {
        a.input(at, v)?;
    }
    let out = kernel.call(f, lowering, a)?;
    Ok(WyGradOutputs {
        dv: out.get(r.dv)?,
        dq: out.get(r.dq)?,
        dk: out.get(r.dk)?,
        dg: out.get(r.dg)?,
        dbeta: out.get(r.dbeta)?,
        daqk: out.get(r.daqk)?,
        dl: out.get(r.dl)?,
    })
}
