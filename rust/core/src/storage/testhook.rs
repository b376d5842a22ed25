//! Test hooks of the storage layer; inert unless a test switches them on.
//!
//! * **Directory-entry tracking** (weak spot 30 of the original): while
//!   switched on with [`track_dir_entries`], every directory entry the
//!   storage layer makes (a new segment, a renamed offset file, a created
//!   directory, a deleted segment) is recorded as unsynced until the
//!   directory holding it is fsynced by [`super::segment::sync_dir`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

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
