//! The suite catches wrong backends: each mutant wraps the reference and breaks one thing.

use kda_core::{
    Backend, BackwardStrategy, Cotangents, DType, HostTensor, KdaGradients, KdaInputs, KdaOutputs, Problem,
    Result,
};
use kda_ref::{RefBackend, RefResiduals};
use kda_testkit::conformance::{self, Path};
use rstest::rstest;

#[derive(Debug, Clone, Copy)]
enum Bug {
    /// dg off by 1%.
    GateGradientScaled,
    /// Ignores segment boundaries (runs packed rows as one sequence).
    NoSegmentReset,
    /// Writes a tiny value into dq at padding tokens.
    PaddingGradientNotZero,
    /// Returns o in f32 for bf16 inputs.
    OutputDtype,
    /// o off by 1e-4 relative (fine for bf16, not for f32).
    OutputSlightlyOff,
}

struct Mutant(Bug);

fn scaled(t: &HostTensor, f: f64) -> HostTensor {
    let x: Vec<f64> = t.to_f64_vec().iter().map(|a| a * f).collect();
    HostTensor::from_f64_as(t.shape(), &x, t.dtype()).unwrap()
}

impl Backend for Mutant {
    type Residuals = RefResiduals;
    fn name(&self) -> String {
        format!("mutant-{:?}", self.0)
    }
    fn supports(&self, p: &Problem) -> Result<()> {
        RefBackend.supports(p)
    }
    fn forward(&self, inputs: &KdaInputs, s: BackwardStrategy) -> Result<(KdaOutputs, RefResiduals)> {
        let mut x = inputs.clone();
        if let Bug::NoSegmentReset = self.0 {
            x.segments = None;
            x.initial_state = None;
        }
        let (mut out, res) = RefBackend.forward(&x, s)?;
        match self.0 {
            Bug::OutputDtype => out.o = out.o.cast(DType::F32),
            Bug::OutputSlightlyOff => out.o = scaled(&out.o, 1.0 + 1e-4),
            _ => {}
        }
        Ok((out, res))
    }
    fn backward(&self, res: RefResiduals, cot: &Cotangents) -> Result<KdaGradients> {
        let mut g = RefBackend.backward(res, cot)?;
        match self.0 {
            Bug::GateGradientScaled => g.dg = scaled(&g.dg, 1.01),
            Bug::PaddingGradientNotZero => {
                let mut x = g.dq.to_f64_vec();
                if let Some(last) = x.last_mut() {
                    *last = 1e-30;
                }
                g.dq = HostTensor::from_f64_as(g.dq.shape(), &x, g.dq.dtype())?;
            }
            _ => {}
        }
        Ok(g)
    }
}

#[rstest]
#[case::gate_gradient_scaled(Bug::GateGradientScaled, "fixed_small", DType::F32)]
#[case::no_segment_reset(Bug::NoSegmentReset, "packed_lengths_1_63_64_65_0", DType::F32)]
#[case::padding_gradient_not_zero(Bug::PaddingGradientNotZero, "packed_lengths_1_63_64_65_0", DType::F32)]
#[case::output_dtype(Bug::OutputDtype, "fixed_small", DType::BF16)]
#[case::output_slightly_off_in_f32(Bug::OutputSlightlyOff, "fixed_small", DType::F32)]
fn suite_rejects_mutant(#[case] bug: Bug, #[case] case: &str, #[case] dtype: DType) {
    let m = Mutant(bug);
    let r = conformance::backward(&m, case, dtype, BackwardStrategy::SavedState, Path::Split);
    let msg = r.expect_err("the suite must fail this backend");
    assert!(msg.contains(case) || msg.contains("dtype"), "failure must name the case: {msg}");
}

#[test]
fn bf16_tolerance_accepts_a_small_output_error() {
    let m = Mutant(Bug::OutputSlightlyOff);
    conformance::forward(&m, "fixed_small", DType::BF16).unwrap();
}
