//! What an idle agent holds: the memory finished migrations freed goes back to the system.
//!
//! A migration allocates in proportion to its guest (the codec's page history is one 4 KiB
//! allocation per guest page) from every thread of the runtime. glibc gives each thread that
//! contends an arena of its own, and `malloc_trim` cannot shrink the top of those arenas: an
//! agent idled at 85-94 MiB after 30 migrations of a 256 MiB guest, with under 1 MB in use.
//! With one arena, `malloc_trim` returns it all: 16-17 MiB idle after the same 30, and
//! migrations no slower (their median 1,090 ms against 1,185 ms; docs/testing.md, "The soak").

/// Makes glibc serve every thread from one arena. Called before the agent's threads start.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn one_malloc_arena() {
    // SAFETY: mallopt only sets glibc's allocator parameters; it touches no memory in use.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn one_malloc_arena() {}

/// Returns glibc's free pages to the system (blocking: it walks the heap).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn release_free() {
    // SAFETY: malloc_trim only returns glibc's free pages to the kernel; it touches no memory
    // in use and is safe to call from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free() {}
