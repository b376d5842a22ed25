// why this file is long: the Engine facade (publish with or without caller-given ids,
// read, subscribe, stats, federation), each entry point short; splitting it scatters the API.
//! The messenger engine: a data directory plus an instance name, publishing
//! envelopes through the channel writers.
//! why this file is long: it is the engine's whole public surface, each a short
//! method delegating to storage, subscribe or federation.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::dedup::SeenIds;
use crate::envelope::{
    self, encode_record, validate_name, Header, NameKind, Stamp, MAX_RECORD_BYTES,
};
use crate::federation::{FedConfig, Federation};
use crate::fork::Owner;
use crate::lograte::RateLimit;
use crate::stats::{ChannelSnapshot, EngineStats, SubscriberSnapshot};
use crate::storage::compaction::{self, CompactionReport, RetentionConfig};
use crate::storage::offsets::{offset_path, read_offset, subscribers_dir};
use crate::storage::timeindex::{self, PositionError, SeekCost, StartPosition};
use crate::storage::{
    AfterBatch, Appended, ChannelWriter, LogReader, StorageError, Store, StoreConfig, Ticket,
};
use crate::subscribe::{Handler, Stop, SubscribeOptions, Subscriber, Wiring};
use crate::Error;

/// How long [`Engine::close`] waits for handlers still running.
pub const DEFAULT_CLOSE_TIMEOUT: Duration = crate::subscribe::DEFAULT_STOP_TIMEOUT;

/// One message to publish; the payload is already compact JSON.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub payload_type: &'a str,
    pub payload_json: &'a [u8],
    pub service_name: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
}

/// Result of a publish: the message id and where its record starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub id: String,
    pub offset: u64,
}

/// A publish handed to its channel's committer thread ([`Engine::submit`]):
/// its id at once, its outcome later. Dropping it does not cancel it.
pub struct Submitted {
    /// The message id.
    pub id: String,
    ticket: Ticket,
}

impl Submitted {
    fn published(
        &self,
        r: Result<crate::storage::Appended, StorageError>,
    ) -> Result<Published, Error> {
        r.map(|at| Published {
            id: self.id.clone(),
            offset: at.offset,
        })
        .map_err(Error::from)
    }

    /// Whether the outcome is known.
    pub fn is_done(&self) -> bool {
        self.ticket.is_done()
    }

    /// Starts the commit of a message from [`Engine::submit_held`], and of
    /// every message held on its channel; harmless for any other.
    pub fn release(&self) {
        self.ticket.release();
    }

    /// The channel the message was submitted to.
    pub fn channel(&self) -> &str {
        self.ticket.channel()
    }

    /// Waits at most `timeout`; `None` if the outcome is not known by then.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<Published, Error>> {
        self.ticket.wait_timeout(timeout).map(|r| self.published(r))
    }

    /// Waits for the outcome: `Ok` once committed, as [`Engine::publish`].
    pub fn wait(&self) -> Result<Published, Error> {
        self.published(self.ticket.wait())
    }

    /// Calls `callback` with the outcome, on the thread that commits the
    /// batch (or at once if it is known).
    pub fn on_done(&self, callback: impl FnOnce(Result<Published, Error>) + Send + 'static) {
        self.ticket.on_done(self.outcome_to(callback));
    }

    /// [`Submitted::on_done`], then `after` once per batch, when all the
    /// batch's callbacks have run (see [`Ticket::on_done_then`]).
    pub fn on_done_then(
        &self,
        callback: impl FnOnce(Result<Published, Error>) + Send + 'static,
        after: &AfterBatch,
    ) {
        self.ticket.on_done_then(self.outcome_to(callback), after);
    }

    /// `callback`, taking a commit's outcome as this message's.
    fn outcome_to(
        &self,
        callback: impl FnOnce(Result<Published, Error>) + Send + 'static,
    ) -> impl FnOnce(Result<Appended, StorageError>) + Send + 'static {
        let id = self.id.clone();
        move |r| {
            callback(
                r.map(|at| Published {
                    id,
                    offset: at.offset,
                })
                .map_err(Error::from),
            )
        }
    }
}

/// The ids of a batch, each with its record's offset in the batch.
pub type Ids = Vec<(String, u64)>;

/// Records framed for one channel by one origin, ready to append: ids,
/// timestamps and the valid-record checks are fixed when framed
/// ([`frame_batch`]), so framing can run before the data directory is open
/// (a Spark task frames while another holds the directory lock).
pub struct Framed {
    origin: String,
    channel: String,
    buf: Vec<u8>,
    ids: FramedIds,
}

impl Framed {
    /// The channel the records were framed for.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// The ids of the records, in order.
    pub fn ids(&self) -> &FramedIds {
        &self.ids
    }
}

/// The ids of framed records: listed ([`frame_batch`]), or numbered
/// `<prefix><first + i>` ([`frame_rows`], which then makes no string per
/// record).
#[derive(Debug)]
pub enum FramedIds {
    Listed(Ids),
    Numbered {
        prefix: String,
        first: u64,
        count: usize,
    },
}

impl FramedIds {
    /// How many records.
    pub fn len(&self) -> usize {
        match self {
            FramedIds::Listed(ids) => ids.len(),
            FramedIds::Numbered { count, .. } => *count,
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id of record `i` (None past the end).
    pub fn get(&self, i: usize) -> Option<String> {
        match self {
            FramedIds::Listed(ids) => ids.get(i).map(|(id, _)| id.clone()),
            FramedIds::Numbered {
                prefix,
                first,
                count,
            } => (i < *count).then(|| numbered_id(prefix, first + i as u64)),
        }
    }

    /// The first record's id.
    pub fn first(&self) -> Option<String> {
        self.get(0)
    }

    /// The last record's id.
    pub fn last(&self) -> Option<String> {
        self.len().checked_sub(1).and_then(|i| self.get(i))
    }

    /// Every id, in order.
    pub fn to_vec(&self) -> Vec<String> {
        (0..self.len()).filter_map(|i| self.get(i)).collect()
    }

    /// Every id, in order, borrowed where they are listed.
    pub fn iter(&self) -> impl Iterator<Item = Cow<'_, str>> {
        (0..self.len()).filter_map(move |i| match self {
            FramedIds::Listed(ids) => ids.get(i).map(|(id, _)| Cow::Borrowed(id.as_str())),
            FramedIds::Numbered { .. } => self.get(i).map(Cow::Owned),
        })
    }
}

/// `<prefix><n>`.
fn numbered_id(prefix: &str, n: u64) -> String {
    let mut id = String::with_capacity(prefix.len() + 20);
    id.push_str(prefix);
    id.push_str(itoa::Buffer::new().format(n));
    id
}

/// Frames `items` for `channel` as published by `origin` ([`encode_message_with_id`]
/// each: new or `given` ids, the current time); all or none.
pub fn frame_batch(
    origin: &str,
    channel: &str,
    items: &[Outgoing<'_>],
    given: Option<&[String]>,
) -> Result<Framed, Error> {
    validate_name(NameKind::PublishChannel, channel)?;
    if let Some(given) = given {
        if given.len() != items.len() {
            return Err(Error::InvalidRecord(envelope::RecordError::Field {
                field: "id",
                value: format!("{} ids", given.len()),
                reason: format!("one id per message is needed ({} messages)", items.len()),
            }));
        }
    }
    let mut buf = Vec::with_capacity(items.iter().map(|m| 200 + m.payload_json.len()).sum());
    let mut ids = Vec::with_capacity(items.len());
    // Given ids need no new ones: one clock reading stamps the whole batch.
    let ts = given.map(|_| envelope::ts_now());
    for (i, m) in items.iter().enumerate() {
        let start = buf.len();
        let id = match (given, &ts) {
            (Some(g), Some(ts)) => {
                encode_message_at(&mut buf, origin, channel, m, &g[i], ts.as_str())?
            }
            _ => encode_message_with_id(&mut buf, origin, channel, m, None)?,
        };
        ids.push((id, start as u64));
    }
    Ok(Framed {
        origin: origin.to_owned(),
        channel: channel.to_owned(),
        buf,
        ids: FramedIds::Listed(ids),
    })
}

/// Each id of a batch with its record's global offset, the batch starting
/// at `offset`.
pub fn placed(ids: Ids, offset: u64) -> Vec<Published> {
    ids.into_iter()
        .map(|(id, rel)| Published {
            id,
            offset: offset + rel,
        })
        .collect()
}

/// Frames `rows` records that differ only in id (`<id_prefix><first_row + i>`)
/// and payload, with one timestamp for all; `payload(row, out)` writes each
/// payload straight into its record, so no list of payloads is built and
/// copied. The records and checks of [`frame_batch`] (the shared header is
/// checked once, each id and payload on its own); `m.payload_json` is not
/// used. All or none.
pub fn frame_rows(
    origin: &str,
    channel: &str,
    m: &Outgoing<'_>,
    id_prefix: &str,
    first_row: u64,
    rows: usize,
    mut payload: impl FnMut(usize, &mut Vec<u8>) -> Result<(), Error>,
) -> Result<Framed, Error> {
    validate_name(NameKind::PublishChannel, channel)?;
    let ts = envelope::ts_now();
    let mut buf = Vec::with_capacity(rows * 256);
    // `{"v":1,"id":"<prefix>` and `","ts":...,"payload":`: the same for
    // every record. Each id is the prefix and a number: checking the first
    // and the last (the longest) checks them all, and none needs escaping.
    let mut head = Vec::new();
    let mut after_id = Vec::new();
    if rows > 0 {
        let last = u64::try_from(rows - 1)
            .ok()
            .and_then(|n| first_row.checked_add(n))
            .ok_or_else(|| {
                Error::InvalidRecord(envelope::RecordError::Field {
                    field: "id",
                    value: format!("{id_prefix}{first_row}"),
                    reason: format!("{rows} rows from row {first_row} overflow the row numbers"),
                })
            })?;
        let first_id = numbered_id(id_prefix, first_row);
        envelope::validate_id(&numbered_id(id_prefix, last))?;
        let header = Header {
            id: &first_id,
            ts: ts.as_str(),
            channel,
            origin,
            payload_type: m.payload_type,
            correlation_id: m.correlation_id,
            service_name: m.service_name,
        };
        envelope::validate_header(&header, NameKind::PublishChannel)?;
        envelope::encode_record_id(&mut head, id_prefix);
        head.pop(); // the closing quote: the row number comes first
        after_id.push(b'"');
        envelope::encode_record_after_id(&mut after_id, &header);
    }
    for row in 0..rows {
        let start = buf.len();
        buf.extend_from_slice(&head);
        buf.extend_from_slice(
            itoa::Buffer::new()
                .format(first_row + row as u64)
                .as_bytes(),
        );
        buf.extend_from_slice(&after_id);
        let payload_start = buf.len();
        payload(row, &mut buf)?;
        envelope::check_payload(&buf[payload_start..])?;
        buf.extend_from_slice(envelope::RECORD_TAIL);
        let size = buf.len() - start;
        if size > MAX_RECORD_BYTES {
            return Err(Error::TooLarge {
                size,
                limit: MAX_RECORD_BYTES,
            });
        }
    }
    Ok(Framed {
        origin: origin.to_owned(),
        channel: channel.to_owned(),
        buf,
        ids: FramedIds::Numbered {
            prefix: id_prefix.to_owned(),
            first: first_row,
            count: rows,
        },
    })
}

/// A local messenger instance: storage plus identity.
pub struct Engine {
    store: Arc<Store>,
    origin: String,
    closed: AtomicBool,
    /// Set by [`Engine::stop_waiting`]: a close in progress (or to come)
    /// waits no longer for handlers.
    stop_waiting: AtomicBool,
    subscribers: Mutex<HashMap<(String, String), Arc<Subscriber>>>,
    retention: Mutex<Option<(Arc<Stop>, JoinHandle<()>)>>,
    /// Set once federation starts: the seen-id window of every federation
    /// receiver, and the channels this instance asks a hub for (every
    /// `client.hubs[].subscribe`). Ids published here on those channels are
    /// marked seen so that echoes coming back from a hub are dropped. No
    /// other channel can echo: a hub sends a client only the channels it
    /// subscribed to, and a client forwards only what it published itself.
    seen: OnceLock<Arc<SeenIds>>,
    echo_channels: OnceLock<HashSet<String>>,
    federation: Mutex<Option<Federation>>,
    gateway: Mutex<Option<crate::gateway::Gateway>>,
    stats: Arc<EngineStats>,
    /// The process that opened it: a forked child may not use it.
    owner: Owner,
}

type SubscriberKey = (String, String);

fn io_error(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| {
        Error::Storage(StorageError::Io {
            context,
            source: Arc::new(e),
        })
    }
}

impl Engine {
    /// Opens the data directory of `cfg` for the instance `origin`.
    pub fn open(cfg: StoreConfig, origin: &str) -> Result<Engine, Error> {
        if origin.is_empty() {
            return Err(Error::Config("instance name must not be empty".into()));
        }
        let owner = Owner::current();
        Ok(Engine {
            owner,
            store: Arc::new(Store::open(cfg)?),
            origin: origin.to_owned(),
            closed: AtomicBool::new(false),
            stop_waiting: AtomicBool::new(false),
            subscribers: Mutex::new(HashMap::new()),
            retention: Mutex::new(None),
            seen: OnceLock::new(),
            echo_channels: OnceLock::new(),
            federation: Mutex::new(None),
            gateway: Mutex::new(None),
            stats: Arc::new(EngineStats::default()),
        })
    }

    /// The instance name written as `origin`.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The underlying store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// `Err(Error::Forked)` in a process forked after this engine was opened.
    pub fn check_process(&self) -> Result<(), Error> {
        self.owner.check("messenger")
    }

    /// Whether the caller runs in a process forked after this engine was opened.
    pub fn is_forked(&self) -> bool {
        self.owner.is_foreign()
    }

    fn check_open(&self) -> Result<(), Error> {
        self.check_process()?;
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed("messenger is closed".into()))
        } else {
            Ok(())
        }
    }

    /// The writer of a channel callers may publish to.
    pub fn publish_writer(&self, channel: &str) -> Result<Arc<ChannelWriter>, Error> {
        self.check_open()?;
        validate_name(NameKind::PublishChannel, channel)?;
        Ok(self.store.writer(channel)?)
    }

    /// Appends one message envelope to `out` and returns its id; refuses
    /// records over the size limit.
    pub fn encode(
        &self,
        out: &mut Vec<u8>,
        channel: &str,
        m: &Outgoing<'_>,
    ) -> Result<String, Error> {
        encode_message(out, &self.origin, channel, m)
    }

    /// Publishes one message and returns once it is committed.
    pub fn publish(&self, channel: &str, m: &Outgoing<'_>) -> Result<Published, Error> {
        self.publish_via(channel, m, |append| append())
    }

    /// [`Engine::publish`], with `wait` running the part that may wait on
    /// another thread or the disk: opening the channel and appending. When
    /// the append can be done at once (relaxed mode, the channel's writer
    /// open and idle: see [`ChannelWriter::try_append_now`]), it is done
    /// here and `wait` is not called. For a caller holding a lock others wait
    /// for (the GIL): `wait` lets go of it only when there is a wait, rather
    /// than around every publish, which costs a context switch per message
    /// once several threads publish.
    pub fn publish_via<W>(
        &self,
        channel: &str,
        m: &Outgoing<'_>,
        wait: W,
    ) -> Result<Published, Error>
    where
        W: FnOnce(&(dyn Fn() -> Result<Appended, Error> + Sync)) -> Result<Appended, Error>,
    {
        self.check_open()?;
        validate_name(NameKind::PublishChannel, channel)?;
        let mut line = Vec::with_capacity(200 + m.payload_json.len());
        let id = self.encode(&mut line, channel, m)?;
        let started = Instant::now();
        let now = match self.durable() {
            true => None,
            false => self
                .store
                .open_writer_now(channel)
                .and_then(|w| w.try_append_now(&line, 1, started)),
        };
        let (at, took) = match now {
            Some((done, took)) => (done?, took),
            None => {
                let at = wait(&|| Ok(self.store.writer(channel)?.append(&line, 1)?))?;
                (at, started.elapsed())
            }
        };
        self.stats.publish.record(took);
        if let Some(seen) = self.echo_window(channel) {
            seen.insert(&id);
        }
        Ok(Published {
            id,
            offset: at.offset,
        })
    }

    /// The seen-id window, if ids published on `channel` must be marked in it
    /// (see `Engine::echo_channels`).
    fn echo_window(&self, channel: &str) -> Option<&Arc<SeenIds>> {
        let channels = self.echo_channels.get()?;
        match !channels.is_empty() && channels.contains(channel) {
            true => self.seen.get(),
            false => None,
        }
    }

    /// Whether a publish is fdatasynced before it is acknowledged
    /// (`sync_interval_ms: 0`).
    pub fn durable(&self) -> bool {
        self.store.durable()
    }

    /// Hands one message to its channel's committer thread and returns at
    /// once with its id; [`Submitted`] gives the outcome. Records submitted
    /// from one thread are committed in the order submitted, and share
    /// batches (and fdatasyncs) with each other and with [`Engine::publish`].
    pub fn submit(&self, channel: &str, m: &Outgoing<'_>) -> Result<Submitted, Error> {
        self.submit_as(channel, m, false)
    }

    /// [`Engine::submit`], leaving the start of the commit to
    /// [`Submitted::release`] (see [`ChannelWriter::submit_held`]): an event
    /// loop hands over the messages of all the tasks it runs in one pass,
    /// then releases them, so they share one batch.
    pub fn submit_held(&self, channel: &str, m: &Outgoing<'_>) -> Result<Submitted, Error> {
        self.submit_as(channel, m, true)
    }

    fn submit_as(&self, channel: &str, m: &Outgoing<'_>, held: bool) -> Result<Submitted, Error> {
        let writer = self.publish_writer(channel)?;
        let mut line = Vec::with_capacity(200 + m.payload_json.len());
        let id = self.encode(&mut line, channel, m)?;
        let ticket = writer.submit_as(Cow::Borrowed(&line), 1, held)?;
        self.on_commit(&ticket, channel, || vec![id.clone()]);
        Ok(Submitted { id, ticket })
    }

    /// What a commit of submitted records updates, as `publish` does after
    /// `append`: the publish latency, and (once committed) the ids marked
    /// seen for federation (`ids` is called only for a channel whose ids
    /// are marked).
    fn on_commit(&self, ticket: &Ticket, channel: &str, ids: impl FnOnce() -> Vec<String>) {
        let started = Instant::now();
        let stats = self.stats.clone();
        let seen = self.echo_window(channel).cloned();
        let ids = match seen {
            Some(_) => ids(),
            None => Vec::new(),
        };
        ticket.on_done(move |r| {
            stats.publish.record(started.elapsed());
            if let (Ok(_), Some(seen)) = (r, seen) {
                seen.insert_each(&ids);
            }
        });
    }

    /// Publishes several messages as one group: one write, one fsync, all or
    /// none committed, contiguous in one segment.
    pub fn publish_batch(
        &self,
        channel: &str,
        items: &[Outgoing<'_>],
    ) -> Result<Vec<Published>, Error> {
        self.publish_batch_with_ids(channel, items, None)
    }

    /// [`Engine::publish_batch`] with the ids given by the caller, one per
    /// item (`None`: new ids). The engine does not deduplicate them.
    pub fn publish_batch_with_ids(
        &self,
        channel: &str,
        items: &[Outgoing<'_>],
        given: Option<&[String]>,
    ) -> Result<Vec<Published>, Error> {
        self.publish_writer(channel)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let framed = frame_batch(&self.origin, channel, items, given)?;
        let (offset, ids) = self.publish_framed(framed)?;
        let FramedIds::Listed(ids) = ids else {
            unreachable!("frame_batch lists its ids")
        };
        Ok(placed(ids, offset))
    }

    /// Appends records framed ahead ([`frame_batch`]) by this instance's
    /// origin, as [`Engine::publish_batch`] does; returns the global offset
    /// of the first (the end of the channel for an empty batch) and the
    /// records' ids. The records are moved into the channel's queue, not
    /// copied.
    pub fn publish_framed(&self, framed: Framed) -> Result<(u64, FramedIds), Error> {
        let writer = self.framed_writer(&framed)?;
        let Framed {
            buf, ids, channel, ..
        } = framed;
        if ids.is_empty() {
            return Ok((writer.committed_end(), ids));
        }
        let started = Instant::now();
        let at = writer.append(buf, ids.len() as u64)?;
        self.stats.publish.record(started.elapsed());
        if let Some(seen) = self.echo_window(&channel) {
            seen.insert_each(ids.iter());
        }
        Ok((at.offset, ids))
    }

    /// [`Engine::publish_framed`] handed to the channel's committer thread:
    /// returns at once ([`Engine::submit`]) with the batch's outcome to come,
    /// under its last record's id; `None` for an empty batch.
    pub fn submit_framed(&self, framed: Framed) -> Result<Option<Submitted>, Error> {
        let writer = self.framed_writer(&framed)?;
        let Some(last) = framed.ids.last() else {
            return Ok(None);
        };
        let ticket = writer.submit(framed.buf, framed.ids.len() as u64)?;
        self.on_commit(&ticket, &framed.channel, || framed.ids.to_vec());
        Ok(Some(Submitted { id: last, ticket }))
    }

    /// The writer of a framed batch's channel, once the batch is known to
    /// be this instance's (records carry their origin).
    fn framed_writer(&self, framed: &Framed) -> Result<Arc<ChannelWriter>, Error> {
        if framed.origin != self.origin {
            return Err(Error::InvalidRecord(envelope::RecordError::Field {
                field: "origin",
                value: framed.origin.clone(),
                reason: format!(
                    "records framed for origin {:?} cannot be published by instance {:?}: \
                     frame them with this instance's name",
                    framed.origin, self.origin
                ),
            }));
        }
        self.publish_writer(&framed.channel)
    }

    /// A reader of `channel` from global offset `from`, and the channel's
    /// writer when the channel exists (its committed end limits reads).
    /// Reading never creates a channel.
    pub fn reader(
        &self,
        channel: &str,
        from: u64,
    ) -> Result<(LogReader, Option<Arc<ChannelWriter>>), Error> {
        self.check_open()?;
        validate_name(NameKind::Channel, channel)?;
        let dir = self.store.channel_dir(channel)?;
        let writer = if dir.is_dir() {
            Some(self.store.writer(channel)?)
        } else {
            None
        };
        Ok((self.store.reader(dir, from), writer))
    }

    /// A reader of an existing `channel` from global offset `from`, and its
    /// writer (whose committed end limits reads). A channel that does not
    /// exist is [`StorageError::ChannelNotFound`]; nothing is created.
    pub fn read(&self, channel: &str, from: u64) -> Result<(LogReader, Arc<ChannelWriter>), Error> {
        self.check_open()?;
        validate_name(NameKind::Channel, channel)?;
        let dir = existing_channel_dir(self.store.data_dir(), channel)?;
        let writer = self.store.writer(channel)?;
        Ok((self.store.reader(dir, from), writer))
    }

    fn subs(&self) -> std::sync::MutexGuard<'_, HashMap<SubscriberKey, Arc<Subscriber>>> {
        self.subscribers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts delivering `channel` to `handler` as subscriber `id`, resuming
    /// from its offset file (or starting at the current end when it has
    /// none). One subscription per (channel, id) at a time.
    pub fn subscribe<H: Handler>(
        &self,
        channel: &str,
        id: &str,
        handler: H,
        opts: SubscribeOptions,
    ) -> Result<Arc<Subscriber>, Error> {
        self.subscribe_from(channel, id, handler, opts, StartPosition::Latest, false)
    }

    /// [`Engine::read`] from `from`, which must start a record and not be
    /// past the channel's end ([`Error::Config`] otherwise, as for a
    /// subscriber's start). 0, or an offset whose data was deleted, is
    /// taken as is: the reader starts at the oldest record kept, or reports
    /// the gap.
    pub fn read_at(
        &self,
        channel: &str,
        from: u64,
    ) -> Result<(LogReader, Arc<ChannelWriter>), Error> {
        let (reader, writer) = self.read(channel, from)?;
        if from != 0 {
            check_start(reader.dir(), channel, from, writer.committed_end())?;
        }
        Ok((reader, writer))
    }

    /// Global offset of the record boundary `pos` names in `channel` (see
    /// [`timeindex::resolve`]); a channel that does not exist is
    /// [`StorageError::ChannelNotFound`].
    pub fn resolve_position(&self, channel: &str, pos: StartPosition) -> Result<u64, Error> {
        let (reader, writer) = self.read(channel, 0)?;
        resolve_in(reader.dir(), channel, pos, writer.committed_end())
    }

    /// Makes `sub` go on at `pos`: the next record delivered is the one
    /// there (taken between batches; the new offset is persisted).
    pub fn seek(&self, sub: &Subscriber, pos: StartPosition) -> Result<(), Error> {
        if sub.is_stopped() {
            return Err(Error::Closed(format!(
                "subscription {:?}/{:?} is closed",
                sub.channel(),
                sub.id()
            )));
        }
        let at = self.resolve_position(sub.channel(), pos)?;
        sub.seek(at);
        Ok(())
    }

    /// As [`Engine::subscribe`], starting at `start` when the subscriber has
    /// no stored offset, or always when `reset`.
    pub fn subscribe_from<H: Handler>(
        &self,
        channel: &str,
        id: &str,
        handler: H,
        opts: SubscribeOptions,
        start: StartPosition,
        reset: bool,
    ) -> Result<Arc<Subscriber>, Error> {
        self.check_open()?;
        validate_name(NameKind::Channel, channel)?;
        validate_name(NameKind::SubscriberId, id)?;
        let mut subs = self.subs();
        let key = (channel.to_owned(), id.to_owned());
        if let Some(existing) = subs.get(&key) {
            if !existing.is_stopped() {
                return Err(Error::Subscription(format!(
                    "subscriber {id:?} is already subscribed to channel {channel:?}; close that subscription first"
                )));
            }
            if !existing.wait_finished(Duration::from_secs(1)) {
                // Closed from its own handler: its thread still persists the offset.
                return Err(Error::Subscription(format!(
                    "subscriber {id:?} of channel {channel:?} is still stopping; try again shortly"
                )));
            }
            subs.remove(&key);
        }
        let writer = self.store.writer(channel)?;
        let dead_letters = if channel.ends_with(envelope::DEAD_LETTER_SUFFIX) {
            writer.clone()
        } else {
            self.store.writer(&envelope::dead_letter_channel(channel))?
        };
        let path = offset_path(&subscribers_dir(self.store.data_dir(), channel), id);
        let fresh = reset
            || read_offset(&path)
                .map_err(io_error(format!("cannot read {}", path.display())))?
                .is_none();
        let initial = if fresh && start != StartPosition::Latest {
            Some(resolve_in(
                writer.dir(),
                channel,
                start,
                writer.committed_end(),
            )?)
        } else if fresh && reset {
            Some(writer.committed_end())
        } else {
            None
        };
        let wiring = Wiring {
            channel: channel.to_owned(),
            id: id.to_owned(),
            writer,
            dead_letters,
            offset_path: path.clone(),
            stats: self.stats.clone(),
            initial,
        };
        let sub = Subscriber::start(wiring, handler, opts).map_err(io_error(format!(
            "cannot start subscriber {id:?} on channel {channel:?} (offset file {})",
            path.display()
        )))?;
        let sub = Arc::new(sub);
        subs.insert(key, sub.clone());
        Ok(sub)
    }

    /// Stops `sub` (its offset is kept) and forgets it, unless another
    /// subscription has replaced it under the same id. Idempotent.
    pub fn release(&self, sub: &Arc<Subscriber>) {
        self.release_within(sub, DEFAULT_CLOSE_TIMEOUT, &mut || false);
    }

    /// [`Engine::release`] waiting at most `timeout` for a handler call in
    /// progress (see [`Subscriber::stop_within`]); false when it gave up.
    pub fn release_within(
        &self,
        sub: &Arc<Subscriber>,
        timeout: Duration,
        interrupted: &mut dyn FnMut() -> bool,
    ) -> bool {
        if self.owner.is_foreign() {
            return true;
        }
        if sub.is_current_thread() {
            // From its own handler: signal only; the entry stays until the
            // thread has ended, so the same id cannot start a second writer
            // of its offset file meanwhile.
            sub.signal_stop();
            return true;
        }
        let key = (sub.channel().to_owned(), sub.id().to_owned());
        {
            let mut subs = self.subs();
            if subs.get(&key).is_some_and(|s| Arc::ptr_eq(s, sub)) {
                subs.remove(&key);
            }
        }
        sub.stop_within(timeout, interrupted)
    }

    /// Stops subscriber `id` of `channel` (its offset is kept). Returns
    /// false when it was not subscribed.
    pub fn stop_subscriber(&self, channel: &str, id: &str) -> bool {
        let sub = self.subs().remove(&(channel.to_owned(), id.to_owned()));
        match sub {
            Some(s) => {
                s.stop();
                true
            }
            None => false,
        }
    }

    /// Stops subscriber `id` (if running) and deletes its offset file, so a
    /// later subscribe starts at the end again.
    pub fn unsubscribe(&self, channel: &str, id: &str) -> Result<(), Error> {
        self.check_open()?;
        validate_name(NameKind::Channel, channel)?;
        let dir = subscribers_dir(self.store.data_dir(), channel);
        if let Err(e) = validate_name(NameKind::SubscriberId, id) {
            // 1.4 took any string as an id: one this version refuses (a
            // space, a ':', a non-ASCII letter) may name an offset file that
            // holds back retention. Removing it is allowed when the id is a
            // plain file name (no path) and not a federation cursor's.
            let plain = !id.is_empty()
                && id != "."
                && id != ".."
                && !id.contains(['/', '\0'])
                && !id.starts_with(crate::envelope::FED_CURSOR_PREFIX)
                && !id.starts_with(crate::envelope::HUB_CURSOR_PREFIX);
            if !(plain && offset_path(&dir, id).is_file()) {
                return Err(e.into());
            }
        }
        // Its thread must write no offset after the file is deleted: not
        // even when this is called from its own handler (the stop cannot
        // wait for that call) or the handler outlasts the stop's wait.
        let sub = self.subs().remove(&(channel.to_owned(), id.to_owned()));
        let was_running = sub.is_some();
        if let Some(s) = sub {
            s.forget_offset();
            s.stop();
        }
        let path = offset_path(&dir, id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && was_running => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Subscription(
                format!("subscriber {id:?} of channel {channel:?} does not exist"),
            )),
            Err(e) => Err(io_error(format!("cannot delete {}", path.display()))(e)),
        }
    }

    /// Test hook: a power loss on every open channel (see
    /// [`ChannelWriter::simulate_power_loss`]), then close. Reopening the
    /// data directory afterwards shows what survived.
    #[doc(hidden)]
    pub fn simulate_power_loss(&self, torn: usize) -> Result<(), Error> {
        self.closed.store(true, Ordering::Release);
        let subs: Vec<_> = self.subs().drain().map(|(_, s)| s).collect();
        for s in subs {
            s.stop();
        }
        for w in self.store.writers() {
            w.simulate_power_loss(torn).map_err(io_error(format!(
                "power-loss simulation on {:?}",
                w.channel()
            )))?;
        }
        self.close();
        Ok(())
    }

    /// Latency windows (publish, consume, handler).
    pub fn latency(&self) -> &EngineStats {
        &self.stats
    }

    /// Per-channel figures for every channel of the data directory.
    pub fn channel_stats(&self) -> Result<Vec<ChannelSnapshot>, Error> {
        self.check_process()?;
        let active: HashMap<(String, String), u64> = self
            .subs()
            .iter()
            .map(|(k, s)| (k.clone(), s.position()))
            .collect();
        let writers: HashMap<String, Arc<ChannelWriter>> = self
            .store
            .writers()
            .into_iter()
            .map(|w| (w.channel().to_owned(), w))
            .collect();
        let linked = self.with_federation(linked_cursors).unwrap_or_default();
        channel_snapshots(self.store.data_dir(), &active, &linked, &writers)
    }

    /// Runs one retention pass over every channel of the data directory.
    pub fn compact(&self, cfg: &RetentionConfig) -> Result<Vec<(String, CompactionReport)>, Error> {
        self.check_process()?;
        let root = self.store.data_dir();
        let channels = compaction::list_channels(root).map_err(io_error(format!(
            "cannot list channels of {}",
            root.display()
        )))?;
        let mut active: HashMap<String, HashSet<String>> = HashMap::new();
        for (channel, id) in self.subs().keys() {
            active
                .entry(channel.clone())
                .or_default()
                .insert(id.clone());
        }
        let none = HashSet::new();
        let mut out = Vec::new();
        for channel in channels {
            let ids = active.get(&channel).unwrap_or(&none);
            match compaction::compact_channel(root, &channel, ids, cfg) {
                Ok(r) => out.push((channel, r)),
                // One unreadable channel does not stop the others.
                Err(e) => log::error!("channel {channel:?}: compaction skipped: {e}"),
            }
        }
        Ok(out)
    }

    /// Runs [`Engine::compact`] every `interval` on a background thread
    /// until close. Replaces a previously started one.
    pub fn start_retention(
        self: &Arc<Self>,
        cfg: RetentionConfig,
        interval: Duration,
    ) -> Result<(), Error> {
        self.check_process()?;
        self.stop_retention();
        let stop = Arc::new(Stop::default());
        let (engine, s) = (Arc::downgrade(self), stop.clone());
        let handle = std::thread::Builder::new()
            .name("keyop-retention".into())
            .spawn(move || {
                while !s.sleep(interval) {
                    let Some(engine) = engine.upgrade() else {
                        break;
                    };
                    if let Err(e) = engine.compact(&cfg) {
                        log::error!("compaction failed: {e}");
                    }
                }
            })
            .map_err(io_error("cannot start the retention thread".into()))?;
        *self.retention.lock().unwrap_or_else(|e| e.into_inner()) = Some((stop, handle));
        Ok(())
    }

    fn stop_retention(&self) {
        let taken = self
            .retention
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((stop, handle)) = taken {
            stop.set();
            if std::thread::current().id() != handle.thread().id() {
                let _ = handle.join();
            }
        }
    }

    /// Starts the hub and/or client links of `cfg` (see [`Federation::start`]).
    pub fn start_federation(&self, mut cfg: FedConfig) -> Result<(), Error> {
        self.check_open()?;
        let mut slot = self.federation.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Err(Error::Federation("federation is already running".into()));
        }
        cfg.name = self.origin.clone();
        let subscribed = cfg.client.hubs.iter().flat_map(|h| h.subscribe.iter());
        let _ = self.echo_channels.set(subscribed.cloned().collect());
        let seen = self
            .seen
            .get_or_init(|| Arc::new(SeenIds::new(cfg.seen_id_lru_size.max(1))))
            .clone();
        let fed = Federation::start(self.store.clone(), seen, cfg)
            .map_err(|e| Error::Federation(e.to_string()))?;
        *slot = Some(fed);
        Ok(())
    }

    /// Creates the missing forwarding cursors of client links to `hubs`
    /// without starting them (see [`crate::federation::client::create_cursors`]):
    /// for an instance opened without federation whose configuration has them.
    pub fn create_client_cursors(
        &self,
        hubs: &[crate::federation::HubEndpoint],
    ) -> Result<(), Error> {
        self.check_open()?;
        for ep in hubs {
            crate::federation::client::create_cursors(&self.store, ep)
                .map_err(Error::Federation)?;
        }
        Ok(())
    }

    /// Starts the HTTP gateway of `cfg` (see [`crate::gateway::Gateway::start`]).
    pub fn start_gateway(
        self: &Arc<Self>,
        cfg: crate::gateway::GatewayConfig,
    ) -> Result<(), Error> {
        self.check_open()?;
        let mut slot = self.gateway.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Err(Error::Config("the gateway is already running".into()));
        }
        let backend: Arc<dyn crate::gateway::Backend> = self.clone();
        let gw = crate::gateway::Gateway::start(Arc::downgrade(&backend), cfg)
            .map_err(|e| Error::Config(format!("gateway: {e}")))?;
        *slot = Some(gw);
        Ok(())
    }

    /// Runs `f` on the running gateway, if any.
    pub fn with_gateway<T>(&self, f: impl FnOnce(&crate::gateway::Gateway) -> T) -> Option<T> {
        self.gateway
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(f)
    }

    /// `flush()`: syncs every channel; returns what hubs must still acknowledge.
    pub fn flush_start(&self) -> Result<Vec<crate::federation::flush::FlushTarget>, Error> {
        self.check_open()?;
        crate::federation::flush::sync_all(&self.store)?;
        Ok(self
            .with_federation(|f| f.flush_targets())
            .unwrap_or_default())
    }

    /// Runs `f` on the running federation, if any.
    pub fn with_federation<T>(&self, f: impl FnOnce(&Federation) -> T) -> Option<T> {
        self.federation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(f)
    }

    /// Stops federation (if running), every subscriber (each persists its
    /// offset) and the retention thread, then flushes and closes every
    /// channel. Idempotent. Waits at most [`DEFAULT_CLOSE_TIMEOUT`] for
    /// handlers still running (see [`Engine::close_within`]).
    pub fn close(&self) {
        self.close_within(DEFAULT_CLOSE_TIMEOUT, &mut || false);
    }

    /// Makes a close running on another thread (or to come) stop waiting for
    /// handlers, as its `interrupted` would: for a caller that cannot
    /// interrupt that thread (an asyncio task cancelled while the close runs
    /// on a pool thread). Never blocks.
    pub fn stop_waiting(&self) {
        self.stop_waiting.store(true, Ordering::Release);
    }

    /// [`Engine::close`] waiting at most `timeout` in all for subscriber
    /// handlers still running. A handler that does not return in time is
    /// left running (a warning names it) and its message stays
    /// unacknowledged: the offset does not move past it, so it is delivered
    /// again next time; the channels are flushed and closed all the same.
    /// `interrupted` is asked every 100 ms while waiting; true stops the
    /// waiting at once (the rest of the close still runs). Returns false
    /// when some handler was left running.
    ///
    /// In a process forked after the engine was opened it releases nothing
    /// and touches no file: everything belongs to the parent.
    pub fn close_within(&self, timeout: Duration, interrupted: &mut dyn FnMut() -> bool) -> bool {
        if self.owner.is_foreign() {
            self.leak_in_child();
            return true;
        }
        let started = Instant::now();
        self.closed.store(true, Ordering::Release);
        let gateway = self
            .gateway
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut gw) = gateway {
            gw.stop();
        }
        let fed = self
            .federation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut fed) = fed {
            fed.stop();
        }
        let subs: Vec<_> = self.subs().drain().map(|(_, s)| s).collect();
        for s in &subs {
            s.signal_stop();
        }
        let mut all_done = true;
        let mut gave_up = false;
        for s in &subs {
            let left = if gave_up {
                Duration::ZERO
            } else {
                timeout.saturating_sub(started.elapsed())
            };
            let mut check = || {
                gave_up = gave_up || self.stop_waiting.load(Ordering::Acquire) || interrupted();
                gave_up
            };
            all_done &= s.stop_within(left, &mut check);
        }
        self.stop_retention();
        self.store.close();
        all_done
    }

    /// In a forked child: lets go of the parent's threads, runtime and files
    /// without joining, flushing or closing anything.
    fn leak_in_child(&self) {
        if let Some(fed) = self
            .federation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            std::mem::forget(fed);
        }
        if let Some(gw) = self
            .gateway
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            std::mem::forget(gw);
        }
        for (_, s) in self.subs().drain() {
            std::mem::forget(s);
        }
        if let Some(r) = self
            .retention
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            std::mem::forget(r);
        }
        std::mem::forget(self.store.clone());
    }
}

impl crate::gateway::Backend for Engine {
    fn instance_name(&self) -> String {
        self.origin.clone()
    }

    fn publish(
        &self,
        channel: &str,
        items: &[crate::gateway::Item<'_>],
    ) -> Result<Vec<(String, u64)>, Error> {
        let items: Vec<Outgoing<'_>> = items
            .iter()
            .map(|i| Outgoing {
                payload_type: i.payload_type,
                payload_json: i.payload_json,
                service_name: i.service_name,
                correlation_id: i.correlation_id,
            })
            .collect();
        Ok(self
            .publish_batch(channel, &items)?
            .into_iter()
            .map(|p| (p.id, p.offset))
            .collect())
    }

    fn channel_exists(&self, channel: &str) -> bool {
        validate_name(NameKind::Channel, channel).is_ok()
            && crate::storage::channel_dir(self.store.data_dir(), channel).is_dir()
    }

    fn open_reader(
        &self,
        channel: &str,
        pos: StartPosition,
        create: bool,
    ) -> Result<(LogReader, Arc<ChannelWriter>), Error> {
        self.check_open()?;
        validate_name(NameKind::Channel, channel)?;
        if create {
            self.store.writer(channel)?;
        }
        let at = self.resolve_position(channel, pos)?;
        self.read(channel, at)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

/// Publish time of the first readable record at or after `from`.
fn oldest_pending(dir: &Path, from: u64, limit: u64) -> Option<i64> {
    let mut reader = LogReader::new(dir, from);
    for _ in 0..64 {
        match reader.next_item(limit).ok()?? {
            crate::storage::Item::Record { line, .. } => {
                if let Ok(e) = crate::envelope::Envelope::decode(&line) {
                    return Some(e.ts_nanos);
                }
            }
            _ => continue,
        }
    }
    None
}

/// Appends one new envelope (fresh UUIDv7 id, current time) from `origin` to
/// `out` and returns its id; refuses invalid records (names, fields, payload
/// depth and values: [`envelope::validate_header`], [`envelope::check_payload`])
/// and records over the size limit, appending nothing.
pub fn encode_message(
    out: &mut Vec<u8>,
    origin: &str,
    channel: &str,
    m: &Outgoing<'_>,
) -> Result<String, Error> {
    encode_message_with_id(out, origin, channel, m, None)
}

/// [`encode_message`] with the id given by the caller (`None`: a new one).
/// A caller-given id must be valid (envelope.rs) and should be unique: ids
/// derived deterministically from a job let a hub's deduplication drop a
/// record sent twice.
pub fn encode_message_with_id(
    out: &mut Vec<u8>,
    origin: &str,
    channel: &str,
    m: &Outgoing<'_>,
    id: Option<&str>,
) -> Result<String, Error> {
    match id {
        Some(id) => encode_message_at(out, origin, channel, m, id, envelope::ts_now().as_str()),
        None => {
            let stamp = Stamp::now();
            encode_message_at(out, origin, channel, m, stamp.id(), stamp.ts())
        }
    }
}

/// [`encode_message_with_id`] with the id and timestamp given.
fn encode_message_at(
    out: &mut Vec<u8>,
    origin: &str,
    channel: &str,
    m: &Outgoing<'_>,
    id: &str,
    ts: &str,
) -> Result<String, Error> {
    let before = out.len();
    let header = Header {
        id,
        ts,
        channel,
        origin,
        payload_type: m.payload_type,
        correlation_id: m.correlation_id,
        service_name: m.service_name,
    };
    // The one definition of a valid record (envelope.rs), before anything is written.
    envelope::validate_header(&header, NameKind::PublishChannel)?;
    envelope::check_payload(m.payload_json)?;
    encode_record(out, &header, m.payload_json);
    let size = out.len() - before;
    if size > MAX_RECORD_BYTES {
        out.truncate(before);
        return Err(Error::TooLarge {
            size,
            limit: MAX_RECORD_BYTES,
        });
    }
    Ok(id.to_owned())
}

/// Per-channel figures of any data directory, read from its files only: no
/// lock is taken, so it works beside a running messenger (figures as of the
/// last write; counters of that process are not visible, so
/// `messages_published` is 0 and no subscriber is `active`).
pub fn read_channel_stats(data_dir: &Path) -> Result<Vec<ChannelSnapshot>, Error> {
    if !data_dir.is_dir() {
        return Err(StorageError::DataDirNotFound(data_dir.to_path_buf()).into());
    }
    channel_snapshots(data_dir, &HashMap::new(), &HashSet::new(), &HashMap::new())
}

/// Ids of the federation cursors in use now: `fed-<peer>` of every peer
/// connected to the hub, `hub-<addr>` of every client link that is connected.
fn linked_cursors(fed: &Federation) -> HashSet<String> {
    let mut ids: HashSet<String> = fed
        .hub()
        .map(|hub| hub.connected_peers())
        .unwrap_or_default()
        .into_iter()
        .map(|peer| format!("{}{peer}", envelope::FED_CURSOR_PREFIX))
        .collect();
    ids.extend(
        fed.clients()
            .iter()
            .filter(|link| link.status().connected.load(Ordering::Relaxed))
            .map(|link| crate::federation::client_cursor_id(link.addr())),
    );
    ids
}

/// Figures of every channel under `root`; `active` maps (channel, subscriber)
/// to the position of a subscriber running in this process, `linked` holds
/// the federation cursors in use ([`linked_cursors`]), `writers` the
/// channels this process has open.
fn channel_snapshots(
    root: &Path,
    active: &HashMap<(String, String), u64>,
    linked: &HashSet<String>,
    writers: &HashMap<String, Arc<ChannelWriter>>,
) -> Result<Vec<ChannelSnapshot>, Error> {
    let channels = compaction::list_channels(root).map_err(io_error(format!(
        "cannot list channels of {}",
        root.display()
    )))?;
    let mut out = Vec::new();
    for name in channels {
        let dir = crate::storage::channel_dir(root, &name);
        let segs = crate::storage::segment::list_segments(&dir).unwrap_or_default();
        let disk_bytes = segs
            .iter()
            .filter_map(|&s| std::fs::metadata(crate::storage::segment::segment_path(&dir, s)).ok())
            .map(|m| m.len())
            .sum();
        let writer = writers.get(&name);
        let stream_bytes = match writer {
            Some(w) => w.committed_end(),
            None => crate::storage::segment::stream_end(&dir).unwrap_or(0),
        };
        let mut subscribers = Vec::new();
        let sub_dir = subscribers_dir(root, &name);
        for (id, path) in crate::storage::offsets::list_offsets(&sub_dir).unwrap_or_default() {
            let live = active.get(&(name.clone(), id.clone())).copied();
            let stored = || match crate::storage::offsets::read_offset(&path) {
                Ok(position) => position,
                Err(e) => {
                    // Left out of the figures, but never silently: retention
                    // keeps the channel's data while the file cannot be read.
                    static UNREADABLE: RateLimit = RateLimit::new(Duration::from_secs(60));
                    if let Some(held) = UNREADABLE.check() {
                        log::warn!(
                            "channel {name:?}: subscriber {id:?} left out of the stats: its \
                             offset file {} cannot be read ({e}); retention keeps the \
                             channel's data until it is fixed or the subscriber is \
                             unsubscribed{held}",
                            path.display()
                        );
                    }
                    None
                }
            };
            let Some(position) = live.or_else(stored) else {
                continue;
            };
            let lag_bytes = stream_bytes.saturating_sub(position);
            let oldest_pending_nanos = if lag_bytes > 0 {
                oldest_pending(&dir, position, stream_bytes)
            } else {
                None
            };
            let active = live.is_some() || linked.contains(&id);
            subscribers.push(SubscriberSnapshot {
                id,
                position,
                lag_bytes,
                oldest_pending_nanos,
                active,
            });
        }
        out.push(ChannelSnapshot {
            messages_published: writer.map_or(0, |w| w.counters().records),
            name,
            stream_bytes,
            disk_bytes,
            last_message_nanos: crate::storage::timeindex::last_record_ts(&dir, stream_bytes)
                .ok()
                .flatten(),
            subscribers,
        });
    }
    Ok(out)
}

/// A reader over a channel of any data directory, including one written by
/// keyop-messenger 1.4 or by another process (no lock is taken). Creates
/// nothing: a data directory or channel that does not exist is an error
/// ([`StorageError::DataDirNotFound`], [`StorageError::ChannelNotFound`]).
pub fn read_channel(data_dir: &Path, channel: &str, from: u64) -> Result<LogReader, Error> {
    envelope::validate_name(NameKind::Channel, channel)?;
    let dir = existing_channel_dir(data_dir, channel)?;
    Ok(LogReader::new(dir, from))
}

/// [`read_channel`] from a caller's offset, which must start a record and
/// not be past the channel's end ([`Error::Config`] otherwise, as for a
/// subscriber's start; a reader would take a partial line for an unreadable
/// record). 0, or an offset whose data was deleted, is taken as is: the
/// reader starts at the oldest record kept, or reports the gap.
pub fn read_channel_at(data_dir: &Path, channel: &str, from: u64) -> Result<LogReader, Error> {
    let reader = read_channel(data_dir, channel, from)?;
    if from != 0 {
        check_start(reader.dir(), channel, from, u64::MAX)?;
    }
    Ok(reader)
}

/// Whether a read of the channel directory `dir` may start at `from` (see
/// [`read_channel_at`]); `limit` is the committed end, if known.
fn check_start(dir: &Path, channel: &str, from: u64, limit: u64) -> Result<(), Error> {
    let at = StartPosition::Offset(from);
    match timeindex::resolve(dir, at, limit, &mut SeekCost::default()) {
        Ok(_) | Err(PositionError::Gone(_)) => Ok(()),
        Err(e) => Err(position_error(channel, e)),
    }
}

/// `data_dir/channels/<channel>` if both exist (the name must already be
/// validated); nothing is created.
pub fn existing_channel_dir(data_dir: &Path, channel: &str) -> Result<std::path::PathBuf, Error> {
    if !data_dir.is_dir() {
        return Err(StorageError::DataDirNotFound(data_dir.to_owned()).into());
    }
    let dir = crate::storage::channel_dir(data_dir, channel);
    if !dir.is_dir() {
        return Err(StorageError::ChannelNotFound {
            data_dir: data_dir.to_owned(),
            channel: channel.to_owned(),
        }
        .into());
    }
    Ok(dir)
}

/// [`timeindex::resolve`] with its errors named after `channel`.
fn resolve_in(dir: &Path, channel: &str, pos: StartPosition, limit: u64) -> Result<u64, Error> {
    timeindex::resolve(dir, pos, limit, &mut SeekCost::default())
        .map_err(|e| position_error(channel, e))
}

/// A [`PositionError`] of `channel` as the engine's error.
fn position_error(channel: &str, e: PositionError) -> Error {
    match e {
        PositionError::Invalid(why) | PositionError::Gone(why) => {
            Error::Config(format!("channel {channel:?}: {why}"))
        }
        PositionError::Io(e) => io_error(format!("cannot seek in channel {channel:?}"))(e),
    }
}

/// [`Engine::resolve_position`] for a channel of any data directory (no
/// lock taken; every complete record counts).
pub fn resolve_position(data_dir: &Path, channel: &str, pos: StartPosition) -> Result<u64, Error> {
    envelope::validate_name(NameKind::Channel, channel)?;
    let dir = existing_channel_dir(data_dir, channel)?;
    resolve_in(&dir, channel, pos, u64::MAX)
}
