//! The static form of the plan: a chunk capacity fixed at compile time from `(B, T, N_max, C)`,
//! filled at run time by index tables.

use crate::plan::{check_chunk_size, SegmentPlan};
use crate::tables::IndexTables;
use kda_core::{fmt_shape, KdaError, Result, SegmentTable};

/// The compile-time sizes of a packed program and its provably sufficient chunk capacity.
///
/// A row of `T` tokens split into `k <= min(N_max, T)` non-empty segments needs
/// `sum ceil(L_i / C) <= k + floor((T - k) / C)` chunks (each segment's last chunk holds at least
/// one token, all others `C`), and `k - 1` one-token segments plus one long one reach the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StaticCapacity {
    b: usize,
    t: usize,
    max_segments: usize,
    c: usize,
    row_chunks: usize,
}

impl StaticCapacity {
    /// The capacity for `b` rows of `t` tokens with at most `max_segments` segments per row.
    pub fn new(b: usize, t: usize, max_segments: usize, c: usize) -> Result<Self> {
        let c = check_chunk_size(c)?;
        if max_segments == 0 {
            return Err(KdaError::value("max_segments", "at least 1 segment slot per row", "0"));
        }
        let k = max_segments.min(t);
        let row_chunks = k + (t - k) / c;
        let limit = i32::MAX as usize;
        let fits = b.checked_mul(row_chunks).and_then(|x| x.checked_mul(c)).is_some_and(|x| x <= limit)
            && b.checked_mul(t).is_some_and(|x| x <= limit)
            && b.checked_mul(max_segments).is_some_and(|x| x <= limit);
        if !fits {
            return Err(KdaError::unsupported(
                "capacity",
                format!("index tables within i32 (at most {limit} entries)"),
                format!("B = {b}, T = {t}, N = {max_segments}, C = {c}"),
            ));
        }
        Ok(Self { b, t, max_segments, c, row_chunks })
    }
    /// Batch rows B.
    pub fn b(&self) -> usize {
        self.b
    }
    /// Tokens per row T.
    pub fn t(&self) -> usize {
        self.t
    }
    /// Segment slots per row the program is compiled for.
    pub fn max_segments(&self) -> usize {
        self.max_segments
    }
    /// Chunk size C.
    pub fn chunk_size(&self) -> usize {
        self.c
    }
    /// The worst-case chunks of one row, `k + floor((T - k) / C)` with `k = min(N_max, T)`.
    pub fn row_chunks(&self) -> usize {
        self.row_chunks
    }
    /// The chunk capacity of the whole batch, `B * row_chunks`.
    pub fn chunks(&self) -> usize {
        self.b * self.row_chunks
    }
    /// Aligned slots per head, `chunks * C`.
    pub fn slots(&self) -> usize {
        self.chunks() * self.c
    }
    /// The aligned shape `[H, capacity, C, D]` of a per-token tensor.
    pub fn aligned_shape(&self, h: usize, d: usize) -> [usize; 4] {
        [h, self.chunks(), self.c, d]
    }

    /// Fills the capacity with one segmentation: the exact plan plus tables padded to capacity.
    pub fn plan(&self, table: &SegmentTable) -> Result<StaticPlan> {
        if table.b() != self.b || table.t() != self.t {
            return Err(KdaError::shape(
                "segments",
                format!("rows of the compiled capacity {}", fmt_shape(&[self.b, self.t])),
                fmt_shape(&[table.b(), table.t()]),
            ));
        }
        if table.n() > self.max_segments {
            return Err(KdaError::unsupported(
                "segments",
                format!("at most {} segments per row (the compiled capacity)", self.max_segments),
                table.n().to_string(),
            ));
        }
        let exact = SegmentPlan::new(table, self.c)?;
        let tables = IndexTables::build(&exact, self.chunks(), self.max_segments)?;
        Ok(StaticPlan { capacity: *self, exact, tables })
    }
}

/// One segmentation placed in a static capacity: the exact plan and the padded `i32` tables.
///
/// The exact plan's chunks come first; chunks past its count are unused (all sentinels, length 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticPlan {
    capacity: StaticCapacity,
    exact: SegmentPlan,
    tables: IndexTables,
}

impl StaticPlan {
    /// The compile-time capacity.
    pub fn capacity(&self) -> &StaticCapacity {
        &self.capacity
    }
    /// The exact plan this static plan was filled from.
    pub fn exact(&self) -> &SegmentPlan {
        &self.exact
    }
    /// The runtime tables, padded to the capacity.
    pub fn tables(&self) -> &IndexTables {
        &self.tables
    }
}
