//! The TPU kernels of the KDA op, written in [`crate::lang`]: the chunked forward
//! ([`forward`]) and backward ([`backward`]) kernels, their building blocks ([`blocks`]), and
//! their wiring into the op's programs (`forward_program`, `backward_program`), lowered to
//! Mosaic for libtpu or through the interpret lowering on any plugin.

pub mod backward;
mod backward_program;
pub mod blocks;
pub mod forward;
mod forward_program;

use crate::hlo::{FnBuilder, Value};
use crate::lang::Lowering;
use crate::op::args::Args;
use crate::op::spec::KernelSpec;
use crate::Result;

/// The forward on the kernels: `o [final_state] [h]`.
pub(super) fn forward(
    f: &mut FnBuilder,
    s: &KernelSpec,
    a: &Args,
    keep_h: bool,
    lowering: Lowering,
) -> Result<Vec<Value>> {
    let calls = forward_program::kernel_calls(f, s, forward_program::MaskReaders::Forward, lowering)?;
    let kept = forward_program::Kept { states: keep_h, terms: false };
    forward_program::forward_body(f, s, a, kept, &calls)
}

pub(super) use backward_program::{backward, fused};
