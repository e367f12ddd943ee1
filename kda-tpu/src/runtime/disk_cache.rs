//! An optional on-disk cache of compiled executables, shared between processes and runs.
//!
//! Set `KDA_COMPILE_CACHE=DIR` and every compile first looks in `DIR` for the same program; a hit
//! deserializes the executable (milliseconds) instead of compiling it (seconds for the KDA
//! programs on the CPU plugin). `cargo xtask test` sets it to `target/kda-compile-cache`, kept
//! between runs (`cargo xtask test --clean-cache` empties it).
//!
//! What must match for a hit: the program text, every compile option that changes the code (XLA
//! overrides, replica and partition counts, device assignment), the plugin build (path, size,
//! modification time, PJRT API version) and the host CPU's features. XLA's CPU code is native
//! code for the compiling machine, so an entry written on an AVX-512 host is never loaded on an
//! AVX2 one. Entries hold that whole key and are compared byte for byte, so a hash collision can
//! only cost a miss; an unreadable or damaged entry is a miss too, never an error.
//!
//! Entries follow the workspace's one cache protocol ([`kda_core::cache_file`]): a miss takes
//! the entry's lock before compiling and looks again once it holds it, so of several processes
//! that need one program at once one compiles it and the others load its result. Size: after each write, entries least recently used are removed until the
//! folder holds at most `KDA_COMPILE_CACHE_MAX_MB` (default [`DEFAULT_MAX_MB`]).
//!
//! `KDA_COMPILE_STATS=FILE` appends one line per compile (`compile MS`) and per cache hit
//! (`hit MS`) to `FILE`, so a run of many processes can add up its compiles (`cargo xtask test`
//! does).

use std::fs::File;
use std::io::Write;

use kda_core::cache_file::{CacheFile, CacheLock};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

const MAGIC: &[u8; 8] = b"KDAEXE2\n";
const EXTENSION: &str = "kdaexe";

/// The size cap when `KDA_COMPILE_CACHE_MAX_MB` is not set: about 1,500 of the KDA programs.
pub const DEFAULT_MAX_MB: u64 = 4096;

/// The cache directory and what identifies the plugin build and the host.
#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
    plugin: String,
    host: String,
    max_bytes: u64,
    stats: Option<PathBuf>,
}

impl DiskCache {
    /// The cache named by `KDA_COMPILE_CACHE`, for the plugin at `plugin_path`.
    pub(crate) fn from_env(plugin_path: &Path, version: (i32, i32)) -> Option<Self> {
        let dir = std::env::var_os("KDA_COMPILE_CACHE").filter(|d| !d.is_empty())?;
        Some(Self::new(PathBuf::from(dir), plugin_path, version))
    }

    /// A cache in `dir` for the plugin at `plugin_path`.
    pub(crate) fn new(dir: PathBuf, plugin_path: &Path, version: (i32, i32)) -> Self {
        let meta = std::fs::metadata(plugin_path).ok();
        let len = meta.as_ref().map(|m| m.len()).unwrap_or(0);
        let modified = meta
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let plugin =
            format!("{} len={len} mtime={modified} api={}.{}", plugin_path.display(), version.0, version.1);
        let max_mb = std::env::var("KDA_COMPILE_CACHE_MAX_MB").ok().and_then(|v| v.parse::<u64>().ok());
        Self {
            dir,
            plugin,
            host: host_cpu(),
            max_bytes: max_mb.unwrap_or(DEFAULT_MAX_MB).saturating_mul(1 << 20),
            stats: std::env::var_os("KDA_COMPILE_STATS").filter(|v| !v.is_empty()).map(PathBuf::from),
        }
    }

    /// The same cache capped at `max_bytes` (see the module docs).
    #[cfg(test)]
    pub(crate) fn with_max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    fn header(&self, text: &str, options: &str) -> Vec<u8> {
        let mut h = Vec::with_capacity(text.len() + self.host.len() + 512);
        h.extend_from_slice(MAGIC);
        for part in [self.plugin.as_bytes(), self.host.as_bytes(), options.as_bytes(), text.as_bytes()] {
            h.extend_from_slice(&(part.len() as u64).to_le_bytes());
            h.extend_from_slice(part);
        }
        h
    }

    fn entry(&self, header: &[u8]) -> CacheFile {
        CacheFile::hashed(&self.dir, header, EXTENSION)
    }

    /// The serialized executable stored for this program, if any (a hit marks it used, so
    /// least recently used goes first when the folder is over its cap).
    pub(crate) fn load(&self, text: &str, options: &str) -> Option<Vec<u8>> {
        let header = self.header(text, options);
        self.entry(&header).read(&header)
    }

    /// Takes this program's entry lock, waiting while another process holds it.
    pub(crate) fn lock(&self, text: &str, options: &str) -> CacheLock {
        self.entry(&self.header(text, options)).lock()
    }

    /// Stores a serialized executable; failures (read-only disk, full disk) are only logged.
    pub(crate) fn store(&self, text: &str, options: &str, executable: &[u8]) {
        let header = self.header(text, options);
        let entry = self.entry(&header);
        if let Err(e) = entry.write(&header, executable) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "could not write the compile cache");
            return;
        }
        self.evict(&entry.path());
    }

    /// Removes the least recently used entries (never `keep`) until the folder fits its cap.
    fn evict(&self, keep: &Path) {
        let Ok(read) = std::fs::read_dir(&self.dir) else { return };
        let mut entries: Vec<(SystemTime, u64, PathBuf)> = read
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == EXTENSION))
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                Some((m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len(), e.path()))
            })
            .collect();
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        if total <= self.max_bytes {
            return;
        }
        entries.sort();
        for (_, len, path) in entries {
            if total <= self.max_bytes {
                break;
            }
            if path != keep && std::fs::remove_file(&path).is_ok() {
                total -= len;
            }
        }
    }

    /// Appends one event (`compile` or `hit`) to the `KDA_COMPILE_STATS` file, if one is set.
    pub(crate) fn record(&self, event: &str, took: Duration) {
        if let Some(path) = &self.stats {
            let line = format!("{event} {:.1}\n", took.as_secs_f64() * 1e3);
            // One short write on a file opened for appending: lines of processes never interleave.
            let _ = File::options()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| f.write_all(line.as_bytes()));
        }
    }
}

/// What the host CPU can run: the architecture and, on Linux, the feature flags the kernel
/// reports (`/proc/cpuinfo`), sorted; elsewhere the features the standard library detects.
pub fn host_cpu() -> String {
    let flags = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|info| {
        info.lines()
            .find(|l| l.starts_with("flags") || l.starts_with("Features"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, f)| {
                let mut v: Vec<&str> = f.split_whitespace().collect();
                v.sort_unstable();
                v.join(" ")
            })
    });
    let flags = flags.unwrap_or_else(detected_features);
    format!("{} {flags}", std::env::consts::ARCH)
}

#[cfg(target_arch = "x86_64")]
fn detected_features() -> String {
    let mut v = Vec::new();
    macro_rules! probe {
        ($($f:tt),*) => {$( if std::arch::is_x86_feature_detected!($f) { v.push($f); } )*};
    }
    probe!("sse4.2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq");
    probe!("avx512vnni", "avx512bf16", "avx512fp16");
    v.join(" ")
}

#[cfg(not(target_arch = "x86_64"))]
fn detected_features() -> String {
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-disk-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn cache(dir: &Path) -> DiskCache {
        DiskCache::new(dir.to_path_buf(), Path::new("/nonexistent/plugin.so"), (0, 115))
    }

    #[test]
    fn another_host_cpu_misses() {
        let dir = scratch("host");
        let here = cache(&dir);
        here.store("program", "opts", b"native code");
        assert_eq!(here.load("program", "opts").as_deref(), Some(&b"native code"[..]));
        let mut avx2 = here.clone();
        avx2.host = "x86_64 avx avx2 fma".to_string();
        assert_ne!(avx2.host, here.host);
        assert_eq!(avx2.load("program", "opts"), None);
        assert_eq!(here.load("program", "other opts"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn host_cpu_names_the_architecture_and_features() {
        let h = host_cpu();
        assert!(h.starts_with(std::env::consts::ARCH), "{h}");
        #[cfg(target_arch = "x86_64")]
        assert!(h.contains("sse2") || h.contains("sse4.2") || h.contains("avx"), "{h}");
    }

    #[test]
    fn least_recently_used_entries_go_past_the_cap() {
        let dir = scratch("cap");
        let c = cache(&dir).with_max_bytes(u64::MAX);
        let body = vec![7u8; 1000];
        for name in ["a", "b", "c"] {
            c.store(name, "", &body);
        }
        let old = SystemTime::now() - Duration::from_secs(3600);
        for e in std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()) {
            if e.path().extension().is_some_and(|x| x == EXTENSION) {
                File::options().write(true).open(e.path()).unwrap().set_modified(old).unwrap();
            }
        }
        assert!(c.load("a", "").is_some(), "a hit marks `a` used");
        let one = std::fs::metadata(c.entry(&c.header("a", "")).path()).unwrap().len();
        // Room for two entries: storing `d` removes the least recently used of b and c first.
        let small = c.clone().with_max_bytes(2 * one + one / 2);
        small.store("d", "", &body);
        assert!(small.load("a", "").is_some());
        assert!(small.load("d", "").is_some());
        assert_eq!(small.load("b", "").is_some() as u8 + small.load("c", "").is_some() as u8, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn stats_lines_name_each_compile_and_hit() {
        let dir = scratch("stats");
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = cache(&dir);
        c.stats = Some(dir.join("stats.log"));
        c.record("compile", Duration::from_millis(1500));
        c.record("hit", Duration::from_micros(2500));
        let lines = std::fs::read_to_string(dir.join("stats.log")).unwrap();
        assert_eq!(lines, "compile 1500.0\nhit 2.5\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
