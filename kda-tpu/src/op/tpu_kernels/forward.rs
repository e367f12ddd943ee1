//! The chunked KDA forward as one Mosaic kernel (docs/kda.md, Chunks): a grid over heads and
//! rows (`parallel`; packed rows are one row of chunks) and chunk positions (`arbitrary`), the
//! state `S` `[K, V]` of a lane (a head of a row) in VMEM scratch across its chunks. Per chunk:
//! [`super::blocks::chunk_terms`], `A = (I + L)^-1` ([`super::blocks::unit_lower_inverse`]),
//! `u = A (beta v)`, `w = A (beta k e^G)`, `v_new = u - w S`, `o = scale (q e^G) S + Aqk v_new`,
//! `S <- e^(G_C) S + (k e^(G_C - G))^T v_new`.
//!
//! Segments come as three scalar-prefetched chunk tables, as the XLA programs read them: at a
//! chunk with `first[c] = 1` the state starts from `h0` of slot `slot[c]` (or zero), at one with
//! `last[c] = 1` it is written to `ht` of that slot. Fixed-length rows are the tables
//! `first = [1, 0, ..]`, `last = [.., 0, 1]`, `slot = 0`; one kernel serves both.
//!
//! Its per-token operands hold their tokens as [`Tokens`] says (the caller's head-first or
//! batch-first tensors in place, or lanes `[L, NT * 64, D]` that XLA made); the kernel widens
//! bf16 blocks, L2-normalises q and k when asked, applies the [`Gate`] and the floor to `g`, and
//! accumulates everything in f32. `h0` and `ht` are `[L, S, K, V]` f32 (`S` state slots per
//! lane), `h` `[L, NT, K, V]` the state entering every chunk (what the saved-state
//! backward reads; f32, or with the chunk terms [`ForwardDims::state_dtype`]).

use kda_core::DType;

use super::blocks::{chunk_terms, unit_lower_inverse_of_parts, TermScratch, EXPONENT_ROWS, LEVEL_ROWS};
use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Binary, Body, MatPrecision, Offset, Reduction, Ref, Unary, V};
use crate::lang::{Cost, Index, Kernel, KernelBuilder, Operand, Semantics};

pub(super) const C: i64 = 64;

/// How the per-token operands (`q k v g` and `o`) hold their tokens (`R` rows of `T = NT * 64`
/// tokens, `H` heads, `L = H * R` lanes, lane `h * R + r`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokens {
    /// `[L, T, D]`: lanes made by XLA (any width; packed rows gathered to chunk-aligned work).
    Lanes,
    /// `[H, R * T, D]`: the caller's head-first `[H, B, T, D]`, read in place.
    HeadFirst,
    /// `[R, T, H * D]`: the caller's batch-first `[B, T, H, D]`, read in place (each block a
    /// head's `D` lanes, so D a multiple of 128, or H = 1).
    BatchFirst,
    /// Packed segments read in place from the caller's head-first tensors `[H, P, D]` (`P`
    /// packed tokens, a multiple of 64; one row of chunks): chunk `c` holds the `len[c]` tokens
    /// from `start[c]`, read through the two aligned 64-token blocks around them ([`Window`]);
    /// `o` comes out f32 in the tokens' own places (`[H, P, V]`), padding tokens unwritten.
    PackedHeadFirst,
    /// As [`Tokens::PackedHeadFirst`] from batch-first tensors `[1, P, H * D]` (D a multiple of
    /// 128, or H = 1).
    PackedBatchFirst,
}

impl Tokens {
    /// Whether the kernel reads packed tokens in place through the window tables.
    pub fn packed(self) -> bool {
        matches!(self, Tokens::PackedHeadFirst | Tokens::PackedBatchFirst)
    }
}

/// The scalar-prefetch tables after `first`, `last`, `slot` with which a packed kernel
/// ([`Tokens::packed`]) finds chunk `c`'s tokens `start[c] .. start[c] + len[c]` in place: the
/// block indices `lo[c]` (of the block holding `start[c]`) and `hi[c]` (the next one, clamped
/// to the last block), `off[c] = start[c] - 64 lo[c]` and `len[c]`; rows from `len[c]` on are
/// read as zeros.
#[derive(Clone, Copy, Debug)]
pub struct Window;

impl Window {
    /// Table indices of `lo`, `hi`, `off` and `len`.
    pub const LO: usize = 3;
    /// See [`Window::LO`].
    pub const HI: usize = 4;
    /// See [`Window::LO`].
    pub const OFF: usize = 5;
    /// See [`Window::LO`].
    pub const LEN: usize = 6;
}

/// The gate the kernel applies to `g` (docs/kda.md, Tensors), then the floor at -30 (the XLA
/// programs' `GATE_FLOOR`): with `Softplus` or `LowerBound` the per-head `exp(a_log)` and
/// `dt_bias` come as the operand `gate` `[H, 2, K]` (row 0 `exp(a_log[h])` on every channel,
/// row 1 `dt_bias[h, :]`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gate {
    /// `g` is the log-decay.
    Preactivated,
    /// `g = -exp(a_log) softplus(x + dt_bias)`.
    Softplus,
    /// `g = lb sigmoid(exp(a_log) (x + dt_bias))`.
    LowerBound(f64),
}

/// The floor of the per-token log-decay (as the XLA programs' `GATE_FLOOR`).
pub(super) const FLOOR: f64 = -30.0;

/// The dims and options of one forward kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForwardDims {
    /// Heads `H`.
    pub heads: i64,
    /// Rows `R` side by side (`B` for fixed-length rows; 1 for packed rows, whose chunks follow
    /// each other in one lane per head).
    pub rows: i64,
    /// Chunk positions per lane.
    pub chunks: i64,
    /// State slots per lane (`h0`, `ht`): 1 for fixed-length rows.
    pub slots: i64,
    /// Key width.
    pub k: i64,
    /// Value width.
    pub v: i64,
    /// The dtype of `q` and `k` (f32 or bf16).
    pub qk: DType,
    /// The dtype of `g` (f32 or bf16).
    pub g: DType,
    /// The dtype of `v`, `beta` and `o` (f32 or bf16).
    pub dtype: DType,
    /// How `q k v g o` hold their tokens.
    pub tokens: Tokens,
    /// Packed tokens `P` of [`Tokens::packed`] operands (a multiple of 64; else unused).
    pub packed_tokens: i64,
    /// Whether the kernel L2-normalises q and k over K.
    pub l2norm: bool,
    /// The gate applied to `g`.
    pub gate: Gate,
    /// Whether the caller's gate has parameters whose gradients sum `dg` over every token (an
    /// in-kernel gate, applied here or, for lanes, by XLA): the backward then forms `dg` to
    /// about 16 bits in one-pass products.
    pub gate_params: bool,
    /// Whether `h0` is an input (else every segment starts from zero).
    pub h0: bool,
    /// Whether `ht` is a result.
    pub ht: bool,
    /// Whether `h`, the state entering every chunk, is a result.
    pub states: bool,
    /// Whether every chunk's `A = (I + L)^-1` and `Aqk` are results (`a`, `aqk`
    /// `[L, NT, 64, 64]` in [`ForwardDims::mask_dtype`]: what the backward kernel reads
    /// instead of forming them again).
    pub terms: bool,
    /// Chunks per grid step: a divisor of `chunks`, above one only for fixed-length rows read in
    /// place ([`ForwardDims::steps_for`] picks one). A step forms all its chunks' terms before
    /// their state updates, so that the compiler overlaps them, and pays the step's own
    /// bookkeeping once.
    pub step_chunks: i64,
}

impl ForwardDims {
    /// `Unsupported` (naming `what` and the limit) unless the kernels take these dims: one
    /// head, row, chunk and slot or more, f32 or bf16 inputs, K and V of 1 to [`MAX_WIDTH`].
    pub fn check(&self, what: &str) -> Result<()> {
        let float = |t: DType| matches!(t, DType::F32 | DType::BF16);
        let sizes_ok = self.chunks >= 1 && self.heads >= 1 && self.rows >= 1 && self.slots >= 1;
        if !sizes_ok || !float(self.dtype) || !float(self.qk) || !float(self.g) {
            return Err(TpuError::unsupported(
                what,
                format!("one head, row, chunk and slot or more and f32 or bf16 inputs ({self:?})"),
            ));
        }
        if !(1..=MAX_WIDTH).contains(&self.k) || !(1..=MAX_WIDTH).contains(&self.v) {
            return Err(TpuError::unsupported(
                what,
                format!("K and V of 1 to {MAX_WIDTH} (K = {}, V = {})", self.k, self.v),
            ));
        }
        let n = self.chunks_per_step();
        if n < 1 || self.chunks % n != 0 || (n > 1 && !self.fixed_rows()) {
            return Err(TpuError::unsupported(
                what,
                format!(
                    "chunks per step dividing the chunk count, one unless fixed-length rows are \
                     read in place ({self:?})"
                ),
            ));
        }
        let t = self.packed_tokens;
        if self.tokens.packed() && (self.rows != 1 || t < C || t % C != 0) {
            return Err(TpuError::unsupported(
                what,
                format!("packed tokens read in place in one row of whole 64-token blocks ({self:?})"),
            ));
        }
        Ok(())
    }

    /// The builder both kernels start from: the grid (heads, rows, then the sequential steps of
    /// `chunks_per_step` chunks) and the scalar-prefetched chunk tables (`first`, `last`,
    /// `slot`, and for packed tokens read in place the window tables `lo`, `hi`, `off`, `len`).
    pub(super) fn builder(&self, name: &str) -> KernelBuilder {
        let nt = self.chunks;
        let mut kb = KernelBuilder::new(name)
            .grid(self.heads, Semantics::Parallel)
            .grid(self.rows, Semantics::Parallel)
            .grid(nt / self.chunks_per_step(), Semantics::Arbitrary)
            .table("first", nt)
            .table("last", nt)
            .table("slot", nt);
        if self.tokens.packed() {
            kb = kb.table("lo", nt).table("hi", nt).table("off", nt).table("len", nt);
        }
        kb
    }

    /// The tables of a per-token input's blocks: one block, or a packed window's two.
    pub(super) fn windows(&self) -> &'static [usize] {
        if self.tokens.packed() {
            &[Window::LO, Window::HI]
        } else {
            &[0]
        }
    }

    /// How `beta` is read: as the tokens, but head-first in place for batch-first tokens (a
    /// packed window's `[H, P, 1]`, or fixed rows' `[R * T, H]` columns).
    pub(super) fn beta_tokens(&self) -> Tokens {
        match self.tokens {
            Tokens::Lanes => Tokens::Lanes,
            Tokens::PackedHeadFirst | Tokens::PackedBatchFirst => Tokens::PackedHeadFirst,
            _ => Tokens::HeadFirst,
        }
    }

    fn lanes(&self) -> i64 {
        self.heads * self.rows
    }

    /// The precision of the kernel's products: f32 inputs keep f32 products (the MXU at full
    /// precision); bf16 inputs run them in one bf16 pass with f32 accumulation, as their inputs'
    /// precision allows (docs/kda.md, Accuracy: 2e-2), but for the sums of `g`
    /// ([`super::blocks::chunk_terms`]).
    pub fn precision(&self) -> MatPrecision {
        if self.dtype == DType::BF16 && self.qk == DType::BF16 {
            MatPrecision::Default
        } else {
            MatPrecision::Highest
        }
    }

    /// Whether the tokens are fixed-length rows read in place ([`Tokens::HeadFirst`],
    /// [`Tokens::BatchFirst`]): one segment per lane, its state reset at the first chunk and
    /// final at the last (lanes may hold packed segments).
    pub fn fixed_rows(&self) -> bool {
        matches!(self.tokens, Tokens::HeadFirst | Tokens::BatchFirst)
    }

    /// Chunks per grid step ([`ForwardDims::step_chunks`]).
    pub fn chunks_per_step(&self) -> i64 {
        self.step_chunks
    }

    /// The chunks per grid step for a wish of `at_most`: the largest power of two up to it that
    /// divides the chunk count, for fixed-length rows read in place ([`ForwardDims::fixed_rows`]);
    /// one otherwise (packed windows).
    pub fn steps_for(&self, at_most: i64) -> i64 {
        if !self.fixed_rows() {
            return 1;
        }
        let mut n = 1;
        while n * 2 <= at_most.max(1) && self.chunks % (n * 2) == 0 {
            n *= 2;
        }
        n
    }

    /// The default wish for [`ForwardDims::steps_for`]: [`STREAMED_STEP_CHUNKS`] when the
    /// per-token operands are too large for XLA to place them in VMEM (it streams them from HBM
    /// then, and each grid step pays DMA bookkeeping for every operand: at H=32, T=8192 about
    /// 140 bundles a step), while a step's double-buffered blocks stay within
    /// [`STEP_BLOCK_BYTES`]; else [`RESIDENT_STEP_CHUNKS`] (a step's other chunks' terms overlap
    /// each chunk's state update).
    pub fn default_step_chunks(&self) -> i64 {
        let bytes = |t: DType| i64::from(t.bit_width() / 8);
        // Bytes of one token of one lane through q, k, v, g, beta and o (and one chunk's state).
        let token =
            2 * self.k * bytes(self.qk) + self.k * bytes(self.g) + (2 * self.v + 1) * bytes(self.dtype);
        let operands = self.lanes() * self.chunks * C * token;
        if operands <= STREAMED_BYTES {
            return RESIDENT_STEP_CHUNKS;
        }
        let chunk = C * token + if self.states { 4 * self.k * self.v } else { 0 };
        let mut n = STREAMED_STEP_CHUNKS;
        while n > 2 && 2 * n * chunk > STEP_BLOCK_BYTES {
            n /= 2;
        }
        n
    }

    /// The dtype of the per-chunk states `h`: with the chunk terms ([`ForwardDims::terms`],
    /// states that only the backward kernel reads) [`ForwardDims::mask_dtype`], since the
    /// backward's one-pass products round them to it anyway; else f32 (the caller's `h`).
    pub fn state_dtype(&self) -> DType {
        if self.terms {
            self.mask_dtype()
        } else {
            DType::F32
        }
    }

    /// The dtype of the exponent masks the kernel reads
    /// ([`super::blocks::term_masks_kernel`]): bf16 for one-pass products, else f32.
    pub fn mask_dtype(&self) -> DType {
        match self.precision() {
            MatPrecision::Default => DType::BF16,
            MatPrecision::Highest => DType::F32,
        }
    }
}

/// Per-token operand bytes above which [`ForwardDims::default_step_chunks`] takes XLA to stream
/// them from HBM: more than a TensorCore's 64 MiB of VMEM cannot stay there (the primary
/// shape's 10 MB, bf16, or 25 MB, f32, are placed in VMEM; H=32, T=8192's 336 MB stream).
pub const STREAMED_BYTES: i64 = 64 << 20;

/// Chunks per grid step when the operands stay in VMEM: at the primary shape (bf16, tpu7x) the
/// fused forward+VJP counts 196 k static cycles at two, 190 k at four and 195 k at eight (the
/// forward alone 75.5 k and 73.8 k at two and four).
pub const RESIDENT_STEP_CHUNKS: i64 = 4;

/// Chunks per grid step when the operands stream from HBM: at H=32, T=8192 (bf16, tpu7x) the
/// static count falls from 2.94 M at two to 2.59 M at sixteen (thirty-two: a little less again,
/// for twice the code and VMEM).
pub const STREAMED_STEP_CHUNKS: i64 = 16;

/// The bound on one grid step's double-buffered per-token blocks (and saved states) that
/// [`ForwardDims::default_step_chunks`] keeps to, well inside the default scoped VMEM.
pub const STEP_BLOCK_BYTES: i64 = 8 << 20;

/// The largest key or value width of the kernel (docs/kda.md, Shapes).
pub const MAX_WIDTH: i64 = 256;

/// The type, block and block indices of a per-token operand of width `w` held as `tokens`, for
/// the grid (heads, rows, chunks): packed operands are read through window `table` (the block
/// index table [`Window::LO`] or [`Window::HI`]) of `packed` tokens. With `reverse` grid step
/// `i` reads the row's steps from the last (the backward's order; fixed-length rows and lanes).
pub(super) fn token_operand(
    name: &str,
    d: &ForwardDims,
    tokens: Tokens,
    dtype: DType,
    w: i64,
    table: usize,
    reverse: bool,
) -> Operand {
    let (h, r, nt, p, n) = (d.heads, d.rows, d.chunks, d.packed_tokens, d.chunks_per_step());
    let (g0, g1) = (Index::Grid(0), Index::Grid(1));
    let g2 = if reverse { Index::Const(nt / n - 1) + Index::Grid(2) * -1 } else { Index::Grid(2) };
    let (dims, map) = match tokens {
        Tokens::Lanes => ([h * r, nt * C, w], vec![g0 * r + g1, g2, Index::Const(0)]),
        Tokens::HeadFirst => ([h, r * nt * C, w], vec![g0, g1 * (nt / n) + g2, Index::Const(0)]),
        Tokens::BatchFirst => ([r, nt * C, h * w], vec![g1, g2, g0]),
        Tokens::PackedHeadFirst => ([h, p, w], vec![g0, Index::table(table, g2), Index::Const(0)]),
        Tokens::PackedBatchFirst => ([1, p, h * w], vec![Index::Const(0), Index::table(table, g2), g0]),
    };
    Operand::blocked(name, TensorType::new(dtype, &dims), &[1, n * C, w], map)
}

/// The forward kernel of `d` with output scale `scale`, on the grid (heads, rows: parallel;
/// chunks: arbitrary). Its operands: the tables `first`, `last`, `slot` (`[NT]` i32; `slot`
/// must not decrease, padding chunks after the last segment repeating its slot, since a result
/// block revisited later would be written back stale), then
/// `q k v g beta [gate] [h0] exponent_masks level_masks` (beta `[L, T, 1]` for
/// [`Tokens::Lanes`], `[R * T, H]` for [`Tokens::BatchFirst`], else `[H, R * T, 1]`; `h0` `[L, S, K, V]` f32; the masks are the results
/// of [`super::blocks::term_masks_kernel`] for [`ForwardDims::mask_dtype`]); its results
/// `o [ht] [h] [a aqk]` (`o` laid out as `v`; read in place packed, f32 `[H, P, V]` or
/// `[1, P, H * V]` with padding tokens unwritten: [`place`]).
pub fn forward_kernel(d: ForwardDims, scale: f64) -> Result<Kernel> {
    d.check("mosaic forward")?;
    let (l, nt, k, v, x, n) = (d.lanes(), d.chunks, d.k, d.v, d.dtype, d.chunks_per_step());
    let fixed_rows = d.fixed_rows();
    let t = nt * C;
    let (g0, g1, g2) = (Index::Grid(0), Index::Grid(1), Index::Grid(2));
    let lane = || g0.clone() * d.rows + g1.clone();
    // A step's state slot is its first chunk's (steps of several chunks are fixed-length rows,
    // one slot per lane).
    let slot = || vec![lane(), Index::table(2, g2.clone() * n), Index::Const(0), Index::Const(0)];
    let ty = |dt: DType, dims: &[i64]| TensorType::new(dt, dims);
    // docs/kda.md, Work: per token and head, 6CK + 4CV + 6KV + (2/3)C^2 flops; four exponentials
    // per gate element; every operand and result once through HBM.
    let (cf, kf, vf) = (C as f64, k as f64, v as f64);
    let flops = (l * t) as f64 * (6.0 * cf * kf + 4.0 * cf * vf + 6.0 * kf * vf + 2.0 / 3.0 * cf * cf);
    let bytes_of = |t: DType| f64::from(t.bit_width() / 8);
    let states = (l * k * v) as f64
        * 4.0
        * (d.slots * (i64::from(d.h0) + i64::from(d.ht)) + nt * i64::from(d.states)) as f64;
    let packed = d.tokens.packed();
    // Packed windows read every block twice (as a chunk's upper, then the next one's lower block).
    let reads = if packed { 2.0 } else { 1.0 };
    let bytes =
        (l * t) as f64 * reads * (2.0 * kf * bytes_of(d.qk) + (vf + 1.0) * bytes_of(x) + kf * bytes_of(d.g))
            + (l * t) as f64 * vf * bytes_of(x)
            + states;
    let beta_tokens = d.beta_tokens();
    let gated = d.gate != Gate::Preactivated;
    let mut kb = d.builder("kda_forward");
    // q k v g beta: one operand each, or a packed window's two blocks each.
    let windows = d.windows();
    let token_inputs =
        [("q", d.tokens, d.qk, k), ("k", d.tokens, d.qk, k), ("v", d.tokens, x, v), ("g", d.tokens, d.g, k)];
    // Batch-first beta `[R * T, H]` is read in place, every head's column of a step's rows
    // (its own picked in the body), rather than transposed by XLA.
    let beta_rows = d.tokens == Tokens::BatchFirst;
    for (name, tokens, dtype, w) in token_inputs.into_iter().chain([("beta", beta_tokens, x, 1)]) {
        for &table in windows {
            kb = kb.input(if name == "beta" && beta_rows {
                Operand::blocked(
                    "beta",
                    TensorType::new(x, &[d.rows * nt * C, d.heads]),
                    &[n * C, d.heads],
                    vec![g1.clone() * (nt / n) + g2.clone(), Index::Const(0)],
                )
            } else {
                token_operand(name, &d, tokens, dtype, w, table, false)
            });
        }
    }
    let per_token = 5 * windows.len();
    if gated {
        let at = vec![g0.clone(), Index::Const(0), Index::Const(0)];
        kb = kb.input(Operand::blocked("gate", ty(DType::F32, &[d.heads, 2, k]), &[1, 2, k], at));
    }
    let h0_input = per_token + usize::from(gated);
    if d.h0 {
        kb = kb.input(Operand::blocked("h0", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()));
    }
    let masks_input = h0_input + usize::from(d.h0);
    kb = kb.input(Operand::whole("exponent_masks", ty(d.mask_dtype(), &[EXPONENT_ROWS, C])));
    kb = kb.input(Operand::whole("level_masks", ty(DType::F32, &[LEVEL_ROWS, C])));
    kb = kb.output(if packed {
        // A head's packed tokens whole, in f32: every chunk's rows go to their tokens
        // ([`place`]), the block written back once, after the head's last chunk; padding tokens
        // hold whatever was there, and the caller zeroes them.
        let p = d.packed_tokens;
        let (dims, at) = match d.tokens {
            Tokens::PackedBatchFirst => {
                ([1, p, d.heads * v], vec![Index::Const(0), Index::Const(0), g0.clone()])
            }
            _ => ([d.heads, p, v], vec![g0.clone(), Index::Const(0), Index::Const(0)]),
        };
        Operand::blocked("o", ty(DType::F32, &dims), &[1, p, v], at)
    } else {
        token_operand("o", &d, d.tokens, x, v, 0, false)
    });
    if d.ht {
        kb = kb.output(Operand::blocked("ht", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()));
    }
    if d.states {
        let at = vec![lane(), g2.clone(), Index::Const(0), Index::Const(0)];
        kb = kb.output(Operand::blocked("h", ty(d.state_dtype(), &[l, nt, k, v]), &[1, n, k, v], at));
    }
    if d.terms {
        let at = vec![lane(), g2.clone(), Index::Const(0), Index::Const(0)];
        for name in ["a", "aqk"] {
            kb = kb.output(Operand::blocked(
                name,
                ty(d.mask_dtype(), &[l, nt, C, C]),
                &[1, n, C, C],
                at.clone(),
            ));
        }
    }
    let p = d.precision();
    let out_ht = Ref::Output(1);
    let out_h = Ref::Output(1 + usize::from(d.ht));
    let out_terms = 1 + usize::from(d.ht) + usize::from(d.states);
    // The gate's own: softplus an exponential and a log1p, the lower bound one tanh.
    let gate_ops = match d.gate {
        Gate::Preactivated => 0.0,
        Gate::Softplus => 2.0,
        Gate::LowerBound(_) => 1.0,
    };
    let transcendentals =
        (l * t * k) as f64 * (4.0 + gate_ops) + if d.l2norm { 2.0 * (l * t) as f64 } else { 0.0 };
    // A pre-activated bf16 g is bf16 after the floor: one pass sums it exactly.
    let g_passes = if d.g == DType::BF16 && !gated { 1 } else { 2 };
    kb = kb.scratch("state", ty(DType::F32, &[k, v])).scratch("sums", ty(DType::F32, &[C, k]));
    // A packed window's two blocks side by side, per per-token input, in f32 (scratch 2 to 6).
    if packed {
        for (name, w) in
            [("q_window", k), ("k_window", k), ("v_window", v), ("g_window", k), ("beta_window", 1)]
        {
            kb = kb.scratch(name, ty(DType::F32, &[2 * C, w]));
        }
        // The rows a chunk places around its `o` (scratch 7).
        kb = kb.scratch("place_o", ty(DType::F32, &[3 * C, v]));
    }
    kb.cost(Cost { flops, transcendentals, bytes }).build(|b| {
        let step = b.program_id(2)?;
        let zero = b.index(0)?;
        // First every chunk's loads and chunk-local terms (no stores yet, so that the compiler
        // may run a later chunk's terms beside an earlier chunk's state update), then the state
        // updates in chunk order.
        let mut local = Vec::new();
        // Batch-first beta: the mask of this step's head among the `H` lanes of its rows.
        let head_column = if beta_rows {
            let head = b.program_id(0)?;
            let head = b.broadcast(&head, &[C, d.heads])?;
            let ids = b.iota(&[C, d.heads], 1)?;
            Some((b.compare(Cmp::Eq, &ids, &head)?, b.splat(0.0, DType::F32, &[C, d.heads])?))
        } else {
            None
        };
        for ci in 0..n {
            let c = if n == 1 {
                step.clone()
            } else {
                let (nv, iv) = (b.index(n)?, b.index(ci)?);
                let base = b.index_op(Binary::Mul, &step, &nv)?;
                b.index_op(Binary::Add, &base, &iv)?
            };
            // Input `i` (of the five per-token inputs) as f32 [64, w]: its block, or the rows
            // `off .. off + 64` of its window's two blocks.
            let window = if packed {
                let off = b.read_table(Window::OFF, &c)?;
                let len = b.read_table(Window::LEN, &c)?;
                Some((off, len))
            } else {
                None
            };
            let f32_2d = |b: &mut Body, i: usize, w: i64| {
                let block = |b: &mut Body, at: usize| {
                    let rows = [Offset::Const(0), Offset::Const(ci * C), Offset::Const(0)];
                    let x = b.load(Ref::Input(at), &rows, &[1, C, w])?;
                    let x = if x.ty.elem == DType::F32 { x } else { b.cast(&x, DType::F32)? };
                    b.reshape(&x, &[C, w])
                };
                match &window {
                    None => block(b, i),
                    Some((off, _)) => {
                        let buf = Ref::Scratch(2 + i);
                        for half in 0..2 {
                            let x = block(b, 2 * i + half)?;
                            b.store(buf, &[Offset::Const(half as i64 * C), Offset::Const(0)], &x)?;
                        }
                        b.load(buf, &[Offset::Dyn(off.clone(), 1), Offset::Const(0)], &[C, w])
                    }
                }
            };
            // `x` with the rows from a packed chunk's `len` on zero.
            let keep = |b: &mut Body, x: &V| -> Result<V> {
                match &window {
                    None => Ok(x.clone()),
                    Some((_, len)) => {
                        let rows = b.iota(&x.ty.dims, 0)?;
                        let len = b.broadcast(len, &x.ty.dims)?;
                        let inside = b.compare(Cmp::Lt, &rows, &len)?;
                        let zero = b.splat(0.0, DType::F32, &x.ty.dims)?;
                        b.select(&inside, x, &zero)
                    }
                }
            };
            let beta = if let Some((mine, zero)) = &head_column {
                // Head `h`'s column of the rows `[64, H]`: the others zeroed, then a lane sum
                // (exact: one term).
                let rows =
                    b.load(Ref::Input(4), &[Offset::Const(ci * C), Offset::Const(0)], &[C, d.heads])?;
                let rows = if rows.ty.elem == DType::F32 { rows } else { b.cast(&rows, DType::F32)? };
                let picked = b.select(mine, &rows, zero)?;
                b.reduce(Reduction::Sum, &picked, 1)?
            } else {
                f32_2d(b, 4, 1)?
            };
            let (mut q, mut kk, vv, g) =
                (f32_2d(b, 0, k)?, f32_2d(b, 1, k)?, f32_2d(b, 2, v)?, f32_2d(b, 3, k)?);
            if d.l2norm {
                q = l2_normalise(b, &q)?;
                kk = l2_normalise(b, &kk)?;
            }
            // Rows past a packed chunk's tokens: k, v, beta and the activated g zero (no part in
            // the state, a decay of 1); q as read (each row of q reaches only its own row of
            // `o`, and those rows are dropped).
            let (kk, vv, beta) = (keep(b, &kk)?, keep(b, &vv)?, keep(b, &beta)?);
            let g = activate(b, &g, d.gate, per_token)?;
            let g = keep(b, &g)?;
            let scratch = TermScratch::of_kernel(masks_input);
            let terms = chunk_terms(b, &q, &kk, &g, &beta, scale, scratch, p, g_passes)?;
            let bv = b.broadcast(&beta, &[C, v])?;
            let bv = b.binary(Binary::Mul, &vv, &bv)?;
            local.push((c, terms, bv));
        }
        // The inverses side by side (each a chain of dependent products), then `u` and `w`.
        let inverses = local
            .iter()
            .map(|(_, t, _)| unit_lower_inverse_of_parts(b, &t.l_blocks, &t.l_rest, &t.f.eye, p))
            .collect::<Result<Vec<_>>>()?;
        let mut steps = Vec::new();
        for (ci, ((c, terms, bv), a)) in local.into_iter().zip(inverses).enumerate() {
            if d.terms {
                let at = [Offset::Const(0), Offset::Const(ci as i64), Offset::Const(0), Offset::Const(0)];
                for (i, x) in [&a, &terms.aqk].into_iter().enumerate() {
                    let x = if d.mask_dtype() == DType::F32 { x.clone() } else { b.cast(x, d.mask_dtype())? };
                    let x = b.reshape(&x, &[1, 1, C, C])?;
                    b.store(Ref::Output(out_terms + i), &at, &x)?;
                }
            }
            let u = b.matmul(&a, &bv, (1, 0), p)?;
            let w = b.matmul(&a, &terms.f.kbg, (1, 0), p)?;
            steps.push((c, terms, u, w));
        }
        let start = |b: &mut Body| {
            if d.h0 {
                let h0 = b.load_all(Ref::Input(h0_input))?;
                b.reshape(&h0, &[k, v])
            } else {
                b.splat(0.0, DType::F32, &[k, v])
            }
        };
        let mut carried: Option<V> = None;
        for (ci, (c, terms, u, w)) in (0..n).zip(steps) {
            let first = b.read_table(0, &c)?;
            // The state entering the chunk: fixed-length rows carry it as a value from the
            // step's previous chunk, or select it at the step's first (the row's first chunk
            // starts from `h0`; no branch, so that a step's chunks schedule as one block);
            // segments reset it under a branch.
            let s = if let Some(prev) = &carried {
                prev.clone()
            } else if fixed_rows {
                let prev = b.load_all(Ref::Scratch(0))?;
                let h0 = start(b)?;
                let wide = b.broadcast(&first, &[k, v])?;
                let no = b.splat(0.0, DType::I32, &[k, v])?;
                let reset = b.compare(Cmp::Ne, &wide, &no)?;
                b.select(&reset, &h0, &prev)?
            } else {
                let at_first = b.compare(Cmp::Ne, &first, &zero)?;
                b.when(&at_first, |b| {
                    let h0 = start(b)?;
                    b.store_all(Ref::Scratch(0), &h0)
                })?;
                b.load_all(Ref::Scratch(0))?
            };
            if d.states {
                let h = if d.state_dtype() == DType::F32 { s.clone() } else { b.cast(&s, d.state_dtype())? };
                let h = b.reshape(&h, &[1, 1, k, v])?;
                let at = [Offset::Const(0), Offset::Const(ci), Offset::Const(0), Offset::Const(0)];
                b.store(out_h, &at, &h)?;
            }
            let ws = b.matmul(&w, &s, (1, 0), p)?;
            let v_new = b.binary(Binary::Sub, &u, &ws)?;
            let inter = b.matmul(&terms.f.qg, &s, (1, 0), p)?;
            let sc = b.splat(scale, DType::F32, &[C, v])?;
            let inter = b.binary(Binary::Mul, &inter, &sc)?;
            let intra = b.matmul(&terms.aqk, &v_new, (1, 0), p)?;
            let o = b.binary(Binary::Add, &inter, &intra)?;
            if packed {
                let t = |b: &mut Body, i: usize| b.read_table(i, &c);
                let tables = [t(b, Window::LO)?, t(b, Window::HI)?, t(b, Window::OFF)?, t(b, Window::LEN)?];
                place(b, Ref::Output(0), Ref::Scratch(7), &o, &tables)?;
            } else {
                let o = if x == DType::F32 { o } else { b.cast(&o, x)? };
                let o = b.reshape(&o, &[1, C, v])?;
                b.store(Ref::Output(0), &[Offset::Const(0), Offset::Const(ci * C), Offset::Const(0)], &o)?;
            }
            let decay = b.reshape(&terms.f.eg_last, &[k, 1])?;
            let decay = b.broadcast(&decay, &[k, v])?;
            let kept = b.binary(Binary::Mul, &s, &decay)?;
            let add = b.matmul(&terms.f.kg, &v_new, (0, 0), p)?;
            let s_next = b.binary(Binary::Add, &kept, &add)?;
            if fixed_rows {
                // A row's final state: its last chunk's, the last write to its `ht` block.
                if ci + 1 == n {
                    b.store_all(Ref::Scratch(0), &s_next)?;
                    if d.ht {
                        let ht = b.reshape(&s_next, &[1, 1, k, v])?;
                        b.store_all(out_ht, &ht)?;
                    }
                }
                carried = Some(s_next);
            } else {
                b.store_all(Ref::Scratch(0), &s_next)?;
                if d.ht {
                    let last = b.read_table(1, &c)?;
                    let at_last = b.compare(Cmp::Ne, &last, &zero)?;
                    b.when(&at_last, |b| {
                        let ht = b.reshape(&s_next, &[1, 1, k, v])?;
                        b.store_all(out_ht, &ht)
                    })?;
                }
            }
        }
        Ok(())
    })
}

/// Writes a packed chunk's rows `x` `[64, w]` (f32: `o`, or a gradient) to its tokens in the head's result
/// block `out`: `x` goes to rows `64 .. 128` of `buf` (`[192, w]`), whose rows from `64 - off`
/// and from `128 - off` are the chunk's rows as they fall in its blocks `lo` and `hi`; each
/// block takes them where its tokens are the chunk's (read, select, write, `lo` first: with
/// `hi = lo` the second write keeps the first's rows). Nothing else of `buf` is ever selected,
/// and tokens no chunk holds (padding) are left as they are: the caller zeroes them.
pub(super) fn place(b: &mut Body, out: Ref, buf: Ref, x: &V, [lo, hi, off, len]: &[V; 4]) -> Result<()> {
    let w = x.ty.dims[1];
    b.store(buf, &[Offset::Const(C), Offset::Const(0)], x)?;
    let rows = b.iota(&[C, w], 0)?;
    let wide = |b: &mut Body, i: &V| b.broadcast(i, &[C, w]);
    let (c64, c128) = (b.index(C)?, b.index(2 * C)?);
    let end = b.index_op(Binary::Add, off, len)?;
    for (block, from) in [(lo, &c64), (hi, &c128)] {
        let start = b.index_op(Binary::Sub, from, off)?;
        let part = b.load(buf, &[Offset::Dyn(start, 1), Offset::Const(0)], &[C, w])?;
        // Token `64 block + r` is the chunk's when `off <= r + (64 if hi) < off + len`.
        let base = b.index_op(Binary::Sub, from, &c64)?;
        let first = b.index_op(Binary::Sub, off, &base)?;
        let last = b.index_op(Binary::Sub, &end, &base)?;
        let (first, last) = (wide(b, &first)?, wide(b, &last)?);
        let after = b.compare(Cmp::Ge, &rows, &first)?;
        let before = b.compare(Cmp::Lt, &rows, &last)?;
        let row0 = b.index_op(Binary::Mul, block, &c64)?;
        let at = [Offset::Const(0), Offset::Dyn(row0, C), Offset::Const(0)];
        let old = b.load(out, &at, &[1, C, w])?;
        let old = b.reshape(&old, &[C, w])?;
        let new = b.select(&before, &part, &old)?;
        let new = b.select(&after, &new, &old)?;
        let new = b.reshape(&new, &[1, C, w])?;
        b.store(out, &at, &new)?;
    }
    Ok(())
}

/// `x * rsqrt(sum(x^2) + eps)` over the rows of `x` `[64, K]` (the XLA programs' L2 norm).
pub(super) fn l2_normalise(b: &mut Body, x: &V) -> Result<V> {
    Ok(l2_normalise_with_scale(b, x)?.0)
}

/// [`l2_normalise`] and its per-row scale `rsqrt(sum(x^2) + eps)` `[64, 1]`.
pub(super) fn l2_normalise_with_scale(b: &mut Body, x: &V) -> Result<(V, V)> {
    let dims = x.ty.dims.clone();
    let sq = b.binary(Binary::Mul, x, x)?;
    let ss = b.reduce(Reduction::Sum, &sq, 1)?;
    let eps = b.splat(kda_core::L2NORM_EPS, DType::F32, &[dims[0], 1])?;
    let ss = b.binary(Binary::Add, &ss, &eps)?;
    let r = b.unary(Unary::Rsqrt, &ss)?;
    let wide = b.broadcast(&r, &dims)?;
    Ok((b.binary(Binary::Mul, x, &wide)?, r))
}

/// The activated, floored log-decay of the raw gate `x` `[64, K]`; the gate parameters (if
/// any) are input `params` (`[1, 2, K]`: `exp(a_log)`, `dt_bias`).
pub(super) fn activate(b: &mut Body, x: &V, gate: Gate, params: usize) -> Result<V> {
    let dims = x.ty.dims.clone();
    let g = match gate {
        Gate::Preactivated => x.clone(),
        Gate::Softplus | Gate::LowerBound(_) => {
            let row = |b: &mut Body, i: i64| {
                let at = [Offset::Const(0), Offset::Const(i), Offset::Const(0)];
                let r = b.load(Ref::Input(params), &at, &[1, 1, dims[1]])?;
                b.reshape(&r, &[1, dims[1]])
            };
            let (a, bias) = (row(b, 0)?, row(b, 1)?);
            let a = b.broadcast(&a, &dims)?;
            let bias = b.broadcast(&bias, &dims)?;
            let z = b.binary(Binary::Add, x, &bias)?;
            match gate {
                Gate::Softplus => {
                    // softplus(z) = max(z, 0) + log1p(exp(-|z|)), exact and overflow-free.
                    let zero = b.splat(0.0, DType::F32, &dims)?;
                    let pos = b.binary(Binary::Max, &z, &zero)?;
                    let nz = b.unary(Unary::Neg, &z)?;
                    let neg_abs = b.binary(Binary::Min, &z, &nz)?;
                    let e = b.unary(Unary::Exp, &neg_abs)?;
                    let l = b.unary(Unary::Log1p, &e)?;
                    let sp = b.binary(Binary::Add, &pos, &l)?;
                    let g = b.binary(Binary::Mul, &a, &sp)?;
                    b.unary(Unary::Neg, &g)?
                }
                _ => {
                    let lb = if let Gate::LowerBound(lb) = gate { lb } else { 0.0 };
                    // lb * sigmoid(a z) = lb/2 + lb/2 tanh(a z / 2): one transcendental.
                    let half_a = b.splat(0.5, DType::F32, &dims)?;
                    let half_a = b.binary(Binary::Mul, &a, &half_a)?;
                    let x = b.binary(Binary::Mul, &half_a, &z)?;
                    let t = b.unary(Unary::Tanh, &x)?;
                    let half_lb = b.splat(lb / 2.0, DType::F32, &dims)?;
                    let scaled = b.binary(Binary::Mul, &t, &half_lb)?;
                    b.binary(Binary::Add, &scaled, &half_lb)?
                }
            }
        }
    };
    let floor = b.splat(FLOOR, DType::F32, &dims)?;
    b.binary(Binary::Max, &g, &floor)
}
