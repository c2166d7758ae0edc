//! Device memory (GPU) as load targets and save sources.
//!
//! A [`Device`] moves bytes between page-locked ("pinned") host memory and device memory,
//! asynchronously, in pitched 2-D / 3-D copies ([`copy::Pitched`]). On top of it:
//! - [`load_to_device`] reads a checkpoint into device views (whole tensors, sub-regions,
//!   column strips) through a bounded, reused pool of two pinned staging buffers: while one
//!   buffer's bytes are copied to the device, storage reads fill the other. A tensor larger
//!   than a buffer is cut into slabs ([`copy::slabs`]); no full-tensor host copy is made.
//! - [`DevicePiece`]: a box of a tensor in a device view, saved by [`crate::Saver`] (in a
//!   [`crate::SaveRequest`]): the saver downloads the chunks it writes straight into its
//!   bounded, reused page-locked staging memory, so an asynchronous save blocks only for
//!   that download.
//!
//! Two devices implement the trait: [`SimDevice`], host memory posing as a device with
//! deferred copies (used by the tests: a buffer reused before its copy finished shows up as
//! wrong bytes), and `CudaDevice` (cargo feature `cuda`, through cudarc, loading the CUDA
//! driver at run time: a build without CUDA installed works, and `CudaDevice::new` returns
//! [`DeviceError::Unavailable`] where no driver or GPU is found).

pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
mod load;
#[cfg(feature = "nccl")]
pub mod nccl;
mod save;
mod sim;

use std::fmt;
use std::ptr::NonNull;

pub use copy::{Pitched, ViewError};
#[cfg(feature = "cuda")]
pub use cuda::CudaDevice;
pub use load::{
    DeviceLoadReport, DeviceStaging, DeviceTarget, load_to_device, load_to_device_with_objects,
};
#[cfg(feature = "nccl")]
pub use nccl::NcclComm;
pub use save::DevicePiece;
pub use sim::SimDevice;

/// What went wrong with a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No driver or no such device.
    #[error("no device: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("device call {call} failed: {detail}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's message.
        detail: String,
    },
    /// A copy touches device memory outside any allocation (simulated device only: a real
    /// driver reports an illegal address, or worse).
    #[error("device address range {address:#x}+{len} is outside any allocation")]
    OutOfBounds {
        /// First byte.
        address: u64,
        /// Length.
        len: u64,
    },
    /// A fence this device did not hand out, or one already waited on.
    #[error("fence {0} is not a pending fence of this device")]
    UnknownFence(u64),
    /// A value the driver's interface cannot represent (an ordinal or pitch beyond its
    /// integer types).
    #[error("{what} = {value} does not fit the driver's interface")]
    OutOfRange {
        /// What the value is.
        what: &'static str,
        /// The value.
        value: u64,
    },
    /// A view that cannot be a target or source.
    #[error("tensor {key}: {source}")]
    View {
        /// The tensor.
        key: String,
        /// Why.
        source: ViewError,
    },
}

/// How a [`PinnedBuf`]'s memory is given back.
pub type FreePinned = Box<dyn FnOnce(NonNull<u8>, usize) + Send + Sync>;

/// Page-locked host memory from a [`Device`]; freed when dropped.
pub struct PinnedBuf {
    ptr: NonNull<u8>,
    len: usize,
    free: Option<FreePinned>,
}

// SAFETY: the buffer is plain memory owned by this value; access goes through &/&mut self.
unsafe impl Send for PinnedBuf {}
// SAFETY: as above; shared access is read-only.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// Wraps memory a device allocated.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until `free` is called, and
    /// owned by nothing else.
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize, free: FreePinned) -> Self {
        PinnedBuf {
            ptr,
            len,
            free: Some(free),
        }
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte.
    #[must_use]
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The first byte, writable.
    #[must_use]
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for PinnedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: valid for `len` bytes (from_raw's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: valid for `len` bytes and uniquely owned (from_raw's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if let Some(free) = self.free.take() {
            free(self.ptr, self.len);
        }
    }
}

impl fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuf").field("len", &self.len).finish()
    }
}

/// A point in a device's queue of copies: waiting on it waits for every copy enqueued
/// before it.
#[derive(Debug)]
pub struct Fence(pub(crate) u64);

/// A device that copies between pinned host memory and device memory, asynchronously and
/// in order: copies run in the order they were enqueued.
pub trait Device: Send + Sync + fmt::Debug {
    /// Allocates `len` bytes of pinned host memory.
    ///
    /// # Errors
    /// [`DeviceError`] when the allocation fails.
    fn pinned(&self, len: usize) -> Result<PinnedBuf, DeviceError>;

    /// Enqueues copies from the host block at `host` to the device.
    ///
    /// # Errors
    /// [`DeviceError`] when a copy cannot be enqueued.
    ///
    /// # Safety
    /// `host` must point into pinned memory from [`Device::pinned`], valid for every copy's
    /// host range, and left untouched until [`Device::wait`] of the returned fence (or a
    /// later one) returns; the device ranges must be valid device memory.
    unsafe fn to_device(&self, host: *const u8, copies: &[Pitched]) -> Result<Fence, DeviceError>;

    /// Enqueues copies from the device to the host block at `host`.
    ///
    /// # Errors
    /// [`DeviceError`] when a copy cannot be enqueued.
    ///
    /// # Safety
    /// As [`Device::to_device`]; the host bytes hold the result only once the fence was
    /// waited on.
    unsafe fn to_host(&self, host: *mut u8, copies: &[Pitched]) -> Result<Fence, DeviceError>;

    /// Waits until every copy enqueued up to `fence` has finished.
    ///
    /// # Errors
    /// [`DeviceError`] when a copy failed.
    fn wait(&self, fence: Fence) -> Result<(), DeviceError>;
}

/// A strided window of device memory holding a box of a tensor: the element at index `i` of
/// the box lives at `address + sum(i[d] * strides[d]) * element size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceView {
    address: u64,
    strides: Vec<u64>,
}

impl DeviceView {
    /// A view at `address` with `strides` in elements (torch's `data_ptr()` and `stride()`).
    ///
    /// # Safety
    /// For as long as the view is used, the memory it spans (for the box it is attached to)
    /// must be valid device memory of the [`Device`] it is used with, and not be used by
    /// anything else while a load writes into it.
    #[must_use]
    pub unsafe fn new(address: u64, strides: Vec<u64>) -> Self {
        DeviceView { address, strides }
    }

    /// A view of a contiguous (C-order) buffer of `shape`.
    ///
    /// # Safety
    /// As [`DeviceView::new`].
    #[must_use]
    pub unsafe fn contiguous(address: u64, shape: &[u64]) -> Self {
        DeviceView {
            address,
            strides: copy::contiguous_strides(shape),
        }
    }

    /// The device address of the first element.
    #[must_use]
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Strides in elements.
    #[must_use]
    pub fn strides(&self) -> &[u64] {
        &self.strides
    }

    /// The view of the sub-box starting `rel` elements into this one.
    fn offset_by(&self, rel: &[u64], elem: usize) -> DeviceView {
        let off: u64 = rel.iter().zip(&self.strides).map(|(r, s)| r * s).sum();
        DeviceView {
            address: self.address + off * elem as u64,
            strides: self.strides.clone(),
        }
    }
}
