//! The local reader: executes reads of boxes into the caller's buffers in one process, with
//! no communicator. It keeps what every read of the same checkpoint needs: the index, the
//! arrays it opened (their `zarr.json` read and checked once each) and one I/O thread pool.
//!
//! It reads through the storage seam ([`crate::storage::store::Store`]): a store with local
//! files keeps the file-system fast paths (`pread` / `mmap` of the shard files); a store
//! without them (an object store, `s3://...`, or an in-memory store) is read with ranged gets
//! ([`super::fetch`]): each shard's index fetched and decoded once, the needed subchunks
//! fetched coalesced, then checked and copied by the same code.
//!
//! [`crate::Checkpoint`] reads through one with no communicator; the collective
//! [`load`](crate::load()) plans with every rank, executes its own reads through one, then
//! exchanges the boxes several ranks need.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

use super::fetch::{Fetcher, IndexCache, Listed};
use super::{LoadReport, Request, ShardSource, cast, read_item, stored_geometry};
use crate::coord::{Progress, io_pool};
use crate::error::{Error, Result};
use crate::model::copy::DisjointBuf;
use crate::model::{DType, LoadTarget, Region, TensorKey};
use crate::plan::load::{ShardRead, StoredGeometry};
use crate::storage::read::{ReadCounters, ReadMethod};
use crate::storage::store::{Store, join};
use crate::storage::{CheckpointMeta, StorageError, TensorArray, commit};

/// I/O threads of a reader over a store without local files when none are asked for: ranged
/// gets in flight at once (each thread holds at most [`super::fetch::BATCH_BYTES`]).
pub(crate) const FETCH_THREADS: usize = 16;

/// One array, opened once: its `zarr.json` read and checked against the index.
struct OpenArray {
    arr: TensorArray,
    geom: StoredGeometry,
}

/// Reads boxes of a committed checkpoint in one process (no communicator, no collective
/// step). Cheap to share between threads: arrays are opened on first use and kept, and one
/// I/O thread pool is started on the first read that spans several shard files.
pub struct Reader {
    /// The directory, or the URL of a store without local files (for messages).
    dir: PathBuf,
    /// Where shards come from when the store has no local files.
    fetcher: Option<Fetcher>,
    meta: CheckpointMeta,
    arrays: Mutex<HashMap<TensorKey, Arc<OpenArray>>>,
    pool: OnceLock<rayon::ThreadPool>,
    io_threads: usize,
    read_method: ReadMethod,
    opened: AtomicU64,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("dir", &self.dir)
            .field("tensors", &self.meta.tensors.len())
            .field("io_threads", &self.io_threads)
            .field("read_method", &self.read_method)
            .field("fetched", &self.fetcher.is_some())
            .field("arrays_opened", &self.arrays_opened())
            .finish_non_exhaustive()
    }
}

impl Reader {
    /// Opens a committed checkpoint for reading (reads only the root `zarr.json`): a local
    /// directory, or (feature `object-store`) a URL (`s3://bucket/prefix`, `gs://`, `az://`,
    /// `memory://`) opened with [`Reader::open_url`] and default options.
    ///
    /// # Errors
    /// As [`crate::Checkpoint::open`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        #[cfg(feature = "object-store")]
        if let Some(url) = dir.to_str().filter(|s| crate::storage::remote::is_url(s)) {
            return Self::open_url(url, &crate::storage::remote::RemoteOptions::default());
        }
        let meta = commit::read_index(dir)?;
        Ok(Self::from_index(dir.to_owned(), meta))
    }

    /// Opens the checkpoint committed at `url` (feature `object-store`): resolves the
    /// generation pointer and reads the committed generation's manifest and root `zarr.json`,
    /// nothing else (no listing). Shards are then read with ranged gets, sized by the
    /// manifest.
    ///
    /// # Errors
    /// The [`crate::storage::remote::RemoteError`]s of resolving (no pointer, a damaged
    /// manifest, a request that failed); the index errors of [`crate::Checkpoint::open`].
    #[cfg(feature = "object-store")]
    pub fn open_url(url: &str, ropts: &crate::storage::remote::RemoteOptions) -> Result<Self> {
        use crate::storage::remote::{RemoteStore, generation};
        let store = RemoteStore::open(url, ropts)?;
        let resolved = generation::resolve(&store)?;
        Ok(Self::resolved(store, &resolved, None)?.0)
    }

    /// [`Reader::open`] on every rank of `comm` at once (collective): a URL is resolved by
    /// rank 0 alone (pointer, manifest, root `zarr.json`), which sends the manifest and the
    /// index to the others in one broadcast, so a job asks the store for them once, not once
    /// per rank (a large checkpoint's manifest is megabytes); every rank then reads the same
    /// generation. A directory is opened by every rank, as [`Reader::open`] does. Every rank
    /// gets the same outcome.
    ///
    /// # Errors
    /// As [`Reader::open`] (rank 0's failure on every rank, naming it); [`Error::Comm`].
    pub fn open_shared(
        dir: impl AsRef<Path>,
        comm: &dyn crate::comm::Communicator,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        #[cfg(feature = "object-store")]
        if let Some(url) = dir.to_str().filter(|s| crate::storage::remote::is_url(s)) {
            let ropts = crate::storage::remote::RemoteOptions::default();
            return Self::open_url_shared(url, &ropts, comm);
        }
        crate::coord::agree(comm, Self::open(dir))
    }

    /// [`Reader::open_shared`] of `url` with the store options `ropts`.
    ///
    /// # Errors
    /// As [`Reader::open_shared`].
    #[cfg(feature = "object-store")]
    pub fn open_url_shared(
        url: &str,
        ropts: &crate::storage::remote::RemoteOptions,
        comm: &dyn crate::comm::Communicator,
    ) -> Result<Self> {
        use crate::storage::remote::{RemoteStore, generation};
        let store = crate::coord::agree(comm, RemoteStore::open(url, ropts).map_err(Error::from))?;
        // Rank 0: the generation, the manifest's bytes as fetched and the root document's,
        // each framed by its length; the others check them as rank 0 did.
        let first = if comm.rank() == 0 {
            generation::resolve_with_bytes(&store)
                .map_err(Error::from)
                .and_then(|(resolved, manifest)| {
                    let (reader, root) = Self::resolved(store.clone(), &resolved, None)?;
                    let mut msg = Vec::with_capacity(
                        16 + resolved.generation.len() + manifest.len() + root.len(),
                    );
                    for part in [resolved.generation.as_bytes(), &manifest] {
                        msg.extend_from_slice(&(part.len() as u64).to_le_bytes());
                        msg.extend_from_slice(part);
                    }
                    msg.extend_from_slice(&root);
                    Ok((Some(reader), msg))
                })
        } else {
            Ok((None, Vec::new()))
        };
        let (mine, msg) = crate::coord::agree(comm, first)?;
        let got = comm.broadcast(0, &msg)?;
        if let Some(r) = mine {
            return crate::coord::agree(comm, Ok(r));
        }
        let rebuilt = (|| {
            let bad = || StorageError::NotACheckpoint {
                path: std::path::PathBuf::from(url),
                reason: "rank 0 sent a malformed resolution of the checkpoint".into(),
            };
            let mut rest = got.as_slice();
            let mut frame = || -> Option<&[u8]> {
                let n =
                    usize::try_from(u64::from_le_bytes(rest.get(..8)?.try_into().ok()?)).ok()?;
                let part = rest.get(8..8usize.checked_add(n)?)?;
                rest = &rest[8 + n..];
                Some(part)
            };
            let generation = frame()
                .and_then(|g| std::str::from_utf8(g).ok())
                .ok_or_else(bad)?
                .to_owned();
            let manifest = frame().ok_or_else(bad)?;
            let manifest = generation::parse_manifest(&store, &generation, manifest)?;
            let root = rest.to_vec();
            let resolved = generation::Resolved {
                generation,
                manifest,
            };
            Self::resolved(store, &resolved, Some(root)).map(|(r, _)| r)
        })();
        crate::coord::agree(comm, rebuilt)
    }

    /// A reader of the resolved generation `resolved` of the checkpoint `store` holds, its
    /// root document given (`root`, checked against the manifest) or fetched; and the root
    /// document's bytes.
    #[cfg(feature = "object-store")]
    fn resolved(
        store: crate::storage::remote::RemoteStore,
        resolved: &crate::storage::remote::generation::Resolved,
        root: Option<Vec<u8>>,
    ) -> Result<(Self, Vec<u8>)> {
        use crate::storage::remote::generation;
        let prefix = generation::generation_key(&resolved.generation, "");
        let listed = resolved
            .manifest
            .objects
            .iter()
            .map(|e| {
                let tail = e.tail.as_ref().map(|t| (join(&prefix, &t.key), t.offset));
                let l = Listed {
                    size: e.size,
                    crc32c: e.crc32c,
                    tail,
                };
                (join(&prefix, &e.key), l)
            })
            .collect();
        Self::fetching(Arc::new(store), prefix, Some(listed), root)
    }

    /// Opens the checkpoint committed under `prefix` in `store` (its root `zarr.json` there):
    /// through the file system where the store has local files (as [`Reader::open`] of the
    /// directory), else by ranged gets (each shard's size by a `HEAD`).
    ///
    /// # Errors
    /// As [`crate::Checkpoint::open`]; [`StorageError::NotACheckpoint`] when the store holds
    /// no root `zarr.json` under `prefix`.
    pub fn open_store(store: Arc<dyn Store>, prefix: &str) -> Result<Self> {
        match store.local_path(prefix) {
            Some(dir) => Self::open(dir),
            None => Ok(Self::fetching(store, prefix.to_owned(), None, None)?.0),
        }
    }

    /// A reader over a store without local files.
    fn fetching(
        store: Arc<dyn Store>,
        prefix: String,
        listed: Option<std::collections::HashMap<String, Listed>>,
        root_bytes: Option<Vec<u8>>,
    ) -> Result<(Self, Vec<u8>)> {
        let dir = store.display_path(&prefix);
        let root = join(&prefix, "zarr.json");
        let fetcher = Fetcher {
            store,
            prefix,
            listed,
            cache: IndexCache::default(),
        };
        let got = match root_bytes {
            Some(b) => fetcher.committed(&root, b),
            None => fetcher.whole(&root, crate::storage::meta::MAX_ROOT_JSON_BYTES),
        };
        let bytes = match got {
            Ok(b) => b,
            Err(StorageError::NotFound { .. }) => {
                return Err(StorageError::NotACheckpoint {
                    path: dir,
                    reason: "no root zarr.json".into(),
                }
                .into());
            }
            Err(e) => return Err(e.into()),
        };
        let meta = CheckpointMeta::from_root_json(&bytes, &fetcher.store.display_path(&root))?;
        let mut r = Self::from_index(dir, meta);
        r.fetcher = Some(fetcher);
        Ok((r, bytes))
    }

    /// A reader of the local directory `dir` against an index already read.
    #[must_use]
    pub fn from_index(dir: PathBuf, meta: CheckpointMeta) -> Self {
        Reader {
            dir,
            fetcher: None,
            meta,
            arrays: Mutex::new(HashMap::new()),
            pool: OnceLock::new(),
            io_threads: 0,
            read_method: ReadMethod::default(),
            opened: AtomicU64::new(0),
        }
    }

    /// Sets the I/O threads (0: the number of CPUs, at most 8, for local files;
    /// 16 for ranged gets) and how uncompressed shard files are read.
    #[must_use]
    pub fn with_io(mut self, io_threads: usize, read_method: ReadMethod) -> Self {
        self.io_threads = io_threads;
        self.read_method = read_method;
        self
    }

    /// The directory (for a store without local files, its URL: for messages).
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// For a collective load over a store without local files: checks that every rank's
    /// reader resolved the same generation (the pointer may move between two ranks' reads of
    /// it), against rank 0's. Collective when the readers fetch; nothing to do otherwise.
    ///
    /// # Errors
    /// [`StorageError::NotACheckpoint`] on every rank when one resolved another generation (load
    /// again); [`Error::Comm`] when the broadcast fails.
    pub(crate) fn agree_generation(&self, comm: &dyn crate::comm::Communicator) -> Result<()> {
        if self.fetcher.is_none() {
            return Ok(());
        }
        let mine = self.dir.to_string_lossy().into_owned();
        let first = comm.broadcast(0, mine.as_bytes())?;
        let local = if first == mine.as_bytes() {
            Ok(())
        } else {
            Err(StorageError::NotACheckpoint {
                path: self.dir.clone(),
                reason: format!(
                    "rank {} resolved this generation but rank 0 resolved {}: the checkpoint was replaced while the ranks opened it; load again",
                    comm.rank(),
                    String::from_utf8_lossy(&first)
                ),
            }
            .into())
        };
        crate::coord::agree(comm, local)
    }

    /// True when shards are read with ranged gets (a store without local files).
    #[must_use]
    pub fn fetches(&self) -> bool {
        self.fetcher.is_some()
    }

    /// How many shard indexes this reader fetched and decoded (ranged gets only; 0 for local
    /// files): each shard's at most once while they fit
    /// 64 MiB of decoded indexes, however many reads touch it.
    #[must_use]
    pub fn indexes_decoded(&self) -> u64 {
        self.fetcher.as_ref().map_or(0, |f| f.cache.decoded())
    }

    /// Ranged gets of shard bytes this reader made so far (0 for a reader of local files):
    /// a read of a shard's end, or of a whole shard, is one (index and data together), a read
    /// of another part two (index, then data), while its index is cached one; a get of tail
    /// copies from a tails object (spec 20.7) counts one.
    #[must_use]
    pub fn ranged_gets(&self) -> u64 {
        self.fetcher.as_ref().map_or(0, |f| f.cache.gets())
    }

    /// Where this checkpoint's object values are read from: its directory, or its store.
    pub(crate) fn values(&self) -> crate::storage::object::ValueSource<'_> {
        use crate::storage::object::ValueSource;
        match &self.fetcher {
            None => ValueSource::Dir(&self.dir),
            Some(f) => ValueSource::Store(f),
        }
    }

    /// Opens the array of `key` (not kept): what [`crate::Checkpoint::verify`] checks.
    pub(crate) fn open_array(
        &self,
        key: &TensorKey,
        entry: &crate::storage::TensorEntry,
    ) -> std::result::Result<TensorArray, StorageError> {
        match &self.fetcher {
            None => TensorArray::open_for(&self.dir, key, entry, self.meta.save_id),
            Some(f) => f.open_array(key, entry, self.meta.save_id),
        }
    }

    /// Checks every subchunk of the shard at `chunk` of `arr` within `region` (verify).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn verify_shard(
        &self,
        arr: &TensorArray,
        geom: &StoredGeometry,
        chunk: &[u64],
        region: &Region,
        scratch: &mut Vec<u8>,
        buf: &mut Vec<u8>,
        counters: &ReadCounters,
        progress: &dyn Fn(u64),
    ) -> std::result::Result<(), StorageError> {
        match &self.fetcher {
            None => crate::storage::read::verify_shard(
                arr, geom, chunk, region, scratch, buf, counters, progress,
            ),
            Some(f) => f.verify_shard(arr, geom, region, buf, counters, progress),
        }
    }

    /// The index.
    #[must_use]
    pub fn meta(&self) -> &CheckpointMeta {
        &self.meta
    }

    /// How many arrays this reader has opened (read their `zarr.json`) so far: each at most
    /// once, however many reads touch it.
    #[must_use]
    pub fn arrays_opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// The array of `key`, opened on first use.
    fn array(&self, key: &TensorKey) -> Result<Arc<OpenArray>> {
        let entry = self.meta.tensors.get(key).ok_or_else(|| self.absent(key))?;
        // A poisoned map only means another reading thread panicked: the map stays valid.
        let mut arrays = self
            .arrays
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(a) = arrays.get(key) {
            return Ok(Arc::clone(a));
        }
        let geom = stored_geometry(&self.meta, key).ok_or_else(|| self.absent(key))?;
        let arr = self.open_array(key, entry)?;
        self.opened.fetch_add(1, Ordering::Relaxed);
        let a = Arc::new(OpenArray { arr, geom });
        arrays.insert(key.clone(), Arc::clone(&a));
        Ok(a)
    }

    fn absent(&self, key: &TensorKey) -> Error {
        Error::UnexpectedKeys {
            path: self.dir.clone(),
            keys: vec![key.clone()],
            rank: 0,
        }
    }

    fn pool(&self) -> Result<&rayon::ThreadPool> {
        if let Some(p) = self.pool.get() {
            return Ok(p);
        }
        let threads = match (self.io_threads, &self.fetcher) {
            (0, Some(_)) => FETCH_THREADS,
            (n, _) => n,
        };
        let p = io_pool(threads)?;
        // Another thread may have set one meanwhile: either serves.
        let _ = self.pool.set(p);
        self.pool
            .get()
            .ok_or_else(|| Error::ThreadPool("the I/O pool was not kept".into()))
    }

    /// Reads the box `region` of `key` into `buf` (C order, the stored data type).
    ///
    /// # Errors
    /// [`Error::UnexpectedKeys`] for a key the checkpoint lacks, [`Error::Tensor`] for a box
    /// outside the tensor or a buffer of the wrong size, and the storage errors of a damaged
    /// checkpoint (naming key, chunk and path).
    pub fn read_region(
        &self,
        key: &TensorKey,
        region: &Region,
        buf: &mut [u8],
    ) -> Result<LoadReport> {
        let e = self.meta.tensors.get(key).ok_or_else(|| self.absent(key))?;
        let mut t = [LoadTarget::new(
            key.clone(),
            e.dtype,
            e.shape.clone(),
            region.clone(),
            buf,
        )?];
        self.read(&mut t)
    }

    /// Reads every target (boxes or flat ranges; a target that asks for a conversion the
    /// stored data type allows is converted as [`load`](crate::load()) does).
    ///
    /// # Errors
    /// As [`Reader::read_region`], plus [`Error::DtypeMismatch`] / [`Error::ShapeMismatch`]
    /// for a target that disagrees with what is stored.
    pub fn read(&self, targets: &mut [LoadTarget<'_>]) -> Result<LoadReport> {
        if targets.iter().any(|t| t.flat_range().is_some()) {
            let mut boxed: Vec<LoadTarget<'_>> = targets
                .iter_mut()
                .flat_map(LoadTarget::box_targets)
                .collect();
            return self.read_boxes(&mut boxed);
        }
        self.read_boxes(targets)
    }

    fn read_boxes(&self, targets: &mut [LoadTarget<'_>]) -> Result<LoadReport> {
        let mut casts: Vec<Option<(DType, DType)>> = Vec::with_capacity(targets.len());
        let mut opened = Vec::with_capacity(targets.len());
        for t in targets.iter() {
            let e = self
                .meta
                .tensors
                .get(t.key())
                .ok_or_else(|| self.absent(t.key()))?;
            let cast = cast::converts_from(t, &self.meta).map(|from| (from, t.dtype()));
            if cast.is_none() && e.dtype != t.dtype() {
                return Err(Error::DtypeMismatch {
                    key: t.key().clone(),
                    rank: 0,
                    path: self.dir.clone(),
                    requested: t.dtype(),
                    stored: e.dtype,
                });
            }
            if e.shape != t.global_shape() {
                return Err(Error::ShapeMismatch {
                    key: t.key().clone(),
                    rank: 0,
                    path: self.dir.clone(),
                    requested: t.global_shape().to_vec(),
                    stored: e.shape.clone(),
                });
            }
            casts.push(cast);
            opened.push(self.array(t.key())?);
        }
        let loaded: u64 = targets.iter().map(|t| t.buf().len() as u64).sum();
        let requests: Vec<Request> = targets
            .iter()
            .zip(casts)
            .map(|(t, cast)| Request {
                key: t.key().clone(),
                dtype: t.dtype(),
                global_shape: t.global_shape().to_vec(),
                region: t.region().clone(),
                cast,
                alone: true,
            })
            .collect();
        let items: Vec<(usize, ShardRead)> = requests
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                opened[i]
                    .geom
                    .reads_for(&r.region)
                    .into_iter()
                    .map(move |s| (i, s))
            })
            .collect();
        let dests: Vec<DisjointBuf<'_>> = targets
            .iter_mut()
            .zip(&requests)
            .map(|(t, r)| {
                let elem = t.dtype().size();
                DisjointBuf::new(t.buf_mut(), &r.region, elem)
            })
            .collect();
        let counters = ReadCounters::default();
        self.execute(&requests, &items, &dests, &counters, None)?;
        Ok(LoadReport {
            loaded_bytes: loaded,
            bytes_read: counters.bytes.load(Ordering::Relaxed),
            ..LoadReport::default()
        })
    }

    /// Executes planned reads: `reads` gives, by index into `requests`, the shards to read
    /// into `dests[index]` (the request's buffer, over its box). Opens each array on first
    /// use; reads in parallel on the reader's I/O pool (on the calling thread for one shard).
    /// Requests of keys the checkpoint lacks must have no reads.
    pub(crate) fn execute(
        &self,
        requests: &[Request],
        reads: &[(usize, ShardRead)],
        dests: &[DisjointBuf<'_>],
        counters: &ReadCounters,
        progress: Option<&Progress>,
    ) -> Result<()> {
        let mut opened: Vec<Option<Arc<OpenArray>>> = vec![None; requests.len()];
        for (i, _) in reads {
            if opened[*i].is_none() {
                opened[*i] = Some(self.array(&requests[*i].key)?);
            }
        }
        let source = match &self.fetcher {
            None => ShardSource::Files(self.read_method),
            Some(f) => ShardSource::Fetch(f),
        };
        // Tail copies pay off from two shards on (one get for both tails, not two).
        if let Some(f) = &self.fetcher
            && reads.len() >= 2
        {
            let planned: Vec<_> = reads
                .iter()
                .filter_map(|(i, shard)| {
                    let a = opened[*i].as_deref()?;
                    Some((&a.arr, &a.geom, shard))
                })
                .collect();
            self.pool()?
                .install(|| f.prefetch_tails(&planned, counters));
        }
        let one = |(i, shard): &(usize, ShardRead)| -> Result<()> {
            let Some(a) = &opened[*i] else {
                return Err(self.absent(&requests[*i].key));
            };
            let OpenArray { arr, geom } = &**a;
            // SAFETY: the shards of one request are disjoint boxes, so the reads of one
            // request write disjoint bytes of its buffer; requests own distinct buffers.
            unsafe {
                read_item(
                    arr,
                    geom,
                    shard,
                    dests[*i],
                    requests[*i].cast,
                    counters,
                    &source,
                )
            }?;
            if let Some(p) = progress {
                let n: u64 = shard
                    .subchunks
                    .iter()
                    // Invariant: a planned box inside a checked chunk.
                    .map(|s| s.needed.num_elements().unwrap_or(0))
                    .sum();
                p(n * dests[*i].elem() as u64);
            }
            Ok(())
        };
        if reads.len() <= 1 {
            // One shard file: read on the calling thread, no pool hand-off.
            reads.iter().try_for_each(one)
        } else {
            self.pool()?.install(|| reads.par_iter().try_for_each(one))
        }
    }
}
