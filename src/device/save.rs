//! Device memory as a save source: [`DevicePiece`], a box of a global tensor in a device
//! view. The saver ([`crate::Saver`]) downloads the boxes its chunks need straight into its
//! page-locked staging memory ([`DevicePiece::copies`]).

use super::copy::{Pitched, pitched_copies};
use super::{DeviceError, DeviceView};
use crate::error::Result;
use crate::model::{DType, Region, Replica, TensorKey};

/// A box of a global tensor held in device memory at save time (as [`ShardedTensor::new`](crate::ShardedTensor::new),
/// with the data in a device view).
#[derive(Debug, Clone)]
pub struct DevicePiece {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    replica: Replica,
    view: DeviceView,
    /// The region's bytes (checked to fit a `usize` by `new`).
    bytes: usize,
}

impl DevicePiece {
    /// A piece whose elements are read from `view`. `replica_id` as in [`ShardedTensor::new`](crate::ShardedTensor::new).
    ///
    /// # Errors
    /// [`Error::Tensor`](crate::Error::Tensor) when the region is malformed or out of bounds; [`Error::Device`](crate::Error::Device)
    /// when the view's strides do not fit the region or overlap.
    pub fn new(
        key: TensorKey,
        dtype: DType,
        global_shape: Vec<u64>,
        region: Region,
        replica_id: u32,
        view: DeviceView,
    ) -> Result<Self> {
        // An expanded (overlapping) view is refused: save a contiguous copy of it instead.
        let bytes = super::check_device_box(&key, dtype, &global_shape, &region, &view)?;
        Ok(DevicePiece {
            key,
            dtype,
            global_shape,
            region,
            replica: Replica::Id(replica_id),
            view,
            bytes,
        })
    }

    /// The same piece with another replica declaration (for instance [`Replica::Auto`]).
    #[must_use]
    pub fn with_replica(mut self, replica: Replica) -> Self {
        self.replica = replica;
        self
    }

    /// The tensor's key.
    #[must_use]
    pub fn key(&self) -> &TensorKey {
        &self.key
    }

    /// The element type.
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The global tensor's shape.
    #[must_use]
    pub fn global_shape(&self) -> &[u64] {
        &self.global_shape
    }

    /// The box this piece holds.
    #[must_use]
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The replica declaration.
    #[must_use]
    pub fn replica(&self) -> Replica {
        self.replica
    }

    /// Bytes of the piece's box.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The pitched copies that download `region` (a box inside this piece's) from the device
    /// into a contiguous C-order host block starting at `host_offset`.
    ///
    /// # Errors
    /// [`DeviceError::View`] when the view cannot be expressed as pitched copies (checked
    /// by [`DevicePiece::new`], so not expected).
    pub fn copies(
        &self,
        region: &Region,
        host_offset: usize,
    ) -> std::result::Result<Vec<Pitched>, DeviceError> {
        let rel: Vec<u64> = region
            .offset()
            .iter()
            .zip(self.region.offset())
            .map(|(a, b)| a - b)
            .collect();
        let elem = self.dtype.size();
        let view = self.view.offset_by(&rel, elem);
        pitched_copies(
            region.shape(),
            view.strides(),
            elem,
            view.address(),
            host_offset,
        )
        .map_err(|source| DeviceError::View {
            key: self.key.to_string(),
            source,
        })
    }
}
