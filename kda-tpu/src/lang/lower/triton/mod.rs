//! The Triton lowering: a [`Kernel`] as Triton IR (TTIR) text inside a
//! `stablehlo.custom_call @"__gpu$xla.gpu.triton"`, which XLA's CUDA plugin compiles (the
//! contract: `docs/design.md`, Triton kernels).
//!
//! - Parallel grid axes are program ids (`x`, `y`, `z`, in order); arbitrary axes are counted
//!   loops inside each program, in their declared order, carrying the scratch buffers.
//! - Scratch buffers are values (zero at the start), read and written whole.
//! - Blocks are pointer loads and stores: each operand's block at the step's block indices,
//!   each window inside it at its offsets; tables are i32 operands read through pointers.
//! - Triton tensors have power-of-two dims: a value of other dims lives in the next power of
//!   two up, its padding zero after a load and undefined after other ops; reductions and
//!   contractions over a padded dim mask it first, and stores mask it out.
//! - `matmul` is `tt.dot` with f32 accumulation: bf16 operands in one pass, f32 ones at
//!   `Highest` in full precision (`ieee`, or three TF32 passes when the kernel's
//!   [`TritonParams`] say `Tf32x3`), at `Default` rounded to bf16 first (as Mosaic does).
//! - `exp`, `log`, `log1p`, `rsqrt` and `tanh` of f32 call libdevice (correctly rounded to a few
//!   ulp, where `math.exp` would be the approximate `ex2`).
//!
//! What has no TTIR form is refused before any text is written ([`Feature`], [`Triton`]'s
//! [`Lower::check`]).

use std::collections::BTreeSet;
use std::fmt::Write;

use kda_core::DType;

mod features;
mod ops;

pub use features::{features, Feature};

use super::arith::{derefs_to_text, literal, OpRules, Text};
use super::{custom_call_layouts, quoted_error, refuse, Lower};
use crate::error::{Result, TpuError};
use crate::hlo::{FnBuilder, Value};
use crate::lang::ir::{Offset, Op, Place, Ref, Unary, V};
use crate::lang::kernel::{Index, Kernel, Semantics};
use features::padded;

/// The Triton lowering: a kernel as Triton IR inside a `__gpu$xla.gpu.triton` custom call, for
/// XLA's CUDA plugin. Reads each kernel's [`TritonParams`] (defaults where it has none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Triton;

/// How a kernel launches on a GPU: warps per program, software pipeline stages of its loops,
/// and how its full-precision f32 products run ([`crate::lang::KernelBuilder::params`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TritonParams {
    /// Warps per program: 1, 2, 4, 8, 16 or 32 (`wgmma` needs 4 or more).
    pub num_warps: u32,
    /// Pipeline stages of the loads in loops: 1 to 5 (each stage holds its loads in shared
    /// memory).
    pub num_stages: u32,
    /// The `tt.dot` precision of f32 products at [`crate::lang::MatPrecision::Highest`].
    pub f32_dot: F32Dot,
}

/// How a GPU runs an f32 product at full precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F32Dot {
    /// IEEE f32 on the FMA units (`inputPrecision = ieee`): exact f32 products, no tensor
    /// cores; the default until a GPU run shows the alternative within the f32 tolerances.
    Ieee,
    /// Three TF32 tensor-core passes (`tf32x3`: the operands split into a TF32 high part and
    /// residual), close to f32 at a fraction of the FMA time.
    Tf32x3,
}

impl Default for TritonParams {
    /// Four warps (one warp group, the smallest that issues `wgmma`), two stages, IEEE f32
    /// products.
    fn default() -> Self {
        TritonParams { num_warps: 4, num_stages: 2, f32_dot: F32Dot::Ieee }
    }
}

impl TritonParams {
    /// `num_warps` warps and `num_stages` stages, IEEE f32 products; refused where the CUDA
    /// plugin would abort or refuse (warps 1, 2, 4, 8, 16 or 32; stages 1 to 5).
    pub fn new(num_warps: u32, num_stages: u32) -> Result<Self> {
        let p = TritonParams { num_warps, num_stages, f32_dot: F32Dot::Ieee };
        p.valid().map_err(|why| TpuError::builder("triton params", why))?;
        Ok(p)
    }
    /// The same launch with f32 products run as `f32_dot` says.
    pub fn with_f32_dot(mut self, f32_dot: F32Dot) -> Self {
        self.f32_dot = f32_dot;
        self
    }
    /// Other warp counts abort the CUDA plugin's process rather than fail the compile.
    fn valid(&self) -> std::result::Result<(), String> {
        let TritonParams { num_warps, num_stages, .. } = *self;
        if !matches!(num_warps, 1 | 2 | 4 | 8 | 16 | 32) || !(1..=5).contains(&num_stages) {
            return Err(format!(
                "{num_warps} warps, {num_stages} stages: warps 1, 2, 4, 8, 16 or 32, stages 1 to 5"
            ));
        }
        Ok(())
    }
}

impl Triton {
    fn params(kernel: &Kernel) -> TritonParams {
        kernel.params::<TritonParams>().copied().unwrap_or_default()
    }
}

impl Lower for Triton {
    fn name(&self) -> &str {
        "triton"
    }
    /// Refuses launches the plugin does not take and every [`Feature`] the kernel uses.
    fn check(&self, kernel: &Kernel) -> Result<()> {
        Triton::params(kernel).valid().map_err(|why| refuse(self, kernel, why))?;
        match features(kernel).into_iter().next() {
            None => Ok(()),
            Some((f, at)) => Err(refuse(self, kernel, format!("{}: {at}", f.describe()))),
        }
    }
    /// One public `tt.func` whose pointer arguments are the tables, the inputs and the
    /// results, in that order.
    fn text(&self, kernel: &Kernel) -> Result<String> {
        self.check(kernel)?;
        text(kernel, Triton::params(kernel))
    }
    /// A `__gpu$xla.gpu.triton` custom call that XLA's CUDA plugin compiles.
    fn call(&self, kernel: &Kernel, f: &mut FnBuilder, operands: &[Value]) -> Result<Vec<Value>> {
        call(kernel, Triton::params(kernel), f, operands)
    }
    /// Quotes the TTIR line the compiler points at (`-:LINE:COL: error`).
    fn explain(&self, kernel: &Kernel, error: TpuError) -> TpuError {
        let error = match error {
            // The plugin appends the whole module; the quoted line says where.
            TpuError::Compile { mut message } => {
                if let Some(at) = message.find("\ninput ir:") {
                    message.truncate(at);
                }
                TpuError::Compile { message }
            }
            other => other,
        };
        quoted_error(error, kernel, self.text(kernel).ok(), "-:", "TTIR ")
    }
}

fn err(message: impl Into<String>) -> TpuError {
    TpuError::builder("triton lowering", message)
}

fn elem(d: DType) -> &'static str {
    d.name()
}

/// `tensor<AxBxE>` of `dims` (padded by the caller), or the scalar type for no dims.
fn tty(dims: &[i64], e: &str) -> String {
    if dims.is_empty() {
        return e.to_string();
    }
    let d: Vec<String> = dims.iter().map(i64::to_string).collect();
    format!("tensor<{}x{e}>", d.join("x"))
}

/// The Triton type of value `v`.
fn vty(v: &V) -> String {
    tty(&padded(&v.ty.dims), elem(v.ty.elem))
}

/// Row-major strides of `dims`.
fn strides(dims: &[i64]) -> Vec<i64> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// The scratch buffers `ops` store to, at any depth.
pub(super) fn written(ops: &[Op], into: &mut BTreeSet<usize>) {
    for op in ops {
        match op {
            Op::Store { to: Ref { place: Place::Scratch(i), .. }, .. } => {
                into.insert(*i);
            }
            Op::If { then, .. } => written(then, into),
            Op::For { body, .. } => written(body, into),
            _ => {}
        }
    }
}

struct Emitter<'k> {
    k: &'k Kernel,
    /// The kernel's launch and product parameters.
    params: TritonParams,
    t: Text,
    /// The current value of each scratch buffer.
    scratch: Vec<String>,
    /// The current step's element offset of each operand's block (inputs, then outputs).
    bases: Vec<String>,
    /// The name of each grid axis's index.
    grid: Vec<String>,
}

derefs_to_text!(Emitter);

impl<'k> Emitter<'k> {
    /// `t = rhs`, returning `t`.
    fn let_(&mut self, rhs: &str) -> String {
        let t = self.temp();
        self.line(&format!("{t} = {rhs}"));
        t
    }
    fn i32_const(&mut self, c: i64) -> String {
        self.let_(&format!("arith.constant {c} : i32"))
    }

    /// An i32 tensor of `dims` (padded) holding each element's index along `d`.
    fn iota(&mut self, dims: &[i64], d: usize) -> String {
        let n = dims[d];
        let mut cur =
            self.let_(&format!("tt.make_range {{end = {n} : i32, start = 0 : i32}} : tensor<{n}xi32>"));
        let mut shape = vec![n];
        for _ in 0..d {
            let next: Vec<i64> = std::iter::once(1).chain(shape.iter().copied()).collect();
            cur = self.let_(&format!(
                "tt.expand_dims {cur} {{axis = 0 : i32}} : {} -> {}",
                tty(&shape, "i32"),
                tty(&next, "i32")
            ));
            shape = next;
        }
        while shape.len() < dims.len() {
            let mut next = shape.clone();
            next.push(1);
            cur = self.let_(&format!(
                "tt.expand_dims {cur} {{axis = {} : i32}} : {} -> {}",
                shape.len(),
                tty(&shape, "i32"),
                tty(&next, "i32")
            ));
            shape = next;
        }
        if shape != dims {
            cur = self.let_(&format!("tt.broadcast {cur} : {} -> {}", tty(&shape, "i32"), tty(dims, "i32")));
        }
        cur
    }

    /// An i1 tensor of `dims` (padded): index along `d` `cmp` `n`.
    fn index_test(&mut self, dims: &[i64], d: usize, pred: &str, n: i64) -> String {
        let i = self.iota(dims, d);
        let c = self.let_(&format!("arith.constant dense<{n}> : {}", tty(dims, "i32")));
        self.let_(&format!("arith.cmpi {pred}, {i}, {c} : {}", tty(dims, "i32")))
    }

    /// The elements of a value of logical `dims` inside them (None when nothing is padded).
    fn inside(&mut self, dims: &[i64]) -> Option<String> {
        let p = padded(dims);
        let mut mask: Option<String> = None;
        for d in 0..dims.len() {
            if p[d] != dims[d] {
                let m = self.index_test(&p, d, "slt", dims[d]);
                mask = Some(match mask {
                    None => m,
                    Some(prev) => self.let_(&format!("arith.andi {prev}, {m} : {}", tty(&p, "i1"))),
                });
            }
        }
        mask
    }

    /// `mask` (a window's padding mask, if any) and, with `rows`, the window's rows (dim 0)
    /// below that i32 scalar: a masked load reads zero there, a masked store skips them.
    fn with_rows(&mut self, mask: Option<String>, dims: &[i64], rows: Option<&V>) -> Result<Option<String>> {
        let Some(n) = rows else { return Ok(mask) };
        let n = self.name(n)?;
        let p = padded(dims);
        let i = self.iota(&p, 0);
        let bound = self.let_(&format!("tt.splat {n} : i32 -> {}", tty(&p, "i32")));
        let below = self.let_(&format!("arith.cmpi slt, {i}, {bound} : {}", tty(&p, "i32")));
        Ok(Some(match mask {
            None => below,
            Some(m) => self.let_(&format!("arith.andi {m}, {below} : {}", tty(&p, "i1"))),
        }))
    }

    /// `x` (of logical `dims`, type `e`) with its padding along `d` replaced by `fill`.
    fn fill_padding(&mut self, x: &str, dims: &[i64], e: DType, d: usize, fill: f64) -> String {
        let p = padded(dims);
        if p[d] == dims[d] {
            return x.to_string();
        }
        self.keep_where(x, &p, e, (d, "slt", dims[d]), fill)
    }

    /// `x` (a tensor of `dims`, type `e`) where its index along `at.0` passes `at.1` against
    /// `at.2`, else `fill`.
    fn keep_where(&mut self, x: &str, dims: &[i64], e: DType, at: (usize, &str, i64), fill: f64) -> String {
        let m = self.index_test(dims, at.0, at.1, at.2);
        let f = self.let_(&format!("arith.constant dense<{}> : {}", literal(fill, e), tty(dims, elem(e))));
        self.let_(&format!("arith.select {m}, {x}, {f} : {}, {}", tty(dims, "i1"), tty(dims, elem(e))))
    }

    /// The 2-D `x` of logical `dims` and type `e`, transposed.
    fn trans(&mut self, x: &str, dims: &[i64], e: DType) -> String {
        let (from, to) = (tty(&padded(dims), elem(e)), tty(&padded(&[dims[1], dims[0]]), elem(e)));
        self.let_(&format!("tt.trans {x} {{order = array<i32: 1, 0>}} : {from} -> {to}"))
    }

    /// Entry `at` (an i32 scalar) of table `table`.
    fn table_entry(&mut self, table: usize, at: &str) -> String {
        let p = self.let_(&format!("tt.addptr %tab{table}, {at} : !tt.ptr<i32>, i32"));
        self.let_(&format!("tt.load {p} : !tt.ptr<i32>"))
    }

    /// The pointers of a `dims` window of reference `r` at `offsets` inside the step's block,
    /// and the mask of its padding (None when nothing is padded).
    fn window(
        &mut self,
        r: Ref,
        offsets: &[Offset],
        dims: &[i64],
    ) -> Result<(String, String, Option<String>)> {
        let (slot, arg, array) = match r.place {
            Place::Input(i) => (i, format!("%in{i}"), &self.k.inputs[i]),
            Place::Output(i) => (self.k.inputs.len() + i, format!("%out{i}"), &self.k.outputs[i]),
            Place::Scratch(_) => return Err(err("a scratch buffer has no pointers")),
        };
        let e = elem(array.ty.elem);
        let st = strides(&array.ty.dims);
        let mut base = self.bases[slot].clone();
        for (d, o) in offsets.iter().enumerate() {
            let add = match o {
                Offset::Const(0) => continue,
                Offset::Const(c) => self.i32_const(c * st[d]),
                Offset::Dyn(v, _) => {
                    let n = self.name(v)?;
                    let s = self.i32_const(st[d]);
                    self.let_(&format!("arith.muli {n}, {s} : i32"))
                }
            };
            base = self.let_(&format!("arith.addi {base}, {add} : i32"));
        }
        let p = padded(dims);
        let ptr = format!("!tt.ptr<{e}>");
        let moved = self.let_(&format!("tt.addptr {arg}, {base} : {ptr}, i32"));
        let mut offs: Option<String> = None;
        for d in 0..p.len() {
            if p[d] == 1 {
                continue;
            }
            let i = self.iota(&p, d);
            let term = if st[d] == 1 {
                i
            } else {
                let s = self.let_(&format!("arith.constant dense<{}> : {}", st[d], tty(&p, "i32")));
                self.let_(&format!("arith.muli {i}, {s} : {}", tty(&p, "i32")))
            };
            offs = Some(match offs {
                None => term,
                Some(prev) => self.let_(&format!("arith.addi {prev}, {term} : {}", tty(&p, "i32"))),
            });
        }
        let offs = match offs {
            Some(o) => o,
            None => self.let_(&format!("arith.constant dense<0> : {}", tty(&p, "i32"))),
        };
        let ptrs_ty = tty(&p, &ptr);
        let splat = self.let_(&format!("tt.splat {moved} : {ptr} -> {ptrs_ty}"));
        let ptrs = self.let_(&format!("tt.addptr {splat}, {offs} : {ptrs_ty}, {}", tty(&p, "i32")));
        let mask = self.inside(dims);
        Ok((ptrs, ptrs_ty, mask))
    }

    /// The scalar `e` of an index map, as i32.
    fn index(&mut self, e: &Index) -> String {
        match e {
            Index::Grid(a) => self.grid[*a].clone(),
            Index::Const(c) => self.i32_const(*c),
            Index::Add(a, b) => {
                let (a, b) = (self.index(a), self.index(b));
                self.let_(&format!("arith.addi {a}, {b} : i32"))
            }
            Index::Mul(a, k) => {
                let a = self.index(a);
                let c = self.i32_const(*k);
                self.let_(&format!("arith.muli {a}, {c} : i32"))
            }
            Index::Table(tab, at) => {
                let at = self.index(at);
                self.table_entry(tab.index, &at)
            }
        }
    }

    /// The element offset of every operand's block at this step.
    fn step_bases(&mut self) {
        let k = self.k;
        let mut bases = Vec::new();
        for o in k.inputs.iter().chain(&k.outputs) {
            let st = strides(&o.ty.dims);
            let mut acc = self.i32_const(0);
            for (d, m) in o.map.iter().enumerate() {
                if matches!(m, Index::Const(0)) {
                    continue;
                }
                let i = self.index(m);
                let s = self.i32_const(o.block[d] * st[d]);
                let t = self.let_(&format!("arith.muli {i}, {s} : i32"));
                acc = self.let_(&format!("arith.addi {acc}, {t} : i32"));
            }
            bases.push(acc);
        }
        self.bases = bases;
    }

    fn ops(&mut self, ops: &[Op]) -> Result<()> {
        for op in ops {
            self.op(op)?;
        }
        Ok(())
    }

    fn unary_f32(&mut self, op: Unary, x: &str, t: &str) -> String {
        let lib = |s: &str| {
            format!("tt.extern_elementwise {x} {{libname = \"libdevice\", libpath = \"\", pure = true, symbol = \"{s}\"}} : ({t}) -> {t}")
        };
        match op {
            Unary::Exp => self.let_(&lib("__nv_expf")),
            Unary::Exp2 => self.let_(&lib("__nv_exp2f")),
            Unary::Log => self.let_(&lib("__nv_logf")),
            Unary::Log1p => self.let_(&lib("__nv_log1pf")),
            Unary::Rsqrt => self.let_(&lib("__nv_rsqrtf")),
            Unary::Tanh => self.let_(&lib("__nv_tanhf")),
            Unary::Neg => self.let_(&format!("arith.negf {x} : {t}")),
        }
    }

    fn scratch_type(&self, i: usize) -> String {
        let t = &self.k.scratch[i].1;
        tty(&padded(&t.dims), elem(t.elem))
    }

    /// `scf.for i in lo..hi` carrying `values` (named `args` inside, of `types`) and the
    /// scratch buffers `carried`; `body` emits the step and returns the next values. Returns
    /// the loop's values after the last step (the scratch names are updated in place).
    #[allow(clippy::too_many_arguments)]
    fn counted_loop(
        &mut self,
        lo: i64,
        (hi, until): (i64, Option<&str>),
        index: &str,
        values: &[String],
        args: &[String],
        types: &[String],
        carried: &[usize],
        body: impl FnOnce(&mut Self) -> Result<Vec<String>>,
    ) -> Result<Vec<String>> {
        let (l, mut h, one) = (self.i32_const(lo), self.i32_const(hi), self.i32_const(1));
        if let Some(u) = until {
            h = self.let_(&format!("arith.minsi {h}, {u} : i32"));
        }
        let mut all_types: Vec<String> = types.to_vec();
        all_types.extend(carried.iter().map(|&i| self.scratch_type(i)));
        let mut inits: Vec<String> = values.to_vec();
        inits.extend(carried.iter().map(|&i| self.scratch[i].clone()));
        let mut arg_names: Vec<String> = args.to_vec();
        let scratch_args: Vec<String> = carried.iter().map(|_| self.temp()).collect();
        arg_names.extend(scratch_args.iter().cloned());
        let n = all_types.len();
        let r = self.temp();
        let lhs = match n {
            0 => String::new(),
            1 => format!("{r} = "),
            n => format!("{r}:{n} = "),
        };
        let iter: Vec<String> = arg_names.iter().zip(&inits).map(|(a, v)| format!("{a} = {v}")).collect();
        let carry = match n {
            0 => String::new(),
            _ => format!(" iter_args({}) -> ({})", iter.join(", "), all_types.join(", ")),
        };
        self.line(&format!("{lhs}scf.for {index} = {l} to {h} step {one}{carry} : i32 {{"));
        self.depth += 1;
        for (&i, a) in carried.iter().zip(&scratch_args) {
            self.scratch[i] = a.clone();
        }
        let mut ys = body(self)?;
        ys.extend(carried.iter().map(|&i| self.scratch[i].clone()));
        if n > 0 {
            self.line(&format!("scf.yield {} : {}", ys.join(", "), all_types.join(", ")));
        }
        self.depth -= 1;
        self.line("}");
        let outs: Vec<String> = (0..n).map(|k| if n == 1 { r.clone() } else { format!("{r}#{k}") }).collect();
        for (k, &i) in carried.iter().enumerate() {
            self.scratch[i] = outs[values.len() + k].clone();
        }
        Ok(outs[..values.len()].to_vec())
    }

    /// `x` of `dims` reduced over `axis` with the combiner `kind` (an `arith` op of `e`).
    fn reduce(&mut self, x: &str, dims: &[i64], axis: usize, e: &str, kind: &str) -> String {
        let mut reduced = dims.to_vec();
        reduced.remove(axis);
        let (from, to) = (tty(dims, e), tty(&reduced, e));
        self.combining("tt.reduce", x, &format!("axis = {axis} : i32"), (e, kind), (&from, &to))
    }

    /// `op` (`tt.reduce`, `tt.scan`) of `x` with `attrs` and the combiner `kind` (an `arith` op
    /// of `e`), from type `types.0` to `types.1`.
    pub(super) fn combining(
        &mut self,
        op: &str,
        x: &str,
        attrs: &str,
        (e, kind): (&str, &str),
        (from, to): (&str, &str),
    ) -> String {
        let (a, b, c) = (self.temp(), self.temp(), self.temp());
        let r = self.temp();
        self.line(&format!("{r} = \"{op}\"({x}) <{{{attrs}}}> ({{"));
        self.line(&format!("^bb0({a}: {e}, {b}: {e}):"));
        self.depth += 1;
        self.line(&format!("{c} = {kind} {a}, {b} : {e}"));
        self.line(&format!("{op}.return {c} : {e}"));
        self.depth -= 1;
        self.line(&format!("}}) : ({from}) -> {to}"));
        r
    }

    /// Entry `j` of axis `d` of `x` (of `dims`, element `e`), the axis dropped: the other
    /// entries masked to the combiner's identity and reduced away (exact).
    fn pick(&mut self, x: &str, dims: &[i64], d: usize, j: i64, e: DType) -> String {
        let (fill, kind) =
            if e.is_float() { (f64::NEG_INFINITY, "arith.maximumf") } else { (0.0, "arith.addi") };
        let s = self.keep_where(x, dims, e, (d, "eq", j), fill);
        self.reduce(&s, dims, d, elem(e), kind)
    }
}

/// Escapes TTIR text for the `ir` string of the custom call's config dictionary.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\22"),
            '\\' => out.push_str("\\5C"),
            '\n' => out.push_str("\\0A"),
            c => out.push(c),
        }
    }
    out
}

/// The parallel axes as the GPU launch grid `[x, y, z]` (1 where there are fewer).
pub fn launch_grid(k: &Kernel) -> [i64; 3] {
    let mut g = [1; 3];
    for (slot, (n, _)) in k.grid.iter().filter(|(_, s)| *s == Semantics::Parallel).enumerate() {
        if let Some(x) = g.get_mut(slot) {
            *x = *n;
        }
    }
    g
}

/// The kernel as Triton IR text: one public `tt.func` whose pointer arguments are the
/// tables, the inputs and the results, in that order.
fn text(k: &Kernel, params: TritonParams) -> Result<String> {
    let mut e = Emitter {
        k,
        params,
        t: Text::new("triton lowering"),
        scratch: Vec::new(),
        bases: Vec::new(),
        grid: Vec::new(),
    };
    let mut args: Vec<String> = (0..k.tables.len())
        .map(|t| format!("%tab{t}: !tt.ptr<i32> {{tt.divisibility = 16 : i32}}"))
        .collect();
    for (i, o) in k.inputs.iter().enumerate() {
        args.push(format!("%in{i}: !tt.ptr<{}> {{tt.divisibility = 16 : i32}}", elem(o.ty.elem)));
    }
    for (i, o) in k.outputs.iter().enumerate() {
        args.push(format!("%out{i}: !tt.ptr<{}> {{tt.divisibility = 16 : i32}}", elem(o.ty.elem)));
    }
    let _ = writeln!(e.out, "module {{");
    e.depth = 1;
    e.line(&format!("tt.func public @{}({}) {{", k.name, args.join(", ")));
    e.depth = 2;
    let axes = ["x", "y", "z"];
    let mut parallel = 0;
    for (n, s) in &k.grid {
        let _ = n;
        if *s == Semantics::Parallel {
            let g = e.let_(&format!("tt.get_program_id {} : i32", axes[parallel]));
            e.grid.push(g);
            parallel += 1;
        } else {
            e.grid.push(String::new());
        }
    }
    for (_, t) in &k.scratch {
        let z = e.let_(&format!(
            "arith.constant dense<{}> : {}",
            literal(0.0, t.elem),
            tty(&padded(&t.dims), elem(t.elem))
        ));
        e.scratch.push(z);
    }
    let loops: Vec<(usize, i64)> = k
        .grid
        .iter()
        .enumerate()
        .filter(|(_, (_, s))| *s == Semantics::Arbitrary)
        .map(|(a, (n, _))| (a, *n))
        .collect();
    let mut carried = BTreeSet::new();
    written(&k.body, &mut carried);
    let carried: Vec<usize> = carried.into_iter().collect();
    e.arbitrary_steps(&loops, &carried)?;
    e.line("tt.return");
    e.depth = 1;
    e.line("}");
    e.out.push_str("}\n");
    Ok(e.t.out)
}

/// The kernel called from `b` on `operands` (the tables, then the inputs): a
/// `__gpu$xla.gpu.triton` custom call that XLA's CUDA plugin compiles.
fn call(k: &Kernel, params: TritonParams, b: &mut FnBuilder, operands: &[Value]) -> Result<Vec<Value>> {
    let (operand_layouts, result_layouts) = custom_call_layouts(k, "triton", operands)?;
    let results = k.result_types();
    let text = text(k, params)?;
    // The plugin does not compare the kernel's pointer arguments with the call's buffers
    // (a wrong count compiles and runs on garbage): count them in the text.
    let signature = text.lines().find(|l| l.trim_start().starts_with("tt.func")).unwrap_or_default();
    let pointers = signature.matches("!tt.ptr<").count();
    if pointers != operands.len() + results.len() {
        return Err(err(format!(
            "kernel {} takes {pointers} pointers for {} operands and {} results",
            k.name,
            operands.len(),
            results.len()
        )));
    }
    let [gx, gy, gz] = launch_grid(k);
    let config = format!(
        "{{name = \"{}\", ir = \"{}\", num_stages = {} : i32, num_warps = {} : i32, grid_x = {gx} : i32, grid_y = {gy} : i32, grid_z = {gz} : i32, debug = false}}",
        k.name,
        escape(&text),
        params.num_stages,
        params.num_warps,
    );
    let attrs = format!(
        "call_target_name = \"__gpu$xla.gpu.triton\", api_version = 4 : i32, backend_config = {config}, operand_layouts = [{operand_layouts}], result_layouts = [{result_layouts}]",
    );
    b.custom_call(&format!("triton {}", k.name), operands, &results, &attrs)
}

impl Emitter<'_> {
    /// The nest of arbitrary axes `loops` (each a counted loop carrying `carried`), the step's
    /// block offsets and the body innermost.
    fn arbitrary_steps(&mut self, loops: &[(usize, i64)], carried: &[usize]) -> Result<()> {
        let Some(&(axis, n)) = loops.first() else {
            self.step_bases();
            let body = &self.k.body;
            return self.ops(body);
        };
        let i = self.temp();
        self.grid[axis] = i.clone();
        self.counted_loop(0, (n, None), &i, &[], &[], &[], carried, |e| {
            e.arbitrary_steps(&loops[1..], carried)?;
            Ok(Vec::new())
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[rstest::rstest]
    #[case::pow2(&[64, 128], &[64, 128])]
    #[case::k96(&[64, 96], &[64, 128])]
    #[case::tail(&[1, 160], &[1, 256])]
    fn values_live_in_power_of_two_tensors(#[case] dims: &[i64], #[case] want: &[i64]) {
        assert_eq!(super::padded(dims), want);
    }

    #[test]
    fn config_strings_escape_quotes_and_newlines() {
        assert_eq!(super::escape("a \"b\"\nc\\"), "a \\22b\\22\\0Ac\\5C");
    }
}
