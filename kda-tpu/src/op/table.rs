//! The op's table: one row per [`Implementation`], owning what the rest of the crate asks of it:
//! its kernel family and lowering, the plugin platforms it runs on, and how its programs hold
//! the per-token inputs and residuals on the device. The program builders dispatch on the row
//! (`api`), the backend checks a handle's platform and lays out its device tensors by it.

use crate::lang::Lowering;
use crate::{Result, TpuError};
use kda_core::Implementation;

/// How an implementation forms a program's chunk loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Family {
    /// The chunk loops as StableHLO (`op/xla`), tuned by [`super::XlaConfig`].
    Xla,
    /// The TPU kernels (`op/tpu_kernels`) lowered as the row says, tuned by
    /// [`super::TpuKernelConfig`].
    TpuKernels(Lowering),
    /// The GPU forward kernels (`op/gpu_kernels`) lowered as the row says; the backward as
    /// XLA's chunk loops.
    GpuKernels(Lowering),
}

/// One row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Row {
    /// The implementation.
    pub implementation: Implementation,
    /// Its kernel family and lowering.
    pub family: Family,
    /// The plugin platforms (`PjrtBackend::platform`) it runs on; `None`: any.
    pub platforms: Option<&'static [&'static str]>,
    /// What to use elsewhere, for the error of a platform it does not run on.
    pub elsewhere: &'static str,
}

/// The rows, in [`Implementation`]'s order.
const ROWS: [Row; 5] = [
    Row { implementation: Implementation::Xla, family: Family::Xla, platforms: None, elsewhere: "" },
    Row {
        implementation: Implementation::Mosaic,
        family: Family::TpuKernels(Lowering::Mosaic),
        platforms: Some(&["tpu"]),
        elsewhere: "use interpret to run the kernels here",
    },
    Row {
        implementation: Implementation::Interpret,
        family: Family::TpuKernels(Lowering::Interpret),
        platforms: None,
        elsewhere: "",
    },
    Row {
        implementation: Implementation::Triton,
        family: Family::GpuKernels(Lowering::Triton),
        platforms: Some(&["cuda"]),
        elsewhere: "use triton-interpret to run the GPU kernels here",
    },
    Row {
        implementation: Implementation::TritonInterpret,
        family: Family::GpuKernels(Lowering::TritonInterpret),
        platforms: None,
        elsewhere: "",
    },
];

/// The row of `implementation`; an `Unsupported` error for one this build has no row for.
pub fn row(implementation: Implementation) -> Result<Row> {
    ROWS.iter().find(|r| r.implementation == implementation).copied().ok_or_else(|| {
        TpuError::unsupported(
            "implementation",
            format!("no program builders for {implementation:?} in this build of kda-tpu"),
        )
    })
}

impl Row {
    /// `Ok` when the row runs on a plugin of `platform`, else an `Unsupported` error naming
    /// both.
    pub fn supported_on(&self, platform: &str) -> Result<()> {
        match self.platforms {
            Some(ps) if !ps.contains(&platform) => Err(TpuError::unsupported(
                format!("implementation {}", self.implementation.name()),
                format!(
                    "a plugin of platform {}; this handle's platform is {platform} ({})",
                    ps.join(" or "),
                    self.elsewhere
                ),
            )),
            _ => Ok(()),
        }
    }

    /// `Ok` when the row runs on a device of kind `device_kind` with `compute_capability` (a
    /// CUDA device's `9.0`): the `triton` row takes Hopper (9.x) until other GPUs are checked,
    /// else an `Unsupported` error naming the device.
    pub fn supported_by(&self, device_kind: &str, compute_capability: Option<&str>) -> Result<()> {
        if self.family != Family::GpuKernels(Lowering::Triton) {
            return Ok(());
        }
        match compute_capability {
            Some(cc) if cc.starts_with("9.") => Ok(()),
            other => Err(TpuError::unsupported(
                format!("implementation {}", self.implementation.name()),
                format!(
                    "a Hopper GPU (compute capability 9.x; others are not checked yet); this device is \
                     {device_kind} (compute capability {})",
                    other.unwrap_or("unknown")
                ),
            )),
        }
    }

    /// Whether its programs take the per-token inputs in the kernels' forms (batch-first
    /// `[B*T, H*D]`, `beta` `[B*T, H]`; [`super::ProgramSpec::kernel_token_dims`]), as a handle on
    /// this row holds its device tensors; else in the caller's shapes.
    pub fn kernel_forms(&self) -> bool {
        matches!(self.family, Family::TpuKernels(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_implementation_has_a_row_that_names_itself() {
        for implementation in Implementation::ALL {
            assert_eq!(row(implementation).expect("a row").implementation, implementation);
        }
        let mosaic = row(Implementation::Mosaic).expect("a row");
        assert!(mosaic.supported_on("tpu").is_ok());
        let e = mosaic.supported_on("cpu").expect_err("libtpu only");
        assert!(e.to_string().contains("implementation mosaic") && e.to_string().contains("cpu"), "{e}");
        assert!(row(Implementation::Interpret).expect("a row").supported_on("cpu").is_ok());
        let triton = row(Implementation::Triton).expect("a row");
        assert!(triton.supported_by("NVIDIA H200", Some("9.0")).is_ok());
        let e = triton.supported_by("NVIDIA A100-SXM4-80GB", Some("8.0")).expect_err("Hopper only");
        assert!(e.to_string().contains("A100") && e.to_string().contains("8.0"), "{e}");
        assert!(row(Implementation::TritonInterpret).expect("a row").supported_by("cpu", None).is_ok());
    }
}
