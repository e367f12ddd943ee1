//! Spawning cargo (and other tools) with the environment setup computed.

use crate::setup;
use std::process::{Command, ExitStatus};
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
pub fn run(cmd: Command, what: &str) -> Result<(), String> {
    let status = status(cmd, what)?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// Runs `cmd`, echoing it first and its outcome after, and returns its exit status.
pub fn status(mut cmd: Command, what: &str) -> Result<ExitStatus, String> {
    let shown: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    eprintln!("xtask: {what}: {} {}", cmd.get_program().to_string_lossy(), shown.join(" "));
    let t = Instant::now();
    let status = cmd.status().map_err(|e| format!("{what}: could not start: {e}"))?;
    eprintln!(
        "xtask: {what}: {} in {:.1} s",
        if status.success() { "done" } else { "FAILED" },
        t.elapsed().as_secs_f64()
    );
    Ok(status)
}

/// Re-runs this binary with the `pjrt` feature (`cargo run --release --quiet -p xtask --features
/// pjrt -- ARGS`) in the setup environment, from the current directory so relative paths hold.
/// Exits with the child's status when it fails (its own error message is already printed).
#[cfg(not(feature = "pjrt"))]
pub fn reexec_with_pjrt(args: &[String]) -> Result<(), String> {
    let paths = setup::ensure(false)?;
    let manifest = root().join("Cargo.toml");
    let manifest = manifest.to_string_lossy();
    let mut a = vec!["run", "--manifest-path", &manifest, "--release", "--quiet", "-p", "xtask"];
    a.extend(["--features", "pjrt", "--"]);
    a.extend(args.iter().map(String::as_str));
    let mut cmd = cargo(&paths, &a);
    if let Ok(cwd) = std::env::current_dir() {
        cmd.current_dir(cwd);
    }
    let cmd_name = args.first().map_or("xtask", String::as_str);
    eprintln!(
        "xtask: `{cmd_name}` needs the PJRT backend: running xtask with --features pjrt \
         (the first build takes a few minutes)"
    );
    let status = status(cmd, &format!("{cmd_name} (pjrt)"))?;
    if status.success() {
        return Ok(());
    }
    std::process::exit(status.code().unwrap_or(1));
}

/// Whether `cargo nextest` is installed.
pub fn has_nextest() -> bool {
    Command::new("cargo").args(["nextest", "--version"]).output().map(|o| o.status.success()).unwrap_or(false)
}
