//! The two transfer verbs: [`PjrtBackend::to_device`] and [`PjrtBackend::to_host`], for any
//! record of tensors (a tensor, inputs, cotangents, outputs, gradients, a list of them), and
//! the device instances of kda-core's records.

use kda_core::{Cotangents, DType, HostTensor, KdaGradients, KdaInputs, KdaOutputs, Layout, Tensors};

use super::handle::{PjrtBackend, Upload};
use super::tensor::DeviceTensor;

/// The forward's inputs on the device: per-token tensors in `config.layout`, all of q's dtype
/// (f32 or bf16) except `g` (f32 or bf16); states and gate parameters f32. Shapes and dtypes
/// are checked on every call; values (finite, `beta` in `[0, 1]`, a pre-activated `g` at most 0)
/// only by [`PjrtBackend::to_device`] from host tensors: device memory is never read back to
/// check it, so a tensor made on the device is the caller's to keep within the contract.
pub type DeviceInputs = KdaInputs<DeviceTensor>;
/// The cotangents on the device: `do` in q's dtype, `dht` f32.
pub type DeviceCotangents = Cotangents<DeviceTensor>;
/// The forward's outputs on the device: `o` in q's dtype and the call's layout, final states f32.
pub type DeviceOutputs = KdaOutputs<DeviceTensor>;
/// The gradients on the device: `dq dk dv dbeta` in q's dtype, `dg` in g's, the rest f32.
pub type DeviceGradients = KdaGradients<DeviceTensor>;

pub(crate) mod sealed {
    use kda_core::{DType, Layout};

    /// How a record's tensors travel to the device.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Travel {
        /// The dtype `beta` travels in (q's), when the record holds a `beta`.
        pub beta: Option<DType>,
        /// The layout per-token tensors are tagged with.
        pub layout: Option<Layout>,
    }

    /// What [`super::HostSide`] needs of a record, out of the public API.
    pub trait HostRecord {
        /// The shape rules (before anything is copied) and how the tensors travel.
        fn travel(&self) -> kda_core::Result<Travel> {
            Ok(Travel::default())
        }
        /// The value rules, run while the tensors are copied.
        fn check_values(&self) -> kda_core::Result<()> {
            Ok(())
        }
    }
}

/// A record of host tensors [`PjrtBackend::to_device`] copies: checked as its own rules say
/// (inputs: the whole contract; cotangents: finite values), `beta` in q's dtype, states and
/// gate parameters in f32, everything else in its own dtype (f64 as f32).
pub trait HostSide: Tensors<HostTensor> + sealed::HostRecord {}
impl<S: Tensors<HostTensor> + sealed::HostRecord> HostSide for S {}

impl sealed::HostRecord for HostTensor {}

impl sealed::HostRecord for KdaInputs {
    fn travel(&self) -> kda_core::Result<sealed::Travel> {
        let p = self.view().validate()?;
        super::handle::supported(&p)?;
        Ok(sealed::Travel { beta: Some(p.dtype), layout: Some(p.layout) })
    }
    fn check_values(&self) -> kda_core::Result<()> {
        KdaInputs::check_values(self)
    }
}

impl sealed::HostRecord for Cotangents {
    fn check_values(&self) -> kda_core::Result<()> {
        Cotangents::check_values(self)
    }
}

impl sealed::HostRecord for KdaOutputs {}

impl sealed::HostRecord for KdaGradients {}

impl<S: sealed::HostRecord> sealed::HostRecord for Vec<S> {
    fn travel(&self) -> kda_core::Result<sealed::Travel> {
        let mut travel = sealed::Travel::default();
        for s in self {
            let t = s.travel()?;
            travel.beta = travel.beta.or(t.beta);
            travel.layout = travel.layout.or(t.layout);
        }
        Ok(travel)
    }
    fn check_values(&self) -> kda_core::Result<()> {
        self.iter().try_for_each(S::check_values)
    }
}

/// The record names of per-token tensors (tagged with the inputs' layout).
const PER_TOKEN: [&str; 5] = ["q", "k", "v", "g", "beta"];
/// The record names of tensors that live in f32 on the device.
const F32_ON_DEVICE: [&str; 8] =
    ["initial_state", "a_log", "dt_bias", "dht", "final_state", "dh0", "da_log", "ddt_bias"];

/// The dims a per-token input `name` of a record is held in on the device for a handle whose
/// forward runs a kernel (`kernel`): the kernel forward's form
/// ([`crate::op::ProgramSpec::kernel_token_dims`]), batch-first `[B*T, H*D]` (`beta`
/// `[B*T, H]`), so that the forward reads it without a reshape (on a TPU a relayout of the
/// whole tensor); `None`: as given (XLA's programs take the caller's shapes).
pub(crate) fn held_as(name: &str, layout: Option<Layout>, shape: &[usize], kernel: bool) -> Option<Vec<i64>> {
    let token = kernel && matches!(name, "q" | "k" | "v" | "g");
    let beta = kernel && name == "beta";
    match (layout, shape) {
        (Some(Layout::BatchFirst), &[b, t, h, d]) if token => Some(vec![(b * t) as i64, (h * d) as i64]),
        (Some(Layout::BatchFirst), &[b, t, h] | &[b, t, h, 1]) if beta => {
            Some(vec![(b * t) as i64, h as i64])
        }
        _ => None,
    }
}

/// How the tensor `name` of a record travels.
fn travel_of(name: &str, travel: sealed::Travel) -> fn(&HostTensor) -> Upload {
    if name == "beta" && travel.beta == Some(DType::BF16) {
        return |t| Upload::cast(t, DType::BF16);
    }
    if (name == "beta" && travel.beta.is_some()) || F32_ON_DEVICE.contains(&name) {
        return |t| Upload::cast(t, DType::F32);
    }
    Upload::of
}

fn tag(t: DeviceTensor, name: &str, layout: Option<Layout>) -> DeviceTensor {
    match layout {
        Some(l) if PER_TOKEN.contains(&name) => t.with_layout(l),
        _ => t,
    }
}

impl PjrtBackend {
    /// Copies a record of host tensors to device `device`, checked as its kind says (see
    /// [`HostSide`]): a tensor, [`KdaInputs`] (validated, values included), [`Cotangents`],
    /// outputs, gradients, or a `Vec` of them. The copies of large tensors overlap the checks.
    pub fn to_device<S: HostSide>(&self, x: &S, device: usize) -> kda_core::Result<S::Of<DeviceTensor>> {
        self.check_device_index(device)?;
        let travel = x.travel()?;
        let named = x.named();
        let kernel = crate::op::row(self.tuning.implementation).is_ok_and(|r| r.kernel_forms());
        let items = named
            .iter()
            .map(|&(name, t)| (t, travel_of(name, travel), held_as(name, travel.layout, t.shape(), kernel)));
        let mut tensors = self.upload_each(device, items, || x.check_values())?.into_iter();
        x.try_map(&mut |name, _| {
            let t = tensors.next().ok_or_else(|| too_few("upload", name))?;
            Ok(tag(t, name, travel.layout))
        })
    }

    /// Copies a record of device tensors (from any devices of this handle) to the host in one
    /// call to the worker: a [`DeviceTensor`], [`DeviceOutputs`], [`DeviceGradients`], ..., or
    /// a `Vec` of them (one per device of a data-parallel call).
    pub fn to_host<S: Tensors<DeviceTensor>>(&self, x: &S) -> kda_core::Result<S::Of<HostTensor>> {
        let named = x.named();
        let ts: Vec<&DeviceTensor> = named.iter().map(|(_, t)| *t).collect();
        let mut host = self.download_all(&ts)?.into_iter();
        x.try_map(&mut |name, _| host.next().ok_or_else(|| too_few("download", name)))
    }

    /// A device index of this handle, or an error naming the handle's device count.
    pub(crate) fn check_device_index(&self, device: usize) -> kda_core::Result<()> {
        let n = self.device_count();
        match device < n {
            true => Ok(()),
            false => Err(kda_core::KdaError::value(
                "device",
                format!("a device index below {n} (this handle drives {n}; see PjrtOptions::devices)"),
                device.to_string(),
            )),
        }
    }
}

impl Tensors<DeviceTensor> for DeviceTensor {
    type Of<U> = U;
    fn named(&self) -> Vec<(&'static str, &DeviceTensor)> {
        vec![("tensor", self)]
    }
    fn try_map<U, E>(&self, f: &mut dyn FnMut(&'static str, &DeviceTensor) -> Result<U, E>) -> Result<U, E> {
        f("tensor", self)
    }
}

pub(crate) fn too_few(stage: &str, name: &str) -> kda_core::KdaError {
    kda_core::KdaError::backend(stage, "one tensor per entry of the record", format!("none for {name}"))
}
