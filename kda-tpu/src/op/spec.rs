//! The static description of one compiled program: everything that changes the program text.

use kda_core::{DType, GateKind, Layout, Problem, ProblemDims};

pub(crate) use kda_core::CHUNK;
/// Diagonal block size of the blocked `(I + L)^-1`.
pub const SUB: usize = 16;

/// Chunk positions per slab of the fused programs on devices whose memory is the constraint
/// (TPU, GPU): two chunk positions a slab keep the fused programs' peak a fraction of the
/// unslabbed one's (docs/performance.md, Design figures). The CPU plugin runs without slabs
/// (faster there: nothing is recomputed, and host memory is plentiful).
pub const TPU_SLAB: usize = 2;

/// The dtype a host tensor of `dtype` travels and is read in: bf16 stays bf16, f32 and f64
/// are f32 (f64 is uploaded as f32).
pub fn on_device(dtype: DType) -> DType {
    if dtype == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    }
}

pub use kda_core::Implementation;

/// The VMEM a packed kernel's head-resident results may take by default (f32,
/// double-buffered): the forward's `o` and the backward's gradients read in place within it,
/// else through lanes ([`TpuKernelConfig::packed_result_bytes`]).
pub const PACKED_RESULT_BYTES: usize = 12 << 20;

/// The spec of a program under its earlier name.
#[deprecated(since = "0.3.0", note = "renamed ProgramSpec: it describes a program, not a kernel")]
pub type KernelSpec = ProgramSpec;

/// Shapes and options baked into a program, in three parts: the problem's dims, the op's
/// options and the tuning. Two problems with equal specs share executables: the spec is the
/// compile cache's key (`Eq` and `Hash`, its f64 fields hashed by their bits).
#[derive(Debug, Clone, PartialEq)]
pub struct ProgramSpec {
    /// Heads, rows, tokens per row, key and value widths, segment slots per row.
    pub dims: ProblemDims,
    /// Packed: the static chunk capacity; `None` for fixed length.
    pub packed_chunks: Option<usize>,
    /// What the op computes and how its tensors are laid out.
    pub options: OpOptions,
    /// How the programs compute it (no effect on results beyond rounding).
    pub tuning: Tuning,
}

/// The op's options: layouts, dtypes, the gate, the norm, the scale and which states go in
/// and out.
#[derive(Debug, Clone, PartialEq)]
pub struct OpOptions {
    /// Layout of per-token inputs and outputs.
    pub layout: Layout,
    /// Element type of q, k, v, beta, do (and of o and their gradients).
    pub dtype: DType,
    /// Element type of `g` and `dg`: `dtype` unless the caller's `g` differs (an f32 gate with
    /// bf16 q, k, v keeps its precision; [`ProgramSpec::with_g_dtype`]).
    pub g_dtype: DType,
    /// Gate kind (the lower bound is baked in).
    pub gate: GateKind,
    /// Whether an in-kernel gate has a `dt_bias` input.
    pub has_dt_bias: bool,
    /// In-kernel q/k L2 norm.
    pub l2norm: bool,
    /// The query scale.
    pub scale: f64,
    /// Whether `beta` carries a trailing 1.
    pub beta_trailing_one: bool,
    /// Whether an initial state is an input.
    pub has_h0: bool,
    /// Whether final states are an output.
    pub final_state: bool,
    /// Whether `dht` is an input of backward programs.
    pub has_dht: bool,
}

/// The tuning of the programs: what runs their chunk loops and how they are cut. Results agree
/// whatever it is (to rounding). It is set in one place: [`crate::PjrtOptions::tuning`] for a
/// new handle, [`crate::PjrtBackend::with_tuning`] for a handle, [`ProgramSpec::with_tuning`]
/// for a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tuning {
    /// What runs the programs' chunk loops (the context-parallel programs are XLA's): its row
    /// of the table ([`super::table::row`]) reads its own part below.
    pub implementation: Implementation,
    /// The XLA chunk loops' part.
    pub xla: XlaConfig,
    /// The TPU kernels' part (the `mosaic` and `interpret` rows).
    pub tpu_kernels: TpuKernelConfig,
    /// The GPU kernels' part (the `triton` and `triton-interpret` rows).
    pub gpu_kernels: GpuKernelConfig,
}

/// The tuning the GPU kernels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct GpuKernelConfig {
    /// Whether the kernels read packed rows at widths they take in place, writing `o` and the
    /// gradients straight to the packed tokens (true, the default: no gather or compaction in
    /// XLA); else XLA gathers them into aligned chunks and compacts the results back.
    pub packed_in_place: bool,
}

impl Default for GpuKernelConfig {
    /// Packed rows read in place.
    fn default() -> Self {
        GpuKernelConfig { packed_in_place: true }
    }
}

/// The tuning the XLA chunk loops read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct XlaConfig {
    /// Fused programs: chunk positions per slab (0: all chunks at once). With slabs the fused
    /// forward+VJP runs its chunk-parallel work slab by slab inside the recurrence loops, so
    /// only one slab's intermediates are live at a time (see `programs::fused_program`).
    /// 0 also selects the CPU form of the forward alone (outputs formed inside the recurrence).
    pub slab: usize,
}

/// The tuning the TPU kernels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TpuKernelConfig {
    /// The TPU kernels' wish of chunks per grid step for rows of whole blocks (0: their
    /// defaults, the forward kernel's `default_step_chunks`, the backward's capped by its
    /// `BackwardSteps`).
    pub step_chunks: usize,
    /// The VMEM packed kernel programs may give a head's resident results (f32,
    /// double-buffered) to read packed tokens in place; above it they go through lanes.
    pub packed_result_bytes: usize,
    /// Whether the kernels read packed rows of whole 64-token blocks without per-segment states
    /// as one row of blocks, several chunks a step, with the segment boundaries inside a chunk
    /// as masks (true, the default: what a fixed row of the same tokens costs, at any length);
    /// else through per-chunk windows, as rows with `h0` or final states always are.
    pub packed_blocks: bool,
}

impl Default for XlaConfig {
    /// No slabs.
    fn default() -> Self {
        XlaConfig { slab: 0 }
    }
}

impl Default for TpuKernelConfig {
    /// The kernels' default steps, [`PACKED_RESULT_BYTES`], packed rows as whole blocks.
    fn default() -> Self {
        TpuKernelConfig { step_chunks: 0, packed_result_bytes: PACKED_RESULT_BYTES, packed_blocks: true }
    }
}

impl Default for Tuning {
    /// XLA's chunk loops with each part's defaults.
    fn default() -> Self {
        Tuning {
            implementation: Implementation::Xla,
            xla: XlaConfig::default(),
            tpu_kernels: TpuKernelConfig::default(),
            gpu_kernels: GpuKernelConfig::default(),
        }
    }
}

impl Tuning {
    /// The defaults for a plugin of `platform`: no slabs on the CPU ([`TPU_SLAB`] elsewhere:
    /// slabs bound the live intermediates, the memory figure that matters on a TPU, at the cost
    /// of recomputing the chunk terms in the backward loop).
    pub fn for_platform(platform: &str) -> Self {
        Tuning::default().with_slab(if platform == "cpu" { 0 } else { TPU_SLAB })
    }
    /// Programs run by `implementation`: [`Implementation::Mosaic`] needs a TPU plugin,
    /// [`Implementation::Interpret`] runs the same kernels' interpret lowering on any plugin.
    pub fn with_implementation(self, implementation: Implementation) -> Self {
        Tuning { implementation, ..self }
    }
    /// Fused programs in slabs of `chunks` chunk positions (0: no slabs; [`XlaConfig::slab`]).
    pub fn with_slab(mut self, chunks: usize) -> Self {
        self.xla.slab = chunks;
        self
    }
    /// The TPU kernels (forward and backward) running at most `chunks` chunks per grid step on
    /// rows of whole blocks (the largest power of two up to it dividing the chunk count; 0:
    /// their defaults, which count fewest cycles). More chunks a step overlap more work and
    /// stream operands in fewer steps; fewer make smaller kernels that libtpu compiles faster
    /// (eight: docs/kda.md, Compile time) ([`TpuKernelConfig::step_chunks`]).
    pub fn with_step_chunks(mut self, chunks: usize) -> Self {
        self.tpu_kernels.step_chunks = chunks;
        self
    }
    /// Packed kernel programs reading tokens in place (and placing results straight into their
    /// packed tokens) only while a head's results fit `bytes` of VMEM (f32, double-buffered);
    /// above it, or with 0, XLA gathers chunk-aligned lanes and compacts the results.
    pub fn with_packed_result_bytes(mut self, bytes: usize) -> Self {
        self.tpu_kernels.packed_result_bytes = bytes;
        self
    }
    /// Packed rows without per-segment states read as whole blocks with segment masks (true,
    /// the default) or through per-chunk windows (false; [`TpuKernelConfig::packed_blocks`]).
    /// With [`Tuning::with_packed_result_bytes`] 0 every packed row goes through lanes.
    pub fn with_packed_blocks(mut self, blocks: bool) -> Self {
        self.tpu_kernels.packed_blocks = blocks;
        self
    }
    /// The GPU kernels reading packed rows in place (true, the default) or XLA gathering them
    /// into aligned chunks and compacting the results ([`GpuKernelConfig::packed_in_place`]).
    pub fn with_packed_in_place(mut self, in_place: bool) -> Self {
        self.gpu_kernels.packed_in_place = in_place;
        self
    }
}

impl ProgramSpec {
    /// The spec of a validated problem; `packed_chunks` comes from `kda-packed`'s static plan.
    pub fn new(p: &Problem, packed_chunks: Option<usize>, has_dht: bool) -> Self {
        let options = OpOptions {
            layout: p.layout,
            dtype: p.dtype,
            g_dtype: p.dtype,
            gate: p.gate,
            has_dt_bias: p.has_dt_bias,
            l2norm: p.use_qk_l2norm,
            scale: p.scale,
            beta_trailing_one: p.beta_shape.len() == 4,
            has_h0: p.has_initial_state,
            final_state: p.output_final_state,
            has_dht,
        };
        ProgramSpec { dims: p.dims, packed_chunks, options, tuning: Tuning::default() }
    }
    /// The spec of a call's inputs, as the backend builds it: validated, packed segments at
    /// `kda-packed`'s static capacity, `g` read in its own dtype, the default tuning (see
    /// [`ProgramSpec::with_tuning`]). `has_dht`: whether backward and fused programs take `dht`.
    pub fn of_inputs(inputs: &kda_core::KdaInputs, has_dht: bool) -> crate::Result<Self> {
        let p = inputs.validate()?;
        let packed = if p.segments.is_packed() {
            Some(kda_packed::StaticCapacity::new(p.dims.b, p.dims.t, p.dims.n, CHUNK)?.chunks())
        } else {
            None
        };
        Ok(ProgramSpec::new(&p, packed, has_dht).with_g_dtype(inputs.g.dtype()))
    }
    /// The same spec reading `g` (and writing `dg`) as `dtype` (bf16, or f32 for f32 and f64).
    pub fn with_g_dtype(mut self, dtype: DType) -> Self {
        self.options.g_dtype = on_device(dtype);
        self
    }
    /// The same spec tuned as `tuning` says.
    pub fn with_tuning(mut self, tuning: Tuning) -> Self {
        self.tuning = tuning;
        self
    }
    /// Whether the programs run in slabs (the TPU configuration): `slab` set and below the
    /// chunk count.
    pub fn in_slabs(&self) -> bool {
        self.tuning.xla.slab > 0 && self.tuning.xla.slab < self.chunks()
    }
    /// Independent recurrences run side by side: `H*B` fixed, `H` packed (rows run in sequence).
    pub fn lanes(&self) -> usize {
        if self.packed_chunks.is_some() {
            self.dims.h
        } else {
            self.dims.h * self.dims.b
        }
    }
    /// Chunks per lane.
    pub fn chunks(&self) -> usize {
        self.packed_chunks.unwrap_or(self.dims.t.div_ceil(CHUNK))
    }
    /// State slots per lane: `B*N` packed, 1 fixed.
    pub fn slots(&self) -> usize {
        if self.packed_chunks.is_some() {
            self.dims.b * self.dims.n
        } else {
            self.dims.n
        }
    }
    /// Whether the gate is computed in the kernel.
    pub fn in_kernel_gate(&self) -> bool {
        self.options.gate != GateKind::Preactivated
    }
    /// Shape of a per-token input of width `d` in the caller's layout.
    pub fn token_dims(&self, d: usize) -> Vec<i64> {
        self.options
            .layout
            .token_shape(self.dims.h, self.dims.b, self.dims.t, d)
            .iter()
            .map(|&x| x as i64)
            .collect()
    }
    /// Shape of `beta` as the caller gives it.
    pub fn beta_dims(&self) -> Vec<i64> {
        let mut s: Vec<i64> = self
            .options
            .layout
            .scalar_shape(self.dims.h, self.dims.b, self.dims.t)
            .iter()
            .map(|&x| x as i64)
            .collect();
        if self.options.beta_trailing_one {
            s.push(1);
        }
        s
    }
    /// Whether the programs hold their per-token tensors in the kernel forms
    /// ([`ProgramSpec::kernel_token_dims`]): programs run by a kernel lowering. XLA's programs
    /// keep the caller's shapes, from which XLA's layout assignment makes fewer copies.
    pub fn kernel_forms(&self) -> bool {
        super::table::row(self.tuning.implementation).is_ok_and(|r| r.kernel_forms())
    }
    /// A kernel program's form of a per-token input of width `d` (the row-major elements of
    /// [`ProgramSpec::token_dims`]): head-first `[H, B, T, D]` as given, batch-first
    /// `[B*T, H*D]`, whose TPU tiles run along tokens (a `[B, T, H, D]` array is tiled over
    /// `(H, D)`, and reading a head's tokens from it costs a relayout of the whole tensor).
    pub fn kernel_token_dims(&self, d: usize) -> Vec<i64> {
        let (h, b, t, d) = (self.dims.h as i64, self.dims.b as i64, self.dims.t as i64, d as i64);
        match self.options.layout {
            Layout::HeadFirst => vec![h, b, t, d],
            Layout::BatchFirst => vec![b * t, h * d],
        }
    }
    /// A kernel program's form of `beta`: head-first as given, batch-first `[B*T, H]`.
    pub fn kernel_beta_dims(&self) -> Vec<i64> {
        match self.options.layout {
            Layout::HeadFirst => self.beta_dims(),
            Layout::BatchFirst => vec![(self.dims.b * self.dims.t) as i64, self.dims.h as i64],
        }
    }
    /// A per-token result of width `d`, 2-D: `[H*B*T, D]` head-first; batch-first
    /// `[B*T, H*D]` in a kernel program, `[B*T*H, D]` in XLA's (each the row-major elements
    /// of the caller's shape).
    pub fn result_token_dims(&self, d: usize, kernel_forms: bool) -> Vec<i64> {
        let (h, b, t, d) = (self.dims.h as i64, self.dims.b as i64, self.dims.t as i64, d as i64);
        match (self.options.layout, kernel_forms) {
            (Layout::BatchFirst, true) => vec![b * t, h * d],
            _ => vec![h * b * t, d],
        }
    }
    /// `[B, N, H, K, V]`.
    pub fn state_dims(&self) -> Vec<i64> {
        [self.dims.b, self.dims.n, self.dims.h, self.dims.k, self.dims.v].iter().map(|&x| x as i64).collect()
    }
}

// The scale and the gate's bound are validated finite, so the derived `PartialEq` is an
// equivalence, and hashing their bits agrees with it (neither is ever -0.0).
impl Eq for ProgramSpec {}

impl std::hash::Hash for ProgramSpec {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Destructured, so that a new field cannot be left out of the key.
        let ProgramSpec { dims, packed_chunks, options, tuning } = self;
        let ProblemDims { h, b, t, k, v, n } = dims;
        let OpOptions {
            layout,
            dtype,
            g_dtype,
            gate,
            has_dt_bias,
            l2norm,
            scale,
            beta_trailing_one,
            has_h0,
            final_state,
            has_dht,
        } = options;
        (h, b, t, k, v, n, packed_chunks, layout, dtype, g_dtype).hash(state);
        match gate {
            GateKind::Preactivated => 0u64.hash(state),
            GateKind::Softplus => 1u64.hash(state),
            GateKind::LowerBound(lb) => (2u64, lb.to_bits()).hash(state),
        }
        (has_dt_bias, l2norm, scale.to_bits(), beta_trailing_one, has_h0, final_state, has_dht).hash(state);
        tuning.hash(state);
    }
}
