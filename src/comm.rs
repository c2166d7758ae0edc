//! How ranks talk: a small [`Communicator`] trait (bytes in, bytes out, every wait bounded by a
//! timeout) and its implementations.
//!
//! A communicator is a transport: it provides its rank, the world size and point-to-point
//! transfers ([`Communicator::exchange`]); the collectives (tree all-reduce, broadcast,
//! all-gather, barrier) are written once on top of that, in [`collective`], and are the
//! trait's default methods. Every communicator of the crate ([`LocalComm`], [`TcpComm`], the
//! NCCL one of `device`, and `TorchComm` through the Python package) uses them as they are,
//! so each agrees in O(log world) hops with a few messages per rank.
//!
//! Every method is collective: all ranks call the same methods in the same order, one at a
//! time per communicator (calls from several threads must not overlap). A rank that dies or
//! stops answering turns into a [`CommError`] naming it on the others within about the
//! communicator's timeout. What a late (alive, busy) rank means depends on the implementation:
//! [`TcpComm`] waits for it however late (liveness is checked by heartbeats independent of
//! progress; an optional deadline bounds single operations), while [`LocalComm`], whose ranks
//! are threads of one process, bounds every wait by its timeout. A successful call means this
//! rank's part is done: a peer may still fail afterwards, which callers learn at their next
//! collective (save and load end with one).

#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) mod bounded;
pub mod collective;
pub mod local;
pub mod tcp;

use std::time::Duration;

pub use local::{LocalComm, run_local};
pub use tcp::{TcpComm, TcpConfig, TcpMaster, fds_needed};

/// The default timeout: the liveness timeout of [`TcpComm`], the bound on any wait of
/// [`LocalComm`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A failure of communication, naming the rank that saw it and the peer involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A wait exceeded its bound: the rendezvous or connecting timeout, a [`LocalComm`] wait,
    /// or a [`TcpConfig::deadline`].
    #[error("rank {rank}: {op} timed out after {after:?} waiting for {}", peer.map_or("peers".to_owned(), |p| format!("rank {p}")))]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The rank that waited.
        rank: usize,
        /// The peer it waited for, when known.
        peer: Option<usize>,
        /// How long it waited.
        after: Duration,
    },
    /// A peer stopped answering: no heartbeat from it for the liveness timeout, although its
    /// connections are open (its process is stopped or hung, or its host is unreachable). A
    /// peer that is merely busy keeps answering and is never reported so.
    #[error("rank {rank}: {op} failed: rank {peer} is unresponsive: {detail}")]
    Unresponsive {
        /// The operation.
        op: &'static str,
        /// The rank that noticed, or learnt it from the rank that did.
        rank: usize,
        /// The silent peer.
        peer: usize,
        /// How long it was silent when declared dead.
        silent_for: Duration,
        /// What was observed, and by whom.
        detail: String,
    },
    /// A peer went away (process died, connection closed, communicator dropped).
    #[error("rank {rank}: {op} failed: rank {peer} is gone ({detail})")]
    PeerLost {
        /// The operation.
        op: &'static str,
        /// The rank that noticed.
        rank: usize,
        /// The peer that is gone.
        peer: usize,
        /// What was observed.
        detail: String,
    },
    /// Ranks called different operations or sent sizes that do not match.
    #[error("rank {rank}: {op}: protocol mismatch: {detail}")]
    Mismatch {
        /// The operation.
        op: &'static str,
        /// The rank that noticed.
        rank: usize,
        /// What did not match.
        detail: String,
    },
    /// A peer announced a message larger than this rank accepts; refused before allocating.
    #[error(
        "rank {rank}: {op}: rank {peer} announced a message of {declared} bytes, above the limit of {limit} bytes"
    )]
    TooLarge {
        /// The operation.
        op: &'static str,
        /// The rank that refused it.
        rank: usize,
        /// The sender.
        peer: usize,
        /// The size it announced.
        declared: u64,
        /// The limit.
        limit: u64,
    },
    /// Setting up or using the transport failed.
    #[error("rank {rank}: {op}: {detail}")]
    Transport {
        /// The operation.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// What failed.
        detail: String,
    },
}

/// How [`Communicator::all_reduce`] combines two partial results.
pub type Merge<'a> = dyn Fn(&[u8], &[u8]) -> Result<Vec<u8>, String> + Sync + 'a;

/// A buffer to send to a peer in [`Communicator::exchange`].
#[derive(Debug, Clone, Copy)]
pub struct SendBuf<'a> {
    /// Destination rank.
    pub peer: usize,
    /// Bytes to send.
    pub data: &'a [u8],
}

/// A buffer to receive into from a peer in [`Communicator::exchange`].
#[derive(Debug)]
pub struct RecvBuf<'a> {
    /// Source rank.
    pub peer: usize,
    /// Destination; the peer sends exactly this many bytes.
    pub buf: &'a mut [u8],
}

/// The transport save and load run on (rank, world size, point-to-point transfers) and the
/// collectives they need, which default to the ones of [`collective`].
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Every rank contributes bytes; every rank receives all contributions, indexed by rank.
    /// The default gathers them up the tree of [`collective`] and sends the whole down.
    ///
    /// # Errors
    /// [`CommError`] on timeout, a lost peer or a protocol mismatch.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        collective::all_gather(self, data)
    }

    /// `root` sends `data` (other ranks' `data` is ignored); every rank returns it. The
    /// default sends it down the tree of [`collective`] with `root` at its top.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, CommError> {
        collective::broadcast(self, root, data)
    }

    /// Waits until every rank has arrived.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    fn barrier(&self) -> Result<(), CommError> {
        collective::barrier(self)
    }

    /// Every rank contributes bytes; the contributions are combined with `merge` and every
    /// rank returns the combined value. `merge` must be associative and commutative (it is
    /// called on partial results of disjoint sets of ranks, in an order the implementation
    /// chooses); an error it returns fails the operation on every rank.
    ///
    /// The default ([`collective::all_reduce`]) combines them up a binary tree over
    /// [`Communicator::exchange`], so each rank receives at most three combined values (plus a 16-byte header per message) whatever the world
    /// size.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`]; a failed `merge` is a [`CommError::Mismatch`].
    fn all_reduce(&self, data: &[u8], merge: &Merge<'_>) -> Result<Vec<u8>, CommError> {
        collective::all_reduce(self, data, merge)
    }

    /// The largest collective message this rank accepts from a peer: a larger one is refused
    /// with [`CommError::TooLarge`] before anything is allocated. Default
    /// [`collective::MAX_MESSAGE`].
    fn max_message(&self) -> u64 {
        collective::MAX_MESSAGE
    }

    /// Called by the collectives when one failed on this rank with `error` (every rank that
    /// can be reached fails with it too). The state of the links is unspecified afterwards; a
    /// transport may tell its peers at once and refuse later calls ([`TcpComm`] does). The
    /// default does nothing.
    fn abort(&self, error: &CommError) {
        let _ = error;
    }

    /// Point-to-point transfer of large buffers. For every ordered pair of ranks, the sends of
    /// one to the other and the receives of the other from the one match in order and size.
    /// Sends and receives progress concurrently, so any such pattern completes. Called by
    /// itself (a data exchange), every rank calls `exchange`, possibly with nothing to do; the
    /// default collectives call it on the ranks of one tree link at a time, and need a message
    /// sent in one call to be received in one call of the peer, in order per pair of ranks.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`]; a size mismatch is a [`CommError::Mismatch`].
    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError>;
}
