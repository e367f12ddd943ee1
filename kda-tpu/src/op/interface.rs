//! The one description of every KDA program's signature: which arguments it takes and which
//! results it returns, in order, with their types ([`ProgramSignature::of`]), and the host-side
//! index tables among those arguments ([`index_tables`]). The emitters in this module declare
//! their arguments from the signature and check their results against it, so a caller that
//! follows it (the runtime, or a program calling a KDA function, see [`super::compose`])
//! cannot drift from the program text.
//!
//! Arguments, in order (`L` lanes: `H*B` fixed, `H` packed; `NT` [`KernelSpec::chunks`];
//! `[..]` present only when the spec says so):
//!
//! | name | dtype | dims | when |
//! |------|-------|------|------|
//! | `q`, `k` | `dtype` | [`KernelSpec::token_dims`]`(K)` | always |
//! | `v` | `dtype` | `token_dims(V)` | always |
//! | `g` | `g_dtype` | `token_dims(K)` | always |
//! | `beta` | `dtype` | [`KernelSpec::beta_dims`] | always |
//! | `h0` | f32 | `[B, N, H, K, V]` | `has_h0` |
//! | `a_log` | f32 | `[H]` | in-kernel gate |
//! | `dt_bias` | f32 | `[H*K]` | in-kernel gate with `has_dt_bias` |
//! | `chunk_first`, `chunk_last`, `chunk_slot` | i32 | `[NT]` | always |
//! | `slot_token` | i32 | `[NT*64]` | packed |
//! | `token_slot` | i32 | `[B*T]` | packed |
//! | `h` | f32 | `[L, NT, K, V]` | `Backward(SavedState)` |
//! | `do` | `dtype` | `token_dims(V)` | backward and fused |
//! | `dht` | f32 | `[B, N, H, K, V]` | backward and fused with `has_dht` |
//!
//! `dtype` is read as bf16 for bf16 and as f32 otherwise (f64 host data travels as f32).
//! Results: the forward returns `o` (`dtype`), `[final_state]` (f32 `[B, N, H, K, V]`, with
//! `final_state`) and `[h]` (f32 `[L, NT, K, V]`, `Forward(SavedState)`); the backward `dq dk dv dg
//! dbeta [dh0] [da_log] [ddt_bias]` (each in its input's element type; `dh0` like `h0`,
//! `da_log` and `ddt_bias` f32); the fused program the forward's `o [final_state]` and then the
//! backward's results. Per-token results are 2-D: `o dq dk dv dg` are
//! [`KernelSpec::result_token_dims`] (`[H*B*T, D]`, or `[B*T, H*D]` batch-first in a kernel
//! forward) and `dbeta` `[H*B*T]`, holding the row-major elements of the caller's shape
//! (`token_dims(D)`, `beta_dims()`): a reshape gives that shape back. A forward run by a kernel
//! lowering ([`KernelSpec::kernel_forms`]) takes batch-first per-token arguments as `[B*T, H*D]`
//! and `beta` as `[B*T, H]` ([`KernelSpec::kernel_token_dims`], the caller's row-major
//! elements, the form a projection returns and the one a TPU reads a head's tokens from without
//! a relayout).
//!
//! The five index tables (`chunk_first` .. `token_slot`) come from [`index_tables`]: for fixed
//! length `chunk_first = [1, 0, ..]`, `chunk_last = [.., 0, 1]` and `chunk_slot = 0`; for packed
//! segments `kda-packed`'s static plan at the spec's capacity, with its `SENTINEL` entries
//! replaced by values the programs read as "nothing here" (segment 0, token `B*T`, slot
//! `NT*64`, one past the end).

use kda_core::{BackwardStrategy, DType, SegmentTable, Segments};
use kda_packed::{StaticCapacity, SENTINEL};

use super::spec::{on_device, KernelSpec, CHUNK};
use crate::hlo::TensorType;
use crate::{Result, TpuError};

/// Which program of a spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProgramKind {
    /// The forward for a backward strategy: `SavedState` also returns `h`, the state
    /// entering every chunk, for the saved-state backward.
    Forward(BackwardStrategy),
    /// Backward with a strategy.
    Backward(BackwardStrategy),
    /// Fused forward+VJP with a strategy.
    Fused(BackwardStrategy),
}

/// One argument or result of a program: its name (see the module docs) and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    /// `q`, `k`, `v`, `g`, `beta`, `h0`, `a_log`, `dt_bias`, `chunk_first`, `chunk_last`,
    /// `chunk_slot`, `slot_token`, `token_slot`, `h`, `do`, `dht` (arguments); `o`,
    /// `final_state`, `h`, `dq`, `dk`, `dv`, `dg`, `dbeta`, `dh0`, `da_log`, `ddt_bias` (results).
    pub name: &'static str,
    /// Element type and dims.
    pub ty: TensorType,
}

/// The arguments and results of one program of a spec, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramSignature {
    /// Arguments in call order.
    pub args: Vec<Port>,
    /// Results in return order.
    pub results: Vec<Port>,
}

fn port(name: &'static str, elem: DType, dims: &[i64]) -> Port {
    Port { name, ty: TensorType::new(elem, dims) }
}

impl ProgramSignature {
    /// The signature of program `kind` of `spec` (the table in the module docs).
    pub fn of(s: &KernelSpec, kind: ProgramKind) -> ProgramSignature {
        let e = on_device(s.dtype);
        let ge = on_device(s.g_dtype);
        let f32 = DType::F32;
        let i32 = DType::I32;
        let nt = s.chunks() as i64;
        let state = s.state_dims();
        let saved_h = [s.lanes() as i64, nt, s.k as i64, s.v as i64];
        let kernel_forms = s.kernel_forms();
        let tokens = |d: usize| if kernel_forms { s.kernel_token_dims(d) } else { s.token_dims(d) };
        let mut args = vec![
            port("q", e, &tokens(s.k)),
            port("k", e, &tokens(s.k)),
            port("v", e, &tokens(s.v)),
            port("g", ge, &tokens(s.k)),
            port("beta", e, &if kernel_forms { s.kernel_beta_dims() } else { s.beta_dims() }),
        ];
        if s.has_h0 {
            args.push(port("h0", f32, &state));
        }
        if s.in_kernel_gate() {
            args.push(port("a_log", f32, &[s.h as i64]));
            if s.has_dt_bias {
                args.push(port("dt_bias", f32, &[(s.h * s.k) as i64]));
            }
        }
        for name in ["chunk_first", "chunk_last", "chunk_slot"] {
            args.push(port(name, i32, &[nt]));
        }
        if s.packed_chunks.is_some() {
            args.push(port("slot_token", i32, &[nt * CHUNK as i64]));
            args.push(port("token_slot", i32, &[(s.b * s.t) as i64]));
        }
        // Per-token results are 2-D (and `dbeta` `[H*B*T]`): the row-major bytes of the
        // caller's shapes (a 4-D result with a unit axis made XLA copy it once more).
        let flat_k = s.result_token_dims(s.k, kernel_forms);
        let flat_v = s.result_token_dims(s.v, kernel_forms);
        let flat_beta = [s.beta_dims().iter().product::<i64>()];
        let mut results = Vec::new();
        let forward = |results: &mut Vec<Port>| {
            results.push(port("o", e, &flat_v));
            if s.final_state {
                results.push(port("final_state", f32, &state));
            }
        };
        let grads = |results: &mut Vec<Port>| {
            results.push(port("dq", e, &flat_k));
            results.push(port("dk", e, &flat_k));
            results.push(port("dv", e, &flat_v));
            results.push(port("dg", ge, &flat_k));
            results.push(port("dbeta", e, &flat_beta));
            if s.has_h0 {
                results.push(port("dh0", f32, &state));
            }
            if s.in_kernel_gate() {
                results.push(port("da_log", f32, &[s.h as i64]));
                if s.has_dt_bias {
                    results.push(port("ddt_bias", f32, &[(s.h * s.k) as i64]));
                }
            }
        };
        let cotangents = |args: &mut Vec<Port>| {
            args.push(port("do", e, &tokens(s.v)));
            if s.has_dht {
                args.push(port("dht", f32, &state));
            }
        };
        match kind {
            ProgramKind::Forward(strategy) => {
                let keep_h = strategy == BackwardStrategy::SavedState;
                forward(&mut results);
                if keep_h {
                    results.push(port("h", f32, &saved_h));
                }
            }
            ProgramKind::Backward(strategy) => {
                if strategy == BackwardStrategy::SavedState {
                    args.push(port("h", f32, &saved_h));
                }
                cotangents(&mut args);
                grads(&mut results);
            }
            ProgramKind::Fused(_) => {
                cotangents(&mut args);
                forward(&mut results);
                grads(&mut results);
            }
        }
        ProgramSignature { args, results }
    }

    /// The argument types in order (what a `func.call` passes).
    pub fn arg_types(&self) -> Vec<TensorType> {
        self.args.iter().map(|p| p.ty.clone()).collect()
    }

    /// The result types in order (what a `func.call` declares).
    pub fn result_types(&self) -> Vec<TensorType> {
        self.results.iter().map(|p| p.ty.clone()).collect()
    }

    /// The position of argument `name`, if the program takes it.
    pub fn arg_index(&self, name: &str) -> Option<usize> {
        self.args.iter().position(|p| p.name == name)
    }

    /// The position of result `name`, if the program returns it.
    pub fn result_index(&self, name: &str) -> Option<usize> {
        self.results.iter().position(|p| p.name == name)
    }
}

/// One host-side index table: an i32 argument of the programs, built on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexTable {
    /// The argument it fills (`chunk_first`, `chunk_last`, `chunk_slot`, `slot_token`,
    /// `token_slot`).
    pub name: &'static str,
    /// Its dims (as in [`ProgramSignature::of`]).
    pub dims: Vec<i64>,
    /// Row-major values.
    pub data: Vec<i32>,
}

/// The index tables of `spec`'s programs, in signature order: `chunk_first chunk_last
/// chunk_slot` for fixed length (where `segments` is not read and may be `None`), and
/// `slot_token token_slot` after them for a packed spec (whose `segments` must be given, with
/// `B` rows of `T` tokens and at most `N` segments each).
pub fn index_tables(spec: &KernelSpec, segments: Option<&Segments>) -> Result<Vec<IndexTable>> {
    let nt = spec.chunks();
    let table = |name: &'static str, dims: &[usize], data: Vec<i32>| IndexTable {
        name,
        dims: dims.iter().map(|&d| d as i64).collect(),
        data,
    };
    let Some(cap) = spec.packed_chunks else {
        let mut first = vec![0; nt];
        let mut last = vec![0; nt];
        first[0] = 1;
        last[nt - 1] = 1;
        return Ok(vec![
            table("chunk_first", &[nt], first),
            table("chunk_last", &[nt], last),
            table("chunk_slot", &[nt], vec![0; nt]),
        ]);
    };
    let segments = segments.ok_or_else(|| {
        TpuError::contract(kda_core::KdaError::missing(
            "segments",
            "a packed spec's tables need its segments",
        ))
    })?;
    let seg_table = segments.validate(spec.b, spec.t)?;
    packed_tables(spec, cap, &seg_table)
}

/// [`index_tables`] from segments already validated (a [`kda_core::Problem`]'s).
pub fn index_tables_for(spec: &KernelSpec, segments: &SegmentTable) -> Result<Vec<IndexTable>> {
    match spec.packed_chunks {
        None => index_tables(spec, None),
        Some(cap) => packed_tables(spec, cap, segments),
    }
}

fn packed_tables(spec: &KernelSpec, cap: usize, seg_table: &SegmentTable) -> Result<Vec<IndexTable>> {
    let nt = spec.chunks();
    let table = |name: &'static str, dims: &[usize], data: Vec<i32>| IndexTable {
        name,
        dims: dims.iter().map(|&d| d as i64).collect(),
        data,
    };
    let (b, t) = (spec.b, spec.t);
    let tables = StaticCapacity::new(b, t, spec.n, CHUNK)?.plan(seg_table)?.tables().clone();
    if tables.capacity != cap {
        return Err(TpuError::contract(kda_core::KdaError::shape(
            "segments",
            format!("a static capacity of {cap} chunks (the spec's)"),
            format!("{} chunks", tables.capacity),
        )));
    }
    let fix = |v: &[i32], sentinel: i32| -> Vec<i32> {
        v.iter().map(|&x| if x == SENTINEL { sentinel } else { x }).collect()
    };
    Ok(vec![
        table("chunk_first", &[nt], tables.chunk_first.clone()),
        table("chunk_last", &[nt], tables.chunk_last.clone()),
        table("chunk_slot", &[nt], fix(&tables.chunk_segment, 0)),
        table("slot_token", &[nt * CHUNK], fix(&tables.slot_token, (b * t) as i32)),
        table("token_slot", &[b * t], fix(&tables.token_slot, (nt * CHUNK) as i32)),
    ])
}

#[cfg(test)]
mod tests {
    use kda_core::{DType, GateKind, HostTensor, KdaInputs, Layout};

    use super::*;
    use crate::hlo::Module;
    use crate::op::compose::add_function;
    use crate::op::program;

    /// A small spec: 2 heads, 2 rows of 100 tokens (two chunks), K = 16, V = 8.
    fn base(packed: bool) -> KernelSpec {
        KernelSpec {
            h: 2,
            b: 2,
            t: 100,
            k: 16,
            v: 8,
            n: if packed { 3 } else { 1 },
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
            packed_chunks: if packed {
                Some(StaticCapacity::new(2, 100, 3, CHUNK).unwrap().chunks())
            } else {
                None
            },
            slab: 0,
            implementation: super::super::spec::Implementation::Xla,
            step_chunks: 0,
            packed_result_bytes: 0,
        }
    }

    /// Every spec variant the signature branches on.
    fn variants() -> Vec<KernelSpec> {
        let mut out = Vec::new();
        for packed in [false, true] {
            out.push(base(packed));
            out.push(KernelSpec { has_h0: true, final_state: true, has_dht: true, ..base(packed) });
            out.push(KernelSpec { gate: GateKind::Softplus, has_dt_bias: true, ..base(packed) });
            out.push(KernelSpec { gate: GateKind::LowerBound(-5.0), l2norm: true, ..base(packed) });
            out.push(KernelSpec {
                dtype: DType::BF16,
                g_dtype: DType::F32,
                layout: Layout::HeadFirst,
                beta_trailing_one: true,
                has_h0: true,
                has_dht: true,
                ..base(packed)
            });
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
                let spec = spec.clone().with_slab(slab);
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
        use super::super::spec::Implementation;
        for spec in variants() {
            for implementation in [Implementation::Mosaic, Implementation::Interpret] {
                let spec = spec.clone().with_implementation(implementation);
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
        let s = KernelSpec { has_h0: true, final_state: true, has_dht: true, ..base(true) };
        let s = KernelSpec { gate: GateKind::Softplus, has_dt_bias: true, ..s };
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
        let kernel = KernelSpec { implementation: crate::Implementation::Interpret, ..base(false) };
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
            let spec = base(true).with_slab(slab);
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
    fn backend_tables(inputs: &KdaInputs, spec: &KernelSpec) -> Vec<(Vec<i32>, Vec<i64>)> {
        let p = inputs.validate().unwrap();
        let d = &p.dims;
        let nt = spec.chunks();
        let mut out = Vec::new();
        if let Some(cap) = spec.packed_chunks {
            let tables = StaticCapacity::new(d.b, d.t, d.n, CHUNK)
                .unwrap()
                .plan(&p.segments)
                .unwrap()
                .tables()
                .clone();
            assert_eq!(tables.capacity, cap);
            let fix = |v: &[i32], sentinel: i32| -> Vec<i32> {
                v.iter().map(|&x| if x == SENTINEL { sentinel } else { x }).collect()
            };
            out.push((tables.chunk_first.clone(), vec![nt as i64]));
            out.push((tables.chunk_last.clone(), vec![nt as i64]));
            out.push((fix(&tables.chunk_segment, 0), vec![nt as i64]));
            out.push((fix(&tables.slot_token, (d.b * d.t) as i32), vec![(nt * CHUNK) as i64]));
            out.push((fix(&tables.token_slot, (nt * CHUNK) as i32), vec![(d.b * d.t) as i64]));
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
                Some(Segments::SegmentIds(vec![
                    vec![1; 70],
                    [vec![1; 30], vec![2; 30], vec![0; 10]].concat(),
                ])),
            ),
        ];
        for (b, t, segments) in cases {
            let x = inputs(b, t, segments.clone());
            let spec = KernelSpec::of_inputs(&x, false).unwrap();
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
                assert!(table.data.iter().all(|&v| v >= 0), "{}: no sentinel left", table.name);
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
        let spec = KernelSpec::of_inputs(&x, false).unwrap();
        assert!(index_tables(&spec, None).is_err());
    }
}
