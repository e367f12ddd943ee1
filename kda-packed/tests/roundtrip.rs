//! Loading then compaction over generated segmentations: identity on real tokens, exact zeros at
//! padding, and compaction == the gather path (plan-driven, table-driven and static).

mod common;

use common::{random_table, Rng};
use kda_core::{bf16, DType, HostTensor, Layout, SegmentTable};
use kda_packed::{
    compact_gradients, compact_gradients_into, compact_scalar_tensor, compact_tensor, compact_with_tables,
    gather_gradients, gather_scalar_tensor, gather_tensor, load_scalar_tensor, load_segments, load_tensor,
    load_tensor_with_tables, load_with_tables, PackedShape, SegmentPlan, StaticCapacity,
};
use rstest::rstest;
use std::fmt::Debug;

/// Real-token flags for every packed element of `shape`.
fn real_mask(tab: &SegmentTable, shape: PackedShape) -> Vec<bool> {
    let mut mask = vec![false; shape.len()];
    for h in 0..shape.h {
        for b in 0..shape.b {
            for t in 0..tab.real_tokens(b) {
                let at = shape.token_offset(h, b * shape.t + t);
                mask[at..at + shape.d].fill(true);
            }
        }
    }
    mask
}

/// Every property of loading and compaction for one segmentation and one element type.
fn check_roundtrip<T>(tab: &SegmentTable, c: usize, shape: PackedShape, gen: &mut dyn FnMut() -> T)
where
    T: Copy + Default + PartialEq + Debug,
{
    let plan = SegmentPlan::new(tab, c).expect("plan");
    let zero = T::default();
    let packed: Vec<T> = (0..shape.len()).map(|_| gen()).collect();
    let aligned = load_segments(&plan, shape, &packed).expect("load");
    let a = shape.aligned(plan.num_chunks(), c);
    assert_eq!(aligned.len(), a.len());
    for h in 0..shape.h {
        for (ci, ch) in plan.chunks().iter().enumerate() {
            let pad0 = a.slot_offset(h, ci * c + ch.len);
            let end = a.slot_offset(h, (ci + 1) * c);
            assert!(aligned[pad0..end].iter().all(|x| *x == zero), "padding slots are zero");
        }
    }

    // A kernel may leave junk in padding slots: compaction must never read it.
    let mut junk = aligned.clone();
    for h in 0..shape.h {
        for (ci, ch) in plan.chunks().iter().enumerate() {
            for x in &mut junk[a.slot_offset(h, ci * c + ch.len)..a.slot_offset(h, (ci + 1) * c)] {
                *x = gen();
            }
        }
    }
    let mask = real_mask(tab, shape);
    let compacted = compact_gradients(&plan, shape, &junk).expect("compact");
    for (i, (&real, (&got, &want))) in mask.iter().zip(compacted.iter().zip(&packed)).enumerate() {
        if real {
            assert_eq!(got, want, "real token element {i} survives the round trip");
        } else {
            assert_eq!(got, zero, "padding element {i} is exactly 0");
        }
    }
    let mut into: Vec<T> = (0..shape.len()).map(|_| gen()).collect();
    compact_gradients_into(&plan, shape, &junk, &mut into).expect("compact into");
    assert_eq!(into, compacted, "compaction into a dirty buffer zeroes padding");

    let exact = plan.index_tables().expect("tables");
    assert_eq!(gather_gradients(&exact, shape, &junk).expect("gather"), compacted);
    assert_eq!(compact_with_tables(&exact, shape, &junk).expect("table compact"), compacted);
    assert_eq!(load_with_tables(&exact, shape, &packed).expect("table load"), aligned);

    // The static form: same results from a padded capacity.
    let cap = StaticCapacity::new(tab.b(), tab.t(), tab.n() + 1, c).expect("capacity");
    let st = cap.plan(tab).expect("static plan");
    let sa = shape.aligned(cap.chunks(), c);
    let loaded = load_with_tables(st.tables(), shape, &packed).expect("static load");
    for h in 0..shape.h {
        let s0 = sa.slot_offset(h, 0);
        let (e0, e1) = (a.slot_offset(h, 0), a.slot_offset(h, a.slots()));
        assert_eq!(&loaded[s0..s0 + (e1 - e0)], &aligned[e0..e1], "static load = exact load");
        assert!(loaded[s0 + (e1 - e0)..sa.slot_offset(h, sa.slots())].iter().all(|x| *x == zero));
    }
    let mut static_junk: Vec<T> = (0..sa.len()).map(|_| gen()).collect();
    for h in 0..shape.h {
        let (e0, e1) = (a.slot_offset(h, 0), a.slot_offset(h, a.slots()));
        let s0 = sa.slot_offset(h, 0);
        static_junk[s0..s0 + (e1 - e0)].copy_from_slice(&junk[e0..e1]);
    }
    assert_eq!(compact_with_tables(st.tables(), shape, &static_junk).expect("static compact"), compacted);
    assert_eq!(gather_gradients(st.tables(), shape, &static_junk).expect("static gather"), compacted);
}

fn random_shape(rng: &mut Rng, tab: &SegmentTable, layout: Layout) -> PackedShape {
    PackedShape::new(layout, 1 + rng.below(3), tab.b(), tab.t(), 1 + rng.below(5))
}

#[rstest]
fn roundtrip_f32_over_random_segmentations(
    #[values(16, 32, 64)] c: usize,
    #[values(Layout::HeadFirst, Layout::BatchFirst)] layout: Layout,
) {
    let mut rng = Rng::new(7 + c as u64);
    let mut vals = Rng::new(99);
    for _ in 0..120 {
        let tab = random_table(&mut rng, c);
        let shape = random_shape(&mut rng, &tab, layout);
        check_roundtrip(&tab, c, shape, &mut || vals.unit() as f32 + 2.0);
    }
}

#[rstest]
fn roundtrip_bf16_over_random_segmentations(
    #[values(16, 64)] c: usize,
    #[values(Layout::HeadFirst, Layout::BatchFirst)] layout: Layout,
) {
    let mut rng = Rng::new(11 + c as u64);
    let mut vals = Rng::new(5);
    for _ in 0..120 {
        let tab = random_table(&mut rng, c);
        let shape = random_shape(&mut rng, &tab, layout);
        // Compare bit patterns: bit-exact, and -0.0 would not pass for a padding zero.
        check_roundtrip(&tab, c, shape, &mut || bf16::from_f64(vals.unit() + 2.0).to_bits());
    }
}

#[rstest]
#[case::f32(DType::F32)]
#[case::bf16(DType::BF16)]
#[case::f64(DType::F64)]
fn compaction_and_gather_agree_on_tensors(#[case] dtype: DType) {
    let mut rng = Rng::new(1234);
    for layout in [Layout::HeadFirst, Layout::BatchFirst] {
        for _ in 0..40 {
            let tab = random_table(&mut rng, 16);
            let plan = SegmentPlan::new(&tab, 16).expect("plan");
            let (h, d) = (2, 3);
            let dims = layout.token_shape(h, tab.b(), tab.t(), d);
            let vals: Vec<f64> = (0..dims.iter().product()).map(|_| rng.unit()).collect();
            let packed = HostTensor::from_f64_as(&dims, &vals, dtype).expect("tensor");
            let aligned = load_tensor(&plan, layout, &packed).expect("load");
            assert_eq!(aligned.shape(), [h, plan.num_chunks(), 16, d]);
            assert_eq!(aligned.dtype(), dtype);
            let compacted = compact_tensor(&plan, layout, &aligned).expect("compact");
            let tables = plan.index_tables().expect("tables");
            let gathered = gather_tensor(&tables, layout, &aligned).expect("gather");
            assert_eq!(compacted.shape(), packed.shape());
            // Bit-exact in every dtype: stronger than docs/kda.md's 1e-7 absolute for f32.
            assert_eq!(compacted.as_bytes(), gathered.as_bytes(), "bit-exact");
            let via_tables = load_tensor_with_tables(&tables, layout, &packed).expect("table load");
            assert_eq!(via_tables, aligned);
        }
    }
}

#[rstest]
#[case::head_first(Layout::HeadFirst, false)]
#[case::head_first_trailing_one(Layout::HeadFirst, true)]
#[case::batch_first(Layout::BatchFirst, false)]
#[case::batch_first_trailing_one(Layout::BatchFirst, true)]
fn beta_like_scalars_roundtrip(#[case] layout: Layout, #[case] trailing_one: bool) {
    let mut rng = Rng::new(77);
    for _ in 0..40 {
        let tab = random_table(&mut rng, 16);
        let plan = SegmentPlan::new(&tab, 16).expect("plan");
        let mut dims = layout.scalar_shape(3, tab.b(), tab.t()).to_vec();
        if trailing_one {
            dims.push(1);
        }
        let vals = rng.f32s(dims.iter().product());
        let beta = HostTensor::from_f32(&dims, vals.clone()).expect("beta");
        let aligned = load_scalar_tensor(&plan, layout, &beta).expect("load");
        assert_eq!(aligned.shape(), [3, plan.num_chunks(), 16]);
        let back = compact_scalar_tensor(&plan, layout, &aligned, &dims).expect("compact");
        assert_eq!(back.shape(), dims.as_slice(), "the caller's beta shape is kept");
        let tables = plan.index_tables().expect("tables");
        assert_eq!(gather_scalar_tensor(&tables, layout, &aligned, &dims).expect("gather"), back);
        let shape = PackedShape::of_scalars(layout, &dims).expect("shape");
        let mask = real_mask(&tab, shape);
        for ((&real, got), want) in mask.iter().zip(back.to_f32_vec()).zip(vals) {
            assert_eq!(got.to_bits(), if real { want.to_bits() } else { 0 });
        }
    }
}
