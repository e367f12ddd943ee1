//! The device worker: one thread that owns the PJRT runtime (whose objects must stay on the
//! thread that made them) and runs every call of every clone of a handle, in arrival order.
//!
//! Callers send a job and block on its reply. A job that panics poisons the worker: its caller
//! gets [`TpuError::Panic`], and every later call, by any clone, gets [`TpuError::Poisoned`].
//! The worker ends when the last handle, tensor, program or residual that refers to it is dropped.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, ThreadId};

use super::options::{PjrtOptions, Split};
use crate::error::{Result, TpuError};
use crate::op::ProgramSpec;
use crate::runtime::{DeviceBuffer, Executable, Runtime};
use crate::ProgramKind;

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// What the worker thread owns: the runtime, the buffers behind live device tensors, and the
/// compiled programs.
pub(crate) struct Worker {
    pub(crate) rt: Runtime,
    buffers: HashMap<u64, DeviceBuffer>,
    next_id: u64,
    /// Kernel programs by (spec, kind, replicas, first device, form).
    pub(crate) programs: HashMap<(ProgramSpec, ProgramKind, usize, usize, Split), Rc<Executable>>,
    /// Programs compiled for a caller ([`super::DeviceProgram`]), by id.
    pub(crate) user_programs: HashMap<u64, Rc<Executable>>,
}

impl Worker {
    /// Keeps `buf`, which lives on device `device` of the handle, behind a new id.
    pub(crate) fn keep_on(&mut self, buf: DeviceBuffer, device: usize) -> BufferInfo {
        self.next_id += 1;
        let info = BufferInfo { id: self.next_id, dtype: buf.dtype(), dims: buf.dims().to_vec(), device };
        self.buffers.insert(self.next_id, buf);
        info
    }

    /// Drops the buffer behind `id` (an argument uploaded for one run).
    pub(crate) fn forget(&mut self, id: u64) {
        self.buffers.remove(&id);
    }

    /// The buffer behind `id`.
    pub(crate) fn buffer(&self, id: u64) -> Result<&DeviceBuffer> {
        self.buffers.get(&id).ok_or_else(|| TpuError::Execute {
            message: format!("device tensor {id} is not held by this handle's worker"),
        })
    }

    /// Keeps a compiled caller program behind a new id.
    pub(crate) fn keep_program(&mut self, exe: Rc<Executable>) -> u64 {
        self.next_id += 1;
        self.user_programs.insert(self.next_id, exe);
        self.next_id
    }

    /// The kernel program of `spec` and `kind` in the form `split` for the replicas and devices
    /// of `options`, compiled on first use; `true` when it was cached.
    pub(crate) fn kernel(
        &mut self,
        spec: &ProgramSpec,
        kind: ProgramKind,
        options: &crate::runtime::CompileOptions,
        split: Split,
    ) -> Result<(Rc<Executable>, bool)> {
        let replicas = options.replicas();
        let key = (spec.clone(), kind, replicas, options.first_device(), split);
        if let Some(x) = self.programs.get(&key) {
            return Ok((x.clone(), true));
        }
        let text = match split {
            Split::Context => crate::op::context_parallel::context_parallel_program(spec, kind, replicas)?,
            _ => crate::op::data_parallel_program(spec, kind, replicas)?,
        };
        let exe = self.rt.compile_with(&text, options)?;
        self.programs.insert(key, exe.clone());
        Ok((exe, false))
    }
}

/// A buffer as the caller sees it: its id in the worker and its type.
#[derive(Debug, Clone)]
pub(crate) struct BufferInfo {
    pub(crate) id: u64,
    pub(crate) dtype: kda_core::DType,
    pub(crate) dims: Vec<i64>,
    pub(crate) device: usize,
}

/// The plugin a worker loaded.
#[derive(Debug, Clone)]
pub(crate) struct RuntimeInfo {
    pub(crate) platform: String,
    /// The first device's compute capability, where the plugin reports one.
    pub(crate) compute_capability: Option<String>,
    /// The first device's kind.
    pub(crate) device_kind: String,
    pub(crate) plugin_path: PathBuf,
    pub(crate) plugin_version: (i32, i32),
    pub(crate) devices: usize,
}

/// Why a worker stopped, shared by the worker and every caller.
#[derive(Debug, Default)]
struct Poison(Mutex<Option<String>>);

impl Poison {
    fn set(&self, message: String) {
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        p.get_or_insert(message);
    }
    fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Counters of the bytes copied between host and device, over all clones of a handle.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) to_device: AtomicU64,
    pub(crate) to_host: AtomicU64,
    pub(crate) executions: AtomicU64,
    pub(crate) reshapes: AtomicU64,
}

/// What every clone of a handle, and every tensor, shares: the channel to the worker.
pub(crate) struct Shared {
    /// Tells handles apart (a tensor of one handle used with another is an error).
    pub(crate) id: u64,
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    thread_id: ThreadId,
    poison: Arc<Poison>,
    pub(crate) info: RuntimeInfo,
    pub(crate) counters: Arc<Counters>,
}

static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic payload)".to_string())
}

impl Shared {
    /// Starts a worker thread that loads the plugin of `options`.
    pub(crate) fn start(options: &PjrtOptions) -> Result<Arc<Self>> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<RuntimeInfo>>(1);
        let poison = Arc::new(Poison::default());
        let counters = Arc::new(Counters::default());
        let opts = options.clone();
        let worker_poison = poison.clone();
        let thread = std::thread::Builder::new()
            .name("kda-pjrt".to_string())
            .spawn(move || run(opts, rx, ready_tx, worker_poison))
            .map_err(|e| TpuError::PluginLoad {
                path: "(worker thread)".to_string(),
                message: format!("cannot start the device worker thread: {e}"),
            })?;
        let info = match ready_rx.recv() {
            Ok(r) => r?,
            Err(_) => {
                return Err(TpuError::Poisoned {
                    message: poison.get().unwrap_or_else(|| "the worker stopped while starting".into()),
                })
            }
        };
        let thread_id = thread.thread().id();
        Ok(Arc::new(Shared {
            id: NEXT_HANDLE.fetch_add(1, Ordering::Relaxed),
            tx: Some(tx),
            thread: Some(thread),
            thread_id,
            poison,
            info,
            counters,
        }))
    }

    /// The error every call gets once the worker has stopped after a panic.
    pub(crate) fn check(&self) -> Result<()> {
        match self.poison.get() {
            Some(message) => Err(TpuError::Poisoned { message }),
            None => Ok(()),
        }
    }

    /// Runs `f` on the worker and waits for its result. The caller's tracing span is entered on
    /// the worker, so compile, transfer and execute spans nest under the call that caused them.
    pub(crate) fn call<R: Send + 'static>(
        &self,
        stage: &'static str,
        f: impl FnOnce(&mut Worker) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        self.submit(stage, f)?.wait()
    }

    /// Sends `f` to the worker without waiting; [`Pending::wait`] gets its result. Lets the
    /// caller prepare the next job's host data while the worker runs this one.
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        stage: &'static str,
        f: impl FnOnce(&mut Worker) -> Result<R> + Send + 'static,
    ) -> Result<Pending<'_, R>> {
        self.check()?;
        let (reply_tx, reply_rx) = mpsc::sync_channel::<Result<R>>(1);
        let poison = self.poison.clone();
        let span = tracing::Span::current();
        let job: Job = Box::new(move |w: &mut Worker| {
            let _entered = span.enter();
            let result = match catch_unwind(AssertUnwindSafe(|| f(w))) {
                Ok(r) => r,
                Err(payload) => {
                    let message = panic_message(payload.as_ref());
                    poison.set(format!("{stage}: {message}"));
                    Err(TpuError::Panic { stage: stage.to_string(), message })
                }
            };
            let _ = reply_tx.send(result);
        });
        self.tx.as_ref().ok_or_else(|| self.stopped())?.send(job).map_err(|_| self.stopped())?;
        Ok(Pending { shared: self, reply: reply_rx })
    }

    fn stopped(&self) -> TpuError {
        TpuError::Poisoned {
            message: self.poison.get().unwrap_or_else(|| "the device worker has stopped".to_string()),
        }
    }

    /// Frees the buffer (or program) behind `id`, without waiting. A no-op after the worker stopped.
    pub(crate) fn free(&self, id: u64, program: bool) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Box::new(move |w: &mut Worker| {
                if program {
                    w.user_programs.remove(&id);
                } else {
                    w.buffers.remove(&id);
                }
            }));
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop after the jobs already queued; joining
        // makes the plugin's objects go before the handle does (not from the worker itself,
        // which can hold the last reference inside a job).
        drop(self.tx.take());
        if std::thread::current().id() != self.thread_id {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// A job sent to the worker whose result has not been read yet.
pub(crate) struct Pending<'a, R> {
    shared: &'a Shared,
    reply: Receiver<Result<R>>,
}

impl<R> Pending<'_, R> {
    /// Blocks until the job has run; a worker that stopped before replying is an error.
    pub(crate) fn wait(self) -> Result<R> {
        self.reply.recv().map_err(|_| self.shared.stopped())?
    }
}

/// The worker thread: load the plugin, report, then run jobs until every sender is gone or a
/// job panicked.
fn run(
    options: PjrtOptions,
    rx: Receiver<Job>,
    ready: mpsc::SyncSender<Result<RuntimeInfo>>,
    poison: Arc<Poison>,
) {
    let started = catch_unwind(AssertUnwindSafe(|| options.runtime()));
    let rt = match started {
        Ok(Ok(rt)) => rt,
        Ok(Err(e)) => {
            let _ = ready.send(Err(e));
            return;
        }
        Err(payload) => {
            let _ = ready.send(Err(TpuError::Panic {
                stage: "plugin load".to_string(),
                message: panic_message(payload.as_ref()),
            }));
            return;
        }
    };
    let info = RuntimeInfo {
        platform: rt.platform().to_string(),
        compute_capability: rt.compute_capability().map(str::to_string),
        device_kind: rt.device_kind().to_string(),
        plugin_path: rt.plugin_path().to_path_buf(),
        plugin_version: rt.plugin_version(),
        devices: rt.device_count(),
    };
    let mut worker = Worker {
        rt,
        buffers: HashMap::new(),
        next_id: 0,
        programs: HashMap::new(),
        user_programs: HashMap::new(),
    };
    if ready.send(Ok(info)).is_err() {
        return;
    }
    for job in rx {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| job(&mut worker))) {
            poison.set(panic_message(payload.as_ref()));
        }
        if poison.get().is_some() {
            break;
        }
    }
    // Plugin objects are released here, on the thread that made them; a panic while doing so
    // (pjrt `expect`s its destroy calls) must not take the process down.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(worker)));
}
