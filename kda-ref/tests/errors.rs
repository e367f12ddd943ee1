//! Misshapen cotangents are typed errors on every entry point, never a panic or a silent
//! truncation.

mod common;

use common::Small;
use kda_core::{Cotangents, ErrorKind, HostTensor};
use rstest::rstest;

fn zeros_like(shape: &[usize]) -> HostTensor {
    HostTensor::from_f64(shape, vec![0.0; shape.iter().product()]).unwrap()
}

#[rstest]
#[case::do_too_small(|c: &mut Cotangents| c.d_o = zeros_like(&[2, 1, 6, 1]), ErrorKind::Shape, "do")]
#[case::do_too_large(|c: &mut Cotangents| c.d_o = zeros_like(&[2, 1, 6, 5]), ErrorKind::Shape, "do")]
#[case::do_not_finite(|c: &mut Cotangents| {
    c.d_o = common::bump(&c.d_o, 0, f64::NAN);
}, ErrorKind::Value, "do")]
#[case::dht_too_small(|c: &mut Cotangents| {
    c.dht = Some(zeros_like(&[1, 1, 2, 3, 1]));
}, ErrorKind::Shape, "dht")]
#[case::dht_too_large(|c: &mut Cotangents| {
    c.dht = Some(zeros_like(&[1, 1, 2, 3, 5]));
}, ErrorKind::Shape, "dht")]
fn loss_validates_the_cotangents(
    #[case] break_it: fn(&mut Cotangents),
    #[case] kind: ErrorKind,
    #[case] arg: &str,
) {
    let (inputs, mut cot) = Small::new(2, 1, 6, 3, 4).build();
    kda_ref::loss(&inputs, &cot).expect("valid cotangents");
    break_it(&mut cot);
    let err = kda_ref::loss(&inputs, &cot).unwrap_err();
    assert_eq!((err.kind(), err.arg()), (kind, arg));
    let grads = kda_ref::forward_and_vjp(&inputs, &cot).unwrap_err();
    assert_eq!(grads, err, "loss and backward reject the same cotangents alike");
}

/// A positive pre-activated log-decay at one token of a packed row is a `Value` error naming
/// the flat index, from the forward, the fused forward+VJP and the loss alike; the same row with
/// every log-decay exactly 0 (no forgetting) runs and stays finite.
#[test]
fn positive_log_decay_is_refused_with_its_index() {
    let small = Small { cu: Some(vec![vec![0, 2, 5, 9]]), ..Small::new(2, 1, 9, 3, 4) };
    let (mut inputs, cot) = small.build();
    // Head 1, token 6 (third segment), channel 1: head-first [H, B, T, K].
    let at = (9 + 6) * 3 + 1;
    let g = inputs.g.to_f64_vec();
    inputs.g = common::bump(&inputs.g, at, 0.3 - g[at]);
    let err = kda_ref::forward(&inputs).unwrap_err();
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Value, "g"), "{err}");
    assert!(err.got().ends_with(&format!("at flat index {at}")), "{err}");
    assert_eq!(kda_ref::forward_and_vjp(&inputs, &cot).unwrap_err(), err);
    assert_eq!(kda_ref::loss(&inputs, &cot).unwrap_err(), err);

    inputs.g = HostTensor::from_f64(inputs.g.shape(), vec![0.0; g.len()]).unwrap();
    let (out, grads) = kda_ref::forward_and_vjp(&inputs, &cot).expect("g = 0 is a valid log-decay");
    assert!(out.o.to_f64_vec().iter().chain(&grads.dg.to_f64_vec()).all(|x| x.is_finite()));
}
