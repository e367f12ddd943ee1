//! The operands both KDA kernels declare, by name: the scalar-prefetched chunk tables, the
//! per-token inputs (one block, or a packed window's two), and how a chunk reads them. The
//! kernels' bodies and the programs that bind their operands use these same handles.

use kda_core::DType;
use kda_core::GateKind;

use super::dims::{KernelDims, Tokens, C};
use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType, Value};
use crate::lang::{Bindings, Body, Index, KernelBuilder, Offset, Operand, Ref, Semantics, Table, V};

/// The chunk tables of a kernel (`[NT]` i32 each): `first` and `last` mark a segment's first
/// and last chunk, `slot` its state slot; a packed kernel reads its tokens in place through
/// [`WindowTables`], or as whole blocks with the per-token segment ids `segments`
/// ([`KernelDims::segments`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct ChunkTabs {
    pub first: Table,
    pub last: Table,
    pub slot: Table,
    pub window: Option<WindowTables>,
    pub segments: Option<Ref>,
}

/// The tables with which a packed kernel ([`super::dims::Tokens::packed`]) finds chunk
/// `c`'s tokens `start[c] .. start[c] + len[c]` in place: the block indices `lo[c]` (of the
/// block holding `start[c]`) and `hi[c]` (the next one, clamped to the last block),
/// `off[c] = start[c] - 64 lo[c]` and `len[c]`; rows from `len[c]` on are read as zeros.
#[derive(Clone, Copy, Debug)]
pub(super) struct WindowTables {
    pub lo: Table,
    pub hi: Table,
    pub off: Table,
    pub len: Table,
}

/// One value per per-token input of a kernel, `q k v g beta` (handles, or the program's
/// tensors bound to them).
#[derive(Clone, Debug)]
pub(super) struct PerToken<T> {
    pub q: T,
    pub k: T,
    pub v: T,
    pub g: T,
    pub beta: T,
}

impl<T> PerToken<T> {
    /// The five in the kernels' operand order.
    pub fn each(&self) -> [&T; 5] {
        [&self.q, &self.k, &self.v, &self.g, &self.beta]
    }
}

/// A per-token input as a kernel declares it: its block (a packed window's `lo` block), and
/// for a packed kernel the window's `hi` block of the same tensor and the f32 scratch
/// `[128, w]` that holds the two side by side.
#[derive(Clone, Copy, Debug)]
pub(super) struct TokenIn {
    pub block: Ref,
    pub window: Option<WindowBlocks>,
}

/// The second block of a packed window and the scratch the two are read into.
#[derive(Clone, Copy, Debug)]
pub(super) struct WindowBlocks {
    pub hi: Ref,
    pub buf: Ref,
}

impl TokenIn {
    /// Binds `value` to each of the input's blocks.
    pub fn bind(&self, args: &mut Bindings, value: Value) -> Result<()> {
        args.input(self.block, value)?;
        match self.window {
            Some(w) => args.input(w.hi, value),
            None => Ok(()),
        }
    }
}

impl KernelDims {
    /// The builder both kernels start from, and its chunk tables: the grid (heads, rows, then
    /// the sequential steps of `chunks_per_step` chunks) and the scalar-prefetched tables
    /// (`first`, `last`, `slot`, and for packed tokens read in place the window tables), or the
    /// segment ids of [`KernelDims::segments`] (read in the backward's order with `reverse`).
    pub(super) fn builder(&self, name: &str, reverse: bool) -> (KernelBuilder, ChunkTabs) {
        let nt = self.chunks;
        let mut kb = KernelBuilder::new(name);
        kb.grid(self.heads, Semantics::Parallel)
            .grid(self.rows, Semantics::Parallel)
            .grid(nt / self.chunks_per_step(), Semantics::Arbitrary);
        let (first, last, slot) = (kb.table("first", nt), kb.table("last", nt), kb.table("slot", nt));
        let window = self.tokens.packed().then(|| WindowTables {
            lo: kb.table("lo", nt),
            hi: kb.table("hi", nt),
            off: kb.table("off", nt),
            len: kb.table("len", nt),
        });
        // A chunk's ids a lane-dense row each (`[1, T, 1]` would take XLA a relayout to 128
        // lanes a token).
        let segments = self.segments.then(|| {
            let n = self.chunks_per_step();
            let step = if reverse { Index::Const(nt / n - 1) + Index::Grid(2) * -1 } else { Index::Grid(2) };
            let ty = TensorType::new(DType::F32, &[nt, 1, C]);
            kb.input(Operand::blocked(
                "segments",
                ty,
                &[n, 1, C],
                vec![step, Index::Const(0), Index::Const(0)],
            ))
        });
        (kb, ChunkTabs { first, last, slot, window, segments })
    }

    /// Declares a per-token input of width `w` whose block `operand(table)` makes: one block,
    /// or (packed) one per window table, `lo` then `hi`, and the scratch `{name}_window`.
    pub(super) fn token_in(
        &self,
        kb: &mut KernelBuilder,
        tabs: &ChunkTabs,
        name: &str,
        w: i64,
        operand: impl Fn(Option<Table>) -> Result<Operand>,
    ) -> Result<TokenIn> {
        Ok(match tabs.window {
            None => TokenIn { block: kb.input(operand(None)?), window: None },
            Some(t) => {
                let (block, hi) = (kb.input(operand(Some(t.lo))?), kb.input(operand(Some(t.hi))?));
                let buf = kb.scratch(&format!("{name}_window"), TensorType::new(DType::F32, &[2 * C, w]));
                TokenIn { block, window: Some(WindowBlocks { hi, buf }) }
            }
        })
    }
}

impl KernelDims {
    /// Declares the per-token inputs `q k v g beta`, read in the backward's order of steps
    /// with `reverse`. Batch-first beta `[R * T, H]` is read in place, every head's column of
    /// a step's rows (its own picked in the body), rather than transposed by XLA.
    pub(super) fn declare_tokens(
        &self,
        kb: &mut KernelBuilder,
        tabs: &ChunkTabs,
        reverse: bool,
    ) -> Result<PerToken<TokenIn>> {
        let (k, x) = (self.k, self.dtype);
        let per_token = |kb: &mut KernelBuilder, name: &str, tokens: Tokens, dtype: DType, w: i64| {
            self.token_in(kb, tabs, name, w, |t| token_operand(name, self, tokens, dtype, w, t, reverse))
        };
        let q = per_token(kb, "q", self.tokens, self.qk, k)?;
        let kk = per_token(kb, "k", self.tokens, self.qk, k)?;
        let v = per_token(kb, "v", self.tokens, x, self.v)?;
        let g = per_token(kb, "g", self.tokens, self.g, k)?;
        let beta = if self.tokens == Tokens::BatchFirst {
            let (nt, n) = (self.chunks, self.chunks_per_step());
            let step = if reverse { Index::Const(nt / n - 1) + Index::Grid(2) * -1 } else { Index::Grid(2) };
            let at = vec![Index::Grid(1) * (nt / n) + step, Index::Const(0)];
            let rows = TensorType::new(x, &[self.rows * nt * C, self.heads]);
            TokenIn {
                block: kb.input(Operand::blocked("beta", rows, &[n * C, self.heads], at)),
                window: None,
            }
        } else {
            per_token(kb, "beta", self.beta_tokens(), x, 1)?
        };
        Ok(PerToken { q, k: kk, v, g, beta })
    }

    /// Declares the gate parameters `[H, 2, K]` of an in-kernel gate ([`kda_core::GateKind`]).
    pub(super) fn declare_gate(&self, kb: &mut KernelBuilder) -> Option<Ref> {
        (self.gate != GateKind::Preactivated).then(|| {
            let at = vec![Index::Grid(0), Index::Const(0), Index::Const(0)];
            let ty = TensorType::new(DType::F32, &[self.heads, 2, self.k]);
            kb.input(Operand::blocked("gate", ty, &[1, 2, self.k], at))
        })
    }

    /// Declares the exponent and level masks ([`super::terms::term_masks_kernel`]'s results).
    pub(super) fn declare_masks(&self, kb: &mut KernelBuilder) -> [Ref; 2] {
        [
            kb.input(Operand::whole(
                "exponent_masks",
                TensorType::new(self.mask_dtype(), &[self.levels().exponent_rows(), C]),
            )),
            kb.input(Operand::whole(
                "level_masks",
                TensorType::new(DType::F32, &[self.levels().level_rows(), C]),
            )),
        ]
    }
}

/// Where chunk `ci` of a grid step finds its tokens: rows `64 ci` of its blocks, or (packed)
/// rows `off .. off + 64` of its window's two blocks, the rows from `len` on not its own; with
/// [`KernelDims::segments`], its segment ids.
pub(super) struct ChunkRows {
    pub ci: i64,
    /// `off` and `len` of a packed chunk.
    pub window: Option<(V, V)>,
    /// The segment ids of a chunk of [`KernelDims::segments`].
    pub segments: Option<ChunkSegments>,
}

impl ChunkRows {
    /// Input `x` (of width `w`) of the chunk as f32 `[64, w]`.
    pub fn read(&self, b: &mut Body, x: &TokenIn, w: i64) -> Result<V> {
        let ci = self.ci;
        let block = |b: &mut Body, r: Ref| {
            let rows = [Offset::Const(0), Offset::Const(ci * C), Offset::Const(0)];
            let x = b.load(r, &rows, &[1, C, w])?;
            let x = b.to_dtype(&x, DType::F32)?;
            b.reshape(&x, &[C, w])
        };
        match (&self.window, x.window) {
            (Some((off, _)), Some(WindowBlocks { hi, buf })) => {
                for (half, r) in [x.block, hi].into_iter().enumerate() {
                    let x = block(b, r)?;
                    b.store(buf, &[Offset::Const(half as i64 * C), Offset::Const(0)], &x)?;
                }
                b.load(buf, &[Offset::Dyn(off.clone(), 1), Offset::Const(0)], &[C, w])
            }
            _ => block(b, x.block),
        }
    }

    /// Chunk `ci`'s rows: in its window (`off`, `len`), or with the segment ids of `segments`.
    pub fn new(b: &mut Body, ci: i64, window: Option<(V, V)>, segments: Option<Ref>) -> Result<Self> {
        let segments = match segments {
            Some(ids) => Some(ChunkSegments::read(b, ids, ci)?),
            None => None,
        };
        Ok(ChunkRows { ci, window, segments })
    }

    /// `x` with padding tokens' rows zero (segment ids; a window's rows past `len` are another
    /// segment's tokens, finite, which [`ChunkRows::keep`] drops where it matters).
    pub fn real(&self, b: &mut Body, x: &V) -> Result<V> {
        segment_rows(b, self.segments.as_ref(), x, SegmentRows::Real)
    }

    /// `x` with the rows from a packed chunk's `len` on zero (the next segment's tokens), or
    /// padding tokens' rows zero (segment ids).
    pub fn keep(&self, b: &mut Body, x: &V) -> Result<V> {
        if self.segments.is_some() {
            return self.real(b, x);
        }
        match &self.window {
            None => Ok(x.clone()),
            Some((_, len)) => {
                let rows = b.iota(&x.ty.dims, 0)?;
                let len = b.broadcast(len, &x.ty.dims)?;
                let inside = b.compare(Cmp::Lt, &rows, &len)?;
                let zero = b.splat(0.0, DType::F32, &x.ty.dims)?;
                b.select(&inside, x, &zero)
            }
        }
    }
}

/// Which rows of a chunk of [`KernelDims::segments`] a mask keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SegmentRows {
    /// Tokens (not padding).
    Real,
    /// The chunk's first segment's, the one the entering state belongs to.
    First,
    /// The chunk's last segment's, the one the leaving state belongs to.
    Last,
}

/// A chunk's segment ids ([`KernelDims::segments`]) and the masks made of them: every
/// boundary inside the chunk is a select, so a segment's results read only its own tokens,
/// bitwise.
pub(super) struct ChunkSegments {
    /// Token `t`'s id in row `t`, `[64, 1]` f32.
    ids: V,
    /// `[64, 64]` i1: the pairs of tokens of one segment.
    same: V,
    /// The row masks made so far, by rows and width (each made once a chunk).
    masks: std::cell::RefCell<Vec<((SegmentRows, i64), V)>>,
}

impl ChunkSegments {
    /// Chunk `ci`'s ids from the step's block of `segments` (`[n, 1, 64]`, one lane-dense row
    /// a chunk).
    pub fn read(b: &mut Body, segments: Ref, ci: i64) -> Result<Self> {
        let x = b.load(segments, &[Offset::Const(ci), Offset::Const(0), Offset::Const(0)], &[1, 1, C])?;
        let x = b.reshape(&x, &[1, C])?;
        let cols = b.broadcast(&x, &[C, C])?;
        let ids = b.reshape(&x, &[C, 1])?;
        let rows = b.broadcast(&ids, &[C, C])?;
        let same = b.compare(Cmp::Eq, &rows, &cols)?;
        Ok(ChunkSegments { ids, same, masks: Default::default() })
    }

    /// Row `r`'s id broadcast to `dims`.
    fn id_of_row(&self, b: &mut Body, r: i64, dims: &[i64]) -> Result<V> {
        let x = b.slice(&self.ids, &[r, 0], &[1, 1])?;
        b.broadcast(&x, dims)
    }

    /// `x` `[64, w]` with the rows outside `rows` zero (a select: the rows dropped may hold
    /// anything, padding tokens' inputs included).
    pub fn keep(&self, b: &mut Body, x: &V, rows: SegmentRows) -> Result<V> {
        let dims = x.ty.dims.clone();
        let inside = self.mask(b, rows, &dims)?;
        let zero = b.splat(0.0, DType::F32, &dims)?;
        b.select(&inside, x, &zero)
    }

    /// The i1 mask `[64, w]` of `rows`, made on first use.
    fn mask(&self, b: &mut Body, rows: SegmentRows, dims: &[i64]) -> Result<V> {
        let key = (rows, dims[1]);
        if let Some((_, m)) = self.masks.borrow().iter().find(|(k, _)| *k == key) {
            return Ok(m.clone());
        }
        let ids = b.broadcast(&self.ids, dims)?;
        let inside = match rows {
            SegmentRows::Real => {
                let zero = b.splat(0.0, DType::F32, dims)?;
                b.compare(Cmp::Ge, &ids, &zero)?
            }
            SegmentRows::First | SegmentRows::Last => {
                let r = if rows == SegmentRows::First { 0 } else { C - 1 };
                let id = self.id_of_row(b, r, dims)?;
                b.compare(Cmp::Eq, &ids, &id)?
            }
        };
        self.masks.borrow_mut().push((key, inside.clone()));
        Ok(inside)
    }

    /// `x` `[64, 64]` on the pairs of tokens of one segment, zero elsewhere.
    pub fn within(&self, b: &mut Body, x: &V) -> Result<V> {
        let zero = b.splat(0.0, DType::F32, &[C, C])?;
        b.select(&self.same, x, &zero)
    }

    /// The chunk terms `Aqk` and `L` (both parts) on each segment's pairs alone: the inverse of
    /// `I + L` then holds no pair of two segments either.
    pub fn within_terms(&self, b: &mut Body, t: &mut super::terms::ChunkTerms) -> Result<()> {
        t.aqk = self.within(b, &t.aqk)?;
        t.l_blocks = self.within(b, &t.l_blocks)?;
        t.l_rest = self.within(b, &t.l_rest)?;
        t.l = self.within(b, &t.l)?;
        Ok(())
    }

    /// `x` (a state, or the chunk's decay) where the chunk is one segment throughout, else
    /// zero: a boundary inside the chunk ends the entering state's segment there.
    pub fn if_whole(&self, b: &mut Body, x: &V) -> Result<V> {
        let dims = x.ty.dims.clone();
        let (first, last) = (self.id_of_row(b, 0, &dims)?, self.id_of_row(b, C - 1, &dims)?);
        let whole = b.compare(Cmp::Eq, &first, &last)?;
        let zero = b.splat(0.0, DType::F32, &dims)?;
        b.select(&whole, x, &zero)
    }
}

/// `x` with the rows outside `rows` zero for a chunk with segment ids `segs`
/// ([`ChunkSegments::keep`]); `x` as it is without them.
pub(super) fn segment_rows(
    b: &mut Body,
    segs: Option<&ChunkSegments>,
    x: &V,
    rows: SegmentRows,
) -> Result<V> {
    match segs {
        Some(s) => s.keep(b, x, rows),
        None => Ok(x.clone()),
    }
}

/// `x` where a chunk with segment ids `segs` is one segment throughout, else zero
/// ([`ChunkSegments::if_whole`]); `x` as it is without them.
pub(super) fn if_whole(b: &mut Body, segs: Option<&ChunkSegments>, x: &V) -> Result<V> {
    match segs {
        Some(s) => s.if_whole(b, x),
        None => Ok(x.clone()),
    }
}

/// `x` (a state `[K, V]`) where table `flag` is 0 at chunk `c`, else zero: the state entering
/// a segment's first chunk (forward, `first`) or leaving its last (backward, `last`) without
/// `h0` or `dht`. A select, so that a step's chunks schedule as one block.
pub(super) fn reset_where(b: &mut Body, (flag, c): (Table, &V), x: &V) -> Result<V> {
    let dims = x.ty.dims.clone();
    let set = b.read_table(flag, c)?;
    let set = b.broadcast(&set, &dims)?;
    let no = b.splat(0.0, DType::I32, &dims)?;
    let keep = b.compare(Cmp::Eq, &set, &no)?;
    let zero = b.splat(0.0, DType::F32, &dims)?;
    b.select(&keep, x, &zero)
}

/// Writes the state `x` `[K, V]` to the `[1, 1, K, V]` block `out` where `flag[c]` is set (a
/// segment's last chunk in the forward, its first in the backward); `zero` the i32 zero.
pub(super) fn store_state_where(
    b: &mut Body,
    (flag, c): (Table, &V),
    zero: &V,
    x: &V,
    out: Ref,
) -> Result<()> {
    let set = b.read_table(flag, c)?;
    let set = b.compare(Cmp::Ne, &set, zero)?;
    b.when(&set, |b| {
        let (k, v) = (x.ty.dims[0], x.ty.dims[1]);
        let y = b.reshape(x, &[1, 1, k, v])?;
        b.store_all(out, &y)
    })
}

/// The window tables' entries at chunk `c`, `[lo, hi, off, len]` (what [`super::forward::place`]
/// takes).
pub(super) fn window_at(b: &mut Body, t: &WindowTables, c: &V) -> Result<[V; 4]> {
    Ok([b.read_table(t.lo, c)?, b.read_table(t.hi, c)?, b.read_table(t.off, c)?, b.read_table(t.len, c)?])
}

/// The type, block and block indices of a per-token operand of width `w` held as `tokens`, for
/// the grid (heads, rows, chunks): packed operands are read through window table `table`
/// (`lo` or `hi` of the window tables) of `packed` tokens. With `reverse` grid step
/// `i` reads the row's steps from the last (the backward's order; fixed-length rows and lanes).
pub(super) fn token_operand(
    name: &str,
    d: &KernelDims,
    tokens: Tokens,
    dtype: DType,
    w: i64,
    table: Option<Table>,
    reverse: bool,
) -> Result<Operand> {
    let (h, r, nt, p, n) = (d.heads, d.rows, d.chunks, d.packed_tokens, d.chunks_per_step());
    let (g0, g1) = (Index::Grid(0), Index::Grid(1));
    let g2 = if reverse { Index::Const(nt / n - 1) + Index::Grid(2) * -1 } else { Index::Grid(2) };
    let (dims, map) = match (tokens, table) {
        (Tokens::Lanes, _) => ([h * r, nt * C, w], vec![g0 * r + g1, g2, Index::Const(0)]),
        (Tokens::HeadFirst, _) => ([h, r * nt * C, w], vec![g0, g1 * (nt / n) + g2, Index::Const(0)]),
        (Tokens::BatchFirst, _) => ([r, nt * C, h * w], vec![g1, g2, g0]),
        (Tokens::PackedHeadFirst, Some(t)) => ([h, p, w], vec![g0, Index::table(t, g2), Index::Const(0)]),
        (Tokens::PackedBatchFirst, Some(t)) => {
            ([1, p, h * w], vec![Index::Const(0), Index::table(t, g2), g0])
        }
        (_, None) => {
            return Err(TpuError::builder(
                "mosaic kernels",
                format!("packed operand {name} without a window"),
            ))
        }
    };
    Ok(Operand::blocked(name, TensorType::new(dtype, &dims), &[1, n * C, w], map))
}
