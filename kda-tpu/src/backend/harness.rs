//! The benchmark harness (feature `harness`, not part of the stable API): one program at a
//! time on a call's tensors uploaded once, and the staged baseline.

use kda_core::{BackwardStrategy, Cotangents, KdaError, KdaInputs, Problem, Result};

use super::handle::PjrtBackend;
use super::launch::{Arg, Bound};
use super::options::Split;
use super::tensor::DeviceTensor;
use crate::op::{ProgramKind, ProgramSpec};
use crate::runtime::CompileOptions;

/// A call's inputs and cotangents on device 0, validated once: what benchmarks time programs on.
#[derive(Debug)]
pub struct DeviceCall {
    problem: Problem,
    spec: ProgramSpec,
    inputs: Vec<(&'static str, DeviceTensor)>,
    cotangents: Vec<(&'static str, DeviceTensor)>,
}

impl DeviceCall {
    /// Validates and uploads a call; `cot` is needed for backward and fused programs.
    pub fn upload(be: &PjrtBackend, inputs: &KdaInputs, cot: Option<&Cotangents>) -> Result<DeviceCall> {
        let dev = be.to_device(inputs, 0)?;
        let (problem, spec) = be.validate_on(0, &dev, cot.is_some_and(|c| c.dht.is_some()))?;
        let named = |args: Vec<(&'static str, Arg)>| {
            args.into_iter()
                .filter_map(|(n, a)| match a {
                    Arg::Tensor(t) => Some((n, t)),
                    Arg::Upload(_) => None,
                })
                .collect()
        };
        let cotangents = match cot {
            Some(c) => named(be.cotangent_args(c, &problem, 0)?),
            None => Vec::new(),
        };
        Ok(DeviceCall { inputs: named(super::launch::tensor_args(&dev)), problem, spec, cotangents })
    }

    /// The validated problem.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }
    /// The kernel spec (with `has_dht` set from the cotangents given).
    pub fn spec(&self) -> &ProgramSpec {
        &self.spec
    }

    /// Runs one program of the call. Saved-state backward programs need `h` (the last output
    /// of `Forward(SavedState)`).
    pub fn run(
        &self,
        be: &PjrtBackend,
        kind: ProgramKind,
        h: Option<&DeviceTensor>,
    ) -> Result<Vec<DeviceTensor>> {
        let mut args: Vec<(&'static str, Arg)> =
            self.inputs.iter().map(|(n, t)| (*n, Arg::Tensor(t.clone()))).collect();
        let cotangents = self.cotangents.iter().map(|(n, t)| (*n, Arg::Tensor(t.clone())));
        match kind {
            ProgramKind::Forward(_) => {}
            ProgramKind::Backward(s) => {
                if s == BackwardStrategy::SavedState {
                    let h = h.ok_or_else(|| {
                        KdaError::missing("h", "the saved-state backward reads the forward's states")
                    })?;
                    args.push(("h", Arg::Tensor(h.clone())));
                }
                args.extend(cotangents);
            }
            ProgramKind::Fused(_) => args.extend(cotangents),
        }
        let bound = vec![Bound { device: 0, problem: &self.problem, args }];
        let mut results = be.launch(&self.spec, kind, Split::Data, bound)?;
        Ok(results.pop().map(|r| r.into_iter().map(|(_, t)| t).collect()).unwrap_or_default())
    }

    /// The staged baseline: the forward program, its states handed back to the caller
    /// (downloaded to host memory), then a separate backward program fed from them.
    pub fn run_staged(
        &self,
        be: &PjrtBackend,
        strategy: BackwardStrategy,
    ) -> Result<(Vec<DeviceTensor>, Vec<DeviceTensor>)> {
        let saved = strategy == BackwardStrategy::SavedState;
        let mut fwd = self.run(be, ProgramKind::Forward(strategy), None)?;
        let h = if saved {
            let dev = fwd.pop().ok_or_else(|| KdaError::backend("forward", "an h output", "none"))?;
            let host = be.to_host(&dev)?;
            Some(be.to_device(&host, 0)?)
        } else {
            None
        };
        let bwd = self.run(be, ProgramKind::Backward(strategy), h.as_ref())?;
        Ok((fwd, bwd))
    }
}

/// The XLA options a kernel program of `kind` is compiled with on `be`'s platform.
pub fn compile_options(be: &PjrtBackend, kind: ProgramKind) -> CompileOptions {
    be.compile_options(kind)
}
