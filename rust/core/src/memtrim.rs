//! Giving freed heap memory back to the operating system.
//!
//! glibc's malloc keeps memory freed by other threads in per-thread arenas
//! and returns it to the system only from the top of the main heap, so
//! after a burst of connections or large records a process stays at its
//! peak RSS although the memory is free. `malloc_trim(0)` releases the free
//! pages of every arena. Callers ask for a trim with [`request`] when they
//! freed something big; a background task calls [`trim_if_requested`].
//! Other C libraries and allocators need nothing: the functions do nothing.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

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
