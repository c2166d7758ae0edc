//! Writing a rank's files: array metadata and whole shards (one writer per shard, written
//! whole), made durable before commit.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use super::array::TensorArray;
use super::error::StorageError;
use super::fsio::{create_dir_durable, write_durable};
use super::shard::{start_writeback, write_uncompressed};
use crate::model::Region;
use crate::model::copy::copy_region;

/// Writes the array's `zarr.json` (creating its directory).
///
/// # Errors
/// I/O errors naming the path.
pub fn write_array_metadata(arr: &TensorArray) -> Result<(), StorageError> {
    create_dir_durable(arr.dir())?;
    let doc = super::array::array_metadata_for(arr.key(), arr.entry(), arr.save_id());
    // Invariant: serializing a JSON value (string keys only) cannot fail.
    let bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    write_durable(&arr.dir().join("zarr.json"), &[&bytes]).map(|_| ())
}

/// Writes the shard of the chunk at grid index `chunk`, whose full (unclipped) box is
/// `chunk_box`, from `src`, a C-order buffer holding `src_box` (which contains `chunk_box`).
/// Uncompressed arrays are written straight from `src`; compressed ones are encoded by zarrs.
/// An array created for a save id ([`TensorArray::create_for`]) gets the shard footer of
/// format 1.1 between the last subchunk and the index.
/// The file is not yet durable: call [`sync_file`] on it before committing. Returns the bytes
/// written.
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
    let path = arr.chunk_path(chunk);
    let elem = arr.entry().dtype.size();
    if arr.uncompressed() {
        return write_uncompressed(
            &path,
            src,
            src_box,
            chunk_box,
            &arr.entry().subchunk_shape,
            elem,
            arr.save_id().map(|id| (id, arr.key(), chunk)),
        );
    }
    let owned;
    let bytes = if src_box == chunk_box {
        src
    } else {
        // Invariant: a chunk box lies inside its tensor, whose byte size fits memory here.
        let mut buf = vec![0u8; chunk_box.num_elements().unwrap_or(0) as usize * elem];
        copy_region(src, src_box, &mut buf, chunk_box, chunk_box, elem);
        owned = buf;
        &owned
    };
    let encoded = arr.encode_chunk(chunk, bytes)?;
    let (data, index) = encoded.split_at(
        encoded
            .len()
            .saturating_sub(crate::model::usize_of(arr.index_bytes())),
    );
    let foot = match arr.save_id() {
        Some(id) => compressed_footer(arr, chunk, id, data, index)?,
        None => Vec::new(),
    };
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(StorageError::io("create", &path))?;
    for part in [data, &foot, index] {
        f.write_all(part)
            .map_err(StorageError::io("write", &path))?;
    }
    start_writeback(&f);
    Ok((data.len() + foot.len() + index.len()) as u64)
}

/// The footer of a shard encoded by zarrs: the crc32c each subchunk's inner `crc32c` codec
/// stored (its last 4 bytes), in index order.
fn compressed_footer(
    arr: &TensorArray,
    chunk: &[u64],
    id: super::footer::SaveId,
    data: &[u8],
    index: &[u8],
) -> Result<Vec<u8>, StorageError> {
    let entries = arr.decode_index(chunk, index)?;
    let mut crcs = Vec::with_capacity(entries.len());
    for e in entries {
        let crc = e
            .and_then(|(off, n)| {
                let end = usize::try_from(off.checked_add(n)?).ok()?;
                let c = data.get(end.checked_sub(4)?..end)?;
                Some(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            })
            // An absent subchunk's footer entry is 0 (spec); a present entry lies inside
            // `data`, which this writer has just encoded with this index.
            .unwrap_or(0);
        crcs.push(crc);
    }
    Ok(super::footer::encode(id, arr.key(), chunk, &crcs))
}

/// Makes a written file durable (fsync).
///
/// # Errors
/// I/O errors naming the path.
pub fn sync_file(path: &Path) -> Result<(), StorageError> {
    File::open(path)
        .and_then(|f| f.sync_data())
        .map_err(StorageError::io("fsync", path))
}
