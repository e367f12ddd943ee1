//! A kernel definition in the spirit of Pallas TPU: a grid whose axes are `parallel` or
//! `arbitrary`, scalar-prefetch tables, operands and results cut into blocks by index maps,
//! scratch buffers kept across grid steps, and a typed [`Body`]. [`KernelBuilder::build`] checks it
//! once; every lowering reads the checked definition.

use std::any::Any;
use std::sync::Arc;

use kda_core::DType;

use super::body::{Body, Scope};
use super::call::{Bindings, Returned};
use super::ir::{Op, OpKind, Place, Ref, Table};
use crate::error::{Result, TpuError};
use crate::hlo::{FnBuilder, Module, TensorType, Value};

/// A distinct tag per kernel builder, so that a handle of one kernel is refused by another.
static KERNELS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// How the steps of one grid axis relate: independent (`Parallel`, may run on several cores)
/// or in order with state carried from one to the next (`Arbitrary`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Semantics {
    /// Independent steps.
    Parallel,
    /// Ordered steps.
    Arbitrary,
}

/// A block index: a function of the grid indices and the scalar-prefetch tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Index {
    /// Grid index `axis`.
    Grid(usize),
    /// A constant.
    Const(i64),
    /// The sum of two indices.
    Add(Box<Index>, Box<Index>),
    /// An index times a constant.
    Mul(Box<Index>, i64),
    /// Entry `at` of scalar-prefetch table `table`.
    Table(Table, Box<Index>),
}

impl std::ops::Add for Index {
    type Output = Index;
    fn add(self, b: Index) -> Index {
        Index::Add(Box::new(self), Box::new(b))
    }
}

impl std::ops::Mul<i64> for Index {
    type Output = Index;
    fn mul(self, k: i64) -> Index {
        Index::Mul(Box::new(self), k)
    }
}

impl Index {
    /// `table[at]`.
    pub fn table(table: Table, at: Index) -> Index {
        Index::Table(table, Box::new(at))
    }

    /// The smallest and largest value over a grid of `steps` per axis; `None` when the index
    /// reads a table (known only at run time).
    fn range(&self, steps: &[i64]) -> Option<(i64, i64)> {
        match self {
            Index::Grid(a) => Some((0, steps.get(*a)? - 1)),
            Index::Const(c) => Some((*c, *c)),
            Index::Add(a, b) => {
                let ((a0, a1), (b0, b1)) = (a.range(steps)?, b.range(steps)?);
                Some((a0 + b0, a1 + b1))
            }
            Index::Mul(a, k) => {
                let (a0, a1) = a.range(steps)?;
                Some(((a0 * k).min(a1 * k), (a0 * k).max(a1 * k)))
            }
            Index::Table(..) => None,
        }
    }

    fn check(&self, grid: usize, kernel: u32) -> bool {
        match self {
            Index::Grid(a) => *a < grid,
            Index::Const(c) => i32::try_from(*c).is_ok(),
            Index::Add(a, b) => a.check(grid, kernel) && b.check(grid, kernel),
            Index::Mul(a, k) => i32::try_from(*k).is_ok() && a.check(grid, kernel),
            Index::Table(t, at) => t.kernel == kernel && at.check(grid, kernel),
        }
    }
}

/// An operand or result of a kernel: its full tensor type and the block each grid step sees
/// (`block` dims, block indices from `map`, one per dim; element offset = index x block dim).
#[derive(Clone, Debug)]
pub struct Operand {
    /// Name (for errors).
    pub name: String,
    /// The whole array.
    pub ty: TensorType,
    /// Block dims.
    pub block: Vec<i64>,
    /// Block indices.
    pub map: Vec<Index>,
}

impl Operand {
    /// An operand seen whole at every step.
    pub fn whole(name: &str, ty: TensorType) -> Self {
        let map = vec![Index::Const(0); ty.dims.len()];
        Operand { name: name.to_string(), block: ty.dims.clone(), ty, map }
    }
    /// An operand seen in `block`s at block indices `map`.
    pub fn blocked(name: &str, ty: TensorType, block: &[i64], map: Vec<Index>) -> Self {
        Operand { name: name.to_string(), ty, block: block.to_vec(), map }
    }
    pub(crate) fn block_type(&self) -> TensorType {
        TensorType::new(self.ty.elem, &self.block)
    }
}

/// The analytic work of a kernel, handed to XLA's cost model (`cost_estimate`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    /// Floating-point operations.
    pub flops: f64,
    /// Transcendental operations (`exp`, `log`, ...).
    pub transcendentals: f64,
    /// Bytes read and written in HBM.
    pub bytes: f64,
}

/// Parameters of a lowering that a kernel carries, one value per type (Pallas's compiler
/// params): opaque to the language, read by the lowering that defines the type
/// ([`Kernel::params`]).
#[derive(Clone, Default)]
pub(crate) struct ParamSet(Vec<Arc<dyn Any + Send + Sync>>);

impl ParamSet {
    fn set<P: Any + Send + Sync>(&mut self, p: P) {
        self.0.retain(|x| !x.is::<P>());
        self.0.push(Arc::new(p));
    }
    fn get<P: Any>(&self) -> Option<&P> {
        self.0.iter().find_map(|x| x.downcast_ref::<P>())
    }
}

impl std::fmt::Debug for ParamSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ParamSet({} lowering parameters)", self.0.len())
    }
}

/// A lowering of the kernel language: what it refuses, its text of a kernel, the call of that
/// text from a StableHLO function, and what a compile error of its text means. Object safe:
/// callers hold a `&dyn Lower`.
pub trait Lower: std::fmt::Debug + Send + Sync {
    /// The lowering's name, as its errors say it.
    fn name(&self) -> &str;

    /// Refuses `kernel` when it uses what this lowering has no form for: an `Unsupported`
    /// error naming the lowering, the kernel and the part it cannot lower.
    fn check(&self, kernel: &Kernel) -> Result<()>;

    /// The kernel in this lowering's own text (Mosaic MLIR, Triton IR; for a lowering to plain
    /// StableHLO, a module whose `@main` runs it).
    fn text(&self, kernel: &Kernel) -> Result<String>;

    /// The kernel called from `f` on `operands` (the tables, then the inputs, as
    /// [`Kernel::operand_types`] lists them), returning its results in order.
    /// [`Kernel::call`] and [`Kernel::module`] run [`Lower::check`] first.
    fn call(&self, kernel: &Kernel, f: &mut FnBuilder, operands: &[Value]) -> Result<Vec<Value>>;

    /// A compile error of this lowering's text of `kernel`, with the place it names quoted
    /// where the lowering can find it; the error as it came by default.
    fn explain(&self, kernel: &Kernel, error: TpuError) -> TpuError {
        let _ = kernel;
        error
    }
}

/// A checked kernel: what every lowering reads.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub(crate) tag: u32,
    pub(crate) name: String,
    pub(crate) grid: Vec<(i64, Semantics)>,
    pub(crate) tables: Vec<(String, i64)>,
    pub(crate) inputs: Vec<Operand>,
    pub(crate) outputs: Vec<Operand>,
    pub(crate) scratch: Vec<(String, TensorType)>,
    pub(crate) body: Vec<Op>,
    pub(crate) cost: Option<Cost>,
    pub(crate) params: ParamSet,
}

/// The parts of a kernel before its body. Each part added returns its handle ([`Table`],
/// [`Ref`]): the body and the call name operands by these, never by position.
#[derive(Clone, Debug)]
pub struct KernelBuilder {
    tag: u32,
    name: String,
    grid: Vec<(i64, Semantics)>,
    tables: Vec<(String, i64)>,
    inputs: Vec<Operand>,
    outputs: Vec<Operand>,
    scratch: Vec<(String, TensorType)>,
    cost: Option<Cost>,
    params: ParamSet,
}

fn err(what: &str, message: impl Into<String>) -> TpuError {
    TpuError::builder(format!("kernel {what}"), message)
}

impl KernelBuilder {
    /// A kernel named `name` (an MLIR symbol: letters, digits, `_`).
    pub fn new(name: &str) -> Self {
        KernelBuilder {
            tag: KERNELS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            name: name.to_string(),
            grid: Vec::new(),
            tables: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            scratch: Vec::new(),
            cost: None,
            params: ParamSet::default(),
        }
    }
    /// Adds a grid axis of `steps` steps.
    pub fn grid(&mut self, steps: i64, semantics: Semantics) -> &mut Self {
        self.grid.push((steps, semantics));
        self
    }
    /// Adds a scalar-prefetch table of `len` i32 entries (the call's first operands, in SMEM).
    pub fn table(&mut self, name: &str, len: i64) -> Table {
        self.tables.push((name.to_string(), len));
        Table { kernel: self.tag, index: self.tables.len() - 1 }
    }
    /// Adds an operand.
    pub fn input(&mut self, operand: Operand) -> Ref {
        self.inputs.push(operand);
        Ref { kernel: self.tag, place: Place::Input(self.inputs.len() - 1) }
    }
    /// Adds a result. A step sees its result block as the TPU does: a VMEM buffer that holds
    /// what the earlier steps with the same block index wrote, uninitialised on a block's
    /// first visit (NaN in the interpret lowering); blocks go back to HBM when the index
    /// changes. Write every block before reading it, and visit each one in consecutive steps.
    pub fn output(&mut self, operand: Operand) -> Ref {
        self.outputs.push(operand);
        Ref { kernel: self.tag, place: Place::Output(self.outputs.len() - 1) }
    }
    /// Adds a VMEM scratch buffer, kept across grid steps (zero before the first step in the
    /// interpret lowering; on a TPU, whatever VMEM held: initialise it in the body).
    pub fn scratch(&mut self, name: &str, ty: TensorType) -> Ref {
        self.scratch.push((name.to_string(), TensorType::new(ty.elem, &ty.dims)));
        Ref { kernel: self.tag, place: Place::Scratch(self.scratch.len() - 1) }
    }
    /// Sets a parameter of a lowering (its own type: [`super::MosaicParams`],
    /// [`super::TritonParams`], ...), replacing one of the same type; the lowerings that do not
    /// define the type ignore it.
    pub fn params<P: Any + Send + Sync>(&mut self, params: P) -> &mut Self {
        self.params.set(params);
        self
    }
    /// Sets the analytic cost.
    pub fn cost(&mut self, cost: Cost) -> &mut Self {
        self.cost = Some(cost);
        self
    }
    fn check_operand(&self, o: &Operand) -> Result<()> {
        let what = format!("operand {}", o.name);
        let r = o.ty.dims.len();
        if r == 0 || o.block.len() != r || o.map.len() != r {
            return Err(err(&what, format!("{} with block {:?} and {} indices", o.ty, o.block, o.map.len())));
        }
        if !matches!(o.ty.elem, DType::F32 | DType::BF16 | DType::I32) {
            return Err(err(&what, format!("{}: f32, bf16 or i32 arrays", o.ty)));
        }
        for (i, (&b, &d)) in o.block.iter().zip(&o.ty.dims).enumerate() {
            if b < 1 || d % b != 0 {
                return Err(err(&what, format!("block dim {i} of {b} does not divide {} ({})", d, o.ty)));
            }
        }
        if o.map.iter().any(|m| !m.check(self.grid.len(), self.tag)) {
            return Err(err(&what, "an index names a grid axis or table the kernel lacks"));
        }
        // Block indices the grid alone decides must stay inside the array (table-read ones are
        // the caller's to keep in range: the interpret lowering clamps them, Mosaic does not).
        let steps: Vec<i64> = self.grid.iter().map(|(n, _)| *n).collect();
        for (axis, (m, (&b, &d))) in o.map.iter().zip(o.block.iter().zip(&o.ty.dims)).enumerate() {
            if let Some((lo, hi)) = m.range(&steps) {
                if lo < 0 || hi >= d / b {
                    return Err(err(
                        &what,
                        format!("block index {lo}..={hi} of dim {axis}: {} blocks there", d / b),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the parts, builds the body with `body` and returns the kernel.
    pub fn build(self, body: impl FnOnce(&mut Body) -> Result<()>) -> Result<Kernel> {
        let symbol = !self.name.is_empty()
            && self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !self.name.starts_with(|c: char| c.is_ascii_digit());
        if !symbol {
            return Err(err("name", format!("`{}` is not a symbol", self.name)));
        }
        if self.grid.is_empty() || self.grid.iter().any(|(n, _)| *n < 1 || i32::try_from(*n).is_err()) {
            return Err(err("grid", format!("{:?}: one axis or more, each of 1 to 2^31 steps", self.grid)));
        }
        if self.outputs.is_empty() {
            return Err(err("outputs", "a kernel returns one result or more"));
        }
        for o in self.inputs.iter().chain(&self.outputs) {
            self.check_operand(o)?;
        }
        for (name, t) in &self.scratch {
            if t.dims.is_empty() || !matches!(t.elem, DType::F32 | DType::BF16 | DType::I32) {
                return Err(err(&format!("scratch {name}"), format!("{t:?}: an f32, bf16 or i32 array")));
            }
        }
        if self.tables.iter().any(|(_, n)| *n < 1) {
            return Err(err("tables", "each table holds one entry or more"));
        }
        let scope = Scope {
            kernel: self.tag,
            grid: self.grid.len(),
            tables: self.tables.len(),
            inputs: self.inputs.iter().map(Operand::block_type).collect(),
            outputs: self.outputs.iter().map(Operand::block_type).collect(),
            scratch: self.scratch.iter().map(|(_, t)| t.clone()).collect(),
        };
        let mut b = Body::new(scope);
        body(&mut b)?;
        Ok(Kernel {
            tag: self.tag,
            name: self.name,
            grid: self.grid,
            tables: self.tables,
            inputs: self.inputs,
            outputs: self.outputs,
            scratch: self.scratch,
            body: b.finish()?,
            cost: self.cost,
            params: self.params,
        })
    }
}

impl Kernel {
    /// The same kernel with a lowering's parameter set ([`KernelBuilder::params`]).
    pub fn with_params<P: Any + Send + Sync>(mut self, params: P) -> Kernel {
        self.params.set(params);
        self
    }
    /// The kernel's parameter of type `P`, if it has one.
    pub fn params<P: Any>(&self) -> Option<&P> {
        self.params.get::<P>()
    }
    /// Calls `visit` on the kind of every op of the body, in the order they were built, a
    /// region's ops after the op that holds them: what a lowering outside this crate can read
    /// of a body.
    pub fn walk(&self, visit: &mut dyn FnMut(OpKind)) {
        fn go(ops: &[Op], visit: &mut dyn FnMut(OpKind)) {
            for op in ops {
                visit(op.kind());
                match op {
                    Op::If { then, .. } => go(then, visit),
                    Op::For { body, .. } => go(body, visit),
                    _ => {}
                }
            }
        }
        go(&self.body, visit);
    }
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The result types, in order.
    pub fn result_types(&self) -> Vec<TensorType> {
        self.outputs.iter().map(|o| o.ty.clone()).collect()
    }
    /// The operand types the call takes: the tables (i32), then the inputs.
    pub fn operand_types(&self) -> Vec<TensorType> {
        let tables = self.tables.iter().map(|(_, n)| TensorType::new(DType::I32, &[*n]));
        tables.chain(self.inputs.iter().map(|o| o.ty.clone())).collect()
    }

    /// Empty bindings for a call of this kernel.
    pub fn bindings(&self) -> Bindings {
        Bindings::new(self.tag, &self.name, self.tables.len(), self.inputs.len())
    }

    /// The kernel called from `f` on `args` (every table and input bound), lowered by
    /// `lowering` once it has accepted the kernel ([`Lower::check`]).
    pub fn call(&self, f: &mut FnBuilder, lowering: &dyn Lower, args: Bindings) -> Result<Returned> {
        let names = self.tables.iter().map(|(n, _)| n).chain(self.inputs.iter().map(|o| &o.name));
        let operands = args.operands(self.tag, names)?;
        lowering.check(self)?;
        Ok(Returned::new(self.tag, &self.name, lowering.call(self, f, &operands)?))
    }

    /// A module whose public `@main` takes the kernel's operands (tables, then inputs) and
    /// returns its results, lowered by `lowering` once it has accepted the kernel.
    pub fn module(&self, lowering: &dyn Lower) -> Result<String> {
        lowering.check(self)?;
        let mut f = FnBuilder::new("main", true);
        let args = self.operand_types().into_iter().map(|t| f.arg(t)).collect::<Result<Vec<_>>>()?;
        let outs = lowering.call(self, &mut f, &args)?;
        f.ret(&outs)?;
        let mut m = Module::new();
        m.add(f)?;
        Ok(m.to_text())
    }
}
