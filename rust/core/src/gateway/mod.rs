//! The HTTP gateway: publish and subscribe over HTTPS for programs in any
//! language and for browsers, on the federation runtime.
//!
//! `POST /v1/channels/{channel}/messages` publishes through the channel
//! writer (201 once committed); `GET` on the same path streams Server-Sent
//! Events or answers long-poll JSON; `GET /v1/channels/{channel}/ws` is a
//! WebSocket for both directions; `GET /v1/openapi.json` describes it all.
//! Clients authenticate with a client certificate (CN checked against
//! `hub.allowed_peers`) or a bearer token (`gateway.tokens`, hashes only);
//! body size, per-client rate, open streams and slow clients are bounded,
//! and every refusal is counted ([`GatewayCounters`]).

mod activity;
pub mod auth;
mod conn;
mod http;
mod publish;
mod reply;
mod slots;
mod stream;
mod ws;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::Deserialize;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::federation::{self, AllowedPeer, FedError, TlsSettings};
use crate::storage::{ChannelWriter, LogReader};
use crate::StartPosition;

pub use auth::{token_hash, TokenEntry};

/// One message to publish (its payload compact JSON).
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    pub payload_type: &'a str,
    pub payload_json: &'a [u8],
    pub service_name: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
}

/// What the gateway needs of the messenger (the engine implements it, so
/// the gateway does not depend on the engine module).
pub trait Backend: Send + Sync {
    /// The instance name.
    fn instance_name(&self) -> String;
    /// Publishes `items` as one group through the channel writer; returns
    /// `(id, offset)` of each once committed.
    fn publish(
        &self,
        channel: &str,
        items: &[Item<'_>],
    ) -> Result<Vec<(String, u64)>, crate::Error>;
    /// Whether `channel` exists.
    fn channel_exists(&self, channel: &str) -> bool;
    /// A reader of `channel` at `pos`, and its writer; a missing channel is
    /// created when `create` (as a subscribe does), else an error.
    fn open_reader(
        &self,
        channel: &str,
        pos: StartPosition,
        create: bool,
    ) -> Result<(LogReader, Arc<ChannelWriter>), crate::Error>;
}

/// The `gateway` section, with `tls` and `hub.allowed_peers` beside it.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct GatewayConfig {
    pub listen_addr: String,
    pub tls: TlsSettings,
    /// `hub.allowed_peers`: client certificates are checked against it.
    pub allowed_peers: Vec<AllowedPeer>,
    pub tokens: Vec<TokenEntry>,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Requests per second per client (429 above); 0 turns it off.
    pub rate_limit_per_s: f64,
    /// Requests a client may make at once before the rate applies.
    pub rate_limit_burst: u32,
    /// Most streams (SSE, long polls, WebSockets) open at once (503 above);
    /// one client may hold a quarter of them (429 above).
    pub max_streams: usize,
    /// Most connections open at once; further ones wait in the backlog.
    pub max_connections: usize,
    /// Time a client has to send a request's headers.
    pub header_timeout_ms: u64,
    /// A connection with no byte moved either way for this long is closed.
    pub idle_timeout_ms: u64,
    /// Longest `wait` of a long poll.
    pub max_wait_ms: u64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen_addr: String::new(),
            tls: TlsSettings::default(),
            allowed_peers: Vec::new(),
            tokens: Vec::new(),
            max_body_bytes: 1024 * 1024,
            rate_limit_per_s: 100.0,
            rate_limit_burst: 200,
            max_streams: 256,
            max_connections: 1024,
            header_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            max_wait_ms: 30_000,
        }
    }
}

/// What the gateway did and refused, by reason.
#[derive(Debug, Default)]
pub struct GatewayCounters {
    pub requests: AtomicU64,
    pub published: AtomicU64,
    pub delivered: AtomicU64,
    pub streams_open: AtomicU64,
    pub refused_unauthenticated: AtomicU64,
    pub refused_forbidden: AtomicU64,
    pub refused_too_large: AtomicU64,
    pub refused_rate_limited: AtomicU64,
    pub refused_too_many_streams: AtomicU64,
    pub refused_bad_request: AtomicU64,
    /// Connections dropped before their first request to make room for
    /// others (`gateway.max_connections` all taken, or a quarter of them
    /// opening from one address).
    pub refused_too_many_connections: AtomicU64,
    /// TLS handshakes that failed (not TLS, an untrusted certificate, closed early).
    pub refused_tls: AtomicU64,
    /// Requests refused (429) without checking their token: their address
    /// sent too many bad tokens.
    pub refused_too_many_auth_failures: AtomicU64,
    /// Publishes or reads that failed in storage (disk full, EIO: 500).
    pub refused_storage: AtomicU64,
    pub timed_out: AtomicU64,
}

impl GatewayCounters {
    /// `(name, value)` of every counter, for stats and metrics.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("requests", g(&self.requests)),
            ("published", g(&self.published)),
            ("delivered", g(&self.delivered)),
            ("streams_open", g(&self.streams_open)),
            ("refused_unauthenticated", g(&self.refused_unauthenticated)),
            ("refused_forbidden", g(&self.refused_forbidden)),
            ("refused_too_large", g(&self.refused_too_large)),
            ("refused_rate_limited", g(&self.refused_rate_limited)),
            (
                "refused_too_many_streams",
                g(&self.refused_too_many_streams),
            ),
            ("refused_bad_request", g(&self.refused_bad_request)),
            (
                "refused_too_many_connections",
                g(&self.refused_too_many_connections),
            ),
            ("refused_tls", g(&self.refused_tls)),
            (
                "refused_too_many_auth_failures",
                g(&self.refused_too_many_auth_failures),
            ),
            ("refused_storage", g(&self.refused_storage)),
            ("timed_out", g(&self.timed_out)),
        ]
    }
}

/// Who may connect: `hub.allowed_peers` and `gateway.tokens`, replaceable
/// while running ([`Gateway::set_access`]).
pub(crate) struct Access {
    pub peers: Vec<AllowedPeer>,
    pub tokens: Vec<TokenEntry>,
}

/// State shared by the gateway's tasks.
pub(crate) struct State {
    pub access: std::sync::RwLock<Arc<Access>>,
    /// Channels each client's publishes created (`hub.allowed_peers[].max_channels`).
    pub budgets:
        std::sync::Mutex<std::collections::HashMap<String, Arc<federation::ChannelBudget>>>,
    pub engine: Weak<dyn Backend>,
    pub cfg: GatewayConfig,
    pub counters: Arc<GatewayCounters>,
    pub limiter: auth::RateLimiter,
    /// Bad tokens per source address ([`auth::AUTH_FAILURE_RATE`]).
    pub auth_failures: auth::RateLimiter,
    pub streams: Arc<tokio::sync::Semaphore>,
    /// Streams open per client label (each holds a quarter of `max_streams`).
    pub streams_by: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    pub cancel: CancellationToken,
}

/// A running gateway.
pub struct Gateway {
    state: Arc<State>,
    rt: Arc<Runtime>,
    addr: SocketAddr,
    cancel: CancellationToken,
    counters: Arc<GatewayCounters>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Gateway {
    /// Loads the TLS files and binds the listener (errors surface here),
    /// then serves in the background.
    pub fn start(engine: Weak<dyn Backend>, cfg: GatewayConfig) -> Result<Gateway, FedError> {
        if cfg.listen_addr.is_empty() {
            return Err(FedError::Config("gateway.listen_addr is not set".into()));
        }
        let name = engine
            .upgrade()
            .map(|e| e.instance_name())
            .unwrap_or_default();
        let tls = federation::load_tls(&name, &cfg.tls)?
            .gateway_server_config()
            .map_err(|e| FedError::Tls(e.to_string()))?;
        let rt = federation::runtime()?;
        let (listener, addr) = rt.block_on(federation::bind(&cfg.listen_addr))?;
        let cancel = CancellationToken::new();
        let counters = Arc::new(GatewayCounters::default());
        let state = Arc::new(State {
            access: std::sync::RwLock::new(Arc::new(Access {
                peers: cfg.allowed_peers.clone(),
                tokens: cfg.tokens.clone(),
            })),
            budgets: std::sync::Mutex::new(std::collections::HashMap::new()),
            engine,
            limiter: auth::RateLimiter::new(cfg.rate_limit_per_s, cfg.rate_limit_burst),
            auth_failures: auth::RateLimiter::new(
                auth::AUTH_FAILURE_RATE,
                auth::AUTH_FAILURE_BURST,
            ),
            streams: Arc::new(tokio::sync::Semaphore::new(cfg.max_streams)),
            streams_by: std::sync::Mutex::new(std::collections::HashMap::new()),
            counters: counters.clone(),
            cancel: cancel.clone(),
            cfg,
        });
        let task = rt.spawn(conn::accept_loop(state.clone(), listener, tls));
        log::info!("gateway: listening on https://{addr}");
        Ok(Gateway {
            state,
            rt,
            addr,
            cancel,
            counters,
            task: Some(task),
        })
    }

    /// The address it listens on (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replaces the allowed peers and tokens (a configuration reload): every
    /// request from now on is checked against them; streams already open
    /// keep going until they end.
    pub fn set_access(&self, peers: Vec<AllowedPeer>, tokens: Vec<TokenEntry>) {
        *self.state.access.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Access { peers, tokens });
    }

    /// Its counters.
    pub fn counters(&self) -> &GatewayCounters {
        &self.counters
    }

    /// Closes the listener and every connection (bounded wait). Idempotent.
    pub fn stop(&mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            self.rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
            });
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop();
    }
}
