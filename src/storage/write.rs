//! Writing a rank's files: array metadata and whole shards, each durable before commit.

use std::path::Path;

use super::array::TensorArray;
use super::error::StorageError;
use super::fsio::{create_dir_durable, write_durable};

/// Writes the array's `zarr.json` (creating its directory).
///
/// # Errors
/// I/O errors naming the path.
pub fn write_array_metadata(arr: &TensorArray) -> Result<(), StorageError> {
    create_dir_durable(arr.dir())?;
    let doc = super::array::array_metadata(arr.key(), arr.entry());
    let bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    write_durable(&arr.dir().join("zarr.json"), &[&bytes]).map(|_| ())
}

/// Encodes one whole shard with zarrs and writes it durably (one writer per shard, written
/// whole). Returns the bytes written.
///
/// # Errors
/// Encoding or I/O errors naming the tensor, chunk and path.
pub fn write_shard(arr: &TensorArray, chunk: &[u64], chunk_bytes: &[u8]) -> Result<u64, StorageError> {
    let encoded = arr.encode_chunk(chunk, chunk_bytes)?;
    let path = arr.chunk_path(chunk);
    ensure_parent(&path)?;
    write_durable(&path, &[&encoded])
}

fn ensure_parent(path: &Path) -> Result<(), StorageError> {
    match path.parent() {
        Some(p) if !p.is_dir() => create_dir_durable(p),
        _ => Ok(()),
    }
}
