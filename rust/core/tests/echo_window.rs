//! A client marks the ids it publishes as seen only on the channels it asks
//! a hub for: only those can come back as echoes, and marking every id of a
//! busy publisher cost a large part of its CPU.

use keyop_core::federation::{ClientSettings, FedConfig, HubEndpoint};
use keyop_core::keygen::{generate_ca, CertificateAuthority};
use keyop_core::Engine;

mod common;
use common::{msg, open_engine};

/// Submits one message and returns its id once its commit's callbacks ran
/// (the engine's marking included: callbacks run in the order registered).
fn submit(engine: &Engine, channel: &str) -> String {
    let submitted = engine.submit(channel, &msg("{}")).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    submitted.on_done(move |r| tx.send(r.map(|p| p.id)).unwrap());
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .expect("committed within 30 s")
        .unwrap()
}

/// Publishes on `channel` by each path (one, a batch of two, a submit);
/// returns the ids.
fn publish_every_way(engine: &Engine, channel: &str) -> Vec<String> {
    let mut ids = vec![engine.publish(channel, &msg("{}")).unwrap().id];
    let batch = engine.publish_batch(channel, &[msg("{}"), msg("{}")]);
    ids.extend(batch.unwrap().into_iter().map(|p| p.id));
    ids.push(submit(engine, channel));
    ids
}

#[test]
fn only_ids_published_on_subscribed_channels_are_marked_seen() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(&dir.path().join("node"), 0).unwrap();
    let ca_gen = generate_ca(30).unwrap();
    let ca = CertificateAuthority::from_pem(ca_gen.cert_pem.as_bytes(), ca_gen.key_pem.as_bytes())
        .unwrap();
    let tls = common::tls_files(dir.path(), &ca, &ca_gen.cert_pem, "node");
    // Published before federation starts: nothing can echo yet.
    let early = engine.publish("chat", &msg("{}")).unwrap().id;
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
    let chat = publish_every_way(&engine, "chat");
    let temps = publish_every_way(&engine, "temps");

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
