//! A client marks the ids it publishes as seen only on the channels it asks
//! a hub for: only those can come back as echoes, and marking every id of a
//! busy publisher cost a large part of its CPU.

use keyop_core::engine::Outgoing;
use keyop_core::federation::{ClientSettings, FedConfig, HubEndpoint};
use keyop_core::keygen::{generate_ca, CertificateAuthority};
use keyop_core::{Engine, StoreConfig};

mod common;

fn message() -> Outgoing<'static> {
    Outgoing {
        payload_type: "t",
        payload_json: b"{}",
        service_name: None,
        correlation_id: None,
    }
}

/// Submits one message and returns its id once its commit's callbacks ran
/// (the engine's marking included: callbacks run in the order registered).
fn submit(engine: &Engine, channel: &str) -> String {
    let submitted = engine.submit(channel, &message()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    submitted.on_done(move |r| tx.send(r.map(|p| p.id)).unwrap());
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .expect("committed within 30 s")
        .unwrap()
}

#[test]
fn only_ids_published_on_subscribed_channels_are_marked_seen() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(
        StoreConfig {
            data_dir: dir.path().join("node"),
            sync_interval_ms: 0,
            segment_bytes: 0,
        },
        "node1",
    )
    .unwrap();
    let ca_gen = generate_ca(30).unwrap();
    let ca = CertificateAuthority::from_pem(ca_gen.cert_pem.as_bytes(), ca_gen.key_pem.as_bytes())
        .unwrap();
    let tls = common::tls_files(dir.path(), &ca, &ca_gen.cert_pem, "node1");
    // Published before federation starts: nothing can echo yet.
    let early = engine.publish("chat", &message()).unwrap().id;
    engine
        .start_federation(FedConfig {
            client: ClientSettings {
                enabled: true,
                // Nothing listens on port 9 here: the link keeps dialing.
                hubs: vec![HubEndpoint {
                    addr: "127.0.0.1:9".into(),
                    subscribe: vec!["chat".into()],
                    publish: vec!["chat".into(), "temps".into()],
                }],
            },
            tls,
            seen_id_lru_size: 1000,
            ..FedConfig::default()
        })
        .unwrap();
    let mut chat = vec![engine.publish("chat", &message()).unwrap().id];
    chat.extend(
        engine
            .publish_batch("chat", &[message(), message()])
            .unwrap()
            .into_iter()
            .map(|p| p.id),
    );
    chat.push(submit(&engine, "chat"));
    let mut temps = vec![engine.publish("temps", &message()).unwrap().id];
    temps.extend(
        engine
            .publish_batch("temps", &[message(), message()])
            .unwrap()
            .into_iter()
            .map(|p| p.id),
    );
    temps.push(submit(&engine, "temps"));

    engine
        .with_federation(|f| {
            let seen = f.seen();
            for id in &chat {
                assert!(seen.contains(id), "{id} on a subscribed channel is marked");
            }
            for id in &temps {
                assert!(!seen.contains(id), "{id} cannot echo: not marked");
            }
            assert!(!seen.contains(&early));
            assert_eq!(seen.len(), chat.len());
        })
        .expect("federation runs");
    engine.close();
}
