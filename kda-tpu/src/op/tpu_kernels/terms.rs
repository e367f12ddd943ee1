//! Building blocks of the KDA kernels, written once on a [`Body`] so that both lowerings share
//! them.

use kda_core::DType;

use crate::error::{Result, TpuError};
use crate::hlo::Cmp;
use crate::lang::{Body, MatPrecision, Offset, Ref, V};

pub use super::levels::Levels;

/// Rows of a chunk and of its diagonal blocks.
use super::super::chunk::mul_const;
use super::super::chunk::C;
const S: i64 = 16;

fn at(r: i64, c: i64) -> [Offset; 2] {
    [Offset::Const(r), Offset::Const(c)]
}

/// The identity of `n x n`, f32.
#[cfg_attr(not(feature = "harness"), allow(dead_code))] // the op tests' (harness feature)
fn eye(b: &mut Body, n: i64) -> Result<V> {
    let (r, c) = (b.iota(&[n, n], 0)?, b.iota(&[n, n], 1)?);
    let d = b.compare(Cmp::Eq, &r, &c)?;
    let (one, zero) = (b.splat(1.0, DType::F32, &[n, n])?, b.splat(0.0, DType::F32, &[n, n])?);
    b.select(&d, &one, &zero)
}

/// The 0/1 f32 `n x n` mask of the diagonal `block x block` blocks.
#[cfg_attr(not(feature = "harness"), allow(dead_code))] // the op tests' (harness feature)
fn block_diagonal(b: &mut Body, n: i64, block: i64) -> Result<V> {
    let (r, c) = (b.iota(&[n, n], 0)?, b.iota(&[n, n], 1)?);
    let one = b.splat(1.0, DType::F32, &[n, n])?;
    let mut m = b.splat(0.0, DType::F32, &[n, n])?;
    for lo in (0..n).step_by(block as usize) {
        let (lo_v, hi_v) =
            (b.splat(lo as f64, DType::I32, &[n, n])?, b.splat((lo + block) as f64, DType::I32, &[n, n])?);
        let mut inside = one.clone();
        for (x, cmp, bound) in
            [(&r, Cmp::Ge, &lo_v), (&r, Cmp::Lt, &hi_v), (&c, Cmp::Ge, &lo_v), (&c, Cmp::Lt, &hi_v)]
        {
            let t = b.compare(cmp, x, bound)?;
            inside = b.select(&t, &inside, &m)?;
        }
        m = inside;
    }
    Ok(m)
}

/// `x y` at `p`: `Highest` (f32 inputs) or one bf16 pass (bf16 inputs, whose `L` carries the
/// one-pass rounding already: a three-pass inverse left their `o` and final states unchanged to
/// three digits).
fn product(b: &mut Body, x: &V, y: &V, p: MatPrecision) -> Result<V> {
    b.matmul(x, y, (1, 0), p)
}

/// `A = (I + L)^-1` of a strictly lower 64x64 f32 `l` in whole-chunk products (ten 64x64
/// products, eight deep): with `Lb` the 16x16 diagonal blocks of `L` and `N = L - Lb`,
/// `D^-1 = (I + Lb)^-1 = (I - Lb)(I + Lb^2)(I + Lb^4)(I + Lb^8)` (each block nilpotent of
/// order 16), `M = D^-1 N` (nilpotent of order 4: four block rows) and
/// `A = (I + M)^-1 D^-1 = (I - M)(I + M^2) D^-1`. Products run at `p` (see [`product`]).
#[cfg_attr(not(feature = "harness"), allow(dead_code))] // the op tests' (harness feature)
pub fn unit_lower_inverse(b: &mut Body, l: &V, p: MatPrecision) -> Result<V> {
    if l.ty.elem != DType::F32 || l.ty.dims != [C, C] {
        return Err(TpuError::builder("mosaic unit_lower_inverse", format!("a 64x64 f32 L, not {:?}", l.ty)));
    }
    let (i, bd) = (eye(b, C)?, block_diagonal(b, C, S)?);
    let lb = b.mul(l, &bd)?;
    let n = b.sub(l, &lb)?;
    unit_lower_inverse_of_parts(b, &lb, &n, &i, p)
}

/// [`unit_lower_inverse`] of `L = lb + n` given as its 16x16 diagonal blocks `lb` and the rest
/// `n` (as [`ChunkTerms`] has them), with the identity `i`.
pub fn unit_lower_inverse_of_parts(b: &mut Body, lb: &V, n: &V, i: &V, p: MatPrecision) -> Result<V> {
    let square = |v: &V| v.ty.elem == DType::F32 && v.ty.dims == [C, C];
    if !square(lb) || !square(n) || !square(i) {
        return Err(TpuError::builder("mosaic unit_lower_inverse", "64x64 f32 parts and identity"));
    }
    // D^-1 = (I - Lb)(I + Lb^2)(I + Lb^4)(I + Lb^8), each factor applied as soon as its power
    // exists (the order the TPU compiler schedules best).
    let mut d = b.sub(i, lb)?;
    let mut pow = lb.clone();
    for _ in 0..3 {
        pow = product(b, &pow, &pow, p)?;
        let f = b.add(i, &pow)?;
        d = product(b, &d, &f, p)?;
    }
    // A = (I - M)(I + M^2) D^-1, M = D^-1 N.
    let m = product(b, &d, n, p)?;
    let m2 = product(b, &m, &m, p)?;
    let left = b.sub(i, &m)?;
    let right = b.add(i, &m2)?;
    let x = product(b, &left, &right, p)?;
    product(b, &x, &d, p)
}

/// `2^v`.
fn exp2(b: &mut Body, v: &V) -> Result<V> {
    b.unary(crate::lang::Unary::Exp2, v)
}

/// `x / d` of non-negative i32 indices for a power of two `d`, exact (through f32).
fn div_pow2(b: &mut Body, x: &V, d: i64) -> Result<V> {
    let f = b.cast(x, DType::F32)?;
    let r = b.splat(1.0 / d as f64, DType::F32, &x.ty.dims)?;
    let f = b.mul(&f, &r)?;
    b.cast(&f, DType::I32)
}

fn int(b: &mut Body, v: i64, like: &V) -> Result<V> {
    b.splat(v as f64, DType::I32, &like.ty.dims)
}

/// `cond ? then : other` on f32 values, with `cond` from `cmp(x, y)`.
fn pick(b: &mut Body, x: &V, cmp: Cmp, y: &V, then: &V, other: &V) -> Result<V> {
    let c = b.compare(cmp, x, y)?;
    b.select(&c, then, other)
}

/// The `[64, 64]` coefficient masks of the exponents [`chunk_terms`] sums from `g` (row `t`,
/// column `s`), in order: `G` (`s <= t`), the strict suffix (`s > t`), the 4-block mid-anchor
/// exponent `G_t - G_a` (`a = 4 floor(t / 4) + 1`; signed), and per `B` of [`HALVES`] the
/// level exponent: the sum from the start of `t`'s `B` block to `t` when `t` lies in the
/// second half of its `2B` block, the sum after `t` to the end of its `B` block otherwise.
fn exponent_masks(b: &mut Body, lv: Levels) -> Result<Vec<V>> {
    exponent_masks_along(b, 0, lv)
}

/// [`exponent_masks`] with row `t` along dim `rows` (1: the transposed masks).
fn exponent_masks_along(b: &mut Body, rows: usize, lv: Levels) -> Result<Vec<V>> {
    let (t, s) = (b.iota(&[C, C], rows)?, b.iota(&[C, C], 1 - rows)?);
    let one = b.splat(1.0, DType::F32, &[C, C])?;
    let zero = b.splat(0.0, DType::F32, &[C, C])?;
    let minus = b.splat(-1.0, DType::F32, &[C, C])?;
    let upto = pick(b, &s, Cmp::Le, &t, &one, &zero)?;
    let after = pick(b, &s, Cmp::Gt, &t, &one, &zero)?;
    // Mid anchor: +1 on (a, t], -1 on (t, a].
    let a = {
        let q = div_pow2(b, &t, lv.base)?;
        let four = int(b, lv.base, &t)?;
        let base = b.mul(&q, &four)?;
        let one_i = int(b, 1, &t)?;
        b.add(&base, &one_i)?
    };
    let pos = pick(b, &s, Cmp::Gt, &a, &upto, &zero)?;
    let neg_in = pick(b, &s, Cmp::Le, &a, &minus, &zero)?;
    let neg = pick(b, &s, Cmp::Gt, &t, &neg_in, &zero)?;
    let mid = b.add(&pos, &neg)?;
    let mut masks = vec![upto.clone(), after.clone(), mid];
    for half in lv.halves() {
        let (bt, bs) = (div_pow2(b, &t, half)?, div_pow2(b, &s, half)?);
        let same = pick(b, &bt, Cmp::Eq, &bs, &one, &zero)?;
        let (p, q) = (b.mul(&same, &upto)?, b.mul(&same, &after)?);
        // `t` in the second half of its 2B block: floor(t / B) odd.
        let pair = div_pow2(b, &t, 2 * half)?;
        let two = int(b, 2, &t)?;
        let even = b.mul(&pair, &two)?;
        masks.push(pick(b, &bt, Cmp::Ne, &even, &p, &q)?);
    }
    Ok(masks)
}

/// The 0/1 `[64, 64]` masks of the levels of [`chunk_terms`], two per level (the `Aqk` mask,
/// causal with the diagonal, then the `L` mask, strictly causal): level 0 the pairs in one
/// 4-token block, then per `B` of [`HALVES`] the pairs whose 4-blocks first part at `B`; then
/// per level above 0 the symmetric mask ([`LEVEL_PAIRS`]: its pairs in either order, what the
/// level products of both kernels keep), and the strictly lower triangle.
fn level_masks(b: &mut Body, lv: Levels) -> Result<Vec<V>> {
    let dims = [C, C];
    let halves = lv.halves();
    let (t, j) = (b.iota(&dims, 0)?, b.iota(&dims, 1)?);
    let (zero_i, one_i) = (int(b, 0, &t)?, int(b, 1, &t)?);
    // Level: how many of the block sizes `base` to 32 put t and j in different blocks.
    let mut level = zero_i.clone();
    for &half in &halves {
        let (bt, bj) = (div_pow2(b, &t, half)?, div_pow2(b, &j, half)?);
        let ne = b.compare(Cmp::Ne, &bt, &bj)?;
        let inc = b.select(&ne, &one_i, &zero_i)?;
        level = b.add(&level, &inc)?;
    }
    let one = b.splat(1.0, DType::F32, &dims)?;
    let zero = b.splat(0.0, DType::F32, &dims)?;
    let causal = pick(b, &t, Cmp::Ge, &j, &one, &zero)?;
    let strict = pick(b, &t, Cmp::Gt, &j, &one, &zero)?;
    let mut masks = Vec::new();
    for l in 0..=halves.len() as i64 {
        let li = int(b, l, &t)?;
        for kept in [&causal, &strict] {
            masks.push(pick(b, &level, Cmp::Eq, &li, kept, &zero)?);
        }
    }
    // Per level above 0, its pairs in both orders (the strict mask and its transpose); then
    // the strictly lower triangle.
    for l in 1..=halves.len() as i64 {
        let li = int(b, l, &t)?;
        let off_diagonal = pick(b, &t, Cmp::Ne, &j, &one, &zero)?;
        masks.push(pick(b, &level, Cmp::Eq, &li, &off_diagonal, &zero)?);
    }
    masks.push(strict);
    Ok(masks)
}

/// `mask @ g` for a coefficient `mask` of small integers: at full precision, or with
/// `passes` one-pass products of `g` split into bf16 parts (`g = p1 + p2 + ..`; a product of
/// a small integer and a bf16 part is exact, the sums are f32): one pass for a `g` already
/// bf16 (a pre-activated bf16 gate), two for about 16 bits.
fn mask_sum(b: &mut Body, mask: &V, g: &V, data: MatPrecision, passes: usize) -> Result<V> {
    if data != MatPrecision::Default {
        return b.dot(mask, g);
    }
    let mask = b.to_dtype(mask, DType::BF16)?;
    let mut rest = g.clone();
    let mut acc: Option<V> = None;
    for i in 0..passes {
        let part = if i + 1 == passes {
            rest.clone()
        } else {
            let r = b.cast(&rest, DType::BF16)?;
            let part = b.cast(&r, DType::F32)?;
            rest = b.sub(&rest, &part)?;
            part
        };
        let part = b.cast(&part, DType::BF16)?;
        let t = b.matmul(&mask, &part, (1, 0), MatPrecision::Default)?;
        acc = Some(match acc {
            Some(a) => b.add(&a, &t)?,
            None => t,
        });
    }
    acc.ok_or_else(|| TpuError::builder("mosaic mask_sum", "one pass or more"))
}

/// The `[64, K]` array of `x_t - x_r` (`plus(t)`) or `x_r - x_t` for the anchor row
/// `(r, plus) = anchor(t)` of each row `t` of `x` `[64, K]`, built 8 rows (one vreg) at a time:
/// the anchor rows broadcast, a select where the anchor or the sign changes inside the 8 rows.
fn anchored(b: &mut Body, x: &V, anchor: impl Fn(i64) -> (i64, bool)) -> Result<V> {
    let kd = x.ty.dims[1];
    let mut pieces = Vec::new();
    let half = {
        let r = b.iota(&[8, kd], 0)?;
        let four = b.splat(4.0, DType::I32, &[8, kd])?;
        b.compare(Cmp::Lt, &r, &four)?
    };
    for v in 0..C / 8 {
        let rows = b.slice(x, &[8 * v, 0], &[8, kd])?;
        // Each 4-row half has one anchor and one sign.
        let diff = |b: &mut Body, (r, plus): (i64, bool)| -> Result<V> {
            let row = b.slice(x, &[r, 0], &[1, kd])?;
            let row = b.broadcast(&row, &[8, kd])?;
            if plus {
                b.sub(&rows, &row)
            } else {
                b.sub(&row, &rows)
            }
        };
        let (upper, lower) = (anchor(8 * v), anchor(8 * v + 4));
        let first = diff(b, upper)?;
        let piece = if upper == lower {
            first
        } else {
            let second = diff(b, lower)?;
            b.select(&half, &first, &second)?
        };
        pieces.push(piece);
    }
    b.concat(&pieces, 0)
}

/// The chunk-local terms of the chunked forward (docs/kda.md, Chunks) from one chunk's
/// `q`, `k` `[64, K]` f32, log-decays `g` `[64, K]` f32 (already floored) and `beta` `[64, 1]`:
/// `aqk` (`scale` included, causal with the diagonal), `l` (strictly lower, `beta` applied),
/// and the [`ChunkFactors`] they are made of.
#[derive(Clone, Debug)]
pub struct ChunkTerms {
    /// `scale sum_i q_t[i] k_j[i] e^(G_t[i] - G_j[i])` for `j <= t`, `[64, 64]`.
    pub aqk: V,
    /// `beta_t sum_i k_t[i] k_j[i] e^(G_t[i] - G_j[i])` for `j < t`, `[64, 64]`.
    #[cfg_attr(not(feature = "harness"), allow(dead_code))] // the op tests' (harness feature)
    pub l: V,
    /// `l` on its 16x16 diagonal blocks (pairs within 16 tokens), zero elsewhere.
    pub l_blocks: V,
    /// `l` off those blocks: `l = l_blocks + l_rest`.
    pub l_rest: V,
    /// The decay factors and gated tokens.
    pub f: ChunkFactors,
}

/// A chunk's decay factors and gated tokens, every exponential at most 1 or bounded:
/// `qg = q e^G`, `kg = k e^(G_C - G)`, `kbg = beta k e^G`, `eg_last = e^(G_C)` `[1, K]`, and the
/// per-level factors of the pairs of [`chunk_terms`].
#[derive(Clone, Debug)]
pub struct ChunkFactors {
    /// `q e^G`, `[64, K]`.
    pub qg: V,
    /// `k e^(G_C - G)`, `[64, K]`.
    pub kg: V,
    /// `beta k e^G`, `[64, K]`.
    pub kbg: V,
    /// `e^(G_C)`, the whole chunk's decay, `[1, K]`.
    pub eg_last: V,
    /// `e^G`, `[64, K]`.
    pub egc: V,
    /// `e^(G_C - G)`, `[64, K]`.
    pub egs: V,
    /// `beta k`, `[64, K]`.
    pub bk: V,
    /// Per level, the row and column factors `[64, K]`.
    pub factors: Vec<(V, V)>,
    /// Per level, the `Aqk` mask (causal) and the `L` mask (strictly causal), `[64, 64]` f32.
    pub levels: Vec<V>,
    /// Per level above 0, its pairs in either order (0/1 `[64, 64]` f32).
    pub pairs: Vec<V>,
    /// The strictly lower triangle (0/1 `[64, 64]` f32).
    pub lower: V,
    /// The 64x64 identity (from the level masks).
    pub eye: V,
    /// The levels the factors were made for.
    pub blocks: Levels,
}

/// Where [`chunk_terms`] finds its constant masks: made in the body at every step (`Build`), or
/// read from inputs holding [`term_masks_kernel`]'s results (`Input`, one block each for the
/// whole grid, fetched once).
#[derive(Clone, Copy, Debug)]
pub enum TermMasks {
    #[cfg_attr(not(feature = "harness"), allow(dead_code))] // the op tests' (harness feature)
    /// Made by the body.
    Build,
    /// Read from blocks: the exponent masks `[EXPONENT_ROWS, 64]` in the products' dtype (bf16
    /// for one-pass products: their entries -1, 0, 1 are exact) and the level masks
    /// `[LEVEL_ROWS, 64]` f32.
    Input {
        /// The exponent masks.
        exponents: Ref,
        /// The level masks.
        levels: Ref,
    },
}

/// The one-step kernel writing the masks [`chunk_terms`] reads with [`TermMasks::Input`] (the
/// exponent masks in `dtype`, the level masks in f32): the same definitions as
/// [`TermMasks::Build`], made once per call instead of once per step. With `transposed` a
/// third result holds the exponent masks' transposes side by side, `[64, EXPONENT_ROWS]` in
/// `dtype` (what the backward kernel's gate gradient multiplies by).
pub fn term_masks_kernel(dtype: DType, transposed: bool, lv: Levels) -> Result<TermMasksKernel> {
    use crate::lang::{KernelBuilder, Operand, Semantics};
    let ty = |t: DType, rows: i64| crate::hlo::TensorType::new(t, &[rows, C]);
    let mut kb = KernelBuilder::new("kda_term_masks");
    kb.grid(1, Semantics::Arbitrary);
    let exponents = kb.output(Operand::whole("exponents", ty(dtype, lv.exponent_rows())));
    let levels = kb.output(Operand::whole("levels", ty(DType::F32, lv.level_rows())));
    let exponents_t = transposed.then(|| {
        kb.output(Operand::whole("exponents_t", crate::hlo::TensorType::new(dtype, &[C, lv.exponent_rows()])))
    });
    let cast = |b: &mut Body, m: &V| b.to_dtype(m, dtype);
    let kernel = kb.build(|b| {
        for (i, m) in exponent_masks(b, lv)?.iter().enumerate() {
            let m = cast(b, m)?;
            b.store(exponents, &at(i as i64 * C, 0), &m)?;
        }
        for (i, m) in level_masks(b, lv)?.iter().enumerate() {
            b.store(levels, &at(i as i64 * C, 0), m)?;
        }
        if let Some(out) = exponents_t {
            for (i, m) in exponent_masks_along(b, 1, lv)?.iter().enumerate() {
                let m = cast(b, m)?;
                b.store(out, &at(0, i as i64 * C), &m)?;
            }
        }
        Ok(())
    })?;
    Ok(TermMasksKernel { kernel, exponents, levels, exponents_t })
}

/// The masks kernel and its results by name.
pub struct TermMasksKernel {
    /// The kernel.
    pub kernel: crate::lang::Kernel,
    /// The exponent masks `[EXPONENT_ROWS, 64]`.
    pub exponents: Ref,
    /// The level masks `[LEVEL_ROWS, 64]`.
    pub levels: Ref,
    /// The exponent masks' transposes `[64, EXPONENT_ROWS]`, when asked for.
    pub exponents_t: Option<Ref>,
}

/// The memory [`chunk_terms`] uses: where its masks come from (and the levels they were made
/// for), and `sums`, a `[64, K]` f32 scratch holding `G` (whose last row is the chunk's total).
#[derive(Clone, Copy, Debug)]
pub struct TermScratch {
    /// Where the masks come from.
    pub masks: TermMasks,
    /// `G`, whose last row is the chunk's total.
    pub sums: Ref,
    /// The levels of the masks.
    pub levels: Levels,
}

impl TermScratch {
    /// A kernel's: the masks kernel's exponent and level masks for `levels` read from the
    /// inputs `[exponents, levels]`, `G` in the scratch `sums`.
    pub fn of_kernel([exponents, level_masks]: [Ref; 2], sums: Ref, levels: Levels) -> Self {
        TermScratch { masks: TermMasks::Input { exponents, levels: level_masks }, sums, levels }
    }
}

/// Terms of one chunk with every exponential at most 1 or bounded, and every exponent a direct
/// sum of `g` (no difference of long cumulative sums), in whole-chunk products. A
/// pair `j < t` in one 4-token block factors through the block's anchor `a` (its second token,
/// at or before every such `t`), `e^(G_t - G_j) = e^(G_t - G_a) e^(G_a - G_j)`, each factor
/// within `e^(+-60)` under the floor of -30 (no overflow, no underflow); a pair whose 4-blocks
/// first part at block size `B` (`t` in the second half of a `2B` block, `j` in the first)
/// factors through the start of that second half, both factors at most 1. Level 0 is
/// `q x k^T` and `beta k x k^T` over the whole chunk, kept where its strict mask is 1, and the
/// undecayed diagonal `q_t . k_t` of `Aqk` (so every row reads only its own and earlier gates:
/// bitwise causal); a level above it, whose rows and columns never share
/// a token, one product holding its `Aqk` pairs below the diagonal and its `L` pairs above
/// (transposed). The exponents come from coefficient-mask
/// products with `g` (split into `g_passes` bf16 parts for `data = Default`). `data` is the
/// products' precision (`Default`, one bf16 pass, for bf16 inputs).
#[allow(clippy::too_many_arguments)]
pub fn chunk_terms(
    b: &mut Body,
    q: &V,
    k: &V,
    g: &V,
    beta: &V,
    scale: f64,
    scratch: TermScratch,
    data: MatPrecision,
    g_passes: usize,
) -> Result<ChunkTerms> {
    let f = chunk_factors(b, q, k, g, beta, scratch, data, g_passes)?;
    chunk_products(b, q, k, f, scale, data)
}

/// The factors of [`chunk_terms`] alone (what a backward that has the products saved needs).
#[allow(clippy::too_many_arguments)]
pub fn chunk_factors(
    b: &mut Body,
    q: &V,
    k: &V,
    g: &V,
    beta: &V,
    scratch: TermScratch,
    data: MatPrecision,
    g_passes: usize,
) -> Result<ChunkFactors> {
    let kd = g.ty.dims.get(1).copied().unwrap_or(0);
    let ok = |v: &V, w: i64| v.ty.elem == DType::F32 && v.ty.dims == [C, w];
    if !ok(q, kd) || !ok(k, kd) || !ok(g, kd) || !ok(beta, 1) {
        return Err(TpuError::builder("mosaic chunk_terms", "q, k, g [64, K] and beta [64, 1], f32"));
    }
    let lv = scratch.levels;
    let halves = lv.halves();
    let n_levels = 2 * (1 + halves.len());
    let (masks, levels, pairs, lower) = match scratch.masks {
        TermMasks::Build => {
            let mut levels = level_masks(b, lv)?;
            let mut pairs = levels.split_off(n_levels);
            let lower = pairs.pop().ok_or_else(|| TpuError::builder("mosaic chunk_terms", "level masks"))?;
            (exponent_masks(b, lv)?, levels, pairs, lower)
        }
        TermMasks::Input { exponents, levels } => {
            let rows = |b: &mut Body, r: Ref, from: i64, n: usize| -> Result<Vec<V>> {
                (0..n as i64).map(|i| b.load(r, &at(from + i * C, 0), &[C, C])).collect()
            };
            // One-pass products read `G`'s mask alone (the other arrays come from `G`).
            let exps = if data == MatPrecision::Default { 1 } else { 3 + halves.len() };
            (
                rows(b, exponents, 0, exps)?,
                rows(b, levels, 0, n_levels)?,
                rows(b, levels, lv.level_pairs(), halves.len())?,
                b.load(levels, &at(lv.level_pairs() + halves.len() as i64 * C, 0), &[C, C])?,
            )
        }
    };
    // Every exponent array in base 2 (`x log2(e)`), so that each exponential is one `2^x`.
    // Full precision: one product per exponent array of `g log2(e)`, each used as it comes
    // (only `G` is stored, for its last row: the chunk's total). One-pass products (bf16
    // inputs): `G` alone, from `g` as it is (a bf16 `g` is exact in one pass), scaled after,
    // the other arrays differences of its rows ([`anchored`]).
    let sums = match data {
        MatPrecision::Highest
        | MatPrecision::Tf32
        | MatPrecision::Tf32x3
        | MatPrecision::Bf16x3
        | MatPrecision::Ieee => {
            let g2 = mul_const(b, g, std::f64::consts::LOG2_E)?;
            masks.iter().map(|m| mask_sum(b, m, &g2, data, g_passes)).collect::<Result<Vec<_>>>()?
        }
        MatPrecision::Default => {
            let gc = mask_sum(b, &masks[0], g, data, g_passes)?;
            let gc = mul_const(b, &gc, std::f64::consts::LOG2_E)?;
            let mut sums = vec![gc.clone()];
            // The suffix, G_63 - G_t; the mid-anchor exponent, G_t - G_a.
            sums.push(anchored(b, &gc, |_| (C - 1, false))?);
            sums.push(anchored(b, &gc, |t| (lv.base * (t / lv.base) + 1, true))?);
            // Level B: the sum to t from its B block's start in the second half of its 2B
            // block, G_t - G_r, else after t to its B block's end, G_r - G_t, with r the last
            // row of the 2B block's first half.
            for &half in &halves {
                sums.push(anchored(b, &gc, |t| {
                    (half * (2 * (t / (2 * half)) + 1) - 1, (t / half) % 2 == 1)
                })?);
            }
            sums
        }
    };
    let (gc, gs, mid) = (&sums[0], &sums[1], &sums[2]);
    let last = match data {
        MatPrecision::Highest
        | MatPrecision::Tf32
        | MatPrecision::Tf32x3
        | MatPrecision::Bf16x3
        | MatPrecision::Ieee => {
            b.store_all(scratch.sums, gc)?;
            b.load(scratch.sums, &at(C - 1, 0), &[1, kd])?
        }
        MatPrecision::Default => b.slice(gc, &[C - 1, 0], &[1, kd])?,
    };
    let eg_last = exp2(b, &last)?;
    let egc = exp2(b, gc)?;
    let qg = b.mul(q, &egc)?;
    let wide_beta = b.broadcast(beta, &[C, kd])?;
    let bk = b.mul(k, &wide_beta)?;
    let kbg = b.mul(&bk, &egc)?;
    let egs = exp2(b, gs)?;
    let kg = b.mul(k, &egs)?;
    // Row and column factors per level: the mid anchor's pair, then one factor per level (rows
    // in second halves and columns in first halves read the same exponent array).
    let neg_mid = b.unary(crate::lang::Unary::Neg, mid)?;
    let mut factors = vec![(exp2(b, mid)?, exp2(b, &neg_mid)?)];
    for x in &sums[3..] {
        let f = exp2(b, x)?;
        factors.push((f.clone(), f));
    }
    // The identity is level 0's causal mask less its strict one.
    let eye = b.sub(&levels[0], &levels[1])?;
    Ok(ChunkFactors { qg, kg, kbg, eg_last, egc, egs, bk, factors, levels, pairs, lower, eye, blocks: lv })
}

/// The products of [`chunk_terms`] from its factors.
fn chunk_products(
    b: &mut Body,
    q: &V,
    k: &V,
    f: ChunkFactors,
    scale: f64,
    data: MatPrecision,
) -> Result<ChunkTerms> {
    let zero = b.splat(0.0, DType::F32, &[C, C])?;
    let one = b.splat(1.0, DType::F32, &[C, C])?;
    // Level 0 (pairs within a 4-token block): its strictly causal `Aqk` and `L` pairs as two
    // products sharing the column operand, kept where the strict mask is 1 (select, not
    // multiply: outside it the mid-anchor factors may overflow). Every row with such a pair
    // lies at or after its block's anchor (the second token); the diagonal of `Aqk`,
    // `q_t . k_t` with no decay, comes from one more product `q k^T` (cheaper on a TPU than a
    // lane reduction and its broadcast back), so the block's first row reads no later token's
    // gate.
    let ((fr, fc), strict) = (&f.factors[0], &f.levels[1]);
    let cols = b.mul(k, fc)?;
    let qk = b.matmul(q, k, (1, 1), data)?;
    let diagonal = b.mul(&f.eye, &qk)?;
    let mut level0 = vec![];
    for (x, other) in [(q, &diagonal), (&f.bk, &zero)] {
        let rows = b.mul(x, fr)?;
        let p = b.matmul(&rows, &cols, (1, 1), data)?;
        level0.push(pick(b, strict, Cmp::Eq, &one, &p, other)?);
    }
    // Levels 1 to 4 (block size `B`: rows `t` in the second half of a `2B` block, columns `j`
    // in its first, one factor array `e` for both, at most 1) one product each: with
    // `x = e (q on second halves, k on first)` and `y = e (beta k on second halves, k on first)`,
    // `x y^T` holds the level's `Aqk` pairs below the diagonal and its `L` pairs transposed
    // above. Summed on each level's pairs, apart for the levels within 16 tokens (`L`'s
    // diagonal blocks) and across them.
    // `z[0]` the levels within 16 tokens, `z[1]` those across (none within for 16-token
    // level-0 blocks).
    let mut z: [Option<V>; 2] = [None, None];
    for (i, half) in f.blocks.halves().into_iter().enumerate() {
        let e = &f.factors[i + 1].0;
        let x = by_halves(b, half, q, k)?;
        let x = b.mul(&x, e)?;
        let y = by_halves(b, half, &f.bk, k)?;
        let y = b.mul(&y, e)?;
        let p = b.matmul(&x, &y, (1, 1), data)?;
        let kept = b.mul(&p, &f.pairs[i])?;
        let at = usize::from(half >= S);
        z[at] = Some(b.add(z[at].as_ref().unwrap_or(&zero), &kept)?);
    }
    // Below the diagonal (0/1 products, no selects), and what is left above it, transposed.
    let mut below = vec![];
    for zi in &z {
        below.push(match zi {
            Some(zi) => Some(b.mul(zi, &f.lower)?),
            None => None,
        });
    }
    let mut aqk = level0[0].clone();
    for x in below.iter().flatten() {
        aqk = b.add(&aqk, x)?;
    }
    let mut l_parts = vec![];
    for (zi, bi) in z.iter().zip(&below) {
        l_parts.push(match (zi, bi) {
            (Some(zi), Some(bi)) => {
                let above = b.sub(zi, bi)?;
                Some(b.transpose(&above)?)
            }
            _ => None,
        });
    }
    let l_blocks = match &l_parts[0] {
        Some(x) => b.add(&level0[1], x)?,
        None => level0[1].clone(),
    };
    let l_rest = match l_parts[1].take() {
        Some(x) => x,
        None => zero,
    };
    let scale_c = b.splat(scale, DType::F32, &[C, C])?;
    let aqk = b.mul(&aqk, &scale_c)?;
    let l = b.add(&l_blocks, &l_rest)?;
    Ok(ChunkTerms { aqk, l, l_blocks, l_rest, f })
}

/// Rows `t` of `on` where `t` lies in the second half of its `2B` block (`B = half`), of `off`
/// elsewhere, `[64, w]`: whole 8-row tiles taken from one or the other (no arithmetic) for `B`
/// a multiple of 8, else a select on an 8-row pattern.
pub fn by_halves(b: &mut Body, half: i64, on: &V, off: &V) -> Result<V> {
    let w = on.ty.dims[1];
    let parts = if half % 8 == 0 {
        (0..C / half)
            .map(|i| b.slice(if i % 2 == 1 { on } else { off }, &[i * half, 0], &[half, w]))
            .collect::<Result<Vec<_>>>()?
    } else {
        let rows = b.iota(&[8, w], 0)?;
        let second = {
            // t mod 2B >= B within each 8 rows (2B divides 8).
            let mut any = None;
            for start in (half..8).step_by(2 * half as usize) {
                let lo = b.splat(start as f64, DType::I32, &[8, w])?;
                let hi = b.splat((start + half) as f64, DType::I32, &[8, w])?;
                let ge = b.compare(Cmp::Ge, &rows, &lo)?;
                let lt = b.compare(Cmp::Lt, &rows, &hi)?;
                let inside = b.select(&ge, &lt, &ge)?;
                any = Some(match any {
                    None => inside,
                    Some(a) => b.select(&a, &a, &inside)?,
                });
            }
            any.ok_or_else(|| TpuError::builder("mosaic by_halves", "internal: empty half pattern"))?
        };
        (0..C / 8)
            .map(|i| {
                let x = b.slice(on, &[8 * i, 0], &[8, w])?;
                let y = b.slice(off, &[8 * i, 0], &[8, w])?;
                b.select(&second, &x, &y)
            })
            .collect::<Result<Vec<_>>>()?
    };
    b.concat(&parts, 0)
}
