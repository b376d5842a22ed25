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

use std::fs::File;
use std::io::{self, BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};

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
    reader: BufReader<File>,
}

/// A cursor over one channel directory.
pub struct LogReader {
    dir: PathBuf,
    pos: u64,
    open: Option<Open>,
}

enum Line {
    Complete(Vec<u8>),
    Oversize(u64),
    /// End of file (possibly after an unterminated fragment, not consumed).
    End,
}

impl LogReader {
    /// A reader of the channel directory `dir` positioned at global `pos`.
    pub fn new(dir: impl Into<PathBuf>, pos: u64) -> LogReader {
        LogReader {
            dir: dir.into(),
            pos,
            open: None,
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
                let segs = segment::list_segments(&self.dir)?;
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
                let mut file = match File::open(segment::segment_path(&self.dir, start)) {
                    Ok(f) => f,
                    // Deleted between listing and opening: list again.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                };
                file.seek(SeekFrom::Start(self.pos - start))?;
                self.open = Some(Open {
                    start,
                    reader: BufReader::with_capacity(64 * 1024, file),
                });
            }
            let open = self.open.as_mut().expect("opened above");
            let start = open.start;
            match read_line(&mut open.reader)? {
                Line::Complete(line) => {
                    let offset = self.pos;
                    let item = Item::Record {
                        offset,
                        segment: start,
                        line,
                    };
                    if item.next_offset() > limit {
                        self.open = None;
                        return Ok(None);
                    }
                    self.pos = item.next_offset();
                    return Ok(Some(item));
                }
                Line::Oversize(len) => {
                    let item = Item::Oversize {
                        offset: self.pos,
                        segment: start,
                        len,
                    };
                    if item.next_offset() > limit {
                        self.open = None;
                        return Ok(None);
                    }
                    log::warn!(
                        "{}: skipped a {len}-byte record at offset {} (limit {MAX_RECORD_BYTES})",
                        self.dir.display(),
                        self.pos
                    );
                    self.pos = item.next_offset();
                    return Ok(Some(item));
                }
                Line::End => {
                    // Re-open next time so the unread tail is read afresh.
                    self.open = None;
                    let segs = segment::list_segments(&self.dir)?;
                    match segs.iter().find(|&&s| s > start) {
                        Some(&next) => {
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

/// Reads one `\n`-terminated line. An unterminated fragment at end of file
/// is left unconsumed as far as the caller is concerned (it re-seeks).
fn read_line(r: &mut BufReader<File>) -> io::Result<Line> {
    let mut line = Vec::new();
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
                return Ok(Line::Complete(line));
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
