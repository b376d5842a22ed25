//! Torn-tail recovery and the line reader, on channel files made of
//! arbitrary bytes.
//!
//! The input is split at its first two 0xFF bytes into up to three segment
//! files of one channel, each named after the global offset where the
//! previous one ends (as the writer names a segment when it rolls); only the
//! last one may be empty. Sealed segments may end in an unterminated
//! fragment too. Checked:
//!
//! * before recovery, a reader from offset 0 returns exactly the complete
//!   lines of every segment, in order, each at its true global offset,
//!   without its `\n` and without any line feed inside; unterminated
//!   fragments are never returned; a reader started just after any of
//!   these lines (a saved cursor) returns exactly the lines that follow;
//! * opening the store cuts the active (last) segment to its longest prefix
//!   ending in a line feed (empty if it has none) and leaves sealed
//!   segments untouched; opening it again changes nothing;
//! * the channel's writer starts at the end of what was kept, a reader
//!   limited by it returns the same lines, and an appended record starts
//!   exactly where the torn fragment began and is read back whole.

#![no_main]

use std::fs;
use std::path::{Path, PathBuf};

use keyop_core::storage::segment::{list_segments, segment_path};
use keyop_core::storage::{Item, LogReader, Store};
use keyop_core::{read_channel, StoreConfig};
use libfuzzer_sys::fuzz_target;

const CHANNEL: &str = "fuzz";

/// A complete line: global offset and bytes (without the `\n`).
type Line = (u64, Vec<u8>);

/// Complete lines of `content`, a segment starting at global `start`.
fn complete_lines(start: u64, content: &[u8]) -> Vec<Line> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(i) = content[at..].iter().position(|&b| b == b'\n') {
        out.push((start + at as u64, content[at..at + i].to_vec()));
        at += i + 1;
    }
    out
}

fn read_all(mut reader: LogReader, limit: u64) -> Vec<Line> {
    let mut out = Vec::new();
    // Every step returns an item or ends; a reader that loops is a bug.
    for _ in 0..100_000 {
        match reader.next_item(limit).expect("read") {
            Some(Item::Record { offset, line, .. }) => {
                assert!(!line.contains(&b'\n'), "a line feed inside a line");
                out.push((offset, line));
            }
            Some(other) => panic!("unexpected item {other:?}"),
            None => return out,
        }
    }
    panic!("the reader does not stop");
}

/// A fresh directory under `$TMPDIR` when it is set, else under `/dev/shm`
/// when there is one: recovery and appends fsync, which costs nothing on
/// tmpfs and makes the target about ten times faster than on a disk.
fn scratch_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let base = match std::env::var_os("TMPDIR") {
        Some(dir) => PathBuf::from(dir),
        None if shm.is_dir() => shm.to_owned(),
        None => std::env::temp_dir(),
    };
    tempfile::tempdir_in(base).expect("temporary directory")
}

fn config(data: &Path) -> StoreConfig {
    StoreConfig {
        data_dir: data.to_owned(),
        sync_interval_ms: 0,
        segment_bytes: 0,
    }
}

fuzz_target!(|input: &[u8]| {
    let mut segments: Vec<&[u8]> = input.splitn(3, |&b| b == 0xFF).collect();
    // An empty segment followed by another would share its name; the writer
    // never seals an empty segment, so only the last one may be empty.
    let last = segments.pop().expect("splitn yields at least one part");
    segments.retain(|s| !s.is_empty());
    segments.push(last);
    let tmp = scratch_dir();
    let data = tmp.path();
    let dir = data.join("channels").join(CHANNEL);
    fs::create_dir_all(&dir).expect("channel directory");

    let mut starts = Vec::new();
    let mut want = Vec::new();
    let mut start = 0u64;
    for content in &segments {
        fs::write(segment_path(&dir, start), content).expect("write segment");
        starts.push(start);
        want.extend(complete_lines(start, content));
        start += content.len() as u64;
    }
    assert_eq!(list_segments(&dir).expect("list"), starts);
    let last_start = *starts.last().expect("at least one segment");
    let last = *segments.last().expect("at least one segment");
    let kept = last.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let end = last_start + kept as u64;

    let before = read_all(
        read_channel(data, CHANNEL, 0).expect("channel name"),
        u64::MAX,
    );
    assert_eq!(before, want, "lines read before recovery");
    // A cursor saved after any record resumes with the records after it;
    // after the last line of a sealed segment that ends in a fragment, the
    // reader has to skip the fragment to reach the next segment.
    for (k, (offset, line)) in want.iter().enumerate().take(16) {
        let resumed = read_all(
            LogReader::new(&dir, offset + line.len() as u64 + 1),
            u64::MAX,
        );
        assert_eq!(resumed, want[k + 1..], "resumed after record {k}");
    }

    let store = Store::open(config(data)).expect("open the store");
    for (i, (&s, content)) in starts.iter().zip(&segments).enumerate() {
        let now = fs::read(segment_path(&dir, s)).expect("read segment");
        if i + 1 < segments.len() {
            assert_eq!(&now[..], *content, "a sealed segment was changed");
        } else {
            assert_eq!(&now[..], &last[..kept], "the active segment's tail");
        }
    }
    let writer = store.writer(CHANNEL).expect("writer");
    assert_eq!(writer.committed_end(), end);
    assert_eq!(
        read_all(LogReader::new(&dir, 0), writer.committed_end()),
        want
    );

    let record = b"{\"v\":1}\n";
    let at = writer.append(record, 1).expect("append");
    assert_eq!((at.offset, at.end), (end, end + record.len() as u64));
    store.close();
    drop(store);

    // Recovery is idempotent: a second open keeps every byte.
    let store = Store::open(config(data)).expect("reopen the store");
    let writer = store.writer(CHANNEL).expect("writer");
    assert_eq!(writer.committed_end(), at.end);
    let mut with_record = want;
    with_record.push((end, record[..record.len() - 1].to_vec()));
    assert_eq!(
        read_all(LogReader::new(&dir, 0), writer.committed_end()),
        with_record
    );
    store.close();
});
