//! Records as columns, for readers and writers that work in Arrow batches
//! (the Spark data source): [`ColumnReader`] reads the records of a byte
//! range of a channel into column buffers laid out as Arrow's (offsets, data,
//! validity bitmaps), [`parse_payload_fields`] parses payloads' top-level
//! fields into such buffers, and [`encode_payloads`] turns columns given in
//! that layout into one JSON object per row. No Arrow library is involved: the
//! buffers are plain bytes the caller wraps (pyarrow's `Array.from_buffers`).

use std::io;
use std::path::{Path, PathBuf};

use crate::storage::quarantine::{decode_stored_ref, quarantine, split_point};
use crate::storage::{Item, LogReader};
use crate::Error;

mod parse;
pub use parse::{parse_payload_fields, parse_timestamp, FieldColumn, FieldKind};

/// A column of optional UTF-8 values in Arrow's layout: `offsets` (`i32`,
/// one more than rows), `data`, and a validity bitmap (bit set: not null).
#[derive(Debug, Default, Clone)]
pub struct TextColumn {
    pub offsets: Vec<i32>,
    pub data: Vec<u8>,
    pub validity: Vec<u8>,
    pub nulls: usize,
}

impl TextColumn {
    fn new() -> TextColumn {
        TextColumn {
            offsets: vec![0],
            ..TextColumn::default()
        }
    }

    /// Appends `value` and a line feed (inside the value's range).
    fn push_line(&mut self, value: &[u8]) {
        let row = self.offsets.len() - 1;
        if row & 7 == 0 {
            self.validity.push(0);
        }
        self.data.extend_from_slice(value);
        self.data.push(b'\n');
        self.validity[row / 8] |= 1 << (row % 8);
        self.offsets.push(self.data.len() as i32);
    }

    fn push(&mut self, value: Option<&[u8]>) {
        let row = self.offsets.len() - 1;
        if row & 7 == 0 {
            self.validity.push(0);
        }
        match value {
            Some(v) => {
                self.data.extend_from_slice(v);
                self.validity[row / 8] |= 1 << (row % 8);
            }
            None => self.nulls += 1,
        }
        self.offsets.push(self.data.len() as i32);
    }
}

/// Records read into columns (the envelope's fields, in Arrow's layout).
/// `payload` holds each payload's JSON text followed by a line feed, so its
/// `data` is JSON lines a JSON reader can parse in one go; the line feed is
/// inside each value's range.
#[derive(Debug, Clone)]
pub struct RecordColumns {
    pub rows: usize,
    /// Global offset of each record.
    pub offset: Vec<i64>,
    /// Start offset of the segment file of each record.
    pub segment: Vec<i64>,
    /// `ts` in microseconds since the Unix epoch.
    pub ts_micros: Vec<i64>,
    pub id: TextColumn,
    pub channel: TextColumn,
    pub origin: TextColumn,
    pub payload_type: TextColumn,
    pub service_name: TextColumn,
    pub correlation_id: TextColumn,
    pub payload: TextColumn,
}

impl RecordColumns {
    fn new() -> RecordColumns {
        RecordColumns {
            rows: 0,
            offset: Vec::new(),
            segment: Vec::new(),
            ts_micros: Vec::new(),
            id: TextColumn::new(),
            channel: TextColumn::new(),
            origin: TextColumn::new(),
            payload_type: TextColumn::new(),
            service_name: TextColumn::new(),
            correlation_id: TextColumn::new(),
            payload: TextColumn::new(),
        }
    }
}

/// What [`ColumnReader::next_batch`] found.
#[derive(Debug)]
pub enum ColumnBatch {
    Records(Box<RecordColumns>),
    /// Bytes `from..to` are gone (returned after the records before them).
    Gap {
        from: u64,
        to: u64,
    },
}

/// Reads the records of a channel between two offsets in batches of columns.
/// Unreadable records (not valid envelopes) are quarantined and passed over,
/// as every reader does (`storage::quarantine`).
pub struct ColumnReader {
    reader: LogReader,
    data_dir: PathBuf,
    channel: String,
    /// Records ending past this offset are not read.
    until: u64,
    pending_gap: Option<(u64, u64)>,
}

impl ColumnReader {
    /// A reader of `channel` in `data_dir` from the record boundary `from`
    /// up to records ending at or before `until`.
    pub fn open(
        data_dir: &Path,
        channel: &str,
        from: u64,
        until: u64,
    ) -> Result<ColumnReader, Error> {
        Ok(ColumnReader {
            reader: crate::read_channel(data_dir, channel, from)?,
            data_dir: data_dir.to_owned(),
            channel: channel.to_owned(),
            until,
            pending_gap: None,
        })
    }

    /// Global offset of the next record.
    pub fn position(&self) -> u64 {
        self.reader.position()
    }

    /// Up to `max_rows` records; a gap ends the batch and is returned by the
    /// next call. `None`: nothing more.
    pub fn next_batch(&mut self, max_rows: usize) -> io::Result<Option<ColumnBatch>> {
        if let Some((from, to)) = self.pending_gap.take() {
            return Ok(Some(ColumnBatch::Gap { from, to }));
        }
        let mut cols = RecordColumns::new();
        while cols.rows < max_rows {
            let Some(item) = self.reader.next_item(self.until)? else {
                break;
            };
            let (offset, segment, line) = match item {
                Item::Record {
                    offset,
                    segment,
                    line,
                } => (offset, segment, line),
                // A gap before offset 0's first segment is history retention trimmed.
                Item::Gap { from, to } if from > 0 => {
                    if cols.rows == 0 {
                        return Ok(Some(ColumnBatch::Gap { from, to }));
                    }
                    self.pending_gap = Some((from, to));
                    break;
                }
                _ => continue,
            };
            let e = match decode_stored_ref(&line) {
                Ok(e) => e,
                Err(reason) => {
                    let bad = split_point(&line).unwrap_or(line.len());
                    quarantine(&self.data_dir, &self.channel, offset, &line[..bad], &reason);
                    if bad < line.len() {
                        self.reader.seek(offset + bad as u64);
                    }
                    continue;
                }
            };
            cols.rows += 1;
            cols.offset.push(offset as i64);
            cols.segment.push(segment as i64);
            cols.ts_micros.push(e.ts_nanos.div_euclid(1000));
            cols.id.push(Some(e.id.as_bytes()));
            cols.channel.push(Some(e.channel.as_bytes()));
            cols.origin.push(Some(e.origin.as_bytes()));
            cols.payload_type.push(Some(e.payload_type.as_bytes()));
            cols.service_name
                .push(e.service_name.as_deref().map(str::as_bytes));
            cols.correlation_id
                .push(e.correlation_id.as_deref().map(str::as_bytes));
            cols.payload.push_line(e.payload.as_bytes());
        }
        if cols.rows == 0 {
            return Ok(self
                .pending_gap
                .take()
                .map(|(from, to)| ColumnBatch::Gap { from, to }));
        }
        Ok(Some(ColumnBatch::Records(Box::new(cols))))
    }
}

/// The type of a column given to [`encode_payloads`], with its buffers in
/// Arrow's layout (values start at row `offset` of the buffers).
#[derive(Debug, Clone, Copy)]
pub enum ColumnValues<'a> {
    /// Bit-packed booleans.
    Bool(&'a [u8]),
    /// Little-endian signed integers of 1, 2, 4 or 8 bytes.
    Int { width: usize, data: &'a [u8] },
    /// Little-endian IEEE floats of 4 or 8 bytes; NaN and infinities become
    /// the strings `"NaN"`, `"Infinity"` and `"-Infinity"`.
    Float { width: usize, data: &'a [u8] },
    /// UTF-8 text: `i32` offsets and data.
    Text { offsets: &'a [u8], data: &'a [u8] },
    /// Microseconds since the Unix epoch (`i64`), written as RFC 3339 UTC
    /// text (`Z`) or, when `utc` is false, as wall-clock text without a zone.
    TimestampMicros { data: &'a [u8], utc: bool },
    /// Days since the Unix epoch (`i32`), written as `YYYY-MM-DD`.
    Date32(&'a [u8]),
}

/// One column given to [`encode_payloads`].
#[derive(Debug, Clone, Copy)]
pub struct Column<'a> {
    pub name: &'a str,
    pub values: ColumnValues<'a>,
    /// Validity bitmap (bit set: not null); `None`: no nulls.
    pub validity: Option<&'a [u8]>,
    /// Index of the column's first row in its buffers (Arrow's array offset).
    pub offset: usize,
}

fn bit(bits: &[u8], i: usize) -> Option<bool> {
    bits.get(i / 8).map(|b| b & (1 << (i % 8)) != 0)
}

fn fixed<const N: usize>(data: &[u8], i: usize) -> Option<[u8; N]> {
    data.get(i * N..i * N + N)?.try_into().ok()
}

/// Why columns could not be encoded (a buffer shorter than its rows say, text
/// that is not UTF-8, a width not supported).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot encode column {column:?}: {reason}")]
pub struct ColumnError {
    pub column: String,
    pub reason: String,
}

/// Encodes `rows` rows of `columns` as JSON objects (`{"name":value,...}`,
/// nulls included as `null`), appended to `out`; returns the end of each
/// row's object in `out`.
pub fn encode_payloads(
    columns: &[Column<'_>],
    rows: usize,
    out: &mut Vec<u8>,
) -> Result<Vec<usize>, ColumnError> {
    let writer = PayloadWriter::new(columns);
    let mut ends = Vec::with_capacity(rows);
    for row in 0..rows {
        writer.write_row(row, out)?;
        ends.push(out.len());
    }
    Ok(ends)
}

/// Writes one row of columns at a time as a JSON object (see
/// [`encode_payloads`]): for callers that frame each payload as it is written.
pub struct PayloadWriter<'c, 'a> {
    columns: &'c [Column<'a>],
    /// `{"name":` for the first column, `,"name":` for the others.
    keys: Vec<String>,
    /// Per column: a text column's data, checked as UTF-8 once (None: not
    /// text, or not valid as a whole, so each value is checked on its own).
    texts: Vec<Option<&'a str>>,
    /// Per column: the last date written (days, `YYYY-MM-DD`): rows of a
    /// batch mostly share their day, and the calendar arithmetic is skipped.
    last_day: Vec<std::cell::Cell<(i64, [u8; 10])>>,
}

impl<'c, 'a> PayloadWriter<'c, 'a> {
    /// A writer of the rows of `columns`.
    pub fn new(columns: &'c [Column<'a>]) -> Self {
        let keys = columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut k = String::new();
                k.push(if i == 0 { '{' } else { ',' });
                k.push_str(&serde_json::to_string(c.name).unwrap_or_default());
                k.push(':');
                k
            })
            .collect();
        let texts = columns
            .iter()
            .map(|c| match c.values {
                ColumnValues::Text { data, .. } => std::str::from_utf8(data).ok(),
                _ => None,
            })
            .collect();
        // i64::MIN: no day yet (no date is that far out).
        let last_day = columns
            .iter()
            .map(|_| std::cell::Cell::new((i64::MIN, [0; 10])))
            .collect();
        PayloadWriter {
            columns,
            keys,
            texts,
            last_day,
        }
    }

    /// Appends `YYYY-MM-DD` of `days` for column `col` (see `last_day`).
    fn write_day(&self, col: usize, days: i64, out: &mut Vec<u8>) -> Option<()> {
        let cell = &self.last_day[col];
        let (cached, text) = cell.get();
        if cached == days {
            out.extend_from_slice(&text);
            return Some(());
        }
        let start = out.len();
        write_date(out, days)?;
        let mut text = [0; 10];
        if let Some(written) = out.get(start..start + 10) {
            text.copy_from_slice(written);
            cell.set((days, text));
        }
        Some(())
    }

    /// Appends row `row` (from each column's offset) to `out` as a JSON object.
    pub fn write_row(&self, row: usize, out: &mut Vec<u8>) -> Result<(), ColumnError> {
        if self.columns.is_empty() {
            out.push(b'{');
        }
        for (col, (c, key)) in self.columns.iter().zip(&self.keys).enumerate() {
            out.extend_from_slice(key.as_bytes());
            let fail = |reason: &str| ColumnError {
                column: c.name.to_owned(),
                reason: reason.to_owned(),
            };
            let i = row + c.offset;
            if let Some(v) = c.validity {
                if !bit(v, i).ok_or_else(|| fail("validity bitmap too short"))? {
                    out.extend_from_slice(b"null");
                    continue;
                }
            }
            let short = || fail("buffer shorter than the rows");
            match c.values {
                ColumnValues::Bool(bits) => {
                    let b = bit(bits, i).ok_or_else(short)?;
                    out.extend_from_slice(if b { b"true" } else { b"false" });
                }
                ColumnValues::Int { width, data } => {
                    let v: i64 = match width {
                        1 => i8::from_le_bytes(fixed::<1>(data, i).ok_or_else(short)?).into(),
                        2 => i16::from_le_bytes(fixed::<2>(data, i).ok_or_else(short)?).into(),
                        4 => i32::from_le_bytes(fixed::<4>(data, i).ok_or_else(short)?).into(),
                        8 => i64::from_le_bytes(fixed::<8>(data, i).ok_or_else(short)?),
                        _ => return Err(fail("integer width not supported")),
                    };
                    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
                }
                ColumnValues::Float { width, data } => {
                    let v: f64 = match width {
                        4 => f32::from_le_bytes(fixed::<4>(data, i).ok_or_else(short)?).into(),
                        8 => f64::from_le_bytes(fixed::<8>(data, i).ok_or_else(short)?),
                        _ => return Err(fail("float width not supported")),
                    };
                    if v.is_nan() {
                        out.extend_from_slice(b"\"NaN\"");
                    } else if v.is_infinite() {
                        out.extend_from_slice(if v > 0.0 {
                            b"\"Infinity\"".as_slice()
                        } else {
                            b"\"-Infinity\"".as_slice()
                        });
                    } else {
                        serde_json::to_writer(&mut *out, &v).map_err(|e| fail(&e.to_string()))?;
                    }
                }
                ColumnValues::Text { offsets, data } => {
                    let lo = i32::from_le_bytes(fixed::<4>(offsets, i).ok_or_else(short)?);
                    let hi = i32::from_le_bytes(fixed::<4>(offsets, i + 1).ok_or_else(short)?);
                    let range = usize::try_from(lo)
                        .ok()
                        .zip(usize::try_from(hi).ok())
                        .map(|(lo, hi)| lo..hi);
                    let s = match (range, self.texts[col]) {
                        // Checked once; a range splitting a character is None.
                        (Some(r), Some(text)) => text
                            .get(r)
                            .ok_or_else(|| fail("text offsets out of range or not UTF-8"))?,
                        (range, _) => {
                            let bytes = range.and_then(|r| data.get(r)).ok_or_else(short)?;
                            std::str::from_utf8(bytes).map_err(|_| fail("text is not UTF-8"))?
                        }
                    };
                    serde_json::to_writer(&mut *out, s).map_err(|e| fail(&e.to_string()))?;
                }
                ColumnValues::TimestampMicros { data, utc } => {
                    let us = i64::from_le_bytes(fixed::<8>(data, i).ok_or_else(short)?);
                    out.push(b'"');
                    let secs = us.div_euclid(1_000_000);
                    self.write_day(col, secs.div_euclid(86_400), out)
                        .ok_or_else(|| fail("timestamp out of range"))?;
                    write_time(out, secs, us.rem_euclid(1_000_000) as u64, utc);
                    out.push(b'"');
                }
                ColumnValues::Date32(data) => {
                    let days = i32::from_le_bytes(fixed::<4>(data, i).ok_or_else(short)?);
                    out.push(b'"');
                    self.write_day(col, days.into(), out)
                        .ok_or_else(|| fail("date out of range"))?;
                    out.push(b'"');
                }
            }
        }
        out.push(b'}');
        Ok(())
    }
}

/// Year, month and day of the day `days` after 1970-01-01 (proleptic
/// Gregorian; Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Appends `n` as `width` decimal digits (zero-padded).
fn digits(out: &mut Vec<u8>, n: u64, width: usize) {
    let start = out.len();
    out.resize(start + width, b'0');
    let mut n = n;
    for i in (start..start + width).rev() {
        out[i] = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// Appends `YYYY-MM-DD`; `None` for years outside 0..=9999.
fn write_date(out: &mut Vec<u8>, days: i64) -> Option<()> {
    let (y, m, d) = civil_from_days(days);
    if !(0..=9999).contains(&y) {
        return None;
    }
    digits(out, y as u64, 4);
    out.push(b'-');
    digits(out, m.into(), 2);
    out.push(b'-');
    digits(out, d.into(), 2);
    Some(())
}

/// Appends `YYYY-MM-DDTHH:MM:SS[.ffffff]` (fraction trimmed of trailing
/// zeros) and `Z` when `utc`; `None` for years outside 0..=9999.
#[cfg(test)]
fn write_timestamp(out: &mut Vec<u8>, micros: i64, utc: bool) -> Option<()> {
    let secs = micros.div_euclid(1_000_000);
    write_date(out, secs.div_euclid(86_400))?;
    write_time(out, secs, micros.rem_euclid(1_000_000) as u64, utc);
    Some(())
}

/// Appends `THH:MM:SS[.ffffff]` of the second `secs` (since the epoch) and
/// fraction `frac` (microseconds; trimmed of trailing zeros), and `Z` when
/// `utc`: the time part of [`write_timestamp`].
fn write_time(out: &mut Vec<u8>, secs: i64, frac: u64, utc: bool) {
    let sod = secs.rem_euclid(86_400) as u64;
    out.push(b'T');
    digits(out, sod / 3600, 2);
    out.push(b':');
    digits(out, sod / 60 % 60, 2);
    out.push(b':');
    digits(out, sod % 60, 2);
    if frac != 0 {
        let (mut f, mut width) = (frac, 6);
        while f % 10 == 0 {
            f /= 10;
            width -= 1;
        }
        out.push(b'.');
        digits(out, f, width);
    }
    if utc {
        out.push(b'Z');
    }
}

#[cfg(test)]
mod tests;
