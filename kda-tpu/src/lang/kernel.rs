//! A kernel definition in the spirit of Pallas TPU: a grid whose axes are `parallel` or
//! `arbitrary`, scalar-prefetch tables, operands and results cut into blocks by index maps,
//! scratch buffers kept across grid steps, and a typed [`Body`]. [`Kernel::build`] checks it
//! once; the two lowerings read the checked definition.

use kda_core::DType;

use super::body::{Body, Op, Place, Ref, Scope, Table};
use crate::error::{Result, TpuError};
use crate::hlo::TensorType;

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

/// How a kernel launches on a GPU (the Triton lowering): warps per program, software
/// pipeline stages of its loops, and how its full-precision f32 products run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuLaunch {
    /// Warps per program: 1, 2, 4, 8, 16 or 32 (`wgmma` needs 4 or more).
    pub num_warps: u32,
    /// Pipeline stages of the loads in loops: 1 to 5 (each stage holds its loads in shared
    /// memory).
    pub num_stages: u32,
    /// The `tt.dot` precision of f32 products at [`super::MatPrecision::Highest`].
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

impl Default for GpuLaunch {
    /// Four warps (one warp group, the smallest that issues `wgmma`), two stages, IEEE f32
    /// products.
    fn default() -> Self {
        GpuLaunch { num_warps: 4, num_stages: 2, f32_dot: F32Dot::Ieee }
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
    pub(crate) vmem_limit: Option<i64>,
    pub(crate) gpu: GpuLaunch,
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
    vmem_limit: Option<i64>,
    gpu: GpuLaunch,
}

fn err(what: &str, message: impl Into<String>) -> TpuError {
    TpuError::builder(format!("mosaic kernel {what}"), message)
}

/// The (sublane, lane) tiling of a 32-bit or 16-bit array's last two dims.
fn tiling(dtype: DType) -> (i64, i64) {
    if dtype.bit_width() == 16 {
        (16, 128)
    } else {
        (8, 128)
    }
}

impl Operand {
    /// Where the block breaks Mosaic's rule (each of the last two block dims a multiple of the
    /// (8, 128) tiling of 32-bit types, (16, 128) of 16-bit ones, or the full dim), if it does.
    pub(crate) fn off_tiling(&self) -> Option<String> {
        let r = self.ty.dims.len();
        let (sub, lane) = tiling(self.ty.elem);
        let tiles = if r >= 2 { vec![(r - 2, sub), (r - 1, lane)] } else { vec![(0, lane)] };
        tiles.into_iter().find_map(|(axis, t)| {
            let (b, d) = (self.block[axis], self.ty.dims[axis]);
            (b != d && b % t != 0).then(|| {
                format!(
                    "block {:?} of {}: dim {axis} must be a multiple of {t} or the full {d}",
                    self.block, self.ty
                )
            })
        })
    }
}

/// Refuses launches the CUDA plugin aborts on (other warp counts) or refuses.
fn check_launch(launch: GpuLaunch) -> Result<()> {
    let GpuLaunch { num_warps, num_stages, .. } = launch;
    if !matches!(num_warps, 1 | 2 | 4 | 8 | 16 | 32) || !(1..=5).contains(&num_stages) {
        return Err(err(
            "gpu launch",
            format!("{num_warps} warps, {num_stages} stages: warps 1, 2, 4, 8, 16 or 32, stages 1 to 5"),
        ));
    }
    Ok(())
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
            vmem_limit: None,
            gpu: GpuLaunch::default(),
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
    /// Sets how the kernel launches on a GPU (the Triton lowering; others ignore it).
    pub fn gpu_launch(&mut self, launch: GpuLaunch) -> &mut Self {
        self.gpu = launch;
        self
    }
    /// Sets the analytic cost.
    pub fn cost(&mut self, cost: Cost) -> &mut Self {
        self.cost = Some(cost);
        self
    }
    /// Sets the scoped VMEM the TPU compiler may give the kernel (its blocks, scratch and
    /// spills), for a kernel that needs more than the generation's default (16 MiB on v5e, the
    /// smallest). Only the Mosaic lowering reads it. Refused unless positive.
    pub fn vmem_limit(&mut self, bytes: i64) -> Result<&mut Self> {
        if bytes <= 0 {
            return Err(err("vmem_limit", format!("{bytes} bytes")));
        }
        self.vmem_limit = Some(bytes);
        Ok(self)
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
        // Other warp counts abort the CUDA plugin's process rather than fail the compile.
        check_launch(self.gpu)?;
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
            vmem_limit: self.vmem_limit,
            gpu: self.gpu,
        })
    }
}

impl Kernel {
    /// The same kernel launched as `launch` on a GPU.
    pub fn with_gpu_launch(mut self, launch: GpuLaunch) -> Result<Kernel> {
        check_launch(launch)?;
        self.gpu = launch;
        Ok(self)
    }
    /// How the kernel launches on a GPU.
    pub fn gpu_launch(&self) -> GpuLaunch {
        self.gpu
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
}
