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

use crate::envelope::{format_ts, push_json_str};

/// One audit record; its `ts` is the time it is logged.
#[derive(Debug, Default, Clone)]
pub struct AuditEvent {
    pub event: &'static str,
    pub message_id: String,
    pub channel: String,
    pub direction: String,
    pub peer: String,
    pub peer_addr: String,
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

    fn record<'a>(&'a self, ts: &'a str) -> Record<'a> {
        Record {
            ts,
            event: self.event,
            message_id: &self.message_id,
            channel: &self.channel,
            direction: &self.direction,
            peer: &self.peer,
            peer_addr: &self.peer_addr,
            detail: &self.detail,
        }
    }
}

/// The line of one record, in 1.4's key order; empty fields are omitted.
#[derive(Serialize)]
struct Record<'a> {
    ts: &'a str,
    event: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    message_id: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    channel: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    direction: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    peer: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    peer_addr: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    detail: &'a str,
}

/// One line of the log.
enum Line<'a> {
    Record(Record<'a>),
    /// A `forward` record: `head` ends with `"message_id":`, the id follows
    /// as a JSON string, then `tail` (the other keys and the closing brace).
    Forward {
        head: &'a [u8],
        id: &'a str,
        tail: &'a [u8],
    },
}

impl Line<'_> {
    /// Appends the line, with its `\n`, to `buf`.
    fn write_to(&self, buf: &mut Vec<u8>) {
        match self {
            Line::Record(rec) => {
                serde_json::to_writer(&mut *buf, rec).expect("audit record serialises")
            }
            Line::Forward { head, id, tail } => {
                buf.extend_from_slice(head);
                push_json_str(buf, id);
                buf.extend_from_slice(tail);
            }
        }
        buf.push(b'\n');
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

/// Records are written in pieces of about this many bytes. A batch of
/// 19,000 forwards is 3.6 MB of lines: built in one buffer, that buffer was
/// mapped fresh for every batch (hubs fix glibc's mmap threshold, see
/// `memtrim`), and faulting its pages in took more time than writing them.
const WRITE_CHUNK_BYTES: usize = 64 * 1024;

/// The audit log of one data directory.
pub struct AuditLog {
    path: PathBuf,
    max_bytes: u64,
    max_files: u32,
    state: Mutex<State>,
}

/// What writing takes, under one lock.
struct State {
    /// The open file; `None` once closed.
    live: Option<Live>,
    /// The buffer records are encoded into, kept between writes.
    scratch: Vec<u8>,
}

/// Opens the live file for appending. A torn last line (1.4 never fsyncs
/// its audit log; a crash of either leaves one) is cut first, so the next
/// record starts a line of its own instead of being glued to the fragment.
fn open_live(path: &Path) -> io::Result<Live> {
    let file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o644)
        .open(path)?;
    let size = crate::storage::segment::repair_tail(&file, path)?;
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
            state: Mutex::new(State {
                live: Some(live),
                scratch: Vec::new(),
            }),
        })
    }

    /// Path of the live file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record (with the current time); errors are logged, never
    /// returned, and a closed log ignores the call.
    pub fn log(&self, ev: AuditEvent) {
        let ts = format_ts(SystemTime::now());
        self.write_records(std::iter::once(Line::Record(ev.record(&ts))));
    }

    /// Appends one `forward` record per id of a batch forwarded on `channel`
    /// to or from `peer` (`direction` is `inbound` or `outbound`), with one
    /// timestamp and one write for the batch (rotating where a record fills
    /// the file, as [`AuditLog::log`] does). The keys around the id are the
    /// same for every record of the batch, so they are encoded once.
    pub fn log_forwards<'a>(
        &self,
        direction: &str,
        peer: &str,
        channel: &str,
        ids: impl IntoIterator<Item = &'a str>,
    ) {
        let mut ids = ids.into_iter().peekable();
        if ids.peek().is_none() {
            return;
        }
        let ts = format_ts(SystemTime::now());
        let record = |message_id| Record {
            ts: &ts,
            event: "forward",
            message_id,
            channel,
            direction,
            peer,
            peer_addr: "",
            detail: "",
        };
        // `{"ts":…,"event":"forward"` is followed by the id, then by what a
        // record without an id has after those two keys.
        let head_only = Record {
            channel: "",
            direction: "",
            peer: "",
            ..record("")
        };
        let mut head = serde_json::to_vec(&head_only).expect("audit record serialises");
        head.pop(); // its closing brace
        let without_id = serde_json::to_vec(&record("")).expect("audit record serialises");
        let tail = &without_id[head.len()..];
        head.extend_from_slice(b",\"message_id\":");
        self.write_records(ids.map(|id| match id.is_empty() {
            false => Line::Forward {
                head: &head,
                id,
                tail,
            },
            true => Line::Record(record(id)),
        }));
    }

    /// Writes records with as few writes as rotation allows: the file rotates
    /// right after the record that brings it to the size limit.
    fn write_records<'a>(&self, records: impl IntoIterator<Item = Line<'a>>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State {
            live: guard,
            scratch: buf,
        } = &mut *state;
        if guard.is_none() {
            return;
        }
        buf.clear();
        for rec in records {
            rec.write_to(buf);
            let Some(live) = guard.as_mut() else { return };
            if buf.len() >= WRITE_CHUNK_BYTES && !self.append(live, buf) {
                return;
            }
            if live.size + buf.len() as u64 >= self.max_bytes {
                if !self.append(live, buf) {
                    return;
                }
                match self.rotate() {
                    Ok(fresh) => *guard = Some(fresh),
                    Err(e) => log::error!("audit: rotation of {} failed: {e}", self.path.display()),
                }
            }
        }
        if let Some(live) = guard.as_mut() {
            self.append(live, buf);
        }
        if buf.capacity() > 2 * WRITE_CHUNK_BYTES {
            // A record longer than a chunk grew it: give that back.
            *buf = Vec::new();
        }
    }

    /// Writes and empties `buf`; `false` (logged) if the write failed.
    fn append(&self, live: &mut Live, buf: &mut Vec<u8>) -> bool {
        if buf.is_empty() {
            return true;
        }
        let res = live.file.write_all(buf);
        let len = buf.len() as u64;
        buf.clear();
        match res {
            Ok(()) => {
                live.size += len;
                true
            }
            Err(e) => {
                log::error!("audit: cannot write {}: {e}", self.path.display());
                false
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
        let live = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .live
            .take();
        if let Some(live) = live {
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
        log.log_forwards("inbound", "p", "c", ["ignored"]);
    }

    /// A torn last line left by a crash (of 1.4 or of this process) is cut
    /// on open: the next record is a line of its own, the lines before it
    /// kept.
    #[test]
    fn a_torn_last_line_is_cut_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let audit = dir.path().join("audit");
        fs::create_dir_all(&audit).unwrap();
        let kept = "{\"ts\":\"2026-03-31T14:22:01Z\",\"event\":\"client_connected\"}\n";
        fs::write(
            audit.join("audit.jsonl"),
            format!("{kept}{{\"ts\":\"2026-03-31T14:22:0"),
        )
        .unwrap();
        let log = AuditLog::open(dir.path(), 1, 2).unwrap();
        log.log(AuditEvent::new("hub_started"));
        let text = fs::read_to_string(log.path()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(format!("{}\n", lines[0]), kept);
        let last: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(last["event"], "hub_started");
    }

    /// A forward record encoded once around its id reads as serde writes
    /// the whole record, whatever the id's characters and whichever of the
    /// other keys are empty.
    #[test]
    fn forward_lines_are_what_serde_writes() {
        let ids: Vec<String> = [
            "plain",
            "q\"uote",
            "back\\slash",
            "ünï\u{1F600}",
            "\u{1}ctl",
            "",
        ]
        .map(String::from)
        .to_vec();
        for (direction, peer, channel) in [
            ("inbound", "p", "c"),
            ("outbound", "", "c\"h"),
            ("", "", ""),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let log = AuditLog::open(dir.path(), 1, 3).unwrap();
            log.log_forwards(direction, peer, channel, ids.iter().map(String::as_str));
            let text = fs::read_to_string(log.path()).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), ids.len());
            for (line, id) in lines.iter().zip(&ids) {
                let ts: serde_json::Value = serde_json::from_str(line).unwrap();
                let ts = ts["ts"].as_str().unwrap();
                let want = serde_json::to_string(&Record {
                    ts,
                    event: "forward",
                    message_id: id,
                    channel,
                    direction,
                    peer,
                    peer_addr: "",
                    detail: "",
                })
                .unwrap();
                assert_eq!(*line, want);
            }
        }
    }

    /// A batch of forwards is one record per id, with the keys of a single
    /// `log`, and it rotates at the record that fills the file.
    #[test]
    fn forwards_of_a_batch_are_one_record_each_and_rotate() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(dir.path(), 1, 3).unwrap();
        let ids: Vec<String> = (0..3).map(|i| format!("id-{i}")).collect();
        log.log_forwards("outbound", "hub-a", "temps", ids.iter().map(String::as_str));
        let text = fs::read_to_string(log.path()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        for (line, id) in lines.iter().zip(&ids) {
            assert!(line.starts_with("{\"ts\":\""), "{line}");
            assert!(line.ends_with(&format!(
                "\"event\":\"forward\",\"message_id\":\"{id}\",\"channel\":\"temps\",\"direction\":\"outbound\",\"peer\":\"hub-a\"}}"
            )), "{line}");
        }
        // About 1.3 MiB of records in one batch: the file rotates once, right
        // after the record that reaches 1 MiB, and nothing is lost.
        let many: Vec<String> = (0..6_000).map(|i| format!("{i:0>100}")).collect();
        log.log_forwards("inbound", "p", "c", many.iter().map(String::as_str));
        let audit = dir.path().join("audit");
        let rotated = fs::read_to_string(audit.join("audit.jsonl.1")).unwrap();
        let live = fs::read_to_string(log.path()).unwrap();
        assert!(!audit.join("audit.jsonl.2").exists());
        let limit = 1024 * 1024;
        assert!(rotated.len() >= limit, "{}", rotated.len());
        let last_len = rotated.lines().last().unwrap().len() + 1;
        assert!(rotated.len() - last_len < limit, "rotated late");
        assert_eq!(
            rotated.lines().count() + live.lines().count(),
            3 + many.len()
        );
        assert!(live.lines().last().unwrap().contains(&many[5_999]));
    }
}
