//! `cargo xtask run`: runs a backend on `.npy` tensors from a directory and writes the results
//! as `.npy`, so users can check the library against tensors from their own model.

use crate::cli;
use crate::npy::{self, NpyArray, NpyData};
use kda_core::{
    fmt_shape, Backend, BackwardStrategy, Cotangents, DType, HostTensor, KdaConfig, KdaError, KdaInputs,
    Layout, ProblemDims, Segments,
};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The backends `--backend` accepts.
/// `pjrt` runs on `KDA_PJRT_PLUGIN`, else the CPU plugin `cargo xtask setup` installed.
pub const BACKENDS: &[&str] = &["ref", "pjrt"];

/// The usage text printed for `--help` and with every argument error.
pub const USAGE: &str = "\
usage: cargo xtask run --backend ref|pjrt --inputs DIR --out DIR [options]

Reads q k v g beta (+ optional h0 do dht cu_seqlens) as .npy from --inputs, runs the backend
and writes o, ht (with h0, dht or --output-final-state) and, with do: dq dk dv dg dbeta (+ dh0)
to --out. Tensors: float64 or float32; cu_seqlens: int64 or int32 ([N+1] = one packed row, or
[B, N+1]). States h0/dht/ht/dh0: [B, N, H, K, V] or [B*N, H, K, V] (outputs keep h0's rank).

options:
  --backend NAME                  backend to run: ref (f64 reference) or pjrt (the PJRT
                                  backend on $KDA_PJRT_PLUGIN, else setup's CPU plugin;
                                  f32 and bf16 only)
  --inputs DIR                    directory with the input .npy files
  --out DIR                       directory for the results (created if missing)
  --layout bthk|hbtk              batch-first [B,T,H,K] (default) or head-first [H,B,T,K]
  --scale X                       query scale (default K^-1/2)
  --dtype f32|bf16|f64            round inputs to this dtype first (default f32); results are
                                  written as float32 (float64 for f64)
  --strategy saved-state|remat    backward residual strategy (default saved-state)
  --l2norm                        L2-normalise q and k inside the kernel
  --output-final-state            write ht even without h0
  --gate softplus|lower-bound=LB  compute the gate in the kernel from g (the raw gate input),
                                  a_log.npy [H] and, if present, dt_bias.npy [H*K]; writes
                                  da_log and ddt_bias with the other gradients
  --implementation NAME           pjrt: xla (default), mosaic (the Mosaic forward kernel;
                                  needs a TPU plugin), interpret (its interpret lowering),
                                  triton (the GPU forward kernels; the CUDA plugin on a
                                  Hopper GPU) or triton-interpret (their interpret lowering)
  --devices N                     pjrt: split every row into N pieces over N devices (context
                                  parallelism; on the CPU plugin, N CPU devices); default 1
  -h, --help                      show this text";

/// `--gate`: how `g` becomes the log-decay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GateChoice {
    /// `g` is the log-decay.
    Preactivated,
    /// In-kernel softplus gate.
    Softplus,
    /// In-kernel lower-bound gate with this bound.
    LowerBound(f64),
}

impl GateChoice {
    /// Parses `softplus` or `lower-bound=LB` (LB finite and negative).
    pub fn parse(v: &str) -> Option<Self> {
        match v {
            "softplus" => Some(GateChoice::Softplus),
            "preactivated" => Some(GateChoice::Preactivated),
            _ => v
                .strip_prefix("lower-bound=")
                .and_then(|lb| lb.parse::<f64>().ok())
                .filter(|lb| lb.is_finite() && *lb < 0.0)
                .map(GateChoice::LowerBound),
        }
    }
}

/// Everything `run` needs besides the backend.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOptions {
    /// Directory of the input `.npy` files.
    pub inputs: PathBuf,
    /// Directory for the results.
    pub out: PathBuf,
    /// Layout of the per-token tensors.
    pub layout: Layout,
    /// Query scale; `None` means `K^-1/2`.
    pub scale: Option<f64>,
    /// The dtype inputs are rounded to.
    pub dtype: DType,
    /// The backward strategy.
    pub strategy: BackwardStrategy,
    /// In-kernel q/k L2 norm.
    pub l2norm: bool,
    /// Return (and write) final states even without `h0`.
    pub output_final_state: bool,
    /// The gate.
    pub gate: GateChoice,
    /// Devices for context parallelism (pjrt only; 1: one device).
    pub devices: usize,
    /// What runs the programs' chunk loops (pjrt only; the context-parallel ones are XLA's).
    pub implementation: kda_core::Implementation,
}

impl RunOptions {
    /// Default options for an input and an output directory.
    pub fn new(inputs: impl Into<PathBuf>, out: impl Into<PathBuf>) -> Self {
        Self {
            inputs: inputs.into(),
            out: out.into(),
            layout: Layout::BatchFirst,
            scale: None,
            dtype: DType::F32,
            strategy: BackwardStrategy::SavedState,
            l2norm: false,
            output_final_state: false,
            gate: GateChoice::Preactivated,
            devices: 1,
            implementation: kda_core::Implementation::Xla,
        }
    }
}

/// What a run read, computed and wrote.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The backend's name.
    pub backend: String,
    /// The problem sizes.
    pub dims: ProblemDims,
    /// The options of the run.
    pub opts: RunOptions,
    /// Files read: name, shape, NumPy dtype.
    pub read: Vec<(String, Vec<usize>, &'static str)>,
    /// Files written: path and shape.
    pub written: Vec<(PathBuf, Vec<usize>)>,
    /// Time in the backend.
    pub compute: Duration,
    /// Time of the whole run, files included.
    pub total: Duration,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (o, d) = (&self.opts, &self.dims);
        writeln!(
            f,
            "backend {} | {} | dtype {} | strategy {}",
            self.backend,
            o.layout,
            o.dtype,
            o.strategy.name()
        )?;
        writeln!(f, "sizes H={} B={} T={} K={} V={} N={}", d.h, d.b, d.t, d.k, d.v, d.n)?;
        writeln!(f, "inputs from {}", o.inputs.display())?;
        for (name, shape, dtype) in &self.read {
            writeln!(f, "  read  {name}.npy {} {dtype}", fmt_shape(shape))?;
        }
        for (path, shape) in &self.written {
            writeln!(f, "  wrote {} {}", path.display(), fmt_shape(shape))?;
        }
        writeln!(f, "backend time {:.3?}, total {:.3?}", self.compute, self.total)
    }
}

/// Parses the arguments after `run`; `Ok(None)` means help was asked for.
pub fn parse_args(args: &[String]) -> Result<Option<(String, RunOptions)>, String> {
    let (mut backend, mut inputs, mut out) = (None, None, None);
    let mut opts = RunOptions::new("", "");
    let mut flags = cli::Flags::new(args);
    while let Some(flag) = flags.next_flag()? {
        let flag = flag.as_str();
        let bad = |what: &str, v: &str| format!("`{flag}`: expected {what}, got `{v}`");
        let mut take_value = |flag: &str| flags.value(flag);
        match flag {
            "-h" | "--help" => return Ok(None),
            "--l2norm" => opts.l2norm = true,
            "--output-final-state" => opts.output_final_state = true,
            "--backend" => backend = Some(take_value(flag)?),
            "--inputs" => inputs = Some(PathBuf::from(take_value(flag)?)),
            "--out" => out = Some(PathBuf::from(take_value(flag)?)),
            "--layout" => {
                let v = &take_value(flag)?;
                opts.layout = Layout::parse(v).ok_or_else(|| bad("bthk or hbtk", v))?;
            }
            "--scale" => {
                let v = &take_value(flag)?;
                let s = v
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite())
                    .ok_or_else(|| bad("a finite number", v))?;
                opts.scale = Some(s);
            }
            "--dtype" => {
                let v = &take_value(flag)?;
                opts.dtype =
                    DType::parse(v).filter(|d| d.is_float()).ok_or_else(|| bad("f32, bf16 or f64", v))?;
            }
            "--strategy" => {
                let v = &take_value(flag)?;
                opts.strategy = BackwardStrategy::parse(v).ok_or_else(|| bad("saved-state or remat", v))?;
            }
            "--gate" => {
                let v = &take_value(flag)?;
                opts.gate =
                    GateChoice::parse(v).ok_or_else(|| bad("softplus or lower-bound=LB (LB < 0)", v))?;
            }
            "--devices" => opts.devices = crate::cli::positive(flag, &take_value(flag)?)?,
            "--implementation" => {
                let v = &take_value(flag)?;
                opts.implementation =
                    kda_core::Implementation::parse(v).ok_or_else(|| bad(crate::cli::IMPLEMENTATIONS, v))?;
            }
            _ => return Err(format!("unknown argument `{flag}`")),
        }
    }
    let backend = backend.ok_or(format!("`--backend` is required (available: {})", BACKENDS.join(", ")))?;
    if opts.devices > 1 && backend != "pjrt" {
        return Err(format!("`--devices {}` needs `--backend pjrt`", opts.devices));
    }
    if opts.implementation != kda_core::Implementation::Xla && backend != "pjrt" {
        return Err(format!("`--implementation {}` needs `--backend pjrt`", opts.implementation.name()));
    }
    opts.inputs = inputs.ok_or("`--inputs DIR` is required")?;
    opts.out = out.ok_or("`--out DIR` is required")?;
    Ok(Some((backend, opts)))
}

/// The entry point of `cargo xtask run`; `args` are the arguments after `run`.
pub fn run(args: &[String]) -> Result<(), String> {
    let Some((backend, opts)) = parse_args(args).map_err(|e| format!("xtask run: {e}\n\n{USAGE}"))? else {
        println!("{USAGE}");
        return Ok(());
    };
    let summary = match backend.as_str() {
        "ref" => run_with(&kda_ref::RefBackend, &opts),
        #[cfg(feature = "pjrt")]
        "pjrt" => kda_tpu::PjrtOptions::new()
            .devices(opts.devices)
            .split(kda_tpu::Split::Context)
            .build()
            .and_then(|b| b.clone().with_tuning(b.tuning().with_implementation(opts.implementation)))
            .and_then(|b| run_with(&b, &opts)),
        #[cfg(not(feature = "pjrt"))]
        "pjrt" => {
            let mut all = vec!["run".to_string()];
            all.extend(args.iter().cloned());
            return crate::cargo_cmd::reexec_with_pjrt(&all);
        }
        other => {
            return Err(format!("xtask run: unknown backend `{other}`; available: {}", BACKENDS.join(", ")))
        }
    };
    print!("{}", summary.map_err(|e| format!("xtask run: {e}"))?);
    Ok(())
}

/// Puts the input file's path on an error the contract raised about an argument.
fn name_file(e: KdaError, dir: &Path) -> KdaError {
    let file = match e.arg() {
        "q" | "k" | "v" | "g" | "beta" | "do" | "dht" | "cu_seqlens" | "a_log" | "dt_bias" => {
            e.arg().to_string()
        }
        "initial_state" => "h0".to_string(),
        "K" => return e.with_arg(format!("K (last axis of {})", dir.join("q.npy").display())),
        _ => return e,
    };
    e.with_arg(dir.join(format!("{file}.npy")).display().to_string())
}

/// Reads `name.npy` from `dir`; `Ok(None)` when the file is absent.
fn load(dir: &Path, name: &str) -> Result<Option<NpyArray>, KdaError> {
    let path = dir.join(format!("{name}.npy"));
    if !path.is_file() {
        return Ok(None);
    }
    npy::read(&path).map(Some)
}

/// A float array as a tensor rounded to `dtype`.
fn tensor(dir: &Path, name: &str, arr: &NpyArray, dtype: DType) -> Result<HostTensor, KdaError> {
    let path = dir.join(format!("{name}.npy")).display().to_string();
    let data = arr.data.floats().ok_or_else(|| {
        KdaError::dtype(&path, "float64 or float32 ('<f8' or '<f4')", arr.data.dtype_name())
    })?;
    HostTensor::from_f64_as(&arr.shape, &data, dtype).map_err(|e| e.with_arg(path))
}

/// Sizes a 4-D state `[B*N, H, K, V]` is checked against: `(B, N, H, K, V)` from q and v.
type StateDims = (usize, usize, usize, usize, usize);

/// Brings a state to `[B, N, H, K, V]`; returns it with the rank it was given in.
fn state_5d(
    dir: &Path,
    name: &str,
    t: HostTensor,
    dims: Option<StateDims>,
) -> Result<(HostTensor, usize), KdaError> {
    let rank = t.shape().len();
    let path = dir.join(format!("{name}.npy")).display().to_string();
    match (rank, dims) {
        (5, _) => Ok((t, 5)),
        (4, Some((b, n, h, k, v))) => {
            if t.shape() != [b * n, h, k, v] {
                return Err(KdaError::shape(
                    path,
                    format!(
                        "[B*N = {}, H, K, V] = {} for a 4-D state (B = {b}, N = {n})",
                        b * n,
                        fmt_shape(&[b * n, h, k, v])
                    ),
                    fmt_shape(t.shape()),
                ));
            }
            Ok((t.reshape(&[b, n, h, k, v])?, 4))
        }
        (4, None) => Ok((t, 4)), // q or v is malformed; validation reports it.
        _ => Err(KdaError::shape(
            path,
            "rank 5 [B, N, H, K, V] or rank 4 [B*N, H, K, V]",
            fmt_shape(t.shape()),
        )),
    }
}

/// Runs `backend` on the files of `opts.inputs` and writes the results to `opts.out`.
pub fn run_with<B: Backend>(backend: &B, opts: &RunOptions) -> Result<Summary, KdaError> {
    let start = Instant::now();
    let dir = opts.inputs.as_path();
    if !dir.is_dir() {
        let got = if dir.exists() { "not a directory" } else { "no such directory" };
        return Err(KdaError::io(dir.display().to_string(), "a directory of .npy inputs", got));
    }
    let need = |name: &str| -> Result<NpyArray, KdaError> {
        let path = dir.join(format!("{name}.npy"));
        let what = format!("the required input `{name}` as an .npy file");
        load(dir, name)?.ok_or_else(|| KdaError::io(path.display().to_string(), what, "no such file"))
    };
    let (q, k, v, g, beta) = (need("q")?, need("k")?, need("v")?, need("g")?, need("beta")?);
    let (h0, d_o, dht, cu) =
        (load(dir, "h0")?, load(dir, "do")?, load(dir, "dht")?, load(dir, "cu_seqlens")?);
    let given = [("q", Some(&q)), ("k", Some(&k)), ("v", Some(&v)), ("g", Some(&g)), ("beta", Some(&beta))];
    let optional =
        [("h0", h0.as_ref()), ("do", d_o.as_ref()), ("dht", dht.as_ref()), ("cu_seqlens", cu.as_ref())];
    let read: Vec<_> = given
        .into_iter()
        .chain(optional)
        .filter_map(|(name, a)| a.map(|a| (name.to_string(), a.shape.clone(), a.data.dtype_name())))
        .collect();

    let state_dtype = if opts.dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let q_rank4 = (q.shape.len() == 4).then(|| opts.layout.hbt(&q.shape));
    let cu_path = dir.join("cu_seqlens.npy").display().to_string();
    let segments = match &cu {
        None => None,
        Some(a) => {
            let c = a.data.ints().ok_or_else(|| {
                KdaError::dtype(&cu_path, "int64 or int32 ('<i8' or '<i4')", a.data.dtype_name())
            })?;
            let rows = match a.shape[..] {
                [_] => {
                    if let Some((_, b, _)) = q_rank4.filter(|&(_, b, _)| b != 1) {
                        let want = format!(
                            "[B, N+1] (a 1-D cu_seqlens means one packed row, but q.npy has B = {b})"
                        );
                        return Err(KdaError::segments(cu_path, want, fmt_shape(&a.shape)));
                    }
                    vec![c]
                }
                [_, w] if w > 0 => c.chunks(w).map(<[i64]>::to_vec).collect(),
                _ => {
                    return Err(KdaError::shape(
                        cu_path,
                        "[N+1] or [B, N+1] with N >= 1",
                        fmt_shape(&a.shape),
                    ))
                }
            };
            Some(Segments::CuSeqlens(rows))
        }
    };
    let n = match &segments {
        Some(Segments::CuSeqlens(rows)) => rows.first().map_or(1, |r| r.len().saturating_sub(1)),
        _ => 1,
    };
    let sdims = match (q_rank4, &v.shape[..]) {
        (Some((h, b, _)), &[.., vw]) if v.shape.len() == 4 => Some((b, n, h, q.shape[3], vw)),
        _ => None,
    };

    let state = |name: &str, a: Option<NpyArray>| -> Result<Option<(HostTensor, usize)>, KdaError> {
        a.map(|a| state_5d(dir, name, tensor(dir, name, &a, state_dtype)?, sdims)).transpose()
    };
    let h0 = state("h0", h0)?;
    let dht = state("dht", dht)?;
    let ht_rank = h0.as_ref().or(dht.as_ref()).map_or(5, |s| s.1);
    let config = KdaConfig {
        layout: opts.layout,
        scale: opts.scale,
        use_qk_l2norm: opts.l2norm,
        output_final_state: opts.output_final_state || h0.is_some() || dht.is_some(),
    };
    let mut inputs = KdaInputs::new(
        tensor(dir, "q", &q, opts.dtype)?,
        tensor(dir, "k", &k, opts.dtype)?,
        tensor(dir, "v", &v, opts.dtype)?,
        tensor(dir, "g", &g, opts.dtype)?,
        tensor(dir, "beta", &beta, opts.dtype)?,
    )
    .with_config(config);
    if opts.gate != GateChoice::Preactivated {
        let a_log = tensor(dir, "a_log", &need("a_log")?, state_dtype)?;
        let dt_bias = load(dir, "dt_bias")?.map(|a| tensor(dir, "dt_bias", &a, state_dtype)).transpose()?;
        inputs.gate = match opts.gate {
            GateChoice::LowerBound(lb) => kda_core::GateMode::lower_bound(lb, a_log, dt_bias),
            _ => kda_core::GateMode::softplus(a_log, dt_bias),
        };
    }
    inputs.segments = segments;
    let h0_rank = h0.as_ref().map(|s| s.1);
    inputs.initial_state = h0.map(|s| s.0);
    let named = |e: KdaError| name_file(e, dir);
    let problem = inputs.validate().map_err(named)?;
    backend.supports(&problem)?;
    let cot = match d_o {
        Some(a) => {
            let d_o = tensor(dir, "do", &a, opts.dtype)?;
            let cot = Cotangents { d_o, dht: dht.map(|s| s.0) };
            cot.validate(&problem).map_err(named)?;
            Some(cot)
        }
        None if dht.is_some() => {
            let why = "gradients need do.npy; dht.npy was given without it (use zeros for no output loss)";
            return Err(KdaError::missing(dir.join("do.npy").display().to_string(), why));
        }
        None => None,
    };

    let t0 = Instant::now();
    let (outputs, grads) = match &cot {
        Some(c) => backend.forward_and_vjp(&inputs, c, opts.strategy).map(|(o, g)| (o, Some(g))),
        None => backend.forward(&inputs, opts.strategy).map(|(o, _)| (o, None)),
    }
    .map_err(named)?;
    let compute = t0.elapsed();

    let d = problem.dims;
    let mut results: Vec<(&str, &HostTensor, usize)> = vec![("o", &outputs.o, 4)];
    if let Some(ht) = &outputs.final_state {
        results.push(("ht", ht, ht_rank));
    }
    for (name, t) in grads.as_ref().map(|g| g.named()).unwrap_or_default() {
        let rank = if name == "dh0" { h0_rank.unwrap_or(5) } else { t.shape().len() };
        results.push((name, t, rank));
    }
    std::fs::create_dir_all(&opts.out).map_err(|e| {
        KdaError::io(opts.out.display().to_string(), "a writable output directory", e.to_string())
    })?;
    let mut written = Vec::new();
    for (name, t, rank) in results {
        let shape = match (t.shape(), rank) {
            (&[b, n, h, kk, vv], 4) => vec![b * n, h, kk, vv],
            (s, _) => s.to_vec(),
        };
        let data = match opts.dtype {
            DType::F64 => NpyData::F64(t.to_f64_vec()),
            _ => NpyData::F32(t.to_f32_vec()),
        };
        let path = opts.out.join(format!("{name}.npy"));
        npy::write(&path, &NpyArray::new(&shape, data)?)?;
        written.push((path, shape));
    }
    Ok(Summary {
        backend: backend.name(),
        dims: d,
        opts: opts.clone(),
        read,
        written,
        compute,
        total: start.elapsed(),
    })
}
