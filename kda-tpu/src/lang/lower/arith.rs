//! The `arith` dialect's spellings of the body's ops and constants, shared by the Mosaic and
//! Triton lowerings (both MLIR).

use std::collections::HashMap;

use kda_core::DType;

use crate::error::{Result, TpuError};
use crate::hlo::Cmp;
use crate::lang::ir::{Binary, Op, V};

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
    /// `out = a cmp b` of vectors (or i32 scalars) of type `ty`: the float or the integer
    /// comparison by the element type.
    pub(super) fn compare(&mut self, out: &V, cmp: Cmp, a: &V, b: &V, ty: &str) -> Result<()> {
        let (an, bn) = (self.name(a)?, self.name(b)?);
        let (f, i) = predicate(cmp);
        let n = self.def(out);
        let (op, pred) = if a.ty.elem.is_float() { ("cmpf", f) } else { ("cmpi", i) };
        self.line(&format!("{n} = arith.{op} {pred}, {an}, {bn} : {ty}"));
        Ok(())
    }
    /// `out = cond ? a : b` elementwise, the condition of type `cond_ty` and the values of `ty`.
    pub(super) fn select(
        &mut self,
        out: &V,
        cond: &V,
        a: &V,
        b: &V,
        (cond_ty, ty): (&str, &str),
    ) -> Result<()> {
        let (c, an, bn) = (self.name(cond)?, self.name(a)?, self.name(b)?);
        let n = self.def(out);
        self.line(&format!("{n} = arith.select {c}, {an}, {bn} : {cond_ty}, {ty}"));
        Ok(())
    }
    /// `out = a op b` elementwise of vectors of type `ty` (as the lowering spells it): the float
    /// or the integer form by the element type.
    pub(super) fn binary(&mut self, out: &V, op: Binary, a: &V, b: &V, ty: &str) -> Result<()> {
        let (an, bn) = (self.name(a)?, self.name(b)?);
        let name = if a.ty.elem.is_float() { float_op(op) } else { int_op(op) };
        let n = self.def(out);
        self.line(&format!("{n} = arith.{name} {an}, {bn} : {ty}"));
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

/// The rules of a lowering that writes MLIR text, one method per op of a body (each handed the
/// op it is the rule of), and the dispatch over a body's ops written once for all of them.
pub(super) trait OpRules: std::ops::DerefMut<Target = Text> {
    /// The text of an `Op::ProgramId`.
    fn emit_program_id(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::ReadTable`.
    fn emit_read_table(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Splat`.
    fn emit_splat(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Load`.
    fn emit_load(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Store`.
    fn emit_store(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Matmul`.
    fn emit_matmul(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Binary`.
    fn emit_binary(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Unary`.
    fn emit_unary(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Iota`.
    fn emit_iota(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Compare`.
    fn emit_compare(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Select`.
    fn emit_select(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Reduce`.
    fn emit_reduce(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Cumsum`.
    fn emit_cumsum(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Broadcast`.
    fn emit_broadcast(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Cast`.
    fn emit_cast(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Transpose`.
    fn emit_transpose(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Reshape`.
    fn emit_reshape(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Slice`.
    fn emit_slice(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::Concat`.
    fn emit_concat(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::If`.
    fn emit_if(&mut self, op: &Op) -> Result<()>;
    /// The text of an `Op::For`.
    fn emit_for(&mut self, op: &Op) -> Result<()>;

    /// Writes `op` by its rule (the index ops by the writer's own).
    fn op(&mut self, op: &Op) -> Result<()> {
        match op {
            Op::IndexConst { out, value } => {
                self.index_const(out, *value);
                Ok(())
            }
            Op::IndexBinary { out, op, a, b } => self.index_binary(out, *op, a, b),
            Op::ProgramId { .. } => self.emit_program_id(op),
            Op::ReadTable { .. } => self.emit_read_table(op),
            Op::Splat { .. } => self.emit_splat(op),
            Op::Load { .. } => self.emit_load(op),
            Op::Store { .. } => self.emit_store(op),
            Op::Matmul { .. } => self.emit_matmul(op),
            Op::Binary { .. } => self.emit_binary(op),
            Op::Unary { .. } => self.emit_unary(op),
            Op::Iota { .. } => self.emit_iota(op),
            Op::Compare { .. } => self.emit_compare(op),
            Op::Select { .. } => self.emit_select(op),
            Op::Reduce { .. } => self.emit_reduce(op),
            Op::Cumsum { .. } => self.emit_cumsum(op),
            Op::Broadcast { .. } => self.emit_broadcast(op),
            Op::Cast { .. } => self.emit_cast(op),
            Op::Transpose { .. } => self.emit_transpose(op),
            Op::Reshape { .. } => self.emit_reshape(op),
            Op::Slice { .. } => self.emit_slice(op),
            Op::Concat { .. } => self.emit_concat(op),
            Op::If { .. } => self.emit_if(op),
            Op::For { .. } => self.emit_for(op),
        }
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
