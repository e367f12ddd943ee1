//! The measuring side of `cargo xtask bench`.

use super::{backend_label, compile_aot, compile_aot_replicas, err, memory, ms};
use crate::bench::{
    console_table, write_json, BenchOptions, BenchRecord, ProgramFigures, RunInfo, Suite, TpuFigures,
    Variant, TOPOLOGY,
};
use crate::machine::Machine;
use kda_core::{BackwardStrategy, DType};
use kda_testkit::{benchmark_cases, case_data, Case, CaseSegments};
use kda_tpu::backend::harness::DeviceCall;
use kda_tpu::{DeviceTensor, PjrtBackend, ProgramKind, TpuCompiler};
use std::time::Instant;

/// The programs a variant runs, with their names in the report.
fn programs(variant: Variant) -> Vec<(&'static str, ProgramKind)> {
    use BackwardStrategy::{Rematerialize, SavedState};
    match variant {
        Variant::Forward | Variant::ForwardMosaic => {
            vec![("forward", ProgramKind::Forward(BackwardStrategy::Rematerialize))]
        }
        Variant::Baseline => {
            vec![
                ("forward", ProgramKind::Forward(BackwardStrategy::SavedState)),
                ("backward", ProgramKind::Backward(SavedState)),
            ]
        }
        Variant::FusedSavedState | Variant::FusedMosaic => vec![("fused", ProgramKind::Fused(SavedState))],
        Variant::FusedRemat => vec![("fused", ProgramKind::Fused(Rematerialize))],
        // The api suite times these itself (`measure_api`).
        Variant::DeviceApi | Variant::HostApi | Variant::HostCopy => vec![],
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
                    // What a TPU runs: fused programs in slabs (`PjrtBackend` off the CPU plugin),
                    // the Mosaic lowering of a kernel the CPU runs interpreted.
                    let mut tuning = spec.tuning.with_slab(kda_tpu::op::TPU_SLAB);
                    if matches!(variant, Variant::ForwardMosaic | Variant::FusedMosaic) {
                        tuning = tuning.with_implementation(kda_tpu::Implementation::Mosaic);
                    }
                    let tpu_spec = spec.clone().with_tuning(tuning);
                    let text = kda_tpu::op::program(&tpu_spec, kind).map_err(err)?;
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
                        devices: 1,
                        flops: f.flops,
                        bytes_accessed: f.bytes_accessed,
                        compile_ms: f.compile_ms,
                        cycles: (f.cycles >= 0).then_some(f.cycles),
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
                        self.call.run_staged(self.be, BackwardStrategy::SavedState).map_err(err)?;
                    fwd.extend(bwd);
                    Ok(fwd)
                }
                _ => self.call.run(self.be, kind, None).map_err(err),
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
            devices: 1,
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

/// The `api` suite on one case and dtype: the fused saved-state program alone, the device
/// API, the host API and one host copy of the call's input and output bytes, timed in
/// alternation (one of each per round) so that drift of the shared machine hits all four alike.
fn measure_api(
    be: &PjrtBackend,
    case: &Case,
    dtype: DType,
    data: &kda_testkit::CaseData,
    iterations: usize,
) -> Result<Vec<BenchRecord>, String> {
    let label = format!("{} api {dtype}", case.name);
    let strategy = BackwardStrategy::SavedState;
    let kind = ProgramKind::Fused(strategy);
    let call = DeviceCall::upload(be, &data.inputs, Some(&data.cotangents)).map_err(err)?;
    crate::progress::step("bench", format_args!("{label}: compiling the fused program..."));
    be.prepare(call.spec(), &[kind]).map_err(err)?;
    let x = be.to_device(&data.inputs, 0).map_err(err)?;
    let c = be.to_device(&data.cotangents, 0).map_err(err)?;
    let (outputs, grads) = be.forward_and_vjp(&data.inputs, &data.cotangents, strategy).map_err(err)?;
    let mut host: Vec<&kda_core::HostTensor> = vec![&data.inputs.q, &data.inputs.k, &data.inputs.v];
    host.extend([&data.inputs.g, &data.inputs.beta, &data.cotangents.d_o, &outputs.o]);
    host.extend(grads.named().into_iter().map(|(_, t)| t));
    let bytes: usize = host.iter().map(|t| t.as_bytes().len()).sum();
    let variants = [Variant::FusedSavedState, Variant::DeviceApi, Variant::HostApi, Variant::HostCopy];
    let mut times = vec![Vec::with_capacity(iterations); variants.len()];
    crate::progress::step(
        "bench",
        format_args!(
            "{label}: {iterations} rounds of program / device API / host API / host copy ({bytes} bytes)..."
        ),
    );
    for round in 0..=iterations {
        for (i, v) in variants.iter().enumerate() {
            let t = Instant::now();
            match v {
                Variant::FusedSavedState => drop(call.run(be, kind, None).map_err(err)?),
                Variant::DeviceApi => drop(be.forward_and_vjp(&x, &c, strategy).map_err(err)?),
                Variant::HostApi => {
                    drop(be.forward_and_vjp(&data.inputs, &data.cotangents, strategy).map_err(err)?)
                }
                _ => drop(std::hint::black_box(host.iter().map(|t| (*t).clone()).collect::<Vec<_>>())),
            }
            // Round 0 is the warm-up.
            if round > 0 {
                times[i].push(ms(t.elapsed()));
            }
        }
    }
    if case.segments == CaseSegments::Fixed && dtype == DType::F32 {
        threads_throughput(be, data, iterations)?;
    }
    let segments = match &case.segments {
        CaseSegments::Fixed => None,
        CaseSegments::Lengths(rows) | CaseSegments::SegmentIds(rows) => rows.first().cloned(),
    };
    Ok(variants
        .into_iter()
        .zip(times)
        .map(|(variant, times_ms)| BenchRecord {
            suite: Suite::Api,
            variant,
            dtype,
            case: case.name.to_string(),
            shape: [case.h, case.b, case.t, case.k, case.v],
            segments: segments.clone(),
            times_ms,
            programs: Vec::new(),
            devices: 1,
        })
        .collect())
}

/// The tpu7x devices of the context-parallel memory figures: the four chips of one
/// `tpu7x:2x2x1` host, as in docs/kda.md Context parallelism's targets.
const TPU_CP_DEVICES: usize = 4;

/// The figures of one program for the TPU: compiled deviceless for `replicas` devices.
fn tpu_figures(tpu: &TpuCompiler, text: &str, replicas: usize, label: &str) -> Result<TpuFigures, String> {
    crate::progress::step(
        "bench",
        format_args!("{label}: compiling for {TOPOLOGY}, {replicas} device(s) (minutes for several)..."),
    );
    let f = compile_aot_replicas(tpu, text, TOPOLOGY, replicas)
        .map_err(|e| format!("{label}: {TOPOLOGY} compile for {replicas} devices: {e}"))?;
    Ok(TpuFigures {
        memory: f.memory,
        devices: replicas,
        flops: f.flops,
        bytes_accessed: f.bytes_accessed,
        compile_ms: f.compile_ms,
        cycles: (f.cycles >= 0).then_some(f.cycles),
    })
}

/// Memory per device of the scaling suite's calls: the fused saved-state program on one device
/// (CPU, and tpu7x for one device) and its context-parallel form (CPU for `cp`'s devices,
/// tpu7x for [`TPU_CP_DEVICES`]), in the record form.
fn device_memory(
    be: &PjrtBackend,
    cp: &PjrtBackend,
    tpu: Option<&TpuCompiler>,
    data: &kda_testkit::CaseData,
    dtype: DType,
    label: &str,
) -> Result<[ProgramFigures; 2], String> {
    use kda_tpu::op::context_parallel::{context_parallel_program, local_spec};
    use kda_tpu::op::TPU_SLAB;
    let kind = ProgramKind::Fused(BackwardStrategy::SavedState);
    let has_dht = data.cotangents.dht.is_some();
    let problem = data.inputs.view().validate().map_err(err)?;
    let spec = be.spec(&problem, has_dht).map_err(err)?;
    let cp_text = |devices: usize, slab: usize| -> Result<String, String> {
        let locals = kda_packed::PiecePlan::split(&problem, devices).map_err(err)?.1;
        // A piece always takes `dht` (its carry slot's ending `dh` comes in through it).
        let s =
            local_spec(&locals[0], true, kda_tpu::Tuning::default().with_slab(slab), dtype).map_err(err)?;
        context_parallel_program(&s, kind, devices).map_err(err)
    };
    let single_cpu = memory(&be.memory_stats(&spec, kind).map_err(err)?);
    let n = cp.device_count();
    crate::progress::step(
        "bench",
        format_args!("{label}: compiling the context-parallel program for {n} CPU devices..."),
    );
    let rt = kda_tpu::Runtime::with_devices(n).map_err(err)?;
    let t = Instant::now();
    let exe = rt
        .compile_with(&cp_text(n, 0)?, &kda_tpu::backend::harness::compile_options(cp, kind).with_replicas(n))
        .map_err(err)?;
    let cp_compile_ms = ms(t.elapsed());
    let cp_cpu = memory(&rt.memory_stats(&exe).map_err(err)?);
    let (single_tpu, cp_tpu) = match tpu {
        None => (None, None),
        Some(c) => {
            let tpu_spec = spec.clone().with_tuning(spec.tuning.with_slab(TPU_SLAB));
            let text = kda_tpu::op::program(&tpu_spec, kind).map_err(err)?;
            let single = tpu_figures(c, &text, 1, label)?;
            let many = tpu_figures(c, &cp_text(TPU_CP_DEVICES, TPU_SLAB)?, TPU_CP_DEVICES, label)?;
            (Some(single), Some(many))
        }
    };
    let kind_text = format!("{kind:?}");
    Ok([
        ProgramFigures {
            name: "fused",
            kind: kind_text.clone(),
            compile_ms: 0.0,
            cpu: single_cpu,
            tpu: single_tpu,
        },
        ProgramFigures {
            name: "context-parallel fused",
            kind: kind_text,
            compile_ms: cp_compile_ms,
            cpu: cp_cpu,
            tpu: cp_tpu,
        },
    ])
}

/// The scaling suite's calls through the host API on one device and, context-parallel, on two
/// (`cp`): fixed length and packed (one segment per 256 tokens), timed in alternation, with
/// their programs' memory per device ([`device_memory`]).
fn measure_devices(
    be: &PjrtBackend,
    cp: &PjrtBackend,
    tpu: Option<&TpuCompiler>,
    case: &Case,
    dtype: DType,
    iterations: usize,
) -> Result<Vec<BenchRecord>, String> {
    let strategy = BackwardStrategy::SavedState;
    let packed = Case {
        segments: CaseSegments::Lengths(vec![kda_testkit::cases::balanced(case.t, case.t / 256)]),
        ..case.clone()
    };
    let mut out = Vec::new();
    for c in [case, &packed] {
        let data = case_data(c, dtype).map_err(err)?;
        let label = format!("{} {} {dtype}", c.name, if c.is_packed() { "packed" } else { "fixed" });
        crate::progress::step("bench", format_args!("{label}: host API on 1 and 2 devices, compiling..."));
        let mut times = [Vec::with_capacity(iterations), Vec::with_capacity(iterations)];
        for round in 0..=iterations {
            for (i, b) in [be, cp].into_iter().enumerate() {
                let t = Instant::now();
                drop(b.forward_and_vjp(&data.inputs, &data.cotangents, strategy).map_err(err)?);
                if round > 0 {
                    times[i].push(ms(t.elapsed()));
                }
            }
            if round == 0 {
                crate::progress::step("bench", format_args!("{label}: timing {iterations} rounds..."));
            }
        }
        let segments = match &c.segments {
            CaseSegments::Fixed => None,
            CaseSegments::Lengths(rows) | CaseSegments::SegmentIds(rows) => rows.first().cloned(),
        };
        let figures = device_memory(be, cp, tpu, &data, dtype, &label)?;
        for ((devices, times_ms), program) in [1, 2].into_iter().zip(times).zip(figures) {
            out.push(BenchRecord {
                suite: Suite::Scaling,
                variant: Variant::HostApi,
                dtype,
                case: case.name.to_string(),
                shape: [c.h, c.b, c.t, c.k, c.v],
                segments: segments.clone(),
                times_ms,
                programs: vec![program],
                devices,
            });
        }
    }
    Ok(out)
}

/// Host-API fused calls per second from 1, 2 and 8 threads sharing one handle (each thread
/// makes `iterations` calls). Calls run one at a time on the handle's device worker, so more
/// threads overlap only their host-side work (validation, copies) with the device's.
fn threads_throughput(
    be: &PjrtBackend,
    data: &kda_testkit::CaseData,
    iterations: usize,
) -> Result<(), String> {
    for n in [1usize, 2, 8] {
        let t = Instant::now();
        std::thread::scope(|scope| -> Result<(), String> {
            let workers: Vec<_> = (0..n)
                .map(|_| {
                    scope.spawn(|| -> Result<(), String> {
                        for _ in 0..iterations {
                            drop(
                                be.forward_and_vjp(
                                    &data.inputs,
                                    &data.cotangents,
                                    BackwardStrategy::SavedState,
                                )
                                .map_err(err)?,
                            );
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().map_err(|_| "a bench thread panicked".to_string())?)
        })?;
        let secs = t.elapsed().as_secs_f64();
        println!(
            "threads on one handle: {n} x {iterations} fused host-API calls in {secs:.2} s: {:.1} calls/s",
            (n * iterations) as f64 / secs
        );
    }
    Ok(())
}

/// Runs the suites of `opts`; `args` (the flags as typed) go into the report.
pub fn run(opts: &BenchOptions, args: &[String]) -> Result<(), String> {
    let machine = Machine::collect();
    let tpu = if opts.aot {
        crate::progress::step("bench", format_args!("loading libtpu for the {TOPOLOGY} compiles..."));
        // With libtpu's bundle listings on: every compile reports its static cycles.
        let c =
            super::load_tpu(None).map_err(|e| format!("{e}\n(pass --no-aot to skip the TPU compiles)"))?;
        Some(c)
    } else {
        None
    };
    let be = super::timing_backend()?;
    let cp = if opts.suites.contains(&Suite::Scaling) {
        crate::progress::step(
            "bench",
            format_args!("starting a second handle with 2 CPU devices (context parallel)..."),
        );
        Some(
            kda_tpu::PjrtOptions::new()
                .devices(2)
                .split(kda_tpu::Split::Context)
                .retain_host_memory(true)
                .build()
                .map_err(err)?,
        )
    } else {
        None
    };
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
                if suite == Suite::Api {
                    records.extend(measure_api(&be, &case, dtype, &data, opts.iterations)?);
                    continue;
                }
                let cot = (suite != Suite::Forward).then_some(&data.cotangents);
                let call = DeviceCall::upload(&be, &data.inputs, cot).map_err(err)?;
                let m = Measure { be: &be, tpu: tpu.as_ref(), call: &call, iterations: opts.iterations };
                for variant in suite.variants(opts.baseline) {
                    if matches!(variant, Variant::ForwardMosaic | Variant::FusedMosaic) {
                        // The kernels' interpret lowering on this plugin, its own handle and call.
                        let tuning = be.tuning().with_implementation(kda_tpu::Implementation::Interpret);
                        let be = be.clone().with_tuning(tuning).map_err(err)?;
                        let call = DeviceCall::upload(&be, &data.inputs, cot).map_err(err)?;
                        let m =
                            Measure { be: &be, tpu: tpu.as_ref(), call: &call, iterations: opts.iterations };
                        records.push(m.run(suite, variant, &case, dtype)?);
                        continue;
                    }
                    records.push(m.run(suite, variant, &case, dtype)?);
                }
                if let (Suite::Scaling, Some(cp)) = (suite, &cp) {
                    drop(call);
                    records.extend(measure_devices(&be, cp, tpu.as_ref(), &case, dtype, opts.iterations)?);
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
        if suite == Suite::Api {
            print!("\n{}", crate::bench::api_summary(&records));
        }
        all.extend(records);
    }
    if let Some(path) = &opts.markdown {
        let entries = all.iter().map(|r| (r.clone(), info.clone())).collect();
        for written in crate::results::update(path, entries)? {
            crate::progress::step("bench", format_args!("wrote {}", written.display()));
        }
    }
    if let Some(path) = &opts.json {
        write_json(path, &all, &info)?;
        crate::progress::step("bench", format_args!("wrote {} records to {}", all.len(), path.display()));
    }
    Ok(())
}
