//! Fork detection: objects opened before `fork()` belong to the parent.
//!
//! A forked child has copies of the parent's open files, lock and memory but
//! none of its threads. Writing through the copies would interleave with the
//! parent (lost and corrupted records), and waiting for the parent's threads
//! would wait forever. So every object records the process it was opened in
//! ([`Owner`]) and, in another process, refuses every call with
//! [`Error::Forked`] and releases nothing on close or drop.
//!
//! A `pthread_atfork` child handler bumps a generation counter (one atomic
//! add: async-signal-safe), so the check on the hot path is one atomic load.
//! The same handler points the inherited lock descriptors at `/dev/null`, so
//! a child never keeps the parent's data-directory lock alive after the
//! parent closes it (flock locks belong to the open file, which a child's
//! inherited descriptor would otherwise share); while a lock is held, the
//! parent's `fork()` returns only once the child has let go of its copy (a
//! pipe the child closes), so there is no window in which a quick close and
//! reopen by the parent finds its own lock still held. Thread-local random
//! generators are reseeded in the child on their first use there (see
//! [`reseed_rng_after_fork`]), so message ids stay unique across processes.

use std::cell::Cell;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Once;

use crate::Error;

/// Bumped in every forked child.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Lock descriptors to let go of in a child (-1: free slot).
const LOCK_SLOTS: usize = 64;
static LOCK_FDS: [AtomicI32; LOCK_SLOTS] = [const { AtomicI32::new(-1) }; LOCK_SLOTS];

thread_local! {
    /// The pipe of the fork in progress on this thread (see `before_fork`):
    /// (read end, write end), -1 when none.
    static FORK_PIPE: Cell<(RawFd, RawFd)> = const { Cell::new((-1, -1)) };
}

fn locks_held() -> bool {
    LOCK_FDS.iter().any(|s| s.load(Ordering::Acquire) >= 0)
}

/// Parent, before the fork: a pipe whose write end the child closes once its
/// lock copies are gone.
extern "C" fn before_fork() {
    let mut fds = [-1; 2];
    // SAFETY: pipe2 with a valid two-element array.
    if locks_held() && unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        fds = [-1, -1];
    }
    FORK_PIPE.with(|p| p.set((fds[0], fds[1])));
}

/// Parent, after the fork: waits until the child closed its write end (or
/// died), so the child holds none of our locks when `fork()` returns. The
/// wait is bounded (1 s): a child forked at the same moment by another
/// thread may hold a copy of the pipe too.
extern "C" fn after_fork_in_parent() {
    let (r, w) = FORK_PIPE.with(|p| p.replace((-1, -1)));
    if r < 0 {
        return;
    }
    // SAFETY: our own descriptors; poll on one valid pollfd.
    unsafe {
        libc::close(w);
        let mut pfd = libc::pollfd {
            fd: r,
            events: libc::POLLIN,
            revents: 0,
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let rc = libc::poll(&mut pfd, 1, left.as_millis() as libc::c_int);
            if rc >= 0 || *libc::__errno_location() != libc::EINTR || left.is_zero() {
                break;
            }
        }
        libc::close(r);
    }
}

extern "C" fn in_child() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
    let (pipe_r, pipe_w) = FORK_PIPE.with(|p| p.replace((-1, -1)));
    let mut devnull: RawFd = -1;
    for slot in &LOCK_FDS {
        let fd = slot.swap(-1, Ordering::AcqRel);
        if fd < 0 {
            continue;
        }
        if devnull < 0 {
            // SAFETY: open and dup2 are async-signal-safe; the path is a
            // NUL-terminated literal.
            devnull =
                unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            if devnull < 0 {
                return;
            }
        }
        // SAFETY: replaces the child's copy of the descriptor; the number
        // stays valid (now /dev/null), so whoever owns it may still close it.
        unsafe { libc::dup2(devnull, fd) };
    }
    if devnull >= 0 {
        // SAFETY: our own descriptor.
        unsafe { libc::close(devnull) };
    }
    for fd in [pipe_r, pipe_w] {
        if fd >= 0 {
            // SAFETY: this process's copies of the pipe: closing the write
            // end lets the parent's fork() return.
            unsafe { libc::close(fd) };
        }
    }
}

fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler that only does async-signal-safe work.
        let rc = unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_in_parent),
                Some(in_child),
            )
        };
        if rc != 0 {
            log::error!("pthread_atfork failed ({rc}): fork detection falls back to the PID");
        }
    });
}

/// The process an object was opened in.
#[derive(Debug, Clone, Copy)]
pub struct Owner {
    pid: u32,
    generation: u64,
}

impl Owner {
    /// The current process.
    pub fn current() -> Owner {
        install();
        Owner {
            pid: std::process::id(),
            generation: GENERATION.load(Ordering::Acquire),
        }
    }

    /// Whether the caller runs in another process than the owner (a child
    /// forked after the object was opened).
    pub fn is_foreign(&self) -> bool {
        GENERATION.load(Ordering::Acquire) != self.generation
    }

    /// `Err(Error::Forked)` in a forked child, naming `what` and both processes.
    pub fn check(&self, what: &str) -> Result<(), Error> {
        if self.is_foreign() {
            Err(Error::Forked(format!(
                "this {what} was opened in process {}, this is process {}: open a new one in the child",
                self.pid,
                std::process::id()
            )))
        } else {
            Ok(())
        }
    }

    /// The process id the object was opened in.
    pub fn pid(&self) -> u32 {
        self.pid
    }
}

/// Registers `fd` (a held lock) to be pointed at `/dev/null` in forked
/// children. Returns the slot for [`forget_lock_fd`]; None when every slot is
/// taken (the lock then stays shared with children, as before).
pub fn register_lock_fd(fd: RawFd) -> Option<usize> {
    install();
    for (i, slot) in LOCK_FDS.iter().enumerate() {
        if slot
            .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return Some(i);
        }
    }
    log::warn!("more than {LOCK_SLOTS} data directories open: forked children keep their locks");
    None
}

/// Unregisters a slot of [`register_lock_fd`] (before the descriptor closes).
pub fn forget_lock_fd(slot: usize, fd: RawFd) {
    let _ = LOCK_FDS[slot].compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire);
}

thread_local! {
    /// Generation this thread's random generator was last seeded in;
    /// u64::MAX: not yet checked (it may have been copied from a parent).
    static RNG_GENERATION: Cell<u64> = const { Cell::new(u64::MAX) };
}

/// Reseeds the calling thread's `rand::rng()` the first time it is used by
/// this thread in this process: after `fork()` the child's copy of the
/// forking thread's generator would repeat the parent's numbers (rand does
/// not reseed on fork). Returns true when it reseeded.
pub fn reseed_rng_after_fork() -> bool {
    let now = GENERATION.load(Ordering::Acquire);
    RNG_GENERATION.with(|g| {
        if g.get() == now {
            return false;
        }
        install();
        if let Err(e) = rand::rng().reseed() {
            log::error!("cannot reseed the random generator: {e}");
        }
        g.set(now);
        true
    })
}

/// The fork generation of this process (0 in a process that never forked
/// since the library was loaded; one more in each forked child).
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}
