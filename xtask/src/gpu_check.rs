//! `cargo xtask gpu-check`: stages what a GPU host without cargo runs in one go: the test
//! binaries of the `gpu::` tier, the `xtask` binary for `gpu-bench`, fla-core 0.6.0's wheel
//! with `einops` and a timing script for fla's forward and forward+backward, and `run.sh`, which runs them all on the
//! host's CUDA plugin.

use crate::cargo_cmd::{cargo, root};
use crate::cli;
use crate::setup;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// The usage text.
pub const USAGE: &str = "\
usage: cargo xtask gpu-check [--dir DIR]

Builds the test binaries of the `gpu::` tier in release (each kernel of the kernel language's
op tests through its Triton lowering on a GPU against the host computation, the GPU forward
kernels against the f64 reference, the `triton` row's conformance covering set and a repeated
forward compared bitwise) and the `xtask` binary (for `gpu-bench`: this library's `triton` and
`xla` forwards and fused forward+VJPs at the benchmark shapes), downloads fla-core 0.6.0's
wheel and einops (checked to install offline into a fresh virtual environment here), and stages
them with fla_bench.py (fla's chunk_kda forward, and forward plus backward(), at the same
shapes) and run.sh in DIR (default target/gpu-check, at
most 64 MiB), for a GPU host that has jax 0.11.2 with jax-cuda13-pjrt 0.11.2, torch and triton
installed and no cargo (x86-64 Linux, like this machine). There:

  bash target/gpu-check/run.sh     # results under $OUT (else DIR/out); exits non-zero on a failure

It finds the CUDA plugin through Python (or $KDA_CUDA_PLUGIN), and ptxas and libdevice in the
site-packages' nvidia/cu13 (or $KDA_CUDA_DIR); prints the GPU (nvidia-smi) and each test.

options:
  --dir DIR    where to stage (default target/gpu-check)
  -h, --help   show this text";

/// The test binaries the GPU host runs, each with the filter of its `gpu::` tests.
const BINARIES: [(&str, &str, &str); 3] =
    [("kda-tpu", "lang", "gpu::"), ("kda-tpu", "gpu_kernels", "gpu::"), ("kda-tpu", "conformance", "gpu::")];

/// The Python packages the fla timing needs beside the host's torch and triton, as pip pins.
const WHEELS: [&str; 2] = ["fla-core==0.6.0", "einops==0.8.1"];

/// The fla timing script.
const FLA_SCRIPT: &str = include_str!("../scripts/fla_bench.py");

/// Parsed flags: the staging folder; `None` means help was asked for.
pub fn parse_args(args: &[String]) -> Result<Option<PathBuf>, String> {
    let mut dir = root().canonicalize().unwrap_or_else(|_| root()).join("target/gpu-check");
    let mut flags = cli::Flags::new(args);
    while let Some(flag) = flags.next_flag()? {
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--dir" => dir = PathBuf::from(flags.value(&flag)?),
            _ => return Err(format!("unknown argument `{flag}`")),
        }
    }
    Ok(Some(dir))
}

/// The entry point of `cargo xtask gpu-check`; `args` are the arguments after `gpu-check`.
pub fn gpu_check(args: &[String]) -> Result<(), String> {
    let Some(dir) = parse_args(args).map_err(|e| format!("xtask gpu-check: {e}\n\n{USAGE}"))? else {
        println!("{USAGE}");
        return Ok(());
    };
    let paths = setup::ensure(false)?;
    let bin = dir.join("bin");
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("remove {}: {e}", dir.display()))?;
    }
    fs::create_dir_all(&bin).map_err(|e| format!("create {}: {e}", bin.display()))?;
    let mut total = 0;
    for (package, test, _) in BINARIES {
        let exe = build_test(&paths, package, test)?;
        let to = bin.join(test);
        fs::copy(&exe, &to).map_err(|e| format!("copy {} -> {}: {e}", exe.display(), to.display()))?;
        total += fs::metadata(&to).map(|m| m.len()).unwrap_or(0);
        eprintln!("gpu-check: staged {} ({:.1} MiB)", to.display(), mib(&to));
    }
    let exe = build_xtask(&paths)?;
    let to = bin.join("xtask");
    fs::copy(&exe, &to).map_err(|e| format!("copy {} -> {}: {e}", exe.display(), to.display()))?;
    total += fs::metadata(&to).map(|m| m.len()).unwrap_or(0);
    eprintln!("gpu-check: staged {} ({:.1} MiB)", to.display(), mib(&to));
    total += stage_wheels(&dir.join("wheels"))?;
    fs::write(dir.join("fla_bench.py"), FLA_SCRIPT).map_err(|e| format!("write fla_bench.py: {e}"))?;
    total += FLA_SCRIPT.len() as u64;
    if total > 64 << 20 {
        return Err(format!(
            "gpu-check: {:.1} MiB staged, over the 64 MiB a device run carries",
            total as f64 / 1048576.0
        ));
    }
    let script = dir.join("run.sh");
    fs::write(&script, run_script()).map_err(|e| format!("write {}: {e}", script.display()))?;
    println!(
        "gpu-check: staged in {} ({:.1} MiB); on the GPU host: bash {}",
        dir.display(),
        total as f64 / 1048576.0,
        script.display()
    );
    Ok(())
}

fn mib(p: &Path) -> f64 {
    fs::metadata(p).map(|m| m.len() as f64 / 1048576.0).unwrap_or(0.0)
}

/// Downloads [`WHEELS`] into `dir` and installs them offline into a fresh virtual environment
/// (no dependencies: the GPU host brings torch and triton); returns their bytes.
fn stage_wheels(dir: &Path) -> Result<u64, String> {
    fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let run = |what: &str, cmd: &mut std::process::Command| -> Result<(), String> {
        let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
        match out.status.success() {
            true => Ok(()),
            false => Err(format!("{what} failed: {}", String::from_utf8_lossy(&out.stderr))),
        }
    };
    let mut download = std::process::Command::new("python3");
    download.args(["-m", "pip", "download", "--no-deps", "--dest"]).arg(dir).args(WHEELS);
    run("pip download", &mut download)?;
    let venv = std::env::temp_dir().join(format!("kda-gpu-check-venv-{}", std::process::id()));
    let _ = fs::remove_dir_all(&venv);
    run("python3 -m venv", std::process::Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    let mut install = std::process::Command::new(venv.join("bin/pip"));
    install.args(["install", "--no-index", "--no-deps", "--find-links"]).arg(dir).args(WHEELS);
    let installed = run("pip install (offline)", &mut install);
    let _ = fs::remove_dir_all(&venv);
    installed?;
    eprintln!("gpu-check: {} install offline into a fresh virtual environment", WHEELS.join(" and "));
    let mut total = 0;
    for e in fs::read_dir(dir).map_err(|e| format!("read {}: {e}", dir.display()))?.flatten() {
        total += e.metadata().map(|m| m.len()).unwrap_or(0);
    }
    Ok(total)
}

/// Builds the `xtask` binary with its `pjrt` feature in release and returns it.
fn build_xtask(paths: &setup::Paths) -> Result<PathBuf, String> {
    let args = ["build", "--release", "-p", "xtask", "--features", "pjrt", "--message-format=json"];
    built(paths, &args, "xtask")
}

/// Builds `package`'s test `test` with every feature in release (small binaries, fast tests)
/// and returns its executable.
fn build_test(paths: &setup::Paths, package: &str, test: &str) -> Result<PathBuf, String> {
    let args = [
        "test",
        "--release",
        "-p",
        package,
        "--all-features",
        "--test",
        test,
        "--no-run",
        "--message-format=json",
    ];
    built(paths, &args, test)
}

/// Runs cargo with `args` (JSON messages) and returns the executable of target `target`, read
/// from cargo's messages.
fn built(paths: &setup::Paths, args: &[&str], target: &str) -> Result<PathBuf, String> {
    let out = cargo(paths, args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!("cargo {} failed ({})", args.join(" "), out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    executable(&text, target).ok_or_else(|| format!("cargo built no executable for `{target}`"))
}

/// The `"executable"` of the compiler-artifact message of test target `test`.
fn executable(messages: &str, test: &str) -> Option<PathBuf> {
    let target = format!("\"name\":\"{test}\"");
    messages
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && l.contains(&target))
        .find_map(|l| {
            let at = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let rest = &l[at..];
            Some(PathBuf::from(&rest[..rest.find('"')?]))
        })
}

/// The script the GPU host runs (bash, no cargo): each staged binary's `gpu::` tests, one at a
/// time, with the CUDA plugin and its CUDA tools found there.
fn run_script() -> String {
    let mut runs = String::new();
    for (_, test, filter) in BINARIES {
        runs.push_str(&format!("run_tests {test} \"$here/bin/{test}\" {filter}\n"));
    }
    let wheels = WHEELS.join(" ");
    format!(
        r#"#!/usr/bin/env bash
# Written by `cargo xtask gpu-check`: runs the gpu:: tier of the staged test binaries on this
# host's GPU through the CUDA PJRT plugin. Results under $OUT (else this folder's out/).
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${{OUT:-$here/out}}
mkdir -p "$out"
plugin=${{KDA_CUDA_PLUGIN:-$(python3 -c 'import os, jax_plugins.xla_cuda13 as m; print(os.path.join(m.__path__[0], "xla_cuda_plugin.so"))' 2>/dev/null)}}
if [ ! -f "$plugin" ]; then echo "gpu-check: no CUDA plugin (pip install jax-cuda13-pjrt==0.11.2, or set KDA_CUDA_PLUGIN)" | tee "$out/summary.txt"; exit 2; fi
find_cuda() {{
  python3 - <<'PY'
import os, sys
for p in sys.path:
    c = os.path.join(p, "nvidia", "cu13")
    if os.path.isfile(os.path.join(c, "bin", "ptxas")):
        print(c)
        break
PY
}}
cuda=${{KDA_CUDA_DIR:-$(find_cuda 2>/dev/null)}}
export KDA_PJRT_PLUGIN="$plugin"
if [ -n "$cuda" ]; then export XLA_FLAGS="${{XLA_FLAGS:-}} --xla_gpu_cuda_data_dir=$cuda"; fi
{{ echo "plugin: $plugin"; echo "cuda tools: ${{cuda:-(searched by the plugin)}}"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1; }} | tee "$out/host.txt"
failed=0
run_tests() {{
  local name=$1 exe=$2 filter=$3 start=$SECONDS
  "$exe" "$filter" --test-threads 1 2>&1 | tee "$out/$name.log"
  local status=${{PIPESTATUS[0]}}
  echo "$name $filter: exit $status in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  [ "$status" -eq 0 ] || failed=1
}}
{runs}# This library's forwards and fused forward+VJPs, then fla's, at the benchmark shapes (times
# are reported, not gated).
"$here/bin/xtask" gpu-bench --implementation triton,xla --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.log"
python3 -m venv --system-site-packages "$out/venv" \
  && "$out/venv/bin/pip" install --no-index --no-deps --find-links "$here/wheels" {wheels} > "$out/venv.log" 2>&1 \
  && "$out/venv/bin/python" "$here/fla_bench.py" --json "$out/fla.json" 2>&1 | tee "$out/fla.log"
exit $failed
"#
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_the_test_executable_in_cargos_messages() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","target":{"name":"kda_tpu","kind":["lib"]},"executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"name":"lang","kind":["test"]},"executable":"/w/target/debug/deps/lang-1f"}"#,
        );
        assert_eq!(super::executable(messages, "lang"), Some("/w/target/debug/deps/lang-1f".into()));
        assert_eq!(super::executable(messages, "sweep"), None);
    }

    #[test]
    fn the_script_runs_each_binarys_gpu_tier() {
        let s = super::run_script();
        assert!(s.starts_with("#!/usr/bin/env bash"));
        assert!(s.contains("run_tests lang \"$here/bin/lang\" gpu::"), "{s}");
        assert!(s.contains("export KDA_PJRT_PLUGIN=\"$plugin\""));
        assert!(s.contains("--xla_gpu_cuda_data_dir=$cuda"));
        assert!(s.contains("run_tests conformance \"$here/bin/conformance\" gpu::"), "{s}");
        assert!(s.contains("\"$here/bin/xtask\" gpu-bench --implementation triton,xla"), "{s}");
        assert!(s.contains("--find-links \"$here/wheels\" fla-core==0.6.0 einops==0.8.1"), "{s}");
        assert!(s.contains("\"$here/fla_bench.py\""), "{s}");
    }

    #[test]
    fn takes_a_dir() {
        let d = super::parse_args(&["--dir".to_string(), "/tmp/g".to_string()]).unwrap();
        assert_eq!(d, Some("/tmp/g".into()));
        assert!(super::parse_args(&["--x".to_string()]).is_err());
    }
}
