//! Scratch timing (to be replaced by `cargo xtask bench`).
use kda_core::{Backend, BackwardStrategy, DType};
use std::time::Instant;
fn main() {
    let be = kda_tpu::PjrtBackend::new().unwrap();
    for (name, dtype) in [("bench_primary", DType::F32), ("bench_primary_packed", DType::F32)] {
        let case = kda_testkit::benchmark_cases().into_iter().find(|c| c.name == name).unwrap();
        let data = kda_testkit::case_data(&case, dtype).unwrap();
        let t = Instant::now();
        let _ = be.forward(&data.inputs, BackwardStrategy::Rematerialize).unwrap();
        println!("{name} first forward (compile) {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
        let mut v = vec![];
        for _ in 0..10 { let t = Instant::now(); let _ = be.forward(&data.inputs, BackwardStrategy::Rematerialize).unwrap(); v.push(t.elapsed().as_secs_f64() * 1e3); }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{name} forward median {:.1} ms min {:.1}", v[5], v[0]);
        let t = Instant::now();
        let _ = be.forward_and_vjp(&data.inputs, &data.cotangents, BackwardStrategy::SavedState).unwrap();
        println!("{name} first fused (compile) {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
        let mut v = vec![];
        for _ in 0..10 { let t = Instant::now(); let _ = be.forward_and_vjp(&data.inputs, &data.cotangents, BackwardStrategy::SavedState).unwrap(); v.push(t.elapsed().as_secs_f64() * 1e3); }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{name} fused median {:.1} ms min {:.1}", v[5], v[0]);
    }
}
