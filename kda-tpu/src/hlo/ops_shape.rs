//! Shape ops: broadcast, reshape, transpose, slice, concatenate, pad, reverse.

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::fmt::fmt_array;
use super::types::{TensorType, Value};
use crate::TpuError;

/// True when `dims` lists distinct axes of a rank-`rank` tensor.
pub(crate) fn valid_axes(dims: &[i64], rank: usize) -> bool {
    dims.iter().enumerate().all(|(i, &d)| d >= 0 && (d as usize) < rank && !dims[..i].contains(&d))
}

impl FnBuilder {
    /// `stablehlo.broadcast_in_dim`: operand dim `i` goes to result dim `mapping[i]`
    /// (operand dims must equal the result dim or be 1).
    pub fn broadcast_in_dim(&mut self, v: Value, result_dims: &[i64], mapping: &[i64]) -> Result<Value> {
        let op = "broadcast_in_dim";
        if mapping.len() != v.rank() {
            return Err(err(op, format!("mapping {mapping:?} has {} entries for {}", mapping.len(), v.ty())));
        }
        if !valid_axes(mapping, result_dims.len()) {
            return Err(err(op, format!("mapping {mapping:?} invalid for result dims {result_dims:?}")));
        }
        for (i, &m) in mapping.iter().enumerate() {
            let d = v.dims()[i];
            if d != 1 && d != result_dims[m as usize] {
                return Err(err(
                    op,
                    format!(
                        "operand {} dim {i} does not fit result dims {result_dims:?} via {mapping:?}",
                        v.ty()
                    ),
                ));
            }
        }
        let attr = format!("broadcast_dimensions = {}", fmt_array(mapping));
        let ty = TensorType::new(v.elem(), result_dims);
        self.push_op1(op, "stablehlo.broadcast_in_dim", &[v], &attr, ty)
    }

    /// Numpy-style broadcast to `dims`: trailing dims aligned, size-1 dims stretch.
    pub fn broadcast_to(&mut self, v: Value, dims: &[i64]) -> Result<Value> {
        let op = "broadcast_to";
        let (r, k) = (dims.len(), v.rank());
        if k > r {
            return Err(err(op, format!("cannot broadcast {} to dims {dims:?}", v.ty())));
        }
        for (i, &d) in v.dims().iter().enumerate() {
            if d != 1 && d != dims[r - k + i] {
                return Err(err(op, format!("cannot broadcast {} to dims {dims:?}", v.ty())));
            }
        }
        let mapping: Vec<i64> = ((r - k) as i64..r as i64).collect();
        self.broadcast_in_dim(v, dims, &mapping)
    }

    /// Reshape to `dims` (same number of elements, row-major).
    pub fn reshape(&mut self, v: Value, dims: &[i64]) -> Result<Value> {
        let ty = TensorType::new(v.elem(), dims);
        if dims.iter().any(|&d| d < 0) || ty.num_elements() != v.num_elements() {
            return Err(err("reshape", format!("cannot reshape {} to {ty}", v.ty())));
        }
        self.push_op1("reshape", "stablehlo.reshape", &[v], "", ty)
    }

    /// Transpose: result dim `i` is operand dim `perm[i]`.
    pub fn transpose(&mut self, v: Value, perm: &[i64]) -> Result<Value> {
        let op = "transpose";
        if perm.len() != v.rank() || !valid_axes(perm, v.rank()) {
            return Err(err(op, format!("permutation {perm:?} is not a permutation for {}", v.ty())));
        }
        let dims: Vec<i64> = perm.iter().map(|&p| v.dims()[p as usize]).collect();
        let attr = format!("permutation = {}", fmt_array(perm));
        self.push_op1(op, "stablehlo.transpose", &[v], &attr, TensorType::new(v.elem(), &dims))
    }

    /// Static strided slice `[start, limit)` with `strides` (all of length rank).
    pub fn slice(&mut self, v: Value, start: &[i64], limit: &[i64], strides: &[i64]) -> Result<Value> {
        let op = "slice";
        let bad =
            err(op, format!("start {start:?} limit {limit:?} strides {strides:?} invalid for {}", v.ty()));
        let dims = per_dim(v.dims(), [start, limit, strides], bad, |d, [s, l, k]| {
            (s >= 0 && s <= l && l <= d && k >= 1).then(|| (l - s + k - 1) / k)
        })?;
        let attr = format!(
            "start_indices = {}, limit_indices = {}, strides = {}",
            fmt_array(start),
            fmt_array(limit),
            fmt_array(strides)
        );
        self.push_op1(op, "stablehlo.slice", &[v], &attr, TensorType::new(v.elem(), &dims))
    }

    /// `v[..., start..limit, ...]` along `axis` (unit stride).
    pub fn slice_axis(&mut self, v: Value, axis: usize, start: i64, limit: i64) -> Result<Value> {
        if axis >= v.rank() {
            return Err(err("slice_axis", format!("axis {axis} out of range for {}", v.ty())));
        }
        let mut lo = vec![0; v.rank()];
        let mut hi = v.dims().to_vec();
        lo[axis] = start;
        hi[axis] = limit;
        self.slice(v, &lo, &hi, &vec![1; v.rank()])
    }

    /// Concatenates `vs` (same rank and elem; equal dims except `dim`) along `dim`.
    pub fn concatenate(&mut self, vs: &[Value], dim: usize) -> Result<Value> {
        let op = "concatenate";
        let Some(first) = vs.first() else {
            return Err(err(op, "no operands"));
        };
        if dim >= first.rank() {
            return Err(err(op, format!("dim {dim} out of range for {}", first.ty())));
        }
        let mut dims = first.dims().to_vec();
        dims[dim] = 0;
        for v in vs {
            let same = v.elem() == first.elem()
                && v.rank() == first.rank()
                && (0..v.rank()).all(|i| i == dim || v.dims()[i] == first.dims()[i]);
            if !same {
                let tys: Vec<String> = vs.iter().map(|v| v.ty().to_string()).collect();
                return Err(err(op, format!("operands [{}] do not agree outside dim {dim}", tys.join(", "))));
            }
            dims[dim] += v.dims()[dim];
        }
        let attr = format!("dimension = {dim} : i64");
        self.push_op1(op, "stablehlo.concatenate", vs, &attr, TensorType::new(first.elem(), &dims))
    }

    /// Pads with the scalar `pad_value`: `low`/`high` edges (negative crops) and `interior` gaps.
    pub fn pad(
        &mut self,
        v: Value,
        pad_value: Value,
        low: &[i64],
        high: &[i64],
        interior: &[i64],
    ) -> Result<Value> {
        let op = "pad";
        if pad_value.rank() != 0 || pad_value.elem() != v.elem() {
            return Err(err(op, format!("pad value {} must be a scalar of {}", pad_value.ty(), v.elem())));
        }
        let bad = err(op, format!("low {low:?} high {high:?} interior {interior:?} invalid for {}", v.ty()));
        let dims = per_dim(v.dims(), [low, high, interior], bad, |d, [lo, hi, int]| {
            let n = lo + hi + d + (d - 1).max(0) * int;
            (int >= 0 && n >= 0).then_some(n)
        })?;
        let attr = format!(
            "edge_padding_low = {}, edge_padding_high = {}, interior_padding = {}",
            fmt_array(low),
            fmt_array(high),
            fmt_array(interior)
        );
        self.push_op1(op, "stablehlo.pad", &[v, pad_value], &attr, TensorType::new(v.elem(), &dims))
    }

    /// Reverses the order of elements along each axis in `dims`.
    pub fn reverse(&mut self, v: Value, dims: &[i64]) -> Result<Value> {
        if !valid_axes(dims, v.rank()) {
            return Err(err("reverse", format!("dims {dims:?} invalid for {}", v.ty())));
        }
        let attr = format!("dimensions = {}", fmt_array(dims));
        self.push_op1("reverse", "stablehlo.reverse", &[v], &attr, v.ty())
    }
}

/// The result dims of an op given three per-dim lists `lists` over an operand of `dims`: `dim`
/// of each dim's extent and list entries, or `bad` when a list's length is not the rank or
/// `dim` refuses an entry.
fn per_dim(
    dims: &[i64],
    lists: [&[i64]; 3],
    bad: TpuError,
    dim: impl Fn(i64, [i64; 3]) -> Option<i64>,
) -> Result<Vec<i64>> {
    if lists.iter().any(|l| l.len() != dims.len()) {
        return Err(bad);
    }
    let out: Option<Vec<i64>> =
        dims.iter().enumerate().map(|(i, &d)| dim(d, [lists[0][i], lists[1][i], lists[2][i]])).collect();
    out.ok_or(bad)
}
