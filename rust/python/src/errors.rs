//! The one place engine errors become Python exceptions.
//!
//! The exception classes live in `keyop_messenger.errors` (plain Python
//! classes, so the pure-Python layer raises the same types); they are looked
//! up once and cached.

use keyop_core::envelope::RecordError;
use keyop_core::{Error, StorageError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The exception classes this module raises.
#[derive(Clone, Copy)]
pub enum Kind {
    InvalidName,
    PayloadType,
    MessageTooLarge,
    Storage,
    DataDirLocked,
    Closed,
    Config,
    Subscription,
    Federation,
    Certificate,
    ConnectionLost,
    BufferFull,
    Policy,
    Forked,
    DataLoss,
    Timeout,
    DataDirNotFound,
    ChannelNotFound,
}

impl Kind {
    fn class_name(self) -> &'static str {
        match self {
            Kind::InvalidName => "InvalidNameError",
            Kind::PayloadType => "PayloadTypeError",
            Kind::MessageTooLarge => "MessageTooLargeError",
            Kind::Storage => "StorageError",
            Kind::DataDirLocked => "DataDirLockedError",
            Kind::Closed => "ClosedError",
            Kind::Config => "ConfigError",
            Kind::Subscription => "SubscriptionError",
            Kind::Federation => "FederationError",
            Kind::Certificate => "CertificateError",
            Kind::ConnectionLost => "ConnectionLostError",
            Kind::BufferFull => "BufferFullError",
            Kind::Policy => "PolicyError",
            Kind::Forked => "ForkedProcessError",
            Kind::DataLoss => "DataLossError",
            Kind::Timeout => "KeyopTimeoutError",
            Kind::DataDirNotFound => "DataDirNotFoundError",
            Kind::ChannelNotFound => "ChannelNotFoundError",
        }
    }
}

static CLASSES: [PyOnceLock<Py<PyType>>; 18] = [
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
];

/// A Python exception of `kind` with `msg`.
pub fn new_err(py: Python<'_>, kind: Kind, msg: String) -> PyErr {
    let cell = &CLASSES[kind as usize];
    let class = cell.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let module = py.import("keyop_messenger.errors")?;
        Ok(module
            .getattr(kind.class_name())?
            .cast_into::<PyType>()?
            .unbind())
    });
    match class {
        Ok(cls) => PyErr::from_type(cls.bind(py).clone(), (msg,)),
        Err(e) => PyRuntimeError::new_err(format!(
            "{msg} (and keyop_messenger.errors failed to load: {e})"
        )),
    }
}

/// Maps an engine error onto its exception class.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    // A storage error also says its OS error (StorageError is an OSError).
    let errno = match &e {
        Error::Storage(s) => s.raw_os_error(),
        _ => None,
    };
    let kind = match &e {
        Error::InvalidName(_) => Kind::InvalidName,
        Error::TooLarge { .. } => Kind::MessageTooLarge,
        Error::InvalidRecord(RecordError::Field { .. }) => Kind::InvalidName,
        Error::InvalidRecord(RecordError::TooLarge { .. }) => Kind::MessageTooLarge,
        Error::InvalidRecord(_) => Kind::PayloadType,
        Error::Closed(_) => Kind::Closed,
        Error::Config(_) => Kind::Config,
        Error::Storage(StorageError::Locked(_)) => Kind::DataDirLocked,
        Error::Storage(StorageError::DataDirNotFound(_)) => Kind::DataDirNotFound,
        Error::Storage(StorageError::ChannelNotFound { .. }) => Kind::ChannelNotFound,
        Error::Storage(_) => Kind::Storage,
        Error::Subscription(_) => Kind::Subscription,
        Error::Federation(_) => Kind::Federation,
        Error::ConnectionLost(_) => Kind::ConnectionLost,
        Error::BufferFull(_) => Kind::BufferFull,
        Error::Policy(_) => Kind::Policy,
        Error::Forked(_) => Kind::Forked,
        Error::DataLoss(_) => Kind::DataLoss,
        Error::Timeout(_) => Kind::Timeout,
    };
    let err = new_err(py, kind, e.to_string());
    if let Some(code) = errno {
        let _ = err.value(py).setattr("errno", code);
    }
    err
}

/// Maps a certificate-tool error: file-system failures are storage errors,
/// everything else (bad input, unusable CA or key) a certificate error.
pub fn keygen_to_py(py: Python<'_>, e: keyop_core::keygen::KeygenError) -> PyErr {
    let kind = if e.is_io() {
        Kind::Storage
    } else {
        Kind::Certificate
    };
    new_err(py, kind, e.to_string())
}

/// `Result<T, Error>` into `PyResult<T>` with [`to_py`].
pub trait IntoPyResult<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}
