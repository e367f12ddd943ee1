//! `cargo xtask test [NAME ...] [--full] [--shard i/n] [--clean-cache]` and `cargo xtask ci`.

use crate::cargo_cmd::{cargo, has_nextest, root, status};
use crate::cli;
use crate::setup;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The usage text.
pub const USAGE: &str = "\
usage: cargo xtask test [NAME ...] [--full] [--shard i/n] [--clean-cache]

Runs every crate's tests (the PJRT conformance suite on the CPU plugin included) with
cargo-nextest, then the doctests, and ends with a summary: wall time, tests run, XLA compiles
and compile-cache hits over all test processes, and the ten slowest tests.

The default tier covers every case of the conformance table (both dtypes, both strategies,
split and fused, paths agreeing), the mixed-dtype checks, the mutants, the libtpu compiles and
the pairwise sweep (40 points in which every pair of values of any two sweep factors occurs).
`--full` adds the tests under `full::`: the whole sweep product (1280 points) and the
reference's own run of the whole conformance table.

Compiled programs are kept in target/kda-compile-cache between runs (keyed by program text,
compile options, plugin build and host CPU features; capped at KDA_COMPILE_CACHE_MAX_MB,
default 4096). Reference results are shared between the processes of one run only.

options:
  NAME            run only the tests whose name contains NAME (several: any of them)
  --full          the whole product of the sweep and the reference's whole table as well
  --shard i/n     run shard i of n (1-based; needs cargo-nextest)
  --clean-cache   empty the compile cache first (a cold run)
  -h, --help      show this text";

/// A CI shard `i/n` (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This shard, 1..=n.
    pub index: usize,
    /// Number of shards.
    pub count: usize,
}

impl Shard {
    /// Parses `i/n` with `1 <= i <= n`.
    pub fn parse(s: &str) -> Result<Shard, String> {
        let bad = || format!("--shard expects i/n with 1 <= i <= n, got `{s}`");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (i.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?);
        if index == 0 || count == 0 || index > count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

/// Parsed `test` flags.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TestOptions {
    /// Also the `full::` tier.
    pub full: bool,
    /// One shard of the suite.
    pub shard: Option<Shard>,
    /// Empty the compile cache first.
    pub clean_cache: bool,
    /// Test-name substrings; empty means every test.
    pub names: Vec<String>,
}

/// Parses the arguments after `test`; `Ok(None)` means help was asked for.
pub fn parse_args(args: &[String]) -> Result<Option<TestOptions>, String> {
    let mut o = TestOptions::default();
    let mut flags = cli::Flags::new(args);
    while let Some(item) = flags.next()? {
        let flag = match item {
            cli::Item::Name(name) => {
                o.names.push(name);
                continue;
            }
            cli::Item::Flag(flag) => flag,
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--full" => o.full = true,
            "--clean-cache" => o.clean_cache = true,
            "--shard" => o.shard = Some(Shard::parse(&flags.value(&flag)?)?),
            _ => return Err(format!("unknown flag `{flag}`")),
        }
    }
    Ok(Some(o))
}

/// The test-runner command line (after `cargo`) for `opts`.
pub fn runner_args(opts: &TestOptions, nextest: bool) -> Result<Vec<String>, String> {
    let mut a: Vec<String> = Vec::new();
    if nextest {
        a.extend(["nextest", "run", "--workspace", "--all-features", "--no-fail-fast"].map(String::from));
        if opts.full {
            // The `full::` tier is kept out by the default filter of .config/nextest.toml; the
            // `gpu::` tier stays out (it needs a GPU: `cargo xtask gpu-check`).
            a.extend(["--ignore-default-filter", "-E", "not test(/^gpu::/)"].map(String::from));
        }
        if let Some(s) = opts.shard {
            a.extend(["--partition".to_string(), format!("count:{}/{}", s.index, s.count)]);
        }
        a.extend(opts.names.iter().cloned());
    } else {
        if opts.shard.is_some() {
            return Err("--shard needs cargo-nextest (cargo install cargo-nextest)".to_string());
        }
        a.extend(["test", "--workspace", "--all-features", "--no-fail-fast", "--"].map(String::from));
        a.extend(opts.names.iter().cloned());
        if !opts.full {
            a.extend(["--skip".to_string(), "full::".to_string()]);
        }
        a.extend(["--skip".to_string(), "gpu::".to_string()]);
    }
    Ok(a)
}

/// The persistent compile cache of `cargo xtask test` and `tpu-test`.
pub fn compile_cache_dir() -> PathBuf {
    root().join("target").join("kda-compile-cache")
}

/// The folder of one run's shared files (compile statistics, reference results), emptied at
/// the start of every run.
fn run_dir() -> PathBuf {
    root().join("target").join("kda-test-run")
}

/// Empties the folder of one run's shared files; returns its compile-statistics file.
pub fn new_run() -> Result<PathBuf, String> {
    let run = run_dir();
    let _ = std::fs::remove_dir_all(&run);
    std::fs::create_dir_all(&run).map_err(|e| format!("create {}: {e}", run.display()))?;
    Ok(run.join("compiles.log"))
}

/// Points `cmd` at the shared files of the current run: the compile cache kept between runs
/// (`KDA_COMPILE_CACHE`, unless the caller set one), the run's compile-statistics file
/// (`KDA_COMPILE_STATS`) and its folder of reference results (`KDA_REFERENCE_CACHE`).
pub fn with_run_files(cmd: &mut Command) {
    if std::env::var_os("KDA_COMPILE_CACHE").is_none() {
        cmd.env("KDA_COMPILE_CACHE", compile_cache_dir());
    }
    cmd.env("KDA_COMPILE_STATS", run_dir().join("compiles.log"));
    cmd.env("KDA_REFERENCE_CACHE", run_dir().join("reference"));
}

/// The XLA backend optimization level the suite compiles kernel programs with, unless
/// `$KDA_XLA_OPT_LEVEL` says otherwise: 0, like cargo's unoptimized test profile. The programs
/// and XLA's HLO passes are the same as at the default level 3; only the CPU code generation is
/// unoptimized, which compiles about 3x faster (compiles are most of the suite's time) and
/// runs slower. The conformance suite's `optimized_codegen` tests run a covering set at level 3.
pub const TEST_OPT_LEVEL: &str = "0";

/// kda-tpu's `OPT_LEVEL_ENV` (xtask builds without kda-tpu unless its `pjrt` feature is on).
const OPT_LEVEL_ENV: &str = "KDA_XLA_OPT_LEVEL";

/// Sets `$KDA_XLA_OPT_LEVEL` for the suite (see [`TEST_OPT_LEVEL`]) unless the caller set it.
fn with_test_codegen(cmd: &mut Command) {
    if std::env::var_os(OPT_LEVEL_ENV).is_none() {
        cmd.env(OPT_LEVEL_ENV, TEST_OPT_LEVEL);
    }
}

/// Runs the suite (or one shard, or the tests named), then prints the summary.
pub fn test(args: &[String]) -> Result<(), String> {
    let Some(opts) = parse_args(args).map_err(|e| format!("xtask test: {e}\n\n{USAGE}"))? else {
        println!("{USAGE}");
        return Ok(());
    };
    let started = Instant::now();
    let paths = setup::ensure(false)?;
    if opts.clean_cache {
        let dir = compile_cache_dir();
        std::fs::remove_dir_all(&dir)
            .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
            .map_err(|e| format!("--clean-cache: {}: {e}", dir.display()))?;
        eprintln!("xtask test: compile cache emptied ({})", dir.display());
    }
    let nextest = has_nextest();
    let a = runner_args(&opts, nextest)?;
    let mut cmd = cargo(&paths, &a.iter().map(String::as_str).collect::<Vec<_>>());
    let stats_file = new_run()?;
    with_run_files(&mut cmd);
    with_test_codegen(&mut cmd);
    let junit = root().join("target").join("nextest").join("default").join("junit.xml");
    let _ = std::fs::remove_file(&junit);
    let mut summary = Summary::default();
    let (ok, counts) = run_counting(cmd, "tests")?;
    summary.failed_steps += usize::from(!ok);
    match (nextest, parse_junit(&junit)) {
        (true, Ok(tests)) => summary.tests = tests,
        (true, Err(e)) => eprintln!("xtask test: no per-test times ({e})"),
        (false, _) => summary.counted = counts,
    }
    // nextest does not run doctests; with cargo test they ran above.
    if nextest && opts.shard.is_none_or(|s| s.index == 1) {
        let mut doc = vec!["test", "--workspace", "--all-features", "--doc"];
        if !opts.names.is_empty() {
            doc.push("--");
            doc.extend(opts.names.iter().map(String::as_str));
        }
        let mut cmd = cargo(&paths, &doc);
        with_run_files(&mut cmd);
        with_test_codegen(&mut cmd);
        let (ok, counts) = run_counting(cmd, "doctests")?;
        summary.failed_steps += usize::from(!ok);
        summary.counted = counts;
    }
    summary.compiles = read_compile_stats(&stats_file);
    summary.wall_seconds = started.elapsed().as_secs_f64();
    summary.print();
    if summary.failed_steps > 0 {
        return Err(match summary.failed() {
            0 => "the test run failed before its tests did (see the build output above)".to_string(),
            n => format!("{n} tests failed"),
        });
    }
    Ok(())
}

/// fmt check, clippy with warnings as errors, then the tests.
pub fn ci(args: &[String]) -> Result<(), String> {
    let paths = setup::ensure(false)?;
    let check = |cmd, what| match status(cmd, what)?.success() {
        true => Ok(()),
        false => Err(format!("{what} failed")),
    };
    check(cargo(&paths, &["fmt", "--all", "--", "--check"]), "fmt")?;
    check(
        cargo(&paths, &["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"]),
        "clippy",
    )?;
    test(args)
}

/// Passed and failed counts from libtest's `test result:` lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Tests passed.
    pub passed: usize,
    /// Tests failed.
    pub failed: usize,
}

impl Counts {
    /// Adds one libtest line (`test result: ok. 3 passed; 0 failed; ...`); other lines add 0.
    pub fn add_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else { return };
        for part in rest.split(['.', ';']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next()) {
                match (n.parse::<usize>(), what) {
                    (Ok(n), "passed") => self.passed += n,
                    (Ok(n), "failed") => self.failed += n,
                    _ => {}
                }
            }
        }
    }
}

/// Runs `cmd` with its stdout echoed and read for libtest's result lines.
fn run_counting(mut cmd: Command, what: &str) -> Result<(bool, Counts), String> {
    cmd.stdout(Stdio::piped());
    let shown: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    eprintln!("xtask: {what}: {} {}", cmd.get_program().to_string_lossy(), shown.join(" "));
    let t = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("{what}: could not start: {e}"))?;
    let mut counts = Counts::default();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{line}");
            counts.add_line(&line);
        }
    }
    let status = child.wait().map_err(|e| format!("{what}: {e}"))?;
    eprintln!(
        "xtask: {what}: {} in {:.1} s",
        if status.success() { "done" } else { "FAILED" },
        t.elapsed().as_secs_f64()
    );
    Ok((status.success(), counts))
}

/// One test's outcome from nextest's JUnit report.
#[derive(Debug, Clone, PartialEq)]
pub struct TestTime {
    /// `binary test-name`.
    pub name: String,
    /// Seconds it ran.
    pub seconds: f64,
    /// Whether it failed.
    pub failed: bool,
}

/// The test cases of a JUnit report (nextest writes one per run, see .config/nextest.toml).
pub fn parse_junit(path: &Path) -> Result<Vec<TestTime>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    junit_cases(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// [`parse_junit`] on the report's text.
pub fn junit_cases(text: &str) -> Result<Vec<TestTime>, String> {
    let doc = roxmltree::Document::parse(text).map_err(|e| e.to_string())?;
    Ok(doc
        .descendants()
        .filter(|n| n.has_tag_name("testcase"))
        .map(|n| TestTime {
            name: format!("{} {}", n.attribute("classname").unwrap_or(""), n.attribute("name").unwrap_or(""))
                .trim()
                .to_string(),
            seconds: n.attribute("time").and_then(|t| t.parse().ok()).unwrap_or(0.0),
            failed: n.children().any(|c| c.has_tag_name("failure") || c.has_tag_name("error")),
        })
        .collect())
}

/// Compiles and compile-cache hits added up from the run's `KDA_COMPILE_STATS` file, whose
/// lines the PJRT runtime writes as `compile MS` and `hit MS`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CompileStats {
    /// Programs compiled.
    pub compiles: u64,
    /// Seconds the compiles took, summed over processes.
    pub compile_seconds: f64,
    /// Programs loaded from the on-disk cache instead.
    pub hits: u64,
}

/// Parses the statistics lines; unknown lines are skipped.
pub fn compile_stats(text: &str) -> CompileStats {
    let mut s = CompileStats::default();
    for line in text.lines() {
        let (event, ms) = line.split_once(' ').unwrap_or((line, "0"));
        let ms: f64 = ms.trim().parse().unwrap_or(0.0);
        match event {
            "compile" => {
                s.compiles += 1;
                s.compile_seconds += ms / 1e3;
            }
            "hit" => s.hits += 1,
            _ => {}
        }
    }
    s
}

fn read_compile_stats(path: &Path) -> CompileStats {
    compile_stats(&std::fs::read_to_string(path).unwrap_or_default())
}

/// What `cargo xtask test` reports at its end.
#[derive(Debug, Clone, Default)]
struct Summary {
    wall_seconds: f64,
    /// nextest's tests, from its JUnit report.
    tests: Vec<TestTime>,
    /// Tests counted from libtest's output (doctests, or everything without nextest).
    counted: Counts,
    compiles: CompileStats,
    failed_steps: usize,
}

impl Summary {
    fn failed(&self) -> usize {
        self.tests.iter().filter(|t| t.failed).count() + self.counted.failed
    }
    fn run(&self) -> usize {
        self.tests.len() + self.counted.passed + self.counted.failed
    }

    fn print(&self) {
        let c = &self.compiles;
        println!("xtask test: summary");
        let (s, min) = (self.wall_seconds, self.wall_seconds / 60.0);
        println!("  wall time       {s:.1} s ({min:.1} min, setup and builds included)");
        println!(
            "  tests run       {} ({} by nextest, {} by libtest: doctests), {} failed",
            self.run(),
            self.tests.len(),
            self.counted.passed + self.counted.failed,
            self.failed()
        );
        println!(
            "  XLA compiles    {} ({:.0} s of compile time over all processes), compile-cache hits {}",
            c.compiles, c.compile_seconds, c.hits
        );
        let level = std::env::var(OPT_LEVEL_ENV).unwrap_or_else(|_| TEST_OPT_LEVEL.to_string());
        println!("  XLA codegen     optimization level {level} (${OPT_LEVEL_ENV}; XLA's default is 3)");
        let mut slow: Vec<&TestTime> = self.tests.iter().collect();
        slow.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        if !slow.is_empty() {
            println!("  slowest tests:");
            for t in slow.iter().take(10) {
                println!("    {:7.2} s  {}{}", t.seconds, t.name, if t.failed { "  FAILED" } else { "" });
            }
        }
        println!("xtask test: {} passed, {} failed", self.run() - self.failed(), self.failed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[rstest]
    #[case::default_tier("", false, None, false, &[])]
    #[case::full_tier("--full", true, None, false, &[])]
    #[case::shard_and_clean("--shard=2/3 --clean-cache", false, Some((2, 3)), true, &[])]
    #[case::names("primary_fixed --shard 1/2 sweep", false, Some((1, 2)), false, &["primary_fixed", "sweep"])]
    fn parses_flags(
        #[case] line: &str,
        #[case] full: bool,
        #[case] shard: Option<(usize, usize)>,
        #[case] clean_cache: bool,
        #[case] names: &[&str],
    ) {
        let o = parse_args(&args(line)).unwrap().unwrap();
        assert_eq!(o.full, full);
        assert_eq!(o.shard, shard.map(|(index, count)| Shard { index, count }));
        assert_eq!(o.clean_cache, clean_cache);
        assert_eq!(o.names, names);
    }

    #[rstest]
    #[case::shard_zero("--shard 0/2", "1 <= i <= n")]
    #[case::shard_past_count("--shard 3/2", "1 <= i <= n")]
    #[case::shard_without_value("--shard", "`--shard` needs a value")]
    #[case::switch_with_value("--full=yes", "takes no value")]
    #[case::unknown_flag("--release", "unknown flag `--release`")]
    fn rejects_bad_flags(#[case] line: &str, #[case] want: &str) {
        let err = parse_args(&args(line)).unwrap_err();
        assert!(err.contains(want), "{line}: {err}");
    }

    #[rstest]
    #[case::default_nextest("", true, "nextest run --workspace --all-features --no-fail-fast")]
    #[case::full_nextest(
        "--full --shard 1/4 conformance",
        true,
        "nextest run --workspace --all-features --no-fail-fast --ignore-default-filter -E not test(/^gpu::/) --partition count:1/4 conformance"
    )]
    #[case::default_cargo_test(
        "",
        false,
        "test --workspace --all-features --no-fail-fast -- --skip full:: --skip gpu::"
    )]
    #[case::full_cargo_test(
        "--full sweep",
        false,
        "test --workspace --all-features --no-fail-fast -- sweep --skip gpu::"
    )]
    fn builds_runner_lines(#[case] line: &str, #[case] nextest: bool, #[case] want: &str) {
        let o = parse_args(&args(line)).unwrap().unwrap();
        assert_eq!(runner_args(&o, nextest).unwrap().join(" "), want);
    }

    #[test]
    fn shards_need_nextest() {
        let o = parse_args(&args("--shard 1/2")).unwrap().unwrap();
        assert!(runner_args(&o, false).unwrap_err().contains("needs cargo-nextest"));
        assert_eq!(parse_args(&args("-h")), Ok(None));
    }

    #[test]
    fn reads_libtest_result_lines() {
        let mut c = Counts::default();
        c.add_line(
            "test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 3.2s",
        );
        c.add_line("test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out");
        c.add_line("running 5 tests");
        assert_eq!(c, Counts { passed: 15, failed: 2 });
    }

    #[test]
    fn reads_nextest_junit_reports() {
        let report = r#"<?xml version="1.0" encoding="UTF-8"?>
<testsuites name="nextest-run" tests="3" failures="1" errors="0">
  <testsuite name="kda-tpu::conformance" tests="2" disabled="0" errors="0" failures="1">
    <testcase name="fixed_small::forward_f32" classname="kda-tpu::conformance" time="0.104"/>
    <testcase name="primary_fixed::paths_agree_f32" classname="kda-tpu::conformance" time="12.5">
      <failure type="test failure">conformance failure</failure>
    </testcase>
  </testsuite>
  <testsuite name="xtask::bin/xtask" tests="1"><testcase name="a" classname="xtask::bin/xtask" time="0.005"/></testsuite>
</testsuites>"#;
        let cases = junit_cases(report).unwrap();
        assert_eq!(cases.len(), 3);
        assert_eq!(cases[1].name, "kda-tpu::conformance primary_fixed::paths_agree_f32");
        approx::assert_relative_eq!(cases[1].seconds, 12.5);
        assert_eq!(cases.iter().map(|c| c.failed).collect::<Vec<_>>(), [false, true, false]);
        assert!(junit_cases("<testsuites>").is_err());
    }

    #[test]
    fn adds_up_compile_statistics() {
        // The lines the PJRT runtime appends (kda_tpu::runtime::disk_cache).
        let s = compile_stats("compile 1500.0\nhit 2.5\ncompile 500.0\nhit 1.0\nhit 0.5\nnoise\n");
        assert_eq!((s.compiles, s.hits), (2, 3));
        approx::assert_relative_eq!(s.compile_seconds, 2.0, max_relative = 1e-12);
        assert_eq!(compile_stats(""), CompileStats::default());
    }
}
