//! A kernel body built op by op ([`super::ir`] holds what it is made of). Every op's shape and
//! dtype rule, and the visibility of its operands, is checked here, once, when the op is added; every lowering
//! ([`super::lower`]) takes the checked ops as they are.

use kda_core::DType;

use super::ir::{Binary, MatPrecision, Offset, Op, Place, Reduction, Ref, Scan, Table, Unary, V};
use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, TensorType};

fn err(op: &str, message: impl Into<String>) -> TpuError {
    TpuError::builder(format!("kernel op {op}"), message)
}

/// True for non-empty dims, each at least 1.
fn positive(dims: &[i64]) -> bool {
    !dims.is_empty() && dims.iter().all(|&d| d >= 1)
}

/// A distinct tag per body, so that a value of one body is refused by another.
static BODIES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn fmt_ty(t: &TensorType) -> String {
    if t.dims.is_empty() {
        t.elem.to_string()
    } else {
        let d: Vec<String> = t.dims.iter().map(i64::to_string).collect();
        format!("vector<{}x{}>", d.join("x"), t.elem)
    }
}

/// What a body may refer to, set by the kernel: the grid rank, the tables and each reference's
/// block type.
#[derive(Clone, Debug, Default)]
pub(crate) struct Scope {
    pub(crate) kernel: u32,
    pub(crate) grid: usize,
    pub(crate) tables: usize,
    pub(crate) inputs: Vec<TensorType>,
    pub(crate) outputs: Vec<TensorType>,
    pub(crate) scratch: Vec<TensorType>,
}

impl Scope {
    fn of(&self, r: Ref) -> Option<&TensorType> {
        if r.kernel != self.kernel {
            return None;
        }
        match r.place {
            Place::Input(i) => self.inputs.get(i),
            Place::Output(i) => self.outputs.get(i),
            Place::Scratch(i) => self.scratch.get(i),
        }
    }
}

/// Builds a body op by op; each method checks its operands and returns the typed result.
pub struct Body {
    scope: Scope,
    /// The precision of [`Body::dot`]'s f32 products.
    precision: MatPrecision,
    tag: u32,
    next: u32,
    ops: Vec<Vec<Op>>,
    /// The values defined in each open region (the body's own first).
    live: Vec<std::collections::HashSet<u32>>,
}

impl Body {
    pub(crate) fn new(scope: Scope) -> Self {
        let tag = BODIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Body {
            scope,
            precision: MatPrecision::Highest,
            tag,
            next: 0,
            ops: vec![Vec::new()],
            live: vec![Default::default()],
        }
    }

    pub(crate) fn finish(mut self) -> Result<Vec<Op>> {
        match self.ops.len() {
            1 => Ok(self.ops.pop().unwrap_or_default()),
            _ => Err(err("body", "an `when` or `for_range` region was left open")),
        }
    }

    fn fresh(&mut self, ty: TensorType) -> V {
        self.next += 1;
        if let Some(l) = self.live.last_mut() {
            l.insert(self.next);
        }
        V { id: self.next, body: self.tag, ty }
    }

    /// Checks that `op`'s operands are values of this body visible here (not from another
    /// body, nor from inside a region that has closed).
    fn uses(&self, op: &str, vs: &[&V]) -> Result<()> {
        for v in vs {
            if v.body != self.tag || !self.live.iter().any(|l| l.contains(&v.id)) {
                return Err(err(
                    op,
                    format!("value {} is not visible here (another body, or a closed region)", v.id),
                ));
            }
        }
        Ok(())
    }

    fn open(&mut self) {
        self.ops.push(Vec::new());
        self.live.push(Default::default());
    }

    fn close(&mut self) -> Vec<Op> {
        self.live.pop();
        self.ops.pop().unwrap_or_default()
    }

    fn push(&mut self, op: Op) {
        if let Some(block) = self.ops.last_mut() {
            block.push(op);
        }
    }

    /// Grid index `axis` of the current step (i32).
    pub fn program_id(&mut self, axis: usize) -> Result<V> {
        if axis >= self.scope.grid {
            return Err(err("program_id", format!("axis {axis} of a grid of rank {}", self.scope.grid)));
        }
        let out = self.fresh(TensorType::scalar(DType::I32));
        self.push(Op::ProgramId { out: out.clone(), axis });
        Ok(out)
    }

    /// An i32 scalar.
    pub fn index(&mut self, value: i64) -> Result<V> {
        if i32::try_from(value).is_err() {
            return Err(err("index", format!("{value} does not fit in i32")));
        }
        let out = self.fresh(TensorType::scalar(DType::I32));
        self.push(Op::IndexConst { out: out.clone(), value });
        Ok(out)
    }

    /// i32 scalar `a op b` (`Add`, `Sub`, `Mul`, `Max`, `Min`).
    pub fn index_op(&mut self, op: Binary, a: &V, b: &V) -> Result<V> {
        self.uses("index_op", &[a, b])?;
        if a.ty != TensorType::scalar(DType::I32)
            || b.ty != TensorType::scalar(DType::I32)
            || op == Binary::Div
        {
            return Err(err("index_op", format!("{op:?} of {} and {}", fmt_ty(&a.ty), fmt_ty(&b.ty))));
        }
        let out = self.fresh(TensorType::scalar(DType::I32));
        self.push(Op::IndexBinary { out: out.clone(), op, a: a.clone(), b: b.clone() });
        Ok(out)
    }

    /// Entry `index` (an i32 scalar) of scalar-prefetch table `table`.
    pub fn read_table(&mut self, table: Table, index: &V) -> Result<V> {
        self.uses("read_table", &[index])?;
        let mine = table.kernel == self.scope.kernel && table.index < self.scope.tables;
        if !mine || index.ty != TensorType::scalar(DType::I32) {
            return Err(err(
                "read_table",
                format!("{table:?} must be this kernel's, read at an i32 index (not {})", fmt_ty(&index.ty)),
            ));
        }
        let table = table.index;
        let out = self.fresh(TensorType::scalar(DType::I32));
        self.push(Op::ReadTable { out: out.clone(), table, index: index.clone() });
        Ok(out)
    }

    /// A vector of `dims` holding `value` (f32, bf16 or i32).
    pub fn splat(&mut self, value: f64, dtype: DType, dims: &[i64]) -> Result<V> {
        if !positive(dims) || !matches!(dtype, DType::F32 | DType::BF16 | DType::I32) {
            return Err(err("splat", format!("{dtype} of dims {dims:?}")));
        }
        let integral = value.fract() == 0.0 && value >= f64::from(i32::MIN) && value <= f64::from(i32::MAX);
        if dtype == DType::I32 && !integral {
            return Err(err("splat", format!("{value} is not an i32")));
        }
        let out = self.fresh(TensorType::new(dtype, dims));
        self.push(Op::Splat { out: out.clone(), value });
        Ok(out)
    }

    fn check_window(&self, op: &str, r: Ref, offsets: &[Offset], dims: &[i64]) -> Result<TensorType> {
        let ty =
            self.scope.of(r).ok_or_else(|| err(op, format!("{r:?} is not a reference of the kernel")))?;
        for o in offsets {
            if let Offset::Dyn(v, _) = o {
                self.uses(op, &[v])?;
            }
        }
        if offsets.len() != ty.dims.len() || dims.len() != ty.dims.len() || !positive(dims) {
            return Err(err(op, format!("{} offsets and dims {dims:?} into {}", offsets.len(), fmt_ty(ty))));
        }
        for (i, (o, (&d, &full))) in offsets.iter().zip(dims.iter().zip(&ty.dims)).enumerate() {
            match o {
                Offset::Const(c) if *c < 0 || c + d > full => {
                    return Err(err(op, format!("dim {i}: {c}..{} outside {}", c + d, fmt_ty(ty))))
                }
                Offset::Dyn(v, m) if v.ty != TensorType::scalar(DType::I32) || *m < 1 || d > full => {
                    return Err(err(
                        op,
                        format!("dim {i}: offset {} (multiple of {m}) into {}", fmt_ty(&v.ty), fmt_ty(ty)),
                    ))
                }
                _ => {}
            }
        }
        Ok(ty.clone())
    }

    /// A `dims` block of `from` at `offsets`, in `from`'s element type.
    pub fn load(&mut self, from: Ref, offsets: &[Offset], dims: &[i64]) -> Result<V> {
        self.load_op(from, offsets, dims, None)
    }

    /// The whole of `from`.
    pub fn load_all(&mut self, from: Ref) -> Result<V> {
        let ty = self
            .scope
            .of(from)
            .cloned()
            .ok_or_else(|| err("load", format!("{from:?} is not a reference")))?;
        let zeros = vec![Offset::Const(0); ty.dims.len()];
        self.load(from, &zeros, &ty.dims)
    }

    /// A masked [`Body::load`]: the window's rows (dim 0) from the i32 `rows` on unread, zero.
    pub fn load_rows(&mut self, from: Ref, offsets: &[Offset], dims: &[i64], rows: &V) -> Result<V> {
        self.masked("load_rows", from, rows, dims)?;
        self.load_op(from, offsets, dims, Some(rows))
    }

    fn load_op(&mut self, from: Ref, offsets: &[Offset], dims: &[i64], rows: Option<&V>) -> Result<V> {
        let ty = self.check_window("load", from, offsets, dims)?;
        let out = self.fresh(TensorType::new(ty.elem, dims));
        self.push(Op::Load { out: out.clone(), from, offsets: offsets.to_vec(), rows: rows.cloned() });
        Ok(out)
    }

    /// Refuses a masked access by a non-i32 count, of a 1-D window or of a scratch buffer.
    fn masked(&self, op: &str, r: Ref, rows: &V, dims: &[i64]) -> Result<()> {
        self.uses(op, &[rows])?;
        let bad = rows.ty != TensorType::scalar(DType::I32) || dims.len() < 2;
        match bad || matches!(r.place, Place::Scratch(_)) {
            true => Err(err(op, format!("{} rows of a {dims:?} window of {r:?}", fmt_ty(&rows.ty)))),
            false => Ok(()),
        }
    }

    /// Writes `value` into `to` at `offsets` (same element type).
    pub fn store(&mut self, to: Ref, offsets: &[Offset], value: &V) -> Result<()> {
        self.store_op(to, offsets, value, None)
    }

    /// A masked [`Body::store`]: only the rows (dim 0) below the i32 `rows`; memory keeps the rest.
    pub fn store_rows(&mut self, to: Ref, offsets: &[Offset], value: &V, rows: &V) -> Result<()> {
        self.masked("store_rows", to, rows, &value.ty.dims)?;
        self.store_op(to, offsets, value, Some(rows))
    }

    fn store_op(&mut self, to: Ref, offsets: &[Offset], value: &V, rows: Option<&V>) -> Result<()> {
        self.uses("store", &[value])?;
        let ty = self.check_window("store", to, offsets, &value.ty.dims)?;
        if ty.elem != value.ty.elem {
            return Err(err("store", format!("{} into a {} reference", fmt_ty(&value.ty), ty.elem)));
        }
        self.push(Op::Store { to, offsets: offsets.to_vec(), value: value.clone(), rows: rows.cloned() });
        Ok(())
    }

    /// Writes `value` over the whole of `to`.
    pub fn store_all(&mut self, to: Ref, value: &V) -> Result<()> {
        let zeros = vec![Offset::Const(0); value.ty.dims.len()];
        self.store(to, &zeros, value)
    }

    /// `a x b` over 2-D operands, contracting `a`'s dim `contract.0` with `b`'s dim
    /// `contract.1`: `[a free, b free]` in f32. Operands share their float type.
    pub fn matmul(&mut self, a: &V, b: &V, contract: (usize, usize), precision: MatPrecision) -> Result<V> {
        self.uses("matmul", &[a, b])?;
        let shapes = || format!("{} x {} contracting {contract:?}", fmt_ty(&a.ty), fmt_ty(&b.ty));
        if a.ty.dims.len() != 2 || b.ty.dims.len() != 2 || contract.0 > 1 || contract.1 > 1 {
            return Err(err("matmul", format!("2-D operands: {}", shapes())));
        }
        if a.ty.elem != b.ty.elem || !matches!(a.ty.elem, DType::F32 | DType::BF16) {
            return Err(err("matmul", format!("operands of one float type: {}", shapes())));
        }
        if a.ty.dims[contract.0] != b.ty.dims[contract.1] {
            return Err(err("matmul", format!("contracting sizes differ: {}", shapes())));
        }
        if precision != MatPrecision::Default && a.ty.elem != DType::F32 {
            return Err(err("matmul", format!("{precision:?} precision needs f32 operands: {}", shapes())));
        }
        let dims = [a.ty.dims[1 - contract.0], b.ty.dims[1 - contract.1]];
        let out = self.fresh(TensorType::new(DType::F32, &dims));
        self.push(Op::Matmul { out: out.clone(), a: a.clone(), b: b.clone(), contract, precision });
        Ok(out)
    }

    /// Elementwise `a op b` (one type; `Div` on floats only). Kernels write the operators
    /// ([`Body::add`], [`Body::mul`], ...), which broadcast size-1 dims first.
    pub(super) fn binary(&mut self, op: Binary, a: &V, b: &V) -> Result<V> {
        self.uses("binary", &[a, b])?;
        if a.ty != b.ty
            || a.ty.dims.is_empty()
            || a.ty.elem == DType::I1
            || (op == Binary::Div && !a.ty.elem.is_float())
        {
            return Err(err("binary", format!("{op:?} of {} and {}", fmt_ty(&a.ty), fmt_ty(&b.ty))));
        }
        let out = self.fresh(a.ty.clone());
        self.push(Op::Binary { out: out.clone(), op, a: a.clone(), b: b.clone() });
        Ok(out)
    }

    /// Elementwise `op(a)` on a float vector.
    pub fn unary(&mut self, op: Unary, a: &V) -> Result<V> {
        self.uses("unary", &[a])?;
        if a.ty.dims.is_empty() || !a.ty.elem.is_float() {
            return Err(err("unary", format!("{op:?} of {}", fmt_ty(&a.ty))));
        }
        let out = self.fresh(a.ty.clone());
        self.push(Op::Unary { out: out.clone(), op, a: a.clone() });
        Ok(out)
    }

    /// `a op b` elementwise, a side's size-1 dims broadcast to the other's first (same rank
    /// and element type; a size-1 dim meets any size, others must agree).
    fn broadcasting(&mut self, op: Binary, a: &V, b: &V) -> Result<V> {
        if a.ty.dims == b.ty.dims || a.ty.dims.len() != b.ty.dims.len() || a.ty.elem != b.ty.elem {
            return self.binary(op, a, b);
        }
        let dims: Option<Vec<i64>> =
            a.ty.dims
                .iter()
                .zip(&b.ty.dims)
                .map(|(&x, &y)| match (x, y) {
                    _ if x == y => Some(x),
                    (1, y) => Some(y),
                    (x, 1) => Some(x),
                    _ => None,
                })
                .collect();
        let Some(dims) = dims else {
            return Err(err("binary", format!("{op:?} of {} and {}", fmt_ty(&a.ty), fmt_ty(&b.ty))));
        };
        let a = if a.ty.dims == dims { a.clone() } else { self.broadcast(a, &dims)? };
        let b = if b.ty.dims == dims { b.clone() } else { self.broadcast(b, &dims)? };
        self.binary(op, &a, &b)
    }
    /// `a + b`, size-1 dims broadcast.
    pub fn add(&mut self, a: &V, b: &V) -> Result<V> {
        self.broadcasting(Binary::Add, a, b)
    }
    /// `a - b`, size-1 dims broadcast.
    pub fn sub(&mut self, a: &V, b: &V) -> Result<V> {
        self.broadcasting(Binary::Sub, a, b)
    }
    /// `a * b`, size-1 dims broadcast.
    pub fn mul(&mut self, a: &V, b: &V) -> Result<V> {
        self.broadcasting(Binary::Mul, a, b)
    }
    /// `a / b` of floats, size-1 dims broadcast.
    pub fn div(&mut self, a: &V, b: &V) -> Result<V> {
        self.broadcasting(Binary::Div, a, b)
    }
    /// `max(a, b)`, size-1 dims broadcast.
    pub fn max(&mut self, a: &V, b: &V) -> Result<V> {
        self.broadcasting(Binary::Max, a, b)
    }
    /// `min(a, b)`, size-1 dims broadcast.
    pub fn min(&mut self, a: &V, b: &V) -> Result<V> {
        self.broadcasting(Binary::Min, a, b)
    }
    /// `exp(a)`.
    pub fn exp(&mut self, a: &V) -> Result<V> {
        self.unary(Unary::Exp, a)
    }
    /// `2^a`.
    pub fn exp2(&mut self, a: &V) -> Result<V> {
        self.unary(Unary::Exp2, a)
    }
    /// `ln(a)`.
    pub fn log(&mut self, a: &V) -> Result<V> {
        self.unary(Unary::Log, a)
    }
    /// `ln(1 + a)`.
    pub fn log1p(&mut self, a: &V) -> Result<V> {
        self.unary(Unary::Log1p, a)
    }
    /// `1 / sqrt(a)`.
    pub fn rsqrt(&mut self, a: &V) -> Result<V> {
        self.unary(Unary::Rsqrt, a)
    }
    /// `tanh(a)`.
    pub fn tanh(&mut self, a: &V) -> Result<V> {
        self.unary(Unary::Tanh, a)
    }
    /// `-a`.
    pub fn neg(&mut self, a: &V) -> Result<V> {
        self.unary(Unary::Neg, a)
    }
    /// The product `a b` of 2-D operands (`a`'s dim 1 against `b`'s dim 0) at the body's
    /// precision ([`Body::set_precision`]); bf16 operands always in the one bf16 pass.
    pub fn dot(&mut self, a: &V, b: &V) -> Result<V> {
        let precision = if a.ty.elem == DType::BF16 { MatPrecision::Default } else { self.precision };
        self.matmul(a, b, (1, 0), precision)
    }
    /// Sets the precision of [`Body::dot`]'s f32 products (`Highest` until set).
    pub fn set_precision(&mut self, precision: MatPrecision) {
        self.precision = precision;
    }

    /// i32 indices along `dim` of a vector of `dims` (at least 2-D).
    pub fn iota(&mut self, dims: &[i64], dim: usize) -> Result<V> {
        if dims.len() < 2 || dim >= dims.len() || !positive(dims) {
            return Err(err("iota", format!("dim {dim} of {dims:?} (a vector of rank 2 or more)")));
        }
        let out = self.fresh(TensorType::new(DType::I32, dims));
        self.push(Op::Iota { out: out.clone(), dim });
        Ok(out)
    }

    /// `a cmp b` (one type: vectors or i32 scalars) into i1.
    pub fn compare(&mut self, cmp: Cmp, a: &V, b: &V) -> Result<V> {
        self.uses("compare", &[a, b])?;
        if a.ty != b.ty || a.ty.elem == DType::I1 || (a.ty.dims.is_empty() && a.ty.elem != DType::I32) {
            return Err(err("compare", format!("{cmp:?} of {} and {}", fmt_ty(&a.ty), fmt_ty(&b.ty))));
        }
        let out = self.fresh(TensorType::new(DType::I1, &a.ty.dims));
        self.push(Op::Compare { out: out.clone(), cmp, a: a.clone(), b: b.clone() });
        Ok(out)
    }

    /// `cond ? a : b` with an i1 `cond` of `a`'s dims.
    pub fn select(&mut self, cond: &V, a: &V, b: &V) -> Result<V> {
        self.uses("select", &[cond, a, b])?;
        if a.ty != b.ty || a.ty.dims.is_empty() || cond.ty != TensorType::new(DType::I1, &a.ty.dims) {
            return Err(err(
                "select",
                format!("{} ? {} : {}", fmt_ty(&cond.ty), fmt_ty(&a.ty), fmt_ty(&b.ty)),
            ));
        }
        let out = self.fresh(a.ty.clone());
        self.push(Op::Select { out: out.clone(), cond: cond.clone(), a: a.clone(), b: b.clone() });
        Ok(out)
    }

    /// `op` over `axis` of an f32 vector of rank 2 or more; the axis stays, with size 1.
    pub fn reduce(&mut self, op: Reduction, a: &V, axis: usize) -> Result<V> {
        self.uses("reduce", &[a])?;
        if a.ty.dims.len() < 2 || axis >= a.ty.dims.len() || a.ty.elem != DType::F32 {
            return Err(err("reduce", format!("{op:?} over axis {axis} of {}", fmt_ty(&a.ty))));
        }
        let mut dims = a.ty.dims.clone();
        dims[axis] = 1;
        let out = self.fresh(TensorType::new(DType::F32, &dims));
        self.push(Op::Reduce { out: out.clone(), op, a: a.clone(), axis });
        Ok(out)
    }

    /// Running sums of the f32 `a` `[R, N]` along `axis` (0 or 1), as `scan` says (forward or
    /// reverse, inclusive or exclusive), and with `starts` (i1 of `a`'s dims) restarting at each
    /// element where it holds: an element then sums only the elements of its own segment, the
    /// run from the last start at or before it to the element before the next start. Direct
    /// sums: no difference of two running totals is ever formed.
    pub fn cumsum(&mut self, a: &V, axis: usize, scan: Scan, starts: Option<&V>) -> Result<V> {
        self.uses("cumsum", &[a])?;
        if let Some(s) = starts {
            self.uses("cumsum", &[s])?;
            if s.ty != TensorType::new(DType::I1, &a.ty.dims) {
                return Err(err("cumsum", format!("starts {} for {}", fmt_ty(&s.ty), fmt_ty(&a.ty))));
            }
        }
        if a.ty.dims.len() != 2 || axis > 1 || a.ty.elem != DType::F32 {
            return Err(err("cumsum", format!("axis {axis} of {} (an f32 [R, N])", fmt_ty(&a.ty))));
        }
        let out = self.fresh(a.ty.clone());
        self.push(Op::Cumsum { out: out.clone(), a: a.clone(), axis, scan, starts: starts.cloned() });
        Ok(out)
    }

    /// `a` stretched to `dims`: an i32 scalar to every element, or a vector whose dims align
    /// with the trailing ones, each equal or 1.
    pub fn broadcast(&mut self, a: &V, dims: &[i64]) -> Result<V> {
        self.uses("broadcast", &[a])?;
        let r = a.ty.dims.len();
        let fits = positive(dims)
            && ((r == 0 && a.ty.elem == DType::I32)
                || (r > 0
                    && r <= dims.len()
                    && a.ty.dims.iter().zip(&dims[dims.len() - r..]).all(|(&s, &d)| s == d || s == 1)));
        if !fits {
            return Err(err("broadcast", format!("{} to {dims:?}", fmt_ty(&a.ty))));
        }
        let out = self.fresh(TensorType::new(a.ty.elem, dims));
        self.push(Op::Broadcast { out: out.clone(), a: a.clone() });
        Ok(out)
    }

    /// `a` in another element type (f32, bf16 and i32 vectors).
    pub fn cast(&mut self, a: &V, dtype: DType) -> Result<V> {
        self.uses("cast", &[a])?;
        let ok = |d: DType| matches!(d, DType::F32 | DType::BF16 | DType::I32);
        if a.ty.dims.is_empty() || !ok(a.ty.elem) || !ok(dtype) || a.ty.elem == dtype {
            return Err(err("cast", format!("{} to {dtype}", fmt_ty(&a.ty))));
        }
        let out = self.fresh(TensorType::new(dtype, &a.ty.dims));
        self.push(Op::Cast { out: out.clone(), a: a.clone() });
        Ok(out)
    }

    /// `a` in `dtype`: `a` itself when it already is, else its cast (no op is added then).
    pub fn to_dtype(&mut self, a: &V, dtype: DType) -> Result<V> {
        if a.ty.elem == dtype {
            self.uses("to_dtype", &[a])?;
            Ok(a.clone())
        } else {
            self.cast(a, dtype)
        }
    }

    /// The transpose of a 2-D vector.
    pub fn transpose(&mut self, a: &V) -> Result<V> {
        self.uses("transpose", &[a])?;
        if a.ty.dims.len() != 2 {
            return Err(err("transpose", format!("a 2-D vector, not {}", fmt_ty(&a.ty))));
        }
        let out = self.fresh(TensorType::new(a.ty.elem, &[a.ty.dims[1], a.ty.dims[0]]));
        self.push(Op::Transpose { out: out.clone(), a: a.clone() });
        Ok(out)
    }

    /// `a` with other dims of the same element count.
    pub fn reshape(&mut self, a: &V, dims: &[i64]) -> Result<V> {
        self.uses("reshape", &[a])?;
        if a.ty.dims.is_empty()
            || !positive(dims)
            || a.ty.dims.iter().product::<i64>() != dims.iter().product::<i64>()
        {
            return Err(err("reshape", format!("{} to {dims:?}", fmt_ty(&a.ty))));
        }
        let out = self.fresh(TensorType::new(a.ty.elem, dims));
        self.push(Op::Reshape { out: out.clone(), a: a.clone() });
        Ok(out)
    }

    /// The `dims` block of vector `a` from `starts` (a value's part, no memory access; free when
    /// the block starts on a vreg tile).
    pub fn slice(&mut self, a: &V, starts: &[i64], dims: &[i64]) -> Result<V> {
        self.uses("slice", &[a])?;
        let fits = !a.ty.dims.is_empty()
            && starts.len() == a.ty.dims.len()
            && dims.len() == a.ty.dims.len()
            && positive(dims)
            && starts.iter().zip(dims).zip(&a.ty.dims).all(|((&s, &d), &full)| s >= 0 && s + d <= full);
        if !fits {
            return Err(err("slice", format!("{dims:?} from {starts:?} of {}", fmt_ty(&a.ty))));
        }
        let out = self.fresh(TensorType::new(a.ty.elem, dims));
        self.push(Op::Slice { out: out.clone(), a: a.clone(), starts: starts.to_vec() });
        Ok(out)
    }

    /// `parts` (one element type and rank, equal dims but along `dim`) side by side along `dim`.
    pub fn concat(&mut self, parts: &[V], dim: usize) -> Result<V> {
        let refs: Vec<&V> = parts.iter().collect();
        self.uses("concat", &refs)?;
        let first = parts.first().ok_or_else(|| err("concat", "one part or more"))?;
        let rank = first.ty.dims.len();
        let same = parts.iter().all(|p| {
            p.ty.elem == first.ty.elem
                && p.ty.dims.len() == rank
                && p.ty.dims.iter().zip(&first.ty.dims).enumerate().all(|(i, (a, b))| i == dim || a == b)
        });
        if rank == 0 || dim >= rank || !same {
            let tys: Vec<String> = parts.iter().map(|p| fmt_ty(&p.ty)).collect();
            return Err(err("concat", format!("[{}] along {dim}", tys.join(", "))));
        }
        let mut dims = first.ty.dims.clone();
        dims[dim] = parts.iter().map(|p| p.ty.dims[dim]).sum();
        let out = self.fresh(TensorType::new(first.ty.elem, &dims));
        self.push(Op::Concat { out: out.clone(), parts: parts.to_vec(), dim });
        Ok(out)
    }

    /// Runs `then` when the i1 scalar `cond` holds. The region may store; its values stay inside.
    pub fn when(&mut self, cond: &V, then: impl FnOnce(&mut Body) -> Result<()>) -> Result<()> {
        self.uses("when", &[cond])?;
        if cond.ty != TensorType::new(DType::I1, &[]) {
            return Err(err("when", format!("an i1 scalar condition, not {}", fmt_ty(&cond.ty))));
        }
        self.open();
        let done = then(self);
        let region = self.close();
        done?;
        self.push(Op::If { cond: cond.clone(), then: region });
        Ok(())
    }

    /// `for i in lo..hi` (constant bounds): `body(b, i, values)` returns the next values, of the
    /// types of `init`; returns the last ones.
    pub fn for_range(
        &mut self,
        lo: i64,
        hi: i64,
        init: &[V],
        body: impl FnOnce(&mut Body, &V, &[V]) -> Result<Vec<V>>,
    ) -> Result<Vec<V>> {
        self.counted(lo, hi, None, (hi - lo) as f64, init, body)
    }

    /// [`Body::for_range`] stopping at the run-time bound `until` (an i32 scalar, such as a
    /// table entry) where it is below `hi`: `for i in lo..min(hi, until)`. `hi` bounds the trips
    /// where a lowering needs a static count (Triton and the interpret lowering stop at
    /// `min(hi, until)` at run time).
    pub fn for_range_until(
        &mut self,
        lo: i64,
        hi: i64,
        until: &V,
        init: &[V],
        body: impl FnOnce(&mut Body, &V, &[V]) -> Result<Vec<V>>,
    ) -> Result<Vec<V>> {
        self.for_range_until_mean(lo, hi, until, (hi - lo) as f64, init, body)
    }

    /// [`Body::for_range_until`] whose trips average `mean` over the programs (a static count of
    /// the work takes that instead of `hi - lo`): the chunks of a packed row's sequences, one
    /// sequence a program, say.
    pub fn for_range_until_mean(
        &mut self,
        lo: i64,
        hi: i64,
        until: &V,
        mean: f64,
        init: &[V],
        body: impl FnOnce(&mut Body, &V, &[V]) -> Result<Vec<V>>,
    ) -> Result<Vec<V>> {
        self.uses("for_range_until", &[until])?;
        if until.ty != TensorType::scalar(DType::I32) {
            return Err(err("for_range_until", format!("a bound of {}: an i32 scalar", fmt_ty(&until.ty))));
        }
        self.counted(lo, hi, Some(until), mean, init, body)
    }

    /// A counted loop, stopping early at `until` when given.
    fn counted(
        &mut self,
        lo: i64,
        hi: i64,
        until: Option<&V>,
        mean_trips: f64,
        init: &[V],
        body: impl FnOnce(&mut Body, &V, &[V]) -> Result<Vec<V>>,
    ) -> Result<Vec<V>> {
        self.uses("for_range", &init.iter().collect::<Vec<_>>())?;
        if lo > hi || i32::try_from(hi).is_err() || i32::try_from(lo).is_err() {
            return Err(err("for_range", format!("bounds {lo}..{hi}")));
        }
        if init.iter().any(|v| v.ty.dims.is_empty()) {
            return Err(err("for_range", "loop values are vectors"));
        }
        self.open();
        let index = self.fresh(TensorType::scalar(DType::I32));
        let args: Vec<V> = init.iter().map(|v| self.fresh(v.ty.clone())).collect();
        let done = body(self, &index, &args);
        if let Ok(yields) = &done {
            self.uses("for_range", &yields.iter().collect::<Vec<_>>())?;
        }
        let region = self.close();
        let yields = done?;
        let types = |vs: &[V]| vs.iter().map(|v| v.ty.clone()).collect::<Vec<_>>();
        if types(&yields) != types(init) {
            return Err(err("for_range", "the body returned other types than the loop values"));
        }
        let outs: Vec<V> = init.iter().map(|v| self.fresh(v.ty.clone())).collect();
        self.push(Op::For {
            lo,
            hi,
            until: until.cloned(),
            mean_trips,
            index,
            init: init.to_vec(),
            args,
            body: region,
            yields,
            outs: outs.clone(),
        });
        Ok(outs)
    }
}
