//! Sharded tensors: the pieces a rank holds when saving, and the pieces it asks for when loading.

use super::convert::Cast;
use super::dtype::{DType, Element, as_bytes, as_bytes_mut};
use super::key::{KeyError, TensorKey};
use super::region::{Region, RegionError, num_bytes};

/// What is wrong with a tensor piece a caller handed in.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// The key is invalid.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The region is malformed or outside the global shape.
    #[error("tensor `{key}`: {source}")]
    Region {
        /// The tensor.
        key: String,
        /// What is wrong.
        #[source]
        source: RegionError,
    },
    /// A `bool` piece holds a byte other than 0 or 1.
    #[error(
        "tensor `{key}`: bool element at byte {offset} is {value:#04x}; bool bytes must be 0 or 1"
    )]
    InvalidBool {
        /// The tensor.
        key: TensorKey,
        /// Byte offset in the piece's buffer.
        offset: usize,
        /// The byte.
        value: u8,
    },
    /// The buffer does not hold exactly the region's bytes.
    #[error(
        "tensor `{key}`: region {region} of {dtype} needs {expected} bytes, the buffer has {got}"
    )]
    BufferSize {
        /// The tensor.
        key: TensorKey,
        /// The region.
        region: Region,
        /// The data type.
        dtype: DType,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
}

fn check_piece(
    key: &TensorKey,
    dtype: DType,
    global_shape: &[u64],
    region: &Region,
    len: usize,
) -> Result<(), TensorError> {
    let wrap = |source| TensorError::Region {
        key: key.to_string(),
        source,
    };
    Region::new(region.offset.clone(), region.shape.clone()).map_err(wrap)?;
    region.check_within(global_shape).map_err(wrap)?;
    crate::model::region::num_elements(global_shape).map_err(wrap)?;
    let expected = num_bytes(&region.shape, dtype.size()).map_err(wrap)?;
    if expected != len {
        return Err(TensorError::BufferSize {
            key: key.clone(),
            region: region.clone(),
            dtype,
            expected,
            got: len,
        });
    }
    Ok(())
}

/// One piece of a global tensor held by a rank at save time.
///
/// `data` holds the piece's elements in C (row-major) order, native byte order (this crate
/// supports little-endian hosts only).
#[derive(Debug, Clone)]
pub struct ShardedTensor<'a> {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    replica_id: u32,
    data: &'a [u8],
}

impl<'a> ShardedTensor<'a> {
    /// A piece from raw bytes.
    ///
    /// `replica_id` 0 marks the main replica; other values mark copies of a piece some other
    /// rank also holds (data parallelism). The main replicas of a tensor must cover every
    /// element exactly once across all ranks.
    ///
    /// # Errors
    /// [`TensorError`] when the region is malformed or out of bounds, or `data` does not hold
    /// exactly the region's bytes.
    pub fn new(
        key: TensorKey,
        dtype: DType,
        global_shape: Vec<u64>,
        region: Region,
        replica_id: u32,
        data: &'a [u8],
    ) -> Result<Self, TensorError> {
        check_piece(&key, dtype, &global_shape, &region, data.len())?;
        if dtype == DType::Bool
            && let Some(offset) = data.iter().position(|&b| b > 1)
        {
            return Err(TensorError::InvalidBool {
                key,
                offset,
                value: data[offset],
            });
        }
        Ok(ShardedTensor {
            key,
            dtype,
            global_shape,
            region,
            replica_id,
            data,
        })
    }

    /// A piece from typed elements; the data type follows from `T`.
    ///
    /// # Errors
    /// As [`ShardedTensor::new`], plus [`TensorError::Key`] for an invalid key.
    pub fn from_slice<T: Element>(
        key: &str,
        global_shape: &[u64],
        offset: &[u64],
        data: &'a [T],
        local_shape: &[u64],
        replica_id: u32,
    ) -> Result<Self, TensorError> {
        let key = TensorKey::new(key)?;
        let region = Region {
            offset: offset.to_vec(),
            shape: local_shape.to_vec(),
        };
        Self::new(
            key,
            T::DTYPE,
            global_shape.to_vec(),
            region,
            replica_id,
            as_bytes(data),
        )
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
    /// Where this piece sits in the global tensor.
    #[must_use]
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// 0 for the main replica.
    #[must_use]
    pub fn replica_id(&self) -> u32 {
        self.replica_id
    }
    /// True for the main replica.
    #[must_use]
    pub fn is_main(&self) -> bool {
        self.replica_id == 0
    }
    /// The piece's bytes (C order).
    #[must_use]
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
}

/// A piece of a global tensor a rank asks for at load time, with the buffer to fill.
#[derive(Debug)]
pub struct LoadTarget<'a> {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    buf: &'a mut [u8],
    cast: Cast,
}

impl<'a> LoadTarget<'a> {
    /// A request to fill `buf` with `region` of the tensor `key`, which must have exactly this
    /// data type and global shape in the checkpoint (nothing is cast or reshaped silently).
    ///
    /// # Errors
    /// [`TensorError`] when the region is malformed or out of bounds, or `buf` is not exactly
    /// the region's size.
    pub fn new(
        key: TensorKey,
        dtype: DType,
        global_shape: Vec<u64>,
        region: Region,
        buf: &'a mut [u8],
    ) -> Result<Self, TensorError> {
        check_piece(&key, dtype, &global_shape, &region, buf.len())?;
        Ok(LoadTarget {
            key,
            dtype,
            global_shape,
            region,
            buf,
            cast: Cast::Exact,
        })
    }

    /// A request into typed elements; the data type follows from `T`.
    ///
    /// # Errors
    /// As [`LoadTarget::new`], plus [`TensorError::Key`] for an invalid key.
    pub fn from_slice<T: Element>(
        key: &str,
        global_shape: &[u64],
        offset: &[u64],
        buf: &'a mut [T],
        local_shape: &[u64],
    ) -> Result<Self, TensorError> {
        let key = TensorKey::new(key)?;
        let region = Region {
            offset: offset.to_vec(),
            shape: local_shape.to_vec(),
        };
        Self::new(
            key,
            T::DTYPE,
            global_shape.to_vec(),
            region,
            as_bytes_mut(buf),
        )
    }

    /// The tensor's key.
    #[must_use]
    pub fn key(&self) -> &TensorKey {
        &self.key
    }
    /// The element type expected.
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The global shape expected.
    #[must_use]
    pub fn global_shape(&self) -> &[u64] {
        &self.global_shape
    }
    /// The region asked for.
    #[must_use]
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// The destination buffer.
    #[must_use]
    pub fn buf(&self) -> &[u8] {
        self.buf
    }
    /// The destination buffer, mutably.
    pub fn buf_mut(&mut self) -> &mut [u8] {
        self.buf
    }
    /// The region and the buffer at once.
    pub fn region_and_buf(&mut self) -> (&Region, &mut [u8]) {
        (&self.region, self.buf)
    }

    /// The same request, accepting a stored data type other than its own as `cast` says
    /// (by default [`Cast::Exact`]: the stored type must be the target's).
    ///
    /// ```
    /// use zarrckpt::{Cast, LoadTarget};
    /// // Load a float32 (or float16, float64) checkpoint tensor into bfloat16, rounding to
    /// // nearest even.
    /// let mut w = vec![half::bf16::ZERO; 12];
    /// let t = LoadTarget::from_slice("w", &[4, 3], &[0, 0], &mut w, &[4, 3])?
    ///     .with_cast(Cast::FloatConvert);
    /// # Ok::<(), zarrckpt::TensorError>(())
    /// ```
    #[must_use]
    pub fn with_cast(mut self, cast: Cast) -> Self {
        self.cast = cast;
        self
    }

    /// Which stored data types this request accepts.
    #[must_use]
    pub fn cast(&self) -> Cast {
        self.cast
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_buffer_and_bounds() {
        let data = vec![0f32; 6];
        ShardedTensor::from_slice("w", &[4, 3], &[2, 0], &data, &[2, 3], 0).unwrap();
        let err = ShardedTensor::from_slice("w", &[4, 3], &[3, 0], &data, &[2, 3], 0).unwrap_err();
        assert!(matches!(err, TensorError::Region { .. }), "{err}");
        let err = ShardedTensor::from_slice("w", &[4, 3], &[0, 0], &data, &[1, 3], 0).unwrap_err();
        assert!(
            matches!(
                err,
                TensorError::BufferSize {
                    expected: 12,
                    got: 24,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("`w`"));
        let bad = [0u8, 1, 2];
        let key = TensorKey::new("m").unwrap();
        let err =
            ShardedTensor::new(key, DType::Bool, vec![3], Region::full(&[3]), 0, &bad).unwrap_err();
        assert!(
            matches!(
                err,
                TensorError::InvalidBool {
                    offset: 2,
                    value: 2,
                    ..
                }
            ),
            "{err}"
        );
        let mut buf = vec![0u16; 3];
        let t = LoadTarget::from_slice("b", &[3], &[0], &mut buf, &[3]).unwrap();
        assert_eq!(t.dtype(), DType::UInt16);
        assert!(LoadTarget::from_slice::<u16>("../b", &[3], &[0], &mut buf, &[3]).is_err());
    }
}
