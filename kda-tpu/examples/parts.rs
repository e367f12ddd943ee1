//! Times each kernel building block alone at the primary shape (N = 128 chunks, K = 128), for
//! profiling the programs piece by piece: `cargo run --release -p kda-tpu --features harness --example parts [NAME..]`
//! (after `eval "$(cargo xtask env)"`). The `products*` parts are the forward's products alone
//! (no elementwise work), with their FLOP rate: the floor the plugin's matmul library sets.
fn cpu_ms() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) * 10.0
}
fn main() {
    let rt = kda_tpu::Runtime::new().unwrap();
    let (n, k) = (128i64, 128i64);
    let mk = |d: &[i64], lo: f32, hi: f32| {
        let len: i64 = d.iter().product();
        let x: Vec<f32> = (0..len).map(|i| lo + (hi - lo) * (((i * 7919) % 1000) as f32 / 1000.0)).collect();
        rt.upload_f32(&x, d).unwrap()
    };
    let bufs = [
        mk(&[n, 64, k], -0.1, 0.1),
        mk(&[n, 64, k], -0.1, 0.1),
        mk(&[n, 64, k], -1.0, 1.0),
        mk(&[n, 64, k], -1.0, 0.0),
        mk(&[n, 64, 1], 0.0, 1.0),
        mk(&[n, 64, 64], -0.01, 0.01),
    ];
    let refs: Vec<_> = bufs.iter().collect();
    let names: Vec<String> = std::env::args().skip(1).collect();
    for name in kda_tpu::op::parts::NAMES {
        if !names.is_empty() && !names.iter().any(|x| x == name) {
            continue;
        }
        let exe = rt.compile(&kda_tpu::op::parts::program(name, n, k).unwrap()).unwrap();
        let _ = rt.execute(&exe, &refs).unwrap();
        let iters: usize = std::env::var("KDA_PARTS_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
        let c0 = cpu_ms();
        let t = std::time::Instant::now();
        for _ in 0..iters {
            let _ = rt.execute(&exe, &refs).unwrap();
        }
        let wall = t.elapsed().as_secs_f64() * 1000.0 / iters as f64;
        let rate = match kda_tpu::op::parts::product_flops(name, n, k) {
            Some(f) => format!("  {:.0} MFLOP, {:.0} GFLOP/s", f / 1e6, f / wall / 1e6),
            None if *name == "stream" => {
                let written = 4.0 * (n * 64 * k * 4) as f64;
                format!("  {:.1} MB written, {:.1} GB/s written", written / 1e6, written / wall / 1e6)
            }
            None => String::new(),
        };
        println!("{name:>14}: wall {wall:.1} ms  cpu {:.1} ms per run{rate}", (cpu_ms() - c0) / iters as f64);
    }
}
