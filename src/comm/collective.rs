//! The collectives, written once over a communicator's point-to-point
//! [`Communicator::exchange`]: a tree all-reduce, broadcast, all-gather and barrier.
//!
//! Every communicator of the crate uses these as they are (its transport's links are the
//! tree's edges). Ranks form a binary tree rooted at rank 0 (the parent of rank `r` is
//! `(r - 1) / 2`): contributions travel up, each
//! rank merging its children's partial results into its own, and the result travels down, so
//! a rank receives at most three values (two partial results and the result) whatever the
//! world size. A broadcast sends the root's data up its path to rank 0 (the other ranks send
//! a one-byte flag up), then down.
//!
//! Every message is a fixed [`HEADER_BYTES`]-byte header (operation, status, argument,
//! payload length) followed, in a second transfer, by its payload when there is one: the
//! receiver refuses a length above its limit ([`CommError::TooLarge`]) before allocating, and
//! a header of another operation or argument ([`CommError::Mismatch`]) before reading on.
//! A failure on one rank (a merge error, a lost or silent peer, a refused message) travels
//! up the tree in place of a value, and the root sends it down in place of the result, so
//! every rank fails with it: a rank learns an error it did not see itself as the same kind
//! of [`CommError`], its detail naming the rank that reported it.
//!
//! The transport's waits bound every step (its timeout names the peer waited for). What a
//! transport needs: a message sent in one `exchange` call is received in one `exchange` call
//! of the peer, in order per pair of ranks, and only the ranks with something to send or
//! receive call it. After a failed collective the state of the links is unspecified: callers
//! stop using the communicator (save and load do).

use super::{CommError, Communicator, Merge, RecvBuf, SendBuf};

/// Bytes of a message's header.
pub const HEADER_BYTES: usize = 16;

/// The largest message the collectives accept from a peer (as
/// [`TcpConfig::max_message_bytes`](super::TcpConfig::max_message_bytes) by default).
pub const MAX_MESSAGE: u64 = 4 << 30;

/// The most bytes of an error's text that travel between ranks.
const MAX_ERROR_TEXT: usize = 4096;

/// The largest failure report: its fixed fields and text.
const FAILURE_BYTES: u64 = 33 + MAX_ERROR_TEXT as u64;

const MAGIC: u8 = 0x5a;
const STATUS_VALUE: u8 = 0;
const STATUS_FAILED: u8 = 1;

/// The parent of `rank` in the collectives' tree (none for rank 0).
#[must_use]
pub fn tree_parent(rank: usize) -> Option<usize> {
    (rank > 0).then(|| (rank - 1) / 2)
}

/// The children of `rank` in the collectives' tree of `world` ranks (at most two).
pub fn tree_children(rank: usize, world: usize) -> impl Iterator<Item = usize> {
    [2 * rank + 1, 2 * rank + 2]
        .into_iter()
        .filter(move |&c| c < world)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    AllReduce = 1,
    AllGather = 2,
    Broadcast = 3,
    Barrier = 4,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        }
    }

    fn from_code(c: u8) -> Option<Op> {
        [Op::AllReduce, Op::AllGather, Op::Broadcast, Op::Barrier]
            .into_iter()
            .find(|o| *o as u8 == c)
    }
}

/// What travels on one link: a value, or a failure standing in for it (its error as this
/// rank reports it, and its wire form, forwarded unchanged so that it keeps its origin).
enum Msg {
    Value(Vec<u8>),
    Failed(CommError, Vec<u8>),
}

/// One collective call on one rank.
struct Call<'a, C: Communicator + ?Sized> {
    comm: &'a C,
    op: Op,
    arg: u32,
    /// The largest message accepted from a peer.
    limit: u64,
    /// Bytes the call adds to the caller's value in a message (not counted in errors).
    framing: u64,
    me: usize,
}

// Error kinds on the wire.
const K_MISMATCH: u8 = 0;
const K_TIMEOUT: u8 = 1;
const K_LOST: u8 = 2;
const K_UNRESPONSIVE: u8 = 3;
const K_TOO_LARGE: u8 = 4;
const K_OTHER: u8 = 5;

fn put(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

fn get(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at + 8)?;
    Some(u64::from_le_bytes(s.try_into().ok()?))
}

fn clip(s: &str) -> &str {
    if s.len() <= MAX_ERROR_TEXT {
        return s;
    }
    let mut end = MAX_ERROR_TEXT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The wire form of a failure first seen by rank `origin`: kind, peer, two numbers, origin,
/// then the detail's text.
fn encode_error(e: &CommError, origin: usize) -> Vec<u8> {
    let none = u64::MAX;
    let (kind, peer, a, b, detail): (u8, u64, u64, u64, String) = match e {
        CommError::Mismatch { detail, .. } => (K_MISMATCH, none, 0, 0, detail.clone()),
        CommError::Timeout { peer, after, .. } => (
            K_TIMEOUT,
            peer.map_or(none, |p| p as u64),
            u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
            0,
            String::new(),
        ),
        CommError::PeerLost { peer, detail, .. } => (K_LOST, *peer as u64, 0, 0, detail.clone()),
        CommError::Unresponsive {
            peer,
            silent_for,
            detail,
            ..
        } => (
            K_UNRESPONSIVE,
            *peer as u64,
            u64::try_from(silent_for.as_millis()).unwrap_or(u64::MAX),
            0,
            detail.clone(),
        ),
        CommError::TooLarge {
            peer,
            declared,
            limit,
            ..
        } => (K_TOO_LARGE, *peer as u64, *declared, *limit, String::new()),
        other => (K_OTHER, none, 0, 0, other.to_string()),
    };
    let mut v = vec![kind];
    for x in [peer, a, b, origin as u64] {
        put(&mut v, x);
    }
    v.extend_from_slice(clip(&detail).as_bytes());
    v
}

impl<'a, C: Communicator + ?Sized> Call<'a, C> {
    fn new(comm: &'a C, op: Op, arg: u32) -> Self {
        Call {
            comm,
            op,
            arg,
            limit: comm.max_message(),
            framing: 0,
            me: comm.rank(),
        }
    }

    /// Tells the transport when the call failed on this rank (see [`Communicator::abort`]).
    fn settle<T>(&self, r: Result<T, CommError>) -> Result<T, CommError> {
        if let Err(e) = &r {
            self.comm.abort(e);
        }
        r
    }

    fn mismatch(&self, detail: String) -> CommError {
        CommError::Mismatch {
            op: self.op.name(),
            rank: self.me,
            detail,
        }
    }

    /// A failure this rank saw itself, ready to travel.
    fn failed(&self, e: CommError) -> Msg {
        let wire = encode_error(&e, self.me);
        Msg::Failed(e, wire)
    }

    /// The error a failure's wire form stands for on this rank.
    fn decode_error(&self, from: usize, b: &[u8]) -> CommError {
        let op = self.op.name();
        let rank = self.me;
        let (Some(&kind), Some(peer), Some(a), Some(bb), Some(origin)) =
            (b.first(), get(b, 1), get(b, 9), get(b, 17), get(b, 25))
        else {
            return self.mismatch(format!("rank {from} sent a malformed failure report"));
        };
        let text = String::from_utf8_lossy(&b[33..]);
        let detail = format!("rank {origin} reports: {text}");
        let peer_of = |p: u64| usize::try_from(p).ok();
        let ms = std::time::Duration::from_millis;
        match (kind, peer_of(peer)) {
            (K_MISMATCH, _) => CommError::Mismatch { op, rank, detail },
            (K_TIMEOUT, p) => CommError::Timeout {
                op,
                rank,
                peer: p,
                after: ms(a),
            },
            (K_LOST, Some(peer)) => CommError::PeerLost {
                op,
                rank,
                peer,
                detail,
            },
            (K_UNRESPONSIVE, Some(peer)) => CommError::Unresponsive {
                op,
                rank,
                peer,
                silent_for: ms(a),
                detail,
            },
            (K_TOO_LARGE, Some(peer)) => CommError::TooLarge {
                op,
                rank,
                peer,
                declared: a,
                limit: bb,
            },
            _ => CommError::Transport { op, rank, detail },
        }
    }

    fn header(&self, status: u8, len: usize) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0] = MAGIC;
        h[1] = self.op as u8;
        h[2] = status;
        h[4..8].copy_from_slice(&self.arg.to_le_bytes());
        h[8..].copy_from_slice(&(len as u64).to_le_bytes());
        h
    }

    /// Sends `msg` to every peer of `peers`: the headers in one transfer, then the payloads.
    fn send(&self, peers: &[usize], msg: &Msg) -> Result<(), CommError> {
        if peers.is_empty() {
            return Ok(());
        }
        let (status, payload) = match msg {
            Msg::Value(v) => (STATUS_VALUE, &v[..]),
            Msg::Failed(_, wire) => (STATUS_FAILED, &wire[..]),
        };
        let h = self.header(status, payload.len());
        let sends: Vec<SendBuf<'_>> = peers
            .iter()
            .map(|&peer| SendBuf { peer, data: &h })
            .collect();
        self.comm.exchange(&sends, &mut [])?;
        if payload.is_empty() {
            return Ok(());
        }
        let sends: Vec<SendBuf<'_>> = peers
            .iter()
            .map(|&peer| SendBuf {
                peer,
                data: payload,
            })
            .collect();
        self.comm.exchange(&sends, &mut [])
    }

    /// Receives one message from every peer of `peers`, in their order.
    fn recv(&self, peers: &[usize]) -> Result<Vec<Msg>, CommError> {
        if peers.is_empty() {
            return Ok(Vec::new());
        }
        let mut heads = vec![[0u8; HEADER_BYTES]; peers.len()];
        let mut recvs: Vec<RecvBuf<'_>> = heads
            .iter_mut()
            .zip(peers)
            .map(|(h, &peer)| RecvBuf { peer, buf: h })
            .collect();
        self.comm.exchange(&[], &mut recvs)?;
        drop(recvs);
        let mut statuses = Vec::with_capacity(peers.len());
        let mut bufs = Vec::with_capacity(peers.len());
        for (h, &peer) in heads.iter().zip(peers) {
            let theirs = Op::from_code(h[1]);
            if h[0] != MAGIC || theirs.is_none() || h[2] > STATUS_FAILED {
                return Err(self.mismatch(format!(
                    "rank {peer} sent a message that is not a collective's header"
                )));
            }
            if theirs != Some(self.op) {
                return Err(self.mismatch(format!(
                    "rank {peer} called {} where this rank called {}",
                    theirs.map_or("?", Op::name),
                    self.op.name()
                )));
            }
            let arg = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
            if arg != self.arg {
                return Err(self.mismatch(format!(
                    "rank {peer} passed root {arg} where this rank passed root {}",
                    self.arg
                )));
            }
            let len = u64::from_le_bytes(h[8..].try_into().unwrap_or([0; 8]));
            // A failure report has its own bound (its text is clipped by the sender).
            let limit = if h[2] == STATUS_FAILED {
                FAILURE_BYTES
            } else {
                self.limit
            };
            if len > limit {
                let framing = if h[2] == STATUS_FAILED {
                    0
                } else {
                    self.framing
                };
                return Err(CommError::TooLarge {
                    op: self.op.name(),
                    rank: self.me,
                    peer,
                    declared: len - framing,
                    limit: limit - framing,
                });
            }
            let len = usize::try_from(len).map_err(|_| CommError::TooLarge {
                op: self.op.name(),
                rank: self.me,
                peer,
                declared: len,
                limit: usize::MAX as u64,
            })?;
            statuses.push(h[2]);
            bufs.push(vec![0u8; len]);
        }
        let mut recvs: Vec<RecvBuf<'_>> = bufs
            .iter_mut()
            .zip(peers)
            .filter(|(b, _)| !b.is_empty())
            .map(|(b, &peer)| RecvBuf { peer, buf: b })
            .collect();
        if !recvs.is_empty() {
            self.comm.exchange(&[], &mut recvs)?;
        }
        drop(recvs);
        Ok(bufs
            .into_iter()
            .zip(statuses)
            .zip(peers)
            .map(|((b, s), &peer)| {
                if s == STATUS_VALUE {
                    Msg::Value(b)
                } else {
                    let e = self.decode_error(peer, &b);
                    Msg::Failed(e, b)
                }
            })
            .collect())
    }

    /// The peer a transport error names, if any (no more is sent to it).
    fn culprit(e: &CommError) -> Option<usize> {
        match e {
            CommError::Timeout { peer, .. } => *peer,
            CommError::PeerLost { peer, .. } | CommError::Unresponsive { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// Up the tree with `mine`, folding the children's messages in with `fold`; returns what
    /// comes down from rank 0.
    fn up_down(
        &self,
        mine: Vec<u8>,
        fold: &dyn Fn(Vec<u8>, usize, Vec<u8>) -> Result<Vec<u8>, String>,
    ) -> Result<Vec<u8>, CommError> {
        let world = self.comm.world_size();
        let children: Vec<usize> = tree_children(self.me, world).collect();
        let mut dead: Option<usize> = None;
        let mut up = Msg::Value(mine);
        match self.recv(&children) {
            Ok(msgs) => {
                for (m, &child) in msgs.into_iter().zip(&children) {
                    up = match (up, m) {
                        (f @ Msg::Failed(..), _) | (Msg::Value(_), f @ Msg::Failed(..)) => f,
                        (Msg::Value(acc), Msg::Value(v)) => match fold(acc, child, v) {
                            Ok(acc) => Msg::Value(acc),
                            Err(e) => self.failed(self.mismatch(format!(
                                "what rank {child} sent (its subtree's contributions) does not combine: {e}"
                            ))),
                        },
                    };
                }
            }
            Err(e) => {
                dead = Self::culprit(&e);
                up = self.failed(e);
            }
        }
        let down = match tree_parent(self.me) {
            None => up,
            Some(p) => match self.send(&[p], &up) {
                // Without a parent, the failure goes down from here.
                Err(e) => self.failed(e),
                Ok(()) => match (self.recv(&[p]), up) {
                    (Ok(mut got), _) => got.pop().unwrap_or_else(|| {
                        self.failed(self.mismatch(format!("nothing came back from rank {p}")))
                    }),
                    // This rank's own failure says more than its parent's giving up.
                    (Err(_), own @ Msg::Failed(..)) => own,
                    (Err(e), Msg::Value(_)) => self.failed(e),
                },
            },
        };
        let to: Vec<usize> = children.into_iter().filter(|&c| Some(c) != dead).collect();
        let sent = self.send(&to, &down);
        match down {
            Msg::Value(v) => sent.map(|()| v),
            Msg::Failed(e, _) => Err(e),
        }
    }
}

/// Combines every rank's `data` with `merge` up the tree; every rank returns the result (see
/// [`Communicator::all_reduce`]). A failed merge fails every rank with
/// [`CommError::Mismatch`].
///
/// # Errors
/// A failure of the transport on any rank, a mismatch or a failed merge, on every rank
/// that can still be reached.
pub fn all_reduce<C: Communicator + ?Sized>(
    comm: &C,
    data: &[u8],
    merge: &Merge<'_>,
) -> Result<Vec<u8>, CommError> {
    let call = Call::new(comm, Op::AllReduce, 0);
    call.settle(call.up_down(data.to_vec(), &|acc, _, v| merge(&acc, &v)))
}

/// Every rank's `data`, indexed by rank, on every rank (gathered up the tree, sent down).
///
/// # Errors
/// As [`all_reduce`].
pub fn all_gather<C: Communicator + ?Sized>(
    comm: &C,
    data: &[u8],
) -> Result<Vec<Vec<u8>>, CommError> {
    let call = Call::new(comm, Op::AllGather, 0);
    call.settle(gather(&call, data))
}

fn gather<C: Communicator + ?Sized>(
    call: &Call<'_, C>,
    data: &[u8],
) -> Result<Vec<Vec<u8>>, CommError> {
    let world = call.comm.world_size();
    let mut mine = Vec::with_capacity(data.len() + 16);
    put(&mut mine, call.me as u64);
    put(&mut mine, data.len() as u64);
    mine.extend_from_slice(data);
    let all = call.up_down(mine, &|mut acc, _, v| {
        acc.extend_from_slice(&v);
        Ok(acc)
    })?;
    let mut parts: Vec<Option<Vec<u8>>> = vec![None; world];
    let mut at = 0usize;
    while at < all.len() {
        let (Some(r), Some(n)) = (get(&all, at), get(&all, at + 8)) else {
            return Err(call.mismatch("a gathered part is cut short".into()));
        };
        let r = usize::try_from(r).unwrap_or(usize::MAX);
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| (at + 16).checked_add(n))
            .filter(|&e| e <= all.len());
        let Some(end) = end else {
            return Err(call.mismatch("a gathered part is cut short".into()));
        };
        match parts.get_mut(r) {
            Some(slot @ None) => *slot = Some(all[at + 16..end].to_vec()),
            _ => {
                return Err(call.mismatch(format!(
                    "the gathered parts name rank {r} twice or out of range"
                )));
            }
        }
        at = end;
    }
    parts
        .into_iter()
        .enumerate()
        .map(|(r, p)| p.ok_or_else(|| call.mismatch(format!("no part of rank {r} was gathered"))))
        .collect()
}

/// `root`'s `data` on every rank (other ranks' `data` is ignored).
///
/// # Errors
/// As [`all_reduce`]; a root out of range or different on different ranks is a
/// [`CommError::Mismatch`].
pub fn broadcast<C: Communicator + ?Sized>(
    comm: &C,
    root: usize,
    data: &[u8],
) -> Result<Vec<u8>, CommError> {
    broadcast_within(comm, root, data, comm.max_message())
}

/// [`broadcast`], refusing any message above `limit` bytes ([`CommError::TooLarge`]): for a
/// transport's own setup, where the largest valid message is known (an address table).
///
/// # Errors
/// As [`broadcast`].
pub fn broadcast_within<C: Communicator + ?Sized>(
    comm: &C,
    root: usize,
    data: &[u8],
    limit: u64,
) -> Result<Vec<u8>, CommError> {
    let world = comm.world_size();
    let arg = u32::try_from(root).unwrap_or(u32::MAX);
    let mut call = Call::new(comm, Op::Broadcast, arg);
    // The value travels after a one-byte flag.
    call.limit = limit.saturating_add(1);
    call.framing = 1;
    if root >= world {
        let e = call.mismatch(format!("root {root} out of range for world size {world}"));
        return call.settle(Err(e));
    }
    // Up the path from the root to rank 0 (every link carries a header naming the root, so
    // ranks passing different roots fail), then down the tree.
    let mine = if call.me == root {
        let mut v = Vec::with_capacity(data.len() + 1);
        v.push(1);
        v.extend_from_slice(data);
        v
    } else {
        vec![0]
    };
    let got = call.up_down(mine, &|acc, _, v| {
        Ok(if v.first() == Some(&1) { v } else { acc })
    });
    let got = got.and_then(|mut got| {
        if got.first() != Some(&1) {
            return Err(call.mismatch(format!("rank {root}'s data did not arrive")));
        }
        got.remove(0);
        Ok(got)
    });
    call.settle(got)
}

/// Returns once every rank has called it.
///
/// # Errors
/// As [`all_reduce`].
pub fn barrier<C: Communicator + ?Sized>(comm: &C) -> Result<(), CommError> {
    let call = Call::new(comm, Op::Barrier, 0);
    call.settle(call.up_down(Vec::new(), &|acc, _, _| Ok(acc)).map(|_| ()))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::comm::{DEFAULT_TIMEOUT, LocalComm, run_local};

    /// A transport only: LocalComm's point-to-point transfers, counting the bytes received,
    /// with every collective the shared one.
    struct P2p {
        inner: LocalComm,
        received: AtomicU64,
    }

    impl P2p {
        fn new(inner: LocalComm) -> P2p {
            P2p {
                inner,
                received: AtomicU64::new(0),
            }
        }
    }

    impl Communicator for P2p {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn exchange(
            &self,
            sends: &[SendBuf<'_>],
            recvs: &mut [RecvBuf<'_>],
        ) -> Result<(), CommError> {
            let n: usize = recvs.iter().map(|r| r.buf.len()).sum();
            self.received.fetch_add(n as u64, Ordering::Relaxed);
            self.inner.exchange(sends, recvs)
        }
    }

    /// Sums of little-endian u64s: associative and commutative.
    fn sum(a: &[u8], b: &[u8]) -> Result<Vec<u8>, String> {
        let x = u64::from_le_bytes(a.try_into().map_err(|_| "not 8 bytes")?);
        let y = u64::from_le_bytes(b.try_into().map_err(|_| "not 8 bytes")?);
        Ok((x + y).to_le_bytes().to_vec())
    }

    #[test]
    fn tree_collectives_at_every_world_size_up_to_17() {
        for world in 1..=17usize {
            let out = run_local(world, DEFAULT_TIMEOUT, |c| {
                let c = P2p::new(c);
                let me = c.rank();
                let total = all_reduce(&c, &(me as u64 + 1).to_le_bytes(), &sum).unwrap();
                let reduce_bytes = c.received.swap(0, Ordering::Relaxed);
                // Different lengths on different ranks, the empty one included.
                let mine: Vec<u8> = (0..me).map(|i| (me * 7 + i) as u8).collect();
                let all = all_gather(&c, &mine).unwrap();
                let root = world / 2;
                let b = broadcast(&c, root, &[me as u8; 3]).unwrap();
                barrier(&c).unwrap();
                (total, reduce_bytes, all, b)
            });
            let want_total = (world * (world + 1) / 2) as u64;
            for (me, (total, bytes, all, b)) in out.into_iter().enumerate() {
                assert_eq!(total, want_total.to_le_bytes(), "world {world} rank {me}");
                // Children's partial results and the result: at most 3 headers and values.
                let msgs = tree_children(me, world).count() + usize::from(me > 0);
                assert_eq!(
                    bytes,
                    (msgs * (HEADER_BYTES + 8)) as u64,
                    "world {world} rank {me}"
                );
                for (r, part) in all.iter().enumerate() {
                    let want: Vec<u8> = (0..r).map(|i| (r * 7 + i) as u8).collect();
                    assert_eq!(part, &want, "world {world} rank {me} part {r}");
                }
                assert_eq!(b, vec![(world / 2) as u8; 3], "world {world} rank {me}");
            }
        }
    }

    #[test]
    fn bytes_received_stay_bounded_as_the_world_grows() {
        // 1 KiB descriptions: the busiest rank receives three of them whatever the world.
        for world in [2usize, 5, 16, 17] {
            let out = run_local(world, DEFAULT_TIMEOUT, |c| {
                let c = P2p::new(c);
                let d = vec![c.rank() as u8; 1024];
                let max = |a: &[u8], b: &[u8]| -> Result<Vec<u8>, String> {
                    Ok(a.iter().zip(b).map(|(x, y)| *x.max(y)).collect())
                };
                let r = all_reduce(&c, &d, &max).unwrap();
                assert_eq!(r, vec![(world - 1) as u8; 1024]);
                c.received.load(Ordering::Relaxed)
            });
            let busiest = out.into_iter().max().unwrap_or(0);
            assert!(
                busiest <= 3 * (1024 + HEADER_BYTES as u64),
                "world {world}: {busiest}"
            );
        }
    }

    #[test]
    fn a_merge_error_fails_every_rank() {
        for world in [2usize, 3, 7, 17] {
            let bad = world - 1; // a leaf, far from the root
            let out = run_local(world, Duration::from_secs(20), |c| {
                let c = P2p::new(c);
                let mine = if c.rank() == bad {
                    vec![1u8; 3]
                } else {
                    1u64.to_le_bytes().to_vec()
                };
                all_reduce(&c, &mine, &sum)
            });
            for (r, res) in out.into_iter().enumerate() {
                match res {
                    Err(CommError::Mismatch { rank, detail, .. }) => {
                        assert_eq!(rank, r);
                        assert!(detail.contains("does not combine"), "{detail}");
                        assert!(detail.contains("not 8 bytes"), "{detail}");
                    }
                    other => panic!("world {world} rank {r}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn a_dead_rank_fails_every_rank_naming_it() {
        let t0 = Instant::now();
        let out = run_local(7, Duration::from_secs(30), |c| {
            let c = P2p::new(c);
            if c.rank() == 4 {
                drop(c);
                return None;
            }
            Some(all_reduce(&c, &1u64.to_le_bytes(), &sum))
        });
        assert!(t0.elapsed() < Duration::from_secs(10));
        for (r, res) in out.into_iter().enumerate() {
            if r == 4 {
                continue;
            }
            match res {
                Some(Err(CommError::PeerLost { peer: 4, rank, .. })) => assert_eq!(rank, r),
                other => panic!("rank {r}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_silent_rank_is_a_timeout_not_a_hang() {
        let t0 = Instant::now();
        let out = run_local(5, Duration::from_millis(300), |c| {
            let c = P2p::new(c);
            if c.rank() == 3 {
                std::thread::sleep(Duration::from_millis(1500));
                return None;
            }
            Some(all_reduce(&c, &1u64.to_le_bytes(), &sum))
        });
        assert!(t0.elapsed() < Duration::from_secs(10));
        // Rank 1 waits for its child 3 and names it; the others learn it from rank 1, or give
        // up waiting for their parent (who may give up at the same time: PeerLost).
        match &out[1] {
            Some(Err(CommError::Timeout {
                peer: Some(3),
                rank: 1,
                ..
            })) => {}
            other => panic!("rank 1: {other:?}"),
        }
        for (r, res) in out.iter().enumerate() {
            if r != 3 {
                assert!(
                    matches!(
                        res,
                        Some(Err(CommError::Timeout { .. } | CommError::PeerLost { .. }))
                    ),
                    "rank {r}: {res:?}"
                );
            }
        }
    }

    #[test]
    fn mismatches_and_limits_are_errors() {
        // One rank calls a barrier, the others an all-reduce.
        let out = run_local(3, Duration::from_secs(5), |c| {
            let c = P2p::new(c);
            if c.rank() == 2 {
                barrier(&c).err()
            } else {
                all_reduce(&c, &1u64.to_le_bytes(), &sum).err()
            }
        });
        assert!(
            out.iter()
                .flatten()
                .any(|e| matches!(e, CommError::Mismatch { detail, .. } if detail.contains("called barrier"))),
            "{out:?}"
        );
        // Different roots.
        let out = run_local(3, Duration::from_secs(5), |c| {
            let c = P2p::new(c);
            broadcast(&c, usize::from(c.rank() == 0), b"x").err()
        });
        assert!(
            out.iter()
                .flatten()
                .any(|e| matches!(e, CommError::Mismatch { .. })),
            "{out:?}"
        );
        let c = P2p::new(LocalComm::single());
        assert!(matches!(
            broadcast(&c, 1, b"x"),
            Err(CommError::Mismatch { .. })
        ));
        // A header announcing more than the limit is refused before allocating, and the
        // refusal reaches the sender too.
        let out = run_local(2, Duration::from_secs(5), |c| {
            let c = P2p::new(c);
            let mut call = Call::new(&c, Op::AllReduce, 0);
            call.limit = 8;
            let mine = vec![0u8; if c.rank() == 1 { 9 } else { 8 }];
            call.up_down(mine, &|a, _, _| Ok(a))
        });
        match &out[0] {
            Err(CommError::TooLarge {
                peer: 1,
                declared: 9,
                limit: 8,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(
                &out[1],
                Err(CommError::TooLarge {
                    rank: 1,
                    peer: 1,
                    ..
                })
            ),
            "{:?}",
            out[1]
        );
    }

    #[test]
    fn local_comm_all_reduce_is_the_tree() {
        let out = run_local(6, DEFAULT_TIMEOUT, |c| {
            c.all_reduce(&(c.rank() as u64).to_le_bytes(), &sum)
                .unwrap()
        });
        assert!(out.iter().all(|v| v == &15u64.to_le_bytes()));
    }
}
