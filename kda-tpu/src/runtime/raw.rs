//! The crate's FFI: every `unsafe` block of `kda-tpu` is here (the crate denies `unsafe_code`
//! elsewhere), each with a SAFETY note. Direct pjrt-sys calls for what pjrt 0.2.0 hides
//! (`peak_memory_in_bytes` of the compiled memory statistics, a panic-free cost analysis,
//! downloads without a zero-fill, the raw handles behind its buffers and executables), the bf16
//! host element pjrt lacks, and glibc's `mallopt`.

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::mem::{offset_of, size_of};
use std::path::Path;

use libloading::Library;
use pjrt::Client;
use pjrt_sys::*;

use crate::error::{compiler_message, Result, TpuError};

/// bf16 bit pattern as a pjrt host element (pjrt 0.2.0 lacks one); see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16Bits(pub(crate) u16);

// SAFETY: `Bf16Bits` is `repr(transparent)` over `u16`: every bit pattern is valid, zero
// included, and it has no padding; so a `Vec<half::bf16>` can be reused as one without a copy.
unsafe impl bytemuck::Zeroable for Bf16Bits {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for Bf16Bits {}

/// What `PJRT_Executable_GetCompiledMemoryStats` reports for the device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Generated code (0 on CPU).
    pub generated_code_bytes: i64,
    /// All arguments.
    pub argument_bytes: i64,
    /// All outputs.
    pub output_bytes: i64,
    /// Output bytes that alias arguments.
    pub alias_bytes: i64,
    /// Scratch space.
    pub temp_bytes: i64,
    /// The compiler's peak estimate (JAX's `memory_analysis().peak_memory_in_bytes`).
    pub peak_bytes: i64,
}

/// pjrt 0.2.0 keeps the raw pointer of `Buffer` / `LoadedExecutable` crate-private. Both are
/// `{ client: Client /* one Rc word */, ptr }`; the word equal to our client handle is the client,
/// the other is the pointer. Checked at run time (sizes, exactly one match): an error, never a guess.
pub(crate) fn paired_ptr<T, P>(client: &Client, value: &T) -> Result<*mut P> {
    let layout_changed =
        || TpuError::unsupported("pjrt version", "pjrt's Buffer/LoadedExecutable layout changed");
    if size_of::<T>() != 2 * size_of::<usize>() || size_of::<Client>() != size_of::<usize>() {
        return Err(layout_changed());
    }
    // SAFETY: both types are exactly pointer-sized words, all initialised (checked above).
    let words: [usize; 2] = unsafe { std::mem::transmute_copy(value) };
    // SAFETY: as above: `Client` is one initialised pointer-sized word.
    let client_word: usize = unsafe { std::mem::transmute_copy(client) };
    match (words[0] == client_word, words[1] == client_word) {
        (true, false) if words[1] != 0 => Ok(words[1] as *mut P),
        (false, true) if words[0] != 0 => Ok(words[0] as *mut P),
        _ => Err(layout_changed()),
    }
}

/// The plugin's `PJRT_Api` function table, reached by reopening the already loaded `.so`.
pub(crate) struct RawApi {
    api: *const PJRT_Api,
    _lib: Library,
}

/// A function pointer from the table, checking the plugin's table is long enough to hold it.
macro_rules! api_fn {
    ($self:expr, $field:ident) => {{
        // SAFETY: `api` came from GetPjrtApi of a library we keep open.
        let api = unsafe { &*$self.api };
        if offset_of!(PJRT_Api, $field) >= api.struct_size {
            Err(raw_err(stringify!($field), "not in this plugin's PJRT_Api"))
        } else {
            api.$field.ok_or_else(|| raw_err(stringify!($field), "null function pointer"))
        }
    }};
}

/// Calls a PJRT function with its args struct; a returned `PJRT_Error` becomes a `TpuError`.
macro_rules! call {
    ($self:expr, $field:ident, $args:expr) => {{
        let f = api_fn!($self, $field)?;
        // SAFETY: args built with pjrt-sys's `new()` (struct_size set), pointers owned by the caller.
        let err = unsafe { f($args) };
        $self.check(stringify!($field), err)
    }};
}

fn raw_err(call: &str, message: impl Into<String>) -> TpuError {
    TpuError::Execute { message: format!("{call}: {}", message.into()) }
}

impl RawApi {
    /// dlopen + `GetPjrtApi`. No `PJRT_Plugin_Initialize`: `pjrt::plugin(..).load()` did it.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let load_err = |e: libloading::Error| TpuError::PluginLoad {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        // SAFETY: the library is a PJRT plugin that pjrt has already loaded; dlopen returns it again.
        let lib = unsafe { Library::new(path) }.map_err(load_err)?;
        // SAFETY: `GetPjrtApi` has this signature in every PJRT plugin.
        let get: libloading::Symbol<unsafe extern "C" fn() -> *const PJRT_Api> =
            unsafe { lib.get(b"GetPjrtApi") }.map_err(load_err)?;
        // SAFETY: `GetPjrtApi` takes nothing and returns a pointer to a static table (or null,
        // checked below); the library stays open as long as `Self`.
        let api = unsafe { get() };
        if api.is_null() {
            return Err(TpuError::PluginLoad {
                path: path.display().to_string(),
                message: "GetPjrtApi returned null".into(),
            });
        }
        Ok(Self { api, _lib: lib })
    }

    fn check(&self, call: &str, err: *mut PJRT_Error) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let mut m = PJRT_Error_Message_Args::new();
        m.error = err;
        let message = match api_fn!(self, PJRT_Error_Message) {
            Ok(f) => {
                // SAFETY: `err` is a live PJRT_Error; the message lives until it is destroyed below.
                unsafe { f(&mut m) };
                // SAFETY: the plugin filled `message` / `message_size` with a live byte range.
                let bytes = unsafe { std::slice::from_raw_parts(m.message as *const u8, m.message_size) };
                String::from_utf8_lossy(bytes).into_owned()
            }
            Err(_) => "(no message)".to_string(),
        };
        if let Ok(f) = api_fn!(self, PJRT_Error_Destroy) {
            let mut d = PJRT_Error_Destroy_Args::new();
            d.error = err;
            // SAFETY: destroys the error we were handed, once.
            unsafe { f(&mut d) };
        }
        if message.contains("Unexpected") && message.contains("size") {
            return Err(TpuError::HeaderTooOld {
                bindings: (PJRT_API_MAJOR, PJRT_API_MINOR),
                plugin: self.version(),
                detail: message,
            });
        }
        Err(raw_err(call, message))
    }

    /// The plugin's PJRT C API version.
    pub(crate) fn version(&self) -> (i32, i32) {
        // SAFETY: a plain field read of the plugin's table.
        let v = unsafe { (*self.api).pjrt_api_version };
        (v.major_version, v.minor_version)
    }

    /// Memory statistics of a loaded executable (goes through `PJRT_LoadedExecutable_GetExecutable`).
    pub(crate) fn loaded_memory_stats(&self, loaded: *mut PJRT_LoadedExecutable) -> Result<MemoryStats> {
        let mut g = PJRT_LoadedExecutable_GetExecutable_Args::new();
        g.loaded_executable = loaded;
        call!(self, PJRT_LoadedExecutable_GetExecutable, &mut g)?;
        let stats = self.memory_stats(g.executable);
        self.destroy_executable(g.executable);
        stats
    }

    pub(crate) fn memory_stats(&self, exe: *mut PJRT_Executable) -> Result<MemoryStats> {
        let mut a = PJRT_Executable_GetCompiledMemoryStats_Args::new();
        a.executable = exe;
        call!(self, PJRT_Executable_GetCompiledMemoryStats, &mut a)?;
        Ok(MemoryStats {
            generated_code_bytes: a.generated_code_size_in_bytes,
            argument_bytes: a.argument_size_in_bytes,
            output_bytes: a.output_size_in_bytes,
            alias_bytes: a.alias_size_in_bytes,
            temp_bytes: a.temp_size_in_bytes,
            peak_bytes: a.peak_memory_in_bytes,
        })
    }

    /// Numeric properties of `PJRT_Executable_GetCostAnalysis` (others skipped; no panic on new kinds).
    pub(crate) fn cost_analysis(&self, exe: *mut PJRT_Executable) -> Result<BTreeMap<String, f64>> {
        let mut a = PJRT_Executable_GetCostAnalysis_Args::new();
        a.executable = exe;
        call!(self, PJRT_Executable_GetCostAnalysis, &mut a)?;
        let mut out = BTreeMap::new();
        if a.properties.is_null() {
            return Ok(out);
        }
        // SAFETY: the plugin owns `num_properties` entries for the executable's lifetime.
        let props = unsafe { std::slice::from_raw_parts(a.properties, a.num_properties) };
        for p in props {
            // SAFETY: each property's `name` / `name_size` is a byte range the plugin owns as above.
            let name = unsafe { std::slice::from_raw_parts(p.name as *const u8, p.name_size) };
            let value = if p.type_ == PJRT_NamedValue_Type_PJRT_NamedValue_kFloat {
                // SAFETY: `type_` says the union holds a float.
                f64::from(unsafe { p.__bindgen_anon_1.float_value })
            } else if p.type_ == PJRT_NamedValue_Type_PJRT_NamedValue_kInt64 {
                // SAFETY: `type_` says the union holds an int64.
                (unsafe { p.__bindgen_anon_1.int64_value }) as f64
            } else {
                continue;
            };
            out.insert(String::from_utf8_lossy(name).into_owned(), value);
        }
        Ok(out)
    }

    /// Downloads a buffer of `n` elements of `T` (the caller has matched `T` to its dtype).
    /// pjrt 0.2.0's own download zero-fills a fresh `Vec<u8>` first and hands back bytes that
    /// must be copied again to be read as `f32`; this writes once, into the returned vector.
    pub(crate) fn to_host_vec<T: bytemuck::Pod>(&self, buf: *mut PJRT_Buffer, n: usize) -> Result<Vec<T>> {
        let bytes = n.checked_mul(size_of::<T>()).ok_or_else(|| {
            raw_err("PJRT_Buffer_ToHostBuffer", format!("{n} elements overflow a byte count"))
        })?;
        let mut out: Vec<T> = Vec::new();
        out.try_reserve_exact(n).map_err(|e| {
            raw_err("PJRT_Buffer_ToHostBuffer", format!("a host array of {bytes} bytes: {e}"))
        })?;
        // SAFETY: the spare capacity holds at least `n` elements of `T`, i.e. `bytes` bytes;
        // viewing uninitialised memory as `MaybeUninit<u8>` is always allowed.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                out.spare_capacity_mut().as_mut_ptr().cast::<std::mem::MaybeUninit<u8>>(),
                bytes,
            )
        };
        self.to_host(buf, dst)?;
        // SAFETY: `to_host` returned Ok only after writing exactly `bytes` bytes (it checks the
        // plugin's size against `dst`), and every bit pattern is a valid `T` (`Pod`).
        unsafe { out.set_len(n) };
        Ok(out)
    }

    /// Copies a buffer's dense row-major bytes into `dst`, which must be exactly its size, and
    /// waits for the copy.
    fn to_host(&self, buf: *mut PJRT_Buffer, dst: &mut [std::mem::MaybeUninit<u8>]) -> Result<()> {
        let mut args = PJRT_Buffer_ToHostBuffer_Args::new();
        args.src = buf;
        // A null `dst` asks for the size.
        call!(self, PJRT_Buffer_ToHostBuffer, &mut args)?;
        if args.dst_size != dst.len() {
            return Err(raw_err(
                "PJRT_Buffer_ToHostBuffer",
                format!("the buffer holds {} bytes, the host array {}", args.dst_size, dst.len()),
            ));
        }
        args.dst = dst.as_mut_ptr().cast();
        call!(self, PJRT_Buffer_ToHostBuffer, &mut args)?;
        if args.event.is_null() {
            return Ok(());
        }
        let mut wait = PJRT_Event_Await_Args::new();
        wait.event = args.event;
        let waited = call!(self, PJRT_Event_Await, &mut wait);
        let mut d = PJRT_Event_Destroy_Args::new();
        d.event = args.event;
        let _: Result<()> = (|| call!(self, PJRT_Event_Destroy, &mut d))();
        waited
    }

    /// The optimized program of `exe` (a serialized `HloModuleProto` on the plugins here).
    pub(crate) fn optimized_program(&self, exe: *mut PJRT_Executable) -> Result<Vec<u8>> {
        let mut prog = PJRT_Program::new();
        let mut args = PJRT_Executable_OptimizedProgram_Args::new();
        args.executable = exe;
        args.program = &mut prog;
        // A null `code` asks for the size.
        call!(self, PJRT_Executable_OptimizedProgram, &mut args)?;
        let mut code = vec![0u8; prog.code_size];
        prog.code = code.as_mut_ptr() as *mut c_char;
        args.program = &mut prog;
        call!(self, PJRT_Executable_OptimizedProgram, &mut args)?;
        code.truncate(prog.code_size);
        Ok(code)
    }

    pub(crate) fn destroy_executable(&self, exe: *mut PJRT_Executable) {
        let mut d = PJRT_Executable_Destroy_Args::new();
        d.executable = exe;
        // Nothing useful to do if destroying fails; the error itself is freed by `check`.
        let _: Result<()> = (|| call!(self, PJRT_Executable_Destroy, &mut d))();
    }

    /// How many devices the TPU topology `topology` describes (libtpu, deviceless).
    pub(crate) fn topology_device_count(&self, topology: &str) -> Result<usize> {
        let mut t = PJRT_TopologyDescription_Create_Args::new();
        t.topology_name = topology.as_ptr() as *const c_char;
        t.topology_name_size = topology.len();
        call!(self, PJRT_TopologyDescription_Create, &mut t)?;
        let mut g = PJRT_TopologyDescription_GetDeviceDescriptions_Args::new();
        g.topology = t.topology;
        let counted =
            call!(self, PJRT_TopologyDescription_GetDeviceDescriptions, &mut g).map(|_| g.num_descriptions);
        let mut d = PJRT_TopologyDescription_Destroy_Args::new();
        d.topology = t.topology;
        let _: Result<()> = (|| call!(self, PJRT_TopologyDescription_Destroy, &mut d))();
        counted
    }

    /// Deviceless compile of MLIR text for `topology`; `f` reads the executable before it is freed.
    pub(crate) fn compile_for_topology<T>(
        &self,
        topology: &str,
        mlir: &str,
        compile_options: &[u8],
        f: impl FnOnce(&Self, *mut PJRT_Executable) -> Result<T>,
    ) -> Result<T> {
        self.compile_deviceless(topology, &[], mlir, compile_options, f)
    }

    /// Deviceless compile of MLIR text for the topology named `topology` and described by the
    /// string create options `described` (the CUDA plugin's `topology` and `target_config`).
    pub(crate) fn compile_deviceless<T>(
        &self,
        topology: &str,
        described: &[(&str, &str)],
        mlir: &str,
        compile_options: &[u8],
        f: impl FnOnce(&Self, *mut PJRT_Executable) -> Result<T>,
    ) -> Result<T> {
        let named: Vec<PJRT_NamedValue> = described
            .iter()
            .map(|(name, value)| {
                let mut v = PJRT_NamedValue::new();
                v.name = name.as_ptr() as *const c_char;
                v.name_size = name.len();
                v.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kString;
                v.__bindgen_anon_1.string_value = value.as_ptr() as *const c_char;
                v.value_size = value.len();
                v
            })
            .collect();
        let mut t = PJRT_TopologyDescription_Create_Args::new();
        t.topology_name = topology.as_ptr() as *const c_char;
        t.topology_name_size = topology.len();
        t.create_options = named.as_ptr();
        t.num_options = named.len();
        call!(self, PJRT_TopologyDescription_Create, &mut t).map_err(|e| match e {
            TpuError::Execute { message } => {
                TpuError::unsupported(format!("deviceless topology `{topology}`"), message)
            }
            other => other,
        })?;
        let topo = t.topology;
        let result = (|| {
            const FORMAT: &[u8] = b"mlir";
            let mut prog = PJRT_Program::new();
            prog.code = mlir.as_ptr() as *mut c_char;
            prog.code_size = mlir.len();
            prog.format = FORMAT.as_ptr() as *const c_char;
            prog.format_size = FORMAT.len();
            let mut c = PJRT_Compile_Args::new();
            c.topology = topo;
            c.program = &prog;
            c.compile_options = compile_options.as_ptr() as *const c_char;
            c.compile_options_size = compile_options.len();
            c.client = std::ptr::null_mut();
            call!(self, PJRT_Compile, &mut c).map_err(|e| match e {
                TpuError::Execute { message } => TpuError::Compile { message: compiler_message(&message) },
                other => other,
            })?;
            let out = f(self, c.executable);
            self.destroy_executable(c.executable);
            out
        })();
        let mut d = PJRT_TopologyDescription_Destroy_Args::new();
        d.topology = topo;
        let _: Result<()> = (|| call!(self, PJRT_TopologyDescription_Destroy, &mut d))();
        result
    }
}

impl RawApi {
    /// Runs `loaded` once on every device of its device assignment: `args[d]` are device `d`'s
    /// arguments (on that device), and each device gets its own `num_outputs` result slots
    /// (pjrt 0.2.0 hands every device the same output array, so all but one device's results
    /// are lost there). Inputs are never donated. Waits for every device to finish.
    pub(crate) fn execute_replicated(
        &self,
        loaded: *mut PJRT_LoadedExecutable,
        args: &[Vec<*mut PJRT_Buffer>],
        num_outputs: usize,
    ) -> Result<Vec<Vec<*mut PJRT_Buffer>>> {
        let devices = args.len();
        let num_args = args.first().map_or(0, Vec::len);
        if args.iter().any(|a| a.len() != num_args) {
            return Err(raw_err(
                "PJRT_LoadedExecutable_Execute",
                "every device needs the same argument count",
            ));
        }
        let arg_lists: Vec<*const *mut PJRT_Buffer> = args.iter().map(|a| a.as_ptr()).collect();
        let mut outputs: Vec<Vec<*mut PJRT_Buffer>> =
            (0..devices).map(|_| vec![std::ptr::null_mut(); num_outputs]).collect();
        let mut output_lists: Vec<*mut *mut PJRT_Buffer> =
            outputs.iter_mut().map(|o| o.as_mut_ptr()).collect();
        let mut events: Vec<*mut PJRT_Event> = vec![std::ptr::null_mut(); devices];
        let keep: Vec<i64> = (0..num_args as i64).collect();
        let mut options = PJRT_ExecuteOptions::new();
        options.non_donatable_input_indices = keep.as_ptr();
        options.num_non_donatable_input_indices = keep.len();
        let mut a = PJRT_LoadedExecutable_Execute_Args::new();
        a.executable = loaded;
        a.options = &mut options;
        a.num_devices = devices;
        a.num_args = num_args;
        a.argument_lists = arg_lists.as_ptr();
        a.output_lists = output_lists.as_mut_ptr();
        a.device_complete_events = events.as_mut_ptr();
        call!(self, PJRT_LoadedExecutable_Execute, &mut a)?;
        let mut first_err = Ok(());
        for event in events.into_iter().filter(|e| !e.is_null()) {
            let mut wait = PJRT_Event_Await_Args::new();
            wait.event = event;
            let waited = call!(self, PJRT_Event_Await, &mut wait);
            if first_err.is_ok() {
                first_err = waited;
            }
            let mut d = PJRT_Event_Destroy_Args::new();
            d.event = event;
            let _: Result<()> = (|| call!(self, PJRT_Event_Destroy, &mut d))();
        }
        let missing = outputs.iter().flatten().any(|p| p.is_null());
        if first_err.is_err() || missing {
            // No caller will own these: free what the plugin did return.
            for &p in outputs.iter().flatten().filter(|p| !p.is_null()) {
                let mut d = PJRT_Buffer_Destroy_Args::new();
                d.buffer = p;
                let _: Result<()> = (|| call!(self, PJRT_Buffer_Destroy, &mut d))();
            }
        }
        first_err?;
        if missing {
            return Err(raw_err(
                "PJRT_LoadedExecutable_Execute",
                "a device returned no buffer for an output",
            ));
        }
        Ok(outputs)
    }
}

/// glibc's `M_TRIM_THRESHOLD` (`<malloc.h>`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) const M_TRIM_THRESHOLD: i32 = -1;
/// glibc's `M_MMAP_MAX`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) const M_MMAP_MAX: i32 = -4;
/// glibc's `M_ARENA_MAX`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) const M_ARENA_MAX: i32 = -8;

/// glibc's `mallopt(param, value)`; true when it took the setting.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn mallopt(param: i32, value: i32) -> bool {
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    // SAFETY: mallopt only updates allocator parameters and is thread-safe in glibc; an
    // unknown parameter or a value out of range makes it return 0, never misbehave.
    unsafe { mallopt(param, value) == 1 }
}
