//! The backward and fused forward+VJP programs around the Mosaic kernels: the same signatures
//! as XLA's. The backward kernel ([`crate::lang::backward`]) reads the states the forward
//! kernel saved (`h`: the saved-state backward's argument, or in the rematerialized backward
//! and the fused program the forward kernel's result in the same executable) and the caller's
//! tensors in place (fixed-length rows of whole chunks; packed rows of whole 64-token blocks,
//! each gradient written straight to its packed tokens), or lanes that XLA makes (other
//! lengths, and packed rows too long for a head's gradients to stay in VMEM: gathered into
//! chunk-aligned work, the gradients gathered straight back to their packed tokens). It applies
//! the floor, the gate and the L2 norm to the gradients itself when it reads raw inputs in
//! place; for lanes XLA takes `dg` through the gate.

use super::backward::backward_kernel;
use super::forward::{ForwardDims, Gate, Tokens};
use super::forward_program::{
    forward_body, gate_operand, kernel_calls, kernel_dims, kernel_gate, kernel_input, kernel_slots,
    or_passed, packed_fits, packed_result, packed_slots, token_inputs, tokens_of, window_tables, Kept,
    KernelCalls, MaskReaders,
};
use crate::hlo::{FnBuilder, Value};
use crate::lang::Lowering;
use crate::op::args::Args;
use crate::op::prep;
use crate::op::spec::{on_device, KernelSpec, CHUNK};
use crate::Result;

/// How the backward kernel reads tokens: as the forward kernel does, packed tokens in place
/// while a head's gradients fit [`KernelSpec::packed_result_bytes`] (4.2 MB at the
/// primary shape's 1024 tokens), else through lanes (XLA gathers the inputs and compacts the
/// gradients).
fn backward_tokens(s: &KernelSpec) -> Tokens {
    match tokens_of(s) {
        Tokens::PackedHeadFirst | Tokens::PackedBatchFirst if !packed_fits(s, 3 * s.k + s.v + 1) => {
            Tokens::Lanes
        }
        t => t,
    }
}

/// The gradients `dq dk dv dg dbeta [dh0] [da_log] [ddt_bias]` (caller layouts and dtypes)
/// of the backward kernel lowered as `lowering`, from the states `h` `[L, NT, K, V]` the
/// forward kernel saved, `do` and `dht`.
pub(super) fn grads(
    b: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    (h, terms): (Value, Option<(Value, Value)>),
    (d_o, dht): (Value, Option<Value>),
    calls: &KernelCalls,
) -> Result<Vec<Value>> {
    let lowering = calls.lowering;
    let x = on_device(s.dtype);
    let tokens = backward_tokens(s);
    let gate = kernel_gate(s, tokens);
    let mut ops = vec![a.tables.first, a.tables.last, kernel_slots(b, s, a.tables.slot)?];
    if tokens.packed() {
        let slot_token = a.slot_token.ok_or_else(|| {
            crate::TpuError::builder("mosaic backward", "a packed program without slot_token")
        })?;
        ops.extend(window_tables(b, s, slot_token)?);
    }
    // A packed kernel reads every per-token input through a window of two blocks: each operand
    // twice.
    let twice = |x: Vec<Value>| -> Vec<Value> {
        match tokens.packed() {
            true => x.into_iter().flat_map(|v| [v, v]).collect(),
            false => x,
        }
    };
    let (inputs, g_dtype) = token_inputs(b, s, a, tokens)?;
    ops.extend(twice(inputs));
    if let (true, Some(al)) = (gate != Gate::Preactivated, a.a_log) {
        ops.push(gate_operand(b, s, al, a.dt_bias)?);
    }
    ops.push(h);
    if let Some((at, aqk)) = terms {
        ops.extend([at, aqk]);
    }
    ops.extend(twice(vec![kernel_input(b, s, d_o, tokens, a.slot_token, s.v as i64)?]));
    let dht_tab = match dht {
        Some(d) => Some(prep::state_table(b, s, d)?),
        None => None,
    };
    ops.extend(dht_tab);
    let dims = ForwardDims {
        h0: s.has_h0,
        ht: dht_tab.is_some(),
        states: true,
        terms: terms.is_some(),
        ..kernel_dims(s, tokens, g_dtype)
    };
    let wish = match s.step_chunks {
        0 => dims.default_step_chunks().min(super::backward::BACKWARD_STEP_CHUNKS),
        n => n as i64,
    };
    let dims = ForwardDims { step_chunks: dims.steps_for(wish), ..dims };
    ops.extend(calls.masks.iter().copied());
    let kernel = backward_kernel(dims, s.scale)?;
    let outs = match lowering {
        Lowering::Mosaic => kernel.call_mosaic(b, &ops)?,
        Lowering::Interpret => kernel.call_interpret(b, &ops)?,
    };
    let mut results = Vec::new();
    let mut gate_grads = Vec::new();
    if tokens == Tokens::Lanes {
        let (l, nt, c) = (s.lanes() as i64, s.chunks() as i64, CHUNK as i64);
        let tok = |b: &mut FnBuilder, y: Value, d: i64| -> Result<Value> {
            let y = b.reshape(y, &[l, nt, c, d])?;
            prep::from_chunks(b, s, y, a.token_slot)
        };
        let (k, v) = (s.k as i64, s.v as i64);
        // `dbeta` comes a chunk's tokens a row, `[L, NT, 64]` f32.
        let (dq, dk, dv, mut dg, dbeta) = (
            tok(b, outs[0], k)?,
            tok(b, outs[1], k)?,
            tok(b, outs[2], v)?,
            tok(b, outs[3], k)?,
            tok(b, outs[4], 1)?,
        );
        if let Some(al) = a.a_log {
            // Through the gate XLA activated.
            let gx = prep::head_first(b, s, a.g)?;
            let p = prep::gate_params(b, s, al, a.dt_bias, gx.dims())?;
            let g = prep::activate(b, s, gx, Some(&p))?;
            let (dx, da_log, ddt) = prep::gate_backward(b, s, gx, g, dg, &p)?;
            dg = dx;
            gate_grads.push(da_log);
            if s.has_dt_bias {
                gate_grads.push(ddt);
            }
        }
        for (y, w) in [(dq, s.k), (dk, s.k), (dv, s.v)] {
            let y = prep::to_caller(b, s, y, x)?;
            results.push(b.reshape(y, &s.result_token_dims(w, true))?);
        }
        let dg = prep::to_caller(b, s, dg, on_device(s.g_dtype))?;
        results.push(b.reshape(dg, &s.result_token_dims(s.k, true))?);
        results.push(prep::beta_to_caller(b, s, dbeta, x)?);
    } else {
        // In place, or (packed) the head's tokens in f32, padding tokens (which no chunk
        // writes) zeroed here.
        let dtypes = [x, x, x, on_device(s.g_dtype), x];
        let mut cast = Vec::new();
        for (&y, t) in outs.iter().zip(dtypes) {
            cast.push(if tokens.packed() {
                packed_result(b, s, y, packed_slots(a)?, t)?
            } else if y.elem() == t {
                y
            } else {
                b.convert(y, t)?
            });
        }
        let outs: Vec<Value> = cast.into_iter().chain(outs[5..].iter().copied()).collect();
        for (i, w) in [(0, s.k), (1, s.k), (2, s.v), (3, s.k)] {
            results.push(b.reshape(outs[i], &s.result_token_dims(w, true))?);
        }
        // `dbeta` `[L, NT, 64]` (f32): the elements of `[H, B, T]` in order.
        let (h, bb, t) = (s.h as i64, s.b as i64, s.t as i64);
        let dbeta = b.reshape(outs[4], &[h, bb, t, 1])?;
        results.push(prep::beta_to_caller(b, s, dbeta, x)?);
        if gate != Gate::Preactivated {
            // Per-lane sums `[L, 2, K]`: `da_log` over a head's lanes and channels, `ddt_bias`
            // over its lanes.
            let sums = outs[5 + usize::from(s.has_h0)];
            let rows = s.lanes() / s.h;
            let sums = b.reshape(sums, &[h, rows as i64, 2, s.k as i64])?;
            let da = b.slice_axis(sums, 2, 0, 1)?;
            gate_grads.push(b.reduce_sum(da, &[1, 2, 3])?);
            if s.has_dt_bias {
                let dd = b.slice_axis(sums, 2, 1, 2)?;
                let dd = b.reduce_sum(dd, &[1, 2])?;
                gate_grads.push(b.reshape(dd, &[(s.h * s.k) as i64])?);
            }
        }
    }
    if s.has_h0 {
        let dh0 = or_passed(b, s, &a.tables, outs[5], dht_tab)?;
        results.push(prep::state_from_table(b, s, dh0)?);
    }
    results.extend(gate_grads);
    Ok(results)
}

/// The fused forward+VJP on the kernels: the forward kernel keeping its states and chunk
/// terms, the backward kernel reading them; `o [final_state]` then the gradients.
pub(in crate::op) fn fused(
    b: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    cotangents: (Value, Option<Value>),
    lowering: Lowering,
) -> Result<Vec<Value>> {
    let calls = kernel_calls(b, s, MaskReaders::ForwardAndBackward, lowering)?;
    let mut outs = forward_body(b, s, a, Kept { states: true, terms: true }, &calls)?;
    let saved = take_saved(&mut outs)?;
    outs.extend(grads(b, s, a, saved, cotangents, &calls)?);
    Ok(outs)
}

/// The states and chunk terms at the end of a forward body's results, taken off them.
fn take_saved(outs: &mut Vec<Value>) -> Result<(Value, Option<(Value, Value)>)> {
    match (outs.pop(), outs.pop(), outs.pop()) {
        (Some(aqk), Some(at), Some(h)) => Ok((h, Some((at, aqk)))),
        _ => Err(crate::TpuError::builder("mosaic backward", "internal: no states and terms")),
    }
}

/// The backward on the kernels: from the saved states `h`, or (rematerialized) from the states
/// and chunk terms the forward kernel recomputes in the same executable.
pub(in crate::op) fn backward(
    b: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    saved: Option<Value>,
    cotangents: (Value, Option<Value>),
    lowering: Lowering,
) -> Result<Vec<Value>> {
    let calls = kernel_calls(b, s, MaskReaders::ForwardAndBackward, lowering)?;
    let saved = match saved {
        Some(h) => (h, None),
        None => {
            let mut outs = forward_body(b, s, a, Kept { states: true, terms: true }, &calls)?;
            take_saved(&mut outs)?
        }
    };
    grads(b, s, a, saved, cotangents, &calls)
}
