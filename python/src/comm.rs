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
use std::sync::Mutex;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use zarrckpt::comm::{RecvBuf, SendBuf};
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
