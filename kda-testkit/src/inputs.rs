//! Seeded inputs for a [`Case`]: the same name and dtype always give the same tensors.

use crate::cases::{Case, CaseGate, CaseSegments, Profile};
use crate::rng::Rng;
use kda_core::{
    Cotangents, DType, GateMode, HostTensor, KdaConfig, KdaInputs, Layout, Result, Segments, Tensors,
};

/// Inputs and cotangents of one case.
#[derive(Debug, Clone)]
pub struct CaseData {
    /// Forward inputs, in the case's dtype.
    pub inputs: KdaInputs,
    /// Cotangents (`do`, and `dht` when the case has states).
    pub cotangents: Cotangents,
}

fn normalise_rows(x: &mut [f64], d: usize) {
    for row in x.chunks_mut(d) {
        let n = row.iter().map(|a| a * a).sum::<f64>().sqrt().max(1e-12);
        row.iter_mut().for_each(|a| *a /= n);
    }
}

fn segments(case: &Case) -> Option<Segments> {
    let cu = |rows: &Vec<Vec<usize>>| -> Vec<Vec<i64>> {
        rows.iter()
            .map(|r| {
                let mut c = vec![0i64];
                for l in r {
                    c.push(c[c.len() - 1] + *l as i64);
                }
                c
            })
            .collect()
    };
    match &case.segments {
        CaseSegments::Fixed => None,
        CaseSegments::Lengths(rows) => Some(Segments::CuSeqlens(cu(rows))),
        CaseSegments::SegmentIds(rows) => Some(Segments::SegmentIds(
            rows.iter()
                .map(|r| {
                    let mut ids = vec![0i64; case.t];
                    let mut pos = 0;
                    for (i, l) in r.iter().enumerate() {
                        ids[pos..pos + l].fill(i as i64 + 1);
                        pos += l;
                    }
                    ids
                })
                .collect(),
        )),
    }
}

/// Segment slots per row of a case.
pub fn slots(case: &Case) -> usize {
    match &case.segments {
        CaseSegments::Fixed => 1,
        CaseSegments::Lengths(rows) | CaseSegments::SegmentIds(rows) => {
            rows.iter().map(|r| r.len()).max().unwrap_or(1)
        }
    }
}

/// Draws the inputs of `case` in `dtype` (the reference then runs on these rounded values).
pub fn case_data(case: &Case, dtype: DType) -> Result<CaseData> {
    let mut r = Rng::from_name(case.name);
    let (h, b, t, k, v) = (case.h, case.b, case.t, case.k, case.v);
    let n = h * b * t;
    let lay = case.layout;
    let tk = lay.token_shape(h, b, t, k);
    let tv = lay.token_shape(h, b, t, v);
    let mut ts = lay.scalar_shape(h, b, t).to_vec();
    if case.beta_trailing_one {
        ts.push(1);
    }
    let mut q = r.normal_vec(n * k);
    let mut kk = r.normal_vec(n * k);
    if !case.l2norm {
        // Well-conditioned inputs (docs/kda.md, Accuracy): q and k arrive L2-normalised.
        normalise_rows(&mut q, k);
        normalise_rows(&mut kk, k);
    }
    let vv = r.normal_vec(n * v);
    let mut g = match (case.gate, case.profile) {
        // For the softplus gate these are the target log-decays; the raw inputs that give them
        // are solved for below, once a_log and dt_bias are drawn.
        (CaseGate::Preactivated | CaseGate::Softplus, Profile::StrongDecay) => {
            r.uniform_vec(n * k, -5.0, -4.5)
        }
        (CaseGate::Preactivated, Profile::LongMemory) => r.uniform_vec(n * k, -0.02, 0.0),
        (CaseGate::Preactivated, Profile::NoDecay) => vec![0.0; n * k],
        (CaseGate::Preactivated, _) => r.uniform_vec(n * k, -5.0, 0.0),
        (_, Profile::LongMemory) => r.uniform_vec(n * k, -8.0, -6.0),
        // Raw gate inputs; the activation maps them into (lb, 0) or (-inf, 0).
        (_, Profile::StrongDecay) => r.uniform_vec(n * k, 3.0, 4.0),
        (_, _) => r.uniform_vec(n * k, -3.0, 3.0),
    };
    if case.profile == Profile::HardReset {
        // Every 37th token (in storage order) forgets everything.
        for tok in (5..n).step_by(37) {
            g[tok * k..(tok + 1) * k].fill(-1000.0);
        }
    }
    let mut beta = r.uniform_vec(n, 0.0, 1.0);
    if case.profile == Profile::BetaEdges {
        for (i, x) in beta.iter_mut().enumerate() {
            match i % 5 {
                0 => *x = 0.0,
                1 => *x = 1.0,
                _ => {}
            }
        }
    }
    let gate = match case.gate {
        CaseGate::Preactivated => GateMode::Preactivated,
        CaseGate::Softplus => {
            let (a_log, dt_bias) = (r.uniform_vec(h, -1.0, 0.5), r.uniform_vec(h * k, -0.5, 0.5));
            if case.profile == Profile::StrongDecay {
                // g = -exp(a_log[h]) softplus(x + dt_bias[h, k]) near -5, as the profile says:
                // x = softplus^-1(-g / exp(a_log)) - dt_bias, with softplus^-1(y) = y + ln(1 - e^-y).
                for (i, x) in g.iter_mut().enumerate() {
                    let (token, ch) = (i / k, i % k);
                    let head = match lay {
                        Layout::HeadFirst => token / (b * t),
                        Layout::BatchFirst => token % h,
                    };
                    let y = -*x / a_log[head].exp();
                    *x = y + (-(-y).exp_m1()).ln() - dt_bias[head * k + ch];
                }
            }
            GateMode::softplus(
                HostTensor::from_f64_as(&[h], &a_log, DType::F32)?,
                Some(HostTensor::from_f64_as(&[h * k], &dt_bias, DType::F32)?),
            )
        }
        CaseGate::LowerBound(lb) => GateMode::lower_bound(
            lb,
            HostTensor::from_f64_as(&[h], &r.uniform_vec(h, -1.0, 0.5), DType::F32)?,
            Some(HostTensor::from_f64_as(&[h * k], &r.uniform_vec(h * k, -0.5, 0.5), DType::F32)?),
        ),
    };
    let slots = slots(case);
    let state = [b, slots, h, k, v];
    let state_len = b * slots * h * k * v;
    let mut inputs = KdaInputs::new(
        HostTensor::from_f64_as(&tk, &q, dtype)?,
        HostTensor::from_f64_as(&tk, &kk, dtype)?,
        HostTensor::from_f64_as(&tv, &vv, dtype)?,
        HostTensor::from_f64_as(&tk, &g, dtype)?,
        HostTensor::from_f64_as(&ts, &beta, dtype)?,
    )
    .with_gate(gate)
    .with_config(KdaConfig {
        layout: lay,
        scale: None,
        use_qk_l2norm: case.l2norm,
        output_final_state: case.final_state,
    });
    if case.initial_state {
        let h0 = r.normal_vec(state_len).iter().map(|x| 0.5 * x).collect::<Vec<_>>();
        inputs = inputs.with_initial_state(HostTensor::from_f64_as(&state, &h0, DType::F32)?);
    }
    if let Some(s) = segments(case) {
        inputs = inputs.with_segments(s);
    }
    let d_o = HostTensor::from_f64_as(&tv, &r.normal_vec(n * v), dtype)?;
    let dht = if case.final_state {
        Some(HostTensor::from_f64_as(&state, &r.normal_vec(state_len), DType::F32)?)
    } else {
        None
    };
    Ok(CaseData { inputs, cotangents: Cotangents { d_o, dht } })
}

/// The same inputs widened to f64, for the reference.
pub fn widen(data: &CaseData) -> Result<CaseData> {
    let mut w = |_: &'static str, t: &HostTensor| t.cast(DType::F64);
    Ok(CaseData { inputs: data.inputs.try_map(&mut w)?, cotangents: data.cotangents.try_map(&mut w)? })
}
