//! An optional on-disk cache of compiled executables, shared between processes.
//!
//! Set `KDA_COMPILE_CACHE=DIR` and every compile first looks in `DIR` for the same program text,
//! compile options and plugin file; a hit deserializes the executable (milliseconds) instead of
//! compiling it (about a second for the KDA programs on the CPU plugin). `cargo xtask test` sets
//! it to `target/kda-compile-cache`, so the many test processes that need one program compile it
//! once. Entries hold the full program text and are compared byte for byte, so a hash collision
//! can only cost a miss; an unreadable or stale entry is a miss too, never an error. Writes go to
//! a temporary file renamed into place, so concurrent processes never read half an entry.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"KDAEXE1\n";

/// The cache directory and what identifies the plugin build.
#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
    plugin: String,
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
        Self { dir, plugin }
    }

    fn header(&self, text: &str, options: &str) -> Vec<u8> {
        let mut h = Vec::with_capacity(text.len() + 256);
        h.extend_from_slice(MAGIC);
        for part in [self.plugin.as_bytes(), options.as_bytes(), text.as_bytes()] {
            h.extend_from_slice(&(part.len() as u64).to_le_bytes());
            h.extend_from_slice(part);
        }
        h
    }

    fn path(&self, header: &[u8]) -> PathBuf {
        let mut hasher = DefaultHasher::new();
        header.hash(&mut hasher);
        self.dir.join(format!("{:016x}-{}.kdaexe", hasher.finish(), header.len()))
    }

    /// The serialized executable stored for this program, if any.
    pub(crate) fn load(&self, text: &str, options: &str) -> Option<Vec<u8>> {
        let header = self.header(text, options);
        let bytes = std::fs::read(self.path(&header)).ok()?;
        if bytes.len() < header.len() + 16 || bytes[..header.len()] != header[..] {
            return None;
        }
        let (sum, body) = bytes[header.len()..].split_at(16);
        (sum == checksum(body)).then(|| body.to_vec())
    }

    /// Stores a serialized executable; failures (read-only disk, full disk) are only logged.
    pub(crate) fn store(&self, text: &str, options: &str, executable: &[u8]) {
        let header = self.header(text, options);
        let path = self.path(&header);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(&self.dir)?;
            let mut data = header;
            data.extend_from_slice(&checksum(executable));
            data.extend_from_slice(executable);
            std::fs::write(&tmp, &data)?;
            std::fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(dir = %self.dir.display(), error = %e, "could not write the compile cache");
        }
    }
}

/// Length and hash of a serialized executable, so a truncated or damaged entry is a miss.
fn checksum(bytes: &[u8]) -> [u8; 16] {
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    out[8..].copy_from_slice(&hasher.finish().to_le_bytes());
    out
}
