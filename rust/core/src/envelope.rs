//! The JSONL envelope: building, encoding, decoding, and name validation.
//!
//! Every record on disk and on the wire is one envelope serialised as a single
//! line of compact JSON with the keys, in order, of keyop-messenger 1.4:
//! `v, id, ts, channel, origin, payload_type, [correlation_id], [service_name], payload`.
//!
//! This module is also the one place where names that become paths (channel
//! names, subscriber ids, peer names) are validated.

use std::fmt;
use std::io::Write as _;
use std::time::SystemTime;

use chrono::{DateTime, Datelike, Timelike, Utc};
use serde_json::value::RawValue;

/// Envelope schema version written and accepted.
pub const ENVELOPE_VERSION: u64 = 1;
/// Largest record accepted anywhere, newline included (10 MiB).
pub const MAX_RECORD_BYTES: usize = 10 * 1024 * 1024;
/// Longest name accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 255;
/// Suffix of the dead-letter companion of a channel.
pub const DEAD_LETTER_SUFFIX: &str = ".dead-letter";
/// Payload type of dead-letter envelopes.
pub const DEAD_LETTER_PAYLOAD_TYPE: &str = "com.keyop.messenger.DeadLetterPayload";
/// File-name prefix reserved for hub-side federation cursors.
pub const FED_CURSOR_PREFIX: &str = "fed-";
/// File-name prefix reserved for a client's forwarding cursors.
pub const HUB_CURSOR_PREFIX: &str = "hub-";

/// What a validated name is used for; changes which names are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameKind {
    /// A channel a caller publishes to: `.dead-letter` channels are refused.
    PublishChannel,
    /// Any channel, dead-letter companions included (subscribe, read, store).
    Channel,
    /// A local subscriber id: the `fed-` and `hub-` prefixes are reserved.
    SubscriberId,
    /// A federation peer name (certificate CN) used in cursor file names.
    PeerName,
}

impl fmt::Display for NameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NameKind::PublishChannel | NameKind::Channel => "channel name",
            NameKind::SubscriberId => "subscriber id",
            NameKind::PeerName => "peer name",
        })
    }
}

/// A name was refused; `reason` says why and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {name:?}: {reason}")]
pub struct NameError {
    pub kind: NameKind,
    pub name: String,
    pub reason: String,
}

/// Checks a name that will become (part of) a path under `data_dir`.
///
/// Allowed: 1 to [`max_len`] bytes of `A-Z a-z 0-9 . _ -`, not `.` or `..`. Channel
/// names given to publish must not end in `.dead-letter`; subscriber ids must
/// not start with `fed-` or `hub-` (those names belong to federation cursors).
pub fn validate_name(kind: NameKind, name: &str) -> Result<(), NameError> {
    let fail = |reason: String| {
        Err(NameError {
            kind,
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return fail("must not be empty".into());
    }
    let max = max_len(kind);
    if name.len() > max {
        return fail(format!(
            "is {} bytes long; at most {max} are allowed",
            name.len()
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return fail(format!(
            "contains {bad:?}; only letters, digits, '.', '_' and '-' are allowed"
        ));
    }
    if name == "." || name == ".." {
        return fail("'.' and '..' are not allowed".into());
    }
    match kind {
        NameKind::PublishChannel if name.ends_with(DEAD_LETTER_SUFFIX) => fail(format!(
            "'{DEAD_LETTER_SUFFIX}' channels are written only by the dead-letter mechanism"
        )),
        NameKind::SubscriberId
            if name.starts_with(FED_CURSOR_PREFIX) || name.starts_with(HUB_CURSOR_PREFIX) =>
        {
            fail(format!(
                "ids starting with '{FED_CURSOR_PREFIX}' or '{HUB_CURSOR_PREFIX}' are reserved for federation cursors"
            ))
        }
        _ => Ok(()),
    }
}

/// Longest name of a kind, so that every file name derived from it fits the
/// 255-byte limit of file systems: a publishable channel leaves room for its
/// `.dead-letter` companion, a subscriber id for `.offset.tmp`, a peer name
/// for `fed-` and `.offset.tmp`.
pub fn max_len(kind: NameKind) -> usize {
    const TMP_OFFSET: usize = ".offset.tmp".len();
    match kind {
        NameKind::Channel => MAX_NAME_BYTES,
        NameKind::PublishChannel => MAX_NAME_BYTES - DEAD_LETTER_SUFFIX.len(),
        NameKind::SubscriberId => MAX_NAME_BYTES - TMP_OFFSET,
        NameKind::PeerName => MAX_NAME_BYTES - FED_CURSOR_PREFIX.len() - TMP_OFFSET,
    }
}

/// The dead-letter companion of `channel`.
pub fn dead_letter_channel(channel: &str) -> String {
    format!("{channel}{DEAD_LETTER_SUFFIX}")
}

/// A new message id: a UUIDv7 in canonical lowercase form (monotonic within the process).
pub fn new_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// Formats a time as keyop-messenger 1.4 does: RFC 3339 in UTC, up to nine
/// fraction digits with trailing zeros trimmed (no dot for a whole second).
pub fn format_ts(t: SystemTime) -> String {
    let dt: DateTime<Utc> = t.into();
    let mut s = String::with_capacity(30);
    write_ts(&mut s, &dt);
    s
}

fn push_digits(out: &mut String, mut v: u32, width: usize) {
    let mut buf = [b'0'; 10];
    for slot in buf[..width].iter_mut().rev() {
        *slot = b'0' + (v % 10) as u8;
        v /= 10;
    }
    out.push_str(std::str::from_utf8(&buf[..width]).expect("ASCII digits"));
}

fn write_ts(out: &mut String, dt: &DateTime<Utc>) {
    // Years outside 0..=9999 cannot occur for clock readings; clamp like Go's
    // formatter would need to, rather than emit a malformed timestamp.
    push_digits(out, dt.year().clamp(0, 9999) as u32, 4);
    out.push('-');
    push_digits(out, dt.month(), 2);
    out.push('-');
    push_digits(out, dt.day(), 2);
    out.push('T');
    push_digits(out, dt.hour(), 2);
    out.push(':');
    push_digits(out, dt.minute(), 2);
    out.push(':');
    push_digits(out, dt.second(), 2);
    // Leap-second nanos (>= 1e9) are folded into the last representable value.
    let mut nanos = dt.nanosecond().min(999_999_999);
    if nanos != 0 {
        let mut width = 9;
        while nanos.is_multiple_of(10) {
            nanos /= 10;
            width -= 1;
        }
        out.push('.');
        push_digits(out, nanos, width);
    }
    out.push('Z');
}

/// Parses an RFC 3339 timestamp (any offset, 0-9 fraction digits) into
/// nanoseconds since the Unix epoch. `None` when it does not parse.
pub fn parse_ts_nanos(ts: &str) -> Option<i64> {
    DateTime::parse_from_rfc3339(ts)
        .ok()
        .and_then(|d| d.timestamp_nanos_opt())
}

/// The fields of an envelope other than the payload, as the publisher sets them.
#[derive(Debug, Clone, Copy)]
pub struct Header<'a> {
    pub id: &'a str,
    pub ts: &'a str,
    pub channel: &'a str,
    pub origin: &'a str,
    pub payload_type: &'a str,
    /// Omitted from the line when `None` or empty.
    pub correlation_id: Option<&'a str>,
    /// Omitted from the line when `None` or empty.
    pub service_name: Option<&'a str>,
}

fn push_json_str(out: &mut Vec<u8>, s: &str) {
    // Writing into a Vec cannot fail, and a &str always serialises.
    serde_json::to_writer(&mut *out, s).expect("string serialisation into a Vec");
}

/// Appends one record (the envelope's JSON and its `\n`) to `out`.
///
/// `payload_json` must be one compact JSON value without raw line feeds (as
/// produced by serde_json or the binding's encoder); it is copied verbatim.
pub fn encode_record(out: &mut Vec<u8>, h: &Header<'_>, payload_json: &[u8]) {
    out.extend_from_slice(b"{\"v\":1,\"id\":");
    push_json_str(out, h.id);
    out.extend_from_slice(b",\"ts\":");
    push_json_str(out, h.ts);
    out.extend_from_slice(b",\"channel\":");
    push_json_str(out, h.channel);
    out.extend_from_slice(b",\"origin\":");
    push_json_str(out, h.origin);
    out.extend_from_slice(b",\"payload_type\":");
    push_json_str(out, h.payload_type);
    if let Some(c) = h.correlation_id.filter(|c| !c.is_empty()) {
        out.extend_from_slice(b",\"correlation_id\":");
        push_json_str(out, c);
    }
    if let Some(s) = h.service_name.filter(|s| !s.is_empty()) {
        out.extend_from_slice(b",\"service_name\":");
        push_json_str(out, s);
    }
    out.extend_from_slice(b",\"payload\":");
    out.extend_from_slice(payload_json);
    let _ = out.write_all(b"}\n");
}

/// Why a stored line is not a readable envelope (the reader skips such lines).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a JSON envelope: {0}")]
    Json(#[from] serde_json::Error),
    #[error("unsupported envelope version {0}")]
    Version(String),
    #[error("timestamp {0:?} is not RFC 3339")]
    Timestamp(String),
}

/// A decoded envelope; the payload is kept as raw JSON text.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub id: String,
    pub ts: String,
    /// `ts` as nanoseconds since the Unix epoch.
    pub ts_nanos: i64,
    pub channel: String,
    pub origin: String,
    pub payload_type: String,
    pub correlation_id: Option<String>,
    pub service_name: Option<String>,
    /// Never holds a raw `\n` or `\r` when decoded.
    pub payload: Box<RawValue>,
}

#[derive(serde::Deserialize)]
struct Wire<'a> {
    #[serde(default)]
    v: Option<serde_json::Number>,
    #[serde(default, borrow)]
    id: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    ts: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    channel: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    origin: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    payload_type: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    correlation_id: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    service_name: Option<std::borrow::Cow<'a, str>>,
    payload: Option<Box<RawValue>>,
}

impl Envelope {
    /// Decodes one line (without its `\n`) with the reader rules of
    /// keyop-messenger 1.4: unknown keys are ignored, `v` must be the integer 1,
    /// `ts` must parse as RFC 3339, missing strings are empty, a missing
    /// payload is `null`. Line breaks between the payload's JSON tokens become
    /// spaces, so [`Envelope::encode`] always makes one line.
    pub fn decode(line: &[u8]) -> Result<Envelope, DecodeError> {
        let w: Wire<'_> = serde_json::from_slice(line)?;
        match &w.v {
            Some(n) if n.as_u64() == Some(ENVELOPE_VERSION) => {}
            other => {
                return Err(DecodeError::Version(
                    other.as_ref().map_or("(missing)".into(), |n| n.to_string()),
                ))
            }
        }
        let ts_nanos =
            parse_ts_nanos(&w.ts).ok_or_else(|| DecodeError::Timestamp(w.ts.to_string()))?;
        let payload = match w.payload {
            // A raw line break in valid JSON can only be whitespace between
            // tokens (strings hold them escaped). Kept, it would split the
            // record `encode` makes of this envelope into several lines, so
            // it becomes a space.
            Some(p) if memchr::memchr2(b'\n', b'\r', p.get().as_bytes()).is_some() => {
                RawValue::from_string(p.get().replace(['\n', '\r'], " "))
                    .expect("whitespace replaced by whitespace is still JSON")
            }
            Some(p) => p,
            None => RawValue::from_string("null".into()).expect("null is JSON"),
        };
        let opt = |o: Option<std::borrow::Cow<'_, str>>| {
            o.map(|c| c.into_owned()).filter(|c| !c.is_empty())
        };
        Ok(Envelope {
            id: w.id.into_owned(),
            ts: w.ts.into_owned(),
            ts_nanos,
            channel: w.channel.into_owned(),
            origin: w.origin.into_owned(),
            payload_type: w.payload_type.into_owned(),
            correlation_id: opt(w.correlation_id),
            service_name: opt(w.service_name),
            payload,
        })
    }

    /// This envelope as one record line (with `\n`), keys in the original's order.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(160 + self.payload.get().len());
        encode_record(
            &mut out,
            &Header {
                id: &self.id,
                ts: &self.ts,
                channel: &self.channel,
                origin: &self.origin,
                payload_type: &self.payload_type,
                correlation_id: self.correlation_id.as_deref(),
                service_name: self.service_name.as_deref(),
            },
            self.payload.get().as_bytes(),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn names() {
        for ok in ["a", "orders", "A.b_c-9", "x.dead-letter"] {
            validate_name(NameKind::Channel, ok).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../x",
            "a\0b",
            "a b",
            "é",
            &"x".repeat(256),
        ] {
            assert!(validate_name(NameKind::Channel, bad).is_err(), "{bad:?}");
        }
        validate_name(NameKind::Channel, &"x".repeat(255)).unwrap();
        validate_name(NameKind::PublishChannel, &"x".repeat(243)).unwrap();
        assert!(validate_name(NameKind::PublishChannel, &"x".repeat(244)).is_err());
        validate_name(NameKind::SubscriberId, &"x".repeat(244)).unwrap();
        assert!(validate_name(NameKind::SubscriberId, &"x".repeat(245)).is_err());
        assert!(validate_name(NameKind::PublishChannel, "x.dead-letter").is_err());
        assert!(validate_name(NameKind::SubscriberId, "fed-hub").is_err());
        validate_name(NameKind::Channel, "fed-hub").unwrap();
        let e = validate_name(NameKind::SubscriberId, "a/b").unwrap_err();
        assert!(e.to_string().contains("subscriber id"), "{e}");
    }

    #[test]
    fn timestamps_trim_trailing_zeros() {
        let t = |s: u64, n: u32| format_ts(UNIX_EPOCH + Duration::new(s, n));
        assert_eq!(t(1_774_966_921, 0), "2026-03-31T14:22:01Z");
        assert_eq!(t(1_774_966_921, 500_000_000), "2026-03-31T14:22:01.5Z");
        assert_eq!(
            t(1_774_966_921, 123_456_789),
            "2026-03-31T14:22:01.123456789Z"
        );
        assert_eq!(t(1_774_966_921, 1_000), "2026-03-31T14:22:01.000001Z");
        assert_eq!(
            parse_ts_nanos("2026-03-31T14:22:01.5Z"),
            Some(1_774_966_921_500_000_000)
        );
        assert_eq!(
            parse_ts_nanos("2026-03-31T16:22:01+02:00"),
            Some(1_774_966_921_000_000_000)
        );
        assert_eq!(parse_ts_nanos("yesterday"), None);
    }

    #[test]
    fn ids_are_uuid_v7_and_increase() {
        let a = new_id();
        let b = new_id();
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "7");
        assert!(a < b);
    }

    #[test]
    fn record_round_trip_and_key_order() {
        let mut out = Vec::new();
        let h = Header {
            id: "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f",
            ts: "2026-03-31T14:22:01.1234567Z",
            channel: "alerts",
            origin: "sensor-1",
            payload_type: "com.example.Alert",
            correlation_id: Some("c1"),
            service_name: Some("thermostat"),
        };
        encode_record(&mut out, &h, br#"{"message":"hot\nline"}"#);
        let line = String::from_utf8(out.clone()).unwrap();
        assert_eq!(
            line,
            "{\"v\":1,\"id\":\"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f\",\"ts\":\"2026-03-31T14:22:01.1234567Z\",\"channel\":\"alerts\",\"origin\":\"sensor-1\",\"payload_type\":\"com.example.Alert\",\"correlation_id\":\"c1\",\"service_name\":\"thermostat\",\"payload\":{\"message\":\"hot\\nline\"}}\n"
        );
        let env = Envelope::decode(&out[..out.len() - 1]).unwrap();
        assert_eq!(env.encode(), out);
        // Empty optional fields are omitted.
        let mut plain = Vec::new();
        encode_record(
            &mut plain,
            &Header {
                correlation_id: Some(""),
                service_name: None,
                ..h
            },
            b"null",
        );
        let s = String::from_utf8(plain).unwrap();
        assert!(!s.contains("correlation_id") && !s.contains("service_name"));
    }

    #[test]
    fn decode_follows_reader_rules() {
        assert!(Envelope::decode(b"not json").is_err());
        assert!(Envelope::decode(br#"{"v":2,"ts":"2026-03-31T14:22:01Z"}"#).is_err());
        assert!(Envelope::decode(br#"{"v":1.0,"ts":"2026-03-31T14:22:01Z"}"#).is_err());
        assert!(Envelope::decode(br#"{"ts":"2026-03-31T14:22:01Z"}"#).is_err());
        assert!(Envelope::decode(br#"{"v":1,"ts":"2026-13-31T14:22:01Z"}"#).is_err());
        let e = Envelope::decode(br#"{"v":1,"ts":"2026-03-31T14:22:01Z","future":[1],"id":"x"}"#)
            .unwrap();
        assert_eq!(e.id, "x");
        assert_eq!(e.payload.get(), "null");
        assert_eq!(e.payload_type, "");
    }
}
