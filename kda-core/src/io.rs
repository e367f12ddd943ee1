//! The tensors that go into and come out of a KDA call, over any tensor type: host tensors by
//! default, a backend's device tensors (or anything else) through the same structs.

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
pub struct KdaInputs<T = HostTensor> {
    /// Queries `[H,B,T,K]` / `[B,T,H,K]`.
    pub q: T,
    /// Keys, shaped like `q`.
    pub k: T,
    /// Values `[H,B,T,V]` / `[B,T,H,V]`.
    pub v: T,
    /// Log-decay (pre-activated) or the raw gate input (in-kernel gates), shaped like `q`.
    pub g: T,
    /// Write strength in `[0, 1]`: `[H,B,T]` / `[B,T,H]`, optionally with a trailing 1.
    pub beta: T,
    /// Initial state `[B,N,H,K,V]`; zeros when absent.
    pub initial_state: Option<T>,
    /// How `g` becomes the log-decay.
    pub gate: GateMode<T>,
    /// Packed segments; `None` means fixed length (N = 1).
    pub segments: Option<Segments>,
    /// Scalar options.
    pub config: KdaConfig,
}

impl<T> KdaInputs<T> {
    /// Fixed-length inputs with default options (batch-first layout, pre-activated gate).
    pub fn new(q: T, k: T, v: T, g: T, beta: T) -> Self {
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
    pub fn with_initial_state(mut self, h0: T) -> Self {
        self.initial_state = Some(h0);
        self
    }
    /// Sets the gate mode.
    pub fn with_gate(mut self, gate: GateMode<T>) -> Self {
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
pub struct Cotangents<T = HostTensor> {
    /// `do`, shaped like `o`.
    pub d_o: T,
    /// `dht` `[B,N,H,K,V]`; zeros when absent.
    pub dht: Option<T>,
}

/// What the forward returns.
#[derive(Debug, Clone, PartialEq)]
pub struct KdaOutputs<T = HostTensor> {
    /// Output, shaped like `v`, in q's dtype.
    pub o: T,
    /// Final states `[B,N,H,K,V]` in f32 (f64 for f64 inputs), when requested.
    pub final_state: Option<T>,
}

/// What the backward returns; each gradient has its input's shape and dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct KdaGradients<T = HostTensor> {
    /// dL/dq.
    pub dq: T,
    /// dL/dk.
    pub dk: T,
    /// dL/dv.
    pub dv: T,
    /// dL/dg, with respect to the gate *input*.
    pub dg: T,
    /// dL/dbeta, shaped like `beta`.
    pub dbeta: T,
    /// dL/dh0 in the state dtype (f32, or f64 for f64 inputs), when an initial state was given.
    pub dh0: Option<T>,
    /// dL/da_log, for in-kernel gates.
    pub da_log: Option<T>,
    /// dL/ddt_bias, for in-kernel gates given a `dt_bias`.
    pub ddt_bias: Option<T>,
}

impl<T> KdaGradients<T> {
    /// The gradients by name, in a fixed order (for reports and files).
    pub fn named(&self) -> Vec<(&'static str, &T)> {
        Tensors::named(self)
    }
}

/// A record of tensors (inputs, cotangents, outputs, gradients, a lone tensor, a list of
/// records): its tensors by name in a fixed order, and the same record over another tensor
/// type. Backends move records between host and device with it, whatever the record.
pub trait Tensors<T> {
    /// The same record holding `U`s.
    type Of<U>;
    /// `(name, tensor)` for every tensor present, in the order [`Tensors::try_map`] visits them.
    fn named(&self) -> Vec<(&'static str, &T)>;
    /// The record with every tensor replaced by `f(name, tensor)`, visited in `named` order.
    fn try_map<U, E>(&self, f: &mut dyn FnMut(&'static str, &T) -> Result<U, E>) -> Result<Self::Of<U>, E>;
}

fn opt<T, U, E>(
    name: &'static str,
    t: &Option<T>,
    f: &mut dyn FnMut(&'static str, &T) -> Result<U, E>,
) -> Result<Option<U>, E> {
    t.as_ref().map(|t| f(name, t)).transpose()
}

impl Tensors<HostTensor> for HostTensor {
    type Of<U> = U;
    fn named(&self) -> Vec<(&'static str, &HostTensor)> {
        vec![("tensor", self)]
    }
    fn try_map<U, E>(&self, f: &mut dyn FnMut(&'static str, &HostTensor) -> Result<U, E>) -> Result<U, E> {
        f("tensor", self)
    }
}

impl<T, S: Tensors<T>> Tensors<T> for Vec<S> {
    type Of<U> = Vec<S::Of<U>>;
    fn named(&self) -> Vec<(&'static str, &T)> {
        self.iter().flat_map(Tensors::named).collect()
    }
    fn try_map<U, E>(&self, f: &mut dyn FnMut(&'static str, &T) -> Result<U, E>) -> Result<Vec<S::Of<U>>, E> {
        self.iter().map(|s| s.try_map(f)).collect()
    }
}

impl<T> Tensors<T> for KdaInputs<T> {
    type Of<U> = KdaInputs<U>;
    fn named(&self) -> Vec<(&'static str, &T)> {
        let mut v =
            vec![("q", &self.q), ("k", &self.k), ("v", &self.v), ("g", &self.g), ("beta", &self.beta)];
        v.extend(self.initial_state.as_ref().map(|t| ("initial_state", t)));
        if let Some((a_log, dt_bias)) = self.gate.params() {
            v.extend(a_log.map(|t| ("a_log", t)));
            v.extend(dt_bias.map(|t| ("dt_bias", t)));
        }
        v
    }
    fn try_map<U, E>(&self, f: &mut dyn FnMut(&'static str, &T) -> Result<U, E>) -> Result<KdaInputs<U>, E> {
        Ok(KdaInputs {
            q: f("q", &self.q)?,
            k: f("k", &self.k)?,
            v: f("v", &self.v)?,
            g: f("g", &self.g)?,
            beta: f("beta", &self.beta)?,
            initial_state: opt("initial_state", &self.initial_state, f)?,
            gate: match &self.gate {
                GateMode::Preactivated => GateMode::Preactivated,
                GateMode::Softplus { a_log, dt_bias } => GateMode::Softplus {
                    a_log: opt("a_log", a_log, f)?,
                    dt_bias: opt("dt_bias", dt_bias, f)?,
                },
                GateMode::LowerBound { lb, a_log, dt_bias } => GateMode::LowerBound {
                    lb: *lb,
                    a_log: opt("a_log", a_log, f)?,
                    dt_bias: opt("dt_bias", dt_bias, f)?,
                },
            },
            segments: self.segments.clone(),
            config: self.config,
        })
    }
}

impl<T> Tensors<T> for Cotangents<T> {
    type Of<U> = Cotangents<U>;
    fn named(&self) -> Vec<(&'static str, &T)> {
        let mut v = vec![("do", &self.d_o)];
        v.extend(self.dht.as_ref().map(|t| ("dht", t)));
        v
    }
    fn try_map<U, E>(&self, f: &mut dyn FnMut(&'static str, &T) -> Result<U, E>) -> Result<Cotangents<U>, E> {
        Ok(Cotangents { d_o: f("do", &self.d_o)?, dht: opt("dht", &self.dht, f)? })
    }
}

impl<T> Tensors<T> for KdaOutputs<T> {
    type Of<U> = KdaOutputs<U>;
    fn named(&self) -> Vec<(&'static str, &T)> {
        let mut v = vec![("o", &self.o)];
        v.extend(self.final_state.as_ref().map(|t| ("final_state", t)));
        v
    }
    fn try_map<U, E>(&self, f: &mut dyn FnMut(&'static str, &T) -> Result<U, E>) -> Result<KdaOutputs<U>, E> {
        Ok(KdaOutputs { o: f("o", &self.o)?, final_state: opt("final_state", &self.final_state, f)? })
    }
}

impl<T> Tensors<T> for KdaGradients<T> {
    type Of<U> = KdaGradients<U>;
    fn named(&self) -> Vec<(&'static str, &T)> {
        let mut out = vec![
            ("dq", &self.dq),
            ("dk", &self.dk),
            ("dv", &self.dv),
            ("dg", &self.dg),
            ("dbeta", &self.dbeta),
        ];
        out.extend(self.dh0.as_ref().map(|t| ("dh0", t)));
        out.extend(self.da_log.as_ref().map(|t| ("da_log", t)));
        out.extend(self.ddt_bias.as_ref().map(|t| ("ddt_bias", t)));
        out
    }
    fn try_map<U, E>(
        &self,
        f: &mut dyn FnMut(&'static str, &T) -> Result<U, E>,
    ) -> Result<KdaGradients<U>, E> {
        Ok(KdaGradients {
            dq: f("dq", &self.dq)?,
            dk: f("dk", &self.dk)?,
            dv: f("dv", &self.dv)?,
            dg: f("dg", &self.dg)?,
            dbeta: f("dbeta", &self.dbeta)?,
            dh0: opt("dh0", &self.dh0, f)?,
            da_log: opt("da_log", &self.da_log, f)?,
            ddt_bias: opt("ddt_bias", &self.ddt_bias, f)?,
        })
    }
}
