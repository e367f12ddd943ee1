//! Bitwise causality (docs/kda.md, Guarantees): a backend's outputs before a token `t0` do not
//! change, not by one bit, when every input from `t0` on changes, and neither do the gradients
//! before `t0` (with `do` zero from `t0` on, no `dht`) nor `dh0`; the gradients from `t0` on do
//! not change when `do` before `t0` changes.
//!
//! Every `t0` of [`starts`] is checked in one batch: row `r` of the batch carries its own
//! `t0 = starts()[r]`, so one perturbed run against one unperturbed run checks all of them.

use crate::conformance::Path;
use crate::rng::Rng;
use kda_core::{
    Backend, BackwardStrategy, Cotangents, DType, HostTensor, KdaConfig, KdaGradients, KdaInputs, Layout,
    ProblemDims, Segments,
};

/// Tokens per row: four chunks.
pub const TOKENS: usize = 256;
/// Heads.
pub const HEADS: usize = 1;
/// Key and value widths.
pub const WIDTH: usize = 16;
/// The segment lengths of every packed row: boundaries at 37, 99 and 152 (inside 4-token
/// blocks), then four tokens of padding.
pub const PACKED_LENGTHS: [usize; 4] = [37, 62, 53, 100];
/// Tokens given a hard reset (`g = -1000`) in the unperturbed inputs: three in a row inside the
/// 4-token block 40..44, and one more.
pub const HARD_RESETS: [usize; 4] = [41, 42, 43, 150];

/// The `t0` of each batch row: every token of the first two chunks, then 129, 189 and 253.
pub fn starts() -> Vec<usize> {
    (0..128).chain([129, 189, 253]).collect()
}

/// The rows to check: fixed length, or packed by [`PACKED_LENGTHS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Fixed-length rows, one segment each.
    Fixed,
    /// Packed rows of four segments and trailing padding.
    Packed,
    /// The packed rows without initial states (the kernels read these as whole blocks, the
    /// boundaries inside chunks as masks).
    PackedNoStates,
}

/// One configuration: rows, dtype, strategy and path.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// Fixed or packed rows.
    pub rows: Rows,
    /// Dtype of q, k, v, g, beta and do.
    pub dtype: DType,
    /// The backward strategy.
    pub strategy: BackwardStrategy,
    /// Forward then backward, or the fused call.
    pub path: Path,
}

/// Per-token tensors of one draw, f64, head-first `[H, B, T, D]`.
struct Draw {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    beta: Vec<f64>,
    d_o: Vec<f64>,
}

fn unit_rows(mut x: Vec<f64>) -> Vec<f64> {
    for row in x.chunks_mut(WIDTH) {
        let n = row.iter().map(|a| a * a).sum::<f64>().sqrt().max(1e-12);
        row.iter_mut().for_each(|a| *a /= n);
    }
    x
}

/// Gates uniform in `[-6, 0]`, with `resets` tokens of every row at -1000.
fn draw(name: &str, b: usize, resets: &[usize]) -> Draw {
    let mut r = Rng::from_name(name);
    let n = HEADS * b * TOKENS;
    let (q, k) = (unit_rows(r.normal_vec(n * WIDTH)), unit_rows(r.normal_vec(n * WIDTH)));
    let v = r.normal_vec(n * WIDTH);
    let mut g = r.uniform_vec(n * WIDTH, -6.0, 0.0);
    for (token, gate) in g.chunks_mut(WIDTH).enumerate() {
        if resets.contains(&(token % TOKENS)) {
            gate.fill(-1000.0);
        }
    }
    let beta = r.uniform_vec(n, 0.0, 1.0);
    let d_o = r.normal_vec(n * WIDTH);
    Draw { q, k, v, g, beta, d_o }
}

/// `x` with the tokens `(row, token)` that `pick` selects taken from `y`; `width` values a token.
fn splice(x: &[f64], y: &[f64], width: usize, pick: &dyn Fn(usize, usize) -> bool) -> Vec<f64> {
    let rows = starts().len();
    let mut out = x.to_vec();
    for (i, (o, y)) in out.iter_mut().zip(y).enumerate() {
        let token = i / width;
        if pick((token / TOKENS) % rows, token % TOKENS) {
            *o = *y;
        }
    }
    out
}

fn tensor(shape: &[usize], x: &[f64], dtype: DType) -> Result<HostTensor, String> {
    HostTensor::from_f64_as(shape, x, dtype).map_err(|e| e.to_string())
}

fn inputs(d: &Draw, h0: &[f64], setup: &Setup) -> Result<KdaInputs, String> {
    let b = starts().len();
    let tk = Layout::HeadFirst.token_shape(HEADS, b, TOKENS, WIDTH);
    let ts = Layout::HeadFirst.scalar_shape(HEADS, b, TOKENS);
    let x = setup.dtype;
    let mut inputs = KdaInputs::new(
        tensor(&tk, &d.q, x)?,
        tensor(&tk, &d.k, x)?,
        tensor(&tk, &d.v, x)?,
        tensor(&tk, &d.g, x)?,
        tensor(&ts, &d.beta, x)?,
    )
    .with_config(KdaConfig {
        layout: Layout::HeadFirst,
        output_final_state: false,
        ..Default::default()
    });
    let slots = match setup.rows {
        Rows::Fixed => 1,
        Rows::Packed | Rows::PackedNoStates => {
            let mut cu = vec![0i64];
            for l in PACKED_LENGTHS {
                cu.push(cu[cu.len() - 1] + l as i64);
            }
            inputs = inputs.with_segments(Segments::CuSeqlens(vec![cu; b]));
            PACKED_LENGTHS.len()
        }
    };
    if setup.rows == Rows::PackedNoStates {
        return Ok(inputs);
    }
    let state = [b, slots, HEADS, WIDTH, WIDTH];
    Ok(inputs.with_initial_state(tensor(&state, &h0[..state.iter().product()], DType::F32)?))
}

fn run<B: Backend>(
    backend: &B,
    x: &KdaInputs,
    d_o: &[f64],
    setup: &Setup,
) -> Result<(HostTensor, KdaGradients), String> {
    let shape = x.v.shape().to_vec();
    let c = Cotangents { d_o: tensor(&shape, d_o, setup.dtype)?, dht: None };
    let what = |e: kda_core::KdaError| format!("{} {setup:?}: {e}", backend.name());
    match setup.path {
        Path::Fused => {
            let (out, grads) = backend.forward_and_vjp(x, &c, setup.strategy).map_err(what)?;
            Ok((out.o, grads))
        }
        Path::Split => {
            let (out, residuals) = backend.forward(x, setup.strategy).map_err(what)?;
            Ok((out.o, backend.backward(residuals, &c).map_err(what)?))
        }
    }
}

/// The per-token gradients by name.
fn per_token(g: &KdaGradients) -> [(&'static str, &HostTensor); 5] {
    [("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv), ("dg", &g.dg), ("dbeta", &g.dbeta)]
}

/// Where two per-token tensors differ among the tokens `pick` selects: `None`, or the first
/// `(row, token)` and the largest change.
fn first_difference(
    a: &HostTensor,
    b: &HostTensor,
    pick: &dyn Fn(usize, usize) -> bool,
) -> Option<((usize, usize), f64)> {
    let dims = ProblemDims { h: HEADS, b: starts().len(), t: TOKENS, k: WIDTH, v: WIDTH, n: 1 };
    let width = a.len() / (dims.h * dims.b * dims.t);
    let mut found: Option<((usize, usize), f64)> = None;
    for h in 0..dims.h {
        for row in 0..dims.b {
            for t in (0..dims.t).filter(|&t| pick(row, t)) {
                for i in 0..width {
                    let at = Layout::HeadFirst.index(&dims, h, row, t, width, i);
                    let (x, y) = (a.get_f64(at), b.get_f64(at));
                    if x.to_bits() != y.to_bits() {
                        let change = (x - y).abs();
                        found = Some(match found {
                            Some((first, m)) => (first.min((row, t)), m.max(change)),
                            None => ((row, t), change),
                        });
                    }
                }
            }
        }
    }
    found
}

/// Checks (a), (b) and (c) of the module doc on `backend` for `setup`: `Ok` with a one-line
/// summary, or `Err` naming every quantity that changed, with the first row, its `t0`, the
/// first changed token and the largest change.
pub fn check<B: Backend>(backend: &B, setup: Setup) -> Result<String, String> {
    let t0 = starts();
    let b = t0.len();
    let base = draw("causality_base", b, &HARD_RESETS);
    let other = draw("causality_other", b, &[97, 98, 99, 200]);
    let before = |r: usize, t: usize| t < t0[r];
    let after = |r: usize, t: usize| t >= t0[r];
    let perturbed = Draw {
        q: splice(&base.q, &other.q, WIDTH, &after),
        k: splice(&base.k, &other.k, WIDTH, &after),
        v: splice(&base.v, &other.v, WIDTH, &after),
        g: splice(&base.g, &other.g, WIDTH, &after),
        beta: splice(&base.beta, &other.beta, 1, &after),
        d_o: Vec::new(),
    };
    let h0: Vec<f64> = Rng::from_name("causality_h0")
        .normal_vec(b * PACKED_LENGTHS.len() * HEADS * WIDTH * WIDTH)
        .iter()
        .map(|x| 0.5 * x)
        .collect();
    let zeros = vec![0.0; base.d_o.len()];
    let do_early = splice(&base.d_o, &zeros, WIDTH, &after);
    let do_late = splice(&base.d_o, &other.d_o, WIDTH, &before);
    let (x, x_changed) = (inputs(&base, &h0, &setup)?, inputs(&perturbed, &h0, &setup)?);

    let mut failures = Vec::new();
    let report = |failures: &mut Vec<String>, what: String, d: Option<((usize, usize), f64)>| {
        if let Some(((row, token), change)) = d {
            failures.push(format!(
                "{what}: row {row} (t0 = {}) changed at token {token}, by up to {change:e}",
                t0[row]
            ));
        }
    };
    // (a) and (b): every input from t0 on changed, do zero from t0 on.
    let (o1, g1) = run(backend, &x, &do_early, &setup)?;
    let (o2, g2) = run(backend, &x_changed, &do_early, &setup)?;
    report(&mut failures, "(a) o before t0".into(), first_difference(&o1, &o2, &before));
    for ((name, a), (_, b)) in per_token(&g1).into_iter().zip(per_token(&g2)) {
        report(&mut failures, format!("(b) {name} before t0"), first_difference(a, b, &before));
    }
    if g1.dh0 != g2.dh0 {
        failures.push("(b) dh0 changed".into());
    }
    // (c): do before t0 changed.
    let (_, g3) = run(backend, &x, &base.d_o, &setup)?;
    let (_, g4) = run(backend, &x, &do_late, &setup)?;
    for ((name, a), (_, b)) in per_token(&g3).into_iter().zip(per_token(&g4)) {
        report(&mut failures, format!("(c) {name} from t0 on"), first_difference(a, b, &after));
    }
    // The perturbations reach what they should: a check that cannot fail proves nothing.
    if first_difference(&o1, &o2, &after).is_none() {
        failures.push("o from t0 on did not change with the inputs".into());
    }
    if first_difference(&g3.dq, &g4.dq, &before).is_none() {
        failures.push("dq before t0 did not change with do".into());
    }
    let label = format!(
        "[{} {:?} {} {:?} {:?}]",
        backend.name(),
        setup.rows,
        setup.dtype,
        setup.strategy,
        setup.path
    );
    if failures.is_empty() {
        Ok(format!("{label} bitwise causal for every t0 of {} rows", b))
    } else {
        Err(format!("{label} not bitwise causal:\n  {}", failures.join("\n  ")))
    }
}
