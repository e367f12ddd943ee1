//! The L2 norm's gradient of the GPU backward: one program per (lane, chunk position) takes the
//! intra gradient's `dq` and `dk` (with respect to the normalised `q` and `k`, f32) through
//! `y = x rsqrt(sum(x^2) + eps)`, whole rows at a time (each row's dot `dy . y` runs over every
//! key column, which the intra gradient's key-block programs each see a block of), and writes
//! them in the input dtype and the tokens' layout: the caller's gradients.

use kda_core::DType;

use crate::error::Result;
use crate::hlo::{FnBuilder, Value};
use crate::lang::{Bindings, Body, Index, Kernel, KernelBuilder, Lower, Offset, Ref, Semantics};
use crate::op::chunk::{l2_backward, l2_normalise_with_scale};

use super::tokens::{self, ChunkRows};
use super::{ForwardInputs, ForwardShape, C};

/// The norm-gradient kernel's operands by name (`[L, T, K]` tokens in the shape's layout).
#[derive(Clone, Copy, Debug)]
pub struct NormGradRefs {
    /// `q` and `k` as the forward read them, in the input dtype.
    pub x: [Ref; 2],
    /// `dq` and `dk` with respect to the normalised `q` and `k`, f32.
    pub dy: [Ref; 2],
    /// `dq` and `dk` with respect to `q` and `k`, in the input dtype.
    pub dx: [Ref; 2],
    /// Packed rows in place: where each chunk position's rows are.
    pub packed: Option<tokens::PackedRefs>,
}

/// The norm-gradient kernel of `s`: grid (lanes, chunk positions), all parallel.
pub fn norm_grad_kernel(s: &ForwardShape) -> Result<(Kernel, NormGradRefs)> {
    let mut kb = KernelBuilder::new("kda_gpu_norm_grad");
    kb.grid(s.lanes, Semantics::Parallel).grid(s.t / C, Semantics::Parallel);
    let token =
        |name: &str, d: DType| tokens::operand(name, s, d, s.k, (C, Index::Grid(1)), (s.k, Index::Const(0)));
    let x = [kb.input(token("q", s.dtype)), kb.input(token("k", s.dtype))];
    let dy = [kb.input(token("dq_normed", DType::F32)), kb.input(token("dk_normed", DType::F32))];
    let dx = [kb.output(token("dq", s.dtype)), kb.output(token("dk", s.dtype))];
    let packed = tokens::declare_packed(&mut kb, s);
    kb.params(s.norm_grad_launch);
    let refs = NormGradRefs { x, dy, dx, packed };
    let kernel = kb.build(|b| chunk_norm_grad(b, s, &refs))?;
    Ok((kernel, refs))
}

/// The body: `q`'s rows, then `k`'s.
fn chunk_norm_grad(b: &mut Body, s: &ForwardShape, r: &NormGradRefs) -> Result<()> {
    let at = ChunkRows::of_step(b, s.layout, r.packed.as_ref())?;
    for i in 0..2 {
        let x = tokens::f32_tile(b, r.x[i], &at, (0, C), (0, s.k))?;
        let (y, scale) = l2_normalise_with_scale(b, &x)?;
        let dy = tokens::f32_tile(b, r.dy[i], &at, (0, C), (0, s.k))?;
        let dx = l2_backward(b, &dy, &y, &scale)?;
        tokens::store_tile(b, r.dx[i], &at, (0, Offset::Const(0)), &dx, s.dtype)?;
    }
    Ok(())
}

/// Calls the norm-gradient kernel of `s` in `f` on `q`, `k` (as the forward kernels take them,
/// with their tables) and the intra gradient's `[dq, dk]`, lowered by `lowering`: `[dq, dk]`.
pub fn call_norm_grad(
    f: &mut FnBuilder,
    s: &ForwardShape,
    x: &ForwardInputs,
    [dq, dk]: [Value; 2],
    lowering: &dyn Lower,
) -> Result<[Value; 2]> {
    s.check()?;
    let (kernel, r) = norm_grad_kernel(s)?;
    let mut a: Bindings = kernel.bindings();
    for (at, v) in [(r.x[0], x.q), (r.x[1], x.k), (r.dy[0], dq), (r.dy[1], dk)] {
        a.input(at, v)?;
    }
    tokens::bind_packed(&mut a, r.packed.as_ref(), x.valid, x.packed)?;
    let out = kernel.call(f, lowering, a)?;
    Ok([out.get(r.dx[0])?, out.get(r.dx[1])?])
}
