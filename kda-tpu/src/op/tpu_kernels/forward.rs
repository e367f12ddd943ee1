//! The chunked KDA forward as one Mosaic kernel (docs/kda.md, Chunks): a grid over heads and
//! rows (`parallel`; packed rows are one row of chunks) and chunk positions (`arbitrary`), the
//! state `S` `[K, V]` of a lane (a head of a row) in VMEM scratch across its chunks. Per chunk:
//! [`super::terms::chunk_terms`], `A = (I + L)^-1` ([`super::terms::unit_lower_inverse`]),
//! `u = A (beta v)`, `w = A (beta k e^G)`, `v_new = u - w S`, `o = scale (q e^G) S + Aqk v_new`,
//! `S <- e^(G_C) S + (k e^(G_C - G))^T v_new`.
//!
//! Segments come as three scalar-prefetched chunk tables, as the XLA programs read them: at a
//! chunk with `first[c] = 1` the state starts from `h0` of slot `slot[c]` (or zero), at one with
//! `last[c] = 1` it is written to `ht` of that slot. Fixed-length rows are the tables
//! `first = [1, 0, ..]`, `last = [.., 0, 1]`, `slot = 0`; one kernel serves both.
//!
//! Its per-token operands hold their tokens as [`Tokens`] says (the caller's head-first or
//! batch-first tensors in place, or lanes `[L, NT * 64, D]` that XLA made); the kernel widens
//! bf16 blocks, L2-normalises q and k when asked, applies the gate ([`kda_core::GateKind`]) and the floor to `g`, and
//! accumulates everything in f32. `h0` and `ht` are `[L, S, K, V]` f32 (`S` state slots per
//! lane), `h` `[L, NT, K, V]` the state entering every chunk (what the saved-state
//! backward reads; f32, or with the chunk terms [`KernelDims::state_dtype`]).

use kda_core::DType;
use kda_core::GateKind;

use super::super::chunk::{activate, chunk_output, chunk_state_next, l2_normalise, ChunkUpdate, UpdateTerm};
use super::dims::{KernelDims, Tokens, C};
use super::operands::{
    if_whole, reset_where, segment_rows, store_state_where, token_operand, window_at, ChunkRows,
    ChunkSegments, ChunkTabs, PerToken, SegmentRows, TokenIn,
};
use super::terms::{chunk_terms, unit_lower_inverse_of_parts, ChunkTerms, TermScratch};
use crate::error::Result;
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Binary, Body, MatPrecision, Offset, Reduction, Ref, V};
use crate::lang::{Cost, Index, Kernel, KernelBuilder, MosaicParams, Operand};

/// The forward kernel's operands, results and scratch by name: what its body reads and writes
/// and what the program around it binds and takes.
#[derive(Clone, Debug)]
pub(super) struct ForwardRefs {
    /// The chunk tables.
    pub tabs: ChunkTabs,
    /// `q k v g beta`.
    pub tokens: PerToken<TokenIn>,
    /// The gate parameters `[H, 2, K]` of an in-kernel gate ([`kda_core::GateKind`]).
    pub gate: Option<Ref>,
    /// `h0` `[L, S, K, V]`.
    pub h0: Option<Ref>,
    /// The exponent and level masks ([`super::terms::term_masks_kernel`]'s first results).
    pub masks: [Ref; 2],
    /// `o`.
    pub o: Ref,
    /// `ht` `[L, S, K, V]`.
    pub ht: Option<Ref>,
    /// `h` `[L, NT, K, V]`, the state entering every chunk.
    pub h: Option<Ref>,
    /// The chunk terms `a aqk` `[L, NT, 64, 64]`.
    pub terms: Option<[Ref; 2]>,
    state: Ref,
    sums: Ref,
    place_o: Option<Ref>,
}

/// The forward kernel and its operands by name.
pub(super) struct ForwardKernel {
    pub kernel: Kernel,
    pub refs: ForwardRefs,
}

/// The forward kernel of `d` with output scale `scale`, on the grid (heads, rows: parallel;
/// chunks: arbitrary). Its operands ([`ForwardRefs`]): the chunk tables (`slot` must not
/// decrease, padding chunks after the last segment repeating its slot, since a result block
/// revisited later would be written back stale), then `q k v g beta [gate] [h0] exponent_masks
/// level_masks` (beta `[L, T, 1]` for [`Tokens::Lanes`], `[R * T, H]` for
/// [`Tokens::BatchFirst`], else `[H, R * T, 1]`; `h0` `[L, S, K, V]` f32; the masks are the
/// results of [`super::terms::term_masks_kernel`] for [`KernelDims::mask_dtype`]); its
/// results `o [ht] [h] [a aqk]` (`o` laid out as `v`; read in place packed, f32 `[H, P, V]` or
/// `[1, P, H * V]` with padding tokens unwritten: [`place`]).
pub(super) fn forward_kernel(d: KernelDims, scale: f64) -> Result<ForwardKernel> {
    d.check("mosaic forward")?;
    let (mut kb, refs) = declare_forward(&d)?;
    let cx = ForwardStep { d: &d, r: &refs, scale, p: d.precision(), g_passes: d.g_passes() };
    kb.cost(forward_cost(&d));
    if let Some(bytes) = d.vmem_limit() {
        kb.params(MosaicParams::default().with_vmem_limit(bytes)?);
    }
    let kernel = kb.build(|b| forward_step(b, &cx))?;
    Ok(ForwardKernel { kernel, refs })
}

/// The forward kernel's builder and its operands (in the order [`forward_kernel`] lists).
fn declare_forward(d: &KernelDims) -> Result<(KernelBuilder, ForwardRefs)> {
    let (l, k, v, x, n) = (d.lanes(), d.k, d.v, d.dtype, d.chunks_per_step());
    let (g0, g1, g2) = (Index::Grid(0), Index::Grid(1), Index::Grid(2));
    let lane = || g0.clone() * d.rows + g1.clone();
    let ty = |dt: DType, dims: &[i64]| TensorType::new(dt, dims);
    let (mut kb, tabs) = d.builder("kda_forward", false);
    // A step's state slot is its first chunk's (steps of several chunks are fixed-length rows,
    // one slot per lane).
    let slot = || vec![lane(), Index::table(tabs.slot, g2.clone() * n), Index::Const(0), Index::Const(0)];
    let (state, sums) =
        (kb.scratch("state", ty(DType::F32, &[k, v])), kb.scratch("sums", ty(DType::F32, &[C, k])));
    let tokens = d.declare_tokens(&mut kb, &tabs, false)?;
    let gate = d.declare_gate(&mut kb);
    let h0 = d.h0.then(|| {
        kb.input(Operand::blocked("h0", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()))
    });
    let masks = d.declare_masks(&mut kb);
    let packed = d.tokens.packed();
    let o = kb.output(if packed {
        // A head's packed tokens whole, in f32: every chunk's rows go to their tokens
        // ([`place`]), the block written back once, after the head's last chunk; padding tokens
        // hold whatever was there, and the caller zeroes them.
        let p = d.packed_tokens;
        let (dims, at) = match d.tokens {
            Tokens::PackedBatchFirst => {
                ([1, p, d.heads * v], vec![Index::Const(0), Index::Const(0), g0.clone()])
            }
            _ => ([d.heads, p, v], vec![g0.clone(), Index::Const(0), Index::Const(0)]),
        };
        Operand::blocked("o", ty(DType::F32, &dims), &[1, p, v], at)
    } else {
        token_operand("o", d, d.tokens, x, v, None, false)?
    });
    let ht = d.ht.then(|| {
        kb.output(Operand::blocked("ht", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()))
    });
    let chunks_at = || vec![lane(), g2.clone(), Index::Const(0), Index::Const(0)];
    let h = d.states.then(|| {
        let dims = [l, d.saved_chunks, k, v];
        kb.output(Operand::blocked("h", ty(d.state_dtype(), &dims), &[1, n, k, v], chunks_at()))
    });
    let terms = d.terms.then(|| {
        ["a", "aqk"].map(|name| {
            let dims = [l, d.saved_chunks, C, C];
            kb.output(Operand::blocked(name, ty(d.mask_dtype(), &dims), &[1, n, C, C], chunks_at()))
        })
    });
    // The rows a packed chunk places around its `o`.
    let place_o = packed.then(|| kb.scratch("place_o", ty(DType::F32, &[3 * C, v])));
    let refs = ForwardRefs { tabs, tokens, gate, h0, masks, o, ht, h, terms, state, sums, place_o };
    Ok((kb, refs))
}

/// The forward kernel's analytic cost (docs/kda.md, Work): per token and head,
/// 6CK + 4CV + 6KV + (2/3)C^2 flops; four exponentials per gate element and the gate's own;
/// every operand and result once through HBM (packed windows read every block twice, as a
/// chunk's upper, then the next one's lower block).
fn forward_cost(d: &KernelDims) -> Cost {
    let (l, nt, k, v) = (d.lanes(), d.chunks, d.k, d.v);
    let t = nt * C;
    let (cf, kf, vf) = (C as f64, k as f64, v as f64);
    let flops = (l * t) as f64 * (6.0 * cf * kf + 4.0 * cf * vf + 6.0 * kf * vf + 2.0 / 3.0 * cf * cf);
    let bytes_of = |t: DType| f64::from(t.bit_width() / 8);
    let states = (l * k * v) as f64
        * 4.0
        * (d.slots * (i64::from(d.h0) + i64::from(d.ht)) + nt * i64::from(d.states)) as f64;
    let reads = if d.tokens.packed() { 2.0 } else { 1.0 };
    let bytes = (l * t) as f64
        * reads
        * (2.0 * kf * bytes_of(d.qk) + (vf + 1.0) * bytes_of(d.dtype) + kf * bytes_of(d.g))
        + (l * t) as f64 * vf * bytes_of(d.dtype)
        + states;
    // The gate's own: softplus an exponential and a log1p, the lower bound one tanh.
    let gate_ops = match d.gate {
        GateKind::Preactivated => 0.0,
        GateKind::Softplus => 2.0,
        GateKind::LowerBound(_) => 1.0,
    };
    let transcendentals =
        (l * t * k) as f64 * (4.0 + gate_ops) + if d.l2norm { 2.0 * (l * t) as f64 } else { 0.0 };
    Cost { flops, transcendentals, bytes }
}

/// What every step of the forward kernel's body reads.
struct ForwardStep<'a> {
    d: &'a KernelDims,
    r: &'a ForwardRefs,
    scale: f64,
    p: MatPrecision,
    /// The bf16 parts the sums of `g` take ([`chunk_terms`]).
    g_passes: usize,
}

impl ForwardStep<'_> {
    fn term_scratch(&self) -> TermScratch {
        TermScratch::of_kernel(self.r.masks, self.r.sums, self.d.levels())
    }
}

/// A chunk of a grid step between its chunk-local terms and its state update: its index `c`,
/// its terms, `u = A (beta v)` and `w = A (beta k e^G)`, and its segment ids
/// ([`KernelDims::segments`]).
struct ChunkWork {
    ci: i64,
    c: V,
    terms: ChunkTerms,
    u: V,
    w: V,
    segs: Option<ChunkSegments>,
}

/// A chunk's index, terms, `beta v` and segment ids, before its inverse.
struct ChunkLocal {
    c: V,
    terms: ChunkTerms,
    bv: V,
    segs: Option<ChunkSegments>,
}

/// One grid step: first every chunk's loads and chunk-local terms (no stores yet, so that the
/// compiler may run a later chunk's terms beside an earlier chunk's state update), the
/// inverses side by side (each a chain of dependent products), `u` and `w`, then the state
/// updates in chunk order.
fn forward_step(b: &mut Body, cx: &ForwardStep) -> Result<()> {
    let (d, n) = (cx.d, cx.d.chunks_per_step());
    let step = b.program_id(2)?;
    let zero = b.index(0)?;
    // Batch-first beta: the mask of this step's head among the `H` lanes of its rows.
    let head_column = if d.tokens == Tokens::BatchFirst {
        let head = b.program_id(0)?;
        let head = b.broadcast(&head, &[C, d.heads])?;
        let ids = b.iota(&[C, d.heads], 1)?;
        Some((b.compare(Cmp::Eq, &ids, &head)?, b.splat(0.0, DType::F32, &[C, d.heads])?))
    } else {
        None
    };
    let mut local = Vec::new();
    for ci in 0..n {
        local.push(chunk_local(b, cx, ci, &step, head_column.as_ref())?);
    }
    let inverses = local
        .iter()
        .map(|x| unit_lower_inverse_of_parts(b, &x.terms.l_blocks, &x.terms.l_rest, &x.terms.f.eye, cx.p))
        .collect::<Result<Vec<_>>>()?;
    let mut work = Vec::new();
    for (ci, (ChunkLocal { c, terms, bv, segs }, a)) in (0..n).zip(local.into_iter().zip(inverses)) {
        if let Some(outs) = cx.r.terms {
            let at = [Offset::Const(0), Offset::Const(ci), Offset::Const(0), Offset::Const(0)];
            for (out, x) in outs.into_iter().zip([&a, &terms.aqk]) {
                let x = b.to_dtype(x, d.mask_dtype())?;
                let x = b.reshape(&x, &[1, 1, C, C])?;
                b.store(out, &at, &x)?;
            }
        }
        let u = b.matmul(&a, &bv, (1, 0), cx.p)?;
        let w = b.matmul(&a, &terms.f.kbg, (1, 0), cx.p)?;
        work.push(ChunkWork { ci, c, terms, u, w, segs });
    }
    let mut carried: Option<V> = None;
    for chunk in work {
        carried = state_update(b, cx, chunk, carried, &zero)?;
    }
    Ok(())
}

/// Chunk `ci` of the step: its index `c`, its chunk terms (with segments, on each segment's
/// pairs alone), `beta v` and its segment ids.
fn chunk_local(
    b: &mut Body,
    cx: &ForwardStep,
    ci: i64,
    step: &V,
    head_column: Option<&(V, V)>,
) -> Result<ChunkLocal> {
    let (d, r, n) = (cx.d, cx.r, cx.d.chunks_per_step());
    let c = if n == 1 {
        step.clone()
    } else {
        let (nv, iv) = (b.index(n)?, b.index(ci)?);
        let base = b.index_op(Binary::Mul, step, &nv)?;
        b.index_op(Binary::Add, &base, &iv)?
    };
    let window = match r.tabs.window {
        Some(t) => Some((b.read_table(t.off, &c)?, b.read_table(t.len, &c)?)),
        None => None,
    };
    let rows = ChunkRows::new(b, ci, window, r.tabs.segments)?;
    let beta = if let Some((mine, zero)) = head_column {
        // Head `h`'s column of the rows `[64, H]`: the others zeroed, then a lane sum (exact:
        // one term).
        let at = [Offset::Const(ci * C), Offset::Const(0)];
        let all = b.load(r.tokens.beta.block, &at, &[C, d.heads])?;
        let all = b.to_dtype(&all, DType::F32)?;
        let picked = b.select(mine, &all, zero)?;
        b.reduce(Reduction::Sum, &picked, 1)?
    } else {
        rows.read(b, &r.tokens.beta, 1)?
    };
    let t = &r.tokens;
    let (mut q, mut kk) = (rows.read(b, &t.q, d.k)?, rows.read(b, &t.k, d.k)?);
    let (vv, g) = (rows.read(b, &t.v, d.v)?, rows.read(b, &t.g, d.k)?);
    if d.l2norm {
        q = l2_normalise(b, &q)?;
        kk = l2_normalise(b, &kk)?;
    }
    // Rows past a packed chunk's tokens: k, v, beta and the activated g zero (no part in the
    // state, a decay of 1); q as read (each row of q reaches only its own row of `o`, and those
    // rows are dropped).
    // Padding tokens' inputs may hold anything: zero, so that every product stays finite.
    let q = rows.real(b, &q)?;
    let (kk, vv, beta) = (rows.keep(b, &kk)?, rows.keep(b, &vv)?, rows.keep(b, &beta)?);
    let g = activate(b, &g, d.gate, r.gate)?;
    let g = rows.keep(b, &g)?;
    let segs = rows.segments;
    let mut terms = chunk_terms(b, &q, &kk, &g, &beta, cx.scale, cx.term_scratch(), cx.p, cx.g_passes)?;
    if let Some(s) = &segs {
        s.within_terms(b, &mut terms)?;
    }
    let bv = b.broadcast(&beta, &[C, d.v])?;
    let bv = b.mul(&vv, &bv)?;
    Ok(ChunkLocal { c, terms, bv, segs })
}

/// A chunk's state update after the state `carried` from the step's previous chunk (fixed-length
/// rows) or from scratch: `v_new = u - w S`, `o = scale (q e^G) S + Aqk v_new`,
/// `S <- e^(G_C) S + (k e^(G_C - G))^T v_new`; returns the state a fixed-length row carries on.
fn state_update(
    b: &mut Body,
    cx: &ForwardStep,
    chunk: ChunkWork,
    carried: Option<V>,
    zero: &V,
) -> Result<Option<V>> {
    let (d, r, p) = (cx.d, cx.r, cx.p);
    let (k, v) = (d.k, d.v);
    let ChunkWork { ci, c, terms, u, w, segs } = chunk;
    let start = |b: &mut Body| match r.h0 {
        Some(h0) => {
            let h0 = b.load_all(h0)?;
            b.reshape(&h0, &[k, v])
        }
        None => b.splat(0.0, DType::F32, &[k, v]),
    };
    let first = b.read_table(r.tabs.first, &c)?;
    // The state entering the chunk: fixed-length rows carry it as a value from the step's
    // previous chunk, or select it at the step's first (the row's first chunk starts from `h0`;
    // no branch, so that a step's chunks schedule as one block); segments reset it under a
    // branch.
    let s = if let Some(prev) = carried {
        // Segments: the state resets where a segment starts at the chunk's first row.
        match segs {
            Some(_) => reset_where(b, (r.tabs.first, &c), &prev)?,
            None => prev,
        }
    } else if d.fixed_rows() {
        let prev = b.load_all(r.state)?;
        let h0 = start(b)?;
        let wide = b.broadcast(&first, &[k, v])?;
        let no = b.splat(0.0, DType::I32, &[k, v])?;
        let reset = b.compare(Cmp::Ne, &wide, &no)?;
        b.select(&reset, &h0, &prev)?
    } else {
        let at_first = b.compare(Cmp::Ne, &first, zero)?;
        b.when(&at_first, |b| {
            let h0 = start(b)?;
            b.store_all(r.state, &h0)
        })?;
        b.load_all(r.state)?
    };
    if let Some(out) = r.h {
        let h = b.to_dtype(&s, d.state_dtype())?;
        let h = b.reshape(&h, &[1, 1, k, v])?;
        b.store(out, &[Offset::Const(0), Offset::Const(ci), Offset::Const(0), Offset::Const(0)], &h)?;
    }
    // With segments the entering state reaches the chunk's first segment alone.
    let segs = segs.as_ref();
    let mut mask = |b: &mut Body, term: UpdateTerm, x: &V| match term {
        UpdateTerm::Entering => segment_rows(b, segs, x, SegmentRows::First),
        UpdateTerm::Output => segment_rows(b, segs, x, SegmentRows::Real),
        UpdateTerm::Kept => if_whole(b, segs, x),
        UpdateTerm::Leaving => segment_rows(b, segs, x, SegmentRows::Last),
    };
    let update = ChunkUpdate {
        state: &s,
        w: &w,
        u: &u,
        qg: &terms.f.qg,
        kg: &terms.f.kg,
        aqk: &terms.aqk,
        last_decay: &terms.f.eg_last,
        scale: Some(cx.scale),
        precision: p,
    };
    let (v_new, o) = chunk_output(b, &update, &mut mask)?;
    match (r.tabs.window, r.place_o) {
        (Some(t), Some(buf)) => {
            let tables = window_at(b, &t, &c)?;
            place(b, r.o, buf, &o, &tables)?;
        }
        _ => {
            let o = b.to_dtype(&o, d.dtype)?;
            let o = b.reshape(&o, &[1, C, v])?;
            b.store(r.o, &[Offset::Const(0), Offset::Const(ci * C), Offset::Const(0)], &o)?;
        }
    }
    // With segments the leaving state is the chunk's last segment's: the entering one only if
    // no segment starts inside the chunk, and only the last segment's tokens.
    let s_next = chunk_state_next(b, &update, &v_new, &mut mask)?;
    if d.fixed_rows() {
        // A row's final state: its last chunk's, the last write to its `ht` block.
        if ci + 1 == d.chunks_per_step() {
            b.store_all(r.state, &s_next)?;
            if let Some(ht) = r.ht {
                let x = b.reshape(&s_next, &[1, 1, k, v])?;
                b.store_all(ht, &x)?;
            }
        }
        return Ok(Some(s_next));
    }
    b.store_all(r.state, &s_next)?;
    if let Some(ht) = r.ht {
        store_state_where(b, (r.tabs.last, &c), zero, &s_next, ht)?;
    }
    Ok(None)
}

/// Writes a packed chunk's rows `x` `[64, w]` (f32: `o`, or a gradient) to its tokens in the head's result
/// block `out`: `x` goes to rows `64 .. 128` of `buf` (`[192, w]`), whose rows from `64 - off`
/// and from `128 - off` are the chunk's rows as they fall in its blocks `lo` and `hi`; each
/// block takes them where its tokens are the chunk's (read, select, write, `lo` first: with
/// `hi = lo` the second write keeps the first's rows). Nothing else of `buf` is ever selected,
/// and tokens no chunk holds (padding) are left as they are: the caller zeroes them.
pub(super) fn place(b: &mut Body, out: Ref, buf: Ref, x: &V, [lo, hi, off, len]: &[V; 4]) -> Result<()> {
    let w = x.ty.dims[1];
    b.store(buf, &[Offset::Const(C), Offset::Const(0)], x)?;
    let rows = b.iota(&[C, w], 0)?;
    let wide = |b: &mut Body, i: &V| b.broadcast(i, &[C, w]);
    let (c64, c128) = (b.index(C)?, b.index(2 * C)?);
    let end = b.index_op(Binary::Add, off, len)?;
    for (block, from) in [(lo, &c64), (hi, &c128)] {
        let start = b.index_op(Binary::Sub, from, off)?;
        let part = b.load(buf, &[Offset::Dyn(start, 1), Offset::Const(0)], &[C, w])?;
        // Token `64 block + r` is the chunk's when `off <= r + (64 if hi) < off + len`.
        let base = b.index_op(Binary::Sub, from, &c64)?;
        let first = b.index_op(Binary::Sub, off, &base)?;
        let last = b.index_op(Binary::Sub, &end, &base)?;
        let (first, last) = (wide(b, &first)?, wide(b, &last)?);
        let after = b.compare(Cmp::Ge, &rows, &first)?;
        let before = b.compare(Cmp::Lt, &rows, &last)?;
        let row0 = b.index_op(Binary::Mul, block, &c64)?;
        let at = [Offset::Const(0), Offset::Dyn(row0, C), Offset::Const(0)];
        let old = b.load(out, &at, &[1, C, w])?;
        let old = b.reshape(&old, &[C, w])?;
        let new = b.select(&before, &part, &old)?;
        let new = b.select(&after, &new, &old)?;
        let new = b.reshape(&new, &[1, C, w])?;
        b.store(out, &at, &new)?;
    }
    Ok(())
}
