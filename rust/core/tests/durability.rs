//! Directory fsyncs (weak spot 30 of keyop-messenger 1.4: no directory fsync
//! after segment creation or offset rename, so a crash can lose a new
//! segment's directory entry or an offset update).
//!
//! The storage layer's test hook records every directory entry it makes (a
//! created directory or segment, a renamed offset file, a deleted segment)
//! until the directory holding it is fsynced. Each step below must leave no
//! such entry unsynced by the time the call that made it returns. This file
//! is its own test binary, so the process-wide tracking sees only this test.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keyop_core::storage::testhook::{dir_entries, track_dir_entries};
use keyop_core::{
    BatchOutcome, Delivery, Engine, Handler, Outgoing, RetentionConfig, StoreConfig,
    SubscribeOptions,
};

const CH: &str = "durable";
/// A channel nothing was published to: subscribing creates its directories.
const CH2: &str = "fresh";

fn open_engine(data_dir: &Path) -> Engine {
    let cfg = StoreConfig {
        data_dir: data_dir.to_owned(),
        sync_interval_ms: 0,
        segment_bytes: 4096,
    };
    Engine::open(cfg, "dirsync").expect("open engine")
}

fn publish(engine: &Engine, n: usize) {
    let body = format!("{{\"n\":{n},\"pad\":\"{}\"}}", "p".repeat(500));
    engine
        .publish(
            CH,
            &Outgoing {
                payload_type: "t.T",
                payload_json: body.as_bytes(),
                service_name: None,
                correlation_id: None,
            },
        )
        .expect("publish");
}

/// Entries under `root` recorded as made, and those still unsynced.
fn tracked(root: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let (made, unsynced) = dir_entries();
    let mine = |v: Vec<PathBuf>| v.into_iter().filter(|p| p.starts_with(root)).collect();
    (mine(made), mine(unsynced))
}

fn assert_all_synced(root: &Path, step: &str) {
    let (_, unsynced) = tracked(root);
    assert!(
        unsynced.is_empty(),
        "after {step}, every new, renamed or deleted directory entry must have had its \
         directory fsynced; unsynced: {unsynced:?}"
    );
}

struct Count(Arc<AtomicUsize>);

impl Handler for Count {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        self.0.fetch_add(batch.len(), Ordering::SeqCst);
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }
}

#[test]
fn every_new_directory_entry_is_fsynced_before_the_call_returns() {
    track_dir_entries(true);
    let tmp = tempfile::tempdir().expect("temp dir");
    let root = tmp.path().join("data");
    let chan_dir = root.join("channels").join(CH);

    let engine = open_engine(&root);
    assert_all_synced(&root, "opening a new data directory");
    publish(&engine, 0);
    assert_all_synced(
        &root,
        "the first publish (channel directory, first segment)",
    );
    for n in 1..40 {
        publish(&engine, n);
        assert_all_synced(&root, &format!("publish {n} (segment rolls)"));
    }

    let opts = SubscribeOptions {
        offset_flush_interval: Duration::ZERO,
        poll_interval: Duration::from_millis(20),
        max_batch: 3,
        ..SubscribeOptions::default()
    };
    let fresh = engine
        .subscribe(CH2, "new", Count(Arc::new(AtomicUsize::new(0))), opts)
        .expect("subscribe");
    assert_all_synced(
        &root,
        "subscribe to a new channel (directories, offset file)",
    );
    // A new id starts at the end: nothing to deliver yet, so no offset write
    // runs concurrently with the check.
    let delivered = Arc::new(AtomicUsize::new(0));
    let sub = engine
        .subscribe(CH, "reader", Count(delivered.clone()), opts)
        .expect("subscribe");
    assert_all_synced(&root, "subscribe (initial offset write)");
    for n in 40..80 {
        publish(&engine, n);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while delivered.load(Ordering::SeqCst) < 40 {
        assert!(Instant::now() < deadline, "40 deliveries within 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    sub.stop();
    fresh.stop();
    assert_all_synced(&root, "delivery (offset renames after each batch of 3)");

    let reports = engine
        .compact(&RetentionConfig::default())
        .expect("compact");
    let deleted: usize = reports.iter().map(|(_, r)| r.segments_deleted).sum();
    assert!(
        deleted >= 3,
        "compaction deleted sealed segments: {reports:?}"
    );
    assert_all_synced(&root, "compaction (segment deletions)");
    engine.close();

    // The test is not vacuous: the hook saw each kind of entry.
    let (made, _) = tracked(&root);
    let count = |f: &dyn Fn(&PathBuf) -> bool| made.iter().filter(|p| f(p)).count();
    assert!(
        made.contains(&chan_dir),
        "the channel directory was recorded"
    );
    assert!(
        count(&|p| p.parent() == Some(chan_dir.as_path())) > 2 * deleted,
        "the creation and deletion of each deleted segment, and the creation of the \
         active one, were recorded: {made:?}"
    );
    assert!(
        count(&|p| p.ends_with("reader.offset")) >= 10,
        "offset renames were recorded (one per batch of 3): {made:?}"
    );
    assert!(
        made.contains(&root.join("subscribers").join(CH2)),
        "the subscribers directory created at subscribe was recorded: {made:?}"
    );
    track_dir_entries(false);
}
