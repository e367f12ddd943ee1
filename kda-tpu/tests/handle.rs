//! The handle's guarantees: shared by threads, device-resident calls, typed device tensors,
//! errors that keep their cause, a poisoned handle after a panic, and bounded memory over many
//! calls. Inputs are two cases of the shared table (fixed batch-first, packed rows), so their
//! programs are the conformance suite's.

use std::sync::Arc;

use kda_core::{BackwardStrategy, Cotangents, DType, ErrorKind, KdaError, KdaGradients, KdaOutputs};
use kda_testkit::{case, case_data, CaseData};
use kda_tpu::{DeviceCotangents, Implementation, PjrtBackend, TpuError, TransferStats};
use rstest::rstest;

fn backend() -> PjrtBackend {
    PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`, then `eval \"$(cargo xtask env)\"`)")
}

fn data(name: &str, dtype: DType) -> CaseData {
    case_data(&case(name).expect("case in the table"), dtype).expect("case data")
}

type Run = (KdaOutputs, KdaGradients);

/// One call of the host API: fused, or split (forward then backward) with `strategy`.
fn host_call(be: &PjrtBackend, d: &CaseData, strategy: BackwardStrategy, fused: bool) -> Run {
    if fused {
        be.forward_and_vjp(&d.inputs, &d.cotangents, strategy).expect("fused call")
    } else {
        let (out, res) = be.forward(&d.inputs, strategy).expect("forward");
        (out, be.backward(&res, &d.cotangents).expect("backward"))
    }
}

#[test]
fn handle_residuals_and_tensors_are_send_and_sync() {
    fn send_sync<T: Send + Sync + Clone + 'static>() {}
    send_sync::<PjrtBackend>();
    send_sync::<kda_tpu::DeviceTensor>();
    send_sync::<kda_tpu::PjrtResiduals>();
    send_sync::<kda_tpu::DeviceProgram>();
}

/// 8 threads share one handle, each with its own inputs (fixed and packed, f32 and bf16),
/// strategies mixed, fused and split; the split calls run their backward on another thread
/// than their forward. Every result is bitwise equal to the same call made alone.
#[test]
fn eight_threads_on_one_handle_match_calls_made_alone_bitwise() {
    let be = backend();
    let cases = ["fixed_batch_first_b2", "packed_rows_differ"];
    let jobs: Vec<(usize, &str, DType, BackwardStrategy)> = (0..8)
        .map(|i| {
            let strategy =
                if i % 3 == 0 { BackwardStrategy::Rematerialize } else { BackwardStrategy::SavedState };
            (i, cases[i % 2], if i % 4 < 2 { DType::F32 } else { DType::BF16 }, strategy)
        })
        .collect();
    let inputs: Vec<Arc<CaseData>> =
        jobs.iter().map(|&(_, name, dtype, _)| Arc::new(data(name, dtype))).collect();
    let alone: Vec<Run> =
        jobs.iter().zip(&inputs).map(|(&(i, _, _, s), d)| host_call(&be, d, s, i % 2 == 0)).collect();

    // Split calls: forwards on these threads, backwards on the next thread over.
    let (tx, rx) = std::sync::mpsc::channel();
    let mut handles = Vec::new();
    for (&(i, _, _, strategy), d) in jobs.iter().zip(&inputs) {
        let (be, d, tx) = (be.clone(), d.clone(), tx.clone());
        handles.push(std::thread::spawn(move || {
            let mut runs = Vec::new();
            for _ in 0..3 {
                runs.push(host_call(&be, &d, strategy, true));
            }
            let (out, res) = be.forward(&d.inputs, strategy).expect("forward");
            tx.send((i, out, res)).expect("send residuals");
            runs
        }));
    }
    drop(tx);
    let mut split = Vec::new();
    for (i, out, res) in rx {
        let (be, cot): (PjrtBackend, Cotangents) = (be.clone(), inputs[i].cotangents.clone());
        split.push(std::thread::spawn(move || (i, out, be.backward(&res, &cot).expect("backward"))));
    }
    for (&(i, name, dtype, strategy), h) in jobs.iter().zip(handles) {
        for run in h.join().expect("thread") {
            let fused_alone = host_call(&be, &inputs[i], strategy, true);
            assert!(
                run == fused_alone,
                "{name} {dtype} {strategy:?}: a threaded fused call differs from one alone"
            );
        }
    }
    for h in split {
        let (i, out, grads) = h.join().expect("thread");
        let (_, name, dtype, strategy) = jobs[i];
        let want = if i % 2 == 0 { host_call(&be, &inputs[i], strategy, false) } else { alone[i].clone() };
        assert!(
            out == want.0 && grads == want.1,
            "{name} {dtype} {strategy:?}: a threaded split call differs"
        );
    }
}

/// The device-resident loop: inputs uploaded once, `do = o` taken on the device, residuals
/// and gradients left there. After the first step only index tables cross, nothing comes
/// back, and the only device-side reshapes are in the backward, between the forms the programs
/// declare: in XLA's programs `o` (returned 2-D) read as `do`; the kernel programs take
/// batch-first tensors as `[B*T, H*D]` throughout (the form they are uploaded in and `o` comes
/// in), so that they reshape nothing. The results equal the host API's bitwise.
#[rstest]
#[case::fixed("fixed_batch_first_b2", Implementation::Xla, 1)]
#[case::packed("packed_rows_differ", Implementation::Xla, 1)]
#[case::fixed_kernels("fixed_batch_first_b2", Implementation::Interpret, 0)]
fn device_loop_moves_index_tables_once(
    #[case] name: &str,
    #[case] implementation: Implementation,
    #[case] reshapes: u64,
) {
    let be = backend();
    let be = be.clone().with_tuning(be.tuning().with_implementation(implementation)).expect("implementation");
    let d = data(name, DType::F32);
    let x = be.to_device(&d.inputs, 0).expect("upload");
    let mut crossed = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let before = be.transfer_stats();
        let (out, res) = be.forward(&x, BackwardStrategy::SavedState).expect("forward");
        // The forward reads the uploaded inputs as they are held.
        assert_eq!(be.transfer_stats().since(before).reshapes, 0, "reshapes in the forward");
        let cot = DeviceCotangents { d_o: out.o.clone(), dht: None };
        let grads = be.backward(&res, &cot).expect("backward");
        crossed.push(be.transfer_stats().since(before));
        last = Some((out, grads));
    }
    let p = d.inputs.validate().expect("valid");
    let spec = be.spec(&p, false).expect("spec");
    let tables: u64 = kda_tpu::op::index_tables_for(&spec, &p.segments)
        .expect("tables")
        .iter()
        .map(|t| 4 * t.data.len() as u64)
        .sum();
    for (step, c) in crossed.iter().enumerate() {
        assert_eq!(
            *c,
            TransferStats {
                to_device: if step == 0 { tables } else { 0 },
                to_host: 0,
                executions: 2,
                reshapes
            },
            "step {step}: only the index tables may cross, once (the handle keeps them)"
        );
    }
    // The same step through host tensors gives the same bits.
    let (out, grads) = last.expect("three steps");
    let host_out = be.to_host(&out.o).expect("o");
    let cot = Cotangents { d_o: host_out.clone(), dht: None };
    let (want_out, res) = be.forward(&d.inputs, BackwardStrategy::SavedState).expect("forward");
    let want = be.backward(&res, &cot).expect("backward");
    assert_eq!(host_out, want_out.o);
    assert_eq!(
        host_out.shape(),
        d.inputs.q.shape()[..3].iter().chain([&d.inputs.v.shape()[3]]).copied().collect::<Vec<_>>()
    );
    assert_eq!(be.to_host(&grads.dq).expect("dq"), want.dq);
    assert_eq!(be.to_host(&grads.dg).expect("dg"), want.dg);
    assert_eq!(be.to_host(&grads.dbeta).expect("dbeta"), want.dbeta);
}

#[test]
fn tensor_of_another_handle_is_a_typed_error() {
    let (a, b) = (backend(), backend());
    let d = data("fixed_batch_first_b2", DType::F32);
    let x = a.to_device(&d.inputs, 0).expect("upload");
    let err = b.forward(&x, BackwardStrategy::SavedState).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Value, "{err}");
    assert!(err.to_string().contains("another handle") || err.to_string().contains("handle"), "{err}");
    assert_eq!(err.arg(), "q");
}

#[test]
fn device_inputs_are_checked_for_dtype_and_layout() {
    let be = backend();
    let d = data("fixed_batch_first_b2", DType::F32);
    let x = be.to_device(&d.inputs, 0).expect("upload");
    // beta must be in q's dtype on the device.
    let bf16_beta = be.to_device(&d.inputs.beta.cast(DType::BF16).expect("float cast"), 0).expect("upload");
    let bad = kda_tpu::DeviceInputs { beta: bf16_beta, ..x.clone() };
    let err = be.forward(&bad, BackwardStrategy::SavedState).unwrap_err();
    assert_eq!((err.kind(), err.arg()), (ErrorKind::DType, "beta"), "{err}");
    // A tensor tagged with the other layout.
    let head_first = x.q.with_layout(kda_core::Layout::HeadFirst);
    let err = be
        .forward(&kda_tpu::DeviceInputs { q: head_first, ..x.clone() }, BackwardStrategy::SavedState)
        .unwrap_err();
    assert_eq!((err.kind(), err.arg()), (ErrorKind::Value, "q"), "{err}");
    // Cotangents in another dtype than q.
    let (out, res) = be.forward(&x, BackwardStrategy::SavedState).expect("forward");
    let d_o = be
        .to_device(&be.to_host(&out.o).expect("o").cast(DType::BF16).expect("float cast"), 0)
        .expect("upload");
    let err = be.backward(&res, &DeviceCotangents { d_o, dht: None }).unwrap_err();
    assert_eq!((err.kind(), err.arg()), (ErrorKind::DType, "do"), "{err}");
}

/// A compile failure comes back as a `Backend` error whose source is the plugin's
/// `TpuError::Compile`, which a caller can match on.
#[test]
fn compile_failure_keeps_its_cause() {
    let be = backend();
    let err: KdaError =
        be.compile_program("module { func.func public @main() -> () { frobnicate } }").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backend);
    let source = std::error::Error::source(&err).expect("a source");
    assert!(matches!(source.downcast_ref::<TpuError>(), Some(TpuError::Compile { .. })), "{source:?}");
}

/// A panic on the worker reaches its caller as an error, and the handle, its clones and its
/// tensors then refuse every call (no hang).
#[test]
fn worker_panic_is_an_error_then_the_handle_is_poisoned() {
    let be = backend();
    let d = data("fixed_batch_first_b2", DType::F32);
    let t = be.to_device(&d.inputs.q, 0).expect("upload");
    let clone = be.clone();
    let err = kda_tpu::backend::testing::inject_worker_panic(&be).unwrap_err();
    let source = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<TpuError>());
    assert!(matches!(source, Some(TpuError::Panic { .. })), "{err}");
    for e in [
        clone.to_host(&t).unwrap_err(),
        clone.to_device(&d.inputs.k, 0).unwrap_err(),
        be.forward_and_vjp(&d.inputs, &d.cotangents, BackwardStrategy::SavedState).unwrap_err(),
    ] {
        let source = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<TpuError>());
        assert!(matches!(source, Some(TpuError::Poisoned { .. })), "{e}");
    }
    // A fresh handle works.
    backend().to_device(&d.inputs.q, 0).expect("a new handle");
}

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|x| x.parse().ok()).expect("resident pages");
    pages * 4096
}

/// 500 fused calls through the host API, host-memory tuning off: resident memory grows at
/// most 16 MiB from call 100 to call 500 (no per-call leak of buffers, programs or tensors).
#[test]
fn soak_500_fused_calls_keep_resident_memory_flat() {
    let be = backend();
    let d = data("packed_rows_differ", DType::F32);
    let mut at_100 = 0;
    for call in 1..=500 {
        let r = be.forward_and_vjp(&d.inputs, &d.cotangents, BackwardStrategy::SavedState).expect("call");
        drop(r);
        if call == 100 {
            at_100 = resident_bytes();
        }
    }
    let growth = resident_bytes().saturating_sub(at_100);
    eprintln!("resident memory growth from call 100 to 500: {:.2} MiB", growth as f64 / (1 << 20) as f64);
    assert!(growth <= 16 << 20, "resident memory grew {growth} bytes from call 100 to call 500");
}

/// The fields of every `kda_call` span, as a subscriber sees them.
#[derive(Default, Clone)]
struct Spans(Arc<std::sync::Mutex<Vec<String>>>);

struct Fields<'a>(&'a mut String);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={:?}", field.name(), value));
    }
}

impl<S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>>
    tracing_subscriber::Layer<S> for Spans
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() == "kda_call" {
            let mut line = String::new();
            attrs.record(&mut Fields(&mut line));
            self.0.lock().expect("lock").push(line);
        }
    }
    fn on_record(
        &self,
        _: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut spans = self.0.lock().expect("lock");
        if let Some(last) = spans.last_mut() {
            values.record(&mut Fields(last));
        }
    }
}

/// Forward, backward and fused calls each open a `kda_call` span naming the program kind,
/// strategy, shape, dtype and whether the program was already compiled.
#[test]
fn calls_trace_kind_shape_dtype_strategy_and_cache() {
    use tracing_subscriber::layer::SubscriberExt;
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    let be = backend();
    let d = data("fixed_batch_first_b2", DType::F32);
    tracing::subscriber::with_default(subscriber, || {
        let (_, res) = be.forward(&d.inputs, BackwardStrategy::Rematerialize).expect("forward");
        be.backward(&res, &d.cotangents).expect("backward");
        be.forward_and_vjp(&d.inputs, &d.cotangents, BackwardStrategy::SavedState).expect("fused");
        be.forward_and_vjp(&d.inputs, &d.cotangents, BackwardStrategy::SavedState).expect("fused again");
    });
    let spans = spans.0.lock().expect("lock").clone();
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let want = [
        ("forward", "Forward(Rematerialize)", "remat", "miss"),
        ("backward", "Backward(Rematerialize)", "remat", "miss"),
        ("fused", "Fused(SavedState)", "saved-state", "miss"),
        ("fused", "Fused(SavedState)", "saved-state", "hit"),
    ];
    for (span, (op, kind, strategy, cache)) in spans.iter().zip(want) {
        for field in [
            format!("op={op:?}"),
            format!("kind={kind}"),
            format!("strategy={strategy:?}"),
            "shape=H2 B2 T130 K32 V24 N1".to_string(),
            "dtype=f32".to_string(),
            format!("cache={cache:?}"),
        ] {
            assert!(span.contains(&field), "{field} not in{span}");
        }
    }
}

/// The Mosaic implementation compiles through libtpu only: on the CPU plugin it is an
/// `Unsupported` error naming the platform, from the options and from a handle alike, and
/// interpret runs there.
#[test]
fn mosaic_needs_a_tpu_plugin() {
    use kda_tpu::{Implementation, PjrtOptions};
    let mosaic = kda_tpu::Tuning::default().with_implementation(Implementation::Mosaic);
    let err = PjrtOptions::new().tuning(mosaic).build().expect_err("no TPU here");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err:?}");
    assert!(err.to_string().contains("platform is cpu"), "{err}");
    let be = PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)");
    let err = be.clone().with_tuning(mosaic).expect_err("no TPU here");
    assert!(err.to_string().contains("platform is cpu"), "{err}");
    let interpret =
        be.with_tuning(mosaic.with_implementation(Implementation::Interpret)).expect("any plugin");
    assert_eq!(interpret.tuning().implementation, Implementation::Interpret);
    assert_eq!(kda_core::Backend::name(&interpret), "pjrt-cpu-interpret");
}

/// A positive pre-activated log-decay at one token of a packed row is refused by every host
/// entry (forward, fused, upload) with its flat index, before anything runs; the same row with
/// every log-decay exactly 0 runs and meets the reference at the limits of docs/kda.md.
#[test]
fn positive_log_decay_in_a_packed_row_is_refused_and_zero_runs() {
    let be = backend();
    let base = case("packed_rows_differ").expect("case in the table");
    let mut d = case_data(&base, DType::F32).expect("case data");
    // Batch-first [B, T, H, K]: row 1, token 120 (its third segment), head 1, channel 5.
    let (t, h, k) = (base.t, base.h, base.k);
    let at = ((t + 120) * h + 1) * k + 5;
    let mut g = d.inputs.g.to_f64_vec();
    g[at] = 0.5;
    d.inputs.g = kda_core::HostTensor::from_f64_as(d.inputs.g.shape(), &g, DType::F32).expect("g");
    let before = be.transfer_stats();
    let errors = [
        be.forward(&d.inputs, BackwardStrategy::SavedState).map(drop).unwrap_err(),
        be.forward_and_vjp(&d.inputs, &d.cotangents, BackwardStrategy::Rematerialize).map(drop).unwrap_err(),
        be.to_device(&d.inputs, 0).map(drop).unwrap_err(),
    ];
    for err in &errors {
        assert_eq!((err.kind(), err.arg()), (ErrorKind::Value, "g"), "{err}");
        assert_eq!(err.got(), format!("0.5 at flat index {at}"), "{err}");
    }
    assert_eq!(be.transfer_stats().since(before).to_host, 0, "nothing came back");

    let no_decay = kda_testkit::Case {
        name: "packed_rows_differ_no_decay",
        profile: kda_testkit::Profile::NoDecay,
        ..base
    };
    assert!(case_data(&no_decay, DType::F32).expect("data").inputs.g.to_f64_vec().iter().all(|&x| x == 0.0));
    for strategy in [BackwardStrategy::SavedState, BackwardStrategy::Rematerialize] {
        let report = kda_testkit::conformance::backward_case(
            &be,
            &no_decay,
            DType::F32,
            strategy,
            kda_testkit::conformance::Path::Fused,
        );
        println!("{}", report.expect("g = 0 meets the reference"));
    }
}
