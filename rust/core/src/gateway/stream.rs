//! Reading channels for clients: start positions, Server-Sent Events and
//! long-poll JSON. Every position handed out (an SSE event's `id:`, a long
//! poll's `next`) is the global offset just past a record: the place to
//! resume from.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::{Bytes, Frame, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::reply::{self as http, Body, Refusal};
use super::State;
use crate::envelope::Envelope;
use crate::storage::{ChannelWriter, Item, LogReader};
use crate::StartPosition;

/// Interval of SSE comments on a quiet stream (keeps proxies and the idle
/// timeout from closing it while the client reads): 15 s, or a third of a
/// shorter idle timeout.
fn heartbeat(state: &State) -> Duration {
    Duration::from_secs(15).min(Duration::from_millis(state.cfg.idle_timeout_ms.max(3) / 3))
}
/// Records read per step of a stream.
pub(super) const STEP: usize = 256;
/// Bytes of records read per step of a stream (SSE, WebSocket): a step
/// stops once it holds this much, or after one record larger than it, so a
/// stream buffers a few steps of at most this plus one record, whatever the
/// records' size.
pub(super) const STEP_BYTES: usize = 256 * 1024;
/// Largest `limit` of a long poll.
pub const MAX_LIMIT: usize = 1000;
/// Bytes of records an answer of a long poll holds at most (plus one record
/// when a single record is larger): the client reads on from its `next`.
pub const ANSWER_BYTES: usize = 1024 * 1024;
/// Batches an SSE stream queues for its connection.
const SSE_QUEUE: usize = 2;

/// Parses `earliest`, `latest`, a byte offset or an RFC 3339 time (one
/// before 1677 is `earliest`, one after 2262 `latest`).
pub(super) fn parse_position(text: &str) -> Result<StartPosition, Refusal> {
    match text {
        "earliest" => Ok(StartPosition::Earliest),
        "latest" => Ok(StartPosition::Latest),
        t if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) => t
            .parse()
            .map(StartPosition::Offset)
            .map_err(|e| bad(format!("offset {t:?}: {e}"))),
        t => match chrono::DateTime::parse_from_rfc3339(t) {
            // Times are nanoseconds since 1970 in 64 bits (years 1677 to
            // 2262): a time beyond is before or after every record.
            Ok(d) => Ok(d.timestamp_nanos_opt().map(StartPosition::Time).unwrap_or(
                if d.timestamp() < 0 {
                    StartPosition::Earliest
                } else {
                    StartPosition::Latest
                },
            )),
            Err(_) => Err(bad(format!(
                "position {t:?} is not earliest, latest, a byte offset or an ISO 8601 time \
                 such as 2026-11-27T08:00:00Z"
            ))),
        },
    }
}

fn bad(message: String) -> Refusal {
    Refusal::new(StatusCode::BAD_REQUEST, "invalid", message)
}

/// A stream slot, released (and the gauge and its client's count lowered)
/// when dropped.
pub(super) struct Slot {
    _permit: OwnedSemaphorePermit,
    state: Arc<State>,
    who: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.state
            .counters
            .streams_open
            .fetch_sub(1, Ordering::Relaxed);
        let mut by = self
            .state
            .streams_by
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = by.get_mut(&self.who) {
            *n -= 1;
            if *n == 0 {
                by.remove(&self.who);
            }
        }
    }
}

/// Most streams one client (certificate CN or token) may hold: a quarter of
/// `gateway.max_streams` (at least one), so one client cannot take them all.
pub(super) fn streams_per_client(state: &State) -> usize {
    (state.cfg.max_streams / 4).max(1)
}

/// A stream slot for the client `who`: 503 when `gateway.max_streams` are
/// open, 429 when `who` holds its share ([`streams_per_client`]).
pub(super) fn take_slot(state: &Arc<State>, who: &str) -> Result<Slot, Refusal> {
    let permit = state
        .streams
        .clone()
        .try_acquire_owned()
        .map_err(|_| http::too_many_streams(state))?;
    {
        let mut by = state.streams_by.lock().unwrap_or_else(|e| e.into_inner());
        let share = streams_per_client(state);
        let n = by.entry(who.to_owned()).or_insert(0);
        if *n >= share {
            let mut r = Refusal::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_streams",
                format!(
                    "{who} has {n} streams open, its share of gateway.max_streams \
                     (a quarter of {}: {share}); close one first",
                    state.cfg.max_streams
                ),
            );
            r.retry_after = Some(1);
            return Err(r);
        }
        *n += 1;
    }
    state.counters.streams_open.fetch_add(1, Ordering::Relaxed);
    Ok(Slot {
        _permit: permit,
        state: state.clone(),
        who: who.to_owned(),
    })
}

/// A reader of `channel` at `pos` and its writer. With `create` (the
/// client's list names the channel) reading creates it, as a local
/// subscribe does, so a client may listen before the first message;
/// otherwise a channel that does not exist is a 404.
///
/// A resume position whose data retention deleted (below the oldest record
/// kept) is not refused: the reader starts there, so its first item is the
/// gap up to the oldest record kept (SSE `event: gap`, a long poll's `gaps`),
/// and goes on from that record. A position past the end or inside a
/// record is still refused (400).
pub(super) fn open_reader(
    state: &State,
    channel: &str,
    pos: StartPosition,
    create: bool,
) -> Result<(LogReader, Arc<ChannelWriter>), Refusal> {
    let engine = state.engine.upgrade().ok_or_else(|| {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "closed",
            "the messenger is closed",
        )
    })?;
    match engine.open_reader(channel, pos, create) {
        Ok(r) => Ok(r),
        Err(e) => {
            if let StartPosition::Offset(o) = pos {
                if let Ok((mut reader, writer)) =
                    engine.open_reader(channel, StartPosition::Earliest, create)
                {
                    if o < reader.position() {
                        reader.seek(o);
                        return Ok((reader, writer));
                    }
                }
            }
            Err(http::engine_refusal(&e))
        }
    }
}

/// One readable item of a channel, as clients see it.
pub(super) enum Event {
    Record {
        offset: u64,
        next: u64,
        line: Vec<u8>,
    },
    Gap {
        from: u64,
        to: u64,
    },
}

/// Reads at most `max` records (and the gaps among them) up to the
/// committed end, stopping once the records read hold `max_bytes` or more
/// (always at least one record, so a record larger than `max_bytes` still
/// goes). Records that are not valid
/// envelopes are skipped (the subscriber path quarantines them).
pub(super) fn read_events(
    reader: &mut LogReader,
    writer: &ChannelWriter,
    max: usize,
    max_bytes: usize,
) -> std::io::Result<Vec<Event>> {
    let limit = writer.committed_end();
    let mut out = Vec::new();
    let (mut records, mut bytes) = (0usize, 0usize);
    while records < max && bytes < max_bytes {
        let Some(item) = reader.next_item(limit)? else {
            break;
        };
        let next = item.next_offset();
        match item {
            Item::Record { offset, line, .. } => {
                if Envelope::decode(&line).is_ok() {
                    bytes += line.len();
                    records += 1;
                    out.push(Event::Record { offset, next, line });
                }
            }
            Item::Gap { from, to } => out.push(Event::Gap { from, to }),
            Item::Oversize { .. } => {}
        }
    }
    Ok(out)
}

/// A response body fed by a task through a channel; dropping it (the
/// client went away) ends the task's sends.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// `GET .../messages` with `Accept: text/event-stream`: events from
/// `Last-Event-ID` (a reconnect) or `from` (default `latest`).
pub(super) async fn sse(
    state: &Arc<State>,
    who: &str,
    channel: &str,
    req: &Request<Incoming>,
    create: bool,
) -> Result<Response<Body>, Refusal> {
    let q = http::query(req);
    let pos = match http::header_str(req, "last-event-id") {
        Some(id) => StartPosition::Offset(id.trim().parse().map_err(|_| {
            bad(format!(
                "Last-Event-ID {id:?} is not a position this gateway sent"
            ))
        })?),
        None => parse_position(http::param(&q, "from").unwrap_or("latest"))?,
    };
    let slot = take_slot(state, who)?;
    let (reader, writer) = open_reader(state, channel, pos, create)?;
    let (tx, rx) = mpsc::channel::<Bytes>(SSE_QUEUE);
    let st = state.clone();
    tokio::spawn(async move {
        let _slot = slot;
        sse_loop(st, reader, writer, tx).await;
    });
    let mut resp = Response::new(ChannelBody { rx }.boxed());
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(resp)
}

async fn sse_loop(
    state: Arc<State>,
    mut reader: LogReader,
    writer: Arc<ChannelWriter>,
    tx: mpsc::Sender<Bytes>,
) {
    // The position first, so a client knows where it stands before any record.
    let hello = format!("retry: 2000\nid: {}\n\n", reader.position());
    if tx.send(Bytes::from(hello)).await.is_err() {
        return;
    }
    loop {
        let events = match tokio::task::block_in_place(|| {
            read_events(&mut reader, &writer, STEP, STEP_BYTES)
        }) {
            Ok(e) => e,
            Err(e) => {
                log::error!("gateway: cannot read channel {:?}: {e}", writer.channel());
                let _ = tx
                    .send(Bytes::from(format!(
                        "event: error\ndata: {{\"message\":{:?}}}\n\n",
                        e.to_string()
                    )))
                    .await;
                return;
            }
        };
        if !events.is_empty() {
            let mut buf = Vec::new();
            let mut n = 0u64;
            for ev in events {
                match ev {
                    Event::Record { next, line, .. } => {
                        buf.extend_from_slice(format!("id: {next}\ndata: ").as_bytes());
                        buf.extend_from_slice(&line);
                        buf.extend_from_slice(b"\n\n");
                        n += 1;
                    }
                    Event::Gap { from, to } => buf.extend_from_slice(
                        format!("event: gap\nid: {to}\ndata: {{\"from\":{from},\"to\":{to}}}\n\n")
                            .as_bytes(),
                    ),
                }
            }
            tokio::select! {
                _ = state.cancel.cancelled() => return,
                r = tx.send(Bytes::from(buf)) => if r.is_err() { return },
            }
            state.counters.delivered.fetch_add(n, Ordering::Relaxed);
            continue;
        }
        tokio::select! {
            _ = state.cancel.cancelled() => return,
            _ = tx.closed() => return,
            _ = writer.notifier().changed_past(reader.position()) => {
                if writer.notifier().committed_end() <= reader.position() {
                    // The channel was closed (the messenger is closing).
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            _ = tokio::time::sleep(heartbeat(&state)) => {
                if tx.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// `GET .../messages` without SSE: up to `limit` records after position
/// `after` (or from `from`), waiting up to `wait` seconds for the first.
pub(super) async fn long_poll(
    state: &Arc<State>,
    who: &str,
    channel: &str,
    req: &Request<Incoming>,
    create: bool,
) -> Result<Response<Body>, Refusal> {
    let q = http::query(req);
    let pos = match (http::param(&q, "after"), http::param(&q, "from")) {
        (Some(a), _) => StartPosition::Offset(
            a.parse()
                .map_err(|_| bad(format!("after={a:?} is not a position (a byte offset)")))?,
        ),
        (None, Some(f)) => parse_position(f)?,
        (None, None) => StartPosition::Earliest,
    };
    let limit = match http::param(&q, "limit") {
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| bad(format!("limit={l:?} must be between 1 and {MAX_LIMIT}")))?,
        None => 100,
    };
    let wait = match http::param(&q, "wait") {
        Some(w) => w
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            // Beyond what a Duration holds is as long as the longest wait.
            .map(|s| Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX))
            .ok_or_else(|| bad(format!("wait={w:?} must be a number of seconds >= 0")))?,
        None => Duration::ZERO,
    }
    .min(http::max_wait(state));
    let _slot = take_slot(state, who)?;
    let (mut reader, writer) = open_reader(state, channel, pos, create)?;
    let deadline = tokio::time::Instant::now() + wait;
    let events = loop {
        let events =
            tokio::task::block_in_place(|| read_events(&mut reader, &writer, limit, ANSWER_BYTES))
                .map_err(|e| {
                    Refusal::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "storage",
                        format!("cannot read channel {channel:?}: {e}"),
                    )
                })?;
        if !events.is_empty() || tokio::time::Instant::now() >= deadline {
            break events;
        }
        tokio::select! {
            _ = state.cancel.cancelled() => break events,
            _ = writer.notifier().changed_past(reader.position()) => {
                if writer.notifier().committed_end() <= reader.position() {
                    break events;
                }
            }
            _ = tokio::time::sleep_until(deadline) => {}
        }
    };
    let mut out = Vec::with_capacity(events.len());
    let mut gaps = Vec::new();
    for ev in events {
        match ev {
            Event::Record { offset, next, line } => {
                let raw = serde_json::value::RawValue::from_string(
                    String::from_utf8_lossy(&line).into_owned(),
                );
                if let Ok(raw) = raw {
                    out.push(serde_json::json!({"offset": offset, "next": next, "message": raw}));
                }
            }
            Event::Gap { from, to } => gaps.push(serde_json::json!({"from": from, "to": to})),
        }
    }
    state
        .counters
        .delivered
        .fetch_add(out.len() as u64, Ordering::Relaxed);
    let body = serde_json::json!({
        "messages": out,
        "gaps": gaps,
        "next": reader.position(),
    });
    Ok(http::json(StatusCode::OK, &body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_beyond_the_nanosecond_range_are_the_ends() {
        assert!(matches!(
            parse_position("9999-12-31T23:59:59Z"),
            Ok(StartPosition::Latest)
        ));
        assert!(matches!(
            parse_position("0000-01-01T00:00:00Z"),
            Ok(StartPosition::Earliest)
        ));
        assert!(matches!(
            parse_position("2026-11-27T08:00:00+01:00"),
            Ok(StartPosition::Time(_))
        ));
        assert!(parse_position("tomorrow").is_err());
    }
}
