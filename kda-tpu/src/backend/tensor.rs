//! [`DeviceTensor`]: a typed tensor held on a handle's device, and what crosses to and from it.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kda_core::{fmt_shape, DType, KdaError, Layout, TensorMeta};

use super::worker::{BufferInfo, Shared};
use crate::error::{Result, TpuError};

/// A tensor on the device of a [`crate::PjrtBackend`]: element type, dims, the layout of a
/// per-token tensor, and the handle and device it lives on. Cloning is cheap (the device
/// memory is shared, never copied); the memory is freed when the last clone is dropped. It can
/// be sent to and shared between threads, and used only with the handle (or a clone of it)
/// that made it. Calls check its shape, dtype and layout, never its values: those are checked
/// once, on the host, by [`crate::PjrtBackend::to_device`] (docs/kda.md, Tensors).
#[derive(Clone)]
pub struct DeviceTensor {
    inner: Arc<Inner>,
    /// The dims callers see; the buffer may hold the same row-major elements under other dims
    /// (the KDA programs return per-token results flat), which programs reading it get
    /// reshaped on the device.
    shape: Vec<usize>,
    layout: Option<Layout>,
}

struct Inner {
    id: u64,
    dtype: DType,
    shape: Vec<usize>,
    device: usize,
    owner: Arc<Shared>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.owner.free(self.id, false);
    }
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceTensor({}{}", self.inner.dtype, fmt_shape(&self.shape))?;
        if let Some(l) = self.layout {
            write!(f, " {l:?}")?;
        }
        write!(f, " on device {} of handle {})", self.device(), self.inner.owner.id)
    }
}

impl DeviceTensor {
    pub(crate) fn wrap(owner: &Arc<Shared>, info: BufferInfo, layout: Option<Layout>) -> Self {
        let shape: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
        let inner = Arc::new(Inner {
            id: info.id,
            dtype: info.dtype,
            shape: shape.clone(),
            device: info.device,
            owner: owner.clone(),
        });
        DeviceTensor { inner, shape, layout }
    }

    /// The same device memory seen with `shape` (same element count; no copy here: a program
    /// that reads it under other dims gets a device-side reshape).
    pub fn reshaped(&self, shape: &[usize]) -> kda_core::Result<Self> {
        let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if n != Some(self.num_elements()) {
            let n = n.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string());
            return Err(KdaError::shape(
                "reshape",
                format!("{} elements", self.num_elements()),
                format!("{} ({n} elements)", fmt_shape(shape)),
            ));
        }
        Ok(DeviceTensor { inner: self.inner.clone(), shape: shape.to_vec(), layout: self.layout })
    }

    /// The same device memory tagged with a per-token `layout` (no copy).
    pub fn with_layout(&self, layout: Layout) -> Self {
        DeviceTensor { inner: self.inner.clone(), shape: self.shape.clone(), layout: Some(layout) }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }
    /// The dims, row-major.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The layout of a per-token tensor (`None`: not tagged; any layout is accepted).
    pub fn layout(&self) -> Option<Layout> {
        self.layout
    }
    /// The device index within its handle (0 to the handle's device count - 1).
    pub fn device(&self) -> usize {
        self.inner.device
    }
    /// Elements.
    pub fn num_elements(&self) -> usize {
        self.inner.shape.iter().product()
    }

    /// Bytes of device memory.
    pub fn size_bytes(&self) -> usize {
        self.num_elements() * self.inner.dtype.size_bytes()
    }
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    /// Checks that this tensor belongs to `owner` (any clone of the same handle).
    pub(crate) fn check_owner(&self, owner: &Shared, arg: &str) -> Result<()> {
        if self.inner.owner.id != owner.id {
            return Err(TpuError::Contract(KdaError::value(
                arg,
                format!("a tensor of handle {}", owner.id),
                format!("a tensor of handle {}", self.inner.owner.id),
            )));
        }
        Ok(())
    }

    /// Shape and float dtype for validation; an integer tensor is a dtype error naming `arg`.
    pub(crate) fn meta(&self, arg: &str) -> Result<Meta> {
        let dtype = self.inner.dtype;
        if !dtype.is_float() {
            return Err(TpuError::Contract(KdaError::dtype(arg, "f32 or bf16", dtype.to_string())));
        }
        Ok(Meta { shape: self.shape.clone(), dtype })
    }
}

/// A device tensor's shape and dtype, as validation reads them.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    shape: Vec<usize>,
    dtype: DType,
}

impl TensorMeta for Meta {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
}

/// How many sets of index tables a handle keeps on its devices (oldest dropped first).
pub(crate) const TABLES_KEPT: usize = 16;

/// Index tables already uploaded, by (spec, segments, device).
#[derive(Default)]
pub(crate) struct TableCache(
    pub(crate) VecDeque<((crate::op::ProgramSpec, kda_core::SegmentTable), usize, Vec<DeviceTensor>)>,
);

/// A program compiled on a handle's device ([`crate::PjrtBackend::compile_program`]).
#[derive(Clone)]
pub struct DeviceProgram {
    inner: Arc<ProgramInner>,
}

struct ProgramInner {
    id: u64,
    owner: Arc<Shared>,
    signature: Option<crate::Signature>,
}

impl Drop for ProgramInner {
    fn drop(&mut self) {
        self.owner.free(self.id, true);
    }
}

impl fmt::Debug for DeviceProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceProgram({} of handle {})", self.inner.id, self.inner.owner.id)
    }
}

impl DeviceProgram {
    pub(crate) fn wrap(owner: &Arc<Shared>, id: u64, signature: Option<crate::Signature>) -> Self {
        DeviceProgram { inner: Arc::new(ProgramInner { id, owner: owner.clone(), signature }) }
    }
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }
    pub(crate) fn owner_id(&self) -> u64 {
        self.inner.owner.id
    }
    /// `@main`'s argument and result types, as parsed from the program text.
    pub fn signature(&self) -> Option<&crate::Signature> {
        self.inner.signature.as_ref()
    }
}

/// Bytes copied between host and device by a handle and its clones since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Bytes uploaded (host to device).
    pub to_device: u64,
    /// Bytes downloaded (device to host).
    pub to_host: u64,
    /// Programs executed.
    pub executions: u64,
    /// Arguments a program read under other dims than its buffer's, reshaped on the device
    /// first (on a TPU each a copy of the tensor; uploads travel in the programs' forms).
    pub reshapes: u64,
}

impl TransferStats {
    pub(crate) fn read(shared: &Shared) -> Self {
        let c = &shared.counters;
        TransferStats {
            to_device: c.to_device.load(Ordering::Relaxed),
            to_host: c.to_host.load(Ordering::Relaxed),
            executions: c.executions.load(Ordering::Relaxed),
            reshapes: c.reshapes.load(Ordering::Relaxed),
        }
    }

    /// What crossed between `earlier` and `self`.
    pub fn since(self, earlier: TransferStats) -> TransferStats {
        TransferStats {
            to_device: self.to_device - earlier.to_device,
            to_host: self.to_host - earlier.to_host,
            executions: self.executions - earlier.executions,
            reshapes: self.reshapes - earlier.reshapes,
        }
    }
}
