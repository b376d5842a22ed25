//! The keyop-messenger 1.4 WebSocket protocol: handshake JSON, binary batches
//! of length-prefixed envelopes, and text acknowledgements.

use serde::{Deserialize, Serialize};

/// Protocol version sent in handshakes.
pub const PROTOCOL_VERSION: &str = "1";
/// Close code a hub sends to a peer that is not in its allowlist.
pub const CLOSE_NOT_ALLOWED: u16 = 4403;
/// Reason text sent with [`CLOSE_NOT_ALLOWED`].
pub const CLOSE_NOT_ALLOWED_REASON: &str = "not in allowlist";

fn is_false(b: &bool) -> bool {
    !*b
}

/// Feature a client announces (handshake key `features`) to be told of
/// refusals: the hub then lists the peer's allowed channels in its handshake
/// and the refused records in its acknowledgements. Go 1.4 peers neither send
/// nor read it (unknown keys are ignored), and a hub sends the extra keys
/// only to a client that announced it, so a 1.4 client sees 1.4 bytes.
pub const FEATURE_REFUSALS: &str = "refusals";

/// The first text message of each side.
///
/// The 1.4 keys come first, in 1.4 order; `features`, `publish_allowed`
/// and `subscribe_allowed` are extensions (omitted when empty).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handshake {
    #[serde(default, deserialize_with = "null_as_default")]
    pub instance_name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub role: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub version: String,
    #[serde(
        default,
        skip_serializing_if = "String::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub last_id: String,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub subscribe: Vec<String>,
    #[serde(
        default,
        skip_serializing_if = "is_false",
        deserialize_with = "null_as_default"
    )]
    pub ephemeral: bool,
    /// Extensions this side speaks ([`FEATURE_REFUSALS`]).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub features: Vec<String>,
    /// Hub only: the channels this peer may publish; absent = unrestricted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_allowed: Option<Vec<String>>,
    /// Hub only: the channels this peer may subscribe; absent = unrestricted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscribe_allowed: Option<Vec<String>>,
}

/// `null` read as the field's empty value, as 1.4's `encoding/json` does.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl Handshake {
    /// Reads a handshake message: a JSON object. serde would also fill the
    /// fields from an array, by position; 1.4 reads only objects.
    pub fn decode(text: &str) -> Result<Handshake, String> {
        if !text.trim_start().starts_with('{') {
            return Err("a handshake must be a JSON object".into());
        }
        serde_json::from_str(text).map_err(|e| e.to_string())
    }

    /// A client's handshake.
    pub fn client(name: &str, subscribe: Vec<String>, ephemeral: bool) -> Handshake {
        Handshake {
            instance_name: name.to_owned(),
            role: "client".into(),
            version: PROTOCOL_VERSION.into(),
            subscribe,
            ephemeral,
            ..Handshake::default()
        }
    }

    /// A hub's handshake.
    pub fn hub(name: &str) -> Handshake {
        Handshake {
            instance_name: name.to_owned(),
            role: "hub".into(),
            version: PROTOCOL_VERSION.into(),
            ..Handshake::default()
        }
    }

    /// As sent on the wire.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("handshake serialises")
    }

    /// Whether this side announced `feature`.
    pub fn has_feature(&self, feature: &str) -> bool {
        self.features.iter().any(|f| f == feature)
    }

    /// A client handshake that also asks to be told of refusals.
    pub fn with_refusals(mut self) -> Handshake {
        self.features.push(FEATURE_REFUSALS.into());
        self
    }
}

/// One record the receiver refused (extension of the acknowledgement).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    /// The record's id; empty when the id itself was invalid (never echoed).
    #[serde(default)]
    pub id: String,
    /// The record's channel; empty when it was not a valid channel name.
    #[serde(default)]
    pub channel: String,
    /// `policy`, `too_large`, `invalid` or `channel_limit`.
    #[serde(default)]
    pub reason: String,
}

impl Refused {
    /// The refusal of a valid record, by `reason`.
    pub fn of(id: &str, channel: &str, reason: super::status::RefusalReason) -> Refused {
        Refused {
            id: id.to_owned(),
            channel: channel.to_owned(),
            reason: reason.as_str().into(),
        }
    }
}

/// The acknowledgement of one batch: `last_id` keeps its 1.4 meaning
/// (federation.md §7); `refused` is an extension sent only to peers that
/// announced [`FEATURE_REFUSALS`] and omitted when empty.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    #[serde(default)]
    pub last_id: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<Refused>,
}

impl Ack {
    /// As sent on the wire: `{"last_id":"..."}` (plus `refused` when any).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("ack serialises")
    }

    /// Parses an acknowledgement: any JSON object is one (1.4 takes any as
    /// the acknowledgement and ignores its content; fields of the wrong type
    /// read as absent). `None` for text that is not a JSON object.
    pub fn parse(text: &str) -> Option<Ack> {
        let value: serde_json::Value = serde_json::from_str(text).ok()?;
        if !value.is_object() {
            return None;
        }
        Some(serde_json::from_value(value).unwrap_or_default())
    }
}

/// A binary message that is not a sequence of whole records.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed batch: {0}")]
pub struct BatchError(pub String);

/// Appends one record (length prefix + JSON) to a batch body.
pub fn push_record(body: &mut Vec<u8>, json: &[u8]) {
    let len = u32::try_from(json.len()).expect("records are far below 4 GiB");
    body.extend_from_slice(&len.to_be_bytes());
    body.extend_from_slice(json);
}

/// Splits a batch body into its records.
pub fn split_batch(mut body: &[u8]) -> Result<Vec<&[u8]>, BatchError> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 4 {
            return Err(BatchError(format!(
                "{} trailing bytes inside a length prefix",
                body.len()
            )));
        }
        let len = u32::from_be_bytes([body[0], body[1], body[2], body[3]]) as usize;
        body = &body[4..];
        if body.len() < len {
            return Err(BatchError(format!(
                "record of {len} bytes but only {} remain",
                body.len()
            )));
        }
        out.push(&body[..len]);
        body = &body[len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshakes_match_the_original_bytes() {
        assert_eq!(
            Handshake::client("dash-1", vec!["alerts".into(), "metrics".into()], false).to_json(),
            r#"{"instance_name":"dash-1","role":"client","version":"1","subscribe":["alerts","metrics"]}"#
        );
        assert_eq!(
            Handshake::client("sensor-1", vec![], false).to_json(),
            r#"{"instance_name":"sensor-1","role":"client","version":"1"}"#
        );
        assert_eq!(
            Handshake::client("kiosk", vec!["alerts".into()], true).to_json(),
            r#"{"instance_name":"kiosk","role":"client","version":"1","subscribe":["alerts"],"ephemeral":true}"#
        );
        assert_eq!(
            Handshake::hub("hub1").to_json(),
            r#"{"instance_name":"hub1","role":"hub","version":"1"}"#
        );
        let h = Handshake::decode(r#" {"instance_name":"x","extra":1}"#).unwrap();
        assert_eq!(h.instance_name, "x");
        // serde alone would fill the fields from an array, by position.
        assert!(serde_json::from_str::<Handshake>(r#"["x","client","1"]"#).is_ok());
        for not_an_object in [r#"["x","client","1"]"#, "[]", "1", r#""x""#] {
            assert!(Handshake::decode(not_an_object).is_err(), "{not_an_object}");
        }
        assert_eq!(Ack::default().to_json(), r#"{"last_id":""}"#);
    }

    /// `null` for a field reads as its empty value, as 1.4 reads it; a key
    /// given twice is still refused (serde's derive cannot take the last).
    #[test]
    fn null_fields_read_as_empty_values() {
        let h = Handshake::decode(
            r#"{"instance_name":"x","role":"client","version":null,"last_id":null,"subscribe":null,"ephemeral":null,"features":null,"publish_allowed":null}"#,
        )
        .unwrap();
        assert_eq!(
            h,
            Handshake {
                instance_name: "x".into(),
                role: "client".into(),
                ..Handshake::default()
            }
        );
        let twice = Handshake::decode(r#"{"instance_name":"x","role":"client","role":"hub"}"#);
        assert!(twice.unwrap_err().contains("duplicate field `role`"));
    }

    #[test]
    fn batches_round_trip_and_reject_truncation() {
        let mut body = Vec::new();
        push_record(&mut body, b"{\"a\":1}");
        push_record(&mut body, b"{}");
        assert_eq!(&body[..4], &[0, 0, 0, 7]);
        assert_eq!(
            split_batch(&body).unwrap(),
            vec![&b"{\"a\":1}"[..], &b"{}"[..]]
        );
        assert_eq!(split_batch(&[]).unwrap(), Vec::<&[u8]>::new());
        assert!(split_batch(&body[..body.len() - 1]).is_err());
        assert!(split_batch(&[0, 0]).is_err());
    }
}
