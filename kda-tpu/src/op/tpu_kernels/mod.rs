//! The TPU kernels of the KDA op, written in [`crate::lang`]: the chunked forward
//! ([`forward`]) and backward ([`backward`]) kernels, their building blocks ([`blocks`]), and
//! their wiring into the op's programs (`forward_program`, `backward_program`), lowered to
//! Mosaic for libtpu or through the interpret lowering on any plugin.

pub mod backward;
mod backward_program;
pub mod blocks;
pub mod forward;
mod forward_program;

pub(super) use backward_program::{backward, fused};
pub(super) use forward_program::forward;
