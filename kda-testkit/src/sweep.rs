//! The regression sweep: a cross product of shapes (the singleton ones of spec section 6 among
//! them, fixed and packed), gate modes (with and without the q/k L2 norm), dtypes and the four
//! backward variants (two strategies, split and fused), each point one forward+VJP checked
//! against `kda-ref` at the spec's targets. 10 x 4 x 2 x 4 = 320 points; a backend instantiates
//! it as an `rstest` matrix over [`SHAPES`], [`GATES`], the dtypes and [`VARIANTS`] (see
//! `kda-tpu/tests/sweep.rs`), so every point is its own test and CI shards them.
//!
//! Small shapes keep each point quick; which points carry initial/final states, `beta [.., 1]`
//! or a harder input profile rotates with the shape and gate, so every combination of those
//! with every gate mode appears somewhere in the sweep.

use crate::cases::{Case, CaseGate, CaseSegments, Profile};
use crate::conformance::{backward_case, Path, Report};
use kda_core::{Backend, BackwardStrategy, DType, Layout};

/// One shape of the sweep: `(H, B, T, K, V)`, layout and segmentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepShape {
    /// T = 1, H = 1 (the smallest problem).
    H1B1T1,
    /// H = 1, B = 2, T = 65 (one token past a chunk).
    H1B2T65,
    /// K = 96, V = 160, batch-first.
    K96V160,
    /// K = 129, V = 127, T = 64 (exactly one chunk).
    K129V127,
    /// K = 256 (the largest supported), V = 32.
    K256V32,
    /// B = 2, T = 130, batch-first, K != V.
    B2T130,
    /// Packed, per-row lengths with 1, 63 and 0 (empty) segments.
    PackedEdges,
    /// Packed via `segment_ids`, a 64-aligned segment and one crossing two chunk boundaries.
    PackedIds,
    /// Packed one-token segments.
    PackedOnes,
    /// Packed, two rows with different segmentations, batch-first.
    PackedRows,
}

/// Every sweep shape.
pub const SHAPES: [SweepShape; 10] = [
    SweepShape::H1B1T1,
    SweepShape::H1B2T65,
    SweepShape::K96V160,
    SweepShape::K129V127,
    SweepShape::K256V32,
    SweepShape::B2T130,
    SweepShape::PackedEdges,
    SweepShape::PackedIds,
    SweepShape::PackedOnes,
    SweepShape::PackedRows,
];

/// The gate modes of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepGate {
    /// `g` given pre-activated.
    Preactivated,
    /// Pre-activated with the in-kernel q/k L2 norm.
    PreactivatedL2,
    /// In-kernel softplus with `dt_bias`.
    Softplus,
    /// In-kernel lower bound (-5) with `dt_bias` and the L2 norm (the Kimi-Linear setting).
    LowerBoundL2,
}

/// Every sweep gate.
pub const GATES: [SweepGate; 4] =
    [SweepGate::Preactivated, SweepGate::PreactivatedL2, SweepGate::Softplus, SweepGate::LowerBoundL2];

/// A backward variant: the strategy and whether the fused executable or the split path runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepVariant {
    /// Saved-state forward, then backward.
    SavedStateSplit,
    /// Saved-state fused forward+VJP.
    SavedStateFused,
    /// Rematerialized forward, then backward.
    RematSplit,
    /// Rematerialized fused forward+VJP.
    RematFused,
}

/// Every sweep variant.
pub const VARIANTS: [SweepVariant; 4] = [
    SweepVariant::SavedStateSplit,
    SweepVariant::SavedStateFused,
    SweepVariant::RematSplit,
    SweepVariant::RematFused,
];

impl SweepVariant {
    /// The strategy and path.
    pub fn parts(self) -> (BackwardStrategy, Path) {
        match self {
            SweepVariant::SavedStateSplit => (BackwardStrategy::SavedState, Path::Split),
            SweepVariant::SavedStateFused => (BackwardStrategy::SavedState, Path::Fused),
            SweepVariant::RematSplit => (BackwardStrategy::Rematerialize, Path::Split),
            SweepVariant::RematFused => (BackwardStrategy::Rematerialize, Path::Fused),
        }
    }
}

fn index<T: PartialEq>(all: &[T], x: &T) -> usize {
    all.iter().position(|y| y == x).unwrap_or(0)
}

/// The case of one sweep point (its name, which seeds its inputs, spells out the point).
pub fn sweep_case(shape: SweepShape, gate: SweepGate, dtype: DType) -> Case {
    use SweepShape as S;
    let (si, gi) = (index(&SHAPES, &shape), index(&GATES, &gate));
    let rows = |r: &[&[usize]]| CaseSegments::Lengths(r.iter().map(|x| x.to_vec()).collect());
    let (h, b, t, k, v, layout, segments) = match shape {
        S::H1B1T1 => (1, 1, 1, 8, 8, Layout::HeadFirst, CaseSegments::Fixed),
        S::H1B2T65 => (1, 2, 65, 16, 16, Layout::HeadFirst, CaseSegments::Fixed),
        S::K96V160 => (2, 1, 70, 96, 160, Layout::BatchFirst, CaseSegments::Fixed),
        S::K129V127 => (1, 1, 64, 129, 127, Layout::HeadFirst, CaseSegments::Fixed),
        S::K256V32 => (1, 1, 40, 256, 32, Layout::HeadFirst, CaseSegments::Fixed),
        S::B2T130 => (2, 2, 130, 24, 40, Layout::BatchFirst, CaseSegments::Fixed),
        S::PackedEdges => (2, 2, 100, 16, 16, Layout::HeadFirst, rows(&[&[1, 63, 0, 30], &[40, 60, 0, 0]])),
        S::PackedIds => {
            (2, 1, 150, 16, 24, Layout::HeadFirst, CaseSegments::SegmentIds(vec![vec![64, 70, 16]]))
        }
        S::PackedOnes => (2, 1, 9, 8, 8, Layout::HeadFirst, rows(&[&[1; 9]])),
        S::PackedRows => (3, 2, 90, 24, 16, Layout::BatchFirst, rows(&[&[64, 0, 26], &[17, 73, 0]])),
    };
    let (case_gate, l2norm) = match gate {
        SweepGate::Preactivated => (CaseGate::Preactivated, false),
        SweepGate::PreactivatedL2 => (CaseGate::Preactivated, true),
        SweepGate::Softplus => (CaseGate::Softplus, false),
        SweepGate::LowerBoundL2 => (CaseGate::LowerBound(-5.0), true),
    };
    // Rotations: states on 3 of every 4 points, beta [.., 1] on every third, and a hard input
    // profile (strong decay, hard reset, beta edges) on every other point.
    let rot = si + gi;
    let profile = match rot % 6 {
        1 => Profile::StrongDecay,
        3 => Profile::HardReset,
        5 => Profile::BetaEdges,
        _ => Profile::Standard,
    };
    let dt = if dtype == DType::BF16 { "bf16" } else { "f32" };
    let name = format!("sweep_{shape:?}_{gate:?}_{dt}").to_lowercase();
    Case {
        name: Box::leak(name.into_boxed_str()),
        h,
        b,
        t,
        k,
        v,
        layout,
        gate: case_gate,
        l2norm,
        initial_state: rot % 4 != 0,
        final_state: rot % 4 != 1,
        beta_trailing_one: rot % 3 == 0,
        segments,
        profile,
        heavy: false,
    }
}

/// Runs one sweep point on `backend`: forward+VJP in `variant` against the reference.
pub fn run<B: Backend>(
    backend: &B,
    shape: SweepShape,
    gate: SweepGate,
    dtype: DType,
    variant: SweepVariant,
) -> Result<Report, String> {
    let case = sweep_case(shape, gate, dtype);
    let (strategy, path) = variant.parts();
    backward_case(backend, &case, dtype, strategy, path)
}
