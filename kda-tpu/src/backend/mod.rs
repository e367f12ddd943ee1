//! [`PjrtBackend`]: a handle on one PJRT device that many threads share, device-resident tensors
//! and the KDA programs on them, with `kda_core::Backend` as a thin host-tensor layer on top.
//!
//! Guarantees: every call blocks until its results exist on the device (downloads until they
//! are on the host). Calls from all clones of a handle run one at a time, in arrival order, on
//! the handle's worker thread; results are bitwise deterministic on one machine and plugin (the
//! same program on the same inputs gives the same bits, whichever thread called and whatever
//! ran before). A panic inside the plugin bindings becomes an error, and the handle then
//! refuses every later call (`TpuError::Poisoned`) instead of hanging.

mod call;
mod context_parallel;
mod data_parallel;
mod handle;
#[cfg(feature = "harness")]
pub mod harness;
mod io;
mod launch;
mod options;
mod residuals;
mod tensor;
mod worker;

pub use call::{CallCotangents, CallInputs};
pub use handle::PjrtBackend;
pub use io::{DeviceCotangents, DeviceGradients, DeviceInputs, DeviceOutputs, HostSide};
pub use options::{CompileCache, PjrtOptions, Split, IMPLEMENTATION_ENV};
pub use residuals::PjrtResiduals;
pub use tensor::{DeviceProgram, DeviceTensor, TransferStats};

/// Hooks for this crate's own tests of the handle's guarantees; not part of the API.
#[doc(hidden)]
pub mod testing {
    /// Panics inside the worker, to test what callers see (an error, then a poisoned handle).
    pub fn inject_worker_panic(backend: &super::PjrtBackend) -> kda_core::Result<()> {
        backend.inject_worker_panic()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    /// The modules of this directory and the sibling modules each one imports
    /// (`super::module::`), leaving out doc comments and unit tests; `mod.rs` only declares and
    /// re-exports, so it is not a node. Methods of `PjrtBackend` that other modules define are
    /// calls, not imports, and are not edges.
    fn imports() -> BTreeMap<String, Vec<String>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend");
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).expect("src/backend") {
            let path = entry.expect("entry").path();
            let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
            if name != "mod" && path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("source");
                let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default().to_string();
                files.insert(name, code);
            }
        }
        let names: Vec<String> = files.keys().cloned().collect();
        files
            .iter()
            .map(|(name, code)| {
                let code: String =
                    code.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
                let deps = names
                    .iter()
                    .filter(|m| *m != name && code.contains(&format!("super::{m}::")))
                    .cloned()
                    .collect();
                (name.clone(), deps)
            })
            .collect()
    }

    /// A module on a cycle of imports, with the cycle, if there is one.
    fn cycle(graph: &BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
        fn visit(
            m: &str,
            graph: &BTreeMap<String, Vec<String>>,
            path: &mut Vec<String>,
            done: &mut Vec<String>,
        ) -> Option<Vec<String>> {
            if let Some(i) = path.iter().position(|p| p == m) {
                let mut c = path[i..].to_vec();
                c.push(m.to_string());
                return Some(c);
            }
            if done.iter().any(|d| d == m) {
                return None;
            }
            path.push(m.to_string());
            for d in graph.get(m).into_iter().flatten() {
                if let Some(c) = visit(d, graph, path, done) {
                    return Some(c);
                }
            }
            path.pop();
            done.push(m.to_string());
            None
        }
        let mut done = Vec::new();
        graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
    }

    #[test]
    fn backend_modules_import_in_layers() {
        let graph = imports();
        assert!(graph.len() >= 10, "found the backend's modules: {:?}", graph.keys());
        assert!(graph["call"].contains(&"launch".to_string()), "the scan sees imports: {graph:?}");
        assert_eq!(cycle(&graph), None, "an import cycle inside kda-tpu/src/backend");
    }

    #[test]
    fn a_cycle_is_found() {
        let g: BTreeMap<String, Vec<String>> = [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"])]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
            .collect();
        assert_eq!(cycle(&g), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    }
}
