//! `flush()` of a durable client: what it waits for, and what is still
//! pending when it gives up. A hub link has acknowledged a channel up to its
//! forwarding cursor (`hub-<addr>.offset`, written after each
//! acknowledgement), so flushing waits until every cursor reaches the end the
//! channel had when `flush()` was called.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::client::ClientLink;
use super::Shared;
use crate::envelope::Envelope;
use crate::storage::offsets::read_offset;
use crate::storage::{ChannelWriter, Item, LogReader};

/// One (hub, channel) pair a flush waits on.
pub struct FlushTarget {
    pub hub: String,
    pub channel: String,
    cursor: PathBuf,
    /// The channel's committed end when the flush started.
    pub end: u64,
    writer: Arc<ChannelWriter>,
    origin: String,
}

/// What a hub has not acknowledged yet on one channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingForward {
    pub hub: String,
    pub channel: String,
    /// Records of this instance's origin not yet acknowledged.
    pub records: u64,
    /// Bytes of the channel between the cursor and the flush point.
    pub bytes: u64,
}

impl FlushTarget {
    /// The cursor, if it is short of the flush point.
    fn behind(&self) -> Option<u64> {
        let at = read_offset(&self.cursor).ok().flatten().unwrap_or(0);
        (at < self.end).then_some(at)
    }

    /// Counts what lies between the cursor and the flush point (records of
    /// our origin: only those are forwarded).
    fn pending(&self, at: u64) -> PendingForward {
        let mut reader = LogReader::new(self.writer.dir(), at);
        let mut records = 0;
        while let Ok(Some(item)) = reader.next_item(self.end) {
            if let Item::Record { line, .. } = item {
                if Envelope::decode(&line).is_ok_and(|e| e.origin == self.origin) {
                    records += 1;
                }
            }
        }
        PendingForward {
            hub: self.hub.clone(),
            channel: self.channel.clone(),
            records,
            bytes: self.end - at,
        }
    }
}

/// Makes every open channel's committed records durable (relaxed mode:
/// fdatasync now); the first failure is returned.
pub fn sync_all(store: &crate::storage::Store) -> Result<(), crate::Error> {
    for w in store.writers() {
        w.sync_committed()
            .map_err(|e| crate::storage::StorageError::Io {
                context: format!("channel {:?}: fdatasync for flush", w.channel()),
                source: Arc::new(e),
            })?;
    }
    Ok(())
}

/// The (hub, channel) pairs with something to forward, as of now. Channels
/// the hub's latest handshake refuses are left out: they are not sent until
/// the hub allows them (see `federation_status()`'s `refused_channels`).
pub(crate) fn targets(shared: &Shared, links: &[ClientLink]) -> Vec<FlushTarget> {
    let mut out = Vec::new();
    for link in links {
        let refused = link.status().refused_channels();
        for channel in link.publish().iter().filter(|c| !refused.contains(c)) {
            let Ok(writer) = shared.store.writer(channel) else {
                continue;
            };
            out.push(FlushTarget {
                hub: link.addr().to_owned(),
                channel: channel.clone(),
                cursor: shared.client_cursor(channel, link.addr()),
                end: writer.committed_end(),
                writer,
                origin: shared.name.clone(),
            });
        }
    }
    out
}

/// Waits up to `wait` for every target's cursor to reach its flush point;
/// keeps in `targets` those still short of it (none left: all acknowledged).
pub fn wait_forwarded(targets: &mut Vec<FlushTarget>, wait: Duration) {
    let until = Instant::now() + wait;
    loop {
        targets.retain(|t| t.behind().is_some());
        if targets.is_empty() || Instant::now() >= until {
            return;
        }
        std::thread::sleep(Duration::from_millis(5).min(until - Instant::now()));
    }
}

/// What the targets still lack, for the timeout message.
pub fn pending(targets: &[FlushTarget]) -> Vec<PendingForward> {
    targets
        .iter()
        .filter_map(|t| t.behind().map(|at| t.pending(at)))
        .collect()
}

/// `"3 records (412 bytes) of channel "orders" to hub 127.0.0.1:7740; ..."`
pub fn describe(pending: &[PendingForward]) -> String {
    pending
        .iter()
        .map(|p| {
            format!(
                "{} records ({} bytes) of channel {:?} to hub {}",
                p.records, p.bytes, p.channel, p.hub
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// An ephemeral client's publishes awaiting the hub: channel -> (records, bytes).
pub(crate) type InFlightMap = Mutex<BTreeMap<String, (u64, u64)>>;

/// Counts one publish call as in flight until dropped (answered or failed).
pub(crate) struct InFlight<'a> {
    map: &'a InFlightMap,
    channel: &'a str,
    records: u64,
    bytes: u64,
}

impl<'a> InFlight<'a> {
    pub(crate) fn new(
        map: &'a InFlightMap,
        channel: &'a str,
        records: usize,
        bytes: usize,
    ) -> InFlight<'a> {
        let (records, bytes) = (records as u64, bytes as u64);
        let mut m = map.lock().unwrap_or_else(|e| e.into_inner());
        let e = m.entry(channel.to_owned()).or_insert((0, 0));
        e.0 += records;
        e.1 += bytes;
        InFlight {
            map,
            channel,
            records,
            bytes,
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = m.get_mut(self.channel) {
            e.0 -= self.records;
            e.1 -= self.bytes;
            if *e == (0, 0) {
                m.remove(self.channel);
            }
        }
    }
}

/// The publishes of `map` in flight to `hub`.
pub(crate) fn in_flight(map: &InFlightMap, hub: &str) -> Vec<PendingForward> {
    let m = map.lock().unwrap_or_else(|e| e.into_inner());
    m.iter()
        .map(|(channel, &(records, bytes))| PendingForward {
            hub: hub.to_owned(),
            channel: channel.clone(),
            records,
            bytes,
        })
        .collect()
}

/// Waits up to `wait` for `map` to empty; returns what is still in flight.
pub(crate) fn wait_idle(map: &InFlightMap, hub: &str, wait: Duration) -> Vec<PendingForward> {
    let until = Instant::now() + wait;
    loop {
        let pending = in_flight(map, hub);
        let now = Instant::now();
        if pending.is_empty() || now >= until {
            return pending;
        }
        std::thread::sleep(Duration::from_millis(5).min(until - now));
    }
}
