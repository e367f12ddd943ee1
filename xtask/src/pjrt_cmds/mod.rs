//! The PJRT side of `bench`, `aot` and `demo` (built with the `pjrt` feature only: kda-tpu's
//! build needs the header `cargo xtask setup` installs).

pub mod aot;
pub mod bench;
pub mod demo;

use crate::aot_cmd::Program;
use crate::bench::Memory;
use kda_core::{Backend, BackwardStrategy, DType, GateMode, HostTensor, KdaConfig, KdaInputs, Segments};
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
        Program::Forward => ProgramKind::Forward(false),
        Program::ForwardSavedState => ProgramKind::Forward(true),
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

/// What a deviceless TPU compile reports, as the commands use it.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// Whether the figures came from the cache.
    pub cached: bool,
}

const CACHE_FIELDS: [&str; 10] = [
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
    let (major, minor) = tpu.plugin_version();
    let key = fnv1a(&[topology.as_bytes(), format!("{major}.{minor}").as_bytes(), text.as_bytes()]);
    let file = cache_dir().join(format!("{key:016x}-{}.txt", text.len()));
    if let Some(f) = std::fs::read_to_string(&file).ok().and_then(|s| parse_cached(&s)) {
        return Ok(f);
    }
    let r = tpu.compile(text, topology).map_err(err)?;
    let f = AotFigures {
        memory: memory(&r.memory),
        flops: r.cost.flops,
        bytes_accessed: r.cost.bytes_accessed,
        optimal_seconds: r.cost.optimal_seconds,
        compile_ms: ms(r.compile_time),
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
    ];
    let body: String = CACHE_FIELDS.iter().zip(values).map(|(k, v)| format!("{k} {v:?}\n")).collect();
    // Best effort: a cache that cannot be written only costs the next run a compile.
    let _ = std::fs::create_dir_all(cache_dir()).and_then(|()| std::fs::write(&file, body));
    Ok(f)
}

fn cache_dir() -> PathBuf {
    crate::cargo_cmd::root().join("target/xtask-aot-cache")
}

fn parse_cached(s: &str) -> Option<AotFigures> {
    let mut v = [0f64; CACHE_FIELDS.len()];
    for (slot, (line, want)) in v.iter_mut().zip(s.lines().zip(CACHE_FIELDS)) {
        let (k, x) = line.split_once(' ')?;
        if k != want {
            return None;
        }
        *slot = x.parse().ok()?;
    }
    if s.lines().count() != CACHE_FIELDS.len() {
        return None;
    }
    let i = |x: f64| x as i64;
    Some(AotFigures {
        memory: Memory {
            argument: i(v[0]),
            output: i(v[1]),
            alias: i(v[2]),
            temp: i(v[3]),
            code: i(v[4]),
            peak: i(v[5]),
        },
        flops: v[6],
        bytes_accessed: v[7],
        optimal_seconds: v[8],
        compile_ms: v[9],
        cached: true,
    })
}

/// The backend that timings are taken on: the default plugin with host-memory retention on.
/// Without it, the CPU plugin's per-call scratch (tens of MB) comes from fresh pages on every
/// run and page faults take about half the time of a fused call; a training program would turn
/// it on for the same reason (see `kda_tpu::runtime::host_memory`).
pub fn timing_backend() -> Result<PjrtBackend, String> {
    PjrtBackend::options().retain_host_memory(true).build().map_err(|e| e.to_string())
}

/// `pjrt-cpu (PJRT API 0.115, pjrt_c_api_cpu_plugin.so)`.
pub fn backend_label(be: &PjrtBackend) -> String {
    let (major, minor) = be.plugin_version();
    let file = be.plugin_path().file_name().unwrap_or(be.plugin_path().as_os_str());
    format!("{} (PJRT API {major}.{minor}, {})", be.name(), file.to_string_lossy())
}

/// All-zero inputs with the shapes and options of `case`: enough to build its programs' specs
/// without drawing (large) random tensors.
pub fn zero_inputs(case: &Case, dtype: DType) -> Result<KdaInputs, String> {
    let (h, b, t, k, v) = (case.h, case.b, case.t, case.k, case.v);
    let lay = case.layout;
    let tk = lay.token_shape(h, b, t, k);
    let mut ts = lay.scalar_shape(h, b, t).to_vec();
    if case.beta_trailing_one {
        ts.push(1);
    }
    let z = |shape: &[usize]| HostTensor::zeros(shape, dtype);
    let gate_params = || (HostTensor::zeros(&[h], DType::F32), Some(HostTensor::zeros(&[h * k], DType::F32)));
    let gate = match case.gate {
        CaseGate::Preactivated => GateMode::Preactivated,
        CaseGate::Softplus => {
            let (a, dt) = gate_params();
            GateMode::softplus(a, dt)
        }
        CaseGate::LowerBound(lb) => {
            let (a, dt) = gate_params();
            GateMode::lower_bound(lb, a, dt)
        }
    };
    let mut x = KdaInputs::new(z(&tk), z(&tk), z(&lay.token_shape(h, b, t, v)), z(&tk), z(&ts))
        .with_gate(gate)
        .with_config(KdaConfig {
            layout: lay,
            scale: None,
            use_qk_l2norm: case.l2norm,
            output_final_state: case.final_state,
        });
    let slots = kda_testkit::inputs::slots(case);
    if case.initial_state {
        x = x.with_initial_state(HostTensor::zeros(&[b, slots, h, k, v], DType::F32));
    }
    match &case.segments {
        CaseSegments::Fixed => {}
        CaseSegments::Lengths(rows) => {
            let cu = rows
                .iter()
                .map(|r| {
                    let mut c = vec![0i64];
                    for &l in r {
                        c.push(c[c.len() - 1] + l as i64);
                    }
                    c
                })
                .collect();
            x = x.with_segments(Segments::CuSeqlens(cu));
        }
        CaseSegments::SegmentIds(rows) => {
            let ids = rows
                .iter()
                .map(|r| {
                    let mut ids = vec![0i64; t];
                    let mut pos = 0;
                    for (i, &l) in r.iter().enumerate() {
                        ids[pos..pos + l].fill(i as i64 + 1);
                        pos += l;
                    }
                    ids
                })
                .collect();
            x = x.with_segments(Segments::SegmentIds(ids));
        }
    }
    Ok(x)
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
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    /// The zero inputs validate to the same problem as the testkit's drawn ones.
    #[test]
    fn zero_inputs_match_case_data_problems() {
        let mut cases = benchmark_cases();
        cases.truncate(2);
        cases.extend(
            ["packed_segment_ids", "gate_lower_bound_l2norm", "beta_trailing_one"].map(|n| case(n).unwrap()),
        );
        for c in cases {
            let want = case_data(&c, DType::BF16).unwrap().inputs.validate().unwrap();
            let got = zero_inputs(&c, DType::BF16).unwrap().validate().unwrap();
            assert_eq!(got, want, "{}", c.name);
        }
    }
}
