//! The measuring side of `cargo xtask bench`.

use super::{backend_label, compile_aot, err, memory, ms};
use crate::bench::{
    console_table, markdown_section, write_json, write_markdown, BenchOptions, BenchRecord, ProgramFigures,
    RunInfo, Suite, TpuFigures, Variant, TOPOLOGY,
};
use crate::machine::Machine;
use kda_core::{BackwardStrategy, DType};
use kda_testkit::{benchmark_cases, case_data, Case, CaseSegments};
use kda_tpu::{DeviceCall, DeviceTensor, PjrtBackend, ProgramKind, TpuCompiler};
use std::time::Instant;

/// The programs a variant runs, with their names in the report.
fn programs(variant: Variant) -> Vec<(&'static str, ProgramKind)> {
    use BackwardStrategy::{Rematerialize, SavedState};
    match variant {
        Variant::Forward => vec![("forward", ProgramKind::Forward(false))],
        Variant::Baseline => {
            vec![("forward", ProgramKind::Forward(true)), ("backward", ProgramKind::Backward(SavedState))]
        }
        Variant::FusedSavedState => vec![("fused", ProgramKind::Fused(SavedState))],
        Variant::FusedRemat => vec![("fused", ProgramKind::Fused(Rematerialize))],
    }
}

/// One variant on one uploaded call: compile (CPU, and tpu7x unless `tpu` is `None`), one warm-up
/// run, then `iterations` timed runs.
struct Measure<'a> {
    be: &'a PjrtBackend,
    tpu: Option<&'a TpuCompiler>,
    call: &'a DeviceCall,
    iterations: usize,
}

impl Measure<'_> {
    fn run(&self, suite: Suite, variant: Variant, case: &Case, dtype: DType) -> Result<BenchRecord, String> {
        let label = format!("{} {} {dtype}", case.name, variant.name());
        let spec = self.call.spec();
        let mut figures = Vec::new();
        for (name, kind) in programs(variant) {
            crate::progress::step(
                "bench",
                format_args!("{label}: compiling the {name} program for {}...", self.be.platform()),
            );
            let t = Instant::now();
            self.be.prepare(spec, &[kind]).map_err(err)?;
            let compile_ms = ms(t.elapsed());
            let cpu = memory(&self.be.memory_stats(spec, kind).map_err(err)?);
            let tpu = match self.tpu {
                None => None,
                Some(c) => {
                    crate::progress::step(
                        "bench",
                        format_args!("{label}: compiling the {name} program for {TOPOLOGY}..."),
                    );
                    // What a TPU runs: fused programs in slabs (`PjrtBackend` off the CPU plugin).
                    let tpu_spec = spec.clone().with_slab(kda_tpu::kernels::TPU_SLAB);
                    let text = PjrtBackend::program_text(&tpu_spec, kind).map_err(err)?;
                    let f = compile_aot(c, &text, TOPOLOGY)
                        .map_err(|e| format!("{label}: {TOPOLOGY} compile: {e}"))?;
                    if f.cached {
                        crate::progress::step(
                            "bench",
                            format_args!("{label}: (figures from target/xtask-aot-cache)"),
                        );
                    }
                    Some(TpuFigures {
                        memory: f.memory,
                        flops: f.flops,
                        bytes_accessed: f.bytes_accessed,
                        compile_ms: f.compile_ms,
                    })
                }
            };
            figures.push(ProgramFigures { name, kind: format!("{kind:?}"), compile_ms, cpu, tpu });
        }
        let kind = programs(variant)[0].1;
        // Runs return after PJRT's execution-complete event (`run_sync`): the whole execution is
        // inside the timed span. Outputs are dropped after the clock stops.
        let once = || -> Result<Vec<DeviceTensor>, String> {
            match variant {
                Variant::Baseline => {
                    let (mut fwd, bwd) =
                        self.be.run_staged(self.call, BackwardStrategy::SavedState).map_err(err)?;
                    fwd.extend(bwd);
                    Ok(fwd)
                }
                _ => self.be.run_program(self.call, kind, None).map_err(err),
            }
        };
        crate::progress::step("bench", format_args!("{label}: warm-up run..."));
        drop(once()?);
        crate::progress::step("bench", format_args!("{label}: timing {} runs...", self.iterations));
        let mut times_ms = Vec::with_capacity(self.iterations);
        for _ in 0..self.iterations {
            let t = Instant::now();
            let out = once()?;
            times_ms.push(ms(t.elapsed()));
            drop(out);
        }
        let segments = match &case.segments {
            CaseSegments::Fixed => None,
            CaseSegments::Lengths(rows) | CaseSegments::SegmentIds(rows) => rows.first().cloned(),
        };
        let record = BenchRecord {
            suite,
            variant,
            dtype,
            case: case.name.to_string(),
            shape: [case.h, case.b, case.t, case.k, case.v],
            segments,
            times_ms,
            programs: figures,
        };
        crate::progress::step(
            "bench",
            format_args!(
                "{label}: median {:.2} ms (min {:.2}, max {:.2})",
                record.median_ms(),
                record.min_ms(),
                record.max_ms()
            ),
        );
        Ok(record)
    }
}

/// Runs the suites of `opts`; `args` (the flags as typed) go into the report.
pub fn run(opts: &BenchOptions, args: &[String]) -> Result<(), String> {
    let machine = Machine::collect();
    let tpu = if opts.aot {
        crate::progress::step("bench", format_args!("loading libtpu for the {TOPOLOGY} compiles..."));
        let c = TpuCompiler::load().map_err(|e| format!("{e}\n(pass --no-aot to skip the TPU compiles)"))?;
        Some(c)
    } else {
        None
    };
    let be = super::timing_backend()?;
    let info = RunInfo {
        machine,
        command: format!("cargo xtask bench {}", args.join(" ")),
        plugin: backend_label(&be),
        libtpu: tpu.as_ref().map(|c| {
            let (major, minor) = c.plugin_version();
            format!("libtpu, PJRT API {major}.{minor}")
        }),
    };
    println!("machine: {} | {} | commit {}", info.machine.summary(), info.machine.date, info.machine.commit);
    println!("backend: {}", info.plugin);
    match &info.libtpu {
        Some(t) => println!("tpu7x figures: deviceless compiles for {TOPOLOGY} ({t})"),
        None => println!("tpu7x figures: skipped (--no-aot)"),
    }

    let mut all = Vec::new();
    for &suite in &opts.suites {
        let mut records = Vec::new();
        for &name in suite.cases() {
            let case = benchmark_cases()
                .into_iter()
                .find(|c| c.name == name)
                .ok_or_else(|| format!("kda_testkit::benchmark_cases has no `{name}`"))?;
            for &dtype in &opts.dtypes {
                crate::progress::step(
                    "bench",
                    format_args!("{name} {dtype}: preparing and uploading inputs..."),
                );
                let data = case_data(&case, dtype).map_err(err)?;
                let cot = (suite != Suite::Forward).then_some(&data.cotangents);
                let call = be.upload_call(&data.inputs, cot).map_err(err)?;
                let m = Measure { be: &be, tpu: tpu.as_ref(), call: &call, iterations: opts.iterations };
                for variant in suite.variants(opts.baseline) {
                    records.push(m.run(suite, variant, &case, dtype)?);
                }
            }
        }
        println!(
            "\nsuite {}: {} timed runs per variant (MB = 10^6 bytes; the CPU plugin's peak counts arguments \
             and outputs, its scratch is CPU temp; baseline: the larger of its two programs)",
            suite.name(),
            opts.iterations
        );
        print!("{}", console_table(&records));
        if let Some(path) = &opts.markdown {
            write_markdown(path, suite, &markdown_section(suite, &records, &info))?;
            crate::progress::step(
                "bench",
                format_args!("wrote the `{}` section of {}", suite.name(), path.display()),
            );
        }
        all.extend(records);
    }
    if let Some(path) = &opts.json {
        write_json(path, &all, &info)?;
        crate::progress::step("bench", format_args!("wrote {} records to {}", all.len(), path.display()));
    }
    Ok(())
}
