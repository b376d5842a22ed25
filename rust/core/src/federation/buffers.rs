//! Batch buffers reused from one batch to the next.
//!
//! A sender reads each batch (up to `federation.max_batch_bytes`, 4 MiB by
//! default) into one buffer, and a receiver gathers the records it stores
//! into one buffer per channel. Made fresh for each batch, a buffer that
//! large is mapped on its own (above the mmap threshold, see `memtrim`):
//! each of its pages is faulted in, and the whole is unmapped after, about a
//! thousand page faults per 4 MiB batch on each side. Such buffers come back
//! here instead ([`POOL`]), at most `KEPT` of them, and [`Pool::trim`] lets go of those
//! unused for `IDLE`, so a process that stopped forwarding holds none.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Buffers kept at most, process-wide (a sender and its read-ahead, a
/// receiver's channels).
const KEPT: usize = 4;

/// Smaller buffers come from the heap cheaply as it is: not kept.
const MIN_BYTES: usize = 128 * 1024;

/// Larger buffers (batches far above the default size) are not kept.
const MAX_BYTES: usize = 16 * 1024 * 1024;

/// A kept buffer unused this long goes at the next [`Pool::trim`].
const IDLE: Duration = Duration::from_secs(1);

/// Kept buffers, each with the time it was given back.
#[derive(Default)]
pub struct Pool {
    free: Mutex<Vec<(Vec<u8>, Instant)>>,
}

/// The process's pool.
pub static POOL: Pool = Pool::new();

impl Pool {
    pub const fn new() -> Pool {
        Pool {
            free: Mutex::new(Vec::new()),
        }
    }

    fn free(&self) -> MutexGuard<'_, Vec<(Vec<u8>, Instant)>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty buffer: the one given back last, if any is kept.
    pub fn take(&self) -> Vec<u8> {
        self.free().pop().map(|(buf, _)| buf).unwrap_or_default()
    }

    /// Keeps `buf`, emptied, for a later [`take`](Pool::take), if it is
    /// large enough to be worth it, not too large, at least a quarter full
    /// (a buffer left over from a burst, now carrying small batches, goes:
    /// its pages stay resident while it is kept), and fewer than `KEPT`
    /// are kept.
    pub fn give(&self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if !(MIN_BYTES..=MAX_BYTES).contains(&cap) || buf.len() < cap / 4 {
            return;
        }
        buf.clear();
        let mut free = self.free();
        if free.len() < KEPT {
            free.push((buf, Instant::now()));
        }
    }

    /// Lets go of the buffers given back more than `IDLE` ago (freed
    /// after the lock is released).
    pub fn trim(&self) {
        let now = Instant::now();
        let stale: Vec<_> = {
            let mut free = self.free();
            let (stale, fresh) = std::mem::take(&mut *free)
                .into_iter()
                .partition(|(_, at)| now.duration_since(*at) >= IDLE);
            *free = fresh;
            stale
        };
        drop(stale);
    }

    /// Bytes kept now.
    #[cfg(test)]
    fn kept_bytes(&self) -> usize {
        self.free().iter().map(|(buf, _)| buf.capacity()).sum()
    }
}

/// A buffer handed to the WebSocket layer (`Bytes::from_owner`): given back
/// to its pool when the last reference to it drops, once the frame is
/// written.
pub struct Pooled {
    buf: Vec<u8>,
    pool: &'static Pool,
}

impl Pooled {
    /// `buf`, to go back to `pool`.
    pub fn new(buf: Vec<u8>, pool: &'static Pool) -> Pooled {
        Pooled { buf, pool }
    }
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer of `len` bytes, filled.
    fn full(len: usize) -> Vec<u8> {
        vec![b'x'; len]
    }

    #[test]
    fn large_buffers_come_back_emptied_and_small_or_huge_ones_do_not() {
        let pool = Pool::new();
        let mut buf = Vec::with_capacity(MIN_BYTES * 2);
        buf.resize(MIN_BYTES / 2, b'x');
        let at = buf.as_ptr();
        pool.give(buf);
        pool.give(full(MIN_BYTES - 1));
        pool.give(full(MAX_BYTES + 1));
        let mut sparse = Vec::with_capacity(MIN_BYTES * 4);
        sparse.resize(MIN_BYTES - 1, b'x'); // under a quarter: its pages would idle
        pool.give(sparse);
        assert_eq!(pool.kept_bytes(), MIN_BYTES * 2);
        let again = pool.take();
        assert_eq!(
            (again.as_ptr(), again.len()),
            (at, 0),
            "the same buffer, emptied"
        );
        assert_eq!(
            pool.take().capacity(),
            0,
            "none kept: a new, unallocated one"
        );
    }

    #[test]
    fn at_most_kept_buffers_stay_and_trim_drops_the_idle_ones() {
        let pool = Pool::new();
        for _ in 0..KEPT + 2 {
            pool.give(full(MIN_BYTES));
        }
        assert_eq!(pool.kept_bytes(), KEPT * MIN_BYTES);
        pool.trim();
        assert_eq!(pool.kept_bytes(), KEPT * MIN_BYTES, "just given back: kept");
        for (_, at) in pool.free().iter_mut() {
            *at -= IDLE;
        }
        let mut again = pool.take();
        again.resize(MIN_BYTES, b'x');
        pool.give(again); // used again: given back now
        pool.trim();
        assert_eq!(pool.kept_bytes(), MIN_BYTES, "only the one used since");
    }

    #[test]
    fn a_pooled_buffer_goes_back_when_its_last_bytes_drop() {
        static POOL: Pool = Pool::new();
        let mut buf = full(MIN_BYTES);
        buf[..7].copy_from_slice(b"a batch");
        let bytes = tokio_tungstenite::tungstenite::Bytes::from_owner(Pooled::new(buf, &POOL));
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(POOL.kept_bytes(), 0, "still referenced");
        assert_eq!(&clone[..7], b"a batch");
        drop(clone);
        assert_eq!(POOL.kept_bytes(), MIN_BYTES);
        assert_eq!(POOL.take().len(), 0, "emptied");
    }
}
