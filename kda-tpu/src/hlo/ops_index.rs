//! Indexing ops: dynamic slices, gathers along an axis, scatter-add of rows.
//! Out-of-range start indices are clamped (StableHLO semantics), never an error at run time.

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::fmt::{fmt_array, fmt_list};
use super::types::{TensorType, Value};
use kda_core::DType;

/// Checks `indices` are `rank` scalar i32 values.
fn check_start_indices(op: &str, v: &Value, indices: &[Value]) -> Result<()> {
    if indices.len() != v.rank() {
        return Err(err(op, format!("{} start indices for {}", indices.len(), v.ty())));
    }
    if let Some(bad) = indices.iter().find(|i| i.rank() != 0 || i.elem() != DType::I32) {
        return Err(err(op, format!("start index {} must be tensor<i32>", bad.ty())));
    }
    Ok(())
}

/// `key = [..]` for non-empty lists (empty ones are omitted, as MLIR prints them).
fn dim_list(parts: &[(&str, &[i64])]) -> String {
    parts
        .iter()
        .filter(|(_, xs)| !xs.is_empty())
        .map(|(k, xs)| format!("{k} = {}", fmt_list(xs)))
        .collect::<Vec<_>>()
        .join(", ")
}

impl FnBuilder {
    /// `v[i0:i0+s0, i1:i1+s1, ...]` with run-time scalar i32 starts (clamped into range).
    pub fn dynamic_slice(&mut self, v: Value, indices: &[Value], sizes: &[i64]) -> Result<Value> {
        let op = "dynamic_slice";
        check_start_indices(op, &v, indices)?;
        if sizes.len() != v.rank() || sizes.iter().zip(v.dims()).any(|(&s, &d)| s < 0 || s > d) {
            return Err(err(op, format!("sizes {sizes:?} invalid for {}", v.ty())));
        }
        let mut operands = vec![v];
        operands.extend_from_slice(indices);
        let attr = format!("slice_sizes = {}", fmt_array(sizes));
        self.push_op1(op, "stablehlo.dynamic_slice", &operands, &attr, TensorType::new(v.elem(), sizes))
    }

    /// Writes `update` into `v` at run-time scalar i32 starts (clamped so it fits).
    pub fn dynamic_update_slice(&mut self, v: Value, update: Value, indices: &[Value]) -> Result<Value> {
        let op = "dynamic_update_slice";
        check_start_indices(op, &v, indices)?;
        let fits = update.elem() == v.elem()
            && update.rank() == v.rank()
            && update.dims().iter().zip(v.dims()).all(|(u, d)| u <= d);
        if !fits {
            return Err(err(op, format!("update {} does not fit into {}", update.ty(), v.ty())));
        }
        let mut operands = vec![v, update];
        operands.extend_from_slice(indices);
        self.push_op1(op, "stablehlo.dynamic_update_slice", &operands, "", v.ty())
    }

    /// `table[indices]` for a table `[N, ...rest]` and i32 indices `[M]`: result `[M, ...rest]`.
    pub fn gather_rows(&mut self, table: Value, indices: Value) -> Result<Value> {
        self.gather_axis(table, 0, indices)
    }

    /// Takes entries along `axis` (`stablehlo.gather`). Indices are i32, either `[M]` (result: `v`'s
    /// dims with `axis` replaced by `M`) or batched `[d0, .., d(axis-1), M]` matching `v`'s leading dims,
    /// each batch row picking its own entries (operand/start-index batching dims).
    pub fn gather_axis(&mut self, v: Value, axis: usize, indices: Value) -> Result<Value> {
        let op = "gather_axis";
        let r = v.rank();
        if axis >= r || indices.elem() != DType::I32 || indices.rank() == 0 {
            return Err(err(op, format!("axis {axis} / indices {} invalid for {}", indices.ty(), v.ty())));
        }
        let batched = indices.rank() > 1;
        if batched && (indices.rank() != axis + 1 || indices.dims()[..axis] != v.dims()[..axis]) {
            return Err(err(
                op,
                format!(
                    "batched indices {} must be [{:?}.., M] for {} axis {axis}",
                    indices.ty(),
                    &v.dims()[..axis],
                    v.ty()
                ),
            ));
        }
        let m = indices.dims()[indices.rank() - 1];
        let batch: Vec<i64> = if batched { (0..axis as i64).collect() } else { Vec::new() };
        let offset: Vec<i64> = (0..r as i64).filter(|&d| d != axis as i64 && !batch.contains(&d)).collect();
        let mut slice_sizes = v.dims().to_vec();
        slice_sizes[axis] = 1;
        for &b in &batch {
            slice_sizes[b as usize] = 1;
        }
        let mut dims = v.dims().to_vec();
        dims[axis] = m;
        let a = [axis as i64];
        let numbers = dim_list(&[
            ("offset_dims", &offset),
            ("collapsed_slice_dims", &a),
            ("operand_batching_dims", &batch),
            ("start_indices_batching_dims", &batch),
            ("start_index_map", &a),
        ]);
        let attr = format!(
            "dimension_numbers = #stablehlo.gather<{numbers}, index_vector_dim = {}>, \
             indices_are_sorted = false, slice_sizes = {}",
            indices.rank(),
            fmt_array(&slice_sizes)
        );
        self.push_op1(op, "stablehlo.gather", &[v, indices], &attr, TensorType::new(v.elem(), &dims))
    }

    /// `table[indices[i]] += updates[i]` for table `[N, ...rest]`, i32 indices `[M]`, updates
    /// `[M, ...rest]`; duplicate indices accumulate, out-of-range rows are skipped.
    pub fn scatter_rows_add(&mut self, table: Value, indices: Value, updates: Value) -> Result<Value> {
        let op = "scatter_rows_add";
        let r = table.rank();
        let ok = r >= 1
            && indices.rank() == 1
            && indices.elem() == DType::I32
            && updates.elem() == table.elem()
            && updates.rank() == r
            && updates.dims()[0] == indices.dims()[0]
            && updates.dims()[1..] == table.dims()[1..]
            && table.elem() != DType::I1;
        if !ok {
            return Err(err(
                op,
                format!(
                    "need table [N, ..], indices i32 [M], updates [M, ..]: {} {} {}",
                    table.ty(),
                    indices.ty(),
                    updates.ty()
                ),
            ));
        }
        let elem = table.elem();
        let s = TensorType::scalar(elem);
        let (body, _) = self.region(op, &[s.clone(), s], |b, a| Ok(vec![b.add(a[0], a[1])?]))?;
        let window: Vec<i64> = (1..r as i64).collect();
        let numbers = dim_list(&[
            ("update_window_dims", &window),
            ("inserted_window_dims", &[0]),
            ("scatter_dims_to_operand_dims", &[0]),
        ]);
        let attr = format!(
            "indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<{numbers}, \
             index_vector_dim = 1>, unique_indices = false"
        );
        let mut out =
            self.push_op(op, "stablehlo.scatter", &[table, indices, updates], &[body], &attr, &[table.ty()])?;
        out.pop().ok_or_else(|| err(op, "internal: no result"))
    }
}
