//! A crate outside this workspace builds against `kda-tpu` and runs a KDA call, the way the
//! README says: path dependencies, the header variable from `cargo xtask env`, the plugin from
//! `KDA_HOME`. It builds the whole dependency tree in its own target folder (minutes), so it
//! sits in the `--full` tier.

use std::path::{Path, PathBuf};
use std::process::Command;

const MAIN_RS: &str = r#"
use kda_core::{Backend, BackwardStrategy, Cotangents, HostTensor, KdaInputs};

fn main() -> Result<(), kda_core::KdaError> {
    let x = |d: &[usize], v: f32| HostTensor::from_f32(d, vec![v; d.iter().product()]);
    let inputs = KdaInputs::new(x(&[1, 40, 2, 8], 0.1)?, x(&[1, 40, 2, 8], 0.2)?, x(&[1, 40, 2, 8], 0.3)?, x(&[1, 40, 2, 8], -0.1)?, x(&[1, 40, 2], 0.5)?);
    let cot = Cotangents { d_o: x(&[1, 40, 2, 8], 1.0)?, dht: None };
    let backend = kda_tpu::PjrtBackend::new()?;
    let (_, grads) = backend.forward_and_vjp(&inputs, &cot, BackwardStrategy::SavedState)?;
    let (_, want) = kda_ref::forward_and_vjp(&inputs, &cot)?;
    let err = grads.dq.to_f64_vec().iter().zip(want.dq.to_f64_vec()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(err < 1e-4, "dq differs by {err}");
    println!("external crate: OK on {}", backend.name());
    Ok(())
}
"#;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().expect("workspace root")
}

mod full {
    use super::*;

    #[test]
    fn external_crate_builds_against_kda_tpu_and_runs() {
        let root = workspace();
        let dir = root.join("target/external-crate");
        std::fs::create_dir_all(dir.join("src")).expect("crate folder");
        let path = |c: &str| root.join(c).display().to_string();
        let manifest = format!(
            "[package]\nname = \"kda-user\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\n\
             kda-core = {{ path = {:?} }}\nkda-ref = {{ path = {:?} }}\nkda-tpu = {{ path = {:?} }}\n\n[workspace]\n",
            path("kda-core"),
            path("kda-ref"),
            path("kda-tpu")
        );
        std::fs::write(dir.join("Cargo.toml"), manifest).expect("Cargo.toml");
        std::fs::write(dir.join("src/main.rs"), MAIN_RS).expect("main.rs");
        // The workspace's lock file keeps the same dependency versions (and works offline).
        std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).expect("Cargo.lock");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .current_dir(&dir)
            .args(["run", "--release", "--offline", "--quiet"])
            .env("CARGO_TARGET_DIR", dir.join("target"))
            .output()
            .expect("cargo runs");
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "the external crate failed:\n{text}");
        assert!(text.contains("external crate: OK"), "{text}");
    }
}
