//! Executing a transfer plan on one rank: per round, a trainer rank packs the boxes it sends
//! (one message per receiver), an engine rank receives one message per sender and copies each
//! box into its buffer through the conversion's own piece copy (transpose, value ops, casts).

use super::error::TransferError;
use super::plan::{split, sub_dbox};
use super::rank::RankPlan;
use std::ops::Range;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use crate::comm::{CommError, Communicator, RecvBuf, SendBuf};
use crate::convert::exec::copy_piece;
use crate::convert::geom::{Bx, copy_box};
use crate::convert::table::ValueOp;
use crate::convert::{Dest, Piece};
use crate::model::{DType, ShardedTensor, usize_of};

/// Messages of one round: (peer, bytes), in plan order.
pub type Messages = Vec<(usize, u64)>;

/// A box this rank sends.
#[derive(Debug, Clone)]
pub(crate) struct SendItem {
    piece: usize,
    sbox: Bx,
    bytes: u64,
}

/// A box this rank receives.
#[derive(Debug, Clone)]
pub(crate) struct RecvItem {
    local: usize,
    cut: Piece,
    src_dtype: DType,
    bytes: u64,
}

/// This rank's part of a plan: what it sends and receives per round (per peer, in the order
/// both ends agree on), and for an engine rank its destinations.
#[derive(Debug, Clone, Default)]
pub struct LocalPlan {
    pub(crate) rounds: usize,
    pub(crate) sends: Vec<Vec<(usize, Vec<SendItem>)>>,
    pub(crate) recvs: Vec<Vec<(usize, Vec<RecvItem>)>>,
    /// Engine: its destinations in declaration order (data type of its buffer, no pieces).
    pub(crate) dests: Vec<Dest>,
    /// Engine: destinations with padding (zeroed before the first round).
    pub(crate) zero: Vec<usize>,
    /// Engine: destinations complete after each round (the last entry: complete with no
    /// moves at all, reported after the first round or at once when there is none).
    pub(crate) completes: Vec<Vec<usize>>,
    /// Bytes this rank sends / receives in all.
    pub(crate) bytes_sent: u64,
    pub(crate) bytes_received: u64,
    /// The busiest sender's bytes and the total bytes moved (for reports).
    pub(crate) busiest_sent: u64,
    pub(crate) total_bytes: u64,
}

impl LocalPlan {
    /// Schedules rank `rp.me`'s moves: each pair's moves, in the order both ends derived,
    /// are cut into boxes of at most `chunk` bytes and packed in order into one message of at
    /// most `chunk` bytes per round, so both ends of every pair put the same bytes in the same
    /// round without knowing any other pair. With `chunk` the bucket over the largest number
    /// of peers of any rank, no rank sends or receives more than the bucket in a round (an
    /// element, 8 bytes at most, per peer when the bucket is smaller). `busiest` and `total`
    /// are the agreed bytes of the busiest sender and of all senders (for reports).
    #[must_use]
    pub fn schedule(rp: &RankPlan, chunk: u64, busiest: u64, total: u64) -> LocalPlan {
        let chunk = chunk.max(8);
        let me = rp.me;
        let mut lp = LocalPlan {
            dests: rp.dests.clone(),
            zero: rp.zero.clone(),
            busiest_sent: busiest,
            total_bytes: total,
            ..LocalPlan::default()
        };
        let mut last: Vec<Option<usize>> = vec![None; rp.dests.len()];
        let mut at = 0;
        while at < rp.moves.len() {
            let first = &rp.moves[at];
            let sending = first.src == me;
            let peer = if sending { first.dst } else { first.src };
            let mut end = at;
            while end < rp.moves.len()
                && (if sending {
                    rp.moves[end].dst
                } else {
                    rp.moves[end].src
                }) == peer
            {
                end += 1;
            }
            let (mut round, mut fill) = (0usize, 0u64);
            let mut cuts = Vec::new();
            for m in &rp.moves[at..end] {
                let dt = rp.src_dtypes[m.cut.src];
                let es = dt.size() as u64;
                cuts.clear();
                split(&m.cut.sbox, es, chunk, &mut cuts);
                for c in cuts.drain(..) {
                    let bytes = c.volume() * es;
                    if fill > 0 && fill + bytes > chunk {
                        round += 1;
                        fill = 0;
                    }
                    fill += bytes;
                    let n = if sending {
                        lp.sends.len()
                    } else {
                        lp.recvs.len()
                    };
                    if n <= round {
                        lp.sends.resize(round + 1, Vec::new());
                        lp.recvs.resize(round + 1, Vec::new());
                    }
                    if sending && lp.sends[round].last().is_none_or(|(p, _)| *p != peer) {
                        lp.sends[round].push((peer, Vec::new()));
                    }
                    if !sending && lp.recvs[round].last().is_none_or(|(p, _)| *p != peer) {
                        lp.recvs[round].push((peer, Vec::new()));
                    }
                    if sending {
                        lp.bytes_sent += bytes;
                        if let Some((_, v)) = lp.sends[round].last_mut() {
                            v.push(SendItem {
                                piece: m.piece,
                                sbox: c,
                                bytes,
                            });
                        }
                    } else {
                        lp.bytes_received += bytes;
                        if let Some(l) = last.get_mut(m.local) {
                            *l = Some(l.map_or(round, |x| x.max(round)));
                        }
                        if let Some((_, v)) = lp.recvs[round].last_mut() {
                            v.push(RecvItem {
                                local: m.local,
                                cut: Piece {
                                    dbox: sub_dbox(&m.cut, &c),
                                    sbox: c,
                                    ..m.cut.clone()
                                },
                                src_dtype: dt,
                                bytes,
                            });
                        }
                    }
                }
            }
            at = end;
        }
        lp.rounds = lp.sends.len().max(lp.recvs.len());
        lp.sends.resize(lp.rounds, Vec::new());
        lp.recvs.resize(lp.rounds, Vec::new());
        lp.completes = vec![Vec::new(); lp.rounds + 1];
        for (local, l) in last.iter().enumerate() {
            lp.completes[l.unwrap_or(lp.rounds)].push(local);
        }
        lp
    }

    /// Number of rounds.
    #[must_use]
    pub fn rounds(&self) -> usize {
        self.rounds
    }

    /// Round `r`'s messages: (peer, bytes) sent and (peer, bytes) received, in plan order.
    #[must_use]
    pub fn messages(&self, r: usize) -> (Messages, Messages) {
        let sizes = |v: &[(usize, Vec<SendItem>)]| -> Vec<(usize, u64)> {
            v.iter()
                .map(|(p, items)| (*p, items.iter().map(|i| i.bytes).sum()))
                .collect()
        };
        let rsizes = |v: &[(usize, Vec<RecvItem>)]| -> Vec<(usize, u64)> {
            v.iter()
                .map(|(p, items)| (*p, items.iter().map(|i| i.bytes).sum()))
                .collect()
        };
        (
            self.sends.get(r).map_or_else(Vec::new, |v| sizes(v)),
            self.recvs.get(r).map_or_else(Vec::new, |v| rsizes(v)),
        )
    }

    /// Round `r`'s point-to-point messages as they travel (spec § 21.2: a box of at least
    /// 64 KiB alone, runs of smaller ones together): (peer, bytes) sent and received, in
    /// order per peer.
    #[must_use]
    pub fn frames(&self, r: usize) -> (Messages, Messages) {
        fn on_wire<T>(v: &[(usize, Vec<T>)], bytes: impl Fn(&T) -> u64) -> Messages {
            v.iter()
                .flat_map(|(p, items)| {
                    let sizes: Vec<u64> = items.iter().map(&bytes).collect();
                    messages(&sizes, OWN_MESSAGE)
                        .into_iter()
                        .map(move |m| (*p, m.bytes))
                })
                .collect()
        }
        (
            self.sends
                .get(r)
                .map_or_else(Vec::new, |v| on_wire(v.as_slice(), |i| i.bytes)),
            self.recvs
                .get(r)
                .map_or_else(Vec::new, |v| on_wire(v.as_slice(), |i| i.bytes)),
        )
    }

    /// Bytes this rank sends.
    #[must_use]
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Bytes this rank receives.
    #[must_use]
    pub fn bytes_received(&self) -> u64 {
        self.bytes_received
    }

    /// Engine: the destinations (name, data type of the buffer, shape), in declaration order.
    #[must_use]
    pub fn dests(&self) -> &[Dest] {
        &self.dests
    }
}

/// Where an engine rank's bytes go.
///
/// # Safety
/// The transfer asks [`Sink::buffer`] for a destination's memory once, then writes into it
/// (from a second thread too, receiving straight into it) until it reports the destination
/// complete through [`Sink::complete`]. Until then, an implementation must keep that memory
/// allocated and in place (never reallocate or free it, whatever later calls of `buffer` or
/// `complete` for other destinations do) and must not read or write it.
pub unsafe trait Sink {
    /// The buffer of destination `local` ([`Dest::nbytes`] bytes); zeroed on first use when
    /// the sink allocates it. See the trait's safety contract.
    fn buffer(&mut self, local: usize) -> &mut [u8];

    /// Destinations `locals` are complete (every byte received).
    ///
    /// # Errors
    /// What the consumer returns; it ends the transfer on this rank.
    fn complete(&mut self, locals: &[usize]) -> Result<(), TransferError>;
}

/// A sink over caller buffers (filled in place).
pub struct Buffers<'b, 'a> {
    /// One buffer per destination, in declaration order.
    pub bufs: &'b mut [&'a mut [u8]],
}

// SAFETY: the caller's buffers are borrowed for the sink's lifetime and never touched by it.
unsafe impl Sink for Buffers<'_, '_> {
    fn buffer(&mut self, local: usize) -> &mut [u8] {
        self.bufs[local]
    }

    fn complete(&mut self, _: &[usize]) -> Result<(), TransferError> {
        Ok(())
    }
}

/// Items of at least this many bytes travel as messages of their own: sent straight from the
/// source's memory and received straight into the destination's when their bytes lie there
/// contiguously and need no conversion. Smaller items travel packed together (a frame and a
/// wake-up per item would cost more than copying them).
const OWN_MESSAGE: u64 = 64 << 10;

/// One message to or from a peer in a round: its items, its bytes, and when it is sent from
/// or received into memory directly, the source piece or destination and the byte offset
/// there.
#[derive(Debug, Clone)]
struct Msg {
    items: Range<usize>,
    bytes: u64,
    direct: Option<(usize, usize)>,
}

/// Cuts one peer's items of a round into messages, in order: an item of at least
/// `own` bytes (normally [`OWN_MESSAGE`]) alone, each run of smaller ones together. Both ends of a pair derive
/// the same messages from the same item sizes, whatever each does with them.
fn messages(sizes: &[u64], own: u64) -> Vec<Msg> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < sizes.len() {
        let mut j = i + 1;
        if sizes[i] < own {
            while j < sizes.len() && sizes[j] < own {
                j += 1;
            }
        }
        out.push(Msg {
            items: i..j,
            bytes: sizes[i..j].iter().sum(),
            direct: None,
        });
        i = j;
    }
    out
}

/// The byte offset of box `b` (elements of `esize` bytes) in a C-order array of shape
/// `shape`, when the box's elements lie there contiguously in C order.
fn contiguous_at(shape: &[u64], b: &Bx, esize: usize) -> Option<usize> {
    if b.len.len() != shape.len() || b.off.len() != shape.len() {
        return None;
    }
    if let Some(k) = b.len.iter().position(|&l| l != 1)
        && b.len[k + 1..] != shape[k + 1..]
    {
        return None;
    }
    let (mut off, mut stride) = (0u64, 1u64);
    for d in (0..shape.len()).rev() {
        off = off.checked_add(b.off[d].checked_mul(stride)?)?;
        stride = stride.checked_mul(shape[d])?;
    }
    usize::try_from(off.checked_mul(esize as u64)?).ok()
}

/// The extents of a box other than 1: two boxes with the same ones list their elements in
/// the same C order.
fn squeezed(len: &[u64]) -> Vec<u64> {
    len.iter().copied().filter(|&l| l != 1).collect()
}

/// Trainer: round `r`'s messages per receiver; a message of one item whose source box lies
/// contiguously in its piece's memory is sent from there.
fn send_messages(
    items: &[(usize, Vec<SendItem>)],
    boxes: &[ShardedTensor<'_>],
    own: u64,
) -> Vec<(usize, Vec<Msg>)> {
    items
        .iter()
        .map(|(peer, v)| {
            let sizes: Vec<u64> = v.iter().map(|s| s.bytes).collect();
            let mut msgs = messages(&sizes, own);
            for m in &mut msgs {
                if m.items.len() != 1 {
                    continue;
                }
                let s = &v[m.items.start];
                let Some(p) = boxes.get(s.piece) else {
                    continue;
                };
                let r = p.region();
                let origin = Bx {
                    off: r.offset().to_vec(),
                    len: r.shape().to_vec(),
                };
                m.direct =
                    contiguous_at(&origin.len, &s.sbox.relative_to(&origin), p.dtype().size())
                        .filter(|&at| at + usize_of(s.bytes) <= p.data().len())
                        .map(|at| (s.piece, at));
            }
            (*peer, msgs)
        })
        .collect()
}

/// Engine: round `r`'s messages per sender; a message of one item that lands unconverted
/// (same data type, no value change, no transpose) in a contiguous part of its destination
/// is received there.
fn recv_messages(
    items: &[(usize, Vec<RecvItem>)],
    dests: &[Dest],
    own: u64,
) -> Vec<(usize, Vec<Msg>)> {
    items
        .iter()
        .map(|(peer, v)| {
            let sizes: Vec<u64> = v.iter().map(|s| s.bytes).collect();
            let mut msgs = messages(&sizes, own);
            for m in &mut msgs {
                if m.items.len() != 1 {
                    continue;
                }
                let it = &v[m.items.start];
                let Some(d) = dests.get(it.local) else {
                    continue;
                };
                let plain = it.src_dtype == d.dtype
                    && d.value
                        .iter()
                        .all(|v| matches!(v, ValueOp::Add(c) if *c == 0.0))
                    && !it.cut.transpose
                    && it.cut.scale.is_none()
                    && squeezed(&it.cut.sbox.len) == squeezed(&it.cut.dbox.len);
                if !plain {
                    continue;
                }
                m.direct = contiguous_at(&d.region.len, &it.cut.dbox, d.dtype.size())
                    .filter(|&at| at + usize_of(it.bytes) <= usize_of(d.nbytes()))
                    .map(|at| (it.local, at));
            }
            (*peer, msgs)
        })
        .collect()
}

/// Trainer: packs a message's boxes into a buffer of the pool.
fn pack(items: &[SendItem], bytes: u64, boxes: &[ShardedTensor<'_>], pool: &Pool) -> Vec<u8> {
    let mut buf = pool.take(usize_of(bytes));
    let mut at = 0;
    for s in items {
        let p = &boxes[s.piece];
        let r = p.region();
        let origin = Bx {
            off: r.offset().to_vec(),
            len: r.shape().to_vec(),
        };
        let n = usize_of(s.bytes);
        copy_box(
            p.data(),
            &origin.len,
            &s.sbox.relative_to(&origin),
            &mut buf[at..at + n],
            &s.sbox.len,
            &Bx::full(&s.sbox.len),
            p.dtype().size(),
            false,
        );
        at += n;
    }
    buf
}

/// What one rank did in a transfer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moved {
    /// Bytes sent.
    pub sent: u64,
    /// Bytes received.
    pub received: u64,
}

/// Message buffers handed back once their round is done, reused by later rounds (a fresh
/// buffer per message costs its page faults again every round). Holds at most `cap` buffers,
/// each at most a chunk: one round's worth at most.
struct Pool {
    bufs: std::sync::Mutex<Vec<Vec<u8>>>,
    cap: usize,
}

impl Pool {
    /// A buffer of `n` bytes (contents unspecified: every byte is written before use).
    fn take(&self, n: usize) -> Vec<u8> {
        let got = self
            .bufs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let mut b = got.unwrap_or_default();
        b.resize(n, 0);
        b
    }

    fn give(&self, b: Vec<u8>) {
        let mut v = self
            .bufs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if v.len() < self.cap {
            v.push(b);
        }
    }
}

/// A destination buffer's memory as the sink lent it: the driver and the wire thread both
/// write into it, never into the same destination at the same time (see [`drive`]).
#[derive(Clone, Copy)]
struct Raw {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `Raw` is turned into a slice only of bytes no other thread touches meanwhile (see
// `drive`), and the sink keeps the memory alive, unmoved, until the destination completes.
unsafe impl Send for Raw {}

/// A message to send: packed into a pool buffer, or straight from a source's memory.
enum Out<'a> {
    Packed(Vec<u8>),
    Direct(&'a [u8]),
}

/// A message to receive: into a pool buffer (unpacked after the round), or straight into
/// part of a destination.
enum In {
    Staged(Vec<u8>),
    Direct(Raw),
}

/// One round for the wire thread: (peer, message) to send and to receive, in order per peer.
struct RoundIo<'a> {
    sends: Vec<(usize, Out<'a>)>,
    recvs: Vec<(usize, In)>,
}

/// A round back from the wire thread: its messages (received ones filled).
type Done<'a> = Result<RoundIo<'a>, CommError>;

/// This rank's messages per round, derived from its plan and its sources and destinations.
struct Sched<'p> {
    lp: &'p LocalPlan,
    sends: Vec<Vec<(usize, Vec<Msg>)>>,
    recvs: Vec<Vec<(usize, Vec<Msg>)>>,
}

impl Sched<'_> {
    /// Destinations round `r` receives into directly (`direct`) or through a staging buffer.
    fn locals(&self, r: usize, direct: bool) -> impl Iterator<Item = usize> + '_ {
        self.recvs[r]
            .iter()
            .zip(&self.lp.recvs[r])
            .flat_map(move |((_, msgs), (_, items))| {
                msgs.iter()
                    .filter(move |m| m.direct.is_some() == direct)
                    .flat_map(move |m| items[m.items.clone()].iter().map(|it| it.local))
            })
    }

    /// Whether round `k` receives directly into a destination that round `k - 1` unpacks
    /// staged bytes into: then round `k` starts only once round `k - 1` is unpacked.
    fn overlaps_previous(&self, k: usize, marks: &mut [bool]) -> bool {
        if k == 0 {
            return false;
        }
        for l in self.locals(k - 1, false) {
            marks[l] = true;
        }
        let hit = self.locals(k, true).any(|l| marks[l]);
        for l in self.locals(k - 1, false) {
            marks[l] = false;
        }
        hit
    }
}

/// Runs every round of `lp` on this rank: a trainer rank sends from `boxes`, an engine rank
/// receives into `sink`. A box of at least 64 KiB whose bytes lie contiguously in its source
/// is sent straight from there, and one that lands unconverted in a contiguous part of its
/// destination is received straight there; smaller or strided boxes are packed and unpacked
/// through pooled buffers. Rounds overlap: a wire thread moves round `k` while this thread
/// prepares round `k + 1` (trainer) or unpacks round `k - 1` (engine), through channels of
/// one round each, so a rank holds at most three rounds' staged messages at once, and keeps
/// at most one round's worth of used buffers for reuse: 4 x the bucket in all.
///
/// # Errors
/// Communication errors; conversion errors of a copy; the sink's errors.
pub fn run(
    comm: &dyn Communicator,
    lp: &LocalPlan,
    boxes: &[ShardedTensor<'_>],
    sink: Option<&mut dyn Sink>,
) -> Result<Moved, TransferError> {
    run_with(comm, lp, boxes, sink, OWN_MESSAGE)
}

/// [`run`] with items of at least `own` bytes in messages of their own (every rank of a
/// transfer passes the same).
fn run_with(
    comm: &dyn Communicator,
    lp: &LocalPlan,
    boxes: &[ShardedTensor<'_>],
    mut sink: Option<&mut dyn Sink>,
    own: u64,
) -> Result<Moved, TransferError> {
    if let Some(s) = sink.as_deref_mut() {
        for &l in &lp.zero {
            s.buffer(l).fill(0);
        }
    }
    let sched = Sched {
        lp,
        sends: lp
            .sends
            .iter()
            .map(|v| send_messages(v, boxes, own))
            .collect(),
        recvs: lp
            .recvs
            .iter()
            .map(|v| recv_messages(v, &lp.dests, own))
            .collect(),
    };
    let staged = |v: &[(usize, Vec<Msg>)]| -> usize {
        v.iter()
            .map(|(_, m)| m.iter().filter(|m| m.direct.is_none()).count())
            .sum()
    };
    let per_round = (0..lp.rounds)
        .map(|r| staged(&sched.sends[r]) + staged(&sched.recvs[r]))
        .max()
        .unwrap_or(0);
    let pool = Pool {
        bufs: std::sync::Mutex::new(Vec::new()),
        cap: per_round,
    };
    let pool = &pool;
    let sched = &sched;
    let moved = std::thread::scope(|sc| {
        let (to_wire, wire_in) = sync_channel::<RoundIo<'_>>(1);
        let (wire_out, from_wire) = sync_channel::<Done<'_>>(1);
        sc.spawn(move || wire(comm, lp.rounds, &wire_in, &wire_out));
        drive(sched, boxes, sink, pool, to_wire, &from_wire)
    })?;
    Ok(moved)
}

/// The wire thread: per round, the messages in, moved, and handed back.
fn wire<'a>(
    comm: &dyn Communicator,
    rounds: usize,
    input: &Receiver<RoundIo<'a>>,
    out: &SyncSender<Done<'a>>,
) {
    for _ in 0..rounds {
        // The driver ended (an error on this rank): stop.
        let Ok(mut io) = input.recv() else {
            return;
        };
        let res = {
            let sends: Vec<SendBuf<'_>> = io
                .sends
                .iter()
                .map(|(peer, m)| SendBuf {
                    peer: *peer,
                    data: match m {
                        Out::Packed(b) => b,
                        Out::Direct(s) => s,
                    },
                })
                .collect();
            let mut recvs: Vec<RecvBuf<'_>> = io
                .recvs
                .iter_mut()
                .map(|(peer, m)| RecvBuf {
                    peer: *peer,
                    buf: match m {
                        In::Staged(b) => b.as_mut_slice(),
                        // SAFETY: the driver lent these bytes of a live destination to this
                        // round alone and touches none of that destination until the round
                        // is back (see `drive`).
                        In::Direct(r) => unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) },
                    },
                })
                .collect();
            comm.exchange(&sends, &mut recvs)
        };
        let failed = res.is_err();
        if out.send(res.map(|()| io)).is_err() || failed {
            return;
        }
    }
}

/// The memory of destination `l`, asked of the sink once and remembered, so that every later
/// slice of it derives from the same loan.
fn lend(mem: &mut [Option<Raw>], sink: &mut dyn Sink, l: usize) -> Raw {
    *mem[l].get_or_insert_with(|| {
        let b = sink.buffer(l);
        Raw {
            ptr: b.as_mut_ptr(),
            len: b.len(),
        }
    })
}

/// Round `k`'s messages for the wire: packed or direct sends, staged or direct receives.
fn prepare<'a>(
    sched: &Sched<'_>,
    k: usize,
    boxes: &[ShardedTensor<'a>],
    sink: &mut Option<&mut dyn Sink>,
    mem: &mut [Option<Raw>],
    pool: &Pool,
) -> (RoundIo<'a>, u64) {
    let lp = sched.lp;
    let mut sent = 0;
    let mut io = RoundIo {
        sends: Vec::new(),
        recvs: Vec::new(),
    };
    for ((peer, msgs), (_, items)) in sched.sends[k].iter().zip(&lp.sends[k]) {
        for m in msgs {
            let out = match m.direct {
                Some((piece, at)) => Out::Direct(&boxes[piece].data()[at..at + usize_of(m.bytes)]),
                None => Out::Packed(pack(&items[m.items.clone()], m.bytes, boxes, pool)),
            };
            sent += m.bytes;
            io.sends.push((*peer, out));
        }
    }
    for ((peer, msgs), _) in sched.recvs[k].iter().zip(&lp.recvs[k]) {
        for m in msgs {
            let n = usize_of(m.bytes);
            let lent = match (m.direct, sink.as_deref_mut()) {
                (Some((l, at)), Some(s)) => {
                    let r = lend(mem, s, l);
                    (at + n <= r.len).then(|| Raw {
                        // SAFETY: `at + n` is within the destination's buffer (checked).
                        ptr: unsafe { r.ptr.add(at) },
                        len: n,
                    })
                }
                _ => None,
            };
            io.recvs.push((
                *peer,
                lent.map_or_else(|| In::Staged(pool.take(n)), In::Direct),
            ));
        }
    }
    (io, sent)
}

/// This rank's side of the rounds: prepares one round ahead of the wire, unpacks what it
/// hands back. Owns the sending end, so returning early (an error) stops the wire thread.
///
/// The wire thread writes into destinations only through the direct receives of the round
/// it moves; this thread writes into destinations only when it unpacks a round the wire has
/// handed back. Round `k + 1` goes to the wire before round `k` is unpacked only when no
/// destination of its direct receives is one round `k` unpacks into, so the two never write
/// into the same destination at once.
fn drive<'a>(
    sched: &Sched<'_>,
    boxes: &[ShardedTensor<'a>],
    mut sink: Option<&mut dyn Sink>,
    pool: &Pool,
    to_wire: SyncSender<RoundIo<'a>>,
    from_wire: &Receiver<Done<'a>>,
) -> Result<Moved, TransferError> {
    let lp = sched.lp;
    let mut moved = Moved::default();
    let mut mem: Vec<Option<Raw>> = vec![None; lp.dests.len()];
    let mut marks = vec![false; lp.dests.len()];
    let mut fed = 0;
    for r in 0..lp.rounds {
        while fed < lp.rounds && fed <= r + 1 {
            if fed == r + 1 && sched.overlaps_previous(fed, &mut marks) {
                break;
            }
            let (io, sent) = prepare(sched, fed, boxes, &mut sink, &mut mem, pool);
            moved.sent += sent;
            if to_wire.send(io).is_err() {
                break; // the wire thread failed: its error comes next
            }
            fed += 1;
        }
        let io = from_wire
            .recv()
            .map_err(|_| TransferError::Setup("the transfer's wire thread ended".into()))??;
        let mut got = io.recvs.into_iter();
        if let Some(s) = sink.as_deref_mut() {
            for ((_, msgs), (_, items)) in sched.recvs[r].iter().zip(&lp.recvs[r]) {
                for m in msgs {
                    moved.received += m.bytes;
                    let Some((_, In::Staged(data))) = got.next() else {
                        continue;
                    };
                    let mut at = 0;
                    for it in &items[m.items.clone()] {
                        let n = usize_of(it.bytes);
                        let d = &lp.dests[it.local];
                        let dst = lend(&mut mem, s, it.local);
                        // SAFETY: the wire thread is not writing into this destination now
                        // (see above), and the sink lent its memory until it completes.
                        let dst = unsafe { std::slice::from_raw_parts_mut(dst.ptr, dst.len) };
                        copy_piece(
                            &it.cut,
                            &data[at..at + n],
                            &it.cut.sbox,
                            it.src_dtype,
                            dst,
                            d,
                            &d.value,
                        )?;
                        at += n;
                    }
                    pool.give(data);
                }
            }
            s.complete(&lp.completes[r])?;
        }
        for (_, m) in got {
            if let In::Staged(b) = m {
                pool.give(b);
            }
        }
        for (_, m) in io.sends {
            if let Out::Packed(b) = m {
                pool.give(b);
            }
        }
    }
    if let Some(s) = sink {
        s.complete(&lp.completes[lp.rounds])?;
    }
    Ok(moved)
}

#[cfg(test)]
#[path = "exec/tests.rs"]
mod tests;
