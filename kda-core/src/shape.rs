//! Shapes and the two accepted layouts.

use crate::error::{KdaError, Result};
use smallvec::SmallVec;
use std::fmt;

/// A tensor shape; up to five dimensions stay inline.
pub type Shape = SmallVec<[usize; 5]>;

/// Builds a [`Shape`] from a slice.
pub fn shape(dims: &[usize]) -> Shape {
    Shape::from_slice(dims)
}

/// Formats a shape as `[a, b, c]` for error messages.
pub fn fmt_shape(dims: &[usize]) -> String {
    let inner: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("[{}]", inner.join(", "))
}

/// Where the head axis sits in per-token tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Layout {
    /// `[H, B, T, D]`: the canonical layout, what the kernels compute in.
    HeadFirst,
    /// `[B, T, H, D]`: what PyTorch users usually hold.
    #[default]
    BatchFirst,
}

impl Layout {
    /// Parses `hbtk` (head-first) or `bthk` (batch-first).
    pub fn parse(s: &str) -> Option<Layout> {
        match s {
            "hbtk" | "head-first" => Some(Layout::HeadFirst),
            "bthk" | "batch-first" => Some(Layout::BatchFirst),
            _ => None,
        }
    }
    /// The shape of a per-token tensor with feature width `d` in this layout.
    pub fn token_shape(self, h: usize, b: usize, t: usize, d: usize) -> Shape {
        match self {
            Layout::HeadFirst => shape(&[h, b, t, d]),
            Layout::BatchFirst => shape(&[b, t, h, d]),
        }
    }
    /// The shape of a per-token scalar (beta) in this layout.
    pub fn scalar_shape(self, h: usize, b: usize, t: usize) -> Shape {
        match self {
            Layout::HeadFirst => shape(&[h, b, t]),
            Layout::BatchFirst => shape(&[b, t, h]),
        }
    }
    /// Reads `(h, b, t)` off the leading three axes of a per-token tensor in this layout: a
    /// rank-3 scalar (`beta`) or a rank-4 token tensor; any other rank is a `Shape` error.
    pub fn try_hbt(self, dims: &[usize]) -> Result<(usize, usize, usize)> {
        match (self, dims) {
            (Layout::HeadFirst, &[h, b, t] | &[h, b, t, _]) => Ok((h, b, t)),
            (Layout::BatchFirst, &[b, t, h] | &[b, t, h, _]) => Ok((h, b, t)),
            _ => {
                let axes = match self {
                    Layout::HeadFirst => "[H, B, T] or [H, B, T, D]",
                    Layout::BatchFirst => "[B, T, H] or [B, T, H, D]",
                };
                Err(KdaError::shape("per-token tensor", format!("rank 3 or 4 {axes}"), fmt_shape(dims)))
            }
        }
    }
    /// [`Layout::try_hbt`] for callers that only compare the result: a shape of another rank
    /// reads as `(0, 0, 0)`, which no validated problem has, instead of panicking.
    pub fn hbt(self, dims: &[usize]) -> (usize, usize, usize) {
        self.try_hbt(dims).unwrap_or((0, 0, 0))
    }
    /// The flat index of element `(h, b, t, i)` of a per-token tensor with width `d`.
    #[inline]
    pub fn index(self, dims: &ProblemDims, h: usize, b: usize, t: usize, d: usize, i: usize) -> usize {
        match self {
            Layout::HeadFirst => ((h * dims.b + b) * dims.t + t) * d + i,
            Layout::BatchFirst => ((b * dims.t + t) * dims.h + h) * d + i,
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Layout::HeadFirst => "head-first [H,B,T,D]",
            Layout::BatchFirst => "batch-first [B,T,H,D]",
        })
    }
}

/// The sizes of one KDA problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProblemDims {
    /// Heads.
    pub h: usize,
    /// Batch rows.
    pub b: usize,
    /// Tokens per row (packed length when segments are given).
    pub t: usize,
    /// Key width.
    pub k: usize,
    /// Value width.
    pub v: usize,
    /// Segment slots per row (1 for fixed length).
    pub n: usize,
}

impl ProblemDims {
    /// The state shape `[B, N, H, K, V]`.
    pub fn state_shape(&self) -> Shape {
        shape(&[self.b, self.n, self.h, self.k, self.v])
    }
    /// Flat index of state element `(b, n, h, i, j)`.
    #[inline]
    pub fn state_index(&self, b: usize, n: usize, h: usize, i: usize, j: usize) -> usize {
        (((b * self.n + n) * self.h + h) * self.k + i) * self.v + j
    }
}
