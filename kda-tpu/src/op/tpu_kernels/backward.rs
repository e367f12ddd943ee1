//! The chunked KDA backward as one Mosaic kernel (docs/kda.md, Chunks, the backward): the
//! grid of the forward kernel (heads, rows: parallel; chunks: arbitrary) walked from each row's
//! last chunk to its first, `dh` (the gradient of the state after the chunk) in VMEM scratch.
//! Per chunk it forms the chunk factors again ([`super::blocks::chunk_factors`]; `A` and `Aqk`
//! as the forward kernel saved them, or formed again too), the WY solve and `v_new = u - w S0`
//! from the state `S0` entering the chunk (saved by the forward kernel), forms
//! every gradient of the chunk and writes it once, and steps `dh` back:
//! `dh <- e^(G_C) dh + scale qg^T dO - w^T dv_new`.
//!
//! The gradients through `Aqk` and `L` follow the forward's levels: each level is
//! `(x fr) (k fc)^T` kept on its mask, so its cotangent gives `x` and `k` their terms and the
//! exponent arrays of `fr` and `fc` theirs; every exponent array is a coefficient mask times
//! `g`, so `dg` is one product of the masks' transposes with the exponent gradients stacked.
//! The `e^(G_C - G)` of `kg` enters through the strict-suffix mask (an exclusive prefix sum:
//! every term decayed to the chunk's end) and `e^(G_C)` as a per-chunk constant, and the
//! diagonal of `Aqk` goes to `dq` and `dk` directly, so no exact cancellation is left to f32
//! (docs/design.md, "The Mosaic backward kernel"). Then through the floor, the gate (whose
//! parameter gradients are summed per lane over the chunks) and the L2 norm. Packed tokens are
//! read through the forward's windows and every gradient goes straight to its packed tokens
//! ([`super::forward::place`]).

use kda_core::DType;

use super::blocks::{
    by_halves, chunk_factors, chunk_terms, unit_lower_inverse_of_parts, ChunkFactors, TermScratch,
    EXPONENT_ROWS, HALVES, LEVEL_ROWS,
};
use super::forward::{
    activate, l2_normalise_with_scale, place, token_operand, ForwardDims, Gate, Tokens, Window, C, FLOOR,
};
use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType};
use crate::lang::{Binary, Body, MatPrecision, Offset, Reduction, Ref, Unary, V};
use crate::lang::{Cost, Index, Kernel, Operand};

/// The most chunks a backward grid step takes by default (the forward's default, capped): a
/// fixed-length row's step is one block, whose spill slots grow with its chunks (at H=32,
/// T=8192 sixteen chunks took 19.3 MB of VMEM and 6.49 M static cycles for the fused
/// forward+VJP, eight 9.7 MB and 6.45 M).
pub const BACKWARD_STEP_CHUNKS: i64 = 8;

/// The backward kernel of `d` (the dims of the forward kernel that saved the states, with its
/// own chunks per step) with scale `scale`. Its operands: the tables `first`, `last`, `slot`
/// (`slot` as the forward kernel's; packed tokens read in place add the window tables), then
/// `q k v g beta [gate] h [a aqk] do [dht] exponent_masks level_masks exponent_masks_t` (as the
/// forward kernel's; `h` the states it saved in [`ForwardDims::state_dtype`], `a` and `aqk`
/// its chunk terms when `d.terms`,
/// `do` laid out as `v`, `dht` `[L, S, K, V]` f32 when `d.ht`, the masks those of
/// [`super::blocks::term_masks_kernel`] with its transposes); its results
/// `dq dk dv dg dbeta [dh0] [gate_sums]`: the gradients laid out as their inputs (`dbeta` f32,
/// a chunk's 64 tokens a row, `[L, NT, 64]`; `dg` that of the raw gate; packed tokens read in
/// place: f32, each head's whole (`dbeta` `[H, P, 1]`), padding tokens unwritten), `dh0` `[L, S, K, V]`
/// f32 when `d.h0` (written at each segment's first chunk), and with an in-kernel gate
/// `gate_sums` `[L, 2, K]` f32: per lane the sums over its tokens of `dg dg/da_log` and of the
/// raw gate's gradient (`da_log` and `ddt_bias` once summed over a head's lanes).
pub fn backward_kernel(d: ForwardDims, scale: f64) -> Result<Kernel> {
    d.check("mosaic backward")?;
    let packed = d.tokens.packed();
    let n = d.chunks_per_step();
    let (h, r, l, nt, k, v, x) = (d.heads, d.rows, d.heads * d.rows, d.chunks, d.k, d.v, d.dtype);
    let (g0, g1, g2) = (Index::Grid(0), Index::Grid(1), Index::Grid(2));
    let lane = || g0.clone() * r + g1.clone();
    // Grid step `i` holds the chunks of block `nt / n - 1 - i`, walked from its last.
    let rev = || Index::Const(nt / n - 1) + g2.clone() * -1;
    let slot = || vec![lane(), Index::table(2, rev() * n), Index::Const(0), Index::Const(0)];
    let ty = |dt: DType, dims: &[i64]| TensorType::new(dt, dims);
    let gated = d.gate != Gate::Preactivated;
    let beta_tokens = d.beta_tokens();
    let beta_rows = d.tokens == Tokens::BatchFirst;
    let mut kb = d.builder("kda_backward");
    // Each per-token input: one operand, or a packed window's two blocks.
    let windows = d.windows();
    let per = windows.len();
    for (name, dtype, w) in [("q", d.qk, k), ("k", d.qk, k), ("v", x, v), ("g", d.g, k)] {
        for &table in windows {
            kb = kb.input(token_operand(name, &d, d.tokens, dtype, w, table, true));
        }
    }
    for &table in windows {
        kb = kb.input(if beta_rows {
            let at = vec![g1.clone() * (nt / n) + rev(), Index::Const(0)];
            Operand::blocked("beta", ty(x, &[r * nt * C, h]), &[n * C, h], at)
        } else {
            token_operand("beta", &d, beta_tokens, x, 1, table, true)
        });
    }
    let gate_input = 5 * per;
    if gated {
        let at = vec![g0.clone(), Index::Const(0), Index::Const(0)];
        kb = kb.input(Operand::blocked("gate", ty(DType::F32, &[h, 2, k]), &[1, 2, k], at));
    }
    let h_input = gate_input + usize::from(gated);
    let at = vec![lane(), rev(), Index::Const(0), Index::Const(0)];
    kb = kb.input(Operand::blocked("h", ty(d.state_dtype(), &[l, nt, k, v]), &[1, n, k, v], at));
    let mut at_terms = None;
    if d.terms {
        at_terms = Some(h_input + 1);
        let at = vec![lane(), rev(), Index::Const(0), Index::Const(0)];
        for name in ["a", "aqk"] {
            kb = kb.input(Operand::blocked(
                name,
                ty(d.mask_dtype(), &[l, nt, C, C]),
                &[1, n, C, C],
                at.clone(),
            ));
        }
    }
    let do_input = h_input + 1 + 2 * usize::from(d.terms);
    for &table in windows {
        kb = kb.input(token_operand("do", &d, d.tokens, x, v, table, true));
    }
    let dht_input = do_input + per;
    if d.ht {
        kb = kb.input(Operand::blocked("dht", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()));
    }
    let masks_input = dht_input + usize::from(d.ht);
    kb = kb.input(Operand::whole("exponent_masks", ty(d.mask_dtype(), &[EXPONENT_ROWS, C])));
    kb = kb.input(Operand::whole("level_masks", ty(DType::F32, &[LEVEL_ROWS, C])));
    kb = kb.input(Operand::whole("exponent_masks_t", ty(d.mask_dtype(), &[C, EXPONENT_ROWS])));
    let grads = [("dq", d.qk, k), ("dk", d.qk, k), ("dv", x, v), ("dg", d.g, k), ("dbeta", x, 1)];
    for (name, dtype, w) in grads {
        kb = kb.output(if packed {
            // A head's packed tokens whole, in f32: every chunk's rows go to their tokens, and
            // the block is written back once, after the head's last chunk (padding tokens hold
            // whatever was there: the caller zeroes them).
            let p = d.packed_tokens;
            let (dims, at) = match d.tokens {
                Tokens::PackedBatchFirst if w > 1 => {
                    ([1, p, h * w], vec![Index::Const(0), Index::Const(0), g0.clone()])
                }
                _ => ([h, p, w], vec![g0.clone(), Index::Const(0), Index::Const(0)]),
            };
            Operand::blocked(name, ty(DType::F32, &dims), &[1, p, w], at)
        } else if w == 1 {
            // `dbeta` lane-dense in f32, a chunk's 64 tokens a row, `[L, NT, 64]` (the elements
            // of `[H, R * T]` in order; a `[.., T, 1]` result took XLA about 1,200 bundles to
            // relayout at the primary shape): a lane's rows whole, resident through its walk.
            let at = vec![lane(), Index::Const(0), Index::Const(0)];
            Operand::blocked(name, ty(DType::F32, &[l, nt, C]), &[1, nt, C], at)
        } else {
            token_operand(name, &d, d.tokens, dtype, w, 0, true)
        });
    }
    if d.h0 {
        kb = kb.output(Operand::blocked("dh0", ty(DType::F32, &[l, d.slots, k, v]), &[1, 1, k, v], slot()));
    }
    let sums_output = 5 + usize::from(d.h0);
    if gated {
        let at = vec![lane(), Index::Const(0), Index::Const(0)];
        kb = kb.output(Operand::blocked("gate_sums", ty(DType::F32, &[l, 2, k]), &[1, 2, k], at));
    }
    // docs/kda.md, Work: the forward's chunk terms again, about twice their products for the
    // gradients; every operand and result once through HBM.
    let (cf, kf, vf, t) = (C as f64, k as f64, v as f64, (l * nt * C) as f64);
    let flops = t * 3.0 * (6.0 * cf * kf + 4.0 * cf * vf + 6.0 * kf * vf + 2.0 / 3.0 * cf * cf);
    let bytes_of = |t: DType| f64::from(t.bit_width() / 8);
    let bytes = t * 2.0 * (2.0 * kf * bytes_of(d.qk) + (2.0 * vf + 1.0) * bytes_of(x) + kf * bytes_of(d.g))
        + (l * k * v) as f64 * 4.0 * (nt + d.slots * (i64::from(d.h0) + i64::from(d.ht))) as f64;
    let transcendentals = t * kf * 8.0;
    kb = kb.scratch("dh", ty(DType::F32, &[k, v])).scratch("sums", ty(DType::F32, &[C, k]));
    // Packed: each input's window (its two blocks side by side, f32; scratch 2 to 7), then per
    // gradient width the rows a chunk places around its tokens (scratch 8 to 10).
    if packed {
        let inputs = [("q_window", k), ("k_window", k), ("v_window", v), ("g_window", k), ("beta_window", 1)];
        for (name, w) in inputs.into_iter().chain([("do_window", v)]) {
            kb = kb.scratch(name, ty(DType::F32, &[2 * C, w]));
        }
        for (name, w) in [("place_k", k), ("place_v", v), ("place_1", 1)] {
            kb = kb.scratch(name, ty(DType::F32, &[3 * C, w]));
        }
    }
    let p = d.precision();
    let g_passes = if d.g == DType::BF16 && !gated { 1 } else { 2 };
    kb.cost(Cost { flops, transcendentals, bytes }).build(|b| {
        let step = b.program_id(2)?;
        let (zero, end) = (b.index(0)?, b.index(nt / n - 1)?);
        let block = b.index_op(Binary::Sub, &end, &step)?;
        // A row's walk starts with no gradient (padding chunks after its segments hold none);
        // each segment's from `dht` of its slot at its last chunk. Fixed-length rows have one
        // segment, whose last chunk is the walk's first: `dht` is read there and no chunk
        // branches (a branch keeps the scheduler from overlapping a step's chunks: at H=32,
        // T=8192 the fused forward+VJP counts 7.11 M static cycles with a branch a chunk, 6.83 M
        // without).
        let one_block = d.fixed_rows();
        let dht_at = |b: &mut Body| -> Result<V> {
            if d.ht {
                let x = b.load_all(Ref::Input(dht_input))?;
                b.reshape(&x, &[k, v])
            } else {
                b.splat(0.0, DType::F32, &[k, v])
            }
        };
        let starts = b.compare(Cmp::Eq, &step, &zero)?;
        b.when(&starts, |b| {
            let z = if one_block { dht_at(b)? } else { b.splat(0.0, DType::F32, &[k, v])? };
            b.store_all(Ref::Scratch(0), &z)?;
            if gated {
                let z = b.splat(0.0, DType::F32, &[1, 2, k])?;
                b.store_all(Ref::Output(sums_output), &z)?;
            }
            Ok(())
        })?;
        // The step's chunks from its last: chunk `c = n block + ci` at rows `64 ci` of its blocks.
        // One block: `dh` passes from chunk to chunk of a step as a value, through scratch only
        // between steps.
        let mut carried: Option<V> = None;
        for ci in (0..n).rev() {
            let c = {
                let (nv, iv) = (b.index(n)?, b.index(ci)?);
                let base = b.index_op(Binary::Mul, &block, &nv)?;
                b.index_op(Binary::Add, &base, &iv)?
            };
            if !one_block {
                let last = b.read_table(1, &c)?;
                let at_last = b.compare(Cmp::Ne, &last, &zero)?;
                b.when(&at_last, |b| {
                    let dht = dht_at(b)?;
                    b.store_all(Ref::Scratch(0), &dht)
                })?;
            }
            let dh = match carried.take() {
                Some(dh) => dh,
                None => b.load_all(Ref::Scratch(0))?,
            };
            // Packed: the chunk's window in its two blocks (`off`, `len`), and the blocks of its
            // tokens (`lo`, `hi`).
            let window = if packed {
                let t = |b: &mut Body, i: usize| b.read_table(i, &c);
                Some([t(b, Window::LO)?, t(b, Window::HI)?, t(b, Window::OFF)?, t(b, Window::LEN)?])
            } else {
                None
            };
            // Per-token input `i` (q k v g beta do) as f32 `[64, w]` from its operand(s) at `at`:
            // its block, or rows `off .. off + 64` of its window's two blocks.
            let token = |b: &mut Body, i: usize, at: usize, w: i64| -> Result<V> {
                let block = |b: &mut Body, at: usize| -> Result<V> {
                    let rows = [Offset::Const(0), Offset::Const(ci * C), Offset::Const(0)];
                    let x = b.load(Ref::Input(at), &rows, &[1, C, w])?;
                    let x = if x.ty.elem == DType::F32 { x } else { b.cast(&x, DType::F32)? };
                    b.reshape(&x, &[C, w])
                };
                match &window {
                    None => block(b, at),
                    Some([_, _, off, _]) => {
                        let buf = Ref::Scratch(2 + i);
                        for half in 0..2 {
                            let x = block(b, at + half)?;
                            b.store(buf, &[Offset::Const(half as i64 * C), Offset::Const(0)], &x)?;
                        }
                        b.load(buf, &[Offset::Dyn(off.clone(), 1), Offset::Const(0)], &[C, w])
                    }
                }
            };
            // `x` with the rows from a packed chunk's `len` on zero (the next segment's tokens).
            let keep = |b: &mut Body, x: &V| -> Result<V> {
                match &window {
                    None => Ok(x.clone()),
                    Some([_, _, _, len]) => {
                        let rows = b.iota(&x.ty.dims, 0)?;
                        let len = b.broadcast(len, &x.ty.dims)?;
                        let inside = b.compare(Cmp::Lt, &rows, &len)?;
                        let zero = b.splat(0.0, DType::F32, &x.ty.dims)?;
                        b.select(&inside, x, &zero)
                    }
                }
            };
            let beta = if beta_rows {
                let head = b.program_id(0)?;
                let head = b.broadcast(&head, &[C, h])?;
                let ids = b.iota(&[C, h], 1)?;
                let mine = b.compare(Cmp::Eq, &ids, &head)?;
                let rows = b.load(Ref::Input(4), &[Offset::Const(ci * C), Offset::Const(0)], &[C, h])?;
                let rows = if rows.ty.elem == DType::F32 { rows } else { b.cast(&rows, DType::F32)? };
                let none = b.splat(0.0, DType::F32, &[C, h])?;
                let picked = b.select(&mine, &rows, &none)?;
                b.reduce(Reduction::Sum, &picked, 1)?
            } else {
                token(b, 4, 4 * per, 1)?
            };
            let (q_in, k_in) = (token(b, 0, 0, k)?, token(b, 1, per, k)?);
            let (vv, gx) = (token(b, 2, 2 * per, v)?, token(b, 3, 3 * per, k)?);
            let d_o = token(b, 5, do_input, v)?;
            // Rows past a packed chunk's tokens: k, v, beta, do and the activated g zero (no part
            // in the state or the gradients; q's rows meet only zero cotangents).
            let (k_in, vv, beta, d_o) = (keep(b, &k_in)?, keep(b, &vv)?, keep(b, &beta)?, keep(b, &d_o)?);
            let (q, q_scale) =
                if d.l2norm { split(l2_normalise_with_scale(b, &q_in)?) } else { (q_in, None) };
            let (kk, k_scale) =
                if d.l2norm { split(l2_normalise_with_scale(b, &k_in)?) } else { (k_in, None) };
            let g = activate(b, &gx, d.gate, gate_input)?;
            let g = keep(b, &g)?;
            let scratch = TermScratch::of_kernel(masks_input);
            // The chunk's `A` and `Aqk`: as the forward kernel saved them, or formed again.
            let (t, a, aqk) = match at_terms {
                Some(at) => {
                    let f = chunk_factors(b, &q, &kk, &g, &beta, scratch, p, g_passes)?;
                    let saved = |b: &mut Body, i: usize| -> Result<V> {
                        let at4 = [Offset::Const(0), Offset::Const(ci), Offset::Const(0), Offset::Const(0)];
                        let x = b.load(Ref::Input(at + i), &at4, &[1, 1, C, C])?;
                        b.reshape(&x, &[C, C])
                    };
                    let (a, aqk) = (saved(b, 0)?, saved(b, 1)?);
                    (f, a, aqk)
                }
                None => {
                    let t = chunk_terms(b, &q, &kk, &g, &beta, scale, scratch, p, g_passes)?;
                    let a = unit_lower_inverse_of_parts(b, &t.l_blocks, &t.l_rest, &t.f.eye, p)?;
                    (t.f, a, t.aqk)
                }
            };
            let wide_beta = b.broadcast(&beta, &[C, v])?;
            let bv = b.binary(Binary::Mul, &vv, &wide_beta)?;
            let u = mm(b, &a, &bv, (1, 0), p)?;
            let w = mm(b, &a, &t.kbg, (1, 0), p)?;
            let at4 = [Offset::Const(0), Offset::Const(ci), Offset::Const(0), Offset::Const(0)];
            let s0 = b.load(Ref::Input(h_input), &at4, &[1, 1, k, v])?;
            let s0 = if s0.ty.elem == DType::F32 { s0 } else { b.cast(&s0, DType::F32)? };
            let s0 = b.reshape(&s0, &[k, v])?;
            let ws = b.matmul(&w, &s0, (1, 0), p)?;
            let vn = b.binary(Binary::Sub, &u, &ws)?;
            // dv_new = Aqk^T dO + kg dh; dh_prev = e^(G_C) dh + scale qg^T dO - w^T dv_new.
            let dvn = {
                // One product: [Aqk^T, kg] [dO; dh].
                let op = aqk.ty.elem;
                let at = b.transpose(&aqk)?;
                let kg = if t.kg.ty.elem == op { t.kg.clone() } else { b.cast(&t.kg, op)? };
                let lhs = b.concat(&[at, kg], 1)?;
                let d_o_op = if d_o.ty.elem == op { d_o.clone() } else { b.cast(&d_o, op)? };
                let dh_op = if dh.ty.elem == op { dh.clone() } else { b.cast(&dh, op)? };
                let rhs = b.concat(&[d_o_op, dh_op], 0)?;
                b.matmul(&lhs, &rhs, (1, 0), p)?
            };
            // `scale dO`, for `dh` and for `Aqk`'s cotangent.
            let sd_o = mul_const(b, &d_o, scale)?;
            let dh_prev = {
                let decay = b.reshape(&t.eg_last, &[k, 1])?;
                let decay = b.broadcast(&decay, &[k, v])?;
                let kept = b.binary(Binary::Mul, &dh, &decay)?;
                // Both products as one over the stacked tokens: [qg; w]^T [scale dO; -dv_new].
                let lhs = b.concat(&[t.qg.clone(), w.clone()], 0)?;
                let ndvn = b.unary(Unary::Neg, &dvn)?;
                let rhs = b.concat(&[sd_o.clone(), ndvn], 0)?;
                let x = b.matmul(&lhs, &rhs, (0, 0), p)?;
                b.binary(Binary::Add, &kept, &x)?
            };
            if one_block && ci > 0 {
                carried = Some(dh_prev.clone());
            } else {
                b.store_all(Ref::Scratch(0), &dh_prev)?;
            }
            // Without branches (fixed-length rows): each step's last chunk writes `dh0`'s block,
            // which stays resident through the row's walk and holds the row's first chunk's
            // when it goes to HBM.
            if d.h0 && one_block && ci == 0 {
                let x = b.reshape(&dh_prev, &[1, 1, k, v])?;
                b.store_all(Ref::Output(5), &x)?;
            }
            let grads = chunk_grads(
                b,
                &d,
                [&q, &kk, &vv, &beta],
                &t,
                [&a, &vn],
                [&s0, &dh, &dvn, &sd_o],
                Ref::Input(masks_input + 2),
            )?;
            let dg = grads.dg;
            let every = b.broadcast(&grads.d_last, &[C, k])?;
            let dg = b.binary(Binary::Add, &dg, &every)?;
            let floor = b.splat(FLOOR, DType::F32, &[C, k])?;
            let live = b.compare(Cmp::Gt, &g, &floor)?;
            let none = b.splat(0.0, DType::F32, &[C, k])?;
            let dg = b.select(&live, &dg, &none)?;
            // A packed chunk's rows past its tokens hold the gradient of their zeroed gate: not a
            // token's, and kept out of the gate parameters' sums.
            let dg = keep(b, &dg)?;
            let dx = if gated {
                let (dz, dlog) = gate_slopes(b, &gx, d.gate, gate_input)?;
                let dx = b.binary(Binary::Mul, &dg, &dz)?;
                let dl = b.binary(Binary::Mul, &dg, &dlog)?;
                // Column sums (a reduction over the rows: no product, whose full precision would
                // take six MXU passes), added to the lane's running sums row by row.
                for (i, x) in [&dl, &dx].into_iter().enumerate() {
                    let sum = b.reduce(Reduction::Sum, x, 0)?;
                    let sum = b.reshape(&sum, &[1, 1, k])?;
                    let at = [Offset::Const(0), Offset::Const(i as i64), Offset::Const(0)];
                    let before = b.load(Ref::Output(sums_output), &at, &[1, 1, k])?;
                    let after = b.binary(Binary::Add, &before, &sum)?;
                    b.store(Ref::Output(sums_output), &at, &after)?;
                }
                dx
            } else {
                dg
            };
            let dq = match &q_scale {
                Some(rs) => l2_backward(b, &grads.dq, &q, rs)?,
                None => grads.dq,
            };
            let dk = match &k_scale {
                Some(rs) => l2_backward(b, &grads.dk, &kk, rs)?,
                None => grads.dk,
            };
            let results = [dq, dk, grads.dv, dx, grads.dbeta];
            match &window {
                None => {
                    for (i, x) in results.iter().enumerate() {
                        if x.ty.dims[1] == 1 {
                            // The column as a row: its entries on the diagonal, summed down the
                            // columns (one term each: exact), at the chunk's row.
                            let wide = b.broadcast(x, &[C, C])?;
                            let diag = b.binary(Binary::Mul, &wide, &t.eye)?;
                            let row = b.reduce(Reduction::Sum, &diag, 0)?;
                            let row = b.reshape(&row, &[1, 1, C])?;
                            let at = [Offset::Const(0), Offset::Dyn(c.clone(), 1), Offset::Const(0)];
                            b.store(Ref::Output(i), &at, &row)?;
                            continue;
                        }
                        let out_ty = b_out_elem(i, &d);
                        let x = if out_ty == DType::F32 { x.clone() } else { b.cast(x, out_ty)? };
                        let w = x.ty.dims[1];
                        let x = b.reshape(&x, &[1, C, w])?;
                        let rows = [Offset::Const(0), Offset::Const(ci * C), Offset::Const(0)];
                        b.store(Ref::Output(i), &rows, &x)?;
                    }
                }
                Some(tables) => {
                    for (i, x) in results.iter().enumerate() {
                        let buf = match x.ty.dims[1] {
                            w if w == k => 8,
                            w if w == v => 9,
                            _ => 10,
                        };
                        place(b, Ref::Output(i), Ref::Scratch(buf), x, tables)?;
                    }
                }
            }
            // Else `dh0` at each segment's first chunk, written last (a branch there would split
            // the chunk's work in two).
            if d.h0 && !one_block {
                let first = b.read_table(0, &c)?;
                let at_first = b.compare(Cmp::Ne, &first, &zero)?;
                b.when(&at_first, |b| {
                    let x = b.reshape(&dh_prev, &[1, 1, k, v])?;
                    b.store_all(Ref::Output(5), &x)
                })?;
            }
        }
        Ok(())
    })
}

/// The element type of gradient result `i` (`dq dk dv dg dbeta`).
fn b_out_elem(i: usize, d: &ForwardDims) -> DType {
    match i {
        0 | 1 => d.qk,
        3 => d.g,
        _ => d.dtype,
    }
}

/// `x y` at `p`, a saved bf16 operand against an f32 one in one bf16 pass (as `p` runs it).
fn mm(b: &mut Body, x: &V, y: &V, contract: (usize, usize), p: MatPrecision) -> Result<V> {
    let (x, y) = match (x.ty.elem, y.ty.elem) {
        (DType::BF16, DType::F32) => (x.clone(), b.cast(y, DType::BF16)?),
        (DType::F32, DType::BF16) => (b.cast(x, DType::BF16)?, y.clone()),
        _ => (x.clone(), y.clone()),
    };
    b.matmul(&x, &y, contract, p)
}

fn split((y, r): (V, V)) -> (V, Option<V>) {
    (y, Some(r))
}

fn mul_const(b: &mut Body, x: &V, c: f64) -> Result<V> {
    let s = b.splat(c, DType::F32, &x.ty.dims)?;
    b.binary(Binary::Mul, x, &s)
}

fn wide(b: &mut Body, x: &V, dims: &[i64]) -> Result<V> {
    b.broadcast(x, dims)
}

/// `sum over the rows' last axis of x y`, `[64, 1]`.
fn rowdot(b: &mut Body, x: &V, y: &V) -> Result<V> {
    let p = b.binary(Binary::Mul, x, y)?;
    b.reduce(Reduction::Sum, &p, 1)
}

/// Through `y = x rsqrt(sum(x^2) + eps)` with `r` the per-row scale: `r (dy - y sum(dy y))`.
fn l2_backward(b: &mut Body, dy: &V, y: &V, r: &V) -> Result<V> {
    let dims = y.ty.dims.clone();
    let dot = rowdot(b, dy, y)?;
    let dot = wide(b, &dot, &dims)?;
    let t = b.binary(Binary::Mul, y, &dot)?;
    let dd = b.binary(Binary::Sub, dy, &t)?;
    let r = wide(b, r, &dims)?;
    b.binary(Binary::Mul, &dd, &r)
}

/// `(dg/dx, dg/da_log)` of the activated gate at the raw gate `x` `[64, K]` (parameters in input
/// `params`, as [`activate`] reads them). Softplus, `g = -a softplus(z)`: `-a sigmoid(z)` and
/// `g`; the lower bound, `g = lb sigmoid(y)`, `y = a z`: `lb s (1 - s) a` and `lb s (1 - s) y`,
/// with `s (1 - s) = e / (1 + e)^2`, `e = e^(-|y|)`, exact where `s` saturates.
fn gate_slopes(b: &mut Body, x: &V, gate: Gate, params: usize) -> Result<(V, V)> {
    let dims = x.ty.dims.clone();
    let row = |b: &mut Body, i: i64| {
        let at = [Offset::Const(0), Offset::Const(i), Offset::Const(0)];
        let r = b.load(Ref::Input(params), &at, &[1, 1, dims[1]])?;
        let r = b.reshape(&r, &[1, dims[1]])?;
        b.broadcast(&r, &dims)
    };
    let (a, bias) = (row(b, 0)?, row(b, 1)?);
    let z = b.binary(Binary::Add, x, &bias)?;
    let one = b.splat(1.0, DType::F32, &dims)?;
    // e = e^(-|y|) of `y`, and 1 + e.
    let tail = |b: &mut Body, y: &V| -> Result<(V, V)> {
        let ny = b.unary(Unary::Neg, y)?;
        let neg_abs = b.binary(Binary::Min, y, &ny)?;
        let e = b.unary(Unary::Exp, &neg_abs)?;
        let one_e = b.binary(Binary::Add, &one, &e)?;
        Ok((e, one_e))
    };
    match gate {
        Gate::Softplus => {
            let (e, one_e) = tail(b, &z)?;
            // sigmoid(z): 1 / (1 + e) for z >= 0, e / (1 + e) below.
            let zero = b.splat(0.0, DType::F32, &dims)?;
            let pos = b.compare(Cmp::Ge, &z, &zero)?;
            let top = b.select(&pos, &one, &e)?;
            let s = b.binary(Binary::Div, &top, &one_e)?;
            let dz = b.binary(Binary::Mul, &a, &s)?;
            let dz = b.unary(Unary::Neg, &dz)?;
            let g = activate(b, x, gate, params)?;
            // dg/da_log = g before the floor; below it dg is zero anyway.
            Ok((dz, g))
        }
        Gate::LowerBound(lb) => {
            let y = b.binary(Binary::Mul, &a, &z)?;
            let (e, one_e) = tail(b, &y)?;
            let sq = b.binary(Binary::Mul, &one_e, &one_e)?;
            let ds = b.binary(Binary::Div, &e, &sq)?;
            let ds = mul_const(b, &ds, lb)?;
            Ok((b.binary(Binary::Mul, &ds, &a)?, b.binary(Binary::Mul, &ds, &y)?))
        }
        Gate::Preactivated => {
            Err(TpuError::builder("mosaic backward", "gate slopes of a pre-activated gate"))
        }
    }
}

/// One chunk's gradients before the floor, the gate and the L2 norm: `dq dk` (of the normalised
/// q and k), `dv`, `dbeta`, and `dg` from the gradients of the exponent arrays (`G`, the strict
/// suffix, the mid anchor, the levels: the exponent masks' order), with that of `G_C` apart.
struct Grads {
    dq: V,
    dk: V,
    dv: V,
    dbeta: V,
    /// `sum over the exponent arrays of mask^T dE` (without `G_C`'s term).
    dg: V,
    d_last: V,
}

fn chunk_grads(
    b: &mut Body,
    d: &ForwardDims,
    [q, k, v, beta]: [&V; 4],
    t: &ChunkFactors,
    [a, vn]: [&V; 2],
    [s0, dh, dvn, sd_o]: [&V; 4],
    masks_t: Ref,
) -> Result<Grads> {
    let (kd, vd) = (d.k, d.v);
    let p = d.precision();
    let mul = |b: &mut Body, x: &V, y: &V| b.binary(Binary::Mul, x, y);
    let add = |b: &mut Body, x: &V, y: &V| b.binary(Binary::Add, x, y);
    let sub = |b: &mut Body, x: &V, y: &V| b.binary(Binary::Sub, x, y);
    let wide_k = |b: &mut Body, x: &V| b.broadcast(x, &[C, kd]);
    // Through O = scale qg S0 + Aqk v_new and S1 = e^(G_C) S0 + kg^T v_new, and the WY solve:
    // u = A (beta v), w = A (beta k e^G), v_new = u - w S0; with dw = -dv_new S0^T,
    // nw = -A^T dw = (A^T dv_new) S0^T. `dqg = scale dO S0^T` and `nw` as one product against
    // `S0^T`.
    let xu = mm(b, a, dvn, (0, 0), p)?;
    let both = {
        let lhs = b.concat(&[sd_o.clone(), xu.clone()], 0)?;
        b.matmul(&lhs, s0, (1, 1), p)?
    };
    let dqg = b.slice(&both, &[0, 0], &[C, kd])?;
    let nw = b.slice(&both, &[C, 0], &[C, kd])?;
    let mut dq = mul(b, &dqg, &t.egc)?;
    let mut d_g = mul(b, &dqg, &t.qg)?;
    let dkg = b.matmul(vn, dh, (1, 1), p)?;
    let mut dk = mul(b, &dkg, &t.egs)?;
    let d_suffix = mul(b, &dkg, &t.kg)?;
    let sd = mul(b, s0, dh)?;
    let hd = b.reduce(Reduction::Sum, &sd, 1)?;
    let hd = b.reshape(&hd, &[1, kd])?;
    let d_last = mul(b, &hd, &t.eg_last)?;
    let wide_v = b.broadcast(beta, &[C, vd])?;
    let dv = mul(b, &xu, &wide_v)?;
    // Through `w = A (beta k e^G)`: `nw e^G` to `dk` (times beta) and to `dg` (times
    // `beta k`); `beta` gets `xu . v` here, and `(d(beta k) - nw e^G) . k` once the levels have
    // summed `d(beta k)`.
    let nwe = mul(b, &nw, &t.egc)?;
    let wb = wide_k(b, beta)?;
    let bnwe = mul(b, &nwe, &wb)?;
    dk = sub(b, &dk, &bnwe)?;
    let x = mul(b, &bnwe, k)?;
    d_g = sub(b, &d_g, &x)?;
    // The cotangents of `Aqk` (scale dO v_new^T) and of `L` (nw w^T - xu u^T = xu (w S0 - u)^T
    // = -xu v_new^T; strictly causal: the level masks keep it so) as one product.
    let nxu = b.unary(Unary::Neg, &xu)?;
    let lhs = b.concat(&[sd_o.clone(), nxu], 0)?;
    let m = b.matmul(&lhs, vn, (1, 1), p)?;
    let m1 = b.slice(&m, &[0, 0], &[C, C])?;
    // Aqk's diagonal, scale q_t . k_t with no decay: its cotangent goes to dq and dk directly.
    let diag = rowdot(b, &m1, &t.eye)?;
    let diag = wide_k(b, &diag)?;
    let x = mul(b, k, &diag)?;
    dq = add(b, &dq, &x)?;
    let x = mul(b, q, &diag)?;
    dk = add(b, &dk, &x)?;
    let m = as_operand(b, &m, p)?;
    let LevelGrads { dq, mut dk, d_bk, d_exponents } = level_grads(b, [q, k], t, &m, p, [dq, dk])?;
    let x = mul(b, &d_bk, &wb)?;
    dk = add(b, &dk, &x)?;
    // dbeta: one reduction over the rows' lanes when K = V.
    let through_k = {
        let x = sub(b, &d_bk, &nwe)?;
        mul(b, &x, k)?
    };
    let through_v = mul(b, &xu, v)?;
    let dbeta = if kd == vd {
        let x = add(b, &through_k, &through_v)?;
        b.reduce(Reduction::Sum, &x, 1)?
    } else {
        let x = b.reduce(Reduction::Sum, &through_k, 1)?;
        let y = b.reduce(Reduction::Sum, &through_v, 1)?;
        add(b, &x, &y)?
    };
    // dg = sum over the exponent arrays of mask^T dE (G, the strict suffix, the mid anchor, the
    // levels: the masks' order), one product over them stacked.
    let mut all = vec![d_g, d_suffix];
    all.extend(d_exponents);
    let stacked = b.concat(&all, 0)?;
    // With gate parameters, which sum `dg` over every token, the gradients of `G` and of the
    // strict suffix (the masks that sum up to 64 of their rows) go in two bf16 parts: bf16
    // `dg` 2.9e-3 RMS (lower-bound gate, L2 norm) against 2.7e-3 with every array in two parts
    // and 3.8e-3 with none; at H=32, T=8192 that costs 0.07 M static cycles, every array in two
    // parts 0.27 M.
    let split = if d.gate_params { 2 * C } else { 0 };
    let dg = fold(b, masks_t, &stacked, p, split)?;
    Ok(Grads { dq, dk, dv, dbeta, dg, d_last })
}

/// What the levels of a chunk's terms add up: `dq`, `dk`, `d(beta k)` and the gradients of the
/// exponent arrays of levels 0 to 4 (the exponent masks' order after `G` and the suffix).
struct LevelGrads {
    dq: V,
    dk: V,
    d_bk: V,
    d_exponents: Vec<V>,
}

/// The operand `x` in the type products at `p` read (bf16 for one-pass products: rounded once,
/// and half the registers while it waits).
fn as_operand(b: &mut Body, x: &V, p: MatPrecision) -> Result<V> {
    let op_ty = if p == MatPrecision::Default { DType::BF16 } else { DType::F32 };
    if x.ty.elem == op_ty {
        Ok(x.clone())
    } else {
        b.cast(x, op_ty)
    }
}

/// The gradients through the levels of `Aqk` and `L` (their cotangents `m`, `Aqk`'s above
/// `L`'s, in the products' type) added to `dq` and `dk`.
fn level_grads(
    b: &mut Body,
    [q, k]: [&V; 2],
    t: &ChunkFactors,
    m: &V,
    p: MatPrecision,
    [dq, dk]: [V; 2],
) -> Result<LevelGrads> {
    let (mut dq, mut dk) = (dq, dk);
    let mul = |b: &mut Body, x: &V, y: &V| b.binary(Binary::Mul, x, y);
    let add = |b: &mut Body, x: &V, y: &V| b.binary(Binary::Add, x, y);
    let sub = |b: &mut Body, x: &V, y: &V| b.binary(Binary::Sub, x, y);
    let as_op = |b: &mut Body, x: &V| as_operand(b, x, p);
    let kd = k.ty.dims[1];
    let m = m.clone();
    let mut d_exponents = vec![];
    // Level 0, the pairs within a 4-token block (rows and columns share tokens): `Aqk` rows
    // `q fr` and `L` rows `beta k fr` against columns `k fc`, strictly causal pairs on its mask.
    // Both cotangents against the shared columns, and both row operands against the
    // cotangents' columns, as one product each.
    let mut d_bk = {
        let ((fr, fc), keep) = (&t.factors[0], &t.levels[1]);
        // The cotangents on the level's strict mask: a product with its 0/1 entries (exact, in
        // the operands' type; cheaper than a compare and a select).
        let both = b.concat(&[keep.clone(), keep.clone()], 0)?;
        let both = as_op(b, &both)?;
        let m = mul(b, &m, &both)?;
        let cols = mul(b, k, fc)?;
        let cols = as_op(b, &cols)?;
        let rows_q = mul(b, q, fr)?;
        let rows_l = mul(b, &t.bk, fr)?;
        let rows = b.concat(&[rows_q, rows_l], 0)?;
        let rows = as_op(b, &rows)?;
        let r = b.matmul(&m, &cols, (1, 0), p)?;
        let rq = b.slice(&r, &[0, 0], &[C, kd])?;
        let rl = b.slice(&r, &[C, 0], &[C, kd])?;
        let cc = b.matmul(&m, &rows, (0, 0), p)?;
        let (pq, pl, pk) = (mul(b, &rq, fr)?, mul(b, &rl, fr)?, mul(b, &cc, fc)?);
        dq = add(b, &dq, &pq)?;
        dk = add(b, &dk, &pk)?;
        let er = mul(b, &pq, q)?;
        let x = mul(b, &pl, &t.bk)?;
        let er = add(b, &er, &x)?;
        let ec = mul(b, &pk, k)?;
        // Its factors are e^(mid) and e^(-mid).
        d_exponents.push(sub(b, &er, &ec)?);
        pl
    };
    // Levels 1 to 4 (block size `B`): rows `t` in the second half of a `2B` block, columns `j`
    // in its first, one exponent array `f` for both, so rows and columns never share a token.
    // With `P` the `Aqk` cotangent below the diagonal and `L`'s transposed above it, `Q` the
    // other way round, both kept on the level's pairs in either order, two products over the
    // whole chunk give every cotangent term: `P (f sb)` holds `Aqk`'s row terms on second halves
    // and `L`'s column terms on first halves, `Q (f sq)` `L`'s row terms and `Aqk`'s column
    // terms, where `sb` and `sq` are `beta k` and `q` on second halves and `k` on first (217 k
    // to 205 k static cycles at the primary shape, from four products and five transposes a
    // level). The cotangents are transposed once for every level.
    let mt = b.transpose(&m)?;
    let (m1, m2) = (b.slice(&m, &[0, 0], &[C, C])?, b.slice(&m, &[C, 0], &[C, C])?);
    let (m1t, m2t) = (b.slice(&mt, &[0, 0], &[C, C])?, b.slice(&mt, &[0, C], &[C, C])?);
    let lower = {
        let (r, c) = (b.iota(&[C, C], 0)?, b.iota(&[C, C], 1)?);
        b.compare(Cmp::Gt, &r, &c)?
    };
    let pm = b.select(&lower, &m1, &m2t)?;
    let qm = b.select(&lower, &m2, &m1t)?;
    for (i, &half) in HALVES.iter().enumerate() {
        let f = &t.factors[i + 1].0;
        let sym = as_op(b, &t.pairs[i])?;
        let (x1, x2) = (mul(b, &pm, &sym)?, mul(b, &qm, &sym)?);
        // Second halves from `on`, first from `off`: for `B` of 8 or more whole 8-row tiles, so
        // that what a half does not take is never formed.
        let pick = |b: &mut Body, on: &V, off: &V| by_halves(b, half, on, off);
        let sq = pick(b, q, k)?;
        let sb = pick(b, &t.bk, k)?;
        let y1 = mul(b, &sb, f)?;
        let y1 = as_op(b, &y1)?;
        let y2 = mul(b, &sq, f)?;
        let y2 = as_op(b, &y2)?;
        let o1 = b.matmul(&x1, &y1, (1, 0), p)?;
        let o2 = b.matmul(&x2, &y2, (1, 0), p)?;
        let (u, w) = (mul(b, &o1, f)?, mul(b, &o2, f)?);
        // Rows: `dq += u`, `d(beta k) += w`, the exponent `u q + w beta k`; columns:
        // `dk += u + w`, the exponent `(u + w) k`.
        let uw = add(b, &u, &w)?;
        let e_rows = {
            let x = mul(b, &u, q)?;
            let y = mul(b, &w, &t.bk)?;
            add(b, &x, &y)?
        };
        let e_cols = mul(b, &uw, k)?;
        d_exponents.push(pick(b, &e_rows, &e_cols)?);
        let x = add(b, &dq, &u)?;
        dq = pick(b, &x, &dq)?;
        let x = add(b, &d_bk, &w)?;
        d_bk = pick(b, &x, &d_bk)?;
        let x = add(b, &dk, &uw)?;
        dk = pick(b, &dk, &x)?;
    }
    Ok(LevelGrads { dq, dk, d_bk, d_exponents })
}

/// `sum_m M_m^T de_m` over the exponent masks (`masks_t` holds the transposes side by side)
/// with `de` their arrays' gradients stacked. The masks' entries (0, 1, -1) are exact in bf16:
/// one-pass products take `de` rounded to bf16, and with `split` its first `split` rows again
/// as what that rounding left (about 16 bits for them).
fn fold(b: &mut Body, masks_t: Ref, de: &V, p: MatPrecision, split: i64) -> Result<V> {
    let mt = b.load_all(masks_t)?;
    let x = if p == MatPrecision::Highest {
        let mt = if mt.ty.elem == DType::F32 { mt } else { b.cast(&mt, DType::F32)? };
        b.matmul(&mt, de, (1, 0), MatPrecision::Highest)?
    } else {
        let hi = b.cast(de, DType::BF16)?;
        let x = b.matmul(&mt, &hi, (1, 0), MatPrecision::Default)?;
        if split == 0 {
            x
        } else {
            let kd = de.ty.dims[1];
            let (de, hi) = (b.slice(de, &[0, 0], &[split, kd])?, b.slice(&hi, &[0, 0], &[split, kd])?);
            let hi = b.cast(&hi, DType::F32)?;
            let rest = b.binary(Binary::Sub, &de, &hi)?;
            let lo = b.cast(&rest, DType::BF16)?;
            let mt = b.slice(&mt, &[0, 0], &[C, split])?;
            let y = b.matmul(&mt, &lo, (1, 0), MatPrecision::Default)?;
            b.binary(Binary::Add, &x, &y)?
        }
    };
    Ok(x)
}
