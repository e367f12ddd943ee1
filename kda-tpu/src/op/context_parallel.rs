//! Context parallelism (docs/kda.md, Context parallelism): each of D devices holds one piece of every row's
//! chunks as a small packed problem of its own (host-built: `backend::context_parallel`), and
//! one program, compiled for D replicas, gives each piece its true entering state and, for the
//! backward, its true ending `dh`.
//!
//! A piece's local problem has one segment slot per segment part it holds. Slot 0 may continue a
//! segment from the previous piece (`cont`); one slot may carry its segment into the next piece
//! (`carry`, a one-hot over the slots). The host puts zeros in those slots of `h0` and `dht`;
//! the program fills them:
//!
//! 1. The piece's transition `S_out = P S_in + Q`: the carry slot's final state of the forward
//!    run once more from `h0` (zero in a continuation slot 0) is `Q`; run on zero values from
//!    the identity in a continuation slot 0, it is `P` (docs/kda.md, Context parallelism).
//! 2. An all-gather of every piece's `[Q | P]`, and the prefix `S_{j+1} = P_j S_j + Q_j`:
//!    device d's entering state is `S_d`, written into its slot 0.
//! 3. Backward: slot 0's `dh0` of the backward run once more (zero `dht` in the carry slot) is
//!    `R`; run on zero values and cotangents with the identity as the carry slot's `dht`, it is
//!    `P^T`. An all-gather and the suffix `G_j = P_{j+1}^T G_{j+1} + R_{j+1}` give each device
//!    its ending `dh`, written into its carry slot of `dht`.
//! 4. The ordinary program on the piece; the gate-parameter gradients are all-reduced.
//!
//! The extra runs cost about one more forward (and backward) at width V + K per piece, in two
//! runs of widths V and K; the exchange is `D x B x H x K x (V + K)` floats per direction,
//! independent of T.

use crate::hlo::Transpose;
use kda_core::{BackwardStrategy, DType, Problem, ProblemDims};
use kda_packed::StaticCapacity;

use super::api::build;
use super::interface::{ProgramKind, ProgramSignature};
use super::spec::{ProgramSpec, Tuning};
use crate::hlo::{FnBuilder, Module, TensorType, Value};
use crate::Result;

/// The extra arguments of a context-parallel program, after the kernel's own: `cont` `[B]`,
/// `carry` `[B, N]`, `piece` `[D]` (f32, 0/1).
pub const CP_ARGS: [&str; 3] = ["cont", "carry", "piece"];

/// The spec every device's context-parallel program is built from (any device's local
/// problem: they share their dims), with `g` in `g_dtype`, tuned as `tuning` says.
pub fn local_spec(local: &Problem, has_dht: bool, tuning: Tuning, g_dtype: DType) -> Result<ProgramSpec> {
    let d = local.dims;
    let chunks = match local.segments.is_packed() {
        true => Some(StaticCapacity::new(d.b, d.t, d.n, super::CHUNK)?.chunks()),
        false => None,
    };
    Ok(ProgramSpec::new(local, chunks, has_dht).with_tuning(tuning).with_g_dtype(g_dtype))
}

/// The identity `[K, K]` in f32.
fn identity(b: &mut FnBuilder, k: i64) -> Result<Value> {
    let ty = TensorType::new(DType::I32, &[k, k]);
    let (r, c) = (b.iota(ty.clone(), 0)?, b.iota(ty, 1)?);
    let eq = b.compare(crate::hlo::Cmp::Eq, r, c)?;
    let f = TensorType::new(DType::F32, &[k, k]);
    let (one, zero) = (b.constant_f32(1.0, f.clone())?, b.constant_f32(0.0, f)?);
    b.select(eq, one, zero)
}

/// `w[b, n] * block[b, h, k, c]` broadcast to a state-shaped `[B, N, H, K, C]`.
fn place(b: &mut FnBuilder, w: Value, block: Value, n: i64) -> Result<Value> {
    let (bb, h, k, c) = (block.dims()[0], block.dims()[1], block.dims()[2], block.dims()[3]);
    let dims = [bb, n, h, k, c];
    let wb = b.broadcast_in_dim(w, &dims, &[0, 1])?;
    let xb = b.broadcast_in_dim(block, &dims, &[0, 2, 3, 4])?;
    b.mul(wb, xb)
}

/// `I` placed by `w[b, n]`: `[B, N, H, K, K]`.
fn placed_identity(b: &mut FnBuilder, w: Value, s: &ProgramSpec) -> Result<Value> {
    let (bb, n, h, k) = (s.dims.b as i64, s.dims.n as i64, s.dims.h as i64, s.dims.k as i64);
    let eye = identity(b, k)?;
    let dims = [bb, n, h, k, k];
    let wb = b.broadcast_in_dim(w, &dims, &[0, 1])?;
    let eb = b.broadcast_in_dim(eye, &dims, &[3, 4])?;
    b.mul(wb, eb)
}

/// Slot 0 of `[B, N]` weighted by `cont[b]`.
fn slot0(b: &mut FnBuilder, cont: Value, n: i64) -> Result<Value> {
    let bb = cont.dims()[0];
    let dims = [bb, n];
    let c = b.broadcast_in_dim(cont, &dims, &[0])?;
    let i = b.iota(TensorType::new(DType::I32, &dims), 1)?;
    let z = b.constant_i32(0, TensorType::new(DType::I32, &dims))?;
    let first = b.compare(crate::hlo::Cmp::Eq, i, z)?;
    let zero = b.constant_f32(0.0, TensorType::new(DType::F32, &dims))?;
    b.select(first, c, zero)
}

/// `sum_n w[b, n] * x[b, n, ...]`: the weighted slot of a state-shaped tensor, `[B, H, K, C]`.
fn pick(b: &mut FnBuilder, w: Value, x: Value) -> Result<Value> {
    let wb = b.broadcast_in_dim(w, x.dims(), &[0, 1])?;
    let m = b.mul(wb, x)?;
    b.reduce_sum(m, &[1])
}

/// The all-gathered `[D, B, H, K, V + K]` of every device's `[B, H, K, V + K]`.
fn exchange(b: &mut FnBuilder, x: Value, devices: usize) -> Result<Value> {
    let mut dims = vec![1];
    dims.extend_from_slice(x.dims());
    let x1 = b.reshape(x, &dims)?;
    b.all_gather(x1, 0, devices)
}

/// Device j's `[B, H, K, C]` block of columns `cols` of a gathered exchange.
fn block(b: &mut FnBuilder, g: Value, j: usize, cols: (i64, i64)) -> Result<Value> {
    let d = g.dims().to_vec();
    let s = b.slice(g, &[j as i64, 0, 0, 0, cols.0], &[j as i64 + 1, d[1], d[2], d[3], cols.1], &[1; 5])?;
    b.reshape(s, &[d[1], d[2], d[3], cols.1 - cols.0])
}

/// `sum_d piece[d] * x_d`.
fn select_piece(b: &mut FnBuilder, piece: Value, xs: &[Value]) -> Result<Value> {
    let mut acc: Option<Value> = None;
    for (d, x) in xs.iter().enumerate() {
        let w = b.slice(piece, &[d as i64], &[d as i64 + 1], &[1])?;
        let w = b.reshape(w, &[])?;
        let wb = b.broadcast_in_dim(w, x.dims(), &[])?;
        let term = b.mul(wb, *x)?;
        acc = Some(match acc {
            Some(a) => b.add(a, term)?,
            None => term,
        });
    }
    acc.ok_or_else(|| crate::TpuError::builder("context_parallel", "no devices"))
}

/// Calls `f` (a kernel function of `sig`) with the arguments by name.
fn call_named(
    b: &mut FnBuilder,
    f: &str,
    sig: &ProgramSignature,
    get: &dyn Fn(&str) -> Option<Value>,
) -> Result<Vec<Value>> {
    let args = sig
        .args
        .iter()
        .map(|p| {
            get(p.name).ok_or_else(|| {
                crate::TpuError::builder("context_parallel", format!("no value for `{}`", p.name))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    b.call(f, &args, &sig.result_types())
}

/// The signature of [`context_parallel_program`]: the kernel program's, then [`CP_ARGS`]
/// (f32 `cont [B]`, `carry [B, N]`, `piece [D]`); a forward also returns `h0`, the entering
/// states it used.
pub fn signature(s: &ProgramSpec, kind: ProgramKind, devices: usize) -> ProgramSignature {
    let mut sig = ProgramSignature::of(s, kind);
    let f32 = |d: &[i64]| TensorType::new(DType::F32, d);
    let (b, n) = (s.dims.b as i64, s.dims.n as i64);
    for (name, dims) in CP_ARGS.into_iter().zip([vec![b], vec![b, n], vec![devices as i64]]) {
        sig.args.push(super::interface::Port { name, ty: f32(&dims) });
    }
    if let ProgramKind::Forward(_) = kind {
        sig.results.push(super::interface::Port { name: "h0", ty: f32(&s.state_dims()) });
    }
    sig
}

/// The context-parallel program `kind` of the local spec `s` (with `h0`, final states
/// and, for backward and fused programs, `dht`) for `devices` replicas. Arguments: the kernel
/// program's, then [`CP_ARGS`]. Results: the kernel program's; a forward also returns the
/// entering states it used (`h0` with slot 0 filled), which its backward takes as `h0`.
///
/// Each transition is found by two runs of the piece's program rather than one of width V + K:
/// the value columns (`Q`, `R`) at width V from the piece's own inputs, and the state columns
/// (`P`, `P^T`) at width K from zero values and cotangents with the identity in the continuation
/// (carry) slot. Same work, half the live memory of the widest phase.
pub fn context_parallel_program(s: &ProgramSpec, kind: ProgramKind, devices: usize) -> Result<String> {
    let (k, n) = (s.dims.k as i64, s.dims.n as i64);
    // The state-column runs: values K wide (the same spec as `s` when K = V).
    let sk = ProgramSpec { dims: ProblemDims { v: s.dims.k, ..s.dims }, ..s.clone() };
    let same = sk == *s;
    let mut m = Module::new();
    let fwd_kind = ProgramKind::Forward(BackwardStrategy::Rematerialize);
    // The backward transition runs: in slabs (the TPU configuration) the fused remat program,
    // whose backward re-runs one slab at a time; the standalone backward program computes every
    // chunk's terms at once, which at long pieces peaked well above the piece's own program.
    let bwd_kind = match s.in_slabs() {
        true => ProgramKind::Fused(BackwardStrategy::Rematerialize),
        false => ProgramKind::Backward(BackwardStrategy::Rematerialize),
    };
    let main_sig = ProgramSignature::of(s, kind);
    let (f, _) = build("kda", false, s, kind)?;
    m.add(f)?;
    let wants_forward = !matches!(kind, ProgramKind::Backward(_));
    let wants_backward = !matches!(kind, ProgramKind::Forward(_));
    let fwd_sig = (ProgramSignature::of(s, fwd_kind), ProgramSignature::of(&sk, fwd_kind));
    let bwd_sig = (ProgramSignature::of(s, bwd_kind), ProgramSignature::of(&sk, bwd_kind));
    let fwd_k = if same { "kda_fwd" } else { "kda_fwd_k" };
    let bwd_k = if same { "kda_bwd" } else { "kda_bwd_k" };
    if wants_forward {
        m.add(build("kda_fwd", false, s, fwd_kind)?.0)?;
        if !same {
            m.add(build(fwd_k, false, &sk, fwd_kind)?.0)?;
        }
    }
    if wants_backward {
        m.add(build("kda_bwd", false, s, bwd_kind)?.0)?;
        if !same {
            m.add(build(bwd_k, false, &sk, bwd_kind)?.0)?;
        }
    }

    let mut b = FnBuilder::new("main", true);
    let mut named: Vec<(&'static str, Value)> = Vec::new();
    for p in &main_sig.args {
        named.push((p.name, b.arg(p.ty.clone())?));
    }
    let f32 = |d: &[i64]| TensorType::new(DType::F32, d);
    let cont = b.arg(f32(&[s.dims.b as i64]))?;
    let carry = b.arg(f32(&[s.dims.b as i64, n]))?;
    let piece = b.arg(f32(&[devices as i64]))?;
    let missing = |what: &str| crate::TpuError::builder("context_parallel", format!("needs {what}"));
    let get =
        |named: &[(&'static str, Value)], name: &str| named.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
    let h0 = get(&named, "h0").ok_or_else(|| missing("h0"))?;
    let v_in = get(&named, "v").ok_or_else(|| missing("v"))?;
    // Zero values (and cotangents) K wide, for the state-column runs.
    let zeros_k = {
        // `v` as the K-wide runs declare it (the caller's shape or the kernel form).
        let dims = ProgramSignature::of(&sk, fwd_kind)
            .args
            .iter()
            .find(|p| p.name == "v")
            .map(|p| p.ty.dims.clone())
            .ok_or_else(|| missing("v in the K-wide signature"))?;
        let z = b.constant_f32(0.0, f32(&dims))?;
        if v_in.elem() == DType::F32 {
            z
        } else {
            b.convert(z, v_in.elem())?
        }
    };
    let zero_states_k = b.constant_f32(0.0, f32(&[s.dims.b as i64, n, s.dims.h as i64, k, k]))?;
    let first = slot0(&mut b, cont, n)?;

    let cx = Pieces {
        s,
        devices,
        named: &named,
        fwd: (&fwd_sig, fwd_k),
        bwd: (&bwd_sig, bwd_k),
        zeros_k,
        zero_states_k,
        first,
        carry,
        piece,
    };
    // 1-2: the entering state of each piece (a backward program gets it in `h0`).
    let h0_eff = if wants_forward { entering_states(&mut b, &cx, h0)? } else { h0 };
    // 3: the ending dh of each piece.
    let dht_eff = if wants_backward { Some(ending_dh(&mut b, &cx, h0_eff)?) } else { None };

    // 4: the piece's own program, after the transitions (fenced: not interleaved with them).
    let mut fence: Vec<Value> = named.iter().map(|(_, v)| *v).collect();
    fence.push(h0_eff);
    fence.extend(dht_eff);
    let fenced = b.optimization_barrier(&fence)?;
    let main_named: Vec<(&'static str, Value)> =
        named.iter().map(|(n, _)| *n).zip(fenced.iter().copied()).collect();
    let (h0_main, dht_main) = (fenced[named.len()], dht_eff.map(|_| fenced[named.len() + 1]));
    let mut outs = call_named(&mut b, "kda", &main_sig, &|name| match name {
        "h0" => Some(h0_main),
        "dht" => dht_main,
        other => get(&main_named, other),
    })?;
    for name in ["da_log", "ddt_bias"] {
        if let Some(i) = main_sig.result_index(name) {
            outs[i] = b.all_reduce_sum(outs[i], devices)?;
        }
    }
    if let ProgramKind::Forward(_) = kind {
        outs.push(h0_eff);
    }
    b.ret(&outs)?;
    m.add(b)?;
    Ok(m.to_text())
}

/// What the transition runs of a context-parallel program share.
struct Pieces<'a> {
    s: &'a ProgramSpec,
    devices: usize,
    /// The program's arguments by name.
    named: &'a [(&'static str, Value)],
    /// The forward transition runs' signatures (V wide, K wide) and the K-wide function.
    fwd: (&'a (ProgramSignature, ProgramSignature), &'static str),
    /// The backward transition runs' signatures and the K-wide function.
    bwd: (&'a (ProgramSignature, ProgramSignature), &'static str),
    /// Zero values (and cotangents) K wide, and zero states `[B, N, H, K, K]`.
    zeros_k: Value,
    zero_states_k: Value,
    /// Slot 0 of each row (its first segment) and the continuation slot.
    first: Value,
    carry: Value,
    /// This device's piece index.
    piece: Value,
}

impl Pieces<'_> {
    fn get(&self, name: &str) -> Option<Value> {
        self.named.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }
}

/// Steps 1-2: each piece's entering state, `h0` plus the states the pieces before it pass on
/// (`Q + P S` folded over the exchanged transitions).
fn entering_states(b: &mut FnBuilder, cx: &Pieces, h0: Value) -> Result<Value> {
    let (s, devices, (fwd_sig, fwd_k)) = (cx.s, cx.devices, cx.fwd);
    let (k, v, n) = (s.dims.k as i64, s.dims.v as i64, s.dims.n as i64);
    let f32 = |d: &[i64]| TensorType::new(DType::F32, d);
    let (first, carry, piece, zeros_k) = (cx.first, cx.carry, cx.piece, cx.zeros_k);
    let outs = call_named(b, "kda_fwd", &fwd_sig.0, &|name| cx.get(name))?;
    let q = pick(b, carry, outs[fwd_sig.0.result_index("final_state").unwrap_or(1)])?;
    let eye = placed_identity(b, first, s)?;
    // One run after the other: their intermediates are never live together.
    let fenced = b.optimization_barrier(&[q, zeros_k, eye])?;
    let (q, zk, eye) = (fenced[0], fenced[1], fenced[2]);
    let outs = call_named(b, fwd_k, &fwd_sig.1, &|name| match name {
        "v" => Some(zk),
        "h0" => Some(eye),
        other => cx.get(other),
    })?;
    let p = pick(b, carry, outs[fwd_sig.1.result_index("final_state").unwrap_or(1)])?;
    let qp = b.concatenate(&[q, p], 3)?;
    let all = exchange(b, qp, devices)?;
    let mut states = vec![b.constant_f32(0.0, f32(&[s.dims.b as i64, s.dims.h as i64, k, v]))?];
    for j in 0..devices.saturating_sub(1) {
        let q = block(b, all, j, (0, v))?;
        let p = block(b, all, j, (v, v + k))?;
        let ps = b.batch_matmul(p, states[j], Transpose::None)?;
        states.push(b.add(ps, q)?);
    }
    let s_in = select_piece(b, piece, &states)?;
    let placed = place(b, first, s_in, n)?;
    b.add(h0, placed)
}

/// Step 3: each piece's ending `dh`, `dht` plus what the pieces after it pass back (`R + P^T G`
/// folded in reverse), from the entering states `h0_eff`.
fn ending_dh(b: &mut FnBuilder, cx: &Pieces, h0_eff: Value) -> Result<Value> {
    let (s, devices, (bwd_sig, bwd_k)) = (cx.s, cx.devices, cx.bwd);
    let (k, v, n) = (s.dims.k as i64, s.dims.v as i64, s.dims.n as i64);
    let f32 = |d: &[i64]| TensorType::new(DType::F32, d);
    let (first, carry, piece) = (cx.first, cx.carry, cx.piece);
    let missing = |what: &str| crate::TpuError::builder("context_parallel", format!("needs {what}"));
    let dht = cx.get("dht").ok_or_else(|| missing("dht"))?;
    let dh0_of = |sig: &ProgramSignature| {
        sig.result_index("dh0").ok_or_else(|| crate::TpuError::builder("context_parallel", "no dh0"))
    };
    let outs = call_named(b, "kda_bwd", &bwd_sig.0, &|name| match name {
        "h0" => Some(h0_eff),
        other => cx.get(other),
    })?;
    let r = pick(b, first, outs[dh0_of(&bwd_sig.0)?])?;
    let eye = placed_identity(b, carry, s)?;
    let fenced = b.optimization_barrier(&[r, cx.zeros_k, cx.zero_states_k, eye])?;
    let (r, zk, zs, eye) = (fenced[0], fenced[1], fenced[2], fenced[3]);
    let outs = call_named(b, bwd_k, &bwd_sig.1, &|name| match name {
        "v" | "do" => Some(zk),
        "h0" => Some(zs),
        "dht" => Some(eye),
        other => cx.get(other),
    })?;
    let pt = pick(b, first, outs[dh0_of(&bwd_sig.1)?])?;
    let rp = b.concatenate(&[r, pt], 3)?;
    let all = exchange(b, rp, devices)?;
    let mut ends = vec![b.constant_f32(0.0, f32(&[s.dims.b as i64, s.dims.h as i64, k, v]))?; devices];
    for j in (0..devices.saturating_sub(1)).rev() {
        let r = block(b, all, j + 1, (0, v))?;
        let pt = block(b, all, j + 1, (v, v + k))?;
        let pg = b.batch_matmul(pt, ends[j + 1], Transpose::None)?;
        ends[j] = b.add(pg, r)?;
    }
    let dh_out = select_piece(b, piece, &ends)?;
    let placed = place(b, carry, dh_out, n)?;
    b.add(dht, placed)
}
