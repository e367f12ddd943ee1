//! The intra-chunk gradient of the GPU backward (fla's intra backward and its reverse cumsum):
//! one program per (lane, chunk position) takes the pair gradients of the WY-gradient kernel
//! ([`super::wy_grad`]), `dAqk` (of `scale q_t . k_j e^(G_t - G_j)`) and `dL` (of
//! `beta_t k_t . k_j e^(G_t - G_j)`), back through the pairs to `q`, `k`, `beta` and the gate,
//! adds that kernel's parts and sums the gate gradient within the chunk, `BK` key columns at a
//! time. The decays are those of the forward's intra kernel ([`super::intra`]): pairs with an
//! earlier 16-token sub-chunk factor at the anchor before the row's sub-chunk (a row factor and a
//! column factor, each an exponential of a direct sum of gates at most 0: one product per side),
//! pairs inside a sub-chunk take their own exponent column by column. Nothing above 1 is ever
//! formed, so strongly decayed chunks keep f32 accuracy.
//!
//! With `M` either pair gradient and `x` its row operand (`q` or `beta k`), `y` its column
//! operand (`k`): row `t` gets `sum_j M_tj y_j e^(G_t - G_j)` (to `x`'s gradient, and times
//! `x_t` to `dG_t`), column `j` gets `sum_t M_tj x_t e^(G_t - G_j)` (to `k`'s gradient, and
//! times `-k_j` to `dG_j`); `dbeta_t` gets `k_t . sum_j dL_tj k_j e^(G_t - G_j)`.

use kda_core::{DType, GateKind};

use crate::error::Result;
use crate::hlo::{Cmp, FnBuilder, TensorType, Value};
use crate::lang::{
    Binary, Bindings, Body, Index, Kernel, KernelBuilder, Lower, Offset, Operand, Reduction, Ref, Scan,
    Semantics, V,
};

use super::intra::row_of;
use super::tokens::{self, ChunkRows, TokenRefs};
use super::wy_grad::{plus, product};
use super::{ForwardShape, C, SUB};
use crate::op::chunk::{gate_slopes, GATE_FLOOR};

/// The intra-gradient kernel's operands by name (`[L, T, D]` lane-major tokens).
#[derive(Clone, Copy, Debug)]
pub struct IntraGradRefs {
    /// The per-token inputs (no `v`).
    pub tokens: TokenRefs,
    /// `dAqk` (scale folded in), strictly causal, `[L, T, C]` f32.
    pub daqk: Ref,
    /// `dL`, strictly causal, `[L, T, C]` f32.
    pub dl: Ref,
    /// The WY-gradient kernel's parts of `dq`, `dk`, `dg` `[L, T, K]` f32.
    pub parts: [Ref; 3],
    /// `dq`, `dk` (in [`ForwardShape::qk_grad_dtype`]), `dg` (summed within the chunk, through
    /// the floor and the in-kernel gate, in [`ForwardShape::g_dtype`]) `[L, T, K]` in the tokens'
    /// layout, and this kernel's
    /// terms of `dbeta` per key block `[L, T, K / BK]` f32.
    pub grads: [Ref; 4],
    /// With an in-kernel gate: each chunk's column sums of `dg` times the gate's slopes
    /// `[L, NT, 2, K]` f32 (`a_log`'s per channel, then `dt_bias`'s), summed outside.
    pub gate_sums: Option<Ref>,
}

/// The intra-gradient kernel of `s`: grid (lanes, chunk positions, key blocks of
/// [`ForwardShape::intra_grad_bk`]), all parallel.
pub fn intra_grad_kernel(s: &ForwardShape) -> Result<(Kernel, IntraGradRefs)> {
    let (l, t, nt, k) = (s.lanes, s.t, s.t / C, s.k);
    let nkb = k / s.intra_grad_bk();
    let mut kb = KernelBuilder::new("kda_gpu_intra_grad");
    kb.grid(l, Semantics::Parallel).grid(nt, Semantics::Parallel).grid(nkb, Semantics::Parallel);
    let bk = s.intra_grad_bk();
    let tokens = tokens::declare_key_blocks(&mut kb, s, bk);
    let chunk = |name: &str, w: i64, bw: i64, col: Index| {
        let at = vec![Index::Grid(0), Index::Grid(1), col];
        Operand::blocked(name, TensorType::new(DType::F32, &[l, t, w]), &[1, C, bw], at)
    };
    let pairs = |name: &str| chunk(name, C, C, Index::Const(0));
    let keys = |name: &str| chunk(name, k, bk, Index::Grid(2));
    let daqk = kb.input(pairs("daqk"));
    let dl = kb.input(pairs("dl"));
    let parts = [kb.input(keys("dq_part")), kb.input(keys("dk_part")), kb.input(keys("dg_part"))];
    let token =
        |name: &str, d: DType| tokens::operand(name, s, d, k, (C, Index::Grid(1)), (bk, Index::Grid(2)));
    let grads = [
        kb.output(token("dq", s.qk_grad_dtype())),
        kb.output(token("dk", s.qk_grad_dtype())),
        kb.output(token("dg", s.g_dtype)),
        kb.output(chunk("dbeta", nkb, 1, Index::Grid(2))),
    ];
    let gate_sums = (s.gate != GateKind::Preactivated).then(|| {
        let ty = TensorType::new(DType::F32, &[l, nt, 2, k]);
        let at = vec![Index::Grid(0), Index::Grid(1), Index::Const(0), Index::Grid(2)];
        kb.output(Operand::blocked("gate_sums", ty, &[1, 1, 2, bk], at))
    });
    kb.params(s.intra_grad_launch);
    let refs = IntraGradRefs { tokens, daqk, dl, parts, grads, gate_sums };
    let kernel = kb.build(|b| chunk_intra_grad(b, s, &refs))?;
    Ok((kernel, refs))
}

/// Rows `start..start + n` and columns `col..col + w` of `r`'s `[1, C, D]` f32 block.
fn rows_of(b: &mut Body, r: Ref, (start, n): (i64, i64), (col, w): (i64, i64)) -> Result<V> {
    tokens::tile(b, r, &ChunkRows::LANE_BLOCK, (start, n), (Offset::Const(col), w))
}

/// The pairs of sub-chunk `y` with itself (strictly causal), from the `[16, 16]` diagonal
/// blocks `m` of `dAqk`, `dL` and `beta dL`: rows `[16, BK]` to `q` and `k` (the latter before
/// `beta_t`) and columns `[16, BK]`. Column by column from the last, `d` holds
/// `sum_{j < s <= t} g_s` on the rows after `j` (as the forward's intra kernel), each column's
/// terms formed from it.
fn within_sub_chunk(b: &mut Body, y: &tokens::Chunk, m: [&V; 3]) -> Result<(V, V, V)> {
    let bk = y.g.ty.dims[1];
    let zk = b.splat(0.0, DType::F32, &[SUB, bk])?;
    let init = [zk.clone(), zk.clone(), zk.clone(), zk];
    let outs = b.for_range(0, SUB, &init, |b, i, carried| {
        let local = b.iota(&[SUB, bk], 0)?;
        let last = b.index(SUB - 1)?;
        let j = b.index_op(Binary::Sub, &last, i)?;
        let one = b.index(1)?;
        let next = b.index_op(Binary::Add, &j, &one)?;
        let gn = row_of(b, &y.g, &local, &next)?;
        let nexts = b.broadcast(&next, &[SUB, bk])?;
        let after = b.compare(Cmp::Ge, &local, &nexts)?;
        let zk = b.splat(0.0, DType::F32, &[SUB, bk])?;
        let grown = b.add(&carried[0], &gn)?;
        let d = b.select(&after, &grown, &zk)?;
        let e = b.exp(&d)?;
        let f = b.select(&after, &e, &zk)?;
        // Column j of each pair gradient's block.
        let cols = b.iota(&[SUB, SUB], 1)?;
        let js = b.broadcast(&j, &[SUB, SUB])?;
        let here = b.compare(Cmp::Eq, &cols, &js)?;
        let zs = b.splat(0.0, DType::F32, &[SUB, SUB])?;
        let mut col = Vec::new();
        for x in m {
            let x = b.select(&here, x, &zs)?;
            col.push(b.reduce(Reduction::Sum, &x, 1)?);
        }
        let kj = row_of(b, &y.k, &local, &j)?;
        let kf = b.mul(&kj, &f)?;
        let t = b.mul(&col[0], &kf)?;
        let q_rows = b.add(&carried[1], &t)?;
        let t = b.mul(&col[1], &kf)?;
        let k_rows = b.add(&carried[2], &t)?;
        let x = b.mul(&col[0], &y.q)?;
        let t = b.mul(&col[2], &y.k)?;
        let x = b.add(&x, &t)?;
        let x = b.mul(&x, &f)?;
        let x = b.reduce(Reduction::Sum, &x, 0)?;
        let x = b.broadcast(&x, &[SUB, bk])?;
        let row_j = b.broadcast(&j, &[SUB, bk])?;
        let at_j = b.compare(Cmp::Eq, &local, &row_j)?;
        let columns = b.select(&at_j, &x, &carried[3])?;
        Ok(vec![d, q_rows, k_rows, columns])
    })?;
    Ok((outs[1].clone(), outs[2].clone(), outs[3].clone()))
}

/// The body: program `i` of grid axis 2 takes key block `i` (its operands' blocks).
fn chunk_intra_grad(b: &mut Body, s: &ForwardShape, r: &IntraGradRefs) -> Result<()> {
    let norms = if s.intra_grad_bk() < s.k { tokens::norms(b, s, &r.tokens)? } else { None };
    key_block(b, s, r, norms.as_ref())
}

/// The program's key block, sub-chunk by sub-chunk from the last: a sub-chunk's rows are final once its
/// own pairs are done (their columns' later pairs came before), so its `dq`, `dk`, `dbeta` term
/// and `dg` (the WY gradient's part plus the suffix sum of the pairs' gate terms, carried from
/// the sub-chunks after it) are written then; only the column sums of the sub-chunks before it
/// are carried, one `[16, BK]` tile each.
fn key_block(b: &mut Body, s: &ForwardShape, r: &IntraGradRefs, norms: Option<&tokens::Norms>) -> Result<()> {
    let (bk, col) = (s.intra_grad_bk(), 0);
    let [dq_in, dk_in, dg_in] = r.parts;
    let [dq_out, dk_out, dg_out, db_out] = r.grads;
    let z = Offset::Const(0);
    let placed = r.tokens.rows(b)?;
    let mut columns =
        (0..C / SUB).map(|_| b.splat(0.0, DType::F32, &[SUB, bk])).collect::<Result<Vec<_>>>()?;
    let mut carry = b.splat(0.0, DType::F32, &[1, bk])?;
    let mut sums = None;
    for sc in (0..C / SUB).rev() {
        let rows = (SUB * sc, SUB);
        let y = tokens::load_tile(b, s, &r.tokens, rows, (col, bk), norms)?;
        // The earlier sub-chunks' pairs first: fewer values live at once (f32 fits 255
        // registers this way).
        let earlier = match sc {
            0 => None,
            _ => Some(earlier_sub_chunks(b, s, r, &y, sc, norms, &mut columns)?),
        };
        let m = pair_blocks(b, r, &y, sc, sc)?;
        let (mut qr, mut kr, own) = within_sub_chunk(b, &y, [&m[0], &m[1], &m[2]])?;
        let cols_here = b.add(&own, &columns[sc as usize])?;
        if let Some((q_more, k_more)) = earlier {
            qr = b.add(&qr, &q_more)?;
            kr = b.add(&kr, &k_more)?;
        }
        // Packed rows in place write the rows past the chunk's tokens too (a row's trailing
        // padding): exactly zero there.
        let real = match placed {
            ChunkRows::Packed { .. } => tokens::real_rows(b, &r.tokens, rows, bk)?,
            ChunkRows::Aligned(..) => None,
        };
        let store_rows = |b: &mut Body, out: Ref, x: &V, dtype: DType| -> Result<()> {
            let x = match &real {
                Some(real) => {
                    let zero = b.splat(0.0, DType::F32, &[SUB, bk])?;
                    b.select(real, x, &zero)?
                }
                None => x.clone(),
            };
            tokens::store_tile(b, out, &placed, (SUB * sc, Offset::Const(col)), &x, dtype)
        };
        let dq = rows_of(b, dq_in, rows, (col, bk))?;
        let dq = b.add(&dq, &qr)?;
        store_rows(b, dq_out, &dq, s.qk_grad_dtype())?;
        let krb = b.mul(&kr, &y.beta)?;
        let dk = rows_of(b, dk_in, rows, (col, bk))?;
        let dk = b.add(&dk, &krb)?;
        let dk = b.add(&dk, &cols_here)?;
        store_rows(b, dk_out, &dk, s.qk_grad_dtype())?;
        let t = b.mul(&y.k, &kr)?;
        let db = b.reduce(Reduction::Sum, &t, 1)?;
        let db = b.reshape(&db, &[1, SUB, 1])?;
        b.store(db_out, &[z.clone(), Offset::Const(SUB * sc), z.clone()], &db)?;
        let dgg = b.mul(&y.q, &qr)?;
        let t = b.mul(&y.k, &krb)?;
        let dgg = b.add(&dgg, &t)?;
        let t = b.mul(&y.k, &cols_here)?;
        let dgg = b.sub(&dgg, &t)?;
        let suffix = b.cumsum(&dgg, 0, Scan { reverse: true, exclusive: false }, None)?;
        let suffix = b.add(&suffix, &carry)?;
        carry = b.slice(&suffix, &[0, 0], &[1, bk])?;
        let dg = rows_of(b, dg_in, rows, (col, bk))?;
        let dg = b.add(&dg, &suffix)?;
        let dg = through_gate(b, s, r, &y, rows, &dg, &mut sums)?;
        store_rows(b, dg_out, &dg, s.g_dtype)?;
    }
    if let (Some(out), Some(sums)) = (r.gate_sums, sums) {
        let both = b.concat(&sums, 0)?;
        let both = b.reshape(&both, &[1, 1, 2, bk])?;
        b.store(out, &[z.clone(), z.clone(), z.clone(), z], &both)?;
    }
    Ok(())
}

/// The `[16, 16]` blocks of `dAqk`, `dL` and `beta dL` pairing sub-chunk `sc`'s rows (`y`)
/// with sub-chunk `e`'s columns.
fn pair_blocks(b: &mut Body, r: &IntraGradRefs, y: &tokens::Chunk, sc: i64, e: i64) -> Result<[V; 3]> {
    let (rows, cols) = ((SUB * sc, SUB), (SUB * e, SUB));
    let aqk = rows_of(b, r.daqk, rows, cols)?;
    let l = rows_of(b, r.dl, rows, cols)?;
    let beta_l = b.mul(&l, &y.beta)?;
    Ok([aqk, l, beta_l])
}

/// The pairs of sub-chunk `sc`'s rows (`y`) with every earlier sub-chunk's columns, through the
/// anchor `a = 16 sc - 1`: `e^(G_t - G_a)` on the rows, `e^(G_a - G_j)` on the columns, the
/// latter the sub-chunk's own reverse sum plus the totals of the sub-chunks between it and the
/// anchor. Returns the rows' parts of `q` and `k` (the latter before `beta_t`); adds the
/// columns' parts to `columns`. Every operand is a `[16, BK]` tile.
fn earlier_sub_chunks(
    b: &mut Body,
    s: &ForwardShape,
    r: &IntraGradRefs,
    y: &tokens::Chunk,
    sc: i64,
    norms: Option<&tokens::Norms>,
    columns: &mut [V],
) -> Result<(V, V)> {
    let bk = y.g.ty.dims[1];
    let rsum = b.cumsum(&y.g, 0, Scan { reverse: false, exclusive: false }, None)?;
    let er = b.exp(&rsum)?;
    let yq = b.mul(&y.q, &er)?;
    let yk = b.mul(&y.k, &er)?;
    let (mut q_acc, mut k_acc, mut between): (Option<V>, Option<V>, Option<V>) = (None, None, None);
    for e in (0..sc).rev() {
        let x = tokens::load_tile(b, s, &r.tokens, (SUB * e, SUB), (0, bk), norms)?;
        let mut cs = b.cumsum(&x.g, 0, Scan { reverse: true, exclusive: true }, None)?;
        if let Some(t) = &between {
            let t = b.broadcast(t, &[SUB, bk])?;
            cs = b.add(&cs, &t)?;
        }
        let ec = b.exp(&cs)?;
        let m = pair_blocks(b, r, y, sc, e)?;
        // The columns' products before the rows' (f32 fits 255 registers this way).
        let c1 = product(b, s, &m[0], &yq, (0, 0))?;
        let c2 = product(b, s, &m[2], &yk, (0, 0))?;
        let c = b.add(&c1, &c2)?;
        let c = b.mul(&c, &ec)?;
        columns[e as usize] = b.add(&columns[e as usize], &c)?;
        let kc = b.mul(&x.k, &ec)?;
        let t = product(b, s, &m[0], &kc, (1, 0))?;
        q_acc = Some(plus(b, q_acc, t)?);
        let t = product(b, s, &m[1], &kc, (1, 0))?;
        k_acc = Some(plus(b, k_acc, t)?);
        let total = b.reduce(Reduction::Sum, &x.g, 0)?;
        let total = b.reshape(&total, &[1, bk])?;
        between = Some(plus(b, between, total)?);
    }
    let missing = || crate::error::TpuError::builder("gpu intra gradient", "internal: no earlier sub-chunk");
    let q = b.mul(&q_acc.ok_or_else(missing)?, &er)?;
    let k = b.mul(&k_acc.ok_or_else(missing)?, &er)?;
    Ok((q, k))
}

/// `dg` of rows `start..start + n` through the floor (zero where the gate sat on it) and, with
/// an in-kernel gate, through the gate (`gate_slopes`), whose parameters' column sums over the
/// chunk's tokens (not its padding rows) are added to `sums`.
fn through_gate(
    b: &mut Body,
    s: &ForwardShape,
    r: &IntraGradRefs,
    y: &tokens::Chunk,
    (start, n): (i64, i64),
    dg: &V,
    sums: &mut Option<[V; 2]>,
) -> Result<V> {
    let dims = dg.ty.dims.clone();
    let floor = b.splat(GATE_FLOOR, DType::F32, &dims)?;
    let live = b.compare(Cmp::Gt, &y.g, &floor)?;
    let zero = b.splat(0.0, DType::F32, &dims)?;
    let dg = b.select(&live, dg, &zero)?;
    if r.gate_sums.is_none() {
        return Ok(dg);
    }
    let dg = match tokens::real_rows(b, &r.tokens, (start, n), dims[1])? {
        Some(real) => b.select(&real, &dg, &zero)?,
        None => dg,
    };
    let (dz, dlog) = gate_slopes(b, &y.raw, s.gate, r.tokens.gate)?;
    let dx = b.mul(&dg, &dz)?;
    let dl = b.mul(&dg, &dlog)?;
    let mut next = Vec::new();
    for (i, x) in [&dl, &dx].into_iter().enumerate() {
        let sum = b.reduce(Reduction::Sum, x, 0)?;
        let sum = b.reshape(&sum, &[1, dims[1]])?;
        next.push(match sums {
            Some(acc) => b.add(&acc[i], &sum)?,
            None => sum,
        });
    }
    *sums = Some([next[0].clone(), next[1].clone()]);
    Ok(dx)
}

/// Calls the intra-gradient kernel of `s` in `f` on the forward's per-token inputs `fx`, the
/// pair gradients `[dAqk, dL]` and the WY-gradient kernel's `parts` (`dq`, `dk`, `dg`),
/// lowered by `lowering`.
pub fn call_intra_grad(
    f: &mut FnBuilder,
    s: &ForwardShape,
    fx: &super::ForwardInputs,
    [daqk, dl]: [Value; 2],
    parts: [Value; 3],
    lowering: &dyn Lower,
) -> Result<IntraGradOutputs> {
    s.check()?;
    let (kernel, r) = intra_grad_kernel(s)?;
    let mut a: Bindings = kernel.bindings();
    super::bind_tokens(&mut a, &r.tokens, fx)?;
    a.input(r.daqk, daqk)?;
    a.input(r.dl, dl)?;
    for (at, v) in r.parts.into_iter().zip(parts) {
        a.input(at, v)?;
    }
    let out = kernel.call(f, lowering, a)?;
    let got = |i: usize| out.get(r.grads[i]);
    let gate_sums = r.gate_sums.map(|at| out.get(at)).transpose()?;
    Ok(IntraGradOutputs { grads: [got(0)?, got(1)?, got(2)?, got(3)?], gate_sums })
}

/// What the intra-gradient kernel returns (shapes as in [`IntraGradRefs`]).
#[derive(Clone, Copy, Debug)]
pub struct IntraGradOutputs {
    /// `[dq, dk, dg, dbeta terms]`.
    pub grads: [Value; 4],
    /// The gate parameters' column sums, with an in-kernel gate.
    pub gate_sums: Option<Value>,
}
