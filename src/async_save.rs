//! Asynchronous saves and repeated saves of the same structure: [`Saver`].
//!
//! A [`Saver`] owns what repeated saves share: the communicator, a bounded staging pool
//! reused from save to save, and the plan the ranks last agreed on.
//!
//! [`Saver::save_async`] plans (collectively, reusing the last plan when no rank's structure
//! changed), copies the chunks this rank writes into staging memory, hands them to a
//! background thread and returns a [`SaveHandle`]. The background thread writes the shard
//! files, makes them durable and takes part in the commit; its outcome, including any error,
//! comes back from [`SaveHandle::wait`]. A save that fails on any rank commits nothing.
//!
//! # Who may use the communicator when
//! The communicator is shared (`Arc<dyn Communicator>`) between the caller and the
//! background thread, and collectives must not overlap (see [`crate::comm`]). The rule: from
//! the moment `save_async` is called until its save is done ([`SaveHandle::is_done`] or
//! [`Saver::is_busy`] false, or [`SaveHandle::wait`] returned), the background thread owns
//! the communicator and the caller must not start any collective on it; training
//! collectives belong on another communicator (as with `torch.distributed` process groups).
//! The `Saver` itself keeps the rule: a new save on it first waits for (or, with
//! [`IfBusy::Fail`], refuses to start while) the previous one is in flight.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::model::copy::{byte_offset, is_contiguous};
use crate::model::{ShardedTensor, StateObject};
use crate::plan::cache::CachedPlan;
use crate::plan::ruled::RankPlan;
use crate::plan::save::{RankTasks, SavePlan, Source};
use crate::save::{self as steps, AgreedLayout, SaveOptions, SaveReport};
use crate::stage::{self, ItemSource, Lease, StagingPool};
use crate::storage::{fsio, write};

/// What a new save does while the previous asynchronous save of the same [`Saver`] is still
/// in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IfBusy {
    /// Wait until the previous save is done, then start (the default).
    #[default]
    Wait,
    /// Return [`Error::SaveInFlight`] at once, starting nothing. The check is local to the
    /// rank: ranks finish a save within moments of each other (its last step is collective),
    /// but a rank that gets this error must make sure the others do not go on saving
    /// without it (they would time out), e.g. by all ranks skipping this save.
    Fail,
}

/// How a [`Saver`] stages.
#[derive(Debug, Clone)]
pub struct SaverOptions {
    /// Cap on staging memory, in bytes (default 4 GiB). A rank's chunks beyond it are staged
    /// in rounds, the caller waiting only for the writes that free the memory it needs next.
    /// The pool may exceed the cap only to hold one chunk larger than half of it.
    pub staging_bytes: u64,
    /// Threads copying into staging memory; 0 picks the machine's cores (at most 8).
    pub copy_threads: usize,
    /// What a save does while the previous one is still in flight.
    pub if_busy: IfBusy,
    /// Run the background writer's threads at a lower CPU priority (nice +10 on Linux), so
    /// that they yield to the training job (and to other ranks still staging) when cores
    /// are scarce (on by default). On a machine shared with other jobs it also yields to
    /// them, and the write may take longer.
    pub lower_priority: bool,
}

impl Default for SaverOptions {
    fn default() -> Self {
        SaverOptions {
            staging_bytes: stage::DEFAULT_STAGING_BYTES,
            copy_threads: 0,
            if_busy: IfBusy::Wait,
            lower_priority: true,
        }
    }
}

/// The shared outcome of one background save.
#[derive(Debug, Default)]
struct Job {
    state: Mutex<JobState>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct JobState {
    finished: bool,
    result: Option<Result<SaveReport>>,
}

impl Job {
    fn lock(&self) -> MutexGuard<'_, JobState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn finish(&self, result: Result<SaveReport>) {
        let mut s = self.lock();
        if !s.finished {
            s.finished = true;
            s.result = Some(result);
        }
        drop(s);
        self.done.notify_all();
    }

    fn is_finished(&self) -> bool {
        self.lock().finished
    }

    fn wait_finished(&self) -> MutexGuard<'_, JobState> {
        let mut s = self.lock();
        while !s.finished {
            s = self
                .done
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        s
    }
}

/// Marks the job failed if the background thread ends without finishing it (it unwound).
struct Finisher {
    job: Arc<Job>,
    rank: usize,
    path: PathBuf,
}

impl Drop for Finisher {
    fn drop(&mut self) {
        self.job.finish(Err(Error::Background {
            rank: self.rank,
            path: self.path.clone(),
            detail: "the background writer stopped unexpectedly".into(),
        }));
    }
}

/// An asynchronous save in flight.
#[derive(Debug)]
#[must_use = "an asynchronous save's outcome is only known from `wait`"]
pub struct SaveHandle {
    job: Arc<Job>,
    blocked: Duration,
    staged_bytes: u64,
}

impl SaveHandle {
    /// True once the background work (writing, fsync, commit) is over, successfully or not.
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.job.is_finished()
    }

    /// Waits for the save to finish and returns its report.
    ///
    /// # Errors
    /// Whatever the save failed with on this rank, or [`Error::RemoteFailure`] when another
    /// rank failed; nothing was committed then.
    pub fn wait(self) -> Result<SaveReport> {
        let mut s = self.job.wait_finished();
        s.result.take().unwrap_or_else(|| {
            Err(Error::Background {
                rank: 0,
                path: PathBuf::new(),
                detail: "the outcome was already taken".into(),
            })
        })
    }

    /// How long the call that started this save kept its caller (planning and staging).
    #[must_use]
    pub fn blocked(&self) -> Duration {
        self.blocked
    }

    /// Bytes this rank copied into staging memory.
    #[must_use]
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }
}

/// One round of staged chunks on its way to the writer.
struct StagedRound {
    lease: Lease,
    /// (index into the rank's writes, range in the arena).
    items: Vec<(usize, Range<usize>)>,
}

/// Saves repeatedly on one communicator: synchronously ([`Saver::save`]) or in the
/// background ([`Saver::save_async`]), reusing the agreed plan while the structure is
/// unchanged and the staging memory from save to save. Every rank creates its own `Saver`
/// on its own communicator and calls the same methods in the same order.
///
/// While an asynchronous save is in flight its background thread owns the communicator: the
/// caller must not start collectives on it until [`SaveHandle::is_done`] (or
/// [`Saver::is_busy`] is false, or [`SaveHandle::wait`] returned); use another communicator
/// for training. Dropping the handle or the saver does not stop a save in flight.
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
/// use zarrckpt::{Communicator, SaveOptions, Saver, ShardedTensor, run_local};
///
/// run_local(2, Duration::from_secs(60), |comm| {
///     let comm: Arc<dyn Communicator> = Arc::new(comm);
///     let r = comm.rank() as u64;
///     let mut saver = Saver::new(Arc::clone(&comm));
///     let mut weights = vec![r as f32; 6];
///     for step in 0..3 {
///         let piece = ShardedTensor::from_slice("w", &[4, 3], &[2 * r, 0], &weights, &[2, 3], 0)?;
///         let dir = format!("ckpt/step-{step}");
///         let handle = saver.save_async(&[piece], dir.as_ref(), &SaveOptions::default())?;
///         weights.iter_mut().for_each(|w| *w += 1.0); // training goes on at once
///         handle.wait()?; // or poll `handle.is_done()` and wait later
///     }
///     Ok::<(), zarrckpt::Error>(())
/// });
/// ```
pub struct Saver {
    comm: Arc<dyn Communicator>,
    opts: SaverOptions,
    pool: Arc<StagingPool>,
    threads: Option<Arc<rayon::ThreadPool>>,
    cache: Option<CachedPlan>,
    in_flight: Option<(Arc<Job>, PathBuf)>,
}

impl std::fmt::Debug for Saver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saver")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("opts", &self.opts)
            .field("busy", &self.is_busy())
            .finish_non_exhaustive()
    }
}

impl Saver {
    /// A saver on `comm` with default options.
    #[must_use]
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self::with_options(comm, SaverOptions::default())
    }

    /// A saver on `comm` with `opts`. Allocates nothing until the first save.
    #[must_use]
    pub fn with_options(comm: Arc<dyn Communicator>, opts: SaverOptions) -> Self {
        Saver {
            pool: Arc::new(StagingPool::new(opts.staging_bytes)),
            comm,
            opts,
            threads: None,
            cache: None,
            in_flight: None,
        }
    }

    /// The communicator (free for other collectives only while no save is in flight).
    #[must_use]
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// True while an asynchronous save started by this saver is still running.
    #[must_use]
    pub fn is_busy(&self) -> bool {
        self.in_flight.as_ref().is_some_and(|j| !j.0.is_finished())
    }

    /// Bytes of staging memory the saver holds between saves.
    #[must_use]
    pub fn staging_bytes_held(&self) -> usize {
        self.pool.held_bytes()
    }

    /// Applies the busy policy: waits for the previous save, or refuses to start.
    fn settle(&mut self) -> Result<()> {
        if let Some((job, path)) = &self.in_flight
            && !job.is_finished()
        {
            if self.opts.if_busy == IfBusy::Fail {
                return Err(Error::SaveInFlight {
                    rank: self.comm.rank(),
                    path: path.clone(),
                });
            }
            drop(job.wait_finished());
        }
        self.in_flight = None;
        // The writer drops its last arena just after finishing the job.
        self.pool.wait_idle();
        Ok(())
    }

    fn threads(&mut self) -> Result<Arc<rayon::ThreadPool>> {
        if let Some(t) = &self.threads {
            return Ok(Arc::clone(t));
        }
        let t = Arc::new(
            stage::copy_pool(self.opts.copy_threads)
                .map_err(|e| Error::ThreadPool(e.to_string()))?,
        );
        self.threads = Some(Arc::clone(&t));
        Ok(t)
    }

    /// Saves synchronously, as [`crate::save()`], reusing the agreed plan while no rank's
    /// structure changed.
    ///
    /// # Errors
    /// As [`crate::save()`]; [`Error::SaveInFlight`] as [`Saver::save_async`].
    pub fn save(
        &mut self,
        pieces: &[ShardedTensor<'_>],
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveReport> {
        // A save still in flight fails here, before any collective: the background thread
        // of that save may be using the communicator (IfBusy::Fail), and two collectives must
        // never interleave on it. A rank that is not busy then fails in the agreement within
        // the communicator's timeout.
        self.settle()?;
        let ready = Ok(());
        // Flat pieces are saved as the boxes of their decomposition.
        let boxed = crate::model::tensor::boxed_pieces(pieces);
        let pieces = &boxed[..];
        let agreed =
            steps::agree_on_layout_cached(ready, pieces, &*self.comm, opts, &mut self.cache)?;
        steps::save_agreed(dir, &*self.comm, opts, &agreed, None)
    }

    /// Saves synchronously with objects, as [`crate::save_with_objects`], reusing the agreed
    /// plan while no rank's structure changed. Every rank calls it (or every rank
    /// [`Saver::save`]) for a given save; an empty `objects` is fine.
    ///
    /// # Errors
    /// As [`crate::save_with_objects`]; [`Error::SaveInFlight`] as [`Saver::save_async`].
    pub fn save_with_objects(
        &mut self,
        pieces: &[ShardedTensor<'_>],
        objects: &[StateObject],
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveReport> {
        // A save still in flight fails here, before any collective: the background thread
        // of that save may be using the communicator (IfBusy::Fail), and two collectives must
        // never interleave on it. A rank that is not busy then fails in the agreement within
        // the communicator's timeout.
        self.settle()?;
        let ready = Ok(());
        // Flat pieces are saved as the boxes of their decomposition.
        let boxed = crate::model::tensor::boxed_pieces(pieces);
        let pieces = &boxed[..];
        let agreed =
            steps::agree_on_layout_cached(ready, pieces, &*self.comm, opts, &mut self.cache)?;
        let objects = crate::objects::agree_on_objects(objects, &*self.comm)?;
        let mut report = steps::save_agreed(dir, &*self.comm, opts, &agreed, Some(&objects))?;
        report.gathered_bytes += objects.gathered_bytes;
        Ok(report)
    }

    /// Starts a save and returns once this rank's part of the state is staged in host memory;
    /// writing, fsync and commit go on in the background. The caller may change or free its
    /// tensors as soon as this returns: what is saved is what they held during the call.
    ///
    /// # Errors
    /// Planning errors as [`crate::save()`] (an invalid layout, a rank that died) are returned
    /// here; errors of the background work come from [`SaveHandle::wait`].
    /// [`Error::SaveInFlight`] when the previous save is still in flight and the policy is
    /// [`IfBusy::Fail`].
    pub fn save_async(
        &mut self,
        pieces: &[ShardedTensor<'_>],
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        self.start(pieces, None, dir, opts)
    }

    /// [`Saver::save_async`] with objects (non-tensor state, as [`crate::save_with_objects`]):
    /// they are copied during the call, so the caller may change them once it returns, and
    /// agreed on and written in the background with the tensors, in the same commit. Every
    /// rank calls it (or every rank [`Saver::save_async`]) for a given save.
    ///
    /// # Errors
    /// As [`Saver::save_async`]; objects that do not agree across ranks fail the save on
    /// every rank, from [`SaveHandle::wait`].
    pub fn save_async_with_objects(
        &mut self,
        pieces: &[ShardedTensor<'_>],
        objects: &[StateObject],
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        self.start(pieces, Some(objects.to_vec()), dir, opts)
    }

    fn start(
        &mut self,
        pieces: &[ShardedTensor<'_>],
        objects: Option<Vec<StateObject>>,
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        let t0 = Instant::now();
        // A save still in flight fails here, before any collective (see `save`); a copy pool
        // that cannot start fails every rank, in the first agreement.
        self.settle()?;
        let ready = self.threads();
        let comm = Arc::clone(&self.comm);
        let rank = comm.rank();
        // Flat pieces are saved as the boxes of their decomposition.
        let boxed = crate::model::tensor::boxed_pieces(pieces);
        let pieces = &boxed[..];
        let (threads, ready) = match ready {
            Ok(t) => (Some(t), Ok(())),
            Err(e) => (None, Err(e)),
        };
        let agreed = steps::agree_on_layout_cached(ready, pieces, &*comm, opts, &mut self.cache)?;
        let threads = threads.ok_or_else(|| Error::ThreadPool("no copy pool".into()))?;
        let plan = Arc::clone(&agreed.plan);
        let tasks = plan.tasks.clone();
        // Unaligned parts travel now, from the caller's buffers, while the communicator is
        // still the caller's; what arrives is staged with the rest.
        let received = steps::exchange_unaligned(&*comm, &agreed, &tasks)?;
        let items = stage_sources(&plan.plan, &tasks, &agreed.local, &received);
        let sizes: Vec<usize> = items.iter().map(item_len).collect();
        let rounds = stage::pack(&sizes, self.pool.arena_cap());

        let job = Arc::new(Job::default());
        let (tx, rx) = sync_channel::<StagedRound>(stage::ARENAS);
        let bg = Background {
            comm,
            dir: dir.to_owned(),
            plan: Arc::clone(&plan),
            tasks: tasks.clone(),
            opts: opts.clone(),
            report: ReportParts::of(&agreed),
            lower_priority: self.opts.lower_priority,
            objects,
        };
        let finisher = Finisher {
            job: Arc::clone(&job),
            rank,
            path: dir.to_owned(),
        };
        std::thread::Builder::new()
            .name(format!("zarrckpt-save-{rank}"))
            .spawn(move || {
                let result = bg.run(rx);
                finisher.job.finish(result);
                drop(finisher);
            })
            .map_err(|e| Error::Background {
                rank,
                path: dir.to_owned(),
                detail: format!("could not start the background writer: {e}"),
            })?;
        self.in_flight = Some((Arc::clone(&job), dir.to_owned()));
        let staged = stage_rounds(&self.pool, &threads, &items, &sizes, &rounds, &tx);
        drop(tx);
        Ok(SaveHandle {
            job,
            blocked: t0.elapsed(),
            staged_bytes: staged,
        })
    }
}

fn item_len(item: &ItemSource<'_>) -> usize {
    match item {
        ItemSource::Bytes(b) => b.len(),
        ItemSource::Parts { full, elem, .. } => {
            // Invariant: a chunk box of a planned tensor, whose element count fits `u64`.
            crate::model::usize_of(full.num_elements().unwrap_or(0)) * elem
        }
    }
}

/// Where each chunk this rank writes comes from: a contiguous run of a local piece, or a box
/// assembled from local pieces and received parts (zero-padded at the tensor's edge).
fn stage_sources<'a>(
    plan: &'a SavePlan,
    tasks: &'a RankTasks,
    local: &'a steps::PieceIndex<'a, 'a>,
    received: &'a [Vec<Vec<u8>>],
) -> Vec<ItemSource<'a>> {
    tasks
        .writes
        .iter()
        .zip(received.iter().map(Some).chain(std::iter::repeat(None)))
        .map(|(w, recv)| {
            let tp = &plan.tensors[w.tensor];
            let elem = tp.dtype.size();
            let full = steps::full_chunk_box(tp, &w.chunk);
            if let [part] = w.parts.as_slice()
                && let Source::Local(piece_region) = &part.source
                && w.region == full
                && let Some(piece) = local.get(&(&tp.key, piece_region))
            {
                if is_contiguous(full.shape(), piece_region.shape()) {
                    let rel: Vec<u64> = full
                        .offset()
                        .iter()
                        .zip(piece_region.offset())
                        .map(|(a, b)| a - b)
                        .collect();
                    let start = byte_offset(&rel, piece_region.shape(), elem);
                    // Invariant: inside the piece, whose bytes are in memory.
                    let len = crate::model::usize_of(full.num_elements().unwrap_or(0)) * elem;
                    return ItemSource::Bytes(&piece.data()[start..start + len]);
                }
                return ItemSource::Parts {
                    parts: vec![(piece.data(), piece.region(), full.clone())],
                    full,
                    elem,
                    covered: true,
                };
            }
            let mut remote = recv.into_iter().flatten();
            let parts = w
                .parts
                .iter()
                .filter_map(|part| match &part.source {
                    Source::Local(piece_region) => local
                        .get(&(&tp.key, piece_region))
                        .map(|p| (p.data(), p.region(), part.region.clone())),
                    Source::Remote(_) => remote
                        .next()
                        .map(|d| (d.as_slice(), &part.region, part.region.clone())),
                })
                .collect();
            ItemSource::Parts {
                full,
                elem,
                covered: false,
                parts,
            }
        })
        .collect()
}

/// Copies the rounds into arenas and sends them to the writer; stops early if the writer
/// gave up (its error comes from `wait`). Returns the bytes staged.
fn stage_rounds(
    pool: &Arc<StagingPool>,
    threads: &rayon::ThreadPool,
    items: &[ItemSource<'_>],
    sizes: &[usize],
    rounds: &[Range<usize>],
    tx: &SyncSender<StagedRound>,
) -> u64 {
    let mut staged = 0u64;
    for round in rounds {
        let mut at = 0usize;
        let ranges: Vec<Range<usize>> = sizes[round.clone()]
            .iter()
            .map(|&s| {
                let r = at..at + s;
                at += s;
                r
            })
            .collect();
        let mut lease = pool.take(at);
        stage::fill(lease.bytes_mut(), &ranges, &items[round.clone()], threads);
        staged += at as u64;
        let items = round.clone().zip(ranges).collect();
        if tx.send(StagedRound { lease, items }).is_err() {
            break;
        }
    }
    staged
}

/// What the report says about planning (the plan itself travels separately).
struct ReportParts {
    plan_time: Duration,
    gathered_bytes: u64,
    plan_reused: bool,
    balance: f64,
}

impl ReportParts {
    fn of(agreed: &AgreedLayout<'_, '_>) -> Self {
        ReportParts {
            plan_time: agreed.plan_time,
            gathered_bytes: agreed.gathered_bytes,
            plan_reused: agreed.reused,
            balance: agreed.balance,
        }
    }
}

/// The background half of an asynchronous save: everything after staging.
struct Background {
    comm: Arc<dyn Communicator>,
    dir: PathBuf,
    plan: Arc<RankPlan>,
    tasks: RankTasks,
    opts: SaveOptions,
    report: ReportParts,
    lower_priority: bool,
    /// The objects, copied when the save started; agreed on and written here.
    objects: Option<Vec<StateObject>>,
}

/// The nice value of background writer threads with [`SaverOptions::lower_priority`].
const BACKGROUND_NICE: libc::c_int = 10;

/// Lowers the calling thread's CPU priority (Linux: the nice value is per thread).
fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid has no preconditions; setpriority with PRIO_PROCESS and a thread id
    // changes only that thread's nice value, and a failure (e.g. forbidden) changes nothing.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(
            libc::PRIO_PROCESS,
            // A thread id is positive; 0 would name the calling thread all the same.
            libc::id_t::try_from(tid).unwrap_or_default(),
            BACKGROUND_NICE,
        );
    }
}

/// The background writer's I/O threads.
fn writer_pool(threads: usize, lower_priority: bool) -> Result<rayon::ThreadPool> {
    crate::coord::pool_builder(threads, "bg-io")
        .start_handler(move |_| {
            if lower_priority {
                lower_thread_priority();
            }
        })
        .build()
        .map_err(|e| Error::ThreadPool(e.to_string()))
}

impl Background {
    fn run(self, rx: Receiver<StagedRound>) -> Result<SaveReport> {
        if self.lower_priority {
            lower_thread_priority();
        }
        let comm = &*self.comm;
        let objects = match self
            .objects
            .as_deref()
            .map(|o| crate::objects::agree_on_objects(o, comm))
            .transpose()
        {
            Ok(o) => o,
            Err(e) => {
                drop(rx);
                return Err(e);
            }
        };
        let prepared = match steps::prepare_directory(
            &self.dir,
            comm,
            &self.plan.plan,
            objects.as_ref(),
            &self.opts,
        ) {
            Ok(p) => p,
            Err(e) => {
                drop(rx);
                return Err(e);
            }
        };
        let rank = u32::try_from(comm.rank()).unwrap_or(u32::MAX);
        let written = self
            .write_rounds(rx, &prepared)
            .and_then(|(data, files)| match &objects {
                Some(o) => Ok((
                    data,
                    files + crate::objects::write_values(prepared.dir(), rank, o, prepared.id)?,
                )),
                None => Ok((data, files)),
            });
        let outcome = agree(comm, written).and_then(|totals| {
            steps::commit_index(
                comm,
                &prepared,
                &self.plan.plan,
                objects.as_ref(),
                &self.opts,
            )?;
            Ok(totals)
        });
        if outcome.is_err() {
            prepared.abandon();
        }
        let (data_bytes, file_bytes) = outcome?;
        Ok(SaveReport {
            tensors: self.plan.plan.tensors.len(),
            chunks_written: self.tasks.writes.len(),
            data_bytes,
            file_bytes,
            write_balance: self.report.balance,
            assigned_bytes: self.plan.bytes,
            plan_time: self.report.plan_time,
            gathered_bytes: self.report.gathered_bytes
                + objects.as_ref().map_or(0, |o| o.gathered_bytes),
            plan_reused: self.report.plan_reused,
        })
    }

    /// Writes the staged rounds as they come; the receiver is dropped on return, so a caller
    /// waiting for staging memory is released even when writing failed.
    fn write_rounds(
        &self,
        rx: Receiver<StagedRound>,
        prepared: &steps::Prepared,
    ) -> Result<(u64, u64)> {
        let (plan, tasks, opts) = (&self.plan.plan, &self.tasks, &self.opts);
        let arrays = steps::open_arrays(prepared.dir(), plan, tasks, opts, prepared.id)?;
        let pool = writer_pool(opts.io_threads, self.lower_priority)?;
        let dirs = pool.install(|| steps::write_array_documents(tasks, &arrays))?;
        let (mut data, mut files, mut done) = (0u64, 0u64, 0usize);
        for round in rx {
            let (d, f) = pool.install(|| -> Result<(u64, u64)> {
                let totals = round
                    .items
                    .par_iter()
                    .map(|(wi, range)| -> Result<(u64, u64)> {
                        let w = &tasks.writes[*wi];
                        let tp = &plan.tensors[w.tensor];
                        let full = steps::full_chunk_box(tp, &w.chunk);
                        let src = &round.lease.bytes()[range.clone()];
                        let n =
                            write::write_shard(&arrays[&w.tensor], &w.chunk, src, &full, &full)?;
                        // Invariant: a planned region lies inside its tensor.
                        let d = w.region.num_elements().unwrap_or(0) * tp.dtype.size() as u64;
                        if let Some(p) = &opts.progress {
                            p(d);
                        }
                        Ok((d, n))
                    })
                    .try_reduce(|| (0, 0), |a, b| Ok((a.0 + b.0, a.1 + b.1)))?;
                round.items.par_iter().try_for_each(|(wi, _)| {
                    let w = &tasks.writes[*wi];
                    write::sync_file(&arrays[&w.tensor].chunk_path(&w.chunk))
                })?;
                Ok(totals)
            })?;
            data += d;
            files += f;
            done += round.items.len();
        }
        if done != tasks.writes.len() {
            return Err(Error::Background {
                rank: self.comm.rank(),
                path: self.dir.clone(),
                detail: format!(
                    "{done} of {} staged chunks reached the writer",
                    tasks.writes.len()
                ),
            });
        }
        pool.install(|| dirs.par_iter().try_for_each(|d| fsio::fsync_dir(d)))?;
        Ok((data, files))
    }
}
