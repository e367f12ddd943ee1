//! The chunked KDA programs (docs/kda.md, Chunks) as StableHLO, built with [`crate::hlo`].

pub mod compose;
pub mod context_parallel;
pub mod interface;
mod intra;
mod kernel_backward;
mod kernel_forward;
mod ops;
#[cfg(feature = "harness")]
pub mod parts;
mod prep;
mod programs;
mod recurrence;
mod solve;
mod spec;
mod tiles;

pub use interface::{index_tables, index_tables_for, IndexTable, Port, ProgramKind, ProgramSignature};
pub use kernel_forward::PACKED_RESULT_BYTES;
pub use programs::{
    backward_program, data_parallel_program, forward_program, fused_program, program, GATE_FLOOR,
};
pub(crate) use spec::CHUNK;
pub use spec::{on_device, Implementation, KernelSpec, SUB, TPU_SLAB};

/// The names of the host-built index-table arguments, in signature order.
pub const TABLE_NAMES: [&str; 5] = ["chunk_first", "chunk_last", "chunk_slot", "slot_token", "token_slot"];

/// The signature of program `kind` of `spec` as the backend runs it on `devices` replicas:
/// [`ProgramSignature::of`], or in the context-parallel form
/// [`context_parallel::signature`].
pub fn signature(
    spec: &KernelSpec,
    kind: ProgramKind,
    context: bool,
    devices: usize,
) -> crate::Result<ProgramSignature> {
    Ok(match context {
        true => context_parallel::signature(spec, kind, devices),
        false => ProgramSignature::of(spec, kind),
    })
}
