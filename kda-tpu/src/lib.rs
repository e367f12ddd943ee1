//! KDA kernels over PJRT: a runtime for any PJRT plugin (CPU here, libtpu or CUDA elsewhere) and
//! deviceless ahead-of-time TPU compiles. Build after `cargo xtask setup` (see [`error::SETUP_HINT`]).
#![warn(missing_docs)]

pub mod aot;
pub mod backend;
pub mod error;
pub mod hlo;
pub mod kernels;
pub mod runtime;

pub use aot::{AotReport, CostAnalysis, TpuCompiler, DEFAULT_TOPOLOGY};
pub use backend::{
    CompileCache, DeviceCall, DeviceCotangents, DeviceGate, DeviceGradients, DeviceInputs, DeviceOutputs,
    DeviceProgram, DeviceTensor, PjrtBackend, PjrtOptions, PjrtResiduals, ProgramKind, TransferStats,
};
pub use error::{Result, TpuError};
pub use kernels::KernelSpec;
pub use runtime::{
    CompileOptions, DeviceBuffer, ElementType, Executable, MemoryStats, Runtime, Signature, TensorType,
    XlaOption,
};

/// The README's Rust code, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
