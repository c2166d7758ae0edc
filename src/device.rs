//! Device memory (GPU) as load targets and save sources: the device engines, over the device
//! memory layer (the [`Device`] trait and its drivers, re-exported here from a layer beneath
//! save and load, so that the crate's `Error` can carry a [`DeviceError`]).
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

pub use crate::devmem::copy;
#[cfg(feature = "cuda")]
pub use crate::devmem::cuda;
mod load;
#[cfg(feature = "nccl")]
pub mod nccl;
mod save;
use crate::devmem::sim;

pub use crate::devmem::{Device, DeviceError, DeviceView, Fence, FreePinned, PinnedBuf};
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
