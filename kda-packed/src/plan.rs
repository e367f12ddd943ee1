//! The exact chunk plan of a packed batch: every segment starts a new chunk (docs/kda.md, Chunks).

use kda_core::{KdaError, Result, SegmentTable, Segments};
use std::ops::Range;

/// The chunk sizes this crate plans for: [`kda_core::CHUNK`], and 16 and 32 for tests.
pub const CHUNK_SIZES: [usize; 3] = [16, 32, kda_core::CHUNK];

/// `Ok(c)` when `c` is one of [`CHUNK_SIZES`]; otherwise an `Unsupported` error naming the limit.
pub fn check_chunk_size(c: usize) -> Result<usize> {
    if CHUNK_SIZES.contains(&c) {
        Ok(c)
    } else {
        Err(KdaError::unsupported("chunk_size", "a chunk size of 16, 32 or 64", c.to_string()))
    }
}

/// One chunk of the plan: which segment it belongs to and which packed tokens it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Batch row.
    pub row: usize,
    /// Segment slot `n` within the row.
    pub segment: usize,
    /// Index of this chunk within its segment (0 for the segment's first chunk).
    pub local: usize,
    /// True for the segment's first chunk (the state resets here).
    pub first: bool,
    /// True for the segment's last chunk (the final state is taken here).
    pub last: bool,
    /// Real tokens in the chunk: `C` except in a partial tail chunk.
    pub len: usize,
    /// Token position (within the row) of the chunk's first token.
    pub start: usize,
}

/// One segment slot of the plan: its packed tokens and its aligned chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Batch row.
    pub row: usize,
    /// Segment slot `n` within the row.
    pub segment: usize,
    /// First token position within the row.
    pub start: usize,
    /// Length in tokens (0 for an empty segment).
    pub len: usize,
    /// Packed flat offset `row * T + start`.
    pub packed_offset: usize,
    /// Index of the segment's first chunk in the aligned layout.
    pub chunk_offset: usize,
    /// Chunks of the segment, `ceil(len / C)` (0 for an empty segment).
    pub chunks: usize,
}

impl SegmentInfo {
    /// The aligned slots `chunk_offset * C ..` holding the segment's real tokens.
    pub fn slots(&self, c: usize) -> Range<usize> {
        self.chunk_offset * c..self.chunk_offset * c + self.len
    }
    /// The packed token positions of the segment within its row.
    pub fn tokens(&self) -> Range<usize> {
        self.start..self.start + self.len
    }
}

/// The exact plan: `sum ceil(L_n / C)` chunks, in row-major segment order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentPlan {
    c: usize,
    b: usize,
    t: usize,
    n: usize,
    chunks: Vec<ChunkInfo>,
    segments: Vec<SegmentInfo>,
}

impl SegmentPlan {
    /// Plans validated segments with chunk size `c` (16, 32 or 64).
    pub fn new(table: &SegmentTable, c: usize) -> Result<Self> {
        let c = check_chunk_size(c)?;
        let (b, t, n) = (table.b(), table.t(), table.n());
        let total: usize = table.rows().iter().flatten().map(|r| r.len().div_ceil(c)).sum();
        let mut chunks = Vec::with_capacity(total);
        let mut segments = Vec::with_capacity(b * n);
        for (row, ranges) in table.rows().iter().enumerate() {
            for (segment, r) in ranges.iter().enumerate() {
                let len = r.len();
                let count = len.div_ceil(c);
                segments.push(SegmentInfo {
                    row,
                    segment,
                    start: r.start,
                    len,
                    packed_offset: row * t + r.start,
                    chunk_offset: chunks.len(),
                    chunks: count,
                });
                for local in 0..count {
                    chunks.push(ChunkInfo {
                        row,
                        segment,
                        local,
                        first: local == 0,
                        last: local + 1 == count,
                        len: c.min(len - local * c),
                        start: r.start + local * c,
                    });
                }
            }
        }
        Ok(Self { c, b, t, n, chunks, segments })
    }
    /// Validates caller metadata against `b` rows of `t` tokens (kda-core's rules), then plans it.
    pub fn from_segments(segments: &Segments, b: usize, t: usize, c: usize) -> Result<Self> {
        Self::new(&segments.validate(b, t)?, c)
    }
    /// The plan of a fixed-length batch: each row one segment of `t` tokens.
    pub fn fixed(b: usize, t: usize, c: usize) -> Result<Self> {
        Self::new(&SegmentTable::fixed(b, t), c)
    }

    /// Chunk size C.
    pub fn chunk_size(&self) -> usize {
        self.c
    }
    /// Batch rows B.
    pub fn b(&self) -> usize {
        self.b
    }
    /// Tokens per row T.
    pub fn t(&self) -> usize {
        self.t
    }
    /// Segment slots per row N.
    pub fn n(&self) -> usize {
        self.n
    }
    /// The exact chunk count NT = `sum ceil(L_n / C)`.
    pub fn num_chunks(&self) -> usize {
        self.chunks.len()
    }
    /// Aligned slots per head, `NT * C`.
    pub fn num_slots(&self) -> usize {
        self.chunks.len() * self.c
    }
    /// Real (non-padding) tokens over all rows.
    pub fn real_tokens(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }
    /// All chunks in aligned order.
    pub fn chunks(&self) -> &[ChunkInfo] {
        &self.chunks
    }
    /// All segment slots, row-major (`b * N + n`).
    pub fn segments(&self) -> &[SegmentInfo] {
        &self.segments
    }
    /// Segment slot `n` of row `b`, or a `Shape` error when out of range.
    pub fn segment(&self, b: usize, n: usize) -> Result<&SegmentInfo> {
        if b >= self.b || n >= self.n {
            return Err(KdaError::shape(
                "segment",
                format!("row < {} and slot < {}", self.b, self.n),
                format!("row {b}, slot {n}"),
            ));
        }
        Ok(&self.segments[b * self.n + n])
    }
}
