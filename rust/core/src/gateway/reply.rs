//! Responses and what requests carry: JSON bodies, refusals (counted by
//! reason), query parameters and headers.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};

use super::{GatewayCounters, State};
use crate::Error;

/// Refusals are logged at most once per 10 s (they are all counted).
pub(super) static REFUSALS_LOGGED: crate::lograte::RateLimit =
    crate::lograte::RateLimit::new(std::time::Duration::from_secs(10));
/// Storage errors (disk full, EIO) are logged apart from refusals, so a
/// flood of bad requests does not hide them.
pub(super) static STORAGE_ERRORS_LOGGED: crate::lograte::RateLimit =
    crate::lograte::RateLimit::new(std::time::Duration::from_secs(10));

/// The connection a request came on.
pub(super) struct Client {
    /// Subject CN of the verified client certificate, if one was presented.
    pub cn: Option<String>,
    pub remote: std::net::SocketAddr,
    /// When bytes last moved on the connection (a WebSocket's idle timeout).
    pub activity: super::activity::Activity,
    /// Until its first request arrives, the connection may be dropped to
    /// make room for others (taken out, and dropped, by that request).
    pub opening: std::sync::Mutex<Option<super::slots::Pending>>,
}

/// Takes a request from the client `label`'s rate limit: a 429 refusal
/// with `Retry-After` when it is over (HTTP requests and WebSocket publish
/// frames alike).
pub(super) fn rate_limit(state: &State, label: &str) -> Result<(), Refusal> {
    let Err(wait) = state.limiter.check(label) else {
        return Ok(());
    };
    let mut r = Refusal::new(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        format!(
            "{label} is over gateway.rate_limit_per_s ({}/s); retry later",
            state.cfg.rate_limit_per_s
        ),
    );
    r.retry_after = Some(wait.as_secs_f64().ceil() as u64);
    Err(r)
}

/// Logs a refusal: counted always, logged at most once per 10 s (a flood of
/// bad requests must not flood the log); a storage error at WARNING.
pub(super) fn log_refusal(who: &str, r: &Refusal) {
    if r.status.is_server_error() && r.code == "storage" {
        if let Some(more) = STORAGE_ERRORS_LOGGED.check() {
            log::warn!(
                "gateway: cannot serve a request of {who}: {} {}{more}",
                r.status,
                r.message
            );
        }
    } else if let Some(more) = REFUSALS_LOGGED.check() {
        log::info!(
            "gateway: refused a request of {who}: {} {}{more}",
            r.status,
            r.message
        );
    }
}

/// Response bodies: whole or streamed.
pub(super) type Body = BoxBody<Bytes, Infallible>;

/// A refusal: its status, a short code and the message for the caller.
pub(super) struct Refusal {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<u64>,
    /// One more header of the answer: a 405's `Allow` (the methods
    /// served), a 426's `Sec-WebSocket-Version`.
    pub header: Option<(header::HeaderName, &'static str)>,
    /// Close the connection after the answer.
    pub close: bool,
}

impl Refusal {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            code,
            message: message.into(),
            retry_after: None,
            header: None,
            close: false,
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

/// Counts a refusal under its reason.
pub(super) fn count(state: &State, r: &Refusal) {
    if let Some(counter) = counter(&state.counters, r) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The counter of a refusal's reason (none for a closing messenger).
fn counter<'a>(c: &'a GatewayCounters, r: &Refusal) -> Option<&'a AtomicU64> {
    match r.status {
        _ if r.code == "too_many_auth_failures" => Some(&c.refused_too_many_auth_failures),
        _ if r.code == "too_many_streams" => Some(&c.refused_too_many_streams),
        StatusCode::UNAUTHORIZED => Some(&c.refused_unauthenticated),
        StatusCode::FORBIDDEN => Some(&c.refused_forbidden),
        StatusCode::PAYLOAD_TOO_LARGE => Some(&c.refused_too_large),
        StatusCode::TOO_MANY_REQUESTS => Some(&c.refused_rate_limited),
        StatusCode::BAD_REQUEST
        | StatusCode::NOT_FOUND
        | StatusCode::METHOD_NOT_ALLOWED
        | StatusCode::UPGRADE_REQUIRED => Some(&c.refused_bad_request),
        _ if r.code == "storage" => Some(&c.refused_storage),
        _ => None,
    }
}

/// The JSON error body of a refusal (counted by reason).
pub(super) fn refuse(state: &State, r: Refusal) -> Response<Body> {
    count(state, &r);
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
    if let Some((name, value)) = r.header {
        resp.headers_mut()
            .insert(name, HeaderValue::from_static(value));
    }
    if r.close {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
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
        Error::Storage(crate::StorageError::ChannelNotFound { channel, .. }) => {
            return Refusal::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("channel {channel:?} does not exist (yet): publish to it first"),
            )
        }
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

pub(super) fn percent_decode(s: &str) -> String {
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
    use super::*;

    #[test]
    fn a_storage_error_is_counted_as_storage() {
        let c = GatewayCounters::default();
        let io = std::io::Error::new(std::io::ErrorKind::StorageFull, "No space left on device");
        let r = engine_refusal(&Error::Storage(crate::StorageError::Io {
            context: "append to segment".into(),
            source: std::sync::Arc::new(io),
        }));
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(std::ptr::eq(counter(&c, &r).unwrap(), &c.refused_storage));
        let closed = Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "closed", "closed");
        assert!(counter(&c, &closed).is_none());
    }

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
