//! The backward kernel's operands, results and scratch by name, declared on its builder, and
//! its analytic cost.

use kda_core::DType;

use super::dims::{KernelDims, Tokens, C};
use super::operands::{token_operand, ChunkTabs, PerToken, TokenIn};
use crate::error::Result;
use crate::hlo::TensorType;
use crate::lang::{Cost, Index, KernelBuilder, Operand, Ref};

/// The backward kernel's operands, results and scratch by name: what its body reads and
/// writes and what the program around it binds and takes.
#[derive(Clone, Debug)]
pub(super) struct BackwardRefs {
    /// The chunk tables.
    pub tabs: ChunkTabs,
    /// `q k v g beta`, as the forward kernel reads them.
    pub tokens: PerToken<TokenIn>,
    /// The gate parameters `[H, 2, K]` of an in-kernel gate.
    pub gate: Option<Ref>,
    /// `h`, the states the forward kernel saved.
    pub h: Ref,
    /// The chunk terms `a aqk` the forward kernel saved.
    pub terms: Option<[Ref; 2]>,
    /// `do`.
    pub d_o: TokenIn,
    /// `dht` `[L, S, K, V]`.
    pub dht: Option<Ref>,
    /// The exponent and level masks and the exponent masks' transposes.
    pub masks: [Ref; 3],
    /// `dq dk dv dg dbeta`.
    pub grads: PerToken<Ref>,
    /// `dh0` `[L, S, K, V]`.
    pub dh0: Option<Ref>,
    /// `gate_sums` `[L, 2, K]`.
    pub gate_sums: Option<Ref>,
    pub dh: Ref,
    pub sums: Ref,
    /// The rows a packed chunk places around its gradients, of widths K, V and 1.
    pub place: Option<[Ref; 3]>,
}

/// The backward kernel's builder and its operands (in the order [`mod@super::backward`]'s kernel lists).
pub(super) fn declare_backward(d: &KernelDims) -> Result<(KernelBuilder, BackwardRefs)> {
    let n = d.chunks_per_step();
    let (h, r, l, nt, k, v, x) = (d.heads, d.rows, d.heads * d.rows, d.chunks, d.k, d.v, d.dtype);
    let (g0, g1, g2) = (Index::Grid(0), Index::Grid(1), Index::Grid(2));
    let lane = || g0.clone() * r + g1.clone();
    // Grid step `i` holds the chunks of block `nt / n - 1 - i`, walked from its last.
    let rev = || Index::Const(nt / n - 1) + g2.clone() * -1;
    let ty = |dt: DType, dims: &[i64]| TensorType::new(dt, dims);
    let (mut kb, tabs) = d.builder("kda_backward", true);
    let slot = || vec![lane(), Index::table(tabs.slot, rev() * n), Index::Const(0), Index::Const(0)];
    let (dh, sums) = (kb.scratch("dh", ty(DType::F32, &[k, v])), kb.scratch("sums", ty(DType::F32, &[C, k])));
    let tokens = d.declare_tokens(&mut kb, &tabs, true)?;
    let gate = d.declare_gate(&mut kb);
    let chunks_at = || vec![lane(), rev(), Index::Const(0), Index::Const(0)];
    let saved = d.saved_chunks;
    let hs =
        kb.input(Operand::blocked("h", ty(d.state_dtype(), &[l, saved, k, v]), &[1, n, k, v], chunks_at()));
    let terms = d.terms.then(|| {
        ["a", "aqk"].map(|name| {
            kb.input(Operand::blocked(
                name,
                ty(d.mask_dtype(), &[l, saved, C, C]),
                &[1, n, C, C],
                chunks_at(),
            ))
        })
    });
    let d_o = d.token_in(&mut kb, &tabs, "do", v, |t| token_operand("do", d, d.tokens, x, v, t, true))?;
    let dht = d.ht.then(|| {
        kb.input(Operand::blocked("dht", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()))
    });
    let [exponents, levels] = d.declare_masks(&mut kb);
    let transposes =
        kb.input(Operand::whole("exponent_masks_t", ty(d.mask_dtype(), &[C, d.levels().exponent_rows()])));
    let masks = [exponents, levels, transposes];
    let mut grad = |name: &str, dtype: DType, w: i64| -> Result<Ref> {
        Ok(kb.output(if d.tokens.packed() {
            // A head's packed tokens whole, in f32: every chunk's rows go to their tokens, and
            // the block is written back once, after the head's last chunk (padding tokens hold
            // whatever was there: the caller zeroes them).
            let p = d.packed_tokens;
            let (dims, at) = match d.tokens {
                Tokens::PackedBatchFirst if w > 1 => {
                    ([1, p, h * w], vec![Index::Const(0), Index::Const(0), g0.clone()])
                }
                _ => ([h, p, w], vec![g0.clone(), Index::Const(0), Index::Const(0)]),
            };
            Operand::blocked(name, ty(DType::F32, &dims), &[1, p, w], at)
        } else if name == "dbeta" {
            // `dbeta` lane-dense in f32, a chunk's 64 tokens a row, `[L, NT, 64]` (the elements
            // of `[H, R * T]` in order; a `[.., T, 1]` result costs XLA a relayout): a lane's
            // rows whole, resident through its walk.
            let at = vec![lane(), Index::Const(0), Index::Const(0)];
            Operand::blocked(name, ty(DType::F32, &[l, nt, C]), &[1, nt, C], at)
        } else {
            token_operand(name, d, d.tokens, dtype, w, None, true)?
        }))
    };
    let grads = PerToken {
        q: grad("dq", d.qk, k)?,
        k: grad("dk", d.qk, k)?,
        v: grad("dv", x, v)?,
        g: grad("dg", d.g, k)?,
        beta: grad("dbeta", x, 1)?,
    };
    let dh0 = d.h0.then(|| {
        kb.output(Operand::blocked("dh0", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()))
    });
    let gate_sums = gate.is_some().then(|| {
        let at = vec![lane(), Index::Const(0), Index::Const(0)];
        kb.output(Operand::blocked("gate_sums", ty(DType::F32, &[l, 2, k]), &[1, 2, k], at))
    });
    let place = d.tokens.packed().then(|| {
        [("place_k", k), ("place_v", v), ("place_1", 1)]
            .map(|(name, w)| kb.scratch(name, ty(DType::F32, &[3 * C, w])))
    });
    let refs = BackwardRefs {
        tabs,
        tokens,
        gate,
        h: hs,
        terms,
        d_o,
        dht,
        masks,
        grads,
        dh0,
        gate_sums,
        dh,
        sums,
        place,
    };
    Ok((kb, refs))
}

/// The backward kernel's analytic cost (docs/kda.md, Work): the forward's chunk terms again,
/// about twice their products for the gradients; every operand and result once through HBM.
pub(super) fn backward_cost(d: &KernelDims) -> Cost {
    let (l, nt, k, v, x) = (d.heads * d.rows, d.chunks, d.k, d.v, d.dtype);
    let (cf, kf, vf, t) = (C as f64, k as f64, v as f64, (l * nt * C) as f64);
    let flops = t * 3.0 * (6.0 * cf * kf + 4.0 * cf * vf + 6.0 * kf * vf + 2.0 / 3.0 * cf * cf);
    let bytes_of = |t: DType| f64::from(t.bit_width() / 8);
    let bytes = t * 2.0 * (2.0 * kf * bytes_of(d.qk) + (2.0 * vf + 1.0) * bytes_of(x) + kf * bytes_of(d.g))
        + (l * k * v) as f64 * 4.0 * (nt + d.slots * (i64::from(d.h0) + i64::from(d.ht))) as f64;
    Cost { flops, transcendentals: t * kf * 8.0, bytes }
}
