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
    compact_gradients_into(plan, shape, aligned, &mut packed)?;
    Ok(packed)
}

/// Compacts into `packed`: real tokens from their chunk slots, padding tokens set to exactly 0.
pub fn compact_gradients_into<T: Copy + Default>(
    plan: &SegmentPlan,
    shape: PackedShape,
    aligned: &[T],
    packed: &mut [T],
) -> Result<()> {
    packed.fill(T::default());
    scatter_real_tokens(plan, shape, aligned, packed)
}

/// Writes each chunk's real tokens to their packed positions; nothing else is touched.
fn scatter_real_tokens<T: Copy>(
    plan: &SegmentPlan,
    shape: PackedShape,
    aligned: &[T],
    packed: &mut [T],
) -> Result<()> {
    let a = shape.plan_aligned(plan, packed.len(), aligned.len())?;
    for (dst, src, n) in shape.chunk_runs(plan, a) {
        packed[dst..dst + n].copy_from_slice(&aligned[src..src + n]);
    }
    Ok(())
}

/// The aligned shape of `shape` at the tables' capacity, once the tables, their fit to
/// `shape` and an aligned tensor of `len` elements are checked.
fn checked_aligned(tables: &IndexTables, shape: PackedShape, len: usize) -> Result<AlignedShape> {
    tables.check()?;
    shape.check_tables(tables)?;
    let a = shape.aligned(tables.capacity, tables.c);
    a.check_len("aligned", len)?;
    Ok(a)
}

/// Compaction through the tables, as a device scatter does: slot `s` writes token `slot_token[s]`.
pub fn compact_with_tables<T: Copy + Default>(
    tables: &IndexTables,
    shape: PackedShape,
    aligned: &[T],
) -> Result<Vec<T>> {
    let a = checked_aligned(tables, shape, aligned.len())?;
    let d = a.d;
    let mut packed = vec![T::default(); shape.len()];
    for (dst, src) in shape.slot_moves(tables, a) {
        packed[dst..dst + d].copy_from_slice(&aligned[src..src + d]);
    }
    Ok(packed)
}

/// The gather path: every packed token reads slot `token_slot[tok]`, padding tokens get 0.
pub fn gather_gradients<T: Copy + Default>(
    tables: &IndexTables,
    shape: PackedShape,
    aligned: &[T],
) -> Result<Vec<T>> {
    let a = checked_aligned(tables, shape, aligned.len())?;
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

/// How an aligned tensor goes back to its packed tokens: compacted along a segment plan, or
/// gathered through the index tables.
#[derive(Clone, Copy)]
enum Route<'a> {
    Compact(&'a SegmentPlan),
    Gather(&'a IndexTables),
}

impl Route<'_> {
    /// Chunks, chunk size, rows and tokens per row.
    fn sizes(&self) -> (usize, usize, usize, usize) {
        match self {
            Route::Compact(p) => (p.num_chunks(), p.chunk_size(), p.b(), p.t()),
            Route::Gather(t) => (t.capacity, t.c, t.b, t.t),
        }
    }

    fn apply<T: Copy + Default>(&self, shape: PackedShape, aligned: &[T]) -> Result<Vec<T>> {
        match self {
            Route::Compact(p) => compact_gradients(p, shape, aligned),
            Route::Gather(t) => gather_gradients(t, shape, aligned),
        }
    }

    /// An aligned `[H, NT, C, D]` tensor (or, with `like`, a scalar `[H, NT, C]` returned in the
    /// shape `like`) at its packed tokens.
    fn tensor(&self, layout: Layout, aligned: &HostTensor, like: Option<&[usize]>) -> Result<HostTensor> {
        let (chunks, c, b, t) = self.sizes();
        let a = AlignedShape::of_dims(aligned.shape(), like.is_some())?;
        a.check_chunks(chunks, c)?;
        let shape = match like {
            Some(like) => scalar_target(layout, a.h, b, t, like)?,
            None => PackedShape::new(layout, a.h, b, t, a.d),
        };
        let data = map_data!(aligned.data(), v => self.apply(shape, v)?);
        match like {
            Some(like) => HostTensor::new(like, data),
            None => HostTensor::new(&shape.dims(), data),
        }
    }
}

/// Compacts an aligned `[H, NT, C, D]` tensor into `[H,B,T,D]` / `[B,T,H,D]` (same dtype).
pub fn compact_tensor(plan: &SegmentPlan, layout: Layout, aligned: &HostTensor) -> Result<HostTensor> {
    Route::Compact(plan).tensor(layout, aligned, None)
}

/// Compacts an aligned scalar `[H, NT, C]` into the caller's scalar shape `like` (e.g. beta's).
pub fn compact_scalar_tensor(
    plan: &SegmentPlan,
    layout: Layout,
    aligned: &HostTensor,
    like: &[usize],
) -> Result<HostTensor> {
    Route::Compact(plan).tensor(layout, aligned, Some(like))
}

/// The gather path for an aligned `[H, capacity, C, D]` tensor.
pub fn gather_tensor(tables: &IndexTables, layout: Layout, aligned: &HostTensor) -> Result<HostTensor> {
    Route::Gather(tables).tensor(layout, aligned, None)
}

/// The gather path for an aligned scalar `[H, capacity, C]`, returned in the shape `like`.
pub fn gather_scalar_tensor(
    tables: &IndexTables,
    layout: Layout,
    aligned: &HostTensor,
    like: &[usize],
) -> Result<HostTensor> {
    Route::Gather(tables).tensor(layout, aligned, Some(like))
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
