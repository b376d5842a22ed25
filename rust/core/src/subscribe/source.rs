//! [`Source`]: where a subscriber's records come from. A [`LogReader`], and
//! the records it read and decoded ahead, on another thread, while the
//! handler ran on the batch before ([`Source::fill`]). Reading and decoding
//! a record costs about as much as handing it to a Python handler, so on a
//! backlog the two overlap instead of taking turns.
//!
//! Reading ahead changes nothing a handler or an offset can see: records
//! come out of [`Source::next`] in the order and with the content the reader
//! gives, and nothing is acknowledged until the worker settles it. What is
//! read ahead is dropped on a seek.

use std::collections::VecDeque;
use std::io;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::{self, JoinHandle};

use super::Delivery;
use crate::storage::{Item, LogReader};

/// A record the reader gave, decoded (or why it cannot be), or another item
/// (a gap or an oversize line).
// Nearly every item is a record: boxing it would allocate once per record
// to save space only on the rare others.
#[allow(clippy::large_enum_variant)]
pub(super) enum Fetched {
    Record {
        offset: u64,
        /// Just past the record's `\n`.
        next: u64,
        decoded: Result<Delivery, (String, Vec<u8>)>,
    },
    Other(Item),
}

impl Fetched {
    fn of(item: Item) -> Fetched {
        match item {
            Item::Record { offset, line, .. } => Fetched::Record {
                offset,
                next: offset + line.len() as u64 + 1,
                decoded: Delivery::decode(offset, line),
            },
            other => Fetched::Other(other),
        }
    }

    /// Global offset where this item starts.
    fn start(&self) -> u64 {
        match self {
            Fetched::Record { offset, .. } => *offset,
            Fetched::Other(Item::Record { offset, .. } | Item::Oversize { offset, .. }) => *offset,
            Fetched::Other(Item::Gap { from, .. }) => *from,
        }
    }

    /// Bytes of the channel this item covers.
    fn len(&self) -> u64 {
        match self {
            Fetched::Record { offset, next, .. } => next - offset,
            Fetched::Other(item) => item.next_offset() - self.start(),
        }
    }
}

/// Records read ahead while the handler runs need at least this many per
/// batch to pay for the hand-over.
pub(super) const READ_AHEAD_MIN_BATCH: usize = 64;
/// Most bytes read ahead (a batch of ordinary records is far less).
const READ_AHEAD_MAX_BYTES: u64 = 4 << 20;
/// Batches delivered without reading ahead after the worker had to wait
/// for the read-ahead thread; doubled for each such wait in a row, up to 64
/// times this.
pub(super) const READ_AHEAD_PAUSE_BATCHES: u32 = 8;
/// One batch in this many read-ahead batches is read by the worker itself,
/// to keep its measure of what reading costs it current.
pub(super) const READ_AHEAD_SAMPLE_EVERY: u64 = 32;

/// A subscriber's read-ahead thread: given the worker's [`Source`], it
/// fills it ([`Source::fill`]) and gives it back. It lives as long as this
/// value (dropping it ends and joins the thread), so its caches stay warm
/// from one batch to the next.
pub(super) struct ReadAhead {
    jobs: Option<SyncSender<(Source, u64, usize)>>,
    done: Receiver<Source>,
    thread: Option<JoinHandle<()>>,
}

impl ReadAhead {
    pub(super) fn start(id: &str) -> io::Result<ReadAhead> {
        let (jobs, todo) = sync_channel::<(Source, u64, usize)>(1);
        let (filled, done) = sync_channel(1);
        let thread = thread::Builder::new()
            .name(format!("keyop-ahead-{id}"))
            .spawn(move || {
                for (mut src, limit, count) in todo {
                    src.fill(limit, count, READ_AHEAD_MAX_BYTES);
                    if filled.send(src).is_err() {
                        break;
                    }
                }
            })?;
        Ok(ReadAhead {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    /// Hands `src` over to be filled up to `count` items at or below
    /// `limit` (then `None`); gives it back at once if the thread is gone.
    pub(super) fn give(&self, src: Source, limit: u64, count: usize) -> Option<Source> {
        let jobs = self.jobs.as_ref().expect("open until dropped");
        jobs.send((src, limit, count)).err().map(|e| e.0 .0)
    }

    /// Takes the source given last back, once filled.
    pub(super) fn take(&self) -> Source {
        self.done
            .recv()
            .expect("the read-ahead thread gives back what it was given")
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A subscriber's reader and what it read ahead.
pub(super) struct Source {
    reader: LogReader,
    /// Read ahead, in order; the reader is past all of them.
    ahead: VecDeque<Fetched>,
}

impl Source {
    pub(super) fn new(reader: LogReader) -> Source {
        Source {
            reader,
            ahead: VecDeque::new(),
        }
    }

    /// The next item at or below `limit` (a committed end no lower than the
    /// one records were read ahead to).
    pub(super) fn next(&mut self, limit: u64) -> io::Result<Option<Fetched>> {
        if let Some(f) = self.ahead.pop_front() {
            return Ok(Some(f));
        }
        Ok(self.reader.next_item(limit)?.map(Fetched::of))
    }

    /// Puts `f`, the item [`Source::next`] gave last, back in front.
    pub(super) fn unread(&mut self, f: Fetched) {
        self.ahead.push_front(f);
    }

    /// Gives back the lines of delivered records, for the reader to fill
    /// again (see [`LogReader::recycle`]): with a read-ahead thread, lines
    /// would otherwise be allocated on one thread and freed on another.
    pub(super) fn recycle(&mut self, batch: &mut Vec<Delivery>) {
        for d in batch.drain(..) {
            self.reader.recycle(d.into_line());
        }
    }

    /// Moves to global offset `pos`, dropping what was read ahead.
    pub(super) fn seek(&mut self, pos: u64) {
        self.ahead.clear();
        self.reader.seek(pos);
    }

    /// Whether nothing was read ahead (the next item comes from the reader).
    pub(super) fn nothing_ahead(&self) -> bool {
        self.ahead.is_empty()
    }

    /// Offset of the next item [`Source::next`] gives.
    pub(super) fn position(&self) -> u64 {
        self.ahead
            .front()
            .map_or(self.reader.position(), Fetched::start)
    }

    /// Reads and decodes items at or below `limit` ahead, until `count` are
    /// ahead or it read `max_bytes`. A read error ends it quietly: the
    /// worker's own read meets it again, and handles it.
    pub(super) fn fill(&mut self, limit: u64, count: usize, max_bytes: u64) {
        let mut bytes = 0;
        while self.ahead.len() < count && bytes < max_bytes {
            match self.reader.next_item(limit) {
                Ok(Some(item)) => {
                    let f = Fetched::of(item);
                    bytes += f.len();
                    self.ahead.push_back(f);
                }
                Ok(None) | Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{ChannelWriter, WriterConfig};

    const ANY: u64 = u64::MAX;

    fn record(i: u32) -> Vec<u8> {
        format!(
            "{{\"v\":1,\"id\":\"r{i}\",\"ts\":\"2026-03-31T14:22:01Z\",\"channel\":\"c\",\
             \"origin\":\"o\",\"payload_type\":\"t\",\"payload\":{i}}}\n"
        )
        .into_bytes()
    }

    /// What `next` gives is the same whether or not records were read ahead,
    /// a seek drops what was read ahead, and `unread` puts an item back.
    #[test]
    fn read_ahead_gives_what_the_reader_gives() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cfg = WriterConfig {
            segment_bytes: 0,
            durable: false,
        };
        let w = ChannelWriter::open("c", &dir.path().join("c"), cfg).expect("writer");
        let mut all = Vec::new();
        for i in 0..10 {
            all.extend_from_slice(&record(i));
        }
        all.extend_from_slice(b"not json\n");
        all.extend_from_slice(&record(10));
        w.append(&all, 12).expect("append");
        let end = w.committed_end();

        let ids = |src: &mut Source, n: usize| -> Vec<String> {
            (0..n)
                .map(|_| match src.next(end).expect("read").expect("an item") {
                    Fetched::Record { decoded: Ok(d), .. } => d.envelope().id.into_owned(),
                    Fetched::Record {
                        decoded: Err(_), ..
                    } => "unreadable".into(),
                    Fetched::Other(_) => "other".into(),
                })
                .collect()
        };
        let plain = ids(&mut Source::new(LogReader::new(w.dir(), 0)), 12);
        assert_eq!(plain[10], "unreadable");
        assert_eq!(plain[11], "r10");

        let mut src = Source::new(LogReader::new(w.dir(), 0));
        assert_eq!(ids(&mut src, 2), plain[..2]);
        src.fill(end, 5, ANY);
        assert_eq!(src.ahead.len(), 5);
        assert_eq!(src.position(), src.ahead[0].start());
        let third = src.next(end).expect("read").expect("an item");
        let third_at = third.start();
        src.unread(third);
        assert_eq!(src.position(), third_at);
        src.fill(end, 100, ANY);
        assert_eq!(ids(&mut src, 10), plain[2..]);
        assert!(
            src.next(end).expect("read").is_none(),
            "nothing past the end"
        );
        assert_eq!(src.position(), end);

        // A seek drops what was read ahead and reads from there.
        let mut src = Source::new(LogReader::new(w.dir(), 0));
        src.fill(end, 8, ANY);
        let at = record(0).len() as u64 * 3;
        src.seek(at);
        assert!(src.ahead.is_empty());
        assert_eq!(ids(&mut src, 9), plain[3..]);

        // The byte bound: reading stops once it is reached.
        let mut src = Source::new(LogReader::new(w.dir(), 0));
        src.fill(end, 100, 1);
        assert_eq!(src.ahead.len(), 1);
        src.fill(end, 100, record(0).len() as u64 * 2 + 1);
        assert_eq!(
            src.ahead.len(),
            4,
            "three more: the bound counts this call's bytes"
        );
        // ... and the count bound.
        src.fill(end, 6, ANY);
        assert_eq!(src.ahead.len(), 6);
    }
}
