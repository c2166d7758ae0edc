//! The shared collectives for Python callers and `zarrckpt._native.TcpComm`: both built on
//! the byte transport of [`crate::comm`] and report errors through [`crate::errors`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use zarrckpt::comm::{TcpComm as RsTcpComm, TcpConfig};

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
