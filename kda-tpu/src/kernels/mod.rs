//! The chunked KDA programs (spec section 4) as StableHLO, built with [`crate::hlo`].

mod intra;
mod ops;
mod prep;
mod programs;
mod recurrence;
mod solve;
mod spec;
mod tiles;

pub use programs::{backward_program, forward_program, fused_program, GATE_FLOOR};
pub use spec::{KernelSpec, CHUNK, SUB, TPU_SLAB};

/// Programs holding one building block each, at a given chunk count, for profiling the kernels
/// piece by piece (`examples/parts.rs`). Not part of the stable API.
#[doc(hidden)]
pub mod parts {
    use super::{intra, tiles};
    use crate::hlo::{ElemType, FnBuilder, Module, TensorType};
    use crate::Result;

    /// The names [`program`] knows.
    pub const NAMES: &[&str] = &["decay", "grams", "row_sides", "col_sides", "inverse", "terms"];

    /// A program with inputs `q, k, v, g [N, 64, K]`, `beta [N, 64, 1]`, `m [N, 64, 64]`.
    pub fn program(name: &str, n: i64, k: i64) -> Result<String> {
        let mut b = FnBuilder::new("main", true);
        let f = |d: &[i64]| TensorType::new(ElemType::F32, d);
        let q = b.arg(f(&[n, 64, k]))?;
        let kk = b.arg(f(&[n, 64, k]))?;
        let v = b.arg(f(&[n, 64, k]))?;
        let g = b.arg(f(&[n, 64, k]))?;
        let beta = b.arg(f(&[n, 64, 1]))?;
        let m = b.arg(f(&[n, 64, 64]))?;
        let dc = tiles::decay(&mut b, g, true)?;
        let outs = match name {
            "decay" => dc.all(),
            "grams" => tiles::grams(&mut b, &dc, [q, kk], kk)?.to_vec(),
            "row_sides" => tiles::row_sides(&mut b, &dc, &[m, m], kk)?,
            "col_sides" => vec![tiles::col_side_sum(&mut b, &dc, &[(m, q), (m, kk)], true)?],
            "inverse" => vec![super::solve::unit_lower_inverse(&mut b, m)?],
            _ => {
                let t = intra::chunk_terms(&mut b, q, kk, v, g, beta, 0.1, true)?;
                vec![t.u, t.w, t.aqk]
            }
        };
        b.ret(&outs)?;
        let mut md = Module::new();
        md.add(b)?;
        Ok(md.to_text())
    }

    /// A program from `q, k, g [N, 64, K]` to the stored decay factors and the two decayed
    /// grams (`Aqk` without scale, and `k k` strictly causal), with the decay factors in the CPU
    /// form (`products`: products of `exp(g)`) or the TPU form (exponentials of sums), so tests
    /// can hold the two forms to each other.
    pub fn decay_forms(n: i64, k: i64, products: bool) -> Result<String> {
        let mut b = FnBuilder::new("main", true);
        let f = |d: &[i64]| TensorType::new(ElemType::F32, d);
        let q = b.arg(f(&[n, 64, k]))?;
        let kk = b.arg(f(&[n, 64, k]))?;
        let g = b.arg(f(&[n, 64, k]))?;
        let dc = tiles::decay(&mut b, g, products)?;
        let mut outs = dc.factors();
        outs.extend(tiles::grams(&mut b, &dc, [q, kk], kk)?);
        b.ret(&outs)?;
        let mut md = Module::new();
        md.add(b)?;
        Ok(md.to_text())
    }
}
