//! `stablehlo.custom_call`: a call the compiler hands to a backend target (Mosaic kernels).

use super::builder::FnBuilder;
use super::error::Result;
use super::types::{TensorType, Value};

impl FnBuilder {
    /// `stablehlo.custom_call` of `operands` with `results`; `attrs` is the attribute list
    /// (`call_target_name = "..."` and the target's own), `op` names the call in errors.
    pub fn custom_call(
        &mut self,
        op: &str,
        operands: &[Value],
        results: &[TensorType],
        attrs: &str,
    ) -> Result<Vec<Value>> {
        self.push_op(op, "stablehlo.custom_call", operands, &[], attrs, results)
    }
}
