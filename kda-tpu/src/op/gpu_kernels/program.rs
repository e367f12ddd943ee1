//! The programs of the GPU rows (`triton`, `triton-interpret`): the forward runs the GPU
//! kernels on the caller's batch-first rows in place (fixed length, whole chunks, widths the
//! kernels take), else on the inputs XLA lays out as aligned chunks (packed rows gathered by
//! `slot_token`, widths zero-padded); the backward runs the GPU backward kernels on lane-major
//! chunks (the factors from the chunk kernels, the states saved, re-run or the fused forward's),
//! and XLA takes the gradients through the gate floor, the L2 norm and the gate activation into
//! the caller's layout.

use kda_core::{BackwardStrategy, DType, Layout};

use super::intra_grad::call_intra_grad;
use super::norm_grad::call_norm_grad;
use super::state_grad::{call_state_grad, StateGradInputs};
use super::wy_grad::{call_wy_grad, WyGradInputs};
use super::{
    call_factors, call_recurrence, fixed_tables, FactorValues, ForwardInputs, ForwardShape, TokenLayout, C,
};
use crate::error::TpuError;
use crate::hlo::{Cmp, FnBuilder, TensorType, Value};
use crate::lang::{Kernel, Lower};
use crate::op::args::{state_tab, Args};
use crate::op::prep;
use crate::op::spec::{on_device, ProgramSpec};
use crate::op::tpu_kernels::forward_program::{
    gate_operand, kernel_slots, kernel_tokens, lanes_first, or_passed,
};
use crate::op::xla;
use crate::Result;

/// The kernels' dtype for inputs held in `dtype` on the device: bf16 stays, the rest is f32.
fn kernel_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 => DType::BF16,
        _ => DType::F32,
    }
}

/// A width as the kernels take it: the next power of two, at least 16 (the columns past the
/// caller's are zero: inert in every product, sliced off the results).
fn padded(d: usize) -> i64 {
    (d.max(16) as u64).next_power_of_two() as i64
}

/// `x` with its last axis zero-padded to `to`.
fn pad_last(f: &mut FnBuilder, x: Value, to: i64) -> Result<Value> {
    let dims = x.dims().to_vec();
    let n = dims.len();
    let extra = to - dims[n - 1];
    if extra == 0 {
        return Ok(x);
    }
    let zero = f.constant_f32(0.0, TensorType::scalar(x.elem()))?;
    let (lo, mut hi) = (vec![0; n], vec![0; n]);
    hi[n - 1] = extra;
    f.pad(x, zero, &lo, &hi, &vec![0; n])
}

/// `x` with axis `axis` cut to its first `to`.
fn cut(f: &mut FnBuilder, x: Value, axis: usize, to: usize) -> Result<Value> {
    match x.dims()[axis] == to as i64 {
        true => Ok(x),
        false => f.slice_axis(x, axis, 0, to as i64),
    }
}

/// The forward kernels' shape for `s` (widths padded).
fn shape(s: &ProgramSpec, dtype: DType, keep_h: bool) -> ForwardShape {
    let base = ForwardShape::new(
        s.lanes() as i64,
        (s.chunks() * C as usize) as i64,
        padded(s.dims.k),
        padded(s.dims.v),
        dtype,
    );
    ForwardShape {
        gate: s.options.gate,
        l2norm: s.options.l2norm,
        scale: s.options.scale,
        slots: s.slots() as i64,
        segmented: s.packed_chunks.is_some(),
        h0: s.options.has_h0,
        keep_h,
        ..base
    }
}

/// A per-token input in the caller's layout as the kernels' `[L, NT * 64, D]` in `dtype`, `D`
/// padded.
fn tokens(f: &mut FnBuilder, s: &ProgramSpec, a: &Args, x: Value, dtype: DType) -> Result<Value> {
    let x = if x.elem() == dtype { x } else { f.convert(x, dtype)? };
    let x = lanes_first(f, s, x)?;
    let x = kernel_tokens(f, s, x, a.slot_token)?;
    let d = *x.dims().last().unwrap_or(&1);
    pad_last(f, x, padded(d as usize))
}

/// The forward kernels of `s`'s GPU rows ([`super::forward_kernels`]), as its forward program
/// builds them (`keep_h`: the recurrence writes every chunk's entering state), inputs held in
/// `dtype` on the device.
pub(in crate::op) fn forward_kernels(s: &ProgramSpec, dtype: DType, keep_h: bool) -> Result<Vec<Kernel>> {
    let g_dtype = kernel_dtype(crate::op::spec::on_device(s.options.g_dtype));
    let sh = ForwardShape { g_dtype, ..placed(s, shape(s, kernel_dtype(dtype), keep_h)) };
    sh.check()?;
    super::forward_kernels(&sh)
}

/// The backward kernels of `s`'s GPU rows (state gradient, WY gradient, intra gradient, with the
/// L2 norm its gradient), inputs
/// held in `dtype` on the device; `dht` is read when the forward returns final states.
pub(in crate::op) fn backward_kernels(s: &ProgramSpec, dtype: DType) -> Result<Vec<Kernel>> {
    let sh = placed(s, shape(s, kernel_dtype(dtype), false));
    sh.check()?;
    let mut kernels = vec![
        super::state_grad::state_grad_kernel(&sh, s.options.final_state)?.0,
        super::wy_grad::wy_grad_kernel(&sh)?.0,
        super::intra_grad::intra_grad_kernel(&sh)?.0,
    ];
    if sh.l2norm {
        kernels.push(super::norm_grad::norm_grad_kernel(&sh)?.0);
    }
    Ok(kernels)
}

/// Tokens per chunk position `[NT]`: from `slot_token` for packed rows (a padding slot points
/// past the tokens), else 64 but the last chunk's remainder.
fn valid(f: &mut FnBuilder, s: &ProgramSpec, a: &Args) -> Result<Value> {
    let nt = s.chunks() as i64;
    let Some(st) = a.slot_token else {
        let [valid, ..] = fixed_tables(f, s.dims.t as i64, nt)?;
        return Ok(valid);
    };
    let ty = TensorType::new(DType::I32, &[nt * C]);
    let pad = f.constant_i32((s.dims.b * s.dims.t) as i32, ty)?;
    let real = f.compare(Cmp::Ne, st, pad)?;
    let real = f.convert(real, DType::I32)?;
    let real = f.reshape(real, &[nt, C])?;
    f.reduce_sum(real, &[1])
}

/// How the kernels read `s`'s per-token tensors: batch-first fixed-length rows of whole chunks
/// in place ([`TokenLayout::Rows`]), batch-first packed rows in place ([`TokenLayout::Packed`]),
/// head-first packed rows in place ([`TokenLayout::PackedLanes`]), all at widths the kernels
/// take as they are (packed rows unless the tuning says otherwise); else as lane-major chunks
/// XLA lays out ([`TokenLayout::Lanes`]: head-first tensors, widths the kernels pad).
fn placement(s: &ProgramSpec) -> TokenLayout {
    let exact = padded(s.dims.k) == s.dims.k as i64 && padded(s.dims.v) == s.dims.v as i64;
    // A chunk's window of 64 rows fits the tokens.
    let windows = s.dims.b * s.dims.t >= C as usize && s.tuning.gpu_kernels.packed_in_place;
    match (s.options.layout, s.packed_chunks) {
        _ if !exact => TokenLayout::Lanes,
        (Layout::BatchFirst, None) if s.dims.t.is_multiple_of(C as usize) => TokenLayout::Rows,
        (Layout::BatchFirst, Some(_)) if windows => TokenLayout::Packed,
        (Layout::HeadFirst, Some(_)) if windows => TokenLayout::PackedLanes,
        _ => TokenLayout::Lanes,
    }
}

/// `base` (lane-major) as the kernels read `s`'s tensors ([`placement`]): for rows, lanes are
/// heads, the rows' tokens one after another, a state slot per row; for packed rows, the
/// caller's `B T` tokens in place.
fn placed(s: &ProgramSpec, base: ForwardShape) -> ForwardShape {
    let (h, bb, t) = (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64);
    match placement(s) {
        TokenLayout::Rows => ForwardShape {
            layout: TokenLayout::Rows,
            lanes: h,
            t: bb * t,
            tokens: bb * t,
            slots: bb,
            run_chunks: t / C,
            ..base
        },
        layout @ (TokenLayout::Packed | TokenLayout::PackedLanes) => {
            ForwardShape { layout, tokens: bb * t, ..base }
        }
        TokenLayout::Lanes => base,
    }
}

/// The kernels' shape for `a`'s inputs ([`placed`]); with `keep_h` the recurrence keeps the
/// entering states, in that dtype.
fn kernel_shape(s: &ProgramSpec, a: &Args, keep_h: Option<DType>) -> ForwardShape {
    let base = placed(s, shape(s, kernel_dtype(a.q.elem()), keep_h.is_some()));
    ForwardShape { g_dtype: kernel_dtype(a.g.elem()), h_dtype: keep_h.unwrap_or(DType::F32), ..base }
}

/// The caller's tensor `x` as the kernels read it in place, in `dtype`: batch-first `[B T, H w]`,
/// head-first `[H B T, w]`.
fn rows_of(f: &mut FnBuilder, s: &ProgramSpec, x: Value, dtype: DType, w: i64) -> Result<Value> {
    let x = if x.elem() == dtype { x } else { f.convert(x, dtype)? };
    let (h, n) = (s.dims.h as i64, (s.dims.b * s.dims.t) as i64);
    match s.options.layout {
        Layout::BatchFirst => f.reshape(x, &[n, h * w]),
        Layout::HeadFirst => f.reshape(x, &[h * n, w]),
    }
}

/// `q k v g beta` as the kernels of shape `sh` read them in place ([`rows_of`]).
fn in_place_tokens(f: &mut FnBuilder, s: &ProgramSpec, a: &Args, sh: &ForwardShape) -> Result<[Value; 5]> {
    let (k, v) = (s.dims.k as i64, s.dims.v as i64);
    Ok([
        rows_of(f, s, a.q, sh.dtype, k)?,
        rows_of(f, s, a.k, sh.dtype, k)?,
        rows_of(f, s, a.v, sh.dtype, v)?,
        rows_of(f, s, a.g, sh.g_dtype, k)?,
        rows_of(f, s, a.beta, sh.dtype, 1)?,
    ])
}

/// The inputs of the row kernels of shape `sh`: the caller's tensors in place, a state slot
/// per row, each row's first and last chunk flagged.
fn rows_inputs(f: &mut FnBuilder, s: &ProgramSpec, a: &Args, sh: &ForwardShape) -> Result<ForwardInputs> {
    let (h, bb, t, k, v) =
        (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64, s.dims.k as i64, s.dims.v as i64);
    let nt = t / C;
    // The tables as constants (no launches): chunk position `c` is chunk `c % nt` of row `c / nt`.
    let table = |f: &mut FnBuilder, of: &dyn Fn(i64) -> i64| -> Result<Value> {
        let values: Vec<i32> = (0..bb * nt).map(|c| of(c) as i32).collect();
        f.constant_i32s(&values)
    };
    let first = table(f, &|c| i64::from(c % nt == 0))?;
    let last = table(f, &|c| i64::from(c % nt == nt - 1))?;
    let row = table(f, &|c| c / nt)?;
    let h0 = match a.h0 {
        Some(_) => {
            let tab = state_tab(f, s, a.h0)?;
            Some(f.reshape(tab, &[h, bb, k, v])?)
        }
        None => None,
    };
    let [q, kk, vv, g, beta] = in_place_tokens(f, s, a, sh)?;
    Ok(ForwardInputs {
        q,
        k: kk,
        v: vv,
        g,
        beta,
        gate: match a.a_log {
            Some(al) => Some(gate_operand(f, s, al, a.dt_bias)?),
            None => None,
        },
        h0,
        valid: table(f, &|_| C)?,
        first,
        last,
        slot: row,
        packed: None,
    })
}

/// The forward of batch-first fixed-length rows, read and written in place (`TokenLayout::Rows`:
/// lanes are heads, the rows' tokens one row after another, the state restarting at each row).
fn forward_rows(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    keep_h: Option<DType>,
    lowering: &dyn Lower,
) -> Result<(Vec<Value>, Kept)> {
    let (h, bb, t, k, v) =
        (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64, s.dims.k as i64, s.dims.v as i64);
    let sh = kernel_shape(s, a, keep_h);
    let x = rows_inputs(f, s, a, &sh)?;
    let fv = call_factors(f, &sh, &x, lowering)?;
    let out = call_recurrence(f, &sh, &x, &fv, lowering)?;
    let mut outs = vec![f.reshape(out.o, &[bb * t * h, v])?];
    if s.options.final_state {
        let ht = f.reshape(out.ht, &[h * bb, 1, k, v])?;
        outs.push(prep::state_from_table(f, s, ht)?);
    }
    if let Some(hs) = out.h {
        outs.push(f.reshape(hs, &[h * bb, t / C, k, v])?);
    }
    Ok((outs, Kept { factors: fv, v_new: out.v_new }))
}

/// What a forward hands a backward in the same program: the chunk kernels' factors and, where
/// it kept the states, `v' = u - w S`, as the kernels hold them (lane-major, widths padded; for
/// rows in place, a lane per head).
#[derive(Clone, Copy, Debug)]
struct Kept {
    factors: FactorValues,
    v_new: Option<Value>,
}

/// The forward: `o [final_state] [h]`, the GPU kernels lowered by `lowering`.
pub(in crate::op) fn forward(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    keep_h: bool,
    lowering: &dyn Lower,
) -> Result<Vec<Value>> {
    Ok(forward_parts(f, s, a, keep_h.then_some(DType::F32), lowering)?.0)
}

/// The inputs of the lane-major kernels of shape `sh` (tokens as aligned chunks, widths
/// padded), and the initial states' table as the caller gave them, when given.
fn lane_inputs(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    sh: &ForwardShape,
) -> Result<(ForwardInputs, Option<Value>)> {
    let beta = prep::beta_head_first(f, s, a.beta)?;
    let beta = f.convert(beta, sh.dtype)?;
    let h0 = match a.h0 {
        Some(_) => Some(state_tab(f, s, a.h0)?),
        None => None,
    };
    let gate = match a.a_log {
        Some(al) => Some(lane_gate(f, s, al, a.dt_bias)?),
        None => None,
    };
    let h0_padded = match h0 {
        Some(h) => Some(pad_state(f, h, sh.k, sh.v)?),
        None => None,
    };
    let x = ForwardInputs {
        q: tokens(f, s, a, a.q, sh.dtype)?,
        k: tokens(f, s, a, a.k, sh.dtype)?,
        v: tokens(f, s, a, a.v, sh.dtype)?,
        g: tokens(f, s, a, a.g, sh.g_dtype)?,
        beta: kernel_tokens(f, s, beta, a.slot_token)?,
        gate: match gate {
            Some(p) => Some(pad_last(f, p, sh.k)?),
            None => None,
        },
        h0: h0_padded,
        valid: valid(f, s, a)?,
        first: a.tables.first,
        last: a.tables.last,
        slot: kernel_slots(f, s, a.tables.slot)?,
        packed: None,
    };
    Ok((x, h0))
}

/// [`forward`], with what a backward in the same program reads.
fn forward_parts(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    keep_h: Option<DType>,
    lowering: &dyn Lower,
) -> Result<(Vec<Value>, Kept)> {
    let sh = kernel_shape(s, a, keep_h);
    let (x, h0) = match sh.layout {
        TokenLayout::Rows => return forward_rows(f, s, a, keep_h, lowering),
        TokenLayout::Packed | TokenLayout::PackedLanes => packed_inputs(f, s, a, &sh)?,
        TokenLayout::Lanes => lane_inputs(f, s, a, &sh)?,
    };
    let fv = call_factors(f, &sh, &x, lowering)?;
    let out = call_recurrence(f, &sh, &x, &fv, lowering)?;
    let (l, nt, v) = (s.lanes() as i64, s.chunks() as i64, s.dims.v as i64);
    let o = match sh.layout {
        // In the caller's layout already.
        TokenLayout::Packed | TokenLayout::PackedLanes => {
            f.reshape(out.o, &[(s.dims.b * s.dims.t * s.dims.h) as i64, v])?
        }
        _ => {
            let o = cut(f, out.o, 2, s.dims.v)?;
            let o = f.reshape(o, &[l, nt, C, v])?;
            let o = prep::from_chunks(f, s, o, a.token_slot)?;
            prep::to_caller(f, s, o, on_device(s.options.dtype))?
        }
    };
    let mut outs = vec![o];
    if s.options.final_state {
        let ht = cut(f, out.ht, 2, s.dims.k)?;
        let ht = cut(f, ht, 3, s.dims.v)?;
        let ht = or_passed(f, s, &a.tables, ht, h0)?;
        outs.push(prep::state_from_table(f, s, ht)?);
    }
    if let Some(h) = out.h {
        let h = cut(f, h, 2, s.dims.k)?;
        outs.push(cut(f, h, 3, s.dims.v)?);
    }
    Ok((outs, Kept { factors: fv, v_new: out.v_new }))
}

/// The inputs of the packed kernels of shape `sh` (the caller's batch-first packed rows in
/// place, [`packed_tables`] placing each chunk position), and the initial states' table, when
/// given.
fn packed_inputs(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    sh: &ForwardShape,
) -> Result<(ForwardInputs, Option<Value>)> {
    let h0 = match a.h0 {
        Some(_) => Some(state_tab(f, s, a.h0)?),
        None => None,
    };
    let valid = valid(f, s, a)?;
    let [q, kk, vv, g, beta] = in_place_tokens(f, s, a, sh)?;
    let x = ForwardInputs {
        q,
        k: kk,
        v: vv,
        g,
        beta,
        gate: match a.a_log {
            Some(al) => Some(lane_gate(f, s, al, a.dt_bias)?),
            None => None,
        },
        h0,
        valid,
        first: a.tables.first,
        last: a.tables.last,
        slot: kernel_slots(f, s, a.tables.slot)?,
        packed: Some(super::packed::packed_tables(f, s, a, valid)?),
    };
    Ok((x, h0))
}

/// The in-kernel gate's parameters per lane `[L, 2, K]` (lane `h B + b` takes head `h`'s; a
/// packed program's lanes are its heads).
fn lane_gate(f: &mut FnBuilder, s: &ProgramSpec, a_log: Value, dt_bias: Option<Value>) -> Result<Value> {
    let (h, bb, k) = (s.dims.h as i64, s.dims.b as i64, s.dims.k as i64);
    let p = gate_operand(f, s, a_log, dt_bias)?;
    if s.packed_chunks.is_some() {
        return Ok(p);
    }
    let p = f.broadcast_in_dim(p, &[h, bb, 2, k], &[0, 2, 3])?;
    f.reshape(p, &[h * bb, 2, k])
}

/// The backward from the saved states `saved` (the forward kernels' `h`) or, when
/// rematerializing, the states of the recurrence run again; the chunk kernels run again in
/// both.
pub(in crate::op) fn backward(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    saved: Option<Value>,
    cotangents: (Value, Option<Value>),
    lowering: &dyn Lower,
) -> Result<Vec<Value>> {
    backward_from(f, s, a, saved.map(|h| (h, None)), cotangents, lowering)
}

/// The fused forward+VJP: the forward kernels keeping the entering states (in the factors'
/// dtype: they only feed the WY gradient's products and its `h . dh` sums), then the backward
/// from them and the forward's factors (both strategies: the states are in the executable
/// anyway).
pub(in crate::op) fn fused(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    _strategy: BackwardStrategy,
    cotangents: (Value, Option<Value>),
    lowering: &dyn Lower,
) -> Result<Vec<Value>> {
    let fd = kernel_dtype(a.q.elem());
    let (mut outs, kept) = forward_parts(f, s, a, Some(fd), lowering)?;
    let h = outs.pop().ok_or_else(|| TpuError::builder("triton fused", "internal: no states kept"))?;
    let grads = backward_from(f, s, a, Some((h, Some(kept))), cotangents, lowering)?;
    outs.extend(grads);
    Ok(outs)
}

/// A `[L, slots, K, V]` state table with `K` and `V` zero-padded to the kernels' widths.
fn pad_state(f: &mut FnBuilder, x: Value, k: i64, v: i64) -> Result<Value> {
    let x = pad_last(f, x, v)?;
    let x = f.transpose(x, &[0, 1, 3, 2])?;
    let x = pad_last(f, x, k)?;
    f.transpose(x, &[0, 1, 3, 2])
}

/// The backward kernels: the state gradient, the WY gradient and the intra gradient, from the
/// entering states `[L, NT, K, V]` (and the chunk kernels' factors) of a forward that ran, else
/// from both formed again; batch-first fixed-length rows read in place and get their gradients
/// in place ([`rows_tail`]), the rest goes through lane-major chunks and XLA's tail
/// (`xla::finish_chunk_grads`).
fn backward_from(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    from: Option<(Value, Option<Kept>)>,
    (d_o, dht): (Value, Option<Value>),
    lowering: &dyn Lower,
) -> Result<Vec<Value>> {
    let sh = kernel_shape(s, a, None);
    sh.check()?;
    let rows = sh.layout == TokenLayout::Rows;
    let x = match sh.layout {
        TokenLayout::Rows => rows_inputs(f, s, a, &sh)?,
        TokenLayout::Packed | TokenLayout::PackedLanes => packed_inputs(f, s, a, &sh)?.0,
        TokenLayout::Lanes => lane_inputs(f, s, a, &sh)?.0,
    };
    // A state table `[L, n, K, V]` as the kernels hold it: a lane per head for rows, else with
    // the widths padded.
    let states = |f: &mut FnBuilder, x: Value| -> Result<Value> {
        match rows {
            true => {
                let d = x.dims().to_vec();
                f.reshape(x, &[sh.lanes, d[0] * d[1] / sh.lanes, d[2], d[3]])
            }
            false => pad_state(f, x, sh.k, sh.v),
        }
    };
    let internal = || TpuError::builder("triton backward", "internal: no states kept");
    let (fv, h, v_new) = match from {
        Some((h, Some(Kept { factors, v_new: Some(v_new) }))) => (factors, states(f, h)?, v_new),
        Some((h, _)) => {
            let fv = call_factors(f, &sh, &x, lowering)?;
            let h = states(f, h)?;
            let v_new = saved_v_new(f, &sh, &fv, h)?;
            (fv, h, v_new)
        }
        None => {
            let fv = call_factors(f, &sh, &x, lowering)?;
            let keep = ForwardShape { keep_h: true, h_dtype: sh.factor_dtype(), ..sh };
            let out = call_recurrence(f, &keep, &x, &fv, lowering)?;
            (fv, out.h.ok_or_else(internal)?, out.v_new.ok_or_else(internal)?)
        }
    };
    let d_o = match sh.layout {
        TokenLayout::Lanes => tokens(f, s, a, d_o, sh.dtype)?,
        _ => rows_of(f, s, d_o, sh.dtype, s.dims.v as i64)?,
    };
    let dht = match dht {
        Some(d) => {
            let tab = state_tab(f, s, Some(d))?;
            Some(states(f, tab)?)
        }
        None => None,
    };
    let sx = StateGradInputs {
        w: fv.w,
        qg: fv.qg,
        kg: fv.kg,
        aqk: fv.aqk,
        eg: fv.eg,
        d_o,
        dht,
        first: x.first,
        slot: x.slot,
        valid: x.valid,
        packed: x.packed,
    };
    let sg = call_state_grad(f, &sh, &sx, lowering)?;
    let wx = WyGradInputs { a: fv.a, v_new, h, dh: sg.dh, dv_new: sg.dv, d_o };
    let wg = call_wy_grad(f, &ForwardShape { h_dtype: h.elem(), ..sh }, &x, &wx, lowering)?;
    let ig = call_intra_grad(f, &sh, &x, [wg.daqk, wg.dl], [wg.dq, wg.dk, wg.dg], lowering)?;
    let [dq, dk, dg, db] = ig.grads;
    let [dq, dk] = match sh.l2norm {
        true => call_norm_grad(f, &sh, &x, [dq, dk], lowering)?,
        false => [dq, dk],
    };
    let gate_grads = gate_param_grads(f, s, ig.gate_sums)?;
    // dbeta: the WY gradient's terms (per key block and the value side's) and the intra
    // gradient's (per key block), `[L, T]`.
    let db = f.concatenate(&[wg.dbeta, db], 2)?;
    let dbeta = f.reduce_sum(db, &[2])?;
    let (h, k, v) = (s.dims.h as i64, s.dims.k as i64, s.dims.v as i64);
    match sh.layout {
        TokenLayout::Rows => {
            let dbeta = f.transpose(dbeta, &[1, 0])?;
            let dbeta = f.reshape(dbeta, &[(s.dims.b * s.dims.t) as i64 * h])?;
            let dh0 = f.reshape(sg.dh0, &[h * s.dims.b as i64, 1, k, v])?;
            return rows_tail(f, s, [dq, dk, wg.dv, dg], dbeta, dh0, gate_grads);
        }
        TokenLayout::Packed | TokenLayout::PackedLanes => {
            // dbeta alone is compacted from its chunk positions.
            let dbeta = f.reshape(dbeta, &[sh.lanes, sh.t / C, C, 1])?;
            let dbeta = prep::from_chunks(f, s, dbeta, a.token_slot)?;
            let dbeta = prep::beta_to_caller(f, s, dbeta, on_device(s.options.dtype))?;
            return rows_tail(f, s, [dq, dk, wg.dv, dg], dbeta, sg.dh0, gate_grads);
        }
        TokenLayout::Lanes => {}
    }
    let dims = dbeta.dims().to_vec();
    let dbeta = f.reshape(dbeta, &[dims[0], dims[1], 1])?;
    let (n, c) = ((s.lanes() * s.chunks()) as i64, C);
    let chunked = |f: &mut FnBuilder, x: Value, d: usize| -> Result<Value> {
        let x = cut(f, x, 2, d)?;
        f.reshape(x, &[n, c, d as i64])
    };
    let (k, v) = (s.dims.k, s.dims.v);
    let grads = [
        chunked(f, dq, k)?,
        chunked(f, dk, k)?,
        chunked(f, wg.dv, v)?,
        chunked(f, dg, k)?,
        chunked(f, dbeta, 1)?,
    ];
    let dh0 = cut(f, sg.dh0, 2, k)?;
    let dh0 = cut(f, dh0, 3, v)?;
    xla::finish_chunk_grads(f, s, a, grads, dh0, gate_grads)
}

/// The gate parameters' gradients as the options ask for them (`da_log` `[H]`, then `dt_bias`'s
/// `[H K]`) from the intra gradient's column sums `[L, NT, 2, K']` (none without an in-kernel
/// gate).
fn gate_param_grads(f: &mut FnBuilder, s: &ProgramSpec, sums: Option<Value>) -> Result<Vec<Value>> {
    let Some(x) = sums else { return Ok(Vec::new()) };
    let (h, k) = (s.dims.h as i64, s.dims.k as i64);
    let x = cut(f, x, 3, s.dims.k)?;
    let d = x.dims().to_vec();
    let x = f.reshape(x, &[h, d[0] * d[1] / h, 2, k])?;
    // Each straight from the sums (one reduction apiece; summing over chunks first took a
    // reduction and a copy more).
    let da_log = f.slice_axis(x, 2, 0, 1)?;
    let mut out = vec![f.reduce_sum(da_log, &[1, 2, 3])?];
    if s.options.has_dt_bias {
        let ddt = f.slice_axis(x, 2, 1, 2)?;
        let ddt = f.reduce_sum(ddt, &[1, 2])?;
        out.push(f.reshape(ddt, &[h * k])?);
    }
    Ok(out)
}

/// The backward's tail for rows and packed rows read in place: the kernels' gradients, in the
/// caller's layout already (`dq`, `dk`, `dg` `[B T, H K]`, `dv` `[B T, H V]`), `dbeta` in the
/// caller's order, the initial states' gradients as a state table and the gate parameters'
/// gradients, as the caller takes them: `dq dk dv dg dbeta [dh0] [da_log] [ddt_bias]`.
fn rows_tail(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    [dq, dk, dv, dg]: [Value; 4],
    dbeta: Value,
    dh0_tab: Value,
    gate_grads: Vec<Value>,
) -> Result<Vec<Value>> {
    let (h, n, k, v) = (s.dims.h as i64, (s.dims.b * s.dims.t) as i64, s.dims.k as i64, s.dims.v as i64);
    let e = on_device(s.options.dtype);
    let out = |f: &mut FnBuilder, x: Value, dtype: DType, w: i64| -> Result<Value> {
        let x = if x.elem() == dtype { x } else { f.convert(x, dtype)? };
        f.reshape(x, &[n * h, w])
    };
    let dbeta = if dbeta.elem() == e { dbeta } else { f.convert(dbeta, e)? };
    let mut outs = vec![
        out(f, dq, e, k)?,
        out(f, dk, e, k)?,
        out(f, dv, e, v)?,
        out(f, dg, on_device(s.options.g_dtype), k)?,
        dbeta,
    ];
    if s.options.has_h0 {
        outs.push(prep::state_from_table(f, s, dh0_tab)?);
    }
    outs.extend(gate_grads);
    Ok(outs)
}

/// `v' = u - w S` `[L, T, V]` in the factors' dtype from the saved entering states `h`
/// `[L, NT, K, V]` (padded): one batched product per chunk, as the recurrence forms it.
fn saved_v_new(f: &mut FnBuilder, sh: &ForwardShape, fv: &FactorValues, h: Value) -> Result<Value> {
    let (l, nt, k, v) = (sh.lanes, sh.t / C, sh.k, sh.v);
    let n = l * nt;
    let w = f.convert(fv.w, DType::F32)?;
    let w = f.reshape(w, &[n, C, k])?;
    let hs = f.reshape(h, &[n, k, v])?;
    let ws = f.batch_matmul(w, hs, crate::hlo::Transpose::None)?;
    let u = f.convert(fv.u, DType::F32)?;
    let u = f.reshape(u, &[n, C, v])?;
    let vn = f.sub(u, ws)?;
    let vn = f.reshape(vn, &[l, nt * C, v])?;
    f.convert(vn, sh.factor_dtype())
}
