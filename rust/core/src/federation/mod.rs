//! Federation: clients dial hubs over WebSockets with mutual TLS and
//! exchange batches of envelopes (the protocol of keyop-messenger 1.4).
//!
//! Everything runs on one tokio runtime per process, created on first use and
//! re-created in a forked child (PID check). Both directions are driven by
//! persisted cursors over the channel files: the hub streams each subscribed
//! channel to a client from `fed-<peer>.offset`, and a client forwards its
//! locally published messages from `hub-<addr>.offset`, so nothing published
//! while a link is down is lost.

pub mod buffers;
pub mod client;
pub mod conns;
pub mod ephemeral;
pub mod flush;
pub mod hub;
pub mod ids;
pub mod link;
pub mod status;
pub mod tls;
pub mod wire;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::audit::AuditLog;
use crate::dedup::SeenIds;
use crate::storage::Store;

/// Errors starting federation.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FedError {
    #[error("TLS: {0}")]
    Tls(String),
    #[error("hub: cannot listen on {addr}: {reason}")]
    Listen { addr: String, reason: String },
    #[error("{0}")]
    Config(String),
    #[error("cannot start the federation runtime: {0}")]
    Runtime(String),
}

/// `tls` section.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct TlsSettings {
    pub cert: String,
    pub key: String,
    pub ca: String,
    pub min_version: String,
    pub expiry_warn_days: i64,
}

/// Channels a peer may create on a hub unless its entry says otherwise.
pub const DEFAULT_MAX_CHANNELS: usize = 1024;

/// One `hub.allowed_peers` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct AllowedPeer {
    pub name: String,
    pub subscribe: Vec<String>,
    pub publish: Vec<String>,
    /// Most channels this peer's records may create on the hub (channels
    /// that did not exist when its first record for them arrived), counted
    /// since the hub started; further new channels are refused with reason
    /// `channel_limit`. Default [`DEFAULT_MAX_CHANNELS`].
    pub max_channels: usize,
}

impl Default for AllowedPeer {
    fn default() -> Self {
        AllowedPeer {
            name: String::new(),
            subscribe: Vec::new(),
            publish: Vec::new(),
            max_channels: DEFAULT_MAX_CHANNELS,
        }
    }
}

/// The channels one peer has created on a hub, shared by its connections.
#[derive(Debug)]
pub struct ChannelBudget {
    limit: std::sync::atomic::AtomicUsize,
    created: Mutex<std::collections::HashSet<String>>,
}

impl ChannelBudget {
    /// A budget of `limit` new channels.
    pub fn new(limit: usize) -> ChannelBudget {
        ChannelBudget {
            limit: std::sync::atomic::AtomicUsize::new(limit),
            created: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Sets how many new channels the peer may create in all (its entry's
    /// `max_channels`, which a configuration reload may change); the
    /// channels created so far still count.
    pub fn set_limit(&self, limit: usize) {
        self.limit
            .store(limit, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the peer may create `channel` now; a yes is counted.
    pub fn try_create(&self, channel: &str) -> bool {
        let mut created = self.created.lock().unwrap_or_else(|e| e.into_inner());
        if created.contains(channel) {
            return true;
        }
        if created.len() >= self.limit.load(std::sync::atomic::Ordering::Relaxed) {
            return false;
        }
        created.insert(channel.to_owned());
        true
    }

    /// Whether the peer may write to or subscribe to `channel` in `store`:
    /// it exists, or the budget lets the peer create it (a yes is counted).
    pub fn admits(&self, store: &Store, channel: &str) -> bool {
        store.channel_dir(channel).is_ok_and(|d| d.is_dir()) || self.try_create(channel)
    }

    /// Channels created so far.
    pub fn created(&self) -> usize {
        self.created.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// `hub` section.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HubSettings {
    pub enabled: bool,
    pub listen_addr: String,
    pub allowed_peers: Vec<AllowedPeer>,
    /// Cursor TTL in seconds; negative disables the sweep.
    pub fed_client_offset_ttl_s: f64,
}

/// One `client.hubs` entry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HubEndpoint {
    pub addr: String,
    pub subscribe: Vec<String>,
    pub publish: Vec<String>,
}

/// `client` section.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ClientSettings {
    pub enabled: bool,
    pub hubs: Vec<HubEndpoint>,
}

/// `federation` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct LinkSettings {
    pub reconnect_base_ms: u64,
    pub reconnect_max_ms: u64,
    pub reconnect_jitter: f64,
    pub max_batch_bytes: usize,
}

impl Default for LinkSettings {
    fn default() -> Self {
        LinkSettings {
            reconnect_base_ms: 500,
            reconnect_max_ms: 60_000,
            reconnect_jitter: 0.2,
            max_batch_bytes: 4 * 1024 * 1024,
        }
    }
}

/// Everything federation needs from the configuration.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct FedConfig {
    pub name: String,
    pub hub: HubSettings,
    pub client: ClientSettings,
    pub tls: TlsSettings,
    pub federation: LinkSettings,
    pub seen_id_lru_size: usize,
    pub audit_max_size_mb: u64,
    pub audit_max_files: u32,
    /// Receives the client links' connection and refusal events.
    #[serde(skip)]
    pub events: Option<status::EventSink>,
}

/// Liveness settings (not configurable in 1.4; fixed here).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Interval of WebSocket pings on an idle link.
pub const PING_INTERVAL: Duration = Duration::from_secs(15);
/// A link with nothing received for this long is dead.
pub const READ_TIMEOUT: Duration = Duration::from_secs(45);
/// How long a sender waits for the acknowledgement of a batch.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(60);
/// Most concurrent connections a hub serves.
pub const MAX_CONNECTIONS: usize = 1024;

static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// Environment variable setting the federation runtime's worker threads
/// (read when the process's runtime starts; 1 suits a small board).
pub const WORKER_THREADS_ENV: &str = "KEYOP_MESSENGER_WORKER_THREADS";
/// Worker threads when [`WORKER_THREADS_ENV`] is not set.
pub const DEFAULT_WORKER_THREADS: usize = 2;
/// Most worker threads [`WORKER_THREADS_ENV`] may ask for.
pub const MAX_WORKER_THREADS: usize = 64;

/// The runtime's worker threads for the value of [`WORKER_THREADS_ENV`].
pub fn worker_threads(value: Option<&str>) -> Result<usize, FedError> {
    let Some(text) = value else {
        return Ok(DEFAULT_WORKER_THREADS);
    };
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_WORKER_THREADS).contains(&n) => Ok(n),
        _ => Err(FedError::Runtime(format!(
            "{WORKER_THREADS_ENV} must be a whole number from 1 to {MAX_WORKER_THREADS}, \
             got {text:?}; unset it for the default of {DEFAULT_WORKER_THREADS}"
        ))),
    }
}

/// The process's federation runtime, created lazily; a forked child gets a
/// fresh one (the parent's threads do not exist there).
pub fn runtime() -> Result<Arc<Runtime>, FedError> {
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return Ok(rt.clone());
        }
    }
    if let Some((_, inherited)) = slot.take() {
        // Its worker threads died with the fork; dropping it would wait for them.
        std::mem::forget(inherited);
    }
    let workers = worker_threads(std::env::var(WORKER_THREADS_ENV).ok().as_deref())?;
    // The runtime starts its workers first, so they are named apart from
    // the threads it starts later for blocking work.
    let started = std::sync::atomic::AtomicUsize::new(0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name_fn(move || {
            if started.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < workers {
                "keyop-fed".into()
            } else {
                "keyop-fed-io".into()
            }
        })
        .enable_all()
        .build()
        .map_err(|e| FedError::Runtime(e.to_string()))?;
    let rt = Arc::new(rt);
    *slot = Some((pid, rt.clone()));
    Ok(rt)
}

/// State shared by every federation task of an instance.
pub struct Shared {
    pub name: String,
    pub store: Arc<Store>,
    pub seen: Arc<SeenIds>,
    pub audit: Arc<AuditLog>,
    pub link: LinkSettings,
    pub cancel: CancellationToken,
    /// Client links' events for the application (see [`status::LinkEvent`]).
    pub events: Option<status::EventSink>,
}

impl Shared {
    /// Where a client keeps its forwarding cursor for `hub_addr` on `channel`.
    pub fn client_cursor(&self, channel: &str, hub_addr: &str) -> PathBuf {
        client_cursor_path(&self.store, channel, hub_addr)
    }
}

/// The offset file of the forwarding cursor of `channel` towards `hub_addr`.
pub fn client_cursor_path(store: &Store, channel: &str, hub_addr: &str) -> PathBuf {
    crate::storage::offsets::offset_path(
        &crate::storage::offsets::subscribers_dir(store.data_dir(), channel),
        &client_cursor_id(hub_addr),
    )
}

/// Offset-file id of a client's forwarding cursor towards `hub_addr`
/// (`hub-` plus the address with characters outside the name rule as `_`).
pub fn client_cursor_id(hub_addr: &str) -> String {
    let clean: String = hub_addr
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{}{clean}", crate::envelope::HUB_CURSOR_PREFIX)
}

/// A running federation: a hub listener and/or client links.
pub struct Federation {
    rt: Arc<Runtime>,
    shared: Arc<Shared>,
    hub: Option<hub::Hub>,
    clients: Vec<client::ClientLink>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The hub's TLS configuration, replaced by [`Federation::reload_tls`].
    server_tls: Option<Arc<tls::Reloadable<rustls::ServerConfig>>>,
    /// The client links' TLS configuration, replaced by [`Federation::reload_tls`].
    client_tls: Option<Arc<tls::Reloadable<rustls::ClientConfig>>>,
}

impl Federation {
    /// Starts the hub (binding its listener now, so errors surface here) and
    /// the client links (which keep dialing in the background: a hub that is
    /// down does not make this fail).
    pub fn start(
        store: Arc<Store>,
        seen: Arc<SeenIds>,
        cfg: FedConfig,
    ) -> Result<Federation, FedError> {
        if cfg.name.is_empty() {
            return Err(FedError::Config("instance name must not be empty".into()));
        }
        let material = if cfg.hub.enabled || cfg.client.enabled {
            Some(load_tls(&cfg.name, &cfg.tls)?)
        } else {
            None
        };
        let audit = AuditLog::open(store.data_dir(), cfg.audit_max_size_mb, cfg.audit_max_files)
            .map_err(|e| FedError::Config(format!("cannot open the audit log: {e}")))?;
        let rt = runtime()?;
        let shared = Arc::new(Shared {
            name: cfg.name.clone(),
            store,
            seen,
            audit: Arc::new(audit),
            link: cfg.federation.clone(),
            cancel: CancellationToken::new(),
            events: cfg.events.clone(),
        });
        let mut fed = Federation {
            rt: rt.clone(),
            shared: shared.clone(),
            hub: None,
            clients: Vec::new(),
            tasks: Vec::new(),
            server_tls: None,
            client_tls: None,
        };
        if let (true, Some(m)) = (cfg.hub.enabled, material.as_ref()) {
            let server = tls::Reloadable::new(
                m.server_config()
                    .map_err(|e| FedError::Tls(e.to_string()))?,
            );
            fed.server_tls = Some(server.clone());
            let (hub, tasks) =
                rt.block_on(hub::Hub::start(shared.clone(), cfg.hub.clone(), server))?;
            fed.hub = Some(hub);
            fed.tasks.extend(tasks);
        }
        if let (true, Some(m)) = (cfg.client.enabled, material.as_ref()) {
            let client_tls = tls::Reloadable::new(
                m.client_config()
                    .map_err(|e| FedError::Tls(e.to_string()))?,
            );
            fed.client_tls = Some(client_tls.clone());
            for ep in &cfg.client.hubs {
                let (link, task) =
                    client::ClientLink::start(&rt, shared.clone(), ep.clone(), client_tls.clone())
                        .map_err(|e| {
                            FedError::Config(format!("client link to {}: {e}", ep.addr))
                        })?;
                fed.clients.push(link);
                fed.tasks.push(task);
            }
        }
        Ok(fed)
    }

    /// Loads the `tls` files again, with the checks made at start (readable,
    /// within their validity dates, key private and unencrypted, key matching
    /// the certificate), and makes connections
    /// accepted or dialed from now on use them; established connections keep
    /// theirs. Nothing is replaced unless everything loads: on an error the
    /// running TLS configuration stays.
    pub fn reload_tls(&self, cfg: &TlsSettings) -> Result<(), FedError> {
        if self.server_tls.is_none() && self.client_tls.is_none() {
            return Err(FedError::Config(
                "no hub or client is running: no TLS to reload".into(),
            ));
        }
        let m = load_tls(&self.shared.name, cfg)?;
        let tls_err = |e: rustls::Error| FedError::Tls(e.to_string());
        let server = match self.server_tls {
            Some(_) => Some(m.server_config().map_err(tls_err)?),
            None => None,
        };
        let client = match self.client_tls {
            Some(_) => Some(m.client_config().map_err(tls_err)?),
            None => None,
        };
        if let (Some(holder), Some(new)) = (&self.server_tls, server) {
            holder.replace(new);
        }
        if let (Some(holder), Some(new)) = (&self.client_tls, client) {
            holder.replace(new);
        }
        log::debug!(
            "TLS reloaded: certificate {:?} (CN {:?}), CA {:?}; new connections use it",
            cfg.cert,
            m.own_cn().unwrap_or_default(),
            cfg.ca
        );
        Ok(())
    }

    /// The seen-id window shared by this instance's receivers (and marked
    /// by its publishes on the channels it subscribes to from a hub).
    pub fn seen(&self) -> &SeenIds {
        &self.shared.seen
    }

    /// The address the hub listens on (useful with port 0).
    pub fn hub_addr(&self) -> Option<std::net::SocketAddr> {
        self.hub.as_ref().map(|h| h.local_addr())
    }

    /// The hub, if enabled.
    pub fn hub(&self) -> Option<&hub::Hub> {
        self.hub.as_ref()
    }

    /// Client links, one per configured hub.
    pub fn clients(&self) -> &[client::ClientLink] {
        &self.clients
    }

    /// What `flush()` waits for: every (hub, channel) this instance forwards,
    /// with the channel's committed end as of now.
    pub fn flush_targets(&self) -> Vec<flush::FlushTarget> {
        flush::targets(&self.shared, &self.clients)
    }

    /// Stops every task and closes every connection (bounded wait), then the audit log.
    pub fn stop(&mut self) {
        self.shared.cancel.cancel();
        let tasks = std::mem::take(&mut self.tasks);
        self.rt.block_on(async {
            for t in tasks {
                let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
            }
        });
        self.shared.audit.close();
    }
}

/// Loads the `tls` files, warning when the certificate CN is not `name` or
/// a certificate expires soon.
/// Binds a listener on `addr` (hub, gateway): the listener and the address it
/// got (port 0 picks one).
pub(crate) async fn bind(
    addr: &str,
) -> Result<(tokio::net::TcpListener, std::net::SocketAddr), FedError> {
    let failed = |e: std::io::Error| FedError::Listen {
        addr: addr.to_owned(),
        reason: e.to_string(),
    };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(failed)?;
    let local = listener.local_addr().map_err(failed)?;
    Ok((listener, local))
}

pub(crate) fn load_tls(name: &str, cfg: &TlsSettings) -> Result<tls::TlsMaterial, FedError> {
    let m = tls::TlsMaterial::load(cfg)?;
    if m.own_cn().as_deref() != Some(name) {
        log::warn!(
            "instance name {:?} differs from the certificate CN {:?}; hubs identify this instance by the CN",
            name,
            m.own_cn().unwrap_or_default()
        );
    }
    m.warn_expiry(cfg.expiry_warn_days, &cfg.cert, &cfg.ca);
    Ok(m)
}

impl Drop for Federation {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_threads_from_the_environment_value() {
        assert_eq!(worker_threads(None).unwrap(), DEFAULT_WORKER_THREADS);
        assert_eq!(worker_threads(Some("1")).unwrap(), 1);
        assert_eq!(worker_threads(Some(" 4 ")).unwrap(), 4);
        for bad in ["0", "-1", "two", "", "65"] {
            let err = worker_threads(Some(bad)).unwrap_err().to_string();
            assert!(err.contains(WORKER_THREADS_ENV), "{err}");
        }
    }
}
