//! The load front door: every rank calls [`load`] with the boxes it wants and buffers to fill.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::Ordering;

use rayon::prelude::*;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::model::{LoadTarget, TensorKey};
use crate::plan::layout::{GatheredLayouts, PieceDecl, RankLayout, TensorDecl};
use crate::plan::load::{ShardRead, StoredGeometry};
use crate::save::{Progress, agree, gather_layouts, io_pool};
use crate::storage::read::{Dest, ReadCounters, read_shard};
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
        matches!(self, StrictMode::LogAll | StrictMode::RaiseAll | StrictMode::ReturnAll)
    }
    fn raises_unexpected(self) -> bool {
        matches!(self, StrictMode::RaiseUnexpected | StrictMode::RaiseAll | StrictMode::AssumeOkUnexpected)
    }
}

/// How to load.
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Key checks.
    pub strict: StrictMode,
    /// Threads reading files on this rank; 0 picks the number of CPUs (at most 8).
    pub io_threads: usize,
    /// Progress callback, in bytes loaded into this rank's buffers.
    pub progress: Option<Progress>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions").field("strict", &self.strict).field("io_threads", &self.io_threads).finish_non_exhaustive()
    }
}

/// What a load did on this rank.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Bytes written into this rank's buffers.
    pub loaded_bytes: u64,
    /// Bytes this rank read from storage (shard indexes and subchunks).
    pub bytes_read: u64,
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
                        detail: format!("requests on this rank declare {} {:?} and {} {:?}", d.dtype, d.global_shape, t.dtype(), t.global_shape()),
                    });
                }
                id
            }
            None => {
                let id = u32::try_from(layout.tensors.len()).unwrap_or(u32::MAX);
                layout.tensors.push(TensorDecl { key: t.key().clone(), dtype: t.dtype(), global_shape: t.global_shape().to_vec() });
                ids.insert(t.key(), id);
                id
            }
        };
        layout.pieces.push(PieceDecl { tensor: id, region: t.region().clone(), main: false });
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
                        return Err(Error::DtypeMismatch { key: t.key.clone(), path, requested: t.dtype, stored: e.dtype });
                    }
                    if e.shape != t.global_shape {
                        return Err(Error::ShapeMismatch {
                            key: t.key.clone(),
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
            return Err(Error::UnexpectedKeys { path: dir.to_owned(), keys: my_unexpected, rank: me });
        }
        if let Some((rank, keys)) = first_other {
            return Err(Error::UnexpectedKeys { path: dir.to_owned(), keys, rank });
        }
    }
    let missing: Vec<TensorKey> = if strict.needs_missing() {
        meta.tensors.keys().filter(|k| !requested.contains(k)).cloned().collect()
    } else {
        Vec::new()
    };
    match strict {
        StrictMode::RaiseAll if !missing.is_empty() => {
            return Err(Error::MissingKeys { path: dir.to_owned(), keys: missing });
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
pub fn load(targets: &mut [LoadTarget<'_>], dir: &Path, comm: &dyn Communicator, opts: &LoadOptions) -> Result<LoadReport> {
    let me = comm.rank();
    let meta = agree(comm, commit::read_index(dir).map_err(Error::from))?;
    let layout = agree(comm, request_layout(targets))?;
    let (gathered, _) = gather_layouts(comm, &layout)?;
    let (unexpected, missing) = check_requests(dir, &meta, &gathered, me, opts.strict)?;

    let local = (|| -> Result<LoadReport> {
        // Open each needed array once.
        let mut arrays: BTreeMap<TensorKey, (TensorArray, StoredGeometry)> = BTreeMap::new();
        for t in targets.iter() {
            if let (Some(entry), false) = (meta.tensors.get(t.key()), arrays.contains_key(t.key())) {
                let arr = TensorArray::open(dir, t.key(), entry)?;
                let geom = StoredGeometry {
                    global_shape: entry.shape.clone(),
                    chunk_shape: entry.chunk_shape.clone(),
                    subchunk_shape: entry.subchunk_shape.clone(),
                    elem: entry.dtype.size(),
                };
                arrays.insert(t.key().clone(), (arr, geom));
            }
        }
        let mut items: Vec<(usize, ShardRead)> = Vec::new();
        let mut loaded = 0u64;
        for (i, t) in targets.iter().enumerate() {
            if let Some((_, geom)) = arrays.get(t.key()) {
                loaded += t.buf().len() as u64;
                items.extend(geom.reads_for(t.region()).into_iter().map(|s| (i, s)));
            }
        }
        let keys: Vec<TensorKey> = targets.iter().map(|t| t.key().clone()).collect();
        let dests: Vec<Dest> = targets
            .iter_mut()
            .map(|t| {
                let elem = t.dtype().size();
                let (region, buf) = t.region_and_buf();
                Dest::new(buf, region, elem)
            })
            .collect();
        let counters = ReadCounters::default();
        let pool = io_pool(opts.io_threads)?;
        pool.install(|| {
            items.par_iter().try_for_each_init(Vec::new, |scratch, (i, shard)| {
                let (arr, geom) = &arrays[&keys[*i]];
                // SAFETY: the shards of one target are disjoint boxes, so the items of one
                // target write disjoint bytes of its buffer; targets own distinct buffers.
                unsafe { read_shard(arr, geom, shard, dests[*i], scratch, &counters) }?;
                if let Some(p) = &opts.progress {
                    let n: u64 = shard.subchunks.iter().map(|s| s.needed.num_elements().unwrap_or(0)).sum();
                    p(n * geom.elem as u64);
                }
                Ok::<(), Error>(())
            })
        })?;
        Ok(LoadReport { loaded_bytes: loaded, bytes_read: counters.bytes.load(Ordering::Relaxed), unexpected: Vec::new(), missing: Vec::new() })
    })();
    let mut report = agree(comm, local)?;
    if matches!(opts.strict, StrictMode::ReturnUnexpected | StrictMode::ReturnAll) {
        report.unexpected = unexpected;
    }
    if matches!(opts.strict, StrictMode::ReturnAll | StrictMode::LogAll) {
        report.missing = missing;
    }
    Ok(report)
}
