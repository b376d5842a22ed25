//! Unreadable records already on disk: a subscriber quarantines each once,
//! dead-letters it with its reason, and delivers its neighbours; a corrupt
//! run glued to a valid record is split off it.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyop_core::storage::quarantine::quarantine_path;
use keyop_core::storage::Item;
use keyop_core::{
    read_channel, BatchOutcome, Delivery, Engine, Envelope, Handler, Outgoing, StoreConfig,
    SubscribeOptions, Subscriber,
};

const CH: &str = "orders";
const DL: &str = "orders.dead-letter";

fn open_engine(data_dir: &Path) -> Engine {
    let cfg = StoreConfig {
        data_dir: data_dir.to_owned(),
        sync_interval_ms: 0,
        segment_bytes: 0,
    };
    Engine::open(cfg, "node").expect("open engine")
}

fn line(id: &str, n: u64) -> String {
    format!(
        r#"{{"v":1,"id":"{id}","ts":"2026-03-31T14:22:01Z","channel":"{CH}","origin":"peer","payload_type":"t","payload":{{"n":{n}}}}}"#
    )
}

#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<String>>>);

impl Handler for Collect {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        let mut got = self.0.lock().expect("lock");
        got.extend(batch.iter().map(|d| d.envelope().id.into_owned()));
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }
}

fn dead_letters(data_dir: &Path) -> Vec<serde_json::Value> {
    let mut r = read_channel(data_dir, DL, 0).expect("reader");
    let mut out = Vec::new();
    while let Some(item) = r.next_item(u64::MAX).expect("read") {
        if let Item::Record { line, .. } = item {
            let e = Envelope::decode(&line).expect("a dead letter is a valid envelope");
            out.push(serde_json::from_str(e.payload.get()).expect("payload"));
        }
    }
    out
}

/// Waits up to 10 s for `cond`, failing the test with `what` after that.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what} not seen in 10 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Opens the engine on `data`, subscribes id `s` (its offset file already
/// written) with batches of at most `max_batch`, and waits until `records`
/// were delivered and two dead letters written. Gives back the ids
/// delivered, and the engine and subscription, to keep it running.
fn deliver_all(
    data: &Path,
    max_batch: usize,
    records: usize,
) -> (Vec<String>, Engine, Arc<Subscriber>) {
    let engine = open_engine(data);
    let got = Collect::default();
    let opts = SubscribeOptions {
        max_batch,
        poll_interval: Duration::from_millis(20),
        ..SubscribeOptions::default()
    };
    let sub = engine
        .subscribe(CH, "s", got.clone(), opts)
        .expect("subscribe");
    wait_until("delivery and dead letters", || {
        got.0.lock().expect("lock").len() >= records && dead_letters(data).len() >= 2
    });
    let ids = got.0.lock().expect("lock").clone();
    (ids, engine, sub)
}

#[test]
fn subscriber_quarantines_and_dead_letters_unreadable_records_and_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path();
    {
        let engine = open_engine(data);
        let m = Outgoing {
            payload_type: "t",
            payload_json: b"{}",
            service_name: None,
            correlation_id: None,
        };
        engine.publish(CH, &m).expect("publish");
    }
    let seg = data
        .join("channels")
        .join(CH)
        .join(format!("{:020}.jsonl", 0));
    let start = fs::metadata(&seg).expect("segment").len();
    let garbage = "not json at all";
    let torn = r#"{"v":1,"id":"torn","ts":"20"#;
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(&seg)
        .expect("open");
    writeln!(f, "{garbage}").expect("write");
    writeln!(f, "{}", line("a", 1)).expect("write");
    writeln!(f, "{torn}{}", line("glued", 2)).expect("write");
    writeln!(f, "{}", line("b", 3)).expect("write");
    drop(f);
    let subs = data.join("subscribers").join(CH);
    fs::create_dir_all(&subs).expect("mkdir");
    fs::write(subs.join("s.offset"), format!("{start}\n")).expect("offset");

    let (got, _engine, _sub) = deliver_all(data, SubscribeOptions::default().max_batch, 3);
    assert_eq!(got, vec!["a", "glued", "b"]);

    let letters = dead_letters(data);
    assert_eq!(letters.len(), 2);
    assert_eq!(letters[0]["original"], serde_json::Value::Null);
    assert_eq!(letters[0]["unreadable"], garbage);
    assert_eq!(letters[0]["offset"], start);
    assert!(letters[0]["last_error"]
        .as_str()
        .expect("text")
        .starts_with("unreadable record"));
    assert_eq!(letters[1]["unreadable"], torn);
    let glued_at = start + garbage.len() as u64 + 1 + line("a", 1).len() as u64 + 1;
    assert_eq!(letters[1]["offset"], glued_at);

    let copy = quarantine_path(data, CH, start);
    assert_eq!(
        fs::read_to_string(&copy).expect("copy"),
        format!("{garbage}\n")
    );
    assert_eq!(
        letters[0]["quarantine_file"],
        copy.strip_prefix(data)
            .expect("under data_dir")
            .to_str()
            .expect("utf-8")
    );
    let torn_copy = quarantine_path(data, CH, glued_at);
    assert_eq!(
        fs::read_to_string(torn_copy).expect("copy"),
        format!("{torn}\n")
    );
}

/// The same in a backlog of several full batches, the unreadable lines in
/// the middle of later batches (met first by the read-ahead thread, on a
/// machine with more than one CPU): each is settled in its place, after the
/// records before it and before those after it, and nothing is delivered
/// twice or lost.
#[test]
fn unreadable_records_in_a_backlog_are_settled_in_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path();
    drop(open_engine(data));
    let chan = data.join("channels").join(CH);
    fs::create_dir_all(&chan).expect("mkdir");
    let seg = chan.join(format!("{:020}.jsonl", 0));
    let torn = r#"{"v":1,"id":"torn","ts":"20"#;
    let mut text = String::new();
    let mut want = Vec::new();
    let mut bad_at = Vec::new();
    for n in 0..300u64 {
        if n == 70 {
            bad_at.push(text.len() as u64);
            text.push_str("not json\n");
        }
        let id = format!("r{n}");
        if n == 140 {
            // A torn record glued to this one, in the third batch.
            bad_at.push(text.len() as u64);
            text.push_str(torn);
        }
        text.push_str(&line(&id, n));
        text.push('\n');
        want.push(id);
    }
    fs::write(&seg, &text).expect("write segment");
    let subs = data.join("subscribers").join(CH);
    fs::create_dir_all(&subs).expect("mkdir");
    fs::write(subs.join("s.offset"), "0\n").expect("offset");

    let (got, _engine, _sub) = deliver_all(data, 64, want.len());
    assert_eq!(got, want);
    let letters = dead_letters(data);
    let offsets: Vec<u64> = letters
        .iter()
        .map(|l| l["offset"].as_u64().expect("offset"))
        .collect();
    assert_eq!(offsets, bad_at);
    assert_eq!(letters[1]["unreadable"], torn);
    let offset = subs.join("s.offset");
    wait_until("the offset at the end", || {
        fs::read_to_string(&offset).expect("offset") == format!("{}\n", text.len())
    });
}
