//! [`Delivery`]: one stored record handed to a handler. Its envelope is kept
//! as byte ranges of one buffer, the record's line, so reading a batch
//! allocates at most one buffer per record (the line, and a reader reuses
//! those) instead of one per field. The ranges are 32-bit and the value
//! small (112 bytes on 64-bit targets): a subscriber moves it from its read-ahead
//! thread's queue into the batch, across CPUs, once per record.

use std::borrow::Cow;

use crate::envelope::{EnvelopeRef, MAX_RECORD_BYTES};
use crate::storage::quarantine::decode_stored_ref;

/// One record handed to a handler.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Global offset of the record.
    pub offset: u64,
    /// The raw line (without `\n`), then the text of each field the line
    /// does not hold as is (an escaped string, a default, a payload whose
    /// line breaks became spaces). Never changed once decoded, so the spans
    /// stay valid.
    buf: Vec<u8>,
    /// Length of the line at the start of `buf`.
    line_len: u32,
    ts_nanos: i64,
    /// id, ts, channel, origin, payload_type, correlation_id, service_name,
    /// payload: each a range of `buf`, [`ABSENT`] for an optional one unset.
    spans: [Span; FIELDS],
}

const FIELDS: usize = 8;
const ID: usize = 0;
const TS: usize = 1;
const CHANNEL: usize = 2;
const ORIGIN: usize = 3;
const PAYLOAD_TYPE: usize = 4;
const CORRELATION_ID: usize = 5;
const SERVICE_NAME: usize = 6;
const PAYLOAD: usize = 7;

/// `buf[from..to]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    from: u32,
    to: u32,
}

/// An optional field that is not set.
const ABSENT: Span = Span {
    from: u32::MAX,
    to: u32::MAX,
};

// A line is at most MAX_RECORD_BYTES, and a field's own text is never longer
// than the line it was decoded from: `buf` stays far below 4 GiB.
const _: () = assert!(2 * (MAX_RECORD_BYTES as u64) < u32::MAX as u64);

fn span(from: usize, to: usize) -> Span {
    // Within `buf`, which the assertion above keeps under u32::MAX.
    Span {
        from: from as u32,
        to: to as u32,
    }
}

impl Delivery {
    /// Decodes a stored line (without its `\n`) by the reader's rules
    /// (`quarantine::decode_stored`); an unreadable line comes back with why.
    pub fn decode(offset: u64, line: Vec<u8>) -> Result<Delivery, (String, Vec<u8>)> {
        let line_len = line.len();
        if line_len > MAX_RECORD_BYTES {
            return Err((
                format!("record of {line_len} bytes is over the limit"),
                line,
            ));
        }
        // Each field: a span of the line, or text to append after it.
        let mut spans = [ABSENT; FIELDS];
        let mut own: Vec<(usize, String)> = Vec::new();
        let ts_nanos = {
            let e = match decode_stored_ref(&line) {
                Ok(e) => e,
                Err(why) => return Err((why, line)),
            };
            let base = line.as_ptr() as usize;
            let mut put = |field: usize, text: Cow<'_, str>| match text {
                Cow::Borrowed(s)
                    if s.as_ptr() as usize >= base
                        && s.as_ptr() as usize + s.len() <= base + line_len =>
                {
                    let from = s.as_ptr() as usize - base;
                    spans[field] = span(from, from + s.len());
                }
                other => own.push((field, other.into_owned())),
            };
            put(ID, e.id);
            put(TS, e.ts);
            put(CHANNEL, e.channel);
            put(ORIGIN, e.origin);
            put(PAYLOAD_TYPE, e.payload_type);
            if let Some(c) = e.correlation_id {
                put(CORRELATION_ID, c);
            }
            if let Some(s) = e.service_name {
                put(SERVICE_NAME, s);
            }
            put(PAYLOAD, e.payload);
            e.ts_nanos
        };
        let mut buf = line;
        for (field, text) in own {
            let from = buf.len();
            buf.extend_from_slice(text.as_bytes());
            spans[field] = span(from, buf.len());
        }
        Ok(Delivery {
            offset,
            buf,
            line_len: line_len as u32,
            ts_nanos,
            spans,
        })
    }

    /// The text of field `field`, `None` if absent.
    fn field(&self, field: usize) -> Option<&str> {
        let Span { from, to } = self.spans[field];
        if from == u32::MAX {
            return None;
        }
        let bytes = &self.buf[from as usize..to as usize];
        debug_assert!(std::str::from_utf8(bytes).is_ok());
        // SAFETY: a span is made only from a `&str` lying within the line, or
        // from a `String` appended after it (`decode`), and `buf` is private
        // and never changed after decoding: these bytes are that `str`'s.
        Some(unsafe { std::str::from_utf8_unchecked(bytes) })
    }

    /// The raw line's buffer, given back for reuse once delivered.
    pub fn into_line(self) -> Vec<u8> {
        let mut buf = self.buf;
        buf.truncate(self.line_len as usize);
        buf
    }

    /// The raw line (without `\n`).
    pub fn line(&self) -> &[u8] {
        &self.buf[..self.line_len as usize]
    }

    /// Global offset just past the record's `\n`: where delivery resumes
    /// once it is acknowledged.
    pub fn end(&self) -> u64 {
        self.offset + u64::from(self.line_len) + 1
    }

    /// The record's envelope, its fields borrowed from the line.
    pub fn envelope(&self) -> EnvelopeRef<'_> {
        let text = |field| Cow::Borrowed(self.field(field).unwrap_or_default());
        EnvelopeRef {
            id: text(ID),
            ts: text(TS),
            ts_nanos: self.ts_nanos,
            channel: text(CHANNEL),
            origin: text(ORIGIN),
            payload_type: text(PAYLOAD_TYPE),
            correlation_id: self.field(CORRELATION_ID).map(Cow::Borrowed),
            service_name: self.field(SERVICE_NAME).map(Cow::Borrowed),
            payload: text(PAYLOAD),
        }
    }

    /// The record's time (`ts`) as nanoseconds since the Unix epoch.
    pub fn ts_nanos(&self) -> i64 {
        self.ts_nanos
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Envelope;

    /// Every field reads back as the owned decoder gives it, whether the line
    /// holds it as is or escaped, defaulted or rewritten.
    #[test]
    fn fields_read_back_as_the_owned_decoder_gives_them() {
        let lines: [&[u8]; 4] = [
            br#"{"v":1,"id":"a","ts":"2026-01-02T03:04:05Z","channel":"c","origin":"o","payload_type":"t","correlation_id":"k","service_name":"s","payload":{"x":1}}"#,
            br#"{"v":1,"id":"a\u0062","ts":"2026-01-02T03:04:05.5+01:00","channel":"c\"q","origin":"\u00e9","payload_type":"t","payload":[1,
2]}"#,
            br#"{"v":1,"ts":"2026-01-02T03:04:05Z","payload":null,"extra":"\n"}"#,
            br#"{"v":1,"ts":"2026-01-02T03:04:05Z","correlation_id":"","service_name":"","id":"z"}"#,
        ];
        for line in lines {
            let owned = Envelope::decode(line).expect("owned decode");
            let d = Delivery::decode(7, line.to_vec()).expect("delivery decode");
            let e = d.envelope();
            assert_eq!(e.id, owned.id);
            assert_eq!(e.ts, owned.ts);
            assert_eq!((e.ts_nanos, d.ts_nanos()), (owned.ts_nanos, owned.ts_nanos));
            assert_eq!(e.channel, owned.channel);
            assert_eq!(e.origin, owned.origin);
            assert_eq!(e.payload_type, owned.payload_type);
            assert_eq!(e.correlation_id.as_deref(), owned.correlation_id.as_deref());
            assert_eq!(e.service_name.as_deref(), owned.service_name.as_deref());
            assert_eq!(e.payload, owned.payload.get());
            assert_eq!((d.line(), d.end()), (line, 7 + line.len() as u64 + 1));
            // The buffer given back holds the line alone, whatever text was
            // appended after it.
            assert_eq!(d.clone().into_line(), line);
        }
    }

    /// Small enough to move cheaply between threads (it was 232 bytes with
    /// a 24-byte range or string per field).
    #[test]
    fn a_delivery_stays_small() {
        assert!(
            std::mem::size_of::<Delivery>() <= 112,
            "{}",
            std::mem::size_of::<Delivery>()
        );
    }

    #[test]
    fn an_unreadable_line_says_why() {
        let (err, line) = Delivery::decode(0, b"{\"v\":2}".to_vec()).expect_err("version 2");
        assert!(err.contains("unreadable record"), "{err}");
        assert_eq!(line, b"{\"v\":2}", "the line comes back");
    }
}
