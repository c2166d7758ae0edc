//! Opening a committed checkpoint: listing its tensors without reading data, reading boxes in
//! a single process, and verifying every chunk.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::coord::io_pool;
use crate::error::{Error, Result};
use crate::load::{LoadReport, Reader};
use crate::model::{DType, Encoding, ObjectRequest, ObjectSlot, ObjectValue, Region, TensorKey};
use crate::plan::grid;
use crate::plan::load::StoredGeometry;
use crate::storage::object::StoredScope;
use crate::storage::read::{ReadCounters, zeroed_buffer};
use crate::storage::{CheckpointMeta, Compression, TensorArray};

/// A committed checkpoint, opened for reading.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    /// Executes every read (holds the index, the opened arrays and the I/O pool).
    reader: Arc<Reader>,
}

/// What the index says about one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The key.
    pub key: TensorKey,
    /// Data type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Outer chunk (shard file) shape.
    pub chunk_shape: Vec<u64>,
    /// Inner subchunk shape.
    pub subchunk_shape: Vec<u64>,
    /// Compression.
    pub compression: Compression,
    /// Number of shard files.
    pub num_chunks: u64,
    /// Logical size in bytes.
    pub nbytes: u64,
}

/// One problem found by [`Checkpoint::verify`].
#[derive(Debug)]
pub struct Problem {
    /// The tensor.
    pub key: TensorKey,
    /// The chunk, when one is involved.
    pub chunk: Option<Vec<u64>>,
    /// What is wrong (names the file).
    pub error: Error,
}

/// The outcome of [`Checkpoint::verify`].
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Tensors checked.
    pub tensors: usize,
    /// Shard files checked.
    pub chunks: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Everything found wrong (empty when the checkpoint is sound), at most
    /// [`MAX_PROBLEMS_PER_TENSOR`] per tensor.
    pub problems: Vec<Problem>,
    /// Chunks not checked because their tensor already had [`MAX_PROBLEMS_PER_TENSOR`]
    /// problems (0 when every chunk was checked).
    pub skipped_chunks: u64,
    /// Object values checked.
    pub object_values: u64,
}

/// What the index says about one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The key.
    pub key: TensorKey,
    /// Common, per-rank or sharded.
    pub scope: StoredScope,
    /// JSON or bytes.
    pub encoding: Encoding,
    /// A common object's size in bytes.
    pub size: Option<u64>,
    /// A per-rank object's world size (one value per rank below it).
    pub world_size: Option<u64>,
    /// A sharded object's grid.
    pub grid: Option<Vec<u64>>,
    /// Number of stored values.
    pub values: u64,
}

impl Checkpoint {
    /// Opens a committed checkpoint (reads only the root `zarr.json`).
    ///
    /// # Errors
    /// [`crate::storage::StorageError::Incomplete`] for a save that never committed, and the other index
    /// errors of the storage layer.
    ///
    /// `dir` may also be a URL (feature `object-store`: `s3://bucket/prefix`, `gs://`, `az://`,
    /// `memory://`): the generation pointer is resolved and only the committed manifest and
    /// index are read; shards are then read with ranged gets ([`Reader::open_url`]).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Ok(Self::with_reader(Reader::open(dir)?))
    }

    /// Opens the checkpoint committed at `url` with these store options (feature
    /// `object-store`; see [`Reader::open_url`]).
    ///
    /// # Errors
    /// As [`Reader::open_url`].
    #[cfg(feature = "object-store")]
    pub fn open_url(url: &str, ropts: &crate::storage::remote::RemoteOptions) -> Result<Self> {
        Ok(Self::with_reader(Reader::open_url(url, ropts)?))
    }

    /// Opens the checkpoint committed under `prefix` in `store` (see [`Reader::open_store`]).
    ///
    /// # Errors
    /// As [`Reader::open_store`].
    pub fn open_store(store: Arc<dyn crate::storage::store::Store>, prefix: &str) -> Result<Self> {
        Ok(Self::with_reader(Reader::open_store(store, prefix)?))
    }

    /// The checkpoint a reader opened.
    #[must_use]
    pub fn with_reader(reader: Reader) -> Self {
        Checkpoint {
            dir: reader.dir().to_owned(),
            reader: Arc::new(reader),
        }
    }

    /// The directory (or, for a checkpoint on an object store, its generation's URL).
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index.
    #[must_use]
    pub fn meta(&self) -> &CheckpointMeta {
        self.reader.meta()
    }

    /// The reader every read of this checkpoint goes through (no communicator).
    #[must_use]
    pub fn reader(&self) -> &Reader {
        &self.reader
    }

    /// Every tensor, sorted by key.
    #[must_use]
    pub fn tensors(&self) -> Vec<TensorInfo> {
        self.meta()
            .tensors
            .iter()
            .map(|(key, e)| TensorInfo {
                key: key.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                chunk_shape: e.chunk_shape.clone(),
                subchunk_shape: e.subchunk_shape.clone(),
                compression: e.compression,
                num_chunks: grid::grid_shape(&e.shape, &e.chunk_shape).iter().product(),
                nbytes: e.nbytes(),
            })
            .collect()
    }

    /// Information on one tensor.
    #[must_use]
    pub fn tensor(&self, key: &TensorKey) -> Option<TensorInfo> {
        self.tensors().into_iter().find(|t| &t.key == key)
    }

    /// The index entry of `key`.
    fn entry(&self, key: &TensorKey) -> Result<&crate::storage::TensorEntry> {
        self.meta()
            .tensors
            .get(key)
            .ok_or_else(|| Error::UnexpectedKeys {
                path: self.dir.clone(),
                keys: vec![key.clone()],
                rank: 0,
            })
    }

    /// Reads a box of one tensor into `buf` (single process, no communicator, against the
    /// index read by [`Checkpoint::open`]; each array's `zarr.json` is read once, on its
    /// first read; see [`load`](crate::load()) for ranks).
    ///
    /// # Errors
    /// As [`Reader::read_region`].
    pub fn read_region(
        &self,
        key: &TensorKey,
        region: &Region,
        buf: &mut [u8],
    ) -> Result<LoadReport> {
        self.reader.read_region(key, region, buf)
    }

    /// Reads a whole tensor.
    ///
    /// # Errors
    /// As [`load`](crate::load()).
    pub fn read_tensor(&self, key: &TensorKey) -> Result<Vec<u8>> {
        let e = self.entry(key)?;
        let n = crate::model::region::num_bytes(&e.shape, e.dtype.size()).map_err(|source| {
            Error::Tensor(crate::model::TensorError::Region {
                key: key.to_string(),
                source,
            })
        })?;
        let mut buf: Vec<u8> = zeroed_buffer(n as u64, key.as_str(), &self.dir.join(&e.path))?;
        self.read_region(key, &Region::full(&e.shape), &mut buf)?;
        Ok(buf)
    }

    /// Reads a whole tensor as an `ndarray` of `T`, whose data type must be the stored one.
    ///
    /// # Errors
    /// [`Error::DtypeMismatch`] when `T` is not the stored data type; otherwise as [`load`](crate::load()).
    pub fn read_ndarray<T: crate::model::Element + Default>(
        &self,
        key: &TensorKey,
    ) -> Result<ndarray::ArrayD<T>> {
        let e = self.entry(key)?;
        if e.dtype != T::DTYPE {
            return Err(Error::DtypeMismatch {
                key: key.clone(),
                rank: 0,
                path: self.dir.clone(),
                requested: T::DTYPE,
                stored: e.dtype,
            });
        }
        // Lossless (64-bit targets only); the element count is checked just below.
        let shape: Vec<usize> = e.shape.iter().map(|&d| crate::model::usize_of(d)).collect();
        let n = crate::model::region::num_elements(&e.shape).map_err(|source| {
            Error::Tensor(crate::model::TensorError::Region {
                key: key.to_string(),
                source,
            })
        })?;
        let mut data: Vec<T> = zeroed_buffer(n, key.as_str(), &self.dir.join(&e.path))?;
        self.read_region(
            key,
            &Region::full(&e.shape),
            crate::model::dtype::as_bytes_mut(&mut data),
        )?;
        ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), data).map_err(|_| {
            Error::Tensor(crate::model::TensorError::Region {
                key: key.to_string(),
                source: crate::model::RegionError::Overflow {
                    what: "array shape",
                    shape: e.shape.clone(),
                },
            })
        })
    }

    /// Reads every chunk of every tensor and checks every checksum, that every chunk file
    /// exists and that every array's `zarr.json` agrees with the index. Collects problems
    /// rather than stopping at the first, up to [`MAX_PROBLEMS_PER_TENSOR`] per tensor (the
    /// chunks of a tensor left after that are counted in [`VerifyReport::skipped_chunks`]).
    ///
    /// Memory stays bounded whatever the metadata declares: chunks are enumerated lazily and
    /// each is read a bounded box of subchunks at a time.
    ///
    /// # Errors
    /// Only when the I/O thread pool cannot start; problems go into the report.
    pub fn verify(
        &self,
        threads: usize,
        progress: Option<&(dyn Fn(u64) + Sync)>,
    ) -> Result<VerifyReport> {
        use std::sync::atomic::{AtomicU64, Ordering};
        let problems = Mutex::new(Vec::new());
        let push = |p: Problem| {
            problems
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(p);
        };
        let counters = ReadCounters::default();
        let mut chunks_total = 0u64;
        // Each opened tensor: its array, geometry, chunk grid, problems found and chunks
        // checked.
        type Opened = (TensorArray, StoredGeometry, Vec<u64>, AtomicU64, AtomicU64);
        let mut tensors: Vec<Opened> = Vec::new();
        for (key, e) in &self.meta().tensors {
            match self.reader.open_array(key, e) {
                Ok(arr) => {
                    let geom = StoredGeometry {
                        global_shape: e.shape.clone(),
                        chunk_shape: e.chunk_shape.clone(),
                        subchunk_shape: e.subchunk_shape.clone(),
                        elem: e.dtype.size(),
                    };
                    let gs = grid::grid_shape(&e.shape, &e.chunk_shape);
                    chunks_total += e
                        .num_chunks()
                        .expect("bounded by the index's validation when the checkpoint opened");
                    tensors.push((arr, geom, gs, AtomicU64::new(0), AtomicU64::new(0)));
                }
                Err(err) => push(Problem {
                    key: key.clone(),
                    chunk: None,
                    error: err.into(),
                }),
            }
        }
        // Chunks are generated lazily; a tensor's stop once it has too many problems.
        let work = tensors.iter().flat_map(|t| {
            grid_indices(t.2.clone())
                .take_while(|_| t.3.load(Ordering::Relaxed) < MAX_PROBLEMS_PER_TENSOR)
                .map(move |c| (t, c))
        });
        let pool = io_pool(threads)?;
        pool.install(|| {
            work.par_bridge().for_each_init(
                || (Vec::new(), Vec::new()),
                |(scratch, buf), ((arr, geom, _, found, checked), chunk)| {
                    checked.fetch_add(1, Ordering::Relaxed);
                    let region = grid::chunk_region(&geom.global_shape, &geom.chunk_shape, &chunk);
                    let inc = |n: u64| {
                        if let Some(p) = progress {
                            p(n);
                        }
                    };
                    if let Err(err) = self
                        .reader
                        .verify_shard(arr, geom, &chunk, &region, scratch, buf, &counters, &inc)
                    {
                        found.fetch_add(1, Ordering::Relaxed);
                        push(Problem {
                            key: arr.key().clone(),
                            chunk: Some(chunk.clone()),
                            error: err.into(),
                        });
                    }
                },
            );
        });
        let mut problems = problems
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        problems.sort_by(|a, b| (&a.key, &a.chunk).cmp(&(&b.key, &b.chunk)));
        let (object_values, object_bytes) = self.verify_objects(&mut problems);
        Ok(VerifyReport {
            tensors: self.meta().tensors.len(),
            chunks: chunks_total,
            bytes_read: counters.bytes.load(Ordering::Relaxed) + object_bytes,
            problems,
            object_values,
            skipped_chunks: tensors
                .iter()
                .map(|t| {
                    let declared = grid_indices_count(&t.2);
                    declared.saturating_sub(t.4.load(Ordering::Relaxed))
                })
                .sum(),
        })
    }

    /// Every object, sorted by key.
    #[must_use]
    pub fn objects(&self) -> Vec<ObjectInfo> {
        self.meta()
            .objects
            .iter()
            .map(|(key, e)| ObjectInfo {
                key: key.clone(),
                scope: e.scope,
                encoding: e.encoding,
                size: e.size,
                world_size: e.world_size,
                grid: e.grid.clone(),
                values: match e.scope {
                    StoredScope::Common => 1,
                    StoredScope::PerRank => e
                        .world_size
                        .expect("required of per-rank objects by the index's validation"),
                    StoredScope::Sharded => {
                        e.grid.as_ref().map_or(0, |g| g.iter().product::<u64>())
                    }
                },
            })
            .collect()
    }

    /// Reads one stored value of an object: the common value ([`ObjectSlot::Common`]), the
    /// value rank `r` saved ([`ObjectSlot::Rank`], whatever this job's size), or a shard
    /// ([`ObjectSlot::Shard`]). Checks the array's metadata, length and CRC-32C.
    ///
    /// # Errors
    /// [`Error::UnexpectedKeys`] when there is no such object, [`Error::ObjectScopeMismatch`]
    /// for a slot of another scope, [`Error::ObjectRankMissing`] /
    /// [`Error::ObjectGridMismatch`] for a rank or shard the object does not have, storage
    /// errors for damaged files.
    pub fn read_object(&self, key: &TensorKey, slot: &ObjectSlot) -> Result<ObjectValue> {
        let r = ObjectRequest {
            key: key.clone(),
            slot: slot.clone(),
            grid: None,
        };
        let e = crate::objects::check_request(&self.dir, self.meta(), &r)?.ok_or_else(|| {
            Error::UnexpectedKeys {
                path: self.dir.clone(),
                keys: vec![key.clone()],
                rank: 0,
            }
        })?;
        crate::objects::read(self.reader.values(), self.meta(), e, &r)
    }

    /// Reads every value of every object, collecting problems. Returns (values, bytes).
    fn verify_objects(&self, problems: &mut Vec<Problem>) -> (u64, u64) {
        let (mut n, mut bytes) = (0u64, 0u64);
        for (key, e) in &self.meta().objects {
            for slot in e.slots() {
                n += 1;
                match self.read_object(key, &slot) {
                    Ok(v) => bytes += v.to_stored().len() as u64,
                    Err(error) => problems.push(Problem {
                        key: key.clone(),
                        chunk: None,
                        error,
                    }),
                }
            }
        }
        (n, bytes)
    }
}

/// Most problems [`Checkpoint::verify`] records per tensor before it stops checking that
/// tensor's remaining chunks (a crafted index can declare millions of missing chunks).
pub const MAX_PROBLEMS_PER_TENSOR: u64 = 100;

/// Number of indices of a grid of shape `shape` (saturating).
fn grid_indices_count(shape: &[u64]) -> u64 {
    shape.iter().fold(1u64, |acc, &n| acc.saturating_mul(n))
}

/// Every index of a grid of shape `shape`, in C order, generated lazily.
fn grid_indices(shape: Vec<u64>) -> impl Iterator<Item = Vec<u64>> + Send {
    let mut next = (!shape.contains(&0)).then(|| vec![0u64; shape.len()]);
    std::iter::from_fn(move || {
        let cur = next.take()?;
        let mut n = cur.clone();
        for d in (0..n.len()).rev() {
            n[d] += 1;
            if n[d] < shape[d] {
                next = Some(n);
                break;
            }
            n[d] = 0;
        }
        Some(cur)
    })
}
