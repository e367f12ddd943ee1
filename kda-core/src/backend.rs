//! The trait every backend implements (docs/kda.md, Strategies).

use crate::config::BackwardStrategy;
use crate::error::Result;
use crate::io::{Cotangents, KdaGradients, KdaInputs, KdaOutputs};
use crate::problem::Problem;

/// What a forward keeps for its backward. The backward learns the strategy from here, never
/// from a second flag.
pub trait Residuals {
    /// The strategy these residuals were produced for.
    fn strategy(&self) -> BackwardStrategy;
    /// The validated problem of the forward that produced them.
    fn problem(&self) -> &Problem;
}

/// A KDA implementation: forward, backward and (optionally fused) forward+VJP.
pub trait Backend {
    /// The backend's residual record.
    type Residuals: Residuals;

    /// A short name for reports (`ref`, `pjrt-cpu`, ...).
    fn name(&self) -> String;

    /// `Ok` when this backend can run `problem`; otherwise an `Unsupported` error naming the limit.
    fn supports(&self, problem: &Problem) -> Result<()>;

    /// Runs the forward and returns the outputs plus residuals for `strategy`.
    fn forward(
        &self,
        inputs: &KdaInputs,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, Self::Residuals)>;

    /// Runs the backward from the residuals of a forward and the cotangents.
    fn backward(&self, residuals: Self::Residuals, cotangents: &Cotangents) -> Result<KdaGradients>;

    /// Forward plus backward; backends with a fused executable override this.
    fn forward_and_vjp(
        &self,
        inputs: &KdaInputs,
        cotangents: &Cotangents,
        strategy: BackwardStrategy,
    ) -> Result<(KdaOutputs, KdaGradients)> {
        let (outputs, residuals) = self.forward(inputs, strategy)?;
        let grads = self.backward(residuals, cotangents)?;
        Ok((outputs, grads))
    }
}
