// why this file is long: the integration tests of the on-disk contract (disk-format.md 1-5)
// share their helpers; one test file per engine area.
//! Integration tests of keyop-core storage against the on-disk contract of
//! keyop-messenger 1.4 (`shared/spec/disk-format.md` sections 1-5) and the
//! publish guarantees of `shared/spec/semantics.md` section 2.

use std::collections::{HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::thread;

use keyop_core::storage::{FaultPoint, Item, LogReader, StorageError};
use keyop_core::{read_channel, Engine, Envelope, Error, Outgoing, Published, StoreConfig};
use serde_json::Value;
use tempfile::TempDir;

/// Largest record the format allows, newline included (10 MiB).
const MAX_RECORD: usize = 10 * 1024 * 1024;
/// File name of the first segment of every channel.
const SEG0: &str = "00000000000000000000.jsonl";
/// Upper bound on items any single read-through may return.
const READ_BOUND: usize = 100_000;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn tempdir() -> TempDir {
    tempfile::tempdir().expect("create temp dir")
}

fn open_engine(data_dir: &Path, sync_interval_ms: u64, segment_bytes: u64) -> Engine {
    let cfg = StoreConfig {
        data_dir: data_dir.to_owned(),
        sync_interval_ms,
        segment_bytes,
    };
    match Engine::open(cfg, "sensor-1") {
        Ok(e) => e,
        Err(e) => panic!("open engine on {}: {e}", data_dir.display()),
    }
}

/// A message of type `com.example.Test` without optional fields.
fn msg(payload_json: &[u8]) -> Outgoing<'_> {
    Outgoing {
        payload_type: "com.example.Test",
        payload_json,
        service_name: None,
        correlation_id: None,
    }
}

fn channel_dir(data_dir: &Path, channel: &str) -> PathBuf {
    data_dir.join("channels").join(channel)
}

fn segment_file_name(start: u64) -> String {
    format!("{start:020}.jsonl")
}

/// Every file of a channel directory, which must all be 20-digit segments:
/// (start offset, content), ascending.
fn segments(dir: &Path) -> Vec<(u64, Vec<u8>)> {
    let mut segs = Vec::new();
    for entry in fs::read_dir(dir).expect("list channel dir") {
        let entry = entry.expect("dir entry");
        let name = entry.file_name().into_string().expect("utf-8 file name");
        let stem = name
            .strip_suffix(".jsonl")
            .unwrap_or_else(|| panic!("not a segment: {name}"));
        assert!(
            stem.len() == 20 && stem.bytes().all(|b| b.is_ascii_digit()),
            "segment name is not 20 digits: {name}"
        );
        let start: u64 = stem.parse().expect("segment start");
        segs.push((start, fs::read(entry.path()).expect("read segment")));
    }
    segs.sort_by_key(|s| s.0);
    segs
}

fn file_len(path: &Path) -> u64 {
    fs::metadata(path).expect("stat").len()
}

/// Splits a segment's bytes into (offset within the segment, line without
/// `\n`); the content must end with a line feed.
fn split_lines(bytes: &[u8]) -> Vec<(u64, &[u8])> {
    assert!(
        bytes.is_empty() || bytes.ends_with(b"\n"),
        "segment does not end with a line feed"
    );
    let mut out = Vec::new();
    let mut off = 0;
    for line in bytes.split_inclusive(|&b| b == b'\n') {
        out.push((off, &line[..line.len() - 1]));
        off += line.len() as u64;
    }
    out
}

/// `bytes` must be exactly one `\n`-terminated line; returns it without `\n`.
fn only_line(bytes: &[u8]) -> &[u8] {
    let line = bytes.strip_suffix(b"\n").expect("line is terminated");
    assert!(!line.contains(&b'\n'), "more than one line");
    line
}

/// Every line of every segment: (global offset, segment start, line).
fn lines_on_disk(dir: &Path) -> Vec<(u64, u64, Vec<u8>)> {
    let mut out = Vec::new();
    for (start, bytes) in segments(dir) {
        for (off, line) in split_lines(&bytes) {
            out.push((start + off, start, line.to_vec()));
        }
    }
    out
}

/// Reads everything up to `limit` (bounded).
fn read_until(reader: &mut LogReader, limit: u64) -> Vec<Item> {
    let mut items = Vec::new();
    while let Some(item) = reader.next_item(limit).expect("read item") {
        items.push(item);
        assert!(items.len() < READ_BOUND, "reader does not stop");
    }
    items
}

fn read_all(reader: &mut LogReader) -> Vec<Item> {
    read_until(reader, u64::MAX)
}

/// The records of `items` as (offset, segment, line); panics on other items.
fn records(items: Vec<Item>) -> Vec<(u64, u64, Vec<u8>)> {
    items
        .into_iter()
        .map(|item| match item {
            Item::Record {
                offset,
                segment,
                line,
            } => (offset, segment, line),
            other => panic!("expected a record, got {other:?}"),
        })
        .collect()
}

fn decode(line: &[u8]) -> Envelope {
    Envelope::decode(line).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(line)))
}

/// (offset, id) of every record of `channel`, read through `read_channel`;
/// every record must decode.
fn ids_on_disk(data_dir: &Path, channel: &str) -> Vec<(u64, String)> {
    let mut reader = read_channel(data_dir, channel, 0).expect("reader");
    records(read_all(&mut reader))
        .into_iter()
        .map(|(offset, _, line)| (offset, decode(&line).id))
        .collect()
}

fn published_ids(published: &[Published]) -> Vec<(u64, String)> {
    published.iter().map(|p| (p.offset, p.id.clone())).collect()
}

/// The OS error number of an `Error::Storage` I/O failure.
fn storage_errno(result: Result<Published, Error>) -> i32 {
    match result {
        Err(Error::Storage(e)) => e
            .raw_os_error()
            .unwrap_or_else(|| panic!("storage error without errno: {e}")),
        Err(e) => panic!("expected a storage error, got {e}"),
        Ok(p) => panic!("expected a storage error, got {p:?}"),
    }
}

/// A complete record as the Go writer leaves it, numbered `n` (< 256).
fn go_line(n: u8) -> String {
    format!(
        "{{\"v\":1,\"id\":\"01970a3c-0000-7000-8000-0000000000{n:02x}\",\"ts\":\"2026-03-31T14:22:01Z\",\
         \"channel\":\"c\",\"origin\":\"go-host\",\"payload_type\":\"t\",\"payload\":{{\"n\":{n}}}}}\n"
    )
}

/// Names of the entries of `dir`.
fn entries(dir: &Path) -> HashSet<String> {
    fs::read_dir(dir)
        .expect("list dir")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .into_string()
                .expect("utf-8")
        })
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).expect("create dir");
    for entry in fs::read_dir(from).expect("list fixture dir") {
        let entry = entry.expect("dir entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), &target).expect("copy fixture file");
        }
    }
}

fn go_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/go-1.4")
}

/// Canonical lowercase UUIDv7: version nibble 7, variant bits `10`.
fn assert_uuid_v7(id: &str) {
    let b = id.as_bytes();
    assert_eq!(b.len(), 36, "{id}");
    for (i, &c) in b.iter().enumerate() {
        if [8, 13, 18, 23].contains(&i) {
            assert_eq!(c, b'-', "{id}");
        } else {
            assert!(c.is_ascii_digit() || (b'a'..=b'f').contains(&c), "{id}");
        }
    }
    assert_eq!(b[14], b'7', "version of {id}");
    assert!(
        matches!(b[19], b'8' | b'9' | b'a' | b'b'),
        "variant of {id}"
    );
}

/// `^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z$` without a trailing zero
/// in the fraction: Go's UTC `time.Time` JSON form.
fn is_go_utc_ts(ts: &str) -> bool {
    let b = ts.as_bytes();
    let digits = |at: usize, n: usize| {
        b.get(at..at + n)
            .is_some_and(|s| s.iter().all(u8::is_ascii_digit))
    };
    let is = |at: usize, c: u8| b.get(at) == Some(&c);
    let date_time = digits(0, 4)
        && is(4, b'-')
        && digits(5, 2)
        && is(7, b'-')
        && digits(8, 2)
        && is(10, b'T')
        && digits(11, 2)
        && is(13, b':')
        && digits(14, 2)
        && is(16, b':')
        && digits(17, 2);
    let Some(rest) = b.get(19..).and_then(|r| r.strip_suffix(b"Z")) else {
        return false;
    };
    date_time
        && match rest.split_first() {
            None => true,
            Some((b'.', frac)) => {
                (1..=9).contains(&frac.len())
                    && frac.iter().all(u8::is_ascii_digit)
                    && frac.last() != Some(&b'0')
            }
            Some(_) => false,
        }
}

// ---------------------------------------------------------------------------
// 1. Line format
// ---------------------------------------------------------------------------

#[test]
fn ts_matcher_accepts_only_go_utc_form() {
    for ok in [
        "2026-03-31T14:22:01Z",
        "2026-03-31T14:22:01.5Z",
        "2026-03-31T14:22:01.123456789Z",
    ] {
        assert!(is_go_utc_ts(ok), "{ok}");
    }
    for bad in [
        "2026-03-31T14:22:01.50Z",
        "2026-03-31T14:22:01.Z",
        "2026-03-31T14:22:01.1234567890Z",
        "2026-03-31T14:22:01+00:00",
        "2026-03-31 14:22:01Z",
        "2026-03-31T14:22:1Z",
        "2026-03-31T14:22:01",
    ] {
        assert!(!is_go_utc_ts(bad), "{bad}");
    }
}

#[test]
fn published_lines_have_the_go_layout() {
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 0);
    let payload = br#"{"temp":21.5,"tags":["a","b"],"note":"x y"}"#;
    let plain = msg(payload);
    let full = Outgoing {
        payload_type: "com.example.Alert",
        payload_json: payload,
        service_name: Some("thermostat"),
        correlation_id: Some("corr-42"),
    };
    let sent = [plain, full, plain];
    let published: Vec<Published> = sent
        .iter()
        .map(|m| engine.publish("alerts", m).expect("publish"))
        .collect();

    let raw = fs::read(channel_dir(tmp.path(), "alerts").join(SEG0)).expect("read segment");
    assert!(raw.ends_with(b"\n"), "last line is not terminated");
    assert!(!raw.contains(&b'\r'), "segment contains a carriage return");
    let lines = split_lines(&raw);
    assert_eq!(lines.len(), sent.len(), "one line per message");

    for ((&(offset, line), m), p) in lines.iter().zip(&sent).zip(&published) {
        assert_eq!(
            p.offset, offset,
            "Published.offset is the line's byte position"
        );
        let text = std::str::from_utf8(line).expect("utf-8 line");
        assert!(text.starts_with("{\"v\":1,\"id\":\""), "{text}");
        let payload_text = std::str::from_utf8(m.payload_json).unwrap();
        assert!(
            text.ends_with(&format!(",\"payload\":{payload_text}}}")),
            "payload not last or not compact: {text}"
        );

        // Keys in Go struct order; optional ones only when set.
        let mut keys = vec!["v", "id", "ts", "channel", "origin", "payload_type"];
        keys.extend(m.correlation_id.map(|_| "correlation_id"));
        keys.extend(m.service_name.map(|_| "service_name"));
        keys.push("payload");
        let positions: Vec<usize> = keys
            .iter()
            .map(|k| {
                text.find(&format!("\"{k}\":"))
                    .unwrap_or_else(|| panic!("key {k} missing: {text}"))
            })
            .collect();
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "key order: {text}"
        );
        if m.correlation_id.is_none() {
            assert!(!text.contains("\"correlation_id\""), "{text}");
            assert!(!text.contains("\"service_name\""), "{text}");
        }

        let v: Value = serde_json::from_slice(line).expect("line is JSON");
        let obj = v.as_object().expect("line is an object");
        assert_eq!(obj.len(), keys.len(), "no other keys: {text}");
        assert!(
            obj["v"].is_u64() && obj["v"].as_u64() == Some(1),
            "v: {text}"
        );
        assert_eq!(obj["id"], Value::from(p.id.as_str()));
        assert_uuid_v7(&p.id);
        let ts = obj["ts"].as_str().expect("ts is a string");
        assert!(is_go_utc_ts(ts), "ts {ts:?}");
        assert_eq!(obj["channel"], "alerts");
        assert_eq!(obj["origin"], "sensor-1");
        assert_eq!(obj["payload_type"], m.payload_type);
        if let (Some(c), Some(s)) = (m.correlation_id, m.service_name) {
            assert_eq!(obj["correlation_id"], c);
            assert_eq!(obj["service_name"], s);
        }
        assert_eq!(
            obj["payload"],
            serde_json::from_slice::<Value>(payload).unwrap()
        );
    }
    assert!(
        published.windows(2).all(|w| w[0].id < w[1].id),
        "ids increase within a process"
    );
}

// ---------------------------------------------------------------------------
// 2. A directory written by keyop-messenger 1.4
// ---------------------------------------------------------------------------

/// What a readable fixture line decodes to (channel is always `alerts`).
struct Good {
    id: &'static str,
    ts_nanos: i64,
    origin: &'static str,
    payload_type: &'static str,
    correlation_id: Option<&'static str>,
    service_name: Option<&'static str>,
    payload: &'static str,
}

/// A fixture line that decodes to nothing but the id, timestamp, origin,
/// type and payload given.
const fn good(
    id: &'static str,
    ts_nanos: i64,
    origin: &'static str,
    payload_type: &'static str,
    payload: &'static str,
) -> Option<Good> {
    Some(Good {
        id,
        ts_nanos,
        origin,
        payload_type,
        correlation_id: None,
        service_name: None,
        payload,
    })
}

/// The fixture's lines in order; `None`: unreadable (corrupt, `v` 2).
const GO_FIXTURE_RECORDS: [Option<Good>; 9] = [
    Some(Good {
        id: "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f",
        ts_nanos: 1_774_966_921_123_456_700,
        origin: "sensor-1",
        payload_type: "com.example.Alert",
        correlation_id: Some("01970a3c-0000-7000-8000-000000000001"),
        service_name: Some("thermostat"),
        payload: r#"{"message":"hot"}"#,
    }),
    Some(Good {
        id: "01970a3c-5e22-7000-8000-000000000002",
        ts_nanos: 1_774_966_922_123_456_700,
        origin: "sensor-2",
        payload_type: "com.example.Alert",
        correlation_id: None,
        service_name: Some("temp > 30 & rising"),
        payload: r#"{"message":"warm \u003c30\u003e \u0026 rising"}"#,
    }),
    good(
        "01970a3c-5e23-7000-8000-000000000003",
        1_774_966_923_000_000_000,
        "sensor-1",
        "com.example.Alert",
        r#"{"message":"cold"}"#,
    ),
    good(
        "01970a3c-5e24-7000-8000-000000000004",
        1_774_966_924_500_000_000,
        "sensor-1",
        "",
        "null",
    ),
    good(
        "01970a3c-5e25-7000-8000-000000000005",
        1_774_966_925_000_000_001,
        "sensor-3",
        "com.example.Reading",
        r#"[21.5,"C",true]"#,
    ),
    None,
    None,
    good(
        "01970a3c-5e28-7000-8000-000000000008",
        1_774_966_980_000_000_000,
        "hub-a",
        "com.example.Alert",
        r#"{"message":"line1\nline2"}"#,
    ),
    good(
        "01970a3c-5e29-7000-8000-000000000009",
        1_774_966_981_250_000_000,
        "sensor-1",
        "com.example.Note",
        r#""plain text""#,
    ),
];

fn check_fixture_line(line: &[u8], expected: &Option<Good>) {
    let text = String::from_utf8_lossy(line);
    match (Envelope::decode(line), expected) {
        (Err(_), None) => {}
        (Ok(e), None) => panic!("accepted an unreadable line as {e:?}: {text}"),
        (Err(e), Some(_)) => panic!("rejected a good line ({e}): {text}"),
        (Ok(e), Some(g)) => {
            assert_eq!(e.id, g.id, "{text}");
            assert_eq!(e.ts_nanos, g.ts_nanos, "{text}");
            assert_eq!(e.channel, "alerts", "{text}");
            assert_eq!(e.origin, g.origin, "{text}");
            assert_eq!(e.payload_type, g.payload_type, "{text}");
            assert_eq!(e.correlation_id.as_deref(), g.correlation_id, "{text}");
            assert_eq!(e.service_name.as_deref(), g.service_name, "{text}");
            assert_eq!(e.payload.get(), g.payload, "{text}");
        }
    }
}

#[test]
fn reads_a_directory_written_by_go() {
    let data = go_fixture();
    let dir = channel_dir(&data, "alerts");
    let segs = segments(&dir);
    assert_eq!(segs.len(), 2, "fixture has two segments");
    assert_eq!(segs[0].0, 0);
    assert_eq!(
        segs[1].0,
        segs[0].1.len() as u64,
        "fixture damaged: second segment must be named after the first's size"
    );
    let expected_lines = lines_on_disk(&dir);
    assert_eq!(expected_lines.len(), GO_FIXTURE_RECORDS.len());

    let mut reader = read_channel(&data, "alerts", 0).expect("reader");
    let got = records(read_all(&mut reader));
    assert_eq!(got, expected_lines, "records, offsets and segment starts");
    let end = segs[1].0 + segs[1].1.len() as u64;
    assert_eq!(reader.position(), end, "reader stops at the stream end");
    for ((_, _, line), expected) in got.iter().zip(&GO_FIXTURE_RECORDS) {
        check_fixture_line(line, expected);
    }

    // Starting mid-stream at a record boundary of each segment.
    for (offset, _, _) in &expected_lines {
        let mut r = read_channel(&data, "alerts", *offset).expect("reader");
        let tail = records(read_all(&mut r));
        assert_eq!(tail.first().map(|t| t.0), Some(*offset));
        assert_eq!(
            tail.len(),
            expected_lines.iter().filter(|l| l.0 >= *offset).count()
        );
    }
}

#[test]
fn engine_appends_to_a_directory_written_by_go() {
    let tmp = tempdir();
    let data = tmp.path().join("data");
    copy_dir(&go_fixture(), &data);
    let dir = channel_dir(&data, "alerts");
    let before = segments(&dir);
    let old_lines = lines_on_disk(&dir);
    let end = before[1].0 + before[1].1.len() as u64;

    let engine = open_engine(&data, 0, 0);
    let p = engine
        .publish("alerts", &msg(br#"{"message":"new"}"#))
        .expect("publish");
    assert_eq!(p.offset, end, "appended at the stream end");

    let after = segments(&dir);
    assert_eq!(after.len(), 2, "no new segment");
    assert_eq!(after[0], before[0], "sealed segment untouched");
    let active = &after[1].1;
    assert!(active.starts_with(&before[1].1), "active segment only grew");
    let new_line = only_line(&active[before[1].1.len()..]);
    assert_eq!(decode(new_line).id, p.id);

    // Everything readable through the engine, up to its committed end.
    let (mut reader, writer) = engine.reader("alerts", 0).expect("engine reader");
    let writer = writer.expect("the channel exists");
    assert_eq!(writer.committed_end(), end + new_line.len() as u64 + 1);
    let got = records(read_until(&mut reader, writer.committed_end()));
    assert_eq!(got.len(), old_lines.len() + 1);
    assert_eq!(&got[..old_lines.len()], &old_lines[..]);
    let last = got.last().expect("new record");
    assert_eq!((last.0, last.1), (p.offset, before[1].0));
    for ((_, _, line), expected) in got.iter().zip(&GO_FIXTURE_RECORDS) {
        check_fixture_line(line, expected);
    }
}

// ---------------------------------------------------------------------------
// 3. Segment rolling
// ---------------------------------------------------------------------------

#[test]
fn segments_roll_contiguously_and_never_split_a_batch() {
    const LIMIT: u64 = 1000;
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, LIMIT);
    let payloads: Vec<String> = (0..60)
        .map(|i| format!(r#"{{"n":{i},"pad":"{}"}}"#, "p".repeat(i % 40)))
        .collect();
    // Each publish call is one group: singles, batches of three that fit in
    // a segment, and a batch of seven that cannot.
    let mut groups: Vec<Vec<Published>> = Vec::new();
    let mut next = payloads.iter();
    for round in 0..30 {
        let size = match round % 10 {
            3 | 6 => 3,
            9 => 7,
            _ => 1,
        };
        let items: Vec<Outgoing<'_>> = next
            .by_ref()
            .take(size)
            .map(|p| msg(p.as_bytes()))
            .collect();
        assert_eq!(items.len(), size, "enough payloads");
        let published = if size == 1 {
            vec![engine.publish("roll", &items[0]).expect("publish")]
        } else {
            engine.publish_batch("roll", &items).expect("publish_batch")
        };
        groups.push(published);
    }
    let all: Vec<Published> = groups.iter().flatten().cloned().collect();

    let dir = channel_dir(tmp.path(), "roll");
    let segs = segments(&dir);
    assert!(
        segs.len() > 3,
        "rolled several times ({} segments)",
        segs.len()
    );
    assert_eq!(segs[0].0, 0, "first segment starts at 0");
    for w in segs.windows(2) {
        assert_eq!(
            w[0].0 + w[0].1.len() as u64,
            w[1].0,
            "segments are contiguous"
        );
    }
    let writer = engine.publish_writer("roll").expect("writer");
    assert_eq!(writer.counters().rolls, segs.len() as u64 - 1);

    let seg_of = |offset: u64| {
        segs.iter()
            .rev()
            .find(|s| s.0 <= offset)
            .expect("segment")
            .0
    };
    let group_of: HashMap<u64, usize> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, ps)| ps.iter().map(move |p| (p.offset, g)))
        .collect();
    let line_len: HashMap<u64, u64> = lines_on_disk(&dir)
        .into_iter()
        .map(|(offset, _, line)| (offset, line.len() as u64 + 1))
        .collect();
    let group_len = |g: usize| groups[g].iter().map(|p| line_len[&p.offset]).sum::<u64>();

    for group in &groups {
        let s = seg_of(group[0].offset);
        assert!(
            group.iter().all(|p| seg_of(p.offset) == s),
            "group split across segments: {group:?}"
        );
    }
    for (i, (start, bytes)) in segs.iter().enumerate() {
        let groups_here: HashSet<usize> = split_lines(bytes)
            .iter()
            .map(|(off, _)| group_of[&(start + off)])
            .collect();
        assert!(
            bytes.len() as u64 <= LIMIT || groups_here.len() == 1,
            "segment {start} is {} bytes with {} groups",
            bytes.len(),
            groups_here.len()
        );
        // Rolled only because the next group did not fit.
        if let Some((next_start, _)) = segs.get(i + 1) {
            let first_next = group_of[next_start];
            assert!(
                bytes.len() as u64 + group_len(first_next) > LIMIT,
                "segment {start} rolled before it was full"
            );
        }
    }

    assert_eq!(ids_on_disk(tmp.path(), "roll"), published_ids(&all));
}

// ---------------------------------------------------------------------------
// 4. Torn tails
// ---------------------------------------------------------------------------

#[test]
fn torn_tail_is_never_read_and_is_cut_on_open() {
    let tmp = tempdir();
    let data = tmp.path();
    let complete = format!("{}{}", go_line(1), go_line(2));
    // Longer than the record published below, so overwriting it in place
    // without cutting it would leave bytes behind.
    let fragment = format!(
        r#"{{"v":1,"id":"01970a3c-0000-7000-8000-0000000000ff","payload":"{}"#,
        "f".repeat(400)
    );
    let dir = channel_dir(data, "torn");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(SEG0), format!("{complete}{fragment}")).unwrap();
    // A channel whose active segment is nothing but a fragment.
    let only = channel_dir(data, "only-fragment");
    fs::create_dir_all(&only).unwrap();
    fs::write(only.join(SEG0), &fragment).unwrap();

    // Before recovery: from any position, a reader stops before the fragment.
    let good_end = complete.len() as u64;
    for pos in 0..=good_end + fragment.len() as u64 {
        let mut reader = read_channel(data, "torn", pos).expect("reader");
        for item in read_all(&mut reader) {
            assert!(
                item.next_offset() <= good_end,
                "read into the fragment from {pos}: {item:?}"
            );
        }
        assert_eq!(
            reader.position(),
            pos.max(good_end),
            "stopped at the fragment from {pos}"
        );
    }

    let engine = open_engine(data, 0, 0);
    let p = engine.publish("torn", &msg(b"{}")).expect("publish");
    assert_eq!(
        p.offset, good_end,
        "new record starts where the fragment was"
    );
    let content = fs::read(dir.join(SEG0)).unwrap();
    assert!(content.starts_with(complete.as_bytes()));
    let new_line = only_line(&content[complete.len()..]);
    assert_eq!(decode(new_line).id, p.id, "fragment is gone");
    let ids = ids_on_disk(data, "torn");
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[2], (p.offset, p.id));

    let p = engine
        .publish("only-fragment", &msg(b"{}"))
        .expect("publish");
    assert_eq!(p.offset, 0);
    let content = fs::read(only.join(SEG0)).unwrap();
    assert_eq!(decode(only_line(&content)).id, p.id, "fragment is gone");
    assert_eq!(segments(&only).len(), 1);
}

#[test]
fn torn_tail_of_a_sealed_segment_is_skipped() {
    let tmp = tempdir();
    let data = tmp.path();
    let dir = channel_dir(data, "c");
    fs::create_dir_all(&dir).unwrap();
    let sealed = format!("{}{{\"v\":1,\"id\":\"tor", go_line(1));
    let next = sealed.len() as u64;
    fs::write(dir.join(SEG0), &sealed).unwrap();
    fs::write(dir.join(segment_file_name(next)), go_line(2)).unwrap();

    let got = records(read_all(&mut read_channel(data, "c", 0).unwrap()));
    let offsets: Vec<(u64, u64)> = got.iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(offsets, vec![(0, 0), (next, next)]);
    assert_eq!(got[1].2, go_line(2).trim_end().as_bytes());

    // Recovery only touches the active segment.
    let engine = open_engine(data, 0, 0);
    let p = engine.publish("c", &msg(b"{}")).expect("publish");
    assert_eq!(p.offset, next + go_line(2).len() as u64);
    assert_eq!(fs::read(dir.join(SEG0)).unwrap(), sealed.as_bytes());
}

#[test]
fn reader_waits_for_the_newline_of_an_in_progress_record() {
    let tmp = tempdir();
    let data = tmp.path();
    let dir = channel_dir(data, "c");
    fs::create_dir_all(&dir).unwrap();
    let first = go_line(1);
    fs::write(dir.join(SEG0), &first).unwrap();
    let mut reader = read_channel(data, "c", 0).unwrap();
    assert_eq!(records(read_all(&mut reader)).len(), 1);

    let second = go_line(2);
    let (head, tail) = second.split_at(second.len() / 2);
    let mut file = OpenOptions::new()
        .append(true)
        .open(dir.join(SEG0))
        .unwrap();
    file.write_all(head.as_bytes()).unwrap();
    for _ in 0..3 {
        assert_eq!(
            reader.next_item(u64::MAX).unwrap(),
            None,
            "unterminated tail returned"
        );
        assert_eq!(
            reader.position(),
            first.len() as u64,
            "unterminated tail consumed"
        );
    }

    file.write_all(tail.as_bytes()).unwrap();
    assert_eq!(
        reader.next_item(u64::MAX).unwrap(),
        Some(Item::Record {
            offset: first.len() as u64,
            segment: 0,
            line: second.trim_end().as_bytes().to_vec(),
        })
    );
    assert_eq!(reader.next_item(u64::MAX).unwrap(), None);
}

// ---------------------------------------------------------------------------
// 5. Group commit
// ---------------------------------------------------------------------------

#[test]
fn concurrent_publishers_share_fsyncs() {
    const THREADS: usize = 16;
    const EACH: usize = 50;
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 0);
    let writer = engine.publish_writer("ch").expect("writer");

    let per_thread: Vec<Vec<Published>> = thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let engine = &engine;
                s.spawn(move || {
                    (0..EACH)
                        .map(|i| {
                            let payload = format!("[{t},{i}]");
                            engine
                                .publish("ch", &msg(payload.as_bytes()))
                                .expect("publish")
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("publisher thread"))
            .collect()
    });

    let on_disk: HashMap<String, u64> = ids_on_disk(tmp.path(), "ch")
        .into_iter()
        .map(|(offset, id)| (id, offset))
        .collect();
    assert_eq!(
        on_disk.len(),
        THREADS * EACH,
        "every record once, nothing else"
    );
    for published in &per_thread {
        for p in published {
            assert_eq!(
                on_disk.get(&p.id),
                Some(&p.offset),
                "id {} at its offset",
                p.id
            );
        }
        assert!(published.windows(2).all(|w| w[0].offset < w[1].offset));
    }
    let c = writer.counters();
    assert_eq!(c.records, (THREADS * EACH) as u64);
    assert!(c.fsyncs < c.records, "no group commit: {c:?}");
    assert_eq!(c.failures, 0);
}

#[test]
fn publish_batch_is_one_write_and_one_fsync() {
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 0);
    let writer = engine.publish_writer("ch").expect("writer");
    engine.publish("ch", &msg(b"{}")).expect("publish");
    let before = writer.counters();

    let payloads: Vec<String> = (0..1000).map(|i| format!(r#"{{"i":{i}}}"#)).collect();
    let items: Vec<Outgoing<'_>> = payloads.iter().map(|p| msg(p.as_bytes())).collect();
    let published = engine.publish_batch("ch", &items).expect("publish_batch");

    let after = writer.counters();
    assert_eq!(after.fsyncs, before.fsyncs + 1, "{after:?}");
    assert_eq!(after.writes, before.writes + 1, "{after:?}");
    assert_eq!(after.records, before.records + 1000);
    let on_disk = ids_on_disk(tmp.path(), "ch");
    assert_eq!(&on_disk[1..], &published_ids(&published)[..]);
}

// ---------------------------------------------------------------------------
// 6. Fault injection
// ---------------------------------------------------------------------------

/// The segment holds only complete lines that decode, and exactly `ids`.
fn assert_clean_segment(data: &Path, channel: &str, ids: &[(u64, String)]) {
    let raw = fs::read(channel_dir(data, channel).join(SEG0)).unwrap();
    for (_, line) in split_lines(&raw) {
        decode(line);
    }
    assert_eq!(ids_on_disk(data, channel), ids);
}

#[test]
fn failed_write_leaves_nothing_behind() {
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 0);
    let seg = channel_dir(tmp.path(), "f").join(SEG0);
    let mut ok = vec![engine.publish("f", &msg(b"{}")).expect("publish")];
    let writer = engine.publish_writer("f").expect("writer");
    let len = file_len(&seg);

    writer.inject_fault(FaultPoint::Write { partial: 37 }, 1);
    assert_eq!(
        storage_errno(engine.publish("f", &msg(br#"{"lost":1}"#))),
        libc::ENOSPC
    );
    assert_eq!(file_len(&seg), len, "partial write cut back");

    writer.inject_fault(FaultPoint::Write { partial: 37 }, 1);
    let batch = [msg(br#"{"lost":2}"#), msg(br#"{"lost":3}"#)];
    match engine.publish_batch("f", &batch) {
        Err(Error::Storage(e)) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC)),
        other => panic!("expected a storage error, got {other:?}"),
    }
    assert_eq!(file_len(&seg), len, "partial batch cut back");

    ok.push(
        engine
            .publish("f", &msg(b"{}"))
            .expect("publish after failure"),
    );
    assert_eq!(ok[1].offset, len);
    assert_clean_segment(tmp.path(), "f", &published_ids(&ok));
    assert_eq!(writer.counters().failures, 2);
}

#[test]
fn failed_fsync_is_rolled_back() {
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 0);
    let seg = channel_dir(tmp.path(), "f").join(SEG0);
    let mut ok = vec![engine.publish("f", &msg(b"{}")).expect("publish")];
    let writer = engine.publish_writer("f").expect("writer");
    let len = file_len(&seg);

    writer.inject_fault(FaultPoint::Sync, 1);
    assert_eq!(
        storage_errno(engine.publish("f", &msg(br#"{"lost":1}"#))),
        libc::EIO
    );
    assert_eq!(file_len(&seg), len, "unsynced record cut back");

    ok.push(
        engine
            .publish("f", &msg(b"{}"))
            .expect("publish after failure"),
    );
    assert_eq!(ok[1].offset, len);
    assert_clean_segment(tmp.path(), "f", &published_ids(&ok));
}

#[test]
fn failed_roll_keeps_the_old_segment_active() {
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 700);
    let dir = channel_dir(tmp.path(), "f");
    let mut ok = vec![engine.publish("f", &msg(b"{}")).expect("publish")];
    let writer = engine.publish_writer("f").expect("writer");
    writer.inject_fault(FaultPoint::Roll, 1);

    let mut failed = false;
    for _ in 0..20 {
        let before = segments(&dir);
        match engine.publish("f", &msg(b"{}")) {
            Ok(p) => ok.push(p),
            Err(e) => {
                assert_eq!(storage_errno(Err(e)), libc::ENOSPC);
                assert_eq!(segments(&dir), before, "failed roll changed the files");
                failed = true;
                break;
            }
        }
    }
    assert!(failed, "the segment never filled up");
    let sealed_len = file_len(&dir.join(SEG0));
    assert_eq!(segments(&dir).len(), 1);

    let p = engine
        .publish("f", &msg(b"{}"))
        .expect("publish after failed roll");
    assert_eq!(p.offset, sealed_len, "next segment starts at the old end");
    let segs = segments(&dir);
    assert_eq!(
        segs.iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![0, sealed_len]
    );
    ok.push(p);
    assert_eq!(ids_on_disk(tmp.path(), "f"), published_ids(&ok));
    let c = writer.counters();
    assert_eq!((c.rolls, c.failures), (1, 1));
}

#[test]
fn failed_batch_fails_only_its_publishers() {
    const THREADS: usize = 8;
    const EACH: usize = 10;
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 0);
    let writer = engine.publish_writer("f").expect("writer");
    writer.inject_fault(FaultPoint::Write { partial: 37 }, 1);

    type Outcome = ((usize, usize), Result<Published, Error>);
    let outcomes: Vec<Outcome> = thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let engine = &engine;
                s.spawn(move || {
                    (0..EACH)
                        .map(|i| {
                            let payload = format!("[{t},{i}]");
                            ((t, i), engine.publish("f", &msg(payload.as_bytes())))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("publisher thread"))
            .collect()
    });

    let mut expected: HashMap<(usize, usize), Published> = HashMap::new();
    let mut errors = 0;
    for (key, result) in outcomes {
        match result {
            Ok(p) => {
                expected.insert(key, p);
            }
            Err(e) => {
                assert_eq!(storage_errno(Err(e)), libc::ENOSPC);
                errors += 1;
            }
        }
    }
    assert!(errors >= 1, "the injected fault hit nobody");
    assert_eq!(expected.len() + errors, THREADS * EACH);

    let raw = fs::read(channel_dir(tmp.path(), "f").join(SEG0)).unwrap();
    let mut found: HashMap<(usize, usize), Published> = HashMap::new();
    for (offset, line) in split_lines(&raw) {
        let env = decode(line);
        let key: (usize, usize) = serde_json::from_str(env.payload.get()).expect("payload [t,i]");
        let dup = found.insert(key, Published { id: env.id, offset });
        assert!(dup.is_none(), "{key:?} written twice");
    }
    assert_eq!(
        found, expected,
        "exactly the successful publishes are on disk"
    );
    assert_eq!(writer.counters().failures, 1);
}

// ---------------------------------------------------------------------------
// 7. Relaxed durability
// ---------------------------------------------------------------------------

#[test]
fn relaxed_mode_syncs_on_close() {
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 50, 0);
    let writer = engine.publish_writer("r").expect("writer");
    let p = engine.publish("r", &msg(b"{}")).expect("publish");
    assert_eq!(
        ids_on_disk(tmp.path(), "r"),
        published_ids(&[p]),
        "readable at once"
    );

    engine.close();
    let synced = writer.counters();
    assert!(synced.fsyncs >= 1, "{synced:?}");
    engine.close();
    assert_eq!(
        writer.counters(),
        synced,
        "second close changed the counters"
    );

    assert!(matches!(
        engine.publish("r", &msg(b"{}")),
        Err(Error::Closed(_))
    ));
    assert!(matches!(
        engine.publish_batch("r", &[msg(b"{}")]),
        Err(Error::Closed(_))
    ));
    assert!(matches!(
        engine.publish("other", &msg(b"{}")),
        Err(Error::Closed(_))
    ));
    assert!(matches!(
        writer.append(b"{}\n", 1),
        Err(StorageError::Closed(_))
    ));
}

// ---------------------------------------------------------------------------
// 8. Names and sizes
// ---------------------------------------------------------------------------

#[test]
fn invalid_channel_names_create_nothing() {
    let tmp = tempdir();
    let data = tmp.path().join("data");
    let engine = open_engine(&data, 0, 0);
    let watched = [tmp.path().to_owned(), data.clone(), data.join("channels")];
    let snapshot = || watched.iter().map(|d| entries(d)).collect::<Vec<_>>();
    let before = snapshot();

    let long = "x".repeat(256);
    for name in [
        "..",
        ".",
        "a/b",
        "../escape",
        "",
        "x.dead-letter",
        long.as_str(),
    ] {
        assert!(
            matches!(
                engine.publish(name, &msg(b"{}")),
                Err(Error::InvalidName(_))
            ),
            "publish to {name:?}"
        );
        assert!(
            matches!(
                engine.publish_batch(name, &[msg(b"{}")]),
                Err(Error::InvalidName(_))
            ),
            "publish_batch to {name:?}"
        );
        if name != "x.dead-letter" {
            assert!(
                matches!(engine.reader(name, 0), Err(Error::InvalidName(_))),
                "reader of {name:?}"
            );
            assert!(matches!(
                read_channel(&data, name, 0),
                Err(Error::InvalidName(_))
            ));
        }
    }
    assert_eq!(
        snapshot(),
        before,
        "an invalid name touched the file system"
    );
    // 243 bytes leave room for the ".dead-letter" companion in 255.
    engine
        .publish(&"x".repeat(243), &msg(b"{}"))
        .expect("243-byte name is allowed");
    assert!(matches!(
        engine.publish(&"x".repeat(244), &msg(b"{}")),
        Err(Error::InvalidName(_))
    ));
}

#[test]
fn oversized_message_is_refused_and_not_written() {
    let tmp = tempdir();
    let engine = open_engine(tmp.path(), 0, 0);
    let big = format!("\"{}\"", "x".repeat(MAX_RECORD));
    match engine.publish("big", &msg(big.as_bytes())) {
        Err(Error::TooLarge { size, limit }) => {
            assert_eq!(limit, MAX_RECORD);
            assert!(size > MAX_RECORD);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let batch = [msg(b"{}"), msg(big.as_bytes()), msg(b"{}")];
    assert!(matches!(
        engine.publish_batch("big", &batch),
        Err(Error::TooLarge { .. })
    ));

    let dir = channel_dir(tmp.path(), "big");
    let written: usize = segments(&dir).iter().map(|s| s.1.len()).sum();
    assert_eq!(written, 0, "nothing written");
    let c = engine.publish_writer("big").expect("writer").counters();
    assert_eq!((c.records, c.writes), (0, 0));
}

// ---------------------------------------------------------------------------
// 9. Data directory lock
// ---------------------------------------------------------------------------

#[test]
fn second_engine_on_the_same_directory_is_locked_out() {
    let tmp = tempdir();
    let first = open_engine(tmp.path(), 0, 0);
    let p = first.publish("c", &msg(b"{}")).expect("publish");

    let cfg = StoreConfig {
        data_dir: tmp.path().to_owned(),
        sync_interval_ms: 0,
        segment_bytes: 0,
    };
    match Engine::open(cfg, "other") {
        Err(Error::Storage(StorageError::Locked(dir))) => assert_eq!(dir, tmp.path()),
        Err(e) => panic!("expected Locked, got {e}"),
        Ok(_) => panic!("two engines opened one data directory"),
    }

    drop(first);
    let second = open_engine(tmp.path(), 0, 0);
    let q = second
        .publish("c", &msg(b"{}"))
        .expect("publish after reopen");
    assert_eq!(ids_on_disk(tmp.path(), "c"), published_ids(&[p, q]));
}

// ---------------------------------------------------------------------------
// 10. Reader edge cases
// ---------------------------------------------------------------------------

/// A line of exactly `len` bytes, newline included.
fn padded_line(len: usize) -> Vec<u8> {
    let mut line = br#"{"pad":""#.to_vec();
    line.resize(len - 3, b'x');
    line.extend_from_slice(b"\"}\n");
    line
}

#[test]
fn reader_skips_oversize_lines_only() {
    let tmp = tempdir();
    let data = tmp.path();
    let dir = channel_dir(data, "c");
    fs::create_dir_all(&dir).unwrap();
    let first = go_line(1);
    let oversize = padded_line(MAX_RECORD + 1);
    let at_limit = padded_line(MAX_RECORD);
    let last = go_line(2);
    let mut content = first.as_bytes().to_vec();
    for part in [&oversize[..], &at_limit[..], last.as_bytes()] {
        content.extend_from_slice(part);
    }
    fs::write(dir.join(SEG0), &content).unwrap();

    let o1 = first.len() as u64;
    let o2 = o1 + oversize.len() as u64;
    let o3 = o2 + at_limit.len() as u64;
    let record = |offset: u64, line: &[u8]| Item::Record {
        offset,
        segment: 0,
        line: line[..line.len() - 1].to_vec(),
    };
    let expected = vec![
        record(0, first.as_bytes()),
        Item::Oversize {
            offset: o1,
            segment: 0,
            len: oversize.len() as u64,
        },
        record(o2, &at_limit),
        record(o3, last.as_bytes()),
    ];
    assert_eq!(read_all(&mut read_channel(data, "c", 0).unwrap()), expected);
    assert_eq!(
        read_all(&mut read_channel(data, "c", o1).unwrap()),
        expected[1..]
    );
}

#[test]
fn reader_below_the_first_segment_gets_a_gap() {
    let tmp = tempdir();
    let data = tmp.path();
    let dir = channel_dir(data, "c");
    fs::create_dir_all(&dir).unwrap();
    // Segments before 5000 were deleted; 5000 and the next one are contiguous,
    // the one after that follows a hole, which readers report as a gap too.
    let (a, b, c) = (go_line(1), go_line(2), go_line(3));
    let s2 = 5000 + a.len() as u64;
    let s3 = s2 + b.len() as u64 + 100;
    fs::write(dir.join(segment_file_name(5000)), &a).unwrap();
    fs::write(dir.join(segment_file_name(s2)), &b).unwrap();
    fs::write(dir.join(segment_file_name(s3)), &c).unwrap();

    for from in [0, 4999] {
        let mut reader = read_channel(data, "c", from).unwrap();
        let mut items = read_all(&mut reader);
        assert_eq!(items.remove(0), Item::Gap { from, to: 5000 });
        let hole = Item::Gap {
            from: s2 + b.len() as u64,
            to: s3,
        };
        assert_eq!(items.remove(2), hole);
        let got: Vec<(u64, u64)> = records(items).iter().map(|r| (r.0, r.1)).collect();
        assert_eq!(got, vec![(5000, 5000), (s2, s2), (s3, s3)]);
        assert_eq!(reader.position(), s3 + c.len() as u64);
    }
}

#[test]
fn stray_files_in_a_channel_directory_are_ignored() {
    let tmp = tempdir();
    let data = tmp.path();
    let dir = channel_dir(data, "c");
    fs::create_dir_all(dir.join(segment_file_name(99))).unwrap();
    let first = go_line(1);
    fs::write(dir.join(SEG0), &first).unwrap();
    // Not segments: a non-canonical number, a temp file, other files.
    for stray in ["7.jsonl", "00000000000000000000.jsonl.tmp", "notes.txt"] {
        fs::write(dir.join(stray), go_line(9)).unwrap();
    }

    let got = records(read_all(&mut read_channel(data, "c", 0).unwrap()));
    assert_eq!(got, vec![(0, 0, only_line(first.as_bytes()).to_vec())]);

    let engine = open_engine(data, 0, 0);
    let p = engine.publish("c", &msg(b"{}")).expect("publish");
    assert_eq!(p.offset, first.len() as u64, "appended to the real segment");
    let content = fs::read(dir.join(SEG0)).unwrap();
    assert_eq!(decode(only_line(&content[first.len()..])).id, p.id);
}
