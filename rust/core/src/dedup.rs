//! Recently seen message ids: a bounded LRU shared by every federation
//! receiver of an instance and by local publish (so echoes are recognised).
//!
//! Ids are marked seen only once the message is committed locally, so a
//! failed write never makes a later retransmission look like a duplicate.
//! While a receiver is storing a record its id is *in flight*
//! ([`SeenIds::claim`]): another receiver given the same id (a resend on a
//! second connection, a retried Spark task) waits for that outcome instead
//! of storing a second copy, and stores the record itself if the first
//! attempt failed.
//!
//! The window is bounded in bytes as well as in entries: ids are normally
//! 36-character UUIDs, but a peer may send long ones, and a window of
//! 100,000 multi-megabyte ids would hold gigabytes.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;
use tokio::sync::watch;

/// Bytes an entry is counted for on top of its id (the LRU's node and
/// hash-table slot).
pub const ENTRY_OVERHEAD_BYTES: usize = 64;
/// Bytes budgeted per entry of capacity: a UUID and its overhead fit many
/// times over, so the byte bound only bites on unusually long ids.
pub const BUDGET_PER_ENTRY_BYTES: usize = 256;
/// The byte bound is never below this (small windows still take long ids).
pub const MIN_WINDOW_BYTES: usize = 16 * 1024 * 1024;

/// A bounded set of recently seen ids.
pub struct SeenIds {
    ids: Mutex<Window>,
}

struct Window {
    /// foldhash, randomly seeded per process (as the store's channel map):
    /// with SipHash, dedup was about a tenth of the CPU of a client and hub
    /// federating in one process.
    lru: LruCache<String, (), foldhash::fast::RandomState>,
    /// Ids being stored now, with the channel their outcome is sent on
    /// (true: committed), made when a second caller first waits for it:
    /// most ids are never waited for, and a channel per record was a large
    /// part of a hub's CPU.
    in_flight: HashMap<String, Option<watch::Sender<Option<bool>>>, foldhash::fast::RandomState>,
    /// Bytes counted for the ids held (id length plus overhead).
    bytes: usize,
    max_bytes: usize,
}

impl Window {
    fn claim(&mut self, id: &str) -> Claim {
        if self.lru.get(id).is_some() {
            return Claim::Seen;
        }
        if let Some(tx) = self.in_flight.get_mut(id) {
            let rx = match tx {
                Some(tx) => tx.subscribe(),
                None => {
                    let (new, rx) = watch::channel(None);
                    *tx = Some(new);
                    rx
                }
            };
            return Claim::Pending(rx);
        }
        self.in_flight.insert(id.to_owned(), None);
        Claim::Mine
    }

    /// Ends the claim on `id`; returns the channel of its waiters, if any.
    fn settle(&mut self, id: &str, committed: bool) -> Option<watch::Sender<Option<bool>>> {
        let (key, tx) = self.in_flight.remove_entry(id).unzip();
        if committed {
            // The claim's own copy of the id becomes the window's.
            self.admit(id, || key.unwrap_or_else(|| id.to_owned()));
        }
        tx.flatten()
    }

    /// Marks `id` seen; `owned` gives it as a `String` if it is to be held.
    fn admit(&mut self, id: &str, owned: impl FnOnce() -> String) {
        if self.lru.get(id).is_some() || cost(id) > self.max_bytes {
            return;
        }
        while self.bytes + cost(id) > self.max_bytes {
            match self.lru.pop_lru() {
                Some((old, ())) => self.bytes -= cost(&old),
                None => break,
            }
        }
        if let Some((old, ())) = self.lru.push(owned(), ()) {
            self.bytes -= cost(&old);
        }
        self.bytes += cost(id);
    }
}

fn cost(id: &str) -> usize {
    id.len() + ENTRY_OVERHEAD_BYTES
}

impl SeenIds {
    /// A set holding at most `capacity` ids (at least 1), and at most
    /// `max(capacity × BUDGET_PER_ENTRY_BYTES, MIN_WINDOW_BYTES)` bytes of them.
    pub fn new(capacity: usize) -> SeenIds {
        let max_bytes = capacity
            .saturating_mul(BUDGET_PER_ENTRY_BYTES)
            .max(MIN_WINDOW_BYTES);
        SeenIds::with_max_bytes(capacity, max_bytes)
    }

    /// A set bounded by `capacity` ids and `max_bytes` (ids plus
    /// [`ENTRY_OVERHEAD_BYTES`] each); the least recently used go first.
    /// An id larger than `max_bytes` on its own is never held.
    pub fn with_max_bytes(capacity: usize, max_bytes: usize) -> SeenIds {
        let cap = NonZeroUsize::new(capacity.max(1)).expect("capacity >= 1");
        SeenIds {
            ids: Mutex::new(Window {
                lru: LruCache::with_hasher(cap, foldhash::fast::RandomState::default()),
                in_flight: HashMap::default(),
                bytes: 0,
                max_bytes,
            }),
        }
    }

    /// Whether `id` was seen recently (refreshes its recency).
    pub fn contains(&self, id: &str) -> bool {
        self.contains_each([id])[0]
    }

    /// For each of `ids`, whether it was seen recently (refreshing its
    /// recency), under one lock: a receiver asks for a whole batch at once.
    pub fn contains_each<'i>(&self, ids: impl IntoIterator<Item = &'i str>) -> Vec<bool> {
        let mut w = self.lock();
        ids.into_iter().map(|id| w.lru.get(id).is_some()).collect()
    }

    /// Claims `id` for storing: [`Claim::Seen`] if it was committed
    /// recently, [`Claim::Pending`] if another caller is storing it now (wait
    /// on the receiver, then claim again), else [`Claim::Mine`]: the caller
    /// stores the record and must [`settle`](SeenIds::settle) the id, whatever
    /// the outcome.
    pub fn claim(&self, id: &str) -> Claim {
        self.claim_each([id]).pop().expect("one claim per id")
    }

    /// [`claim`](SeenIds::claim)s each of `ids` in order, under one lock.
    /// The ids must differ: a repeat would wait for its own first claim.
    pub fn claim_each<'i>(&self, ids: impl IntoIterator<Item = &'i str>) -> Vec<Claim> {
        let mut w = self.lock();
        ids.into_iter().map(|id| w.claim(id)).collect()
    }

    /// Ends the claim on `id`: marks it seen if `committed`, and tells the
    /// callers waiting on it.
    pub fn settle(&self, id: &str, committed: bool) {
        self.settle_each([id], committed);
    }

    /// [`settle`](SeenIds::settle)s each of `ids` under one lock; waiters
    /// are told once it is released.
    pub fn settle_each<'i>(&self, ids: impl IntoIterator<Item = &'i str>, committed: bool) {
        let waiters: Vec<_> = {
            let mut w = self.lock();
            ids.into_iter()
                .filter_map(|id| w.settle(id, committed))
                .collect()
        };
        for tx in waiters {
            tx.send_replace(Some(committed));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ids claimed and not yet settled.
    pub fn in_flight(&self) -> usize {
        self.lock().in_flight.len()
    }

    /// Marks `id` as seen.
    pub fn insert(&self, id: &str) {
        self.lock().admit(id, || id.to_owned());
    }

    /// Bytes counted for the ids held now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Ids currently held.
    pub fn len(&self) -> usize {
        self.lock().lru.len()
    }

    /// Whether no id is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What [`SeenIds::claim`] found.
#[derive(Debug)]
pub enum Claim {
    /// Committed recently: a duplicate.
    Seen,
    /// Being stored by another caller; its outcome (true: committed) comes
    /// on this receiver (the sender dropped also ends the wait: claim again).
    Pending(watch::Receiver<Option<bool>>),
    /// The caller stores it.
    Mine,
}

impl Claim {
    /// Waits until a pending claim's outcome is known: true when the other
    /// attempt committed the record.
    pub async fn outcome(rx: &mut watch::Receiver<Option<bool>>) -> bool {
        match rx.wait_for(Option::is_some).await {
            Ok(v) => v.unwrap_or(false),
            Err(_) => false, // settled and gone: claim again
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_ids_wait_for_the_first_attempt() {
        let s = SeenIds::new(10);
        assert!(matches!(s.claim("a"), Claim::Mine));
        let Claim::Pending(mut rx) = s.claim("a") else {
            panic!("a second claim must wait");
        };
        s.settle("a", false);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert!(
            !rt.block_on(Claim::outcome(&mut rx)),
            "the first attempt failed"
        );
        assert!(
            matches!(s.claim("a"), Claim::Mine),
            "a failed attempt frees the id"
        );
        let Claim::Pending(mut rx) = s.claim("a") else {
            panic!("in flight again");
        };
        let Claim::Pending(mut rx2) = s.claim("a") else {
            panic!("a third claim waits too");
        };
        s.settle_each(["a"], true);
        assert!(rt.block_on(Claim::outcome(&mut rx)));
        assert!(
            rt.block_on(Claim::outcome(&mut rx2)),
            "every waiter learns it"
        );
        assert!(matches!(s.claim("a"), Claim::Seen));
        assert_eq!(s.len(), 1);
        assert_eq!(s.bytes(), 1 + ENTRY_OVERHEAD_BYTES);
        let claims = s.claim_each(["a", "b", "c"]);
        assert!(matches!(
            claims[..],
            [Claim::Seen, Claim::Mine, Claim::Mine]
        ));
        assert_eq!(s.in_flight(), 2);
        assert_eq!(s.contains_each(["a", "b", "c"]), [true, false, false]);
        s.settle_each(["b", "c"], false);
        assert_eq!(s.in_flight(), 0, "settled, failed");
        assert!(matches!(s.claim("b"), Claim::Mine));
    }

    #[test]
    fn evicts_least_recently_used() {
        let s = SeenIds::new(2);
        s.insert("a");
        s.insert("b");
        assert!(s.contains("a")); // refreshes a
        s.insert("c"); // evicts b
        assert!(s.contains("a") && s.contains("c") && !s.contains("b"));
        assert_eq!(s.len(), 2);
        assert_eq!(s.bytes(), 2 * (1 + ENTRY_OVERHEAD_BYTES));
    }

    #[test]
    fn long_ids_are_bounded_in_bytes() {
        let max = 10 * 1024 * 1024;
        let s = SeenIds::with_max_bytes(100_000, max);
        let big = |c: char| c.to_string().repeat(3 * 1024 * 1024);
        for c in ['a', 'b', 'c', 'd', 'e'] {
            s.insert(&big(c));
            assert!(s.bytes() <= max, "{} bytes held", s.bytes());
        }
        // Three 3 MiB ids fit in 10 MiB: the two oldest went.
        assert_eq!(s.len(), 3);
        assert!(!s.contains(&big('a')) && !s.contains(&big('b')));
        assert!(s.contains(&big('e')));
        // Short ids still fit beside them.
        for i in 0..1000 {
            s.insert(&format!("{i:036}"));
        }
        assert_eq!(s.len(), 1003);
        // An id over the whole budget is not held (nor evicts everything).
        s.insert(&"z".repeat(max + 1));
        assert_eq!(s.len(), 1003);
        // A long one makes room by evicting the least recently used.
        s.insert(&big('f'));
        assert!(!s.contains(&big('c')) && s.contains(&big('f')));
        assert!(s.bytes() <= max);
    }

    #[test]
    fn the_default_byte_bound_leaves_uuid_windows_alone() {
        let s = SeenIds::new(1000);
        for i in 0..1000 {
            s.insert(&format!("{i:036}"));
        }
        assert_eq!(s.len(), 1000);
        let s = SeenIds::new(10);
        s.insert(&"x".repeat(9 * 1024 * 1024));
        assert_eq!(s.len(), 1, "a small window still holds one long id");
    }
}
