//! Start positions: turning "earliest", "latest", a byte offset or a time
//! into the global offset of a record boundary of a channel.
//!
//! A time seek does not scan the channel. It picks the segment through the
//! last (and first) record timestamps of the segments, by bisection over the
//! segment list, then bisects byte positions inside that segment: read a
//! small window at the midpoint, find the next newline, parse the `ts` of the
//! record starting there. Each step reads O(1) windows, so a seek reads
//! O(log segments + log segment bytes) windows. Timestamps are assumed to grow
//! along the stream (true for records published here; records received over
//! federation from clocks that disagree may break it, and the answer is then
//! some record boundary near the time, never a position inside a record).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::segment;
use crate::envelope::Envelope;

/// Bytes read per probe.
pub const WINDOW: usize = 4096;

/// Where a subscription or read starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartPosition {
    /// The oldest record kept.
    Earliest,
    /// The current end of the stream (only records published later).
    Latest,
    /// A global byte offset; must be a record boundary.
    Offset(u64),
    /// The first record whose `ts` is at or after this time (Unix nanoseconds).
    Time(i64),
}

/// Why a position could not be resolved.
#[derive(Debug)]
pub enum PositionError {
    /// The position is not usable (message says why and what to do).
    Invalid(String),
    /// An offset before the oldest record kept: its data was deleted (the
    /// message says so); a reader starting there meets a gap.
    Gone(String),
    Io(io::Error),
}

impl From<io::Error> for PositionError {
    fn from(e: io::Error) -> Self {
        PositionError::Io(e)
    }
}

/// Counts the windows a seek read (tests and benchmarks check it stays logarithmic).
#[derive(Debug, Default, Clone, Copy)]
pub struct SeekCost {
    pub reads: usize,
}

/// Resolves `pos` in the channel directory `dir`, reading no byte at or
/// past `limit` (a writer's committed end, or `u64::MAX`).
pub fn resolve(
    dir: &Path,
    pos: StartPosition,
    limit: u64,
    cost: &mut SeekCost,
) -> Result<u64, PositionError> {
    let segs = Segments::list(dir, limit, cost)?;
    let first = segs.items.first().map_or(0, |s| s.start);
    let end = segs.end();
    match pos {
        StartPosition::Earliest => Ok(first),
        StartPosition::Latest => Ok(end),
        StartPosition::Time(t) => Ok(segs.find_time(t, cost)?),
        StartPosition::Offset(o) => {
            if o == end || (o == first && !segs.items.is_empty()) {
                return Ok(o);
            }
            if o > end {
                return Err(PositionError::Invalid(format!(
                    "offset {o} is past the end of the channel ({end}); use an offset \
                     between {first} and {end}, or \"latest\""
                )));
            }
            if o < first {
                return Err(PositionError::Gone(format!(
                    "offset {o} is before the oldest record kept (offset {first}; older \
                     data was deleted by retention); use \"earliest\" or an offset from {first}"
                )));
            }
            let seg = segs
                .items
                .iter()
                .rev()
                .find(|s| s.start <= o)
                .expect("o >= first");
            if o == seg.start || o >= seg.start + seg.len {
                // A segment start, its end, or a hole between segments (the
                // reader goes on at the next segment).
                return Ok(o);
            }
            let mut prev = [0u8; 1];
            cost.reads += 1;
            seg.file.read_exact_at(&mut prev, o - seg.start - 1)?;
            if prev[0] == b'\n' {
                return Ok(o);
            }
            Err(PositionError::Invalid(format!(
                "offset {o} is not the start of a record; use the offset of a message \
                 (Message.offset / LogEntry.offset), a stream_end(), \"earliest\", \
                 \"latest\" or a datetime"
            )))
        }
    }
}

struct Seg {
    start: u64,
    /// Bytes of whole records (within the limit).
    len: u64,
    file: File,
}

struct Segments {
    items: Vec<Seg>,
}

impl Segments {
    fn list(dir: &Path, limit: u64, cost: &mut SeekCost) -> io::Result<Segments> {
        let starts = segment::list_segments(dir)?;
        let mut items = Vec::with_capacity(starts.len());
        let n = starts.len();
        for (i, start) in starts.into_iter().enumerate() {
            if start >= limit && i > 0 {
                break;
            }
            let file = match File::open(segment::segment_path(dir, start)) {
                Ok(f) => f,
                // Deleted by retention meanwhile: older data is simply gone.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let mut len = file.metadata()?.len().min(limit.saturating_sub(start));
            if i + 1 == n {
                // The active segment may end in a record being written.
                len = complete_len(&file, len, cost)?;
            }
            items.push(Seg { start, len, file });
        }
        Ok(Segments { items })
    }

    fn end(&self) -> u64 {
        self.items.last().map_or(0, |s| s.start + s.len)
    }

    /// Global offset of the first record with `ts >= t`, or the end.
    fn find_time(&self, t: i64, cost: &mut SeekCost) -> io::Result<u64> {
        // First segment whose last record is at or after t.
        let (mut lo, mut hi) = (0usize, self.items.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let s = &self.items[mid];
            // A segment whose last record cannot be parsed is searched.
            let last = last_ts(&s.file, s.len, cost)?;
            if last.is_none_or(|(_, ts)| ts >= t) && s.len > 0 {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let Some(s) = self.items.get(lo) else {
            return Ok(self.end());
        };
        Ok(s.start + seek_in_segment(&s.file, s.len, t, cost)?)
    }
}

/// Publish time (`ts`, Unix nanoseconds) of the last record of the channel
/// in `dir` that ends at or before `limit` (a writer's committed end, or
/// `u64::MAX`); `None` when the channel holds no record or the last one cannot
/// be parsed. Reads one window of the newest non-empty segment (looking back
/// at most a few segments, as a roll leaves the newest one empty).
pub fn last_record_ts(dir: &Path, limit: u64) -> io::Result<Option<i64>> {
    let mut cost = SeekCost::default();
    let starts = segment::list_segments(dir)?;
    for &start in starts.iter().rev().filter(|&&s| s < limit).take(3) {
        let file = match File::open(segment::segment_path(dir, start)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len().min(limit - start);
        let len = complete_len(&file, len, &mut cost)?;
        if len > 0 {
            return Ok(last_ts(&file, len, &mut cost)?.map(|(_, ts)| ts));
        }
    }
    Ok(None)
}

/// Position in a segment of `len` bytes of whole records of the first record
/// with `ts >= t`, or `len`.
fn seek_in_segment(file: &File, len: u64, t: i64, cost: &mut SeekCost) -> io::Result<u64> {
    match scan(file, 0, len, cost, |_| true)? {
        None => return Ok(len),
        Some((pos, ts)) if ts >= t => return Ok(pos),
        Some(_) => {}
    }
    // f(p): the first record at or after byte p has ts >= t (or there is
    // none); false at 0, true at len, monotone. Find the smallest p.
    let (mut lo, mut hi) = (0u64, len);
    let mut best = len;
    while hi - lo > WINDOW as u64 {
        let mid = lo + (hi - lo) / 2;
        let found = match next_boundary(file, mid, len, cost)? {
            Some(b) => scan(file, b, len, cost, |_| true)?,
            None => None,
        };
        match found {
            Some((_, ts)) if ts < t => lo = mid,
            Some((pos, _)) => {
                hi = mid;
                best = pos;
            }
            None => hi = mid,
        }
    }
    let from = if lo == 0 {
        Some(0)
    } else {
        next_boundary(file, lo, best, cost)?
    };
    let Some(from) = from else {
        return Ok(best);
    };
    Ok(scan(file, from, best, cost, |ts| ts >= t)?.map_or(best, |(pos, _)| pos))
}

/// The first record boundary at or after `p` (> 0) and before `end`.
fn next_boundary(file: &File, p: u64, end: u64, cost: &mut SeekCost) -> io::Result<Option<u64>> {
    let mut at = p - 1;
    let mut buf = vec![0u8; WINDOW];
    while at < end {
        let n = (WINDOW as u64).min(end - at) as usize;
        cost.reads += 1;
        file.read_exact_at(&mut buf[..n], at)?;
        if let Some(i) = memchr::memchr(b'\n', &buf[..n]) {
            let b = at + i as u64 + 1;
            return Ok((b < end).then_some(b));
        }
        at += n as u64;
    }
    Ok(None)
}

/// The first parsable record starting at boundary `b` or later, and before
/// `end` (a boundary), whose `ts` satisfies `want`: its position and `ts`.
fn scan(
    file: &File,
    mut b: u64,
    end: u64,
    cost: &mut SeekCost,
    want: impl Fn(i64) -> bool,
) -> io::Result<Option<(u64, i64)>> {
    let mut buf = Vec::new();
    while b < end {
        let mut size = WINDOW;
        loop {
            let n = (size as u64).min(end - b) as usize;
            buf.resize(n, 0);
            cost.reads += 1;
            file.read_exact_at(&mut buf, b)?;
            if memchr::memchr(b'\n', &buf).is_some() || n as u64 == end - b {
                break;
            }
            size *= 2;
        }
        let mut i = 0;
        while let Some(j) = memchr::memchr(b'\n', &buf[i..]) {
            if let Ok(e) = Envelope::decode(&buf[i..i + j]) {
                if want(e.ts_nanos) {
                    return Ok(Some((b + i as u64, e.ts_nanos)));
                }
            }
            i += j + 1;
        }
        if i == 0 {
            return Ok(None); // an unterminated tail
        }
        b += i as u64;
    }
    Ok(None)
}

/// Length of the prefix of the first `len` bytes that ends with a newline.
fn complete_len(file: &File, len: u64, cost: &mut SeekCost) -> io::Result<u64> {
    let mut end = len;
    let mut buf = vec![0u8; WINDOW];
    while end > 0 {
        let start = end.saturating_sub(WINDOW as u64);
        let chunk = &mut buf[..(end - start) as usize];
        cost.reads += 1;
        file.read_exact_at(chunk, start)?;
        if let Some(i) = memchr::memrchr(b'\n', chunk) {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// The last record of a segment of `len` bytes of whole records: its
/// position and `ts`; `None` when it cannot be parsed (or there is none).
fn last_ts(file: &File, len: u64, cost: &mut SeekCost) -> io::Result<Option<(u64, i64)>> {
    if len == 0 {
        return Ok(None);
    }
    let mut size = WINDOW as u64;
    loop {
        let start = len.saturating_sub(size);
        let mut buf = vec![0u8; (len - start) as usize];
        cost.reads += 1;
        file.read_exact_at(&mut buf, start)?;
        let body = &buf[..buf.len() - 1]; // without the final newline
        let line_start = match memchr::memrchr(b'\n', body) {
            Some(i) => i + 1,
            None if start == 0 => 0,
            None => {
                size *= 2;
                continue;
            }
        };
        return Ok(Envelope::decode(&body[line_start..])
            .ok()
            .map(|e| (start + line_start as u64, e.ts_nanos)));
    }
}
