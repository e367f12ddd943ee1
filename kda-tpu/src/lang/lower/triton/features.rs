//! What the Triton lowering has no form for: the parts of the language a kernel may use that
//! TTIR cannot hold as this lowering writes it, found before any text is written.

use crate::lang::ir::{Offset, Op, Place};
use crate::lang::kernel::{Kernel, Semantics};

/// Each dim rounded up to a power of two: the dims of the Triton tensor that holds a value.
pub(crate) fn padded(dims: &[i64]) -> Vec<i64> {
    dims.iter().map(|&d| (d.max(1) as u64).next_power_of_two() as i64).collect()
}

/// A part of the kernel language that the Triton lowering has no form for.
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
    /// A reverse cumsum with segments (the segmented scan here runs forward only).
    ReverseSegmentedScan,
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
            Feature::ReverseSegmentedScan => "a reverse cumsum with segments (forward only here)",
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
            Op::Load { from, offsets, out: v, .. } | Op::Store { to: from, offsets, value: v, .. } => {
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
            Op::Cumsum { scan, starts: Some(_), .. } if scan.reverse => {
                out.push((Feature::ReverseSegmentedScan, "cumsum".to_string()))
            }
            Op::If { then, .. } => used(k, then, out),
            Op::For { body, .. } => used(k, body, out),
            _ => {}
        }
    }
}

/// Every part of `k` the Triton lowering has no form for, with where the kernel uses it.
pub fn features(k: &Kernel) -> Vec<(Feature, String)> {
    let mut out = Vec::new();
    let parallel: Vec<i64> =
        k.grid.iter().filter(|(_, s)| *s == Semantics::Parallel).map(|(n, _)| *n).collect();
    if parallel.len() > 3 || parallel.iter().skip(1).any(|&n| n > 65_535) {
        out.push((Feature::WideGrid, format!("parallel axes {parallel:?}")));
    }
    for o in k.inputs.iter().chain(&k.outputs) {
        if o.ty.num_elements() >= 1 << 31 {
            out.push((Feature::HugeArray, format!("`{}` {}", o.name, o.ty)));
        }
    }
    used(k, &k.body, &mut out);
    out
}
