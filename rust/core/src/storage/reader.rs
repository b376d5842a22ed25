//! Reading a channel's segments from a byte offset, whole lines only.
//!
//! Rules (those of keyop-messenger 1.4, with its defects fixed): only
//! newline-terminated lines are records; an unterminated tail is left for
//! later (it may still be being written, or it is a torn record); a line over
//! the 10 MiB limit is skipped whole instead of wedging the reader; at the
//! end of a sealed segment the reader continues at the next segment's start;
//! an offset below the first remaining segment jumps forward to it. Both
//! jumps over missing bytes are returned as [`Item::Gap`], for the caller to
//! report (never skipped in silence).

use std::io::{self, BufRead, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::fdpool::{PooledFile, NO_OWNER};
use super::quarantine::{quarantine_from, Source};
use super::segment;
use crate::envelope::MAX_RECORD_BYTES;

/// One item read from a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A complete line (without its `\n`) starting at global `offset`.
    Record {
        offset: u64,
        segment: u64,
        line: Vec<u8>,
    },
    /// A line longer than the record limit, skipped; `len` includes the `\n`.
    Oversize { offset: u64, segment: u64, len: u64 },
    /// Bytes `from..to` are gone: segments before `to` were deleted (or one
    /// was truncated) while the reader was at or before `from`.
    Gap { from: u64, to: u64 },
}

impl Item {
    /// Global offset just past this item: where the next read starts.
    pub fn next_offset(&self) -> u64 {
        match self {
            Item::Record { offset, line, .. } => offset + line.len() as u64 + 1,
            Item::Oversize { offset, len, .. } => offset + len,
            Item::Gap { to, .. } => *to,
        }
    }
}

struct Open {
    start: u64,
    reader: SegmentReader,
}

/// A buffered reader of one segment whose file lives in the descriptor pool
/// ([`super::fdpool`]): it may be closed between reads and is reopened
/// (checked to be the same file) on the next.
struct SegmentReader {
    file: PooledFile,
    buf: Box<[u8]>,
    lo: usize,
    hi: usize,
    /// File position of `buf[hi]`.
    at: u64,
}

impl SegmentReader {
    fn new(file: PooledFile, at: u64) -> SegmentReader {
        SegmentReader {
            file,
            buf: vec![0u8; 64 * 1024].into_boxed_slice(),
            lo: 0,
            hi: 0,
            at,
        }
    }
}

impl Read for SegmentReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let n = {
            let avail = self.fill_buf()?;
            let n = avail.len().min(out.len());
            out[..n].copy_from_slice(&avail[..n]);
            n
        };
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for SegmentReader {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.lo == self.hi {
            let n = self.file.get()?.read_at(&mut self.buf, self.at)?;
            self.at += n as u64;
            self.lo = 0;
            self.hi = n;
        }
        Ok(&self.buf[self.lo..self.hi])
    }

    fn consume(&mut self, n: usize) {
        self.lo = (self.lo + n).min(self.hi);
    }
}

/// A cursor over one channel directory.
pub struct LogReader {
    dir: PathBuf,
    pos: u64,
    open: Option<Open>,
    /// Descriptor-pool owner of the files opened (a store's, or none).
    owner: u64,
    /// Emptied line buffers given back ([`LogReader::recycle`]), filled
    /// again by the next reads instead of allocating one per line.
    spare: Vec<Vec<u8>>,
    /// The segment starts as last listed (empty: not listed yet). Serves
    /// for every segment before the last one listed, so catching up over n
    /// segments lists the directory a few times, not n times (a listing
    /// costs O(n)); reaching the last one, or a segment found deleted,
    /// lists again.
    segs: Vec<u64>,
}

/// Most line buffers a reader keeps for reuse: a subscriber's batch.
const SPARE_LINES: usize = 1024;
/// Buffers larger than this are freed rather than kept, so one large record
/// does not pin its size for the reader's life.
const SPARE_LINE_CAPACITY: usize = 4096;

enum Line {
    /// A line was read into the buffer given.
    Complete,
    Oversize(u64),
    /// End of file (possibly after an unterminated fragment, not consumed).
    End,
}

impl LogReader {
    /// A reader of the channel directory `dir` positioned at global `pos`.
    pub fn new(dir: impl Into<PathBuf>, pos: u64) -> LogReader {
        Self::owned(dir, pos, NO_OWNER)
    }

    /// A reader whose open files belong to the pool owner `owner` (a
    /// store's: they are closed when the store closes).
    pub fn owned(dir: impl Into<PathBuf>, pos: u64, owner: u64) -> LogReader {
        LogReader {
            dir: dir.into(),
            pos,
            open: None,
            owner,
            spare: Vec::new(),
            segs: Vec::new(),
        }
    }

    /// Gives back the line of a record read earlier, once done with it: the
    /// next reads fill it again instead of allocating (up to a bound).
    pub fn recycle(&mut self, mut line: Vec<u8>) {
        if self.spare.len() < SPARE_LINES && line.capacity() <= SPARE_LINE_CAPACITY {
            line.clear();
            self.spare.push(line);
        }
    }

    /// The channel directory read.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Global offset of the next item.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Moves the reader to global offset `pos`.
    pub fn seek(&mut self, pos: u64) {
        if pos != self.pos {
            self.pos = pos;
            self.open = None;
        }
    }

    /// The next item ending at or before `limit` (a writer's committed end,
    /// or `u64::MAX` for a directory no one is writing). `None`: nothing more
    /// yet.
    pub fn next_item(&mut self, limit: u64) -> io::Result<Option<Item>> {
        loop {
            if self.pos >= limit {
                return Ok(None);
            }
            if self.open.is_none() {
                // Segments newer than the last listed may exist by now.
                if self.segs.last().is_none_or(|&last| self.pos >= last) {
                    self.segs = segment::list_segments(&self.dir)?;
                }
                let segs = &self.segs;
                let Some(&first) = segs.first() else {
                    return Ok(None);
                };
                if self.pos < first {
                    let from = self.pos;
                    self.pos = first;
                    return Ok(Some(Item::Gap { from, to: first }));
                }
                let start = *segs
                    .iter()
                    .rev()
                    .find(|&&s| s <= self.pos)
                    .expect("first <= pos");
                let path = segment::segment_path(&self.dir, start);
                let file = match PooledFile::open(&path, false, self.owner) {
                    Ok(f) => f,
                    // Deleted since it was listed: list again.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        self.segs.clear();
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                self.open = Some(Open {
                    start,
                    reader: SegmentReader::new(file, self.pos - start),
                });
            }
            let open = self.open.as_mut().expect("opened above");
            let start = open.start;
            let mut buf = self.spare.pop().unwrap_or_default();
            let line = match read_line(&mut open.reader, &mut buf) {
                Ok(line) => line,
                // Closed by the pool and deleted since: list again.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    self.open = None;
                    self.segs.clear();
                    continue;
                }
                Err(e) => {
                    self.open = None;
                    return Err(e);
                }
            };
            match line {
                Line::Complete => {
                    // The line and its newline, as `Item::next_offset` counts.
                    let next = self.pos + buf.len() as u64 + 1;
                    if next > limit {
                        self.open = None;
                        self.recycle(buf);
                        return Ok(None);
                    }
                    let offset = std::mem::replace(&mut self.pos, next);
                    return Ok(Some(Item::Record {
                        offset,
                        segment: start,
                        line: buf,
                    }));
                }
                Line::Oversize(len) => {
                    self.recycle(buf);
                    let item = Item::Oversize {
                        offset: self.pos,
                        segment: start,
                        len,
                    };
                    if item.next_offset() > limit {
                        self.open = None;
                        return Ok(None);
                    }
                    self.quarantine_oversize(start, len);
                    self.pos = item.next_offset();
                    return Ok(Some(item));
                }
                Line::End => {
                    self.recycle(buf);
                    // Re-open next time so the unread tail is read afresh.
                    self.open = None;
                    let mut next = self.segs.iter().copied().find(|&s| s > start);
                    if next.is_none() {
                        self.segs = segment::list_segments(&self.dir)?;
                        next = self.segs.iter().copied().find(|&s| s > start);
                    }
                    match next {
                        Some(next) => {
                            // A sealed segment is done; a torn fragment left in it is skipped.
                            let seg_len =
                                std::fs::metadata(segment::segment_path(&self.dir, start))
                                    .map(|m| m.len())
                                    .unwrap_or(0);
                            if start + seg_len > self.pos {
                                log::warn!(
                                    "{}: skipped an unterminated record at offset {} of a sealed segment",
                                    self.dir.display(),
                                    self.pos
                                );
                            }
                            // Bytes between this segment's end and the next
                            // segment are gone (a deleted or truncated segment).
                            let from = self.pos.max(start + seg_len);
                            self.pos = next;
                            if from < next {
                                return Ok(Some(Item::Gap { from, to: next }));
                            }
                        }
                        _ => return Ok(None),
                    }
                }
            }
        }
    }
}

impl LogReader {
    /// Copies the line of `len` bytes (with its line feed) at the reader's
    /// position, over the record limit, to the quarantine directory (as an
    /// unreadable record: counted, logged once, every reader goes past it).
    /// Only logged for a directory not inside a data directory's `channels/`.
    fn quarantine_oversize(&self, segment_start: u64, len: u64) {
        let reason = format!("a {len}-byte line is over the record limit ({MAX_RECORD_BYTES})");
        let parent = self.dir.parent();
        let inside = parent.and_then(Path::file_name) == Some(segment::CHANNELS_DIR.as_ref());
        let data_dir = parent.and_then(Path::parent);
        let channel = self.dir.file_name().and_then(|n| n.to_str());
        match (inside, data_dir, channel) {
            (true, Some(data_dir), Some(channel)) => {
                let src = Source::Range {
                    segment: &segment::segment_path(&self.dir, segment_start),
                    at: self.pos - segment_start,
                    len: len - 1,
                };
                quarantine_from(data_dir, channel, self.pos, src, &reason);
            }
            _ => log::warn!(
                "{}: skipped at offset {}: {reason}",
                self.dir.display(),
                self.pos
            ),
        }
    }
}

/// Reads one `\n`-terminated line into `line` (empty on entry). An
/// unterminated fragment at end of file is left unconsumed as far as the
/// caller is concerned (it re-seeks).
fn read_line(r: &mut impl BufRead, line: &mut Vec<u8>) -> io::Result<Line> {
    let mut skipped: u64 = 0;
    let mut oversize = false;
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            return Ok(Line::End);
        }
        match memchr::memchr(b'\n', buf) {
            Some(i) => {
                if oversize || line.len() + i + 1 > MAX_RECORD_BYTES {
                    let len = skipped + line.len() as u64 + i as u64 + 1;
                    r.consume(i + 1);
                    return Ok(Line::Oversize(len));
                }
                line.extend_from_slice(&buf[..i]);
                r.consume(i + 1);
                return Ok(Line::Complete);
            }
            None => {
                let n = buf.len();
                if oversize || line.len() + n >= MAX_RECORD_BYTES {
                    oversize = true;
                    skipped += (line.len() + n) as u64;
                    line.clear();
                } else {
                    line.extend_from_slice(buf);
                }
                r.consume(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` one-line segments `seg<i>` of `dir`, each right after the last.
    fn one_line_segments(dir: &Path, n: u64) -> Vec<u64> {
        let mut starts = Vec::new();
        let mut at = 0;
        for i in 0..n {
            let line = format!("seg{i:04}\n");
            std::fs::write(segment::segment_path(dir, at), &line).expect("write segment");
            starts.push(at);
            at += line.len() as u64;
        }
        starts
    }

    /// Catching up over many segments lists the directory a few times, not
    /// once per segment (each listing costs as much as there are segments).
    #[test]
    fn reading_many_segments_lists_the_directory_a_few_times() {
        let dir = tempfile::tempdir().expect("temp dir");
        one_line_segments(dir.path(), 300);
        let before = segment::LISTINGS.with(|n| n.get());
        let mut reader = LogReader::new(dir.path(), 0);
        let mut read = 0;
        while let Some(item) = reader.next_item(u64::MAX).expect("read") {
            assert!(matches!(item, Item::Record { .. }), "{item:?}");
            read += 1;
        }
        assert_eq!(read, 300);
        let listings = segment::LISTINGS.with(|n| n.get()) - before;
        assert!(listings <= 4, "{listings} listings for 300 segments");
    }

    /// Segments deleted after the reader listed them are a gap, and the
    /// segments written after it listed are read.
    #[test]
    fn segments_deleted_or_added_since_the_listing_are_seen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let starts = one_line_segments(dir.path(), 10);
        let mut reader = LogReader::new(dir.path(), 0);
        let first = reader.next_item(u64::MAX).expect("read");
        assert!(matches!(first, Some(Item::Record { offset: 0, .. })));
        for &s in &starts[1..5] {
            std::fs::remove_file(segment::segment_path(dir.path(), s)).expect("delete");
        }
        let end = 10 * 8;
        std::fs::write(segment::segment_path(dir.path(), end), "seg0010\n").expect("append");
        let mut items = Vec::new();
        while let Some(item) = reader.next_item(u64::MAX).expect("read") {
            items.push(item);
        }
        assert_eq!(
            items[0],
            Item::Gap {
                from: starts[1],
                to: starts[5]
            }
        );
        let offsets: Vec<u64> = items[1..]
            .iter()
            .map(|i| match i {
                Item::Record { offset, .. } => *offset,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(offsets, [&starts[5..], &[end][..]].concat());
    }

    /// Lines read into recycled buffers are exactly the file's, whatever the
    /// buffers held before; oversized buffers are not kept.
    #[test]
    fn recycled_buffers_read_back_exact_lines() {
        let dir = tempfile::tempdir().expect("temp dir");
        let lines: Vec<Vec<u8>> = (0..40)
            .map(|i| vec![b'a' + (i % 26) as u8; 1 + (i * 37) % 300])
            .collect();
        let mut file = Vec::new();
        for l in &lines {
            file.extend_from_slice(l);
            file.push(b'\n');
        }
        file.extend_from_slice(b"unterminated tail");
        std::fs::write(segment::segment_path(dir.path(), 0), &file).expect("write segment");

        let mut reader = LogReader::new(dir.path(), 0);
        let mut read = Vec::new();
        while let Some(item) = reader.next_item(u64::MAX).expect("read") {
            let Item::Record { line, .. } = item else {
                panic!("only records here");
            };
            read.push(line.clone());
            // A longer buffer full of other bytes, and the line itself.
            reader.recycle(vec![b'#'; 512]);
            reader.recycle(line);
        }
        assert_eq!(read, lines);
        assert!(reader.spare.len() <= SPARE_LINES);
        assert!(reader.spare.iter().all(Vec::is_empty));

        let before = reader.spare.len();
        reader.recycle(Vec::with_capacity(SPARE_LINE_CAPACITY + 1));
        assert_eq!(reader.spare.len(), before, "a large buffer is freed");
    }
}
