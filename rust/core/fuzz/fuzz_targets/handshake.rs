//! The handshake parser: a hub and a client each parse the peer's first
//! WebSocket text message with `serde_json::from_str::<Handshake>`; the
//! acknowledgement of a batch is an [`Ack`] text message.
//!
//! WebSocket text is UTF-8, so inputs that are not are skipped. Checked:
//!
//! * parsing never panics;
//! * whatever parses serialises (`to_json`) to one line that parses back to
//!   the same value, and that serialisation is a fixed point;
//! * a parsed handshake with the fields a constructor sets (`role` `client`
//!   or `hub`, `version` 1, no `last_id`) serialises to exactly the bytes that
//!   constructor's handshake does;
//! * the same round trip for acknowledgements, whose serialisation always
//!   carries `last_id`.
//!
//! The input also seeds the constructors: split at 0xFF bytes (never part
//! of UTF-8) into a name and channel names, it builds client and hub
//! handshakes that must round-trip through the parser unchanged.

#![no_main]

use keyop_core::federation::wire::{Ack, Handshake, PROTOCOL_VERSION};
use libfuzzer_sys::fuzz_target;

fn round_trip(h: &Handshake) {
    let json = h.to_json();
    assert!(!json.contains('\n') && !json.contains('\r'), "{json:?}");
    let back: Handshake = serde_json::from_str(&json).expect("a serialised handshake parses");
    assert_eq!(&back, h);
    assert_eq!(back.to_json(), json, "serialisation is not a fixed point");
}

fn parsed(text: &str) {
    if let Ok(h) = serde_json::from_str::<Handshake>(text) {
        round_trip(&h);
        if h.version == PROTOCOL_VERSION && h.last_id.is_empty() {
            let built = match h.role.as_str() {
                "client" => Some(Handshake::client(
                    &h.instance_name,
                    h.subscribe.clone(),
                    h.ephemeral,
                )),
                "hub" if h.subscribe.is_empty() && !h.ephemeral => {
                    Some(Handshake::hub(&h.instance_name))
                }
                _ => None,
            };
            if let Some(built) = built {
                assert_eq!(built, h);
                assert_eq!(built.to_json(), h.to_json());
            }
        }
    }
    if let Ok(a) = serde_json::from_str::<Ack>(text) {
        let json = a.to_json();
        assert!(json.starts_with("{\"last_id\":"), "{json}");
        let back: Ack = serde_json::from_str(&json).expect("a serialised ack parses");
        assert_eq!(back, a);
        assert_eq!(back.to_json(), json);
    }
}

fn constructed(data: &[u8]) {
    let mut parts = data.split(|&b| b == 0xFF).map(String::from_utf8_lossy);
    let name = parts.next().unwrap_or_default();
    let subscribe: Vec<String> = parts.map(|p| p.into_owned()).collect();
    let ephemeral = data.first().is_some_and(|b| b & 1 == 1);
    round_trip(&Handshake::client(&name, subscribe.clone(), ephemeral));
    round_trip(&Handshake::hub(&name));
    let ack = Ack {
        last_id: name.into_owned(),
        ..Ack::default()
    };
    let back: Ack = serde_json::from_str(&ack.to_json()).expect("a serialised ack parses");
    assert_eq!(back, ack);
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        parsed(text);
    }
    constructed(data);
});
