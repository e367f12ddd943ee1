//! What every chunk-parallel GPU kernel reads of a chunk: its per-token inputs in f32, with
//! the L2 norm and the gate applied in the kernel and the rows past the chunk's tokens held at
//! zero (so that a packed chunk's padding decays nothing and writes nothing).

use kda_core::{DType, GateKind};

use crate::error::Result;
use crate::hlo::{Cmp, TensorType, Value};
use crate::lang::{Binary, Bindings, Body, Index, KernelBuilder, Offset, Operand, Reduction, Ref, Table, V};
use crate::op::chunk::{activate_columns, l2_normalise_with_scale};

use super::{ForwardShape, PackedTables, TokenLayout, C};

/// The per-token operands of a chunk-parallel kernel (grid: lanes, chunk positions).
#[derive(Clone, Copy, Debug)]
pub struct TokenRefs {
    /// `q` `[L, T, K]` in the shape's dtype.
    pub q: Ref,
    /// `k` `[L, T, K]`.
    pub k: Ref,
    /// `v` `[L, T, V]`, for kernels that read it.
    pub v: Option<Ref>,
    /// The raw or pre-activated log-decay `[L, T, K]` in [`ForwardShape::g_dtype`].
    pub g: Ref,
    /// `beta` `[L, T, 1]`.
    pub beta: Ref,
    /// The in-kernel gate's parameters `[L, 2, K]` f32 (`exp(a_log)`, `dt_bias`).
    pub gate: Option<Ref>,
    /// Tokens held by each chunk position `[NT]` (the rest is padding); none for rows read in
    /// place, whose chunks are whole.
    pub valid: Option<Table>,
    /// Packed rows read in place: where each chunk position's rows are.
    pub packed: Option<PackedRefs>,
    /// How the per-token operands are laid out.
    pub layout: TokenLayout,
    /// Key columns of `q`, `k`, `g` and the gate in a program's block: `K`, or the block of
    /// grid axis 2 ([`declare_key_blocks`]).
    pub width: i64,
    /// `q` and `k` whole, for the L2 norm's scales where a program reads a block of columns.
    pub whole: Option<(Ref, Ref)>,
}

impl TokenRefs {
    /// The rows of the step's chunk (grid index 1) in these operands.
    pub fn rows(&self, b: &mut Body) -> Result<ChunkRows> {
        ChunkRows::of_step(b, self.layout, self.packed.as_ref())
    }
}

/// Declares the per-token operands of `s` on `kb`, whose grid is (lanes, chunk positions).
pub fn declare(kb: &mut KernelBuilder, s: &ForwardShape, with_v: bool) -> TokenRefs {
    declare_width(kb, s, with_v, s.k)
}

/// [`declare`] for a kernel whose grid axis 2 runs over blocks of `width` key columns: a
/// program reads its block of `q`, `k`, `g` and the gate's parameters (and, with the L2 norm,
/// `q` and `k` whole for the scales).
pub fn declare_key_blocks(kb: &mut KernelBuilder, s: &ForwardShape, width: i64) -> TokenRefs {
    declare_width(kb, s, false, width)
}

fn declare_width(kb: &mut KernelBuilder, s: &ForwardShape, with_v: bool, width: i64) -> TokenRefs {
    let (l, t, k) = (s.lanes, s.t, s.k);
    let blocks = k / width;
    let valid = (s.layout != TokenLayout::Rows).then(|| kb.table("valid", t / C));
    let packed = declare_packed(kb, s);
    let mut tok = |name: &str, d: DType, w: i64, keys: bool| {
        let blocked = keys && blocks > 1;
        let cols = match blocked {
            true => (width, Index::Grid(2)),
            false => (w, Index::Const(0)),
        };
        kb.input(operand(name, s, d, w, (C, Index::Grid(1)), cols))
    };
    let (q, kk) = (tok("q", s.dtype, k, true), tok("k", s.dtype, k, true));
    let whole = (blocks > 1 && s.l2norm)
        .then(|| (tok("q_whole", s.dtype, k, false), tok("k_whole", s.dtype, k, false)));
    let v = with_v.then(|| tok("v", s.dtype, s.v, false));
    let g = tok("g", s.g_dtype, k, true);
    let beta = tok("beta", s.dtype, 1, false);
    let gate = (s.gate != GateKind::Preactivated).then(|| {
        let ty = TensorType::new(DType::F32, &[l, 2, k]);
        let col = if blocks > 1 { Index::Grid(2) } else { Index::Const(0) };
        kb.input(Operand::blocked("gate", ty, &[1, 2, width], vec![Index::Grid(0), Index::Const(0), col]))
    });
    TokenRefs { q, k: kk, v, g, beta, gate, valid, packed, layout: s.layout, width, whole }
}

/// The tables of packed rows read in place ([`TokenLayout::Packed`]), as a kernel declares them.
#[derive(Clone, Copy, Debug)]
pub struct PackedRefs {
    /// Each chunk position's first token `[NT]`.
    pub start: Table,
    /// The tokens it reads `[NT]` (its window's rows past them read zero).
    pub valid: Table,
    /// The rows it writes `[NT]`.
    pub written: Table,
}

/// Declares the tables of packed rows read in place on `kb` (none for other layouts).
pub fn declare_packed(kb: &mut KernelBuilder, s: &ForwardShape) -> Option<PackedRefs> {
    s.layout.packed().then(|| {
        let nt = s.t / C;
        let (start, valid) = (kb.table("start", nt), kb.table("rows_read", nt));
        PackedRefs { start, valid, written: kb.table("written", nt) }
    })
}

/// Binds the packed tables `p` (if declared) to `tables` and the tokens per chunk position
/// `valid`.
pub fn bind_packed(
    a: &mut Bindings,
    p: Option<&PackedRefs>,
    valid: Value,
    tables: Option<PackedTables>,
) -> Result<()> {
    let Some(p) = p else { return Ok(()) };
    let t = tables.ok_or_else(|| {
        crate::error::TpuError::builder("gpu tokens", "internal: packed rows in place without their tables")
    })?;
    a.table(p.start, t.start)?;
    a.table(p.valid, valid)?;
    a.table(p.written, t.written)
}

/// Where one chunk's rows are in a per-token operand, as a body reads and writes them.
#[derive(Clone, Debug)]
pub enum ChunkRows {
    /// Lane-major or batch-first rows: from row `first` of the operand's block (`[1, rows, D]`
    /// or `[rows, D]`), every row read and written.
    Aligned(TokenLayout, Offset),
    /// Packed rows in place: from token `first` of the block of every token (`[B T, D]`),
    /// `valid` rows read and `written` rows written.
    Packed {
        /// The first token.
        first: V,
        /// Rows read.
        valid: V,
        /// Rows written.
        written: V,
    },
}

impl ChunkRows {
    /// The step's own block of lane-major rows (a chunk-parallel kernel's lane tiles).
    pub const LANE_BLOCK: ChunkRows = ChunkRows::Aligned(TokenLayout::Lanes, Offset::Const(0));

    /// The rows of the chunk at grid index 1 of a chunk-parallel kernel, whose block is that
    /// chunk (packed rows in place: whose block is every token).
    pub fn of_step(b: &mut Body, layout: TokenLayout, packed: Option<&PackedRefs>) -> Result<ChunkRows> {
        match packed {
            Some(p) => {
                let c = b.program_id(1)?;
                Self::packed(b, p, &c)
            }
            None => Ok(ChunkRows::Aligned(layout, Offset::Const(0))),
        }
    }

    /// The rows of chunk position `c` (an i32 scalar) of a kernel whose block holds every
    /// chunk of its lane.
    pub fn of_chunk(
        b: &mut Body,
        layout: TokenLayout,
        packed: Option<&PackedRefs>,
        c: &V,
    ) -> Result<ChunkRows> {
        match packed {
            Some(p) => Self::packed(b, p, c),
            None => {
                let c64 = b.index(C)?;
                let row = b.index_op(Binary::Mul, c, &c64)?;
                Ok(ChunkRows::Aligned(layout, Offset::Dyn(row, C)))
            }
        }
    }

    fn packed(b: &mut Body, p: &PackedRefs, c: &V) -> Result<ChunkRows> {
        Ok(ChunkRows::Packed {
            first: b.read_table(p.start, c)?,
            valid: b.read_table(p.valid, c)?,
            written: b.read_table(p.written, c)?,
        })
    }
}

/// `at + by` as an offset.
fn shifted(b: &mut Body, at: &Offset, by: i64) -> Result<Offset> {
    Ok(match at {
        _ if by == 0 => at.clone(),
        Offset::Const(c) => Offset::Const(c + by),
        Offset::Dyn(v, m) => {
            let k = b.index(by)?;
            let sum = b.index_op(Binary::Add, v, &k)?;
            Offset::Dyn(sum, gcd(*m, by))
        }
    })
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a.abs().max(1)
    } else {
        gcd(b, a % b)
    }
}

/// For packed rows: the token of row `row` of the chunk and the rows of an `n`-row window from
/// there below `count` (`count - row`).
fn packed_window(b: &mut Body, first: &V, count: &V, row: i64) -> Result<(Offset, V)> {
    if row == 0 {
        return Ok((Offset::Dyn(first.clone(), 1), count.clone()));
    }
    let k = b.index(row)?;
    let at = b.index_op(Binary::Add, first, &k)?;
    Ok((Offset::Dyn(at, 1), b.index_op(Binary::Sub, count, &k)?))
}

/// A chunk's inputs in f32, as the kernels use them.
pub struct Chunk {
    /// `q` `[C, K]`, L2-normalised when the shape says so.
    pub q: V,
    /// `k` `[C, K]`, likewise.
    pub k: V,
    /// The activated, floored log-decay `[C, K]`, zero past the chunk's tokens.
    pub g: V,
    /// `beta` `[C, 1]`.
    pub beta: V,
    /// The gate as stored, before its activation and floor, in f32.
    pub raw: V,
}

/// A per-token operand of `w` columns in `s`'s layout, a program's block `rows` tokens by `bw`
/// columns at token block `row` and column block `col`: `[L, T, w]` in `[1, rows, bw]` blocks
/// (lanes), `[T, L w]` in `[rows, bw]` blocks (the caller's batch-first rows).
pub fn operand(
    name: &str,
    s: &ForwardShape,
    dtype: DType,
    w: i64,
    (rows, row): (i64, Index),
    (bw, col): (i64, Index),
) -> Operand {
    match s.layout {
        TokenLayout::Lanes => {
            let ty = TensorType::new(dtype, &[s.lanes, s.t, w]);
            Operand::blocked(name, ty, &[1, rows, bw], vec![Index::Grid(0), row, col])
        }
        TokenLayout::Rows | TokenLayout::Packed => {
            let ty = TensorType::new(dtype, &[s.tokens, s.lanes * w]);
            let col = match (w == bw, col) {
                (true, Index::Const(0)) => Index::Grid(0),
                (_, col) => Index::Grid(0) * (w / bw) + col,
            };
            // Packed rows: every token in the block, each chunk's rows found by its tables.
            match s.layout {
                TokenLayout::Packed => {
                    Operand::blocked(name, ty, &[s.tokens, bw], vec![Index::Const(0), col])
                }
                _ => Operand::blocked(name, ty, &[rows, bw], vec![row, col]),
            }
        }
        // A lane's tokens are the lane's block of rows of `[L B T, w]`.
        TokenLayout::PackedLanes => {
            let ty = TensorType::new(dtype, &[s.lanes * s.tokens, w]);
            Operand::blocked(name, ty, &[s.tokens, bw], vec![Index::Grid(0), col])
        }
    }
}

/// Rows `row..row + n` of the chunk at `at` and columns `col..col + w` of `r`, in `r`'s dtype
/// (packed rows: those past the chunk's tokens read zero).
pub fn tile(
    b: &mut Body,
    r: Ref,
    at: &ChunkRows,
    (row, n): (i64, i64),
    (col, w): (Offset, i64),
) -> Result<V> {
    match at {
        ChunkRows::Aligned(TokenLayout::Lanes, first) => {
            let row = shifted(b, first, row)?;
            let x = b.load(r, &[Offset::Const(0), row, col], &[1, n, w])?;
            b.reshape(&x, &[n, w])
        }
        ChunkRows::Aligned(_, first) => {
            let row = shifted(b, first, row)?;
            b.load(r, &[row, col], &[n, w])
        }
        ChunkRows::Packed { first, valid, .. } => {
            let (row, count) = packed_window(b, first, valid, row)?;
            b.load_rows(r, &[row, col], &[n, w], &count)
        }
    }
}

/// Stores the `[n, w]` tile `x` at rows `row..` of the chunk at `at` and columns `col..` of
/// `r` (as [`tile`] reads it), in `dtype` (packed rows: only the rows the chunk writes).
pub fn store_tile(
    b: &mut Body,
    r: Ref,
    at: &ChunkRows,
    (row, col): (i64, Offset),
    x: &V,
    dtype: DType,
) -> Result<()> {
    let x = b.to_dtype(x, dtype)?;
    match at {
        ChunkRows::Aligned(TokenLayout::Lanes, first) => {
            let row = shifted(b, first, row)?;
            let dims = x.ty.dims.clone();
            let x = b.reshape(&x, &[1, dims[0], dims[1]])?;
            b.store(r, &[Offset::Const(0), row, col], &x)
        }
        ChunkRows::Aligned(_, first) => {
            let row = shifted(b, first, row)?;
            b.store(r, &[row, col], &x)
        }
        ChunkRows::Packed { first, written, .. } => {
            let (row, count) = packed_window(b, first, written, row)?;
            b.store_rows(r, &[row, col], &x, &count)
        }
    }
}

/// Rows `start..start + n` of the chunk at `at` and columns `col..col + w` of `r` as an f32
/// tile.
pub fn f32_tile(
    b: &mut Body,
    r: Ref,
    at: &ChunkRows,
    (start, n): (i64, i64),
    (col, w): (i64, i64),
) -> Result<V> {
    let x = tile(b, r, at, (start, n), (Offset::Const(col), w))?;
    b.to_dtype(&x, DType::F32)
}

/// Stores the `[C, w]` tile `x` into `r`'s `[1, C, w]` block, in `dtype`.
pub fn store(b: &mut Body, r: Ref, x: &V, dtype: DType) -> Result<()> {
    store_columns(b, r, 0, x, dtype)
}

/// Stores the `[C, w]` tile `x` at columns `col..col + w` of `r`'s `[1, C, D]` block, in
/// `dtype`.
pub fn store_columns(b: &mut Body, r: Ref, col: i64, x: &V, dtype: DType) -> Result<()> {
    let dims = x.ty.dims.clone();
    let x = b.to_dtype(x, dtype)?;
    let x = b.reshape(&x, &[1, dims[0], dims[1]])?;
    b.store(r, &[Offset::Const(0), Offset::Const(0), Offset::Const(col)], &x)
}

/// The per-row L2 scales `rsqrt(sum(x^2) + eps)` `[C, 1]` of the chunk's `q` and `k`, read
/// whole, for kernels that then read them in blocks of columns.
#[derive(Clone)]
pub struct Norms {
    /// `q`'s scales.
    pub q: V,
    /// `k`'s scales.
    pub k: V,
}

/// Columns per load of [`norms`]: the sums of squares run over blocks of this many, so that no
/// whole `[64, K]` row block is live at once.
const NORM_COLUMNS: i64 = 64;

/// The chunk's [`Norms`] when the shape L2-normalises (none otherwise): each row's sum of
/// squares over blocks of [`NORM_COLUMNS`], then `rsqrt(sum + eps)`.
pub fn norms(b: &mut Body, s: &ForwardShape, r: &TokenRefs) -> Result<Option<Norms>> {
    if !s.l2norm {
        return Ok(None);
    }
    let w = s.k.min(NORM_COLUMNS);
    let at = r.rows(b)?;
    let mut scales = |x: Ref| -> Result<V> {
        let mut ss: Option<V> = None;
        for col in (0..s.k).step_by(w as usize) {
            let x = f32_tile(b, x, &at, (0, C), (col, w))?;
            let sq = b.mul(&x, &x)?;
            let part = b.reduce(Reduction::Sum, &sq, 1)?;
            ss = Some(match ss {
                Some(acc) => b.add(&acc, &part)?,
                None => part,
            });
        }
        let ss =
            ss.ok_or_else(|| crate::error::TpuError::builder("gpu tokens", "internal: no key columns"))?;
        let eps = b.splat(kda_core::L2NORM_EPS, DType::F32, &[C, 1])?;
        let ss = b.add(&ss, &eps)?;
        b.rsqrt(&ss)
    };
    let (q, k) = r.whole.unwrap_or((r.q, r.k));
    Ok(Some(Norms { q: scales(q)?, k: scales(k)? }))
}

/// The chunk's `q`, `k`, `g` and `beta` (the chunk position is grid index 1) at rows
/// `start..start + n` and key columns `col..col + w`, in f32; the L2 norm, when the shape has
/// one, scales by `norms` (whole rows) or, with all the columns and no `norms`, by the rows'
/// own.
pub fn load_tile(
    b: &mut Body,
    s: &ForwardShape,
    r: &TokenRefs,
    (start, n): (i64, i64),
    (col, w): (i64, i64),
    norms: Option<&Norms>,
) -> Result<Chunk> {
    let at = r.rows(b)?;
    let (mut q, mut kx) =
        (f32_tile(b, r.q, &at, (start, n), (col, w))?, f32_tile(b, r.k, &at, (start, n), (col, w))?);
    if s.l2norm {
        match norms {
            Some(nm) => {
                let scaled = |b: &mut Body, x: &V, scale: &V| -> Result<V> {
                    let scale = b.slice(scale, &[start, 0], &[n, 1])?;
                    let scale = b.broadcast(&scale, &[n, w])?;
                    b.mul(x, &scale)
                };
                q = scaled(b, &q, &nm.q)?;
                kx = scaled(b, &kx, &nm.k)?;
            }
            None if w == s.k => {
                q = l2_normalise_with_scale(b, &q)?.0;
                kx = l2_normalise_with_scale(b, &kx)?.0;
            }
            None => {
                return Err(crate::error::TpuError::builder(
                    "gpu tokens",
                    "internal: a column block without its norms",
                ))
            }
        }
    }
    let raw = f32_tile(b, r.g, &at, (start, n), (col, w))?;
    let g = activate_columns(b, &raw, s.gate, r.gate, col)?;
    let g = match real_rows(b, r, (start, n), w)? {
        Some(real) => {
            let zero = b.splat(0.0, DType::F32, &[n, w])?;
            b.select(&real, &g, &zero)?
        }
        None => g,
    };
    let beta = f32_tile(b, r.beta, &at, (start, n), (0, 1))?;
    Ok(Chunk { q, k: kx, g, beta, raw })
}

/// Where rows `start..start + n` of the chunk (grid index 1) hold tokens, `[n, w]`: none where
/// every row does (rows read in place).
pub fn real_rows(b: &mut Body, r: &TokenRefs, (start, n): (i64, i64), w: i64) -> Result<Option<V>> {
    let Some(valid) = r.valid else { return Ok(None) };
    let at = b.program_id(1)?;
    let valid = b.read_table(valid, &at)?;
    let row = b.iota(&[n, w], 0)?;
    let first = b.splat(start as f64, DType::I32, &[n, w])?;
    let row = b.add(&row, &first)?;
    let valid = b.broadcast(&valid, &[n, w])?;
    Ok(Some(b.compare(Cmp::Lt, &row, &valid)?))
}
