//! What every chunk-parallel GPU kernel reads of a chunk: its per-token inputs in f32, with
//! the L2 norm and the gate applied in the kernel and the rows past the chunk's tokens held at
//! zero (so that a packed chunk's padding decays nothing and writes nothing).

use kda_core::{DType, GateKind};

use crate::error::Result;
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Body, Index, KernelBuilder, Offset, Operand, Ref, Table, V};
use crate::op::chunk::{activate, l2_normalise};

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
    /// Tokens held by each chunk position `[NT]` (the rest is padding).
    pub valid: Table,
    /// How the per-token operands are laid out.
    pub layout: TokenLayout,
}

/// Declares the per-token operands of `s` on `kb`, whose grid is (lanes, chunk positions).
pub fn declare(kb: &mut KernelBuilder, s: &ForwardShape, with_v: bool) -> TokenRefs {
    let (l, t, k) = (s.lanes, s.t, s.k);
    let valid = kb.table("valid", t / C);
    let mut tok = |name: &str, d: DType, w: i64| {
        let operand = match s.layout {
            TokenLayout::Lanes => {
                let at = vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
                Operand::blocked(name, TensorType::new(d, &[l, t, w]), &[1, C, w], at)
            }
            TokenLayout::Rows => {
                let at = vec![Index::Grid(1), Index::Grid(0)];
                Operand::blocked(name, TensorType::new(d, &[t, l * w]), &[C, w], at)
            }
        };
        kb.input(operand)
    };
    let (q, kk) = (tok("q", s.dtype, k), tok("k", s.dtype, k));
    let v = with_v.then(|| tok("v", s.dtype, s.v));
    let g = tok("g", s.g_dtype, k);
    let beta = tok("beta", s.dtype, 1);
    let gate = (s.gate != GateKind::Preactivated).then(|| {
        let ty = TensorType::new(DType::F32, &[l, 2, k]);
        kb.input(Operand::blocked(
            "gate",
            ty,
            &[1, 2, k],
            vec![Index::Grid(0), Index::Const(0), Index::Const(0)],
        ))
    });
    TokenRefs { q, k: kk, v, g, beta, gate, valid, layout: s.layout }
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

/// `r`'s block as a `[C, w]` f32 tile.
pub fn f32_block(b: &mut Body, r: Ref, w: i64, layout: TokenLayout) -> Result<V> {
    f32_rows(b, r, 0, C, w, layout)
}

/// Rows `start..start + rows` of `r`'s block (`[1, C, w]`, or `[C, w]` in rows) as an f32 tile.
pub fn f32_rows(b: &mut Body, r: Ref, start: i64, rows: i64, w: i64, layout: TokenLayout) -> Result<V> {
    let x = match layout {
        TokenLayout::Lanes => {
            let at = [Offset::Const(0), Offset::Const(start), Offset::Const(0)];
            let x = b.load(r, &at, &[1, rows, w])?;
            b.reshape(&x, &[rows, w])?
        }
        TokenLayout::Rows => b.load(r, &[Offset::Const(start), Offset::Const(0)], &[rows, w])?,
    };
    b.to_dtype(&x, DType::F32)
}

/// Stores the `[C, w]` tile `x` into `r`'s `[1, C, w]` block, in `dtype`.
pub fn store(b: &mut Body, r: Ref, x: &V, dtype: DType) -> Result<()> {
    let dims = x.ty.dims.clone();
    let x = b.to_dtype(x, dtype)?;
    let x = b.reshape(&x, &[1, dims[0], dims[1]])?;
    b.store_all(r, &x)
}

/// The chunk's `q`, `k`, `g` and `beta` (the chunk position is grid index 1).
pub fn load(b: &mut Body, s: &ForwardShape, r: &TokenRefs) -> Result<Chunk> {
    load_rows(b, s, r, 0, C)
}

/// [`load`] of rows `start..start + rows` of the chunk.
pub fn load_rows(b: &mut Body, s: &ForwardShape, r: &TokenRefs, start: i64, rows: i64) -> Result<Chunk> {
    let k = s.k;
    let lay = r.layout;
    let (mut q, mut kx) = (f32_rows(b, r.q, start, rows, k, lay)?, f32_rows(b, r.k, start, rows, k, lay)?);
    if s.l2norm {
        q = l2_normalise(b, &q)?;
        kx = l2_normalise(b, &kx)?;
    }
    let raw = f32_rows(b, r.g, start, rows, k, lay)?;
    let g = activate(b, &raw, s.gate, r.gate)?;
    let at = b.program_id(1)?;
    let n = b.read_table(r.valid, &at)?;
    let row = b.iota(&[rows, k], 0)?;
    let first = b.splat(start as f64, DType::I32, &[rows, k])?;
    let row = b.add(&row, &first)?;
    let n = b.broadcast(&n, &[rows, k])?;
    let real = b.compare(Cmp::Lt, &row, &n)?;
    let zero = b.splat(0.0, DType::F32, &[rows, k])?;
    let g = b.select(&real, &g, &zero)?;
    let beta = f32_rows(b, r.beta, start, rows, 1, lay)?;
    Ok(Chunk { q, k: kx, g, beta })
}
