//! Runs builder programs through kda-tpu's `Runtime` on the setup's CPU plugin. Without the
//! `runtime` feature the programs are only built (the builder's type checks still run) and
//! [`run!`] returns from the test before anything would execute.
#![cfg_attr(not(feature = "runtime"), allow(dead_code))]

#[cfg(feature = "runtime")]
use std::time::{Duration, Instant};

use half::bf16;
#[cfg(feature = "runtime")]
use kda_core::DType;
#[cfg(feature = "runtime")]
use kda_tpu::{DeviceBuffer, Runtime};

/// `run(text, inputs)`'s outputs; without the runtime, checks that `text` is a module with a
/// public `@main` and returns `Ok(())` from the calling test.
macro_rules! run {
    ($text:expr, $inputs:expr $(,)?) => {
        match $crate::hlo_support::run($text, $inputs) {
            Some(outs) => outs,
            None => return Ok(()),
        }
    };
}

/// Host-side input tensor.
#[allow(dead_code)] // only read when the programs execute
#[derive(Clone)]
pub enum In {
    F32(Vec<f32>, Vec<i64>),
    I32(Vec<i32>, Vec<i64>),
    Bf16(Vec<bf16>, Vec<i64>),
}

/// A downloaded output: its dims and its values (floats as f32, i32 as i32).
#[derive(Debug)]
pub struct Out {
    pub dims: Vec<i64>,
    floats: Option<Vec<f32>>,
    ints: Option<Vec<i32>>,
}

impl Out {
    /// f32 values of an f32 or bf16 output.
    pub fn f32s(&self) -> Vec<f32> {
        self.floats.clone().expect("not a float output")
    }
    /// Values of an i32 output.
    pub fn i32s(&self) -> Vec<i32> {
        self.ints.clone().expect("not an i32 output")
    }
}

#[cfg(feature = "runtime")]
fn runtime() -> Runtime {
    Runtime::new().unwrap_or_else(|e| panic!("no CPU plugin ({e}); run `cargo xtask setup`"))
}

#[cfg(feature = "runtime")]
fn upload(rt: &Runtime, inputs: &[In]) -> Vec<DeviceBuffer> {
    inputs
        .iter()
        .map(|i| match i {
            In::F32(d, dims) => rt.upload_f32(d, dims),
            In::I32(d, dims) => rt.upload_i32(d, dims),
            In::Bf16(d, dims) => rt.upload_bf16(d, dims),
        })
        .collect::<Result<_, _>>()
        .expect("upload")
}

#[cfg(feature = "runtime")]
fn download(rt: &Runtime, b: &DeviceBuffer) -> Out {
    let dims = b.dims().to_vec();
    match b.dtype() {
        DType::F32 => Out { dims, floats: Some(rt.download_f32(b).expect("f32")), ints: None },
        DType::BF16 => {
            let v = rt.download_bf16(b).expect("bf16").iter().map(|x| x.to_f32()).collect();
            Out { dims, floats: Some(v), ints: None }
        }
        DType::I32 => Out { dims, floats: None, ints: Some(rt.download_i32(b).expect("i32")) },
        other => panic!("no download for {other:?} outputs (convert to i32 in the program)"),
    }
}

/// Compiles `text`, runs it once on `inputs` and downloads every output (use [`run!`]).
#[cfg(feature = "runtime")]
pub fn run(text: &str, inputs: Vec<In>) -> Option<Vec<Out>> {
    Some(run_timed(text, inputs, 1).0)
}

/// Without the runtime: checks the text's shape and returns `None` (nothing executes).
#[cfg(not(feature = "runtime"))]
pub fn run(text: &str, inputs: Vec<In>) -> Option<Vec<Out>> {
    assert!(text.starts_with("module") && text.contains("func.func public @main("), "{text}");
    drop(inputs);
    None
}

/// Like [`run`], executing `iters` times on the same device inputs; also the median execute time.
#[cfg(feature = "runtime")]
#[allow(dead_code)]
pub fn run_timed(text: &str, inputs: Vec<In>, iters: usize) -> (Vec<Out>, Duration) {
    let rt = runtime();
    let exe = rt.compile(text).unwrap_or_else(|e| panic!("compile failed: {e}\n--- program ---\n{text}"));
    let bufs = upload(&rt, &inputs);
    let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
    let mut times = Vec::new();
    let mut outs = Vec::new();
    for _ in 0..iters.max(1) {
        let t0 = Instant::now();
        outs = rt.execute(&exe, &refs).expect("execute");
        times.push(t0.elapsed());
    }
    times.sort();
    (outs.iter().map(|b| download(&rt, b)).collect(), times[times.len() / 2])
}

/// Deterministic pseudo-random values in [lo, hi), from the test kit's seeded generator.
pub fn rand_vec(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut r = kda_testkit::Rng::new(seed);
    (0..n).map(|_| r.uniform(f64::from(lo), f64::from(hi)) as f32).collect()
}

/// `v`'s rows of `k` values, each scaled to unit length.
#[allow(dead_code)] // not every test binary normalises rows
pub fn unit_rows(v: Vec<f32>, k: usize) -> Vec<f32> {
    v.chunks(k)
        .flat_map(|r| {
            let n = r.iter().map(|x| x * x).sum::<f32>().sqrt();
            r.iter().map(move |x| x / n).collect::<Vec<_>>()
        })
        .collect()
}

/// Panics at the first element that differs by more than `tol`, absolutely or relative to the
/// larger magnitude (`approx::relative_eq!`); a NaN never passes.
pub fn assert_close(name: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let bad = got
        .iter()
        .zip(want)
        .position(|(g, w)| !approx::relative_eq!(*g, *w, epsilon = tol, max_relative = tol));
    if let Some(i) = bad {
        panic!("{name}: element {i}: got {}, want {} (tolerance {tol})", got[i], want[i]);
    }
}
