//! The federation audit log: `data_dir/audit/audit.jsonl`, one JSON object
//! per line with the keys of keyop-messenger 1.4 (`ts`, `event`,
//! `message_id`, `channel`, `direction`, `peer`, `peer_addr`, `detail`;
//! empty ones omitted), rotated to `audit.jsonl.1` .. `.N` by size.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Serialize;

use crate::envelope::format_ts;

/// One audit record. `ts` is filled in when it is logged.
#[derive(Debug, Default, Clone, Serialize)]
pub struct AuditEvent {
    pub ts: String,
    pub event: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message_id: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub channel: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub direction: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub peer: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub peer_addr: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl AuditEvent {
    /// An event of type `event` with every other field empty.
    pub fn new(event: &'static str) -> AuditEvent {
        AuditEvent {
            event,
            ..AuditEvent::default()
        }
    }
}

/// A duration rounded to milliseconds in Go's `time.Duration` text form, as
/// 1.4 writes it in `peer_disconnected` details: `0s`, `63ms`, `1.5s`,
/// `7m59.5s`, `1h0m0s`.
pub fn go_duration(d: std::time::Duration) -> String {
    let ms = (d.as_micros() + 500) / 1000;
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    let (sec, frac) = (rest / 1000, rest % 1000);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    out.push_str(&sec.to_string());
    if frac > 0 {
        let f = format!("{frac:03}");
        out.push('.');
        out.push_str(f.trim_end_matches('0'));
    }
    out.push('s');
    out
}

struct Live {
    file: File,
    size: u64,
}

/// The audit log of one data directory.
pub struct AuditLog {
    path: PathBuf,
    max_bytes: u64,
    max_files: u32,
    live: Mutex<Option<Live>>,
}

fn open_live(path: &Path) -> io::Result<Live> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .open(path)?;
    let size = file.metadata()?.len();
    Ok(Live { file, size })
}

impl AuditLog {
    /// Opens (appending to) `data_dir/audit/audit.jsonl`.
    pub fn open(data_dir: &Path, max_size_mb: u64, max_files: u32) -> io::Result<AuditLog> {
        let dir = data_dir.join("audit");
        crate::storage::segment::create_dir_all(&dir)?;
        let path = dir.join("audit.jsonl");
        let live = open_live(&path)?;
        Ok(AuditLog {
            path,
            max_bytes: max_size_mb.max(1) * 1024 * 1024,
            max_files: max_files.max(1),
            live: Mutex::new(Some(live)),
        })
    }

    /// Path of the live file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record (with the current time); errors are logged, never
    /// returned, and a closed log ignores the call.
    pub fn log(&self, mut ev: AuditEvent) {
        ev.ts = format_ts(SystemTime::now());
        let mut line = serde_json::to_vec(&ev).expect("audit event serialises");
        line.push(b'\n');
        let mut guard = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let Some(live) = guard.as_mut() else { return };
        if let Err(e) = live.file.write_all(&line) {
            log::error!("audit: cannot write {}: {e}", self.path.display());
            return;
        }
        live.size += line.len() as u64;
        if live.size >= self.max_bytes {
            match self.rotate() {
                Ok(fresh) => *guard = Some(fresh),
                Err(e) => log::error!("audit: rotation of {} failed: {e}", self.path.display()),
            }
        }
    }

    fn numbered(&self, n: u32) -> PathBuf {
        let mut p = self.path.as_os_str().to_owned();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    }

    fn rotate(&self) -> io::Result<Live> {
        for n in (1..self.max_files).rev() {
            let from = self.numbered(n);
            if from.exists() {
                fs::rename(&from, self.numbered(n + 1))?;
            }
        }
        fs::rename(&self.path, self.numbered(1))?;
        let _ = fs::remove_file(self.numbered(self.max_files + 1));
        open_live(&self.path)
    }

    /// Flushes to disk and stops logging. Idempotent.
    pub fn close(&self) {
        if let Some(live) = self.live.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = live.file.sync_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_go() {
        use std::time::Duration as D;
        assert_eq!(go_duration(D::ZERO), "0s");
        assert_eq!(go_duration(D::from_micros(63_400)), "63ms");
        assert_eq!(go_duration(D::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(D::from_millis(62_345)), "1m2.345s");
        assert_eq!(go_duration(D::from_millis(479_500)), "7m59.5s");
        assert_eq!(go_duration(D::from_secs(3600)), "1h0m0s");
    }

    #[test]
    fn records_and_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(dir.path(), 1, 2).unwrap();
        let mut ev = AuditEvent::new("forward");
        ev.message_id = "m1".into();
        ev.channel = "temps".into();
        ev.direction = "inbound".into();
        ev.peer = "sensor-1".into();
        log.log(ev);
        let text = fs::read_to_string(log.path()).unwrap();
        assert!(text.starts_with("{\"ts\":\""), "{text}");
        assert!(text.ends_with(
            "\"event\":\"forward\",\"message_id\":\"m1\",\"channel\":\"temps\",\"direction\":\"inbound\",\"peer\":\"sensor-1\"}\n"
        ));
        // Fill past 1 MiB three times: at most 2 rotated files plus the live one.
        let big = "x".repeat(200_000);
        for _ in 0..20 {
            let mut e = AuditEvent::new("client_connected");
            e.detail = big.clone();
            log.log(e);
        }
        let audit = dir.path().join("audit");
        assert!(audit.join("audit.jsonl.1").exists());
        assert!(audit.join("audit.jsonl.2").exists());
        assert!(!audit.join("audit.jsonl.3").exists());
        log.close();
        log.log(AuditEvent::new("ignored after close"));
    }
}
