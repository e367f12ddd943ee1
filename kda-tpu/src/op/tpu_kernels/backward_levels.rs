//! The gradients through the levels of a chunk's terms inside the backward kernel
//! ([`mod@super::backward`]), and the fold of the exponent arrays' gradients into `dg`.

use kda_core::DType;

use super::dims::C;
use super::terms::{by_halves, ChunkFactors};
use crate::error::Result;
use crate::hlo::Cmp;
use crate::lang::{Body, MatPrecision, Ref, V};

/// What the levels of a chunk's terms add up: `dq`, `dk`, `d(beta k)` and the gradients of the
/// exponent arrays of levels 0 to 4 (the exponent masks' order after `G` and the suffix).
pub(super) struct LevelGrads {
    pub dq: V,
    pub dk: V,
    pub d_bk: V,
    pub d_exponents: Vec<V>,
}

/// The operand `x` in the type products at `p` read (bf16 for one-pass products: rounded once,
/// and half the registers while it waits).
pub(super) fn as_operand(b: &mut Body, x: &V, p: MatPrecision) -> Result<V> {
    let op_ty = if p == MatPrecision::Default { DType::BF16 } else { DType::F32 };
    b.to_dtype(x, op_ty)
}

/// The gradients through the levels of `Aqk` and `L` (their cotangents `m`, `Aqk`'s above
/// `L`'s, in the products' type) added to `dq` and `dk`.
pub(super) fn level_grads(
    b: &mut Body,
    [q, k]: [&V; 2],
    t: &ChunkFactors,
    m: &V,
    p: MatPrecision,
    [dq, dk]: [V; 2],
) -> Result<LevelGrads> {
    let (mut dq, mut dk) = (dq, dk);
    let as_op = |b: &mut Body, x: &V| as_operand(b, x, p);
    let kd = k.ty.dims[1];
    let m = m.clone();
    let mut d_exponents = vec![];
    // Level 0, the pairs within a 4-token block (rows and columns share tokens): `Aqk` rows
    // `q fr` and `L` rows `beta k fr` against columns `k fc`, strictly causal pairs on its mask.
    // Both cotangents against the shared columns, and both row operands against the
    // cotangents' columns, as one product each.
    let mut d_bk = {
        let ((fr, fc), keep) = (&t.factors[0], &t.levels[1]);
        // The cotangents on the level's strict mask: a product with its 0/1 entries (exact, in
        // the operands' type; cheaper than a compare and a select).
        let both = b.concat(&[keep.clone(), keep.clone()], 0)?;
        let both = as_op(b, &both)?;
        let m = b.mul(&m, &both)?;
        let cols = b.mul(k, fc)?;
        let rows_q = b.mul(q, fr)?;
        let rows_l = b.mul(&t.bk, fr)?;
        let rows = b.concat(&[rows_q, rows_l], 0)?;
        // Blocks above 4 tokens: the factors in two bf16 parts (see [`two_part_product`]).
        let parts = if p == MatPrecision::Default && t.blocks.wide_level0() { 2 } else { 1 };
        let r = two_part_product(b, &m, &cols, (1, 0), p, parts)?;
        let rq = b.slice(&r, &[0, 0], &[C, kd])?;
        let rl = b.slice(&r, &[C, 0], &[C, kd])?;
        let cc = two_part_product(b, &m, &rows, (0, 0), p, parts)?;
        let (pq, pl, pk) = (b.mul(&rq, fr)?, b.mul(&rl, fr)?, b.mul(&cc, fc)?);
        dq = b.add(&dq, &pq)?;
        dk = b.add(&dk, &pk)?;
        let er = b.mul(&pq, q)?;
        let x = b.mul(&pl, &t.bk)?;
        let er = b.add(&er, &x)?;
        let ec = b.mul(&pk, k)?;
        // Its factors are e^(mid) and e^(-mid).
        d_exponents.push(b.sub(&er, &ec)?);
        pl
    };
    // Levels 1 to 4 (block size `B`): rows `t` in the second half of a `2B` block, columns `j`
    // in its first, one exponent array `f` for both, so rows and columns never share a token.
    // With `P` the `Aqk` cotangent below the diagonal and `L`'s transposed above it, `Q` the
    // other way round, both kept on the level's pairs in either order, two products over the
    // whole chunk give every cotangent term: `P (f sb)` holds `Aqk`'s row terms on second halves
    // and `L`'s column terms on first halves, `Q (f sq)` `L`'s row terms and `Aqk`'s column
    // terms, where `sb` and `sq` are `beta k` and `q` on second halves and `k` on first (217 k
    // to 205 k static cycles at the primary shape, from four products and five transposes a
    // level). The cotangents are transposed once for every level.
    let mt = b.transpose(&m)?;
    let (m1, m2) = (b.slice(&m, &[0, 0], &[C, C])?, b.slice(&m, &[C, 0], &[C, C])?);
    let (m1t, m2t) = (b.slice(&mt, &[0, 0], &[C, C])?, b.slice(&mt, &[0, C], &[C, C])?);
    let lower = {
        let (r, c) = (b.iota(&[C, C], 0)?, b.iota(&[C, C], 1)?);
        b.compare(Cmp::Gt, &r, &c)?
    };
    let pm = b.select(&lower, &m1, &m2t)?;
    let qm = b.select(&lower, &m2, &m1t)?;
    for (i, half) in t.blocks.halves().into_iter().enumerate() {
        let f = &t.factors[i + 1].0;
        let sym = as_op(b, &t.pairs[i])?;
        let (x1, x2) = (b.mul(&pm, &sym)?, b.mul(&qm, &sym)?);
        // Second halves from `on`, first from `off`: for `B` of 8 or more whole 8-row tiles, so
        // that what a half does not take is never formed.
        let pick = |b: &mut Body, on: &V, off: &V| by_halves(b, half, on, off);
        let sq = pick(b, q, k)?;
        let sb = pick(b, &t.bk, k)?;
        let y1 = b.mul(&sb, f)?;
        let y1 = as_op(b, &y1)?;
        let y2 = b.mul(&sq, f)?;
        let y2 = as_op(b, &y2)?;
        let o1 = b.matmul(&x1, &y1, (1, 0), p)?;
        let o2 = b.matmul(&x2, &y2, (1, 0), p)?;
        let (u, w) = (b.mul(&o1, f)?, b.mul(&o2, f)?);
        // Rows: `dq += u`, `d(beta k) += w`, the exponent `u q + w beta k`; columns:
        // `dk += u + w`, the exponent `(u + w) k`.
        let uw = b.add(&u, &w)?;
        let e_rows = {
            let x = b.mul(&u, q)?;
            let y = b.mul(&w, &t.bk)?;
            b.add(&x, &y)?
        };
        let e_cols = b.mul(&uw, k)?;
        d_exponents.push(pick(b, &e_rows, &e_cols)?);
        let x = b.add(&dq, &u)?;
        dq = pick(b, &x, &dq)?;
        let x = b.add(&d_bk, &w)?;
        d_bk = pick(b, &x, &d_bk)?;
        let x = b.add(&dk, &uw)?;
        dk = pick(b, &dk, &x)?;
    }
    Ok(LevelGrads { dq, dk, d_bk, d_exponents })
}

/// `m x` at `p` for `m` in the products' type and `x` f32, `x` rounded to it once (`parts` 1) or
/// split into two bf16 parts (`parts` 2, about 16 bits: `m` is exact in bf16, so the product
/// carries `x` that far). Level 0's row and column terms reach `dg` through one exponent array
/// whose row and column gradients cancel on the tokens after the anchor; across a 16-token
/// block one rounding of the factors left `da_log` outside its limit.
fn two_part_product(
    b: &mut Body,
    m: &V,
    x: &V,
    contract: (usize, usize),
    p: MatPrecision,
    parts: usize,
) -> Result<V> {
    let hi = as_operand(b, x, p)?;
    let y = b.matmul(m, &hi, contract, p)?;
    if parts < 2 {
        return Ok(y);
    }
    let back = b.to_dtype(&hi, DType::F32)?;
    let rest = b.sub(x, &back)?;
    let lo = as_operand(b, &rest, p)?;
    let z = b.matmul(m, &lo, contract, p)?;
    b.add(&y, &z)
}

/// `sum_m M_m^T de_m` over the exponent masks (`masks_t` holds the transposes side by side)
/// with `de` their arrays' gradients stacked. The masks' entries (0, 1, -1) are exact in bf16:
/// one-pass products take `de` rounded to bf16, and with `split` its first `split` rows again
/// as what that rounding left (about 16 bits for them).
pub(super) fn fold(b: &mut Body, masks_t: Ref, de: &V, p: MatPrecision, split: i64) -> Result<V> {
    let mt = b.load_all(masks_t)?;
    let x = if p != MatPrecision::Default {
        let mt = b.to_dtype(&mt, DType::F32)?;
        b.matmul(&mt, de, (1, 0), MatPrecision::Highest)?
    } else {
        let hi = b.cast(de, DType::BF16)?;
        let x = b.matmul(&mt, &hi, (1, 0), MatPrecision::Default)?;
        if split == 0 {
            x
        } else {
            let kd = de.ty.dims[1];
            let (de, hi) = (b.slice(de, &[0, 0], &[split, kd])?, b.slice(&hi, &[0, 0], &[split, kd])?);
            let hi = b.cast(&hi, DType::F32)?;
            let rest = b.sub(&de, &hi)?;
            let lo = b.cast(&rest, DType::BF16)?;
            let mt = b.slice(&mt, &[0, 0], &[C, split])?;
            let y = b.matmul(&mt, &lo, (1, 0), MatPrecision::Default)?;
            b.add(&x, &y)?
        }
    };
    Ok(x)
}
