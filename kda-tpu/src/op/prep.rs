//! Inputs to the kernels' working form and results back: layout, dtype, q/k L2 norm, gate
//! activation, and the segment loading / gradient compaction between tokens and aligned chunks.

use super::hlo_ops::{splat, sum_last_keep};
use super::spec::{ProgramSpec, CHUNK};
use crate::hlo::{FnBuilder, Value};
use crate::Result;
use kda_core::{DType, GateKind, Layout, L2NORM_EPS};

/// Per-token tensor in the caller's layout to head-first `[H, B, T, D]` f32.
pub fn head_first(b: &mut FnBuilder, s: &ProgramSpec, x: Value) -> Result<Value> {
    let x = if x.elem() == DType::F32 { x } else { b.convert(x, DType::F32)? };
    Ok(match s.options.layout {
        Layout::HeadFirst => x,
        Layout::BatchFirst => heads_outermost(b, s, x)?,
    })
}

/// A batch-first per-token tensor, `[B, T, H, D]` or a kernel forward's `[B*T, H*D]`
/// ([`ProgramSpec::kernel_token_dims`]), as head-first `[H, B, T, D]`, in its own dtype.
pub fn heads_outermost(b: &mut FnBuilder, s: &ProgramSpec, x: Value) -> Result<Value> {
    let x = if x.rank() == 4 {
        x
    } else {
        let hd = *x.dims().last().unwrap_or(&1);
        let (h, bb, t) = (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64);
        b.reshape(x, &[bb, t, h, hd / h.max(1)])?
    };
    b.transpose(x, &[2, 0, 1, 3])
}

/// `beta` as the caller gives it to `[H, B, T, 1]` f32.
pub fn beta_head_first(b: &mut FnBuilder, s: &ProgramSpec, beta: Value) -> Result<Value> {
    let mut d = s
        .options
        .layout
        .scalar_shape(s.dims.h, s.dims.b, s.dims.t)
        .iter()
        .map(|&x| x as i64)
        .collect::<Vec<_>>();
    d.push(1);
    let x = b.reshape(beta, &d)?;
    head_first(b, s, x)
}

/// Head-first `[H, B, T, D]` f32 back to the caller's layout and `dtype`, as a program result:
/// flat `[tokens, D]`, the same row-major bytes as the caller's 4-D shape (the backend downloads
/// results with the API shape). A 4-D result with a unit axis (B = 1) made XLA give the last
/// fusion a layout with that axis elsewhere and then copy the whole result into the standard one.
pub fn to_caller(b: &mut FnBuilder, s: &ProgramSpec, x: Value, dtype: DType) -> Result<Value> {
    let x = match s.options.layout {
        Layout::HeadFirst => x,
        Layout::BatchFirst => b.transpose(x, &[1, 2, 0, 3])?,
    };
    let x = if x.elem() == dtype { x } else { b.convert(x, dtype)? };
    let d = x.dims().to_vec();
    b.reshape(x, &[d[0] * d[1] * d[2], d[3]])
}

/// Head-first `[H, B, T, 1]` back to beta's caller layout and `dtype`, as a flat result.
pub fn beta_to_caller(b: &mut FnBuilder, s: &ProgramSpec, x: Value, dtype: DType) -> Result<Value> {
    let x = to_caller(b, s, x, dtype)?;
    let n: i64 = s.beta_dims().iter().product();
    b.reshape(x, &[n])
}

/// `x * rsqrt(sum(x^2) + eps)` over the last axis; returns the normalised `x` and `rstd`.
pub fn l2_normalise(b: &mut FnBuilder, x: Value) -> Result<(Value, Value)> {
    let sq = b.mul(x, x)?;
    let ss = sum_last_keep(b, sq)?;
    let ss = b.add_const(ss, L2NORM_EPS as f32)?;
    let rstd = b.rsqrt(ss)?;
    Ok((b.mul_bcast(x, rstd)?, rstd))
}

/// The L2-norm backward `rstd * (dy - (dy . y) y)` with `y` the normalised input.
pub fn l2_backward(b: &mut FnBuilder, dy: Value, y: Value, rstd: Value) -> Result<Value> {
    let p = b.mul(dy, y)?;
    let dot = sum_last_keep(b, p)?;
    let t = b.mul_bcast(y, dot)?;
    let d = b.sub(dy, t)?;
    b.mul_bcast(d, rstd)
}

/// The gate parameters broadcast to `[H, B, T, K]`: `exp(a_log[h])` and `dt_bias[h, :]` (0 if absent).
pub struct GateParams {
    /// `exp(a_log)` per head.
    pub a: Value,
    /// `dt_bias` per head and channel.
    pub bias: Value,
}

/// Broadcasts `a_log` `[H]` and `dt_bias` `[H*K]` to `x`'s `[H, B, T, K]` shape.
pub fn gate_params(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a_log: Value,
    dt_bias: Option<Value>,
    dims: &[i64],
) -> Result<GateParams> {
    let a = b.exp(a_log)?;
    let a = b.broadcast_in_dim(a, dims, &[0])?;
    let bias = match dt_bias {
        Some(d) => {
            let d = b.reshape(d, &[s.dims.h as i64, s.dims.k as i64])?;
            b.broadcast_in_dim(d, dims, &[0, 3])?
        }
        None => splat(b, 0.0, dims)?,
    };
    Ok(GateParams { a, bias })
}

/// The activated log-decay from the raw gate input `x` `[H, B, T, K]` (docs/kda.md, Tensors).
pub fn activate(b: &mut FnBuilder, s: &ProgramSpec, x: Value, p: Option<&GateParams>) -> Result<Value> {
    let Some(p) = p else { return Ok(x) };
    let z = b.add(x, p.bias)?;
    match s.options.gate {
        GateKind::Preactivated => Ok(x),
        GateKind::Softplus => {
            // softplus(z) = max(z, 0) + log1p(exp(-|z|)), exact and overflow-free.
            let sp = softplus(b, z)?;
            let g = b.mul(p.a, sp)?;
            b.neg(g)
        }
        GateKind::LowerBound(lb) => {
            let az = b.mul(p.a, z)?;
            let sg = b.logistic(az)?;
            b.mul_const(sg, lb as f32)
        }
    }
}

fn softplus(b: &mut FnBuilder, z: Value) -> Result<Value> {
    let zero = splat(b, 0.0, z.dims())?;
    let pos = b.max(z, zero)?;
    let a = b.abs(z)?;
    let na = b.neg(a)?;
    let e = b.exp(na)?;
    let l = b.log1p(e)?;
    b.add(pos, l)
}

/// Gradients through the gate: `(dx, da_log [H], ddt_bias [H*K])` from `dg` w.r.t. the activated
/// gate, all `[H, B, T, K]` before the reductions.
pub fn gate_backward(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    x: Value,
    g: Value,
    dg: Value,
    p: &GateParams,
) -> Result<(Value, Value, Value)> {
    let z = b.add(x, p.bias)?;
    let (dx, dalog) = match s.options.gate {
        GateKind::Preactivated => return Ok((dg, dg, dg)),
        GateKind::Softplus => {
            // g = -a softplus(z): dg/dz = -a sigmoid(z), dg/da_log = g.
            let sg = b.logistic(z)?;
            let d = b.mul(p.a, sg)?;
            let d = b.neg(d)?;
            (b.mul(dg, d)?, b.mul(dg, g)?)
        }
        GateKind::LowerBound(lb) => {
            // g = lb sigmoid(a z): dg/dz = lb s (1 - s) a, dg/da_log = lb s (1 - s) a z, with
            // 1 - s formed as sigmoid(-a z): near saturation 1 - s would keep only the few bits
            // of s below 1.
            let az = b.mul(p.a, z)?;
            let sg = b.logistic(az)?;
            let naz = b.neg(az)?;
            let om = b.logistic(naz)?;
            let ds = b.mul(sg, om)?;
            let ds = b.mul_const(ds, lb as f32)?;
            let dsa = b.mul(ds, p.a)?;
            let dsaz = b.mul(ds, az)?;
            (b.mul(dg, dsa)?, b.mul(dg, dsaz)?)
        }
    };
    let da_log = b.reduce_sum(dalog, &[1, 2, 3])?;
    let ddt = b.reduce_sum(dx, &[1, 2])?;
    let ddt = b.reshape(ddt, &[(s.dims.h * s.dims.k) as i64])?;
    Ok((dx, da_log, ddt))
}

/// Segment loading: head-first `[H, B, T, D]` to aligned chunks `[L, NT, C, D]` (padding rows 0,
/// in `x`'s dtype).
/// Packed programs gather through `slot_token` (`[NT*C]`, padding slots point at a zero row).
pub fn to_chunks(b: &mut FnBuilder, s: &ProgramSpec, x: Value, slot_token: Option<Value>) -> Result<Value> {
    let d = x.dims()[3];
    let (h, bb, t) = (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64);
    let (l, nt, c) = (s.lanes() as i64, s.chunks() as i64, CHUNK as i64);
    let zero = b.constant_f32(0.0, crate::hlo::TensorType::scalar(x.elem()))?;
    match slot_token {
        None => {
            let x = b.reshape(x, &[h * bb, t, d])?;
            let x = b.pad(x, zero, &[0, 0, 0], &[0, nt * c - t, 0], &[0, 0, 0])?;
            b.reshape(x, &[l, nt, c, d])
        }
        Some(idx) => {
            let x = b.reshape(x, &[h, bb * t, d])?;
            let x = b.pad(x, zero, &[0, 0, 0], &[0, 1, 0], &[0, 0, 0])?;
            let x = head_rows(b, x, idx)?;
            b.reshape(x, &[l, nt, c, d])
        }
    }
}

/// Gradient compaction: aligned `[L, NT, C, D]` to head-first `[H, B, T, D]`, each token read
/// from its slot (`token_slot` `[B*T]`, padding tokens point at a zero row, so they are exactly 0).
pub fn from_chunks(b: &mut FnBuilder, s: &ProgramSpec, y: Value, token_slot: Option<Value>) -> Result<Value> {
    let d = y.dims()[3];
    let (h, bb, t) = (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64);
    let (nt, c) = (s.chunks() as i64, CHUNK as i64);
    match token_slot {
        None => {
            let y = b.reshape(y, &[h * bb, nt * c, d])?;
            let y = b.slice_axis(y, 1, 0, t)?;
            b.reshape(y, &[h, bb, t, d])
        }
        Some(idx) => {
            let zero = b.constant_f32(0.0, crate::hlo::TensorType::scalar(y.elem()))?;
            let y = b.reshape(y, &[h, nt * c, d])?;
            let y = b.pad(y, zero, &[0, 0, 0], &[0, 1, 0], &[0, 0, 0])?;
            let y = head_rows(b, y, idx)?;
            b.reshape(y, &[h, bb, t, d])
        }
    }
}

/// Rows `idx[m]` of every head of `x` `[H, R, D]`: `[H * M, D]`. Gathered as rows of the
/// flattened `[H * R, D]` with indices `h * R + idx[m]`, so the result comes out head-major
/// as the kernels want it (gathering along axis 1 of `[H, R, D]` makes XLA's canonical gather
/// write `[M, H, D]` and transpose it afterwards, once per consumer).
fn head_rows(b: &mut FnBuilder, x: Value, idx: Value) -> Result<Value> {
    let (h, r, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let m = idx.dims()[0];
    let i32t = |dims: &[i64]| crate::hlo::TensorType::new(DType::I32, dims);
    let head = b.iota(i32t(&[h, m]), 0)?;
    let rows = b.constant_i32(r as i32, i32t(&[]))?;
    let rows = b.broadcast_in_dim(rows, &[h, m], &[])?;
    let base = b.mul(head, rows)?;
    let at = b.broadcast_in_dim(idx, &[h, m], &[1])?;
    let at = b.add(base, at)?;
    let at = b.reshape(at, &[h * m])?;
    let flat = b.reshape(x, &[h * r, d])?;
    b.gather_axis(flat, 0, at)
}

/// States `[B, N, H, K, V]` to the per-lane table `[L, slots, K, V]`.
pub fn state_table(b: &mut FnBuilder, s: &ProgramSpec, x: Value) -> Result<Value> {
    let x = b.transpose(x, &[2, 0, 1, 3, 4])?;
    b.reshape(x, &[s.lanes() as i64, s.slots() as i64, s.dims.k as i64, s.dims.v as i64])
}

/// The per-lane table `[L, slots, K, V]` back to `[B, N, H, K, V]`.
pub fn state_from_table(b: &mut FnBuilder, s: &ProgramSpec, x: Value) -> Result<Value> {
    let x =
        b.reshape(x, &[s.dims.h as i64, s.dims.b as i64, s.dims.n as i64, s.dims.k as i64, s.dims.v as i64])?;
    b.transpose(x, &[1, 2, 0, 3, 4])
}
