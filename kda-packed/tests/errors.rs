//! Invalid segmentations and mismatched tensors come back as kda-core's typed errors, never a
//! panic: one case per rule, asserting the kind and the argument named.

mod common;

use common::table;
use kda_core::{ErrorKind, HostTensor, Layout, SegmentTable, Segments};
use kda_packed::{
    compact_scalar_tensor, compact_tensor, load_segments, load_tensor, PackedShape, SegmentPlan,
    StaticCapacity,
};
use rstest::rstest;

fn cu(rows: &[&[i64]]) -> Segments {
    Segments::CuSeqlens(rows.iter().map(|r| r.to_vec()).collect())
}

fn ids(rows: &[&[i64]]) -> Segments {
    Segments::SegmentIds(rows.iter().map(|r| r.to_vec()).collect())
}

#[rstest]
#[case::cu_seqlens_wrong_row_count(cu(&[&[0, 4]]), 2, 8, "cu_seqlens")]
#[case::cu_seqlens_fewer_than_two_entries(cu(&[&[0]]), 1, 8, "cu_seqlens")]
#[case::cu_seqlens_ragged_rows(cu(&[&[0, 4], &[0, 2, 4]]), 2, 8, "cu_seqlens")]
#[case::cu_seqlens_first_entry_not_zero(cu(&[&[1, 4]]), 1, 8, "cu_seqlens")]
#[case::cu_seqlens_decreasing(cu(&[&[0, 5, 3]]), 1, 8, "cu_seqlens")]
#[case::cu_seqlens_beyond_t(cu(&[&[0, 9]]), 1, 8, "cu_seqlens")]
#[case::cu_seqlens_negative(cu(&[&[0, -1]]), 1, 8, "cu_seqlens")]
#[case::segment_ids_wrong_row_count(ids(&[&[1, 1]]), 2, 2, "segment_ids")]
#[case::segment_ids_wrong_row_length(ids(&[&[1, 1, 0]]), 1, 2, "segment_ids")]
#[case::segment_ids_negative(ids(&[&[1, -1]]), 1, 2, "segment_ids")]
#[case::segment_ids_id_after_padding(ids(&[&[1, 0, 2]]), 1, 3, "segment_ids")]
#[case::segment_ids_skipped_id(ids(&[&[1, 3]]), 1, 2, "segment_ids")]
#[case::segment_ids_out_of_order(ids(&[&[1, 2, 1]]), 1, 3, "segment_ids")]
#[case::segment_ids_not_starting_at_one(ids(&[&[2, 2]]), 1, 2, "segment_ids")]
#[case::segment_ids_only_padding(ids(&[&[0, 0]]), 1, 2, "segment_ids")]
fn invalid_segmentation_is_rejected(
    #[case] segments: Segments,
    #[case] b: usize,
    #[case] t: usize,
    #[case] arg: &str,
) {
    let err = SegmentPlan::from_segments(&segments, b, t, 16).expect_err("must be rejected");
    assert_eq!(err.kind(), ErrorKind::Segments, "{err}");
    assert_eq!(err.arg(), arg);
}

#[test]
fn non_adjacent_ranges_are_rejected() {
    let err = SegmentTable::from_ranges(8, vec![vec![0..2, 3..5]]).expect_err("gap");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Segments, "ranges"));
}

#[test]
fn valid_segment_ids_plan_like_cu_seqlens() {
    let a = SegmentPlan::from_segments(&ids(&[&[1, 1, 2, 0], &[1, 0, 0, 0]]), 2, 4, 16).expect("ids");
    let b = SegmentPlan::from_segments(&cu(&[&[0, 2, 3], &[0, 1, 1]]), 2, 4, 16).expect("cu");
    assert_eq!(a, b);
}

#[rstest]
#[case::zero(0)]
#[case::not_a_power_of_two(48)]
#[case::too_large(128)]
#[case::too_small(8)]
fn unsupported_chunk_size_is_rejected(#[case] c: usize) {
    let err = SegmentPlan::fixed(1, 4, c).expect_err("unsupported");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Unsupported, "chunk_size"));
    assert!(err.expected().contains("64"), "the error names the limit: {err}");
    let err = StaticCapacity::new(1, 4, 1, c).expect_err("unsupported");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Unsupported, "chunk_size"));
}

#[test]
fn static_capacity_needs_a_segment_slot() {
    let err = StaticCapacity::new(1, 4, 0, 16).expect_err("no slots");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Value, "max_segments"));
}

#[test]
fn static_capacity_beyond_i32_is_unsupported() {
    let err = StaticCapacity::new(1 << 20, 1 << 20, 1, 64).expect_err("too large");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Unsupported, "capacity"));
}

#[test]
fn more_segments_than_the_capacity_are_unsupported() {
    let cap = StaticCapacity::new(1, 8, 1, 16).expect("capacity");
    let err = cap.plan(&table(8, &[vec![4, 4]])).expect_err("too many");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Unsupported, "segments"));
}

#[test]
fn segments_of_another_shape_than_the_capacity_are_rejected() {
    let cap = StaticCapacity::new(1, 8, 2, 16).expect("capacity");
    let err = cap.plan(&table(9, &[vec![4, 4]])).expect_err("wrong T");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "segments"));
}

#[test]
fn segment_slot_out_of_range_is_a_shape_error() {
    let plan = SegmentPlan::fixed(1, 4, 16).expect("plan");
    let err = plan.segment(1, 0).expect_err("row 1 of 1");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "segment"));
}

#[test]
fn packed_tensor_of_another_t_is_rejected() {
    let plan = SegmentPlan::fixed(1, 4, 16).expect("plan");
    let x = HostTensor::zeros(&[1, 5, 2, 3], kda_core::DType::F32);
    let err = load_tensor(&plan, Layout::BatchFirst, &x).expect_err("T = 5 vs 4");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "packed"));
}

#[test]
fn packed_tensor_of_wrong_rank_is_rejected() {
    let plan = SegmentPlan::fixed(1, 4, 16).expect("plan");
    let x = HostTensor::zeros(&[1, 4, 2], kda_core::DType::F32);
    let err = load_tensor(&plan, Layout::HeadFirst, &x).expect_err("rank 3");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "packed"));
}

#[test]
fn packed_slice_of_wrong_length_is_rejected() {
    let plan = SegmentPlan::fixed(1, 4, 16).expect("plan");
    let shape = PackedShape::new(Layout::HeadFirst, 2, 1, 4, 3);
    let err = load_segments(&plan, shape, &[0.0f32; 23]).expect_err("23 of 24");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "packed"));
}

#[test]
fn aligned_tensor_with_another_chunk_count_is_rejected() {
    let plan = SegmentPlan::fixed(1, 40, 16).expect("plan");
    let x = HostTensor::zeros(&[1, 2, 16, 3], kda_core::DType::F32);
    let err = compact_tensor(&plan, Layout::HeadFirst, &x).expect_err("NT = 2 vs 3");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "aligned"));
}

#[test]
fn scalar_target_shape_must_match_the_plan() {
    let plan = SegmentPlan::fixed(1, 4, 16).expect("plan");
    let x = HostTensor::zeros(&[2, 1, 16], kda_core::DType::F32);
    let err = compact_scalar_tensor(&plan, Layout::HeadFirst, &x, &[2, 1, 5]).expect_err("T = 5");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "like"));
}

#[test]
fn edited_index_tables_are_rejected_not_followed() {
    let plan = SegmentPlan::fixed(1, 4, 16).expect("plan");
    let shape = PackedShape::new(Layout::HeadFirst, 1, 1, 4, 2);
    let mut tables = plan.index_tables().expect("tables");
    tables.slot_token[0] = 4;
    let err = kda_packed::load_with_tables(&tables, shape, &[0.0f32; 8]).expect_err("token 4 of 4");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Value, "slot_token"));
    tables = plan.index_tables().expect("tables");
    tables.token_slot.pop();
    let err = kda_packed::gather_gradients(&tables, shape, &[0.0f32; 32]).expect_err("short table");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "token_slot"));
}

#[rstest]
#[case::capacity_times_c(|t: &mut kda_packed::IndexTables| t.capacity = usize::MAX, "aligned slots")]
#[case::capacity_past_i32(|t: &mut kda_packed::IndexTables| t.capacity = 1 << 28, "aligned slots")]
#[case::b_times_t(|t: &mut kda_packed::IndexTables| t.t = usize::MAX, "packed tokens")]
#[case::b_times_n_slots(|t: &mut kda_packed::IndexTables| {
    t.b = 2;
    t.n_slots = usize::MAX;
}, "segment slots")]
fn edited_index_table_sizes_that_overflow_are_unsupported(
    #[case] edit: fn(&mut kda_packed::IndexTables),
    #[case] arg: &str,
) {
    let plan = SegmentPlan::fixed(1, 4, 16).expect("plan");
    let mut tables = plan.index_tables().expect("tables");
    edit(&mut tables);
    let err = tables.check().expect_err("sizes beyond i32 indices");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Unsupported, arg));
    let shape = PackedShape::new(Layout::HeadFirst, 1, 1, 4, 2);
    let err = kda_packed::load_with_tables(&tables, shape, &[0.0f32; 8]).expect_err("loader checks first");
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Unsupported, arg));
}
