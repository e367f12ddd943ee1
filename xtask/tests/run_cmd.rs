//! End-to-end tests of `cargo xtask run`: `.npy` inputs in a temporary directory, the command's
//! entry point, and the written results compared with calling `kda_ref` directly.

// run_cmd re-runs xtask through cargo for `--backend pjrt` without the `pjrt` feature.
#[allow(dead_code)]
#[path = "../src/cargo_cmd.rs"]
mod cargo_cmd;
#[allow(dead_code)]
#[path = "../src/cli.rs"]
mod cli;
#[allow(dead_code)]
#[path = "../src/npy.rs"]
mod npy;
#[allow(dead_code)]
#[path = "../src/run_cmd.rs"]
mod run_cmd;
#[allow(dead_code)]
#[path = "../src/setup.rs"]
mod setup;

use kda_core::{
    Backend, BackwardStrategy, Cotangents, DType, HostTensor, KdaConfig, KdaInputs, Layout, Segments,
};
use npy::{NpyArray, NpyData};
use rstest::rstest;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kda-xtask-run-{}-{tag}-{n}", std::process::id()));
        std::fs::create_dir_all(dir.join("in")).expect("create temp dir");
        Self(dir)
    }
    fn inputs(&self) -> PathBuf {
        self.0.join("in")
    }
    fn out(&self) -> PathBuf {
        self.0.join("out")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(dir: &Path, name: &str, shape: &[usize], data: NpyData) {
    let arr = NpyArray::new(shape, data).expect("consistent test array");
    npy::write(&dir.join(format!("{name}.npy")), &arr).expect("write test input");
}

fn read(dir: &Path, name: &str) -> NpyArray {
    npy::read(&dir.join(format!("{name}.npy"))).expect("read result")
}

/// The shape of one test problem and which optional inputs it has.
#[derive(Clone)]
struct Spec {
    layout: Layout,
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    v: usize,
    /// Per-row cu_seqlens; written 1-D when `cu_1d`.
    cu: Option<Vec<Vec<i64>>>,
    cu_1d: bool,
    /// Rank h0 is written in (4 or 5), if any.
    h0_rank: Option<usize>,
    with_do: bool,
    with_dht: bool,
    beta_trailing_one: bool,
}

impl Spec {
    fn fixed(layout: Layout) -> Self {
        let (b, t, h, k, v) = (2, 5, 3, 4, 3);
        let base = (None, false, Some(5), true, false, false);
        let (cu, cu_1d, h0_rank, with_do, with_dht, beta_trailing_one) = base;
        Self { layout, b, t, h, k, v, cu, cu_1d, h0_rank, with_do, with_dht, beta_trailing_one }
    }
    fn n(&self) -> usize {
        self.cu.as_ref().map_or(1, |c| c[0].len() - 1)
    }
}

/// What the flags of a run mean, for the expected results.
#[derive(Clone, Copy)]
struct Expect {
    dtype: DType,
    strategy: BackwardStrategy,
    scale: Option<f64>,
    l2norm: bool,
    /// `--output-final-state` was passed.
    ofs: bool,
}

const DEFAULTS: Expect = Expect {
    dtype: DType::F32,
    strategy: BackwardStrategy::SavedState,
    scale: None,
    l2norm: false,
    ofs: false,
};

/// The f64 inputs of a written problem, to rebuild what the command should compute.
struct Fixture {
    spec: Spec,
    tensors: Vec<(&'static str, Vec<usize>, Vec<f64>)>,
    dir: TempDir,
}

impl Fixture {
    /// Draws the inputs of `spec` and writes them (q as f32, the rest as f64).
    fn new(spec: Spec, seed: u64) -> Self {
        let mut rng = kda_testkit::Rng::new(seed);
        let Spec { layout, b, t, h, k, v, .. } = spec;
        let (tk, tv) = (layout.token_shape(h, b, t, k).to_vec(), layout.token_shape(h, b, t, v).to_vec());
        let mut beta_shape = layout.scalar_shape(h, b, t).to_vec();
        if spec.beta_trailing_one {
            beta_shape.push(1);
        }
        let n = spec.n();
        let state = |rank: usize| if rank == 4 { vec![b * n, h, k, v] } else { vec![b, n, h, k, v] };
        let mut tensors = vec![
            ("q", tk.clone(), rng.uniform_vec(b * t * h * k, -1.0, 1.0)),
            ("k", tk.clone(), rng.uniform_vec(b * t * h * k, -1.0, 1.0)),
            ("v", tv.clone(), rng.uniform_vec(b * t * h * v, -1.0, 1.0)),
            ("g", tk, rng.uniform_vec(b * t * h * k, -1.0, 0.0)),
            ("beta", beta_shape, rng.uniform_vec(b * t * h, 0.0, 1.0)),
        ];
        if let Some(rank) = spec.h0_rank {
            tensors.push(("h0", state(rank), rng.uniform_vec(b * n * h * k * v, -0.5, 0.5)));
        }
        if spec.with_do {
            tensors.push(("do", tv, rng.uniform_vec(b * t * h * v, -1.0, 1.0)));
        }
        if spec.with_dht {
            tensors.push(("dht", state(5), rng.uniform_vec(b * n * h * k * v, -1.0, 1.0)));
        }
        let dir = TempDir::new("case");
        for (name, shape, data) in &tensors {
            let data = match *name {
                "q" => NpyData::F32(data.iter().map(|&x| x as f32).collect()),
                _ => NpyData::F64(data.clone()),
            };
            write(&dir.inputs(), name, shape, data);
        }
        if let Some(cu) = &spec.cu {
            let flat: Vec<i64> = cu.concat();
            match spec.cu_1d {
                true => write(&dir.inputs(), "cu_seqlens", &[flat.len()], NpyData::I32(to_i32(&flat))),
                false => write(&dir.inputs(), "cu_seqlens", &[cu.len(), cu[0].len()], NpyData::I64(flat)),
            }
        }
        Self { spec, tensors, dir }
    }

    fn get(&self, name: &str, dtype: DType) -> Option<HostTensor> {
        let (_, shape, data) = self.tensors.iter().find(|t| t.0 == name)?;
        let data: Vec<f64> = match name {
            "q" => data.iter().map(|&x| x as f32 as f64).collect(),
            _ => data.clone(),
        };
        let Spec { b, h, k, v, .. } = self.spec;
        let shape = if shape.len() == 4 && matches!(name, "h0" | "dht") {
            vec![b, self.spec.n(), h, k, v]
        } else {
            shape.clone()
        };
        Some(HostTensor::from_f64_as(&shape, &data, dtype).expect("fixture tensor"))
    }

    /// Runs the command with `extra` flags and checks every result file against `kda_ref`
    /// called with the options `e` those flags should mean.
    fn check(&self, extra: &[&str], e: Expect) {
        let Expect { dtype, strategy, scale, l2norm, ofs } = e;
        let ofs = ofs || self.spec.h0_rank.is_some() || self.spec.with_dht;
        let mut args = vec!["--backend", "ref", "--inputs"];
        let (inp, out) = (self.dir.inputs().display().to_string(), self.dir.out().display().to_string());
        args.extend([inp.as_str(), "--out", out.as_str()]);
        args.extend(extra);
        let args: Vec<String> = args.into_iter().map(String::from).collect();
        run_cmd::run(&args).expect("the run succeeds");

        let sd = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let tok = |n| self.get(n, dtype).expect("token input");
        let mut inputs = KdaInputs::new(tok("q"), tok("k"), tok("v"), tok("g"), tok("beta"));
        inputs.config =
            KdaConfig { layout: self.spec.layout, scale, use_qk_l2norm: l2norm, output_final_state: ofs };
        inputs.initial_state = self.get("h0", sd);
        inputs.segments = self.spec.cu.clone().map(Segments::CuSeqlens);
        let backend = kda_ref::RefBackend;
        let (outputs, grads) = match self.get("do", dtype) {
            Some(d_o) => {
                let cot = Cotangents { d_o, dht: self.get("dht", sd) };
                let (o, g) = backend.forward_and_vjp(&inputs, &cot, strategy).expect("reference");
                (o, Some(g))
            }
            None => (backend.forward(&inputs, strategy).expect("reference").0, None),
        };
        let mut expected = vec![("o", outputs.o.clone())];
        expected.extend(outputs.final_state.map(|t| ("ht", t)));
        expected.extend(grads.iter().flat_map(|g| g.named()).map(|(n, t)| (n, t.clone())));
        let n_files = std::fs::read_dir(self.dir.out()).expect("out dir").count();
        assert_eq!(n_files, expected.len(), "written files: {expected:?}");
        for (name, want) in expected {
            let got = read(&self.dir.out(), name);
            let mut shape = want.shape().to_vec();
            if matches!(name, "ht" | "dh0") && self.spec.h0_rank == Some(4) {
                shape = vec![shape[0] * shape[1], shape[2], shape[3], shape[4]];
            }
            assert_eq!(got.shape, shape, "{name} keeps the shape (and state rank)");
            let data = match dtype {
                DType::F64 => NpyData::F64(want.to_f64_vec()),
                _ => NpyData::F32(want.to_f32_vec()),
            };
            assert_eq!(got.data, data, "{name} equals kda_ref");
        }
    }
}

fn to_i32(v: &[i64]) -> Vec<i32> {
    v.iter().map(|&x| i32::try_from(x).expect("small")).collect()
}

#[rstest]
#[case::batch_first_f32(Layout::BatchFirst, DType::F32, "saved-state", Some(5), true, false)]
#[case::head_first_f32_remat_4d(Layout::HeadFirst, DType::F32, "remat", Some(4), true, true)]
#[case::batch_first_f64_l2norm(Layout::BatchFirst, DType::F64, "saved-state", None, true, false)]
#[case::head_first_bf16(Layout::HeadFirst, DType::BF16, "saved-state", Some(5), true, true)]
#[case::forward_only(Layout::BatchFirst, DType::F32, "saved-state", None, false, false)]
fn fixed_length_matches_reference(
    #[case] layout: Layout,
    #[case] dtype: DType,
    #[case] strategy: &str,
    #[case] h0_rank: Option<usize>,
    #[case] with_do: bool,
    #[case] with_dht: bool,
) {
    let spec = Spec { h0_rank, with_do, with_dht, ..Spec::fixed(layout) };
    let f = Fixture::new(spec, 7);
    let lay = if layout == Layout::HeadFirst { "hbtk" } else { "bthk" };
    let l2norm = dtype == DType::F64;
    let dt = dtype.to_string();
    let mut extra = vec!["--layout", lay, "--dtype", dt.as_str(), "--strategy", strategy];
    if l2norm {
        extra.push("--l2norm");
    }
    if !with_do {
        extra.push("--output-final-state");
    }
    let strategy = BackwardStrategy::parse(strategy).expect("strategy");
    f.check(&extra, Expect { dtype, strategy, l2norm, ofs: !with_do, ..DEFAULTS });
}

#[rstest]
#[case::one_row_1d_cu_4d_state(vec![vec![0, 3, 3, 9]], true, 4)]
#[case::one_row_1d_cu_5d_state(vec![vec![0, 3, 3, 9]], true, 5)]
#[case::two_rows_2d_cu_5d_state(vec![vec![0, 2, 6], vec![0, 9, 9]], false, 5)]
#[case::two_rows_2d_cu_4d_state(vec![vec![0, 2, 6], vec![0, 9, 9]], false, 4)]
fn packed_matches_reference_and_keeps_state_rank(
    #[case] cu: Vec<Vec<i64>>,
    #[case] cu_1d: bool,
    #[case] rank: usize,
) {
    let base = Spec::fixed(Layout::BatchFirst);
    let spec = Spec { b: cu.len(), t: 10, cu: Some(cu), cu_1d, h0_rank: Some(rank), with_dht: true, ..base };
    Fixture::new(spec, 11).check(&[], DEFAULTS);
}

#[test]
fn beta_with_trailing_one_and_inline_flags() {
    let spec = Spec { beta_trailing_one: true, h0_rank: None, ..Spec::fixed(Layout::HeadFirst) };
    let f = Fixture::new(spec, 3);
    f.check(&["--layout=hbtk", "--scale=0.5"], Expect { scale: Some(0.5), ..DEFAULTS });
    assert_eq!(read(&f.dir.out(), "dbeta").shape, vec![3, 2, 5, 1]);
}

#[test]
fn bf16_rounds_the_inputs() {
    let f = Fixture::new(Spec { with_do: false, h0_rank: None, ..Spec::fixed(Layout::BatchFirst) }, 5);
    let o = |dtype: &str| {
        let out = f.dir.out().join(dtype).display().to_string();
        let inp = f.dir.inputs().display().to_string();
        let args = ["--backend", "ref", "--inputs", &inp, "--out", &out, "--dtype", dtype];
        run_cmd::run(&args.map(String::from)).expect("run");
        read(Path::new(&out), "o").data.floats().expect("float output")
    };
    let (bf, fp) = (o("bf16"), o("f32"));
    assert!(bf.iter().all(|&x| f64::from(half::bf16::from_f64(x)) == x), "o of a bf16 run is bf16");
    let diff = bf.iter().zip(&fp).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff > 1e-4 && diff < 0.1, "bf16 and f32 runs differ by rounding: {diff}");
}

/// A mutation of a valid input directory that makes the run fail.
type Break = fn(&Path);

fn remove(dir: &Path, name: &str) {
    std::fs::remove_file(dir.join(format!("{name}.npy"))).expect("remove");
}

/// Replaces the first `from` in the bytes of `name.npy` by `to` (same length).
fn patch(dir: &Path, name: &str, from: &str, to: &str) {
    let p = dir.join(format!("{name}.npy"));
    let mut bytes = std::fs::read(&p).expect("read");
    let at = bytes.windows(from.len()).position(|w| w == from.as_bytes()).expect("pattern present");
    bytes[at..at + to.len()].copy_from_slice(to.as_bytes());
    std::fs::write(&p, bytes).expect("write");
}

#[rstest]
#[case::missing_q(|d: &Path| remove(d, "q"), &["q.npy", "no such file"])]
#[case::k_wrong_shape(|d: &Path| write(d, "k", &[2, 5, 3, 5], NpyData::F64(vec![0.0; 150])), &["k.npy", "[2, 5, 3, 4]"])]
#[case::q_int64(|d: &Path| write(d, "q", &[2, 5, 3, 4], NpyData::I64(vec![0; 120])), &["q.npy", "int64"])]
#[case::beta_out_of_range(|d: &Path| write(d, "beta", &[2, 5, 3], NpyData::F64(vec![1.5; 30])), &["beta.npy", "[0, 1]"])]
#[case::v_truncated(|d: &Path| {
    let p = d.join("v.npy");
    let bytes = std::fs::read(&p).expect("read");
    std::fs::write(&p, &bytes[..bytes.len() - 3]).expect("write");
}, &["v.npy", "truncated"])]
#[case::g_fortran_order(|d: &Path| patch(d, "g", "'fortran_order': False", "'fortran_order': True "), &["g.npy", "Fortran"])]
#[case::g_big_endian(|d: &Path| patch(d, "g", "<f8", ">f8"), &["g.npy", "'>f8'"])]
#[case::h0_float16(|d: &Path| patch(d, "h0", "<f8", "<f2"), &["h0.npy", "'<f2'"])]
#[case::cu_float(|d: &Path| write(d, "cu_seqlens", &[2], NpyData::F64(vec![0.0, 5.0])), &["cu_seqlens.npy", "float64"])]
#[case::cu_1d_with_two_rows(|d: &Path| write(d, "cu_seqlens", &[2], NpyData::I64(vec![0, 5])), &["cu_seqlens.npy", "B = 2"])]
#[case::cu_decreasing(|d: &Path| write(d, "cu_seqlens", &[2, 3], NpyData::I64(vec![0, 4, 2, 0, 1, 5])), &["cu_seqlens.npy", "non-decreasing"])]
#[case::cu_3d(|d: &Path| write(d, "cu_seqlens", &[1, 1, 2], NpyData::I64(vec![0, 5])), &["cu_seqlens.npy", "[N+1] or [B, N+1]"])]
#[case::h0_4d_wrong_rows(|d: &Path| write(d, "h0", &[3, 3, 4, 3], NpyData::F64(vec![0.0; 108])), &["h0.npy", "B*N = 2"])]
#[case::h0_5d_wrong_n(|d: &Path| write(d, "h0", &[2, 2, 3, 4, 3], NpyData::F64(vec![0.0; 144])), &["h0.npy", "N = 1"])]
#[case::h0_rank_3(|d: &Path| write(d, "h0", &[2, 3, 4], NpyData::F64(vec![0.0; 24])), &["h0.npy", "rank 5"])]
#[case::do_wrong_shape(|d: &Path| write(d, "do", &[2, 5, 3, 4], NpyData::F64(vec![0.0; 120])), &["do.npy", "like o"])]
#[case::dht_without_do(|d: &Path| {
    remove(d, "do");
    write(d, "dht", &[2, 1, 3, 4, 3], NpyData::F64(vec![0.0; 72]));
}, &["do.npy", "dht.npy was given without it"])]
fn errors_name_the_file(#[case] breaks: Break, #[case] needles: &[&str]) {
    let f = Fixture::new(Spec::fixed(Layout::BatchFirst), 1);
    breaks(&f.dir.inputs());
    let inp = f.dir.inputs().display().to_string();
    let out = f.dir.out().display().to_string();
    let args = ["--backend", "ref", "--inputs", &inp, "--out", &out];
    let err = run_cmd::run(&args.map(String::from)).expect_err("the run must fail");
    for needle in needles {
        assert!(err.contains(needle), "`{err}` lacks `{needle}`");
    }
    assert!(!f.dir.out().exists(), "nothing is written on failure");
}

#[rstest]
#[case::unknown_backend(&["--backend", "cuda", "--inputs", "a", "--out", "b"], "available: ref, pjrt")]
#[case::no_backend(&["--inputs", "a", "--out", "b"], "`--backend` is required")]
#[case::no_out(&["--backend", "ref", "--inputs", "a"], "`--out DIR` is required")]
#[case::unknown_flag(&["--backend", "ref", "--frobnicate"], "unknown argument `--frobnicate`")]
#[case::bad_layout(&["--layout", "tbhk"], "expected bthk or hbtk, got `tbhk`")]
#[case::bad_dtype(&["--dtype=f16"], "expected f32, bf16 or f64")]
#[case::bad_strategy(&["--strategy", "lazy"], "saved-state or remat")]
#[case::bad_scale(&["--scale", "nan"], "a finite number")]
#[case::missing_value(&["--inputs"], "`--inputs` needs a value")]
#[case::no_inputs_dir(&["--backend", "ref", "--inputs", "/nonexistent/kda", "--out", "b"], "no such directory")]
#[case::bad_gate(&["--gate", "sigmoid"], "softplus or lower-bound=LB")]
#[case::positive_lower_bound(&["--gate", "lower-bound=2"], "softplus or lower-bound=LB")]
#[case::zero_devices(&["--devices", "0"], "`--devices` needs a positive whole number")]
#[case::devices_need_pjrt(&["--backend", "ref", "--devices", "2", "--inputs", "a", "--out", "b"], "needs `--backend pjrt`")]
#[case::implementation_needs_pjrt(&["--backend", "ref", "--implementation", "interpret", "--inputs", "a", "--out", "b"], "needs `--backend pjrt`")]
#[case::bad_implementation(&["--implementation", "pallas"], "xla, mosaic, interpret, triton or triton-interpret")]
fn argument_errors(#[case] args: &[&str], #[case] needle: &str) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let err = run_cmd::run(&args).expect_err("must fail");
    assert!(err.contains(needle), "`{err}` lacks `{needle}`");
    if !needle.contains("available") && !needle.contains("directory") {
        assert!(err.contains("usage: cargo xtask run"), "argument errors show the usage: {err}");
    }
}

#[test]
fn parses_flags_and_help() {
    let args = "--backend ref --inputs i --out o --layout hbtk --scale 0.25 --dtype bf16 --strategy remat \
                --l2norm --output-final-state";
    let args: Vec<String> = args.split_whitespace().map(String::from).collect();
    let (backend, opts) = run_cmd::parse_args(&args).expect("valid").expect("not help");
    assert_eq!(backend, "ref");
    let want = run_cmd::RunOptions {
        layout: Layout::HeadFirst,
        scale: Some(0.25),
        dtype: DType::BF16,
        strategy: BackwardStrategy::Rematerialize,
        l2norm: true,
        output_final_state: true,
        ..run_cmd::RunOptions::new("i", "o")
    };
    assert_eq!(opts, want);
    assert_eq!(run_cmd::parse_args(&["--help".to_string()]), Ok(None));
    assert_eq!(run_cmd::run(&["-h".to_string()]), Ok(()));
}

/// `--backend pjrt` (with the `pjrt` feature): every written result agrees with the reference at
/// the f32 limits of docs/kda.md, packed and with states, with the XLA forward and with the Mosaic
/// forward kernel's interpret lowering.
#[cfg(feature = "pjrt")]
#[rstest]
#[case::xla("xla")]
#[case::interpret("interpret")]
fn pjrt_backend_agrees_with_reference(#[case] implementation: &str) {
    use kda_testkit::{agreement, rms_limit, Quantity};
    let spec = Spec {
        cu: Some(vec![vec![0, 2, 5], vec![0, 4, 4]]),
        with_dht: true,
        ..Spec::fixed(Layout::BatchFirst)
    };
    let f = Fixture::new(spec, 11);
    let inp = f.dir.inputs().display().to_string();
    let run = |backend: &str, out: &Path| {
        let out = out.display().to_string();
        let mut args = vec!["--backend", backend, "--inputs", &inp, "--out", &out, "--dtype", "f32"];
        if backend == "pjrt" {
            args.extend(["--implementation", implementation]);
        }
        let args: Vec<String> = args.into_iter().map(String::from).collect();
        run_cmd::run(&args).unwrap_or_else(|e| panic!("{backend}: {e}"));
    };
    let (pjrt_out, ref_out) = (f.dir.out(), f.dir.0.join("ref"));
    run("pjrt", &pjrt_out);
    run("ref", &ref_out);
    let names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"];
    assert_eq!(std::fs::read_dir(&pjrt_out).expect("out dir").count(), names.len());
    for name in names {
        let (got, want) = (read(&pjrt_out, name), read(&ref_out, name));
        assert_eq!(got.shape, want.shape, "{name}");
        let got = HostTensor::from_f64(&got.shape, got.data.floats().expect("floats")).expect("tensor");
        let a = agreement(&got, &want.data.floats().expect("floats"));
        let limit = rms_limit(Quantity::of(name), DType::F32);
        assert!(a.finite && a.rms_ratio <= limit, "{name}: {a:?} (limit {limit})");
    }
}

/// `--gate softplus` and `--gate lower-bound=LB` read `a_log.npy` and `dt_bias.npy`, compute the
/// gate in the kernel and write `da_log` and `ddt_bias` equal to the reference's.
#[rstest]
#[case::softplus("softplus", kda_core::GateKind::Softplus)]
#[case::lower_bound("lower-bound=-5", kda_core::GateKind::LowerBound(-5.0))]
fn in_kernel_gate_reads_its_parameters_and_writes_their_gradients(
    #[case] flag: &str,
    #[case] kind: kda_core::GateKind,
) {
    let f = Fixture::new(Spec { h0_rank: None, ..Spec::fixed(Layout::BatchFirst) }, 13);
    let Spec { h, k, .. } = f.spec;
    let mut rng = kda_testkit::Rng::new(17);
    let (a_log, dt_bias) = (rng.uniform_vec(h, -1.0, 0.5), rng.uniform_vec(h * k, -0.5, 0.5));
    write(&f.dir.inputs(), "a_log", &[h], NpyData::F64(a_log.clone()));
    write(&f.dir.inputs(), "dt_bias", &[h * k], NpyData::F64(dt_bias.clone()));
    let (inp, out) = (f.dir.inputs().display().to_string(), f.dir.out().display().to_string());
    let args = ["--backend", "ref", "--inputs", &inp, "--out", &out, "--gate", flag];
    run_cmd::run(&args.map(String::from)).expect("run");

    let tok = |n| f.get(n, DType::F32).expect("token input");
    let (a, d) = (
        HostTensor::from_f64_as(&[h], &a_log, DType::F32).expect("a_log"),
        HostTensor::from_f64_as(&[h * k], &dt_bias, DType::F32).expect("dt_bias"),
    );
    let gate = match kind {
        kda_core::GateKind::LowerBound(lb) => kda_core::GateMode::lower_bound(lb, a, Some(d)),
        _ => kda_core::GateMode::softplus(a, Some(d)),
    };
    let inputs = KdaInputs::new(tok("q"), tok("k"), tok("v"), tok("g"), tok("beta")).with_gate(gate);
    let cot = Cotangents { d_o: tok("do"), dht: None };
    let (_, grads) =
        kda_ref::RefBackend.forward_and_vjp(&inputs, &cot, BackwardStrategy::SavedState).expect("reference");
    for (name, want) in [("da_log", grads.da_log), ("ddt_bias", grads.ddt_bias)] {
        let want = want.unwrap_or_else(|| panic!("the reference returns {name}"));
        assert_eq!(read(&f.dir.out(), name).data, NpyData::F32(want.to_f32_vec()), "{name}");
    }
}

/// A positive log-decay at one token of a packed row names g.npy, the flat index and the value;
/// the same row with every log-decay exactly 0 runs and equals the reference.
#[test]
fn positive_log_decay_in_a_packed_row_names_its_index() {
    let base = Spec::fixed(Layout::BatchFirst);
    let spec = Spec { b: 1, t: 10, cu: Some(vec![vec![0, 3, 3, 10]]), cu_1d: true, ..base };
    let mut f = Fixture::new(spec, 13);
    fn set_g(f: &mut Fixture, g: Vec<f64>) {
        let slot = f.tensors.iter_mut().find(|t| t.0 == "g").expect("g is written");
        write(&f.dir.inputs(), "g", &slot.1, NpyData::F64(g.clone()));
        slot.2 = g;
    }
    // [B, T, H, K] with H = 3, K = 4: token 7 (the third segment), head 2, channel 1.
    let at = (7 * 3 + 2) * 4 + 1;
    let mut g = vec![-0.5; 10 * 3 * 4];
    g[at] = 0.75;
    set_g(&mut f, g.clone());
    let inp = f.dir.inputs().display().to_string();
    let out = f.dir.out().display().to_string();
    let args = ["--backend", "ref", "--inputs", &inp, "--out", &out];
    let err = run_cmd::run(&args.map(String::from)).expect_err("a growing gate must be refused");
    for needle in ["g.npy", "<= 0", &format!("0.75 at flat index {at}")] {
        assert!(err.contains(needle), "`{err}` lacks `{needle}`");
    }
    assert!(!f.dir.out().exists(), "nothing is written on failure");
    set_g(&mut f, vec![0.0; g.len()]);
    f.check(&[], DEFAULTS);
}
