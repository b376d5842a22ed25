//! Rate-limited logging: an error that can repeat thousands of times a second
//! (a full descriptor table, a hostile peer, a failing disk) is logged at most
//! once per interval, with the number of repeats suppressed since.
//!
//! ```
//! use std::time::Duration;
//! use keyop_core::lograte::RateLimit;
//! static READ_ERRORS: RateLimit = RateLimit::new(Duration::from_secs(10));
//! if let Some(held) = READ_ERRORS.check() {
//!     // "cannot read: ..." and, if any were held back, " (12 more since the last report)"
//!     log::error!("cannot read: ...{held}");
//! }
//! ```

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Reports held back since the last one let through. Displays as nothing
/// when there were none, else as ` (N more since the last report)`, to end a
/// log line with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held(pub u64);

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            0 => Ok(()),
            n => write!(f, " ({n} more since the last report)"),
        }
    }
}

/// Lets one report through per `interval`; counts the ones held back.
#[derive(Debug)]
pub struct RateLimit {
    interval: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimit {
    /// A limiter letting one report through per `interval`.
    pub const fn new(interval: Duration) -> RateLimit {
        RateLimit {
            interval,
            state: Mutex::new(State {
                last: None,
                suppressed: 0,
            }),
        }
    }

    /// `Some(held)` when the caller should log now, `held` counting the
    /// reports held back since the last one let through; `None` to stay
    /// quiet.
    pub fn check(&self) -> Option<Held> {
        self.check_at(Instant::now()).map(Held)
    }

    fn check_at(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match st.last {
            Some(t) if now.saturating_duration_since(t) < self.interval => {
                st.suppressed += 1;
                None
            }
            _ => {
                st.last = Some(now);
                Some(std::mem::take(&mut st.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_report_per_interval_with_the_count_held_back() {
        let limit = RateLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(limit.check_at(t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(limit.check_at(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(limit.check_at(t0 + Duration::from_secs(10)), Some(1000));
        assert_eq!(limit.check_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(limit.check_at(t0 + Duration::from_secs(20)), Some(1));
        assert_eq!(Held(0).to_string(), "");
        assert_eq!(Held(7).to_string(), " (7 more since the last report)");
    }
}
