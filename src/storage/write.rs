//! Writing a rank's files: array metadata and whole shards (one writer per shard, written
//! whole, through the store's streaming writer), made durable before commit.

use std::path::Path;

use super::array::TensorArray;
use super::error::StorageError;
use super::shard::{EncodeSubchunk, ShardSpec};
use super::store::{LocalStore, Store};
use crate::model::Region;

/// Writes the array's `zarr.json` (creating its directory), durably.
///
/// # Errors
/// I/O errors naming the path.
pub fn write_array_metadata(arr: &TensorArray) -> Result<(), StorageError> {
    write_array_metadata_to(&LocalStore::new(arr.root()), arr)
}

/// [`write_array_metadata`] into `store` (holding the checkpoint at its root).
///
/// # Errors
/// I/O errors naming the object.
pub fn write_array_metadata_to(store: &dyn Store, arr: &TensorArray) -> Result<(), StorageError> {
    store.create_prefix(&arr.entry().path)?;
    let bytes = super::array::array_metadata_bytes(arr.key(), arr.entry(), arr.save_id());
    let loc = arr.metadata_location();
    let mut w = store.put_multipart(&loc)?;
    w.write(&bytes)?;
    w.finish()?;
    store.sync(&loc)
}

/// Writes the shard of the chunk at grid index `chunk`, whose full (unclipped) box is
/// `chunk_box`, from `src`, a C-order buffer holding `src_box` (which contains `chunk_box`),
/// through the one shard writer ([`super::shard::write_shard`]): uncompressed subchunks go
/// straight from `src`, compressed ones are encoded with the array's inner codecs. An array
/// created for a save id ([`TensorArray::create_for`]) gets the shard footer of format 1.1
/// between the last subchunk and the index. The file is not yet durable: call [`sync_file`]
/// on it before committing. Returns the bytes written.
///
/// # Errors
/// Encoding or I/O errors naming the tensor, chunk and path.
pub fn write_shard(
    arr: &TensorArray,
    chunk: &[u64],
    src: &[u8],
    src_box: &Region,
    chunk_box: &Region,
) -> Result<u64, StorageError> {
    write_shard_to(
        &LocalStore::new(arr.root()),
        arr,
        chunk,
        src,
        src_box,
        chunk_box,
    )
}

/// [`write_shard`] into `store` (holding the checkpoint at its root). On stores with
/// [`super::store::Capabilities::explicit_sync`] the shard is durable after
/// [`Store::sync`] of [`TensorArray::chunk_location`]. Once written, the shard's tail goes to
/// [`Store::shard_tail`].
///
/// # Errors
/// Encoding or I/O errors naming the tensor, chunk and object.
pub fn write_shard_to(
    store: &dyn Store,
    arr: &TensorArray,
    chunk: &[u64],
    src: &[u8],
    src_box: &Region,
    chunk_box: &Region,
) -> Result<u64, StorageError> {
    let encode = |linear: u64, raw: &[u8]| arr.encode_subchunk(chunk, linear, raw);
    let spec = ShardSpec {
        subchunk_shape: &arr.entry().subchunk_shape,
        elem: arr.entry().dtype.size(),
        encode: (!arr.uncompressed()).then_some(&encode as EncodeSubchunk),
        footer: arr.save_id().map(|id| (id, arr.key(), chunk)),
    };
    let location = arr.chunk_location(chunk);
    let mut w = store.put_multipart(&location)?;
    match super::shard::write_shard(&mut *w, src, src_box, chunk_box, &spec) {
        Ok((n, tail)) => {
            w.finish()?;
            store.shard_tail(&location, &tail);
            Ok(n)
        }
        Err(e) => {
            let _ = w.abort();
            Err(e)
        }
    }
}

/// Makes a written file durable (fsync).
///
/// # Errors
/// I/O errors naming the path.
pub fn sync_file(path: &Path) -> Result<(), StorageError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_data())
        .map_err(StorageError::io("fsync", path))
}
