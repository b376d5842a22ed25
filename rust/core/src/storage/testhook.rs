//! Test hooks of the storage layer; inert unless a test switches them on.
//!
//! * **Stop points** for crash tests: with `KEYOP_TEST_STOP_AT=<point>:<n>`
//!   in the environment, the process stops itself (SIGSTOP) the `n`-th time
//!   it reaches `<point>`, so the test can SIGKILL it exactly there. Points:
//!   `offset-tmp` (an offset's temporary file is written and synced, not yet
//!   renamed over the offset file) and `compaction` (a retention pass has
//!   just deleted a segment; the rest of the pass and its directory fsync
//!   are not done). Unset, a stop point costs one initialised-once check.
//! * **Directory-entry tracking** (weak spot 30 of the original): while
//!   switched on with [`track_dir_entries`], every directory entry the
//!   storage layer makes (a new segment, a renamed offset file, a created
//!   directory, a deleted segment) is recorded as unsynced until the
//!   directory holding it is fsynced by [`super::segment::sync_dir`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Environment variable naming the stop point and its occurrence.
pub const STOP_AT_ENV: &str = "KEYOP_TEST_STOP_AT";

struct StopAt {
    point: String,
    nth: u64,
    seen: AtomicU64,
}

fn stop_at() -> Option<&'static StopAt> {
    static STOP_AT: OnceLock<Option<StopAt>> = OnceLock::new();
    STOP_AT
        .get_or_init(|| {
            let value = std::env::var(STOP_AT_ENV).ok()?;
            let parsed = value.rsplit_once(':').and_then(|(point, n)| {
                let nth = n.parse().ok().filter(|&n| n > 0)?;
                Some(StopAt {
                    point: point.to_owned(),
                    nth,
                    seen: AtomicU64::new(0),
                })
            });
            if parsed.is_none() {
                log::warn!("{STOP_AT_ENV}={value:?} ignored: expected <point>:<n> with n >= 1");
            }
            parsed
        })
        .as_ref()
}

/// A stop point: stops the process if the environment asks for this
/// occurrence of `point` (see the module documentation).
pub(crate) fn stop_point(point: &str) {
    let Some(cfg) = stop_at() else {
        return;
    };
    if cfg.point == point && cfg.seen.fetch_add(1, Ordering::AcqRel) + 1 == cfg.nth {
        // SAFETY: raise has no memory-safety preconditions.
        unsafe {
            libc::raise(libc::SIGSTOP);
        }
    }
}

static TRACKING: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct Entries {
    made: Vec<PathBuf>,
    unsynced: BTreeSet<PathBuf>,
}

fn entries() -> std::sync::MutexGuard<'static, Entries> {
    static ENTRIES: OnceLock<Mutex<Entries>> = OnceLock::new();
    ENTRIES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Test hook: switches directory-entry tracking on or off (process-wide).
#[doc(hidden)]
pub fn track_dir_entries(on: bool) {
    TRACKING.store(on, Ordering::Release);
}

/// Test hook: every entry recorded while tracking, in order, and those
/// whose directory has not been fsynced since.
#[doc(hidden)]
pub fn dir_entries() -> (Vec<PathBuf>, Vec<PathBuf>) {
    let e = entries();
    (e.made.clone(), e.unsynced.iter().cloned().collect())
}

/// Records that the directory entry `path` was made, renamed or removed.
pub(crate) fn entry_changed(path: &Path) {
    if TRACKING.load(Ordering::Acquire) {
        let mut e = entries();
        e.made.push(path.to_owned());
        e.unsynced.insert(path.to_owned());
    }
}

/// Records that `dir` was fsynced: its entries are durable.
pub(crate) fn dir_synced(dir: &Path) {
    if TRACKING.load(Ordering::Acquire) {
        entries()
            .unsynced
            .retain(|p| p.parent().is_none_or(|parent| parent != dir));
    }
}
