//! Errors of a live weight transfer.

use crate::comm::CommError;
use crate::convert::ConvertError;

/// A refused or failed transfer. Refusals ([`TransferError::Plan`], [`TransferError::Engine`],
/// [`TransferError::Trainer`], [`TransferError::Coverage`]) are found from the ranks'
/// declarations alone, agreed by every rank, and returned on every rank before any weight
/// byte moves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The conversion table refuses the layout (the checks of file conversion: rule, key and
    /// numbers named).
    #[error("transfer plan refused: {0}")]
    Plan(#[from] ConvertError),
    /// An engine rank's buffers do not match what the table produces for it.
    #[error("engine rank {rank} (global rank {global}): tensor `{key}`: {msg}")]
    Engine {
        /// The rank's index among the engine ranks.
        rank: usize,
        /// Its rank in the communicator.
        global: usize,
        /// The HF (or vLLM) tensor name.
        key: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// A trainer rank's pieces are inconsistent (with themselves or with other ranks').
    #[error("trainer rank {rank} (global rank {global}): tensor `{key}`: {msg}")]
    Trainer {
        /// The rank's index among the trainer ranks.
        rank: usize,
        /// Its rank in the communicator.
        global: usize,
        /// The Megatron key.
        key: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// The trainer's main replicas do not cover a tensor the engine needs exactly once.
    #[error("tensor `{key}`: {msg}")]
    Coverage {
        /// The Megatron key.
        key: String,
        /// Which elements, how many times.
        msg: String,
    },
    /// The transfer's options or the roles of the ranks are wrong.
    #[error("transfer: {0}")]
    Setup(String),
    /// Another rank refused (its reason is in the message).
    #[error("rank {rank} refused the transfer: {msg}")]
    Peer {
        /// The rank that refused.
        rank: usize,
        /// Its error.
        msg: String,
    },
    /// Communication failed (a rank died or timed out).
    #[error(transparent)]
    Comm(#[from] CommError),
}
