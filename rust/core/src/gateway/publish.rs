//! Publish bodies (one message or `{"messages": [...]}`), committed
//! through the channel writer before any answer.

use std::sync::atomic::Ordering;

use hyper::StatusCode;
use serde::Deserialize;

use std::sync::Arc;

use super::auth::{Access, Identity};
use super::reply::{engine_refusal, Refusal};
use super::State;

/// One message of a publish request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MessageIn {
    pub payload_type: Option<String>,
    pub payload: serde_json::Value,
    pub correlation_id: Option<String>,
    pub service_name: Option<String>,
}

/// Whether a JSON parse failed on serde_json's nesting limit (128), which
/// is past the record rule's 100 levels.
pub(super) fn is_too_deep(e: &serde_json::Error) -> bool {
    e.to_string().starts_with("recursion limit exceeded")
}

/// The refusal of a body nested past what any record may hold, in the
/// words of the record rule.
pub(super) fn too_deep() -> Refusal {
    Refusal::new(
        StatusCode::BAD_REQUEST,
        "invalid",
        format!(
            "the body is nested deeper than {} levels of arrays and objects \
             (a payload may nest at most {0})",
            crate::envelope::MAX_PAYLOAD_DEPTH
        ),
    )
}

/// Parses a publish body and publishes it through the channel writer:
/// `Ok` only once every record is committed.
pub(super) async fn publish_body(
    state: &State,
    channel: &str,
    body: &[u8],
    default_type: Option<&str>,
) -> Result<Vec<(String, u64)>, Refusal> {
    let invalid = |e: String| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            format!(
                "the body must be {{\"payload_type\": ..., \"payload\": ...}} or \
                 {{\"messages\": [...]}} of those: {e}"
            ),
        )
    };
    let mut parsed: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        if is_too_deep(&e) {
            too_deep()
        } else {
            invalid(e.to_string())
        }
    })?;
    let batch = match parsed.as_object_mut() {
        Some(o) if o.contains_key("messages") => {
            if o.len() > 1 {
                return Err(invalid("a batch has only the key \"messages\"".into()));
            }
            o.remove("messages")
        }
        _ => None,
    };
    let messages: Vec<MessageIn> = match batch {
        Some(list) => {
            serde_json::from_value(list).map_err(|e| invalid(format!("messages: {e}")))?
        }
        None => vec![serde_json::from_value(parsed).map_err(|e| invalid(e.to_string()))?],
    };
    if messages.is_empty() {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            "\"messages\" is empty: send at least one message",
        ));
    }
    // Compact payloads, each as its own JSON text (what the envelope holds).
    let mut payloads = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if m.payload_type.as_deref().or(default_type).is_none() {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "invalid",
                format!(
                    "message {i} has no payload_type: set the field or the Keyop-Payload-Type header"
                ),
            ));
        }
        payloads.push(serde_json::to_vec(&m.payload).unwrap_or_default());
    }
    let engine = state.engine.upgrade().ok_or_else(|| {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "closed",
            "the messenger is closed",
        )
    })?;
    let channel = channel.to_owned();
    let default_type = default_type.map(str::to_owned);
    let published = tokio::task::spawn_blocking(move || {
        let items: Vec<super::Item<'_>> = messages
            .iter()
            .zip(&payloads)
            .map(|(m, p)| super::Item {
                payload_type: m
                    .payload_type
                    .as_deref()
                    .or(default_type.as_deref())
                    .unwrap_or_default(),
                payload_json: p,
                service_name: m.service_name.as_deref(),
                correlation_id: m.correlation_id.as_deref(),
            })
            .collect();
        engine.publish(&channel, &items)
    })
    .await
    .map_err(|e| {
        Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "storage",
            format!("publish task: {e}"),
        )
    })?
    .map_err(|e| engine_refusal(&e))?;
    state
        .counters
        .published
        .fetch_add(published.len() as u64, Ordering::Relaxed);
    Ok(published)
}

/// A publish that would create a channel its client's list does not name
/// counts against the client's `max_channels` (as on the hub); past it, 403.
pub(super) fn check_channel_budget(
    state: &State,
    identity: &Identity,
    channel: &str,
) -> Result<(), Refusal> {
    if identity.names(Access::Publish, channel) {
        return Ok(());
    }
    let exists = state
        .engine
        .upgrade()
        .is_some_and(|e| e.channel_exists(channel));
    if exists {
        return Ok(());
    }
    let budget = state
        .budgets
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(identity.label.clone())
        .or_insert_with(|| Arc::new(crate::federation::ChannelBudget::new(identity.max_channels)))
        .clone();
    // The current `max_channels` (a reload may have changed it), as the hub
    // applies it on each admission.
    budget.set_limit(identity.max_channels);
    if budget.try_create(channel) {
        Ok(())
    } else {
        Err(Refusal::new(
            StatusCode::FORBIDDEN,
            "channel_limit",
            format!(
                "{} may create at most {} channels (hub.allowed_peers max_channels); \
                 channel {channel:?} does not exist",
                identity.label, identity.max_channels
            ),
        ))
    }
}
