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
#[case::k_dtype(|x: &mut KdaInputs| x.k = x.k.cast(DType::BF16).expect("float cast"), ErrorKind::DType, "k")]
#[case::v_dtype(|x: &mut KdaInputs| x.v = x.v.cast(DType::F64).expect("float cast"), ErrorKind::DType, "v")]
#[case::beta_above_one(|x: &mut KdaInputs| x.beta = set(&x.beta, 3, 1.5), ErrorKind::Value, "beta")]
#[case::beta_negative(|x: &mut KdaInputs| x.beta = set(&x.beta, 0, -0.1), ErrorKind::Value, "beta")]
#[case::q_not_finite(|x: &mut KdaInputs| x.q = set(&x.q, 5, f64::NAN), ErrorKind::Value, "q")]
#[case::g_infinite(|x: &mut KdaInputs| x.g = set(&x.g, 1, f64::NEG_INFINITY), ErrorKind::Value, "g")]
#[case::g_positive_preactivated(|x: &mut KdaInputs| x.g = set(&x.g, 7, 0.5), ErrorKind::Value, "g")]
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
#[case::g_zero_everywhere(|x: &mut KdaInputs| x.g = set(&filled(&[H, B, T, K], 0.0), 3, -0.0), 1)]
#[case::positive_raw_input_of_an_in_kernel_gate(|x: &mut KdaInputs| {
    x.g = filled(&[H, B, T, K], 2.0);
    x.gate = GateMode::softplus(a_log(), None);
}, 1)]
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

/// A positive pre-activated log-decay at one token of a packed row is refused in every host
/// dtype, naming the first offending flat index and its value; a non-finite value before it is
/// named as non-finite.
#[rstest]
#[case::f32(DType::F32)]
#[case::bf16(DType::BF16)]
#[case::f64(DType::F64)]
fn positive_log_decay_in_a_packed_row_names_its_index(#[case] dtype: DType) {
    let mut x = base().with_segments(Segments::CuSeqlens(vec![vec![0, 2, 6], vec![0, 3, 5]]));
    let cast = |t: &HostTensor| t.cast(dtype).expect("float cast");
    (x.q, x.k, x.v, x.beta) = (cast(&x.q), cast(&x.k), cast(&x.v), cast(&x.beta));
    // Head 1, row 1, token 4 (inside the second segment), channel 2; and later a second one.
    let at = ((B + 1) * T + 4) * K + 2;
    x.g = cast(&set(&set(&x.g, at, 0.25), at + K, 3.0));
    let err = x.validate().expect_err("a growing gate must be rejected");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Value, "g"), "{err}");
    assert_eq!(err.got(), format!("0.25 at flat index {at}"), "{err}");
    assert!(err.expected().contains("<= 0"), "{err}");
    x.g = cast(&set(&x.g, at - 1, f64::NAN));
    let err = x.validate().expect_err("NaN must be rejected");
    assert_eq!(
        (err.expected(), err.got()),
        ("finite values", format!("NaN at flat index {}", at - 1).as_str())
    );
}

#[test]
fn segment_ids_become_ranges_with_trailing_empty_slots() {
    let mut x = base();
    x.segments = Some(Segments::SegmentIds(vec![vec![1, 1, 2, 2, 3, 0], vec![1, 1, 1, 1, 0, 0]]));
    let p = x.validate().unwrap();
    assert_eq!(p.segments.row(0).unwrap(), &[0..2, 2..4, 4..5]);
    assert_eq!(p.segments.row(1).unwrap(), &[0..4, 4..4, 4..4]);
    assert_eq!(p.segments.owner(0, 5).unwrap(), None);
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
    approx::assert_relative_eq!(p.scale, 0.5, max_relative = 1e-15); // the default scale is K^-1/2
}

#[test]
fn permute_moves_axes() {
    let t = HostTensor::from_f64(&[2, 3], vec![0., 1., 2., 3., 4., 5.]).unwrap();
    let p = t.permute(&[1, 0]).unwrap();
    assert_eq!(p.shape(), &[3, 2]);
    assert_eq!(p.to_f64_vec(), vec![0., 3., 1., 4., 2., 5.]);
    assert_eq!(t.permute(&[0, 0]).unwrap_err().kind(), ErrorKind::Shape);
}

#[rstest]
#[case::segment_row_past_b(|s: &kda_core::SegmentTable| s.segment(B, 0).map(drop), "segment")]
#[case::segment_slot_past_n(|s: &kda_core::SegmentTable| s.segment(0, 3).map(drop), "segment")]
#[case::row_past_b(|s: &kda_core::SegmentTable| s.row(B).map(drop), "segment row")]
#[case::owner_row_past_b(|s: &kda_core::SegmentTable| s.owner(B, 0).map(drop), "segment row")]
#[case::cu_seqlens_row_past_b(|s: &kda_core::SegmentTable| s.cu_seqlens(B).map(drop), "segment row")]
fn segment_table_accessor_out_of_range_is_a_shape_error(
    #[case] access: fn(&kda_core::SegmentTable) -> kda_core::Result<()>,
    #[case] arg: &str,
) {
    let mut x = base();
    x.segments = Some(Segments::CuSeqlens(vec![vec![0, 2, 4, 5], vec![0, 4, 4, 4]]));
    let p = x.validate().unwrap();
    let err = access(&p.segments).unwrap_err();
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, arg));
}

#[test]
fn segment_table_real_tokens_of_a_missing_row_is_zero() {
    let p = base().validate().unwrap();
    assert_eq!(p.segments.real_tokens(B - 1), T);
    assert_eq!(p.segments.real_tokens(B), 0);
    assert_eq!(p.segments.segment(B - 1, 0).unwrap(), 0..T);
    assert_eq!(p.segments.cu_seqlens(0).unwrap(), vec![0, T as i64]);
}

/// `HALF * HALF` is `2^usize::BITS`: a plain product wraps to 0 in release builds.
const HALF: usize = 1 << (usize::BITS / 2);

#[rstest]
#[case::new_product_wraps_to_zero(|| HostTensor::from_f64(&[HALF, HALF, 1, 1], vec![]).map(drop))]
#[case::new_product_overflows(|| HostTensor::from_f32(&[usize::MAX, 2], vec![]).map(drop))]
#[case::try_zeros_product_overflows(|| HostTensor::try_zeros(&[HALF, HALF, 1, 1], DType::F32).map(drop))]
#[case::try_zeros_beyond_one_allocation(|| HostTensor::try_zeros(&[usize::MAX / 4], DType::F64).map(drop))]
#[case::reshape_product_overflows(|| filled(&[2, 3], 0.0).reshape(&[HALF, HALF, 6]).map(drop))]
fn huge_tensor_shape_is_unsupported_not_an_overflow(#[case] make: fn() -> kda_core::Result<()>) {
    let err = make().unwrap_err();
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Unsupported, "tensor shape"));
}

#[test]
fn zeros_len_is_the_element_count() {
    let z = HostTensor::try_zeros(&[2, 3, 4], DType::BF16).unwrap();
    assert_eq!((z.len(), z.shape()), (24, &[2, 3, 4][..]));
    assert_eq!(HostTensor::zeros(&[0, 5], DType::F32).len(), 0);
}

#[rstest]
#[case::head_first_rank_3(Layout::HeadFirst, &[2, 3, 4], Some((2, 3, 4)))]
#[case::head_first_rank_4(Layout::HeadFirst, &[2, 3, 4, 5], Some((2, 3, 4)))]
#[case::batch_first_rank_3(Layout::BatchFirst, &[3, 4, 2], Some((2, 3, 4)))]
#[case::batch_first_rank_4(Layout::BatchFirst, &[3, 4, 2, 5], Some((2, 3, 4)))]
#[case::rank_2(Layout::HeadFirst, &[2, 3], None)]
#[case::rank_0(Layout::BatchFirst, &[], None)]
#[case::rank_5(Layout::HeadFirst, &[1, 2, 3, 4, 5], None)]
fn layout_hbt_checks_the_rank(
    #[case] layout: Layout,
    #[case] dims: &[usize],
    #[case] want: Option<(usize, usize, usize)>,
) {
    match want {
        Some(hbt) => assert_eq!(layout.try_hbt(dims).unwrap(), hbt),
        None => assert_eq!(layout.try_hbt(dims).unwrap_err().kind(), ErrorKind::Shape),
    }
    assert_eq!(layout.hbt(dims), want.unwrap_or((0, 0, 0)), "hbt never panics");
}

#[test]
fn with_config_replaces_the_layout_too() {
    let x = base().with_config(KdaConfig::default());
    assert_eq!(x.config.layout, Layout::BatchFirst, "with_config overwrites an earlier with_layout");
}

#[test]
fn elements_mut_edits_in_place_and_keeps_the_shape() {
    let mut t = kda_core::HostTensor::from_f32(&[2, 3], vec![0.0; 6]).expect("tensor");
    if let kda_core::ElementsMut::F32(x) = t.elements_mut() {
        x[4] = 2.5;
    }
    assert_eq!(t.to_f32_vec(), vec![0.0, 0.0, 0.0, 0.0, 2.5, 0.0]);
    assert_eq!(t.shape(), [2, 3]);
    assert!(matches!(t.elements_mut(), kda_core::ElementsMut::F32(x) if x.len() == 6));
}
