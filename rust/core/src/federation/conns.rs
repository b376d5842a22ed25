//! Connection bookkeeping of the hub: which connections are still opening
//! (TLS, WebSocket upgrade, application handshake) and which are
//! established, per peer, with the limits that keep one party from starving
//! the others.
//!
//! * Unfinished connections are capped apart from established ones
//!   ([`MAX_PENDING`]). When the cap is reached, the OLDEST unfinished
//!   connection is dropped to make room for the new one: a flood of
//!   half-open connections only churns itself and cannot keep a
//!   well-behaved peer out (it finishes its handshake in milliseconds).
//! * Each certificate CN may hold at most [`MAX_PER_PEER`] connections,
//!   opening and established together. A newer connection beyond the limit
//!   EVICTS that peer's oldest one (an unfinished one first), it is not
//!   refused: a peer that reconnects after a half-open loss must get in, and
//!   a peer flooding with its own certificate only hurts itself.
//! * Established connections are capped by [`MAX_CONNECTIONS`]; a handshake
//!   beyond it is refused (the per-peer limit keeps one peer from filling it).
//! * Both caps shrink to fit the process's descriptor limit
//!   ([`Limits::for_nofile`]), so that connections never take the
//!   descriptors the channel files and the audit log need.
//!
//! Eviction cancels the connection's token; its task drops the socket.
//! [`ws_config`] keeps each connection's WebSocket buffers small.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;

use super::link::max_message_size;
use super::MAX_CONNECTIONS;

/// Most connections still opening (before the application handshake).
pub const MAX_PENDING: usize = 256;
/// Most connections (opening and established) of one certificate CN.
pub const MAX_PER_PEER: usize = 64;

/// Read and write buffer of a connection: small, so that many idle or
/// opening connections cost little (large messages grow them on demand).
pub const WS_BUFFER_BYTES: usize = 16 * 1024;

/// WebSocket limits of a federation connection: small buffers, and no
/// message or frame larger than [`max_message_size`].
pub fn ws_config(max_batch_bytes: usize) -> WebSocketConfig {
    let max = max_message_size(max_batch_bytes);
    WebSocketConfig::default()
        .read_buffer_size(WS_BUFFER_BYTES)
        .write_buffer_size(WS_BUFFER_BYTES)
        .max_write_buffer_size(max.saturating_mul(2))
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
}

/// The caps of a connection table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub pending: usize,
    pub established: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            pending: MAX_PENDING,
            established: MAX_CONNECTIONS,
        }
    }
}

impl Limits {
    /// The caps for a process allowed `nofile` open descriptors: unfinished
    /// connections take at most a quarter of them, established ones half
    /// (at least 4 each); the rest is left to files.
    pub fn for_nofile(nofile: u64) -> Limits {
        let part = |div: u64| usize::try_from(nofile / div).unwrap_or(usize::MAX).max(4);
        Limits {
            pending: MAX_PENDING.min(part(4)),
            established: MAX_CONNECTIONS.min(part(2)),
        }
    }

    /// The caps for this process's soft `RLIMIT_NOFILE` (the defaults if it
    /// cannot be read or is unlimited).
    pub fn for_this_process() -> Limits {
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct we pass and nothing else.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0;
        if !ok || rl.rlim_cur == libc::RLIM_INFINITY {
            return Limits::default();
        }
        // rlim_t is u64 on 64-bit targets and u32 on 32-bit ones (armv7).
        #[allow(clippy::useless_conversion)]
        let nofile = u64::from(rl.rlim_cur);
        Limits::for_nofile(nofile)
    }
}

struct Entry {
    cancel: CancellationToken,
    peer: Option<String>,
    established: bool,
}

#[derive(Default)]
struct Inner {
    next: u64,
    /// Every live connection by number (numbers grow with age).
    conns: HashMap<u64, Entry>,
    /// Unfinished connections, oldest first.
    pending: BTreeMap<u64, ()>,
    /// Connections of each identified peer, oldest first.
    peers: HashMap<String, BTreeMap<u64, ()>>,
    established: usize,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.conns.remove(&id)?;
        self.pending.remove(&id);
        if e.established {
            self.established -= 1;
        }
        if let Some(p) = &e.peer {
            if let Some(set) = self.peers.get_mut(p) {
                set.remove(&id);
                if set.is_empty() {
                    self.peers.remove(p);
                }
            }
        }
        Some(e)
    }

    fn evict(&mut self, id: u64) -> bool {
        match self.remove(id) {
            Some(e) => {
                e.cancel.cancel();
                true
            }
            None => false,
        }
    }
}

/// The hub's live connections.
#[derive(Default)]
pub struct ConnTable {
    limits: Limits,
    inner: Mutex<Inner>,
    /// Set when a connection ends (freed memory may be given back).
    closed: AtomicBool,
}

/// One connection's place in the table; dropping it removes the connection.
pub struct ConnGuard {
    table: Arc<ConnTable>,
    id: u64,
    /// Cancelled when the connection is evicted (or the hub stops).
    pub cancel: CancellationToken,
}

/// Figures of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnCounts {
    pub pending: usize,
    pub established: usize,
}

impl ConnTable {
    /// An empty table with these caps.
    pub fn new(limits: Limits) -> ConnTable {
        ConnTable {
            limits,
            ..ConnTable::default()
        }
    }

    /// Its caps.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a new, unfinished connection whose token is a child of
    /// `parent`, evicting the oldest unfinished one if the cap of
    /// unfinished connections is reached. Returns the guard and whether a connection was evicted.
    pub fn admit(self: &Arc<Self>, parent: &CancellationToken) -> (ConnGuard, bool) {
        let cancel = parent.child_token();
        let mut inner = self.lock();
        let mut evicted = false;
        while inner.pending.len() >= self.limits.pending {
            let Some((&oldest, _)) = inner.pending.iter().next() else {
                break;
            };
            evicted |= inner.evict(oldest);
        }
        inner.next += 1;
        let id = inner.next;
        inner.conns.insert(
            id,
            Entry {
                cancel: cancel.clone(),
                peer: None,
                established: false,
            },
        );
        inner.pending.insert(id, ());
        drop(inner);
        let guard = ConnGuard {
            table: self.clone(),
            id,
            cancel,
        };
        (guard, evicted)
    }

    /// Drops the oldest unfinished connection (to free a file descriptor);
    /// false if there is none.
    pub fn evict_oldest_pending(&self) -> bool {
        let mut inner = self.lock();
        let oldest = inner.pending.keys().next().copied();
        oldest.is_some_and(|id| inner.evict(id))
    }

    /// Connections opening and established now.
    pub fn counts(&self) -> ConnCounts {
        let inner = self.lock();
        ConnCounts {
            pending: inner.pending.len(),
            established: inner.established,
        }
    }

    /// Connections of `peer` now (opening and established).
    pub fn peer_connections(&self, peer: &str) -> usize {
        self.lock().peers.get(peer).map_or(0, |s| s.len())
    }

    /// Whether a connection ended since the last call.
    pub fn take_closed(&self) -> bool {
        self.closed.swap(false, Ordering::Relaxed)
    }
}

impl ConnGuard {
    /// The connection's TLS identity is known: counts it against `peer`'s
    /// limit, evicting that peer's oldest connection (unfinished first) when
    /// the limit is passed. Returns the number evicted.
    pub fn identified(&self, peer: &str) -> usize {
        let mut inner = self.table.lock();
        let Some(e) = inner.conns.get_mut(&self.id) else {
            return 0;
        };
        e.peer = Some(peer.to_owned());
        inner
            .peers
            .entry(peer.to_owned())
            .or_default()
            .insert(self.id, ());
        let mut evicted = 0;
        while let Some(set) = inner.peers.get(peer).filter(|s| s.len() > MAX_PER_PEER) {
            let others = || set.keys().copied().filter(|&id| id != self.id);
            let victim = others()
                .find(|id| inner.pending.contains_key(id))
                .or_else(|| others().next());
            match victim {
                Some(id) if inner.evict(id) => evicted += 1,
                _ => break,
            }
        }
        evicted
    }

    /// The application handshake is done: the connection moves from the
    /// unfinished to the established count. Err (the connection must be
    /// closed) if it was evicted meanwhile or the cap of established
    /// connections is reached.
    pub fn establish(&self) -> Result<(), String> {
        let cap = self.table.limits.established;
        let mut inner = self.table.lock();
        if inner.established >= cap {
            return Err(format!("{cap} connections are already established"));
        }
        let Some(e) = inner.conns.get_mut(&self.id) else {
            return Err("evicted while opening".into());
        };
        e.established = true;
        inner.pending.remove(&self.id);
        inner.established += 1;
        Ok(())
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.table.lock().remove(self.id);
        self.table.closed.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> (Arc<ConnTable>, CancellationToken) {
        (Arc::new(ConnTable::default()), CancellationToken::new())
    }

    #[test]
    fn a_full_pending_table_drops_its_oldest_for_a_newcomer() {
        let (t, root) = table();
        let flood: Vec<ConnGuard> = (0..MAX_PENDING).map(|_| t.admit(&root).0).collect();
        let (newcomer, evicted) = t.admit(&root);
        assert!(evicted);
        assert!(flood[0].cancel.is_cancelled(), "the oldest goes");
        assert!(flood[1..].iter().all(|g| !g.cancel.is_cancelled()));
        assert!(!newcomer.cancel.is_cancelled());
        assert_eq!(t.counts().pending, MAX_PENDING);
        // The newcomer finishes its handshake and no longer counts as pending.
        newcomer.identified("node2");
        newcomer.establish().unwrap();
        assert_eq!(
            t.counts(),
            ConnCounts {
                pending: MAX_PENDING - 1,
                established: 1
            }
        );
        drop(flood);
        drop(newcomer);
        assert_eq!(
            t.counts(),
            ConnCounts {
                pending: 0,
                established: 0
            }
        );
        assert!(t.take_closed());
    }

    #[test]
    fn an_evicted_connection_cannot_establish() {
        let (t, root) = table();
        let (g, _) = t.admit(&root);
        assert!(t.evict_oldest_pending());
        assert!(g.cancel.is_cancelled());
        assert!(g.establish().is_err());
        assert!(!t.evict_oldest_pending());
    }

    #[test]
    fn a_peer_over_its_limit_loses_its_oldest_unfinished_connection_first() {
        let (t, root) = table();
        let (durable, _) = t.admit(&root);
        durable.identified("node1");
        durable.establish().unwrap();
        let idle: Vec<ConnGuard> = (1..MAX_PER_PEER)
            .map(|_| {
                let (g, _) = t.admit(&root);
                assert_eq!(g.identified("node1"), 0);
                g
            })
            .collect();
        let (other, _) = t.admit(&root);
        assert_eq!(other.identified("node2"), 0);
        let (newest, _) = t.admit(&root);
        assert_eq!(newest.identified("node1"), 1);
        assert!(idle[0].cancel.is_cancelled(), "oldest unfinished of node1");
        assert!(!durable.cancel.is_cancelled(), "established one kept");
        assert!(!other.cancel.is_cancelled(), "another peer is untouched");
        assert_eq!(t.peer_connections("node1"), MAX_PER_PEER);
        assert_eq!(t.peer_connections("node2"), 1);
    }

    #[test]
    fn a_peer_with_only_established_connections_loses_its_oldest() {
        let (t, root) = table();
        let links: Vec<ConnGuard> = (0..MAX_PER_PEER)
            .map(|_| {
                let (g, _) = t.admit(&root);
                g.identified("spark");
                g.establish().unwrap();
                g
            })
            .collect();
        let (newest, _) = t.admit(&root);
        assert_eq!(newest.identified("spark"), 1);
        assert!(links[0].cancel.is_cancelled());
        assert!(links[1..].iter().all(|g| !g.cancel.is_cancelled()));
        assert_eq!(t.counts().established, MAX_PER_PEER - 1);
    }

    #[test]
    fn established_connections_are_capped() {
        let (t, root) = table();
        let peers = MAX_CONNECTIONS.div_ceil(MAX_PER_PEER);
        let links: Vec<ConnGuard> = (0..MAX_CONNECTIONS)
            .map(|i| {
                let (g, _) = t.admit(&root);
                g.identified(&format!("p{}", i % peers));
                g.establish().unwrap();
                g
            })
            .collect();
        let (extra, _) = t.admit(&root);
        extra.identified("late");
        assert!(extra.establish().is_err());
        drop(links);
        assert!(extra.establish().is_ok());
    }

    #[test]
    fn caps_shrink_to_the_descriptor_limit() {
        assert_eq!(
            Limits::for_nofile(64),
            Limits {
                pending: 16,
                established: 32
            }
        );
        assert_eq!(Limits::for_nofile(1 << 20), Limits::default());
        assert_eq!(Limits::for_nofile(3).pending, 4);
        let t = Arc::new(ConnTable::new(Limits::for_nofile(64)));
        let root = CancellationToken::new();
        let first: Vec<ConnGuard> = (0..16).map(|_| t.admit(&root).0).collect();
        assert!(t.admit(&root).1, "the 17th unfinished connection evicts");
        assert!(first[0].cancel.is_cancelled());
    }

    #[test]
    fn cancelling_the_hub_cancels_every_connection() {
        let (t, root) = table();
        let (g, _) = t.admit(&root);
        root.cancel();
        assert!(g.cancel.is_cancelled());
    }
}
