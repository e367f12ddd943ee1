//! The `i32` index tables a compiled device program reads, so one program serves every
//! segmentation of the same capacity.

use crate::plan::{ChunkInfo, SegmentPlan};
use kda_core::{KdaError, Result};

/// Marks a padding slot, a padding token, an unused chunk or an empty segment.
pub const SENTINEL: i32 = -1;

/// Runtime index tables for `capacity` chunks of `C` slots and `n_slots` segment slots per row.
///
/// Packed tokens are numbered `b * T + t`, aligned slots `chunk * C + i`, segments `b * n_slots + n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexTables {
    /// Chunk size C.
    pub c: usize,
    /// Batch rows B.
    pub b: usize,
    /// Tokens per row T.
    pub t: usize,
    /// Chunks the tables describe (the exact count, or a static capacity).
    pub capacity: usize,
    /// Segment slots per row the tables describe.
    pub n_slots: usize,
    /// Per aligned slot `[capacity * C]`: packed token, or [`SENTINEL`] for a padding slot.
    pub slot_token: Vec<i32>,
    /// Per packed token `[B * T]`: aligned slot, or [`SENTINEL`] for a padding token.
    pub token_slot: Vec<i32>,
    /// Per chunk: segment index `b * n_slots + n`, or [`SENTINEL`] for an unused chunk.
    pub chunk_segment: Vec<i32>,
    /// Per chunk: batch row, or [`SENTINEL`] for an unused chunk.
    pub chunk_row: Vec<i32>,
    /// Per chunk: index within its segment, or [`SENTINEL`] for an unused chunk.
    pub chunk_local: Vec<i32>,
    /// Per chunk: 1 for a segment's first chunk, else 0.
    pub chunk_first: Vec<i32>,
    /// Per chunk: 1 for a segment's last chunk, else 0.
    pub chunk_last: Vec<i32>,
    /// Per chunk: real tokens (0 for an unused chunk).
    pub chunk_len: Vec<i32>,
    /// Per chunk: packed token of its first slot, or [`SENTINEL`] for an unused chunk.
    pub chunk_start: Vec<i32>,
    /// Per segment `[B * n_slots]`: first chunk, or [`SENTINEL`] for an empty or absent segment.
    pub segment_first_chunk: Vec<i32>,
    /// Per segment `[B * n_slots]`: last chunk, or [`SENTINEL`] for an empty or absent segment.
    pub segment_last_chunk: Vec<i32>,
}

fn to_i32(arg: &str, x: usize) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| KdaError::unsupported(arg, format!("at most {} (i32 indices)", i32::MAX), x.to_string()))
}

/// `x * y` when it fits the `i32` indices of the tables (as [`IndexTables::build`] requires);
/// otherwise an `Unsupported` error naming the limit, never an overflow.
fn checked_size(arg: &str, x: usize, y: usize) -> Result<usize> {
    let n = x.checked_mul(y).ok_or_else(|| {
        KdaError::unsupported(arg, format!("at most {} (i32 indices)", i32::MAX), format!("{x} * {y}"))
    })?;
    to_i32(arg, n)?;
    Ok(n)
}

impl IndexTables {
    /// Tables for `plan` padded to `capacity` chunks and `n_slots` segment slots per row.
    pub fn build(plan: &SegmentPlan, capacity: usize, n_slots: usize) -> Result<Self> {
        let (c, b, t) = (plan.chunk_size(), plan.b(), plan.t());
        if capacity < plan.num_chunks() {
            return Err(KdaError::unsupported(
                "chunks",
                format!("at most the capacity of {capacity} chunks"),
                plan.num_chunks().to_string(),
            ));
        }
        if n_slots < plan.n() {
            return Err(KdaError::unsupported(
                "segments",
                format!("at most {n_slots} segment slots per row"),
                plan.n().to_string(),
            ));
        }
        let slots = capacity.saturating_mul(c);
        to_i32("aligned slots", slots)?;
        to_i32("packed tokens", b.saturating_mul(t))?;
        to_i32("segment slots", b.saturating_mul(n_slots))?;

        let mut tables = Self {
            c,
            b,
            t,
            capacity,
            n_slots,
            slot_token: vec![SENTINEL; slots],
            token_slot: vec![SENTINEL; b * t],
            chunk_segment: vec![SENTINEL; capacity],
            chunk_row: vec![SENTINEL; capacity],
            chunk_local: vec![SENTINEL; capacity],
            chunk_first: vec![0; capacity],
            chunk_last: vec![0; capacity],
            chunk_len: vec![0; capacity],
            chunk_start: vec![SENTINEL; capacity],
            segment_first_chunk: vec![SENTINEL; b * n_slots],
            segment_last_chunk: vec![SENTINEL; b * n_slots],
        };
        // Every value below is bounded by the checks above, so `as i32` cannot wrap.
        for (ci, ch) in plan.chunks().iter().enumerate() {
            let token0 = ch.row * t + ch.start;
            tables.chunk_segment[ci] = (ch.row * n_slots + ch.segment) as i32;
            tables.chunk_row[ci] = ch.row as i32;
            tables.chunk_local[ci] = ch.local as i32;
            tables.chunk_first[ci] = i32::from(ch.first);
            tables.chunk_last[ci] = i32::from(ch.last);
            tables.chunk_len[ci] = ch.len as i32;
            tables.chunk_start[ci] = token0 as i32;
            for i in 0..ch.len {
                tables.slot_token[ci * c + i] = (token0 + i) as i32;
                tables.token_slot[token0 + i] = (ci * c + i) as i32;
            }
        }
        for s in plan.segments().iter().filter(|s| s.chunks > 0) {
            let si = s.row * n_slots + s.segment;
            tables.segment_first_chunk[si] = s.chunk_offset as i32;
            tables.segment_last_chunk[si] = (s.chunk_offset + s.chunks - 1) as i32;
        }
        Ok(tables)
    }

    /// `Ok` when the sizes fit `i32` indices, the table lengths match them and every index is in
    /// range (or the sentinel); the table-driven loaders call this, so edited tables give an
    /// `Unsupported`, `Shape` or `Value` error, not a panic.
    pub fn check(&self) -> Result<()> {
        let (slots, tokens, segs) = (
            checked_size("aligned slots", self.capacity, self.c)?,
            checked_size("packed tokens", self.b, self.t)?,
            checked_size("segment slots", self.b, self.n_slots)?,
        );
        let lens = [
            ("slot_token", self.slot_token.len(), slots),
            ("token_slot", self.token_slot.len(), tokens),
            ("chunk_segment", self.chunk_segment.len(), self.capacity),
            ("chunk_row", self.chunk_row.len(), self.capacity),
            ("chunk_local", self.chunk_local.len(), self.capacity),
            ("chunk_first", self.chunk_first.len(), self.capacity),
            ("chunk_last", self.chunk_last.len(), self.capacity),
            ("chunk_len", self.chunk_len.len(), self.capacity),
            ("chunk_start", self.chunk_start.len(), self.capacity),
            ("segment_first_chunk", self.segment_first_chunk.len(), segs),
            ("segment_last_chunk", self.segment_last_chunk.len(), segs),
        ];
        for (arg, got, want) in lens {
            if got != want {
                return Err(KdaError::shape(arg, format!("{want} entries"), format!("{got} entries")));
            }
        }
        let ranges = [("slot_token", &self.slot_token, tokens), ("token_slot", &self.token_slot, slots)];
        for (arg, table, bound) in ranges {
            if let Some((i, x)) =
                table.iter().enumerate().find(|(_, &x)| x < SENTINEL || x as i64 >= bound as i64)
            {
                return Err(KdaError::value(
                    arg,
                    format!("indices in 0..{bound} or the sentinel {SENTINEL}"),
                    format!("{x} at entry {i}"),
                ));
            }
        }
        Ok(())
    }

    /// Aligned slots per head, `capacity * C`.
    pub fn num_slots(&self) -> usize {
        self.slot_token.len()
    }

    /// Decodes chunk `i` back into the plan's form; `None` for an unused (or out-of-range) chunk.
    pub fn chunk_info(&self, i: usize) -> Option<ChunkInfo> {
        let entry = |table: &[i32]| table.get(i).and_then(|&x| usize::try_from(x).ok());
        let (segment, row, start) =
            (entry(&self.chunk_segment)?, entry(&self.chunk_row)?, entry(&self.chunk_start)?);
        Some(ChunkInfo {
            row,
            segment: segment.checked_sub(row * self.n_slots)?,
            local: entry(&self.chunk_local)?,
            first: *self.chunk_first.get(i)? != 0,
            last: *self.chunk_last.get(i)? != 0,
            len: entry(&self.chunk_len)?,
            start: start.checked_sub(row * self.t)?,
        })
    }

    /// The packed token `(b, t)` of aligned slot `s`, or `None` for a padding slot.
    pub fn token_of_slot(&self, s: usize) -> Option<(usize, usize)> {
        let tok = usize::try_from(*self.slot_token.get(s)?).ok()?;
        Some((tok / self.t, tok % self.t))
    }

    /// The aligned slot of packed token `(b, t)`, or `None` for a padding token.
    pub fn slot_of_token(&self, b: usize, t: usize) -> Option<usize> {
        if t >= self.t {
            return None;
        }
        usize::try_from(*self.token_slot.get(b * self.t + t)?).ok()
    }
}

impl SegmentPlan {
    /// The `i32` index tables of this exact plan (capacity = NT chunks, N segment slots).
    pub fn index_tables(&self) -> Result<IndexTables> {
        IndexTables::build(self, self.num_chunks(), self.n())
    }
}
