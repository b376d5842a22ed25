//! Process life cycle of the engine: a close bounded in time (a stuck
//! handler's message stays unacknowledged), and readers that never create
//! paths. Fork safety is in fork.rs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyop_core::storage::StorageError;
use keyop_core::{read_channel, BatchOutcome, Delivery, Error, Handler, SubscribeOptions};

mod common;
use common::{msg, open_engine};

/// A handler that records its first call, then blocks until released.
#[derive(Clone, Default)]
struct Stuck {
    entered: Arc<AtomicBool>,
    release: Arc<AtomicBool>,
    calls: Arc<Mutex<Vec<String>>>,
}

impl Handler for Stuck {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        self.calls
            .lock()
            .unwrap()
            .push(batch[0].envelope().id.into_owned());
        self.entered.store(true, Ordering::SeqCst);
        while !self.release.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }
}

fn wait_for(flag: &AtomicBool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !flag.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "timed out waiting");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn close_gives_up_on_a_stuck_handler_and_keeps_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(dir.path(), 0).unwrap();
    let stuck = Stuck::default();
    let _sub = engine
        .subscribe("c", "s", stuck.clone(), SubscribeOptions::default())
        .unwrap();
    let first = engine.publish("c", &msg("{}")).unwrap().id;
    wait_for(&stuck.entered);
    let started = Instant::now();
    assert!(!engine.close_within(Duration::from_millis(200), &mut || false));
    assert!(started.elapsed() < Duration::from_secs(30), "close hung");
    drop(engine);

    let again = Stuck::default();
    again.release.store(true, Ordering::SeqCst);
    let engine = open_engine(dir.path(), 0).unwrap();
    let _sub = engine
        .subscribe("c", "s", again.clone(), SubscribeOptions::default())
        .unwrap();
    wait_for(&again.entered);
    // The abandoned handler returning now writes no offset.
    stuck.release.store(true, Ordering::SeqCst);
    assert_eq!(again.calls.lock().unwrap().clone(), vec![first]);
    engine.close();
}

#[test]
fn close_wait_can_be_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(dir.path(), 0).unwrap();
    let stuck = Stuck::default();
    let _sub = engine
        .subscribe("c", "s", stuck.clone(), SubscribeOptions::default())
        .unwrap();
    engine.publish("c", &msg("{}")).unwrap();
    wait_for(&stuck.entered);
    let mut asked = 0;
    let done = engine.close_within(Duration::from_secs(3600), &mut || {
        asked += 1;
        asked >= 2
    });
    assert!(!done);
    assert_eq!(asked, 2);
    stuck.release.store(true, Ordering::SeqCst);
    // Released: the directory can be opened again.
    drop(open_engine(dir.path(), 0).unwrap());
}

#[test]
fn readers_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    assert!(matches!(
        read_channel(&missing, "c", 0),
        Err(Error::Storage(StorageError::DataDirNotFound(_)))
    ));
    assert!(!missing.exists());
    let data = dir.path().join("data");
    let engine = open_engine(&data, 0).unwrap();
    assert!(matches!(
        engine.read("c", 0),
        Err(Error::Storage(StorageError::ChannelNotFound { .. }))
    ));
    assert!(matches!(
        read_channel(&data, "c", 0),
        Err(Error::Storage(StorageError::ChannelNotFound { .. }))
    ));
    assert!(!data.join("channels/c").exists());
    engine.publish("c", &msg("{}")).unwrap();
    assert!(engine.read("c", 0).is_ok());
    engine.close();
}
