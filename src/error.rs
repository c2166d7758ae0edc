//! The crate's top-level error: one variant per layer, plus what the front doors check.

use std::path::PathBuf;

use crate::comm::CommError;
use crate::model::{DType, KeyError, TensorError, TensorKey};
use crate::plan::{LayoutDecodeError, PlanError};
use crate::storage::StorageError;

/// Shows at most 20 keys, then how many more.
fn keys_list(keys: &[TensorKey]) -> String {
    let mut s = keys
        .iter()
        .take(20)
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if keys.len() > 20 {
        s.push_str(&format!(" and {} more", keys.len() - 20));
    }
    s
}

/// Everything save, load and open can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor piece handed in is invalid.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A device (GPU) copy or view failed.
    #[error(transparent)]
    Device(#[from] crate::devmem::DeviceError),
    /// A key is invalid.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The ranks' declarations do not form a valid checkpoint.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A rank sent a malformed layout description.
    #[error(transparent)]
    Layout(#[from] LayoutDecodeError),
    /// Communication failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// An object store failed (feature `object-store`).
    #[cfg(feature = "object-store")]
    #[error(transparent)]
    Remote(#[from] crate::storage::remote::RemoteError),
    /// The checkpoint a save would commit breaks a reader limit of the format (spec section
    /// 4): nothing was written.
    #[error(transparent)]
    Limit(#[from] crate::storage::meta::IndexLimit),
    /// One rank holds the same piece twice, or declares one key with two data types or shapes.
    #[error("tensor `{key}`: {detail}")]
    InconsistentPieces {
        /// The tensor.
        key: TensorKey,
        /// What is inconsistent.
        detail: String,
    },
    /// Some ranks do not see the files rank 0 writes in the checkpoint directory (several
    /// hosts without a shared file system): the save stopped before writing any data.
    #[error("{}: ranks {ranks:?} cannot see the file rank 0 wrote there, so the ranks do not share this storage (a multi-host save needs a shared file system mounted at the same path on every host); nothing was saved", path.display())]
    StorageNotShared {
        /// The directory the save writes into.
        path: std::path::PathBuf,
        /// The ranks that could not see rank 0's file.
        ranks: Vec<usize>,
    },
    /// Another rank failed; this rank stopped too so that no rank waits forever.
    #[error("rank {rank} failed: {message}")]
    RemoteFailure {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// Keys requested but absent from the checkpoint.
    #[error("{}: {} requested key(s) are not in the checkpoint: {}", path.display(), keys.len(), keys_list(keys))]
    UnexpectedKeys {
        /// The checkpoint.
        path: PathBuf,
        /// The keys (of the rank that requested them).
        keys: Vec<TensorKey>,
        /// The rank that requested them.
        rank: usize,
    },
    /// Keys in the checkpoint that no rank requested (strict mode `RaiseAll`).
    #[error("{}: {} key(s) in the checkpoint were requested by no rank: {}", path.display(), keys.len(), keys_list(keys))]
    MissingKeys {
        /// The checkpoint.
        path: PathBuf,
        /// The keys.
        keys: Vec<TensorKey>,
    },
    /// The checkpoint stores another data type than requested (nothing is cast silently).
    #[error("tensor `{key}` in {}: rank {rank} requested {requested}, stored {stored}", path.display())]
    DtypeMismatch {
        /// The tensor.
        key: TensorKey,
        /// The (lowest) rank that made the request.
        rank: usize,
        /// The checkpoint.
        path: PathBuf,
        /// What was asked for.
        requested: DType,
        /// What is stored.
        stored: DType,
    },
    /// The checkpoint stores another global shape than requested.
    #[error("tensor `{key}` in {}: rank {rank} requested global shape {requested:?}, stored {stored:?}", path.display())]
    ShapeMismatch {
        /// The tensor.
        key: TensorKey,
        /// The (lowest) rank that made the request.
        rank: usize,
        /// The checkpoint.
        path: PathBuf,
        /// What was asked for.
        requested: Vec<u64>,
        /// What is stored.
        stored: Vec<u64>,
    },
    /// A conversion was refused (spec § 19.5: rule, key and numbers named).
    #[error(transparent)]
    Convert(#[from] crate::plan::ConvertError),
    /// The I/O thread pool could not be created.
    #[error("could not start the I/O thread pool: {0}")]
    ThreadPool(String),
    /// An object handed in or asked for is invalid.
    #[error(transparent)]
    Object(#[from] crate::model::ObjectError),
    /// The ranks' object declarations disagree (naming the key and the ranks).
    #[error(transparent)]
    ObjectPlan(#[from] crate::plan::objects::ObjectPlanError),
    /// A state dict cannot be flattened.
    #[error(transparent)]
    State(#[from] crate::model::StateError),
    /// An object was asked for with another scope than it was saved with.
    #[error("object `{key}` in {}: requested as {requested}, stored as {stored}", path.display())]
    ObjectScopeMismatch {
        /// The object.
        key: TensorKey,
        /// The checkpoint.
        path: PathBuf,
        /// The scope asked for (`common`, `per_rank`, `sharded`).
        requested: &'static str,
        /// The scope stored.
        stored: &'static str,
    },
    /// A per-rank object was asked for a rank the saving job did not have.
    #[error(
        "per-rank object `{key}` in {}: no value for rank {rank}; the checkpoint was saved by {world_size} ranks. \
         A job with another world size can read any saved rank's value (Checkpoint::read_object with ObjectSlot::Rank(r), \
         or ObjectRequest::rank in a load) and redistribute it",
        path.display()
    )]
    ObjectRankMissing {
        /// The object.
        key: TensorKey,
        /// The checkpoint.
        path: PathBuf,
        /// The rank asked for.
        rank: u64,
        /// The saving job's world size.
        world_size: u64,
    },
    /// A sharded object was asked for with another grid than it was saved with, or a shard
    /// index outside its grid.
    #[error("sharded object `{key}` in {}: requested {requested:?}, stored grid {stored:?}", path.display())]
    ObjectGridMismatch {
        /// The object.
        key: TensorKey,
        /// The checkpoint.
        path: PathBuf,
        /// The grid (or shard index) asked for.
        requested: Vec<u64>,
        /// The stored grid.
        stored: Vec<u64>,
    },
    /// A save was started while this rank's previous asynchronous save was still in flight
    /// (with [`crate::IfBusy::Fail`]); nothing was started.
    #[error("rank {rank}: an asynchronous save to {} is still in flight; wait for it first", path.display())]
    SaveInFlight {
        /// This rank.
        rank: usize,
        /// Where the save in flight writes.
        path: PathBuf,
    },
    /// The caller's `user` metadata cannot be stored so that every reader reads it back
    /// (spec section 4: it nests deeper than readers parse); nothing was written.
    #[error("user metadata for {}: {reason}", path.display())]
    UserMetadata {
        /// The checkpoint.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The background writer of an asynchronous save could not start or stopped without
    /// finishing; nothing was committed by this rank.
    #[error("rank {rank}: background save to {}: {detail}", path.display())]
    Background {
        /// This rank.
        rank: usize,
        /// The checkpoint.
        path: PathBuf,
        /// What happened.
        detail: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
