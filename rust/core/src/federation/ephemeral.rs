//! The ephemeral client: a hub client with no local storage.
//! why this file is long: one client's whole life (connect, bounded publish with
//! refusals, close, fork safety) around its one connection task.
//!
//! `publish` hands a batch to the connection task through a bounded queue
//! (a full queue is an error the caller sees) and blocks until the hub
//! acknowledges the frame that carried it — the hub acknowledges only after
//! committing — or the connection is lost. Received messages are handed to
//! a handler (live only: the hub keeps no cursor for ephemeral peers).
//! Without auto-reconnect a lost connection stays lost and every publish
//! fails fast; with it, queued publishes wait for the next connection.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use lru::LruCache;
use rustls::ClientConfig;
use serde::Deserialize;
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use super::client::{connect_once, jittered, DialError, HubStream};
use super::status::RefusalReason;
use super::status::{LinkEvent, LinkStatus};
use super::wire::{split_batch, Ack, Refused, FEATURE_REFUSALS};
use super::{
    runtime, tls, FedError, HubEndpoint, LinkSettings, TlsSettings, ACK_TIMEOUT, PING_INTERVAL,
    READ_TIMEOUT,
};
use crate::envelope::{decode_valid, Envelope, NameKind, MAX_RECORD_BYTES};
use crate::lograte::RateLimit;
use crate::Error;

/// Invalid records from the hub, logged at most once per interval.
static INVALID_LOG: RateLimit = RateLimit::new(Duration::from_secs(10));

/// Ids remembered per connection to drop duplicates (as in 1.4).
const DEDUP_PER_CONNECTION: usize = 1024;

/// Settings of an ephemeral client.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct EphemeralConfig {
    pub name: String,
    pub hub: HubEndpoint,
    pub tls: TlsSettings,
    pub federation: LinkSettings,
    pub auto_reconnect: bool,
    /// Capacity of the outbound queue, in publish calls.
    pub buffer_messages: usize,
    /// Receives connection and refusal events.
    #[serde(skip)]
    pub events: Option<super::status::EventSink>,
}

/// Receives every message the hub streams, one frame at a time.
pub type ReceiveHandler = Arc<dyn Fn(Vec<Envelope>) + Send + Sync>;

struct Pending {
    body: Vec<u8>,
    /// Ids of the records in `body`, to match the hub's refusals.
    ids: Vec<String>,
    /// The records the hub refused (empty: all stored), or why the frame
    /// failed. Closed when the publisher stopped waiting (timeout): the
    /// publish is then not sent.
    done: oneshot::Sender<Result<Vec<Refused>, String>>,
}

/// Slice of a bounded wait between two checks for an interruption.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Runs `fut` on `rt` for at most `timeout`, asking `interrupted` every
/// 100 ms. `Ok(None)`: the time ran out; `Err(())`: interrupted.
fn wait_bounded<F: std::future::Future + Unpin>(
    rt: &Runtime,
    mut fut: F,
    timeout: Duration,
    interrupted: &mut dyn FnMut() -> bool,
) -> Result<Option<F::Output>, ()> {
    let started = std::time::Instant::now();
    loop {
        let left = timeout.saturating_sub(started.elapsed());
        let slice = left.min(WAIT_SLICE);
        if let Ok(out) = rt.block_on(async { tokio::time::timeout(slice, &mut fut).await }) {
            return Ok(Some(out));
        }
        if interrupted() {
            return Err(());
        }
        if left.is_zero() {
            return Ok(None);
        }
    }
}

struct Ctx {
    cfg: EphemeralConfig,
    tls: Arc<ClientConfig>,
    handler: Mutex<Option<ReceiveHandler>>,
    status: Arc<LinkStatus>,
    cancel: CancellationToken,
    /// The connection is gone for good (no auto-reconnect, or closed).
    dead: AtomicBool,
    last_error: Mutex<String>,
    /// The channels the hub allows us to publish, from its latest handshake
    /// (`None`: unrestricted, or a 1.4 hub that does not say).
    publish_allowed: Mutex<Option<Vec<String>>>,
    /// Publishes not yet answered by the hub: channel -> (records, bytes).
    in_flight: super::flush::InFlightMap,
}

/// A storage-less hub client.
pub struct EphemeralClient {
    owner: crate::fork::Owner,
    rt: Arc<Runtime>,
    ctx: Arc<Ctx>,
    queue: Mutex<Option<mpsc::Sender<Pending>>>,
    rx: Mutex<Option<mpsc::Receiver<Pending>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl EphemeralClient {
    /// Checks the settings and loads the TLS material; does not dial.
    pub fn new(cfg: EphemeralConfig) -> Result<EphemeralClient, FedError> {
        if cfg.name.is_empty() {
            return Err(FedError::Config("instance name must not be empty".into()));
        }
        if super::client::host_of(&cfg.hub.addr).is_none() {
            return Err(FedError::Config(format!(
                "hub address {:?} is not host:port",
                cfg.hub.addr
            )));
        }
        let material = tls::TlsMaterial::load(&cfg.tls)?;
        let client_tls = material
            .client_config()
            .map_err(|e| FedError::Tls(e.to_string()))?;
        let (tx, rx) = mpsc::channel(cfg.buffer_messages.max(1));
        let events = cfg.events.clone();
        Ok(EphemeralClient {
            owner: crate::fork::Owner::current(),
            rt: runtime()?,
            ctx: Arc::new(Ctx {
                cfg,
                tls: client_tls,
                handler: Mutex::new(None),
                status: Arc::new(LinkStatus::with_events(events)),
                cancel: CancellationToken::new(),
                dead: AtomicBool::new(false),
                last_error: Mutex::new(String::new()),
                publish_allowed: Mutex::new(None),
                in_flight: Mutex::new(Default::default()),
            }),
            queue: Mutex::new(Some(tx)),
            rx: Mutex::new(Some(rx)),
            task: Mutex::new(None),
        })
    }

    /// Sets the handler of received messages (before or after connecting).
    pub fn set_handler(&self, handler: ReceiveHandler) {
        *self.ctx.handler.lock().unwrap_or_else(|e| e.into_inner()) = Some(handler);
    }

    /// Connection state and counters.
    pub fn status(&self) -> &LinkStatus {
        &self.ctx.status
    }

    /// Bytes sent in the frame awaiting acknowledgement.
    pub fn unacked_bytes(&self) -> u64 {
        self.ctx.status.unacked_bytes.load(Ordering::Relaxed)
    }

    fn lost(&self) -> Error {
        let why = self
            .ctx
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Error::ConnectionLost(format!(
            "connection to hub {} lost: {why}",
            self.ctx.cfg.hub.addr
        ))
    }

    /// Dials the hub and waits up to `timeout` for the first connection.
    /// Idempotent once connected.
    pub fn connect(&self, timeout: Duration) -> Result<(), Error> {
        self.connect_within(timeout, &mut || false)
    }

    /// [`EphemeralClient::connect`], asking `interrupted` every 100 ms while
    /// it waits (true: stop waiting). Raises [`Error::Timeout`] when no
    /// connection was made in time, also with auto-reconnect (which then
    /// keeps dialing in the background).
    pub fn connect_within(
        &self,
        timeout: Duration,
        interrupted: &mut dyn FnMut() -> bool,
    ) -> Result<(), Error> {
        self.owner.check("ephemeral messenger")?;
        let Some(rx) = self.rx.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return if self.ctx.dead.load(Ordering::Acquire) {
                Err(self.lost())
            } else {
                Ok(())
            };
        };
        let (ready_tx, ready_rx) = oneshot::channel();
        let task = self.rt.spawn(run(self.ctx.clone(), rx, ready_tx));
        *self.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        let outcome = wait_bounded(&self.rt, ready_rx, timeout, interrupted);
        match outcome {
            Ok(Some(Ok(Ok(())))) => Ok(()),
            Ok(Some(Ok(Err(e)))) => Err(Error::ConnectionLost(format!(
                "cannot connect to hub {}: {e}",
                self.ctx.cfg.hub.addr
            ))),
            Ok(Some(Err(_))) => Err(self.lost()),
            Ok(None) | Err(()) => {
                let why = format!(
                    "no connection to hub {} within {:.1}s{}",
                    self.ctx.cfg.hub.addr,
                    timeout.as_secs_f64(),
                    if self.ctx.cfg.auto_reconnect {
                        " (still dialing in the background)"
                    } else {
                        ""
                    }
                );
                if !self.ctx.cfg.auto_reconnect {
                    self.close();
                    *self
                        .ctx
                        .last_error
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = why.clone();
                }
                Err(Error::Timeout(why))
            }
        }
    }

    /// Whether the hub (by its latest handshake) accepts `channel` from us;
    /// `Error::Policy` naming the channel and the hub if not.
    pub fn check_publish(&self, channel: &str) -> Result<(), Error> {
        let allowed = self
            .ctx
            .publish_allowed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match allowed.as_ref() {
            Some(a) if !a.iter().any(|c| c == channel) => Err(Error::Policy(format!(
                "hub {} refuses channel {channel:?} from {:?}: it is not in that peer's allowed publish list (hub.allowed_peers); nothing was sent",
                self.ctx.cfg.hub.addr, self.ctx.cfg.name
            ))),
            _ => Ok(()),
        }
    }

    /// Sends one frame body (length-prefixed records of `channel` with
    /// `ids`) and waits for the hub's acknowledgement. A channel the hub's
    /// handshake refuses, or records its acknowledgement lists as refused,
    /// give `Error::Policy` (nothing of a refused record was stored).
    pub fn send(&self, channel: &str, ids: Vec<String>, body: Vec<u8>) -> Result<(), Error> {
        self.send_within(channel, ids, body, ACK_TIMEOUT, &mut || false)
    }

    /// [`EphemeralClient::send`] waiting at most `timeout` for the
    /// acknowledgement, asking `interrupted` every 100 ms (true: stop
    /// waiting). Out of time it fails with [`Error::Timeout`]: a publish
    /// still queued is then not sent; one already sent may still be stored
    /// by the hub (at-least-once).
    pub fn send_within(
        &self,
        channel: &str,
        ids: Vec<String>,
        body: Vec<u8>,
        timeout: Duration,
        interrupted: &mut dyn FnMut() -> bool,
    ) -> Result<(), Error> {
        self.owner.check("ephemeral messenger")?;
        if self.ctx.dead.load(Ordering::Acquire) {
            return Err(self.lost());
        }
        self.check_publish(channel)?;
        // A frame over the hub's WebSocket limit would cost the connection
        // (and every publish merged with it); refuse it here instead.
        let limit = super::link::max_message_size(self.ctx.cfg.federation.max_batch_bytes);
        if body.len() > limit {
            return Err(Error::TooLarge {
                size: body.len(),
                limit,
            });
        }
        let tx = self
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Error::Closed("ephemeral messenger is closed".into()))?;
        if self
            .task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
        {
            return Err(Error::ConnectionLost(
                "not connected: call connect() first".into(),
            ));
        }
        let (done, wait) = oneshot::channel();
        let total = ids.len();
        let _in_flight =
            super::flush::InFlight::new(&self.ctx.in_flight, channel, total, body.len());
        match tx.try_send(Pending { body, ids, done }) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                return Err(Error::BufferFull(format!(
                    "the outbound buffer of {} publishes to hub {} is full",
                    self.ctx.cfg.buffer_messages.max(1),
                    self.ctx.cfg.hub.addr
                )))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(self.lost()),
        }
        match wait_bounded(&self.rt, wait, timeout, interrupted) {
            Ok(Some(Ok(Ok(refused)))) if refused.is_empty() => Ok(()),
            Ok(Some(Ok(Ok(refused)))) => {
                let first = &refused[0];
                let reason = RefusalReason::parse(&first.reason);
                Err(Error::Policy(format!(
                    "hub {} refused {} of {total} messages on channel {channel:?} from {:?} ({}: {}); refused messages were not stored",
                    self.ctx.cfg.hub.addr,
                    refused.len(),
                    self.ctx.cfg.name,
                    reason.as_str(),
                    reason.describe()
                )))
            }
            Ok(Some(Ok(Err(e)))) => Err(Error::ConnectionLost(format!(
                "connection to hub {} lost before the acknowledgement: {e}",
                self.ctx.cfg.hub.addr
            ))),
            Ok(Some(Err(_))) => Err(self.lost()),
            Ok(None) | Err(()) => Err(Error::Timeout(format!(
                "no acknowledgement from hub {} within {:.1}s ({}); a publish not yet sent \
                 is dropped, one already sent may still be stored by the hub",
                self.ctx.cfg.hub.addr,
                timeout.as_secs_f64(),
                if self.ctx.status.connected.load(Ordering::Acquire) {
                    "connected"
                } else {
                    "not connected"
                }
            ))),
        }
    }

    /// Publishes not yet answered by the hub, per channel.
    pub fn in_flight(&self) -> Vec<super::flush::PendingForward> {
        super::flush::in_flight(&self.ctx.in_flight, &self.ctx.cfg.hub.addr)
    }

    /// Waits up to `wait` for every publish in flight to be answered;
    /// returns those still waiting (empty: none in flight).
    pub fn wait_idle(&self, wait: Duration) -> Vec<super::flush::PendingForward> {
        super::flush::wait_idle(&self.ctx.in_flight, &self.ctx.cfg.hub.addr, wait)
    }

    /// Stops the connection; pending publishes fail. Idempotent. In a
    /// forked child it does nothing (the connection is the parent's).
    pub fn close(&self) {
        if self.owner.is_foreign() {
            return;
        }
        self.ctx.cancel.cancel();
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
        *self
            .ctx
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = "client closed".into();
        self.ctx.dead.store(true, Ordering::Release);
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = task {
            let _ = self
                .rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(5), t).await });
        }
    }
}

impl Drop for EphemeralClient {
    fn drop(&mut self) {
        if self.owner.is_foreign() {
            // The parent's runtime and task: never waited for here.
            std::mem::forget(self.rt.clone());
            if let Some(t) = self
                .task
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                std::mem::forget(t);
            }
            return;
        }
        self.close();
    }
}

fn fail_all(rx: &mut mpsc::Receiver<Pending>, why: &str) {
    rx.close();
    while let Ok(p) = rx.try_recv() {
        let _ = p.done.send(Err(why.to_owned()));
    }
}

async fn run(
    ctx: Arc<Ctx>,
    mut rx: mpsc::Receiver<Pending>,
    ready: oneshot::Sender<Result<(), String>>,
) {
    let mut ready = Some(ready);
    let link = &ctx.cfg.federation;
    let base = Duration::from_millis(link.reconnect_base_ms.max(1));
    let max = Duration::from_millis(link.reconnect_max_ms).max(base);
    let mut delay = base;
    loop {
        let dialed = tokio::select! {
            _ = ctx.cancel.cancelled() => break,
            r = connect_once(&ctx.cfg.name, link.max_batch_bytes, &ctx.cfg.hub, ctx.tls.clone(), true) => r,
        };
        let why = match dialed {
            Ok((ws, welcome)) => {
                delay = base;
                *ctx.publish_allowed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = welcome.publish_allowed.clone();
                // Subscriptions the hub says it will not deliver (a hub of
                // this implementation says so; a 1.4 hub does not).
                let hub_cfg = &ctx.cfg.hub;
                let refused = super::client::not_allowed(
                    &hub_cfg.subscribe,
                    welcome.subscribe_allowed.as_ref(),
                );
                for channel in &refused {
                    log::warn!(
                        "ephemeral: hub {} will not deliver channel {channel:?} to this peer (not in its allowed subscribe list)",
                        hub_cfg.addr
                    );
                }
                ctx.status.set_refused_channels(Vec::new(), refused);
                if ctx.status.connects.fetch_add(1, Ordering::Relaxed) > 0 {
                    ctx.status.reconnects.fetch_add(1, Ordering::Relaxed);
                }
                ctx.status.connected.store(true, Ordering::Release);
                let hub = ctx.cfg.hub.addr.clone();
                ctx.status.emit(LinkEvent::Connected { hub: hub.clone() });
                if let Some(r) = ready.take() {
                    let _ = r.send(Ok(()));
                }
                // A 1.4 hub (no features) stores a record at a time, each
                // fsynced: its frames are kept to a few hundred records.
                let max_records = match welcome.has_feature(FEATURE_REFUSALS) {
                    true => usize::MAX,
                    false => super::link::LEGACY_BATCH_RECORDS,
                };
                let why = serve(&ctx, ws, &mut rx, max_records).await;
                ctx.status.connected.store(false, Ordering::Release);
                if !ctx.cancel.is_cancelled() {
                    let reason = why.clone();
                    ctx.status.emit(LinkEvent::Disconnected { hub, reason });
                }
                why
            }
            Err(e) => {
                ctx.status.failed_attempts.fetch_add(1, Ordering::Relaxed);
                match e {
                    DialError::Rejected => super::client::rejected_text(&ctx.tls),
                    DialError::Failed(t) => t,
                }
            }
        };
        if ctx.cancel.is_cancelled() {
            break;
        }
        log::warn!("ephemeral client: hub {}: {why}", ctx.cfg.hub.addr);
        *ctx.last_error.lock().unwrap_or_else(|e| e.into_inner()) = why.clone();
        if !ctx.cfg.auto_reconnect {
            ctx.dead.store(true, Ordering::Release);
            if let Some(r) = ready.take() {
                let _ = r.send(Err(why.clone()));
            }
            fail_all(&mut rx, &why);
            return;
        }
        tokio::select! {
            _ = ctx.cancel.cancelled() => break,
            _ = tokio::time::sleep(jittered(delay, link.reconnect_jitter)) => {}
        }
        delay = (delay * 2).min(max);
    }
    fail_all(&mut rx, "client closed");
}

/// One connection: sends queued frames stop-and-wait, hands received frames
/// to the handler and acknowledges them. Returns why it ended.
async fn serve(
    ctx: &Arc<Ctx>,
    ws: HubStream,
    rx: &mut mpsc::Receiver<Pending>,
    max_records: usize,
) -> String {
    let (sink, mut stream) = ws.split();
    let sink = Arc::new(tokio::sync::Mutex::new(sink));
    let (ack_tx, mut ack_rx) = mpsc::channel::<Ack>(4);
    let conn_cancel = ctx.cancel.child_token();
    // Received frames are handed to the handler and acknowledged, in order,
    // by their own task, so the reader keeps reading the acknowledgements of
    // our publishes meanwhile (a handler may publish and wait for one).
    let (deliver_tx, mut deliver_rx) = mpsc::channel::<(Vec<Envelope>, String)>(4);
    let deliverer = {
        let (ctx, sink) = (ctx.clone(), sink.clone());
        tokio::spawn(async move {
            while let Some((fresh, last_id)) = deliver_rx.recv().await {
                let handler = ctx
                    .handler
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                if let (Some(h), false) = (handler, fresh.is_empty()) {
                    let _ = tokio::task::spawn_blocking(move || h(fresh)).await;
                }
                let ack = Message::Text(
                    Ack {
                        last_id,
                        ..Ack::default()
                    }
                    .to_json()
                    .into(),
                );
                if sink.lock().await.send(ack).await.is_err() {
                    return;
                }
            }
        })
    };
    let reader = {
        let cancel = conn_cancel.clone();
        tokio::spawn(async move {
            let mut seen: LruCache<String, ()> =
                LruCache::new(NonZeroUsize::new(DEDUP_PER_CONNECTION).expect("non-zero"));
            loop {
                let next = tokio::select! {
                    _ = cancel.cancelled() => return "closed".to_owned(),
                    r = tokio::time::timeout(READ_TIMEOUT, stream.next()) => r,
                };
                let msg = match next {
                    Err(_) => return format!("nothing received for {}s", READ_TIMEOUT.as_secs()),
                    Ok(None) => return "connection closed".to_owned(),
                    Ok(Some(Err(e))) => return e.to_string(),
                    Ok(Some(Ok(m))) => m,
                };
                match msg {
                    Message::Binary(body) => {
                        let Ok(records) = split_batch(&body) else {
                            return "malformed batch from the hub".to_owned();
                        };
                        let mut fresh = Vec::new();
                        let mut last_id = String::new();
                        for rec in records {
                            // The one definition of a valid record; an invalid
                            // one is not handed to the application.
                            let env = match decode_valid(rec, MAX_RECORD_BYTES, NameKind::Channel) {
                                Ok(env) => env,
                                Err(invalid) => {
                                    if let Some(more) = INVALID_LOG.check() {
                                        log::warn!("ephemeral client: skipped an invalid record from the hub: {}{more}", invalid.error);
                                    }
                                    continue;
                                }
                            };
                            if seen.put(env.id.clone(), ()).is_some() {
                                continue;
                            }
                            last_id = env.id.clone();
                            fresh.push(env);
                        }
                        if deliver_tx.send((fresh, last_id)).await.is_err() {
                            return "the connection is closing".to_owned();
                        }
                    }
                    Message::Text(text) => {
                        // Any text completes the frame in flight (as 1.4's client).
                        let _ = ack_tx.try_send(Ack::parse(text.as_str()).unwrap_or_default());
                    }
                    Message::Close(_) => return "hub closed the connection".to_owned(),
                    _ => {}
                }
            }
        })
    };
    tokio::pin!(reader);
    let mut ping = tokio::time::interval(PING_INTERVAL);
    ping.tick().await;
    let max_bytes = ctx.cfg.federation.max_batch_bytes.max(1);
    // A publish that did not fit the last frame goes first in the next.
    let mut carried: Option<Pending> = None;
    let why = loop {
        let first = if let Some(p) = carried.take() {
            p
        } else {
            tokio::select! {
            r = &mut reader => break r.unwrap_or_else(|e| e.to_string()),
            _ = ctx.cancel.cancelled() => break "closed".to_owned(),
            _ = ping.tick() => {
                if sink.lock().await.send(Message::Ping(Vec::new().into())).await.is_err() {
                    break "cannot send a ping".to_owned();
                }
                continue;
            }
            p = rx.recv() => match p {
                Some(p) if p.done.is_closed() => continue,
                Some(p) => p,
                None => break "closed".to_owned(),
            },
            }
        };
        // Everything queued right now goes in one frame, up to the size and
        // record limits: a publish that would take the frame past one waits
        // for the next frame (a single publish over a limit goes alone).
        let mut body = first.body;
        let mut records = first.ids.len();
        let mut waiting = vec![(first.ids, first.done)];
        while let Ok(p) = rx.try_recv() {
            if p.done.is_closed() {
                continue;
            }
            if body.len() + p.body.len() > max_bytes || records + p.ids.len() > max_records {
                carried = Some(p);
                break;
            }
            body.extend_from_slice(&p.body);
            records += p.ids.len();
            waiting.push((p.ids, p.done));
        }
        ctx.status
            .unacked_bytes
            .store(body.len() as u64, Ordering::Relaxed);
        let sent_at = std::time::Instant::now();
        if let Err(e) = sink.lock().await.send(Message::Binary(body.into())).await {
            let why = format!("cannot send: {e}");
            for (_, w) in waiting {
                let _ = w.send(Err(why.clone()));
            }
            break why;
        }
        let acked = tokio::select! {
            r = &mut reader => Err(r.unwrap_or_else(|e| e.to_string())),
            _ = ctx.cancel.cancelled() => Err("closed".to_owned()),
            r = tokio::time::timeout(ACK_TIMEOUT, ack_rx.recv()) => match r {
                Ok(Some(ack)) => Ok(ack),
                Ok(None) => Err("connection closed".to_owned()),
                Err(_) => Err(format!("no acknowledgement within {}s", ACK_TIMEOUT.as_secs())),
            },
        };
        ctx.status.unacked_bytes.store(0, Ordering::Relaxed);
        match acked {
            Ok(ack) => {
                ctx.status.rtt.record(sent_at.elapsed());
                for (ids, w) in waiting {
                    let mine: Vec<Refused> = ack
                        .refused
                        .iter()
                        .filter(|r| ids.contains(&r.id))
                        .cloned()
                        .collect();
                    let mut counts: std::collections::BTreeMap<&str, u64> = Default::default();
                    for r in &mine {
                        ctx.status.count_refused(&r.channel, 1);
                        *counts.entry(r.channel.as_str()).or_insert(0) += 1;
                    }
                    for (channel, count) in counts {
                        ctx.status.emit(LinkEvent::Refused {
                            hub: ctx.cfg.hub.addr.clone(),
                            channel: channel.to_owned(),
                            count,
                        });
                    }
                    let _ = w.send(Ok(mine));
                }
            }
            Err(why) => {
                for (_, w) in waiting {
                    let _ = w.send(Err(why.clone()));
                }
                break why;
            }
        }
    };
    conn_cancel.cancel();
    deliverer.abort();
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        sink.lock().await.close().await
    })
    .await;
    why
}
