//! Keeping freed host memory mapped, so executions on the CPU plugin do not page-fault.
//!
//! The CPU plugin allocates each execution's scratch (tens of MB for the KDA programs) with
//! `malloc` and frees it afterwards; the runtime has it execute on the calling thread, so the
//! block comes from that thread's arena (the main one for a program's main thread; a pool
//! thread's arena cannot hold blocks over 64 MiB, and those always come from `mmap`). With glibc's defaults such blocks
//! come from `mmap` and go straight back to the kernel, so every run touches fresh pages that
//! the kernel must fault in and zero: about half of the CPU time of a fused forward+VJP at the
//! benchmark shape. [`retain`] tells glibc to serve every block from the main heap and never
//! return it (`M_ARENA_MAX = 1`, `M_MMAP_MAX = 0`, `M_TRIM_THRESHOLD = 2 GiB`), so scratch is
//! reused warm. The cost is that the whole process keeps its high-water heap, so nothing in
//! this crate calls [`retain`] unless asked ([`crate::PjrtOptions::retain_host_memory`]); the
//! benchmarks and the demo ask. It is a no-op off glibc.

/// Applies the glibc settings described in the module docs; returns whether they took effect.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn retain() -> bool {
    use super::raw::{mallopt, M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD};
    mallopt(M_ARENA_MAX, 1) && mallopt(M_MMAP_MAX, 0) && mallopt(M_TRIM_THRESHOLD, i32::MAX)
}

/// Applies the glibc settings described in the module docs; a no-op returning `false` here.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn retain() -> bool {
    false
}
