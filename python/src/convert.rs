//! Python values in and out: piece and target descriptions, objects, options and reports.
//!
//! A piece or target arrives as a tuple
//! `(key, dtype, global_shape, offset | None, local_shape | None, (start, stop) | None,
//!   replica | cast, address, nbytes)`:
//! a box (`offset` and `local_shape`) or a flat range of the C-order flattening, the memory
//! as an address and a length. For a piece the seventh field is the replica id (`None` for
//! an automatic replica); for a target it is whether float conversion is accepted.

use std::collections::HashSet;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use zarrckpt::{
    Cast, Compression, DType, Error, LoadOptions, LoadReport, LoadTarget, ObjectRequest,
    ObjectValue, ReadMethod, Region, Replica, SaveOptions, SaveReport, ShardedTensor, StateObject,
    StrictMode, TensorKey,
};

/// Memory the caller owns for the duration of a call.
#[derive(Clone, Copy)]
pub(crate) struct RawMut {
    address: usize,
    nbytes: usize,
}

impl RawMut {
    pub(crate) fn new(address: usize, nbytes: usize) -> PyResult<Self> {
        if address == 0 && nbytes != 0 {
            return Err(PyValueError::new_err("null address for a non-empty buffer"));
        }
        if isize::try_from(nbytes).is_err() {
            return Err(PyValueError::new_err("buffer too large"));
        }
        Ok(RawMut { address, nbytes })
    }

    /// # Safety
    /// `nbytes` bytes at `address` must be readable for the lifetime chosen.
    pub(crate) unsafe fn slice_ref<'a>(self) -> &'a [u8] {
        if self.nbytes == 0 {
            return &[];
        }
        // SAFETY: per the function's contract.
        unsafe { std::slice::from_raw_parts(self.address as *const u8, self.nbytes) }
    }

    /// # Safety
    /// `nbytes` bytes at `address` must be writable, and not otherwise accessed, for the
    /// lifetime chosen.
    pub(crate) unsafe fn slice<'a>(self) -> &'a mut [u8] {
        if self.nbytes == 0 {
            return &mut [];
        }
        // SAFETY: per the function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.address as *mut u8, self.nbytes) }
    }
}

fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| {
        let all: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        PyValueError::new_err(format!(
            "data type `{name}` is not supported; supported: {}",
            all.join(", ")
        ))
    })
}

/// One piece or target, as described from Python.
struct Spec {
    key: String,
    dtype: DType,
    global_shape: Vec<u64>,
    /// A box (offset, local shape), or a flat range.
    place: Place,
    mem: RawMut,
}

enum Place {
    Box(Vec<u64>, Vec<u64>),
    Flat(u64, u64),
}

fn spec_of<'py>(item: &Bound<'py, PyAny>) -> PyResult<(Spec, Bound<'py, PyAny>)> {
    let t = item.cast::<PyTuple>()?;
    if t.len() != 9 {
        return Err(PyValueError::new_err(format!(
            "a piece is a 9-tuple, got {} fields",
            t.len()
        )));
    }
    let key: String = t.get_item(0)?.extract()?;
    let dtype = dtype(&t.get_item(1)?.extract::<String>()?)?;
    let global_shape: Vec<u64> = t.get_item(2)?.extract()?;
    let offset: Option<Vec<u64>> = t.get_item(3)?.extract()?;
    let shape: Option<Vec<u64>> = t.get_item(4)?.extract()?;
    let flat: Option<(u64, u64)> = t.get_item(5)?.extract()?;
    let extra = t.get_item(6)?;
    let address: usize = t.get_item(7)?.extract()?;
    let nbytes: usize = t.get_item(8)?.extract()?;
    let place = match (offset, shape, flat) {
        (Some(o), Some(s), None) => Place::Box(o, s),
        (None, None, Some((a, b))) => Place::Flat(a, b),
        _ => {
            return Err(PyValueError::new_err(format!(
                "`{key}`: give either an offset and a local shape, or a flat range"
            )));
        }
    };
    Ok((
        Spec {
            key,
            dtype,
            global_shape,
            place,
            mem: RawMut::new(address, nbytes)?,
        },
        extra,
    ))
}

/// The pieces of a save, extracted while the GIL is held.
pub(crate) struct SaveSpec(Vec<(Spec, Replica)>);

impl SaveSpec {
    pub(crate) fn extract(list: &Bound<'_, PyList>) -> PyResult<Self> {
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            let (spec, extra) = spec_of(&item)?;
            let replica = if extra.is_none() {
                Replica::Auto
            } else {
                Replica::Id(extra.extract()?)
            };
            out.push((spec, replica));
        }
        Ok(SaveSpec(out))
    }
}

/// The pieces to hand to zarrckpt. Flat pieces are handed in as the boxes of their
/// decomposition, which `zarrckpt::save` does itself but `Saver` (repeated and asynchronous
/// saves) does not.
pub(crate) fn pieces_of(spec: &SaveSpec) -> Result<Vec<ShardedTensor<'_>>, Error> {
    let pieces = pieces_as_given(spec)?;
    Ok(if pieces.iter().any(|p| p.flat_range().is_some()) {
        zarrckpt::model::tensor::expand_flat_pieces(&pieces)
    } else {
        pieces
    })
}

fn pieces_as_given(spec: &SaveSpec) -> Result<Vec<ShardedTensor<'_>>, Error> {
    spec.0
        .iter()
        .map(|(s, replica)| {
            let key = TensorKey::new(s.key.as_str())?;
            // SAFETY: the Python caller keeps the memory alive and unchanged for the call.
            let data = unsafe { s.mem.slice_ref() };
            let piece = match &s.place {
                Place::Box(offset, shape) => ShardedTensor::new(
                    key,
                    s.dtype,
                    s.global_shape.clone(),
                    checked_region(s.key.as_str(), offset, shape)?,
                    0,
                    data,
                )?,
                Place::Flat(a, b) => {
                    ShardedTensor::from_flat(key, s.dtype, s.global_shape.clone(), *a..*b, 0, data)?
                }
            };
            Ok(piece.with_replica(*replica))
        })
        .collect()
}

/// The box a Python caller gave for tensor `key`, checked (equal lengths, at most
/// `MAX_DIMS` dimensions, no end past `u64`): a typed error otherwise.
fn checked_region(key: &str, offset: &[u64], shape: &[u64]) -> Result<Region, Error> {
    Region::new(offset.to_vec(), shape.to_vec()).map_err(|source| {
        Error::Tensor(zarrckpt::TensorError::Region {
            key: key.to_string(),
            source,
        })
    })
}

/// The targets of a load, extracted while the GIL is held.
pub(crate) struct LoadSpec(Vec<(Spec, bool)>);

impl LoadSpec {
    pub(crate) fn extract(list: &Bound<'_, PyList>) -> PyResult<Self> {
        let mut out = Vec::with_capacity(list.len());
        let mut seen = HashSet::new();
        for item in list.iter() {
            let (spec, extra) = spec_of(&item)?;
            // Two targets writing the same memory would be two mutable borrows of it.
            if spec.mem.nbytes > 0 && !seen.insert(spec.mem.address) {
                return Err(PyValueError::new_err(format!(
                    "`{}`: two load targets share the memory at {:#x}",
                    spec.key, spec.mem.address
                )));
            }
            out.push((spec, extra.extract::<bool>()?));
        }
        Ok(LoadSpec(out))
    }
}

/// The targets to hand to zarrckpt.
pub(crate) fn targets_of(spec: &LoadSpec) -> Result<Vec<LoadTarget<'_>>, Error> {
    spec.0
        .iter()
        .map(|(s, cast)| {
            let key = TensorKey::new(s.key.as_str())?;
            // SAFETY: the Python caller keeps the memory alive for the call and hands in
            // disjoint buffers (checked for equal addresses above, by `_core` for overlaps).
            let buf = unsafe { s.mem.slice() };
            let t = match &s.place {
                Place::Box(offset, shape) => LoadTarget::new(
                    key,
                    s.dtype,
                    s.global_shape.clone(),
                    checked_region(s.key.as_str(), offset, shape)?,
                    buf,
                )?,
                Place::Flat(a, b) => {
                    LoadTarget::from_flat(key, s.dtype, s.global_shape.clone(), *a..*b, buf)?
                }
            };
            Ok(if *cast {
                t.with_cast(Cast::FloatConvert)
            } else {
                t
            })
        })
        .collect()
}

fn json_value(key: &str, text: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(text)
        .map_err(|e| PyValueError::new_err(format!("object `{key}`: not JSON: {e}")))
}

fn grid_of(v: Option<Vec<u64>>, what: &str, key: &str) -> PyResult<Vec<u64>> {
    v.ok_or_else(|| {
        PyValueError::new_err(format!("object `{key}`: a sharded object needs a {what}"))
    })
}

/// An object to save, as described from Python.
type ObjectTuple<'py> = (
    String,
    String,
    Option<Vec<u64>>,
    Option<Vec<u64>>,
    Bound<'py, PyAny>,
);

/// An object request, as described from Python.
type RequestTuple = (
    String,
    String,
    Option<u64>,
    Option<Vec<u64>>,
    Option<Vec<u64>>,
);

/// Objects to save: tuples `(key, scope, grid | None, index | None, value)` where the value
/// is `str` (JSON text) or `bytes`.
pub(crate) fn save_objects(list: &Bound<'_, PyList>) -> PyResult<Vec<StateObject>> {
    let py = list.py();
    list.iter()
        .map(|item| {
            let (key, scope, grid, index, value): ObjectTuple<'_> = item.extract()?;
            let value = if let Ok(b) = value.cast::<PyBytes>() {
                ObjectValue::Bytes(b.as_bytes().to_vec())
            } else if let Ok(s) = value.cast::<PyString>() {
                ObjectValue::Json(json_value(&key, s.to_str()?)?)
            } else {
                return Err(PyValueError::new_err(format!(
                    "object `{key}`: the value must be JSON text or bytes"
                )));
            };
            let obj = match scope.as_str() {
                "common" => StateObject::common(&key, value),
                "per_rank" => StateObject::per_rank(&key, value),
                "sharded" => StateObject::sharded(
                    &key,
                    &grid_of(grid, "grid", &key)?,
                    &grid_of(index, "shard index", &key)?,
                    value,
                ),
                other => {
                    return Err(PyValueError::new_err(format!(
                        "object `{key}`: unknown scope `{other}` (common, per_rank, sharded)"
                    )));
                }
            };
            obj.map_err(|e| crate::errors::to_py(py, &Error::Object(e), None))
        })
        .collect()
}

/// Object requests: tuples `(key, scope, rank | None, grid | None, index | None)`.
pub(crate) fn object_requests(list: &Bound<'_, PyList>) -> PyResult<Vec<ObjectRequest>> {
    let py = list.py();
    list.iter()
        .map(|item| {
            let (key, scope, rank, grid, index): RequestTuple = item.extract()?;
            let r = match scope.as_str() {
                "common" => ObjectRequest::common(&key),
                "per_rank" => ObjectRequest::rank(
                    &key,
                    rank.ok_or_else(|| {
                        PyValueError::new_err(format!(
                            "object `{key}`: a per-rank request needs a rank"
                        ))
                    })?,
                ),
                "sharded" => ObjectRequest::shard(
                    &key,
                    &grid_of(grid, "grid", &key)?,
                    &grid_of(index, "shard index", &key)?,
                ),
                other => {
                    return Err(PyValueError::new_err(format!(
                        "object `{key}`: unknown scope `{other}` (common, per_rank, sharded)"
                    )));
                }
            };
            r.map_err(|e| crate::errors::to_py(py, &Error::Object(e), None))
        })
        .collect()
}

fn check_keys(options: &Bound<'_, PyDict>, known: &[&str], what: &str) -> PyResult<()> {
    for k in options.keys() {
        let k: String = k.extract()?;
        if !known.contains(&k.as_str()) {
            return Err(PyValueError::new_err(format!(
                "unknown {what} option `{k}`; known: {}",
                known.join(", ")
            )));
        }
    }
    Ok(())
}

/// The option `key`, if given and not None.
fn opt<'py>(options: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(options.get_item(key)?.filter(|v| !v.is_none()))
}

fn get_bool(options: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<bool>> {
    opt(options, key)?.map(|v| v.extract::<bool>()).transpose()
}

fn get_u64(options: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<u64>> {
    opt(options, key)?.map(|v| v.extract::<u64>()).transpose()
}

fn get_usize(options: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<usize>> {
    opt(options, key)?.map(|v| v.extract::<usize>()).transpose()
}

fn get_str(options: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<String>> {
    opt(options, key)?
        .map(|v| v.extract::<String>())
        .transpose()
}

pub(crate) fn compression_name(c: Compression) -> &'static str {
    match c {
        Compression::None => "none",
        Compression::Zstd => "zstd",
        Compression::Blosc => "blosc",
    }
}

/// Save options from a dict: overwrite, compression (none, zstd, blosc), io_threads,
/// balance_replicas, subchunk_bytes, user_metadata (JSON text of an object).
pub(crate) fn save_options(options: &Bound<'_, PyDict>) -> PyResult<SaveOptions> {
    check_keys(
        options,
        &[
            "overwrite",
            "compression",
            "io_threads",
            "balance_replicas",
            "subchunk_bytes",
            "user_metadata",
        ],
        "save",
    )?;
    let mut o = SaveOptions::default();
    if let Some(v) = get_bool(options, "overwrite")? {
        o.overwrite = v;
    }
    if let Some(v) = get_str(options, "compression")? {
        o.compression = match v.as_str() {
            "none" => Compression::None,
            "zstd" => Compression::Zstd,
            "blosc" => Compression::Blosc,
            other => {
                return Err(PyValueError::new_err(format!(
                    "compression `{other}`: none, zstd or blosc"
                )));
            }
        };
    }
    if let Some(v) = get_usize(options, "io_threads")? {
        o.io_threads = v;
    }
    if let Some(v) = get_bool(options, "balance_replicas")? {
        o.balance_replicas = v;
    }
    if let Some(v) = get_u64(options, "subchunk_bytes")? {
        o.grid.subchunk_target_bytes = v;
    }
    if let Some(v) = get_str(options, "user_metadata")? {
        match json_value("user_metadata", &v)? {
            serde_json::Value::Object(m) => o.user_metadata = m,
            _ => return Err(PyValueError::new_err("user_metadata must be a JSON object")),
        }
    }
    Ok(o)
}

/// Load options from a dict: strict, io_threads, exchange, read_method (pread, mmap).
pub(crate) fn load_options(options: &Bound<'_, PyDict>) -> PyResult<LoadOptions> {
    check_keys(
        options,
        &["strict", "io_threads", "exchange", "read_method"],
        "load",
    )?;
    let mut o = LoadOptions::default();
    if let Some(v) = get_str(options, "strict")? {
        o.strict = match v.as_str() {
            "assume_ok_unexpected" => StrictMode::AssumeOkUnexpected,
            "log_unexpected" => StrictMode::LogUnexpected,
            "log_all" => StrictMode::LogAll,
            "raise_unexpected" => StrictMode::RaiseUnexpected,
            "raise_all" => StrictMode::RaiseAll,
            "return_unexpected" => StrictMode::ReturnUnexpected,
            "return_all" => StrictMode::ReturnAll,
            "ignore_all" => StrictMode::IgnoreAll,
            other => {
                return Err(PyValueError::new_err(format!(
                    "strict mode `{other}`: assume_ok_unexpected, log_unexpected, log_all, \
                     raise_unexpected, raise_all, return_unexpected, return_all or ignore_all"
                )));
            }
        };
    }
    if let Some(v) = get_usize(options, "io_threads")? {
        o.io_threads = v;
    }
    if let Some(v) = get_bool(options, "exchange")? {
        o.exchange = v;
    }
    if let Some(v) = get_str(options, "read_method")? {
        o.read_method = match v.as_str() {
            "pread" => ReadMethod::Pread,
            "mmap" => ReadMethod::Mmap,
            other => {
                return Err(PyValueError::new_err(format!(
                    "read_method `{other}`: pread or mmap"
                )));
            }
        };
    }
    Ok(o)
}

pub(crate) fn save_report(py: Python<'_>, r: &SaveReport) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tensors", r.tensors)?;
    d.set_item("chunks_written", r.chunks_written)?;
    d.set_item("data_bytes", r.data_bytes)?;
    d.set_item("file_bytes", r.file_bytes)?;
    d.set_item("assigned_bytes", r.assigned_bytes)?;
    d.set_item("write_balance", r.write_balance)?;
    d.set_item("plan_s", r.plan_time.as_secs_f64())?;
    d.set_item("gathered_bytes", r.gathered_bytes)?;
    d.set_item("plan_reused", r.plan_reused)?;
    Ok(d.unbind())
}

/// An object value on its way to Python: `("json", text)` or `("bytes", bytes)`, or None.
pub(crate) struct ObjectOut(pub(crate) Option<ObjectValue>);

impl ObjectOut {
    pub(crate) fn into_tuple(self, py: Python<'_>) -> PyResult<Py<PyTuple>> {
        match self.0 {
            Some(ObjectValue::Json(v)) => Ok(PyTuple::new(
                py,
                [
                    PyString::new(py, "json").into_any(),
                    PyString::new(py, &v.to_string()).into_any(),
                ],
            )?
            .unbind()),
            Some(ObjectValue::Bytes(b)) => Ok(PyTuple::new(
                py,
                [
                    PyString::new(py, "bytes").into_any(),
                    PyBytes::new(py, &b).into_any(),
                ],
            )?
            .unbind()),
            None => Err(PyValueError::new_err("no value")),
        }
    }
}

pub(crate) fn load_report(py: Python<'_>, r: &LoadReport) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("loaded_bytes", r.loaded_bytes)?;
    d.set_item("bytes_read", r.bytes_read)?;
    d.set_item("bytes_received", r.bytes_received)?;
    d.set_item("bytes_sent", r.bytes_sent)?;
    let keys = |ks: &[TensorKey]| ks.iter().map(|k| k.as_str().to_owned()).collect::<Vec<_>>();
    d.set_item("unexpected", keys(&r.unexpected))?;
    d.set_item("missing", keys(&r.missing))?;
    let objects = PyList::empty(py);
    for o in &r.objects {
        match o {
            Some(v) => objects.append(ObjectOut(Some(v.clone())).into_tuple(py)?)?,
            None => objects.append(py.None())?,
        }
    }
    d.set_item("objects", objects)?;
    Ok(d.unbind())
}
