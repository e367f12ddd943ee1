//! The inverse kernel of the GPU forward, for shapes whose intra kernel runs a program per
//! sub-chunk (f32): one program per (lane, chunk position) turns the chunk's `L` into
//! `A = (I + L)^-1` by [`block_inverse`], `[16, 16]` blocks at a time.

use kda_core::DType;

use crate::error::Result;
use crate::hlo::TensorType;
use crate::lang::{Body, Index, Kernel, KernelBuilder, Operand, Ref, Semantics, V};

use super::intra::block_inverse;
use super::tokens::store;
use super::{ForwardShape, C, SUB};

/// The inverse kernel's operands by name.
#[derive(Clone, Copy, Debug)]
pub struct InverseRefs {
    /// The intra kernel's `L` `[L, T, C]` f32, each chunk's rows.
    pub l: Ref,
    /// `A` `[L, T, C]` in the factors' dtype.
    pub a: Ref,
}

/// The inverse kernel of `s`: grid (lanes, chunk positions), both parallel.
pub fn inverse_kernel(s: &ForwardShape) -> Result<(Kernel, InverseRefs)> {
    let (l, t, nt) = (s.lanes, s.t, s.t / C);
    let mut kb = KernelBuilder::new("kda_gpu_inverse");
    kb.grid(l, Semantics::Parallel).grid(nt, Semantics::Parallel);
    let at = || vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let li = kb.input(Operand::blocked("l", TensorType::new(DType::F32, &[l, t, C]), &[1, C, C], at()));
    let a = kb.output(Operand::blocked("a", TensorType::new(s.factor_dtype(), &[l, t, C]), &[1, C, C], at()));
    kb.params(s.intra_launch);
    let refs = InverseRefs { l: li, a };
    let kernel = kb.build(|b| chunk_inverse(b, s, &refs))?;
    Ok((kernel, refs))
}

/// The body: `L`'s `[16, 16]` blocks on and below the diagonal, inverted.
fn chunk_inverse(b: &mut Body, s: &ForwardShape, r: &InverseRefs) -> Result<()> {
    let l = b.load_all(r.l)?;
    let l = b.reshape(&l, &[C, C])?;
    let n = C / SUB;
    let blocks: Vec<Vec<V>> = (0..n)
        .map(|i| (0..=i).map(|j| b.slice(&l, &[SUB * i, SUB * j], &[SUB, SUB])).collect())
        .collect::<Result<_>>()?;
    let a = block_inverse(b, &blocks, s.precision())?;
    let a = b.concat(&a, 0)?;
    store(b, r.a, &a, s.factor_dtype())
}
