//! The exact chunk plan and its static form.

mod common;

use common::{expected_chunks, random_table, table, Rng};
use kda_core::SegmentTable;
use kda_packed::{IndexTables, SegmentPlan, StaticCapacity, SENTINEL};
use rstest::rstest;

/// Checks every plan invariant against the table it came from.
fn check_plan(t: &SegmentTable, plan: &SegmentPlan) {
    let c = plan.chunk_size();
    assert_eq!(plan.num_chunks(), expected_chunks(t, c), "exact chunk count");
    assert_eq!((plan.b(), plan.t(), plan.n()), (t.b(), t.t(), t.n()));
    let mut next_chunk = 0;
    for (b, row) in t.rows().iter().enumerate() {
        for (n, r) in row.iter().enumerate() {
            let s = plan.segment(b, n).expect("segment in range");
            assert_eq!((s.row, s.segment, s.start, s.len), (b, n, r.start, r.len()));
            assert_eq!(s.packed_offset, b * t.t() + r.start);
            assert_eq!(s.chunk_offset, next_chunk, "segments start new chunks in order");
            assert_eq!(s.chunks, r.len().div_ceil(c));
            for local in 0..s.chunks {
                let ch = plan.chunks()[s.chunk_offset + local];
                assert_eq!((ch.row, ch.segment, ch.local), (b, n, local));
                assert_eq!(ch.first, local == 0);
                assert_eq!(ch.last, local + 1 == s.chunks);
                assert_eq!(ch.start, r.start + local * c);
                let want_len = if ch.last { r.len() - local * c } else { c };
                assert_eq!(ch.len, want_len, "tail chunk length");
                assert!(ch.len >= 1 && ch.len <= c);
            }
            next_chunk += s.chunks;
        }
    }
    assert_eq!(next_chunk, plan.num_chunks());
    assert_eq!(plan.real_tokens(), (0..t.b()).map(|b| t.real_tokens(b)).sum::<usize>());
}

#[rstest]
#[case::empty_segment_only(4, vec![vec![0]], 0)]
#[case::one_token(1, vec![vec![1]], 1)]
#[case::c_minus_one(15, vec![vec![15]], 1)]
#[case::exactly_c(16, vec![vec![16]], 1)]
#[case::c_plus_one(17, vec![vec![17]], 2)]
#[case::edge_lengths_in_one_row(33 + 16 + 15 + 1, vec![vec![0, 1, 15, 16, 17, 0]], 5)]
#[case::trailing_padding(40, vec![vec![5, 6]], 2)]
#[case::one_segment_fills_row(48, vec![vec![48]], 3)]
#[case::many_one_token_segments(20, vec![vec![1; 20]], 20)]
#[case::rows_with_different_segmentations(40, vec![vec![40, 0], vec![1, 17], vec![0, 0]], 6)]
fn plan_chunk_count_is_exact(#[case] t: usize, #[case] rows: Vec<Vec<usize>>, #[case] chunks: usize) {
    let tab = table(t, &rows);
    let plan = SegmentPlan::new(&tab, 16).expect("plan");
    assert_eq!(plan.num_chunks(), chunks);
    check_plan(&tab, &plan);
}

#[rstest]
#[case::c16(16)]
#[case::c32(32)]
#[case::c64(64)]
fn plan_invariants_hold_for_random_segmentations(#[case] c: usize) {
    let mut rng = Rng::new(0x5eed + c as u64);
    for _ in 0..300 {
        let tab = random_table(&mut rng, c);
        check_plan(&tab, &SegmentPlan::new(&tab, c).expect("plan"));
    }
}

#[test]
fn fixed_length_plan_is_one_segment_per_row() {
    let plan = SegmentPlan::fixed(3, 130, 64).expect("plan");
    assert_eq!(plan.num_chunks(), 9);
    assert_eq!(plan.chunks()[2].len, 2);
    assert!(plan.chunks()[2].last && plan.chunks()[3].first);
}

/// The static tables decode to the exact plan's chunks, then only unused chunks follow.
fn check_static_reproduces_exact(tables: &IndexTables, plan: &SegmentPlan, capacity: usize) {
    let c = plan.chunk_size();
    assert_eq!(tables.capacity, capacity);
    assert_eq!(tables.slot_token.len(), capacity * c);
    assert_eq!(tables.token_slot.len(), plan.b() * plan.t());
    for (i, ch) in plan.chunks().iter().enumerate() {
        assert_eq!(tables.chunk_info(i), Some(*ch), "chunk {i}");
    }
    for i in plan.num_chunks()..capacity {
        assert_eq!(tables.chunk_info(i), None);
        assert_eq!(tables.chunk_len[i], 0);
        assert_eq!(tables.chunk_segment[i], SENTINEL);
    }
    for s in plan.segments() {
        let si = s.row * tables.n_slots + s.segment;
        let (first, last) = (tables.segment_first_chunk[si], tables.segment_last_chunk[si]);
        if s.chunks == 0 {
            assert_eq!((first, last), (SENTINEL, SENTINEL), "empty segment");
        } else {
            assert_eq!(first as usize, s.chunk_offset);
            assert_eq!(last as usize, s.chunk_offset + s.chunks - 1);
        }
        for (i, tok) in s.tokens().enumerate() {
            let slot = s.chunk_offset * c + i;
            assert_eq!(tables.slot_of_token(s.row, tok), Some(slot));
            assert_eq!(tables.token_of_slot(slot), Some((s.row, tok)));
        }
    }
    let real = tables.token_slot.iter().filter(|&&x| x != SENTINEL).count();
    assert_eq!(real, plan.real_tokens(), "padding tokens map to the sentinel");
    assert_eq!(tables.slot_token.iter().filter(|&&x| x != SENTINEL).count(), real);
}

#[rstest]
#[case::c16(16)]
#[case::c32(32)]
#[case::c64(64)]
fn static_tables_reproduce_exact_plan(#[case] c: usize) {
    let mut rng = Rng::new(0xabc + c as u64);
    for _ in 0..300 {
        let tab = random_table(&mut rng, c);
        let cap = StaticCapacity::new(tab.b(), tab.t(), tab.n() + rng.below(3), c).expect("capacity");
        let st = cap.plan(&tab).expect("static plan");
        assert!(st.exact().num_chunks() <= cap.chunks(), "capacity is sufficient");
        check_static_reproduces_exact(st.tables(), st.exact(), cap.chunks());
        let exact = st.exact().index_tables().expect("exact tables");
        check_static_reproduces_exact(&exact, st.exact(), st.exact().num_chunks());
    }
}

#[rstest]
#[case::one_segment(100, 1, 16)]
#[case::few_segments(100, 4, 16)]
#[case::more_segments_than_tokens(5, 9, 16)]
#[case::c64_benchmark_shape(1024, 4, 64)]
fn static_capacity_is_reached_by_the_worst_case(#[case] t: usize, #[case] n: usize, #[case] c: usize) {
    let cap = StaticCapacity::new(2, t, n, c).expect("capacity");
    let k = n.min(t);
    let mut worst = vec![1; k - 1];
    worst.push(t - (k - 1));
    worst.resize(n, 0);
    let tab = table(t, &[worst.clone(), worst]);
    let st = cap.plan(&tab).expect("static plan");
    assert_eq!(st.exact().num_chunks(), cap.chunks(), "the bound is tight");
    assert_eq!(cap.row_chunks(), k + (t - k) / c);
    assert!(cap.chunks() * c <= 2 * (t + n * (c - 1)), "never above tokamax's worst case");
}

#[test]
fn one_capacity_serves_every_segmentation() {
    let cap = StaticCapacity::new(2, 70, 3, 16).expect("capacity");
    let shapes: Vec<_> = [vec![vec![70, 0, 0], vec![1, 1, 1]], vec![vec![16, 17, 0], vec![0, 0, 0]]]
        .iter()
        .map(|rows| {
            let t = cap.plan(&table(70, rows)).expect("static plan");
            let tb = t.tables();
            (tb.slot_token.len(), tb.token_slot.len(), tb.chunk_len.len(), tb.segment_first_chunk.len())
        })
        .collect();
    assert_eq!(shapes[0], shapes[1]);
}
