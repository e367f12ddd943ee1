//! The primary-shape programs (docs/kda.md, Benchmarks, bf16, fixed and packed) compile ahead of time for
//! `tpu7x:2x2x1` through the setup's libtpu, in the configuration a TPU runs (fused programs in
//! slabs of `TPU_SLAB` chunk positions); each test prints the compiler's memory figures, peak
//! included. The fused programs must stay within the backend issue's memory targets (80 MB
//! fixed, 110 MB packed): the compiler's figures are deterministic for one libtpu, so this is a
//! regression check, not a timing.

use kda_core::BackwardStrategy;
use kda_core::{BackwardStrategy as S, DType};
use kda_testkit::{benchmark_cases, case_data};
use kda_tpu::aot::StaticCycles;
use kda_tpu::op::TPU_SLAB;
use kda_tpu::{PjrtBackend, ProgramKind, TpuCompiler, DEFAULT_TOPOLOGY};
use rstest::rstest;
use std::collections::BTreeMap;

/// The spec of benchmark case `name` in bf16 as the CPU plugin `cpu` plans it (nothing runs
/// on it: it only plans the packed capacity), taking `dht` when `dht` is asked and the case
/// has one, tuned by `f`.
fn bench_spec(
    cpu: &PjrtBackend,
    name: &str,
    dht: bool,
    f: impl FnOnce(kda_tpu::Tuning) -> kda_tpu::Tuning,
) -> kda_tpu::ProgramSpec {
    let case = benchmark_cases().into_iter().find(|c| c.name == name).expect("benchmark case");
    let data = case_data(&case, DType::BF16).expect("inputs");
    let problem = data.inputs.validate().expect("valid inputs");
    let spec = cpu.spec(&problem, dht && data.cotangents.dht.is_some()).expect("spec");
    let tuning = f(spec.tuning);
    spec.with_tuning(tuning)
}

const MB: f64 = 1e6;

/// In CI: the forward and the fused saved-state program, fixed and packed; the rest under `--full`.
#[rstest]
#[case::forward_fixed("bench_primary", ProgramKind::Forward(BackwardStrategy::Rematerialize), None)]
#[case::fused_saved_state_fixed("bench_primary", ProgramKind::Fused(S::SavedState), Some(80.0))]
#[case::fused_saved_state_packed("bench_primary_packed", ProgramKind::Fused(S::SavedState), Some(110.0))]
fn primary_program_compiles_for_tpu7x(
    #[case] name: &str,
    #[case] kind: ProgramKind,
    #[case] limit_mb: Option<f64>,
) {
    xla_program_compiles(name, kind, limit_mb);
}

fn xla_program_compiles(name: &str, kind: ProgramKind, limit_mb: Option<f64>) {
    let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
    let spec = bench_spec(&cpu, name, true, |t| t.with_slab(TPU_SLAB));
    let text = kda_tpu::op::program(&spec, kind).expect("program");
    let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
    let report = tpu.compile(&text, DEFAULT_TOPOLOGY).expect("tpu7x compile");
    let m = &report.memory;
    eprintln!(
        "{name} {kind:?} bf16 on {DEFAULT_TOPOLOGY}: peak {:.2} MB, temp {:.2} MB, arguments {:.2} MB, \
         outputs {:.2} MB (compiled in {:.1} s)",
        m.peak_bytes as f64 / MB,
        m.temp_bytes as f64 / MB,
        m.argument_bytes as f64 / MB,
        m.output_bytes as f64 / MB,
        report.compile_time.as_secs_f64()
    );
    assert!(m.peak_bytes > 0, "{report:?}");
    if let Some(limit) = limit_mb {
        let peak = m.peak_bytes as f64 / MB;
        assert!(peak <= limit, "{name} {kind:?}: tpu7x peak {peak:.2} MB above the {limit} MB target");
    }
}

/// 16 MiB: the smallest default scoped-VMEM limit of the TPU generations; a kernel within it
/// needs no `vmem_limit_bytes` anywhere.
const VMEM_LIMIT: u64 = 16 << 20;

/// The forward programs around the Mosaic forward kernel (`Implementation::Mosaic`) compile
/// for tpu7x at the primary shape, bf16, fixed and with four segments, as two kernels (the
/// forward and the one-step kernel of its constant masks) within
/// the default scoped VMEM; the forward's HBM peak is at most tokamax's Pallas forward measured
/// the same way (27.3 MB fixed, 28.9 MB packed, docs/performance.md). The same at H=32,
/// T=8192 (L2 norm, lower-bound gate), fixed and with 25 segments, with no peak target, under
/// `--full`.
#[rstest]
#[case::forward_fixed("bench_primary", S::Rematerialize, Some(27.3))]
#[case::forward_packed("bench_primary_packed", S::Rematerialize, Some(28.9))]
#[case::forward_saved_state_fixed("bench_primary", S::SavedState, None)]
#[case::forward_saved_state_packed("bench_primary_packed", S::SavedState, None)]
fn mosaic_forward_compiles_for_tpu7x(
    #[case] name: &str,
    #[case] strategy: BackwardStrategy,
    #[case] limit_mb: Option<f64>,
) {
    mosaic_forward_compiles(name, strategy, limit_mb);
}

fn mosaic_forward_compiles(name: &str, strategy: BackwardStrategy, limit_mb: Option<f64>) {
    let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
    let spec = bench_spec(&cpu, name, false, |t| t.with_implementation(kda_tpu::Implementation::Mosaic));
    let text = kda_tpu::op::program(&spec, ProgramKind::Forward(strategy)).expect("program");
    let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
    let report = tpu.compile(&text, DEFAULT_TOPOLOGY).expect("tpu7x compile");
    let (m, vmem) = (&report.memory, &report.kernel_vmem_bytes);
    let peak = m.peak_bytes as f64 / MB;
    eprintln!(
        "{name} mosaic forward {strategy:?} bf16 on {DEFAULT_TOPOLOGY}: peak {peak:.2} MB, temp {:.2} MB, \
         code {:.2} MB, kernel VMEM {vmem:?} B",
        m.temp_bytes as f64 / MB,
        m.generated_code_bytes as f64 / MB
    );
    assert_eq!(vmem.len(), 2, "the forward kernel and the chunk terms' masks kernel");
    // The forward and backward kernels hold blocks in scoped VMEM; libtpu may give the
    // one-step masks kernel none (at H=32 with the lower-bound gate's three levels).
    assert!(vmem.iter().all(|&b| b <= VMEM_LIMIT), "kernel VMEM {vmem:?} B");
    assert!(vmem.iter().filter(|&&b| b > 0).count() >= 2, "kernel VMEM {vmem:?} B");
    if let Some(limit) = limit_mb {
        assert!(peak <= limit, "{name}: tpu7x peak {peak:.2} MB above tokamax's {limit} MB");
    }
}

/// A libtpu that writes bundle listings into a directory of its own. The listings flags must
/// reach libtpu before it loads, so each test calling this loads its own libtpu (nextest gives
/// each test a process).
fn listing_compiler() -> (TpuCompiler, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kda-listings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("listing dir");
    std::env::set_var("LIBTPU_INIT_ARGS", kda_tpu::aot::cycles::listing_flags(&dir));
    let tpu = TpuCompiler::load()
        .unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"))
        .with_listings(&dir);
    (tpu, dir)
}

/// Static cycles from libtpu's bundle listings (`kda_tpu::aot::cycles`), bf16: the XLA
/// forward's count at the primary shape agrees within 1% with the independent count of the same
/// method, which evaluates the pipelined loops' guards (496 k bundles, libtpu 0.0.52;
/// docs/performance.md: 495.7 k here, 506.2 k with guarded regions counted on every trip), and
/// the Mosaic forward's counts come with their kernels' share and are at most two thirds of
/// tokamax's Mosaic forward's counted the same way (docs/kda.md, Benchmarks): 57.8 k of its
/// 86.7 k at the primary shape, 1.74 M of its 2.61 M at H=32, T=8192 (the L2 norm and the
/// lower-bound gate, whose 16-token level-0 blocks take two levels fewer), and with four
/// segments no more than the 52.5 k it took before those (two thirds of its 177 k is 118 k:
/// packed rows read as whole blocks).
#[test]
fn static_cycles_of_the_forward() {
    use kda_tpu::Implementation::{Mosaic, Xla};
    let (tpu, dir) = listing_compiler();
    let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
    let kind = ProgramKind::Forward(S::Rematerialize);
    let count = |name: &str, implementation| {
        let spec =
            bench_spec(&cpu, name, false, |t| t.with_slab(TPU_SLAB).with_implementation(implementation));
        let text = kda_tpu::op::program(&spec, kind).expect("program");
        let report = tpu.compile(&text, DEFAULT_TOPOLOGY).expect("tpu7x compile");
        let c = report.static_cycles.expect("a static cycle count");
        eprintln!("{implementation:?} forward, {name} bf16: {c:?}");
        c
    };
    let xla = count("bench_primary", Xla);
    let off = (xla.total as f64 / 496e3 - 1.0).abs();
    assert!(off <= 0.01, "XLA forward: {} cycles, {:.1}% off 496 k", xla.total, off * 100.0);
    assert_eq!(xla.kernels, 0);
    for (name, limit) in
        [("bench_primary", 57_800), ("bench_primary_packed", 52_500), ("bench_secondary", 1_740_000)]
    {
        let mosaic = count(name, Mosaic);
        assert!(mosaic.kernels > 0 && mosaic.kernels <= mosaic.total, "{mosaic:?}");
        // The forward kernel's ops by unit: vector work, products and exponentials, all on
        // the path; its listing spills (docs/kernels/static-cycles.md).
        let u = mosaic.per_kernel["kda_forward"].units;
        assert!(u.valu > 0 && u.mxu_pushes > 0 && u.transcendental_pushes > 0, "{u:?}");
        assert!(u.spill_stores > 0 && u.spill_loads >= u.spill_stores, "{u:?}");
        assert!(mosaic.total <= limit, "{name} Mosaic forward: {} cycles, over {limit}", mosaic.total);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A one-step kernel of `rows x 128` f32 that holds `e = 2^x` across a reduction over all its
/// rows, `o = e * colsum(e)`: `rows / 8` vector registers live at once, which libtpu cannot
/// take back from the input (`e` is computed). 128 rows (16 registers) fit the file of 64;
/// 1024 rows (128 registers) do not, and the listing's `vst` to `_spill` slots
/// (`cycles::Units`, docs/kernels/static-cycles.md) must show it.
#[rstest]
#[case::fits(128, false)]
#[case::spills(1024, true)]
fn a_kernel_holding_more_registers_than_the_file_spills(#[case] rows: i64, #[case] spills: bool) {
    use kda_tpu::hlo::TensorType;
    use kda_tpu::lang::{KernelBuilder, Mosaic, Operand, Reduction, Semantics, Unary};
    let (tpu, dir) = listing_compiler();
    let mut kb = KernelBuilder::new("kda_spill_probe");
    kb.grid(1, Semantics::Parallel);
    let ty = TensorType::new(DType::F32, &[rows, 128]);
    let x = kb.input(Operand::whole("x", ty.clone()));
    let o = kb.output(Operand::whole("o", ty));
    let kernel = kb
        .build(|b| {
            let x = b.load_all(x)?;
            let e = b.unary(Unary::Exp2, &x)?;
            let sum = b.reduce(Reduction::Sum, &e, 0)?;
            let sum = b.reshape(&sum, &[1, 128])?;
            let sum = b.broadcast(&sum, &[rows, 128])?;
            let y = b.mul(&e, &sum)?;
            b.store_all(o, &y)
        })
        .expect("the probe builds");
    let text = kernel.module(&Mosaic).expect("its Mosaic module");
    let report = tpu.compile(&text, DEFAULT_TOPOLOGY).expect("tpu7x compile");
    let c = report.static_cycles.expect("a static cycle count");
    let u = c.per_kernel["kda_spill_probe"].units;
    eprintln!("{rows} rows: {u:?}");
    assert_eq!(u.spill_stores > 0, spills, "{rows} rows: {u:?}");
    assert!(u.spill_loads >= u.spill_stores, "{u:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The fused forward+VJP on the Mosaic kernels (bf16, the primary shape, fixed and with four
/// segments): three kernels (the forward, the backward, the masks they share) within the
/// scoped VMEM they ask for; the peak below the XLA fused programs' (49.2 MB fixed, 60.5 MB
/// packed, remat: the lower of the two strategies) and so below the seed's 64.0 / 97.7 MB;
/// static cycles at most two thirds of tokamax's 186 k fixed (124 k), and with four segments
/// no more than before the backward's one-product chain (151.4 k; two thirds of tokamax's
/// 361 k is 240 k). H=32, T=8192 in `full`.
#[test]
fn static_cycles_and_peaks_of_the_fused_kernels() {
    for (name, peak_mb, cycles) in [("bench_primary", 49.2, 124_000), ("bench_primary_packed", 60.5, 151_400)]
    {
        fused_kernels_hold(name, peak_mb, cycles);
    }
}

/// The fused forward+VJP (bf16) compiles for v5e, whose default scoped VMEM (16 MiB) is the
/// smallest, within what its kernels ask for (`BackwardSteps::vmem_limit`,
/// `KernelDims::vmem_limit`). H=32, T=8192 (the forward's thirty-two-chunk steps with its
/// terms) in `full`.
#[test]
fn fused_kernels_compile_for_v5e() {
    fused_compiles_for_v5e("bench_primary");
}

/// `Tuning::with_step_chunks(8)`, the faster compile (docs/kda.md, Compile time), gives both
/// kernels of the fused program at the primary shape eight chunks a grid step where their
/// defaults take sixteen: each hands libtpu about half the Mosaic text a step. Text only: no
/// libtpu loads.
#[test]
fn eight_chunk_steps_halve_the_kernels_text() {
    let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
    let valu = |steps: Option<usize>| {
        let spec = bench_spec(&cpu, "bench_primary", true, |t| {
            let t = t.with_implementation(kda_tpu::Implementation::Mosaic);
            steps.map_or(t, |n| t.with_step_chunks(n))
        });
        let text = kda_tpu::op::program(&spec, ProgramKind::Fused(S::SavedState)).expect("program");
        let texts = kda_tpu::aot::mosaic_text::kernel_texts(&text).expect("the program's Mosaic kernels");
        texts.iter().map(|(n, t)| (n.clone(), kda_tpu::aot::mosaic_text::count(n, t).valu)).collect()
    };
    let (default, eight): (BTreeMap<String, u64>, BTreeMap<String, u64>) = (valu(None), valu(Some(8)));
    for name in ["kda_forward", "kda_backward"] {
        let r = eight[name] as f64 / default[name] as f64;
        eprintln!(
            "{name}: {} vector ALU ops a step by default, {} in eight-chunk steps",
            default[name], eight[name]
        );
        assert!((0.45..=0.55).contains(&r), "{name}: eight-chunk steps hold {r:.3}x the default's text");
    }
}

fn fused_compiles_for_v5e(name: &str) {
    let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
    let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
    let spec = bench_spec(&cpu, name, true, |t| t.with_implementation(kda_tpu::Implementation::Mosaic));
    let text = kda_tpu::op::program(&spec, ProgramKind::Fused(S::SavedState)).expect("program");
    let report = tpu.compile(&text, "v5e:2x2").expect("v5e compile");
    let vmem = &report.kernel_vmem_bytes;
    eprintln!("{name} mosaic fused bf16 on v5e:2x2: kernel VMEM {vmem:?} B");
    let most = kda_tpu::op::tpu_kernels::dims::TERMS_VMEM_BYTES as u64;
    assert!(vmem.iter().all(|&b| b <= most) && vmem.len() == 3, "kernel VMEM {vmem:?} B");
}

/// The fused saved-state forward+VJP of benchmark case `name` on the Mosaic kernels (bf16,
/// tpu7x) peaks at most at `peak_mb` and counts at most `cycles` static cycles.
fn fused_kernels_hold(name: &str, peak_mb: f64, cycles: u64) {
    let (tpu, dir) = listing_compiler();
    let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
    let spec = bench_spec(&cpu, name, true, |t| t.with_implementation(kda_tpu::Implementation::Mosaic));
    let text = kda_tpu::op::program(&spec, ProgramKind::Fused(S::SavedState)).expect("program");
    let report = tpu.compile(&text, DEFAULT_TOPOLOGY).expect("tpu7x compile");
    let (m, vmem) = (&report.memory, &report.kernel_vmem_bytes);
    let peak = m.peak_bytes as f64 / MB;
    let c = report.static_cycles.expect("a static cycle count");
    eprintln!(
        "{name} mosaic fused bf16 on {DEFAULT_TOPOLOGY}: peak {peak:.2} MB, kernel VMEM {vmem:?} B, {c:?}"
    );
    // The Mosaic text each kernel hands libtpu, in vector-register ops a grid step: the basis
    // of docs/kernels/static-cycles.md's per-chunk figures (sixteen chunks a step here).
    let texts = kda_tpu::aot::mosaic_text::kernel_texts(&text).expect("the program's Mosaic kernels");
    assert_eq!(texts.len(), 3, "forward, backward and their masks kernel");
    for (name, body) in &texts {
        let t = kda_tpu::aot::mosaic_text::count(name, body);
        eprintln!("{name} mosaic fused bf16, Mosaic text a grid step: {t:?}");
        assert!(c.per_kernel.contains_key(name.as_str()), "{name}: no share of the listing's bundles");
        assert!(t.valu > 0 && t.stores > 0, "{t:?}");
        if name != "kda_term_masks" {
            assert!(t.products > 0 && t.transcendental > 0 && t.conversions > 0 && t.loads > 0, "{t:?}");
        }
    }
    assert_eq!(vmem.len(), 3, "forward, backward and their masks kernel");
    // The forward and backward kernels hold blocks in scoped VMEM, within the most either asks
    // for (the backward's sixteen-chunk steps, the forward's with its terms); libtpu may give
    // the one-step masks kernel none (at H=32 with the lower-bound gate's three levels).
    let most = kda_tpu::op::tpu_kernels::dims::TERMS_VMEM_BYTES as u64;
    assert!(vmem.iter().all(|&b| b <= most), "kernel VMEM {vmem:?} B");
    assert!(vmem.iter().filter(|&&b| b > 0).count() >= 2, "kernel VMEM {vmem:?} B");
    assert!(peak <= peak_mb, "{name}: tpu7x peak {peak:.2} MB above {peak_mb} MB");
    assert!(c.kernels > 0 && c.total <= cycles, "{name}: {c:?} over {cycles} cycles");
    std::fs::remove_dir_all(&dir).ok();
}

/// A packed row without per-segment states costs at most `ratio` times the static cycles of
/// the fixed row of the same tokens on the Mosaic kernels (bf16, tpu7x; read as whole blocks
/// with segment masks, docs/kernels/packed-rows.md), with no loop of run-time trip count, forward and fused
/// saved-state: at the primary shape with four segments here (1.11x and 1.08x); in `full` at
/// H=32, T=8192 with 25 segments and at T=32,768 with 100 (at most 1.15x) and with 1,000
/// segments of 1 to 64 tokens (at most 1.5x).
#[rstest]
#[case::primary_forward(
    "bench_primary",
    "bench_primary_packed",
    ProgramKind::Forward(S::Rematerialize),
    1.15
)]
#[case::primary_fused("bench_primary", "bench_primary_packed", ProgramKind::Fused(S::SavedState), 1.15)]
fn packed_rows_cost_what_fixed_rows_cost(
    #[case] fixed: &str,
    #[case] packed: &str,
    #[case] kind: ProgramKind,
    #[case] ratio: f64,
) {
    packed_within(fixed, packed, kind, ratio);
}

/// The static cycles of program `kind` of benchmark case `name` on the Mosaic kernels (bf16,
/// tpu7x), which has no loop of run-time trip count.
fn mosaic_cycles(tpu: &TpuCompiler, cpu: &PjrtBackend, name: &str, kind: ProgramKind) -> StaticCycles {
    let spec = bench_spec(cpu, name, true, |t| t.with_implementation(kda_tpu::Implementation::Mosaic));
    let text = kda_tpu::op::program(&spec, kind).expect("program");
    let report = tpu.compile(&text, DEFAULT_TOPOLOGY).expect("tpu7x compile");
    let c = report.static_cycles.expect("a static cycle count");
    eprintln!("{name} mosaic {kind:?} bf16: {c:?}");
    assert_eq!(c.unknown_loops, 0, "{name}: loops of run-time trip count");
    c
}

fn packed_within(fixed: &str, packed: &str, kind: ProgramKind, ratio: f64) {
    let (tpu, dir) = listing_compiler();
    let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
    let count = |name: &str| mosaic_cycles(&tpu, &cpu, name, kind).total;
    let (f, p) = (count(fixed), count(packed));
    let r = p as f64 / f as f64;
    eprintln!("{packed}: {r:.3}x {fixed}");
    assert!(r <= ratio, "{packed}: {p} static cycles, {r:.3}x {fixed}'s {f} (at most {ratio}x)");
    std::fs::remove_dir_all(&dir).ok();
}

/// The remaining programs of the two tables above (`cargo xtask test --full`): the XLA forward
/// packed and the rematerializing fused programs, and the Mosaic forward and fused forward+VJP
/// at H=32, T=8192.
mod full {
    use super::*;

    #[rstest]
    #[case::forward_packed("bench_primary_packed", ProgramKind::Forward(S::Rematerialize), None)]
    #[case::fused_remat_fixed("bench_primary", ProgramKind::Fused(S::Rematerialize), Some(80.0))]
    #[case::fused_remat_packed("bench_primary_packed", ProgramKind::Fused(S::Rematerialize), Some(110.0))]
    fn primary_program_compiles_for_tpu7x(
        #[case] name: &str,
        #[case] kind: ProgramKind,
        #[case] limit_mb: Option<f64>,
    ) {
        xla_program_compiles(name, kind, limit_mb);
    }

    #[rstest]
    #[case::secondary_forward("bench_secondary", "bench_secondary_packed", FORWARD, 1.15)]
    #[case::secondary_fused("bench_secondary", "bench_secondary_packed", FUSED, 1.15)]
    #[case::long_forward("bench_long", "bench_long_packed", FORWARD, 1.15)]
    #[case::long_fused("bench_long", "bench_long_packed", FUSED, 1.15)]
    #[case::short_segments_forward("bench_long", "bench_long_short_segments", FORWARD, 1.5)]
    #[case::short_segments_fused("bench_long", "bench_long_short_segments", FUSED, 1.5)]
    fn packed_rows_cost_what_fixed_rows_cost_at_length(
        #[case] fixed: &str,
        #[case] packed: &str,
        #[case] kind: ProgramKind,
        #[case] ratio: f64,
    ) {
        packed_within(fixed, packed, kind, ratio);
    }

    const FORWARD: ProgramKind = ProgramKind::Forward(S::Rematerialize);
    const FUSED: ProgramKind = ProgramKind::Fused(S::SavedState);

    /// The forward on packed rows read with segment masks at H=32, T=8192 (thirty-two chunks a
    /// step) compiles for v5e within the scoped VMEM its kernel asks for (`SEGMENT_VMEM_BYTES`;
    /// it takes close to v5e's 16 MiB default).
    #[test]
    fn packed_forward_compiles_for_v5e() {
        let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
        let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
        let spec = bench_spec(&cpu, "bench_secondary_packed", true, |t| {
            t.with_implementation(kda_tpu::Implementation::Mosaic)
        });
        let text = kda_tpu::op::program(&spec, FORWARD).expect("program");
        let report = tpu.compile(&text, "v5e:2x2").expect("v5e compile");
        let vmem = &report.kernel_vmem_bytes;
        let most = kda_tpu::op::tpu_kernels::dims::SEGMENT_VMEM_BYTES as u64;
        assert!(vmem.iter().all(|&b| b <= most) && vmem.iter().any(|&b| b > 0), "kernel VMEM {vmem:?} B");
    }

    /// The fused forward+VJP on the kernels at H=32, T=8192: at most tokamax's Pallas peak
    /// (2421 MB fixed, 3251 MB with 25 segments); static cycles at most two thirds of
    /// tokamax's 6.62 M fixed (4.41 M), and with 25 segments no more than before the kernels'
    /// vector work was cut (6.114 M; two thirds of tokamax's is 6.70 M).
    #[rstest]
    #[case::fixed("bench_secondary", 2421.0, 4_410_000)]
    #[case::packed("bench_secondary_packed", 3251.0, 6_114_000)]
    fn mosaic_fused_at_h32_holds_tokamax(#[case] name: &str, #[case] peak_mb: f64, #[case] cycles: u64) {
        fused_kernels_hold(name, peak_mb, cycles);
    }

    /// The Mosaic forward at H=32, T=8192 with 25 segments: no more static cycles than before
    /// the kernels' vector work was cut (2.126 M; two thirds of tokamax's is 2.65 M).
    #[test]
    fn mosaic_forward_with_segments_at_h32_holds() {
        let (tpu, dir) = listing_compiler();
        let cpu = PjrtBackend::new().expect("PJRT CPU plugin (run `cargo xtask setup`)");
        let c = mosaic_cycles(&tpu, &cpu, "bench_secondary_packed", FORWARD);
        assert!(c.kernels > 0 && c.total <= 2_126_000, "{c:?} over 2,126,000 cycles");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The fused forward+VJP at H=32, T=8192 compiles for v5e: the forward's thirty-two-chunk
    /// steps with its terms ask for more than the default scoped VMEM (`TERMS_VMEM_BYTES`).
    #[test]
    fn fused_kernels_compile_for_v5e_at_h32() {
        super::fused_compiles_for_v5e("bench_secondary");
    }
}
