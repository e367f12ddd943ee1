//! Shared test helpers: a seeded PRNG (PCG-64) and segmentation generators.
#![allow(dead_code)]

pub mod packed_io;
pub mod segment_view;

use kda_core::{bf16, SegmentTable};
use std::ops::Range;

/// A seeded PCG-64 (the generator of every test input in the workspace).
pub struct Rng(rand_pcg::Pcg64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(rand_pcg::Pcg64::new(u128::from(seed), 0))
    }
    pub fn next_u64(&mut self) -> u64 {
        rand_core::Rng::next_u64(&mut self.0)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit() as f32).collect()
    }
    pub fn bf16s(&mut self, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f64(self.unit())).collect()
    }
}

/// Ranges from per-row lengths, T = `t`.
pub fn table(t: usize, rows: &[Vec<usize>]) -> SegmentTable {
    let ranges: Vec<Vec<Range<usize>>> = rows
        .iter()
        .map(|lens| {
            let mut at = 0;
            lens.iter()
                .map(|&l| {
                    at += l;
                    at - l..at
                })
                .collect()
        })
        .collect();
    SegmentTable::from_ranges(t, ranges).expect("generated segmentation is valid")
}

/// The lengths that matter at chunk size `c`: 0, 1, C-1, C, C+1.
pub fn edge_lengths(c: usize) -> [usize; 5] {
    [0, 1, c - 1, c, c + 1]
}

/// A random segmentation at chunk size `c`: B in 1..=3, N in 1..=5, lengths mixing the edge
/// lengths with random ones, different per row, sometimes trailing padding, sometimes one
/// segment filling the row, sometimes many one-token segments.
pub fn random_table(rng: &mut Rng, c: usize) -> SegmentTable {
    let b = 1 + rng.below(3);
    let style = rng.below(8);
    let n = match style {
        0 => 1,
        1 => 2 * c + rng.below(c),
        _ => 1 + rng.below(5),
    };
    let edges = edge_lengths(c);
    let rows: Vec<Vec<usize>> = (0..b)
        .map(|_| {
            (0..n)
                .map(|_| match style {
                    1 => 1,
                    _ if rng.below(2) == 0 => edges[rng.below(5)],
                    _ => rng.below(3 * c + 2),
                })
                .collect()
        })
        .collect();
    let longest = rows.iter().map(|r| r.iter().sum::<usize>()).max().unwrap_or(0);
    let pad = if rng.below(3) == 0 { 0 } else { rng.below(c + 2) };
    table((longest + pad).max(1), &rows)
}

/// `sum ceil(L / C)` computed directly from the table.
pub fn expected_chunks(t: &SegmentTable, c: usize) -> usize {
    t.rows().iter().flatten().map(|r| r.len().div_ceil(c)).sum()
}
