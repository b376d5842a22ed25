//! Requests: routing, authentication, the rate limit and the publish
//! endpoint.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use http_body_util::{BodyExt, Limited};
use hyper::body::{Body as _, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};

use super::auth::{self, Access, AuthError, Identity};
use super::publish::publish_body;
use super::reply::{
    full, header_str, json, log_refusal, param, percent_decode, query, rate_limit, refuse, Body,
    Client, Refusal,
};
use super::State;
use crate::envelope::{validate_name, NameKind};

/// Most bytes of a refused request's body read and thrown away before the
/// connection closes, so a client that sends its whole body before reading
/// the answer gets the answer (closing with unread bytes resets the
/// connection, and the client loses it).
const DRAIN_MIN: usize = 4 * 1024 * 1024;

/// The OpenAPI 3.1 description of this API.
pub const OPENAPI: &str = include_str!("openapi.json");

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
    let access = state
        .access
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    auth::identify(
        client.cn.as_deref(),
        token.as_deref(),
        &access.peers,
        &access.tokens,
    )
    .map_err(|e| match e {
        AuthError::Missing => Refusal::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "no credentials: present a client certificate or an Authorization: Bearer token",
        ),
        AuthError::BadToken => {
            // Taken from the address's allowance of bad tokens.
            let _ = state.auth_failures.check(&client.remote.ip().to_string());
            Refusal::new(
                StatusCode::UNAUTHORIZED,
                "unauthenticated",
                "the bearer token is not one of gateway.tokens",
            )
        }
        AuthError::UnknownPeer(cn) => Refusal::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("certificate CN {cn:?} is not in hub.allowed_peers"),
        ),
    })
}

/// [`authenticate`], unless the client's address sent too many bad tokens
/// (more than [`auth::AUTH_FAILURE_BURST`] at once, then
/// [`auth::AUTH_FAILURE_RATE`] a second): then 429 without checking the
/// token (a right guess is refused too) and the connection is closed.
/// A certificate client is identified by TLS and is not held back.
fn authenticate_limited(
    state: &State,
    client: &Client,
    req: &Request<Incoming>,
) -> Result<Identity, Refusal> {
    let addr = client.remote.ip().to_string();
    if client.cn.is_none() {
        if let Err(wait) = state.auth_failures.peek(&addr) {
            let mut r = Refusal::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_auth_failures",
                format!(
                    "{addr} sent too many bad tokens (more than {} at once, then {}/s); \
                     retry later",
                    auth::AUTH_FAILURE_BURST,
                    auth::AUTH_FAILURE_RATE
                ),
            );
            r.retry_after = Some(wait.as_secs_f64().ceil() as u64);
            r.close = true;
            return Err(r);
        }
    }
    authenticate(state, client, req)
}

/// Entry point of every request.
pub(super) async fn handle(
    state: Arc<State>,
    client: Arc<Client>,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    state.counters.requests.fetch_add(1, Ordering::Relaxed);
    // Its first request: the connection is no longer one still opening.
    drop(
        client
            .opening
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(),
    );
    let resp = match route(&state, &client, &mut req).await {
        Ok(r) => r,
        Err(r) => {
            log_refusal(&client.remote.to_string(), &r);
            let unread = !req.body().is_end_stream();
            let mut resp = refuse(&state, r);
            if unread {
                // Answered before the body was read (or all of it): read a
                // bounded amount of the rest, then close the connection.
                drain(&state, &mut req).await;
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            resp
        }
    };
    Ok(resp)
}

/// Reads and drops what is left of a refused request's body: at most
/// `max(gateway.max_body_bytes, 4 MiB)` bytes within `gateway.header_timeout`.
/// A client waiting for `100 Continue` has sent nothing: nothing is read.
async fn drain(state: &State, req: &mut Request<Incoming>) {
    let budget = state.cfg.max_body_bytes.max(DRAIN_MIN) as u64;
    let expects = header_str(req, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
    let declared = header_str(req, "content-length").and_then(|v| v.parse::<u64>().ok());
    if expects || declared.is_some_and(|n| n > budget) {
        return;
    }
    let limit = std::time::Duration::from_millis(state.cfg.header_timeout_ms.max(1));
    let body = req.body_mut();
    let _ = tokio::time::timeout(limit, async {
        let mut read = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            read += frame.data_ref().map_or(0, |d| d.len() as u64);
            if read > budget {
                break;
            }
        }
    })
    .await;
}

async fn route(
    state: &Arc<State>,
    client: &Client,
    req: &mut Request<Incoming>,
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
    let identity = authenticate_limited(state, client, req)?;
    rate_limit(state, &identity.label)?;
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
            super::publish::check_channel_budget(state, &identity, &channel)?;
            publish(state, &channel, req).await
        }
        (&Method::GET, "messages") => {
            if !identity.allows(Access::Subscribe, &channel) {
                return Err(forbidden(Access::Subscribe));
            }
            let create = identity.names(Access::Subscribe, &channel);
            let sse = header_str(req, "accept")
                .is_some_and(|a| a.to_ascii_lowercase().contains("text/event-stream"));
            if sse {
                super::stream::sse(state, &identity.label, &channel, req, create).await
            } else {
                super::stream::long_poll(state, &identity.label, &channel, req, create).await
            }
        }
        (&Method::GET, "ws") => {
            if !identity.allows(Access::Publish, &channel)
                && !identity.allows(Access::Subscribe, &channel)
            {
                return Err(forbidden(Access::Subscribe));
            }
            super::ws::upgrade(state, &channel, req, identity, client)
        }
        _ => {
            let mut r = Refusal::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{} is not served on {path:?}", req.method()),
            );
            r.header = Some((
                header::ALLOW,
                if tail == "ws" { "GET" } else { "GET, POST" },
            ));
            Err(r)
        }
    }
}

async fn publish(
    state: &Arc<State>,
    channel: &str,
    req: &mut Request<Incoming>,
) -> Result<Response<Body>, Refusal> {
    let max = state.cfg.max_body_bytes;
    let too_large = || {
        Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the body is over gateway.max_body_bytes ({max} bytes); send fewer or smaller messages"),
        )
    };
    let declared = header_str(req, "content-length").and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let default_type = match req.headers().get("keyop-payload-type") {
        None => None,
        Some(v) => Some(v.to_str().map(str::to_owned).map_err(|_| {
            Refusal::new(
                StatusCode::BAD_REQUEST,
                "invalid",
                "the Keyop-Payload-Type header is not valid: it must be visible ASCII \
                 (set payload_type in the body for other types)",
            )
        })?),
    };
    let body = Limited::new(req.body_mut(), max)
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
    let ids: Vec<&str> = published.iter().map(|p| p.0.as_str()).collect();
    let offsets: Vec<u64> = published.iter().map(|p| p.1).collect();
    Ok(json(
        StatusCode::CREATED,
        &serde_json::json!({"ids": ids, "offsets": offsets}),
    ))
}
