//! Spawning cargo (and other tools) with the environment setup computed.

use crate::setup;
use std::process::Command;
use std::time::Instant;

/// The workspace root.
pub fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A cargo command in the workspace root with the PJRT build environment set.
pub fn cargo(paths: &setup::Paths, args: &[&str]) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root()).args(args);
    for (k, v) in setup::cargo_env(paths) {
        c.env(k, v);
    }
    c
}

/// Runs `cmd`, echoing it first, and fails with its exit status.
pub fn run(mut cmd: Command, what: &str) -> Result<(), String> {
    let shown: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    eprintln!("xtask: {what}: {} {}", cmd.get_program().to_string_lossy(), shown.join(" "));
    let t = Instant::now();
    let status = cmd.status().map_err(|e| format!("{what}: could not start: {e}"))?;
    eprintln!("xtask: {what}: {} in {:.1} s", if status.success() { "done" } else { "FAILED" }, t.elapsed().as_secs_f64());
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// Whether `cargo nextest` is installed.
pub fn has_nextest() -> bool {
    Command::new("cargo").args(["nextest", "--version"]).output().map(|o| o.status.success()).unwrap_or(false)
}
