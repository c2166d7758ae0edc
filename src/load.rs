//! The load front door: every rank calls [`load`] with the boxes it wants and buffers to fill.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::coord::{Progress, agree};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::model::copy::DisjointBuf;
use crate::model::{LoadTarget, ObjectRequest, ObjectValue, TensorKey};
use crate::plan::load::{ShardRead, StoredGeometry};
use crate::storage::CheckpointMeta;
use crate::storage::read::{ReadCounters, ReadMethod, ReadPhases, read_shard, with_scratch};

mod cast;
pub(crate) mod collective;
pub(crate) mod fetch;
mod reader;

pub(crate) use collective::Request;
pub use collective::collective_steps;

pub use reader::Reader;

pub use crate::plan::StrictMode;

/// How to load.
#[derive(Clone)]
pub struct LoadOptions {
    /// Key checks.
    pub strict: StrictMode,
    /// Threads reading files on this rank; 0 picks the number of CPUs (at most 8).
    pub io_threads: usize,
    /// Read every box that several ranks need (data-parallel replicas) from storage once and
    /// send it to the others over the communicator (default). With no such box, nothing is
    /// exchanged.
    pub exchange: bool,
    /// Progress callback, in bytes loaded into this rank's buffers.
    pub progress: Option<Progress>,
    /// How uncompressed shard files are read (mapped by default).
    pub read_method: ReadMethod,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            strict: StrictMode::default(),
            io_threads: 0,
            exchange: true,
            progress: None,
            read_method: ReadMethod::default(),
        }
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("strict", &self.strict)
            .field("io_threads", &self.io_threads)
            .field("exchange", &self.exchange)
            .field("read_method", &self.read_method)
            .finish_non_exhaustive()
    }
}

/// Where a collective load's time went on one rank: wall time of its steps, and what its
/// reading threads did (summed over them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadPhases {
    /// Reading the index, agreeing on it and planning with every rank (collective).
    pub plan: Duration,
    /// Executing this rank's reads and agreeing on their outcome.
    pub read: Duration,
    /// Exchanging the boxes several ranks need (collective), outcome agreed on included.
    pub exchange: Duration,
    /// The reading threads' time by step, summed over the threads.
    pub io: ReadPhases,
}

/// What a load did on this rank.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Bytes written into this rank's buffers.
    pub loaded_bytes: u64,
    /// Bytes this rank read from storage (shard indexes and subchunks).
    pub bytes_read: u64,
    /// Bytes this rank received from other ranks instead of reading them.
    pub bytes_received: u64,
    /// Bytes this rank sent to other ranks.
    pub bytes_sent: u64,
    /// Keys this rank requested that the checkpoint lacks (skipped), when the mode reports them.
    pub unexpected: Vec<TensorKey>,
    /// Keys in the checkpoint no rank requested, when the mode computes them.
    pub missing: Vec<TensorKey>,
    /// With [`load_with_objects`]: one value per object request, in order (`None` for a key
    /// the checkpoint lacks, when the strict mode skips it).
    pub objects: Vec<Option<ObjectValue>>,
    /// Where the time went on this rank (the collective load fills it; reads through a
    /// [`Reader`] leave it empty).
    pub phases: LoadPhases,
}

/// Loads the requested boxes into the targets' buffers. Every rank of `comm` calls it with
/// its own targets, in any topology: each rank reads only the shards and subchunks that
/// intersect what it asked for, decoding straight into its buffers.
///
/// # Errors
/// [`Error::Storage`] when the checkpoint is incomplete, missing files or corrupt (naming
/// key, chunk and path); [`Error::DtypeMismatch`] / [`Error::ShapeMismatch`] when a request
/// disagrees with what is stored; [`Error::UnexpectedKeys`] / [`Error::MissingKeys`]
/// according to the strict mode; [`Error::Comm`] or [`Error::RemoteFailure`] when another
/// rank dies or fails.
pub fn load(
    targets: &mut [LoadTarget<'_>],
    dir: &Path,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    load_impl(targets, None, dir, comm, opts)
}

/// Loads tensors as [`load`] does and objects: one value per request, returned in order in
/// [`LoadReport::objects`]. A per-rank object is asked for by rank index
/// ([`ObjectRequest::rank`], usually this rank's); the strict mode applies to object keys as
/// to tensor keys (missing keys count objects only here, not in [`load`]). Every rank calls
/// it, with its own requests.
///
/// # Errors
/// As [`load`], plus [`Error::ObjectScopeMismatch`], [`Error::ObjectRankMissing`] (a rank the
/// saving job did not have) and [`Error::ObjectGridMismatch`] for requests that do not match
/// what is stored, and storage errors for damaged object files.
pub fn load_with_objects(
    targets: &mut [LoadTarget<'_>],
    objects: &[ObjectRequest],
    dir: &Path,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    load_impl(targets, Some(objects), dir, comm, opts)
}

fn load_impl(
    targets: &mut [LoadTarget<'_>],
    objects: Option<&[ObjectRequest]>,
    dir: &Path,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    collective::note_step();
    let t0 = Instant::now();
    let reader = Reader::open_shared(dir, comm)?.with_io(opts.io_threads, opts.read_method);
    let index = t0.elapsed();
    let mut report = load_with_reader(targets, objects, &reader, comm, opts)?;
    report.phases.plan += index;
    Ok(report)
}

/// [`load_with_objects`] (`objects` given) or [`load`] through a reader this rank opened
/// already, for example with [`Reader::open_url`] and its own store options: plan
/// (collective), execute the local reads through the reader, exchange (collective). Every
/// rank calls it with a reader of the same checkpoint; on an object store the ranks first
/// check that they resolved the same generation.
///
/// # Errors
/// As [`load_with_objects`]; [`crate::StorageError::NotACheckpoint`] on every rank when the
/// ranks' readers resolved different generations (the pointer moved meanwhile: load again).
pub fn load_with_reader(
    targets: &mut [LoadTarget<'_>],
    objects: Option<&[ObjectRequest]>,
    reader: &Reader,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    reader.agree_generation(comm)?;
    // Flat requests are loaded as the boxes of their decomposition, over disjoint parts of
    // their buffers.
    if targets.iter().any(|t| t.flat_range().is_some()) {
        let mut boxed: Vec<LoadTarget<'_>> = targets
            .iter_mut()
            .flat_map(LoadTarget::box_targets)
            .collect();
        return load_boxes(&mut boxed, objects, reader, comm, opts);
    }
    load_boxes(targets, objects, reader, comm, opts)
}

/// [`load_with_reader`] once every target is a box.
fn load_boxes(
    targets: &mut [LoadTarget<'_>],
    objects: Option<&[ObjectRequest]>,
    reader: &Reader,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let meta = reader.meta();
    let dir = reader.dir();
    let t0 = Instant::now();
    let requests: Vec<Request> = targets.iter().map(|t| Request::of(t, meta)).collect();
    let plan = collective::plan(
        &requests,
        objects,
        (dir, meta, reader.values()),
        comm,
        opts,
        0,
    )?;
    let t_plan = t0.elapsed();
    let t1 = Instant::now();
    let loaded: u64 = targets
        .iter()
        .filter(|t| meta.tensors.contains_key(t.key()))
        .map(|t| t.buf().len() as u64)
        .sum();
    let dests: Vec<DisjointBuf> = targets
        .iter_mut()
        .zip(&requests)
        .map(|(t, r)| {
            let elem = t.dtype().size();
            DisjointBuf::new(t.buf_mut(), &r.region, elem)
        })
        .collect();
    let counters = ReadCounters::default();
    let local = plan.check_absent(dir, comm.rank()).and_then(|()| {
        reader.execute(
            &requests,
            &plan.reads,
            &dests,
            &counters,
            opts.progress.as_ref(),
        )
    });
    agree(comm, local)?;
    let t_read = t1.elapsed();
    let t2 = Instant::now();
    let (sent, received) = if plan.exchanges() {
        let me = u32::try_from(comm.rank()).unwrap_or(u32::MAX);
        let shared = collective::exchange_shared(
            comm,
            &plan.exchange,
            plan.group_rounds,
            me,
            &plan.first_target,
            &dests,
            opts,
        );
        agree(comm, shared)?
    } else {
        (0, 0)
    };
    Ok(plan.report(
        opts.strict,
        LoadReport {
            loaded_bytes: loaded,
            bytes_read: counters.bytes.load(Ordering::Relaxed),
            bytes_received: received,
            bytes_sent: sent,
            phases: LoadPhases {
                plan: t_plan,
                read: t_read,
                exchange: t2.elapsed(),
                io: counters.phases(),
            },
            ..LoadReport::default()
        },
    ))
}

/// The stored geometry of a tensor of the index.
fn stored_geometry(meta: &CheckpointMeta, key: &TensorKey) -> Option<StoredGeometry> {
    meta.tensors.get(key).map(|e| StoredGeometry {
        global_shape: e.shape.clone(),
        chunk_shape: e.chunk_shape.clone(),
        subchunk_shape: e.subchunk_shape.clone(),
        elem: e.dtype.size(),
    })
}

/// Where the shards a reader reads come from.
pub(crate) enum ShardSource<'a> {
    /// Shard files on the local file system, read the given way.
    Files(ReadMethod),
    /// A store without local files: ranged gets.
    Fetch(&'a fetch::Fetcher),
}

/// Reads one planned shard of a target into its buffer, converting between float types when
/// `cast` asks (`(stored, target)`): the one step the collective load and the local
/// [`Reader`] both execute per shard, from files or fetched bytes.
///
/// # Safety
/// Concurrent calls must write disjoint bytes: the shards of one target are disjoint boxes,
/// and targets own distinct buffers.
pub(crate) unsafe fn read_item(
    arr: &crate::storage::TensorArray,
    geom: &crate::plan::load::StoredGeometry,
    shard: &ShardRead,
    dest: DisjointBuf<'_>,
    cast: Option<(crate::model::DType, crate::model::DType)>,
    counters: &ReadCounters,
    source: &ShardSource<'_>,
) -> Result<()> {
    let read_part = |part: &ShardRead, d: DisjointBuf<'_>| match source {
        // SAFETY: `d` is `dest` (forwarded to the caller) or a staging buffer this thread
        // owns.
        ShardSource::Files(method) => with_scratch(|scratch| unsafe {
            read_shard(arr, geom, part, d, scratch, counters, *method)
        }),
        // SAFETY: as above.
        ShardSource::Fetch(f) => unsafe { f.read_shard(arr, geom, part, d, counters) },
    };
    match cast {
        None => read_part(shard, dest)?,
        // SAFETY: forwarded to the caller.
        Some((from, to)) => {
            unsafe { cast::read_shard_converted(arr, geom, shard, dest, from, to, &read_part) }?
        }
    }
    Ok(())
}
