//! A communicator whose bulk transfers (the data-parallel exchange of a load: a box read
//! from storage once per group and sent to the other members) go GPU to GPU over NCCL
//! (cargo feature `nccl`; NCCL is loaded at run time). Control messages go over a bootstrap
//! communicator (TCP, in-process, or the torch process group through the Python front),
//! which also hands out NCCL's unique id: the collectives (agreement, planning) are the
//! shared ones of [`crate::comm::collective`] run over the bootstrap's point-to-point
//! transfers, so NcclComm itself only moves bytes.
//!
//! Every exchange first checks, over the bootstrap, that each pair's send and receive sizes
//! match, so a mismatch is an error instead of an NCCL hang. The transfer itself is waited on
//! by polling (`cuEventQuery` on the stream, `ncclCommGetAsyncError` on the communicator) up
//! to a deadline ([`NcclComm::with_timeout`], default [`DEFAULT_TIMEOUT`]); on the deadline or
//! an asynchronous error the communicator is aborted (`ncclCommAbort`) and the exchange fails,
//! so a peer that died mid-transfer is an error on the others, not a hang. An aborted
//! communicator refuses every later exchange (on every rank: refusals are agreed over the
//! bootstrap); its buffers are leaked rather than freed under work that may still be queued.
//!
//! Not bounded by this: `ncclCommInitRank` (every rank first agrees over the bootstrap that it
//! can join, so only a rank dying inside the call leaves the others waiting) and
//! `ncclGroupEnd`, which sets up a pair's connection on its first transfer (blocking NCCL
//! communicators cannot be aborted from the blocked thread).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::nccl::{result as nccl, sys as nsys};

use super::cuda::CudaDevice;
use super::{Device, DeviceError, Fence, PinnedBuf, Pitched};
use crate::comm::bounded::{InFlight, wait_bounded};
use crate::comm::{CommError, Communicator, DEFAULT_TIMEOUT, Merge, RecvBuf, SendBuf, collective};

/// Device and pinned host buffers an exchange reuses (grown to the largest exchange).
#[derive(Default)]
struct Buffers {
    device: Option<(u64, usize)>,
    pinned: Option<PinnedBuf>,
}

/// NCCL for bulk bytes, a bootstrap communicator for the rest.
pub struct NcclComm {
    bootstrap: Arc<dyn Communicator>,
    device: Arc<CudaDevice>,
    comm: usize,
    buffers: Mutex<Buffers>,
    /// The bound on one transfer's wait.
    timeout: Duration,
    /// Set once `ncclCommAbort` was called: the handle is gone.
    aborted: AtomicBool,
}

// SAFETY: the NCCL communicator is used under the buffers' mutex only (one exchange at a
// time); the handle itself is an opaque pointer.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.bootstrap.rank())
            .field("world", &self.bootstrap.world_size())
            .field("device", &self.device.ordinal())
            .finish_non_exhaustive()
    }
}

fn transport(op: &'static str, rank: usize, detail: impl std::fmt::Display) -> CommError {
    CommError::Transport {
        op,
        rank,
        detail: detail.to_string(),
    }
}

/// Whether this rank and every other is `ok`, agreed over `bootstrap` with the shared
/// all-reduce (a few bytes per rank whatever the world size): the lowest rank that is not, if
/// any.
fn first_failed(bootstrap: &dyn Communicator, ok: bool) -> Result<Option<usize>, CommError> {
    let rank = bootstrap.rank();
    let mine = if ok { u64::MAX } else { rank as u64 };
    let word = |v: &[u8]| <[u8; 8]>::try_from(v).map(u64::from_le_bytes);
    let min = |a: &[u8], b: &[u8]| -> Result<Vec<u8>, String> {
        match (word(a), word(b)) {
            (Ok(x), Ok(y)) => Ok(x.min(y).to_le_bytes().to_vec()),
            _ => Err(format!("{} and {} bytes, not 8", a.len(), b.len())),
        }
    };
    let got = collective::all_reduce(bootstrap, &mine.to_le_bytes(), &min)?;
    let bad = word(&got).map_err(|_| CommError::Mismatch {
        op: "all_reduce",
        rank,
        detail: format!("the agreement returned {} bytes, not 8", got.len()),
    })?;
    Ok((bad != u64::MAX).then(|| usize::try_from(bad).unwrap_or(usize::MAX)))
}

impl NcclComm {
    /// Creates the NCCL communicator of the bootstrap's ranks, one per GPU (collective over
    /// `bootstrap`: rank 0 makes the unique id and broadcasts it).
    ///
    /// # Errors
    /// [`CommError::Transport`] when NCCL is missing or fails to initialise on any rank
    /// (every rank fails).
    pub fn new(
        device: Arc<CudaDevice>,
        bootstrap: Arc<dyn Communicator>,
    ) -> Result<Self, CommError> {
        let rank = bootstrap.rank();
        // Every rank sees the same world size, so every rank refuses alike, before any
        // collective; a rank below it fits too.
        let world = i32::try_from(bootstrap.world_size()).map_err(|_| {
            transport(
                "nccl init",
                rank,
                format!("{} ranks are more than NCCL counts", bootstrap.world_size()),
            )
        })?;
        let me = i32::try_from(rank)
            .map_err(|_| transport("nccl init", rank, "the rank does not fit NCCL's int"))?;
        let id = if rank == 0 {
            // SAFETY: only tries to load the library.
            if unsafe { nsys::is_culib_present() } {
                nccl::get_uniqueid()
                    .map(|id| id.internal.iter().map(|&c| c as u8).collect::<Vec<u8>>())
                    .map_err(|e| format!("ncclGetUniqueId: {e:?}"))
            } else {
                Err("NCCL (libnccl.so.2) is not installed".to_owned())
            }
        } else {
            Ok(Vec::new())
        };
        // A failure on rank 0 travels as an empty id with the message appended.
        let msg = match &id {
            Ok(bytes) => [vec![1u8], bytes.clone()].concat(),
            Err(e) => [vec![0u8], e.as_bytes().to_vec()].concat(),
        };
        let got = collective::broadcast(&*bootstrap, 0, &msg)?;
        if got.first() != Some(&1) || got.len() != 129 {
            return Err(transport(
                "nccl init",
                rank,
                format!(
                    "rank 0 could not create the NCCL id: {}",
                    String::from_utf8_lossy(&got[1.min(got.len())..])
                ),
            ));
        }
        let mut uid = nsys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(&got[1..]) {
            *d = *s as _;
        }
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // ncclCommInitRank blocks until every rank joins: agree first that every rank can.
        let ready = device.make_current().map_err(|e| e.to_string());
        if let Some(bad) = first_failed(&*bootstrap, ready.is_ok())? {
            let detail = ready
                .err()
                .unwrap_or_else(|| format!("rank {bad} cannot use its GPU"));
            return Err(transport("nccl init", rank, detail));
        }
        // SAFETY: a valid out-pointer and an id every rank shares.
        let local = unsafe { nccl::comm_init_rank(&raw mut comm, world, uid, me) }
            .map(|_| ())
            .map_err(|e| format!("ncclCommInitRank: {e:?}"));
        // Every rank learns whether every rank succeeded.
        if let Some(bad) = first_failed(&*bootstrap, local.is_ok())? {
            if !comm.is_null() {
                // SAFETY: a communicator this rank created; not used afterwards.
                let _ = unsafe { nccl::comm_destroy(comm) };
            }
            let detail = match local {
                Err(e) => e,
                Ok(()) => format!("rank {bad} failed to join the NCCL communicator"),
            };
            return Err(transport("nccl init", rank, detail));
        }
        Ok(NcclComm {
            bootstrap,
            device,
            comm: comm as usize,
            buffers: Mutex::new(Buffers::default()),
            timeout: DEFAULT_TIMEOUT,
            aborted: AtomicBool::new(false),
        })
    }

    /// Sets the bound on the wait for one NCCL transfer (default [`DEFAULT_TIMEOUT`]): past
    /// it the communicator is aborted and the exchange fails with [`CommError::Timeout`].
    /// Every rank should use the same bound.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Checks over the bootstrap that every pair's sizes match (as the TCP transport does).
    fn check_sizes(&self, sends: &[SendBuf<'_>], recvs: &[RecvBuf<'_>]) -> Result<(), CommError> {
        let me = self.rank();
        let mut out: std::collections::BTreeMap<usize, Vec<u8>> = Default::default();
        for s in sends {
            out.entry(s.peer)
                .or_default()
                .extend((s.data.len() as u64).to_le_bytes());
        }
        let mut want: std::collections::BTreeMap<usize, Vec<u8>> = Default::default();
        for r in recvs {
            want.entry(r.peer)
                .or_default()
                .extend((r.buf.len() as u64).to_le_bytes());
        }
        let mut inbox: Vec<(usize, Vec<u8>)> =
            want.iter().map(|(p, v)| (*p, vec![0u8; v.len()])).collect();
        {
            let sends: Vec<SendBuf<'_>> = out
                .iter()
                .map(|(p, v)| SendBuf { peer: *p, data: v })
                .collect();
            let mut rb: Vec<RecvBuf<'_>> = inbox
                .iter_mut()
                .map(|(p, b)| RecvBuf { peer: *p, buf: b })
                .collect();
            self.bootstrap.exchange(&sends, &mut rb)?;
        }
        for (peer, got) in &inbox {
            if want.get(peer) != Some(got) {
                return Err(CommError::Mismatch {
                    op: "exchange",
                    rank: me,
                    detail: format!(
                        "the sizes rank {peer} sends differ from the sizes this rank receives from it"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Grows the buffers and uploads what this rank sends.
    fn prepare(&self, sends: &[SendBuf<'_>], recvs: &[RecvBuf<'_>]) -> Result<(), String> {
        if self.aborted.load(Ordering::Acquire) {
            return Err("the NCCL communicator was aborted after an earlier failure".into());
        }
        let world = self.world_size();
        let peers = sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer));
        if let Some(bad) = peers.into_iter().find(|&p| p >= world) {
            return Err(format!(
                "peer rank {bad} is not below the world size {world}"
            ));
        }
        let send_total: usize = sends.iter().map(|s| s.data.len()).sum();
        let recv_total: usize = recvs.iter().map(|r| r.buf.len()).sum();
        let total = send_total + recv_total;
        if total == 0 {
            return Ok(());
        }
        let mut g = self
            .buffers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let dev = &self.device;
        let err = |e: DeviceError| e.to_string();
        if g.device.is_none_or(|(_, len)| len < total) {
            if let Some((a, _)) = g.device.take() {
                // SAFETY: allocated below by this communicator, not in use.
                unsafe { dev.free(a) }.map_err(err)?;
            }
            g.device = Some((dev.alloc(total).map_err(err)?, total));
        }
        if g.pinned.as_ref().is_none_or(|p| p.len() < total) {
            g.pinned = None;
            g.pinned = Some(dev.pinned(total).map_err(err)?);
        }
        let (base, _) = g.device.ok_or("no device buffer")?;
        let pinned = g.pinned.as_mut().ok_or("no pinned buffer")?;
        let mut at = 0;
        for s in sends {
            pinned[at..at + s.data.len()].copy_from_slice(s.data);
            at += s.data.len();
        }
        let linear = |off: usize, len: usize| Pitched::linear(off, base + off as u64, len);
        if send_total > 0 {
            // SAFETY: the host range is in `pinned`, kept until the copy is waited on right
            // after; the device range is this communicator's buffer.
            let f =
                unsafe { dev.to_device(pinned.as_ptr(), &[linear(0, send_total)]) }.map_err(err)?;
            dev.wait(f).map_err(err)?;
        }
        Ok(())
    }

    /// The NCCL transfer (buffers prepared) and the download of what was received.
    fn nccl_exchange(
        &self,
        sends: &[SendBuf<'_>],
        recvs: &mut [RecvBuf<'_>],
    ) -> Result<(), CommError> {
        let send_total: usize = sends.iter().map(|s| s.data.len()).sum();
        let recv_total: usize = recvs.iter().map(|r| r.buf.len()).sum();
        if send_total + recv_total == 0 {
            return Ok(());
        }
        let rank = self.rank();
        let fail = |e: String| transport("exchange", rank, e);
        let mut g = self
            .buffers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let dev = &self.device;
        let err = |e: DeviceError| transport("exchange", rank, e);
        let (base, _) = g.device.ok_or_else(|| fail("no device buffer".into()))?;
        let pinned = g
            .pinned
            .as_mut()
            .ok_or_else(|| fail("no pinned buffer".into()))?;
        let linear = |off: usize, len: usize| Pitched::linear(off, base + off as u64, len);
        let stream = dev.raw_stream() as nsys::cudaStream_t;
        let comm = self.comm as nsys::ncclComm_t;
        let ty = nsys::ncclDataType_t::ncclUint8;
        nccl::group_start().map_err(|e| fail(format!("ncclGroupStart: {e:?}")))?;
        // `prepare` checked every peer is below the world size, which fits an i32.
        let peer = |p: usize| i32::try_from(p).map_err(|_| format!("peer rank {p} beyond i32"));
        let issue = || -> Result<(), String> {
            let mut off = 0usize;
            for s in sends {
                let p = (base + off as u64) as *const c_void;
                // SAFETY: device memory of this communicator, sized above.
                unsafe { nccl::send(p, s.data.len(), ty, peer(s.peer)?, comm, stream) }
                    .map_err(|e| format!("ncclSend to rank {}: {e:?}", s.peer))?;
                off += s.data.len();
            }
            for r in recvs.iter() {
                let p = (base + off as u64) as *mut c_void;
                // SAFETY: as above.
                unsafe { nccl::recv(p, r.buf.len(), ty, peer(r.peer)?, comm, stream) }
                    .map_err(|e| format!("ncclRecv from rank {}: {e:?}", r.peer))?;
                off += r.buf.len();
            }
            Ok(())
        };
        let issued = issue();
        let ended = nccl::group_end().map_err(|e| format!("ncclGroupEnd: {e:?}"));
        issued.map_err(fail)?;
        ended.map_err(fail)?;
        let fence = if recv_total > 0 {
            // SAFETY: as above; waited on right after (the pinned buffer is leaked, never
            // freed, if the wait fails).
            unsafe { dev.to_host(pinned.as_mut_ptr(), &[linear(send_total, recv_total)]) }
        } else {
            dev.record_fence()
        }
        .map_err(err)?;
        let mut transfer = Transfer {
            device: dev,
            fence: &fence,
            comm,
            aborted: &self.aborted,
        };
        wait_bounded(&mut transfer, "exchange", rank, self.timeout)?;
        // Complete: returns at once and releases the event.
        dev.wait(fence).map_err(err)?;
        let mut off = send_total;
        for r in recvs.iter_mut() {
            let n = r.buf.len();
            r.buf.copy_from_slice(&pinned[off..off + n]);
            off += n;
        }
        Ok(())
    }
}

/// One NCCL transfer in flight: its completion is the fence recorded after it on the stream.
struct Transfer<'a> {
    device: &'a CudaDevice,
    fence: &'a Fence,
    comm: nsys::ncclComm_t,
    aborted: &'a AtomicBool,
}

impl InFlight for Transfer<'_> {
    fn poll(&mut self) -> Result<bool, String> {
        self.device.query(self.fence).map_err(|e| e.to_string())
    }

    fn async_error(&mut self) -> Result<(), String> {
        let mut state = nsys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator (not aborted: the wait stops at the abort) and a valid
        // out-pointer.
        let call = unsafe { nsys::ncclCommGetAsyncError(self.comm, &raw mut state) };
        if call != nsys::ncclResult_t::ncclSuccess {
            return Err(format!("ncclCommGetAsyncError failed: {call:?}"));
        }
        match state {
            nsys::ncclResult_t::ncclSuccess | nsys::ncclResult_t::ncclInProgress => Ok(()),
            e => Err(format!(
                "NCCL reports {e:?} (a peer failed or the network broke)"
            )),
        }
    }

    fn abort(&mut self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: the communicator of this exchange; marked aborted above, so never used
            // (nor destroyed) afterwards.
            let _ = unsafe { nccl::comm_abort(self.comm) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let aborted = self.aborted.load(Ordering::Acquire);
        let g = self
            .buffers
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if aborted {
            // Work aborted mid-transfer may still be queued on the stream: leak the buffers
            // it could touch rather than free them under it. The handle is gone already.
            std::mem::forget(g.pinned.take());
            return;
        }
        if let Some((a, _)) = g.device.take() {
            // SAFETY: allocated by this communicator, not in use.
            let _ = unsafe { self.device.free(a) };
        }
        // SAFETY: created in `new`; not used afterwards.
        let _ = unsafe { nccl::comm_destroy(self.comm as nsys::ncclComm_t) };
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    fn world_size(&self) -> usize {
        self.bootstrap.world_size()
    }

    // The collectives: the shared ones, over the bootstrap's point-to-point transfers (small
    // control messages; NCCL carries the bulk exchange only).

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        collective::all_gather(&*self.bootstrap, data)
    }

    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, CommError> {
        collective::broadcast(&*self.bootstrap, root, data)
    }

    fn barrier(&self) -> Result<(), CommError> {
        collective::barrier(&*self.bootstrap)
    }

    fn all_reduce(&self, data: &[u8], merge: &Merge<'_>) -> Result<Vec<u8>, CommError> {
        collective::all_reduce(&*self.bootstrap, data, merge)
    }

    fn max_message(&self) -> u64 {
        self.bootstrap.max_message()
    }

    fn abort(&self, error: &CommError) {
        self.bootstrap.abort(error);
    }

    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        // Sizes checked and buffers ready on every rank before any NCCL call: a rank that
        // cannot go on must not leave the others blocked in ncclSend / ncclRecv.
        let ready = self
            .check_sizes(sends, recvs)
            .map_err(|e| e.to_string())
            .and_then(|()| self.prepare(sends, recvs));
        let bad = first_failed(&*self.bootstrap, ready.is_ok())?;
        match (ready, bad) {
            (Err(e), _) => return Err(transport("exchange", self.rank(), e)),
            (Ok(()), Some(bad)) => {
                return Err(transport(
                    "exchange",
                    self.rank(),
                    format!("rank {bad} could not set its NCCL transfer up"),
                ));
            }
            (Ok(()), None) => {}
        }
        let local = self.nccl_exchange(sends, recvs);
        // Every rank learns whether every rank's transfer went through.
        let bad = first_failed(&*self.bootstrap, local.is_ok())?;
        match (local, bad) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(bad)) => Err(transport(
                "exchange",
                self.rank(),
                format!("rank {bad}'s NCCL transfer failed"),
            )),
            (Ok(()), None) => Ok(()),
        }
    }
}
