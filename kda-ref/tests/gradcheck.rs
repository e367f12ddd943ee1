//! The reference backward against central finite differences of the f64 loss.

mod common;

use common::{bump, Gate, Small};
use kda_core::{Cotangents, GateMode, HostTensor, KdaInputs, Layout};
use rstest::rstest;

const EPS: f64 = 1e-6;
const LIMIT: f64 = 1e-6;

/// Every differentiable input: its name, a getter and a setter.
fn perturbed(inputs: &KdaInputs, name: &str, i: usize, delta: f64) -> KdaInputs {
    let mut x = inputs.clone();
    match name {
        "dq" => x.q = bump(&x.q, i, delta),
        "dk" => x.k = bump(&x.k, i, delta),
        "dv" => x.v = bump(&x.v, i, delta),
        "dg" => x.g = bump(&x.g, i, delta),
        "dbeta" => x.beta = bump(&x.beta, i, delta),
        "dh0" => x.initial_state = x.initial_state.as_ref().map(|t| bump(t, i, delta)),
        "da_log" | "ddt_bias" => {
            let pick = |a: &mut Option<HostTensor>, d: &mut Option<HostTensor>| {
                let t = if name == "da_log" { a } else { d };
                *t = t.as_ref().map(|t| bump(t, i, delta));
            };
            match &mut x.gate {
                GateMode::Softplus { a_log, dt_bias } | GateMode::LowerBound { a_log, dt_bias, .. } => {
                    pick(a_log, dt_bias)
                }
                GateMode::Preactivated => {}
            }
        }
        other => panic!("unknown gradient {other}"),
    }
    x
}

fn check(case: &Small) {
    let (inputs, cot): (KdaInputs, Cotangents) = case.build();
    let (_, grads) = kda_ref::forward_and_vjp(&inputs, &cot).unwrap();
    let named = grads.named();
    let expected: &[&str] = match case.gate {
        Gate::Pre => &["dq", "dk", "dv", "dg", "dbeta", "dh0"],
        _ => &["dq", "dk", "dv", "dg", "dbeta", "dh0", "da_log", "ddt_bias"],
    };
    let names: Vec<&str> = named.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, expected, "gradients returned");
    for (name, analytic) in named {
        let an = analytic.to_f64_vec();
        let mut err2 = 0.0;
        let mut ref2 = 0.0;
        for (i, a) in an.iter().enumerate() {
            let lp = kda_ref::loss(&perturbed(&inputs, name, i, EPS), &cot).unwrap();
            let lm = kda_ref::loss(&perturbed(&inputs, name, i, -EPS), &cot).unwrap();
            let fd = (lp - lm) / (2.0 * EPS);
            err2 += (fd - a) * (fd - a);
            ref2 += fd * fd;
        }
        assert!(ref2 > 0.0, "{name}: finite differences are all zero; the case does not exercise it");
        let rel = (err2 / ref2).sqrt();
        assert!(rel <= LIMIT, "{name}: relative error {rel:e} > {LIMIT:e} in {case:?}");
    }
}

#[rstest]
#[case::preactivated_head_first(Small::new(2, 2, 7, 3, 4))]
#[case::preactivated_batch_first(Small { layout: Layout::BatchFirst, ..Small::new(2, 1, 6, 4, 3) })]
#[case::l2norm(Small { l2norm: true, ..Small::new(2, 1, 6, 3, 4) })]
#[case::softplus_gate(Small { gate: Gate::Softplus, ..Small::new(2, 1, 6, 3, 2) })]
#[case::lower_bound_gate_l2norm(Small { gate: Gate::LowerBound, l2norm: true, ..Small::new(2, 2, 5, 3, 2) })]
#[case::packed_segments(Small { cu: Some(vec![vec![0, 3, 3, 6], vec![0, 1, 5, 8]]), ..Small::new(2, 2, 8, 3, 2) })]
#[case::packed_l2norm_softplus(Small {
    cu: Some(vec![vec![0, 2, 7]]), l2norm: true, gate: Gate::Softplus, ..Small::new(1, 1, 8, 3, 3)
})]
#[case::longer_than_a_checkpoint(Small::new(1, 1, 70, 2, 2))]
fn gradients_match_central_differences(#[case] case: Small) {
    check(&case);
}
