//! The batch frame decoder, `wire::split_batch`, on arbitrary bytes.
//!
//! A batch body is a sequence of records, each a 4-byte big-endian length
//! followed by that many bytes. Checked for every input:
//!
//! * `split_batch` never panics and accepts exactly the bodies that an
//!   independent walk (64-bit arithmetic over indices) finds to be whole
//!   records, returning the same records;
//! * the records it returns are sub-slices of the input, in order and
//!   without gaps, and `push_record` of each rebuilds the input byte for byte;
//! * an accepted non-empty body loses its acceptance when its last byte is
//!   cut, and a cut at any of its first record boundaries is accepted with
//!   that many records.

#![no_main]

use keyop_core::federation::wire::{push_record, split_batch};
use libfuzzer_sys::fuzz_target;

/// Byte ranges of the records of `body`, or `None` when it is not a
/// concatenation of whole records.
fn reference_split(body: &[u8]) -> Option<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    let mut at: u64 = 0;
    let total = body.len() as u64;
    while at < total {
        if total - at < 4 {
            return None;
        }
        let i = at as usize;
        let len = u64::from(u32::from_be_bytes([
            body[i],
            body[i + 1],
            body[i + 2],
            body[i + 3],
        ]));
        let start = at + 4;
        let end = start + len;
        if end > total {
            return None;
        }
        out.push((start as usize, end as usize));
        at = end;
    }
    Some(out)
}

fuzz_target!(|body: &[u8]| {
    let reference = reference_split(body);
    let records = match split_batch(body) {
        Ok(records) => records,
        Err(e) => {
            assert!(
                reference.is_none(),
                "split_batch refused whole records: {e}"
            );
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let ranges = reference.expect("split_batch accepted a body that is not whole records");
    assert_eq!(records.len(), ranges.len());
    let base = body.as_ptr() as usize;
    let mut expected_start = 0usize;
    for (rec, &(start, end)) in records.iter().zip(&ranges) {
        assert_eq!(start, expected_start + 4, "a gap between records");
        assert_eq!(rec.as_ptr() as usize - base, start, "not a sub-slice");
        assert_eq!(rec.len(), end - start);
        expected_start = end;
    }
    assert_eq!(expected_start, body.len(), "bytes left over");

    let mut rebuilt = Vec::with_capacity(body.len());
    for rec in &records {
        push_record(&mut rebuilt, rec);
    }
    assert_eq!(rebuilt, body, "push_record does not rebuild the body");

    if !body.is_empty() {
        assert!(
            split_batch(&body[..body.len() - 1]).is_err(),
            "a body without its last byte was accepted"
        );
    }
    // The first boundaries only: checking all of them is quadratic in the
    // number of records, and a 4 KiB input holds a thousand empty ones.
    let mut boundary = 0;
    for (k, &(_, end)) in ranges.iter().enumerate().take(32) {
        let part = split_batch(&body[..boundary]).expect("a prefix of whole records");
        assert_eq!(part.len(), k);
        boundary = end;
    }
});
