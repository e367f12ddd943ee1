//! `cargo xtask aot`: deviceless ahead-of-time compiles of the KDA programs for a TPU topology,
//! printing the compiler's memory statistics and cost analysis. The compiling lives in
//! `pjrt_cmds::aot` (built with the `pjrt` feature only).

use crate::cli;
use kda_core::DType;

/// The usage text.
pub const USAGE: &str = "\
usage: cargo xtask aot [options]

Compiles KDA programs ahead of time for a TPU topology through libtpu (no TPU needed) and
prints the compiler's memory statistics (argument, output, alias, temp, code, peak) and cost
analysis (flops, bytes accessed). Nothing runs.

options:
  --topology NAME      TPU topology (default tpu7x:2x2x1; also v6e:2x2, v5e:2x2, v5p:2x2x1)
  --target h200        compile for a GPU instead, deviceless through the CUDA plugin (excludes
                       --topology and --devices; xla or interpret): memory, the kernel launches
                       of one call (XLA's thunk sequence, each loop body once) and per kernel
                       its grid, threads, registers, spills and shared memory (ptxas)
  --program LIST       forward, forward-saved-state, fused-saved-state, fused-remat,
                       backward-saved-state, backward-remat, or all (default all);
                       comma-separated lists work
  --shape LIST         primary, primary-packed, secondary, secondary-packed, long,
                       long-packed, long-short-segments, or all (default primary);
                       docs/kda.md, Benchmarks; long: H=8, T=32,768 fixed, with 100
                       balanced segments, with 1,000 segments of 1 to 64 tokens
  --dtype f32|bf16|both  input dtype (default bf16)
  --implementation xla|mosaic|interpret|triton|triton-interpret
                       what runs the programs' chunk loops (default xla): mosaic compiles
                       the Mosaic forward and backward kernels (and reports their VMEM),
                       interpret their plain-StableHLO lowering; triton the GPU forward
                       kernels (with --target), triton-interpret their plain-StableHLO
                       lowering
  --devices N          compile the context-parallel programs for N devices (replicas) and
                       report the memory per device (default 1: the single-device programs);
                       on tpu7x:2x2x1 libtpu counts 8 devices, one per TensorCore
  --heads N            override the shape's heads H
  --b N, --k N, --v N  override the shape's batch rows B and head widths K and V
  --t N                override the shape's tokens per row T (packed shapes keep their
                       segment count, rebalanced over the new T)
  --segments N         packed: N balanced segments per row (0: fixed length)
  --packed-result-bytes N
                       the VMEM a packed kernel program may give a head's resident results
                       to read packed tokens in place (default the library's 12 MiB; 0: the
                       tokens go through chunk-aligned lanes)
  --packed-windows     packed rows without per-segment states read through per-chunk windows
                       (the route of rows with states) instead of as whole blocks with
                       segment masks
  --step-chunks N      the Mosaic kernels take at most N chunks a grid step (a power of two;
                       default the kernels' own: fewer chunks, smaller kernels that libtpu
                       compiles faster, at more cycles; docs/kda.md, Compile time)
  --emit DIR           write each program's StableHLO text to
                       DIR/<program>.<shape>.<dtype>.<implementation>[.d<devices>].mlir
                       instead of compiling it (no libtpu needed; compare two commits'
                       programs with sha256sum)
  --json PATH          also write one JSON record per compile (program, implementation,
                       shape, dtype, devices, h, b, t, k, v, segments, peak_bytes,
                       temp_bytes, code_bytes, kernel_vmem_bytes, static_cycles,
                       kernel_cycles, unknown_trip_loops, dma_bytes, gflop, and kernels:
                       per Mosaic kernel its name, bundles, dma_bytes, model_us (the
                       calibrated model of TPU_CYCLES.md: 2.2 G bundles/s), hbm_us (its
                       DMA bytes at 3.7 TB/s) and its ops along the path by unit:
                       valu_ops, spill_stores, spill_loads, mxu_pushes,
                       transcendental_pushes, and text: its Mosaic text's vreg ops a grid
                       step by class (docs/kernels/static-cycles.md))
  --libtpu PATH        libtpu to load (default $KDA_LIBTPU, else the one setup installed)
  -h, --help           show this text

programs:
  forward               forward, no residuals kept (what the forward benchmark runs)
  forward-saved-state   forward that also returns the per-chunk states h
  fused-saved-state     forward+VJP in one executable, states kept
  fused-remat           forward+VJP in one executable, states recomputed
  backward-saved-state  backward reading h (the staged baseline's second program)
  backward-remat        backward that re-runs the state recurrence";

/// One program of a spec (maps onto `kda_tpu::ProgramKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    /// `Forward(Rematerialize)`.
    Forward,
    /// `Forward(SavedState)`.
    ForwardSavedState,
    /// `Fused(SavedState)`.
    FusedSavedState,
    /// `Fused(Rematerialize)`.
    FusedRemat,
    /// `Backward(SavedState)`.
    BackwardSavedState,
    /// `Backward(Rematerialize)`.
    BackwardRemat,
}

impl Program {
    /// Every program, in print order.
    pub const ALL: [Program; 6] = [
        Program::Forward,
        Program::ForwardSavedState,
        Program::FusedSavedState,
        Program::FusedRemat,
        Program::BackwardSavedState,
        Program::BackwardRemat,
    ];
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Program::Forward => "forward",
            Program::ForwardSavedState => "forward-saved-state",
            Program::FusedSavedState => "fused-saved-state",
            Program::FusedRemat => "fused-remat",
            Program::BackwardSavedState => "backward-saved-state",
            Program::BackwardRemat => "backward-remat",
        }
    }
    /// Parses a flag value.
    pub fn parse(s: &str) -> Option<Program> {
        Program::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// A benchmark shape of docs/kda.md, Benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// H=8 B=1 T=1024 K=V=128.
    Primary,
    /// The same, four segments 200, 311, 77, 436.
    PrimaryPacked,
    /// Kimi-Linear 48B: H=32 B=1 T=8192 K=V=128, L2 norm, lower-bound gate.
    Secondary,
    /// The same, 25 balanced segments.
    SecondaryPacked,
    /// The primary width at T=32,768, fixed.
    Long,
    /// The same, 100 balanced segments.
    LongPacked,
    /// The same, 1,000 segments of 1 to 64 tokens.
    LongShortSegments,
}

impl Shape {
    /// Every shape, in print order.
    pub const ALL: [Shape; 7] = [
        Shape::Primary,
        Shape::PrimaryPacked,
        Shape::Secondary,
        Shape::SecondaryPacked,
        Shape::Long,
        Shape::LongPacked,
        Shape::LongShortSegments,
    ];
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Primary => "primary",
            Shape::PrimaryPacked => "primary-packed",
            Shape::Secondary => "secondary",
            Shape::SecondaryPacked => "secondary-packed",
            Shape::Long => "long",
            Shape::LongPacked => "long-packed",
            Shape::LongShortSegments => "long-short-segments",
        }
    }
    /// Parses a flag value.
    pub fn parse(s: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|p| p.name() == s)
    }
    /// The `kda_testkit::benchmark_cases` case.
    pub fn case(self) -> kda_testkit::Case {
        let name = match self {
            Shape::Primary => "bench_primary",
            Shape::PrimaryPacked => "bench_primary_packed",
            Shape::Secondary => "bench_secondary",
            Shape::SecondaryPacked => "bench_secondary_packed",
            Shape::Long => "bench_long",
            Shape::LongPacked => "bench_long_packed",
            Shape::LongShortSegments => "bench_long_short_segments",
        };
        kda_testkit::benchmark_cases()
            .into_iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("kda_testkit::benchmark_cases has no `{name}`"))
    }
}

/// Parsed `aot` flags.
#[derive(Debug, Clone, PartialEq)]
pub struct AotOptions {
    /// The TPU topology.
    pub topology: String,
    /// Programs, in print order.
    pub programs: Vec<Program>,
    /// Shapes, in print order.
    pub shapes: Vec<Shape>,
    /// Input dtypes.
    pub dtypes: Vec<DType>,
    /// libtpu to load instead of the default.
    pub libtpu: Option<String>,
    /// Devices of the context-parallel programs (1: the single-device programs).
    pub devices: usize,
    /// Overrides of the named shape: heads, tokens per row, rows, widths, segments per row.
    pub heads: Option<usize>,
    /// Tokens per row.
    pub t: Option<usize>,
    /// Batch rows.
    pub b: Option<usize>,
    /// Key and query width.
    pub k: Option<usize>,
    /// Value width.
    pub v: Option<usize>,
    /// Balanced segments per row (0: fixed length).
    pub segments: Option<usize>,
    /// Where to write the JSON records.
    pub json: Option<String>,
    /// What runs the forward programs' chunk loop.
    pub implementation: kda_core::Implementation,
    /// The packed kernel programs' VMEM budget for reading tokens in place (`None`: the
    /// library's default).
    pub packed_result_bytes: Option<usize>,
    /// Packed rows without per-segment states through windows (`Tuning::packed_blocks` false).
    pub packed_windows: bool,
    /// The kernels' chunks a grid step (`Tuning::with_step_chunks`; `None`: their default).
    pub step_chunks: Option<usize>,
    /// Write the program texts here instead of compiling them.
    pub emit: Option<String>,
    /// Compile for this GPU target (`--target`) instead of the TPU topology.
    pub target: Option<String>,
}

impl Default for AotOptions {
    fn default() -> Self {
        Self {
            topology: "tpu7x:2x2x1".to_string(),
            target: None,
            programs: Program::ALL.to_vec(),
            shapes: vec![Shape::Primary],
            dtypes: vec![DType::BF16],
            libtpu: None,
            devices: 1,
            heads: None,
            t: None,
            b: None,
            k: None,
            v: None,
            segments: None,
            json: None,
            implementation: kda_core::Implementation::Xla,
            packed_result_bytes: None,
            packed_windows: false,
            step_chunks: None,
            emit: None,
        }
    }
}

/// Parses the arguments after `aot`; `Ok(None)` means help was asked for.
pub fn parse_args(args: &[String]) -> Result<Option<AotOptions>, String> {
    let mut o = AotOptions::default();
    let mut topology = false;
    let mut flags = cli::Flags::new(args);
    while let Some(flag) = flags.next_flag()? {
        let flag = flag.as_str();
        match flag {
            "-h" | "--help" => return Ok(None),
            "--topology" => {
                let v = flags.value(flag)?;
                if v.is_empty() {
                    return Err("`--topology` needs a name such as tpu7x:2x2x1".to_string());
                }
                o.topology = v;
                topology = true;
            }
            "--target" => o.target = Some(flags.value(flag)?),
            "--program" => {
                let v = flags.value(flag)?;
                o.programs = cli::list(flag, &v, &Program::ALL, Program::parse, &program_names())?;
            }
            "--implementation" => {
                let v = flags.value(flag)?;
                o.implementation = kda_core::Implementation::parse(&v)
                    .ok_or_else(|| format!("`{flag}` takes {}, got `{v}`", cli::IMPLEMENTATIONS))?;
            }
            "--shape" => {
                let v = flags.value(flag)?;
                let names = "primary, primary-packed, secondary, secondary-packed, long, long-packed or \
                             long-short-segments";
                o.shapes = cli::list(flag, &v, &Shape::ALL, Shape::parse, names)?;
            }
            "--dtype" => o.dtypes = cli::dtypes(flag, &flags.value(flag)?)?,
            "--libtpu" => o.libtpu = Some(flags.value(flag)?),
            "--devices" => o.devices = cli::positive(flag, &flags.value(flag)?)?,
            "--heads" => o.heads = Some(cli::positive(flag, &flags.value(flag)?)?),
            "--t" => o.t = Some(cli::positive(flag, &flags.value(flag)?)?),
            "--b" => o.b = Some(cli::positive(flag, &flags.value(flag)?)?),
            "--k" => o.k = Some(cli::positive(flag, &flags.value(flag)?)?),
            "--v" => o.v = Some(cli::positive(flag, &flags.value(flag)?)?),
            "--segments" => {
                let v = flags.value(flag)?;
                o.segments = Some(v.parse().map_err(|_| format!("`{flag}` needs a count, got `{v}`"))?);
            }
            "--json" => o.json = Some(flags.value(flag)?),
            "--emit" => o.emit = Some(flags.value(flag)?),
            "--packed-windows" => o.packed_windows = true,
            "--step-chunks" => {
                let n = cli::positive(flag, &flags.value(flag)?)?;
                if !n.is_power_of_two() {
                    return Err(format!("`{flag}` needs a power of two, got {n}"));
                }
                o.step_chunks = Some(n);
            }
            "--packed-result-bytes" => {
                let v = flags.value(flag)?;
                o.packed_result_bytes =
                    Some(v.parse().map_err(|_| format!("`{flag}` needs a byte count, got `{v}`"))?);
            }
            _ => return Err(format!("unknown argument `{flag}`")),
        }
    }
    if let Some(t) = &o.target {
        if topology {
            return Err(format!("`--target {t}` compiles for a GPU: it excludes `--topology`"));
        }
        if o.devices > 1 {
            return Err(format!("`--target {t}` compiles for one GPU: it excludes `--devices`"));
        }
        if o.implementation == kda_core::Implementation::Mosaic {
            return Err(format!("`--target {t}`: the Mosaic kernels are TPU kernels (use xla or interpret)"));
        }
    } else if o.implementation == kda_core::Implementation::Triton {
        return Err(
            "`--implementation triton`: the Triton kernels are GPU kernels (add `--target h200`)".to_string()
        );
    }
    Ok(Some(o))
}

impl AotOptions {
    /// `shape`'s case with the overrides applied.
    pub fn case(&self, shape: Shape) -> kda_testkit::Case {
        let mut c = shape.case();
        if let Some(h) = self.heads {
            c.h = h;
        }
        let count = |c: &kda_testkit::Case| match &c.segments {
            kda_testkit::CaseSegments::Fixed => 0,
            kda_testkit::CaseSegments::Lengths(r) | kda_testkit::CaseSegments::SegmentIds(r) => r[0].len(),
        };
        let segments = self.segments.unwrap_or(count(&c));
        if let Some(t) = self.t {
            c.t = t;
        }
        c.b = self.b.unwrap_or(c.b);
        c.k = self.k.unwrap_or(c.k);
        c.v = self.v.unwrap_or(c.v);
        c.segments = if segments == 0 {
            kda_testkit::CaseSegments::Fixed
        } else {
            kda_testkit::CaseSegments::Lengths(vec![kda_testkit::cases::balanced(c.t, segments); c.b])
        };
        c
    }
}

fn program_names() -> String {
    let names: Vec<&str> = Program::ALL.iter().map(|p| p.name()).collect();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn defaults() {
        let o = parse_args(&[]).unwrap().unwrap();
        assert_eq!(o, AotOptions::default());
        assert_eq!(o.topology, "tpu7x:2x2x1");
        assert_eq!(o.programs.len(), 6);
        assert_eq!((o.shapes.as_slice(), o.dtypes.as_slice()), (&[Shape::Primary][..], &[DType::BF16][..]));
    }

    #[rstest]
    #[case("--program fused-saved-state", &[Program::FusedSavedState])]
    #[case("--program=forward,backward-remat", &[Program::Forward, Program::BackwardRemat])]
    #[case("--program all", &Program::ALL)]
    #[case("--program forward-saved-state", &[Program::ForwardSavedState])]
    fn parses_programs(#[case] line: &str, #[case] want: &[Program]) {
        assert_eq!(parse_args(&args(line)).unwrap().unwrap().programs, want);
    }

    #[rstest]
    #[case("--shape primary-packed", &[Shape::PrimaryPacked])]
    #[case("--shape secondary,secondary-packed", &[Shape::Secondary, Shape::SecondaryPacked])]
    #[case("--shape=all", &Shape::ALL)]
    fn parses_shapes(#[case] line: &str, #[case] want: &[Shape]) {
        assert_eq!(parse_args(&args(line)).unwrap().unwrap().shapes, want);
    }

    #[rstest]
    #[case("--topology v6e:2x2 --dtype f32", "v6e:2x2", &[DType::F32])]
    #[case("--topology=v5p:2x2x1 --dtype both", "v5p:2x2x1", &[DType::F32, DType::BF16])]
    fn parses_topology_and_dtype(#[case] line: &str, #[case] topology: &str, #[case] dtypes: &[DType]) {
        let o = parse_args(&args(line)).unwrap().unwrap();
        assert_eq!((o.topology.as_str(), o.dtypes.as_slice()), (topology, dtypes));
    }

    #[rstest]
    #[case("", None)]
    #[case("--step-chunks 8", Some(8))]
    #[case("--step-chunks=1", Some(1))]
    fn parses_step_chunks(#[case] line: &str, #[case] steps: Option<usize>) {
        assert_eq!(parse_args(&args(line)).unwrap().unwrap().step_chunks, steps);
    }

    #[test]
    fn shape_overrides_rebalance_segments() {
        let o = parse_args(&args("--devices 4 --t 32768 --heads 16 --json out.json")).unwrap().unwrap();
        assert_eq!((o.devices, o.json.as_deref()), (4, Some("out.json")));
        let c = o.case(Shape::SecondaryPacked);
        assert_eq!((c.h, c.t), (16, 32768));
        let kda_testkit::CaseSegments::Lengths(rows) = &c.segments else { panic!("packed") };
        assert_eq!((rows[0].len(), rows[0].iter().sum::<usize>()), (25, 32768));
        let fixed = parse_args(&args("--segments 0")).unwrap().unwrap().case(Shape::SecondaryPacked);
        assert_eq!(fixed.segments, kda_testkit::CaseSegments::Fixed);
        let o = parse_args(&args("--b 3 --k 64 --v 32 --segments 5")).unwrap().unwrap();
        let c = o.case(Shape::Secondary);
        assert_eq!((c.b, c.k, c.v), (3, 64, 32));
        let kda_testkit::CaseSegments::Lengths(rows) = &c.segments else { panic!("packed") };
        assert_eq!((rows.len(), rows[0].len()), (3, 5), "one balanced row per batch row");
    }

    #[rstest]
    #[case("--devices 0", "positive whole number")]
    #[case("--t x", "positive whole number")]
    #[case("--k 0", "positive whole number")]
    #[case("--program fused", "got `fused`")]
    #[case("--shape tertiary", "got `tertiary`")]
    #[case("--dtype f16", "expected f32, bf16 or both")]
    #[case("--topology", "`--topology` needs a value")]
    #[case("--topology=", "needs a name")]
    #[case("--peak", "unknown argument `--peak`")]
    #[case("--step-chunks 12", "needs a power of two, got 12")]
    #[case("--step-chunks 0", "positive whole number")]
    #[case("--target h200 --topology v6e:2x2", "excludes `--topology`")]
    #[case("--target h200 --devices 2", "excludes `--devices`")]
    #[case("--target h200 --implementation mosaic", "Mosaic kernels are TPU kernels")]
    fn rejects_bad_flags(#[case] line: &str, #[case] want: &str) {
        let err = parse_args(&args(line)).unwrap_err();
        assert!(err.contains(want), "{line}: {err}");
    }

    #[test]
    fn takes_a_gpu_target() {
        let o = parse_args(&args("--target h200 --implementation interpret")).unwrap().unwrap();
        assert_eq!(o.target.as_deref(), Some("h200"));
        assert_eq!(parse_args(&args("")).unwrap().unwrap().target, None);
    }

    #[test]
    fn mosaic_compiles_every_program() {
        let o = parse_args(&args("--implementation mosaic")).unwrap().unwrap();
        assert_eq!(o.implementation, kda_core::Implementation::Mosaic);
        assert_eq!(o.programs.len(), 6, "{:?}", o.programs);
        let o = parse_args(&args("--implementation interpret --devices 4")).unwrap().unwrap();
        assert_eq!(o.devices, 4);
        let err = parse_args(&args("--implementation pallas")).unwrap_err();
        assert!(err.contains("got `pallas`"), "{err}");
    }

    #[test]
    fn every_shape_has_a_case() {
        for s in Shape::ALL {
            let c = s.case();
            let packed = s.name().ends_with("-packed") || s.name().ends_with("-segments");
            assert_eq!(c.is_packed(), packed, "{s:?}");
        }
        assert_eq!(parse_args(&args("--help")), Ok(None));
    }
}
