//! Deviceless ahead-of-time CUDA compiles through XLA's CUDA PJRT plugin: proves that a program
//! (Triton kernels included, `__gpu$xla.gpu.triton` custom calls) compiles for a GPU described
//! by a target file, with no GPU and no CUDA driver, and reads each kernel's launch, register,
//! spill and shared-memory figures from the compiler's dumps. Nothing runs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::gpu_model::{hlo_launches, ProgramModel};
use crate::error::{Result, TpuError};
use crate::runtime::guard::guarded;
use crate::runtime::plugin::{self, PluginLocation};
use crate::runtime::raw::RawApi;
use crate::runtime::{CompileOptions, MemoryStats, XlaOption};

/// A GPU to compile for: its name and XLA's `GpuTargetConfigProto` in text form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuTarget {
    /// The CLI name (`h200`).
    pub name: &'static str,
    /// The `ptxas --gpu-name` of the target (`sm_90a`).
    pub arch: &'static str,
    /// The target config, protobuf text.
    pub config: &'static str,
}

/// The NVIDIA H200 (132 SMs, compute capability 9.0a), written for this project.
pub const H200: GpuTarget =
    GpuTarget { name: "h200", arch: "sm_90a", config: include_str!("targets/h200.txtpb") };

/// The targets `--target` takes.
pub const GPU_TARGETS: [GpuTarget; 1] = [H200];

/// The target named `name`, or an `Unsupported` error listing the known ones.
pub fn gpu_target(name: &str) -> Result<GpuTarget> {
    GPU_TARGETS.iter().copied().find(|t| t.name == name).ok_or_else(|| {
        let known: Vec<&str> = GPU_TARGETS.iter().map(|t| t.name).collect();
        TpuError::unsupported(format!("GPU target `{name}`"), format!("known targets: {}", known.join(", ")))
    })
}

/// One GPU kernel of a compiled program, as the compiler's dumps describe it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuKernelFigures {
    /// The kernel's name in the thunk sequence (a Triton kernel: its `tt.func` name).
    pub name: String,
    /// Launch grid.
    pub grid: [u64; 3],
    /// Threads per block.
    pub threads: [u64; 3],
    /// Dynamic shared memory per block, bytes.
    pub shared_memory_bytes: u64,
    /// Registers per thread (`ptxas -v`), when the PTX was found.
    pub registers: Option<u64>,
    /// Bytes of spill stores and loads per thread (`ptxas -v`).
    pub spill_store_bytes: Option<u64>,
    /// Bytes of spill loads per thread.
    pub spill_load_bytes: Option<u64>,
}

/// What a deviceless GPU compile reports.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuAotReport {
    /// The target compiled for.
    pub target: String,
    /// Memory statistics (arguments, outputs, temporaries).
    pub memory: MemoryStats,
    /// Wall time of the compile.
    pub compile_time: Duration,
    /// Kernel launches of one call, in program order (empty unless figures were asked for:
    /// [`GpuCompiler::with_figures`]).
    pub kernels: Vec<GpuKernelFigures>,
    /// The static model's compulsory HBM bytes of each op of the optimized program's entry
    /// computation (loop bodies not counted; empty unless figures were asked for); FLOPs are
    /// added from the kernels' definitions ([`super::gpu_model::kernel_work`]).
    pub model: ProgramModel,
}

/// XLA's CUDA plugin loaded for deviceless compiles, with the CUDA tools folder (`ptxas`,
/// libdevice) it compiles with. Not `Send` (it holds the raw plugin table).
pub struct GpuCompiler {
    raw: RawApi,
    version: (i32, i32),
    cuda_dir: PathBuf,
    figures: Option<PathBuf>,
}

impl std::fmt::Debug for GpuCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuCompiler(PJRT API {}.{}, {})", self.version.0, self.version.1, self.cuda_dir.display())
    }
}

impl GpuCompiler {
    /// Loads `$KDA_CUDA_PLUGIN`, else `$KDA_HOME`'s CUDA plugin, with the CUDA tools that
    /// `cargo xtask setup` installed beside it (`nvidia/cu13`: `bin/ptxas`, `nvvm/libdevice`).
    pub fn load() -> Result<Self> {
        let loc = plugin::default_cuda_plugin();
        let cuda_dir = plugin::cuda_tools_for(&loc.path);
        Self::with_plugin(&loc, cuda_dir)
    }

    /// Loads the CUDA plugin at `loc`, compiling with the CUDA tools in `cuda_dir`.
    pub fn with_plugin(loc: &PluginLocation, cuda_dir: PathBuf) -> Result<Self> {
        if !cuda_dir.join("bin/ptxas").is_file() {
            return Err(TpuError::PluginNotFound {
                what: "ptxas (CUDA tools for the CUDA plugin)".to_string(),
                path: cuda_dir.join("bin/ptxas").display().to_string(),
                hint:
                    "run `cargo xtask setup`: it installs nvidia-cuda-nvcc and nvidia-nvvm beside the plugin"
                        .to_string(),
            });
        }
        let (_api, raw) = plugin::load(loc)?;
        let version = raw.version();
        Ok(Self { raw, version, cuda_dir, figures: None })
    }

    /// Reads each kernel's figures ([`GpuAotReport::kernels`]) from dumps the compiler writes
    /// under `dir` (one fresh folder per compile, removed after reading unless
    /// `KDA_KEEP_DUMPS` is set: each kernel's Triton passes are then in
    /// `main.<kernel>.triton-to-llvm.txt`, where register pressure is read).
    pub fn with_figures(mut self, dir: impl Into<PathBuf>) -> Self {
        self.figures = Some(dir.into());
        self
    }

    /// The plugin's PJRT C API version.
    pub fn plugin_version(&self) -> (i32, i32) {
        self.version
    }

    /// Compiles StableHLO text for `target`.
    pub fn compile(&self, program: &str, target: &GpuTarget) -> Result<GpuAotReport> {
        let _span = tracing::info_span!("compile", target = target.name, bytes = program.len()).entered();
        let started = Instant::now();
        let dump = match &self.figures {
            Some(dir) => Some(fresh_dump_dir(dir)?),
            None => None,
        };
        let mut options = CompileOptions::default().with_xla_option(
            "xla_gpu_cuda_data_dir",
            XlaOption::Str(self.cuda_dir.to_string_lossy().into_owned()),
        );
        if let Some(d) = &dump {
            options = options
                .with_xla_option("xla_dump_to", XlaOption::Str(d.to_string_lossy().into_owned()))
                .with_xla_option("xla_dump_emitter_re", XlaOption::Str(".*".to_string()));
        }
        let encoded = options.to_pjrt(&[0]).encode();
        let described = [("topology", "1x1x1"), ("target_config", target.config)];
        let memory = guarded("gpu aot compile", || {
            self.raw.compile_deviceless("", &described, program, &encoded, |raw, exe| raw.memory_stats(exe))
        })?;
        let compile_time = started.elapsed();
        let (kernels, model) = match &dump {
            Some(d) => {
                let read = read_figures(d, &self.cuda_dir.join("bin/ptxas"), target.arch);
                if std::env::var_os("KDA_KEEP_DUMPS").is_none() {
                    let _ = std::fs::remove_dir_all(d);
                }
                read?
            }
            None => (Vec::new(), ProgramModel::default()),
        };
        Ok(GpuAotReport { target: target.name.to_string(), memory, compile_time, kernels, model })
    }
}

/// A new empty folder under `dir` for one compile's dumps.
fn fresh_dump_dir(dir: &Path) -> Result<PathBuf> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = dir.join(format!("compile-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)
        .map_err(|e| TpuError::Compile { message: format!("cannot create {}: {e}", d.display()) })?;
    Ok(d)
}

fn io(what: &Path, e: std::io::Error) -> TpuError {
    TpuError::Compile { message: format!("{}: {e}", what.display()) }
}

/// The kernel launches of the thunk sequence in `dump`, with the registers and spills that
/// `ptxas -v` reports for the dumped PTX, and the entry computation's ops with their bytes.
fn read_figures(dump: &Path, ptxas: &Path, arch: &str) -> Result<(Vec<GpuKernelFigures>, ProgramModel)> {
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(dump).map_err(|e| io(dump, e))?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    let named = |suffix: &'static str| files.iter().filter(move |f| f.to_string_lossy().ends_with(suffix));
    let mut kernels = Vec::new();
    if let Some(seq) = named(".thunk_sequence.txt").next_back() {
        let text = std::fs::read_to_string(seq).map_err(|e| io(seq, e))?;
        kernels = thunk_kernels(&text);
    }
    let mut usage = std::collections::HashMap::new();
    for ptx in named(".ptx") {
        let out = std::process::Command::new(ptxas)
            .args(["-v", "--gpu-name", arch, "-o", "/dev/null"])
            .arg(ptx)
            .output()
            .map_err(|e| io(ptxas, e))?;
        usage.extend(ptxas_usage(&String::from_utf8_lossy(&out.stderr)));
    }
    for k in &mut kernels {
        if let Some(&(regs, stores, loads)) = usage.get(&k.name) {
            (k.registers, k.spill_store_bytes, k.spill_load_bytes) = (Some(regs), Some(stores), Some(loads));
        }
    }
    let mut model = ProgramModel::default();
    if let Some(hlo) = named("after_optimizations.txt").next_back() {
        let text = std::fs::read_to_string(hlo).map_err(|e| io(hlo, e))?;
        model.launches = hlo_launches(&text);
    }
    Ok((kernels, model))
}

/// `kCustomKernel NAME grid: [x, y, z] threads: [x, y, z] shared_memory: N bytes` lines (and
/// XLA's own kernels, `kKernel`), in order.
fn thunk_kernels(text: &str) -> Vec<GpuKernelFigures> {
    let triple = |s: &str| -> Option<[u64; 3]> {
        let inner = s.split('[').nth(1)?.split(']').next()?;
        let v: Vec<u64> = inner.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        (v.len() == 3).then(|| [v[0], v[1], v[2]])
    };
    text.lines()
        .filter_map(|line| {
            let at = line.find("kCustomKernel ").or_else(|| line.find("kKernel "))?;
            let rest = &line[at..];
            let name = rest.split(" grid:").next()?.split_whitespace().last()?.to_string();
            let grid = triple(rest.split("grid:").nth(1)?)?;
            let threads = triple(rest.split("threads:").nth(1)?)?;
            let shared =
                rest.split("shared_memory:").nth(1).and_then(|s| s.split_whitespace().next()?.parse().ok());
            Some(GpuKernelFigures {
                name,
                grid,
                threads,
                shared_memory_bytes: shared.unwrap_or(0),
                ..Default::default()
            })
        })
        .collect()
}

/// Per function: (registers, spill store bytes, spill load bytes) from `ptxas -v` output.
fn ptxas_usage(text: &str) -> Vec<(String, (u64, u64, u64))> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    let mut spills = (0, 0);
    for line in text.lines() {
        if let Some(at) = line.find("Compiling entry function '") {
            let rest = &line[at + "Compiling entry function '".len()..];
            current = rest.split('\'').next().map(str::to_string);
        } else if line.contains("bytes spill stores") {
            let n = |key: &str| -> u64 {
                line.split(key).next().and_then(|s| s.split_whitespace().last()?.parse().ok()).unwrap_or(0)
            };
            spills = (n(" bytes spill stores"), n(" bytes spill loads"));
        } else if let Some(at) = line.find("Used ") {
            let regs = line[at + 5..].split_whitespace().next().and_then(|s| s.parse().ok());
            if let (Some(name), Some(regs)) = (current.take(), regs) {
                out.push((name, (regs, spills.0, spills.1)));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn thunk_lines_give_launches() {
        let text = "001: kCustomKernel [source | sink] kv_loop grid: [8, 1, 1] threads: [128, 1, 1] shared_memory: 49152 bytes\nkCopy x\n";
        let k = super::thunk_kernels(text);
        assert_eq!(k.len(), 1);
        assert_eq!(
            (k[0].name.as_str(), k[0].grid, k[0].threads, k[0].shared_memory_bytes),
            ("kv_loop", [8, 1, 1], [128, 1, 1], 49152)
        );
    }

    #[test]
    fn ptxas_lines_give_registers_and_spills() {
        let text = "ptxas info    : Compiling entry function 'kv_loop' for 'sm_90a'\nptxas info    : Function properties for kv_loop\n    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 64 registers, used 1 barriers\n";
        assert_eq!(super::ptxas_usage(text), vec![("kv_loop".to_string(), (64, 8, 4))]);
    }

    #[test]
    fn unknown_targets_are_named() {
        let e = super::gpu_target("a100").expect_err("not written");
        assert!(e.to_string().contains("known targets: h200"), "{e}");
    }
}
