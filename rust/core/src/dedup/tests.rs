//! The window's tests: against a plain model, and case by case.

use super::*;
use proptest::prelude::*;
use std::collections::HashSet;

/// A plain model of the window: a list in order of use and a set of
/// ids in flight, checked against the window after every step.
#[derive(Default)]
struct Model {
    held: Vec<String>,
    in_flight: HashSet<String>,
}

impl Model {
    fn touch(&mut self, id: &str) -> bool {
        let Some(at) = self.held.iter().position(|h| h == id) else {
            return false;
        };
        let id = self.held.remove(at);
        self.held.push(id);
        true
    }

    fn admit(&mut self, id: &str, capacity: usize) {
        self.in_flight.remove(id);
        if !self.touch(id) {
            self.held.push(id.to_owned());
            if self.held.len() > capacity {
                self.held.remove(0);
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    Insert(u8),
    Contains(u8),
    Claim(u8),
    Settle(u8, bool),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..12u8).prop_map(Step::Insert),
        (0..12u8).prop_map(Step::Contains),
        (0..12u8).prop_map(Step::Claim),
        (0..12u8, any::<bool>()).prop_map(|(i, c)| Step::Settle(i, c)),
    ]
}

/// Ids 0-5 as canonical UUIDs, 6-11 as other text: both kinds of key.
fn id(i: u8) -> String {
    match i < 6 {
        true => format!("0197a3c5-5e21-7b4f-8c2d-{i:012x}"),
        false => format!("id-{i}"),
    }
}

proptest! {
    #[test]
    fn behaves_as_a_plain_lru_with_ids_in_flight(
        capacity in 1..5usize,
        steps in proptest::collection::vec(step(), 1..200),
    ) {
        let s = SeenIds::with_max_bytes(capacity, usize::MAX);
        let mut m = Model::default();
        for st in steps {
            match st {
                Step::Insert(i) => {
                    s.insert(&id(i));
                    m.admit(&id(i), capacity);
                }
                Step::Contains(i) => prop_assert_eq!(s.contains(&id(i)), m.touch(&id(i))),
                Step::Claim(i) => {
                    let want = match () {
                        _ if m.touch(&id(i)) => "seen",
                        _ if !m.in_flight.insert(id(i)) => "pending",
                        _ => "mine",
                    };
                    let got = match s.claim(&id(i)) {
                        Claim::Seen => "seen",
                        Claim::Pending(_) => "pending",
                        Claim::Mine => "mine",
                    };
                    prop_assert_eq!(got, want);
                }
                Step::Settle(i, committed) => {
                    s.settle(&id(i), committed);
                    m.in_flight.remove(&id(i));
                    if committed {
                        m.admit(&id(i), capacity);
                    }
                }
            }
            prop_assert_eq!(s.len(), m.held.len());
            prop_assert_eq!(s.in_flight(), m.in_flight.len());
            let w = s.lock();
            prop_assert_eq!(w.ids.len(), w.held + w.in_flight);
            let bytes: usize = m.held.iter().map(|h| cost(h)).sum();
            prop_assert_eq!(w.bytes, bytes);
        }
    }
}

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

#[test]
fn uuids_are_held_as_bits_and_still_compare_as_strings() {
    let lower = "0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e5f";
    assert!(parse_canonical_uuid(lower.as_bytes()).is_some());
    for other in [
        "0197A3C5-5E21-7B4F-8C2D-4A1B2C3D4E5F",
        "0197a3c55e217b4f8c2d4a1b2c3d4e5f",
        "{0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e5f}",
        "0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e5g",
        "0197a3c5-5e21-7b4f-8c2d4-a1b2c3d4e5f",
    ] {
        assert!(parse_canonical_uuid(other.as_bytes()).is_none(), "{other}");
    }
    let s = SeenIds::new(10);
    s.insert(lower);
    assert!(s.contains(lower));
    assert!(!s.contains(&lower.to_uppercase()), "case matters");
    assert!(!s.contains("0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e50"));
    s.insert(&lower.to_uppercase());
    assert_eq!(s.len(), 2, "two different ids");
    assert_eq!(s.bytes(), 2 * (36 + ENTRY_OVERHEAD_BYTES));
    assert!(matches!(s.claim(lower), Claim::Seen));
    let next = "0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e60";
    assert!(matches!(s.claim(next), Claim::Mine));
    assert!(matches!(s.claim(next), Claim::Pending(_)));
    s.settle(next, true);
    assert!(s.contains(next) && s.in_flight() == 0);
}

#[test]
fn recency_survives_many_refreshes() {
    // Refreshing one id over and over leaves stale queue entries that
    // must neither evict it nor grow without bound.
    let s = SeenIds::new(3);
    s.insert("keep");
    for i in 0..10_000 {
        s.insert(&format!("{i:036}"));
        assert!(s.contains("keep"), "refreshed at {i}, still held");
    }
    assert_eq!(s.len(), 3);
    let w = s.lock();
    assert!(
        w.order.len() <= 2 * w.held + 64 + 1,
        "{} queued",
        w.order.len()
    );
    drop(w);
    // The least recently used goes first, UUIDs and text alike.
    let uuid = |n: u32| format!("0197a3c5-5e21-7b4f-8c2d-{n:012x}");
    let s = SeenIds::new(3);
    s.insert(&uuid(1));
    s.insert("text");
    s.insert(&uuid(2));
    assert!(s.contains(&uuid(1)));
    s.insert(&uuid(3)); // evicts "text"
    assert!(!s.contains("text"));
    assert!(s.contains(&uuid(1)) && s.contains(&uuid(2)) && s.contains(&uuid(3)));
    s.insert_each(["a", "b"]); // evicts uuid(1), then uuid(2)
    assert!(!s.contains(&uuid(1)) && !s.contains(&uuid(2)));
    assert_eq!(s.len(), 3);
    assert_eq!(s.bytes(), 36 + 2 + 3 * ENTRY_OVERHEAD_BYTES);
}
