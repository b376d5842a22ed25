//! One established federation connection, after the handshake: the reader
//! (batches in, acknowledgements of our batches), the sender (stop-and-wait
//! batches out from persisted cursors) and a keepalive pinger. Every write
//! goes through one lock, so acknowledgements and batches never interleave.
//! why this file is long: the reader (storing a received batch: validity,
//! dedup with in-flight ids, policy, one commit per channel) and the sender
//! share one connection's state; split, each half would need the other's types.

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, Mutex};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Bytes, Message};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

use super::buffers::{Pooled, POOL};
use super::ids::IdList;
use super::status::{InboundCounts, LinkStatus, RefusalReason};
use super::wire::{push_record, split_batch, Ack, Refused};
use super::{Shared, ACK_TIMEOUT, PING_INTERVAL, READ_TIMEOUT};
use crate::audit::AuditEvent;
use crate::dedup::Claim;
use crate::envelope::{
    decode_valid_ref, validate_name, EnvelopeRef, NameKind, RecordError, MAX_RECORD_BYTES,
};
use crate::lograte::RateLimit;
use crate::storage::offsets::write_offset;
use crate::storage::{ChannelWriter, Item, LogReader};

type Sink<S> = Arc<Mutex<SplitSink<WebSocketStream<S>, Message>>>;

/// Largest WebSocket message accepted: a full batch plus one maximal record.
pub fn max_message_size(max_batch_bytes: usize) -> usize {
    max_batch_bytes
        .saturating_add(MAX_RECORD_BYTES)
        .saturating_add(64 * 1024)
}

/// One channel this side sends from.
pub struct OutChannel {
    pub channel: String,
    pub writer: Arc<ChannelWriter>,
    pub reader: LogReader,
    /// Persisted cursor; `None` keeps the position in memory only.
    pub cursor: Option<PathBuf>,
    /// Forward only records with this origin (a client forwards only what
    /// was published locally).
    pub only_origin: Option<String>,
}

struct Batch {
    body: Vec<u8>,
    ids: IdList,
    end: u64,
    /// Byte ranges the reader skipped because their segments are gone.
    gaps: Vec<(u64, u64)>,
    /// The batch is full: more records were there to read.
    full: bool,
}

/// Most records in a batch sent to a 1.4 peer. Its receiver writes and
/// fsyncs each record in its read loop, answering no ping meanwhile: a whole
/// 4 MiB batch of small records (some 20,000 fsyncs on a board's SD card) could
/// outlast our read and acknowledgement timeouts, and the link would be
/// dropped and the batch sent again, over and over. 256 records take 25 s
/// even at 100 ms an fsync.
pub const LEGACY_BATCH_RECORDS: usize = 256;

/// How large a batch may grow: JSON bytes (the first record always goes)
/// and records.
#[derive(Clone, Copy, Debug)]
struct BatchLimit {
    bytes: usize,
    records: usize,
}

impl OutChannel {
    /// Collects records from the cursor while their JSON fits in
    /// `cap.bytes` (the first one always goes) and they number at most
    /// `cap.records`.
    fn read_batch(&mut self, cap: BatchLimit) -> std::io::Result<Batch> {
        let max_bytes = cap.bytes;
        let limit = self.writer.committed_end();
        let mut body = POOL.take();
        let mut ids = IdList::default();
        let mut json_bytes = 0;
        let mut gaps = Vec::new();
        let mut full = false;
        loop {
            let before = self.reader.position();
            let Some(item) = self.reader.next_item(limit)? else {
                break;
            };
            let line = match item {
                Item::Record { line, .. } => line,
                Item::Gap { from, to } => {
                    gaps.push((from, to));
                    continue;
                }
                Item::Oversize { .. } => continue,
            };
            // Only the id and origin are needed here: the receiver checks
            // the whole record, and refuses it (counted, audited) if invalid.
            let Some((id, origin)) = EnvelopeRef::id_and_origin(&line) else {
                continue;
            };
            if self.only_origin.as_ref().is_some_and(|o| *o != origin) {
                continue;
            }
            if !ids.is_empty() && json_bytes + line.len() > max_bytes {
                self.reader.seek(before);
                full = true;
                break;
            }
            push_record(&mut body, &line);
            json_bytes += line.len();
            ids.push(&id);
            if json_bytes >= max_bytes || ids.len() >= cap.records {
                full = true;
                break;
            }
        }
        Ok(Batch {
            body,
            ids,
            end: self.reader.position(),
            gaps,
            full,
        })
    }
}

/// What the receiving side accepts, how it is labelled in the audit log,
/// and where its figures go.
pub struct Inbound {
    /// Channels accepted; `None` accepts any.
    pub allow: Option<FastSet<String>>,
    /// `peer` in audit records.
    pub peer: String,
    /// Counts records stored and refused (the hub listener's counters).
    pub counts: Option<Arc<InboundCounts>>,
    /// Round trips and unacknowledged bytes of our batches (client links).
    pub link: Option<Arc<LinkStatus>>,
    /// Accept records for `.dead-letter` channels (a client receiving what
    /// its hub streams; never a hub receiving from a client).
    pub dead_letters: bool,
    /// New channels this peer may still create (hub side); `None`: no limit.
    pub channel_budget: Option<Arc<super::ChannelBudget>>,
    /// List refused records in acknowledgements (the peer announced
    /// [`FEATURE_REFUSALS`](super::wire::FEATURE_REFUSALS); a 1.4 peer gets
    /// plain acknowledgements).
    pub report_refusals: bool,
}

/// The next message of `ws` that is not a ping or a pong (answered or
/// ignored by the WebSocket layer): a peer may send them before its
/// handshake (RFC 6455 allows control frames at any point). The caller's
/// handshake timeout bounds how many.
pub async fn next_data<S>(
    ws: &mut WebSocketStream<S>,
) -> Option<Result<Message, tokio_tungstenite::tungstenite::Error>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        match ws.next().await {
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            other => return other,
        }
    }
}

/// Runs a connection until it fails, the peer goes away, or `cancel` fires.
/// Returns the reason it ended (for the audit log), or `None` on cancel.
pub async fn run<S>(
    shared: Arc<Shared>,
    ws: WebSocketStream<S>,
    out: Vec<OutChannel>,
    inbound: Inbound,
    cancel: CancellationToken,
) -> Option<String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sink, stream) = ws.split();
    let sink: Sink<S> = Arc::new(Mutex::new(sink));
    let (ack_tx, ack_rx) = mpsc::channel::<Ack>(4);
    // Whether a batch of ours awaits its acknowledgement (stop and wait).
    let outstanding = Arc::new(AtomicBool::new(false));
    let limit = BatchLimit {
        bytes: shared.link.max_batch_bytes.max(1),
        records: match inbound.report_refusals {
            true => usize::MAX,
            false => LEGACY_BATCH_RECORDS, // a 1.4 peer (no features)
        },
    };
    let sender = tokio::spawn(send_loop(
        shared.clone(),
        sink.clone(),
        (out, limit),
        (ack_rx, outstanding.clone()),
        cancel.clone(),
        inbound.peer.clone(),
        inbound.link.clone(),
    ));
    let pinger = tokio::spawn(ping_loop(sink.clone(), cancel.clone()));
    let acks = (ack_tx, outstanding);
    let read_result = read_loop(&shared, stream, &sink, &inbound, acks, &cancel).await;
    cancel.cancel();
    let send_result = sender
        .await
        .unwrap_or_else(|e| Some(format!("sender task failed: {e}")));
    let _ = pinger.await;
    // An instance shutting down says so (1001, "going away"): the peer logs
    // why its link ended. Otherwise the close carries no code, as in 1.4.
    let going_away = shared.cancel.is_cancelled().then(|| CloseFrame {
        code: CloseCode::Away,
        reason: "shutting down".into(),
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut sink = sink.lock().await;
        if let Some(frame) = going_away {
            let _ = sink.send(Message::Close(Some(frame))).await;
        }
        sink.close().await
    })
    .await;
    if shared.cancel.is_cancelled() {
        return None;
    }
    read_result.or(send_result)
}

async fn read_loop<S>(
    shared: &Arc<Shared>,
    mut stream: SplitStream<WebSocketStream<S>>,
    sink: &Sink<S>,
    inbound: &Inbound,
    (ack_tx, outstanding): (mpsc::Sender<Ack>, Arc<AtomicBool>),
    cancel: &CancellationToken,
) -> Option<String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return None,
            r = tokio::time::timeout(READ_TIMEOUT, stream.next()) => r,
        };
        let msg = match next {
            Err(_) => return Some(format!("nothing received for {}s", READ_TIMEOUT.as_secs())),
            Ok(None) => return Some("connection closed".into()),
            Ok(Some(Err(e))) => return Some(e.to_string()),
            Ok(Some(Ok(m))) => m,
        };
        match msg {
            Message::Binary(body) => {
                let received = receive_batch(shared, inbound, &body).await;
                if body.len() >= crate::memtrim::LARGE_BYTES {
                    drop(body);
                    crate::memtrim::request();
                }
                let ack = match received {
                    Ok(ack) => ack,
                    Err(e) => return Some(e),
                };
                let ack = Message::Text(ack.to_json().into());
                if let Err(e) = sink.lock().await.send(ack).await {
                    return Some(format!("cannot send acknowledgement: {e}"));
                }
            }
            Message::Text(text) => {
                let Some(ack) = Ack::parse(text.as_str()) else {
                    // Nothing a peer sends; our batch, if any, goes again on
                    // the next connection.
                    return Some("received a text message that is not a JSON object".into());
                };
                if outstanding.swap(false, Ordering::AcqRel) {
                    let _ = ack_tx.try_send(ack);
                } else {
                    // No batch of ours awaits one: taking it would acknowledge
                    // the next batch before the peer has it (and move the
                    // cursor past records it may never store).
                    static UNSOLICITED: RateLimit = RateLimit::new(Duration::from_secs(10));
                    if let Some(n) = UNSOLICITED.check() {
                        log::warn!(
                            "{}: dropped an acknowledgement sent while no batch was outstanding{n}",
                            inbound.peer
                        );
                    }
                }
            }
            Message::Close(frame) => {
                return Some(match frame {
                    Some(f) if f.reason.is_empty() => {
                        format!("peer closed the connection (code {})", u16::from(f.code))
                    }
                    Some(f) => format!(
                        "peer closed the connection (code {}: {})",
                        u16::from(f.code),
                        f.reason.as_str().escape_debug()
                    ),
                    None => "peer closed the connection".into(),
                })
            }
            _ => {}
        }
    }
}

/// Refusals logged at most once per interval (a hostile peer can send
/// thousands a second); each one is audited.
static REFUSAL_LOG: RateLimit = RateLimit::new(Duration::from_secs(10));

/// Refused records without an id audited (and listed in the acknowledgement)
/// one by one per batch; past these they are only counted, and audited once
/// at the batch's end. The sender cannot match such a refusal to a record
/// anyway, and a batch of 14 MiB of empty records would otherwise write an
/// audit line and hold a list entry for each 4 bytes received.
const NAMELESS_DETAILED: usize = 16;

/// [`refuse`]s a record of a received batch and lists it in the batch's
/// acknowledgement; a refused record with an id is, so far, the last record
/// the acknowledgement covers (`last_wanted` false: not the last stored).
fn refuse_in_ack(
    shared: &Shared,
    inbound: &Inbound,
    (ack, last_wanted, nameless): (&mut Ack, &mut bool, &mut usize),
    refused: Refused,
    why: &str,
) {
    if !refused.id.is_empty() {
        ack.last_id.clone_from(&refused.id);
        *last_wanted = false;
    }
    refuse_listed(shared, inbound, (ack, nameless), refused, why);
}

/// Counts a refused record of a received batch (every one, in
/// [`Inbound::counts`]), [`refuse`]s it and lists it in the batch's
/// acknowledgement if the peer asked for refusals; past [`NAMELESS_DETAILED`]
/// records without an id in the batch, only counts it in `nameless`.
fn refuse_listed(
    shared: &Shared,
    inbound: &Inbound,
    (ack, nameless): (&mut Ack, &mut usize),
    refused: Refused,
    why: &str,
) {
    if let Some(counts) = &inbound.counts {
        counts.refused.add(RefusalReason::parse(&refused.reason));
    }
    if refused.id.is_empty() {
        *nameless += 1;
        if *nameless > NAMELESS_DETAILED {
            return;
        }
    }
    refuse(shared, inbound, &refused, why);
    if inbound.report_refusals {
        ack.refused.push(refused);
    }
}

/// Audits (and logs, rate-limited) the refusals without an id of a batch
/// that were only counted ([`NAMELESS_DETAILED`]).
fn refuse_nameless_rest(shared: &Shared, inbound: &Inbound, nameless: usize) {
    let Some(rest) = nameless.checked_sub(NAMELESS_DETAILED).filter(|&n| n > 0) else {
        return;
    };
    let why = format!(
        "{rest} more records without an id in this batch were refused as unreadable, invalid or \
         too large (each batch audits the first {NAMELESS_DETAILED} one by one)"
    );
    if let Some(more) = REFUSAL_LOG.check() {
        log::warn!("{}: {why}{more}", inbound.peer);
    }
    let mut ev = AuditEvent::new("record_refused");
    ev.direction = "inbound".into();
    ev.peer = inbound.peer.clone();
    ev.detail = why;
    shared.audit.log(ev);
}

/// Logs (rate-limited) and audits one refused record.
fn refuse(shared: &Shared, inbound: &Inbound, refused: &Refused, why: &str) {
    if let Some(more) = REFUSAL_LOG.check() {
        log::warn!(
            "{}: refused a record (id {:?}, channel {:?}): {}: {why}{more}",
            inbound.peer,
            refused.id,
            refused.channel,
            refused.reason,
        );
    }
    let policy = refused.reason == RefusalReason::Policy.as_str();
    let mut ev = AuditEvent::new(if policy {
        "policy_violation"
    } else {
        "record_refused"
    });
    ev.message_id = refused.id.clone();
    ev.channel = refused.channel.clone();
    ev.direction = "inbound".into();
    ev.peer = inbound.peer.clone();
    if !policy {
        ev.detail = format!("reason={} {why}", refused.reason);
    }
    shared.audit.log(ev);
}

/// Stores a received batch: each record is checked against the one
/// definition of a valid record (envelope.rs: size, fields, depth),
/// deduplicated, checked against the policy and appended (one commit per
/// channel per batch); ids are marked seen and audited only once committed.
/// Refused records are logged, audited and listed in the acknowledgement
/// (for peers that asked, see [`Inbound::report_refusals`]); they are never
/// acknowledged as stored. A failed append ends the connection without
/// acknowledging, so the peer sends the batch again. A record whose id
/// another connection is storing at the same moment (a resend) is not
/// stored twice: this batch waits for that attempt and stores the record
/// itself only if the attempt failed (`dedup::SeenIds::claim`).
async fn receive_batch(
    shared: &Arc<Shared>,
    inbound: &Inbound,
    body: &[u8],
) -> Result<Ack, String> {
    let records = split_batch(body).map_err(|e| e.to_string())?;
    let limit = shared.link.max_batch_bytes.max(MAX_RECORD_BYTES - 1);
    let mut ack = Ack::default();
    let mut in_batch: FastSet<Cow<str>> = FastSet::default();
    // Channels of the records wanted so far (for the channel budget).
    let mut channels: FastSet<Cow<str>> = FastSet::default();
    // Whether the last record that counts for the acknowledgement is the
    // last one wanted (else a refused one set `ack.last_id`).
    let mut last_wanted = false;
    let mut last_wanted_id = Cow::Borrowed("");
    // Refused records without an id so far (see `NAMELESS_DETAILED`).
    let mut nameless = 0usize;
    // Claims this batch holds, per channel, settled as failed if it returns
    // early; records another connection is storing at the same moment.
    let mut mine = Claimed::new(&shared.seen);
    let mut pending: Vec<(String, Vec<u8>, String, PendingOutcome)> = Vec::new();
    // A chunk's records, decoded, then those to claim, in batch order: a
    // whole batch's would take megabytes, mapped and faulted in afresh for
    // each batch.
    let mut decoded = Vec::with_capacity(DECODE_CHUNK);
    let mut wanted: Vec<Wanted> = Vec::with_capacity(DECODE_CHUNK);
    for chunk in records.chunks(DECODE_CHUNK) {
        decoded.extend(
            chunk
                .iter()
                .map(|rec| decode_valid_ref(rec, limit, NameKind::Channel)),
        );
        // The dedup window is asked and claimed once per chunk, not per
        // record: its lock is shared by every receiver and local publisher.
        let mut seen_before = shared
            .seen
            .contains_each(decoded.iter().filter_map(|d| Some(&*d.as_ref().ok()?.id)))
            .into_iter();
        for (rec, env) in chunk.iter().zip(decoded.drain(..)) {
            let env = match env {
                Ok(env) => env,
                Err(invalid) => {
                    let reason = match invalid.error {
                        RecordError::TooLarge { .. } => RefusalReason::TooLarge,
                        _ => RefusalReason::Invalid,
                    };
                    let refused = Refused {
                        id: invalid.id,
                        channel: invalid.channel,
                        reason: reason.as_str().into(),
                    };
                    let why = invalid.error.to_string();
                    if matches!(invalid.error, RecordError::Unreadable(_)) {
                        // Named (from its leading fields) if it can be, but as in
                        // 1.4 a record that does not parse leaves `last_id` alone.
                        refuse_listed(shared, inbound, (&mut ack, &mut nameless), refused, &why);
                    } else {
                        let at = (&mut ack, &mut last_wanted, &mut nameless);
                        refuse_in_ack(shared, inbound, at, refused, &why);
                    }
                    continue;
                }
            };
            let seen = seen_before.next().unwrap_or(false);
            if seen || in_batch.contains(&*env.id) {
                continue;
            }
            // Peers may not write dead letters into a hub: those are only made
            // by a subscriber on the instance that holds the channel.
            let allowed = (inbound.dead_letters
                || validate_name(NameKind::PublishChannel, &env.channel).is_ok())
                && inbound
                    .allow
                    .as_ref()
                    .is_none_or(|a| a.contains(&*env.channel));
            if !allowed {
                let refused = Refused::of(&env.id, &env.channel, RefusalReason::Policy);
                let why = "channel not allowed for this peer";
                let at = (&mut ack, &mut last_wanted, &mut nameless);
                refuse_in_ack(shared, inbound, at, refused, why);
                continue;
            }
            if let Some(budget) = &inbound.channel_budget {
                let admitted =
                    channels.contains(&*env.channel) || budget.admits(&shared.store, &env.channel);
                if !admitted {
                    let refused = Refused::of(&env.id, &env.channel, RefusalReason::ChannelLimit);
                    let why = "the peer's max_channels is reached";
                    let at = (&mut ack, &mut last_wanted, &mut nameless);
                    refuse_in_ack(shared, inbound, at, refused, why);
                    continue;
                }
            }
            // Store the received bytes verbatim unless they are not one line.
            let line: Cow<[u8]> = match rec.contains(&b'\n') || rec.contains(&b'\r') {
                true => Cow::Owned(env.encode()),
                false => Cow::Borrowed(rec),
            };
            in_batch.insert(env.id.clone());
            last_wanted = true;
            last_wanted_id.clone_from(&env.id);
            if inbound.channel_budget.is_some() && !channels.contains(&*env.channel) {
                channels.insert(env.channel.clone());
            }
            wanted.push(Wanted {
                channel: env.channel,
                line,
                id: env.id,
            });
        }
        let claims = shared.seen.claim_each(wanted.iter().map(|w| &*w.id));
        for (Wanted { channel, line, id }, claim) in wanted.drain(..).zip(claims) {
            match claim {
                Claim::Seen => {}
                Claim::Pending(rx) => pending.push((
                    channel.into_owned(),
                    Line(&line).to_vec(),
                    id.into_owned(),
                    rx,
                )),
                Claim::Mine => mine.add(&channel, Line(&line), &id),
            }
        }
    }
    if last_wanted {
        ack.last_id = last_wanted_id.into_owned();
    }
    loop {
        for group in &mut mine.groups {
            let store = shared.store.clone();
            let n = group.ids.len() as u64;
            let ch = group.channel.clone();
            let lines = std::mem::take(&mut group.lines);
            let committed = tokio::task::spawn_blocking(move || {
                let writer = store.writer(&ch)?;
                // A relaxed writer that is idle writes from this buffer,
                // which then serves the next batch; otherwise it is moved
                // into the writer's queue.
                if let Some(done) = writer.append_if_idle(&lines, n) {
                    POOL.give(lines);
                    return done;
                }
                writer.append(lines, n)
            })
            .await
            .map_err(|e| format!("store task failed: {e}"))?;
            if let Err(e) = committed {
                return Err(format!(
                    "cannot store {n} records on channel {:?}: {e}",
                    group.channel
                ));
            }
            if let Some(counts) = &inbound.counts {
                counts.stored.fetch_add(n, Ordering::Relaxed);
            }
            shared.seen.settle_each(group.ids.iter(), true);
            shared
                .audit
                .log_forwards("inbound", &inbound.peer, &group.channel, group.ids.iter());
            group.ids = IdList::default();
        }
        mine.groups.clear();
        // Records another connection was storing (none of ours is held now,
        // so two batches waiting on each other cannot deadlock): acknowledged
        // once that attempt committed them, stored here if it failed.
        if pending.is_empty() {
            break;
        }
        for (channel, line, id, mut rx) in std::mem::take(&mut pending) {
            if Claim::outcome(&mut rx).await {
                continue;
            }
            match shared.seen.claim(&id) {
                Claim::Seen => {}
                Claim::Pending(rx) => pending.push((channel, line, id, rx)),
                Claim::Mine => mine.add(&channel, Line(&line), &id),
            }
        }
    }
    // Every qualifying record is now refused or committed (a failed commit
    // returned above): acknowledge the last of them in batch order.
    refuse_nameless_rest(shared, inbound, nameless);
    Ok(ack)
}

type PendingOutcome = tokio::sync::watch::Receiver<Option<bool>>;

/// Records of a received batch decoded, checked and claimed at a time.
const DECODE_CHUNK: usize = 512;

/// A received record that passed the checks, to be claimed and stored:
/// borrowed from the batch as far as possible.
struct Wanted<'a> {
    channel: Cow<'a, str>,
    line: Cow<'a, [u8]>,
    id: Cow<'a, str>,
}

/// The records a batch has claimed (`Claim::Mine`), per channel in order of
/// first appearance. Ids still held when it drops (an error, a cancelled
/// task) are settled as failed, so a resend waiting on them stores them.
struct Claimed<'a> {
    seen: &'a crate::dedup::SeenIds,
    groups: Vec<Group>,
}

/// One channel's claimed records: their lines, ready to append, and ids.
struct Group {
    channel: String,
    lines: Vec<u8>,
    ids: IdList,
}

impl<'a> Claimed<'a> {
    fn new(seen: &'a crate::dedup::SeenIds) -> Claimed<'a> {
        Claimed {
            seen,
            groups: Vec::new(),
        }
    }

    /// Adds a claimed record to its channel's group.
    fn add(&mut self, channel: &str, line: Line<'_>, id: &str) {
        let at = match self.groups.iter().position(|g| g.channel == channel) {
            Some(at) => at,
            None => {
                self.groups.push(Group {
                    channel: channel.to_owned(),
                    lines: POOL.take(),
                    ids: IdList::default(),
                });
                self.groups.len() - 1
            }
        };
        let g = &mut self.groups[at];
        line.push_to(&mut g.lines);
        g.ids.push(id);
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        let held = self.groups.iter().flat_map(|g| g.ids.iter());
        self.seen.settle_each(held, false);
    }
}

/// A set with the per-process seeded foldhash (as the store's channel map):
/// looked up for every record received.
type FastSet<T> = HashSet<T, foldhash::fast::RandomState>;

/// A record as stored: one line, with or without its final `\n`.
#[derive(Clone, Copy)]
struct Line<'a>(&'a [u8]);

impl Line<'_> {
    /// Appends the line to `out`, ending it with one `\n`.
    fn push_to(self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.0);
        if !self.0.ends_with(b"\n") {
            out.push(b'\n');
        }
    }

    fn to_vec(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.0.len() + 1);
        self.push_to(&mut out);
        out
    }
}

async fn send_loop<S>(
    shared: Arc<Shared>,
    sink: Sink<S>,
    (mut chans, limit): (Vec<OutChannel>, BatchLimit),
    (mut acks, outstanding): (mpsc::Receiver<Ack>, Arc<AtomicBool>),
    cancel: CancellationToken,
    peer: String,
    metrics: Option<Arc<LinkStatus>>,
) -> Option<String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Channels already warned about on this connection (one warning each).
    let mut warned: HashSet<String> = HashSet::new();
    let mut positions: Vec<u64> = chans.iter().map(|c| c.reader.position()).collect();
    // Per channel, the batch read while the previous one was at the peer:
    // reading it then overlaps our reading with the peer's storing, which
    // stop-and-wait would otherwise run one after the other. Nothing of it
    // is logged or acknowledged until it is sent (a broken connection drops
    // it; the next one reads it again from the persisted cursor).
    let mut read_ahead: Vec<Option<Batch>> = chans.iter().map(|_| None).collect();
    loop {
        if cancel.is_cancelled() {
            return None;
        }
        let mut sent = false;
        let mut read_failed = false;
        for (i, ch) in chans.iter_mut().enumerate() {
            let read = match read_ahead[i].take() {
                Some(batch) => Ok(batch),
                None => tokio::task::block_in_place(|| ch.read_batch(limit)),
            };
            let batch = match read {
                Ok(b) => b,
                Err(e) => {
                    static READ_ERRORS: RateLimit = RateLimit::new(Duration::from_secs(10));
                    if let Some(n) = READ_ERRORS.check() {
                        log::error!(
                            "channel {:?}: cannot read for federation: {e}{n}",
                            ch.channel
                        );
                    }
                    read_failed = true;
                    continue;
                }
            };
            for &(from, to) in &batch.gaps {
                log::warn!(
                    "channel {:?}: bytes {from}..{to} to forward to {peer} are gone (segments deleted); skipped",
                    ch.channel
                );
                let mut ev = AuditEvent::new("replay_gap");
                ev.channel = ch.channel.clone();
                ev.direction = "outbound".into();
                ev.peer = peer.clone();
                ev.detail = format!("from={from} to={to}");
                shared.audit.log(ev);
            }
            if !batch.ids.is_empty() {
                let sent_at = std::time::Instant::now();
                if let Some(m) = &metrics {
                    m.unacked_bytes
                        .store(batch.body.len() as u64, Ordering::Relaxed);
                    m.unacked_records
                        .store(batch.ids.len() as u64, Ordering::Relaxed);
                }
                let full = batch.full;
                let msg = Message::Binary(Bytes::from_owner(Pooled::new(batch.body, &POOL)));
                outstanding.store(true, Ordering::Release);
                if let Err(e) = sink.lock().await.send(msg).await {
                    cancel.cancel();
                    return Some(format!("cannot send a batch: {e}"));
                }
                if full {
                    // More is likely waiting: read it while the peer stores this one
                    // (an error is met again, and reported, on the next read).
                    read_ahead[i] = tokio::task::block_in_place(|| ch.read_batch(limit)).ok();
                }
                let ack = tokio::select! {
                    _ = cancel.cancelled() => return None,
                    r = tokio::time::timeout(ACK_TIMEOUT, acks.recv()) => match r {
                        Ok(Some(ack)) => {
                            if let Some(m) = &metrics {
                                m.rtt.record(sent_at.elapsed());
                                m.unacked_bytes.store(0, Ordering::Relaxed);
                                m.unacked_records.store(0, Ordering::Relaxed);
                            }
                            ack
                        }
                        Ok(None) => return None,
                        Err(_) => {
                            cancel.cancel();
                            return Some(format!("no acknowledgement within {}s", ACK_TIMEOUT.as_secs()));
                        }
                    }
                };
                let mut refused = HashSet::new();
                if !ack.refused.is_empty() {
                    note_refusals(
                        &shared,
                        &peer,
                        &ch.channel,
                        metrics.as_deref(),
                        &ack.refused,
                        &mut warned,
                    );
                    refused.extend(ack.refused.iter().map(|r| r.id.as_str()));
                }
                let forwarded = batch.ids.iter().filter(|id| !refused.contains(id));
                shared
                    .audit
                    .log_forwards("outbound", &peer, &ch.channel, forwarded);
                sent = true;
            }
            if batch.end != positions[i] {
                positions[i] = batch.end;
                if let Some(path) = &ch.cursor {
                    if let Err(e) = tokio::task::block_in_place(|| write_offset(path, batch.end)) {
                        log::error!("cannot persist federation cursor {}: {e}", path.display());
                    }
                }
            }
        }
        if sent {
            continue;
        }
        if read_failed {
            // Unread data makes the waits below return at once: pause instead.
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            continue;
        }
        // Nothing to send: batch buffers unused for a while go.
        POOL.trim();
        let waits: Vec<_> = chans
            .iter()
            .map(|c| Box::pin(c.writer.notifier().changed_past(c.reader.position())))
            .collect();
        if waits.is_empty() {
            cancel.cancelled().await;
            return None;
        }
        tokio::select! {
            _ = cancel.cancelled() => return None,
            _ = futures_util::future::select_all(waits) => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Our records the peer refused (listed in its acknowledgement): they stay
/// in our channel files (nothing is deleted), are counted per channel,
/// audited one by one (`publish_refused`) and logged with one warning per
/// channel per connection. The cursor moves past them: resending the same
/// bytes would be refused again.
fn note_refusals(
    shared: &Shared,
    peer: &str,
    sent_channel: &str,
    status: Option<&LinkStatus>,
    refused: &[Refused],
    warned: &mut HashSet<String>,
) {
    let mut counts: std::collections::BTreeMap<&str, u64> = Default::default();
    for r in refused {
        let channel = if r.channel.is_empty() {
            sent_channel
        } else {
            r.channel.as_str()
        };
        if let Some(s) = status {
            s.count_refused(channel, 1);
            *counts.entry(channel).or_insert(0) += 1;
        }
        if warned.insert(channel.to_owned()) {
            log::warn!(
                "hub {peer} refused records of channel {channel:?} ({}: {}); they stay in this instance's channel files and are not forwarded",
                r.reason,
                RefusalReason::parse(&r.reason).describe()
            );
        }
        let mut ev = AuditEvent::new("publish_refused");
        ev.message_id = r.id.clone();
        ev.channel = channel.to_owned();
        ev.direction = "outbound".into();
        ev.peer = peer.to_owned();
        ev.detail = format!("reason={}", r.reason);
        shared.audit.log(ev);
    }
    for (channel, count) in counts {
        if let Some(s) = status {
            s.emit(super::status::LinkEvent::Refused {
                hub: peer.to_owned(),
                channel: channel.to_owned(),
                count,
            });
        }
    }
}

async fn ping_loop<S>(sink: Sink<S>, cancel: CancellationToken)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(PING_INTERVAL) => {}
        }
        if sink
            .lock()
            .await
            .send(Message::Ping(Vec::new().into()))
            .await
            .is_err()
        {
            cancel.cancel();
            return;
        }
    }
}
