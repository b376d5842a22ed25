//! Counters of a channel writer.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one writer since it was opened.
#[derive(Debug, Default)]
pub struct WriterCounters {
    pub records: AtomicU64,
    pub appends: AtomicU64,
    pub batches: AtomicU64,
    pub writes: AtomicU64,
    pub fsyncs: AtomicU64,
    pub bytes: AtomicU64,
    pub rolls: AtomicU64,
    pub failures: AtomicU64,
}

/// A plain copy of [`WriterCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    pub records: u64,
    pub appends: u64,
    pub batches: u64,
    pub writes: u64,
    pub fsyncs: u64,
    pub bytes: u64,
    pub rolls: u64,
    pub failures: u64,
}

impl WriterCounters {
    pub(super) fn snapshot(&self) -> CounterSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CounterSnapshot {
            records: l(&self.records),
            appends: l(&self.appends),
            batches: l(&self.batches),
            writes: l(&self.writes),
            fsyncs: l(&self.fsyncs),
            bytes: l(&self.bytes),
            rolls: l(&self.rolls),
            failures: l(&self.failures),
        }
    }
}
