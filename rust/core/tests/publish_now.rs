//! `Engine::try_publish`: the relaxed publish taken without waiting, for a
//! caller that holds the GIL. It stores exactly what `publish` would, and
//! declines (storing nothing) whenever it would have to wait.

use std::path::Path;

use keyop_core::storage::Item;
use keyop_core::{read_channel, Engine, Envelope, Error, Outgoing, StoreConfig};

fn open_engine(data_dir: &Path, sync_interval_ms: u64) -> Engine {
    Engine::open(
        StoreConfig {
            data_dir: data_dir.to_owned(),
            sync_interval_ms,
            segment_bytes: 0,
        },
        "node",
    )
    .expect("open engine")
}

fn msg(json: &str) -> Outgoing<'_> {
    Outgoing {
        payload_type: "test.T",
        payload_json: json.as_bytes(),
        service_name: None,
        correlation_id: None,
    }
}

/// The ids of the records stored in `channel`, in order.
fn stored_ids(data_dir: &Path, channel: &str) -> Vec<String> {
    let mut reader = read_channel(data_dir, channel, 0).expect("read channel");
    let mut ids = Vec::new();
    while let Some(item) = reader.next_item(u64::MAX).expect("read") {
        if let Item::Record { line, .. } = item {
            ids.push(Envelope::decode(&line).expect("valid record").id);
        }
    }
    ids
}

#[test]
fn relaxed_publish_to_an_open_channel_is_stored_at_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(tmp.path(), 200);
    // The channel's writer is opened by the first (full) publish.
    assert!(engine.try_publish("c", &msg("{\"n\":0}")).is_none());
    let first = engine.publish("c", &msg("{\"n\":0}")).expect("publish");
    let now = engine
        .try_publish("c", &msg("{\"n\":1}"))
        .expect("taken at once")
        .expect("stored");
    assert!(now.offset > first.offset);
    assert_eq!(stored_ids(tmp.path(), "c"), [first.id, now.id]);
}

#[test]
fn declines_in_durable_mode_and_after_close() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let durable = open_engine(&tmp.path().join("d"), 0);
    durable.publish("c", &msg("{}")).expect("publish");
    assert!(durable.try_publish("c", &msg("{}")).is_none());
    let relaxed = open_engine(&tmp.path().join("r"), 200);
    relaxed.publish("c", &msg("{}")).expect("publish");
    relaxed.close();
    assert!(relaxed.try_publish("c", &msg("{}")).is_none());
    assert!(matches!(
        relaxed.publish("c", &msg("{}")),
        Err(Error::Closed(_))
    ));
}

/// What `publish` refuses, `try_publish` refuses too, even for a channel
/// whose writer is open (a dead-letter channel, opened by a reader).
#[test]
fn refuses_what_publish_refuses() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(tmp.path(), 200);
    std::fs::create_dir_all(tmp.path().join("channels").join("c.dead-letter")).expect("mkdir");
    let _reader = engine
        .read("c.dead-letter", 0)
        .expect("read opens the writer");
    assert!(matches!(
        engine.try_publish("c.dead-letter", &msg("{}")),
        Some(Err(Error::InvalidName(_)))
    ));
    engine.publish("c", &msg("{}")).expect("publish");
    let huge = format!("{{\"pad\":\"{}\"}}", "x".repeat(11 << 20));
    assert!(matches!(
        engine.try_publish("c", &msg(&huge)),
        Some(Err(Error::TooLarge { .. }))
    ));
    assert_eq!(
        stored_ids(tmp.path(), "c").len(),
        1,
        "nothing refused was stored"
    );
}
