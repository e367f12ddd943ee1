//! Agreement metrics.

use kda_core::HostTensor;
use kda_testkit::{agreement, rms_limit, ulp_distance, Quantity};
use rstest::rstest;

#[rstest]
#[case::equal(1.0, 1.0, 0)]
#[case::signed_zeros(0.0, -0.0, 0)]
#[case::next_up(1.0, f32::from_bits(1.0f32.to_bits() + 1), 1)]
#[case::across_zero(f32::from_bits(1), -f32::from_bits(1), 2)]
#[case::nan(f32::NAN, 1.0, u64::MAX)]
fn ulp_distance_counts_representable_steps(#[case] a: f32, #[case] b: f32, #[case] want: u64) {
    assert_eq!(ulp_distance(a, b), want);
}

#[test]
fn agreement_reports_rms_ratio_max_abs_and_ulps() {
    let x = HostTensor::from_f32(&[4], vec![1.0, 2.0, 3.0, 4.5]).unwrap();
    let a = agreement(&x, &[1.0, 2.0, 3.0, 4.0]);
    approx::assert_relative_eq!(a.rms_ratio, 0.5 / 30f64.sqrt(), max_relative = 1e-12);
    assert_eq!(a.max_abs, 0.5);
    assert_eq!(a.max_ulp, (0.5 / f32::EPSILON as f64 / 4.0) as u64);
    assert!(a.finite);
    let bad = HostTensor::from_f32(&[2], vec![f32::INFINITY, 0.0]).unwrap();
    assert!(!agreement(&bad, &[0.0, 0.0]).finite);
}

#[rstest]
#[case::output_f32(Quantity::Output, kda_core::DType::F32, 1e-5)]
#[case::final_state_f32(Quantity::of("final_state"), kda_core::DType::F32, 1e-5)]
#[case::dq_f32(Quantity::of("dq"), kda_core::DType::F32, 1e-4)]
#[case::dh0_f32(Quantity::of("dh0"), kda_core::DType::F32, 1e-4)]
#[case::dg_f32(Quantity::of("dg"), kda_core::DType::F32, 1e-3)]
#[case::ddt_bias_f32(Quantity::of("ddt_bias"), kda_core::DType::F32, 1e-3)]
#[case::dq_bf16(Quantity::of("dq"), kda_core::DType::BF16, 2e-2)]
fn tolerance_table_matches_the_spec(#[case] q: Quantity, #[case] d: kda_core::DType, #[case] limit: f64) {
    assert_eq!(rms_limit(q, d), limit);
}
