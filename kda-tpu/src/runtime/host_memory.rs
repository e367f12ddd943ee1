//! Keeping freed host memory mapped, so executions on the CPU plugin do not page-fault.
//!
//! The CPU plugin allocates each execution's scratch (tens of MB for the KDA programs) with
//! `malloc` and frees it afterwards; the runtime has it execute on the calling thread, so the
//! block comes from that thread's arena (the main one for a program's main thread; a pool
//! thread's arena cannot hold blocks over 64 MB, and those always come from `mmap`). With glibc's defaults such blocks
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
    // From glibc's <malloc.h>.
    const M_TRIM_THRESHOLD: i32 = -1;
    const M_MMAP_MAX: i32 = -4;
    const M_ARENA_MAX: i32 = -8;
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    // SAFETY: mallopt only updates allocator parameters; it is thread-safe in glibc and every
    // value here is in its documented range.
    unsafe {
        mallopt(M_ARENA_MAX, 1) == 1
            && mallopt(M_MMAP_MAX, 0) == 1
            && mallopt(M_TRIM_THRESHOLD, i32::MAX) == 1
    }
}

/// Applies the glibc settings described in the module docs; a no-op returning `false` here.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn retain() -> bool {
    false
}
