//! What a kernel body is made of: its values, the references it reads and writes, and its
//! ops, as [`super::Body`] checked them; what every lowering reads.

use crate::hlo::{Cmp, TensorType};

/// A value of a body: its id and type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct V {
    pub(crate) id: u32,
    pub(super) body: u32,
    /// The value's type: a vector (dims non-empty) or a scalar (dims empty; i32 scalars are
    /// grid indices, table entries, loop counters and offsets; an i1 scalar is a condition).
    pub ty: TensorType,
}

/// A memory reference the body reads and writes: the block of an input or output (the window
/// of the current grid step) or a scratch buffer (kept across grid steps). Only the kernel's
/// builder makes one ([`super::KernelBuilder::input`], `output`, `scratch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ref {
    pub(super) kernel: u32,
    pub(super) place: Place,
}

/// A scalar-prefetch table of a kernel, as [`super::KernelBuilder::table`] returned it: what an
/// [`super::Index`] and [`super::Body::read_table`] read, and what [`super::Bindings::table`] binds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Table {
    pub(super) kernel: u32,
    pub(super) index: usize,
}

/// Which of its kernel's references a [`Ref`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Place {
    /// Input `i`'s block.
    Input(usize),
    /// Output `i`'s block.
    Output(usize),
    /// Scratch buffer `i`.
    Scratch(usize),
}

/// An offset into a reference: a constant, or an i32 scalar known to be a multiple of `multiple`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Offset {
    /// A constant offset.
    Const(i64),
    /// A run-time offset.
    Dyn(V, i64),
}

/// Elementwise binary ops (both operands of one type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b` (floats)
    Div,
    /// `max(a, b)`
    Max,
    /// `min(a, b)`
    Min,
}

/// Elementwise unary ops on floats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    /// `exp(x)`
    Exp,
    /// `2^x` (what a TPU's transcendental unit computes: `exp(x)` costs a multiply more)
    Exp2,
    /// `ln(x)`
    Log,
    /// `ln(1 + x)`, accurate for small `x`
    Log1p,
    /// `1 / sqrt(x)`
    Rsqrt,
    /// `tanh(x)`
    Tanh,
    /// `-x`
    Neg,
}

/// Reductions over one axis (the axis kept with size 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
}

/// How [`super::Body::cumsum`] runs along its axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// From the last element to the first: each element sums itself and what follows it.
    pub reverse: bool,
    /// Each element's sum leaves itself out (the first element of a segment sums to 0).
    pub exclusive: bool,
}

/// Matmul precision, per product: `Default` is the native bf16 pass (the only choice for bf16
/// operands); the others take f32 operands. On a TPU (Mosaic) every one but `Default` runs at
/// full precision (the `fp32` contract precision); a GPU (Triton) runs each as it says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatPrecision {
    /// One bf16 pass: f32 operands rounded to bf16, exact products, f32 sums.
    Default,
    /// Full f32: Mosaic's `fp32`; on a GPU as the kernel's `TritonParams::f32_dot` says.
    Highest,
    /// One TF32 pass (GPU tensor cores: operands rounded to 10 mantissa bits).
    Tf32,
    /// Three TF32 passes: each operand split into a TF32 part and the TF32 of its rest, the
    /// three largest cross products summed (the small ones first).
    Tf32x3,
    /// Three bf16 passes, split as [`MatPrecision::Tf32x3`] with bf16 parts.
    Bf16x3,
    /// IEEE f32 products on a GPU's FMA units (no tensor cores).
    Ieee,
}

/// One op of a body.
#[derive(Clone, Debug)]
pub enum Op {
    /// Grid index `axis` of the current step.
    ProgramId { out: V, axis: usize },
    /// An i32 scalar constant.
    IndexConst { out: V, value: i64 },
    /// i32 scalar arithmetic.
    IndexBinary { out: V, op: Binary, a: V, b: V },
    /// Entry `index` of scalar-prefetch table `table` (its position).
    ReadTable { out: V, table: usize, index: V },
    /// A vector of one value.
    Splat { out: V, value: f64 },
    /// A block of `out.ty.dims` from `from` at `offsets`; with `rows` (an i32 scalar), the
    /// window's rows (dim 0) from `rows` on are not read and hold zero.
    Load { out: V, from: Ref, offsets: Vec<Offset>, rows: Option<V> },
    /// Writes `value` into `to` at `offsets`; with `rows`, only the window's rows (dim 0) below
    /// `rows`, the rest of memory left as it was.
    Store { to: Ref, offsets: Vec<Offset>, value: V, rows: Option<V> },
    /// `a x b` contracting `a`'s dim `contract.0` with `b`'s dim `contract.1` (2-D operands,
    /// output `[a free, b free]`, f32 accumulation).
    Matmul { out: V, a: V, b: V, contract: (usize, usize), precision: MatPrecision },
    /// Elementwise binary op.
    Binary { out: V, op: Binary, a: V, b: V },
    /// Elementwise unary op.
    Unary { out: V, op: Unary, a: V },
    /// i32 indices along `dim`.
    Iota { out: V, dim: usize },
    /// Comparison into an i1 value of the same dims.
    Compare { out: V, cmp: Cmp, a: V, b: V },
    /// `cond ? a : b` elementwise.
    Select { out: V, cond: V, a: V, b: V },
    /// Reduction over `axis`, kept with size 1.
    Reduce { out: V, op: Reduction, a: V, axis: usize },
    /// Running sums of `a` along `axis` as `scan` says, restarting where the i1 `starts` holds.
    Cumsum { out: V, a: V, axis: usize, scan: Scan, starts: Option<V> },
    /// Stretches size-1 dims (and prepends leading ones) to `out`'s dims.
    Broadcast { out: V, a: V },
    /// Element type conversion.
    Cast { out: V, a: V },
    /// 2-D transpose.
    Transpose { out: V, a: V },
    /// Same elements, other dims.
    Reshape { out: V, a: V },
    /// The `out.ty.dims` block of `a` from `starts` (static).
    Slice { out: V, a: V, starts: Vec<i64> },
    /// `parts` side by side along `dim`.
    Concat { out: V, parts: Vec<V>, dim: usize },
    /// Runs `then` when the i1 scalar `cond` holds (stores only; no values come out).
    If { cond: V, then: Vec<Op> },
    /// `for i in lo..hi` carrying `init` as `args`; the body's `yields` become `outs`. With
    /// `until` (an i32 scalar) the loop stops there when it is below `hi`: `lo..min(hi, until)`.
    For {
        lo: i64,
        hi: i64,
        until: Option<V>,
        /// The trips a static count of the work takes ([`super::work`]): `hi - lo`, or the
        /// mean over the programs that a run-time bound gives.
        mean_trips: f64,
        index: V,
        init: Vec<V>,
        args: Vec<V>,
        body: Vec<Op>,
        yields: Vec<V>,
        outs: Vec<V>,
    },
}

/// What an op of a body is, without its operands: one kind per [`super::Body`] method that adds an
/// op ([`super::Kernel::walk`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum OpKind {
    /// A grid index ([`super::Body::program_id`]).
    ProgramId,
    /// An i32 scalar constant ([`super::Body::index`]).
    IndexConst,
    /// i32 scalar arithmetic ([`super::Body::index_op`]).
    IndexBinary,
    /// A scalar-prefetch table entry ([`super::Body::read_table`]).
    ReadTable,
    /// A vector of one value ([`super::Body::splat`]).
    Splat,
    /// A block read from a reference ([`super::Body::load`]).
    Load,
    /// A block written to a reference ([`super::Body::store`]).
    Store,
    /// A block read from a reference with its rows from a run-time count on left unread
    /// ([`super::Body::load_rows`]).
    LoadRows,
    /// A block's rows below a run-time count written to a reference
    /// ([`super::Body::store_rows`]).
    StoreRows,
    /// A matrix product ([`super::Body::matmul`]).
    Matmul,
    /// An elementwise binary op ([`super::Body::add`], `sub`, `mul`, `div`, `max`, `min`).
    Binary,
    /// An elementwise unary op ([`super::Body::unary`]).
    Unary,
    /// Indices along a dim ([`super::Body::iota`]).
    Iota,
    /// A comparison ([`super::Body::compare`]).
    Compare,
    /// An elementwise select ([`super::Body::select`]).
    Select,
    /// A reduction over an axis ([`super::Body::reduce`]).
    Reduce,
    /// Running sums along an axis ([`super::Body::cumsum`]).
    Cumsum,
    /// A broadcast ([`super::Body::broadcast`]).
    Broadcast,
    /// An element type conversion ([`super::Body::cast`]).
    Cast,
    /// A 2-D transpose ([`super::Body::transpose`]).
    Transpose,
    /// A reshape ([`super::Body::reshape`]).
    Reshape,
    /// A static slice ([`super::Body::slice`]).
    Slice,
    /// A concatenation ([`super::Body::concat`]).
    Concat,
    /// A conditional region ([`super::Body::when`]).
    If,
    /// A counted loop region ([`super::Body::for_range`]).
    For,
}

impl Op {
    /// The op's kind.
    pub(crate) fn kind(&self) -> OpKind {
        match self {
            Op::ProgramId { .. } => OpKind::ProgramId,
            Op::IndexConst { .. } => OpKind::IndexConst,
            Op::IndexBinary { .. } => OpKind::IndexBinary,
            Op::ReadTable { .. } => OpKind::ReadTable,
            Op::Splat { .. } => OpKind::Splat,
            Op::Load { rows: None, .. } => OpKind::Load,
            Op::Load { rows: Some(_), .. } => OpKind::LoadRows,
            Op::Store { rows: None, .. } => OpKind::Store,
            Op::Store { rows: Some(_), .. } => OpKind::StoreRows,
            Op::Matmul { .. } => OpKind::Matmul,
            Op::Binary { .. } => OpKind::Binary,
            Op::Unary { .. } => OpKind::Unary,
            Op::Iota { .. } => OpKind::Iota,
            Op::Compare { .. } => OpKind::Compare,
            Op::Select { .. } => OpKind::Select,
            Op::Reduce { .. } => OpKind::Reduce,
            Op::Cumsum { .. } => OpKind::Cumsum,
            Op::Broadcast { .. } => OpKind::Broadcast,
            Op::Cast { .. } => OpKind::Cast,
            Op::Transpose { .. } => OpKind::Transpose,
            Op::Reshape { .. } => OpKind::Reshape,
            Op::Slice { .. } => OpKind::Slice,
            Op::Concat { .. } => OpKind::Concat,
            Op::If { .. } => OpKind::If,
            Op::For { .. } => OpKind::For,
        }
    }
}
