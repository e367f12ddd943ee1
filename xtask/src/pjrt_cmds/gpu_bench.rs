//! The measuring side of `cargo xtask gpu-bench`.

use super::{backend_label, err, ms};
use crate::gpu_bench::{BenchProgram, GpuBenchOptions};
use kda_core::BackwardStrategy;
use kda_testkit::{benchmark_cases, case_data};
use kda_tpu::backend::harness::DeviceCall;
use kda_tpu::ProgramKind;
use std::time::Instant;

/// Times every (shape, dtype, implementation, program) of `o` and prints one line each.
pub fn run(o: &GpuBenchOptions) -> Result<(), String> {
    let be = super::timing_backend()?;
    println!("backend: {} | platform {}", backend_label(&be), be.platform());
    let mut records = Vec::new();
    for &name in &o.cases {
        let case = benchmark_cases()
            .into_iter()
            .find(|c| c.name == name)
            .ok_or_else(|| format!("kda_testkit::benchmark_cases has no `{name}`"))?;
        for &dtype in &o.dtypes {
            crate::progress::step("gpu-bench", format_args!("{name} {dtype}: preparing inputs..."));
            let data = case_data(&case, dtype).map_err(err)?;
            for &implementation in &o.implementations {
                let label = format!("{name} {dtype} {}", implementation.name());
                let tuning = be.tuning().with_implementation(implementation);
                let be = be.clone().with_tuning(tuning).map_err(err)?;
                let call = DeviceCall::upload(&be, &data.inputs, Some(&data.cotangents)).map_err(err)?;
                for &program in &o.programs {
                    let label = format!("{label} {}", program.name());
                    let kind = match program {
                        BenchProgram::Forward => ProgramKind::Forward(BackwardStrategy::Rematerialize),
                        BenchProgram::Fused => ProgramKind::Fused(BackwardStrategy::SavedState),
                    };
                    crate::progress::step("gpu-bench", format_args!("{label}: compiling..."));
                    let t = Instant::now();
                    be.prepare(call.spec(), &[kind]).map_err(err)?;
                    let compile_ms = ms(t.elapsed());
                    drop(call.run(&be, kind, None).map_err(err)?);
                    let mut times: Vec<f64> = Vec::with_capacity(o.iterations);
                    for _ in 0..o.iterations {
                        let t = Instant::now();
                        let out = call.run(&be, kind, None).map_err(err)?;
                        times.push(ms(t.elapsed()));
                        drop(out);
                    }
                    let mut sorted = times.clone();
                    sorted.sort_by(f64::total_cmp);
                    let median = sorted[sorted.len() / 2];
                    println!(
                        "{label}: median {median:.3} ms (min {:.3}, max {:.3}) over {} runs; compiled in {compile_ms:.0} ms",
                        sorted[0],
                        sorted[sorted.len() - 1],
                        sorted.len()
                    );
                    records.push(serde_json::json!({
                        "case": name,
                        "dtype": dtype.to_string(),
                        "implementation": implementation.name(),
                        "program": program.name(),
                        "platform": be.platform(),
                        "shape": [case.h, case.b, case.t, case.k, case.v],
                        "times_ms": times,
                        "median_ms": median,
                        "compile_ms": compile_ms,
                    }));
                }
            }
        }
    }
    if let Some(path) = &o.json {
        let text = serde_json::to_string_pretty(&records).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {path}: {e}"))?;
        println!("wrote {} records to {path}", records.len());
    }
    Ok(())
}
