//! The lowerings, and what a kernel uses that not every lowering takes: each lowering's
//! capability flags ([`Lowering::takes`]) and the check that refuses a kernel before its text is
//! written ([`Kernel::check_lowering`]).

use super::body::{Offset, Op, Place};
use super::kernel::{Kernel, Semantics};
use crate::error::{Result, TpuError};

/// How a kernel is lowered: to Mosaic (for libtpu), to Triton (for XLA's CUDA plugin), or to
/// plain StableHLO (any plugin).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lowering {
    /// A `tpu_custom_call` holding the Mosaic text.
    Mosaic,
    /// The interpret lowering.
    Interpret,
    /// A `__gpu$xla.gpu.triton` custom call holding the Triton IR text.
    Triton,
}

/// Each dim rounded up to a power of two: the dims of the Triton tensor that holds a value.
pub(super) fn padded(dims: &[i64]) -> Vec<i64> {
    dims.iter().map(|&d| (d.max(1) as u64).next_power_of_two() as i64).collect()
}

/// A part of the kernel language that some lowering has no form for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    /// A scratch buffer read or written in part, or at run-time offsets (Triton holds scratch
    /// as a value, used whole).
    ScratchWindow,
    /// A result block read back (Triton stores results straight to memory).
    ResultRead,
    /// A store into an input block (on a GPU it would write the caller's buffer).
    InputWrite,
    /// A reshape of a value with a dim that is not a power of two (Triton pads such dims).
    PaddedReshape,
    /// A slice or concat whose parts are not power-of-two blocks at multiples of their size.
    UnalignedPart,
    /// More than three parallel grid axes, or over 65,535 steps on the second or third.
    WideGrid,
    /// An array of 2^31 elements or more (Triton offsets are i32).
    HugeArray,
    /// A block whose last two dims are neither multiples of the TPU's (8, 128) tiling ((16,
    /// 128) for 16-bit types) nor the full dims (Mosaic's rule).
    OffTiling,
}

impl Feature {
    /// What the feature is, for errors.
    pub fn describe(self) -> &'static str {
        match self {
            Feature::ScratchWindow => {
                "a scratch buffer used in part (Triton keeps scratch whole, as a value)"
            }
            Feature::ResultRead => "a result block read back (Triton writes results straight to memory)",
            Feature::InputWrite => "a store into an input block",
            Feature::PaddedReshape => "a reshape of a value whose dims are not powers of two",
            Feature::UnalignedPart => {
                "a slice or concat of parts that are not power-of-two blocks at multiples of their size"
            }
            Feature::WideGrid => "more than 3 parallel grid axes, or over 65,535 steps on the 2nd or 3rd",
            Feature::HugeArray => "an array of 2^31 elements or more",
            Feature::OffTiling => "a block off the TPU's tiling",
        }
    }
}

impl Lowering {
    /// Whether this lowering takes `feature`. The interpret lowering takes the whole language;
    /// Mosaic all but blocks off its tiling; Triton none but those.
    pub fn takes(self, feature: Feature) -> bool {
        match self {
            Lowering::Interpret => true,
            Lowering::Mosaic => feature != Feature::OffTiling,
            Lowering::Triton => feature == Feature::OffTiling,
        }
    }
}

fn pow2(n: i64) -> bool {
    n > 0 && (n & (n - 1)) == 0
}

/// Every feature `ops` use, with the op that uses it.
fn used(k: &Kernel, ops: &[Op], out: &mut Vec<(Feature, String)>) {
    for op in ops {
        match op {
            Op::Load { from, offsets, out: v } | Op::Store { to: from, offsets, value: v } => {
                let store = matches!(op, Op::Store { .. });
                match from.place {
                    Place::Scratch(i) => {
                        let whole = offsets.iter().all(|o| *o == Offset::Const(0))
                            && v.ty.dims == k.scratch[i].1.dims;
                        if !whole {
                            out.push((Feature::ScratchWindow, format!("scratch `{}`", k.scratch[i].0)));
                        }
                    }
                    Place::Output(i) if !store => {
                        out.push((Feature::ResultRead, format!("result `{}`", k.outputs[i].name)))
                    }
                    Place::Input(i) if store => {
                        out.push((Feature::InputWrite, format!("input `{}`", k.inputs[i].name)))
                    }
                    _ => {}
                }
            }
            Op::Reshape { out: o, a }
                if padded(&a.ty.dims) != a.ty.dims || padded(&o.ty.dims) != o.ty.dims =>
            {
                out.push((Feature::PaddedReshape, format!("reshape {:?} to {:?}", a.ty.dims, o.ty.dims)));
            }
            Op::Slice { out: o, a, starts } => {
                let aligned = (0..starts.len()).all(|d| {
                    let (s, full) = (o.ty.dims[d], a.ty.dims[d]);
                    s == full || (pow2(s) && pow2(full) && starts[d] % s == 0)
                });
                if !aligned {
                    out.push((
                        Feature::UnalignedPart,
                        format!("slice {:?} at {starts:?} of {:?}", o.ty.dims, a.ty.dims),
                    ));
                }
            }
            Op::Concat { parts, dim, .. } => {
                let first = &parts[0].ty.dims;
                let aligned = parts.iter().all(|p| &p.ty.dims == first)
                    && pow2(first[*dim])
                    && pow2(parts.len() as i64);
                if !aligned {
                    let dims: Vec<_> = parts.iter().map(|p| p.ty.dims.clone()).collect();
                    out.push((Feature::UnalignedPart, format!("concat of {dims:?} along {dim}")));
                }
            }
            Op::If { then, .. } => used(k, then, out),
            Op::For { body, .. } => used(k, body, out),
            _ => {}
        }
    }
}

impl Kernel {
    /// Every feature this kernel uses that some lowering may refuse, with where.
    pub fn features(&self) -> Vec<(Feature, String)> {
        let mut out = Vec::new();
        let parallel: Vec<i64> =
            self.grid.iter().filter(|(_, s)| *s == Semantics::Parallel).map(|(n, _)| *n).collect();
        if parallel.len() > 3 || parallel.iter().skip(1).any(|&n| n > 65_535) {
            out.push((Feature::WideGrid, format!("parallel axes {parallel:?}")));
        }
        for o in self.inputs.iter().chain(&self.outputs) {
            if o.ty.num_elements() >= 1 << 31 {
                out.push((Feature::HugeArray, format!("`{}` {}", o.name, o.ty)));
            }
            if let Some(why) = o.off_tiling() {
                out.push((Feature::OffTiling, format!("`{}`: {why}", o.name)));
            }
        }
        used(self, &self.body, &mut out);
        out
    }

    /// Refuses the kernel for `lowering` when it uses a feature the lowering does not take: an
    /// `Unsupported` error naming the feature and where the kernel uses it.
    pub fn check_lowering(&self, lowering: Lowering) -> Result<()> {
        match self.features().into_iter().find(|(f, _)| !lowering.takes(*f)) {
            None => Ok(()),
            Some((f, at)) => Err(TpuError::unsupported(
                format!("{lowering:?} lowering of kernel {}", self.name),
                format!("{}: {at}", f.describe()),
            )),
        }
    }
}
