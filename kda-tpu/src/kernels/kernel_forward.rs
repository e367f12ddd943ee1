//! The forward program around the Mosaic forward kernel ([`crate::mosaic::forward`]): the same
//! signature as the XLA forward, so the backend, the compile cache and the backward read it
//! unchanged. Around the kernel, in XLA: the caller's layout to lanes, the q/k L2 norm, the gate
//! activation and floor, segment loading (packed tokens to chunk-aligned work), the chunk tables
//! as the kernel reads them; after it, the outputs back to the caller's layout and the final
//! states of segments that hold no chunk.
//!
//! The gate and the norm run around the kernel, not in it: XLA fuses them into the layout and
//! segment-loading pass it makes anyway, and the saved-state backward re-forms them from the
//! inputs, so the kernel reads the activated gate once (f32) and nothing else is kept.

use super::ops::{i32t, splat};
use super::prep;
use super::programs::{state_tab, Args, GATE_FLOOR};
use super::spec::{on_device, KernelSpec, CHUNK};
use crate::hlo::{Cmp, FnBuilder, Value};
use crate::mosaic::forward::{forward_kernel, ForwardDims};
use crate::mosaic::Lowering;
use crate::Result;
use kda_core::{DType, Layout};

/// A per-token tensor in the caller's layout to head-first `[H, B, T, D]`, in its own dtype.
fn lanes_first(b: &mut FnBuilder, s: &KernelSpec, x: Value) -> Result<Value> {
    match s.layout {
        Layout::HeadFirst => Ok(x),
        Layout::BatchFirst => b.transpose(x, &[2, 0, 1, 3]),
    }
}

/// Head-first `[H, B, T, D]` to the kernel's `[L, NT * 64, D]` (packed: gathered by `slot_token`).
fn kernel_tokens(b: &mut FnBuilder, s: &KernelSpec, x: Value, slot_token: Option<Value>) -> Result<Value> {
    let d = x.dims()[3];
    let c = prep::to_chunks(b, s, x, slot_token)?;
    b.reshape(c, &[s.lanes() as i64, (s.chunks() * CHUNK) as i64, d])
}

/// `slot` with every entry raised to the largest before it: the real chunks' slots never
/// decrease, and the padding chunks after them (slot 0 in the tables) then keep the last
/// segment's slot, so the kernel's `ht` block is never revisited.
fn running_max(b: &mut FnBuilder, slot: Value) -> Result<Value> {
    let n = slot.dims()[0];
    let at = b.iota(i32t(&[n, n]), 0)?;
    let before = b.iota(i32t(&[n, n]), 1)?;
    let seen = b.compare(Cmp::Le, before, at)?;
    let wide = b.broadcast_in_dim(slot, &[n, n], &[1])?;
    let zero = b.constant_i32(0, i32t(&[n, n]))?;
    let kept = b.select(seen, wide, zero)?;
    b.reduce_max(kept, &[1])
}

/// `[S]` i1: whether a chunk ends a segment of each state slot (the kernel writes `ht` there;
/// an empty segment's final state is its initial one).
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

/// The forward body: `o [final_state] [h]` as [`super::ProgramSignature`] says, the chunk
/// loop in the forward kernel lowered as `lowering`.
pub(super) fn forward_body(
    b: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    keep_h: bool,
    lowering: Lowering,
) -> Result<Vec<Value>> {
    let x = on_device(s.dtype);
    let (q, k, qk) = if s.l2norm {
        let q = prep::head_first(b, s, a.q)?;
        let k = prep::head_first(b, s, a.k)?;
        (prep::l2_normalise(b, q)?.0, prep::l2_normalise(b, k)?.0, DType::F32)
    } else {
        (lanes_first(b, s, a.q)?, lanes_first(b, s, a.k)?, x)
    };
    let v = lanes_first(b, s, a.v)?;
    let gx = prep::head_first(b, s, a.g)?;
    let gate = match a.a_log {
        Some(al) => Some(prep::gate_params(b, s, al, a.dt_bias, gx.dims())?),
        None => None,
    };
    let g = prep::activate(b, s, gx, gate.as_ref())?;
    let floor = splat(b, GATE_FLOOR, g.dims())?;
    let g = b.max(g, floor)?;
    let mut beta_dims: Vec<i64> = s.layout.scalar_shape(s.h, s.b, s.t).iter().map(|&d| d as i64).collect();
    beta_dims.push(1);
    let beta = b.reshape(a.beta, &beta_dims)?;
    let beta = lanes_first(b, s, beta)?;
    let mut ops = vec![a.tables.first, a.tables.last, running_max(b, a.tables.slot)?];
    for t in [q, k, v, g, beta] {
        ops.push(kernel_tokens(b, s, t, a.slot_token)?);
    }
    let h0 = match a.h0 {
        Some(h0) => Some(prep::state_table(b, s, h0)?),
        None => None,
    };
    ops.extend(h0);
    let dims = ForwardDims {
        lanes: s.lanes() as i64,
        chunks: s.chunks() as i64,
        slots: s.slots() as i64,
        k: s.k as i64,
        v: s.v as i64,
        qk,
        dtype: x,
        h0: h0.is_some(),
        ht: s.final_state,
        states: keep_h,
    };
    let kernel = forward_kernel(dims, s.scale)?;
    let outs = match lowering {
        Lowering::Mosaic => kernel.call_mosaic(b, &ops)?,
        Lowering::Interpret => kernel.call_interpret(b, &ops)?,
    };
    let (l, nt) = (s.lanes() as i64, s.chunks() as i64);
    let o = b.reshape(outs[0], &[l, nt, CHUNK as i64, s.v as i64])?;
    let o = prep::from_chunks(b, s, o, a.token_slot)?;
    let mut results = vec![prep::to_caller(b, s, o, x)?];
    if s.final_state {
        let ht = outs[1];
        let start = match h0 {
            Some(h0) => h0,
            None => state_tab(b, s, None)?,
        };
        let ended = ended(b, s, a.tables.last, a.tables.slot)?;
        let ended = b.broadcast_in_dim(ended, ht.dims(), &[1])?;
        let fin = b.select(ended, ht, start)?;
        results.push(prep::state_from_table(b, s, fin)?);
    }
    if keep_h {
        results.push(outs[outs.len() - 1]);
    }
    Ok(results)
}
