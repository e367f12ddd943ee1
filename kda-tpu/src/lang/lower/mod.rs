//! The lowerings: one module each behind one trait, [`Lower`]. A lowering checks what it can
//! lower, writes its text of a kernel, makes the call of that text from a StableHLO function,
//! and explains a compile error of its text. The core language ([`Kernel`], its body, a call)
//! names no target; what a target needs of a kernel (Mosaic's scoped VMEM, Triton's warps) is a
//! parameter type of its lowering that the kernel carries ([`crate::lang::KernelBuilder::params`]).
//!
//! A lowering outside this crate implements the same trait. This one lowers through the
//! interpret lowering and counts the kernels it lowered:
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use kda_tpu::hlo::{FnBuilder, TensorType, Value};
//! use kda_tpu::lang::{Interpret, Kernel, KernelBuilder, Lower, Operand, Semantics};
//!
//! #[derive(Debug, Default)]
//! struct Counting(AtomicUsize);
//!
//! impl Lower for Counting {
//!     fn name(&self) -> &str {
//!         "counting"
//!     }
//!     fn check(&self, kernel: &Kernel) -> kda_tpu::Result<()> {
//!         Interpret::default().check(kernel)
//!     }
//!     fn text(&self, kernel: &Kernel) -> kda_tpu::Result<String> {
//!         kernel.module(self)
//!     }
//!     fn call(&self, kernel: &Kernel, f: &mut FnBuilder, operands: &[Value]) -> kda_tpu::Result<Vec<Value>> {
//!         self.0.fetch_add(1, Ordering::Relaxed);
//!         Interpret::default().call(kernel, f, operands)
//!     }
//! }
//!
//! let mut k = KernelBuilder::new("ones");
//! k.grid(2, Semantics::Parallel);
//! let o = k.output(Operand::whole("o", TensorType::new(kda_core::DType::F32, &[8, 128])));
//! let kernel = k.build(|b| {
//!     let one = b.splat(1.0, kda_core::DType::F32, &[8, 128])?;
//!     b.store_all(o, &one)
//! })?;
//! let lowering = Counting::default();
//! let text = kernel.module(&lowering)?;
//! assert!(text.contains("func.func public @main"));
//! assert_eq!(lowering.0.load(Ordering::Relaxed), 1);
//! # Ok::<(), kda_tpu::TpuError>(())
//! ```

mod arith;
pub mod interpret;
pub mod mosaic;
pub mod renamed;
pub mod triton;

use super::kernel::Kernel;
pub use super::kernel::Lower;
use crate::error::{Result, TpuError};
use crate::hlo::{FnBuilder, TensorType, Value};

pub use interpret::{Interpret, InterpretParams, Numerics};
pub use mosaic::{Mosaic, MosaicParams, Schedule, Tiling};
pub use triton::{F32Dot, Feature, Triton, TritonParams};

/// The built-in lowerings by name, each with its default parameters: what an implementation
/// of the KDA op picks its kernels' lowering from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lowering {
    /// [`Mosaic`]: a `tpu_custom_call` holding the Mosaic text, for libtpu.
    Mosaic,
    /// [`Interpret`]: plain StableHLO, for any plugin.
    Interpret,
    /// [`Triton`]: a `__gpu$xla.gpu.triton` custom call holding the Triton IR text.
    Triton,
    /// [`Interpret`] with a GPU's numerics under Triton ([`Interpret::TRITON_NUMERICS`]): the
    /// GPU kernels checked on any plugin.
    TritonInterpret,
}

static MOSAIC: Mosaic = Mosaic;
static TRITON: Triton = Triton;
static INTERPRET: Interpret = Interpret::MOSAIC_NUMERICS;
static TRITON_INTERPRET: Interpret = Interpret::TRITON_NUMERICS;

impl Lowering {
    /// The lowering itself.
    pub fn get(self) -> &'static dyn Lower {
        match self {
            Lowering::Mosaic => &MOSAIC,
            Lowering::Interpret => &INTERPRET,
            Lowering::Triton => &TRITON,
            Lowering::TritonInterpret => &TRITON_INTERPRET,
        }
    }
}

impl Lower for Lowering {
    fn name(&self) -> &str {
        self.get().name()
    }
    fn check(&self, kernel: &Kernel) -> Result<()> {
        self.get().check(kernel)
    }
    fn text(&self, kernel: &Kernel) -> Result<String> {
        self.get().text(kernel)
    }
    fn call(&self, kernel: &Kernel, f: &mut FnBuilder, operands: &[Value]) -> Result<Vec<Value>> {
        self.get().call(kernel, f, operands)
    }
    fn explain(&self, kernel: &Kernel, error: TpuError) -> TpuError {
        self.get().explain(kernel, error)
    }
}

/// The `Unsupported` error of `lowering` refusing `kernel` for `why`.
pub(crate) fn refuse(lowering: &dyn Lower, kernel: &Kernel, why: impl Into<String>) -> TpuError {
    TpuError::unsupported(format!("{} lowering of kernel {}", lowering.name(), kernel.name()), why)
}

/// A compile error of `kernel`'s text `text` in a lowering, with the line the message locates
/// as `MARKER LINE:COL` quoted after `what` (the body, the TTIR); the error as it came when there
/// is no such line.
pub(crate) fn quoted_error(
    error: TpuError,
    kernel: &Kernel,
    text: Option<String>,
    marker: &str,
    what: &str,
) -> TpuError {
    let TpuError::Compile { message } = error else { return error };
    match text.and_then(|text| quote_line(&text, &message, marker)) {
        Some(line) => {
            TpuError::Compile { message: format!("{message}\n  kernel {} {what}{line}", kernel.name()) }
        }
        None => TpuError::Compile { message },
    }
}

/// The line of `body` that `message` locates as `MARKER LINE:COL` (Mosaic's `loc("-":`,
/// Triton's `-:`), with its number.
pub fn quote_line(body: &str, message: &str, marker: &str) -> Option<String> {
    let at = message.find(marker)? + marker.len();
    let line: usize = message[at..].split(':').next()?.parse().ok()?;
    let text = body.lines().nth(line.checked_sub(1)?)?;
    Some(format!("line {line}: {}", text.trim()))
}

/// The row-major `operand_layouts` and `result_layouts` of a custom call of `kernel` on
/// `operands` (checked against the kernel's operand types; `what` names the lowering).
pub(crate) fn custom_call_layouts(
    kernel: &Kernel,
    what: &str,
    operands: &[Value],
) -> Result<(String, String)> {
    let want = kernel.operand_types();
    let got: Vec<TensorType> = operands.iter().map(Value::ty).collect();
    if got != want {
        return Err(TpuError::builder(
            format!("{what} call {}", kernel.name()),
            format!("operands {got:?}, the kernel takes {want:?}"),
        ));
    }
    let layout = |t: &TensorType| {
        let r = t.dims.len();
        let order: Vec<String> = (0..r).rev().map(|d| d.to_string()).collect();
        match r {
            1 => "dense<0> : tensor<1xindex>".to_string(),
            _ => format!("dense<[{}]> : tensor<{r}xindex>", order.join(", ")),
        }
    };
    let all = |ts: &[TensorType]| ts.iter().map(layout).collect::<Vec<_>>().join(", ");
    Ok((all(&want), all(&kernel.result_types())))
}
