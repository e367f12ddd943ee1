//! The chunked KDA forward as one Mosaic kernel (docs/kda.md, Chunks): a grid over lanes (one
//! lane per head, and per row when rows have a fixed length; `parallel`) and chunk positions
//! (`arbitrary`), the state `S` `[K, V]` in VMEM scratch across the chunks of a lane. Per chunk:
//! [`super::blocks::chunk_terms`], `A = (I + L)^-1` ([`super::blocks::unit_lower_inverse`]),
//! `u = A (beta v)`, `w = A (beta k e^G)`, `v_new = u - w S`, `o = scale (q e^G) S + Aqk v_new`,
//! `S <- e^(G_C) S + (k e^(G_C - G))^T v_new`.
//!
//! Segments come as three scalar-prefetched chunk tables, as the XLA programs read them: at a
//! chunk with `first[c] = 1` the state starts from `h0` of slot `slot[c]` (or zero), at one with
//! `last[c] = 1` it is written to `ht` of that slot. Fixed-length rows are the tables
//! `first = [1, 0, ..]`, `last = [.., 0, 1]`, `slot = 0`; one kernel serves both.
//!
//! Its operands are the lanes' chunk-aligned tokens as `[L, NT * 64, D]`, `g` already
//! activated and floored (f32), `beta` `[L, NT * 64, 1]`, `h0` `[L, S, K, V]` f32 (`S` state
//! slots per lane); its results `o` `[L, NT * 64, V]` (in `v`'s dtype), `ht` `[L, S, K, V]`
//! f32, and optionally `h` `[L, NT, K, V]` f32, the state entering every chunk (what the
//! saved-state backward reads). bf16 blocks are widened in the kernel; everything accumulates
//! in f32.

use kda_core::DType;

use super::blocks::{chunk_terms, unit_lower_inverse};
use super::body::{Binary, MatPrecision, Ref};
use super::kernel::{Cost, Index, Kernel, KernelBuilder, Operand, Semantics};
use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType};

const C: i64 = 64;

/// The dims and options of one forward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardDims {
    /// Lanes: independent recurrences side by side.
    pub lanes: i64,
    /// Chunk positions per lane.
    pub chunks: i64,
    /// State slots per lane (`h0`, `ht`): 1 for fixed-length rows.
    pub slots: i64,
    /// Key width.
    pub k: i64,
    /// Value width.
    pub v: i64,
    /// The dtype of `q` and `k` (f32 or bf16; f32 after an L2 norm).
    pub qk: DType,
    /// The dtype of `v`, `beta` and `o` (f32 or bf16).
    pub dtype: DType,
    /// Whether `h0` is an input (else every segment starts from zero).
    pub h0: bool,
    /// Whether `ht` is a result.
    pub ht: bool,
    /// Whether `h`, the state entering every chunk, is a result.
    pub states: bool,
}

impl ForwardDims {
    /// Fixed-length lanes of `t` tokens (a multiple of 64), `q`, `k`, `v` and `beta` of one
    /// `dtype`, with `h0` and `ht`, no per-chunk states.
    pub fn fixed(lanes: i64, t: i64, k: i64, v: i64, dtype: DType) -> Self {
        ForwardDims {
            lanes,
            chunks: t / C,
            slots: 1,
            k,
            v,
            qk: dtype,
            dtype,
            h0: true,
            ht: true,
            states: false,
        }
    }
}

/// The largest key or value width of the kernel (docs/kda.md, Shapes).
pub const MAX_WIDTH: i64 = 256;

/// The chunk tables of fixed-length lanes of `chunks` chunks: `first`, `last`, `slot`.
pub fn fixed_tables(chunks: usize) -> [Vec<i32>; 3] {
    let mut first = vec![0; chunks];
    let mut last = vec![0; chunks];
    if chunks > 0 {
        first[0] = 1;
        last[chunks - 1] = 1;
    }
    [first, last, vec![0; chunks]]
}

/// The forward kernel of `d` with output scale `scale`. Its operands: the tables `first`,
/// `last`, `slot` (`[NT]` i32; `slot` must not decrease, padding chunks after the last segment
/// repeating its slot, since a result block revisited later would be written back stale), then
/// `q k v g beta [h0]`; its results `o [ht] [h]`.
pub fn forward_kernel(d: ForwardDims, scale: f64) -> Result<Kernel> {
    let float = |t: DType| matches!(t, DType::F32 | DType::BF16);
    if d.chunks < 1 || d.lanes < 1 || d.slots < 1 || !float(d.dtype) || !float(d.qk) {
        return Err(TpuError::unsupported(
            "mosaic forward",
            format!(
                "one lane, chunk and slot or more and f32 or bf16 inputs ({} lanes, {} chunks, {} slots, {} / {})",
                d.lanes, d.chunks, d.slots, d.qk, d.dtype
            ),
        ));
    }
    if !(1..=MAX_WIDTH).contains(&d.k) || !(1..=MAX_WIDTH).contains(&d.v) {
        return Err(TpuError::unsupported(
            "mosaic forward",
            format!("K and V of 1 to {MAX_WIDTH} (K = {}, V = {})", d.k, d.v),
        ));
    }
    let (l, nt, k, v, x) = (d.lanes, d.chunks, d.k, d.v, d.dtype);
    let t = nt * C;
    let tok = || vec![Index::Grid(0), Index::Grid(1), Index::Const(0)];
    let slot = || vec![Index::Grid(0), Index::table(2, Index::Grid(1)), Index::Const(0), Index::Const(0)];
    let ty = |dt: DType, dims: &[i64]| TensorType::new(dt, dims);
    // docs/kda.md, Work: per token and head, 6CK + 4CV + 6KV + (2/3)C^2 flops; four exponentials
    // per gate element; every operand and result once through HBM.
    let (cf, kf, vf) = (C as f64, k as f64, v as f64);
    let flops = (l * t) as f64 * (6.0 * cf * kf + 4.0 * cf * vf + 6.0 * kf * vf + 2.0 / 3.0 * cf * cf);
    let bytes_of = |t: DType| f64::from(t.bit_width() / 8);
    let states = (l * k * v) as f64
        * 4.0
        * (d.slots * (i64::from(d.h0) + i64::from(d.ht)) + nt * i64::from(d.states)) as f64;
    let bytes =
        (l * t) as f64 * (2.0 * kf * bytes_of(d.qk) + (2.0 * vf + 1.0) * bytes_of(x) + 4.0 * kf) + states;
    let mut kb = KernelBuilder::new("kda_forward")
        .grid(l, Semantics::Parallel)
        .grid(nt, Semantics::Arbitrary)
        .table("first", nt)
        .table("last", nt)
        .table("slot", nt)
        .input(Operand::blocked("q", ty(d.qk, &[l, t, k]), &[1, C, k], tok()))
        .input(Operand::blocked("k", ty(d.qk, &[l, t, k]), &[1, C, k], tok()))
        .input(Operand::blocked("v", ty(x, &[l, t, v]), &[1, C, v], tok()))
        .input(Operand::blocked("g", ty(DType::F32, &[l, t, k]), &[1, C, k], tok()))
        .input(Operand::blocked("beta", ty(x, &[l, t, 1]), &[1, C, 1], tok()));
    if d.h0 {
        kb = kb.input(Operand::blocked("h0", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()));
    }
    kb = kb.output(Operand::blocked("o", ty(x, &[l, t, v]), &[1, C, v], tok()));
    if d.ht {
        kb = kb.output(Operand::blocked("ht", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()));
    }
    if d.states {
        let at = vec![Index::Grid(0), Index::Grid(1), Index::Const(0), Index::Const(0)];
        kb = kb.output(Operand::blocked("h", ty(DType::F32, &[l, nt, k, v]), &[1, 1, k, v], at));
    }
    let out_ht = Ref::Output(1);
    let out_h = Ref::Output(1 + usize::from(d.ht));
    kb.scratch("state", ty(DType::F32, &[k, v]))
        .scratch("work", ty(DType::F32, &[C, k]))
        .scratch("tiles", ty(DType::F32, &[C, C]))
        .scratch("solve_work", ty(DType::F32, &[C, C]))
        .scratch("solve_out", ty(DType::F32, &[C, C]))
        .cost(Cost { flops, transcendentals: (l * t * k) as f64 * 4.0, bytes })
        .build(|b| {
            let c = b.program_id(1)?;
            let zero = b.index(0)?;
            let first = b.read_table(0, &c)?;
            let at_first = b.compare(Cmp::Ne, &first, &zero)?;
            b.when(&at_first, |b| {
                let h0 = if d.h0 {
                    let h0 = b.load_all(Ref::Input(5))?;
                    b.reshape(&h0, &[k, v])?
                } else {
                    b.splat(0.0, DType::F32, &[k, v])?
                };
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
            if d.states {
                let h = b.reshape(&s, &[1, 1, k, v])?;
                b.store_all(out_h, &h)?;
            }
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
            if d.ht {
                let last = b.read_table(1, &c)?;
                let at_last = b.compare(Cmp::Ne, &last, &zero)?;
                b.when(&at_last, |b| {
                    let ht = b.reshape(&s_next, &[1, 1, k, v])?;
                    b.store_all(out_ht, &ht)
                })?;
            }
            Ok(())
        })
}
