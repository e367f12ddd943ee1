//! `cargo xtask demo`: KDA forward+VJP at the primary benchmark shape (docs/kda.md, Benchmarks), checked
//! against the f64 reference, with timings.

use kda_core::{DType, KdaGradients, KdaInputs, KdaOutputs};
use kda_testkit::{agreement, benchmark_cases, case_data, widen, CaseData, Rng};
use std::time::Instant;

/// A central-difference spot check of a few gradient entries of the f64 reference.
fn finite_difference_spot_check(
    inputs: &KdaInputs,
    cot: &kda_core::Cotangents,
    grads: &KdaGradients,
) -> Result<(), String> {
    let e = |e: kda_core::KdaError| e.to_string();
    let mut rng = Rng::new(2026);
    println!("finite-difference spot check of the reference (f64, central, eps 1e-6):");
    let mut worst: f64 = 0.0;
    for (name, g) in grads.named() {
        if !["dq", "dk", "dv", "dg", "dbeta"].contains(&name) {
            continue;
        }
        let i = (rng.next_u64() % g.len() as u64) as usize;
        let bump = |delta: f64| -> Result<f64, String> {
            let mut x = inputs.clone();
            let t = match name {
                "dq" => &mut x.q,
                "dk" => &mut x.k,
                "dv" => &mut x.v,
                "dg" => &mut x.g,
                _ => &mut x.beta,
            };
            let mut d = t.to_f64_vec();
            d[i] += delta;
            *t = kda_core::HostTensor::from_f64(t.shape(), d).map_err(e)?;
            kda_ref::loss(&x, cot).map_err(e)
        };
        let fd = (bump(1e-6)? - bump(-1e-6)?) / 2e-6;
        let an = g.get_f64(i);
        let rel = (fd - an).abs() / an.abs().max(1e-3);
        worst = worst.max(rel);
        println!(
            "  {name:>5}[{i:>7}]: analytic {an:+.9e}  finite difference {fd:+.9e}  rel. error {rel:.1e}"
        );
    }
    if worst > 1e-5 {
        return Err(format!("finite-difference spot check failed: worst relative error {worst:.1e}"));
    }
    Ok(())
}

/// The usage text.
pub const USAGE: &str = "\
usage: cargo xtask demo [--ref-only]

KDA forward+VJP at the primary benchmark shape (docs/kda.md, Benchmarks; f32): the f64 reference with a
finite-difference spot check, then the PJRT backend's fused saved-state forward+VJP on the CPU
plugin (compile time, median of 5 runs), checked against the reference at the limits of docs/kda.md.

options:
  --ref-only   only the reference part (no PJRT build needed)
  -h, --help   show this text";

/// The reference part's results, for the PJRT part to compare with.
pub struct Reference {
    /// Its f32 inputs and cotangents.
    pub data: CaseData,
    /// The f64 reference on the inputs widened to f64.
    pub outputs: KdaOutputs,
    /// Its gradients.
    pub grads: KdaGradients,
    /// Wall time of the reference forward+VJP.
    pub ms: f64,
}

/// The reference part: the f64 reference forward+VJP at the primary shape, how far f32 rounding of
/// its results is from f64, and a finite-difference spot check of its gradients.
pub fn reference() -> Result<Reference, String> {
    let case = benchmark_cases().into_iter().next().ok_or("no benchmark case")?;
    println!(
        "KDA forward+VJP, primary benchmark shape: H={} B={} T={} K={} V={} (f32 inputs)",
        case.h, case.b, case.t, case.k, case.v
    );
    let data = case_data(&case, DType::F32).map_err(|e| e.to_string())?;
    let wide = widen(&data).map_err(|e| e.to_string())?;
    crate::progress::step("demo", "the f64 reference forward+VJP (single thread)...");
    let t = Instant::now();
    let (outputs, grads) =
        kda_ref::forward_and_vjp(&wide.inputs, &wide.cotangents).map_err(|e| e.to_string())?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    println!("reference forward+VJP: {ms:.0} ms (f64 token recurrence, single thread)");
    println!("f32-rounded reference results vs f64 (RMS ratio, max abs):");
    let a = agreement(&outputs.o.cast(DType::F32).map_err(|e| e.to_string())?, &outputs.o.to_f64_vec());
    println!("  {:>6}: {:.2e}  {:.2e}", "o", a.rms_ratio, a.max_abs);
    for (n, g) in grads.named() {
        let a = agreement(&g.cast(DType::F32).map_err(|e| e.to_string())?, &g.to_f64_vec());
        println!("  {n:>6}: {:.2e}  {:.2e}", a.rms_ratio, a.max_abs);
    }
    finite_difference_spot_check(&wide.inputs, &wide.cotangents, &grads)?;
    Ok(Reference { data, outputs, grads, ms })
}
