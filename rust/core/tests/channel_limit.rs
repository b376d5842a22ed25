//! A hub caps the channels a peer may create (`max_channels`), refusing the
//! rest with reason `channel_limit` through the acknowledgement; an ephemeral
//! publisher hears it as `Error::Policy` naming the channel and the hub.

use std::time::Duration;

use keyop_core::engine::{encode_message, Outgoing};
use keyop_core::federation::ephemeral::{EphemeralClient, EphemeralConfig};
use keyop_core::federation::wire::push_record;
use keyop_core::federation::{
    AllowedPeer, FedConfig, HubEndpoint, HubSettings, DEFAULT_MAX_CHANNELS,
};
use keyop_core::keygen::{generate_ca, CertificateAuthority};
use keyop_core::{Engine, Error, StoreConfig};

mod common;
use common::tls_files;

/// One frame with one message on `channel`; returns (ids, body).
fn frame(channel: &str) -> (Vec<String>, Vec<u8>) {
    let mut line = Vec::new();
    let id = encode_message(
        &mut line,
        "node1",
        channel,
        &Outgoing {
            payload_type: "t",
            payload_json: b"{}",
            service_name: None,
            correlation_id: None,
        },
    )
    .unwrap();
    let mut body = Vec::new();
    push_record(&mut body, &line[..line.len() - 1]);
    (vec![id], body)
}

#[test]
fn default_is_documented() {
    assert_eq!(AllowedPeer::default().max_channels, DEFAULT_MAX_CHANNELS);
    let p: AllowedPeer = serde_json::from_str(r#"{"name":"n"}"#).unwrap();
    assert_eq!(p.max_channels, DEFAULT_MAX_CHANNELS);
}

#[test]
fn new_channels_past_the_cap_are_refused_and_the_publisher_hears_it() {
    let dir = tempfile::tempdir().unwrap();
    let ca_gen = generate_ca(30).unwrap();
    let ca = CertificateAuthority::from_pem(ca_gen.cert_pem.as_bytes(), ca_gen.key_pem.as_bytes())
        .unwrap();
    let hub_tls = tls_files(dir.path(), &ca, &ca_gen.cert_pem, "hub1");
    let node_tls = tls_files(dir.path(), &ca, &ca_gen.cert_pem, "node1");

    let hub = Engine::open(
        StoreConfig {
            data_dir: dir.path().join("hub"),
            sync_interval_ms: 0,
            segment_bytes: 0,
        },
        "hub1",
    )
    .unwrap();
    // "old" exists before the peer connects: using it creates nothing.
    hub.store().writer("old").unwrap();
    hub.start_federation(FedConfig {
        hub: HubSettings {
            enabled: true,
            listen_addr: "127.0.0.1:0".into(),
            allowed_peers: vec![AllowedPeer {
                name: "node1".into(),
                max_channels: 2,
                ..AllowedPeer::default()
            }],
            fed_client_offset_ttl_s: -1.0,
        },
        tls: hub_tls,
        seen_id_lru_size: 1000,
        ..FedConfig::default()
    })
    .unwrap();
    let port = hub
        .with_federation(|f| f.hub_addr())
        .flatten()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");

    let client = EphemeralClient::new(EphemeralConfig {
        name: "node1".into(),
        hub: HubEndpoint {
            addr: addr.clone(),
            ..HubEndpoint::default()
        },
        tls: node_tls,
        buffer_messages: 16,
        ..EphemeralConfig::default()
    })
    .unwrap();
    client.connect(Duration::from_secs(15)).unwrap();
    for channel in ["old", "a", "b", "a", "old"] {
        let (ids, body) = frame(channel);
        client.send(channel, ids, body).unwrap();
    }
    let (ids, body) = frame("c");
    match client.send("c", ids, body) {
        Err(Error::Policy(msg)) => {
            assert!(msg.contains("\"c\"") && msg.contains(&addr), "{msg}");
            assert!(msg.contains("channel_limit"), "{msg}");
        }
        other => panic!("expected a policy refusal, got {other:?}"),
    }
    assert_eq!(client.status().refused().get("c"), Some(&1));
    assert!(
        !dir.path().join("hub/channels/c").exists(),
        "nothing created"
    );
    client.close();
    hub.close();
}
