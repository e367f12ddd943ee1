//! Packed semantics of the reference: a packed run equals per-segment runs, and handing the
//! final state over between two halves equals the unsplit run.

mod common;

use common::Small;
use kda_core::{Cotangents, HostTensor, KdaGradients, KdaInputs, KdaOutputs};
use rstest::rstest;

/// Head-first `[H,B,T,D]` slice of tokens `range` of row `b`, as `[H,1,L,D]`.
fn slice_tokens(t: &HostTensor, b: usize, range: std::ops::Range<usize>) -> HostTensor {
    let s = t.shape();
    let (hh, bb, tt) = (s[0], s[1], s[2]);
    let d: usize = s[3..].iter().product();
    let x = t.to_f64_vec();
    let mut out = Vec::new();
    for h in 0..hh {
        for tok in range.clone() {
            let base = ((h * bb + b) * tt + tok) * d;
            out.extend_from_slice(&x[base..base + d]);
        }
    }
    let mut shape = vec![hh, 1, range.len()];
    shape.extend_from_slice(&s[3..]);
    HostTensor::from_f64(&shape, out).unwrap()
}

/// State slot `(b, n)` of `[B,N,H,K,V]` as `[1,1,H,K,V]`.
fn slice_state(t: &HostTensor, b: usize, n: usize) -> HostTensor {
    let s = t.shape();
    let per = s[2] * s[3] * s[4];
    let x = t.to_f64_vec();
    let base = (b * s[1] + n) * per;
    HostTensor::from_f64(&[1, 1, s[2], s[3], s[4]], x[base..base + per].to_vec()).unwrap()
}

fn sub_problem(
    inputs: &KdaInputs,
    cot: &Cotangents,
    b: usize,
    n: usize,
    r: std::ops::Range<usize>,
) -> (KdaInputs, Cotangents) {
    let mut x = inputs.clone();
    x.segments = None;
    x.q = slice_tokens(&inputs.q, b, r.clone());
    x.k = slice_tokens(&inputs.k, b, r.clone());
    x.v = slice_tokens(&inputs.v, b, r.clone());
    x.g = slice_tokens(&inputs.g, b, r.clone());
    x.beta = slice_tokens(&inputs.beta, b, r.clone());
    x.initial_state = inputs.initial_state.as_ref().map(|t| slice_state(t, b, n));
    let c = Cotangents {
        d_o: slice_tokens(&cot.d_o, b, r.clone()),
        dht: cot.dht.as_ref().map(|t| slice_state(t, b, n)),
    };
    (x, c)
}

fn assert_close(what: &str, a: &HostTensor, b: &HostTensor) {
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    assert_eq!(x.len(), y.len(), "{what}: length");
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        assert!(approx::relative_eq!(p, q, epsilon = 1e-12, max_relative = 1e-12), "{what}[{i}]: {p} vs {q}");
    }
}

fn run(inputs: &KdaInputs, cot: &Cotangents) -> (KdaOutputs, KdaGradients) {
    kda_ref::forward_and_vjp(inputs, cot).unwrap()
}

#[rstest]
#[case::two_rows_with_empty_segment_and_padding(vec![vec![0, 3, 3, 6], vec![0, 1, 5, 8]], 8)]
#[case::one_token_segments(vec![vec![0, 1, 2, 3, 4]], 5)]
#[case::segments_across_checkpoints(vec![vec![0, 63, 64, 129, 129, 140]], 150)]
fn packed_run_equals_per_segment_runs(#[case] cu: Vec<Vec<i64>>, #[case] t: usize) {
    let case = Small { cu: Some(cu.clone()), ..Small::new(2, cu.len(), t, 3, 2) };
    let (inputs, cot) = case.build();
    let (out, grads) = run(&inputs, &cot);
    let p = inputs.validate().unwrap();
    let fs = out.final_state.as_ref().unwrap();
    for b in 0..p.dims.b {
        for n in 0..p.dims.n {
            let r = p.segments.segment(b, n).unwrap();
            let at = format!("row {b} segment {n}");
            if r.is_empty() {
                // An empty segment returns its initial state; its dh0 is its dht.
                let h0 = slice_state(inputs.initial_state.as_ref().unwrap(), b, n);
                assert_close(&format!("empty segment final state {at}"), &slice_state(fs, b, n), &h0);
                let dht = slice_state(cot.dht.as_ref().unwrap(), b, n);
                assert_close(
                    &format!("empty segment dh0 {at}"),
                    &slice_state(grads.dh0.as_ref().unwrap(), b, n),
                    &dht,
                );
                continue;
            }
            let (xi, ci) = sub_problem(&inputs, &cot, b, n, r.clone());
            let (o1, g1) = run(&xi, &ci);
            assert_close(
                &format!("final state {at}"),
                &slice_state(fs, b, n),
                o1.final_state.as_ref().unwrap(),
            );
            assert_close(
                &format!("dh0 {at}"),
                &slice_state(grads.dh0.as_ref().unwrap(), b, n),
                g1.dh0.as_ref().unwrap(),
            );
            assert_close(&format!("o {at}"), &slice_tokens(&out.o, b, r.clone()), &o1.o);
            for ((name, whole), (_, part)) in grads.named().into_iter().zip(g1.named()) {
                if name != "dh0" {
                    assert_close(&format!("{name} {at}"), &slice_tokens(whole, b, r.clone()), part);
                }
            }
        }
        let pad = p.segments.real_tokens(b)..t;
        if !pad.is_empty() {
            assert!(
                slice_tokens(&out.o, b, pad.clone()).to_f64_vec().iter().all(|&x| x == 0.0),
                "o at padding"
            );
            for (name, g) in grads.named() {
                if name != "dh0" {
                    let z = slice_tokens(g, b, pad.clone()).to_f64_vec();
                    assert!(z.iter().all(|&x| x == 0.0), "{name} at padding of row {b} is not exactly 0");
                }
            }
        }
    }
}

#[rstest]
#[case::split_inside_first_chunk(9, 4)]
#[case::split_after_a_checkpoint(100, 70)]
fn handing_the_final_state_over_equals_the_unsplit_run(#[case] t: usize, #[case] cut: usize) {
    let (inputs, cot) = Small::new(2, 1, t, 3, 4).build();
    let (out, grads) = run(&inputs, &cot);
    let (second_in, second_cot) = {
        let (mut x, c) = sub_problem(&inputs, &cot, 0, 0, cut..t);
        let (first_in, _) = sub_problem(&inputs, &cot, 0, 0, 0..cut);
        x.initial_state = kda_ref::forward(&first_in).unwrap().final_state;
        (x, c)
    };
    let (o2, g2) = run(&second_in, &second_cot);
    let (mut first_in, mut first_cot) = sub_problem(&inputs, &cot, 0, 0, 0..cut);
    first_in.initial_state = inputs.initial_state.clone();
    first_cot.dht = g2.dh0.clone();
    let (o1, g1) = run(&first_in, &first_cot);
    assert_close("o, first half", &slice_tokens(&out.o, 0, 0..cut), &o1.o);
    assert_close("o, second half", &slice_tokens(&out.o, 0, cut..t), &o2.o);
    assert_close("final state", out.final_state.as_ref().unwrap(), o2.final_state.as_ref().unwrap());
    assert_close("dh0", grads.dh0.as_ref().unwrap(), g1.dh0.as_ref().unwrap());
    for (((name, whole), (_, a)), (_, b)) in grads.named().into_iter().zip(g1.named()).zip(g2.named()) {
        if name != "dh0" {
            assert_close(&format!("{name}, first half"), &slice_tokens(whole, 0, 0..cut), a);
            assert_close(&format!("{name}, second half"), &slice_tokens(whole, 0, cut..t), b);
        }
    }
}

#[test]
fn hard_reset_gate_gives_finite_results_that_forget_the_past() {
    let (mut inputs, cot) = Small::new(1, 1, 6, 3, 2).build();
    let mut g = inputs.g.to_f64_vec();
    g[3 * 3..4 * 3].fill(-1000.0);
    inputs.g = HostTensor::from_f64(inputs.g.shape(), g).unwrap();
    let (out, grads) = run(&inputs, &cot);
    assert!(out.o.to_f64_vec().iter().all(|x| x.is_finite()));
    for (name, t) in grads.named() {
        assert!(t.to_f64_vec().iter().all(|x| x.is_finite()), "{name} not finite");
    }
    // After the reset at token 3, outputs do not depend on the initial state.
    let mut other = inputs.clone();
    other.initial_state = other.initial_state.as_ref().map(|t| common::bump(t, 0, 10.0));
    let o2 = kda_ref::forward(&other).unwrap();
    assert_close("o after reset", &slice_tokens(&out.o, 0, 3..6), &slice_tokens(&o2.o, 0, 3..6));
}
