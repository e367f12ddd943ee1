//! The one execution path of the KDA programs, for 1 to D devices: each device's arguments
//! given by name, laid out in the order of the program's signature
//! ([`crate::op::signature`]) with the index tables placed, every argument checked
//! against its port (an error names it), buffers stored under other dims (flat results fed
//! back) reshaped on their device, and the results handed back by name.

use kda_core::{fmt_shape, KdaError, Problem, Tensors};

use super::handle::{e, HostData, PjrtBackend, Upload};
use super::options::Split;
use super::tensor::{DeviceProgram, DeviceTensor, TableCache, TABLES_KEPT};
use super::worker::{BufferInfo, Counters, Worker};
use crate::error::{Result, TpuError};
use crate::op::{Port, ProgramKind, ProgramSignature, ProgramSpec, TABLE_NAMES};
use crate::runtime::CompileOptions;
use crate::Executable;
use kda_core::DType;

/// A program argument: a tensor on the device, or a host array uploaded for this run only.
pub(crate) enum Arg {
    Tensor(DeviceTensor),
    Upload(Upload),
}

/// One device's part of a launch: its device, the problem its index tables come from, and its
/// arguments by signature name (index tables may be left out: they are placed here).
pub(crate) struct Bound<'p> {
    pub(crate) device: usize,
    pub(crate) problem: &'p Problem,
    pub(crate) args: Vec<(&'static str, Arg)>,
}

/// One device's part of a call: its device, its problem and its arguments by name.
pub(crate) struct Part {
    pub(crate) device: usize,
    pub(crate) problem: Problem,
    pub(crate) args: Vec<(&'static str, Arg)>,
}

/// A record's tensors as program arguments, by program name.
pub(crate) fn tensor_args<S: Tensors<DeviceTensor> + ?Sized>(x: &S) -> Vec<(&'static str, Arg)> {
    x.named().into_iter().map(|(n, t)| (arg_name(n), Arg::Tensor(t.clone()))).collect()
}

/// A tensor of a call that runs on device `device`: anywhere else is an error naming both.
pub(crate) fn check_on(t: &DeviceTensor, arg: &str, device: usize) -> kda_core::Result<()> {
    if t.device() == device {
        return Ok(());
    }
    Err(KdaError::value(
        arg,
        format!("a tensor on device {device} (where the call's other tensors are)"),
        format!("a tensor on device {}", t.device()),
    ))
}

/// Results of one device, by signature name, in signature order.
pub(crate) type Named = Vec<(&'static str, DeviceTensor)>;

impl PjrtBackend {
    /// Runs program `kind` of `spec` in the form `split` over `bound.len()` devices (one
    /// program compiled for that many replicas; one device: the plain program on that device).
    pub(crate) fn launch(
        &self,
        spec: &ProgramSpec,
        kind: ProgramKind,
        split: Split,
        bound: Vec<Bound<'_>>,
    ) -> kda_core::Result<Vec<Named>> {
        let sig = crate::op::signature(spec, kind, split == Split::Context, bound.len()).map_err(e)?;
        if bound.len() > 1 && bound.iter().enumerate().any(|(d, b)| b.device != d) {
            return Err(KdaError::value(
                "devices",
                "device d's part of a launch on device d",
                "another order",
            ));
        }
        let first = bound.first().map_or(0, |b| b.device);
        let mut lists = Vec::with_capacity(bound.len());
        for b in bound {
            lists.push((b.device, self.lay_out(spec, &sig, b)?));
        }
        let options = self.compile_options(kind).with_replicas(lists.len()).on_devices_from(first);
        let (spec, counters) = (spec.clone(), self.shared().counters.clone());
        let wanted: Vec<Vec<i64>> = sig.args.iter().map(|p| p.ty.dims.clone()).collect();
        let infos = self
            .shared()
            .call("kernel", move |w| {
                let (exe, cached) = w.kernel(&spec, kind, &options, split)?;
                let mut lists_ids = Vec::with_capacity(lists.len());
                let (mut held, mut uploaded) = (Vec::new(), Vec::new());
                let mut placed = Ok(());
                for (device, list) in lists {
                    let mut ids = Vec::with_capacity(list.len());
                    for a in list {
                        match a {
                            Arg::Tensor(t) => {
                                ids.push(t.id());
                                held.push(t);
                            }
                            Arg::Upload(u) if placed.is_ok() => match w.upload_on(&counters, u, device) {
                                Ok(buf) => {
                                    let id = w.keep_on(buf, device).id;
                                    uploaded.push(id);
                                    ids.push(id);
                                }
                                Err(err) => placed = Err(err),
                            },
                            Arg::Upload(_) => {}
                        }
                    }
                    lists_ids.push((device, ids));
                }
                let out = placed.and_then(|()| run(w, &counters, &exe, lists_ids, &wanted));
                // Arguments uploaded for this run only go with it, whatever happened.
                for id in uploaded {
                    w.forget(id);
                }
                drop(held);
                out.map(|o| (o, cached))
            })
            .map_err(e)?;
        let (infos, cached) = infos;
        tracing::Span::current().record("cache", if cached { "hit" } else { "miss" });
        Ok(infos
            .into_iter()
            .map(|device| sig.results.iter().map(|p| p.name).zip(self.wrap(device)).collect())
            .collect())
    }

    /// Runs a compiled program on device 0's tensors (borrowed: they stay valid); one new
    /// tensor per result. [`PjrtBackend::bind`] lays out a KDA function's arguments.
    pub fn execute(
        &self,
        program: &DeviceProgram,
        args: &[DeviceTensor],
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        if program.owner_id() != self.shared.id {
            return Err(KdaError::value(
                "program",
                "a program of this handle",
                "a program of another handle",
            ));
        }
        for (i, t) in args.iter().enumerate() {
            t.check_owner(&self.shared, &format!("argument {i}")).map_err(e)?;
        }
        let ids: Vec<u64> = args.iter().map(|t| t.id()).collect();
        let pid = program.id();
        let counters = self.shared.counters.clone();
        let infos = self
            .shared
            .call("execute", move |w| {
                let exe = w.user_programs.get(&pid).cloned().ok_or_else(|| TpuError::Execute {
                    message: format!("program {pid} is not held by this handle's worker"),
                })?;
                let mut outs = run(w, &counters, &exe, vec![(0, ids)], &[])?;
                Ok(outs.remove(0))
            })
            .map_err(e)?;
        Ok(self.wrap(infos))
    }

    /// The arguments of the KDA function `kda` of a caller's program
    /// ([`crate::op::compose::add_function`]) on device `device`, in its signature's
    /// order: each given tensor under its name (`q`, `k`, ..., `initial_state` or `h0`, `do`,
    /// ...: a record's [`kda_core::Tensors::named`] fits), checked against its port, and the
    /// index tables of `segments` (fixed length: `None`), uploaded on first use and kept.
    /// Arguments neither given nor index tables are left out, so a program whose `@main`
    /// computes `q`, `k` and `v` itself binds the tables alone.
    pub fn bind(
        &self,
        kda: &crate::op::compose::KdaFunction,
        tensors: &[(&str, &DeviceTensor)],
        segments: Option<&kda_core::Segments>,
        device: usize,
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        self.check_device_index(device)?;
        let sig = &kda.signature;
        for (name, _) in tensors {
            if sig.arg_index(arg_name_of(name)).is_none() {
                return Err(KdaError::value(
                    *name,
                    format!("an argument of @{}", kda.name),
                    "a tensor it does not take",
                ));
            }
        }
        let table = match segments {
            Some(s) => s.validate(kda.spec.dims.b, kda.spec.dims.t)?,
            None => kda_core::SegmentTable::fixed(kda.spec.dims.b, kda.spec.dims.t),
        };
        let mut problem_tables: Option<Vec<DeviceTensor>> = None;
        let mut out = Vec::with_capacity(sig.args.len());
        for port in &sig.args {
            if let Some((_, t)) = tensors.iter().find(|(n, _)| arg_name_of(n) == port.name) {
                let a = Arg::Tensor((*t).clone());
                self.check_arg(port, &a, device)?;
                out.push((*t).clone());
            } else if let Some(k) = TABLE_NAMES.iter().position(|n| *n == port.name) {
                if problem_tables.is_none() {
                    problem_tables = Some(self.tables_of(&kda.spec, &table, device)?);
                }
                let present: Vec<&str> =
                    TABLE_NAMES.iter().copied().filter(|n| sig.arg_index(n).is_some()).collect();
                let at = present.iter().position(|n| *n == TABLE_NAMES[k]).unwrap_or(k);
                let t = problem_tables.as_ref().and_then(|ts| ts.get(at).cloned());
                out.push(t.ok_or_else(|| KdaError::missing(port.name, "an index table"))?);
            }
        }
        Ok(out)
    }

    /// One device's arguments in signature order, each checked against its port.
    fn lay_out(
        &self,
        spec: &ProgramSpec,
        sig: &ProgramSignature,
        b: Bound<'_>,
    ) -> kda_core::Result<Vec<Arg>> {
        let mut given = b.args;
        for (name, _) in &given {
            if sig.arg_index(name).is_none() {
                return Err(KdaError::value(
                    *name,
                    "an argument of the program",
                    "a tensor it does not take",
                ));
            }
        }
        let mut tables: Option<Vec<DeviceTensor>> = None;
        let mut out = Vec::with_capacity(sig.args.len());
        for (i, port) in sig.args.iter().enumerate() {
            if let Some(j) = given.iter().position(|(n, _)| *n == port.name) {
                let (_, mut a) = given.swap_remove(j);
                self.check_arg(port, &a, b.device)?;
                // Host data travels in the port's dims (its row-major elements are the same), so
                // the device holds it in the program's form without a reshape there.
                if let Arg::Upload(u) = &mut a {
                    u.dims = port.ty.dims.clone();
                }
                out.push(a);
                continue;
            }
            if TABLE_NAMES.contains(&port.name) {
                if tables.is_none() {
                    tables = Some(self.tables(spec, b.problem, b.device)?);
                }
                let t = tables.as_ref().and_then(|ts| {
                    let k = sig.args[..=i].iter().filter(|p| TABLE_NAMES.contains(&p.name)).count() - 1;
                    ts.get(k).cloned()
                });
                out.push(Arg::Tensor(t.ok_or_else(|| KdaError::missing(port.name, "an index table"))?));
                continue;
            }
            return Err(KdaError::missing(port.name, format!("the program takes {} {}", port.name, port.ty)));
        }
        Ok(out)
    }

    /// An argument against its port: this handle's, on `device`, the port's element type, and
    /// the port's element count (other dims are reshaped on the device).
    fn check_arg(&self, port: &Port, a: &Arg, device: usize) -> kda_core::Result<()> {
        let name = public_name(port.name);
        let want_n: i64 = port.ty.dims.iter().product();
        let (dtype, n, shape) = match a {
            Arg::Tensor(t) => {
                t.check_owner(self.shared(), name).map_err(e)?;
                if t.device() != device {
                    return Err(KdaError::value(
                        name,
                        format!("a tensor on device {device} (the call's other tensors are there)"),
                        format!("a tensor on device {}", t.device()),
                    ));
                }
                (t.dtype(), t.num_elements() as i64, fmt_shape(t.shape()))
            }
            Arg::Upload(u) => {
                let dtype = match u.data {
                    HostData::F32(_) => DType::F32,
                    HostData::Bf16(_) => DType::BF16,
                    HostData::I32(_) => DType::I32,
                };
                let dims: Vec<usize> = u.dims.iter().map(|&d| d as usize).collect();
                (dtype, u.dims.iter().product(), fmt_shape(&dims))
            }
        };
        if dtype.name() != port.ty.elem.name() {
            return Err(KdaError::dtype(name, port.ty.elem.name(), dtype.name()));
        }
        if n != want_n {
            let dims: Vec<usize> = port.ty.dims.iter().map(|&d| d as usize).collect();
            return Err(KdaError::shape(name, fmt_shape(&dims), shape));
        }
        Ok(())
    }

    /// The index tables of `problem`'s segments under `spec` on `device`, uploaded on first
    /// use and kept (the last [`TABLES_KEPT`] sets).
    fn tables(
        &self,
        spec: &ProgramSpec,
        problem: &Problem,
        device: usize,
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        self.tables_of(spec, &problem.segments, device)
    }

    fn tables_of(
        &self,
        spec: &ProgramSpec,
        segments: &kda_core::SegmentTable,
        device: usize,
    ) -> kda_core::Result<Vec<DeviceTensor>> {
        let key = (spec.clone(), segments.clone());
        let cache = |c: &TableCache| {
            c.0.iter().find(|(k, d, _)| *d == device && *k == key).map(|(_, _, t)| t.clone())
        };
        if let Some(t) = cache(&self.tables.lock().unwrap_or_else(|p| p.into_inner())) {
            return Ok(t);
        }
        let tables = crate::op::index_tables_for(spec, segments).map_err(e)?;
        let ups = tables.into_iter().map(|t| Upload::i32(t.data, t.dims)).collect();
        let uploaded = self.upload_to(device, ups)?;
        let mut c = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        c.0.push_back((key, device, uploaded.clone()));
        while c.0.len() > TABLES_KEPT {
            c.0.pop_front();
        }
        Ok(uploaded)
    }
}

/// The caller's name of a program argument (`h0` is the inputs' `initial_state`).
fn public_name(port: &str) -> &str {
    match port {
        "h0" => "initial_state",
        other => other,
    }
}

fn arg_name_of(name: &str) -> &str {
    match name {
        "initial_state" => "h0",
        other => other,
    }
}

/// The program's name of a record's tensor (`initial_state` is the programs' `h0`).
pub(crate) fn arg_name(record: &'static str) -> &'static str {
    match record {
        "initial_state" => "h0",
        other => other,
    }
}

/// Executes `exe` on the worker, replica `r` on device `lists[r].0` with the kept buffers
/// `lists[r].1`, and keeps every replica's outputs on its device. A buffer whose dims differ
/// from `wanted` (same element count) is reshaped on its device first.
pub(crate) fn run(
    w: &mut Worker,
    counters: &Counters,
    exe: &Executable,
    lists: Vec<(usize, Vec<u64>)>,
    wanted: &[Vec<i64>],
) -> Result<Vec<Vec<BufferInfo>>> {
    let declared: Vec<Vec<i64>>;
    let wanted = match (wanted.is_empty(), exe.signature()) {
        (true, Some(sig)) => {
            declared =
                sig.args.iter().map(|a| a.as_ref().map(|t| t.dims.clone()).unwrap_or_default()).collect();
            &declared
        }
        _ => wanted,
    };
    let mut temps: Vec<crate::DeviceBuffer> = Vec::new();
    let mut orders: Vec<Vec<Result<u64, usize>>> = Vec::with_capacity(lists.len());
    for (device, ids) in &lists {
        let mut order = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let (dtype, dims) = {
                let buf = w.buffer(id)?;
                (buf.dtype(), buf.dims().to_vec())
            };
            match wanted.get(i) {
                Some(want)
                    if dims != *want && dims.iter().product::<i64>() == want.iter().product::<i64>() =>
                {
                    let reshape = w.reshape_program(dtype, &dims, want, *device)?;
                    counters.reshapes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let mut out = execute_on(w, &reshape, *device, vec![w.buffer(id)?])?;
                    order.push(Err(temps.len()));
                    temps.push(
                        out.pop().ok_or_else(|| TpuError::Execute {
                            message: "reshape returned nothing".into(),
                        })?,
                    );
                }
                _ => order.push(Ok(id)),
            }
        }
        orders.push(order);
    }
    let outs = {
        let mut refs = Vec::with_capacity(orders.len());
        for order in &orders {
            let mut r = Vec::with_capacity(order.len());
            for o in order {
                r.push(match o {
                    Ok(id) => w.buffer(*id)?,
                    Err(i) => &temps[*i],
                });
            }
            refs.push(r);
        }
        match (refs.len(), lists.first().map(|l| l.0)) {
            (1, Some(0)) => vec![w.rt.execute(exe, &refs[0])?],
            _ => w.rt.execute_replicated(exe, &refs)?,
        }
    };
    counters.executions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    drop(temps);
    Ok(outs
        .into_iter()
        .zip(&lists)
        .map(|(bufs, (device, _))| bufs.into_iter().map(|b| w.keep_on(b, *device)).collect())
        .collect())
}

/// Runs a one-replica program on `device` (compiled for it).
fn execute_on(
    w: &Worker,
    exe: &Executable,
    device: usize,
    args: Vec<&crate::DeviceBuffer>,
) -> Result<Vec<crate::DeviceBuffer>> {
    match device {
        0 => w.rt.execute(exe, &args),
        _ => Ok(w.rt.execute_replicated(exe, &[args])?.remove(0)),
    }
}

impl Worker {
    /// The program that gives a buffer other dims on `device` (same elements, row-major).
    fn reshape_program(
        &mut self,
        dtype: DType,
        from: &[i64],
        to: &[i64],
        device: usize,
    ) -> Result<std::rc::Rc<Executable>> {
        let ty = |dims: &[i64]| crate::hlo::TensorType::new(dtype, dims).to_string();
        let (a, b) = (ty(from), ty(to));
        let text = format!(
            "module {{\n  func.func public @main(%x: {a}) -> {b} {{\n    %y = stablehlo.reshape %x : ({a}) -> {b}\n    return %y : {b}\n  }}\n}}\n"
        );
        self.rt.compile_with(&text, &CompileOptions::default().on_devices_from(device))
    }
}
