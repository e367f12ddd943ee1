//! The GPU kernels (`op::gpu_kernels`): the forward through the interpret lowering on the CPU
//! plugin against the f64 reference at the limits of docs/kda.md, and the forward's and the
//! backward's state-gradient kernel through their Triton lowering, compiled deviceless for the
//! H200 through the CUDA plugin (the backward's numerics: `conformance`, `triton_interpret`).

// The shared runner of builder programs; this binary reads float results only.
#[allow(dead_code)]
#[macro_use]
mod hlo_support;

use half::bf16;
use hlo_support::{unit_rows, In};
use kda_core::{DType, GateKind, GateMode, HostTensor, KdaConfig, KdaInputs, Layout};
use kda_testkit::metrics::agreement;
use kda_testkit::tolerance::{rms_limit, Quantity};
use kda_testkit::Rng;
use kda_tpu::aot::{GpuCompiler, H200};
use kda_tpu::lang::{Interpret, Lower, Triton};
use kda_tpu::op::gpu_kernels::intra_grad::intra_grad_kernel;
use kda_tpu::op::gpu_kernels::norm_grad::norm_grad_kernel;
use kda_tpu::op::gpu_kernels::state_grad::state_grad_kernel;
use kda_tpu::op::gpu_kernels::wy_grad::wy_grad_kernel;
use kda_tpu::op::gpu_kernels::{forward_module, ForwardShape};
use kda_tpu::Result;
use rstest::rstest;

/// Seeded inputs of `s` (q and k L2-normalised, g in [-5, 0] or with hard resets at -30,
/// beta in [0, 1]), rounded to the shape's dtype: what the kernels and the reference both take.
struct Data {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    beta: Vec<f64>,
    h0: Vec<f64>,
}

fn data(s: &ForwardShape, seed: u64, resets: bool) -> Data {
    data_in(s, seed, -5.0, resets)
}

/// [`data`] with `g` drawn from `[g_lo, 0]`.
fn data_in(s: &ForwardShape, seed: u64, g_lo: f64, resets: bool) -> Data {
    let (l, t, k, v) = (s.lanes as usize, s.t as usize, s.k as usize, s.v as usize);
    let mut r = Rng::new(seed);
    let unit = |x: Vec<f64>| -> Vec<f64> {
        let narrow: Vec<f32> = x.iter().map(|&a| a as f32).collect();
        unit_rows(narrow, k).into_iter().map(f64::from).collect()
    };
    let round = |x: Vec<f64>| -> Vec<f64> {
        match s.dtype {
            DType::BF16 => x.iter().map(|&a| f64::from(bf16::from_f64(a).to_f32())).collect(),
            _ => x.iter().map(|&a| f64::from(a as f32)).collect(),
        }
    };
    let q = round(unit(r.normal_vec(l * t * k)));
    let kk = round(unit(r.normal_vec(l * t * k)));
    let vv = round(r.normal_vec(l * t * v));
    let mut g: Vec<f64> =
        r.uniform_vec(l * t * k, g_lo, 0.0).into_iter().map(|a| f64::from(a as f32)).collect();
    if resets {
        // Hard resets: every gate of tokens 21, 40 and 49..52 of each lane at the floor.
        for lane in 0..l {
            for tok in [21, 40, 49, 50, 51, 90, 127] {
                if tok < t {
                    g[(lane * t + tok) * k..(lane * t + tok + 1) * k].fill(-30.0);
                }
            }
        }
    }
    let beta = round(r.uniform_vec(l * t, 0.0, 1.0));
    let h0: Vec<f64> = r.normal_vec(l * k * v).into_iter().map(|a| f64::from((0.1 * a) as f32)).collect();
    Data { q, k: kk, v: vv, g, beta, h0 }
}

fn host(dtype: DType, x: &[f64], dims: &[i64]) -> In {
    match dtype {
        DType::BF16 => In::Bf16(x.iter().map(|&a| bf16::from_f64(a)).collect(), dims.to_vec()),
        _ => In::F32(x.iter().map(|&a| a as f32).collect(), dims.to_vec()),
    }
}

/// The forward's operands of `d`, in `forward_module`'s order.
fn operands(s: &ForwardShape, d: &Data) -> Vec<In> {
    let (l, t, k, v) = (s.lanes, s.t, s.k, s.v);
    let mut ins = vec![
        host(s.dtype, &d.q, &[l, t, k]),
        host(s.dtype, &d.k, &[l, t, k]),
        host(s.dtype, &d.v, &[l, t, v]),
        host(DType::F32, &d.g, &[l, t, k]),
        host(s.dtype, &d.beta, &[l, t, 1]),
    ];
    if s.h0 {
        ins.push(host(DType::F32, &d.h0, &[l, k, v]));
    }
    ins
}

/// The f64 reference's `o` and final state of `d` (lanes as heads of one row, head-first).
fn reference(s: &ForwardShape, d: &Data) -> (Vec<f64>, Vec<f64>) {
    let (h, t, k, v) = (s.lanes as usize, s.t as usize, s.k as usize, s.v as usize);
    let t64 = |dims: &[usize], x: &[f64]| HostTensor::from_f64(dims, x.to_vec()).expect("tensor");
    let mut inputs = KdaInputs::new(
        t64(&[h, 1, t, k], &d.q),
        t64(&[h, 1, t, k], &d.k),
        t64(&[h, 1, t, v], &d.v),
        t64(&[h, 1, t, k], &d.g),
        t64(&[h, 1, t], &d.beta),
    )
    .with_gate(GateMode::Preactivated)
    .with_config(KdaConfig {
        layout: Layout::HeadFirst,
        scale: Some(s.scale),
        use_qk_l2norm: false,
        output_final_state: true,
    });
    if s.h0 {
        inputs = inputs.with_initial_state(t64(&[1, 1, h, k, v], &d.h0));
    }
    let out = kda_ref::forward(&inputs).expect("the reference");
    (out.o.to_f64_vec(), out.final_state.expect("final state").to_f64_vec())
}

/// The GPU forward through its interpret lowering meets the reference: `o` and the final state
/// at the limits of docs/kda.md for the shape's dtype.
#[rstest]
#[case::f32_with_state(ForwardShape { h0: true, ..ForwardShape::new(2, 256, 128, 128, DType::F32) }, false)]
#[case::f32_hard_resets(ForwardShape { h0: true, ..ForwardShape::new(2, 192, 128, 128, DType::F32) }, true)]
#[case::f32_narrow_values(ForwardShape::new(1, 128, 128, 64, DType::F32), false)]
#[case::bf16_with_state(ForwardShape { h0: true, ..ForwardShape::new(2, 128, 64, 128, DType::BF16) }, false)]
fn gpu_forward_meets_the_reference(#[case] s: ForwardShape, #[case] resets: bool) -> Result<()> {
    meets_the_reference(&s, resets, &Interpret::TRITON_NUMERICS)
}

/// Runs the forward of `s` lowered as `lowering` on the default plugin against the reference.
fn meets_the_reference(s: &ForwardShape, resets: bool, lowering: &dyn Lower) -> Result<()> {
    let s = *s;
    let d = data(&s, 7, resets);
    let (want_o, want_ht) = reference(&s, &d);
    let text = forward_module(&s, lowering)?;
    let outs = run!(&text, operands(&s, &d));
    for (name, got, want, q) in [
        ("o", &outs[0], &want_o, Quantity::Output),
        ("final state", &outs[1], &want_ht, Quantity::FinalState),
    ] {
        let dims: Vec<usize> = got.dims.iter().map(|&x| x as usize).collect();
        let a = agreement(&HostTensor::from_f32(&dims, got.f32s())?, want);
        let limit = rms_limit(q, s.dtype);
        eprintln!("{name}: rms ratio {:.3e} (limit {limit:e}), max abs {:.3e}", a.rms_ratio, a.max_abs);
        assert!(a.finite && a.rms_ratio <= limit, "{name}: {a:?} over {limit}");
    }
    Ok(())
}

/// The GPU forward through its interpret lowering is bitwise causal: every input of every
/// token from `t0` on replaced by other draws leaves the outputs of the tokens before `t0` the
/// same to the bit, on each lane. Gates in [-0.05, 0], so that no decay hides a term that reads
/// a later token (a q-side decay over the rest of the chunk breaks this test). `t0` inside a 16-token sub-chunk,
/// at a sub-chunk start inside a chunk, and one token into a chunk.
#[rstest]
#[case::inside_a_sub_chunk(DType::F32, 100)]
#[case::at_a_sub_chunk_start(DType::F32, 80)]
#[case::one_into_a_chunk(DType::BF16, 129)]
fn gpu_forward_is_bitwise_causal(#[case] dtype: DType, #[case] t0: usize) -> Result<()> {
    let s = ForwardShape { h0: true, ..ForwardShape::new(2, 192, 64, 128, dtype) };
    let (l, t, k, v) = (s.lanes as usize, s.t as usize, s.k as usize, s.v as usize);
    let (a, other) = (data_in(&s, 11, -0.05, false), data_in(&s, 12, -0.05, false));
    let mut b = data_in(&s, 11, -0.05, false);
    for lane in 0..l {
        for (x, y, w) in [
            (&mut b.q, &other.q, k),
            (&mut b.k, &other.k, k),
            (&mut b.v, &other.v, v),
            (&mut b.g, &other.g, k),
            (&mut b.beta, &other.beta, 1),
        ] {
            let from = (lane * t + t0) * w;
            let to = (lane + 1) * t * w;
            x[from..to].copy_from_slice(&y[from..to]);
        }
    }
    let text = forward_module(&s, &Interpret::TRITON_NUMERICS)?;
    let (oa, ob) = (run!(&text, operands(&s, &a)), run!(&text, operands(&s, &b)));
    let (xa, xb) = (oa[0].f32s(), ob[0].f32s());
    let mut changed_after = false;
    for lane in 0..l {
        let before =
            |o: &[f32]| o[lane * t * v..(lane * t + t0) * v].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(before(&xa), before(&xb), "lane {lane}: an output before token {t0} moved");
        changed_after |=
            xa[(lane * t + t0) * v..(lane + 1) * t * v] != xb[(lane * t + t0) * v..(lane + 1) * t * v];
    }
    assert!(changed_after, "the outputs from token {t0} on see the new inputs");
    Ok(())
}

/// The GPU forward kernels compile deviceless for the H200 at the primary shape (H=8, T=1024,
/// K=V=128, an initial state) in bf16: one program per lane and chunk for the intra and WY
/// kernels, one per lane and 32 state columns for the recurrence, 8 warps each, within the
/// H200's 232,448 B of shared memory, no atomics in the Triton text, and no spill stores. f32
/// (about a minute) is under `full::`.
#[test]
fn gpu_forward_compiles_for_the_h200_in_bf16() -> Result<()> {
    let grids =
        [("kda_gpu_intra", [8, 16, 1]), ("kda_gpu_wy", [8, 16, 1]), ("kda_gpu_recurrence", [8, 4, 1])];
    compiles_for_the_h200(DType::BF16, &grids)
}

/// The backward's state-gradient kernel at the primary shape (H=8, T=1024, K=V=128, `dht`
/// given), bf16: a program per lane and block of 32 state columns, 8 warps, no spill stores, no
/// atomics. f32 and K = 256 are under `full::`.
#[test]
fn gpu_state_grad_compiles_for_the_h200_in_bf16() -> Result<()> {
    state_grad_compiles(DType::BF16, 128, 128, [8, 4, 1])
}

/// [`gpu_state_grad_compiles_for_the_h200_in_bf16`] for `dtype` at `K = k`, `V = v`: launched
/// on `grid`, no spills.
fn state_grad_compiles(dtype: DType, k: i64, v: i64, grid: [u64; 3]) -> Result<()> {
    let s = ForwardShape::new(8, 1024, k, v, dtype);
    let text = state_grad_kernel(&s, true)?.0.module(&Triton)?;
    launches_on_the_h200(&text, dtype, &[("kda_gpu_state_grad", grid)])
}

/// The WY gradient at the primary shape (H=8, T=1024, K=V=128) in bf16 with the secondary
/// benchmark's options (L2 norm, the lower-bound gate: the most registers of the backward's
/// chunk-parallel kernels): per lane and chunk a program per 64 key columns and the value
/// side's, 8 warps, no spill stores, no atomics. The intra gradient, the kernels without the
/// options, in f32 and at K = 256 are under `full::`.
#[test]
fn gpu_wy_grad_compiles_for_the_h200_in_bf16() -> Result<()> {
    chunk_grad_compiles("kda_gpu_wy_grad", DType::BF16, 128, 128, true)
}

/// The chunk-parallel backward kernel `name` for `dtype` at `K = k`, `V = v` (H=8, T=1024;
/// `gated`: the L2 norm and the lower-bound gate): launched on (lanes, chunks, its programs
/// per chunk), no spills.
fn chunk_grad_compiles(name: &str, dtype: DType, k: i64, v: i64, gated: bool) -> Result<()> {
    let s = ForwardShape::new(8, 1024, k, v, dtype);
    let s = match gated {
        true => ForwardShape { l2norm: true, gate: GateKind::LowerBound(-5.0), ..s },
        false => s,
    };
    let (kernel, programs) = match name {
        "kda_gpu_wy_grad" => (wy_grad_kernel(&s)?.0, s.wy_grad_parts() as u64),
        "kda_gpu_norm_grad" => (norm_grad_kernel(&s)?.0, 1),
        _ => (intra_grad_kernel(&s)?.0, (k / s.intra_grad_bk()) as u64),
    };
    launches_on_the_h200(&kernel.module(&Triton)?, dtype, &[(name, [8, 16, programs])])
}

mod full {
    use super::*;

    /// The chunk-parallel backward kernels without the gate and L2 norm, in f32 (the WY
    /// gradient's products through `A^T` as a loop) and at K = 256 / V = 32 in bf16, no spill
    /// stores.
    #[rstest]
    fn gpu_chunk_grads_compile_for_the_h200(
        #[values("kda_gpu_wy_grad", "kda_gpu_intra_grad", "kda_gpu_norm_grad")] name: &str,
        #[values((DType::BF16, 128, 128), (DType::F32, 128, 128), (DType::BF16, 256, 32))] shape: (
            DType,
            i64,
            i64,
        ),
    ) -> Result<()> {
        chunk_grad_compiles(name, shape.0, shape.1, shape.2, false)
    }

    /// The intra gradient with the secondary benchmark's options (L2 norm, the lower-bound
    /// gate, whose backward and floor it runs) in bf16 and f32, no spill stores: on lanes at
    /// H=8, T=1024, and as the `triton` program launches it at the secondary shape (H=32,
    /// T=8192, batch-first rows read in place; the register allocation follows the index
    /// arithmetic, so the shape the program runs is compiled itself).
    #[rstest]
    fn gpu_intra_grad_compiles_for_the_h200_with_the_gate_and_l2_norm(
        #[values(DType::BF16, DType::F32)] dtype: DType,
        #[values(false, true)] secondary_rows: bool,
    ) -> Result<()> {
        if !secondary_rows {
            return chunk_grad_compiles("kda_gpu_intra_grad", dtype, 128, 128, true);
        }
        let s = ForwardShape {
            layout: kda_tpu::op::gpu_kernels::TokenLayout::Rows,
            l2norm: true,
            gate: GateKind::LowerBound(-5.0),
            ..ForwardShape::new(32, 8192, 128, 128, dtype)
        };
        let kernel = intra_grad_kernel(&s)?.0;
        let grid = [32, 128, (128 / s.intra_grad_bk()) as u64];
        launches_on_the_h200(&kernel.module(&Triton)?, dtype, &[("kda_gpu_intra_grad", grid)])
    }
    use kda_core::BackwardStrategy;
    use kda_testkit::{benchmark_cases, case_data};
    use kda_tpu::op::ProgramKind;
    use kda_tpu::{Implementation, PjrtBackend};

    /// The state-gradient kernel in f32 (`dh` whole along K, 8 state columns per program) and
    /// at K = 256 in bf16 (two parts of 128 rows), no spill stores.
    #[rstest]
    #[case::f32_k128(DType::F32, 128, 128, [8, 16, 1])]
    #[case::bf16_k256_v32(DType::BF16, 256, 32, [8, 1, 1])]
    fn gpu_state_grad_compiles_for_the_h200(
        #[case] dtype: DType,
        #[case] k: i64,
        #[case] v: i64,
        #[case] grid: [u64; 3],
    ) -> Result<()> {
        state_grad_compiles(dtype, k, v, grid)
    }

    /// f32 holds every operand of a three-pass product twice: the intra kernel runs a program
    /// per sub-chunk and hands `L` to the inverse kernel, the WY kernel a program per block of
    /// 64 key or value columns, the recurrence 16 state columns per program; none spills.
    #[test]
    fn gpu_forward_compiles_for_the_h200_in_f32() -> Result<()> {
        let grids = [
            ("kda_gpu_intra", [8, 16, 4]),
            ("kda_gpu_inverse", [8, 16, 1]),
            ("kda_gpu_wy", [8, 16, 4]),
            ("kda_gpu_recurrence", [8, 8, 1]),
        ];
        compiles_for_the_h200(DType::F32, &grids)
    }

    /// The `triton` row's forward program at the benchmark shapes of docs/kda.md (the
    /// secondary: H=32, T=8192, L2 norm and the lower-bound gate; fixed, and packed into 25
    /// segments; the primary packed), bf16 and f32: every GPU kernel without spill stores and
    /// within the H200's shared memory, whatever the shape (registers depend on the tiles
    /// alone).
    #[rstest]
    fn the_triton_forward_program_compiles_without_spills(
        #[values("bench_primary_packed", "bench_secondary", "bench_secondary_packed")] name: &str,
        #[values(DType::BF16, DType::F32)] dtype: DType,
    ) -> Result<()> {
        program_compiles_without_spills(name, dtype, ProgramKind::Forward(BackwardStrategy::Rematerialize), 3)
    }

    /// The `triton` row's split backward (saved state: the chunk kernels again, then the state,
    /// WY and intra gradients) at the benchmark shapes, bf16 and f32.
    #[rstest]
    fn the_triton_backward_program_compiles_without_spills(
        #[values("bench_primary", "bench_secondary", "bench_secondary_packed")] name: &str,
        #[values(DType::BF16, DType::F32)] dtype: DType,
    ) -> Result<()> {
        program_compiles_without_spills(name, dtype, ProgramKind::Backward(BackwardStrategy::SavedState), 5)
    }

    /// Compiles program `kind` of benchmark case `name` in `dtype` for the H200: at least
    /// `kernels` GPU kernels, none spilling, each within the H200's shared memory.
    fn program_compiles_without_spills(
        name: &str,
        dtype: DType,
        kind: ProgramKind,
        kernels: usize,
    ) -> Result<()> {
        let case = benchmark_cases().into_iter().find(|c| c.name == name).expect("benchmark case");
        let data = case_data(&case, dtype).expect("inputs");
        let problem = data.inputs.validate().expect("valid inputs");
        let cpu = PjrtBackend::new()?;
        let spec = cpu.spec(&problem, case.final_state)?;
        let tuning = spec.tuning.with_implementation(Implementation::Triton);
        let spec = spec.with_tuning(tuning);
        let text = kda_tpu::op::program(&spec, kind)?;
        let gpu = GpuCompiler::load()?.with_figures(std::env::temp_dir().join("kda-gpu-kernel-dumps"));
        let report = gpu.compile(&text, &H200)?;
        let found: Vec<_> = report.kernels.iter().filter(|k| k.name.starts_with("kda_gpu")).collect();
        assert!(found.len() >= kernels, "{:?}", report.kernels);
        for k in found {
            eprintln!("{name} {dtype} {k:?}");
            assert_eq!(k.spill_store_bytes, Some(0), "{}: spills", k.name);
            assert!(
                k.shared_memory_bytes <= 232_448,
                "{}: {} B of shared memory",
                k.name,
                k.shared_memory_bytes
            );
        }
        Ok(())
    }
}

/// Compiles the forward of the primary shape in `dtype`: its kernels launch on `grids`, with
/// 8 warps, no spill stores and at most the H200's shared memory.
fn compiles_for_the_h200(dtype: DType, grids: &[(&str, [u64; 3])]) -> Result<()> {
    let s = ForwardShape { h0: true, ..ForwardShape::new(8, 1024, 128, 128, dtype) };
    launches_on_the_h200(&forward_module(&s, &Triton)?, dtype, grids)
}

/// Compiles `text` for the H200: its kernels launch on `grids`, with 8 warps, no spill stores,
/// no atomics and at most the H200's shared memory.
fn launches_on_the_h200(text: &str, dtype: DType, grids: &[(&str, [u64; 3])]) -> Result<()> {
    assert!(!text.contains("atomic"), "an atomic in the Triton text");
    let gpu = GpuCompiler::load()
        .unwrap_or_else(|e| panic!("no CUDA plugin ({e}); run `cargo xtask setup`"))
        .with_figures(std::env::temp_dir().join("kda-gpu-kernel-dumps"));
    let report = gpu.compile(text, &H200)?;
    let kernels: Vec<_> = report.kernels.iter().filter(|k| k.name.starts_with("kda_gpu")).collect();
    for k in &kernels {
        eprintln!("{dtype} {k:?}");
    }
    let launched: Vec<(&str, [u64; 3])> = kernels.iter().map(|k| (k.name.as_str(), k.grid)).collect();
    assert_eq!(launched, grids);
    for k in &kernels {
        assert_eq!(k.threads[0], 256, "{}: 8 warps", k.name);
        assert!(k.shared_memory_bytes <= 232_448, "{}: {} B of shared memory", k.name, k.shared_memory_bytes);
        assert_eq!(k.spill_store_bytes, Some(0), "{}: spill stores", k.name);
    }
    Ok(())
}

/// On a GPU host only (`cargo xtask gpu-check`): the GPU forward through Triton meets the
/// reference as its interpret lowering does.
mod gpu {
    use super::*;

    #[rstest]
    #[case::f32_with_state(ForwardShape { h0: true, ..ForwardShape::new(2, 256, 128, 128, DType::F32) }, false)]
    #[case::f32_hard_resets(ForwardShape { h0: true, ..ForwardShape::new(2, 192, 128, 128, DType::F32) }, true)]
    #[case::bf16_with_state(ForwardShape { h0: true, ..ForwardShape::new(2, 128, 64, 128, DType::BF16) }, false)]
    fn forward_runs_through_triton(#[case] s: ForwardShape, #[case] resets: bool) -> Result<()> {
        let platform = kda_tpu::Runtime::new()?.platform().to_lowercase();
        assert!(
            platform.contains("cuda"),
            "the gpu:: tier runs on a GPU (`cargo xtask gpu-check`), not on {platform}"
        );
        meets_the_reference(&s, resets, &Triton)
    }
}
