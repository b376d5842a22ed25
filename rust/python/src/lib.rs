//! `keyop_messenger._core`: the PyO3 face of keyop-core.
//! why this file is long: every class of the module (engine, messenger base,
//! subscriptions, record iterator, ephemeral client) is a thin, independent
//! wrapper; they share the conversion helpers here.
//!
//! Thin by design: argument conversion, GIL release around every blocking
//! step, and error mapping (in `errors`). No engine logic lives here.

mod columns;
mod errors;
mod json;
mod keygen;
mod message;
mod receipt;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use keyop_core::engine::encode_message_with_id;
use keyop_core::federation::ephemeral::{EphemeralClient as EphemeralCore, EphemeralConfig};
use keyop_core::storage::{ChannelWriter, FaultPoint, Item, LogReader};
use keyop_core::{
    BatchOutcome, Delivery, Engine, Envelope, EnvelopeRef, Failure, Handler, Outgoing,
    RetentionConfig, RetentionLimits, StartPosition, StoreConfig, SubscribeOptions, Subscriber,
};
use pyo3::exceptions::{PyRuntimeError, PyUnicodeEncodeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};

use errors::{new_err, IntoPyResult, Kind};
use json::PyDecoder;

/// Runs `wait(interrupted)` with the GIL released; `interrupted` checks for
/// Python signals (Ctrl-C) every time the engine asks (every ~100 ms), so a
/// bounded wait can be cut short. A signal's exception (e.g.
/// KeyboardInterrupt) is raised after `wait` returns, instead of its result.
fn interruptible<T: Send>(
    py: Python<'_>,
    wait: impl FnOnce(&mut dyn FnMut() -> bool) -> T + Send,
) -> PyResult<T> {
    let mut raised: Option<PyErr> = None;
    let out = py.detach(|| {
        let mut check = || {
            if raised.is_none() {
                raised = Python::attach(|py| py.check_signals()).err();
            }
            raised.is_some()
        };
        wait(&mut check)
    });
    match raised {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// A gap met by a reader of `channel` (bytes `from..to` are gone): reported
/// (counted and logged) now, and the `DataLossError` the reader raises unless
/// asked to skip gaps.
pub(crate) fn reader_gap(py: Python<'_>, channel: &str, from: u64, to: u64) -> PyErr {
    keyop_core::storage::quarantine::report_gap(channel, "a reader", from, to);
    new_err(
        py,
        Kind::DataLoss,
        format!(
            "channel {channel:?}: bytes {from}..{to} are gone (deleted by retention, or a \
             segment was removed or truncated); read from offset {to}, or with \
             skip_gaps=True, to go on past them"
        ),
    )
}

/// A configuration section handed over as JSON; `ConfigError` naming `what`
/// if it does not parse.
fn section<T: serde::de::DeserializeOwned>(py: Python<'_>, json: &str, what: &str) -> PyResult<T> {
    serde_json::from_str(json).map_err(|e| new_err(py, Kind::Config, format!("{what}: {e}")))
}

/// The longest wait a timeout gives: a century. Longer finite timeouts (up to
/// `1e308`) wait this long, the same in practice, rather than overflowing the
/// clock arithmetic of the waits.
const LONGEST_WAIT: Duration = Duration::from_secs(100 * 365 * 86_400);

/// `timeout_s` (seconds, None: the engine's default) as a duration.
pub(crate) fn timeout_or(timeout_s: Option<f64>, default: Duration) -> PyResult<Duration> {
    match timeout_s {
        None => Ok(default),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Duration::try_from_secs_f64(t)
            .unwrap_or(LONGEST_WAIT)
            .min(LONGEST_WAIT)),
        Some(t) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "timeout must be a finite number of seconds >= 0, got {t}"
        ))),
    }
}

/// A local messenger instance: a data directory and an instance name.
#[pyclass(module = "keyop_messenger._core", name = "Engine", frozen)]
struct PyEngine {
    engine: Arc<Engine>,
}

/// One message read from a channel, as a plain tuple:
/// `(offset, segment, id, ts_nanos, channel, origin, payload_type,
///   service_name, correlation_id, payload)`; the payload is decoded JSON.
type Row<'py> = (
    u64,
    u64,
    String,
    i64,
    String,
    String,
    String,
    Option<String>,
    Option<String>,
    Bound<'py, PyAny>,
);

/// Encodes `(payload_type, payload)` tuples of a batch.
fn encode_items(
    py: Python<'_>,
    items: &Bound<'_, PyAny>,
    default: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<(String, Vec<u8>)>> {
    let mut encoded = Vec::new();
    for item in items.try_iter()? {
        let item = item?;
        let pair = item.cast::<PyTuple>().map_err(|_| {
            new_err(
                py,
                Kind::PayloadType,
                "publish_batch items must be (payload_type, payload) tuples".into(),
            )
        })?;
        if pair.len() != 2 {
            return Err(new_err(
                py,
                Kind::PayloadType,
                format!(
                    "publish_batch items must be 2-tuples, got {} elements",
                    pair.len()
                ),
            ));
        }
        let payload_type: String = pair.get_item(0)?.extract()?;
        let json = encode_payload(&pair.get_item(1)?, default)?;
        encoded.push((payload_type, json));
    }
    Ok(encoded)
}

/// `(payload_type, payload JSON)` pairs borrowed from encoded items.
fn borrowed(owned: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    owned
        .iter()
        .map(|(t, j)| (t.as_str(), j.as_slice()))
        .collect()
}

/// The ids a `PayloadBatch` given as items carries, if any.
fn batch_ids(items: &Bound<'_, PyAny>) -> Option<Vec<String>> {
    items
        .cast::<columns::PayloadBatch>()
        .ok()
        .and_then(|b| b.get().ids.clone())
}

fn encode_payload(
    payload: &Bound<'_, PyAny>,
    default: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<u8>> {
    let mut out = Vec::with_capacity(128);
    json::write_json(payload, &mut out, default, 0)?;
    Ok(out)
}

/// What `Messenger.publish` needs, bound once by `Messenger.__init__`.
struct PublishPath {
    engine: Arc<Engine>,
    /// The payload registry's dict of registered types.
    registry: Py<PyDict>,
    /// `check(payload_type, payload, encoded)`: raises if a registered type's
    /// payload does not match it; `encoded` is the payload's JSON as the
    /// engine will store it (`None` when encoding failed).
    check: Py<PyAny>,
    /// `get` of the `ContextVar` holding `(service_name, correlation_id)`.
    context_get: Py<PyAny>,
    /// Turns payload objects JSON has no form for into plain data.
    default: Py<PyAny>,
    /// `unicode_error(exc, **texts)`: the library error for text that is not
    /// valid Unicode.
    unicode_error: Py<PyAny>,
}

/// Base class of `Messenger`: its `publish`, the hot path, runs here without
/// a Python frame.
#[pyclass(
    module = "keyop_messenger._core",
    name = "MessengerBase",
    subclass,
    frozen
)]
struct MessengerBase {
    path: OnceLock<PublishPath>,
}

/// `text` (a `str` or None) as UTF-8.
fn opt_str<'a>(text: &'a Bound<'_, PyAny>) -> PyResult<Option<&'a str>> {
    if text.is_none() {
        Ok(None)
    } else {
        Ok(Some(text.cast::<PyString>()?.to_str()?))
    }
}

/// How `publish` hands a message to the engine.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Handover {
    /// Returns once committed (`wait=True`).
    Commit,
    /// Returns a receipt at once (`wait=False`).
    Receipt,
    /// As `Receipt`, but the commit starts on `Submitted::release` (the
    /// asyncio completer releases once per pass of its event loop).
    Held,
}

/// `publish`'s arguments, as Python gave them.
struct PublishArgs<'a, 'py> {
    channel: &'a Bound<'py, PyAny>,
    payload_type: &'a Bound<'py, PyAny>,
    payload: &'a Bound<'py, PyAny>,
    service_name: Option<&'a Bound<'py, PyAny>>,
    correlation_id: Option<&'a Bound<'py, PyAny>>,
}

/// What `send` gives back: the committed id, or the submitted message.
enum Sent<'py> {
    Id(Bound<'py, PyAny>),
    Submitted(keyop_core::Submitted),
}

impl MessengerBase {
    /// `publish` once the context is resolved and the registry consulted:
    /// encodes, then commits with the GIL released, and returns the id (or
    /// the submitted message at once, see [`Handover`]). Text that is not
    /// valid Unicode fails with `UnicodeEncodeError`.
    ///
    /// A durable publish from Python's main thread is handed to the channel's
    /// committer thread and waited for in slices, so Ctrl-C is honoured even
    /// while an fdatasync takes long; other threads commit inline (group
    /// commit, no hand-off).
    ///
    /// A payload of a registered type is checked on the JSON encoded here,
    /// the form its subscribers will decode.
    fn send<'py>(
        py: Python<'py>,
        path: &PublishPath,
        texts: [&Bound<'py, PyAny>; 4],
        payload: &Bound<'py, PyAny>,
        handover: Handover,
    ) -> PyResult<Sent<'py>> {
        let [channel, payload_type, service_name, correlation_id] = texts;
        let channel = channel.cast::<PyString>()?.to_str()?;
        let registry = path.registry.bind(py);
        let registered = !registry.is_empty() && registry.contains(payload_type)?;
        let json = match encode_payload(payload, Some(path.default.bind(py))) {
            Ok(json) => json,
            Err(e) => {
                if registered {
                    // A payload of the wrong class is named as such, not by
                    // what could not be encoded in it.
                    path.check.call1(py, (payload_type, payload, py.None()))?;
                }
                return Err(e);
            }
        };
        if registered {
            let encoded = PyBytes::new(py, &json);
            path.check.call1(py, (payload_type, payload, encoded))?;
        }
        let msg = Outgoing {
            payload_type: payload_type.cast::<PyString>()?.to_str()?,
            payload_json: &json,
            service_name: opt_str(service_name)?,
            correlation_id: opt_str(correlation_id)?,
        };
        match handover {
            Handover::Receipt => {
                let sub = py.detach(|| path.engine.submit(channel, &msg)).py_err(py)?;
                return Ok(Sent::Submitted(sub));
            }
            Handover::Held => {
                let sub = py
                    .detach(|| path.engine.submit_held(channel, &msg))
                    .py_err(py)?;
                return Ok(Sent::Submitted(sub));
            }
            Handover::Commit => {}
        }
        if path.engine.durable() && receipt::on_main_thread(py)? {
            let sub = py.detach(|| path.engine.submit(channel, &msg)).py_err(py)?;
            let published = receipt::wait_interruptibly(py, &sub, None)?
                .expect("no limit: waits until the outcome is known");
            return Ok(Sent::Id(PyString::new(py, &published.id).into_any()));
        }
        // Relaxed mode: a write that needs no wait is done holding the GIL,
        // rather than letting it go and contending for it back (which, with
        // several publishing threads, costs a context switch per message).
        let published = path
            .engine
            .publish_via(channel, &msg, |append| py.detach(append))
            .py_err(py)?;
        Ok(Sent::Id(PyString::new(py, &published.id).into_any()))
    }

    /// `publish`'s body: the context, then [`Self::send`].
    fn publish_as<'py>(
        &self,
        py: Python<'py>,
        args: PublishArgs<'_, 'py>,
        handover: Handover,
    ) -> PyResult<Sent<'py>> {
        let PublishArgs {
            channel,
            payload_type,
            payload,
            service_name,
            correlation_id,
        } = args;
        let Some(path) = self.path.get() else {
            return Err(new_err(
                py,
                Kind::Closed,
                "this messenger was not set up (Messenger.__init__ did not finish)".into(),
            ));
        };
        // None (or left out) means: from the enclosing context() block.
        let given = |t: Option<&Bound<'py, PyAny>>| t.filter(|t| !t.is_none()).cloned();
        let (mut service_name, mut correlation_id) = (given(service_name), given(correlation_id));
        if service_name.is_none() || correlation_id.is_none() {
            let ctx = path.context_get.bind(py).call0()?;
            let ctx = ctx.cast::<PyTuple>()?;
            if service_name.is_none() {
                service_name = Some(ctx.get_item(0)?);
            }
            if correlation_id.is_none() {
                correlation_id = Some(ctx.get_item(1)?);
            }
        }
        let none = py.None().into_bound(py);
        let texts = [
            channel,
            payload_type,
            service_name.as_ref().unwrap_or(&none),
            correlation_id.as_ref().unwrap_or(&none),
        ];
        match Self::send(py, path, texts, payload, handover) {
            Err(e) if e.is_instance_of::<PyUnicodeEncodeError>(py) => {
                let named = PyDict::new(py);
                for (key, text) in ["channel", "payload_type", "service_name", "correlation_id"]
                    .into_iter()
                    .zip(texts)
                {
                    named.set_item(key, text)?;
                }
                let mapped = path
                    .unicode_error
                    .bind(py)
                    .call((e.value(py),), Some(&named))?;
                Err(PyErr::from_value(mapped))
            }
            r => r,
        }
    }
}

#[pymethods]
impl MessengerBase {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        MessengerBase {
            path: OnceLock::new(),
        }
    }

    /// Binds `publish` to `engine`, once.
    fn _bind_publish(
        &self,
        engine: &PyEngine,
        registry: Bound<'_, PyDict>,
        check: Bound<'_, PyAny>,
        context: Bound<'_, PyAny>,
        default: Bound<'_, PyAny>,
        unicode_error: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let path = PublishPath {
            engine: engine.engine.clone(),
            registry: registry.unbind(),
            check: check.unbind(),
            context_get: context.getattr(intern!(context.py(), "get"))?.unbind(),
            default: default.unbind(),
            unicode_error: unicode_error.unbind(),
        };
        self.path
            .set(path)
            .map_err(|_| PyRuntimeError::new_err("publish is already bound"))
    }

    /// Publishes one message and returns its id once it is committed.
    ///
    /// `service_name` and `correlation_id` default to those of the enclosing
    /// `keyop_messenger.context()` block. Raises `InvalidNameError` for a bad
    /// channel name, `PayloadTypeError` if the payload does not match its
    /// registered type or is not JSON-encodable, `MessageTooLargeError` over
    /// 10 MiB, `StorageError` if it was not committed, and `ClosedError`
    /// after `close()`.
    ///
    /// With `wait=False` it returns a `Receipt` as soon as the message is
    /// handed to the channel's committer: its `wait()` returns the id once
    /// committed (or raises what `publish` would have raised).
    #[pyo3(signature = (channel, payload_type, payload, *, service_name = None, correlation_id = None, wait = true))]
    #[allow(clippy::too_many_arguments)]
    fn publish<'py>(
        &self,
        py: Python<'py>,
        channel: &Bound<'py, PyAny>,
        payload_type: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyAny>,
        service_name: Option<&Bound<'py, PyAny>>,
        correlation_id: Option<&Bound<'py, PyAny>>,
        wait: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let handover = if wait {
            Handover::Commit
        } else {
            Handover::Receipt
        };
        let args = PublishArgs {
            channel,
            payload_type,
            payload,
            service_name,
            correlation_id,
        };
        match self.publish_as(py, args, handover)? {
            Sent::Id(id) => Ok(id),
            Sent::Submitted(sub) => {
                let receipt = receipt::Receipt { sub: Arc::new(sub) };
                Ok(Bound::new(py, receipt)?.into_any())
            }
        }
    }
}

impl PyEngine {
    /// Appends framed records, as durable or relaxed as the instance: from
    /// the main thread a durable commit is waited for in slices, so Ctrl-C
    /// interrupts it (as in `send`).
    fn publish_framed(&self, py: Python<'_>, framed: keyop_core::Framed) -> PyResult<()> {
        if self.engine.durable() && receipt::on_main_thread(py)? {
            let submitted = py.detach(|| self.engine.submit_framed(framed)).py_err(py)?;
            if let Some(sub) = submitted {
                receipt::wait_interruptibly(py, &sub, None)?;
            }
            return Ok(());
        }
        py.detach(|| self.engine.publish_framed(framed))
            .py_err(py)?;
        Ok(())
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (data_dir, name, *, sync_interval_ms = 0, segment_bytes = 0))]
    fn new(
        py: Python<'_>,
        data_dir: PathBuf,
        name: &str,
        sync_interval_ms: u64,
        segment_bytes: u64,
    ) -> PyResult<Self> {
        let cfg = StoreConfig {
            data_dir,
            sync_interval_ms,
            segment_bytes,
        };
        let engine = py.detach(|| Engine::open(cfg, name)).py_err(py)?;
        Ok(PyEngine {
            engine: Arc::new(engine),
        })
    }

    /// The instance name written as `origin`.
    #[getter]
    fn name(&self) -> &str {
        self.engine.origin()
    }

    /// Publishes `(payload_type, payload)` pairs with one write and one
    /// fsync, all or none; returns their ids in order. `ids`: one valid id
    /// per item, given by the caller (default: new ids).
    #[pyo3(signature = (channel, items, service_name = None, correlation_id = None, default = None, ids = None))]
    #[allow(clippy::too_many_arguments)]
    fn publish_batch(
        &self,
        py: Python<'_>,
        channel: &str,
        items: &Bound<'_, PyAny>,
        service_name: Option<&str>,
        correlation_id: Option<&str>,
        default: Option<&Bound<'_, PyAny>>,
        ids: Option<Vec<String>>,
    ) -> PyResult<Vec<String>> {
        let owned;
        let encoded = match items.cast::<columns::PayloadBatch>() {
            Ok(batch) => batch.get().pairs(),
            Err(_) => {
                owned = encode_items(py, items, default)?;
                borrowed(&owned)
            }
        };
        let ids = ids.or_else(|| batch_ids(items));
        let msgs: Vec<Outgoing<'_>> = encoded
            .iter()
            .map(|&(t, j)| Outgoing {
                payload_type: t,
                payload_json: j,
                service_name,
                correlation_id,
            })
            .collect();
        let origin = self.engine.origin();
        let framed = py
            .detach(|| keyop_core::frame_batch(origin, channel, &msgs, ids.as_deref()))
            .py_err(py)?;
        let ids = framed.ids().to_vec();
        self.publish_framed(py, framed)?;
        Ok(ids)
    }

    /// Appends records framed ahead by `encode_records` for this instance,
    /// with one write and one fsync, all or none, as `publish_batch` does.
    /// With `wait=False`, hands them to the channel's committer thread and
    /// returns at once a `Receipt` (under the last record's id; None for an
    /// empty batch) whose `wait()` gives the outcome.
    #[pyo3(name = "publish_framed", signature = (batch, wait = true))]
    fn py_publish_framed(
        &self,
        py: Python<'_>,
        batch: &columns::FramedBatch,
        wait: bool,
    ) -> PyResult<Option<receipt::Receipt>> {
        let framed = batch.take()?;
        if wait {
            self.publish_framed(py, framed)?;
            return Ok(None);
        }
        let submitted = py.detach(|| self.engine.submit_framed(framed)).py_err(py)?;
        Ok(submitted.map(|sub| receipt::Receipt { sub: Arc::new(sub) }))
    }

    /// Committed end (global byte offset) of `channel`.
    fn stream_end(&self, py: Python<'_>, channel: &str) -> PyResult<u64> {
        let (_, writer) = py.detach(|| self.engine.reader(channel, 0)).py_err(py)?;
        Ok(writer.map_or(0, |w| w.committed_end()))
    }

    /// Global offset of the record boundary a position names in `channel`:
    /// `kind` is "earliest", "latest", "offset" (`value` a byte offset) or
    /// "time" (`value` Unix nanoseconds: the first record at or after it).
    fn resolve_position(
        &self,
        py: Python<'_>,
        channel: &str,
        kind: &str,
        value: i64,
    ) -> PyResult<u64> {
        let pos = start_position(kind, value)?;
        py.detach(|| self.engine.resolve_position(channel, pos))
            .py_err(py)
    }

    /// Reads committed records of `channel` from `start_offset`, up to (not
    /// including) the record at `until` if given. A gap raises
    /// `DataLossError` unless `skip_gaps`; a channel that does not exist
    /// raises `ChannelNotFoundError` (nothing is created).
    #[pyo3(signature = (channel, start_offset = 0, *, skip_gaps = false, until = None))]
    fn read(
        &self,
        py: Python<'_>,
        channel: &str,
        start_offset: u64,
        skip_gaps: bool,
        until: Option<u64>,
    ) -> PyResult<RecordIter> {
        let (reader, writer) = py
            .detach(|| self.engine.read_at(channel, start_offset))
            .py_err(py)?;
        Ok(RecordIter {
            limit: Limit::Committed(Some(writer)),
            reader,
            decoder: PyDecoder::default(),
            data_dir: self.engine.store().data_dir().to_owned(),
            channel: channel.to_owned(),
            skip_gaps,
            until: until.unwrap_or(u64::MAX),
        })
    }

    /// Writer counters of `channel` (records, appends, batches, writes,
    /// fsyncs, bytes, rolls, failures).
    fn _counters<'py>(&self, py: Python<'py>, channel: &str) -> PyResult<Bound<'py, PyDict>> {
        let c = self.writer(py, channel)?.counters();
        let d = PyDict::new(py);
        for (k, v) in [
            ("records", c.records),
            ("appends", c.appends),
            ("batches", c.batches),
            ("writes", c.writes),
            ("fsyncs", c.fsyncs),
            ("bytes", c.bytes),
            ("rolls", c.rolls),
            ("failures", c.failures),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Test hook: fail the next `count` I/O steps of `kind` ("write",
    /// "sync" or "roll") on `channel`; a failing write first writes
    /// `partial` bytes. `errno` (write and sync) picks the OS error instead
    /// of ENOSPC (write) or EIO (sync). `delay_ms` (sync): the fdatasync
    /// takes that much longer and succeeds (a stalled disk).
    #[pyo3(signature = (channel, kind, count = 1, partial = 0, errno = 0, delay_ms = 0))]
    #[allow(clippy::too_many_arguments)]
    fn _inject_fault(
        &self,
        py: Python<'_>,
        channel: &str,
        kind: &str,
        count: u32,
        partial: usize,
        errno: i32,
        delay_ms: u64,
    ) -> PyResult<()> {
        let point = match kind {
            "sync" if delay_ms != 0 => FaultPoint::SyncDelay { ms: delay_ms },
            "write" if errno != 0 => FaultPoint::WriteErrno { partial, errno },
            "sync" if errno != 0 => FaultPoint::SyncErrno { errno },
            "write" => FaultPoint::Write { partial },
            "sync" => FaultPoint::Sync,
            "roll" => FaultPoint::Roll,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown fault kind {other:?}; use 'write', 'sync' or 'roll'"
                )))
            }
        };
        self.writer(py, channel)?.inject_fault(point, count);
        Ok(())
    }

    /// Starts delivering `channel` to `deliver` as subscriber `subscriber_id`.
    ///
    /// `deliver(messages)` is called with a list of `Message`s (payloads
    /// decoded on first read) and returns `(handled, failure)`: how many
    /// leading messages were handled, and `None` or `(reject, error_text)`
    /// for the one after them (`reject`: dead-letter at once instead of
    /// retrying), or `(True, error_text, True)` when its payload cannot
    /// become a Python value (dead-lettered as raw text).
    ///
    /// `on_gap(from, to)` is called when bytes `from..to` the subscriber had
    /// not read are gone (delivery goes on at `to`).
    ///
    /// `start_kind`/`start_value` (see `resolve_position`) say where a
    /// subscriber without a stored offset starts; `reset` applies them even
    /// when it has one.
    #[pyo3(signature = (channel, subscriber_id, deliver, *, max_retries = 5, offset_flush_interval_ms = 0, backoff_base_ms = 100, backoff_max_ms = 5000, on_gap = None, start_kind = "latest", start_value = 0, reset = false, dead_letter = true))]
    #[allow(clippy::too_many_arguments)]
    fn subscribe(
        &self,
        py: Python<'_>,
        channel: &str,
        subscriber_id: &str,
        deliver: Py<PyAny>,
        max_retries: u32,
        offset_flush_interval_ms: u64,
        backoff_base_ms: u64,
        backoff_max_ms: u64,
        on_gap: Option<Py<PyAny>>,
        start_kind: &str,
        start_value: i64,
        reset: bool,
        dead_letter: bool,
    ) -> PyResult<Subscription> {
        let start = start_position(start_kind, start_value)?;
        let opts = SubscribeOptions {
            max_retries,
            offset_flush_interval: Duration::from_millis(offset_flush_interval_ms),
            backoff_base: Duration::from_millis(backoff_base_ms),
            backoff_max: Duration::from_millis(backoff_max_ms.max(backoff_base_ms)),
            dead_letter,
            ..SubscribeOptions::default()
        };
        let handler = PyHandler {
            deliver,
            on_gap,
            decoder: PyDecoder::default(),
        };
        let sub = py
            .detach(|| {
                self.engine
                    .subscribe_from(channel, subscriber_id, handler, opts, start, reset)
            })
            .py_err(py)?;
        Ok(Subscription {
            engine: self.engine.clone(),
            sub,
        })
    }

    /// Stops `subscriber_id` of `channel` if running and deletes its offset file.
    fn unsubscribe(&self, py: Python<'_>, channel: &str, subscriber_id: &str) -> PyResult<()> {
        py.detach(|| self.engine.unsubscribe(channel, subscriber_id))
            .py_err(py)
    }

    /// Runs the retention loop every `interval_ms` until close. `max_age_ms`
    /// and `max_bytes` delete sealed segments whether read or not (off when
    /// None); `channels` maps a channel to its own `(max_age_ms, max_bytes)`,
    /// replacing both for it.
    #[pyo3(signature = (interval_ms, max_lag_bytes = None, offset_ttl_ms = None, max_age_ms = None, max_bytes = None, channels = None))]
    #[allow(clippy::too_many_arguments)]
    fn start_retention(
        &self,
        py: Python<'_>,
        interval_ms: u64,
        max_lag_bytes: Option<u64>,
        offset_ttl_ms: Option<u64>,
        max_age_ms: Option<u64>,
        max_bytes: Option<u64>,
        channels: Option<ChannelLimits>,
    ) -> PyResult<()> {
        let cfg = retention(
            max_lag_bytes,
            offset_ttl_ms,
            max_age_ms,
            max_bytes,
            channels,
        );
        self.engine
            .start_retention(cfg, Duration::from_millis(interval_ms.max(1)))
            .py_err(py)
    }

    /// One retention pass now; returns `{channel: (segments_deleted,
    /// bytes_freed, offsets_removed)}` for channels where something happened.
    /// The retention arguments are those of `start_retention`.
    #[pyo3(signature = (max_lag_bytes = None, offset_ttl_ms = None, max_age_ms = None, max_bytes = None, channels = None))]
    fn compact<'py>(
        &self,
        py: Python<'py>,
        max_lag_bytes: Option<u64>,
        offset_ttl_ms: Option<u64>,
        max_age_ms: Option<u64>,
        max_bytes: Option<u64>,
        channels: Option<ChannelLimits>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let cfg = retention(
            max_lag_bytes,
            offset_ttl_ms,
            max_age_ms,
            max_bytes,
            channels,
        );
        let reports = py.detach(|| self.engine.compact(&cfg)).py_err(py)?;
        let d = PyDict::new(py);
        for (channel, r) in reports {
            if r.segments_deleted > 0 || !r.offsets_removed.is_empty() {
                d.set_item(
                    channel,
                    (r.segments_deleted, r.bytes_freed, r.offsets_removed),
                )?;
            }
        }
        Ok(d)
    }

    /// Starts the hub and/or client links from a JSON document with the
    /// fields of `keyop_core::federation::FedConfig`.
    /// `events(kind, hub, detail, count)` is called on a dedicated thread
    /// for every client link event (see `link_events`).
    #[pyo3(signature = (settings_json, events = None))]
    fn start_federation(
        &self,
        py: Python<'_>,
        settings_json: &str,
        events: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let mut cfg: keyop_core::federation::FedConfig = serde_json::from_str(settings_json)
            .map_err(|e| new_err(py, Kind::Config, format!("federation settings: {e}")))?;
        cfg.events = events.map(link_events);
        py.detach(|| self.engine.start_federation(cfg)).py_err(py)
    }

    /// Creates the missing forwarding cursors of the client links in
    /// `hubs_json` (a JSON list of `{"addr", "subscribe", "publish"}`) without
    /// dialing: records published from now on are forwarded once they run.
    fn create_client_cursors(&self, py: Python<'_>, hubs_json: &str) -> PyResult<()> {
        let hubs: Vec<keyop_core::federation::HubEndpoint> = serde_json::from_str(hubs_json)
            .map_err(|e| new_err(py, Kind::Config, format!("client hubs: {e}")))?;
        py.detach(|| self.engine.create_client_cursors(&hubs))
            .py_err(py)
    }

    /// Starts the HTTP gateway from a JSON document with the fields of
    /// `keyop_core::gateway::GatewayConfig`.
    fn start_gateway(&self, py: Python<'_>, settings_json: &str) -> PyResult<()> {
        let cfg: keyop_core::gateway::GatewayConfig = serde_json::from_str(settings_json)
            .map_err(|e| new_err(py, Kind::Config, format!("gateway settings: {e}")))?;
        py.detach(|| self.engine.start_gateway(cfg)).py_err(py)
    }

    /// Replaces the gateway's allowed peers and tokens (JSON lists).
    /// Raises ConfigError when no gateway is running.
    fn set_gateway_access(
        &self,
        py: Python<'_>,
        peers_json: &str,
        tokens_json: &str,
    ) -> PyResult<()> {
        let peers: Vec<keyop_core::federation::AllowedPeer> =
            section(py, peers_json, "hub.allowed_peers")?;
        let tokens: Vec<keyop_core::gateway::TokenEntry> =
            section(py, tokens_json, "gateway.tokens")?;
        self.engine
            .with_gateway(|g| g.set_access(peers, tokens))
            .ok_or_else(|| keyop_core::Error::Config("the gateway is not running".into()))
            .py_err(py)
    }

    /// `(host, port)` the gateway listens on, or None.
    #[getter]
    fn gateway_address(&self, py: Python<'_>) -> PyResult<Option<(String, u16)>> {
        self.engine.check_process().py_err(py)?;
        Ok(self
            .engine
            .with_gateway(|g| g.local_addr())
            .map(|a| (a.ip().to_string(), a.port())))
    }

    /// Replaces the hub's `allowed_peers` (JSON list of entries); returns the
    /// connected peers disconnected because their entry went or changed.
    /// Raises FederationError when no hub is running.
    fn set_allowed_peers(&self, py: Python<'_>, peers_json: &str) -> PyResult<Vec<String>> {
        let peers: Vec<keyop_core::federation::AllowedPeer> =
            section(py, peers_json, "hub.allowed_peers")?;
        py.detach(|| {
            self.engine
                .with_federation(|f| f.hub().map(|h| h.set_allowed_peers(peers)))
                .flatten()
                .ok_or_else(|| keyop_core::Error::Federation("no hub is running".into()))
        })
        .py_err(py)
    }

    /// Loads the `tls` files of `tls_json` (the `tls` section) again for new
    /// connections; established ones keep theirs. Raises FederationError when
    /// a file does not load (the running TLS stays) or no federation runs.
    fn reload_tls(&self, py: Python<'_>, tls_json: &str) -> PyResult<()> {
        let tls: keyop_core::federation::TlsSettings = section(py, tls_json, "tls")?;
        py.detach(|| {
            self.engine
                .with_federation(|f| f.reload_tls(&tls))
                .ok_or_else(|| keyop_core::Error::Federation("federation is not running".into()))?
                .map_err(|e| keyop_core::Error::Federation(e.to_string()))
        })
        .py_err(py)
    }

    /// `(host, port)` the hub listens on, or None.
    #[getter]
    fn hub_address(&self, py: Python<'_>) -> PyResult<Option<(String, u16)>> {
        self.engine.check_process().py_err(py)?;
        Ok(self
            .engine
            .with_federation(|f| f.hub_addr())
            .flatten()
            .map(|a| (a.ip().to_string(), a.port())))
    }

    /// A snapshot: `{"channels": [...], "latency": {stage: (count, p50_us,
    /// p90_us, p99_us)}, "links": [...], "listener": {...} | None}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let channels = py.detach(|| self.engine.channel_stats()).py_err(py)?;
        let out = PyDict::new(py);
        out.set_item("channels", channels_to_py(py, channels)?)?;
        let lat = PyDict::new(py);
        let l = self.engine.latency();
        for (stage, w) in [
            ("publish", &l.publish),
            ("consume", &l.consume),
            ("handler", &l.handler),
        ] {
            let p = w.percentiles();
            lat.set_item(stage, (p.count, p.p50_us, p.p90_us, p.p99_us))?;
        }
        out.set_item("latency", lat)?;
        let loss = keyop_core::storage::quarantine::loss_counts();
        out.set_item("data_loss", (loss.gaps, loss.gap_bytes, loss.quarantined))?;
        let fed = self.engine.with_federation(|f| {
            let links: Vec<_> = f
                .clients()
                .iter()
                .map(|c| {
                    let s = c.status();
                    let rtt = s.rtt.percentiles();
                    (
                        c.addr().to_owned(),
                        s.connected.load(std::sync::atomic::Ordering::Acquire),
                        s.reconnects.load(Relaxed),
                        s.unacked_bytes.load(Relaxed),
                        rtt.p50_us,
                        rtt.p99_us,
                        s.refused(),
                        s.refused_channels(),
                    )
                })
                .collect();
            let listener = f.hub().map(|h| {
                let c = h.counters();
                (
                    h.local_addr().to_string(),
                    h.connected_peers(),
                    c.inbound.stored.load(Relaxed),
                    c.accepted.load(Relaxed),
                    c.rejected.load(Relaxed),
                    c.inbound.refused.snapshot(),
                    c.failed.snapshot(),
                )
            });
            (links, listener)
        });
        let (links, listener) = fed.unwrap_or_default();
        out.set_item("links", links)?;
        out.set_item("listener", listener)?;
        let gateway = self
            .engine
            .with_gateway(|g| g.counters().snapshot().into_iter().collect::<Vec<_>>());
        out.set_item("gateway", gateway)?;
        Ok(out)
    }

    /// Federation state: `{"hub": {...} | None, "clients": [{...}]}`.
    fn federation_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        self.engine.check_process().py_err(py)?;
        let d = PyDict::new(py);
        d.set_item("hub", py.None())?;
        d.set_item("clients", pyo3::types::PyList::empty(py))?;
        let snapshot = self.engine.with_federation(|f| {
            let hub = f.hub().map(|h| {
                let c = h.counters();
                (
                    c.accepted.load(Relaxed),
                    c.rejected.load(Relaxed),
                    h.connected_peers(),
                )
            });
            let clients: Vec<_> = f
                .clients()
                .iter()
                .map(|c| {
                    let s = c.status();
                    (
                        c.addr().to_owned(),
                        s.connected.load(std::sync::atomic::Ordering::Acquire),
                        s.reconnects.load(Relaxed),
                        s.failed_attempts.load(Relaxed),
                        (s.refused(), s.refused_channels(), s.refused_subscriptions()),
                    )
                })
                .collect();
            (hub, clients)
        });
        if let Some((hub, clients)) = snapshot {
            if let Some((accepted, rejected, peers)) = hub {
                let h = PyDict::new(py);
                h.set_item("accepted", accepted)?;
                h.set_item("rejected", rejected)?;
                h.set_item("peers", peers)?;
                d.set_item("hub", h)?;
            }
            let list = pyo3::types::PyList::empty(py);
            for (addr, connected, reconnects, failed, refusals) in clients {
                let (refused, refused_channels, refused_subscriptions) = refusals;
                let c = PyDict::new(py);
                c.set_item("addr", addr)?;
                c.set_item("connected", connected)?;
                c.set_item("reconnects", reconnects)?;
                c.set_item("failed_attempts", failed)?;
                c.set_item("refused", refused)?;
                c.set_item("refused_channels", refused_channels)?;
                c.set_item("refused_subscriptions", refused_subscriptions)?;
                list.append(c)?;
            }
            d.set_item("clients", list)?;
        }
        Ok(d)
    }

    /// Returns once everything published so far is committed locally
    /// (relaxed mode: fdatasynced) and acknowledged by every hub it is
    /// forwarded to; `Error::Timeout` naming what is pending after
    /// `timeout_s` seconds (None: no limit). Ctrl-C interrupts the wait.
    #[pyo3(signature = (timeout_s = None))]
    fn flush(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<()> {
        use keyop_core::federation::flush;
        let mut targets = py.detach(|| self.engine.flush_start()).py_err(py)?;
        let targets = Mutex::new(std::mem::take(&mut targets));
        flush_loop(
            py,
            timeout_s,
            |slice| {
                let mut t = targets.lock().unwrap_or_else(|e| e.into_inner());
                flush::wait_forwarded(&mut t, slice);
                t.is_empty()
            },
            || {
                let t = targets.lock().unwrap_or_else(|e| e.into_inner());
                flush::describe(&flush::pending(&t))
            },
        )
    }

    /// Appends the original of the dead letter at `offset` of `channel`'s
    /// dead-letter channel to `channel`, byte for byte (same id, origin,
    /// timestamp and fields; from its quarantine copy when it was too large
    /// to embed); returns its id once committed (dead-letter replay).
    fn _replay_dead_letter(&self, py: Python<'_>, channel: &str, offset: u64) -> PyResult<String> {
        py.detach(|| keyop_core::replay::replay_dead_letter(&self.engine, channel, offset))
            .py_err(py)
    }

    /// Test hook: simulates a power loss (unsynced bytes dropped, the first
    /// `torn` of them kept as a torn write) and closes the engine.
    #[pyo3(signature = (torn = 0))]
    fn _simulate_power_loss(&self, py: Python<'_>, torn: usize) -> PyResult<()> {
        self.engine.check_process().py_err(py)?;
        py.detach(|| self.engine.simulate_power_loss(torn))
            .py_err(py)
    }

    /// Stops every subscriber, waiting at most `timeout_s` (default 10 s)
    /// for handlers still running, then flushes and closes every channel.
    /// Returns False when a handler was left running (its message stays
    /// unacknowledged). Ctrl-C stops the waiting (the close still
    /// finishes) and raises KeyboardInterrupt. Idempotent; in a forked
    /// child it releases nothing.
    #[pyo3(signature = (timeout_s = None))]
    fn close(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let timeout = timeout_or(timeout_s, keyop_core::engine::DEFAULT_CLOSE_TIMEOUT)?;
        interruptible(py, |check| self.engine.close_within(timeout, check))
    }

    /// Makes a close running on another thread stop waiting for handlers
    /// (the rest of the close still runs). Never blocks.
    fn stop_waiting(&self) {
        self.engine.stop_waiting();
    }

    /// Whether this is a process forked after the engine was opened (where
    /// every call raises ForkedProcessError).
    #[getter]
    fn forked(&self) -> bool {
        self.engine.is_forked()
    }
}

/// Waits in slices of at most 100 ms with the GIL released, checking for
/// signals (Ctrl-C) between slices, until `wait(slice)` says all is done or
/// `timeout_s` (None: no limit) runs out; then `Error::Timeout` with
/// `pending()` (what is still waiting).
fn flush_loop(
    py: Python<'_>,
    timeout_s: Option<f64>,
    mut wait: impl FnMut(Duration) -> bool + Send,
    pending: impl FnOnce() -> String + Send,
) -> PyResult<()> {
    let limit = timeout_s
        .map(|t| timeout_or(Some(t), Duration::ZERO))
        .transpose()?;
    let started = std::time::Instant::now();
    loop {
        let slice = limit.map_or(Duration::from_millis(100), |l| {
            l.saturating_sub(started.elapsed())
                .min(Duration::from_millis(100))
        });
        if py.detach(|| wait(slice)) {
            return Ok(());
        }
        py.check_signals()?;
        if let Some(l) = limit.filter(|l| started.elapsed() >= *l) {
            let what = py.detach(pending);
            return Err(keyop_core::Error::Timeout(format!(
                "flush: not committed and acknowledged within {:.1}s: {what}",
                l.as_secs_f64()
            )))
            .py_err(py);
        }
    }
}

/// A sink for link events and the thread that hands them to Python as
/// `events(kind, hub, detail, count)`: `("connect", hub, "", 0)`,
/// `("disconnect", hub, reason, 0)`, `("refused", hub, channel, count)`.
/// The thread ends once the links (every sink clone) are gone.
fn link_events(events: Py<PyAny>) -> keyop_core::federation::status::EventSink {
    use keyop_core::federation::status::{EventSink, LinkEvent};
    let (sink, rx) = EventSink::new(1024);
    let spawned = std::thread::Builder::new()
        .name("keyop-events".into())
        .spawn(move || {
            for ev in rx {
                let args = match ev {
                    LinkEvent::Connected { hub } => ("connect", hub, String::new(), 0),
                    LinkEvent::Disconnected { hub, reason } => ("disconnect", hub, reason, 0),
                    LinkEvent::Refused {
                        hub,
                        channel,
                        count,
                    } => ("refused", hub, channel, count),
                };
                Python::attach(|py| {
                    if let Err(err) = events.call1(py, args) {
                        err.print(py);
                    }
                });
            }
        });
    if let Err(e) = spawned {
        log::error!("cannot start the link event thread: {e}; callbacks will not be called");
    }
    sink
}

/// Per-channel retention limits: channel -> `(max_age_ms, max_bytes)`.
type ChannelLimits = std::collections::HashMap<String, (Option<u64>, Option<u64>)>;

fn retention(
    max_lag_bytes: Option<u64>,
    offset_ttl_ms: Option<u64>,
    max_age_ms: Option<u64>,
    max_bytes: Option<u64>,
    channels: Option<ChannelLimits>,
) -> RetentionConfig {
    let limits = |age: Option<u64>, bytes: Option<u64>| RetentionLimits {
        max_age: age.map(Duration::from_millis),
        max_bytes: bytes,
    };
    RetentionConfig {
        max_lag_bytes,
        stale_offset_ttl: offset_ttl_ms.map(Duration::from_millis),
        limits: limits(max_age_ms, max_bytes),
        per_channel: channels
            .unwrap_or_default()
            .into_iter()
            .map(|(c, (age, bytes))| (c, limits(age, bytes)))
            .collect(),
    }
}

/// The `Message` handed to a subscription's delivery function for `e`.
fn delivery_message(
    py: Python<'_>,
    dec: &mut PyDecoder,
    e: &EnvelopeRef<'_>,
) -> PyResult<Py<message::Message>> {
    Py::new(
        py,
        message::Message::from_record(
            PyString::new(py, &e.id).into_any().unbind(),
            dec.field(py, json::CHANNEL, &e.channel).into_any().unbind(),
            dec.field(py, json::ORIGIN, &e.origin).into_any().unbind(),
            dec.field(py, json::PAYLOAD_TYPE, &e.payload_type)
                .into_any()
                .unbind(),
            e.service_name
                .as_deref()
                .map(|s| dec.field(py, json::SERVICE_NAME, s).into_any().unbind()),
            e.correlation_id
                .as_deref()
                .map(|s| PyString::new(py, s).into_any().unbind()),
            e.ts_nanos,
            &e.payload,
        ),
    )
}

/// Reads the delivery function's `(handled, failure)`: `failure` is None, or
/// `(reject, error_text)`, or `(reject, error_text, True)` for a record
/// whose payload cannot become a Python value (dead-lettered as raw text).
fn delivery_outcome(result: &Bound<'_, PyAny>) -> PyResult<BatchOutcome> {
    let (handled, failure) = result.extract::<(usize, Option<Bound<'_, PyTuple>>)>()?;
    let failure = match failure {
        None => None,
        Some(t) => {
            let reject: bool = t.get_item(0)?.extract()?;
            let text: String = t.get_item(1)?.extract()?;
            let unreadable = t.len() > 2 && t.get_item(2)?.extract::<bool>()?;
            Some(if unreadable {
                Failure::Unreadable(text)
            } else if reject {
                Failure::Reject(text)
            } else {
                Failure::Retry(text)
            })
        }
    };
    Ok(BatchOutcome { handled, failure })
}

/// Calls the Python delivery function with the GIL held, once per batch,
/// and `on_gap(from, to)` (if given) for each gap.
struct PyHandler {
    deliver: Py<PyAny>,
    on_gap: Option<Py<PyAny>>,
    decoder: PyDecoder,
}

/// `(offset, id, ts_nanos, channel, origin, payload_type, service_name,
/// correlation_id, payload)`; the payload is decoded JSON.
type DeliveryRow<'a, 'py> = (
    u64,
    &'a str,
    i64,
    Bound<'py, PyString>,
    Bound<'py, PyString>,
    Bound<'py, PyString>,
    Option<Bound<'py, PyString>>,
    Option<&'a str>,
    Bound<'py, PyAny>,
);

/// One row for a Python delivery function; fails when the payload cannot
/// become a Python value.
fn delivery_row<'a, 'py>(
    py: Python<'py>,
    dec: &mut PyDecoder,
    offset: u64,
    e: &'a Envelope,
) -> PyResult<DeliveryRow<'a, 'py>> {
    Ok((
        offset,
        e.id.as_str(),
        e.ts_nanos,
        dec.field(py, json::CHANNEL, &e.channel),
        dec.field(py, json::ORIGIN, &e.origin),
        dec.field(py, json::PAYLOAD_TYPE, &e.payload_type),
        e.service_name
            .as_deref()
            .map(|s| dec.field(py, json::SERVICE_NAME, s)),
        e.correlation_id.as_deref(),
        dec.payload(py, e.payload.get())?,
    ))
}

impl Handler for PyHandler {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        Python::attach(|py| {
            // One `Message` per record, its payload left as JSON text until
            // the handler reads it; one call of the delivery function per batch.
            let mut messages = Vec::with_capacity(batch.len());
            for d in batch {
                match delivery_message(py, &mut self.decoder, &d.envelope()) {
                    Ok(m) => messages.push(m),
                    Err(e) => {
                        return BatchOutcome {
                            handled: 0,
                            failure: Some(Failure::Retry(format!(
                                "cannot build the message: {}",
                                e.value(py)
                            ))),
                        }
                    }
                }
            }
            let result = self
                .deliver
                .call1(py, (messages,))
                .and_then(|r| delivery_outcome(r.bind(py)));
            result.unwrap_or_else(|e| BatchOutcome {
                handled: 0,
                failure: Some(Failure::Retry(format!("delivery function failed: {e}"))),
            })
        })
    }

    fn gap(&mut self, from: u64, to: u64) {
        if let Some(on_gap) = &self.on_gap {
            Python::attach(|py| {
                if let Err(e) = on_gap.call1(py, (from, to)) {
                    e.print(py);
                }
            });
        }
    }
}

/// A storage-less hub client (`keyop_core::federation::ephemeral`).
#[pyclass(module = "keyop_messenger._core", frozen)]
struct EphemeralClient {
    client: EphemeralCore,
    origin: String,
}

#[pymethods]
impl EphemeralClient {
    /// Loads TLS and checks the settings (JSON with the fields of
    /// `EphemeralConfig`); does not dial.
    #[new]
    #[pyo3(signature = (settings_json, events = None))]
    fn new(py: Python<'_>, settings_json: &str, events: Option<Py<PyAny>>) -> PyResult<Self> {
        let mut cfg: EphemeralConfig = serde_json::from_str(settings_json)
            .map_err(|e| new_err(py, Kind::Config, format!("ephemeral settings: {e}")))?;
        cfg.events = events.map(link_events);
        let origin = cfg.name.clone();
        let client = py
            .detach(|| EphemeralCore::new(cfg))
            .map_err(|e| keyop_core::Error::Federation(e.to_string()))
            .py_err(py)?;
        Ok(EphemeralClient { client, origin })
    }

    /// Dials the hub; waits up to `timeout_s` for the first connection
    /// (KeyopTimeoutError after that). Ctrl-C stops the waiting.
    fn connect(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = timeout_or(Some(timeout_s), Duration::ZERO)?;
        interruptible(py, |check| self.client.connect_within(timeout, check))?.py_err(py)
    }

    /// Sets `deliver(rows)`, called with rows like a subscription's for
    /// every frame the hub streams (return value ignored).
    fn set_handler(&self, deliver: Py<PyAny>) {
        let deliver = Arc::new(deliver);
        let decoder = Mutex::new(PyDecoder::default());
        self.client
            .set_handler(Arc::new(move |envelopes: Vec<Envelope>| {
                Python::attach(|py| {
                    let mut dec = decoder.lock().unwrap_or_else(|e| e.into_inner());
                    // A payload that cannot become a Python value is dropped
                    // alone (logged), not with the rest of the frame.
                    let mut rows = Vec::with_capacity(envelopes.len());
                    for e in &envelopes {
                        match delivery_row(py, &mut dec, 0, e) {
                            Ok(row) => rows.push(row),
                            Err(err) => log::warn!(
                                "channel {:?}: message {} from the hub cannot be read: {}",
                                e.channel,
                                e.id,
                                err.value(py)
                            ),
                        }
                    }
                    if let Err(err) = deliver.call1(py, (rows,)) {
                        err.print(py);
                    }
                })
            }));
    }

    /// Publishes `(payload_type, payload)` items in one frame; returns their
    /// ids once the hub acknowledged (after committing) the frame. Waits at
    /// most `timeout_s` (default 60 s) for that (KeyopTimeoutError after
    /// it); Ctrl-C stops the waiting. `ids`: one valid id per item, given by
    /// the caller (default: new ids); the hub drops a record whose id it has
    /// recently seen.
    #[pyo3(signature = (channel, items, service_name = None, correlation_id = None, default = None, timeout_s = None, ids = None))]
    #[allow(clippy::too_many_arguments)]
    fn publish_batch(
        &self,
        py: Python<'_>,
        channel: &str,
        items: &Bound<'_, PyAny>,
        service_name: Option<&str>,
        correlation_id: Option<&str>,
        default: Option<&Bound<'_, PyAny>>,
        timeout_s: Option<f64>,
        ids: Option<Vec<String>>,
    ) -> PyResult<Vec<String>> {
        let timeout = timeout_or(timeout_s, keyop_core::federation::ACK_TIMEOUT)?;
        keyop_core::envelope::validate_name(keyop_core::NameKind::PublishChannel, channel)
            .map_err(keyop_core::Error::from)
            .py_err(py)?;
        let owned;
        let encoded = match items.cast::<columns::PayloadBatch>() {
            Ok(batch) => batch.get().pairs(),
            Err(_) => {
                owned = encode_items(py, items, default)?;
                borrowed(&owned)
            }
        };
        let given = ids.or_else(|| batch_ids(items));
        if let Some(g) = &given {
            if g.len() != encoded.len() {
                return Err(new_err(
                    py,
                    Kind::InvalidName,
                    format!(
                        "publish_batch: {} ids given for {} items (one id per item)",
                        g.len(),
                        encoded.len()
                    ),
                ));
            }
        }
        let mut body = Vec::new();
        let mut ids = Vec::with_capacity(encoded.len());
        let mut line = Vec::with_capacity(256);
        for (i, (payload_type, json)) in encoded.iter().enumerate() {
            line.clear();
            let m = Outgoing {
                payload_type,
                payload_json: json,
                service_name,
                correlation_id,
            };
            let id = given.as_ref().map(|g| g[i].as_str());
            ids.push(encode_message_with_id(&mut line, &self.origin, channel, &m, id).py_err(py)?);
            keyop_core::federation::wire::push_record(&mut body, &line[..line.len() - 1]);
        }
        if ids.is_empty() {
            return Ok(ids);
        }
        let sent = ids.clone();
        interruptible(py, |check| {
            self.client.send_within(channel, sent, body, timeout, check)
        })?
        .py_err(py)?;
        Ok(ids)
    }

    /// `{"connected", "reconnects", "failed_attempts", "unacked_bytes",
    /// "refused", "refused_subscriptions"}` (`refused`: records the hub
    /// refused, per channel; `refused_subscriptions`: requested channels the
    /// hub's last handshake said it will not deliver).
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.client.status();
        let d = PyDict::new(py);
        d.set_item("refused", s.refused())?;
        d.set_item("refused_subscriptions", s.refused_subscriptions())?;
        d.set_item("connected", s.connected.load(Relaxed))?;
        d.set_item("reconnects", s.reconnects.load(Relaxed))?;
        d.set_item("failed_attempts", s.failed_attempts.load(Relaxed))?;
        d.set_item("unacked_bytes", self.client.unacked_bytes())?;
        Ok(d)
    }

    /// Returns once no publish is waiting for the hub's answer;
    /// `Error::Timeout` naming what is in flight after `timeout_s` seconds
    /// (None: no limit). Ctrl-C interrupts the wait.
    #[pyo3(signature = (timeout_s = None))]
    fn flush(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<()> {
        flush_loop(
            py,
            timeout_s,
            |slice| self.client.wait_idle(slice).is_empty(),
            || keyop_core::federation::flush::describe(&self.client.in_flight()),
        )
    }

    /// Closes the connection; pending publishes fail. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.client.close());
    }
}

/// A running subscription; `close()` stops it and keeps its offset.
#[pyclass(module = "keyop_messenger._core", frozen)]
struct Subscription {
    engine: Arc<Engine>,
    sub: Arc<Subscriber>,
}

#[pymethods]
impl Subscription {
    /// Channel subscribed to.
    #[getter]
    fn channel(&self) -> &str {
        self.sub.channel()
    }

    /// Subscriber id.
    #[getter]
    fn subscriber_id(&self) -> &str {
        self.sub.id()
    }

    /// Offset of the next record not yet acknowledged.
    #[getter]
    fn position(&self) -> u64 {
        self.sub.position()
    }

    /// Makes delivery go on at a position (see `Engine.resolve_position`):
    /// taken between batches, the new offset is persisted.
    fn seek(&self, py: Python<'_>, kind: &str, value: i64) -> PyResult<()> {
        let pos = start_position(kind, value)?;
        py.detach(|| self.engine.seek(&self.sub, pos)).py_err(py)
    }

    /// Stops delivery and persists the offset, waiting at most `timeout_s`
    /// (default 10 s) for a handler call in progress; returns False when it
    /// was left running (its message stays unacknowledged, delivered again
    /// next time). Ctrl-C stops the waiting and raises KeyboardInterrupt.
    /// Idempotent; safe to call from the handler.
    #[pyo3(signature = (timeout_s = None))]
    fn close(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let timeout = timeout_or(timeout_s, keyop_core::engine::DEFAULT_CLOSE_TIMEOUT)?;
        interruptible(py, |check| {
            self.engine.release_within(&self.sub, timeout, check)
        })
    }
}

impl PyEngine {
    fn writer(&self, py: Python<'_>, channel: &str) -> PyResult<Arc<ChannelWriter>> {
        py.detach(|| self.engine.publish_writer(channel)).py_err(py)
    }
}

/// Iterator over the readable records of a channel (see `Row`). Unreadable
/// records (not valid envelopes, or payloads that cannot become Python
/// values) are quarantined and passed over; a gap (bytes gone from the
/// middle of the stream, or before a non-zero start offset) raises
/// `DataLossError` naming the byte range, unless `skip_gaps` (then it is
/// only counted and logged). This iterator, iterated again after the error,
/// goes on past the gap.
#[pyclass(module = "keyop_messenger._core")]
struct RecordIter {
    reader: LogReader,
    limit: Limit,
    decoder: PyDecoder,
    data_dir: PathBuf,
    channel: String,
    skip_gaps: bool,
    /// Records ending past this offset are not read.
    until: u64,
}

/// What the reader found next, before conversion to Python (transient).
#[allow(clippy::large_enum_variant)]
enum Found {
    Record(u64, u64, Vec<u8>, Envelope),
    Gap(u64, u64),
}

/// How far a [`RecordIter`] may read.
enum Limit {
    /// Up to the committed end of this messenger's writer (none: the channel
    /// does not exist, so there is nothing to read).
    Committed(Option<Arc<ChannelWriter>>),
    /// A directory no writer of ours owns: every complete line.
    Complete,
}

#[pymethods]
impl RecordIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Row<'py>>> {
        loop {
            let Some(found) = self.next_found(py)? else {
                return Ok(None);
            };
            let (offset, segment, line, e) = match found {
                Found::Record(offset, segment, line, e) => (offset, segment, line, e),
                Found::Gap(from, to) => {
                    let lost = reader_gap(py, &self.channel, from, to);
                    if self.skip_gaps {
                        continue;
                    }
                    return Err(lost);
                }
            };
            let payload = match self.decoder.payload(py, e.payload.get()) {
                Ok(p) => p,
                Err(err) => {
                    let reason = format!("payload cannot be read: {}", err.value(py));
                    keyop_core::storage::quarantine::quarantine(
                        &self.data_dir,
                        &self.channel,
                        offset,
                        &line,
                        &reason,
                    );
                    continue;
                }
            };
            return Ok(Some((
                offset,
                segment,
                e.id,
                e.ts_nanos,
                e.channel,
                e.origin,
                e.payload_type,
                e.service_name,
                e.correlation_id,
                payload,
            )));
        }
    }

    /// Global offset of the next record.
    #[getter]
    fn position(&self) -> u64 {
        self.reader.position()
    }
}

impl RecordIter {
    /// The next record or gap, read with the GIL released; unreadable lines
    /// are quarantined and passed over (a corrupt run glued to a valid
    /// record is split off it). A gap before offset 0's first segment is
    /// history retention trimmed: not reported.
    fn next_found(&mut self, py: Python<'_>) -> PyResult<Option<Found>> {
        use keyop_core::storage::quarantine::{decode_stored, quarantine, split_point};
        let limit = match &self.limit {
            Limit::Committed(w) => w.as_ref().map_or(0, |w| w.committed_end()),
            Limit::Complete => u64::MAX,
        }
        .min(self.until);
        let (reader, data_dir, channel) = (&mut self.reader, &self.data_dir, &self.channel);
        py.detach(|| -> std::io::Result<Option<Found>> {
            loop {
                let Some(item) = reader.next_item(limit)? else {
                    return Ok(None);
                };
                let (offset, segment, line) = match item {
                    Item::Record {
                        offset,
                        segment,
                        line,
                    } => (offset, segment, line),
                    Item::Gap { from, to } if from > 0 => return Ok(Some(Found::Gap(from, to))),
                    _ => continue,
                };
                match decode_stored(&line) {
                    Ok(e) => return Ok(Some(Found::Record(offset, segment, line, e))),
                    Err(reason) => {
                        let bad = split_point(&line).unwrap_or(line.len());
                        quarantine(data_dir, channel, offset, &line[..bad], &reason);
                        if bad < line.len() {
                            reader.seek(offset + bad as u64);
                        }
                    }
                }
            }
        })
        .map_err(|e| {
            new_err(
                py,
                Kind::Storage,
                format!("cannot read {}: {e}", self.reader.dir().display()),
            )
        })
    }
}

/// Reads records of `channel` in any data directory (also one written by
/// keyop-messenger 1.4, or in use by another process) from `start_offset`,
/// which must start a record and not be past the end (ConfigError) unless
/// `check_start` is false (a caller reading from an offset it recorded).
/// A gap raises `DataLossError` unless `skip_gaps`.
#[pyfunction]
#[pyo3(signature = (data_dir, channel, start_offset = 0, *, skip_gaps = false, until = None, check_start = true))]
fn read_channel(
    py: Python<'_>,
    data_dir: PathBuf,
    channel: &str,
    start_offset: u64,
    skip_gaps: bool,
    until: Option<u64>,
    check_start: bool,
) -> PyResult<RecordIter> {
    let reader = match check_start {
        true => keyop_core::engine::read_channel_at(&data_dir, channel, start_offset),
        false => keyop_core::read_channel(&data_dir, channel, start_offset),
    }
    .py_err(py)?;
    Ok(RecordIter {
        reader,
        limit: Limit::Complete,
        decoder: PyDecoder::default(),
        data_dir,
        channel: channel.to_owned(),
        skip_gaps,
        until: until.unwrap_or(u64::MAX),
    })
}

/// Global offset of the record boundary a position names in `channel` of any
/// data directory (see `Engine.resolve_position`).
#[pyfunction]
fn resolve_position(
    py: Python<'_>,
    data_dir: PathBuf,
    channel: &str,
    kind: &str,
    value: i64,
) -> PyResult<u64> {
    let pos = start_position(kind, value)?;
    py.detach(|| keyop_core::resolve_position(&data_dir, channel, pos))
        .py_err(py)
}

/// A start position from its Python form (kind name and value).
fn start_position(kind: &str, value: i64) -> PyResult<StartPosition> {
    Ok(match kind {
        "earliest" => StartPosition::Earliest,
        "latest" => StartPosition::Latest,
        "time" => StartPosition::Time(value),
        "offset" => StartPosition::Offset(u64::try_from(value).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "offset {value} is negative; use a record's offset (0 or more)"
            ))
        })?),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "unknown position kind {other:?}; use 'earliest', 'latest', 'offset' or 'time'"
            )))
        }
    })
}

/// The channel figures as `MessengerBase.stats()` gives them.
fn channels_to_py(
    py: Python<'_>,
    channels: Vec<keyop_core::stats::ChannelSnapshot>,
) -> PyResult<Bound<'_, pyo3::types::PyList>> {
    let list = pyo3::types::PyList::empty(py);
    for c in channels {
        let d = PyDict::new(py);
        d.set_item("name", c.name)?;
        d.set_item("messages_published", c.messages_published)?;
        d.set_item("stream_bytes", c.stream_bytes)?;
        d.set_item("disk_bytes", c.disk_bytes)?;
        d.set_item("last_message_nanos", c.last_message_nanos)?;
        let subs = pyo3::types::PyList::empty(py);
        for s in c.subscribers {
            subs.append((s.id, s.lag_bytes, s.oldest_pending_nanos, s.active))?;
        }
        d.set_item("subscribers", subs)?;
        list.append(d)?;
    }
    Ok(list)
}

/// `stats()` of any data directory from its files only (no lock: works beside
/// a running messenger); no latency samples, no federation.
#[pyfunction]
fn read_stats(py: Python<'_>, data_dir: PathBuf) -> PyResult<Bound<'_, PyDict>> {
    let channels = py
        .detach(|| keyop_core::read_channel_stats(&data_dir))
        .py_err(py)?;
    let out = PyDict::new(py);
    out.set_item("channels", channels_to_py(py, channels)?)?;
    out.set_item("latency", PyDict::new(py))?;
    out.set_item("links", pyo3::types::PyList::empty(py))?;
    out.set_item("listener", py.None())?;
    Ok(out)
}

/// pyo3-log's cache of Python loggers and their levels.
static LOG_CACHE: std::sync::OnceLock<pyo3_log::ResetHandle> = std::sync::OnceLock::new();

/// Forgets the cached Python logger levels, so that a level changed in Python
/// applies to the engine's log records from now on.
#[pyfunction]
fn reset_log_cache() {
    if let Some(handle) = LOG_CACHE.get() {
        handle.reset();
    }
}

/// Process-wide data-loss counters: `{"gaps", "gap_bytes", "quarantined"}`.
#[pyfunction]
fn loss_counts(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = keyop_core::storage::quarantine::loss_counts();
    let d = PyDict::new(py);
    d.set_item("gaps", c.gaps)?;
    d.set_item("gap_bytes", c.gap_bytes)?;
    d.set_item("quarantined", c.quarantined)?;
    Ok(d)
}

/// Raises InvalidNameError unless `name` is a valid channel name (the
/// engine's rule; dead-letter channels included).
#[pyfunction]
fn validate_channel(py: Python<'_>, name: &str) -> PyResult<()> {
    keyop_core::envelope::validate_name(keyop_core::NameKind::Channel, name)
        .map_err(keyop_core::Error::from)
        .py_err(py)
}

/// Raises InvalidNameError unless `name` is a valid federation peer name
/// (a certificate CN a hub can name its cursor files after).
#[pyfunction]
fn validate_peer_name(py: Python<'_>, name: &str) -> PyResult<()> {
    keyop_core::envelope::validate_name(keyop_core::NameKind::PeerName, name)
        .map_err(keyop_core::Error::from)
        .py_err(py)
}

/// Loads the TLS files as federation and the gateway do at start (readable,
/// key mode, the key belongs to the certificate, certificates valid now and
/// chained to the CA); raises FederationError saying what is wrong.
#[pyfunction]
#[pyo3(signature = (cert, key, ca, min_version = "1.3"))]
fn check_tls(py: Python<'_>, cert: &str, key: &str, ca: &str, min_version: &str) -> PyResult<()> {
    let settings = keyop_core::federation::TlsSettings {
        cert: cert.to_owned(),
        key: key.to_owned(),
        ca: ca.to_owned(),
        min_version: min_version.to_owned(),
        expiry_warn_days: 0,
    };
    use keyop_core::federation::FedError;
    py.detach(|| keyop_core::federation::tls::TlsMaterial::load(&settings))
        .map(drop)
        .map_err(|e| {
            let why = match e {
                FedError::Tls(why) => why,
                e => e.to_string(),
            };
            new_err(py, Kind::Federation, why)
        })
}

/// Raises ValueError unless `timeout_s` is a timeout the extension's waits
/// take (None, or a finite number of seconds >= 0): for callers that must
/// check one before they change any state.
#[pyfunction]
#[pyo3(signature = (timeout_s))]
fn check_timeout(timeout_s: Option<f64>) -> PyResult<()> {
    timeout_or(timeout_s, Duration::ZERO).map(drop)
}

/// Raises InvalidNameError unless `name` is a valid payload type: the
/// engine's rule for the envelope's `payload_type` field.
#[pyfunction]
fn validate_payload_type(py: Python<'_>, name: &str) -> PyResult<()> {
    keyop_core::envelope::validate_field("payload_type", name)
        .map_err(keyop_core::Error::InvalidRecord)
        .py_err(py)
}

/// Raises InvalidNameError unless `value` is a valid `field` of an envelope
/// (`payload_type`, `service_name` or `correlation_id`): the engine's rule,
/// for callers that check options before any record is made (Spark's driver).
#[pyfunction]
fn validate_field(py: Python<'_>, field: &str, value: &str) -> PyResult<()> {
    let field: &'static str = match field {
        "payload_type" => "payload_type",
        "service_name" => "service_name",
        "correlation_id" => "correlation_id",
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "not an envelope text field: {other:?}"
            )))
        }
    };
    keyop_core::envelope::validate_field(field, value)
        .map_err(keyop_core::Error::InvalidRecord)
        .py_err(py)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The engine's log records go to Python logging under the package's
    // logger: the Rust module keyop_core::federation::hub logs to
    // "keyop_messenger.keyop_core.federation.hub". If the process already has
    // a Rust logger installed (another extension), records go there instead.
    if let Ok(handle) = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::LoggersAndLevels)?
        .set_prefix("keyop_messenger")
        .install()
    {
        let _ = LOG_CACHE.set(handle);
    }
    m.add_class::<PyEngine>()?;
    m.add_class::<MessengerBase>()?;
    m.add_class::<RecordIter>()?;
    m.add_class::<Subscription>()?;
    m.add_class::<EphemeralClient>()?;
    m.add_class::<receipt::Receipt>()?;
    m.add_class::<receipt::Completer>()?;
    m.add_function(wrap_pyfunction!(read_channel, m)?)?;
    m.add_class::<columns::PayloadBatch>()?;
    m.add_class::<columns::FramedBatch>()?;
    m.add_class::<columns::ColumnIter>()?;
    m.add_function(wrap_pyfunction!(columns::encode_columns, m)?)?;
    m.add_function(wrap_pyfunction!(columns::encode_records, m)?)?;
    m.add_function(wrap_pyfunction!(columns::read_columns, m)?)?;
    m.add_function(wrap_pyfunction!(columns::parse_payload_fields, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_position, m)?)?;
    m.add_function(wrap_pyfunction!(read_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_log_cache, m)?)?;
    m.add_function(wrap_pyfunction!(validate_channel, m)?)?;
    m.add_function(wrap_pyfunction!(validate_peer_name, m)?)?;
    m.add_function(wrap_pyfunction!(loss_counts, m)?)?;
    m.add_function(wrap_pyfunction!(validate_payload_type, m)?)?;
    m.add_function(wrap_pyfunction!(check_timeout, m)?)?;
    m.add_function(wrap_pyfunction!(check_tls, m)?)?;
    m.add_function(wrap_pyfunction!(validate_field, m)?)?;
    keygen::register(m)?;
    message::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_RECORD_BYTES", keyop_core::envelope::MAX_RECORD_BYTES)?;
    Ok(())
}
