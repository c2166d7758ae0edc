//! Sharded tensors: the pieces a rank holds when saving, and the pieces it asks for when loading.

use std::ops::Range;

use super::convert::Cast;
use super::dtype::{DType, Element, as_bytes, as_bytes_mut};
use super::flat::{FlatBox, check_flat_range, flat_boxes};
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
    /// The buffer does not hold exactly the flat range's bytes.
    #[error(
        "tensor `{key}`: flat range {}..{} of {dtype} needs {expected} bytes, the buffer has {got}",
        range.start, range.end
    )]
    FlatBufferSize {
        /// The tensor.
        key: TensorKey,
        /// The flat range (elements, C order).
        range: Range<u64>,
        /// The data type.
        dtype: DType,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
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

pub(crate) fn check_piece(
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
    Region::new(region.offset().to_vec(), region.shape().to_vec()).map_err(wrap)?;
    region.check_within(global_shape).map_err(wrap)?;
    crate::model::region::num_elements(global_shape).map_err(wrap)?;
    let expected = num_bytes(region.shape(), dtype.size()).map_err(wrap)?;
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

/// A flat piece's range and its decomposition into boxes (see [`crate::model::flat`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Flat {
    range: Range<u64>,
    boxes: Vec<FlatBox>,
}

/// Validates a flat piece and returns its decomposition and bounding box.
fn check_flat(
    key: &TensorKey,
    dtype: DType,
    global_shape: &[u64],
    range: &Range<u64>,
    len: usize,
) -> Result<(Flat, Region), TensorError> {
    let wrap = |source| TensorError::Region {
        key: key.to_string(),
        source,
    };
    if global_shape.len() > crate::model::region::MAX_DIMS {
        return Err(wrap(RegionError::TooManyDims {
            dims: global_shape.len(),
        }));
    }
    check_flat_range(global_shape, range).map_err(wrap)?;
    let count = range.end - range.start;
    let expected = usize::try_from(count)
        .ok()
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| {
            wrap(RegionError::Overflow {
                what: "byte size",
                shape: vec![count],
            })
        })?;
    let boxes = flat_boxes(global_shape, range.clone()).map_err(wrap)?;
    let bounding = bounding_box(global_shape, &boxes);
    if expected != len {
        return Err(TensorError::FlatBufferSize {
            key: key.clone(),
            range: range.clone(),
            dtype,
            expected,
            got: len,
        });
    }
    Ok((
        Flat {
            range: range.clone(),
            boxes,
        },
        bounding,
    ))
}

/// The smallest box holding `boxes`; for none, an empty box at the origin (zero extent along
/// the first dimension).
fn bounding_box(global_shape: &[u64], boxes: &[FlatBox]) -> Region {
    let n = global_shape.len();
    let Some(first) = boxes.first() else {
        return empty_box(global_shape);
    };
    let mut lo = first.region.offset().to_vec();
    let mut hi: Vec<u64> = (0..n).map(|d| first.region.end(d)).collect();
    for b in &boxes[1..] {
        for d in 0..n {
            lo[d] = lo[d].min(b.region.offset()[d]);
            hi[d] = hi[d].max(b.region.end(d));
        }
    }
    // The hull of valid boxes: lo <= hi, and every end is one of theirs.
    Region::from_parts_unchecked(lo.clone(), hi.iter().zip(&lo).map(|(h, l)| h - l).collect())
}

/// An empty box at the origin: what a rank holding an empty flat range declares, so that it
/// still takes part in the checks on data type and global shape.
fn empty_box(global_shape: &[u64]) -> Region {
    let mut shape = global_shape.to_vec();
    if let Some(first) = shape.first_mut() {
        *first = 0;
    }
    // Offset zero: no end overflows.
    Region::from_parts_unchecked(vec![0; global_shape.len()], shape)
}

/// The boxes a flat piece is saved or loaded as: its decomposition, or one empty box for an
/// empty range (none for a scalar).
fn box_list(global_shape: &[u64], flat: &Flat) -> Vec<FlatBox> {
    if flat.boxes.is_empty() && !global_shape.is_empty() {
        vec![FlatBox {
            region: empty_box(global_shape),
            start: 0,
        }]
    } else {
        flat.boxes.clone()
    }
}

/// Byte range of a flat box in its piece's buffer (valid: checked when the piece was built).
fn byte_range(b: &FlatBox, elem: usize) -> Range<usize> {
    let start = crate::model::usize_of(b.start) * elem;
    let n = b
        .region
        .num_elements()
        .map(crate::model::usize_of)
        .expect("a flat box's element count was checked when its piece was built");
    start..start + n * elem
}

/// How a piece relates to copies of the same box on other ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Replica {
    /// An explicit replica id: 0 marks the main replica (the one stored), any other value a
    /// copy of a box some other rank holds as main. The main replicas of a tensor must cover
    /// every element exactly once across all ranks.
    Id(u32),
    /// Replicated without an id: every rank that declares this very box (same key, same
    /// offsets and extents) as `Auto` holds the same data, and the save stores it once,
    /// written by one of them (picked by the plan, balanced across holders like explicit
    /// replicas). A box held as `Auto` by one rank and with id 0 by another is stored from
    /// the id-0 rank's data or from any `Auto` holder: all must hold the same bytes.
    Auto,
}

impl From<u32> for Replica {
    fn from(id: u32) -> Self {
        Replica::Id(id)
    }
}

/// One piece of a global tensor held by a rank at save time.
///
/// A piece is either a box ([`ShardedTensor::new`], [`ShardedTensor::from_slice`]) or a
/// contiguous range of the tensor's C-order flattening ([`ShardedTensor::from_flat`],
/// [`ShardedTensor::from_flat_slice`]: ZeRO / FSDP1 flat shards). `data` holds the piece's
/// elements in C (row-major) order, native byte order (this crate supports little-endian
/// hosts only).
#[derive(Debug, Clone)]
pub struct ShardedTensor<'a> {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    replica: Replica,
    flat: Option<Flat>,
    data: &'a [u8],
}

fn check_bool(key: &TensorKey, dtype: DType, data: &[u8]) -> Result<(), TensorError> {
    if dtype == DType::Bool
        && let Some(offset) = data.iter().position(|&b| b > 1)
    {
        return Err(TensorError::InvalidBool {
            key: key.clone(),
            offset,
            value: data[offset],
        });
    }
    Ok(())
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
        check_bool(&key, dtype, data)?;
        Ok(ShardedTensor {
            key,
            dtype,
            global_shape,
            region,
            replica: Replica::Id(replica_id),
            flat: None,
            data,
        })
    }

    /// A flat piece from raw bytes: the elements `range.start..range.end` of the tensor's
    /// C-order flattening (Megatron's `flattened_range`, an FSDP1 flat parameter's share).
    /// `data` holds exactly those elements. An empty range is allowed (the rank then holds
    /// nothing of the tensor but still declares its data type and shape). `replica_id` as in
    /// [`ShardedTensor::new`].
    ///
    /// Saving stores the range as the boxes of its decomposition
    /// ([`crate::model::flat::flat_boxes`]), so flat and box pieces of one tensor mix freely
    /// as long as the main replicas cover every element exactly once.
    ///
    /// # Errors
    /// [`TensorError`] when the range is reversed or past the tensor's end, the shape is
    /// malformed, or `data` does not hold exactly the range's bytes.
    pub fn from_flat(
        key: TensorKey,
        dtype: DType,
        global_shape: Vec<u64>,
        range: Range<u64>,
        replica_id: u32,
        data: &'a [u8],
    ) -> Result<Self, TensorError> {
        let (flat, region) = check_flat(&key, dtype, &global_shape, &range, data.len())?;
        check_bool(&key, dtype, data)?;
        Ok(ShardedTensor {
            key,
            dtype,
            global_shape,
            region,
            replica: Replica::Id(replica_id),
            flat: Some(flat),
            data,
        })
    }

    /// A flat piece from typed elements; the data type follows from `T`.
    ///
    /// ```
    /// # use zarrckpt::ShardedTensor;
    /// // elements 5..17 of a [4, 6] tensor: a partial row, a whole row, a partial row
    /// let data = vec![0f32; 12];
    /// let piece = ShardedTensor::from_flat_slice("w", &[4, 6], 5..17, &data, 0)?;
    /// assert_eq!(piece.flat_range(), Some(5..17));
    /// assert_eq!(piece.box_pieces().len(), 3);
    /// # Ok::<(), zarrckpt::model::TensorError>(())
    /// ```
    ///
    /// # Errors
    /// As [`ShardedTensor::from_flat`], plus [`TensorError::Key`] for an invalid key.
    pub fn from_flat_slice<T: Element>(
        key: &str,
        global_shape: &[u64],
        range: Range<u64>,
        data: &'a [T],
        replica_id: u32,
    ) -> Result<Self, TensorError> {
        Self::from_flat(
            TensorKey::new(key)?,
            T::DTYPE,
            global_shape.to_vec(),
            range,
            replica_id,
            as_bytes(data),
        )
    }

    /// A box that several ranks hold identically, declared [`Replica::Auto`]: each holder
    /// declares it the same way and the save stores it once, with no replica ids to
    /// assign by hand (what PyTorch DCP does for identical boxes).
    ///
    /// ```
    /// # use zarrckpt::ShardedTensor;
    /// let bias = vec![1f32; 2048];
    /// // every data-parallel rank declares the whole bias the same way
    /// let piece = ShardedTensor::replicated("layer.bias", &[2048], &[0], &bias, &[2048])?;
    /// assert!(!piece.is_main());
    /// # Ok::<(), zarrckpt::model::TensorError>(())
    /// ```
    ///
    /// # Errors
    /// As [`ShardedTensor::from_slice`].
    pub fn replicated<T: Element>(
        key: &str,
        global_shape: &[u64],
        offset: &[u64],
        data: &'a [T],
        local_shape: &[u64],
    ) -> Result<Self, TensorError> {
        Ok(
            Self::from_slice(key, global_shape, offset, data, local_shape, 0)?
                .with_replica(Replica::Auto),
        )
    }

    /// The same piece with another replica declaration (for instance [`Replica::Auto`] on a
    /// flat piece).
    #[must_use]
    pub fn with_replica(mut self, replica: Replica) -> Self {
        self.replica = replica;
        self
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
        let region = Region::new(offset.to_vec(), local_shape.to_vec()).map_err(|source| {
            TensorError::Region {
                key: key.to_string(),
                source,
            }
        })?;
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
    /// Where this piece sits in the global tensor: its box, or for a flat piece the smallest
    /// box holding its range (which the piece fills only in part; see
    /// [`ShardedTensor::box_pieces`]).
    #[must_use]
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// The explicit replica id: 0 for the main replica, and also 0 for [`Replica::Auto`]
    /// (see [`ShardedTensor::replica`]).
    #[must_use]
    pub fn replica_id(&self) -> u32 {
        match self.replica {
            Replica::Id(id) => id,
            Replica::Auto => 0,
        }
    }
    /// How the piece was declared with respect to copies on other ranks.
    #[must_use]
    pub fn replica(&self) -> Replica {
        self.replica
    }
    /// True for the main replica (replica id 0; false for [`Replica::Auto`], whose stored
    /// copy the plan picks).
    #[must_use]
    pub fn is_main(&self) -> bool {
        self.replica == Replica::Id(0)
    }
    /// True when declared [`Replica::Auto`].
    #[must_use]
    pub fn is_auto_replica(&self) -> bool {
        self.replica == Replica::Auto
    }
    /// The flat range of a flat piece (elements, C order), `None` for a box piece.
    #[must_use]
    pub fn flat_range(&self) -> Option<Range<u64>> {
        self.flat.as_ref().map(|f| f.range.clone())
    }
    /// The piece as box pieces: itself for a box piece; for a flat piece, one piece per box
    /// of its range's decomposition (at most `2 * ndim - 1`), each borrowing its contiguous
    /// part of the data, with the same key, data type, shape and replica declaration (an
    /// empty range gives one empty box, or none for a scalar).
    #[must_use]
    pub fn box_pieces(&self) -> Vec<ShardedTensor<'a>> {
        let Some(flat) = &self.flat else {
            return vec![self.clone()];
        };
        let elem = self.dtype.size();
        box_list(&self.global_shape, flat)
            .into_iter()
            .map(|b| ShardedTensor {
                key: self.key.clone(),
                dtype: self.dtype,
                global_shape: self.global_shape.clone(),
                data: &self.data[byte_range(&b, elem)],
                region: b.region,
                replica: self.replica,
                flat: None,
            })
            .collect()
    }
    /// The piece's bytes (C order).
    #[must_use]
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
}

/// The pieces as boxes: `pieces` itself when none is flat, else [`expand_flat_pieces`].
#[must_use]
pub fn boxed_pieces<'p, 'a>(
    pieces: &'p [ShardedTensor<'a>],
) -> std::borrow::Cow<'p, [ShardedTensor<'a>]> {
    if pieces.iter().any(|p| p.flat_range().is_some()) {
        std::borrow::Cow::Owned(expand_flat_pieces(pieces))
    } else {
        std::borrow::Cow::Borrowed(pieces)
    }
}

/// `pieces` with every flat piece replaced by its box pieces ([`ShardedTensor::box_pieces`]),
/// what a save declares. Several empty flat pieces of one key give one empty box, so that a
/// rank holding empty ranges does not declare the same empty box twice.
#[must_use]
pub fn expand_flat_pieces<'a>(pieces: &[ShardedTensor<'a>]) -> Vec<ShardedTensor<'a>> {
    let mut empty_declared: Vec<&TensorKey> = Vec::new();
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        for b in p.box_pieces() {
            if p.flat.is_some() && b.region.is_empty() {
                if empty_declared.contains(&p.key()) {
                    continue;
                }
                empty_declared.push(p.key());
            }
            out.push(b);
        }
    }
    out
}

/// A piece of a global tensor a rank asks for at load time, with the buffer to fill.
///
/// Like a [`ShardedTensor`], a target is a box or a flat range of the tensor's C-order
/// flattening ([`LoadTarget::from_flat`]); any target loads from any saved layout.
#[derive(Debug)]
pub struct LoadTarget<'a> {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    flat: Option<Flat>,
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
            flat: None,
            buf,
            cast: Cast::Exact,
        })
    }

    /// A request to fill `buf` with the elements `range.start..range.end` of the C-order
    /// flattening of tensor `key` (a ZeRO / FSDP1 flat shard), whatever layout it was saved
    /// in. Data type and global shape must match the checkpoint exactly.
    ///
    /// # Errors
    /// [`TensorError`] when the range is reversed or past the tensor's end, the shape is
    /// malformed, or `buf` is not exactly the range's size.
    pub fn from_flat(
        key: TensorKey,
        dtype: DType,
        global_shape: Vec<u64>,
        range: Range<u64>,
        buf: &'a mut [u8],
    ) -> Result<Self, TensorError> {
        let (flat, region) = check_flat(&key, dtype, &global_shape, &range, buf.len())?;
        Ok(LoadTarget {
            key,
            dtype,
            global_shape,
            region,
            flat: Some(flat),
            buf,
            cast: Cast::Exact,
        })
    }

    /// A flat request into typed elements; the data type follows from `T`.
    ///
    /// # Errors
    /// As [`LoadTarget::from_flat`], plus [`TensorError::Key`] for an invalid key.
    pub fn from_flat_slice<T: Element>(
        key: &str,
        global_shape: &[u64],
        range: Range<u64>,
        buf: &'a mut [T],
    ) -> Result<Self, TensorError> {
        Self::from_flat(
            TensorKey::new(key)?,
            T::DTYPE,
            global_shape.to_vec(),
            range,
            as_bytes_mut(buf),
        )
    }

    /// The flat range of a flat request, `None` for a box request.
    #[must_use]
    pub fn flat_range(&self) -> Option<Range<u64>> {
        self.flat.as_ref().map(|f| f.range.clone())
    }

    /// The request as box requests over disjoint parts of its buffer: itself (reborrowed) for
    /// a box request; for a flat request, one per box of its range's decomposition (an empty
    /// range gives one empty box, or none for a scalar).
    #[must_use]
    pub fn box_targets(&mut self) -> Vec<LoadTarget<'_>> {
        let Some(flat) = &self.flat else {
            return vec![LoadTarget {
                key: self.key.clone(),
                dtype: self.dtype,
                global_shape: self.global_shape.clone(),
                region: self.region.clone(),
                flat: None,
                buf: &mut *self.buf,
                cast: self.cast,
            }];
        };
        let elem = self.dtype.size();
        let boxes = box_list(&self.global_shape, flat);
        let mut out = Vec::with_capacity(boxes.len());
        let mut rest: &mut [u8] = &mut *self.buf;
        let mut at = 0usize;
        for b in boxes {
            let range = byte_range(&b, elem);
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - at);
            let (mine, tail) = tail.split_at_mut(range.len());
            rest = tail;
            at = range.end;
            out.push(LoadTarget {
                key: self.key.clone(),
                dtype: self.dtype,
                global_shape: self.global_shape.clone(),
                region: b.region,
                flat: None,
                buf: mine,
                cast: self.cast,
            });
        }
        out
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
        let region = Region::new(offset.to_vec(), local_shape.to_vec()).map_err(|source| {
            TensorError::Region {
                key: key.to_string(),
                source,
            }
        })?;
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
    /// The region asked for (for a flat request, the smallest box holding its range).
    #[must_use]
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// The destination buffer.
    #[must_use]
    pub fn buf(&self) -> &[u8] {
        self.buf
    }
    /// The destination buffer, mutably (for a flat request it holds the range in flattening
    /// order, not the box [`LoadTarget::region`]; see [`LoadTarget::box_targets`]).
    pub fn buf_mut(&mut self) -> &mut [u8] {
        self.buf
    }
    /// The region and the buffer at once (a box request's; see [`LoadTarget::buf_mut`]).
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

    #[test]
    fn flat_pieces_split_into_box_pieces() {
        // elements 5..17 of a [4, 6] tensor, valued by their flat index
        let data: Vec<u32> = (5..17).collect();
        let p = ShardedTensor::from_flat_slice("w", &[4, 6], 5..17, &data, 0).unwrap();
        assert_eq!(p.flat_range(), Some(5..17));
        assert_eq!(p.region(), &Region::new(vec![0, 0], vec![3, 6]).unwrap());
        let boxes = p.box_pieces();
        let regions: Vec<String> = boxes.iter().map(|b| b.region().to_string()).collect();
        assert_eq!(regions, ["[0..1, 5..6]", "[1..2, 0..6]", "[2..3, 0..5]"]);
        for b in &boxes {
            assert!(b.flat_range().is_none() && b.is_main());
            let first = u32::from_le_bytes(b.data()[..4].try_into().unwrap());
            let r = b.region();
            assert_eq!(u64::from(first), r.offset()[0] * 6 + r.offset()[1]);
            assert_eq!(b.data().len(), r.num_elements().unwrap() as usize * 4);
        }
        // a box piece is its own box piece
        let whole = ShardedTensor::from_slice("w", &[2], &[0], &[1u8, 2], &[2], 3).unwrap();
        assert_eq!(whole.box_pieces()[0].region(), whole.region());
        // empty ranges still declare the tensor, with an empty box (none for a scalar)
        let e = ShardedTensor::from_flat_slice::<f32>("w", &[4, 6], 7..7, &[], 0).unwrap();
        let eb = e.box_pieces();
        assert_eq!(eb.len(), 1);
        assert!(eb[0].region().is_empty());
        let s = ShardedTensor::from_flat_slice::<f32>("s", &[], 0..0, &[], 0).unwrap();
        assert!(s.box_pieces().is_empty());
        // replica declarations carry over
        let r = p.clone().with_replica(Replica::Auto);
        assert!(r.box_pieces().iter().all(ShardedTensor::is_auto_replica));
        assert_eq!(r.replica_id(), 0);
        assert!(!r.is_main());
    }

    #[test]
    fn flat_pieces_are_checked() {
        let data = vec![0f32; 4];
        let err = ShardedTensor::from_flat_slice("w", &[4, 6], 22..26, &data, 0).unwrap_err();
        assert!(
            matches!(
                err,
                TensorError::Region {
                    source: RegionError::FlatOutOfBounds { len: 24, .. },
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("22..26"), "{err}");
        let err = ShardedTensor::from_flat_slice("w", &[4, 6], 0..3, &data, 0).unwrap_err();
        assert!(
            matches!(
                err,
                TensorError::FlatBufferSize {
                    expected: 12,
                    got: 16,
                    ..
                }
            ),
            "{err}"
        );
        let key = TensorKey::new("m").unwrap();
        let err =
            ShardedTensor::from_flat(key, DType::Bool, vec![3], 1..3, 0, &[1, 7]).unwrap_err();
        assert!(
            matches!(err, TensorError::InvalidBool { offset: 1, .. }),
            "{err}"
        );
        let mut buf = vec![0u16; 2];
        assert!(LoadTarget::from_flat_slice("b", &[u64::MAX, 4], 0..2, &mut buf).is_err());
        assert!(LoadTarget::from_flat_slice("b", &[1; 33], 0..1, &mut buf[..1]).is_err());
    }

    #[test]
    fn flat_targets_split_their_buffer() {
        let mut buf = vec![0u32; 12];
        {
            let mut t = LoadTarget::from_flat_slice("w", &[4, 6], 5..17, &mut buf).unwrap();
            assert_eq!(t.flat_range(), Some(5..17));
            for mut b in t.box_targets() {
                let r = b.region().clone();
                let n = r.num_elements().unwrap();
                for (i, chunk) in b.buf_mut().chunks_exact_mut(4).enumerate() {
                    let flat = r.offset()[0] * 6 + r.offset()[1] + i as u64;
                    assert!(i as u64 <= n);
                    chunk.copy_from_slice(&(flat as u32).to_le_bytes());
                }
            }
        }
        assert_eq!(buf, (5..17).collect::<Vec<u32>>());
        let mut one = vec![0u8; 3];
        let mut t = LoadTarget::from_slice("v", &[3], &[0], &mut one, &[3]).unwrap();
        let bt = t.box_targets();
        assert_eq!((bt.len(), bt[0].buf().len()), (1, 3));
    }
}
