//! Refusals on the wire: the extension keys of the handshake and the
//! acknowledgement are extra keys only, sent only to a peer that asked, and
//! 1.4-shaped messages still parse.

use keyop_core::federation::status::{LinkStatus, RefusalReason};
use keyop_core::federation::wire::{Ack, Handshake, Refused, FEATURE_REFUSALS};
use serde_json::Value;

fn keys(text: &str) -> Vec<String> {
    match serde_json::from_str::<Value>(text).unwrap() {
        Value::Object(m) => m.keys().cloned().collect(),
        other => panic!("not an object: {other}"),
    }
}

#[test]
fn go_14_handshakes_and_acks_still_parse() {
    let hub: Handshake =
        serde_json::from_str(r#"{"instance_name":"hub1","role":"hub","version":"1"}"#).unwrap();
    assert!(!hub.has_feature(FEATURE_REFUSALS));
    assert_eq!(
        hub.publish_allowed, None,
        "a 1.4 hub restricts nothing we know of"
    );
    assert_eq!(hub.subscribe_allowed, None);
    let ack = Ack::parse(r#"{"last_id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f"}"#).unwrap();
    assert_eq!(ack.last_id, "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f");
    assert!(ack.refused.is_empty());
    // 1.4 counts any text message as the acknowledgement.
    assert_eq!(Ack::parse("not json"), None);
    assert_eq!(Ack::parse("[1,2,3]"), None);
    assert_eq!(Ack::parse(r#"{"last_id":5}"#), Some(Ack::default()));
}

#[test]
fn extension_keys_are_extra_keys_only() {
    // Without the feature: exactly the 1.4 bytes.
    assert_eq!(
        Handshake::hub("hub1").to_json(),
        r#"{"instance_name":"hub1","role":"hub","version":"1"}"#
    );
    assert_eq!(
        Ack {
            last_id: "a".into(),
            refused: vec![]
        }
        .to_json(),
        r#"{"last_id":"a"}"#
    );
    // With it: the 1.4 keys, in 1.4 order, then the extensions.
    let mut hub = Handshake::hub("hub1");
    hub.features = vec![FEATURE_REFUSALS.into()];
    hub.publish_allowed = Some(vec!["temps".into()]);
    hub.subscribe_allowed = Some(vec!["cmds".into()]);
    let text = hub.to_json();
    assert_eq!(
        keys(&text),
        [
            "instance_name",
            "role",
            "version",
            "features",
            "publish_allowed",
            "subscribe_allowed"
        ]
    );
    let mut plain: Value = serde_json::from_str(&text).unwrap();
    for k in ["features", "publish_allowed", "subscribe_allowed"] {
        plain.as_object_mut().unwrap().remove(k);
    }
    assert_eq!(plain.to_string(), Handshake::hub("hub1").to_json());

    let client = Handshake::client("node1", vec![], false).with_refusals();
    assert_eq!(
        client.to_json(),
        r#"{"instance_name":"node1","role":"client","version":"1","features":["refusals"]}"#
    );
    let ack = Ack {
        last_id: "b".into(),
        refused: vec![Refused {
            id: "b".into(),
            channel: "debug".into(),
            reason: RefusalReason::Policy.as_str().into(),
        }],
    };
    let text = ack.to_json();
    assert_eq!(
        text,
        r#"{"last_id":"b","refused":[{"id":"b","channel":"debug","reason":"policy"}]}"#
    );
    assert_eq!(Ack::parse(&text), Some(ack));
}

#[test]
fn reasons_round_trip_and_unknown_ones_are_invalid() {
    for r in [
        RefusalReason::Policy,
        RefusalReason::TooLarge,
        RefusalReason::Invalid,
        RefusalReason::ChannelLimit,
    ] {
        assert_eq!(RefusalReason::parse(r.as_str()), r);
    }
    assert_eq!(
        RefusalReason::parse("from-the-future"),
        RefusalReason::Invalid
    );
}

#[test]
fn link_status_counts_refusals_per_channel() {
    let s = LinkStatus::default();
    s.count_refused("debug", 2);
    s.count_refused("debug", 1);
    s.count_refused("temps", 1);
    assert_eq!(
        s.refused().into_iter().collect::<Vec<_>>(),
        vec![("debug".to_string(), 3), ("temps".to_string(), 1)]
    );
    s.set_refused_channels(vec!["debug".into()], vec!["secret".into()]);
    assert_eq!(s.refused_channels(), ["debug"]);
    assert_eq!(s.refused_subscriptions(), ["secret"]);
}
