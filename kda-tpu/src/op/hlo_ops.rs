//! Small compositions of builder ops that the kernels use everywhere.

use crate::hlo::Transpose;
use crate::hlo::{Cmp, FnBuilder, TensorType, Value};
use crate::Result;
use kda_core::DType;

/// An f32 tensor type.
pub fn f32t(dims: &[i64]) -> TensorType {
    TensorType::new(DType::F32, dims)
}

/// An i32 tensor type.
pub fn i32t(dims: &[i64]) -> TensorType {
    TensorType::new(DType::I32, dims)
}

/// A splat f32 constant of shape `dims`.
pub fn splat(b: &mut FnBuilder, x: f32, dims: &[i64]) -> Result<Value> {
    b.constant_f32(x, f32t(dims))
}

/// An i1 mask of shape `dims` that is true where index(col_axis) `<=` (or `<` when `strict`)
/// index(row_axis).
pub fn causal_mask(
    b: &mut FnBuilder,
    dims: &[i64],
    row_axis: usize,
    col_axis: usize,
    strict: bool,
) -> Result<Value> {
    let it = TensorType::new(DType::I32, dims);
    let r = b.iota(it.clone(), row_axis)?;
    let c = b.iota(it, col_axis)?;
    b.compare(if strict { Cmp::Lt } else { Cmp::Le }, c, r)
}

/// An i1 mask of shape `dims` that is true where index(a) `cmp` index(b).
pub fn index_mask(b: &mut FnBuilder, dims: &[i64], a: usize, cmp: Cmp, c: usize) -> Result<Value> {
    let it = TensorType::new(DType::I32, dims);
    let x = b.iota(it.clone(), a)?;
    let y = b.iota(it, c)?;
    b.compare(cmp, x, y)
}

/// `select(mask, x, 0)`, broadcasting `mask` to `x`'s shape (trailing-aligned).
pub fn keep(b: &mut FnBuilder, mask: Value, x: Value) -> Result<Value> {
    let m = if mask.dims() == x.dims() { mask } else { b.broadcast_to(mask, x.dims())? };
    let z = splat(b, 0.0, x.dims())?;
    b.select(m, x, z)
}

/// Which rows of a part [`row_sums`] adds into row `t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// Rows `s >= t` (a reverse cumulative sum).
    Suffix,
    /// Rows `s < t` (row 0 gets 0).
    ExclusivePrefix,
    /// Every row (the part may have any number of rows).
    Every,
}

/// `sum_p Scan_p(x_p)` for parts `x_p` `[N, n_p, D]` (the scanned ones with `n` rows): `[N, n,
/// D]`, as one matmul of the parts stacked along axis 1 with a 0/1 matrix `[n, sum n_p]` (fast
/// on every backend; one product and no adds of the partial sums).
pub fn row_sums(b: &mut FnBuilder, n: i64, parts: &[(Value, Scan)]) -> Result<Value> {
    let mut blocks = Vec::new();
    let mut xs = Vec::new();
    for &(x, scan) in parts {
        let np = x.dims()[1];
        let block = match scan {
            Scan::Every => splat(b, 1.0, &[n, np])?,
            Scan::Suffix | Scan::ExclusivePrefix => {
                // block[t, s] = 1 where row s is summed into row t.
                let cmp = if scan == Scan::Suffix { Cmp::Ge } else { Cmp::Lt };
                let m = index_mask(b, &[n, np], 1, cmp, 0)?;
                let one = splat(b, 1.0, &[n, np])?;
                keep(b, m, one)?
            }
        };
        blocks.push(block);
        xs.push(x);
    }
    let (mat, x) =
        if xs.len() == 1 { (blocks[0], xs[0]) } else { (b.concatenate(&blocks, 1)?, b.concatenate(&xs, 1)?) };
    let nb = x.dims()[0];
    let cols = mat.dims()[1];
    let mat = b.broadcast_in_dim(mat, &[nb, n, cols], &[1, 2])?;
    b.batch_matmul(mat, x, Transpose::None)
}

/// The diagonal of square matrices `[N, n, n]` as `[N, n, 1]`.
pub fn diagonal(b: &mut FnBuilder, m: Value) -> Result<Value> {
    let d = m.dims().to_vec();
    let eye = index_mask(b, &d, 1, Cmp::Eq, 2)?;
    let on = keep(b, eye, m)?;
    let s = b.reduce_sum(on, &[2])?;
    b.reshape(s, &[d[0], d[1], 1])
}

/// Sum over the last axis, keeping it as size 1.
pub fn sum_last_keep(b: &mut FnBuilder, x: Value) -> Result<Value> {
    let r = x.rank();
    let s = b.reduce_sum(x, &[r as i64 - 1])?;
    let mut dims = x.dims().to_vec();
    dims[r - 1] = 1;
    b.reshape(s, &dims)
}

/// Element `i` of a 1-D i32 vector as a scalar.
pub fn element(b: &mut FnBuilder, v: Value, i: Value) -> Result<Value> {
    let s = b.dynamic_slice(v, &[i], &[1])?;
    b.reshape(s, &[])
}

/// Reads `x[.., i, ..]` along `axis` (size kept 1 then dropped).
pub fn take(b: &mut FnBuilder, x: Value, axis: usize, i: Value) -> Result<Value> {
    let zero = b.scalar_i32(0)?;
    let idx: Vec<Value> = (0..x.rank()).map(|a| if a == axis { i } else { zero }).collect();
    let mut sizes = x.dims().to_vec();
    sizes[axis] = 1;
    let s = b.dynamic_slice(x, &idx, &sizes)?;
    let mut dims = x.dims().to_vec();
    dims.remove(axis);
    b.reshape(s, &dims)
}

/// Writes `u` (shaped like `x` without `axis`) into `x[.., i, ..]`.
pub fn put(b: &mut FnBuilder, x: Value, axis: usize, i: Value, u: Value) -> Result<Value> {
    let zero = b.scalar_i32(0)?;
    let idx: Vec<Value> = (0..x.rank()).map(|a| if a == axis { i } else { zero }).collect();
    let mut dims = x.dims().to_vec();
    dims[axis] = 1;
    let u = b.reshape(u, &dims)?;
    b.dynamic_update_slice(x, u, &idx)
}

/// `select(flag != 0, a, b)` for an i32 scalar flag.
pub fn choose(b: &mut FnBuilder, flag: Value, x: Value, y: Value) -> Result<Value> {
    let zero = b.scalar_i32(0)?;
    let p = b.compare(Cmp::Ne, flag, zero)?;
    let p = b.broadcast_in_dim(p, x.dims(), &[])?;
    b.select(p, x, y)
}

/// The transposes (last two axes) of `xs`, stored behind one optimization barrier so that XLA
/// cannot fold them back into the products that use them. The CPU configuration runs products
/// over a matrix's rows this way: the CPU plugin's ordinary products are faster than its
/// transposed-operand ones. TPU programs (slabs) keep the transposed-operand form instead.
pub fn stored_transposes(b: &mut FnBuilder, xs: &[Value]) -> Result<Vec<Value>> {
    let t: Vec<Value> = xs
        .iter()
        .map(|&x| {
            let mut perm: Vec<i64> = (0..x.rank() as i64).collect();
            let r = perm.len();
            perm.swap(r - 1, r - 2);
            b.transpose(x, &perm)
        })
        .collect::<Result<_>>()?;
    b.barrier(&t)
}
