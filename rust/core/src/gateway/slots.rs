//! Connections still opening (accepted, TLS or the first request not yet
//! done), oldest first, so a flood of them cannot keep clients out: when
//! every connection slot is taken, the oldest opening connection is dropped
//! for the newcomer (as the federation listener does), and one address holds
//! at most a quarter of the slots in opening connections (its oldest goes).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

/// Opening connections, oldest first.
pub(super) struct Opening {
    per_addr: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    /// By id (ids grow: the first is the oldest).
    pending: BTreeMap<u64, (IpAddr, Instant, CancellationToken)>,
    by_addr: HashMap<IpAddr, BTreeSet<u64>>,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<(IpAddr, Instant, CancellationToken)> {
        let entry = self.pending.remove(&id)?;
        if let Some(ids) = self.by_addr.get_mut(&entry.0) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_addr.remove(&entry.0);
            }
        }
        Some(entry)
    }

    /// Cancels and forgets connection `id`: who it was and how long it was open.
    fn evict(&mut self, id: u64) -> Option<Evicted> {
        let (addr, since, cancel) = self.remove(id)?;
        cancel.cancel();
        Some(Evicted {
            addr,
            open_for: since.elapsed(),
        })
    }
}

/// A connection dropped to make room.
#[derive(Debug)]
pub(super) struct Evicted {
    pub addr: IpAddr,
    pub open_for: std::time::Duration,
}

/// One opening connection: cancelled when it is evicted, forgotten when
/// dropped (its first request arrived, or it ended).
pub(super) struct Pending {
    table: Arc<Opening>,
    id: u64,
    pub cancel: CancellationToken,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.table.lock().remove(self.id);
    }
}

impl Opening {
    /// A table for `max_connections` slots: one address may hold a quarter
    /// of them (at least one) in opening connections.
    pub(super) fn new(max_connections: usize) -> Arc<Opening> {
        Arc::new(Opening {
            per_addr: (max_connections / 4).max(1),
            inner: Mutex::new(Inner::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a new opening connection from `addr`; when `addr` already
    /// holds its share of opening connections, its oldest is evicted.
    pub(super) fn add(self: &Arc<Self>, addr: IpAddr) -> (Pending, Option<Evicted>) {
        let mut inner = self.lock();
        let mut evicted = None;
        let oldest_of_addr = inner
            .by_addr
            .get(&addr)
            .filter(|ids| ids.len() >= self.per_addr)
            .and_then(|ids| ids.first().copied());
        if let Some(oldest) = oldest_of_addr {
            evicted = inner.evict(oldest);
        }
        let id = inner.next;
        inner.next += 1;
        let cancel = CancellationToken::new();
        inner
            .pending
            .insert(id, (addr, Instant::now(), cancel.clone()));
        inner.by_addr.entry(addr).or_default().insert(id);
        drop(inner);
        let pending = Pending {
            table: self.clone(),
            id,
            cancel,
        };
        (pending, evicted)
    }

    /// Evicts the oldest opening connection, if there is one.
    pub(super) fn evict_oldest(&self) -> Option<Evicted> {
        let mut inner = self.lock();
        let oldest = *inner.pending.keys().next()?;
        inner.evict(oldest)
    }

    /// Opening connections now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn the_oldest_opening_connection_is_evicted_first() {
        let t = Opening::new(100);
        let (first, _) = t.add(A);
        let (second, _) = t.add(B);
        assert_eq!(t.evict_oldest().unwrap().addr, A);
        assert!(first.cancel.is_cancelled() && !second.cancel.is_cancelled());
        drop(first); // already forgotten: dropping it again is harmless
        assert_eq!(t.len(), 1);
        drop(second);
        assert_eq!(t.len(), 0);
        assert!(t.evict_oldest().is_none());
    }

    #[test]
    fn one_address_holds_a_quarter_of_the_slots_in_opening_connections() {
        let t = Opening::new(8); // 2 per address
        let (a1, none) = t.add(A);
        assert!(none.is_none());
        let (a2, _) = t.add(A);
        let (b1, _) = t.add(B);
        let (a3, evicted) = t.add(A);
        assert_eq!(evicted.unwrap().addr, A);
        assert!(a1.cancel.is_cancelled());
        assert!(!a2.cancel.is_cancelled() && !a3.cancel.is_cancelled());
        assert!(!b1.cancel.is_cancelled());
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn a_connection_past_its_first_request_is_never_evicted() {
        let t = Opening::new(100);
        let (served, _) = t.add(A);
        let cancel = served.cancel.clone();
        drop(served); // its first request arrived
        assert!(t.evict_oldest().is_none());
        assert!(!cancel.is_cancelled());
    }
}
