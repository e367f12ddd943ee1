//! The f64 reference results of a case, computed once per test run and shared.
//!
//! [`forward_and_vjp`] keys a result by the case's label (name and dtypes) and a hash of every
//! input and cotangent, so two different inputs can never share an entry. Within a process the
//! results are memoized; across the processes of one run (cargo-nextest runs each test in its
//! own) they are shared through the folder named by `KDA_REFERENCE_CACHE`, one entry per key in
//! the workspace's one cache protocol ([`kda_core::cache_file`]), so whichever process asks first
//! computes it and the others wait and read it.
//! `cargo xtask test` points that variable at a folder it empties at the start of every run: a
//! result never outlives the run, so a change to `kda-ref` never meets a stale oracle. Without the
//! variable each process computes its own results. A damaged or unreadable entry is recomputed.

use crate::inputs::{widen, CaseData};
use kda_core::cache_file::CacheFile;
use kda_core::{HostTensor, KdaGradients, KdaOutputs, TensorData};
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

/// The reference's outputs and gradients on one case's inputs.
pub type Reference = Arc<(KdaOutputs, KdaGradients)>;

const MAGIC: &[u8; 8] = b"KDAREF1\n";

/// The environment variable naming the per-run folder of shared reference results.
pub const CACHE_ENV: &str = "KDA_REFERENCE_CACHE";

/// `kda_ref::forward_and_vjp` on `data` widened to f64, computed once per run for this `label`
/// (the case name and dtypes, for the file name and messages) and these exact inputs.
pub fn forward_and_vjp(label: &str, data: &CaseData) -> Result<Reference, String> {
    static MEMO: OnceLock<Mutex<HashMap<String, Reference>>> = OnceLock::new();
    let key = format!("{}-{:016x}", file_stem(label), inputs_hash(data));
    let memo = MEMO.get_or_init(Default::default);
    // One computation per key in this process: the lock is held while computing, which also
    // serializes tests that run on threads of one process (plain `cargo test`).
    let mut map = memo.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(hit) = map.get(&key) {
        return Ok(Arc::clone(hit));
    }
    let result = match std::env::var_os(CACHE_ENV).filter(|d| !d.is_empty()) {
        Some(dir) => shared(Path::new(&dir), &key, data)?,
        None => compute(data)?,
    };
    let result = Arc::new(result);
    map.insert(key, Arc::clone(&result));
    Ok(result)
}

fn compute(data: &CaseData) -> Result<(KdaOutputs, KdaGradients), String> {
    let wide = widen(data).map_err(|e| format!("widen: {e}"))?;
    kda_ref::forward_and_vjp(&wide.inputs, &wide.cotangents).map_err(|e| format!("reference: {e}"))
}

/// Reads the entry `key` in `dir`, or computes and writes it, holding the entry's lock.
fn shared(dir: &Path, key: &str, data: &CaseData) -> Result<(KdaOutputs, KdaGradients), String> {
    let entry = CacheFile::new(dir, key, "ref");
    let header = [MAGIC.as_slice(), key.as_bytes()].concat();
    let _lock = entry.lock();
    if let Some(hit) = entry.read(&header).and_then(|b| decode(&b)) {
        return Ok(hit);
    }
    let result = compute(data)?;
    // An entry that cannot be written (read-only or full disk) only costs the next process time.
    let _ = entry.write(&header, &encode(&result));
    Ok(result)
}

/// The label as a file name: letters, digits, `_` and `-` kept, anything else `_`.
fn file_stem(label: &str) -> String {
    label.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
}

/// A hash of every tensor's dtype, shape and bytes, and of the gate, segments and options.
fn inputs_hash(data: &CaseData) -> u64 {
    let mut h = DefaultHasher::new();
    let mut tensor = |t: Option<&HostTensor>| match t {
        Some(t) => {
            (t.dtype().size_bytes(), format!("{}", t.dtype()), t.shape()).hash(&mut h);
            t.as_bytes().hash(&mut h);
        }
        None => 0u8.hash(&mut h),
    };
    let (x, c) = (&data.inputs, &data.cotangents);
    for t in [&x.q, &x.k, &x.v, &x.g, &x.beta, &c.d_o] {
        tensor(Some(t));
    }
    tensor(x.initial_state.as_ref());
    tensor(c.dht.as_ref());
    // The gate (with its small parameter tensors), the segments and the options in full.
    format!("{:?} {:?} {:?}", x.gate, x.segments, x.config).hash(&mut h);
    h.finish()
}

fn named(r: &(KdaOutputs, KdaGradients)) -> Vec<(&'static str, &HostTensor)> {
    let mut out = vec![("o", &r.0.o)];
    if let Some(t) = &r.0.final_state {
        out.push(("final_state", t));
    }
    out.extend(r.1.named());
    out
}

fn encode(r: &(KdaOutputs, KdaGradients)) -> Vec<u8> {
    let mut b = Vec::new();
    let tensors = named(r);
    b.extend((tensors.len() as u64).to_le_bytes());
    for (name, t) in tensors {
        let code: u8 = match t.data() {
            TensorData::F64(_) => 0,
            TensorData::F32(_) => 1,
            TensorData::BF16(_) => 2,
        };
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.push(code);
        b.extend((t.shape().len() as u64).to_le_bytes());
        for &d in t.shape() {
            b.extend((d as u64).to_le_bytes());
        }
        b.extend((t.as_bytes().len() as u64).to_le_bytes());
        b.extend(t.as_bytes());
    }
    b
}

/// Reads [`encode`]'s bytes; `None` on anything malformed.
fn decode(bytes: &[u8]) -> Option<(KdaOutputs, KdaGradients)> {
    let mut r = bytes;
    let u64_ = |r: &mut &[u8]| -> Option<usize> {
        let mut w = [0u8; 8];
        r.read_exact(&mut w).ok()?;
        usize::try_from(u64::from_le_bytes(w)).ok()
    };
    let count = u64_(&mut r)?;
    let mut map: HashMap<String, HostTensor> = HashMap::new();
    for _ in 0..count {
        let n = u64_(&mut r)?;
        let name = String::from_utf8(r.get(..n)?.to_vec()).ok()?;
        r = &r[n..];
        let code = *r.first()?;
        r = &r[1..];
        let rank = u64_(&mut r)?;
        let shape = (0..rank).map(|_| u64_(&mut r)).collect::<Option<Vec<_>>>()?;
        let n = u64_(&mut r)?;
        let raw = r.get(..n)?;
        r = &r[n..];
        let data = match code {
            0 => TensorData::F64(pod_vec(raw)?),
            1 => TensorData::F32(pod_vec(raw)?),
            2 => TensorData::BF16(pod_vec(raw)?),
            _ => return None,
        };
        map.insert(name, HostTensor::new(&shape, data).ok()?);
    }
    if !r.is_empty() {
        return None;
    }
    let outputs = KdaOutputs { o: map.remove("o")?, final_state: map.remove("final_state") };
    let grads = KdaGradients {
        dq: map.remove("dq")?,
        dk: map.remove("dk")?,
        dv: map.remove("dv")?,
        dg: map.remove("dg")?,
        dbeta: map.remove("dbeta")?,
        dh0: map.remove("dh0"),
        da_log: map.remove("da_log"),
        ddt_bias: map.remove("ddt_bias"),
    };
    map.is_empty().then_some((outputs, grads))
}

/// Elements of a plain type from the (unaligned) bytes [`HostTensor::as_bytes`] wrote, in this
/// machine's byte order (entries never leave the machine: they live for one run).
fn pod_vec<T: bytemuck::Pod>(raw: &[u8]) -> Option<Vec<T>> {
    let size = std::mem::size_of::<T>();
    raw.len().is_multiple_of(size).then(|| raw.chunks_exact(size).map(bytemuck::pod_read_unaligned).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cases::case;
    use crate::inputs::case_data;
    use kda_core::DType;

    #[test]
    fn entries_round_trip_bit_for_bit() {
        let data = case_data(&case("gate_softplus").expect("case"), DType::F32).expect("inputs");
        let r = compute(&data).expect("reference");
        let back = decode(&encode(&r)).expect("decodes");
        assert_eq!(back.0, r.0);
        assert_eq!(back.1, r.1);
    }

    #[test]
    fn damaged_entries_are_misses() {
        let data = case_data(&case("fixed_small").expect("case"), DType::BF16).expect("inputs");
        let bytes = encode(&compute(&data).expect("reference"));
        assert!(decode(&bytes[..bytes.len() - 1]).is_none(), "truncated");
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_none(), "trailing bytes");
        assert!(decode(&bytes[1..]).is_none(), "shifted by a byte");
    }

    #[test]
    fn other_inputs_give_other_keys() {
        let c = case("fixed_small").expect("case");
        let a = case_data(&c, DType::F32).expect("inputs");
        let mut b = a.clone();
        if let kda_core::ElementsMut::F32(x) = b.inputs.g.elements_mut() {
            x[0] += 1e-3;
        }
        assert_ne!(inputs_hash(&a), inputs_hash(&b));
        assert_eq!(inputs_hash(&a), inputs_hash(&a.clone()));
    }

    #[test]
    fn a_shared_entry_is_computed_once_and_read_back() {
        let dir = std::env::temp_dir().join(format!("kda-ref-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let data = case_data(&case("no_states").expect("case"), DType::F32).expect("inputs");
        let first = shared(&dir, "no_states-f32", &data).expect("computed");
        let entry = dir.join("no_states-f32.ref");
        let written = std::fs::read(&entry).expect("entry written");
        // A planted entry is what a later reader gets: the file, not a recomputation, answers.
        let mut planted = first.clone();
        planted.0.o = planted.0.o.cast(DType::F32).and_then(|o| o.cast(DType::F64)).expect("float cast");
        let header = [MAGIC.as_slice(), b"no_states-f32"].concat();
        CacheFile::new(&dir, "no_states-f32", "ref").write(&header, &encode(&planted)).expect("plant");
        let second = shared(&dir, "no_states-f32", &data).expect("read");
        assert_eq!(second.0.o, planted.0.o);
        std::fs::write(&entry, &written[..10]).expect("damage");
        let third = shared(&dir, "no_states-f32", &data).expect("recomputed");
        assert_eq!(third.0.o, first.0.o);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
