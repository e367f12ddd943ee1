//! The XLA implementation of the KDA op: the chunk loops as StableHLO (docs/kda.md, Chunks),
//! built with [`crate::hlo`]: the chunk-local terms through decay tiles, the WY solve and the
//! state and `dh` recurrences.

mod grads;
mod intra;
#[cfg(feature = "harness")]
pub mod parts;
mod programs;
mod recurrence;
mod solve;
mod tiles;

pub(super) use programs::{backward, finish_chunk_grads, forward, fused};
