//! The TPU kernels of the KDA op, written in [`crate::lang`]: the chunked forward
//! ([`mod@forward`]) and backward ([`mod@backward`]) kernels for the dims of [`dims`], the operands
//! both declare by name (`operands`), their chunk terms ([`terms`]) on the levels of `levels`, and their wiring into
//! the op's programs (`forward_program`, `backward_program`), lowered to Mosaic for libtpu or
//! through the interpret lowering on any plugin.

pub mod backward;
mod backward_chain;
mod backward_levels;
mod backward_operands;
mod backward_program;
pub mod dims;
pub mod forward;
pub(in crate::op) mod forward_program;
mod levels;
mod operands;
pub mod terms;

pub(super) use backward_program::{backward, fused};
pub(super) use forward_program::forward;
