//! The kernel language: kernels written once in Rust, in the spirit of Pallas, and lowered
//! either way. Nothing in it is KDA's (the KDA kernels are `crate::op::tpu_kernels`).
//!
//! A [`KernelBuilder`] takes a grid (each axis [`Semantics::Parallel`] or
//! [`Semantics::Arbitrary`]), scalar-prefetch tables, operands and results cut into blocks by
//! [`Index`] maps, and VMEM scratch kept across grid steps; its body is built op by op on a
//! [`Body`], which checks every op's shapes and dtypes. The checked [`Kernel`] then lowers
//! either way:
//!
//! - [`Lowering::Mosaic`]: the Mosaic MLIR text ([`Kernel::mosaic_text`]) inside a
//!   `tpu_custom_call` of a StableHLO function, which libtpu compiles for a TPU;
//! - [`Lowering::Interpret`]: plain StableHLO (the grid as loops, blocks as dynamic slices,
//!   scratch carried), which any plugin runs; on the CPU plugin it checks the kernel against
//!   a host computation.
//!
//! Every part a builder adds returns its handle: a [`Table`] for a scalar-prefetch table, a
//! [`Ref`] for an input, a result or a scratch buffer. The body reads and writes through
//! these; a call binds its operands to them ([`Kernel::bindings`], [`Kernel::call`]) and reads
//! its results by them ([`Returned::get`]). A handle is only ever made by its builder:
//!
//! ```compile_fail
//! // No way to name an operand by its position.
//! let r = kda_tpu::lang::Ref::Input(0);
//! ```
//!
//! What the CPU verifies is the interpret lowering of the same ops libtpu compiles; only a TPU
//! run verifies the Mosaic lowering's numbers.

mod body;
mod call;
mod interpret;
mod kernel;
mod mosaic;

pub use body::{Binary, Body, MatPrecision, Offset, Reduction, Ref, Table, Unary, V};
pub use call::{Bindings, Returned};
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
        let outs = self.call_lowered(&mut f, lowering, &args)?;
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
    use super::{Binary, Index, KernelBuilder, Lowering, Operand, Ref, Semantics, V};
    use crate::hlo::TensorType;
    use kda_core::DType;

    /// A two-step kernel of one `[8, 128]` f32 result, running `body` on it.
    fn kernel(body: impl FnOnce(&mut super::Body, Ref) -> crate::Result<()>) -> crate::Result<super::Kernel> {
        let mut k = KernelBuilder::new("k");
        k.grid(2, Semantics::Parallel);
        let o = k.output(Operand::whole("o", TensorType::new(DType::F32, &[8, 128])));
        k.build(|b| body(b, o))
    }

    #[rstest::rstest]
    #[case::i1_scalar(DType::I1, &[8, 128])]
    #[case::to_a_scalar(DType::I32, &[])]
    #[case::to_a_zero_dim(DType::I32, &[0, 128])]
    fn scalar_broadcasts_follow_the_rule(#[case] dtype: DType, #[case] dims: &'static [i64]) {
        let err = kernel(|b, _| {
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
        let err = kernel(|b, _| b.splat(3e9, DType::I32, &[8, 128]).map(|_| ())).expect_err("too large");
        assert!(err.to_string().contains("is not an i32"), "{err}");
        assert!(kernel(|b, _| b.splat(0.5, DType::I32, &[8, 128]).map(|_| ())).is_err());
        assert!(kernel(|b, _| b.splat(-7.0, DType::I32, &[8, 128]).map(|_| ())).is_ok());
    }

    #[test]
    fn values_stay_in_their_body_and_region() {
        let mut stolen: Option<V> = None;
        kernel(|b, _| {
            stolen = Some(b.splat(1.0, DType::F32, &[8, 128])?);
            Ok(())
        })
        .expect("a kernel");
        let other = kernel(|b, o| b.store_all(o, stolen.as_ref().expect("value"))).expect_err("another body");
        assert!(other.to_string().contains("not visible"), "{other}");
        let escaped = kernel(|b, _| {
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
        let mut k = KernelBuilder::new("k");
        k.grid(8, Semantics::Parallel);
        let rows = vec![Index::Grid(0), Index::Const(0)];
        k.output(Operand::blocked("o", TensorType::new(DType::F32, &[448, 128]), &[64, 128], rows));
        let err = k.build(|_| Ok(())).expect_err("8 steps over 7 blocks");
        assert!(err.to_string().contains("block index 0..=7 of dim 0: 7 blocks"), "{err}");
    }

    #[test]
    fn handles_belong_to_their_kernel() {
        let ty = TensorType::new(DType::F32, &[8, 128]);
        let mut other = KernelBuilder::new("other");
        other.grid(1, Semantics::Parallel);
        let (foreign_table, foreign) = (other.table("t", 4), other.output(Operand::whole("o", ty.clone())));
        let store = kernel(|b, _| {
            let z = b.splat(0.0, DType::F32, &[8, 128])?;
            b.store_all(foreign, &z)
        })
        .expect_err("another kernel's result");
        assert!(store.to_string().contains("not a reference of the kernel"), "{store}");
        let read = kernel(|b, _| {
            let i = b.index(0)?;
            b.read_table(foreign_table, &i).map(|_| ())
        })
        .expect_err("another kernel's table");
        assert!(read.to_string().contains("must be this kernel's"), "{read}");
        let mut k = KernelBuilder::new("k");
        k.grid(1, Semantics::Parallel);
        k.table("mine", 4);
        let rows = vec![Index::table(foreign_table, Index::Grid(0)), Index::Const(0)];
        k.output(Operand::blocked("o", TensorType::new(DType::F32, &[32, 128]), &[8, 128], rows));
        let map = k.build(|_| Ok(())).expect_err("an index reading another kernel's table");
        assert!(map.to_string().contains("grid axis or table the kernel lacks"), "{map}");
    }

    #[test]
    fn a_call_binds_each_operand_once() -> crate::Result<()> {
        let ty = TensorType::new(DType::F32, &[8, 128]);
        let mut k = KernelBuilder::new("k");
        k.grid(1, Semantics::Parallel);
        let (x, o) = (k.input(Operand::whole("x", ty.clone())), k.output(Operand::whole("o", ty.clone())));
        let kernel = k.build(|b| {
            let v = b.load_all(x)?;
            b.store_all(o, &v)
        })?;
        let mut f = crate::hlo::FnBuilder::new("main", true);
        let arg = f.arg(ty)?;
        let unbound = kernel.call(&mut f, Lowering::Interpret, kernel.bindings()).expect_err("x unbound");
        assert!(unbound.to_string().contains("`x` is not bound"), "{unbound}");
        let mut args = kernel.bindings();
        assert!(args.input(o, arg).is_err(), "a result is not an input");
        args.input(x, arg)?;
        let twice = args.input(x, arg).expect_err("bound twice");
        assert!(twice.to_string().contains("bound twice"), "{twice}");
        let outs = kernel.call(&mut f, Lowering::Interpret, args)?;
        assert!(outs.get(x).is_err(), "an input is not a result");
        assert_eq!(outs.get(o)?.ty(), TensorType::new(DType::F32, &[8, 128]));
        Ok(())
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
