//! `A = (I + L)^-1` for strictly lower `L` `[N, C, C]`, built from 16-row blocks with matmuls.
//!
//! XLA's generic triangular solve expands into a row-by-row loop; here each diagonal block is
//! inverted by repeated squaring (`(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)` for a
//! nilpotent 16x16 `L`) and the blocks below the diagonal follow by block forward substitution,
//! `A_IJ = -A_II sum_{J <= M < I} L_IM A_MJ`, all batched matmuls.

use super::ops::{index_mask, keep, splat};
use super::spec::{CHUNK, SUB};
use crate::hlo::{Cmp, FnBuilder, Value};
use crate::Result;

const NB: usize = CHUNK / SUB;
const S: i64 = SUB as i64;

fn eye(b: &mut FnBuilder, dims: &[i64]) -> Result<Value> {
    let r = dims.len();
    let m = index_mask(b, dims, r - 2, Cmp::Eq, r - 1)?;
    let one = splat(b, 1.0, dims)?;
    keep(b, m, one)
}

/// Block `(i, j)` of `x` `[N, C, C]` as `[N, 16, 16]`.
fn block(b: &mut FnBuilder, x: Value, i: usize, j: usize) -> Result<Value> {
    let n = x.dims()[0];
    let (i, j) = (i as i64 * S, j as i64 * S);
    b.slice(x, &[0, i, j], &[n, i + S, j + S], &[1, 1, 1])
}

/// `(I + L)^-1` for strictly lower `L` `[N, C, C]`.
pub fn unit_lower_inverse(b: &mut FnBuilder, l: Value) -> Result<Value> {
    let n = l.dims()[0];
    // Diagonal blocks, batched as [N*4, 16, 16].
    let diag: Vec<Value> = (0..NB).map(|i| block(b, l, i, i)).collect::<Result<_>>()?;
    let d = b.concatenate(&diag, 0)?;
    let id = eye(b, &[n * NB as i64, S, S])?;
    let neg = b.neg(d)?;
    let mut inv = b.add(id, neg)?; // I - L
    let mut pow = d;
    for _ in 0..3 {
        pow = b.batch_matmul(pow, pow, false, false)?; // L^2, L^4, L^8
        let f = b.add(id, pow)?;
        inv = b.batch_matmul(inv, f, false, false)?;
    }
    let dinv: Vec<Value> = (0..NB)
        .map(|i| b.slice(inv, &[i as i64 * n, 0, 0], &[(i as i64 + 1) * n, S, S], &[1, 1, 1]))
        .collect::<Result<_>>()?;
    // Block forward substitution below the diagonal.
    let zero = splat(b, 0.0, &[n, S, S])?;
    let mut a = vec![vec![zero; NB]; NB];
    for i in 0..NB {
        a[i][i] = dinv[i];
    }
    for i in 1..NB {
        for j in 0..i {
            let mut acc: Option<Value> = None;
            for (m, row) in a.iter().enumerate().take(i).skip(j) {
                let lim = block(b, l, i, m)?;
                let p = b.batch_matmul(lim, row[j], false, false)?;
                acc = Some(match acc {
                    Some(x) => b.add(x, p)?,
                    None => p,
                });
            }
            let acc = acc.ok_or_else(|| crate::TpuError::builder("unit_lower_inverse", "empty block sum"))?;
            let p = b.batch_matmul(a[i][i], acc, false, false)?;
            a[i][j] = b.neg(p)?;
        }
    }
    let rows: Vec<Value> = a.iter().map(|r| b.concatenate(r, 2)).collect::<Result<_>>()?;
    b.concatenate(&rows, 1)
}
