//! Native packed backward input: `do` in, gradients out, in the caller's layout.

mod common;

use common::packed_io::{AlignedGradients, PackedIo};
use common::{random_table, Rng};
use kda_core::{Cotangents, DType, HostTensor, KdaInputs, Layout};
use kda_packed::SegmentPlan;
use rstest::rstest;

fn tensor(rng: &mut Rng, dims: &[usize], dtype: DType) -> HostTensor {
    let vals: Vec<f64> = (0..dims.iter().product()).map(|_| rng.unit() * 0.5 + 0.5).collect();
    HostTensor::from_f64_as(dims, &vals, dtype).expect("tensor")
}

/// Zeroes padding tokens of a packed per-token tensor of width `d` (`d = 1` for scalars).
fn zero_padding(x: &HostTensor, layout: Layout, plan: &SegmentPlan, h: usize, d: usize) -> Vec<f64> {
    let mut v = x.to_f64_vec();
    let dims = kda_core::ProblemDims { h, b: plan.b(), t: plan.t(), k: d, v: d, n: plan.n() };
    for b in 0..plan.b() {
        let end = plan.segments().iter().filter(|s| s.row == b).map(|s| s.start + s.len).max().unwrap_or(0);
        for t in end..plan.t() {
            for hh in 0..h {
                for i in 0..d {
                    v[layout.index(&dims, hh, b, t, d, i)] = 0.0;
                }
            }
        }
    }
    v
}

#[rstest]
#[case::head_first_f32(Layout::HeadFirst, DType::F32, false)]
#[case::batch_first_f32(Layout::BatchFirst, DType::F32, false)]
#[case::batch_first_bf16_beta_trailing_one(Layout::BatchFirst, DType::BF16, true)]
#[case::head_first_bf16_beta_trailing_one(Layout::HeadFirst, DType::BF16, true)]
fn gradients_come_back_in_the_callers_layout(
    #[case] layout: Layout,
    #[case] dtype: DType,
    #[case] trailing_one: bool,
) {
    let mut rng = Rng::new(42);
    for _ in 0..30 {
        let tab = random_table(&mut rng, 16);
        let plan = SegmentPlan::new(&tab, 16).expect("plan");
        let (h, k, v) = (2, 3, 4);
        let tk = layout.token_shape(h, tab.b(), tab.t(), k);
        let tv = layout.token_shape(h, tab.b(), tab.t(), v);
        let mut bdims = layout.scalar_shape(h, tab.b(), tab.t()).to_vec();
        if trailing_one {
            bdims.push(1);
        }
        let inputs = KdaInputs::new(
            tensor(&mut rng, &tk, dtype),
            tensor(&mut rng, &tk, dtype),
            tensor(&mut rng, &tv, dtype),
            tensor(&mut rng, &tk, DType::F32),
            tensor(&mut rng, &bdims, DType::F32),
        )
        .with_layout(layout);
        let io = PackedIo::new(&plan, layout);
        let aligned = io.align_inputs(&inputs).expect("align inputs");
        assert_eq!(aligned.q.shape(), [h, plan.num_chunks(), 16, k]);
        assert_eq!(aligned.v.shape(), [h, plan.num_chunks(), 16, v]);
        assert_eq!(aligned.beta.shape(), [h, plan.num_chunks(), 16]);
        let d_o = io.align_do(&Cotangents { d_o: inputs.v.clone(), dht: None }).expect("do");
        assert_eq!(d_o, aligned.v);

        // Identity "backward": each gradient is its aligned input.
        let grads = AlignedGradients {
            dq: aligned.q,
            dk: aligned.k,
            dv: aligned.v,
            dg: aligned.g,
            dbeta: aligned.beta,
            dh0: None,
            da_log: None,
            ddt_bias: None,
        };
        let out = io.packed_gradients(grads, inputs.beta.shape()).expect("packed gradients");
        for (name, got, want, d) in [
            ("dq", &out.dq, &inputs.q, k),
            ("dk", &out.dk, &inputs.k, k),
            ("dv", &out.dv, &inputs.v, v),
            ("dg", &out.dg, &inputs.g, k),
            ("dbeta", &out.dbeta, &inputs.beta, 1),
        ] {
            assert_eq!(got.shape(), want.shape(), "{name} shape");
            assert_eq!(got.dtype(), want.dtype(), "{name} dtype");
            assert_eq!(got.to_f64_vec(), zero_padding(want, layout, &plan, h, d), "{name}");
        }
    }
}
