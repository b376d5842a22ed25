//! Appends that do not wait: [`ChannelWriter::submit`] queues records and
//! returns a [`Ticket`] at once; a committer thread of the writer leads the
//! batches that hold submitted records.
//!
//! What this is for:
//! - pipelining: one thread submits many records and waits for the last
//!   tickets, so its records share fdatasyncs instead of paying one each;
//! - asyncio: a commit completes the futures of all its records in one step
//!   ([`Ticket::on_done_then`] runs on the committer thread), and the tasks
//!   an event loop runs in one pass submit held
//!   ([`ChannelWriter::submit_held`]), released once after the pass, so
//!   their records share one batch;
//! - a caller that must stay interruptible (Python's main thread, where
//!   Ctrl-C is delivered): it never sits in `fdatasync` itself, and waits in
//!   bounded slices ([`Ticket::wait_timeout`]).
//!
//! Submitted and blocking appends share the same batches, slots and group
//! commit; the committer thread is started on the first submit, ends after a
//! while without work, and is joined by `close`.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    AfterBatch, Appended, ChannelWriter, Slot, StorageError, DONE, LEAD, PENDING, SLEEPING,
};

/// The committer thread ends after this long without a submitted append.
const COMMITTER_IDLE: Duration = Duration::from_secs(5);

/// Held appends not released after this long are committed anyway.
pub(super) const HELD_MAX: Duration = Duration::from_millis(50);

/// A submitted append: where it stands, and a way to wait for its outcome.
pub struct Ticket {
    writer: Arc<ChannelWriter>,
    slot: Arc<Slot>,
    pos: usize,
    len: usize,
    /// Submitted with [`ChannelWriter::submit_held`] and not yet released
    /// by a wait: the first wait releases it, once.
    held: AtomicBool,
}

impl ChannelWriter {
    /// Queues `records` (`count` whole newline-terminated records) and
    /// returns at once; the committer thread commits them with the next
    /// batch. The outcome is the same as [`ChannelWriter::append`]'s.
    pub fn submit<'a>(
        self: &Arc<Self>,
        records: impl Into<Cow<'a, [u8]>>,
        count: u64,
    ) -> Result<Ticket, StorageError> {
        self.submit_as(records.into(), count, false)
    }

    /// [`ChannelWriter::submit`], but the committer thread is not woken for
    /// these records: [`Ticket::release`] wakes it. For a caller that submits
    /// several records in a row on behalf of others (an event loop running
    /// its ready tasks, each publishing one message): released once after
    /// the last, they share one batch instead of the first going alone.
    ///
    /// Held records are never stranded: they go with the next batch any
    /// other append starts, `close` commits them, waiting on the ticket
    /// releases them, and the committer thread commits them unasked once
    /// they have waited `HELD_MAX` (50 ms).
    pub fn submit_held<'a>(
        self: &Arc<Self>,
        records: impl Into<Cow<'a, [u8]>>,
        count: u64,
    ) -> Result<Ticket, StorageError> {
        self.submit_as(records.into(), count, true)
    }

    /// [`ChannelWriter::submit`] or, if `held`, [`ChannelWriter::submit_held`].
    pub(crate) fn submit_as(
        self: &Arc<Self>,
        records: Cow<'_, [u8]>,
        count: u64,
        held: bool,
    ) -> Result<Ticket, StorageError> {
        let len = records.len();
        let (mut st, pos, slot) = self.enqueue(records, count)?;
        if !held {
            st.submitted = true;
        } else if st.held_since.is_none() {
            st.held_since = Some(Instant::now());
        }
        if !st.committer {
            self.start_committer(&mut st)?;
        } else if !held && !st.flushing {
            self.kick.notify_one();
        }
        drop(st);
        Ok(Ticket {
            writer: self.clone(),
            slot,
            pos,
            len,
            held: AtomicBool::new(held),
        })
    }

    /// Releases the held records (they go with the next batch), and wakes
    /// the committer thread unless a batch is being committed (the thread
    /// commits the next one when it ends).
    fn release_held(&self) {
        let mut st = self.lock();
        if st.held_since.take().is_some() {
            st.submitted = true;
            if !st.flushing {
                self.kick.notify_one();
            }
        }
    }

    /// Starts the committer thread (the state's lock is held). A thread that
    /// cannot be started fails the submit, with the records taken back out.
    fn start_committer(self: &Arc<Self>, st: &mut super::State) -> Result<(), StorageError> {
        let mut handle = self.committer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = handle.take() {
            // It has left its loop (st.committer is false): ends promptly.
            let _ = old.join();
        }
        let writer = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("keyop-commit".into())
            .spawn(move || committer_loop(writer));
        match spawned {
            Ok(h) => {
                *handle = Some(h);
                st.committer = true;
                Ok(())
            }
            Err(e) => {
                let (len, _) = st.groups.pop().expect("pushed by submit");
                let keep = st.pending.len() - len;
                st.pending.truncate(keep);
                Err(super::io_err(
                    format!("channel {:?}: cannot start the commit thread", self.channel),
                    e,
                ))
            }
        }
    }

    /// Test hook: how long held appends wait for a release.
    #[cfg(test)]
    pub(super) fn set_held_max(&self, held_max: Duration) {
        self.lock().held_max = held_max;
    }

    /// Waits for the committer thread to end (after `close`), unless called
    /// from it (a completion callback that closes the writer).
    pub(super) fn join_committer(&self) {
        let handle = self
            .committer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// Leads every batch that holds submitted appends, until the writer closes
/// or nothing is submitted for [`COMMITTER_IDLE`].
fn committer_loop(writer: std::sync::Weak<ChannelWriter>) {
    loop {
        let Some(w) = writer.upgrade() else { return };
        let mut st = w.lock();
        let mut idle_since = Instant::now();
        loop {
            if st.closed {
                st.committer = false;
                return;
            }
            let mut held_for = st.held_since.map(|t| t.elapsed());
            if held_for.is_some_and(|h| h >= st.held_max) {
                st.held_since = None;
                st.submitted = true;
                held_for = None;
            }
            if st.submitted && !st.flushing {
                break;
            }
            if st.submitted || held_for.is_some() {
                idle_since = Instant::now();
            }
            let waited = idle_since.elapsed();
            if waited >= COMMITTER_IDLE {
                st.committer = false;
                return;
            }
            let mut timeout = COMMITTER_IDLE - waited;
            if let Some(h) = held_for {
                timeout = timeout.min(st.held_max.saturating_sub(h));
            }
            st = w
                .kick
                .wait_timeout(st, timeout)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        w.lead_as(st, false);
    }
}

impl Ticket {
    /// The channel the records were submitted to.
    pub fn channel(&self) -> &str {
        self.writer.channel()
    }

    /// Starts the commit of held records (see [`ChannelWriter::submit_held`])
    /// unless one is already due; harmless for any ticket.
    pub fn release(&self) {
        if !self.is_done() {
            self.writer.release_held();
        }
    }

    /// Whether the outcome is known.
    pub fn is_done(&self) -> bool {
        self.slot.outcome.get().is_some()
    }

    /// The outcome, once known.
    pub fn outcome(&self) -> Option<Result<Appended, StorageError>> {
        self.slot
            .outcome
            .get()
            .map(|o| o.result(self.pos, self.len))
    }

    /// Waits at most `timeout` for the outcome; `None` if it is not known
    /// by then (the records stay queued and may still be committed).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<Appended, StorageError>> {
        if self.held.swap(false, Ordering::Relaxed) {
            self.release();
        }
        let deadline = Instant::now() + timeout;
        let state = &self.slot.state;
        let mut slept = false;
        loop {
            match state.load(Ordering::Acquire) {
                DONE => {
                    if slept {
                        // Pass the wake-up chain on (see `Slot::finish`).
                        atomic_wait::wake_one(state);
                    }
                    return self.outcome();
                }
                PENDING => {
                    let _ = state.compare_exchange(
                        PENDING,
                        SLEEPING,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                LEAD => {
                    // Asked to lead: a ticket's holder never leads (it must
                    // stay interruptible); the committer thread does.
                    if state
                        .compare_exchange(LEAD, SLEEPING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        let _st = self.writer.lock();
                        self.writer.kick.notify_one();
                    }
                }
                _ => {
                    let now = Instant::now();
                    if now >= deadline {
                        return None;
                    }
                    wait_word(state, SLEEPING, deadline - now);
                    slept = true;
                }
            }
        }
    }

    /// Waits for the outcome.
    pub fn wait(&self) -> Result<Appended, StorageError> {
        loop {
            if let Some(r) = self.wait_timeout(Duration::from_secs(3600)) {
                return r;
            }
        }
    }

    /// Calls `callback` with the outcome: on the thread that finishes the
    /// batch, or at once on this thread if it is already known.
    pub fn on_done(&self, callback: impl FnOnce(Result<Appended, StorageError>) + Send + 'static) {
        self.register(Box::new(callback), None);
    }

    /// [`Ticket::on_done`], then `after` once the batch's callbacks have all
    /// run: once per batch for all the tickets given the same `after` (the
    /// same `Arc`). For a consumer that collects outcomes and must learn
    /// when a batch's are all in, e.g. to wake another thread once for them.
    pub fn on_done_then(
        &self,
        callback: impl FnOnce(Result<Appended, StorageError>) + Send + 'static,
        after: &AfterBatch,
    ) {
        self.register(Box::new(callback), Some(after));
    }

    fn register(&self, callback: super::Callback, after: Option<&AfterBatch>) {
        let slot = &self.slot;
        let mut callbacks = slot.callbacks.lock().unwrap_or_else(|e| e.into_inner());
        if slot.outcome.get().is_some() {
            drop(callbacks);
            callback(self.outcome().expect("checked above"));
            if let Some(after) = after {
                after();
            }
            return;
        }
        callbacks.each.push((self.pos, self.len, callback));
        if let Some(after) = after {
            if !callbacks.after.iter().any(|a| Arc::ptr_eq(a, after)) {
                callbacks.after.push(after.clone());
            }
        }
        slot.has_callbacks.store(true, Ordering::Release);
    }
}

/// Sleeps while `word` holds `value`, for at most `timeout` (a futex wait;
/// woken by `atomic_wait::wake_one`, which uses the same private futex).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn wait_word(word: &AtomicU32, value: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call;
    // FUTEX_WAIT only reads it and the timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            value,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn wait_word(word: &AtomicU32, value: u32, timeout: Duration) {
    let until = Instant::now() + timeout;
    while word.load(Ordering::Acquire) == value && Instant::now() < until {
        std::thread::sleep(Duration::from_micros(200));
    }
}
