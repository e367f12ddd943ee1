//! One training step of a KDA layer, the way a downstream crate would write it: forward on the
//! PJRT backend (residuals stay on the device), a loss, the backward from those residuals, and
//! the gradients checked against the f64 reference.
//!
//! Run with `eval "$(cargo xtask env)" && cargo run --release -p kda-tpu --example training_step`.

use kda_core::{Backend, BackwardStrategy, Cotangents, DType, HostTensor, KdaConfig, KdaInputs, Layout};
use kda_testkit::{agreement, rms_limit, Quantity, Rng};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A small packed batch: 2 heads, one row of 300 tokens holding documents of 120, 57 and 123.
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
    let shape_k = [1, t, h, k]; // batch-first [B, T, H, K]
    let inputs = KdaInputs::new(
        HostTensor::from_f64_as(&shape_k, &unit(tokens(k, &mut rng), k), DType::F32)?,
        HostTensor::from_f64_as(&shape_k, &unit(tokens(k, &mut rng), k), DType::F32)?,
        HostTensor::from_f64_as(&[1, t, h, v], &tokens(v, &mut rng), DType::F32)?,
        HostTensor::from_f64_as(&shape_k, &rng.uniform_vec(t * h * k, -1.0, 0.0), DType::F32)?,
        HostTensor::from_f64_as(&[1, t, h], &rng.uniform_vec(t * h, 0.0, 1.0), DType::F32)?,
    )
    .with_config(KdaConfig { layout: Layout::BatchFirst, output_final_state: true, ..KdaConfig::default() })
    .with_segments(kda_core::Segments::CuSeqlens(vec![vec![0, 120, 177, 300]]));

    let backend = kda_tpu::PjrtBackend::new()?;
    // Forward: outputs come back, residuals (inputs and per-chunk states) stay on the device.
    let (out, residuals) = backend.forward(&inputs, BackwardStrategy::SavedState)?;
    println!("forward: o {:?}, {} bytes of residuals on the device", out.o.shape(), residuals.device_bytes());

    // Loss = 0.5 * sum(o^2) (+ nothing on the final state): do = o.
    let o = out.o.to_f64_vec();
    let loss: f64 = 0.5 * o.iter().map(|x| x * x).sum::<f64>();
    let cot = Cotangents { d_o: out.o.clone(), dht: None };
    let grads = backend.backward(residuals, &cot)?;
    println!("loss {loss:.6}");

    // The same gradients from the f64 reference, on the same f32 inputs and cotangent.
    let (_, want) = kda_ref::forward_and_vjp(&inputs, &cot)?;
    let mut ok = true;
    for ((name, got), (_, w)) in grads.named().into_iter().zip(want.named()) {
        let a = agreement(got, &w.to_f64_vec());
        let limit = rms_limit(Quantity::of(name), DType::F32);
        let pass = a.rms_ratio <= limit;
        ok &= pass;
        println!(
            "  {name:>6}: rms ratio {:.2e} (limit {limit:.0e}) {}",
            a.rms_ratio,
            if pass { "ok" } else { "FAIL" }
        );
    }
    if !ok {
        return Err("gradients disagree with the reference".into());
    }
    Ok(())
}
