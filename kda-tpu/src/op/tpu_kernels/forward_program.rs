//! The forward program around the Mosaic forward kernel ([`mod@super::forward`]): the same
//! signature as the XLA forward, so the backend, the compile cache and the backward read it
//! unchanged. The kernel reads the caller's tensors as they are (fixed-length rows of whole
//! chunks, [`Tokens::HeadFirst`] and [`Tokens::BatchFirst`]; packed rows of whole 64-token
//! blocks through windows, [`Tokens::PackedHeadFirst`] and [`Tokens::PackedBatchFirst`]) and
//! applies the L2 norm, the gate and its floor itself, so nothing of the size of the inputs is
//! made before it; otherwise XLA makes lanes first (a transpose, the padding of T to whole
//! chunks, or the gather of packed segments into chunk-aligned work, in the inputs' own
//! dtypes). After the kernel: `o` in the caller's layout (in place; packed, its padding tokens
//! zeroed with the cast; or back from lanes) and the final states of segments that hold no
//! chunk (their initial states).

use super::dims::{KernelDims, Tokens};
use super::forward::forward_kernel;
use super::operands::{ChunkTabs, PerToken, TokenIn};
use crate::hlo::{Cmp, FnBuilder, Value};
use crate::lang::{Bindings, Lower, Ref};
use crate::op::args::{state_tab, Args, ChunkTables};
use crate::op::hlo_ops::{i32t, splat};
use crate::op::prep;
use crate::op::spec::{on_device, ProgramSpec, CHUNK};
use crate::Result;
use kda_core::{GateKind, Layout};

/// A per-token tensor in the caller's layout to head-first `[H, B, T, D]`, in its own dtype.
pub(in crate::op) fn lanes_first(b: &mut FnBuilder, s: &ProgramSpec, x: Value) -> Result<Value> {
    match s.options.layout {
        Layout::HeadFirst => Ok(x),
        Layout::BatchFirst => prep::heads_outermost(b, s, x),
    }
}

/// Head-first `[H, B, T, D]` to the kernel's `[L, NT * 64, D]` (packed: gathered by `slot_token`).
pub(in crate::op) fn kernel_tokens(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    x: Value,
    slot_token: Option<Value>,
) -> Result<Value> {
    let d = x.dims()[3];
    let c = prep::to_chunks(b, s, x, slot_token)?;
    b.reshape(c, &[s.lanes() as i64, (s.chunks() * CHUNK) as i64, d])
}

/// The slot table the kernels read: `slot` itself for fixed length (all zeros), else its
/// [`running_max`].
pub(in crate::op) fn kernel_slots(b: &mut FnBuilder, s: &ProgramSpec, slot: Value) -> Result<Value> {
    match s.packed_chunks {
        None => Ok(slot),
        Some(_) => running_max(b, slot),
    }
}

/// `slot` with every entry raised to the largest before it: the real chunks' slots never
/// decrease, and the padding chunks after them (slot 0 in the tables) then keep the last
/// segment's slot, so the kernel's `ht` block is never revisited.
pub(in crate::op) fn running_max(b: &mut FnBuilder, slot: Value) -> Result<Value> {
    let n = slot.dims()[0];
    let at = b.iota(i32t(&[n, n]), 0)?;
    let before = b.iota(i32t(&[n, n]), 1)?;
    let seen = b.compare(Cmp::Le, before, at)?;
    let wide = b.broadcast_in_dim(slot, &[n, n], &[1])?;
    let zero = b.constant_i32(0, i32t(&[n, n]))?;
    let kept = b.select(seen, wide, zero)?;
    b.reduce_max(kept, &[1])
}

/// The kernel's per-slot state table `state` where some chunk ended the slot's segment, else
/// `passed` (zeros when `None`): a segment without chunks passes its starting state straight
/// through (`h0` to `ht` forward, `dht` to `dh0` backward).
pub(in crate::op) fn or_passed(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    tables: &ChunkTables,
    state: Value,
    passed: Option<Value>,
) -> Result<Value> {
    let passed = match passed {
        Some(p) => p,
        None => state_tab(b, s, None)?,
    };
    let ended = ended(b, s, tables.last, tables.slot)?;
    let ended = b.broadcast_in_dim(ended, state.dims(), &[1])?;
    b.select(ended, state, passed)
}

/// `[S]` i1: whether a chunk ends a segment of each state slot.
fn ended(b: &mut FnBuilder, s: &ProgramSpec, last: Value, slot: Value) -> Result<Value> {
    let (nt, slots) = (s.chunks() as i64, s.slots() as i64);
    let ids = b.iota(i32t(&[nt, slots]), 1)?;
    let at = b.broadcast_in_dim(slot, &[nt, slots], &[0])?;
    let mine = b.compare(Cmp::Eq, ids, at)?;
    let ends = b.broadcast_in_dim(last, &[nt, slots], &[0])?;
    let zero = b.constant_i32(0, i32t(&[nt, slots]))?;
    let hit = b.select(mine, ends, zero)?;
    let any = b.reduce_max(hit, &[0])?;
    let zero = b.constant_i32(0, i32t(&[slots]))?;
    b.compare(Cmp::Gt, any, zero)
}

/// Whether the kernels read a packed spec's rows as one row of whole 64-token blocks with
/// segment ids ([`KernelDims::segments`]): packed tokens filling whole blocks, no per-segment
/// states in or out, the tuning's [`TpuKernelConfig::packed_blocks`](crate::op::TpuKernelConfig::packed_blocks)
/// and a nonzero result budget (0 sends every packed row through lanes).
pub(super) fn segment_blocks(s: &ProgramSpec) -> bool {
    let p = s.dims.b * s.dims.t;
    let states = s.options.has_h0 || s.options.final_state || s.options.has_dht;
    s.packed_chunks.is_some()
        && s.tuning.tpu_kernels.packed_blocks
        && s.tuning.tpu_kernels.packed_result_bytes > 0
        && !states
        && p.is_multiple_of(CHUNK)
        && (p as i64) < super::dims::SEGMENT_ID_LIMIT
}

/// How the kernel reads the caller's tokens: in place when rows have a fixed length of whole
/// chunks, or are packed into whole 64-token blocks (as one fixed row with segment ids,
/// [`segment_blocks`], or through windows); batch-first only when each head's K and V lanes are
/// whole 128-lane tiles, or H = 1; else through lanes that XLA makes (padded to whole chunks).
pub(super) fn tokens_of(s: &ProgramSpec) -> Tokens {
    let tiles = s.dims.h == 1 || (s.dims.k.is_multiple_of(128) && s.dims.v.is_multiple_of(128));
    if segment_blocks(s) {
        match (s.options.layout, tiles) {
            (Layout::HeadFirst, _) => return Tokens::HeadFirst,
            (Layout::BatchFirst, true) => return Tokens::BatchFirst,
            _ => {}
        }
    }
    if s.packed_chunks.is_some() {
        // A head's `o` stays in VMEM (f32, double-buffered) while its chunks place their rows.
        if !packed_fits(s, s.dims.v) {
            return Tokens::Lanes;
        }
        return match ((s.dims.b * s.dims.t).is_multiple_of(CHUNK), s.options.layout) {
            (true, Layout::HeadFirst) => Tokens::PackedHeadFirst,
            (true, Layout::BatchFirst) if tiles => Tokens::PackedBatchFirst,
            _ => Tokens::Lanes,
        };
    }
    match (s.dims.t.is_multiple_of(CHUNK), s.options.layout) {
        (true, Layout::HeadFirst) => Tokens::HeadFirst,
        (true, Layout::BatchFirst) if tiles => Tokens::BatchFirst,
        _ => Tokens::Lanes,
    }
}

/// A per-token input as the kernel reads it: in place (a free reshape) or as lanes.
pub(super) fn kernel_input(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    x: Value,
    tokens: Tokens,
    slot_token: Option<Value>,
    d: i64,
) -> Result<Value> {
    let (h, bb, t) = (s.dims.h as i64, s.dims.b as i64, s.dims.t as i64);
    let (rows, per_row) = if s.packed_chunks.is_some() { (1, bb * t) } else { (bb, t) };
    match tokens {
        Tokens::HeadFirst | Tokens::PackedHeadFirst => b.reshape(x, &[h, bb * t, d]),
        Tokens::BatchFirst => b.reshape(x, &[rows, per_row, h * d]),
        Tokens::PackedBatchFirst => b.reshape(x, &[1, bb * t, h * d]),
        Tokens::Lanes => {
            let x = lanes_first(b, s, x)?;
            kernel_tokens(b, s, x, slot_token)
        }
    }
}

/// The tables of a packed row read as whole blocks ([`segment_blocks`]), `[first, last, slot,
/// segments]`: per 64-token block whether a segment starts at its first token and whether one
/// ends at its last (i32 `[P / 64]`), the slots (zeros: no per-segment states), and each
/// token's segment id (f32 `[P / 64, 1, 64]`: `token_segment`, and `-1 - p` for padding token `p`, so
/// that each is a segment of its own).
pub(super) fn segment_tables(b: &mut FnBuilder, s: &ProgramSpec, a: &Args) -> Result<[Value; 4]> {
    let (c, p) = (CHUNK as i64, (s.dims.b * s.dims.t) as i64);
    let blocks = p / c;
    let segment = a.token_segment.ok_or_else(|| {
        crate::TpuError::builder("mosaic kernels", "a packed program without token_segment")
    })?;
    let zero = b.constant_i32(0, i32t(&[p]))?;
    let real = b.compare(Cmp::Ge, segment, zero)?;
    let own = b.iota(i32t(&[p]), 0)?;
    let minus_one = b.constant_i32(-1, i32t(&[p]))?;
    let own = b.sub(minus_one, own)?;
    let id = b.select(real, segment, own)?;
    // Per block: its first and last tokens' ids against its neighbours'.
    let rows = b.reshape(id, &[blocks, c])?;
    let head = b.slice(rows, &[0, 0], &[blocks, 1], &[1, 1])?;
    let head = b.reshape(head, &[blocks])?;
    let tail = b.slice(rows, &[0, c - 1], &[blocks, c], &[1, 1])?;
    let tail = b.reshape(tail, &[blocks])?;
    let edge = b.constant_i32(i32::MIN, i32t(&[1]))?;
    let before = b.slice(tail, &[0], &[blocks - 1], &[1])?;
    let before = b.concatenate(&[edge, before], 0)?;
    let after = b.slice(head, &[1], &[blocks], &[1])?;
    let after = b.concatenate(&[after, edge], 0)?;
    let flag = |b: &mut FnBuilder, x: Value, y: Value| -> Result<Value> {
        let differ = b.compare(Cmp::Ne, x, y)?;
        let one = b.constant_i32(1, i32t(&[blocks]))?;
        let zero = b.constant_i32(0, i32t(&[blocks]))?;
        b.select(differ, one, zero)
    };
    let first = flag(b, head, before)?;
    let last = flag(b, tail, after)?;
    let slot = b.constant_i32(0, i32t(&[blocks]))?;
    let ids = b.convert(id, kda_core::DType::F32)?;
    let ids = b.reshape(ids, &[blocks, 1, c])?;
    Ok([first, last, slot, ids])
}

/// The window tables of a packed kernel ([`super::operands::WindowTables`]) from `slot_token`
/// (`[NT * 64]`, the packed token of each chunk row, `B * T` on padding rows): `lo hi off len`.
pub(super) fn window_tables(b: &mut FnBuilder, s: &ProgramSpec, slot_token: Value) -> Result<[Value; 4]> {
    let (nt, c, p) = (s.chunks() as i64, CHUNK as i64, (s.dims.b * s.dims.t) as i64);
    let blocks = p / c;
    let rows = b.reshape(slot_token, &[nt, c])?;
    let start = b.reduce_min(rows, &[1])?;
    let pad = b.constant_i32(p as i32, i32t(&[nt, c]))?;
    let real = b.compare(Cmp::Lt, rows, pad)?;
    let one = b.constant_i32(1, i32t(&[nt, c]))?;
    let zero = b.constant_i32(0, i32t(&[nt, c]))?;
    let real = b.select(real, one, zero)?;
    let len = b.reduce_sum(real, &[1])?;
    let scalar = |b: &mut FnBuilder, v: i64| -> Result<Value> {
        let x = b.constant_i32(v as i32, i32t(&[]))?;
        b.broadcast_in_dim(x, &[nt], &[])
    };
    let (cv, last) = (scalar(b, c)?, scalar(b, blocks - 1)?);
    let block = b.div(start, cv)?;
    let lo = b.min(block, last)?;
    let one = scalar(b, 1)?;
    let next = b.add(lo, one)?;
    let hi = b.min(next, last)?;
    let base = b.mul(lo, cv)?;
    let off = b.sub(start, base)?;
    let off = b.min(off, cv)?;
    Ok([lo, hi, off, len])
}

/// The kernel's gate parameters `[H, 2, K]`: `exp(a_log)` on every channel, then `dt_bias`.
pub(in crate::op) fn gate_operand(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a_log: Value,
    dt_bias: Option<Value>,
) -> Result<Value> {
    let (h, k) = (s.dims.h as i64, s.dims.k as i64);
    let a = b.exp(a_log)?;
    let a = b.broadcast_in_dim(a, &[h, 1, k], &[0])?;
    let bias = match dt_bias {
        Some(d) => b.reshape(d, &[h, 1, k])?,
        None => splat(b, 0.0, &[h, 1, k])?,
    };
    b.concatenate(&[a, bias], 1)
}

/// The kernel's per-token inputs `q k v g beta` as `tokens` reads them, with the dtype of `g`
/// (the raw gate, or for lanes the gate XLA activated).
pub(super) fn token_inputs(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    tokens: Tokens,
) -> Result<(PerToken<Value>, kda_core::DType)> {
    let q = kernel_input(b, s, a.q, tokens, a.slot_token, s.dims.k as i64)?;
    let k = kernel_input(b, s, a.k, tokens, a.slot_token, s.dims.k as i64)?;
    let v = kernel_input(b, s, a.v, tokens, a.slot_token, s.dims.v as i64)?;
    // Lanes get the gate XLA activated ([`kernel_gate`]).
    let g = match (tokens, a.a_log) {
        (Tokens::Lanes, Some(al)) => {
            let gx = prep::head_first(b, s, a.g)?;
            let p = prep::gate_params(b, s, al, a.dt_bias, gx.dims())?;
            let g = prep::activate(b, s, gx, Some(&p))?;
            kernel_tokens(b, s, g, a.slot_token)?
        }
        _ => kernel_input(b, s, a.g, tokens, a.slot_token, s.dims.k as i64)?,
    };
    let g_dtype = g.elem();
    let mut beta_dims: Vec<i64> =
        s.options.layout.scalar_shape(s.dims.h, s.dims.b, s.dims.t).iter().map(|&d| d as i64).collect();
    beta_dims.push(1);
    let beta = b.reshape(a.beta, &beta_dims)?;
    let beta = match tokens {
        // Batch-first rows read in place: beta as the programs take it, `[B*T, H]`.
        Tokens::BatchFirst => b.reshape(beta, &[(s.dims.b * s.dims.t) as i64, s.dims.h as i64])?,
        Tokens::Lanes => {
            let beta = lanes_first(b, s, beta)?;
            kernel_tokens(b, s, beta, a.slot_token)?
        }
        _ => {
            let beta = lanes_first(b, s, beta)?;
            b.reshape(beta, &[s.dims.h as i64, (s.dims.b * s.dims.t) as i64, 1])?
        }
    };
    Ok((PerToken { q, k, v, g, beta }, g_dtype))
}

/// Whether results of `width` lanes per packed token fit [`TpuKernelConfig::packed_result_bytes`](crate::op::TpuKernelConfig::packed_result_bytes).
pub(super) fn packed_fits(s: &ProgramSpec, width: usize) -> bool {
    2 * 4 * s.dims.b * s.dims.t * width <= s.tuning.tpu_kernels.packed_result_bytes
}

/// A packed program's `token_slot` (the chunk row of each packed token; padding tokens point
/// past the last row).
pub(super) fn packed_slots(a: &Args) -> Result<Value> {
    a.token_slot
        .ok_or_else(|| crate::TpuError::builder("mosaic kernels", "a packed program without token_slot"))
}

/// A kernel's packed result (f32, tokens along axis 1: `[H, P, w]` or batch-first
/// `[1, P, H * w]`) with its padding tokens, which no chunk writes, zeroed, in `dtype`.
pub(super) fn packed_result(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    y: Value,
    token_slot: Value,
    dtype: kda_core::DType,
) -> Result<Value> {
    let pad = b.constant_i32((s.chunks() * CHUNK) as i32, i32t(&[]))?;
    let pad = b.broadcast_in_dim(pad, token_slot.dims(), &[])?;
    let real = b.compare(Cmp::Lt, token_slot, pad)?;
    let keep = b.broadcast_in_dim(real, y.dims(), &[1])?;
    let zero = b.constant_f32(0.0, crate::hlo::TensorType::new(y.elem(), y.dims()))?;
    let y = b.select(keep, y, zero)?;
    if y.elem() == dtype {
        Ok(y)
    } else {
        b.convert(y, dtype)
    }
}

/// The kernels' dims of `s` read as `tokens` with `g` in `g_dtype` (one chunk a step, no state
/// operands or results: the caller sets those).
pub(super) fn kernel_dims(s: &ProgramSpec, tokens: Tokens, g_dtype: kda_core::DType) -> KernelDims {
    let x = on_device(s.options.dtype);
    // Segment ids: one row of the packed tokens' blocks, no state slots.
    let segments = tokens != Tokens::Lanes && !tokens.packed() && s.packed_chunks.is_some();
    let (chunks, slots) = if segments {
        (((s.dims.b * s.dims.t) / CHUNK) as i64, 1)
    } else {
        (s.chunks() as i64, s.slots() as i64)
    };
    KernelDims {
        heads: s.dims.h as i64,
        rows: (s.lanes() / s.dims.h) as i64,
        chunks,
        slots,
        segments,
        saved_chunks: s.chunks() as i64,
        k: s.dims.k as i64,
        v: s.dims.v as i64,
        qk: x,
        g: g_dtype,
        dtype: x,
        tokens,
        packed_tokens: (s.dims.b * s.dims.t) as i64,
        l2norm: s.options.l2norm,
        gate: kernel_gate(s, tokens),
        gate_params: s.in_kernel_gate(),
        h0: false,
        ht: false,
        states: false,
        terms: false,
        step_chunks: 1,
    }
}

/// The gate the kernel applies: the caller's when it reads raw gates in place (lanes hold
/// padding tokens, whose zero raw gate would activate to a decay, so lanes get the gate XLA
/// activated, zero on padding, as the XLA programs have it).
pub(super) fn kernel_gate(s: &ProgramSpec, tokens: Tokens) -> GateKind {
    match (tokens != Tokens::Lanes && s.in_kernel_gate(), s.options.gate) {
        (false, _) | (_, GateKind::Preactivated) => GateKind::Preactivated,
        (true, GateKind::Softplus) => GateKind::Softplus,
        (true, GateKind::LowerBound(lb)) => GateKind::LowerBound(lb),
    }
}

/// The chunk terms' constant masks ([`super::terms::term_masks_kernel`]'s results)
/// and how the program's kernels are lowered: what every kernel call of a program shares.
pub(super) struct KernelCalls<'l> {
    /// How the kernels are lowered.
    pub lowering: &'l dyn Lower,
    /// The exponent masks.
    pub exponents: Value,
    /// The level masks.
    pub levels: Value,
    /// The exponent masks' transposes (for the backward kernel).
    pub exponents_t: Option<Value>,
}

/// Which kernels of a program read the chunk terms' masks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MaskReaders {
    /// The forward kernel alone.
    Forward,
    /// The forward and backward kernels: the exponent masks' transposes too.
    ForwardAndBackward,
}

/// The masks for the kernels of `s`, made once by their own one-step kernel; for the backward
/// kernel also the exponent masks' transposes (a program with both kernels makes them once and
/// hands the first two to the forward kernel).
pub(super) fn kernel_calls<'l>(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    readers: MaskReaders,
    lowering: &'l dyn Lower,
) -> Result<KernelCalls<'l>> {
    // The masks' dtype follows the kernels' products, whatever the gate's dtype.
    let dims = kernel_dims(s, tokens_of(s), on_device(s.options.dtype));
    let transposed = readers == MaskReaders::ForwardAndBackward;
    let masks = super::terms::term_masks_kernel(dims.mask_dtype(), transposed, dims.levels())?;
    let outs = masks.kernel.call(b, lowering, masks.kernel.bindings())?;
    let exponents_t = match masks.exponents_t {
        Some(t) => Some(outs.get(t)?),
        None => None,
    };
    Ok(KernelCalls {
        lowering,
        exponents: outs.get(masks.exponents)?,
        levels: outs.get(masks.levels)?,
        exponents_t,
    })
}

/// `dims` with the chunks a grid step takes: the tuning's wish, else the kernel's default
/// (at most `cap`).
pub(super) fn with_steps(dims: KernelDims, s: &ProgramSpec, cap: Option<i64>) -> KernelDims {
    let wish = match s.tuning.tpu_kernels.step_chunks {
        0 => cap.map_or(dims.default_step_chunks(), |c| dims.default_step_chunks().min(c)),
        n => n as i64,
    };
    KernelDims { step_chunks: dims.steps_for(wish), ..dims }
}

/// What both kernels read alike, as the program's values: the chunk tables (`first`, `last`,
/// the slots, for packed tokens read in place the window tables), `q k v g beta` (with the
/// dtype of `g`) and the gate parameters of an in-kernel gate.
pub(super) struct SharedInputs {
    first: Value,
    last: Value,
    slot: Value,
    window: Option<[Value; 4]>,
    segments: Option<Value>,
    tokens: PerToken<Value>,
    gate: Option<Value>,
    /// The dtype of `g` as the kernel reads it.
    pub g_dtype: kda_core::DType,
}

impl SharedInputs {
    /// The values for a kernel of `s` reading `tokens` (`what` names it in errors): the slots
    /// the kernels read ([`kernel_slots`]), the window tables from `slot_token` (or the tables
    /// of [`segment_tables`]), the per-token inputs, the gate parameters.
    pub(super) fn new(
        b: &mut FnBuilder,
        s: &ProgramSpec,
        a: &Args,
        tokens: Tokens,
        what: &str,
    ) -> Result<Self> {
        let (first, last, slot, segments) = if kernel_dims(s, tokens, s.options.dtype).segments {
            let [first, last, slot, ids] = segment_tables(b, s, a)?;
            (first, last, slot, Some(ids))
        } else {
            (a.tables.first, a.tables.last, kernel_slots(b, s, a.tables.slot)?, None)
        };
        let window = if tokens.packed() {
            let slot_token = a
                .slot_token
                .ok_or_else(|| crate::TpuError::builder(what, "a packed program without slot_token"))?;
            Some(window_tables(b, s, slot_token)?)
        } else {
            None
        };
        let (tokens_in, g_dtype) = token_inputs(b, s, a, tokens)?;
        let gate = match (kernel_gate(s, tokens) != GateKind::Preactivated, a.a_log) {
            (true, Some(al)) => Some(gate_operand(b, s, al, a.dt_bias)?),
            _ => None,
        };
        Ok(SharedInputs { first, last, slot, window, segments, tokens: tokens_in, gate, g_dtype })
    }

    /// Binds them to a kernel's tables `tabs`, per-token inputs `refs` and gate input `gate`.
    pub(super) fn bind(
        &self,
        args: &mut Bindings,
        tabs: &ChunkTabs,
        refs: &PerToken<TokenIn>,
        gate: Option<Ref>,
    ) -> Result<()> {
        args.table(tabs.first, self.first)?;
        args.table(tabs.last, self.last)?;
        args.table(tabs.slot, self.slot)?;
        if let (Some(t), Some([lo, hi, off, len])) = (tabs.window, self.window) {
            args.table(t.lo, lo)?;
            args.table(t.hi, hi)?;
            args.table(t.off, off)?;
            args.table(t.len, len)?;
        }
        if let (Some(input), Some(value)) = (tabs.segments, self.segments) {
            args.input(input, value)?;
        }
        for (input, value) in refs.each().into_iter().zip(self.tokens.each()) {
            input.bind(args, *value)?;
        }
        match (gate, self.gate) {
            (Some(input), Some(value)) => args.input(input, value),
            _ => Ok(()),
        }
    }
}

/// What a forward body keeps besides `o [final_state]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Kept {
    /// `h`, the state entering every chunk.
    pub states: bool,
    /// The chunk terms `a aqk` the backward kernel reads.
    pub terms: bool,
}

/// The forward body: `o [final_state]` as the op's signature says (`o` in the kernel forms),
/// then what `kept` names: `h`, then the chunk terms `a aqk`; the chunk loop in the forward
/// kernel, lowered and fed masks as `calls` says.
pub(super) fn forward_body(
    b: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    kept: Kept,
    calls: &KernelCalls,
) -> Result<Vec<Value>> {
    let Kept { states: keep_h, terms } = kept;
    let x = on_device(s.options.dtype);
    let tokens = tokens_of(s);
    let shared = SharedInputs::new(b, s, a, tokens, "mosaic forward")?;
    let h0 = match a.h0 {
        Some(h0) => Some(prep::state_table(b, s, h0)?),
        None => None,
    };
    let dims = kernel_dims(s, tokens, shared.g_dtype);
    // States kept for a backward in the same program (with the chunk terms) take the kernel's
    // own chunks; a saved-state forward's `h` has the signature's.
    let saved_chunks = if terms { dims.chunks } else { dims.saved_chunks };
    let dims = KernelDims {
        h0: h0.is_some(),
        ht: s.options.final_state,
        states: keep_h,
        terms,
        saved_chunks,
        ..dims
    };
    let fk = forward_kernel(with_steps(dims, s, None), s.options.scale)?;
    let r = &fk.refs;
    let mut args = fk.kernel.bindings();
    shared.bind(&mut args, &r.tabs, &r.tokens, r.gate)?;
    if let (Some(input), Some(value)) = (r.h0, h0) {
        args.input(input, value)?;
    }
    args.input(r.masks[0], calls.exponents)?;
    args.input(r.masks[1], calls.levels)?;
    let outs = fk.kernel.call(b, calls.lowering, args)?;
    let o = outs.get(r.o)?;
    let o = match tokens {
        Tokens::PackedHeadFirst | Tokens::PackedBatchFirst => {
            let slots = packed_slots(a)?;
            let o = packed_result(b, s, o, slots, x)?;
            b.reshape(o, &s.result_token_dims(s.dims.v, true))?
        }
        Tokens::Lanes => {
            let (l, nt) = (s.lanes() as i64, s.chunks() as i64);
            let o = b.reshape(o, &[l, nt, CHUNK as i64, s.dims.v as i64])?;
            let o = prep::from_chunks(b, s, o, a.token_slot)?;
            let o = prep::to_caller(b, s, o, x)?;
            b.reshape(o, &s.result_token_dims(s.dims.v, true))?
        }
        // Already in the caller's layout: the result's form is a reshape.
        _ => b.reshape(o, &s.result_token_dims(s.dims.v, true))?,
    };
    let mut results = vec![o];
    if let Some(ht) = r.ht {
        let fin = or_passed(b, s, &a.tables, outs.get(ht)?, h0)?;
        results.push(prep::state_from_table(b, s, fin)?);
    }
    if let Some(h) = r.h {
        results.push(outs.get(h)?);
    }
    if let Some(saved) = r.terms {
        for t in saved {
            results.push(outs.get(t)?);
        }
    }
    Ok(results)
}

/// The forward on the kernels: `o [final_state] [h]`.
pub(in crate::op) fn forward(
    f: &mut FnBuilder,
    s: &ProgramSpec,
    a: &Args,
    keep_h: bool,
    lowering: &dyn Lower,
) -> Result<Vec<Value>> {
    let calls = kernel_calls(f, s, MaskReaders::Forward, lowering)?;
    let kept = Kept { states: keep_h, terms: false };
    forward_body(f, s, a, kept, &calls)
}
