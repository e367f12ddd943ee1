//! The tensors that go into and come out of a KDA call.

use crate::config::{GateMode, KdaConfig};
use crate::segments::Segments;
use crate::tensor::HostTensor;

/// Everything the forward needs. Per-token tensors are in `config.layout`.
///
/// ```
/// use kda_core::{HostTensor, KdaConfig, KdaInputs, Layout, Segments};
///
/// // One row of 8 tokens, 2 heads, K = V = 4, batch-first [B, T, H, D], two documents.
/// let x = |d: usize, v: f32| HostTensor::from_f32(&[1, 8, 2, d], vec![v; 8 * 2 * d]);
/// let inputs = KdaInputs::new(x(4, 0.5)?, x(4, 0.5)?, x(4, 1.0)?, x(4, -0.1)?, HostTensor::from_f32(&[1, 8, 2], vec![0.9; 16])?)
///     .with_config(KdaConfig { layout: Layout::BatchFirst, output_final_state: true, ..Default::default() })
///     .with_segments(Segments::CuSeqlens(vec![vec![0, 5, 8]]));
/// let problem = inputs.validate()?;
/// assert_eq!((problem.dims.h, problem.dims.t, problem.dims.n), (2, 8, 2));
///
/// // A violation is a typed error naming the argument.
/// let bad = KdaInputs { beta: HostTensor::from_f32(&[1, 7, 2], vec![0.9; 14])?, ..inputs };
/// assert!(bad.validate().unwrap_err().to_string().contains("beta"));
/// # Ok::<(), kda_core::KdaError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct KdaInputs {
    /// Queries `[H,B,T,K]` / `[B,T,H,K]`.
    pub q: HostTensor,
    /// Keys, shaped like `q`.
    pub k: HostTensor,
    /// Values `[H,B,T,V]` / `[B,T,H,V]`.
    pub v: HostTensor,
    /// Log-decay (pre-activated) or the raw gate input (in-kernel gates), shaped like `q`.
    pub g: HostTensor,
    /// Write strength in `[0, 1]`: `[H,B,T]` / `[B,T,H]`, optionally with a trailing 1.
    pub beta: HostTensor,
    /// Initial state `[B,N,H,K,V]`; zeros when absent.
    pub initial_state: Option<HostTensor>,
    /// How `g` becomes the log-decay.
    pub gate: GateMode,
    /// Packed segments; `None` means fixed length (N = 1).
    pub segments: Option<Segments>,
    /// Scalar options.
    pub config: KdaConfig,
}

impl KdaInputs {
    /// Fixed-length inputs with default options (batch-first layout, pre-activated gate).
    pub fn new(q: HostTensor, k: HostTensor, v: HostTensor, g: HostTensor, beta: HostTensor) -> Self {
        Self {
            q,
            k,
            v,
            g,
            beta,
            initial_state: None,
            gate: GateMode::Preactivated,
            segments: None,
            config: KdaConfig::default(),
        }
    }
    /// Sets the layout of the per-token tensors.
    pub fn with_layout(mut self, layout: crate::Layout) -> Self {
        self.config.layout = layout;
        self
    }
    /// Sets the initial state.
    pub fn with_initial_state(mut self, h0: HostTensor) -> Self {
        self.initial_state = Some(h0);
        self
    }
    /// Sets the gate mode.
    pub fn with_gate(mut self, gate: GateMode) -> Self {
        self.gate = gate;
        self
    }
    /// Sets packed segments.
    pub fn with_segments(mut self, segments: Segments) -> Self {
        self.segments = Some(segments);
        self
    }
    /// Replaces all scalar options, the layout included: set the layout in `config` (or call
    /// [`KdaInputs::with_layout`] afterwards), as an earlier `with_layout` is overwritten.
    pub fn with_config(mut self, config: KdaConfig) -> Self {
        self.config = config;
        self
    }
}

/// The cotangents of the loss `sum(o * do) + sum(final_state * dht)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Cotangents {
    /// `do`, shaped like `o`.
    pub d_o: HostTensor,
    /// `dht` `[B,N,H,K,V]`; zeros when absent.
    pub dht: Option<HostTensor>,
}

/// What the forward returns.
#[derive(Debug, Clone, PartialEq)]
pub struct KdaOutputs {
    /// Output, shaped like `v`, in q's dtype.
    pub o: HostTensor,
    /// Final states `[B,N,H,K,V]` in f32 (f64 for f64 inputs), when requested.
    pub final_state: Option<HostTensor>,
}

/// What the backward returns; each gradient has its input's shape and dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct KdaGradients {
    /// dL/dq.
    pub dq: HostTensor,
    /// dL/dk.
    pub dk: HostTensor,
    /// dL/dv.
    pub dv: HostTensor,
    /// dL/dg, with respect to the gate *input*.
    pub dg: HostTensor,
    /// dL/dbeta, shaped like `beta`.
    pub dbeta: HostTensor,
    /// dL/dh0 in the state dtype (f32, or f64 for f64 inputs), when an initial state was given.
    pub dh0: Option<HostTensor>,
    /// dL/da_log, for in-kernel gates.
    pub da_log: Option<HostTensor>,
    /// dL/ddt_bias, for in-kernel gates given a `dt_bias`.
    pub ddt_bias: Option<HostTensor>,
}

impl KdaGradients {
    /// The gradients by name, in a fixed order (for reports and files).
    pub fn named(&self) -> Vec<(&'static str, &HostTensor)> {
        let mut out = vec![
            ("dq", &self.dq),
            ("dk", &self.dk),
            ("dv", &self.dv),
            ("dg", &self.dg),
            ("dbeta", &self.dbeta),
        ];
        if let Some(t) = &self.dh0 {
            out.push(("dh0", t));
        }
        if let Some(t) = &self.da_log {
            out.push(("da_log", t));
        }
        if let Some(t) = &self.ddt_bias {
            out.push(("ddt_bias", t));
        }
        out
    }
}
