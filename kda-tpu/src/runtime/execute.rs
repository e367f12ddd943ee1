//! Execution with borrowed inputs, and the input/output checks against `@main`'s signature.

use std::marker::PhantomData;

use kda_core::KdaError;
use pjrt::ExecutionInputs;
use pjrt_sys::PJRT_Buffer;

use super::buffer::DeviceBuffer;
use super::compile::Executable;
use crate::error::{Result, TpuError};
use crate::hlo::TensorType;

/// Inputs that borrow device buffers: pjrt's own impls take buffers by value and destroy them after
/// the call; these destroy nothing and mark every input non-donatable, so buffers can be reused.
pub(crate) struct Borrowed<'a> {
    ptrs: Vec<*mut PJRT_Buffer>,
    _bufs: PhantomData<&'a DeviceBuffer>,
}

impl<'a> Borrowed<'a> {
    pub(crate) fn new(bufs: &[&'a DeviceBuffer]) -> Self {
        Self { ptrs: bufs.iter().map(|b| b.raw()).collect(), _bufs: PhantomData }
    }
}

impl ExecutionInputs for Borrowed<'_> {
    fn buffer_ptrs(&self) -> Vec<Vec<*mut PJRT_Buffer>> {
        vec![self.ptrs.clone()]
    }
    /// Honoured by `LoadedExecutable::execution(..).run_sync()` (not by `execute_sync`): an input
    /// aliased to an output (`tf.aliasing_output`) is then copied, never invalidated.
    fn non_donatable_input_indices(&self) -> Vec<i64> {
        (0..self.ptrs.len() as i64).collect()
    }
}

/// Checks count, dtype and dims of `inputs` against the program (when its signature is known).
pub(crate) fn check_inputs(exe: &Executable, inputs: &[&DeviceBuffer]) -> Result<()> {
    let Some(sig) = exe.signature() else { return Ok(()) };
    if sig.args.len() != inputs.len() {
        return Err(KdaError::shape(
            "inputs",
            format!("{} arguments for @main", sig.args.len()),
            format!("{} buffers", inputs.len()),
        )
        .into());
    }
    for (i, (want, buf)) in sig.args.iter().zip(inputs).enumerate() {
        if let Some(TensorType { elem: dtype, dims }) = want {
            buf.expect(&format!("input {i}"), *dtype, dims)?;
        }
    }
    Ok(())
}

/// Checks the plugin's outputs against the declared results; a mismatch is a runtime bug.
pub(crate) fn check_outputs(exe: &Executable, outputs: &[DeviceBuffer]) -> Result<()> {
    let Some(sig) = exe.signature() else { return Ok(()) };
    if sig.results.len() != outputs.len() {
        return Err(TpuError::Execute {
            message: format!(
                "@main declares {} results, plugin returned {}",
                sig.results.len(),
                outputs.len()
            ),
        });
    }
    for (i, (want, got)) in sig.results.iter().zip(outputs).enumerate() {
        if let Some(t) = want {
            if got.dtype() != t.elem || got.dims() != t.dims.as_slice() {
                return Err(TpuError::Execute {
                    message: format!("output {i}: declared {t}, plugin returned {got:?}"),
                });
            }
        }
    }
    Ok(())
}
