//! The saver: [`Saver`], with [`Saver::save`] and [`Saver::save_async`] of a
//! [`SaveRequest`] (host tensors, device tensors, objects, or a nested state dict).
//!
//! A [`Saver`] owns what repeated saves share: the communicator, one bounded staging pool
//! reused from save to save (host memory, or page-locked memory of the device when the
//! request has device pieces), and the plan the ranks last agreed on.
//!
//! [`Saver::save_async`] plans (collectively, reusing the last plan when no rank's structure
//! changed) and agrees on the objects, so that every planning error (an invalid layout,
//! objects that disagree across ranks, a rank that died) is returned by the call itself;
//! then it copies (or downloads, from device memory) the chunks this rank writes into
//! staging memory, hands them to a background thread and returns a [`SaveHandle`]. The
//! background thread writes the shard files, makes them durable and takes part in the
//! commit; its outcome, including any I/O error, comes back from [`SaveHandle::wait`]. A
//! save that fails on any rank commits nothing. [`Saver::save`] writes host pieces straight
//! from the caller's buffers, and runs a request with device pieces through the same staging
//! as `save_async`, waiting for it.
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
use crate::objects::AgreedObjects;
use crate::plan::cache::CachedPlan;
use crate::plan::ruled::RankPlan;
use crate::plan::save::{RankTasks, SavePlan, Source};
use crate::save::{self as steps, AgreedLayout, SaveOptions, SaveReport, SaveRequest, Sources};
use crate::stage::{self, ItemSource, Lease, PartSource, StagingPool};
use crate::storage::footer::SaveId;
use crate::storage::store::Store;

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
    /// Cap on staging memory, in bytes (default 4 GiB), host or page-locked alike. A rank's
    /// chunks beyond it are staged in rounds, the caller waiting only for the writes that
    /// free the memory it needs next. The pool may exceed the cap only to hold one chunk
    /// larger than half of it (plus, for a chunk assembled from parts of device pieces, room
    /// to download those parts).
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
/// use zarrckpt::{Communicator, SaveOptions, SaveRequest, Saver, ShardedTensor, run_local};
///
/// run_local(2, Duration::from_secs(60), |comm| {
///     let comm: Arc<dyn Communicator> = Arc::new(comm);
///     let r = comm.rank() as u64;
///     let mut saver = Saver::new(Arc::clone(&comm));
///     let mut weights = vec![r as f32; 6];
///     for step in 0..3 {
///         let piece = ShardedTensor::from_slice("w", &[4, 3], &[2 * r, 0], &weights, &[2, 3], 0)?;
///         let dir = format!("ckpt/step-{step}");
///         let request = SaveRequest::new().with_tensors([piece]);
///         let handle = saver.save_async(&request, dir.as_ref(), &SaveOptions::default())?;
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

    /// Waits for a save in flight, if any (its outcome stays with its handle).
    pub(crate) fn wait_idle(&mut self) {
        if let Some((job, _)) = self.in_flight.take() {
            drop(job.wait_finished());
        }
        self.pool.wait_idle();
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

    /// Saves `request` into the checkpoint at `dir` and returns once it is committed. Every
    /// rank calls it (or every rank [`Saver::save_async`]) for a given save, with its own
    /// request, in the same order on every rank.
    ///
    /// Host pieces are written straight from the caller's buffers (as [`crate::save()`]);
    /// a request with device pieces runs through the saver's staging as
    /// [`Saver::save_async`] does, and waits for it. The agreed plan is reused while no
    /// rank's structure changed.
    ///
    /// # Errors
    /// As [`crate::save()`], plus [`Error::Object`] / [`Error::ObjectPlan`] for objects that
    /// are invalid or disagree across ranks, [`Error::Device`] when a download from device
    /// memory fails, and [`Error::SaveInFlight`] as [`Saver::save_async`].
    pub fn save(
        &mut self,
        request: &SaveRequest<'_>,
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveReport> {
        if !request.device_tensors.is_empty() {
            return self.start(request, dir, opts, None)?.wait();
        }
        // A save still in flight fails here, before any collective: the background thread
        // of that save may be using the communicator (IfBusy::Fail), and two collectives must
        // never interleave on it. A rank that is not busy then fails in the agreement within
        // the communicator's timeout.
        self.settle()?;
        steps::save_direct(
            &request.tensors,
            request.objects.as_deref(),
            dir,
            &*self.comm,
            opts,
            Some(&mut self.cache),
        )
    }

    /// Starts a save of `request` and returns once this rank's part of it is staged (host
    /// pieces copied, device pieces downloaded, objects taken); writing, fsync and commit go
    /// on in the background. The caller may change or free its tensors and objects as soon
    /// as this returns: what is saved is what they held during the call.
    ///
    /// # Errors
    /// Every error that planning can know is returned here, on every rank: an invalid
    /// layout or objects (as [`Saver::save`]), a rank that died, a failed download.
    /// Errors of the background work (I/O, the commit) come from [`SaveHandle::wait`].
    /// [`Error::SaveInFlight`] when the previous save is still in flight and the policy is
    /// [`IfBusy::Fail`].
    pub fn save_async(
        &mut self,
        request: &SaveRequest<'_>,
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        self.start(request, dir, opts, None)
    }

    /// [`Saver::save_async`], running `after` in the background thread once the save is
    /// committed on every rank (its error, agreed across ranks, becomes the save's).
    pub(crate) fn save_async_then(
        &mut self,
        request: &SaveRequest<'_>,
        dir: &Path,
        opts: &SaveOptions,
        after: AfterCommit,
    ) -> Result<SaveHandle> {
        self.start(request, dir, opts, Some(after))
    }

    fn start(
        &mut self,
        request: &SaveRequest<'_>,
        dir: &Path,
        opts: &SaveOptions,
        after: Option<AfterCommit>,
    ) -> Result<SaveHandle> {
        let t0 = Instant::now();
        // A save still in flight fails here, before any collective (see `save`); a copy pool
        // that cannot start fails every rank, in the first agreement.
        self.settle()?;
        let ready = self.threads();
        let comm = Arc::clone(&self.comm);
        let rank = comm.rank();
        // Flat pieces are saved as the boxes of their decomposition.
        let boxed = crate::model::tensor::boxed_pieces(&request.tensors);
        let src = Sources {
            host: &boxed,
            device: &request.device_tensors,
            reader: request.device.as_ref(),
        };
        let (threads, ready) = match ready {
            Ok(t) => (Some(t), Ok(())),
            Err(e) => (None, Err(e)),
        };
        let agreed = steps::agree_on_layout_cached(ready, src, &*comm, opts, &mut self.cache)?;
        let objects = request
            .objects
            .as_deref()
            .map(|o| crate::objects::agree_on_objects(o, &*comm).map(AgreedObjects::into_owned))
            .transpose()?;
        let threads = threads.ok_or_else(|| Error::ThreadPool("no copy pool".into()))?;
        let plan = Arc::clone(&agreed.plan);
        let tasks = plan.tasks.clone();
        // Unaligned parts travel now, from the caller's buffers, while the communicator is
        // still the caller's; what arrives is staged with the rest.
        let pool = &self.pool;
        let mut download = |piece: &crate::device::DevicePiece, region: &crate::model::Region| {
            let device = agreed.reader.ok_or_else(|| {
                crate::device::DeviceError::Unavailable("no device for device pieces".into())
            })?;
            Ok(stage::download(pool, device, piece, region)?)
        };
        let received = steps::exchange_unaligned(&*comm, &agreed, &tasks, Some(&mut download))?;
        let items = stage_sources(&plan.plan, &tasks, &agreed, &received);
        let sizes: Vec<usize> = items.iter().map(|i| i.len() + i.scratch()).collect();
        let rounds = stage::pack(&sizes, self.pool.arena_cap());
        let device = items
            .iter()
            .any(ItemSource::reads_device)
            .then_some(agreed.reader)
            .flatten();

        let job = Arc::new(Job::default());
        let (tx, rx) = sync_channel::<StagedRound>(stage::ARENAS);
        let bg = Background {
            comm,
            dir: dir.to_owned(),
            plan: Arc::clone(&plan),
            tasks: tasks.clone(),
            opts: opts.clone(),
            report: ReportParts::of(&agreed, objects.as_ref()),
            lower_priority: self.opts.lower_priority,
            objects,
            after,
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
        let staging = Staging {
            pool: &self.pool,
            threads: &threads,
            device,
        };
        let staged = staging.rounds(&items, &sizes, &rounds, &tx);
        drop(tx);
        // A failed download fails the save on every rank: this rank's writer never gets every
        // chunk and fails its agreement, so the others fail from `wait`; here the download's
        // error is returned, once the writer is done with the communicator.
        let staged = match staged {
            Ok(n) => n,
            Err(e) => {
                drop(job.wait_finished());
                self.in_flight = None;
                return Err(e.into());
            }
        };
        Ok(SaveHandle {
            job,
            blocked: t0.elapsed(),
            staged_bytes: staged,
        })
    }
}

/// Work a save runs in its background thread once committed on every rank (the manager's
/// pointer and retention), given the communicator; its outcome is agreed on by the saver.
pub(crate) type AfterCommit = Box<dyn FnOnce(&dyn Communicator) -> Result<()> + Send>;

/// Where each chunk this rank writes comes from: a contiguous run of a local piece, a box of
/// a device piece, or a box assembled from local pieces and received parts (zero-padded at
/// the tensor's edge).
fn stage_sources<'a>(
    plan: &'a SavePlan,
    tasks: &'a RankTasks,
    agreed: &'a AgreedLayout<'a, 'a>,
    received: &'a [Vec<Vec<u8>>],
) -> Vec<ItemSource<'a>> {
    let (local, device) = (&agreed.local, &agreed.device);
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
            {
                if let Some(piece) = local.get(&(&tp.key, piece_region)) {
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
                        parts: vec![(PartSource::Host(piece.data(), piece.region()), full.clone())],
                        full,
                        elem,
                        covered: true,
                    };
                }
                if let Some(piece) = device.get(&(&tp.key, piece_region)) {
                    return ItemSource::Device { piece, full };
                }
            }
            let mut remote = recv.into_iter().flatten();
            let parts = w
                .parts
                .iter()
                .filter_map(|part| match &part.source {
                    Source::Local(piece_region) => {
                        let at = (&tp.key, piece_region);
                        match (local.get(&at), device.get(&at)) {
                            (Some(p), _) => {
                                Some((PartSource::Host(p.data(), p.region()), part.region.clone()))
                            }
                            (None, Some(p)) => Some((PartSource::Device(p), part.region.clone())),
                            (None, None) => None,
                        }
                    }
                    Source::Remote(_) => remote.next().map(|d| {
                        (
                            PartSource::Host(d.as_slice(), &part.region),
                            part.region.clone(),
                        )
                    }),
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

/// The staging of one save: the pool, the copy threads, and the device whose page-locked
/// memory the arenas must be when chunks download from it.
struct Staging<'s> {
    pool: &'s Arc<StagingPool>,
    threads: &'s rayon::ThreadPool,
    device: Option<&'s Arc<dyn crate::device::Device>>,
}

impl Staging<'_> {
    /// Fills the rounds into arenas and sends them to the writer; stops early if the writer
    /// gave up (its error comes from `wait`). Returns the bytes staged.
    fn rounds(
        &self,
        items: &[ItemSource<'_>],
        sizes: &[usize],
        rounds: &[Range<usize>],
        tx: &SyncSender<StagedRound>,
    ) -> std::result::Result<u64, crate::device::DeviceError> {
        let mut staged = 0u64;
        let largest = rounds
            .iter()
            .map(|r| sizes[r.clone()].iter().sum::<usize>())
            .max()
            .unwrap_or(0);
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
            let mut lease = self.pool.take(at, largest, self.device)?;
            stage::fill(&mut lease, &ranges, &items[round.clone()], self.threads)?;
            staged += ranges
                .iter()
                .zip(&items[round.clone()])
                .map(|(_, i)| i.len() as u64)
                .sum::<u64>();
            let items = round
                .clone()
                .zip(ranges)
                .zip(&items[round.clone()])
                .map(|((wi, r), item)| (wi, r.start..r.start + item.len()))
                .collect();
            if tx.send(StagedRound { lease, items }).is_err() {
                break;
            }
        }
        Ok(staged)
    }
}

/// What the report says about planning (the plan itself travels separately).
struct ReportParts {
    plan_time: Duration,
    gathered_bytes: u64,
    plan_reused: bool,
    balance: f64,
}

impl ReportParts {
    fn of(agreed: &AgreedLayout<'_, '_>, objects: Option<&AgreedObjects<'_>>) -> Self {
        ReportParts {
            plan_time: agreed.plan_time,
            gathered_bytes: agreed.gathered_bytes + objects.map_or(0, |o| o.gathered_bytes),
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
    /// The objects, agreed on when the save started (they own copies of the values).
    objects: Option<AgreedObjects<'static>>,
    /// Run once the save is committed.
    after: Option<AfterCommit>,
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
    fn run(mut self, rx: Receiver<StagedRound>) -> Result<SaveReport> {
        if self.lower_priority {
            lower_thread_priority();
        }
        let comm = &*self.comm;
        let objects = self.objects.take();
        let plan = &self.plan.plan;
        // The same destination as a synchronous save: a local directory, or a fresh
        // generation on an object store committed through the pointer move.
        let dest = match steps::Destination::prepare(
            &self.dir,
            comm,
            plan,
            objects.as_ref(),
            &self.opts,
        ) {
            Ok(d) => d,
            Err(e) => {
                drop(rx);
                return Err(e);
            }
        };
        let (data_bytes, file_bytes) = dest.write_and_commit(
            comm,
            plan,
            objects.as_ref(),
            &self.opts,
            |store, root, id| self.write_rounds(rx, store, root, id),
        )?;
        drop(dest);
        if let Some(after) = self.after.take() {
            agree(comm, after(comm))?;
        }
        Ok(SaveReport {
            tensors: self.plan.plan.tensors.len(),
            chunks_written: self.tasks.writes.len(),
            data_bytes,
            file_bytes,
            write_balance: self.report.balance,
            assigned_bytes: self.plan.bytes,
            plan_time: self.report.plan_time,
            gathered_bytes: self.report.gathered_bytes,
            plan_reused: self.report.plan_reused,
        })
    }

    /// Writes the staged rounds as they come through `store` (holding the checkpoint at its
    /// root, named `root` in messages); the receiver is dropped on return, so a caller
    /// waiting for staging memory is released even when writing failed.
    fn write_rounds(
        &self,
        rx: Receiver<StagedRound>,
        store: &dyn Store,
        root: &Path,
        id: SaveId,
    ) -> Result<(u64, u64)> {
        let (plan, tasks, opts) = (&self.plan.plan, &self.tasks, &self.opts);
        let pool = writer_pool(steps::writer_threads(store, opts), self.lower_priority)?;
        let arrays = pool.install(|| steps::Arrays::start(store, root, plan, tasks, opts, id))?;
        let (mut data, mut files, mut done) = (0u64, 0u64, 0usize);
        for round in rx {
            let (d, f) = pool.install(|| -> Result<(u64, u64)> {
                let totals = round
                    .items
                    .par_iter()
                    .map(|(wi, range)| {
                        let w = &tasks.writes[*wi];
                        let full = steps::full_chunk_box(&plan.tensors[w.tensor], &w.chunk);
                        let src = &round.lease.bytes()[range.clone()];
                        arrays.write_chunk(store, plan, w, src, &full, opts)
                    })
                    .try_reduce(|| (0, 0), |a, b| Ok((a.0 + b.0, a.1 + b.1)))?;
                arrays.sync_chunks(
                    store,
                    round.items.par_iter().map(|(wi, _)| &tasks.writes[*wi]),
                )?;
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
        pool.install(|| arrays.sync_prefixes(store))?;
        Ok((data, files))
    }
}
