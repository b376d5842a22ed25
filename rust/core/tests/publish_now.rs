//! `Engine::publish_via`: a publish that calls its caller's `wait` (where
//! the binding lets go of the GIL) only when it has to wait: never for a
//! relaxed publish to an open, idle channel, always for a durable one. It
//! stores exactly what `publish` would.

use std::cell::Cell;

use keyop_core::{Engine, Error, Published};

mod common;
use common::{ids_on_disk, msg, open_engine};

/// Publishes with `publish_via`, counting the calls of its `wait`.
fn publish_counting(
    engine: &Engine,
    channel: &str,
    json: &str,
    waits: &Cell<u32>,
) -> Result<Published, Error> {
    engine.publish_via(channel, &msg(json), |append| {
        waits.set(waits.get() + 1);
        append()
    })
}

#[test]
fn relaxed_publish_to_an_open_channel_needs_no_wait() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(tmp.path(), 200).expect("open engine");
    let waits = Cell::new(0);
    // The channel's writer is opened by the first publish, in `wait`.
    let first = publish_counting(&engine, "c", "{\"n\":0}", &waits).expect("publish");
    assert_eq!(waits.get(), 1, "opening a channel may wait");
    let now = publish_counting(&engine, "c", "{\"n\":1}", &waits).expect("publish");
    assert_eq!(waits.get(), 1, "an idle writer takes the record at once");
    assert!(now.offset > first.offset);
    assert_eq!(ids_on_disk(tmp.path(), "c"), [first.id, now.id]);
}

#[test]
fn durable_publish_waits_and_a_closed_engine_refuses() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let durable = open_engine(&tmp.path().join("d"), 0).expect("open engine");
    let waits = Cell::new(0);
    for n in 0..2 {
        publish_counting(&durable, "c", "{}", &waits).expect("publish");
        assert_eq!(
            waits.get(),
            n + 1,
            "every durable publish waits for its sync"
        );
    }
    let relaxed = open_engine(&tmp.path().join("r"), 200).expect("open engine");
    relaxed.publish("c", &msg("{}")).expect("publish");
    relaxed.close();
    assert!(matches!(
        publish_counting(&relaxed, "c", "{}", &waits),
        Err(Error::Closed(_))
    ));
    assert_eq!(waits.get(), 2, "nothing to wait for after close");
}

/// What `wait` returns is the outcome: a wait that fails (an interrupted
/// caller) stores nothing.
#[test]
fn a_failed_wait_stores_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(tmp.path(), 0).expect("open engine");
    let stored = engine.publish("c", &msg("{}")).expect("publish");
    let refused = engine.publish_via("c", &msg("{}"), |_append| {
        Err(Error::Closed("interrupted".into()))
    });
    assert!(matches!(refused, Err(Error::Closed(_))));
    assert_eq!(ids_on_disk(tmp.path(), "c"), [stored.id]);
}

/// What `publish` refuses is refused before any write, even for a channel
/// whose writer is open (a dead-letter channel, opened by a reader).
#[test]
fn refuses_what_publish_refuses() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let engine = open_engine(tmp.path(), 200).expect("open engine");
    std::fs::create_dir_all(tmp.path().join("channels").join("c.dead-letter")).expect("mkdir");
    let _reader = engine
        .read("c.dead-letter", 0)
        .expect("read opens the writer");
    let waits = Cell::new(0);
    assert!(matches!(
        publish_counting(&engine, "c.dead-letter", "{}", &waits),
        Err(Error::InvalidName(_))
    ));
    engine.publish("c", &msg("{}")).expect("publish");
    let huge = format!("{{\"pad\":\"{}\"}}", "x".repeat(11 << 20));
    assert!(matches!(
        publish_counting(&engine, "c", &huge, &waits),
        Err(Error::TooLarge { .. })
    ));
    assert_eq!(waits.get(), 0);
    assert_eq!(
        ids_on_disk(tmp.path(), "c").len(),
        1,
        "nothing refused was stored"
    );
}
