//! Saving from device memory: device-to-host into a pinned snapshot, then the ordinary
//! collective save.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::copy::{check_disjoint, pitched_copies, view_extent};
use super::{Device, DeviceError, DeviceView, PinnedBuf};
use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::model::region::num_bytes;
use crate::model::tensor::check_piece;
use crate::model::{DType, Region, Replica, ShardedTensor, StateObject, TensorError, TensorKey};
use crate::save::{SaveOptions, SaveReport, save_with_objects};

/// A box of a global tensor held in device memory at save time (as [`ShardedTensor::new`],
/// with the data in a device view).
#[derive(Debug, Clone)]
pub struct DevicePiece {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    replica: Replica,
    view: DeviceView,
    /// The region's bytes (checked to fit a `usize` by `new`).
    bytes: usize,
}

impl DevicePiece {
    /// A piece whose elements are read from `view`. `replica_id` as in [`ShardedTensor::new`].
    ///
    /// # Errors
    /// [`Error::Tensor`] when the region is malformed or out of bounds; [`Error::Device`]
    /// when the view's strides do not fit the region or overlap.
    pub fn new(
        key: TensorKey,
        dtype: DType,
        global_shape: Vec<u64>,
        region: Region,
        replica_id: u32,
        view: DeviceView,
    ) -> Result<Self> {
        let bytes =
            num_bytes(region.shape(), dtype.size()).map_err(|source| TensorError::Region {
                key: key.to_string(),
                source,
            })?;
        check_piece(&key, dtype, &global_shape, &region, bytes)?;
        let wrap = |source| DeviceError::View {
            key: key.to_string(),
            source,
        };
        view_extent(region.shape(), view.strides(), dtype.size()).map_err(wrap)?;
        // An expanded (overlapping) view has no pitched-copy form on a GPU: save a
        // contiguous copy of it instead.
        check_disjoint(region.shape(), view.strides()).map_err(wrap)?;
        Ok(DevicePiece {
            key,
            dtype,
            global_shape,
            region,
            replica: Replica::Id(replica_id),
            view,
            bytes,
        })
    }

    /// The same piece with another replica declaration (for instance [`Replica::Auto`]).
    #[must_use]
    pub fn with_replica(mut self, replica: Replica) -> Self {
        self.replica = replica;
        self
    }

    fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Where a snapshotted piece's bytes are, for building it again in the background.
#[derive(Debug, Clone)]
struct Staged {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    replica: Replica,
    range: std::ops::Range<usize>,
}

#[derive(Debug, Default)]
struct Job {
    state: Mutex<(bool, Option<Result<SaveReport>>)>,
    done: Condvar,
}

impl Job {
    fn lock(&self) -> MutexGuard<'_, (bool, Option<Result<SaveReport>>)> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    fn finish(&self, r: Result<SaveReport>) {
        let mut g = self.lock();
        *g = (true, Some(r));
        self.done.notify_all();
    }
    fn wait_done(&self) -> MutexGuard<'_, (bool, Option<Result<SaveReport>>)> {
        let mut g = self.lock();
        while !g.0 {
            g = self
                .done
                .wait(g)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        g
    }
}

/// An asynchronous save from device memory in flight.
#[derive(Debug)]
pub struct DeviceSaveHandle {
    job: Arc<Job>,
    blocked: Duration,
    device_bytes: u64,
    rank: usize,
    path: PathBuf,
}

impl DeviceSaveHandle {
    /// How long the call blocked (the device-to-host copy and the host pieces' copy).
    #[must_use]
    pub fn blocked(&self) -> Duration {
        self.blocked
    }

    /// Bytes copied from the device.
    #[must_use]
    pub fn device_bytes(&self) -> u64 {
        self.device_bytes
    }

    /// Whether the background save has finished.
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.job.lock().0
    }

    /// Waits for the save to commit (or fail) on this rank.
    ///
    /// # Errors
    /// As [`crate::save_with_objects`].
    pub fn wait(self) -> Result<SaveReport> {
        let mut g = self.job.wait_done();
        g.1.take().unwrap_or_else(|| {
            Err(Error::Background {
                rank: self.rank,
                path: self.path.clone(),
                detail: "the save's result was already taken".into(),
            })
        })
    }
}

/// Saves device memory (and host memory, in the same call): device-to-host into a pinned
/// snapshot that is reused across saves (it grows to the largest state saved), then the
/// ordinary collective save.
pub struct DeviceSaver {
    device: Arc<dyn Device>,
    comm: Arc<dyn Communicator>,
    snapshot: Arc<Mutex<Option<PinnedBuf>>>,
    in_flight: Option<Arc<Job>>,
}

impl std::fmt::Debug for DeviceSaver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSaver")
            .field("device", &self.device)
            .field("rank", &self.comm.rank())
            .field("in_flight", &self.in_flight.is_some())
            .finish_non_exhaustive()
    }
}

impl DeviceSaver {
    /// A saver over `device` for the ranks of `comm`.
    #[must_use]
    pub fn new(device: Arc<dyn Device>, comm: Arc<dyn Communicator>) -> Self {
        DeviceSaver {
            device,
            comm,
            snapshot: Arc::new(Mutex::new(None)),
            in_flight: None,
        }
    }

    /// Pinned bytes held between saves.
    #[must_use]
    pub fn snapshot_bytes(&self) -> usize {
        self.slot().as_ref().map_or(0, |b| b.len())
    }

    fn slot(&self) -> MutexGuard<'_, Option<PinnedBuf>> {
        self.snapshot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits for the previous asynchronous save, if any (its result stays with its handle).
    fn settle(&mut self) {
        if let Some(job) = self.in_flight.take() {
            drop(job.wait_done());
        }
    }

    /// Takes the snapshot buffer, grown to at least `len` bytes.
    fn take_snapshot(&self, len: usize) -> Result<PinnedBuf, DeviceError> {
        match self.slot().take() {
            Some(b) if b.len() >= len => Ok(b),
            _ => self.device.pinned(len.max(1)),
        }
    }

    /// Copies the device pieces into the front of `snap`, and waits for the copies.
    fn download(&self, device: &[DevicePiece], snap: &mut PinnedBuf) -> Result<Vec<Staged>> {
        let mut staged = Vec::with_capacity(device.len());
        let mut copies = Vec::new();
        let mut at = 0usize;
        for p in device {
            let n = p.bytes();
            copies.extend(
                pitched_copies(
                    p.region.shape(),
                    p.view.strides(),
                    p.dtype.size(),
                    p.view.address(),
                    at,
                )
                .map_err(|source| DeviceError::View {
                    key: p.key.to_string(),
                    source,
                })?,
            );
            staged.push(Staged {
                key: p.key.clone(),
                dtype: p.dtype,
                global_shape: p.global_shape.clone(),
                region: p.region.clone(),
                replica: p.replica,
                range: at..at + n,
            });
            at += n;
        }
        if !copies.is_empty() {
            // SAFETY: the host ranges lie in `snap`, borrowed mutably until the wait below
            // returns; the device ranges are the pieces' views (DeviceView::new's contract).
            let fence = unsafe { self.device.to_host(snap.as_mut_ptr(), &copies) }?;
            self.device.wait(fence)?;
        }
        Ok(staged)
    }

    /// The pinned snapshot of a save: the device pieces downloaded, then `host` (box pieces)
    /// copied after them; agreed across ranks (a failed copy fails every rank).
    fn snapshot(
        &self,
        device: &[DevicePiece],
        host: &[ShardedTensor<'_>],
    ) -> Result<(PinnedBuf, Vec<Staged>)> {
        let dev_total: usize = device.iter().map(DevicePiece::bytes).sum();
        let host_total: usize = host.iter().map(|p| p.data().len()).sum();
        let local = self
            .take_snapshot(dev_total + host_total)
            .map_err(Error::from)
            .and_then(|mut snap| {
                let mut staged = self.download(device, &mut snap)?;
                let mut at = dev_total;
                for p in host {
                    let n = p.data().len();
                    snap[at..at + n].copy_from_slice(p.data());
                    staged.push(Staged {
                        key: p.key().clone(),
                        dtype: p.dtype(),
                        global_shape: p.global_shape().to_vec(),
                        region: p.region().clone(),
                        replica: p.replica(),
                        range: at..at + n,
                    });
                    at += n;
                }
                Ok((snap, staged))
            });
        agree(&*self.comm, local)
    }

    /// Saves synchronously: every rank calls it with its own pieces. Host pieces are read
    /// in place; device pieces go through the pinned snapshot.
    ///
    /// # Errors
    /// As [`crate::save_with_objects`], plus [`Error::Device`] when a copy fails on any rank
    /// (every rank fails; nothing is committed).
    pub fn save(
        &mut self,
        host: &[ShardedTensor<'_>],
        device: &[DevicePiece],
        objects: &[StateObject],
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<SaveReport> {
        self.settle();
        let (snap, staged) = self.snapshot(device, &[])?;
        let result = {
            let mut pieces = host.to_vec();
            for s in &staged {
                pieces.push(rebuild(s, &snap)?);
            }
            save_with_objects(&pieces, objects, dir, &*self.comm, opts)
        };
        *self.slot() = Some(snap);
        result
    }

    /// Starts a save and returns once this rank's device pieces (and host pieces) are copied
    /// into the pinned snapshot; writing and commit go on in a background thread, which uses
    /// the communicator meanwhile (as [`crate::Saver::save_async`] does). A save started
    /// while one is in flight waits for it first.
    ///
    /// # Errors
    /// [`Error::Device`] when a copy fails on any rank (every rank fails; nothing was
    /// started); errors of the save itself come from [`DeviceSaveHandle::wait`].
    pub fn save_async(
        &mut self,
        host: &[ShardedTensor<'_>],
        device: &[DevicePiece],
        objects: &[StateObject],
        dir: &Path,
        opts: &SaveOptions,
    ) -> Result<DeviceSaveHandle> {
        let t0 = Instant::now();
        self.settle();
        // Flat host pieces are snapshotted as the boxes of their decomposition.
        let host = crate::model::tensor::boxed_pieces(host);
        let (snap, staged) = self.snapshot(device, &host)?;
        let blocked = t0.elapsed();
        let job = Arc::new(Job::default());
        let rank = self.comm.rank();
        let comm = Arc::clone(&self.comm);
        let slot = Arc::clone(&self.snapshot);
        let objects = objects.to_vec();
        let dir_owned = dir.to_owned();
        let opts = opts.clone();
        let bg_job = Arc::clone(&job);
        std::thread::Builder::new()
            .name(format!("zarrckpt-device-save-{rank}"))
            .spawn(move || {
                let result = staged
                    .iter()
                    .map(|s| rebuild(s, &snap))
                    .collect::<Result<Vec<_>>>()
                    .and_then(|pieces| {
                        save_with_objects(&pieces, &objects, &dir_owned, &*comm, &opts)
                    });
                *slot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(snap);
                bg_job.finish(result);
            })
            .map_err(|e| Error::Background {
                rank,
                path: dir.to_owned(),
                detail: format!("could not start the background writer: {e}"),
            })?;
        self.in_flight = Some(Arc::clone(&job));
        Ok(DeviceSaveHandle {
            job,
            blocked,
            device_bytes: device.iter().map(|p| p.bytes() as u64).sum(),
            rank,
            path: dir.to_owned(),
        })
    }
}

fn rebuild<'a>(s: &Staged, snap: &'a [u8]) -> Result<ShardedTensor<'a>> {
    Ok(ShardedTensor::new(
        s.key.clone(),
        s.dtype,
        s.global_shape.clone(),
        s.region.clone(),
        0,
        &snap[s.range.clone()],
    )?
    .with_replica(s.replica))
}
