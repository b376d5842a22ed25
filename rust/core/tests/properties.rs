//! Property tests (issue 7, part 6) with proptest, bounded so they run in
//! the default `cargo test`: the batch frame decoder, the handshake parser,
//! the envelope decoder, and torn-tail recovery of a channel.
//!
//! * `wire::split_batch` never panics; it accepts exactly the bodies that are
//!   a concatenation of whole records (so `push_record` of what it returns
//!   rebuilds the input byte for byte), and a body cut anywhere but at a
//!   record boundary is refused.
//! * The handshake parser (`serde_json::from_slice::<Handshake>`) never
//!   panics, and handshakes round-trip.
//! * `Envelope::decode` never panics (arbitrary bytes and mutated lines), and
//!   `decode(encode(e)) == e` with `encode(decode(line)) == line`;
//!   `EnvelopeRef::decode` (borrowing) accepts the same lines with the same fields.
//! * Torn tail: for complete records spread over one to three segments plus
//!   an arbitrary fragment at the end of the last one, readers never return
//!   the fragment; opening an `Engine` cuts exactly the fragment; a reader
//!   then returns exactly the complete records, and the next publish lands
//!   where the fragment began.
//!
//! Longer runs: `PROPTEST_CASES=100000 cargo test -p keyop-core --test properties`.

use std::fs;
use std::path::Path;

use keyop_core::envelope::{encode_record, format_ts, EnvelopeRef, Header};
use keyop_core::federation::wire::{push_record, split_batch, Handshake};
use keyop_core::storage::{Item, LogReader};
use keyop_core::{read_channel, Engine, Envelope, Outgoing, StoreConfig};
use proptest::collection::vec;
use proptest::prelude::*;
use serde_json::Value;

/// `cases` per property (`PROPTEST_CASES` overrides it for longer runs); no
/// regression files are written into the source tree.
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((".{0,6}", inner), 0..4).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Strings for envelope fields: any Unicode, quotes, backslashes and
/// control characters included.
fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,16}",
        "[a-z0-9._-]{1,16}",
        Just("\"\\\n\r\t\u{0}\u{2028}".to_owned()),
    ]
}

#[derive(Debug, Clone)]
struct Fields {
    id: String,
    ts: String,
    channel: String,
    origin: String,
    payload_type: String,
    correlation_id: Option<String>,
    service_name: Option<String>,
    payload: String,
}

fn timestamp() -> impl Strategy<Value = String> {
    (0u64..4_102_444_800, 0u32..1_000_000_000)
        .prop_map(|(s, n)| format_ts(std::time::UNIX_EPOCH + std::time::Duration::new(s, n)))
}

fn envelope_fields() -> impl Strategy<Value = Fields> {
    (
        field(),
        timestamp(),
        field(),
        field(),
        field(),
        proptest::option::of(field()),
        proptest::option::of(field()),
        json_value(),
    )
        .prop_map(
            |(id, ts, channel, origin, payload_type, corr, svc, payload)| Fields {
                id,
                ts,
                channel,
                origin,
                payload_type,
                correlation_id: corr,
                service_name: svc,
                payload: serde_json::to_string(&payload).expect("JSON value serialises"),
            },
        )
}

/// One record line (with its `\n`) of an envelope.
fn encode(f: &Fields) -> Vec<u8> {
    let mut out = Vec::new();
    encode_record(
        &mut out,
        &Header {
            id: &f.id,
            ts: &f.ts,
            channel: &f.channel,
            origin: &f.origin,
            payload_type: &f.payload_type,
            correlation_id: f.correlation_id.as_deref(),
            service_name: f.service_name.as_deref(),
        },
        f.payload.as_bytes(),
    );
    out
}

/// Bytes that look like batches: random length prefixes (often small, often
/// huge) followed by random bytes.
fn batch_like_bytes() -> impl Strategy<Value = Vec<u8>> {
    vec(
        (
            prop_oneof![0u32..64, any::<u32>(), Just(u32::MAX), Just(1 << 30)],
            vec(any::<u8>(), 0..48),
        ),
        0..6,
    )
    .prop_map(|parts| {
        let mut body = Vec::new();
        for (len, bytes) in parts {
            body.extend_from_slice(&len.to_be_bytes());
            body.extend_from_slice(&bytes);
        }
        body
    })
}

// ---------------------------------------------------------------------------
// Batch frames
// ---------------------------------------------------------------------------

fn rebuild(records: &[&[u8]]) -> Vec<u8> {
    let mut body = Vec::new();
    for r in records {
        push_record(&mut body, r);
    }
    body
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn split_batch_never_panics_and_accepts_only_whole_records(
        body in prop_oneof![vec(any::<u8>(), 0..512), batch_like_bytes()]
    ) {
        if let Ok(records) = split_batch(&body) {
            prop_assert_eq!(rebuild(&records), body);
        }
    }

    #[test]
    fn split_batch_round_trips_push_record(
        records in vec(vec(any::<u8>(), 0..200), 0..8)
    ) {
        let mut body = Vec::new();
        let mut boundaries = vec![0usize];
        for r in &records {
            push_record(&mut body, r);
            boundaries.push(body.len());
        }
        let split = split_batch(&body).expect("a pushed batch splits");
        prop_assert_eq!(split.len(), records.len());
        for (got, want) in split.iter().zip(&records) {
            prop_assert_eq!(*got, want.as_slice());
        }
        // Every cut: whole records before a boundary, an error anywhere else.
        for cut in 0..=body.len() {
            match boundaries.iter().position(|&b| b == cut) {
                Some(k) => {
                    let part = split_batch(&body[..cut]).expect("cut at a boundary");
                    prop_assert_eq!(part.len(), k);
                }
                None => prop_assert!(split_batch(&body[..cut]).is_err(), "cut {} accepted", cut),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Handshakes
// ---------------------------------------------------------------------------

fn handshake_like_bytes() -> impl Strategy<Value = Vec<u8>> {
    let key = prop_oneof![
        Just("instance_name"),
        Just("role"),
        Just("version"),
        Just("last_id"),
        Just("subscribe"),
        Just("ephemeral"),
        Just("other"),
    ];
    vec((key, json_value()), 0..7).prop_map(|kv| {
        let mut text = String::from("{");
        for (i, (k, v)) in kv.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&format!("\"{k}\":{v}"));
        }
        text.push('}');
        text.into_bytes()
    })
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn handshake_parser_never_panics(
        bytes in prop_oneof![vec(any::<u8>(), 0..256), handshake_like_bytes()]
    ) {
        if let Ok(h) = serde_json::from_slice::<Handshake>(&bytes) {
            // Whatever parsed serialises and parses back to the same value.
            let again: Handshake = serde_json::from_str(&h.to_json()).expect("re-parse");
            prop_assert_eq!(again, h);
        }
    }

    #[test]
    fn handshakes_round_trip(
        name in field(),
        subscribe in vec(field(), 0..4),
        ephemeral in any::<bool>(),
        hub in any::<bool>()
    ) {
        let h = if hub { Handshake::hub(&name) } else { Handshake::client(&name, subscribe, ephemeral) };
        let text = h.to_json();
        prop_assert!(!text.contains('\n'));
        let back: Handshake = serde_json::from_slice(text.as_bytes()).expect("parse");
        prop_assert_eq!(back, h);
    }
}

// ---------------------------------------------------------------------------
// Envelopes
// ---------------------------------------------------------------------------

/// A valid line with one mutation: a byte changed, removed or inserted, or
/// the line cut short.
fn mutated_line() -> impl Strategy<Value = Vec<u8>> {
    (
        envelope_fields(),
        any::<prop::sample::Index>(),
        any::<u8>(),
        0u8..4,
    )
        .prop_map(|(f, at, byte, how)| {
            let mut line = encode(&f);
            line.pop();
            let i = at
                .index(line.len().max(1))
                .min(line.len().saturating_sub(1));
            match how {
                0 if !line.is_empty() => line[i] = byte,
                1 if !line.is_empty() => {
                    line.remove(i);
                }
                2 => line.insert(i, byte),
                _ => line.truncate(i),
            }
            line
        })
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn envelope_decode_never_panics(
        bytes in prop_oneof![vec(any::<u8>(), 0..300), mutated_line()]
    ) {
        if let Ok(env) = Envelope::decode(&bytes) {
            // Whatever decodes encodes to one line that decodes the same.
            let line = env.encode();
            prop_assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
            let again = Envelope::decode(&line[..line.len() - 1]).expect("re-decode");
            prop_assert_eq!(again.encode(), line);
        }
    }

    #[test]
    fn borrowed_decode_agrees_with_owned_decode(
        bytes in prop_oneof![vec(any::<u8>(), 0..300), mutated_line(), record_line()]
    ) {
        match (Envelope::decode(&bytes), EnvelopeRef::decode(&bytes)) {
            (Ok(owned), Ok(borrowed)) => {
                prop_assert_eq!(&owned.id, &borrowed.id);
                prop_assert_eq!(&owned.ts, &borrowed.ts);
                prop_assert_eq!(owned.ts_nanos, borrowed.ts_nanos);
                prop_assert_eq!(&owned.channel, &borrowed.channel);
                prop_assert_eq!(&owned.origin, &borrowed.origin);
                prop_assert_eq!(&owned.payload_type, &borrowed.payload_type);
                prop_assert_eq!(owned.correlation_id.as_deref(), borrowed.correlation_id.as_deref());
                prop_assert_eq!(owned.service_name.as_deref(), borrowed.service_name.as_deref());
                prop_assert_eq!(owned.payload.get(), &*borrowed.payload);
            }
            (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
            (a, b) => prop_assert!(false, "owned {:?} but borrowed {:?}", a.is_ok(), b.is_ok()),
        }
    }

    #[test]
    fn envelope_encode_decode_round_trip(f in envelope_fields()) {
        let line = encode(&f);
        prop_assert_eq!(line.last(), Some(&b'\n'));
        prop_assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1, "one line");
        let env = Envelope::decode(&line[..line.len() - 1]).expect("decode");
        prop_assert_eq!(&env.id, &f.id);
        prop_assert_eq!(&env.ts, &f.ts);
        prop_assert_eq!(env.ts_nanos, keyop_core::envelope::parse_ts_nanos(&f.ts).unwrap());
        prop_assert_eq!(&env.channel, &f.channel);
        prop_assert_eq!(&env.origin, &f.origin);
        prop_assert_eq!(&env.payload_type, &f.payload_type);
        // Empty optional fields are omitted, so they come back as None.
        prop_assert_eq!(env.correlation_id.clone(), f.correlation_id.clone().filter(|s| !s.is_empty()));
        prop_assert_eq!(env.service_name.clone(), f.service_name.clone().filter(|s| !s.is_empty()));
        prop_assert_eq!(env.payload.get(), f.payload.as_str());
        prop_assert_eq!(env.encode(), line);
    }
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn json_strings_are_escaped_exactly_like_serde_json(s in any::<String>()) {
        let mut ours = Vec::new();
        keyop_core::envelope::push_json_str(&mut ours, &s);
        prop_assert_eq!(ours, serde_json::to_vec(&s).unwrap());
    }

    #[test]
    fn timestamps_parse_back_to_the_same_instant(secs in 0u64..253_402_300_800, nanos in 0u32..1_000_000_000) {
        let ts = format_ts(std::time::UNIX_EPOCH + std::time::Duration::new(secs, nanos));
        let want = i128::from(secs) * 1_000_000_000 + i128::from(nanos);
        prop_assert_eq!(keyop_core::envelope::parse_ts_nanos(&ts).map(i128::from), Some(want).filter(|w| *w <= i128::from(i64::MAX)));
    }
}

/// Found by the `envelope` fuzz target: raw line breaks between the payload's
/// JSON tokens were kept by `decode`, so `encode` (which a hub uses to store
/// a received record holding `\n` or `\r`) made a record of several lines.
#[test]
fn line_breaks_between_payload_tokens_do_not_split_the_record() {
    let ts = "2026-03-31T14:22:01Z";
    for (raw, want) in [
        ("[1,\n2]", "[1, 2]"),
        ("{\"a\":\r\n[\ntrue ]\r}", "{\"a\":  [ true ] }"),
        ("\"x\\ny\"", "\"x\\ny\""),
    ] {
        let line = format!("{{\"v\":1,\"id\":\"i\",\"ts\":\"{ts}\",\"payload\":{raw}\r\n}}");
        let env = Envelope::decode(line.as_bytes()).expect("valid JSON");
        assert_eq!(env.payload.get(), want);
        let record = env.encode();
        assert_eq!(record.iter().filter(|&&b| b == b'\n').count(), 1);
        assert!(!record.contains(&b'\r'));
        assert_eq!(record.last(), Some(&b'\n'));
        let again = Envelope::decode(&record[..record.len() - 1]).expect("re-decode");
        assert_eq!(again.payload.get(), want);
        assert_eq!(
            serde_json::from_str::<Value>(want).unwrap(),
            serde_json::from_str::<Value>(raw).unwrap()
        );
    }
    // A raw line break inside a JSON string is not JSON at all.
    assert!(Envelope::decode(
        format!("{{\"v\":1,\"ts\":\"{ts}\",\"payload\":\"a\nb\"}}").as_bytes()
    )
    .is_err());
}

// ---------------------------------------------------------------------------
// Torn-tail recovery
// ---------------------------------------------------------------------------

/// A record line (with `\n`): an envelope, or arbitrary bytes without a line
/// feed (readers work on lines; an empty line is a record too).
fn record_line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => envelope_fields().prop_map(|f| encode(&f)),
        1 => vec(any::<u8>(), 0..40).prop_map(|mut b| {
            b.retain(|&c| c != b'\n');
            b.push(b'\n');
            b
        }),
    ]
}

/// A torn trailing record: a non-empty prefix of a record, or arbitrary
/// bytes, never containing a line feed.
fn fragment() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        (envelope_fields(), any::<prop::sample::Index>()).prop_map(|(f, at)| {
            let line = encode(&f);
            line[..1 + at.index(line.len() - 1)].to_vec()
        }),
        vec(any::<u8>(), 1..64).prop_map(|mut b| {
            for c in &mut b {
                if *c == b'\n' {
                    *c = b'x';
                }
            }
            b
        }),
    ]
}

fn read_lines(mut reader: LogReader, limit: u64) -> Vec<Vec<u8>> {
    let mut lines = Vec::new();
    for _ in 0..10_000 {
        match reader.next_item(limit).expect("read") {
            Some(Item::Record { line, .. }) => lines.push(line),
            Some(other) => panic!("unexpected item {other:?}"),
            None => return lines,
        }
    }
    panic!("reader did not stop");
}

fn write_segments(dir: &Path, records: &[Vec<u8>], cuts: &[usize], fragment: &[u8]) -> u64 {
    fs::create_dir_all(dir).unwrap();
    // Segment boundaries at record indices `cuts` (sorted, deduplicated).
    let mut starts = vec![0usize];
    starts.extend(cuts.iter().copied().filter(|&c| c > 0 && c < records.len()));
    starts.sort_unstable();
    starts.dedup();
    let mut offset = 0u64;
    for (n, &first) in starts.iter().enumerate() {
        let last = starts.get(n + 1).copied().unwrap_or(records.len());
        let mut content: Vec<u8> = records[first..last].concat();
        let start = offset;
        offset += content.len() as u64;
        if n + 1 == starts.len() {
            content.extend_from_slice(fragment);
        }
        fs::write(dir.join(format!("{start:020}.jsonl")), content).unwrap();
    }
    offset
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn torn_tail_is_cut_exactly_and_never_read(
        records in vec(record_line(), 0..12),
        cuts in vec(0usize..12, 0..3),
        frag in fragment()
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path();
        let dir = data.join("channels").join("torn");
        let complete = write_segments(&dir, &records, &cuts, &frag);
        let last_seg = *keyop_core::storage::segment::list_segments(&dir).unwrap().last().unwrap();
        let want: Vec<Vec<u8>> = records.iter().map(|r| r[..r.len() - 1].to_vec()).collect();

        // Before recovery a reader stops at the fragment.
        let before = read_lines(read_channel(data, "torn", 0).unwrap(), u64::MAX);
        prop_assert_eq!(&before, &want);

        let engine = Engine::open(
            StoreConfig { data_dir: data.to_owned(), sync_interval_ms: 0, segment_bytes: 0 },
            "prop",
        ).unwrap();
        let (reader, writer) = engine.reader("torn", 0).unwrap();
        let writer = writer.expect("the channel exists");
        prop_assert_eq!(writer.committed_end(), complete, "committed end = complete records");
        let active = dir.join(format!("{last_seg:020}.jsonl"));
        prop_assert_eq!(last_seg + fs::metadata(&active).unwrap().len(), complete,
            "exactly the fragment was cut");
        prop_assert_eq!(read_lines(reader, writer.committed_end()), want.clone());

        let p = engine.publish("torn", &Outgoing {
            payload_type: "t", payload_json: b"{}", service_name: None, correlation_id: None,
        }).unwrap();
        prop_assert_eq!(p.offset, complete, "the next record starts where the fragment was");
        let (reader, writer) = engine.reader("torn", 0).unwrap();
        let after = read_lines(reader, writer.unwrap().committed_end());
        prop_assert_eq!(after.len(), want.len() + 1);
        prop_assert_eq!(&after[..want.len()], &want[..]);
        prop_assert_eq!(Envelope::decode(&after[want.len()]).unwrap().id, p.id);
        engine.close();
    }
}
