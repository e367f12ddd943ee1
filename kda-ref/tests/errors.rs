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
