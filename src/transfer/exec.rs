//! Executing a transfer plan on one rank: per round, a trainer rank packs the boxes it sends
//! (one message per receiver), an engine rank receives one message per sender and copies each
//! box into its buffer through the conversion's own piece copy (transpose, value ops, casts).

use super::error::TransferError;
use super::plan::{split, sub_dbox};
use super::rank::RankPlan;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use crate::comm::{CommError, Communicator, RecvBuf, SendBuf};
use crate::convert::exec::copy_piece;
use crate::convert::geom::{Bx, copy_box};
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
pub trait Sink {
    /// The buffer of destination `local` ([`Dest::nbytes`] bytes); zeroed on first use when
    /// the sink allocates it.
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

impl Sink for Buffers<'_, '_> {
    fn buffer(&mut self, local: usize) -> &mut [u8] {
        self.bufs[local]
    }

    fn complete(&mut self, _: &[usize]) -> Result<(), TransferError> {
        Ok(())
    }
}

/// Trainer side of one round: the packed message per receiver.
fn pack(
    items: &[(usize, Vec<SendItem>)],
    boxes: &[ShardedTensor<'_>],
    pool: &Pool,
) -> Vec<(usize, Vec<u8>)> {
    items
        .iter()
        .map(|(peer, v)| {
            let total: u64 = v.iter().map(|s| s.bytes).sum();
            let mut buf = pool.take(usize_of(total));
            let mut at = 0;
            for s in v {
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
            (*peer, buf)
        })
        .collect()
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

/// Received messages of one round, one per peer in plan order.
type Round = Result<Vec<Vec<u8>>, CommError>;

/// Runs every round of `lp` on this rank: a trainer rank sends from `boxes`, an engine rank
/// receives into `sink`. Rounds overlap: a wire thread moves round `k` while this thread
/// packs round `k + 1` (trainer) or unpacks round `k - 1` (engine), through channels of one
/// round each, so a rank holds at most three rounds' messages at once, and keeps at most one
/// round's worth of used buffers for reuse: 4 x the bucket in all.
///
/// # Errors
/// Communication errors; conversion errors of a copy; the sink's errors.
pub fn run(
    comm: &dyn Communicator,
    lp: &LocalPlan,
    boxes: &[ShardedTensor<'_>],
    mut sink: Option<&mut dyn Sink>,
) -> Result<Moved, TransferError> {
    if let Some(s) = sink.as_deref_mut() {
        for &l in &lp.zero {
            s.buffer(l).fill(0);
        }
    }
    let per_round = (0..lp.rounds)
        .map(|r| lp.sends[r].len() + lp.recvs[r].len())
        .max()
        .unwrap_or(0);
    let pool = Pool {
        bufs: std::sync::Mutex::new(Vec::new()),
        cap: per_round,
    };
    let pool = &pool;
    let moved = std::thread::scope(|sc| {
        let (to_wire, wire_in) = sync_channel::<Vec<(usize, Vec<u8>)>>(1);
        let (wire_out, from_wire) = sync_channel::<Round>(1);
        sc.spawn(move || wire(comm, lp, pool, &wire_in, &wire_out));
        drive(lp, boxes, sink, pool, to_wire, &from_wire)
    })?;
    Ok(moved)
}

/// The wire thread: per round, the packed messages in, the received ones out.
fn wire(
    comm: &dyn Communicator,
    lp: &LocalPlan,
    pool: &Pool,
    packed_in: &Receiver<Vec<(usize, Vec<u8>)>>,
    out: &SyncSender<Round>,
) {
    for r in 0..lp.rounds {
        // The driver ended (an error on this rank): stop.
        let Ok(packed) = packed_in.recv() else {
            return;
        };
        let sends: Vec<SendBuf<'_>> = packed
            .iter()
            .map(|(peer, data)| SendBuf { peer: *peer, data })
            .collect();
        let mut bufs: Vec<Vec<u8>> = lp.recvs[r]
            .iter()
            .map(|(_, v)| pool.take(usize_of(v.iter().map(|i| i.bytes).sum())))
            .collect();
        let res = {
            let mut recvs: Vec<RecvBuf<'_>> = bufs
                .iter_mut()
                .zip(&lp.recvs[r])
                .map(|(buf, (peer, _))| RecvBuf {
                    peer: *peer,
                    buf: buf.as_mut_slice(),
                })
                .collect();
            comm.exchange(&sends, &mut recvs)
        };
        drop(sends);
        for (_, b) in packed {
            pool.give(b);
        }
        let failed = res.is_err();
        if out.send(res.map(|()| bufs)).is_err() || failed {
            return;
        }
    }
}

/// This rank's side of the rounds: packs one round ahead of the wire, unpacks what it hands
/// back. Owns the sending end, so returning early (an error) stops the wire thread.
fn drive(
    lp: &LocalPlan,
    boxes: &[ShardedTensor<'_>],
    mut sink: Option<&mut dyn Sink>,
    pool: &Pool,
    to_wire: SyncSender<Vec<(usize, Vec<u8>)>>,
    from_wire: &Receiver<Round>,
) -> Result<Moved, TransferError> {
    let mut moved = Moved::default();
    let mut packed = 0;
    for r in 0..lp.rounds {
        while packed < lp.rounds && packed <= r + 1 {
            let p = pack(&lp.sends[packed], boxes, pool);
            moved.sent += p.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
            if to_wire.send(p).is_err() {
                break; // the wire thread failed: its error comes next
            }
            packed += 1;
        }
        let bufs = from_wire
            .recv()
            .map_err(|_| TransferError::Setup("the transfer's wire thread ended".into()))??;
        if let Some(s) = sink.as_deref_mut() {
            for (data, (_, items)) in bufs.iter().zip(&lp.recvs[r]) {
                let mut at = 0;
                for it in items {
                    let n = usize_of(it.bytes);
                    let d = &lp.dests[it.local];
                    copy_piece(
                        &it.cut,
                        &data[at..at + n],
                        &it.cut.sbox,
                        it.src_dtype,
                        s.buffer(it.local),
                        d,
                        &d.value,
                    )?;
                    at += n;
                }
                moved.received += data.len() as u64;
            }
            s.complete(&lp.completes[r])?;
        }
        for b in bufs {
            pool.give(b);
        }
    }
    if let Some(s) = sink {
        s.complete(&lp.completes[lp.rounds])?;
    }
    Ok(moved)
}
