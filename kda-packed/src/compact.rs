//! Gradient compaction: aligned `[H, NT, C, D]` results written straight back to their packed
//! token positions, plus the gather path (read every packed token through the index table) that
//! serves as its cross-check. Padding tokens come out exactly 0 on both paths.

use crate::dispatch::map_data;
use crate::layout::{AlignedShape, PackedShape};
use crate::plan::SegmentPlan;
use crate::tables::IndexTables;
use kda_core::{fmt_shape, HostTensor, KdaError, Layout, Result};

/// Compacts an aligned buffer into a new packed buffer of `shape` (padding tokens 0).
pub fn compact_gradients<T: Copy + Default>(
    plan: &SegmentPlan,
    shape: PackedShape,
    aligned: &[T],
) -> Result<Vec<T>> {
    let mut packed = vec![T::default(); shape.len()];
    scatter_real_tokens(plan, shape, aligned, &mut packed)?;
    Ok(packed)
}

/// Compacts into `packed`: real tokens from their chunk slots, padding tokens set to exactly 0.
pub fn compact_gradients_into<T: Copy + Default>(
    plan: &SegmentPlan,
    shape: PackedShape,
    aligned: &[T],
    packed: &mut [T],
) -> Result<()> {
    scatter_real_tokens(plan, shape, aligned, packed)?;
    let mut row_end = vec![0usize; shape.b];
    for s in plan.segments() {
        row_end[s.row] = row_end[s.row].max(s.start + s.len);
    }
    for h in 0..shape.h {
        for (b, &end) in row_end.iter().enumerate() {
            for t in end..shape.t {
                let dst = shape.token_offset(h, b * shape.t + t);
                packed[dst..dst + shape.d].fill(T::default());
            }
        }
    }
    Ok(())
}

/// Writes each chunk's real tokens to their packed positions; nothing else is touched.
fn scatter_real_tokens<T: Copy>(
    plan: &SegmentPlan,
    shape: PackedShape,
    aligned: &[T],
    packed: &mut [T],
) -> Result<()> {
    shape.check_plan(plan)?;
    shape.check_len("packed", packed.len())?;
    let a = shape.aligned(plan.num_chunks(), plan.chunk_size());
    a.check_len("aligned", aligned.len())?;
    let d = a.d;
    for h in 0..shape.h {
        for (ci, ch) in plan.chunks().iter().enumerate() {
            let tok0 = ch.row * shape.t + ch.start;
            let src0 = a.slot_offset(h, ci * a.c);
            if shape.layout == Layout::HeadFirst {
                let dst0 = shape.token_offset(h, tok0);
                packed[dst0..dst0 + ch.len * d].copy_from_slice(&aligned[src0..src0 + ch.len * d]);
            } else {
                for i in 0..ch.len {
                    let dst = shape.token_offset(h, tok0 + i);
                    let src = src0 + i * d;
                    packed[dst..dst + d].copy_from_slice(&aligned[src..src + d]);
                }
            }
        }
    }
    Ok(())
}

/// Compaction through the tables, as a device scatter does: slot `s` writes token `slot_token[s]`.
pub fn compact_with_tables<T: Copy + Default>(
    tables: &IndexTables,
    shape: PackedShape,
    aligned: &[T],
) -> Result<Vec<T>> {
    tables.check()?;
    shape.check_tables(tables)?;
    let a = shape.aligned(tables.capacity, tables.c);
    a.check_len("aligned", aligned.len())?;
    let d = a.d;
    let mut packed = vec![T::default(); shape.len()];
    for h in 0..shape.h {
        for (s, &tok) in tables.slot_token.iter().enumerate() {
            if let Ok(tok) = usize::try_from(tok) {
                let (src, dst) = (a.slot_offset(h, s), shape.token_offset(h, tok));
                packed[dst..dst + d].copy_from_slice(&aligned[src..src + d]);
            }
        }
    }
    Ok(packed)
}

/// The gather path: every packed token reads slot `token_slot[tok]`, padding tokens get 0.
pub fn gather_gradients<T: Copy + Default>(
    tables: &IndexTables,
    shape: PackedShape,
    aligned: &[T],
) -> Result<Vec<T>> {
    tables.check()?;
    shape.check_tables(tables)?;
    let a = shape.aligned(tables.capacity, tables.c);
    a.check_len("aligned", aligned.len())?;
    let d = a.d;
    let mut packed = vec![T::default(); shape.len()];
    for h in 0..shape.h {
        for (tok, &slot) in tables.token_slot.iter().enumerate() {
            let dst = shape.token_offset(h, tok);
            match usize::try_from(slot) {
                Ok(slot) => {
                    let src = a.slot_offset(h, slot);
                    packed[dst..dst + d].copy_from_slice(&aligned[src..src + d]);
                }
                Err(_) => packed[dst..dst + d].fill(T::default()),
            }
        }
    }
    Ok(packed)
}

/// Compacts an aligned `[H, NT, C, D]` tensor into `[H,B,T,D]` / `[B,T,H,D]` (same dtype).
pub fn compact_tensor(plan: &SegmentPlan, layout: Layout, aligned: &HostTensor) -> Result<HostTensor> {
    let a = AlignedShape::of_dims(aligned.shape(), false)?;
    a.check_chunks(plan.num_chunks(), plan.chunk_size())?;
    let shape = PackedShape::new(layout, a.h, plan.b(), plan.t(), a.d);
    let data = map_data!(aligned.data(), v => compact_gradients(plan, shape, v)?);
    HostTensor::new(&shape.dims(), data)
}

/// Compacts an aligned scalar `[H, NT, C]` into the caller's scalar shape `like` (e.g. beta's).
pub fn compact_scalar_tensor(
    plan: &SegmentPlan,
    layout: Layout,
    aligned: &HostTensor,
    like: &[usize],
) -> Result<HostTensor> {
    let a = AlignedShape::of_dims(aligned.shape(), true)?;
    a.check_chunks(plan.num_chunks(), plan.chunk_size())?;
    let shape = scalar_target(layout, a.h, plan.b(), plan.t(), like)?;
    let data = map_data!(aligned.data(), v => compact_gradients(plan, shape, v)?);
    HostTensor::new(like, data)
}

/// The gather path for an aligned `[H, capacity, C, D]` tensor.
pub fn gather_tensor(tables: &IndexTables, layout: Layout, aligned: &HostTensor) -> Result<HostTensor> {
    let a = AlignedShape::of_dims(aligned.shape(), false)?;
    a.check_chunks(tables.capacity, tables.c)?;
    let shape = PackedShape::new(layout, a.h, tables.b, tables.t, a.d);
    let data = map_data!(aligned.data(), v => gather_gradients(tables, shape, v)?);
    HostTensor::new(&shape.dims(), data)
}

/// The gather path for an aligned scalar `[H, capacity, C]`, returned in the shape `like`.
pub fn gather_scalar_tensor(
    tables: &IndexTables,
    layout: Layout,
    aligned: &HostTensor,
    like: &[usize],
) -> Result<HostTensor> {
    let a = AlignedShape::of_dims(aligned.shape(), true)?;
    a.check_chunks(tables.capacity, tables.c)?;
    let shape = scalar_target(layout, a.h, tables.b, tables.t, like)?;
    let data = map_data!(aligned.data(), v => gather_gradients(tables, shape, v)?);
    HostTensor::new(like, data)
}

fn scalar_target(layout: Layout, h: usize, b: usize, t: usize, like: &[usize]) -> Result<PackedShape> {
    let shape = PackedShape::of_scalars(layout, like).map_err(|e| e.with_arg("like"))?;
    if (shape.h, shape.b, shape.t) != (h, b, t) {
        let want = layout.scalar_shape(h, b, t);
        return Err(KdaError::shape(
            "like",
            format!("{} (optionally with a trailing 1)", fmt_shape(&want)),
            fmt_shape(like),
        ));
    }
    Ok(shape)
}
