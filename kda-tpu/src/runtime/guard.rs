//! The panic boundary: pjrt 0.2.0 `expect`s on many C-API calls (about 100 sites); every runtime
//! operation runs inside [`guarded`] so such a panic becomes a [`TpuError::Panic`] instead of unwinding
//! into the caller. Needs `panic = "unwind"` (the default); the default hook still prints the panic.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Result, TpuError};

/// Runs `f`, turning a panic inside it into [`TpuError::Panic`] for `stage`.
pub(crate) fn guarded<T>(stage: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // AssertUnwindSafe: after a panic we only return an error; the pjrt objects touched are either
    // dropped by the unwinding or left as they were (pjrt keeps no shared mutable state of its own).
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "(non-string panic payload)".to_string());
            Err(TpuError::Panic { stage: stage.to_string(), message })
        }
    }
}
