//! Federation pieces that are checked best without sockets: the wire format
//! against the example bytes of `shared/spec/federation.md` (§4.2, §6, §7,
//! §14), audit records (`disk-format.md` §9), client cursor names and the
//! hub's cursor TTL sweep (§8.5, which runs at most once a minute and so is
//! out of reach of the end-to-end tests in tests/test_federation.py).

use std::collections::HashSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

use keyop_core::audit::{AuditEvent, AuditLog};
use keyop_core::federation::client_cursor_id;
use keyop_core::federation::hub::sweep;
use keyop_core::federation::wire::{
    push_record, split_batch, Ack, Handshake, CLOSE_NOT_ALLOWED, CLOSE_NOT_ALLOWED_REASON,
};
use keyop_core::Envelope;

/// The first record of the example batch of federation.md §6 (189 bytes).
const SPEC_RECORD: &str = r#"{"v":1,"id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f","ts":"2026-03-31T14:22:01.1234567Z","channel":"alerts","origin":"sensor-1","payload_type":"com.example.Alert","payload":{"message":"hot"}}"#;

#[test]
fn batch_layout_matches_the_spec_example() {
    assert_eq!(SPEC_RECORD.len(), 189);
    let second = SPEC_RECORD.replace("\"hot\"", "\"very hot, really\"");
    let mut body = Vec::new();
    push_record(&mut body, SPEC_RECORD.as_bytes());
    push_record(&mut body, second.as_bytes());
    assert_eq!(
        &body[..4],
        &[0x00, 0x00, 0x00, 0xBD],
        "length 189, big-endian"
    );
    assert_eq!(&body[4..6], b"{\"");
    assert_eq!(&body[0xC1..0xC5], &(second.len() as u32).to_be_bytes());
    assert_eq!(body.len(), 8 + 189 + second.len(), "no header, no trailer");
    let records = split_batch(&body).expect("well-formed batch");
    assert_eq!(records, vec![SPEC_RECORD.as_bytes(), second.as_bytes()]);
    let env = Envelope::decode(records[0]).expect("the spec's envelope decodes");
    assert_eq!(env.id, "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f");
    assert_eq!(env.channel, "alerts");
    assert_eq!(env.origin, "sensor-1");
}

#[test]
fn truncated_batches_are_errors_and_empty_is_legal() {
    let mut body = Vec::new();
    push_record(&mut body, SPEC_RECORD.as_bytes());
    assert!(split_batch(&[]).expect("empty body").is_empty());
    for cut in [1, 3, 4, 5, body.len() - 1] {
        assert!(
            split_batch(&body[..cut]).is_err(),
            "a body cut at {cut} bytes is malformed"
        );
    }
}

#[test]
fn handshakes_and_acks_match_the_spec_bytes() {
    assert_eq!(
        Handshake::client("dash-1", vec!["alerts".into(), "metrics".into()], false).to_json(),
        r#"{"instance_name":"dash-1","role":"client","version":"1","subscribe":["alerts","metrics"]}"#
    );
    assert_eq!(
        Handshake::client("sensor-1", Vec::new(), false).to_json(),
        r#"{"instance_name":"sensor-1","role":"client","version":"1"}"#
    );
    assert_eq!(
        Handshake::client("kiosk", vec!["alerts".into()], true).to_json(),
        r#"{"instance_name":"kiosk","role":"client","version":"1","subscribe":["alerts"],"ephemeral":true}"#
    );
    assert_eq!(
        Handshake::hub("hub1.example.net").to_json(),
        r#"{"instance_name":"hub1.example.net","role":"hub","version":"1"}"#
    );
    // Readers ignore unknown keys and the legacy last_id.
    let h: Handshake = serde_json::from_str(
        r#"{"instance_name":"dash-1","role":"client","version":"1","last_id":"x","subscribe":["alerts"],"future":{"a":1}}"#,
    )
    .expect("lenient handshake parsing");
    assert_eq!(h.subscribe, vec!["alerts".to_string()]);
    assert!(!h.ephemeral);
    assert_eq!(
        Ack {
            last_id: "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f".into(),
            ..Ack::default()
        }
        .to_json(),
        r#"{"last_id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f"}"#
    );
    assert_eq!(Ack::default().to_json(), r#"{"last_id":""}"#);
    assert_eq!(
        (CLOSE_NOT_ALLOWED, CLOSE_NOT_ALLOWED_REASON),
        (4403, "not in allowlist")
    );
}

#[test]
fn audit_records_keep_key_order_and_omit_empty_fields() {
    let dir = tempfile::tempdir().expect("temp dir");
    let log = AuditLog::open(dir.path(), 100, 10).expect("open audit log");
    let mut connected = AuditEvent::new("client_connected");
    connected.peer = "dash-1".into();
    connected.peer_addr = "10.0.0.7:53122".into();
    connected.detail = "addr=10.0.0.7:53122 sub=[alerts]".into();
    log.log(connected);
    let mut forward = AuditEvent::new("forward");
    forward.message_id = "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f".into();
    forward.channel = "temps".into();
    forward.direction = "inbound".into();
    forward.peer = "sensor-1".into();
    log.log(forward);
    let mut rejected = AuditEvent::new("client_rejected");
    rejected.peer = "intruder".into();
    log.log(rejected);
    log.close();

    let text = fs::read_to_string(dir.path().join("audit/audit.jsonl")).expect("audit file");
    let tails: Vec<&str> = text
        .lines()
        .map(|line| {
            let rest = line.strip_prefix(r#"{"ts":""#).expect("ts first");
            let (ts, tail) = rest.split_once('"').expect("ts string");
            assert!(is_trimmed_rfc3339(ts), "ts {ts:?}");
            tail
        })
        .collect();
    assert_eq!(
        tails,
        vec![
            r#","event":"client_connected","peer":"dash-1","peer_addr":"10.0.0.7:53122","detail":"addr=10.0.0.7:53122 sub=[alerts]"}"#,
            r#","event":"forward","message_id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f","channel":"temps","direction":"inbound","peer":"sensor-1"}"#,
            r#","event":"client_rejected","peer":"intruder"}"#,
        ]
    );
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction without trailing zeros]Z`.
fn is_trimmed_rfc3339(ts: &str) -> bool {
    let b = ts.as_bytes();
    let digits = |r: std::ops::Range<usize>| r.into_iter().all(|i| b[i].is_ascii_digit());
    if b.len() < 20 || !ts.ends_with('Z') {
        return false;
    }
    let head_ok = digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19);
    let frac = &ts[19..ts.len() - 1];
    let frac_ok = frac.is_empty()
        || (frac.starts_with('.')
            && (2..=10).contains(&frac.len())
            && frac[1..].bytes().all(|c| c.is_ascii_digit())
            && !frac.ends_with('0'));
    head_ok && frac_ok
}

#[test]
fn client_cursor_ids_replace_separators() {
    assert_eq!(client_cursor_id("127.0.0.1:7740"), "hub-127.0.0.1_7740");
    assert_eq!(client_cursor_id("localhost:7740"), "hub-localhost_7740");
    assert_eq!(
        client_cursor_id("hub1.example.net:7740"),
        "hub-hub1.example.net_7740"
    );
    assert_eq!(client_cursor_id("[::1]:7740"), "hub-___1__7740");
}

fn write_aged(path: &Path, age: Duration) {
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(path, "42\n").expect("write offset");
    let file = fs::File::options().write(true).open(path).expect("open");
    file.set_modified(SystemTime::now() - age)
        .expect("set mtime");
}

#[test]
fn ttl_sweep_removes_only_stale_cursors_of_absent_peers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    for ch in ["alerts", "temps"] {
        fs::create_dir_all(root.join("channels").join(ch)).expect("channel dir");
    }
    let subs = |ch: &str, file: &str| root.join("subscribers").join(ch).join(file);
    let day = Duration::from_secs(86_400);
    let stale_gone = subs("alerts", "fed-dash-1.offset");
    let stale_other = subs("temps", "fed-dash-1.offset");
    let stale_connected = subs("alerts", "fed-live.offset");
    let fresh = subs("alerts", "fed-dash-2.offset");
    let local = subs("alerts", "worker.offset");
    let forwarding = subs("alerts", "hub-127.0.0.1_7740.offset");
    write_aged(&stale_gone, 10 * day);
    write_aged(&stale_other, 10 * day);
    write_aged(&stale_connected, 10 * day);
    write_aged(&fresh, Duration::from_secs(60));
    write_aged(&local, 10 * day);
    write_aged(&forwarding, 10 * day);

    let connected: HashSet<String> = ["live".to_string()].into();
    let mut removed = sweep(root, 7 * day, &connected);
    removed.sort();
    let mut expected = vec![stale_gone, stale_other];
    expected.sort();
    assert_eq!(removed, expected);
    for kept in [&stale_connected, &fresh, &local, &forwarding] {
        assert!(kept.exists(), "{} must stay", kept.display());
    }
    assert!(sweep(root, 7 * day, &HashSet::new()).contains(&stale_connected));
}
