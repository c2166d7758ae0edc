//! `zarrckpt._native.CheckpointManager`: zarrckpt's `CheckpointManager` (one checkpoint per
//! step under a root, a `latest` pointer, keep-N retention) over a `Saver` on the caller's
//! communicator. `zarrckpt.manager` is its Python front.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use zarrckpt::{CheckpointManager as RsManager, ManagerOptions, Saver};

use crate::{Comm, SaveArgs, SaveHandle, communicator, convert, device, saver_options};

/// Checkpoints of a run, one per step, saved through a saver (collective saves).
#[pyclass(module = "zarrckpt._native")]
pub(crate) struct CheckpointManager {
    inner: Arc<Mutex<RsManager>>,
    comm: Comm,
    root: PathBuf,
}

impl CheckpointManager {
    fn lock(&self) -> std::sync::MutexGuard<'_, RsManager> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymethods]
impl CheckpointManager {
    #[new]
    #[pyo3(signature = (root, comm=None, keep_last=0, keep_every=None, staging_bytes=None, lower_priority=true))]
    fn new(
        root: PathBuf,
        comm: Option<&Bound<'_, PyAny>>,
        keep_last: usize,
        keep_every: Option<u64>,
        staging_bytes: Option<u64>,
        lower_priority: bool,
    ) -> PyResult<Self> {
        let comm = communicator(comm)?;
        let saver = Saver::with_options(
            Arc::clone(&comm.dynamic),
            saver_options(staging_bytes, lower_priority, false),
        );
        let opts = ManagerOptions {
            keep_last,
            keep_every,
        };
        Ok(CheckpointManager {
            inner: Arc::new(Mutex::new(RsManager::new(&root, saver, opts))),
            comm,
            root,
        })
    }

    /// The root directory or object-store URL (a string: a `pathlib.Path` would fold the
    /// `//` of `s3://bucket/run`).
    #[getter]
    fn root(&self) -> String {
        self.root.to_string_lossy().into_owned()
    }

    /// The directory (or URL) of `step`.
    fn step_dir(&self, step: u64) -> String {
        self.lock().step_dir(step).to_string_lossy().into_owned()
    }

    /// Saves `step` and publishes it (collective); returns the report.
    #[pyo3(signature = (step, pieces, objects, options, device_pieces=None, device=None))]
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        py: Python<'_>,
        step: u64,
        pieces: &Bound<'_, PyList>,
        objects: Option<&Bound<'_, PyList>>,
        options: &Bound<'_, PyDict>,
        device_pieces: Option<&Bound<'_, PyList>>,
        device: Option<&Bound<'_, device::Device>>,
    ) -> PyResult<Py<PyDict>> {
        let args = SaveArgs::extract(pieces, objects, options, device_pieces, device)?;
        let report = args.run(py, &self.inner, &self.comm, |m, request, opts| {
            m.save(step, request, opts)
        })?;
        convert::save_report(py, &report)
    }

    /// Starts saving `step` (collective): returns once staged, with every planning error;
    /// the commit, the `latest` pointer and retention follow in the background.
    #[pyo3(signature = (step, pieces, objects, options, device_pieces=None, device=None))]
    #[allow(clippy::too_many_arguments)]
    fn save_async(
        &self,
        py: Python<'_>,
        step: u64,
        pieces: &Bound<'_, PyList>,
        objects: Option<&Bound<'_, PyList>>,
        options: &Bound<'_, PyDict>,
        device_pieces: Option<&Bound<'_, PyList>>,
        device: Option<&Bound<'_, device::Device>>,
    ) -> PyResult<SaveHandle> {
        let args = SaveArgs::extract(pieces, objects, options, device_pieces, device)?;
        let handle = args.run(py, &self.inner, &self.comm, |m, request, opts| {
            m.save_async(step, request, opts)
        })?;
        Ok(SaveHandle::new(handle, self.comm.clone()))
    }

    /// The latest committed step under the root, or None (local).
    fn latest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        self.lock().latest().map_err(|e| self.comm.err(py, &e))
    }

    /// Every step directory (or URL): `(step, dir, complete, bytes)` by increasing step
    /// (local).
    fn steps(&self, py: Python<'_>) -> PyResult<Vec<(u64, String, bool, u64)>> {
        let steps = self.lock().steps().map_err(|e| self.comm.err(py, &e))?;
        Ok(steps
            .into_iter()
            .map(|s| {
                (
                    s.step,
                    s.dir.to_string_lossy().into_owned(),
                    s.complete,
                    s.bytes,
                )
            })
            .collect())
    }

    /// The latest committed step as rank 0 sees it, told to every rank (collective), after
    /// any save of this manager in flight.
    fn agreed_latest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let inner = Arc::clone(&self.inner);
        py.detach(|| {
            inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .agreed_latest()
        })
        .map_err(|e| self.comm.err(py, &e))
    }

    /// True while an asynchronous save is in flight.
    fn busy(&self) -> bool {
        self.lock().saver().is_busy()
    }
}
