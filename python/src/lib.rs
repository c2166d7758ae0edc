//! `zarrckpt._native`: the Python extension over the zarrckpt crate.
//!
//! Internal to the `zarrckpt` Python package: its pure-Python layer (`zarrckpt._core`) is the
//! only caller. Tensor data crosses as raw addresses and byte lengths of memory the caller
//! owns and keeps alive for the duration of the call (torch CPU tensors, numpy arrays): no
//! copy in either direction, and every dtype (bf16 and fp8 included) is just bytes. The GIL
//! is released while zarrckpt plans, reads and writes; a communicator implemented in Python
//! (`zarrckpt._core.TorchComm`) is called back with the GIL re-acquired. Every zarrckpt
//! error becomes a Python exception carrying the crate's full message (key, chunk, rank,
//! path) and its kind.

mod collectives;
mod comm;
mod conversion;
mod convert;
mod device;
mod errors;
mod manager;
mod transfer;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use zarrckpt::{
    Checkpoint as RsCheckpoint, Communicator, IfBusy, LocalComm, ObjectSlot,
    SaveHandle as RsHandle, Saver as RsSaver, SaverOptions, TensorKey,
};

use crate::comm::PyComm;
use crate::convert::{
    LoadSpec, ObjectOut, SaveSpec, load_options, object_requests, pieces_of, save_objects,
    save_options, targets_of,
};
use crate::errors::to_py;

/// The communicator of a call: a Python one (several ranks) or a single rank.
#[derive(Clone)]
pub(crate) struct Comm {
    dynamic: Arc<dyn Communicator>,
    python: Option<Arc<PyComm>>,
}

impl Comm {
    /// The Python exception for an error of a call on this communicator.
    pub(crate) fn err(&self, py: Python<'_>, e: &zarrckpt::Error) -> PyErr {
        to_py(py, e, self.python.as_deref())
    }
}

pub(crate) fn communicator(comm: Option<&Bound<'_, PyAny>>) -> PyResult<Comm> {
    Ok(match comm {
        Some(c) if c.is_instance_of::<collectives::TcpComm>() => Comm {
            dynamic: c.cast::<collectives::TcpComm>()?.get().get()?,
            python: None,
        },
        Some(c) if !c.is_none() => {
            let p = Arc::new(PyComm::new(c)?);
            Comm {
                dynamic: Arc::clone(&p) as Arc<dyn Communicator>,
                python: Some(p),
            }
        }
        _ => Comm {
            dynamic: Arc::new(LocalComm::single()),
            python: None,
        },
    })
}

/// The byte-wise maximum of every rank's `data` (all of one length) through the
/// communicator's all-reduce, the one a save's or load's agreement runs: for tests and
/// benchmarks of the collectives. Collective.
#[pyfunction]
fn all_reduce_max<'py>(
    py: Python<'py>,
    comm: &Bound<'py, PyAny>,
    data: Vec<u8>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let comm = communicator(Some(comm))?;
    let max = |a: &[u8], b: &[u8]| -> Result<Vec<u8>, String> {
        if a.len() != b.len() {
            return Err(format!("{} bytes against {}", a.len(), b.len()));
        }
        Ok(a.iter().zip(b).map(|(x, y)| *x.max(y)).collect())
    };
    let out = py
        .detach(|| comm.dynamic.all_reduce(&data, &max))
        .map_err(|e| comm.err(py, &zarrckpt::Error::from(e)))?;
    Ok(pyo3::types::PyBytes::new(py, &out))
}

/// Saves tensor pieces and objects (see `zarrckpt._core.save`). Collective.
#[pyfunction]
#[pyo3(signature = (path, pieces, objects, comm, options))]
fn save(
    py: Python<'_>,
    path: PathBuf,
    pieces: &Bound<'_, PyList>,
    objects: Option<&Bound<'_, PyList>>,
    comm: Option<&Bound<'_, PyAny>>,
    options: &Bound<'_, PyDict>,
) -> PyResult<Py<PyDict>> {
    let comm = communicator(comm)?;
    let spec = SaveSpec::extract(pieces)?;
    let objs = objects.map(save_objects).transpose()?;
    let opts = save_options(options)?;
    let result = py.detach(|| {
        let pieces = pieces_of(&spec)?;
        match &objs {
            Some(o) => zarrckpt::save_with_objects(&pieces, o, &path, &*comm.dynamic, &opts),
            None => zarrckpt::save(&pieces, &path, &*comm.dynamic, &opts),
        }
    });
    let report = result.map_err(|e| comm.err(py, &e))?;
    convert::save_report(py, &report)
}

/// Loads into the targets' memory; returns the report with object values. Collective.
#[pyfunction]
#[pyo3(signature = (path, targets, objects, comm, options))]
fn load(
    py: Python<'_>,
    path: PathBuf,
    targets: &Bound<'_, PyList>,
    objects: Option<&Bound<'_, PyList>>,
    comm: Option<&Bound<'_, PyAny>>,
    options: &Bound<'_, PyDict>,
) -> PyResult<Py<PyDict>> {
    let comm = communicator(comm)?;
    let spec = LoadSpec::extract(targets)?;
    let reqs = objects.map(object_requests).transpose()?;
    let opts = load_options(options)?;
    let result = py.detach(|| {
        let mut targets = targets_of(&spec)?;
        match &reqs {
            Some(r) => zarrckpt::load_with_objects(&mut targets, r, &path, &*comm.dynamic, &opts),
            None => zarrckpt::load(&mut targets, &path, &*comm.dynamic, &opts),
        }
    });
    let report = result.map_err(|e| comm.err(py, &e))?;
    convert::load_report(py, &report)
}

/// Checks, without saving, what a save on this rank would be handed: the pieces (keys, boxes
/// inside their global shapes, buffer sizes, bool bytes), the objects and the options.
/// `zarrckpt._core` runs it before the ranks agree on the outcome of preparing a call, so that
/// a rank whose input the core would refuse before its first collective fails on every rank.
#[pyfunction]
#[pyo3(signature = (pieces, objects, options))]
fn check_save(
    py: Python<'_>,
    pieces: &Bound<'_, PyList>,
    objects: Option<&Bound<'_, PyList>>,
    options: &Bound<'_, PyDict>,
) -> PyResult<()> {
    let spec = SaveSpec::extract(pieces)?;
    objects.map(save_objects).transpose()?;
    save_options(options)?;
    py.detach(|| pieces_of(&spec).map(drop))
        .map_err(|e| to_py(py, &e, None))
}

/// As [`check_save`], for a load's host targets, object requests and options.
#[pyfunction]
#[pyo3(signature = (targets, objects, options))]
fn check_load(
    py: Python<'_>,
    targets: &Bound<'_, PyList>,
    objects: Option<&Bound<'_, PyList>>,
    options: &Bound<'_, PyDict>,
) -> PyResult<()> {
    let spec = LoadSpec::extract(targets)?;
    objects.map(object_requests).transpose()?;
    load_options(options)?;
    py.detach(|| targets_of(&spec).map(drop))
        .map_err(|e| to_py(py, &e, None))
}

/// A save's arguments, extracted while the GIL is held: host pieces, objects, device pieces
/// and their device, options.
pub(crate) struct SaveArgs {
    spec: SaveSpec,
    objects: Vec<zarrckpt::StateObject>,
    device_specs: Vec<device::DeviceSpec>,
    device: Option<Arc<dyn zarrckpt::device::Device>>,
    pub(crate) opts: zarrckpt::SaveOptions,
}

impl SaveArgs {
    pub(crate) fn extract(
        pieces: &Bound<'_, PyList>,
        objects: Option<&Bound<'_, PyList>>,
        options: &Bound<'_, PyDict>,
        device_pieces: Option<&Bound<'_, PyList>>,
        device: Option<&Bound<'_, device::Device>>,
    ) -> PyResult<Self> {
        let device_specs = device_pieces
            .map(device::device_specs)
            .transpose()?
            .unwrap_or_default();
        let device = device.map(|d| Arc::clone(&d.borrow().inner));
        if !device_specs.is_empty() && device.is_none() {
            return Err(PyValueError::new_err("device pieces need a device"));
        }
        Ok(SaveArgs {
            spec: SaveSpec::extract(pieces)?,
            objects: objects.map(save_objects).transpose()?.unwrap_or_default(),
            device_specs,
            device,
            opts: save_options(options)?,
        })
    }

    /// The request (GIL released). Every rank saves objects, whether or not it has any of
    /// its own, so that every rank takes the same path.
    pub(crate) fn request(&self) -> Result<zarrckpt::SaveRequest<'_>, zarrckpt::Error> {
        let mut r = zarrckpt::SaveRequest::new()
            .with_tensors(pieces_of(&self.spec)?)
            .with_objects(self.objects.iter().cloned());
        if let Some(d) = &self.device {
            r = r.with_device_tensors(Arc::clone(d), device::device_pieces(&self.device_specs)?);
        }
        Ok(r)
    }

    /// Runs `f` on the saver or manager behind `inner` with the request and the options,
    /// the GIL released and the lock held; errors become Python exceptions through `comm`.
    pub(crate) fn run<T: Send, R: Send>(
        &self,
        py: Python<'_>,
        inner: &Arc<Mutex<T>>,
        comm: &Comm,
        f: impl FnOnce(
            &mut T,
            &zarrckpt::SaveRequest<'_>,
            &zarrckpt::SaveOptions,
        ) -> zarrckpt::Result<R>
        + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let request = self.request()?;
            let mut guard = inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut guard, &request, &self.opts)
        })
        .map_err(|e| comm.err(py, &e))
    }
}

/// The saver options of a Python saver or manager.
pub(crate) fn saver_options(
    staging_bytes: Option<u64>,
    lower_priority: bool,
    fail_if_busy: bool,
) -> SaverOptions {
    let mut opts = SaverOptions {
        lower_priority,
        ..SaverOptions::default()
    };
    if let Some(b) = staging_bytes {
        opts.staging_bytes = b;
    }
    if fail_if_busy {
        opts.if_busy = IfBusy::Fail;
    }
    opts
}

/// Repeated and asynchronous saves on one communicator (zarrckpt's `Saver`): host pieces,
/// device pieces (through its bounded page-locked staging) and objects; the plan the ranks
/// agreed on is reused while the structure is unchanged, staging memory is reused.
#[pyclass(module = "zarrckpt._native")]
struct Saver {
    inner: Arc<Mutex<RsSaver>>,
    comm: Comm,
}

#[pymethods]
impl Saver {
    #[new]
    #[pyo3(signature = (comm=None, staging_bytes=None, lower_priority=true, fail_if_busy=false))]
    fn new(
        comm: Option<&Bound<'_, PyAny>>,
        staging_bytes: Option<u64>,
        lower_priority: bool,
        fail_if_busy: bool,
    ) -> PyResult<Self> {
        let comm = communicator(comm)?;
        let opts = saver_options(staging_bytes, lower_priority, fail_if_busy);
        Ok(Saver {
            inner: Arc::new(Mutex::new(RsSaver::with_options(
                Arc::clone(&comm.dynamic),
                opts,
            ))),
            comm,
        })
    }

    /// Saves synchronously (`Saver::save`), objects included, reusing the agreed plan while
    /// the structure is unchanged. The caller waits for a save in flight first.
    #[pyo3(signature = (path, pieces, objects, options, device_pieces=None, device=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature's arguments
    fn save(
        &self,
        py: Python<'_>,
        path: PathBuf,
        pieces: &Bound<'_, PyList>,
        objects: Option<&Bound<'_, PyList>>,
        options: &Bound<'_, PyDict>,
        device_pieces: Option<&Bound<'_, PyList>>,
        device: Option<&Bound<'_, device::Device>>,
    ) -> PyResult<Py<PyDict>> {
        let args = SaveArgs::extract(pieces, objects, options, device_pieces, device)?;
        let report = args.run(py, &self.inner, &self.comm, |saver, request, opts| {
            saver.save(request, &path, opts)
        })?;
        convert::save_report(py, &report)
    }

    /// Starts an asynchronous save (`Saver::save_async`): returns once the pieces are
    /// staged, with every planning error.
    #[pyo3(signature = (path, pieces, objects, options, device_pieces=None, device=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature's arguments
    fn save_async(
        &self,
        py: Python<'_>,
        path: PathBuf,
        pieces: &Bound<'_, PyList>,
        objects: Option<&Bound<'_, PyList>>,
        options: &Bound<'_, PyDict>,
        device_pieces: Option<&Bound<'_, PyList>>,
        device: Option<&Bound<'_, device::Device>>,
    ) -> PyResult<SaveHandle> {
        let args = SaveArgs::extract(pieces, objects, options, device_pieces, device)?;
        let handle = args.run(py, &self.inner, &self.comm, |saver, request, opts| {
            saver.save_async(request, &path, opts)
        })?;
        Ok(SaveHandle::new(handle, self.comm.clone()))
    }

    /// True while an asynchronous save of this saver is in flight.
    fn busy(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_busy()
    }

    /// Bytes of staging memory held between saves.
    fn staging_bytes_held(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .staging_bytes_held()
    }
}

enum HandleState {
    Running(RsHandle),
    Finished(Result<zarrckpt::SaveReport, zarrckpt::Error>),
    Taken,
}

/// An asynchronous save in flight.
#[pyclass(module = "zarrckpt._native")]
pub(crate) struct SaveHandle {
    state: Arc<Mutex<HandleState>>,
    comm: Comm,
    #[pyo3(get)]
    blocked_s: f64,
    #[pyo3(get)]
    staged_bytes: u64,
}

impl SaveHandle {
    pub(crate) fn new(handle: RsHandle, comm: Comm) -> Self {
        SaveHandle {
            blocked_s: handle.blocked().as_secs_f64(),
            staged_bytes: handle.staged_bytes(),
            state: Arc::new(Mutex::new(HandleState::Running(handle))),
            comm,
        }
    }

    /// Waits (GIL released) until the outcome is known; keeps it.
    fn settle(&self, py: Python<'_>) {
        let state = Arc::clone(&self.state);
        py.detach(move || {
            let mut s = state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let HandleState::Running(_) = &*s
                && let HandleState::Running(h) = std::mem::replace(&mut *s, HandleState::Taken)
            {
                *s = HandleState::Finished(h.wait());
            }
        });
    }
}

#[pymethods]
impl SaveHandle {
    /// True once the background work is over, successfully or not.
    fn done(&self) -> bool {
        let s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*s {
            HandleState::Running(h) => h.is_done(),
            _ => true,
        }
    }

    /// Waits for the save; returns its report or raises its error.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        self.settle(py);
        let s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*s {
            HandleState::Finished(Ok(r)) => convert::save_report(py, r),
            HandleState::Finished(Err(e)) => Err(self.comm.err(py, e)),
            _ => Err(PyValueError::new_err("the save's outcome is not available")),
        }
    }
}

/// A committed checkpoint opened for reading in this process.
#[pyclass(module = "zarrckpt._native")]
struct Checkpoint {
    inner: Arc<RsCheckpoint>,
}

#[pymethods]
impl Checkpoint {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let ck = py
            .detach(|| RsCheckpoint::open(&path))
            .map_err(|e| to_py(py, &e, None))?;
        Ok(Checkpoint {
            inner: Arc::new(ck),
        })
    }

    /// Every tensor: a list of dicts (key, dtype, shape, chunk_shape, subchunk_shape,
    /// compression, num_chunks, nbytes), sorted by key.
    fn tensors(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let out = PyList::empty(py);
        for t in self.inner.tensors() {
            let d = PyDict::new(py);
            d.set_item("key", t.key.as_str())?;
            d.set_item("dtype", t.dtype.name())?;
            d.set_item("shape", PyTuple::new(py, &t.shape)?)?;
            d.set_item("chunk_shape", PyTuple::new(py, &t.chunk_shape)?)?;
            d.set_item("subchunk_shape", PyTuple::new(py, &t.subchunk_shape)?)?;
            d.set_item("compression", convert::compression_name(t.compression))?;
            d.set_item("num_chunks", t.num_chunks)?;
            d.set_item("nbytes", t.nbytes)?;
            out.append(d)?;
        }
        Ok(out.unbind())
    }

    /// Every object: a list of dicts (key, scope, encoding, size, world_size, grid, values).
    fn objects(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let out = PyList::empty(py);
        for o in self.inner.objects() {
            let d = PyDict::new(py);
            d.set_item("key", o.key.as_str())?;
            d.set_item("scope", o.scope.name())?;
            d.set_item("encoding", o.encoding.name())?;
            d.set_item("size", o.size)?;
            d.set_item("world_size", o.world_size)?;
            d.set_item("grid", o.grid.map(|g| PyTuple::new(py, g)).transpose()?)?;
            d.set_item("values", o.values)?;
            out.append(d)?;
        }
        Ok(out.unbind())
    }

    /// The index's free-form user metadata, as JSON text.
    fn user_metadata(&self) -> String {
        serde_json::Value::Object(self.inner.meta().user.clone()).to_string()
    }

    /// The number of ranks that saved the checkpoint.
    fn world_size(&self) -> u64 {
        self.inner.meta().world_size
    }

    /// The save id the index records (32 hex digits; `None` for a version 1.0 checkpoint).
    fn save_id(&self) -> Option<String> {
        self.inner.meta().save_id.map(|id| id.hex())
    }

    /// Reads the box (`offset`, `shape`) of tensor `key` into `nbytes` bytes at `address`
    /// (memory the caller owns, C order, the stored dtype); returns the read report
    /// (`bytes_read` counts the shard indexes and subchunks read).
    fn read_region(
        &self,
        py: Python<'_>,
        key: &str,
        offset: Vec<u64>,
        shape: Vec<u64>,
        address: usize,
        nbytes: usize,
    ) -> PyResult<Py<PyDict>> {
        let key = TensorKey::new(key).map_err(|e| to_py(py, &e.into(), None))?;
        let region = zarrckpt::Region::new(offset, shape).map_err(|source| {
            let e = zarrckpt::Error::Tensor(zarrckpt::TensorError::Region {
                key: key.to_string(),
                source,
            });
            to_py(py, &e, None)
        })?;
        let buf = convert::RawMut::new(address, nbytes)?;
        let inner = Arc::clone(&self.inner);
        let result = py.detach(move || {
            // SAFETY: the caller owns `nbytes` writable bytes at `address` for this call.
            let slice = unsafe { buf.slice() };
            inner.read_region(&key, &region, slice)
        });
        let report = result.map_err(|e| to_py(py, &e, None))?;
        convert::load_report(py, &report)
    }

    /// Reads one stored object value: `slot` is "common", ("rank", r) or ("shard", index).
    /// Returns ("json", text) or ("bytes", bytes).
    fn read_object(
        &self,
        py: Python<'_>,
        key: &str,
        slot: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyTuple>> {
        let key = TensorKey::new(key).map_err(|e| to_py(py, &e.into(), None))?;
        let slot = if slot.is_instance_of::<PyString>() {
            if slot.extract::<String>()? != "common" {
                return Err(PyValueError::new_err(
                    "slot: 'common', ('rank', r) or ('shard', index)",
                ));
            }
            ObjectSlot::Common
        } else {
            let (kind, v): (String, Bound<'_, PyAny>) = slot.extract()?;
            match kind.as_str() {
                "rank" => ObjectSlot::Rank(v.extract()?),
                "shard" => ObjectSlot::Shard(v.extract()?),
                _ => {
                    return Err(PyValueError::new_err(
                        "slot: 'common', ('rank', r) or ('shard', index)",
                    ));
                }
            }
        };
        let inner = Arc::clone(&self.inner);
        let value = py
            .detach(move || inner.read_object(&key, &slot))
            .map_err(|e| to_py(py, &e, None))?;
        ObjectOut(Some(value)).into_tuple(py)
    }

    /// Reads every chunk and checks every checksum; returns a list of problem messages.
    #[pyo3(signature = (threads=0))]
    fn verify(&self, py: Python<'_>, threads: usize) -> PyResult<Py<PyDict>> {
        let inner = Arc::clone(&self.inner);
        let rep = py
            .detach(move || inner.verify(threads, None))
            .map_err(|e| to_py(py, &e, None))?;
        let d = PyDict::new(py);
        d.set_item("tensors", rep.tensors)?;
        d.set_item("chunks", rep.chunks)?;
        d.set_item("bytes_read", rep.bytes_read)?;
        d.set_item("object_values", rep.object_values)?;
        let problems: Vec<String> = rep.problems.iter().map(|p| p.error.to_string()).collect();
        d.set_item("problems", problems)?;
        Ok(d.unbind())
    }

    /// The checkpoint directory.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.dir().to_owned()
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(check_save, m)?)?;
    m.add_function(wrap_pyfunction!(check_load, m)?)?;
    conversion::register(m)?;
    transfer::register(m)?;
    m.add_function(wrap_pyfunction!(all_reduce_max, m)?)?;
    collectives::register(m)?;
    m.add_class::<Saver>()?;
    m.add_class::<SaveHandle>()?;
    m.add_class::<Checkpoint>()?;
    m.add_function(wrap_pyfunction!(device::load_device, m)?)?;
    m.add_class::<device::Device>()?;
    m.add_class::<manager::CheckpointManager>()?;
    m.add("HAS_CUDA", cfg!(feature = "cuda"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DTYPES", zarrckpt::DType::ALL.map(|d| d.name()).to_vec())?;
    Ok(())
}
