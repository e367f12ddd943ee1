//! Validation: the contract of docs/kda.md, Tensors, Packing and Shapes turned into typed errors, and the
//! validated [`Problem`] that backends work from.

use crate::config::{GateKind, KdaConfig, MAX_K};
use crate::dtype::DType;
use crate::error::{KdaError, Result};
use crate::io::{Cotangents, KdaInputs};
use crate::segments::{SegmentTable, Segments};
use crate::shape::{fmt_shape, Layout, ProblemDims, Shape};
use crate::tensor::{HostTensor, ValueRange};

/// A validated KDA call: sizes, options and segments, without the tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Sizes (N = segment slots per row).
    pub dims: ProblemDims,
    /// Layout of the per-token tensors.
    pub layout: Layout,
    /// dtype of q, k, v (and of the output).
    pub dtype: DType,
    /// The resolved query scale.
    pub scale: f64,
    /// Segments, one range per slot and row.
    pub segments: SegmentTable,
    /// Whether an initial state was given.
    pub has_initial_state: bool,
    /// The gate kind.
    pub gate: GateKind,
    /// Whether an in-kernel gate has a `dt_bias`.
    pub has_dt_bias: bool,
    /// q/k L2 norm inside the kernel.
    pub use_qk_l2norm: bool,
    /// Whether final states are returned.
    pub output_final_state: bool,
    /// The shape `beta` was given in (a trailing 1 is kept for `dbeta`).
    pub beta_shape: Shape,
}

impl Problem {
    /// dtype of final states and `dh0`: f64 for f64 inputs, f32 otherwise.
    pub fn state_dtype(&self) -> DType {
        if self.dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }
}

fn finite(arg: &str, t: &HostTensor) -> Result<()> {
    within(arg, t, ValueRange::Finite)
}

/// One pass over `t` for `range`; a non-finite value is named as such whatever the range.
fn within(arg: &str, t: &HostTensor, range: ValueRange) -> Result<()> {
    let Some(i) = t.first_outside(range) else { return Ok(()) };
    let x = t.get_f64(i);
    let expected = if x.is_finite() {
        "log-decays <= 0 (the pre-activated gate; a positive g grows the state by e^g a token)"
    } else {
        "finite values"
    };
    Err(KdaError::value(arg, expected, format!("{x} at flat index {i}")))
}

fn expect_shape(arg: &str, t: &impl TensorMeta, want: &[usize], what: &str) -> Result<()> {
    if t.shape() != want {
        return Err(KdaError::shape(arg, format!("{} ({what})", fmt_shape(want)), fmt_shape(t.shape())));
    }
    Ok(())
}

/// What validation reads of a tensor: its shape and dtype. Host tensors implement it, and so
/// do device tensors of a backend, whose calls are validated without reading their values.
pub trait TensorMeta {
    /// Row-major dims.
    fn shape(&self) -> &[usize];
    /// Element type.
    fn dtype(&self) -> DType;
}

impl TensorMeta for HostTensor {
    fn shape(&self) -> &[usize] {
        HostTensor::shape(self)
    }
    fn dtype(&self) -> DType {
        HostTensor::dtype(self)
    }
}

/// The tensors of a call, by reference, for the shape and dtype rules of the contract
/// ([`InputsView::validate`]); [`KdaInputs::validate`] adds the value rules.
#[derive(Debug, Clone, Copy)]
pub struct InputsView<'a, T: TensorMeta> {
    /// Queries.
    pub q: &'a T,
    /// Keys.
    pub k: &'a T,
    /// Values.
    pub v: &'a T,
    /// Log-decays (or gate pre-activations).
    pub g: &'a T,
    /// Write strengths.
    pub beta: &'a T,
    /// Initial states.
    pub initial_state: Option<&'a T>,
    /// The gate kind.
    pub gate: GateKind,
    /// `a_log` of an in-kernel gate.
    pub a_log: Option<&'a T>,
    /// `dt_bias` of an in-kernel gate.
    pub dt_bias: Option<&'a T>,
    /// Segment metadata.
    pub segments: Option<&'a Segments>,
    /// Scalar options.
    pub config: &'a KdaConfig,
}

impl<T: TensorMeta> InputsView<'_, T> {
    /// Checks every shape, dtype and option rule of the contract (not the tensors' values) and
    /// returns the validated problem.
    pub fn validate(&self) -> Result<Problem> {
        let layout = self.config.layout;
        let axes = match layout {
            Layout::HeadFirst => "[H, B, T, K]",
            Layout::BatchFirst => "[B, T, H, K]",
        };
        if self.q.shape().len() != 4 {
            return Err(KdaError::shape("q", format!("rank 4 {axes}"), fmt_shape(self.q.shape())));
        }
        let (h, b, t) = layout.try_hbt(self.q.shape()).map_err(|e| e.with_arg("q"))?;
        let k = self.q.shape()[3];
        if self.q.shape().contains(&0) {
            return Err(KdaError::shape("q", "non-empty H, B, T and K", fmt_shape(self.q.shape())));
        }
        if k > MAX_K {
            return Err(KdaError::unsupported("K", format!("K <= {MAX_K}"), format!("K = {k}")));
        }
        let token_k = layout.token_shape(h, b, t, k);
        expect_shape("k", self.k, &token_k, "like q")?;
        expect_shape("g", self.g, &token_k, "like q")?;
        if self.v.shape().len() != 4 {
            return Err(KdaError::shape("v", "rank 4 with q's leading axes", fmt_shape(self.v.shape())));
        }
        let v = self.v.shape()[3];
        if v == 0 {
            return Err(KdaError::shape("v", "non-empty V", fmt_shape(self.v.shape())));
        }
        expect_shape("v", self.v, &layout.token_shape(h, b, t, v), "q's leading axes, width V")?;
        let scalar = layout.scalar_shape(h, b, t);
        let mut scalar1 = scalar.clone();
        scalar1.push(1);
        if self.beta.shape() != scalar.as_slice() && self.beta.shape() != scalar1.as_slice() {
            return Err(KdaError::shape(
                "beta",
                format!("{} or {}", fmt_shape(&scalar), fmt_shape(&scalar1)),
                fmt_shape(self.beta.shape()),
            ));
        }

        let dtype = self.q.dtype();
        for (arg, x) in [("k", self.k), ("v", self.v)] {
            if x.dtype() != dtype {
                return Err(KdaError::dtype(arg, format!("{dtype} like q"), x.dtype().to_string()));
            }
        }

        let scale = match self.config.scale {
            Some(s) if !s.is_finite() => {
                return Err(KdaError::value("scale", "a finite scale", s.to_string()))
            }
            Some(s) => s,
            None => 1.0 / (k as f64).sqrt(),
        };

        let segments = match self.segments {
            Some(s) => s.validate(b, t)?,
            None => SegmentTable::fixed(b, t),
        };
        let n = segments.n();
        let dims = ProblemDims { h, b, t, k, v, n };

        if let Some(h0) = self.initial_state {
            let want = dims.state_shape();
            if h0.shape().len() == 5 && h0.shape()[1] != n && h0.shape()[0] == b {
                return Err(KdaError::shape(
                    "initial_state",
                    format!("N = {n} segment slots ({} from the segments)", fmt_shape(&want)),
                    fmt_shape(h0.shape()),
                ));
            }
            expect_shape("initial_state", h0, &want, "[B, N, H, K, V]")?;
        }

        let has_dt_bias = self.validate_gate(h, k)?;

        Ok(Problem {
            dims,
            layout,
            dtype,
            scale,
            segments,
            has_initial_state: self.initial_state.is_some(),
            gate: self.gate,
            has_dt_bias,
            use_qk_l2norm: self.config.use_qk_l2norm,
            output_final_state: self.config.output_final_state,
            beta_shape: Shape::from_slice(self.beta.shape()),
        })
    }

    fn validate_gate(&self, h: usize, k: usize) -> Result<bool> {
        if let GateKind::LowerBound(lb) = self.gate {
            if !(-5.0..0.0).contains(&lb) {
                return Err(KdaError::value("lb", "a lower bound in [-5, 0)", lb.to_string()));
            }
        }
        if self.gate == GateKind::Preactivated {
            return Ok(false);
        }
        let a_log = self
            .a_log
            .ok_or_else(|| KdaError::missing("a_log", "an in-kernel gate needs a_log of shape [H]"))?;
        expect_shape("a_log", a_log, &[h], "[H]")?;
        if let Some(dt) = self.dt_bias {
            expect_shape("dt_bias", dt, &[h * k], "[H*K]")?;
        }
        Ok(self.dt_bias.is_some())
    }
}

impl<T: TensorMeta> KdaInputs<T> {
    /// The call's tensors by reference, for the shape and dtype rules.
    pub fn view(&self) -> InputsView<'_, T> {
        let (a_log, dt_bias) = self.gate.params().unwrap_or((None, None));
        InputsView {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
            initial_state: self.initial_state.as_ref(),
            gate: self.gate.kind(),
            a_log,
            dt_bias,
            segments: self.segments.as_ref(),
            config: &self.config,
        }
    }
}

impl KdaInputs {
    /// Checks every rule of the contract and returns the validated problem.
    pub fn validate(&self) -> Result<Problem> {
        let problem = self.view().validate()?;
        self.check_values()?;
        Ok(problem)
    }

    /// The value rules alone (finite entries, a pre-activated `g` at most 0, beta in `[0, 1]`);
    /// [`KdaInputs::validate`] runs them after the shape rules. A backend may run them while it
    /// copies the tensors. Each tensor is read once: the sign rule of `g` rides on its
    /// finiteness pass. An in-kernel gate's `g` is a pre-activation of any sign.
    pub fn check_values(&self) -> Result<()> {
        for (arg, x) in [("q", &self.q), ("k", &self.k), ("v", &self.v)] {
            finite(arg, x)?;
        }
        let g_range = match self.gate.kind() {
            GateKind::Preactivated => ValueRange::FiniteAtMostZero,
            GateKind::Softplus | GateKind::LowerBound(_) => ValueRange::Finite,
        };
        within("g", &self.g, g_range)?;
        finite("beta", &self.beta)?;
        for i in 0..self.beta.len() {
            let x = self.beta.get_f64(i);
            if !(0.0..=1.0).contains(&x) {
                return Err(KdaError::value("beta", "values in [0, 1]", format!("{x} at flat index {i}")));
            }
        }
        if let Some(h0) = &self.initial_state {
            finite("initial_state", h0)?;
        }
        if let Some((a_log, dt_bias)) = self.gate.params() {
            for (arg, x) in [("a_log", a_log), ("dt_bias", dt_bias)] {
                if let Some(x) = x {
                    finite(arg, x)?;
                }
            }
        }
        Ok(())
    }
}

/// Checks a cotangent's shapes against a validated problem (not its values).
pub fn validate_cotangent_shapes<T: TensorMeta>(p: &Problem, d_o: &T, dht: Option<&T>) -> Result<()> {
    let d = &p.dims;
    expect_shape("do", d_o, &p.layout.token_shape(d.h, d.b, d.t, d.v), "shaped like o")?;
    if let Some(dht) = dht {
        expect_shape("dht", dht, &d.state_shape(), "[B, N, H, K, V]")?;
    }
    Ok(())
}

impl Cotangents {
    /// Checks the cotangents against a validated problem.
    pub fn validate(&self, p: &Problem) -> Result<()> {
        validate_cotangent_shapes(p, &self.d_o, self.dht.as_ref())?;
        self.check_values()
    }

    /// The value rules alone (finite entries).
    pub fn check_values(&self) -> Result<()> {
        finite("do", &self.d_o)?;
        if let Some(dht) = &self.dht {
            finite("dht", dht)?;
        }
        Ok(())
    }
}
