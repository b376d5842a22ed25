//! Python values to compact JSON, written straight into the record buffer.
//!
//! Handles `None`, `bool`, `int`, `float`, `str`, `dict` (str keys), `list`
//! and `tuple` natively; anything else is passed to the `default` callable
//! (as `json.dumps` does) and its result encoded instead.

use std::collections::HashMap;
use std::fmt;

use foldhash::fast::RandomState;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use keyop_core::envelope::push_json_str;

use crate::errors::{new_err, Kind};

/// Nesting of arrays and objects allowed in a payload: the engine's one
/// definition (`keyop_core::envelope::MAX_PAYLOAD_DEPTH`).
const MAX_DEPTH: u32 = keyop_core::envelope::MAX_PAYLOAD_DEPTH as u32;

fn type_err(py: Python<'_>, msg: String) -> PyErr {
    new_err(py, Kind::PayloadType, msg)
}

/// Appends the JSON encoding of `obj` to `out`.
pub fn write_json(
    obj: &Bound<'_, PyAny>,
    out: &mut Vec<u8>,
    default: Option<&Bound<'_, PyAny>>,
    depth: u32,
) -> PyResult<()> {
    let py = obj.py();
    // `depth` counts the arrays and objects around `obj` (and `default`
    // calls, which bounds a `default` that never returns plain data).
    if depth > MAX_DEPTH {
        return Err(type_err(
            py,
            format!(
                "payload is nested deeper than {MAX_DEPTH} levels of arrays and objects (or contains a cycle); flatten it"
            ),
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
        push_json_str(out, text);
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
            push_json_str(out, text);
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

/// Builds Python objects from stored JSON, reusing the `str` objects of
/// strings that repeat from record to record: dict keys and the envelope's
/// channel, origin, payload type and service name. Reused strings are neither
/// allocated nor hashed again.
#[derive(Default)]
pub struct PyDecoder {
    keys: HashMap<Box<str>, Py<PyString>, RandomState>,
    fields: [Option<(Box<str>, Py<PyString>)>; FIELDS],
}

/// Envelope fields [`PyDecoder::field`] remembers the last value of.
pub const CHANNEL: usize = 0;
pub const ORIGIN: usize = 1;
pub const PAYLOAD_TYPE: usize = 2;
pub const SERVICE_NAME: usize = 3;
const FIELDS: usize = 4;

/// Keys longer than this are not cached (they rarely repeat).
const MAX_CACHED_KEY: usize = 64;
/// The key cache is emptied when it reaches this size.
const MAX_CACHED_KEYS: usize = 1024;

impl PyDecoder {
    /// The value of envelope field `slot` (one of [`CHANNEL`], ...), as the
    /// same `str` object as last time when it did not change.
    pub fn field<'py>(&mut self, py: Python<'py>, slot: usize, text: &str) -> Bound<'py, PyString> {
        match &self.fields[slot] {
            Some((last, obj)) if **last == *text => obj.bind(py).clone(),
            _ => {
                let obj = PyString::new(py, text);
                self.fields[slot] = Some((text.into(), obj.clone().unbind()));
                obj
            }
        }
    }

    /// Python objects from JSON text (the reverse of [`write_json`]):
    /// objects become dicts, arrays lists, numbers int or float.
    pub fn payload<'py>(&mut self, py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
        if has_long_digit_run(text) {
            // Integers beyond 64 bits keep every digit through Python's parser.
            return py.import("json")?.call_method1("loads", (text,));
        }
        let mut de = serde_json::Deserializer::from_str(text);
        let parsed = ValueSeed {
            py,
            keys: &mut self.keys,
        }
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v));
        match parsed {
            Ok(value) => Ok(value),
            // JSON text may escape lone UTF-16 surrogates ("\ud800"), which
            // Rust strings cannot hold and Python's parser turns into str.
            Err(e) if text.contains("\\u") => py
                .import("json")?
                .call_method1("loads", (text,))
                .map_err(|_| type_err(py, format!("payload is not valid JSON: {e}"))),
            Err(e) => Err(type_err(py, format!("payload is not valid JSON: {e}"))),
        }
    }
}

/// Builds one Python value straight from the JSON token stream.
struct ValueSeed<'a, 'py> {
    py: Python<'py>,
    keys: &'a mut HashMap<Box<str>, Py<PyString>, RandomState>,
}

impl<'py> ValueSeed<'_, 'py> {
    /// A seed for a nested value, sharing the key cache.
    fn value(&mut self) -> ValueSeed<'_, 'py> {
        ValueSeed {
            py: self.py,
            keys: &mut *self.keys,
        }
    }

    /// A seed for a dict key, sharing the key cache.
    fn key(&mut self) -> KeySeed<'_, 'py> {
        KeySeed(self.value())
    }
}

impl<'de, 'py> DeserializeSeed<'de> for ValueSeed<'_, 'py> {
    type Value = Bound<'py, PyAny>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

fn py_err<E: de::Error>(e: PyErr) -> E {
    E::custom(e)
}

impl<'de, 'py> Visitor<'de> for ValueSeed<'_, 'py> {
    type Value = Bound<'py, PyAny>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(self.py.None().into_bound(self.py))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(PyBool::new(self.py, v).to_owned().into_any())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(PyInt::new(self.py, v).into_any())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(PyInt::new(self.py, v).into_any())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(PyFloat::new(self.py, v).into_any())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PyString::new(self.py, v).into_any())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Self::Value, A::Error> {
        let list = PyList::empty(self.py);
        while let Some(item) = seq.next_element_seed(self.value())? {
            list.append(item).map_err(py_err)?;
        }
        Ok(list.into_any())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Self::Value, A::Error> {
        let dict = PyDict::new(self.py);
        while let Some(key) = map.next_key_seed(self.key())? {
            let value = map.next_value_seed(self.value())?;
            dict.set_item(key, value).map_err(py_err)?;
        }
        Ok(dict.into_any())
    }
}

/// A dict key: a cached `str` object when the key was seen before.
struct KeySeed<'a, 'py>(ValueSeed<'a, 'py>);

impl<'de, 'py> DeserializeSeed<'de> for KeySeed<'_, 'py> {
    type Value = Bound<'py, PyString>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de, 'py> Visitor<'de> for KeySeed<'_, 'py> {
    type Value = Bound<'py, PyString>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let ValueSeed { py, keys } = self.0;
        if v.len() > MAX_CACHED_KEY {
            return Ok(PyString::new(py, v));
        }
        if let Some(obj) = keys.get(v) {
            return Ok(obj.bind(py).clone());
        }
        if keys.len() >= MAX_CACHED_KEYS {
            keys.clear();
        }
        let obj = PyString::new(py, v);
        keys.insert(v.into(), obj.clone().unbind());
        Ok(obj)
    }
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
