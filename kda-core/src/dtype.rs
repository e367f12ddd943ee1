//! Element types: f32 and bf16 for the kernels, f64 for the reference.

use std::fmt;

/// The element type of a host tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision; the kernels' accumulation type.
    F32,
    /// bfloat16 (via `half`); inputs only, accumulation stays f32.
    BF16,
    /// IEEE double precision; the reference's working type.
    F64,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
            DType::F64 => 8,
        }
    }
    /// Parses `f32`, `bf16` or `f64`.
    pub fn parse(s: &str) -> Option<DType> {
        match s {
            "f32" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f64" | "float64" => Some(DType::F64),
            _ => None,
        }
    }
    /// Rounds an f64 value to this dtype and back, the way a stored element would be.
    pub fn round(self, x: f64) -> f64 {
        match self {
            DType::F64 => x,
            DType::F32 => x as f32 as f64,
            DType::BF16 => half::bf16::from_f64(x).to_f64(),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
        })
    }
}
