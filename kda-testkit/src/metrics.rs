//! Agreement of a result with the f64 reference (docs/kda.md, Accuracy): RMS ratio, max abs error and
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

/// The worst row of `result` against `reference`, rows being runs of `width` elements (a
/// token's channels): `max_row |x - ref| / |ref|` (Euclidean norms; the error's own norm where
/// the reference row is zero). An RMS ratio over the whole tensor is dominated by its largest
/// rows; this sees a row that is wrong relative to its own size.
pub fn worst_row_ratio(result: &HostTensor, reference: &[f64], width: usize) -> f64 {
    let x = result.to_f64_vec();
    assert_eq!(x.len(), reference.len(), "result and reference sizes differ");
    let width = width.max(1);
    let mut worst: f64 = 0.0;
    for (a, r) in x.chunks(width).zip(reference.chunks(width)) {
        let e2: f64 = a.iter().zip(r).map(|(a, r)| (a - r) * (a - r)).sum();
        let r2: f64 = r.iter().map(|r| r * r).sum();
        if !e2.is_finite() {
            return f64::INFINITY;
        }
        worst = worst.max(if r2 > 0.0 { (e2 / r2).sqrt() } else { e2.sqrt() });
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_relative_eq;

    #[test]
    fn worst_row_ratio_sees_a_small_row_an_rms_ratio_hides() {
        // Row 0 is large and exact, row 1 is small and 10% off.
        let reference = [100.0, 100.0, 1e-3, 1e-3];
        let got = HostTensor::from_f64(&[2, 2], vec![100.0, 100.0, 1.1e-3, 1.1e-3]).unwrap();
        assert!(agreement(&got, &reference).rms_ratio < 1e-5);
        assert_relative_eq!(worst_row_ratio(&got, &reference, 2), 0.1, max_relative = 1e-4);
    }
}
