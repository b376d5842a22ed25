//! Recently seen message ids: a bounded LRU shared by every federation
//! receiver of an instance and by local publish (so echoes are recognised).
//!
//! Ids are marked seen only once the message is committed locally, so a
//! failed write never makes a later retransmission look like a duplicate.

use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;

/// A bounded set of recently seen ids.
pub struct SeenIds {
    ids: Mutex<LruCache<String, ()>>,
}

impl SeenIds {
    /// A set holding at most `capacity` ids (at least 1).
    pub fn new(capacity: usize) -> SeenIds {
        let cap = NonZeroUsize::new(capacity.max(1)).expect("capacity >= 1");
        SeenIds {
            ids: Mutex::new(LruCache::new(cap)),
        }
    }

    /// Whether `id` was seen recently (refreshes its recency).
    pub fn contains(&self, id: &str) -> bool {
        self.ids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .is_some()
    }

    /// Marks `id` as seen.
    pub fn insert(&self, id: &str) {
        let mut ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        if ids.get(id).is_none() {
            ids.put(id.to_owned(), ());
        }
    }

    /// Ids currently held.
    pub fn len(&self) -> usize {
        self.ids.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no id is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let s = SeenIds::new(2);
        s.insert("a");
        s.insert("b");
        assert!(s.contains("a")); // refreshes a
        s.insert("c"); // evicts b
        assert!(s.contains("a") && s.contains("c") && !s.contains("b"));
        assert_eq!(s.len(), 2);
    }
}
