//! The KDA math the kernel families share, written once as [`Body`] functions: the chunk
//! length, the gate's activation and floor (on [`kda_core::GateKind`]) and its backward, the L2
//! norm and its backward, and the chunk update (docs/kda.md, Chunks). The XLA programs keep
//! their own StableHLO forms of the same math (`op/xla`, `op/prep.rs`).

use kda_core::{DType, GateKind};

use crate::error::{Result, TpuError};
use crate::hlo::Cmp;
use crate::lang::{Body, MatPrecision, Offset, Reduction, Ref, V};

/// Tokens per chunk: every kernel's chunk length, kda-core's [`kda_core::CHUNK`].
pub const C: i64 = kda_core::CHUNK as i64;

/// The floor of the per-token log-decay after the gate: a hard reset below it changes nothing
/// (`e^-30` is below f32's resolution of 1), and the factors of a chunk stay within f32.
pub const GATE_FLOOR: f64 = -30.0;

/// `v c` for a constant `c`.
pub fn mul_const(b: &mut Body, v: &V, c: f64) -> Result<V> {
    let c = b.splat(c, DType::F32, &v.ty.dims)?;
    b.mul(v, &c)
}

/// The gate parameters' block of an in-kernel gate.
pub fn gate_params(params: Option<Ref>) -> Result<Ref> {
    params.ok_or_else(|| TpuError::builder("mosaic kernels", "an in-kernel gate without its parameters"))
}

/// `x * rsqrt(sum(x^2) + eps)` over the rows of `x` `[64, K]` (the XLA programs' L2 norm).
pub fn l2_normalise(b: &mut Body, x: &V) -> Result<V> {
    Ok(l2_normalise_with_scale(b, x)?.0)
}

/// [`l2_normalise`] and its per-row scale `rsqrt(sum(x^2) + eps)` `[64, 1]`.
pub fn l2_normalise_with_scale(b: &mut Body, x: &V) -> Result<(V, V)> {
    let dims = x.ty.dims.clone();
    let sq = b.mul(x, x)?;
    let ss = b.reduce(Reduction::Sum, &sq, 1)?;
    let eps = b.splat(kda_core::L2NORM_EPS, DType::F32, &[dims[0], 1])?;
    let ss = b.add(&ss, &eps)?;
    let r = b.rsqrt(&ss)?;
    let wide = b.broadcast(&r, &dims)?;
    Ok((b.mul(x, &wide)?, r))
}

/// The activated, floored log-decay of the raw gate `x` `[64, K]`; the gate parameters (of an
/// in-kernel gate) are the block `params` (`[1, 2, K]`: `exp(a_log)`, `dt_bias`).
pub fn activate(b: &mut Body, x: &V, gate: GateKind, params: Option<Ref>) -> Result<V> {
    activate_columns(b, x, gate, params, 0)
}

/// [`activate`] of the gate's columns `col..` (a block of a wider gate, whose parameters are
/// read from the same columns).
pub fn activate_columns(b: &mut Body, x: &V, gate: GateKind, params: Option<Ref>, col: i64) -> Result<V> {
    let dims = x.ty.dims.clone();
    let g = match gate {
        GateKind::Preactivated => x.clone(),
        GateKind::Softplus | GateKind::LowerBound(_) => {
            let params = gate_params(params)?;
            let row = |b: &mut Body, i: i64| {
                let at = [Offset::Const(0), Offset::Const(i), Offset::Const(col)];
                let r = b.load(params, &at, &[1, 1, dims[1]])?;
                b.reshape(&r, &[1, dims[1]])
            };
            let (a, bias) = (row(b, 0)?, row(b, 1)?);
            let a = b.broadcast(&a, &dims)?;
            let bias = b.broadcast(&bias, &dims)?;
            let z = b.add(x, &bias)?;
            match gate {
                GateKind::Softplus => {
                    // softplus(z) = max(z, 0) + log1p(exp(-|z|)), exact and overflow-free.
                    let zero = b.splat(0.0, DType::F32, &dims)?;
                    let pos = b.max(&z, &zero)?;
                    let nz = b.neg(&z)?;
                    let neg_abs = b.min(&z, &nz)?;
                    let e = b.exp(&neg_abs)?;
                    let l = b.log1p(&e)?;
                    let sp = b.add(&pos, &l)?;
                    let g = b.mul(&a, &sp)?;
                    b.neg(&g)?
                }
                _ => {
                    let lb = if let GateKind::LowerBound(lb) = gate { lb } else { 0.0 };
                    // lb * sigmoid(a z) = lb/2 + lb/2 tanh(a z / 2): one transcendental.
                    let half_a = b.splat(0.5, DType::F32, &dims)?;
                    let half_a = b.mul(&a, &half_a)?;
                    let x = b.mul(&half_a, &z)?;
                    let t = b.tanh(&x)?;
                    let half_lb = b.splat(lb / 2.0, DType::F32, &dims)?;
                    let scaled = b.mul(&t, &half_lb)?;
                    b.add(&scaled, &half_lb)?
                }
            }
        }
    };
    let floor = b.splat(GATE_FLOOR, DType::F32, &dims)?;
    b.max(&g, &floor)
}

/// `sum over the rows' last axis of x y`, `[64, 1]`.
pub fn rowdot(b: &mut Body, x: &V, y: &V) -> Result<V> {
    let p = b.mul(x, y)?;
    b.reduce(Reduction::Sum, &p, 1)
}

/// Through `y = x rsqrt(sum(x^2) + eps)` with `r` the per-row scale: `r (dy - y sum(dy y))`.
pub fn l2_backward(b: &mut Body, dy: &V, y: &V, r: &V) -> Result<V> {
    let dims = y.ty.dims.clone();
    let dot = rowdot(b, dy, y)?;
    let dot = b.broadcast(&dot, &dims)?;
    let t = b.mul(y, &dot)?;
    let dd = b.sub(dy, &t)?;
    let r = b.broadcast(r, &dims)?;
    b.mul(&dd, &r)
}

/// `(dg/dx, dg/da_log)` of the activated gate at the raw gate `x` `[64, K]` (parameters in input
/// `params`, as [`activate`] reads them). Softplus, `g = -a softplus(z)`: `-a sigmoid(z)` and
/// `g`; the lower bound, `g = lb sigmoid(y)`, `y = a z`: `lb s (1 - s) a` and `lb s (1 - s) y`,
/// with `s (1 - s) = e / (1 + e)^2`, `e = e^(-|y|)`, exact where `s` saturates.
pub fn gate_slopes(b: &mut Body, x: &V, gate: GateKind, params: Option<Ref>) -> Result<(V, V)> {
    let dims = x.ty.dims.clone();
    let block = gate_params(params)?;
    let row = |b: &mut Body, i: i64| {
        let at = [Offset::Const(0), Offset::Const(i), Offset::Const(0)];
        let r = b.load(block, &at, &[1, 1, dims[1]])?;
        let r = b.reshape(&r, &[1, dims[1]])?;
        b.broadcast(&r, &dims)
    };
    let (a, bias) = (row(b, 0)?, row(b, 1)?);
    let z = b.add(x, &bias)?;
    let one = b.splat(1.0, DType::F32, &dims)?;
    // e = e^(-|y|) of `y`, and 1 + e.
    let tail = |b: &mut Body, y: &V| -> Result<(V, V)> {
        let ny = b.neg(y)?;
        let neg_abs = b.min(y, &ny)?;
        let e = b.exp(&neg_abs)?;
        let one_e = b.add(&one, &e)?;
        Ok((e, one_e))
    };
    match gate {
        GateKind::Softplus => {
            let (e, one_e) = tail(b, &z)?;
            // sigmoid(z): 1 / (1 + e) for z >= 0, e / (1 + e) below.
            let zero = b.splat(0.0, DType::F32, &dims)?;
            let pos = b.compare(Cmp::Ge, &z, &zero)?;
            let top = b.select(&pos, &one, &e)?;
            let s = b.div(&top, &one_e)?;
            let dz = b.mul(&a, &s)?;
            let dz = b.neg(&dz)?;
            let g = activate(b, x, gate, params)?;
            // dg/da_log = g before the floor; below it dg is zero anyway.
            Ok((dz, g))
        }
        GateKind::LowerBound(lb) => {
            let y = b.mul(&a, &z)?;
            let (e, one_e) = tail(b, &y)?;
            let sq = b.mul(&one_e, &one_e)?;
            let ds = b.div(&e, &sq)?;
            let ds = mul_const(b, &ds, lb)?;
            Ok((b.mul(&ds, &a)?, b.mul(&ds, &y)?))
        }
        GateKind::Preactivated => {
            Err(TpuError::builder("mosaic backward", "gate slopes of a pre-activated gate"))
        }
    }
}

/// A term of the chunk update that segments inside the chunk confine ([`chunk_output`],
/// [`chunk_state_next`]): a kernel with segment masks keeps each to its rows, others take it
/// whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateTerm {
    /// A product with the entering state (`w S`, `qg S`): the first segment's rows.
    Entering,
    /// The output `o`: the rows of real tokens.
    Output,
    /// The decayed entering state `e^(G_C) S`: kept only when no segment starts in the chunk.
    Kept,
    /// The keys `kg` that write the leaving state: the last segment's rows.
    Leaving,
}

/// What the chunk update reads: the state entering the chunk and the chunk's factors, for a
/// block of `Vb` of the state's columns (the whole `V`, or a GPU program's column block).
#[derive(Clone, Copy, Debug)]
pub struct ChunkUpdate<'a> {
    /// The entering state `S` `[K, Vb]`, f32.
    pub state: &'a V,
    /// `w` `[64, K]`: the products read `S` in its dtype.
    pub w: &'a V,
    /// `u` `[64, Vb]`.
    pub u: &'a V,
    /// `q e^G` `[64, K]`.
    pub qg: &'a V,
    /// `k e^(G_C - G)` `[64, K]`.
    pub kg: &'a V,
    /// `Aqk` `[64, 64]`: the products read `v_new` in its dtype.
    pub aqk: &'a V,
    /// `e^(G_C)` `[1, K]`.
    pub last_decay: &'a V,
    /// The output scale, where `qg` does not carry it.
    pub scale: Option<f64>,
    /// The precision of the products.
    pub precision: MatPrecision,
}

/// A kernel's confinement of the update's terms ([`UpdateTerm`]); [`whole_terms`] for rows
/// without segments inside a chunk.
pub type TermMask<'m> = &'m mut dyn FnMut(&mut Body, UpdateTerm, &V) -> Result<V>;

/// Every term whole: chunks without segments inside them.
pub fn whole_terms(_: &mut Body, _: UpdateTerm, x: &V) -> Result<V> {
    Ok(x.clone())
}

/// The chunk's output from its entering state (docs/kda.md, Chunks): `v_new = u - w S` and
/// `o = scale qg S + Aqk v_new`; returns `v_new` as the products read it (in `Aqk`'s dtype)
/// and `o` `[64, Vb]` f32.
pub fn chunk_output(b: &mut Body, x: &ChunkUpdate, mask: TermMask) -> Result<(V, V)> {
    let p = x.precision;
    let s = b.to_dtype(x.state, x.w.ty.elem)?;
    let ws = b.matmul(x.w, &s, (1, 0), p)?;
    let ws = mask(b, UpdateTerm::Entering, &ws)?;
    let v_new = b.sub(x.u, &ws)?;
    let inter = b.matmul(x.qg, &s, (1, 0), p)?;
    let inter = mask(b, UpdateTerm::Entering, &inter)?;
    let inter = match x.scale {
        Some(scale) => {
            let sc = b.splat(scale, DType::F32, &inter.ty.dims)?;
            b.mul(&inter, &sc)?
        }
        None => inter,
    };
    let v_new = b.to_dtype(&v_new, x.aqk.ty.elem)?;
    let intra = b.matmul(x.aqk, &v_new, (1, 0), p)?;
    let o = b.add(&inter, &intra)?;
    let o = mask(b, UpdateTerm::Output, &o)?;
    Ok((v_new, o))
}

/// `e^(G_C) S`: each row of a state (or its gradient) `[K, W]` times its lane's whole-chunk
/// decay `last_decay` `[1, K]`.
pub fn decayed(b: &mut Body, state: &V, last_decay: &V) -> Result<V> {
    let dims = state.ty.dims.clone();
    let decay = b.reshape(last_decay, &[dims[0], 1])?;
    let decay = b.broadcast(&decay, &dims)?;
    b.mul(state, &decay)
}

/// The state leaving the chunk: `S <- e^(G_C) S + kg^T v_new` (`v_new` as [`chunk_output`]
/// returned it), `[K, Vb]` f32.
pub fn chunk_state_next(b: &mut Body, x: &ChunkUpdate, v_new: &V, mask: TermMask) -> Result<V> {
    let kept = decayed(b, x.state, x.last_decay)?;
    let kept = mask(b, UpdateTerm::Kept, &kept)?;
    let kg = mask(b, UpdateTerm::Leaving, x.kg)?;
    let add = b.matmul(&kg, v_new, (0, 0), x.precision)?;
    b.add(&kept, &add)
}
