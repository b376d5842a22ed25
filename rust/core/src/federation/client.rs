//! A client link: dials one hub with exponential backoff and jitter (also
//! when the hub is down at startup, and also for subscribe-only links),
//! forwards locally published messages of the `publish` channels from a
//! persisted cursor, and stores what the hub streams for `subscribe`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::SinkExt;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::link::{self, Inbound, OutChannel};
use super::status::{LinkEvent, LinkStatus};
use super::wire::{Handshake, CLOSE_NOT_ALLOWED, FEATURE_REFUSALS};
use super::{HubEndpoint, Shared, HANDSHAKE_TIMEOUT};
use crate::audit::AuditEvent;
use crate::envelope::{validate_name, NameKind};
use crate::storage::offsets::{read_offset, write_offset};
use crate::storage::{LogReader, Store};

/// A client link to one hub.
pub struct ClientLink {
    addr: String,
    publish: Vec<String>,
    status: Arc<LinkStatus>,
}

impl ClientLink {
    /// Creates the forwarding cursors (at the current end of each publish
    /// channel, if new) and starts dialing.
    pub fn start(
        rt: &Runtime,
        shared: Arc<Shared>,
        ep: HubEndpoint,
        tls: Arc<super::tls::Reloadable<ClientConfig>>,
    ) -> Result<(ClientLink, tokio::task::JoinHandle<()>), String> {
        create_cursors(&shared.store, &ep)?;
        let status = Arc::new(LinkStatus::with_events(shared.events.clone()));
        let task = rt.spawn(dial_loop(shared, ep.clone(), tls, status.clone()));
        Ok((
            ClientLink {
                addr: ep.addr,
                publish: ep.publish,
                status,
            },
            task,
        ))
    }

    /// The hub address dialed.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Channels forwarded to this hub.
    pub fn publish(&self) -> &[String] {
        &self.publish
    }

    /// Connection state and counters.
    pub fn status(&self) -> &LinkStatus {
        &self.status
    }
}

/// Why a hub refused this instance (close code 4403), naming the CN of
/// the certificate it presented: the hub's `allowed_peers` must list it.
pub(crate) fn rejected_text(tls: &ClientConfig) -> String {
    let cn = super::tls::own_cn(tls).unwrap_or_else(|| "?".to_owned());
    format!(
        "rejected by the hub: this instance's certificate (CN={cn}) is not in its \
         hub.allowed_peers"
    )
}

/// Creates the forwarding cursors of the link to `ep` that do not exist yet,
/// at the current end of each of its publish channels: the link forwards
/// what is published from then on. Run when the link starts, and by an
/// instance opened without federation that publishes (the command line's
/// `pub` beside a stopped service), so that those records are forwarded
/// once the link runs.
pub fn create_cursors(store: &Store, ep: &HubEndpoint) -> Result<(), String> {
    if host_of(&ep.addr).is_none() {
        return Err(format!("hub address {:?} is not host:port", ep.addr));
    }
    for channel in ep.publish.iter().chain(&ep.subscribe) {
        validate_name(NameKind::Channel, channel).map_err(|e| e.to_string())?;
    }
    for channel in &ep.publish {
        let writer = store.writer(channel).map_err(|e| e.to_string())?;
        let path = super::client_cursor_path(store, channel, &ep.addr);
        if read_offset(&path).map_err(|e| e.to_string())?.is_none() {
            if let Some(dir) = path.parent() {
                crate::storage::segment::create_dir_all(dir).map_err(|e| e.to_string())?;
            }
            write_offset(&path, writer.committed_end()).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Host part of `host:port` or `[v6]:port`.
pub(crate) fn host_of(addr: &str) -> Option<&str> {
    let (host, port) = addr.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    (!host.is_empty()).then_some(host)
}

pub(crate) enum DialError {
    Rejected,
    Failed(String),
}

pub(crate) type HubStream = WebSocketStream<TlsStream<TcpStream>>;

/// `text` (a failed dial) with what it most likely means when it is a
/// certificate refusal: rustls' words (`BadSignature`, `received fatal alert:
/// DecryptError`) do not say which side's CA is wrong. In TLS 1.3 the hub
/// checks the client's certificate after the client's handshake ends, so
/// its refusal arrives as an alert at the first read (the upgrade).
fn with_tls_hint(text: String) -> String {
    let hint = if text.contains("invalid peer certificate") {
        "the hub's certificate is not signed by this instance's tls.ca, or is expired \
         or not for this host (both sides need certificates of the same CA, from \
         keygen ca, and the hub's must name the host dialed)"
    } else if text.contains("received fatal alert")
        && [
            "DecryptError",
            "BadCertificate",
            "UnknownCA",
            "CertificateUnknown",
            "CertificateExpired",
        ]
        .iter()
        .any(|a| text.contains(a))
    {
        "the hub refused this instance's certificate: it is not signed by the hub's \
         tls.ca, or is expired (both sides need certificates of the same CA)"
    } else {
        return text;
    };
    format!("{text}: {hint}")
}

/// Dials `ep` and exchanges handshakes (client first), within the handshake timeout.
pub(crate) async fn connect_once(
    name: &str,
    max_batch_bytes: usize,
    ep: &HubEndpoint,
    tls: Arc<ClientConfig>,
    ephemeral: bool,
) -> Result<(HubStream, Handshake), DialError> {
    let host = host_of(&ep.addr).unwrap_or_default().to_owned();
    let server_name =
        ServerName::try_from(host).map_err(|e| DialError::Failed(format!("bad hub host: {e}")))?;
    let ws_cfg =
        WebSocketConfig::default().max_message_size(Some(link::max_message_size(max_batch_bytes)));
    let hello = Handshake::client(name, ep.subscribe.clone(), ephemeral)
        .with_refusals()
        .to_json();
    let attempt = async {
        let tcp = TcpStream::connect(&ep.addr)
            .await
            .map_err(|e| DialError::Failed(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let tls = TlsConnector::from(tls)
            .connect(server_name, tcp)
            .await
            .map_err(|e| DialError::Failed(with_tls_hint(format!("TLS: {e}"))))?;
        let (mut ws, _) = tokio_tungstenite::client_async_with_config(
            format!("wss://{}/", ep.addr),
            tls,
            Some(ws_cfg),
        )
        .await
        .map_err(|e| DialError::Failed(with_tls_hint(format!("WebSocket upgrade: {e}"))))?;
        ws.send(Message::Text(hello.into()))
            .await
            .map_err(|e| DialError::Failed(e.to_string()))?;
        match link::next_data(&mut ws).await {
            Some(Ok(Message::Text(t))) => {
                let welcome = Handshake::decode(t.as_str())
                    .map_err(|e| DialError::Failed(format!("bad hub handshake: {e}")))?;
                Ok((ws, welcome))
            }
            Some(Ok(Message::Close(Some(f)))) if u16::from(f.code) == CLOSE_NOT_ALLOWED => {
                Err(DialError::Rejected)
            }
            other => Err(DialError::Failed(format!(
                "expected the hub handshake, got {other:?}"
            ))),
        }
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, attempt).await {
        Ok(r) => r,
        Err(_) => Err(DialError::Failed(format!(
            "no hub handshake within {}s",
            HANDSHAKE_TIMEOUT.as_secs()
        ))),
    }
}

/// Channels of `wanted` not in `allowed` (`None`: the hub did not restrict,
/// or is a 1.4 hub that does not say).
pub(crate) fn not_allowed(wanted: &[String], allowed: Option<&Vec<String>>) -> Vec<String> {
    match allowed {
        None => Vec::new(),
        Some(a) => wanted.iter().filter(|c| !a.contains(c)).cloned().collect(),
    }
}

/// Learns from the hub's handshake which configured channels it refuses:
/// one warning and one audit record per channel, and the link status.
fn note_handshake_refusals(
    shared: &Shared,
    ep: &HubEndpoint,
    welcome: &Handshake,
    status: &LinkStatus,
) -> Vec<String> {
    let publish = not_allowed(&ep.publish, welcome.publish_allowed.as_ref());
    let subscribe = not_allowed(&ep.subscribe, welcome.subscribe_allowed.as_ref());
    for channel in &publish {
        log::warn!(
            "client: hub {} refuses channel {channel:?} from this instance (not in its allowed publish list); it is not sent, and its messages stay here until the hub allows it",
            ep.addr
        );
        let mut ev = AuditEvent::new("publish_refused");
        ev.channel = channel.clone();
        ev.direction = "outbound".into();
        ev.peer = ep.addr.clone();
        ev.detail = "reason=policy at=handshake".into();
        shared.audit.log(ev);
    }
    for channel in &subscribe {
        log::warn!(
            "client: hub {} will not deliver channel {channel:?} to this instance (not in its allowed subscribe list)",
            ep.addr
        );
        let mut ev = AuditEvent::new("subscribe_refused");
        ev.channel = channel.clone();
        ev.direction = "inbound".into();
        ev.peer = ep.addr.clone();
        ev.detail = "reason=policy at=handshake".into();
        shared.audit.log(ev);
    }
    status.set_refused_channels(publish.clone(), subscribe);
    publish
}

fn open_channels(
    shared: &Shared,
    ep: &HubEndpoint,
    refused: &[String],
) -> Result<Vec<OutChannel>, String> {
    let mut out = Vec::new();
    // A refused channel keeps its cursor: sent once the hub allows it.
    for channel in ep.publish.iter().filter(|c| !refused.contains(c)) {
        let writer = shared.store.writer(channel).map_err(|e| e.to_string())?;
        let path = shared.client_cursor(channel, &ep.addr);
        let end = writer.committed_end();
        let start = read_offset(&path)
            .map_err(|e| e.to_string())?
            .unwrap_or(end)
            .min(end);
        out.push(OutChannel {
            channel: channel.clone(),
            reader: LogReader::new(writer.dir(), start),
            writer,
            cursor: Some(path),
            only_origin: Some(shared.name.clone()),
        });
    }
    Ok(out)
}

fn audit(shared: &Shared, event: &'static str, addr: &str, detail: String) {
    let mut ev = AuditEvent::new(event);
    ev.peer_addr = addr.to_owned();
    ev.detail = detail;
    shared.audit.log(ev);
}

/// `delay ± delay × jitter`, never negative.
pub(crate) fn jittered(delay: Duration, jitter: f64) -> Duration {
    let u: f64 = rand::random::<f64>() * 2.0 - 1.0;
    delay.mul_f64((1.0 + jitter.clamp(0.0, 1.0) * u).max(0.0))
}

async fn dial_loop(
    shared: Arc<Shared>,
    ep: HubEndpoint,
    tls: Arc<super::tls::Reloadable<ClientConfig>>,
    status: Arc<LinkStatus>,
) {
    let base = Duration::from_millis(shared.link.reconnect_base_ms.max(1));
    let max = Duration::from_millis(shared.link.reconnect_max_ms).max(base);
    let mut delay = base;
    let mut attempt: u64 = 0;
    loop {
        if shared.cancel.is_cancelled() {
            return;
        }
        attempt += 1;
        let connected = tokio::select! {
            _ = shared.cancel.cancelled() => return,
            r = connect_once(&shared.name, shared.link.max_batch_bytes, &ep, tls.current(), false) => r,
        };
        match connected {
            Ok((ws, welcome)) => {
                attempt = 0;
                delay = base;
                if status.connects.fetch_add(1, Ordering::Relaxed) > 0 {
                    status.reconnects.fetch_add(1, Ordering::Relaxed);
                }
                status.connected.store(true, Ordering::Release);
                audit(&shared, "peer_connected", &ep.addr, String::new());
                log::info!("client: connected to hub {}", ep.addr);
                status.emit(LinkEvent::Connected {
                    hub: ep.addr.clone(),
                });
                let refused = note_handshake_refusals(&shared, &ep, &welcome, &status);
                let ended = match open_channels(&shared, &ep, &refused) {
                    Ok(out) => {
                        let inbound = Inbound {
                            allow: (!ep.subscribe.is_empty())
                                .then(|| ep.subscribe.iter().cloned().collect()),
                            peer: ep.addr.clone(),
                            counts: None,
                            link: Some(status.clone()),
                            dead_letters: true,
                            channel_budget: None,
                            report_refusals: welcome.has_feature(FEATURE_REFUSALS),
                        };
                        link::run(
                            shared.clone(),
                            ws,
                            out,
                            inbound,
                            shared.cancel.child_token(),
                        )
                        .await
                    }
                    Err(e) => Some(e),
                };
                status.connected.store(false, Ordering::Release);
                let Some(err) = ended else { return };
                log::warn!("client: link to hub {} lost: {err}", ep.addr);
                // 1.4's detail (the records sent and not acknowledged), and why.
                let unacked = status.unacked_records.swap(0, Ordering::Relaxed);
                status.unacked_bytes.store(0, Ordering::Relaxed);
                let detail = format!("unacked={unacked} err={err}");
                audit(&shared, "peer_disconnected", &ep.addr, detail);
                status.emit(LinkEvent::Disconnected {
                    hub: ep.addr.clone(),
                    reason: err,
                });
            }
            Err(e) => {
                status.failed_attempts.fetch_add(1, Ordering::Relaxed);
                let text = match &e {
                    DialError::Rejected => rejected_text(&tls.current()),
                    DialError::Failed(t) => t.clone(),
                };
                log::warn!(
                    "client: cannot connect to hub {} (attempt {attempt}): {text}",
                    ep.addr
                );
                audit(
                    &shared,
                    "peer_connect_failed",
                    &ep.addr,
                    format!("attempt={attempt} err={text}"),
                );
                // A rejection will not change until the hub's configuration does.
                delay = if matches!(e, DialError::Rejected) {
                    max
                } else {
                    delay
                };
            }
        }
        let sleep = jittered(delay, shared.link.reconnect_jitter);
        tokio::select! {
            _ = shared.cancel.cancelled() => return,
            _ = tokio::time::sleep(sleep) => {}
        }
        delay = (delay * 2).min(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        assert_eq!(host_of("hub1.example.net:7740"), Some("hub1.example.net"));
        assert_eq!(host_of("127.0.0.1:1"), Some("127.0.0.1"));
        assert_eq!(host_of("[::1]:7740"), Some("::1"));
        assert_eq!(host_of("nohost"), None);
        assert_eq!(host_of(":7740"), None);
    }

    #[test]
    fn jitter_stays_in_range() {
        let d = Duration::from_millis(1000);
        for _ in 0..100 {
            let j = jittered(d, 0.2);
            assert!(j >= Duration::from_millis(800) && j <= Duration::from_millis(1200));
        }
        assert_eq!(jittered(d, 0.0), d);
    }
}
