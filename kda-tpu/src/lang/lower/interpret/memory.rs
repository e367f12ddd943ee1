//! The interpret lowering's loads and stores: windows of a step's references at their offsets,
//! masked ones selecting on their rows' count (their references padded past the end first, as a
//! dynamic slice would clamp a window back inside), and which results masked stores write.

use std::collections::{BTreeSet, HashMap};

use kda_core::DType;

use super::{get, zeros, Refs, Step};
use crate::error::Result;
use crate::hlo::{Cmp, FnBuilder, TensorType, Value};
use crate::lang::ir::{Offset, Op, Place, Ref, V};

impl Step<'_> {
    /// `out` read from `from` at `offsets`; with `rows`, zero from that row on.
    pub(super) fn load(
        &self,
        b: &mut FnBuilder,
        (out, from): (&V, Ref),
        (offsets, rows): (&[Offset], &Option<V>),
        vals: &HashMap<u32, Value>,
        refs: &Refs,
    ) -> Result<Value> {
        let offs = self.offsets(b, offsets, vals)?;
        let dims = &out.ty.dims;
        let Some(n) = rows else { return b.dynamic_slice(refs.get(from), &offs, dims) };
        let n = get(vals, n)?;
        let padded = past_end(b, refs.get(from), dims[0])?;
        let x = b.dynamic_slice(padded, &offs, dims)?;
        let zero = zeros(b, &TensorType::new(out.ty.elem, dims))?;
        let kept = rows_below(b, dims, n)?;
        b.select(kept, x, zero)
    }

    /// `value` written into `to` at `offsets`; with `rows`, only the rows below it (the others
    /// keep what memory held).
    pub(super) fn store(
        &self,
        b: &mut FnBuilder,
        to: Ref,
        offsets: &[Offset],
        (value, rows): (&V, &Option<V>),
        vals: &HashMap<u32, Value>,
        refs: &mut Refs,
    ) -> Result<()> {
        let offs = self.offsets(b, offsets, vals)?;
        let v = get(vals, value)?;
        let updated = match rows {
            None => b.dynamic_update_slice(refs.get(to), v, &offs)?,
            Some(n) => {
                let n = get(vals, n)?;
                let whole = refs.get(to);
                let end = whole.dims()[0];
                let dims = &value.ty.dims;
                let padded = past_end(b, whole, dims[0])?;
                let held = b.dynamic_slice(padded, &offs, dims)?;
                let kept = rows_below(b, dims, n)?;
                let v = b.select(kept, v, held)?;
                let padded = b.dynamic_update_slice(padded, v, &offs)?;
                b.slice_axis(padded, 0, 0, end)?
            }
        };
        refs.set(to, updated);
        Ok(())
    }
}

/// `x` with `n` zero rows past its end (dim 0).
fn past_end(b: &mut FnBuilder, x: Value, n: i64) -> Result<Value> {
    let dims = x.dims().to_vec();
    let zero = zeros(b, &TensorType::scalar(x.elem()))?;
    let (lo, mut hi) = (vec![0; dims.len()], vec![0; dims.len()]);
    hi[0] = n;
    b.pad(x, zero, &lo, &hi, &vec![0; dims.len()])
}

/// An i1 `dims` mask: the rows (dim 0) below the i32 scalar `n`.
fn rows_below(b: &mut FnBuilder, dims: &[i64], n: Value) -> Result<Value> {
    let row = b.iota(TensorType::new(DType::I32, dims), 0)?;
    let n = b.broadcast_in_dim(n, dims, &[])?;
    b.compare(Cmp::Lt, row, n)
}

/// The results that `ops` write with masked stores.
pub(super) fn masked_stores(ops: &[Op], into: &mut BTreeSet<usize>) {
    for op in ops {
        match op {
            Op::Store { to: Ref { place: Place::Output(i), .. }, rows: Some(_), .. } => {
                into.insert(*i);
            }
            Op::If { then, .. } => masked_stores(then, into),
            Op::For { body, .. } => masked_stores(body, into),
            _ => {}
        }
    }
}
