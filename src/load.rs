//! The load front door: every rank calls [`load`] with the boxes it wants and buffers to fill.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::Ordering;

use rayon::prelude::*;

use crate::comm::Communicator;
use crate::comm::{RecvBuf, SendBuf};
use crate::coord::{
    BoxDecl, Progress, agree, all_reduce_u64, combine, describe, io_pool, rank_layout,
};
use crate::error::{Error, Result};
use crate::model::copy::DisjointBuf;
use crate::model::{LoadTarget, ObjectRequest, ObjectValue, Region, TensorKey};
use crate::plan::exchange::{ExchangePlan, SharedRead};
use crate::plan::layout::RankLayout;
use crate::plan::load::{ShardRead, StoredGeometry};
use crate::plan::rule::World;
use crate::plan::ruled::plan_load;
use crate::storage::read::{ReadCounters, ReadMethod, read_shard, with_scratch};
use crate::storage::{CheckpointMeta, TensorArray, commit};

mod cast;
mod reader;

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
}

/// This rank's requests as a layout. A request that converts declares the stored data type
/// and is marked as read by this rank alone (its buffer holds another type, so it cannot
/// share boxes with other ranks).
fn request_layout(targets: &[LoadTarget<'_>], meta: &CheckpointMeta) -> Result<RankLayout> {
    rank_layout(
        targets.iter().map(|t| {
            let from = cast::converts_from(t, meta);
            BoxDecl {
                key: t.key(),
                dtype: from.unwrap_or(t.dtype()),
                global_shape: t.global_shape(),
                region: t.region(),
                main: from.is_some(),
                auto: false,
            }
        }),
        "requests",
    )
}

/// Checks every rank's requests against the index, identically on every rank, so that all
/// ranks fail together (naming the offending rank) instead of some waiting for the others.
fn check_requests(
    dir: &Path,
    meta: &CheckpointMeta,
    w: &World,
    me: usize,
    strict: StrictMode,
) -> Result<(Vec<TensorKey>, Vec<TensorKey>)> {
    let mut my_unexpected = Vec::new();
    let mut first_other: Option<(usize, Vec<TensorKey>)> = None;
    let mut requested: BTreeSet<&TensorKey> = BTreeSet::new();
    let my_template = w.of_rank(me).map(|(t, _)| t);
    for (u, template) in w.templates.iter().enumerate() {
        // Only names a rank in errors; a template no run uses (none in a world built by
        // merging rank summaries) is named by rank 0.
        let lowest = w.some_ranks(u).first().copied().unwrap_or(0) as usize;
        let mine = my_template == Some(u);
        let mut unexpected = Vec::new();
        for t in &template.tensors {
            requested.insert(&t.key);
            match meta.tensors.get(&t.key) {
                None => unexpected.push(t.key.clone()),
                Some(e) => {
                    let path = dir.to_owned();
                    if e.dtype != t.dtype {
                        return Err(Error::DtypeMismatch {
                            key: t.key.clone(),
                            rank: lowest,
                            path,
                            requested: t.dtype,
                            stored: e.dtype,
                        });
                    }
                    if e.shape != t.global_shape {
                        return Err(Error::ShapeMismatch {
                            key: t.key.clone(),
                            rank: lowest,
                            path,
                            requested: t.global_shape.clone(),
                            stored: e.shape.clone(),
                        });
                    }
                }
            }
        }
        if mine {
            my_unexpected = unexpected;
        } else if !unexpected.is_empty() && first_other.as_ref().is_none_or(|(r, _)| lowest < *r) {
            first_other = Some((lowest, unexpected));
        }
    }
    // AssumeOkUnexpected: no check here; a missing key fails when this rank reads it.
    if strict.raises_unexpected() && strict != StrictMode::AssumeOkUnexpected {
        if !my_unexpected.is_empty() {
            return Err(Error::UnexpectedKeys {
                path: dir.to_owned(),
                keys: my_unexpected,
                rank: me,
            });
        }
        if let Some((rank, keys)) = first_other {
            return Err(Error::UnexpectedKeys {
                path: dir.to_owned(),
                keys,
                rank,
            });
        }
    }
    let missing: Vec<TensorKey> = if strict.needs_missing() {
        meta.tensors
            .keys()
            .filter(|k| !requested.contains(k))
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    match strict {
        StrictMode::RaiseAll if !missing.is_empty() => {
            return Err(Error::MissingKeys {
                path: dir.to_owned(),
                keys: missing,
            });
        }
        StrictMode::LogUnexpected | StrictMode::LogAll => {
            if !my_unexpected.is_empty() {
                tracing::warn!(rank = me, keys = ?my_unexpected, "requested keys not in checkpoint {}", dir.display());
            }
            if !missing.is_empty() {
                tracing::warn!(keys = ?missing, "checkpoint keys requested by no rank in {}", dir.display());
            }
        }
        _ => {}
    }
    Ok((my_unexpected, missing))
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
    let meta = agree(comm, commit::read_index(dir).map_err(Error::from))?;
    load_from_index(targets, objects, dir, &meta, comm, opts)
}

/// [`load_impl`] against an index already read and agreed on (a [`crate::Checkpoint`]'s).
pub(crate) fn load_from_index(
    targets: &mut [LoadTarget<'_>],
    objects: Option<&[ObjectRequest]>,
    dir: &Path,
    meta: &CheckpointMeta,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    // Flat requests are loaded as the boxes of their decomposition, over disjoint parts of
    // their buffers.
    if targets.iter().any(|t| t.flat_range().is_some()) {
        let mut boxed: Vec<LoadTarget<'_>> = targets
            .iter_mut()
            .flat_map(LoadTarget::box_targets)
            .collect();
        return load_boxes(&mut boxed, objects, dir, meta, comm, opts);
    }
    load_boxes(targets, objects, dir, meta, comm, opts)
}

/// [`load_from_index`] once every target is a box.
fn load_boxes(
    targets: &mut [LoadTarget<'_>],
    objects: Option<&[ObjectRequest]>,
    dir: &Path,
    meta: &CheckpointMeta,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let me = comm.rank();
    let me32 = u32::try_from(me).unwrap_or(u32::MAX);
    let layout = agree(comm, request_layout(targets, meta))?;
    // The world's requests: this rank's described by rule, combined up the tree.
    let (world, _) = combine(comm, &describe(comm, &layout))?;
    let (mut unexpected, mut missing) = check_requests(dir, meta, &world, me, opts.strict)?;
    let object_values = match objects {
        Some(requests) => {
            let o = crate::objects::load_objects(dir, meta, requests, comm, opts.strict)?;
            unexpected.extend(o.unexpected);
            missing.extend(o.missing);
            o.values
        }
        None => Vec::new(),
    };
    let (plan, group_rounds) = if opts.exchange && comm.world_size() > 1 {
        let geometry = |key: &TensorKey| stored_geometry(meta, key);
        let (plan, mine) = plan_load(&world, me32, &geometry, ROUND_BYTES)?;
        let rounds = all_reduce_u64(comm, &[u64::from(mine)], &[u64::max])?[0];
        (plan, u32::try_from(rounds).unwrap_or(u32::MAX))
    } else {
        (ExchangePlan::default(), 0)
    };
    let loaded: u64 = targets
        .iter()
        .filter(|t| meta.tensors.contains_key(t.key()))
        .map(|t| t.buf().len() as u64)
        .sum();
    let requests: Vec<(TensorKey, Region)> = targets
        .iter()
        .map(|t| (t.key().clone(), t.region().clone()))
        .collect();
    // (stored, target) data types of the requests that convert.
    let casts: Vec<Option<(crate::model::DType, crate::model::DType)>> = targets
        .iter()
        .map(|t| cast::converts_from(t, meta).map(|from| (from, t.dtype())))
        .collect();
    let dests: Vec<DisjointBuf> = targets
        .iter_mut()
        .zip(&requests)
        .map(|(t, (_, region))| {
            let elem = t.dtype().size();
            DisjointBuf::new(t.buf_mut(), region, elem)
        })
        .collect();

    let counters = ReadCounters::default();
    let mut first_target = HashMap::new();
    let local = open_arrays(dir, meta, &requests, me, opts.strict).and_then(|arrays| {
        let items = shard_reads(&arrays, &requests, &casts, &plan, me32, &mut first_target);
        read_shards(&arrays, &requests, &items, &dests, &casts, &counters, opts)
    });
    agree(comm, local)?;

    let (sent, received) = if group_rounds == 0 && plan.general_rounds == 0 {
        (0, 0)
    } else {
        let shared = exchange_shared(comm, &plan, group_rounds, me32, &first_target, &dests, opts);
        agree(comm, shared)?
    };
    let mut report = LoadReport {
        loaded_bytes: loaded,
        bytes_read: counters.bytes.load(Ordering::Relaxed),
        bytes_received: received,
        bytes_sent: sent,
        objects: object_values,
        ..LoadReport::default()
    };
    if matches!(
        opts.strict,
        StrictMode::ReturnUnexpected | StrictMode::ReturnAll
    ) {
        report.unexpected = unexpected;
    }
    if matches!(opts.strict, StrictMode::ReturnAll | StrictMode::LogAll) {
        report.missing = missing;
    }
    Ok(report)
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

/// Arrays this rank reads, opened once each, with their geometry.
type OpenArrays<'k> = BTreeMap<&'k TensorKey, (TensorArray, StoredGeometry)>;

/// Opens every requested array present in the index, once. With
/// [`StrictMode::AssumeOkUnexpected`], a requested key the index lacks fails here.
fn open_arrays<'k>(
    dir: &Path,
    meta: &CheckpointMeta,
    requests: &'k [(TensorKey, Region)],
    me: usize,
    strict: StrictMode,
) -> Result<OpenArrays<'k>> {
    let mut arrays = BTreeMap::new();
    if strict == StrictMode::AssumeOkUnexpected {
        let absent: BTreeSet<&TensorKey> = requests
            .iter()
            .map(|(k, _)| k)
            .filter(|k| !meta.tensors.contains_key(*k))
            .collect();
        if !absent.is_empty() {
            return Err(Error::UnexpectedKeys {
                path: dir.to_owned(),
                keys: absent.into_iter().cloned().collect(),
                rank: me,
            });
        }
    }
    for (key, _) in requests {
        if let (Some(entry), Some(geom), false) = (
            meta.tensors.get(key),
            stored_geometry(meta, key),
            arrays.contains_key(key),
        ) {
            arrays.insert(
                key,
                (TensorArray::open_for(dir, key, entry, meta.save_id)?, geom),
            );
        }
    }
    Ok(arrays)
}

/// The shard reads this rank does itself: every shard intersecting a request, except the
/// boxes another rank of its read group reads and sends. Fills `first_target` with, for each
/// shared read this rank takes part in, the first of its requests that needs it.
fn shard_reads(
    arrays: &OpenArrays<'_>,
    requests: &[(TensorKey, Region)],
    casts: &[Option<(crate::model::DType, crate::model::DType)>],
    plan: &ExchangePlan,
    me: u32,
    first_target: &mut HashMap<usize, usize>,
) -> Vec<(usize, ShardRead)> {
    let mut mine: HashMap<(&TensorKey, &[u64], &Region), usize> = HashMap::new();
    for (u, r) in plan.reads.iter().enumerate() {
        if r.ranks.binary_search(&me).is_ok() {
            mine.insert((&r.key, r.chunk.as_slice(), &r.region), u);
        }
    }
    let mut items = Vec::new();
    for (i, (key, region)) in requests.iter().enumerate() {
        let Some((_, geom)) = arrays.get(key) else {
            continue;
        };
        for shard in geom.reads_for(region) {
            let chunk_box = crate::plan::grid::chunk_box(&geom.chunk_shape, &shard.chunk);
            // A converting request reads alone: it never takes part in shared reads.
            let unit = region
                .intersect(&chunk_box)
                .as_ref()
                .filter(|_| casts[i].is_none())
                .and_then(|b| mine.get(&(key, shard.chunk.as_slice(), b)).copied());
            if let Some(u) = unit
                && !first_target.contains_key(&u)
            {
                first_target.insert(u, i);
                if plan.reads[u].reader != me {
                    continue; // received from the reader
                }
            }
            items.push((i, shard));
        }
    }
    items
}

/// Reads one planned shard of a target into its buffer, converting between float types when
/// `cast` asks (`(stored, target)`): the one step the collective load and the local
/// [`Reader`] both execute per shard.
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
    method: crate::storage::read::ReadMethod,
) -> Result<()> {
    match cast {
        // SAFETY: forwarded to the caller.
        None => with_scratch(|scratch| unsafe {
            read_shard(arr, geom, shard, dest, scratch, counters, method)
        })?,
        // SAFETY: forwarded to the caller.
        Some((from, to)) => unsafe {
            cast::read_shard_converted(arr, geom, shard, dest, from, to, counters, method)
        }?,
    }
    Ok(())
}

/// Reads the shard items in parallel on the I/O pool, straight into the requests' buffers.
fn read_shards(
    arrays: &OpenArrays<'_>,
    requests: &[(TensorKey, Region)],
    items: &[(usize, ShardRead)],
    dests: &[DisjointBuf<'_>],
    casts: &[Option<(crate::model::DType, crate::model::DType)>],
    counters: &ReadCounters,
    opts: &LoadOptions,
) -> Result<()> {
    let pool = io_pool(opts.io_threads)?;
    pool.install(|| {
        items.par_iter().try_for_each(|(i, shard)| {
            let (arr, geom) = &arrays[&requests[*i].0];
            // SAFETY: the shards of one target are disjoint boxes, so the items of one
            // target write disjoint bytes of its buffer; targets own distinct buffers.
            unsafe {
                read_item(
                    arr,
                    geom,
                    shard,
                    dests[*i],
                    casts[*i],
                    counters,
                    opts.read_method,
                )
            }?;
            if let Some(p) = &opts.progress {
                let n: u64 = shard
                    .subchunks
                    .iter()
                    // Invariant: a planned box inside a checked chunk.
                    .map(|s| s.needed.num_elements().unwrap_or(0))
                    .sum();
                p(n * dests[*i].elem() as u64);
            }
            Ok::<(), Error>(())
        })
    })
}

/// Bytes of shared reads moved through one exchange round at most: bounds what a rank stages
/// for boxes that are not contiguous in its buffers.
const ROUND_BYTES: u64 = 32 << 20;

/// Sends the boxes this rank read for others and receives the ones others read for it, in
/// rounds of bounded size. Returns (bytes sent, bytes received).
fn exchange_shared(
    comm: &dyn Communicator,
    plan: &ExchangePlan,
    group_rounds: u32,
    me: u32,
    first_target: &HashMap<usize, usize>,
    dests: &[DisjointBuf<'_>],
    opts: &LoadOptions,
) -> Result<(u64, u64)> {
    let (mut sent, mut received) = (0u64, 0u64);
    let groups = (0..group_rounds).map(|r| (0..plan.general_from, r));
    let general = (0..plan.general_rounds).map(|r| (plan.general_from..plan.reads.len(), r));
    for (range, round) in groups.chain(general) {
        let reads: Vec<(usize, &SharedRead)> = range
            .filter(|&u| plan.round[u] == round)
            .map(|u| (u, &plan.reads[u]))
            .collect();
        // Sends: straight from this rank's buffer when the box is contiguous there.
        let mut packed: Vec<(usize, Vec<u8>)> = Vec::new();
        for &(u, r) in &reads {
            if r.reader == me
                && let Some(&t) = first_target.get(&u)
                && dests[t].contiguous_range(&r.region).is_none()
            {
                let mut v = Vec::new();
                // SAFETY: the exchange only reads this rank's own filled boxes and writes
                // boxes received from others: distinct shards, disjoint bytes.
                unsafe { dests[t].pack(&r.region, &mut v) };
                packed.push((u, v));
            }
        }
        let mut sends: Vec<SendBuf> = Vec::new();
        for &(u, r) in &reads {
            let Some(&t) = first_target.get(&u) else {
                continue;
            };
            if r.reader != me {
                continue;
            }
            let data: &[u8] = match dests[t].contiguous_range(&r.region) {
                // SAFETY: as above.
                Some((start, len)) => unsafe { dests[t].slice(start, len) },
                None => packed
                    .iter()
                    .find(|p| p.0 == u)
                    .map_or(&[][..], |p| p.1.as_slice()),
            };
            for &peer in r.ranks.iter().filter(|&&p| p != me) {
                sends.push(SendBuf {
                    peer: peer as usize,
                    data,
                });
                sent += data.len() as u64;
            }
        }
        // Receives: straight into this rank's buffer when the box is contiguous there.
        let mut staged: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut recvs: Vec<RecvBuf> = Vec::new();
        for &(u, r) in &reads {
            let Some(&t) = first_target.get(&u) else {
                continue;
            };
            if r.reader == me {
                continue;
            }
            if dests[t].contiguous_range(&r.region).is_none() {
                staged.push((u, vec![0u8; crate::model::usize_of(r.bytes)]));
            }
        }
        let mut staged_iter = staged.iter_mut();
        for &(u, r) in &reads {
            let Some(&t) = first_target.get(&u) else {
                continue;
            };
            if r.reader == me {
                continue;
            }
            let buf: &mut [u8] = match dests[t].contiguous_range(&r.region) {
                // SAFETY: as above.
                Some((start, len)) => unsafe { dests[t].slice(start, len) },
                None => staged_iter
                    .next()
                    .map_or(&mut [][..], |s| s.1.as_mut_slice()),
            };
            received += buf.len() as u64;
            recvs.push(RecvBuf {
                peer: r.reader as usize,
                buf,
            });
        }
        comm.exchange(&sends, &mut recvs)?;
        drop(recvs);
        for (u, data) in &staged {
            let t = first_target[u];
            // SAFETY: as above.
            unsafe { dests[t].unpack(&plan.reads[*u].region, data) };
        }
        if let Some(p) = &opts.progress {
            p(reads
                .iter()
                .filter(|(u, r)| r.reader != me && first_target.contains_key(u))
                .map(|(_, r)| r.bytes)
                .sum());
        }
    }
    Ok((sent, received))
}
