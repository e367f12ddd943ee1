//! KDA programs as functions of a caller's own module: [`add_function`] emits program `kind` of
//! a spec as a private `func.func @name`, and the caller's `@main` (or any later function)
//! calls it with [`FnBuilder::call`](crate::hlo::FnBuilder::call), passing the arguments and
//! declaring the results of the returned [`ProgramSignature`]. One compiled program can so hold
//! a whole layer around KDA (projections before, a loss after), with the KDA forward+VJP inlined
//! by the compiler.
//!
//! The signature (argument order, dtypes, dims) is documented in [`super::interface`]: the
//! per-token inputs `q k v g beta` in the spec's layout and dtype, the optional `h0 a_log
//! dt_bias`, the index tables `chunk_first chunk_last chunk_slot [slot_token token_slot]`
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
//! use kda_tpu::kernels::compose::{add_function, ProgramConfig};
//! use kda_tpu::kernels::interface::index_tables;
//! use kda_tpu::{KernelSpec, ProgramKind};
//!
//! // The spec of a call: batch-first [B, T, H, D] = [1, 128, 2, 16], f32, in-kernel q/k norm.
//! let x = |d: usize| HostTensor::zeros(&[1, 128, 2, d], DType::F32);
//! let inputs = KdaInputs::new(x(16), x(16), x(16), x(16), HostTensor::zeros(&[1, 128, 2], DType::F32))
//!     .with_config(KdaConfig { use_qk_l2norm: true, ..KdaConfig::default() });
//! let spec = KernelSpec::of_inputs(&inputs, false)?;
//!
//! // The KDA forward as @kda_forward, and a @main that passes its arguments through and
//! // returns `o` doubled.
//! let mut module = Module::new();
//! let kind = ProgramKind::Forward(false);
//! let sig = add_function(&mut module, "kda_forward", &spec, kind, ProgramConfig::Cpu)?;
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

use super::interface::{ProgramKind, ProgramSignature};
use super::programs::build;
use super::spec::KernelSpec;
use crate::hlo::Module;
use crate::Result;

/// How the program is laid out for its device; the caller chooses (nothing is inferred from a
/// plugin here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ProgramConfig {
    /// The CPU configuration: no slabs, all chunks' parallel work at once (fastest where memory
    /// is plentiful).
    #[default]
    Cpu,
    /// The TPU/GPU configuration: fused programs (and the forward) in slabs of this many chunk
    /// positions ([`KernelSpec::with_slab`]; [`super::TPU_SLAB`] on TPU), bounding the live
    /// intermediates to one slab's.
    Slabs(usize),
}

impl ProgramConfig {
    /// `spec` in this configuration.
    pub fn apply(self, spec: &KernelSpec) -> KernelSpec {
        match self {
            ProgramConfig::Cpu => spec.clone().with_slab(0),
            ProgramConfig::Slabs(n) => spec.clone().with_slab(n),
        }
    }
}

/// Emits program `kind` of `spec` (in `config`) into `module` as the private function `@name`
/// and returns its signature; call it with `FnBuilder::call(name, &args, &sig.result_types())`
/// from a function added to `module` afterwards.
pub fn add_function(
    module: &mut Module,
    name: &str,
    spec: &KernelSpec,
    kind: ProgramKind,
    config: ProgramConfig,
) -> Result<ProgramSignature> {
    let spec = config.apply(spec);
    let (f, sig) = build(name, false, &spec, kind)?;
    module.add(f)?;
    Ok(sig)
}
