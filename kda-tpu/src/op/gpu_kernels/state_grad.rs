//! The state gradient of the GPU backward (fla's `dhu`): one program per (lane, block of `BV`
//! state columns, state slot) runs its slot's chunks last to first with its `[K, BV]` slice of
//! `dh` (the loss's gradient with respect to the state leaving the chunk) as loop values, from
//! the forward's factors and `dO`: `dv' = (scale Aqk)^T dO + kg dh` and
//! `dh <- e^(G_C) dh + (scale q e^G)^T dO - w^T dv'`. A slot's run starts from its `dht` (zero
//! when not given) at its last chunk position and ends with the slot's `dh0`; runs are read as in
//! the forward's [`super::recurrence`] (fixed rows: `run_chunks` positions each; packed rows: from
//! the run tables, a loop with a run-time bound).

use kda_core::DType;

use crate::error::Result;
use crate::hlo::{FnBuilder, TensorType, Value};
use crate::lang::{
    Binary, Bindings, Body, Index, Kernel, KernelBuilder, Lower, Offset, Operand, Ref, Semantics, Table, V,
};

use super::recurrence::columns;
use super::tokens::{self, ChunkRows};
use super::{ForwardShape, PackedTables, C};

/// The state-gradient kernel's operands by name (`[L, T, D]` lane-major chunks; `dO` in the
/// tokens' layout).
#[derive(Clone, Copy, Debug)]
pub struct StateGradRefs {
    /// `w = A (beta k e^G)` `[L, T, K]`, in [`ForwardShape::factor_dtype`].
    pub w: Ref,
    /// `scale q e^G` `[L, T, K]`.
    pub qg: Ref,
    /// `k e^(G_C - G)` `[L, T, K]`.
    pub kg: Ref,
    /// `scale Aqk` `[L, T, C]`, each chunk's rows.
    pub aqk: Ref,
    /// `e^(G_C)` `[L, NT, K]` f32.
    pub eg: Ref,
    /// `dO` `[L, T, V]` in the input dtype, in the tokens' layout.
    pub d_o: Ref,
    /// The final states' gradients `[L, slots, K, V]` f32, when given.
    pub dht: Option<Ref>,
    /// Segmented shapes: each slot's first chunk position and its run's length `[slots]`.
    pub runs: Option<(Table, Table)>,
    /// `dh` leaving each chunk `[L, NT, K, V]` in [`ForwardShape::factor_dtype`] (the WY
    /// gradient's products round it so in bf16; its `h . dh` sums take it as it is).
    pub dh: Ref,
    /// `dv'` (the gradient with respect to `v_new`) `[L, T, V]` f32.
    pub dv: Ref,
    /// The initial states' gradients `[L, slots, K, V]` f32 (`dht` for a slot without chunks).
    pub dh0: Ref,
    /// Packed rows in place: where each chunk position's rows of `dO` are.
    pub packed: Option<tokens::PackedRefs>,
}

/// The state-gradient kernel of `s`: grid (lanes, state column blocks, state slots), all
/// parallel; `dht` says whether the final states' gradients are given.
pub fn state_grad_kernel(s: &ForwardShape, dht: bool) -> Result<(Kernel, StateGradRefs)> {
    let (l, t, nt, k, v, bv) = (s.lanes, s.t, s.t / C, s.k, s.v, s.grad_bv());
    let ty = |dims: &[i64]| TensorType::new(DType::F32, dims);
    let fty = |dims: &[i64]| TensorType::new(s.factor_dtype(), dims);
    let (g0, g1, g2) = (Index::Grid(0), Index::Grid(1), Index::Grid(2));
    let zero = || Index::Const(0);
    let mut kb = KernelBuilder::new("kda_gpu_state_grad");
    kb.grid(l, Semantics::Parallel).grid(v / bv, Semantics::Parallel).grid(s.slots, Semantics::Parallel);
    let runs = s.segmented.then(|| (kb.table("run_start", s.slots), kb.table("run_chunks", s.slots)));
    let mut lane = |name: &str, w: i64| {
        kb.input(Operand::blocked(name, fty(&[l, t, w]), &[1, t, w], vec![g0.clone(), zero(), zero()]))
    };
    let (w, qg, kg, aqk) = (lane("w", k), lane("qg", k), lane("kg", k), lane("aqk", C));
    let eg = kb.input(Operand::blocked("eg", ty(&[l, nt, k]), &[1, nt, k], vec![g0.clone(), zero(), zero()]));
    let columns_at = || vec![g0.clone(), zero(), g1.clone()];
    let d_o = kb.input(tokens::operand("do", s, s.dtype, v, (t, zero()), (bv, g1.clone())));
    let slots = s.slots;
    let state_at = || vec![g0.clone(), g2.clone(), zero(), g1.clone()];
    let dht =
        dht.then(|| kb.input(Operand::blocked("dht", ty(&[l, slots, k, v]), &[1, 1, k, bv], state_at())));
    let dh = kb.output(Operand::blocked(
        "dh",
        fty(&[l, nt, k, v]),
        &[1, nt, k, bv],
        vec![g0.clone(), zero(), zero(), g1.clone()],
    ));
    let dv = kb.output(Operand::blocked("dv", ty(&[l, t, v]), &[1, t, bv], columns_at()));
    let dh0 = kb.output(Operand::blocked("dh0", ty(&[l, slots, k, v]), &[1, 1, k, bv], state_at()));
    let packed = tokens::declare_packed(&mut kb, s);
    kb.params(s.state_grad_launch);
    let refs = StateGradRefs { w, qg, kg, aqk, eg, d_o, dht, runs, dh, dv, dh0, packed };
    let kernel = kb.build(|b| run(b, s, &refs))?;
    Ok((kernel, refs))
}

/// The slot's run, last chunk first, `BK` state rows per value; `dh0` is written before the loop
/// (a slot without chunks keeps `dht`) and after it.
fn run(b: &mut Body, s: &ForwardShape, r: &StateGradRefs) -> Result<()> {
    let (bk, bv) = (s.grad_bk(), s.grad_bv());
    let slot = b.program_id(2)?;
    let z = Offset::Const(0);
    let mut init = Vec::new();
    for i in 0..s.k / bk {
        init.push(match r.dht {
            Some(dht) => {
                let x =
                    b.load(dht, &[z.clone(), z.clone(), Offset::Const(i * bk), z.clone()], &[1, 1, bk, bv])?;
                b.reshape(&x, &[bk, bv])?
            }
            None => b.splat(0.0, DType::F32, &[bk, bv])?,
        });
    }
    let one = b.index(1)?;
    let done = match r.runs {
        Some((start, chunks)) => {
            let start = b.read_table(start, &slot)?;
            let chunks = b.read_table(chunks, &slot)?;
            store_dh0(b, s, r, &init)?;
            let end = b.index_op(Binary::Add, &start, &chunks)?;
            let top = b.index_op(Binary::Sub, &end, &one)?;
            let mean = (s.t / C) as f64 / s.slots as f64;
            b.for_range_until_mean(0, s.run_chunks, &chunks, mean, &init, |b, i, parts| {
                let c = b.index_op(Binary::Sub, &top, i)?;
                step(b, s, r, &c, parts)
            })?
        }
        None => {
            let n = b.index(s.run_chunks)?;
            let next = b.index_op(Binary::Add, &slot, &one)?;
            let end = b.index_op(Binary::Mul, &next, &n)?;
            let top = b.index_op(Binary::Sub, &end, &one)?;
            b.for_range(0, s.run_chunks, &init, |b, i, parts| {
                let c = b.index_op(Binary::Sub, &top, i)?;
                step(b, s, r, &c, parts)
            })?
        }
    };
    store_dh0(b, s, r, &done)
}

/// Writes the slot's `dh0` block from its parts.
fn store_dh0(b: &mut Body, s: &ForwardShape, r: &StateGradRefs, parts: &[V]) -> Result<()> {
    let (bk, bv, z) = (s.grad_bk(), s.grad_bv(), Offset::Const(0));
    for (i, part) in parts.iter().enumerate() {
        let x = b.reshape(part, &[1, 1, bk, bv])?;
        b.store(r.dh0, &[z.clone(), z.clone(), Offset::Const(i as i64 * bk), z.clone()], &x)?;
    }
    Ok(())
}

/// One chunk `c` of one `dh` slice (`BK` rows per part): writes `dh` and
/// `dv' = (scale Aqk)^T dO + sum_k kg_k dh_k`, then returns each part entering the chunk,
/// `e^(G_C)_k dh_k + qg_k^T dO - w_k^T dv'`.
fn step(b: &mut Body, s: &ForwardShape, r: &StateGradRefs, c: &V, parts: &[V]) -> Result<Vec<V>> {
    let (bk, bv, p, fd) = (s.grad_bk(), s.grad_bv(), s.precision(), s.factor_dtype());
    let c64 = b.index(C)?;
    let row = b.index_op(Binary::Mul, c, &c64)?;
    let z = Offset::Const(0);
    let at = ChunkRows::of_chunk(b, s.layout, r.packed.as_ref(), c)?;
    let d_o = tokens::tile(b, r.d_o, &at, (0, C), (Offset::Const(0), bv))?;
    let d_o = b.to_dtype(&d_o, fd)?;
    let aqk = columns(b, r.aqk, &row, 0, C)?;
    let mut dv = b.matmul(&aqk, &d_o, (0, 0), p)?;
    for (i, part) in parts.iter().enumerate() {
        let at = i as i64 * bk;
        let dh = b.to_dtype(part, fd)?;
        let x = b.reshape(&dh, &[1, 1, bk, bv])?;
        b.store(r.dh, &[z.clone(), Offset::Dyn(c.clone(), 1), Offset::Const(at), z.clone()], &x)?;
        let kg = columns(b, r.kg, &row, at, bk)?;
        let x = b.matmul(&kg, &dh, (1, 0), p)?;
        dv = b.add(&dv, &x)?;
    }
    let x = b.reshape(&dv, &[1, C, bv])?;
    b.store(r.dv, &[z.clone(), Offset::Dyn(row.clone(), C), z.clone()], &x)?;
    let dvd = b.to_dtype(&dv, fd)?;
    let mut next = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let at = i as i64 * bk;
        let eg = b.load(r.eg, &[z.clone(), Offset::Dyn(c.clone(), 1), Offset::Const(at)], &[1, 1, bk])?;
        let eg = b.reshape(&eg, &[bk, 1])?;
        let eg = b.broadcast(&eg, &[bk, bv])?;
        let kept = b.mul(part, &eg)?;
        let qg = columns(b, r.qg, &row, at, bk)?;
        let read = b.matmul(&qg, &d_o, (0, 0), p)?;
        let w = columns(b, r.w, &row, at, bk)?;
        let wd = b.matmul(&w, &dvd, (0, 0), p)?;
        let x = b.add(&kept, &read)?;
        next.push(b.sub(&x, &wd)?);
    }
    Ok(next)
}

/// The state-gradient kernel's operands as values of the calling function (shapes as in
/// [`StateGradRefs`]).
#[derive(Clone, Copy, Debug)]
pub struct StateGradInputs {
    /// `w`.
    pub w: Value,
    /// `scale q e^G`.
    pub qg: Value,
    /// `k e^(G_C - G)`.
    pub kg: Value,
    /// `scale Aqk`.
    pub aqk: Value,
    /// `e^(G_C)`.
    pub eg: Value,
    /// `dO`.
    pub d_o: Value,
    /// The final states' gradients, when given.
    pub dht: Option<Value>,
    /// 1 at a segment's first chunk position `[NT]` i32 (segmented shapes).
    pub first: Value,
    /// The state slot of each chunk position `[NT]` i32 (segmented shapes).
    pub slot: Value,
    /// Tokens per chunk position `[NT]` i32 (read with packed rows in place).
    pub valid: Value,
    /// Packed rows in place: their tables.
    pub packed: Option<PackedTables>,
}

/// What the state-gradient kernel returns (shapes as in [`StateGradRefs`]).
#[derive(Clone, Copy, Debug)]
pub struct StateGradOutputs {
    /// `dh` leaving each chunk.
    pub dh: Value,
    /// `dv'`.
    pub dv: Value,
    /// The initial states' gradients.
    pub dh0: Value,
}

/// Calls the state-gradient kernel of `s` on `x` in `f`, lowered by `lowering` (the run tables
/// made from `first` and `slot` when the shape is segmented).
pub fn call_state_grad(
    f: &mut FnBuilder,
    s: &ForwardShape,
    x: &StateGradInputs,
    lowering: &dyn Lower,
) -> Result<StateGradOutputs> {
    s.check()?;
    let (kernel, r) = state_grad_kernel(s, x.dht.is_some())?;
    let mut a: Bindings = kernel.bindings();
    for (at, v) in [(r.w, x.w), (r.qg, x.qg), (r.kg, x.kg), (r.aqk, x.aqk), (r.eg, x.eg), (r.d_o, x.d_o)] {
        a.input(at, v)?;
    }
    if let (Some(at), Some(v)) = (r.dht, x.dht) {
        a.input(at, v)?;
    }
    if let Some((start_t, chunks_t)) = r.runs {
        let (start, chunks) = super::recurrence::runs(f, s.slots, x.first, x.slot)?;
        a.table(start_t, start)?;
        a.table(chunks_t, chunks)?;
    }
    tokens::bind_packed(&mut a, r.packed.as_ref(), x.valid, x.packed)?;
    let out = kernel.call(f, lowering, a)?;
    Ok(StateGradOutputs { dh: out.get(r.dh)?, dv: out.get(r.dv)?, dh0: out.get(r.dh0)? })
}
