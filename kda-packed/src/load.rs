//! Segment loading: packed per-token tensors gathered into the chunk-aligned layout
//! `[H, NT, C, D]`, every segment starting a new chunk, padding slots zero.

use crate::dispatch::map_data;
use crate::layout::{AlignedShape, PackedShape};
use crate::plan::SegmentPlan;
use crate::tables::IndexTables;
use kda_core::{HostTensor, Layout, Result};

/// Loads a packed tensor of `shape` into a new aligned buffer `[H, NT, C, D]`.
pub fn load_segments<T: Copy + Default>(
    plan: &SegmentPlan,
    shape: PackedShape,
    packed: &[T],
) -> Result<Vec<T>> {
    let mut aligned = vec![T::default(); shape.aligned(plan.num_chunks(), plan.chunk_size()).len()];
    load_segments_into(plan, shape, packed, &mut aligned)?;
    Ok(aligned)
}

/// Loads a packed tensor into `aligned` (`[H, NT, C, D]`), writing every slot (padding slots zero).
pub fn load_segments_into<T: Copy + Default>(
    plan: &SegmentPlan,
    shape: PackedShape,
    packed: &[T],
    aligned: &mut [T],
) -> Result<()> {
    let a = shape.plan_aligned(plan, packed.len(), aligned.len())?;
    aligned.fill(T::default());
    for (src, dst, n) in shape.chunk_runs(plan, a) {
        aligned[dst..dst + n].copy_from_slice(&packed[src..src + n]);
    }
    Ok(())
}

/// Loads through the `i32` tables, as a device gather does: slot `s` reads token `slot_token[s]`.
///
/// The result is `[H, capacity, C, D]`; padding slots and unused chunks are zero.
pub fn load_with_tables<T: Copy + Default>(
    tables: &IndexTables,
    shape: PackedShape,
    packed: &[T],
) -> Result<Vec<T>> {
    tables.check()?;
    shape.check_tables(tables)?;
    shape.check_len("packed", packed.len())?;
    let a = shape.aligned(tables.capacity, tables.c);
    let d = a.d;
    let mut aligned = vec![T::default(); a.len()];
    for (src, dst) in shape.slot_moves(tables, a) {
        aligned[dst..dst + d].copy_from_slice(&packed[src..src + d]);
    }
    Ok(aligned)
}

/// Loads a per-token tensor (`[H,B,T,D]` / `[B,T,H,D]`, any dtype) into `[H, NT, C, D]`.
pub fn load_tensor(plan: &SegmentPlan, layout: Layout, packed: &HostTensor) -> Result<HostTensor> {
    let shape = PackedShape::of_tokens(layout, packed.shape())?;
    let a = shape.aligned(plan.num_chunks(), plan.chunk_size());
    let data = map_data!(packed.data(), v => load_segments(plan, shape, v)?);
    HostTensor::new(&a.dims(), data)
}

/// Loads a per-token scalar (`[H,B,T]` / `[B,T,H]`, optional trailing 1) into `[H, NT, C]`.
pub fn load_scalar_tensor(plan: &SegmentPlan, layout: Layout, packed: &HostTensor) -> Result<HostTensor> {
    let shape = PackedShape::of_scalars(layout, packed.shape())?;
    let a = shape.aligned(plan.num_chunks(), plan.chunk_size());
    let data = map_data!(packed.data(), v => load_segments(plan, shape, v)?);
    HostTensor::new(&[a.h, a.chunks, a.c], data)
}

/// Loads a per-token tensor through the tables into `[H, capacity, C, D]`.
pub fn load_tensor_with_tables(
    tables: &IndexTables,
    layout: Layout,
    packed: &HostTensor,
) -> Result<HostTensor> {
    let shape = PackedShape::of_tokens(layout, packed.shape())?;
    let a: AlignedShape = shape.aligned(tables.capacity, tables.c);
    let data = map_data!(packed.data(), v => load_with_tables(tables, shape, v)?);
    HostTensor::new(&a.dims(), data)
}
