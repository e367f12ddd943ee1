//! The shared case table: docs/kda.md, Shapes (singleton and shape cases), packed segmentations,
//! hard numerics and the benchmark shapes. Every backend runs all of it.

use kda_core::Layout;

/// How the inputs of a case are drawn (see [`crate::inputs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// q/k L2-normalised, g uniform in [-5, 0], beta uniform in (0, 1).
    Standard,
    /// g near -5 for every token and channel.
    StrongDecay,
    /// Standard, plus some tokens with g = -1000 (a hard reset).
    HardReset,
    /// Standard, with some beta exactly 0 and some exactly 1.
    BetaEdges,
    /// Log-decays near 0 (pre-activated g uniform in [-0.02, 0]; raw softplus inputs in
    /// [-8, -6]): states carry across many chunks, as on a model's slow channels. Context
    /// parallelism is checked on it, where a piece's entering state then matters.
    LongMemory,
    /// Standard, with every pre-activated log-decay exactly 0: no forgetting, the largest
    /// log-decay the contract allows (in-kernel gates draw their raw inputs as Standard).
    NoDecay,
}

/// The gate mode of a case.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CaseGate {
    /// `g` given pre-activated.
    Preactivated,
    /// In-kernel softplus, with `dt_bias`.
    Softplus,
    /// In-kernel lower bound `lb`, with `dt_bias`.
    LowerBound(f64),
}

/// How the tokens of each row are segmented.
#[derive(Debug, Clone, PartialEq)]
pub enum CaseSegments {
    /// Fixed length (N = 1).
    Fixed,
    /// Per-row segment lengths (trailing tokens of a row past their sum are padding).
    Lengths(Vec<Vec<usize>>),
    /// The same, handed to the backend as `segment_ids`.
    SegmentIds(Vec<Vec<usize>>),
}

/// One named case.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// The case's name (also its seed).
    pub name: &'static str,
    /// Heads.
    pub h: usize,
    /// Rows.
    pub b: usize,
    /// Tokens per row.
    pub t: usize,
    /// Key width.
    pub k: usize,
    /// Value width.
    pub v: usize,
    /// Layout of per-token tensors.
    pub layout: Layout,
    /// Gate mode.
    pub gate: CaseGate,
    /// In-kernel q/k L2 norm (q and k are drawn unnormalised then).
    pub l2norm: bool,
    /// Whether an initial state is given.
    pub initial_state: bool,
    /// Whether final states are requested (and a `dht` cotangent drawn with them).
    pub final_state: bool,
    /// Beta as `[..., 1]`.
    pub beta_trailing_one: bool,
    /// Segmentation.
    pub segments: CaseSegments,
    /// Input profile.
    pub profile: Profile,
    /// A benchmark-sized case: slow on the reference (seconds), still part of the suite.
    pub heavy: bool,
}

impl Case {
    /// A fixed-length standard case in the head-first layout with initial and final states.
    pub const fn base(name: &'static str, h: usize, b: usize, t: usize, k: usize, v: usize) -> Case {
        Case {
            name,
            h,
            b,
            t,
            k,
            v,
            layout: Layout::HeadFirst,
            gate: CaseGate::Preactivated,
            l2norm: false,
            initial_state: true,
            final_state: true,
            beta_trailing_one: false,
            segments: CaseSegments::Fixed,
            profile: Profile::Standard,
            heavy: false,
        }
    }
    /// Whether the case is packed.
    pub fn is_packed(&self) -> bool {
        self.segments != CaseSegments::Fixed
    }
}

fn lengths(rows: &[&[usize]]) -> CaseSegments {
    CaseSegments::Lengths(rows.iter().map(|r| r.to_vec()).collect())
}

/// The cases of the gate-gradient accuracy check (see
/// [`crate::conformance::gate_gradients`]): the strong-decay profile (log-decay near -5 on every
/// token and channel) with initial states and `dht`, where the gate gradients have the least room
/// in f32. `strong_decay_rows` (pre-activated, two chunks and a tail) checks `dg` row by row;
/// the others add the in-kernel gates at K = 256 and on packed segments of 1, 63, 0 and 30
/// tokens (and a row of 40 and 60).
pub fn strong_decay_gate_case(name: &str) -> Option<Case> {
    let strong = |c: Case| Case { profile: Profile::StrongDecay, ..c };
    let edges = lengths(&[&[1, 63, 0, 30], &[40, 60, 0, 0]]);
    Some(strong(match name {
        "strong_decay_rows" => Case::base("strong_decay_rows", 2, 1, 150, 32, 32),
        "strong_decay_k256_softplus" => {
            Case { gate: CaseGate::Softplus, ..Case::base("strong_decay_k256_softplus", 1, 1, 130, 256, 32) }
        }
        "strong_decay_k256_lower_bound_l2norm" => Case {
            gate: CaseGate::LowerBound(-5.0),
            l2norm: true,
            ..Case::base("strong_decay_k256_lower_bound_l2norm", 1, 1, 130, 256, 32)
        },
        "strong_decay_packed_edges_softplus" => Case {
            gate: CaseGate::Softplus,
            segments: edges,
            ..Case::base("strong_decay_packed_edges_softplus", 2, 2, 100, 16, 16)
        },
        "strong_decay_packed_edges_lower_bound_l2norm" => Case {
            gate: CaseGate::LowerBound(-5.0),
            l2norm: true,
            segments: edges,
            ..Case::base("strong_decay_packed_edges_lower_bound_l2norm", 2, 2, 100, 16, 16)
        },
        _ => return None,
    }))
}

/// Balanced lengths: `n` segments summing to `t`, the first `t % n` one token longer.
/// `n = 0` gives no segments (an empty list) rather than a division by zero.
pub fn balanced(t: usize, n: usize) -> Vec<usize> {
    match (t.checked_div(n), t.checked_rem(n)) {
        (Some(q), Some(r)) => (0..n).map(|i| q + usize::from(i < r)).collect(),
        _ => Vec::new(),
    }
}

/// The one list of case names. `for_each_case!(@list names)` gives them as a `&[&str]`;
/// `for_each_case!(@list conformance EXPR)` expands the conformance tests (see
/// [`conformance_suite!`](crate::conformance_suite)). A test checks the list against [`case`].
#[macro_export]
macro_rules! for_each_case {
    (@list $($cb:tt)*) => {
        $crate::for_each_case! { @apply [$($cb)*]
            fixed_small,
            fixed_batch_first_b2,
            singleton_h1_b1_t1,
            single_head_b2,
            k96_v160,
            k129_v127,
            k256_v32,
            k_ne_v,
            beta_trailing_one,
            no_states,
            gate_softplus,
            gate_lower_bound_l2norm,
            l2norm_preactivated,
            strong_decay,
            hard_reset,
            beta_edges,
            packed_lengths_1_63_64_65_0,
            packed_rows_differ,
            packed_segment_ids,
            packed_one_token_segments,
            packed_single_segment,
            packed_hard_reset_l2norm,
            packed_all_empty,
            primary_fixed,
            primary_packed,
            kimi_linear_scaled
        }
    };
    (@apply [names] $($n:ident),*) => { &[$(stringify!($n)),*] };
    (@apply [conformance $make:expr] $($n:ident),*) => {
        $(
            #[allow(non_snake_case)]
            mod $n {
                #[allow(unused_imports)]
                use super::*;
                use $crate::__private::{BackwardStrategy as S, DType as D, Path as P};
                fn run(r: Result<$crate::conformance::Report, String>) {
                    match r {
                        Ok(report) => eprint!("{report}"),
                        Err(failure) => panic!("conformance failure:\n{failure}"),
                    }
                }
                #[test] fn forward_f32() { run($crate::conformance::forward(&$make, stringify!($n), D::F32)) }
                #[test] fn forward_bf16() { run($crate::conformance::forward(&$make, stringify!($n), D::BF16)) }
                #[test] fn backward_saved_state_split_f32() { run($crate::conformance::backward(&$make, stringify!($n), D::F32, S::SavedState, P::Split)) }
                #[test] fn backward_saved_state_fused_f32() { run($crate::conformance::backward(&$make, stringify!($n), D::F32, S::SavedState, P::Fused)) }
                #[test] fn backward_remat_split_f32() { run($crate::conformance::backward(&$make, stringify!($n), D::F32, S::Rematerialize, P::Split)) }
                #[test] fn backward_remat_fused_f32() { run($crate::conformance::backward(&$make, stringify!($n), D::F32, S::Rematerialize, P::Fused)) }
                #[test] fn backward_saved_state_split_bf16() { run($crate::conformance::backward(&$make, stringify!($n), D::BF16, S::SavedState, P::Split)) }
                #[test] fn backward_saved_state_fused_bf16() { run($crate::conformance::backward(&$make, stringify!($n), D::BF16, S::SavedState, P::Fused)) }
                #[test] fn backward_remat_split_bf16() { run($crate::conformance::backward(&$make, stringify!($n), D::BF16, S::Rematerialize, P::Split)) }
                #[test] fn backward_remat_fused_bf16() { run($crate::conformance::backward(&$make, stringify!($n), D::BF16, S::Rematerialize, P::Fused)) }
                #[test] fn paths_agree_f32() { run($crate::conformance::paths_agree(&$make, stringify!($n), D::F32)) }
            }
        )*
    };
}

/// The names of all cases, in table order.
pub const CASE_NAMES: &[&str] = for_each_case!(@list names);

/// The case called `name`.
pub fn case(name: &str) -> Option<Case> {
    let c = |name, h, b, t, k, v| Case::base(name, h, b, t, k, v);
    Some(match name {
        "fixed_small" => c("fixed_small", 2, 1, 37, 16, 16),
        "fixed_batch_first_b2" => {
            Case { layout: Layout::BatchFirst, ..c("fixed_batch_first_b2", 2, 2, 130, 32, 24) }
        }
        "singleton_h1_b1_t1" => c("singleton_h1_b1_t1", 1, 1, 1, 8, 8),
        "single_head_b2" => c("single_head_b2", 1, 2, 100, 16, 16),
        "k96_v160" => c("k96_v160", 1, 1, 70, 96, 160),
        "k129_v127" => c("k129_v127", 1, 1, 65, 129, 127),
        "k256_v32" => c("k256_v32", 1, 1, 40, 256, 32),
        "k_ne_v" => Case { layout: Layout::BatchFirst, ..c("k_ne_v", 2, 1, 50, 24, 40) },
        "beta_trailing_one" => Case { beta_trailing_one: true, ..c("beta_trailing_one", 2, 2, 20, 8, 8) },
        "no_states" => Case { initial_state: false, final_state: false, ..c("no_states", 2, 1, 64, 16, 16) },
        "gate_softplus" => Case { gate: CaseGate::Softplus, ..c("gate_softplus", 2, 1, 80, 16, 16) },
        "gate_lower_bound_l2norm" => Case {
            gate: CaseGate::LowerBound(-5.0),
            l2norm: true,
            ..c("gate_lower_bound_l2norm", 2, 1, 80, 16, 16)
        },
        "l2norm_preactivated" => Case { l2norm: true, ..c("l2norm_preactivated", 2, 1, 70, 16, 16) },
        "strong_decay" => Case { profile: Profile::StrongDecay, ..c("strong_decay", 2, 1, 130, 32, 32) },
        "hard_reset" => Case { profile: Profile::HardReset, ..c("hard_reset", 2, 1, 130, 32, 32) },
        "beta_edges" => Case { profile: Profile::BetaEdges, ..c("beta_edges", 2, 1, 70, 16, 16) },
        "packed_lengths_1_63_64_65_0" => Case {
            segments: lengths(&[&[1, 63, 64, 65, 0]]),
            ..c("packed_lengths_1_63_64_65_0", 2, 1, 200, 16, 16)
        },
        "packed_rows_differ" => Case {
            layout: Layout::BatchFirst,
            segments: lengths(&[&[30, 70, 28], &[100, 0, 40]]),
            ..c("packed_rows_differ", 2, 2, 140, 16, 24)
        },
        "packed_segment_ids" => Case {
            segments: CaseSegments::SegmentIds(vec![vec![10, 65, 20], vec![64, 64]]),
            ..c("packed_segment_ids", 2, 2, 130, 16, 16)
        },
        "packed_one_token_segments" => {
            Case { segments: lengths(&[&[1; 12]]), ..c("packed_one_token_segments", 2, 1, 12, 8, 8) }
        }
        "packed_single_segment" => {
            Case { segments: lengths(&[&[96]]), ..c("packed_single_segment", 2, 1, 96, 16, 16) }
        }
        "packed_hard_reset_l2norm" => Case {
            profile: Profile::HardReset,
            l2norm: true,
            segments: lengths(&[&[50, 79]]),
            ..c("packed_hard_reset_l2norm", 2, 1, 140, 16, 16)
        },
        // Every segment empty: no chunk position is used (the packed loops make no trip); the
        // final states are the initial ones, `dh0` is `dht`, everything else is 0.
        "packed_all_empty" => {
            Case { segments: lengths(&[&[0, 0]]), ..c("packed_all_empty", 2, 1, 70, 16, 16) }
        }
        "primary_fixed" => Case { heavy: true, ..c("primary_fixed", 8, 1, 1024, 128, 128) },
        "primary_packed" => Case {
            heavy: true,
            segments: lengths(&[&[200, 311, 77, 436]]),
            ..c("primary_packed", 8, 1, 1024, 128, 128)
        },
        // The secondary (Kimi-Linear 48B) configuration at reduced H and T: L2 norm, lower-bound
        // gate at -5, 25 balanced segments.
        "kimi_linear_scaled" => Case {
            heavy: true,
            l2norm: true,
            gate: CaseGate::LowerBound(-5.0),
            layout: Layout::BatchFirst,
            segments: CaseSegments::Lengths(vec![balanced(1024, 25)]),
            ..c("kimi_linear_scaled", 2, 1, 1024, 128, 128)
        },
        _ => return None,
    })
}

/// Every case, in table order.
pub fn all_cases() -> Vec<Case> {
    CASE_NAMES.iter().filter_map(|n| case(n)).collect()
}

/// The benchmark shapes of docs/kda.md, Benchmarks (primary first).
pub fn benchmark_cases() -> Vec<Case> {
    let primary = Case {
        initial_state: false,
        final_state: false,
        ..Case::base("bench_primary", 8, 1, 1024, 128, 128)
    };
    let secondary = Case {
        l2norm: true,
        gate: CaseGate::LowerBound(-5.0),
        layout: Layout::BatchFirst,
        initial_state: false,
        final_state: false,
        ..Case::base("bench_secondary", 32, 1, 8192, 128, 128)
    };
    vec![
        primary.clone(),
        Case { name: "bench_primary_packed", segments: lengths(&[&[200, 311, 77, 436]]), ..primary },
        secondary.clone(),
        Case {
            name: "bench_secondary_packed",
            segments: CaseSegments::Lengths(vec![balanced(8192, 25)]),
            ..secondary
        },
        // The primary width at other sequence lengths (`bench_primary` is T = 1024).
        Case { t: 512, ..Case { name: "bench_scaling_t512", ..primary.clone() } },
        Case { t: 2048, ..Case { name: "bench_scaling_t2048", ..primary.clone() } },
        Case { t: 4096, ..Case { name: "bench_scaling_t4096", ..primary.clone() } },
        Case { t: 8192, ..Case { name: "bench_scaling_t8192", ..primary.clone() } },
        Case { t: 16384, ..Case { name: "bench_scaling_t16384", ..primary.clone() } },
        Case { t: 32768, ..Case { name: "bench_scaling_t32768", ..primary.clone() } },
        // Long rows at the primary width: fixed, 100 balanced documents, 1,000 short ones.
        Case { t: LONG_T, ..Case { name: "bench_long", ..primary.clone() } },
        Case {
            t: LONG_T,
            segments: CaseSegments::Lengths(vec![balanced(LONG_T, 100)]),
            ..Case { name: "bench_long_packed", ..primary.clone() }
        },
        Case {
            t: LONG_T,
            segments: CaseSegments::Lengths(vec![short_documents(1000)]),
            ..Case { name: "bench_long_short_segments", ..primary }
        },
    ]
}

/// Tokens per row of the long benchmark rows.
const LONG_T: usize = 32768;

/// `n` documents of 1 to 64 tokens, a fixed spread (`1 + 37 i mod 64`): each length about equally
/// often, neighbours far apart.
fn short_documents(n: usize) -> Vec<usize> {
    (0..n).map(|i| 1 + (37 * i) % 64).collect()
}

#[cfg(test)]
mod tests {
    use super::balanced;
    use rstest::rstest;

    #[test]
    fn short_documents_fit_the_long_row() {
        let d = super::short_documents(1000);
        assert!(d.iter().all(|&l| (1..=64).contains(&l)));
        assert!(d.iter().sum::<usize>() <= super::LONG_T, "{}", d.iter().sum::<usize>());
        assert_eq!((d.iter().min(), d.iter().max()), (Some(&1), Some(&64)));
    }

    #[rstest]
    #[case::even_split(12, 3, vec![4, 4, 4])]
    #[case::remainder_goes_first(10, 3, vec![4, 3, 3])]
    #[case::more_segments_than_tokens(2, 4, vec![1, 1, 0, 0])]
    #[case::zero_segments_is_empty_not_a_division_by_zero(7, 0, vec![])]
    #[case::zero_tokens_zero_segments(0, 0, vec![])]
    fn balanced_lengths_sum_to_t(#[case] t: usize, #[case] n: usize, #[case] want: Vec<usize>) {
        let got = balanced(t, n);
        assert_eq!(got, want);
        if n > 0 {
            assert_eq!(got.iter().sum::<usize>(), t);
        }
    }
}
