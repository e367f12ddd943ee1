//! [`PjrtResiduals`]: what a forward keeps on the devices for its backward, in one of three
//! forms: one device's, one shard per device (data parallel), one piece per device (context
//! parallel).

use std::sync::Arc;

use kda_core::{BackwardStrategy, DType, HostTensor, KdaGradients, KdaInputs, Problem, Residuals, Result};

use super::launch::Named;
use super::tensor::DeviceTensor;
use crate::op::ProgramSpec;
use kda_packed::{PiecePlan, RowPlan};

/// A context-parallel call's split, kept with a forward's residuals: every row's pieces, each
/// device's local problem (its own segment table; the same dims everywhere) and the local
/// programs' spec.
#[derive(Debug)]
pub(crate) struct ContextPlan {
    pub(crate) pieces: PiecePlan,
    pub(crate) locals: Vec<Problem>,
    pub(crate) spec: ProgramSpec,
}

impl ContextPlan {
    pub(crate) fn devices(&self) -> usize {
        self.locals.len()
    }
}

/// What a forward keeps on the devices for its backward: its inputs (shared with the caller,
/// not copied) and, for the saved-state strategy, the state entering every chunk; for a call
/// over several devices, each device's part, where it ran. `Send`: a backward may run on
/// another thread than its forward; backward borrows them, so one forward serves several.
#[derive(Debug, Clone)]
pub struct PjrtResiduals {
    /// The caller's problem (the whole batch).
    pub(crate) problem: Problem,
    pub(crate) strategy: BackwardStrategy,
    /// The spec of every device's programs.
    pub(crate) spec: ProgramSpec,
    /// The host dtypes of g, beta, a_log and dt_bias, for gradients downloaded by a host call.
    pub(crate) host_types: Option<Gradtypes>,
    pub(crate) held: Held,
}

/// Where the residuals live.
#[derive(Debug, Clone)]
pub(crate) enum Held {
    /// One device's program.
    One(Piece),
    /// Whole rows per device.
    Rows { plan: RowPlan, shards: Vec<Piece> },
    /// One piece of every row per device.
    Pieces { plan: Arc<ContextPlan>, shards: Vec<Piece> },
}

/// One device's residuals: its problem and the arguments its backward reads, by name.
#[derive(Debug, Clone)]
pub(crate) struct Piece {
    pub(crate) problem: Problem,
    pub(crate) device: usize,
    pub(crate) kept: Named,
}

impl Residuals for PjrtResiduals {
    fn strategy(&self) -> BackwardStrategy {
        self.strategy
    }
    fn problem(&self) -> &Problem {
        &self.problem
    }
}

impl PjrtResiduals {
    /// Bytes held on the devices by these residuals (inputs shared with the caller included).
    pub fn device_bytes(&self) -> usize {
        self.pieces().iter().flat_map(|p| p.kept.iter()).map(|(_, t)| DeviceTensor::size_bytes(t)).sum()
    }

    pub(crate) fn pieces(&self) -> &[Piece] {
        match &self.held {
            Held::One(p) => std::slice::from_ref(p),
            Held::Rows { shards, .. } | Held::Pieces { shards, .. } => shards,
        }
    }
}

/// The host dtypes gradients come back in (their inputs').
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gradtypes {
    g: DType,
    beta: DType,
    /// `a_log`'s dtype.
    gate: DType,
    /// `dt_bias`'s dtype.
    dt_bias: DType,
}

impl Gradtypes {
    pub(crate) fn of(x: &KdaInputs) -> Self {
        let gate = x.gate.params().and_then(|(a, _)| a).map_or(DType::F32, |t| t.dtype());
        let dt_bias = x.gate.params().and_then(|(_, d)| d).map_or(DType::F32, |t| t.dtype());
        Gradtypes { g: x.g.dtype(), beta: x.beta.dtype(), gate, dt_bias }
    }

    /// Downloads each device's gradients and casts them to their inputs' dtypes.
    pub(crate) fn download(
        b: &super::handle::PjrtBackend,
        types: Option<Self>,
        grads: &[super::io::DeviceGradients],
    ) -> Result<Vec<KdaGradients>> {
        b.to_host(&grads.to_vec())?.into_iter().map(|g| Gradtypes::apply(types, g)).collect()
    }

    /// Casts downloaded gradients to their inputs' dtypes.
    pub(crate) fn apply(types: Option<Self>, mut grads: KdaGradients) -> Result<KdaGradients> {
        let Some(x) = types else { return Ok(grads) };
        let cast = |t: &mut HostTensor, to: DType| -> Result<()> {
            *t = t.cast(to)?;
            Ok(())
        };
        cast(&mut grads.dg, x.g)?;
        cast(&mut grads.dbeta, x.beta)?;
        if let Some(t) = &mut grads.da_log {
            cast(t, x.gate)?;
        }
        if let Some(t) = &mut grads.ddt_bias {
            cast(t, x.dt_bias)?;
        }
        Ok(grads)
    }
}
