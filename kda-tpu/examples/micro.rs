use kda_tpu::hlo::{ElemType, FnBuilder, Module, TensorType};
use std::time::Instant;
fn time(rt: &kda_tpu::Runtime, name: &str, text: &str, shapes: &[Vec<i64>]) {
    let exe = rt.compile(text).unwrap();
    let bufs: Vec<_> = shapes.iter().map(|s| { let n: i64 = s.iter().product(); let d: Vec<f32> = (0..n).map(|i| ((i % 97) as f32) * 0.001 - 0.05).collect(); rt.upload_f32(&d, s).unwrap() }).collect();
    let refs: Vec<_> = bufs.iter().collect();
    let _ = rt.execute(&exe, &refs).unwrap();
    let mut v = vec![];
    for _ in 0..7 { let t = Instant::now(); let _ = rt.execute(&exe, &refs).unwrap(); v.push(t.elapsed().as_secs_f64() * 1e3); }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("{name}: median {:.2} ms min {:.2}", v[3], v[0]);
}
fn main() {
    let rt = kda_tpu::Runtime::new().unwrap();
    let f = |d: &[i64]| TensorType::new(ElemType::F32, d);
    // triangular solve
    let mut b = FnBuilder::new("main", true);
    let a = b.arg(f(&[128, 64, 64])).unwrap(); let r = b.arg(f(&[128, 64, 256])).unwrap();
    let x = b.triangular_solve(a, r, true, true, true, false).unwrap(); b.ret(&[x]).unwrap();
    let mut m = Module::new(); m.add(b).unwrap();
    time(&rt, "trisolve 128x64x64 rhs 256", &m.to_text(), &[vec![128, 64, 64], vec![128, 64, 256]]);
    // batch matmul 64x64x256
    let mut b = FnBuilder::new("main", true);
    let a = b.arg(f(&[128, 64, 64])).unwrap(); let r = b.arg(f(&[128, 64, 256])).unwrap();
    let x = b.batch_matmul(a, r, false, false).unwrap(); b.ret(&[x]).unwrap();
    let mut m = Module::new(); m.add(b).unwrap();
    time(&rt, "bmm 128x64x64 @ 64x256", &m.to_text(), &[vec![128, 64, 64], vec![128, 64, 256]]);
    // 5D elementwise exp + reduce
    let mut b = FnBuilder::new("main", true);
    let g = b.arg(f(&[128, 4, 16, 128])).unwrap(); let q = b.arg(f(&[128, 4, 16, 128])).unwrap();
    let d5 = [128, 4, 16, 16, 128];
    let gt = b.broadcast_in_dim(g, &d5, &[0, 1, 2, 4]).unwrap(); let gj = b.broadcast_in_dim(g, &d5, &[0, 1, 3, 4]).unwrap();
    let diff = b.sub(gt, gj).unwrap(); let e = b.exp(diff).unwrap();
    let qt = b.broadcast_in_dim(q, &d5, &[0, 1, 2, 4]).unwrap(); let kj = b.broadcast_in_dim(q, &d5, &[0, 1, 3, 4]).unwrap();
    let p = b.mul(qt, kj).unwrap(); let p = b.mul(p, e).unwrap(); let s = b.reduce_sum(p, &[4]).unwrap();
    b.ret(&[s]).unwrap(); let mut m = Module::new(); m.add(b).unwrap();
    time(&rt, "diag gram 5D exp+reduce", &m.to_text(), &[vec![128, 4, 16, 128], vec![128, 4, 16, 128]]);
    // exp only on 16.8M
    let mut b = FnBuilder::new("main", true);
    let g = b.arg(f(&[128, 4, 16, 16, 128])).unwrap(); let e = b.exp(g).unwrap(); let s = b.reduce_sum(e, &[4]).unwrap(); b.ret(&[s]).unwrap();
    let mut m = Module::new(); m.add(b).unwrap();
    time(&rt, "exp+reduce 16.8M", &m.to_text(), &[vec![128, 4, 16, 16, 128]]);
}
