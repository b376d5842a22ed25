//! Who a gateway client is and what it may do: the client certificate's CN
//! checked against `hub.allowed_peers` (the hub's own policy), or a bearer
//! token whose SHA-256 hash is listed in `gateway.tokens`; and the per-client
//! rate limit (also used for bad tokens per address).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::federation::AllowedPeer;

/// One `gateway.tokens` entry: the token itself is never stored, only
/// `sha256:<hex>` of it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct TokenEntry {
    pub name: String,
    pub hash: String,
    /// Channels the token may publish to; empty: none.
    pub publish: Vec<String>,
    /// Channels the token may read; empty: none.
    pub subscribe: Vec<String>,
}

/// `sha256:` and the lowercase hex SHA-256 of `token` (what `gateway.tokens`
/// stores and `keyop-messenger token create` prints).
pub fn token_hash(token: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in d.as_ref() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// What a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Publish,
    Subscribe,
}

/// An authenticated client and its channel lists.
#[derive(Debug, Clone)]
pub struct Identity {
    /// `peer:<CN>` or `token:<name>`: the rate-limit key and the log label.
    pub label: String,
    /// `None`: any channel (a peer whose list is empty, as on the hub).
    publish: Option<Vec<String>>,
    subscribe: Option<Vec<String>>,
    /// A peer's `max_channels`: channels its publishes may create.
    pub max_channels: usize,
}

impl Identity {
    /// A peer of `hub.allowed_peers` (empty list: any channel, as the hub decides).
    pub fn peer(p: &AllowedPeer) -> Identity {
        Identity {
            label: format!("peer:{}", p.name),
            publish: (!p.publish.is_empty()).then(|| p.publish.clone()),
            subscribe: (!p.subscribe.is_empty()).then(|| p.subscribe.clone()),
            max_channels: p.max_channels,
        }
    }

    /// A token entry (empty list: no channel).
    pub fn token(t: &TokenEntry) -> Identity {
        Identity {
            label: format!("token:{}", t.name),
            publish: Some(t.publish.clone()),
            subscribe: Some(t.subscribe.clone()),
            max_channels: t.publish.len(),
        }
    }

    /// Whether `channel` is written in this client's list for `access` (not
    /// merely allowed by an empty list): only such channels are created by
    /// reading them.
    pub fn names(&self, access: Access, channel: &str) -> bool {
        let list = match access {
            Access::Publish => &self.publish,
            Access::Subscribe => &self.subscribe,
        };
        list.as_ref()
            .is_some_and(|l| l.iter().any(|c| c == channel))
    }

    /// Whether this client may use `channel` for `access`.
    pub fn allows(&self, access: Access, channel: &str) -> bool {
        let list = match access {
            Access::Publish => &self.publish,
            Access::Subscribe => &self.subscribe,
        };
        list.as_ref().is_none_or(|l| l.iter().any(|c| c == channel))
    }
}

/// Why a request has no identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// No certificate and no token (401).
    Missing,
    /// A token that matches no entry (401).
    BadToken,
    /// A certificate whose CN is not in `hub.allowed_peers` (403).
    UnknownPeer(String),
}

/// The identity of a request: the certificate's CN when the client
/// presented one (verified against the CA by TLS), else the bearer token.
pub fn identify(
    cert_cn: Option<&str>,
    token: Option<&str>,
    peers: &[AllowedPeer],
    tokens: &[TokenEntry],
) -> Result<Identity, AuthError> {
    if let Some(cn) = cert_cn {
        return peers
            .iter()
            .find(|p| p.name == cn)
            .map(Identity::peer)
            .ok_or_else(|| AuthError::UnknownPeer(cn.to_owned()));
    }
    let Some(token) = token else {
        return Err(AuthError::Missing);
    };
    let hash = token_hash(token);
    // Every entry is compared (no early exit on the first byte that differs).
    let mut found = None;
    for t in tokens {
        if constant_eq(t.hash.as_bytes(), hash.as_bytes()) {
            found = Some(t);
        }
    }
    found.map(Identity::token).ok_or(AuthError::BadToken)
}

fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A token bucket per client: `rate` requests per second, bursts of `burst`.
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

/// Bad tokens one address may send at once (then 429 until its bucket refills).
pub const AUTH_FAILURE_BURST: u32 = 10;
/// Bad tokens per second one address may send after its burst.
pub const AUTH_FAILURE_RATE: f64 = 1.0;

/// Clients remembered at most; idle full buckets are forgotten first.
const MAX_BUCKETS: usize = 10_000;

impl RateLimiter {
    /// `rate <= 0` turns the limit off.
    pub fn new(rate: f64, burst: u32) -> RateLimiter {
        RateLimiter {
            rate,
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request from `client`'s bucket: `Err(wait)` when it is empty.
    pub fn check(&self, client: &str) -> Result<(), Duration> {
        self.take(client, true)
    }

    /// Whether `client`'s bucket holds a request, without taking it:
    /// `Err(wait)` when it is empty.
    pub fn peek(&self, client: &str) -> Result<(), Duration> {
        self.take(client, false)
    }

    fn take(&self, client: &str, take: bool) -> Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let now = Instant::now();
        if !take {
            let b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
            let tokens = b.get(client).map_or(self.burst, |(tokens, at)| {
                (tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(self.burst)
            });
            return if tokens >= 1.0 {
                Ok(())
            } else {
                Err(Duration::from_secs_f64((1.0 - tokens) / self.rate))
            };
        }
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if b.len() >= MAX_BUCKETS && !b.contains_key(client) {
            let (rate, burst) = (self.rate, self.burst);
            b.retain(|_, (tokens, at)| {
                *tokens + now.duration_since(*at).as_secs_f64() * rate < burst
            });
        }
        let (tokens, at) = b.entry(client.to_owned()).or_insert((self.burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(self.burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / self.rate))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hash_is_sha256_hex() {
        assert_eq!(
            token_hash("abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn lists() {
        let t = TokenEntry {
            name: "t".into(),
            hash: token_hash("s"),
            publish: vec!["a".into()],
            subscribe: vec![],
        };
        let id = identify(None, Some("s"), &[], &[t]).unwrap();
        assert!(id.allows(Access::Publish, "a"));
        assert!(!id.allows(Access::Publish, "b"));
        assert!(!id.allows(Access::Subscribe, "a"));
        assert_eq!(
            identify(None, Some("x"), &[], &[]).unwrap_err(),
            AuthError::BadToken
        );
        assert_eq!(
            identify(None, None, &[], &[]).unwrap_err(),
            AuthError::Missing
        );
        let p = AllowedPeer {
            name: "edge".into(),
            ..AllowedPeer::default()
        };
        let id = identify(Some("edge"), None, &[p], &[]).unwrap();
        assert!(id.allows(Access::Subscribe, "anything"));
    }

    #[test]
    fn rate_limit_refuses_past_the_burst() {
        let r = RateLimiter::new(0.001, 2);
        assert!(r.check("a").is_ok());
        assert!(r.check("a").is_ok());
        assert!(r.check("a").is_err());
        assert!(r.check("b").is_ok());
    }

    #[test]
    fn peek_takes_nothing() {
        let r = RateLimiter::new(0.001, 1);
        for _ in 0..3 {
            assert!(r.peek("a").is_ok());
        }
        assert!(r.check("a").is_ok());
        assert!(r.peek("a").is_err());
        assert!(r.peek("b").is_ok());
    }
}
