//! The descriptor pool of segment files (storage/fdpool.rs), the check of
//! the active segment at each commit, and close releasing every file.
//!
//! One test per concern, but the first lowers this test process's
//! RLIMIT_NOFILE, so every test here runs in one function, in order.

use std::path::Path;

use keyop_core::storage::fdpool;
use keyop_core::storage::{FaultPoint, Item};
use keyop_core::{Engine, Error, Outgoing, StoreConfig};

fn open_engine(data_dir: &Path) -> Engine {
    let cfg = StoreConfig {
        data_dir: data_dir.to_owned(),
        sync_interval_ms: 0,
        segment_bytes: 0,
    };
    Engine::open(cfg, "pool-test").expect("open engine")
}

fn msg(payload: &[u8]) -> Outgoing<'_> {
    Outgoing {
        payload_type: "t",
        payload_json: payload,
        service_name: None,
        correlation_id: None,
    }
}

/// Open descriptors of this process that point into `dir`.
fn fds_into(dir: &Path) -> usize {
    let root = dir.canonicalize().expect("canonical dir");
    std::fs::read_dir("/proc/self/fd")
        .expect("list fds")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.starts_with(&root))
        .count()
}

fn ids(engine: &Engine, channel: &str) -> Vec<String> {
    let (mut reader, writer) = engine.reader(channel, 0).expect("reader");
    let limit = writer.map_or(0, |w| w.committed_end());
    let mut out = Vec::new();
    while let Some(item) = reader.next_item(limit).expect("read") {
        if let Item::Record { line, .. } = item {
            let v: serde_json::Value = serde_json::from_slice(&line).expect("json");
            out.push(v["id"].as_str().expect("id").to_owned());
        }
    }
    out
}

fn many_channels_under_a_low_limit(dir: &Path) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit on structs we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = 96;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    let engine = open_engine(dir);
    let cap = fdpool::pool().capacity();
    assert_eq!(cap, 24, "a quarter of the soft limit");
    let names: Vec<String> = (0..400).map(|i| format!("c{i:03}")).collect();
    let mut acked: Vec<Vec<String>> = vec![Vec::new(); names.len()];
    let mut peak = 0;
    for round in 0..2 {
        for (i, name) in names.iter().enumerate() {
            let p = engine
                .publish(name, &msg(format!("{{\"r\":{round}}}").as_bytes()))
                .expect("publish under a low descriptor limit");
            acked[i].push(p.id);
            if i % 40 == 0 {
                peak = peak.max(fds_into(dir));
            }
        }
    }
    for (i, name) in names.iter().enumerate() {
        assert_eq!(ids(&engine, name), acked[i], "channel {name}");
    }
    assert!(fdpool::pool().open_count() <= cap);
    // The lock file, and a file in use while evicted.
    assert!(peak <= cap + 2, "{peak} files open into the data directory");
    engine.close();
    assert_eq!(fds_into(dir), 0, "files left open after close");
}

fn unlinked_active_segment_is_written_back(dir: &Path) {
    let engine = open_engine(dir);
    let a = engine.publish("u", &msg(b"1")).expect("publish").id;
    let seg = dir.join("channels/u/00000000000000000000.jsonl");
    std::fs::remove_file(&seg).expect("unlink");
    let err = engine
        .publish("u", &msg(b"2"))
        .expect_err("unlinked segment");
    let text = err.to_string();
    assert!(
        text.contains("unlinked") && text.contains(&*seg.to_string_lossy()),
        "{text}"
    );
    let b = engine
        .publish("u", &msg(b"3"))
        .expect("publish after write-back")
        .id;
    assert_eq!(ids(&engine, "u"), [a.clone(), b.clone()]);
    engine.close();
    let again = open_engine(dir);
    assert_eq!(ids(&again, "u"), [a, b]);
    again.close();
}

fn replaced_active_segment_breaks_the_writer(dir: &Path) {
    let engine = open_engine(dir);
    engine.publish("r", &msg(b"1")).expect("publish");
    let seg = dir.join("channels/r/00000000000000000000.jsonl");
    let other = dir.join("channels/r/other.tmp");
    std::fs::write(&other, b"").expect("write other");
    std::fs::rename(&other, &seg).expect("replace");
    for _ in 0..3 {
        match engine.publish("r", &msg(b"2")) {
            Err(Error::Storage(e)) => assert!(e.to_string().contains("replaced"), "{e}"),
            other => panic!("expected a storage error, got {other:?}"),
        }
    }
    assert_eq!(std::fs::metadata(&seg).expect("stat").len(), 0);
    engine.close();
}

fn injected_errno_is_reported(dir: &Path) {
    let engine = open_engine(dir);
    let w = engine.publish_writer("e").expect("writer");
    engine.publish("e", &msg(b"1")).expect("publish");
    w.inject_fault(
        FaultPoint::WriteErrno {
            partial: 5,
            errno: libc::EIO,
        },
        1,
    );
    match engine.publish("e", &msg(b"2")) {
        Err(Error::Storage(e)) => assert_eq!(e.raw_os_error(), Some(libc::EIO)),
        other => panic!("expected EIO, got {other:?}"),
    }
    w.inject_fault(FaultPoint::SyncErrno { errno: libc::EROFS }, 1);
    match engine.publish("e", &msg(b"3")) {
        Err(Error::Storage(e)) => assert_eq!(e.raw_os_error(), Some(libc::EROFS)),
        other => panic!("expected EROFS, got {other:?}"),
    }
    engine.publish("e", &msg(b"4")).expect("publish resumes");
    assert_eq!(ids(&engine, "e").len(), 2);
    engine.close();
}

#[test]
fn descriptor_pool_and_active_segment_checks() {
    let tmp = tempfile::tempdir().expect("tempdir");
    unlinked_active_segment_is_written_back(&tmp.path().join("unlink"));
    replaced_active_segment_breaks_the_writer(&tmp.path().join("replace"));
    injected_errno_is_reported(&tmp.path().join("errno"));
    many_channels_under_a_low_limit(&tmp.path().join("many"));
}
