//! The channel writer: the single path through which every append to a
//! channel goes, with group commit.
//!
//! why this file is long: the group commit (the batch slots, `append`,
//! `gather`, `lead`, `close`) is one lock-and-wake protocol that has to be
//! read in one place; the batch's I/O is in `writer/commit.rs`, the
//! notifier and counters in their own files.
//!
//! Callers append whole records. The first caller to find no flush in
//! progress becomes the leader: it takes every record queued at that moment,
//! writes them with one positioned write, calls `fdatasync` once (durable
//! mode), then wakes every caller of that batch. Callers arriving while a
//! flush runs queue their records for the next batch, so N concurrent
//! publishers share one fsync instead of paying N.
//!
//! Wake-ups are what limit group commit on few cores, so each batch has its
//! own wait word (a `Slot`): finishing a batch wakes only its callers, one
//! after another (each passes the wake-up on), and they read the outcome
//! without taking the writer's lock. Callers of the next batch sleep on; one
//! of them is asked to lead it if nobody else does.
//!
//! Failure contract: an `Err` from [`ChannelWriter::append`] means the
//! records were not committed; the file is truncated back to the last
//! committed byte before the error is returned (a truncation that itself
//! fails is retried before the next write). `Ok` means committed: durable in
//! durable mode, written to the file otherwise.

use std::borrow::Cow;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub use counters::{CounterSnapshot, WriterCounters};
pub use notify::CommitNotifier;
pub use submit::Ticket;

use super::fdpool::{PooledFile, NO_OWNER};
use super::segment;
use super::StorageError;

/// How a writer commits.
#[derive(Debug, Clone, Copy)]
pub struct WriterConfig {
    /// Roll to a new segment before a batch would grow the active one past
    /// this many bytes; 0 never rolls.
    pub segment_bytes: u64,
    /// `true`: fdatasync before an append returns (`sync_interval_ms: 0`).
    pub durable: bool,
}

/// Where an append landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// Global offset of the first appended byte.
    pub offset: u64,
    /// Global offset just past the last appended byte.
    pub end: u64,
}

/// Test hook: which I/O step an injected fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// The data write: `partial` bytes are really written, then ENOSPC.
    Write { partial: usize },
    /// The data write: `partial` bytes are really written, then the OS
    /// error `errno` (EIO, EROFS, ...).
    WriteErrno { partial: usize, errno: i32 },
    /// The fdatasync after a write: EIO.
    Sync,
    /// The fdatasync after a write: the OS error `errno`.
    SyncErrno { errno: i32 },
    /// The fdatasync after a write takes `ms` milliseconds longer, then
    /// succeeds (a stalled disk).
    SyncDelay { ms: u64 },
    /// Creating the next segment at a roll: ENOSPC.
    Roll,
}

struct Active {
    /// The segment file, through the descriptor pool (closed while idle).
    file: Arc<PooledFile>,
    start: u64,
    /// Committed length of the active segment.
    len: u64,
    /// A failed truncation left bytes past `len`; cut them before writing.
    tainted: bool,
    /// The segment file was unlinked or replaced under the writer: every
    /// later append fails with this error (nothing is acknowledged into a
    /// file no one can read) until the data directory is opened again.
    broken: Option<StorageError>,
    /// When the file was last checked to be the one its path names
    /// ([`commit::coarse_now`]).
    checked: Duration,
}

struct Outcome {
    batch_start: u64,
    /// Bytes of the batch, from its start, that were committed.
    committed: usize,
    error: Option<StorageError>,
}

impl Outcome {
    /// The result of the append that occupies `pos..pos + len` of the batch.
    fn result(&self, pos: usize, len: usize) -> Result<Appended, StorageError> {
        let end = pos + len;
        match &self.error {
            Some(e) if end > self.committed => Err(e.clone()),
            _ => Ok(Appended {
                offset: self.batch_start + pos as u64,
                end: self.batch_start + end as u64,
            }),
        }
    }
}

/// Called once with the result of a submitted append (see [`Ticket::on_done`]).
type Callback = Box<dyn FnOnce(Result<Appended, StorageError>) + Send>;

/// Called once per batch, after the batch's callbacks (see
/// [`Ticket::on_done_then`]).
pub type AfterBatch = Arc<dyn Fn() + Send + Sync>;

/// Completion callbacks of one batch's submitted appends.
#[derive(Default)]
struct Callbacks {
    /// `(pos, len, callback)` of each append.
    each: Vec<(usize, usize, Callback)>,
    /// Run after all of `each`, each one once however many appends it was
    /// registered with.
    after: Vec<AfterBatch>,
}

/// [`Slot::state`]: the batch is queued or in flight, nobody sleeps yet.
const PENDING: u32 = 0;
/// Queued or in flight, and callers may sleep on the word.
const SLEEPING: u32 = 1;
/// Still queued after the previous batch finished: a caller should lead it.
const LEAD: u32 = 2;
/// Finished: `outcome` is set.
const DONE: u32 = 3;

/// One batch: its outcome, and the word its callers sleep on.
#[derive(Default)]
struct Slot {
    outcome: OnceLock<Outcome>,
    state: AtomicU32,
    /// Completion callbacks of submitted appends.
    callbacks: Mutex<Callbacks>,
    has_callbacks: AtomicBool,
}

impl Slot {
    /// Marks the batch finished and wakes one of those sleeping on it; each
    /// caller woken wakes the next ([`ChannelWriter::append`]), so they come
    /// back one after another instead of all contending at once for the
    /// scheduler and the caller's own locks (the GIL).
    fn finish(&self, outcome: Outcome) {
        let _ = self.outcome.set(outcome);
        if self.state.swap(DONE, Ordering::AcqRel) != PENDING {
            atomic_wait::wake_one(&self.state);
        }
        // A callback registered from now on finds the outcome set and runs at
        // once (`Ticket::on_done` checks under the same lock).
        if self.has_callbacks.load(Ordering::Acquire) {
            let callbacks =
                std::mem::take(&mut *self.callbacks.lock().unwrap_or_else(|e| e.into_inner()));
            self.has_callbacks.store(false, Ordering::Release);
            let o = self.outcome.get().expect("set above");
            for (pos, len, callback) in callbacks.each {
                callback(o.result(pos, len));
            }
            for after in callbacks.after {
                after();
            }
        }
    }

    /// Asks one caller of this (queued) batch to lead it.
    fn request_leader(&self) {
        match self
            .state
            .compare_exchange(SLEEPING, LEAD, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => atomic_wait::wake_one(&self.state),
            Err(PENDING) => {
                let _ =
                    self.state
                        .compare_exchange(PENDING, LEAD, Ordering::AcqRel, Ordering::Acquire);
            }
            Err(_) => {}
        }
    }
}

/// The largest queue buffer a writer keeps for reuse between batches.
const SPARE_MAX_BYTES: usize = 1 << 20;

/// Owned records from this size on are moved into an empty queue, not
/// copied (smaller ones are copied into the reused buffer).
const MOVE_MIN_BYTES: usize = 64 << 10;

/// What a batch committed: its records, append calls and bytes.
#[derive(Clone, Copy, Default)]
struct Committed {
    records: u64,
    appends: u64,
    bytes: usize,
}

struct State {
    pending: Vec<u8>,
    /// (bytes, records) of each append call queued in `pending`.
    groups: Vec<(usize, u64)>,
    slot: Arc<Slot>,
    /// The slot of the last finished batch; reused for a later batch once
    /// every caller of that batch has let go of it (no allocation per batch).
    used_slot: Option<Arc<Slot>>,
    spare: Vec<u8>,
    spare_groups: Vec<(usize, u64)>,
    flushing: bool,
    /// A leader is waiting until this many append calls are queued before it
    /// flushes (see [`ChannelWriter::gather`]); 0 when none is.
    gather_want: usize,
    /// Append calls in the last batch.
    last_groups: usize,
    closed: bool,
    /// Callers blocked on `done` (closing), so a batch wakes them only then.
    waiters: usize,
    /// `pending` holds submitted appends (see [`ChannelWriter::submit`]),
    /// which only the committer thread may be counted on to lead.
    submitted: bool,
    /// `pending` holds appends submitted held, not yet released (see
    /// [`ChannelWriter::submit_held`]): since when. The committer thread
    /// commits them unasked once they have waited `held_max`.
    held_since: Option<Instant>,
    /// `submit::HELD_MAX`, shorter or longer in tests.
    held_max: Duration,
    /// The committer thread is running.
    committer: bool,
    active: Option<Active>,
    /// The active file, for the periodic fsync of relaxed mode.
    sync_file: Option<Arc<PooledFile>>,
}

/// Points the periodic fsync (`State::sync_file`) at `file`, the file just
/// written, cloning the handle only when it changed (a segment roll).
fn track_sync_file(sync_file: &mut Option<Arc<PooledFile>>, file: &Arc<PooledFile>) {
    if !sync_file.as_ref().is_some_and(|f| Arc::ptr_eq(f, file)) {
        *sync_file = Some(file.clone());
    }
}

/// The one writer of one channel directory.
pub struct ChannelWriter {
    channel: String,
    dir: PathBuf,
    cfg: WriterConfig,
    state: Mutex<State>,
    /// Signalled when a batch ends while `close` waits for it.
    done: Condvar,
    /// Signalled when enough appends are queued for a gathering leader.
    arrived: Condvar,
    /// Signalled when the committer thread has a batch to lead, or on close.
    kick: Condvar,
    /// The committer thread, once started (joined by `close`).
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Duration of the last fdatasync, in nanoseconds: bounds a gather.
    last_sync_ns: AtomicU64,
    notifier: CommitNotifier,
    counters: WriterCounters,
    unsynced: AtomicBool,
    /// Global offset up to which the channel is known to be fdatasynced.
    durable_end: AtomicU64,
    faults: Mutex<Vec<(FaultPoint, u32)>>,
    has_faults: AtomicBool,
    /// Descriptor-pool owner of the segment files (the store's).
    owner: u64,
    /// When the writer was opened: the origin of `now_paused_until`.
    opened: Instant,
    /// [`ChannelWriter::try_append_now`] declines until this many
    /// nanoseconds after `opened` (set after a slow write).
    now_paused_until: AtomicU64,
    /// Slow writes in a row taken by `try_append_now`.
    now_slow_streak: AtomicU32,
}

/// A write taken by [`ChannelWriter::try_append_now`] that took longer than
/// this is slow. The second slow write in a row pauses that path for
/// [`NOW_PAUSE`], and each further one doubles the pause (up to 64 times):
/// dirty-page throttling sleeps 10-200 ms on every write. A slow write alone
/// is left be: an ordinary write stalls now and then (the periodic fdatasync
/// of the same file, the VM's CPU taken away for a moment), and with many
/// Python threads a second on the queued path costs a GIL hand-off per
/// message (16 threads lost a third of their rate to one such pause in a
/// two-second run).
const NOW_SLOW: Duration = Duration::from_millis(10);
const NOW_PAUSE: Duration = Duration::from_secs(1);

/// How long [`ChannelWriter::try_append_now`] pauses after a slow write
/// that had `before` slow ones in a row before it: not at all after the
/// first.
fn now_pause(before: u32) -> Option<Duration> {
    let doublings = before.checked_sub(1)?.min(6);
    Some(NOW_PAUSE * (1 << doublings))
}

fn io_err(context: String, e: io::Error) -> StorageError {
    StorageError::Io {
        context,
        source: Arc::new(e),
    }
}

impl ChannelWriter {
    /// Opens the writer of `dir` (creating it and its first segment if
    /// needed) and recovers a torn tail: bytes after the last line feed of
    /// the active segment are cut away, so the next append starts a new line.
    pub fn open(
        channel: &str,
        dir: &Path,
        cfg: WriterConfig,
    ) -> Result<ChannelWriter, StorageError> {
        Self::open_owned(channel, dir, cfg, NO_OWNER)
    }

    /// [`ChannelWriter::open`] with segment files belonging to the
    /// descriptor-pool owner `owner` (see [`super::fdpool`]).
    pub fn open_owned(
        channel: &str,
        dir: &Path,
        cfg: WriterConfig,
        owner: u64,
    ) -> Result<ChannelWriter, StorageError> {
        let ctx = |what: &str| format!("channel {channel:?}: {what} in {}", dir.display());
        segment::create_dir_all(dir).map_err(|e| io_err(ctx("cannot create directory"), e))?;
        // `create_dir_all` syncs what it creates; this also covers a channel
        // directory made by someone who did not (1.4 never syncs directories).
        if let Some(parent) = dir.parent() {
            segment::sync_dir(parent)
                .map_err(|e| io_err(ctx("cannot sync parent directory"), e))?;
        }
        let segs =
            segment::list_segments(dir).map_err(|e| io_err(ctx("cannot list segments"), e))?;
        let pooled = |path: &Path, file: File| {
            PooledFile::adopt(path, file, true, owner)
                .map(Arc::new)
                .map_err(|e| io_err(ctx("cannot keep the active segment open"), e))
        };
        let active = match segs.last() {
            None => Active {
                file: pooled(
                    &segment::segment_path(dir, 0),
                    segment::create_segment(dir, 0)
                        .map_err(|e| io_err(ctx("cannot create first segment"), e))?,
                )?,
                start: 0,
                len: 0,
                tainted: false,
                broken: None,
                checked: commit::coarse_now(),
            },
            Some(&start) => {
                let path = segment::segment_path(dir, start);
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| io_err(ctx("cannot open active segment"), e))?;
                let good = segment::repair_tail(&file, &path)
                    .map_err(|e| io_err(ctx("cannot repair the active segment's tail"), e))?;
                Active {
                    file: pooled(&path, file)?,
                    start,
                    len: good,
                    tainted: false,
                    broken: None,
                    checked: commit::coarse_now(),
                }
            }
        };
        let notifier = CommitNotifier::default();
        let end_at_open = active.start + active.len;
        notifier.end.store(end_at_open, Ordering::Release);
        Ok(ChannelWriter {
            channel: channel.to_owned(),
            dir: dir.to_owned(),
            cfg,
            state: Mutex::new(State {
                pending: Vec::new(),
                groups: Vec::new(),
                slot: Arc::default(),
                used_slot: None,
                spare: Vec::new(),
                spare_groups: Vec::new(),
                flushing: false,
                gather_want: 0,
                last_groups: 0,
                closed: false,
                waiters: 0,
                submitted: false,
                held_since: None,
                held_max: submit::HELD_MAX,
                committer: false,
                sync_file: Some(active.file.clone()),
                active: Some(active),
            }),
            done: Condvar::new(),
            arrived: Condvar::new(),
            kick: Condvar::new(),
            committer: Mutex::new(None),
            last_sync_ns: AtomicU64::new(0),
            notifier,
            counters: WriterCounters::default(),
            unsynced: AtomicBool::new(false),
            durable_end: AtomicU64::new(end_at_open),
            faults: Mutex::new(Vec::new()),
            has_faults: AtomicBool::new(false),
            owner,
            opened: Instant::now(),
            now_paused_until: AtomicU64::new(0),
            now_slow_streak: AtomicU32::new(0),
        })
    }

    /// The channel this writer appends to.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// The channel's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Readers wait on this for new commits.
    pub fn notifier(&self) -> &CommitNotifier {
        &self.notifier
    }

    /// Global offset up to which the channel is committed.
    pub fn committed_end(&self) -> u64 {
        self.notifier.committed_end()
    }

    /// Counters since open.
    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends `records` (`count` whole newline-terminated records, from one
    /// caller) and returns once they are committed. They are written
    /// contiguously and never split across segments. Owned records of at
    /// least `MOVE_MIN_BYTES` that find the queue empty become the queue,
    /// uncopied; others are copied into it.
    pub fn append<'a>(
        &self,
        records: impl Into<Cow<'a, [u8]>>,
        count: u64,
    ) -> Result<Appended, StorageError> {
        let records = records.into();
        let len = records.len();
        let (st, pos, slot) = self.enqueue(records, count)?;
        if st.flushing {
            drop(st);
        } else {
            self.lead(st);
        }
        let mut slept = false;
        loop {
            match slot.state.load(Ordering::Acquire) {
                DONE => {
                    if slept {
                        // Pass the wake-up on (see `Slot::finish`). A caller
                        // that sleeps after this finds DONE and returns.
                        atomic_wait::wake_one(&slot.state);
                    }
                    break;
                }
                PENDING => {
                    let _ = slot.state.compare_exchange(
                        PENDING,
                        SLEEPING,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                LEAD => {
                    if slot
                        .state
                        .compare_exchange(LEAD, SLEEPING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        // Still queued and nobody flushing: this caller leads.
                        let st = self.lock();
                        if !st.flushing && slot.outcome.get().is_none() {
                            self.lead(st);
                        }
                    }
                }
                _ => {
                    atomic_wait::wait(&slot.state, SLEEPING);
                    slept = true;
                }
            }
        }
        slot.outcome
            .get()
            .expect("a finished batch has its outcome")
            .result(pos, len)
    }

    /// Relaxed mode: appends `records` as [`ChannelWriter::append`] does, but
    /// only if that needs no wait on another thread and no I/O beyond the
    /// write itself (and the periodic identity check, a `stat`): the
    /// writer's lock is free, nobody else is appending or flushing, no
    /// segment roll or cut-back is due, and writes taken this way have been
    /// fast. `None` means nothing was done; call `append`. `started` is the
    /// caller's clock reading from just before; the time since then is
    /// returned with the result (one clock reading serves both).
    ///
    /// For callers that hold a lock of their own which others wait for (the
    /// GIL) and must not hold it across a wait: a write into the page cache
    /// is a copy, but two in a row that stall past 10 ms (dirty-page
    /// throttling) turn this path off for a while, so a slow disk costs the
    /// held lock rarely, not per append.
    pub fn try_append_now(
        &self,
        records: &[u8],
        count: u64,
        started: Instant,
    ) -> Option<(Result<Appended, StorageError>, Duration)> {
        let since_open = |t: Instant| t.duration_since(self.opened).as_nanos() as u64;
        if since_open(started) < self.now_paused_until.load(Ordering::Relaxed) {
            return None;
        }
        let result = self.append_if_idle(records, count)?;
        let took = started.elapsed();
        if took > NOW_SLOW {
            // Each slow write in a row after the first doubles the pause, so
            // a disk that stays slow costs a held lock ever more rarely.
            // Saturating: a streak that long stays at its longest pause.
            let before = self
                .now_slow_streak
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_add(1))
                })
                .unwrap_or_else(|n| n);
            if let Some(pause) = now_pause(before) {
                let until = since_open(started + took + pause);
                self.now_paused_until.store(until, Ordering::Relaxed);
            }
        } else if self.now_slow_streak.load(Ordering::Relaxed) != 0 {
            self.now_slow_streak.store(0, Ordering::Relaxed);
        }
        Some((result, took))
    }

    /// Relaxed mode: appends `records` here and now if the writer is idle,
    /// as [`ChannelWriter::try_append_now`] does, but for a caller that holds
    /// no lock others wait for (a hub storing a received batch from its
    /// own buffer): its writes neither consult nor feed that path's
    /// slow-write pause. `None` means nothing was done; call `append`.
    pub fn append_if_idle(
        &self,
        records: &[u8],
        count: u64,
    ) -> Option<Result<Appended, StorageError>> {
        debug_assert!(records.ends_with(b"\n"));
        if self.cfg.durable || self.has_faults.load(Ordering::Relaxed) {
            return None;
        }
        let mut guard = self.state.try_lock().ok()?;
        let st = &mut *guard;
        if st.closed || st.flushing || !st.groups.is_empty() || st.waiters > 0 {
            return None;
        }
        let limit = self.cfg.segment_bytes;
        let active = st.active.as_mut()?;
        if active.tainted
            || active.broken.is_some()
            || (limit > 0 && active.len > 0 && active.len + records.len() as u64 > limit)
        {
            return None;
        }
        // Nothing is queued or in flight, and the lock keeps it so: this
        // append is a batch of its own, written here rather than through a
        // queue and a slot as `lead` would.
        let offset = active.start + active.len;
        let written = self.commit_run(active, records, false);
        let end = active.start + active.len;
        track_sync_file(&mut st.sync_file, &active.file);
        let done = written.is_ok();
        let committed = match done {
            true => Committed {
                records: count,
                appends: 1,
                bytes: records.len(),
            },
            false => Committed::default(),
        };
        self.count_batch(committed, !done);
        drop(guard);
        if done {
            self.notifier.publish(end);
        }
        Some(written.map(|()| Appended {
            offset,
            end: offset + records.len() as u64,
        }))
    }

    /// Counts one finished batch: what it committed, and whether an error
    /// stopped it.
    fn count_batch(&self, done: Committed, failed: bool) {
        let Committed {
            records,
            appends,
            bytes,
        } = done;
        let c = &self.counters;
        c.batches.fetch_add(1, Ordering::Relaxed);
        c.records.fetch_add(records, Ordering::Relaxed);
        c.appends.fetch_add(appends, Ordering::Relaxed);
        c.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if failed {
            c.failures.fetch_add(1, Ordering::Relaxed);
        }
        if bytes > 0 && !self.cfg.durable {
            self.unsynced.store(true, Ordering::Release);
        }
    }

    /// Queues `records` for the next batch (the state's lock held): their
    /// place in it and the batch's slot. Refused once the writer is closed.
    fn enqueue(
        &self,
        records: Cow<'_, [u8]>,
        count: u64,
    ) -> Result<(MutexGuard<'_, State>, usize, Arc<Slot>), StorageError> {
        debug_assert!(records.ends_with(b"\n"));
        let mut st = self.lock();
        if st.closed {
            return Err(StorageError::Closed(self.channel.clone()));
        }
        let pos = st.pending.len();
        let len = records.len();
        match records {
            // A large batch (a Spark chunk, a federated group) is moved in
            // rather than copied: the copy would also fault in fresh pages.
            Cow::Owned(owned) if pos == 0 && owned.len() >= MOVE_MIN_BYTES => {
                let emptied = std::mem::replace(&mut st.pending, owned);
                if st.spare.capacity() < emptied.capacity() && emptied.capacity() <= SPARE_MAX_BYTES
                {
                    st.spare = emptied;
                }
            }
            records => st.pending.extend_from_slice(&records),
        }
        st.groups.push((len, count));
        if st.gather_want > 0 && st.groups.len() >= st.gather_want {
            self.arrived.notify_one();
        }
        let slot = st.slot.clone();
        Ok((st, pos, slot))
    }

    /// Durable mode with concurrent publishers: before flushing, waits until
    /// as many append calls are queued as the last batch had (its callers
    /// come back one by one, each needing the GIL), for at most one
    /// fdatasync's duration (and 2 ms). Without this the first caller back
    /// would flush alone and the others would wait for the next fdatasync,
    /// halving the records per fdatasync. A lone publisher never waits, nor
    /// does the committer thread ([`ChannelWriter::lead_as`]).
    fn gather<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let want = st.last_groups;
        if !self.cfg.durable || want < 2 || st.groups.len() >= want {
            return st;
        }
        let window = Duration::from_nanos(self.last_sync_ns.load(Ordering::Relaxed))
            .min(Duration::from_millis(2));
        let deadline = Instant::now() + window;
        st.gather_want = want;
        while st.groups.len() < want && !st.closed {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = self
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st.gather_want = 0;
        st
    }

    /// Runs one batch as leader: everything queued right now. Wakes the
    /// batch's callers when it ends, and asks a caller of the next batch to
    /// lead that one.
    fn lead<'a>(&'a self, st: MutexGuard<'a, State>) {
        self.lead_as(st, true)
    }

    /// [`ChannelWriter::lead`], with `gather` false for the committer thread:
    /// what it commits was submitted by callers that do not block (one
    /// thread pipelining, or asyncio tasks of one event loop, submitting one
    /// after another), so waiting for them would only put their submitting
    /// after the fdatasync instead of beside it. It commits what is queued at
    /// once, and the next batch fills while this one syncs.
    fn lead_as<'a>(&'a self, mut st: MutexGuard<'a, State>, gather: bool) {
        st.flushing = true;
        if gather {
            st = self.gather(st);
        }
        let spare = std::mem::take(&mut st.spare);
        let spare_groups = std::mem::take(&mut st.spare_groups);
        let buf = std::mem::replace(&mut st.pending, spare);
        let groups = std::mem::replace(&mut st.groups, spare_groups);
        let next = Self::fresh_slot(&mut st);
        let slot = std::mem::replace(&mut st.slot, next);
        st.submitted = false;
        st.held_since = None;
        let Some(mut active) = st.active.take() else {
            // Closed: the segment file is released; nothing is written.
            st.flushing = false;
            drop(st);
            slot.finish(Outcome {
                batch_start: 0,
                committed: 0,
                error: Some(StorageError::Closed(self.channel.clone())),
            });
            return;
        };
        st.last_groups = groups.len();
        drop(st);

        let batch_start = active.start + active.len;
        let (committed, error) = self.flush(&mut active, &buf, &groups);
        let mut records = 0;
        let mut done_groups = 0;
        let mut acc = 0;
        for &(len, n) in &groups {
            acc += len;
            if acc > committed {
                break;
            }
            records += n;
            done_groups += 1;
        }
        let done = Committed {
            records,
            appends: done_groups,
            bytes: committed,
        };
        self.count_batch(done, error.is_some());
        let end = active.start + active.len;

        let mut st = self.lock();
        track_sync_file(&mut st.sync_file, &active.file);
        st.active = Some(active);
        let (mut buf, mut groups) = (buf, groups);
        buf.clear();
        groups.clear();
        // Keep a moderately sized buffer for reuse; drop huge ones.
        if buf.capacity() <= SPARE_MAX_BYTES {
            st.spare = buf;
        }
        st.spare_groups = groups;
        st.flushing = false;
        let next = (!st.groups.is_empty()).then(|| st.slot.clone());
        st.used_slot = Some(slot.clone());
        if st.waiters > 0 {
            self.done.notify_all();
        }
        if st.submitted {
            self.kick.notify_one();
        }
        drop(st);
        // Readers learn of the commit before its callers return, so a
        // caller reads its own record at once (read-your-writes).
        self.notifier.publish(end);
        slot.finish(Outcome {
            batch_start,
            committed,
            error,
        });
        if let Some(next) = next {
            next.request_leader();
        }
    }

    /// A slot for the next batch: the last finished one when nobody holds it
    /// any more (no allocation per batch), else a new one.
    fn fresh_slot(st: &mut State) -> Arc<Slot> {
        if let Some(mut used) = st.used_slot.take() {
            if let Some(free) = Arc::get_mut(&mut used) {
                free.outcome.take();
                *free.state.get_mut() = PENDING;
                return used;
            }
        }
        Arc::default()
    }

    fn take_fault(&self, want: fn(&FaultPoint) -> bool) -> Option<FaultPoint> {
        if !self.has_faults.load(Ordering::Relaxed) {
            return None;
        }
        let mut faults = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        let i = faults.iter().position(|(p, _)| want(p))?;
        let point = faults[i].0;
        faults[i].1 -= 1;
        if faults[i].1 == 0 {
            faults.remove(i);
        }
        if faults.is_empty() {
            self.has_faults.store(false, Ordering::Relaxed);
        }
        Some(point)
    }

    /// Test hook: make the next `count` I/O steps of kind `point` fail.
    #[doc(hidden)]
    pub fn inject_fault(&self, point: FaultPoint, count: u32) {
        if count == 0 {
            return;
        }
        self.faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((point, count));
        self.has_faults.store(true, Ordering::Relaxed);
    }

    /// Relaxed mode: fdatasync the active segment if anything was written
    /// since the last sync. Errors are logged, as nothing waits on them.
    pub fn sync_if_dirty(&self) {
        if let Err(e) = self.sync_once() {
            log::error!("channel {:?}: periodic fdatasync failed: {e}", self.channel);
        }
    }

    /// One relaxed-mode sync of what was written since the last one.
    fn sync_once(&self) -> io::Result<()> {
        if !self.unsynced.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let (file, end) = {
            let st = self.lock();
            (st.sync_file.clone(), self.committed_end())
        };
        let Some(file) = file else {
            return Ok(()); // closed: the last sync was done then
        };
        match file.get().and_then(|f| self.sync(&f)) {
            Ok(()) => {
                self.durable_end.fetch_max(end, Ordering::AcqRel);
                Ok(())
            }
            Err(e) => {
                self.unsynced.store(true, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Makes everything committed so far durable: in relaxed mode fdatasyncs
    /// now (or waits for the periodic sync already under way); in durable
    /// mode every commit already was. A failed fdatasync is returned.
    pub fn sync_committed(&self) -> io::Result<()> {
        if self.cfg.durable {
            return Ok(());
        }
        let target = self.committed_end();
        // Bounded: a periodic sync in progress ends within one fdatasync.
        for _ in 0..30_000 {
            self.sync_once()?;
            if self.durable_end.load(Ordering::Acquire) >= target || self.lock().sync_file.is_none()
            {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("channel {:?}: fdatasync did not complete", self.channel),
        ))
    }

    /// Test hook: a power loss. Stops the writer and cuts the active segment
    /// back to what was fdatasynced, keeping the first `torn` lost bytes (a
    /// torn write). Returns the durable end. The writer is closed afterwards.
    #[doc(hidden)]
    pub fn simulate_power_loss(&self, torn: usize) -> io::Result<u64> {
        let mut st = self.lock();
        st.closed = true;
        while st.flushing {
            st.waiters += 1;
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiters -= 1;
        }
        let durable = self.durable_end.load(Ordering::Acquire);
        if let Some(active) = st.active.as_mut() {
            let keep = durable.saturating_sub(active.start).min(active.len);
            let lost = (active.len - keep) as usize;
            let mut tail = vec![0u8; torn.min(lost)];
            let file = active.file.get()?;
            file.read_exact_at(&mut tail, keep)?;
            file.set_len(keep)?;
            file.write_all_at(&tail, keep)?;
            active.len = keep;
        }
        self.unsynced.store(false, Ordering::Release);
        drop(st);
        self.notifier.close();
        Ok(durable)
    }

    /// Stops accepting appends, commits the batch in flight and what is
    /// queued behind it, and syncs. Idempotent.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        self.arrived.notify_all();
        self.kick.notify_all();
        loop {
            while st.flushing {
                st.waiters += 1;
                st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
                st.waiters -= 1;
            }
            if st.pending.is_empty() {
                break;
            }
            // Close flushes: what was queued before it (blocking appends and
            // submits alike) is committed, or fails with the commit's error.
            self.lead(st);
            st = self.lock();
        }
        drop(st);
        self.sync_if_dirty();
        // Release the segment file now, not when the last holder of this
        // writer lets go of it.
        let released = {
            let mut st = self.lock();
            st.sync_file = None;
            st.active.take()
        };
        drop(released);
        self.notifier.close();
        self.join_committer();
    }
}

mod commit;
mod counters;
mod notify;
mod submit;
#[cfg(test)]
mod tests;
