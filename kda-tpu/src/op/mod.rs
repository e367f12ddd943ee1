//! The KDA op (docs/kda.md, Chunks): its program spec ([`ProgramSpec`]), signature
//! ([`interface`]), arguments, composition into a caller's module ([`compose`]) and context
//! parallelism ([`context_parallel`]), and the table that maps an implementation to its program
//! builders (`api`). Beside them one folder per implementation: `xla` (the chunk loops as
//! StableHLO, built with [`crate::hlo`]), `tpu_kernels` (the TPU kernels written in
//! [`crate::lang`], their building blocks and their program wiring) and `gpu_kernels` (the
//! GPU forward kernels in the same language and their programs).

mod api;
mod args;
pub mod chunk;
pub mod compose;
pub mod context_parallel;
/// The GPU kernels: public with the `harness` feature (their tests), private otherwise.
#[cfg(feature = "harness")]
pub mod gpu_kernels;
#[cfg(not(feature = "harness"))]
mod gpu_kernels;
mod hlo_ops;
pub mod interface;
mod prep;
mod spec;
pub mod table;
#[cfg(test)]
mod tests;
/// The TPU kernels: public with the `harness` feature (their op tests), private otherwise.
#[cfg(feature = "harness")]
pub mod tpu_kernels;
#[cfg(not(feature = "harness"))]
mod tpu_kernels;
mod xla;

pub use api::{
    backward_program, data_parallel_program, forward_program, fused_program, program, program_lowered_by,
};
pub use args::GATE_FLOOR;
pub use interface::{index_tables, index_tables_for, IndexTable, Port, ProgramKind, ProgramSignature};
#[allow(deprecated)]
pub use spec::KernelSpec;
pub(crate) use spec::CHUNK;
pub use spec::{
    on_device, GpuKernelConfig, Implementation, OpOptions, ProgramSpec, TpuKernelConfig, Tuning, XlaConfig,
    PACKED_RESULT_BYTES, SUB, TPU_SLAB,
};
pub use table::{row, Family, Row};
#[cfg(feature = "harness")]
pub use xla::parts;

/// The names of the host-built index-table arguments, in signature order.
pub const TABLE_NAMES: [&str; 6] =
    ["chunk_first", "chunk_last", "chunk_slot", "slot_token", "token_slot", "token_segment"];

/// The GPU forward kernels the `triton` rows run for `spec` (intra, WY, recurrence; with
/// `keep_h` the recurrence writes every chunk's entering state, as the saved-state and fused
/// programs ask), for figures and models (`aot::gpu_model::kernel_work`).
pub fn gpu_forward_kernels(spec: &ProgramSpec, keep_h: bool) -> crate::Result<Vec<crate::lang::Kernel>> {
    gpu_kernels::program::forward_kernels(spec, on_device(spec.options.dtype), keep_h)
}

/// The GPU backward kernels the `triton` rows run for `spec` (the state gradient), for figures
/// and models.
pub fn gpu_backward_kernels(spec: &ProgramSpec) -> crate::Result<Vec<crate::lang::Kernel>> {
    gpu_kernels::program::backward_kernels(spec, on_device(spec.options.dtype))
}

/// The signature of program `kind` of `spec` as the backend runs it on `devices` replicas:
/// [`ProgramSignature::of`], or in the context-parallel form
/// [`context_parallel::signature`].
pub fn signature(
    spec: &ProgramSpec,
    kind: ProgramKind,
    context: bool,
    devices: usize,
) -> crate::Result<ProgramSignature> {
    Ok(match context {
        true => context_parallel::signature(spec, kind, devices),
        false => ProgramSignature::of(spec, kind),
    })
}
