//! The CUDA device (cargo feature `cuda`): cudarc's driver API, with the driver loaded at
//! run time. Copies go on one stream (the device's own, or a caller's, such as torch's
//! current stream), in order; fences are CUDA events.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Mutex;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use super::{Device, DeviceError, Fence, PinnedBuf, Pitched};

fn driver(call: &'static str) -> impl Fn(DriverError) -> DeviceError {
    move |e| DeviceError::Driver {
        call,
        detail: e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0)),
    }
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), DeviceError> {
    r.result().map_err(driver(call))
}

/// Restores the thread's previous context when dropped.
struct CtxGuard {
    previous: usize,
    changed: bool,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: the context that was current before (or none).
            let _ = unsafe { sys::cuCtxSetCurrent(self.previous as sys::CUcontext) };
        }
    }
}

/// One GPU through the CUDA driver.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: usize,
    device: sys::CUdevice,
    ctx: usize,
    stream: usize,
    owns_stream: bool,
    events: Mutex<(u64, HashMap<u64, usize>)>,
}

// SAFETY: the context and stream handles are used only through driver calls, which are
// thread-safe once the context is made current on the calling thread (done by every call).
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the event table is behind a mutex.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Whether a CUDA driver can be loaded and reports at least one device.
    #[must_use]
    pub fn available() -> bool {
        Self::count() > 0
    }

    /// Devices the driver reports (0 without a driver).
    #[must_use]
    pub fn count() -> usize {
        // SAFETY: only tries to load the library.
        if !unsafe { sys::is_culib_present() } {
            return 0;
        }
        if cudarc::driver::result::init().is_err() {
            return 0;
        }
        // A driver that cannot count its devices offers none, as documented.
        cudarc::driver::result::device::get_count()
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0)
    }

    /// Device `ordinal`'s primary context (the one PyTorch uses) and a new non-blocking
    /// stream of its own.
    ///
    /// # Errors
    /// [`DeviceError::Unavailable`] without a driver or such a device; driver errors.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        let mut d = Self::open(ordinal)?;
        let _ctx = d.enter()?;
        let stream = cudarc::driver::result::stream::create(
            cudarc::driver::result::stream::StreamKind::NonBlocking,
        )
        .map_err(driver("cuStreamCreate"))?;
        d.stream = stream as usize;
        d.owns_stream = true;
        Ok(d)
    }

    /// Device `ordinal`'s primary context, copying on the caller's `stream` (a `CUstream`,
    /// for example `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default
    /// stream), so that copies are ordered with the caller's work on that stream.
    ///
    /// # Errors
    /// As [`CudaDevice::new`].
    ///
    /// # Safety
    /// `stream` must be a stream of that device's primary context, alive as long as this.
    pub unsafe fn with_stream(ordinal: usize, stream: u64) -> Result<Self, DeviceError> {
        let mut d = Self::open(ordinal)?;
        d.stream = usize::try_from(stream).map_err(|_| DeviceError::OutOfRange {
            what: "CUDA stream handle",
            value: stream,
        })?;
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<Self, DeviceError> {
        // SAFETY: only tries to load the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::Unavailable(
                "the CUDA driver (libcuda) is not installed".into(),
            ));
        }
        cudarc::driver::result::init().map_err(driver("cuInit"))?;
        let count = Self::count();
        if ordinal >= count {
            return Err(DeviceError::Unavailable(format!(
                "device {ordinal} asked for; the driver reports {count}"
            )));
        }
        let index = i32::try_from(ordinal).map_err(|_| DeviceError::OutOfRange {
            what: "CUDA device ordinal",
            value: ordinal as u64,
        })?;
        let device = cudarc::driver::result::device::get(index).map_err(driver("cuDeviceGet"))?;
        // SAFETY: a valid device handle.
        let ctx = unsafe { cudarc::driver::result::primary_ctx::retain(device) }
            .map_err(driver("cuDevicePrimaryCtxRetain"))?;
        let d = CudaDevice {
            ordinal,
            device,
            ctx: ctx as usize,
            stream: 0,
            owns_stream: false,
            events: Mutex::new((0, HashMap::new())),
        };
        Ok(d)
    }

    /// The device ordinal.
    #[must_use]
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn current(&self) -> Result<(), DeviceError> {
        // SAFETY: a retained primary context.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.ctx as sys::CUcontext)
        })
    }

    /// Makes this device's context current for the guard's life, then restores the thread's
    /// previous one (so that a load into `cuda:1` does not change torch's current device).
    fn enter(&self) -> Result<CtxGuard, DeviceError> {
        let previous = cudarc::driver::result::ctx::get_current()
            .map_err(driver("cuCtxGetCurrent"))?
            .map_or(0, |c| c as usize);
        if previous != self.ctx {
            self.current()?;
        }
        Ok(CtxGuard {
            previous,
            changed: previous != self.ctx,
        })
    }

    fn stream(&self) -> sys::CUstream {
        self.stream as sys::CUstream
    }

    /// The stream copies go on (a `CUstream`).
    #[must_use]
    pub fn raw_stream(&self) -> usize {
        self.stream
    }

    /// Makes this device's context current on the calling thread.
    ///
    /// # Errors
    /// Driver errors.
    pub fn make_current(&self) -> Result<(), DeviceError> {
        self.current()
    }

    /// Allocates `len` bytes of device memory (for tests and benchmarks; training code
    /// passes its own tensors' addresses).
    ///
    /// # Errors
    /// Driver errors.
    pub fn alloc(&self, len: usize) -> Result<u64, DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: the context is current.
        unsafe { cudarc::driver::result::malloc_sync(len.max(1)) }.map_err(driver("cuMemAlloc"))
    }

    /// Frees memory from [`CudaDevice::alloc`].
    ///
    /// # Errors
    /// Driver errors.
    ///
    /// # Safety
    /// `address` came from `alloc` and is not used afterwards.
    pub unsafe fn free(&self, address: u64) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: per the contract.
        unsafe { cudarc::driver::result::free_sync(address) }.map_err(driver("cuMemFree"))
    }

    /// Waits until everything enqueued on the stream has finished.
    ///
    /// # Errors
    /// Driver errors.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: a valid stream of the current context.
        unsafe { cudarc::driver::result::stream::synchronize(self.stream()) }
            .map_err(driver("cuStreamSynchronize"))
    }

    /// A fence after everything enqueued so far on the stream (NCCL's work included).
    ///
    /// # Errors
    /// Driver errors.
    pub fn record_fence(&self) -> Result<Fence, DeviceError> {
        let _ctx = self.enter()?;
        self.record()
    }

    /// Whether everything up to `fence` has finished, without blocking (`cuEventQuery`).
    ///
    /// # Errors
    /// [`DeviceError::UnknownFence`] for a fence this device did not hand out (or one
    /// already waited on); driver errors (a failed copy or kernel).
    pub fn query(&self, fence: &Fence) -> Result<bool, DeviceError> {
        let _ctx = self.enter()?;
        let event = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1
            .get(&fence.0)
            .copied()
            .ok_or(DeviceError::UnknownFence(fence.0))?;
        // SAFETY: an event recorded by this device, destroyed only by `wait` or drop.
        match unsafe { cudarc::driver::result::event::query(event as sys::CUevent) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(driver("cuEventQuery")(e)),
        }
    }

    fn record(&self) -> Result<Fence, DeviceError> {
        let event =
            cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(driver("cuEventCreate"))?;
        // SAFETY: a fresh event and a valid stream.
        unsafe { cudarc::driver::result::event::record(event, self.stream()) }
            .map_err(driver("cuEventRecord"))?;
        let mut g = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        g.0 += 1;
        let id = g.0;
        g.1.insert(id, event as usize);
        Ok(Fence(id))
    }

    /// Enqueues one pitched copy. `to_device`: host -> device, else device -> host.
    ///
    /// # Safety
    /// As [`Device::to_device`].
    unsafe fn enqueue(
        &self,
        host: *mut u8,
        c: &Pitched,
        to_device: bool,
    ) -> Result<(), DeviceError> {
        // SAFETY (all blocks below): the caller guarantees the host and device ranges.
        let h = unsafe { host.add(c.host_offset) };
        if c.is_linear() {
            let n = c.bytes();
            return if to_device {
                check("cuMemcpyHtoDAsync", unsafe {
                    sys::cuMemcpyHtoDAsync_v2(c.device, h as *const c_void, n, self.stream())
                })
            } else {
                check("cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(h as *mut c_void, c.device, n, self.stream())
                })
            };
        }
        let fit = |what, value: u64| {
            usize::try_from(value).map_err(|_| DeviceError::OutOfRange { what, value })
        };
        let dev_pitch = fit("device pitch", c.device_pitch)?;
        let dev_slice = fit("device slice pitch", c.device_slice_pitch)?;
        let (host_t, dev_t) = (
            sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        );
        let (src_t, dst_t) = if to_device {
            (host_t, dev_t)
        } else {
            (dev_t, host_t)
        };
        if c.depth > 1 && dev_pitch > 0 && dev_slice % dev_pitch == 0 {
            // Built field by field: `CUmemorytype` has no zero value, so a zeroed struct is
            // undefined behaviour (Rust aborts on it).
            let mut p = sys::CUDA_MEMCPY3D {
                srcXInBytes: 0,
                srcY: 0,
                srcZ: 0,
                srcLOD: 0,
                srcMemoryType: src_t,
                srcHost: std::ptr::null(),
                srcDevice: 0,
                srcArray: std::ptr::null_mut(),
                reserved0: std::ptr::null_mut(),
                srcPitch: 0,
                srcHeight: 0,
                dstXInBytes: 0,
                dstY: 0,
                dstZ: 0,
                dstLOD: 0,
                dstMemoryType: dst_t,
                dstHost: std::ptr::null_mut(),
                dstDevice: 0,
                dstArray: std::ptr::null_mut(),
                reserved1: std::ptr::null_mut(),
                dstPitch: 0,
                dstHeight: 0,
                WidthInBytes: 0,
                Height: 0,
                Depth: 0,
            };
            if to_device {
                p.srcHost = h as *const c_void;
                p.srcPitch = c.host_pitch;
                p.srcHeight = c.height;
                p.dstDevice = c.device;
                p.dstPitch = dev_pitch;
                p.dstHeight = dev_slice / dev_pitch;
            } else {
                p.srcDevice = c.device;
                p.srcPitch = dev_pitch;
                p.srcHeight = dev_slice / dev_pitch;
                p.dstHost = h.cast::<c_void>();
                p.dstPitch = c.host_pitch;
                p.dstHeight = c.height;
            }
            p.WidthInBytes = c.width;
            p.Height = c.height;
            p.Depth = c.depth;
            return check("cuMemcpy3DAsync", unsafe {
                sys::cuMemcpy3DAsync_v2(&raw const p, self.stream())
            });
        }
        // 2-D copies, one per slice.
        for z in 0..c.depth {
            let hz = unsafe { h.add(z * c.host_slice_pitch) };
            let dz = c.device + z as u64 * c.device_slice_pitch;
            let mut p = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: src_t,
                srcHost: std::ptr::null(),
                srcDevice: 0,
                srcArray: std::ptr::null_mut(),
                srcPitch: 0,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: dst_t,
                dstHost: std::ptr::null_mut(),
                dstDevice: 0,
                dstArray: std::ptr::null_mut(),
                dstPitch: 0,
                WidthInBytes: 0,
                Height: 0,
            };
            if to_device {
                p.srcHost = hz as *const c_void;
                p.srcPitch = c.host_pitch;
                p.dstDevice = dz;
                p.dstPitch = dev_pitch;
            } else {
                p.srcDevice = dz;
                p.srcPitch = dev_pitch;
                p.dstHost = hz.cast::<c_void>();
                p.dstPitch = c.host_pitch;
            }
            p.WidthInBytes = c.width;
            p.Height = c.height;
            check("cuMemcpy2DAsync", unsafe {
                sys::cuMemcpy2DAsync_v2(&raw const p, self.stream())
            })?;
        }
        Ok(())
    }
}

impl CudaDevice {
    /// Enqueues every copy and records a fence. When any step fails, waits for the copies
    /// already enqueued before returning the error, so that the caller may free or reuse the
    /// host memory at once.
    ///
    /// # Safety
    /// As [`Device::to_device`].
    unsafe fn enqueue_all(
        &self,
        host: *mut u8,
        copies: &[Pitched],
        to_device: bool,
    ) -> Result<Fence, DeviceError> {
        let _ctx = self.enter()?;
        let mut result = Ok(());
        for c in copies {
            // SAFETY: forwarded contract.
            result = unsafe { self.enqueue(host, c, to_device) };
            if result.is_err() {
                break;
            }
        }
        let fence = result.and_then(|()| self.record());
        if fence.is_err() {
            // SAFETY: a valid stream of the current context.
            let _ = unsafe { cudarc::driver::result::stream::synchronize(self.stream()) };
        }
        fence
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let Ok(_ctx) = self.enter() else { return };
        let g = self
            .events
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (_, e) in g.1.drain() {
            // SAFETY: events created by this device, not used afterwards.
            let _ = unsafe { cudarc::driver::result::event::destroy(e as sys::CUevent) };
        }
        if self.owns_stream {
            // SAFETY: the stream this device created.
            let _ = unsafe { cudarc::driver::result::stream::destroy(self.stream()) };
        }
        // SAFETY: retained in `open`.
        let _ = unsafe { cudarc::driver::result::primary_ctx::release(self.device) };
    }
}

impl Device for CudaDevice {
    fn pinned(&self, len: usize) -> Result<PinnedBuf, DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: the context is current.
        let p = unsafe {
            cudarc::driver::result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
        }
        .map_err(driver("cuMemHostAlloc"))?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| DeviceError::Driver {
            call: "cuMemHostAlloc",
            detail: "returned a null pointer".into(),
        })?;
        // The buffer keeps the primary context alive (its own retain) until it is freed,
        // whatever is dropped first.
        // SAFETY: a valid device handle.
        let ctx = unsafe { cudarc::driver::result::primary_ctx::retain(self.device) }
            .map_err(driver("cuDevicePrimaryCtxRetain"))? as usize;
        let device = self.device;
        let free = Box::new(move |p: NonNull<u8>, _len: usize| {
            // SAFETY: memory from cuMemHostAlloc in this context, not used afterwards; the
            // context retained above is released after it.
            unsafe {
                let mut previous: sys::CUcontext = std::ptr::null_mut();
                let _ = sys::cuCtxGetCurrent(&raw mut previous);
                let _ = sys::cuCtxSetCurrent(ctx as sys::CUcontext);
                let _ = cudarc::driver::result::free_host(p.as_ptr().cast::<c_void>());
                let _ = sys::cuCtxSetCurrent(previous);
                let _ = cudarc::driver::result::primary_ctx::release(device);
            }
        });
        // SAFETY: fresh pinned memory of `len` bytes (at least 1 allocated), owned here.
        Ok(unsafe { PinnedBuf::from_raw(ptr, len, free) })
    }

    unsafe fn to_device(&self, host: *const u8, copies: &[Pitched]) -> Result<Fence, DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { self.enqueue_all(host.cast_mut(), copies, true) }
    }

    unsafe fn to_host(&self, host: *mut u8, copies: &[Pitched]) -> Result<Fence, DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { self.enqueue_all(host, copies, false) }
    }

    fn wait(&self, fence: Fence) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        let event = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1
            .remove(&fence.0);
        let Some(e) = event else {
            return Err(DeviceError::UnknownFence(fence.0));
        };
        let e = e as sys::CUevent;
        // SAFETY: an event recorded by this device.
        let r = unsafe { cudarc::driver::result::event::synchronize(e) }
            .map_err(driver("cuEventSynchronize"));
        // SAFETY: as above; not used afterwards.
        let _ = unsafe { cudarc::driver::result::event::destroy(e) };
        r
    }
}
