//! The GPU kernels of the KDA op, written in [`crate::lang`] and tiled for a GPU: lowered to
//! Triton for XLA's CUDA plugin (the `triton` row of the op table), or through the interpret
//! lowering with a GPU's numerics on any plugin (`triton-interpret`). The forward is three
//! kernels, four in f32 (docs/kernels/gpu-forward.md): [`intra`] (the chunk's pair terms and
//! its inverse; in f32 a program per sub-chunk and the inverse in [`inverse`]), [`wy`] (the
//! factors the recurrence reads) and [`recurrence`] (one program per lane, block of state
//! columns and state slot, looping over the slot's chunks), wired by [`call_forward`]. The
//! backward is [`state_grad`] (the reverse recurrence), [`wy_grad`] (through the states and the
//! WY solve), [`intra_grad`] (through the chunk's pairs, the floor and the gate) and, with the
//! L2 norm, [`norm_grad`] (docs/kernels/gpu-backward.md).
//! The programs around them are in `program`.

pub mod intra;
pub mod intra_grad;
pub mod inverse;
pub mod norm_grad;
mod packed;
pub(in crate::op) mod program;
pub mod recurrence;
pub mod state_grad;
pub mod tokens;
pub mod wy;
pub mod wy_grad;

use kda_core::{DType, GateKind};

use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, FnBuilder, Module, TensorType, Value};
use crate::lang::{Lower, MatPrecision, Ref, TritonParams};

/// Tokens per chunk.
pub use super::chunk::C;
/// Tokens per sub-chunk of the intra kernel.
pub const SUB: i64 = 16;
/// The widest block of state columns one recurrence program holds.
pub const MAX_BV: i64 = 32;

/// What the chunk kernels hand the recurrence per chunk (`eg` in f32, the others in
/// [`ForwardShape::factor_dtype`]).
#[derive(Clone, Copy, Debug)]
pub struct Factors {
    /// `w = A (beta k e^G)` `[L, T, K]`.
    pub w: Ref,
    /// `u = A (beta v)` `[L, T, V]`.
    pub u: Ref,
    /// `scale q e^G` `[L, T, K]`.
    pub qg: Ref,
    /// `k e^(G_C - G)` `[L, T, K]`.
    pub kg: Ref,
    /// `scale Aqk` `[L, T, C]`, each chunk's rows.
    pub aqk: Ref,
    /// `e^(G_C)` `[L, NT, K]`, each chunk's whole decay.
    pub eg: Ref,
}

impl Factors {
    /// The six, in order.
    pub fn all(&self) -> [Ref; 6] {
        [self.w, self.u, self.qg, self.kg, self.aqk, self.eg]
    }
}

/// How the kernels read the per-token inputs and write `o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenLayout {
    /// Lane-major `[L, T, D]` (`beta` `[L, T, 1]`): a head-first caller's tensors, or XLA's
    /// aligned chunks of packed rows.
    Lanes,
    /// The caller's batch-first rows read in place: `[T, L * D]` (`beta` `[T, L]`), lanes being
    /// heads and `T` the rows' tokens one row after another (each row whole chunks; the tables
    /// restart the state at each row).
    Rows,
    /// The caller's batch-first packed rows read in place: `[B T, L * D]`, lanes being heads;
    /// chunk position `c` reads the `valid[c]` tokens from token `start[c]` (masked loads: the
    /// rest of its window reads zero) and writes `written[c]` rows there (masked stores: a row's
    /// trailing padding tokens are written by its last chunk and by the unused positions, as
    /// zeros).
    Packed,
    /// The caller's head-first packed rows read in place: `[L, B T, D]` (`beta` `[L, B T, 1]`),
    /// each chunk position placed as in [`TokenLayout::Packed`].
    PackedLanes,
}

impl TokenLayout {
    /// Whether the layout is packed rows read in place (the chunk positions' tables place them).
    pub fn packed(self) -> bool {
        matches!(self, TokenLayout::Packed | TokenLayout::PackedLanes)
    }
}

/// The problem the GPU kernels take: `lanes` (heads x rows) of `t` aligned token slots
/// (whole chunks; a packed row's segments each start a chunk), `slots` state slots per lane.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForwardShape {
    /// Heads times rows.
    pub lanes: i64,
    /// Token slots per lane, a multiple of 64.
    pub t: i64,
    /// Rows of the caller's per-token tensors the kernels read in place ([`TokenLayout::Rows`],
    /// [`TokenLayout::Packed`]): `t` for rows, `B T` for packed rows.
    pub tokens: i64,
    /// Key width, a power of two from 16 to 256.
    pub k: i64,
    /// Value width, a power of two from 16 to 256.
    pub v: i64,
    /// The dtype of `q`, `k`, `v`, `beta` and `o` (f32 or bf16).
    pub dtype: DType,
    /// The dtype of `g` (f32 or bf16; the kernels widen it).
    pub g_dtype: DType,
    /// How the per-token operands and `o` are laid out.
    pub layout: TokenLayout,
    /// How the kernels activate `g` (in-kernel gates read `[L, 2, K]` parameters).
    pub gate: GateKind,
    /// Whether the kernels L2-normalise `q` and `k`.
    pub l2norm: bool,
    /// The query scale.
    pub scale: f64,
    /// State slots per lane (segments of a packed row; 1 for fixed-length rows).
    pub slots: i64,
    /// The most chunk positions one slot's run takes: the recurrence's static trip bound
    /// (`t / 64` unless every run is known shorter, as batch-first rows are).
    pub run_chunks: i64,
    /// Whether the slots' runs come from the segment tables (packed rows); otherwise slot `s`
    /// runs positions `s * run_chunks ..` for `run_chunks`, with no tables to compute.
    pub segmented: bool,
    /// Whether initial states are given.
    pub h0: bool,
    /// Whether the recurrence writes the state entering every chunk (for the saved-state
    /// backward).
    pub keep_h: bool,
    /// The dtype of the kept entering states, as the recurrence writes them and the WY gradient
    /// reads them: f32 for a saved-state residual, the factors' dtype inside a fused program
    /// (its products round them so anyway).
    pub h_dtype: DType,
    /// How the intra kernel launches on a GPU.
    pub intra_launch: TritonParams,
    /// How the WY kernel launches.
    pub wy_launch: TritonParams,
    /// How the recurrence launches.
    pub recurrence_launch: TritonParams,
    /// How the backward's state-gradient kernel launches.
    pub state_grad_launch: TritonParams,
    /// How the backward's WY-gradient kernel launches.
    pub wy_grad_launch: TritonParams,
    /// How the backward's intra-gradient kernel launches.
    pub intra_grad_launch: TritonParams,
    /// How the backward's L2-norm gradient kernel launches.
    pub norm_grad_launch: TritonParams,
}

impl ForwardShape {
    /// `lanes` of `t` tokens, `k` and `v` wide, in `dtype`, scale `k^-1/2`, a pre-activated
    /// gate, no L2 norm, one slot, no initial state. Launches: 8 warps and one pipeline stage
    /// each, the configuration that compiles without spills (docs/kernels/gpu-forward.md).
    pub fn new(lanes: i64, t: i64, k: i64, v: i64, dtype: DType) -> Self {
        let launch = |num_warps| TritonParams { num_warps, num_stages: 1, ..TritonParams::default() };
        ForwardShape {
            lanes,
            t,
            tokens: t,
            k,
            v,
            dtype,
            g_dtype: DType::F32,
            layout: TokenLayout::Lanes,
            gate: GateKind::Preactivated,
            l2norm: false,
            scale: 1.0 / (k as f64).sqrt(),
            slots: 1,
            run_chunks: t / C,
            segmented: false,
            h0: false,
            keep_h: false,
            h_dtype: DType::F32,
            intra_launch: launch(8),
            wy_launch: launch(8),
            recurrence_launch: launch(8),
            state_grad_launch: launch(8),
            wy_grad_launch: launch(8),
            intra_grad_launch: launch(8),
            norm_grad_launch: launch(8),
        }
    }

    /// The products' precision: one bf16 pass for bf16 inputs, three TF32 passes for f32 ones.
    pub fn precision(&self) -> MatPrecision {
        match self.dtype {
            DType::BF16 => MatPrecision::Default,
            _ => MatPrecision::Tf32x3,
        }
    }

    /// The type the chunk kernels hand over the factors that only feed products (`w`, `qg`,
    /// `kg`, `aqk`, `A`): the input dtype, since a bf16 product rounds its operands to bf16
    /// anyway (the same bits, half the traffic and registers); `u` too (it enters `v_new`,
    /// which a bf16 product rounds the same way); `eg` stays f32.
    pub fn factor_dtype(&self) -> DType {
        self.dtype
    }

    /// Key columns a kernel holds at once (the recurrence's state rows per buffer): 64 for f32,
    /// whose three-pass products hold each operand twice, 128 for bf16 (the register files of
    /// docs/kernels/gpu-forward.md).
    pub fn bk(&self) -> i64 {
        self.k.min(match self.dtype {
            DType::BF16 => 128,
            _ => 64,
        })
    }

    /// Value columns the WY kernel makes `u` for at once: as [`ForwardShape::bk`].
    pub fn bu(&self) -> i64 {
        self.v.min(self.bk().max(16))
    }

    /// WY programs per lane and chunk: one for bf16; for f32, one per block of key columns and
    /// one per block of value columns, so that a program holds one three-pass product.
    pub fn wy_programs(&self) -> i64 {
        match self.dtype {
            DType::BF16 => 1,
            _ => self.k / self.bk() + self.v / self.bu(),
        }
    }

    /// Intra programs per lane and chunk: one for bf16; for f32, one per 16-token sub-chunk,
    /// whose `L` rows the inverse kernel ([`inverse`]) then inverts (a program holding the
    /// chunk's three-pass products and its inverse together spills).
    pub fn intra_programs(&self) -> i64 {
        match self.dtype {
            DType::BF16 => 1,
            _ => C / SUB,
        }
    }

    /// State columns per recurrence program: 32 for bf16, 16 for f32 (whose three-pass
    /// products hold each operand twice).
    pub fn bv(&self) -> i64 {
        self.v.min(match self.dtype {
            DType::BF16 => MAX_BV,
            _ => MAX_BV / 2,
        })
    }

    /// State rows per part of the state-gradient kernel's `dh`: as [`ForwardShape::bk`] for
    /// bf16; up to 128 for f32, where one part with 8 columns per program keeps its three-pass
    /// products within the registers (two 64-row parts spill).
    pub fn grad_bk(&self) -> i64 {
        match self.dtype {
            DType::BF16 => self.bk(),
            _ => self.k.min(128),
        }
    }

    /// State columns per state-gradient program: as [`ForwardShape::bv`] for bf16, 8 for f32.
    pub fn grad_bv(&self) -> i64 {
        match self.dtype {
            DType::BF16 => self.bv(),
            _ => self.v.min(8),
        }
    }

    /// Key columns per block of the WY-gradient kernel's key side, which holds three `[64, BK]`
    /// f32 accumulators (`dO h^T`, `v_new dh^T`, `dv' h^T`): 64 for bf16, 32 for f32.
    pub fn wy_grad_bk(&self) -> i64 {
        self.k.min(match self.dtype {
            DType::BF16 => 64,
            _ => 32,
        })
    }

    /// Programs per lane and chunk of the WY-gradient kernel: one per block of
    /// [`ForwardShape::wy_grad_bk`] key columns, one for the value side's pairs and one for the
    /// products through `A^T`.
    pub fn wy_grad_parts(&self) -> i64 {
        self.k / self.wy_grad_bk() + 2
    }

    /// The dtype the intra gradient writes `dq` and `dk` in: f32 for the L2 norm's gradient
    /// kernel ([`norm_grad`]) to take on, else the input dtype (final).
    pub fn qk_grad_dtype(&self) -> DType {
        match self.l2norm {
            true => DType::F32,
            false => self.dtype,
        }
    }

    /// Key columns per intra-gradient program: 64 for bf16, 32 for f32 (a program holds the
    /// chunk's `q`, `k`, gates and column sums at this width beside three `[64, 64]` pair
    /// gradients).
    pub fn intra_grad_bk(&self) -> i64 {
        self.wy_grad_bk()
    }

    /// An `Unsupported` error naming the limit the shape is past.
    pub fn check(&self) -> Result<()> {
        let width = |n: i64| (16..=256).contains(&n) && n & (n - 1) == 0;
        let limit = if !(width(self.k) && width(self.v)) {
            Some(format!("K = {}, V = {}: the GPU kernels take powers of two from 16 to 256", self.k, self.v))
        } else if self.t < C || self.t % C != 0 {
            Some(format!("T = {}: the GPU kernels take whole 64-token chunks", self.t))
        } else if !matches!(self.dtype, DType::F32 | DType::BF16) {
            Some(format!("{}: the GPU kernels take f32 or bf16", self.dtype))
        } else if self.lanes < 1 || self.slots < 1 {
            Some("no lanes or no state slots".to_string())
        } else {
            None
        };
        match limit {
            Some(m) => Err(TpuError::unsupported("GPU kernels", m)),
            None => Ok(()),
        }
    }
}

/// The forward's operands as the kernels take them (see [`ForwardShape`] for the shapes).
#[derive(Clone, Copy, Debug)]
pub struct ForwardInputs {
    /// `q` `[L, T, K]`.
    pub q: Value,
    /// `k` `[L, T, K]`.
    pub k: Value,
    /// `v` `[L, T, V]`.
    pub v: Value,
    /// The raw or pre-activated log-decay `[L, T, K]` in the shape's `g_dtype`.
    pub g: Value,
    /// `beta` `[L, T, 1]`.
    pub beta: Value,
    /// The in-kernel gate's `[L, 2, K]` (`exp(a_log)`, `dt_bias`).
    pub gate: Option<Value>,
    /// The initial states `[L, slots, K, V]` f32.
    pub h0: Option<Value>,
    /// Tokens per chunk position `[NT]` i32.
    pub valid: Value,
    /// 1 at a segment's first chunk position `[NT]` i32.
    pub first: Value,
    /// 1 at a segment's last chunk position `[NT]` i32.
    pub last: Value,
    /// The state slot of each chunk position `[NT]` i32.
    pub slot: Value,
    /// Packed rows read in place: each chunk position's first token and the rows it writes
    /// (`[NT]` i32 each; [`TokenLayout::Packed`]).
    pub packed: Option<PackedTables>,
}

/// Where packed rows read in place put each chunk position ([`TokenLayout::Packed`]).
#[derive(Clone, Copy, Debug)]
pub struct PackedTables {
    /// The caller's token at the chunk position's first row (any in-range value where it reads
    /// and writes nothing).
    pub start: Value,
    /// Rows written from `start`: its tokens, and the trailing padding it zeroes.
    pub written: Value,
}

/// What the forward kernels return: `o` `[L, T, V]` in the input dtype, the final states `[L, slots, K, V]`
/// (slots without chunks unwritten) and, with [`ForwardShape::keep_h`], the state entering each
/// chunk `[L, NT, K, V]` and `v'`.
#[derive(Clone, Copy, Debug)]
pub struct ForwardOutputs {
    /// The output.
    pub o: Value,
    /// The final states.
    pub ht: Value,
    /// The entering states.
    pub h: Option<Value>,
    /// `v' = u - w S` `[L, T, V]`, kept with the entering states.
    pub v_new: Option<Value>,
}

/// The chunk kernels' results: the factors the recurrence reads and the inverse `A` (shapes
/// as in [`Factors`]; `A` `[L, T, C]` in [`ForwardShape::factor_dtype`]).
#[derive(Clone, Copy, Debug)]
pub struct FactorValues {
    /// `w`.
    pub w: Value,
    /// `u`.
    pub u: Value,
    /// `scale q e^G`.
    pub qg: Value,
    /// `k e^(G_C - G)`.
    pub kg: Value,
    /// `scale Aqk`.
    pub aqk: Value,
    /// `e^(G_C)`.
    pub eg: Value,
    /// `A = (I + L)^-1`.
    pub a: Value,
}

/// Binds the per-token operands `t` of a chunk-parallel kernel to `x`'s.
pub(super) fn bind_tokens(
    a: &mut crate::lang::Bindings,
    t: &tokens::TokenRefs,
    x: &ForwardInputs,
) -> Result<()> {
    for (r, v) in [(t.q, x.q), (t.k, x.k), (t.g, x.g), (t.beta, x.beta)] {
        a.input(r, v)?;
    }
    if let Some(r) = t.v {
        a.input(r, x.v)?;
    }
    if let (Some(r), Some(v)) = (t.gate, x.gate) {
        a.input(r, v)?;
    }
    if let Some((q, k)) = t.whole {
        a.input(q, x.q)?;
        a.input(k, x.k)?;
    }
    if let Some(valid) = t.valid {
        a.table(valid, x.valid)?;
    }
    tokens::bind_packed(a, t.packed.as_ref(), x.valid, x.packed)
}

/// Calls the chunk kernels of `s` (intra, the inverse where the intra kernel splits the chunk,
/// WY) on `x` in `f`, lowered by `lowering`.
pub fn call_factors(
    f: &mut FnBuilder,
    s: &ForwardShape,
    x: &ForwardInputs,
    lowering: &dyn Lower,
) -> Result<FactorValues> {
    s.check()?;
    let (ik, ir) = intra::intra_kernel(s)?;
    let mut a = ik.bindings();
    bind_tokens(&mut a, &ir.tokens, x)?;
    let intra = ik.call(f, lowering, a)?;
    let mut inverse = intra.get(ir.a)?;
    if s.intra_programs() > 1 {
        let (vk, vr) = inverse::inverse_kernel(s)?;
        let mut a = vk.bindings();
        a.input(vr.l, inverse)?;
        inverse = vk.call(f, lowering, a)?.get(vr.a)?;
    }
    let (wk, wr) = wy::wy_kernel(s)?;
    let mut a = wk.bindings();
    bind_tokens(&mut a, &wr.tokens, x)?;
    a.input(wr.a, inverse)?;
    let wy = wk.call(f, lowering, a)?;
    Ok(FactorValues {
        w: wy.get(wr.w)?,
        u: wy.get(wr.u)?,
        qg: wy.get(wr.qg)?,
        kg: wy.get(wr.kg)?,
        aqk: intra.get(ir.aqk)?,
        eg: wy.get(wr.eg)?,
        a: inverse,
    })
}

/// Calls the recurrence kernel of `s` on the factors `fv` and `x`'s states and tables in `f`,
/// lowered by `lowering`.
pub fn call_recurrence(
    f: &mut FnBuilder,
    s: &ForwardShape,
    x: &ForwardInputs,
    fv: &FactorValues,
    lowering: &dyn Lower,
) -> Result<ForwardOutputs> {
    let (rk, rr) = recurrence::recurrence_kernel(s)?;
    let mut a = rk.bindings();
    let from = [fv.w, fv.u, fv.qg, fv.kg, fv.aqk, fv.eg];
    for (r, v) in rr.factors.all().into_iter().zip(from) {
        a.input(r, v)?;
    }
    if let (Some(r), Some(v)) = (rr.h0, x.h0) {
        a.input(r, v)?;
    }
    if let Some((start_t, chunks_t)) = rr.runs {
        let (start, chunks) = recurrence::runs(f, s.slots, x.first, x.slot)?;
        a.table(start_t, start)?;
        a.table(chunks_t, chunks)?;
    }
    a.table(rr.last, x.last)?;
    tokens::bind_packed(&mut a, rr.packed.as_ref(), x.valid, x.packed)?;
    let out = rk.call(f, lowering, a)?;
    let kept = |r: Option<Ref>| r.map(|r| out.get(r)).transpose();
    Ok(ForwardOutputs { o: out.get(rr.o)?, ht: out.get(rr.ht)?, h: kept(rr.h)?, v_new: kept(rr.v_new)? })
}

/// Calls the forward kernels of `s` on `x` in `f` ([`call_factors`], then
/// [`call_recurrence`]), lowered by `lowering`.
pub fn call_forward(
    f: &mut FnBuilder,
    s: &ForwardShape,
    x: &ForwardInputs,
    lowering: &dyn Lower,
) -> Result<ForwardOutputs> {
    let fv = call_factors(f, s, x, lowering)?;
    call_recurrence(f, s, x, &fv, lowering)
}

/// The kernels of the forward of `s`, in launch order (intra, the inverse where the intra kernel
/// splits the chunk, WY, recurrence).
pub fn forward_kernels(s: &ForwardShape) -> Result<Vec<crate::lang::Kernel>> {
    let mut kernels = vec![intra::intra_kernel(s)?.0];
    if s.intra_programs() > 1 {
        kernels.push(inverse::inverse_kernel(s)?.0);
    }
    kernels.push(wy::wy_kernel(s)?.0);
    kernels.push(recurrence::recurrence_kernel(s)?.0);
    Ok(kernels)
}

/// The tables of fixed-length lanes of `t` tokens in `nt` chunk positions: `valid` (64 but the
/// last chunk's remainder), `first`, `last`, `slot` (all 0).
pub fn fixed_tables(f: &mut FnBuilder, t: i64, nt: i64) -> Result<[Value; 4]> {
    let ty = TensorType::new(DType::I32, &[nt]);
    let pos = f.iota(ty.clone(), 0)?;
    let c = f.constant_i32(C as i32, ty.clone())?;
    let start = f.mul(pos, c)?;
    let total = f.constant_i32(t as i32, ty.clone())?;
    let left = f.sub(total, start)?;
    let valid = f.min(left, c)?;
    let flag = |f: &mut FnBuilder, at: i64| -> Result<Value> {
        let at = f.constant_i32(at as i32, ty.clone())?;
        let hit = f.compare(Cmp::Eq, pos, at)?;
        f.convert(hit, DType::I32)
    };
    let (first, last) = (flag(f, 0)?, flag(f, nt - 1)?);
    let slot = f.constant_i32(0, ty.clone())?;
    Ok([valid, first, last, slot])
}

/// A module whose `@main(q, k, v, g, beta[, h0])` (`[L, T, K]`, `[L, T, K]`, `[L, T, V]` in the
/// shape's dtype, `g` `[L, T, K]` f32 pre-activated, `beta` `[L, T, 1]`, `h0` `[L, K, V]` f32)
/// returns `(o [L, T, V], ht [L, K, V])` in f32: fixed-length lanes, the kernels lowered by
/// `lowering`.
#[cfg_attr(not(feature = "harness"), allow(dead_code))] // the GPU kernels' tests (harness feature)
pub fn forward_module(s: &ForwardShape, lowering: &dyn Lower) -> Result<String> {
    s.check()?;
    let (l, t, k, v) = (s.lanes, s.t, s.k, s.v);
    let ty = |d: DType, dims: &[i64]| TensorType::new(d, dims);
    let mut f = FnBuilder::new("main", true);
    let q = f.arg(ty(s.dtype, &[l, t, k]))?;
    let kk = f.arg(ty(s.dtype, &[l, t, k]))?;
    let vv = f.arg(ty(s.dtype, &[l, t, v]))?;
    let g = f.arg(ty(DType::F32, &[l, t, k]))?;
    let beta = f.arg(ty(s.dtype, &[l, t, 1]))?;
    let h0 = match s.h0 {
        true => {
            let h = f.arg(ty(DType::F32, &[l, k, v]))?;
            Some(f.reshape(h, &[l, 1, k, v])?)
        }
        false => None,
    };
    let [valid, first, last, slot] = fixed_tables(&mut f, t, t / C)?;
    let shape = ForwardShape { gate: GateKind::Preactivated, slots: 1, ..*s };
    let x =
        ForwardInputs { q, k: kk, v: vv, g, beta, gate: None, h0, valid, first, last, slot, packed: None };
    let out = call_forward(&mut f, &shape, &x, lowering)?;
    let ht = f.reshape(out.ht, &[l, k, v])?;
    let o = match out.o.elem() {
        DType::F32 => out.o,
        _ => f.convert(out.o, DType::F32)?,
    };
    let mut outs = vec![o, ht];
    outs.extend(out.h);
    f.ret(&outs)?;
    let mut m = Module::new();
    m.add(f)?;
    Ok(m.to_text())
}
