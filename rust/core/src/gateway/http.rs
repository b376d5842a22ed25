//! Requests: routing, authentication, limits, publishing, and the
//! responses (JSON bodies, named errors).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;

use super::auth::{self, Access, AuthError, Identity};
use super::State;
use crate::engine::Outgoing;
use crate::envelope::{validate_name, NameKind};
use crate::Error;

pub(super) type Body = BoxBody<Bytes, Infallible>;

/// The OpenAPI 3.1 description of this API.
pub const OPENAPI: &str = include_str!("openapi.json");

/// The connection a request came on.
pub(super) struct Client {
    /// Subject CN of the verified client certificate, if one was presented.
    pub cn: Option<String>,
    pub remote: SocketAddr,
}

/// A refusal: its status, a short code and the message for the caller.
pub(super) struct Refusal {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<u64>,
}

impl Refusal {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
}

pub(super) fn full(
    status: StatusCode,
    content_type: &'static str,
    body: Vec<u8>,
) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body)).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

pub(super) fn json(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    full(
        status,
        "application/json",
        serde_json::to_vec(v).unwrap_or_default(),
    )
}

/// The JSON error body of a refusal (counted by reason).
pub(super) fn refuse(state: &State, r: Refusal) -> Response<Body> {
    let c = &state.counters;
    let counter = match r.status {
        StatusCode::UNAUTHORIZED => Some(&c.refused_unauthenticated),
        StatusCode::FORBIDDEN => Some(&c.refused_forbidden),
        StatusCode::PAYLOAD_TOO_LARGE => Some(&c.refused_too_large),
        StatusCode::TOO_MANY_REQUESTS => Some(&c.refused_rate_limited),
        StatusCode::SERVICE_UNAVAILABLE if r.code == "too_many_streams" => {
            Some(&c.refused_too_many_streams)
        }
        StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => {
            Some(&c.refused_bad_request)
        }
        _ => None,
    };
    if let Some(counter) = counter {
        counter.fetch_add(1, Ordering::Relaxed);
    }
    let mut resp = json(
        r.status,
        &serde_json::json!({"error": r.code, "message": r.message}),
    );
    if r.status == StatusCode::UNAUTHORIZED {
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"keyop-messenger\""),
        );
    }
    if let Some(s) = r.retry_after {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
    }
    resp
}

/// Maps an engine error onto a refusal (nothing was stored).
pub(super) fn engine_refusal(e: &Error) -> Refusal {
    let (status, code) = match e {
        Error::InvalidName(_) | Error::InvalidRecord(_) | Error::Config(_) => {
            (StatusCode::BAD_REQUEST, "invalid")
        }
        Error::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        Error::Closed(_) | Error::Forked(_) => (StatusCode::SERVICE_UNAVAILABLE, "closed"),
        Error::Policy(_) => (StatusCode::FORBIDDEN, "forbidden"),
        Error::DataLoss(_) => (StatusCode::GONE, "data_loss"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "storage"),
    };
    Refusal::new(status, code, e.to_string())
}

/// Query parameters, percent-decoded.
pub(super) fn query(req: &Request<Incoming>) -> Vec<(String, String)> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

pub(super) fn param<'a>(q: &'a [(String, String)], name: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn header_str<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Who sent `req` (certificate or bearer token, or `access_token` in the
/// query for browsers' EventSource, which cannot set headers).
fn authenticate(
    state: &State,
    client: &Client,
    req: &Request<Incoming>,
) -> Result<Identity, Refusal> {
    let bearer = header_str(req, "authorization")
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(|t| t.trim().to_owned());
    let token = bearer.or_else(|| param(&query(req), "access_token").map(str::to_owned));
    auth::identify(
        client.cn.as_deref(),
        token.as_deref(),
        &state.cfg.allowed_peers,
        &state.cfg.tokens,
    )
    .map_err(|e| match e {
        AuthError::Missing => Refusal::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "no credentials: present a client certificate or an Authorization: Bearer token",
        ),
        AuthError::BadToken => Refusal::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "the bearer token is not one of gateway.tokens",
        ),
        AuthError::UnknownPeer(cn) => Refusal::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("certificate CN {cn:?} is not in hub.allowed_peers"),
        ),
    })
}

/// Entry point of every request.
pub(super) async fn handle(
    state: Arc<State>,
    client: Arc<Client>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    state.counters.requests.fetch_add(1, Ordering::Relaxed);
    let resp = match route(&state, &client, req).await {
        Ok(r) => r,
        Err(r) => {
            if r.status != StatusCode::NOT_FOUND {
                log::info!(
                    "gateway: refused a request of {}: {} {}",
                    client.remote,
                    r.status,
                    r.message
                );
            }
            refuse(&state, r)
        }
    };
    Ok(resp)
}

async fn route(
    state: &Arc<State>,
    client: &Client,
    req: Request<Incoming>,
) -> Result<Response<Body>, Refusal> {
    let path = req.uri().path().to_owned();
    if path == "/v1/openapi.json" {
        return Ok(full(
            StatusCode::OK,
            "application/json",
            OPENAPI.as_bytes().to_vec(),
        ));
    }
    let rest = path.strip_prefix("/v1/channels/").ok_or_else(|| {
        Refusal::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no such path {path:?}"),
        )
    })?;
    let (channel, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let channel = percent_decode(channel);
    if tail != "messages" && tail != "ws" {
        return Err(Refusal::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no such path {path:?}: use /v1/channels/{{channel}}/messages or /ws"),
        ));
    }
    let identity = authenticate(state, client, &req)?;
    if let Err(wait) = state.limiter.check(&identity.label) {
        let mut r = Refusal::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            format!(
                "{} is over gateway.rate_limit_per_s ({}/s); retry later",
                identity.label, state.cfg.rate_limit_per_s
            ),
        );
        r.retry_after = Some(wait.as_secs_f64().ceil() as u64);
        return Err(r);
    }
    validate_name(NameKind::Channel, &channel)
        .map_err(|e| Refusal::new(StatusCode::BAD_REQUEST, "invalid", e.to_string()))?;
    let forbidden = |access: Access| {
        Refusal::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "{} may not {} channel {channel:?}",
                identity.label,
                match access {
                    Access::Publish => "publish to",
                    Access::Subscribe => "subscribe to",
                }
            ),
        )
    };
    match (req.method(), tail) {
        (&Method::POST, "messages") => {
            if !identity.allows(Access::Publish, &channel) {
                return Err(forbidden(Access::Publish));
            }
            publish(state, &channel, req).await
        }
        (&Method::GET, "messages") => {
            if !identity.allows(Access::Subscribe, &channel) {
                return Err(forbidden(Access::Subscribe));
            }
            let sse = header_str(&req, "accept").is_some_and(|a| a.contains("text/event-stream"));
            if sse {
                super::stream::sse(state, &channel, &req).await
            } else {
                super::stream::long_poll(state, &channel, &req).await
            }
        }
        (&Method::GET, "ws") => {
            let (p, s) = (
                identity.allows(Access::Publish, &channel),
                identity.allows(Access::Subscribe, &channel),
            );
            if !p && !s {
                return Err(forbidden(Access::Subscribe));
            }
            super::ws::upgrade(state, &channel, req, p, s)
        }
        _ => Err(Refusal::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{} is not served on {path:?}", req.method()),
        )),
    }
}

/// One message of a publish request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MessageIn {
    pub payload_type: Option<String>,
    pub payload: serde_json::Value,
    pub correlation_id: Option<String>,
    pub service_name: Option<String>,
}

/// Parses a publish body and publishes it through the channel writer:
/// `Ok` only once every record is committed.
pub(super) async fn publish_body(
    state: &State,
    channel: &str,
    body: &[u8],
    default_type: Option<&str>,
) -> Result<Vec<crate::Published>, Refusal> {
    let invalid = |e: String| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            format!(
                "the body must be {{\"payload_type\": ..., \"payload\": ...}} or \
                 {{\"messages\": [...]}} of those: {e}"
            ),
        )
    };
    let mut parsed: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| invalid(e.to_string()))?;
    let batch = match parsed.as_object_mut() {
        Some(o) if o.contains_key("messages") => {
            if o.len() > 1 {
                return Err(invalid("a batch has only the key \"messages\"".into()));
            }
            o.remove("messages")
        }
        _ => None,
    };
    let messages: Vec<MessageIn> = match batch {
        Some(list) => {
            serde_json::from_value(list).map_err(|e| invalid(format!("messages: {e}")))?
        }
        None => vec![serde_json::from_value(parsed).map_err(|e| invalid(e.to_string()))?],
    };
    if messages.is_empty() {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            "\"messages\" is empty: send at least one message",
        ));
    }
    // Compact payloads, each as its own JSON text (what the envelope holds).
    let mut payloads = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if m.payload_type.as_deref().or(default_type).is_none() {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "invalid",
                format!(
                    "message {i} has no payload_type: set the field or the Keyop-Payload-Type header"
                ),
            ));
        }
        payloads.push(serde_json::to_vec(&m.payload).unwrap_or_default());
    }
    let engine = state.engine.upgrade().ok_or_else(|| {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "closed",
            "the messenger is closed",
        )
    })?;
    let channel = channel.to_owned();
    let default_type = default_type.map(str::to_owned);
    let published = tokio::task::spawn_blocking(move || {
        let items: Vec<Outgoing<'_>> = messages
            .iter()
            .zip(&payloads)
            .map(|(m, p)| Outgoing {
                payload_type: m
                    .payload_type
                    .as_deref()
                    .or(default_type.as_deref())
                    .unwrap_or_default(),
                payload_json: p,
                service_name: m.service_name.as_deref(),
                correlation_id: m.correlation_id.as_deref(),
            })
            .collect();
        engine.publish_batch(&channel, &items)
    })
    .await
    .map_err(|e| {
        Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "storage",
            format!("publish task: {e}"),
        )
    })?
    .map_err(|e| engine_refusal(&e))?;
    state
        .counters
        .published
        .fetch_add(published.len() as u64, Ordering::Relaxed);
    Ok(published)
}

async fn publish(
    state: &Arc<State>,
    channel: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, Refusal> {
    let max = state.cfg.max_body_bytes;
    let too_large = || {
        Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the body is over gateway.max_body_bytes ({max} bytes); send fewer or smaller messages"),
        )
    };
    let declared = header_str(&req, "content-length").and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let default_type = header_str(&req, "keyop-payload-type").map(str::to_owned);
    let body = Limited::new(req.into_body(), max)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                too_large()
            } else {
                Refusal::new(
                    StatusCode::BAD_REQUEST,
                    "invalid",
                    format!("cannot read the body: {e}"),
                )
            }
        })?
        .to_bytes();
    let published = publish_body(state, channel, &body, default_type.as_deref()).await?;
    let ids: Vec<&str> = published.iter().map(|p| p.id.as_str()).collect();
    let offsets: Vec<u64> = published.iter().map(|p| p.offset).collect();
    Ok(json(
        StatusCode::CREATED,
        &serde_json::json!({"ids": ids, "offsets": offsets}),
    ))
}

/// `Retry-After` for a refused stream.
pub(super) fn too_many_streams(state: &State) -> Refusal {
    let mut r = Refusal::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "too_many_streams",
        format!(
            "gateway.max_streams ({}) streams are open; retry later",
            state.cfg.max_streams
        ),
    );
    r.retry_after = Some(1);
    r
}

/// Most a long poll may wait: `gateway.max_wait_ms`, and well within the idle timeout.
pub(super) fn max_wait(state: &State) -> Duration {
    Duration::from_millis(state.cfg.max_wait_ms.min(state.cfg.idle_timeout_ms / 2))
}

#[cfg(test)]
mod tests {
    use super::percent_decode;

    #[test]
    fn decodes_percent_escapes() {
        assert_eq!(
            percent_decode("2026-11-27T08%3A00%3A00Z"),
            "2026-11-27T08:00:00Z"
        );
        assert_eq!(percent_decode("a+b%"), "a b%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
