//! Building blocks of the KDA kernels, written once on a [`Body`] so that both lowerings share
//! them.

use kda_core::DType;

use super::body::{Binary, Body, MatPrecision, Offset, Ref, V};
use crate::error::{Result, TpuError};
use crate::hlo::Cmp;

/// Rows of a chunk and of its diagonal blocks.
const C: i64 = 64;
const S: i64 = 16;

fn at(r: i64, c: i64) -> [Offset; 2] {
    [Offset::Const(r), Offset::Const(c)]
}

fn mm(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.matmul(x, y, (1, 0), MatPrecision::Highest)
}

/// The identity of `n x n`, f32.
fn eye(b: &mut Body, n: i64) -> Result<V> {
    let (r, c) = (b.iota(&[n, n], 0)?, b.iota(&[n, n], 1)?);
    let d = b.compare(Cmp::Eq, &r, &c)?;
    let (one, zero) = (b.splat(1.0, DType::F32, &[n, n])?, b.splat(0.0, DType::F32, &[n, n])?);
    b.select(&d, &one, &zero)
}

/// The 0/1 f32 `n x n` mask of the diagonal `block x block` blocks.
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
pub fn unit_lower_inverse(b: &mut Body, l: &V, p: MatPrecision) -> Result<V> {
    if l.ty.elem != DType::F32 || l.ty.dims != [C, C] {
        return Err(TpuError::builder("mosaic unit_lower_inverse", format!("a 64x64 f32 L, not {:?}", l.ty)));
    }
    let i = eye(b, C)?;
    let bd = block_diagonal(b, C, S)?;
    let lb = mul(b, l, &bd)?;
    let n = b.binary(Binary::Sub, l, &lb)?;
    let p2 = product(b, &lb, &lb, p)?;
    let p4 = product(b, &p2, &p2, p)?;
    let p8 = product(b, &p4, &p4, p)?;
    let mut d = b.binary(Binary::Sub, &i, &lb)?;
    for q in [&p2, &p4, &p8] {
        let f = add(b, &i, q)?;
        d = product(b, &d, &f, p)?;
    }
    let m = product(b, &d, &n, p)?;
    let m2 = product(b, &m, &m, p)?;
    let left = b.binary(Binary::Sub, &i, &m)?;
    let right = add(b, &i, &m2)?;
    let x = product(b, &left, &right, p)?;
    product(b, &x, &d, p)
}

fn exp(b: &mut Body, v: &V) -> Result<V> {
    b.unary(super::body::Unary::Exp, v)
}

fn mul(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.binary(Binary::Mul, x, y)
}

fn add(b: &mut Body, x: &V, y: &V) -> Result<V> {
    b.binary(Binary::Add, x, y)
}

/// Block sizes of the hierarchy of [`chunk_terms`]: a pair `j < t` of one chunk falls in one
/// 4-token block (level 0), or its tokens first part at block size `B`: in the two halves of one
/// block of `2B` (the level of `B`).
const HALVES: [i64; 4] = [4, 8, 16, 32];

/// `x / d` of non-negative i32 indices for a power of two `d`, exact (through f32).
fn div(b: &mut Body, x: &V, d: i64) -> Result<V> {
    let f = b.cast(x, DType::F32)?;
    let r = b.splat(1.0 / d as f64, DType::F32, &x.ty.dims)?;
    let f = b.binary(Binary::Mul, &f, &r)?;
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
fn exponent_masks(b: &mut Body) -> Result<Vec<V>> {
    let (t, s) = (b.iota(&[C, C], 0)?, b.iota(&[C, C], 1)?);
    let one = b.splat(1.0, DType::F32, &[C, C])?;
    let zero = b.splat(0.0, DType::F32, &[C, C])?;
    let minus = b.splat(-1.0, DType::F32, &[C, C])?;
    let upto = pick(b, &s, Cmp::Le, &t, &one, &zero)?;
    let after = pick(b, &s, Cmp::Gt, &t, &one, &zero)?;
    // Mid anchor: +1 on (a, t], -1 on (t, a].
    let a = {
        let q = div(b, &t, 4)?;
        let four = int(b, 4, &t)?;
        let base = b.binary(Binary::Mul, &q, &four)?;
        let one_i = int(b, 1, &t)?;
        b.binary(Binary::Add, &base, &one_i)?
    };
    let pos = pick(b, &s, Cmp::Gt, &a, &upto, &zero)?;
    let neg_in = pick(b, &s, Cmp::Le, &a, &minus, &zero)?;
    let neg = pick(b, &s, Cmp::Gt, &t, &neg_in, &zero)?;
    let mid = add(b, &pos, &neg)?;
    let mut masks = vec![upto.clone(), after.clone(), mid];
    for &half in &HALVES {
        let (bt, bs) = (div(b, &t, half)?, div(b, &s, half)?);
        let same = pick(b, &bt, Cmp::Eq, &bs, &one, &zero)?;
        let (p, q) = (mul(b, &same, &upto)?, mul(b, &same, &after)?);
        // `t` in the second half of its 2B block: floor(t / B) odd.
        let pair = div(b, &t, 2 * half)?;
        let two = int(b, 2, &t)?;
        let even = b.binary(Binary::Mul, &pair, &two)?;
        masks.push(pick(b, &bt, Cmp::Ne, &even, &p, &q)?);
    }
    Ok(masks)
}

/// The 0/1 `[128, 64]` masks of the levels of [`chunk_terms`] (rows `0..64` the `Aqk` rows
/// `t`, causal with the diagonal; rows `64..128` the `L` rows `t`, strictly causal): level 0
/// pairs in one 4-token block, then per `B` of [`HALVES`] the pairs whose 4-blocks first differ
/// at `B`.
fn level_masks(b: &mut Body) -> Result<Vec<V>> {
    let dims = [2 * C, C];
    let (r, j) = (b.iota(&dims, 0)?, b.iota(&dims, 1)?);
    let c = int(b, C, &r)?;
    let (zero_i, one_i) = (int(b, 0, &r)?, int(b, 1, &r)?);
    let second = b.compare(Cmp::Ge, &r, &c)?;
    let r_minus = b.binary(Binary::Sub, &r, &c)?;
    let t = b.select(&second, &r_minus, &r)?;
    let strict = b.select(&second, &one_i, &zero_i)?;
    let gap = b.binary(Binary::Sub, &t, &j)?;
    let causal = b.compare(Cmp::Ge, &gap, &strict)?;
    // Level: how many of the block sizes 4, 8, 16, 32 put t and j in different blocks.
    let mut level = zero_i.clone();
    for &half in &HALVES {
        let (bt, bj) = (div(b, &t, half)?, div(b, &j, half)?);
        let ne = b.compare(Cmp::Ne, &bt, &bj)?;
        let inc = b.select(&ne, &one_i, &zero_i)?;
        level = b.binary(Binary::Add, &level, &inc)?;
    }
    let one = b.splat(1.0, DType::F32, &dims)?;
    let zero = b.splat(0.0, DType::F32, &dims)?;
    let kept = b.select(&causal, &one, &zero)?;
    (0..=HALVES.len() as i64)
        .map(|l| {
            let li = int(b, l, &r)?;
            pick(b, &level, Cmp::Eq, &li, &kept, &zero)
        })
        .collect()
}

/// `mask @ g` for a coefficient `mask` of small integers: at full precision, or with
/// `passes` one-pass products of `g` split into bf16 parts (`g = p1 + p2 + ..`; a product of
/// a small integer and a bf16 part is exact, the sums are f32): one pass for a `g` already
/// bf16 (a pre-activated bf16 gate), two for about 16 bits.
fn mask_sum(b: &mut Body, mask: &V, g: &V, data: MatPrecision, passes: usize) -> Result<V> {
    if data == MatPrecision::Highest {
        return mm(b, mask, g);
    }
    let mask = if mask.ty.elem == DType::BF16 { mask.clone() } else { b.cast(mask, DType::BF16)? };
    let mut rest = g.clone();
    let mut acc: Option<V> = None;
    for i in 0..passes {
        let part = if i + 1 == passes {
            rest.clone()
        } else {
            let r = b.cast(&rest, DType::BF16)?;
            let part = b.cast(&r, DType::F32)?;
            rest = b.binary(Binary::Sub, &rest, &part)?;
            part
        };
        let part = b.cast(&part, DType::BF16)?;
        let t = b.matmul(&mask, &part, (1, 0), MatPrecision::Default)?;
        acc = Some(match acc {
            Some(a) => add(b, &a, &t)?,
            None => t,
        });
    }
    acc.ok_or_else(|| TpuError::builder("mosaic mask_sum", "one pass or more"))
}

/// The chunk-local terms of the chunked forward (docs/kda.md, Chunks) from one chunk's
/// `q`, `k` `[64, K]` f32, log-decays `g` `[64, K]` f32 (already floored) and `beta` `[64, 1]`:
/// `aqk` (`scale` included, causal with the diagonal), `l` (strictly lower, `beta` applied),
/// `qg = q e^G`, `kg = k e^(G_C - G)`, `kbg = beta k e^G` and `eg_last = e^(G_C)` `[1, K]`.
#[derive(Clone, Debug)]
pub struct ChunkTerms {
    /// `scale sum_i q_t[i] k_j[i] e^(G_t[i] - G_j[i])` for `j <= t`, `[64, 64]`.
    pub aqk: V,
    /// `beta_t sum_i k_t[i] k_j[i] e^(G_t[i] - G_j[i])` for `j < t`, `[64, 64]`.
    pub l: V,
    /// `q e^G`, `[64, K]`.
    pub qg: V,
    /// `k e^(G_C - G)`, `[64, K]`.
    pub kg: V,
    /// `beta k e^G`, `[64, K]`.
    pub kbg: V,
    /// `e^(G_C)`, the whole chunk's decay, `[1, K]`.
    pub eg_last: V,
}

/// Rows of the stacked exponent masks ([`exponent_masks`]): `[EXPONENT_ROWS, 64]`.
pub const EXPONENT_ROWS: i64 = (3 + HALVES.len() as i64) * C;

/// Rows of the stacked level masks ([`level_masks`], `[128, 64]` each): `[LEVEL_ROWS, 64]` f32.
pub const LEVEL_ROWS: i64 = (1 + HALVES.len() as i64) * 2 * C;

/// Where [`chunk_terms`] finds its constant masks: made in the body at every step (`Build`,
/// through the `[448, 64]` f32 scratch `staging`), or read from inputs holding
/// [`term_masks_kernel`]'s results (`Input`, one block each for the whole grid, fetched once).
#[derive(Clone, Copy, Debug)]
pub enum TermMasks {
    /// Made by the body; `staging` stacks the exponent masks for their product.
    Build {
        /// A `[448, 64]` f32 scratch.
        staging: Ref,
    },
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
/// [`TermMasks::Build`], made once per call instead of once per step.
pub fn term_masks_kernel(dtype: DType) -> Result<super::kernel::Kernel> {
    use super::kernel::{KernelBuilder, Operand, Semantics};
    let ty = |t: DType, rows: i64| crate::hlo::TensorType::new(t, &[rows, C]);
    KernelBuilder::new("kda_term_masks")
        .grid(1, Semantics::Arbitrary)
        .output(Operand::whole("exponents", ty(dtype, EXPONENT_ROWS)))
        .output(Operand::whole("levels", ty(DType::F32, LEVEL_ROWS)))
        .build(|b| {
            for (i, m) in exponent_masks(b)?.iter().enumerate() {
                let m = if dtype == DType::F32 { m.clone() } else { b.cast(m, dtype)? };
                b.store(Ref::Output(0), &at(i as i64 * C, 0), &m)?;
            }
            for (i, m) in level_masks(b)?.iter().enumerate() {
                b.store(Ref::Output(1), &at(i as i64 * 2 * C, 0), m)?;
            }
            Ok(())
        })
}

/// The scratch buffers of [`chunk_terms`], f32: `sums` `[448, K]`, `rows` `[640, K]`,
/// `pairs` `[128, 64]`.
#[derive(Clone, Copy, Debug)]
pub struct TermScratch {
    /// Where the masks come from.
    pub masks: TermMasks,
    /// The stacked exponents.
    pub sums: Ref,
    /// The `[q; beta k]` operands of the five levels.
    pub rows: Ref,
    /// The `[Aqk; L]` result.
    pub pairs: Ref,
}

impl TermScratch {
    /// The types of `sums`, `rows`, `pairs` for key width `k`, and of a `Build` staging buffer.
    pub fn types(k: i64) -> [crate::hlo::TensorType; 4] {
        let t = |d: &[i64]| crate::hlo::TensorType::new(DType::F32, d);
        let levels = 1 + HALVES.len() as i64;
        [t(&[EXPONENT_ROWS, k]), t(&[levels * 2 * C, k]), t(&[2 * C, C]), t(&[EXPONENT_ROWS, C])]
    }
}

/// Terms of one chunk with every exponential at most 1 or bounded, and every exponent a direct
/// sum of `g` (no difference of long cumulative sums), in five matmuls of the whole chunk. A
/// pair `j <= t` in one 4-token block factors through the block's anchor `a` (its second token),
/// `e^(G_t - G_j) = e^(G_t - G_a) e^(G_a - G_j)`, each factor within `e^(+-60)` under the
/// floor of -30 (no overflow, no underflow); a pair whose 4-blocks first part at block size `B`
/// (`t` in the second half of a `2B` block, `j` in the first) factors through the start of that
/// second half, both factors at most 1. Each level is one `[q; beta k] x k^T` product of the
/// whole chunk kept where the level's mask is 1. The exponents come from one coefficient-mask
/// product with `g` (split into `g_passes` bf16 parts for `data = Default`). `data` is the
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
    let kd = g.ty.dims.get(1).copied().unwrap_or(0);
    let ok = |v: &V, w: i64| v.ty.elem == DType::F32 && v.ty.dims == [C, w];
    if !ok(q, kd) || !ok(k, kd) || !ok(g, kd) || !ok(beta, 1) {
        return Err(TpuError::builder("mosaic chunk_terms", "q, k, g [64, K] and beta [64, 1], f32"));
    }
    let (all, levels) = match scratch.masks {
        TermMasks::Build { staging } => {
            for (i, m) in exponent_masks(b)?.iter().enumerate() {
                b.store(staging, &at(i as i64 * C, 0), m)?;
            }
            (b.load_all(staging)?, level_masks(b)?)
        }
        TermMasks::Input { exponents, levels } => {
            let all = b.load_all(exponents)?;
            let levels = (0..=HALVES.len() as i64)
                .map(|i| b.load(levels, &at(i * 2 * C, 0), &[2 * C, C]))
                .collect::<Result<Vec<_>>>()?;
            (all, levels)
        }
    };
    let sums = mask_sum(b, &all, g, data, g_passes)?;
    b.store_all(scratch.sums, &sums)?;
    let part = |b: &mut Body, i: i64| b.load(scratch.sums, &at(i * C, 0), &[C, kd]);
    let (gc, gs, mid) = (part(b, 0)?, part(b, 1)?, part(b, 2)?);
    let last = b.load(scratch.sums, &at(C - 1, 0), &[1, kd])?;
    let eg_last = exp(b, &last)?;
    let egc = exp(b, &gc)?;
    let qg = mul(b, q, &egc)?;
    let wide_beta = b.broadcast(beta, &[C, kd])?;
    let bk = mul(b, k, &wide_beta)?;
    let kbg = mul(b, &bk, &egc)?;
    let egs = exp(b, &gs)?;
    let kg = mul(b, k, &egs)?;
    // Row and column factors per level: the mid anchor's pair, then one factor per level (rows
    // in second halves and columns in first halves read the same exponent array).
    let neg_mid = b.unary(super::body::Unary::Neg, &mid)?;
    let mut factors = vec![(exp(b, &mid)?, exp(b, &neg_mid)?)];
    for i in 0..HALVES.len() as i64 {
        let x = part(b, 3 + i)?;
        let f = exp(b, &x)?;
        factors.push((f.clone(), f));
    }
    let zero = b.splat(0.0, DType::F32, &[2 * C, C])?;
    let mut acc = zero.clone();
    for (i, ((fr, fc), keep)) in factors.iter().zip(&levels).enumerate() {
        let base = i as i64 * 2 * C;
        let qr = mul(b, q, fr)?;
        b.store(scratch.rows, &at(base, 0), &qr)?;
        let kr = mul(b, &bk, fr)?;
        b.store(scratch.rows, &at(base + C, 0), &kr)?;
        let rows = b.load(scratch.rows, &at(base, 0), &[2 * C, kd])?;
        let cols = mul(b, k, fc)?;
        let p = b.matmul(&rows, &cols, (1, 1), data)?;
        // Select, not multiply: outside its mask the mid-anchor level may overflow.
        let one = b.splat(1.0, DType::F32, &[2 * C, C])?;
        let kept = pick(b, keep, Cmp::Eq, &one, &p, &zero)?;
        acc = add(b, &acc, &kept)?;
    }
    b.store_all(scratch.pairs, &acc)?;
    let aqk = b.load(scratch.pairs, &at(0, 0), &[C, C])?;
    let scale_c = b.splat(scale, DType::F32, &[C, C])?;
    let aqk = mul(b, &aqk, &scale_c)?;
    let l = b.load(scratch.pairs, &at(C, 0), &[C, C])?;
    Ok(ChunkTerms { aqk, l, qg, kg, kbg, eg_last })
}
