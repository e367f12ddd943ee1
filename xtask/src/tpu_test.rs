//! `cargo xtask tpu-test [--plugin PATH] [--shard i/n]`: kda-tpu's conformance suite and the
//! regression sweep on a chosen PJRT plugin (the setup's CPU plugin by default; libtpu on a TPU host).

use crate::cargo_cmd::{cargo, has_nextest, run};
use crate::cli;
use crate::setup;
use crate::test_cmd::Shard;
use std::path::PathBuf;

/// The usage text.
pub const USAGE: &str = "\
usage: cargo xtask tpu-test [--plugin PATH] [--implementation NAME] [--full] [--shard i/n]
                            [-- TEST-RUNNER ARGS]

Runs kda-tpu's conformance suite (every case of the testkit's table through the PJRT backend,
forward and backward, f32 and bf16) and the regression sweep's pairwise tier (the whole product
with --full) with KDA_PJRT_PLUGIN set to the plugin: with cargo-nextest (`--partition count:i/n`
for a shard), else with cargo test (no shards). Compiled programs are kept in
target/kda-compile-cache (keyed by plugin build and host CPU, among others).

options:
  --plugin PATH   PJRT plugin to test (default: the CPU plugin `cargo xtask setup` installed;
                  on a TPU host pass libtpu.so, with a GPU the CUDA plugin)
  --implementation xla|mosaic|interpret|triton|triton-interpret
                  what runs the forward programs (KDA_IMPLEMENTATION for the suite; default
                  xla): mosaic needs libtpu (--plugin), interpret runs the Mosaic kernel's
                  interpret lowering on any plugin; triton needs the CUDA plugin on a Hopper
                  GPU, triton-interpret runs the GPU kernels' interpret lowering anywhere
  --full          the sweep's whole product (1280 points) as well
  --shard i/n     run shard i of n (1-based; needs cargo-nextest)
  -- ARGS         passed on to the test runner (e.g. a test-name filter)
  -h, --help      show this text";

/// Parsed `tpu-test` flags.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TpuTestOptions {
    /// The plugin; `None` means the setup's CPU plugin.
    pub plugin: Option<PathBuf>,
    /// One shard of the suite.
    pub shard: Option<Shard>,
    /// The sweep's whole product as well.
    pub full: bool,
    /// What runs the forward programs (`None`: the environment's, else XLA).
    pub implementation: Option<kda_core::Implementation>,
    /// Arguments after `--`, for the test runner.
    pub extra: Vec<String>,
}

/// Parses the arguments after `tpu-test`; `Ok(None)` means help was asked for.
pub fn parse_args(args: &[String]) -> Result<Option<TpuTestOptions>, String> {
    let mut o = TpuTestOptions::default();
    // lexopt hands `--` over as the end of flags: everything after it is the runner's.
    let dashes = args.iter().position(|a| a == "--");
    let own = &args[..dashes.unwrap_or(args.len())];
    let mut flags_own = cli::Flags::new(own);
    while let Some(flag) = flags_own.next_flag()? {
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--plugin" => o.plugin = Some(PathBuf::from(flags_own.value(&flag)?)),
            "--shard" => o.shard = Some(Shard::parse(&flags_own.value(&flag)?)?),
            "--full" => o.full = true,
            "--implementation" => {
                let v = flags_own.value(&flag)?;
                o.implementation =
                    Some(kda_core::Implementation::parse(&v).ok_or_else(|| {
                        format!("`{flag}` takes {}, got `{v}`", crate::cli::IMPLEMENTATIONS)
                    })?);
            }
            _ => return Err(format!("unknown argument `{flag}`")),
        }
    }
    if let Some(at) = dashes {
        o.extra = args[at + 1..].to_vec();
    }
    Ok(Some(o))
}

/// The test-runner command line (after `cargo`) for `opts`.
pub fn runner_args(opts: &TpuTestOptions, nextest: bool) -> Result<Vec<String>, String> {
    let mut a: Vec<String> = if nextest {
        ["nextest", "run", "-p", "kda-tpu", "--test", "conformance", "--test", "sweep", "--no-fail-fast"]
            .map(String::from)
            .to_vec()
    } else {
        if opts.shard.is_some() {
            return Err("--shard needs cargo-nextest (cargo install cargo-nextest)".to_string());
        }
        ["test", "-p", "kda-tpu", "--test", "conformance", "--test", "sweep", "--no-fail-fast"]
            .map(String::from)
            .to_vec()
    };
    if let Some(s) = opts.shard {
        a.extend(["--partition".to_string(), format!("count:{}/{}", s.index, s.count)]);
    }
    if nextest {
        if opts.full {
            a.push("--ignore-default-filter".to_string());
        }
        a.extend(opts.extra.iter().cloned());
    } else {
        a.push("--".to_string());
        a.extend(opts.extra.iter().cloned());
        if !opts.full {
            a.extend(["--skip".to_string(), "full::".to_string()]);
        }
    }
    Ok(a)
}

/// The entry point of `cargo xtask tpu-test`; `args` are the arguments after `tpu-test`.
pub fn tpu_test(args: &[String]) -> Result<(), String> {
    let Some(opts) = parse_args(args).map_err(|e| format!("xtask tpu-test: {e}\n\n{USAGE}"))? else {
        println!("{USAGE}");
        return Ok(());
    };
    let paths = setup::ensure(false)?;
    let plugin = match &opts.plugin {
        Some(p) => std::path::absolute(p).map_err(|e| format!("--plugin {}: {e}", p.display()))?,
        None => paths.cpu_plugin.clone(),
    };
    if !plugin.is_file() {
        return Err(format!("xtask tpu-test: no PJRT plugin at {}", plugin.display()));
    }
    let a = runner_args(&opts, has_nextest())?;
    let mut cmd = cargo(&paths, &a.iter().map(String::as_str).collect::<Vec<_>>());
    crate::test_cmd::new_run()?;
    crate::test_cmd::with_run_files(&mut cmd);
    cmd.env("KDA_PJRT_PLUGIN", &plugin);
    if let Some(i) = opts.implementation {
        // The suite's handles read it (kda_tpu::IMPLEMENTATION_ENV).
        cmd.env("KDA_IMPLEMENTATION", i.name());
    }
    // On a TPU host libtpu may need its metadata server; skip it only for setup's own plugins,
    // unless the caller set the switch.
    if opts.plugin.is_some() && std::env::var_os("TPU_SKIP_MDS_QUERY").is_none() {
        cmd.env_remove("TPU_SKIP_MDS_QUERY");
    }
    let implementation = opts.implementation.map_or("the environment's (default xla)", |i| i.name());
    eprintln!("xtask tpu-test: plugin {}, implementation {implementation}", plugin.display());
    run(cmd, "conformance suite")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[rstest]
    #[case("", None, None, &[])]
    #[case("--plugin /opt/libtpu.so", Some("/opt/libtpu.so"), None, &[])]
    #[case("--plugin=p.so --shard 2/3", Some("p.so"), Some((2, 3)), &[])]
    #[case("--shard=1/4 -- forward_f32 --nocapture", None, Some((1, 4)), &["forward_f32", "--nocapture"])]
    fn parses_flags(
        #[case] line: &str,
        #[case] plugin: Option<&str>,
        #[case] shard: Option<(usize, usize)>,
        #[case] extra: &[&str],
    ) {
        let o = parse_args(&args(line)).unwrap().unwrap();
        assert_eq!(o.plugin, plugin.map(PathBuf::from));
        assert_eq!(o.shard, shard.map(|(index, count)| Shard { index, count }));
        assert_eq!(o.extra, extra);
    }

    #[rstest]
    #[case("--shard 0/2", "1 <= i <= n")]
    #[case("--shard 3/2", "1 <= i <= n")]
    #[case("--shard", "`--shard` needs a value")]
    #[case("--plugin", "`--plugin` needs a value")]
    #[case("--release", "unknown argument `--release`")]
    #[case("--implementation pallas", "got `pallas`")]
    fn rejects_bad_flags(#[case] line: &str, #[case] want: &str) {
        let err = parse_args(&args(line)).unwrap_err();
        assert!(err.contains(want), "{line}: {err}");
    }

    #[test]
    fn takes_an_implementation() {
        let o = parse_args(&args("--implementation mosaic --plugin libtpu.so")).unwrap().unwrap();
        assert_eq!(o.implementation, Some(kda_core::Implementation::Mosaic));
        assert_eq!(parse_args(&args("")).unwrap().unwrap().implementation, None);
    }

    #[test]
    fn builds_runner_lines() {
        let o = parse_args(&args("--shard 2/3 -- primary")).unwrap().unwrap();
        assert_eq!(
            runner_args(&o, true).unwrap().join(" "),
            "nextest run -p kda-tpu --test conformance --test sweep --no-fail-fast --partition count:2/3 primary"
        );
        assert!(runner_args(&o, false).unwrap_err().contains("needs cargo-nextest"));
        let o = parse_args(&args("-- primary")).unwrap().unwrap();
        assert_eq!(
            runner_args(&o, false).unwrap().join(" "),
            "test -p kda-tpu --test conformance --test sweep --no-fail-fast -- primary --skip full::"
        );
        let o = parse_args(&args("--full")).unwrap().unwrap();
        assert_eq!(
            runner_args(&o, true).unwrap().join(" "),
            "nextest run -p kda-tpu --test conformance --test sweep --no-fail-fast --ignore-default-filter"
        );
        assert_eq!(parse_args(&args("-h")), Ok(None));
    }
}
