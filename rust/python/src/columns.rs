//! Columns in Arrow's buffer layout, to and from Python (the Spark data
//! source's Arrow batches): conversion only, the work is in
//! `keyop_core::columns`.

use std::path::PathBuf;
use std::sync::Mutex;

use keyop_core::columns::{
    parse_payload_fields as parse_fields, Column, ColumnBatch, ColumnReader, ColumnValues,
    FieldKind, TextColumn,
};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::errors::{new_err, IntoPyResult, Kind};
use crate::reader_gap;

/// Payloads encoded from columns, with one payload type and, optionally,
/// the ids `<id_prefix><first_row + i>`: what `publish_batch` takes in place
/// of a list of `(payload_type, payload)` items.
#[pyclass(module = "keyop_messenger._core", frozen)]
pub struct PayloadBatch {
    pub payload_type: String,
    pub json: Vec<u8>,
    pub ends: Vec<usize>,
    pub ids: Option<Vec<String>>,
}

#[pymethods]
impl PayloadBatch {
    fn __len__(&self) -> usize {
        self.ends.len()
    }

    /// The payloads as JSON text, one per row (for tests and debugging).
    fn payloads(&self) -> Vec<String> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let s = String::from_utf8_lossy(&self.json[start..end]).into_owned();
                start = end;
                s
            })
            .collect()
    }
}

impl PayloadBatch {
    /// `(payload_type, payload JSON)` pairs, as `publish_batch` takes them.
    pub fn pairs(&self) -> Vec<(&str, &[u8])> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let item = (self.payload_type.as_str(), &self.json[start..end]);
                start = end;
                item
            })
            .collect()
    }
}

/// Records framed by `encode_records`: ids, timestamps and the valid-record
/// checks fixed, ready for `Engine.publish_framed`.
/// Framing is most of a batch's publishing work; done before the data
/// directory is open, it runs in parallel with another process holding it.
/// Publishing moves the records out (no copy of the batch): a batch is
/// published once.
#[pyclass(module = "keyop_messenger._core", frozen)]
pub struct FramedBatch {
    framed: Mutex<Option<keyop_core::Framed>>,
    len: usize,
    channel: String,
    first_id: Option<String>,
    last_id: Option<String>,
}

impl FramedBatch {
    pub fn new(framed: keyop_core::Framed) -> Self {
        FramedBatch {
            len: framed.ids().len(),
            channel: framed.channel().to_owned(),
            first_id: framed.ids().first(),
            last_id: framed.ids().last(),
            framed: Mutex::new(Some(framed)),
        }
    }

    /// The records, moved out for publishing; refused once they were.
    pub fn take(&self) -> PyResult<keyop_core::Framed> {
        let mut slot = self.framed.lock().unwrap_or_else(|e| e.into_inner());
        slot.take().ok_or_else(|| {
            PyRuntimeError::new_err(format!(
                "this FramedBatch of {} records for channel {:?} was already handed to \
                 publish_framed, which moves its records out: encode the rows again",
                self.len, self.channel
            ))
        })
    }
}

#[pymethods]
impl FramedBatch {
    fn __len__(&self) -> usize {
        self.len
    }

    /// The channel the records were framed for.
    #[getter]
    fn channel(&self) -> &str {
        &self.channel
    }

    /// The first record's id (None for an empty batch).
    #[getter]
    fn first_id(&self) -> Option<&str> {
        self.first_id.as_deref()
    }

    /// The last record's id (None for an empty batch).
    #[getter]
    fn last_id(&self) -> Option<&str> {
        self.last_id.as_deref()
    }
}

type ColumnSpec<'py> = (
    String,
    String,
    usize,
    Option<Bound<'py, PyAny>>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
);

/// Encodes `rows` rows of `columns` as JSON objects. Each column is
/// `(name, kind, offset, validity, data, offsets)`: `kind` one of `bool`,
/// `int8`..`int64`, `float32`, `float64`, `utf8`, `timestamp_utc`,
/// `timestamp_ntz` (microseconds), `date32`; the buffers are Arrow's, as
/// `bytes` or immutable `pyarrow.Buffer`s (read in place, not copied)
/// (`validity` None when there are no nulls; `offsets` for `utf8` only);
/// `offset` the array's first row in them.
#[pyfunction]
#[pyo3(signature = (payload_type, columns, rows, *, id_prefix = None, first_row = 0))]
pub fn encode_columns(
    py: Python<'_>,
    payload_type: String,
    columns: Vec<ColumnSpec<'_>>,
    rows: usize,
    id_prefix: Option<&str>,
    first_row: u64,
) -> PyResult<PayloadBatch> {
    let cols = parse_columns(py, &columns)?;
    let mut json = Vec::with_capacity(rows * 64);
    let ends = py
        .detach(|| keyop_core::columns::encode_payloads(&cols, rows, &mut json))
        .map_err(|e| new_err(py, Kind::PayloadType, e.to_string()))?;
    let ids = id_prefix.map(|p| {
        (0..rows as u64)
            .map(|i| {
                let mut id = String::with_capacity(p.len() + 20);
                id.push_str(p);
                id.push_str(itoa::Buffer::new().format(first_row + i));
                id
            })
            .collect()
    });
    Ok(PayloadBatch {
        payload_type,
        json,
        ends,
        ids,
    })
}

/// Encodes `rows` rows of `columns` (see `encode_columns`) as records of
/// `channel` published by the instance named `origin`, with the ids
/// `<id_prefix><first_row + i>`, each payload written straight into its
/// record; raises what publishing them would (invalid names or fields, a
/// record over the size limit).
#[pyfunction]
#[pyo3(signature = (
    payload_type, columns, rows, *, origin, channel, id_prefix, first_row = 0,
    service_name = None, correlation_id = None
))]
#[allow(clippy::too_many_arguments)]
pub fn encode_records(
    py: Python<'_>,
    payload_type: &str,
    columns: Vec<ColumnSpec<'_>>,
    rows: usize,
    origin: &str,
    channel: &str,
    id_prefix: &str,
    first_row: u64,
    service_name: Option<&str>,
    correlation_id: Option<&str>,
) -> PyResult<FramedBatch> {
    let cols = parse_columns(py, &columns)?;
    let header = keyop_core::Outgoing {
        payload_type,
        payload_json: b"",
        service_name,
        correlation_id,
    };
    let framed = py
        .detach(|| {
            let writer = keyop_core::columns::PayloadWriter::new(&cols);
            keyop_core::frame_rows(
                origin,
                channel,
                &header,
                id_prefix,
                first_row,
                rows,
                |row, out| {
                    writer.write_row(row, out).map_err(|e| {
                        keyop_core::Error::InvalidRecord(
                            keyop_core::envelope::RecordError::Unreadable(e.to_string()),
                        )
                    })
                },
            )
        })
        .py_err(py)?;
    Ok(FramedBatch::new(framed))
}

/// The byte width of an `intN` or `floatN` kind (`int8`: 1, `float64`: 8).
fn byte_width(kind: &str) -> usize {
    let bits = kind.trim_start_matches(|c: char| c.is_ascii_alphabetic());
    bits.parse::<usize>().unwrap_or(64) / 8
}

/// The bytes of a column buffer: a `bytes` object, or an immutable
/// `pyarrow.Buffer` read in place.
fn buffer_bytes<'a>(py: Python<'_>, name: &str, obj: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes());
    }
    let bad = |what: &str| {
        new_err(
            py,
            Kind::PayloadType,
            format!("column {name:?}: a buffer must be bytes or an immutable pyarrow.Buffer, not {what}"),
        )
    };
    let is_arrow_buffer = match py.import("pyarrow") {
        Ok(arrow) => obj.is_instance(&arrow.getattr("Buffer")?)?,
        Err(_) => false, // without pyarrow nothing is a pyarrow.Buffer
    };
    if !is_arrow_buffer {
        return Err(bad(&obj.get_type().name()?.to_string()));
    }
    if obj.getattr("is_mutable")?.is_truthy()? {
        return Err(bad("a mutable one (pass buffer.to_pybytes())"));
    }
    let size: usize = obj.getattr("size")?.extract()?;
    if size == 0 {
        return Ok(&[]);
    }
    let address: usize = obj.getattr("address")?.extract()?;
    // SAFETY: a pyarrow.Buffer owns (or keeps alive) `size` bytes at
    // `address` for as long as the object lives, and `obj` is borrowed for
    // 'a, so the object outlives the slice. The buffer is immutable: no
    // Python code writes through it while the slice is read (also with the
    // GIL released). Bytes need no alignment.
    Ok(unsafe { std::slice::from_raw_parts(address as *const u8, size) })
}

/// The columns of an `encode_columns` call, checked.
fn parse_columns<'a>(py: Python<'_>, columns: &'a [ColumnSpec<'_>]) -> PyResult<Vec<Column<'a>>> {
    let bad = |msg: String| new_err(py, Kind::PayloadType, msg);
    let mut cols = Vec::with_capacity(columns.len());
    for (name, kind, offset, validity, data, offsets) in columns {
        let data = buffer_bytes(py, name, data)?;
        let values = match kind.as_str() {
            "bool" => ColumnValues::Bool(data),
            "int8" | "int16" | "int32" | "int64" => ColumnValues::Int {
                width: byte_width(kind),
                data,
            },
            "float32" | "float64" => ColumnValues::Float {
                width: byte_width(kind),
                data,
            },
            "utf8" => ColumnValues::Text {
                offsets: buffer_bytes(
                    py,
                    name,
                    offsets
                        .as_ref()
                        .ok_or_else(|| bad(format!("column {name:?}: utf8 needs offsets")))?,
                )?,
                data,
            },
            "timestamp_utc" => ColumnValues::TimestampMicros { data, utc: true },
            "timestamp_ntz" => ColumnValues::TimestampMicros { data, utc: false },
            "date32" => ColumnValues::Date32(data),
            other => {
                return Err(bad(format!(
                    "column {name:?}: kind {other:?} not supported"
                )))
            }
        };
        let validity = match validity {
            Some(v) => Some(buffer_bytes(py, name, v)?),
            None => None,
        };
        cols.push(Column {
            name,
            values,
            validity,
            offset: *offset,
        });
    }
    Ok(cols)
}

/// Batches of the records of a channel as Arrow buffers (see
/// `read_columns`).
#[pyclass(module = "keyop_messenger._core")]
pub struct ColumnIter {
    reader: ColumnReader,
    channel: String,
    skip_gaps: bool,
    batch_rows: usize,
}

fn text<'py>(py: Python<'py>, c: &TextColumn) -> Bound<'py, PyTuple> {
    let offsets: Vec<u8> = c.offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
    let validity = (c.nulls > 0).then(|| PyBytes::new(py, &c.validity));
    PyTuple::new(
        py,
        [
            PyBytes::new(py, &offsets).into_any(),
            PyBytes::new(py, &c.data).into_any(),
            validity.map_or_else(|| py.None().into_bound(py), |v| v.into_any()),
            c.nulls.into_pyobject(py).expect("int").into_any(),
        ],
    )
    .expect("tuple")
}

fn ints<'py>(py: Python<'py>, v: &[i64]) -> Bound<'py, PyBytes> {
    let b: Vec<u8> = v.iter().flat_map(|o| o.to_le_bytes()).collect();
    PyBytes::new(py, &b)
}

#[pymethods]
impl ColumnIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// `(rows, offset, segment, ts_micros, id, channel, origin, payload_type,
    /// service_name, correlation_id, payload)`: the numbers as `int64`
    /// buffers, each text column as `(offsets, data, validity or None,
    /// null count)`; each payload's JSON text ends with a line feed.
    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        loop {
            let rows = self.batch_rows;
            let reader = &mut self.reader;
            let found = py.detach(|| reader.next_batch(rows)).map_err(|e| {
                new_err(
                    py,
                    Kind::Storage,
                    format!("cannot read channel {:?}: {e}", self.channel),
                )
            })?;
            let cols = match found {
                None => return Ok(None),
                Some(ColumnBatch::Records(cols)) => cols,
                Some(ColumnBatch::Gap { from, to }) => {
                    let lost = reader_gap(py, &self.channel, from, to);
                    if self.skip_gaps {
                        continue;
                    }
                    return Err(lost);
                }
            };
            let items = [
                cols.rows.into_pyobject(py)?.into_any(),
                ints(py, &cols.offset).into_any(),
                ints(py, &cols.segment).into_any(),
                ints(py, &cols.ts_micros).into_any(),
                text(py, &cols.id).into_any(),
                text(py, &cols.channel).into_any(),
                text(py, &cols.origin).into_any(),
                text(py, &cols.payload_type).into_any(),
                text(py, &cols.service_name).into_any(),
                text(py, &cols.correlation_id).into_any(),
                text(py, &cols.payload).into_any(),
            ];
            return Ok(Some(PyTuple::new(py, items)?));
        }
    }
}

/// Reads the records of `channel` in `data_dir` from the record boundary
/// `start_offset`, up to records ending at or before `until`, in batches of
/// at most `batch_rows` as Arrow buffers (see `ColumnIter.__next__`).
/// Unreadable records are quarantined and passed over; a gap raises
/// `DataLossError` unless `skip_gaps`.
#[pyfunction]
#[pyo3(signature = (data_dir, channel, start_offset, until, *, skip_gaps = false, batch_rows = 8192))]
pub fn read_columns(
    py: Python<'_>,
    data_dir: PathBuf,
    channel: &str,
    start_offset: u64,
    until: u64,
    skip_gaps: bool,
    batch_rows: usize,
) -> PyResult<ColumnIter> {
    let reader = ColumnReader::open(&data_dir, channel, start_offset, until).py_err(py)?;
    Ok(ColumnIter {
        reader,
        channel: channel.to_owned(),
        skip_gaps,
        batch_rows: batch_rows.max(1),
    })
}

/// Parses `rows` payloads, the JSON values of `data` (a `read_columns`
/// payload column's data), into one column per `(name, kind)` of `fields`,
/// `kind` one of `utf8`, `bool`, `int8`..`int64`, `float32`, `float64`,
/// `timestamp_utc` (microseconds). Each column is `(data, offsets or None,
/// validity or None, null count)` in Arrow's layout. `None` when some value
/// is not a plain one of its kind (`keyop_core::columns::parse_payload_fields`):
/// the caller's general conversion then decides.
#[pyfunction]
pub fn parse_payload_fields<'py>(
    py: Python<'py>,
    data: &[u8],
    rows: usize,
    fields: Vec<(String, String)>,
) -> PyResult<Option<Vec<Bound<'py, PyTuple>>>> {
    let mut specs = Vec::with_capacity(fields.len());
    for (name, kind) in &fields {
        let kind = match kind.as_str() {
            "utf8" => FieldKind::Text,
            "bool" => FieldKind::Bool,
            "int8" | "int16" | "int32" | "int64" => FieldKind::Int(byte_width(kind)),
            "float32" | "float64" => FieldKind::Float(byte_width(kind)),
            "timestamp_utc" => FieldKind::TimestampMicros,
            other => {
                return Err(new_err(
                    py,
                    Kind::PayloadType,
                    format!("field {name:?}: kind {other:?} not supported"),
                ))
            }
        };
        specs.push((name.as_str(), kind));
    }
    let Some(columns) = py.detach(|| parse_fields(data, rows, &specs)) else {
        return Ok(None);
    };
    let none = || py.None().into_bound(py);
    let tuples = columns
        .iter()
        .map(|c| {
            let offsets = (c.kind == FieldKind::Text).then(|| {
                let b: Vec<u8> = c.offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
                PyBytes::new(py, &b).into_any()
            });
            let validity = (c.nulls > 0).then(|| PyBytes::new(py, &c.validity).into_any());
            PyTuple::new(
                py,
                [
                    PyBytes::new(py, &c.data).into_any(),
                    offsets.unwrap_or_else(none),
                    validity.unwrap_or_else(none),
                    c.nulls.into_pyobject(py)?.into_any(),
                ],
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(Some(tuples))
}
