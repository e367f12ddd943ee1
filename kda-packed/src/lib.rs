//! Packed (variable-length) batches for Kimi Delta Attention (docs/kda.md, Packing and Chunks): the chunk
//! plan, segment loading into the chunk-aligned layout and gradient compaction back out of it.
//!
//! Every segment starts a new chunk of `C` tokens. The aligned layout of a per-token tensor is
//! `[H, NT, C, D]` where `NT` is the plan's exact chunk count (or a static capacity); slot
//! `chunk * C + i` holds token `i` of that chunk and padding slots are zero. Packed tokens are
//! numbered `b * T + t` in the `i32` index tables that device programs use.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod compact;
mod dispatch;
mod layout;
mod load;
mod pieces;
mod plan;
mod rows;
mod static_plan;
mod tables;

pub use compact::{
    compact_gradients, compact_gradients_into, compact_scalar_tensor, compact_tensor, compact_with_tables,
    gather_gradients, gather_scalar_tensor, gather_tensor,
};
pub use layout::{AlignedShape, PackedShape};
pub use load::{
    load_scalar_tensor, load_segments, load_segments_into, load_tensor, load_tensor_with_tables,
    load_with_tables,
};
pub use pieces::{Part, PiecePlan};
pub use plan::{check_chunk_size, ChunkInfo, SegmentInfo, SegmentPlan, CHUNK_SIZES};
pub use rows::{batch_axis, join_problems, RowPlan};
pub use static_plan::{StaticCapacity, StaticPlan};
pub use tables::{IndexTables, SENTINEL};
