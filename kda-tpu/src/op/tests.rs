//! The signature and the index tables checked against the programs that read them.

use kda_core::{BackwardStrategy, DType, GateKind, HostTensor, KdaInputs, Layout, ProblemDims, Segments};
use kda_packed::{StaticCapacity, SENTINEL};

use super::interface::*;
use super::spec::{OpOptions, ProgramSpec, Tuning, CHUNK};
use crate::hlo::{Module, TensorType};
use crate::op::compose::add_function;
use crate::op::program;

/// A small spec: 2 heads, 2 rows of 100 tokens (two chunks), K = 16, V = 8.
fn base(packed: bool) -> ProgramSpec {
    ProgramSpec {
        dims: ProblemDims { h: 2, b: 2, t: 100, k: 16, v: 8, n: if packed { 3 } else { 1 } },
        packed_chunks: if packed {
            Some(StaticCapacity::new(2, 100, 3, CHUNK).unwrap().chunks())
        } else {
            None
        },
        options: OpOptions {
            layout: Layout::BatchFirst,
            dtype: DType::F32,
            g_dtype: DType::F32,
            gate: GateKind::Preactivated,
            has_dt_bias: false,
            l2norm: false,
            scale: 0.25,
            beta_trailing_one: false,
            has_h0: false,
            final_state: false,
            has_dht: false,
        },
        tuning: Tuning::default().with_packed_result_bytes(0),
    }
}

/// `base(packed)` with its options changed by `f`.
fn with(packed: bool, f: impl FnOnce(&mut OpOptions)) -> ProgramSpec {
    let mut s = base(packed);
    f(&mut s.options);
    s
}

/// Every spec variant the signature branches on.
fn variants() -> Vec<ProgramSpec> {
    let mut out = Vec::new();
    for packed in [false, true] {
        out.push(base(packed));
        out.push(with(packed, |o| (o.has_h0, o.final_state, o.has_dht) = (true, true, true)));
        out.push(with(packed, |o| (o.gate, o.has_dt_bias) = (GateKind::Softplus, true)));
        out.push(with(packed, |o| (o.gate, o.l2norm) = (GateKind::LowerBound(-5.0), true)));
        out.push(with(packed, |o| {
            (o.dtype, o.g_dtype, o.layout) = (DType::BF16, DType::F32, Layout::HeadFirst);
            (o.beta_trailing_one, o.has_h0, o.has_dht) = (true, true, true);
        }));
    }
    out
}

fn kinds() -> Vec<ProgramKind> {
    use BackwardStrategy::*;
    vec![
        ProgramKind::Forward(BackwardStrategy::Rematerialize),
        ProgramKind::Forward(BackwardStrategy::SavedState),
        ProgramKind::Backward(SavedState),
        ProgramKind::Backward(Rematerialize),
        ProgramKind::Fused(SavedState),
        ProgramKind::Fused(Rematerialize),
    ]
}

/// The argument and result types of `@name` as the text declares them.
fn declared(text: &str, name: &str) -> (Vec<String>, Vec<String>) {
    let head = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("func.func") && l.contains(&format!(" @{name}(")))
        .unwrap_or_else(|| panic!("no @{name} in\n{text}"));
    let open = head.find('(').unwrap();
    let arrow = head.find(") -> (").unwrap();
    let params = &head[open + 1..arrow];
    let results = &head[arrow + 6..head.rfind(") {").unwrap()];
    let args = params.split(", ").map(|p| p.split_once(": ").unwrap().1.to_string()).collect();
    let results = results.split(", ").map(str::to_string).collect();
    (args, results)
}

fn strings(ports: &[Port]) -> Vec<String> {
    ports.iter().map(|p| p.ty.to_string()).collect()
}

#[test]
fn emitted_main_matches_the_signature() {
    let mut checked = 0;
    for spec in variants() {
        for slab in [0, 1] {
            let spec = spec.clone().with_tuning(spec.tuning.with_slab(slab));
            for kind in kinds() {
                let sig = ProgramSignature::of(&spec, kind);
                let text = program(&spec, kind).unwrap_or_else(|e| panic!("{kind:?} {spec:?}: {e}"));
                let (args, results) = declared(&text, "main");
                assert_eq!(args, strings(&sig.args), "{kind:?} arguments of {spec:?}");
                assert_eq!(results, strings(&sig.results), "{kind:?} results of {spec:?}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 10 * 2 * 6);
}

/// The forward programs around the Mosaic kernel (either lowering) keep the signature, and
/// only the Mosaic one holds a `tpu_custom_call`.
#[test]
fn kernel_forwards_match_the_signature() {
    use super::spec::Implementation;
    for spec in variants() {
        for implementation in [Implementation::Mosaic, Implementation::Interpret] {
            let spec = spec.clone().with_tuning(spec.tuning.with_implementation(implementation));
            for kind in [
                ProgramKind::Forward(BackwardStrategy::Rematerialize),
                ProgramKind::Forward(BackwardStrategy::SavedState),
            ] {
                let sig = ProgramSignature::of(&spec, kind);
                let text = program(&spec, kind).unwrap_or_else(|e| panic!("{kind:?} {spec:?}: {e}"));
                let (args, results) = declared(&text, "main");
                assert_eq!(args, strings(&sig.args), "{kind:?} arguments of {spec:?}");
                assert_eq!(results, strings(&sig.results), "{kind:?} results of {spec:?}");
                let mosaic = text.contains("tpu_custom_call");
                assert_eq!(mosaic, implementation == Implementation::Mosaic, "{implementation:?}");
            }
        }
    }
}

#[test]
fn signature_names_and_optional_ports() {
    let s = with(true, |o| {
        (o.has_h0, o.final_state, o.has_dht) = (true, true, true);
        (o.gate, o.has_dt_bias) = (GateKind::Softplus, true);
    });
    let sig = ProgramSignature::of(&s, ProgramKind::Backward(BackwardStrategy::SavedState));
    let names: Vec<&str> = sig.args.iter().map(|p| p.name).collect();
    assert_eq!(
        names,
        [
            "q",
            "k",
            "v",
            "g",
            "beta",
            "h0",
            "a_log",
            "dt_bias",
            "chunk_first",
            "chunk_last",
            "chunk_slot",
            "slot_token",
            "token_slot",
            "token_segment",
            "h",
            "do",
            "dht"
        ]
    );
    let names: Vec<&str> = sig.results.iter().map(|p| p.name).collect();
    assert_eq!(names, ["dq", "dk", "dv", "dg", "dbeta", "dh0", "da_log", "ddt_bias"]);
    let sig = ProgramSignature::of(&base(false), ProgramKind::Fused(BackwardStrategy::Rematerialize));
    let names: Vec<&str> = sig.results.iter().map(|p| p.name).collect();
    assert_eq!(names, ["o", "dq", "dk", "dv", "dg", "dbeta"]);
    assert_eq!(sig.arg_index("do"), Some(8));
    assert_eq!(sig.arg_index("h"), None);
    let sig = ProgramSignature::of(&base(false), ProgramKind::Forward(BackwardStrategy::SavedState));
    // Batch-first (H = 2, B = 2, T = 100, K = 16, V = 8): XLA's programs take the caller's
    // shapes and return `[B*T*H, D]`; kernel programs take and return `[B*T, H*D]`.
    assert_eq!(sig.results[0].ty, TensorType::new(DType::F32, &[400, 8]));
    assert_eq!(sig.args[0].ty, TensorType::new(DType::F32, &[2, 100, 2, 16]));
    assert_eq!(sig.results[1].ty, TensorType::new(DType::F32, &[4, 2, 16, 8]));
    let kernel =
        base(false).with_tuning(Tuning::default().with_implementation(crate::Implementation::Interpret));
    let sig = ProgramSignature::of(&kernel, ProgramKind::Forward(BackwardStrategy::SavedState));
    assert_eq!(sig.results[0].ty, TensorType::new(DType::F32, &[200, 16]));
    assert_eq!(sig.args[0].ty, TensorType::new(DType::F32, &[200, 32]));
    assert_eq!(sig.args[4].ty, TensorType::new(DType::F32, &[200, 2]));
    // The backward and fused programs on the kernels hold the same forms, `do` and the
    // gradients too.
    let sig = ProgramSignature::of(&kernel, ProgramKind::Fused(BackwardStrategy::SavedState));
    assert_eq!(sig.args[0].ty, TensorType::new(DType::F32, &[200, 32]));
    let d_o = sig.arg_index("do").expect("do");
    assert_eq!(sig.args[d_o].ty, TensorType::new(DType::F32, &[200, 16]));
    let dq = sig.results.iter().find(|p| p.name == "dq").expect("dq");
    assert_eq!(dq.ty, TensorType::new(DType::F32, &[200, 32]));
}

#[test]
fn add_function_emits_a_private_callee_with_the_signature() {
    for slab in [0, 1] {
        let spec = base(true).with_tuning(Tuning::default().with_slab(slab));
        let kind = ProgramKind::Fused(BackwardStrategy::SavedState);
        let mut m = Module::new();
        let sig = add_function(&mut m, "kda_vjp", &spec, kind).unwrap().signature;
        assert_eq!(sig, ProgramSignature::of(&spec, kind));
        let mut main = crate::hlo::FnBuilder::new("main", true);
        let args: Vec<_> = sig.args.iter().map(|p| main.arg(p.ty.clone()).unwrap()).collect();
        let outs = main.call("kda_vjp", &args, &sig.result_types()).unwrap();
        main.ret(&outs).unwrap();
        m.add(main).unwrap();
        let text = m.to_text();
        assert!(text.contains("func.func private @kda_vjp("), "slab {slab}");
        assert_eq!(text.matches("func.func ").count(), 2, "no helper functions besides the callee");
        assert_eq!(declared(&text, "kda_vjp"), declared(&text, "main"));
        // The function body is the program's: same text apart from the name and visibility.
        let own = program(&spec, kind).unwrap();
        let body = |t: &str, head: &str| -> String {
            let start = t.find(head).unwrap();
            let end = start + t[start..].find("\n  }\n").unwrap();
            t[start..end].split_once('\n').unwrap().1.to_string()
        };
        assert_eq!(body(&text, "@kda_vjp("), body(&own, "@main("), "slab {slab}");
        // A second function of that name is refused.
        assert!(add_function(&mut m, "kda_vjp", &spec, kind).is_err());
    }
}

/// The tables as `PjrtBackend::upload_inputs` builds them (a copy of its logic).
fn backend_tables(inputs: &KdaInputs, spec: &ProgramSpec) -> Vec<(Vec<i32>, Vec<i64>)> {
    let p = inputs.validate().unwrap();
    let d = &p.dims;
    let nt = spec.chunks();
    let mut out = Vec::new();
    if let Some(cap) = spec.packed_chunks {
        let tables =
            StaticCapacity::new(d.b, d.t, d.n, CHUNK).unwrap().plan(&p.segments).unwrap().tables().clone();
        assert_eq!(tables.capacity, cap);
        let fix = |v: &[i32], sentinel: i32| -> Vec<i32> {
            v.iter().map(|&x| if x == SENTINEL { sentinel } else { x }).collect()
        };
        out.push((tables.chunk_first.clone(), vec![nt as i64]));
        out.push((tables.chunk_last.clone(), vec![nt as i64]));
        out.push((fix(&tables.chunk_segment, 0), vec![nt as i64]));
        out.push((fix(&tables.slot_token, (d.b * d.t) as i32), vec![(nt * CHUNK) as i64]));
        out.push((fix(&tables.token_slot, (nt * CHUNK) as i32), vec![(d.b * d.t) as i64]));
        // Each token's segment slot, read from its chunk (-1 for padding tokens), spelled out.
        let segment: Vec<i32> = tables
            .token_slot
            .iter()
            .map(|&s| if s == SENTINEL { -1 } else { tables.chunk_segment[s as usize / CHUNK] })
            .collect();
        out.push((segment, vec![(d.b * d.t) as i64]));
    } else {
        let mut first = vec![0; nt];
        let mut last = vec![0; nt];
        first[0] = 1;
        last[nt - 1] = 1;
        out.push((first, vec![nt as i64]));
        out.push((last, vec![nt as i64]));
        out.push((vec![0; nt], vec![nt as i64]));
    }
    out
}

fn inputs(b: usize, t: usize, segments: Option<Segments>) -> KdaInputs {
    let x = |d: usize| HostTensor::zeros(&[b, t, 2, d], DType::F32);
    let x = KdaInputs::new(x(16), x(16), x(8), x(16), HostTensor::zeros(&[b, t, 2], DType::F32));
    match segments {
        Some(s) => x.with_segments(s),
        None => x,
    }
}

#[test]
fn index_tables_match_the_backend() {
    let cases = [
        (1, 100, None),
        (2, 200, None),
        (1, 64, None),
        (1, 300, Some(Segments::CuSeqlens(vec![vec![0, 120, 177, 300]]))),
        (2, 130, Some(Segments::CuSeqlens(vec![vec![0, 1, 64, 130], vec![0, 65, 65, 100]]))),
        (
            2,
            70,
            Some(Segments::SegmentIds(vec![vec![1; 70], [vec![1; 30], vec![2; 30], vec![0; 10]].concat()])),
        ),
    ];
    for (b, t, segments) in cases {
        let x = inputs(b, t, segments.clone());
        let spec = ProgramSpec::of_inputs(&x, false).unwrap();
        assert_eq!(spec.packed_chunks.is_some(), segments.is_some());
        let got = index_tables(&spec, x.segments.as_ref()).unwrap();
        let sig = ProgramSignature::of(&spec, ProgramKind::Forward(BackwardStrategy::Rematerialize));
        let want = backend_tables(&x, &spec);
        assert_eq!(got.len(), want.len());
        for (table, (data, dims)) in got.iter().zip(&want) {
            assert_eq!(&table.data, data, "{} of {segments:?}", table.name);
            assert_eq!(&table.dims, dims, "{}", table.name);
            let port = &sig.args[sig.arg_index(table.name).unwrap()];
            assert_eq!(port.ty, TensorType::new(DType::I32, dims), "{}", table.name);
            assert_eq!(table.data.len() as i64, dims.iter().product::<i64>());
            // No sentinel left (`token_segment` marks padding tokens -1).
            let least = if table.name == "token_segment" { -1 } else { 0 };
            assert!(table.data.iter().all(|&v| v >= least), "{}: no sentinel left", table.name);
        }
        // Index tables stand in signature order, right after the per-token inputs.
        let first = sig.arg_index("chunk_first").unwrap();
        for (i, table) in got.iter().enumerate() {
            assert_eq!(sig.args[first + i].name, table.name);
        }
        if spec.packed_chunks.is_some() {
            let (nt, bt) = (spec.chunks() as i32, (b * t) as i32);
            assert!(got[3].data.iter().all(|&v| v <= bt));
            assert!(got[4].data.iter().all(|&v| v <= nt * CHUNK as i32));
        }
    }
    // A packed spec needs its segments.
    let x = inputs(1, 300, Some(Segments::CuSeqlens(vec![vec![0, 120, 300]])));
    let spec = ProgramSpec::of_inputs(&x, false).unwrap();
    assert!(index_tables(&spec, None).is_err());
}
