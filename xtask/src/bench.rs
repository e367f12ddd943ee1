//! `cargo xtask bench`: the benchmarks of docs/kda.md, Benchmarks on the PJRT CPU plugin, with the
//! compiler's memory figures on CPU and from deviceless `tpu7x:2x2x1` compiles.
//!
//! This module parses the flags and renders results (console table, markdown, JSON); the
//! measuring lives in `pjrt_cmds::bench` (built with the `pjrt` feature only).

use crate::cli;
use crate::machine::Machine;
use kda_core::DType;
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};

/// The usage text.
pub const USAGE: &str = "\
usage: cargo xtask bench --suite forward|backward|backward-packed|api|scaling|all [options]

Times KDA programs at the primary shape of docs/kda.md, Benchmarks (H=8 B=1 T=1024 K=V=128) on the PJRT
CPU plugin: inputs uploaded once (host preparation and compiles excluded), one warm-up run,
then N timed runs; median, min and max. Memory: the compiler's statistics of each program on
CPU and, unless --no-aot, from a deviceless compile of the same program text for tpu7x:2x2x1
(peak memory, static cycles from libtpu's bundle listings, cost-analysis flops).

suites:
  forward          forward only (no residuals kept), fixed and packed (segments 200,311,77,436):
                   the XLA program (forward) and the Mosaic kernel's (forward-mosaic: tpu7x
                   figures of its Mosaic lowering, CPU times of its interpret lowering)
  backward         forward+VJP, fixed: variants baseline, fused-saved-state, fused-remat
  backward-packed  the same with the four packed segments
  scaling          the fused saved-state forward+VJP at the primary width (H=8, K=V=128; the
                   secondary's 32 heads do not fit a small machine's memory at large T),
                   T = 1K to 32K: the program alone (time, memory), and calls through the
                   host API on one device and context-parallel on two CPU devices, fixed
                   and packed (one segment per 256 tokens), with each call's memory per
                   device: CPU, and tpu7x for the same programs on 1 and 4 devices. The
                   two CPU devices share the machine's cores: this shows context
                   parallelism's overhead, not a speed-up
  api              the fused saved-state call, fixed and packed, four ways in alternation:
                   the program alone (fused-saved-state), the device API (device-api), the
                   host API (host-api), and one host copy of its input and output bytes
                   (host-copy); prints the overhead ratios
  all              the five above

variants (backward suites):
  baseline           staged: forward program, saved states h downloaded to the host and
                     uploaded again, backward program (runs by default; --no-baseline skips)
  fused-saved-state  one forward+VJP executable, states kept per chunk
  fused-remat        one forward+VJP executable, states recomputed in the backward

options:
  --suite NAME          suite to run (required)
  --iterations N        timed runs per variant (default 10)
  --dtype f32|bf16|both input dtype (default both)
  --baseline            run the staged baseline (the default; accepted for explicitness)
  --no-baseline         skip the staged baseline
  --no-aot              skip the tpu7x:2x2x1 compiles (tpu7x fields are null)
  --json PATH           also write the records as a JSON array
  --markdown PATH       markdown file whose section for the suite is replaced
                        (default docs/performance.md in the workspace); the suite's records
                        replace its old ones in bench/results.json next to it, and every
                        section and the SVG charts in charts/ are rendered from that file
  --no-markdown         write no markdown, results or charts
  --render              run nothing: re-render every section and chart from bench/results.json
  -h, --help            show this text";

/// The TPU topology of the AOT figures (the JSON fields are named after it).
pub const TOPOLOGY: &str = "tpu7x:2x2x1";

/// A benchmark suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// Forward only, fixed and packed.
    Forward,
    /// Forward+VJP, fixed length.
    Backward,
    /// Forward+VJP, packed.
    BackwardPacked,
    /// What a call costs around the fused program: device API, host API, a host copy.
    Api,
    /// The fused saved-state forward+VJP at the primary width, T from 512 to 4096.
    Scaling,
}

impl Suite {
    /// Every suite, in run order.
    pub const ALL: [Suite; 5] =
        [Suite::Forward, Suite::Backward, Suite::BackwardPacked, Suite::Api, Suite::Scaling];

    /// The suite's flag value.
    pub fn name(self) -> &'static str {
        match self {
            Suite::Forward => "forward",
            Suite::Backward => "backward",
            Suite::BackwardPacked => "backward-packed",
            Suite::Api => "api",
            Suite::Scaling => "scaling",
        }
    }
    /// Parses a flag value.
    pub fn parse(s: &str) -> Option<Suite> {
        Suite::ALL.into_iter().find(|x| x.name() == s)
    }
    /// The heading of the suite's markdown section.
    pub fn title(self) -> &'static str {
        match self {
            Suite::Forward => "Forward, primary shape, fixed and packed",
            Suite::Backward => "Forward+VJP, primary shape, fixed length",
            Suite::BackwardPacked => "Forward+VJP, primary shape, packed (segments 200, 311, 77, 436)",
            Suite::Api => {
                "Call overhead of the fused saved-state forward+VJP, primary shape, fixed and packed"
            }
            Suite::Scaling => "Forward+VJP against sequence length, primary width, on one and two devices",
        }
    }
    /// The benchmark cases (`kda_testkit::benchmark_cases` names) the suite runs.
    pub fn cases(self) -> &'static [&'static str] {
        match self {
            Suite::Forward => &["bench_primary", "bench_primary_packed"],
            Suite::Backward => &["bench_primary"],
            Suite::BackwardPacked => &["bench_primary_packed"],
            Suite::Api => &["bench_primary", "bench_primary_packed"],
            Suite::Scaling => &[
                "bench_primary",
                "bench_scaling_t2048",
                "bench_scaling_t4096",
                "bench_scaling_t8192",
                "bench_scaling_t16384",
                "bench_scaling_t32768",
            ],
        }
    }
    /// The variants the suite times.
    pub fn variants(self, baseline: bool) -> Vec<Variant> {
        match self {
            Suite::Forward => vec![Variant::Forward, Variant::ForwardMosaic],
            Suite::Scaling => vec![Variant::FusedSavedState],
            Suite::Api => {
                vec![Variant::FusedSavedState, Variant::DeviceApi, Variant::HostApi, Variant::HostCopy]
            }
            Suite::Backward | Suite::BackwardPacked => {
                let mut v = vec![];
                if baseline {
                    v.push(Variant::Baseline);
                }
                v.extend([Variant::FusedSavedState, Variant::FusedRemat, Variant::FusedMosaic]);
                v
            }
        }
    }
}

/// What one record times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The forward program without residuals.
    Forward,
    /// The same program around the Mosaic forward kernel: tpu7x figures of its Mosaic lowering,
    /// CPU figures and times of its interpret lowering (the grid as loops on the CPU plugin,
    /// which says nothing of TPU speed).
    ForwardMosaic,
    /// Staged saved-state: forward program, `h` through host memory, backward program.
    Baseline,
    /// Fused forward+VJP, saved state.
    FusedSavedState,
    /// Fused forward+VJP, rematerialized.
    FusedRemat,
    /// The fused saved-state program on the Mosaic forward and backward kernels: tpu7x figures
    /// of their Mosaic lowering, CPU figures and times of their interpret lowering.
    FusedMosaic,
    /// The fused saved-state call through the device API (device tensors in and out).
    DeviceApi,
    /// The fused saved-state call through `kda_core::Backend` (host tensors in and out).
    HostApi,
    /// One host copy of the call's input and output bytes (what the host API must move).
    HostCopy,
}

impl Variant {
    /// Every variant.
    pub const ALL: [Variant; 9] = [
        Variant::Forward,
        Variant::ForwardMosaic,
        Variant::Baseline,
        Variant::FusedSavedState,
        Variant::FusedRemat,
        Variant::FusedMosaic,
        Variant::DeviceApi,
        Variant::HostApi,
        Variant::HostCopy,
    ];
    /// Parses a name of [`Variant::name`].
    pub fn parse(s: &str) -> Option<Variant> {
        Variant::ALL.into_iter().find(|v| v.name() == s)
    }
    /// The name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Forward => "forward",
            Variant::ForwardMosaic => "forward-mosaic",
            Variant::Baseline => "baseline",
            Variant::FusedSavedState => "fused-saved-state",
            Variant::FusedRemat => "fused-remat",
            Variant::FusedMosaic => "fused-mosaic",
            Variant::DeviceApi => "device-api",
            Variant::HostApi => "host-api",
            Variant::HostCopy => "host-copy",
        }
    }
}

/// Parsed `bench` flags.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    /// Suites, in run order.
    pub suites: Vec<Suite>,
    /// Timed runs per variant.
    pub iterations: usize,
    /// Input dtypes, in run order.
    pub dtypes: Vec<DType>,
    /// Whether the backward suites run the staged baseline.
    pub baseline: bool,
    /// Whether to compile for tpu7x:2x2x1.
    pub aot: bool,
    /// Where to write the JSON records.
    pub json: Option<PathBuf>,
    /// The markdown file; `None` writes none.
    pub markdown: Option<PathBuf>,
    /// Only re-render the markdown sections and charts from the results file.
    pub render: bool,
}

/// The default markdown file: `docs/performance.md` in the workspace.
pub fn default_markdown() -> PathBuf {
    let root = crate::cargo_cmd::root();
    root.canonicalize().unwrap_or(root).join("docs/performance.md")
}

/// Parses the arguments after `bench`; `Ok(None)` means help was asked for.
pub fn parse_args(args: &[String]) -> Result<Option<BenchOptions>, String> {
    let mut suites = None;
    let mut opts = BenchOptions {
        suites: vec![],
        iterations: 10,
        dtypes: vec![DType::F32, DType::BF16],
        baseline: true,
        aot: true,
        json: None,
        markdown: Some(default_markdown()),
        render: false,
    };
    let mut baseline_flag = None;
    let mut flags = cli::Flags::new(args);
    while let Some(flag) = flags.next_flag()? {
        let flag = flag.as_str();
        match flag {
            "-h" | "--help" => return Ok(None),
            "--suite" => {
                let v = flags.value(flag)?;
                suites = Some(cli::list(
                    flag,
                    &v,
                    &Suite::ALL,
                    Suite::parse,
                    "forward, backward, backward-packed, api or scaling",
                )?);
            }
            "--iterations" => {
                let v = flags.value(flag)?;
                opts.iterations = v
                    .parse()
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| format!("`--iterations`: expected a whole number >= 1, got `{v}`"))?;
            }
            "--dtype" => opts.dtypes = cli::dtypes(flag, &flags.value(flag)?)?,
            "--baseline" | "--no-baseline" => {
                baseline_flag = Some(flag.to_string());
                opts.baseline = flag == "--baseline";
            }
            "--no-aot" => opts.aot = false,
            "--json" => opts.json = Some(PathBuf::from(flags.value(flag)?)),
            "--markdown" => opts.markdown = Some(PathBuf::from(flags.value(flag)?)),
            "--no-markdown" => opts.markdown = None,
            "--render" => opts.render = true,
            _ => return Err(format!("unknown argument `{flag}`")),
        }
    }
    if opts.render {
        return match (suites, &opts.markdown) {
            (None, Some(_)) => Ok(Some(opts)),
            (Some(_), _) => Err("`--render` runs nothing: leave out `--suite`".to_string()),
            (_, None) => Err("`--render` writes the markdown: leave out `--no-markdown`".to_string()),
        };
    }
    opts.suites =
        suites.ok_or("`--suite` is required (forward, backward, backward-packed, api, scaling or all)")?;
    if let Some(flag) = baseline_flag {
        if !opts.suites.iter().any(|s| *s != Suite::Forward) {
            return Err(format!("`{flag}` applies to the backward suites only"));
        }
    }
    Ok(Some(opts))
}

/// The compiler's memory statistics of one program, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// Arguments.
    pub argument: i64,
    /// Outputs.
    pub output: i64,
    /// Outputs aliasing arguments.
    pub alias: i64,
    /// Scratch.
    pub temp: i64,
    /// Generated code.
    pub code: i64,
    /// The compiler's peak estimate.
    pub peak: i64,
}

impl Memory {
    fn json(&self) -> Json {
        json!({
            "argument_bytes": self.argument,
            "output_bytes": self.output,
            "alias_bytes": self.alias,
            "temp_bytes": self.temp,
            "generated_code_bytes": self.code,
            "peak_bytes": self.peak,
        })
    }
}

/// A deviceless TPU compile's figures for one program.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TpuFigures {
    /// Memory statistics (per device when `devices` > 1).
    pub memory: Memory,
    /// Devices (replicas) the program was compiled for.
    pub devices: usize,
    /// Cost analysis `flops`.
    pub flops: f64,
    /// Cost analysis `bytes accessed`.
    pub bytes_accessed: f64,
    /// Compile wall time.
    pub compile_ms: f64,
    /// Static cycles from libtpu's bundle listings (`kda_tpu::aot::cycles`), when counted.
    pub cycles: Option<i64>,
}

/// One compiled program of a variant (the baseline has two).
#[derive(Debug, Clone, PartialEq)]
pub struct ProgramFigures {
    /// `forward`, `backward` or `fused`.
    pub name: &'static str,
    /// The `ProgramKind`, as Debug text.
    pub kind: String,
    /// CPU compile wall time.
    pub compile_ms: f64,
    /// CPU memory statistics.
    pub cpu: Memory,
    /// The tpu7x compile, unless `--no-aot`.
    pub tpu: Option<TpuFigures>,
}

/// One timed variant.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRecord {
    /// The suite.
    pub suite: Suite,
    /// The variant.
    pub variant: Variant,
    /// Input dtype.
    pub dtype: DType,
    /// The benchmark case name.
    pub case: String,
    /// `[H, B, T, K, V]`.
    pub shape: [usize; 5],
    /// Segment lengths when packed.
    pub segments: Option<Vec<usize>>,
    /// Every timed run, in milliseconds, in run order.
    pub times_ms: Vec<f64>,
    /// The programs the variant runs.
    pub programs: Vec<ProgramFigures>,
    /// Devices the call ran on (context parallelism when more than 1).
    pub devices: usize,
}

impl BenchRecord {
    /// Whether the case is packed.
    pub fn packed(&self) -> bool {
        self.segments.is_some()
    }
    fn sorted(&self) -> Vec<f64> {
        let mut t = self.times_ms.clone();
        t.sort_by(f64::total_cmp);
        t
    }
    /// Median of the timed runs (mean of the middle two for an even count).
    pub fn median_ms(&self) -> f64 {
        let t = self.sorted();
        match t.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => t[n / 2],
            n => (t[n / 2 - 1] + t[n / 2]) / 2.0,
        }
    }
    /// Fastest run.
    pub fn min_ms(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }
    /// Slowest run.
    pub fn max_ms(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }
    /// CPU compile time of all programs.
    pub fn compile_ms(&self) -> f64 {
        self.programs.iter().map(|p| p.compile_ms).sum()
    }
    /// The CPU peak: the largest over the variant's programs (the baseline runs two in turn).
    pub fn cpu_peak(&self) -> i64 {
        self.programs.iter().map(|p| p.cpu.peak).max().unwrap_or(0)
    }
    /// The CPU scratch bytes, largest over the programs (the CPU plugin's peak leaves them out).
    pub fn cpu_temp(&self) -> i64 {
        self.programs.iter().map(|p| p.cpu.temp).max().unwrap_or(0)
    }
    /// The tpu7x peak, largest over the programs; `None` without AOT figures.
    pub fn tpu_peak(&self) -> Option<i64> {
        let peaks: Option<Vec<i64>> = self.programs.iter().map(|p| p.tpu.map(|t| t.memory.peak)).collect();
        peaks.and_then(|v| v.into_iter().max())
    }
    /// The devices of the tpu7x figures (per-device memory when more than 1).
    pub fn tpu_devices(&self) -> usize {
        self.programs.iter().filter_map(|p| p.tpu.map(|t| t.devices)).max().unwrap_or(1)
    }
    /// tpu7x flops, summed over the programs; `None` without AOT figures.
    pub fn tpu_flops(&self) -> Option<f64> {
        self.programs.iter().map(|p| p.tpu.map(|t| t.flops)).sum()
    }
    /// tpu7x static cycles, summed over the programs (the staged baseline runs two); `None`
    /// without AOT figures or where one program's count is missing.
    pub fn tpu_cycles(&self) -> Option<i64> {
        self.programs.iter().map(|p| p.tpu.and_then(|t| t.cycles)).sum()
    }
    fn segments_label(&self) -> String {
        if self.suite == Suite::Scaling {
            let kind = match &self.segments {
                None => "fixed".to_string(),
                Some(s) => format!("{} segments", s.len()),
            };
            let devices =
                if self.devices > 1 { format!(", {} devices", self.devices) } else { String::new() };
            return format!("{kind}, T={}{devices}", self.shape[2]);
        }
        match &self.segments {
            None => "fixed".to_string(),
            Some(s) => format!("packed {}", s.iter().map(usize::to_string).collect::<Vec<_>>().join(",")),
        }
    }
}

/// What every record of a run shares.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    /// Machine, date, commit.
    pub machine: Machine,
    /// The command line, as typed.
    pub command: String,
    /// The backend and plugin, e.g. `pjrt-cpu (PJRT API 0.115, /path/plugin.so)`.
    pub plugin: String,
    /// libtpu's description when AOT figures were taken.
    pub libtpu: Option<String>,
}

fn mb(bytes: i64) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

fn opt_mb(bytes: Option<i64>) -> String {
    bytes.map_or("-".to_string(), mb)
}

fn opt_kcycles(cycles: Option<i64>) -> String {
    cycles.map_or("-".to_string(), |c| format!("{:.1}", c as f64 / 1e3))
}

fn opt_gflop(flops: Option<f64>) -> String {
    flops.map_or("-".to_string(), |f| format!("{:.2}", f / 1e9))
}

const COLUMNS: [&str; 12] = [
    "variant",
    "dtype",
    "segments",
    "median ms",
    "min ms",
    "max ms",
    "compile s",
    "CPU peak MB",
    "CPU temp MB",
    "tpu7x peak MB",
    "tpu7x k cycles",
    "tpu7x GFLOP",
];

fn row(r: &BenchRecord) -> [String; 12] {
    let mut cells = row_cells(r);
    if r.programs.is_empty() {
        // The api suite's call timings: no program figures of their own.
        for c in &mut cells[6..] {
            *c = "-".to_string();
        }
    }
    cells
}

fn row_cells(r: &BenchRecord) -> [String; 12] {
    [
        r.variant.name().to_string(),
        r.dtype.to_string(),
        r.segments_label(),
        format!("{:.2}", r.median_ms()),
        format!("{:.2}", r.min_ms()),
        format!("{:.2}", r.max_ms()),
        format!("{:.2}", r.compile_ms() / 1e3),
        mb(r.cpu_peak()),
        mb(r.cpu_temp()),
        match r.tpu_devices() {
            1 => opt_mb(r.tpu_peak()),
            n => format!("{} (D={n})", opt_mb(r.tpu_peak())),
        },
        opt_kcycles(r.tpu_cycles()),
        opt_gflop(r.tpu_flops()),
    ]
}

/// A plain-text table of records for the console.
pub fn console_table(records: &[BenchRecord]) -> String {
    let rows: Vec<[String; 12]> = records.iter().map(row).collect();
    let width = |i: usize| rows.iter().map(|r| r[i].len()).chain([COLUMNS[i].len()]).max().unwrap_or(0);
    let widths: Vec<usize> = (0..COLUMNS.len()).map(width).collect();
    let line = |cells: &[&str]| -> String {
        let parts: Vec<String> =
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if i < 3 {
                        format!("{c:<w$}", w = widths[i])
                    } else {
                        format!("{c:>w$}", w = widths[i])
                    }
                })
                .collect();
        parts.join("  ").trim_end().to_string() + "\n"
    };
    let mut out = line(&COLUMNS);
    for r in &rows {
        out += &line(&r.iter().map(String::as_str).collect::<Vec<_>>());
    }
    out
}

/// The markdown table of records.
pub fn markdown_table(records: &[BenchRecord]) -> String {
    let mut out = format!("| {} |\n", COLUMNS.join(" | "));
    out += &format!("|{}\n", ["---|", "---|", "---|"].concat() + &"---:|".repeat(COLUMNS.len() - 3));
    for r in records {
        out += &format!("| {} |\n", row(r).join(" | "));
    }
    out
}

fn markers(suite: Suite) -> (String, String) {
    (format!("<!-- bench:{}:start -->", suite.name()), format!("<!-- bench:{}:end -->", suite.name()))
}

/// The markdown section of one suite's latest run, between its markers.
pub fn markdown_section(suite: Suite, records: &[BenchRecord], info: &RunInfo) -> String {
    let (start, end) = markers(suite);
    let iterations = records.first().map_or(0, |r| r.times_ms.len());
    let aot = match &info.libtpu {
        Some(t) => format!("deviceless compile of the same program text for `{TOPOLOGY}` ({t})"),
        None => "not taken (`--no-aot`)".to_string(),
    };
    let mut out = format!("{start}\n## {} (`--suite {}`)\n\n", suite.title(), suite.name());
    out += &format!("- Run: {}, commit `{}`: `{}`\n", info.machine.date, info.machine.commit, info.command);
    out += &format!("- Machine: {}; backend {}\n", info.machine.summary(), info.plugin);
    out += &format!("- Times: {iterations} timed runs after one warm-up; TPU figures: {aot}\n\n");
    out += &markdown_table(records);
    if records.iter().any(|r| r.variant == Variant::Baseline) {
        out += "\nbaseline: memory columns are the larger of its forward and backward programs'; \
                k cycles and GFLOP are their sums.\n";
    }
    if suite == Suite::Api {
        out += &format!("\n{}", api_summary(records));
    }
    if suite == Suite::Scaling {
        out += &format!("\n{}", scaling_summary(records));
    }
    out + &end + "\n"
}

/// The `scaling` suite's ratios per T, fixed and packed: host-API time on two CPU devices
/// against one, and the tpu7x peak per device of the context-parallel program (D = 4) against
/// the single-device program at the same T and at T / 4 (docs/kda.md Context parallelism's targets: 30% and,
/// fixed length, 1.2x).
pub fn scaling_summary(records: &[BenchRecord]) -> String {
    let mut out = String::from(
        "Memory columns of the host-api rows: the call's program, per device (CPU at the row's device \
         count; tpu7x for the devices in parentheses, the context-parallel program for 4 of \
         tpu7x:2x2x1's devices). Two CPU devices share the machine's cores: the time ratio is \
         context parallelism's overhead here, not a speed-up.\n\n\
         | T | rows | host API, 2 devices / 1 | tpu7x D=4 / D=1, same T | tpu7x D=4 / D=1 at T/4 |\n\
         |---:|---|---:|---:|---:|\n",
    );
    let call = |t: usize, packed: bool, devices: usize| {
        records.iter().find(|r| {
            r.variant == Variant::HostApi && r.shape[2] == t && r.packed() == packed && r.devices == devices
        })
    };
    let mut ts: Vec<usize> =
        records.iter().filter(|r| r.variant == Variant::HostApi).map(|r| r.shape[2]).collect();
    ts.sort_unstable();
    ts.dedup();
    let ratio = |a: Option<f64>, b: Option<f64>, pct: bool| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && pct => format!("{:.1}%", 100.0 * a / b),
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".to_string(),
    };
    let peak = |r: Option<&BenchRecord>| r.and_then(BenchRecord::tpu_peak).map(|b| b as f64);
    for &t in &ts {
        for packed in [false, true] {
            let (one, two) = (call(t, packed, 1), call(t, packed, 2));
            if one.is_none() && two.is_none() {
                continue;
            }
            let rows = two.or(one).map_or(String::new(), |r| r.segments_label());
            let rows = rows.split(", T=").next().unwrap_or_default().to_string();
            out += &format!(
                "| {t} | {rows} | {} | {} | {} |\n",
                ratio(two.map(BenchRecord::median_ms), one.map(BenchRecord::median_ms), false),
                ratio(peak(two), peak(one), true),
                ratio(peak(two), peak(call(t / 4, packed, 1)), false),
            );
        }
    }
    out
}

/// The `api` suite's ratios per case and dtype, from medians of one run: the device API
/// against the program alone, and the host API against the program plus one host copy of its
/// input and output bytes.
pub fn api_summary(records: &[BenchRecord]) -> String {
    let mut out = String::from(
        "| case | dtype | device API / program | device API - program | host API / (program + host copy) |\n\
         |---|---|---:|---:|---:|\n",
    );
    let find = |case: &str, dtype: DType, v: Variant| {
        records
            .iter()
            .find(|r| r.case == case && r.dtype == dtype && r.variant == v)
            .map(BenchRecord::median_ms)
    };
    for r in records.iter().filter(|r| r.variant == Variant::FusedSavedState) {
        let (Some(dev), Some(host), Some(copy)) = (
            find(&r.case, r.dtype, Variant::DeviceApi),
            find(&r.case, r.dtype, Variant::HostApi),
            find(&r.case, r.dtype, Variant::HostCopy),
        ) else {
            continue;
        };
        let prog = r.median_ms();
        out += &format!(
            "| {} | {} | {:.3} | {:+.3} ms | {:.3} |\n",
            r.case,
            r.dtype,
            dev / prog,
            dev - prog,
            host / (prog + copy)
        );
    }
    out
}

/// The text a new markdown file starts with.
pub const MARKDOWN_HEADER: &str = "\
# Benchmarks

Written by `cargo xtask bench` (see `cargo xtask bench --help`) from `bench/results.json`;
each suite's section holds its latest run and is replaced by the next one. Shapes and variants: docs/kda.md, Benchmarks (primary shape
H=8, B=1, T=1024, K=V=128; packed = four segments 200, 311, 77, 436 in one row).

- Variants: `forward` (forward program, no residuals kept); `forward-mosaic` (the same program
  around the Mosaic forward kernel: tpu7x figures of its Mosaic lowering, CPU times and memory
  of its interpret lowering, which say nothing of TPU speed); `baseline` (staged saved-state: the
  forward program, its per-chunk states downloaded to the host and uploaded again, then the
  backward program; run by default, `--no-baseline` skips it); `fused-saved-state` and
  `fused-remat` (one forward+VJP executable per strategy).
- Times: PJRT CPU plugin; inputs uploaded once (host input preparation and compiles excluded),
  one warm-up run, then N timed runs of the program(s) on the device-resident inputs. Each run
  returns after PJRT's execution-complete event, so the time covers the whole execution; outputs
  stay on the device. The staged baseline also includes its host round trip of the saved states.
- compile s: CPU compile of the variant's program(s).
- CPU peak MB: the CPU compiler's `peak_memory_in_bytes` for the program (MB = 10^6 bytes). The
  CPU plugin counts arguments and outputs in it, not scratch: CPU temp MB is its `temp_size`.
- tpu7x: the same StableHLO text compiled ahead of time (deviceless) for `tpu7x:2x2x1` through
  libtpu: the compiler's peak memory, its static cycles (bundles of libtpu's final listings along
  the executed path, `kda_tpu::aot::cycles`: a model of issue cycles, not a time) and its
  cost-analysis flops. Nothing runs on a TPU.
";

/// Replaces (or appends) `section` of `suite` in the markdown text `old` (`None`: a new file).
pub fn splice_section(old: Option<&str>, suite: Suite, section: &str) -> String {
    let (start, end) = markers(suite);
    let Some(old) = old else {
        return format!("{MARKDOWN_HEADER}\n{section}");
    };
    if let (Some(a), Some(b)) = (old.find(&start), old.find(&end)) {
        if a < b {
            let after = &old[b + end.len()..];
            let after = after.strip_prefix('\n').unwrap_or(after);
            return format!("{}{section}{after}", &old[..a]);
        }
    }
    let sep = if old.is_empty() || old.ends_with("\n\n") {
        ""
    } else if old.ends_with('\n') {
        "\n"
    } else {
        "\n\n"
    };
    format!("{old}{sep}{section}")
}

/// Writes `section` of `suite` into the markdown file at `path`, keeping everything else.
pub fn write_markdown(path: &Path, suite: Suite, section: &str) -> Result<(), String> {
    let old = match std::fs::read_to_string(path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("read {}: {e}", path.display())),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    }
    let text = splice_section(old.as_deref(), suite, section);
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
}

/// Milliseconds to 0.1 microsecond.
fn msec(x: f64) -> Json {
    json!((x * 1e4).round() / 1e4)
}

/// The JSON record of one variant.
pub fn record_json(r: &BenchRecord, info: &RunInfo) -> Json {
    let [h, b, t, k, v] = r.shape;
    let programs: Vec<Json> = r
        .programs
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "kind": p.kind,
                "compile_ms": msec(p.compile_ms),
                "cpu_memory": p.cpu.json(),
                "tpu7x": p.tpu.map(|t| json!({
                    "memory": t.memory.json(),
                    "devices": t.devices,
                    "flops": t.flops,
                    "bytes_accessed": t.bytes_accessed,
                    "compile_ms": msec(t.compile_ms),
                    "static_cycles": t.cycles,
                })),
            })
        })
        .collect();
    json!({
        "suite": r.suite.name(),
        "variant": r.variant.name(),
        "dtype": r.dtype.to_string(),
        "packed": r.packed(),
        "median_ms": msec(r.median_ms()),
        "min_ms": msec(r.min_ms()),
        "max_ms": msec(r.max_ms()),
        "iterations": r.times_ms.len(),
        "cpu_memory_bytes": r.cpu_peak(),
        "cpu_temp_bytes": r.cpu_temp(),
        "tpu7x_memory_bytes": r.tpu_peak(),
        "tpu7x_flops": r.tpu_flops(),
        "tpu7x_static_cycles": r.tpu_cycles(),
        "case": r.case,
        "shape": { "h": h, "b": b, "t": t, "k": k, "v": v },
        "segments": r.segments,
        "compile_ms": msec(r.compile_ms()),
        "times_ms": r.times_ms.iter().map(|&x| msec(x)).collect::<Vec<_>>(),
        "programs": programs,
        "devices": r.devices,
        "date": info.machine.date,
        "commit": info.machine.commit,
        "cpus": info.machine.cpus,
        "cpu_model": info.machine.cpu_model,
        "cpu_detail": info.machine.cpu_detail,
        "backend": info.plugin,
        "command": info.command,
        "libtpu": info.libtpu,
    })
}

/// Writes all records as a JSON array.
pub fn write_json(path: &Path, records: &[BenchRecord], info: &RunInfo) -> Result<(), String> {
    let all = Json::Array(records.iter().map(|r| record_json(r, info)).collect());
    let text = serde_json::to_string_pretty(&all).map_err(|e| format!("JSON of the records: {e}"))? + "\n";
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[rstest]
    #[case("--suite forward", &[Suite::Forward], 10, &[DType::F32, DType::BF16], true, true)]
    #[case("--suite=backward --iterations 3 --dtype f32", &[Suite::Backward], 3, &[DType::F32], true, true)]
    #[case("--suite backward-packed --no-baseline --no-aot --dtype=bf16", &[Suite::BackwardPacked], 10, &[DType::BF16], false, false)]
    #[case("--suite backward --baseline", &[Suite::Backward], 10, &[DType::F32, DType::BF16], true, true)]
    #[case("--suite all --iterations=1", &Suite::ALL, 1, &[DType::F32, DType::BF16], true, true)]
    #[case("--suite backward,forward", &[Suite::Backward, Suite::Forward], 10, &[DType::F32, DType::BF16], true, true)]
    fn parses_flags(
        #[case] line: &str,
        #[case] suites: &[Suite],
        #[case] iterations: usize,
        #[case] dtypes: &[DType],
        #[case] baseline: bool,
        #[case] aot: bool,
    ) {
        let o = parse_args(&args(line)).unwrap().unwrap();
        assert_eq!(o.suites, suites);
        assert_eq!(o.iterations, iterations);
        assert_eq!(o.dtypes, dtypes);
        assert_eq!((o.baseline, o.aot), (baseline, aot));
        assert_eq!(o.json, None);
        assert_eq!(o.markdown, Some(default_markdown()));
    }

    #[test]
    fn parses_output_paths() {
        let o = parse_args(&args("--suite forward --json out/b.json --markdown=x.md")).unwrap().unwrap();
        assert_eq!(o.json, Some(PathBuf::from("out/b.json")));
        assert_eq!(o.markdown, Some(PathBuf::from("x.md")));
        let o = parse_args(&args("--suite forward --no-markdown")).unwrap().unwrap();
        assert_eq!(o.markdown, None);
        assert!(default_markdown().ends_with("docs/performance.md"));
    }

    #[rstest]
    #[case("", "`--suite` is required")]
    #[case("--suite sideways", "got `sideways`")]
    #[case("--suite forward --iterations 0", "expected a whole number >= 1")]
    #[case("--suite forward --iterations", "`--iterations` needs a value")]
    #[case("--suite forward --dtype f64", "expected f32, bf16 or both")]
    #[case("--suite forward --baseline", "backward suites only")]
    #[case("--suite forward --no-aot=1", "takes no value")]
    #[case("--suite forward --fast", "unknown argument `--fast`")]
    #[case("--render --suite forward", "leave out `--suite`")]
    #[case("--render --no-markdown", "leave out `--no-markdown`")]
    fn rejects_bad_flags(#[case] line: &str, #[case] want: &str) {
        let err = parse_args(&args(line)).unwrap_err();
        assert!(err.contains(want), "{line}: {err}");
    }

    #[test]
    fn render_needs_no_suite() {
        let o = parse_args(&args("--render")).unwrap().unwrap();
        assert!(o.render && o.suites.is_empty() && o.markdown.is_some());
    }

    #[test]
    fn help_is_not_an_error() {
        assert_eq!(parse_args(&args("--suite forward -h")), Ok(None));
    }

    #[test]
    fn suites_pick_cases_and_variants() {
        assert_eq!(Suite::Forward.variants(true), [Variant::Forward, Variant::ForwardMosaic]);
        assert_eq!(
            Suite::Backward.variants(true),
            [Variant::Baseline, Variant::FusedSavedState, Variant::FusedRemat, Variant::FusedMosaic]
        );
        assert_eq!(
            Suite::BackwardPacked.variants(false),
            [Variant::FusedSavedState, Variant::FusedRemat, Variant::FusedMosaic]
        );
        let names: Vec<&str> = kda_testkit::benchmark_cases().iter().map(|c| c.name).collect();
        for s in Suite::ALL {
            assert!(s.cases().iter().all(|c| names.contains(c)), "{s:?}");
        }
    }

    fn record(variant: Variant, times: &[f64], peaks: &[(i64, Option<i64>)]) -> BenchRecord {
        BenchRecord {
            suite: Suite::Backward,
            variant,
            dtype: DType::F32,
            case: "bench_primary".into(),
            shape: [8, 1, 1024, 128, 128],
            segments: None,
            times_ms: times.to_vec(),
            programs: peaks
                .iter()
                .map(|&(cpu, tpu)| ProgramFigures {
                    name: "fused",
                    kind: "Fused(SavedState)".into(),
                    compile_ms: 500.0,
                    cpu: Memory { peak: cpu, ..Memory::default() },
                    tpu: tpu.map(|p| TpuFigures {
                        memory: Memory { peak: p, ..Memory::default() },
                        devices: 1,
                        flops: 2e9,
                        bytes_accessed: 1e8,
                        compile_ms: 900.0,
                        cycles: Some(400_000),
                    }),
                })
                .collect(),
            devices: 1,
        }
    }

    fn info() -> RunInfo {
        RunInfo {
            machine: Machine {
                cpus: 2,
                cpu_model: "Test CPU".into(),
                cpu_detail: "family 25 model 1, AVX2".into(),
                date: "2026-11-29 10:00 UTC".into(),
                commit: "abc1234".into(),
            },
            command: "cargo xtask bench --suite backward".into(),
            plugin: "pjrt-cpu".into(),
            libtpu: Some("libtpu, PJRT API 0.117".into()),
        }
    }

    #[test]
    fn records_summarise_times_and_memory() {
        let r = record(Variant::Baseline, &[5.0, 1.0, 3.0, 4.0], &[(10, Some(30)), (20, Some(25))]);
        assert_eq!((r.median_ms(), r.min_ms(), r.max_ms()), (3.5, 1.0, 5.0));
        assert_eq!((r.cpu_peak(), r.tpu_peak(), r.tpu_flops()), (20, Some(30), Some(4e9)));
        assert_eq!(r.compile_ms(), 1000.0);
        let r = record(Variant::FusedRemat, &[2.0, 1.0, 3.0], &[(10, None)]);
        assert_eq!((r.median_ms(), r.tpu_peak(), r.tpu_flops()), (2.0, None, None));
    }

    #[test]
    fn json_has_the_issue_fields() {
        let r = record(Variant::FusedSavedState, &[2.0], &[(64_000_000, None)]);
        let j = record_json(&r, &info());
        let text = serde_json::to_string_pretty(&j).unwrap();
        let back: Json = serde_json::from_str(&text).unwrap();
        assert_eq!(back, j, "the text reads back as the record");
        assert_eq!(back["suite"], "backward");
        assert_eq!(back["variant"], "fused-saved-state");
        assert_eq!(back["dtype"], "f32");
        assert_eq!(back["packed"], false);
        for key in ["median_ms", "min_ms", "max_ms"] {
            assert_eq!(back[key].as_f64(), Some(2.0), "{key}");
        }
        assert_eq!(back["iterations"], 1);
        assert_eq!(back["cpu_memory_bytes"], 64_000_000);
        assert!(back["tpu7x_memory_bytes"].is_null() && back["tpu7x_flops"].is_null());
        let keys: Vec<&str> = back.as_object().unwrap().keys().map(String::as_str).take(3).collect();
        assert_eq!(keys, ["suite", "variant", "dtype"], "fields keep their order");
    }

    #[test]
    fn markdown_sections_are_replaced_in_place() {
        let recs = [record(Variant::FusedSavedState, &[2.0, 3.0], &[(64_000_000, Some(70_000_000))])];
        let sec = markdown_section(Suite::Backward, &recs, &info());
        assert!(
            sec.contains(
                "| fused-saved-state | f32 | fixed | 2.50 | 2.00 | 3.00 | 0.50 | 64.0 | 0.0 | 70.0 | 400.0 | 2.00 |"
            ),
            "{sec}"
        );
        let fresh = splice_section(None, Suite::Backward, &sec);
        assert!(fresh.starts_with("# Benchmarks"));
        let other = markdown_section(Suite::Forward, &recs, &info());
        let both = splice_section(Some(&fresh), Suite::Forward, &other);
        assert!(both.contains(&sec) && both.ends_with(&other), "{both}");
        let newer = markdown_section(Suite::Backward, &recs, &RunInfo { command: "again".into(), ..info() });
        let replaced = splice_section(Some(&both), Suite::Backward, &newer);
        assert!(replaced.contains("`again`") && !replaced.contains(&sec) && replaced.ends_with(&other));
        assert_eq!(replaced.matches("bench:backward:start").count(), 1);
    }

    #[test]
    fn console_table_aligns_columns() {
        let recs = [record(Variant::FusedSavedState, &[12.345], &[(64_000_000, None)])];
        let t = console_table(&recs);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("variant"));
        assert!(lines[1].contains("12.35") && lines[1].ends_with('-'), "{t}");
    }
}
