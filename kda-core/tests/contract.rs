//! One test per contract rule: each violation is a typed error naming the argument.

use kda_core::{Cotangents, DType, ErrorKind, GateMode, HostTensor, KdaConfig, KdaInputs, Layout, Segments};
use rstest::rstest;

const H: usize = 2;
const B: usize = 2;
const T: usize = 6;
const K: usize = 4;
const V: usize = 3;

fn filled(shape: &[usize], x: f64) -> HostTensor {
    let n = shape.iter().product();
    HostTensor::from_f64_as(shape, &vec![x; n], DType::F32).unwrap()
}

/// A valid head-first baseline.
fn base() -> KdaInputs {
    KdaInputs::new(
        filled(&[H, B, T, K], 0.1),
        filled(&[H, B, T, K], 0.2),
        filled(&[H, B, T, V], 0.3),
        filled(&[H, B, T, K], -0.5),
        filled(&[H, B, T], 0.5),
    )
    .with_layout(Layout::HeadFirst)
}

fn set(t: &HostTensor, i: usize, x: f64) -> HostTensor {
    let mut d = t.to_f64_vec();
    d[i] = x;
    HostTensor::from_f64_as(t.shape(), &d, t.dtype()).unwrap()
}

fn a_log() -> HostTensor {
    filled(&[H], 0.0)
}

#[rstest]
#[case::q_rank(|x: &mut KdaInputs| x.q = filled(&[H, B, T], 0.1), ErrorKind::Shape, "q")]
#[case::empty_dimension(|x: &mut KdaInputs| x.q = filled(&[H, B, 0, K], 0.1), ErrorKind::Shape, "q")]
#[case::k_above_256_unsupported(|x: &mut KdaInputs| {
    x.q = filled(&[H, B, T, 257], 0.1);
}, ErrorKind::Unsupported, "K")]
#[case::k_shape(|x: &mut KdaInputs| x.k = filled(&[H, B, T, K + 1], 0.1), ErrorKind::Shape, "k")]
#[case::g_shape(|x: &mut KdaInputs| x.g = filled(&[H, B, T - 1, K], 0.1), ErrorKind::Shape, "g")]
#[case::v_leading_axes(|x: &mut KdaInputs| x.v = filled(&[H, B + 1, T, V], 0.1), ErrorKind::Shape, "v")]
#[case::v_empty(|x: &mut KdaInputs| x.v = filled(&[H, B, T, 0], 0.1), ErrorKind::Shape, "v")]
#[case::beta_shape(|x: &mut KdaInputs| x.beta = filled(&[H, B, T, 2], 0.5), ErrorKind::Shape, "beta")]
#[case::k_dtype(|x: &mut KdaInputs| x.k = x.k.cast(DType::BF16), ErrorKind::DType, "k")]
#[case::v_dtype(|x: &mut KdaInputs| x.v = x.v.cast(DType::F64), ErrorKind::DType, "v")]
#[case::beta_above_one(|x: &mut KdaInputs| x.beta = set(&x.beta, 3, 1.5), ErrorKind::Value, "beta")]
#[case::beta_negative(|x: &mut KdaInputs| x.beta = set(&x.beta, 0, -0.1), ErrorKind::Value, "beta")]
#[case::q_not_finite(|x: &mut KdaInputs| x.q = set(&x.q, 5, f64::NAN), ErrorKind::Value, "q")]
#[case::g_infinite(|x: &mut KdaInputs| x.g = set(&x.g, 1, f64::NEG_INFINITY), ErrorKind::Value, "g")]
#[case::scale_not_finite(|x: &mut KdaInputs| x.config.scale = Some(f64::NAN), ErrorKind::Value, "scale")]
#[case::cu_seqlens_not_starting_at_zero(|x: &mut KdaInputs| {
    x.segments = Some(Segments::CuSeqlens(vec![vec![1, 6], vec![0, 6]]));
}, ErrorKind::Segments, "cu_seqlens")]
#[case::cu_seqlens_decreasing(|x: &mut KdaInputs| {
    x.segments = Some(Segments::CuSeqlens(vec![vec![0, 4, 3], vec![0, 2, 6]]));
}, ErrorKind::Segments, "cu_seqlens")]
#[case::cu_seqlens_past_t(|x: &mut KdaInputs| {
    x.segments = Some(Segments::CuSeqlens(vec![vec![0, 7], vec![0, 6]]));
}, ErrorKind::Segments, "cu_seqlens")]
#[case::cu_seqlens_row_count(|x: &mut KdaInputs| {
    x.segments = Some(Segments::CuSeqlens(vec![vec![0, 6]]));
}, ErrorKind::Segments, "cu_seqlens")]
#[case::cu_seqlens_ragged_n(|x: &mut KdaInputs| {
    x.segments = Some(Segments::CuSeqlens(vec![vec![0, 6], vec![0, 2, 6]]));
}, ErrorKind::Segments, "cu_seqlens")]
#[case::segment_ids_not_contiguous(|x: &mut KdaInputs| {
    x.segments = Some(Segments::SegmentIds(vec![vec![1, 1, 3, 3, 0, 0], vec![1; T]]));
}, ErrorKind::Segments, "segment_ids")]
#[case::segment_ids_out_of_order(|x: &mut KdaInputs| {
    x.segments = Some(Segments::SegmentIds(vec![vec![1, 2, 1, 2, 2, 2], vec![1; T]]));
}, ErrorKind::Segments, "segment_ids")]
#[case::segment_ids_padding_before_a_segment(|x: &mut KdaInputs| {
    x.segments = Some(Segments::SegmentIds(vec![vec![1, 1, 0, 2, 2, 0], vec![1; T]]));
}, ErrorKind::Segments, "segment_ids")]
#[case::segment_ids_shape(|x: &mut KdaInputs| {
    x.segments = Some(Segments::SegmentIds(vec![vec![1; T - 1], vec![1; T]]));
}, ErrorKind::Segments, "segment_ids")]
#[case::initial_state_n_mismatch(|x: &mut KdaInputs| {
    x.segments = Some(Segments::CuSeqlens(vec![vec![0, 2, 6], vec![0, 3, 5]]));
    x.initial_state = Some(filled(&[B, 1, H, K, V], 0.0));
}, ErrorKind::Shape, "initial_state")]
#[case::initial_state_shape(|x: &mut KdaInputs| {
    x.initial_state = Some(filled(&[B, 1, H, V, K], 0.0));
}, ErrorKind::Shape, "initial_state")]
#[case::initial_state_not_finite(|x: &mut KdaInputs| {
    x.initial_state = Some(set(&filled(&[B, 1, H, K, V], 0.0), 2, f64::NAN));
}, ErrorKind::Value, "initial_state")]
#[case::lower_bound_below_minus_five(|x: &mut KdaInputs| {
    x.gate = GateMode::lower_bound(-6.0, a_log(), None);
}, ErrorKind::Value, "lb")]
#[case::lower_bound_zero(|x: &mut KdaInputs| x.gate = GateMode::lower_bound(0.0, a_log(), None), ErrorKind::Value, "lb")]
#[case::softplus_without_a_log(|x: &mut KdaInputs| {
    x.gate = GateMode::Softplus { a_log: None, dt_bias: None };
}, ErrorKind::Missing, "a_log")]
#[case::lower_bound_without_a_log(|x: &mut KdaInputs| {
    x.gate = GateMode::LowerBound { lb: -5.0, a_log: None, dt_bias: None };
}, ErrorKind::Missing, "a_log")]
#[case::a_log_shape(|x: &mut KdaInputs| x.gate = GateMode::softplus(filled(&[H, 1], 0.0), None), ErrorKind::Shape, "a_log")]
#[case::dt_bias_shape(|x: &mut KdaInputs| {
    x.gate = GateMode::softplus(a_log(), Some(filled(&[H, K], 0.0)));
}, ErrorKind::Shape, "dt_bias")]
fn contract_violation_is_a_typed_error(
    #[case] break_it: fn(&mut KdaInputs),
    #[case] kind: ErrorKind,
    #[case] arg: &str,
) {
    let mut x = base();
    break_it(&mut x);
    let err = x.validate().expect_err("the violation must be rejected");
    assert_eq!((err.kind(), err.arg()), (kind, arg), "{err}");
    assert!(!err.to_string().is_empty());
}

#[rstest]
#[case::do_shape(|c: &mut Cotangents| c.d_o = filled(&[H, B, T, V + 1], 0.0), ErrorKind::Shape, "do")]
#[case::do_not_finite(|c: &mut Cotangents| c.d_o = set(&c.d_o, 0, f64::INFINITY), ErrorKind::Value, "do")]
#[case::dht_shape(|c: &mut Cotangents| c.dht = Some(filled(&[B, 2, H, K, V], 0.0)), ErrorKind::Shape, "dht")]
fn cotangent_violation_is_a_typed_error(
    #[case] break_it: fn(&mut Cotangents),
    #[case] kind: ErrorKind,
    #[case] arg: &str,
) {
    let p = base().validate().unwrap();
    let mut c = Cotangents { d_o: filled(&[H, B, T, V], 0.1), dht: None };
    break_it(&mut c);
    let err = c.validate(&p).expect_err("the violation must be rejected");
    assert_eq!((err.kind(), err.arg()), (kind, arg), "{err}");
}

#[rstest]
#[case::beta_trailing_singleton(|x: &mut KdaInputs| x.beta = filled(&[H, B, T, 1], 0.5), 1)]
#[case::beta_edges_zero_and_one(|x: &mut KdaInputs| x.beta = set(&set(&x.beta, 0, 0.0), 1, 1.0), 1)]
#[case::k_equal_256(|x: &mut KdaInputs| {
    x.q = filled(&[H, B, T, 256], 0.1);
    x.k = filled(&[H, B, T, 256], 0.1);
    x.g = filled(&[H, B, T, 256], -0.1);
}, 1)]
#[case::cu_seqlens_with_empty_segment_and_padding(|x: &mut KdaInputs| {
    x.segments = Some(Segments::CuSeqlens(vec![vec![0, 2, 2, 5], vec![0, 1, 4, 6]]));
}, 3)]
#[case::segment_ids_rows_with_fewer_segments(|x: &mut KdaInputs| {
    x.segments = Some(Segments::SegmentIds(vec![vec![1, 1, 2, 2, 3, 0], vec![1, 1, 1, 1, 0, 0]]));
}, 3)]
#[case::in_kernel_gates(|x: &mut KdaInputs| {
    x.gate = GateMode::lower_bound(-5.0, a_log(), Some(filled(&[H * K], 0.0)));
    x.config = KdaConfig { use_qk_l2norm: true, ..x.config };
}, 1)]
fn valid_inputs_are_accepted(#[case] change: fn(&mut KdaInputs), #[case] n: usize) {
    let mut x = base();
    change(&mut x);
    let p = x.validate().unwrap();
    assert_eq!(p.dims.n, n);
}

#[test]
fn segment_ids_become_ranges_with_trailing_empty_slots() {
    let mut x = base();
    x.segments = Some(Segments::SegmentIds(vec![vec![1, 1, 2, 2, 3, 0], vec![1, 1, 1, 1, 0, 0]]));
    let p = x.validate().unwrap();
    assert_eq!(p.segments.row(0), &[0..2, 2..4, 4..5]);
    assert_eq!(p.segments.row(1), &[0..4, 4..4, 4..4]);
    assert_eq!(p.segments.owner(0, 5), None);
    assert_eq!(p.segments.real_tokens(1), 4);
}

#[test]
fn batch_first_layout_reads_heads_from_the_third_axis() {
    let x = KdaInputs::new(
        filled(&[B, T, H, K], 0.1),
        filled(&[B, T, H, K], 0.1),
        filled(&[B, T, H, V], 0.1),
        filled(&[B, T, H, K], -0.1),
        filled(&[B, T, H], 0.5),
    );
    let p = x.validate().unwrap();
    assert_eq!((p.dims.h, p.dims.b, p.dims.t, p.dims.k, p.dims.v), (H, B, T, K, V));
    assert!((p.scale - 0.5).abs() < 1e-15, "default scale is K^-1/2");
}

#[test]
fn permute_moves_axes() {
    let t = HostTensor::from_f64(&[2, 3], vec![0., 1., 2., 3., 4., 5.]).unwrap();
    let p = t.permute(&[1, 0]).unwrap();
    assert_eq!(p.shape(), &[3, 2]);
    assert_eq!(p.to_f64_vec(), vec![0., 3., 1., 4., 2., 5.]);
    assert_eq!(t.permute(&[0, 0]).unwrap_err().kind(), ErrorKind::Shape);
}
