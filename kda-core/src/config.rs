//! Options of one KDA call: gate mode, scale, normalisation, layout, residual strategy.

use crate::shape::Layout;
use crate::tensor::HostTensor;

/// How the per-channel log-decay `g` is produced (docs/kda.md, Tensors).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum GateMode<T = HostTensor> {
    /// `g` is already `ln(alpha)` (the default).
    #[default]
    Preactivated,
    /// `g = -exp(a_log[h]) * softplus(x + dt_bias[h, :])`, with `x` passed as `g`.
    Softplus {
        /// `[H]`, required.
        a_log: Option<T>,
        /// `[H*K]`, optional.
        dt_bias: Option<T>,
    },
    /// `g = lb * sigmoid(exp(a_log[h]) * (x + dt_bias[h, :]))` with `lb` in `[-5, 0)`.
    LowerBound {
        /// The lower bound of the gate.
        lb: f64,
        /// `[H]`, required.
        a_log: Option<T>,
        /// `[H*K]`, optional.
        dt_bias: Option<T>,
    },
}

impl<T> GateMode<T> {
    /// The in-kernel softplus gate.
    pub fn softplus(a_log: T, dt_bias: Option<T>) -> Self {
        GateMode::Softplus { a_log: Some(a_log), dt_bias }
    }
    /// The in-kernel lower-bound gate.
    pub fn lower_bound(lb: f64, a_log: T, dt_bias: Option<T>) -> Self {
        GateMode::LowerBound { lb, a_log: Some(a_log), dt_bias }
    }
    /// `a_log` and `dt_bias` when the gate is computed in the kernel.
    pub fn params(&self) -> Option<(Option<&T>, Option<&T>)> {
        match self {
            GateMode::Preactivated => None,
            GateMode::Softplus { a_log, dt_bias } | GateMode::LowerBound { a_log, dt_bias, .. } => {
                Some((a_log.as_ref(), dt_bias.as_ref()))
            }
        }
    }
    /// The gate's kind without its tensors.
    pub fn kind(&self) -> GateKind {
        match self {
            GateMode::Preactivated => GateKind::Preactivated,
            GateMode::Softplus { .. } => GateKind::Softplus,
            GateMode::LowerBound { lb, .. } => GateKind::LowerBound(*lb),
        }
    }
}

/// [`GateMode`] without its parameter tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GateKind {
    /// `g` given directly.
    Preactivated,
    /// In-kernel softplus gate.
    Softplus,
    /// In-kernel lower-bound gate with this bound.
    LowerBound(f64),
}

/// The scalar options of a KDA call.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KdaConfig {
    /// Layout of the per-token tensors (batch-first by default, as PyTorch users hold them).
    pub layout: Layout,
    /// Query scale; `None` means `K^-1/2`.
    pub scale: Option<f64>,
    /// L2-normalise q and k over K (`x * rsqrt(sum(x^2) + 1e-6)`) inside the kernel.
    pub use_qk_l2norm: bool,
    /// Return the final state of every segment.
    pub output_final_state: bool,
}

/// The epsilon of the in-kernel q/k L2 norm.
pub const L2NORM_EPS: f64 = 1e-6;

/// The largest key width any backend supports.
pub const MAX_K: usize = 256;

/// Tokens per chunk of the chunked algorithm (docs/kda.md, Chunks): the one chunk size of every
/// program, plan and checkpoint interval in the workspace.
pub const CHUNK: usize = 64;

/// What the forward keeps for the backward (docs/kda.md, Strategies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackwardStrategy {
    /// Keep the state entering every chunk; the backward never re-runs the recurrence.
    #[default]
    SavedState,
    /// Keep no states; the backward re-runs the state recurrence.
    Rematerialize,
}

impl BackwardStrategy {
    /// Parses a name ([`BackwardStrategy::name`]), or `saved` or `rematerialize`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = match s {
            "saved" => "saved-state",
            "rematerialize" => "remat",
            s => s,
        };
        [Self::SavedState, Self::Rematerialize].into_iter().find(|x| x.name() == s)
    }
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::SavedState => "saved-state",
            Self::Rematerialize => "remat",
        }
    }
}

/// What runs a PJRT backend's chunk loops (docs/design.md, "The op table").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Implementation {
    /// XLA loops over chunks (any plugin; the default).
    #[default]
    Xla,
    /// The Mosaic forward and backward kernels in `tpu_custom_call`s (libtpu only).
    Mosaic,
    /// The Mosaic kernels' interpret lowering: the same kernels as plain StableHLO, on
    /// any plugin (what the CPU checks).
    Interpret,
    /// The GPU kernels lowered to Triton in XLA's Triton custom calls (the CUDA plugin on a
    /// Hopper GPU); the backward runs XLA's chunk loops from the kernels' forward.
    Triton,
    /// The GPU kernels' interpret lowering with a GPU's numerics: the same kernels as plain
    /// StableHLO on any plugin (what the CPU checks of the GPU kernels).
    TritonInterpret,
}

impl Implementation {
    /// Every implementation, in order.
    pub const ALL: [Implementation; 5] =
        [Self::Xla, Self::Mosaic, Self::Interpret, Self::Triton, Self::TritonInterpret];
    /// Parses a name ([`Implementation::name`]: `xla`, `mosaic`, `interpret`, `triton` or
    /// `triton-interpret`).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.name() == s)
    }
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Xla => "xla",
            Self::Mosaic => "mosaic",
            Self::Interpret => "interpret",
            Self::Triton => "triton",
            Self::TritonInterpret => "triton-interpret",
        }
    }
}
