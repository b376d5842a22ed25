//! Latency windows and snapshots of an engine's counters.
//!
//! A [`Window`] keeps the last [`WINDOW`] samples in a ring (one short lock
//! per sample, cheap enough to stay on in the publish path) and computes
//! percentiles over them on demand.

use std::sync::Mutex;
use std::time::Duration;

/// Samples kept per window.
pub const WINDOW: usize = 4096;

/// Percentiles of a window, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Percentiles {
    pub count: usize,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
}

/// A sliding window of duration samples.
#[derive(Debug)]
pub struct Window {
    ring: Mutex<Ring>,
}

#[derive(Debug)]
struct Ring {
    samples: Vec<u32>,
    next: usize,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            ring: Mutex::new(Ring {
                samples: Vec::with_capacity(WINDOW),
                next: 0,
            }),
        }
    }
}

impl Window {
    /// Adds one sample (saturating at about 71 minutes).
    pub fn record(&self, d: Duration) {
        let us = u32::try_from(d.as_micros()).unwrap_or(u32::MAX);
        let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if r.samples.len() < WINDOW {
            r.samples.push(us);
        } else {
            let i = r.next;
            r.samples[i] = us;
        }
        r.next = (r.next + 1) % WINDOW;
    }

    /// p50/p90/p99 of the samples in the window.
    pub fn percentiles(&self) -> Percentiles {
        let mut v = self
            .ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .samples
            .clone();
        if v.is_empty() {
            return Percentiles::default();
        }
        v.sort_unstable();
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64;
        Percentiles {
            count: v.len(),
            p50_us: at(0.50),
            p90_us: at(0.90),
            p99_us: at(0.99),
        }
    }
}

/// The latency windows of an engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Publish call to commit (includes the group-commit wait and fsync).
    pub publish: Window,
    /// Publish time (envelope `ts`) to the start of the handler call.
    pub consume: Window,
    /// Handler run time per message.
    pub handler: Window,
}

/// One subscriber (or federation cursor) in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberSnapshot {
    pub id: String,
    pub position: u64,
    pub lag_bytes: u64,
    /// Publish time (ns since the epoch) of the oldest unacknowledged record.
    pub oldest_pending_nanos: Option<i64>,
    pub active: bool,
}

/// One channel in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelSnapshot {
    pub name: String,
    pub messages_published: u64,
    pub stream_bytes: u64,
    pub disk_bytes: u64,
    /// Publish time (ns since the epoch) of the newest record, if any.
    pub last_message_nanos: Option<i64>,
    pub subscribers: Vec<SubscriberSnapshot>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_over_the_window() {
        let w = Window::default();
        assert_eq!(w.percentiles().count, 0);
        for us in 1..=100u64 {
            w.record(Duration::from_micros(us));
        }
        let p = w.percentiles();
        assert_eq!(p.count, 100);
        assert_eq!((p.p50_us, p.p90_us, p.p99_us), (51.0, 90.0, 99.0));
        for _ in 0..WINDOW {
            w.record(Duration::from_micros(7));
        }
        let p = w.percentiles();
        assert_eq!((p.count, p.p50_us, p.p99_us), (WINDOW, 7.0, 7.0));
    }
}
