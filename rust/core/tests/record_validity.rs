//! The one definition of a valid record (envelope.rs): ids, names, fields,
//! payload depth and size, applied to received records and local publishes.

use keyop_core::engine::{encode_message, Outgoing};
use keyop_core::envelope::{
    check_payload_depth, decode_valid, decode_valid_ref, validate_field, validate_id, RecordError,
    MAX_FIELD_BYTES, MAX_ID_BYTES, MAX_PAYLOAD_DEPTH, MAX_RECORD_BYTES,
};
use keyop_core::{Error, NameKind};

/// Every record committed to `channel` of `engine`, decoded.
fn stored(engine: &keyop_core::Engine, channel: &str) -> Vec<keyop_core::Envelope> {
    let end = engine.store().writer(channel).unwrap().committed_end();
    let (mut reader, _) = engine.read(channel, 0).unwrap();
    let mut got = Vec::new();
    while let Some(item) = reader.next_item(end).unwrap() {
        if let keyop_core::storage::Item::Record { line, .. } = item {
            got.push(keyop_core::Envelope::decode(&line).unwrap());
        }
    }
    got
}

/// A durable engine named `node1` over `data_dir`.
fn open_node1(data_dir: &std::path::Path) -> keyop_core::Engine {
    keyop_core::Engine::open(
        keyop_core::StoreConfig {
            data_dir: data_dir.to_owned(),
            sync_interval_ms: 0,
            segment_bytes: 0,
        },
        "node1",
    )
    .unwrap()
}

fn nested(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

fn record(id: &str, channel: &str, payload: &str) -> Vec<u8> {
    format!(
        r#"{{"v":1,"id":{},"ts":"2026-03-31T14:22:01Z","channel":{},"origin":"node1","payload_type":"t","payload":{payload}}}"#,
        serde_json::to_string(id).unwrap(),
        serde_json::to_string(channel).unwrap()
    )
    .into_bytes()
}

#[test]
fn depth_limit_is_exact_and_ignores_brackets_in_strings() {
    check_payload_depth(nested(MAX_PAYLOAD_DEPTH).as_bytes()).unwrap();
    assert_eq!(
        check_payload_depth(nested(MAX_PAYLOAD_DEPTH + 1).as_bytes()),
        Err(RecordError::TooDeep)
    );
    let mixed = format!(
        "{}{{\"k\":1}}{}",
        "[{\"a\":".repeat(MAX_PAYLOAD_DEPTH / 2),
        "}]".repeat(MAX_PAYLOAD_DEPTH / 2)
    );
    assert_eq!(
        check_payload_depth(mixed.as_bytes()),
        Err(RecordError::TooDeep)
    );
    // Brackets inside strings (with escaped quotes) do not count.
    let text = format!(
        "[\"{}\\\"{}\", {}]",
        "[".repeat(500),
        "{".repeat(500),
        nested(MAX_PAYLOAD_DEPTH - 1)
    );
    check_payload_depth(text.as_bytes()).unwrap();
    // Wide is fine; 100,000 deep is refused without recursion.
    check_payload_depth(format!("[{}1]", "[1],".repeat(10_000)).as_bytes()).unwrap();
    assert_eq!(
        check_payload_depth(nested(100_000).as_bytes()),
        Err(RecordError::TooDeep)
    );
}

#[test]
fn ids_follow_the_documented_rule() {
    validate_id("01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f").unwrap();
    validate_id("01ARZ3NDEKTSV4RRFFQ69G5FAV").unwrap();
    validate_id("order:42_a.b").unwrap();
    validate_id(&"a".repeat(MAX_ID_BYTES)).unwrap();
    for bad in ["", "a b", "a/b", "é", "a\nb", &"a".repeat(MAX_ID_BYTES + 1)] {
        assert!(validate_id(bad).is_err(), "{bad:?}");
    }
    let huge = "x".repeat(9 * 1024 * 1024);
    let msg = validate_id(&huge).unwrap_err().to_string();
    assert!(
        msg.len() < 300,
        "the message must not echo the id: {} bytes",
        msg.len()
    );
}

#[test]
fn fields_are_bounded_and_free_of_control_characters() {
    validate_field("origin", "").unwrap();
    validate_field("origin", "host:8080").unwrap();
    validate_field("service_name", "thermostat ✓").unwrap();
    validate_field("origin", &"o".repeat(MAX_FIELD_BYTES)).unwrap();
    assert!(validate_field("origin", &"o".repeat(MAX_FIELD_BYTES + 1)).is_err());
    assert!(validate_field("correlation_id", "a\nforged line").is_err());
    assert!(validate_field("payload_type", "a\u{7f}").is_err());
}

#[test]
fn every_character_is_judged_by_the_rules() {
    // Ids: each ASCII byte alone, and inside a longer id.
    for b in 0u8..128 {
        let c = char::from(b);
        let allowed = c.is_ascii_alphanumeric() || "-_.:".contains(c);
        for id in [c.to_string(), format!("0197-{c}-abcd")] {
            assert_eq!(validate_id(&id).is_ok(), allowed, "{id:?}");
        }
    }
    // Fields: the first 512 code points (C0, DEL, C1 and beyond), alone and
    // after printable text.
    for c in (0u32..512).filter_map(char::from_u32) {
        for value in [c.to_string(), format!("svc-{c}")] {
            assert_eq!(
                validate_field("service_name", &value).is_ok(),
                !c.is_control(),
                "{value:?}"
            );
        }
    }
}

#[test]
fn received_records_are_checked_and_never_echo_bad_values() {
    let ok = record("01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f", "temps", "{}");
    let env = decode_valid(&ok, MAX_RECORD_BYTES, NameKind::Channel).unwrap();
    assert_eq!(env.channel, "temps");

    let deep = record("id-1", "temps", &nested(100_000));
    let bad = decode_valid(&deep, MAX_RECORD_BYTES, NameKind::Channel).unwrap_err();
    assert_eq!(bad.error, RecordError::TooDeep);
    assert_eq!((bad.id.as_str(), bad.channel.as_str()), ("id-1", "temps"));

    let huge_id = "x".repeat(9 * 1024 * 1024);
    let rec = record(&huge_id, "temps", "{}");
    let bad = decode_valid(&rec, usize::MAX, NameKind::Channel).unwrap_err();
    assert!(matches!(bad.error, RecordError::Field { field: "id", .. }));
    assert_eq!(bad.id, "", "an invalid id is never kept");
    assert!(bad.error.to_string().len() < 300);

    let rec = record("id-2", "../etc", "{}");
    let bad = decode_valid(&rec, MAX_RECORD_BYTES, NameKind::Channel).unwrap_err();
    assert!(matches!(
        bad.error,
        RecordError::Field {
            field: "channel",
            ..
        }
    ));
    assert_eq!((bad.id.as_str(), bad.channel.as_str()), ("id-2", ""));

    let rec = record("id-3", "temps", "\"0123456789\"");
    let bad = decode_valid(&rec, 50, NameKind::Channel).unwrap_err();
    assert!(matches!(bad.error, RecordError::TooLarge { limit: 50, .. }));
    assert_eq!(bad.id, "id-3");

    let bad = decode_valid(b"{not json", MAX_RECORD_BYTES, NameKind::Channel).unwrap_err();
    assert!(matches!(bad.error, RecordError::Unreadable(_)));
    let long_ts = format!(
        r#"{{"v":1,"id":"a","ts":"{}","channel":"c"}}"#,
        "9".repeat(1_000_000)
    );
    let bad = decode_valid(long_ts.as_bytes(), MAX_RECORD_BYTES, NameKind::Channel).unwrap_err();
    assert!(bad.error.to_string().len() < 300);
}

/// The borrowing decoder (a hub's receive path) accepts and refuses exactly
/// what the owning one does, with the same fields and the same line.
#[test]
fn the_borrowing_decoder_agrees_with_the_owning_one() {
    let escaped = br#"{"v":1,"id":"e\u002d1","ts":"2026-03-31T14:22:01Z","channel":"te\u006dps","origin":"n\"1","payload_type":"t","correlation_id":"","service_name":"s","payload":{"a":"\n"}}"#;
    let broken = b"{\"v\":1,\"id\":\"b-1\",\"ts\":\"2026-03-31T14:22:01Z\",\"channel\":\"temps\",\"payload\":{\"a\":\r\n1}}";
    let cases: Vec<(Vec<u8>, usize, NameKind)> = vec![
        (
            record("01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f", "temps", "{}"),
            MAX_RECORD_BYTES,
            NameKind::Channel,
        ),
        (
            record("id-1", "temps", &nested(100_000)),
            MAX_RECORD_BYTES,
            NameKind::Channel,
        ),
        (
            record(&"x".repeat(MAX_ID_BYTES + 1), "temps", "{}"),
            usize::MAX,
            NameKind::Channel,
        ),
        (
            record("id-2", "../etc", "{}"),
            MAX_RECORD_BYTES,
            NameKind::Channel,
        ),
        (
            record("id-3", "temps", "\"0123456789\""),
            50,
            NameKind::Channel,
        ),
        (
            record("id-4", "temps.dead-letter", "1"),
            MAX_RECORD_BYTES,
            NameKind::PublishChannel,
        ),
        (
            record("id-5", "temps.dead-letter", "1"),
            MAX_RECORD_BYTES,
            NameKind::Channel,
        ),
        (b"{not json".to_vec(), MAX_RECORD_BYTES, NameKind::Channel),
        (
            br#"{"v":2,"id":"a","ts":"2026-03-31T14:22:01Z","channel":"c"}"#.to_vec(),
            MAX_RECORD_BYTES,
            NameKind::Channel,
        ),
        (
            br#"{"v":1,"id":"a","ts":"yesterday","channel":"c"}"#.to_vec(),
            MAX_RECORD_BYTES,
            NameKind::Channel,
        ),
        (
            br#"{"v":1,"id":"a","ts":"2026-03-31T14:22:01Z","channel":"c"}"#.to_vec(),
            MAX_RECORD_BYTES,
            NameKind::Channel,
        ),
        (escaped.to_vec(), MAX_RECORD_BYTES, NameKind::Channel),
        (broken.to_vec(), MAX_RECORD_BYTES, NameKind::Channel),
    ];
    let mut accepted = 0;
    for (rec, limit, kind) in &cases {
        let text = String::from_utf8_lossy(&rec[..rec.len().min(80)]).into_owned();
        match (
            decode_valid(rec, *limit, *kind),
            decode_valid_ref(rec, *limit, *kind),
        ) {
            (Ok(owned), Ok(borrowed)) => {
                accepted += 1;
                assert_eq!(owned.id, borrowed.id, "{text}");
                assert_eq!(owned.channel, borrowed.channel, "{text}");
                assert_eq!(owned.encode(), borrowed.encode(), "{text}");
            }
            (Err(owned), Err(borrowed)) => assert_eq!(owned, borrowed, "{text}"),
            (owned, borrowed) => panic!(
                "{text}: owned {:?}, borrowed {:?}",
                owned.map(|e| e.id),
                borrowed.map(|e| e.id.into_owned())
            ),
        }
    }
    assert_eq!(
        accepted, 5,
        "the valid, the dead letter, the minimal, the escaped and the broken"
    );
}

#[test]
fn local_publish_refuses_invalid_records_before_writing() {
    let deep = nested(MAX_PAYLOAD_DEPTH + 1);
    let mut out = b"prefix".to_vec();
    let m = Outgoing {
        payload_type: "t",
        payload_json: deep.as_bytes(),
        service_name: None,
        correlation_id: None,
    };
    let e = encode_message(&mut out, "node1", "temps", &m).unwrap_err();
    assert!(
        matches!(e, Error::InvalidRecord(RecordError::TooDeep)),
        "{e}"
    );
    assert_eq!(out, b"prefix", "nothing appended");

    let m = Outgoing {
        correlation_id: Some("line\nbreak"),
        payload_json: b"{}",
        ..m
    };
    let e = encode_message(&mut out, "node1", "temps", &m).unwrap_err();
    assert!(matches!(
        e,
        Error::InvalidRecord(RecordError::Field {
            field: "correlation_id",
            ..
        })
    ));
    let ok = nested(MAX_PAYLOAD_DEPTH);
    let m = Outgoing {
        correlation_id: None,
        payload_json: ok.as_bytes(),
        ..m
    };
    encode_message(&mut out, "node1", "temps", &m).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let engine = open_node1(dir.path());
    let m = Outgoing {
        payload_json: deep.as_bytes(),
        ..m
    };
    assert!(matches!(
        engine.publish("temps", &m),
        Err(Error::InvalidRecord(RecordError::TooDeep))
    ));
    assert_eq!(engine.store().writer("temps").unwrap().committed_end(), 0);
}

/// Records framed ahead (`frame_batch`, before the data directory is open)
/// are checked as a publish checks them, and only their own instance may
/// append them: they carry its name as their origin.
#[test]
fn framed_batches_are_checked_when_framed_and_appended_only_by_their_origin() {
    use keyop_core::frame_batch;
    let item = |payload: &'static str| Outgoing {
        payload_type: "t",
        payload_json: payload.as_bytes(),
        service_name: Some("svc"),
        correlation_id: None,
    };
    let deep = nested(MAX_PAYLOAD_DEPTH + 1);
    let too_deep = Outgoing {
        payload_json: deep.as_bytes(),
        ..item("{}")
    };
    assert!(matches!(
        frame_batch("node1", "temps", &[item("{}"), too_deep], None),
        Err(Error::InvalidRecord(RecordError::TooDeep))
    ));
    assert!(matches!(
        frame_batch("node1", "bad/channel", &[item("{}")], None),
        Err(Error::InvalidName(_))
    ));
    let one_id = ["a".to_owned()];
    assert!(frame_batch("node1", "temps", &[item("{}"), item("{}")], Some(&one_id)).is_err());

    let dir = tempfile::tempdir().unwrap();
    let engine = open_node1(dir.path());
    let ids = ["job:0:0".to_owned(), "job:0:1".to_owned()];
    let foreign = frame_batch("node2", "temps", &[item("{\"a\":1}")], None).unwrap();
    let e = engine.publish_framed(foreign).unwrap_err();
    assert!(e.to_string().contains("node2"), "{e}");
    assert_eq!(engine.store().writer("temps").unwrap().committed_end(), 0);

    let framed = frame_batch(
        "node1",
        "temps",
        &[item("{\"a\":1}"), item("[2]")],
        Some(&ids),
    )
    .unwrap();
    let (offset, framed_ids) = engine.publish_framed(framed).unwrap();
    assert_eq!(offset, 0);
    let got = stored(&engine, "temps");
    let ids_read: Vec<_> = got.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids_read, ["job:0:0", "job:0:1"]);
    assert!(got
        .iter()
        .all(|e| e.origin == "node1" && e.channel == "temps"));
    assert_eq!(
        got[0].ts_nanos, got[1].ts_nanos,
        "one clock reading per batch of given ids"
    );
    assert_eq!(framed_ids.len(), 2);
    assert_eq!(framed_ids.first().as_deref(), Some("job:0:0"));
    assert_eq!(framed_ids.last().as_deref(), Some("job:0:1"));
    assert_eq!(framed_ids.to_vec(), ["job:0:0", "job:0:1"]);
    assert_eq!(framed_ids.get(2), None);
}

/// Rows framed with numbered ids (`frame_rows`) keep no string per id, yet
/// give each id back, and the receipt of a submitted batch names its last.
#[test]
fn rows_framed_with_numbered_ids_read_back_with_each_id() {
    use keyop_core::frame_rows;
    let header = Outgoing {
        payload_type: "t",
        payload_json: b"",
        service_name: None,
        correlation_id: Some("c1"),
    };
    let framed = frame_rows("node1", "temps", &header, "job:3:", 7, 3, |row, out| {
        out.extend_from_slice(format!("{{\"row\":{row}}}").as_bytes());
        Ok(())
    })
    .unwrap();
    assert_eq!(framed.ids().len(), 3);
    assert_eq!(framed.ids().first().as_deref(), Some("job:3:7"));
    assert_eq!(framed.ids().last().as_deref(), Some("job:3:9"));
    assert_eq!(framed.ids().get(3), None);
    // Ids that are not all valid are refused when framing, all or none: a
    // prefix with a space; a last id one byte too long (the first fits);
    // row numbers past u64.
    let empty = |_: usize, out: &mut Vec<u8>| {
        out.extend_from_slice(b"{}");
        Ok(())
    };
    assert!(frame_rows("node1", "temps", &header, "bad id:", 0, 1, empty).is_err());
    let long = "p".repeat(MAX_ID_BYTES - 1);
    assert!(frame_rows("node1", "temps", &header, &long, 9, 1, empty).is_ok());
    assert!(matches!(
        frame_rows("node1", "temps", &header, &long, 9, 2, empty),
        Err(Error::InvalidRecord(RecordError::Field { field: "id", .. }))
    ));
    assert!(frame_rows("node1", "temps", &header, "j:", u64::MAX, 2, empty).is_err());
    assert_eq!(
        frame_rows("node1", "temps", &header, "j:", 0, 0, empty)
            .unwrap()
            .ids()
            .len(),
        0
    );

    let dir = tempfile::tempdir().unwrap();
    let engine = open_node1(dir.path());
    let submitted = engine.submit_framed(framed).unwrap().unwrap();
    assert_eq!(submitted.id, "job:3:9");
    assert_eq!(submitted.wait().unwrap().offset, 0);
    let got = stored(&engine, "temps");
    let ids: Vec<_> = got.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["job:3:7", "job:3:8", "job:3:9"]);
    assert!(got
        .iter()
        .all(|e| e.correlation_id.as_deref() == Some("c1")));
}

#[test]
fn values_no_reader_can_hold_are_refused() {
    use keyop_core::envelope::{check_payload, MAX_INTEGER_DIGITS};
    let bad = |json: &str| {
        matches!(
            check_payload(json.as_bytes()),
            Err(RecordError::BadValue(_))
        )
    };
    // Surrogates: a pair is fine, either half alone is not, nor a half after
    // an escaped backslash (that is text, not an escape).
    check_payload(br#"{"s":"\ud83d\ude00 \u00e9 \\ud800"}"#).unwrap();
    for lone in [
        r#""\ud800""#,
        r#""\ud800x""#,
        r#""\ud800\u0041""#,
        r#""\ude00""#,
        r#""a\ude00\ud800""#,
        r#""\\\ud800""#,
        r#""\\ud800\ude00""#,
        r#"{"k":["\uDBFF"]}"#,
    ] {
        assert!(bad(lone), "{lone}");
    }
    // Numbers: doubles must be finite; integers of up to 4300 digits pass
    // (Python reads them), wherever they stand.
    for good in [
        "1e308",
        "-1.5E-400",
        "0.0",
        "[1,2,3e10]",
        "true",
        r#"{"e":1e2}"#,
    ] {
        check_payload(good.as_bytes()).unwrap();
    }
    let long = "9".repeat(MAX_INTEGER_DIGITS);
    check_payload(format!("[-{long}]").as_bytes()).unwrap();
    check_payload(format!("{{\"x\":\"{long}9e999999\"}}").as_bytes()).unwrap(); // a string
    for worse in [
        "1e999999".to_owned(),
        "[1,-1E309]".to_owned(),
        format!("{{\"n\":{long}9}}"),
        format!("[{}.5]", "9".repeat(400)),
    ] {
        assert!(bad(&worse), "{}", &worse[..worse.len().min(40)]);
    }
    // A received record is checked whole: a key besides the envelope's
    // obeys the depth and value rules as the payload does.
    let deep_key = format!(
        r#"{{"v":1,"id":"id-1","ts":"2026-03-31T14:22:01Z","channel":"temps","origin":"o","payload_type":"t","x":{},"payload":{{}}}}"#,
        nested(MAX_PAYLOAD_DEPTH + 1)
    );
    let e = decode_valid(deep_key.as_bytes(), MAX_RECORD_BYTES, NameKind::Channel).unwrap_err();
    assert_eq!(e.error, RecordError::TooDeep);
    let inf_key = deep_key.replace(&nested(MAX_PAYLOAD_DEPTH + 1), "1e999");
    let e = decode_valid(inf_key.as_bytes(), MAX_RECORD_BYTES, NameKind::Channel).unwrap_err();
    assert!(matches!(e.error, RecordError::BadValue(_)), "{e:?}");
    let fine = deep_key.replace(&nested(MAX_PAYLOAD_DEPTH + 1), &nested(MAX_PAYLOAD_DEPTH));
    decode_valid(fine.as_bytes(), MAX_RECORD_BYTES, NameKind::Channel).unwrap();
    assert!(decode_valid_ref(fine.as_bytes(), MAX_RECORD_BYTES, NameKind::Channel).is_ok());
    for rec in [&deep_key, &inf_key] {
        let Err(e) = decode_valid_ref(rec.as_bytes(), MAX_RECORD_BYTES, NameKind::Channel) else {
            panic!("accepted: {rec}");
        };
        assert!(
            matches!(e.error, RecordError::TooDeep | RecordError::BadValue(_)),
            "{e:?}"
        );
    }
    // A record in the canonical layout (the receiver's fast path) has its
    // payload checked.
    for payload in [r#""\ud800""#, "1e999", "[1,2e400]"] {
        let rec = record("id-2", "temps", payload);
        let Err(e) = decode_valid_ref(&rec, MAX_RECORD_BYTES, NameKind::Channel) else {
            panic!("accepted: {payload}");
        };
        assert!(
            matches!(e.error, RecordError::BadValue(_)),
            "{payload}: {e:?}"
        );
    }
    decode_valid_ref(
        &record("id-3", "temps", "[1e300]"),
        MAX_RECORD_BYTES,
        NameKind::Channel,
    )
    .unwrap();
    // A local publish obeys the same rule.
    let m = Outgoing {
        payload_type: "t",
        payload_json: br#"{"s":"\udfff"}"#,
        correlation_id: None,
        service_name: None,
    };
    let e = encode_message(&mut Vec::new(), "o", "temps", &m).unwrap_err();
    assert!(
        matches!(e, Error::InvalidRecord(RecordError::BadValue(_))),
        "{e:?}"
    );
}
