//! The chunked KDA backward as one Mosaic kernel (docs/kda.md, Chunks, the backward): the
//! grid of the forward kernel (heads, rows: parallel; chunks: arbitrary) walked from each row's
//! last chunk to its first, `dh` (the gradient of the state after the chunk) in VMEM scratch.
//! Per chunk it forms the chunk factors again ([`super::terms::chunk_factors`]; `A` and `Aqk`
//! as the forward kernel saved them, or formed again too), the WY solve and `v_new = u - w S0`
//! from the state `S0` entering the chunk (saved by the forward kernel), forms
//! every gradient of the chunk and writes it once, and steps `dh` back:
//! `dh <- e^(G_C) dh + scale qg^T dO - w^T dv_new`.
//!
//! The gradients through `Aqk` and `L` follow the forward's levels: each level is
//! `(x fr) (k fc)^T` kept on its mask, so its cotangent gives `x` and `k` their terms and the
//! exponent arrays of `fr` and `fc` theirs; every exponent array is a coefficient mask times
//! `g`, so `dg` is one product of the masks' transposes with the exponent gradients stacked.
//! The `e^(G_C - G)` of `kg` enters through the strict-suffix mask (an exclusive prefix sum:
//! every term decayed to the chunk's end) and `e^(G_C)` as a per-chunk constant, and the
//! diagonal of `Aqk` goes to `dq` and `dk` directly, so no exact cancellation is left to f32
//! (docs/kernels/tpu-backward.md, "The gate's gradient"). Then through the floor, the gate (whose
//! parameter gradients are summed per lane over the chunks) and the L2 norm. Packed tokens are
//! read through the forward's windows and every gradient goes straight to its packed tokens
//! ([`super::forward::place`]).

use kda_core::DType;

use super::super::chunk::{activate, gate_slopes, l2_backward, l2_normalise_with_scale, rowdot, GATE_FLOOR};
use super::backward_chain::DhChain;
use super::backward_levels::{as_operand, fold, level_grads, LevelGrads};
use super::backward_operands::{backward_cost, declare_backward, BackwardRefs};
use super::dims::{KernelDims, Tokens, C};
use super::forward::place;
use super::operands::{
    if_whole, reset_where, segment_rows, store_state_where, window_at, ChunkRows, ChunkSegments, PerToken,
    SegmentRows,
};
use super::terms::{chunk_factors, chunk_terms, unit_lower_inverse_of_parts, ChunkFactors, TermScratch};
use crate::error::Result;
use crate::hlo::Cmp;
use crate::lang::{Binary, Body, MatPrecision, Offset, Reduction, Ref, V};
use crate::lang::{Kernel, MosaicParams};

/// How the backward kernel steps (docs/kernels/op-order.md, "Chunks in flight"). With one-pass
/// (bf16) products `dh` enters one product a chunk ([`DhChain`]), so a step's chunks overlap
/// and sixteen a step with ten in flight count fewest; f32 products take six passes each and
/// keep two products in a row, eight chunks a step and three in flight (docs/performance.md,
/// Figures behind the code's constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardSteps {
    /// The most chunks a step takes by default (the forward's default, capped).
    pub chunks: i64,
    /// The most chunks of a step the op order keeps in flight ([`KernelDims::schedule`]).
    pub in_flight: u32,
    /// The scoped VMEM the kernel asks for: its steps' spill slots pass the default of v5e and
    /// v5p. More lets libtpu move the program's buffers into VMEM, which costs cycles.
    pub vmem_limit: i64,
    /// Whether `dh` enters one product a chunk ([`DhChain::step`]) on steps of several chunks:
    /// one product more a chunk, worth it where a product is one pass.
    pub one_product_chain: bool,
}

impl BackwardSteps {
    /// The steps of a backward kernel whose products take `p`.
    pub fn for_precision(p: MatPrecision) -> BackwardSteps {
        let vmem_limit = 32 << 20;
        match p {
            MatPrecision::Default => {
                BackwardSteps { chunks: 16, in_flight: 10, vmem_limit, one_product_chain: true }
            }
            _ => BackwardSteps { chunks: 8, in_flight: 3, vmem_limit, one_product_chain: false },
        }
    }

    /// Whether a step of `chunks_per_step` chunks walks `dh` through one product a chunk: only
    /// with [`Self::one_product_chain`] and several chunks a step (one chunk a step overlaps
    /// nothing, and the extra product would be all cost).
    pub fn one_product(&self, chunks_per_step: i64) -> bool {
        self.one_product_chain && chunks_per_step > 1
    }
}

/// The backward kernel and its operands by name.
pub(super) struct BackwardKernel {
    pub kernel: Kernel,
    pub refs: BackwardRefs,
}

/// The backward kernel of `d` (the dims of the forward kernel that saved the states, with its
/// own chunks per step) with scale `scale`. Its operands ([`BackwardRefs`]): the chunk tables
/// (as the forward kernel's), then `q k v g beta [gate] h [a aqk] do [dht] exponent_masks
/// level_masks exponent_masks_t` (as the forward kernel's; `h` the states it saved in
/// [`KernelDims::state_dtype`], `a` and `aqk` its chunk terms when `d.terms`, `do` laid out as
/// `v`, `dht` `[L, S, K, V]` f32 when `d.ht`, the masks those of
/// [`super::terms::term_masks_kernel`] with its transposes); its results
/// `dq dk dv dg dbeta [dh0] [gate_sums]`: the gradients laid out as their inputs (`dbeta` f32,
/// a chunk's 64 tokens a row, `[L, NT, 64]`; `dg` that of the raw gate; packed tokens read in
/// place: f32, each head's whole (`dbeta` `[H, P, 1]`), padding tokens unwritten), `dh0`
/// `[L, S, K, V]` f32 when `d.h0` (written at each segment's first chunk), and with an
/// in-kernel gate `gate_sums` `[L, 2, K]` f32: per lane the sums over its tokens of
/// `dg dg/da_log` and of the raw gate's gradient (`da_log` and `ddt_bias` once summed over a
/// head's lanes).
pub(super) fn backward_kernel(d: KernelDims, scale: f64) -> Result<BackwardKernel> {
    d.check("mosaic backward")?;
    let (mut kb, refs) = declare_backward(&d)?;
    let steps = BackwardSteps::for_precision(d.precision());
    let cx = BackwardStep { d: &d, r: &refs, scale, p: d.precision(), g_passes: d.g_passes(), steps };
    kb.cost(backward_cost(&d));
    let params = MosaicParams::default().with_schedule(d.schedule(steps.in_flight));
    let params = params.with_vmem_limit(steps.vmem_limit)?;
    kb.params(params);
    let kernel = kb.build(|b| backward_step(b, &cx))?;
    Ok(BackwardKernel { kernel, refs })
}

/// What every step of the backward kernel's body reads.
struct BackwardStep<'a> {
    d: &'a KernelDims,
    r: &'a BackwardRefs,
    scale: f64,
    p: MatPrecision,
    /// The bf16 parts the sums of `g` take ([`chunk_terms`]).
    g_passes: usize,
    steps: BackwardSteps,
}

impl BackwardStep<'_> {
    /// Whether a step's chunks are one block of one fixed-length row: its one segment's last
    /// chunk is the walk's first, `dht` read there and no chunk branching (a branch keeps the
    /// scheduler from overlapping a step's chunks).
    fn one_block(&self) -> bool {
        self.d.fixed_rows()
    }

    /// `dht` of the step's lane and slot, or zeros.
    fn dht(&self, b: &mut Body) -> Result<V> {
        let (k, v) = (self.d.k, self.d.v);
        match self.r.dht {
            Some(dht) => {
                let x = b.load_all(dht)?;
                b.reshape(&x, &[k, v])
            }
            None => b.splat(0.0, DType::F32, &[k, v]),
        }
    }
}

/// One grid step: a row's walk starts with no gradient (padding chunks after its segments hold
/// none); each segment's from `dht` of its slot at its last chunk. Then the step's chunks from
/// its last (chunk `c = n block + ci` at rows `64 ci` of its blocks); in one block `dh` passes
/// from chunk to chunk as a value, through scratch only between steps.
fn backward_step(b: &mut Body, cx: &BackwardStep) -> Result<()> {
    let (d, r, n) = (cx.d, cx.r, cx.d.chunks_per_step());
    let (k, v) = (d.k, d.v);
    let step = b.program_id(2)?;
    let (zero, end) = (b.index(0)?, b.index(d.chunks / n - 1)?);
    let block = b.index_op(Binary::Sub, &end, &step)?;
    let starts = b.compare(Cmp::Eq, &step, &zero)?;
    b.when(&starts, |b| {
        let z = if cx.one_block() { cx.dht(b)? } else { b.splat(0.0, DType::F32, &[k, v])? };
        b.store_all(r.dh, &z)?;
        if let Some(sums) = r.gate_sums {
            let z = b.splat(0.0, DType::F32, &[1, 2, k])?;
            b.store_all(sums, &z)?;
        }
        Ok(())
    })?;
    let mut carried: Option<V> = None;
    for ci in (0..n).rev() {
        let c = {
            let (nv, iv) = (b.index(n)?, b.index(ci)?);
            let base = b.index_op(Binary::Mul, &block, &nv)?;
            b.index_op(Binary::Add, &base, &iv)?
        };
        if !cx.one_block() {
            let last = b.read_table(r.tabs.last, &c)?;
            let at_last = b.compare(Cmp::Ne, &last, &zero)?;
            b.when(&at_last, |b| {
                let dht = cx.dht(b)?;
                b.store_all(r.dh, &dht)
            })?;
        }
        let dh = match carried.take() {
            Some(dh) => dh,
            None => b.load_all(r.dh)?,
        };
        // Segments: no gradient leaves a chunk whose last row ends a segment.
        let dh = if d.segments { reset_where(b, (r.tabs.last, &c), &dh)? } else { dh };
        let chunk = ChunkAt { ci, c, zero: zero.clone() };
        carried = backward_chunk(b, cx, &chunk, dh)?;
    }
    Ok(())
}

/// Chunk `ci` of a step: its index `c` (and the i32 zero the branches compare with).
struct ChunkAt {
    ci: i64,
    c: V,
    zero: V,
}

/// A chunk's inputs as its gradients need them: normalised `q` and `k` with their L2 scales,
/// `v`, `beta`, `do`, the raw gate `gx` and the activated `g`.
struct ChunkInputs {
    q: V,
    q_scale: Option<V>,
    kk: V,
    k_scale: Option<V>,
    vv: V,
    beta: V,
    d_o: V,
    gx: V,
    g: V,
}

/// The chunk's per-token inputs as `rows` finds them, the rows past a packed chunk's tokens
/// zero for k, v, beta, do and the activated g (no part in the state or the gradients; q's
/// rows meet only zero cotangents).
fn chunk_inputs(b: &mut Body, cx: &BackwardStep, rows: &ChunkRows) -> Result<ChunkInputs> {
    let (d, r, ci) = (cx.d, cx.r, rows.ci);
    let (h, k, v) = (d.heads, d.k, d.v);
    let beta = if d.tokens == Tokens::BatchFirst {
        let head = b.program_id(0)?;
        let head = b.broadcast(&head, &[C, h])?;
        let ids = b.iota(&[C, h], 1)?;
        let mine = b.compare(Cmp::Eq, &ids, &head)?;
        let all = b.load(r.tokens.beta.block, &[Offset::Const(ci * C), Offset::Const(0)], &[C, h])?;
        let all = b.to_dtype(&all, DType::F32)?;
        let none = b.splat(0.0, DType::F32, &[C, h])?;
        let picked = b.select(&mine, &all, &none)?;
        b.reduce(Reduction::Sum, &picked, 1)?
    } else {
        rows.read(b, &r.tokens.beta, 1)?
    };
    let t = &r.tokens;
    let (q_in, k_in) = (rows.read(b, &t.q, k)?, rows.read(b, &t.k, k)?);
    let (vv, gx) = (rows.read(b, &t.v, v)?, rows.read(b, &t.g, k)?);
    // Padding tokens' inputs may hold anything: zero, so that every product stays finite.
    let (q_in, gx) = (rows.real(b, &q_in)?, rows.real(b, &gx)?);
    let d_o = rows.read(b, &r.d_o, v)?;
    let (k_in, vv, beta, d_o) =
        (rows.keep(b, &k_in)?, rows.keep(b, &vv)?, rows.keep(b, &beta)?, rows.keep(b, &d_o)?);
    let (q, q_scale) = if d.l2norm { split(l2_normalise_with_scale(b, &q_in)?) } else { (q_in, None) };
    let (kk, k_scale) = if d.l2norm { split(l2_normalise_with_scale(b, &k_in)?) } else { (k_in, None) };
    let g = activate(b, &gx, d.gate, r.gate)?;
    let g = rows.keep(b, &g)?;
    Ok(ChunkInputs { q, q_scale, kk, k_scale, vv, beta, d_o, gx, g })
}

/// What a chunk's gradients read of its forward and of `dh`: the chunk factors, `A`, the
/// state `S0` entering it, `v_new`, `dv_new` and `scale dO`.
struct ChunkState {
    t: ChunkFactors,
    a: V,
    s0: V,
    vn: V,
    dvn: V,
    sd_o: V,
}

/// The chunk's forward again from its saved state (`A` and `Aqk` as the forward kernel saved
/// them, or formed again), `dv_new = Aqk^T dO + kg dh` and the gradient of the state before
/// it, `dh_prev = e^(G_C) dh + scale qg^T dO - w^T dv_new`; with segments `segs`, the entering
/// state's terms on the first segment's rows, the leaving state's on the last's.
fn chunk_state(
    b: &mut Body,
    cx: &BackwardStep,
    ci: i64,
    x: &ChunkInputs,
    dh: &V,
    segs: Option<&ChunkSegments>,
) -> Result<(ChunkState, V)> {
    let (d, r, p) = (cx.d, cx.r, cx.p);
    let (k, v) = (d.k, d.v);
    let scratch = TermScratch::of_kernel([r.masks[0], r.masks[1]], r.sums, d.levels());
    let at4 = [Offset::Const(0), Offset::Const(ci), Offset::Const(0), Offset::Const(0)];
    let (t, a, aqk) = match r.terms {
        Some(saved) => {
            let f = chunk_factors(b, &x.q, &x.kk, &x.g, &x.beta, scratch, p, cx.g_passes)?;
            let [a, aqk] = saved.map(|at| {
                let y = b.load(at, &at4, &[1, 1, C, C])?;
                b.reshape(&y, &[C, C])
            });
            (f, a?, aqk?)
        }
        None => {
            let mut t = chunk_terms(b, &x.q, &x.kk, &x.g, &x.beta, cx.scale, scratch, p, cx.g_passes)?;
            if let Some(s) = segs {
                s.within_terms(b, &mut t)?;
            }
            let a = unit_lower_inverse_of_parts(b, &t.l_blocks, &t.l_rest, &t.f.eye, p)?;
            (t.f, a, t.aqk)
        }
    };
    let wide_beta = b.broadcast(&x.beta, &[C, v])?;
    let bv = b.mul(&x.vv, &wide_beta)?;
    let u = mixed_matmul(b, &a, &bv, (1, 0), p)?;
    let w = mixed_matmul(b, &a, &t.kbg, (1, 0), p)?;
    let s0 = b.load(r.h, &at4, &[1, 1, k, v])?;
    let s0 = b.to_dtype(&s0, DType::F32)?;
    let s0 = b.reshape(&s0, &[k, v])?;
    let ws = b.matmul(&w, &s0, (1, 0), p)?;
    let ws = segment_rows(b, segs, &ws, SegmentRows::First)?;
    let vn = b.sub(&u, &ws)?;
    // `dh` stepped back, with `dv_new` and `scale dO` (for `Aqk`'s cotangent).
    let chain = DhChain { t: &t, aqk: &aqk, w: &w, d_o: &x.d_o, scale: cx.scale, segs };
    let (dvn, sd_o, dh_prev) = chain.step(b, dh, cx.steps.one_product(d.chunks_per_step()), p)?;
    Ok((ChunkState { t, a, s0, vn, dvn, sd_o }, dh_prev))
}

/// One chunk of the walk from `dh`, the gradient of the state after it: its inputs, its
/// forward again, `dh` stepped back (returned when it passes on as a value), and its
/// gradients written.
fn backward_chunk(b: &mut Body, cx: &BackwardStep, chunk: &ChunkAt, dh: V) -> Result<Option<V>> {
    let (d, r) = (cx.d, cx.r);
    let ChunkAt { ci, c, zero } = chunk;
    let (k, v) = (d.k, d.v);
    let window = match r.tabs.window {
        Some(t) => Some(window_at(b, &t, c)?),
        None => None,
    };
    let off_len = window.as_ref().map(|[_, _, off, len]| (off.clone(), len.clone()));
    let rows = ChunkRows::new(b, *ci, off_len, r.tabs.segments)?;
    let x = chunk_inputs(b, cx, &rows)?;
    let segs = rows.segments.as_ref();
    let (st, dh_prev) = chunk_state(b, cx, *ci, &x, &dh, segs)?;
    let carried = if cx.one_block() && *ci > 0 {
        Some(dh_prev.clone())
    } else {
        b.store_all(r.dh, &dh_prev)?;
        None
    };
    // Without branches (fixed-length rows): each step's last chunk writes `dh0`'s block, which
    // stays resident through the row's walk and holds the row's first chunk's when it goes to
    // HBM.
    if let (Some(dh0), true, 0) = (r.dh0, cx.one_block(), *ci) {
        let y = b.reshape(&dh_prev, &[1, 1, k, v])?;
        b.store_all(dh0, &y)?;
    }
    let grads = chunk_grads(b, d, [&x.q, &x.kk, &x.vv, &x.beta], &st, &dh, segs, r.masks[2])?;
    let results = chunk_results(b, cx, &rows, &x, grads)?;
    write_grads(b, cx, chunk, &results, &st.t.eye, window.as_ref())?;
    // Else `dh0` at each segment's first chunk, written last (a branch there would split the
    // chunk's work in two).
    if let (Some(dh0), false) = (r.dh0, cx.one_block()) {
        store_state_where(b, (r.tabs.first, c), zero, &dh_prev, dh0)?;
    }
    Ok(carried)
}

/// The chunk's gradients of the kernel's inputs from [`chunk_grads`]: `dg` with `G_C`'s term,
/// through the floor (zero where the gate sat on it) and (in-kernel) the gate, whose parameter
/// gradients go to the lane's running sums; `dq` and `dk` through the L2 norm.
fn chunk_results(
    b: &mut Body,
    cx: &BackwardStep,
    rows: &ChunkRows,
    x: &ChunkInputs,
    grads: Grads,
) -> Result<PerToken<V>> {
    let (d, r, k) = (cx.d, cx.r, cx.d.k);
    let every = b.broadcast(&grads.d_last, &[C, k])?;
    let dg = b.add(&grads.dg, &every)?;
    let floor = b.splat(GATE_FLOOR, DType::F32, &[C, k])?;
    let live = b.compare(Cmp::Gt, &x.g, &floor)?;
    let none = b.splat(0.0, DType::F32, &[C, k])?;
    let dg = b.select(&live, &dg, &none)?;
    // A packed chunk's rows past its tokens hold the gradient of their zeroed gate: not a
    // token's, and kept out of the gate parameters' sums.
    let dg = rows.keep(b, &dg)?;
    let dx = match r.gate_sums {
        Some(sums) => {
            let (dz, dlog) = gate_slopes(b, &x.gx, d.gate, r.gate)?;
            let dx = b.mul(&dg, &dz)?;
            let dl = b.mul(&dg, &dlog)?;
            // Column sums (a reduction over the rows: no product, whose full precision would
            // take six MXU passes), added to the lane's running sums row by row.
            for (i, y) in [&dl, &dx].into_iter().enumerate() {
                let sum = b.reduce(Reduction::Sum, y, 0)?;
                let sum = b.reshape(&sum, &[1, 1, k])?;
                let at = [Offset::Const(0), Offset::Const(i as i64), Offset::Const(0)];
                let before = b.load(sums, &at, &[1, 1, k])?;
                let after = b.add(&before, &sum)?;
                b.store(sums, &at, &after)?;
            }
            dx
        }
        None => dg,
    };
    let dq = match &x.q_scale {
        Some(rs) => l2_backward(b, &grads.dq, &x.q, rs)?,
        None => grads.dq,
    };
    let dk = match &x.k_scale {
        Some(rs) => l2_backward(b, &grads.dk, &x.kk, rs)?,
        None => grads.dk,
    };
    let (dv, dbeta) = (grads.dv, grads.dbeta);
    if rows.segments.is_none() {
        return Ok(PerToken { q: dq, k: dk, v: dv, g: dx, beta: dbeta });
    }
    // Padding tokens' gradients exactly zero.
    let [q, k, v, g, beta] = [dq, dk, dv, dx, dbeta].map(|y| rows.real(b, &y));
    Ok(PerToken { q: q?, k: k?, v: v?, g: g?, beta: beta? })
}

/// Writes a chunk's gradients `dq dk dv dg dbeta`: at its rows of the step's blocks in their
/// dtypes (`dbeta` as a row of `[L, NT, 64]`: the column's entries on the diagonal of `eye`,
/// summed down the columns, one term each: exact), or (packed) to its tokens.
fn write_grads(
    b: &mut Body,
    cx: &BackwardStep,
    chunk: &ChunkAt,
    results: &PerToken<V>,
    eye: &V,
    window: Option<&[V; 4]>,
) -> Result<()> {
    let (d, r) = (cx.d, cx.r);
    let g = &r.grads;
    let outs = [
        (g.q, &results.q, d.qk),
        (g.k, &results.k, d.qk),
        (g.v, &results.v, d.dtype),
        (g.g, &results.g, d.g),
    ];
    match (window, r.place) {
        (Some(tables), Some([place_k, place_v, place_1])) => {
            for (out, x, _) in outs.into_iter().chain([(g.beta, &results.beta, d.dtype)]) {
                let buf = match x.ty.dims[1] {
                    w if w == d.k => place_k,
                    w if w == d.v => place_v,
                    _ => place_1,
                };
                place(b, out, buf, x, tables)?;
            }
        }
        _ => {
            for (out, x, dtype) in outs {
                let x = b.to_dtype(x, dtype)?;
                let w = x.ty.dims[1];
                let x = b.reshape(&x, &[1, C, w])?;
                b.store(out, &[Offset::Const(0), Offset::Const(chunk.ci * C), Offset::Const(0)], &x)?;
            }
            let wide = b.broadcast(&results.beta, &[C, C])?;
            let diag = b.mul(&wide, eye)?;
            let row = b.reduce(Reduction::Sum, &diag, 0)?;
            let row = b.reshape(&row, &[1, 1, C])?;
            b.store(g.beta, &[Offset::Const(0), Offset::Dyn(chunk.c.clone(), 1), Offset::Const(0)], &row)?;
        }
    }
    Ok(())
}

/// `x y` at `p`, a saved bf16 operand against an f32 one in one bf16 pass (as `p` runs it).
fn mixed_matmul(b: &mut Body, x: &V, y: &V, contract: (usize, usize), p: MatPrecision) -> Result<V> {
    let (x, y) = match (x.ty.elem, y.ty.elem) {
        (DType::BF16, DType::F32) => (x.clone(), b.cast(y, DType::BF16)?),
        (DType::F32, DType::BF16) => (b.cast(x, DType::BF16)?, y.clone()),
        _ => (x.clone(), y.clone()),
    };
    b.matmul(&x, &y, contract, p)
}

fn split((y, r): (V, V)) -> (V, Option<V>) {
    (y, Some(r))
}

/// One chunk's gradients before the floor, the gate and the L2 norm: `dq dk` (of the normalised
/// q and k), `dv`, `dbeta`, and `dg` from the gradients of the exponent arrays (`G`, the strict
/// suffix, the mid anchor, the levels: the exponent masks' order), with that of `G_C` apart.
struct Grads {
    dq: V,
    dk: V,
    dv: V,
    dbeta: V,
    /// `sum over the exponent arrays of mask^T dE` (without `G_C`'s term).
    dg: V,
    d_last: V,
}

/// With segments `segs`, the entering state's terms on the first segment's rows, the leaving
/// state's on the last's, the cotangents of `Aqk` and `L` on each segment's pairs.
fn chunk_grads(
    b: &mut Body,
    d: &KernelDims,
    [q, k, v, beta]: [&V; 4],
    st: &ChunkState,
    dh: &V,
    segs: Option<&ChunkSegments>,
    masks_t: Ref,
) -> Result<Grads> {
    let ChunkState { t, a, s0, vn, dvn, sd_o } = st;
    let (kd, vd) = (d.k, d.v);
    let p = d.precision();
    let wide_k = |b: &mut Body, x: &V| b.broadcast(x, &[C, kd]);
    // Through O = scale qg S0 + Aqk v_new and S1 = e^(G_C) S0 + kg^T v_new, and the WY solve:
    // u = A (beta v), w = A (beta k e^G), v_new = u - w S0; with dw = -dv_new S0^T,
    // nw = -A^T dw = (A^T dv_new) S0^T. `dqg = scale dO S0^T` and `nw` as one product against
    // `S0^T`.
    let xu = mixed_matmul(b, a, dvn, (0, 0), p)?;
    let both = {
        let lhs = b.concat(&[sd_o.clone(), xu.clone()], 0)?;
        b.matmul(&lhs, s0, (1, 1), p)?
    };
    let dqg = b.slice(&both, &[0, 0], &[C, kd])?;
    let dqg = segment_rows(b, segs, &dqg, SegmentRows::First)?;
    let nw = b.slice(&both, &[C, 0], &[C, kd])?;
    let nw = segment_rows(b, segs, &nw, SegmentRows::First)?;
    let mut dq = b.mul(&dqg, &t.egc)?;
    let mut d_g = b.mul(&dqg, &t.qg)?;
    let dkg = b.matmul(vn, dh, (1, 1), p)?;
    let dkg = segment_rows(b, segs, &dkg, SegmentRows::Last)?;
    let mut dk = b.mul(&dkg, &t.egs)?;
    let d_suffix = b.mul(&dkg, &t.kg)?;
    let sd = b.mul(s0, dh)?;
    let hd = b.reduce(Reduction::Sum, &sd, 1)?;
    let hd = b.reshape(&hd, &[1, kd])?;
    let d_last = b.mul(&hd, &t.eg_last)?;
    let d_last = if_whole(b, segs, &d_last)?;
    let wide_v = b.broadcast(beta, &[C, vd])?;
    let dv = b.mul(&xu, &wide_v)?;
    // Through `w = A (beta k e^G)`: `nw e^G` to `dk` (times beta) and to `dg` (times
    // `beta k`); `beta` gets `xu . v` here, and `(d(beta k) - nw e^G) . k` once the levels have
    // summed `d(beta k)`.
    let nwe = b.mul(&nw, &t.egc)?;
    let wb = wide_k(b, beta)?;
    let bnwe = b.mul(&nwe, &wb)?;
    dk = b.sub(&dk, &bnwe)?;
    let x = b.mul(&bnwe, k)?;
    d_g = b.sub(&d_g, &x)?;
    // The cotangents of `Aqk` (scale dO v_new^T) and of `L` (nw w^T - xu u^T = xu (w S0 - u)^T
    // = -xu v_new^T; strictly causal: the level masks keep it so) as one product.
    let nxu = b.neg(&xu)?;
    let lhs = b.concat(&[sd_o.clone(), nxu], 0)?;
    let m = b.matmul(&lhs, vn, (1, 1), p)?;
    let m = match segs {
        Some(s) => {
            let halves = [b.slice(&m, &[0, 0], &[C, C])?, b.slice(&m, &[C, 0], &[C, C])?];
            let kept = halves.map(|x| s.within(b, &x));
            let [x, y] = kept;
            b.concat(&[x?, y?], 0)?
        }
        None => m,
    };
    let m1 = b.slice(&m, &[0, 0], &[C, C])?;
    // Aqk's diagonal, scale q_t . k_t with no decay: its cotangent goes to dq and dk directly.
    let diag = rowdot(b, &m1, &t.eye)?;
    let diag = wide_k(b, &diag)?;
    let x = b.mul(k, &diag)?;
    dq = b.add(&dq, &x)?;
    let x = b.mul(q, &diag)?;
    dk = b.add(&dk, &x)?;
    let m = as_operand(b, &m, p)?;
    let LevelGrads { dq, mut dk, d_bk, d_exponents } = level_grads(b, [q, k], t, &m, p, [dq, dk])?;
    let x = b.mul(&d_bk, &wb)?;
    dk = b.add(&dk, &x)?;
    // dbeta: one reduction over the rows' lanes when K = V.
    let through_k = {
        let x = b.sub(&d_bk, &nwe)?;
        b.mul(&x, k)?
    };
    let through_v = b.mul(&xu, v)?;
    let dbeta = if kd == vd {
        let x = b.add(&through_k, &through_v)?;
        b.reduce(Reduction::Sum, &x, 1)?
    } else {
        let x = b.reduce(Reduction::Sum, &through_k, 1)?;
        let y = b.reduce(Reduction::Sum, &through_v, 1)?;
        b.add(&x, &y)?
    };
    // dg = sum over the exponent arrays of mask^T dE (G, the strict suffix, the mid anchor, the
    // levels: the masks' order), one product over them stacked.
    let mut all = vec![d_g, d_suffix];
    all.extend(d_exponents);
    let stacked = b.concat(&all, 0)?;
    // With gate parameters, which sum `dg` over every token, the gradients of `G` and of the
    // strict suffix (the masks that sum up to 64 of their rows) go in two bf16 parts: nearly
    // the accuracy of every array in two parts at a quarter of its cycles. Above 4-token
    // level-0 blocks the mid anchor's too: its row and column terms cancel on the tokens after
    // the anchor (`backward_levels::two_part_product`).
    let split = match (d.gate_params, d.levels().wide_level0()) {
        (false, _) => 0,
        (true, false) => 2 * C,
        (true, true) => 3 * C,
    };
    let dg = fold(b, masks_t, &stacked, p, split)?;
    Ok(Grads { dq, dk, dv, dbeta, dg, d_last })
}
