//! Constants, iota and elementwise ops. Plain binary ops need equal types; the `_bcast`
//! forms first broadcast both operands numpy-style (trailing dims aligned, size 1 stretches).

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::fmt::fmt_float;
use super::types::{Cmp, TensorType, Value};
use kda_core::DType;

/// Which element types an elementwise op accepts.
#[derive(Clone, Copy)]
enum Kind {
    /// f32, bf16, i32, u16.
    Numeric,
    /// f32, bf16.
    Float,
    /// i1, i32, u16.
    Logical,
    /// f32, bf16, i32.
    Signed,
}

fn check_kind(op: &str, kind: Kind, v: &Value) -> Result<()> {
    let e = v.elem();
    let ok = match kind {
        Kind::Numeric => e != DType::I1,
        Kind::Float => e.is_float(),
        Kind::Logical => matches!(e, DType::I1 | DType::I32 | DType::U16),
        Kind::Signed => matches!(e, DType::F32 | DType::BF16 | DType::I32),
    };
    if ok {
        Ok(())
    } else {
        Err(err(op, format!("element type {e} not supported (operand {})", v.ty())))
    }
}

/// Methods `name(a, b)` of binary elementwise ops: `name => "stablehlo.op", Kind;`.
macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $mlir:literal, $kind:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(&mut self, a: Value, b: Value) -> Result<Value> {
            self.binary(stringify!($name), $mlir, Kind::$kind, a, b)
        }
    )*};
}

/// Methods `name(a)` of unary elementwise ops: `name => "stablehlo.op", Kind;`.
macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident => $mlir:literal, $kind:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(&mut self, a: Value) -> Result<Value> {
            self.unary(stringify!($name), $mlir, Kind::$kind, a)
        }
    )*};
}

/// Methods `name(a, b)` of binary ops with numpy broadcasting: `name => op;`.
macro_rules! broadcasting_ops {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(&mut self, a: Value, b: Value) -> Result<Value> {
            self.bcast2(stringify!($name), a, b, Self::$op)
        }
    )*};
}

impl FnBuilder {
    /// Splat constant of a float type (`f32`/`bf16`; bf16 rounds `value` to nearest).
    pub fn constant_f32(&mut self, value: f32, ty: TensorType) -> Result<Value> {
        if !ty.elem.is_float() {
            return Err(err("constant_f32", format!("type {ty} is not a float type")));
        }
        let attr = format!("value = dense<{}> : {ty}", fmt_float(value, ty.elem));
        self.push_op1("constant_f32", "stablehlo.constant", &[], &attr, ty)
    }

    /// Splat constant of an integer type (`i32`, or `ui16` for 0..=65535).
    pub fn constant_i32(&mut self, value: i32, ty: TensorType) -> Result<Value> {
        let ok = match ty.elem {
            DType::I32 => true,
            DType::U16 => (0..=u16::MAX as i32).contains(&value),
            _ => false,
        };
        if !ok {
            return Err(err("constant_i32", format!("value {value} does not fit type {ty}")));
        }
        let attr = format!("value = dense<{value}> : {ty}");
        self.push_op1("constant_i32", "stablehlo.constant", &[], &attr, ty)
    }

    /// A rank-1 `i32` constant holding `values` (tables known when the program is built).
    pub fn constant_i32s(&mut self, values: &[i32]) -> Result<Value> {
        let ty = TensorType::new(DType::I32, &[values.len() as i64]);
        let items: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        let attr = format!("value = dense<[{}]> : {ty}", items.join(", "));
        self.push_op1("constant_i32s", "stablehlo.constant", &[], &attr, ty)
    }

    /// Splat boolean constant of type `tensor<dims x i1>`.
    pub fn constant_bool(&mut self, value: bool, dims: &[i64]) -> Result<Value> {
        let ty = TensorType::new(DType::I1, dims);
        let attr = format!("value = dense<{value}> : {ty}");
        self.push_op1("constant_bool", "stablehlo.constant", &[], &attr, ty)
    }

    /// Scalar `tensor<i32>` constant (indices for `dynamic_slice`, loop counters).
    pub fn scalar_i32(&mut self, value: i32) -> Result<Value> {
        self.constant_i32(value, TensorType::scalar(DType::I32))
    }

    /// `stablehlo.iota`: counts 0, 1, ... along `dim`, constant along the other dims.
    pub fn iota(&mut self, ty: TensorType, dim: usize) -> Result<Value> {
        if dim >= ty.rank() || ty.elem == DType::I1 {
            return Err(err("iota", format!("dim {dim} / element type invalid for {ty}")));
        }
        let attr = format!("iota_dimension = {dim} : i64");
        self.push_op1("iota", "stablehlo.iota", &[], &attr, ty)
    }

    fn binary(&mut self, op: &str, mlir: &str, kind: Kind, a: Value, b: Value) -> Result<Value> {
        if a.elem() != b.elem() || a.dims() != b.dims() {
            return Err(err(op, format!("operand types differ: {} vs {}", a.ty(), b.ty())));
        }
        check_kind(op, kind, &a)?;
        self.push_op1(op, mlir, &[a, b], "", a.ty())
    }

    fn unary(&mut self, op: &str, mlir: &str, kind: Kind, a: Value) -> Result<Value> {
        check_kind(op, kind, &a)?;
        self.push_op1(op, mlir, &[a], "", a.ty())
    }

    // The elementwise ops, one line each: the doc, the method, its StableHLO op and the element
    // kinds it takes.
    binary_ops! {
        /// `a + b` (equal types).
        add => "stablehlo.add", Numeric;
        /// `a - b` (equal types).
        sub => "stablehlo.subtract", Numeric;
        /// `a * b` (equal types).
        mul => "stablehlo.multiply", Numeric;
        /// `a / b` (equal types; integer division truncates).
        div => "stablehlo.divide", Numeric;
        /// Elementwise maximum (equal types).
        max => "stablehlo.maximum", Numeric;
        /// Elementwise minimum (equal types).
        min => "stablehlo.minimum", Numeric;
        /// `a ^ b` for floats (equal types).
        pow => "stablehlo.power", Float;
        /// Logical/bitwise and (i1 or integers).
        and => "stablehlo.and", Logical;
        /// Logical/bitwise or (i1 or integers).
        or => "stablehlo.or", Logical;
    }
    unary_ops! {
        /// Logical/bitwise not (i1 or integers).
        not => "stablehlo.not", Logical;
        /// `-a`.
        neg => "stablehlo.negate", Signed;
        /// `|a|`.
        abs => "stablehlo.abs", Signed;
        /// `e^a`.
        exp => "stablehlo.exponential", Float;
        /// `e^a - 1`, accurate near 0.
        expm1 => "stablehlo.exponential_minus_one", Float;
        /// Natural log.
        log => "stablehlo.log", Float;
        /// `ln(1 + a)`, accurate near 0.
        log1p => "stablehlo.log_plus_one", Float;
        /// Square root.
        sqrt => "stablehlo.sqrt", Float;
        /// `1 / sqrt(a)`.
        rsqrt => "stablehlo.rsqrt", Float;
        /// Sigmoid `1 / (1 + e^-a)`.
        logistic => "stablehlo.logistic", Float;
        /// Hyperbolic tangent.
        tanh => "stablehlo.tanh", Float;
    }

    /// `compare(dir, a, b)` -> i1 of the same dims (FLOAT, SIGNED or UNSIGNED by element type).
    pub fn compare(&mut self, dir: Cmp, a: Value, b: Value) -> Result<Value> {
        let op = "compare";
        if a.elem() != b.elem() || a.dims() != b.dims() {
            return Err(err(op, format!("operand types differ: {} vs {}", a.ty(), b.ty())));
        }
        let ct = match a.elem() {
            DType::F32 | DType::BF16 | DType::F64 => "FLOAT",
            DType::I32 => "SIGNED",
            DType::I1 | DType::U16 => "UNSIGNED",
            other => return Err(err(op, format!("no comparison type for {other}"))),
        };
        let attr = format!(
            "comparison_direction = #stablehlo<comparison_direction {}>, compare_type = #stablehlo<comparison_type {ct}>",
            dir.mlir()
        );
        self.push_op1(op, "stablehlo.compare", &[a, b], &attr, a.ty().with_elem(DType::I1))
    }

    /// `pred ? a : b` elementwise; `pred` is i1 with the dims of `a` or a scalar.
    pub fn select(&mut self, pred: Value, a: Value, b: Value) -> Result<Value> {
        let op = "select";
        if a.elem() != b.elem() || a.dims() != b.dims() {
            return Err(err(op, format!("branch types differ: {} vs {}", a.ty(), b.ty())));
        }
        if pred.elem() != DType::I1 || (pred.rank() != 0 && pred.dims() != a.dims()) {
            return Err(err(op, format!("pred {} must be i1 of dims {:?} or a scalar", pred.ty(), a.dims())));
        }
        self.push_op1(op, "stablehlo.select", &[pred, a, b], "", a.ty())
    }

    /// Element type conversion (rounds to nearest even for f32 -> bf16).
    pub fn convert(&mut self, v: Value, elem: DType) -> Result<Value> {
        self.push_op1("convert", "stablehlo.convert", &[v], "", v.ty().with_elem(elem))
    }

    /// `v` rounded (to nearest even) to a float of `exponent_bits` and `mantissa_bits`, kept in
    /// its own type: TF32 is 8 and 10, bf16 8 and 7.
    pub fn reduce_precision(&mut self, v: Value, exponent_bits: u32, mantissa_bits: u32) -> Result<Value> {
        if !v.elem().is_float() || exponent_bits == 0 {
            return Err(err("reduce_precision", format!("{} to e{exponent_bits}m{mantissa_bits}", v.ty())));
        }
        let attrs = format!("exponent_bits = {exponent_bits} : i32, mantissa_bits = {mantissa_bits} : i32");
        self.push_op1("reduce_precision", "stablehlo.reduce_precision", &[v], &attrs, v.ty())
    }

    /// Reinterprets bits as another element type of the same width (u16 <-> bf16, i32 <-> f32).
    pub fn bitcast_convert(&mut self, v: Value, elem: DType) -> Result<Value> {
        if v.elem().bit_width() != elem.bit_width() || elem == DType::I1 {
            return Err(err("bitcast_convert", format!("{} to {elem}: widths differ", v.ty())));
        }
        self.push_op1("bitcast_convert", "stablehlo.bitcast_convert", &[v], "", v.ty().with_elem(elem))
    }

    /// Numpy broadcast of two shapes (trailing dims aligned; a 1 stretches).
    pub fn broadcast_dims(op: &str, a: &[i64], b: &[i64]) -> Result<Vec<i64>> {
        let r = a.len().max(b.len());
        let mut out = vec![0; r];
        for (i, o) in out.iter_mut().enumerate() {
            let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
            let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
            *o = match (da, db) {
                _ if da == db => da,
                (1, d) | (d, 1) => d,
                _ => return Err(err(op, format!("dims {a:?} and {b:?} do not broadcast"))),
            };
        }
        Ok(out)
    }

    /// Broadcasts `a` and `b` numpy-style to a common shape, then applies `f`.
    fn bcast2<F>(&mut self, op: &str, a: Value, b: Value, f: F) -> Result<Value>
    where
        F: FnOnce(&mut Self, Value, Value) -> Result<Value>,
    {
        let dims = Self::broadcast_dims(op, a.dims(), b.dims())?;
        let a2 = if a.dims() == dims.as_slice() { a } else { self.broadcast_to(a, &dims)? };
        let b2 = if b.dims() == dims.as_slice() { b } else { self.broadcast_to(b, &dims)? };
        f(self, a2, b2)
    }

    broadcasting_ops! {
        /// `a + b` with numpy broadcasting (trailing-aligned).
        add_bcast => add;
        /// `a - b` with numpy broadcasting (trailing-aligned).
        sub_bcast => sub;
        /// `a * b` with numpy broadcasting (trailing-aligned).
        mul_bcast => mul;
        /// `a / b` with numpy broadcasting (trailing-aligned).
        div_bcast => div;
        /// Elementwise max with numpy broadcasting (trailing-aligned).
        max_bcast => max;
        /// Elementwise min with numpy broadcasting (trailing-aligned).
        min_bcast => min;
    }
    /// Compare with numpy broadcasting (trailing-aligned).
    pub fn compare_bcast(&mut self, dir: Cmp, a: Value, b: Value) -> Result<Value> {
        self.bcast2("compare_bcast", a, b, |s, x, y| s.compare(dir, x, y))
    }

    /// `v * c` for a float constant `c` (splat of `v`'s type).
    pub fn mul_const(&mut self, v: Value, c: f32) -> Result<Value> {
        let k = self.constant_f32(c, v.ty())?;
        self.mul(v, k)
    }

    /// `v + c` for a float constant `c` (splat of `v`'s type).
    pub fn add_const(&mut self, v: Value, c: f32) -> Result<Value> {
        let k = self.constant_f32(c, v.ty())?;
        self.add(v, k)
    }
}
