// why this file is long: one fixture (a CA, certificates, an engine with the gateway, a raw
// HTTPS client) shared by every end-to-end case of the gateway; split, each file would repeat it.
//! The HTTP gateway end to end over real TLS sockets on 127.0.0.1: durable
//! publish, Server-Sent Events with resume, long polls, the WebSocket,
//! authentication by certificate and by token, and the limits.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use keyop_core::federation::{AllowedPeer, TlsSettings};
use keyop_core::gateway::{token_hash, GatewayConfig, TokenEntry};
use keyop_core::keygen::{self, InstanceRequest};
use keyop_core::{Engine, StoreConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

const TOKEN: &str = "s3cret-token";

struct Pki {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_owned();
        keygen::keygen_ca(&root.join("ca.crt"), &root.join("ca.key"), 30, false).unwrap();
        for name in ["localhost", "edge", "stranger"] {
            let mut req = InstanceRequest::new(root.join("ca.crt"), root.join("ca.key"), name);
            req.out_cert = Some(root.join(format!("{name}.crt")));
            req.out_key = Some(root.join(format!("{name}.key")));
            keygen::keygen_instance(&req).unwrap();
        }
        Pki { _dir: dir, root }
    }

    fn path(&self, file: &str) -> String {
        self.root.join(file).to_string_lossy().into_owned()
    }

    /// A TLS client trusting the CA, presenting `cert` (an instance name) if given.
    fn connector(&self, cert: Option<&str>) -> TlsConnector {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(self.root.join("ca.crt")).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let b = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let cfg = match cert {
            Some(name) => {
                let certs = CertificateDer::pem_file_iter(self.root.join(format!("{name}.crt")))
                    .unwrap()
                    .map(|c| c.unwrap())
                    .collect();
                let key =
                    PrivateKeyDer::from_pem_file(self.root.join(format!("{name}.key"))).unwrap();
                b.with_client_auth_cert(certs, key).unwrap()
            }
            None => b.with_no_client_auth(),
        };
        TlsConnector::from(Arc::new(cfg))
    }
}

struct Fixture {
    pki: Pki,
    _data: tempfile::TempDir,
    engine: Arc<Engine>,
    addr: std::net::SocketAddr,
    rt: tokio::runtime::Runtime,
}

fn start(tweak: impl FnOnce(&mut GatewayConfig)) -> Fixture {
    let pki = Pki::new();
    let data = tempfile::tempdir().unwrap();
    let engine = Arc::new(
        Engine::open(
            StoreConfig {
                data_dir: data.path().to_owned(),
                sync_interval_ms: 0,
                segment_bytes: 0,
            },
            "localhost",
        )
        .unwrap(),
    );
    let mut cfg = GatewayConfig {
        listen_addr: "127.0.0.1:0".into(),
        tls: TlsSettings {
            cert: pki.path("localhost.crt"),
            key: pki.path("localhost.key"),
            ca: pki.path("ca.crt"),
            min_version: "1.3".into(),
            expiry_warn_days: 0,
        },
        allowed_peers: vec![AllowedPeer {
            name: "edge".into(),
            publish: vec!["sensors".into()],
            subscribe: vec!["sensors".into()],
            ..AllowedPeer::default()
        }],
        tokens: vec![TokenEntry {
            name: "app".into(),
            hash: token_hash(TOKEN),
            publish: vec!["sensors".into(), "big".into()],
            subscribe: vec!["sensors".into()],
        }],
        ..GatewayConfig::default()
    };
    tweak(&mut cfg);
    engine.start_gateway(cfg).unwrap();
    let addr = engine.with_gateway(|g| g.local_addr()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    Fixture {
        pki,
        _data: data,
        engine,
        addr,
        rt,
    }
}

struct Resp {
    status: u16,
    headers: String,
    body: String,
}

impl Fixture {
    async fn tls(&self, cert: Option<&str>) -> tokio_rustls::client::TlsStream<TcpStream> {
        let tcp = TcpStream::connect(self.addr).await.unwrap();
        self.pki
            .connector(cert)
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap()
    }

    /// One request on its own connection (`Connection: close`), read to the end.
    fn request(
        &self,
        cert: Option<&str>,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Resp {
        self.rt.block_on(async {
            let mut s = self.tls(cert).await;
            let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
            for (k, v) in headers {
                req.push_str(&format!("{k}: {v}\r\n"));
            }
            req.push_str("\r\n");
            req.push_str(body);
            s.write_all(req.as_bytes()).await.unwrap();
            let mut raw = Vec::new();
            tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
                .await
                .expect("response in time")
                .ok();
            parse(&String::from_utf8_lossy(&raw))
        })
    }

    fn token_request(&self, method: &str, path: &str, body: &str) -> Resp {
        self.request(
            None,
            method,
            path,
            &[("Authorization", &format!("Bearer {TOKEN}"))],
            body,
        )
    }

    /// Reads an SSE stream until `n` records arrived: their (id, data).
    fn sse(&self, path: &str, last_event_id: Option<&str>, n: usize) -> Vec<(String, String)> {
        self.rt.block_on(async {
            let mut s = self.tls(None).await;
            let mut req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\nAuthorization: Bearer {TOKEN}\r\n");
            if let Some(id) = last_event_id {
                req.push_str(&format!("Last-Event-ID: {id}\r\n"));
            }
            req.push_str("\r\n");
            s.write_all(req.as_bytes()).await.unwrap();
            let mut raw = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let events = sse_events(&String::from_utf8_lossy(&raw));
                if events.len() >= n {
                    return events;
                }
                let got = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
                    .await
                    .expect("events in time")
                    .unwrap();
                assert!(got > 0, "stream ended early: {}", String::from_utf8_lossy(&raw));
                raw.extend_from_slice(&buf[..got]);
            }
        })
    }
}

fn parse(raw: &str) -> Resp {
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Resp {
        status,
        headers: head.to_ascii_lowercase(),
        body: body.to_owned(),
    }
}

/// `(id, data)` of the SSE events carrying data in `raw` (chunk framing
/// lines, comments and data-less events are passed over).
fn sse_events(raw: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut id = None;
    for line in raw.lines() {
        if let Some(v) = line.strip_prefix("id: ") {
            id = Some(v.to_owned());
        } else if let Some(v) = line.strip_prefix("data: ") {
            out.push((id.clone().unwrap_or_default(), v.to_owned()));
        }
    }
    out
}

fn stream_end(engine: &Engine, channel: &str, dir: &Path) -> u64 {
    if !dir.join("channels").join(channel).is_dir() {
        return 0;
    }
    engine.store().writer(channel).unwrap().committed_end()
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {body:?}"))
}

#[test]
fn publish_answers_201_with_ids_of_committed_records_and_sse_resumes() {
    let f = start(|_| {});
    let one = f.token_request(
        "POST",
        "/v1/channels/sensors/messages",
        r#"{"payload_type":"reading","payload":{"t":1}}"#,
    );
    assert_eq!(one.status, 201, "{}", one.body);
    let one = json(&one.body);
    let batch = f.request(
        None,
        "POST",
        "/v1/channels/sensors/messages",
        &[
            ("Authorization", &format!("Bearer {TOKEN}")),
            ("Keyop-Payload-Type", "reading"),
        ],
        r#"{"messages":[{"payload":{"t":2}},{"payload":{"t":3},"correlation_id":"c-3"}]}"#,
    );
    assert_eq!(batch.status, 201, "{}", batch.body);
    let batch = json(&batch.body);
    let mut ids: Vec<String> = one["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    ids.extend(
        batch["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned()),
    );
    assert_eq!(ids.len(), 3);

    // Committed: a reader of the channel finds the three records, in order.
    let (mut reader, writer) = f.engine.read("sensors", 0).unwrap();
    let mut on_disk = Vec::new();
    while let Some(keyop_core::storage::Item::Record { line, .. }) =
        reader.next_item(writer.committed_end()).unwrap()
    {
        on_disk.push(keyop_core::Envelope::decode(&line).unwrap());
    }
    assert_eq!(
        on_disk.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        ids
    );
    assert_eq!(on_disk[2].correlation_id.as_deref(), Some("c-3"));
    assert_eq!(on_disk[1].payload_type, "reading");

    let events = f.sse("/v1/channels/sensors/messages?from=earliest", None, 3);
    let seen: Vec<String> = events
        .iter()
        .map(|(_, d)| json(d)["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(seen, ids);
    // Resume after the first event: the next two, and nothing twice.
    let resumed = f.sse(
        "/v1/channels/sensors/messages?from=earliest",
        Some(&events[0].0),
        2,
    );
    let again: Vec<String> = resumed
        .iter()
        .map(|(_, d)| json(d)["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(again, ids[1..]);
    // A time in the future starts at the end; a time in the past at the start.
    let past = f.sse(
        "/v1/channels/sensors/messages?from=2000-01-01T00:00:00Z",
        None,
        3,
    );
    assert_eq!(past.len(), 3);

    // Long poll: after a position, limited, with the next position.
    let p = f.token_request(
        "GET",
        &format!(
            "/v1/channels/sensors/messages?after={}&limit=1",
            events[0].0
        ),
        "",
    );
    assert_eq!(p.status, 200, "{}", p.body);
    let p = json(&p.body);
    assert_eq!(p["messages"].as_array().unwrap().len(), 1);
    assert_eq!(p["messages"][0]["message"]["id"], ids[1].as_str());
    assert_eq!(p["next"].to_string(), events[1].0);
}

#[test]
fn bad_bodies_are_refused_with_named_errors_and_nothing_is_stored() {
    let f = start(|_| {});
    for body in [
        "not json",
        r#"{"payload":{"t":1}}"#,
        r#"{"messages":[]}"#,
        r#"{"payload_type":"bad\u0007type","payload":1}"#,
        r#"{"payload_type":"x","payload":1,"extra":2}"#,
    ] {
        let r = f.token_request("POST", "/v1/channels/sensors/messages", body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(json(&r.body)["error"], "invalid");
    }
    assert_eq!(stream_end(&f.engine, "sensors", f._data.path()), 0);
}

#[test]
fn credentials_and_channel_lists_decide() {
    let f = start(|_| {});
    let body = r#"{"payload_type":"t","payload":1}"#;
    let none = f.request(None, "POST", "/v1/channels/sensors/messages", &[], body);
    assert_eq!(none.status, 401);
    assert!(none.headers.contains("www-authenticate: bearer"));
    let wrong = f.request(
        None,
        "POST",
        "/v1/channels/sensors/messages",
        &[("Authorization", "Bearer nope")],
        body,
    );
    assert_eq!(wrong.status, 401);
    // The token may not publish to "other": 403 and nothing stored.
    let other = f.token_request("POST", "/v1/channels/other/messages", body);
    assert_eq!(other.status, 403, "{}", other.body);
    assert_eq!(stream_end(&f.engine, "other", f._data.path()), 0);
    // It may publish to "big" but not read it.
    let read = f.token_request("GET", "/v1/channels/big/messages", "");
    assert_eq!(read.status, 403);
    // A certificate in allowed_peers publishes within its lists.
    let edge = f.request(
        Some("edge"),
        "POST",
        "/v1/channels/sensors/messages",
        &[],
        body,
    );
    assert_eq!(edge.status, 201, "{}", edge.body);
    let edge_other = f.request(
        Some("edge"),
        "POST",
        "/v1/channels/other/messages",
        &[],
        body,
    );
    assert_eq!(edge_other.status, 403);
    // A CA-signed certificate whose CN is not an allowed peer: 403.
    let stranger = f.request(
        Some("stranger"),
        "POST",
        "/v1/channels/sensors/messages",
        &[],
        body,
    );
    assert_eq!(stranger.status, 403);
    assert_eq!(stream_end(&f.engine, "other", f._data.path()), 0);
    let c = f.engine.with_gateway(|g| g.counters().snapshot()).unwrap();
    let get = |k: &str| c.iter().find(|(n, _)| *n == k).unwrap().1;
    assert_eq!(get("refused_unauthenticated"), 2);
    assert_eq!(get("refused_forbidden"), 4);
    assert_eq!(get("published"), 1);
}

#[test]
fn limits_refuse_and_are_counted() {
    let f = start(|c| {
        c.max_body_bytes = 200;
        c.rate_limit_per_s = 0.01;
        c.rate_limit_burst = 4;
        c.max_streams = 1;
        c.header_timeout_ms = 300;
    });
    let big = format!(r#"{{"payload_type":"t","payload":"{}"}}"#, "x".repeat(300));
    let r = f.token_request("POST", "/v1/channels/big/messages", &big);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(stream_end(&f.engine, "big", f._data.path()), 0);

    // One stream open (a WebSocket from the certificate client), a second is refused.
    f.rt.block_on(async {
        let tls = f.tls(Some("edge")).await;
        let (mut ws, _) = tokio_tungstenite::client_async("wss://localhost/v1/channels/sensors/ws?from=earliest", tls)
            .await
            .unwrap();
        let mut s = f.tls(None).await;
        s.write_all(format!("GET /v1/channels/sensors/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAccept: text/event-stream\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok();
        let r = parse(&String::from_utf8_lossy(&raw));
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(r.headers.contains("retry-after: 1"));
        // The WebSocket publishes and hears its own message.
        ws.send(tokio_tungstenite::tungstenite::Message::Text(
            r#"{"ref":7,"payload_type":"t","payload":{"n":1}}"#.into(),
        ))
        .await
        .unwrap();
        let mut published = None;
        let mut delivered = None;
        for _ in 0..10 {
            let m = tokio::time::timeout(Duration::from_secs(30), ws.next()).await.unwrap().unwrap().unwrap();
            if let tokio_tungstenite::tungstenite::Message::Text(t) = m {
                let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
                match v["type"].as_str() {
                    Some("published") => published = Some(v),
                    Some("message") => delivered = Some(v),
                    _ => {}
                }
            }
            if published.is_some() && delivered.is_some() {
                break;
            }
        }
        let (p, d) = (published.unwrap(), delivered.unwrap());
        assert_eq!(p["ref"], 7);
        assert_eq!(d["message"]["id"], p["ids"][0]);
        ws.close(None).await.ok();
    });

    // Slow client: headers never finished; the connection is closed.
    f.rt.block_on(async {
        let mut s = f.tls(None).await;
        s.write_all(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let mut raw = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw)).await;
        assert!(closed.is_ok(), "the server closed the slow connection");
    });

    // The burst is 4 requests (one went to the 413, one to the 503 above,
    // counting per identity: the token made 2); exhaust it.
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let r = f.token_request("GET", "/v1/channels/sensors/messages", "");
        statuses.push((r.status, r.headers));
    }
    let limited = statuses.iter().find(|(s, _)| *s == 429).expect("a 429");
    assert!(limited.1.contains("retry-after: "));

    let c = f.engine.with_gateway(|g| g.counters().snapshot()).unwrap();
    let get = |k: &str| c.iter().find(|(n, _)| *n == k).unwrap().1;
    assert_eq!(get("refused_too_large"), 1);
    assert_eq!(get("refused_too_many_streams"), 1);
    assert!(get("refused_rate_limited") >= 1);
    assert!(get("timed_out") >= 1);
}

#[test]
fn openapi_document_is_served_without_credentials() {
    let f = start(|_| {});
    let r = f.request(None, "GET", "/v1/openapi.json", &[], "");
    assert_eq!(r.status, 200);
    let doc = json(&r.body);
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/v1/channels/{channel}/messages"]["post"].is_object());
}

#[test]
fn close_stops_the_gateway() {
    let f = start(|_| {});
    let addr = f.addr;
    f.engine.close();
    assert!(f.engine.with_gateway(|_| ()).is_none());
    let refused = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5));
    assert!(refused.is_err(), "nothing listens after close");
}

#[test]
fn an_idle_connection_is_closed_and_counted() {
    let f = start(|c| {
        c.idle_timeout_ms = 400;
        c.header_timeout_ms = 60_000;
    });
    f.rt.block_on(async {
        let mut s = f.tls(None).await;
        // One complete request on a keep-alive connection, then silence.
        s.write_all(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut raw = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw)).await;
        assert!(closed.is_ok(), "the server closed the idle connection");
        assert!(String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 200"));
    });
    let c = f.engine.with_gateway(|g| g.counters().snapshot()).unwrap();
    assert_eq!(c.iter().find(|(n, _)| *n == "timed_out").unwrap().1, 1);
}

#[test]
fn websocket_refuses_publishing_outside_the_lists_and_stores_nothing() {
    let f = start(|c| c.tokens[0].publish = vec!["big".into()]);
    f.rt.block_on(async {
        // The token may read "sensors" and publish to "big" only: on a
        // "sensors" WebSocket it reads, and its publish frames are refused.
        let tls = f.tls(None).await;
        let req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
            "wss://localhost/v1/channels/sensors/ws",
        )
        .map(|mut r| {
            r.headers_mut()
                .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
            r
        })
        .unwrap();
        let (mut ws, _) = tokio_tungstenite::client_async(req, tls).await.unwrap();
        ws.send(tokio_tungstenite::tungstenite::Message::Text(
            r#"{"ref":"a","payload_type":"t","payload":1}"#.into(),
        ))
        .await
        .unwrap();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(30), ws.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            if let tokio_tungstenite::tungstenite::Message::Text(t) = m {
                let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
                assert_eq!(v["type"], "error", "{v}");
                assert_eq!(v["status"], 403);
                assert_eq!(v["ref"], "a");
                break;
            }
        }
        ws.close(None).await.ok();
    });
    assert_eq!(stream_end(&f.engine, "sensors", f._data.path()), 0);
    // Without credentials the upgrade itself is refused.
    let r = f.request(
        None,
        "GET",
        "/v1/channels/sensors/ws",
        &[
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ],
        "",
    );
    assert_eq!(r.status, 401);
}

#[test]
fn reading_creates_only_channels_a_list_names() {
    // "edge" may read any channel (an empty list, the hub's rule).
    let f = start(|c| c.allowed_peers[0].subscribe.clear());
    let r = f.request(
        Some("edge"),
        "GET",
        "/v1/channels/nowhere/messages",
        &[],
        "",
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(!f._data.path().join("channels").join("nowhere").exists());
    // A channel the token names is created by reading it (listen first, publish later).
    let r = f.token_request("GET", "/v1/channels/sensors/messages", "");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(f._data.path().join("channels").join("sensors").is_dir());
    let r = f.request(
        Some("edge"),
        "GET",
        "/v1/channels/sensors/messages",
        &[],
        "",
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_peer_creates_at_most_max_channels_channels() {
    // "edge" may publish anywhere (empty list) but create one channel only.
    let f = start(|c| {
        c.allowed_peers[0].publish.clear();
        c.allowed_peers[0].max_channels = 1;
    });
    let body = r#"{"payload_type":"t","payload":1}"#;
    let first = f.request(Some("edge"), "POST", "/v1/channels/a/messages", &[], body);
    assert_eq!(first.status, 201, "{}", first.body);
    let again = f.request(Some("edge"), "POST", "/v1/channels/a/messages", &[], body);
    assert_eq!(again.status, 201, "the channel exists now");
    let second = f.request(Some("edge"), "POST", "/v1/channels/b/messages", &[], body);
    assert_eq!(second.status, 403, "{}", second.body);
    assert_eq!(json(&second.body)["error"], "channel_limit");
    assert!(!f._data.path().join("channels").join("b").exists());
}
