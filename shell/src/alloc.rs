//! The C allocator's bounds: set once at start, and a trim after a large block of work.
//!
//! In: nothing. Out: glibc's malloc limited to [`ARENA_MAX`] arenas with a fixed mmap
//! threshold ([`bound`], called by `entry::run` before the runtime starts its threads), and
//! [`trim`], which hands the free pages of every arena back to the kernel.
//!
//! Why: glibc gives a thread that finds the arenas busy an arena of its own, up to 8 per
//! core, and keeps what is freed in each. A webhook with a worker per core that decodes a
//! 3 MB review on each of them in turn keeps each review's memory in a different arena: on a
//! node of many cores that is several times the budget held while idle (measured:
//! docs/webhook.md, "Memory at any core count"). Fixing the mmap threshold also stops glibc
//! from raising it after a large block is freed, so a review's body buffer stays a mapping
//! of its own, returned whole when freed. Elsewhere (musl, other targets) both do nothing.

/// Arenas glibc may create, whatever the core count: the daemons' hot paths allocate little
/// at once, so a few arenas are shared by their threads without waiting for each other long.
pub const ARENA_MAX: i32 = 2;

/// Blocks from this size up are mappings of their own, returned to the kernel when freed.
pub const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Sets [`ARENA_MAX`] and [`MMAP_THRESHOLD`]; before any other thread starts.
pub fn bound() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets malloc's parameters; called before other threads allocate.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Returns the free memory of every arena to the kernel: after a block of work that
/// allocated much and freed it (a large review), so the process is not left holding it.
/// Takes each arena's lock in turn; a few milliseconds at most for the webhook's heaps.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim is thread-safe and only releases free pages.
    unsafe {
        libc::malloc_trim(0);
    }
}
