//! `GET /v1/channels/{channel}/ws`: a WebSocket for both directions. The
//! client sends publish requests as text frames (the body of a POST, plus
//! an optional `ref` echoed back) and gets `{"type":"published",...}` once
//! committed or `{"type":"error",...}`; when it may read the channel it gets
//! `{"type":"message","next":...,"message":{...}}` from `from` (default
//! `latest`). Each publish frame takes a request from the client's rate
//! limit; a frame over `gateway.max_body_bytes` closes with 1009, shutdown
//! with 1001, a frame breaking RFC 6455 (unmasked, reserved bits, a control
//! frame over 125 bytes) with 1002, and a connection on which no byte moves
//! for `gateway.idle_timeout` (a reader that stopped reading) is dropped.
//! The upgrade wants `Sec-WebSocket-Version: 13` (426 otherwise) and a key
//! of 16 bytes in base64 (400 otherwise).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncReadExt;
use tokio_tungstenite::tungstenite::error::ProtocolError;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use super::auth::{Access, Identity};
use super::publish;
use super::reply::{self as http, log_refusal, Body, Client, Refusal, REFUSALS_LOGGED};
use super::stream::{self, Event};
use super::State;
use crate::storage::{ChannelWriter, LogReader};

const PING: Duration = Duration::from_secs(15);
/// After closing for a frame over the limit, the rest of the client's bytes
/// are read and dropped for at most this long (and this many), so the
/// close frame reaches a client still sending rather than a reset.
const DRAIN_TIME: Duration = Duration::from_secs(2);
const DRAIN_BYTES: usize = 64 * 1024 * 1024;

pub(super) fn upgrade(
    state: &Arc<State>,
    channel: &str,
    req: &mut Request<Incoming>,
    identity: Identity,
    client: &Client,
) -> Result<Response<Body>, Refusal> {
    let may_publish = identity.allows(Access::Publish, channel);
    let may_subscribe = identity.allows(Access::Subscribe, channel);
    let create = identity.names(Access::Subscribe, channel);
    let key = http::header_str(req, "sec-websocket-key").map(str::to_owned);
    let is_ws =
        http::header_str(req, "upgrade").is_some_and(|u| u.eq_ignore_ascii_case("websocket"));
    let Some(key) = key.filter(|_| is_ws) else {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            "this path is a WebSocket: send Upgrade: websocket and Sec-WebSocket-Key",
        ));
    };
    // RFC 6455 4.2.1: version 13 only (426 names it), and a key that is
    // 16 bytes in base64.
    if http::header_str(req, "sec-websocket-version").map(str::trim) != Some("13") {
        let mut r = Refusal::new(
            StatusCode::UPGRADE_REQUIRED,
            "invalid",
            "Sec-WebSocket-Version must be 13 (RFC 6455)",
        );
        r.header = Some((header::SEC_WEBSOCKET_VERSION, "13"));
        return Err(r);
    }
    if !is_websocket_key(key.trim()) {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            "Sec-WebSocket-Key must be 16 random bytes in base64 (24 characters)",
        ));
    }
    let q = http::query(req);
    let pos = stream::parse_position(http::param(&q, "from").unwrap_or("latest"))?;
    let slot = stream::take_slot(state, &identity.label)?;
    let reader = if may_subscribe {
        let (reader, writer) = stream::open_reader(state, channel, pos, create)?;
        Some((reader, writer))
    } else {
        None
    };
    let (st, ch) = (state.clone(), channel.to_owned());
    let (activity, remote) = (client.activity.clone(), client.remote);
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let _slot = slot;
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                log::debug!("gateway: WebSocket upgrade failed: {e}");
                return;
            }
        };
        // A frame over the limit is refused from its header, before its
        // payload is buffered.
        let cfg = WebSocketConfig::default()
            .max_message_size(Some(st.cfg.max_body_bytes))
            .max_frame_size(Some(st.cfg.max_body_bytes));
        let ws =
            WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, Some(cfg)).await;
        let idle = Duration::from_millis(st.cfg.idle_timeout_ms.max(1));
        tokio::select! {
            _ = run(st.clone(), ch, ws, (may_publish, identity), reader) => {}
            // Nothing moved either way (the client stopped reading, so a
            // send is blocked; or it vanished): drop the connection.
            _ = activity.idle(idle) => {
                st.counters.timed_out.fetch_add(1, Ordering::Relaxed);
                log::info!("gateway: closed the WebSocket of {remote}: no byte moved for {idle:?}");
            }
        }
    });
    let mut resp = Response::new(Empty::<Bytes>::new().boxed());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(v) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    Ok(resp)
}

async fn run<S>(
    state: Arc<State>,
    channel: String,
    ws: WebSocketStream<S>,
    (may_publish, identity): (bool, Identity),
    mut reader: Option<(LogReader, Arc<ChannelWriter>)>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut sink, mut source) = ws.split();
    let idle = Duration::from_millis(state.cfg.idle_timeout_ms.max(1));
    // When bytes last moved either way (a frame read, a step of records
    // written out): a reader catching up sends nothing and is not idle.
    let mut last_heard = tokio::time::Instant::now();
    // Records were delivered in the last step: more may be waiting. The
    // client's frames are read between steps (publishes answered, a Close
    // answered), not only once caught up.
    let mut backlog = false;
    loop {
        if let Some((r, w)) = reader.as_mut() {
            let events = tokio::task::block_in_place(|| {
                stream::read_events(r, w, stream::STEP, stream::STEP_BYTES)
            });
            let events = match events {
                Ok(e) => e,
                Err(e) => {
                    log::error!("gateway: cannot read channel {channel:?}: {e}");
                    return;
                }
            };
            let events_empty = events.is_empty();
            if !events_empty {
                let mut n = 0;
                for ev in events {
                    let text = match ev {
                        Event::Record { next, line, .. } => {
                            n += 1;
                            let mut t =
                                format!("{{\"type\":\"message\",\"next\":{next},\"message\":");
                            t.push_str(&String::from_utf8_lossy(&line));
                            t.push('}');
                            t
                        }
                        Event::Gap { from, to } => {
                            format!("{{\"type\":\"gap\",\"from\":{from},\"to\":{to}}}")
                        }
                    };
                    if sink.feed(Message::Text(text.into())).await.is_err() {
                        return;
                    }
                }
                if sink.flush().await.is_err() {
                    return;
                }
                last_heard = tokio::time::Instant::now();
                state.counters.delivered.fetch_add(n, Ordering::Relaxed);
            }
            backlog = !events_empty;
        }
        let committed = async {
            if backlog {
                return; // the next step at once (unless a client frame is there)
            }
            match reader.as_ref() {
                Some((r, w)) => w.notifier().changed_past(r.position()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = state.cancel.cancelled() => {
                let _ = sink.send(close(CloseCode::Away, "the gateway is shutting down")).await;
                return;
            }
            _ = committed => {
                if let Some((r, w)) = reader.as_ref().filter(|_| !backlog) {
                    if w.notifier().committed_end() <= r.position() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            _ = tokio::time::sleep(PING.min(idle / 3)) => {
                if last_heard.elapsed() > idle {
                    state.counters.timed_out.fetch_add(1, Ordering::Relaxed);
                    let _ = sink.send(close(CloseCode::Away, "idle timeout")).await;
                    return;
                }
                if sink.send(Message::Ping(Bytes::new())).await.is_err() {
                    return;
                }
            }
            msg = source.next() => {
                last_heard = tokio::time::Instant::now();
                let reply = match msg {
                    Some(Ok(Message::Text(t))) => {
                        publish_frame(&state, &channel, t.as_str(), may_publish, &identity).await
                    }
                    Some(Ok(Message::Binary(b))) => {
                        let r = Refusal::new(
                            StatusCode::BAD_REQUEST,
                            "invalid",
                            "binary frames are not served: send each publish request as a \
                             text frame (JSON)",
                        );
                        http::count(&state, &r);
                        error_frame(&reference(&b), r)
                    }
                    Some(Err(WsError::Capacity(e))) => {
                        let r = Refusal::new(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "too_large",
                            format!("a frame over gateway.max_body_bytes ({} bytes): {e}", state.cfg.max_body_bytes),
                        );
                        http::count(&state, &r);
                        if let Some(more) = REFUSALS_LOGGED.check() {
                            log::info!(
                                "gateway: closed a WebSocket on channel {channel:?} (1009): {}{more}",
                                r.message
                            );
                        }
                        let _ = sink.send(close(CloseCode::Size, "message too big")).await;
                        if let Ok(mut ws) = sink.reunite(source) {
                            drain(ws.get_mut()).await;
                        }
                        return;
                    }
                    Some(Ok(Message::Close(_))) => {
                        // The reply tungstenite queued, sent: the closing handshake.
                        let _ = sink.close().await;
                        return;
                    }
                    Some(Err(WsError::Protocol(e)))
                        if !matches!(e, ProtocolError::ResetWithoutClosingHandshake) =>
                    {
                        // Not a WebSocket client's frame (unmasked, reserved
                        // bits, a control frame over 125 bytes...): close 1002.
                        let r = Refusal::new(
                            StatusCode::BAD_REQUEST,
                            "invalid",
                            format!("WebSocket protocol error: {e}"),
                        );
                        http::count(&state, &r);
                        if let Some(more) = REFUSALS_LOGGED.check() {
                            log::info!(
                                "gateway: closed a WebSocket of {} on channel {channel:?} (1002): {}{more}",
                                identity.label,
                                r.message
                            );
                        }
                        let _ = sink.send(close(CloseCode::Protocol, "protocol error")).await;
                        if let Ok(mut ws) = sink.reunite(source) {
                            drain(ws.get_mut()).await;
                        }
                        return;
                    }
                    None | Some(Err(_)) => return,
                    Some(Ok(_)) => continue,
                };
                if sink.send(Message::Text(reply.to_string().into())).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Whether `key` is 16 bytes in base64 (RFC 6455 4.1): 22 characters of the
/// alphabet, the last holding 2 bits (`A`, `Q`, `g` or `w`), then `==`.
fn is_websocket_key(key: &str) -> bool {
    let b = key.as_bytes();
    b.len() == 24
        && b[..22]
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/')
        && matches!(b[21], b'A' | b'Q' | b'g' | b'w')
        && &b[22..] == b"=="
}

/// A close frame with `code` and `reason`.
fn close(code: CloseCode, reason: &'static str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

/// Reads and drops what the client still sends (bounded in time and bytes)
/// once the close frame is out, so closing does not reset the connection
/// under the close frame.
async fn drain<S: tokio::io::AsyncRead + Unpin>(io: &mut S) {
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut read = 0usize;
        while read < DRAIN_BYTES {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    })
    .await;
}

/// The `ref` of a frame, if it is a JSON object holding one.
fn reference(frame: &[u8]) -> serde_json::Value {
    serde_json::from_slice::<serde_json::Value>(frame)
        .ok()
        .and_then(|v| v.get("ref").cloned())
        .unwrap_or(serde_json::Value::Null)
}

/// The error frame answering the frame of `reference`.
fn error_frame(reference: &serde_json::Value, r: Refusal) -> serde_json::Value {
    let mut v = serde_json::json!({
        "type": "error", "ref": reference, "status": r.status.as_u16(),
        "error": r.code, "message": r.message,
    });
    if let Some(s) = r.retry_after {
        v["retry_after"] = serde_json::json!(s.max(1));
    }
    v
}

/// Handles one publish frame: the reply to send back. Refusals are counted
/// by reason, as HTTP requests' are.
async fn publish_frame(
    state: &State,
    channel: &str,
    text: &str,
    may_publish: bool,
    identity: &Identity,
) -> serde_json::Value {
    let reference = reference(text.as_bytes());
    let refused = |r: Refusal| {
        http::count(state, &r);
        log_refusal(&identity.label, &r);
        error_frame(&reference, r)
    };
    // Each publish frame is a request of the client's rate limit.
    if let Err(r) = http::rate_limit(state, &identity.label) {
        return refused(r);
    }
    if !may_publish {
        return refused(Refusal::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("this client may not publish to channel {channel:?}"),
        ));
    }
    if let Err(r) = publish::check_channel_budget(state, identity, channel) {
        return refused(r);
    }
    // `ref` is ours, not the message's: take it out before parsing.
    let mut body: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) if publish::is_too_deep(&e) => return refused(publish::too_deep()),
        Err(e) => {
            return refused(Refusal::new(
                StatusCode::BAD_REQUEST,
                "invalid",
                format!("bad JSON: {e}"),
            ));
        }
    };
    if let Some(o) = body.as_object_mut() {
        o.remove("ref");
    }
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    match publish::publish_body(state, channel, &bytes, None).await {
        Ok(p) => {
            let ids: Vec<&str> = p.iter().map(|p| p.0.as_str()).collect();
            let offsets: Vec<u64> = p.iter().map(|p| p.1).collect();
            serde_json::json!({"type": "published", "ref": reference, "ids": ids, "offsets": offsets})
        }
        Err(r) => refused(r),
    }
}

#[cfg(test)]
mod tests {
    use super::is_websocket_key;

    #[test]
    fn a_key_is_sixteen_bytes_in_base64() {
        assert!(is_websocket_key("dGhlIHNhbXBsZSBub25jZQ=="));
        assert!(!is_websocket_key("dGhlIHNhbXBsZSBub25jZQ")); // no padding
        assert!(!is_websocket_key("dGhlIHNhbXBsZSBub25jZR==")); // 130 bits
        assert!(!is_websocket_key("dGhlIHNhbXBsZSBub25j!Q=="));
        assert!(!is_websocket_key("abc"));
        assert!(!is_websocket_key("c2l4dGVlbiBieXRlcyBsb25nIQ==")); // 19 bytes
    }
}
