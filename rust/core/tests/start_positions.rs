//! Start positions (`storage::timeindex`): earliest / latest / offset / time,
//! the time seek's bisection (checked against a full scan, and counted: it
//! reads O(log n) windows), and the engine's use of them in subscribe
//! (start, reset) and seek.
//!
//! Every wait polls with a bounded deadline.

use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, UNIX_EPOCH};

use keyop_core::envelope::{encode_record, format_ts, new_id, Header};
use keyop_core::storage::segment::segment_path;
use keyop_core::storage::timeindex::{
    last_record_ts, resolve, PositionError, SeekCost, StartPosition,
};
use keyop_core::storage::Item;
use keyop_core::{
    read_channel, BatchOutcome, Delivery, Engine, Envelope, Error, Handler, Outgoing, StoreConfig,
    SubscribeOptions, Subscriber,
};
use tempfile::TempDir;

const CH: &str = "positions";
const WAIT: Duration = Duration::from_secs(10);
/// Publish time of record 0 (Unix nanoseconds).
const BASE: i64 = 1_780_000_000_000_000_000;
/// Three records share each millisecond, so equal timestamps occur.
const PER_TICK: usize = 3;
const TICK: i64 = 1_000_000;

fn ts_of(i: usize) -> i64 {
    BASE + (i / PER_TICK) as i64 * TICK
}

/// Writes `segments` segments of `per` records each (record i published at
/// `ts_of(i)`) into `dir`; returns each record's global offset and the end.
fn write_channel(dir: &Path, segments: usize, per: usize) -> (Vec<u64>, u64) {
    fs::create_dir_all(dir).unwrap();
    let mut offsets = Vec::new();
    let mut start = 0u64;
    let mut i = 0usize;
    for _ in 0..segments {
        let mut buf = Vec::new();
        for _ in 0..per {
            offsets.push(start + buf.len() as u64);
            let ts = format_ts(UNIX_EPOCH + Duration::from_nanos(ts_of(i) as u64));
            let id = new_id();
            let payload = format!("{{\"n\":{i}}}");
            encode_record(
                &mut buf,
                &Header {
                    id: &id,
                    ts: &ts,
                    channel: CH,
                    origin: "t",
                    payload_type: "t.N",
                    correlation_id: None,
                    service_name: None,
                },
                payload.as_bytes(),
            );
            i += 1;
        }
        fs::write(segment_path(dir, start), &buf).unwrap();
        start += buf.len() as u64;
    }
    (offsets, start)
}

fn seek(dir: &Path, pos: StartPosition) -> (u64, usize) {
    let mut cost = SeekCost::default();
    let at = match resolve(dir, pos, u64::MAX, &mut cost) {
        Ok(at) => at,
        Err(PositionError::Invalid(why) | PositionError::Gone(why)) => panic!("refused: {why}"),
        Err(PositionError::Io(e)) => panic!("io: {e}"),
    };
    (at, cost.reads)
}

/// The first record with ts >= t by the definition: a full scan.
fn scan_first_at_or_after(offsets: &[u64], end: u64, t: i64) -> u64 {
    (0..offsets.len())
        .find(|&i| ts_of(i) >= t)
        .map_or(end, |i| offsets[i])
}

#[test]
fn time_seek_matches_a_full_scan_and_reads_log_n_windows() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path().join(CH);
    let (segments, per) = (40, 1000);
    let (offsets, end) = write_channel(&dir, segments, per);
    let n = offsets.len();
    let last = ts_of(n - 1);
    let mut times = vec![BASE - 1, BASE, last, last + 1, last + TICK * 100];
    for i in (0..n)
        .step_by(977)
        .chain([1, 2, 3, per - 1, per, per + 1, n - 2])
    {
        times.push(ts_of(i)); // exactly a record's time (first of its tick)
        times.push(ts_of(i) + 1); // between two ticks
        times.push(ts_of(i) - 1);
    }
    let full_scan_windows = end as usize / keyop_core::storage::timeindex::WINDOW;
    let log2n = (n as f64).log2().ceil() as usize;
    let mut most = 0;
    for t in times {
        let (at, reads) = seek(&dir, StartPosition::Time(t));
        assert_eq!(at, scan_first_at_or_after(&offsets, end, t), "time {t}");
        most = most.max(reads);
    }
    eprintln!(
        "time seek over {n} records: at most {most} windows read; a scan reads {full_scan_windows}"
    );
    // O(log n): a handful of windows per halving, far below a scan.
    assert!(
        most <= 4 * log2n,
        "a time seek read {most} windows; 4*log2(n) = {}",
        4 * log2n
    );
    assert!(
        most * 20 < full_scan_windows,
        "{most} vs {full_scan_windows}"
    );
}

#[test]
fn time_seek_reads_grow_logarithmically() {
    let reads_for = |segments: usize, per: usize| {
        let tmp = TempDir::new().unwrap();
        let dir = tmp.path().join(CH);
        let (offsets, _) = write_channel(&dir, segments, per);
        let mid = ts_of(offsets.len() / 2 + 1) + 1;
        seek(&dir, StartPosition::Time(mid)).1
    };
    let small = reads_for(2, 500);
    let big = reads_for(20, 5000); // 100 times the records
                                   // 100x the data: log2(100) < 7 more halvings, about 2 windows each.
    assert!(
        big <= small + 20,
        "reads went from {small} to {big} for 100x the records"
    );
}

#[test]
fn earliest_latest_and_offsets() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path().join(CH);
    let (offsets, end) = write_channel(&dir, 3, 10);
    assert_eq!(seek(&dir, StartPosition::Earliest).0, 0);
    assert_eq!(seek(&dir, StartPosition::Latest).0, end);
    for &o in &offsets {
        assert_eq!(seek(&dir, StartPosition::Offset(o)).0, o);
    }
    assert_eq!(seek(&dir, StartPosition::Offset(end)).0, end);
    let refused = |o: u64| match resolve(
        &dir,
        StartPosition::Offset(o),
        u64::MAX,
        &mut SeekCost::default(),
    ) {
        Err(PositionError::Invalid(why) | PositionError::Gone(why)) => why,
        other => panic!("offset {o} not refused: {other:?}"),
    };
    assert!(refused(offsets[4] + 1).contains("not the start of a record"));
    assert!(refused(end + 1).contains("past the end"));
    // Once the first segment is deleted, earliest is the next one.
    fs::remove_file(segment_path(&dir, 0)).unwrap();
    assert_eq!(seek(&dir, StartPosition::Earliest).0, offsets[10]);
    assert!(refused(offsets[3]).contains("before the oldest record kept"));
    // A time before every record kept: the oldest kept.
    assert_eq!(seek(&dir, StartPosition::Time(0)).0, offsets[10]);
}

#[test]
fn a_torn_tail_is_not_a_record() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path().join(CH);
    let (_, end) = write_channel(&dir, 1, 5);
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(segment_path(&dir, 0))
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"v\":1,\"id\":\"torn").unwrap();
    assert_eq!(seek(&dir, StartPosition::Latest).0, end);
    assert_eq!(seek(&dir, StartPosition::Time(i64::MAX)).0, end);
}

#[test]
fn last_record_ts_is_the_newest_record_within_the_limit() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path().join(CH);
    fs::create_dir_all(&dir).unwrap();
    assert_eq!(last_record_ts(&dir, u64::MAX).unwrap(), None);
    let (offsets, end) = write_channel(&dir, 3, 10);
    let n = offsets.len();
    assert_eq!(last_record_ts(&dir, u64::MAX).unwrap(), Some(ts_of(n - 1)));
    // A limit (a writer's committed end) hides the records after it.
    assert_eq!(
        last_record_ts(&dir, offsets[n - 1]).unwrap(),
        Some(ts_of(n - 2))
    );
    // A torn tail is not a record; an empty newest segment (just rolled) is skipped.
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(segment_path(&dir, offsets[20]))
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"v\":1,\"id\":\"torn").unwrap();
    assert_eq!(last_record_ts(&dir, u64::MAX).unwrap(), Some(ts_of(n - 1)));
    fs::write(segment_path(&dir, end + 17), b"").unwrap();
    assert_eq!(last_record_ts(&dir, u64::MAX).unwrap(), Some(ts_of(n - 1)));
}

// ---------------------------------------------------------------------------
// Engine: subscribe(start, reset) and seek
// ---------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<u64>>>);

impl Handler for Seen {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        let mut v = self.0.lock().unwrap();
        for d in batch {
            let p: serde_json::Value = serde_json::from_str(&d.envelope().payload).unwrap();
            v.push(p["n"].as_u64().unwrap());
        }
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }
}

impl Seen {
    fn wait_for(&self, count: usize) -> Vec<u64> {
        let deadline = Instant::now() + WAIT;
        loop {
            let v = self.0.lock().unwrap().clone();
            if v.len() >= count {
                return v;
            }
            assert!(Instant::now() < deadline, "only {v:?} delivered");
            thread::sleep(Duration::from_millis(5));
        }
    }
}

fn open(tmp: &TempDir) -> Engine {
    let cfg = StoreConfig {
        data_dir: tmp.path().join("data"),
        sync_interval_ms: 0,
        segment_bytes: 0,
    };
    Engine::open(cfg, "node").unwrap()
}

fn publish(e: &Engine, n: u64) -> u64 {
    let payload = format!("{{\"n\":{n}}}");
    e.publish(
        CH,
        &Outgoing {
            payload_type: "t.N",
            payload_json: payload.as_bytes(),
            service_name: None,
            correlation_id: None,
        },
    )
    .unwrap()
    .offset
}

fn ts_at(e: &Engine, offset: u64) -> i64 {
    let mut r = read_channel(e.store().data_dir(), CH, offset).unwrap();
    match r.next_item(u64::MAX).unwrap() {
        Some(Item::Record { line, .. }) => Envelope::decode(&line).unwrap().ts_nanos,
        other => panic!("no record at {offset}: {other:?}"),
    }
}

fn opts() -> SubscribeOptions {
    SubscribeOptions {
        poll_interval: Duration::from_millis(50),
        ..SubscribeOptions::default()
    }
}

#[test]
fn subscribe_start_positions_and_reset() {
    let tmp = TempDir::new().unwrap();
    let e = open(&tmp);
    let offs: Vec<u64> = (0..4).map(|n| publish(&e, n)).collect();
    let start = |id: &str, pos, reset| {
        let seen = Seen::default();
        let sub = e
            .subscribe_from(CH, id, seen.clone(), opts(), pos, reset)
            .unwrap();
        (seen, sub)
    };
    let (seen, sub) = start("a", StartPosition::Earliest, false);
    assert_eq!(seen.wait_for(4), vec![0, 1, 2, 3]);
    e.release(&sub);
    let (seen, sub) = start("b", StartPosition::Offset(offs[2]), false);
    assert_eq!(seen.wait_for(2), vec![2, 3]);
    e.release(&sub);
    let (seen, sub) = start("c", StartPosition::Time(ts_at(&e, offs[1])), false);
    assert_eq!(seen.wait_for(3), vec![1, 2, 3]);
    e.release(&sub);
    // "a" has an offset (the end): earliest is ignored without reset...
    let (seen, sub) = start("a", StartPosition::Earliest, false);
    publish(&e, 4);
    assert_eq!(seen.wait_for(1), vec![4]);
    e.release(&sub);
    // ... and applied with it.
    let (seen, sub) = start("a", StartPosition::Offset(offs[3]), true);
    assert_eq!(seen.wait_for(2), vec![3, 4]);
    e.release(&sub);
    match e.subscribe_from(
        CH,
        "d",
        Seen::default(),
        opts(),
        StartPosition::Offset(offs[1] + 2),
        false,
    ) {
        Err(Error::Config(why)) => assert!(why.contains("not the start of a record"), "{why}"),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("an offset inside a record was accepted"),
    }
}

/// Subscriber `s` of the channel from its first record.
fn subscribe_earliest(e: &Engine, handler: impl Handler) -> Arc<Subscriber> {
    e.subscribe_from(CH, "s", handler, opts(), StartPosition::Earliest, false)
        .unwrap()
}

#[test]
fn seek_while_running_redelivers_from_the_position() {
    let tmp = TempDir::new().unwrap();
    let e = open(&tmp);
    let offs: Vec<u64> = (0..3).map(|n| publish(&e, n)).collect();
    let seen = Seen::default();
    let sub = subscribe_earliest(&e, seen.clone());
    assert_eq!(seen.wait_for(3), vec![0, 1, 2]);
    e.seek(&sub, StartPosition::Offset(offs[1])).unwrap();
    assert_eq!(seen.wait_for(5), vec![0, 1, 2, 1, 2]);
    e.seek(&sub, StartPosition::Earliest).unwrap();
    assert_eq!(seen.wait_for(8)[5..], [0, 1, 2]);
    e.release(&sub);
    assert!(matches!(
        e.seek(&sub, StartPosition::Earliest),
        Err(Error::Closed(_))
    ));
}

/// A handler that holds its first batch until opened; counts its calls.
#[derive(Clone, Default)]
struct Gate(Arc<Mutex<bool>>, Arc<AtomicUsize>);

impl Handler for Gate {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        self.1.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + WAIT;
        while !*self.0.lock().unwrap() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }
}

#[test]
fn a_seek_is_persisted_when_taken() {
    let tmp = TempDir::new().unwrap();
    let e = open(&tmp);
    for n in 0..3 {
        publish(&e, n);
    }
    let gate = Gate::default();
    let sub = e.subscribe(CH, "s", gate.clone(), opts()).unwrap();
    let stored = || stored_offset(&tmp, "s");
    let end = e.resolve_position(CH, StartPosition::Latest).unwrap();
    assert_eq!(stored(), end);
    e.seek(&sub, StartPosition::Earliest).unwrap();
    // The handler now holds the redelivered batch: the seek's offset is on disk.
    let deadline = Instant::now() + WAIT;
    while stored() != 0 {
        assert!(Instant::now() < deadline, "offset file still {}", stored());
        thread::sleep(Duration::from_millis(5));
    }
    *gate.0.lock().unwrap() = true;
    e.release(&sub);
    assert_eq!(stored(), end);
}

/// The offset file of subscriber `id`.
fn stored_offset(tmp: &TempDir, id: &str) -> u64 {
    let path = tmp
        .path()
        .join("data/subscribers")
        .join(CH)
        .join(format!("{id}.offset"));
    fs::read_to_string(path).unwrap().trim().parse().unwrap()
}

/// A seek asked for while a handler call runs shows in `position()` at
/// once, and when delivery stops before taking it, the offset persisted is
/// the seek's, not the one past the batch the handler was holding.
#[test]
fn a_seek_asked_for_before_a_stop_is_persisted() {
    let tmp = TempDir::new().unwrap();
    let e = open(&tmp);
    let offs: Vec<u64> = (0..3).map(|n| publish(&e, n)).collect();
    let gate = Gate::default();
    let sub = subscribe_earliest(&e, gate.clone());
    let deadline = Instant::now() + WAIT;
    while gate.1.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the handler was not called");
        thread::sleep(Duration::from_millis(5));
    }
    // The handler holds records 0-2.
    assert_eq!(sub.position(), 0);
    e.seek(&sub, StartPosition::Offset(offs[1])).unwrap();
    assert_eq!(sub.position(), offs[1], "the seek shows before it is taken");
    sub.signal_stop();
    *gate.0.lock().unwrap() = true;
    e.release(&sub);
    assert_eq!(
        gate.1.load(Ordering::SeqCst),
        1,
        "nothing delivered after the stop"
    );
    assert_eq!(sub.position(), offs[1]);
    assert_eq!(stored_offset(&tmp, "s"), offs[1]);
}
