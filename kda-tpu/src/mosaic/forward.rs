//! The chunked KDA forward as one Mosaic kernel, for fixed-length rows (docs/kda.md, Chunks):
//! a grid over lanes (one lane per head and row, `parallel`) and chunks (`arbitrary`), the
//! state `S` `[K, V]` in VMEM scratch across the chunks of a lane. Per chunk:
//! [`super::blocks::chunk_terms`], `A = (I + L)^-1` ([`super::blocks::unit_lower_inverse`]),
//! `u = A (beta v)`, `w = A (beta k e^G)`, `v_new = u - w S`, `o = scale (q e^G) S + Aqk v_new`,
//! `S <- e^(G_C) S + (k e^(G_C - G))^T v_new`.
//!
//! Its operands are the lanes' tensors as `[L, T, D]` (`L = H * B` lanes, T a multiple of 64),
//! `g` already activated and floored, `beta` `[L, T, 1]`, `h0` `[L, K, V]` f32; its results `o`
//! `[L, T, V]` (q's dtype) and `ht` `[L, K, V]` f32. bf16 inputs are read as bf16 and widened in
//! the kernel; everything accumulates in f32.

use kda_core::DType;

use super::blocks::{chunk_terms, unit_lower_inverse};
use super::body::{Binary, MatPrecision, Ref};
use super::kernel::{Cost, Index, Kernel, KernelBuilder, Operand, Semantics};
use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType};

const C: i64 = 64;

/// The dims of one fixed-length forward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardDims {
    /// Lanes (`H * B`).
    pub lanes: i64,
    /// Tokens per lane, a multiple of 64.
    pub t: i64,
    /// Key width.
    pub k: i64,
    /// Value width.
    pub v: i64,
    /// The dtype of `q`, `k`, `v`, `beta` and `o` (f32 or bf16).
    pub dtype: DType,
}

/// The forward kernel of `d` with output scale `scale`.
pub fn forward_kernel(d: ForwardDims, scale: f64) -> Result<Kernel> {
    if d.t < C || d.t % C != 0 || !matches!(d.dtype, DType::F32 | DType::BF16) || d.lanes < 1 {
        return Err(TpuError::unsupported(
            "mosaic forward",
            format!("T a multiple of 64 and f32 or bf16 inputs (T = {}, {})", d.t, d.dtype),
        ));
    }
    let (l, t, k, v, x) = (d.lanes, d.t, d.k, d.v, d.dtype);
    let chunks = t / C;
    let tok = || vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let lane = || vec![Index::Grid(0), Index::Const(0), Index::Const(0)];
    let ty = |dt: DType, dims: &[i64]| TensorType::new(dt, dims);
    // docs/kda.md, Work: per token and head, 6CK + 4CV + 6KV + (2/3)C^2 flops; four exponentials
    // per gate element; every operand and result once through HBM.
    let (cf, kf, vf) = (C as f64, k as f64, v as f64);
    let flops = (l * t) as f64 * (6.0 * cf * kf + 4.0 * cf * vf + 6.0 * kf * vf + 2.0 / 3.0 * cf * cf);
    let bytes = (l * t) as f64 * ((3 * k + 2 * v + 1) as f64 * f64::from(x.bit_width() / 8) + 4.0 * k as f64)
        + (2 * l * k * v) as f64 * 4.0;
    KernelBuilder::new("kda_forward")
        .grid(l, Semantics::Parallel)
        .grid(chunks, Semantics::Arbitrary)
        .input(Operand::blocked("q", ty(x, &[l, t, k]), &[1, C, k], tok()))
        .input(Operand::blocked("k", ty(x, &[l, t, k]), &[1, C, k], tok()))
        .input(Operand::blocked("v", ty(x, &[l, t, v]), &[1, C, v], tok()))
        .input(Operand::blocked("g", ty(DType::F32, &[l, t, k]), &[1, C, k], tok()))
        .input(Operand::blocked("beta", ty(x, &[l, t, 1]), &[1, C, 1], tok()))
        .input(Operand::blocked("h0", ty(DType::F32, &[l, k, v]), &[1, k, v], lane()))
        .output(Operand::blocked("o", ty(x, &[l, t, v]), &[1, C, v], tok()))
        .output(Operand::blocked("ht", ty(DType::F32, &[l, k, v]), &[1, k, v], lane()))
        .scratch("state", ty(DType::F32, &[k, v]))
        .scratch("work", ty(DType::F32, &[C, k]))
        .scratch("tiles", ty(DType::F32, &[C, C]))
        .scratch("solve_work", ty(DType::F32, &[C, C]))
        .scratch("solve_out", ty(DType::F32, &[C, C]))
        .cost(Cost { flops, transcendentals: (l * t * k) as f64 * 4.0, bytes })
        .build(|b| {
            let c = b.program_id(1)?;
            let (first, last) = (b.index(0)?, b.index(chunks - 1)?);
            let at_first = b.compare(Cmp::Eq, &c, &first)?;
            b.when(&at_first, |b| {
                let h0 = b.load_all(Ref::Input(5))?;
                let h0 = b.reshape(&h0, &[k, v])?;
                b.store_all(Ref::Scratch(0), &h0)
            })?;
            let f32_2d = |b: &mut super::body::Body, i: usize, w: i64| {
                let x = b.load_all(Ref::Input(i))?;
                let x = if x.ty.elem == DType::F32 { x } else { b.cast(&x, DType::F32)? };
                b.reshape(&x, &[C, w])
            };
            let (q, kk, vv, g, beta) =
                (f32_2d(b, 0, k)?, f32_2d(b, 1, k)?, f32_2d(b, 2, v)?, f32_2d(b, 3, k)?, f32_2d(b, 4, 1)?);
            let terms = chunk_terms(b, &q, &kk, &g, &beta, scale, Ref::Scratch(1), Ref::Scratch(2))?;
            let a = unit_lower_inverse(b, &terms.l, Ref::Scratch(3), Ref::Scratch(4))?;
            let bv = b.broadcast(&beta, &[C, v])?;
            let bv = b.binary(Binary::Mul, &vv, &bv)?;
            let u = b.matmul(&a, &bv, (1, 0), MatPrecision::Highest)?;
            let w = b.matmul(&a, &terms.kbg, (1, 0), MatPrecision::Highest)?;
            let s = b.load_all(Ref::Scratch(0))?;
            let ws = b.matmul(&w, &s, (1, 0), MatPrecision::Highest)?;
            let v_new = b.binary(Binary::Sub, &u, &ws)?;
            let inter = b.matmul(&terms.qg, &s, (1, 0), MatPrecision::Highest)?;
            let sc = b.splat(scale, DType::F32, &[C, v])?;
            let inter = b.binary(Binary::Mul, &inter, &sc)?;
            let intra = b.matmul(&terms.aqk, &v_new, (1, 0), MatPrecision::Highest)?;
            let o = b.binary(Binary::Add, &inter, &intra)?;
            let o = if x == DType::F32 { o } else { b.cast(&o, x)? };
            let o = b.reshape(&o, &[1, C, v])?;
            b.store_all(Ref::Output(0), &o)?;
            let decay = b.reshape(&terms.eg_last, &[k, 1])?;
            let decay = b.broadcast(&decay, &[k, v])?;
            let kept = b.binary(Binary::Mul, &s, &decay)?;
            let add = b.matmul(&terms.kg, &v_new, (0, 0), MatPrecision::Highest)?;
            let s_next = b.binary(Binary::Add, &kept, &add)?;
            b.store_all(Ref::Scratch(0), &s_next)?;
            let at_last = b.compare(Cmp::Eq, &c, &last)?;
            b.when(&at_last, |b| {
                let ht = b.reshape(&s_next, &[1, k, v])?;
                b.store_all(Ref::Output(1), &ht)
            })
        })
}
