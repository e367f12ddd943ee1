//! The PJRT side of `bench`, `aot` and `demo` (built with the `pjrt` feature only: kda-tpu's
//! build needs the header `cargo xtask setup` installs).

pub mod aot;
pub mod bench;
pub mod demo;
pub mod gpu_bench;

use crate::aot_cmd::Program;
use crate::bench::Memory;
use kda_core::{Backend, BackwardStrategy, DType, KdaConfig, Segments};
use kda_testkit::{Case, CaseGate, CaseSegments};
use kda_tpu::{MemoryStats, PjrtBackend, ProgramKind, TpuCompiler};
use std::path::PathBuf;
use std::time::Duration;

/// Any error as the commands' `String` error.
pub fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The backend's `ProgramKind` of a program name.
pub fn kind(p: Program) -> ProgramKind {
    match p {
        Program::Forward => ProgramKind::Forward(BackwardStrategy::Rematerialize),
        Program::ForwardSavedState => ProgramKind::Forward(BackwardStrategy::SavedState),
        Program::FusedSavedState => ProgramKind::Fused(BackwardStrategy::SavedState),
        Program::FusedRemat => ProgramKind::Fused(BackwardStrategy::Rematerialize),
        Program::BackwardSavedState => ProgramKind::Backward(BackwardStrategy::SavedState),
        Program::BackwardRemat => ProgramKind::Backward(BackwardStrategy::Rematerialize),
    }
}

/// kda-tpu's memory statistics as the report's plain record.
pub fn memory(m: &MemoryStats) -> Memory {
    Memory {
        argument: m.argument_bytes,
        output: m.output_bytes,
        alias: m.alias_bytes,
        temp: m.temp_bytes,
        code: m.generated_code_bytes,
        peak: m.peak_bytes,
    }
}

/// One Mosaic kernel's share of a compiled program's static count.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelFigures {
    /// The kernel's module name.
    pub name: String,
    /// Bundles along the path, over all its calls.
    pub bundles: i64,
    /// Bytes its DMAs move along the path.
    pub dma_bytes: i64,
    /// Its ops along the path by unit (`kda_tpu::aot::cycles::Units`): vector ALU ops, spill
    /// stores, spill loads, MXU pushes, transcendental pushes.
    pub units: [i64; 5],
}

/// Issue rate of Mosaic kernel bundles in the calibrated model of `shared/docs/TPU_CYCLES.md`
/// (a model, not a time: tpu7x, fitted on libtpu 0.0.44.1, reliable to about 2x).
pub const MODEL_KERNEL_BUNDLES_PER_US: f64 = 2.2e3;

/// HBM bandwidth of a tpu7x TensorCore the DMA time is figured at, bytes per microsecond
/// (3.7 TB/s).
pub const HBM_BYTES_PER_US: f64 = 3.7e6;

impl KernelFigures {
    /// The calibrated model's time for the kernel's bundles, in microseconds.
    pub fn model_us(&self) -> f64 {
        self.bundles as f64 / MODEL_KERNEL_BUNDLES_PER_US
    }
    /// The time its DMA bytes need at [`HBM_BYTES_PER_US`], in microseconds.
    pub fn hbm_us(&self) -> f64 {
        self.dma_bytes as f64 / HBM_BYTES_PER_US
    }
}

/// What a deviceless TPU compile reports, as the commands use it.
#[derive(Debug, Clone, PartialEq)]
pub struct AotFigures {
    /// Memory statistics.
    pub memory: Memory,
    /// Cost analysis `flops`.
    pub flops: f64,
    /// Cost analysis `bytes accessed`.
    pub bytes_accessed: f64,
    /// Cost analysis `optimal_seconds` (meaningless with while loops).
    pub optimal_seconds: f64,
    /// Wall time of the compile (of the original one when cached).
    pub compile_ms: f64,
    /// The Mosaic kernels' scoped VMEM, summed over the program's kernels (0 without kernels).
    pub kernel_vmem: i64,
    /// Mosaic kernels in the program.
    pub kernels: i64,
    /// Static cycles from libtpu's bundle listings (`kda_tpu::aot::cycles`).
    pub cycles: i64,
    /// The part of `cycles` inside Mosaic kernels.
    pub kernel_cycles: i64,
    /// Loops whose trip count is unknown statically (counted once in `cycles`).
    pub unknown_loops: i64,
    /// Bytes the DMAs along the path move.
    pub dma_bytes: i64,
    /// Each Mosaic kernel's share, by name.
    pub per_kernel: Vec<KernelFigures>,
    /// Whether the figures came from the cache.
    pub cached: bool,
}

/// The cache file's fixed lines, in order; then one `kernel NAME BUNDLES DMA_BYTES` line per
/// Mosaic kernel, followed by its five unit counts (a line without them is a miss).
const CACHE_FIELDS: [&str; 16] = [
    "argument",
    "output",
    "alias",
    "temp",
    "code",
    "peak",
    "flops",
    "bytes_accessed",
    "optimal_seconds",
    "compile_ms",
    "kernel_vmem",
    "kernels",
    "cycles",
    "kernel_cycles",
    "unknown_loops",
    "dma_bytes",
];

/// FNV-1a, 64 bit: a hash that stays the same across Rust versions.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(b"\0") {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Compiles `text` for `topology`. Deviceless compiles are slow (tens of seconds on 2 cores) and
/// deterministic, so their figures are kept in `<workspace>/target/xtask-aot-cache`, keyed by a
/// hash of the topology, libtpu's API version and the program text.
pub fn compile_aot(tpu: &TpuCompiler, text: &str, topology: &str) -> Result<AotFigures, String> {
    compile_aot_replicas(tpu, text, topology, 1)
}

/// [`compile_aot`] for a program of `replicas` replicas (one per device; the memory figures are
/// then per device).
pub fn compile_aot_replicas(
    tpu: &TpuCompiler,
    text: &str,
    topology: &str,
    replicas: usize,
) -> Result<AotFigures, String> {
    let (major, minor) = tpu.plugin_version();
    let replica_key = if replicas > 1 { format!("replicas {replicas}") } else { String::new() };
    let key = fnv1a(&[
        topology.as_bytes(),
        format!("{major}.{minor}").as_bytes(),
        replica_key.as_bytes(),
        text.as_bytes(),
    ]);
    let file = cache_dir().join(format!("{key:016x}-{}.txt", text.len()));
    if let Some(f) = std::fs::read_to_string(&file).ok().and_then(|s| parse_cached(&s)) {
        return Ok(f);
    }
    let options = kda_tpu::CompileOptions::default().with_replicas(replicas);
    let r = tpu.compile_with(text, topology, &options).map_err(err)?;
    let f = AotFigures {
        memory: memory(&r.memory),
        flops: r.cost.flops,
        bytes_accessed: r.cost.bytes_accessed,
        optimal_seconds: r.cost.optimal_seconds,
        compile_ms: ms(r.compile_time),
        kernel_vmem: r.kernel_vmem_bytes.iter().sum::<u64>() as i64,
        kernels: r.kernel_vmem_bytes.len() as i64,
        cycles: r.static_cycles.as_ref().map_or(-1, |c| c.total as i64),
        kernel_cycles: r.static_cycles.as_ref().map_or(-1, |c| c.kernels as i64),
        unknown_loops: r.static_cycles.as_ref().map_or(-1, |c| c.unknown_loops as i64),
        dma_bytes: r.static_cycles.as_ref().map_or(-1, |c| c.dma_bytes as i64),
        per_kernel: r.static_cycles.as_ref().map_or(Vec::new(), |c| {
            let share = |(name, k): (&String, &kda_tpu::aot::cycles::KernelShare)| KernelFigures {
                name: name.clone(),
                bundles: k.bundles as i64,
                dma_bytes: k.dma_bytes as i64,
                units: [
                    k.units.valu,
                    k.units.spill_stores,
                    k.units.spill_loads,
                    k.units.mxu_pushes,
                    k.units.transcendental_pushes,
                ]
                .map(|x| x as i64),
            };
            c.per_kernel.iter().map(share).collect()
        }),
        cached: false,
    };
    let m = f.memory;
    let values = [
        m.argument as f64,
        m.output as f64,
        m.alias as f64,
        m.temp as f64,
        m.code as f64,
        m.peak as f64,
        f.flops,
        f.bytes_accessed,
        f.optimal_seconds,
        f.compile_ms,
        f.kernel_vmem as f64,
        f.kernels as f64,
        f.cycles as f64,
        f.kernel_cycles as f64,
        f.unknown_loops as f64,
        f.dma_bytes as f64,
    ];
    let mut body: String = CACHE_FIELDS.iter().zip(values).map(|(k, v)| format!("{k} {v:?}\n")).collect();
    for k in &f.per_kernel {
        let units: Vec<String> = k.units.iter().map(i64::to_string).collect();
        body += &format!("kernel {} {} {} {}\n", k.name, k.bundles, k.dma_bytes, units.join(" "));
    }
    // Best effort: a cache that cannot be written only costs the next run a compile.
    let _ = std::fs::create_dir_all(cache_dir()).and_then(|()| std::fs::write(&file, body));
    Ok(f)
}

/// Where libtpu writes the bundle listings the static cycle count reads (each compile removes
/// its own).
pub fn listing_dir() -> PathBuf {
    crate::cargo_cmd::root().join("target/xtask-aot-listings")
}

/// Loads libtpu (`path`, else the setup's) with the listing flags in `LIBTPU_INIT_ARGS`, so that
/// every compile reports its static cycles.
pub fn load_tpu(path: Option<&str>) -> Result<TpuCompiler, String> {
    let dir = listing_dir();
    let flags = kda_tpu::aot::cycles::listing_flags(&dir);
    let args = match std::env::var("LIBTPU_INIT_ARGS") {
        Ok(a) if !a.trim().is_empty() => format!("{a} {flags}"),
        _ => flags,
    };
    // xtask's own environment, read by libtpu when it loads below.
    std::env::set_var("LIBTPU_INIT_ARGS", args);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let tpu = match path {
        Some(p) => TpuCompiler::with_libtpu(p),
        None => TpuCompiler::load(),
    }
    .map_err(err)?;
    Ok(tpu.with_listings(dir))
}

fn cache_dir() -> PathBuf {
    crate::cargo_cmd::root().join("target/xtask-aot-cache")
}

fn parse_cached(s: &str) -> Option<AotFigures> {
    let mut v = [0f64; CACHE_FIELDS.len()];
    let mut lines = s.lines();
    for (slot, want) in v.iter_mut().zip(CACHE_FIELDS) {
        let (k, x) = lines.next()?.split_once(' ')?;
        if k != want {
            return None;
        }
        *slot = x.parse().ok()?;
    }
    let mut per_kernel = Vec::new();
    for line in lines {
        let w: Vec<&str> = line.split(' ').collect();
        let ["kernel", name, b, d, units @ ..] = w.as_slice() else {
            return None;
        };
        let units: Vec<i64> = units.iter().map(|x| x.parse().ok()).collect::<Option<_>>()?;
        per_kernel.push(KernelFigures {
            name: name.to_string(),
            bundles: b.parse().ok()?,
            dma_bytes: d.parse().ok()?,
            units: units.try_into().ok()?,
        });
    }
    let [argument, output, alias, temp, code, peak] = [v[0], v[1], v[2], v[3], v[4], v[5]].map(|x| x as i64);
    let [kernel_vmem, kernels, cycles, kernel_cycles, unknown_loops, dma_bytes] =
        [v[10], v[11], v[12], v[13], v[14], v[15]].map(|x| x as i64);
    let memory = Memory { argument, output, alias, temp, code, peak };
    let (flops, bytes_accessed, optimal_seconds, compile_ms) = (v[6], v[7], v[8], v[9]);
    Some(AotFigures {
        memory,
        flops,
        bytes_accessed,
        optimal_seconds,
        compile_ms,
        kernel_vmem,
        kernels,
        cycles,
        kernel_cycles,
        unknown_loops,
        dma_bytes,
        per_kernel,
        cached: true,
    })
}

/// The backend that timings are taken on: the default plugin with host-memory retention on.
/// Without it, the CPU plugin's per-call scratch (tens of MB) comes from fresh pages on every
/// run and page faults take about half the time of a fused call; a training program would turn
/// it on for the same reason (see `kda_tpu::runtime::host_memory`).
pub fn timing_backend() -> Result<PjrtBackend, String> {
    kda_tpu::PjrtOptions::new().retain_host_memory(true).build().map_err(|e| e.to_string())
}

/// `pjrt-cpu (PJRT API 0.115, pjrt_c_api_cpu_plugin.so)`.
pub fn backend_label(be: &PjrtBackend) -> String {
    let (path, (major, minor)) = be.plugin();
    let file = path.file_name().unwrap_or(path.as_os_str());
    format!("{} (PJRT API {major}.{minor}, {})", be.name(), file.to_string_lossy())
}

/// The validated problem of `case` in `dtype` from shapes alone (no tensor is allocated, so a
/// T of 128K costs nothing).
pub fn problem_of(case: &Case, dtype: DType) -> Result<kda_core::Problem, String> {
    struct Meta(Vec<usize>, DType);
    impl kda_core::TensorMeta for Meta {
        fn shape(&self) -> &[usize] {
            &self.0
        }
        fn dtype(&self) -> DType {
            self.1
        }
    }
    let (h, b, t, k, v) = (case.h, case.b, case.t, case.k, case.v);
    let lay = case.layout;
    let tk = Meta(lay.token_shape(h, b, t, k).to_vec(), dtype);
    let (kk, g) = (Meta(tk.0.clone(), dtype), Meta(tk.0.clone(), dtype));
    let vv = Meta(lay.token_shape(h, b, t, v).to_vec(), dtype);
    let mut ts = lay.scalar_shape(h, b, t).to_vec();
    if case.beta_trailing_one {
        ts.push(1);
    }
    let beta = Meta(ts, dtype);
    let h0 = Meta(vec![b, kda_testkit::inputs::slots(case), h, k, v], DType::F32);
    let (a_log, dt_bias) = (Meta(vec![h], DType::F32), Meta(vec![h * k], DType::F32));
    let gate = match case.gate {
        CaseGate::Preactivated => kda_core::GateKind::Preactivated,
        CaseGate::Softplus => kda_core::GateKind::Softplus,
        CaseGate::LowerBound(lb) => kda_core::GateKind::LowerBound(lb),
    };
    let in_kernel = gate != kda_core::GateKind::Preactivated;
    let segments = segments_of(case);
    let config = KdaConfig {
        layout: lay,
        scale: None,
        use_qk_l2norm: case.l2norm,
        output_final_state: case.final_state,
    };
    kda_core::InputsView {
        q: &tk,
        k: &kk,
        v: &vv,
        g: &g,
        beta: &beta,
        initial_state: case.initial_state.then_some(&h0),
        gate,
        a_log: in_kernel.then_some(&a_log),
        dt_bias: in_kernel.then_some(&dt_bias),
        segments: segments.as_ref(),
        config: &config,
    }
    .validate()
    .map_err(err)
}

/// The segments of `case` (cu_seqlens or segment ids, as the case says).
fn segments_of(case: &Case) -> Option<Segments> {
    match &case.segments {
        CaseSegments::Fixed => None,
        CaseSegments::Lengths(rows) => Some(Segments::CuSeqlens(
            rows.iter()
                .map(|r| {
                    let mut c = vec![0i64];
                    for &l in r {
                        c.push(c[c.len() - 1] + l as i64);
                    }
                    c
                })
                .collect(),
        )),
        CaseSegments::SegmentIds(rows) => Some(Segments::SegmentIds(
            rows.iter()
                .map(|r| {
                    let mut ids = vec![0i64; case.t];
                    let mut pos = 0;
                    for (i, &l) in r.iter().enumerate() {
                        ids[pos..pos + l].fill(i as i64 + 1);
                        pos += l;
                    }
                    ids
                })
                .collect(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_testkit::{benchmark_cases, case, case_data};

    #[test]
    fn cached_figures_round_trip() {
        let body: String =
            CACHE_FIELDS.iter().enumerate().map(|(i, k)| format!("{k} {:?}\n", i as f64 * 1.5)).collect();
        let f = parse_cached(&body).unwrap();
        assert!(f.cached);
        assert_eq!((f.memory.argument, f.memory.peak, f.flops, f.compile_ms), (0, 7, 9.0, 13.5));
        assert_eq!(parse_cached(&body.replace("peak", "top")), None);
        assert_eq!(parse_cached("argument 1\n"), None);
        let with_kernels = body.clone()
            + "kernel kda_forward 72494 2230272 5 4 3 2 1\nkernel kda_term_masks 224 0 0 0 0 0 0\n";
        let k = parse_cached(&with_kernels).unwrap().per_kernel;
        assert_eq!(k.len(), 2);
        assert_eq!((k[0].name.as_str(), k[0].bundles, k[0].dma_bytes), ("kda_forward", 72494, 2230272));
        assert_eq!(k[0].units, [5, 4, 3, 2, 1]);
        // A kernel line written before the unit counts is a miss (the compile runs again).
        assert_eq!(parse_cached(&(body.clone() + "kernel kda_forward 72494 2230272\n")), None);
        assert!(
            (k[0].model_us() - 72494.0 / 2200.0).abs() < 1e-9
                && (k[0].hbm_us() - 2230272.0 / 3.7e6).abs() < 1e-9
        );
        assert_eq!(parse_cached(&(body + "kernel kda_forward 1\n")), None);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    /// The problem read from shapes alone is the one the testkit's drawn inputs validate to.
    #[test]
    fn shape_problems_match_case_data_problems() {
        let mut cases = benchmark_cases();
        cases.truncate(2);
        cases.extend(
            ["packed_segment_ids", "gate_lower_bound_l2norm", "beta_trailing_one"].map(|n| case(n).unwrap()),
        );
        for c in cases {
            let want = case_data(&c, DType::BF16).unwrap().inputs.validate().unwrap();
            let got = problem_of(&c, DType::BF16).unwrap();
            assert_eq!(got, want, "{}", c.name);
        }
    }
}
