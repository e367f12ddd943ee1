//! The state recurrence of the GPU forward: one program per (lane, block of `BV` state columns)
//! runs the chunk positions in order with its `[K, BV]` slice of the state as a value (the
//! state split along V across programs, as fla does), from the chunk kernels' factors:
//! `v' = u - w S`, `o = (scale q e^G) S + (scale Aqk) v'`, `S <- e^(G_C) S + (k e^(G_C - G))^T v'`.
//! Packed rows: the state restarts from the slot's initial state at a segment's first chunk and
//! is written to the slot's final state at its last (the tables `first`, `last`, `slot`).

use kda_core::DType;

use crate::error::Result;
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Body, Index, Kernel, KernelBuilder, Operand, Ref, Semantics, Table, V};

use super::super::chunk::{chunk_output, chunk_state_next, whole_terms, ChunkUpdate};
use super::{Factors, ForwardShape, TokenLayout, C};

/// The recurrence kernel's operands by name.
#[derive(Clone, Copy, Debug)]
pub struct RecurrenceRefs {
    /// The chunk kernels' results.
    pub factors: Factors,
    /// 1 at a segment's first chunk position `[NT]`.
    pub first: Table,
    /// 1 at a segment's last chunk position `[NT]`.
    pub last: Table,
    /// The state slot of each chunk position's segment `[NT]`.
    pub slot: Table,
    /// The initial states `[L, slots, K, V]` f32, when given.
    pub h0: Option<Ref>,
    /// `o` `[L, T, V]` in the input dtype (`[T, L * V]` in rows).
    pub o: Ref,
    /// The final states `[L, slots, K, V]` f32 (a slot without chunks is not written).
    pub ht: Ref,
    /// The state entering each chunk `[L, NT, K, V]` f32, when the shape keeps it.
    pub h: Option<Ref>,
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
    let (first, last, slot) = (kb.table("first", nt), kb.table("last", nt), kb.table("slot", nt));
    let mut chunk = |name: &str, w: i64| {
        let at = vec![g0.clone(), g2.clone(), Index::Const(0)];
        kb.input(Operand::blocked(name, fty(&[l, t, w]), &[1, C, w], at))
    };
    let w = chunk("w", k);
    let (qg, kg, aqk) = (chunk("qg", k), chunk("kg", k), chunk("aqk", C));
    let cols = || vec![g0.clone(), g2.clone(), g1.clone()];
    let u = kb.input(Operand::blocked("u", fty(&[l, t, v]), &[1, C, bv], cols()));
    let eg = kb.input(Operand::blocked(
        "eg",
        ty(&[l, nt, k]),
        &[1, 1, k],
        vec![g0.clone(), g2.clone(), Index::Const(0)],
    ));
    let slots = s.slots;
    let state_at = || vec![g0.clone(), Index::table(slot, g2.clone()), Index::Const(0), g1.clone()];
    let h0 =
        s.h0.then(|| kb.input(Operand::blocked("h0", ty(&[l, slots, k, v]), &[1, 1, k, bv], state_at())));
    let o = kb.output(match s.layout {
        TokenLayout::Lanes => {
            Operand::blocked("o", TensorType::new(s.dtype, &[l, t, v]), &[1, C, bv], cols())
        }
        TokenLayout::Rows => {
            let at = vec![g2.clone(), g0.clone() * (v / bv) + g1.clone()];
            Operand::blocked("o", TensorType::new(s.dtype, &[t, l * v]), &[C, bv], at)
        }
    });
    let ht = kb.output(Operand::blocked("ht", ty(&[l, slots, k, v]), &[1, 1, k, bv], state_at()));
    let h = s.keep_h.then(|| {
        let at = vec![g0.clone(), g2.clone(), Index::Const(0), g1.clone()];
        kb.output(Operand::blocked("h", ty(&[l, nt, k, v]), &[1, 1, k, bv], at))
    });
    let state = kb.scratch("state", ty(&[k, bv]));
    kb.params(s.recurrence_launch);
    let factors = Factors { w, u, qg, kg, aqk, eg };
    let refs = RecurrenceRefs { factors, first, last, slot, h0, o, ht, h, state };
    let kernel = kb.build(|b| step(b, s, &refs))?;
    Ok((kernel, refs))
}

fn block(b: &mut Body, r: Ref, dims: &[i64]) -> Result<V> {
    let x = b.load_all(r)?;
    b.reshape(&x, dims)
}

/// Whether table `t` holds a non-zero at chunk position `c`.
fn flagged(b: &mut Body, t: Table, c: &V) -> Result<V> {
    let x = b.read_table(t, c)?;
    let zero = b.index(0)?;
    b.compare(Cmp::Ne, &x, &zero)
}

/// One chunk of one state slice.
fn step(b: &mut Body, s: &ForwardShape, r: &RecurrenceRefs) -> Result<()> {
    let (k, bv, p) = (s.k, s.bv(), s.precision());
    let c = b.program_id(2)?;
    let at_first = flagged(b, r.first, &c)?;
    b.when(&at_first, |b| {
        let h = match r.h0 {
            Some(h0) => block(b, h0, &[k, bv])?,
            None => b.splat(0.0, DType::F32, &[k, bv])?,
        };
        b.store_all(r.state, &h)
    })?;
    let state = b.load_all(r.state)?;
    if let Some(h) = r.h {
        let x = b.reshape(&state, &[1, 1, k, bv])?;
        b.store_all(h, &x)?;
    }
    let w = block(b, r.factors.w, &[C, k])?;
    let u = block(b, r.factors.u, &[C, bv])?;
    let u = b.to_dtype(&u, DType::F32)?;
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
    let o = b.to_dtype(&o, s.dtype)?;
    let o = match s.layout {
        TokenLayout::Lanes => b.reshape(&o, &[1, C, bv])?,
        TokenLayout::Rows => o,
    };
    b.store_all(r.o, &o)?;
    let next = chunk_state_next(b, &update, &vnd, &mut whole_terms)?;
    b.store_all(r.state, &next)?;
    let at_last = flagged(b, r.last, &c)?;
    b.when(&at_last, |b| {
        let h = b.reshape(&next, &[1, 1, k, bv])?;
        b.store_all(r.ht, &h)
    })
}
