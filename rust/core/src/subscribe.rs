//! Delivery to local subscribers: read -> handler -> retry/backoff ->
//! acknowledge or dead-letter, with a persisted offset per subscriber.
//! why this file is long: the delivery loop, its retry/dead-letter
//! settlement and the handling of what a reader can meet (gaps, unreadable
//! records) share the worker's offset state; split apart they would have to
//! pass it around by hand.
//!
//! A gap (the subscriber's position points into data that is gone) is
//! counted, logged and handed to [`Handler::gap`]; an unreadable record is
//! quarantined (see `storage::quarantine`) and dead-lettered with the reason,
//! and delivery goes on past both.
//!
//! Each subscriber runs on its own engine-owned thread. It waits on its
//! channel's commit notifier (with a slow fallback poll), reads whole
//! committed lines in batches (on a backlog, a read-ahead thread reads the
//! next batch while the handler runs: see `source`), and hands each batch
//! to the [`Handler`], which
//! processes records in order and reports how far it got. A failing record
//! blocks the ones behind it while it is retried with exponential backoff;
//! after the last retry it is appended to `<channel>.dead-letter` and only
//! then is the offset moved past it. Stopping during a backoff leaves the
//! failing record unacknowledged, so it is delivered again next time.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle, ThreadId};
use std::time::{Duration, Instant, SystemTime};

use crate::envelope::{
    self, dead_letter_channel, encode_record, Header, Stamp, DEAD_LETTER_PAYLOAD_TYPE,
    DEAD_LETTER_SUFFIX,
};
use crate::stats::EngineStats;
use crate::storage::offsets::{read_offset, write_offset};
use crate::storage::quarantine::{self, quarantine, report_gap, split_point};
use crate::storage::{segment, ChannelWriter, Item, LogReader};

/// Most records the batch buffer is allocated for up front (a larger
/// `max_batch` grows it as needed).
const MAX_BATCH_CAPACITY: usize = 4096;

mod delivery;
mod source;
pub use delivery::Delivery;
use source::{Fetched, ReadAhead, Source};

/// Why a handler did not acknowledge a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The handler failed: retry with backoff, then dead-letter.
    Retry(String),
    /// The record can never be handled (its payload does not decode into the
    /// registered type): dead-letter it at once.
    Reject(String),
    /// The record cannot even be represented to the handler (for example a
    /// payload nested deeper than the reader allows): quarantine it and
    /// dead-letter it at once, with its raw text instead of the original.
    Unreadable(String),
}

/// Outcome of a handler call over a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Leading records handled successfully.
    pub handled: usize,
    /// Set when the record at index `handled` failed.
    pub failure: Option<Failure>,
}

/// Application code receiving deliveries, in order.
pub trait Handler: Send + 'static {
    /// Handles `batch` in order, stopping at the first failure. A handler
    /// may also stop early without a failure when its subscription is being
    /// stopped; the records it did not handle stay unacknowledged.
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome;

    /// Told that bytes `from..to` of the channel are gone (deleted by
    /// retention, a removed or truncated segment) before this subscriber
    /// read them; delivery goes on at `to`. The gap is already counted and
    /// logged.
    fn gap(&mut self, _from: u64, _to: u64) {}
}

/// Delivery settings of one subscriber.
#[derive(Debug, Clone, Copy)]
pub struct SubscribeOptions {
    /// Retries after the first failed call before dead-lettering.
    pub max_retries: u32,
    /// Minimum time between offset-file writes; zero writes after every batch.
    pub offset_flush_interval: Duration,
    /// First retry delay; doubles per retry.
    pub backoff_base: Duration,
    /// Cap of the retry delay.
    pub backoff_max: Duration,
    /// Most records per handler call. The offset is written at most once per
    /// batch, so a backlog pays two fsyncs per this many records (1024 by
    /// default; on a slow or busy disk those fsyncs bound the delivery rate),
    /// and a crash redelivers at most one batch with a zero flush interval.
    pub max_batch: usize,
    /// Fallback poll when no commit wakes the reader.
    pub poll_interval: Duration,
    /// Dead-letter records that fail for good; false logs and skips them.
    pub dead_letter: bool,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions {
            max_retries: 5,
            offset_flush_interval: Duration::ZERO,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            max_batch: 1024,
            poll_interval: Duration::from_secs(1),
            dead_letter: true,
        }
    }
}

/// Delay before retry number `k` (1-based): base * 2^(k-1), capped.
pub fn backoff_delay(base: Duration, max: Duration, k: u32) -> Duration {
    let factor = 1u32.checked_shl(k.saturating_sub(1)).unwrap_or(u32::MAX);
    base.checked_mul(factor).unwrap_or(max).min(max)
}

/// Stop signal shared by a background thread and its owner.
#[derive(Default)]
pub(crate) struct Stop {
    flag: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Stop {
    pub(crate) fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    pub(crate) fn set(&self) {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.flag.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    /// Sleeps up to `d`; true when stopped meanwhile.
    pub(crate) fn sleep(&self, d: Duration) -> bool {
        let g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self
            .cv
            .wait_timeout_while(g, d, |_| !self.flag.load(Ordering::Acquire))
            .unwrap_or_else(|e| e.into_inner());
        self.is_set()
    }
}

/// How long [`Subscriber::stop`] (and so a drop) waits for a handler call in
/// progress before giving up on it.
pub const DEFAULT_STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Slice of a bounded wait between two checks for an interruption.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// A running subscriber. Dropping it stops it (see [`Subscriber::stop`]).
pub struct Subscriber {
    channel: String,
    id: String,
    stop: Arc<Stop>,
    /// Set by the delivery thread as its last act.
    finished: Arc<Stop>,
    /// Set when a stop gave up waiting: the thread writes no offset any more.
    abandoned: Arc<AtomicBool>,
    owner: crate::fork::Owner,
    writer: Arc<ChannelWriter>,
    position: Arc<AtomicU64>,
    seek_to: Arc<Mutex<Option<u64>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

/// Everything the delivery thread owns.
struct Worker<H: Handler> {
    channel: String,
    id: String,
    handler: H,
    opts: SubscribeOptions,
    /// Whether to read the next batch while the handler runs on this one
    /// (more than one CPU, and batches big enough to pay for it).
    read_ahead: bool,
    /// Full batches still to deliver without reading ahead, and how many
    /// times in a row reading ahead did not pay.
    ahead_paused: u32,
    ahead_waits: u32,
    /// How long the worker took, last time, to read a full batch itself.
    own_read: Duration,
    /// Batches delivered while reading ahead.
    ahead_runs: u64,
    writer: Arc<ChannelWriter>,
    dead_letters: Arc<ChannelWriter>,
    offset_path: PathBuf,
    /// Offset of the next record not yet acknowledged.
    acked: u64,
    persisted: u64,
    last_flush: Instant,
    /// Failed offset writes in a row (a full or failing disk), retried with backoff.
    offset_failures: OffsetFailures,
    position: Arc<AtomicU64>,
    /// A seek requested by [`Subscriber::seek`], taken between batches.
    seek_to: Arc<Mutex<Option<u64>>>,
    stop: Arc<Stop>,
    finished: Arc<Stop>,
    abandoned: Arc<AtomicBool>,
    stats: Arc<EngineStats>,
}

/// Where a subscriber reads from and writes to.
pub(crate) struct Wiring {
    pub channel: String,
    pub id: String,
    pub writer: Arc<ChannelWriter>,
    pub dead_letters: Arc<ChannelWriter>,
    pub offset_path: PathBuf,
    pub stats: Arc<EngineStats>,
    /// A resolved start position (a record boundary) used instead of the
    /// stored offset, or instead of the end when there is none.
    pub initial: Option<u64>,
}

impl Subscriber {
    /// Starts delivering the channel to `handler` from the offset stored in
    /// the offset file (or, when there is none, from the current end, which
    /// is written to a new offset file at once).
    pub(crate) fn start<H: Handler>(
        w: Wiring,
        handler: H,
        opts: SubscribeOptions,
    ) -> io::Result<Subscriber> {
        let Wiring {
            channel,
            id,
            writer,
            dead_letters,
            offset_path,
            stats,
            initial,
        } = w;
        let (channel, id) = (channel.as_str(), id.as_str());
        let end = writer.committed_end();
        let start = match initial {
            Some(at) => at,
            None => match read_offset(&offset_path)? {
                Some(stored) => sane_start(&writer, stored, end, channel, id)?,
                None => end,
            },
        };
        if let Some(dir) = offset_path.parent() {
            segment::create_dir_all(dir)?;
        }
        write_offset(&offset_path, start)?;
        let stop = Arc::new(Stop::default());
        let finished = Arc::new(Stop::default());
        let abandoned = Arc::new(AtomicBool::new(false));
        let position = Arc::new(AtomicU64::new(start));
        let seek_to = Arc::new(Mutex::new(None));
        let worker = Worker {
            channel: channel.to_owned(),
            id: id.to_owned(),
            handler,
            opts,
            read_ahead: opts.max_batch >= source::READ_AHEAD_MIN_BATCH
                && thread::available_parallelism().is_ok_and(|n| n.get() > 1),
            ahead_paused: 0,
            ahead_waits: 0,
            own_read: Duration::ZERO,
            ahead_runs: 0,
            writer: writer.clone(),
            dead_letters,
            offset_path,
            acked: start,
            persisted: start,
            last_flush: Instant::now(),
            offset_failures: OffsetFailures::default(),
            position: position.clone(),
            seek_to: seek_to.clone(),
            stop: stop.clone(),
            finished: finished.clone(),
            abandoned: abandoned.clone(),
            stats,
        };
        let source = Source::new(LogReader::new(writer.dir(), start));
        let thread = thread::Builder::new()
            .name(format!("keyop-sub-{id}"))
            .spawn(move || worker.run(source))?;
        Ok(Subscriber {
            channel: channel.to_owned(),
            id: id.to_owned(),
            stop,
            finished,
            abandoned,
            owner: crate::fork::Owner::current(),
            writer,
            position,
            seek_to,
            thread_id: thread.thread().id(),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The channel subscribed to.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// The subscriber id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Offset of the next record not yet acknowledged; once [`seek`] was
    /// called, the offset it goes to, even before the delivery thread takes
    /// it.
    ///
    /// [`seek`]: Subscriber::seek
    pub fn position(&self) -> u64 {
        let pending = *self.seek_to.lock().unwrap_or_else(|e| e.into_inner());
        pending.unwrap_or_else(|| self.position.load(Ordering::Acquire))
    }

    /// Asks the delivery thread to go on at `offset` (a record boundary,
    /// already checked): it is taken between batches, the offset is
    /// persisted, and the next record delivered is the one at `offset`. A
    /// seek not yet taken when delivery stops is taken as it stops, so the
    /// offset persisted is the seek's.
    pub fn seek(&self, offset: u64) {
        *self.seek_to.lock().unwrap_or_else(|e| e.into_inner()) = Some(offset);
        self.writer.notifier().wake_all();
    }

    /// Whether a stop was requested.
    pub fn is_stopped(&self) -> bool {
        self.stop.is_set()
    }

    /// Whether the delivery thread has ended (after a stop).
    pub fn is_finished(&self) -> bool {
        self.thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|h| h.is_finished())
    }

    /// Waits up to `timeout` for the delivery thread to finish (after a
    /// stop: its offset is then persisted); true when it has.
    pub fn wait_finished(&self, timeout: Duration) -> bool {
        if self.is_current_thread() {
            return false;
        }
        self.finished.sleep(timeout) || self.is_finished()
    }

    /// Whether the caller runs on this subscriber's delivery thread (its handler).
    pub fn is_current_thread(&self) -> bool {
        thread::current().id() == self.thread_id
    }

    /// Stops delivery, waits up to [`DEFAULT_STOP_TIMEOUT`] for a handler
    /// call in progress to return, and persists the offset (see
    /// [`Subscriber::stop_within`]).
    pub fn stop(&self) {
        self.stop_within(DEFAULT_STOP_TIMEOUT, &mut || false);
    }

    /// From now on the delivery thread writes no offset (the subscriber is
    /// being removed and its offset file deleted).
    pub fn forget_offset(&self) {
        self.abandoned.store(true, Ordering::Release);
    }

    /// Asks the delivery thread to stop after the handler call in progress,
    /// without waiting.
    pub fn signal_stop(&self) {
        self.stop.set();
        self.writer.notifier().wake_all();
    }

    /// Stops delivery and waits up to `timeout` for a handler call in
    /// progress to return; the thread then persists the offset. Returns
    /// false when it gave up: the handler is still running, a warning names
    /// the subscriber and channel, and the thread will write no offset any
    /// more, so the message in hand stays unacknowledged and is delivered
    /// again next time. `interrupted` is asked every 100 ms; true gives up
    /// at once. Idempotent. Called from the subscriber's own handler it only
    /// signals; in a forked child it does nothing (the thread is the
    /// parent's).
    pub fn stop_within(&self, timeout: Duration, interrupted: &mut dyn FnMut() -> bool) -> bool {
        if self.owner.is_foreign() {
            return true;
        }
        self.signal_stop();
        if self.is_current_thread() {
            return true;
        }
        let mut thread = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        let Some(handle) = thread.as_ref() else {
            return true;
        };
        let started = Instant::now();
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            if self.finished.sleep(left.min(WAIT_SLICE)) || handle.is_finished() {
                if let Some(h) = thread.take() {
                    let _ = h.join();
                }
                return true;
            }
            if left.is_zero() || interrupted() {
                break;
            }
        }
        self.abandoned.store(true, Ordering::Release);
        // Detached: it ends when (if ever) the handler returns.
        thread.take();
        log::warn!(
            "channel {:?}: subscriber {:?}: the handler did not return within {:.1}s of the stop; \
             stopped waiting for it. The message it holds stays unacknowledged and is delivered again \
             next time",
            self.channel,
            self.id,
            started.elapsed().as_secs_f64()
        );
        false
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if self.owner.is_foreign() {
            // The parent's thread: neither joined nor detached here.
            if let Some(h) = self
                .thread
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                std::mem::forget(h);
            }
            return;
        }
        self.stop();
    }
}

/// Validates a stored offset against the stream: one past the end (possible
/// after an OS crash in relaxed mode) is clamped to the end, and one that
/// does not fall on a record boundary moves to the next boundary.
fn sane_start(
    writer: &ChannelWriter,
    stored: u64,
    end: u64,
    channel: &str,
    id: &str,
) -> io::Result<u64> {
    if stored > end {
        log::warn!(
            "channel {channel:?}: subscriber {id:?} offset {stored} is past the end {end}; resuming at the end"
        );
        return Ok(end);
    }
    let segs = segment::list_segments(writer.dir())?;
    let Some(&seg) = segs.iter().rev().find(|&&s| s < stored) else {
        return Ok(stored);
    };
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(segment::segment_path(writer.dir(), seg))?;
    let mut prev = [0u8; 1];
    if stored - seg > file.metadata()?.len() {
        return Ok(stored); // in a gap between segments: the reader skips ahead
    }
    file.read_exact_at(&mut prev, stored - seg - 1)?;
    if prev[0] == b'\n' {
        return Ok(stored);
    }
    // Mid-record: skip to the start of the next record.
    let mut reader = LogReader::new(writer.dir(), stored);
    let next = match reader.next_item(end)? {
        Some(item) => item.next_offset(),
        None => end,
    };
    log::warn!(
        "channel {channel:?}: subscriber {id:?} offset {stored} is inside a record; resuming at {next}"
    );
    Ok(next)
}

impl<H: Handler> Worker<H> {
    fn run(mut self, mut src: Source) {
        // One batch buffer for the subscription's life: a fresh one per batch
        // grew by reallocation to ~230 kB, mapped and unmapped every batch.
        let mut batch = Vec::with_capacity(self.opts.max_batch.min(MAX_BATCH_CAPACITY));
        // Started on the first backlog; ended (and joined) with this loop.
        let mut ahead: Option<ReadAhead> = None;
        while !self.stop.is_set() {
            self.take_seek(&mut src);
            src.recycle(&mut batch);
            let (reads_itself, started) = (src.nothing_ahead(), Instant::now());
            let read = self.read_batch(&mut src, &mut batch);
            if reads_itself && batch.len() == self.opts.max_batch {
                self.own_read = started.elapsed();
            }
            if let Err(e) = read {
                log::error!(
                    "channel {:?}: subscriber {:?}: read failed: {e}",
                    self.channel,
                    self.id
                );
                if self.stop.sleep(self.opts.poll_interval) {
                    break;
                }
                continue;
            }
            if batch.is_empty() {
                self.flush_offset(false);
                if self.seek_pending() {
                    continue;
                }
                let wait = if self.acked != self.persisted {
                    let due = self.opts.offset_flush_interval.min(self.opts.poll_interval);
                    // After a failed write, not before its retry (new records still wake it).
                    self.offset_failures
                        .until_retry()
                        .map_or(due, |r| r.max(due))
                } else {
                    self.opts.poll_interval
                };
                self.writer.notifier().wait_past(src.position(), wait);
                continue;
            }
            let delivered;
            (src, delivered) = self.deliver_reading_ahead(&mut ahead, src, &batch);
            if !delivered {
                break;
            }
            self.flush_offset(false);
        }
        // The read-ahead thread ends (joined) before the worker says it has.
        drop(ahead);
        // A seek asked for before the stop is kept: its offset is persisted.
        self.take_seek(&mut src);
        self.flush_offset(true);
        self.finished.set();
    }

    /// Delivers `batch` (see [`Worker::deliver`]). A full batch suggests a
    /// backlog: then the records after it are read and decoded meanwhile by
    /// the read-ahead thread (started the first time), so reading overlaps
    /// the handler's run. Gives `src` back, with what was read ahead.
    ///
    /// That pays only with a CPU to spare. When the worker, its handler run
    /// done, waits longer for the read-ahead thread than it took to read a
    /// batch itself (other work holds the CPUs), reading ahead pauses for a
    /// number of batches, doubled each time in a row, and the worker reads
    /// for itself.
    fn deliver_reading_ahead(
        &mut self,
        ahead: &mut Option<ReadAhead>,
        src: Source,
        batch: &[Delivery],
    ) -> (Source, bool) {
        if !self.read_ahead || batch.len() < self.opts.max_batch {
            return (src, self.deliver(batch));
        }
        if self.ahead_paused > 0 {
            self.ahead_paused -= 1;
            return (src, self.deliver(batch));
        }
        if ahead.is_none() {
            match ReadAhead::start(&self.id) {
                Ok(a) => *ahead = Some(a),
                Err(e) => {
                    log::debug!("channel {:?}: no read-ahead thread: {e}", self.channel);
                    self.read_ahead = false;
                    return (src, self.deliver(batch));
                }
            }
        }
        let reader = ahead.as_ref().expect("started above");
        let limit = self.writer.committed_end();
        let src = reader.give(src, limit, self.opts.max_batch);
        let started = Instant::now();
        let delivered = self.deliver(batch);
        let handled = started.elapsed();
        let src = match src {
            Some(src) => src,
            None => reader.take(),
        };
        // What the worker waited for the read-ahead thread, beyond its own run.
        let waited = started.elapsed().saturating_sub(handled);
        self.ahead_runs += 1;
        if waited > self.own_read {
            self.ahead_waits = (self.ahead_waits + 1).min(7);
            self.ahead_paused = source::READ_AHEAD_PAUSE_BATCHES << (self.ahead_waits - 1);
        } else {
            self.ahead_waits = 0;
            if self.ahead_runs % source::READ_AHEAD_SAMPLE_EVERY == 0 {
                // The next batch is read by the worker, to time that afresh.
                self.ahead_paused = 1;
            }
        }
        (src, delivered)
    }

    /// Applies a requested seek: the reader and the acknowledged offset move
    /// there, and the offset is persisted at once.
    fn take_seek(&mut self, src: &mut Source) {
        let to = *self.seek_to.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(to) = to {
            src.seek(to);
            self.ack(to);
            // Cleared only once acknowledged, so `position()` never shows
            // the offset before the seek; a newer seek stays pending.
            let mut pending = self.seek_to.lock().unwrap_or_else(|e| e.into_inner());
            if *pending == Some(to) {
                *pending = None;
            }
            drop(pending);
            self.flush_offset(true);
        }
    }

    fn seek_pending(&self) -> bool {
        self.seek_to
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Reads up to `max_batch` decodable records into `batch` (empty on
    /// entry). Unreadable lines and skipped regions advance the acknowledged
    /// offset directly.
    fn read_batch(&mut self, src: &mut Source, batch: &mut Vec<Delivery>) -> io::Result<()> {
        let limit = self.writer.committed_end();
        while batch.len() < self.opts.max_batch {
            let Some(fetched) = src.next(limit)? else {
                break;
            };
            let plain = matches!(fetched, Fetched::Record { decoded: Ok(_), .. });
            if !plain && !batch.is_empty() {
                // Settled once the records before it are.
                src.unread(fetched);
                break;
            }
            match fetched {
                Fetched::Record { decoded: Ok(d), .. } => batch.push(d),
                Fetched::Record {
                    offset,
                    next,
                    decoded: Err((e, line)),
                } => {
                    // A corrupt run glued to a valid record: only the run is
                    // unreadable; the record after it is read next.
                    let bad = split_point(&line).unwrap_or(line.len());
                    let next = if bad < line.len() {
                        offset + bad as u64
                    } else {
                        next
                    };
                    if let Err(err) = self.unreadable(offset, &line[..bad], None, &e) {
                        src.seek(offset);
                        return Err(io::Error::other(format!(
                            "cannot dead-letter the unreadable record at offset {offset}: {err}"
                        )));
                    }
                    self.ack(next);
                    if bad < line.len() {
                        src.seek(next);
                    }
                }
                Fetched::Other(Item::Oversize {
                    offset,
                    segment,
                    len,
                }) => {
                    if let Err(err) = self.oversize(offset, segment, len) {
                        src.seek(offset);
                        return Err(io::Error::other(format!(
                            "cannot dead-letter the oversized record at offset {offset}: {err}"
                        )));
                    }
                    self.ack(offset + len);
                }
                Fetched::Other(item) => {
                    if let Item::Gap { from, to } = item {
                        report_gap(
                            &self.channel,
                            &format!("subscriber {:?}", self.id),
                            from,
                            to,
                        );
                        self.handler.gap(from, to);
                    }
                    self.ack(item.next_offset());
                }
            }
        }
        Ok(())
    }

    /// Calls the handler, recording consume latency (publish time to now,
    /// for the first record) and handler time per record.
    fn timed_handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        let now_nanos = SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        let waited = now_nanos - batch[0].ts_nanos();
        if waited >= 0 {
            self.stats
                .consume
                .record(Duration::from_nanos(waited as u64));
        }
        let started = Instant::now();
        let out = self.handler.handle(batch);
        let per = started.elapsed() / (out.handled.max(1) as u32);
        self.stats.handler.record(per);
        out
    }

    fn ack(&mut self, next: u64) {
        self.acked = next;
        self.position.store(next, Ordering::Release);
    }

    /// Delivers a batch; false when stopped before it was fully handled (the
    /// unhandled records stay unacknowledged).
    fn deliver(&mut self, batch: &[Delivery]) -> bool {
        let mut rest = batch;
        while !rest.is_empty() {
            let out = self.timed_handle(rest);
            let handled = out.handled.min(rest.len());
            if handled > 0 {
                let r = &rest[handled - 1];
                self.ack(r.end());
            }
            rest = &rest[handled..];
            if self.seek_pending() {
                // The rest of the batch is passed over: delivery goes on where asked.
                return true;
            }
            if self.stop.is_set() {
                // Stopped while handling: what was not handled stays unacknowledged.
                return rest.is_empty();
            }
            let Some(failure) = out.failure else {
                if handled == 0 && !rest.is_empty() {
                    // A handler that neither handles nor fails: treat as a failure.
                    if !self.settle(&rest[0], Failure::Retry("handler made no progress".into())) {
                        return false;
                    }
                    rest = &rest[1..];
                }
                continue;
            };
            if rest.is_empty() {
                break;
            }
            if !self.settle(&rest[0], failure) {
                return false;
            }
            rest = &rest[1..];
            if self.stop.is_set() {
                return false;
            }
        }
        true
    }

    /// Retries a failed record, then dead-letters it; true once it is
    /// acknowledged, false when stopped first. The dead letter's `retries` is
    /// the number of retries made (`max_retries` after a handler failure, as
    /// in 1.4; 0 for a record rejected outright).
    fn settle(&mut self, d: &Delivery, first: Failure) -> bool {
        let mut retries = 0;
        let mut raw = false;
        let mut rejected = true;
        let last_error = match first {
            Failure::Reject(e) => e,
            Failure::Unreadable(e) => {
                raw = true;
                e
            }
            Failure::Retry(mut e) => {
                let mut attempt = 1;
                loop {
                    if attempt > self.opts.max_retries {
                        rejected = false;
                        break e;
                    }
                    retries = attempt;
                    let delay =
                        backoff_delay(self.opts.backoff_base, self.opts.backoff_max, attempt);
                    if self.stop.sleep(delay) {
                        return false;
                    }
                    let out = self.timed_handle(std::slice::from_ref(d));
                    match out.failure {
                        None if out.handled >= 1 => {
                            self.ack(d.end());
                            return true;
                        }
                        Some(Failure::Reject(r)) => break r,
                        Some(Failure::Unreadable(r)) => {
                            raw = true;
                            break r;
                        }
                        Some(Failure::Retry(r)) => e = r,
                        None => e = "handler made no progress".into(),
                    }
                    attempt += 1;
                }
            }
        };
        let last_error = bounded_error(last_error);
        if raw {
            // Quarantined and dead-lettered as raw text (logged there).
            return self.commit_dead_letter(d, |w| {
                w.unreadable(d.offset, d.line(), Some(&d.envelope().origin), &last_error)
            });
        }
        if self.channel.ends_with(DEAD_LETTER_SUFFIX) || !self.opts.dead_letter {
            log::error!(
                "channel {:?}: subscriber {:?} gave up on record {} at offset {} (not dead-lettered): {last_error}",
                self.channel,
                self.id,
                d.envelope().id,
                d.offset
            );
            self.ack(d.end());
            return true;
        }
        self.commit_dead_letter(d, |w| w.dead_letter(d, &last_error, retries, rejected))
    }

    /// Writes `d`'s dead letter with `write`, retrying with backoff until it
    /// is committed; the offset moves only then. False when stopped first.
    fn commit_dead_letter(
        &mut self,
        d: &Delivery,
        write: impl Fn(&Self) -> Result<(), crate::StorageError>,
    ) -> bool {
        let mut attempt = 1;
        loop {
            match write(self) {
                Ok(()) => {
                    self.ack(d.end());
                    return true;
                }
                Err(e) => log::error!(
                    "channel {:?}: cannot write dead letter for {}: {e}; retrying",
                    self.channel,
                    d.envelope().id
                ),
            }
            let delay = backoff_delay(self.opts.backoff_base, self.opts.backoff_max, attempt);
            if self.stop.sleep(delay) {
                return false;
            }
            attempt += 1;
        }
    }

    fn dead_letter(
        &self,
        d: &Delivery,
        last_error: &str,
        retries: u32,
        rejected: bool,
    ) -> Result<(), crate::StorageError> {
        let stamp = Stamp::now();
        let mut payload = Vec::with_capacity(d.line().len() + last_error.len() + 160);
        payload.extend_from_slice(b"{\"original\":");
        payload.extend_from_slice(d.line());
        payload.extend_from_slice(format!(",\"retries\":{retries},\"last_error\":").as_bytes());
        envelope::push_json_str(&mut payload, last_error);
        payload.extend_from_slice(b",\"failed_at\":");
        envelope::push_json_str(&mut payload, stamp.ts());
        // Beyond 1.4: why (rejected at once, or retries exhausted), handler
        // calls made, and where the original was.
        let reason = if rejected {
            "rejected"
        } else {
            "retries_exhausted"
        };
        let attempts = retries + 1;
        payload.extend_from_slice(
            format!(",\"reason\":\"{reason}\",\"attempts\":{attempts},\"channel\":").as_bytes(),
        );
        envelope::push_json_str(&mut payload, &self.channel);
        payload.extend_from_slice(format!(",\"offset\":{}", d.offset).as_bytes());
        payload.push(b'}');
        let origin = &d.envelope().origin;
        let line = self.dead_letter_line(&stamp, origin, &payload);
        if line.len() <= envelope::MAX_RECORD_BYTES {
            return self.dead_letters.append(&line, 1).map(|_| ());
        }
        // The original, with the dead letter's fields around it, is over the
        // record limit (no reader would read it): the original is copied whole
        // to the quarantine directory first, and the dead letter says where.
        let data_dir = channel_data_dir(self.writer.dir());
        quarantine::copy_aside(data_dir, &self.channel, d.offset, d.line()).map_err(|e| {
            crate::StorageError::Io {
                context: format!(
                    "channel {:?}: copying the original of a dead letter aside",
                    self.channel
                ),
                source: Arc::new(e),
            }
        })?;
        let copy = quarantine::quarantine_path(Path::new(""), &self.channel, d.offset);
        log::warn!(
            "channel {:?}: record {} at offset {} ({} bytes) is too large to embed in its dead \
             letter; the dead letter names its copy in {}",
            self.channel,
            d.envelope().id,
            d.offset,
            d.line().len(),
            copy.display()
        );
        let mut small = Vec::with_capacity(last_error.len() + 512);
        small.extend_from_slice(b"{\"original\":null,\"original_id\":");
        envelope::push_json_str(&mut small, &d.envelope().id);
        small.extend_from_slice(format!(",\"original_bytes\":{}", d.line().len()).as_bytes());
        small.extend_from_slice(b",\"quarantine_file\":");
        envelope::push_json_str(&mut small, &copy.to_string_lossy());
        // The fields after the original, as above.
        small.extend_from_slice(&payload[b"{\"original\":".len() + d.line().len()..]);
        let line = self.dead_letter_line(&stamp, origin, &small);
        self.dead_letters.append(&line, 1).map(|_| ())
    }

    /// The dead-letter record of `payload`, a line of the `.dead-letter` channel.
    fn dead_letter_line(&self, stamp: &Stamp, origin: &str, payload: &[u8]) -> Vec<u8> {
        let channel = dead_letter_channel(&self.channel);
        let mut line = Vec::with_capacity(payload.len() + 200);
        encode_record(
            &mut line,
            &Header {
                id: stamp.id(),
                ts: stamp.ts(),
                channel: &channel,
                origin,
                payload_type: DEAD_LETTER_PAYLOAD_TYPE,
                correlation_id: None,
                service_name: None,
            },
            payload,
        );
        line
    }

    fn append_dead_letter(
        &self,
        stamp: &Stamp,
        origin: &str,
        payload: &[u8],
    ) -> Result<(), crate::StorageError> {
        let line = self.dead_letter_line(stamp, origin, payload);
        self.dead_letters.append(&line, 1).map(|_| ())
    }

    /// Quarantines the unreadable record `bytes` at `offset` and, unless
    /// this is a dead-letter channel, dead-letters it: `original` is null
    /// and `unreadable` holds its text (at most [`UNREADABLE_TEXT_BYTES`];
    /// the whole record is in `quarantine_file`, relative to the data
    /// directory).
    fn unreadable(
        &self,
        offset: u64,
        bytes: &[u8],
        origin: Option<&str>,
        reason: &str,
    ) -> Result<(), crate::StorageError> {
        let data_dir = channel_data_dir(self.writer.dir());
        quarantine(data_dir, &self.channel, offset, bytes, reason);
        if self.channel.ends_with(DEAD_LETTER_SUFFIX) {
            return Ok(());
        }
        let stamp = Stamp::now();
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(UNREADABLE_TEXT_BYTES)]);
        let copy = quarantine::quarantine_path(Path::new(""), &self.channel, offset);
        let mut payload = Vec::with_capacity(text.len() + reason.len() + 256);
        payload.extend_from_slice(b"{\"original\":null,\"unreadable\":");
        envelope::push_json_str(&mut payload, &text);
        payload.extend_from_slice(format!(",\"offset\":{offset},\"quarantine_file\":").as_bytes());
        envelope::push_json_str(&mut payload, &copy.to_string_lossy());
        payload.extend_from_slice(b",\"retries\":0,\"last_error\":");
        envelope::push_json_str(&mut payload, reason);
        payload.extend_from_slice(b",\"failed_at\":");
        envelope::push_json_str(&mut payload, stamp.ts());
        payload.push(b'}');
        self.append_dead_letter(&stamp, origin.unwrap_or(""), &payload)
    }

    /// Dead-letters the line of `len` bytes (with its line feed) at `offset`
    /// of the segment starting at `segment`, over the record limit (1.4
    /// writers do not bound what they append): its copy in the quarantine
    /// directory (made here if the reader could not) is named by the dead
    /// letter (`original` null, `original_bytes`, `quarantine_file`), as for
    /// an unreadable record. A dead-letter channel's are only quarantined.
    fn oversize(&self, offset: u64, segment: u64, len: u64) -> Result<(), crate::StorageError> {
        if self.channel.ends_with(DEAD_LETTER_SUFFIX) {
            return Ok(());
        }
        let data_dir = channel_data_dir(self.writer.dir());
        let src = quarantine::Source::Range {
            segment: &segment::segment_path(self.writer.dir(), segment),
            at: offset - segment,
            len: len - 1,
        };
        quarantine::copy_from(data_dir, &self.channel, offset, &src).map_err(|e| {
            crate::StorageError::Io {
                context: format!(
                    "channel {:?}: copying the oversized record at offset {offset} aside",
                    self.channel
                ),
                source: Arc::new(e),
            }
        })?;
        let stamp = Stamp::now();
        let copy = quarantine::quarantine_path(Path::new(""), &self.channel, offset);
        let mut payload = Vec::with_capacity(256);
        payload.extend_from_slice(
            format!(
                "{{\"original\":null,\"original_bytes\":{},\"offset\":{offset}",
                len - 1
            )
            .as_bytes(),
        );
        payload.extend_from_slice(b",\"quarantine_file\":");
        envelope::push_json_str(&mut payload, &copy.to_string_lossy());
        payload.extend_from_slice(b",\"retries\":0,\"last_error\":");
        let why = format!(
            "a {}-byte record is over the record limit ({})",
            len - 1,
            envelope::MAX_RECORD_BYTES
        );
        envelope::push_json_str(&mut payload, &why);
        payload.extend_from_slice(b",\"failed_at\":");
        envelope::push_json_str(&mut payload, stamp.ts());
        payload.push(b'}');
        self.append_dead_letter(&stamp, "", &payload)
    }

    /// Writes the acknowledged offset if it moved and the flush interval
    /// allows (always when `force`). After a failed write the next one waits
    /// for its backoff ([`OffsetFailures`]) unless forced.
    fn flush_offset(&mut self, force: bool) {
        if self.acked == self.persisted || self.abandoned.load(Ordering::Acquire) {
            return;
        }
        if !force
            && (self.last_flush.elapsed() < self.opts.offset_flush_interval
                || self.offset_failures.until_retry().is_some())
        {
            return;
        }
        match write_offset(&self.offset_path, self.acked) {
            Ok(()) => {
                self.persisted = self.acked;
                self.last_flush = Instant::now();
                if let Some(failed) = self.offset_failures.succeeded() {
                    log::info!(
                        "channel {:?}: subscriber {:?}: offset written again, after {failed} \
                         failed attempts",
                        self.channel,
                        self.id
                    );
                }
            }
            Err(e) => {
                // A forced write (close, seek) that fails is always logged.
                let held = self.offset_failures.failed();
                if let Some(held) = held.or(force.then_some(crate::lograte::Held(0))) {
                    log::error!(
                        "channel {:?}: subscriber {:?}: cannot write offset {}: {e}; \
                         delivery goes on and the write is retried, every {} s at most \
                         (a restart before it succeeds delivers the messages since the \
                         last offset written again){held}",
                        self.channel,
                        self.id,
                        self.offset_path.display(),
                        OFFSET_RETRY_MAX.as_secs()
                    );
                }
            }
        }
    }
}

/// First wait before an offset write that failed is tried again; doubled
/// up to [`OFFSET_RETRY_MAX`].
const OFFSET_RETRY_MIN: Duration = Duration::from_millis(50);
/// Longest wait between attempts to write an offset.
const OFFSET_RETRY_MAX: Duration = Duration::from_secs(5);
/// A subscriber's failing offset writes are logged at most this often.
const OFFSET_LOG_EVERY: Duration = Duration::from_secs(30);

/// Failed offset writes in a row: when to try again, and when the failure
/// was last logged (a full disk must not make a worker spin, nor flood a
/// log that may well be on the same disk).
#[derive(Default)]
struct OffsetFailures {
    count: u32,
    retry_at: Option<Instant>,
    logged_at: Option<Instant>,
    held: u64,
}

impl OffsetFailures {
    /// Time left before the next attempt, if one failed.
    fn until_retry(&self) -> Option<Duration> {
        let left = self.retry_at?.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// Counts a failure and sets the next attempt; `Some(held)` when this one
    /// is to be logged, `held` being the ones not logged since the last.
    fn failed(&mut self) -> Option<crate::lograte::Held> {
        self.count = self.count.saturating_add(1);
        let delay = OFFSET_RETRY_MIN
            .saturating_mul(1 << (self.count - 1).min(10))
            .min(OFFSET_RETRY_MAX);
        let now = Instant::now();
        self.retry_at = Some(now + delay);
        if self
            .logged_at
            .is_some_and(|at| now.duration_since(at) < OFFSET_LOG_EVERY)
        {
            self.held += 1;
            return None;
        }
        self.logged_at = Some(now);
        Some(crate::lograte::Held(std::mem::take(&mut self.held)))
    }

    /// Forgets the failures; how many there were, if any.
    fn succeeded(&mut self) -> Option<u32> {
        let count = std::mem::take(self).count;
        (count > 0).then_some(count)
    }
}

/// Most bytes of an unreadable record copied into its dead letter.
pub const UNREADABLE_TEXT_BYTES: usize = 64 * 1024;

/// The data directory of a channel directory (`data_dir/channels/<channel>`).
/// Longest `last_error` a dead letter carries: a handler's message can be
/// of any size, and the dead letter must stay within the record limit.
const MAX_ERROR_BYTES: usize = 16 * 1024;

/// `error`, cut at [`MAX_ERROR_BYTES`] (on a character boundary) with a note
/// of how much was cut.
fn bounded_error(error: String) -> String {
    if error.len() <= MAX_ERROR_BYTES {
        return error;
    }
    let mut cut = MAX_ERROR_BYTES;
    while !error.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}... ({} more bytes)", &error[..cut], error.len() - cut)
}

fn channel_data_dir(dir: &Path) -> &Path {
    dir.parent().and_then(Path::parent).unwrap_or(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap() {
        let b = Duration::from_millis(100);
        let m = Duration::from_secs(5);
        let got: Vec<u128> = (1..=8)
            .map(|k| backoff_delay(b, m, k).as_millis())
            .collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(backoff_delay(b, m, 60), m);
    }
}
