//! The fast path of [`EnvelopeRef::decode`](super::EnvelopeRef::decode):
//! a line laid out exactly as [`encode_record`](super::encode_record) writes
//! it, read by walking its known keys instead of running a JSON parser over
//! the header. Every writer of the format (this one, and keyop-messenger
//! 1.4) writes that layout, so nearly every stored line takes this path.
//!
//! It accepts a line only when the full decoder would read it the same
//! way: header strings without escapes or control characters, the keys in
//! the canonical order with no whitespace, and a payload that is one valid
//! JSON value with no surrounding whitespace or raw line break. Anything
//! else (an escape, another key, another order, an error of any kind)
//! returns `None`, and the caller decodes the line in full, with its error
//! messages.

use std::borrow::Cow;

use serde::de::IgnoredAny;

use super::{non_empty, parse_ts_nanos, EnvelopeRef};

/// Everything before the id's text.
const HEAD: &[u8] = b"{\"v\":1,\"id\":\"";

/// The envelope of `line` if it has the canonical layout (see the module
/// documentation), else `None`.
pub(super) fn decode(line: &[u8]) -> Option<EnvelopeRef<'_>> {
    let rest = line.strip_prefix(HEAD)?;
    let line = std::str::from_utf8(line).ok()?;
    let mut at = Cursor {
        line,
        pos: line.len() - rest.len(),
    };
    let id = at.string()?;
    at.key(b",\"ts\":\"")?;
    let ts = at.string()?;
    at.key(b",\"channel\":\"")?;
    let channel = at.string()?;
    at.key(b",\"origin\":\"")?;
    let origin = at.string()?;
    at.key(b",\"payload_type\":\"")?;
    let payload_type = at.string()?;
    let correlation_id = at.optional(b",\"correlation_id\":\"")?;
    let service_name = at.optional(b",\"service_name\":\"")?;
    at.key(b",\"payload\":")?;
    let payload = line[at.pos..].strip_suffix('}')?;
    let (first, last) = (*payload.as_bytes().first()?, *payload.as_bytes().last()?);
    if first.is_ascii_whitespace()
        || last.is_ascii_whitespace()
        || memchr::memchr2(b'\n', b'\r', payload.as_bytes()).is_some()
    {
        return None;
    }
    // One whole JSON value and nothing after it: a trailing `,"key":...`
    // taken into the payload by the strip above fails here. Skipping a value
    // has no depth limit, here or in the full decoder; the record rules'
    // depth limit (`check_payload_depth`) is separate, as before.
    serde_json::from_str::<IgnoredAny>(payload).ok()?;
    let ts_nanos = parse_ts_nanos(ts)?;
    Some(EnvelopeRef {
        id: Cow::Borrowed(id),
        ts: Cow::Borrowed(ts),
        ts_nanos,
        channel: Cow::Borrowed(channel),
        origin: Cow::Borrowed(origin),
        payload_type: Cow::Borrowed(payload_type),
        correlation_id: non_empty(correlation_id.map(Cow::Borrowed)),
        service_name: non_empty(service_name.map(Cow::Borrowed)),
        payload: Cow::Borrowed(payload),
    })
}

/// The id, channel and origin of `line` if its header starts in the
/// canonical layout, up to the key after `origin`; nothing after that is
/// read. For a sender that forwards lines as they are stored (its receiver
/// checks the whole record), and to name a record that does not decode.
pub(super) fn leading_fields(line: &[u8]) -> Option<(&str, &str, &str)> {
    fn string<'a>(at: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = plain_len(at)?;
        let s = &at[..len];
        *at = &at[len + 1..];
        Some(s)
    }
    fn key(at: &mut &[u8], key: &[u8]) -> Option<()> {
        *at = at.strip_prefix(key)?;
        Some(())
    }
    let mut at = line.strip_prefix(HEAD)?;
    let id = string(&mut at)?;
    key(&mut at, b",\"ts\":\"")?;
    string(&mut at)?;
    key(&mut at, b",\"channel\":\"")?;
    let channel = string(&mut at)?;
    key(&mut at, b",\"origin\":\"")?;
    let origin = string(&mut at)?;
    key(&mut at, b",\"payload_type\":\"")?;
    let text = |b| std::str::from_utf8(b).ok();
    Some((text(id)?, text(channel)?, text(origin)?))
}

/// The length of `b` up to its first `"`, if no `\\` and no control
/// character (below 0x20) comes before it: the text of a JSON string that
/// needs no unescaping. Eight bytes per step: header strings are short, and
/// a test per byte was a tenth of a subscriber's time per message.
fn plain_len(b: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    /// High bit set in each byte of `x` below `n` (n <= 0x80); exact for the
    /// lowest such byte, which is all that is read (a borrow can also flag
    /// bytes above it).
    fn below(x: u64, n: u8) -> u64 {
        x.wrapping_sub(ONES * u64::from(n)) & !x & HIGH
    }
    let stop = |c: u8| c == b'"' || c == b'\\' || c < 0x20;
    let mut at = 0;
    let found = loop {
        let Some(chunk) = b.get(at..at + 8) else {
            break at + b[at..].iter().position(|&c| stop(c))?;
        };
        let x = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
        // A byte equal to `c` is a zero byte of `x ^ c`, i.e. below 1.
        let m = below(x ^ (ONES * u64::from(b'"')), 1)
            | below(x ^ (ONES * u64::from(b'\\')), 1)
            | below(x, 0x20);
        if m != 0 {
            // Little-endian: the lowest flagged bit is the first such byte.
            break at + (m.trailing_zeros() / 8) as usize;
        }
        at += 8;
    };
    (b[found] == b'"').then_some(found)
}

/// A position in a line being read.
struct Cursor<'a> {
    line: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// The text of a string whose opening quote is behind the cursor, up to
    /// its closing quote (the cursor moves past it); `None` for a string
    /// with an escape or a control character, or no end.
    fn string(&mut self) -> Option<&'a str> {
        let len = plain_len(&self.line.as_bytes()[self.pos..])?;
        let s = &self.line[self.pos..self.pos + len];
        self.pos += len + 1;
        Some(s)
    }

    /// Moves past `key` (the bytes from a value's end to the next value's
    /// start), or `None` if it is not next.
    fn key(&mut self, key: &[u8]) -> Option<()> {
        self.line.as_bytes()[self.pos..].starts_with(key).then(|| {
            self.pos += key.len();
        })
    }

    /// The string under `key` if it is next, else nothing (the outer `None`
    /// only when it is next but not a plain string).
    fn optional(&mut self, key: &[u8]) -> Option<Option<&'a str>> {
        if self.key(key).is_none() {
            return Some(None);
        }
        self.string().map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{encode_record, Header};

    const TS: &str = "2026-03-31T14:22:01.123456789Z";

    fn line(h: &Header<'_>, payload: &str) -> Vec<u8> {
        let mut out = Vec::new();
        encode_record(&mut out, h, payload.as_bytes());
        out.pop();
        out
    }

    fn header<'a>(corr: Option<&'a str>, svc: Option<&'a str>) -> Header<'a> {
        Header {
            id: "0195f3c2-7a4b-7c3d-8e9f-0a1b2c3d4e5f",
            ts: TS,
            channel: "orders",
            origin: "edge-1",
            payload_type: "bench.Reading",
            correlation_id: corr,
            service_name: svc,
        }
    }

    /// Reads `line` both ways and checks they agree, field by field.
    fn same_as_full(line: &[u8]) -> bool {
        let full = super::super::decode_full(line).expect("the full decoder reads it");
        let Some(fast) = decode(line) else {
            return false;
        };
        assert_eq!(fast.header(), full.header());
        assert_eq!(fast.ts_nanos, full.ts_nanos);
        assert_eq!(fast.payload, full.payload);
        true
    }

    #[test]
    fn written_records_take_the_fast_path_and_read_as_the_full_decoder_reads_them() {
        let payloads = [
            r#"{"sensor":"t-17","celsius":21.5,"seq":0,"ok":true}"#,
            r#"{"a":"x}\"y","b":[1,{"c":null}]}"#,
            r#""just \"text\" \u00e9""#,
            "null",
            "1.5e3",
            "[]",
        ];
        for corr in [None, Some("k-1")] {
            for svc in [None, Some("svc")] {
                for p in payloads {
                    let l = line(&header(corr, svc), p);
                    assert!(same_as_full(&l), "{}", String::from_utf8_lossy(&l));
                }
            }
        }
        // Non-ASCII header text needs no escape.
        let mut h = header(None, None);
        h.origin = "büro-ø";
        assert!(same_as_full(&line(&h, "{}")));
    }

    #[test]
    fn leading_fields_read_from_the_header_match_the_full_decoder() {
        for corr in [None, Some("k-1")] {
            let mut h = header(corr, None);
            h.origin = "büro-ø";
            let l = line(&h, r#"{"x":1}"#);
            let full = super::super::decode_full(&l).expect("decodes");
            assert_eq!(
                leading_fields(&l),
                Some((&*full.id, &*full.channel, &*full.origin))
            );
        }
        let ok = String::from_utf8(line(&header(None, None), r#"{"x":1}"#)).expect("utf-8");
        // Not the canonical layout up to the key after `origin`: left to
        // the full decoder.
        for other in [
            ok.replace("edge-1", r"edge\u003c1"),
            ok.replace("\"v\":1", "\"v\": 1"),
            ok.replace(",\"origin\"", ",\"extra\":0,\"origin\""),
            ok.replace(",\"payload_type\"", " ,\"payload_type\""),
            ok[..40].to_string(),
        ] {
            assert!(leading_fields(other.as_bytes()).is_none(), "{other}");
        }
        let mut bad_utf8 = ok.clone().into_bytes();
        bad_utf8[HEAD.len()] = 0xff;
        assert!(leading_fields(&bad_utf8).is_none());
        // The payload is not read: the receiver checks it.
        let broken = ok.replace("{\"x\":1}", "{\"x\":");
        assert!(leading_fields(broken.as_bytes()).is_some());
        assert!(decode(broken.as_bytes()).is_none());
    }

    #[test]
    fn any_other_layout_is_left_to_the_full_decoder() {
        let ok = line(&header(Some("k"), None), r#"{"x":1}"#);
        let text = String::from_utf8(ok.clone()).expect("utf-8");
        let others: Vec<String> = vec![
            // An escape in a header string (Go escapes `<`, `>`, `&`).
            text.replace("edge-1", r"edge\u003c1"),
            text.replace("edge-1", r#"edge\"1"#),
            // Whitespace between tokens, around or inside the payload.
            text.replace("\"v\":1", "\"v\": 1"),
            text.replace("\"payload\":{", "\"payload\": {"),
            text.replace("{\"x\":1}", "{\"x\":1} "),
            text.replace("{\"x\":1}", "{\"x\":\r1}"),
            // Another key, in the header or after the payload.
            text.replace(",\"origin\"", ",\"extra\":0,\"origin\""),
            text.replace("{\"x\":1}}", "{\"x\":1},\"extra\":\"}\"}"),
            // Keys out of order, or a version written another way.
            text.replace(
                &format!(",\"ts\":\"{TS}\",\"channel\":\"orders\""),
                &format!(",\"channel\":\"orders\",\"ts\":\"{TS}\""),
            ),
            text.replace("\"v\":1", "\"v\":1.0"),
        ];
        for other in &others {
            assert_ne!(other, &text, "each case changes the line");
            assert!(decode(other.as_bytes()).is_none(), "{other}");
            // ... and the full decoder still reads those it accepts.
            if let Ok(full) = super::super::decode_full(other.as_bytes()) {
                assert_eq!(full.id, "0195f3c2-7a4b-7c3d-8e9f-0a1b2c3d4e5f");
            }
        }
    }

    /// Deep payloads read the same both ways: skipping a value has no depth
    /// limit in either decoder (the reader's depth rule is applied after).
    #[test]
    fn deep_payloads_read_as_the_full_decoder_reads_them() {
        for depth in [100, 101, 127, 128, 129, 10_000] {
            let payload = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            let l = line(&header(None, None), &payload);
            assert!(same_as_full(&l), "depth {depth}");
        }
    }

    /// The eight-bytes-at-a-time scan finds what a scan byte by byte finds,
    /// for every byte value at every position of the first two words.
    #[test]
    fn plain_strings_end_where_a_byte_scan_says() {
        let naive = |b: &[u8]| {
            let at = b
                .iter()
                .position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
            (b[at] == b'"').then_some(at)
        };
        for len in 0..20 {
            for at in 0..len {
                for c in 0..=255u8 {
                    let mut b = vec![b'a'; len];
                    b[at] = c;
                    assert_eq!(plain_len(&b), naive(&b), "{c:#x} at {at} of {len}");
                    b.push(b'"');
                    b.extend_from_slice(b"\\tail\x01");
                    assert_eq!(plain_len(&b), naive(&b), "{c:#x} at {at} of {len}, quoted");
                }
            }
        }
        // Bytes above 0x7f (UTF-8) are text; a control byte after a
        // high byte is still seen.
        assert_eq!(plain_len("ééééé\"".as_bytes()), Some(10));
        assert_eq!(plain_len(b"\xff\xff\x1f\""), None);
    }

    #[test]
    fn broken_lines_are_left_to_the_full_decoder() {
        let ok = line(&header(None, None), r#"{"x":1}"#);
        let text = String::from_utf8(ok.clone()).expect("utf-8");
        let broken = [
            text.replace("{\"x\":1}", "{\"x\":"),
            text.replace("{\"x\":1}", "{\"x\":1}}"),
            text.replace("{\"x\":1}", ""),
            text.replace(TS, "yesterday"),
            text.replace("edge-1", "edge\u{1}1"),
            text[..text.len() - 1].to_string(),
            text[..30].to_string(),
        ];
        for b in &broken {
            assert!(decode(b.as_bytes()).is_none(), "{b}");
            assert!(super::super::decode_full(b.as_bytes()).is_err(), "{b}");
        }
        let mut bad_utf8 = ok.clone();
        bad_utf8[20] = 0xff;
        assert!(decode(&bad_utf8).is_none());
    }
}
