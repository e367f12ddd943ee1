//! The one on-disk protocol of the workspace's caches (compiled executables in `kda-tpu`,
//! reference results in `kda-testkit`). An entry is the file `DIR/STEM.EXT`: the caller's whole
//! key (its header, compared byte for byte, so a hash collision in the name can only cost a
//! miss), the body's length and hash, then the body. A writer holds `DIR/locks/STEM.lock`, so
//! of several processes that need one entry one computes it and the others read it; it writes
//! a temporary file and renames it into place, so no reader sees half an entry. An unreadable,
//! truncated or damaged entry is a miss, never an error.

use std::collections::hash_map::DefaultHasher;
use std::fs::File;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// One cache entry: its folder, file stem and extension.
#[derive(Debug, Clone)]
pub struct CacheFile {
    dir: PathBuf,
    stem: String,
    ext: String,
}

/// A held entry lock, released when dropped; holds nothing when the folder is read-only (the
/// caller then computes on its own, which costs time but never correctness).
#[derive(Debug)]
pub struct CacheLock(#[allow(dead_code)] Option<File>);

impl CacheFile {
    /// The entry `dir/stem.ext`; `stem` must be a plain file name.
    pub fn new(dir: &Path, stem: impl Into<String>, ext: &str) -> Self {
        Self { dir: dir.to_path_buf(), stem: stem.into(), ext: ext.to_string() }
    }

    /// The entry of a key with no readable name: its stem is the header's hash and length.
    pub fn hashed(dir: &Path, header: &[u8], ext: &str) -> Self {
        let mut h = DefaultHasher::new();
        header.hash(&mut h);
        Self::new(dir, format!("{:016x}-{}", h.finish(), header.len()), ext)
    }

    /// The entry's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(format!("{}.{}", self.stem, self.ext))
    }

    /// Takes the entry's lock, waiting while another process holds it.
    pub fn lock(&self) -> CacheLock {
        let locks = self.dir.join("locks");
        let file = std::fs::create_dir_all(&locks)
            .and_then(|()| {
                File::options()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(locks.join(format!("{}.lock", self.stem)))
            })
            .ok();
        if let Some(f) = &file {
            // A lock the file system refuses leaves the entry unguarded, as a read-only folder does.
            let _ = f.lock();
        }
        CacheLock(file)
    }

    /// The body stored under `header`, if the entry holds exactly that header and an intact
    /// body; a hit marks the entry used (its modification time), for least-recently-used
    /// eviction.
    pub fn read(&self, header: &[u8]) -> Option<Vec<u8>> {
        let path = self.path();
        let bytes = std::fs::read(&path).ok()?;
        let rest = bytes.strip_prefix(header)?;
        if rest.len() < 16 {
            return None;
        }
        let (sum, body) = rest.split_at(16);
        if sum != checksum(body) {
            return None;
        }
        let _ = File::options().write(true).open(&path).and_then(|f| f.set_modified(SystemTime::now()));
        Some(body.to_vec())
    }

    /// Stores `body` under `header` (temporary file, then rename).
    pub fn write(&self, header: &[u8], body: &[u8]) -> std::io::Result<()> {
        let path = self.path();
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(&self.dir)?;
            let mut data = Vec::with_capacity(header.len() + 16 + body.len());
            data.extend_from_slice(header);
            data.extend_from_slice(&checksum(body));
            data.extend_from_slice(body);
            std::fs::write(&tmp, &data)?;
            std::fs::rename(&tmp, &path)
        };
        write().inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }
}

/// Length and hash of a body, so a truncated or damaged entry is a miss.
fn checksum(bytes: &[u8]) -> [u8; 16] {
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    out[8..].copy_from_slice(&hasher.finish().to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::CacheFile;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-cache-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn an_entry_reads_back_under_its_header_only() {
        let dir = scratch("header");
        let e = CacheFile::hashed(&dir, b"key one", "bin");
        let _lock = e.lock();
        e.write(b"key one", b"body").expect("write");
        assert_eq!(e.read(b"key one").as_deref(), Some(&b"body"[..]));
        assert_eq!(e.read(b"key two"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn damaged_and_truncated_entries_are_misses() {
        let dir = scratch("damaged");
        let e = CacheFile::new(&dir, "entry", "bin");
        e.write(b"h", b"a body of some length").expect("write");
        let mut bytes = std::fs::read(e.path()).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(e.path(), &bytes).expect("damage");
        assert_eq!(e.read(b"h"), None);
        std::fs::write(e.path(), &bytes[..10]).expect("truncate");
        assert_eq!(e.read(b"h"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
