//! The state recurrence of the GPU forward: one program per (lane, block of `BV` state columns)
//! runs the chunks in order with its `[K, BV]` slice of the state as a value (the state split
//! along V across programs, as fla does), from the terms kernel's per-chunk factors:
//! `v' = u - w S`, `o = (scale q e^G) S + (scale Aqk) v'`, `S <- e^(G_C) S + (k e^(G_C - G))^T v'`.

use kda_core::DType;

use crate::error::Result;
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Body, Index, Kernel, KernelBuilder, Operand, Ref, Semantics, V};

use super::super::chunk::{chunk_output, chunk_state_next, whole_terms, ChunkUpdate};
use super::{Factors, ForwardShape, C};

/// The recurrence kernel's operands by name.
#[derive(Clone, Copy, Debug)]
pub struct RecurrenceRefs {
    /// The terms kernel's results.
    pub factors: Factors,
    /// The initial state `[L, K, V]` f32, when given.
    pub h0: Option<Ref>,
    /// `o` `[L, T, V]` f32.
    pub o: Ref,
    /// The final state `[L, K, V]` f32.
    pub ht: Ref,
    /// The state slice, kept across the chunks.
    pub state: Ref,
}

/// The recurrence kernel of `s`: grid (lanes, state column blocks: parallel; chunks: arbitrary).
pub fn recurrence_kernel(s: &ForwardShape) -> Result<(Kernel, RecurrenceRefs)> {
    let (l, t, nt, k, v, bv) = (s.lanes, s.t, s.t / C, s.k, s.v, s.bv());
    let ty = |dims: &[i64]| TensorType::new(DType::F32, dims);
    let fty = |dims: &[i64]| TensorType::new(s.factor_dtype(), dims);
    let (g0, g1, g2) = (Index::Grid(0), Index::Grid(1), Index::Grid(2));
    let mut kb = KernelBuilder::new("kda_gpu_recurrence");
    kb.grid(l, Semantics::Parallel).grid(v / bv, Semantics::Parallel).grid(nt, Semantics::Arbitrary);
    let chunk = |kb: &mut KernelBuilder, name: &str, w: i64| {
        let at = vec![g0.clone(), g2.clone(), Index::Const(0)];
        kb.input(Operand::blocked(name, fty(&[l, t, w]), &[1, C, w], at))
    };
    let w = chunk(&mut kb, "w", k);
    let u = kb.input(Operand::blocked(
        "u",
        ty(&[l, t, v]),
        &[1, C, bv],
        vec![g0.clone(), g2.clone(), g1.clone()],
    ));
    let (qg, kg, aqk) = (chunk(&mut kb, "qg", k), chunk(&mut kb, "kg", k), chunk(&mut kb, "aqk", C));
    let eg = kb.input(Operand::blocked(
        "eg",
        ty(&[l, nt, k]),
        &[1, 1, k],
        vec![g0.clone(), g2.clone(), Index::Const(0)],
    ));
    let state_at = vec![g0.clone(), Index::Const(0), g1.clone()];
    let h0 = s.h0.then(|| kb.input(Operand::blocked("h0", ty(&[l, k, v]), &[1, k, bv], state_at.clone())));
    let o = kb.output(Operand::blocked(
        "o",
        ty(&[l, t, v]),
        &[1, C, bv],
        vec![g0.clone(), g2.clone(), g1.clone()],
    ));
    let ht = kb.output(Operand::blocked("ht", ty(&[l, k, v]), &[1, k, bv], state_at));
    let state = kb.scratch("state", ty(&[k, bv]));
    kb.params(s.recurrence_launch);
    let refs = RecurrenceRefs { factors: Factors { w, u, qg, kg, aqk, eg }, h0, o, ht, state };
    let kernel = kb.build(|b| step(b, s, &refs, nt))?;
    Ok((kernel, refs))
}

fn block(b: &mut Body, r: Ref, dims: &[i64]) -> Result<V> {
    let x = b.load_all(r)?;
    b.reshape(&x, dims)
}

/// One chunk of one state slice.
fn step(b: &mut Body, s: &ForwardShape, r: &RecurrenceRefs, nt: i64) -> Result<()> {
    let (k, bv, p) = (s.k, s.bv(), s.precision());
    let c = b.program_id(2)?;
    let first = b.index(0)?;
    let at_first = b.compare(Cmp::Eq, &c, &first)?;
    b.when(&at_first, |b| {
        let h = match r.h0 {
            Some(h0) => block(b, h0, &[k, bv])?,
            None => b.splat(0.0, DType::F32, &[k, bv])?,
        };
        b.store_all(r.state, &h)
    })?;
    let state = b.load_all(r.state)?;
    let (w, u) = (block(b, r.factors.w, &[C, k])?, block(b, r.factors.u, &[C, bv])?);
    let (qg, kg, aqk) = (
        block(b, r.factors.qg, &[C, k])?,
        block(b, r.factors.kg, &[C, k])?,
        block(b, r.factors.aqk, &[C, C])?,
    );
    let eg = block(b, r.factors.eg, &[1, k])?;
    // Product operands in the factors' type (bf16 products round to it anyway).
    let update = ChunkUpdate {
        state: &state,
        w: &w,
        u: &u,
        qg: &qg,
        kg: &kg,
        aqk: &aqk,
        last_decay: &eg,
        scale: None,
        precision: p,
    };
    let (vnd, o) = chunk_output(b, &update, &mut whole_terms)?;
    let o = b.reshape(&o, &[1, C, bv])?;
    b.store_all(r.o, &o)?;
    let next = chunk_state_next(b, &update, &vnd, &mut whole_terms)?;
    b.store_all(r.state, &next)?;
    let last = b.index(nt - 1)?;
    let at_last = b.compare(Cmp::Eq, &c, &last)?;
    b.when(&at_last, |b| {
        let h = b.reshape(&next, &[1, k, bv])?;
        b.store_all(r.ht, &h)
    })
}
