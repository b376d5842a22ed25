//! Certificate generation (`keyop_core::keygen`) for the `keyop-messenger
//! keygen` command. Argument conversion, GIL release and error mapping only.

use std::path::PathBuf;

use keyop_core::keygen::{self, InstanceRequest};
use pyo3::prelude::*;

use crate::errors::keygen_to_py;

/// File-system failures become `StorageError`; bad input material or
/// parameters become `ConfigError`.
/// Creates a self-signed CA (ECDSA P-384) and writes its certificate and key
/// (mode 0600); returns the four-line summary that `keygen ca` prints.
#[pyfunction]
#[pyo3(signature = (out_cert = PathBuf::from("ca.crt"), out_key = PathBuf::from("ca.key"), days = keygen::DEFAULT_DAYS, force = false))]
fn keygen_ca(
    py: Python<'_>,
    out_cert: PathBuf,
    out_key: PathBuf,
    days: i64,
    force: bool,
) -> PyResult<String> {
    py.detach(|| keygen::keygen_ca(&out_cert, &out_key, days, force))
        .map(|s| s.to_string())
        .map_err(|e| keygen_to_py(py, e))
}

/// Creates an instance certificate for `name` signed by the CA and writes it
/// and its key (mode 0600, default `<name>.crt` and `<name>.key`); returns
/// the four-line summary that `keygen instance` prints.
#[pyfunction]
#[pyo3(signature = (ca, ca_key, name, out_cert = None, out_key = None, days = keygen::DEFAULT_DAYS, force = false, sans = Vec::new()))]
#[allow(clippy::too_many_arguments)]
fn keygen_instance(
    py: Python<'_>,
    ca: PathBuf,
    ca_key: PathBuf,
    name: String,
    out_cert: Option<PathBuf>,
    out_key: Option<PathBuf>,
    days: i64,
    force: bool,
    sans: Vec<String>,
) -> PyResult<String> {
    let req = InstanceRequest {
        ca_cert: ca,
        ca_key,
        name,
        out_cert,
        out_key,
        days,
        force,
        extra_sans: sans,
    };
    py.detach(|| keygen::keygen_instance(&req))
        .map(|s| s.to_string())
        .map_err(|e| keygen_to_py(py, e))
}

/// Describes every certificate in the file (PEM, or one DER certificate):
/// subject, issuer, serial, validity, SHA-256 fingerprint, key type, CA flag
/// and SANs, one labelled line each; certificates are separated by a blank
/// line.
#[pyfunction]
fn inspect_cert(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    py.detach(|| keygen::inspect(&path))
        .map(|all| {
            all.iter()
                .map(|s| s.details())
                .collect::<Vec<_>>()
                .join("\n\n")
        })
        .map_err(|e| keygen_to_py(py, e))
}

/// Adds the keygen functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(keygen_ca, m)?)?;
    m.add_function(wrap_pyfunction!(keygen_instance, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_cert, m)?)?;
    Ok(())
}
