//! Mosaic TPU kernels from Rust: a kernel layer in the spirit of Pallas TPU with two lowerings
//! of one definition.
//!
//! A [`KernelBuilder`] takes a grid (each axis [`Semantics::Parallel`] or
//! [`Semantics::Arbitrary`]), scalar-prefetch tables, operands and results cut into blocks by
//! [`Index`] maps, and VMEM scratch kept across grid steps; its body is built op by op on a
//! [`Body`], which checks every op's shapes and dtypes. The checked [`Kernel`] then lowers
//! either way:
//!
//! - [`Kernel::call_mosaic`]: the Mosaic MLIR text ([`Kernel::mosaic_text`]) inside a
//!   `tpu_custom_call` of a StableHLO function, which libtpu compiles for a TPU;
//! - [`Kernel::call_interpret`]: plain StableHLO (the grid as loops, blocks as dynamic slices,
//!   scratch carried), which any plugin runs; on the CPU plugin it checks the kernel against
//!   a host computation.
//!
//! What the CPU verifies is the interpret lowering of the same ops libtpu compiles; only a TPU
//! run verifies the Mosaic lowering's numbers.

mod body;
mod interpret;
mod kernel;
mod text;

pub use body::{Binary, Body, MatPrecision, Offset, Reduction, Ref, Unary, VType, V};
pub use kernel::{Cost, Index, Kernel, KernelBuilder, Operand, Semantics};

use crate::error::{Result, TpuError};
use crate::hlo::{FnBuilder, Module};

/// How a kernel is lowered: to Mosaic (for libtpu) or to plain StableHLO (any plugin).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lowering {
    /// A `tpu_custom_call` holding the Mosaic text.
    Mosaic,
    /// The interpret lowering.
    Interpret,
}

impl Kernel {
    /// A module whose public `@main` takes the kernel's operands (tables, then inputs) and
    /// returns its results, lowered as `lowering` says.
    pub fn module(&self, lowering: Lowering) -> Result<String> {
        let mut f = FnBuilder::new("main", true);
        let args = self.operand_types().into_iter().map(|t| f.arg(t)).collect::<Result<Vec<_>>>()?;
        let outs = match lowering {
            Lowering::Mosaic => self.call_mosaic(&mut f, &args)?,
            Lowering::Interpret => self.call_interpret(&mut f, &args)?,
        };
        f.ret(&outs)?;
        let mut m = Module::new();
        m.add(f)?;
        Ok(m.to_text())
    }

    /// A compile error of this kernel's Mosaic module with the body line the compiler points
    /// at (`loc("-":LINE:COL)`) quoted, so the message shows the op libtpu refused.
    pub fn explain(&self, e: TpuError) -> TpuError {
        let TpuError::Compile { message } = e else { return e };
        let quoted = self.mosaic_text().ok().and_then(|text| quote_line(&text, &message));
        match quoted {
            Some(line) => {
                TpuError::Compile { message: format!("{message}\n  kernel {} body: {line}", self.name) }
            }
            None => TpuError::Compile { message },
        }
    }
}

/// The line of `body` that `message` locates as `loc("-":LINE:COL)`, with its number.
pub fn quote_line(body: &str, message: &str) -> Option<String> {
    let at = message.find("loc(\"-\":")? + "loc(\"-\":".len();
    let line: usize = message[at..].split(':').next()?.parse().ok()?;
    let text = body.lines().nth(line.checked_sub(1)?)?;
    Some(format!("line {line}: {}", text.trim()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_located_error_quotes_its_body_line() {
        let body = "module @k {\n  func.func @k() {\n    %0 = bad.op\n  }\n}\n";
        let got = super::quote_line(body, "error: loc(\"-\":3:10): unknown op");
        assert_eq!(got.as_deref(), Some("line 3: %0 = bad.op"));
        assert_eq!(super::quote_line(body, "no location"), None);
        assert_eq!(super::quote_line(body, "loc(\"-\":99:1)"), None);
    }
}
