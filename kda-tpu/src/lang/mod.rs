//! The kernel language: kernels written once in Rust, in the spirit of Pallas, and lowered
//! either way. Nothing in it is KDA's (the KDA kernels are `crate::op::tpu_kernels`).
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
mod mosaic;

pub use body::{Binary, Body, MatPrecision, Offset, Reduction, Ref, Unary, V};
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
    use super::{Binary, Index, KernelBuilder, Operand, Ref, Semantics, V};
    use crate::hlo::TensorType;
    use kda_core::DType;

    fn kernel(body: impl FnOnce(&mut super::Body) -> crate::Result<()>) -> crate::Result<super::Kernel> {
        KernelBuilder::new("k")
            .grid(2, Semantics::Parallel)
            .output(Operand::whole("o", TensorType::new(DType::F32, &[8, 128])))
            .build(body)
    }

    #[rstest::rstest]
    #[case::i1_scalar(DType::I1, &[8, 128])]
    #[case::to_a_scalar(DType::I32, &[])]
    #[case::to_a_zero_dim(DType::I32, &[0, 128])]
    fn scalar_broadcasts_follow_the_rule(#[case] dtype: DType, #[case] dims: &'static [i64]) {
        let err = kernel(|b| {
            let i = b.program_id(0)?;
            let s = if dtype == DType::I1 {
                let z = b.index(0)?;
                b.compare(crate::hlo::Cmp::Eq, &i, &z)?
            } else {
                i
            };
            b.broadcast(&s, dims).map(|_| ())
        })
        .expect_err("refused");
        assert!(err.to_string().contains("broadcast"), "{err}");
    }

    #[test]
    fn i32_splats_hold_integers() {
        let err = kernel(|b| b.splat(3e9, DType::I32, &[8, 128]).map(|_| ())).expect_err("too large");
        assert!(err.to_string().contains("is not an i32"), "{err}");
        assert!(kernel(|b| b.splat(0.5, DType::I32, &[8, 128]).map(|_| ())).is_err());
        assert!(kernel(|b| b.splat(-7.0, DType::I32, &[8, 128]).map(|_| ())).is_ok());
    }

    #[test]
    fn values_stay_in_their_body_and_region() {
        let mut stolen: Option<V> = None;
        kernel(|b| {
            stolen = Some(b.splat(1.0, DType::F32, &[8, 128])?);
            Ok(())
        })
        .expect("a kernel");
        let other = kernel(|b| b.store_all(Ref::Output(0), stolen.as_ref().expect("value")))
            .expect_err("another body");
        assert!(other.to_string().contains("not visible"), "{other}");
        let escaped = kernel(|b| {
            let i = b.program_id(0)?;
            let z = b.index(0)?;
            let c = b.compare(crate::hlo::Cmp::Eq, &i, &z)?;
            let mut inner = None;
            b.when(&c, |b| {
                inner = Some(b.splat(2.0, DType::F32, &[8, 128])?);
                Ok(())
            })?;
            let v = inner.expect("value");
            b.binary(Binary::Add, &v, &v).map(|_| ())
        })
        .expect_err("a value from a closed region");
        assert!(escaped.to_string().contains("not visible"), "{escaped}");
    }

    #[test]
    fn grid_indices_stay_inside_the_array() {
        let err = KernelBuilder::new("k")
            .grid(8, Semantics::Parallel)
            .output(Operand::blocked(
                "o",
                TensorType::new(DType::F32, &[448, 128]),
                &[64, 128],
                vec![Index::Grid(0), Index::Const(0)],
            ))
            .build(|_| Ok(()))
            .expect_err("8 steps over 7 blocks");
        assert!(err.to_string().contains("block index 0..=7 of dim 0: 7 blocks"), "{err}");
    }

    #[test]
    fn a_located_error_quotes_its_body_line() {
        let body = "module @k {\n  func.func @k() {\n    %0 = bad.op\n  }\n}\n";
        let got = super::quote_line(body, "error: loc(\"-\":3:10): unknown op");
        assert_eq!(got.as_deref(), Some("line 3: %0 = bad.op"));
        assert_eq!(super::quote_line(body, "no location"), None);
        assert_eq!(super::quote_line(body, "loc(\"-\":99:1)"), None);
    }
}
