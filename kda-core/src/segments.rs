//! Packed-sequence metadata (docs/kda.md, Packing) and its validated form.

use crate::error::{KdaError, Result};
use std::ops::Range;

/// Segment metadata as the caller gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum Segments {
    /// One `cu_seqlens` `[N+1]` per row: starts at 0, non-decreasing, ends at or before T.
    /// Tokens after the last boundary are padding.
    CuSeqlens(Vec<Vec<i64>>),
    /// `segment_ids [B, T]`: 1-indexed, contiguous, in order; 0 marks padding after the last
    /// segment. N is the largest id over the rows; rows with fewer segments get empty ones.
    SegmentIds(Vec<Vec<i64>>),
}

/// Validated segments: for every row, exactly N token ranges in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentTable {
    t: usize,
    rows: Vec<Vec<Range<usize>>>,
    packed: bool,
}

impl SegmentTable {
    /// Fixed length: each of `b` rows is one segment of `t` tokens.
    pub fn fixed(b: usize, t: usize) -> Self {
        Self { t, rows: vec![vec![0..t]; b], packed: false }
    }
    /// A packed table from per-row ranges; validates as [`Segments::CuSeqlens`] does.
    pub fn from_ranges(t: usize, rows: Vec<Vec<Range<usize>>>) -> Result<Self> {
        let cu: Vec<Vec<i64>> = rows
            .iter()
            .map(|r| {
                let mut c = vec![0i64];
                c.extend(r.iter().map(|x| x.end as i64));
                c
            })
            .collect();
        let table = validate_cu_seqlens(&cu, rows.len(), t)?;
        if table.rows != rows {
            return Err(KdaError::segments("ranges", "adjacent ranges starting at 0", format!("{rows:?}")));
        }
        Ok(table)
    }
    /// Tokens per row.
    pub fn t(&self) -> usize {
        self.t
    }
    /// Rows.
    pub fn b(&self) -> usize {
        self.rows.len()
    }
    /// Segment slots per row.
    pub fn n(&self) -> usize {
        self.rows.first().map_or(0, |r| r.len())
    }
    /// True when built from `cu_seqlens` or `segment_ids`.
    pub fn is_packed(&self) -> bool {
        self.packed
    }
    /// The segments of row `b`, or a `Shape` error naming the row count when `b >= B`.
    pub fn row(&self, b: usize) -> Result<&[Range<usize>]> {
        self.rows.get(b).map(Vec::as_slice).ok_or_else(|| {
            KdaError::shape("segment row", format!("row < B = {}", self.rows.len()), format!("row {b}"))
        })
    }
    /// The token range of segment `n` of row `b`, or a `Shape` error when either is out of range
    /// (like `SegmentPlan::segment` in kda-packed).
    pub fn segment(&self, b: usize, n: usize) -> Result<Range<usize>> {
        let (rows, slots) = (self.b(), self.n());
        self.rows.get(b).and_then(|r| r.get(n)).cloned().ok_or_else(|| {
            KdaError::shape(
                "segment",
                format!("row < {rows} and slot < {slots}"),
                format!("row {b}, slot {n}"),
            )
        })
    }
    /// All rows.
    pub fn rows(&self) -> &[Vec<Range<usize>>] {
        &self.rows
    }
    /// Real (non-padding) tokens in row `b`; 0 for a row past B, which has none. The one
    /// accessor that stays infallible, as padding loops outside this crate read it directly;
    /// [`SegmentTable::row`] is the checked way to ask whether the row exists.
    pub fn real_tokens(&self, b: usize) -> usize {
        self.rows.get(b).and_then(|r| r.last()).map_or(0, |r| r.end)
    }
    /// The segment owning token `t` of row `b` (`None` for padding or `t >= T`), or a `Shape`
    /// error when `b >= B`.
    pub fn owner(&self, b: usize, t: usize) -> Result<Option<usize>> {
        Ok(self.row(b)?.iter().position(|r| r.contains(&t)))
    }
    /// The `cu_seqlens` of row `b`, or a `Shape` error when `b >= B`.
    pub fn cu_seqlens(&self, b: usize) -> Result<Vec<i64>> {
        let mut c = vec![0i64];
        c.extend(self.row(b)?.iter().map(|r| r.end as i64));
        Ok(c)
    }
}

impl Segments {
    /// Validates against `b` rows of `t` tokens.
    pub fn validate(&self, b: usize, t: usize) -> Result<SegmentTable> {
        match self {
            Segments::CuSeqlens(cu) => validate_cu_seqlens(cu, b, t),
            Segments::SegmentIds(ids) => validate_segment_ids(ids, b, t),
        }
    }
}

fn validate_cu_seqlens(cu: &[Vec<i64>], b: usize, t: usize) -> Result<SegmentTable> {
    const ARG: &str = "cu_seqlens";
    if cu.len() != b {
        return Err(KdaError::segments(
            ARG,
            format!("one row per batch row ({b})"),
            format!("{} rows", cu.len()),
        ));
    }
    let width = cu.first().map_or(0, |r| r.len());
    let mut rows = Vec::with_capacity(b);
    for (row, c) in cu.iter().enumerate() {
        if c.len() < 2 {
            return Err(KdaError::segments(
                ARG,
                "at least 2 entries ([N+1] with N >= 1)",
                format!("{} entries in row {row}", c.len()),
            ));
        }
        if c.len() != width {
            return Err(KdaError::segments(
                ARG,
                format!("the same N+1 = {width} entries in every row"),
                format!("{} in row {row}", c.len()),
            ));
        }
        if c[0] != 0 {
            return Err(KdaError::segments(ARG, "a first entry of 0", format!("{} in row {row}", c[0])));
        }
        let mut ranges = Vec::with_capacity(c.len() - 1);
        for (i, w) in c.windows(2).enumerate() {
            if w[1] < w[0] {
                return Err(KdaError::segments(
                    ARG,
                    "non-decreasing entries",
                    format!("{} after {} at index {} of row {row}", w[1], w[0], i + 1),
                ));
            }
            if w[1] as u64 > t as u64 {
                return Err(KdaError::segments(
                    ARG,
                    format!("entries at most T = {t}"),
                    format!("{} at index {} of row {row}", w[1], i + 1),
                ));
            }
            ranges.push(w[0] as usize..w[1] as usize);
        }
        rows.push(ranges);
    }
    Ok(SegmentTable { t, rows, packed: true })
}

fn validate_segment_ids(ids: &[Vec<i64>], b: usize, t: usize) -> Result<SegmentTable> {
    const ARG: &str = "segment_ids";
    if ids.len() != b {
        return Err(KdaError::segments(ARG, format!("shape [B={b}, T={t}]"), format!("{} rows", ids.len())));
    }
    let mut rows = Vec::with_capacity(b);
    for (row, r) in ids.iter().enumerate() {
        if r.len() != t {
            return Err(KdaError::segments(
                ARG,
                format!("T = {t} ids per row"),
                format!("{} in row {row}", r.len()),
            ));
        }
        let mut ranges: Vec<Range<usize>> = Vec::new();
        let mut padding_from: Option<usize> = None;
        for (pos, &id) in r.iter().enumerate() {
            let current = ranges.len() as i64;
            if id < 0 {
                return Err(KdaError::segments(ARG, "ids >= 0", format!("{id} at row {row}, token {pos}")));
            }
            if id == 0 {
                padding_from.get_or_insert(pos);
                continue;
            }
            if let Some(p) = padding_from {
                return Err(KdaError::segments(
                    ARG,
                    "padding (0) only after the last segment",
                    format!("id {id} at token {pos} after padding at token {p} in row {row}"),
                ));
            }
            if id == current {
                if let Some(last) = ranges.last_mut() {
                    last.end = pos + 1;
                }
            } else if id == current + 1 {
                ranges.push(pos..pos + 1);
            } else {
                return Err(KdaError::segments(
                    ARG,
                    format!("contiguous ids in order ({current} or {})", current + 1),
                    format!("{id} at row {row}, token {pos}"),
                ));
            }
        }
        rows.push(ranges);
    }
    let n = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    if n == 0 {
        return Err(KdaError::segments(ARG, "at least one segment", "only padding"));
    }
    for r in &mut rows {
        let end = r.last().map_or(0, |x| x.end);
        while r.len() < n {
            r.push(end..end);
        }
    }
    Ok(SegmentTable { t, rows, packed: true })
}
