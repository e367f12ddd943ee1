//! KDA kernels over PJRT: a runtime for any PJRT plugin (CPU here, libtpu or CUDA elsewhere) and
//! deviceless ahead-of-time TPU compiles. Build after `cargo xtask setup` (see [`error::SETUP_HINT`]).
//!
//! Feature `runtime` (default) brings the PJRT runtime (module `runtime`), the backend and the
//! ahead-of-time compiler; without it the crate is the StableHLO builder ([`hlo`]), the kernel
//! language ([`lang`]) and the KDA op's program emitters ([`op`], with [`op::interface`] and
//! [`op::compose`] to put a KDA program into a caller's own module), which build with no
//! libclang, PJRT header or plugin.
#![warn(missing_docs)]
#![deny(unsafe_code, clippy::undocumented_unsafe_blocks)]

#[cfg(feature = "runtime")]
pub mod aot;
#[cfg(feature = "runtime")]
pub mod backend;
pub mod error;
pub mod hlo;
pub mod lang;
pub mod op;
#[cfg(feature = "runtime")]
pub mod runtime;

#[cfg(feature = "runtime")]
pub use aot::{AotReport, CostAnalysis, TpuCompiler, DEFAULT_TOPOLOGY};
#[cfg(feature = "runtime")]
pub use backend::{
    CallCotangents, CallInputs, CompileCache, DeviceCotangents, DeviceGradients, DeviceInputs, DeviceOutputs,
    DeviceProgram, DeviceTensor, HostSide, PjrtBackend, PjrtOptions, PjrtResiduals, Split, TransferStats,
    IMPLEMENTATION_ENV,
};
pub use error::{Result, TpuError};
pub use op::interface::ProgramKind;
#[allow(deprecated)]
pub use op::KernelSpec;
pub use op::{Implementation, ProgramSpec, Tuning};
#[cfg(feature = "runtime")]
pub use runtime::{CompileOptions, DeviceBuffer, Executable, MemoryStats, Runtime, Signature, XlaOption};

/// The README's Rust code, compiled and run by `cargo test --doc`.
#[cfg(all(doctest, feature = "runtime"))]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
