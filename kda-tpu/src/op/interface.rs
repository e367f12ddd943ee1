//! The one description of every KDA program's signature: which arguments it takes and which
//! results it returns, in order, with their types ([`ProgramSignature::of`]), and the host-side
//! index tables among those arguments ([`index_tables`]). The emitters in this module declare
//! their arguments from the signature and check their results against it, so a caller that
//! follows it (the runtime, or a program calling a KDA function, see [`super::compose`])
//! cannot drift from the program text.
//!
//! Arguments, in order (`L` lanes: `H*B` fixed, `H` packed; `NT` [`ProgramSpec::chunks`];
//! `[..]` present only when the spec says so):
//!
//! | name | dtype | dims | when |
//! |------|-------|------|------|
//! | `q`, `k` | `dtype` | [`ProgramSpec::token_dims`]`(K)` | always |
//! | `v` | `dtype` | `token_dims(V)` | always |
//! | `g` | `g_dtype` | `token_dims(K)` | always |
//! | `beta` | `dtype` | [`ProgramSpec::beta_dims`] | always |
//! | `h0` | f32 | `[B, N, H, K, V]` | `has_h0` |
//! | `a_log` | f32 | `[H]` | in-kernel gate |
//! | `dt_bias` | f32 | `[H*K]` | in-kernel gate with `has_dt_bias` |
//! | `chunk_first`, `chunk_last`, `chunk_slot` | i32 | `[NT]` | always |
//! | `slot_token` | i32 | `[NT*64]` | packed |
//! | `token_slot` | i32 | `[B*T]` | packed |
//! | `token_segment` | i32 | `[B*T]` | packed |
//! | `h` | f32 | `[L, NT, K, V]` | `Backward(SavedState)` |
//! | `do` | `dtype` | `token_dims(V)` | backward and fused |
//! | `dht` | f32 | `[B, N, H, K, V]` | backward and fused with `has_dht` |
//!
//! `dtype` is read as bf16 for bf16 and as f32 otherwise (f64 host data travels as f32).
//! Results: the forward returns `o` (`dtype`), `[final_state]` (f32 `[B, N, H, K, V]`, with
//! `final_state`) and `[h]` (f32 `[L, NT, K, V]`, `Forward(SavedState)`); the backward `dq dk dv dg
//! dbeta [dh0] [da_log] [ddt_bias]` (each in its input's element type; `dh0` like `h0`,
//! `da_log` and `ddt_bias` f32); the fused program the forward's `o [final_state]` and then the
//! backward's results. `h` is the state entering every chunk of the plan; where the Mosaic
//! kernels read packed rows as whole 64-token blocks (no per-segment states), the state
//! entering each block, in its first `B*T/64` entries (the rest unused), which the same
//! implementation's backward reads. Per-token results are 2-D: `o dq dk dv dg` are
//! [`ProgramSpec::result_token_dims`] (`[H*B*T, D]`, or `[B*T, H*D]` batch-first in a kernel
//! forward) and `dbeta` `[H*B*T]`, holding the row-major elements of the caller's shape
//! (`token_dims(D)`, `beta_dims()`): a reshape gives that shape back. A forward run by a kernel
//! lowering ([`ProgramSpec::kernel_forms`]) takes batch-first per-token arguments as `[B*T, H*D]`
//! and `beta` as `[B*T, H]` ([`ProgramSpec::kernel_token_dims`], the caller's row-major
//! elements, the form a projection returns and the one a TPU reads a head's tokens from without
//! a relayout).
//!
//! The six index tables (`chunk_first` .. `token_segment`) come from [`index_tables`]: for fixed
//! length `chunk_first = [1, 0, ..]`, `chunk_last = [.., 0, 1]` and `chunk_slot = 0`; for packed
//! segments `kda-packed`'s static plan at the spec's capacity, with its `SENTINEL` entries
//! replaced by values the programs read as "nothing here" (segment 0, token `B*T`, slot
//! `NT*64`, one past the end), and `token_segment`, each token's segment slot (its chunk's
//! `chunk_slot`; -1 for padding tokens), what kernels reading packed rows as whole blocks
//! compare.

use kda_core::{BackwardStrategy, DType, SegmentTable, Segments};
use kda_packed::{StaticCapacity, SENTINEL};

use super::spec::{on_device, ProgramSpec, CHUNK};
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
    pub fn of(s: &ProgramSpec, kind: ProgramKind) -> ProgramSignature {
        let e = on_device(s.options.dtype);
        let ge = on_device(s.options.g_dtype);
        let f32 = DType::F32;
        let i32 = DType::I32;
        let nt = s.chunks() as i64;
        let state = s.state_dims();
        let saved_h = [s.lanes() as i64, nt, s.dims.k as i64, s.dims.v as i64];
        let kernel_forms = s.kernel_forms();
        let tokens = |d: usize| if kernel_forms { s.kernel_token_dims(d) } else { s.token_dims(d) };
        let mut args = vec![
            port("q", e, &tokens(s.dims.k)),
            port("k", e, &tokens(s.dims.k)),
            port("v", e, &tokens(s.dims.v)),
            port("g", ge, &tokens(s.dims.k)),
            port("beta", e, &if kernel_forms { s.kernel_beta_dims() } else { s.beta_dims() }),
        ];
        // The initial state and the gate parameters, or (named `[dh0, da_log, ddt_bias]`)
        // their gradients, where the spec has them.
        let state_and_gate = |ports: &mut Vec<Port>, [h0, a_log, dt_bias]: [&'static str; 3]| {
            if s.options.has_h0 {
                ports.push(port(h0, f32, &state));
            }
            if s.in_kernel_gate() {
                ports.push(port(a_log, f32, &[s.dims.h as i64]));
                if s.options.has_dt_bias {
                    ports.push(port(dt_bias, f32, &[(s.dims.h * s.dims.k) as i64]));
                }
            }
        };
        state_and_gate(&mut args, ["h0", "a_log", "dt_bias"]);
        for name in ["chunk_first", "chunk_last", "chunk_slot"] {
            args.push(port(name, i32, &[nt]));
        }
        if s.packed_chunks.is_some() {
            args.push(port("slot_token", i32, &[nt * CHUNK as i64]));
            args.push(port("token_slot", i32, &[(s.dims.b * s.dims.t) as i64]));
            args.push(port("token_segment", i32, &[(s.dims.b * s.dims.t) as i64]));
        }
        // Per-token results are 2-D (and `dbeta` `[H*B*T]`): the row-major bytes of the
        // caller's shapes (a 4-D result with a unit axis made XLA copy it once more).
        let flat_k = s.result_token_dims(s.dims.k, kernel_forms);
        let flat_v = s.result_token_dims(s.dims.v, kernel_forms);
        let flat_beta = [s.beta_dims().iter().product::<i64>()];
        let mut results = Vec::new();
        let forward = |results: &mut Vec<Port>| {
            results.push(port("o", e, &flat_v));
            if s.options.final_state {
                results.push(port("final_state", f32, &state));
            }
        };
        let grads = |results: &mut Vec<Port>| {
            results.push(port("dq", e, &flat_k));
            results.push(port("dk", e, &flat_k));
            results.push(port("dv", e, &flat_v));
            results.push(port("dg", ge, &flat_k));
            results.push(port("dbeta", e, &flat_beta));
            state_and_gate(results, ["dh0", "da_log", "ddt_bias"]);
        };
        let cotangents = |args: &mut Vec<Port>| {
            args.push(port("do", e, &tokens(s.dims.v)));
            if s.options.has_dht {
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
    /// `token_slot`, `token_segment`).
    pub name: &'static str,
    /// Its dims (as in [`ProgramSignature::of`]).
    pub dims: Vec<i64>,
    /// Row-major values.
    pub data: Vec<i32>,
}

/// The index tables of `spec`'s programs, in signature order: `chunk_first chunk_last
/// chunk_slot` for fixed length (where `segments` is not read and may be `None`), and
/// `slot_token token_slot token_segment` after them for a packed spec (whose `segments` must be given, with
/// `B` rows of `T` tokens and at most `N` segments each).
pub fn index_tables(spec: &ProgramSpec, segments: Option<&Segments>) -> Result<Vec<IndexTable>> {
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
    let seg_table = segments.validate(spec.dims.b, spec.dims.t)?;
    packed_tables(spec, cap, &seg_table)
}

/// [`index_tables`] from segments already validated (a [`kda_core::Problem`]'s).
pub fn index_tables_for(spec: &ProgramSpec, segments: &SegmentTable) -> Result<Vec<IndexTable>> {
    match spec.packed_chunks {
        None => index_tables(spec, None),
        Some(cap) => packed_tables(spec, cap, segments),
    }
}

fn packed_tables(spec: &ProgramSpec, cap: usize, seg_table: &SegmentTable) -> Result<Vec<IndexTable>> {
    let nt = spec.chunks();
    let table = |name: &'static str, dims: &[usize], data: Vec<i32>| IndexTable {
        name,
        dims: dims.iter().map(|&d| d as i64).collect(),
        data,
    };
    let (b, t) = (spec.dims.b, spec.dims.t);
    let tables = StaticCapacity::new(b, t, spec.dims.n, CHUNK)?.plan(seg_table)?.tables().clone();
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
    let chunk_slot = fix(&tables.chunk_segment, 0);
    let token_segment = token_segments(&tables.token_slot, &chunk_slot);
    Ok(vec![
        table("chunk_first", &[nt], tables.chunk_first.clone()),
        table("chunk_last", &[nt], tables.chunk_last.clone()),
        table("chunk_slot", &[nt], chunk_slot),
        table("slot_token", &[nt * CHUNK], fix(&tables.slot_token, (b * t) as i32)),
        table("token_slot", &[b * t], fix(&tables.token_slot, (nt * CHUNK) as i32)),
        table("token_segment", &[b * t], token_segment),
    ])
}

/// Each packed token's segment slot: the `chunk_slot` of the chunk its slot lies in, -1 for a
/// padding token (`SENTINEL` in `token_slot`).
pub(crate) fn token_segments(token_slot: &[i32], chunk_slot: &[i32]) -> Vec<i32> {
    let of = |slot: i32| {
        let chunk = usize::try_from(slot).ok()? / CHUNK;
        chunk_slot.get(chunk).copied()
    };
    token_slot.iter().map(|&s| if s == SENTINEL { -1 } else { of(s).unwrap_or(-1) }).collect()
}
