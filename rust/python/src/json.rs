//! Python values to compact JSON, written straight into the record buffer.
//!
//! Handles `None`, `bool`, `int`, `float`, `str`, `dict` (str keys), `list`
//! and `tuple` natively; anything else is passed to the `default` callable
//! (as `json.dumps` does) and its result encoded instead.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::{new_err, Kind};

const MAX_DEPTH: u32 = 200;

fn type_err(py: Python<'_>, msg: String) -> PyErr {
    new_err(py, Kind::PayloadType, msg)
}

fn push_str(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("string serialisation into a Vec");
}

/// Appends the JSON encoding of `obj` to `out`.
pub fn write_json(
    obj: &Bound<'_, PyAny>,
    out: &mut Vec<u8>,
    default: Option<&Bound<'_, PyAny>>,
    depth: u32,
) -> PyResult<()> {
    let py = obj.py();
    if depth > MAX_DEPTH {
        return Err(type_err(
            py,
            format!("payload is nested deeper than {MAX_DEPTH} levels (or contains a cycle)"),
        ));
    }
    if obj.is_none() {
        out.extend_from_slice(b"null");
    } else if let Ok(s) = obj.cast::<PyString>() {
        let text = s.to_str().map_err(|e| {
            type_err(
                py,
                format!("payload text is not valid Unicode (lone surrogate?): {e}"),
            )
        })?;
        push_str(out, text);
    } else if let Ok(b) = obj.cast::<PyBool>() {
        out.extend_from_slice(if b.is_true() { b"true" } else { b"false" });
    } else if let Ok(i) = obj.cast::<PyInt>() {
        if let Ok(v) = i.extract::<i64>() {
            out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
        } else {
            // Arbitrary-precision integers keep all their digits.
            out.extend_from_slice(i.str()?.to_str()?.as_bytes());
        }
    } else if let Ok(f) = obj.cast::<PyFloat>() {
        let v = f.value();
        if !v.is_finite() {
            return Err(type_err(
                py,
                format!("payload contains {v}, which JSON cannot represent"),
            ));
        }
        serde_json::to_writer(&mut *out, &v).expect("finite float serialisation");
    } else if let Ok(d) = obj.cast::<PyDict>() {
        out.push(b'{');
        for (n, (k, v)) in d.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            let key = k.cast::<PyString>().map_err(|_| {
                type_err(
                    py,
                    format!(
                        "payload dict keys must be str, got {}",
                        k.get_type()
                            .name()
                            .map(|n| n.to_string())
                            .unwrap_or_default()
                    ),
                )
            })?;
            let text = key.to_str().map_err(|e| {
                type_err(
                    py,
                    format!("payload key is not valid Unicode (lone surrogate?): {e}"),
                )
            })?;
            push_str(out, text);
            out.push(b':');
            write_json(&v, out, default, depth + 1)?;
        }
        out.push(b'}');
    } else if let Ok(l) = obj.cast::<PyList>() {
        write_seq(l.iter(), out, default, depth)?;
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        write_seq(t.iter(), out, default, depth)?;
    } else if let Some(f) = default {
        let plain = f.call1((obj,))?;
        if plain.is(obj) {
            return Err(type_err(
                py,
                "payload default function returned its input".into(),
            ));
        }
        write_json(&plain, out, default, depth + 1)?;
    } else {
        let name = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        return Err(type_err(
            py,
            format!("{name} values cannot be encoded as JSON"),
        ));
    }
    Ok(())
}

fn write_seq<'py>(
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    out: &mut Vec<u8>,
    default: Option<&Bound<'py, PyAny>>,
    depth: u32,
) -> PyResult<()> {
    out.push(b'[');
    for (n, item) in items.enumerate() {
        if n > 0 {
            out.push(b',');
        }
        write_json(&item, out, default, depth + 1)?;
    }
    out.push(b']');
    Ok(())
}

/// Builds Python objects from JSON text (the reverse of [`write_json`]):
/// objects become dicts, arrays lists, numbers int or float.
pub fn json_to_py<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    if has_long_digit_run(text) {
        // Integers beyond 64 bits keep every digit through Python's parser.
        return py.import("json")?.call_method1("loads", (text,));
    }
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| type_err(py, format!("payload is not valid JSON: {e}")))?;
    value_to_py(py, &value)
}

fn value_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use pyo3::IntoPyObjectExt;
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_bound_py_any(py)?,
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                i.into_bound_py_any(py)?
            } else if let Some(u) = n.as_u64() {
                u.into_bound_py_any(py)?
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_bound_py_any(py)?
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(value_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, item) in map {
                dict.set_item(k, value_to_py(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

/// Whether `text` holds 19 or more consecutive digits (a number that may not
/// fit in 64 bits: `-9223372036854775809` has 19).
fn has_long_digit_run(text: &str) -> bool {
    let mut run = 0;
    for b in text.bytes() {
        if b.is_ascii_digit() {
            run += 1;
            if run >= 19 {
                return true;
            }
        } else {
            run = 0;
        }
    }
    false
}
