//! When bytes last moved on a gateway connection (its idle timeout).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// When bytes last moved on a connection, either way (milliseconds since
/// `started`); shared by the connection and, after an upgrade, its WebSocket.
#[derive(Clone)]
pub(super) struct Activity {
    last: Arc<AtomicU64>,
    started: Instant,
}

impl Activity {
    /// No byte moved yet; the clock starts now.
    pub(super) fn new() -> Activity {
        Activity {
            last: Arc::new(AtomicU64::new(0)),
            started: Instant::now(),
        }
    }

    /// Bytes moved just now.
    pub(super) fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }

    /// Returns once no byte has moved either way for longer than `idle`
    /// (a reader that stopped reading, so writes block, counts as idle).
    pub(super) async fn idle(&self, idle: Duration) {
        loop {
            tokio::time::sleep(idle / 4).await;
            let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
            if self.started.elapsed().saturating_sub(last) > idle {
                return;
            }
        }
    }
}
