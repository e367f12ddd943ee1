//! The case table: complete, consistent, and covering docs/kda.md, Shapes.

use kda_core::Layout;
use kda_testkit::{all_cases, case, case_data, CaseGate, CaseSegments, Profile, CASE_NAMES};
use rstest::rstest;

#[test]
fn every_listed_name_has_a_case_with_that_name() {
    for name in CASE_NAMES {
        let c = case(name).unwrap_or_else(|| panic!("{name} listed but not in the table"));
        assert_eq!(c.name, *name);
    }
    let mut names = CASE_NAMES.to_vec();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), CASE_NAMES.len(), "duplicate case names");
    assert!(case("no_such_case").is_none());
}

fn lengths_present(len: usize) -> bool {
    all_cases().iter().any(|c| match &c.segments {
        CaseSegments::Lengths(r) | CaseSegments::SegmentIds(r) => r.iter().flatten().any(|&l| l == len),
        CaseSegments::Fixed => false,
    })
}

#[rstest]
#[case::single_head(|| all_cases().iter().any(|c| c.h == 1))]
#[case::one_row(|| all_cases().iter().any(|c| c.b == 1))]
#[case::several_rows(|| all_cases().iter().any(|c| c.b > 1))]
#[case::one_token(|| all_cases().iter().any(|c| c.t == 1))]
#[case::one_token_segment(|| lengths_present(1))]
#[case::segment_lengths_63_64_65_0(|| [63, 64, 65, 0].iter().all(|&l| lengths_present(l)))]
#[case::packed_several_rows(|| all_cases().iter().any(|c| c.is_packed() && c.b > 1))]
#[case::packed_one_slot(|| all_cases().iter().any(|c| kda_testkit::inputs::slots(c) == 1 && c.is_packed()))]
#[case::segment_ids(|| all_cases().iter().any(|c| matches!(c.segments, CaseSegments::SegmentIds(_))))]
#[case::beta_trailing_one(|| all_cases().iter().any(|c| c.beta_trailing_one))]
#[case::k96_v160(|| all_cases().iter().any(|c| c.k == 96 && c.v == 160))]
#[case::k129_v127(|| all_cases().iter().any(|c| c.k == 129 && c.v == 127))]
#[case::k_ne_v(|| all_cases().iter().any(|c| c.k != c.v))]
#[case::k256(|| all_cases().iter().any(|c| c.k == 256))]
#[case::both_layouts(|| [Layout::HeadFirst, Layout::BatchFirst].iter().all(|l| all_cases().iter().any(|c| c.layout == *l)))]
#[case::every_gate(|| all_cases().iter().any(|c| c.gate == CaseGate::Softplus)
    && all_cases().iter().any(|c| matches!(c.gate, CaseGate::LowerBound(_))))]
#[case::every_profile(|| [Profile::StrongDecay, Profile::HardReset, Profile::BetaEdges].iter()
    .all(|p| all_cases().iter().any(|c| c.profile == *p)))]
#[case::primary_benchmark_shape(|| all_cases().iter().any(|c| (c.h, c.t, c.k, c.v) == (8, 1024, 128, 128)))]
fn table_covers(#[case] covered: fn() -> bool) {
    assert!(covered());
}

#[test]
fn every_case_draws_valid_inputs() {
    for c in all_cases() {
        let data = case_data(&c, kda_core::DType::F32).unwrap();
        let p = data.inputs.validate().unwrap_or_else(|e| panic!("{}: {e}", c.name));
        data.cotangents.validate(&p).unwrap();
        assert_eq!(
            (p.dims.h, p.dims.b, p.dims.t, p.dims.k, p.dims.v),
            (c.h, c.b, c.t, c.k, c.v),
            "{}",
            c.name
        );
    }
}

#[test]
fn inputs_are_reproducible_from_the_name() {
    let c = case("fixed_small").unwrap();
    let a = case_data(&c, kda_core::DType::BF16).unwrap();
    let b = case_data(&c, kda_core::DType::BF16).unwrap();
    assert_eq!(a.inputs, b.inputs);
    assert_ne!(
        a.inputs.q,
        case_data(&case("strong_decay").unwrap(), kda_core::DType::BF16).unwrap().inputs.q
    );
}

/// The strong-decay profile puts every activated log-decay near -5 (the edge of the
/// well-conditioned range of docs/kda.md, Accuracy, g in [-5, 0]) whatever the gate mode: the raw inputs of an in-kernel
/// gate are drawn so that its activation lands there.
#[rstest::rstest]
#[case::preactivated(kda_testkit::sweep::SweepGate::Preactivated, -4.5)]
#[case::softplus(kda_testkit::sweep::SweepGate::Softplus, -4.5)]
#[case::lower_bound(kda_testkit::sweep::SweepGate::LowerBoundL2, -3.5)]
fn strong_decay_keeps_the_log_decay_near_minus_five(
    #[case] gate: kda_testkit::sweep::SweepGate,
    #[case] highest: f64,
) {
    use kda_core::{GateMode, Layout};
    use kda_testkit::sweep::{sweep_case, SweepPoint, SweepShape, SweepVariant};
    for shape in [SweepShape::K96V160, SweepShape::K256V32, SweepShape::PackedRows] {
        let c = sweep_case(&SweepPoint {
            shape,
            gate,
            dtype: kda_core::DType::F32,
            variant: SweepVariant::SavedStateFused,
            profile: kda_testkit::Profile::StrongDecay,
        });
        let x = case_data(&c, kda_core::DType::F32).unwrap().inputs;
        let raw = x.g.to_f64_vec();
        let head = |i: usize| match c.layout {
            Layout::HeadFirst => i / c.k / (c.b * c.t),
            Layout::BatchFirst => (i / c.k) % c.h,
        };
        let params = |a: &Option<kda_core::HostTensor>| a.as_ref().map(|t| t.to_f64_vec()).unwrap();
        let g: Vec<f64> = match &x.gate {
            GateMode::Preactivated => raw,
            GateMode::Softplus { a_log, dt_bias } => {
                let (a, dt) = (params(a_log), params(dt_bias));
                let at = |i: usize| raw[i] + dt[head(i) * c.k + i % c.k];
                (0..raw.len()).map(|i| -a[head(i)].exp() * at(i).exp().ln_1p()).collect()
            }
            GateMode::LowerBound { lb, a_log, dt_bias } => {
                let (a, dt) = (params(a_log), params(dt_bias));
                let at = |i: usize| a[head(i)].exp() * (raw[i] + dt[head(i) * c.k + i % c.k]);
                (0..raw.len()).map(|i| lb / (1.0 + (-at(i)).exp())).collect()
            }
        };
        let (lo, hi) = g.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        assert!(lo >= -5.0 - 1e-4 && hi <= highest, "{}: log-decay in [{lo}, {hi}]", c.name);
    }
}

/// The sweep's whole product: 1280 distinct points whose inputs validate, covering every gate
/// mode with and without states, fixed and packed, in both tiers.
#[test]
fn sweep_points_are_distinct_and_valid() {
    use kda_testkit::sweep::{full_product, sweep_case, GATES, PAIRWISE};
    let all = full_product();
    assert_eq!(all.len(), 1280);
    let mut names = std::collections::BTreeSet::new();
    for p in &all {
        let c = sweep_case(p);
        // One case (inputs) per point, the variant included.
        names.insert(c.name);
        let data = case_data(&c, p.dtype).unwrap();
        let problem = data.inputs.validate().unwrap_or_else(|e| panic!("{}: {e}", c.name));
        data.cotangents.validate(&problem).unwrap();
    }
    assert_eq!(names.len(), all.len(), "every point must have inputs of its own");
    for (tier, points) in [("pairwise", PAIRWISE.to_vec()), ("full", all)] {
        let mut seen = std::collections::BTreeSet::new();
        for p in &points {
            let c = sweep_case(p);
            seen.insert((format!("{:?}", p.gate), c.initial_state, c.final_state, c.is_packed()));
        }
        for gate in &GATES {
            for packed in [false, true] {
                for (h0, fin) in [(true, true), (false, true), (true, false)] {
                    let want = (format!("{gate:?}"), h0, fin, packed);
                    assert!(seen.contains(&want), "{tier}: no point with {want:?}");
                }
            }
        }
    }
}

/// The pairwise tier covers every pair of values of any two sweep factors, names each point
/// once, and holds points of the whole product only.
#[test]
fn sweep_pairwise_tier_covers_every_pair() {
    use kda_testkit::sweep::{full_product, uncovered_pairs, PAIRWISE};
    assert_eq!(uncovered_pairs(PAIRWISE), vec![]);
    let all = full_product();
    for p in PAIRWISE {
        assert!(all.contains(p), "{p:?} is not a point of the product");
    }
    let distinct: std::collections::BTreeSet<_> = PAIRWISE.iter().map(|p| format!("{p:?}")).collect();
    assert_eq!(distinct.len(), PAIRWISE.len(), "a point is listed twice");
}

/// The covering check finds a missing pair: without its one point that pairs `H1B1T1` with
/// the lower-bound gate, the tier is no longer pairwise.
#[test]
fn sweep_covering_check_finds_a_missing_pair() {
    use kda_testkit::sweep::{uncovered_pairs, SweepGate, SweepShape, PAIRWISE};
    let fewer: Vec<_> = PAIRWISE
        .iter()
        .filter(|p| !(p.shape == SweepShape::H1B1T1 && p.gate == SweepGate::LowerBoundL2))
        .copied()
        .collect();
    assert_eq!(fewer.len(), PAIRWISE.len() - 1);
    assert!(uncovered_pairs(&fewer).contains(&("shape", 0, "gate", 3)));
}
