//! The text forms the ops and the module share: type lists, dense arrays, exact float
//! literals, symbol names.

use super::error::{err, Result};
use super::types::TensorType;
use kda_core::DType;

/// `t1, t2, ...` (operand type lists inside parentheses).
pub(crate) fn fmt_types(types: &[TensorType]) -> String {
    types.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// `t` for one result, `(t1, t2)` otherwise.
pub(crate) fn fmt_result_types(types: &[TensorType]) -> String {
    if types.len() == 1 {
        types[0].to_string()
    } else {
        format!("({})", fmt_types(types))
    }
}

/// `array<i64: 1, 2>` (`array<i64>` when empty): the dense-array attribute form plugins accept.
pub(crate) fn fmt_array(xs: &[i64]) -> String {
    if xs.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", join(xs))
    }
}

/// `[1, 2]` (lists inside `#stablehlo.dot<...>` and `#stablehlo.gather<...>`).
pub(crate) fn fmt_list(xs: &[i64]) -> String {
    format!("[{}]", join(xs))
}

fn join(xs: &[i64]) -> String {
    xs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// An exact, deterministic float literal for a splat of `elem`: shortest round-trip decimal
/// with a mantissa dot (`1.0e-2`), or the bit pattern in hex for inf/nan.
pub(crate) fn fmt_float(x: f32, elem: DType) -> String {
    if x.is_finite() {
        let s = format!("{x:e}");
        match s.split_once('e') {
            Some((m, e)) if !m.contains('.') => format!("{m}.0e{e}"),
            _ => s,
        }
    } else if elem == DType::BF16 {
        format!("0x{:04X}", (x.to_bits() >> 16) as u16 | if x.is_nan() { 0x40 } else { 0 })
    } else if elem == DType::F64 {
        format!("0x{:016X}", f64::from(x).to_bits())
    } else {
        format!("0x{:08X}", x.to_bits())
    }
}

/// Symbol names are plain identifiers: `[A-Za-z_][A-Za-z0-9_.$]*`.
pub(crate) fn check_symbol(op: &str, name: &str) -> Result<()> {
    let mut chars = name.chars();
    let ok_first = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if ok_first && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '$')) {
        Ok(())
    } else {
        Err(err(op, format!("bad symbol name {name:?} (want [A-Za-z_][A-Za-z0-9_.$]*)")))
    }
}
