//! Live weight transfer (spec § 20) for `zarrckpt.transfer`: a `Transfer` object per rank,
//! kept from step to step (it caches the plan), over the Python communicator. Tensor data
//! crosses as raw addresses and byte lengths of memory the caller keeps alive for the call;
//! the GIL is released while bytes move (the communicator re-acquires it). A refused transfer
//! raises `ConversionError` (rule, key, numbers) on every rank; a failed one `CommError`.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use zarrckpt::convert::{Layout, load_checked};
use zarrckpt::model::{DType, Region, Replica, ShardedTensor, TensorKey};
use zarrckpt::transfer::{
    EngineLayout, EngineTensor, Options, Received, Report, TrainerNames, Transfer as RsTransfer,
    TransferError,
};

use crate::communicator;
use crate::convert::RawMut as Buf;
use crate::errors::new_error;

fn transfer_error(py: Python<'_>, e: &TransferError, comm: &crate::Comm) -> PyErr {
    let (class, kind) = match e {
        TransferError::Comm(_) => ("CommError", "Comm"),
        TransferError::Plan(_) => ("ConversionError", "Plan"),
        TransferError::Engine { .. } => ("ConversionError", "Engine"),
        TransferError::Trainer { .. } => ("ConversionError", "Trainer"),
        TransferError::Coverage { .. } => ("ConversionError", "Coverage"),
        TransferError::Peer { .. } => ("ConversionError", "Peer"),
        _ => ("ConversionError", "Setup"),
    };
    let err = new_error(py, class, kind, e.to_string());
    if let Some(cause) = comm
        .python
        .as_deref()
        .and_then(crate::comm::PyComm::take_error)
    {
        err.set_cause(py, Some(cause));
    }
    err
}

fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name)
        .ok_or_else(|| PyValueError::new_err(format!("unknown data type `{name}`")))
}

fn report(py: Python<'_>, r: &Report) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("planned", r.planned)?;
    d.set_item("plan_s", r.plan_time.as_secs_f64())?;
    d.set_item("move_s", r.move_time.as_secs_f64())?;
    d.set_item("rounds", r.rounds)?;
    d.set_item("bytes_sent", r.moved.sent)?;
    d.set_item("bytes_received", r.moved.received)?;
    d.set_item("busiest_sent", r.busiest_sent)?;
    d.set_item("total_bytes", r.total_bytes)?;
    Ok(d.unbind())
}

/// A trainer piece: (key, dtype, global shape, offset, shape, replica id (None: automatic,
/// one of the ranks declaring the same box sends), address, nbytes).
type PieceSpec = (
    String,
    String,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    Option<u32>,
    usize,
    usize,
);

/// An engine tensor: (name, dtype, shape, address, nbytes); address 0 with no buffer.
type TensorSpec = (String, String, Vec<u64>, usize, usize);

/// One rank's end of a live weight transfer.
#[pyclass(module = "zarrckpt._native")]
pub(crate) struct Transfer {
    inner: Mutex<RsTransfer>,
}

fn lock(t: &Mutex<RsTransfer>) -> std::sync::MutexGuard<'_, RsTransfer> {
    t.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[pymethods]
impl Transfer {
    /// `table`: built-in name, path or JSON text; `config`: the HF config as JSON text;
    /// `trainer`: (tp, pp, ep); `engine`: "vllm" (with `engine_tp`) or "hf"; `names`: the
    /// trainer's tensor names, "megatron" or "hf".
    #[new]
    #[allow(clippy::too_many_arguments)] // the Python signature's keyword arguments
    #[pyo3(signature = (table, config, trainer, engine, engine_tp=1, bucket_bytes=zarrckpt::transfer::DEFAULT_BUCKET_BYTES, cast=false, names="megatron"))]
    fn new(
        py: Python<'_>,
        table: &str,
        config: &str,
        trainer: (u64, u64, u64),
        engine: &str,
        engine_tp: u64,
        bucket_bytes: u64,
        cast: bool,
        names: &str,
    ) -> PyResult<Self> {
        let table = load_checked(table)
            .map_err(|e| new_error(py, "TableError", "Convert", e.to_string()))?;
        let config: serde_json::Value = serde_json::from_str(config)
            .map_err(|e| PyValueError::new_err(format!("config: {e}")))?;
        let (tp, pp, ep) = trainer;
        if tp == 0 || pp == 0 || ep == 0 {
            return Err(PyValueError::new_err(format!(
                "trainer layout ({tp}, {pp}, {ep}): positive sizes"
            )));
        }
        let engine = match engine {
            "vllm" if engine_tp > 0 => EngineLayout::Vllm { tp: engine_tp },
            "hf" => EngineLayout::Hf,
            other => {
                return Err(PyValueError::new_err(format!(
                    "engine: \"vllm\" (engine_tp > 0) or \"hf\", not {other:?} (engine_tp {engine_tp})"
                )));
            }
        };
        let names = match names {
            "megatron" => TrainerNames::Megatron,
            "hf" => TrainerNames::Hf,
            other => {
                return Err(PyValueError::new_err(format!(
                    "names: \"megatron\" or \"hf\", not {other:?}"
                )));
            }
        };
        let mut opts = Options::new(table, config, Layout { tp, pp, ep }, engine);
        opts.names = names;
        opts.bucket_bytes = bucket_bytes;
        opts.cast = cast;
        Ok(Transfer {
            inner: Mutex::new(RsTransfer::new(opts)),
        })
    }

    /// Trainer side: sends this rank's pieces. Collective over `comm`.
    fn send(
        &self,
        py: Python<'_>,
        comm: &Bound<'_, PyAny>,
        pieces: Vec<PieceSpec>,
    ) -> PyResult<Py<PyDict>> {
        let comm = communicator(Some(comm))?;
        let mut bufs = Vec::with_capacity(pieces.len());
        for p in &pieces {
            bufs.push(Buf::new(p.6, p.7)?);
        }
        let mut built = Vec::with_capacity(pieces.len());
        for (p, b) in pieces.iter().zip(&bufs) {
            let (key, dt, gshape, off, shape, replica, ..) = p;
            let bad = |e: String| PyValueError::new_err(format!("piece `{key}`: {e}"));
            let key = TensorKey::new(key).map_err(|e| bad(e.to_string()))?;
            let region = Region::new(off.clone(), shape.clone()).map_err(|e| bad(e.to_string()))?;
            // SAFETY: the caller keeps the tensor alive and unchanged for the call.
            let data = unsafe { b.slice_ref() };
            let piece = ShardedTensor::new(
                key,
                dtype(dt)?,
                gshape.clone(),
                region,
                replica.unwrap_or(0),
                data,
            )
            .map_err(|e| bad(e.to_string()))?;
            built.push(if replica.is_none() {
                piece.with_replica(Replica::Auto)
            } else {
                piece
            });
        }
        let mut guard = lock(&self.inner);
        let t: &mut RsTransfer = &mut guard;
        let r = py.detach(|| t.send(comm.dynamic.as_ref(), &built));
        match r {
            Ok(r) => report(py, &r),
            Err(e) => Err(transfer_error(py, &e, &comm)),
        }
    }

    /// Engine side: fills the given buffers in place. Collective over `comm`.
    fn receive(
        &self,
        py: Python<'_>,
        comm: &Bound<'_, PyAny>,
        tensors: Vec<TensorSpec>,
    ) -> PyResult<Py<PyDict>> {
        let comm = communicator(Some(comm))?;
        let mut decl = Vec::with_capacity(tensors.len());
        let mut slices: Vec<&mut [u8]> = Vec::with_capacity(tensors.len());
        for (name, dt, shape, addr, n) in &tensors {
            decl.push(EngineTensor::new(name, dtype(dt)?, shape.clone()));
            // SAFETY: the caller keeps each (distinct) buffer alive for the call.
            slices.push(unsafe { Buf::new(*addr, *n)?.slice() });
        }
        let mut guard = lock(&self.inner);
        let t: &mut RsTransfer = &mut guard;
        let r = py.detach(|| t.receive(comm.dynamic.as_ref(), &decl, &mut slices));
        match r {
            Ok(r) => report(py, &r),
            Err(e) => Err(transfer_error(py, &e, &comm)),
        }
    }

    /// Engine side, checkpoint format: `on_bucket(list of (name, dtype, shape, bytes))` is
    /// called with the tensors completed in each round. Collective over `comm`.
    fn receive_buckets(
        &self,
        py: Python<'_>,
        comm: &Bound<'_, PyAny>,
        tensors: Vec<(String, String, Vec<u64>)>,
        on_bucket: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyDict>> {
        let comm = communicator(Some(comm))?;
        let decl = tensors
            .iter()
            .map(|(n, d, s)| Ok(EngineTensor::new(n, dtype(d)?, s.clone())))
            .collect::<PyResult<Vec<_>>>()?;
        let cb = on_bucket.clone().unbind();
        let failure: Mutex<Option<PyErr>> = Mutex::new(None);
        let mut call = |bucket: Vec<Received>| -> Result<(), TransferError> {
            Python::attach(|py| {
                let list = PyList::empty(py);
                for r in bucket {
                    let item = (r.name, r.dtype.name(), r.shape, PyBytes::new(py, &r.data));
                    list.append(item)?;
                }
                cb.bind(py).call1((list,))?;
                Ok::<(), PyErr>(())
            })
            .map_err(|e| {
                let msg = e.to_string();
                *failure
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                TransferError::Setup(format!("on_bucket raised {msg}"))
            })
        };
        let mut guard = lock(&self.inner);
        let t: &mut RsTransfer = &mut guard;
        let r = py.detach(|| t.receive_with(comm.dynamic.as_ref(), &decl, &mut call));
        if let Some(e) = failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            return Err(e);
        }
        match r {
            Ok(r) => report(py, &r),
            Err(e) => Err(transfer_error(py, &e, &comm)),
        }
    }

    /// This rank's cached plan: rounds and bytes sent / received, or None before the first
    /// call.
    fn plan_info(&self, py: Python<'_>) -> PyResult<Option<Py<PyDict>>> {
        let t = lock(&self.inner);
        let Some(lp) = t.local_plan() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("rounds", lp.rounds())?;
        d.set_item("bytes_sent", lp.bytes_sent())?;
        d.set_item("bytes_received", lp.bytes_received())?;
        let dests = PyList::empty(py);
        for x in lp.dests() {
            dests.append((x.name.clone(), x.dtype.name(), x.shape.clone()))?;
        }
        d.set_item("dests", dests)?;
        Ok(Some(d.unbind()))
    }
}

/// Registers the class.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Transfer>()
}
