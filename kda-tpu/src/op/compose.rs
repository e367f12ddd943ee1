//! KDA programs as functions of a caller's own module: [`add_function`] emits program `kind` of
//! a spec as a private `func.func @name`, and the caller's `@main` (or any later function)
//! calls it with [`FnBuilder::call`](crate::hlo::FnBuilder::call), passing the arguments and
//! declaring the results of the returned [`ProgramSignature`]. One compiled program can so hold
//! a whole layer around KDA (projections before, a loss after), with the KDA forward+VJP inlined
//! by the compiler.
//!
//! The signature (argument order, dtypes, dims) is documented in [`super::interface`]: the
//! per-token inputs `q k v g beta` in the spec's layout and dtype, the optional `h0 a_log
//! dt_bias`, the index tables `chunk_first chunk_last chunk_slot [slot_token token_slot token_segment]`
//! (host-built by [`index_tables`](super::interface::index_tables)), then for backward and fused
//! programs `[h] do [dht]`. The index tables are ordinary arguments: a caller passes them
//! through from its own `@main`'s arguments (or builds them as constants).
//!
//! Names: the KDA programs emit no helper functions of their own, so the only symbol
//! [`add_function`] adds is `@name`; it must not be `main`'s name or any other function's in
//! the module (`Module::add` refuses a second function of one name).
//!
//! ```
//! use kda_core::{BackwardStrategy, DType, HostTensor, KdaConfig, KdaInputs};
//! use kda_tpu::hlo::{FnBuilder, Module};
//! use kda_tpu::op::compose::add_function;
//! use kda_tpu::op::interface::index_tables;
//! use kda_tpu::{ProgramSpec, ProgramKind};
//!
//! // The spec of a call: batch-first [B, T, H, D] = [1, 128, 2, 16], f32, in-kernel q/k norm.
//! let x = |d: usize| HostTensor::zeros(&[1, 128, 2, d], DType::F32);
//! let inputs = KdaInputs::new(x(16), x(16), x(16), x(16), HostTensor::zeros(&[1, 128, 2], DType::F32))
//!     .with_config(KdaConfig { use_qk_l2norm: true, ..KdaConfig::default() });
//! let spec = ProgramSpec::of_inputs(&inputs, false)?;
//!
//! // The KDA forward as @kda_forward, and a @main that passes its arguments through and
//! // returns `o` doubled.
//! let mut module = Module::new();
//! let kind = ProgramKind::Forward(BackwardStrategy::Rematerialize);
//! let sig = add_function(&mut module, "kda_forward", &spec, kind)?.signature;
//! let mut main = FnBuilder::new("main", true);
//! let args = sig.args.iter().map(|p| main.arg(p.ty.clone())).collect::<Result<Vec<_>, _>>()?;
//! let outs = main.call("kda_forward", &args, &sig.result_types())?;
//! let o = outs[sig.result_index("o").unwrap()];
//! let doubled = main.mul_const(o, 2.0)?;
//! main.ret(&[doubled])?;
//! module.add(main)?;
//! let text = module.to_text();
//! assert!(text.contains("func.func private @kda_forward("));
//! assert!(text.contains("callee = @kda_forward"));
//! assert!(text.contains("func.func public @main("));
//!
//! // The host passes the index tables after q, k, v, g, beta (fixed length: 3 tables of [NT]).
//! let tables = index_tables(&spec, inputs.segments.as_ref())?;
//! let names: Vec<&str> = tables.iter().map(|t| t.name).collect();
//! assert_eq!(names, ["chunk_first", "chunk_last", "chunk_slot"]);
//! assert_eq!(sig.arg_index("chunk_first"), Some(5));
//! assert_eq!(tables[0].data, [1, 0]); // two chunks of 64
//! # let _ = BackwardStrategy::SavedState;
//! # Ok::<(), kda_tpu::TpuError>(())
//! ```

use super::api::build;
use super::interface::{ProgramKind, ProgramSignature};
use super::spec::ProgramSpec;
use crate::hlo::Module;
use crate::Result;

/// A KDA program emitted into a caller's module: its function name, the spec and kind it was
/// built for, and its signature (what [`crate::PjrtBackend::bind`] lays out).
#[derive(Debug, Clone, PartialEq)]
pub struct KdaFunction {
    /// The function's symbol (`@name`).
    pub name: String,
    /// The spec it computes (slabs included: the handle's configuration when the spec came
    /// from [`crate::PjrtBackend::spec`]).
    pub spec: ProgramSpec,
    /// Which program.
    pub kind: ProgramKind,
    /// Its arguments and results, in order.
    pub signature: ProgramSignature,
}

/// Emits program `kind` of `spec` into `module` as the private function `@name`; call it with
/// `FnBuilder::call(name, &args, &f.signature.result_types())` from a function added to
/// `module` afterwards.
pub fn add_function(
    module: &mut Module,
    name: &str,
    spec: &ProgramSpec,
    kind: ProgramKind,
) -> Result<KdaFunction> {
    let (f, signature) = build(name, false, spec, kind)?;
    module.add(f)?;
    Ok(KdaFunction { name: name.to_string(), spec: spec.clone(), kind, signature })
}
