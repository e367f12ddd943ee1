//! The two sequential parts: the state recurrence over chunks (forward) and the `dh`
//! recurrence in reverse (backward). Everything else is chunk-parallel.

use super::intra::ChunkTerms;
use crate::hlo::Transpose;
use crate::hlo::{FnBuilder, Value};
use crate::op::args::ChunkTables;
use crate::op::hlo_ops::{choose, element, i32t, put, splat, take};
use crate::op::spec::{ProgramSpec, CHUNK};
use crate::Result;

/// `for i in 0..nt`, or `0..used` when the tables bound the loop at run time.
fn chunk_loop<F>(
    b: &mut FnBuilder,
    nt: i64,
    used: Option<Value>,
    init: &[Value],
    body: F,
) -> Result<Vec<Value>>
where
    F: FnOnce(&mut FnBuilder, Value, &[Value]) -> Result<Vec<Value>>,
{
    match used {
        Some(n) => b.for_loop_until(n, init, body),
        None => b.for_loop(nt as i32, init, body),
    }
}

fn lanes4(b: &mut FnBuilder, s: &ProgramSpec, nt: i64, x: Value) -> Result<Value> {
    let l = s.lanes() as i64;
    let d = x.dims();
    let mut dims = vec![l, nt];
    dims.extend_from_slice(&d[1..]);
    b.reshape(x, &dims)
}

/// Results of the forward recurrence.
pub struct StateRun {
    /// The state entering every chunk, `[L, NT, K, V]`.
    pub h: Value,
    /// `v_new = u - w S` per chunk, `[L, NT, C, V]`.
    pub v_new: Value,
    /// Final state per slot, `[L, slots, K, V]` (the initial state for empty segments).
    pub final_tab: Value,
    /// The state after the last chunk, `[L, K, V]`.
    pub last: Value,
}

/// Runs `S <- exp(G_last) S + kg^T (u - w S)` over the chunks of every lane, resetting to the
/// slot's initial state at each segment's first chunk. Inputs are `[N, ...]` chunk tensors.
pub fn run_states(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    t: ChunkTables,
    h0: Value,
    ct: &ChunkTerms,
) -> Result<StateRun> {
    let (l, k, v) = (s.lanes() as i64, s.dims.k as i64, s.dims.v as i64);
    let whole = whole_rows(s, &t);
    let s0 = if whole { only_slot(b, h0)? } else { splat(b, 0.0, &[l, k, v])? };
    run_states_window(b, s, s.chunks() as i64, t, h0, (s0, h0), ct, whole)
}

/// [`run_states`] over a window of `nt` chunks per lane (`t` and `ct` cover just the window),
/// starting from the carried state and final-state table `(state, fin)`; with `whole` (see
/// [`whole_rows`]) `state` is already the initial state and no per-chunk tables are read.
#[allow(clippy::too_many_arguments)]
pub fn run_states_window(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    nt: i64,
    t: ChunkTables,
    h0: Value,
    (s0, fin0): (Value, Value),
    ct: &ChunkTerms,
    whole: bool,
) -> Result<StateRun> {
    let (u, w, kg, eg_last) = (ct.u, ct.w, ct.kg, ct.dc.eg_last);
    let (l, k, v, c) = (s.lanes() as i64, s.dims.k as i64, s.dims.v as i64, CHUNK as i64);
    let (u, w, kg, el) =
        (lanes4(b, s, nt, u)?, lanes4(b, s, nt, w)?, lanes4(b, s, nt, kg)?, lanes4(b, s, nt, eg_last)?);
    let h_all = b.scratch_f32(&[l, nt, k, v])?;
    let vn_all = b.scratch_f32(&[l, nt, c, v])?;
    // Off whole rows the carried state is already the one entering the visited chunk: the reset
    // at a segment's first chunk is applied before the loop and at the end of the chunk before.
    let (s0, ahead) = if whole { (s0, None) } else { boundaries_ahead(b, t, h0, s0)? };
    let init: &[Value] = if whole { &[s0, h_all, vn_all] } else { &[s0, h_all, vn_all, fin0] };
    let out = chunk_loop(b, nt, t.used, init, |b, i, a| {
        let (st, h_all, vn_all) = (a[0], a[1], a[2]);
        let h_all = put(b, h_all, 1, i, st)?;
        let (uc, wc) = (take(b, u, 1, i)?, take(b, w, 1, i)?);
        let ws = b.batch_matmul(wc, st, Transpose::None)?;
        let vn = b.sub(uc, ws)?;
        let vn_all = put(b, vn_all, 1, i, vn)?;
        let s1 = next_state(b, (kg, el), i, st, vn)?;
        if whole {
            return Ok(vec![s1, h_all, vn_all]);
        }
        let fin = record_final(b, t, i, a[3], s1)?;
        let s1 = reset_ahead(b, ahead, h0, i, s1)?;
        Ok(vec![s1, h_all, vn_all, fin])
    })?;
    let final_tab = if whole { as_table(b, out[0])? } else { out[3] };
    Ok(StateRun { h: out[1], v_new: out[2], final_tab, last: out[0] })
}

/// Whether the loops cover whole fixed-length rows: one segment per lane that starts at chunk 0
/// and ends at the last chunk, with one state slot. The loops then start from the slot's
/// initial state (or `dht`) and read the final one after the last chunk, with no per-chunk
/// selects on the state (each a cost on every chunk of the loop).
fn whole_rows(s: &ProgramSpec, t: &ChunkTables) -> bool {
    s.packed_chunks.is_none() && t.used.is_none() && s.slots() == 1
}

/// Slot 0 of a `[L, 1, K, V]` table as `[L, K, V]`.
fn only_slot(b: &mut FnBuilder, tab: Value) -> Result<Value> {
    let d = tab.dims();
    b.reshape(tab, &[d[0], d[2], d[3]])
}

/// A `[L, K, V]` state as the `[L, 1, K, V]` table of one slot.
fn as_table(b: &mut FnBuilder, st: Value) -> Result<Value> {
    let d = st.dims();
    b.reshape(st, &[d[0], 1, d[1], d[2]])
}

/// The per-chunk tables moved by `by` chunks (`+1`: entry `i` describes chunk `i + 1`; `-1`:
/// chunk `i - 1`), a chunk outside the window reading as no segment boundary. The loops apply a
/// boundary at the end of the chunk before it, in the same fusion as the update, so the state a
/// chunk's products read is the carried value itself, not a selected copy.
fn shifted_tables(b: &mut FnBuilder, t: ChunkTables, by: i64) -> Result<ChunkTables> {
    let shift = |b: &mut FnBuilder, x: Value| -> Result<Value> {
        let n = x.dims()[0];
        let zero = b.constant_i32(0, i32t(&[1]))?;
        if by > 0 {
            let rest = b.slice_axis(x, 0, 1, n)?;
            b.concatenate(&[rest, zero], 0)
        } else {
            let rest = b.slice_axis(x, 0, 0, n - 1)?;
            b.concatenate(&[zero, rest], 0)
        }
    };
    Ok(ChunkTables {
        first: shift(b, t.first)?,
        last: shift(b, t.last)?,
        slot: shift(b, t.slot)?,
        used: t.used,
    })
}

/// Off whole rows, the forward loops' boundaries: the state entering the first visited chunk
/// (`s0`, or the slot's initial state if a segment starts there) and the tables one chunk ahead,
/// which [`reset_ahead`] reads at the end of each chunk.
fn boundaries_ahead(
    b: &mut FnBuilder,
    t: ChunkTables,
    h0: Value,
    s0: Value,
) -> Result<(Value, Option<ChunkTables>)> {
    let zero = b.scalar_i32(0)?;
    Ok((entering_state(b, t, h0, zero, s0)?, Some(shifted_tables(b, t, 1)?)))
}

/// The state entering chunk `i + 1` from `s1`, the state after chunk `i`, with the tables of
/// [`boundaries_ahead`] (`None` on whole rows: no boundary inside).
fn reset_ahead(
    b: &mut FnBuilder,
    ahead: Option<ChunkTables>,
    h0: Value,
    i: Value,
    s1: Value,
) -> Result<Value> {
    match ahead {
        Some(next) => entering_state(b, next, h0, i, s1),
        None => Ok(s1),
    }
}

/// The state entering chunk `i`: the carried one, or the slot's initial state at a segment's
/// first chunk.
fn entering_state(b: &mut FnBuilder, t: ChunkTables, h0: Value, i: Value, st: Value) -> Result<Value> {
    let first = element(b, t.first, i)?;
    let slot = element(b, t.slot, i)?;
    let init = take(b, h0, 1, slot)?;
    choose(b, first, init, st)
}

/// The gradient leaving chunk `i`: the carried one, or the slot's `dht` at a segment's last
/// chunk.
fn seeded(b: &mut FnBuilder, t: ChunkTables, dht: Value, i: Value, ds: Value) -> Result<Value> {
    let last = element(b, t.last, i)?;
    let slot = element(b, t.slot, i)?;
    let seed = take(b, dht, 1, slot)?;
    choose(b, last, seed, ds)
}

/// `S1 = exp(G_last) S0 + kg^T v_new` for chunk `i` of the `[L, NT, ..]` tensors `(kg, el)`.
fn next_state(b: &mut FnBuilder, (kg, el): (Value, Value), i: Value, st: Value, vn: Value) -> Result<Value> {
    let (kgc, elc) = (take(b, kg, 1, i)?, take(b, el, 1, i)?);
    let elb = b.broadcast_in_dim(elc, st.dims(), &[0, 1])?;
    let decayed = b.mul(elb, st)?;
    let write = b.batch_matmul(kgc, vn, Transpose::A)?;
    b.add(decayed, write)
}

/// Writes `s1` as its slot's final state when chunk `i` ends a segment.
fn record_final(b: &mut FnBuilder, t: ChunkTables, i: Value, fin: Value, s1: Value) -> Result<Value> {
    let last = element(b, t.last, i)?;
    let slot = element(b, t.slot, i)?;
    let cur = take(b, fin, 1, slot)?;
    let upd = choose(b, last, s1, cur)?;
    put(b, fin, 1, slot, upd)
}

/// Results of the forward recurrence with the output formed inside the loop.
pub struct OutputRun {
    /// `O = scale qg S0 + Aqk v_new` per chunk, `[L, NT, C, V]`.
    pub o: Value,
    /// Final state per slot, `[L, slots, K, V]`.
    pub final_tab: Value,
}

/// [`run_states`] for the forward alone: each chunk's output is formed where its entering state
/// and `v_new` are at hand, so neither the per-chunk states (`[L, NT, K, V]`) nor `v_new` are
/// written out, only `o`. `ct.aqk` must already carry `scale`. The four products of a chunk run
/// as two taller ones: `[w; qg] S0` (giving `w S0` and the inter-chunk output) and
/// `[Aqk; kg^T] v_new` (the intra-chunk output and the state update): on the CPU plugin fewer,
/// larger products take less time than the same work in four.
pub fn run_output(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    t: ChunkTables,
    h0: Value,
    ct: &ChunkTerms,
    scale: f32,
) -> Result<OutputRun> {
    let (l, k, v, c) = (s.lanes() as i64, s.dims.k as i64, s.dims.v as i64, CHUNK as i64);
    let nt = s.chunks() as i64;
    let wq = b.concatenate(&[ct.w, ct.qg], 1)?; // [N, 2C, K]
    let kgt = b.transpose(ct.kg, &[0, 2, 1])?;
    let ak = b.concatenate(&[ct.aqk, kgt], 1)?; // [N, C + K, C]
    let (u, wq, ak, el) = (
        lanes4(b, s, nt, ct.u)?,
        lanes4(b, s, nt, wq)?,
        lanes4(b, s, nt, ak)?,
        lanes4(b, s, nt, ct.dc.eg_last)?,
    );
    let whole = whole_rows(s, &t);
    let (s0, ahead) = if whole {
        (only_slot(b, h0)?, None)
    } else {
        let s0 = splat(b, 0.0, &[l, k, v])?;
        boundaries_ahead(b, t, h0, s0)?
    };
    // `o` is written over `u` ([L, NT, C, V] both): each chunk's `u` is read by the products
    // that form its `o`, so the write comes after the read and no buffer is filled for `o`.
    let init: &[Value] = if whole { &[s0, u] } else { &[s0, u, h0] };
    let out = chunk_loop(b, nt, t.used, init, |b, i, a| {
        let (st, o_all) = (a[0], a[1]);
        let uc = take(b, o_all, 1, i)?;
        let (wqc, akc, elc) = (take(b, wq, 1, i)?, take(b, ak, 1, i)?, take(b, el, 1, i)?);
        let m1 = b.batch_matmul(wqc, st, Transpose::None)?; // [L, 2C, V]
        let ws = b.slice_axis(m1, 1, 0, c)?;
        let inter = b.slice_axis(m1, 1, c, 2 * c)?;
        let vn = b.sub(uc, ws)?;
        let m2 = b.batch_matmul(akc, vn, Transpose::None)?; // [L, C + K, V]
        let intra = b.slice_axis(m2, 1, 0, c)?;
        let write = b.slice_axis(m2, 1, c, c + k)?;
        let inter = b.mul_const(inter, scale)?;
        let oc = b.add(inter, intra)?;
        let o_all = put(b, o_all, 1, i, oc)?;
        let elb = b.broadcast_in_dim(elc, st.dims(), &[0, 1])?;
        let decayed = b.mul(elb, st)?;
        let s1 = b.add(decayed, write)?;
        if whole {
            return Ok(vec![s1, o_all]);
        }
        let fin = record_final(b, t, i, a[2], s1)?;
        let s1 = reset_ahead(b, ahead, h0, i, s1)?;
        Ok(vec![s1, o_all, fin])
    })?;
    let final_tab = if whole { as_table(b, out[0])? } else { out[2] };
    Ok(OutputRun { o: out[1], final_tab })
}

/// Results of the reverse recurrence.
pub struct GradRun {
    /// dL/d(state after every chunk), `[L, NT, K, V]`.
    pub dh: Value,
    /// dL/d(v_new) per chunk, `[L, NT, C, V]`.
    pub dv_new: Value,
    /// dL/d(initial state) per slot, `[L, slots, K, V]` (`dht` for empty segments).
    pub dh0_tab: Value,
    /// dL/d(state entering the first chunk), `[L, K, V]`.
    pub first: Value,
}

/// Runs `dh_prev = exp(G_last) dh + scale q2 - w^T dv_new`, `dv_new = p1 + kg dh` from the last
/// chunk to the first, seeding `dh` from `dht` at each segment's last chunk (docs/kda.md, Chunks,
/// steps 1-2), with `p = (p1, q2) = (Aqk^T dO, qg^T dO)` per chunk.
pub fn run_grads(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    t: ChunkTables,
    dht: Value,
    p: (Value, Value),
    ct: &ChunkTerms,
) -> Result<GradRun> {
    let (l, k, v) = (s.lanes() as i64, s.dims.k as i64, s.dims.v as i64);
    let whole = whole_rows(s, &t);
    let d0 = if whole { only_slot(b, dht)? } else { splat(b, 0.0, &[l, k, v])? };
    run_grads_window(b, s, s.chunks() as i64, t, dht, (d0, dht), p, ct, whole)
}

/// [`run_grads`] over a window of `nt` chunks per lane, starting from the carried gradient and
/// `dh0` table `(dh, dh0)`; with `whole` (see [`whole_rows`]) `dh` is already `dht` and no
/// per-chunk tables are read. `p1` is consumed: each chunk's entry is read just before `dv_new`
/// is written over it, so `dv_new` needs no buffer of its own; in the CPU configuration `q2`
/// is consumed the same way by `dh`.
#[allow(clippy::too_many_arguments)]
pub fn run_grads_window(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    nt: i64,
    t: ChunkTables,
    dht: Value,
    (d0, dh0_init): (Value, Value),
    p: (Value, Value),
    ct: &ChunkTerms,
    whole: bool,
) -> Result<GradRun> {
    let (p1, q2, w, kg, eg_last) = (p.0, p.1, ct.w, ct.kg, ct.dc.eg_last);
    let (l, k, v) = (s.lanes() as i64, s.dims.k as i64, s.dims.v as i64);
    let scale = s.options.scale as f32;
    let (p1, q2, w, kg, el) = (
        lanes4(b, s, nt, p1)?,
        lanes4(b, s, nt, q2)?,
        lanes4(b, s, nt, w)?,
        lanes4(b, s, nt, kg)?,
        lanes4(b, s, nt, eg_last)?,
    );
    // dv_new is written over p1 ([L, NT, C, V]): each chunk's p1 is read by the sum that forms
    // its dv_new, so the write comes after the read. dh is written over q2 ([L, NT, K, V]) the
    // same way, but its value does not depend on the chunk's q2 (which feeds only `prev`), so an
    // optimization barrier over the read q2 and the written dh orders the read first; without it
    // XLA may schedule the write first and copies q2 instead (a token-sized copy).
    // In slabs (the TPU configuration) dh gets its own buffer: there the reuse raised the tpu7x
    // peak of the fused saved-state program.
    let over_q2 = !s.in_slabs();
    let dh_init = if over_q2 { q2 } else { b.scratch_f32(&[l, nt, k, v])? };
    // The last visited chunk: fixed at `nt - 1`, or one before the run-time bound.
    let top_used = match t.used {
        Some(n) => {
            let one = b.scalar_i32(1)?;
            Some(b.sub(n, one)?)
        }
        None => None,
    };
    let top = match top_used {
        Some(top) => top,
        None => b.scalar_i32(nt as i32 - 1)?,
    };
    // Off whole rows the carried gradient is already the one leaving the visited chunk: the seed
    // at a segment's last chunk is applied before the loop and at the end of the chunk after it.
    let (d0, behind) =
        if whole { (d0, None) } else { (seeded(b, t, dht, top, d0)?, Some(shifted_tables(b, t, -1)?)) };
    let init: &[Value] = if whole { &[d0, dh_init, p1] } else { &[d0, dh_init, p1, dh0_init] };
    let out = chunk_loop(b, nt, t.used, init, |b, i, a| {
        let (ds1, dh_all, dvn_all) = (a[0], a[1], a[2]);
        let ci = b.sub(top, i)?;
        let (p1c, q2c, wc, kgc, elc) = (
            take(b, dvn_all, 1, ci)?,
            take(b, if over_q2 { dh_all } else { q2 }, 1, ci)?,
            take(b, w, 1, ci)?,
            take(b, kg, 1, ci)?,
            take(b, el, 1, ci)?,
        );
        let (q2c, ds1) = if over_q2 {
            let ordered = b.barrier(&[q2c, ds1])?;
            (ordered[0], ordered[1])
        } else {
            (q2c, ds1)
        };
        let dh_all = put(b, dh_all, 1, ci, ds1)?;
        let kd = b.batch_matmul(kgc, ds1, Transpose::None)?;
        let dvn = b.add(p1c, kd)?;
        let dvn_all = put(b, dvn_all, 1, ci, dvn)?;
        let elb = b.broadcast_in_dim(elc, &[l, k, v], &[0, 1])?;
        let decayed = b.mul(elb, ds1)?;
        let wd = b.batch_matmul(wc, dvn, Transpose::A)?;
        let p2c = b.mul_const(q2c, scale)?;
        let prev = b.add(decayed, p2c)?;
        let prev = b.sub(prev, wd)?;
        if whole {
            return Ok(vec![prev, dh_all, dvn_all]);
        }
        let first = element(b, t.first, ci)?;
        let slot = element(b, t.slot, ci)?;
        let cur = take(b, a[3], 1, slot)?;
        let upd = choose(b, first, prev, cur)?;
        let dh0 = put(b, a[3], 1, slot, upd)?;
        let prev = match behind {
            Some(before) => seeded(b, before, dht, ci, prev)?,
            None => prev,
        };
        Ok(vec![prev, dh_all, dvn_all, dh0])
    })?;
    let dh0_tab = if whole { as_table(b, out[0])? } else { out[3] };
    Ok(GradRun { dh: out[1], dv_new: out[2], dh0_tab, first: out[0] })
}
