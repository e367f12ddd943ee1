//! The WY kernel of the GPU forward: one program per (lane, chunk position) turns the chunk's
//! inverse `A` into the factors the recurrence reads: `w = A (beta k e^G)`, `u = A (beta v)`,
//! `qg = scale q e^G`, `kg = k e^(G_C - G)` and `e^(G_C)`, with `G` the chunk's running sums
//! of the gates (inclusive forward, exclusive reverse: direct sums, every factor at most 1).

use kda_core::DType;

use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Body, Index, Kernel, KernelBuilder, Offset, Operand, Ref, Scan, Semantics, V};
use crate::op::chunk::mul_const;

use super::tokens::{self, f32_tile, store_columns, TokenRefs};
use super::{ForwardShape, C};

/// The WY kernel's operands by name.
#[derive(Clone, Copy, Debug)]
pub struct WyRefs {
    /// The per-token inputs (`v` included).
    pub tokens: TokenRefs,
    /// The intra kernel's `A` `[L, T, C]`.
    pub a: Ref,
    /// `w` `[L, T, K]`.
    pub w: Ref,
    /// `u` `[L, T, V]`.
    pub u: Ref,
    /// `scale q e^G` `[L, T, K]`.
    pub qg: Ref,
    /// `k e^(G_C - G)` `[L, T, K]`.
    pub kg: Ref,
    /// `e^(G_C)` `[L, NT, K]` f32.
    pub eg: Ref,
}

/// The WY kernel of `s`: grid (lanes, chunk positions), both parallel.
pub fn wy_kernel(s: &ForwardShape) -> Result<(Kernel, WyRefs)> {
    let (l, t, nt, k, v) = (s.lanes, s.t, s.t / C, s.k, s.v);
    let mut kb = KernelBuilder::new("kda_gpu_wy");
    kb.grid(l, Semantics::Parallel).grid(nt, Semantics::Parallel).grid(s.wy_programs(), Semantics::Parallel);
    let tokens = tokens::declare(&mut kb, s, true);
    let at = || vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let ty = |d: DType, dims: &[i64]| TensorType::new(d, dims);
    let fd = s.factor_dtype();
    let a = kb.input(Operand::blocked("a", ty(fd, &[l, t, C]), &[1, C, C], at()));
    let mut res =
        |name: &str, d: DType, w: i64| kb.output(Operand::blocked(name, ty(d, &[l, t, w]), &[1, C, w], at()));
    let (w, u, qg, kg) = (res("w", fd, k), res("u", fd, v), res("qg", fd, k), res("kg", fd, k));
    let eg = kb.output(Operand::blocked("eg", ty(DType::F32, &[l, nt, k]), &[1, 1, k], at()));
    kb.params(s.wy_launch);
    let refs = WyRefs { tokens, a, w, u, qg, kg, eg };
    let kernel = kb.build(|b| chunk_wy(b, s, &refs))?;
    Ok((kernel, refs))
}

/// The body: one chunk's factors, `BK` key columns (and as many value columns) at a time, each
/// block's gate sums its own (the sums run along the tokens, column by column). With
/// [`ForwardShape::wy_programs`] above 1, program `j` of grid axis 2 makes block `j` alone (key
/// blocks first, then value blocks).
fn chunk_wy(b: &mut Body, s: &ForwardShape, r: &WyRefs) -> Result<()> {
    let (k, v, bk, bu) = (s.k, s.v, s.bk(), s.bu());
    let a = b.load_all(r.a)?;
    let a = b.reshape(&a, &[C, C])?;
    let a = b.to_dtype(&a, DType::F32)?;
    let blocks: Vec<Block> =
        (0..k / bk).map(|j| Block::Keys(j * bk)).chain((0..v / bu).map(|j| Block::Values(j * bu))).collect();
    if s.wy_programs() == 1 {
        for block in blocks {
            wy_block(b, s, r, &a, block)?;
        }
        return Ok(());
    }
    let at = b.program_id(2)?;
    for (j, block) in blocks.into_iter().enumerate() {
        let j = b.index(j as i64)?;
        let here = b.compare(Cmp::Eq, &at, &j)?;
        b.when(&here, |b| wy_block(b, s, r, &a, block))?;
    }
    Ok(())
}

/// A block of the WY kernel's results: key columns from `.0` (`w`, `qg`, `kg`, `e^(G_C)`) or
/// value columns from `.0` (`u`).
#[derive(Clone, Copy, Debug)]
enum Block {
    Keys(i64),
    Values(i64),
}

fn wy_block(b: &mut Body, s: &ForwardShape, r: &WyRefs, a: &V, block: Block) -> Result<()> {
    let (p, fd) = (s.precision(), s.factor_dtype());
    match block {
        Block::Keys(col) => {
            let bk = s.bk();
            let norms = if bk < s.k { tokens::norms(b, s, &r.tokens)? } else { None };
            let x = tokens::load_tile(b, s, &r.tokens, (0, C), (col, bk), norms.as_ref())?;
            let gc = b.cumsum(&x.g, 0, Scan { reverse: false, exclusive: false }, None)?; // G_t
            let egc = b.exp(&gc)?;
            let wide_beta = b.broadcast(&x.beta, &[C, bk])?;
            let bkx = b.mul(&x.k, &wide_beta)?;
            let kbg = b.mul(&bkx, &egc)?;
            let wv = b.matmul(a, &kbg, (1, 0), p)?;
            store_columns(b, r.w, col, &wv, fd)?;
            let qg = b.mul(&x.q, &egc)?;
            let qg = mul_const(b, &qg, s.scale)?;
            store_columns(b, r.qg, col, &qg, fd)?;
            let total = b.slice(&gc, &[C - 1, 0], &[1, bk])?;
            let eg = b.exp(&total)?;
            let eg = b.reshape(&eg, &[1, 1, bk])?;
            b.store(r.eg, &[Offset::Const(0), Offset::Const(0), Offset::Const(col)], &eg)?;
            let gs = b.cumsum(&x.g, 0, Scan { reverse: true, exclusive: true }, None)?; // G_C - G_t
            let egs = b.exp(&gs)?;
            let kg = b.mul(&x.k, &egs)?;
            store_columns(b, r.kg, col, &kg, fd)
        }
        Block::Values(col) => {
            let bu = s.bu();
            let v_in = r.tokens.v.ok_or_else(|| TpuError::builder("kda_gpu_wy", "internal: no v operand"))?;
            let rows = r.tokens.rows(b)?;
            let beta = f32_tile(b, r.tokens.beta, &rows, (0, C), (0, 1))?;
            let vx = f32_tile(b, v_in, &rows, (0, C), (col, bu))?;
            let beta_v = b.broadcast(&beta, &[C, bu])?;
            let bv = b.mul(&vx, &beta_v)?;
            let uv = b.matmul(a, &bv, (1, 0), p)?;
            store_columns(b, r.u, col, &uv, fd)
        }
    }
}
