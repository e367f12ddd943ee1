//! Device-resident tensors: upload (f32, bf16, i32), download with dtype and size checks.
//!
//! bf16: pjrt 0.2.0 has no bf16 host type, so a private newtype pair ([`Bf16Bits`] / `Bf16Type`)
//! implements `pjrt::ElemType`/`pjrt::Type` with `PrimitiveType::BF16`; the public API takes and
//! returns `half::bf16`. Downloads read raw bytes because `copy_to_host_sync` rejects bf16.

use std::fmt;

use kda_core::{DType, KdaError};
use pjrt::{Buffer, Client, Device, ElemType, PrimitiveType, Type, TypedHostBuffer};
use pjrt_sys::PJRT_Buffer;

use super::raw::{paired_ptr, Bf16Bits};
use crate::error::{pjrt_message, Result, TpuError};

/// The PJRT primitive type of each element type the runtime moves.
const PRIMITIVES: [(DType, PrimitiveType); 6] = [
    (DType::F32, PrimitiveType::F32),
    (DType::BF16, PrimitiveType::BF16),
    (DType::F64, PrimitiveType::F64),
    (DType::I32, PrimitiveType::S32),
    (DType::U16, PrimitiveType::U16),
    (DType::I1, PrimitiveType::Pred),
];

/// The element type of a PJRT buffer, or an `Unsupported` error naming the ones handled.
fn dtype_of(p: PrimitiveType) -> Result<DType> {
    PRIMITIVES.iter().find(|(_, q)| *q == p).map(|(d, _)| *d).ok_or_else(|| {
        TpuError::unsupported(
            format!("buffer type {p:?}"),
            "kda-tpu handles f32, bf16, f64, i32, ui16 and i1",
        )
    })
}

/// The pjrt `Type` marker for [`Bf16Bits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bf16Type;

impl Type for Bf16Type {
    const NAME: &'static str = "bf16";
    const PRIMITIVE_TYPE: PrimitiveType = PrimitiveType::BF16;
    const TYPE: Self = Bf16Type;
    type ElemType = Bf16Bits;
}

impl ElemType for Bf16Bits {
    type Type = Bf16Type;
}

/// A tensor on the runtime's device, with its dtype and dims read once at creation.
/// Not `Send`: it belongs to the thread of its [`Runtime`](super::Runtime).
pub struct DeviceBuffer {
    /// Owns the plugin's buffer: dropping it frees the device memory. Read through `raw`.
    _buf: Buffer,
    raw: *mut PJRT_Buffer,
    dtype: DType,
    dims: Vec<i64>,
    elements: usize,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer({}{:?})", self.dtype, self.dims)
    }
}

impl DeviceBuffer {
    /// Wraps a pjrt buffer; queries dtype and dims (callers run this inside the panic guard).
    pub(crate) fn wrap(client: &Client, buf: Buffer) -> Result<Self> {
        let raw = paired_ptr::<Buffer, PJRT_Buffer>(client, &buf)?;
        let dtype = dtype_of(buf.primitive_type())?;
        let dims = buf.dims();
        let elements = element_count("device buffer", &dims)?;
        Ok(Self { _buf: buf, raw, dtype, dims, elements })
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The dimensions (empty for a scalar).
    pub fn dims(&self) -> &[i64] {
        &self.dims
    }
    /// The number of elements.
    pub fn num_elements(&self) -> usize {
        self.elements
    }
    /// Contract check: `arg` must be `dtype` with exactly `dims`.
    pub fn expect(&self, arg: &str, dtype: DType, dims: &[i64]) -> Result<()> {
        if self.dtype != dtype {
            return Err(KdaError::dtype(arg, dtype.name(), self.dtype.name()).into());
        }
        if self.dims != dims {
            return Err(KdaError::shape(arg, format!("{dims:?}"), format!("{:?}", self.dims)).into());
        }
        Ok(())
    }
    pub(crate) fn raw(&self) -> *mut PJRT_Buffer {
        self.raw
    }
}

/// Checks that `len` elements fill `dims` exactly (pjrt's builder does not; its `bytes()` panics).
pub(crate) fn check_len(arg: &str, len: usize, dims: &[i64]) -> Result<()> {
    let n = element_count(arg, dims)?;
    if n != len {
        return Err(KdaError::shape(
            arg,
            format!("{n} elements for dims {dims:?}"),
            format!("{len} elements"),
        )
        .into());
    }
    Ok(())
}

/// The number of elements of `dims`: an error naming `arg` for a negative dim or a product
/// that overflows `usize`.
pub(crate) fn element_count(arg: &str, dims: &[i64]) -> Result<usize> {
    dims.iter().try_fold(1usize, |n, &d| usize::try_from(d).ok().and_then(|d| n.checked_mul(d))).ok_or_else(
        || KdaError::shape(arg, "non-negative dims whose product fits in usize", format!("{dims:?}")).into(),
    )
}

/// Host -> device copy of any pjrt element type; blocks until the copy is done.
pub(crate) fn upload<E: ElemType>(
    client: &Client,
    device: &Device,
    data: Vec<E>,
    dims: &[i64],
) -> Result<DeviceBuffer> {
    let what = <E::Type as Type>::NAME;
    check_len(&format!("upload_{what}"), data.len(), dims)?;
    let host: TypedHostBuffer<E::Type> =
        TypedHostBuffer::<E::Type>::builder().data::<E>(data).dims(dims.to_vec()).build();
    let buf = host.copy_to_sync(device).map_err(|e| TpuError::Transfer {
        what: format!("{what}{dims:?} to device"),
        message: pjrt_message(&e),
    })?;
    DeviceBuffer::wrap(client, buf)
}
