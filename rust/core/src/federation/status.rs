//! State of a client link, shared by the link machinery (`link.rs`), the
//! durable client (`client.rs`) and the ephemeral client (`ephemeral.rs`),
//! which all import it from here (no import circle between them).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Why a hub refused a record; the `reason` of a refusal on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RefusalReason {
    /// The channel is not in the peer's allowlist.
    Policy,
    /// The record is larger than the receiver accepts.
    TooLarge,
    /// The record is not a valid envelope (envelope.rs rules).
    Invalid,
    /// The peer may not create more channels on the hub.
    ChannelLimit,
}

impl Label for RefusalReason {
    const ALL: &'static [RefusalReason] = &[
        RefusalReason::Policy,
        RefusalReason::TooLarge,
        RefusalReason::Invalid,
        RefusalReason::ChannelLimit,
    ];

    fn label(self) -> &'static str {
        self.as_str()
    }
}

impl RefusalReason {
    /// The wire form: `policy`, `too_large`, `invalid`, `channel_limit`.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::Policy => "policy",
            RefusalReason::TooLarge => "too_large",
            RefusalReason::Invalid => "invalid",
            RefusalReason::ChannelLimit => "channel_limit",
        }
    }

    /// Parses the wire form; an unknown reason (a newer hub) is `Invalid`.
    pub fn parse(s: &str) -> RefusalReason {
        match s {
            "policy" => RefusalReason::Policy,
            "too_large" => RefusalReason::TooLarge,
            "channel_limit" => RefusalReason::ChannelLimit,
            _ => RefusalReason::Invalid,
        }
    }

    /// Words for log lines and error messages.
    pub fn describe(self) -> &'static str {
        match self {
            RefusalReason::Policy => "the channel is not in this peer's allowed publish list",
            RefusalReason::TooLarge => "the record is over the hub's size limit",
            RefusalReason::Invalid => "the record is not a valid envelope",
            RefusalReason::ChannelLimit => "this peer may not create more channels on the hub",
        }
    }
}

/// The values a metric is broken down by (a reason, a stage), with their
/// labels.
pub trait Label: Copy + PartialEq + std::fmt::Debug + 'static {
    /// Every value, in the order a [`Tally`] lists them.
    const ALL: &'static [Self];
    /// The metric label of this value.
    fn label(self) -> &'static str;
}

/// One counter per value of `L`.
#[derive(Debug)]
pub struct Tally<L: Label> {
    counts: Box<[AtomicU64]>,
    _label: std::marker::PhantomData<L>,
}

impl<L: Label> Default for Tally<L> {
    fn default() -> Self {
        Tally {
            counts: L::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            _label: std::marker::PhantomData,
        }
    }
}

impl<L: Label> Tally<L> {
    /// Counts one for `value`.
    pub fn add(&self, value: L) {
        if let Some(i) = L::ALL.iter().position(|&v| v == value) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Every value's label and count so far, zeros included.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        L::ALL
            .iter()
            .zip(self.counts.iter())
            .map(|(v, c)| (v.label(), c.load(Ordering::Relaxed)))
            .collect()
    }
}

/// What a hub's receivers count of the records its peers send (the
/// listener's metrics), shared by every connection it serves.
#[derive(Debug, Default)]
pub struct InboundCounts {
    /// Records stored.
    pub stored: AtomicU64,
    /// Records refused, by reason.
    pub refused: Tally<RefusalReason>,
}

/// A change of a client link the application may want to hear about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    /// The handshake with `hub` completed.
    Connected { hub: String },
    /// The connection to `hub` was lost (it is dialed again with backoff).
    Disconnected { hub: String, reason: String },
    /// `hub` refused `count` records of `channel` in one acknowledgement.
    Refused {
        hub: String,
        channel: String,
        count: u64,
    },
}

/// Where link events go: a bounded queue read by the application's thread
/// (a slow callback never stalls a link; overflow is counted and logged).
#[derive(Clone)]
pub struct EventSink(std::sync::mpsc::SyncSender<LinkEvent>);

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventSink")
    }
}

impl EventSink {
    /// A sink holding up to `capacity` undelivered events, and its receiver
    /// (which ends once every sink clone is dropped).
    pub fn new(capacity: usize) -> (EventSink, std::sync::mpsc::Receiver<LinkEvent>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(capacity.max(1));
        (EventSink(tx), rx)
    }

    /// Queues `ev`; a full queue drops it (logged, rate-limited).
    pub fn emit(&self, ev: LinkEvent) {
        static DROPPED: crate::lograte::RateLimit =
            crate::lograte::RateLimit::new(std::time::Duration::from_secs(10));
        if let Err(std::sync::mpsc::TrySendError::Full(ev)) = self.0.try_send(ev) {
            if let Some(more) = DROPPED.check() {
                log::warn!("link event dropped, the callbacks are behind: {ev:?}{more}");
            }
        }
    }
}

/// State of one client link (durable or ephemeral), readable from any thread.
#[derive(Debug, Default)]
pub struct LinkStatus {
    /// Connection and refusal events for the application, if it listens.
    pub events: Option<EventSink>,
    pub connected: AtomicBool,
    /// Successful connections after the first.
    pub reconnects: AtomicU64,
    pub connects: AtomicU64,
    pub failed_attempts: AtomicU64,
    /// Bytes of the batch awaiting acknowledgement.
    pub unacked_bytes: AtomicU64,
    /// Records of the batch awaiting acknowledgement (audited with the
    /// link's `peer_disconnected`, as 1.4 does).
    pub unacked_records: AtomicU64,
    /// Batch send to acknowledgement.
    pub rtt: crate::stats::Window,
    /// Records the hub refused, per channel (kept on this instance's disk).
    refused: Mutex<BTreeMap<String, u64>>,
    /// Channels this instance is configured to publish that the hub's
    /// handshake says it refuses (as of the latest connection); not sent.
    refused_channels: Mutex<Vec<String>>,
    /// Channels requested for subscription that the hub will not deliver.
    refused_subscriptions: Mutex<Vec<String>>,
}

impl LinkStatus {
    /// A fresh status whose events go to `events`.
    pub fn with_events(events: Option<EventSink>) -> LinkStatus {
        LinkStatus {
            events,
            ..LinkStatus::default()
        }
    }

    /// Reports `ev` to the application, if it listens.
    pub fn emit(&self, ev: LinkEvent) {
        if let Some(sink) = &self.events {
            sink.emit(ev);
        }
    }

    /// Counts `n` records of `channel` refused by the hub.
    pub fn count_refused(&self, channel: &str, n: u64) {
        *self
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(channel.to_owned())
            .or_insert(0) += n;
    }

    /// Refused records per channel since start.
    pub fn refused(&self) -> BTreeMap<String, u64> {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records the channels refused at the latest handshake.
    pub fn set_refused_channels(&self, publish: Vec<String>, subscribe: Vec<String>) {
        *self
            .refused_channels
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = publish;
        *self
            .refused_subscriptions
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = subscribe;
    }

    /// Publish channels the hub refuses (latest handshake).
    pub fn refused_channels(&self) -> Vec<String> {
        self.refused_channels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Subscribed channels the hub does not deliver (latest handshake).
    pub fn refused_subscriptions(&self) -> Vec<String> {
        self.refused_subscriptions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
