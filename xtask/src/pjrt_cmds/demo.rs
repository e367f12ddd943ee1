//! The PJRT part of `cargo xtask demo`: the fused saved-state forward+VJP at the primary shape on
//! the CPU plugin, timed and checked against the f64 reference at the limits of docs/kda.md, then the
//! same in the TPU configuration (the fused program in slabs), then the fused forward+VJP on the
//! Mosaic forward and backward kernels through their interpret lowering.

use super::{backend_label, err, ms};
use kda_core::{BackwardStrategy, DType, HostTensor};
use kda_testkit::{agreement, rms_limit, Quantity};
use kda_tpu::backend::harness::DeviceCall;
use kda_tpu::ProgramKind;
use std::time::Instant;

const RUNS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the reference part, then the PJRT part; fails when a quantity misses its limit.
pub fn run() -> Result<(), String> {
    let reference = crate::demo::reference()?;
    let (data, strategy) = (&reference.data, BackwardStrategy::SavedState);

    println!("\nPJRT backend: fused forward+VJP, saved state, f32");
    let be = super::timing_backend()?;
    println!("  backend {}", backend_label(&be));
    let problem = data.inputs.validate().map_err(err)?;
    let spec = be.spec(&problem, data.cotangents.dht.is_some()).map_err(err)?;
    crate::progress::step("demo", "compiling the fused program...");
    let t = Instant::now();
    be.prepare(&spec, &[ProgramKind::Fused(strategy)]).map_err(err)?;
    println!("  compile: {:.0} ms (program built and compiled once)", ms(t.elapsed()));

    crate::progress::step(
        "demo",
        format_args!("timing {RUNS} runs of the Backend API and of the program alone..."),
    );
    let mut times = Vec::with_capacity(RUNS);
    let mut result = None;
    for _ in 0..RUNS {
        let t = Instant::now();
        result = Some(be.forward_and_vjp(&data.inputs, &data.cotangents, strategy).map_err(err)?);
        times.push(ms(t.elapsed()));
    }
    let (outputs, grads) = result.ok_or("no run")?;
    let api = median(times);
    println!("  forward_and_vjp (Backend API, host transfers included): median {api:.1} ms of {RUNS} runs");
    let call = DeviceCall::upload(&be, &data.inputs, Some(&data.cotangents)).map_err(err)?;
    let mut device = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        let out = call.run(&be, ProgramKind::Fused(strategy), None).map_err(err)?;
        device.push(ms(t.elapsed()));
        drop(out);
    }
    let device = median(device);
    println!("  the program alone (inputs already on the device): median {device:.1} ms of {RUNS} runs");
    println!(
        "  reference (f64, single thread): {:.0} ms, {:.0}x the Backend API time",
        reference.ms,
        reference.ms / api
    );

    println!("\nagreement with the f64 reference (docs/kda.md, Accuracy, f32 limits):");
    println!("  {:>6}  {:>9}  {:>9}  {:>9}  result", "", "RMS ratio", "limit", "max abs");
    let mut failed = Vec::new();
    let mut check = |name: &str, got: &HostTensor, want: &HostTensor| {
        let a = agreement(got, &want.to_f64_vec());
        let limit = rms_limit(Quantity::of(name), DType::F32);
        let pass = a.finite && a.rms_ratio <= limit;
        let verdict = if pass { "PASS" } else { "FAIL" };
        println!("  {name:>6}  {:>9.2e}  {limit:>9.0e}  {:>9.2e}  {verdict}", a.rms_ratio, a.max_abs);
        if !pass {
            failed.push(name.to_string());
        }
    };
    check("o", &outputs.o, &reference.outputs.o);
    if let (Some(got), Some(want)) = (&outputs.final_state, &reference.outputs.final_state) {
        check("ht", got, want);
    }
    let want = reference.grads.named();
    for (name, got) in grads.named() {
        let w =
            want.iter().find(|(n, _)| *n == name).ok_or_else(|| format!("the reference has no {name}"))?;
        check(name, got, w.1);
    }
    // The TPU configuration (fused program in slabs) on the same inputs: the program that
    // `cargo xtask aot` compiles for tpu7x, run here and held to the same limits.
    let slab = kda_tpu::op::TPU_SLAB;
    println!("\nthe TPU configuration (fused program in slabs of {slab} chunk positions), same check:");
    let tpu_be = be.clone().with_tuning(be.tuning().with_slab(slab)).map_err(err)?;
    crate::progress::step("demo", "compiling and running the TPU configuration...");
    let t = Instant::now();
    let (t_out, t_grads) = tpu_be.forward_and_vjp(&data.inputs, &data.cotangents, strategy).map_err(err)?;
    println!("  compiled and ran in {:.0} ms", ms(t.elapsed()));
    check("o", &t_out.o, &reference.outputs.o);
    for (name, got) in t_grads.named() {
        let w =
            want.iter().find(|(n, _)| *n == name).ok_or_else(|| format!("the reference has no {name}"))?;
        check(name, got, w.1);
    }
    // The Mosaic kernels, through their interpret lowering (the kernels libtpu compiles, as
    // plain StableHLO), on the same inputs: the forward kernel saving its states and chunk
    // terms, the backward kernel reading them.
    println!("\nthe Mosaic forward and backward kernels (interpret lowering), fused, same check:");
    let kernel_tuning = be.tuning().with_implementation(kda_tpu::Implementation::Interpret);
    let kernel_be = be.clone().with_tuning(kernel_tuning).map_err(err)?;
    crate::progress::step("demo", "compiling and running the Mosaic kernels' interpret lowering...");
    let t = Instant::now();
    let (k_out, k_grads) =
        kernel_be.forward_and_vjp(&data.inputs, &data.cotangents, strategy).map_err(err)?;
    println!("  compiled and ran in {:.0} ms", ms(t.elapsed()));
    check("o", &k_out.o, &reference.outputs.o);
    if let (Some(got), Some(want)) = (&k_out.final_state, &reference.outputs.final_state) {
        check("ht", got, want);
    }
    for (name, got) in k_grads.named() {
        let w =
            want.iter().find(|(n, _)| *n == name).ok_or_else(|| format!("the reference has no {name}"))?;
        check(name, got, w.1);
    }
    if failed.is_empty() {
        println!(
            "demo: PASS ({} quantities within the limits of docs/kda.md; implementations checked: \
             xla (CPU and TPU configurations), the Mosaic forward and backward kernels through \
             their interpret lowering)",
            1 + grads.named().len()
        );
        Ok(())
    } else {
        Err(format!("demo: FAIL: {} outside the limits of docs/kda.md", failed.join(", ")))
    }
}
