//! Agreement of a result with the f64 reference (spec section 7): RMS ratio, max abs error and
//! max ULP distance from the reference rounded to f32.

use kda_core::HostTensor;

/// How far a result is from the reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreement {
    /// `rms(x - ref) / rms(ref)`; `rms(x)` when the reference is all zeros.
    pub rms_ratio: f64,
    /// `max |x - ref|`.
    pub max_abs: f64,
    /// Max distance in f32 units in the last place between `x` (as f32) and `ref` rounded to f32.
    pub max_ulp: u64,
    /// Whether every element of `x` is finite.
    pub finite: bool,
}

/// Maps an f32 to an integer line where adjacent floats differ by one.
fn ordered(x: f32) -> i64 {
    let bits = x.to_bits() as i32;
    if bits < 0 {
        i32::MIN as i64 - bits as i64
    } else {
        bits as i64
    }
}

/// The ULP distance between two f32 values (0 for equal values, including +0 and -0).
pub fn ulp_distance(a: f32, b: f32) -> u64 {
    if a == b {
        return 0;
    }
    if a.is_nan() || b.is_nan() {
        return u64::MAX;
    }
    (ordered(a) - ordered(b)).unsigned_abs()
}

/// Compares `result` with the f64 `reference` element by element.
pub fn agreement(result: &HostTensor, reference: &[f64]) -> Agreement {
    let x = result.to_f64_vec();
    assert_eq!(x.len(), reference.len(), "result and reference sizes differ");
    let mut err2 = 0.0;
    let mut ref2 = 0.0;
    let mut max_abs: f64 = 0.0;
    let mut max_ulp = 0u64;
    let mut finite = true;
    for (a, r) in x.iter().zip(reference) {
        finite &= a.is_finite();
        let e = a - r;
        err2 += e * e;
        ref2 += r * r;
        max_abs = max_abs.max(e.abs());
        max_ulp = max_ulp.max(ulp_distance(*a as f32, *r as f32));
    }
    let n = x.len().max(1) as f64;
    let rms_ratio = if ref2 > 0.0 { (err2 / ref2).sqrt() } else { (err2 / n).sqrt() };
    Agreement { rms_ratio: if finite { rms_ratio } else { f64::INFINITY }, max_abs, max_ulp, finite }
}
