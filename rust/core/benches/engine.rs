//! Engine benchmarks without Python: `cargo bench -p keyop-core`.
//!
//! The message is the one `keyop-messenger bench` publishes (a 4-field
//! reading, about 200 bytes as a record). Stores live in temporary
//! directories; the append benchmarks open a fresh store for every sample,
//! outside the timed loop, so the data written stays bounded. Filter with a
//! name, e.g. `cargo bench -p keyop-core -- append/`.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use keyop_core::engine::encode_message;
use keyop_core::envelope::{encode_record, format_ts, new_id, EnvelopeRef, Header};
use keyop_core::federation::wire::{push_record, split_batch};
use keyop_core::storage::Item;
use keyop_core::{read_channel, Delivery, Engine, Envelope, Outgoing, StoreConfig};
use tempfile::TempDir;

const CHANNEL: &str = "bench";
const ORIGIN: &str = "bench";
const PAYLOAD_TYPE: &str = "bench.Reading";
const PAYLOAD: &[u8] = br#"{"sensor":"t-17","celsius":21.5,"seq":0,"ok":true}"#;
const SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
/// Records in the channel the reader benchmarks scan.
const SCAN_RECORDS: usize = 10_000;
/// Records in a federation batch.
const BATCH: usize = 100;

fn outgoing() -> Outgoing<'static> {
    Outgoing {
        payload_type: PAYLOAD_TYPE,
        payload_json: PAYLOAD,
        service_name: None,
        correlation_id: None,
    }
}

/// `n` records of the typical message, each with its `\n`.
fn records(n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n {
        encode_message(&mut out, ORIGIN, CHANNEL, &outgoing()).expect("encode");
    }
    out
}

fn open(data_dir: &Path, sync_interval_ms: u64) -> Engine {
    let cfg = StoreConfig {
        data_dir: data_dir.to_owned(),
        sync_interval_ms,
        segment_bytes: SEGMENT_BYTES,
    };
    Engine::open(cfg, ORIGIN).expect("open engine")
}

fn envelope(c: &mut Criterion) {
    let mut g = c.benchmark_group("envelope");
    g.throughput(Throughput::Elements(1));
    let id = new_id();
    let ts = format_ts(SystemTime::now());
    let header = Header {
        id: &id,
        ts: &ts,
        channel: CHANNEL,
        origin: ORIGIN,
        payload_type: PAYLOAD_TYPE,
        correlation_id: None,
        service_name: None,
    };
    let mut out = Vec::with_capacity(512);
    // The record alone: header fields escaped, payload copied.
    g.bench_function("encode_record", |b| {
        b.iter(|| {
            out.clear();
            encode_record(&mut out, black_box(&header), black_box(PAYLOAD));
            out.len()
        })
    });
    // What a publish pays before the append: a new UUIDv7, a timestamp, the record.
    g.bench_function("encode_message", |b| {
        b.iter(|| {
            out.clear();
            encode_message(&mut out, ORIGIN, CHANNEL, black_box(&outgoing())).expect("encode")
        })
    });
    let line = records(1);
    let line = &line[..line.len() - 1];
    g.bench_function("decode", |b| {
        b.iter(|| Envelope::decode(black_box(line)).expect("decode"))
    });
    // What a subscriber, a Spark read and a hub's receive pay per record.
    g.bench_function("decode_ref", |b| {
        b.iter(|| EnvelopeRef::decode(black_box(line)).expect("decode"))
    });
    g.finish();
}

/// Times `iters` appends of `records` (`count` records each) to a new store.
fn timed_appends(sync_interval_ms: u64, records: &[u8], count: u64, iters: u64) -> Duration {
    let dir = TempDir::new().expect("temp dir");
    let engine = open(dir.path(), sync_interval_ms);
    let writer = engine.publish_writer(CHANNEL).expect("channel writer");
    let started = Instant::now();
    for _ in 0..iters {
        black_box(writer.append(records, count).expect("append"));
    }
    let took = started.elapsed();
    engine.close();
    took
}

fn append(c: &mut Criterion) {
    let one = records(1);
    let batch = records(BATCH);
    let mut g = c.benchmark_group("append");
    // Relaxed: the append returns after the write; a timer fdatasyncs every 200 ms.
    g.throughput(Throughput::Elements(1));
    g.bench_function("relaxed/1", |b| {
        b.iter_custom(|iters| timed_appends(200, &one, 1, iters))
    });
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function(format!("relaxed/{BATCH}"), |b| {
        b.iter_custom(|iters| timed_appends(200, &batch, BATCH as u64, iters))
    });
    // Durable, one thread: every append waits for its fdatasync (the disk's pace).
    g.sample_size(10);
    g.throughput(Throughput::Elements(1));
    g.bench_function("durable/1", |b| {
        b.iter_custom(|iters| timed_appends(0, &one, 1, iters))
    });
    // Durable, 16 threads appending one record each: group commit shares one
    // fdatasync among whoever is waiting (no GIL here, unlike from Python).
    g.throughput(Throughput::Elements(THREADS));
    g.bench_function(format!("durable/{THREADS}_threads"), |b| {
        b.iter_custom(|iters| timed_threaded_appends(&one, iters))
    });
    g.finish();
}

/// Threads of the group-commit benchmark.
const THREADS: u64 = 16;

/// Times `iters` rounds in which each of [`THREADS`] threads appends one
/// record (durable), all threads running at once.
fn timed_threaded_appends(record: &[u8], iters: u64) -> Duration {
    let dir = TempDir::new().expect("temp dir");
    let engine = open(dir.path(), 0);
    let writer = engine.publish_writer(CHANNEL).expect("channel writer");
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                for _ in 0..iters {
                    black_box(writer.append(record, 1).expect("append"));
                }
            });
        }
    });
    let took = started.elapsed();
    engine.close();
    took
}

/// Reads the whole channel as a subscriber does, each record decoded into a
/// [`Delivery`] (the read-ahead thread's work per record); returns the count.
fn scan_deliveries(data_dir: &Path) -> usize {
    let mut reader = read_channel(data_dir, CHANNEL, 0).expect("reader");
    let mut n = 0;
    while let Some(item) = reader.next_item(u64::MAX).expect("read") {
        if let Item::Record { offset, line, .. } = item {
            black_box(Delivery::decode(offset, line).expect("decode"));
            n += 1;
        }
    }
    assert_eq!(n, SCAN_RECORDS);
    n
}

/// Reads the whole channel, optionally decoding each record; returns the count.
fn scan(data_dir: &Path, decode: bool) -> usize {
    let mut reader = read_channel(data_dir, CHANNEL, 0).expect("reader");
    let mut n = 0;
    while let Some(item) = reader.next_item(u64::MAX).expect("read") {
        if let Item::Record { line, .. } = item {
            if decode {
                black_box(Envelope::decode(&line).expect("decode"));
            }
            n += 1;
        }
    }
    assert_eq!(n, SCAN_RECORDS);
    n
}

fn reader(c: &mut Criterion) {
    let dir = TempDir::new().expect("temp dir");
    let engine = open(dir.path(), 0);
    let writer = engine.publish_writer(CHANNEL).expect("channel writer");
    writer
        .append(records(SCAN_RECORDS), SCAN_RECORDS as u64)
        .expect("append");
    engine.close();
    // The segment is in the page cache: these measure the reader, not the disk.
    let mut g = c.benchmark_group("reader");
    g.throughput(Throughput::Elements(SCAN_RECORDS as u64));
    g.bench_function(format!("scan/{SCAN_RECORDS}"), |b| {
        b.iter(|| scan(dir.path(), false))
    });
    g.bench_function(format!("scan_decode/{SCAN_RECORDS}"), |b| {
        b.iter(|| scan(dir.path(), true))
    });
    g.bench_function(format!("scan_deliveries/{SCAN_RECORDS}"), |b| {
        b.iter(|| scan_deliveries(dir.path()))
    });
    g.finish();
}

/// Records in the channel of the time-seek benchmark.
const SEEK_RECORDS: usize = 100_000;

/// A time seek (the first record at or after a time) in a channel of
/// [`SEEK_RECORDS`] records over 1 MiB segments: bisection over the segments'
/// timestamps, then over record boundaries in one segment.
fn time_seek(c: &mut Criterion) {
    use keyop_core::storage::timeindex::{resolve, SeekCost, StartPosition};
    let dir = TempDir::new().expect("temp dir");
    let cfg = StoreConfig {
        data_dir: dir.path().to_owned(),
        sync_interval_ms: 0,
        segment_bytes: 1024 * 1024,
    };
    let engine = Engine::open(cfg, ORIGIN).expect("open engine");
    let writer = engine.publish_writer(CHANNEL).expect("channel writer");
    let chunk = 1000;
    let mut middle = 0;
    for i in 0..SEEK_RECORDS / chunk {
        if i == SEEK_RECORDS / chunk / 2 {
            middle = SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_nanos() as i64;
        }
        writer.append(records(chunk), chunk as u64).expect("append");
    }
    let end = writer.committed_end();
    let channel_dir = writer.dir().to_owned();
    engine.close();
    let mut cost = SeekCost::default();
    let at = resolve(
        &channel_dir,
        StartPosition::Time(middle),
        u64::MAX,
        &mut cost,
    )
    .unwrap_or_else(|_| panic!("time seek failed"));
    eprintln!(
        "time_seek: {SEEK_RECORDS} records, {end} bytes, {} segments: found offset {at} \
         reading {} windows of {} bytes",
        keyop_core::storage::segment::list_segments(&channel_dir).map_or(0, |s| s.len()),
        cost.reads,
        keyop_core::storage::timeindex::WINDOW
    );
    let mut g = c.benchmark_group("seek");
    g.throughput(Throughput::Elements(1));
    g.bench_function(format!("time/{SEEK_RECORDS}"), |b| {
        b.iter(|| {
            let mut cost = SeekCost::default();
            resolve(
                black_box(&channel_dir),
                StartPosition::Time(black_box(middle)),
                u64::MAX,
                &mut cost,
            )
            .is_ok()
        })
    });
    g.finish();
}

fn wire(c: &mut Criterion) {
    let stored = records(BATCH);
    let lines: Vec<&[u8]> = stored
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    let mut g = c.benchmark_group("wire");
    g.throughput(Throughput::Elements(BATCH as u64));
    let mut body = Vec::with_capacity(stored.len() + 4 * BATCH);
    // The body of one binary batch message: length-prefixed records.
    g.bench_function(format!("encode_batch/{BATCH}"), |b| {
        b.iter(|| {
            body.clear();
            for line in &lines {
                push_record(&mut body, black_box(line));
            }
            body.len()
        })
    });
    // What a receiver does with it before the append: split and decode each record.
    let mut frame = Vec::new();
    for line in &lines {
        push_record(&mut frame, line);
    }
    g.bench_function(format!("decode_batch/{BATCH}"), |b| {
        b.iter(|| {
            let records = split_batch(black_box(&frame)).expect("whole records");
            for record in records {
                black_box(Envelope::decode(record).expect("decode"));
            }
        })
    });
    g.finish();
}

/// The machine, not the engine: a ring of [`THREADS`] threads, each asleep
/// on its own futex word until the one before wakes it. One hop is what a
/// group commit pays per caller it wakes; compare it pinned to one CPU
/// (`taskset -c 0`), where a wake-up is a context switch.
fn probe(c: &mut Criterion) {
    let mut g = c.benchmark_group("probe");
    g.throughput(Throughput::Elements(1));
    g.bench_function(format!("futex_ring/{THREADS}_threads"), |b| {
        b.iter_custom(futex_ring)
    });
    g.finish();
}

/// Times `hops` hand-offs around the ring.
fn futex_ring(hops: u64) -> Duration {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
    let words: Vec<AtomicU32> = (0..THREADS).map(|_| AtomicU32::new(0)).collect();
    let done = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        for i in 0..words.len() {
            let (words, done) = (&words, &done);
            s.spawn(move || loop {
                while words[i].swap(0, Ordering::AcqRel) == 0 {
                    atomic_wait::wait(&words[i], 0);
                }
                let hop = done.fetch_add(1, Ordering::AcqRel);
                let next = &words[(i + 1) % words.len()];
                next.store(1, Ordering::Release);
                atomic_wait::wake_one(next);
                // Each thread leaves after passing the turn on past the end,
                // so the next one wakes and leaves too.
                if hop >= hops {
                    return;
                }
            });
        }
        words[0].store(1, Ordering::Release);
        atomic_wait::wake_one(&words[0]);
    });
    started.elapsed()
}

/// The seen-id window every local publish (once federating) and every
/// received record goes through: a full window of 100,000 ids, then fresh
/// UUIDv7 ids claimed and settled (a hub's receive), or inserted (a publish).
fn dedup(c: &mut Criterion) {
    use keyop_core::dedup::SeenIds;
    const WINDOW: usize = 100_000;
    let ids: Vec<String> = (0..WINDOW * 4).map(|_| new_id()).collect();
    let mut g = c.benchmark_group("dedup");
    g.throughput(Throughput::Elements(1));
    let seen = SeenIds::new(WINDOW);
    for id in &ids[..WINDOW] {
        seen.insert(id);
    }
    let mut next = ids.iter().cycle();
    g.bench_function("insert", |b| {
        b.iter(|| seen.insert(next.next().expect("endless")))
    });
    g.bench_function("claim_settle", |b| {
        b.iter(|| {
            let id = next.next().expect("endless");
            black_box(seen.claim(id));
            seen.settle(id, true);
        })
    });
    // As a hub and a publishing client use it: a batch of ids per lock.
    g.throughput(Throughput::Elements(1000));
    let mut batches = ids.chunks(1000).cycle();
    g.bench_function("insert_batch_1000", |b| {
        b.iter(|| {
            let batch = batches.next().expect("endless");
            seen.insert_each(batch)
        })
    });
    g.bench_function("claim_settle_batch_1000", |b| {
        b.iter(|| {
            let batch = batches.next().expect("endless");
            black_box(seen.contains_each(batch.iter().map(String::as_str)));
            black_box(seen.claim_each(batch.iter().map(String::as_str)));
            seen.settle_each(batch.iter().map(String::as_str), true);
        })
    });
    g.finish();
}

fn config() -> Criterion {
    // Shorter than criterion's defaults (3 s + 5 s) to keep the suite to a
    // couple of minutes; --warm-up-time and --measurement-time override.
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = envelope, append, reader, time_seek, wire, probe, dedup
}
criterion_main!(benches);
