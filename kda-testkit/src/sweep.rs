//! The regression sweep: small problems over six independent factors, each point one
//! forward+VJP checked against `kda-ref` at the limits of docs/kda.md. The factors are the shape (10:
//! the singleton ones of docs/kda.md, Shapes among them, fixed and packed), the gate mode (4: with and
//! without the q/k L2 norm), the dtype (2), the backward strategy (2), the path (split or fused:
//! 2) and the input profile (4).
//!
//! Two tiers instantiate it (see `kda-tpu/tests/sweep.rs`):
//! - the pairwise tier, [`for_each_sweep_point!`](crate::for_each_sweep_point)'s 40 named points, in which every pair of
//!   values of any two factors occurs in at least one point (a test checks that property on the
//!   table itself); it runs in every `cargo xtask test`;
//! - the whole product, 10 x 4 x 2 x 2 x 2 x 4 = 1280 points, an `rstest` matrix under `full::`
//!   that `cargo xtask test --full` runs.
//!
//! Which points carry initial/final states or `beta [.., 1]` rotates with the shape and gate, so
//! every combination of those with every gate mode appears in both tiers.

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

/// Every input profile, the sweep's sixth factor.
pub const PROFILES: [Profile; 4] =
    [Profile::Standard, Profile::StrongDecay, Profile::HardReset, Profile::BetaEdges];

/// One point of the sweep: a value of each factor (the strategy and path as one [`SweepVariant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepPoint {
    /// The shape.
    pub shape: SweepShape,
    /// The gate mode.
    pub gate: SweepGate,
    /// The dtype of the activations.
    pub dtype: DType,
    /// The backward strategy and path.
    pub variant: SweepVariant,
    /// The input profile.
    pub profile: Profile,
}

impl SweepPoint {
    /// The point's value of each factor as an index into its factor's list: shape, gate, dtype,
    /// strategy, path, profile (the order of [`FACTOR_LEVELS`]).
    pub fn levels(&self) -> [usize; 6] {
        let (strategy, path) = self.variant.parts();
        [
            index(&SHAPES, &self.shape),
            index(&GATES, &self.gate),
            usize::from(self.dtype == DType::BF16),
            usize::from(strategy == BackwardStrategy::Rematerialize),
            usize::from(path == Path::Fused),
            index(&PROFILES, &self.profile),
        ]
    }
}

/// The factors' names and their number of values, in [`SweepPoint::levels`] order.
pub const FACTOR_LEVELS: [(&str, usize); 6] =
    [("shape", 10), ("gate", 4), ("dtype", 2), ("strategy", 2), ("path", 2), ("profile", 4)];

/// The pairs of values of two factors that no point of `points` holds, as
/// `(factor, value, factor, value)`; empty when `points` covers every pair.
pub fn uncovered_pairs(points: &[SweepPoint]) -> Vec<(&'static str, usize, &'static str, usize)> {
    let levels: Vec<[usize; 6]> = points.iter().map(SweepPoint::levels).collect();
    let mut missing = Vec::new();
    for (i, &(fi, ni)) in FACTOR_LEVELS.iter().enumerate() {
        for (j, &(fj, nj)) in FACTOR_LEVELS.iter().enumerate().skip(i + 1) {
            for a in 0..ni {
                for b in 0..nj {
                    if !levels.iter().any(|l| l[i] == a && l[j] == b) {
                        missing.push((fi, a, fj, b));
                    }
                }
            }
        }
    }
    missing
}

/// The pairwise tier's points, named. `for_each_sweep_point!(@list points)` gives them as a
/// `&[SweepPoint]` ([`PAIRWISE`]); `for_each_sweep_point!(@list tests EXPR)` expands one test per
/// point on the backend `EXPR` builds. The list was drawn as a covering array of strength two
/// (40 points, the least possible: shape times gate) with the split path on one point per shape
/// only (a split point compiles two programs, a fused one one); `tests/table.rs` checks that it
/// still covers every pair.
#[macro_export]
macro_rules! for_each_sweep_point {
    (@list $($cb:tt)*) => {
        $crate::for_each_sweep_point! { @apply [$($cb)*]
            h1_b1_t1_preact_bf16_saved_fused_standard: (H1B1T1, Preactivated, BF16, SavedStateFused, Standard),
            h1_b1_t1_preact_l2_f32_saved_split_strong_decay: (H1B1T1, PreactivatedL2, F32, SavedStateSplit, StrongDecay),
            h1_b1_t1_softplus_bf16_remat_fused_hard_reset: (H1B1T1, Softplus, BF16, RematFused, HardReset),
            h1_b1_t1_lower_bound_l2_bf16_remat_fused_beta_edges: (H1B1T1, LowerBoundL2, BF16, RematFused, BetaEdges),
            h1_b2_t65_preact_f32_remat_fused_strong_decay: (H1B2T65, Preactivated, F32, RematFused, StrongDecay),
            h1_b2_t65_preact_l2_bf16_remat_fused_hard_reset: (H1B2T65, PreactivatedL2, BF16, RematFused, HardReset),
            h1_b2_t65_softplus_bf16_saved_split_beta_edges: (H1B2T65, Softplus, BF16, SavedStateSplit, BetaEdges),
            h1_b2_t65_lower_bound_l2_bf16_saved_fused_standard: (H1B2T65, LowerBoundL2, BF16, SavedStateFused, Standard),
            k96_v160_preact_bf16_remat_fused_hard_reset: (K96V160, Preactivated, BF16, RematFused, HardReset),
            k96_v160_preact_l2_bf16_saved_fused_beta_edges: (K96V160, PreactivatedL2, BF16, SavedStateFused, BetaEdges),
            k96_v160_softplus_f32_saved_split_standard: (K96V160, Softplus, F32, SavedStateSplit, Standard),
            k96_v160_lower_bound_l2_bf16_remat_fused_strong_decay: (K96V160, LowerBoundL2, BF16, RematFused, StrongDecay),
            k129_v127_preact_bf16_saved_fused_beta_edges: (K129V127, Preactivated, BF16, SavedStateFused, BetaEdges),
            k129_v127_preact_l2_bf16_remat_split_standard: (K129V127, PreactivatedL2, BF16, RematSplit, Standard),
            k129_v127_softplus_f32_remat_fused_strong_decay: (K129V127, Softplus, F32, RematFused, StrongDecay),
            k129_v127_lower_bound_l2_bf16_remat_fused_hard_reset: (K129V127, LowerBoundL2, BF16, RematFused, HardReset),
            k256_v32_preact_f32_remat_fused_standard: (K256V32, Preactivated, F32, RematFused, Standard),
            k256_v32_preact_l2_f32_saved_fused_strong_decay: (K256V32, PreactivatedL2, F32, SavedStateFused, StrongDecay),
            k256_v32_softplus_bf16_saved_split_hard_reset: (K256V32, Softplus, BF16, SavedStateSplit, HardReset),
            k256_v32_lower_bound_l2_f32_remat_fused_beta_edges: (K256V32, LowerBoundL2, F32, RematFused, BetaEdges),
            b2_t130_preact_bf16_remat_split_strong_decay: (B2T130, Preactivated, BF16, RematSplit, StrongDecay),
            b2_t130_preact_l2_f32_remat_fused_hard_reset: (B2T130, PreactivatedL2, F32, RematFused, HardReset),
            b2_t130_softplus_bf16_saved_fused_beta_edges: (B2T130, Softplus, BF16, SavedStateFused, BetaEdges),
            b2_t130_lower_bound_l2_bf16_saved_fused_standard: (B2T130, LowerBoundL2, BF16, SavedStateFused, Standard),
            packed_edges_preact_f32_saved_fused_hard_reset: (PackedEdges, Preactivated, F32, SavedStateFused, HardReset),
            packed_edges_preact_l2_bf16_remat_fused_beta_edges: (PackedEdges, PreactivatedL2, BF16, RematFused, BetaEdges),
            packed_edges_softplus_f32_remat_split_standard: (PackedEdges, Softplus, F32, RematSplit, Standard),
            packed_edges_lower_bound_l2_bf16_saved_fused_strong_decay: (PackedEdges, LowerBoundL2, BF16, SavedStateFused, StrongDecay),
            packed_ids_preact_f32_saved_fused_beta_edges: (PackedIds, Preactivated, F32, SavedStateFused, BetaEdges),
            packed_ids_preact_l2_bf16_remat_split_standard: (PackedIds, PreactivatedL2, BF16, RematSplit, Standard),
            packed_ids_softplus_bf16_remat_fused_strong_decay: (PackedIds, Softplus, BF16, RematFused, StrongDecay),
            packed_ids_lower_bound_l2_bf16_remat_fused_hard_reset: (PackedIds, LowerBoundL2, BF16, RematFused, HardReset),
            packed_ones_preact_bf16_remat_fused_standard: (PackedOnes, Preactivated, BF16, RematFused, Standard),
            packed_ones_preact_l2_f32_remat_fused_strong_decay: (PackedOnes, PreactivatedL2, F32, RematFused, StrongDecay),
            packed_ones_softplus_bf16_remat_fused_hard_reset: (PackedOnes, Softplus, BF16, RematFused, HardReset),
            packed_ones_lower_bound_l2_f32_saved_split_beta_edges: (PackedOnes, LowerBoundL2, F32, SavedStateSplit, BetaEdges),
            packed_rows_preact_f32_saved_fused_strong_decay: (PackedRows, Preactivated, F32, SavedStateFused, StrongDecay),
            packed_rows_preact_l2_f32_remat_fused_hard_reset: (PackedRows, PreactivatedL2, F32, RematFused, HardReset),
            packed_rows_softplus_f32_remat_fused_beta_edges: (PackedRows, Softplus, F32, RematFused, BetaEdges),
            packed_rows_lower_bound_l2_bf16_remat_split_standard: (PackedRows, LowerBoundL2, BF16, RematSplit, Standard),
        }
    };
    (@apply [points] $($n:ident: ($s:ident, $g:ident, $d:ident, $v:ident, $p:ident)),* $(,)?) => {
        &[$($crate::sweep::SweepPoint {
            shape: $crate::__private::SweepShape::$s,
            gate: $crate::__private::SweepGate::$g,
            dtype: $crate::__private::DType::$d,
            variant: $crate::__private::SweepVariant::$v,
            profile: $crate::__private::Profile::$p,
        }),*]
    };
    (@apply [tests $make:expr] $($n:ident: ($s:ident, $g:ident, $d:ident, $v:ident, $p:ident)),* $(,)?) => {
        $(
            #[test]
            fn $n() {
                let point = $crate::sweep::SweepPoint {
                    shape: $crate::__private::SweepShape::$s,
                    gate: $crate::__private::SweepGate::$g,
                    dtype: $crate::__private::DType::$d,
                    variant: $crate::__private::SweepVariant::$v,
                    profile: $crate::__private::Profile::$p,
                };
                match $crate::sweep::run(&$make, point) {
                    Ok(report) => eprint!("{report}"),
                    Err(failure) => panic!("sweep failure:\n{failure}"),
                }
            }
        )*
    };
}

/// The pairwise tier (see [`for_each_sweep_point!`](crate::for_each_sweep_point)).
pub const PAIRWISE: &[SweepPoint] = for_each_sweep_point!(@list points);

/// Every point of the whole product, in factor order.
pub fn full_product() -> Vec<SweepPoint> {
    let mut all = Vec::new();
    for shape in SHAPES {
        for gate in GATES {
            for dtype in [DType::F32, DType::BF16] {
                for variant in VARIANTS {
                    for profile in PROFILES {
                        all.push(SweepPoint { shape, gate, dtype, variant, profile });
                    }
                }
            }
        }
    }
    all
}

fn index<T: PartialEq>(all: &[T], x: &T) -> usize {
    all.iter().position(|y| y == x).unwrap_or(0)
}

/// The case of one sweep point. Its name, which seeds its inputs, spells out the whole point,
/// the variant included, so every point of the product draws inputs of its own.
pub fn sweep_case(point: &SweepPoint) -> Case {
    use SweepShape as S;
    let SweepPoint { shape, gate, dtype, variant, profile } = *point;
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
    // Rotations: states on 3 of every 4 shape and gate pairs, beta [.., 1] on every third.
    let rot = si + gi;
    let dt = if dtype == DType::BF16 { "bf16" } else { "f32" };
    let name = format!("sweep_{shape:?}_{gate:?}_{dt}_{variant:?}_{profile:?}").to_lowercase();
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

/// Runs one sweep point on `backend`: forward+VJP in its variant against the reference.
pub fn run<B: Backend>(backend: &B, point: SweepPoint) -> Result<Report, String> {
    let case = sweep_case(&point);
    let (strategy, path) = point.variant.parts();
    backward_case(backend, &case, point.dtype, strategy, path)
}
