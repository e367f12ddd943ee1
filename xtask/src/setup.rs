//! `cargo xtask setup`: installs what the PJRT backend needs into `<workspace>/.kda` (or `$KDA_HOME`):
//! pjrt-sys's build tools, a PJRT C API header new enough for today's plugins, the CPU plugin, libtpu,
//! and XLA's CUDA plugin with the CUDA tools it compiles Triton kernels with (`ptxas`, libdevice).
//!
//! Idempotent: each wheel leaves a stamp (`NAME==VER`) next to its files, so a finished setup costs a
//! few `stat`s and one `dpkg -s`. Progress goes to stderr so that `eval "$(cargo xtask env)"` stays clean.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Where setup put things; every path is absolute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// The setup folder (`<workspace>/.kda` or `$KDA_HOME`).
    pub home: PathBuf,
    /// The folder to pass as `-iquote`; it holds `xla/pjrt/c/pjrt_c_api.h`.
    pub include_dir: PathBuf,
    /// The CPU PJRT plugin (`pjrt_c_api_cpu_plugin.so`, PJRT API 0.115).
    pub cpu_plugin: PathBuf,
    /// libtpu, for deviceless ahead-of-time TPU compiles (PJRT API 0.117).
    pub libtpu: PathBuf,
    /// XLA's CUDA plugin, for deviceless GPU compiles and GPU runs (PJRT API 0.115); `ptxas`
    /// and libdevice sit in `nvidia/cu13` of the same folder.
    pub cuda_plugin: PathBuf,
}

/// One pinned PyPI wheel and the file setup needs from it.
struct Wheel {
    name: &'static str,
    version: &'static str,
    /// Download size, for the progress line.
    size: &'static str,
    /// The file we need, relative to the wheel's install folder.
    file: &'static str,
    /// Other pinned wheels installed into the same folder.
    with: &'static [&'static str],
}

impl Wheel {
    /// A wheel installed alone.
    const fn alone(
        name: &'static str,
        version: &'static str,
        size: &'static str,
        file: &'static str,
    ) -> Self {
        Wheel { name, version, size, file, with: &[] }
    }
}

/// Ships `pjrt_c_api.h` at API 0.81 (the header pjrt-sys 0.2.0 bundles is 0.54, too old).
const HEADER_WHEEL: Wheel =
    Wheel::alone("xla-cpu-pjrt", "0.0.1", "64 MB", "xla_plugins/xla_cpu_pjrt/include/pjrt_c_api.h");
const CPU_WHEEL: Wheel =
    Wheel::alone("lammps-jax-pjrt-cpu", "0.11.2", "63 MB", "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so");
const TPU_WHEEL: Wheel = Wheel::alone("libtpu", "0.0.52", "137 MB", "libtpu/libtpu.so");
/// The CUDA plugin the lent H200 machine runs (so the Triton it bundles parses the kernels the
/// same way here and there), with `ptxas` (nvcc's wheel) and libdevice (nvvm's) in
/// `nvidia/cu13` beside it: deviceless compiles need both, and no GPU or driver.
const CUDA_WHEEL: Wheel = Wheel {
    name: "jax-cuda13-pjrt",
    version: "0.11.2",
    size: "233 MB",
    file: "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
    with: &["nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88"],
};

/// Debian packages pjrt-sys's build script needs (bindgen -> libclang, prost-build -> protoc and
/// the well-known types its protos import, `google/protobuf/any.proto` and the like, which
/// Debian ships in libprotobuf-dev: protobuf-compiler only recommends it, and setup installs
/// without recommends).
const APT_PACKAGES: [&str; 3] = ["libclang-dev", "protobuf-compiler", "libprotobuf-dev"];
const STAMP: &str = ".kda-stamp";

/// The setup folder: `$KDA_HOME` if set (made absolute), else `<workspace root>/.kda`.
pub fn home() -> Result<PathBuf, String> {
    match std::env::var_os("KDA_HOME").filter(|v| !v.is_empty()) {
        Some(h) => absolute(Path::new(&h)),
        None => {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            let root = root.canonicalize().map_err(|e| format!("workspace root {}: {e}", root.display()))?;
            Ok(root.join(".kda"))
        }
    }
}

fn absolute(p: &Path) -> Result<PathBuf, String> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    let cwd = std::env::current_dir().map_err(|e| format!("current directory: {e}"))?;
    Ok(cwd.join(p))
}

/// The paths setup produces under `home` (whether or not they exist yet).
pub fn paths_in(home: &Path) -> Paths {
    Paths {
        home: home.to_path_buf(),
        include_dir: home.join("include"),
        cpu_plugin: home.join("plugins/cpu").join(CPU_WHEEL.file),
        libtpu: home.join("plugins/tpu").join(TPU_WHEEL.file),
        cuda_plugin: home.join("plugins/cuda").join(CUDA_WHEEL.file),
    }
}

/// Installs whatever is missing and returns the paths; quick (no network, no pip) when all is in place.
pub fn ensure(verbose: bool) -> Result<Paths, String> {
    let home = home()?;
    let paths = paths_in(&home);
    ensure_apt_packages(verbose)?;

    let header_dir = home.join("pip").join(HEADER_WHEEL.name);
    let header = paths.include_dir.join("xla/pjrt/c/pjrt_c_api.h");
    if !stamped(&header_dir, &HEADER_WHEEL) {
        install_wheel(&header_dir, &HEADER_WHEEL, "PJRT C API header")?;
        // Only the header is used; the wheel's own (older, API 0.81) plugin is 250 MB.
        let _ = fs::remove_file(header_dir.join("xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"));
    }
    let src = header_dir.join(HEADER_WHEEL.file);
    if !header.is_file() || fs::read(&header).ok() != fs::read(&src).ok() {
        let parent = header.parent().ok_or("header path has no parent")?;
        fs::create_dir_all(parent).map_err(|e| format!("create {}: {e}", parent.display()))?;
        fs::copy(&src, &header)
            .map_err(|e| format!("copy {} -> {}: {e}", src.display(), header.display()))?;
        eprintln!("setup: header -> {}", header.display());
    } else if verbose {
        eprintln!("setup: header present: {}", header.display());
    }

    for (kind, wheel, what, file) in [
        ("cpu", &CPU_WHEEL, "CPU PJRT plugin", &paths.cpu_plugin),
        ("tpu", &TPU_WHEEL, "libtpu", &paths.libtpu),
        ("cuda", &CUDA_WHEEL, "CUDA PJRT plugin, ptxas and libdevice", &paths.cuda_plugin),
    ] {
        let dir = home.join("pip").join(wheel.name);
        let fresh = !stamped(&dir, wheel);
        if fresh {
            install_wheel(&dir, wheel, what)?;
        }
        if fresh || !file.is_file() {
            link_plugin_dir(&home, kind, wheel)?;
        } else if verbose {
            eprintln!("setup: {what} present: {}", file.display());
        }
    }
    for f in [&header, &paths.cpu_plugin, &paths.libtpu, &paths.cuda_plugin] {
        if !f.is_file() {
            return Err(format!(
                "setup finished but {} is missing; delete {} and retry",
                f.display(),
                home.display()
            ));
        }
    }
    Ok(paths)
}

/// Variables for the cargo commands xtask spawns: the header for pjrt-sys's bindgen, libtpu's
/// switch that skips a cloud metadata server (about 90 s of retries on machines outside GCP),
/// and the setup folder, where kda-tpu finds its default plugins (`KDA_HOME`).
pub fn cargo_env(paths: &Paths) -> Vec<(String, String)> {
    // bindgen splits BINDGEN_EXTRA_CLANG_ARGS with shell rules, so quote paths with spaces.
    let include = sh_quote(&paths.include_dir.to_string_lossy());
    vec![
        ("BINDGEN_EXTRA_CLANG_ARGS".to_string(), format!("-iquote {include}")),
        ("TPU_SKIP_MDS_QUERY".to_string(), "1".to_string()),
        ("KDA_HOME".to_string(), paths.home.to_string_lossy().into_owned()),
    ]
}

/// `export NAME='VALUE'` lines for users of plain cargo: `eval "$(cargo xtask env)"`.
pub fn env_lines(paths: &Paths) -> String {
    cargo_env(paths).iter().map(|(k, v)| format!("export {k}={}\n", sh_quote(v))).collect()
}

/// Quotes `s` for a POSIX shell when it holds anything beyond a safe set of characters.
fn sh_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Points `<home>/plugins/<kind>` at `../pip/<wheel>` (a relative directory link: the .so keeps its
/// siblings, and the runtime's fixed paths `plugins/cpu/...`, `plugins/tpu/libtpu/libtpu.so`,
/// `plugins/cuda/jax_plugins/...` hold).
fn link_plugin_dir(home: &Path, kind: &str, wheel: &Wheel) -> Result<(), String> {
    let plugins = home.join("plugins");
    fs::create_dir_all(&plugins).map_err(|e| format!("create {}: {e}", plugins.display()))?;
    let link = plugins.join(kind);
    if link.symlink_metadata().is_ok() {
        let removed = if link.is_dir() && !link.is_symlink() {
            fs::remove_dir_all(&link)
        } else {
            fs::remove_file(&link)
        };
        removed.map_err(|e| format!("remove stale {}: {e}", link.display()))?;
    }
    let target = Path::new("../pip").join(wheel.name);
    std::os::unix::fs::symlink(&target, &link)
        .map_err(|e| format!("link {} -> {}: {e}", link.display(), target.display()))
}

fn stamped(dir: &Path, wheel: &Wheel) -> bool {
    fs::read_to_string(dir.join(STAMP)).is_ok_and(|s| s.trim() == spec(wheel))
        && dir.join(wheel.file).is_file()
}

/// The pip specs of `wheel` and its companions, space-separated (also the stamp).
fn spec(wheel: &Wheel) -> String {
    std::iter::once(format!("{}=={}", wheel.name, wheel.version))
        .chain(wheel.with.iter().map(|w| w.to_string()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `python3 -m pip install --no-deps --target DIR NAME==VER` into a fresh folder, then the stamp.
/// `--no-deps` matters: these wheels declare jax as a dependency.
fn install_wheel(dir: &Path, wheel: &Wheel, what: &str) -> Result<(), String> {
    let spec = spec(wheel);
    eprintln!("setup: installing {what} ({spec}, {} download)...", wheel.size);
    let pip = run(Command::new("python3").args(["-m", "pip", "--version"]));
    if !pip.as_ref().is_ok_and(|o| o.status.success()) {
        return Err("setup needs pip: `python3 -m pip --version` failed. Install python3 and pip \
                    (Debian: apt-get install python3-pip) and rerun `cargo xtask setup`"
            .to_string());
    }
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(|e| format!("remove stale {}: {e}", dir.display()))?;
    }
    fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let started = std::time::Instant::now();
    let out = run(Command::new("python3")
        .args(["-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet", "--target"])
        .arg(dir)
        .args(spec.split(' ')))?;
    if !out.status.success() {
        let _ = fs::remove_dir_all(dir);
        let err = tail(&String::from_utf8_lossy(&out.stderr), 8);
        return Err(format!(
            "pip could not install {spec} (needs network access to pypi.org, or a configured index/proxy \
             via PIP_INDEX_URL): {err}"
        ));
    }
    if !dir.join(wheel.file).is_file() {
        return Err(format!("{spec} installed but {} is missing from it", wheel.file));
    }
    fs::write(dir.join(STAMP), &spec).map_err(|e| format!("write stamp in {}: {e}", dir.display()))?;
    eprintln!(
        "setup: {what} ready in {:.1} s: {}",
        started.elapsed().as_secs_f64(),
        dir.join(wheel.file).display()
    );
    Ok(())
}

/// Installs [`APT_PACKAGES`] with apt-get when `dpkg -s` says they are missing;
/// `apt-get update` only when the package lists are empty or the first install fails.
fn ensure_apt_packages(verbose: bool) -> Result<(), String> {
    let missing: Vec<&str> = match run(Command::new("dpkg").arg("-s").args(APT_PACKAGES)) {
        Ok(o) if o.status.success() => vec![],
        Ok(_) => APT_PACKAGES
            .into_iter()
            .filter(|p| !run(Command::new("dpkg").args(["-s", p])).is_ok_and(|o| o.status.success()))
            .collect(),
        // No dpkg: not Debian. Accept if protoc is on PATH, otherwise say what to install.
        Err(_) => {
            if run(Command::new("protoc").arg("--version")).is_ok_and(|o| o.status.success()) {
                return Ok(());
            }
            return Err("no dpkg and no protoc on PATH: install protoc and libclang (the build tools \
                        of pjrt-sys) with your package manager, then rerun `cargo xtask setup`"
                .to_string());
        }
    };
    if missing.is_empty() {
        if verbose {
            eprintln!("setup: {} present", APT_PACKAGES.join(", "));
        }
        return Ok(());
    }
    eprintln!("setup: installing {} with apt-get (about 20 s)...", missing.join(" "));
    let lists_empty = fs::read_dir("/var/lib/apt/lists")
        .map(|d| !d.flatten().any(|e| e.file_name().to_string_lossy().ends_with("_Packages")))
        .unwrap_or(true);
    if lists_empty {
        apt(&["update"])?;
    }
    let mut install = vec!["install", "-y", "--no-install-recommends"];
    install.extend(&missing);
    if apt(&install).is_err() && !lists_empty {
        apt(&["update"])?;
        apt(&install)?;
    }
    Ok(())
}

fn apt(args: &[&str]) -> Result<(), String> {
    let out = run(Command::new("apt-get").args(args).env("DEBIAN_FRONTEND", "noninteractive"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "`apt-get {}` failed (needs root and network; or install libclang-dev, protobuf-compiler \
         and libprotobuf-dev yourself): {}",
        args.join(" "),
        tail(&String::from_utf8_lossy(&out.stderr), 6)
    ))
}

fn run(cmd: &mut Command) -> Result<Output, String> {
    cmd.output().map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_lines_quote_paths() {
        let p = paths_in(Path::new("/a b/.kda"));
        let env = cargo_env(&p);
        assert_eq!(env[0].1, "-iquote '/a b/.kda/include'");
        assert!(env_lines(&p).starts_with("export BINDGEN_EXTRA_CLANG_ARGS='-iquote '\\''/a b/"));
        let plain = paths_in(Path::new("/w/.kda"));
        assert_eq!(cargo_env(&plain)[0].1, "-iquote /w/.kda/include");
        assert!(env_lines(&plain).contains("export TPU_SKIP_MDS_QUERY=1\n"));
        assert!(env_lines(&plain).contains("export KDA_HOME=/w/.kda\n"));
        assert!(env_lines(&p).contains("export KDA_HOME='/a b/.kda'\n"));
    }
}
