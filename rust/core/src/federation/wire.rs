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

/// The first text message of each side.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handshake {
    #[serde(default)]
    pub instance_name: String,
    #[serde(default)]
    pub role: String,
    #[serde(default)]
    pub version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_id: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subscribe: Vec<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub ephemeral: bool,
}

impl Handshake {
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
}

/// The acknowledgement of one batch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    #[serde(default)]
    pub last_id: String,
}

impl Ack {
    /// As sent on the wire: `{"last_id":"..."}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("ack serialises")
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
        let h: Handshake = serde_json::from_str(r#"{"instance_name":"x","extra":1}"#).unwrap();
        assert_eq!(h.instance_name, "x");
        assert_eq!(Ack { last_id: "".into() }.to_json(), r#"{"last_id":""}"#);
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
