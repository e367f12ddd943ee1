//! The chunked KDA programs (spec section 4) as StableHLO, built with [`crate::hlo`].

mod intra;
mod ops;
mod prep;
mod programs;
mod recurrence;
mod solve;
mod spec;

pub use programs::{backward_program, forward_program, fused_program, GATE_FLOOR};
pub use spec::{KernelSpec, CHUNK, SUB};
