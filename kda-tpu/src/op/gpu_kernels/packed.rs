//! Where packed rows read in place ([`super::TokenLayout::Packed`],
//! [`super::TokenLayout::PackedLanes`]) put each chunk position: its first token and the rows it
//! writes, derived by XLA from the token tables.

use kda_core::DType;

use super::{PackedTables, C};
use crate::error::TpuError;
use crate::hlo::{Cmp, FnBuilder, TensorType, Value};
use crate::op::args::Args;
use crate::op::spec::ProgramSpec;
use crate::Result;

/// Where each chunk position of packed rows read in place reads and writes the caller's tokens
/// (`valid` `[NT]`: its tokens). A used position starts at its first token and writes its
/// tokens, the last of a batch row's also the row's trailing padding up to 64 rows; the unused
/// positions (after the used ones) each take the next 64 rows of that padding past the rows'
/// last chunks (the plan's capacity holds them: a row's chunks with its padding as part of its
/// last segment are a segmentation of the row), reading nothing, writing zeros.
pub(super) fn packed_tables(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    valid: Value,
) -> Result<PackedTables> {
    let (bb, t, nt) = (s.dims.b as i64, s.dims.t as i64, s.chunks() as i64);
    let (Some(slot_token), Some(token_slot)) = (a.slot_token, a.token_slot) else {
        return Err(TpuError::builder("triton packed rows", "internal: no token tables"));
    };
    let i32t = |dims: &[i64]| TensorType::new(DType::I32, dims);
    let splat = |f: &mut FnBuilder, x: i64, dims: &[i64]| f.constant_i32(x as i32, i32t(dims));
    let c = splat(f, C, &[nt])?;
    let tt = splat(f, t, &[nt])?;
    let zero = splat(f, 0, &[nt])?;
    // Used positions: their first token (a slot's token) and rows to the end of their batch row.
    let first = f.reshape(slot_token, &[nt, C])?;
    let first = f.slice_axis(first, 1, 0, 1)?;
    let first = f.reshape(first, &[nt])?;
    let used = f.compare(Cmp::Gt, valid, zero)?;
    let first = f.select(used, first, zero)?;
    let row = f.div(first, tt)?;
    let one = splat(f, 1, &[nt])?;
    let next_row = f.add(row, one)?;
    let row_end = f.mul(next_row, tt)?;
    let after = f.add(first, valid)?;
    let last_token = splat(f, bb * t - 1, &[nt])?;
    let peek = f.min(after, last_token)?;
    let peek = f.gather_axis(token_slot, 0, peek)?;
    let pad_slot = splat(f, nt * C, &[nt])?;
    let padding_next = f.compare(Cmp::Eq, peek, pad_slot)?;
    let row_ends = f.compare(Cmp::Eq, after, row_end)?;
    let ends_row = f.or(padding_next, row_ends)?;
    let to_end = f.sub(row_end, first)?;
    let to_end = f.min(to_end, c)?;
    let written = f.select(ends_row, to_end, valid)?;
    // Each batch row's first token not written by its used positions, and the 64-row pieces
    // of padding from there to its end.
    let bn = [bb, nt];
    let b_of = f.iota(i32t(&bn), 0)?;
    let row_n = f.broadcast_in_dim(row, &bn, &[1])?;
    let mine = f.compare(Cmp::Eq, row_n, b_of)?;
    let used_n = f.broadcast_in_dim(used, &bn, &[1])?;
    let mine = f.and(mine, used_n)?;
    let reach = f.add(first, written)?;
    let reach = f.broadcast_in_dim(reach, &bn, &[1])?;
    let tb = splat(f, t, &bn)?;
    let row_start = f.mul(b_of, tb)?;
    let reach = f.select(mine, reach, row_start)?;
    let from = f.reduce_max(reach, &[1])?;
    let b1 = f.iota(i32t(&[bb]), 0)?;
    let ones = splat(f, 1, &[bb])?;
    let b1 = f.add(b1, ones)?;
    let tb1 = splat(f, t, &[bb])?;
    let end = f.mul(b1, tb1)?;
    let left = f.sub(end, from)?;
    let c63 = splat(f, C - 1, &[bb])?;
    let cb = splat(f, C, &[bb])?;
    let pieces = f.add(left, c63)?;
    let pieces = f.div(pieces, cb)?;
    // Pieces before each row (an exclusive prefix sum over B).
    let bbd = [bb, bb];
    let at = f.iota(i32t(&bbd), 0)?;
    let before = f.iota(i32t(&bbd), 1)?;
    let earlier = f.compare(Cmp::Lt, before, at)?;
    let wide = f.broadcast_in_dim(pieces, &bbd, &[1])?;
    let zb = splat(f, 0, &bbd)?;
    let kept = f.select(earlier, wide, zb)?;
    let offset = f.reduce_sum(kept, &[1])?;
    // Unused position `c` takes piece `c - used` of the rows' pieces in order.
    let used_i = f.convert(used, DType::I32)?;
    let n_used = f.reduce_sum(used_i, &[0])?;
    let n_used = f.broadcast_in_dim(n_used, &[nt], &[])?;
    let pos = f.iota(i32t(&[nt]), 0)?;
    let piece = f.sub(pos, n_used)?;
    let nb = [nt, bb];
    let piece_n = f.broadcast_in_dim(piece, &nb, &[0])?;
    let ends = f.add(offset, pieces)?;
    let ends = f.broadcast_in_dim(ends, &nb, &[1])?;
    let passed = f.compare(Cmp::Le, ends, piece_n)?;
    let passed = f.convert(passed, DType::I32)?;
    let owner = f.reduce_sum(passed, &[1])?;
    let owner_n = f.broadcast_in_dim(owner, &nb, &[0])?;
    let b_of = f.iota(i32t(&nb), 1)?;
    let pick = f.compare(Cmp::Eq, b_of, owner_n)?;
    let zn = splat(f, 0, &nb)?;
    let chosen = |f: &mut FnBuilder, x: Value| -> Result<Value> {
        let x = f.broadcast_in_dim(x, &nb, &[1])?;
        let x = f.select(pick, x, zn)?;
        f.reduce_sum(x, &[1])
    };
    let (p_from, p_offset, p_end) = (chosen(f, from)?, chosen(f, offset)?, chosen(f, end)?);
    let k = f.sub(piece, p_offset)?;
    let k = f.mul(k, c)?;
    let p_first = f.add(p_from, k)?;
    let p_left = f.sub(p_end, p_first)?;
    let p_written = f.min(p_left, c)?;
    let b_count = splat(f, bb, &[nt])?;
    let owned = f.compare(Cmp::Lt, owner, b_count)?;
    let unused = f.compare(Cmp::Le, valid, zero)?;
    let owned = f.and(owned, unused)?;
    let p_first = f.select(owned, p_first, zero)?;
    let p_written = f.select(owned, p_written, zero)?;
    Ok(PackedTables { start: f.select(used, first, p_first)?, written: f.select(used, written, p_written)? })
}
