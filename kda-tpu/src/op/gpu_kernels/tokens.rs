//! What every chunk-parallel GPU kernel reads of a chunk: its per-token inputs in f32, with
//! the L2 norm and the gate applied in the kernel and the rows past the chunk's tokens held at
//! zero (so that a packed chunk's padding decays nothing and writes nothing).

use kda_core::{DType, GateKind};

use crate::error::Result;
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Body, Index, KernelBuilder, Offset, Operand, Reduction, Ref, Table, V};
use crate::op::chunk::{activate_columns, l2_normalise_with_scale};

use super::{ForwardShape, TokenLayout, C};

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
    /// How the per-token operands are laid out.
    pub layout: TokenLayout,
    /// Key columns of `q`, `k`, `g` and the gate in a program's block: `K`, or the block of
    /// grid axis 2 ([`declare_key_blocks`]).
    pub width: i64,
    /// `q` and `k` whole, for the L2 norm's scales where a program reads a block of columns.
    pub whole: Option<(Ref, Ref)>,
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
    let valid = (s.layout == TokenLayout::Lanes).then(|| kb.table("valid", t / C));
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
    TokenRefs { q, k: kk, v, g, beta, gate, valid, layout: s.layout, width, whole }
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
        TokenLayout::Rows => {
            let ty = TensorType::new(dtype, &[s.t, s.lanes * w]);
            let col = match (w == bw, col) {
                (true, Index::Const(0)) => Index::Grid(0),
                (_, col) => Index::Grid(0) * (w / bw) + col,
            };
            Operand::blocked(name, ty, &[rows, bw], vec![row, col])
        }
    }
}

/// Rows `row..row + n` and columns `col..col + w` of `r`'s block (`[1, rows, D]`, or
/// `[rows, D]` in rows), in `r`'s dtype.
pub fn tile(
    b: &mut Body,
    r: Ref,
    layout: TokenLayout,
    (row, n): (Offset, i64),
    (col, w): (Offset, i64),
) -> Result<V> {
    match layout {
        TokenLayout::Lanes => {
            let x = b.load(r, &[Offset::Const(0), row, col], &[1, n, w])?;
            b.reshape(&x, &[n, w])
        }
        TokenLayout::Rows => b.load(r, &[row, col], &[n, w]),
    }
}

/// Stores the `[n, w]` tile `x` at rows `row..` and columns `col..` of `r`'s block (as
/// [`tile`] reads it), in `dtype`.
pub fn store_tile(
    b: &mut Body,
    r: Ref,
    layout: TokenLayout,
    (row, col): (Offset, Offset),
    x: &V,
    dtype: DType,
) -> Result<()> {
    let x = b.to_dtype(x, dtype)?;
    match layout {
        TokenLayout::Lanes => {
            let dims = x.ty.dims.clone();
            let x = b.reshape(&x, &[1, dims[0], dims[1]])?;
            b.store(r, &[Offset::Const(0), row, col], &x)
        }
        TokenLayout::Rows => b.store(r, &[row, col], &x),
    }
}

/// Rows `start..start + n` and columns `col..col + w` of `r`'s block (`[1, C, D]`, or `[C, D]`
/// in rows) as an f32 tile.
pub fn f32_tile(
    b: &mut Body,
    r: Ref,
    (start, n): (i64, i64),
    (col, w): (i64, i64),
    layout: TokenLayout,
) -> Result<V> {
    let x = tile(b, r, layout, (Offset::Const(start), n), (Offset::Const(col), w))?;
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
    let mut scales = |x: Ref| -> Result<V> {
        let mut ss: Option<V> = None;
        for col in (0..s.k).step_by(w as usize) {
            let x = f32_tile(b, x, (0, C), (col, w), r.layout)?;
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
    let lay = r.layout;
    let (mut q, mut kx) =
        (f32_tile(b, r.q, (start, n), (col, w), lay)?, f32_tile(b, r.k, (start, n), (col, w), lay)?);
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
    let raw = f32_tile(b, r.g, (start, n), (col, w), lay)?;
    let g = activate_columns(b, &raw, s.gate, r.gate, col)?;
    let g = match real_rows(b, r, (start, n), w)? {
        Some(real) => {
            let zero = b.splat(0.0, DType::F32, &[n, w])?;
            b.select(&real, &g, &zero)?
        }
        None => g,
    };
    let beta = f32_tile(b, r.beta, (start, n), (0, 1), lay)?;
    Ok(Chunk { q, k: kx, g, beta })
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
