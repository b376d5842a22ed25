//! Retention: deleting sealed segments, only by a rule the user set.
//!
//! Two rules, and nothing else, delete data (the active segment never):
//! - consumed: a sealed segment goes when the start of the next segment is at
//!   or below the offset in every offset file of the channel, federation
//!   cursors included, and including subscribers that have not subscribed
//!   again since a restart (the original ignored those). It applies only to
//!   a channel with at least one offset file: a channel nobody reads keeps
//!   its data (keyop-messenger 1.4 deleted all of it). An unreadable offset
//!   file stops compaction of that channel for the round.
//! - limits ([`RetentionLimits`], off unless configured): sealed segments
//!   whose last write is older than `max_age`, and the oldest sealed segments
//!   while the channel holds more than `max_bytes`, go even if unread
//!   (readers then meet a gap, which they report).
//!
//! Segments are deleted oldest first and never past one that must stay, so
//! what remains is always a contiguous suffix of the stream.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::offsets::{list_offsets, read_offset, subscribers_dir};
use super::segment::{list_segments, segment_path, sync_dir, CHANNELS_DIR};
use super::testhook;
use crate::envelope::{validate_name, NameKind, FED_CURSOR_PREFIX, HUB_CURSOR_PREFIX};

/// Retention settings.
#[derive(Debug, Clone, Default)]
pub struct RetentionConfig {
    /// Warn about local subscribers lagging more than this many bytes.
    pub max_lag_bytes: Option<u64>,
    /// Remove offset files of local subscribers not subscribed in this
    /// process whose file is older than this (by modification time).
    pub stale_offset_ttl: Option<Duration>,
    /// Limits of every channel without an entry in `per_channel`.
    pub limits: RetentionLimits,
    /// Limits of named channels, replacing `limits` whole for them.
    pub per_channel: HashMap<String, RetentionLimits>,
}

impl RetentionConfig {
    /// The limits that apply to `channel`.
    pub fn limits_for(&self, channel: &str) -> RetentionLimits {
        self.per_channel
            .get(channel)
            .copied()
            .unwrap_or(self.limits)
    }
}

/// Deletion of data whether or not it was read; each limit is off when None.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionLimits {
    /// Delete sealed segments last written longer ago than this.
    pub max_age: Option<Duration>,
    /// Delete the oldest sealed segments while the channel's segments hold
    /// more bytes than this.
    pub max_bytes: Option<u64>,
}

/// What one pass did to one channel.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CompactionReport {
    pub segments_deleted: usize,
    pub bytes_freed: u64,
    pub offsets_removed: Vec<String>,
    /// Local subscribers over the lag threshold, with their lag in bytes.
    pub lagging: Vec<(String, u64)>,
}

/// Runs one retention pass over `channel` of `data_dir`. `active` holds the
/// ids subscribed in this process (never considered stale).
pub fn compact_channel(
    data_dir: &Path,
    channel: &str,
    active: &HashSet<String>,
    cfg: &RetentionConfig,
) -> io::Result<CompactionReport> {
    let mut report = CompactionReport::default();
    let chan_dir = super::channel_dir(data_dir, channel);
    let segs = list_segments(&chan_dir)?;
    let Some(&last) = segs.last() else {
        return Ok(report);
    };
    let stream_end = last + fs::metadata(segment_path(&chan_dir, last))?.len();
    let sub_dir = subscribers_dir(data_dir, channel);
    // No offset file: no consumer rule (the channel keeps its data).
    let mut min: Option<u64> = None;
    for (id, path) in list_offsets(&sub_dir)? {
        let is_local = !(id.starts_with(FED_CURSOR_PREFIX) || id.starts_with(HUB_CURSOR_PREFIX));
        if let (true, Some(ttl), false) = (is_local, cfg.stale_offset_ttl, active.contains(&id)) {
            let age = fs::metadata(&path)?
                .modified()
                .ok()
                .and_then(|m| SystemTime::now().duration_since(m).ok())
                .unwrap_or_default();
            if age > ttl {
                fs::remove_file(&path)?;
                log::warn!(
                    "channel {channel:?}: removed offset file of subscriber {id:?}, unused for {}s",
                    age.as_secs()
                );
                report.offsets_removed.push(id);
                continue;
            }
        }
        let offset = read_offset(&path)?.unwrap_or(0);
        min = Some(min.map_or(offset, |m| m.min(offset)));
        if let (true, Some(limit)) = (is_local, cfg.max_lag_bytes) {
            let lag = stream_end.saturating_sub(offset);
            if lag > limit {
                log::warn!("channel {channel:?}: subscriber {id:?} lags {lag} bytes behind");
                report.lagging.push((id, lag));
            }
        }
    }
    let limits = cfg.limits_for(channel);
    let mut sizes = Vec::with_capacity(segs.len());
    for &s in &segs {
        sizes.push(fs::metadata(segment_path(&chan_dir, s)).map_or(0, |m| m.len()));
    }
    let mut held: u64 = sizes.iter().sum();
    for (i, pair) in segs.windows(2).enumerate() {
        let (start, next) = (pair[0], pair[1]);
        let path = segment_path(&chan_dir, start);
        let size = sizes[i];
        let consumed = min.is_some_and(|m| next <= m);
        let over_bytes = limits.max_bytes.is_some_and(|max| held > max);
        let too_old = limits.max_age.is_some_and(|max| {
            fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|m| SystemTime::now().duration_since(m).ok())
                .is_some_and(|age| age > max)
        });
        if !(consumed || over_bytes || too_old) {
            break;
        }
        if !consumed {
            log::warn!(
                "channel {channel:?}: retention deletes unread bytes {start}..{next} ({})",
                if too_old { "max_age" } else { "max_bytes" }
            );
        }
        fs::remove_file(&path)?;
        held -= size;
        testhook::entry_changed(&path);
        report.segments_deleted += 1;
        report.bytes_freed += size;
        testhook::stop_point("compaction");
    }
    if report.segments_deleted > 0 {
        sync_dir(&chan_dir)?;
        log::info!(
            "channel {channel:?}: deleted {} sealed segment(s), {} bytes freed",
            report.segments_deleted,
            report.bytes_freed
        );
    }
    Ok(report)
}

/// Names of every channel directory under `data_dir/channels` with a valid
/// name. A directory whose name is not one (1.4 stored channels named by
/// peers without checking them) is logged once per process: it is neither
/// read nor compacted.
pub fn list_channels(data_dir: &Path) -> io::Result<Vec<String>> {
    static WARNED: std::sync::Mutex<std::collections::BTreeSet<std::path::PathBuf>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut out = Vec::new();
    for entry in fs::read_dir(data_dir.join(CHANNELS_DIR))? {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        let name = entry.file_name();
        let refused = match name.to_str() {
            Some(name) => match validate_name(NameKind::Channel, name) {
                Ok(()) => {
                    out.push(name.to_owned());
                    continue;
                }
                Err(e) => e.to_string(),
            },
            None => "its name is not UTF-8".to_owned(),
        };
        let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
        if warned.insert(entry.path()) {
            log::warn!(
                "{}: not a channel this version reads or compacts ({refused}); a 1.4 hub \
                 may have stored it for a peer (docs/compatibility.md)",
                entry.path().display()
            );
        }
    }
    out.sort();
    Ok(out)
}
