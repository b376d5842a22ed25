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

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use hashbrown::hash_map::{Entry, EntryRef};
use hashbrown::{Equivalent, HashMap};
use tokio::sync::watch;

/// Bytes an entry is counted for on top of its id (its hash-table slot and
/// its place in the recency queue).
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

/// foldhash, randomly seeded per process (as the store's channel map):
/// with SipHash, dedup was about a tenth of the CPU of a client and hub
/// federating in one process.
type Map<V> = HashMap<Key, V, foldhash::fast::RandomState>;

/// The stamp of an id being stored now; stamps of held ids start at 1.
const IN_FLIGHT: u64 = 0;

/// The window: an exact least-recently-used set without a node per entry.
/// Every id held maps to the stamp of its last use; `order` lists uses
/// oldest first, so the front entry whose stamp is still its id's is the
/// least recently used. A use of an id already held pushes a new entry and
/// leaves the old one stale (skipped when it reaches the front, dropped
/// when stale entries outnumber live ones). A linked LRU allocated and
/// freed a node and a string per id, and those cache misses and frees were
/// a fifth of the CPU of a federating client and hub.
///
/// Ids being stored now are in the same map, stamped [`IN_FLIGHT`] (never
/// queued, so never evicted): a hub claims, stores and settles every id it
/// receives, and with a map apart each of those steps was two lookups
/// where one now does, in a table too large for the CPU's caches.
struct Window {
    ids: Map<u64>,
    order: VecDeque<(Key, u64)>,
    /// The stamp of the last use.
    stamp: u64,
    /// Ids held (in `ids` with a stamp that is not [`IN_FLIGHT`]).
    held: usize,
    /// Ids in flight.
    in_flight: usize,
    capacity: usize,
    /// In-flight ids somebody waits for, with the channel their outcome is
    /// sent on (true: committed), made when a second caller first waits:
    /// most ids are never waited for, and a channel per record was a large
    /// part of a hub's CPU.
    waiters: Map<watch::Sender<Option<bool>>>,
    /// Bytes counted for the ids held (id length plus overhead).
    bytes: usize,
    max_bytes: usize,
}

/// An id as held. A canonical UUID (lowercase and hyphenated, as this
/// engine and the Go original write them) is kept as its 128 bits, with no
/// allocation; any other id as its text. The mapping is one-to-one, so ids
/// still compare as exact strings.
#[derive(Clone, PartialEq, Eq)]
enum Key {
    Uuid([u64; 2]),
    Text(Box<str>),
}

/// An id being looked up: [`Key`] without owning its text.
#[derive(Clone, Copy)]
enum KeyRef<'a> {
    Uuid([u64; 2]),
    Text(&'a str),
}

impl<'a> KeyRef<'a> {
    fn of(id: &'a str) -> KeyRef<'a> {
        match parse_canonical_uuid(id.as_bytes()) {
            Some(bits) => KeyRef::Uuid(bits),
            None => KeyRef::Text(id),
        }
    }

    fn to_key(self) -> Key {
        match self {
            KeyRef::Uuid(bits) => Key::Uuid(bits),
            KeyRef::Text(id) => Key::Text(id.into()),
        }
    }

    fn cost(self) -> usize {
        match self {
            KeyRef::Uuid(_) => UUID_LEN + ENTRY_OVERHEAD_BYTES,
            KeyRef::Text(id) => cost(id),
        }
    }
}

/// What a vacant [`HashMap::entry_ref`] stores.
impl From<&KeyRef<'_>> for Key {
    fn from(id: &KeyRef<'_>) -> Key {
        id.to_key()
    }
}

impl Key {
    fn as_ref(&self) -> KeyRef<'_> {
        match self {
            Key::Uuid(bits) => KeyRef::Uuid(*bits),
            Key::Text(id) => KeyRef::Text(id),
        }
    }
}

// `Key` and `KeyRef` hash alike, so a `KeyRef` finds its `Key`.
impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        match self {
            KeyRef::Uuid([hi, lo]) => {
                h.write_u64(*hi);
                h.write_u64(*lo);
            }
            KeyRef::Text(id) => id.hash(h),
        }
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.as_ref().hash(h)
    }
}

impl Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        match (self, key) {
            (KeyRef::Uuid(a), Key::Uuid(b)) => a == b,
            (KeyRef::Text(a), Key::Text(b)) => *a == &**b,
            _ => false,
        }
    }
}

const UUID_LEN: usize = 36;

/// Each byte's value as a hex digit (lowercase only), or [`NOT_HEX`].
const HEX: [u8; 256] = {
    let mut t = [NOT_HEX; 256];
    let mut c = 0;
    while c < 10 {
        t[b'0' as usize + c] = c as u8;
        c += 1;
    }
    let mut c = 0;
    while c < 6 {
        t[b'a' as usize + c] = 10 + c as u8;
        c += 1;
    }
    t
};
const NOT_HEX: u8 = 0xff;

/// The 128 bits of `id` if it is a UUID written in lowercase hex with
/// hyphens at 8, 13, 18 and 23 (exactly one id string has those bits).
/// Every id a hub receives is looked up three times (seen? claim, settle):
/// a table instead of a match per byte.
fn parse_canonical_uuid(id: &[u8]) -> Option<[u64; 2]> {
    let id: &[u8; UUID_LEN] = id.try_into().ok()?;
    if [id[8], id[13], id[18], id[23]] != [b'-'; 4] {
        return None;
    }
    let mut bits: u128 = 0;
    let mut bad = 0;
    for &c in id[..8]
        .iter()
        .chain(&id[9..13])
        .chain(&id[14..18])
        .chain(&id[19..23])
        .chain(&id[24..])
    {
        let nibble = HEX[usize::from(c)];
        bad |= nibble;
        bits = bits << 4 | u128::from(nibble & 0x0f);
    }
    (bad != NOT_HEX).then_some([(bits >> 64) as u64, bits as u64])
}

impl Window {
    /// Whether `id` is held; a held id becomes the most recently used.
    fn touch(&mut self, id: KeyRef<'_>) -> bool {
        match self.ids.get_mut(&id) {
            Some(stamp) if *stamp != IN_FLIGHT => {
                self.stamp += 1;
                *stamp = self.stamp;
                self.queue(id.to_key());
                true
            }
            _ => false,
        }
    }

    /// Queues a use of `key` at the current stamp, dropping stale entries
    /// once they outnumber live ones.
    fn queue(&mut self, key: Key) {
        self.order.push_back((key, self.stamp));
        if self.order.len() > 2 * self.held + 64 {
            let ids = &self.ids;
            self.order
                .retain(|(key, stamp)| ids.get(key) == Some(stamp));
        }
    }

    fn claim(&mut self, id: KeyRef<'_>) -> Claim {
        match self.ids.entry_ref(&id) {
            EntryRef::Vacant(v) => {
                v.insert(IN_FLIGHT);
                self.in_flight += 1;
                Claim::Mine
            }
            EntryRef::Occupied(o) if *o.get() == IN_FLIGHT => {
                let tx = self
                    .waiters
                    .entry_ref(&id)
                    .or_insert_with(|| watch::channel(None).0);
                Claim::Pending(tx.subscribe())
            }
            EntryRef::Occupied(o) => {
                self.stamp += 1;
                *o.into_mut() = self.stamp;
                self.queue(id.to_key());
                Claim::Seen
            }
        }
    }

    /// Ends the claim on `id`; returns the channel of its waiters, if any.
    fn settle(&mut self, id: KeyRef<'_>, committed: bool) -> Option<watch::Sender<Option<bool>>> {
        let waiters = match self.waiters.is_empty() {
            true => None,
            false => self.waiters.remove(&id),
        };
        let cost = id.cost();
        let keep = committed && cost <= self.max_bytes;
        match self.ids.entry_ref(&id) {
            EntryRef::Occupied(o) if *o.get() == IN_FLIGHT => {
                self.in_flight -= 1;
                if keep {
                    self.stamp += 1;
                    *o.into_mut() = self.stamp;
                    self.hold(id.to_key(), cost);
                } else {
                    o.remove();
                }
            }
            // Not claimed (or marked seen while in flight): a commit marks it.
            EntryRef::Occupied(o) if keep => {
                self.stamp += 1;
                *o.into_mut() = self.stamp;
                self.queue(id.to_key());
            }
            EntryRef::Vacant(v) if keep => {
                self.stamp += 1;
                v.insert(self.stamp);
                self.hold(id.to_key(), cost);
            }
            _ => {}
        }
        waiters
    }

    /// Marks `id` seen (`owned` gives it as a [`Key`] if it is to be held).
    fn admit(&mut self, id: KeyRef<'_>, owned: impl FnOnce() -> Key) {
        let cost = id.cost();
        if self.touch(id) || cost > self.max_bytes {
            return;
        }
        self.stamp += 1;
        let key = owned();
        if let Some(stamp) = self.ids.get_mut(&key) {
            // In flight: held from now on; its settle refreshes it.
            *stamp = self.stamp;
            self.in_flight -= 1;
        } else {
            self.ids.insert(key.clone(), self.stamp);
        }
        self.hold(key, cost);
    }

    /// Counts a newly held id (stamped with the current stamp) as the most
    /// recently used, then evicts the least recently used ones while the
    /// window is over its bounds (never the new one: it costs at most
    /// `max_bytes` and the capacity is at least 1).
    fn hold(&mut self, key: Key, cost: usize) {
        self.held += 1;
        self.bytes += cost;
        self.queue(key);
        while self.bytes > self.max_bytes || self.held > self.capacity {
            if !self.evict_oldest() {
                break;
            }
        }
    }

    /// Drops the least recently used id; false when none is held.
    fn evict_oldest(&mut self) -> bool {
        while let Some((key, stamp)) = self.order.pop_front() {
            let cost = key.as_ref().cost();
            if let Entry::Occupied(o) = self.ids.entry(key) {
                if *o.get() == stamp {
                    o.remove();
                    self.held -= 1;
                    self.bytes -= cost;
                    return true;
                }
            }
        }
        false
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
        SeenIds {
            ids: Mutex::new(Window {
                ids: Map::default(),
                order: VecDeque::new(),
                stamp: IN_FLIGHT,
                held: 0,
                in_flight: 0,
                capacity: capacity.max(1),
                waiters: Map::default(),
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
        ids.into_iter().map(|id| w.touch(KeyRef::of(id))).collect()
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
        ids.into_iter().map(|id| w.claim(KeyRef::of(id))).collect()
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
                .filter_map(|id| w.settle(KeyRef::of(id), committed))
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
        self.lock().in_flight
    }

    /// Marks `id` as seen.
    pub fn insert(&self, id: &str) {
        self.insert_each([id]);
    }

    /// [`insert`](SeenIds::insert)s each of `ids` under one lock.
    pub fn insert_each(&self, ids: impl IntoIterator<Item = impl AsRef<str>>) {
        let mut w = self.lock();
        for id in ids {
            let id = KeyRef::of(id.as_ref());
            w.admit(id, || id.to_key());
        }
    }

    /// Bytes counted for the ids held now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Ids currently held.
    pub fn len(&self) -> usize {
        self.lock().held
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
mod tests;
