//! A small typed StableHLO builder: values carry tensor types, ops check operands when built,
//! and a [`Module`] emits deterministic StableHLO text (generic op syntax) for PJRT.

mod builder;
mod control;
mod emit;
mod error;
mod fmt;
mod ops_collective;
mod ops_custom;
mod ops_elementwise;
mod ops_index;
mod ops_linalg;
mod ops_reduce;
mod ops_shape;
mod types;

pub use builder::FnBuilder;
pub use emit::Module;
pub use ops_linalg::{Transpose, TriangularSolve};
pub use types::{Cmp, Precision, TensorType, Value, MAX_RANK};

#[cfg(test)]
mod tests;
