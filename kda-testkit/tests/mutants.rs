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

/// Slot 0 of each row of a `[B, N, H, K, V]` state: `[B, 1, H, K, V]`.
fn first_slot(t: &HostTensor) -> Result<HostTensor> {
    let s = t.shape();
    let (b, n, rest) = (s[0], s[1], s[2..].iter().product::<usize>());
    let x = t.to_f64_vec();
    let y: Vec<f64> = (0..b).flat_map(|r| x[r * n * rest..r * n * rest + rest].to_vec()).collect();
    HostTensor::from_f64_as(&[b, 1, s[2], s[3], s[4]], &y, t.dtype())
}

/// `[B, 1, H, K, V]` repeated into `n` slots per row.
fn every_slot(t: &HostTensor, n: usize) -> Result<HostTensor> {
    let s = t.shape();
    let rest = s[2..].iter().product::<usize>();
    let x = t.to_f64_vec();
    let y: Vec<f64> = (0..s[0]).flat_map(|r| x[r * rest..(r + 1) * rest].repeat(n)).collect();
    HostTensor::from_f64_as(&[s[0], n, s[2], s[3], s[4]], &y, t.dtype())
}

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
            // Each row as one sequence from its first slot's state; the states keep their
            // [B, N, H, K, V] shape (every slot gets the row's one final state), so only the
            // numbers can give the bug away.
            x.segments = None;
            x.initial_state = x.initial_state.as_ref().map(first_slot).transpose()?;
        }
        let (mut out, res) = RefBackend.forward(&x, s)?;
        if let (Bug::NoSegmentReset, Some(h0)) = (self.0, &inputs.initial_state) {
            out.final_state = out.final_state.map(|h| every_slot(&h, h0.shape()[1])).transpose()?;
        }
        match self.0 {
            Bug::OutputDtype => out.o = out.o.cast(DType::F32).expect("float cast"),
            Bug::OutputSlightlyOff => out.o = scaled(&out.o, 1.0 + 1e-4),
            _ => {}
        }
        Ok((out, res))
    }
    fn backward(&self, res: RefResiduals, cot: &Cotangents) -> Result<KdaGradients> {
        let mut cot = cot.clone();
        let mut slots = None;
        if let Bug::NoSegmentReset = self.0 {
            slots = cot.dht.as_ref().map(|t| t.shape()[1]);
            cot.dht = cot.dht.as_ref().map(first_slot).transpose()?;
        }
        let mut g = RefBackend.backward(res, &cot)?;
        if let Some(n) = slots {
            g.dh0 = g.dh0.map(|h| every_slot(&h, n)).transpose()?;
        }
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

/// Each mutant must fail for its own reason: a failed numeric check of the quantity it breaks
/// (a `FAIL` line of the report naming the case and that quantity) or, for the dtype mutant, the
/// dtype contract.
#[rstest]
#[case::gate_gradient_scaled(Bug::GateGradientScaled, "fixed_small", DType::F32, "FAIL", "dg")]
#[case::no_segment_reset(Bug::NoSegmentReset, "packed_lengths_1_63_64_65_0", DType::F32, "FAIL", "o")]
#[case::padding_gradient_not_zero(
    Bug::PaddingGradientNotZero,
    "packed_lengths_1_63_64_65_0",
    DType::F32,
    "FAIL",
    "dq"
)]
#[case::output_dtype(Bug::OutputDtype, "fixed_small", DType::BF16, "o has dtype f32", "o")]
#[case::output_slightly_off_in_f32(Bug::OutputSlightlyOff, "fixed_small", DType::F32, "FAIL", "o")]
fn suite_rejects_mutant(
    #[case] bug: Bug,
    #[case] case: &str,
    #[case] dtype: DType,
    #[case] why: &str,
    #[case] quantity: &str,
) {
    let m = Mutant(bug);
    let r = conformance::backward(&m, case, dtype, BackwardStrategy::SavedState, Path::Split);
    let msg = r.expect_err("the suite must fail this backend");
    assert!(msg.contains(why), "failure must be `{why}`: {msg}");
    if why == "FAIL" {
        let own = msg
            .lines()
            .filter(|l| l.starts_with("FAIL"))
            .any(|l| l.contains(case) && l.contains(&format!(": {quantity} rms_ratio")));
        assert!(own, "a FAIL line must name the case and {quantity}: {msg}");
    }
}

/// Without segment resets the mutant's `o` is wrong from the second segment on, while its
/// shapes are all right: the forward check alone must see it.
#[test]
fn forward_check_sees_ignored_segment_boundaries() {
    let r = conformance::forward(&Mutant(Bug::NoSegmentReset), "packed_lengths_1_63_64_65_0", DType::F32);
    let msg = r.expect_err("the suite must fail this backend");
    assert!(msg.contains("FAIL") && msg.contains(": o rms_ratio"), "o must fail: {msg}");
}

#[test]
fn bf16_tolerance_accepts_a_small_output_error() {
    let m = Mutant(Bug::OutputSlightlyOff);
    conformance::forward(&m, "fixed_small", DType::BF16).unwrap();
}
