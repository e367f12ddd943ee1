//! Context-parallel pieces: each row's aligned chunks (every segment starts a chunk) split into
//! D contiguous pieces, one per device, as token ranges. A piece boundary inside a segment falls
//! on one of that segment's chunk boundaries, so each piece, loaded as a packed problem of its
//! own, chunks its tokens exactly as the whole row does.

use std::ops::Range;

use kda_core::{
    DType, ElementsMut, GateKind, HostTensor, KdaError, Layout, Problem, Result, SegmentTable, TensorData,
    CHUNK,
};

/// `(row, source token, destination token, tokens)`.
type Move = (usize, usize, usize, usize);

/// The part of one segment that a piece holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The segment's slot in its row.
    pub segment: usize,
    /// Its tokens in the row (empty for an empty segment).
    pub tokens: Range<usize>,
    /// Whether the segment starts here (else it continues from the previous piece).
    pub starts: bool,
    /// Whether the segment ends here (else it carries into the next piece).
    pub ends: bool,
}

/// Every row's pieces over D devices, and the static size of a piece's local problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PiecePlan {
    /// `parts[b][d]`: what device `d` holds of row `b`, in token order.
    pub parts: Vec<Vec<Vec<Part>>>,
    /// Tokens per local row (the largest piece; at least 1).
    pub t: usize,
    /// Segment slots per local row (the most parts of a piece; at least 1).
    pub n: usize,
}

impl PiecePlan {
    /// Splits the rows of `table` into `devices` pieces of `ceil(chunks / devices)` aligned
    /// chunks of `chunk` tokens (the last pieces may be shorter or empty). An empty segment goes
    /// to the piece holding the chunk position it sits at.
    pub fn new(table: &SegmentTable, devices: usize, chunk: usize) -> Self {
        let devices = devices.max(1);
        let mut parts = Vec::with_capacity(table.b());
        for row in table.rows() {
            let chunks: Vec<usize> = row.iter().map(|r| r.len().div_ceil(chunk)).collect();
            let total: usize = chunks.iter().sum();
            let per = total.div_ceil(devices).max(1);
            let mut pieces: Vec<Vec<Part>> = vec![Vec::new(); devices];
            let mut offset = 0;
            for (segment, (r, &c)) in row.iter().zip(&chunks).enumerate() {
                if c == 0 {
                    let d = (offset / per).min(devices - 1);
                    pieces[d].push(Part { segment, tokens: r.clone(), starts: true, ends: true });
                    continue;
                }
                let mut j = 0;
                while j < c {
                    let d = (offset + j) / per;
                    let take = ((d + 1) * per - (offset + j)).min(c - j);
                    let start = r.start + j * chunk;
                    let end = (r.start + (j + take) * chunk).min(r.end);
                    pieces[d].push(Part { segment, tokens: start..end, starts: j == 0, ends: j + take == c });
                    j += take;
                }
                offset += c;
            }
            parts.push(pieces);
        }
        let piece_len = |p: &Vec<Part>| p.iter().map(|x| x.tokens.len()).sum::<usize>();
        let t = parts.iter().flatten().map(piece_len).max().unwrap_or(0).max(1);
        let n = parts.iter().flatten().map(Vec::len).max().unwrap_or(0).max(1);
        PiecePlan { parts, t, n }
    }

    /// Device `d`'s local segment table: its parts side by side from token 0, then empty slots
    /// up to `n`.
    pub fn local_table(&self, d: usize) -> Result<SegmentTable> {
        self.check_device(d)?;
        let rows = self
            .parts
            .iter()
            .map(|pieces| {
                let mut pos = 0;
                let mut ranges: Vec<Range<usize>> = pieces[d]
                    .iter()
                    .map(|p| {
                        let r = pos..pos + p.tokens.len();
                        pos = r.end;
                        r
                    })
                    .collect();
                ranges.resize(self.n, pos..pos);
                ranges
            })
            .collect();
        SegmentTable::from_ranges(self.t, rows)
    }

    /// Device `d`'s token moves `(row, row token, local token, len)`, one per non-empty part.
    pub fn moves(&self, d: usize) -> Vec<(usize, usize, usize, usize)> {
        let mut out = Vec::new();
        for (b, pieces) in self.parts.iter().enumerate() {
            let mut pos = 0;
            for p in pieces.get(d).into_iter().flatten() {
                if !p.tokens.is_empty() {
                    out.push((b, p.tokens.start, pos, p.tokens.len()));
                }
                pos += p.tokens.len();
            }
        }
        out
    }
}

impl PiecePlan {
    /// Every row of `p` cut into `devices` pieces of whole chunks, and each device's local
    /// problem: its piece's tokens from token 0, with initial and final states (the program
    /// fills the continuation and carry slots). A fixed-length batch stays fixed length when
    /// every piece is full, or when its gate is pre-activated (a zero token with `g = 0` and
    /// `beta = 0` leaves the state as it is, so a short last piece is padded exactly); otherwise
    /// a piece is a packed row with one slot per segment part. The fixed form needs no index
    /// gathers and less scratch.
    pub fn split(p: &Problem, devices: usize) -> Result<(PiecePlan, Vec<Problem>)> {
        let pieces = PiecePlan::new(&p.segments, devices, CHUNK);
        let full = pieces
            .parts
            .iter()
            .flatten()
            .all(|parts| parts.iter().map(|x| x.tokens.len()).sum::<usize>() == pieces.t);
        let fixed = !p.segments.is_packed() && (full || p.gate == GateKind::Preactivated);
        let mut locals = Vec::with_capacity(devices);
        for d in 0..devices.max(1) {
            let mut q = p.clone();
            q.dims.t = pieces.t;
            q.dims.n = pieces.n;
            q.segments =
                if fixed { SegmentTable::fixed(p.dims.b, pieces.t) } else { pieces.local_table(d)? };
            q.has_initial_state = true;
            q.output_final_state = true;
            q.beta_shape[token_axis(p.layout)] = pieces.t;
            locals.push(q);
        }
        Ok((pieces, locals))
    }

    /// `(row, global slot, local slot)` of device `d`'s parts that start (`starts`) or end
    /// their segment.
    pub fn slots(&self, d: usize, starts: bool) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        for (b, pieces) in self.parts.iter().enumerate() {
            for (i, p) in pieces.get(d).into_iter().flatten().enumerate() {
                if (starts && p.starts) || (!starts && p.ends) {
                    out.push((b, p.segment, i));
                }
            }
        }
        out
    }

    /// A `Value` error unless `d` is one of the plan's devices.
    fn check_device(&self, d: usize) -> Result<()> {
        let devices = self.parts.first().map_or(0, Vec::len);
        if d >= devices {
            return Err(KdaError::value("device", format!("a device below {devices}"), d.to_string()));
        }
        Ok(())
    }

    /// A per-token tensor of the whole batch moved to device `d`'s local rows (zeros elsewhere).
    pub fn local_tokens(&self, t: &HostTensor, layout: Layout, d: usize) -> Result<HostTensor> {
        self.check_device(d)?;
        check_tokens("tokens", t.shape(), layout)?;
        let mut shape = t.shape().to_vec();
        shape[token_axis(layout)] = self.t;
        let mut out = HostTensor::try_zeros(&shape, t.dtype())?;
        copy_tokens(t, &mut out, layout, &self.moves(d))?;
        Ok(out)
    }

    /// A state tensor of the whole batch (`[B, N, H, K, V]`) as device `d`'s local slots, in
    /// f32: the slots of the parts that start (or end) their segment; zeros in the others.
    pub fn local_states(
        &self,
        t: Option<&HostTensor>,
        d: usize,
        starts: bool,
        p: &Problem,
    ) -> Result<HostTensor> {
        self.check_device(d)?;
        let dims = p.dims;
        let mut out = HostTensor::try_zeros(&[dims.b, self.n, dims.h, dims.k, dims.v], DType::F32)?;
        if let Some(t) = t {
            copy_slots(&t.cast(DType::F32)?, &mut out, &self.slots(d, starts))?;
        }
        Ok(out)
    }

    /// Writes device `d`'s local per-token tensor back to its tokens of `out` (the whole batch).
    pub fn place_tokens(
        &self,
        local: &HostTensor,
        d: usize,
        layout: Layout,
        out: &mut HostTensor,
    ) -> Result<()> {
        self.check_device(d)?;
        check_tokens("local tokens", local.shape(), layout)?;
        check_tokens("tokens", out.shape(), layout)?;
        let back: Vec<Move> = self.moves(d).iter().map(|&(b, g, l, n)| (b, l, g, n)).collect();
        copy_tokens(local, out, layout, &back)
    }

    /// Writes device `d`'s local state slots back to the slots of `out` (`[B, N, H, K, V]`) of
    /// the parts that start (or end) their segment.
    pub fn place_states(
        &self,
        local: &HostTensor,
        d: usize,
        starts: bool,
        out: &mut HostTensor,
    ) -> Result<()> {
        self.check_device(d)?;
        let back: Vec<_> = self.slots(d, starts).iter().map(|&(b, g, l)| (b, l, g)).collect();
        copy_slots(local, out, &back)
    }
}

/// The token axis of a per-token tensor (and of `beta`) in `layout`.
fn token_axis(layout: Layout) -> usize {
    match layout {
        Layout::HeadFirst => 2,
        Layout::BatchFirst => 1,
    }
}

/// A `Shape` error unless `shape` is a per-token tensor (`[H, B, T, ..]` or `[B, T, H, ..]`).
fn check_tokens(arg: &str, shape: &[usize], layout: Layout) -> Result<()> {
    if shape.len() < 3 {
        let want = match layout {
            Layout::HeadFirst => "[H, B, T] or [H, B, T, D]",
            Layout::BatchFirst => "[B, T, H] or [B, T, H, D]",
        };
        return Err(KdaError::shape(arg, want, kda_core::fmt_shape(shape)));
    }
    Ok(())
}

/// `(H, B, T, W)` of a per-token tensor (`W`: elements per head and token).
fn geometry(shape: &[usize], layout: Layout) -> (usize, usize, usize, usize) {
    let w: usize = shape[3.min(shape.len())..].iter().product();
    match layout {
        Layout::HeadFirst => (shape[0], shape[1], shape[2], w),
        Layout::BatchFirst => (shape[2], shape[0], shape[1], w),
    }
}

/// Copies token runs of `src` into `dst` (same dtype and layout; T may differ).
fn copy_tokens(src: &HostTensor, dst: &mut HostTensor, layout: Layout, moves: &[Move]) -> Result<()> {
    let (h, b, ts, w) = geometry(src.shape(), layout);
    let (hd, bd, td, wd) = geometry(dst.shape(), layout);
    let fits =
        moves.iter().all(|&(row, from, to, len)| row < b.min(bd) && from + len <= ts && to + len <= td);
    if (h, b, w) != (hd, bd, wd) || !fits {
        return Err(KdaError::shape(
            "tokens",
            format!("the rows and tokens of the plan, like {}", kda_core::fmt_shape(dst.shape())),
            kda_core::fmt_shape(src.shape()),
        ));
    }
    fn run<T: Copy>(
        s: &[T],
        d: &mut [T],
        layout: Layout,
        g: (usize, usize, usize, usize, usize),
        moves: &[Move],
    ) {
        let (h, b, ts, td, w) = g;
        for &(row, from, to, len) in moves {
            match layout {
                Layout::HeadFirst => {
                    for hh in 0..h {
                        let si = ((hh * b + row) * ts + from) * w;
                        let di = ((hh * b + row) * td + to) * w;
                        d[di..di + len * w].copy_from_slice(&s[si..si + len * w]);
                    }
                }
                Layout::BatchFirst => {
                    let (si, di) = ((row * ts + from) * h * w, (row * td + to) * h * w);
                    d[di..di + len * h * w].copy_from_slice(&s[si..si + len * h * w]);
                }
            }
        }
    }
    let g = (h, b, ts, td, w);
    match (src.data(), dst.elements_mut()) {
        (TensorData::F32(s), ElementsMut::F32(d)) => run(s, d, layout, g, moves),
        (TensorData::BF16(s), ElementsMut::BF16(d)) => run(s, d, layout, g, moves),
        (TensorData::F64(s), ElementsMut::F64(d)) => run(s, d, layout, g, moves),
        _ => return Err(KdaError::dtype("tokens", src.dtype().to_string(), dst.dtype().to_string())),
    }
    Ok(())
}

/// Copies state slots `(row, source slot, destination slot)` of `[B, N, H, K, V]` tensors.
fn copy_slots(src: &HostTensor, dst: &mut HostTensor, slots: &[(usize, usize, usize)]) -> Result<()> {
    let (s, t) = (src.shape(), dst.shape());
    let fits = |ns: usize, nd: usize| slots.iter().all(|&(row, from, to)| row < s[0] && from < ns && to < nd);
    if s.len() != 5 || t.len() != 5 || s[0] != t[0] || s[2..] != t[2..] || !fits(s[1], t[1]) {
        return Err(KdaError::shape(
            "states",
            format!("[B, N, H, K, V] with the plan's slots, like {}", kda_core::fmt_shape(t)),
            kda_core::fmt_shape(s),
        ));
    }
    let (ns, nd) = (s[1], t[1]);
    let block: usize = s[2..].iter().product();
    fn run<T: Copy>(
        s: &[T],
        d: &mut [T],
        ns: usize,
        nd: usize,
        block: usize,
        slots: &[(usize, usize, usize)],
    ) {
        for &(row, from, to) in slots {
            let (si, di) = ((row * ns + from) * block, (row * nd + to) * block);
            d[di..di + block].copy_from_slice(&s[si..si + block]);
        }
    }
    match (src.data(), dst.elements_mut()) {
        (TensorData::F32(s), ElementsMut::F32(d)) => run(s, d, ns, nd, block, slots),
        (TensorData::F64(s), ElementsMut::F64(d)) => run(s, d, ns, nd, block, slots),
        (TensorData::BF16(s), ElementsMut::BF16(d)) => run(s, d, ns, nd, block, slots),
        _ => return Err(KdaError::dtype("states", src.dtype().to_string(), dst.dtype().to_string())),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_core::KdaInputs;
    use rstest::rstest;

    /// A tensor whose every element is its own index.
    fn counting(shape: &[usize]) -> HostTensor {
        let n: usize = shape.iter().product();
        HostTensor::from_f64_as(shape, &(0..n).map(|i| i as f64).collect::<Vec<_>>(), DType::F32).unwrap()
    }

    #[rstest]
    #[case::head_first(Layout::HeadFirst, vec![2, 2, 140, 3])]
    #[case::batch_first(Layout::BatchFirst, vec![2, 140, 2, 3])]
    #[case::batch_first_scalars(Layout::BatchFirst, vec![2, 140, 2])]
    fn tokens_out_to_the_pieces_and_back_are_the_identity(#[case] layout: Layout, #[case] shape: Vec<usize>) {
        let plan = PiecePlan::new(&table(140, &[&[30, 100, 10], &[140, 0, 0]]), 3, 64);
        let x = counting(&shape);
        let mut back = HostTensor::zeros(&shape, DType::F32);
        for d in 0..3 {
            let local = plan.local_tokens(&x, layout, d).unwrap();
            plan.place_tokens(&local, d, layout, &mut back).unwrap();
        }
        assert_eq!(back, x);
    }

    #[test]
    fn states_out_to_the_pieces_and_back_are_the_identity() {
        let (h, k, v) = (2, 3, 4);
        let z = |dims: &[usize]| HostTensor::zeros(dims, DType::F32);
        let x = KdaInputs::new(
            z(&[h, 2, 140, k]),
            z(&[h, 2, 140, k]),
            z(&[h, 2, 140, v]),
            z(&[h, 2, 140, k]),
            z(&[h, 2, 140]),
        )
        .with_layout(Layout::HeadFirst)
        .with_segments(kda_core::Segments::CuSeqlens(vec![vec![0, 30, 130, 140], vec![0, 140, 140, 140]]));
        let p = x.validate().unwrap();
        let (plan, locals) = PiecePlan::split(&p, 3).unwrap();
        assert_eq!(locals.len(), 3);
        let h0 = counting(&[2, 3, h, k, v]);
        // Every segment starts on exactly one piece: the starting slots give every state back.
        let mut back = z(&[2, 3, h, k, v]);
        for d in 0..3 {
            let local = plan.local_states(Some(&h0), d, true, &p).unwrap();
            assert_eq!(local.shape(), &[2, plan.n, h, k, v]);
            plan.place_states(&local, d, true, &mut back).unwrap();
        }
        assert_eq!(back, h0);
    }

    #[test]
    fn bad_devices_and_shapes_are_errors() {
        let plan = PiecePlan::new(&table(140, &[&[30, 100, 10]]), 2, 64);
        let x = counting(&[1, 1, 140, 2]);
        let err = plan.local_tokens(&x, Layout::HeadFirst, 2).unwrap_err();
        assert_eq!((err.kind(), err.arg()), (kda_core::ErrorKind::Value, "device"));
        let err = plan.local_tokens(&counting(&[1, 1, 100, 2]), Layout::HeadFirst, 1).unwrap_err();
        assert_eq!((err.kind(), err.arg()), (kda_core::ErrorKind::Shape, "tokens"));
        let err = plan.local_tokens(&counting(&[140, 2]), Layout::HeadFirst, 0).unwrap_err();
        assert_eq!(err.kind(), kda_core::ErrorKind::Shape);
    }

    fn table(t: usize, rows: &[&[usize]]) -> SegmentTable {
        let ranges = rows
            .iter()
            .map(|lens| {
                let mut pos = 0;
                lens.iter()
                    .map(|&l| {
                        let r = pos..pos + l;
                        pos += l;
                        r
                    })
                    .collect()
            })
            .collect();
        SegmentTable::from_ranges(t, ranges).unwrap()
    }

    /// (segment, start, end, starts, ends) per part, per device, for one row.
    type Want = Vec<Vec<(usize, usize, usize, bool, bool)>>;

    #[rstest]
    #[case::fixed_even_split(&[256], 2, vec![vec![(0, 0, 128, true, false)], vec![(0, 128, 256, false, true)]])]
    #[case::segment_spans_three_pieces(&[200], 4, vec![
        vec![(0, 0, 64, true, false)], vec![(0, 64, 128, false, false)],
        vec![(0, 128, 192, false, false)], vec![(0, 192, 200, false, true)]])]
    #[case::boundary_on_a_segment_end(&[64, 100], 3, vec![
        vec![(0, 0, 64, true, true)], vec![(1, 64, 128, true, false)], vec![(1, 128, 164, false, true)]])]
    #[case::segments_inside_and_across(&[30, 100, 10], 2, vec![
        vec![(0, 0, 30, true, true), (1, 30, 94, true, false)],
        vec![(1, 94, 130, false, true), (2, 130, 140, true, true)]])]
    #[case::more_devices_than_chunks(&[40], 3, vec![vec![(0, 0, 40, true, true)], vec![], vec![]])]
    #[case::empty_segment_stays_in_order(&[64, 0, 64], 2, vec![
        vec![(0, 0, 64, true, true)], vec![(1, 64, 64, true, true), (2, 64, 128, true, true)]])]
    fn rows_split_on_chunk_boundaries(#[case] lens: &[usize], #[case] devices: usize, #[case] want: Want) {
        let t: usize = lens.iter().sum::<usize>().max(1);
        let plan = PiecePlan::new(&table(t, &[lens]), devices, 64);
        let got: Want = plan.parts[0]
            .iter()
            .map(|ps| {
                ps.iter().map(|p| (p.segment, p.tokens.start, p.tokens.end, p.starts, p.ends)).collect()
            })
            .collect();
        assert_eq!(got, want);
        for d in 0..devices {
            let local = plan.local_table(d).unwrap();
            assert_eq!((local.t(), local.n()), (plan.t, plan.n));
        }
    }

    #[test]
    fn local_rows_hold_their_parts_from_token_zero() {
        let plan = PiecePlan::new(&table(140, &[&[30, 100, 10], &[140, 0, 0]]), 2, 64);
        assert_eq!((plan.t, plan.n), (128, 3));
        assert_eq!(plan.moves(1), vec![(0, 94, 0, 36), (0, 130, 36, 10), (1, 128, 0, 12)]);
        let local = plan.local_table(1).unwrap();
        assert_eq!(local.rows()[0], vec![0..36, 36..46, 46..46]);
    }
}
