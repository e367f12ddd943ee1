//! The interpret lowering: a [`Kernel`] as plain StableHLO that runs on any plugin, as
//! Pallas's interpret mode does. The grid is nested counted loops in its declared order (the
//! last axis innermost); each step slices its blocks out of the operands and of the results so
//! far (dynamic slices at block index x block dims), runs the body on them, and writes the
//! result blocks back (dynamic updates). A result block is a buffer as on the TPU: kept while
//! consecutive steps share its block index, NaN on every new visit (so a block read before it
//! is written, or revisited after other blocks and not rewritten, poisons the check, where a
//! TPU would read or write back stale VMEM), save a result written by masked stores, whose new
//! visit starts from the results so far (as a GPU's memory holds them); scratch buffers are loop values, zero at the start.
//! Stores inside `when` are selects on the condition; `for_range` is a counted loop that
//! carries the references with its values.

use std::collections::HashMap;

use kda_core::DType;

mod memory;

use super::triton::{F32Dot, TritonParams};
use super::Lower;
use crate::error::{Result, TpuError};
use crate::hlo::{Cmp, FnBuilder, Precision, TensorType, Value};
use crate::lang::ir::{Binary, MatPrecision, Offset, Op, Place, Reduction, Ref, Scan, Unary, V};
use crate::lang::kernel::{Index, Kernel};
use memory::masked_stores;

fn err(message: impl Into<String>) -> TpuError {
    TpuError::builder("interpret lowering", message)
}

/// The interpret lowering: a kernel as plain StableHLO that any plugin runs, with the
/// numerics its [`InterpretParams`] state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Interpret {
    /// Its parameters.
    pub params: InterpretParams,
}

/// The interpret lowering's parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InterpretParams {
    /// Whose numerics the lowering reproduces.
    pub numerics: Numerics,
}

/// Whose numerics the interpret lowering reproduces, so that a CPU run checks what that
/// target computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Numerics {
    /// A TPU's under Mosaic: products at [`MatPrecision::Default`] in one bf16 pass (f32
    /// operands rounded to bf16, exact products, f32 sums), at `Highest` in f32; everything
    /// else in the values' own dtypes.
    #[default]
    Mosaic,
    /// A GPU's under Triton: each product as its [`MatPrecision`] says (TF32 operands rounded
    /// to 10 mantissa bits, three-pass products as their split sum, `Highest` as the kernel's
    /// `TritonParams::f32_dot`), so that a GPU kernel run here meets GPU numerics.
    Triton,
}

impl Interpret {
    /// The interpret lowering with a TPU's numerics under Mosaic.
    pub const MOSAIC_NUMERICS: Interpret =
        Interpret { params: InterpretParams { numerics: Numerics::Mosaic } };
    /// The interpret lowering with a GPU's numerics under Triton.
    pub const TRITON_NUMERICS: Interpret =
        Interpret { params: InterpretParams { numerics: Numerics::Triton } };
}

impl Lower for Interpret {
    fn name(&self) -> &str {
        "interpret"
    }
    /// Takes the whole language.
    fn check(&self, _kernel: &Kernel) -> Result<()> {
        Ok(())
    }
    /// A module whose `@main` runs the kernel.
    fn text(&self, kernel: &Kernel) -> Result<String> {
        kernel.module(self)
    }
    /// The grid as nested loops around each step's blocks and body.
    fn call(&self, kernel: &Kernel, f: &mut FnBuilder, operands: &[Value]) -> Result<Vec<Value>> {
        let f32_dot = kernel.params::<TritonParams>().copied().unwrap_or_default().f32_dot;
        call(kernel, f, operands, Products { numerics: self.params.numerics, f32_dot })
    }
}

fn tensor(t: &TensorType) -> TensorType {
    TensorType::new(t.elem, &t.dims)
}

fn zeros(b: &mut FnBuilder, t: &TensorType) -> Result<Value> {
    if t.elem.is_float() {
        b.constant_f32(0.0, t.clone())
    } else {
        b.constant_i32(0, t.clone())
    }
}

/// What a result holds before the kernel writes it: NaN (i32::MIN for integers), so that a
/// kernel reading a result block it has not written fails its CPU check, as the uninitialised
/// VMEM buffer of that block would make it fail on a TPU.
fn unwritten(b: &mut FnBuilder, t: &TensorType) -> Result<Value> {
    if t.elem.is_float() {
        b.constant_f32(f32::NAN, t.clone())
    } else {
        b.constant_i32(i32::MIN, t.clone())
    }
}

/// The references of one step: input, output and scratch blocks as values.
#[derive(Clone)]
struct Refs {
    inputs: Vec<Value>,
    outputs: Vec<Value>,
    scratch: Vec<Value>,
}

impl Refs {
    fn get(&self, r: Ref) -> Value {
        match r.place {
            Place::Input(i) => self.inputs[i],
            Place::Output(i) => self.outputs[i],
            Place::Scratch(i) => self.scratch[i],
        }
    }
    fn set(&mut self, r: Ref, v: Value) {
        match r.place {
            Place::Input(i) => self.inputs[i] = v,
            Place::Output(i) => self.outputs[i] = v,
            Place::Scratch(i) => self.scratch[i] = v,
        }
    }
    fn all(&self) -> Vec<Value> {
        self.inputs.iter().chain(&self.outputs).chain(&self.scratch).copied().collect()
    }
    fn with(&self, values: &[Value]) -> Refs {
        let (i, o) = (self.inputs.len(), self.outputs.len());
        Refs {
            inputs: values[..i].to_vec(),
            outputs: values[i..i + o].to_vec(),
            scratch: values[i + o..].to_vec(),
        }
    }
}

/// The call's operands: the scalar-prefetch tables and the inputs.
#[derive(Clone, Copy)]
struct Operands<'a> {
    tables: &'a [Value],
    inputs: &'a [Value],
    products: Products,
}

struct Step<'a> {
    grid: &'a [Value],
    tables: &'a [Value],
    products: Products,
}

/// How the products of a kernel round: whose numerics, and a GPU's `Highest`.
#[derive(Clone, Copy, Debug)]
struct Products {
    numerics: Numerics,
    f32_dot: F32Dot,
}

impl Step<'_> {
    fn scalar(&self, b: &mut FnBuilder, e: &Index) -> Result<Value> {
        Ok(match e {
            Index::Grid(a) => self.grid[*a],
            Index::Const(c) => b.scalar_i32(*c as i32)?,
            Index::Add(x, y) => {
                let (x, y) = (self.scalar(b, x)?, self.scalar(b, y)?);
                b.add(x, y)?
            }
            Index::Mul(x, k) => {
                let x = self.scalar(b, x)?;
                let k = b.scalar_i32(*k as i32)?;
                b.mul(x, k)?
            }
            Index::Table(t, at) => {
                let at = self.scalar(b, at)?;
                self.entry(b, t.index, at)?
            }
        })
    }

    fn entry(&self, b: &mut FnBuilder, table: usize, at: Value) -> Result<Value> {
        let one = b.dynamic_slice(self.tables[table], &[at], &[1])?;
        b.reshape(one, &[])
    }

    fn ops(
        &self,
        b: &mut FnBuilder,
        ops: &[Op],
        vals: &mut HashMap<u32, Value>,
        refs: &mut Refs,
    ) -> Result<()> {
        for op in ops {
            self.op(b, op, vals, refs)?;
        }
        Ok(())
    }

    fn offsets(
        &self,
        b: &mut FnBuilder,
        offsets: &[Offset],
        vals: &HashMap<u32, Value>,
    ) -> Result<Vec<Value>> {
        offsets
            .iter()
            .map(|o| match o {
                Offset::Const(c) => b.scalar_i32(*c as i32),
                Offset::Dyn(v, _) => get(vals, v),
            })
            .collect()
    }

    fn op(&self, b: &mut FnBuilder, op: &Op, vals: &mut HashMap<u32, Value>, refs: &mut Refs) -> Result<()> {
        let (out, value) = match op {
            Op::ProgramId { out, axis } => (out, self.grid[*axis]),
            Op::IndexConst { out, value } => (out, b.scalar_i32(*value as i32)?),
            Op::IndexBinary { out, op, a, b: y } => {
                let (x, y) = (get(vals, a)?, get(vals, y)?);
                (out, binary(b, *op, x, y)?)
            }
            Op::ReadTable { out, table, index } => {
                let at = get(vals, index)?;
                (out, self.entry(b, *table, at)?)
            }
            Op::Splat { out, value } => {
                let ty = tensor(&out.ty);
                let v = match out.ty.elem {
                    DType::I32 => b.constant_i32(*value as i32, ty)?,
                    _ => b.constant_f32(*value as f32, ty)?,
                };
                (out, v)
            }
            Op::Load { out, from, offsets, rows } => {
                (out, self.load(b, (out, *from), (offsets, rows), vals, refs)?)
            }
            Op::Store { to, offsets, value, rows } => {
                return self.store(b, *to, offsets, (value, rows), vals, refs)
            }
            Op::Matmul { out, a, b: y, contract, precision } => {
                (out, matmul(b, get(vals, a)?, get(vals, y)?, *contract, self.products.rounding(*precision))?)
            }
            Op::Binary { out, op, a, b: y } => {
                let (x, y) = (get(vals, a)?, get(vals, y)?);
                (out, binary(b, *op, x, y)?)
            }
            Op::Unary { out, op, a } => {
                let x = get(vals, a)?;
                let v = match op {
                    Unary::Exp => b.exp(x)?,
                    // StableHLO has no 2^x: e^(x ln 2).
                    Unary::Exp2 => {
                        let y = b.mul_const(x, std::f32::consts::LN_2)?;
                        b.exp(y)?
                    }
                    Unary::Log => b.log(x)?,
                    Unary::Log1p => b.log1p(x)?,
                    Unary::Rsqrt => b.rsqrt(x)?,
                    Unary::Tanh => b.tanh(x)?,
                    Unary::Neg => b.neg(x)?,
                };
                (out, v)
            }
            Op::Iota { out, dim } => (out, b.iota(tensor(&out.ty), *dim)?),
            Op::Compare { out, cmp, a, b: y } => {
                let (x, y) = (get(vals, a)?, get(vals, y)?);
                (out, b.compare(*cmp, x, y)?)
            }
            Op::Select { out, cond, a, b: y } => {
                let (c, x, y) = (get(vals, cond)?, get(vals, a)?, get(vals, y)?);
                (out, b.select(c, x, y)?)
            }
            Op::Reduce { out, op, a, axis } => {
                let x = get(vals, a)?;
                let r = match op {
                    Reduction::Sum => b.reduce_sum(x, &[*axis as i64])?,
                    Reduction::Max => b.reduce_max(x, &[*axis as i64])?,
                };
                (out, b.reshape(r, &out.ty.dims)?)
            }
            Op::Broadcast { out, a } => {
                let x = get(vals, a)?;
                let (r, big) = (a.ty.dims.len() as i64, out.ty.dims.len() as i64);
                let mapping: Vec<i64> = (big - r..big).collect();
                (out, b.broadcast_in_dim(x, &out.ty.dims, &mapping)?)
            }
            Op::Cast { out, a } => {
                let x = get(vals, a)?;
                (out, b.convert(x, out.ty.elem)?)
            }
            Op::Transpose { out, a } => {
                let x = get(vals, a)?;
                (out, b.transpose(x, &[1, 0])?)
            }
            Op::Cumsum { out, a, axis, scan, starts } => {
                let x = get(vals, a)?;
                let starts = starts.as_ref().map(|s| get(vals, s)).transpose()?;
                (out, cumsum(b, x, *axis, *scan, starts)?)
            }
            Op::Reshape { out, a } => {
                let x = get(vals, a)?;
                (out, b.reshape(x, &out.ty.dims)?)
            }
            Op::Slice { out, a, starts } => {
                let x = get(vals, a)?;
                let limits: Vec<i64> = starts.iter().zip(&out.ty.dims).map(|(s, d)| s + d).collect();
                let strides = vec![1; starts.len()];
                (out, b.slice(x, starts, &limits, &strides)?)
            }
            Op::Concat { out, parts, dim } => {
                let xs = parts.iter().map(|p| get(vals, p)).collect::<Result<Vec<_>>>()?;
                (out, b.concatenate(&xs, *dim)?)
            }
            Op::If { cond, then } => return self.when(b, cond, then, vals, refs),
            Op::For { .. } => return self.for_range(b, op, vals, refs),
        };
        vals.insert(out.id, value);
        Ok(())
    }

    /// A `when` region: its stores as selects on the condition.
    fn when(
        &self,
        b: &mut FnBuilder,
        cond: &V,
        then: &[Op],
        vals: &mut HashMap<u32, Value>,
        refs: &mut Refs,
    ) -> Result<()> {
        let c = get(vals, cond)?;
        let mut inner_vals = vals.clone();
        let mut inner = refs.clone();
        self.ops(b, then, &mut inner_vals, &mut inner)?;
        let (before, after) = (refs.all(), inner.all());
        let mut chosen = Vec::with_capacity(before.len());
        for (old, new) in before.into_iter().zip(after) {
            if old == new {
                chosen.push(old);
            } else {
                let cb = b.broadcast_in_dim(c, old.dims(), &[])?;
                chosen.push(b.select(cb, new, old)?);
            }
        }
        *refs = refs.with(&chosen);
        Ok(())
    }

    /// A `for_range` region: a counted loop carrying its values and the references.
    fn for_range(
        &self,
        b: &mut FnBuilder,
        op: &Op,
        vals: &mut HashMap<u32, Value>,
        refs: &mut Refs,
    ) -> Result<()> {
        let Op::For { lo, hi, until, index, init, args, body, yields, outs, .. } = op else {
            return Err(err("internal: a loop region expected"));
        };
        let until = until.as_ref().map(|u| get(vals, u)).transpose()?;
        let mut state: Vec<Value> = init.iter().map(|v| get(vals, v)).collect::<Result<_>>()?;
        let carried = state.len();
        state.extend(refs.all());
        let trips = i32::try_from(hi - lo).map_err(|_| err("loop bounds"))?;
        let shape = refs.clone();
        let outer = vals.clone();
        let step = |b: &mut FnBuilder, i: Value, st: &[Value]| -> Result<Vec<Value>> {
            let mut inner_vals = outer;
            let lo = b.scalar_i32(*lo as i32)?;
            let at = b.add(i, lo)?;
            inner_vals.insert(index.id, at);
            for (a, v) in args.iter().zip(st) {
                inner_vals.insert(a.id, *v);
            }
            let mut inner = shape.with(&st[carried..]);
            self.ops(b, body, &mut inner_vals, &mut inner)?;
            let mut next: Vec<Value> = yields.iter().map(|v| get(&inner_vals, v)).collect::<Result<_>>()?;
            next.extend(inner.all());
            Ok(next)
        };
        let done = match until {
            // `for i in lo..min(hi, until)`: max(0, min(hi, until) - lo) trips.
            Some(u) => {
                let hi = b.scalar_i32(*hi as i32)?;
                let end = b.min(hi, u)?;
                let lo_v = b.scalar_i32(*lo as i32)?;
                let n = b.sub(end, lo_v)?;
                let zero = b.scalar_i32(0)?;
                let n = b.max(n, zero)?;
                b.for_loop_until(n, &state, step)?
            }
            None => b.for_loop(trips, &state, step)?,
        };
        for (o, v) in outs.iter().zip(&done) {
            vals.insert(o.id, *v);
        }
        *refs = refs.with(&done[carried..]);
        Ok(())
    }
}

/// How a product's operands round before exact f32 products and sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rounding {
    /// Not at all (full f32).
    Exact,
    /// Each operand once to a float of (exponent, mantissa) bits.
    Once(u32, u32),
    /// Each operand split into its rounding and the rounding of its rest, the three largest
    /// cross products summed, the two small ones first.
    Split(u32, u32),
}

/// bf16's exponent and mantissa bits.
const BF16: (u32, u32) = (8, 7);
/// TF32's exponent and mantissa bits.
const TF32: (u32, u32) = (8, 10);

impl Products {
    /// The rounding of a product at `precision` under these numerics.
    fn rounding(self, precision: MatPrecision) -> Rounding {
        match (self.numerics, precision) {
            (_, MatPrecision::Default) => Rounding::Once(BF16.0, BF16.1),
            (Numerics::Mosaic, _) | (Numerics::Triton, MatPrecision::Ieee) => Rounding::Exact,
            (Numerics::Triton, MatPrecision::Highest) => match self.f32_dot {
                F32Dot::Ieee => Rounding::Exact,
                F32Dot::Tf32x3 => Rounding::Split(TF32.0, TF32.1),
            },
            (Numerics::Triton, MatPrecision::Tf32) => Rounding::Once(TF32.0, TF32.1),
            (Numerics::Triton, MatPrecision::Tf32x3) => Rounding::Split(TF32.0, TF32.1),
            (Numerics::Triton, MatPrecision::Bf16x3) => Rounding::Split(BF16.0, BF16.1),
        }
    }
}

/// `x y` contracting `contract` with the operands rounded as `rounding` says; the products
/// and sums in f32 (the CPU plugin would otherwise multiply as it likes).
fn matmul(
    b: &mut FnBuilder,
    x: Value,
    y: Value,
    contract: (usize, usize),
    rounding: Rounding,
) -> Result<Value> {
    let exact = |b: &mut FnBuilder, x: Value, y: Value| -> Result<Value> {
        let before = b.dot_precision();
        b.set_dot_precision(Precision::Highest);
        let v = b.dot_general(x, y, &[], &[], &[contract.0 as i64], &[contract.1 as i64], DType::F32);
        b.set_dot_precision(before);
        v
    };
    // bf16 operands are what they are; f32 ones round.
    let round = |b: &mut FnBuilder, v: Value, (e, m): (u32, u32)| -> Result<Value> {
        match (v.elem(), (e, m)) {
            (DType::F32, BF16) => {
                // As a bf16 pass rounds: through bf16 and back (the same values).
                let r = b.convert(v, DType::BF16)?;
                b.convert(r, DType::F32)
            }
            (DType::F32, _) => b.reduce_precision(v, e, m),
            _ => Ok(v),
        }
    };
    match rounding {
        Rounding::Exact => exact(b, x, y),
        Rounding::Once(e, m) => {
            let (x, y) = (round(b, x, (e, m))?, round(b, y, (e, m))?);
            exact(b, x, y)
        }
        Rounding::Split(e, m) => {
            let (xh, yh) = (round(b, x, (e, m))?, round(b, y, (e, m))?);
            let (xr, yr) = (b.sub(x, xh)?, b.sub(y, yh)?);
            let (xl, yl) = (round(b, xr, (e, m))?, round(b, yr, (e, m))?);
            let small = exact(b, xh, yl)?;
            let other = exact(b, xl, yh)?;
            let small = b.add(small, other)?;
            let big = exact(b, xh, yh)?;
            b.add(small, big)
        }
    }
}

/// Running sums of `x` `[R, N]` along `axis` as products with a 0/1 mask (`M[j, i] = 1` where
/// element `j` is in element `i`'s sum), each sum direct; with `starts`, the mask also asks
/// `j` and `i` to share a segment (their counts of starts so far equal), one mask per row.
fn cumsum(b: &mut FnBuilder, x: Value, axis: usize, scan: Scan, starts: Option<Value>) -> Result<Value> {
    let (x, starts) = match axis {
        0 => (b.transpose(x, &[1, 0])?, starts.map(|s| b.transpose(s, &[1, 0])).transpose()?),
        _ => (x, starts),
    };
    let (r, n) = (x.dims()[0], x.dims()[1]);
    let square = TensorType::new(DType::I32, &[n, n]);
    let (j, i) = (b.iota(square.clone(), 0)?, b.iota(square, 1)?);
    let cmp = match (scan.reverse, scan.exclusive) {
        (false, false) => Cmp::Le,
        (false, true) => Cmp::Lt,
        (true, false) => Cmp::Ge,
        (true, true) => Cmp::Gt,
    };
    let within = b.compare(cmp, j, i)?;
    let f32_of = |b: &mut FnBuilder, m: Value, dims: &[i64]| -> Result<Value> {
        let (one, zero) = (
            b.constant_f32(1.0, TensorType::new(DType::F32, dims))?,
            b.constant_f32(0.0, TensorType::new(DType::F32, dims))?,
        );
        b.select(m, one, zero)
    };
    let exact = |b: &mut FnBuilder, x: Value, m: Value, batch: bool| -> Result<Value> {
        let before = b.dot_precision();
        b.set_dot_precision(Precision::Highest);
        let v = match batch {
            false => b.dot_general(x, m, &[], &[], &[1], &[0], DType::F32),
            true => b.dot_general(x, m, &[0], &[0], &[2], &[1], DType::F32),
        };
        b.set_dot_precision(before);
        v
    };
    let sums = match starts {
        None => {
            let m = f32_of(b, within, &[n, n])?;
            exact(b, x, m, false)?
        }
        Some(s) => {
            // Each element's segment: the count of starts up to it (exact in f32 below 2^24).
            let counts = f32_of(b, s, &[r, n])?;
            let upto = b.compare(Cmp::Le, j, i)?;
            let upto = f32_of(b, upto, &[n, n])?;
            let seg = exact(b, counts, upto, false)?;
            let seg_j = b.broadcast_in_dim(seg, &[r, n, n], &[0, 1])?;
            let seg_i = b.broadcast_in_dim(seg, &[r, n, n], &[0, 2])?;
            let same = b.compare(Cmp::Eq, seg_j, seg_i)?;
            let within = b.broadcast_in_dim(within, &[r, n, n], &[1, 2])?;
            let m = b.and(same, within)?;
            let m = f32_of(b, m, &[r, n, n])?;
            let x3 = b.reshape(x, &[r, 1, n])?;
            let y = exact(b, x3, m, true)?;
            b.reshape(y, &[r, n])?
        }
    };
    match axis {
        0 => b.transpose(sums, &[1, 0]),
        _ => Ok(sums),
    }
}

fn get(vals: &HashMap<u32, Value>, v: &V) -> Result<Value> {
    vals.get(&v.id).copied().ok_or_else(|| err(format!("value {} used outside its region", v.id)))
}

fn binary(b: &mut FnBuilder, op: Binary, x: Value, y: Value) -> Result<Value> {
    match op {
        Binary::Add => b.add(x, y),
        Binary::Sub => b.sub(x, y),
        Binary::Mul => b.mul(x, y),
        Binary::Div => b.div(x, y),
        Binary::Max => b.max(x, y),
        Binary::Min => b.min(x, y),
    }
}

/// The kernel run on `operands` (the tables, then the inputs) as plain StableHLO in `b`:
/// the interpret lowering, for any plugin.
fn call(k: &Kernel, b: &mut FnBuilder, operands: &[Value], products: Products) -> Result<Vec<Value>> {
    let want = k.operand_types();
    let got: Vec<TensorType> = operands.iter().map(Value::ty).collect();
    if got != want {
        return Err(err(format!("operands {got:?}, the kernel {} takes {want:?}", k.name)));
    }
    let (tables, inputs) = operands.split_at(k.tables.len());
    // Loop state: the results, the scratch, then per result its current block and that
    // block's start indices (-1 before the first step: every first visit is a new one).
    let mut state = Vec::new();
    for o in &k.outputs {
        state.push(unwritten(b, &o.ty)?);
    }
    for (_, t) in &k.scratch {
        state.push(zeros(b, &tensor(t))?);
    }
    for o in &k.outputs {
        state.push(unwritten(b, &o.block_type())?);
        for _ in &o.block {
            state.push(b.scalar_i32(-1)?);
        }
    }
    let done = grid_loop(k, b, &[], Operands { tables, inputs, products }, &state)?;
    Ok(done[..k.outputs.len()].to_vec())
}

/// The grid's axes from `grid.len()` on as nested loops around [`step`].
fn grid_loop(
    k: &Kernel,
    b: &mut FnBuilder,
    grid: &[Value],
    x: Operands<'_>,
    state: &[Value],
) -> Result<Vec<Value>> {
    if grid.len() == k.grid.len() {
        return step(k, b, &Step { grid, tables: x.tables, products: x.products }, x.inputs, state);
    }
    let steps = k.grid[grid.len()].0 as i32;
    b.for_loop(steps, state, |b, i, st| {
        let mut g = grid.to_vec();
        g.push(i);
        grid_loop(k, b, &g, x, st)
    })
}

/// One grid step at `step`'s indices: blocks in, the body, result blocks back.
fn step(
    k: &Kernel,
    b: &mut FnBuilder,
    step: &Step<'_>,
    inputs: &[Value],
    state: &[Value],
) -> Result<Vec<Value>> {
    let starts = |b: &mut FnBuilder, o: &crate::lang::kernel::Operand| -> Result<Vec<Value>> {
        o.map
            .iter()
            .zip(&o.block)
            .map(|(m, &d)| {
                let i = step.scalar(b, m)?;
                let d = b.scalar_i32(d as i32)?;
                b.mul(i, d)
            })
            .collect()
    };
    let n_out = k.outputs.len();
    let n_scratch = k.scratch.len();
    let mut refs =
        Refs { inputs: Vec::new(), outputs: Vec::new(), scratch: state[n_out..n_out + n_scratch].to_vec() };
    for (o, &x) in k.inputs.iter().zip(inputs) {
        let s = starts(b, o)?;
        refs.inputs.push(b.dynamic_slice(x, &s, &o.block)?);
    }
    let mut kept = &state[n_out + n_scratch..];
    let mut out_starts = Vec::with_capacity(n_out);
    let mut masked = std::collections::BTreeSet::new();
    masked_stores(&k.body, &mut masked);
    for o in &k.outputs {
        let s = starts(b, o)?;
        let (held, rest) = kept.split_at(1 + o.block.len());
        kept = rest;
        // The buffer of the last step when this step's block index is the same, else new.
        let mut same = b.constant_bool(true, &[])?;
        for (&now, &before) in s.iter().zip(&held[1..]) {
            let eq = b.compare(crate::hlo::Cmp::Eq, now, before)?;
            same = b.and(same, eq)?;
        }
        // A result a masked store writes starts a visit from memory (the rows past its count
        // keep what the steps before wrote there); any other, unwritten.
        let fresh = match masked.contains(&refs.outputs.len()) {
            true => b.dynamic_slice(state[refs.outputs.len()], &s, &o.block)?,
            false => unwritten(b, &o.block_type())?,
        };
        refs.outputs.push(b.select(same, held[0], fresh)?);
        out_starts.push(s);
    }
    let mut vals = HashMap::new();
    step.ops(b, &k.body, &mut vals, &mut refs)?;
    let mut next = Vec::with_capacity(state.len());
    for ((&whole, block), s) in state.iter().zip(&refs.outputs).zip(&out_starts) {
        next.push(b.dynamic_update_slice(whole, *block, s)?);
    }
    next.extend(refs.scratch);
    for (block, s) in refs.outputs.iter().zip(out_starts) {
        next.push(*block);
        next.extend(s);
    }
    Ok(next)
}
