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

/// Checks a device box before it is used as a save source or a load target: the region is
/// well formed and inside `global_shape`, its bytes fit a `usize`, and `view`'s strides fit
/// the region without overlapping (an expanded view has no pitched-copy form on a GPU).
/// Returns the region's bytes.
fn check_device_box(
    key: &crate::model::TensorKey,
    dtype: crate::model::DType,
    global_shape: &[u64],
    region: &crate::model::Region,
    view: &DeviceView,
) -> crate::error::Result<usize> {
    let bytes =
        crate::model::region::num_bytes(region.shape(), dtype.size()).map_err(|source| {
            crate::model::TensorError::Region {
                key: key.to_string(),
                source,
            }
        })?;
    crate::model::tensor::check_piece(key, dtype, global_shape, region, bytes)?;
    let wrap = |source| DeviceError::View {
        key: key.to_string(),
        source,
    };
    copy::view_extent(region.shape(), view.strides(), dtype.size()).map_err(wrap)?;
    copy::check_disjoint(region.shape(), view.strides()).map_err(wrap)?;
    Ok(bytes)
}
