//! The dims and options of the KDA kernels, what both the forward and the backward kernel are
//! built for: how the per-token operands hold their tokens, the gate, the widths and dtypes,
//! and the chunks a grid step takes.

use kda_core::{DType, GateKind};

use super::terms::Levels;
use crate::error::{Result, TpuError};
use crate::lang::{MatPrecision, Schedule};

pub(super) use super::super::chunk::C;

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
    /// from `start[c]`, read through the two aligned 64-token blocks around them (`WindowTables`);
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

/// The gate the kernels apply to `g`, under its earlier name: [`kda_core::GateKind`] (with
/// `Softplus` or `LowerBound` the per-head `exp(a_log)` and `dt_bias` come as the operand `gate`
/// `[H, 2, K]`: row 0 `exp(a_log[h])` on every channel, row 1 `dt_bias[h, :]`).
#[deprecated(since = "0.3.0", note = "use kda_core::GateKind")]
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
pub type Gate = kda_core::GateKind;

/// The kernels' dims under their earlier name.
#[deprecated(since = "0.3.0", note = "renamed KernelDims: the forward and the backward kernel read them")]
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
pub type ForwardDims = KernelDims;

/// The dims and options of one forward kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KernelDims {
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
    /// Whether one row of whole 64-token blocks holds packed segments, read as a fixed-length
    /// row ([`Tokens::HeadFirst`] or [`Tokens::BatchFirst`], `rows = 1`): an operand `segments`
    /// `[NT, 1, 64]` f32 names each token's segment (negative for padding tokens), and
    /// the boundaries inside a chunk are masks (terms only within a segment, the entering state
    /// only for the chunk's first segment, the leaving state only from its last) with the state
    /// reset where the `first` table marks a segment's first token at a chunk's first row. No
    /// per-segment `h0` or `ht` (those rows take the windows of [`Tokens::PackedHeadFirst`]).
    pub segments: bool,
    /// Chunk entries of the saved states `h` and chunk terms (their operands' second dim):
    /// `chunks`, or with [`KernelDims::segments`] the packed plan's chunk count (the programs'
    /// signature), of which the first `chunks` are written.
    pub saved_chunks: i64,
    /// Whether the kernel L2-normalises q and k over K.
    pub l2norm: bool,
    /// The gate applied to `g`.
    pub gate: GateKind,
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
    /// `[L, NT, 64, 64]` in [`KernelDims::mask_dtype`]: what the backward kernel reads
    /// instead of forming them again).
    pub terms: bool,
    /// Chunks per grid step: a divisor of `chunks`, above one only for fixed-length rows read in
    /// place ([`KernelDims::steps_for`] picks one). A step forms all its chunks' terms before
    /// their state updates, so that the compiler overlaps them, and pays the step's own
    /// bookkeeping once.
    pub step_chunks: i64,
}

impl KernelDims {
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
        let segments_ok = self.fixed_rows()
            && self.rows == 1
            && !self.h0
            && !self.ht
            && self.slots == 1
            && self.chunks * C < SEGMENT_ID_LIMIT;
        if self.segments && !segments_ok {
            return Err(TpuError::unsupported(
                what,
                format!(
                    "segments read as one row of whole blocks without per-segment states, under \
                     {SEGMENT_ID_LIMIT} tokens ({self:?})"
                ),
            ));
        }
        let saved = self.states || self.terms;
        if self.saved_chunks < self.chunks || (saved && self.saved_chunks % n != 0) {
            return Err(TpuError::unsupported(
                what,
                format!("saved chunk entries for every chunk, whole steps of them ({self:?})"),
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

    /// How `beta` is read: as the tokens, but head-first in place for batch-first tokens (a
    /// packed window's `[H, P, 1]`, or fixed rows' `[R * T, H]` columns).
    pub(super) fn beta_tokens(&self) -> Tokens {
        match self.tokens {
            Tokens::Lanes => Tokens::Lanes,
            Tokens::PackedHeadFirst | Tokens::PackedBatchFirst => Tokens::PackedHeadFirst,
            _ => Tokens::HeadFirst,
        }
    }

    pub(super) fn lanes(&self) -> i64 {
        self.heads * self.rows
    }

    /// The precision of the kernel's products: f32 inputs keep f32 products (the MXU at full
    /// precision); bf16 inputs run them in one bf16 pass with f32 accumulation, as their inputs'
    /// precision allows (docs/kda.md, Accuracy: 2e-2), but for the sums of `g`
    /// ([`super::terms::chunk_terms`]).
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

    /// Chunks per grid step ([`KernelDims::step_chunks`]).
    pub fn chunks_per_step(&self) -> i64 {
        self.step_chunks
    }

    /// The chunks per grid step for a wish of `at_most`: the largest power of two up to it that
    /// divides the chunk count (and, with saved states or terms, their chunk entries
    /// [`KernelDims::saved_chunks`]), for fixed-length rows read in place
    /// ([`KernelDims::fixed_rows`]); one otherwise (packed windows).
    pub fn steps_for(&self, at_most: i64) -> i64 {
        if !self.fixed_rows() {
            return 1;
        }
        let saved = self.states || self.terms;
        let divides = |m: i64| self.chunks % m == 0 && (!saved || self.saved_chunks % m == 0);
        let mut n = 1;
        while n * 2 <= at_most.max(1) && divides(n * 2) {
            n *= 2;
        }
        n
    }

    /// The default wish for [`KernelDims::steps_for`]: [`STREAMED_STEP_CHUNKS`] when the
    /// per-token operands are too large for XLA to place them in VMEM (it streams them from HBM
    /// then, and each grid step pays DMA bookkeeping for every operand), while a step's double-buffered blocks stay within
    /// [`STEP_BLOCK_BYTES`]; else [`RESIDENT_STEP_CHUNKS`] (a step's other chunks' terms
    /// overlap each chunk's state update).
    pub fn default_step_chunks(&self) -> i64 {
        let bytes = |t: DType| i64::from(t.bit_width() / 8);
        // Bytes of one token of one lane through q, k, v, g, beta and o (and one chunk's state).
        let token =
            2 * self.k * bytes(self.qk) + self.k * bytes(self.g) + (2 * self.v + 1) * bytes(self.dtype);
        let operands = self.lanes() * self.chunks * C * token;
        if operands <= STREAMED_BYTES {
            return RESIDENT_STEP_CHUNKS;
        }
        // A chunk's blocks; a kernel that saves its chunk terms (the fused program's forward)
        // writes its states in their dtype and the terms beside them, and asks for more VMEM
        // ([`Self::vmem_limit`]).
        let (per_chunk, budget) = if self.terms {
            let saved = bytes(self.state_dtype()) * self.k * self.v + 2 * C * C * bytes(self.mask_dtype());
            (C * token + saved, TERMS_STEP_BLOCK_BYTES)
        } else {
            (C * token + if self.states { 4 * self.k * self.v } else { 0 }, STEP_BLOCK_BYTES)
        };
        let mut n = STREAMED_STEP_CHUNKS;
        while n > 2 && 2 * n * per_chunk > budget {
            n /= 2;
        }
        n
    }

    /// The Mosaic op order of a kernel that keeps at most `in_flight` of a step's chunks in
    /// flight: the list schedule, windowed when a step has more chunks
    /// (docs/kernels/op-order.md).
    pub fn schedule(&self, in_flight: u32) -> Schedule {
        let of = u32::try_from(self.chunks_per_step()).unwrap_or(u32::MAX);
        if of > in_flight {
            Schedule::Windowed { ahead: in_flight, of }
        } else {
            Schedule::List
        }
    }

    /// The scoped VMEM the forward kernel asks for beyond the default: when it saves its chunk
    /// terms [`TERMS_VMEM_BYTES`] on more than sixteen chunks a step, else
    /// [`RESIDENT_TERMS_VMEM_BYTES`]; [`SEGMENT_VMEM_BYTES`] for segment masks on more than
    /// sixteen chunks; otherwise none.
    pub fn vmem_limit(&self) -> Option<i64> {
        let wide = self.step_chunks > 16;
        if self.terms {
            Some(if wide { TERMS_VMEM_BYTES } else { RESIDENT_TERMS_VMEM_BYTES })
        } else {
            (self.segments && wide).then_some(SEGMENT_VMEM_BYTES)
        }
    }

    /// The bf16 parts the kernels' sums of `g` take ([`super::terms::chunk_terms`]): a
    /// pre-activated bf16 g is bf16 after the floor, and one pass sums it exactly.
    pub fn g_passes(&self) -> usize {
        if self.g == DType::BF16 && self.gate == GateKind::Preactivated {
            1
        } else {
            2
        }
    }

    /// The dtype of the per-chunk states `h`: with the chunk terms ([`KernelDims::terms`],
    /// states that only the backward kernel reads) [`KernelDims::mask_dtype`], since the
    /// backward's one-pass products round them to it anyway; else f32 (the caller's `h`).
    pub fn state_dtype(&self) -> DType {
        if self.terms {
            self.mask_dtype()
        } else {
            DType::F32
        }
    }

    /// The levels of the chunk terms under the kernel's gate ([`Levels::for_gate`]).
    pub fn levels(&self) -> Levels {
        Levels::for_gate(self.gate)
    }

    /// The dtype of the exponent masks the kernel reads
    /// ([`super::terms::term_masks_kernel`]): bf16 for one-pass products, else f32.
    pub fn mask_dtype(&self) -> DType {
        match self.precision() {
            MatPrecision::Default => DType::BF16,
            _ => DType::F32,
        }
    }
}

/// Per-token operand bytes above which [`KernelDims::default_step_chunks`] takes XLA to stream
/// them from HBM: more than a TensorCore's 64 MiB of VMEM cannot stay there (the primary
/// shape's operands are placed in VMEM, H=32, T=8192's stream).
pub const STREAMED_BYTES: i64 = 64 << 20;

/// Chunks per grid step when the operands stay in VMEM: the most the static counts fell to at
/// the primary shape (docs/performance.md, Design figures). The Mosaic lowering's op order is
/// what lets a long step pay (docs/kernels/op-order.md): written chunk by chunk, sixteen count
/// more than four.
pub const RESIDENT_STEP_CHUNKS: i64 = 16;

/// Chunks per grid step when the operands stream from HBM: the most the static counts fell to
/// at H=32, T=8192 (docs/performance.md, Design figures).
pub const STREAMED_STEP_CHUNKS: i64 = 32;

/// The scoped VMEM the forward kernel asks for on packed rows read with segment masks whose
/// operands stream ([`KernelDims::vmem_limit`]): their masks' live values take more of it, and
/// at H=32, T=8192 with 25 segments (bf16) a step of [`STREAMED_STEP_CHUNKS`] needs more than
/// v5e's 16 MiB default (every TPU generation has at least 64 MiB of VMEM).
pub const SEGMENT_VMEM_BYTES: i64 = 32 << 20;

/// The bound on one grid step's double-buffered per-token blocks (and saved states) that
/// [`KernelDims::default_step_chunks`] keeps to, well inside the default scoped VMEM.
pub const STEP_BLOCK_BYTES: i64 = 8 << 20;

/// The bound of [`STEP_BLOCK_BYTES`] for a kernel that saves its chunk terms and states (the
/// fused program's forward): twice the other kernels', so that bf16 streamed rows take
/// [`STREAMED_STEP_CHUNKS`] a step, which count fewer cycles than sixteen (docs/performance.md,
/// Figures behind the code's constants).
pub const TERMS_STEP_BLOCK_BYTES: i64 = 16 << 20;

/// The scoped VMEM a kernel that saves its chunk terms asks for on steps of more than sixteen
/// chunks ([`KernelDims::vmem_limit`]).
pub const TERMS_VMEM_BYTES: i64 = 48 << 20;

/// The scoped VMEM a kernel that saves its chunk terms asks for on sixteen chunks a step or
/// fewer: f32 at the primary shape passes v5p's default. More lets libtpu move the program's
/// buffers into VMEM, which costs cycles.
pub const RESIDENT_TERMS_VMEM_BYTES: i64 = 32 << 20;

/// Tokens of a row read with segment ids ([`KernelDims::segments`]): the ids are f32, exact
/// below 2^24.
pub const SEGMENT_ID_LIMIT: i64 = 1 << 24;

/// The largest key or value width of the kernel (docs/kda.md, Shapes).
pub const MAX_WIDTH: i64 = 256;
