//! The compiling side of `cargo xtask aot`.

use super::{compile_aot_replicas, err, kind, problem_of};
use crate::aot_cmd::{AotOptions, Program, Shape};
use crate::bench::Memory;
use kda_testkit::CaseSegments;
use kda_tpu::aot::gpu_model::{kernel_work, ProgramModel, H200_PEAKS};
use kda_tpu::PjrtBackend;

fn mb(bytes: i64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

/// One compiled program, for the closing table.
struct Row {
    program: &'static str,
    kernel_vmem: i64,
    cycles: i64,
    shape: &'static str,
    dtype: String,
    memory: Memory,
    flops: f64,
}

/// `N (kernels M)`, with the loops of unknown trip count when there are any.
fn cycles_line(r: &super::AotFigures) -> String {
    if r.cycles < 0 {
        return "not counted".to_string();
    }
    let mut s = format!("{} (Mosaic kernels {})", r.cycles, r.kernel_cycles);
    if r.unknown_loops > 0 {
        s += &format!(", {} loops of run-time trip count counted once: a lower bound", r.unknown_loops);
    }
    s + "; bundles along the executed path (a model, not a time)"
}

/// The validated problem of `case` in `dtype` and its pieces over `o.devices` devices.
fn pieces(
    o: &AotOptions,
    case: &kda_testkit::Case,
    dtype: kda_core::DType,
) -> Result<(kda_core::Problem, Vec<kda_core::Problem>), String> {
    let problem = problem_of(case, dtype)?;
    let cp = kda_packed::PiecePlan::split(&problem, o.devices).map_err(err)?.1;
    Ok((problem, cp))
}

/// The StableHLO text of `program` of `case` in `dtype` as a TPU runs it (fused programs in
/// slabs), on one device or in the context-parallel form over `o.devices`.
fn program_text(
    o: &AotOptions,
    be: &PjrtBackend,
    (case, dtype): (&kda_testkit::Case, kda_core::DType),
    (problem, cp): (&kda_core::Problem, &[kda_core::Problem]),
    program: crate::aot_cmd::Program,
) -> Result<String, String> {
    let slab = kda_tpu::op::TPU_SLAB;
    let budget = |s: kda_tpu::ProgramSpec| {
        let tuning = match o.packed_result_bytes {
            Some(bytes) => s.tuning.with_packed_result_bytes(bytes),
            None => s.tuning,
        };
        let tuning = if o.packed_windows { tuning.with_packed_blocks(false) } else { tuning };
        let tuning = o.step_chunks.map_or(tuning, |n| tuning.with_step_chunks(n));
        s.with_tuning(tuning)
    };
    if o.devices > 1 {
        let tuning = kda_tpu::Tuning::default().with_slab(slab).with_implementation(o.implementation);
        let cp_spec = kda_tpu::op::context_parallel::local_spec(&cp[0], true, tuning, dtype).map_err(err)?;
        kda_tpu::op::context_parallel::context_parallel_program(&budget(cp_spec), kind(program), o.devices)
            .map_err(err)
    } else {
        let spec = be.spec(problem, case.final_state).map_err(err)?;
        let tuning = spec.tuning.with_slab(slab).with_implementation(o.implementation);
        let spec = spec.with_tuning(tuning);
        kda_tpu::op::program(&budget(spec), kind(program)).map_err(err)
    }
}

/// `--emit DIR`: every program's text into `DIR`, nothing compiled.
fn emit(o: &AotOptions, be: &PjrtBackend, dir: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {dir}: {e}"))?;
    let mut n = 0;
    each_program(o, be, |shape, _, dtype, program, text| {
        let devices = if o.devices > 1 { format!(".d{}", o.devices) } else { String::new() };
        let name =
            format!("{}.{}.{dtype}.{}{devices}.mlir", program.name(), shape.name(), o.implementation.name());
        let path = std::path::Path::new(dir).join(name);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        n += 1;
        Ok(())
    })?;
    println!("wrote {n} program texts to {dir}");
    Ok(())
}

/// Calls `f` on every (shape, its case, dtype, program) of `o` with the program's text.
fn each_program(
    o: &AotOptions,
    be: &PjrtBackend,
    mut f: impl FnMut(Shape, &kda_testkit::Case, kda_core::DType, Program, String) -> Result<(), String>,
) -> Result<(), String> {
    for &shape in &o.shapes {
        let case = o.case(shape);
        for &dtype in &o.dtypes {
            let (problem, cp) = pieces(o, &case, dtype)?;
            for &program in &o.programs {
                let text = program_text(o, be, (&case, dtype), (&problem, &cp), program)?;
                f(shape, &case, dtype, program, text)?;
            }
        }
    }
    Ok(())
}

/// Tokens times heads of `case`: what the model's bytes are counted per.
fn token_heads(case: &kda_testkit::Case) -> f64 {
    (case.h * case.b * case.t) as f64
}

/// The static model of `program`: the compiled program's launches with their bytes, the GPU
/// rows' kernels with their FLOPs and exponentials from the kernels' definitions.
fn gpu_model(
    o: &AotOptions,
    be: &PjrtBackend,
    case: &kda_testkit::Case,
    dtype: kda_core::DType,
    program: crate::aot_cmd::Program,
    compiled: &ProgramModel,
) -> Result<ProgramModel, String> {
    use kda_core::{BackwardStrategy::SavedState, Implementation};
    use kda_tpu::op::ProgramKind;
    let mut model = compiled.clone();
    if !matches!(o.implementation, Implementation::Triton | Implementation::TritonInterpret) {
        return Ok(model);
    }
    // The forward kernels (keeping `h` where a backward reads it; the rematerializing
    // backward runs them again) and the backward's.
    let (forward, keep_h, backward) = match kind(program) {
        ProgramKind::Forward(st) => (true, st == SavedState, false),
        ProgramKind::Backward(_) => (true, true, true),
        ProgramKind::Fused(_) => (true, true, true),
    };
    let (problem, _) = pieces(o, case, dtype)?;
    let spec = be.spec(&problem, case.final_state).map_err(err)?;
    let tuning = spec.tuning.with_implementation(o.implementation);
    let spec = spec.with_tuning(tuning);
    let mut kernels = Vec::new();
    if forward {
        kernels.extend(kda_tpu::op::gpu_forward_kernels(&spec, keep_h).map_err(err)?);
    }
    if backward {
        kernels.extend(kda_tpu::op::gpu_backward_kernels(&spec).map_err(err)?);
    }
    for k in kernels {
        let work = kernel_work(&k);
        if let Some(l) = model.launches.iter_mut().find(|l| l.name == work.name) {
            (l.tensor_flops, l.fma_flops, l.exps) = (work.tensor_flops, work.fma_flops, work.exps);
        }
    }
    Ok(model)
}

/// The model's lines: per launch that moves at least 1% of the bytes or does arithmetic, then
/// the program's sum, per token and head and as floors at the H200's peaks.
fn print_model(model: &ProgramModel, case: &kda_testkit::Case) {
    let th = token_heads(case);
    let total = model.bytes();
    println!("  static model (not a time; floors at H200 peaks: 4.8 TB/s, 989 TFLOP/s, 66.9 TFLOP/s FMA, 4.2 T exp/s):");
    for l in &model.launches {
        let arithmetic = l.tensor_flops + l.fma_flops + l.exps > 0.0;
        if !arithmetic && l.bytes < 0.01 * total {
            continue;
        }
        let f = l.floors(&H200_PEAKS);
        println!(
            "    {:<28} {:>7.0} B/token-head | TC {:>8.2} GFLOP | FMA {:>7.2} GFLOP | exp {:>7.3} G | floor {:>7.1} us (mem {:.1}, TC {:.1}, FMA {:.1}, exp {:.1})",
            l.name,
            l.bytes / th,
            l.tensor_flops / 1e9,
            l.fma_flops / 1e9,
            l.exps / 1e9,
            f.max() * 1e6,
            f.memory * 1e6,
            f.tensor * 1e6,
            f.fma * 1e6,
            f.exp * 1e6
        );
    }
    let f = model.floors(&H200_PEAKS);
    println!(
        "    program: {} launches in the entry computation, {:.0} B per token and head, floor {:.1} us (summed per resource: mem {:.1}, TC {:.1}, FMA {:.1}, exp {:.1})",
        model.launches(),
        model.bytes_per_token_head(th),
        model.floor(&H200_PEAKS) * 1e6,
        f.memory * 1e6,
        f.tensor * 1e6,
        f.fma * 1e6,
        f.exp * 1e6
    );
}

/// `--target`: every (shape, dtype, program) of `o` compiled deviceless for a GPU, with its
/// kernel launches and each kernel's figures.
fn run_gpu(o: &AotOptions, be: &PjrtBackend, target: &str) -> Result<(), String> {
    let target = kda_tpu::aot::gpu::gpu_target(target).map_err(err)?;
    crate::progress::step("aot", format_args!("loading the CUDA plugin..."));
    let dumps = std::env::temp_dir().join(format!("kda-aot-gpu-{}", std::process::id()));
    let gpu = kda_tpu::aot::GpuCompiler::load().map_err(err)?.with_figures(&dumps);
    let (major, minor) = gpu.plugin_version();
    println!(
        "target {} ({}) | CUDA plugin PJRT API {major}.{minor} | MB = 10^6 bytes",
        target.name, target.arch
    );
    let mut records = Vec::new();
    each_program(o, be, |shape, case, dtype, program, text| {
        crate::progress::step(
            "aot",
            format_args!("compiling {} ({} {dtype}) for {}...", program.name(), shape.name(), target.name),
        );
        let r = gpu
            .compile(&text, &target)
            .map_err(|e| format!("{} {} {dtype}: {}", program.name(), shape.name(), err(e)))?;
        let m = r.memory;
        println!(
            "\n{} | {} | {} (H={} B={} T={} K={} V={}) | {dtype} | compiled in {:.1} s",
            program.name(),
            o.implementation.name(),
            shape.name(),
            case.h,
            case.b,
            case.t,
            case.k,
            case.v,
            r.compile_time.as_secs_f64()
        );
        println!(
            "  memory: argument {}, output {}, temp {}, peak {}",
            mb(m.argument_bytes),
            mb(m.output_bytes),
            mb(m.temp_bytes),
            mb(m.peak_bytes)
        );
        let spills: u64 = r.kernels.iter().filter_map(|k| k.spill_store_bytes).sum();
        let regs = r.kernels.iter().filter_map(|k| k.registers).max().unwrap_or(0);
        println!(
            "  kernel launches: {} (each loop body once); most registers {regs}; spill stores {spills} B",
            r.kernels.len()
        );
        let model = gpu_model(o, be, case, dtype, program, &r.model)?;
        print_model(&model, case);
        records.push(serde_json::json!({
            "program": program.name(),
            "implementation": o.implementation.name(),
            "shape": shape.name(),
            "dtype": dtype.to_string(),
            "target": target.name,
            "h": case.h,
            "b": case.b,
            "t": case.t,
            "k": case.k,
            "v": case.v,
            "segments": kda_testkit::inputs::slots(case),
            "peak_bytes": m.peak_bytes,
            "temp_bytes": m.temp_bytes,
            "argument_bytes": m.argument_bytes,
            "output_bytes": m.output_bytes,
            "launches": r.kernels.len(),
            "model_hbm_bytes_per_token_head": model.bytes_per_token_head(token_heads(case)),
            "model_floor_us": model.floor(&H200_PEAKS) * 1e6,
            "kernels": r.kernels.iter().map(|k| serde_json::json!({
                "name": k.name,
                "grid": k.grid,
                "threads": k.threads,
                "registers": k.registers,
                "spill_store_bytes": k.spill_store_bytes,
                "spill_load_bytes": k.spill_load_bytes,
                "shared_memory_bytes": k.shared_memory_bytes,
            })).collect::<Vec<_>>(),
        }));
        Ok(())
    })?;
    let _ = std::fs::remove_dir_all(&dumps);
    if let Some(path) = &o.json {
        let text = serde_json::to_string_pretty(&records).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {path}: {e}"))?;
        println!("wrote {} records to {path}", records.len());
    }
    Ok(())
}

/// Compiles every (shape, dtype, program) of `o` for its topology and prints the figures.
/// A kernel's Mosaic text counts (vreg ops a grid step) for `--json`.
fn text_json(t: &kda_tpu::aot::mosaic_text::TextCounts) -> serde_json::Value {
    serde_json::json!({
        "valu": t.valu,
        "conversions": t.conversions,
        "transcendental": t.transcendental,
        "products": t.products,
        "layout": t.layout,
        "loads": t.loads,
        "stores": t.stores,
        "constants": t.constants,
    })
}

pub fn run(o: &AotOptions) -> Result<(), String> {
    // The CPU plugin only serves `spec()` (the packed capacity plan); nothing runs on it.
    let be = PjrtBackend::new().map_err(err)?;
    if let Some(dir) = &o.emit {
        return emit(o, &be, dir);
    }
    if let Some(target) = &o.target {
        return run_gpu(o, &be, target);
    }
    kda_tpu::aot::check_topology(&o.topology).map_err(err)?;
    crate::progress::step("aot", format_args!("loading libtpu..."));
    let tpu = super::load_tpu(o.libtpu.as_deref())?;
    let (major, minor) = tpu.plugin_version();
    println!("topology {} | libtpu PJRT API {major}.{minor} | MB = 10^6 bytes", o.topology);
    let mut rows = Vec::new();
    let mut records = Vec::new();
    if o.devices > 1 {
        println!("context-parallel programs for {} devices: the memory figures are per device", o.devices);
    }
    for &shape in &o.shapes {
        let case = o.case(shape);
        let segments = match &case.segments {
            CaseSegments::Fixed => "fixed".to_string(),
            CaseSegments::Lengths(r) | CaseSegments::SegmentIds(r) => {
                format!("packed, {} segments", r.iter().map(Vec::len).sum::<usize>())
            }
        };
        let mut options = Vec::new();
        if case.l2norm {
            options.push("q/k L2 norm".to_string());
        }
        if let kda_testkit::CaseGate::LowerBound(lb) = case.gate {
            options.push(format!("lower-bound gate {lb}"));
        }
        let about = format!(
            "H={} B={} T={} K={} V={}, {segments}{}",
            case.h,
            case.b,
            case.t,
            case.k,
            case.v,
            options.iter().map(|x| format!(", {x}")).collect::<String>()
        );
        for &dtype in &o.dtypes {
            let (problem, cp) = pieces(o, &case, dtype)?;
            for &program in &o.programs {
                let text = program_text(o, &be, (&case, dtype), (&problem, &cp), program)?;
                crate::progress::step(
                    "aot",
                    format_args!(
                        "compiling {} ({} {dtype}, {} kB of StableHLO) for {}...",
                        program.name(),
                        shape.name(),
                        text.len() / 1000,
                        o.topology
                    ),
                );
                let r = compile_aot_replicas(&tpu, &text, &o.topology, o.devices)
                    .map_err(|e| format!("{} {} {dtype}: {e}", program.name(), shape.name()))?;
                let m = r.memory;
                let when = if r.cached { " (cached: target/xtask-aot-cache)" } else { "" };
                let devices = if o.devices > 1 { format!(" | {} devices", o.devices) } else { String::new() };
                println!(
                    "\n{} | {} | {} ({about}) | {dtype}{devices} | compiled in {:.1} s{when}",
                    program.name(),
                    o.implementation.name(),
                    shape.name(),
                    r.compile_ms / 1e3
                );
                println!(
                    "  memory: argument {}, output {}, alias {}, temp {}, code {}, peak {} ({} bytes)",
                    mb(m.argument),
                    mb(m.output),
                    mb(m.alias),
                    mb(m.temp),
                    mb(m.code),
                    mb(m.peak),
                    m.peak
                );
                if r.kernels > 0 {
                    println!(
                        "  kernels: {}, scoped VMEM {} ({} bytes)",
                        r.kernels,
                        mb(r.kernel_vmem),
                        r.kernel_vmem
                    );
                }
                println!("  static cycles: {}", cycles_line(&r));
                // Each kernel's Mosaic text counted once, in the order of `per_kernel`.
                let texts = kda_tpu::aot::mosaic_text::kernel_texts(&text).map_err(err)?;
                let counts: Vec<_> = r
                    .per_kernel
                    .iter()
                    .map(|k| {
                        texts
                            .iter()
                            .find(|(n, _)| *n == k.name)
                            .map(|(n, t)| kda_tpu::aot::mosaic_text::count(n, t))
                            .unwrap_or_default()
                    })
                    .collect();
                for (k, t) in r.per_kernel.iter().zip(&counts) {
                    println!(
                        "    kernel {}: {} bundles (model {:.1} us), {:.2} MB of DMA (HBM time {:.1} us at 3.7 TB/s)",
                        k.name,
                        k.bundles,
                        k.model_us(),
                        k.dma_bytes as f64 / 1e6,
                        k.hbm_us()
                    );
                    let [valu, stores, loads, mxu, eup] = k.units;
                    println!(
                        "      by unit: {valu} vector ALU ops, {stores} spill stores, {loads} spill loads, \
                         {mxu} MXU pushes, {eup} transcendental pushes"
                    );
                    println!(
                        "      Mosaic text, vreg ops a grid step: {} vector ALU, {} conversions, {} \
                         transcendental, {} product results, {} layout, {} loads, {} stores, {} constants",
                        t.valu,
                        t.conversions,
                        t.transcendental,
                        t.products,
                        t.layout,
                        t.loads,
                        t.stores,
                        t.constants
                    );
                }
                println!(
                    "  cost:   {:.3} GFLOP, {:.3} GB accessed (optimal_seconds {:.3e}: not \
                     meaningful for programs with while loops)",
                    r.flops / 1e9,
                    r.bytes_accessed / 1e9,
                    r.optimal_seconds
                );
                records.push(serde_json::json!({
                    "program": program.name(),
                    "implementation": o.implementation.name(),
                    "shape": shape.name(),
                    "dtype": dtype.to_string(),
                    "devices": o.devices,
                    "topology": o.topology,
                    "h": case.h,
                    "b": case.b,
                    "t": case.t,
                    "k": case.k,
                    "v": case.v,
                    "segments": kda_testkit::inputs::slots(&case),
                    "local_t": if o.devices > 1 { cp[0].dims.t } else { problem.dims.t },
                    "peak_bytes": m.peak,
                    "temp_bytes": m.temp,
                    "argument_bytes": m.argument,
                    "output_bytes": m.output,
                    "code_bytes": m.code,
                    "kernel_vmem_bytes": r.kernel_vmem,
                    "static_cycles": r.cycles,
                    "kernel_cycles": r.kernel_cycles,
                    "unknown_trip_loops": r.unknown_loops,
                    "dma_bytes": r.dma_bytes,
                    "kernels": r.per_kernel.iter().zip(&counts).map(|(k, t)| serde_json::json!({
                        "name": k.name,
                        "bundles": k.bundles,
                        "dma_bytes": k.dma_bytes,
                        "model_us": k.model_us(),
                        "hbm_us": k.hbm_us(),
                        "valu_ops": k.units[0],
                        "spill_stores": k.units[1],
                        "spill_loads": k.units[2],
                        "mxu_pushes": k.units[3],
                        "transcendental_pushes": k.units[4],
                        "text": text_json(t),
                    })).collect::<Vec<_>>(),
                    "gflop": r.flops / 1e9,
                }));
                rows.push(Row {
                    program: program.name(),
                    kernel_vmem: r.kernel_vmem,
                    cycles: r.cycles,
                    shape: shape.name(),
                    dtype: dtype.to_string(),
                    memory: m,
                    flops: r.flops,
                });
            }
        }
    }
    if let Some(path) = &o.json {
        let text = serde_json::to_string_pretty(&records).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {path}: {e}"))?;
        println!("wrote {} records to {path}", records.len());
    }
    if rows.len() > 1 {
        println!(
            "\n{:<21} {:<17} {:<5} {:>12} {:>12} {:>9} {:>9} {:>9} {:>12}",
            "program", "shape", "dtype", "peak MB", "temp MB", "code MB", "VMEM MB", "GFLOP", "k cycles"
        );
        for r in &rows {
            println!(
                "{:<21} {:<17} {:<5} {:>12.2} {:>12.2} {:>9.2} {:>9.2} {:>9.3} {:>12.1}",
                r.program,
                r.shape,
                r.dtype,
                r.memory.peak as f64 / 1e6,
                r.memory.temp as f64 / 1e6,
                r.memory.code as f64 / 1e6,
                r.kernel_vmem as f64 / 1e6,
                r.flops / 1e9,
                r.cycles as f64 / 1e3
            );
        }
    }
    Ok(())
}
