//! The `arith` dialect's spellings of the body's ops and constants, shared by the Mosaic and
//! Triton lowerings (both MLIR).

use std::collections::HashMap;

use kda_core::DType;

use crate::error::{Result, TpuError};
use crate::hlo::Cmp;
use crate::lang::ir::{Binary, V};

/// `Deref` and `DerefMut` of an emitter struct to its `t: Text`, so that both lowerings write
/// through the same [`Text`] methods.
macro_rules! derefs_to_text {
    ($emitter:ident) => {
        impl std::ops::Deref for $emitter<'_> {
            type Target = super::arith::Text;
            fn deref(&self) -> &super::arith::Text {
                &self.t
            }
        }
        impl std::ops::DerefMut for $emitter<'_> {
            fn deref_mut(&mut self) -> &mut super::arith::Text {
                &mut self.t
            }
        }
    };
}
pub(super) use derefs_to_text;

/// MLIR text being written: its lines at their indentation, numbered temporaries, and the
/// names given to the body's values.
pub(super) struct Text {
    pub(super) out: String,
    pub(super) names: HashMap<u32, String>,
    pub(super) temps: u32,
    pub(super) depth: usize,
    /// Who writes it, for errors.
    what: &'static str,
}

impl Text {
    pub(super) fn new(what: &'static str) -> Self {
        Text { out: String::new(), names: HashMap::new(), temps: 0, depth: 0, what }
    }
    /// Appends `s` as a line at the current depth.
    pub(super) fn line(&mut self, s: &str) {
        for _ in 0..self.depth {
            self.out.push_str("  ");
        }
        self.out.push_str(s);
        self.out.push('\n');
    }
    /// A fresh temporary's name.
    pub(super) fn temp(&mut self) -> String {
        self.temps += 1;
        format!("%t{}", self.temps)
    }
    /// The name of `v` here.
    pub(super) fn name(&self, v: &V) -> Result<String> {
        self.names
            .get(&v.id)
            .cloned()
            .ok_or_else(|| TpuError::builder(self.what, format!("value {} used outside its region", v.id)))
    }
    /// Names `v` after its id and returns the name.
    pub(super) fn def(&mut self, v: &V) -> String {
        let n = format!("%v{}", v.id);
        self.names.insert(v.id, n.clone());
        n
    }
    /// `out`, a vector of type `ty` (as the lowering spells it), all `value`.
    pub(super) fn splat(&mut self, out: &V, value: f64, ty: &str) {
        let n = self.def(out);
        self.line(&format!("{n} = arith.constant dense<{}> : {ty}", literal(value, out.ty.elem)));
    }
    /// `out = value`, an i32 scalar.
    pub(super) fn index_const(&mut self, out: &V, value: i64) {
        let n = self.def(out);
        self.line(&format!("{n} = arith.constant {value} : i32"));
    }
    /// `out = a op b` of i32 scalars.
    pub(super) fn index_binary(&mut self, out: &V, op: Binary, a: &V, b: &V) -> Result<()> {
        let (a, b) = (self.name(a)?, self.name(b)?);
        let n = self.def(out);
        self.line(&format!("{n} = arith.{} {a}, {b} : i32", int_op(op)));
        Ok(())
    }
}

/// An MLIR literal of `value` in `dtype`: a decimal with a point, or the bit pattern for
/// infinities and NaN.
pub(super) fn literal(value: f64, dtype: DType) -> String {
    match dtype {
        DType::I32 | DType::I1 | DType::U16 => format!("{}", value as i64),
        DType::BF16 if !value.is_finite() => format!("0x{:04X}", half::bf16::from_f64(value).to_bits()),
        _ if !value.is_finite() => format!("0x{:08X}", (value as f32).to_bits()),
        _ => format!("{:.9e}", value),
    }
}

/// The `arith` op of an integer `op`.
pub(super) fn int_op(op: Binary) -> &'static str {
    match op {
        Binary::Add => "addi",
        Binary::Sub => "subi",
        Binary::Mul => "muli",
        Binary::Div => "divsi",
        Binary::Max => "maxsi",
        Binary::Min => "minsi",
    }
}

/// The `arith` op of a float `op`.
pub(super) fn float_op(op: Binary) -> &'static str {
    match op {
        Binary::Add => "addf",
        Binary::Sub => "subf",
        Binary::Mul => "mulf",
        Binary::Div => "divf",
        Binary::Max => "maximumf",
        Binary::Min => "minimumf",
    }
}

/// The `arith` conversion from `from` to `to` (f32, bf16 and i32).
pub(super) fn cast_op(from: DType, to: DType) -> &'static str {
    match (from, to) {
        (DType::F32, DType::BF16) => "arith.truncf",
        (DType::BF16, DType::F32) => "arith.extf",
        (DType::I32, _) => "arith.sitofp",
        _ => "arith.fptosi",
    }
}

/// The `arith.cmpf` and `arith.cmpi` predicates of `cmp`.
pub(super) fn predicate(cmp: Cmp) -> (&'static str, &'static str) {
    match cmp {
        Cmp::Eq => ("oeq", "eq"),
        Cmp::Ne => ("une", "ne"),
        Cmp::Lt => ("olt", "slt"),
        Cmp::Le => ("ole", "sle"),
        Cmp::Gt => ("ogt", "sgt"),
        Cmp::Ge => ("oge", "sge"),
    }
}

#[cfg(test)]
mod tests {
    use super::literal;
    use kda_core::DType;

    #[test]
    fn literals_carry_a_point_or_bits() {
        assert_eq!(literal(1.0, DType::F32), "1.000000000e0");
        assert_eq!(literal(f64::NEG_INFINITY, DType::F32), "0xFF800000");
        assert_eq!(literal(3.0, DType::I32), "3");
    }
}
