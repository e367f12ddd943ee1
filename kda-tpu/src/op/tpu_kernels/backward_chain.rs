//! The backward's walk from one chunk to the one before it: `dv_new = Aqk^T dO + kg dh` and
//! `dh_prev = e^(G_C) dh + scale qg^T dO - w^T dv_new`, in one of two forms with the same
//! value. With segments, the entering state's terms (`qg`, `w`) on the chunk's first segment's
//! rows, the leaving state's (`kg`) on its last's, `e^(G_C) dh` only across a whole chunk.

use super::super::chunk::{decayed, mul_const};
use super::operands::{if_whole, segment_rows, ChunkSegments, SegmentRows};
use super::terms::ChunkFactors;
use crate::error::Result;
use crate::lang::{Body, MatPrecision, V};

/// What a chunk's step of `dh` reads besides `dh`.
pub(super) struct DhChain<'a> {
    /// The chunk's factors (`qg`, `kg`, `e^(G_C)`).
    pub t: &'a ChunkFactors,
    /// `Aqk` as the products read it.
    pub aqk: &'a V,
    /// `w = A (beta k e^G)`.
    pub w: &'a V,
    /// `dO`.
    pub d_o: &'a V,
    /// The output scale.
    pub scale: f64,
    pub segs: Option<&'a ChunkSegments>,
}

impl DhChain<'_> {
    /// `(dv_new, scale dO, dh_prev)`. With `one_product`, `dh` enters one product on the walk's chain,
    /// `w^T dv_new = (w^T kg) dh + w^T Aqk^T dO`, and the rest is formed beside it; else two
    /// products in a row (`dv_new` from `dh`, then `dh_prev` from `dv_new`), one fewer in all.
    pub fn step(&self, b: &mut Body, dh: &V, one_product: bool, p: MatPrecision) -> Result<(V, V, V)> {
        if one_product {
            self.one_product(b, dh, p)
        } else {
            self.two_products(b, dh, p)
        }
    }

    /// `[Aqk^T, kg] [dO; dh]`, then `[qg; w]^T [scale dO; -dv_new]`.
    fn two_products(&self, b: &mut Body, dh: &V, p: MatPrecision) -> Result<(V, V, V)> {
        let op = self.aqk.ty.elem;
        let dvn = {
            let at = b.transpose(self.aqk)?;
            let kg = self.kg(b)?;
            let lhs = b.concat(&[at, kg], 1)?;
            let d_o = b.to_dtype(self.d_o, op)?;
            let dh_op = b.to_dtype(dh, op)?;
            let rhs = b.concat(&[d_o, dh_op], 0)?;
            b.matmul(&lhs, &rhs, (1, 0), p)?
        };
        let sd_o = mul_const(b, self.d_o, self.scale)?;
        let kept = self.kept(b, dh)?;
        let (qg, w) = self.entering(b)?;
        let y = stacked(b, [qg, w], &sd_o, &dvn, p)?;
        let dh_prev = b.add(&kept, &y)?;
        Ok((dvn, sd_o, dh_prev))
    }

    /// `dv_new = Aqk^T dO + kg dh` and `dh_prev = e^(G_C) dh - (w^T kg) dh + [qg; w]^T
    /// [scale dO; -Aqk^T dO]`: `dh` reaches `dh_prev` through one product.
    fn one_product(&self, b: &mut Body, dh: &V, p: MatPrecision) -> Result<(V, V, V)> {
        let op = self.aqk.ty.elem;
        let kg = self.kg(b)?;
        let (qg, w) = self.entering(b)?;
        let at_do = {
            let at = b.transpose(self.aqk)?;
            let d_o = b.to_dtype(self.d_o, op)?;
            b.matmul(&at, &d_o, (1, 0), p)?
        };
        let dh_op = b.to_dtype(dh, op)?;
        let dvn = {
            let kg_dh = b.matmul(&kg, &dh_op, (1, 0), p)?;
            b.add(&at_do, &kg_dh)?
        };
        let sd_o = mul_const(b, self.d_o, self.scale)?;
        let kept = self.kept(b, dh)?;
        let wkg = {
            let w_op = b.to_dtype(&w, op)?;
            let y = b.matmul(&w_op, &kg, (0, 0), p)?;
            b.to_dtype(&y, op)?
        };
        let chain = b.matmul(&wkg, &dh_op, (1, 0), p)?;
        let beside = stacked(b, [qg, w], &sd_o, &at_do, p)?;
        let kept = b.sub(&kept, &chain)?;
        let dh_prev = b.add(&kept, &beside)?;
        Ok((dvn, sd_o, dh_prev))
    }

    /// `qg` and `w` on the chunk's first segment's rows (the entering state's terms).
    fn entering(&self, b: &mut Body) -> Result<(V, V)> {
        let qg = segment_rows(b, self.segs, &self.t.qg, SegmentRows::First)?;
        Ok((qg, segment_rows(b, self.segs, self.w, SegmentRows::First)?))
    }

    /// `kg` on the chunk's last segment's rows, as the products read it.
    fn kg(&self, b: &mut Body) -> Result<V> {
        let kg = segment_rows(b, self.segs, &self.t.kg, SegmentRows::Last)?;
        b.to_dtype(&kg, self.aqk.ty.elem)
    }

    /// `e^(G_C) dh`, across a whole chunk only.
    fn kept(&self, b: &mut Body, dh: &V) -> Result<V> {
        let kept = decayed(b, dh, &self.t.eg_last)?;
        if_whole(b, self.segs, &kept)
    }
}

/// `[qg; w]^T [scale dO; -x]`: both products with `dO`'s side as one over the stacked tokens.
fn stacked(b: &mut Body, [qg, w]: [V; 2], sd_o: &V, x: &V, p: MatPrecision) -> Result<V> {
    let lhs = b.concat(&[qg, w], 0)?;
    let nx = b.neg(x)?;
    let rhs = b.concat(&[sd_o.clone(), nx], 0)?;
    b.matmul(&lhs, &rhs, (0, 0), p)
}
