use kda_core::{BackwardStrategy, DType};
use kda_tpu::ProgramKind;
use std::time::Instant;
fn cpu_ms() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) * 10.0
}
fn main() {
    let be = kda_tpu::PjrtBackend::new().unwrap();
    let case = kda_testkit::benchmark_cases().into_iter().next().unwrap();
    let data = kda_testkit::case_data(&case, DType::F32).unwrap();
    let call = be.upload_call(&data.inputs, Some(&data.cotangents)).unwrap();
    let kinds: Vec<ProgramKind> = if std::env::var("KDA_ONLY_FWD").is_ok() { vec![ProgramKind::Forward(false)] } else { vec![ProgramKind::Forward(false), ProgramKind::Fused(BackwardStrategy::SavedState)] };
    for kind in kinds {
        let _ = be.run_program(&call, kind, None).unwrap();
        let mut v = vec![];
        let c0 = cpu_ms();
        for _ in 0..9 { let t = Instant::now(); let _ = be.run_program(&call, kind, None).unwrap(); v.push(t.elapsed().as_secs_f64() * 1e3); }
        let cpu = (cpu_ms() - c0) / 9.0;
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{kind:?} median {:.1} ms min {:.1}  cpu/run {:.1} ms", v[4], v[0], cpu);
    }
}
