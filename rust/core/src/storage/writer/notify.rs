//! The commit notifier: how readers learn that the committed end moved.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Wakes readers when the committed end of the channel moves.
#[derive(Debug, Default)]
pub struct CommitNotifier {
    pub(super) end: AtomicU64,
    state: Mutex<NotifyState>,
    cv: Condvar,
    /// Wakes async readers (federation links).
    async_wake: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct NotifyState {
    waiters: usize,
    closed: bool,
    /// Bumped by [`CommitNotifier::wake_all`] so waiters return at once.
    kicks: u64,
}

impl CommitNotifier {
    /// Global offset up to which records are committed and may be read.
    pub fn committed_end(&self) -> u64 {
        self.end.load(Ordering::Acquire)
    }

    pub(super) fn publish(&self, end: u64) {
        self.end.store(end, Ordering::Release);
        self.async_wake.notify_waiters();
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.waiters > 0 {
            self.cv.notify_all();
        }
    }

    pub(super) fn close(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.closed = true;
        self.cv.notify_all();
        self.async_wake.notify_waiters();
    }

    /// Async wait until the committed end passes `pos` (or a close). Returns
    /// at once when it already has.
    pub async fn changed_past(&self, pos: u64) {
        let notified = self.async_wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.committed_end() > pos || self.state.lock().unwrap_or_else(|e| e.into_inner()).closed
        {
            return;
        }
        notified.await;
    }

    /// Waits until the committed end passes `pos`, the writer closes, or
    /// `timeout` elapses; returns the committed end.
    pub fn wait_past(&self, pos: u64, timeout: Duration) -> u64 {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if self.committed_end() <= pos && !st.closed {
            st.waiters += 1;
            let kicks = st.kicks;
            let (mut g, _) = self
                .cv
                .wait_timeout_while(st, timeout, |s| {
                    !s.closed && s.kicks == kicks && self.end.load(Ordering::Acquire) <= pos
                })
                .unwrap_or_else(|e| e.into_inner());
            g.waiters -= 1;
        }
        self.committed_end()
    }

    /// Wakes every waiter without a new commit (used when stopping readers).
    pub fn wake_all(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.kicks += 1;
        self.cv.notify_all();
    }
}
