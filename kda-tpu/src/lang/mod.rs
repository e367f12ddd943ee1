//! The kernel language: kernels written once in Rust, in the spirit of Pallas, and lowered
//! several ways. Nothing in it is KDA's (the KDA kernels are `crate::op::tpu_kernels`), and
//! its core names no target.
//!
//! A [`KernelBuilder`] takes a grid (each axis [`Semantics::Parallel`] or
//! [`Semantics::Arbitrary`]), scalar-prefetch tables, operands and results cut into blocks by
//! [`Index`] maps, scratch buffers kept across grid steps, and the parameters of any lowering
//! ([`KernelBuilder::params`]); its body is built op by op on a [`Body`], which checks every
//! op's shapes and dtypes. The checked [`Kernel`] then lowers through any [`Lower`]
//! ([`Kernel::module`], [`Kernel::call`]); the built-in ones ([`lower`], [`Lowering`]):
//!
//! - [`Mosaic`]: the Mosaic MLIR text inside a `tpu_custom_call` of a StableHLO function, which
//!   libtpu compiles for a TPU ([`MosaicParams`]: scoped VMEM, tiling rule, op order);
//! - [`Interpret`]: plain StableHLO (the grid as loops, blocks as dynamic slices, scratch
//!   carried), which any plugin runs; on the CPU plugin it checks the kernel against a host
//!   computation, with the numerics its [`InterpretParams`] state;
//! - [`Triton`]: Triton IR text inside a `__gpu$xla.gpu.triton` custom call, which XLA's CUDA
//!   plugin compiles for an NVIDIA GPU (parallel axes as program ids, arbitrary ones as loops,
//!   scratch as values; [`TritonParams`]: warps, stages, f32 products).
//!
//! Each lowering refuses what it has no form for in its own [`Lower::check`], naming itself.
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
//! What the CPU verifies is the interpret lowering of the same ops libtpu and the CUDA plugin
//! compile; only a TPU run verifies the Mosaic lowering's numbers, a GPU run the Triton one's.

mod body;
mod call;
mod ir;
mod kernel;
pub mod lower;
pub mod work;

pub use body::Body;
pub use call::{Bindings, Returned};
pub use ir::{Binary, MatPrecision, Offset, OpKind, Reduction, Ref, Scan, Table, Unary, V};
pub use kernel::{Cost, Index, Kernel, KernelBuilder, Operand, Semantics};
pub use lower::renamed::*;
pub use lower::{
    quote_line, F32Dot, Feature, Interpret, InterpretParams, Lower, Lowering, Mosaic, MosaicParams, Numerics,
    Schedule, Tiling, Triton, TritonParams,
};

#[cfg(test)]
mod tests {
    use super::{
        Feature, Index, KernelBuilder, Lower, Lowering, Operand, Ref, Semantics, Triton, TritonParams, V,
    };
    use crate::hlo::TensorType;
    use kda_core::DType;

    /// A two-step kernel of one `[8, 128]` f32 result, running `body` on it.
    fn kernel<F: FnOnce(&mut super::Body, Ref) -> crate::Result<()>>(
        body: F,
    ) -> crate::Result<super::Kernel> {
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

    /// The operators stretch a side's size-1 dims to the other's (a `Broadcast` before the
    /// op) and refuse dims that neither equal nor stretch.
    #[test]
    fn operators_broadcast_size_one_dims() -> crate::Result<()> {
        let k = kernel(|b, o| {
            let x = b.splat(2.0, DType::F32, &[8, 128])?;
            let (col, row) = (b.splat(3.0, DType::F32, &[8, 1])?, b.splat(1.0, DType::F32, &[1, 128])?);
            let y = b.mul(&x, &col)?;
            let z = b.add(&row, &y)?;
            assert_eq!((y.ty.dims.as_slice(), z.ty.dims.as_slice()), (&[8, 128][..], &[8, 128][..]));
            let other = b.splat(1.0, DType::F32, &[4, 128])?;
            let e = b.sub(&z, &other).expect_err("4 rows against 8");
            assert!(e.to_string().contains("Sub"), "{e}");
            b.store_all(o, &z)
        })?;
        let mut kinds = Vec::new();
        k.walk(&mut |kind| kinds.push(kind));
        use super::OpKind::{Binary as B, Broadcast as Br, Splat as S, Store as St};
        assert_eq!(kinds, [S, S, S, Br, B, Br, B, S, St]);
        Ok(())
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
            b.add(&v, &v).map(|_| ())
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
        let unbound = kernel.call(&mut f, &Lowering::Interpret, kernel.bindings()).expect_err("x unbound");
        assert!(unbound.to_string().contains("`x` is not bound"), "{unbound}");
        let mut args = kernel.bindings();
        assert!(args.input(o, arg).is_err(), "a result is not an input");
        args.input(x, arg)?;
        let twice = args.input(x, arg).expect_err("bound twice");
        assert!(twice.to_string().contains("bound twice"), "{twice}");
        let outs = kernel.call(&mut f, &Lowering::Interpret, args)?;
        assert!(outs.get(x).is_err(), "an input is not a result");
        assert_eq!(outs.get(o)?.ty(), TensorType::new(DType::F32, &[8, 128]));
        Ok(())
    }

    /// A one-step kernel of an `[8, 128]` f32 input and result and an `[8, 128]` scratch,
    /// with `grid` parallel axes, running `body` on (input, result, scratch).
    fn triton_kernel(
        grid: &[i64],
        body: impl FnOnce(&mut super::Body, Ref, Ref, Ref) -> crate::Result<()>,
    ) -> crate::Result<super::Kernel> {
        let ty = TensorType::new(DType::F32, &[8, 128]);
        let mut k = KernelBuilder::new("k");
        for &n in grid {
            k.grid(n, Semantics::Parallel);
        }
        let (x, o) = (k.input(Operand::whole("x", ty.clone())), k.output(Operand::whole("o", ty.clone())));
        let s = k.scratch("s", ty);
        k.build(|b| body(b, x, o, s))
    }

    #[rstest::rstest]
    #[case::scratch_window(Feature::ScratchWindow, &[1])]
    #[case::result_read(Feature::ResultRead, &[1])]
    #[case::input_write(Feature::InputWrite, &[1])]
    #[case::padded_reshape(Feature::PaddedReshape, &[1])]
    #[case::unaligned_slice(Feature::UnalignedPart, &[1])]
    #[case::four_parallel_axes(Feature::WideGrid, &[1, 1, 1, 1])]
    #[case::tall_second_axis(Feature::WideGrid, &[1, 65_536])]
    #[case::reverse_segmented_scan(Feature::ReverseSegmentedScan, &[1])]
    fn triton_refuses_what_it_has_no_form_for(
        #[case] feature: Feature,
        #[case] grid: &[i64],
    ) -> crate::Result<()> {
        let kernel = triton_kernel(grid, |b, x, o, s| {
            let v = b.load_all(x)?;
            match feature {
                Feature::ScratchWindow => {
                    let half = b.slice(&v, &[0, 0], &[4, 128])?;
                    b.store(s, &[super::Offset::Const(4), super::Offset::Const(0)], &half)?;
                }
                Feature::ResultRead => {
                    b.store_all(o, &v)?;
                    let back = b.load_all(o)?;
                    b.store_all(s, &back)?;
                }
                Feature::InputWrite => b.store_all(x, &v)?,
                Feature::PaddedReshape => {
                    let zero = super::Offset::Const(0);
                    let part = b.load(x, &[zero.clone(), zero], &[8, 96])?;
                    b.reshape(&part, &[96, 8])?;
                }
                Feature::UnalignedPart => {
                    b.slice(&v, &[0, 32], &[8, 64])?;
                }
                Feature::ReverseSegmentedScan => {
                    let z = b.splat(0.0, DType::F32, &[8, 128])?;
                    let starts = b.compare(crate::hlo::Cmp::Eq, &v, &z)?;
                    let scan = super::Scan { reverse: true, exclusive: false };
                    b.cumsum(&v, 1, scan, Some(&starts))?;
                }
                Feature::WideGrid | Feature::HugeArray => {}
            }
            b.store_all(o, &v)
        })?;
        assert_eq!(super::lower::triton::features(&kernel).first().map(|f| f.0), Some(feature));
        let e = kernel.module(&Triton).expect_err("refused");
        assert!(matches!(e, crate::TpuError::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains(feature.describe()), "{e}");
        assert!(e.to_string().contains("triton lowering of kernel k"), "{e}");
        kernel.module(&Lowering::Interpret)?;
        Ok(())
    }

    #[test]
    fn triton_refuses_arrays_past_i32_offsets() -> crate::Result<()> {
        let mut k = KernelBuilder::new("huge");
        k.grid(1 << 16, Semantics::Parallel);
        let rows = vec![Index::Grid(0), Index::Const(0)];
        k.output(Operand::blocked("o", TensorType::new(DType::BF16, &[1 << 23, 256]), &[128, 256], rows));
        let kernel = k.build(|_| Ok(()))?;
        let e = Triton.check(&kernel).expect_err("2^31 elements");
        assert!(e.to_string().contains(Feature::HugeArray.describe()), "{e}");
        Ok(())
    }

    #[rstest::rstest]
    #[case::three_warps(3, 2)]
    #[case::no_stages(4, 0)]
    #[case::six_stages(4, 6)]
    fn gpu_launches_take_what_the_plugin_takes(#[case] num_warps: u32, #[case] num_stages: u32) {
        let e = TritonParams::new(num_warps, num_stages).expect_err("refused");
        assert!(e.to_string().contains("warps 1, 2, 4, 8, 16 or 32, stages 1 to 5"), "{e}");
        // Set on a kernel without the constructor, the Triton lowering refuses it by name.
        let mut k = KernelBuilder::new("k");
        k.grid(1, Semantics::Parallel).params(TritonParams {
            num_warps,
            num_stages,
            ..TritonParams::default()
        });
        k.output(Operand::whole("o", TensorType::new(DType::F32, &[8, 128])));
        let kernel = k.build(|_| Ok(())).expect("the language takes any parameters");
        let e = kernel.module(&Triton).expect_err("refused");
        assert!(e.to_string().contains("triton lowering of kernel k"), "{e}");
        assert!(kernel.module(&Lowering::Interpret).is_ok(), "other lowerings ignore them");
    }

    #[test]
    fn triton_text_has_one_pointer_per_buffer() -> crate::Result<()> {
        let kernel = triton_kernel(&[2, 3], |b, x, o, s| {
            let v = b.load_all(x)?;
            b.store_all(s, &v)?;
            let w = b.load_all(s)?;
            b.store_all(o, &w)
        })?;
        let text = Triton.text(&kernel)?;
        let signature = text.lines().find(|l| l.contains("tt.func public @k(")).expect("the kernel function");
        assert_eq!(signature.matches("!tt.ptr<f32>").count(), 2, "{signature}");
        assert!(text.contains("tt.get_program_id y : i32"), "two parallel axes: x and y");
        assert_eq!(super::lower::triton::launch_grid(&kernel), [2, 3, 1]);
        Ok(())
    }

    #[test]
    fn a_triton_error_quotes_its_ttir_line() -> crate::Result<()> {
        let kernel = triton_kernel(&[1], |b, x, o, _| {
            let v = b.load_all(x)?;
            b.store_all(o, &v)
        })?;
        let e = crate::TpuError::Compile {
            message: "Failed to parse Triton module: -:2:5: error: expected '->'\ninput ir: \"module {..."
                .into(),
        };
        let explained = Triton.explain(&kernel, e).to_string();
        assert!(explained.contains("TTIR line 2: tt.func public @k("), "{explained}");
        assert!(!explained.contains("input ir"), "the module text is cut: {explained}");
        Ok(())
    }

    #[test]
    fn a_located_error_quotes_its_body_line() {
        let body = "module @k {\n  func.func @k() {\n    %0 = bad.op\n  }\n}\n";
        let mosaic = "loc(\"-\":";
        let got = super::quote_line(body, "error: loc(\"-\":3:10): unknown op", mosaic);
        assert_eq!(got.as_deref(), Some("line 3: %0 = bad.op"));
        assert_eq!(super::quote_line(body, "no location", mosaic), None);
        assert_eq!(super::quote_line(body, "loc(\"-\":99:1)", mosaic), None);
    }
}
