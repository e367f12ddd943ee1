//! `cargo xtask test [--shard i/n]` and `cargo xtask ci`.

use crate::cargo_cmd::{cargo, has_nextest, root, run};
use crate::setup;
use std::process::Command;

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

fn shard_arg(args: &[String]) -> Result<Option<Shard>, String> {
    let mut shard = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--shard" => shard = Some(Shard::parse(it.next().ok_or("--shard needs a value")?)?),
            s if s.starts_with("--shard=") => shard = Some(Shard::parse(&s["--shard=".len()..])?),
            other => return Err(format!("unknown flag `{other}`; usage: cargo xtask test [--shard i/n]")),
        }
    }
    Ok(shard)
}

/// Points the test processes at a shared on-disk compile cache (`KDA_COMPILE_CACHE`, see
/// `kda_tpu::runtime::disk_cache`), emptied at the start of each run, unless the caller set
/// one: the many test processes that need one program then compile it once.
pub fn with_compile_cache(mut cmd: Command) -> Command {
    if std::env::var_os("KDA_COMPILE_CACHE").is_none() {
        let dir = root().join("target").join("kda-compile-cache");
        let _ = std::fs::remove_dir_all(&dir);
        cmd.env("KDA_COMPILE_CACHE", &dir);
    }
    cmd
}

/// Runs the whole test suite (every crate, the PJRT conformance suite included), or one shard.
pub fn test(args: &[String]) -> Result<(), String> {
    let shard = shard_arg(args)?;
    let paths = setup::ensure(false)?;
    let features = "--all-features";
    if has_nextest() {
        let part = shard.map(|s| format!("count:{}/{}", s.index, s.count));
        let mut a = vec!["nextest", "run", "--workspace", features, "--no-fail-fast"];
        if let Some(p) = &part {
            a.extend(["--partition", p]);
        }
        run(with_compile_cache(cargo(&paths, &a)), "tests")?;
        // nextest does not run doctests.
        if shard.is_none_or(|s| s.index == 1) {
            run(cargo(&paths, &["test", "--workspace", features, "--doc"]), "doctests")?;
        }
        Ok(())
    } else {
        if shard.is_some() {
            return Err("--shard needs cargo-nextest (cargo install cargo-nextest)".into());
        }
        run(with_compile_cache(cargo(&paths, &["test", "--workspace", features])), "tests")
    }
}

/// fmt check, clippy with warnings as errors, then the tests.
pub fn ci(args: &[String]) -> Result<(), String> {
    let paths = setup::ensure(false)?;
    run(cargo(&paths, &["fmt", "--all", "--", "--check"]), "fmt")?;
    run(
        cargo(&paths, &["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"]),
        "clippy",
    )?;
    test(args)
}
