//! `GET /v1/channels/{channel}/ws`: a WebSocket for both directions. The
//! client sends publish requests as text frames (the body of a POST, plus
//! an optional `ref` echoed back) and gets `{"type":"published",...}` once
//! committed or `{"type":"error",...}`; when it may read the channel it gets
//! `{"type":"message","next":...,"message":{...}}` from `from` (default
//! `latest`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::auth::{Access, Identity};
use super::publish;
use super::reply::{self as http, Body, Refusal};
use super::stream::{self, Event};
use super::State;
use crate::storage::{ChannelWriter, LogReader};

const PING: Duration = Duration::from_secs(15);

pub(super) fn upgrade(
    state: &Arc<State>,
    channel: &str,
    mut req: Request<Incoming>,
    identity: Identity,
) -> Result<Response<Body>, Refusal> {
    let may_publish = identity.allows(Access::Publish, channel);
    let may_subscribe = identity.allows(Access::Subscribe, channel);
    let create = identity.names(Access::Subscribe, channel);
    let key = http::header_str(&req, "sec-websocket-key").map(str::to_owned);
    let is_ws =
        http::header_str(&req, "upgrade").is_some_and(|u| u.eq_ignore_ascii_case("websocket"));
    let Some(key) = key.filter(|_| is_ws) else {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            "this path is a WebSocket: send Upgrade: websocket and Sec-WebSocket-Key",
        ));
    };
    let q = http::query(&req);
    let pos = stream::parse_position(http::param(&q, "from").unwrap_or("latest"))?;
    let slot = stream::take_slot(state)?;
    let reader = if may_subscribe {
        let (reader, writer) = stream::open_reader(state, channel, pos, create)?;
        Some((reader, writer))
    } else {
        None
    };
    let (st, ch) = (state.clone(), channel.to_owned());
    tokio::spawn(async move {
        let _slot = slot;
        let upgraded = match hyper::upgrade::on(&mut req).await {
            Ok(u) => u,
            Err(e) => {
                log::debug!("gateway: WebSocket upgrade failed: {e}");
                return;
            }
        };
        let cfg = WebSocketConfig::default().max_message_size(Some(st.cfg.max_body_bytes));
        let ws =
            WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, Some(cfg)).await;
        run(st, ch, ws, (may_publish, identity), reader).await;
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
    let mut last_heard = tokio::time::Instant::now();
    loop {
        // Deliver what is committed first.
        if let Some((r, w)) = reader.as_mut() {
            let events = tokio::task::block_in_place(|| stream::read_events(r, w, 256));
            let events = match events {
                Ok(e) => e,
                Err(e) => {
                    log::error!("gateway: cannot read channel {channel:?}: {e}");
                    return;
                }
            };
            if !events.is_empty() {
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
                state.counters.delivered.fetch_add(n, Ordering::Relaxed);
                continue;
            }
        }
        let committed = async {
            match reader.as_ref() {
                Some((r, w)) => w.notifier().changed_past(r.position()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = state.cancel.cancelled() => {
                let _ = sink.close().await;
                return;
            }
            _ = committed => {
                if let Some((r, w)) = reader.as_ref() {
                    if w.notifier().committed_end() <= r.position() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            _ = tokio::time::sleep(PING.min(idle / 3)) => {
                if last_heard.elapsed() > idle {
                    state.counters.timed_out.fetch_add(1, Ordering::Relaxed);
                    let _ = sink.close().await;
                    return;
                }
                if sink.send(Message::Ping(Bytes::new())).await.is_err() {
                    return;
                }
            }
            msg = source.next() => {
                last_heard = tokio::time::Instant::now();
                let text = match msg {
                    Some(Ok(Message::Text(t))) => t,
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                    Some(Ok(_)) => continue,
                };
                let reply = publish_frame(&state, &channel, text.as_str(), may_publish, &identity).await;
                if sink.send(Message::Text(reply.to_string().into())).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Handles one publish frame: the reply to send back.
async fn publish_frame(
    state: &State,
    channel: &str,
    text: &str,
    may_publish: bool,
    identity: &Identity,
) -> serde_json::Value {
    let reference = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v.get("ref").cloned())
        .unwrap_or(serde_json::Value::Null);
    let refused = |r: Refusal| {
        serde_json::json!({
            "type": "error", "ref": reference, "status": r.status.as_u16(),
            "error": r.code, "message": r.message,
        })
    };
    if !may_publish {
        state
            .counters
            .refused_forbidden
            .fetch_add(1, Ordering::Relaxed);
        return refused(Refusal::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("this client may not publish to channel {channel:?}"),
        ));
    }
    if let Err(r) = publish::check_channel_budget(state, identity, channel) {
        state
            .counters
            .refused_forbidden
            .fetch_add(1, Ordering::Relaxed);
        return refused(r);
    }
    // `ref` is ours, not the message's: take it out before parsing.
    let mut body: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            state
                .counters
                .refused_bad_request
                .fetch_add(1, Ordering::Relaxed);
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
        Err(r) => {
            if r.status == StatusCode::BAD_REQUEST {
                state
                    .counters
                    .refused_bad_request
                    .fetch_add(1, Ordering::Relaxed);
            }
            refused(r)
        }
    }
}
