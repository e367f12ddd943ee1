//! Training steps of a KDA layer with everything on the device, the way a downstream crate
//! would write them: the layer's inputs are uploaded once; each step runs the forward (its
//! residuals stay on the device), a loss program, the backward from `do = o` taken on the
//! device, and an SGD update of the gate parameters `a_log` and `dt_bias`, also on the device.
//! Per step it prints the bytes that crossed and checks that only the scalar loss did (and, in
//! the first step, the index tables, host-built, a few hundred bytes, which the handle keeps). The last step's gradients
//! are checked against the f64 reference.
//!
//! Run with `eval "$(cargo xtask env)" && cargo run --release -p kda-tpu --example training_step`.

use kda_core::{
    BackwardStrategy, Cotangents, DType, GateMode, HostTensor, KdaConfig, KdaInputs, Layout, Segments,
};
use kda_testkit::{agreement, rms_limit, Quantity, Rng};
use kda_tpu::hlo::{FnBuilder, Module, TensorType};
use kda_tpu::{DeviceCotangents, PjrtBackend};

type Error = Box<dyn std::error::Error>;

const STEPS: usize = 4;
const LR: f32 = 0.05;

fn f32t(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, &dims.iter().map(|&d| d as i64).collect::<Vec<_>>())
}

/// `0.5 * sum(o^2)` as a program: `o` in, a scalar out.
fn loss_program(shape: &[usize]) -> Result<String, Error> {
    let mut b = FnBuilder::new("main", true);
    let o = b.arg(f32t(shape))?;
    let sq = b.mul(o, o)?;
    let axes: Vec<i64> = (0..shape.len() as i64).collect();
    let sum = b.reduce_sum(sq, &axes)?;
    let loss = b.mul_const(sum, 0.5)?;
    b.ret(&[loss])?;
    let mut m = Module::new();
    m.add(b)?;
    Ok(m.to_text())
}

/// `p - LR * dp` for `a_log [H]` and `dt_bias [H*K]`.
fn sgd_program(h: usize, hk: usize) -> Result<String, Error> {
    let mut b = FnBuilder::new("main", true);
    let mut outs = Vec::new();
    let args = [b.arg(f32t(&[h]))?, b.arg(f32t(&[h]))?, b.arg(f32t(&[hk]))?, b.arg(f32t(&[hk]))?];
    for pair in args.chunks(2) {
        let step = b.mul_const(pair[1], -LR)?;
        outs.push(b.add(pair[0], step)?);
    }
    b.ret(&outs)?;
    let mut m = Module::new();
    m.add(b)?;
    Ok(m.to_text())
}

fn main() -> Result<(), Error> {
    // A small packed batch: 2 heads, one row of 300 tokens holding documents of 120, 57 and
    // 123, batch-first [B, T, H, D], an in-kernel softplus gate.
    let (h, t, k, v) = (2, 300, 64, 64);
    let mut rng = Rng::new(7);
    let tokens = |d: usize, rng: &mut Rng| -> Vec<f64> { rng.normal_vec(t * h * d) };
    let unit = |mut x: Vec<f64>, d: usize| {
        for row in x.chunks_mut(d) {
            let n = row.iter().map(|a| a * a).sum::<f64>().sqrt();
            row.iter_mut().for_each(|a| *a /= n);
        }
        x
    };
    let f32_tensor = |shape: &[usize], x: &[f64]| HostTensor::from_f64_as(shape, x, DType::F32);
    let shape_k = [1, t, h, k];
    let mut inputs = KdaInputs::new(
        f32_tensor(&shape_k, &unit(tokens(k, &mut rng), k))?,
        f32_tensor(&shape_k, &unit(tokens(k, &mut rng), k))?,
        f32_tensor(&[1, t, h, v], &tokens(v, &mut rng))?,
        f32_tensor(&shape_k, &rng.uniform_vec(t * h * k, -2.0, 1.0))?,
        f32_tensor(&[1, t, h], &rng.uniform_vec(t * h, 0.0, 1.0))?,
    )
    .with_config(KdaConfig { layout: Layout::BatchFirst, ..KdaConfig::default() })
    .with_segments(Segments::CuSeqlens(vec![vec![0, 120, 177, 300]]))
    .with_gate(GateMode::softplus(
        f32_tensor(&[h], &rng.uniform_vec(h, -1.0, 0.0))?,
        Some(f32_tensor(&[h * k], &rng.uniform_vec(h * k, -0.5, 0.5))?),
    ));

    let backend = PjrtBackend::new()?;
    let loss_fn = backend.compile_program(&loss_program(&[1, t, h, v])?)?;
    let sgd = backend.compile_program(&sgd_program(h, h * k)?)?;
    let mut x = backend.to_device(&inputs, 0)?;
    println!("uploaded the layer's inputs: {} bytes", backend.transfer_stats().to_device);
    // What a step may move: the index tables, built on the host from the segments (i32), in
    // the first step only, and the 4-byte loss back.
    let spec = kda_tpu::ProgramSpec::of_inputs(&inputs, false)?;
    let table_bytes: u64 = kda_tpu::op::index_tables(&spec, inputs.segments.as_ref())?
        .iter()
        .map(|t| 4 * t.data.len() as u64)
        .sum();

    let strategy = BackwardStrategy::SavedState;
    let mut last = None;
    for step in 1..=STEPS {
        let before = backend.transfer_stats();
        let (out, residuals) = backend.forward(&x, strategy)?;
        let loss = backend.to_host(&backend.execute(&loss_fn, std::slice::from_ref(&out.o))?[0])?.get_f64(0);
        // d(0.5 sum o^2)/do = o: the cotangent is the output itself, no copy.
        let grads = backend.backward(&residuals, &DeviceCotangents { d_o: out.o.clone(), dht: None })?;
        let (da_log, ddt_bias) =
            (grads.da_log.clone().ok_or("da_log")?, grads.ddt_bias.clone().ok_or("ddt_bias")?);
        let GateMode::Softplus { a_log: Some(a_log), dt_bias: Some(dt_bias) } = &x.gate else {
            return Err("the softplus gate with dt_bias".into());
        };
        let updated = backend.execute(&sgd, &[a_log.clone(), da_log, dt_bias.clone(), ddt_bias])?;
        let crossed = backend.transfer_stats().since(before);
        println!(
            "step {step}: loss {loss:.6}; {} bytes to the device (index tables: {table_bytes}), {} bytes back (the loss), {} programs",
            crossed.to_device, crossed.to_host, crossed.executions
        );
        let tables = if step == 1 { table_bytes } else { 0 };
        if crossed.to_device != tables || crossed.to_host != 4 {
            return Err(
                format!("step {step}: more than index tables and the loss crossed: {crossed:?}").into()
            );
        }
        // The gradients checked below are those of this step's parameters.
        last = Some((grads, x.gate.clone()));
        x.gate = GateMode::softplus(updated[0].clone(), Some(updated[1].clone()));
    }

    // The last step's gradients against the f64 reference, at the parameters of that step.
    let (grads, gate) = last.ok_or("no step")?;
    inputs.gate = backend.to_host(&KdaInputs { gate, ..x.clone() })?.gate;
    let (out, _) = kda_ref::forward_and_vjp(
        &inputs,
        &Cotangents { d_o: HostTensor::zeros(&[1, t, h, v], DType::F32), dht: None },
    )?;
    let cot = Cotangents { d_o: out.o.cast(DType::F32).expect("float cast"), dht: None };
    let (_, want) = kda_ref::forward_and_vjp(&inputs, &cot)?;
    let mut ok = true;
    for ((name, got), (_, w)) in grads.named().into_iter().zip(want.named()) {
        let a = agreement(&backend.to_host(got)?, &w.to_f64_vec());
        let limit = rms_limit(Quantity::of(name), DType::F32);
        let pass = a.rms_ratio <= limit;
        ok &= pass;
        println!(
            "  {name:>8}: rms ratio {:.2e} (limit {limit:.0e}) {}",
            a.rms_ratio,
            if pass { "ok" } else { "FAIL" }
        );
    }
    if !ok {
        return Err("gradients disagree with the reference".into());
    }
    println!("PASS");
    Ok(())
}
