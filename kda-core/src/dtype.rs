//! The element types of the workspace: f32 and bf16 for the kernels' inputs, f64 for the
//! reference, and the integer and boolean types the device programs use for index tables,
//! bf16 bit patterns and masks. Host tensors hold the three float types.

use std::fmt;

/// An element type, spelled as in StableHLO (`f32`, `bf16`, `f64`, `i32`, `ui16`, `i1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// IEEE single precision; the kernels' accumulation type.
    F32,
    /// bfloat16 (via `half`); inputs only, accumulation stays f32.
    BF16,
    /// IEEE double precision; the reference's working type.
    F64,
    /// Signed 32-bit integer: index tables and loop counters on the device.
    I32,
    /// Unsigned 16-bit integer: bf16 bit patterns on the device.
    U16,
    /// Boolean: comparison results and masks on the device.
    I1,
}

const NAMES: [(DType, &str); 6] = [
    (DType::F32, "f32"),
    (DType::BF16, "bf16"),
    (DType::F64, "f64"),
    (DType::I32, "i32"),
    (DType::U16, "ui16"),
    (DType::I1, "i1"),
];

impl DType {
    /// The StableHLO / MLIR spelling (`f32`, `bf16`, `f64`, `i32`, `ui16`, `i1`).
    pub fn name(self) -> &'static str {
        NAMES.iter().find(|(d, _)| *d == self).map_or("?", |(_, n)| n)
    }
    /// Parses a StableHLO spelling, or the long float names `float32`, `bfloat16`, `float64`.
    pub fn parse(s: &str) -> Option<DType> {
        let s = match s {
            "float32" => "f32",
            "bfloat16" => "bf16",
            "float64" => "f64",
            s => s,
        };
        NAMES.iter().find(|(_, n)| *n == s).map(|(d, _)| *d)
    }
    /// True for the float types, the ones host tensors hold.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F64)
    }
    /// True for the integer types `I32` and `U16` (not `I1`).
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::U16)
    }
    /// Storage width in bits (1 for `I1`).
    pub fn bit_width(self) -> u32 {
        match self {
            DType::F64 => 64,
            DType::F32 | DType::I32 => 32,
            DType::BF16 | DType::U16 => 16,
            DType::I1 => 1,
        }
    }
    /// Size of one element in host memory, in bytes (a boolean takes one).
    pub fn size_bytes(self) -> usize {
        (self.bit_width() as usize).div_ceil(8)
    }
    /// Rounds an f64 value to this dtype and back, the way a stored element would be: to
    /// nearest (even) for the floats, to the nearest representable integer (saturating) for
    /// the integers, to 0 or 1 for `I1`.
    pub fn round(self, x: f64) -> f64 {
        match self {
            DType::F64 => x,
            DType::F32 => x as f32 as f64,
            DType::BF16 => half::bf16::from_f64(x).to_f64(),
            DType::I32 => x.round() as i32 as f64,
            DType::U16 => x.round() as u16 as f64,
            DType::I1 => f64::from(u8::from(x != 0.0)),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[rstest::rstest]
    #[case::f32(DType::F32)]
    #[case::bf16(DType::BF16)]
    #[case::f64(DType::F64)]
    #[case::i32(DType::I32)]
    #[case::u16(DType::U16)]
    #[case::i1(DType::I1)]
    fn names_parse_back(#[case] d: DType) {
        assert_eq!(DType::parse(d.name()), Some(d));
        assert_eq!(d.to_string(), d.name());
    }

    #[test]
    fn long_float_names_parse() {
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("float64"), Some(DType::F64));
        assert_eq!(DType::parse("f16"), None);
    }
}
