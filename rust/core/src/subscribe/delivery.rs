//! [`Delivery`]: one stored record handed to a handler. Its envelope is kept
//! as byte ranges of the record's line, so reading a batch allocates one
//! buffer per record (the line) instead of one per field.

use std::borrow::Cow;

use crate::envelope::EnvelopeRef;
use crate::storage::quarantine::decode_stored_ref;

/// One record handed to a handler.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Global offset of the record.
    pub offset: u64,
    /// The raw line (without `\n`); never changed once decoded, so the
    /// ranges in `fields` stay valid.
    line: Vec<u8>,
    fields: Fields,
}

/// A field of the envelope: a range of the line, or its own text when the
/// line does not hold it as is (an escaped string, a default, a payload
/// whose line breaks became spaces).
#[derive(Debug, Clone)]
enum Text {
    Span(usize, usize),
    Own(Box<str>),
}

#[derive(Debug, Clone)]
struct Fields {
    id: Text,
    ts: Text,
    ts_nanos: i64,
    channel: Text,
    origin: Text,
    payload_type: Text,
    correlation_id: Option<Text>,
    service_name: Option<Text>,
    payload: Text,
}

impl Text {
    fn of(line: &[u8], text: Cow<'_, str>) -> Text {
        if let Cow::Borrowed(s) = &text {
            let (base, at) = (line.as_ptr() as usize, s.as_ptr() as usize);
            if at >= base && at + s.len() <= base + line.len() {
                return Text::Span(at - base, at - base + s.len());
            }
        }
        Text::Own(text.into_owned().into_boxed_str())
    }

    /// The field's text; `line` must be the line it was made from.
    fn get<'a>(&'a self, line: &'a [u8]) -> &'a str {
        match self {
            Text::Span(from, to) => {
                let bytes = &line[*from..*to];
                debug_assert!(std::str::from_utf8(bytes).is_ok());
                // SAFETY: a span is made only from a `&str` lying within the
                // line (`Text::of`), and a delivery's line is private and
                // never changed after decoding: these bytes are that `&str`'s.
                unsafe { std::str::from_utf8_unchecked(bytes) }
            }
            Text::Own(s) => s,
        }
    }
}

impl Delivery {
    /// Decodes a stored line (without its `\n`) by the reader's rules
    /// (`quarantine::decode_stored`); an unreadable line comes back with why.
    pub fn decode(offset: u64, line: Vec<u8>) -> Result<Delivery, (String, Vec<u8>)> {
        let fields = {
            let e = match decode_stored_ref(&line) {
                Ok(e) => e,
                Err(why) => return Err((why, line)),
            };
            let text = |t: Cow<'_, str>| Text::of(&line, t);
            Fields {
                id: text(e.id),
                ts: text(e.ts),
                ts_nanos: e.ts_nanos,
                channel: text(e.channel),
                origin: text(e.origin),
                payload_type: text(e.payload_type),
                correlation_id: e.correlation_id.map(text),
                service_name: e.service_name.map(text),
                payload: text(e.payload),
            }
        };
        Ok(Delivery {
            offset,
            line,
            fields,
        })
    }

    /// The raw line (without `\n`).
    pub fn line(&self) -> &[u8] {
        &self.line
    }

    /// Global offset just past the record's `\n`: where delivery resumes
    /// once it is acknowledged.
    pub fn end(&self) -> u64 {
        self.offset + self.line.len() as u64 + 1
    }

    /// The record's envelope, its fields borrowed from the line.
    pub fn envelope<'a>(&'a self) -> EnvelopeRef<'a> {
        let (f, line) = (&self.fields, self.line.as_slice());
        let text = |t: &'a Text| -> Cow<'a, str> { Cow::Borrowed(t.get(line)) };
        EnvelopeRef {
            id: text(&f.id),
            ts: text(&f.ts),
            ts_nanos: f.ts_nanos,
            channel: text(&f.channel),
            origin: text(&f.origin),
            payload_type: text(&f.payload_type),
            correlation_id: f.correlation_id.as_ref().map(text),
            service_name: f.service_name.as_ref().map(text),
            payload: text(&f.payload),
        }
    }

    /// The record's time (`ts`) as nanoseconds since the Unix epoch.
    pub fn ts_nanos(&self) -> i64 {
        self.fields.ts_nanos
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
        }
    }

    #[test]
    fn an_unreadable_line_says_why() {
        let (err, line) = Delivery::decode(0, b"{\"v\":2}".to_vec()).expect_err("version 2");
        assert!(err.contains("unreadable record"), "{err}");
        assert_eq!(line, b"{\"v\":2}", "the line comes back");
    }
}
