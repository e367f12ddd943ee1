//! The chunked KDA programs (spec section 4) as StableHLO, built with [`crate::hlo`].

mod intra;
mod ops;
mod prep;
mod programs;
mod recurrence;
mod solve;
mod spec;

pub use programs::{backward_program, forward_program, fused_program, GATE_FLOOR};
pub use spec::{KernelSpec, CHUNK, SUB};

/// Programs holding one building block each, at a given chunk count, for profiling the kernels
/// piece by piece (`examples/parts.rs`). Not part of the stable API.
#[doc(hidden)]
pub mod parts {
    use super::intra;
    use crate::hlo::{ElemType, FnBuilder, Module, TensorType};
    use crate::Result;

    /// The names [`program`] knows.
    pub const NAMES: &[&str] = &["decay", "gram", "row_side", "col_side", "inverse", "terms"];

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
        let dc = intra::decay(&mut b, g)?;
        let outs = match name {
            "decay" => {
                let mut o = vec![dc.eg, dc.eg_rest, dc.eg_last];
                for l in &dc.levels {
                    o.push(l.row);
                    o.push(l.col);
                }
                o
            }
            "gram" => vec![intra::decayed_gram(&mut b, &dc, q, kk, false)?],
            "row_side" => vec![intra::row_side(&mut b, &dc, m, kk)?],
            "col_side" => vec![intra::col_side(&mut b, &dc, m, q)?],
            "inverse" => vec![super::solve::unit_lower_inverse(&mut b, m)?],
            _ => {
                let t = intra::chunk_terms(&mut b, q, kk, v, g, beta, 0.1)?;
                vec![t.u, t.w, t.aqk]
            }
        };
        b.ret(&outs)?;
        let mut md = Module::new();
        md.add(b)?;
        Ok(md.to_text())
    }
}
