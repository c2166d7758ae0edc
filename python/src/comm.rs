//! A zarrckpt [`Communicator`] over a Python object (`zarrckpt._core.TorchComm`), whose
//! methods move bytes only:
//!
//! - `rank`, `world_size`: ints;
//! - `exchange(sends: list[tuple[int, memoryview]], recvs: list[tuple[int, memoryview]])`:
//!   point-to-point transfers; the memoryviews wrap zarrckpt's own buffers (read-only for
//!   sends, writable for receives) and are released when the call returns, so the callee
//!   must not keep them.
//!
//! The collectives (all-reduce, all-gather, broadcast, barrier) are the shared tree ones of
//! [`zarrckpt::comm::collective`] over `exchange`, so the agreement of a save or load costs
//! each rank O(1) messages, as over the TCP communicator, not the world's descriptions.
//!
//! Each call re-acquires the GIL (zarrckpt calls from threads that released it, including
//! an asynchronous save's background thread). A Python exception becomes a
//! [`CommError::Transport`] carrying its text, and is kept for the error raised at the end
//! (as its `__cause__`).

use std::os::raw::{c_char, c_int};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use zarrckpt::comm::{RecvBuf, SendBuf, TcpComm as RsTcpComm, TcpConfig};
use zarrckpt::{CommError, Communicator};

/// A communicator calling back into Python.
pub(crate) struct PyComm {
    obj: Py<PyAny>,
    rank: usize,
    world: usize,
    error: Mutex<Option<PyErr>>,
}

impl PyComm {
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let rank: usize = obj.getattr("rank")?.extract()?;
        let world: usize = obj.getattr("world_size")?.extract()?;
        if world == 0 || rank >= world {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "communicator: rank {rank} is not below world size {world}"
            )));
        }
        Ok(PyComm {
            obj: obj.clone().unbind(),
            rank,
            world,
            error: Mutex::new(None),
        })
    }

    /// The Python exception of the first failed call since the last take, if any.
    pub(crate) fn take_error(&self) -> Option<PyErr> {
        self.error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    fn fail(&self, py: Python<'_>, op: &'static str, e: PyErr) -> CommError {
        let detail = format!("{}", e.value(py));
        let name = e
            .get_type(py)
            .name()
            .map_or_else(|_| "Exception".to_owned(), |n| n.to_string());
        let mut slot = self
            .error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(e);
        }
        CommError::Transport {
            op,
            rank: self.rank,
            detail: format!("the Python communicator raised {name}: {detail}"),
        }
    }
}

/// A memoryview over memory zarrckpt owns for the duration of a call.
fn memoryview<'py>(
    py: Python<'py>,
    ptr: *mut u8,
    len: usize,
    writable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let flags: c_int = if writable {
        ffi::PyBUF_WRITE
    } else {
        ffi::PyBUF_READ
    };
    let len = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("buffer too large"))?;
    // A zero-length view may not have a null pointer.
    let ptr = if ptr.is_null() {
        std::ptr::NonNull::<u8>::dangling().as_ptr()
    } else {
        ptr
    };
    // SAFETY: `ptr` is valid for `len` bytes for the duration of the call that built the
    // view; the view is released before that call returns.
    unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyMemoryView_FromMemory(ptr.cast::<c_char>(), len, flags),
        )
    }
}

impl Communicator for PyComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        Python::attach(|py| {
            let mut views: Vec<Bound<'_, PyAny>> = Vec::with_capacity(sends.len() + recvs.len());
            let mut call = || -> PyResult<()> {
                let s = PyList::empty(py);
                for b in sends {
                    // Read-only view of bytes zarrckpt owns.
                    let v = memoryview(py, b.data.as_ptr().cast_mut(), b.data.len(), false)?;
                    views.push(v.clone());
                    s.append(PyTuple::new(py, [b.peer.into_pyobject(py)?.into_any(), v])?)?;
                }
                let r = PyList::empty(py);
                for b in recvs.iter_mut() {
                    let v = memoryview(py, b.buf.as_mut_ptr(), b.buf.len(), true)?;
                    views.push(v.clone());
                    r.append(PyTuple::new(py, [b.peer.into_pyobject(py)?.into_any(), v])?)?;
                }
                self.obj.bind(py).call_method1("exchange", (s, r))?;
                Ok(())
            };
            let result = call();
            // The buffers are zarrckpt's: no view may outlive this call.
            for v in &views {
                let _ = v.call_method0("release");
            }
            result.map_err(|e| self.fail(py, "exchange", e))
        })
    }
}

/// Every rank's `data`, indexed by rank, through the shared all-gather of
/// [`zarrckpt::comm::collective`] over `comm`'s point-to-point transfers (a `TorchComm`, a
/// [`TcpComm`] or any object with the byte protocol). Collective.
#[pyfunction]
pub(crate) fn all_gather<'py>(
    py: Python<'py>,
    comm: &Bound<'py, PyAny>,
    data: Vec<u8>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let c = crate::communicator(Some(comm))?;
    let parts = py
        .detach(|| c.dynamic.all_gather(&data))
        .map_err(|e| c.err(py, &zarrckpt::Error::from(e)))?;
    Ok(parts.iter().map(|p| PyBytes::new(py, p)).collect())
}

/// `root`'s `data` on every rank, through the shared broadcast over `comm`. Collective.
#[pyfunction]
pub(crate) fn broadcast<'py>(
    py: Python<'py>,
    comm: &Bound<'py, PyAny>,
    root: usize,
    data: Vec<u8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let c = crate::communicator(Some(comm))?;
    let got = py
        .detach(|| c.dynamic.broadcast(root, &data))
        .map_err(|e| c.err(py, &zarrckpt::Error::from(e)))?;
    Ok(PyBytes::new(py, &got))
}

/// Returns once every rank of `comm` has called it (the shared barrier). Collective.
#[pyfunction]
pub(crate) fn barrier(py: Python<'_>, comm: &Bound<'_, PyAny>) -> PyResult<()> {
    let c = crate::communicator(Some(comm))?;
    py.detach(|| c.dynamic.barrier())
        .map_err(|e| c.err(py, &zarrckpt::Error::from(e)))
}

/// `zarrckpt._native.TcpComm`: the crate's TCP communicator ([`zarrckpt::comm::TcpComm`]),
/// joined like `torchrun` ranks join (rank 0 listens on `master_port`). Pass it as the `comm`
/// of `zarrckpt._core` calls: zarrckpt then talks TCP directly, with no Python in the path
/// (benchmarks compare it with `TorchComm` over the same collectives).
#[pyclass(name = "TcpComm", module = "zarrckpt._native", frozen, weakref)]
pub(crate) struct TcpComm {
    inner: Mutex<Option<Arc<RsTcpComm>>>,
    rank: usize,
    world: usize,
}

impl TcpComm {
    /// The communicator, unless closed.
    pub(crate) fn get(&self) -> PyResult<Arc<RsTcpComm>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("the TcpComm is closed"))
    }
}

#[pymethods]
impl TcpComm {
    /// Joins the group (collective: every rank constructs one). `timeout` in seconds: the
    /// liveness timeout (`ZARRCKPT_TIMEOUT_S`).
    #[new]
    #[pyo3(signature = (rank, world_size, master_addr, master_port, timeout = 60.0))]
    fn new(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        master_addr: String,
        master_port: u16,
        timeout: f64,
    ) -> PyResult<Self> {
        let mut cfg = TcpConfig::new(rank, world_size, master_addr, master_port);
        cfg.timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("timeout: {e}")))?;
        let comm = py
            .detach(|| RsTcpComm::connect(cfg))
            .map_err(|e| crate::errors::to_py(py, &zarrckpt::Error::from(e), None))?;
        Ok(TcpComm {
            inner: Mutex::new(Some(Arc::new(comm))),
            rank,
            world: world_size,
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.world
    }

    /// Payload bytes this rank received from other ranks (collectives included).
    #[getter]
    fn received_bytes(&self) -> PyResult<u64> {
        Ok(self.get()?.received_bytes())
    }

    /// See the module function `all_gather`.
    fn all_gather<'py>(
        slf: &Bound<'py, Self>,
        data: Vec<u8>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        all_gather(slf.py(), slf.as_any(), data)
    }

    /// See the module function `broadcast`.
    fn broadcast<'py>(
        slf: &Bound<'py, Self>,
        root: usize,
        data: Vec<u8>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        broadcast(slf.py(), slf.as_any(), root, data)
    }

    /// See the module function `barrier`.
    fn barrier(slf: &Bound<'_, Self>) -> PyResult<()> {
        barrier(slf.py(), slf.as_any())
    }

    /// Leaves the group (says goodbye to the peers); later calls fail.
    fn close(&self, py: Python<'_>) {
        let c = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        py.detach(|| drop(c));
    }
}

/// Adds the collectives and `TcpComm` to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(all_gather, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast, m)?)?;
    m.add_function(wrap_pyfunction!(barrier, m)?)?;
    m.add_class::<TcpComm>()
}
