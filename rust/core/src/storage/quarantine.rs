//! Records on disk that cannot be read, and data that is gone.
//!
//! An unreadable record (not JSON, not a valid envelope, or a payload the
//! reader cannot represent, such as one nested 100,000 deep) is quarantined:
//! its bytes are copied to `data_dir/quarantine/<channel>/<offset>.jsonl`
//! (the record as it was on disk, plus `\n`), it is counted, and it is logged
//! once (the first reader to meet it creates the copy; later readers, also
//! after a restart, find the copy and stay quiet). Readers then go on past
//! it. A corrupt run of bytes glued to a valid record that follows it is
//! split off ([`split_point`]), so the valid neighbour is still delivered.
//!
//! Counters are process-wide (every reader of every data directory in the
//! process adds to them).

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::segment;
use crate::envelope::{check_payload_depth, Envelope, EnvelopeRef};

/// Directory under `data_dir` holding quarantined records.
pub const QUARANTINE_DIR: &str = "quarantine";

static GAPS: AtomicU64 = AtomicU64::new(0);
static GAP_BYTES: AtomicU64 = AtomicU64::new(0);
static QUARANTINED: AtomicU64 = AtomicU64::new(0);

/// Process-wide counts of data loss seen by readers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LossCounts {
    /// Gaps met by readers (a reader's position pointed into deleted data).
    pub gaps: u64,
    /// Bytes in those gaps.
    pub gap_bytes: u64,
    /// Unreadable records quarantined (each counted once).
    pub quarantined: u64,
}

/// The counters now.
pub fn loss_counts() -> LossCounts {
    LossCounts {
        gaps: GAPS.load(Ordering::Relaxed),
        gap_bytes: GAP_BYTES.load(Ordering::Relaxed),
        quarantined: QUARANTINED.load(Ordering::Relaxed),
    }
}

/// Counts and logs (WARNING) a gap `from..to` met by `reader` on `channel`.
pub fn report_gap(channel: &str, reader: &str, from: u64, to: u64) {
    GAPS.fetch_add(1, Ordering::Relaxed);
    GAP_BYTES.fetch_add(to.saturating_sub(from), Ordering::Relaxed);
    log::warn!(
        "channel {channel:?}: {reader} met a gap: bytes {from}..{to} are gone \
         (deleted by retention or a removed or truncated segment)"
    );
}

/// `data_dir/quarantine/<channel>` (the name must already be validated).
pub fn quarantine_dir(data_dir: &Path, channel: &str) -> PathBuf {
    data_dir.join(QUARANTINE_DIR).join(channel)
}

/// Path of the copy of the record at `offset` of `channel`.
pub fn quarantine_path(data_dir: &Path, channel: &str, offset: u64) -> PathBuf {
    quarantine_dir(data_dir, channel).join(format!("{offset:020}.jsonl"))
}

/// Where the bytes of a record to quarantine are.
pub enum Source<'a> {
    /// The record (without its line feed), in memory.
    Bytes(&'a [u8]),
    /// `len` bytes (without the line feed) at `at` of the segment file
    /// `segment`: a line over the record limit, never read whole.
    Range {
        segment: &'a Path,
        at: u64,
        len: u64,
    },
}

impl Source<'_> {
    fn len(&self) -> u64 {
        match self {
            Source::Bytes(b) => b.len() as u64,
            Source::Range { len, .. } => *len,
        }
    }

    fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        match self {
            Source::Bytes(b) => out.write_all(b),
            Source::Range { segment, at, len } => {
                use std::io::{Read, Seek, SeekFrom};
                let mut f = std::fs::File::open(segment)?;
                f.seek(SeekFrom::Start(*at))?;
                let copied = io::copy(&mut f.take(*len), out)?;
                if copied < *len {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("{} ended {} bytes early", segment.display(), len - copied),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// Quarantines the unreadable record `bytes` at `offset` of `channel`: the
/// first time, copies it aside, counts it and logs it (WARNING, with the
/// channel, offset, reason and copy); later calls for the same record do
/// nothing. A copy that cannot be written is logged; the reader goes on.
pub fn quarantine(data_dir: &Path, channel: &str, offset: u64, bytes: &[u8], reason: &str) {
    quarantine_from(data_dir, channel, offset, Source::Bytes(bytes), reason);
}

/// [`quarantine`] of a record wherever it is ([`Source`]).
pub fn quarantine_from(data_dir: &Path, channel: &str, offset: u64, src: Source<'_>, reason: &str) {
    let path = quarantine_path(data_dir, channel, offset);
    match copy_from(data_dir, channel, offset, &src) {
        Ok(false) => {
            log::debug!("channel {channel:?}: record at offset {offset} was already quarantined")
        }
        Ok(true) => {
            QUARANTINED.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "channel {channel:?}: quarantined the unreadable record at offset {offset} \
                 ({} bytes): {reason}; copy in {}",
                src.len(),
                path.display()
            );
        }
        Err(e) => {
            static FAILED: crate::lograte::RateLimit =
                crate::lograte::RateLimit::new(std::time::Duration::from_secs(10));
            QUARANTINED.fetch_add(1, Ordering::Relaxed);
            if let Some(n) = FAILED.check() {
                log::warn!(
                    "channel {channel:?}: unreadable record at offset {offset} ({reason}) \
                     skipped; cannot copy it to {}: {e}{n}",
                    path.display()
                );
            }
        }
    }
}

/// Copies the record `bytes` found at `offset` of `channel` to its file
/// under `quarantine/` ([`quarantine_path`]), synced with its directory
/// entry; false when a copy was there already. Written under a temporary
/// name and renamed, so a copy found is always whole.
pub fn copy_aside(data_dir: &Path, channel: &str, offset: u64, bytes: &[u8]) -> io::Result<bool> {
    copy_from(data_dir, channel, offset, &Source::Bytes(bytes))
}

/// [`copy_aside`] of a record wherever it is ([`Source`]). Readers of one
/// channel (subscribers, `read_channel`, federation) meet an unreadable
/// record at the same time: each writes its own temporary file and links it
/// to the copy's name, which only one can do (`false` for the others), so a
/// copy found is always whole and each record is counted once.
pub fn copy_from(
    data_dir: &Path,
    channel: &str,
    offset: u64,
    src: &Source<'_>,
) -> io::Result<bool> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = quarantine_path(data_dir, channel, offset);
    if path.exists() {
        return Ok(false);
    }
    let dir = quarantine_dir(data_dir, channel);
    segment::create_dir_all(&dir)?;
    let mut tmp = path.clone().into_os_string();
    tmp.push(format!(
        ".{}-{}.tmp",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = PathBuf::from(tmp);
    let written = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        src.write_to(&mut f)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        match std::fs::hard_link(&tmp, &path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            // A file system without hard links: a rename (the last whole copy wins).
            Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                std::fs::rename(&tmp, &path).map(|()| true)
            }
            Err(e) => Err(e),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    if written? {
        segment::sync_dir(&dir)?;
        return Ok(true);
    }
    Ok(false)
}

/// Removes the temporary files of [`copy_from`] under `data_dir/quarantine/`
/// whose writing process is gone (a crash between writing and linking one);
/// a live process's, another's reading the directory now, are left alone.
/// Failures are logged, never fatal: a stray temporary file is only space.
pub fn remove_stale_temporaries(data_dir: &Path) {
    let Ok(channels) = std::fs::read_dir(data_dir.join(QUARANTINE_DIR)) else {
        return;
    };
    for dir in channels.flatten() {
        let Ok(files) = std::fs::read_dir(dir.path()) else {
            continue;
        };
        for file in files.flatten() {
            let name = file.file_name();
            let Some(pid) = name.to_str().and_then(temporary_writer) else {
                continue;
            };
            if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            match std::fs::remove_file(file.path()) {
                Ok(()) => log::info!(
                    "removed {}, a quarantine copy left unfinished by a crash",
                    file.path().display()
                ),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => log::warn!("cannot remove {}: {e}", file.path().display()),
            }
        }
    }
}

/// The process id in a temporary file name of [`copy_from`]
/// (`<offset>.jsonl.<pid>-<n>.tmp`).
fn temporary_writer(name: &str) -> Option<u32> {
    let stem = name.strip_suffix(".tmp")?;
    let (copy, writer) = stem.rsplit_once('.')?;
    if !copy.ends_with(".jsonl") {
        return None;
    }
    let (pid, n) = writer.split_once('-')?;
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Decodes a stored line with the reader rules and the payload-depth rule
/// of a valid record ([`check_payload_depth`]); the error is the reason the
/// record is unreadable. Header fields are not re-checked, so records other
/// writers (keyop-messenger 1.4) accept stay readable.
pub fn decode_stored(line: &[u8]) -> Result<Envelope, String> {
    let env = Envelope::decode(line).map_err(|e| format!("unreadable record: {e}"))?;
    check_payload_depth(env.payload.get().as_bytes()).map_err(|e| e.to_string())?;
    Ok(env)
}

/// [`decode_stored`] borrowing the fields from `line` ([`EnvelopeRef`]).
pub fn decode_stored_ref(line: &[u8]) -> Result<EnvelopeRef<'_>, String> {
    let env = EnvelopeRef::decode(line).map_err(|e| format!("unreadable record: {e}"))?;
    check_payload_depth(env.payload.as_bytes()).map_err(|e| e.to_string())?;
    Ok(env)
}

/// Where a valid record starts inside an unreadable line, if one does: the
/// bytes before it are a corrupt record (for example a torn write) glued to
/// its neighbour, which must not be lost with it.
pub fn split_point(line: &[u8]) -> Option<usize> {
    let mut from = 1;
    while from < line.len() {
        let i = from + memchr::memmem::find(&line[from..], b"{\"v\":")?;
        if Envelope::decode(&line[i..]).is_ok() {
            return Some(i);
        }
        from = i + 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Readers copying one record at once: one copy, whole, made by one of
    /// them; no temporary file left.
    #[test]
    fn concurrent_copies_of_one_record_make_one_whole_copy() {
        let dir = tempfile::tempdir().unwrap();
        let record = vec![b'x'; 256 * 1024];
        let made: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| copy_aside(dir.path(), "ch", 148, &record).unwrap()))
                .collect();
            handles
                .into_iter()
                .map(|h| usize::from(h.join().unwrap()))
                .sum()
        });
        assert_eq!(made, 1);
        let copy = std::fs::read(quarantine_path(dir.path(), "ch", 148)).unwrap();
        assert_eq!(copy.len(), record.len() + 1);
        let names: Vec<_> = std::fs::read_dir(quarantine_dir(dir.path(), "ch"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    /// Temporary files of a crashed writer go; a live writer's, the copies
    /// and files of other shapes stay.
    #[test]
    fn temporaries_of_a_process_gone_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let q = quarantine_dir(dir.path(), "ch");
        std::fs::create_dir_all(&q).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let me = std::process::id();
        let names = [
            "148.jsonl".to_owned(),
            format!("149.jsonl.{gone}-0.tmp"),
            format!("150.jsonl.{me}-3.tmp"),
            "notes.tmp".to_owned(),
            format!("151.txt.{gone}-1.tmp"),
        ];
        for name in &names {
            std::fs::write(q.join(name), b"x").unwrap();
        }
        assert_eq!(temporary_writer(&names[1]), Some(gone));
        remove_stale_temporaries(dir.path());
        let mut left: Vec<_> = std::fs::read_dir(&q)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = vec![
            names[0].clone(),
            names[2].clone(),
            names[4].clone(),
            names[3].clone(),
        ];
        want.sort();
        assert_eq!(left, want);
        // No quarantine directory at all is fine.
        remove_stale_temporaries(&dir.path().join("nothing"));
    }

    #[test]
    fn split_finds_a_valid_record_after_garbage() {
        let good = br#"{"v":1,"id":"a","ts":"2026-03-31T14:22:01Z","channel":"c","origin":"o","payload_type":"t","payload":{"v":2}}"#;
        let mut line = b"{\"v\":1,\"id\":\"torn".to_vec();
        line.extend_from_slice(good);
        assert_eq!(split_point(&line), Some(17));
        assert_eq!(split_point(good), None);
        assert_eq!(split_point(b"garbage"), None);
    }
}
