//! Errors of the storage layer: every variant names the path, and the tensor and chunk where
//! one is involved.

use std::path::PathBuf;

/// A storage failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    /// An operating-system I/O error.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The directory holds no zarrckpt checkpoint (and no trace of one being written).
    #[error("{} is not a zarrckpt checkpoint: {reason}", path.display())]
    NotACheckpoint {
        /// The directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A save into this directory never committed (it crashed or is still running).
    #[error("{} is an incomplete checkpoint: the root zarr.json with the zarrckpt index is missing, so the save that wrote it never committed", path.display())]
    Incomplete {
        /// The directory.
        path: PathBuf,
    },
    /// Written by a newer, incompatible format version.
    #[error("{}: format version {found} is not supported (this reader supports {supported})", path.display())]
    UnsupportedVersion {
        /// The metadata file.
        path: PathBuf,
        /// The version found.
        found: String,
        /// What this reader supports.
        supported: String,
    },
    /// Metadata that does not parse or contradicts itself.
    #[error("malformed metadata in {}: {reason}", path.display())]
    Malformed {
        /// The metadata file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// zarrs rejected an array or failed to encode or decode.
    #[error("tensor `{key}` ({}): {source}", path.display())]
    Zarr {
        /// The tensor or object key.
        key: String,
        /// The array or chunk path.
        path: PathBuf,
        /// The zarrs error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A chunk's bytes do not match their checksum.
    #[error("tensor `{key}`, chunk {chunk:?}, subchunk {subchunk} ({}): crc32c mismatch (stored {stored:#010x}, computed {computed:#010x})", path.display())]
    Checksum {
        /// The tensor.
        key: String,
        /// Grid index of the chunk (shard).
        chunk: Vec<u64>,
        /// Linear index of the subchunk in the shard.
        subchunk: u64,
        /// The shard file.
        path: PathBuf,
        /// Checksum stored in the file.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// A shard file is shorter than its index says, or its index is damaged.
    #[error("tensor `{key}`, chunk {chunk:?} ({}): corrupt shard: {detail}", path.display())]
    CorruptChunk {
        /// The tensor.
        key: String,
        /// Grid index of the chunk.
        chunk: Vec<u64>,
        /// The shard file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A chunk file a committed checkpoint must have is absent.
    #[error("tensor `{key}`, chunk {chunk:?}: file {} is missing", path.display())]
    MissingChunk {
        /// The tensor.
        key: String,
        /// Grid index of the chunk.
        chunk: Vec<u64>,
        /// The expected file.
        path: PathBuf,
    },
    /// Another save to the same checkpoint holds its lock.
    #[error("another save to {} is in progress (its lock {} is held); this save was not started", path.display(), lock.display())]
    Locked {
        /// The checkpoint directory.
        path: PathBuf,
        /// The lock file.
        lock: PathBuf,
    },
    /// Reading what was asked for needs a buffer larger than this machine's memory, or one
    /// that cannot be allocated: the size comes from the metadata, which may be damaged.
    #[error("tensor `{key}` ({}): {bytes} bytes cannot be read into memory: {reason}", path.display())]
    TooLarge {
        /// The tensor (or array) key.
        key: String,
        /// The array or metadata file.
        path: PathBuf,
        /// The bytes the metadata declares.
        bytes: u64,
        /// Why (the limit it exceeds, or the allocation that failed).
        reason: String,
    },
    /// The target directory already holds data and overwriting was not asked for.
    #[error("{} already exists and is not empty (pass overwrite to replace it)", path.display())]
    AlreadyExists {
        /// The directory.
        path: PathBuf,
    },
    /// Overwriting was asked for, but the target directory holds something that is not a
    /// zarrckpt checkpoint: a save never replaces another kind of directory.
    #[error("{} is not empty and is not a zarrckpt checkpoint, so it is not replaced even with overwrite (a save replaces checkpoints only): choose another path, or empty it", path.display())]
    NotReplaceable {
        /// The directory.
        path: PathBuf,
    },
    /// An object that is not there (a store's `head` and reads).
    #[error("{}: no such object", path.display())]
    NotFound {
        /// The object.
        path: PathBuf,
    },
    /// A put if absent found an object already there.
    #[error("{}: an object is already there (put if absent)", path.display())]
    ObjectExists {
        /// The object.
        path: PathBuf,
    },
    /// A put if match found another version of the object (or none).
    #[error("{}: the object is not at the expected version ({expected}): {found}", path.display())]
    Precondition {
        /// The object.
        path: PathBuf,
        /// The version the put expected.
        expected: String,
        /// What is there instead.
        found: String,
    },
    /// The store cannot do this (a capability it lacks).
    #[error("{}: this store does not support {op}", path.display())]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// The object or prefix.
        path: PathBuf,
    },
    /// A location that is not a valid store key.
    #[error("invalid store location {location:?}: {reason}")]
    BadLocation {
        /// The location.
        location: String,
        /// What is wrong.
        reason: String,
    },
}

impl StorageError {
    /// Wraps an I/O error with the operation and path.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> StorageError {
        let path = path.into();
        move |source| StorageError::Io { op, path, source }
    }

    /// Wraps a zarrs error with the key and path.
    pub(crate) fn zarr<E: std::error::Error + Send + Sync + 'static>(
        key: &str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(E) -> StorageError {
        let key = key.to_owned();
        let path = path.into();
        move |e| StorageError::Zarr {
            key,
            path,
            source: Box::new(e),
        }
    }
}
