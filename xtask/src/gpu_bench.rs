//! `cargo xtask gpu-bench`: times the forward and the fused forward+VJP programs of the
//! benchmark shapes on the default PJRT plugin (the CUDA plugin on a GPU host:
//! `KDA_PJRT_PLUGIN`), one implementation after another, for the device check to set beside
//! fla's. `bench` keeps the CPU record's suites;
//! this command is the lean path a GPU host without cargo runs from the staged binary.

use crate::cli;
use kda_core::{DType, Implementation};

/// The usage text.
pub const USAGE: &str = "\
usage: cargo xtask gpu-bench [--shape LIST] [--program LIST] [--implementation LIST]
                             [--dtype f32|bf16|both] [--iterations N] [--json PATH]

Times each program of each shape and implementation on the default PJRT plugin (set
KDA_PJRT_PLUGIN to the CUDA plugin on a GPU host): inputs and cotangents uploaded once, the
program compiled and run once outside the timed part, then N runs, each a host wall-clock span
that ends when PJRT reports the execution complete; median, min and max.

options:
  --shape LIST           primary (H=8, T=1024), primary-packed, secondary (H=32, T=8192, L2 norm,
                         lower-bound gate), secondary-packed (25 segments); default
                         primary,secondary,secondary-packed
  --program LIST         forward (no residuals kept), fused (the saved-state forward+VJP in one
                         program: o and every gradient); default forward,fused
  --implementation LIST  xla, triton, triton-interpret, interpret, mosaic; default xla,triton
  --dtype f32|bf16|both  input dtype (default bf16)
  --iterations N         timed runs (default 20)
  --json PATH            also write the records as a JSON array
  -h, --help             show this text";

/// The shapes and the benchmark cases (`kda_testkit::benchmark_cases`) they name.
pub const SHAPES: [(&str, &str); 4] = [
    ("primary", "bench_primary"),
    ("primary-packed", "bench_primary_packed"),
    ("secondary", "bench_secondary"),
    ("secondary-packed", "bench_secondary_packed"),
];

/// A timed program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchProgram {
    /// The forward, no residuals kept.
    Forward,
    /// The saved-state forward+VJP as one program.
    Fused,
}

impl BenchProgram {
    /// The name `--program` takes.
    pub fn name(self) -> &'static str {
        match self {
            BenchProgram::Forward => "forward",
            BenchProgram::Fused => "fused",
        }
    }
}

/// Parsed flags.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuBenchOptions {
    /// Benchmark case names, in run order.
    pub cases: Vec<&'static str>,
    /// Programs, in run order.
    pub programs: Vec<BenchProgram>,
    /// Implementations, in run order.
    pub implementations: Vec<Implementation>,
    /// Input dtypes.
    pub dtypes: Vec<DType>,
    /// Timed runs.
    pub iterations: usize,
    /// Where to write the JSON records.
    pub json: Option<String>,
}

/// Parses the arguments after `gpu-bench`; `Ok(None)` means help was asked for.
pub fn parse_args(args: &[String]) -> Result<Option<GpuBenchOptions>, String> {
    let mut o = GpuBenchOptions {
        cases: vec!["bench_primary", "bench_secondary", "bench_secondary_packed"],
        programs: vec![BenchProgram::Forward, BenchProgram::Fused],
        implementations: vec![Implementation::Xla, Implementation::Triton],
        dtypes: vec![DType::BF16],
        iterations: 20,
        json: None,
    };
    let mut flags = cli::Flags::new(args);
    while let Some(flag) = flags.next_flag()? {
        let flag = flag.as_str();
        match flag {
            "-h" | "--help" => return Ok(None),
            "--shape" => {
                let v = flags.value(flag)?;
                let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
                o.cases = v
                    .split(',')
                    .map(|s| {
                        SHAPES
                            .iter()
                            .find(|(n, _)| *n == s)
                            .map(|(_, c)| *c)
                            .ok_or_else(|| format!("`{flag}` takes {}, got `{s}`", names.join(", ")))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--program" => {
                let v = flags.value(flag)?;
                o.programs = v
                    .split(',')
                    .map(|s| {
                        [BenchProgram::Forward, BenchProgram::Fused]
                            .into_iter()
                            .find(|p| p.name() == s)
                            .ok_or_else(|| format!("`{flag}` takes forward, fused, got `{s}`"))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--implementation" => {
                let v = flags.value(flag)?;
                o.implementations = v
                    .split(',')
                    .map(|s| {
                        Implementation::parse(s)
                            .ok_or_else(|| format!("`{flag}` takes {}, got `{s}`", cli::IMPLEMENTATIONS))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--dtype" => o.dtypes = cli::dtypes(flag, &flags.value(flag)?)?,
            "--iterations" => o.iterations = cli::positive(flag, &flags.value(flag)?)?,
            "--json" => o.json = Some(flags.value(flag)?),
            _ => return Err(format!("unknown argument `{flag}`")),
        }
    }
    Ok(Some(o))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn takes_shapes_and_implementations() {
        let o =
            parse_args(&args("--shape primary,secondary-packed --implementation triton,xla --iterations 3"))
                .unwrap()
                .unwrap();
        assert_eq!(o.cases, ["bench_primary", "bench_secondary_packed"]);
        assert_eq!(o.implementations, [Implementation::Triton, Implementation::Xla]);
        assert_eq!(o.iterations, 3);
        assert_eq!(o.programs, [BenchProgram::Forward, BenchProgram::Fused]);
        let o = parse_args(&args("--program fused")).unwrap().unwrap();
        assert_eq!(o.programs, [BenchProgram::Fused]);
        let e = parse_args(&args("--program backward")).unwrap_err();
        assert!(e.contains("forward, fused"), "{e}");
        let e = parse_args(&args("--shape tertiary")).unwrap_err();
        assert!(e.contains("primary, primary-packed, secondary, secondary-packed"), "{e}");
        let e = parse_args(&args("--implementation pallas")).unwrap_err();
        assert!(e.contains("triton-interpret"), "{e}");
    }
}
