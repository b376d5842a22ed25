//! `keyop_messenger.Message`: one delivered or read message.
//!
//! Built here rather than in Python because delivery makes one per record:
//! a Python `__init__` setting eight attributes cost more than the rest of
//! the delivery path together. The payload stays JSON text until
//! `message.payload` is first read, and the timestamp stays nanoseconds
//! until `message.timestamp` is, so a handler pays only for what it reads.

use std::sync::Mutex;

use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDateTime, PyDelta, PyInt, PyTuple, PyTzInfo};

use crate::json::PyDecoder;

/// Decoder shared by lazy payload reads, so dict keys are reused from
/// message to message. Taken with `try_lock` only: a decode may call
/// Python's `json` (which may switch threads); a reader that finds it busy
/// uses a fresh decoder instead of waiting.
static DECODER: Mutex<Option<PyDecoder>> = Mutex::new(None);

const NANOS_PER_MICRO: i64 = 1_000;
const MICROS_PER_DAY: i64 = 86_400_000_000;

/// One message as stored in a channel (read-only).
///
/// Attributes:
///     id: Message id (a UUIDv7 for messages published by keyop-messenger).
///     channel: Channel the message was published to.
///     origin: Instance name of the original publisher.
///     payload_type: Type discriminator chosen by the publisher.
///     payload: The payload, decoded into the registered type, else plain JSON data.
///         A delivered message keeps its payload as JSON text until this is first
///         read, so a handler that never reads it never pays for decoding it.
///     timestamp: Publish time, an aware UTC datetime (microsecond precision).
///     service_name: Name of the publishing service, if set.
///     correlation_id: Correlation id, if set.
#[pyclass(module = "keyop_messenger", name = "Message", frozen)]
pub struct Message {
    #[pyo3(get)]
    id: Py<PyAny>,
    #[pyo3(get)]
    channel: Py<PyAny>,
    #[pyo3(get)]
    origin: Py<PyAny>,
    #[pyo3(get)]
    payload_type: Py<PyAny>,
    #[pyo3(get)]
    service_name: Option<Py<PyAny>>,
    #[pyo3(get)]
    correlation_id: Option<Py<PyAny>>,
    /// Nanoseconds since the epoch (when built from a record).
    ts_nanos: i64,
    /// Built with a datetime rather than nanoseconds.
    from_datetime: bool,
    ts: PyOnceLock<Py<PyAny>>,
    /// The payload's JSON text, until decoded into `payload`.
    raw: Option<Box<str>>,
    payload: PyOnceLock<Py<PyAny>>,
    /// Why the payload could not become a Python value, once that was tried.
    unreadable: PyOnceLock<String>,
}

impl Message {
    /// A message whose payload is the JSON text `raw`, decoded on first read.
    #[allow(clippy::too_many_arguments)]
    pub fn from_record(
        id: Py<PyAny>,
        channel: Py<PyAny>,
        origin: Py<PyAny>,
        payload_type: Py<PyAny>,
        service_name: Option<Py<PyAny>>,
        correlation_id: Option<Py<PyAny>>,
        ts_nanos: i64,
        raw: &str,
    ) -> Self {
        Message {
            id,
            channel,
            origin,
            payload_type,
            service_name,
            correlation_id,
            ts_nanos,
            from_datetime: false,
            ts: PyOnceLock::new(),
            raw: Some(raw.into()),
            payload: PyOnceLock::new(),
            unreadable: PyOnceLock::new(),
        }
    }

    fn decode(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let raw = self.raw.as_deref().unwrap_or("null");
        let mut shared = DECODER.try_lock().ok();
        let mut fresh = PyDecoder::default();
        let dec = match shared.as_mut() {
            Some(slot) => slot.get_or_insert_with(PyDecoder::default),
            None => &mut fresh,
        };
        let value = dec.payload(py, raw);
        drop(shared);
        value.map(Bound::unbind)
    }

    fn key<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(
            py,
            [
                self.id.bind(py).clone(),
                self.channel.bind(py).clone(),
                self.origin.bind(py).clone(),
                self.payload_type.bind(py).clone(),
                self.payload(py)?,
                self.timestamp(py)?,
                opt(py, &self.service_name),
                opt(py, &self.correlation_id),
            ],
        )
    }
}

fn opt<'py>(py: Python<'py>, value: &Option<Py<PyAny>>) -> Bound<'py, PyAny> {
    match value {
        Some(v) => v.bind(py).clone(),
        None => py.None().into_bound(py),
    }
}

/// An aware UTC datetime `nanos` after the epoch, truncated to microseconds.
fn datetime_from_nanos(py: Python<'_>, nanos: i64) -> PyResult<Bound<'_, PyAny>> {
    let micros = nanos.div_euclid(NANOS_PER_MICRO);
    let days = micros.div_euclid(MICROS_PER_DAY);
    let rest = micros.rem_euclid(MICROS_PER_DAY);
    let delta = PyDelta::new(
        py,
        days as i32,
        (rest / 1_000_000) as i32,
        (rest % 1_000_000) as i32,
        true,
    )?;
    let utc = PyTzInfo::utc(py)?;
    let epoch = PyDateTime::new(py, 1970, 1, 1, 0, 0, 0, 0, Some(&utc))?;
    epoch.as_any().add(delta)
}

#[pymethods]
impl Message {
    #[new]
    #[pyo3(signature = (id, channel, origin, payload_type, payload, timestamp, service_name = None, correlation_id = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        id: Py<PyAny>,
        channel: Py<PyAny>,
        origin: Py<PyAny>,
        payload_type: Py<PyAny>,
        payload: Py<PyAny>,
        timestamp: Bound<'_, PyAny>,
        service_name: Option<Py<PyAny>>,
        correlation_id: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let ts = PyOnceLock::new();
        let mut ts_nanos = 0;
        let from_datetime =
            !timestamp.is_instance_of::<PyInt>() || timestamp.is_instance_of::<PyBool>();
        if from_datetime {
            let _ = ts.set(py, timestamp.unbind());
        } else {
            ts_nanos = timestamp.extract::<i64>()?;
        }
        let value = PyOnceLock::new();
        let _ = value.set(py, payload);
        Ok(Message {
            id,
            channel,
            origin,
            payload_type,
            service_name,
            correlation_id,
            ts_nanos,
            from_datetime,
            ts,
            raw: None,
            payload: value,
            unreadable: PyOnceLock::new(),
        })
    }

    /// The payload, decoded into the registered type, else plain JSON data
    /// (decoded from the stored JSON on first read).
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(v) = self.payload.get(py) {
            return Ok(v.bind(py).clone());
        }
        match self.decode(py) {
            Ok(v) => Ok(self.payload.get_or_init(py, || v).bind(py).clone()),
            Err(e) => {
                let _ = self.unreadable.set(py, e.value(py).to_string());
                Err(e)
            }
        }
    }

    /// Publish time, an aware UTC datetime (microsecond precision).
    #[getter]
    fn timestamp<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(v) = self.ts.get(py) {
            return Ok(v.bind(py).clone());
        }
        let dt = datetime_from_nanos(py, self.ts_nanos)?.unbind();
        Ok(self.ts.get_or_init(py, || dt).bind(py).clone())
    }

    /// The publish time in nanoseconds since the epoch (an `int`) for a
    /// message built from a record or from nanoseconds, else the datetime it
    /// was built with: the command line prints records' full precision.
    #[getter]
    fn _ts(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if self.from_datetime {
            return Ok(self.timestamp(py)?.unbind());
        }
        Ok(self.ts_nanos.into_pyobject(py)?.into_any().unbind())
    }

    /// This message with `payload` in place of its payload (how a
    /// registered type's decoding replaces the plain JSON data).
    fn _with_payload(&self, py: Python<'_>, payload: Py<PyAny>) -> Self {
        let value = PyOnceLock::new();
        let _ = value.set(py, payload);
        Message {
            id: self.id.clone_ref(py),
            channel: self.channel.clone_ref(py),
            origin: self.origin.clone_ref(py),
            payload_type: self.payload_type.clone_ref(py),
            service_name: self.service_name.as_ref().map(|v| v.clone_ref(py)),
            correlation_id: self.correlation_id.as_ref().map(|v| v.clone_ref(py)),
            ts_nanos: self.ts_nanos,
            from_datetime: self.from_datetime,
            ts: self.ts.clone_ref(py),
            raw: None,
            payload: value,
            unreadable: PyOnceLock::new(),
        }
    }

    /// Why the payload could not become a Python value, if reading
    /// `payload` failed; else None.
    fn _unreadable(&self, py: Python<'_>) -> Option<String> {
        self.unreadable.get(py).cloned()
    }

    fn __richcmp__(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
        let Ok(other) = other.cast::<Message>() else {
            return Ok(py.NotImplemented());
        };
        let equal = self.key(py)?.eq(other.get().key(py)?)?;
        match op {
            CompareOp::Eq => Ok(equal.into_pyobject(py)?.to_owned().into_any().unbind()),
            CompareOp::Ne => Ok((!equal).into_pyobject(py)?.to_owned().into_any().unbind()),
            _ => Ok(py.NotImplemented()),
        }
    }

    /// Pickles (and copies) as the constructor's arguments, payload and
    /// timestamp decoded.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let m = slf.get();
        let args = PyTuple::new(
            py,
            [
                m.id.bind(py).clone(),
                m.channel.bind(py).clone(),
                m.origin.bind(py).clone(),
                m.payload_type.bind(py).clone(),
                m.payload(py)?,
                m.timestamp(py)?,
                opt(py, &m.service_name),
                opt(py, &m.correlation_id),
            ],
        )?;
        PyTuple::new(py, [slf.get_type().into_any(), args.into_any()])
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let r = |v: Bound<'_, PyAny>| -> PyResult<String> { Ok(v.repr()?.to_string()) };
        Ok(format!(
            "Message(id={}, channel={}, origin={}, payload_type={}, payload={}, \
             timestamp={}, service_name={}, correlation_id={})",
            r(self.id.bind(py).clone())?,
            r(self.channel.bind(py).clone())?,
            r(self.origin.bind(py).clone())?,
            r(self.payload_type.bind(py).clone())?,
            r(self.payload(py)?)?,
            r(self.timestamp(py)?)?,
            r(opt(py, &self.service_name))?,
            r(opt(py, &self.correlation_id))?,
        ))
    }
}

/// Registers the class on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Message>()
}
