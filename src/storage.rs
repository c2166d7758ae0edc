//! The only layer that touches zarrs, the file system and object stores: array metadata,
//! shard encoding and decoding, durable writes, reads and the commit protocols.
//!
//! Everything goes through the [`store::Store`] seam (put, put-if-absent, put-if-match, a
//! bounded multipart writer, ranged gets, head, list, delete), with capability methods for
//! the local fast paths (rename, flock, fsync, local paths for `pread` / `mmap`):
//! [`store::LocalStore`] for file systems and, with the `object-store` feature,
//! [`remote::RemoteStore`] for S3, GCS, Azure and memory. The CLI, the benches and the fuzz
//! targets use this layer directly; applications normally need only the engines above it.

pub mod array;
pub mod checksum;
pub mod commit;
pub mod doc;
pub mod dtype;
pub mod error;
pub mod footer;
pub mod foreign;
pub mod frame;
pub mod fsio;
pub mod groups;
pub mod meta;
pub mod object;
pub mod read;
#[cfg(feature = "object-store")]
pub mod remote;
pub mod shard;
pub mod store;
pub mod write;

pub use array::TensorArray;
pub use error::StorageError;
pub use meta::{CheckpointMeta, Compression, TensorEntry};
