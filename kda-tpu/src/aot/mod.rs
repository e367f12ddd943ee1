//! Deviceless ahead-of-time TPU compiles through libtpu: proves a program is accepted by the TPU
//! compiler for a named topology and returns its memory statistics (with peak) and cost analysis.
//! Nothing runs: numbers of record come from the CPU plugin.

pub mod cycles;
pub mod gpu;
pub mod gpu_model;
mod guards;
pub mod mosaic_text;
mod units;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use cycles::StaticCycles;
pub use gpu::{GpuAotReport, GpuCompiler, GpuKernelFigures, GpuTarget, H200};

use crate::error::{Result, TpuError};
use crate::runtime::guard::guarded;
use crate::runtime::plugin::{self, PluginLocation};
use crate::runtime::raw::RawApi;
use crate::runtime::{CompileOptions, MemoryStats};

/// The topology used when none is given: TPU v7x, 2x2x1 chips.
pub const DEFAULT_TOPOLOGY: &str = "tpu7x:2x2x1";

/// The compiler's cost estimate for one program.
#[derive(Debug, Clone, PartialEq)]
pub struct CostAnalysis {
    /// Floating-point operations (`flops`).
    pub flops: f64,
    /// Bytes read and written (`bytes accessed`).
    pub bytes_accessed: f64,
    /// The compiler's time estimate; meaningless (often negative) for programs with `while` loops.
    pub optimal_seconds: f64,
    /// Every numeric property the compiler reported, by name.
    pub properties: BTreeMap<String, f64>,
}

/// What a deviceless compile reports.
#[derive(Debug, Clone, PartialEq)]
pub struct AotReport {
    /// The topology compiled for.
    pub topology: String,
    /// Memory statistics, including `peak_bytes`.
    pub memory: MemoryStats,
    /// The cost analysis.
    pub cost: CostAnalysis,
    /// Wall time of the compile.
    pub compile_time: Duration,
    /// The VMEM each Mosaic kernel of the program reserves (`used_scoped_memory_configs` of
    /// its custom call in the optimized program), in program order; empty without kernels,
    /// and when the plugin does not hand out the optimized program.
    pub kernel_vmem_bytes: Vec<u64>,
    /// The static cycle count from libtpu's bundle listings ([`cycles`]), when the compiler
    /// was set up to read them ([`TpuCompiler::with_listings`]).
    pub static_cycles: Option<StaticCycles>,
}

/// libtpu loaded for deviceless compiles. Not `Send` (it holds the raw plugin table).
pub struct TpuCompiler {
    raw: RawApi,
    version: (i32, i32),
    listings: Option<PathBuf>,
}

impl std::fmt::Debug for TpuCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpuCompiler(PJRT API {}.{})", self.version.0, self.version.1)
    }
}

impl TpuCompiler {
    /// Loads `$KDA_LIBTPU`, else `$KDA_HOME`'s libtpu (`plugins/tpu/libtpu/libtpu.so`). Set
    /// `TPU_SKIP_MDS_QUERY=1` first off Google Cloud.
    pub fn load() -> Result<Self> {
        Self::from_location(&plugin::default_libtpu())
    }

    /// Loads libtpu from `path`.
    pub fn with_libtpu(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        Self::from_location(&PluginLocation { path, what: "libtpu", hint: "check the path".to_string() })
    }

    fn from_location(loc: &PluginLocation) -> Result<Self> {
        // Without this variable libtpu spends over a minute retrying a cloud metadata server off
        // GCP, then fails. The library does not change the process environment: the caller
        // sets it (`cargo xtask env` prints it; xtask sets it for itself).
        if std::env::var_os("TPU_SKIP_MDS_QUERY").is_none() {
            tracing::warn!(
                "TPU_SKIP_MDS_QUERY is unset: off GCP, libtpu retries a metadata server for about 90 s"
            );
        }
        let (_api, raw) = plugin::load(loc)?;
        let version = raw.version();
        Ok(Self { raw, version, listings: None })
    }

    /// Counts static cycles ([`AotReport::static_cycles`]) from the listings libtpu writes to
    /// `dir`, which needs `LIBTPU_INIT_ARGS` to hold [`cycles::listing_flags`]`(dir)` before
    /// libtpu is loaded (the library leaves the environment to its caller). Each compile reads
    /// the files it added and removes them (tens of MB per program); with `KDA_KEEP=DIR` set, it
    /// first copies them to `DIR`, an existing folder (to read a kernel's bundles).
    pub fn with_listings(mut self, dir: impl Into<PathBuf>) -> Self {
        self.listings = Some(dir.into());
        self
    }

    /// libtpu's PJRT C API version.
    pub fn plugin_version(&self) -> (i32, i32) {
        self.version
    }

    /// How many PJRT devices libtpu reports for `topology`: on `tpu7x:2x2x1` each of the four
    /// v7x chips shows as two devices (one per TensorCore), so 8.
    pub fn device_count(&self, topology: &str) -> Result<usize> {
        check_topology(topology)?;
        guarded("topology devices", || self.raw.topology_device_count(topology))
    }

    /// Compiles StableHLO text for `topology` (e.g. [`DEFAULT_TOPOLOGY`]) with default options.
    pub fn compile(&self, program: &str, topology: &str) -> Result<AotReport> {
        self.compile_with(program, topology, &CompileOptions::default())
    }

    /// Compiles StableHLO text for `topology` with `options`.
    pub fn compile_with(&self, program: &str, topology: &str, options: &CompileOptions) -> Result<AotReport> {
        check_topology(topology)?;
        let _span = tracing::info_span!("compile", topology, bytes = program.len()).entered();
        let started = Instant::now();
        // Replicas map to the topology's devices 0..n in order (deviceless: ids, no devices).
        let ids: Vec<i64> = (0..options.replicas() as i64).collect();
        let encoded = options.to_pjrt(&ids).encode();
        let before = self.listings.as_deref().map(listing_files).transpose()?;
        let (memory, properties, optimized) = guarded("aot compile", || {
            self.raw.compile_for_topology(topology, program, &encoded, |raw, exe| {
                Ok((raw.memory_stats(exe)?, raw.cost_analysis(exe)?, raw.optimized_program(exe).ok()))
            })
        })
        .map_err(|e| match e {
            TpuError::Unsupported { what, message } => TpuError::Unsupported {
                what,
                message: format!("{message}; known names: tpu7x:2x2x1, v6e:2x2, v5e:2x2, v5p:2x2x1"),
            },
            other => other,
        })?;
        let get = |k: &str| properties.get(k).copied().unwrap_or(f64::NAN);
        let cost = CostAnalysis {
            flops: get("flops"),
            bytes_accessed: get("bytes accessed"),
            optimal_seconds: get("optimal_seconds"),
            properties: properties.clone(),
        };
        let kernel_vmem_bytes = optimized.as_deref().map(scoped_vmem).unwrap_or_default();
        let compile_time = started.elapsed();
        let static_cycles = match (self.listings.as_deref(), before) {
            (Some(dir), Some(before)) => {
                let _span = tracing::info_span!("static_cycles").entered();
                let new: Vec<PathBuf> =
                    listing_files(dir)?.into_iter().filter(|f| !before.contains(f)).collect();
                let counted = cycles::count(&new);
                for f in &new {
                    if let Ok(keep) = std::env::var("KDA_KEEP") {
                        let _ = std::fs::copy(
                            f,
                            std::path::Path::new(&keep).join(f.file_name().unwrap_or_default()),
                        );
                    }
                    // Best effort: a listing left behind only costs disk.
                    let _ = std::fs::remove_file(f);
                }
                Some(counted?)
            }
            _ => None,
        };
        Ok(AotReport {
            topology: topology.to_string(),
            memory,
            cost,
            compile_time,
            kernel_vmem_bytes,
            static_cycles,
        })
    }
}

/// The files in `dir` (none when it does not exist yet).
fn listing_files(dir: &Path) -> Result<std::collections::BTreeSet<PathBuf>> {
    match std::fs::read_dir(dir) {
        Ok(entries) => Ok(entries.filter_map(|e| e.ok().map(|e| e.path())).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Default::default()),
        Err(e) => Err(TpuError::Compile { message: format!("cannot list {}: {e}", dir.display()) }),
    }
}

/// Rejects names libtpu is known to refuse, with the right spelling (`v7x:..` is `tpu7x:..`).
pub fn check_topology(topology: &str) -> Result<()> {
    if let Some(rest) = topology.strip_prefix("v7x") {
        return Err(TpuError::unsupported(
            format!("TPU topology `{topology}`"),
            format!("libtpu names TPU v7x `tpu7x`: use `tpu7x{rest}` (default {DEFAULT_TOPOLOGY})"),
        ));
    }
    if !topology.contains(':') {
        return Err(TpuError::unsupported(
            format!("TPU topology `{topology}`"),
            format!(
                "expected `<generation>:<chips>` such as {DEFAULT_TOPOLOGY}, v6e:2x2, v5e:2x2, v5p:2x2x1"
            ),
        ));
    }
    Ok(())
}

/// The scoped VMEM of each Mosaic custom call in a serialized optimized program: libtpu
/// writes each instruction's backend config as JSON, and a kernel's holds its
/// `custom_call_config` and then its `used_scoped_memory_configs` (`{"size":"N"}` entries,
/// summed).
fn scoped_vmem(program: &[u8]) -> Vec<u64> {
    let text = String::from_utf8_lossy(program);
    let mut out = Vec::new();
    let kernels: Vec<usize> = text.match_indices("\"custom_call_config\"").map(|(at, _)| at).collect();
    for (i, &at) in kernels.iter().enumerate() {
        // Only this kernel's config: up to the next kernel's.
        let rest = &text[at..kernels.get(i + 1).copied().unwrap_or(text.len())];
        let Some(start) = rest.find("\"used_scoped_memory_configs\":[") else { continue };
        let list = &rest[start..];
        let list = &list[..list.find(']').unwrap_or(list.len())];
        let sizes =
            list.split("\"size\":\"").skip(1).filter_map(|s| s.split('"').next()?.parse::<u64>().ok());
        out.push(sizes.sum());
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_vmem_is_read_from_the_custom_calls_config() {
        let program = br#"x{"used_scoped_memory_configs":[],"dma":5}y{"custom_call_config":{"body":"AAA"},"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"196608"},{"memory_space":"1","offset":"196608","size":"1024"}],"retry":1}"#;
        assert_eq!(super::scoped_vmem(program), vec![197_632]);
        assert_eq!(super::scoped_vmem(b"no kernels"), Vec::<u64>::new());
    }
}
