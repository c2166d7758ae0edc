//! The save front door: every rank calls [`save`] with the pieces it holds.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::comm::{Communicator, RecvBuf, SendBuf};
use crate::error::{Error, Result};
use crate::model::copy::copy_region;
use crate::model::{Region, ShardedTensor, TensorKey};
use crate::plan::GridOptions;
use crate::plan::layout::{GatheredLayouts, PieceDecl, RankLayout, TensorDecl};
use crate::plan::save::{ChunkWrite, RankTasks, SavePlan, SavePlanOptions, Source, TensorPlan};
use crate::storage::commit::{SaveLock, Target};
use crate::storage::footer::SaveId;
use crate::storage::meta::tensor_path;
use crate::storage::{CheckpointMeta, Compression, TensorArray, TensorEntry, commit, fsio, write};

/// Called with a number of bytes each time that many more bytes are done.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

/// How to save.
#[derive(Clone)]
pub struct SaveOptions {
    /// Replace an existing checkpoint at the path (never a directory that is not one).
    pub overwrite: bool,
    /// Compression of chunks.
    pub compression: Compression,
    /// Chunk grid choices.
    pub grid: GridOptions,
    /// Spread writes of replicated pieces across their holders (true, the default), or let
    /// main replicas write everything.
    pub balance_replicas: bool,
    /// Threads writing files on this rank; 0 picks the number of CPUs (at most 8).
    pub io_threads: usize,
    /// Free-form metadata stored in the index (rank 0's is used), e.g. the training step.
    pub user_metadata: serde_json::Map<String, serde_json::Value>,
    /// Progress callback, in bytes of tensor data written by this rank.
    pub progress: Option<Progress>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            overwrite: false,
            compression: Compression::None,
            grid: GridOptions::default(),
            balance_replicas: true,
            io_threads: 0,
            user_metadata: serde_json::Map::new(),
            progress: None,
        }
    }
}

impl std::fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("overwrite", &self.overwrite)
            .field("compression", &self.compression)
            .field("grid", &self.grid)
            .field("balance_replicas", &self.balance_replicas)
            .field("io_threads", &self.io_threads)
            .finish_non_exhaustive()
    }
}

/// What a save did on this rank.
#[derive(Debug, Clone)]
pub struct SaveReport {
    /// Tensors in the checkpoint.
    pub tensors: usize,
    /// Shard files this rank wrote.
    pub chunks_written: usize,
    /// Bytes of tensor data this rank wrote (before encoding).
    pub data_bytes: u64,
    /// Bytes this rank wrote to files (encoded shards and metadata).
    pub file_bytes: u64,
    /// Tensor bytes each rank was assigned to write.
    pub bytes_per_rank: Vec<u64>,
    /// Largest assigned bytes over the mean (1.0 is perfect balance).
    pub write_balance: f64,
    /// Time spent gathering layouts and planning.
    pub plan_time: Duration,
    /// Bytes this rank received in the layout all-gathers.
    pub gathered_bytes: u64,
}

pub(crate) fn io_pool(threads: usize) -> Result<rayon::ThreadPool> {
    let n = if threads == 0 {
        std::thread::available_parallelism()
            .map_or(2, std::num::NonZero::get)
            .min(8)
    } else {
        threads
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("zarrckpt-io-{i}"))
        .build()
        .map_err(|e| Error::ThreadPool(e.to_string()))
}

/// Every rank reports its local outcome; everyone returns an error if anyone failed, so no
/// rank proceeds to a step the others will not reach.
pub(crate) fn agree<T>(comm: &dyn Communicator, local: Result<T>) -> Result<T> {
    let msg = match &local {
        Ok(_) => vec![0u8],
        Err(e) => {
            let mut v = vec![1u8];
            v.extend_from_slice(e.to_string().as_bytes());
            v
        }
    };
    let all = match comm.all_gather(&msg) {
        Ok(all) => all,
        Err(e) => return Err(local.err().unwrap_or(Error::Comm(e))),
    };
    let v = local?;
    for (rank, m) in all.iter().enumerate() {
        if m.first() != Some(&0) {
            let message = String::from_utf8_lossy(m.get(1..).unwrap_or_default()).into_owned();
            return Err(Error::RemoteFailure { rank, message });
        }
    }
    Ok(v)
}

/// All-gathers layouts with de-duplication: a hash from every rank, then the description from
/// the lowest rank of each distinct hash. Returns the global view and the bytes received.
pub(crate) fn gather_layouts(
    comm: &dyn Communicator,
    layout: &RankLayout,
) -> Result<(GatheredLayouts, u64)> {
    let encoded = layout.encode();
    let hash = RankLayout::hash_bytes(&encoded);
    let hashes_raw = comm.all_gather(&hash)?;
    let mut hashes = Vec::with_capacity(hashes_raw.len());
    for (r, h) in hashes_raw.iter().enumerate() {
        let h: [u8; 16] = h.as_slice().try_into().map_err(|_| {
            Error::Layout(crate::plan::LayoutDecodeError {
                rank: r,
                at: 0,
                reason: "layout hash is not 16 bytes".into(),
            })
        })?;
        hashes.push(h);
    }
    let reps = GatheredLayouts::representatives(&hashes);
    let mine: &[u8] = if reps[comm.rank()] { &encoded } else { &[] };
    let blobs = comm.all_gather(mine)?;
    let bytes = (hashes_raw.len() * 16 + blobs.iter().map(Vec::len).sum::<usize>()) as u64;
    Ok((GatheredLayouts::from_parts(&hashes, &blobs)?, bytes))
}

/// Builds this rank's layout and an index from (key, region) to the local piece.
/// Local pieces by (key, region).
type PieceIndex<'p, 'a> = HashMap<(&'p TensorKey, &'p Region), &'p ShardedTensor<'a>>;

fn local_layout<'p, 'a>(
    pieces: &'p [ShardedTensor<'a>],
) -> Result<(RankLayout, PieceIndex<'p, 'a>)> {
    let mut layout = RankLayout::default();
    let mut tensor_ids: HashMap<&TensorKey, u32> = HashMap::new();
    let mut by_box = HashMap::with_capacity(pieces.len());
    for p in pieces {
        let id = match tensor_ids.get(p.key()) {
            Some(&id) => {
                let d = &layout.tensors[id as usize];
                if d.dtype != p.dtype() || d.global_shape != p.global_shape() {
                    return Err(Error::InconsistentPieces {
                        key: p.key().clone(),
                        detail: format!(
                            "pieces on this rank declare {} {:?} and {} {:?}",
                            d.dtype,
                            d.global_shape,
                            p.dtype(),
                            p.global_shape()
                        ),
                    });
                }
                id
            }
            None => {
                let id = u32::try_from(layout.tensors.len()).unwrap_or(u32::MAX);
                layout.tensors.push(TensorDecl {
                    key: p.key().clone(),
                    dtype: p.dtype(),
                    global_shape: p.global_shape().to_vec(),
                });
                tensor_ids.insert(p.key(), id);
                id
            }
        };
        if by_box.insert((p.key(), p.region()), p).is_some() {
            return Err(Error::InconsistentPieces {
                key: p.key().clone(),
                detail: format!("this rank holds the piece {} twice", p.region()),
            });
        }
        layout.pieces.push(PieceDecl {
            tensor: id,
            region: p.region().clone(),
            main: p.is_main(),
        });
    }
    Ok((layout, by_box))
}

pub(crate) fn entry_of(tp: &TensorPlan, compression: Compression) -> TensorEntry {
    TensorEntry {
        path: tensor_path(&tp.key),
        dtype: tp.dtype,
        shape: tp.global_shape.clone(),
        chunk_shape: tp.chunk_shape.clone(),
        subchunk_shape: tp.subchunk_shape.clone(),
        compression,
    }
}

/// The full (unclipped) box of a chunk: stored chunks always have the full chunk shape.
fn full_chunk_box(tp: &TensorPlan, chunk: &[u64]) -> Region {
    Region {
        offset: chunk
            .iter()
            .zip(&tp.chunk_shape)
            .map(|(c, s)| c * s)
            .collect(),
        shape: tp.chunk_shape.clone(),
    }
}

/// The source of one chunk: the local piece holding the whole (unpadded) chunk, or else a
/// buffer assembled from local and received parts with zero padding at the tensor's edge.
/// Returns the bytes and the box they hold.
fn chunk_source<'a>(
    tp: &TensorPlan,
    w: &ChunkWrite,
    local: &HashMap<(&TensorKey, &Region), &ShardedTensor<'a>>,
    received: &[Vec<u8>],
) -> (Cow<'a, [u8]>, Region) {
    let elem = tp.dtype.size();
    let full = full_chunk_box(tp, &w.chunk);
    if let [part] = w.parts.as_slice()
        && let Source::Local(piece_region) = &part.source
        && w.region == full
        && let Some(piece) = local.get(&(&tp.key, piece_region))
    {
        return (Cow::Borrowed(piece.data()), piece_region.clone());
    }
    let len = full.shape.iter().product::<u64>() as usize * elem;
    let mut buf = vec![0u8; len];
    let mut remote = received.iter();
    for part in &w.parts {
        match &part.source {
            Source::Local(piece_region) => {
                let piece = local[&(&tp.key, piece_region)];
                copy_region(
                    piece.data(),
                    piece_region,
                    &mut buf,
                    &full,
                    &part.region,
                    elem,
                );
            }
            Source::Remote(_) => {
                let data = remote.next().map_or(&[][..], Vec::as_slice);
                copy_region(data, &part.region, &mut buf, &full, &part.region, elem);
            }
        }
    }
    (Cow::Owned(buf), full)
}

/// Sends and receives the parts of unaligned chunks. Returns, per write, the received parts
/// in order.
fn exchange_parts(
    comm: &dyn Communicator,
    plan: &SavePlan,
    tasks: &RankTasks,
    local: &HashMap<(&TensorKey, &Region), &ShardedTensor<'_>>,
) -> Result<Vec<Vec<Vec<u8>>>> {
    let mut outgoing: Vec<(usize, Vec<u8>)> = Vec::with_capacity(tasks.sends.len());
    for t in &tasks.sends {
        let tp = &plan.tensors[t.tensor];
        let elem = tp.dtype.size();
        let piece = local[&(&tp.key, &t.piece)];
        let mut buf = vec![0u8; t.region.num_elements().unwrap_or(0) as usize * elem];
        copy_region(piece.data(), &t.piece, &mut buf, &t.region, &t.region, elem);
        outgoing.push((t.to as usize, buf));
    }
    let mut received: Vec<Vec<Vec<u8>>> = tasks
        .writes
        .iter()
        .map(|w| {
            let elem = plan.tensors[w.tensor].dtype.size();
            w.parts
                .iter()
                .filter(|p| matches!(p.source, Source::Remote(_)))
                .map(|p| vec![0u8; p.region.num_elements().unwrap_or(0) as usize * elem])
                .collect()
        })
        .collect();
    let sends: Vec<SendBuf> = outgoing
        .iter()
        .map(|(peer, data)| SendBuf { peer: *peer, data })
        .collect();
    let peers: Vec<usize> = tasks
        .writes
        .iter()
        .flat_map(|w| w.parts.iter())
        .filter_map(|p| {
            if let Source::Remote(r) = p.source {
                Some(r as usize)
            } else {
                None
            }
        })
        .collect();
    let mut recvs: Vec<RecvBuf> = received
        .iter_mut()
        .flatten()
        .zip(peers)
        .map(|(buf, peer)| RecvBuf { peer, buf })
        .collect();
    comm.exchange(&sends, &mut recvs)?;
    Ok(received)
}

fn write_files(
    dir: &Path,
    plan: &SavePlan,
    tasks: &RankTasks,
    local: &HashMap<(&TensorKey, &Region), &ShardedTensor<'_>>,
    received: &[Vec<Vec<u8>>],
    opts: &SaveOptions,
    id: SaveId,
) -> Result<(u64, u64)> {
    let mut arrays: HashMap<usize, TensorArray> = HashMap::new();
    for &ti in tasks
        .metadata
        .iter()
        .chain(tasks.writes.iter().map(|w| &w.tensor))
    {
        if let std::collections::hash_map::Entry::Vacant(v) = arrays.entry(ti) {
            let tp = &plan.tensors[ti];
            v.insert(TensorArray::create_for(
                dir,
                &tp.key,
                &entry_of(tp, opts.compression),
                id,
            )?);
        }
    }
    let pool = io_pool(opts.io_threads)?;
    let (data, files) = pool.install(|| -> Result<(u64, u64)> {
        tasks
            .metadata
            .par_iter()
            .try_for_each(|ti| write::write_array_metadata(&arrays[ti]))?;
        let dirs: BTreeSet<PathBuf> = arrays.values().map(|a| a.dir().to_owned()).collect();
        for d in &dirs {
            fsio::create_dir_durable(d)?;
        }
        let totals = tasks
            .writes
            .par_iter()
            .zip(received.par_iter())
            .map(|(w, recv)| -> Result<(u64, u64)> {
                let tp = &plan.tensors[w.tensor];
                let (src, src_box) = chunk_source(tp, w, local, recv);
                let arr = &arrays[&w.tensor];
                let n = write::write_shard(
                    arr,
                    &w.chunk,
                    &src,
                    &src_box,
                    &full_chunk_box(tp, &w.chunk),
                )?;
                let data = w.region.num_elements().unwrap_or(0) * tp.dtype.size() as u64;
                if let Some(p) = &opts.progress {
                    p(data);
                }
                Ok((data, n))
            })
            .try_reduce(|| (0, 0), |a, b| Ok((a.0 + b.0, a.1 + b.1)))?;
        tasks
            .writes
            .par_iter()
            .try_for_each(|w| write::sync_file(&arrays[&w.tensor].chunk_path(&w.chunk)))?;
        dirs.par_iter().try_for_each(|d| fsio::fsync_dir(d))?;
        Ok(totals)
    })?;
    Ok((data, files))
}

/// Saves this rank's pieces into the checkpoint at `dir`. Every rank of `comm` calls it.
///
/// The ranks agree on the global layout (validated: every rank agrees on each tensor's data
/// type and global shape, main replicas cover every element exactly once), each rank writes
/// only the shard files assigned to it (replicated pieces once, spread over their holders by
/// bytes), and rank 0 commits the checkpoint once every rank's files are durable. If any rank
/// fails, every rank returns an error and the checkpoint stays incomplete.
///
/// Rank 0 holds the checkpoint's lock file for the whole save (a second save to the same
/// path fails on every rank of its job). A save over an existing checkpoint (`overwrite`)
/// writes into a staging sibling and swaps it in atomically at commit, so a crash at any
/// moment leaves the previous checkpoint or the new one, never neither and never a mix
/// (spec § "Commit protocol"). Before any data is written every rank checks that it sees a
/// file rank 0 wrote into the target directory.
///
/// # Errors
/// [`Error::Plan`] for an invalid global layout (naming the key and ranks),
/// [`Error::Storage`] for I/O failures (naming the path), [`Error::Comm`] when a rank dies
/// or times out, [`Error::RemoteFailure`] when another rank failed.
pub fn save(
    pieces: &[ShardedTensor<'_>],
    dir: &Path,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let t0 = Instant::now();
    let rank = comm.rank();
    let (layout, local) = agree(comm, local_layout(pieces))?;
    let (gathered, gathered_bytes) = gather_layouts(comm, &layout)?;
    let plan = SavePlan::build(
        &gathered,
        &SavePlanOptions {
            grid: opts.grid,
            balance_replicas: opts.balance_replicas,
        },
    )?;
    let plan_time = t0.elapsed();
    let tasks = plan.tasks_for(u32::try_from(rank).unwrap_or(u32::MAX));

    let prepared = prepare_target(comm, dir, opts.overwrite)?;
    let outcome = save_into(comm, &prepared, &plan, &tasks, &local, opts);
    if outcome.is_err() {
        commit::abandon(&prepared.target, prepared.lock.as_ref());
    }
    let (data_bytes, file_bytes) = outcome?;
    Ok(SaveReport {
        tensors: plan.tensors.len(),
        chunks_written: tasks.writes.len(),
        data_bytes,
        file_bytes,
        write_balance: plan.write_balance(),
        bytes_per_rank: plan.bytes_per_rank,
        plan_time,
        gathered_bytes,
    })
}

/// Where a save writes, as every rank learned it from rank 0.
struct Prepared {
    id: SaveId,
    target: Target,
    /// Rank 0's save lock, held until the save ends.
    lock: Option<SaveLock>,
}

/// Rank 0 takes the save lock, draws the save id, prepares the target directory (spec §
/// "Commit protocol") and writes the nonce file there; every rank learns the id and target
/// and checks it sees the nonce file (same storage), before any data is written.
fn prepare_target(comm: &dyn Communicator, dir: &Path, overwrite: bool) -> Result<Prepared> {
    let id = SaveId::random();
    let local = if comm.rank() == 0 {
        commit::try_lock(dir)
            .and_then(|lock| {
                let t = commit::prepare_target(dir, overwrite, id, &lock)?;
                commit::write_nonce(&t, id)?;
                Ok((Some(lock), Some(t)))
            })
            .map_err(Error::from)
    } else {
        Ok((None, None))
    };
    let (lock, target) = agree(comm, local)?;
    let mut msg = id.0.to_vec();
    msg.push(u8::from(matches!(target, Some(Target::Staging { .. }))));
    let got = comm.broadcast(0, &msg)?;
    let (id, staged) = match got.as_slice() {
        [b @ .., s] if b.len() == 16 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(b);
            (SaveId(a), *s == 1)
        }
        _ => {
            return Err(Error::RemoteFailure {
                rank: 0,
                message: "malformed save id broadcast".into(),
            });
        }
    };
    let target = target.unwrap_or_else(|| Target::new(dir, id, staged));
    let seen = comm.all_gather(&[u8::from(commit::sees_nonce(&target, id))])?;
    let ranks: Vec<usize> = (0..seen.len()).filter(|&r| seen[r] != [1]).collect();
    let prepared = Prepared { id, target, lock };
    if !ranks.is_empty() {
        commit::abandon(&prepared.target, prepared.lock.as_ref());
        return Err(Error::StorageNotShared {
            path: prepared.target.write_dir().to_owned(),
            ranks,
        });
    }
    Ok(prepared)
}

/// Writes this rank's files into the prepared target and commits (rank 0).
fn save_into(
    comm: &dyn Communicator,
    prepared: &Prepared,
    plan: &SavePlan,
    tasks: &RankTasks,
    local: &HashMap<(&TensorKey, &Region), &ShardedTensor<'_>>,
    opts: &SaveOptions,
) -> Result<(u64, u64)> {
    let dir = prepared.target.write_dir();
    let rank = comm.rank();

    let received = if plan.tensors.iter().any(|t| !t.aligned) {
        // Agreed on, so that a rank whose exchange failed cannot fall out of step with the
        // others' next collective.
        agree(comm, exchange_parts(comm, plan, tasks, local))?
    } else {
        vec![Vec::new(); tasks.writes.len()]
    };
    let groups = if rank == 0 {
        commit::write_groups(dir, plan.tensors.iter().map(|t| &t.key)).map_err(Error::from)
    } else {
        Ok(())
    };
    let written =
        groups.and_then(|()| write_files(dir, plan, tasks, local, &received, opts, prepared.id));
    let (data_bytes, file_bytes) = agree(comm, written)?;

    let committed = if rank == 0 {
        let mut meta = CheckpointMeta::new(comm.world_size() as u64);
        meta.user = opts.user_metadata.clone();
        for tp in &plan.tensors {
            meta.tensors
                .insert(tp.key.clone(), entry_of(tp, opts.compression));
        }
        match &prepared.lock {
            Some(lock) => {
                commit::commit_target(&prepared.target, &meta.with_save_id(prepared.id), lock)
                    .map_err(Error::from)
            }
            None => Ok(()),
        }
    } else {
        Ok(())
    };
    agree(comm, committed)?;
    Ok((data_bytes, file_bytes))
}
