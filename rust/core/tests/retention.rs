//! Retention deletes data only by a rule the user set, and readers report
//! what is gone instead of skipping it (`shared/spec/disk-format.md` section
//! 7, with this implementation's differences: a channel with no offset file
//! keeps its data; `max_age` / `max_bytes` limits; gaps are reported).
//!
//! Every wait polls with a bounded deadline.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use keyop_core::storage::Item;
use keyop_core::{
    read_channel, BatchOutcome, Delivery, Engine, Handler, Outgoing, RetentionConfig,
    RetentionLimits, StoreConfig, SubscribeOptions,
};

const CH: &str = "readings";
const WAIT: Duration = Duration::from_secs(10);

fn open_engine(data_dir: &Path, segment_bytes: u64) -> Engine {
    let cfg = StoreConfig {
        data_dir: data_dir.to_owned(),
        sync_interval_ms: 0,
        segment_bytes,
    };
    Engine::open(cfg, "sensor-1").expect("open engine")
}

fn publish_n(engine: &Engine, channel: &str, n: u64) {
    let items: Vec<String> = (0..n).map(|i| format!("{{\"n\":{i}}}")).collect();
    let msgs: Vec<Outgoing<'_>> = items
        .iter()
        .map(|p| Outgoing {
            payload_type: "t",
            payload_json: p.as_bytes(),
            service_name: None,
            correlation_id: None,
        })
        .collect();
    for m in &msgs {
        engine.publish(channel, m).expect("publish");
    }
}

fn segment_starts(data_dir: &Path, channel: &str) -> Vec<u64> {
    let mut out: Vec<u64> = fs::read_dir(data_dir.join("channels").join(channel))
        .expect("channel dir")
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(".jsonl")?.parse().ok()
        })
        .collect();
    out.sort_unstable();
    out
}

fn segment_bytes(data_dir: &Path, channel: &str) -> u64 {
    segment_starts(data_dir, channel)
        .iter()
        .map(|s| {
            let p = data_dir
                .join("channels")
                .join(channel)
                .join(format!("{s:020}.jsonl"));
            fs::metadata(p).expect("segment").len()
        })
        .sum()
}

fn count_records(data_dir: &Path, channel: &str) -> usize {
    let mut r = read_channel(data_dir, channel, 0).expect("reader");
    let mut n = 0;
    while let Some(item) = r.next_item(u64::MAX).expect("read") {
        if matches!(item, Item::Record { .. }) {
            n += 1;
        }
    }
    n
}

fn deleted(reports: &[(String, keyop_core::CompactionReport)], channel: &str) -> usize {
    reports
        .iter()
        .find(|(c, _)| c == channel)
        .map_or(0, |(_, r)| r.segments_deleted)
}

#[test]
fn channel_without_subscribers_keeps_its_sealed_segments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(dir.path(), 1024);
    publish_n(&engine, CH, 200);
    let before = segment_starts(dir.path(), CH);
    assert!(before.len() > 5, "{before:?}");
    let reports = engine
        .compact(&RetentionConfig::default())
        .expect("compact");
    assert_eq!(deleted(&reports, CH), 0, "{reports:?}");
    assert_eq!(segment_starts(dir.path(), CH), before);
    assert_eq!(count_records(dir.path(), CH), 200);
}

#[test]
fn max_bytes_trims_the_oldest_sealed_segments_and_overrides_apply_per_channel() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(dir.path(), 1024);
    publish_n(&engine, CH, 200);
    publish_n(&engine, "kept", 200);
    let before = segment_starts(dir.path(), CH);
    let cfg = RetentionConfig {
        limits: RetentionLimits {
            max_age: None,
            max_bytes: Some(4096),
        },
        per_channel: HashMap::from([("kept".to_owned(), RetentionLimits::default())]),
        ..RetentionConfig::default()
    };
    let reports = engine.compact(&cfg).expect("compact");
    let after = segment_starts(dir.path(), CH);
    assert!(segment_bytes(dir.path(), CH) <= 4096, "{after:?}");
    assert!(after.len() >= 3, "kept as much as fits: {after:?}");
    assert_eq!(
        &before[before.len() - after.len()..],
        &after[..],
        "a suffix stays"
    );
    assert_eq!(deleted(&reports, CH), before.len() - after.len());
    assert_eq!(
        deleted(&reports, "kept"),
        0,
        "the override switches the limit off"
    );
    assert_eq!(count_records(dir.path(), "kept"), 200);
}

#[test]
fn max_age_deletes_sealed_segments_last_written_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(dir.path(), 1024);
    publish_n(&engine, CH, 100);
    let before = segment_starts(dir.path(), CH);
    let old = SystemTime::now() - Duration::from_secs(7200);
    for s in &before[..2] {
        let p = dir
            .path()
            .join("channels")
            .join(CH)
            .join(format!("{s:020}.jsonl"));
        fs::File::options()
            .write(true)
            .open(p)
            .expect("open segment")
            .set_modified(old)
            .expect("set mtime");
    }
    let cfg = RetentionConfig {
        limits: RetentionLimits {
            max_age: Some(Duration::from_secs(3600)),
            max_bytes: None,
        },
        ..RetentionConfig::default()
    };
    engine.compact(&cfg).expect("compact");
    assert_eq!(segment_starts(dir.path(), CH), before[2..].to_vec());
}

#[derive(Clone, Default)]
struct Recorder {
    offsets: Arc<Mutex<Vec<u64>>>,
    gaps: Arc<Mutex<Vec<(u64, u64)>>>,
}

impl Handler for Recorder {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        let mut got = self.offsets.lock().expect("lock");
        got.extend(batch.iter().map(|d| d.offset));
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }

    fn gap(&mut self, from: u64, to: u64) {
        self.gaps.lock().expect("lock").push((from, to));
    }
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn fast() -> SubscribeOptions {
    SubscribeOptions {
        poll_interval: Duration::from_millis(50),
        ..SubscribeOptions::default()
    }
}

#[test]
fn subscriber_is_told_of_unread_data_retention_deleted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(dir.path(), 1024);
    // Registered at offset 0, then stopped: it has read nothing.
    let idle = Recorder::default();
    engine
        .subscribe(CH, "slow", idle, fast())
        .expect("subscribe");
    assert!(engine.stop_subscriber(CH, "slow"));
    publish_n(&engine, CH, 100);
    let before = segment_starts(dir.path(), CH);
    // The consumer rule alone deletes nothing unread.
    let reports = engine
        .compact(&RetentionConfig::default())
        .expect("compact");
    assert_eq!(deleted(&reports, CH), 0);
    let cfg = RetentionConfig {
        limits: RetentionLimits {
            max_age: None,
            max_bytes: Some(4096),
        },
        ..RetentionConfig::default()
    };
    engine.compact(&cfg).expect("compact");
    let first = segment_starts(dir.path(), CH)[0];
    assert!(first > 0);
    let loss_before = keyop_core::storage::quarantine::loss_counts();

    let rec = Recorder::default();
    let _sub = engine
        .subscribe(CH, "slow", rec.clone(), fast())
        .expect("subscribe");
    let end = engine.store().writer(CH).expect("writer").committed_end();
    let sub_rec = rec.clone();
    wait_for("delivery up to the end", || {
        sub_rec.offsets.lock().expect("lock").len() >= count_records(dir.path(), CH)
    });
    assert_eq!(*rec.gaps.lock().expect("lock"), vec![(0, first)]);
    let offsets = rec.offsets.lock().expect("lock").clone();
    assert_eq!(offsets.first(), Some(&first));
    assert!(before.contains(&first));
    let loss = keyop_core::storage::quarantine::loss_counts();
    assert!(loss.gaps > loss_before.gaps);
    assert!(loss.gap_bytes >= loss_before.gap_bytes + first);
    assert!(end > first);
}

#[test]
fn a_removed_middle_segment_is_a_gap_for_readers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(dir.path(), 1024);
    publish_n(&engine, CH, 60);
    engine.close();
    let segs = segment_starts(dir.path(), CH);
    assert!(segs.len() >= 3, "{segs:?}");
    let gone = dir
        .path()
        .join("channels")
        .join(CH)
        .join(format!("{:020}.jsonl", segs[1]));
    fs::remove_file(gone).expect("remove a sealed segment");
    let mut r = read_channel(dir.path(), CH, 0).expect("reader");
    let mut gaps = Vec::new();
    while let Some(item) = r.next_item(u64::MAX).expect("read") {
        if let Item::Gap { from, to } = item {
            gaps.push((from, to));
        }
    }
    assert_eq!(gaps, vec![(segs[1], segs[2])]);
}
