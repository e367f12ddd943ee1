//! The state recurrence of the GPU forward: one program per (lane, block of `BV` state columns,
//! state slot) runs its slot's chunks in order with its `[K, BV]` slice of the state as loop
//! values (the state split along V across programs, as fla does; a packed row's sequences in
//! parallel), from the chunk kernels' factors: `v' = u - w S`,
//! `o = (scale q e^G) S + (scale Aqk) v'`, `S <- e^(G_C) S + (k e^(G_C - G))^T v'`.
//! A slot's run starts from its initial state at its first chunk position and writes the slot's
//! final state at the position flagged `last`: fixed rows run `run_chunks` positions each, in
//! order; packed rows read each run's start and length from tables (a loop with a run-time
//! bound: one compile for every segmentation).

use kda_core::DType;

use crate::error::Result;
use crate::hlo::{Cmp, FnBuilder, TensorType, Value};
use crate::lang::{Binary, Body, Index, Kernel, KernelBuilder, Offset, Operand, Ref, Semantics, Table, V};

use super::tokens::{self, ChunkRows};
use super::{Factors, ForwardShape, C};

/// The recurrence kernel's operands by name.
#[derive(Clone, Copy, Debug)]
pub struct RecurrenceRefs {
    /// The chunk kernels' results.
    pub factors: Factors,
    /// Segmented shapes: each slot's first chunk position and the chunk positions in its run
    /// (0: a slot without chunks), `[slots]` each.
    pub runs: Option<(Table, Table)>,
    /// 1 at a segment's last chunk position `[NT]`.
    pub last: Table,
    /// The initial states `[L, slots, K, V]` f32, when given.
    pub h0: Option<Ref>,
    /// `o` `[L, T, V]` in the input dtype (`[T, L * V]` in rows).
    pub o: Ref,
    /// The final states `[L, slots, K, V]` f32 (a slot without chunks is not written).
    pub ht: Ref,
    /// The state entering each chunk `[L, NT, K, V]` in [`ForwardShape::h_dtype`], when the
    /// shape keeps it.
    pub h: Option<Ref>,
    /// `v' = u - w S` `[L, T, V]` in [`ForwardShape::factor_dtype`], when the shape keeps `h`
    /// (the backward's WY gradient reads it).
    pub v_new: Option<Ref>,
    /// Packed rows in place: where each chunk position's rows of `o` are.
    pub packed: Option<tokens::PackedRefs>,
}

/// The recurrence kernel of `s`: grid (lanes, state column blocks, state slots), all parallel.
pub fn recurrence_kernel(s: &ForwardShape) -> Result<(Kernel, RecurrenceRefs)> {
    let (l, t, nt, k, v, bv) = (s.lanes, s.t, s.t / C, s.k, s.v, s.bv());
    let ty = |dims: &[i64]| TensorType::new(DType::F32, dims);
    let fty = |dims: &[i64]| TensorType::new(s.factor_dtype(), dims);
    let (g0, g1, g2) = (Index::Grid(0), Index::Grid(1), Index::Grid(2));
    let zero = || Index::Const(0);
    let mut kb = KernelBuilder::new("kda_gpu_recurrence");
    kb.grid(l, Semantics::Parallel).grid(v / bv, Semantics::Parallel).grid(s.slots, Semantics::Parallel);
    let runs = s.segmented.then(|| (kb.table("run_start", s.slots), kb.table("run_chunks", s.slots)));
    let last = kb.table("last", nt);
    let mut lane = |name: &str, w: i64| {
        kb.input(Operand::blocked(name, fty(&[l, t, w]), &[1, t, w], vec![g0.clone(), zero(), zero()]))
    };
    let w = lane("w", k);
    let (qg, kg, aqk) = (lane("qg", k), lane("kg", k), lane("aqk", C));
    let u =
        kb.input(Operand::blocked("u", fty(&[l, t, v]), &[1, t, bv], vec![g0.clone(), zero(), g1.clone()]));
    let eg = kb.input(Operand::blocked("eg", ty(&[l, nt, k]), &[1, nt, k], vec![g0.clone(), zero(), zero()]));
    let slots = s.slots;
    let state_at = || vec![g0.clone(), g2.clone(), zero(), g1.clone()];
    let h0 =
        s.h0.then(|| kb.input(Operand::blocked("h0", ty(&[l, slots, k, v]), &[1, 1, k, bv], state_at())));
    let o = kb.output(tokens::operand("o", s, s.dtype, v, (t, zero()), (bv, g1.clone())));
    let packed = tokens::declare_packed(&mut kb, s);
    let ht = kb.output(Operand::blocked("ht", ty(&[l, slots, k, v]), &[1, 1, k, bv], state_at()));
    let h = s.keep_h.then(|| {
        let at = vec![g0.clone(), zero(), zero(), g1.clone()];
        kb.output(Operand::blocked("h", TensorType::new(s.h_dtype, &[l, nt, k, v]), &[1, nt, k, bv], at))
    });
    let v_new = s.keep_h.then(|| {
        let at = vec![g0.clone(), zero(), g1.clone()];
        kb.output(Operand::blocked("v_new", fty(&[l, t, v]), &[1, t, bv], at))
    });
    kb.params(s.recurrence_launch);
    let factors = Factors { w, u, qg, kg, aqk, eg };
    let refs = RecurrenceRefs { factors, runs, last, h0, o, ht, h, v_new, packed };
    let kernel = kb.build(|b| run(b, s, &refs))?;
    Ok((kernel, refs))
}

/// Columns `at..at + width` of chunk rows `row..row + 64` of `r`'s `[1, T, w]` lane block, as a
/// `[C, width]` tile.
pub(super) fn columns(b: &mut Body, r: Ref, row: &V, at: i64, width: i64) -> Result<V> {
    let x = b.load(r, &[Offset::Const(0), Offset::Dyn(row.clone(), C), Offset::Const(at)], &[1, C, width])?;
    b.reshape(&x, &[C, width])
}

/// The slot's run: its initial state, then its chunks in order, `BK` state rows per value.
fn run(b: &mut Body, s: &ForwardShape, r: &RecurrenceRefs) -> Result<()> {
    let (bk, bv) = (s.bk(), s.bv());
    let slot = b.program_id(2)?;
    let mut init = Vec::new();
    for i in 0..s.k / bk {
        init.push(match r.h0 {
            Some(h0) => {
                let x = b.load(
                    h0,
                    &[Offset::Const(0), Offset::Const(0), Offset::Const(i * bk), Offset::Const(0)],
                    &[1, 1, bk, bv],
                )?;
                b.reshape(&x, &[bk, bv])?
            }
            None => b.splat(0.0, DType::F32, &[bk, bv])?,
        });
    }
    match r.runs {
        Some((start, chunks)) => {
            let start = b.read_table(start, &slot)?;
            let chunks = b.read_table(chunks, &slot)?;
            let mean = (s.t / C) as f64 / s.slots as f64;
            b.for_range_until_mean(0, s.run_chunks, &chunks, mean, &init, |b, i, states| {
                let c = b.index_op(Binary::Add, &start, i)?;
                step(b, s, r, &c, states)
            })?;
        }
        None => {
            let n = b.index(s.run_chunks)?;
            let start = b.index_op(Binary::Mul, &slot, &n)?;
            b.for_range(0, s.run_chunks, &init, |b, i, states| {
                let c = b.index_op(Binary::Add, &start, i)?;
                step(b, s, r, &c, states)
            })?;
        }
    }
    Ok(())
}

/// One chunk `c` of one state slice (`BK` rows per part): `v' = u - sum_k w_k S_k` and
/// `o = sum_k qg_k S_k + Aqk v'` first, then each `S_k <- e^(G_C)_k S_k + kg_k^T v'`; returns
/// the parts leaving the chunk.
fn step(b: &mut Body, s: &ForwardShape, r: &RecurrenceRefs, c: &V, states: &[V]) -> Result<Vec<V>> {
    let (bk, bv, p, fd) = (s.bk(), s.bv(), s.precision(), s.factor_dtype());
    let c64 = b.index(C)?;
    let row = b.index_op(Binary::Mul, c, &c64)?;
    let z = Offset::Const(0);
    let mut ws = b.splat(0.0, DType::F32, &[C, bv])?;
    let mut inter = ws.clone();
    for (i, state) in states.iter().enumerate() {
        let at = i as i64 * bk;
        if let Some(h) = r.h {
            let x = b.to_dtype(state, s.h_dtype)?;
            let x = b.reshape(&x, &[1, 1, bk, bv])?;
            b.store(h, &[z.clone(), Offset::Dyn(c.clone(), 1), Offset::Const(at), z.clone()], &x)?;
        }
        let sp = b.to_dtype(state, fd)?;
        let w = columns(b, r.factors.w, &row, at, bk)?;
        let x = b.matmul(&w, &sp, (1, 0), p)?;
        ws = b.add(&ws, &x)?;
        let qg = columns(b, r.factors.qg, &row, at, bk)?;
        let x = b.matmul(&qg, &sp, (1, 0), p)?;
        inter = b.add(&inter, &x)?;
    }
    let u = columns(b, r.factors.u, &row, 0, bv)?;
    let u = b.to_dtype(&u, DType::F32)?;
    let vnd = b.sub(&u, &ws)?;
    let vnd = b.to_dtype(&vnd, fd)?;
    if let Some(v_new) = r.v_new {
        let x = b.reshape(&vnd, &[1, C, bv])?;
        b.store(v_new, &[z.clone(), Offset::Dyn(row.clone(), C), z.clone()], &x)?;
    }
    let aqk = columns(b, r.factors.aqk, &row, 0, C)?;
    let intra = b.matmul(&aqk, &vnd, (1, 0), p)?;
    let o = b.add(&inter, &intra)?;
    let at = ChunkRows::of_chunk(b, s.layout, r.packed.as_ref(), c)?;
    tokens::store_tile(b, r.o, &at, (0, z.clone()), &o, s.dtype)?;
    let last = b.read_table(r.last, c)?;
    let zero = b.index(0)?;
    let at_last = b.compare(Cmp::Ne, &last, &zero)?;
    let mut next = Vec::new();
    for (i, state) in states.iter().enumerate() {
        let at = i as i64 * bk;
        let eg =
            b.load(r.factors.eg, &[z.clone(), Offset::Dyn(c.clone(), 1), Offset::Const(at)], &[1, 1, bk])?;
        let eg = b.reshape(&eg, &[bk, 1])?;
        let eg = b.broadcast(&eg, &[bk, bv])?;
        let kept = b.mul(state, &eg)?;
        let kg = columns(b, r.factors.kg, &row, at, bk)?;
        let add = b.matmul(&kg, &vnd, (0, 0), p)?;
        let x = b.add(&kept, &add)?;
        b.when(&at_last, |b| {
            let h = b.reshape(&x, &[1, 1, bk, bv])?;
            b.store(r.ht, &[z.clone(), z.clone(), Offset::Const(at), z.clone()], &h)
        })?;
        next.push(x);
    }
    Ok(next)
}

/// Each slot's run of chunk positions from the chunk tables `first` and `slot` (`[NT]` i32):
/// `run_start[s]`, the position flagged first for slot `s` (`NT` if none), and `run_chunks[s]`,
/// the positions up to the next slot's start or the end (so that trailing padding positions,
/// whose inputs are zero, ride with the last run and get their `o` and `h` written; with every
/// segment empty, slot 0 runs them all).
pub fn runs(f: &mut FnBuilder, slots: i64, first: Value, slot: Value) -> Result<(Value, Value)> {
    let nt = first.dims()[0];
    let sn = TensorType::new(DType::I32, &[slots, nt]);
    let pos = f.iota(sn.clone(), 1)?;
    let which = f.iota(sn.clone(), 0)?;
    let slot = f.broadcast_in_dim(slot, &[slots, nt], &[1])?;
    let first = f.broadcast_in_dim(first, &[slots, nt], &[1])?;
    let zero = f.constant_i32(0, sn.clone())?;
    let none = f.constant_i32(nt as i32, sn)?;
    let mine = f.compare(Cmp::Eq, slot, which)?;
    let flagged = f.compare(Cmp::Ne, first, zero)?;
    let starts_here = f.select(mine, flagged, mine)?;
    let at = f.select(starts_here, pos, none)?;
    let start = f.reduce_min(at, &[1])?;
    let ss = TensorType::new(DType::I32, &[slots, slots]);
    let mine = f.broadcast_in_dim(start, &[slots, slots], &[0])?;
    let other = f.broadcast_in_dim(start, &[slots, slots], &[1])?;
    let after = f.compare(Cmp::Gt, other, mine)?;
    let none = f.constant_i32(nt as i32, ss)?;
    let next = f.select(after, other, none)?;
    let end = f.reduce_min(next, &[1])?;
    let chunks = f.sub(end, start)?;
    // Every segment empty: slot 0 runs every position (zero inputs, its state unchanged), so
    // that packed rows read in place get their padding tokens' `o` written.
    let st = TensorType::new(DType::I32, &[slots]);
    let first_run = f.reduce_min(start, &[0])?;
    let first_run = f.broadcast_in_dim(first_run, &[slots], &[])?;
    let nts = f.constant_i32(nt as i32, st.clone())?;
    let none_run = f.compare(Cmp::Eq, first_run, nts)?;
    let which = f.iota(st.clone(), 0)?;
    let zeros = f.constant_i32(0, st)?;
    let slot0 = f.compare(Cmp::Eq, which, zeros)?;
    let all = f.and(none_run, slot0)?;
    let start = f.select(all, zeros, start)?;
    let chunks = f.select(all, nts, chunks)?;
    Ok((start, chunks))
}
