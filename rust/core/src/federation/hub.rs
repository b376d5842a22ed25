//! The hub: accepts TLS connections, upgrades them to WebSockets, checks the
//! peer against `hub.allowed_peers`, then runs a link that stores what the
//! peer publishes and streams its subscribed channels from `fed-<peer>`
//! cursors (the backlog is sent at once, not on the next append).
//! why this file is long: accept, handshake, allowlist check, registration and
//! reload are one admission protocol whose ordering matters; read it in one place.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures_util::SinkExt;
use rustls::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use super::conns::{self, ConnGuard, ConnTable, Limits};
use super::link::{self, Inbound, OutChannel};
use super::status::{InboundCounts, Label, Tally};
use super::wire::{Handshake, CLOSE_NOT_ALLOWED, CLOSE_NOT_ALLOWED_REASON, FEATURE_REFUSALS};
use super::{tls, AllowedPeer, FedError, HubSettings, Shared, HANDSHAKE_TIMEOUT};
use crate::audit::AuditEvent;
use crate::envelope::{validate_name, NameKind, FED_CURSOR_PREFIX};
use crate::lograte::RateLimit;
use crate::storage::offsets::{
    list_offsets, offset_path, read_offset, subscribers_dir, write_offset,
};
use crate::storage::{compaction, LogReader};

/// A peer's WebSocket over the hub's TLS.
type WsStream = tokio_tungstenite::WebSocketStream<tokio_rustls::server::TlsStream<TcpStream>>;

/// Counters of the hub listener.
#[derive(Debug, Default)]
pub struct HubCounters {
    pub accepted: AtomicU64,
    /// Connections whose certificate's name is not in `allowed_peers`.
    pub rejected: AtomicU64,
    /// Connections that ended before their handshake completed, by stage.
    pub failed: Tally<OpeningFailure>,
    /// Records stored from peers and refused.
    pub inbound: Arc<InboundCounts>,
}

/// Where a connection that never became a link ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpeningFailure {
    /// The TLS handshake failed (no certificate, another CA's, expired, a
    /// protocol the hub refuses, not TLS at all).
    Tls,
    /// TLS completed but the WebSocket upgrade did not.
    Websocket,
    /// The first message was not a handshake (or not one this hub reads).
    Handshake,
    /// The whole opening took over `HANDSHAKE_TIMEOUT` (10 s).
    Timeout,
    /// Dropped unfinished to make room for newer connections (`conns.rs`).
    Evicted,
}

impl Label for OpeningFailure {
    const ALL: &'static [OpeningFailure] = &[
        OpeningFailure::Tls,
        OpeningFailure::Websocket,
        OpeningFailure::Handshake,
        OpeningFailure::Timeout,
        OpeningFailure::Evicted,
    ];

    /// `tls`, `websocket`, `handshake`, `timeout`, `evicted`.
    fn label(self) -> &'static str {
        match self {
            OpeningFailure::Tls => "tls",
            OpeningFailure::Websocket => "websocket",
            OpeningFailure::Handshake => "handshake",
            OpeningFailure::Timeout => "timeout",
            OpeningFailure::Evicted => "evicted",
        }
    }
}

/// Connected ephemeral peers: name -> (connection number -> its cancel
/// token). Any number of ephemeral connections may share a peer name.
type EphemeralConns = HashMap<String, HashMap<u64, CancellationToken>>;

/// A running hub listener.
pub struct Hub {
    addr: SocketAddr,
    /// The instance's shared state (its audit log, for reloads).
    shared: Arc<Shared>,
    counters: Arc<HubCounters>,
    peers: Arc<Mutex<HashMap<String, (u64, CancellationToken)>>>,
    ephemeral: Arc<Mutex<EphemeralConns>>,
    allowed: Arc<Mutex<Arc<Vec<AllowedPeer>>>>,
}

struct HubState {
    shared: Arc<Shared>,
    cfg: HubSettings,
    /// `hub.allowed_peers`, replaceable while running ([`Hub::set_allowed_peers`]).
    allowed: Arc<Mutex<Arc<Vec<AllowedPeer>>>>,
    /// The server configuration for the next accept (replaced by a TLS reload).
    tls: Arc<tls::Reloadable<ServerConfig>>,
    counters: Arc<HubCounters>,
    /// Connected durable peers: name -> (connection number, its cancel token).
    peers: Arc<Mutex<HashMap<String, (u64, CancellationToken)>>>,
    /// Connected ephemeral peers: name -> their connections' cancel tokens.
    ephemeral: Arc<Mutex<EphemeralConns>>,
    next_conn: AtomicU64,
    /// Channels each peer has created (its `max_channels` budget).
    budgets: Mutex<HashMap<String, Arc<super::ChannelBudget>>>,
    /// Every connection, opening or established, and their limits.
    conns: Arc<ConnTable>,
    /// Warnings of peers rejected by the allowlist: one per 10 s (each is
    /// audited); this hub's own, so another hub's rejections never hide it.
    rejections: RateLimit,
    /// Logs of connections failed before their handshake ended (counted by
    /// stage), and of peers connecting again: one per 10 s each.
    opening_failures: RateLimit,
    reconnects: RateLimit,
    /// One per durable peer name, held while a connection of that peer is
    /// served: a newer connection waits for the older one (cancelled) to
    /// end, so two never write the peer's cursors at once.
    serving: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Hub {
    /// Binds `hub.listen_addr` and starts accepting, plus the cursor sweep.
    pub async fn start(
        shared: Arc<Shared>,
        cfg: HubSettings,
        tls: Arc<tls::Reloadable<ServerConfig>>,
    ) -> Result<(Hub, Vec<tokio::task::JoinHandle<()>>), FedError> {
        let (listener, addr) = super::bind(&cfg.listen_addr).await?;
        log::info!("hub {:?} listening on {addr}", shared.name);
        crate::memtrim::configure();
        let counters = Arc::new(HubCounters::default());
        let peers = Arc::new(Mutex::new(HashMap::new()));
        let ephemeral = Arc::new(Mutex::new(HashMap::new()));
        let allowed = Arc::new(Mutex::new(Arc::new(cfg.allowed_peers.clone())));
        let state = Arc::new(HubState {
            shared: shared.clone(),
            cfg,
            allowed: allowed.clone(),
            tls,
            counters: counters.clone(),
            peers: peers.clone(),
            ephemeral: ephemeral.clone(),
            next_conn: AtomicU64::new(1),
            rejections: RateLimit::new(Duration::from_secs(10)),
            opening_failures: RateLimit::new(Duration::from_secs(10)),
            reconnects: RateLimit::new(Duration::from_secs(10)),
            serving: Mutex::new(HashMap::new()),
            budgets: Mutex::new(HashMap::new()),
            conns: Arc::new(ConnTable::new(Limits::for_this_process())),
        });
        let mut tasks = vec![
            tokio::spawn(accept_loop(state.clone(), listener)),
            tokio::spawn(trim_loop(state.clone())),
        ];
        if state.cfg.fed_client_offset_ttl_s >= 0.0 {
            tasks.push(tokio::spawn(sweep_loop(state)));
        }
        Ok((
            Hub {
                addr,
                shared,
                counters,
                peers,
                ephemeral,
                allowed,
            },
            tasks,
        ))
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connection and record counts.
    pub fn counters(&self) -> &HubCounters {
        &self.counters
    }

    /// Replaces `hub.allowed_peers` (a configuration reload). New connections
    /// are checked against `peers`; a connected durable peer that is no longer
    /// listed, or whose entry changed, is disconnected so that it reconnects
    /// under the new entry; so is every ephemeral connection of such a peer.
    /// Returns the names disconnected (each once).
    pub fn set_allowed_peers(&self, peers: Vec<AllowedPeer>) -> Vec<String> {
        let new: HashMap<&str, &AllowedPeer> = peers.iter().map(|p| (p.name.as_str(), p)).collect();
        let old = {
            let mut slot = self.allowed.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *slot, Arc::new(peers.clone()))
        };
        let changed = |name: &str| match (old.iter().find(|p| p.name == name), new.get(name)) {
            (Some(a), Some(b)) => {
                a.subscribe != b.subscribe
                    || a.publish != b.publish
                    || a.max_channels != b.max_channels
            }
            _ => true,
        };
        let mut dropped: Vec<String> = Vec::new();
        for (name, (_, cancel)) in self.peers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            if changed(name) {
                cancel.cancel();
                dropped.push(name.clone());
            }
        }
        for (name, conns) in self
            .ephemeral
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            if changed(name) {
                conns.values().for_each(CancellationToken::cancel);
                dropped.push(name.clone());
            }
        }
        dropped.sort();
        dropped.dedup();
        log::info!(
            "hub: allowed_peers reloaded ({} peers); disconnected {dropped:?}",
            new.len()
        );
        // An event 1.4 defines and never writes (it cannot reload).
        let detail = format!("peers={} disconnected={}", new.len(), list_text(&dropped));
        audit(&self.shared, "policy_reloaded", "", "", detail);
        dropped
    }

    /// Names of the peers connected now.
    pub fn connected_peers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        v.extend(
            self.ephemeral
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .keys()
                .cloned(),
        );
        v.sort();
        v.dedup();
        v
    }
}

/// First and longest wait after a failed accept (doubling in between).
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How often freed memory is given back after connections ended.
const TRIM_INTERVAL: Duration = Duration::from_secs(1);

static ACCEPT_ERRORS: RateLimit = RateLimit::new(Duration::from_secs(10));
static EVICTIONS: RateLimit = RateLimit::new(Duration::from_secs(10));

/// Whether an accept failed for want of file descriptors.
fn out_of_descriptors(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Accepts connections. Each is registered in the connection table (which
/// drops the oldest unfinished connection when too many are opening). A
/// failed accept backs off (10 ms doubling to 1 s) instead of spinning;
/// when descriptors ran out, the oldest unfinished connection is dropped
/// so that the connections waiting in the backlog can be taken.
async fn accept_loop(state: Arc<HubState>, listener: TcpListener) {
    let cancel = state.shared.cancel.clone();
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            r = listener.accept() => r,
        };
        let (tcp, remote) = match accepted {
            Ok(pair) => {
                backoff = ACCEPT_BACKOFF_MIN;
                pair
            }
            Err(e) => {
                let freed = out_of_descriptors(&e) && state.conns.evict_oldest_pending();
                if let Some(n) = ACCEPT_ERRORS.check() {
                    log::warn!(
                        "hub: accept failed: {e}{}; retrying in {backoff:?}{n}",
                        if freed {
                            "; dropped the oldest unfinished connection"
                        } else {
                            ""
                        }
                    );
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let (conn, evicted) = state.conns.admit(&cancel);
        if evicted {
            if let Some(n) = EVICTIONS.check() {
                log::warn!(
                    "hub: {} connections are still opening; dropped the oldest for {remote}{n}",
                    state.conns.limits().pending
                );
            }
        }
        tokio::spawn(serve(state.clone(), tcp, remote, conn));
    }
}

/// Gives freed memory back to the system after connections ended or large
/// batches were processed (see `memtrim`).
async fn trim_loop(state: Arc<HubState>) {
    loop {
        tokio::select! {
            _ = state.shared.cancel.cancelled() => return,
            _ = tokio::time::sleep(TRIM_INTERVAL) => {}
        }
        let closed = state.conns.take_closed();
        let _ = tokio::task::spawn_blocking(move || {
            super::buffers::POOL.trim();
            crate::memtrim::trim_if_requested(closed)
        })
        .await;
    }
}

fn audit(shared: &Shared, event: &'static str, peer: &str, peer_addr: &str, detail: String) {
    let mut ev = AuditEvent::new(event);
    ev.peer = peer.to_owned();
    ev.peer_addr = peer_addr.to_owned();
    ev.detail = detail;
    shared.audit.log(ev);
}

fn list_text(items: &[String]) -> String {
    format!("[{}]", items.join(","))
}

/// The allowlist entry of `peer`, if it has one and its name is a valid
/// peer name.
fn allowed_entry(state: &HubState, peer: &str) -> Option<AllowedPeer> {
    if validate_name(NameKind::PeerName, peer).is_err() {
        return None;
    }
    let allowed = state
        .allowed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    allowed.iter().find(|p| p.name == peer).cloned()
}

/// Refuses a peer the allowlist does not name: counted, logged (rate
/// limited), told with close code 4403 (up to a second), audited.
async fn reject(state: &HubState, mut ws: WsStream, peer: &str, remote: SocketAddr) {
    state.counters.rejected.fetch_add(1, Ordering::Relaxed);
    if let Some(more) = state.rejections.check() {
        log::warn!("hub: rejected peer {peer:?} from {remote}: not in allowed_peers{more}");
    }
    let close = CloseFrame {
        code: CloseCode::from(CLOSE_NOT_ALLOWED),
        reason: CLOSE_NOT_ALLOWED_REASON.into(),
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        ws.send(Message::Close(Some(close))).await?;
        // The peer's handshake may be unread (it is refused before being
        // read): closing with unread bytes would make the kernel answer with
        // a reset, which can destroy the close frame before the peer reads
        // it. So: half-close, then discard (unparsed, in a small buffer) what
        // the peer still sends, until it closes or the second is up.
        let tls = ws.get_mut();
        let _ = tls.shutdown().await;
        let mut sink = [0u8; 16 * 1024];
        while matches!(tls.read(&mut sink).await, Ok(n) if n > 0) {}
        Ok::<_, tokio_tungstenite::tungstenite::Error>(())
    })
    .await;
    audit(&state.shared, "client_rejected", peer, "", String::new());
}

/// Channels delivered to a peer: requested ∩ allowed (all requested when the
/// peer's subscribe allowlist is empty), without duplicates.
fn effective_subscription(requested: &[String], peer: &AllowedPeer) -> Vec<String> {
    let mut seen = HashSet::new();
    requested
        .iter()
        .filter(|c| peer.subscribe.is_empty() || peer.subscribe.contains(c))
        .filter(|c| seen.insert((*c).clone()))
        .cloned()
        .collect()
}

/// A connection's entry in the hub's table of connected peers, from its
/// handshake until it ends (removed on drop, whatever path ends it).
///
/// A newer durable connection of the same peer replaces the older one (both
/// would advance the same fed-<peer> cursors). Ephemeral connections have no
/// cursor, so any number may share a peer name (Spark tasks do).
struct Registration {
    state: Arc<HubState>,
    peer: String,
    conn: u64,
    ephemeral: bool,
}

impl Registration {
    fn new(state: &Arc<HubState>, peer: &str, ephemeral: bool, cancel: CancellationToken) -> Self {
        let conn = state.next_conn.fetch_add(1, Ordering::Relaxed);
        if ephemeral {
            state
                .ephemeral
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(peer.to_owned())
                .or_default()
                .insert(conn, cancel);
        } else {
            let older = state
                .peers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(peer.to_owned(), (conn, cancel));
            if let Some((_, old)) = older {
                if let Some(more) = state.reconnects.check() {
                    log::warn!(
                        "hub: peer {peer:?} connected again; closing its older connection{more}"
                    );
                }
                old.cancel();
            }
        }
        Registration {
            state: state.clone(),
            peer: peer.to_owned(),
            conn,
            ephemeral,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let (peer, conn) = (&self.peer, self.conn);
        if self.ephemeral {
            let mut eph = self
                .state
                .ephemeral
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(conns) = eph.get_mut(peer) {
                conns.remove(&conn);
                if conns.is_empty() {
                    eph.remove(peer);
                }
            }
        } else {
            let mut peers = self.state.peers.lock().unwrap_or_else(|e| e.into_inner());
            if peers.get(peer).is_some_and(|(c, _)| *c == conn) {
                peers.remove(peer);
            }
        }
    }
}

async fn serve(state: Arc<HubState>, tcp: TcpStream, remote: SocketAddr, guard: ConnGuard) {
    let shared = state.shared.clone();
    let remote_s = remote.to_string();
    let _ = tcp.set_nodelay(true);
    let ws_cfg = conns::ws_config(shared.link.max_batch_bytes);
    // TLS, upgrade and the client's handshake must all arrive in time, and
    // the connection may be evicted meanwhile (conns.rs).
    let opening = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let tls = TlsAcceptor::from(state.tls.current())
            .accept(tcp)
            .await
            .map_err(|e| (OpeningFailure::Tls, format!("TLS handshake: {e}")))?;
        let cn = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| tls::peer_cn(c))
            .ok_or_else(|| {
                let why = "client certificate has no subject CN";
                (OpeningFailure::Tls, why.to_string())
            })?;
        guard.identified(&cn);
        // A peer the allowlist does not name is refused before its handshake
        // is read: a handshake may be megabytes, which only allowed peers
        // get to make this hub hold.
        let allowed_now = allowed_entry(&state, &cn).is_some();
        let mut ws = tokio_tungstenite::accept_async_with_config(tls, Some(ws_cfg))
            .await
            .map_err(|e| (OpeningFailure::Websocket, format!("WebSocket upgrade: {e}")))?;
        if !allowed_now {
            return Ok((ws, cn, None));
        }
        let first = link::next_data(&mut ws).await;
        let hello = match first {
            Some(Ok(Message::Text(t))) => Handshake::decode(t.as_str()).map_err(|e| {
                (
                    OpeningFailure::Handshake,
                    format!("bad handshake JSON: {e}"),
                )
            })?,
            other => {
                let why = format!("expected a text handshake, got {other:?}");
                return Err((OpeningFailure::Handshake, why));
            }
        };
        Ok::<_, (OpeningFailure, String)>((ws, cn, Some(hello)))
    });
    let opened = tokio::select! {
        _ = guard.cancel.cancelled() => {
            // Evicted for newer connections, or the hub is closing.
            if !shared.cancel.is_cancelled() {
                state.counters.failed.add(OpeningFailure::Evicted);
            }
            log::debug!("hub: connection from {remote} dropped before its handshake ended");
            return;
        }
        r = opening => r,
    };
    let (mut ws, peer, hello) = match opened {
        Ok(Ok(v)) => v,
        Ok(Err((stage, e))) => {
            state.counters.failed.add(stage);
            if let Some(more) = state.opening_failures.check() {
                log::info!("hub: connection from {remote} failed: {e}{more}");
            }
            return;
        }
        Err(_) => {
            state.counters.failed.add(OpeningFailure::Timeout);
            if let Some(more) = state.opening_failures.check() {
                log::info!("hub: connection from {remote} timed out before the handshake{more}");
            }
            return;
        }
    };
    let Some(hello) = hello else {
        return reject(&state, ws, &peer, remote).await;
    };
    // Registered before the allowlist is read again, so a reload either
    // finds this connection (and disconnects it if its entry changed) or
    // happened before the read (and this connection gets the new entry):
    // never neither.
    let registration = Registration::new(&state, &peer, hello.ephemeral, guard.cancel.clone());
    let Some(entry) = allowed_entry(&state, &peer) else {
        // Unregistered before the close handshake (up to a second): a
        // rejected peer is never listed among the connected ones once its
        // client has been told.
        drop(registration);
        return reject(&state, ws, &peer, remote).await;
    };
    if let Err(e) = guard.establish() {
        log::warn!("hub: closing the connection of {peer:?} from {remote}: {e}");
        return;
    }
    // A durable peer's older connection, cancelled by the registration,
    // ends (and writes its cursors) before this one reads them.
    let _serving = if hello.ephemeral {
        None
    } else {
        let lock = state
            .serving
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(peer.clone())
            .or_default()
            .clone();
        tokio::select! {
            _ = guard.cancel.cancelled() => return,
            held = tokio::time::timeout(HANDSHAKE_TIMEOUT, lock.lock_owned()) => match held {
                Ok(held) => Some(held),
                Err(_) => {
                    log::warn!(
                        "hub: closing the new connection of {peer:?} from {remote}: its older \
                         connection did not end within {HANDSHAKE_TIMEOUT:?}"
                    );
                    return;
                }
            },
        }
    };
    // The peer's readers start before it is welcomed: a client whose
    // connect returned gets every record published after that (an ephemeral
    // peer starts at the end, so a record published between the welcome and
    // its readers' start was never sent to it).
    let subscription = effective_subscription(&hello.subscribe, &entry);
    // One budget of new channels per peer name, for what it publishes and
    // what it subscribes to alike (a subscription creates its channel).
    let budget = state
        .budgets
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(peer.clone())
        .or_insert_with(|| Arc::new(super::ChannelBudget::new(entry.max_channels)))
        .clone();
    // The entry in force now: a reload may have changed it since the budget
    // was made (and disconnected the peer, which is why it is here again).
    budget.set_limit(entry.max_channels);
    let subscription = within_budget(&shared, &peer, subscription, &budget);
    let out = match open_channels(&shared, &peer, &subscription, hello.ephemeral).await {
        Ok(out) => out,
        Err(e) => {
            log::error!("hub: cannot serve {peer:?}: {e}");
            return;
        }
    };
    // A client that asked to hear of refusals (wire::FEATURE_REFUSALS) is
    // told its allowlist now; a 1.4 client gets the 1.4 handshake.
    let report_refusals = hello.has_feature(FEATURE_REFUSALS);
    let mut welcome = Handshake::hub(&shared.name);
    if report_refusals {
        welcome.features = vec![FEATURE_REFUSALS.into()];
        welcome.publish_allowed = (!entry.publish.is_empty()).then(|| entry.publish.clone());
        welcome.subscribe_allowed = (!entry.subscribe.is_empty()).then(|| entry.subscribe.clone());
    }
    if ws
        .send(Message::Text(welcome.to_json().into()))
        .await
        .is_err()
    {
        return;
    }
    state.counters.accepted.fetch_add(1, Ordering::Relaxed);
    let mut detail = format!("addr={remote_s}");
    if !subscription.is_empty() {
        detail.push_str(&format!(" sub={}", list_text(&subscription)));
    }
    if !entry.publish.is_empty() {
        detail.push_str(&format!(" pub={}", list_text(&entry.publish)));
    }
    let cancel = guard.cancel.clone();
    audit(&shared, "client_connected", &peer, &remote_s, detail);
    log::info!(
        "hub: {} peer {peer:?} connected from {remote}",
        if hello.ephemeral {
            "ephemeral"
        } else {
            "durable"
        }
    );
    let started = Instant::now();
    let inbound = Inbound {
        allow: (!entry.publish.is_empty()).then(|| entry.publish.iter().cloned().collect()),
        peer: peer.clone(),
        counts: Some(state.counters.inbound.clone()),
        link: None,
        dead_letters: false,
        channel_budget: Some(budget),
        report_refusals,
    };
    let ended = link::run(shared.clone(), ws, out, inbound, cancel).await;
    drop(registration);
    let mut detail = format!("duration={}", crate::audit::go_duration(started.elapsed()));
    if let Some(err) = ended {
        detail.push_str(&format!(" err={err}"));
    }
    audit(&shared, "peer_disconnected", &peer, &remote_s, detail);
}

/// The subscribed channels that exist or that the peer's `max_channels`
/// budget lets it create: subscribing to a channel creates it (its segment
/// file and the peer's cursor), so without the budget one handshake naming
/// thousands of new channels made thousands of directories and files. The
/// others are left out, with a warning.
fn within_budget(
    shared: &Shared,
    peer: &str,
    subscription: Vec<String>,
    budget: &super::ChannelBudget,
) -> Vec<String> {
    let (kept, over): (Vec<String>, Vec<String>) = subscription.into_iter().partition(|ch| {
        validate_name(NameKind::Channel, ch).is_err() || budget.admits(&shared.store, ch)
    });
    if !over.is_empty() {
        let shown: Vec<&str> = over.iter().take(5).map(String::as_str).collect();
        log::warn!(
            "hub: peer {peer:?} may create no more channels (max_channels): not subscribed to {} \
             channel(s) that do not exist yet: {shown:?}{}",
            over.len(),
            if over.len() > shown.len() { " ..." } else { "" }
        );
    }
    kept
}

/// Readers for the effective subscription, at each `fed-<peer>` cursor
/// (created at the current end if absent). Ephemeral peers get no cursor
/// files: they start at the end and keep their position in memory.
async fn open_channels(
    shared: &Arc<Shared>,
    peer: &str,
    channels: &[String],
    ephemeral: bool,
) -> Result<Vec<OutChannel>, String> {
    let mut out = Vec::new();
    // Invalid names: how many, and the first few reasons.
    let (mut invalid, mut shown) = (0usize, Vec::new());
    for channel in channels {
        if let Err(e) = validate_name(NameKind::Channel, channel) {
            invalid += 1;
            if shown.len() < 3 {
                shown.push(e.to_string());
            }
            continue;
        }
        let store = shared.store.clone();
        let (ch, p, data_dir) = (
            channel.clone(),
            peer.to_owned(),
            shared.store.data_dir().to_owned(),
        );
        let opened = tokio::task::spawn_blocking(move || -> Result<OutChannel, String> {
            let writer = store.writer(&ch).map_err(|e| e.to_string())?;
            let end = writer.committed_end();
            let cursor = (!ephemeral).then(|| {
                offset_path(
                    &subscribers_dir(&data_dir, &ch),
                    &format!("{FED_CURSOR_PREFIX}{p}"),
                )
            });
            let start = match &cursor {
                Some(path) => {
                    let named = |e: std::io::Error| format!("cursor {}: {e}", path.display());
                    let stored = read_offset(path).map_err(named)?;
                    let start = stored.map_or(end, |s| s.min(end));
                    if let Some(dir) = path.parent() {
                        crate::storage::segment::create_dir_all(dir).map_err(named)?;
                    }
                    write_offset(path, start).map_err(named)?;
                    start
                }
                None => end,
            };
            Ok(OutChannel {
                channel: ch,
                reader: LogReader::new(writer.dir(), start),
                writer,
                cursor,
                only_origin: None,
            })
        })
        .await
        .map_err(|e| e.to_string())??;
        out.push(opened);
    }
    if invalid > 0 {
        // One line per handshake, however many names it holds.
        log::warn!(
            "hub: peer {peer:?} asked for {invalid} invalid channel name(s), left out: {}{}",
            shown.join("; "),
            if invalid > shown.len() { "; ..." } else { "" }
        );
    }
    Ok(out)
}

/// Deletes `fed-*.offset` cursors older than the TTL, except those of peers
/// connected now (the original swept live peers too).
async fn sweep_loop(state: Arc<HubState>) {
    let ttl = Duration::from_secs_f64(state.cfg.fed_client_offset_ttl_s.max(1.0));
    let every = if ttl < Duration::from_secs(3600) {
        (ttl / 2).max(Duration::from_secs(60))
    } else {
        Duration::from_secs(3600)
    };
    loop {
        tokio::select! {
            _ = state.shared.cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let connected: HashSet<String> = state
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        let root = state.shared.store.data_dir().to_owned();
        let _ = tokio::task::spawn_blocking(move || sweep(&root, ttl, &connected)).await;
    }
}

/// One cursor sweep over every channel of `root`; returns the files removed.
pub fn sweep(
    root: &std::path::Path,
    ttl: Duration,
    connected: &HashSet<String>,
) -> Vec<std::path::PathBuf> {
    let mut removed = Vec::new();
    let Ok(channels) = compaction::list_channels(root) else {
        return removed;
    };
    for channel in channels {
        let Ok(files) = list_offsets(&subscribers_dir(root, &channel)) else {
            continue;
        };
        for (id, path) in files {
            let Some(peer) = id.strip_prefix(FED_CURSOR_PREFIX) else {
                continue;
            };
            if connected.contains(peer) {
                continue;
            }
            let age = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|m| SystemTime::now().duration_since(m).ok())
                .unwrap_or_default();
            if age > ttl && std::fs::remove_file(&path).is_ok() {
                log::info!("hub: removed stale federation cursor {}", path.display());
                removed.push(path);
            }
        }
    }
    removed
}
