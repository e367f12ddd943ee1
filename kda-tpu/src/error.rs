//! The crate's one error type: contract errors from kda-core plus what can go wrong with a PJRT plugin.
//! Every variant converts into [`KdaError`] with a message that says what to do.

use std::fmt;

use kda_core::KdaError;

/// The crate's result alias.
pub type Result<T, E = TpuError> = std::result::Result<T, E>;

/// How to get a header and plugins that fit: the setup command and the build variable it prints.
pub const SETUP_HINT: &str = "run `cargo xtask setup`, then build through `cargo xtask ...` or after \
`eval \"$(cargo xtask env)\"` (it sets BINDGEN_EXTRA_CLANG_ARGS so pjrt-sys is rebuilt against the \
setup's pjrt_c_api.h)";

/// Everything that can fail in kda-tpu.
#[derive(Debug, Clone, PartialEq)]
pub enum TpuError {
    /// A contract violation (shape, dtype, value) found before anything reached the plugin.
    Contract(KdaError),
    /// No plugin file at `path`; `hint` says where the path came from (env var or setup folder).
    PluginNotFound {
        /// The plugin the caller asked for ("CPU PJRT plugin", "libtpu").
        what: String,
        /// The path that was tried.
        path: String,
        /// Where the path came from and how to fix it.
        hint: String,
    },
    /// The plugin could not be loaded or initialised (dlopen, GetPjrtApi, PJRT_Plugin_Initialize).
    PluginLoad {
        /// The plugin file.
        path: String,
        /// The loader's message.
        message: String,
    },
    /// pjrt-sys was built against a PJRT C API header too old for the plugin.
    HeaderTooOld {
        /// `PJRT_API_MAJOR.MINOR` of the bindings.
        bindings: (u32, u32),
        /// The plugin's `pjrt_api_version`.
        plugin: (i32, i32),
        /// The plugin's own complaint, if it made one.
        detail: String,
    },
    /// The compiler rejected the program; `message` is its first lines (with `-:LINE:COL`).
    Compile {
        /// The compiler's message.
        message: String,
    },
    /// A host<->device copy failed.
    Transfer {
        /// What was being copied.
        what: String,
        /// The plugin's message.
        message: String,
    },
    /// Execution failed in the plugin.
    Execute {
        /// The plugin's message.
        message: String,
    },
    /// The StableHLO builder refused an op (operand types that do not fit).
    Builder {
        /// The op being built (`dot_general`, ...).
        op: String,
        /// What was wrong.
        message: String,
    },
    /// The request is valid but not supported by this backend or plugin.
    Unsupported {
        /// The feature asked for.
        what: String,
        /// Why, and what to do instead.
        message: String,
    },
    /// The handle's device worker stopped after a panic; every later call on it (and on its
    /// clones, tensors and residuals) returns this.
    Poisoned {
        /// The panic that stopped it.
        message: String,
    },
    /// A pjrt call panicked (an `expect` inside the crate) and was caught at our boundary.
    Panic {
        /// The operation that was running.
        stage: String,
        /// The panic message.
        message: String,
    },
}

impl TpuError {
    /// A dtype/shape/value contract error (wraps a [`KdaError`]).
    pub fn contract(err: KdaError) -> Self {
        TpuError::Contract(err)
    }
    /// An unsupported request.
    pub fn unsupported(what: impl Into<String>, message: impl Into<String>) -> Self {
        TpuError::Unsupported { what: what.into(), message: message.into() }
    }
    /// A builder error for `op`.
    pub fn builder(op: impl Into<String>, message: impl Into<String>) -> Self {
        TpuError::Builder { op: op.into(), message: message.into() }
    }
}

impl fmt::Display for TpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TpuError::Contract(e) => write!(f, "{e}"),
            TpuError::PluginNotFound { what, path, hint } => write!(f, "{what} not found at {path}: {hint}"),
            TpuError::PluginLoad { path, message } => write!(f, "cannot load PJRT plugin {path}: {message}"),
            TpuError::HeaderTooOld { bindings, plugin, detail } => {
                write!(
                    f,
                    "pjrt-sys was built against PJRT C API {}.{}, too old for the plugin ({}.{}); ",
                    bindings.0, bindings.1, plugin.0, plugin.1
                )?;
                if !detail.is_empty() {
                    write!(f, "plugin says: {detail}; ")?;
                }
                write!(f, "{SETUP_HINT}")
            }
            TpuError::Compile { message } => write!(f, "compile failed: {message}"),
            TpuError::Transfer { what, message } => write!(f, "transfer of {what} failed: {message}"),
            TpuError::Execute { message } => write!(f, "execute failed: {message}"),
            TpuError::Builder { op, message } => write!(f, "cannot build `{op}`: {message}"),
            TpuError::Unsupported { what, message } => write!(f, "unsupported {what}: {message}"),
            TpuError::Panic { stage, message } => write!(f, "pjrt panicked during {stage}: {message}"),
            TpuError::Poisoned { message } => {
                write!(f, "the device worker stopped after a panic ({message}); create a new handle")
            }
        }
    }
}

impl std::error::Error for TpuError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TpuError::Contract(e) => Some(e),
            _ => None,
        }
    }
}

impl From<KdaError> for TpuError {
    fn from(e: KdaError) -> Self {
        TpuError::Contract(e)
    }
}

/// A pjrt error outside a known stage; the stage-specific constructors are in [`pjrt_message`] users.
#[cfg(feature = "runtime")]
impl From<pjrt::Error> for TpuError {
    fn from(e: pjrt::Error) -> Self {
        TpuError::Execute { message: pjrt_message(&e) }
    }
}

impl From<TpuError> for KdaError {
    /// Contract errors come back as they were; every other variant becomes a `Backend` (or
    /// `Unsupported`, `Shape`) error whose [`std::error::Error::source`] is the [`TpuError`].
    fn from(e: TpuError) -> Self {
        let msg = e.to_string();
        let converted = match &e {
            TpuError::Contract(k) => return k.clone(),
            TpuError::Builder { op, message } => KdaError::shape(op, "operands that fit the op", message),
            TpuError::Unsupported { what, message } => KdaError::unsupported(what, message, "this request"),
            TpuError::PluginNotFound { .. } | TpuError::PluginLoad { .. } => {
                KdaError::backend("plugin load", SETUP_HINT, msg)
            }
            TpuError::HeaderTooOld { .. } => KdaError::backend("plugin load", SETUP_HINT, msg),
            TpuError::Compile { .. } => {
                KdaError::backend("compile", "fix the program at the reported -:LINE:COL", msg)
            }
            TpuError::Transfer { .. } => KdaError::backend("transfer", "check dtype, shape and device", msg),
            TpuError::Execute { .. } => {
                KdaError::backend("execute", "check the inputs against the program", msg)
            }
            TpuError::Panic { .. } => {
                KdaError::backend("pjrt call", "report this; the pjrt crate panicked", msg)
            }
            TpuError::Poisoned { .. } => {
                KdaError::backend("device worker", "create a new handle; this one stopped after a panic", msg)
            }
        };
        converted.with_source(e)
    }
}

/// pjrt's message without the backtrace its `Display` appends, and with the plugin's
/// "Failed to parse using StableHLO ..." boilerplate tail dropped when a real diagnostic precedes it.
#[cfg(feature = "runtime")]
pub fn pjrt_message(e: &pjrt::Error) -> String {
    match e {
        pjrt::Error::PjrtError { msg, code, .. } => format!("{} ({code:?})", compiler_message(msg)),
        other => other.to_string(),
    }
}

/// A plugin message without blank lines and without the "Failed to parse using StableHLO ..." tail
/// (kept only if it is all there is); at most 12 lines.
pub fn compiler_message(msg: &str) -> String {
    let lines: Vec<&str> = msg.lines().filter(|l| !l.trim().is_empty()).collect();
    let keep: Vec<&str> =
        lines.iter().copied().filter(|l| !l.contains("Failed to parse using StableHLO")).take(12).collect();
    if keep.is_empty() {
        lines.join("\n")
    } else {
        keep.join("\n")
    }
}

/// Whether a plugin error is its complaint about a struct size (header older than the plugin).
#[cfg(feature = "runtime")]
pub(crate) fn is_struct_size_complaint(e: &pjrt::Error) -> bool {
    matches!(e, pjrt::Error::PjrtError { msg, .. } if msg.contains("Unexpected") && msg.contains("size"))
}

#[cfg(test)]
mod tests {
    use kda_core::ErrorKind;

    use super::*;

    #[test]
    fn header_too_old_says_how_to_rebuild() {
        let e = TpuError::HeaderTooOld { bindings: (0, 54), plugin: (0, 115), detail: String::new() };
        let text = e.to_string();
        assert!(
            text.contains("0.54") && text.contains("0.115") && text.contains("cargo xtask setup"),
            "{text}"
        );
        assert!(text.contains("eval \"$(cargo xtask env)\""), "{text}");
        assert_eq!(KdaError::from(e).kind(), ErrorKind::Backend);
    }

    #[test]
    fn kinds_map_into_kda_error() {
        let shape = KdaError::shape("q", "[1, 64, 4, 128]", "[1, 64, 4]");
        assert_eq!(KdaError::from(TpuError::from(shape.clone())), shape);
        assert_eq!(KdaError::from(TpuError::unsupported("K", "K <= 256")).kind(), ErrorKind::Unsupported);
        assert_eq!(KdaError::from(TpuError::builder("add", "f32 vs bf16")).kind(), ErrorKind::Shape);
    }

    #[test]
    fn compiler_message_drops_boilerplate() {
        let msg = "-:3:8: error: custom op 'stablehlo.frobnicate' is unknown\n\n<unknown>:0: error: Failed to parse using StableHLO v1.20.0, this could indicate ...";
        assert_eq!(compiler_message(msg), "-:3:8: error: custom op 'stablehlo.frobnicate' is unknown");
    }
}
