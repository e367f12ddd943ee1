//! Tensor types and SSA value handles of the builder (element types are [`kda_core::DType`]).

use std::fmt;

pub(crate) use kda_core::DType;

/// Highest tensor rank a [`Value`] can carry inline (KDA programs use at most 6).
pub const MAX_RANK: usize = 8;

/// A ranked tensor type; `Display` gives `tensor<8x64xf32>` (`tensor<f32>` for scalars).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub elem: DType,
    /// Static dimensions, outermost first.
    pub dims: Vec<i64>,
}

impl TensorType {
    /// A tensor type from an element type and dims.
    pub fn new(elem: DType, dims: &[i64]) -> Self {
        TensorType { elem, dims: dims.to_vec() }
    }

    /// A rank-0 tensor type.
    pub fn scalar(elem: DType) -> Self {
        TensorType { elem, dims: Vec::new() }
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Product of the dims (1 for scalars).
    pub fn num_elements(&self) -> i64 {
        self.dims.iter().product()
    }

    /// The same dims with another element type.
    pub fn with_elem(&self, elem: DType) -> Self {
        TensorType { elem, dims: self.dims.clone() }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tensor<")?;
        for d in &self.dims {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.elem)
    }
}

/// Result index meaning "the op has a single result" (printed `%N`, not `%N#i`).
pub(crate) const SINGLE: u32 = u32::MAX;

/// A cheap SSA value handle: its id within one [`super::FnBuilder`] and its tensor type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Value {
    pub(crate) fn_id: u32,
    pub(crate) id: u32,
    pub(crate) result: u32,
    elem: DType,
    rank: u8,
    dims: [i64; MAX_RANK],
}

impl Value {
    /// Built only by the builder, which has checked `dims.len() <= MAX_RANK`.
    pub(crate) fn new(fn_id: u32, id: u32, result: u32, ty: &TensorType) -> Self {
        let mut dims = [0; MAX_RANK];
        dims[..ty.dims.len()].copy_from_slice(&ty.dims);
        Value { fn_id, id, result, elem: ty.elem, rank: ty.dims.len() as u8, dims }
    }

    /// The value's tensor type.
    pub fn ty(&self) -> TensorType {
        TensorType { elem: self.elem, dims: self.dims().to_vec() }
    }

    /// The value's dims.
    pub fn dims(&self) -> &[i64] {
        &self.dims[..self.rank as usize]
    }

    /// The value's element type.
    pub fn elem(&self) -> DType {
        self.elem
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.rank as usize
    }

    /// Product of the dims (1 for scalars).
    pub fn num_elements(&self) -> i64 {
        self.dims().iter().product()
    }

    /// The SSA name as printed in the text (`%7`, or `%7#1` for the second result of a multi-result op).
    pub fn name(&self) -> String {
        if self.result == SINGLE {
            format!("%{}", self.id)
        } else {
            format!("%{}#{}", self.id, self.result)
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Comparison direction of `stablehlo.compare`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cmp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

impl Cmp {
    pub(crate) fn mlir(self) -> &'static str {
        match self {
            Cmp::Eq => "EQ",
            Cmp::Ne => "NE",
            Cmp::Lt => "LT",
            Cmp::Le => "LE",
            Cmp::Gt => "GT",
            Cmp::Ge => "GE",
        }
    }
}

/// Precision of `dot_general` operands; on TPU `Default` runs f32 matmuls in bf16 passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Backend default (fastest; reduced precision for f32 on TPU).
    #[default]
    Default,
    /// Three bf16 passes on TPU.
    High,
    /// Full f32 precision.
    Highest,
}

impl Precision {
    pub(crate) fn mlir(self) -> &'static str {
        match self {
            Precision::Default => "DEFAULT",
            Precision::High => "HIGH",
            Precision::Highest => "HIGHEST",
        }
    }
}
