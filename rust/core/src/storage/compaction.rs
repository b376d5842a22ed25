//! Retention: deleting sealed segments every consumer has passed.
//!
//! A sealed segment is deleted only when the start of the next segment is at
//! or below the offset in every offset file of the channel, federation
//! cursors included, and including subscribers that have not subscribed
//! again since a restart (the original ignored those). An unreadable offset
//! file stops compaction of that channel for the round. The active segment is
//! never deleted.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::offsets::{list_offsets, read_offset, subscribers_dir};
use super::segment::{list_segments, segment_path, sync_dir};
use super::testhook;
use crate::envelope::{validate_name, NameKind, FED_CURSOR_PREFIX, HUB_CURSOR_PREFIX};

/// Retention settings.
#[derive(Debug, Clone, Copy, Default)]
pub struct RetentionConfig {
    /// Warn about local subscribers lagging more than this many bytes.
    pub max_lag_bytes: Option<u64>,
    /// Remove offset files of local subscribers not subscribed in this
    /// process whose file is older than this (by modification time).
    pub stale_offset_ttl: Option<Duration>,
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
    let mut min = u64::MAX;
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
        min = min.min(offset);
        if let (true, Some(limit)) = (is_local, cfg.max_lag_bytes) {
            let lag = stream_end.saturating_sub(offset);
            if lag > limit {
                log::warn!("channel {channel:?}: subscriber {id:?} lags {lag} bytes behind");
                report.lagging.push((id, lag));
            }
        }
    }
    for pair in segs.windows(2) {
        let (start, next) = (pair[0], pair[1]);
        if next > min {
            break;
        }
        let path = segment_path(&chan_dir, start);
        let size = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        fs::remove_file(&path)?;
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

/// Names of every channel directory under `data_dir/channels` with a valid name.
pub fn list_channels(data_dir: &Path) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(data_dir.join("channels"))? {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        if let Some(name) = entry.file_name().to_str() {
            if validate_name(NameKind::Channel, name).is_ok() {
                out.push(name.to_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}
