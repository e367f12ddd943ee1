//! The testkit's regression sweep on the PJRT backend, each point its own test (so `cargo xtask
//! test --shard i/n` spreads them), each a forward+VJP checked against `kda-ref` at the spec's
//! targets:
//! - `pairwise::*`: the 40 points in which every pair of values of any two factors (shape, gate,
//!   dtype, strategy, path, profile) occurs; part of every `cargo xtask test`;
//! - `full::point::*`: the whole product, 1280 points, run by `cargo xtask test --full`.
//!
//! The fused programs run in slabs of `TPU_SLAB` chunk positions, as on a TPU (the conformance
//! suite covers the CPU configuration); so does the forward alone on a few cases of the shared
//! table (`forward_tpu_configuration`).

use kda_core::DType;
use rstest::rstest;

/// The backend every point runs on: the default plugin in the TPU configuration.
fn tpu_configuration() -> kda_tpu::PjrtBackend {
    let be = kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)");
    be.clone().with_tuning(be.tuning().with_slab(kda_tpu::op::TPU_SLAB)).expect("a tuning")
}

mod pairwise {
    kda_testkit::for_each_sweep_point!(@list tests super::tpu_configuration());
}

mod full {
    use kda_core::DType;
    use kda_testkit::cases::Profile as P;
    use kda_testkit::sweep::{self, SweepGate as G, SweepPoint, SweepShape as S, SweepVariant as V};
    use rstest::rstest;

    #[rstest]
    fn point(
        #[values(
            S::H1B1T1,
            S::H1B2T65,
            S::K96V160,
            S::K129V127,
            S::K256V32,
            S::B2T130,
            S::PackedEdges,
            S::PackedIds,
            S::PackedOnes,
            S::PackedRows
        )]
        shape: S,
        #[values(G::Preactivated, G::PreactivatedL2, G::Softplus, G::LowerBoundL2)] gate: G,
        #[values(DType::F32, DType::BF16)] dtype: DType,
        #[values(V::SavedStateSplit, V::SavedStateFused, V::RematSplit, V::RematFused)] variant: V,
        #[values(P::Standard, P::StrongDecay, P::HardReset, P::BetaEdges)] profile: P,
    ) {
        let point = SweepPoint { shape, gate, dtype, variant, profile };
        match sweep::run(&super::tpu_configuration(), point) {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("sweep failure:\n{failure}"),
        }
    }
}

/// The forward program alone in the TPU configuration (the CPU configuration forms the outputs
/// inside the recurrence; this one keeps them chunk-parallel), against the reference.
#[rstest]
fn forward_tpu_configuration(
    #[values(
        "fixed_batch_first_b2",
        "k129_v127",
        "hard_reset",
        "gate_lower_bound_l2norm",
        "packed_lengths_1_63_64_65_0",
        "packed_segment_ids"
    )]
    case: &str,
    #[values(DType::F32, DType::BF16)] dtype: DType,
) {
    match kda_testkit::conformance::forward(&tpu_configuration(), case, dtype) {
        Ok(report) => eprint!("{report}"),
        Err(failure) => panic!("forward failure:\n{failure}"),
    }
}
