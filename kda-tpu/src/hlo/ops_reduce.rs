//! Reductions (`stablehlo.reduce` with an add/max/min region) and cumulative sums
//! (`stablehlo.reduce_window`, exact and independent of matmul precision).

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::fmt::fmt_array;
use super::ops_shape::valid_axes;
use super::types::{TensorType, Value};
use kda_core::DType;

/// The binary op of a reduction region.
#[derive(Clone, Copy)]
pub(super) enum Combiner {
    Add,
    Max,
    Min,
}

impl FnBuilder {
    /// Scalar identity of `combiner` for `elem`.
    fn identity(&mut self, op: &str, combiner: Combiner, elem: DType) -> Result<Value> {
        let ty = TensorType::scalar(elem);
        match (combiner, elem) {
            (_, DType::I1) => Err(err(op, "i1 is not reducible (convert first)")),
            (Combiner::Add, e) if e.is_float() => self.constant_f32(0.0, ty),
            (Combiner::Max, e) if e.is_float() => self.constant_f32(f32::NEG_INFINITY, ty),
            (Combiner::Min, e) if e.is_float() => self.constant_f32(f32::INFINITY, ty),
            (Combiner::Add, _) => self.constant_i32(0, ty),
            (Combiner::Max, DType::I32) => self.constant_i32(i32::MIN, ty),
            (Combiner::Min, DType::I32) => self.constant_i32(i32::MAX, ty),
            (Combiner::Max, _) => self.constant_i32(0, ty),
            (Combiner::Min, _) => self.constant_i32(u16::MAX as i32, ty),
        }
    }

    /// Region `(a, b) -> combiner(a, b)` on scalars of `elem`.
    pub(super) fn combiner_region(&mut self, op: &str, combiner: Combiner, elem: DType) -> Result<String> {
        let s = TensorType::scalar(elem);
        let (text, _) = self.region(op, &[s.clone(), s], |b, a| {
            let r = match combiner {
                Combiner::Add => b.add(a[0], a[1])?,
                Combiner::Max => b.max(a[0], a[1])?,
                Combiner::Min => b.min(a[0], a[1])?,
            };
            Ok(vec![r])
        })?;
        Ok(text)
    }

    fn reduce_with(&mut self, op: &str, combiner: Combiner, v: Value, dims: &[i64]) -> Result<Value> {
        if !valid_axes(dims, v.rank()) {
            return Err(err(op, format!("dims {dims:?} invalid for {}", v.ty())));
        }
        let init = self.identity(op, combiner, v.elem())?;
        let body = self.combiner_region(op, combiner, v.elem())?;
        let mut sorted = dims.to_vec();
        sorted.sort_unstable();
        let kept: Vec<i64> =
            (0..v.rank()).filter(|d| !sorted.contains(&(*d as i64))).map(|d| v.dims()[d]).collect();
        let attr = format!("dimensions = {}", fmt_array(&sorted));
        let ty = TensorType::new(v.elem(), &kept);
        let mut out = self.push_op(op, "stablehlo.reduce", &[v, init], &[body], &attr, &[ty])?;
        out.pop().ok_or_else(|| err(op, "internal: no result"))
    }

    /// Sum over `dims` (removed from the result). bf16 sums in bf16: convert to f32 first for accuracy.
    pub fn reduce_sum(&mut self, v: Value, dims: &[i64]) -> Result<Value> {
        self.reduce_with("reduce_sum", Combiner::Add, v, dims)
    }

    /// Maximum over `dims` (removed from the result); -inf for empty float reductions.
    pub fn reduce_max(&mut self, v: Value, dims: &[i64]) -> Result<Value> {
        self.reduce_with("reduce_max", Combiner::Max, v, dims)
    }

    /// Minimum over `dims` (removed from the result); +inf for empty float reductions.
    pub fn reduce_min(&mut self, v: Value, dims: &[i64]) -> Result<Value> {
        self.reduce_with("reduce_min", Combiner::Min, v, dims)
    }

    /// Inclusive cumulative sum along `axis` (`reverse`: suffix sums), same type as `v`.
    pub fn cumsum(&mut self, v: Value, axis: usize, reverse: bool) -> Result<Value> {
        let op = "cumsum";
        if axis >= v.rank() || v.elem() == DType::I1 {
            return Err(err(op, format!("axis {axis} / element type invalid for {}", v.ty())));
        }
        let n = v.dims()[axis];
        let init = self.identity(op, Combiner::Add, v.elem())?;
        let body = self.combiner_region(op, Combiner::Add, v.elem())?;
        let r = v.rank();
        let mut window = vec![1; r];
        window[axis] = n.max(1);
        let pads: Vec<String> = (0..r)
            .map(|d| match (d == axis, reverse) {
                (true, false) => format!("[{}, 0]", (n - 1).max(0)),
                (true, true) => format!("[0, {}]", (n - 1).max(0)),
                _ => "[0, 0]".to_string(),
            })
            .collect();
        let attr = format!(
            "window_dimensions = {}, window_strides = {}, padding = dense<[{}]> : tensor<{r}x2xi64>",
            fmt_array(&window),
            fmt_array(&vec![1; r]),
            pads.join(", ")
        );
        let mut out = self.push_op(op, "stablehlo.reduce_window", &[v, init], &[body], &attr, &[v.ty()])?;
        out.pop().ok_or_else(|| err(op, "internal: no result"))
    }
}
