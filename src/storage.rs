//! The only layer that touches zarrs and the file system: array metadata, shard encoding and
//! decoding, durable writes and the commit protocol.

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
