//! The XLA implementation's program bodies: forward (optionally keeping `h` for the saved-state
//! backward), backward (saved state or rematerialized) and the fused forward+VJP, assembled from
//! the chunk terms and recurrences of this folder.

use super::grads::{chunk_grads, t_matmul, ChunkGrads};
use super::intra::{chunk_terms, ChunkTerms};
use super::recurrence::{run_grads, run_grads_window, run_output, run_states, run_states_window};
use crate::hlo::Transpose;
use crate::hlo::{FnBuilder, TensorType, Value};
use crate::op::args::{state_tab, Args, ChunkTables, GATE_FLOOR};
use crate::op::hlo_ops::{i32t, keep, splat};
use crate::op::prep::{self, GateParams};
use crate::op::spec::{on_device, ProgramSpec, CHUNK};
use crate::Result;
use kda_core::{BackwardStrategy, DType};

/// Inputs in working form: head-first f32 tokens (normalised, gate activated) and chunks.
struct Working {
    q: Value,
    k: Value,
    q_rstd: Option<Value>,
    k_rstd: Option<Value>,
    x: Value,
    g: Value,
    gate: Option<GateParams>,
    v: Value,
    beta: Value,
    /// `[N, C, D]` chunk views (N = lanes x chunks).
    qc: Value,
    kc: Value,
    vc: Value,
    gc: Value,
    betac: Value,
}

fn flat_chunks(b: &mut FnBuilder, s: &ProgramSpec, x: Value, idx: Option<Value>) -> Result<Value> {
    let c = prep::to_chunks(b, s, x, idx)?;
    let d = c.dims()[3];
    b.reshape(c, &[(s.lanes() * s.chunks()) as i64, CHUNK as i64, d])
}

fn working(b: &mut FnBuilder, s: &ProgramSpec, a: &Args) -> Result<Working> {
    let q = prep::head_first(b, s, a.q)?;
    let k = prep::head_first(b, s, a.k)?;
    let (q, k, q_rstd, k_rstd) = if s.options.l2norm {
        let (qn, qr) = prep::l2_normalise(b, q)?;
        let (kn, kr) = prep::l2_normalise(b, k)?;
        (qn, kn, Some(qr), Some(kr))
    } else {
        (q, k, None, None)
    };
    let v = prep::head_first(b, s, a.v)?;
    let x = prep::head_first(b, s, a.g)?;
    let gate = match a.a_log {
        Some(al) => Some(prep::gate_params(b, s, al, a.dt_bias, x.dims())?),
        None => None,
    };
    let g = prep::activate(b, s, x, gate.as_ref())?;
    let floor = splat(b, GATE_FLOOR, g.dims())?;
    let g_used = b.max(g, floor)?;
    let beta = prep::beta_head_first(b, s, a.beta)?;
    let qc = flat_chunks(b, s, q, a.slot_token)?;
    let kc = flat_chunks(b, s, k, a.slot_token)?;
    let vc = flat_chunks(b, s, v, a.slot_token)?;
    let gc = flat_chunks(b, s, g_used, a.slot_token)?;
    let betac = flat_chunks(b, s, beta, a.slot_token)?;
    Ok(Working { q, k, q_rstd, k_rstd, x, g, gate, v, beta, qc, kc, vc, gc, betac })
}

/// The tables the sequential loops read. A packed program's capacity covers the worst
/// segmentation; the loops stop after the last chunk position that ends a segment (one past
/// the largest `i` with `last[i] = 1`; 0 when every segment is empty), since only padding
/// follows it. Fixed-length programs visit every position.
fn loop_tables(b: &mut FnBuilder, s: &ProgramSpec, t: ChunkTables) -> Result<ChunkTables> {
    if s.packed_chunks.is_none() {
        return Ok(t);
    }
    let nt = t.last.dims()[0];
    let pos = b.iota(i32t(&[nt]), 0)?;
    let one = b.constant_i32(1, i32t(&[nt]))?;
    let after = b.add(pos, one)?;
    let ends = b.mul(after, t.last)?;
    let used = b.reduce_max(ends, &[0])?;
    Ok(ChunkTables { used: Some(used), ..t })
}

fn flat(b: &mut FnBuilder, x: Value) -> Result<Value> {
    let d = x.dims();
    let mut dims = vec![d[0] * d[1]];
    dims.extend_from_slice(&d[2..]);
    b.reshape(x, &dims)
}

/// Forward outputs from the chunk terms and the state run: `o` in the caller's layout and dtype.
fn output(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    ct: &ChunkTerms,
    h: Value,
    v_new: Value,
) -> Result<Value> {
    let hf = flat(b, h)?;
    let vf = flat(b, v_new)?;
    let inter = b.batch_matmul(ct.qg, hf, Transpose::None)?;
    let inter = b.mul_const(inter, s.options.scale as f32)?;
    let intra = b.batch_matmul(ct.aqk, vf, Transpose::None)?;
    let o = b.add(inter, intra)?;
    let o = b.reshape(o, &[s.lanes() as i64, s.chunks() as i64, CHUNK as i64, s.dims.v as i64])?;
    let o = prep::from_chunks(b, s, o, a.token_slot)?;
    prep::to_caller(b, s, o, on_device(s.options.dtype))
}

struct Forward {
    o: Value,
    final_state: Option<Value>,
    h: Value,
    v_new: Value,
}

fn forward_core(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    w: &Working,
    ct: &ChunkTerms,
) -> Result<Forward> {
    let h0 = state_tab(b, s, a.h0)?;
    let tables = loop_tables(b, s, a.tables)?;
    let run = run_states(b, s, tables, h0, ct)?;
    let o = output(b, s, a, ct, run.h, run.v_new)?;
    let _ = w;
    let final_state =
        if s.options.final_state { Some(prep::state_from_table(b, s, run.final_tab)?) } else { None };
    Ok(Forward { o, final_state, h: run.h, v_new: run.v_new })
}

/// What the backward's `dh` recurrence hands the chunk-parallel gradients: `dh` leaving every
/// chunk `[L, NT, K, V]`, `dv_new` `[L, NT, C, V]` and the `dh0` table `[L, slots, K, V]`.
struct DhRun {
    dh: Value,
    dv_new: Value,
    dh0_tab: Value,
}

/// The backward's `dh` recurrence as XLA's chunk loop, from the chunk terms, `dO` in chunks
/// (`[L*NT, C, V]` f32) and `dht` as the caller gave it.
fn xla_dh(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    ct: &ChunkTerms,
    doc: Value,
    dht: Option<Value>,
) -> Result<DhRun> {
    let (p1, q2) = dh_terms(b, ct, doc, !s.in_slabs())?;
    let dht_tab = state_tab(b, s, dht)?;
    let tables = loop_tables(b, s, a.tables)?;
    let run = run_grads(b, s, tables, dht_tab, (p1, q2), ct)?;
    Ok(DhRun { dh: run.dh, dv_new: run.dv_new, dh0_tab: run.dh0_tab })
}

/// Gradients in the caller's layout and dtypes, in `KdaGradients` order.
#[allow(clippy::too_many_arguments)]
fn backward_core(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    w: &Working,
    ct: &ChunkTerms,
    (h, v_new): (Value, Value),
    (d_o, dht): (Value, Option<Value>),
) -> Result<Vec<Value>> {
    let doh = prep::head_first(b, s, d_o)?;
    let doc = flat_chunks(b, s, doh, a.slot_token)?;
    let run = xla_dh(b, s, a, ct, doc, dht)?;
    let (h, dh, vn, dvn) = (flat(b, h)?, flat(b, run.dh)?, flat(b, v_new)?, flat(b, run.dv_new)?);
    let g = chunk_grads(b, s, [w.qc, w.kc, w.vc, w.betac], ct, [h, vn, dh, dvn], doc)?;
    finish_grads(b, s, a, w, g, run.dh0_tab, None)
}

/// The chunk-parallel terms of the `dh` recurrence: `Aqk^T dO` and `qg^T dO` (the recurrence
/// applies `scale` to the second where it reads it, so no scaled copy is stored).
fn dh_terms(b: &mut FnBuilder, ct: &ChunkTerms, doc: Value, store: bool) -> Result<(Value, Value)> {
    let p1 = t_matmul(b, ct.aqk, doc, store)?;
    // qg^T dO stays a transposed-operand product: storing qg^T ([N, K, C]) measured no faster.
    let q2 = b.batch_matmul(ct.qg, doc, Transpose::A)?;
    Ok((p1, q2))
}

/// Chunk gradients (`[L*NT, C, D]`) back to tokens, through the gate floor, the L2 norm and the
/// gate activation (unless `gated`: kernels took them through, the gate parameters' gradients
/// given), into the caller's layout and dtypes, in `KdaGradients` order.
fn finish_grads(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    w: &Working,
    g: ChunkGrads,
    dh0_tab: Value,
    gated: Option<Vec<Value>>,
) -> Result<Vec<Value>> {
    let ChunkGrads { dq, dk, dv, dg, dbeta } = g;
    // Back to tokens, then through the L2 norm and the gate.
    let lanes4 = |b: &mut FnBuilder, x: Value| -> Result<Value> {
        let d = x.dims()[2];
        b.reshape(x, &[s.lanes() as i64, s.chunks() as i64, CHUNK as i64, d])
    };
    let tok = |b: &mut FnBuilder, x: Value| -> Result<Value> {
        let x = lanes4(b, x)?;
        prep::from_chunks(b, s, x, a.token_slot)
    };
    let mut dq = tok(b, dq)?;
    let mut dk = tok(b, dk)?;
    let dv = tok(b, dv)?;
    let mut dg = tok(b, dg)?;
    // Below the floor the kernel used the floor: no gradient flows to g there (the reference
    // gives exactly 0 as well, since exp(g) underflows).
    if gated.is_none() {
        let floor = splat(b, GATE_FLOOR, w.g.dims())?;
        let live = b.compare(crate::hlo::Cmp::Gt, w.g, floor)?;
        dg = keep(b, live, dg)?;
    }
    let dbeta = tok(b, dbeta)?;
    if let (Some(qr), Some(kr), None) = (w.q_rstd, w.k_rstd, &gated) {
        dq = prep::l2_backward(b, dq, w.q, qr)?;
        dk = prep::l2_backward(b, dk, w.k, kr)?;
    }
    let mut gate_grads = gated.clone().unwrap_or_default();
    if let (Some(gp), None) = (&w.gate, &gated) {
        let (dx, da_log, ddt) = prep::gate_backward(b, s, w.x, w.g, dg, gp)?;
        dg = dx;
        gate_grads.push(da_log);
        if s.options.has_dt_bias {
            gate_grads.push(ddt);
        }
    }
    let e = on_device(s.options.dtype);
    let mut out = vec![
        prep::to_caller(b, s, dq, e)?,
        prep::to_caller(b, s, dk, e)?,
        prep::to_caller(b, s, dv, e)?,
        prep::to_caller(b, s, dg, on_device(s.options.g_dtype))?,
        prep::beta_to_caller(b, s, dbeta, e)?,
    ];
    if s.options.has_h0 {
        out.push(prep::state_from_table(b, s, dh0_tab)?);
    }
    out.extend(gate_grads);
    let _ = (w.v, w.beta);
    Ok(out)
}

/// The backward's tail for gradients formed elsewhere (the GPU rows' kernels): `[dq, dk, dv,
/// dg, dbeta]` in chunk layout `[L*NT, C, D]` (`dg` summed within the chunk; the gate floor,
/// the gate and the L2 norm passed already, the gate parameters' gradients `gate_grads`) into
/// the caller's layout and dtypes, then the `dh0` table `[L, slots, K, V]`: as [`backward`]
/// returns them.
pub(in crate::op) fn finish_chunk_grads(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    [dq, dk, dv, dg, dbeta]: [Value; 5],
    dh0_tab: Value,
    gate_grads: Vec<Value>,
) -> Result<Vec<Value>> {
    let w = working(f, s, a)?;
    finish_grads(f, s, a, &w, ChunkGrads { dq, dk, dv, dg, dbeta }, dh0_tab, Some(gate_grads))
}

/// The forward: `o [final_state] [h]` (`h` `[L, NT, K, V]` when `keep_h`). With slabs
/// (`s.tuning.xla.slab`, the TPU configuration) it runs as `forward_slabs`; otherwise the chunk terms are
/// computed for all chunks at once.
pub(in crate::op) fn forward(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    keep_h: bool,
) -> Result<Vec<Value>> {
    let a = *a;
    let w = working(f, s, &a)?;
    if s.in_slabs() {
        // The TPU configuration: slab by slab, one slab's intermediates live at a time.
        let sl = Slabs::new(f, s, &a, &w)?;
        let keep = if keep_h { SlabKeep::States } else { SlabKeep::Nothing };
        let fwd = forward_slabs(f, s, &a, &sl, keep)?;
        let mut outs = vec![fwd.o];
        outs.extend(fwd.final_state);
        if let Some(&h) = fwd.kept.first() {
            outs.push(f.slice_axis(h, 1, 0, s.chunks() as i64)?);
        }
        return Ok(outs);
    }
    let ct = chunk_terms(f, w.qc, w.kc, w.vc, w.gc, w.betac, s.options.scale as f32, s.tuning.xla.slab == 0)?;
    if !keep_h {
        // The forward alone on the CPU configuration: outputs formed inside the recurrence, no
        // per-chunk states kept (faster and less scratch on the CPU plugin; on
        // tpu7x this form raised the peak, and the TPU configuration runs in slabs instead).
        let h0 = state_tab(f, s, a.h0)?;
        let tables = loop_tables(f, s, a.tables)?;
        let run = run_output(f, s, tables, h0, &ct, s.options.scale as f32)?;
        let o = prep::from_chunks(f, s, run.o, a.token_slot)?;
        let mut outs = vec![prep::to_caller(f, s, o, on_device(s.options.dtype))?];
        if s.options.final_state {
            outs.push(prep::state_from_table(f, s, run.final_tab)?);
        }
        return Ok(outs);
    }
    let fw = forward_core(f, s, &a, &w, &ct)?;
    let mut outs = vec![fw.o];
    outs.extend(fw.final_state);
    if keep_h {
        outs.push(fw.h);
    }
    Ok(outs)
}

/// The backward from the saved states `saved` (or re-running the recurrence), `do` and
/// `dht`: `dq dk dv dg dbeta [dh0] [da_log] [ddt_bias]`.
pub(in crate::op) fn backward(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    saved: Option<Value>,
    (d_o, dht): (Value, Option<Value>),
) -> Result<Vec<Value>> {
    let a = *a;
    let w = working(f, s, &a)?;
    let ct = chunk_terms(f, w.qc, w.kc, w.vc, w.gc, w.betac, s.options.scale as f32, s.tuning.xla.slab == 0)?;
    let (h, v_new) = match saved {
        Some(h) => {
            // v_new = u - w S0, chunk-parallel from the saved states.
            let hf = flat(f, h)?;
            let ws = f.batch_matmul(ct.w, hf, Transpose::None)?;
            let vn = f.sub(ct.u, ws)?;
            let vn = f.reshape(vn, &[s.lanes() as i64, s.chunks() as i64, CHUNK as i64, s.dims.v as i64])?;
            (h, vn)
        }
        None => {
            let h0 = state_tab(f, s, a.h0)?;
            let tables = loop_tables(f, s, a.tables)?;
            let run = run_states(f, s, tables, h0, &ct)?;
            (run.h, run.v_new)
        }
    };
    let outs = backward_core(f, s, &a, &w, &ct, (h, v_new), (d_o, dht))?;
    Ok(outs)
}

/// The fused forward+VJP: `o [final_state]`, then the gradients. In slabs, `Rematerialize`
/// keeps only each slab's entering state and the backward re-runs the slab's recurrence;
/// without slabs both strategies read the forward's states, which the one executable holds
/// anyway.
pub(in crate::op) fn fused(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    strategy: BackwardStrategy,
    (d_o, dht): (Value, Option<Value>),
) -> Result<Vec<Value>> {
    let a = *a;
    let w = working(f, s, &a)?;
    if s.in_slabs() {
        let outs = fused_slabs(f, s, &a, &w, strategy, (d_o, dht))?;
        return Ok(outs);
    }
    let ct = chunk_terms(f, w.qc, w.kc, w.vc, w.gc, w.betac, s.options.scale as f32, s.tuning.xla.slab == 0)?;
    // Without slabs the forward's per-chunk states are live in this executable whichever the
    // strategy, so the backward half reads them: re-running the identical recurrence would only
    // cost time. The strategies differ in slabs (`fused_slabs`) and in the split path.
    let fw = forward_core(f, s, &a, &w, &ct)?;
    let grads = backward_core(f, s, &a, &w, &ct, (fw.h, fw.v_new), (d_o, dht))?;
    let mut outs = vec![fw.o];
    outs.extend(fw.final_state);
    outs.extend(grads);
    Ok(outs)
}

/// `[L*NT, C, D]` chunk tensor as `[L, NTP, C, D]`, zero chunks appended up to `ntp`.
fn lanes_padded(b: &mut FnBuilder, s: &ProgramSpec, x: Value, ntp: i64) -> Result<Value> {
    let (l, nt, d) = (s.lanes() as i64, s.chunks() as i64, x.dims()[2]);
    let x = b.reshape(x, &[l, nt, CHUNK as i64, d])?;
    let zero = b.constant_f32(0.0, TensorType::new(DType::F32, &[]))?;
    b.pad(x, zero, &[0, 0, 0, 0], &[0, ntp - nt, 0, 0], &[0, 0, 0, 0])
}

/// Chunk positions `off..off+p` of `[L, NTP, ..]` as `[L*p, ..]` (`flat`) or `[L, p, ..]`.
fn slab_of(b: &mut FnBuilder, x: Value, off: Value, p: i64, flat_out: bool) -> Result<Value> {
    let zero = b.scalar_i32(0)?;
    let mut idx = vec![zero; x.rank()];
    idx[1] = off;
    let mut sizes = x.dims().to_vec();
    sizes[1] = p;
    let y = b.dynamic_slice(x, &idx, &sizes)?;
    if flat_out {
        flat(b, y)
    } else {
        Ok(y)
    }
}

/// Writes `[L, p, ..]` (or flat `[L*p, ..]`) into chunk positions `off..` of `[L, NTP, ..]`.
fn put_slab(b: &mut FnBuilder, all: Value, off: Value, x: Value) -> Result<Value> {
    let mut d = all.dims().to_vec();
    d[1] = if x.rank() + 1 == all.rank() { x.dims()[0] / d[0] } else { x.dims()[1] };
    let x = b.reshape(x, &d)?;
    let zero = b.scalar_i32(0)?;
    let mut idx = vec![zero; all.rank()];
    idx[1] = off;
    b.dynamic_update_slice(all, x, &idx)
}

/// The chunk inputs and tables of a program run in slabs of `p` chunk positions, padded with
/// zero chunks (and zero table entries) up to `ntp = ns * p`.
struct Slabs {
    p: i64,
    ns: i64,
    ntp: i64,
    /// `q k v g beta` chunks, `[L, NTP, C, D]`.
    chunks: Vec<Value>,
    tabs: ChunkTables,
}

impl Slabs {
    fn new(b: &mut FnBuilder, s: &ProgramSpec, a: &Args, w: &Working) -> Result<Slabs> {
        let nt = s.chunks() as i64;
        let p = s.tuning.xla.slab as i64;
        let ns = (nt + p - 1) / p;
        let ntp = ns * p;
        let chunks: Vec<Value> = [w.qc, w.kc, w.vc, w.gc, w.betac]
            .iter()
            .map(|&x| lanes_padded(b, s, x, ntp))
            .collect::<Result<_>>()?;
        let pad_tab = |b: &mut FnBuilder, x: Value| -> Result<Value> {
            let z = b.constant_i32(0, TensorType::new(DType::I32, &[]))?;
            b.pad(x, z, &[0], &[ntp - nt], &[0])
        };
        let tabs = ChunkTables {
            first: pad_tab(b, a.tables.first)?,
            last: pad_tab(b, a.tables.last)?,
            slot: pad_tab(b, a.tables.slot)?,
            used: None,
        };
        Ok(Slabs { p, ns, ntp, chunks, tabs })
    }

    /// The tables of the slab starting at chunk position `off`.
    fn tabs_at(&self, b: &mut FnBuilder, off: Value) -> Result<ChunkTables> {
        let p = self.p;
        Ok(ChunkTables {
            first: b.dynamic_slice(self.tabs.first, &[off], &[p])?,
            last: b.dynamic_slice(self.tabs.last, &[off], &[p])?,
            slot: b.dynamic_slice(self.tabs.slot, &[off], &[p])?,
            used: None,
        })
    }

    /// The chunk terms of the slab at `off`, with its flat `q k v g beta` chunks.
    fn terms_at(&self, b: &mut FnBuilder, off: Value, scale: f32) -> Result<(ChunkTerms, [Value; 5])> {
        let x: Vec<Value> =
            self.chunks.iter().map(|&x| slab_of(b, x, off, self.p, true)).collect::<Result<_>>()?;
        let ct = chunk_terms(b, x[0], x[1], x[2], x[3], x[4], scale, false)?;
        Ok((ct, [x[0], x[1], x[2], x[3], x[4]]))
    }

    /// The first chunk position of slab `i`.
    fn offset(&self, b: &mut FnBuilder, i: Value) -> Result<Value> {
        let pc = b.scalar_i32(self.p as i32)?;
        b.mul(i, pc)
    }
}

/// What the slab forward keeps for a backward.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SlabKeep {
    /// Nothing (the forward alone).
    Nothing,
    /// The state entering every chunk (the saved-state residual of the forward program).
    States,
    /// The state entering every chunk and `v_new` (the fused saved-state backward).
    StatesAndVNew,
    /// The state entering every slab (the fused remat backward re-runs each slab from it).
    SlabStarts,
}

/// Results of the slab forward; kept tensors are `[L, NTP, ..]` (`[L, NS, K, V]` for starts).
struct SlabForward {
    /// `o` in the caller's layout and dtype.
    o: Value,
    final_state: Option<Value>,
    kept: Vec<Value>,
}

/// The forward in slabs of `s.tuning.xla.slab` chunk positions: each loop step computes one slab's chunk
/// terms, runs the state recurrence through it and writes its outputs, so only one slab's
/// intermediates are live at a time.
fn forward_slabs(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    sl: &Slabs,
    keep: SlabKeep,
) -> Result<SlabForward> {
    let (l, nt, k, v, c) =
        (s.lanes() as i64, s.chunks() as i64, s.dims.k as i64, s.dims.v as i64, CHUNK as i64);
    let (p, ntp) = (sl.p, sl.ntp);
    let scale = s.options.scale as f32;
    let h0_tab = state_tab(b, s, a.h0)?;
    let s0 = splat(b, 0.0, &[l, k, v])?;
    let o_all = b.scratch_f32(&[l, ntp, c, v])?;
    let mut init = vec![s0, h0_tab, o_all];
    match keep {
        SlabKeep::Nothing => {}
        SlabKeep::States => init.push(b.scratch_f32(&[l, ntp, k, v])?),
        SlabKeep::StatesAndVNew => {
            init.push(b.scratch_f32(&[l, ntp, k, v])?);
            init.push(b.scratch_f32(&[l, ntp, c, v])?);
        }
        SlabKeep::SlabStarts => init.push(b.scratch_f32(&[l, sl.ns, k, v])?),
    }
    let fwd = b.for_loop(sl.ns as i32, &init, |b, i, st| {
        let off = sl.offset(b, i)?;
        let (ct, _) = sl.terms_at(b, off, scale)?;
        let t = sl.tabs_at(b, off)?;
        let run = run_states_window(b, s, p, t, h0_tab, (st[0], st[1]), &ct, false)?;
        let hf = flat(b, run.h)?;
        let vf = flat(b, run.v_new)?;
        let inter = b.batch_matmul(ct.qg, hf, Transpose::None)?;
        let inter = b.mul_const(inter, scale)?;
        let intra = b.batch_matmul(ct.aqk, vf, Transpose::None)?;
        let o = b.add(inter, intra)?;
        let o_all = put_slab(b, st[2], off, o)?;
        let mut next = vec![run.last, run.final_tab, o_all];
        match keep {
            SlabKeep::Nothing => {}
            SlabKeep::States => next.push(put_slab(b, st[3], off, run.h)?),
            SlabKeep::StatesAndVNew => {
                next.push(put_slab(b, st[3], off, run.h)?);
                next.push(put_slab(b, st[4], off, run.v_new)?);
            }
            SlabKeep::SlabStarts => {
                let one = unit1(b, st[0])?;
                next.push(put_slab(b, st[3], i, one)?);
            }
        }
        Ok(next)
    })?;
    let o = b.slice_axis(fwd[2], 1, 0, nt)?;
    let o = prep::from_chunks(b, s, o, a.token_slot)?;
    let o = prep::to_caller(b, s, o, on_device(s.options.dtype))?;
    let final_state = if s.options.final_state { Some(prep::state_from_table(b, s, fwd[1])?) } else { None };
    Ok(SlabForward { o, final_state, kept: fwd[3..].to_vec() })
}

/// The fused forward+VJP in slabs of `s.tuning.xla.slab` chunk positions: [`forward_slabs`], then the
/// reverse loop recomputes each slab's chunk terms, runs the `dh` recurrence through it and
/// writes its chunk gradients. Saved-state keeps `h` and `v_new` per chunk, remat only the state
/// at each slab boundary and re-runs the slab.
fn fused_slabs(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    w: &Working,
    strategy: BackwardStrategy,
    (d_o, dht): (Value, Option<Value>),
) -> Result<Vec<Value>> {
    let (l, nt, k, v, c) =
        (s.lanes() as i64, s.chunks() as i64, s.dims.k as i64, s.dims.v as i64, CHUNK as i64);
    let sl = Slabs::new(b, s, a, w)?;
    let (p, ns, ntp) = (sl.p, sl.ns, sl.ntp);
    let scale = s.options.scale as f32;
    let doh = prep::head_first(b, s, d_o)?;
    let doc = flat_chunks(b, s, doh, a.slot_token)?;
    let doc = lanes_padded(b, s, doc, ntp)?;
    let h0_tab = state_tab(b, s, a.h0)?;
    let dht_tab = state_tab(b, s, dht)?;
    let saved = strategy == BackwardStrategy::SavedState;
    let keep = if saved { SlabKeep::StatesAndVNew } else { SlabKeep::SlabStarts };
    let fwd = forward_slabs(b, s, a, &sl, keep)?;
    let mut outs = vec![fwd.o];
    outs.extend(fwd.final_state);
    let kept = fwd.kept;
    // Backward, slab by slab in reverse.
    let d0 = splat(b, 0.0, &[l, k, v])?;
    let acc = |b: &mut FnBuilder, d: i64| b.scratch_f32(&[l, ntp, c, d]);
    let init = vec![d0, dht_tab, acc(b, k)?, acc(b, k)?, acc(b, v)?, acc(b, k)?, acc(b, 1)?];
    let bwd = b.for_loop(ns as i32, &init, |b, j, st| {
        let last = b.scalar_i32(ns as i32 - 1)?;
        let i = b.sub(last, j)?;
        let off = sl.offset(b, i)?;
        let (ct, x) = sl.terms_at(b, off, scale)?;
        let t = sl.tabs_at(b, off)?;
        let (h_s, vn_s) = if saved {
            (slab_of(b, kept[0], off, p, false)?, slab_of(b, kept[1], off, p, false)?)
        } else {
            let start = slab_of(b, kept[0], i, 1, false)?;
            let start = b.reshape(start, &[l, k, v])?;
            let run = run_states_window(b, s, p, t, h0_tab, (start, h0_tab), &ct, false)?;
            (run.h, run.v_new)
        };
        let do_s = slab_of(b, doc, off, p, true)?;
        let (p1, q2) = dh_terms(b, &ct, do_s, false)?;
        let run = run_grads_window(b, s, p, t, dht_tab, (st[0], st[1]), (p1, q2), &ct, false)?;
        let fl = [flat(b, h_s)?, flat(b, vn_s)?, flat(b, run.dh)?, flat(b, run.dv_new)?];
        let g = chunk_grads(b, s, [x[0], x[1], x[2], x[4]], &ct, fl, do_s)?;
        Ok(vec![
            run.first,
            run.dh0_tab,
            put_slab(b, st[2], off, g.dq)?,
            put_slab(b, st[3], off, g.dk)?,
            put_slab(b, st[4], off, g.dv)?,
            put_slab(b, st[5], off, g.dg)?,
            put_slab(b, st[6], off, g.dbeta)?,
        ])
    })?;
    let back = |b: &mut FnBuilder, x: Value| -> Result<Value> {
        let x = b.slice_axis(x, 1, 0, nt)?;
        flat(b, x)
    };
    let g = ChunkGrads {
        dq: back(b, bwd[2])?,
        dk: back(b, bwd[3])?,
        dv: back(b, bwd[4])?,
        dg: back(b, bwd[5])?,
        dbeta: back(b, bwd[6])?,
    };
    outs.extend(finish_grads(b, s, a, w, g, bwd[1], None)?);
    Ok(outs)
}

/// `[L, K, V]` as `[L, 1, K, V]`.
fn unit1(b: &mut FnBuilder, x: Value) -> Result<Value> {
    let mut d = x.dims().to_vec();
    d.insert(1, 1);
    b.reshape(x, &d)
}
