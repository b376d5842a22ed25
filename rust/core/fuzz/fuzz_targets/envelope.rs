//! The envelope decoder, `Envelope::decode`, on arbitrary bytes: a stored
//! line (without its `\n`) or a record of a received batch.
//!
//! Checked for every input:
//!
//! * decoding never panics;
//! * a decoded envelope is consistent: `ts_nanos` is `parse_ts_nanos(ts)`,
//!   empty optional fields are `None`, the payload is one JSON value without
//!   raw line breaks, equal to the input's `payload` (`null` when missing);
//! * it encodes (`Envelope::encode`) to exactly one line, ending in its only
//!   `\n`, with no `\r` (1.4 readers that split on either would see two
//!   records), which decodes to the same envelope and encodes to the same
//!   bytes again (a fixed point);
//! * the line a hub stores for a received record (the record verbatim when
//!   it holds neither `\n` nor `\r`, its re-encoding otherwise) is one line
//!   that decodes to the same envelope;
//! * the borrowing decoder, `EnvelopeRef::decode` (whose fast path reads the
//!   layout writers produce without a JSON parser), accepts exactly the
//!   lines `Envelope::decode` accepts, with the same fields.

#![no_main]

use keyop_core::envelope::{parse_ts_nanos, Envelope, EnvelopeRef};
use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;
use serde_json::Value;

fn same(a: &Envelope, b: &Envelope) {
    assert_eq!(a.header(), b.header());
    assert_eq!(a.ts_nanos, b.ts_nanos);
    assert_eq!(a.payload.get(), b.payload.get());
}

/// `line` (with its `\n`) is one record line that decodes to `env`.
fn one_line_of(line: &[u8], env: &Envelope, what: &str) {
    assert_eq!(
        line.last(),
        Some(&b'\n'),
        "{what} does not end in a line feed"
    );
    let body = &line[..line.len() - 1];
    assert!(
        !body.contains(&b'\n') && !body.contains(&b'\r'),
        "{what} is not one line: {:?}",
        String::from_utf8_lossy(line)
    );
    let again =
        Envelope::decode(body).unwrap_or_else(|e| panic!("{what} does not decode: {e}: {line:?}"));
    same(&again, env);
}

/// The borrowing decoder reads `line` as the owned one did (`owned`).
fn same_by_ref(line: &[u8], owned: Option<&Envelope>) {
    let by_ref = EnvelopeRef::decode(line);
    let (Some(a), Ok(b)) = (owned, &by_ref) else {
        assert_eq!(owned.is_some(), by_ref.is_ok(), "the decoders disagree on {line:?}");
        return;
    };
    assert_eq!(a.header(), b.header());
    assert_eq!(a.ts_nanos, b.ts_nanos);
    assert_eq!(a.payload.get(), b.payload);
}

fuzz_target!(|line: &[u8]| {
    let decoded = Envelope::decode(line);
    same_by_ref(line, decoded.as_ref().ok());
    let Ok(env) = decoded else {
        return;
    };
    // Its canonical encoding (the fast path's layout) reads the same both ways.
    let canonical = env.encode();
    same_by_ref(&canonical[..canonical.len() - 1], Some(&env));
    assert_eq!(parse_ts_nanos(&env.ts), Some(env.ts_nanos));
    assert_ne!(env.correlation_id.as_deref(), Some(""));
    assert_ne!(env.service_name.as_deref(), Some(""));
    let payload = env.payload.get();
    assert!(
        !payload.contains(['\n', '\r']),
        "a line break in the payload: {payload:?}"
    );
    // JSON grammar only: escapes of lone UTF-16 surrogates are grammatical
    // and kept, though a `Value` refuses them.
    serde_json::from_str::<IgnoredAny>(payload).expect("the payload is one JSON value");
    // The same value as the input's payload (line breaks between tokens
    // become spaces, nothing else changes).
    if let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(line) {
        let value: Value = serde_json::from_str(payload).expect("a payload that was a Value");
        assert_eq!(fields.remove("payload").unwrap_or(Value::Null), value);
    }

    let encoded = env.encode();
    one_line_of(&encoded, &env, "the encoding");
    let again = Envelope::decode(&encoded[..encoded.len() - 1]).expect("checked above");
    assert_eq!(again.encode(), encoded, "encoding is not a fixed point");

    // What a hub appends for this record (federation::link::receive_batch).
    let stored = if line.contains(&b'\n') || line.contains(&b'\r') {
        env.encode()
    } else {
        let mut l = line.to_vec();
        l.push(b'\n');
        l
    };
    one_line_of(&stored, &env, "the stored line");
});
