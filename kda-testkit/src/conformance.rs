//! The conformance suite: a backend's results on a case against `kda-ref` on the same (rounded)
//! inputs, at the limits of docs/kda.md. Every failing check names the case, the quantity, the metric,
//! the measured value and the limit.

use crate::cases::{case, Case};
use crate::inputs::{case_data, CaseData};
use crate::metrics::{agreement, Agreement};
use crate::reference;
use crate::tolerance::{rms_limit, Quantity};
use kda_core::{Backend, BackwardStrategy, DType, HostTensor, KdaGradients, KdaOutputs, Problem};
use std::fmt;

/// Whether the backward ran as forward + backward calls or as one fused call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `forward` then `backward` with the residuals.
    Split,
    /// `forward_and_vjp`.
    Fused,
}

/// One compared quantity.
#[derive(Debug, Clone)]
pub struct Check {
    /// `o`, `final_state`, `dq`, ...
    pub name: String,
    /// Agreement with the reference (or with the other path).
    pub agreement: Agreement,
    /// The RMS-ratio limit.
    pub limit: f64,
    /// Largest |value| at padding tokens (must be exactly 0).
    pub padding_max_abs: f64,
}

impl Check {
    /// Whether the check holds.
    pub fn passed(&self) -> bool {
        self.agreement.finite && self.agreement.rms_ratio <= self.limit && self.padding_max_abs == 0.0
    }
}

/// All checks of one run.
#[derive(Debug, Clone)]
pub struct Report {
    /// What ran: case, dtype, strategy, path.
    pub label: String,
    /// The checks.
    pub checks: Vec<Check>,
}

impl Report {
    /// `Err` with every failed check, or `Ok` with the report.
    pub fn into_result(self) -> Result<Report, String> {
        if self.checks.iter().all(Check::passed) {
            Ok(self)
        } else {
            Err(self.to_string())
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.checks {
            let status = if c.passed() { "ok  " } else { "FAIL" };
            writeln!(
                f,
                "{status} {}: {} rms_ratio = {:.3e} (limit {:.0e}), max_abs = {:.3e}, max_ulp = {}, finite = {}, padding max |x| = {:e}",
                self.label,
                c.name,
                c.agreement.rms_ratio,
                c.limit,
                c.agreement.max_abs,
                c.agreement.max_ulp,
                c.agreement.finite,
                c.padding_max_abs
            )?;
        }
        Ok(())
    }
}

fn find(name: &str) -> Result<Case, String> {
    case(name).ok_or_else(|| format!("no case named {name}"))
}

/// Largest |x| over the padding tokens of a per-token tensor (0 when there is no padding).
fn padding_max_abs(t: &HostTensor, p: &Problem) -> f64 {
    let d = &p.dims;
    let shape = t.shape();
    if shape.len() < 3 || p.layout.hbt(shape) != (d.h, d.b, d.t) {
        return 0.0;
    }
    let width = t.len() / (d.h * d.b * d.t);
    let mut m: f64 = 0.0;
    for b in 0..d.b {
        for s in p.segments.real_tokens(b)..d.t {
            for h in 0..d.h {
                for i in 0..width {
                    m = m.max(t.get_f64(p.layout.index(d, h, b, s, width, i)).abs());
                }
            }
        }
    }
    m
}

fn compare(
    name: &str,
    got: &HostTensor,
    want: &HostTensor,
    dtype: DType,
    p: &Problem,
) -> Result<Check, String> {
    if got.shape() != want.shape() {
        return Err(format!("{name}: shape {:?}, expected {:?}", got.shape(), want.shape()));
    }
    Ok(Check {
        name: name.to_string(),
        agreement: agreement(got, &want.to_f64_vec()),
        limit: rms_limit(Quantity::of(name), dtype),
        padding_max_abs: padding_max_abs(got, p),
    })
}

fn output_checks(
    out: &KdaOutputs,
    want: &KdaOutputs,
    data: &CaseData,
    p: &Problem,
) -> Result<Vec<Check>, String> {
    let dtype = p.dtype;
    if out.o.dtype() != data.inputs.q.dtype() {
        return Err(format!("o has dtype {}, expected q's {}", out.o.dtype(), data.inputs.q.dtype()));
    }
    let mut checks = vec![compare("o", &out.o, &want.o, dtype, p)?];
    match (&out.final_state, &want.final_state) {
        (Some(a), Some(b)) => {
            if a.dtype() != DType::F32 {
                return Err(format!("final_state has dtype {}, expected f32", a.dtype()));
            }
            checks.push(compare("final_state", a, b, dtype, p)?);
        }
        (None, None) => {}
        _ => return Err("final_state present on one side only".into()),
    }
    Ok(checks)
}

/// The dtype a gradient must come back in: its input's (f32 for states and gate parameters).
fn gradient_dtype(name: &str, data: &CaseData) -> DType {
    let x = &data.inputs;
    match name {
        "dq" => x.q.dtype(),
        "dk" => x.k.dtype(),
        "dv" => x.v.dtype(),
        "dg" => x.g.dtype(),
        "dbeta" => x.beta.dtype(),
        _ => DType::F32,
    }
}

fn gradient_checks(
    g: &KdaGradients,
    want: &KdaGradients,
    data: &CaseData,
    p: &Problem,
) -> Result<Vec<Check>, String> {
    let (got, exp) = (g.named(), want.named());
    let names: Vec<_> = got.iter().map(|x| x.0).collect();
    let want_names: Vec<_> = exp.iter().map(|x| x.0).collect();
    if names != want_names {
        return Err(format!("gradients returned: {names:?}, expected {want_names:?}"));
    }
    for (n, t) in &got {
        if t.dtype() != gradient_dtype(n, data) {
            return Err(format!("{n} has dtype {}, expected {}", t.dtype(), gradient_dtype(n, data)));
        }
    }
    got.iter().zip(&exp).map(|((n, a), (_, b))| compare(n, a, b, p.dtype, p)).collect()
}

fn setup<B: Backend>(backend: &B, name: &str, dtype: DType) -> Result<(Case, CaseData, Problem), String> {
    setup_case(backend, find(name)?, dtype)
}

fn setup_case<B: Backend>(
    backend: &B,
    case: Case,
    dtype: DType,
) -> Result<(Case, CaseData, Problem), String> {
    let name = case.name;
    let data = case_data(&case, dtype).map_err(|e| e.to_string())?;
    let p = data.inputs.validate().map_err(|e| e.to_string())?;
    backend.supports(&p).map_err(|e| format!("{}: case {name} must be supported: {e}", backend.name()))?;
    Ok((case, data, p))
}

fn label<B: Backend>(backend: &B, name: &str, dtype: DType, what: &str) -> String {
    format!("[{} {name} {dtype}{what}]", backend.name())
}

/// The forward on case `name` in `dtype` against the reference.
pub fn forward<B: Backend>(backend: &B, name: &str, dtype: DType) -> Result<Report, String> {
    forward_case(backend, &find(name)?, dtype)
}

/// [`forward`] on a case that need not be in the table (its name keys the reference cache).
pub fn forward_case<B: Backend>(backend: &B, case: &Case, dtype: DType) -> Result<Report, String> {
    let name = case.name;
    let (_, data, p) = setup_case(backend, case.clone(), dtype)?;
    let want = &reference::forward_and_vjp(&format!("{name}-{dtype}"), &data)?.0;
    let (out, _) = backend
        .forward(&data.inputs, BackwardStrategy::Rematerialize)
        .map_err(|e| format!("{}: forward failed: {e}", label(backend, name, dtype, "")))?;
    let checks = output_checks(&out, want, &data, &p)?;
    Report { label: label(backend, name, dtype, " forward"), checks }.into_result()
}

/// The backward (split or fused) with `strategy` on case `name` against the reference.
pub fn backward<B: Backend>(
    backend: &B,
    name: &str,
    dtype: DType,
    strategy: BackwardStrategy,
    path: Path,
) -> Result<Report, String> {
    backward_case(backend, &find(name)?, dtype, strategy, path)
}

/// [`backward`] on a case that need not be in the table (the regression sweep's).
pub fn backward_case<B: Backend>(
    backend: &B,
    case: &Case,
    dtype: DType,
    strategy: BackwardStrategy,
    path: Path,
) -> Result<Report, String> {
    let run = run_backward(backend, case, dtype, strategy, path)?;
    let checks = run.checks()?;
    Report { label: run.label, checks }.into_result()
}

/// One forward+VJP of a case with its reference.
struct BackwardRun {
    label: String,
    data: CaseData,
    problem: Problem,
    reference: reference::Reference,
    out: KdaOutputs,
    grads: KdaGradients,
}

impl BackwardRun {
    /// The outputs and every gradient against the reference, at the limits of docs/kda.md.
    fn checks(&self) -> Result<Vec<Check>, String> {
        let mut checks = output_checks(&self.out, &self.reference.0, &self.data, &self.problem)?;
        checks.extend(gradient_checks(&self.grads, &self.reference.1, &self.data, &self.problem)?);
        Ok(checks)
    }
}

fn run_backward<B: Backend>(
    backend: &B,
    case: &Case,
    dtype: DType,
    strategy: BackwardStrategy,
    path: Path,
) -> Result<BackwardRun, String> {
    let name = case.name;
    let (_, data, problem) = setup_case(backend, case.clone(), dtype)?;
    let reference = reference::forward_and_vjp(&format!("{name}-{dtype}"), &data)?;
    let what = format!(" {} {:?}", strategy.name(), path).to_lowercase();
    let label = label(backend, name, dtype, &what);
    let (out, grads) = match path {
        Path::Fused => backend.forward_and_vjp(&data.inputs, &data.cotangents, strategy),
        Path::Split => backend.forward(&data.inputs, strategy).and_then(|(out, res)| {
            use kda_core::Residuals;
            if res.strategy() != strategy {
                return Err(kda_core::KdaError::backend(
                    "forward",
                    "residuals must record the strategy",
                    format!("{:?}", res.strategy()),
                ));
            }
            Ok((out, backend.backward(res, &data.cotangents)?))
        }),
    }
    .map_err(|e| format!("{label}: failed: {e}"))?;
    Ok(BackwardRun { label, data, problem, reference, out, grads })
}

/// The gate gradients of a [`strong_decay_gate_case`](crate::cases::strong_decay_gate_case)
/// in f32: `dg` row by row (each token's `K` channels against that row of the reference,
/// relative to the row's own size, at docs/kda.md's `dg` limit) and `da_log` and `ddt_bias` at
/// [`GATE_PARAMETER_STRONG_DECAY_F32`](crate::tolerance::GATE_PARAMETER_STRONG_DECAY_F32),
/// besides every check of [`backward_case`].
pub fn gate_gradients<B: Backend>(
    backend: &B,
    name: &str,
    strategy: BackwardStrategy,
    path: Path,
) -> Result<Report, String> {
    let case =
        crate::cases::strong_decay_gate_case(name).ok_or_else(|| format!("no gate case named {name}"))?;
    let run = run_backward(backend, &case, DType::F32, strategy, path)?;
    let mut checks = run.checks()?;
    for c in &mut checks {
        if c.name == "da_log" || c.name == "ddt_bias" {
            c.limit = crate::tolerance::GATE_PARAMETER_STRONG_DECAY_F32;
        }
    }
    let want = run.reference.1.dg.to_f64_vec();
    let rows = crate::metrics::worst_row_ratio(&run.grads.dg, &want, run.problem.dims.k);
    checks.push(Check {
        name: "dg (worst row)".into(),
        agreement: crate::metrics::Agreement {
            rms_ratio: rows,
            max_abs: f64::NAN,
            max_ulp: 0,
            finite: rows.is_finite(),
        },
        limit: rms_limit(Quantity::GateGradient, DType::F32),
        padding_max_abs: 0.0,
    });
    Report { label: run.label, checks }.into_result()
}

/// Mixed dtypes on case `name`: `q, k, v, beta` and `do` in `dtype`, `g` in `g_dtype` (say bf16
/// activations with an f32 gate), drawn in f32 and rounded once, through the fused saved-state
/// path against the reference on the rounded values. `o` must come back in `dtype`, `dg` in
/// `g_dtype`; the limits are those of bf16 when either dtype is bf16.
pub fn mixed_gate_dtype<B: Backend>(
    backend: &B,
    name: &str,
    dtype: DType,
    g_dtype: DType,
) -> Result<Report, String> {
    let case = find(name)?;
    let mut data = case_data(&case, DType::F32).map_err(|e| e.to_string())?;
    let to = |t: &HostTensor, d: DType| t.cast(d).map_err(|e| e.to_string());
    let x = &mut data.inputs;
    (x.q, x.k, x.v, x.beta) = (to(&x.q, dtype)?, to(&x.k, dtype)?, to(&x.v, dtype)?, to(&x.beta, dtype)?);
    x.g = to(&x.g, g_dtype)?;
    data.cotangents.d_o = to(&data.cotangents.d_o, dtype)?;
    let p = data.inputs.validate().map_err(|e| e.to_string())?;
    backend.supports(&p).map_err(|e| format!("{}: case {name} must be supported: {e}", backend.name()))?;
    let reference = reference::forward_and_vjp(&format!("{name}-{dtype}-g-{g_dtype}"), &data)?;
    let (want_out, want) = (&reference.0, &reference.1);
    let lbl = label(backend, name, dtype, &format!(" with g {g_dtype} fused saved-state"));
    let (out, grads) = backend
        .forward_and_vjp(&data.inputs, &data.cotangents, BackwardStrategy::SavedState)
        .map_err(|e| format!("{lbl}: failed: {e}"))?;
    let mut checks = output_checks(&out, want_out, &data, &p)?;
    checks.extend(gradient_checks(&grads, want, &data, &p)?);
    let coarse = if dtype == DType::BF16 || g_dtype == DType::BF16 { DType::BF16 } else { dtype };
    for c in &mut checks {
        c.limit = rms_limit(Quantity::of(&c.name), coarse);
    }
    Report { label: lbl, checks }.into_result()
}

/// The two strategies, and the fused and split paths, agree with each other (`o`, the final
/// states and every gradient): RMS ratio at most
/// 1e-6 in f32 (f32 rounding of a long computation) and one bf16 ulp (2^-8) for bf16 results.
pub fn paths_agree<B: Backend>(backend: &B, name: &str, dtype: DType) -> Result<Report, String> {
    let (_, data, p) = setup(backend, name, dtype)?;
    let limit = if dtype == DType::BF16 { 2f64.powi(-8) } else { 1e-6 };
    let run = |s, path| -> Result<(KdaOutputs, KdaGradients), String> {
        let r = match path {
            Path::Fused => backend.forward_and_vjp(&data.inputs, &data.cotangents, s),
            Path::Split => backend
                .forward(&data.inputs, s)
                .and_then(|(o, r)| Ok((o, backend.backward(r, &data.cotangents)?))),
        };
        r.map_err(|e| format!("{} {path:?} failed: {e}", s.name()))
    };
    let base = run(BackwardStrategy::SavedState, Path::Split)?;
    let mut checks = Vec::new();
    for (s, path) in [
        (BackwardStrategy::SavedState, Path::Fused),
        (BackwardStrategy::Rematerialize, Path::Split),
        (BackwardStrategy::Rematerialize, Path::Fused),
    ] {
        let other = run(s, path)?;
        let mut pairs = vec![("o", &other.0.o, &base.0.o)];
        match (&other.0.final_state, &base.0.final_state) {
            (Some(a), Some(b)) => pairs.push(("final_state", a, b)),
            (None, None) => {}
            _ => return Err(format!("{} {path:?}: final_state present on one side only", s.name())),
        }
        pairs.extend(other.1.named().into_iter().zip(base.1.named()).map(|((n, a), (_, b))| (n, a, b)));
        for (n, a, b) in pairs {
            let mut c = compare(n, a, b, dtype, &p)?;
            c.name = format!("{n} ({} {path:?} vs saved-state split)", s.name());
            c.limit = limit;
            checks.push(c);
        }
    }
    Report { label: label(backend, name, dtype, " paths"), checks }.into_result()
}

/// Every check of the suite for one case, as the conformance macro runs them.
pub fn run_case<B: Backend>(backend: &B, name: &str) -> Result<Vec<Report>, String> {
    let mut reports = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        reports.push(forward(backend, name, dtype)?);
        for s in [BackwardStrategy::SavedState, BackwardStrategy::Rematerialize] {
            for path in [Path::Split, Path::Fused] {
                reports.push(backward(backend, name, dtype, s, path)?);
            }
        }
    }
    Ok(reports)
}
