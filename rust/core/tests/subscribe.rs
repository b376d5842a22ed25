// why this file is long: the integration tests of local subscribers (semantics.md 3) share
// their helpers; one test file per engine area.
//! Integration tests of local subscribers (`shared/spec/semantics.md` section 3,
//! `disk-format.md` sections 6-8), with this implementation's deliberate
//! differences: offsets move past a failed record only once its dead letter is
//! committed, stopping during a backoff keeps the failing record, a rejected
//! record is dead-lettered at once with `retries` 0, and stored offsets are
//! sanitised (clamped to the end, moved to the next record boundary).
//!
//! Every wait polls with a bounded deadline; nothing relies on a sleep being
//! long enough.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use keyop_core::storage::{ChannelWriter, FaultPoint, Item};
use keyop_core::{
    read_channel, BatchOutcome, Delivery, Engine, Envelope, Failure, Handler, Outgoing, Published,
    RetentionConfig, StoreConfig, SubscribeOptions, Subscriber,
};
use serde_json::Value;
use tempfile::TempDir;

const CH: &str = "orders";
const DL: &str = "orders.dead-letter";
const ORIGIN: &str = "sensor-1";
const DEAD_LETTER_TYPE: &str = "com.keyop.messenger.DeadLetterPayload";
/// Bound on every wait.
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn tempdir() -> TempDir {
    tempfile::tempdir().expect("create temp dir")
}

fn open_engine(data_dir: &Path, segment_bytes: u64) -> Engine {
    let cfg = StoreConfig {
        data_dir: data_dir.to_owned(),
        sync_interval_ms: 0,
        segment_bytes,
    };
    match Engine::open(cfg, ORIGIN) {
        Ok(e) => e,
        Err(e) => panic!("open engine on {}: {e}", data_dir.display()),
    }
}

/// Fast retries, offsets written after every batch, short fallback poll.
fn fast_opts() -> SubscribeOptions {
    SubscribeOptions {
        max_retries: 3,
        offset_flush_interval: Duration::ZERO,
        backoff_base: Duration::from_millis(1),
        backoff_max: Duration::from_millis(4),
        max_batch: 512,
        poll_interval: Duration::from_millis(50),
        ..SubscribeOptions::default()
    }
}

fn payload(n: u64) -> String {
    format!("{{\"n\":{n}}}")
}

/// A message of the tests' payload type with the JSON `body`.
fn order(body: &str) -> Outgoing<'_> {
    Outgoing {
        payload_type: "com.example.Order",
        payload_json: body.as_bytes(),
        service_name: None,
        correlation_id: None,
    }
}

fn publish(engine: &Engine, n: u64) -> Published {
    let body = payload(n);
    engine
        .publish(CH, &order(&body))
        .unwrap_or_else(|e| panic!("publish {n}: {e}"))
}

fn publish_range(engine: &Engine, ns: std::ops::Range<u64>) -> Vec<Published> {
    ns.map(|n| publish(engine, n)).collect()
}

/// The message number of a delivery (`u64::MAX` for other payloads, such as
/// dead letters).
fn number(d: &Delivery) -> u64 {
    serde_json::from_str::<Value>(&d.envelope().payload)
        .ok()
        .and_then(|v| v.get("n").and_then(Value::as_u64))
        .unwrap_or(u64::MAX)
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn offset_file(data_dir: &Path, channel: &str, id: &str) -> PathBuf {
    data_dir
        .join("subscribers")
        .join(channel)
        .join(format!("{id}.offset"))
}

fn read_offset_file(data_dir: &Path, channel: &str, id: &str) -> u64 {
    let path = offset_file(data_dir, channel, id);
    let text = fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read offset file {}: {e}", path.display()));
    assert!(
        text.ends_with('\n')
            && text
                .trim_end_matches('\n')
                .bytes()
                .all(|b| b.is_ascii_digit()),
        "offset file {} holds {text:?}",
        path.display()
    );
    text.trim_end().parse().expect("decimal offset")
}

fn wait_offset(data_dir: &Path, channel: &str, id: &str, value: u64) {
    let path = offset_file(data_dir, channel, id);
    wait_until(&format!("{} to hold {value}", path.display()), || {
        fs::read_to_string(&path).is_ok_and(|t| t == format!("{value}\n"))
    });
}

/// Every complete record of `channel` on disk: (offset, raw line).
fn records(data_dir: &Path, channel: &str) -> Vec<(u64, Vec<u8>)> {
    let mut reader = read_channel(data_dir, channel, 0).expect("reader");
    let mut out = Vec::new();
    while let Some(item) = reader.next_item(u64::MAX).expect("read") {
        if let Item::Record { offset, line, .. } = item {
            out.push((offset, line));
        }
    }
    out
}

fn segment_starts(data_dir: &Path, channel: &str) -> Vec<u64> {
    let mut starts: Vec<u64> = fs::read_dir(data_dir.join("channels").join(channel))
        .expect("list channel dir")
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(".jsonl")?.parse().ok()
        })
        .collect();
    starts.sort_unstable();
    starts
}

fn end_of(p: &Published, engine: &Engine) -> u64 {
    // The record is the one starting at `p.offset`; find its length on disk.
    let line = records(engine.store().data_dir(), CH)
        .into_iter()
        .find(|(o, _)| *o == p.offset)
        .expect("published record on disk")
        .1;
    p.offset + line.len() as u64 + 1
}

/// What a scripted handler does with one call on a message.
#[derive(Debug, Clone)]
enum Action {
    Ack,
    Retry(String),
    Reject(String),
}

#[derive(Default)]
struct State {
    /// Every handler call on a record: (message number, when).
    calls: Vec<(u64, Instant)>,
    /// Acknowledged records: (message number, offset).
    delivered: Vec<(u64, u64)>,
    /// Size of every batch handed over.
    batches: Vec<usize>,
    /// Scripted actions per message number, used front first; `Ack` when empty.
    script: HashMap<u64, VecDeque<Action>>,
    /// Message numbers that always fail (with a numbered error text).
    always_fail: HashSet<u64>,
    /// Every record fails.
    fail_all: bool,
    /// Stop this subscriber from inside the handler on this message number.
    stop_on: Option<(u64, Arc<Subscriber>)>,
    /// Seek this subscriber to an offset from inside the handler on this
    /// message number: (message number, subscriber, offset).
    seek_on: Option<(u64, Arc<Subscriber>, u64)>,
    /// A dead-letter writer whose committed end is recorded at each delivery.
    watch: Option<Arc<ChannelWriter>>,
    /// (message number, watched committed end) at each acknowledged delivery.
    watched: Vec<(u64, u64)>,
}

/// A handler recording into shared state and failing by script.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<State>>);

impl Recorder {
    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn script(&self, n: u64, actions: Vec<Action>) {
        self.state().script.insert(n, actions.into());
    }

    fn delivered(&self) -> Vec<u64> {
        self.state().delivered.iter().map(|&(n, _)| n).collect()
    }

    fn calls_on(&self, n: u64) -> usize {
        self.state().calls.iter().filter(|&&(m, _)| m == n).count()
    }

    fn wait_delivered(&self, n: u64) {
        wait_until(&format!("delivery of message {n}"), || {
            self.delivered().contains(&n)
        });
    }
}

impl Handler for Recorder {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        let mut st = self.state();
        st.batches.push(batch.len());
        for (i, d) in batch.iter().enumerate() {
            let n = number(d);
            st.calls.push((n, Instant::now()));
            let attempt = st.calls.iter().filter(|&&(m, _)| m == n).count();
            let action = if st.fail_all || st.always_fail.contains(&n) {
                Action::Retry(format!("fail #{attempt}"))
            } else {
                st.script
                    .get_mut(&n)
                    .and_then(VecDeque::pop_front)
                    .unwrap_or(Action::Ack)
            };
            let failure = match action {
                Action::Ack => None,
                Action::Retry(e) => Some(Failure::Retry(e)),
                Action::Reject(e) => Some(Failure::Reject(e)),
            };
            if let Some(failure) = failure {
                return BatchOutcome {
                    handled: i,
                    failure: Some(failure),
                };
            }
            st.delivered.push((n, d.offset));
            if let Some(end) = st.watch.as_ref().map(|w| w.committed_end()) {
                st.watched.push((n, end));
            }
            if let Some((at, sub)) = st.stop_on.clone() {
                if at == n {
                    sub.stop(); // from the subscriber's own thread: only signals
                    return BatchOutcome {
                        handled: i + 1,
                        failure: None,
                    };
                }
            }
            if let Some((at, sub, to)) = st.seek_on.take() {
                if at == n {
                    sub.seek(to); // taken once this call returns
                    return BatchOutcome {
                        handled: i + 1,
                        failure: None,
                    };
                }
                st.seek_on = Some((at, sub, to));
            }
        }
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }
}

fn subscribe(engine: &Engine, id: &str, rec: &Recorder, opts: SubscribeOptions) -> Arc<Subscriber> {
    engine
        .subscribe(CH, id, rec.clone(), opts)
        .unwrap_or_else(|e| panic!("subscribe {id}: {e}"))
}

/// The single dead letter of `DL`, decoded, with its payload and raw line.
fn only_dead_letter(data_dir: &Path) -> (Envelope, Value, Vec<u8>) {
    let recs = records(data_dir, DL);
    assert_eq!(recs.len(), 1, "expected exactly one dead letter");
    let line = recs[0].1.clone();
    let env = Envelope::decode(&line).expect("dead letter decodes");
    let payload: Value = serde_json::from_str(env.payload.get()).expect("payload JSON");
    (env, payload, line)
}

// ---------------------------------------------------------------------------
// Delivery order
// ---------------------------------------------------------------------------

#[test]
fn delivers_in_order_across_batches_and_segment_rolls() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 1024);
    let rec = Recorder::default();
    let opts = SubscribeOptions {
        max_batch: 7,
        ..fast_opts()
    };
    let _sub = subscribe(&engine, "ordered", &rec, opts);
    let published = publish_range(&engine, 0..150);
    rec.wait_delivered(149);

    let st = rec.state();
    let want: Vec<(u64, u64)> = (0..150).zip(published.iter().map(|p| p.offset)).collect();
    assert_eq!(st.delivered, want);
    assert!(
        st.batches.iter().all(|&b| (1..=7).contains(&b)),
        "{:?}",
        st.batches
    );
    assert!(st.batches.len() >= 150 / 7);
    assert_eq!(st.calls.len(), 150, "each record handled exactly once");
    drop(st);
    let segs = segment_starts(dir.path(), CH);
    assert!(segs.len() > 5, "expected several segments, got {segs:?}");
    let end = engine.store().writer(CH).expect("writer").committed_end();
    wait_offset(dir.path(), CH, "ordered", end);
}

// ---------------------------------------------------------------------------
// Retries and dead letters
// ---------------------------------------------------------------------------

#[test]
fn retry_then_success_is_delivered_once_without_dead_letter() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    rec.script(
        0,
        vec![Action::Retry("e1".into()), Action::Retry("e2".into())],
    );
    let opts = SubscribeOptions {
        max_retries: 5,
        ..fast_opts()
    };
    let _sub = subscribe(&engine, "flaky", &rec, opts);
    publish_range(&engine, 0..2);
    rec.wait_delivered(1);

    assert_eq!(rec.calls_on(0), 3);
    assert_eq!(rec.calls_on(1), 1);
    assert_eq!(rec.delivered(), vec![0, 1]);
    assert!(records(dir.path(), DL).is_empty());
    let end = engine.store().writer(CH).expect("writer").committed_end();
    wait_offset(dir.path(), CH, "flaky", end);
}

#[test]
fn dead_letter_after_max_retries() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    rec.state().always_fail.insert(0);
    let opts = SubscribeOptions {
        max_retries: 2,
        ..fast_opts()
    };
    let _sub = subscribe(&engine, "billing", &rec, opts);
    let body = payload(0);
    let poison = engine
        .publish(
            CH,
            &Outgoing {
                payload_type: "com.example.Order",
                payload_json: body.as_bytes(),
                service_name: Some("shop"),
                correlation_id: Some("corr-9"),
            },
        )
        .expect("publish");
    publish(&engine, 1);
    rec.wait_delivered(1);

    assert_eq!(rec.calls_on(0), 3, "first call plus max_retries retries");
    assert_eq!(rec.delivered(), vec![1]);
    let (env, payload, line) = only_dead_letter(dir.path());
    let original = records(dir.path(), CH)
        .into_iter()
        .find(|(o, _)| *o == poison.offset)
        .expect("original on disk")
        .1;
    assert_ne!(env.id, poison.id);
    assert_eq!(env.channel, DL);
    assert_eq!(env.origin, ORIGIN);
    assert_eq!(env.payload_type, DEAD_LETTER_TYPE);
    assert_eq!(env.correlation_id, None);
    assert_eq!(env.service_name, None);
    let expected_original: Value = serde_json::from_slice(&original).expect("original JSON");
    assert_eq!(payload["original"], expected_original);
    assert_eq!(payload["retries"], 2);
    assert_eq!(payload["last_error"], "fail #3");
    assert!(payload["failed_at"].is_string());
    // Keys in the documented order, the original copied verbatim.
    let mut prefix = b"{\"original\":".to_vec();
    prefix.extend_from_slice(&original);
    prefix.extend_from_slice(b",\"retries\":2,\"last_error\":\"fail #3\",\"failed_at\":");
    let text = String::from_utf8(line).expect("utf-8");
    let payload_text = text.split_once("\"payload\":").expect("payload key").1;
    assert!(payload_text.as_bytes().starts_with(&prefix), "{text}");
    let end = engine.store().writer(CH).expect("writer").committed_end();
    wait_offset(dir.path(), CH, "billing", end);
}

#[test]
fn reject_dead_letters_at_once_with_zero_retries() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    rec.script(0, vec![Action::Reject("does not decode".into())]);
    // A retry would wait a minute: the test would time out.
    let opts = SubscribeOptions {
        max_retries: 5,
        backoff_base: Duration::from_secs(60),
        backoff_max: Duration::from_secs(60),
        ..fast_opts()
    };
    let _sub = subscribe(&engine, "typed", &rec, opts);
    publish_range(&engine, 0..2);
    rec.wait_delivered(1);

    assert_eq!(rec.calls_on(0), 1);
    assert_eq!(rec.delivered(), vec![1]);
    let (_, payload, _) = only_dead_letter(dir.path());
    assert_eq!(payload["retries"], 0);
    assert_eq!(payload["last_error"], "does not decode");
    assert_eq!(payload["original"]["payload"]["n"], 0);
}

/// A dead letter is appended through the dead-letter channel's shared writer,
/// so readers waiting on that channel (a hub's federation reader serving a
/// remote subscriber of it) are woken at once.
#[test]
fn dead_letter_append_wakes_readers_of_the_dead_letter_channel() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let dl = engine.store().writer(DL).expect("dead-letter writer");
    let start = dl.committed_end();
    let waiter = {
        let dl = dl.clone();
        thread::spawn(move || dl.notifier().wait_past(start, WAIT))
    };
    let rec = Recorder::default();
    rec.script(0, vec![Action::Reject("poison".into())]);
    let _sub = subscribe(&engine, "billing", &rec, fast_opts());
    publish_range(&engine, 0..2);
    rec.wait_delivered(1);

    let woke_at = waiter.join().expect("waiter thread");
    assert!(
        woke_at > start,
        "a reader waiting on {DL} was not woken by the dead letter (its wait timed out)"
    );
    assert_eq!(records(dir.path(), DL).len(), 1);
}

#[test]
fn failure_in_the_middle_of_a_batch_keeps_order() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    rec.script(4, vec![Action::Reject("bad".into())]);
    rec.script(7, vec![Action::Retry("once".into())]);
    let _sub = subscribe(&engine, "mid", &rec, fast_opts());
    let bodies: Vec<String> = (0..10).map(payload).collect();
    let items: Vec<Outgoing<'_>> = bodies.iter().map(|b| order(b)).collect();
    engine.publish_batch(CH, &items).expect("publish batch");
    rec.wait_delivered(9);

    assert_eq!(rec.delivered(), vec![0, 1, 2, 3, 5, 6, 7, 8, 9]);
    let calls: Vec<u64> = rec.state().calls.iter().map(|&(n, _)| n).collect();
    assert_eq!(calls, vec![0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9]);
    let (_, payload, _) = only_dead_letter(dir.path());
    assert_eq!(payload["original"]["payload"]["n"], 4);
    assert_eq!(payload["retries"], 0);
}

/// A backlog of several full batches (read ahead while the handler runs,
/// on a machine with more than one CPU): a retry, a rejection and a seek
/// from inside the handler in the middle of it give exactly the order, the
/// dead letter and the offset they should (nothing of the skipped range,
/// nothing twice but the retried record).
#[test]
fn a_backlog_keeps_order_through_retries_rejects_and_a_seek() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    rec.script(100, vec![Action::Retry("once".into())]);
    rec.script(150, vec![Action::Reject("bad".into())]);
    let opts = SubscribeOptions {
        max_batch: 64,
        ..fast_opts()
    };
    let sub = subscribe(&engine, "backlog", &rec, opts);
    let bodies: Vec<String> = (0..400).map(payload).collect();
    let items: Vec<Outgoing<'_>> = bodies.iter().map(|b| order(b)).collect();
    // Set before the backlog is there: the handler seeks from 200 to 300.
    let published_at = |n: usize| {
        let recs = records(dir.path(), CH);
        recs[n].0
    };
    {
        let mut st = rec.state();
        // The offset of record 300 is known once published; hold the
        // handler (it waits for this lock) until it is set.
        engine.publish_batch(CH, &items).expect("publish batch");
        st.seek_on = Some((200, sub.clone(), published_at(300)));
    }
    rec.wait_delivered(399);

    let want: Vec<u64> = (0..=200).filter(|&n| n != 150).chain(300..400).collect();
    assert_eq!(rec.delivered(), want);
    let calls: Vec<u64> = rec.state().calls.iter().map(|&(n, _)| n).collect();
    let want_calls: Vec<u64> = (0..=100).chain(100..=200).chain(300..400).collect();
    assert_eq!(calls, want_calls, "each record handled once, 100 twice");
    assert!(rec.state().batches.contains(&64), "full batches");
    let (_, payload, _) = only_dead_letter(dir.path());
    assert_eq!(payload["original"]["payload"]["n"], 150);
    let end = engine.store().writer(CH).expect("writer").committed_end();
    wait_offset(dir.path(), CH, "backlog", end);
}

#[test]
fn failing_dead_letter_subscriber_skips_without_dead_lettering_again() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let dl_rec = Recorder::default();
    dl_rec.state().fail_all = true;
    let opts = SubscribeOptions {
        max_retries: 1,
        ..fast_opts()
    };
    let _dl_sub = engine
        .subscribe(DL, "dl-watch", dl_rec.clone(), opts)
        .expect("subscribe dead letters");
    let rec = Recorder::default();
    rec.script(0, vec![Action::Reject("bad".into())]);
    let _sub = subscribe(&engine, "main", &rec, fast_opts());
    publish_range(&engine, 0..1);
    let dl_writer = engine.store().writer(DL).expect("writer");
    wait_until("the dead letter", || dl_writer.committed_end() > 0);
    wait_offset(dir.path(), DL, "dl-watch", dl_writer.committed_end());

    assert_eq!(dl_rec.state().calls.len(), 2, "first call plus one retry");
    assert!(dl_rec.delivered().is_empty());
    assert_eq!(records(dir.path(), DL).len(), 1);
    assert!(!dir
        .path()
        .join("channels/orders.dead-letter.dead-letter")
        .exists());
}

// ---------------------------------------------------------------------------
// Stopping
// ---------------------------------------------------------------------------

#[test]
fn stop_during_backoff_leaves_offset_at_failing_record() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    rec.state().always_fail.insert(1);
    let opts = SubscribeOptions {
        max_retries: 3,
        backoff_base: Duration::from_secs(30),
        backoff_max: Duration::from_secs(30),
        ..fast_opts()
    };
    let _sub = subscribe(&engine, "stopper", &rec, opts);
    let published = publish_range(&engine, 0..3);
    wait_until("the first failure", || rec.calls_on(1) == 1);

    let started = Instant::now();
    assert!(engine.stop_subscriber(CH, "stopper"));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "stop waited out the 30 s backoff"
    );
    assert_eq!(rec.calls_on(1), 1);
    assert_eq!(rec.delivered(), vec![0]);
    assert_eq!(
        read_offset_file(dir.path(), CH, "stopper"),
        published[1].offset
    );
    assert!(records(dir.path(), DL).is_empty());
    assert!(!engine.stop_subscriber(CH, "stopper"));

    let again = Recorder::default();
    let _sub = subscribe(&engine, "stopper", &again, fast_opts());
    again.wait_delivered(2);
    assert_eq!(again.delivered(), vec![1, 2]);
}

#[test]
fn stop_from_inside_the_handler_returns() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    let sub = subscribe(&engine, "self", &rec, fast_opts());
    rec.state().stop_on = Some((0, sub.clone()));
    let first = publish(&engine, 0);
    rec.wait_delivered(0);
    // The thread ends once the handler returned; stopping again joins it.
    assert!(engine.stop_subscriber(CH, "self"));
    assert_eq!(
        read_offset_file(dir.path(), CH, "self"),
        end_of(&first, &engine)
    );

    publish(&engine, 1);
    let again = Recorder::default();
    let _sub = subscribe(&engine, "self", &again, fast_opts());
    again.wait_delivered(1);
    assert_eq!(again.delivered(), vec![1]);
    assert_eq!(rec.delivered(), vec![0]);
}

#[test]
fn stop_of_an_idle_subscriber_is_prompt() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    let opts = SubscribeOptions {
        poll_interval: Duration::from_secs(30),
        ..fast_opts()
    };
    let _sub = subscribe(&engine, "idle", &rec, opts);
    let p = publish(&engine, 0);
    rec.wait_delivered(0);
    wait_offset(dir.path(), CH, "idle", end_of(&p, &engine));
    // Let the worker finish the offset write (directory fsync) and start waiting;
    // this only makes the bug show, a correct stop is fast either way.
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    assert!(engine.stop_subscriber(CH, "idle"));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stop took {:?}",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------
// Offsets
// ---------------------------------------------------------------------------

#[test]
fn resumes_from_offset_file_after_reopen() {
    let dir = tempdir();
    {
        let engine = open_engine(dir.path(), 0);
        let rec = Recorder::default();
        let _sub = subscribe(&engine, "durable", &rec, fast_opts());
        assert_eq!(read_offset_file(dir.path(), CH, "durable"), 0);
        publish_range(&engine, 0..5);
        rec.wait_delivered(4);
        assert!(engine.stop_subscriber(CH, "durable"));
        publish_range(&engine, 5..8);
        engine.close();
    }
    let engine = open_engine(dir.path(), 0);
    let rec = Recorder::default();
    let _sub = subscribe(&engine, "durable", &rec, fast_opts());
    let fresh = Recorder::default();
    let _fresh = subscribe(&engine, "fresh", &fresh, fast_opts());
    let end = engine.store().writer(CH).expect("writer").committed_end();
    assert_eq!(read_offset_file(dir.path(), CH, "fresh"), end);
    publish(&engine, 8);
    rec.wait_delivered(8);
    fresh.wait_delivered(8);
    assert_eq!(rec.delivered(), vec![5, 6, 7, 8]);
    assert_eq!(fresh.delivered(), vec![8]);
}

#[test]
fn stored_offset_past_the_end_is_clamped_to_the_end() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    publish_range(&engine, 0..3);
    let end = engine.store().writer(CH).expect("writer").committed_end();
    let path = offset_file(dir.path(), CH, "ahead");
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(&path, format!("{}\n", end + 1000)).expect("write offset");

    let rec = Recorder::default();
    let _sub = subscribe(&engine, "ahead", &rec, fast_opts());
    assert_eq!(read_offset_file(dir.path(), CH, "ahead"), end);
    let p = publish(&engine, 3);
    rec.wait_delivered(3);
    assert_eq!(rec.delivered(), vec![3]);
    wait_offset(dir.path(), CH, "ahead", end_of(&p, &engine));
}

#[test]
fn stored_offset_inside_a_record_resumes_at_the_next_boundary() {
    let dir = tempdir();
    let engine = open_engine(dir.path(), 0);
    let published = publish_range(&engine, 0..3);
    for (id, offset) in [
        ("mid", published[1].offset + 5),
        ("last-byte", published[2].offset - 1),
        ("boundary", published[1].offset),
    ] {
        let path = offset_file(dir.path(), CH, id);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(&path, format!("{offset}\n")).expect("write offset");
    }

    let (mid, last_byte, boundary) = (
        Recorder::default(),
        Recorder::default(),
        Recorder::default(),
    );
    let _a = subscribe(&engine, "mid", &mid, fast_opts());
    let _b = subscribe(&engine, "last-byte", &last_byte, fast_opts());
    let _c = subscribe(&engine, "boundary", &boundary, fast_opts());
    let p3 = publish(&engine, 3);
    for r in [&mid, &last_byte, &boundary] {
        r.wait_delivered(3);
    }
    assert_eq!(mid.delivered(), vec![2, 3]);
    assert_eq!(last_byte.delivered(), vec![2, 3]);
    assert_eq!(boundary.delivered(), vec![1, 2, 3]);
    for id in ["mid", "last-byte", "boundary"] {
        wait_offset(dir.path(), CH, id, end_of(&p3, &engine));
    }
}

#[test]
fn dead_letter_write_failure_does_not_advance_the_offset() {
    let dir = tempdir();
    let poison_offset;
    {
        // Dead-letter writes keep failing: the subscriber must not move on.
        let engine = open_engine(dir.path(), 0);
        let dl = engine.store().writer(DL).expect("dead-letter writer");
        dl.inject_fault(FaultPoint::Write { partial: 0 }, 1_000_000);
        let rec = Recorder::default();
        rec.script(0, vec![Action::Reject("bad".into())]);
        let sub = subscribe(&engine, "careful", &rec, fast_opts());
        let published = publish_range(&engine, 0..2);
        poison_offset = published[0].offset;
        wait_until("three failed dead-letter writes", || {
            dl.counters().failures >= 3
        });
        assert_eq!(sub.position(), poison_offset);
        assert_eq!(read_offset_file(dir.path(), CH, "careful"), poison_offset);
        assert!(rec.delivered().is_empty(), "message 1 delivered too early");
        assert_eq!(dl.committed_end(), 0);
        assert!(engine.stop_subscriber(CH, "careful"));
        assert_eq!(read_offset_file(dir.path(), CH, "careful"), poison_offset);
        assert!(records(dir.path(), DL).is_empty());
        assert_eq!(rec.calls_on(1), 0);
        engine.close();
    }
    // A few failures, then the dead letter goes through, then the next record.
    let engine = open_engine(dir.path(), 0);
    let dl = engine.store().writer(DL).expect("dead-letter writer");
    dl.inject_fault(FaultPoint::Write { partial: 0 }, 3);
    let rec = Recorder::default();
    rec.script(0, vec![Action::Reject("bad".into())]);
    rec.state().watch = Some(dl.clone());
    let _sub = subscribe(&engine, "careful", &rec, fast_opts());
    rec.wait_delivered(1);

    assert_eq!(rec.calls_on(0), 1);
    assert_eq!(rec.delivered(), vec![1]);
    assert_eq!(dl.counters().failures, 3);
    let (_, payload, _) = only_dead_letter(dir.path());
    assert_eq!(payload["original"]["payload"]["n"], 0);
    assert_eq!(payload["retries"], 0);
    // When message 1 reached the handler, the dead letter was already committed.
    let watched = rec.state().watched.clone();
    assert_eq!(watched.len(), 1);
    assert!(watched[0].1 > 0, "{watched:?}");
    let end = engine.store().writer(CH).expect("writer").committed_end();
    wait_offset(dir.path(), CH, "careful", end);
    assert!(end > poison_offset);
}

// ---------------------------------------------------------------------------
// Compaction
// ---------------------------------------------------------------------------

#[test]
fn compaction_honours_offsets_of_subscribers_not_subscribed_now() {
    let dir = tempdir();
    let lagging_at;
    {
        let engine = open_engine(dir.path(), 1024);
        publish_range(&engine, 0..20);
        let rec = Recorder::default();
        let _sub = subscribe(&engine, "lagging", &rec, fast_opts());
        assert!(engine.stop_subscriber(CH, "lagging"));
        lagging_at = read_offset_file(dir.path(), CH, "lagging");
        publish_range(&engine, 20..40);
        engine.close();
    }
    // A new process: "lagging" has not subscribed again, its file still counts.
    let engine = open_engine(dir.path(), 1024);
    let before = segment_starts(dir.path(), CH);
    assert!(before.len() >= 4, "{before:?}");
    let holding = *before
        .iter()
        .filter(|&&s| s <= lagging_at)
        .max()
        .expect("segment");
    assert!(holding > 0);

    engine
        .compact(&RetentionConfig::default())
        .expect("compact");
    let after = segment_starts(dir.path(), CH);
    let kept: Vec<u64> = before.iter().copied().filter(|&s| s >= holding).collect();
    assert_eq!(after, kept);

    let rec = Recorder::default();
    let _sub = subscribe(&engine, "lagging", &rec, fast_opts());
    rec.wait_delivered(39);
    assert_eq!(rec.delivered(), (20..40).collect::<Vec<_>>());

    // Stopped, its offset file is at the end: every sealed segment is consumed.
    assert!(engine.stop_subscriber(CH, "lagging"));
    let report = engine
        .compact(&RetentionConfig::default())
        .expect("compact");
    assert_eq!(
        segment_starts(dir.path(), CH),
        vec![*before.last().expect("last")]
    );
    let (_, r) = report
        .iter()
        .find(|(c, _)| c == CH)
        .expect("report for the channel");
    assert_eq!(r.segments_deleted, kept.len() - 1);
}
