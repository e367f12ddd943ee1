//! The forward program around the Mosaic forward kernel ([`crate::lang::forward`]): the same
//! signature as the XLA forward, so the backend, the compile cache and the backward read it
//! unchanged. The kernel reads the caller's tensors as they are (fixed-length rows of whole
//! chunks, [`Tokens::HeadFirst`] and [`Tokens::BatchFirst`]; packed rows of whole 64-token
//! blocks through windows, [`Tokens::PackedHeadFirst`] and [`Tokens::PackedBatchFirst`]) and
//! applies the L2 norm, the gate and its floor itself, so nothing of the size of the inputs is
//! made before it; otherwise XLA makes lanes first (a transpose, the padding of T to whole
//! chunks, or the gather of packed segments into chunk-aligned work, in the inputs' own
//! dtypes). After the kernel: `o` in the caller's layout (in place; packed, its padding tokens
//! zeroed with the cast; or back from lanes) and the final states of segments that hold no
//! chunk (their initial states).

use super::forward::{forward_kernel, ForwardDims, Gate, Tokens};
use crate::hlo::{Cmp, FnBuilder, Value};
use crate::lang::Lowering;
use crate::op::args::{state_tab, Args, ChunkTables};
use crate::op::ops::{i32t, splat};
use crate::op::prep;
use crate::op::spec::{on_device, KernelSpec, CHUNK};
use crate::Result;
use kda_core::{GateKind, Layout};

/// A per-token tensor in the caller's layout to head-first `[H, B, T, D]`, in its own dtype.
pub(super) fn lanes_first(b: &mut FnBuilder, s: &KernelSpec, x: Value) -> Result<Value> {
    match s.layout {
        Layout::HeadFirst => Ok(x),
        Layout::BatchFirst => prep::heads_outermost(b, s, x),
    }
}

/// Head-first `[H, B, T, D]` to the kernel's `[L, NT * 64, D]` (packed: gathered by `slot_token`).
pub(super) fn kernel_tokens(
    b: &mut FnBuilder,
    s: &KernelSpec,
    x: Value,
    slot_token: Option<Value>,
) -> Result<Value> {
    let d = x.dims()[3];
    let c = prep::to_chunks(b, s, x, slot_token)?;
    b.reshape(c, &[s.lanes() as i64, (s.chunks() * CHUNK) as i64, d])
}

/// The slot table the kernels read: `slot` itself for fixed length (all zeros), else its
/// [`running_max`].
pub(super) fn kernel_slots(b: &mut FnBuilder, s: &KernelSpec, slot: Value) -> Result<Value> {
    match s.packed_chunks {
        None => Ok(slot),
        Some(_) => running_max(b, slot),
    }
}

/// `slot` with every entry raised to the largest before it: the real chunks' slots never
/// decrease, and the padding chunks after them (slot 0 in the tables) then keep the last
/// segment's slot, so the kernel's `ht` block is never revisited.
pub(super) fn running_max(b: &mut FnBuilder, slot: Value) -> Result<Value> {
    let n = slot.dims()[0];
    let at = b.iota(i32t(&[n, n]), 0)?;
    let before = b.iota(i32t(&[n, n]), 1)?;
    let seen = b.compare(Cmp::Le, before, at)?;
    let wide = b.broadcast_in_dim(slot, &[n, n], &[1])?;
    let zero = b.constant_i32(0, i32t(&[n, n]))?;
    let kept = b.select(seen, wide, zero)?;
    b.reduce_max(kept, &[1])
}

/// The kernel's per-slot state table `state` where some chunk ended the slot's segment, else
/// `passed` (zeros when `None`): a segment without chunks passes its starting state straight
/// through (`h0` to `ht` forward, `dht` to `dh0` backward).
pub(super) fn or_passed(
    b: &mut FnBuilder,
    s: &KernelSpec,
    tables: &ChunkTables,
    state: Value,
    passed: Option<Value>,
) -> Result<Value> {
    let passed = match passed {
        Some(p) => p,
        None => state_tab(b, s, None)?,
    };
    let ended = ended(b, s, tables.last, tables.slot)?;
    let ended = b.broadcast_in_dim(ended, state.dims(), &[1])?;
    b.select(ended, state, passed)
}

/// `[S]` i1: whether a chunk ends a segment of each state slot.
fn ended(b: &mut FnBuilder, s: &KernelSpec, last: Value, slot: Value) -> Result<Value> {
    let (nt, slots) = (s.chunks() as i64, s.slots() as i64);
    let ids = b.iota(i32t(&[nt, slots]), 1)?;
    let at = b.broadcast_in_dim(slot, &[nt, slots], &[0])?;
    let mine = b.compare(Cmp::Eq, ids, at)?;
    let ends = b.broadcast_in_dim(last, &[nt, slots], &[0])?;
    let zero = b.constant_i32(0, i32t(&[nt, slots]))?;
    let hit = b.select(mine, ends, zero)?;
    let any = b.reduce_max(hit, &[0])?;
    let zero = b.constant_i32(0, i32t(&[slots]))?;
    b.compare(Cmp::Gt, any, zero)
}

/// How the kernel reads the caller's tokens: in place when rows have a fixed length of whole
/// chunks, or are packed into whole 64-token blocks (batch-first only when each head's K and V
/// lanes are whole 128-lane tiles, or H = 1), else through lanes that XLA makes (padded to whole
/// chunks).
pub(super) fn tokens_of(s: &KernelSpec) -> Tokens {
    let tiles = s.h == 1 || (s.k.is_multiple_of(128) && s.v.is_multiple_of(128));
    if s.packed_chunks.is_some() {
        // A head's `o` stays in VMEM (f32, double-buffered) while its chunks place their rows.
        if !packed_fits(s, s.v) {
            return Tokens::Lanes;
        }
        return match ((s.b * s.t).is_multiple_of(CHUNK), s.layout) {
            (true, Layout::HeadFirst) => Tokens::PackedHeadFirst,
            (true, Layout::BatchFirst) if tiles => Tokens::PackedBatchFirst,
            _ => Tokens::Lanes,
        };
    }
    match (s.t.is_multiple_of(CHUNK), s.layout) {
        (true, Layout::HeadFirst) => Tokens::HeadFirst,
        (true, Layout::BatchFirst) if tiles => Tokens::BatchFirst,
        _ => Tokens::Lanes,
    }
}

/// A per-token input as the kernel reads it: in place (a free reshape) or as lanes.
pub(super) fn kernel_input(
    b: &mut FnBuilder,
    s: &KernelSpec,
    x: Value,
    tokens: Tokens,
    slot_token: Option<Value>,
    d: i64,
) -> Result<Value> {
    let (h, bb, t) = (s.h as i64, s.b as i64, s.t as i64);
    match tokens {
        Tokens::HeadFirst | Tokens::PackedHeadFirst => b.reshape(x, &[h, bb * t, d]),
        Tokens::BatchFirst => b.reshape(x, &[bb, t, h * d]),
        Tokens::PackedBatchFirst => b.reshape(x, &[1, bb * t, h * d]),
        Tokens::Lanes => {
            let x = lanes_first(b, s, x)?;
            kernel_tokens(b, s, x, slot_token)
        }
    }
}

/// The window tables of a packed kernel ([`super::forward::Window`]) from `slot_token`
/// (`[NT * 64]`, the packed token of each chunk row, `B * T` on padding rows): `lo hi off len`.
pub(super) fn window_tables(b: &mut FnBuilder, s: &KernelSpec, slot_token: Value) -> Result<[Value; 4]> {
    let (nt, c, p) = (s.chunks() as i64, CHUNK as i64, (s.b * s.t) as i64);
    let blocks = p / c;
    let rows = b.reshape(slot_token, &[nt, c])?;
    let start = b.reduce_min(rows, &[1])?;
    let pad = b.constant_i32(p as i32, i32t(&[nt, c]))?;
    let real = b.compare(Cmp::Lt, rows, pad)?;
    let one = b.constant_i32(1, i32t(&[nt, c]))?;
    let zero = b.constant_i32(0, i32t(&[nt, c]))?;
    let real = b.select(real, one, zero)?;
    let len = b.reduce_sum(real, &[1])?;
    let scalar = |b: &mut FnBuilder, v: i64| -> Result<Value> {
        let x = b.constant_i32(v as i32, i32t(&[]))?;
        b.broadcast_in_dim(x, &[nt], &[])
    };
    let (cv, last) = (scalar(b, c)?, scalar(b, blocks - 1)?);
    let block = b.div(start, cv)?;
    let lo = b.min(block, last)?;
    let one = scalar(b, 1)?;
    let next = b.add(lo, one)?;
    let hi = b.min(next, last)?;
    let base = b.mul(lo, cv)?;
    let off = b.sub(start, base)?;
    let off = b.min(off, cv)?;
    Ok([lo, hi, off, len])
}

/// The kernel's gate parameters `[H, 2, K]`: `exp(a_log)` on every channel, then `dt_bias`.
pub(super) fn gate_operand(
    b: &mut FnBuilder,
    s: &KernelSpec,
    a_log: Value,
    dt_bias: Option<Value>,
) -> Result<Value> {
    let (h, k) = (s.h as i64, s.k as i64);
    let a = b.exp(a_log)?;
    let a = b.broadcast_in_dim(a, &[h, 1, k], &[0])?;
    let bias = match dt_bias {
        Some(d) => b.reshape(d, &[h, 1, k])?,
        None => splat(b, 0.0, &[h, 1, k])?,
    };
    b.concatenate(&[a, bias], 1)
}

/// The kernel's per-token inputs `q k v g beta` as `tokens` reads them, with the dtype of `g`
/// (the raw gate, or for lanes the gate XLA activated).
pub(super) fn token_inputs(
    b: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    tokens: Tokens,
) -> Result<(Vec<Value>, kda_core::DType)> {
    let mut ops = Vec::new();
    for (t, d) in [(a.q, s.k), (a.k, s.k), (a.v, s.v)] {
        ops.push(kernel_input(b, s, t, tokens, a.slot_token, d as i64)?);
    }
    // Lanes get the gate XLA activated ([`kernel_gate`]).
    let g = match (tokens, a.a_log) {
        (Tokens::Lanes, Some(al)) => {
            let gx = prep::head_first(b, s, a.g)?;
            let p = prep::gate_params(b, s, al, a.dt_bias, gx.dims())?;
            let g = prep::activate(b, s, gx, Some(&p))?;
            kernel_tokens(b, s, g, a.slot_token)?
        }
        _ => kernel_input(b, s, a.g, tokens, a.slot_token, s.k as i64)?,
    };
    let g_dtype = g.elem();
    ops.push(g);
    let mut beta_dims: Vec<i64> = s.layout.scalar_shape(s.h, s.b, s.t).iter().map(|&d| d as i64).collect();
    beta_dims.push(1);
    let beta = b.reshape(a.beta, &beta_dims)?;
    ops.push(match tokens {
        // Batch-first rows read in place: beta as the programs take it, `[B*T, H]`.
        Tokens::BatchFirst => b.reshape(beta, &[(s.b * s.t) as i64, s.h as i64])?,
        Tokens::Lanes => {
            let beta = lanes_first(b, s, beta)?;
            kernel_tokens(b, s, beta, a.slot_token)?
        }
        _ => {
            let beta = lanes_first(b, s, beta)?;
            b.reshape(beta, &[s.h as i64, (s.b * s.t) as i64, 1])?
        }
    });
    Ok((ops, g_dtype))
}

/// Whether results of `width` lanes per packed token fit [`KernelSpec::packed_result_bytes`].
pub(super) fn packed_fits(s: &KernelSpec, width: usize) -> bool {
    2 * 4 * s.b * s.t * width <= s.packed_result_bytes
}

/// A packed program's `token_slot` (the chunk row of each packed token; padding tokens point
/// past the last row).
pub(super) fn packed_slots(a: &Args) -> Result<Value> {
    a.token_slot
        .ok_or_else(|| crate::TpuError::builder("mosaic kernels", "a packed program without token_slot"))
}

/// A kernel's packed result (f32, tokens along axis 1: `[H, P, w]` or batch-first
/// `[1, P, H * w]`) with its padding tokens, which no chunk writes, zeroed, in `dtype`.
pub(super) fn packed_result(
    b: &mut FnBuilder,
    s: &KernelSpec,
    y: Value,
    token_slot: Value,
    dtype: kda_core::DType,
) -> Result<Value> {
    let pad = b.constant_i32((s.chunks() * CHUNK) as i32, i32t(&[]))?;
    let pad = b.broadcast_in_dim(pad, token_slot.dims(), &[])?;
    let real = b.compare(Cmp::Lt, token_slot, pad)?;
    let keep = b.broadcast_in_dim(real, y.dims(), &[1])?;
    let zero = b.constant_f32(0.0, crate::hlo::TensorType::new(y.elem(), y.dims()))?;
    let y = b.select(keep, y, zero)?;
    if y.elem() == dtype {
        Ok(y)
    } else {
        b.convert(y, dtype)
    }
}

/// The kernels' dims of `s` read as `tokens` with `g` in `g_dtype` (one chunk a step, no state
/// operands or results: the caller sets those).
pub(super) fn kernel_dims(s: &KernelSpec, tokens: Tokens, g_dtype: kda_core::DType) -> ForwardDims {
    let x = on_device(s.dtype);
    ForwardDims {
        heads: s.h as i64,
        rows: (s.lanes() / s.h) as i64,
        chunks: s.chunks() as i64,
        slots: s.slots() as i64,
        k: s.k as i64,
        v: s.v as i64,
        qk: x,
        g: g_dtype,
        dtype: x,
        tokens,
        packed_tokens: (s.b * s.t) as i64,
        l2norm: s.l2norm,
        gate: kernel_gate(s, tokens),
        gate_params: s.in_kernel_gate(),
        h0: false,
        ht: false,
        states: false,
        terms: false,
        step_chunks: 1,
    }
}

/// The gate the kernel applies: the caller's when it reads raw gates in place (lanes hold
/// padding tokens, whose zero raw gate would activate to a decay, so lanes get the gate XLA
/// activated, zero on padding, as the XLA programs have it).
pub(super) fn kernel_gate(s: &KernelSpec, tokens: Tokens) -> Gate {
    match (tokens != Tokens::Lanes && s.in_kernel_gate(), s.gate) {
        (false, _) | (_, GateKind::Preactivated) => Gate::Preactivated,
        (true, GateKind::Softplus) => Gate::Softplus,
        (true, GateKind::LowerBound(lb)) => Gate::LowerBound(lb),
    }
}

/// The chunk terms' constant masks ([`super::blocks::term_masks_kernel`]'s results)
/// and how the program's kernels are lowered: what every kernel call of a program shares.
pub(super) struct KernelCalls {
    /// How the kernels are lowered.
    pub lowering: Lowering,
    /// The exponent and level masks, then (transposed) the exponent masks' transposes.
    pub masks: Vec<Value>,
}

/// Which kernels of a program read the chunk terms' masks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MaskReaders {
    /// The forward kernel alone.
    Forward,
    /// The forward and backward kernels: the exponent masks' transposes too.
    ForwardAndBackward,
}

/// The masks for the kernels of `s`, made once by their own one-step kernel; for the backward
/// kernel also the exponent masks' transposes (a program with both kernels makes them once and
/// hands the first two to the forward kernel).
pub(super) fn kernel_calls(
    b: &mut FnBuilder,
    s: &KernelSpec,
    readers: MaskReaders,
    lowering: Lowering,
) -> Result<KernelCalls> {
    // The masks' dtype follows the kernels' products, whatever the gate's dtype.
    let dtype = kernel_dims(s, tokens_of(s), on_device(s.dtype)).mask_dtype();
    let transposed = readers == MaskReaders::ForwardAndBackward;
    let kernel = super::blocks::term_masks_kernel(dtype, transposed)?;
    let masks = match lowering {
        Lowering::Mosaic => kernel.call_mosaic(b, &[])?,
        Lowering::Interpret => kernel.call_interpret(b, &[])?,
    };
    Ok(KernelCalls { lowering, masks })
}

/// What a forward body keeps besides `o [final_state]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Kept {
    /// `h`, the state entering every chunk.
    pub states: bool,
    /// The chunk terms `a aqk` the backward kernel reads.
    pub terms: bool,
}

/// The forward body: `o [final_state]` as the op's signature says (`o` in the kernel forms),
/// then what `kept` names: `h`, then the chunk terms `a aqk`; the chunk loop in the forward
/// kernel, lowered and fed masks as `calls` says.
pub(super) fn forward_body(
    b: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    kept: Kept,
    calls: &KernelCalls,
) -> Result<Vec<Value>> {
    let Kept { states: keep_h, terms } = kept;
    let lowering = calls.lowering;
    let x = on_device(s.dtype);
    let tokens = tokens_of(s);
    let mut ops = vec![a.tables.first, a.tables.last, kernel_slots(b, s, a.tables.slot)?];
    if tokens.packed() {
        let slot_token = a.slot_token.ok_or_else(|| {
            crate::TpuError::builder("mosaic forward", "a packed program without slot_token")
        })?;
        ops.extend(window_tables(b, s, slot_token)?);
    }
    let (inputs, g_dtype) = token_inputs(b, s, a, tokens)?;
    ops.extend(inputs);
    // A packed kernel reads every per-token input through a window of two blocks: each operand
    // twice.
    if tokens.packed() {
        let singles = ops.split_off(ops.len() - 5);
        for x in singles {
            ops.extend([x, x]);
        }
    }
    let gate = kernel_gate(s, tokens);
    if let (true, Some(al)) = (gate != Gate::Preactivated, a.a_log) {
        ops.push(gate_operand(b, s, al, a.dt_bias)?);
    }
    let h0 = match a.h0 {
        Some(h0) => Some(prep::state_table(b, s, h0)?),
        None => None,
    };
    ops.extend(h0);
    let dims = ForwardDims {
        h0: h0.is_some(),
        ht: s.final_state,
        states: keep_h,
        terms,
        ..kernel_dims(s, tokens, g_dtype)
    };
    let wish = match s.step_chunks {
        0 => dims.default_step_chunks(),
        n => n as i64,
    };
    let dims = ForwardDims { step_chunks: dims.steps_for(wish), ..dims };
    // The chunk terms' constant masks: the exponent and level masks of the masks kernel.
    ops.extend(calls.masks.iter().take(2).copied());
    let kernel = forward_kernel(dims, s.scale)?;
    let outs = match lowering {
        Lowering::Mosaic => kernel.call_mosaic(b, &ops)?,
        Lowering::Interpret => kernel.call_interpret(b, &ops)?,
    };
    let o = match tokens {
        Tokens::PackedHeadFirst | Tokens::PackedBatchFirst => {
            let slots = packed_slots(a)?;
            let o = packed_result(b, s, outs[0], slots, x)?;
            b.reshape(o, &s.result_token_dims(s.v, true))?
        }
        Tokens::Lanes => {
            let (l, nt) = (s.lanes() as i64, s.chunks() as i64);
            let o = b.reshape(outs[0], &[l, nt, CHUNK as i64, s.v as i64])?;
            let o = prep::from_chunks(b, s, o, a.token_slot)?;
            let o = prep::to_caller(b, s, o, x)?;
            b.reshape(o, &s.result_token_dims(s.v, true))?
        }
        // Already in the caller's layout: the result's form is a reshape.
        _ => b.reshape(outs[0], &s.result_token_dims(s.v, true))?,
    };
    let mut results = vec![o];
    if s.final_state {
        let fin = or_passed(b, s, &a.tables, outs[1], h0)?;
        results.push(prep::state_from_table(b, s, fin)?);
    }
    let at_h = 1 + usize::from(s.final_state);
    if keep_h {
        results.push(outs[at_h]);
    }
    if terms {
        let at = at_h + usize::from(keep_h);
        results.extend([outs[at], outs[at + 1]]);
    }
    Ok(results)
}

/// The forward on the kernels: `o [final_state] [h]`.
pub(in crate::op) fn forward(
    f: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    keep_h: bool,
    lowering: Lowering,
) -> Result<Vec<Value>> {
    let calls = kernel_calls(f, s, MaskReaders::Forward, lowering)?;
    let kept = Kept { states: keep_h, terms: false };
    forward_body(f, s, a, kept, &calls)
}
