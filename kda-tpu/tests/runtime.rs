//! The PJRT runtime on the setup's CPU plugin, and deviceless TPU compiles with the setup's libtpu.
//! Needs `cargo xtask setup` (plugins under `<workspace>/.kda` or `$KDA_HOME`).

use std::rc::Rc;

use half::bf16;
use kda_core::{DType, ErrorKind, KdaError};
use kda_tpu::{CompileOptions, Runtime, TpuCompiler, TpuError, XlaOption, DEFAULT_TOPOLOGY};
use rstest::rstest;

const MATMUL: &str = r#"
func.func public @main(%a: tensor<2x3xf32>, %b: tensor<3x2xf32>) -> tensor<2x2xf32> {
  %d = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x3xf32>, tensor<3x2xf32>) -> tensor<2x2xf32>
  return %d : tensor<2x2xf32>
}
"#;

const BF16_SCALE: &str = r#"
func.func public @main(%x: tensor<4x8xbf16>) -> (tensor<4x8xbf16>, tensor<4x8xf32>) {
  %h = stablehlo.constant dense<5.000000e-01> : tensor<4x8xbf16>
  %y = stablehlo.multiply %x, %h : tensor<4x8xbf16>
  %f = stablehlo.convert %x : (tensor<4x8xbf16>) -> tensor<4x8xf32>
  %two = stablehlo.constant dense<2.000000e+00> : tensor<4x8xf32>
  %z = stablehlo.multiply %f, %two : tensor<4x8xf32>
  return %y, %z : tensor<4x8xbf16>, tensor<4x8xf32>
}
"#;

const I32_AXPY: &str = r#"
func.func public @main(%v: tensor<5xi32>, %s: tensor<i32>) -> tensor<5xi32> {
  %b = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<i32>) -> tensor<5xi32>
  %m = stablehlo.multiply %v, %b : tensor<5xi32>
  %r = stablehlo.add %m, %v : tensor<5xi32>
  return %r : tensor<5xi32>
}
"#;

/// s' = s + k^T k (one state step); used to chain device-resident buffers.
const STATE_STEP: &str = r#"
func.func public @main(%s: tensor<4x4xf32>, %k: tensor<3x4xf32>) -> tensor<4x4xf32> {
  %kk = stablehlo.dot_general %k, %k, contracting_dims = [0] x [0] : (tensor<3x4xf32>, tensor<3x4xf32>) -> tensor<4x4xf32>
  %s2 = stablehlo.add %s, %kk : tensor<4x4xf32>
  return %s2 : tensor<4x4xf32>
}
"#;

fn runtime() -> Runtime {
    match Runtime::new() {
        Ok(rt) => rt,
        Err(e) => panic!("no CPU plugin ({e}); run `cargo xtask setup`"),
    }
}

fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            approx::relative_eq!(*g, *w, epsilon = 1e-5, max_relative = 1e-5),
            "element {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn finds_plugin_named_by_env_else_cpu_plugin_in_setup_folder() {
    let rt = runtime();
    match std::env::var_os("KDA_PJRT_PLUGIN") {
        // `cargo xtask tpu-test --plugin PATH` (libtpu, the CUDA plugin, or the CPU plugin).
        Some(path) => assert_eq!(rt.plugin_path(), std::path::Path::new(&path)),
        None => {
            assert_eq!(rt.platform(), "cpu");
            assert!(rt.plugin_path().ends_with("plugins/cpu/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so"));
        }
    }
    assert!(rt.plugin_version() >= (0, 81));
}

#[test]
fn f32_matmul_matches_rust() {
    let rt = runtime();
    let a = [1.0, 2.0, 3.0, -4.0, 5.5, 6.0];
    let b = [0.5, -1.0, 2.0, 0.25, -3.0, 1.5];
    let exe = rt.compile(MATMUL).unwrap();
    let (da, db) = (rt.upload_f32(&a, &[2, 3]).unwrap(), rt.upload_f32(&b, &[3, 2]).unwrap());
    let out = rt.execute(&exe, &[&da, &db]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].dtype(), out[0].dims()), (DType::F32, &[2i64, 2][..]));
    assert_close(&rt.download_f32(&out[0]).unwrap(), &matmul(&a, &b, 2, 3, 2));
}

#[test]
fn bf16_round_trip_and_convert() {
    let rt = runtime();
    let x: Vec<bf16> = (0..32).map(|i| bf16::from_f32(i as f32 * 0.37 - 5.0)).collect();
    let dx = rt.upload_bf16(&x, &[4, 8]).unwrap();
    assert_eq!(dx.dtype(), DType::BF16);
    assert_eq!(rt.download_bf16(&dx).unwrap(), x);
    let out = rt.execute(&rt.compile(BF16_SCALE).unwrap(), &[&dx]).unwrap();
    let half_x: Vec<bf16> = x.iter().map(|v| bf16::from_f32(v.to_f32() * 0.5)).collect();
    assert_eq!(rt.download_bf16(&out[0]).unwrap(), half_x);
    let twice: Vec<f32> = x.iter().map(|v| v.to_f32() * 2.0).collect();
    assert_eq!(rt.download_f32(&out[1]).unwrap(), twice);
}

#[test]
fn i32_vector_and_scalar() {
    let rt = runtime();
    let v = [1, -2, 3, 40, i32::MAX / 8];
    let (dv, ds) = (rt.upload_i32(&v, &[5]).unwrap(), rt.upload_i32(&[3], &[]).unwrap());
    assert!(ds.dims().is_empty());
    let out = rt.execute(&rt.compile(I32_AXPY).unwrap(), &[&dv, &ds]).unwrap();
    let want: Vec<i32> = v.iter().map(|x| x * 3 + x).collect();
    assert_eq!(rt.download_i32(&out[0]).unwrap(), want);
}

#[test]
fn inputs_are_borrowed_and_reusable() {
    let rt = runtime();
    let step = rt.compile(STATE_STEP).unwrap();
    let k: Vec<f32> = (0..12).map(|i| (i as f32 - 5.0) * 0.1).collect();
    let dk = rt.upload_f32(&k, &[3, 4]).unwrap();
    let mut state = rt.upload_f32(&[0.0; 16], &[4, 4]).unwrap();
    // dk feeds three executions; each output state is fed back without leaving the device.
    for _ in 0..3 {
        state = rt.execute(&step, &[&state, &dk]).unwrap().remove(0);
    }
    let mut kk = [0.0f32; 16];
    for p in 0..3 {
        for i in 0..4 {
            for j in 0..4 {
                kk[i * 4 + j] += k[p * 4 + i] * k[p * 4 + j];
            }
        }
    }
    let want: Vec<f32> = kk.iter().map(|x| 3.0 * x).collect();
    assert_close(&rt.download_f32(&state).unwrap(), &want);
    assert_eq!(rt.download_f32(&dk).unwrap(), k, "borrowed input must survive");
}

#[test]
fn compile_cache_hits_on_same_text_and_options() {
    let rt = runtime();
    let first = rt.compile(MATMUL).unwrap();
    let again = rt.compile(MATMUL).unwrap();
    assert!(Rc::ptr_eq(&first, &again));
    assert_eq!((rt.cache_hits(), rt.cache_len()), (1, 1));
    let opts = CompileOptions::default().with_xla_option("xla_cpu_enable_fast_math", XlaOption::Bool(false));
    let other = rt.compile_with(MATMUL, &opts).unwrap();
    assert!(!Rc::ptr_eq(&first, &other));
    assert_eq!((rt.cache_hits(), rt.cache_len()), (1, 2));
}

/// The on-disk cache: a second runtime loads what the first compiled (and computes the same),
/// other options miss, and a damaged entry is a miss that recompiles, never an error.
#[test]
fn disk_compile_cache_is_shared_between_runtimes() {
    let dir = std::env::temp_dir().join(format!("kda-disk-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let a = [1.0, 2.0, 3.0, -4.0, 5.5, 6.0];
    let b = [0.5, -1.0, 2.0, 0.25, -3.0, 1.5];
    let run = |rt: &Runtime, opts: &CompileOptions| {
        let exe = rt.compile_with(MATMUL, opts).unwrap();
        let (da, db) = (rt.upload_f32(&a, &[2, 3]).unwrap(), rt.upload_f32(&b, &[3, 2]).unwrap());
        rt.download_f32(&rt.execute(&exe, &[&da, &db]).unwrap()[0]).unwrap()
    };
    let plain = CompileOptions::default();
    let mut first = runtime();
    first.set_compile_cache(Some(dir.clone()));
    let want = run(&first, &plain);
    assert_eq!(first.disk_cache_hits(), 0);
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kdaexe"))
        .collect();
    assert_eq!(entries.len(), 1, "one entry per program: {entries:?}");

    let mut second = runtime();
    second.set_compile_cache(Some(dir.clone()));
    assert_eq!(run(&second, &plain), want);
    assert_eq!(second.disk_cache_hits(), 1);
    let fast = CompileOptions::default().with_xla_option("xla_cpu_enable_fast_math", XlaOption::Bool(false));
    assert_eq!(run(&second, &fast), want);
    assert_eq!(second.disk_cache_hits(), 1, "other options must not hit");

    // Damage every entry: the next runtime recompiles.
    for p in entries {
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        bytes.truncate(n / 2);
        std::fs::write(&p, bytes).unwrap();
    }
    let mut third = runtime();
    third.set_compile_cache(Some(dir.clone()));
    assert_eq!(run(&third, &plain), want);
    assert_eq!(third.disk_cache_hits(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compile_error_keeps_compiler_message() {
    let rt = runtime();
    let bad = "func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n  %b = stablehlo.frobnicate %a : tensor<2xf32>\n  return %b : tensor<2xf32>\n}\n";
    let err = rt.compile(bad).unwrap_err();
    let TpuError::Compile { message } = &err else { panic!("expected a compile error, got {err}") };
    assert!(message.contains("-:2:") && message.contains("frobnicate"), "{message}");
    assert!(!message.contains("backtrace"), "{message}");
    let kda: KdaError = err.into();
    assert_eq!(kda.kind(), ErrorKind::Backend);
    assert!(kda.to_string().contains("frobnicate"));
}

#[test]
fn wrong_dtype_and_shape_are_rejected() {
    let rt = runtime();
    let exe = rt.compile(MATMUL).unwrap();
    let ints = rt.upload_i32(&[1, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
    let b = rt.upload_f32(&[0.0; 6], &[3, 2]).unwrap();
    // The CPU plugin itself would run this (same byte size); the runtime must refuse.
    let err = KdaError::from(rt.execute(&exe, &[&ints, &b]).unwrap_err());
    assert_eq!((err.kind(), err.arg()), (ErrorKind::DType, "input 0"));
    let err = KdaError::from(rt.execute(&exe, &[&b, &b]).unwrap_err());
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Shape, "input 0"));
    assert_eq!(KdaError::from(rt.execute(&exe, &[&b]).unwrap_err()).kind(), ErrorKind::Shape);
    assert_eq!(KdaError::from(rt.download_f32(&ints).unwrap_err()).kind(), ErrorKind::DType);
    assert_eq!(KdaError::from(rt.upload_f32(&[1.0; 5], &[2, 3]).unwrap_err()).kind(), ErrorKind::Shape);
}

#[test]
fn memory_stats_include_peak() {
    let rt = runtime();
    let stats = rt.memory_stats(&rt.compile(STATE_STEP).unwrap()).unwrap();
    eprintln!("cpu: {stats:?}");
    assert_eq!((stats.argument_bytes, stats.output_bytes), (4 * (16 + 12), 4 * 16));
    assert!(stats.peak_bytes > 0, "{stats:?}");
}

#[test]
fn missing_plugin_says_what_to_do() {
    let err = Runtime::with_plugin("/nonexistent/plugin.so").unwrap_err();
    assert!(matches!(err, TpuError::PluginNotFound { .. }), "{err}");
    assert_eq!(KdaError::from(err).kind(), ErrorKind::Backend);
}

#[rstest]
#[case(DEFAULT_TOPOLOGY)]
#[case("v6e:2x2")]
fn aot_compile_reports_peak_and_flops(#[case] topology: &str) {
    let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
    let report = tpu.compile(MATMUL, topology).unwrap();
    eprintln!(
        "{topology}: {:?}, flops {}, compiled in {:?}",
        report.memory, report.cost.flops, report.compile_time
    );
    assert!(report.memory.peak_bytes > 0, "{report:?}");
    assert_eq!(report.cost.flops, (2 * 2 * 3 * 2) as f64, "{report:?}");
}

#[test]
fn aot_rejects_v7x_spelling() {
    let err = kda_tpu::aot::check_topology("v7x:2x2x1").unwrap_err();
    assert!(err.to_string().contains("tpu7x:2x2x1"), "{err}");
    assert_eq!(KdaError::from(err).kind(), ErrorKind::Unsupported);
}

/// The forward programs' scheduler override (`PjrtBackend::compile_options`) reaches the CPU
/// compiler: at the primary shape the forward needs less scratch with it than with XLA's
/// defaults (26.3 against 34.5 MB when measured). The fused programs keep the defaults.
#[test]
fn forward_scheduler_override_reaches_the_cpu_compiler() {
    use kda_core::{BackwardStrategy, DType};
    use kda_tpu::backend::harness;
    use kda_tpu::{PjrtBackend, ProgramKind};
    let be = PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)");
    let fwd = ProgramKind::Forward(BackwardStrategy::Rematerialize);
    let scheduler =
        |kind| harness::compile_options(&be, kind).xla_options().contains_key("xla_cpu_scheduler_type");
    assert!(!scheduler(ProgramKind::Fused(BackwardStrategy::SavedState)));
    if be.platform() != "cpu" {
        assert!(!scheduler(fwd), "other plugins get XLA's defaults");
        return;
    }
    assert!(scheduler(fwd));
    let case = kda_testkit::benchmark_cases().into_iter().find(|c| c.name == "bench_primary").unwrap();
    let data = kda_testkit::case_data(&case, DType::F32).unwrap();
    let call = harness::DeviceCall::upload(&be, &data.inputs, None).unwrap();
    let text = kda_tpu::op::program(call.spec(), fwd).unwrap();
    let rt = runtime();
    let tuned = rt.compile_with(&text, &harness::compile_options(&be, fwd)).unwrap();
    let plain = rt.compile_with(&text, &CompileOptions::default()).unwrap();
    let (t, p) = (rt.memory_stats(&tuned).unwrap().temp_bytes, rt.memory_stats(&plain).unwrap().temp_bytes);
    eprintln!("forward scratch: {t} bytes with the override, {p} without");
    assert!(t < p, "the override did not reach the compiler: {t} >= {p} bytes of scratch");
}

/// Each replica adds 10 * its replica id to its own input, then all-gathers and all-reduces.
const COLLECTIVES_4: &str = r#"
func.func public @main(%x: tensor<1xf32>) -> (tensor<4xf32>, tensor<1xf32>) {
  %id = stablehlo.replica_id : tensor<ui32>
  %f = stablehlo.convert %id : (tensor<ui32>) -> tensor<f32>
  %ten = stablehlo.constant dense<1.000000e+01> : tensor<f32>
  %s = stablehlo.multiply %f, %ten : tensor<f32>
  %b = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<1xf32>
  %y = stablehlo.add %x, %b : tensor<1xf32>
  %g = "stablehlo.all_gather"(%y) {all_gather_dim = 0 : i64, replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>} : (tensor<1xf32>) -> tensor<4xf32>
  %r = "stablehlo.all_reduce"(%y) ({
  ^bb0(%a: tensor<f32>, %c: tensor<f32>):
    %sum = stablehlo.add %a, %c : tensor<f32>
    stablehlo.return %sum : tensor<f32>
  }) {replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>} : (tensor<1xf32>) -> tensor<1xf32>
  return %g, %r : tensor<4xf32>, tensor<1xf32>
}
"#;

/// Four CPU devices run one program as four replicas with per-device inputs and outputs, and
/// its collectives finish on two cores (a stall fails the test after two minutes).
#[test]
fn four_device_collectives_give_each_device_its_own_results() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        type PerDevice = Vec<(Vec<f32>, Vec<f32>)>;
        let run = || -> Result<PerDevice, TpuError> {
            let rt = Runtime::with_devices(4)?;
            assert_eq!(rt.device_count(), 4);
            let exe = rt.compile_with(COLLECTIVES_4, &CompileOptions::default().with_replicas(4))?;
            let inputs: Vec<_> =
                (0..4).map(|d| rt.upload_f32_on(d, &[d as f32 + 1.0], &[1])).collect::<Result<_, _>>()?;
            let args: Vec<Vec<_>> = inputs.iter().map(|b| vec![b]).collect();
            let outs = rt.execute_replicated(&exe, &args)?;
            outs.iter().map(|o| Ok((rt.download_f32(&o[0])?, rt.download_f32(&o[1])?))).collect()
        };
        let _ = tx.send(run());
    });
    let per_device = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("a 4-replica program stalled on the CPU plugin")
        .unwrap();
    assert_eq!(per_device.len(), 4);
    for (gathered, reduced) in per_device {
        assert_eq!(gathered, vec![1.0, 12.0, 23.0, 34.0]);
        assert_eq!(reduced, vec![70.0]);
    }
}

/// More replicas than devices, or a device index past the last, is an `Unsupported` error
/// naming both numbers.
#[test]
fn replicas_beyond_the_devices_are_unsupported() {
    let rt = Runtime::with_devices(2).unwrap();
    let err = rt.compile_with(COLLECTIVES_4, &CompileOptions::default().with_replicas(4)).unwrap_err();
    assert!(
        matches!(err, TpuError::Unsupported { .. }) && err.to_string().contains("this runtime has 2"),
        "{err}"
    );
    let err = rt.upload_f32_on(2, &[1.0], &[1]).unwrap_err();
    assert!(err.to_string().contains("device 2 of a runtime with 2 devices"), "{err}");
}

/// libtpu compiles a 4-replica collective program for `tpu7x:2x2x1` (deviceless), and reports
/// how many PJRT devices that topology has.
#[test]
fn aot_compile_of_four_replicas_fits_tpu7x_2x2x1() {
    let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
    let devices = tpu.device_count(DEFAULT_TOPOLOGY).unwrap();
    eprintln!("{DEFAULT_TOPOLOGY}: {devices} PJRT devices");
    assert_eq!(devices, 8, "one device per TensorCore, two per chip");
    let four = tpu.compile_with(COLLECTIVES_4, DEFAULT_TOPOLOGY, &CompileOptions::default().with_replicas(4));
    let report = four.unwrap();
    assert!(report.memory.peak_bytes > 0, "{report:?}");
}

/// `PjrtOptions::xla_option` reaches every kernel program's compile options, over
/// `$KDA_XLA_OPT_LEVEL` when both name the optimization level.
#[test]
fn xla_options_reach_every_kernel_compile() {
    use kda_core::BackwardStrategy;
    use kda_tpu::backend::harness;
    use kda_tpu::{PjrtOptions, ProgramKind};
    let be = PjrtOptions::new()
        .xla_option("xla_backend_optimization_level", XlaOption::Int(2))
        .build()
        .expect("PJRT plugin (run `cargo xtask setup`)");
    let kinds = [
        ProgramKind::Forward(BackwardStrategy::Rematerialize),
        ProgramKind::Backward(BackwardStrategy::SavedState),
        ProgramKind::Fused(BackwardStrategy::Rematerialize),
    ];
    for kind in kinds {
        let options = harness::compile_options(&be, kind);
        assert_eq!(
            options.xla_options().get("xla_backend_optimization_level"),
            Some(&XlaOption::Int(2)),
            "{kind:?}"
        );
    }
}
