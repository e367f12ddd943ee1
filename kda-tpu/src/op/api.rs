//! The program entry points, built by the builders of the table's row ([`super::table`]) of the
//! spec's implementation: a new implementation is a variant of `kda_core::Implementation`, a
//! row of the table, a folder beside `xla` and `tpu_kernels` with its `forward`, `backward` and
//! `fused` builders, and its arm in [`body`]'s dispatch on the family.

use super::args::Declared;
use super::interface::{ProgramKind, ProgramSignature};
use super::spec::ProgramSpec;
use super::table::{row, Family};
use super::{gpu_kernels, tpu_kernels, xla};
use crate::hlo::{FnBuilder, Module, TensorType, Value};
use crate::lang::Lower;
use crate::Result;
use kda_core::BackwardStrategy;

/// The results of program `kind` of `s` from its declared arguments `d`, by the builders of
/// `s.tuning.implementation`'s row; a TPU-kernel row's kernels lowered by `lowering` when one is
/// given.
fn body(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    d: &Declared,
    kind: ProgramKind,
    lowering: Option<&dyn Lower>,
) -> Result<Vec<Value>> {
    let a = d.args()?;
    let saved = |strategy: BackwardStrategy| -> Result<Option<Value>> {
        match strategy {
            BackwardStrategy::SavedState => Ok(Some(d.need("h")?)),
            BackwardStrategy::Rematerialize => Ok(None),
        }
    };
    let cotangents = || -> Result<(Value, Option<Value>)> { Ok((d.need("do")?, d.get("dht"))) };
    let keep_h = |strategy: BackwardStrategy| strategy == BackwardStrategy::SavedState;
    match row(s.tuning.implementation)?.family {
        Family::Xla => {
            if let Some(l) = lowering {
                return Err(crate::TpuError::unsupported(
                    format!("{} lowering", l.name()),
                    "the kernels of a kernel implementation (mosaic, interpret, triton, triton-interpret); xla has none",
                ));
            }
            match kind {
                ProgramKind::Forward(st) => xla::forward(f, s, &a, keep_h(st)),
                ProgramKind::Backward(st) => xla::backward(f, s, &a, saved(st)?, cotangents()?),
                ProgramKind::Fused(st) => xla::fused(f, s, &a, st, cotangents()?),
            }
        }
        Family::TpuKernels(built_in) => {
            let l = lowering.unwrap_or(&built_in);
            match kind {
                ProgramKind::Forward(st) => tpu_kernels::forward(f, s, &a, keep_h(st), l),
                ProgramKind::Backward(st) => tpu_kernels::backward(f, s, &a, saved(st)?, cotangents()?, l),
                // Both strategies are one program on the kernels: the forward's states are in
                // the executable anyway (docs/kernels/tpu-backward.md, The fused program).
                ProgramKind::Fused(_) => tpu_kernels::fused(f, s, &a, cotangents()?, l),
            }
        }
        Family::GpuKernels(built_in) => {
            let l = lowering.unwrap_or(&built_in);
            match kind {
                ProgramKind::Forward(st) => gpu_kernels::program::forward(f, s, &a, keep_h(st), l),
                ProgramKind::Backward(st) => {
                    gpu_kernels::program::backward(f, s, &a, saved(st)?, cotangents()?, l)
                }
                ProgramKind::Fused(st) => gpu_kernels::program::fused(f, s, &a, st, cotangents()?, l),
            }
        }
    }
}

/// Program `kind` of `s` as the function `@name` (public: an entry point; private: a `call`
/// target), with its signature. Its results are checked against the signature.
pub(crate) fn build(
    name: &str,
    public: bool,
    s: &ProgramSpec,
    kind: ProgramKind,
) -> Result<(FnBuilder, ProgramSignature)> {
    build_lowered(name, public, s, kind, None)
}

/// [`build`] with a TPU-kernel row's kernels lowered by `lowering` when one is given.
fn build_lowered(
    name: &str,
    public: bool,
    s: &ProgramSpec,
    kind: ProgramKind,
    lowering: Option<&dyn Lower>,
) -> Result<(FnBuilder, ProgramSignature)> {
    let mut f = FnBuilder::new(name, public);
    f.set_dot_precision(crate::hlo::Precision::Highest);
    let d = Declared::new(&mut f, s, kind)?;
    let outs = body(&mut f, s, &d, kind, lowering)?;
    let got: Vec<TensorType> = outs.iter().map(Value::ty).collect();
    if got != d.sig.result_types() {
        let names: Vec<&str> = d.sig.results.iter().map(|p| p.name).collect();
        return Err(crate::TpuError::builder(
            "program",
            format!(
                "internal: {kind:?} returns {} values ({got:?}), its signature {} ({names:?}: {:?})",
                got.len(),
                names.len(),
                d.sig.result_types()
            ),
        ));
    }
    f.ret(&outs)?;
    Ok((f, d.sig))
}

/// The text of a module holding program `kind` of `s` as its public `@main`.
pub fn program(s: &ProgramSpec, kind: ProgramKind) -> Result<String> {
    let (f, _) = build("main", true, s, kind)?;
    let mut m = Module::new();
    m.add(f)?;
    Ok(m.to_text())
}

/// [`program`] with the kernels of a TPU-kernel implementation (`s.tuning`'s row: mosaic or
/// interpret) lowered by `lowering`, a lowering of the kernel language from outside this crate
/// or a built-in one with other parameters; an `Unsupported` error for the xla row.
pub fn program_lowered_by(s: &ProgramSpec, kind: ProgramKind, lowering: &dyn Lower) -> Result<String> {
    let (f, _) = build_lowered("main", true, s, kind, Some(lowering))?;
    let mut m = Module::new();
    m.add(f)?;
    Ok(m.to_text())
}

/// [`program`] for data parallelism over `replicas` devices (one replica each; 0 or 1: the
/// plain program). Every replica runs the program on its own rows; the gate-parameter
/// gradients (`da_log`, `ddt_bias`), sums over all tokens, are then all-reduced, so every
/// device holds the batch's total. Same arguments and results as [`program`].
pub fn data_parallel_program(s: &ProgramSpec, kind: ProgramKind, replicas: usize) -> Result<String> {
    if replicas <= 1 {
        return program(s, kind);
    }
    let (f, sig) = build("kda", false, s, kind)?;
    let mut m = Module::new();
    m.add(f)?;
    let mut main = FnBuilder::new("main", true);
    let args = sig.arg_types().into_iter().map(|t| main.arg(t)).collect::<Result<Vec<_>>>()?;
    let mut outs = main.call("kda", &args, &sig.result_types())?;
    for name in ["da_log", "ddt_bias"] {
        if let Some(i) = sig.result_index(name) {
            outs[i] = main.all_reduce_sum(outs[i], replicas)?;
        }
    }
    main.ret(&outs)?;
    m.add(main)?;
    Ok(m.to_text())
}

/// The forward program. Outputs: `o`, `[final_state]`, and `h` `[L, NT, K, V]` when `keep_h`.
pub fn forward_program(s: &ProgramSpec, keep_h: bool) -> Result<String> {
    let strategy = match keep_h {
        true => BackwardStrategy::SavedState,
        false => BackwardStrategy::Rematerialize,
    };
    program(s, ProgramKind::Forward(strategy))
}

/// The backward program. Inputs: the forward's, then `[h]` (saved state), `do`, `[dht]`.
/// Outputs: `dq dk dv dg dbeta [dh0] [da_log] [ddt_bias]`.
pub fn backward_program(s: &ProgramSpec, strategy: BackwardStrategy) -> Result<String> {
    program(s, ProgramKind::Backward(strategy))
}

/// The fused forward+VJP program: inputs of the forward then `do`, `[dht]`; outputs `o`,
/// `[final_state]`, then the gradients.
pub fn fused_program(s: &ProgramSpec, strategy: BackwardStrategy) -> Result<String> {
    program(s, ProgramKind::Fused(strategy))
}
