//! A KDA layer as ONE compiled program: the q, k, v projections of `x`, the KDA forward+VJP
//! (a private function of the program, emitted by `op::compose::add_function`), a loss
//! `L = sum(o * C)` and the projection weights' gradient `dW = x^T [dq | dk | dv]`, all in one
//! `@main`. The result is checked against the f64 reference composition on the host.
//!
//! Run with `eval "$(cargo xtask env)" && cargo run --release -p kda-tpu --example kda_layer`.

use kda_core::{BackwardStrategy, Cotangents, DType, HostTensor, KdaConfig, KdaInputs, Layout};
use kda_testkit::{agreement, Rng};
use kda_tpu::hlo::{FnBuilder, Module, Precision, TensorType};
use kda_tpu::op::compose::{add_function, KdaFunction};
use kda_tpu::op::interface::index_tables;
use kda_tpu::{DeviceTensor, PjrtBackend, ProgramKind, ProgramSpec};

/// Heads, tokens, model width, key and value width.
const H: usize = 2;
const T: usize = 128;
const DM: usize = 32;
const K: usize = 16;
const HK: usize = H * K;

type Error = Box<dyn std::error::Error>;

/// The spec of the KDA call inside the layer: one batch-first row `[1, T, H, K]`, f32,
/// pre-activated gate, in-kernel q/k L2 norm (so the projections need no normalisation).
fn kda_inputs(q: HostTensor, k: HostTensor, v: HostTensor, g: HostTensor, beta: HostTensor) -> KdaInputs {
    KdaInputs::new(q, k, v, g, beta).with_config(KdaConfig {
        layout: Layout::BatchFirst,
        use_qk_l2norm: true,
        ..KdaConfig::default()
    })
}

/// The layer program: arguments `x [T, DM]`, `W [DM, 3HK]`, `g [1, T, H, K]`, `beta [1, T, H]`,
/// `C [1, T, H, K]`, then the KDA index tables; results `L` (scalar) and `dW [DM, 3HK]`.
fn layer_program(spec: &ProgramSpec) -> Result<(String, Vec<&'static str>, KdaFunction), Error> {
    let f32t = |d: &[usize]| TensorType::new(DType::F32, &d.iter().map(|&x| x as i64).collect::<Vec<_>>());
    let mut module = Module::named("kda_layer")?;
    let kind = ProgramKind::Fused(BackwardStrategy::SavedState);
    let kda = add_function(&mut module, "kda_fused", spec, kind)?;
    let sig = &kda.signature;

    let mut b = FnBuilder::new("main", true);
    b.set_dot_precision(Precision::Highest);
    let x = b.arg(f32t(&[T, DM]))?;
    let w = b.arg(f32t(&[DM, 3 * HK]))?;
    let g = b.arg(f32t(&[1, T, H, K]))?;
    let beta = b.arg(f32t(&[1, T, H]))?;
    let c = b.arg(f32t(&[1, T, H, K]))?;
    // The index tables pass through from the layer's own arguments.
    let first_table = sig.arg_index("chunk_first").ok_or("no chunk_first")?;
    let tables: Vec<_> = sig.args[first_table..]
        .iter()
        .take_while(|p| p.ty.elem == DType::I32)
        .map(|p| Ok((p.name, b.arg(p.ty.clone())?)))
        .collect::<Result<_, kda_tpu::TpuError>>()?;

    // q, k, v = split(x W), each [1, T, H, K].
    let p = b.dot_general(x, w, &[], &[], &[1], &[0], DType::F32)?; // [T, 3HK]
    let mut qkv = Vec::new();
    for i in 0..3 {
        let part = b.slice_axis(p, 1, (i * HK) as i64, ((i + 1) * HK) as i64)?;
        qkv.push(b.reshape(part, &[1, T as i64, H as i64, K as i64])?);
    }
    // The KDA forward+VJP with do = C, its arguments in signature order.
    let mut args = Vec::new();
    for port in &sig.args {
        let v = match port.name {
            "q" => qkv[0],
            "k" => qkv[1],
            "v" => qkv[2],
            "g" => g,
            "beta" => beta,
            "do" => c,
            name => tables.iter().find(|(n, _)| *n == name).map(|&(_, v)| v).ok_or(name)?,
        };
        args.push(v);
    }
    let outs = b.call("kda_fused", &args, &sig.result_types())?;
    let at = |name: &str| sig.result_index(name).map(|i| outs[i]).ok_or(format!("no result {name}"));
    // L = sum(o * C); o comes back flat [T*H, K] (the row-major elements of [1, T, H, K]).
    let o = at("o")?;
    let c_flat = b.reshape(c, &[(T * H) as i64, K as i64])?;
    let oc = b.mul(o, c_flat)?;
    let loss = b.reduce_sum(oc, &[0, 1])?;
    // dW = x^T [dq | dk | dv].
    let mut dp = Vec::new();
    for name in ["dq", "dk", "dv"] {
        let d = at(name)?;
        dp.push(b.reshape(d, &[T as i64, HK as i64])?);
    }
    let dp = b.concatenate(&dp, 1)?; // [T, 3HK]
    let dw = b.dot_general(x, dp, &[], &[], &[0], &[0], DType::F32)?; // [DM, 3HK]
    b.ret(&[loss, dw])?;
    module.add(b)?;
    Ok((module.to_text(), tables.iter().map(|(n, _)| *n).collect(), kda))
}

/// `a [m, n] x b [n, p]` in f64.
fn matmul(a: &[f64], b: &[f64], m: usize, n: usize, p: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * p];
    for i in 0..m {
        for l in 0..n {
            let x = a[i * n + l];
            for j in 0..p {
                out[i * p + j] += x * b[l * p + j];
            }
        }
    }
    out
}

/// `a^T` of `a [m, n]`.
fn transpose(a: &[f64], m: usize, n: usize) -> Vec<f64> {
    (0..n * m).map(|i| a[(i % m) * n + i / m]).collect()
}

fn main() -> Result<(), Error> {
    let mut rng = Rng::new(11);
    // Host data as f32 values (held in f64 for the reference).
    let as_f32 = |v: Vec<f64>| -> Vec<f64> { v.into_iter().map(|x| f64::from(x as f32)).collect() };
    let x = as_f32(rng.normal_vec(T * DM));
    let w: Vec<f64> = as_f32(rng.normal_vec(DM * 3 * HK).iter().map(|a| a / (DM as f64).sqrt()).collect());
    let g = as_f32(rng.uniform_vec(T * HK, -1.0, -0.05));
    let beta = as_f32(rng.uniform_vec(T * H, 0.0, 1.0));
    let c = as_f32(rng.normal_vec(T * HK));
    let f32s = |v: &[f64]| -> Vec<f32> { v.iter().map(|&a| a as f32).collect() };

    // The layer program and the KDA spec it embeds.
    let shape = [1, T, H, K];
    let zeros = |d: &[usize]| HostTensor::zeros(d, DType::F32);
    let like = kda_inputs(zeros(&shape), zeros(&shape), zeros(&shape), zeros(&shape), zeros(&[1, T, H]));
    let spec = ProgramSpec::of_inputs(&like, false)?;
    let (text, table_names, kda) = layer_program(&spec)?;
    let tables = index_tables(&spec, like.segments.as_ref())?;
    let names: Vec<&str> = tables.iter().map(|t| t.name).collect();
    assert_eq!(names, table_names, "index tables in signature order");
    println!(
        "layer program: {} lines, functions {:?}",
        text.lines().count(),
        text.lines()
            .filter(|l| l.contains("func.func"))
            .map(|l| l.split('(').next().unwrap_or("").trim())
            .collect::<Vec<_>>()
    );

    // Compile and run it once on the shared handle's device; only L and dW come back.
    let be = PjrtBackend::new()?;
    let program = be.compile_program(&text)?;
    let t32 = |d: &[usize], v: &[f64]| HostTensor::from_f32(d, f32s(v));
    let host_args = vec![
        t32(&[T, DM], &x)?,
        t32(&[DM, 3 * HK], &w)?,
        t32(&shape, &g)?,
        t32(&[1, T, H], &beta)?,
        t32(&shape, &c)?,
    ];
    let mut args: Vec<DeviceTensor> = be.to_device(&host_args, 0)?;
    // The layer computes q, k, v itself: the binder gives the KDA function's index tables alone.
    args.extend(be.bind(&kda, &[], like.segments.as_ref(), 0)?);
    let before = be.transfer_stats();
    let outs = be.execute(&program, &args)?;
    let host = be.to_host(&outs)?;
    let crossed = be.transfer_stats().since(before);
    let loss = host[0].get_f64(0);
    let dw = host[1].to_f32_vec();
    println!(
        "ran on {}: L = {loss:.6}, dW {:?}; {} bytes came back (L and dW only)",
        be.platform(),
        outs[1].shape(),
        crossed.to_host
    );

    // The reference composition in f64: the same projections, kda-ref's forward+VJP, x^T dP.
    let p = matmul(&x, &w, T, DM, 3 * HK);
    let part = |i: usize| -> Vec<f64> {
        p.chunks(3 * HK).flat_map(|row| row[i * HK..(i + 1) * HK].to_vec()).collect()
    };
    let t64 = |d: &[usize], v: Vec<f64>| HostTensor::from_f64(d, v);
    let inputs = kda_inputs(
        t64(&shape, part(0))?,
        t64(&shape, part(1))?,
        t64(&shape, part(2))?,
        t64(&shape, g.clone())?,
        t64(&[1, T, H], beta.clone())?,
    );
    let cot = Cotangents { d_o: t64(&shape, c.clone())?, dht: None };
    let (out, grads) = kda_ref::forward_and_vjp(&inputs, &cot)?;
    let o = out.o.to_f64_vec();
    let loss_ref: f64 = o.iter().zip(&c).map(|(a, b)| a * b).sum();
    let loss_scale: f64 = o.iter().zip(&c).map(|(a, b)| (a * b).abs()).sum();
    let (dq, dk, dv) = (grads.dq.to_f64_vec(), grads.dk.to_f64_vec(), grads.dv.to_f64_vec());
    let dp: Vec<f64> = (0..T)
        .flat_map(|t| [&dq, &dk, &dv].into_iter().flat_map(move |d| d[t * HK..(t + 1) * HK].to_vec()))
        .collect();
    let dw_ref = matmul(&transpose(&x, T, DM), &dp, DM, T, 3 * HK);

    // The checks.
    let a = agreement(&HostTensor::from_f32(&[DM, 3 * HK], dw)?, &dw_ref);
    let loss_err = (loss - loss_ref).abs() / loss_scale;
    let dw_ok = a.finite && a.rms_ratio <= 1e-4;
    let loss_ok = loss_err <= 1e-5;
    println!(
        "dW: rms ratio {:.2e} (limit 1e-4), max abs {:.2e}: {}",
        a.rms_ratio,
        a.max_abs,
        if dw_ok { "ok" } else { "FAIL" }
    );
    println!(
        "L: {loss:.6} vs reference {loss_ref:.6}, |diff| / sum|o C| {loss_err:.2e} (limit 1e-5): {}",
        if loss_ok { "ok" } else { "FAIL" }
    );
    if !(dw_ok && loss_ok) {
        return Err("the layer program disagrees with the reference composition".into());
    }
    println!("PASS");
    Ok(())
}
