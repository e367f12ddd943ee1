//! The contract of Kimi Delta Attention kernels: shapes, layouts, dtypes, options, segment
//! metadata, validated problems, typed errors and the [`Backend`] trait.
//!
//! The math and conventions are those of `docs/kda.md` (Recurrence, Tensors, Packing, Shapes); every violation of the
//! contract is a [`KdaError`] that names the argument, what was expected and what came.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod backend;
pub mod cache_file;
mod config;
mod dtype;
mod error;
mod io;
mod problem;
mod segments;
mod shape;
mod tensor;

pub use backend::{Backend, Residuals};
pub use config::{BackwardStrategy, GateKind, GateMode, Implementation, KdaConfig, CHUNK, L2NORM_EPS, MAX_K};
pub use dtype::DType;
pub use error::{ErrorKind, ErrorSource, KdaError, Result};
pub use half::bf16;
pub use io::{Cotangents, KdaGradients, KdaInputs, KdaOutputs, Tensors};
pub use problem::{validate_cotangent_shapes, InputsView, Problem, TensorMeta};
pub use segments::{SegmentTable, Segments};
pub use shape::{fmt_shape, shape, Layout, ProblemDims, Shape};
pub use tensor::{ElementsMut, HostTensor, TensorData, ValueRange};
