//! kda-ref on a packed batch equals kda-ref on each segment alone (outputs, final states and all
//! gradients), with the per-segment problems cut out by this crate's loading and the results put
//! back by its compaction.

mod common;

use common::packed_io::{AlignedGradients, PackedIo};
use common::segment_view::{segment_state, segment_tensor, write_segment, write_segment_state};
use common::{random_table, Rng};
use kda_core::{
    Cotangents, DType, GateMode, HostTensor, KdaConfig, KdaGradients, KdaInputs, KdaOutputs, Layout,
    SegmentTable, Segments,
};
use kda_packed::SegmentPlan;
use rstest::rstest;

const C: usize = 16;
const H: usize = 2;
const K: usize = 3;
const V: usize = 4;

#[derive(Debug, Clone, Copy)]
enum Gate {
    Preactivated,
    Softplus,
    LowerBound,
}

fn tensor(rng: &mut Rng, dims: &[usize], lo: f64, hi: f64, dtype: DType) -> HostTensor {
    let vals: Vec<f64> =
        (0..dims.iter().product()).map(|_| lo + (hi - lo) * (rng.unit() * 0.5 + 0.5)).collect();
    HostTensor::from_f64_as(dims, &vals, dtype).expect("tensor")
}

/// A random packed problem over `tab` with an initial state, final states and `dht`.
fn problem(
    rng: &mut Rng,
    tab: &SegmentTable,
    layout: Layout,
    gate: Gate,
    dtype: DType,
    beta_trailing_one: bool,
) -> (KdaInputs, Cotangents) {
    let (b, t, n) = (tab.b(), tab.t(), tab.n());
    // States (and the gate parameters) in f64 for f64 inputs, as the reference returns them.
    let sdt = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let tk = layout.token_shape(H, b, t, K);
    let tv = layout.token_shape(H, b, t, V);
    let mut bd = layout.scalar_shape(H, b, t).to_vec();
    if beta_trailing_one {
        bd.push(1);
    }
    let state = [b, n, H, K, V];
    let (g, mode) = match gate {
        Gate::Preactivated => (tensor(rng, &tk, -1.0, 0.0, dtype), GateMode::Preactivated),
        Gate::Softplus => (
            tensor(rng, &tk, -2.0, 2.0, dtype),
            GateMode::softplus(
                tensor(rng, &[H], -1.0, 0.5, sdt),
                Some(tensor(rng, &[H * K], -1.0, 1.0, sdt)),
            ),
        ),
        Gate::LowerBound => (
            tensor(rng, &tk, -2.0, 2.0, dtype),
            GateMode::lower_bound(-5.0, tensor(rng, &[H], -1.0, 0.5, sdt), None),
        ),
    };
    let config = KdaConfig {
        layout,
        scale: None,
        use_qk_l2norm: matches!(gate, Gate::Softplus | Gate::LowerBound),
        output_final_state: true,
    };
    let cu: Vec<Vec<i64>> = (0..b).map(|r| tab.cu_seqlens(r).expect("row in range")).collect();
    let inputs = KdaInputs::new(
        tensor(rng, &tk, -1.0, 1.0, dtype),
        tensor(rng, &tk, -1.0, 1.0, dtype),
        tensor(rng, &tv, -1.0, 1.0, dtype),
        g,
        tensor(rng, &bd, 0.0, 1.0, dtype),
    )
    .with_config(config)
    .with_gate(mode)
    .with_initial_state(tensor(rng, &state, -1.0, 1.0, sdt))
    .with_segments(Segments::CuSeqlens(cu));
    let cot = Cotangents {
        d_o: tensor(rng, &tv, -1.0, 1.0, dtype),
        dht: Some(tensor(rng, &state, -1.0, 1.0, sdt)),
    };
    (inputs, cot)
}

fn add_into(acc: &mut Option<Vec<f64>>, x: &Option<HostTensor>) {
    if let Some(x) = x {
        let acc = acc.get_or_insert_with(|| vec![0.0; x.len()]);
        acc.iter_mut().zip(x.to_f64_vec()).for_each(|(a, b)| *a += b);
    }
}

/// Runs kda-ref segment by segment through loading and compaction.
fn per_segment(plan: &SegmentPlan, inputs: &KdaInputs, cot: &Cotangents) -> (KdaOutputs, KdaGradients) {
    let io = PackedIo::new(plan, inputs.config.layout);
    let a = io.align_inputs(inputs).expect("align inputs");
    let d_o = io.align_do(cot).expect("align do");
    let (h0, dht) = (inputs.initial_state.as_ref().expect("h0"), cot.dht.as_ref().expect("dht"));
    let zeros = |like: &HostTensor| HostTensor::zeros(like.shape(), like.dtype());
    let (mut o, mut dq, mut dk, mut dv) = (zeros(&d_o), zeros(&a.q), zeros(&a.k), zeros(&a.v));
    let (mut dg, mut dbeta) = (zeros(&a.g), zeros(&a.beta));
    // An empty segment returns its initial state; its dh0 is its dht.
    let (mut final_state, mut dh0) = (h0.clone(), dht.clone());
    let (mut da_log, mut ddt_bias) = (None, None);
    for s in plan.segments().iter().filter(|s| s.len > 0) {
        let cut = |x: &HostTensor| segment_tensor(plan, x, s.row, s.segment).expect("segment");
        let seg_inputs = KdaInputs::new(cut(&a.q), cut(&a.k), cut(&a.v), cut(&a.g), cut(&a.beta))
            .with_config(KdaConfig { layout: Layout::HeadFirst, ..inputs.config })
            .with_gate(inputs.gate.clone())
            .with_initial_state(segment_state(h0, s.row, s.segment).expect("h0 slot"));
        let seg_cot =
            Cotangents { d_o: cut(&d_o), dht: Some(segment_state(dht, s.row, s.segment).expect("dht slot")) };
        let (out, grads) = kda_ref::forward_and_vjp(&seg_inputs, &seg_cot).expect("segment ref");
        let put = |dst: &mut HostTensor, src: &HostTensor| {
            write_segment(plan, dst, s.row, s.segment, src).expect("write segment")
        };
        put(&mut o, &out.o);
        put(&mut dq, &grads.dq);
        put(&mut dk, &grads.dk);
        put(&mut dv, &grads.dv);
        put(&mut dg, &grads.dg);
        put(&mut dbeta, &grads.dbeta);
        let fs = out.final_state.as_ref().expect("final state");
        write_segment_state(&mut final_state, s.row, s.segment, fs).expect("final slot");
        write_segment_state(&mut dh0, s.row, s.segment, grads.dh0.as_ref().expect("dh0")).expect("dh0 slot");
        add_into(&mut da_log, &grads.da_log);
        add_into(&mut ddt_bias, &grads.ddt_bias);
    }
    let as_like = |sum: Option<Vec<f64>>, like: Option<&HostTensor>| {
        like.map(|l| {
            HostTensor::from_f64_as(l.shape(), &sum.unwrap_or(vec![0.0; l.len()]), l.dtype()).expect("sum")
        })
    };
    let (a_log, dt_bias) = inputs.gate.params().unwrap_or((None, None));
    let aligned = AlignedGradients {
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dh0: Some(dh0),
        da_log: as_like(da_log, a_log),
        ddt_bias: as_like(ddt_bias, dt_bias),
    };
    let grads = io.packed_gradients(aligned, inputs.beta.shape()).expect("packed gradients");
    let out = KdaOutputs { o: io.packed("o", &o).expect("packed o"), final_state: Some(final_state) };
    (out, grads)
}

fn assert_close(name: &str, got: &HostTensor, want: &HostTensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{name} shape");
    assert_eq!(got.dtype(), want.dtype(), "{name} dtype");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let scale = w.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            approx::abs_diff_eq!(a, b, epsilon = tol * scale),
            "{name}[{i}]: per-segment {a} vs packed {b}"
        );
        if *b == 0.0 {
            assert_eq!(*a, 0.0, "{name}[{i}]: exact zero (padding)");
        }
    }
}

#[rstest]
#[case::head_first_preactivated_f64(Layout::HeadFirst, Gate::Preactivated, DType::F64, false, 1e-12)]
#[case::batch_first_softplus_l2norm_f64(Layout::BatchFirst, Gate::Softplus, DType::F64, false, 1e-12)]
#[case::batch_first_lower_bound_beta_trailing_one_f64(
    Layout::BatchFirst,
    Gate::LowerBound,
    DType::F64,
    true,
    1e-12
)]
#[case::head_first_preactivated_f32(Layout::HeadFirst, Gate::Preactivated, DType::F32, false, 1e-6)]
fn ref_on_packed_batch_equals_ref_per_segment(
    #[case] layout: Layout,
    #[case] gate: Gate,
    #[case] dtype: DType,
    #[case] beta_trailing_one: bool,
    #[case] tol: f64,
) {
    let mut rng = Rng::new(2024);
    for _ in 0..25 {
        let tab = random_table(&mut rng, C);
        let plan = SegmentPlan::new(&tab, C).expect("plan");
        let (inputs, cot) = problem(&mut rng, &tab, layout, gate, dtype, beta_trailing_one);
        let (want_out, want) = kda_ref::forward_and_vjp(&inputs, &cot).expect("packed ref");
        let (got_out, got) = per_segment(&plan, &inputs, &cot);
        assert_close("o", &got_out.o, &want_out.o, tol);
        let fs = (got_out.final_state.as_ref(), want_out.final_state.as_ref());
        assert_close("final_state", fs.0.expect("final"), fs.1.expect("final"), tol);
        let want_named = want.named();
        let got_named = got.named();
        assert_eq!(
            got_named.iter().map(|x| x.0).collect::<Vec<_>>(),
            want_named.iter().map(|x| x.0).collect::<Vec<_>>()
        );
        for ((name, g), (_, w)) in got_named.into_iter().zip(want_named) {
            let tol = if matches!(name, "da_log" | "ddt_bias") { tol.max(1e-10) } else { tol };
            assert_close(name, g, w, tol);
        }
    }
}
