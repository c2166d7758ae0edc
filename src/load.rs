//! The load front door: every rank calls [`load`] with the boxes it wants and buffers to fill.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::Ordering;

use rayon::prelude::*;

use crate::comm::Communicator;
use crate::comm::{RecvBuf, SendBuf};
use crate::error::{Error, Result};
use crate::model::copy::DisjointBuf;
use crate::model::{LoadTarget, TensorKey};
use crate::plan::exchange::{ExchangePlan, SharedRead};
use crate::plan::layout::{GatheredLayouts, PieceDecl, RankLayout, TensorDecl};
use crate::plan::load::{ShardRead, StoredGeometry};
use crate::save::{Progress, agree, gather_layouts, io_pool};
use crate::storage::read::{ReadCounters, ReadMethod, read_shard, with_scratch};
use crate::storage::{CheckpointMeta, TensorArray, commit};

/// How to treat keys requested but absent ("unexpected", per rank) and keys present but
/// requested by no rank ("missing", global), after Megatron-Core's `StrictHandling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StrictMode {
    /// No key checks at all (fastest); an unexpected key still fails when it is read.
    AssumeOkUnexpected,
    /// Log unexpected keys and skip them (their buffers are left untouched).
    LogUnexpected,
    /// Log unexpected and missing keys, skip unexpected ones.
    LogAll,
    /// Fail if any rank requested an unexpected key (the default).
    #[default]
    RaiseUnexpected,
    /// Fail on unexpected or missing keys.
    RaiseAll,
    /// Skip unexpected keys and return them in the report.
    ReturnUnexpected,
    /// Skip unexpected keys and return both sets in the report.
    ReturnAll,
    /// Skip unexpected keys silently.
    IgnoreAll,
}

impl StrictMode {
    fn needs_missing(self) -> bool {
        matches!(
            self,
            StrictMode::LogAll | StrictMode::RaiseAll | StrictMode::ReturnAll
        )
    }
    fn raises_unexpected(self) -> bool {
        matches!(
            self,
            StrictMode::RaiseUnexpected | StrictMode::RaiseAll | StrictMode::AssumeOkUnexpected
        )
    }
}

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
}

fn request_layout(targets: &[LoadTarget<'_>]) -> Result<RankLayout> {
    let mut layout = RankLayout::default();
    let mut ids: HashMap<&TensorKey, u32> = HashMap::new();
    for t in targets {
        let id = match ids.get(t.key()) {
            Some(&id) => {
                let d = &layout.tensors[id as usize];
                if d.dtype != t.dtype() || d.global_shape != t.global_shape() {
                    return Err(Error::InconsistentPieces {
                        key: t.key().clone(),
                        detail: format!(
                            "requests on this rank declare {} {:?} and {} {:?}",
                            d.dtype,
                            d.global_shape,
                            t.dtype(),
                            t.global_shape()
                        ),
                    });
                }
                id
            }
            None => {
                let id = u32::try_from(layout.tensors.len()).unwrap_or(u32::MAX);
                layout.tensors.push(TensorDecl {
                    key: t.key().clone(),
                    dtype: t.dtype(),
                    global_shape: t.global_shape().to_vec(),
                });
                ids.insert(t.key(), id);
                id
            }
        };
        layout.pieces.push(PieceDecl {
            tensor: id,
            region: t.region().clone(),
            main: false,
        });
    }
    Ok(layout)
}

/// Checks every rank's requests against the index, identically on every rank, so that all
/// ranks fail together (naming the offending rank) instead of some waiting for the others.
fn check_requests(
    dir: &Path,
    meta: &CheckpointMeta,
    g: &GatheredLayouts,
    me: usize,
    strict: StrictMode,
) -> Result<(Vec<TensorKey>, Vec<TensorKey>)> {
    let mut my_unexpected = Vec::new();
    let mut first_other: Option<(usize, Vec<TensorKey>)> = None;
    let mut requested: BTreeSet<&TensorKey> = BTreeSet::new();
    for (u, layout) in g.unique.iter().enumerate() {
        let ranks = &g.ranks[u];
        let lowest = ranks.first().copied().unwrap_or(0) as usize;
        let mine = g.of_rank[me] as usize == u;
        let mut unexpected = Vec::new();
        for t in &layout.tensors {
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
    if strict.raises_unexpected() {
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
    let me = comm.rank();
    let meta = agree(comm, commit::read_index(dir).map_err(Error::from))?;
    let layout = agree(comm, request_layout(targets))?;
    let (gathered, _) = gather_layouts(comm, &layout)?;
    let (unexpected, missing) = check_requests(dir, &meta, &gathered, me, opts.strict)?;
    let geometry = |key: &TensorKey| {
        meta.tensors.get(key).map(|e| StoredGeometry {
            global_shape: e.shape.clone(),
            chunk_shape: e.chunk_shape.clone(),
            subchunk_shape: e.subchunk_shape.clone(),
            elem: e.dtype.size(),
        })
    };
    let plan = if opts.exchange && comm.world_size() > 1 {
        ExchangePlan::build(&gathered, geometry)
    } else {
        ExchangePlan::default()
    };
    // This rank's part in the shared reads: for each, the first of its targets that needs it.
    let me32 = u32::try_from(me).unwrap_or(u32::MAX);
    let mut mine: HashMap<(&TensorKey, &[u64], &crate::model::Region), usize> = HashMap::new();
    for (u, r) in plan.reads.iter().enumerate() {
        if r.ranks.binary_search(&me32).is_ok() {
            mine.insert((&r.key, r.chunk.as_slice(), &r.region), u);
        }
    }
    let mut first_target: HashMap<usize, usize> = HashMap::new();

    let keys: Vec<TensorKey> = targets.iter().map(|t| t.key().clone()).collect();
    let regions: Vec<crate::model::Region> = targets.iter().map(|t| t.region().clone()).collect();
    let loaded: u64 = targets
        .iter()
        .filter(|t| meta.tensors.contains_key(t.key()))
        .map(|t| t.buf().len() as u64)
        .sum();
    let dests: Vec<DisjointBuf> = targets
        .iter_mut()
        .zip(&regions)
        .map(|(t, region)| {
            let elem = t.dtype().size();
            DisjointBuf::new(t.buf_mut(), region, elem)
        })
        .collect();
    let counters = ReadCounters::default();

    let local = (|| -> Result<()> {
        // Open each needed array once.
        let mut arrays: BTreeMap<&TensorKey, (TensorArray, StoredGeometry)> = BTreeMap::new();
        for key in &keys {
            if let (Some(entry), false) = (meta.tensors.get(key), arrays.contains_key(key)) {
                let arr = TensorArray::open_for(dir, key, entry, meta.save_id)?;
                arrays.insert(
                    key,
                    (
                        arr,
                        geometry(key).unwrap_or_else(|| unreachable!("present")),
                    ),
                );
            }
        }
        let mut items: Vec<(usize, ShardRead)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let Some((_, geom)) = arrays.get(key) else {
                continue;
            };
            for shard in geom.reads_for(&regions[i]) {
                let chunk_box = crate::model::Region {
                    offset: shard
                        .chunk
                        .iter()
                        .zip(&geom.chunk_shape)
                        .map(|(c, s)| c * s)
                        .collect(),
                    shape: geom.chunk_shape.clone(),
                };
                let inner = regions[i].intersect(&chunk_box);
                let unit = inner
                    .as_ref()
                    .and_then(|b| mine.get(&(key, shard.chunk.as_slice(), b)).copied());
                if let Some(u) = unit
                    && !first_target.contains_key(&u)
                {
                    first_target.insert(u, i);
                    if plan.reads[u].reader != me32 {
                        continue; // received from the reader
                    }
                }
                items.push((i, shard));
            }
        }
        let pool = io_pool(opts.io_threads)?;
        pool.install(|| {
            items.par_iter().try_for_each(|(i, shard)| {
                let (arr, geom) = &arrays[&keys[*i]];
                // SAFETY: the shards of one target are disjoint boxes, so the items of one
                // target write disjoint bytes of its buffer; targets own distinct buffers.
                with_scratch(|scratch| unsafe {
                    read_shard(
                        arr,
                        geom,
                        shard,
                        dests[*i],
                        scratch,
                        &counters,
                        opts.read_method,
                    )
                })?;
                if let Some(p) = &opts.progress {
                    let n: u64 = shard
                        .subchunks
                        .iter()
                        .map(|s| s.needed.num_elements().unwrap_or(0))
                        .sum();
                    p(n * geom.elem as u64);
                }
                Ok::<(), Error>(())
            })
        })?;
        Ok(())
    })();
    agree(comm, local)?;

    let (sent, received) = if plan.reads.is_empty() {
        (0, 0)
    } else {
        let shared = exchange_shared(comm, &plan, me32, &first_target, &dests, opts);
        agree(comm, shared)?
    };
    let mut report = LoadReport {
        loaded_bytes: loaded,
        bytes_read: counters.bytes.load(Ordering::Relaxed),
        bytes_received: received,
        bytes_sent: sent,
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

/// Bytes of shared reads moved through one exchange round at most: bounds what a rank stages
/// for boxes that are not contiguous in its buffers.
const ROUND_BYTES: u64 = 32 << 20;

/// Sends the boxes this rank read for others and receives the ones others read for it, in
/// rounds of bounded size. Returns (bytes sent, bytes received).
fn exchange_shared(
    comm: &dyn Communicator,
    plan: &ExchangePlan,
    me: u32,
    first_target: &HashMap<usize, usize>,
    dests: &[DisjointBuf<'_>],
    opts: &LoadOptions,
) -> Result<(u64, u64)> {
    let (mut sent, mut received) = (0u64, 0u64);
    for round in plan.rounds(ROUND_BYTES) {
        let reads: Vec<(usize, &SharedRead)> = round.map(|u| (u, &plan.reads[u])).collect();
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
                staged.push((u, vec![0u8; usize::try_from(r.bytes).unwrap_or(usize::MAX)]));
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
