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

/// `(I + L)^-1` of a strictly lower 16x16 `l`: `(I - L)(I + L^2)(I + L^4)(I + L^8)`, exact for
/// a nilpotent `L` of that size.
fn diagonal_inverse(b: &mut Body, l: &V) -> Result<V> {
    let i = eye(b, S)?;
    let mut e = b.binary(Binary::Sub, &i, l)?;
    let mut p = l.clone();
    for _ in 0..3 {
        p = mm(b, &p, &p)?;
        let f = b.binary(Binary::Add, &i, &p)?;
        e = mm(b, &e, &f)?;
    }
    Ok(e)
}

/// `A = (I + L)^-1` of a strictly lower 64x64 f32 `l`, as the XLA programs build it: each
/// 16-row diagonal block inverted by repeated squaring, then inverses doubled in size (with
/// `E_u`, `E_l` the inverses of a block's diagonal halves, its inverse is
/// `[[E_u, 0], [-E_l L_lu E_u, E_l]]`), 16 -> 32 -> 64 rows. `work` and `out` are 64x64 f32
/// scratch buffers of the kernel (`out` holds `A` afterwards).
pub fn unit_lower_inverse(b: &mut Body, l: &V, work: Ref, out: Ref) -> Result<V> {
    if l.ty.dtype != DType::F32 || l.ty.dims != [C, C] {
        return Err(TpuError::builder("mosaic unit_lower_inverse", format!("a 64x64 f32 L, not {:?}", l.ty)));
    }
    b.store_all(work, l)?;
    let zero = b.splat(0.0, DType::F32, &[C, C])?;
    b.store_all(out, &zero)?;
    for i in 0..C / S {
        let li = b.load(work, &at(i * S, i * S), &[S, S])?;
        let ei = diagonal_inverse(b, &li)?;
        b.store(out, &at(i * S, i * S), &ei)?;
    }
    // Doublings: blocks of `half` rows pair up into blocks of `2 * half`.
    for half in [S, 2 * S] {
        for top in (0..C).step_by((2 * half) as usize) {
            let eu = b.load(out, &at(top, top), &[half, half])?;
            let el = b.load(out, &at(top + half, top + half), &[half, half])?;
            let llu = b.load(work, &at(top + half, top), &[half, half])?;
            let t = mm(b, &el, &llu)?;
            let t = mm(b, &t, &eu)?;
            let z = b.splat(0.0, DType::F32, &[half, half])?;
            let off = b.binary(Binary::Sub, &z, &t)?;
            b.store(out, &at(top + half, top), &off)?;
        }
    }
    b.load_all(out)
}
