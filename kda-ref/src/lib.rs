//! The f64 reference of Kimi Delta Attention: the token recurrence of docs/kda.md, Recurrence, forward
//! and its exact reverse-mode adjoint, with gate activation, q/k L2 norm and packed segments.
//!
//! It is the oracle every backend is checked against: simple and obviously right beats fast.
//! Padding tokens (after a row's last segment) get zero output and zero gradients.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod backend;
mod gate;
mod prepare;
mod recurrence;

pub use backend::{forward, forward_and_vjp, loss, RefBackend, RefResiduals};
