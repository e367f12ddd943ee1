//! Unit tests on emitted text and on the operand checks.

use super::*;
use crate::error::{Result, TpuError};
use kda_core::DType;

fn f32t(dims: &[i64]) -> TensorType {
    TensorType::new(DType::F32, dims)
}

fn text_of(f: FnBuilder) -> String {
    let mut m = Module::new();
    m.add(f).expect("add");
    m.to_text()
}

#[test]
fn tensor_type_display() {
    assert_eq!(f32t(&[8, 64, 128]).to_string(), "tensor<8x64x128xf32>");
    assert_eq!(TensorType::scalar(DType::F32).to_string(), "tensor<f32>");
    assert_eq!(TensorType::new(DType::U16, &[3]).to_string(), "tensor<3xui16>");
    assert_eq!(TensorType::new(DType::I1, &[2, 0]).to_string(), "tensor<2x0xi1>");
}

#[test]
fn add_and_transpose_text() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[2, 3]))?;
    let y = b.arg(f32t(&[2, 3]))?;
    let s = b.add(x, y)?;
    let t = b.transpose(s, &[1, 0])?;
    b.ret(&[t])?;
    let want = "module {
  func.func public @main(%0: tensor<2x3xf32>, %1: tensor<2x3xf32>) -> (tensor<3x2xf32>) {
    %2 = \"stablehlo.add\"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
    %3 = \"stablehlo.transpose\"(%2) {permutation = array<i64: 1, 0>} : (tensor<2x3xf32>) -> tensor<3x2xf32>
    \"func.return\"(%3) : (tensor<3x2xf32>) -> ()
  }
}
";
    assert_eq!(text_of(b), want);
    Ok(())
}

#[test]
fn constants_are_exact_and_deterministic() -> Result<()> {
    let build = || -> Result<String> {
        let mut b = FnBuilder::new("main", true);
        let c = b.constant_f32(0.01, f32t(&[2]))?;
        let d = b.constant_f32(-1000.0, TensorType::scalar(DType::F32))?;
        let e = b.constant_f32(f32::NEG_INFINITY, TensorType::scalar(DType::BF16))?;
        let f = b.constant_f32(f32::INFINITY, TensorType::scalar(DType::F32))?;
        let i = b.scalar_i32(-3)?;
        b.ret(&[c, d, e, f, i])?;
        Ok(text_of(b))
    };
    let t = build()?;
    assert!(t.contains("{value = dense<1.0e-2> : tensor<2xf32>}"), "{t}");
    assert!(t.contains("dense<-1.0e3> : tensor<f32>"), "{t}");
    assert!(t.contains("dense<0xFF80> : tensor<bf16>"), "{t}");
    assert!(t.contains("dense<0x7F800000> : tensor<f32>"), "{t}");
    assert!(t.contains("dense<-3> : tensor<i32>"), "{t}");
    assert_eq!(t, build()?, "same program, same text");
    Ok(())
}

#[test]
fn dot_general_and_reduce_text() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    b.set_dot_precision(Precision::Highest);
    let x = b.arg(TensorType::new(DType::BF16, &[4, 8, 16]))?;
    let y = b.arg(TensorType::new(DType::BF16, &[4, 16, 2]))?;
    let d = b.dot_general(x, y, &[0], &[0], &[2], &[1], DType::F32)?;
    let r = b.reduce_sum(d, &[1])?;
    b.ret(&[r])?;
    let t = text_of(b);
    assert!(t.contains(
        "\"stablehlo.dot_general\"(%0, %1) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [0], \
         rhs_batching_dimensions = [0], lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>, \
         precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]} : \
         (tensor<4x8x16xbf16>, tensor<4x16x2xbf16>) -> tensor<4x8x2xf32>"
    ), "{t}");
    assert!(t.contains("^bb0(%4: tensor<f32>, %5: tensor<f32>):"), "{t}");
    assert!(
        t.contains("{dimensions = array<i64: 1>} : (tensor<4x8x2xf32>, tensor<f32>) -> tensor<4x2xf32>"),
        "{t}"
    );
    Ok(())
}

#[test]
fn while_text_names_results() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let n = b.arg(TensorType::scalar(DType::I32))?;
    let x = b.arg(f32t(&[3]))?;
    let out = b.for_loop(4, &[x], |b, _i, v| Ok(vec![b.mul(v[0], v[0])?]))?;
    let _ = n;
    b.ret(&out)?;
    let t = text_of(b);
    assert!(t.contains(":2 = \"stablehlo.while\"("), "{t}");
    assert!(t.contains("\"func.return\"(%"), "{t}");
    assert!(t.contains("#1) : (tensor<3xf32>) -> ()"), "{t}");
    Ok(())
}

fn builder_parts(e: &TpuError) -> (&str, &str) {
    match e {
        TpuError::Builder { op, message } => (op, message),
        other => panic!("not a builder error: {other}"),
    }
}

fn assert_err<T: std::fmt::Debug>(r: Result<T>, op: &str, needle: &str) {
    match r {
        Ok(v) => panic!("{op}: expected an error, got {v:?}"),
        Err(e) => {
            let (got_op, message) = builder_parts(&e);
            assert_eq!(got_op, op, "{e}");
            assert!(message.contains(needle), "{op}: message {message:?} lacks {needle:?}");
        }
    }
}

#[test]
fn errors_name_the_op_and_shapes() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[2, 3]))?;
    let y = b.arg(f32t(&[3, 2]))?;
    let i = b.arg(TensorType::new(DType::I32, &[2, 3]))?;
    assert_err(b.add(x, y), "add", "tensor<2x3xf32> vs tensor<3x2xf32>");
    assert_err(b.mul(x, i), "mul", "tensor<2x3xi32>");
    assert_err(b.exp(i), "exp", "element type i32");
    assert_err(b.dot_general(x, x, &[], &[], &[1], &[0], DType::F32), "dot_general", "different sizes");
    assert_err(b.dot_general(x, i, &[], &[], &[1], &[0], DType::F32), "dot_general", "element types");
    assert_err(b.batch_matmul(x, x, Transpose::None), "batch_matmul", "contracting sizes differ");
    assert_err(b.transpose(x, &[0, 0]), "transpose", "[0, 0]");
    assert_err(b.transpose(x, &[0, 1, 2]), "transpose", "permutation");
    assert_err(b.reshape(x, &[4, 2]), "reshape", "tensor<4x2xf32>");
    assert_err(b.broadcast_to(x, &[4, 3, 3]), "broadcast_to", "[4, 3, 3]");
    assert_err(b.mul_bcast(x, y), "mul_bcast", "do not broadcast");
    assert_err(b.slice(x, &[0, 0], &[3, 3], &[1, 1]), "slice", "limit");
    assert_err(b.reduce_sum(x, &[2]), "reduce_sum", "dims [2]");
    assert_err(b.bitcast_convert(x, DType::BF16), "bitcast_convert", "widths differ");
    let p = b.compare(Cmp::Lt, x, x)?;
    assert_err(b.select(p, x, y), "select", "branch types differ");
    assert_err(b.dynamic_slice(x, &[p], &[1, 1]), "dynamic_slice", "1 start indices");
    assert_err(
        b.triangular_solve(
            x,
            x,
            TriangularSolve { left_side: true, lower: true, unit_diagonal: false, transpose_a: false },
        ),
        "triangular_solve",
        "square",
    );
    Ok(())
}

#[test]
fn while_body_type_mismatch_is_an_error() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[3]))?;
    let c = b.scalar_i32(0)?;
    let r = b.while_loop(
        &[c, x],
        |b, a| {
            let n = b.scalar_i32(3)?;
            b.compare(Cmp::Lt, a[0], n)
        },
        |b, a| {
            let y = b.reshape(a[1], &[3, 1])?;
            Ok(vec![a[0], y])
        },
    );
    assert_err(r, "while_loop", "body returned (tensor<i32>, tensor<3x1xf32>)");
    let r = b.while_loop(&[x], |_, a| Ok(a[0]), |_, a| Ok(a.to_vec()));
    assert_err(r, "while_loop", "want tensor<i1>");
    // The builder is still usable after a failed region.
    let y = b.add(x, x)?;
    b.ret(&[y])?;
    Ok(())
}

#[test]
fn run_time_trip_count_must_be_an_i32_scalar() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[3]))?;
    let n = b.arg(TensorType::new(DType::I32, &[2]))?;
    let f = b.arg(f32t(&[]))?;
    let body = |b: &mut FnBuilder, _: Value, v: &[Value]| Ok(vec![b.add(v[0], v[0])?]);
    assert_err(b.for_loop_until(n, &[x], body), "for_loop_until", "want tensor<i32>");
    assert_err(b.for_loop_until(f, &[x], body), "for_loop_until", "want tensor<i32>");
    let m = b.arg(TensorType::new(DType::I32, &[]))?;
    let out = b.for_loop_until(m, &[x], body)?;
    assert_eq!(out[0].ty(), x.ty());
    Ok(())
}

#[test]
fn scoping_and_function_errors() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[3]))?;
    let mut leaked = None;
    b.for_loop(2, &[x], |b, _, v| {
        let y = b.add(v[0], x)?;
        leaked = Some(y);
        Ok(vec![y])
    })?;
    let leaked = leaked.expect("the body ran");
    assert_err(b.add(leaked, x), "add", "region that is closed");
    let mut other = FnBuilder::new("other", false);
    let o = other.arg(f32t(&[3]))?;
    assert_err(b.add(o, x), "add", "another function");
    let mut m = Module::new();
    assert_err(m.add(FnBuilder::new("noret", true)), "module_add", "no `ret`");
    let mut c = FnBuilder::new("caller", true);
    let a = c.arg(f32t(&[3]))?;
    let r = c.call("missing", &[a], &[f32t(&[3])])?;
    c.ret(&r)?;
    assert_err(m.add(c), "call", "not in the module");
    assert_err(b.ret(&[x, x]).and_then(|_| b.ret(&[x])), "ret", "already returned");
    Ok(())
}

#[test]
fn barrier_text_returns_every_value() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[2]))?;
    let y = b.arg(f32t(&[3]))?;
    let out = b.barrier(&[x, y])?;
    assert_eq!(out.iter().map(|v| v.dims().to_vec()).collect::<Vec<_>>(), vec![vec![2], vec![3]]);
    b.ret(&out)?;
    let t = text_of(b);
    assert!(
        t.contains("%2:2 = \"stablehlo.optimization_barrier\"(%0, %1) : (tensor<2xf32>, tensor<3xf32>) -> (tensor<2xf32>, tensor<3xf32>)"),
        "{t}"
    );
    assert!(t.contains("\"func.return\"(%2#0, %2#1)"), "{t}");
    Ok(())
}

#[test]
fn barrier_of_nothing_is_an_error() {
    let mut b = FnBuilder::new("main", true);
    assert_err(b.barrier(&[]), "barrier", "no values");
}

#[test]
fn scratch_buffers_get_distinct_fills() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let s1 = b.scratch_f32(&[4, 2])?;
    let s2 = b.scratch_f32(&[4, 2])?;
    b.ret(&[s1, s2])?;
    let t = text_of(b);
    assert!(t.contains("dense<1.0e0> : tensor<4x2xf32>"), "{t}");
    assert!(t.contains("dense<2.0e0> : tensor<4x2xf32>"), "{t}");
    Ok(())
}
