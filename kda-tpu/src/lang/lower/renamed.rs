//! Earlier public names, kept for one release.

/// The Triton lowering's parameters, under their earlier name.
#[deprecated(since = "0.3.0", note = "renamed TritonParams, set with KernelBuilder::params")]
pub type GpuLaunch = super::TritonParams;
