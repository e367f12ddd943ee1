//! Plugin discovery (env var, then the setup folder), loading, and the header/plugin version check.

use std::path::{Path, PathBuf};

use pjrt::Api;

use super::guard::guarded;
use super::raw::RawApi;
use crate::error::{is_struct_size_complaint, pjrt_message, Result, TpuError};

/// PJRT C API version of the header pjrt-sys was built against.
pub const BINDINGS_VERSION: (u32, u32) = (pjrt_sys::PJRT_API_MAJOR, pjrt_sys::PJRT_API_MINOR);

/// Oldest header minor that today's plugins accept (pjrt-sys 0.2.0 ships header 0.54, which they
/// reject).
pub const MIN_BINDINGS_MINOR: u32 = 81;

// A build against the bundled header fails here, with the fix, instead of at run time.
const _: () = assert!(
    pjrt_sys::PJRT_API_MAJOR == 0 && pjrt_sys::PJRT_API_MINOR >= MIN_BINDINGS_MINOR,
    "pjrt-sys was built against its bundled pjrt_c_api.h (API 0.54), too old for today's PJRT plugins. \
     Run `cargo xtask setup` and build through `cargo xtask ...`, or run `eval \"$(cargo xtask env)\"` \
     before plain cargo: BINDGEN_EXTRA_CLANG_ARGS then points bindgen at the setup's header (API >= 0.81) \
     and cargo rebuilds pjrt-sys."
);

/// Env var with the path of the PJRT plugin `.so` the runtime loads by default.
pub const PLUGIN_ENV: &str = "KDA_PJRT_PLUGIN";
/// Env var with the folder `cargo xtask setup` installed into (`<workspace>/.kda` there);
/// `cargo xtask env` prints it. Its CPU plugin and libtpu are the defaults when
/// [`PLUGIN_ENV`] and [`LIBTPU_ENV`] are unset.
pub const HOME_ENV: &str = "KDA_HOME";
/// Env var with the path of libtpu for ahead-of-time TPU compiles.
pub const LIBTPU_ENV: &str = "KDA_LIBTPU";

/// Env var with the path of XLA's CUDA plugin for deviceless GPU compiles (and GPU runs).
pub const CUDA_PLUGIN_ENV: &str = "KDA_CUDA_PLUGIN";

/// The setup folder, `$KDA_HOME`, if set.
pub fn kda_home() -> Option<PathBuf> {
    std::env::var_os(HOME_ENV).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The CPU plugin inside a setup folder.
pub fn setup_cpu_plugin(home: &Path) -> PathBuf {
    home.join("plugins/cpu/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so")
}

/// libtpu inside a setup folder.
pub fn setup_libtpu(home: &Path) -> PathBuf {
    home.join("plugins/tpu/libtpu/libtpu.so")
}

/// XLA's CUDA plugin inside a setup folder (`jax-cuda13-pjrt`).
pub fn setup_cuda_plugin(home: &Path) -> PathBuf {
    home.join("plugins/cuda/jax_plugins/xla_cuda13/xla_cuda_plugin.so")
}

/// The CUDA tools folder for the plugin at `plugin` (`.../jax_plugins/xla_cuda13/*.so`): the
/// `nvidia/cu13` folder of the same install (`bin/ptxas`, `nvvm/libdevice/libdevice.10.bc`).
pub fn cuda_tools_for(plugin: &Path) -> PathBuf {
    let install = plugin.ancestors().nth(3).unwrap_or(Path::new("."));
    install.join("nvidia/cu13")
}

/// Where a plugin path came from, for the not-found message.
#[derive(Debug, Clone)]
pub struct PluginLocation {
    /// The `.so` to load.
    pub path: PathBuf,
    /// "CPU PJRT plugin", "libtpu", ...
    pub what: &'static str,
    /// How to fix a missing file.
    pub hint: String,
}

/// The default plugin: `$KDA_PJRT_PLUGIN`, else `$KDA_HOME`'s CPU plugin. Nothing else: a
/// library never guesses a path from where it was built.
pub fn default_plugin() -> PluginLocation {
    locate(PLUGIN_ENV, setup_cpu_plugin, "PJRT plugin")
}

/// libtpu: `$KDA_LIBTPU`, else `$KDA_HOME`'s copy.
pub fn default_libtpu() -> PluginLocation {
    locate(LIBTPU_ENV, setup_libtpu, "libtpu")
}

/// XLA's CUDA plugin: `$KDA_CUDA_PLUGIN`, else `$KDA_HOME`'s copy.
pub fn default_cuda_plugin() -> PluginLocation {
    locate(CUDA_PLUGIN_ENV, setup_cuda_plugin, "CUDA PJRT plugin")
}

fn locate(var: &str, in_home: fn(&Path) -> PathBuf, what: &'static str) -> PluginLocation {
    if let Some(p) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        return PluginLocation {
            path: PathBuf::from(p),
            what,
            hint: format!("${var} points here; fix it, or unset it to use ${HOME_ENV}'s"),
        };
    }
    match kda_home() {
        Some(home) => PluginLocation {
            path: in_home(&home),
            what,
            hint: format!(
                "${HOME_ENV} points at {}; run `cargo xtask setup` to install it there (or set ${var} to a .so)",
                home.display()
            ),
        },
        None => PluginLocation {
            path: PathBuf::from("(no path)"),
            what,
            hint: format!(
                "neither ${var} nor ${HOME_ENV} is set: pass a path (PjrtOptions::plugin), set ${var} to a .so, \
                 or run `eval \"$(cargo xtask env)\"` after `cargo xtask setup`"
            ),
        },
    }
}

/// Loads a plugin: dlopen and a version check first (no PJRT call yet), then pjrt's loader, which
/// runs `PJRT_Plugin_Initialize` (pjrt caches by path). Returns both views of the plugin.
pub(crate) fn load(loc: &PluginLocation) -> Result<(Api, RawApi)> {
    if !loc.path.is_file() {
        return Err(TpuError::PluginNotFound {
            what: loc.what.to_string(),
            path: loc.path.display().to_string(),
            hint: loc.hint.clone(),
        });
    }
    let path = loc.path.to_string_lossy().into_owned();
    let _span = tracing::info_span!("plugin_load", path = %path).entered();
    let raw = RawApi::open(&loc.path)?;
    check_versions(raw.version())?;
    // `Api::wrap` expects PJRT_Plugin_Initialize to succeed and asserts a non-null api: guarded.
    let api = guarded("plugin load", || {
        pjrt::plugin(path.clone())
            .load()
            .map_err(|e| TpuError::PluginLoad { path: path.clone(), message: pjrt_message(&e) })
    })?;
    Ok((api, raw))
}

/// The plugin's PJRT C API version (a field read; safe even with a mismatched header).
pub fn plugin_version(api: &Api) -> (i32, i32) {
    let v = api.version();
    (v.major_version, v.minor_version)
}

/// Rejects bindings of another major than `plugin`'s, or older than [`MIN_BINDINGS_MINOR`].
pub fn check_versions(plugin: (i32, i32)) -> Result<()> {
    let (major, minor) = BINDINGS_VERSION;
    if i64::from(major) != i64::from(plugin.0) || minor < MIN_BINDINGS_MINOR {
        return Err(TpuError::HeaderTooOld { bindings: BINDINGS_VERSION, plugin, detail: String::new() });
    }
    Ok(())
}

/// Maps a plugin's struct-size complaint to [`TpuError::HeaderTooOld`]; other errors via `other`.
pub fn explain(api: &Api, e: &pjrt::Error, other: impl FnOnce(String) -> TpuError) -> TpuError {
    if is_struct_size_complaint(e) {
        return TpuError::HeaderTooOld {
            bindings: BINDINGS_VERSION,
            plugin: plugin_version(api),
            detail: pjrt_message(e),
        };
    }
    other(pjrt_message(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_check_accepts_newer_plugins_and_rejects_other_majors() {
        assert!(check_versions((0, 115)).is_ok());
        let err = check_versions((1, 0)).unwrap_err();
        assert!(matches!(err, TpuError::HeaderTooOld { plugin: (1, 0), .. }), "{err}");
    }
}
