//! `A = (I + L)^-1` for strictly lower `L` `[N, C, C]`, built from 16-row blocks with matmuls.
//!
//! XLA's generic triangular solve expands into a row-by-row loop; here each diagonal block is
//! inverted by repeated squaring (`(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)` for a
//! nilpotent 16x16 `L`), then inverses double in size: with `E_u`, `E_l` the inverses of the
//! two diagonal halves of a block, its inverse is `[[E_u, 0], [-E_l L_lu E_u, E_l]]`. Two
//! doublings (16 -> 32 -> 64 rows, the two 32-row halves batched together) take 4 products
//! where block forward substitution took 16, each a batched matmul.

use crate::hlo::Transpose;
use crate::hlo::{Cmp, FnBuilder, Value};
use crate::op::hlo_ops::{index_mask, keep, splat};
use crate::op::spec::{CHUNK, SUB};
use crate::Result;

const NB: usize = CHUNK / SUB;
const S: i64 = SUB as i64;
// Two doublings take the 16-row diagonal inverses to a whole chunk.
const _: () = assert!(NB == 4, "unit_lower_inverse doubles 16-row blocks twice: C = 4 * SUB");

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
    // Diagonal blocks in the order 0, 2, 1, 3, batched as [N*4, 16, 16]: the upper and lower
    // halves of each 32-row pair are then contiguous.
    let diag: Vec<Value> = [0, 2, 1, 3].iter().map(|&i| block(b, l, i, i)).collect::<Result<_>>()?;
    let d = b.concatenate(&diag, 0)?;
    let id = eye(b, &[n * NB as i64, S, S])?;
    let neg = b.neg(d)?;
    let mut inv = b.add(id, neg)?; // I - L
    let mut pow = d;
    for _ in 0..3 {
        pow = b.batch_matmul(pow, pow, Transpose::None)?; // L^2, L^4, L^8
        let f = b.add(id, pow)?;
        inv = b.batch_matmul(inv, f, Transpose::None)?;
    }
    // The 32-row blocks from the 16-row pairs (0, 1) and (2, 3), batched.
    let h = 2 * n;
    let du = b.slice(inv, &[0, 0, 0], &[h, S, S], &[1, 1, 1])?;
    let dl = b.slice(inv, &[h, 0, 0], &[2 * h, S, S], &[1, 1, 1])?;
    let lo = [block(b, l, 1, 0)?, block(b, l, 3, 2)?];
    let lo = b.concatenate(&lo, 0)?;
    let e32 = halves_inverse(b, du, dl, lo)?; // [2N, 32, 32]

    // The whole chunk from its two 32-row halves.
    let eu = b.slice(e32, &[0, 0, 0], &[n, 2 * S, 2 * S], &[1, 1, 1])?;
    let el = b.slice(e32, &[n, 0, 0], &[h, 2 * S, 2 * S], &[1, 1, 1])?;
    let m = b.slice(l, &[0, 2 * S, 0], &[n, 4 * S, 2 * S], &[1, 1, 1])?;
    halves_inverse(b, eu, el, m)
}

/// The inverse of the unit lower block matrix `[[U, 0], [lo, D]]` from the inverses `du` of `U`
/// and `dl` of `D`: `[[du, 0], [-dl lo du, dl]]`.
fn halves_inverse(b: &mut FnBuilder, du: Value, dl: Value, lo: Value) -> Result<Value> {
    let (n, r) = (du.dims()[0], du.dims()[1]);
    let x = b.batch_matmul(lo, du, Transpose::None)?;
    let x = b.batch_matmul(dl, x, Transpose::None)?;
    let x = b.neg(x)?;
    let zero = splat(b, 0.0, &[n, r, r])?;
    let top = b.concatenate(&[du, zero], 2)?;
    let bottom = b.concatenate(&[x, dl], 2)?;
    b.concatenate(&[top, bottom], 1)
}
