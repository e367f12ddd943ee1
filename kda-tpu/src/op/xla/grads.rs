//! The chunk-parallel backward of the XLA programs: every chunk's gradients from its terms, the
//! states and `dh` of the recurrences, and `dO` (docs/kda.md, Chunks, the backward).

use super::intra::{rowdot, ChunkTerms};
use super::tiles::{col_side_sum, row_sides};
use crate::hlo::Transpose;
use crate::hlo::{FnBuilder, Value};
use crate::op::hlo_ops::{causal_mask, diagonal, keep, row_sums, stored_transposes, Scan};
use crate::op::spec::{ProgramSpec, CHUNK};
use crate::Result;

/// `x^T y` over the last two axes: on a stored transpose in the CPU configuration (`stored`,
/// see [`stored_transposes`]: faster there for `A^T` and `Aqk^T`), as a
/// transposed-operand product in slabs (TPU), where stored transposes raised the tpu7x peak.
pub(super) fn t_matmul(b: &mut FnBuilder, x: Value, y: Value, stored: bool) -> Result<Value> {
    if !stored {
        return b.batch_matmul(x, y, Transpose::A);
    }
    let t = stored_transposes(b, &[x])?[0];
    b.batch_matmul(t, y, Transpose::None)
}

/// Gradients of a batch of chunks in chunk layout `[N, C, D]` (`dg` already summed in-chunk).
pub(super) struct ChunkGrads {
    pub dq: Value,
    pub dk: Value,
    pub dv: Value,
    pub dg: Value,
    pub dbeta: Value,
}

/// The chunk-parallel backward from the chunk inputs `[q, k, v, beta]`, the chunk terms,
/// `[h, v_new, dh, dv_new]` (flat `[N, ..]`) and `dO`.
///
/// The gate gradient is formed so that no exact cancellation is left to f32
/// (docs/kernels/gate-gradient.md): the `kg` and whole-chunk-decay terms enter as an
/// exclusive prefix sum and a per-row constant, not as a last-row total that a suffix sum
/// cancels, and the diagonal of `Aqk` (whose gate terms cancel exactly) goes to `dq` and `dk`
/// directly.
pub(super) fn chunk_grads(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    [q, k, v, beta]: [Value; 4],
    ct: &ChunkTerms,
    [h, vn, dh, dvn]: [Value; 4],
    doc: Value,
) -> Result<ChunkGrads> {
    let scale = s.options.scale as f32;
    let dc = &ct.dc;
    // Through O = scale qg S0 + Aqk v_new and S1 = exp(G_last) S0 + kg^T v_new.
    let dqg = b.batch_matmul(doc, h, Transpose::B)?;
    let dqg = b.mul_const(dqg, scale)?;
    let mut dq = b.mul(dqg, dc.eg)?;
    // `dgg`: the gradient with respect to the in-chunk cumulative gate G_t, summed from row t
    // on at the end. The kg and exp(G_last) terms are kept apart (see below).
    let mut dgg = b.mul(dqg, ct.qg)?;
    let dkg = b.batch_matmul(vn, dh, Transpose::B)?;
    let mut dk = b.mul(dkg, dc.eg_rest)?;
    // kg_t = k_t exp(G_last - G_t): -t2_t at G_t and +t2_t at G_last, so token s gets the sum of
    // t2 over the rows before it (an exclusive prefix sum, every term decayed to the chunk end).
    let t2 = b.mul(dkg, ct.kg)?;
    // exp(G_last) S0: the same term for every token of the chunk.
    let hd = b.mul(h, dh)?;
    let hd = b.reduce_sum(hd, &[2])?;
    let hd = b.mul(hd, dc.eg_last)?;
    // Through the WY solve: u = A (beta v), w = A (beta k exp(G)), v_new = u - w S0.
    // dw = -dv_new S0^T; the sign is carried into the uses of A^T dw below (nw = -A^T dw), so
    // no negated copy is stored.
    let ndw = b.batch_matmul(dvn, h, Transpose::B)?;
    // A^T du and A^T dw as two products: one over the concatenation would write both operands
    // and the result once more, only to slice them apart.
    let xu = t_matmul(b, ct.a, dvn, !s.in_slabs())?;
    let nw = t_matmul(b, ct.a, ndw, !s.in_slabs())?;
    let dv = b.mul_bcast(xu, beta)?;
    let db1 = rowdot(b, xu, v)?;
    let db2 = rowdot(b, nw, ct.keg)?;
    let mut dbeta = b.sub(db1, db2)?;
    let bnw = b.mul_bcast(nw, beta)?;
    let t = b.mul(bnw, dc.eg)?;
    dk = b.sub(dk, t)?;
    let t = b.mul(bnw, ct.keg)?;
    dgg = b.sub(dgg, t)?;
    // dL = -(A^T du u^T + A^T dw w^T) = nw w^T - xu u^T.
    let a1 = b.batch_matmul(xu, ct.u, Transpose::B)?;
    let a2 = b.batch_matmul(nw, ct.w, Transpose::B)?;
    let dl = b.sub(a2, a1)?;
    let strict = causal_mask(b, dl.dims(), 1, 2, true)?;
    let dl = keep(b, strict, dl)?;
    let t = rowdot(b, dl, ct.kk)?;
    dbeta = b.add(dbeta, t)?;
    // Intra-chunk terms through Aqk and L. Aqk's diagonal, scale q_t . k_t, has no decay: its
    // cotangent d_t = scale dO_t . v_new_t goes to dq and dk here, and m1 is strictly causal.
    let da = b.batch_matmul(doc, vn, Transpose::B)?;
    let m1 = keep(b, strict, da)?;
    let m1 = b.mul_const(m1, scale)?;
    // Read off `da` (a fresh `dO . v_new` would raise the tpu7x peak of the fused remat
    // program in slabs by one token-sized buffer).
    let diag = diagonal(b, da)?;
    let diag = b.mul_const(diag, scale)?;
    let t = b.mul_bcast(k, diag)?;
    dq = b.add(dq, t)?;
    let t = b.mul_bcast(q, diag)?;
    dk = b.add(dk, t)?;
    let m2 = b.mul_bcast(dl, beta)?;
    let rs = row_sides(b, dc, &[m1, m2], k)?;
    let cc = col_side_sum(b, dc, &[(m1, q), (m2, k)], !s.in_slabs())?;
    // Each side is a sum of a dozen padded tile terms and has two consumers (dq or dk, and the
    // gate gradient): without the barrier XLA stores every term for both instead of the sums.
    let sides = b.barrier(&[rs[0], rs[1], cc])?;
    let (r1, r2, cc) = (sides[0], sides[1], sides[2]);
    dq = b.add(dq, r1)?;
    dk = b.add(dk, r2)?;
    dk = b.add(dk, cc)?;
    let t = b.mul(q, r1)?;
    dgg = b.add(dgg, t)?;
    let t = b.mul(k, r2)?;
    dgg = b.add(dgg, t)?;
    let t = b.mul(k, cc)?;
    dgg = b.sub(dgg, t)?;
    // dg_s = sum_{t >= s} dgg_t + sum_{t < s} t2_t + hd. On the CPU plugin as one product over
    // the three stacked (its scratch stays as without the prefix sum; two products and adds
    // take longer); in slabs (TPU) as two products and adds, since the stacked operand keeps
    // one more token-sized buffer live at the tpu7x peak of the fused remat program.
    let n = dgg.dims()[0];
    let dg = if s.in_slabs() {
        let suffix = row_sums(b, CHUNK as i64, &[(dgg, Scan::Suffix)])?;
        let before = row_sums(b, CHUNK as i64, &[(t2, Scan::ExclusivePrefix)])?;
        let dg = b.add(suffix, before)?;
        let hd = b.broadcast_in_dim(hd, dg.dims(), &[0, 2])?;
        b.add(dg, hd)?
    } else {
        let hd = b.reshape(hd, &[n, 1, s.dims.k as i64])?;
        let rows = [(dgg, Scan::Suffix), (t2, Scan::ExclusivePrefix), (hd, Scan::Every)];
        row_sums(b, CHUNK as i64, &rows)?
    };
    Ok(ChunkGrads { dq, dk, dv, dg, dbeta })
}
