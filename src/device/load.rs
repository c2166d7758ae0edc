//! Loading into device memory through bounded, reused pinned staging.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::copy::{pitched_copies, slabs};
use super::{Device, DeviceError, DeviceView, Fence, PinnedBuf};
use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::load::collective::{self, Request, exchange_shared};
use crate::load::{LoadOptions, LoadReport, Reader};
use crate::model::copy::DisjointBuf;
use crate::model::region::num_bytes;
use crate::model::{DType, LoadTarget, ObjectRequest, Region, TensorError, TensorKey};
use crate::plan::load::ShardRead;
use crate::storage::read::ReadCounters;

/// A box of a global tensor to load into a device view.
#[derive(Debug, Clone)]
pub struct DeviceTarget {
    key: TensorKey,
    dtype: DType,
    global_shape: Vec<u64>,
    region: Region,
    view: DeviceView,
}

impl DeviceTarget {
    /// A request to fill `view` with `region` of tensor `key`, which must have exactly this
    /// data type and global shape in the checkpoint.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the region is malformed or out of bounds;
    /// [`Error::Device`] when the view's strides do not fit the region or overlap.
    pub fn new(
        key: TensorKey,
        dtype: DType,
        global_shape: Vec<u64>,
        region: Region,
        view: DeviceView,
    ) -> Result<Self> {
        super::check_device_box(&key, dtype, &global_shape, &region, &view)?;
        Ok(DeviceTarget {
            key,
            dtype,
            global_shape,
            region,
            view,
        })
    }

    /// The tensor.
    #[must_use]
    pub fn key(&self) -> &TensorKey {
        &self.key
    }

    /// The box.
    #[must_use]
    pub fn region(&self) -> &Region {
        &self.region
    }
}

/// Two pinned staging buffers of a device, allocated on first use and reused by every load
/// that is handed the same staging: pinned host memory stays bounded by the cap.
#[derive(Debug)]
pub struct DeviceStaging {
    // Declared (so dropped) before the device: buffers are freed while it is alive.
    buffers: Vec<PinnedBuf>,
    device: Arc<dyn Device>,
    buffer_bytes: usize,
}

impl DeviceStaging {
    /// Staging of at most `cap` bytes of pinned memory (two buffers of half each; at least
    /// one element of the largest data type each).
    #[must_use]
    pub fn new(device: Arc<dyn Device>, cap: usize) -> Self {
        DeviceStaging {
            device,
            buffer_bytes: (cap / 2).max(16),
            buffers: Vec::new(),
        }
    }

    /// The device.
    #[must_use]
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Bytes of one buffer.
    #[must_use]
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    fn ensure(&mut self) -> Result<(), DeviceError> {
        while self.buffers.len() < 2 {
            self.buffers.push(self.device.pinned(self.buffer_bytes)?);
        }
        Ok(())
    }
}

/// What [`load_to_device`] did on this rank.
#[derive(Debug, Default, Clone)]
pub struct DeviceLoadReport {
    /// The storage side, summed over rounds (bytes read, received, sent, loaded: host and
    /// device targets together).
    pub load: LoadReport,
    /// Bytes copied to the device.
    pub device_bytes: u64,
    /// Staging rounds (every rank runs the same number).
    pub rounds: u32,
    /// Pitched copies enqueued.
    pub copies: u64,
    /// Seconds spent in storage reads (and the exchange).
    pub read_seconds: f64,
    /// Seconds spent waiting for device copies to free a staging buffer or to finish.
    pub copy_wait_seconds: f64,
}

/// One slab of a device target: which target, which box, its bytes.
struct Slab {
    target: usize,
    region: Region,
    bytes: usize,
}

/// Loads `host` targets into host buffers and `device` targets into device memory, in one
/// collective call: every rank calls it, with its own targets, in any topology.
///
/// Device targets are read into the staging's pinned buffers a round at a time (a round
/// fills one buffer; a target larger than a buffer is cut into slabs) and copied to the
/// device asynchronously, so the reads of the next round overlap the copies of the last.
/// Returns once every copy has finished. Host targets are loaded in the first round.
/// Device targets must ask for exactly the stored data type.
///
/// # Errors
/// As [`crate::load()`], plus [`Error::Device`] when a copy fails on any rank (every rank
/// returns an error; the device memory of targets is then unspecified).
pub fn load_to_device(
    host: &mut [LoadTarget<'_>],
    device: &[DeviceTarget],
    staging: &mut DeviceStaging,
    dir: &Path,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<DeviceLoadReport> {
    load_device_impl(host, device, None, staging, dir, comm, opts)
}

/// [`load_to_device`] with objects, as [`crate::load_with_objects`]: their values come back
/// in the report's `load.objects`, in order. Every rank calls it (or every rank
/// [`load_to_device`]).
///
/// # Errors
/// As [`load_to_device`] and [`crate::load_with_objects`].
pub fn load_to_device_with_objects(
    host: &mut [LoadTarget<'_>],
    device: &[DeviceTarget],
    objects: &[ObjectRequest],
    staging: &mut DeviceStaging,
    dir: &Path,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<DeviceLoadReport> {
    load_device_impl(host, device, Some(objects), staging, dir, comm, opts)
}

fn load_device_impl(
    host: &mut [LoadTarget<'_>],
    device: &[DeviceTarget],
    objects: Option<&[ObjectRequest]>,
    staging: &mut DeviceStaging,
    dir: &Path,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<DeviceLoadReport> {
    collective::note_step();
    // A directory or an object-store URL (read by ranged gets).
    let reader = Reader::open_shared(dir, comm)?.with_io(opts.io_threads, opts.read_method);
    reader.agree_generation(comm)?;
    let meta = reader.meta();
    let cap = staging.buffer_bytes;
    let mut pieces: Vec<Slab> = Vec::new();
    // Keys the checkpoint lacks have no slabs: the plan checks them under the strict mode.
    for (i, t) in device
        .iter()
        .enumerate()
        .filter(|(_, t)| meta.tensors.contains_key(&t.key))
    {
        let elem = t.dtype.size();
        for region in slabs(&t.region, elem, cap) {
            // A box within the target's region, whose byte size `DeviceTarget::new` checked.
            let bytes = num_bytes(region.shape(), elem).map_err(|source| TensorError::Region {
                key: t.key.to_string(),
                source,
            })?;
            pieces.push(Slab {
                target: i,
                region,
                bytes,
            });
        }
    }
    // Consecutive slabs packed into rounds of at most one buffer each.
    let mut rounds: Vec<std::ops::Range<usize>> = Vec::new();
    let mut used = usize::MAX;
    for (k, s) in pieces.iter().enumerate() {
        if used.saturating_add(s.bytes) > cap {
            rounds.push(k..k);
            used = 0;
        }
        used += s.bytes;
        if let Some(last) = rounds.last_mut() {
            last.end = k + 1;
        }
    }

    // The plan, made once for every round: host targets (loaded in the first round, through
    // the exchange where several ranks need a box) and device targets (read by this rank
    // alone, a round of slabs at a time), checked under the caller's strict mode; the
    // largest round count is agreed on alongside, so that every rank runs as many rounds.
    let mut host_boxes: Vec<LoadTarget<'_>> = Vec::new();
    for t in host.iter_mut() {
        host_boxes.extend(t.box_targets());
    }
    let mut requests: Vec<Request> = host_boxes.iter().map(|t| Request::of(t, meta)).collect();
    requests.extend(device.iter().map(|t| Request {
        key: t.key.clone(),
        dtype: t.dtype,
        global_shape: t.global_shape.clone(),
        region: t.region.clone(),
        cast: None,
        alone: true,
    }));
    let mine = rounds.len().max(1) as u64;
    let plan = collective::plan(
        &requests,
        objects,
        (dir, meta, reader.values()),
        comm,
        opts,
        mine,
    )?;
    let n = plan.extra_max.max(mine);
    let dev = Arc::clone(&staging.device);
    let ready = if rounds.is_empty() {
        Ok(())
    } else {
        staging.ensure()
    };
    agree(comm, ready.map_err(Error::from))?;

    let mut report = DeviceLoadReport {
        rounds: u32::try_from(n).unwrap_or(u32::MAX),
        ..DeviceLoadReport::default()
    };
    let geometry = |key: &TensorKey| {
        meta.tensors
            .get(key)
            .map(|e| crate::plan::load::StoredGeometry {
                global_shape: e.shape.clone(),
                chunk_shape: e.chunk_shape.clone(),
                subchunk_shape: e.subchunk_shape.clone(),
                elem: e.dtype.size(),
            })
    };
    let mut fences: [Option<Fence>; 2] = [None, None];
    let wait = |fence: Option<Fence>, report: &mut DeviceLoadReport| -> Result<(), DeviceError> {
        if let Some(f) = fence {
            let t = Instant::now();
            dev.wait(f)?;
            report.copy_wait_seconds += t.elapsed().as_secs_f64();
        }
        Ok(())
    };
    let me = u32::try_from(comm.rank()).unwrap_or(u32::MAX);
    let host_requests = host_boxes.len();
    // The rounds. The first one is collective (its reads are agreed on, then the host
    // targets' shared boxes exchanged); the later ones are this rank's own reads and copies,
    // their outcome agreed on once at the end. On any error, the copies still in flight are
    // waited for below before returning, so that no copy outlives the call (staging is
    // reused, targets freed).
    let mut rounds_run = |report: &mut DeviceLoadReport| -> Result<()> {
        for r in 0..crate::model::usize_of(n) {
            let b = r % 2;
            // The buffer is free once the copies out of it two rounds ago have finished.
            wait(fences[b].take(), report)?;
            let mine = rounds.get(r).cloned().unwrap_or(0..0);
            let t0 = Instant::now();
            let mut offsets = Vec::with_capacity(mine.len());
            {
                // This round's requests: the host boxes (first round) and its slabs.
                let mut round_requests: Vec<Request> = Vec::new();
                let mut dests: Vec<DisjointBuf<'_>> = Vec::new();
                let mut reads: Vec<(usize, ShardRead)> = Vec::new();
                if r == 0 {
                    round_requests.extend(requests[..host_requests].iter().cloned());
                    reads.extend(
                        plan.reads
                            .iter()
                            .filter(|(i, _)| *i < host_requests)
                            .cloned(),
                    );
                }
                // No buffers when this rank has no device slabs (its rounds only keep step
                // with the other ranks'): an empty slice then, never an index past the end.
                let mut rest: &mut [u8] = match staging.buffers.get_mut(b) {
                    Some(buf) => &mut buf[..],
                    None => &mut [],
                };
                let mut at = 0usize;
                let mut slab_bufs: Vec<&mut [u8]> = Vec::new();
                for s in &pieces[mine.clone()] {
                    let t = &device[s.target];
                    if s.bytes > rest.len() {
                        return Err(Error::from(DeviceError::OutOfRange {
                            what: "staging bytes of a round",
                            value: s.bytes as u64,
                        }));
                    }
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(s.bytes);
                    rest = tail;
                    let i = round_requests.len();
                    round_requests.push(Request {
                        key: t.key.clone(),
                        dtype: t.dtype,
                        global_shape: t.global_shape.clone(),
                        region: s.region.clone(),
                        cast: None,
                        alone: true,
                    });
                    if let Some(g) = geometry(&t.key) {
                        reads.extend(g.reads_for(&s.region).into_iter().map(|x| (i, x)));
                    }
                    slab_bufs.push(head);
                    offsets.push(at);
                    at += s.bytes;
                }
                let mut loaded = 0u64;
                if r == 0 {
                    for (t, q) in host_boxes.iter_mut().zip(&requests[..host_requests]) {
                        if meta.tensors.contains_key(&q.key) {
                            loaded += t.buf().len() as u64;
                        }
                        let elem = t.dtype().size();
                        dests.push(DisjointBuf::new(t.buf_mut(), &q.region, elem));
                    }
                }
                let first_slab = dests.len();
                for (buf, q) in slab_bufs.into_iter().zip(&round_requests[first_slab..]) {
                    loaded += buf.len() as u64;
                    dests.push(DisjointBuf::new(buf, &q.region, q.dtype.size()));
                }
                let counters = ReadCounters::default();
                let local = (if r == 0 {
                    plan.check_absent(dir, comm.rank())
                } else {
                    Ok(())
                })
                .and_then(|()| {
                    reader.execute(
                        &round_requests,
                        &reads,
                        &dests,
                        &counters,
                        opts.progress.as_ref(),
                    )
                });
                let (mut sent, mut received) = (0, 0);
                if r == 0 {
                    agree(comm, local)?;
                    if plan.exchanges() {
                        let shared = exchange_shared(
                            comm,
                            &plan.exchange,
                            plan.group_rounds,
                            me,
                            &plan.first_target,
                            &dests,
                            opts,
                        );
                        (sent, received) = agree(comm, shared)?;
                    }
                } else {
                    local?;
                }
                accumulate(
                    &mut report.load,
                    LoadReport {
                        loaded_bytes: loaded,
                        bytes_read: counters.bytes.load(std::sync::atomic::Ordering::Relaxed),
                        bytes_received: received,
                        bytes_sent: sent,
                        ..LoadReport::default()
                    },
                );
            }
            report.read_seconds += t0.elapsed().as_secs_f64();
            // Copy this round to the device, asynchronously.
            let mut copies = Vec::new();
            let enqueued = (|| -> Result<Option<Fence>, DeviceError> {
                for (s, off) in pieces[mine.clone()].iter().zip(&offsets) {
                    let t = &device[s.target];
                    let elem = t.dtype.size();
                    let rel: Vec<u64> = s
                        .region
                        .offset()
                        .iter()
                        .zip(t.region.offset())
                        .map(|(a, b)| a - b)
                        .collect();
                    let view = t.view.offset_by(&rel, elem);
                    copies.extend(
                        pitched_copies(
                            s.region.shape(),
                            view.strides(),
                            elem,
                            view.address(),
                            *off,
                        )
                        .map_err(|source| DeviceError::View {
                            key: t.key.to_string(),
                            source,
                        })?,
                    );
                    report.device_bytes += s.bytes as u64;
                }
                if copies.is_empty() {
                    return Ok(None);
                }
                // SAFETY: the host ranges lie in staging buffer `b`, which nothing touches until
                // this fence is waited on (two rounds later, or below); the device ranges are
                // the targets' views (DeviceView::new's contract).
                unsafe { dev.to_device(staging.buffers[b].as_ptr(), &copies) }.map(Some)
            })();
            report.copies += copies.len() as u64;
            fences[b] = enqueued?;
        }
        Ok(())
    };
    let ran = rounds_run(&mut report);
    let mut done = Ok(());
    for f in fences.iter_mut() {
        if let Err(e) = wait(f.take(), &mut report) {
            done = Err(e);
        }
    }
    // A failure of the first round was agreed on there; later ones, and the copies', here.
    agree(comm, ran.and(done.map_err(Error::from)))?;
    report.load = plan.report(opts.strict, std::mem::take(&mut report.load));
    Ok(report)
}

fn accumulate(total: &mut LoadReport, step: LoadReport) {
    total.loaded_bytes += step.loaded_bytes;
    total.bytes_read += step.bytes_read;
    total.bytes_received += step.bytes_received;
    total.bytes_sent += step.bytes_sent;
    total.unexpected.extend(step.unexpected);
    total.missing.extend(step.missing);
    total.objects.extend(step.objects);
}
