//! Device memory (GPU) from Python: CUDA tensors as load targets and save sources.
//!
//! A device target or piece arrives as a tuple
//! `(key, dtype, global_shape, offset, local_shape, address, strides, replica | None)`:
//! a box of a global tensor held in device memory at `address` with element `strides`
//! (torch's `data_ptr()` and `stride()`). The device is a [`Device`] handle: CUDA device
//! `ordinal` copying on the caller's stream (torch's current stream), or a simulated device
//! (host memory posing as a GPU) for tests on machines without one.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use zarrckpt::device::{
    self as dev, DevicePiece, DeviceStaging, DeviceTarget, DeviceView, SimDevice,
};
use zarrckpt::{DType, Region, Replica, TensorKey};

use crate::communicator;
use crate::convert::{self, LoadSpec, load_options, object_requests, targets_of};

/// A device for loads and saves; keeps its pinned staging between calls.
#[pyclass(module = "zarrckpt._native")]
pub(crate) struct Device {
    pub(crate) inner: Arc<dyn dev::Device>,
    sim: Option<Arc<SimDevice>>,
    staging: Mutex<Option<DeviceStaging>>,
}

impl Device {
    fn new(inner: Arc<dyn dev::Device>, sim: Option<Arc<SimDevice>>) -> Self {
        Device {
            inner,
            sim,
            staging: Mutex::new(None),
        }
    }

    fn sim(&self) -> PyResult<&SimDevice> {
        self.sim
            .as_deref()
            .ok_or_else(|| PyValueError::new_err("only a simulated device has this"))
    }
}

#[pymethods]
impl Device {
    /// CUDA device `ordinal`, copying on `stream` (a `CUstream` such as
    /// `torch.cuda.current_stream().cuda_stream`, 0 being the legacy default stream; None:
    /// a non-blocking stream of its own, unordered with other work).
    #[staticmethod]
    #[pyo3(signature = (ordinal, stream=None))]
    #[allow(unused_variables)]
    fn cuda(ordinal: usize, stream: Option<u64>) -> PyResult<Self> {
        #[cfg(feature = "cuda")]
        {
            let d = match stream {
                // SAFETY: the caller hands in a live stream of that device (torch's current
                // one; 0 is the legacy default stream, which orders with torch's kernels).
                Some(s) => unsafe { dev::CudaDevice::with_stream(ordinal, s) },
                None => dev::CudaDevice::new(ordinal),
            }
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            Ok(Device::new(Arc::new(d), None))
        }
        #[cfg(not(feature = "cuda"))]
        Err(PyRuntimeError::new_err(
            "this build of zarrckpt has no CUDA support (cargo feature `cuda`)",
        ))
    }

    /// Whether this build supports CUDA and a driver with a GPU is present.
    #[staticmethod]
    fn cuda_available() -> bool {
        #[cfg(feature = "cuda")]
        {
            dev::CudaDevice::available()
        }
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Host memory posing as a device (for tests).
    #[staticmethod]
    fn simulated() -> Self {
        let s = Arc::new(SimDevice::new());
        Device::new(Arc::clone(&s) as Arc<dyn dev::Device>, Some(s))
    }

    /// Simulated device: allocates zeroed memory, returns its address.
    fn alloc(&self, len: usize) -> PyResult<u64> {
        Ok(self.sim()?.alloc(len))
    }

    /// Simulated device: writes bytes at an address.
    fn write(&self, address: u64, data: &[u8]) -> PyResult<()> {
        self.sim()?
            .write(address, data)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Simulated device: reads bytes at an address.
    fn read<'py>(
        &self,
        py: Python<'py>,
        address: u64,
        len: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = self
            .sim()?
            .read(address, len)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &v))
    }

    /// Simulated device: the most pinned bytes held at once so far.
    fn pinned_peak(&self) -> PyResult<usize> {
        Ok(self.sim()?.pinned_peak())
    }
}

pub(crate) struct DeviceSpec {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    address: u64,
    strides: Vec<u64>,
    replica: Replica,
}

pub(crate) fn device_specs(list: &Bound<'_, PyList>) -> PyResult<Vec<DeviceSpec>> {
    let mut out = Vec::with_capacity(list.len());
    for item in list.iter() {
        let t = item.cast::<PyTuple>()?;
        if t.len() != 8 {
            return Err(PyValueError::new_err(format!(
                "a device piece is an 8-tuple, got {} fields",
                t.len()
            )));
        }
        let key: String = t.get_item(0)?.extract()?;
        let dtype_name: String = t.get_item(1)?.extract()?;
        let dtype = DType::from_name(&dtype_name).ok_or_else(|| {
            PyValueError::new_err(format!("data type `{dtype_name}` is not supported"))
        })?;
        let offset: Vec<u64> = t.get_item(3)?.extract()?;
        let shape: Vec<u64> = t.get_item(4)?.extract()?;
        let replica: Option<u32> = t.get_item(7)?.extract()?;
        out.push(DeviceSpec {
            key: TensorKey::new(&key).map_err(|e| PyValueError::new_err(e.to_string()))?,
            dtype,
            global_shape: t.get_item(2)?.extract()?,
            region: Region::new(offset, shape)
                .map_err(|e| PyValueError::new_err(format!("`{key}`: {e}")))?,
            address: t.get_item(5)?.extract()?,
            strides: t.get_item(6)?.extract()?,
            replica: replica.map_or(Replica::Auto, Replica::Id),
        });
    }
    Ok(out)
}

fn view(s: &DeviceSpec) -> DeviceView {
    // SAFETY: the Python layer hands in live tensors' addresses and strides and keeps them
    // alive (and unused by other work on other streams) for the duration of the call.
    unsafe { DeviceView::new(s.address, s.strides.clone()) }
}

/// Loads host targets and device targets (collective); returns the load report plus
/// `device_bytes`, `rounds`, `read_s`, `copy_wait_s`. Without a device (`None`), device
/// targets must be empty.
#[pyfunction]
#[pyo3(signature = (path, targets, device_targets, objects, comm, options, device=None, staging_bytes=1<<30))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_device(
    py: Python<'_>,
    path: PathBuf,
    targets: &Bound<'_, PyList>,
    device_targets: &Bound<'_, PyList>,
    objects: Option<&Bound<'_, PyList>>,
    comm: Option<&Bound<'_, PyAny>>,
    options: &Bound<'_, PyDict>,
    device: Option<&Device>,
    staging_bytes: usize,
) -> PyResult<Py<PyDict>> {
    let comm = communicator(comm)?;
    let spec = LoadSpec::extract(targets)?;
    let dspecs = device_specs(device_targets)?;
    if device.is_none() && !dspecs.is_empty() {
        return Err(PyValueError::new_err("device targets need a device"));
    }
    let reqs = objects.map(object_requests).transpose()?;
    let opts = load_options(options)?;
    let placeholder;
    let device = match device {
        Some(d) => d,
        None => {
            placeholder = Device::simulated();
            &placeholder
        }
    };
    let result = py.detach(|| {
        let mut host = targets_of(&spec)?;
        let dts = dspecs
            .iter()
            .map(|s| {
                DeviceTarget::new(
                    s.key.clone(),
                    s.dtype,
                    s.global_shape.clone(),
                    s.region.clone(),
                    view(s),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut slot = device
            .staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot
            .as_ref()
            .is_none_or(|s| s.buffer_bytes() != (staging_bytes / 2).max(16))
        {
            *slot = Some(DeviceStaging::new(Arc::clone(&device.inner), staging_bytes));
        }
        let staging = slot.as_mut().ok_or_else(|| {
            zarrckpt::Error::ThreadPool("device staging could not be set up".into())
        })?;
        match &reqs {
            Some(r) => dev::load_to_device_with_objects(
                &mut host,
                &dts,
                r,
                staging,
                &path,
                &*comm.dynamic,
                &opts,
            ),
            None => dev::load_to_device(&mut host, &dts, staging, &path, &*comm.dynamic, &opts),
        }
    });
    let report = result.map_err(|e| comm.err(py, &e))?;
    let d = convert::load_report(py, &report.load)?;
    let b = d.bind(py);
    b.set_item("device_bytes", report.device_bytes)?;
    b.set_item("rounds", report.rounds)?;
    b.set_item("read_s", report.read_seconds)?;
    b.set_item("copy_wait_s", report.copy_wait_seconds)?;
    Ok(d)
}

/// The device pieces of a save, from their specs.
pub(crate) fn device_pieces(specs: &[DeviceSpec]) -> Result<Vec<DevicePiece>, zarrckpt::Error> {
    specs
        .iter()
        .map(|s| {
            DevicePiece::new(
                s.key.clone(),
                s.dtype,
                s.global_shape.clone(),
                s.region.clone(),
                0,
                view(s),
            )
            .map(|p| p.with_replica(s.replica))
        })
        .collect()
}
