//! Builder errors are the crate's `TpuError::Builder { op, message }`, naming the op and the shapes.

pub(crate) use crate::error::Result;
use crate::error::TpuError;

/// The builder error for `op` with `message`.
pub(crate) fn err(op: &str, message: impl Into<String>) -> TpuError {
    TpuError::builder(op, message)
}
