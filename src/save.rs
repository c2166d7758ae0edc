//! The collective save: agreeing on the layout, preparing the directory, writing the shard
//! files and committing ([`save`] and [`crate::Saver`] run these steps), and the one value a
//! rank saves ([`SaveRequest`]).

mod files;
#[cfg(feature = "object-store")]
mod remote;
mod request;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::{Communicator, RecvBuf, SendBuf};
use crate::coord::{BoxDecl, agree, all_reduce_u64, combine, describe, rank_layout};
use crate::device::{Device, DevicePiece};
use crate::error::{Error, Result};
use crate::model::copy::copy_region;
use crate::model::{Region, ShardedTensor, StateObject, TensorKey};
use crate::objects::AgreedObjects;
use crate::plan::GridOptions;
use crate::plan::cache::{self, CachedPlan};
use crate::plan::layout::RankLayout;
use crate::plan::ruled::{RankPlan, plan_save};
use crate::plan::save::{ChunkWrite, RankTasks, SavePlan, SavePlanOptions, Source, TensorPlan};
use crate::storage::commit::{SaveLock, Target};
use crate::storage::footer::SaveId;
use crate::storage::meta::tensor_path;
use crate::storage::{CheckpointMeta, Compression, TensorEntry, commit};

pub use crate::coord::Progress;
use files::write_files_to;
pub(crate) use files::{Arrays, Destination, writer_threads};
pub use request::SaveRequest;

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
    /// The longest a save to an object store may take: a write that would start later fails
    /// (naming its object), and every rank returns an error naming the rank that failed.
    /// `None`: no deadline beyond each request's own timeouts.
    pub deadline: Option<Duration>,
    /// How a save to an object-store URL (`s3://bucket/prefix`, `gs://`, `az://`,
    /// `memory://`) reaches the store: endpoint, credentials (over the environment), multipart
    /// threshold, part size and parts in flight, retries.
    #[cfg(feature = "object-store")]
    pub remote: crate::storage::remote::RemoteOptions,
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
            deadline: None,
            #[cfg(feature = "object-store")]
            remote: crate::storage::remote::RemoteOptions::default(),
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
            .field("deadline", &self.deadline)
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
    /// Tensor bytes this rank was assigned to write.
    pub assigned_bytes: u64,
    /// Largest assigned bytes of a rank over the mean (1.0 is perfect balance).
    pub write_balance: f64,
    /// Time spent agreeing on the layout and planning.
    pub plan_time: Duration,
    /// Size of the world's layout description this rank received (the all-reduce's result),
    /// plus the objects' declarations.
    pub gathered_bytes: u64,
    /// True when the ranks found the structure unchanged since the last save of the same
    /// [`crate::Saver`] and reused its plan after a constant-size check.
    pub plan_reused: bool,
}

/// Local pieces by (key, region).
pub(crate) type PieceIndex<'p, 'a> = HashMap<(&'p TensorKey, &'p Region), &'p ShardedTensor<'a>>;

/// Local pieces in device memory by (key, region).
pub(crate) type DeviceIndex<'p> = HashMap<(&'p TensorKey, &'p Region), &'p DevicePiece>;

/// What a rank saves, borrowed: host pieces (boxes only), device pieces and their device.
#[derive(Clone, Copy)]
pub(crate) struct Sources<'p, 'a> {
    pub(crate) host: &'p [ShardedTensor<'a>],
    pub(crate) device: &'p [DevicePiece],
    pub(crate) reader: Option<&'p Arc<dyn Device>>,
}

impl<'p, 'a> Sources<'p, 'a> {
    /// Host pieces only.
    pub(crate) fn host(host: &'p [ShardedTensor<'a>]) -> Self {
        Sources {
            host,
            device: &[],
            reader: None,
        }
    }
}

/// This rank's layout, and indexes from (key, region) to its local pieces.
fn local_layout<'p, 'a>(
    src: Sources<'p, 'a>,
) -> Result<(RankLayout, PieceIndex<'p, 'a>, DeviceIndex<'p>)> {
    let twice = |key: &TensorKey, region: &Region| Error::InconsistentPieces {
        key: key.clone(),
        detail: format!("this rank holds the piece {region} twice"),
    };
    let mut by_box = HashMap::with_capacity(src.host.len());
    for p in src.host {
        if by_box.insert((p.key(), p.region()), p).is_some() {
            return Err(twice(p.key(), p.region()));
        }
    }
    let mut on_device = HashMap::with_capacity(src.device.len());
    for p in src.device {
        if by_box.contains_key(&(p.key(), p.region()))
            || on_device.insert((p.key(), p.region()), p).is_some()
        {
            return Err(twice(p.key(), p.region()));
        }
    }
    let host = src.host.iter().map(|p| BoxDecl {
        key: p.key(),
        dtype: p.dtype(),
        global_shape: p.global_shape(),
        region: p.region(),
        main: p.is_main(),
        auto: p.is_auto_replica(),
    });
    let device = src.device.iter().map(|p| BoxDecl {
        key: p.key(),
        dtype: p.dtype(),
        global_shape: p.global_shape(),
        region: p.region(),
        main: p.replica() == crate::model::Replica::Id(0),
        auto: p.replica() == crate::model::Replica::Auto,
    });
    let layout = rank_layout(host.chain(device), "pieces")?;
    Ok((layout, by_box, on_device))
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
pub(crate) fn full_chunk_box(tp: &TensorPlan, chunk: &[u64]) -> Region {
    crate::plan::grid::chunk_box(&tp.chunk_shape, chunk)
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
    let len = full.shape().iter().product::<u64>() as usize * elem;
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

/// Reads a box of a device piece into host memory (the saver's staging does it).
pub(crate) type Download<'d> = &'d mut dyn FnMut(&DevicePiece, &Region) -> Result<Vec<u8>>;

/// The bytes of `region` of a local piece, for a peer: copied from a host piece, or
/// downloaded from a device piece.
fn send_bytes(
    agreed: &AgreedLayout<'_, '_>,
    download: &mut Option<Download<'_>>,
    key: &TensorKey,
    piece: &Region,
    region: &Region,
    elem: usize,
) -> Result<Vec<u8>> {
    if let Some(p) = agreed.local.get(&(key, piece)) {
        // Invariant: a planned region lies inside this rank's piece, held in memory.
        let len = crate::model::usize_of(region.num_elements().unwrap_or(0)) * elem;
        let mut buf = vec![0u8; len];
        copy_region(p.data(), piece, &mut buf, region, region, elem);
        return Ok(buf);
    }
    match (agreed.device.get(&(key, piece)), download) {
        (Some(p), Some(download)) => download(p, region),
        _ => Err(Error::InconsistentPieces {
            key: key.clone(),
            detail: format!("the plan sends part of {piece}, which this rank does not hold"),
        }),
    }
}

/// Sends and receives the parts of unaligned chunks. Returns, per write, the received parts
/// in order.
fn exchange_parts(
    comm: &dyn Communicator,
    agreed: &AgreedLayout<'_, '_>,
    tasks: &RankTasks,
    mut download: Option<Download<'_>>,
) -> Result<Vec<Vec<Vec<u8>>>> {
    let plan = &agreed.plan.plan;
    let mut outgoing: Vec<(usize, Vec<u8>)> = Vec::with_capacity(tasks.sends.len());
    for t in &tasks.sends {
        let tp = &plan.tensors[t.tensor];
        let buf = send_bytes(
            agreed,
            &mut download,
            &tp.key,
            &t.piece,
            &t.region,
            tp.dtype.size(),
        )?;
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
                // Invariant: a planned part lies inside a chunk of its tensor.
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

/// Saves this rank's pieces into the checkpoint at `dir`. Every rank of `comm` calls it.
///
/// A one-shot save of host tensors, written straight from the caller's buffers. It is
/// [`crate::Saver::save`] of a [`SaveRequest`] of these pieces, without a saver's state:
/// repeated saves, asynchronous saves, device pieces and objects go through a
/// [`crate::Saver`].
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
    save_direct(pieces, None, dir, comm, opts, None)
}

/// Saves tensor pieces as [`save`] does, and objects (non-tensor state: common, per-rank and
/// sharded values, JSON or bytes) in the same checkpoint and commit. Every rank calls it.
///
/// A shorthand kept for existing callers: the same as a one-shot [`crate::Saver::save`] of
/// `SaveRequest::new().with_tensors(..).with_objects(..)`.
///
/// Common objects must have the same value on every rank declaring them, per-rank objects
/// are declared by every rank, and every shard of a sharded object's grid by some rank (its
/// replicas agreeing); values are compared by digest, never silently picked.
///
/// # Errors
/// As [`save`], plus [`Error::Object`] for an invalid object and [`Error::ObjectPlan`] when
/// the ranks' objects disagree (naming the key and the ranks).
pub fn save_with_objects(
    pieces: &[ShardedTensor<'_>],
    objects: &[StateObject],
    dir: &Path,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    save_direct(pieces, Some(objects), dir, comm, opts, None)
}

/// A save of host pieces (and objects, when given) written straight from the caller's
/// buffers: [`save`], and [`crate::Saver::save`] of a request without device pieces (with
/// its plan cache).
pub(crate) fn save_direct(
    pieces: &[ShardedTensor<'_>],
    objects: Option<&[StateObject]>,
    dir: &Path,
    comm: &dyn Communicator,
    opts: &SaveOptions,
    cache: Option<&mut Option<CachedPlan>>,
) -> Result<SaveReport> {
    // Flat pieces are saved as the boxes of their decomposition.
    let boxed = crate::model::tensor::boxed_pieces(pieces);
    let src = Sources::host(&boxed);
    let agreed = match cache {
        Some(cached) => agree_on_layout_cached(Ok(()), src, comm, opts, cached)?,
        None => agree_on_layout(src, comm, opts)?,
    };
    let objects = objects
        .map(|o| crate::objects::agree_on_objects(o, comm))
        .transpose()?;
    // The same collectives in the same order as a staged save (`crate::Saver::save_async`):
    // ranks of one save may take either path (only some holding device pieces).
    let received = exchange_unaligned(comm, &agreed, &agreed.plan.tasks, None)?;
    let mut report = save_agreed(dir, comm, opts, &agreed, &received, objects.as_ref())?;
    report.gathered_bytes += objects.map_or(0, |o| o.gathered_bytes);
    Ok(report)
}

/// Steps 2, 4 and 5 of a save, once the ranks agreed on the plan (and on the objects, if any)
/// and the unaligned parts travelled (step 3, `received`): into a local directory or an
/// object store's fresh generation ([`Destination`]).
fn save_agreed(
    dir: &Path,
    comm: &dyn Communicator,
    opts: &SaveOptions,
    agreed: &AgreedLayout<'_, '_>,
    received: &[Vec<Vec<u8>>],
    objects: Option<&AgreedObjects<'_>>,
) -> Result<SaveReport> {
    let plan = &agreed.plan.plan;
    let dest = Destination::prepare(dir, comm, plan, objects, opts)?;
    let (data_bytes, file_bytes) =
        dest.write_and_commit(comm, plan, objects, opts, |store, root, id| {
            write_files_to(store, root, agreed, received, opts, id)
        })?;
    Ok(agreed.report(&agreed.plan.tasks, data_bytes, file_bytes))
}

/// This rank's share of the plan the ranks agreed on, and this rank's pieces.
pub(crate) struct AgreedLayout<'p, 'a> {
    pub(crate) plan: Arc<RankPlan>,
    pub(crate) local: PieceIndex<'p, 'a>,
    pub(crate) device: DeviceIndex<'p>,
    /// The device the device pieces are read from.
    pub(crate) reader: Option<&'p Arc<dyn Device>>,
    pub(crate) plan_time: Duration,
    pub(crate) gathered_bytes: u64,
    /// Largest assigned bytes of a rank over the mean.
    pub(crate) balance: f64,
    /// The plan of the previous save, found unchanged on every rank.
    pub(crate) reused: bool,
}

impl AgreedLayout<'_, '_> {
    /// The report of a save of this plan that wrote `tasks`.
    pub(crate) fn report(&self, tasks: &RankTasks, data_bytes: u64, file_bytes: u64) -> SaveReport {
        SaveReport {
            tensors: self.plan.plan.tensors.len(),
            chunks_written: tasks.writes.len(),
            data_bytes,
            file_bytes,
            assigned_bytes: self.plan.bytes,
            write_balance: self.balance,
            plan_time: self.plan_time,
            gathered_bytes: self.gathered_bytes,
            plan_reused: self.reused,
        }
    }
}

fn plan_options(opts: &SaveOptions) -> SavePlanOptions {
    SavePlanOptions {
        grid: opts.grid,
        balance_replicas: opts.balance_replicas,
    }
}

/// A rank's description (a one-rank summary) and its hash.
fn own_description(comm: &dyn Communicator, layout: &RankLayout) -> (Vec<u8>, [u8; 16]) {
    let leaf = describe(comm, layout);
    let hash = RankLayout::hash_bytes(&leaf);
    (leaf, hash)
}

/// The world's description, combined up the communicator's tree, and this rank's plan from
/// it. Returns the plan, the description's digest and size, and the write balance.
fn plan_from_world(
    comm: &dyn Communicator,
    leaf: &[u8],
    plan_opts: &SavePlanOptions,
) -> Result<(RankPlan, [u8; 16], u64, f64)> {
    let (world, combined) = combine(comm, leaf)?;
    let rank = u32::try_from(comm.rank()).unwrap_or(u32::MAX);
    let plan = plan_save(&world, rank, plan_opts)?;
    let digest = cache::world_digest(comm.world_size(), plan_opts, &combined);
    let balance = write_balance(comm, plan.bytes)?;
    Ok((plan, digest, combined.len() as u64, balance))
}

/// The largest bytes assigned to a rank over the mean, from one all-reduce of (max, sum).
fn write_balance(comm: &dyn Communicator, bytes: u64) -> Result<f64> {
    let v = all_reduce_u64(comm, &[bytes, bytes], &[u64::max, u64::saturating_add])?;
    let (max, sum) = (v[0], v[1]);
    Ok(if sum == 0 {
        1.0
    } else {
        max as f64 / (sum as f64 / comm.world_size().max(1) as f64)
    })
}

/// Step 1: every rank describes its pieces by rule, the descriptions are combined up the
/// communicator's tree (an all-reduce whose result grows with the distinct rules, not the
/// world), and every rank validates the same world and derives its own part of the plan.
fn agree_on_layout<'p, 'a>(
    src: Sources<'p, 'a>,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<AgreedLayout<'p, 'a>> {
    let t0 = Instant::now();
    let (layout, local, device) = agree(comm, local_layout(src))?;
    let (leaf, _) = own_description(comm, &layout);
    let (plan, _, gathered_bytes, balance) = plan_from_world(comm, &leaf, &plan_options(opts))?;
    Ok(AgreedLayout {
        plan: Arc::new(plan),
        local,
        device,
        reader: src.reader,
        plan_time: t0.elapsed(),
        gathered_bytes,
        balance,
        reused: false,
    })
}

/// Step 1 of a [`crate::Saver`]'s saves: as [`agree_on_layout`], reusing `cached` (the plan
/// of its previous save, if any) when no rank's structure changed.
///
/// After local errors are agreed on, one all-reduce of a constant-size message
/// ([`cache::CHECK_LEN`] bytes: whether the rank's own description is the one its plan was
/// built from, and that plan's digest) decides. When something changed, or there is no plan to
/// reuse, the ranks agree in full and the new plan replaces `cached`. A plan that did not
/// validate replaces nothing.
///
/// `ready` is what the caller found on this rank before (a save still in flight under
/// [`crate::IfBusy::Fail`], a thread pool that could not start): agreed on in the same first
/// collective, so that a rank failing there fails every rank.
pub(crate) fn agree_on_layout_cached<'p, 'a>(
    ready: Result<()>,
    src: Sources<'p, 'a>,
    comm: &dyn Communicator,
    opts: &SaveOptions,
    cached: &mut Option<CachedPlan>,
) -> Result<AgreedLayout<'p, 'a>> {
    let t0 = Instant::now();
    let plan_opts = plan_options(opts);
    let offered = cached
        .as_ref()
        .filter(|c| c.fits(comm.world_size(), &plan_opts));
    let (layout, local, device) = agree(comm, ready.and_then(|()| local_layout(src)))?;
    let (leaf, own) = own_description(comm, &layout);
    let check = cache::check_message(offered, own);
    let reduced = comm.all_reduce(&check, &cache::merge_checks)?;
    let mut gathered_bytes = reduced.len() as u64;
    let (plan, balance, reused) = match cache::reusable(offered, &reduced) {
        Some(c) => (Arc::clone(c.plan()), c.balance(), true),
        None => {
            let (plan, digest, bytes, balance) = plan_from_world(comm, &leaf, &plan_opts)?;
            gathered_bytes += bytes;
            let plan = Arc::new(plan);
            *cached = Some(CachedPlan::new(
                comm.world_size(),
                plan_opts,
                own,
                digest,
                Arc::clone(&plan),
                balance,
            ));
            (plan, balance, false)
        }
    };
    Ok(AgreedLayout {
        plan,
        local,
        device,
        reader: src.reader,
        plan_time: t0.elapsed(),
        gathered_bytes,
        balance,
        reused,
    })
}

/// Step 2 into a local directory: the target directory is prepared ([`prepare_target`]:
/// lock, save id, staging sibling or in place, same-storage check) and rank 0 writes the
/// group documents; every rank waits for the outcome. On error nothing is left to clean up.
fn prepare_directory(
    dir: &Path,
    comm: &dyn Communicator,
    plan: &SavePlan,
    objects: Option<&AgreedObjects<'_>>,
    opts: &SaveOptions,
) -> Result<Prepared> {
    // Every limit a reader enforces on the index is checked before anything is written
    // (rank 0 holds the user metadata the index stores).
    let checked = if comm.rank() == 0 {
        index_of(comm, plan, objects, opts, SaveId([0; 16]))
            .check_writable()
            .map_err(Error::from)
    } else {
        Ok(())
    };
    agree(comm, checked)?;
    let prepared = prepare_target(comm, dir, opts.overwrite, &opts.user_metadata)?;
    let groups = if comm.rank() == 0 {
        commit::write_groups(prepared.dir(), plan.tensors.iter().map(|t| &t.key))
            .map_err(Error::from)
            .and_then(|()| {
                objects.map_or(Ok(()), |o| crate::objects::write_groups(prepared.dir(), o))
            })
    } else {
        Ok(())
    };
    if let Err(e) = agree(comm, groups) {
        prepared.abandon();
        return Err(e);
    }
    Ok(prepared)
}

/// Step 3: the parts of chunks that are not aligned with pieces travel to their chunk's
/// writer (parts of device pieces read through `download`). Returns, per write of this rank,
/// the received parts in order.
pub(crate) fn exchange_unaligned(
    comm: &dyn Communicator,
    agreed: &AgreedLayout<'_, '_>,
    tasks: &RankTasks,
    download: Option<Download<'_>>,
) -> Result<Vec<Vec<Vec<u8>>>> {
    if agreed.plan.plan.tensors.iter().all(|t| t.aligned) {
        return Ok(vec![Vec::new(); tasks.writes.len()]);
    }
    // Agreed on, so that a rank whose exchange failed cannot fall out of step with the
    // others' next collective.
    agree(comm, exchange_parts(comm, agreed, tasks, download))
}

/// Step 5: once every rank's files are durable, rank 0 writes the index (with the save id)
/// and, for a save over an existing checkpoint, swaps the staging directory in: the commit.
fn commit_index(
    comm: &dyn Communicator,
    prepared: &Prepared,
    plan: &SavePlan,
    objects: Option<&AgreedObjects<'_>>,
    opts: &SaveOptions,
) -> Result<()> {
    let committed = match &prepared.lock {
        Some(lock) => {
            let meta = index_of(comm, plan, objects, opts, prepared.id);
            commit::commit_target(&prepared.target, &meta, lock).map_err(Error::from)
        }
        None => Ok(()),
    };
    agree(comm, committed)
}

/// The index a save commits (rank 0's user metadata).
fn index_of(
    comm: &dyn Communicator,
    plan: &SavePlan,
    objects: Option<&AgreedObjects<'_>>,
    opts: &SaveOptions,
    id: SaveId,
) -> CheckpointMeta {
    let mut meta = CheckpointMeta::new(comm.world_size() as u64);
    meta.user = opts.user_metadata.clone();
    if let Some(o) = objects {
        meta.objects = crate::objects::index_entries(o);
    }
    for tp in &plan.tensors {
        meta.tensors
            .insert(tp.key.clone(), entry_of(tp, opts.compression));
    }
    meta.with_save_id(id)
}

/// Where a save writes, as every rank learned it from rank 0.
pub(crate) struct Prepared {
    pub(crate) id: SaveId,
    target: Target,
    /// Rank 0's save lock, held until the save ends.
    lock: Option<SaveLock>,
}

impl Prepared {
    /// The directory this save writes into (the checkpoint's, or its staging sibling).
    pub(crate) fn dir(&self) -> &Path {
        self.target.write_dir()
    }

    /// Removes what a failed save wrote into a staging sibling (rank 0; a no-op elsewhere).
    pub(crate) fn abandon(&self) {
        commit::abandon(&self.target, self.lock.as_ref());
    }
}

/// Checks that every reader parses `user` back (spec section 4: the root `zarr.json` nests
/// at most [`crate::model::json::MAX_JSON_DEPTH`] levels, `user` sitting at level
/// [`crate::model::json::USER_LEVEL`]). Numbers are always in range: a
/// `serde_json::Value` holds only 64-bit integers and finite binary64 numbers.
fn check_user(dir: &Path, user: &serde_json::Map<String, serde_json::Value>) -> Result<()> {
    use crate::model::json::{MAX_JSON_DEPTH, USER_LEVEL, depth};
    let levels = user
        .values()
        .map(depth)
        .max()
        .unwrap_or(0) // an empty `user` has no nesting
        .saturating_add(USER_LEVEL);
    if levels > MAX_JSON_DEPTH {
        return Err(Error::UserMetadata {
            path: dir.to_owned(),
            reason: format!(
                "it nests {} levels deep counting itself; the root zarr.json may nest at most {MAX_JSON_DEPTH} levels, {} of them inside `user`",
                levels - USER_LEVEL + 1,
                MAX_JSON_DEPTH - USER_LEVEL + 1
            ),
        });
    }
    Ok(())
}

/// Rank 0 takes the save lock, draws the save id, prepares the target directory (spec §
/// "Commit protocol") and writes the nonce file there; every rank learns the id and target
/// and checks it sees the nonce file (same storage), before any data is written.
fn prepare_target(
    comm: &dyn Communicator,
    dir: &Path,
    overwrite: bool,
    user: &serde_json::Map<String, serde_json::Value>,
) -> Result<Prepared> {
    let id = SaveId::random();
    let local = if comm.rank() == 0 {
        check_user(dir, user)
            .and_then(|()| commit::try_lock(dir).map_err(Error::from))
            .and_then(|lock| {
                let t = commit::prepare_target(dir, overwrite, id, &lock)?;
                commit::write_nonce(&t, id)?;
                Ok((Some(lock), Some(t)))
            })
    } else {
        Ok((None, None))
    };
    // What rank 0 prepared is undone (a staging directory removed) when another rank fails
    // this agreement or the broadcast after it: nothing is left to clean up on error.
    let (outcome, held) = match local {
        Ok(held) => (Ok(()), Some(held)),
        Err(e) => (Err(e), None),
    };
    let undo = |held: &Option<(Option<commit::SaveLock>, Option<Target>)>| {
        if let Some((lock, Some(t))) = held {
            commit::abandon(t, lock.as_ref());
        }
    };
    if let Err(e) = agree(comm, outcome) {
        undo(&held);
        return Err(e);
    }
    let mut msg = id.0.to_vec();
    msg.push(u8::from(matches!(
        held,
        Some((_, Some(Target::Staging { .. })))
    )));
    let got = match comm.broadcast(0, &msg) {
        Ok(got) => got,
        Err(e) => {
            undo(&held);
            return Err(e.into());
        }
    };
    let (lock, target) = held.unwrap_or((None, None));
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
    // The ranks that do not see the nonce, as little-endian u64s (none, usually): an
    // all-reduce, so each rank receives a few bytes whatever the world size.
    let mine = if commit::sees_nonce(&target, id) {
        Vec::new()
    } else {
        (comm.rank() as u64).to_le_bytes().to_vec()
    };
    let unseen = comm.all_reduce(&mine, &|a, b| Ok([a, b].concat()))?;
    let mut ranks: Vec<usize> = unseen
        .chunks(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a[..c.len()].copy_from_slice(c);
            usize::try_from(u64::from_le_bytes(a)).unwrap_or(usize::MAX)
        })
        .collect();
    ranks.sort_unstable();
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
