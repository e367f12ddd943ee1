//! One segment at a time out of (and back into) the aligned layout: a segment's slots are
//! contiguous there, so it reads as a fixed-length `[H, 1, L, D]` problem of its own.

use kda_core::{fmt_shape, HostTensor, KdaError, Result, TensorData};
use kda_packed::{AlignedShape, SegmentInfo, SegmentPlan};

/// `map_data!(data, v => expr)`: `expr` on the typed elements, wrapped in the same variant.
macro_rules! map_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            TensorData::F64($v) => TensorData::F64($body),
            TensorData::F32($v) => TensorData::F32($body),
            TensorData::BF16($v) => TensorData::BF16($body),
        }
    };
}

fn aligned_of(plan: &SegmentPlan, aligned: &HostTensor) -> Result<(AlignedShape, bool)> {
    let scalar = aligned.shape().len() == 3;
    let a = AlignedShape::of_dims(aligned.shape(), scalar)?;
    a.check_chunks(plan.num_chunks(), plan.chunk_size())?;
    Ok((a, scalar))
}

fn segment_dims(a: &AlignedShape, s: &SegmentInfo, scalar: bool) -> Vec<usize> {
    if scalar {
        vec![a.h, 1, s.len]
    } else {
        vec![a.h, 1, s.len, a.d]
    }
}

fn read<T: Copy>(a: &AlignedShape, s: &SegmentInfo, src: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(a.h * s.len * a.d);
    for h in 0..a.h {
        let from = a.slot_offset(h, s.chunk_offset * a.c);
        out.extend_from_slice(&src[from..from + s.len * a.d]);
    }
    out
}

fn write<T: Copy>(a: &AlignedShape, s: &SegmentInfo, dst: &mut [T], src: &[T]) {
    let n = s.len * a.d;
    for h in 0..a.h {
        let to = a.slot_offset(h, s.chunk_offset * a.c);
        dst[to..to + n].copy_from_slice(&src[h * n..(h + 1) * n]);
    }
}

/// Segment `n` of row `b` of an aligned tensor as head-first `[H, 1, L, D]` (`[H, 1, L]` for
/// an aligned scalar `[H, NT, C]`).
pub fn segment_tensor(plan: &SegmentPlan, aligned: &HostTensor, b: usize, n: usize) -> Result<HostTensor> {
    let (a, scalar) = aligned_of(plan, aligned)?;
    let s = plan.segment(b, n)?;
    let data = map_data!(aligned.data(), v => read(&a, s, v));
    HostTensor::new(&segment_dims(&a, s, scalar), data)
}

/// Writes a head-first `[H, 1, L, D]` (or scalar `[H, 1, L]`) segment result into its slots.
pub fn write_segment(
    plan: &SegmentPlan,
    aligned: &mut HostTensor,
    b: usize,
    n: usize,
    segment: &HostTensor,
) -> Result<()> {
    let (a, scalar) = aligned_of(plan, aligned)?;
    let s = plan.segment(b, n)?;
    let want = segment_dims(&a, s, scalar);
    if segment.len() != want.iter().product::<usize>() {
        return Err(KdaError::shape("segment", fmt_shape(&want), fmt_shape(segment.shape())));
    }
    let mut data = aligned.data().clone();
    match (&mut data, segment.data()) {
        (TensorData::F64(d), TensorData::F64(v)) => write(&a, s, d, v),
        (TensorData::F32(d), TensorData::F32(v)) => write(&a, s, d, v),
        (TensorData::BF16(d), TensorData::BF16(v)) => write(&a, s, d, v),
        _ => {
            return Err(KdaError::dtype(
                "segment",
                format!("{} like the aligned tensor", aligned.dtype()),
                segment.dtype().to_string(),
            ))
        }
    }
    *aligned = HostTensor::new(aligned.shape(), data)?;
    Ok(())
}

/// The state of segment slot `(b, n)` out of `[B, N, H, K, V]`, as `[1, 1, H, K, V]`.
pub fn segment_state(state: &HostTensor, b: usize, n: usize) -> Result<HostTensor> {
    let &[sb, sn, h, k, v] = state.shape() else {
        return Err(KdaError::shape("state", "rank 5 [B, N, H, K, V]", fmt_shape(state.shape())));
    };
    if b >= sb || n >= sn {
        return Err(KdaError::shape(
            "state",
            format!("slot ({b}, {n}) inside [B, N]"),
            fmt_shape(state.shape()),
        ));
    }
    let block = h * k * v;
    let from = (b * sn + n) * block;
    let data = map_data!(state.data(), x => x[from..from + block].to_vec());
    HostTensor::new(&[1, 1, h, k, v], data)
}

/// Writes a `[1, 1, H, K, V]` segment state into slot `(b, n)` of `[B, N, H, K, V]`.
pub fn write_segment_state(state: &mut HostTensor, b: usize, n: usize, segment: &HostTensor) -> Result<()> {
    let &[sb, sn, h, k, v] = state.shape() else {
        return Err(KdaError::shape("state", "rank 5 [B, N, H, K, V]", fmt_shape(state.shape())));
    };
    if b >= sb || n >= sn || segment.shape() != [1, 1, h, k, v] {
        return Err(KdaError::shape(
            "segment state",
            format!("[1, 1, {h}, {k}, {v}] for slot ({b}, {n}) inside [B, N] = [{sb}, {sn}]"),
            fmt_shape(segment.shape()),
        ));
    }
    let block = h * k * v;
    let at = (b * sn + n) * block;
    let mut data = state.data().clone();
    match (&mut data, segment.data()) {
        (TensorData::F64(d), TensorData::F64(x)) => d[at..at + block].copy_from_slice(x),
        (TensorData::F32(d), TensorData::F32(x)) => d[at..at + block].copy_from_slice(x),
        (TensorData::BF16(d), TensorData::BF16(x)) => d[at..at + block].copy_from_slice(x),
        _ => {
            return Err(KdaError::dtype(
                "segment state",
                format!("{} like the state", state.dtype()),
                segment.dtype().to_string(),
            ))
        }
    }
    *state = HostTensor::new(state.shape(), data)?;
    Ok(())
}
