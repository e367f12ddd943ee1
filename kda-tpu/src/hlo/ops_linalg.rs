//! Matrix ops: `dot_general`, `batch_matmul`, `triangular_solve`.

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::fmt::fmt_list;
use super::ops_shape::valid_axes;
use super::types::{Precision, TensorType, Value};
use kda_core::DType;

/// Which operands of [`FnBuilder::batch_matmul`] are read transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transpose {
    /// `a x b`.
    None,
    /// `a^T x b`.
    A,
    /// `a x b^T`.
    B,
    /// `a^T x b^T`.
    Both,
}

/// The form of a [`FnBuilder::triangular_solve`] (StableHLO's attributes of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TriangularSolve {
    /// Solve `op(a) x = b` (else `x op(a) = b`).
    pub left_side: bool,
    /// `a` is lower triangular (else upper).
    pub lower: bool,
    /// `a`'s diagonal is taken as ones.
    pub unit_diagonal: bool,
    /// `op(a) = a^T` (else `a`).
    pub transpose_a: bool,
}

impl FnBuilder {
    /// `stablehlo.dot_general`; result dims are batch, lhs free, rhs free (in operand order).
    /// Float inputs may produce any float `out_elem` (bf16 x bf16 -> f32 accumulates in f32).
    #[allow(clippy::too_many_arguments)]
    pub fn dot_general(
        &mut self,
        lhs: Value,
        rhs: Value,
        batch_lhs: &[i64],
        batch_rhs: &[i64],
        contract_lhs: &[i64],
        contract_rhs: &[i64],
        out_elem: DType,
    ) -> Result<Value> {
        let op = "dot_general";
        let shapes = || format!("lhs {} rhs {}", lhs.ty(), rhs.ty());
        if lhs.elem() != rhs.elem() || lhs.elem() == DType::I1 {
            return Err(err(op, format!("element types must match and be numeric: {}", shapes())));
        }
        let out_ok = if lhs.elem().is_float() { out_elem.is_float() } else { out_elem == DType::I32 };
        if !out_ok {
            return Err(err(op, format!("result element {out_elem} invalid for {}", shapes())));
        }
        if batch_lhs.len() != batch_rhs.len() || contract_lhs.len() != contract_rhs.len() {
            return Err(err(
                op,
                format!(
                    "batch {batch_lhs:?} x {batch_rhs:?} / contracting {contract_lhs:?} x {contract_rhs:?} \
                     lengths differ ({})",
                    shapes()
                ),
            ));
        }
        let lhs_used: Vec<i64> = batch_lhs.iter().chain(contract_lhs).copied().collect();
        let rhs_used: Vec<i64> = batch_rhs.iter().chain(contract_rhs).copied().collect();
        if !valid_axes(&lhs_used, lhs.rank()) || !valid_axes(&rhs_used, rhs.rank()) {
            return Err(err(
                op,
                format!(
                    "batch {batch_lhs:?} x {batch_rhs:?} / contracting {contract_lhs:?} x {contract_rhs:?} \
                     are not distinct axes ({})",
                    shapes()
                ),
            ));
        }
        for (kind, l, r) in [("batch", batch_lhs, batch_rhs), ("contracting", contract_lhs, contract_rhs)] {
            for (&a, &b) in l.iter().zip(r) {
                if lhs.dims()[a as usize] != rhs.dims()[b as usize] {
                    return Err(err(
                        op,
                        format!("{kind} dims {l:?} x {r:?} have different sizes: {}", shapes()),
                    ));
                }
            }
        }
        let mut dims: Vec<i64> = batch_lhs.iter().map(|&d| lhs.dims()[d as usize]).collect();
        for (v, used) in [(&lhs, &lhs_used), (&rhs, &rhs_used)] {
            dims.extend((0..v.rank() as i64).filter(|d| !used.contains(d)).map(|d| v.dims()[d as usize]));
        }
        let mut parts = Vec::new();
        for (key, xs) in [
            ("lhs_batching_dimensions", batch_lhs),
            ("rhs_batching_dimensions", batch_rhs),
            ("lhs_contracting_dimensions", contract_lhs),
            ("rhs_contracting_dimensions", contract_rhs),
        ] {
            if !xs.is_empty() {
                parts.push(format!("{key} = {}", fmt_list(xs)));
            }
        }
        let mut attr = format!("dot_dimension_numbers = #stablehlo.dot<{}>", parts.join(", "));
        if self.dot_precision() != Precision::Default {
            let p = self.dot_precision().mlir();
            attr.push_str(&format!(
                ", precision_config = [#stablehlo<precision {p}>, #stablehlo<precision {p}>]"
            ));
        }
        self.push_op1(op, "stablehlo.dot_general", &[lhs, rhs], &attr, TensorType::new(out_elem, &dims))
    }

    /// `[..., M, K] x [..., K, N] -> [..., M, N]` over equal leading batch dims; `t` says which
    /// operand is read transposed (`a` as `[..., K, M]`, `b` as `[..., N, K]`). Floats accumulate
    /// and return f32; i32 -> i32.
    pub fn batch_matmul(&mut self, a: Value, b: Value, t: Transpose) -> Result<Value> {
        let (transpose_a, transpose_b) =
            (matches!(t, Transpose::A | Transpose::Both), matches!(t, Transpose::B | Transpose::Both));
        let op = "batch_matmul";
        let r = a.rank();
        if r < 2 || b.rank() != r || a.dims()[..r - 2] != b.dims()[..r - 2] {
            return Err(err(
                op,
                format!("need [..., M, K] x [..., K, N] with equal batch dims: {} x {}", a.ty(), b.ty()),
            ));
        }
        let r = r as i64;
        let batch: Vec<i64> = (0..r - 2).collect();
        let ca = if transpose_a { r - 2 } else { r - 1 };
        let cb = if transpose_b { r - 1 } else { r - 2 };
        if a.dims()[ca as usize] != b.dims()[cb as usize] {
            return Err(err(
                op,
                format!(
                    "contracting sizes differ: {} x {} (transpose_a={transpose_a}, transpose_b={transpose_b})",
                    a.ty(),
                    b.ty()
                ),
            ));
        }
        let out = if a.elem().is_float() { DType::F32 } else { a.elem() };
        self.dot_general(a, b, &batch, &batch, &[ca], &[cb], out)
    }

    /// Solves `op(a) x = b` (`left_side`) or `x op(a) = b` for triangular `a` `[..., M, M]`;
    /// `b` is `[..., M, N]` (left) or `[..., N, M]` (right), same batch dims and float type.
    pub fn triangular_solve(&mut self, a: Value, b: Value, how: TriangularSolve) -> Result<Value> {
        let TriangularSolve { left_side, lower, unit_diagonal, transpose_a } = how;
        let op = "triangular_solve";
        let r = a.rank();
        let shapes = || format!("a {} b {} (left_side={left_side})", a.ty(), b.ty());
        if !a.elem().is_float() || a.elem() != b.elem() {
            return Err(err(op, format!("need equal float element types: {}", shapes())));
        }
        if r < 2
            || b.rank() != r
            || a.dims()[r - 1] != a.dims()[r - 2]
            || a.dims()[..r - 2] != b.dims()[..r - 2]
        {
            return Err(err(
                op,
                format!("need square a [..., M, M] and b with the same batch dims: {}", shapes()),
            ));
        }
        let m = a.dims()[r - 1];
        let bm = if left_side { b.dims()[r - 2] } else { b.dims()[r - 1] };
        if bm != m {
            return Err(err(op, format!("b does not match a's size {m}: {}", shapes())));
        }
        let t = if transpose_a { "TRANSPOSE" } else { "NO_TRANSPOSE" };
        let attr = format!(
            "left_side = {left_side}, lower = {lower}, unit_diagonal = {unit_diagonal}, \
             transpose_a = #stablehlo<transpose {t}>"
        );
        self.push_op1(op, "stablehlo.triangular_solve", &[a, b], &attr, b.ty())
    }
}
