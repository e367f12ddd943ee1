//! The kernel language, op by op and feature by feature: each kernel's interpret lowering
//! runs on the CPU plugin and matches a host computation, its Mosaic lowering compiles for
//! `tpu7x:2x2x1` through the setup's libtpu, and its Triton lowering compiles for the H200
//! through the setup's CUDA plugin (or is refused, naming why). `cargo xtask test` runs every test in its own
//! process (nextest), so a libtpu crash on a new op shape fails that test, not the suite.

// The shared runner of builder programs; this binary reads float results only.
#[allow(dead_code)]
#[macro_use]
mod hlo_support;

use half::bf16;
use hlo_support::{assert_close, rand_vec, unit_rows, In};
use kda_core::{DType, GateKind};
use kda_tpu::aot::{GpuCompiler, H200};
use kda_tpu::hlo::{Cmp, TensorType};
use kda_tpu::lang::{
    Binary, Cost, F32Dot, Feature, Index, Interpret, Kernel, KernelBuilder, Lower, Lowering, MatPrecision,
    Mosaic, MosaicParams, Offset, Operand, Reduction, Ref, Scan, Semantics, Triton, TritonParams,
};
use kda_tpu::op::tpu_kernels::terms::{Levels, TermMasks, TermScratch};
use kda_tpu::{Result, TpuCompiler, DEFAULT_TOPOLOGY};
use rstest::rstest;

fn t(dtype: DType, dims: &[i64]) -> TensorType {
    TensorType::new(dtype, dims)
}

/// Row-major `a [m, k] x b [k, n]` in f64.
fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] =
                (0..k).map(|c| f64::from(a[i * k + c]) * f64::from(b[c * n + j])).sum::<f64>() as f32;
        }
    }
    out
}

fn transpose(a: &[f32], m: usize, n: usize) -> Vec<f32> {
    (0..n * m).map(|i| a[(i % m) * n + i / m]).collect()
}

/// A kernel, its operands and the host's expected results (with their tolerance).
struct Case {
    kernel: Kernel,
    inputs: Vec<In>,
    want: Vec<Vec<f32>>,
    tol: f32,
}

/// A case of one result.
fn case_of(kernel: Kernel, inputs: Vec<In>, want: Vec<f32>, tol: f32) -> Result<Case> {
    Ok(Case { kernel, inputs, want: vec![want], tol })
}

fn one_step(name: &str) -> KernelBuilder {
    let mut k = KernelBuilder::new(name);
    k.grid(1, Semantics::Parallel);
    k
}

/// `a x b` of two whole `dtype` operands of `dims`, contracting `contract`, into f32.
fn matmul_kernel(
    name: &str,
    dtype: DType,
    dims: [[i64; 2]; 2],
    contract: (usize, usize),
    precision: MatPrecision,
) -> Result<Kernel> {
    let out = [dims[0][1 - contract.0], dims[1][1 - contract.1]];
    whole_kernel(name, &[t(dtype, &dims[0]), t(dtype, &dims[1])], &[t(DType::F32, &out)], |b, ins, outs| {
        let (x, y) = (b.load_all(ins[0])?, b.load_all(ins[1])?);
        let p = b.matmul(&x, &y, contract, precision)?;
        b.store_all(outs[0], &p)
    })
}

/// A one-step kernel of whole operands and results of the types given, running `body` on
/// their references (inputs, then results).
fn whole_kernel(
    name: &str,
    inputs: &[TensorType],
    outputs: &[TensorType],
    body: impl FnOnce(&mut kda_tpu::lang::Body, &[Ref], &[Ref]) -> Result<()>,
) -> Result<Kernel> {
    let mut k = one_step(name);
    let ins: Vec<Ref> = inputs
        .iter()
        .enumerate()
        .map(|(i, ty)| k.input(Operand::whole(&format!("in{i}"), ty.clone())))
        .collect();
    let outs: Vec<Ref> = outputs
        .iter()
        .enumerate()
        .map(|(i, ty)| k.output(Operand::whole(&format!("out{i}"), ty.clone())))
        .collect();
    k.build(|b| body(b, &ins, &outs))
}

fn matmul_f32() -> Result<Case> {
    let (x, y) = (rand_vec(128 * 128, 1, -1.0, 1.0), rand_vec(128 * 128, 2, -1.0, 1.0));
    let kernel = whole_kernel(
        "matmul_f32",
        &[t(DType::F32, &[128, 128]), t(DType::F32, &[128, 128])],
        &[t(DType::F32, &[128, 128])],
        |b, ins, outs| {
            let (a, c) = (b.load_all(ins[0])?, b.load_all(ins[1])?);
            let p = b.matmul(&a, &c, (1, 0), MatPrecision::Highest)?;
            let one = b.splat(1.0, DType::F32, &[128, 128])?;
            let r = b.add(&p, &one)?;
            b.store_all(outs[0], &r)
        },
    )?;
    let want = matmul(&x, &y, 128, 128, 128).into_iter().map(|v| v + 1.0).collect();
    case_of(kernel, vec![In::F32(x, vec![128, 128]), In::F32(y, vec![128, 128])], want, 1e-5)
}

fn matmul_kt_v() -> Result<Case> {
    let (k, v) = (rand_vec(64 * 128, 3, -1.0, 1.0), rand_vec(64 * 128, 4, -1.0, 1.0));
    let kernel =
        matmul_kernel("matmul_kt_v", DType::F32, [[64, 128], [64, 128]], (0, 0), MatPrecision::Highest)?;
    let want = matmul(&transpose(&k, 64, 128), &v, 128, 64, 128);
    case_of(kernel, vec![In::F32(k, vec![64, 128]), In::F32(v, vec![64, 128])], want, 1e-5)
}

fn matmul_bf16() -> Result<Case> {
    let round = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let (a, c) = (round(rand_vec(64 * 128, 5, -1.0, 1.0)), round(rand_vec(128 * 256, 6, -1.0, 1.0)));
    let wide = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    let kernel =
        matmul_kernel("matmul_bf16", DType::BF16, [[64, 128], [128, 256]], (1, 0), MatPrecision::Default)?;
    let want = matmul(&wide(&a), &wide(&c), 64, 128, 256);
    case_of(kernel, vec![In::Bf16(a, vec![64, 128]), In::Bf16(c, vec![128, 256])], want, 1e-5)
}

fn elementwise() -> Result<Case> {
    let x = rand_vec(8 * 128, 7, 0.5, 2.0);
    let kernel = whole_kernel(
        "elementwise",
        &[t(DType::F32, &[8, 128])],
        &[t(DType::F32, &[8, 128])],
        |b, ins, outs| {
            let x = b.load_all(ins[0])?;
            let one = b.splat(1.0, DType::F32, &[8, 128])?;
            let (e, l, r, n) = (b.exp(&x)?, b.log(&x)?, b.rsqrt(&x)?, b.neg(&x)?);
            let lr = b.mul(&l, &r)?;
            let nx = b.div(&n, &x)?;
            let (hi, lo) = (b.max(&x, &one)?, b.min(&x, &one)?);
            let s = b.add(&e, &lr)?;
            let l1 = b.log1p(&x)?;
            let s = b.add(&s, &l1)?;
            let th = b.tanh(&x)?;
            let s = b.add(&s, &th)?;
            let e2 = b.exp2(&x)?;
            let s = b.add(&s, &e2)?;
            let s = b.sub(&s, &nx)?;
            let m = b.sub(&hi, &lo)?;
            let out = b.add(&s, &m)?;
            b.store_all(outs[0], &out)
        },
    )?;
    let want = x
        .iter()
        .map(|&v| {
            let v = f64::from(v);
            (v.exp() + v.ln() / v.sqrt() + v.ln_1p() + v.tanh() + v.exp2() + 1.0 + (v.max(1.0) - v.min(1.0)))
                as f32
        })
        .collect();
    Ok(Case { kernel, inputs: vec![In::F32(x, vec![8, 128])], want: vec![want], tol: 1e-5 })
}

fn causal_mask() -> Result<Case> {
    let x = rand_vec(64 * 128, 8, -1.0, 1.0);
    let kernel = whole_kernel(
        "causal_mask",
        &[t(DType::F32, &[64, 128])],
        &[t(DType::F32, &[64, 128])],
        |b, ins, outs| {
            let x = b.load_all(ins[0])?;
            let (r, c) = (b.iota(&[64, 128], 0)?, b.iota(&[64, 128], 1)?);
            let keep = b.compare(Cmp::Ge, &r, &c)?;
            let zero = b.splat(0.0, DType::F32, &[64, 128])?;
            let out = b.select(&keep, &x, &zero)?;
            b.store_all(outs[0], &out)
        },
    )?;
    let want = x.iter().enumerate().map(|(i, &v)| if i / 128 >= i % 128 { v } else { 0.0 }).collect();
    Ok(Case { kernel, inputs: vec![In::F32(x, vec![64, 128])], want: vec![want], tol: 0.0 })
}

fn reduce_broadcast() -> Result<Case> {
    let x = rand_vec(64 * 128, 9, -1.0, 1.0);
    let kernel = whole_kernel(
        "reduce_broadcast",
        &[t(DType::F32, &[64, 128])],
        &[t(DType::F32, &[64, 128])],
        |b, ins, outs| {
            let x = b.load_all(ins[0])?;
            let (s, m) = (b.reduce(Reduction::Sum, &x, 1)?, b.reduce(Reduction::Max, &x, 1)?);
            let (s, m) = (b.broadcast(&s, &[64, 128])?, b.broadcast(&m, &[64, 128])?);
            let d = b.sub(&x, &m)?;
            let out = b.add(&d, &s)?;
            b.store_all(outs[0], &out)
        },
    )?;
    let mut want = vec![0f32; 64 * 128];
    for r in 0..64 {
        let row = &x[r * 128..(r + 1) * 128];
        let s: f64 = row.iter().map(|&v| f64::from(v)).sum();
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for c in 0..128 {
            want[r * 128 + c] = (f64::from(row[c]) - f64::from(m) + s) as f32;
        }
    }
    Ok(Case { kernel, inputs: vec![In::F32(x, vec![64, 128])], want: vec![want], tol: 1e-5 })
}

fn cast_transpose() -> Result<Case> {
    let x = rand_vec(64 * 128, 10, -1.0, 1.0);
    let kernel = whole_kernel(
        "cast_transpose",
        &[t(DType::F32, &[64, 128])],
        &[t(DType::F32, &[128, 64])],
        |b, ins, outs| {
            let x = b.load_all(ins[0])?;
            let h = b.cast(&x, DType::BF16)?;
            let w = b.cast(&h, DType::F32)?;
            let tr = b.transpose(&w)?;
            b.store_all(outs[0], &tr)
        },
    )?;
    let rounded: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    Ok(Case {
        kernel,
        inputs: vec![In::F32(x, vec![64, 128])],
        want: vec![transpose(&rounded, 64, 128)],
        tol: 0.0,
    })
}

fn blocked_grid() -> Result<Case> {
    let x = rand_vec(512 * 128, 11, -1.0, 1.0);
    let rows = vec![Index::Grid(0), Index::Const(0)];
    let mut kb = KernelBuilder::new("blocked_grid");
    kb.grid(8, Semantics::Parallel);
    let xs = kb.input(Operand::blocked("x", t(DType::F32, &[512, 128]), &[64, 128], rows.clone()));
    let o = kb.output(Operand::blocked("o", t(DType::F32, &[512, 128]), &[64, 128], rows));
    let kernel = kb.build(|b| {
        // Block i scaled by i + 1: the grid index broadcast and cast to f32.
        let x = b.load_all(xs)?;
        let i = b.program_id(0)?;
        let one = b.index(1)?;
        let ip1 = b.index_op(Binary::Add, &i, &one)?;
        let s = b.broadcast(&ip1, &[64, 128])?;
        let s = b.cast(&s, DType::F32)?;
        let out = b.mul(&x, &s)?;
        b.store_all(o, &out)
    })?;
    let want = x.iter().enumerate().map(|(i, v)| v * (i / (64 * 128) + 1) as f32).collect();
    Ok(Case { kernel, inputs: vec![In::F32(x, vec![512, 128])], want: vec![want], tol: 0.0 })
}

fn scalar_prefetch() -> Result<Case> {
    // tab[0..8): which 8-row block of x step i reads; tab[8 + i]: which 8-row block of y it adds.
    let table: Vec<i32> = vec![3, 0, 7, 1, 6, 2, 5, 4, 7, 6, 5, 4, 3, 2, 1, 0];
    let (x, y) = (rand_vec(64 * 128, 12, -1.0, 1.0), rand_vec(64 * 128, 13, -1.0, 1.0));
    let mut kb = KernelBuilder::new("scalar_prefetch");
    kb.grid(8, Semantics::Arbitrary);
    let tab = kb.table("tab", 16);
    let xs = kb.input(Operand::blocked(
        "x",
        t(DType::F32, &[64, 128]),
        &[8, 128],
        vec![Index::table(tab, Index::Grid(0)), Index::Const(0)],
    ));
    let ys = kb.input(Operand::whole("y", t(DType::F32, &[64, 128])));
    let o = kb.output(Operand::blocked(
        "o",
        t(DType::F32, &[64, 128]),
        &[8, 128],
        vec![Index::Grid(0), Index::Const(0)],
    ));
    let kernel = kb.build(|b| {
        let x = b.load_all(xs)?;
        let i = b.program_id(0)?;
        let eight = b.index(8)?;
        let at = b.index_op(Binary::Add, &i, &eight)?;
        let blk = b.read_table(tab, &at)?;
        let row = b.index_op(Binary::Mul, &blk, &eight)?;
        let y = b.load(ys, &[Offset::Dyn(row, 8), Offset::Const(0)], &[8, 128])?;
        let out = b.add(&x, &y)?;
        b.store_all(o, &out)
    })?;
    let mut want = vec![0f32; 64 * 128];
    for i in 0..8 {
        let (xb, yb) = (table[i] as usize, table[8 + i] as usize);
        for r in 0..8 {
            for c in 0..128 {
                want[(i * 8 + r) * 128 + c] = x[(xb * 8 + r) * 128 + c] + y[(yb * 8 + r) * 128 + c];
            }
        }
    }
    let inputs = vec![In::I32(table, vec![16]), In::F32(x, vec![64, 128]), In::F32(y, vec![64, 128])];
    Ok(Case { kernel, inputs, want: vec![want], tol: 0.0 })
}

/// Value slices and concatenations: `[x[64.., ..128]; x[..64, 128..]]` along rows and
/// `[x[..64, ..128] | x[64.., 128..]]` along lanes, of `x` `[128, 256]`.
fn slice_concat() -> Result<Case> {
    let x = rand_vec(128 * 256, 14, -1.0, 1.0);
    let kernel = whole_kernel(
        "slice_concat",
        &[t(DType::F32, &[128, 256])],
        &[t(DType::F32, &[128, 128]), t(DType::F32, &[64, 256])],
        |b, ins, outs| {
            let x = b.load_all(ins[0])?;
            let part = |b: &mut kda_tpu::lang::Body, r: i64, c: i64| b.slice(&x, &[r, c], &[64, 128]);
            let (a, d) = (part(b, 64, 0)?, part(b, 0, 128)?);
            let rows = b.concat(&[a, d], 0)?;
            b.store_all(outs[0], &rows)?;
            let (a, d) = (part(b, 0, 0)?, part(b, 64, 128)?);
            let lanes = b.concat(&[a, d], 1)?;
            b.store_all(outs[1], &lanes)
        },
    )?;
    let at = |r: usize, c: usize| x[r * 256 + c];
    let rows = (0..128 * 128).map(|i| (i / 128, i % 128)).map(|(r, c)| {
        if r < 64 {
            at(r + 64, c)
        } else {
            at(r - 64, c + 128)
        }
    });
    let lanes = (0..64 * 256)
        .map(|i| (i / 256, i % 256))
        .map(|(r, c)| if c < 128 { at(r, c) } else { at(r + 64, c) });
    Ok(Case {
        kernel,
        inputs: vec![In::F32(x.clone(), vec![128, 256])],
        want: vec![rows.collect(), lanes.collect()],
        tol: 0.0,
    })
}

/// The packed forward's window read: step `i` stores the aligned 64-row blocks `lo[i]` and
/// `lo[i] + 1` of `x` into scratch and loads 64 rows from the unaligned run-time row `off[i]`.
fn unaligned_window() -> Result<Case> {
    let (lo, off): (Vec<i32>, Vec<i32>) = (vec![0, 2, 1], vec![13, 63, 1]);
    let table: Vec<i32> = lo.iter().chain(&off).copied().collect();
    let x = rand_vec(256 * 128, 15, -1.0, 1.0);
    let mut kb = KernelBuilder::new("unaligned_window");
    kb.grid(3, Semantics::Arbitrary);
    let tab = kb.table("tab", 6);
    let block = |shift: i64| {
        Operand::blocked(
            "x",
            t(DType::F32, &[256, 128]),
            &[64, 128],
            vec![Index::table(tab, Index::Grid(0)) + Index::Const(shift), Index::Const(0)],
        )
    };
    let halves = [kb.input(block(0)), kb.input(block(1))];
    let o = kb.output(Operand::blocked(
        "o",
        t(DType::F32, &[192, 128]),
        &[64, 128],
        vec![Index::Grid(0), Index::Const(0)],
    ));
    let window = kb.scratch("window", t(DType::F32, &[128, 128]));
    let kernel = kb.build(|b| {
        for (half, r) in halves.into_iter().enumerate() {
            let x = b.load_all(r)?;
            b.store(window, &[Offset::Const(64 * half as i64), Offset::Const(0)], &x)?;
        }
        let i = b.program_id(0)?;
        let three = b.index(3)?;
        let at = b.index_op(Binary::Add, &i, &three)?;
        let off = b.read_table(tab, &at)?;
        let w = b.load(window, &[Offset::Dyn(off, 1), Offset::Const(0)], &[64, 128])?;
        b.store_all(o, &w)
    })?;
    let mut want = vec![0f32; 192 * 128];
    for i in 0..3 {
        let start = (lo[i] * 64 + off[i]) as usize;
        want[i * 64 * 128..(i + 1) * 64 * 128].copy_from_slice(&x[start * 128..(start + 64) * 128]);
    }
    let inputs =
        vec![In::I32(table, vec![6]), In::F32(x.clone(), vec![256, 128]), In::F32(x, vec![256, 128])];
    Ok(Case { kernel, inputs, want: vec![want], tol: 0.0 })
}

fn scratch_state() -> Result<Case> {
    // Per head h: S = sum over 8 chunks c of k[h, c]^T v[h, c], carried in VMEM scratch over the
    // arbitrary chunk axis, reset at c = 0 and written at the last chunk.
    let (k, v) = (rand_vec(4 * 512 * 128, 14, -0.5, 0.5), rand_vec(4 * 512 * 128, 15, -0.5, 0.5));
    let kv = vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let mut kb = KernelBuilder::new("scratch_state");
    kb.grid(4, Semantics::Parallel).grid(8, Semantics::Arbitrary);
    let ks = kb.input(Operand::blocked("k", t(DType::F32, &[4, 512, 128]), &[1, 64, 128], kv.clone()));
    let vs = kb.input(Operand::blocked("v", t(DType::F32, &[4, 512, 128]), &[1, 64, 128], kv));
    let o = kb.output(Operand::blocked(
        "o",
        t(DType::F32, &[4, 128, 128]),
        &[1, 128, 128],
        vec![Index::Grid(0), Index::Const(0), Index::Const(0)],
    ));
    let state = kb.scratch("state", t(DType::F32, &[128, 128]));
    let kernel = kb.build(|b| {
        let c = b.program_id(1)?;
        let (first, last) = (b.index(0)?, b.index(7)?);
        let at_first = b.compare(Cmp::Eq, &c, &first)?;
        b.when(&at_first, |b| {
            let z = b.splat(0.0, DType::F32, &[128, 128])?;
            b.store_all(state, &z)
        })?;
        let kb = b.load_all(ks)?;
        let vb = b.load_all(vs)?;
        let (kb, vb) = (b.reshape(&kb, &[64, 128])?, b.reshape(&vb, &[64, 128])?);
        let s = b.load_all(state)?;
        let p = b.matmul(&kb, &vb, (0, 0), MatPrecision::Highest)?;
        let s = b.add(&s, &p)?;
        b.store_all(state, &s)?;
        let at_last = b.compare(Cmp::Eq, &c, &last)?;
        b.when(&at_last, |b| {
            let x = b.reshape(&s, &[1, 128, 128])?;
            b.store_all(o, &x)
        })
    })?;
    let mut want = Vec::with_capacity(4 * 128 * 128);
    for h in 0..4 {
        let kh = &k[h * 512 * 128..(h + 1) * 512 * 128];
        let vh = &v[h * 512 * 128..(h + 1) * 512 * 128];
        want.extend(matmul(&transpose(kh, 512, 128), vh, 128, 512, 128));
    }
    let inputs = vec![In::F32(k, vec![4, 512, 128]), In::F32(v, vec![4, 512, 128])];
    Ok(Case { kernel, inputs, want: vec![want], tol: 1e-4 })
}

fn for_loop() -> Result<Case> {
    // s <- s / 2 + x[32j..32j+32]^T x[32j..32j+32] for j in 0..2, from s = 0.
    let x = rand_vec(64 * 128, 16, -1.0, 1.0);
    let kernel = whole_kernel(
        "for_loop",
        &[t(DType::F32, &[64, 128])],
        &[t(DType::F32, &[128, 128])],
        |b, ins, outs| {
            let s0 = b.splat(0.0, DType::F32, &[128, 128])?;
            let out = b.for_range(0, 2, &[s0], |b, j, s| {
                let step = b.index(32)?;
                let row = b.index_op(Binary::Mul, j, &step)?;
                let xs = b.load(ins[0], &[Offset::Dyn(row, 32), Offset::Const(0)], &[32, 128])?;
                let p = b.matmul(&xs, &xs, (0, 0), MatPrecision::Highest)?;
                let half = b.splat(0.5, DType::F32, &[128, 128])?;
                let s = b.mul(&s[0], &half)?;
                Ok(vec![b.add(&s, &p)?])
            })?;
            b.store_all(outs[0], &out[0])
        },
    )?;
    let mut s = vec![0f32; 128 * 128];
    for j in 0..2 {
        let xs = &x[j * 32 * 128..(j + 1) * 32 * 128];
        let p = matmul(&transpose(xs, 32, 128), xs, 128, 32, 128);
        s = s.iter().zip(&p).map(|(a, b)| a * 0.5 + b).collect();
    }
    Ok(Case { kernel, inputs: vec![In::F32(x, vec![64, 128])], want: vec![s], tol: 1e-5 })
}

fn unit_lower_inverse() -> Result<Case> {
    // L strictly lower with entries like beta k_i . k_j of unit keys: A = (I + L)^-1.
    let raw = rand_vec(64 * 64, 17, -0.3, 0.3);
    let l: Vec<f32> = raw.iter().enumerate().map(|(i, &v)| if i / 64 > i % 64 { v } else { 0.0 }).collect();
    let mut kb = one_step("unit_lower_inverse");
    let ls = kb.input(Operand::whole("l", t(DType::F32, &[64, 64])));
    let out = kb.output(Operand::whole("a", t(DType::F32, &[64, 64])));
    let kernel = kb.build(|b| {
        let l = b.load_all(ls)?;
        let a = kda_tpu::op::tpu_kernels::terms::unit_lower_inverse(b, &l, MatPrecision::Highest)?;
        b.store_all(out, &a)
    })?;
    // Forward substitution in f64: (I + L) A = I, row by row.
    let mut a = vec![0f64; 64 * 64];
    for c in 0..64 {
        for r in 0..64 {
            let mut v = if r == c { 1.0 } else { 0.0 };
            for k in 0..r {
                v -= f64::from(l[r * 64 + k]) * a[k * 64 + c];
            }
            a[r * 64 + c] = v;
        }
    }
    let want = a.iter().map(|&v| v as f32).collect();
    Ok(Case { kernel, inputs: vec![In::F32(l, vec![64, 64])], want: vec![want], tol: 1e-5 })
}

/// The chunk terms on `levels`. One chunk, K = 128: q, k of unit rows, g in [-5, 0]; for
/// 4-token level-0 blocks with hard resets at the floor: two alone, and three in a row inside
/// the block 48..52, where the level-0 factors reach their range (e^(+-60) beside the anchor,
/// token 49); for the larger blocks of a lower bound (16 tokens for -5, 8 for -10), g just
/// above -5 on the whole block 48..64, where the 16-token factors reach their range (e^(+-70)).
fn chunk_terms(levels: Levels) -> Result<Case> {
    let kd = 128usize;
    let (q, k) =
        (unit_rows(rand_vec(64 * kd, 18, -1.0, 1.0), kd), unit_rows(rand_vec(64 * kd, 19, -1.0, 1.0), kd));
    let mut g = rand_vec(64 * kd, 20, -5.0, 0.0);
    for c in 0..kd {
        if levels == Levels::FINE {
            g[21 * kd + c] = -30.0;
            g[40 * kd + c] = -30.0;
            for r in 49..52 {
                g[r * kd + c] = -30.0;
            }
        } else {
            for r in 48..64 {
                g[r * kd + c] = -4.99;
            }
        }
    }
    let beta = rand_vec(64, 21, 0.0, 1.0);
    let scale = 1.0 / (kd as f64).sqrt();
    let ty = |d: &[i64]| t(DType::F32, d);
    let mut kb = one_step("chunk_terms");
    let ins = [("q", 128), ("k", 128), ("g", 128), ("beta", 1)]
        .map(|(n, w)| kb.input(Operand::whole(n, ty(&[64, w]))));
    let outs = [
        ("aqk", [64, 64]),
        ("l", [64, 64]),
        ("qg", [64, 128]),
        ("kg", [64, 128]),
        ("kbg", [64, 128]),
        ("eg_last", [1, 128]),
    ]
    .map(|(n, d)| kb.output(Operand::whole(n, ty(&d))));
    let sums = kb.scratch("sums", ty(&[64, 128]));
    let kernel = kb.build(|b| {
        let x: Vec<_> = ins.iter().map(|i| b.load_all(*i)).collect::<Result<_>>()?;
        let c = kda_tpu::op::tpu_kernels::terms::chunk_terms(
            b,
            &x[0],
            &x[1],
            &x[2],
            &x[3],
            scale,
            TermScratch { masks: TermMasks::Build, sums, levels },
            MatPrecision::Highest,
            2,
        )?;
        for (out, v) in outs.iter().zip([c.aqk, c.l, c.f.qg, c.f.kg, c.f.kbg, c.f.eg_last]) {
            b.store_all(*out, &v)?;
        }
        Ok(())
    })?;
    // The definitions, in f64: G inclusive prefix sums of g.
    let mut gc = vec![0f64; 64 * kd];
    for c in 0..kd {
        let mut acc = 0.0;
        for r in 0..64 {
            acc += f64::from(g[r * kd + c]);
            gc[r * kd + c] = acc;
        }
    }
    let (mut aqk, mut l) = (vec![0f32; 64 * 64], vec![0f32; 64 * 64]);
    for r in 0..64 {
        for j in 0..=r {
            let (mut a, mut b) = (0f64, 0f64);
            for c in 0..kd {
                let f = (gc[r * kd + c] - gc[j * kd + c]).exp();
                a += f64::from(q[r * kd + c]) * f64::from(k[j * kd + c]) * f;
                b += f64::from(k[r * kd + c]) * f64::from(k[j * kd + c]) * f;
            }
            aqk[r * 64 + j] = (a * scale) as f32;
            if j < r {
                l[r * 64 + j] = (b * f64::from(beta[r])) as f32;
            }
        }
    }
    let last = |c: usize| gc[63 * kd + c];
    let qg = (0..64 * kd).map(|i| (f64::from(q[i]) * gc[i].exp()) as f32).collect();
    let kg = (0..64 * kd).map(|i| (f64::from(k[i]) * (last(i % kd) - gc[i]).exp()) as f32).collect();
    let kbg =
        (0..64 * kd).map(|i| (f64::from(beta[i / kd]) * f64::from(k[i]) * gc[i].exp()) as f32).collect();
    let eg_last = (0..kd).map(|c| last(c).exp() as f32).collect();
    let inputs = vec![
        In::F32(q, vec![64, 128]),
        In::F32(k, vec![64, 128]),
        In::F32(g, vec![64, 128]),
        In::F32(beta, vec![64, 1]),
    ];
    Ok(Case { kernel, inputs, want: vec![aqk, l, qg, kg, kbg, eg_last], tol: 1e-5 })
}

/// Widths Triton pads: bf16 `x [64, 96] x y [96, 160]` (K = 96 contracted, V = 160 kept) plus
/// a one-token f32 row `t [1, 160]`, and the row sums over the 160 lanes.
fn padded_widths() -> Result<Case> {
    let round = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let wide = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    let (x, y) = (round(rand_vec(64 * 96, 22, -1.0, 1.0)), round(rand_vec(96 * 160, 23, -1.0, 1.0)));
    let tail = rand_vec(160, 24, -1.0, 1.0);
    let kernel = whole_kernel(
        "padded_widths",
        &[t(DType::BF16, &[64, 96]), t(DType::BF16, &[96, 160]), t(DType::F32, &[1, 160])],
        &[t(DType::F32, &[64, 160]), t(DType::F32, &[64, 1])],
        |b, ins, outs| {
            let (a, c, r) = (b.load_all(ins[0])?, b.load_all(ins[1])?, b.load_all(ins[2])?);
            let p = b.matmul(&a, &c, (1, 0), MatPrecision::Default)?;
            let r = b.broadcast(&r, &[64, 160])?;
            let o = b.add(&p, &r)?;
            b.store_all(outs[0], &o)?;
            let s = b.reduce(Reduction::Sum, &o, 1)?;
            b.store_all(outs[1], &s)
        },
    )?;
    let p = matmul(&wide(&x), &wide(&y), 64, 96, 160);
    let o: Vec<f32> = p.iter().enumerate().map(|(i, v)| v + tail[i % 160]).collect();
    let sums = o.chunks(160).map(|r| r.iter().map(|&v| f64::from(v)).sum::<f64>() as f32).collect();
    let inputs = vec![In::Bf16(x, vec![64, 96]), In::Bf16(y, vec![96, 160]), In::F32(tail, vec![1, 160])];
    Ok(Case { kernel, inputs, want: vec![o, sums], tol: 1e-4 })
}

/// Masked loads and stores: step `i` reads 64 rows of `x` `[200, 128]` from row `start[i]`
/// with the rows from `count[i]` on left unread (the first window runs past the array's end),
/// writes `2 x + 1` for its counted rows into `o` (the later steps' windows reach into rows the
/// earlier steps wrote, which must keep their values) and its whole window into `w`.
fn masked_rows() -> Result<Case> {
    let (starts, counts) = ([150, 100, 40, 0], [50, 50, 60, 40]);
    let x = rand_vec(200 * 128, 21, -1.0, 1.0);
    let mut kb = KernelBuilder::new("masked_rows");
    kb.grid(4, Semantics::Arbitrary);
    let (start, count) = (kb.table("start", 4), kb.table("count", 4));
    let xs = kb.input(Operand::whole("x", t(DType::F32, &[200, 128])));
    let o = kb.output(Operand::whole("o", t(DType::F32, &[200, 128])));
    let w = kb.output(Operand::blocked(
        "w",
        t(DType::F32, &[256, 128]),
        &[64, 128],
        vec![Index::Grid(0), Index::Const(0)],
    ));
    let kernel = kb.build(|b| {
        let i = b.program_id(0)?;
        let (at, n) = (b.read_table(start, &i)?, b.read_table(count, &i)?);
        let rows = [Offset::Dyn(at, 1), Offset::Const(0)];
        let x = b.load_rows(xs, &rows, &[64, 128], &n)?;
        b.store_all(w, &x)?;
        let two = b.splat(2.0, DType::F32, &[64, 128])?;
        let one = b.splat(1.0, DType::F32, &[64, 128])?;
        let y = b.mul(&x, &two)?;
        let y = b.add(&y, &one)?;
        b.store_rows(o, &rows, &y, &n)
    })?;
    let o_want = x.iter().map(|v| 2.0 * v + 1.0).collect();
    let mut w_want = vec![0f32; 256 * 128];
    for (i, (&s0, &n)) in starts.iter().zip(&counts).enumerate() {
        for r in 0..n {
            let (from, to) = ((s0 + r) * 128, (i * 64 + r) * 128);
            w_want[to..to + 128].copy_from_slice(&x[from..from + 128]);
        }
    }
    let tables = |v: [usize; 4]| In::I32(v.iter().map(|&x| x as i32).collect(), vec![4]);
    let inputs = vec![tables(starts), tables(counts), In::F32(x, vec![200, 128])];
    Ok(Case { kernel, inputs, want: vec![o_want, w_want], tol: 0.0 })
}

fn case(name: &str) -> Case {
    let built = match name {
        "matmul_f32" => matmul_f32(),
        "matmul_kt_v" => matmul_kt_v(),
        "matmul_bf16" => matmul_bf16(),
        "elementwise" => elementwise(),
        "causal_mask" => causal_mask(),
        "reduce_broadcast" => reduce_broadcast(),
        "cast_transpose" => cast_transpose(),
        "blocked_grid" => blocked_grid(),
        "scalar_prefetch" => scalar_prefetch(),
        "scratch_state" => scratch_state(),
        "slice_concat" => slice_concat(),
        "unaligned_window" => unaligned_window(),
        "for_loop" => for_loop(),
        "unit_lower_inverse" => unit_lower_inverse(),
        "chunk_terms" => chunk_terms(Levels::FINE),
        "chunk_terms_bounded" => chunk_terms(Levels::for_gate(GateKind::LowerBound(-5.0))),
        "chunk_terms_bounded_8" => chunk_terms(Levels::for_gate(GateKind::LowerBound(-10.0))),
        "padded_widths" => padded_widths(),
        "masked_rows" => masked_rows(),
        other => panic!("no case {other}"),
    };
    built.unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Case `name`'s kernel lowered as `lowering` runs on the default plugin and matches the host
/// at the case's tolerance.
fn runs_and_matches(name: &str, c: &Case, lowering: Lowering) -> Result<()> {
    let text = c.kernel.module(&lowering)?;
    let outs = run!(&text, c.inputs.clone());
    assert_eq!(outs.len(), c.want.len());
    for (i, (got, want)) in outs.iter().zip(&c.want).enumerate() {
        assert_close(&format!("{name} result {i} ({lowering:?})"), &got.f32s(), want, c.tol);
    }
    Ok(())
}

/// Each kernel: its interpret lowering matches the host on the CPU plugin, and its Mosaic
/// lowering compiles for tpu7x (one test per kernel, in the libtpu group).
#[rstest]
#[case::matmul_f32("matmul_f32")]
#[case::matmul_kt_v("matmul_kt_v")]
#[case::matmul_bf16("matmul_bf16")]
#[case::elementwise("elementwise")]
#[case::causal_mask("causal_mask")]
#[case::reduce_broadcast("reduce_broadcast")]
#[case::cast_transpose("cast_transpose")]
#[case::blocked_grid("blocked_grid")]
#[case::scalar_prefetch("scalar_prefetch")]
#[case::scratch_state("scratch_state")]
#[case::slice_concat("slice_concat")]
#[case::unaligned_window("unaligned_window")]
#[case::for_loop("for_loop")]
#[case::unit_lower_inverse("unit_lower_inverse")]
#[case::chunk_terms("chunk_terms")]
#[case::chunk_terms_bounded("chunk_terms_bounded")]
#[case::chunk_terms_bounded_8("chunk_terms_bounded_8")]
#[case::padded_widths("padded_widths")]
fn mosaic_kernel_interprets_and_compiles(#[case] name: &str) -> Result<()> {
    let c = case(name);
    runs_and_matches(name, &c, Lowering::Interpret)?;

    let text = c.kernel.module(&Lowering::Mosaic)?;
    let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
    let report = tpu.compile(&text, DEFAULT_TOPOLOGY).map_err(|e| Mosaic.explain(&c.kernel, e))?;
    let m = &report.memory;
    eprintln!(
        "{name} on {DEFAULT_TOPOLOGY}: peak {} B, arguments {} B, outputs {} B, kernel VMEM {:?} B",
        m.peak_bytes, m.argument_bytes, m.output_bytes, report.kernel_vmem_bytes
    );
    assert_eq!(report.kernel_vmem_bytes.len(), 1, "{name}: one kernel's VMEM figure");
    let results: i64 =
        c.kernel.result_types().iter().map(|t| t.num_elements() * i64::from(t.elem.bit_width() / 8)).sum();
    assert!(
        m.output_bytes >= results,
        "{name}: the results' {results} B are in the outputs ({} B)",
        m.output_bytes
    );
    Ok(())
}

/// Masked loads and stores run through the interpret lowering (rows past the count read zero,
/// the memory past it kept) and the Mosaic lowering refuses the masked store, naming it.
#[test]
fn masked_rows_interpret_and_mosaic_refuses_them() -> Result<()> {
    let c = case("masked_rows");
    runs_and_matches("masked_rows", &c, Lowering::Interpret)?;
    let e = c.kernel.module(&Lowering::Mosaic).expect_err("Mosaic has no masked rows");
    assert!(matches!(e, kda_tpu::TpuError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("masked store"), "{e}");
    Ok(())
}

#[test]
fn kernels_refuse_blocks_off_the_tiling() {
    let mut kb = KernelBuilder::new("misaligned");
    kb.grid(2, Semantics::Parallel);
    kb.input(Operand::blocked(
        "x",
        t(DType::F32, &[512, 192]),
        &[64, 96],
        vec![Index::Grid(0), Index::Const(0)],
    ));
    let o = kb.output(Operand::whole("o", t(DType::F32, &[64, 96])));
    let kernel = kb
        .build(|b| {
            let z = b.splat(0.0, DType::F32, &[64, 96])?;
            b.store_all(o, &z)
        })
        .expect("a kernel for the other lowerings");
    let err = kernel.module(&Lowering::Mosaic).expect_err("a 96-lane block of a 192-wide array");
    assert!(err.to_string().contains("multiple of 128 or the full 192"), "{err}");
    assert!(Triton.check(&kernel).is_ok() && kernel.module(&Lowering::Interpret).is_ok());
    // libtpu refuses i1 buffers ("Unsupported bitwidth: 1"): the builder refuses them first.
    let mut kb = one_step("mask_scratch");
    kb.output(Operand::whole("o", t(DType::F32, &[8, 128])));
    kb.scratch("m", t(DType::I1, &[8, 128]));
    let err = kb.build(|_| Ok(())).expect_err("an i1 scratch buffer");
    assert!(err.to_string().contains("scratch m"), "{err}");
}

#[test]
fn the_cost_estimate_reaches_the_compiler() -> Result<()> {
    let cost = Cost { flops: 2.0 * 128f64.powi(3), transcendentals: 128.0 * 128.0, bytes: 3.0 * 65536.0 };
    let with = |cost: Option<Cost>| -> Result<f64> {
        let mut k = one_step("costed");
        let xs = k.input(Operand::whole("x", t(DType::F32, &[128, 128])));
        let o = k.output(Operand::whole("o", t(DType::F32, &[128, 128])));
        if let Some(c) = cost {
            k.cost(c);
        }
        let k = k.build(|b| {
            let x = b.load_all(xs)?;
            let p = b.matmul(&x, &x, (1, 0), MatPrecision::Highest)?;
            let e = b.exp(&p)?;
            b.store_all(o, &e)
        })?;
        let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
        Ok(tpu.compile(&k.module(&Lowering::Mosaic)?, DEFAULT_TOPOLOGY)?.cost.flops)
    };
    assert_eq!(with(Some(cost))?, cost.flops);
    let guessed = with(None)?;
    assert_ne!(guessed, cost.flops, "without the estimate XLA counts the kernel otherwise ({guessed})");
    Ok(())
}

/// A kernel's scoped VMEM limit reaches libtpu: two double-buffered 5 MiB blocks (21 MB) are
/// refused on v5e (16 MiB by default) and compile with a 32 MiB limit.
#[test]
fn a_vmem_limit_reaches_the_compiler() -> Result<()> {
    let with = |limit: Option<i64>| -> Result<Vec<u64>> {
        let mut k = KernelBuilder::new("wide_blocks");
        k.grid(2, Semantics::Parallel);
        let ty = t(DType::F32, &[2 * 1024, 1280]);
        let block = |name: &str| {
            Operand::blocked(name, ty.clone(), &[1024, 1280], vec![Index::Grid(0), Index::Const(0)])
        };
        let xs = k.input(block("x"));
        let o = k.output(block("o"));
        if let Some(bytes) = limit {
            k.params(MosaicParams::default().with_vmem_limit(bytes)?);
        }
        let k = k.build(|b| {
            let x = b.load_all(xs)?;
            let y = b.exp(&x)?;
            b.store_all(o, &y)
        })?;
        let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
        Ok(tpu.compile(&k.module(&Lowering::Mosaic)?, "v5e:2x2")?.kernel_vmem_bytes)
    };
    let err = with(None).expect_err("over v5e's default scoped VMEM");
    assert!(err.to_string().contains("ScopedVmemOom"), "{err}");
    assert_eq!(with(Some(32 << 20))?, vec![4 * 1024 * 1280 * 4]);
    Ok(())
}

/// Each kernel's Triton lowering compiles deviceless for the H200 through the CUDA plugin (one
/// kernel launch of its parallel grid, registers and spills read by `ptxas`), or is refused
/// before any text is written, naming the feature Triton has no form for.
#[rstest]
#[case::matmul_kt_v("matmul_kt_v", None)]
#[case::matmul_bf16("matmul_bf16", None)]
#[case::elementwise("elementwise", None)]
#[case::causal_mask("causal_mask", None)]
#[case::reduce_broadcast("reduce_broadcast", None)]
#[case::cast_transpose("cast_transpose", None)]
#[case::blocked_grid("blocked_grid", None)]
#[case::scalar_prefetch("scalar_prefetch", None)]
#[case::scratch_state("scratch_state", None)]
#[case::slice_concat("slice_concat", None)]
#[case::unaligned_window("unaligned_window", Some(Feature::ScratchWindow))]
#[case::for_loop("for_loop", None)]
#[case::chunk_terms("chunk_terms", Some(Feature::ScratchWindow))]
#[case::padded_widths("padded_widths", None)]
#[case::masked_rows("masked_rows", None)]
fn kernel_compiles_for_the_h200_or_is_refused(
    #[case] name: &str,
    #[case] refused: Option<Feature>,
) -> Result<()> {
    compiles_for_the_h200_or_is_refused(name, refused)
}

mod full {
    use super::*;

    /// The op tests' kernels of half a minute's compile each (f32 products on the FMA units,
    /// `128 x 128 x 128` and ten `64 x 64 x 64` in a chain) compile for the H200.
    #[rstest]
    #[case::matmul_f32("matmul_f32")]
    #[case::unit_lower_inverse("unit_lower_inverse")]
    fn kernel_compiles_for_the_h200(#[case] name: &str) -> Result<()> {
        compiles_for_the_h200_or_is_refused(name, None)
    }
}

fn compiles_for_the_h200_or_is_refused(name: &str, refused: Option<Feature>) -> Result<()> {
    let c = case(name);
    let lowered = c.kernel.module(&Lowering::Triton);
    if let Some(feature) = refused {
        let e = lowered.expect_err("refused");
        assert!(matches!(e, kda_tpu::TpuError::Unsupported { .. }), "{name}: {e}");
        assert!(e.to_string().contains(feature.describe()), "{name}: {e}");
        return Ok(());
    }
    let text = lowered?;
    let gpu = GpuCompiler::load()
        .unwrap_or_else(|e| panic!("no CUDA plugin ({e}); run `cargo xtask setup`"))
        .with_figures(std::env::temp_dir().join("kda-triton-dumps"));
    let report = gpu.compile(&text, &H200).map_err(|e| Triton.explain(&c.kernel, e))?;
    eprintln!("{name} on {}: {:?}", H200.name, report.kernels);
    let [k] = report.kernels.as_slice() else { panic!("{name}: one launch, not {:?}", report.kernels) };
    assert_eq!(k.name, name);
    let parallel = kda_tpu::lang::lower::triton::launch_grid(&c.kernel);
    assert_eq!(k.grid.map(|g| g as i64), parallel, "{name}: the parallel axes are the launch grid");
    assert_eq!(k.threads, [128, 1, 1], "{name}: four warps");
    assert!(k.registers.is_some_and(|r| r <= 255), "{name}: ptxas read the kernel: {k:?}");
    Ok(())
}

/// An f32 product at full precision in three TF32 passes (`F32Dot::Tf32x3`) compiles for the
/// H200 (whether it meets the f32 tolerances is the GPU tier's question).
#[test]
fn f32_products_compile_in_three_tf32_passes() -> Result<()> {
    let launch = TritonParams::default().with_f32_dot(F32Dot::Tf32x3);
    let kernel = case("matmul_kt_v").kernel.with_params(launch);
    let text = kernel.module(&Lowering::Triton)?;
    assert!(text.contains("inputPrecision = tf32x3"), "the product's precision");
    let gpu = GpuCompiler::load().unwrap_or_else(|e| panic!("no CUDA plugin ({e}); run `cargo xtask setup`"));
    gpu.compile(&text, &H200).map_err(|e| Triton.explain(&kernel, e))?;
    Ok(())
}

/// On a GPU host only (`cargo xtask gpu-check` stages this binary and runs this tier with the
/// CUDA plugin as `KDA_PJRT_PLUGIN`; the default and `--full` runs leave it out).
mod gpu {
    use super::*;

    /// The op tests whose kernels Triton takes.
    const RUNNABLE: [&str; 14] = [
        "matmul_f32",
        "matmul_kt_v",
        "matmul_bf16",
        "elementwise",
        "causal_mask",
        "reduce_broadcast",
        "cast_transpose",
        "blocked_grid",
        "scalar_prefetch",
        "scratch_state",
        "slice_concat",
        "for_loop",
        "unit_lower_inverse",
        "padded_widths",
    ];

    /// Each kernel's Triton lowering runs on the GPU and matches the host computation at the
    /// tolerance its interpret lowering meets on the CPU (every kernel tried; the failures
    /// named at the end).
    #[test]
    fn kernels_run_through_triton() -> Result<()> {
        on_a_gpu()?;
        let failed: Vec<String> = RUNNABLE
            .iter()
            .filter_map(|name| match std::panic::catch_unwind(|| kernel_runs_through_triton(name)) {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("{name}: {e}")),
                Err(p) => {
                    let text = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                    Some(format!("{name}: {}", text.unwrap_or_default()))
                }
            })
            .collect();
        assert!(failed.is_empty(), "{} of {} failed:\n{}", failed.len(), RUNNABLE.len(), failed.join("\n"));
        Ok(())
    }

    /// Refuses to run anywhere but on the CUDA plugin.
    fn on_a_gpu() -> Result<()> {
        let platform = kda_tpu::Runtime::new()?.platform().to_lowercase();
        assert!(
            platform.contains("cuda"),
            "the gpu:: tier runs on a GPU (`cargo xtask gpu-check`), not on {platform}"
        );
        Ok(())
    }

    fn kernel_runs_through_triton(name: &str) -> Result<()> {
        runs_and_matches(name, &case(name), Lowering::Triton)
    }

    /// The f32 kernels with their full-precision products in three TF32 passes: within the
    /// tolerance the IEEE products meet, or not (what decides `GpuLaunch`'s default).
    #[rstest]
    #[case::matmul_f32("matmul_f32")]
    #[case::matmul_kt_v("matmul_kt_v")]
    #[case::scratch_state("scratch_state")]
    #[case::for_loop("for_loop")]
    #[case::unit_lower_inverse("unit_lower_inverse")]
    fn f32_products_in_three_tf32_passes(#[case] name: &str) -> Result<()> {
        on_a_gpu()?;
        let c = case(name);
        let kernel = c.kernel.with_params(TritonParams::default().with_f32_dot(F32Dot::Tf32x3));
        let outs = run!(&kernel.module(&Lowering::Triton)?, c.inputs);
        for (i, (got, want)) in outs.iter().zip(&c.want).enumerate() {
            let got = got.f32s();
            let worst =
                got.iter().zip(want).map(|(g, w)| (g - w).abs() / w.abs().max(1.0)).fold(0f32, f32::max);
            eprintln!("{name} result {i} in tf32x3: worst error {worst:e} (tolerance {:e})", c.tol);
            assert_close(&format!("{name} result {i} in tf32x3"), &got, want, c.tol);
        }
        Ok(())
    }
}

/// `x` rounded to nearest even to `mantissa` bits (f32 keeps 23): TF32's 10, bf16's 7.
fn rounded(x: f32, mantissa: u32) -> f32 {
    let drop = 23 - mantissa;
    let bits = x.to_bits();
    let half = 1u32 << (drop - 1);
    let odd = (bits >> drop) & 1;
    f32::from_bits((bits + half - 1 + odd) & !((1u32 << drop) - 1))
}

/// `[m, k] x [k, n]` of `x` and `y` rounded as a product at `precision` rounds them on a GPU,
/// in f64 (the CPU's f32 sums differ from it by their own rounding only).
fn gpu_product(x: &[f32], y: &[f32], (m, k, n): (usize, usize, usize), precision: MatPrecision) -> Vec<f64> {
    let once = |v: &[f32], bits: u32| v.iter().map(|&a| rounded(a, bits)).collect::<Vec<_>>();
    let product = |a: &[f32], b: &[f32]| -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|c| f64::from(a[i * k + c]) * f64::from(b[c * n + j])).sum();
            }
        }
        out
    };
    let split = |bits: u32| {
        let (xh, yh) = (once(x, bits), once(y, bits));
        let rest =
            |v: &[f32], h: &[f32]| v.iter().zip(h).map(|(a, b)| rounded(a - b, bits)).collect::<Vec<_>>();
        let (xl, yl) = (rest(x, &xh), rest(y, &yh));
        let parts = [product(&xh, &yl), product(&xl, &yh), product(&xh, &yh)];
        (0..m * n).map(|i| parts.iter().map(|p| p[i]).sum()).collect()
    };
    match precision {
        MatPrecision::Default => product(&once(x, 7), &once(y, 7)),
        MatPrecision::Tf32 => product(&once(x, 10), &once(y, 10)),
        MatPrecision::Tf32x3 => split(10),
        MatPrecision::Bf16x3 => split(7),
        _ => product(x, y),
    }
}

/// Each product precision through the interpret lowering with a GPU's numerics rounds as a GPU
/// does (against the same rounding on the host, and apart from full f32 where it should be),
/// and with a TPU's numerics every precision but the bf16 pass is full f32.
#[rstest]
#[case::bf16_pass(MatPrecision::Default, 1e-2)]
#[case::tf32(MatPrecision::Tf32, 1e-4)]
#[case::tf32x3(MatPrecision::Tf32x3, 0.0)]
#[case::bf16x3(MatPrecision::Bf16x3, 1e-5)]
#[case::ieee(MatPrecision::Ieee, 0.0)]
fn products_round_as_their_precision_says(#[case] precision: MatPrecision, #[case] apart: f64) -> Result<()> {
    let (m, k, n) = (64, 128, 64);
    let (x, y) = (rand_vec(m * k, 11, -1.0, 1.0), rand_vec(k * n, 12, -1.0, 1.0));
    let kernel = matmul_kernel(
        "precisions",
        DType::F32,
        [[m as i64, k as i64], [k as i64, n as i64]],
        (1, 0),
        precision,
    )?;
    let inputs =
        || vec![In::F32(x.clone(), vec![m as i64, k as i64]), In::F32(y.clone(), vec![k as i64, n as i64])];
    let exact = gpu_product(&x, &y, (m, k, n), MatPrecision::Ieee);
    let want = gpu_product(&x, &y, (m, k, n), precision);
    let worst = |got: &[f32], want: &[f64]| {
        got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).abs()).fold(0.0, f64::max)
    };
    let gpu = run!(&kernel.module(&Interpret::TRITON_NUMERICS)?, inputs());
    let tpu = run!(&kernel.module(&Interpret::MOSAIC_NUMERICS)?, inputs());
    let (gpu, tpu) = (gpu[0].f32s(), tpu[0].f32s());
    // f32 sums of 128 products: a few units in the last place of the largest partial sums.
    assert!(worst(&gpu, &want) < 1e-5, "{precision:?}: {} from the host's rounding", worst(&gpu, &want));
    let shows = want.iter().zip(&exact).map(|(w, e)| (w - e).abs()).fold(0.0, f64::max);
    assert!(shows >= apart, "{precision:?}: the rounding shows ({shows})");
    let tpu_want = if precision == MatPrecision::Default { &want } else { &exact };
    assert!(worst(&tpu, tpu_want) < 1e-5, "{precision:?} on a TPU: {}", worst(&tpu, tpu_want));
    Ok(())
}

/// Each precision's Triton form (`inputPrecision`) compiles for the H200, and its Mosaic form is
/// the one bf16 pass or full precision.
#[rstest]
#[case::tf32(MatPrecision::Tf32, ", inputPrecision = tf32 ")]
#[case::tf32x3(MatPrecision::Tf32x3, ", inputPrecision = tf32x3 ")]
#[case::bf16x3(MatPrecision::Bf16x3, ", inputPrecision = bf16x3 ")]
#[case::ieee(MatPrecision::Ieee, ", inputPrecision = ieee ")]
fn each_product_precision_has_its_gpu_form(
    #[case] precision: MatPrecision,
    #[case] form: &str,
) -> Result<()> {
    let kernel = matmul_kernel("precision_forms", DType::F32, [[64, 64], [64, 64]], (1, 0), precision)?;
    let ttir = Triton.text(&kernel)?;
    assert!(ttir.contains(form), "{precision:?}: {ttir}");
    assert!(Mosaic.text(&kernel)?.contains("contract_precision<fp32>"), "{precision:?} on a TPU");
    let gpu = GpuCompiler::load().unwrap_or_else(|e| panic!("no CUDA plugin ({e}); run `cargo xtask setup`"));
    gpu.compile(&kernel.module(&Triton)?, &H200).map_err(|e| Triton.explain(&kernel, e))?;
    Ok(())
}

/// Three TF32 passes keep about 21 of f32's 24 bits, which random inputs' f32 sums hide: with
/// `x = 1 + 2^-12 + 2^-23` and `y = 1 + 2^-12` (each split exactly) every product is
/// `1 + 2^-11` under a GPU's numerics, so a row of 128 sums to `128 + 2^-4` exactly, where full
/// f32 keeps the last bits.
#[test]
fn three_tf32_passes_drop_what_their_split_drops() -> Result<()> {
    let (m, k, n) = (8, 128, 128);
    let (xv, yv) = (1.0 + 2f32.powi(-12) + 2f32.powi(-23), 1.0 + 2f32.powi(-12));
    let kernel = matmul_kernel("tf32x3", DType::F32, [[m, k], [k, n]], (1, 0), MatPrecision::Tf32x3)?;
    let inputs = || {
        let (m, k, n) = (m as usize, k as usize, n as usize);
        vec![
            In::F32(vec![xv; m * k], vec![m as i64, k as i64]),
            In::F32(vec![yv; k * n], vec![k as i64, n as i64]),
        ]
    };
    let gpu = run!(&kernel.module(&Interpret::TRITON_NUMERICS)?, inputs())[0].f32s();
    let tpu = run!(&kernel.module(&Interpret::MOSAIC_NUMERICS)?, inputs())[0].f32s();
    assert!(gpu.iter().all(|&v| v == 128.0 + 2f32.powi(-4)), "{:?}", &gpu[..4]);
    assert!(tpu.iter().all(|&v| v > 128.0 + 2f32.powi(-4) && v < 128.0625 + 1e-4), "{:?}", &tpu[..4]);
    Ok(())
}

/// A cumsum kernel: `x` `[R, N]` summed along `axis` as `scan` says, restarting where `x`'s
/// companion input `marks` is positive when `segments`.
fn cumsum_kernel(name: &str, dims: [i64; 2], axis: usize, scan: Scan, segments: bool) -> Result<Kernel> {
    let ty = t(DType::F32, &dims);
    whole_kernel(name, &[ty.clone(), ty.clone()], &[ty], |b, ins, outs| {
        let (x, marks) = (b.load_all(ins[0])?, b.load_all(ins[1])?);
        let zero = b.splat(0.0, DType::F32, &dims)?;
        let starts = b.compare(Cmp::Gt, &marks, &zero)?;
        let s = b.cumsum(&x, axis, scan, segments.then_some(&starts))?;
        b.store_all(outs[0], &s)
    })
}

/// The host's running sums of `x` `[r, n]` along `axis`, restarting at each positive mark.
fn host_cumsum(
    x: &[f32],
    marks: &[f32],
    [r, n]: [usize; 2],
    axis: usize,
    scan: Scan,
    segments: bool,
) -> Vec<f32> {
    let at = |i: usize, j: usize| if axis == 1 { i * n + j } else { j * n + i };
    let (lines, len) = if axis == 1 { (r, n) } else { (n, r) };
    let mut out = vec![0.0f32; r * n];
    for l in 0..lines {
        let seg: Vec<usize> = (0..len)
            .scan(0, |s, j| {
                *s += usize::from(segments && marks[at(l, j)] > 0.0);
                Some(*s)
            })
            .collect();
        for i in 0..len {
            let inside = |j: usize| {
                let order = if scan.reverse { j >= i } else { j <= i };
                order && (j != i || !scan.exclusive) && seg[j] == seg[i]
            };
            out[at(l, i)] =
                (0..len).filter(|&j| inside(j)).map(|j| f64::from(x[at(l, j)])).sum::<f64>() as f32;
        }
    }
    out
}

/// Cumsums (forward and reverse, inclusive and exclusive, with and without segments, along
/// either axis of a width that is no power of two) through the interpret lowering meet the
/// host's; the Mosaic lowering refuses them by name, and the Triton lowering writes `tt.scan`.
#[rstest]
#[case::forward(1, false, false, false)]
#[case::reverse_exclusive(1, true, true, false)]
#[case::forward_exclusive_segments(1, false, true, true)]
#[case::reverse_segments(1, true, false, true)]
#[case::down_rows_segments(0, false, false, true)]
fn cumsums_are_direct_running_sums(
    #[case] axis: usize,
    #[case] reverse: bool,
    #[case] exclusive: bool,
    #[case] segments: bool,
) -> Result<()> {
    let (r, n) = (8, 96);
    let scan = Scan { reverse, exclusive };
    let kernel = cumsum_kernel("cumsum", [r as i64, n as i64], axis, scan, segments)?;
    let (x, marks) = (rand_vec(r * n, 21, -1.0, 1.0), rand_vec(r * n, 22, -4.0, 1.0));
    let dims = vec![r as i64, n as i64];
    let got = run!(
        &kernel.module(&Lowering::Interpret)?,
        vec![In::F32(x.clone(), dims.clone()), In::F32(marks.clone(), dims)]
    );
    assert_close("cumsum", &got[0].f32s(), &host_cumsum(&x, &marks, [r, n], axis, scan, segments), 1e-5);
    let e = kernel.module(&Lowering::Mosaic).expect_err("no Mosaic scan");
    assert!(e.to_string().contains("mosaic lowering of kernel cumsum: a cumsum"), "{e}");
    if !(reverse && segments) {
        assert!(Triton.text(&kernel)?.contains("\"tt.scan\""), "a Triton scan");
    }
    Ok(())
}

/// The Triton forms of a plain and a segmented exclusive cumsum compile for the H200.
#[rstest]
#[case::plain(false)]
#[case::segments(true)]
fn cumsums_compile_for_the_h200(#[case] segments: bool) -> Result<()> {
    let kernel = cumsum_kernel("cumsum", [64, 64], 1, Scan { reverse: false, exclusive: true }, segments)?;
    let gpu = GpuCompiler::load().unwrap_or_else(|e| panic!("no CUDA plugin ({e}); run `cargo xtask setup`"));
    gpu.compile(&kernel.module(&Triton)?, &H200).map_err(|e| Triton.explain(&kernel, e))?;
    Ok(())
}

/// A loop to a run-time bound (a table entry `n`: `0..min(16, n)`, counted in every element of
/// `trips`) and a load of the rows below `n` (the rest read as 0, summed in `rows`).
fn run_time_bounds() -> Result<Kernel> {
    let mut k = one_step("run_time_bounds");
    let n = k.table("n", 1);
    let x = k.input(Operand::whole("x", t(DType::F32, &[16, 128])));
    let trips = k.output(Operand::whole("trips", t(DType::F32, &[8, 128])));
    let rows = k.output(Operand::whole("rows", t(DType::F32, &[1, 128])));
    k.build(|b| {
        let at = b.index(0)?;
        let n = b.read_table(n, &at)?;
        let zero = b.splat(0.0, DType::F32, &[8, 128])?;
        let counted = b.for_range_until(0, 16, &n, &[zero], |b, _, acc| {
            let one = b.splat(1.0, DType::F32, &[8, 128])?;
            Ok(vec![b.add(&acc[0], &one)?])
        })?;
        b.store_all(trips, &counted[0])?;
        let y = b.load_rows(x, &[Offset::Const(0), Offset::Const(0)], &[16, 128], &n)?;
        let s = b.reduce(Reduction::Sum, &y, 0)?;
        b.store_all(rows, &s)
    })
}

/// The interpret lowering stops the loop at the table's bound (or at its static one) and reads
/// only the rows below it.
#[rstest]
#[case::below_the_static_bound(5)]
#[case::past_it(40)]
fn loops_and_loads_stop_at_run_time_bounds(#[case] n: i32) -> Result<()> {
    let kernel = run_time_bounds()?;
    let x = rand_vec(16 * 128, 31, -1.0, 1.0);
    let inputs = vec![In::I32(vec![n], vec![1]), In::F32(x.clone(), vec![16, 128])];
    let outs = run!(&kernel.module(&Lowering::Interpret)?, inputs);
    let kept = n.clamp(0, 16) as usize;
    assert!(outs[0].f32s().iter().all(|&v| v == kept as f32), "{n}: {:?}", &outs[0].f32s()[..4]);
    let want: Vec<f32> = (0..128).map(|c| (0..kept).map(|r| x[r * 128 + c]).sum()).collect();
    assert_close("rows", &outs[1].f32s(), &want, 1e-6);
    Ok(())
}

/// The run-time bounds compile through libtpu (a loop to `min(16, n)`) and for the H200.
#[test]
fn mosaic_kernel_with_run_time_bounds_compiles() -> Result<()> {
    let kernel = run_time_bounds()?;
    let tpu = TpuCompiler::load().unwrap_or_else(|e| panic!("no libtpu ({e}); run `cargo xtask setup`"));
    tpu.compile(&kernel.module(&Lowering::Mosaic)?, DEFAULT_TOPOLOGY)
        .map_err(|e| Mosaic.explain(&kernel, e))?;
    let gpu = GpuCompiler::load().unwrap_or_else(|e| panic!("no CUDA plugin ({e}); run `cargo xtask setup`"));
    gpu.compile(&kernel.module(&Triton)?, &H200).map_err(|e| Triton.explain(&kernel, e))?;
    Ok(())
}
