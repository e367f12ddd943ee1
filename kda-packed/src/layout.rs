//! The two sides of loading and compaction: packed per-token tensors in the caller's layout and
//! the chunk-aligned `[H, NT, C, D]` layout.

use crate::plan::SegmentPlan;
use crate::tables::IndexTables;
use kda_core::{fmt_shape, KdaError, Layout, Result, Shape};

/// A packed per-token tensor: `[H, B, T, D]` (head-first) or `[B, T, H, D]` (batch-first).
///
/// Per-token scalars such as beta are the same with `D = 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedShape {
    /// Where the head axis sits.
    pub layout: Layout,
    /// Heads.
    pub h: usize,
    /// Batch rows.
    pub b: usize,
    /// Tokens per row.
    pub t: usize,
    /// Feature width (1 for per-token scalars).
    pub d: usize,
}

impl PackedShape {
    /// A packed shape from its sizes.
    pub fn new(layout: Layout, h: usize, b: usize, t: usize, d: usize) -> Self {
        Self { layout, h, b, t, d }
    }
    /// Reads a rank-4 per-token tensor's shape in `layout`.
    pub fn of_tokens(layout: Layout, dims: &[usize]) -> Result<Self> {
        if dims.len() != 4 {
            let axes = match layout {
                Layout::HeadFirst => "[H, B, T, D]",
                Layout::BatchFirst => "[B, T, H, D]",
            };
            return Err(KdaError::shape("packed", format!("rank 4 {axes}"), fmt_shape(dims)));
        }
        let (h, b, t) = layout.try_hbt(dims).map_err(|e| e.with_arg("packed"))?;
        Ok(Self::new(layout, h, b, t, dims[3]))
    }
    /// Reads a per-token scalar's shape (`[H, B, T]` / `[B, T, H]`, optionally with a trailing 1).
    pub fn of_scalars(layout: Layout, dims: &[usize]) -> Result<Self> {
        if dims.len() == 3 || (dims.len() == 4 && dims[3] == 1) {
            let (h, b, t) = layout.try_hbt(dims).map_err(|e| e.with_arg("packed"))?;
            return Ok(Self::new(layout, h, b, t, 1));
        }
        let axes = match layout {
            Layout::HeadFirst => "[H, B, T] or [H, B, T, 1]",
            Layout::BatchFirst => "[B, T, H] or [B, T, H, 1]",
        };
        Err(KdaError::shape("packed", axes, fmt_shape(dims)))
    }
    /// The rank-4 shape in this layout.
    pub fn dims(&self) -> Shape {
        self.layout.token_shape(self.h, self.b, self.t, self.d)
    }
    /// Element count.
    pub fn len(&self) -> usize {
        self.h * self.b * self.t * self.d
    }
    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Flat index of element 0 of packed token `tok = b * T + t` for head `h`.
    #[inline]
    pub fn token_offset(&self, h: usize, tok: usize) -> usize {
        match self.layout {
            Layout::HeadFirst => (h * self.b * self.t + tok) * self.d,
            Layout::BatchFirst => (tok * self.h + h) * self.d,
        }
    }
    /// `Ok` when the rows and tokens match the plan's B and T.
    pub fn check_plan(&self, plan: &SegmentPlan) -> Result<()> {
        self.check_bt(plan.b(), plan.t())
    }
    /// `Ok` when the rows and tokens match the tables' B and T.
    pub fn check_tables(&self, tables: &IndexTables) -> Result<()> {
        self.check_bt(tables.b, tables.t)
    }
    fn check_bt(&self, b: usize, t: usize) -> Result<()> {
        if self.b != b || self.t != t {
            return Err(KdaError::shape(
                "packed",
                format!("B = {b}, T = {t} from the segments"),
                format!("B = {}, T = {} in {}", self.b, self.t, fmt_shape(&self.dims())),
            ));
        }
        Ok(())
    }
    /// `Ok` when `len` elements fill this shape.
    pub fn check_len(&self, arg: &str, len: usize) -> Result<()> {
        check_len(arg, len, &self.dims())
    }
    /// The aligned shape of `plan`, once the plan's fit to this shape, a packed tensor of
    /// `packed` elements and an aligned one of `aligned` elements are checked.
    pub(crate) fn plan_aligned(
        &self,
        plan: &SegmentPlan,
        packed: usize,
        aligned: usize,
    ) -> Result<AlignedShape> {
        self.check_plan(plan)?;
        self.check_len("packed", packed)?;
        let a = self.aligned(plan.num_chunks(), plan.chunk_size());
        a.check_len("aligned", aligned)?;
        Ok(a)
    }

    /// The runs `(token, slot, elements)` that carry `plan`'s real tokens between this packed
    /// layout and the aligned one `a`, head by head, chunk by chunk: one run per chunk
    /// head-first (its tokens are contiguous), one per token batch-first.
    pub(crate) fn chunk_runs<'a>(
        &'a self,
        plan: &'a SegmentPlan,
        a: AlignedShape,
    ) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
        (0..self.h).flat_map(move |h| {
            plan.chunks().iter().enumerate().flat_map(move |(ci, ch)| {
                let (tok0, slot0) = (ch.row * self.t + ch.start, a.slot_offset(h, ci * a.c));
                let (runs, len) = match self.layout {
                    Layout::HeadFirst => (1, ch.len * a.d),
                    Layout::BatchFirst => (ch.len, a.d),
                };
                (0..runs).map(move |i| (self.token_offset(h, tok0 + i), slot0 + i * a.d, len))
            })
        })
    }

    /// The element offsets `(token, slot)` of every aligned slot that holds a packed token
    /// (`tables.slot_token`), head by head: where a device gather reads and a scatter writes.
    pub(crate) fn slot_moves<'a>(
        &'a self,
        tables: &'a IndexTables,
        a: AlignedShape,
    ) -> impl Iterator<Item = (usize, usize)> + 'a {
        (0..self.h).flat_map(move |h| {
            tables.slot_token.iter().enumerate().filter_map(move |(s, &tok)| {
                usize::try_from(tok).ok().map(|tok| (self.token_offset(h, tok), a.slot_offset(h, s)))
            })
        })
    }
    /// The aligned shape with `chunks` chunks of `c` slots and the same H and D.
    pub fn aligned(&self, chunks: usize, c: usize) -> AlignedShape {
        AlignedShape { h: self.h, chunks, c, d: self.d }
    }
}

/// The chunk-aligned layout `[H, NT, C, D]`: slot `chunk * C + i` of head `h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AlignedShape {
    /// Heads.
    pub h: usize,
    /// Chunks NT (exact count or static capacity).
    pub chunks: usize,
    /// Chunk size C.
    pub c: usize,
    /// Feature width (1 for per-token scalars).
    pub d: usize,
}

impl AlignedShape {
    /// The shape `[H, NT, C, D]`.
    pub fn dims(&self) -> [usize; 4] {
        [self.h, self.chunks, self.c, self.d]
    }
    /// Slots per head, `NT * C`.
    pub fn slots(&self) -> usize {
        self.chunks * self.c
    }
    /// Element count.
    pub fn len(&self) -> usize {
        self.h * self.slots() * self.d
    }
    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Flat index of element 0 of slot `s` for head `h`.
    #[inline]
    pub fn slot_offset(&self, h: usize, s: usize) -> usize {
        (h * self.slots() + s) * self.d
    }
    /// `Ok` when `len` elements fill this shape.
    pub fn check_len(&self, arg: &str, len: usize) -> Result<()> {
        check_len(arg, len, &self.dims())
    }
    /// Reads an aligned tensor's shape: `[H, NT, C, D]`, or `[H, NT, C]` (and `[.., 1]`) for scalars.
    pub fn of_dims(dims: &[usize], scalar: bool) -> Result<Self> {
        match (dims, scalar) {
            ([h, nt, c, d], false) => Ok(Self { h: *h, chunks: *nt, c: *c, d: *d }),
            ([h, nt, c], true) | ([h, nt, c, 1], true) => Ok(Self { h: *h, chunks: *nt, c: *c, d: 1 }),
            _ => Err(KdaError::shape(
                "aligned",
                if scalar { "[H, NT, C] or [H, NT, C, 1]" } else { "rank 4 [H, NT, C, D]" },
                fmt_shape(dims),
            )),
        }
    }
    /// `Ok` when NT and C match `chunks` and `c`.
    pub fn check_chunks(&self, chunks: usize, c: usize) -> Result<()> {
        if self.chunks != chunks || self.c != c {
            return Err(KdaError::shape(
                "aligned",
                format!("NT = {chunks} chunks of C = {c} from the plan"),
                fmt_shape(&self.dims()),
            ));
        }
        Ok(())
    }
}

/// `Ok` when `len` elements fill a tensor of `dims`, else a shape error on `arg` naming both.
fn check_len(arg: &str, len: usize, dims: &[usize]) -> Result<()> {
    let want: usize = dims.iter().product();
    if len != want {
        return Err(KdaError::shape(
            arg,
            format!("{want} elements for {}", fmt_shape(dims)),
            format!("{len} elements"),
        ));
    }
    Ok(())
}
