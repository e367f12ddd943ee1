//! What a kernel does, counted from its definition: the bytes of its operands and results and
//! the arithmetic of its body on every grid step (a static model's inputs:
//! `aot::gpu_model`).

use super::ir::{Op, Unary};
use super::kernel::Kernel;
use super::lower::{F32Dot, TritonParams};
use super::MatPrecision;
use crate::hlo::TensorType;
use kda_core::DType;

/// A kernel's work.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Its operands' and results' bytes, whole arrays once each.
    pub bytes: f64,
    /// Tensor-core FLOPs (a three-pass product counts three passes).
    pub tensor_flops: f64,
    /// FMA-unit FLOPs: elementwise arithmetic and selects, reductions, running sums, IEEE
    /// products (and `Highest` f32 products where the kernel's `TritonParams` run them so).
    pub fma_flops: f64,
    /// Exponentials.
    pub exps: f64,
}

fn elements(ty: &TensorType) -> f64 {
    ty.num_elements() as f64
}

/// The work of `k`: each op on every grid step, a loop's body on each of its trips (its static
/// count, or the mean a run-time bound declares), a conditional region as if it ran every time
/// (an upper bound).
pub fn work(k: &Kernel) -> Work {
    let bytes = k
        .inputs
        .iter()
        .chain(&k.outputs)
        .map(|o| elements(&o.ty) * o.ty.elem.size_bytes() as f64)
        .sum::<f64>()
        + k.tables.iter().map(|(_, n)| 4.0 * *n as f64).sum::<f64>();
    let steps: f64 = k.grid.iter().map(|(n, _)| *n as f64).product();
    let ieee = matches!(k.params::<TritonParams>().map(|p| p.f32_dot), Some(F32Dot::Ieee) | None);
    let mut w = Work { bytes, ..Work::default() };
    count(&k.body, steps, ieee, &mut w);
    w
}

/// Adds the work of `ops`, each run `times`, to `w`.
fn count(ops: &[Op], times: f64, highest_is_ieee: bool, w: &mut Work) {
    for op in ops {
        match op {
            Op::Matmul { out, a, contract, precision, .. } => {
                let flops = 2.0 * elements(&out.ty) * a.ty.dims[contract.0] as f64 * times;
                let f32_operands = a.ty.elem == DType::F32;
                match precision {
                    MatPrecision::Ieee => w.fma_flops += flops,
                    MatPrecision::Highest if f32_operands && highest_is_ieee => w.fma_flops += flops,
                    MatPrecision::Tf32x3 | MatPrecision::Bf16x3 => w.tensor_flops += 3.0 * flops,
                    MatPrecision::Highest if f32_operands => w.tensor_flops += 3.0 * flops,
                    _ => w.tensor_flops += flops,
                }
            }
            Op::Unary { out, op, .. } => match op {
                Unary::Exp | Unary::Exp2 => w.exps += elements(&out.ty) * times,
                _ => w.fma_flops += elements(&out.ty) * times,
            },
            Op::Binary { out, .. } | Op::Select { out, .. } => w.fma_flops += elements(&out.ty) * times,
            Op::Reduce { a, .. } | Op::Cumsum { a, .. } => w.fma_flops += elements(&a.ty) * times,
            Op::If { then, .. } => count(then, times, highest_is_ieee, w),
            Op::For { mean_trips, body, .. } => count(body, times * mean_trips, highest_is_ieee, w),
            _ => {}
        }
    }
}
