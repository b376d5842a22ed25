//! Giving freed heap memory back to the operating system.
//!
//! glibc's malloc keeps memory freed by other threads in per-thread arenas
//! and returns it to the system only from the top of the main heap, so
//! after a burst of connections or large records a process stays at its
//! peak RSS although the memory is free. `malloc_trim(0)` releases the free
//! pages of every arena, but not the free top of the arenas of other
//! threads; and glibc's dynamic mmap threshold, once a multi-megabyte
//! buffer was freed, serves every later buffer of that size from those
//! arenas. [`configure`] therefore fixes the mmap threshold (large buffers
//! are mapped and unmapped on their own, and arena tops are trimmed on
//! free), and callers ask for a trim with [`request`] when they freed
//! something big; a background task calls [`trim_if_requested`].
//! Measured on a hub after 16 concurrent 4 MiB records: RSS 32 MB before,
//! 48 MB after with the trim alone (4 MB kept in each thread arena).
//! Other C libraries and allocators need nothing: the functions do nothing.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// A buffer at least this large, once processed and freed, is worth a
/// [`request`] (a received federation message, for instance).
pub const LARGE_BYTES: usize = 1024 * 1024;

/// Allocations at least this large are mapped on their own (glibc's
/// default start value, made fixed).
pub const MMAP_THRESHOLD_BYTES: i32 = 128 * 1024;

/// Makes large buffers go back to the system as soon as they are freed
/// (once per process; a hub calls it when it starts). The setting is
/// process-wide: `MALLOC_MMAP_THRESHOLD_` in the environment wins.
pub fn configure() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            fix_mmap_threshold();
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn fix_mmap_threshold() {
    // SAFETY: mallopt only changes the allocator's tunables.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn fix_mmap_threshold() {}

/// Notes that a large amount of memory was just freed.
pub fn request() {
    REQUESTED.store(true, Ordering::Relaxed);
}

/// Gives free heap pages back if [`request`] was called since the last
/// trim (or `force`). Returns whether it trimmed. Can take a few
/// milliseconds on a large heap: call it off async worker threads.
pub fn trim_if_requested(force: bool) -> bool {
    if !(REQUESTED.swap(false, Ordering::Relaxed) || force) {
        return false;
    }
    give_back();
    true
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn give_back() {
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn give_back() {}
