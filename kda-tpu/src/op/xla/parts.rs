//! Programs holding one building block each, at a given chunk count, for profiling the kernels
//! piece by piece (`examples/parts.rs`). Behind the `harness` feature: not part of the library's API.

use super::{intra, tiles};
use crate::hlo::{FnBuilder, Module, TensorType, Transpose, Value};
use crate::Result;
use kda_core::DType;

/// The names [`program`] knows.
pub const NAMES: &[&str] = &[
    "decay",
    "grams",
    "row_sides",
    "col_sides",
    "inverse",
    "terms",
    "products",
    "products_grams",
    "products_wy",
    "products_loop",
    "products_large",
    "stream",
];

/// A program with inputs `q, k, v, g [N, 64, K]`, `beta [N, 64, 1]`, `m [N, 64, 64]`.
pub fn program(name: &str, n: i64, k: i64) -> Result<String> {
    let mut b = FnBuilder::new("main", true);
    let f = |d: &[i64]| TensorType::new(DType::F32, d);
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
        // Four token-sized elementwise products: what one pass of XLA's fused kernels over
        // token-sized tensors costs (reads 8, writes 4 tensors of `[N, 64, K]`).
        "stream" => vec![b.mul(q, kk)?, b.mul(kk, v)?, b.mul(v, q)?, b.mul(q, v)?],
        "products" | "products_grams" | "products_wy" | "products_loop" | "products_large" => {
            forward_products(&mut b, name, [q, kk, v, m])?
        }
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

/// The forward's products alone (K = V), at their shapes and all chunks at once, with no
/// elementwise work around them: the floor the matmul library sets under the forward.
/// `products_grams`: the grams' level-1 and level-2 tiles (their operands sliced from the
/// inputs, as the forward writes them from its factors); `products_wy`: `A (beta V)` and
/// `A (beta K e^G)`; `products_loop`: the state loop's `[w; qg] S` (`[128, K] x [K, V]` per
/// chunk) and `[Aqk; kg^T] v_new` (`[192, 64] x [64, V]`), their operands read in place;
/// `products`: all three (about 1.33 GFLOP at the primary shape; the WY inverse's small
/// products are left out); `products_large`: one `[64 N, K] x [K, 2K]` product, the
/// library's rate at a shape it likes.
fn forward_products(b: &mut FnBuilder, name: &str, [q, k, v, m]: [Value; 4]) -> Result<Vec<Value>> {
    let (n, kd) = (q.dims()[0], q.dims()[2]);
    let all = name == "products";
    let mut outs = Vec::new();
    if all || name == "products_grams" {
        let q4 = b.reshape(q, &[n, 4, 16, kd])?;
        let k4 = b.reshape(k, &[n, 4, 16, kd])?;
        for i in 1..4 {
            let (qi, ki) =
                (b.slice_axis(q, 1, 16 * i, 16 * i + 16)?, b.slice_axis(k, 1, 16 * i, 16 * i + 16)?);
            let lhs = b.concatenate(&[qi, ki], 1)?; // [N, 32, K]
            let rhs = b.slice_axis(k, 1, 0, 16 * i)?; // [N, 16I, K]
            outs.push(b.dot_general(lhs, rhs, &[0], &[0], &[2], &[2], DType::F32)?);
            let (qi, ki) = (b.slice_axis(q4, 2, 4 * i, 4 * i + 4)?, b.slice_axis(k4, 2, 4 * i, 4 * i + 4)?);
            let lhs = b.concatenate(&[qi, ki], 2)?; // [N, 4, 8, K]
            let rhs = b.slice_axis(k4, 2, 0, 4 * i)?; // [N, 4, 4I, K]
            outs.push(b.dot_general(lhs, rhs, &[0, 1], &[0, 1], &[3], &[3], DType::F32)?);
        }
    }
    if name == "products_large" {
        // One large product, [64 N, K] x [K, 2K]: the library's rate at its best shapes.
        let a = b.reshape(q, &[n * 64, kd])?;
        let w = b.reshape(k, &[n * 32, 2 * kd])?;
        let w = b.slice_axis(w, 0, 0, kd)?;
        outs.push(b.dot_general(a, w, &[], &[], &[1], &[0], DType::F32)?);
    }
    if all || name == "products_wy" {
        outs.push(b.batch_matmul(m, v, Transpose::None)?);
        outs.push(b.batch_matmul(m, k, Transpose::None)?);
    }
    if all || name == "products_loop" {
        // [w; qg] S: N products [128, K] x [K, V], as 2 x N/2 on the inputs' bytes.
        if kd > 128 || n % 2 != 0 {
            let got = format!("N = {n}, K = {kd}");
            return Err(crate::TpuError::unsupported(
                "products part",
                format!("even N and K <= 128, got {got}"),
            ));
        }
        let a = b.reshape(q, &[n / 2, 128, kd])?;
        let s = b.reshape(k, &[n / 2, 128, kd])?;
        let s = b.slice_axis(s, 1, 0, kd)?; // [N/2, K, V]: in place when K = 128
        let c = b.reshape(v, &[n / 2, 128, kd])?;
        outs.push(b.batch_matmul(a, s, Transpose::None)?);
        outs.push(b.batch_matmul(c, s, Transpose::None)?);
        // [Aqk; kg^T] v_new: N products [192, 64] x [64, V], as three [64, 64] x [64, V].
        for x in [v, q, k] {
            outs.push(b.batch_matmul(m, x, Transpose::None)?);
        }
    }
    Ok(outs)
}

/// The multiply-add FLOPs of a `products*` program (2 per multiply-add), `None` for the
/// other parts.
pub fn product_flops(name: &str, n: i64, k: i64) -> Option<f64> {
    let (n, k) = (n as f64, k as f64);
    let grams: f64 = (1..4).map(|i| i as f64 * (2.0 * 32.0 * 16.0 * k + 4.0 * 2.0 * 8.0 * 4.0 * k)).sum();
    let wy = 2.0 * 2.0 * 64.0 * 64.0 * k;
    let lp = 2.0 * (128.0 * k * k + 192.0 * 64.0 * k);
    let per_chunk = match name {
        "products" => grams + wy + lp,
        "products_grams" => grams,
        "products_wy" => wy,
        "products_loop" => lp,
        "products_large" => 2.0 * 64.0 * k * 2.0 * k,
        _ => return None,
    };
    Some(n * per_chunk)
}

/// A program from `q, k, g [N, 64, K]` to the stored decay factors and the two decayed
/// grams (`Aqk` without scale, and `k k` strictly causal), with the decay factors in the CPU
/// form (`products`: products of `exp(g)`) or the TPU form (exponentials of sums), so tests
/// can hold the two forms to each other.
pub fn decay_forms(n: i64, k: i64, products: bool) -> Result<String> {
    let mut b = FnBuilder::new("main", true);
    let f = |d: &[i64]| TensorType::new(DType::F32, d);
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
