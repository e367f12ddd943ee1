//! Device-resident tensors: upload (f32, bf16, i32), download with dtype and size checks.
//!
//! bf16: pjrt 0.2.0 has no bf16 host type, so a private newtype pair ([`Bf16Bits`] / `Bf16Type`)
//! implements `pjrt::ElemType`/`pjrt::Type` with `PrimitiveType::BF16`; the public API takes and
//! returns `half::bf16`. Downloads read raw bytes because `copy_to_host_sync` rejects bf16.

use std::fmt;

use kda_core::KdaError;
use pjrt::{Buffer, Client, Device, ElemType, PrimitiveType, Type, TypedHostBuffer};
use pjrt_sys::PJRT_Buffer;

use super::raw::paired_ptr;
use crate::error::{pjrt_message, Result, TpuError};

/// Element type of a device buffer, named as in StableHLO (`f32`, `bf16`, `i32`, `ui16`, `i1`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// `f32`
    F32,
    /// `bf16`
    Bf16,
    /// `f16`
    F16,
    /// `f64`
    F64,
    /// `i1` (PRED)
    Pred,
    /// `i8`
    I8,
    /// `i16`
    I16,
    /// `i32`
    I32,
    /// `i64`
    I64,
    /// `ui8`
    U8,
    /// `ui16`
    U16,
    /// `ui32`
    U32,
    /// `ui64`
    U64,
}

const NAMES: [(ElementType, &str, PrimitiveType); 13] = [
    (ElementType::F32, "f32", PrimitiveType::F32),
    (ElementType::Bf16, "bf16", PrimitiveType::BF16),
    (ElementType::F16, "f16", PrimitiveType::F16),
    (ElementType::F64, "f64", PrimitiveType::F64),
    (ElementType::Pred, "i1", PrimitiveType::Pred),
    (ElementType::I8, "i8", PrimitiveType::S8),
    (ElementType::I16, "i16", PrimitiveType::S16),
    (ElementType::I32, "i32", PrimitiveType::S32),
    (ElementType::I64, "i64", PrimitiveType::S64),
    (ElementType::U8, "ui8", PrimitiveType::U8),
    (ElementType::U16, "ui16", PrimitiveType::U16),
    (ElementType::U32, "ui32", PrimitiveType::U32),
    (ElementType::U64, "ui64", PrimitiveType::U64),
];

impl ElementType {
    /// Parses a StableHLO element type name (`f32`, `bf16`, `i32`, `ui16`, `i1`, ...).
    pub fn parse(name: &str) -> Option<Self> {
        NAMES.iter().find(|(_, n, _)| *n == name).map(|(t, _, _)| *t)
    }
    /// The StableHLO name.
    pub fn name(self) -> &'static str {
        NAMES.iter().find(|(t, _, _)| *t == self).map_or("?", |(_, n, _)| n)
    }
    /// Bytes per element on the host (PRED is one byte).
    pub fn size_bytes(self) -> usize {
        match self {
            ElementType::Pred | ElementType::I8 | ElementType::U8 => 1,
            ElementType::Bf16 | ElementType::F16 | ElementType::I16 | ElementType::U16 => 2,
            ElementType::F32 | ElementType::I32 | ElementType::U32 => 4,
            ElementType::F64 | ElementType::I64 | ElementType::U64 => 8,
        }
    }
    fn from_primitive(p: PrimitiveType) -> Result<Self> {
        NAMES.iter().find(|(_, _, q)| *q == p).map(|(t, _, _)| *t).ok_or_else(|| {
            TpuError::unsupported(format!("buffer type {p:?}"), "kda-tpu handles f32/bf16/ints only")
        })
    }
}

impl fmt::Display for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// bf16 bit pattern as a pjrt host element (pjrt 0.2.0 lacks one); see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16Bits(pub(crate) u16);

// SAFETY: `Bf16Bits` is `repr(transparent)` over `u16`: every bit pattern is valid, zero
// included, and it has no padding; so a `Vec<half::bf16>` can be reused as one without a copy.
unsafe impl bytemuck::Zeroable for Bf16Bits {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for Bf16Bits {}

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
    dtype: ElementType,
    dims: Vec<i64>,
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
        let dtype = ElementType::from_primitive(buf.primitive_type())?;
        let dims = buf.dims();
        Ok(Self { _buf: buf, raw, dtype, dims })
    }
    /// The element type.
    pub fn dtype(&self) -> ElementType {
        self.dtype
    }
    /// The dimensions (empty for a scalar).
    pub fn dims(&self) -> &[i64] {
        &self.dims
    }
    /// The number of elements.
    pub fn num_elements(&self) -> usize {
        self.dims.iter().map(|&d| d.max(0) as usize).product()
    }
    /// Contract check: `arg` must be `dtype` with exactly `dims`.
    pub fn expect(&self, arg: &str, dtype: ElementType, dims: &[i64]) -> Result<()> {
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
    if dims.iter().any(|&d| d < 0) {
        return Err(KdaError::shape(arg, "non-negative dims", format!("{dims:?}")).into());
    }
    let n: usize = dims.iter().map(|&d| d as usize).product();
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
