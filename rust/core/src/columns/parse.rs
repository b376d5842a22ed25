//! Payloads parsed into typed columns, for readers that want a payload's
//! top-level fields as Arrow arrays (the Spark data source's
//! `payload_schema`). Only plain values are taken: a string for a text or a
//! timestamp field, `true`/`false` for a boolean, an integer literal in range
//! for an integer, a finite number for a float, `null` or a missing key for
//! null. Anything else (a payload that is not an object, a value of another
//! JSON type, an escaped timestamp) refuses the whole batch with `None`,
//! and the caller falls back to its general conversion: this is a fast path,
//! never a second set of rules.

use std::borrow::Cow;

/// The type of a payload field to parse, with its Arrow layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// UTF-8 text: `i32` offsets and data.
    Text,
    /// Bit-packed booleans.
    Bool,
    /// Little-endian signed integers of 1, 2, 4 or 8 bytes.
    Int(usize),
    /// Little-endian IEEE floats of 4 or 8 bytes.
    Float(usize),
    /// RFC 3339 / ISO 8601 text (no zone: UTC) as `i64` microseconds since
    /// the Unix epoch, UTC.
    TimestampMicros,
}

/// One parsed field: `data` holds the values in Arrow's layout for its
/// kind (zeros under nulls), `offsets` the text offsets (text only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldColumn {
    pub kind: FieldKind,
    pub data: Vec<u8>,
    pub offsets: Vec<i32>,
    /// Validity bitmap (bit set: not null).
    pub validity: Vec<u8>,
    pub nulls: usize,
}

impl FieldColumn {
    fn new(kind: FieldKind, rows: usize) -> FieldColumn {
        let data = match kind {
            FieldKind::Text => Vec::with_capacity(rows * 8),
            FieldKind::Bool => vec![0; rows.div_ceil(8)],
            FieldKind::Int(w) | FieldKind::Float(w) => Vec::with_capacity(rows * w),
            FieldKind::TimestampMicros => Vec::with_capacity(rows * 8),
        };
        let mut offsets = Vec::new();
        if kind == FieldKind::Text {
            offsets.reserve(rows + 1);
            offsets.push(0);
        }
        FieldColumn {
            kind,
            data,
            offsets,
            validity: vec![0; rows.div_ceil(8)],
            nulls: 0,
        }
    }

    /// Appends row `row`'s value, parsed from its JSON text `raw` (None: the
    /// key is missing); `None` when the value is not a plain one of the kind.
    fn push(&mut self, row: usize, raw: Option<&str>) -> Option<()> {
        let text = match raw {
            None | Some("null") => {
                self.push_null();
                return Some(());
            }
            Some(text) => text,
        };
        match self.kind {
            FieldKind::Text => {
                let s = json_string(text)?;
                self.data.extend_from_slice(s.as_bytes());
                self.offsets.push(i32::try_from(self.data.len()).ok()?);
            }
            FieldKind::Bool => match text {
                "true" => self.data[row / 8] |= 1 << (row % 8),
                "false" => {}
                _ => return None,
            },
            FieldKind::Int(width) => {
                json_number(text.as_bytes())?.then_some(())?;
                let v: i64 = text.parse().ok()?;
                let bytes = v.to_le_bytes();
                let bits = 8 * width as u32;
                if bits < 64 && (v < -(1i64 << (bits - 1)) || v >= 1i64 << (bits - 1)) {
                    return None;
                }
                self.data.extend_from_slice(&bytes[..width]);
            }
            FieldKind::Float(width) => {
                json_number(text.as_bytes())?;
                let v: f64 = text.parse().ok()?;
                if width == 4 {
                    let f = v as f32;
                    f.is_finite().then_some(())?;
                    self.data.extend_from_slice(&f.to_le_bytes());
                } else {
                    v.is_finite().then_some(())?;
                    self.data.extend_from_slice(&v.to_le_bytes());
                }
            }
            FieldKind::TimestampMicros => {
                let inner = text.strip_prefix('"')?.strip_suffix('"')?;
                let micros = parse_timestamp(inner.as_bytes())?;
                self.data.extend_from_slice(&micros.to_le_bytes());
            }
        }
        self.validity[row / 8] |= 1 << (row % 8);
        Some(())
    }

    fn push_null(&mut self) {
        self.nulls += 1;
        match self.kind {
            FieldKind::Text => self.offsets.push(self.data.len() as i32),
            FieldKind::Bool => {}
            FieldKind::Int(w) | FieldKind::Float(w) => {
                self.data.resize(self.data.len() + w, 0);
            }
            FieldKind::TimestampMicros => self.data.resize(self.data.len() + 8, 0),
        }
    }
}

/// The text of the JSON string literal `raw` (None: not a string, or not
/// one a Python `str` and Arrow agree on, such as a lone surrogate).
fn json_string(raw: &str) -> Option<Cow<'_, str>> {
    let inner = raw.strip_prefix('"')?.strip_suffix('"')?;
    if inner.bytes().all(|b| b >= 0x20 && b != b'\\' && b != b'"') {
        return Some(Cow::Borrowed(inner));
    }
    serde_json::from_str::<String>(raw).ok().map(Cow::Owned)
}

/// Whether `text` is a JSON number (`-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`),
/// and then whether it is an integer literal (no fraction, no exponent).
fn json_number(text: &[u8]) -> Option<bool> {
    let digits = |s: &[u8]| s.iter().take_while(|b| b.is_ascii_digit()).count();
    let mut rest = text.strip_prefix(b"-").unwrap_or(text);
    let n = digits(rest);
    if n == 0 || (n > 1 && rest[0] == b'0') {
        return None;
    }
    rest = &rest[n..];
    let integer = rest.is_empty();
    if let [b'.', tail @ ..] = rest {
        let n = digits(tail);
        (n > 0).then_some(())?;
        rest = &tail[n..];
    }
    if let [b'e' | b'E', tail @ ..] = rest {
        let tail = tail
            .strip_prefix(b"+")
            .or(tail.strip_prefix(b"-"))
            .unwrap_or(tail);
        let n = digits(tail);
        (n > 0).then_some(())?;
        rest = &tail[n..];
    }
    rest.is_empty().then_some(integer)
}

/// Parses `rows` payloads, the JSON values of `data` (each followed by
/// whitespace, as `RecordColumns::payload` holds them), into one column per
/// field of `fields` (top-level keys; a repeated key's last value counts,
/// as in Python's `json.loads`). `None`: some value is not a plain one of
/// its field's kind (see the module's documentation), or `data` does not
/// hold exactly `rows` JSON objects.
///
/// `data` is taken to be JSON, as the reader gives it (each payload was
/// checked when its record was read): the values of other keys are skipped
/// by their structure, without checking them again. Data that is not JSON
/// never panics, and gives `None` or columns of what it seems to say.
pub fn parse_payload_fields(
    data: &[u8],
    rows: usize,
    fields: &[(&str, FieldKind)],
) -> Option<Vec<FieldColumn>> {
    // Every object takes at least two bytes: more rows than that cannot be
    // there (and would only size the buffers below).
    if fields.is_empty() || rows > data.len() / 2 {
        return None;
    }
    let text = std::str::from_utf8(data).ok()?;
    let mut columns: Vec<FieldColumn> = fields
        .iter()
        .map(|&(_, kind)| FieldColumn::new(kind, rows))
        .collect();
    let mut slots: Vec<Option<(usize, usize)>> = vec![None; fields.len()];
    let mut scan = Scan { s: data, pos: 0 };
    let mut next = 0;
    for row in 0..rows {
        slots.iter_mut().for_each(|s| *s = None);
        scan.object(fields, &mut slots, &mut next)?;
        for (col, slot) in columns.iter_mut().zip(&slots) {
            let raw = match *slot {
                Some((from, to)) => Some(text.get(from..to)?),
                None => None,
            };
            col.push(row, raw)?;
        }
    }
    scan.ws();
    (scan.pos == data.len()).then_some(columns)
}

/// A cursor over JSON text (see [`parse_payload_fields`]).
struct Scan<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Scan<'_> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.pos) {
            self.pos += 1;
        }
    }

    fn next_byte(&mut self) -> Option<u8> {
        let b = *self.s.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    /// At a string's opening quote: moves past its closing quote; whether
    /// it has escapes.
    fn string(&mut self) -> Option<bool> {
        let mut i = self.pos + 1;
        let mut escaped = false;
        // Most strings are short: a plain loop, then memchr past 16 bytes.
        let short = self.s.len().min(i + 16);
        while i < short {
            match self.s[i] {
                b'"' => {
                    self.pos = i + 1;
                    return Some(escaped);
                }
                b'\\' => {
                    escaped = true;
                    i += 2;
                }
                _ => i += 1,
            }
        }
        loop {
            let j = i + memchr::memchr2(b'"', b'\\', self.s.get(i..)?)?;
            if self.s[j] == b'"' {
                self.pos = j + 1;
                return Some(escaped);
            }
            escaped = true;
            i = j + 2;
        }
    }

    /// Moves past the value here; its byte range.
    fn value(&mut self) -> Option<(usize, usize)> {
        let from = self.pos;
        match *self.s.get(from)? {
            b'"' => {
                self.string()?;
            }
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match *self.s.get(self.pos)? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => depth -= 1,
                        _ => {}
                    }
                    self.pos += 1;
                    if depth == 0 {
                        break;
                    }
                }
            }
            _ => {
                let len = self.s[from..]
                    .iter()
                    .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                    .unwrap_or(self.s.len() - from);
                (len > 0).then_some(())?;
                self.pos += len;
            }
        }
        Some((from, self.pos))
    }

    /// Reads one object, putting the range of each value of `fields` in
    /// its slot (the last one for a repeated key).
    /// `next` is the field expected next (payloads mostly keep one key
    /// order): it is compared first.
    fn object(
        &mut self,
        fields: &[(&str, FieldKind)],
        slots: &mut [Option<(usize, usize)>],
        next: &mut usize,
    ) -> Option<()> {
        self.ws();
        (self.next_byte()? == b'{').then_some(())?;
        self.ws();
        if self.s.get(self.pos) == Some(&b'}') {
            self.pos += 1;
            return Some(());
        }
        loop {
            self.ws();
            let key_from = self.pos;
            (self.s.get(key_from) == Some(&b'"')).then_some(())?;
            let escaped = self.string()?;
            let key = &self.s[key_from..self.pos];
            let unescaped;
            let name: &[u8] = if escaped {
                unescaped = serde_json::from_slice::<String>(key).ok()?;
                unescaped.as_bytes()
            } else {
                &key[1..key.len() - 1]
            };
            self.ws();
            (self.next_byte()? == b':').then_some(())?;
            self.ws();
            let range = self.value()?;
            let found = if fields.get(*next).is_some_and(|(n, _)| n.as_bytes() == name) {
                Some(*next)
            } else {
                fields.iter().position(|(n, _)| n.as_bytes() == name)
            };
            if let Some(i) = found {
                slots[i] = Some(range);
                *next = i + 1;
            }
            self.ws();
            match self.next_byte()? {
                b',' => continue,
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }
}

/// Microseconds since the epoch of RFC 3339 / ISO 8601 text, read as the
/// Spark source's Python conversion (`mapping._parse_timestamp`) reads it:
/// `YYYY-MM-DD`, then optionally `T`/`t`/space and `HH:MM[:SS[.fraction]]`
/// (fraction cut to microseconds), then optionally `Z`/`z` or an offset
/// `+HH`, `+HHMM`, `+HH:MM`; no zone is UTC. None for anything else (other
/// spacing, an invalid date or time, a year outside 1-9999 before or after
/// the offset, an offset of a day or more): the caller's conversion decides.
pub fn parse_timestamp(s: &[u8]) -> Option<i64> {
    fn num(s: &[u8]) -> Option<i64> {
        s.iter().try_fold(0i64, |n, &b| {
            b.is_ascii_digit().then(|| n * 10 + i64::from(b - b'0'))
        })
    }
    let (year, month, day) = (num(s.get(0..4)?)?, num(s.get(5..7)?)?, num(s.get(8..10)?)?);
    if s[4] != b'-' || s[7] != b'-' {
        return None;
    }
    let mut rest = &s[10..];
    let (mut hh, mut mm, mut ss, mut micros) = (0, 0, 0, 0);
    if let [b'T' | b't' | b' ', ..] = rest {
        let t = &rest[1..];
        if t.get(2) != Some(&b':') {
            return None;
        }
        hh = num(t.get(0..2)?)?;
        mm = num(t.get(3..5)?)?;
        rest = &t[5..];
        if let [b':', ..] = rest {
            ss = num(rest.get(1..3)?)?;
            rest = &rest[3..];
            if let [b'.', ..] = rest {
                let digits = rest[1..].iter().take_while(|b| b.is_ascii_digit()).count();
                if digits == 0 {
                    return None;
                }
                let frac = &rest[1..1 + digits];
                let kept = &frac[..digits.min(6)];
                micros = num(kept)? * 10i64.pow(6 - kept.len() as u32);
                rest = &rest[1 + digits..];
            }
        }
    }
    let offset_s = match rest {
        [] | [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), zone @ ..] => {
            let (h, m) = match zone {
                [_, _] => (num(zone)?, 0),
                [_, _, _, _] => (num(&zone[..2])?, num(&zone[2..])?),
                [_, _, b':', _, _] => (num(&zone[..2])?, num(&zone[3..])?),
                _ => return None,
            };
            let total = h * 3600 + m * 60;
            if total >= 86_400 {
                return None;
            }
            if *sign == b'+' {
                total
            } else {
                -total
            }
        }
        _ => return None,
    };
    if !(1..=9999).contains(&year) || !(1..=12).contains(&month) || hh > 23 || mm > 59 || ss > 59 {
        return None;
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if day < 1 || day > month_days[month as usize - 1] {
        return None;
    }
    let secs = days_from_civil(year, month, day) * 86_400 + hh * 3600 + mm * 60 + ss - offset_s;
    // Python's datetime refuses an offset taking the time out of years 1-9999.
    const MIN: i64 = -62_135_596_800; // 0001-01-01T00:00:00Z
    const MAX: i64 = 253_402_300_799; // 9999-12-31T23:59:59Z
    if !(MIN..=MAX).contains(&secs) {
        return None;
    }
    Some(secs * 1_000_000 + micros)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`, the inverse of `columns::civil_from_days`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests;
