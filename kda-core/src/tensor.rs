//! Host tensors: a shape plus contiguous row-major data of one dtype.

use crate::dtype::DType;
use crate::error::{KdaError, Result};
use crate::shape::{fmt_shape, Shape};
use half::bf16;

/// The element storage of a [`HostTensor`].
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// f64 elements (reference inputs and results).
    F64(Vec<f64>),
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    BF16(Vec<bf16>),
}

/// The elements of a tensor, mutable in place ([`HostTensor::elements_mut`]).
#[derive(Debug)]
pub enum ElementsMut<'a> {
    /// f64 elements.
    F64(&'a mut [f64]),
    /// f32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
}

/// The values a host value check accepts ([`HostTensor::first_outside`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueRange {
    /// Finite values.
    Finite,
    /// Finite values `<= 0` (log-decays: `-0.0` and `0.0` both pass).
    FiniteAtMostZero,
}

/// A row-major tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    shape: Shape,
    data: TensorData,
}

/// The element count of `shape`, or an `Unsupported` error when the product of its dims
/// overflows `usize` (a plain product would panic in debug builds and wrap in release ones).
pub(crate) fn element_count(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| {
        KdaError::unsupported(
            "tensor shape",
            format!("at most usize::MAX = {} elements", usize::MAX),
            format!("{} (the element count overflows)", fmt_shape(shape)),
        )
    })
}

fn check_len(shape: &[usize], len: usize) -> Result<()> {
    let want = element_count(shape)?;
    if want != len {
        return Err(KdaError::shape(
            "tensor data",
            format!("{} elements for shape {}", want, fmt_shape(shape)),
            format!("{len} elements"),
        ));
    }
    Ok(())
}

impl HostTensor {
    /// A tensor from data; fails when the element count does not match the shape.
    pub fn new(shape: &[usize], data: TensorData) -> Result<Self> {
        let len = match &data {
            TensorData::F64(v) => v.len(),
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
        };
        check_len(shape, len)?;
        Ok(Self { shape: Shape::from_slice(shape), data })
    }
    /// An f32 tensor.
    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        Self::new(shape, TensorData::F32(data))
    }
    /// An f64 tensor.
    pub fn from_f64(shape: &[usize], data: Vec<f64>) -> Result<Self> {
        Self::new(shape, TensorData::F64(data))
    }
    /// A bf16 tensor.
    pub fn from_bf16(shape: &[usize], data: Vec<bf16>) -> Result<Self> {
        Self::new(shape, TensorData::BF16(data))
    }
    /// A tensor of `dtype` from f64 values, rounding each to the dtype.
    pub fn from_f64_as(shape: &[usize], data: &[f64], dtype: DType) -> Result<Self> {
        let data = match host_dtype(dtype)? {
            DType::F32 => TensorData::F32(data.iter().map(|&x| x as f32).collect()),
            DType::BF16 => TensorData::BF16(data.iter().map(|&x| bf16::from_f64(x)).collect()),
            _ => TensorData::F64(data.to_vec()),
        };
        Self::new(shape, data)
    }
    /// A zero tensor, or an `Unsupported` error when the shape holds more elements (or bytes)
    /// than one allocation can: the checked form of [`HostTensor::zeros`] for untrusted shapes.
    pub fn try_zeros(shape: &[usize], dtype: DType) -> Result<Self> {
        let n = element_count(shape)?;
        let dtype = host_dtype(dtype)?;
        let max = isize::MAX as usize / dtype.size_bytes();
        if n > max {
            return Err(KdaError::unsupported(
                "tensor shape",
                format!("at most {max} {dtype} elements (isize::MAX bytes, one allocation)"),
                format!("{} = {n} elements", fmt_shape(shape)),
            ));
        }
        let data = match dtype {
            DType::F32 => TensorData::F32(vec![0.0; n]),
            DType::BF16 => TensorData::BF16(vec![bf16::ZERO; n]),
            _ => TensorData::F64(vec![0.0; n]),
        };
        Ok(Self { shape: Shape::from_slice(shape), data })
    }
    /// A zero tensor of a shape the caller controls (tests, fixed sizes).
    ///
    /// # Panics
    ///
    /// When the shape is too large for one allocation, like `vec!` (it never wraps to a
    /// tensor whose data disagrees with its shape), and for a dtype host tensors do not hold. Use [`HostTensor::try_zeros`] for shapes
    /// that come from user input.
    pub fn zeros(shape: &[usize], dtype: DType) -> Self {
        match Self::try_zeros(shape, dtype) {
            Ok(t) => t,
            Err(e) => panic!("HostTensor::zeros: {e}"),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            TensorData::F64(_) => DType::F64,
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
        }
    }
    /// Number of elements: the storage length, which every constructor checked against the
    /// shape, so it cannot overflow.
    pub fn len(&self) -> usize {
        match &self.data {
            TensorData::F64(v) => v.len(),
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
        }
    }
    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The storage.
    pub fn data(&self) -> &TensorData {
        &self.data
    }
    /// Mutable access to the elements, in place: their count and dtype stay those of the
    /// shape (the storage itself cannot be swapped for one of another length).
    pub fn elements_mut(&mut self) -> ElementsMut<'_> {
        match &mut self.data {
            TensorData::F64(v) => ElementsMut::F64(v),
            TensorData::F32(v) => ElementsMut::F32(v),
            TensorData::BF16(v) => ElementsMut::BF16(v),
        }
    }
    /// The storage, consuming the tensor.
    pub fn into_data(self) -> TensorData {
        self.data
    }
    /// The raw little-endian bytes of the elements (for device uploads and files).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            TensorData::F64(v) => bytemuck::cast_slice(v),
            TensorData::F32(v) => bytemuck::cast_slice(v),
            TensorData::BF16(v) => bytemuck::cast_slice(v),
        }
    }
    /// Element `i` widened to f64.
    #[inline]
    pub fn get_f64(&self, i: usize) -> f64 {
        match &self.data {
            TensorData::F64(v) => v[i],
            TensorData::F32(v) => v[i] as f64,
            TensorData::BF16(v) => v[i].to_f64(),
        }
    }
    /// All elements widened to f64.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            TensorData::F64(v) => v.clone(),
            TensorData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        }
    }
    /// All elements converted to f32 (rounding f64, widening bf16).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            TensorData::F64(v) => v.iter().map(|&x| x as f32).collect(),
            TensorData::F32(v) => v.clone(),
            TensorData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
    /// The same values in another float dtype (round to nearest even when narrowing); an
    /// `Unsupported` error for a dtype host tensors do not hold.
    pub fn cast(&self, dtype: DType) -> Result<HostTensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let data = match host_dtype(dtype)? {
            DType::F32 => TensorData::F32(self.to_f32_vec()),
            DType::BF16 => TensorData::BF16(match &self.data {
                TensorData::F64(v) => v.iter().map(|&x| bf16::from_f64(x)).collect(),
                TensorData::F32(v) => v.iter().map(|&x| bf16::from_f32(x)).collect(),
                TensorData::BF16(v) => v.clone(),
            }),
            _ => TensorData::F64(self.to_f64_vec()),
        };
        Ok(HostTensor { shape: self.shape.clone(), data })
    }
    /// The same data under another shape with the same element count.
    pub fn reshape(&self, shape: &[usize]) -> Result<HostTensor> {
        check_len(shape, self.len())?;
        Ok(HostTensor { shape: Shape::from_slice(shape), data: self.data.clone() })
    }
    /// Index of the first non-finite element, if any.
    pub fn first_non_finite(&self) -> Option<usize> {
        self.first_outside(ValueRange::Finite)
    }
    /// Index of the first element outside `range`, if any. Blocks of elements are checked
    /// without an early exit (which vectorizes), and only a failing block is searched, so a
    /// range costs one pass whatever it adds to finiteness.
    pub fn first_outside(&self, range: ValueRange) -> Option<usize> {
        fn first<T: Copy>(v: &[T], inside: impl Fn(T) -> bool + Copy) -> Option<usize> {
            const BLOCK: usize = 4096;
            let bad = v.chunks(BLOCK).position(|c| !c.iter().fold(true, |ok, &x| ok & inside(x)))?;
            let at = v[bad * BLOCK..].iter().position(|&x| !inside(x))?;
            Some(bad * BLOCK + at)
        }
        // bf16 by its bits: exponent all ones is infinity or NaN; at most 0 is the sign bit set
        // or +0.
        let bf16_finite = |x: bf16| x.to_bits() & 0x7f80 != 0x7f80;
        let bf16_at_most_zero = |x: bf16| x.to_bits() & 0x8000 != 0 || x.to_bits() == 0;
        match (&self.data, range) {
            (TensorData::F64(v), ValueRange::Finite) => first(v, f64::is_finite),
            (TensorData::F64(v), ValueRange::FiniteAtMostZero) => first(v, |x| x.is_finite() & (x <= 0.0)),
            (TensorData::F32(v), ValueRange::Finite) => first(v, f32::is_finite),
            (TensorData::F32(v), ValueRange::FiniteAtMostZero) => first(v, |x| x.is_finite() & (x <= 0.0)),
            (TensorData::BF16(v), ValueRange::Finite) => first(v, bf16_finite),
            (TensorData::BF16(v), ValueRange::FiniteAtMostZero) => {
                first(v, |x| bf16_finite(x) & bf16_at_most_zero(x))
            }
        }
    }
    /// Reorders the axes: result axis `i` is input axis `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<HostTensor> {
        let rank = self.shape.len();
        let mut seen = vec![false; rank];
        if perm.len() != rank || perm.iter().any(|&p| p >= rank || std::mem::replace(&mut seen[p], true)) {
            return Err(KdaError::shape("perm", format!("a permutation of 0..{rank}"), format!("{perm:?}")));
        }
        let out_shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        let mut in_strides = vec![1usize; rank];
        for i in (0..rank.saturating_sub(1)).rev() {
            in_strides[i] = in_strides[i + 1] * self.shape[i + 1];
        }
        let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
        let n = self.len();
        let mut src = Vec::with_capacity(n);
        let mut idx = vec![0usize; rank];
        for _ in 0..n {
            src.push(idx.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>());
            for ax in (0..rank).rev() {
                idx[ax] += 1;
                if idx[ax] < out_shape[ax] {
                    break;
                }
                idx[ax] = 0;
            }
        }
        let data = match &self.data {
            TensorData::F64(v) => TensorData::F64(src.iter().map(|&i| v[i]).collect()),
            TensorData::F32(v) => TensorData::F32(src.iter().map(|&i| v[i]).collect()),
            TensorData::BF16(v) => TensorData::BF16(src.iter().map(|&i| v[i]).collect()),
        };
        HostTensor::new(&out_shape, data)
    }

    /// Indices `start..start + len` of axis `axis`; indices past the axis's end read as zeros
    /// (data-parallel shards pad their last rows this way).
    pub fn slice_padded(&self, axis: usize, start: usize, len: usize) -> Result<HostTensor> {
        let rank = self.shape.len();
        if axis >= rank {
            return Err(KdaError::shape("axis", format!("an axis below {rank}"), axis.to_string()));
        }
        let (outer, extent) = (self.shape[..axis].iter().product::<usize>(), self.shape[axis]);
        let inner: usize = self.shape[axis + 1..].iter().product();
        let mut shape = self.shape.to_vec();
        shape[axis] = len;
        fn take<T: Copy + Default>(
            v: &[T],
            outer: usize,
            extent: usize,
            inner: usize,
            start: usize,
            len: usize,
        ) -> Vec<T> {
            let mut out = Vec::with_capacity(outer * len * inner);
            for o in 0..outer {
                let real = len.min(extent.saturating_sub(start));
                if real > 0 {
                    let from = (o * extent + start) * inner;
                    out.extend_from_slice(&v[from..from + real * inner]);
                }
                out.resize(out.len() + (len - real) * inner, T::default());
            }
            out
        }
        let data = match &self.data {
            TensorData::F64(v) => TensorData::F64(take(v, outer, extent, inner, start, len)),
            TensorData::F32(v) => TensorData::F32(take(v, outer, extent, inner, start, len)),
            TensorData::BF16(v) => TensorData::BF16(take(v, outer, extent, inner, start, len)),
        };
        HostTensor::new(&shape, data)
    }

    /// Joins tensors of one dtype along `axis` (all other dims equal).
    pub fn concat(parts: &[HostTensor], axis: usize) -> Result<HostTensor> {
        let first = parts.first().ok_or_else(|| KdaError::shape("parts", "at least one tensor", "none"))?;
        let rank = first.shape.len();
        if axis >= rank {
            return Err(KdaError::shape("axis", format!("an axis below {rank}"), axis.to_string()));
        }
        for p in parts {
            let same = p.shape.len() == rank
                && p.dtype() == first.dtype()
                && (0..rank).all(|a| a == axis || p.shape[a] == first.shape[a]);
            if !same {
                return Err(KdaError::shape("parts", fmt_shape(&first.shape), fmt_shape(&p.shape)));
            }
        }
        let outer: usize = first.shape[..axis].iter().product();
        let inner: usize = first.shape[axis + 1..].iter().product();
        let mut shape = first.shape.to_vec();
        shape[axis] = parts.iter().map(|p| p.shape[axis]).sum();
        fn join<T: Copy>(parts: &[&[T]], extents: &[usize], outer: usize, inner: usize) -> Vec<T> {
            let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
            for o in 0..outer {
                for (p, &e) in parts.iter().zip(extents) {
                    out.extend_from_slice(&p[o * e * inner..(o + 1) * e * inner]);
                }
            }
            out
        }
        let extents: Vec<usize> = parts.iter().map(|p| p.shape[axis]).collect();
        // Every part's elements of the first's variant (all share its dtype, checked above).
        macro_rules! joined {
            ($variant:ident) => {{
                let slices: Vec<_> = parts
                    .iter()
                    .map(|p| match &p.data {
                        TensorData::$variant(v) => v.as_slice(),
                        _ => &[],
                    })
                    .collect();
                TensorData::$variant(join(&slices, &extents, outer, inner))
            }};
        }
        let data = match &first.data {
            TensorData::F64(_) => joined!(F64),
            TensorData::F32(_) => joined!(F32),
            TensorData::BF16(_) => joined!(BF16),
        };
        HostTensor::new(&shape, data)
    }
}

/// `Ok(dtype)` for the float dtypes host tensors hold; otherwise an `Unsupported` error.
fn host_dtype(dtype: DType) -> Result<DType> {
    if dtype.is_float() {
        Ok(dtype)
    } else {
        Err(KdaError::unsupported("dtype", "a host tensor of f32, bf16 or f64", dtype.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    /// [2, 3, 2] counting 0..12: rows of axis 1 sliced with zero padding, then joined back.
    #[rstest]
    #[case::inside(1, 1, 2, vec![2., 3., 4., 5., 8., 9., 10., 11.])]
    #[case::padded_past_the_end(1, 2, 2, vec![4., 5., 0., 0., 10., 11., 0., 0.])]
    #[case::all_padding(1, 3, 1, vec![0., 0., 0., 0.])]
    #[case::leading_axis(0, 1, 1, vec![6., 7., 8., 9., 10., 11.])]
    fn slice_padded_takes_rows_and_pads_with_zeros(
        #[case] axis: usize,
        #[case] start: usize,
        #[case] len: usize,
        #[case] want: Vec<f32>,
    ) {
        let t = HostTensor::from_f32(&[2, 3, 2], (0..12).map(|i| i as f32).collect()).unwrap();
        let s = t.slice_padded(axis, start, len).unwrap();
        assert_eq!(s.to_f32_vec(), want);
        assert_eq!(s.shape()[axis], len);
    }

    #[test]
    fn concat_undoes_a_split_along_any_axis() {
        let t = HostTensor::from_f32(&[2, 3, 2], (0..12).map(|i| i as f32).collect()).unwrap();
        for axis in 0..3 {
            let n = t.shape()[axis];
            let parts: Vec<_> = (0..n).map(|i| t.slice_padded(axis, i, 1).unwrap()).collect();
            assert_eq!(HostTensor::concat(&parts, axis).unwrap(), t, "axis {axis}");
        }
        let other = HostTensor::from_f32(&[2, 2, 2], vec![0.0; 8]).unwrap();
        assert!(HostTensor::concat(&[t, other], 0).is_err());
    }
}
