//! The backward and fused forward+VJP programs around the Mosaic kernels: the same signatures
//! as XLA's. The backward kernel ([`mod@super::backward`]) reads the states the forward
//! kernel saved (`h`: the saved-state backward's argument, or in the rematerialized backward
//! and the fused program the forward kernel's result in the same executable) and the caller's
//! tensors in place (fixed-length rows of whole chunks; packed rows of whole 64-token blocks,
//! each gradient written straight to its packed tokens), or lanes that XLA makes (other
//! lengths, and packed rows too long for a head's gradients to stay in VMEM: gathered into
//! chunk-aligned work, the gradients gathered straight back to their packed tokens). It applies
//! the floor, the gate and the L2 norm to the gradients itself when it reads raw inputs in
//! place; for lanes XLA takes `dg` through the gate.

use super::backward::{backward_kernel, BackwardSteps};
use super::dims::{KernelDims, Tokens};
use super::forward_program::{
    forward_body, kernel_calls, kernel_dims, kernel_input, or_passed, packed_fits, packed_result,
    packed_slots, tokens_of, with_steps, Kept, KernelCalls, MaskReaders, SharedInputs,
};
use crate::hlo::{FnBuilder, Value};
use crate::lang::Lower;
use crate::op::args::Args;
use crate::op::prep;
use crate::op::spec::{on_device, ProgramSpec, CHUNK};
use crate::Result;

/// How the backward kernel reads tokens: as the forward kernel does, packed tokens in place
/// while a head's gradients fit [`TpuKernelConfig::packed_result_bytes`](crate::op::TpuKernelConfig::packed_result_bytes),
/// else through lanes (XLA gathers the inputs and compacts the
/// gradients).
fn backward_tokens(s: &ProgramSpec) -> Tokens {
    match tokens_of(s) {
        Tokens::PackedHeadFirst | Tokens::PackedBatchFirst
            if !packed_fits(s, 3 * s.dims.k + s.dims.v + 1) =>
        {
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
    s: &ProgramSpec,
    a: &Args,
    (h, terms): (Value, Option<(Value, Value)>),
    (d_o, dht): (Value, Option<Value>),
    calls: &KernelCalls,
) -> Result<Vec<Value>> {
    let x = on_device(s.options.dtype);
    let tokens = backward_tokens(s);
    let shared = SharedInputs::new(b, s, a, tokens, "mosaic backward")?;
    let d_o = kernel_input(b, s, d_o, tokens, a.slot_token, s.dims.v as i64)?;
    let dht_tab = match dht {
        Some(d) => Some(prep::state_table(b, s, d)?),
        None => None,
    };
    let dims = kernel_dims(s, tokens, shared.g_dtype);
    // States from the same program's forward kernel (with its chunk terms) come at the kernel's
    // own chunks; a saved-state backward's `h` at the signature's.
    let saved_chunks = if terms.is_some() { dims.chunks } else { dims.saved_chunks };
    let dims = KernelDims {
        h0: s.options.has_h0,
        ht: dht_tab.is_some(),
        states: true,
        terms: terms.is_some(),
        saved_chunks,
        ..dims
    };
    let cap = BackwardSteps::for_precision(dims.precision()).chunks;
    let bk = backward_kernel(with_steps(dims, s, Some(cap)), s.options.scale)?;
    let r = &bk.refs;
    let mut args = bk.kernel.bindings();
    shared.bind(&mut args, &r.tabs, &r.tokens, r.gate)?;
    args.input(r.h, h)?;
    if let (Some([ra, raqk]), Some((va, vaqk))) = (r.terms, terms) {
        args.input(ra, va)?;
        args.input(raqk, vaqk)?;
    }
    r.d_o.bind(&mut args, d_o)?;
    if let (Some(input), Some(value)) = (r.dht, dht_tab) {
        args.input(input, value)?;
    }
    let exponents_t = calls
        .exponents_t
        .ok_or_else(|| crate::TpuError::builder("mosaic backward", "masks made without their transposes"))?;
    for (input, value) in r.masks.into_iter().zip([calls.exponents, calls.levels, exponents_t]) {
        args.input(input, value)?;
    }
    let outs = bk.kernel.call(b, calls.lowering, args)?;
    let g = &r.grads;
    let grads = [outs.get(g.q)?, outs.get(g.k)?, outs.get(g.v)?, outs.get(g.g)?, outs.get(g.beta)?];
    let mut results = Vec::new();
    let mut gate_grads = Vec::new();
    if tokens == Tokens::Lanes {
        lane_grads(b, s, a, grads, &mut results, &mut gate_grads)?;
    } else {
        // In place, or (packed) the head's tokens in f32, padding tokens (which no chunk
        // writes) zeroed here.
        let dtypes = [x, x, x, on_device(s.options.g_dtype), x];
        let mut cast = Vec::new();
        for (y, t) in grads.into_iter().zip(dtypes) {
            cast.push(if tokens.packed() {
                packed_result(b, s, y, packed_slots(a)?, t)?
            } else if y.elem() == t {
                y
            } else {
                b.convert(y, t)?
            });
        }
        for (i, w) in [(0, s.dims.k), (1, s.dims.k), (2, s.dims.v), (3, s.dims.k)] {
            results.push(b.reshape(cast[i], &s.result_token_dims(w, true))?);
        }
        // `dbeta` `[L, NT, 64]` (f32): the elements of `[H, B, T]` in order.
        let (h, bb, t) = (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64);
        let dbeta = b.reshape(cast[4], &[h, bb, t, 1])?;
        results.push(prep::beta_to_caller(b, s, dbeta, x)?);
        if let Some(sums) = r.gate_sums {
            // Per-lane sums `[L, 2, K]`: `da_log` over a head's lanes and channels, `ddt_bias`
            // over its lanes.
            let sums = outs.get(sums)?;
            let rows = s.lanes() / s.dims.h;
            let sums = b.reshape(sums, &[h, rows as i64, 2, s.dims.k as i64])?;
            let da = b.slice_axis(sums, 2, 0, 1)?;
            gate_grads.push(b.reduce_sum(da, &[1, 2, 3])?);
            if s.options.has_dt_bias {
                let dd = b.slice_axis(sums, 2, 1, 2)?;
                let dd = b.reduce_sum(dd, &[1, 2])?;
                gate_grads.push(b.reshape(dd, &[(s.dims.h * s.dims.k) as i64])?);
            }
        }
    }
    if let Some(dh0) = r.dh0 {
        let dh0 = or_passed(b, s, &a.tables, outs.get(dh0)?, dht_tab)?;
        results.push(prep::state_from_table(b, s, dh0)?);
    }
    results.extend(gate_grads);
    Ok(results)
}

/// The gradients of a kernel on lanes (`[L * NT * 64, D]`) back to the caller's tokens, layout
/// and dtypes, through the gate XLA activated: onto `results`, the gate-parameter gradients onto
/// `gate_grads`.
fn lane_grads(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    grads: [Value; 5],
    results: &mut Vec<Value>,
    gate_grads: &mut Vec<Value>,
) -> Result<()> {
    let x = on_device(s.options.dtype);
    let (l, nt, c) = (s.lanes() as i64, s.chunks() as i64, CHUNK as i64);
    let tok = |b: &mut FnBuilder, y: Value, d: i64| -> Result<Value> {
        let y = b.reshape(y, &[l, nt, c, d])?;
        prep::from_chunks(b, s, y, a.token_slot)
    };
    let (k, v) = (s.dims.k as i64, s.dims.v as i64);
    // `dbeta` comes a chunk's tokens a row, `[L, NT, 64]` f32.
    let (dq, dk, dv, mut dg, dbeta) = (
        tok(b, grads[0], k)?,
        tok(b, grads[1], k)?,
        tok(b, grads[2], v)?,
        tok(b, grads[3], k)?,
        tok(b, grads[4], 1)?,
    );
    if let Some(al) = a.a_log {
        // Through the gate XLA activated.
        let gx = prep::head_first(b, s, a.g)?;
        let p = prep::gate_params(b, s, al, a.dt_bias, gx.dims())?;
        let g = prep::activate(b, s, gx, Some(&p))?;
        let (dx, da_log, ddt) = prep::gate_backward(b, s, gx, g, dg, &p)?;
        dg = dx;
        gate_grads.push(da_log);
        if s.options.has_dt_bias {
            gate_grads.push(ddt);
        }
    }
    for (y, w) in [(dq, s.dims.k), (dk, s.dims.k), (dv, s.dims.v)] {
        let y = prep::to_caller(b, s, y, x)?;
        results.push(b.reshape(y, &s.result_token_dims(w, true))?);
    }
    let dg = prep::to_caller(b, s, dg, on_device(s.options.g_dtype))?;
    results.push(b.reshape(dg, &s.result_token_dims(s.dims.k, true))?);
    results.push(prep::beta_to_caller(b, s, dbeta, x)?);
    Ok(())
}

/// The fused forward+VJP on the kernels: the forward kernel keeping its states and chunk
/// terms, the backward kernel reading them; `o [final_state]` then the gradients.
pub(in crate::op) fn fused(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    cotangents: (Value, Option<Value>),
    lowering: &dyn Lower,
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
    s: &ProgramSpec,
    a: &Args,
    saved: Option<Value>,
    cotangents: (Value, Option<Value>),
    lowering: &dyn Lower,
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
