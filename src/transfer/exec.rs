//! Executing a transfer plan on one rank: per round, a trainer rank packs the boxes it sends
//! (one message per receiver), an engine rank receives one message per sender and copies each
//! box into its buffer through the conversion's own piece copy (transpose, value ops, casts).

use super::decl::Role;
use super::error::TransferError;
use super::plan::GlobalPlan;
use crate::comm::{Communicator, RecvBuf, SendBuf};
use crate::convert::exec::copy_piece;
use crate::convert::geom::{Bx, copy_box};
use crate::convert::{Dest, Piece};
use crate::model::{DType, ShardedTensor, usize_of};

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
    /// Trainer: the number of box pieces the plan indexes.
    pub(crate) pieces: usize,
    /// Bytes this rank sends / receives in all.
    pub(crate) bytes_sent: u64,
    pub(crate) bytes_received: u64,
    /// The busiest sender's bytes and the total bytes moved (for reports).
    pub(crate) busiest_sent: u64,
    pub(crate) total_bytes: u64,
}

impl LocalPlan {
    /// Extracts rank `me`'s part.
    #[must_use]
    pub fn of(g: &GlobalPlan, me: usize) -> LocalPlan {
        let mut lp = LocalPlan {
            rounds: g.rounds,
            sends: vec![Vec::new(); g.rounds],
            recvs: vec![Vec::new(); g.rounds],
            ..LocalPlan::default()
        };
        let sent = g.sent_per_rank();
        lp.busiest_sent = sent.iter().copied().max().unwrap_or(0);
        lp.total_bytes = sent.iter().sum();
        if let Role::Trainer(b) = &g.decls[me].role {
            lp.pieces = b.len();
        }
        let mut last: Vec<Option<usize>> = Vec::new();
        if let (Some(locals), Role::Engine(tensors)) = (g.dest_of.get(&me), &g.decls[me].role) {
            last = vec![None; locals.len()];
            for (local, &di) in locals.iter().enumerate() {
                let d = &g.conv.dests[di];
                let mut mine = Dest {
                    pieces: Vec::new(),
                    ..d.clone()
                };
                mine.dtype = DType::from_name(&tensors[local].dtype).unwrap_or(d.dtype);
                let covered: u64 = d.pieces.iter().map(|p| p.sbox.volume()).sum();
                if covered < d.region.volume() {
                    lp.zero.push(local);
                }
                lp.dests.push(mine);
            }
        }
        for m in &g.moves {
            if m.src == me {
                let r = &mut lp.sends[m.round];
                if r.last().is_none_or(|(p, _)| *p != m.dst) {
                    r.push((m.dst, Vec::new()));
                }
                if let Some((_, v)) = r.last_mut() {
                    v.push(SendItem {
                        piece: m.piece,
                        sbox: m.cut.sbox.clone(),
                        bytes: m.bytes,
                    });
                }
                lp.bytes_sent += m.bytes;
            }
            if m.dst == me {
                let r = &mut lp.recvs[m.round];
                if r.last().is_none_or(|(p, _)| *p != m.src) {
                    r.push((m.src, Vec::new()));
                }
                if let Some((_, v)) = r.last_mut() {
                    v.push(RecvItem {
                        local: m.local,
                        cut: m.cut.clone(),
                        src_dtype: g.conv.sources[m.cut.src].dtype,
                        bytes: m.bytes,
                    });
                }
                lp.bytes_received += m.bytes;
                last[m.local] = Some(m.round);
            }
        }
        lp.completes = vec![Vec::new(); g.rounds + 1];
        for (local, l) in last.iter().enumerate() {
            lp.completes[l.unwrap_or(g.rounds)].push(local);
        }
        lp
    }

    /// Number of rounds.
    #[must_use]
    pub fn rounds(&self) -> usize {
        self.rounds
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
fn pack(items: &[(usize, Vec<SendItem>)], boxes: &[ShardedTensor<'_>]) -> Vec<(usize, Vec<u8>)> {
    items
        .iter()
        .map(|(peer, v)| {
            let total: u64 = v.iter().map(|s| s.bytes).sum();
            let mut buf = vec![0u8; usize_of(total)];
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

/// Runs every round of `lp` on this rank: a trainer rank sends from `boxes`, an engine rank
/// receives into `sink`.
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
    let mut moved = Moved::default();
    for r in 0..lp.rounds {
        let packed = pack(&lp.sends[r], boxes);
        let sends: Vec<SendBuf<'_>> = packed
            .iter()
            .map(|(peer, data)| SendBuf { peer: *peer, data })
            .collect();
        let mut bufs: Vec<(usize, Vec<u8>)> = lp.recvs[r]
            .iter()
            .map(|(peer, v)| (*peer, vec![0u8; usize_of(v.iter().map(|i| i.bytes).sum())]))
            .collect();
        {
            let mut recvs: Vec<RecvBuf<'_>> = bufs
                .iter_mut()
                .map(|(peer, buf)| RecvBuf {
                    peer: *peer,
                    buf: buf.as_mut_slice(),
                })
                .collect();
            comm.exchange(&sends, &mut recvs)?;
        }
        moved.sent += packed.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
        drop(sends);
        drop(packed);
        if let Some(s) = sink.as_deref_mut() {
            for ((_, data), (_, items)) in bufs.iter().zip(&lp.recvs[r]) {
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
    }
    if let Some(s) = sink {
        s.complete(&lp.completes[lp.rounds])?;
    }
    Ok(moved)
}
