//! Writing uncompressed shards straight from the caller's memory.
//!
//! For arrays whose inner codecs are `bytes` + `crc32c` (no compression), a shard is the
//! concatenation, in C order, of every subchunk that is not all zeros, each followed by the
//! crc32c of its bytes, then the index: one little-endian `(offset, nbytes)` u64 pair per
//! subchunk (`u64::MAX` twice for an omitted one) and the index's own crc32c. That is exactly
//! what zarrs' `sharding_indexed` encoder produces with C subchunk order (a test checks the
//! two byte for byte); here the subchunks go to the file with vectored writes directly from
//! the source buffer, checksummed in place, with no intermediate copy of the shard, except
//! for subchunks that are not contiguous in the source (gathered into a small staging buffer).

use std::fs::{File, OpenOptions};
use std::io::{IoSlice, Write};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use super::error::StorageError;
use crate::model::Region;
use crate::model::copy::for_each_run;
use crate::plan::grid;

/// crc32c (Castagnoli), hardware accelerated.
#[must_use]
pub fn crc32c(data: &[u8]) -> u32 {
    // Crc32Iscsi is CRC-32C; the result fits in 32 bits.
    u32::try_from(crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data)).unwrap_or(0)
}

/// Staging capacity for gathered (non-contiguous) subchunks and the batch size of one
/// vectored write.
const STAGING_BYTES: usize = 8 << 20;
/// Most slices passed to one `writev`.
const MAX_IOV: usize = 512;

enum Seg {
    /// A contiguous range of the source.
    Src(usize, usize),
    /// A range of the staging buffer.
    Staged(usize, usize),
}

/// Writes `iov` completely.
fn write_all_vectored(
    file: &mut File,
    mut iov: &mut [IoSlice<'_>],
    path: &Path,
) -> Result<(), StorageError> {
    while !iov.is_empty() {
        let n = iov.len().min(MAX_IOV);
        match file.write_vectored(&iov[..n]) {
            Ok(0) => {
                return Err(StorageError::io("write", path)(
                    std::io::ErrorKind::WriteZero.into(),
                ));
            }
            Ok(written) => IoSlice::advance_slices(&mut iov, written),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(StorageError::io("write", path)(e)),
        }
    }
    Ok(())
}

/// Writes the shard holding `chunk_box` (the full, unclipped chunk) of an uncompressed array
/// to `path`, taking the data from `src`, a C-order buffer holding `src_box` (which contains
/// `chunk_box`). Starts writeback of the file; the caller fsyncs it before committing. With
/// `footer` (save id, tensor key, chunk grid index) the shard footer of format 1.1 goes
/// between the last subchunk and the index. Returns the bytes written.
///
/// # Errors
/// I/O errors naming the path.
///
/// # Panics
/// If `src` is smaller than `src_box` or `chunk_box` is not inside it (caller bugs).
pub fn write_uncompressed(
    path: &Path,
    src: &[u8],
    src_box: &Region,
    chunk_box: &Region,
    subchunk_shape: &[u64],
    elem: usize,
    footer: Option<FooterFor<'_>>,
) -> Result<u64, StorageError> {
    let per_shard: Vec<u64> = chunk_box
        .shape()
        .iter()
        .zip(subchunk_shape)
        .map(|(c, s)| c / s)
        .collect();
    let n_sub = per_shard.iter().product::<u64>() as usize;
    let sub_bytes = subchunk_shape.iter().product::<u64>() as usize * elem;
    let zero_crc = crc32c(&vec![0u8; sub_bytes.min(1 << 20)]);
    let zero_crc = if sub_bytes <= 1 << 20 {
        Some(zero_crc)
    } else {
        None
    };

    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(StorageError::io("create", path))?;
    let mut index: Vec<u8> = Vec::with_capacity(n_sub * 16 + 4);
    let mut offset: u64 = 0;
    let mut staging: Vec<u8> = Vec::with_capacity(STAGING_BYTES.min(n_sub * sub_bytes));
    let mut segs: Vec<(Seg, [u8; 4])> = Vec::new();
    let mut crcs: Vec<u32> = Vec::with_capacity(if footer.is_some() { n_sub } else { 0 });

    let flush = |file: &mut File,
                 segs: &mut Vec<(Seg, [u8; 4])>,
                 staging: &mut Vec<u8>|
     -> Result<(), StorageError> {
        let mut iov: Vec<IoSlice> = Vec::with_capacity(segs.len() * 2);
        for (seg, crc) in segs.iter() {
            let data = match *seg {
                Seg::Src(a, b) => &src[a..b],
                Seg::Staged(a, b) => &staging[a..b],
            };
            iov.push(IoSlice::new(data));
            iov.push(IoSlice::new(crc));
        }
        write_all_vectored(file, &mut iov, path)?;
        segs.clear();
        staging.clear();
        Ok(())
    };

    let mut sub_indices = Vec::with_capacity(n_sub);
    grid::for_each_index(&vec![0; per_shard.len()], &per_shard, |s| {
        sub_indices.push(s.to_vec())
    });
    for s in &sub_indices {
        // A subchunk of `chunk_box` in the checked geometry.
        let sub_box = Region::from_parts_unchecked(
            s.iter()
                .zip(subchunk_shape)
                .zip(chunk_box.offset())
                .map(|((i, n), o)| o + i * n)
                .collect(),
            subchunk_shape.to_vec(),
        );
        // Where the subchunk's bytes are: one run of the source, or gathered.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for_each_run(src_box, &sub_box, &sub_box, elem, |so, _, len| {
            runs.push((so, len))
        });
        let seg = if let [(so, len)] = runs[..] {
            Seg::Src(so, so + len)
        } else {
            if staging.len() + sub_bytes > staging.capacity() && !staging.is_empty() {
                flush(&mut file, &mut segs, &mut staging)?;
            }
            let start = staging.len();
            for (so, len) in &runs {
                staging.extend_from_slice(&src[*so..so + len]);
            }
            Seg::Staged(start, staging.len())
        };
        let data = match seg {
            Seg::Src(a, b) => &src[a..b],
            Seg::Staged(a, b) => &staging[a..b],
        };
        let crc = crc32c(data);
        let all_zero = zero_crc.is_none_or(|z| z == crc) && data.iter().all(|&b| b == 0);
        if all_zero {
            if let Seg::Staged(a, _) = seg {
                staging.truncate(a);
            }
            index.extend_from_slice(&u64::MAX.to_le_bytes());
            index.extend_from_slice(&u64::MAX.to_le_bytes());
            if footer.is_some() {
                crcs.push(0);
            }
            continue;
        }
        index.extend_from_slice(&offset.to_le_bytes());
        index.extend_from_slice(&(sub_bytes as u64 + 4).to_le_bytes());
        offset += sub_bytes as u64 + 4;
        if footer.is_some() {
            crcs.push(crc);
        }
        segs.push((seg, crc.to_le_bytes()));
        if segs.len() * 2 >= MAX_IOV * 8 {
            flush(&mut file, &mut segs, &mut staging)?;
        }
    }
    flush(&mut file, &mut segs, &mut staging)?;
    let crc = crc32c(&index);
    index.extend_from_slice(&crc.to_le_bytes());
    let foot = footer.map_or_else(Vec::new, |f| super::footer::encode(f.0, f.1, f.2, &crcs));
    let mut tail = [IoSlice::new(&foot), IoSlice::new(&index)];
    write_all_vectored(&mut file, &mut tail, path)?;
    start_writeback(&file);
    Ok(offset + foot.len() as u64 + index.len() as u64)
}

/// What a shard footer binds the shard to: the save id, the tensor key and the chunk's grid
/// index.
pub type FooterFor<'a> = (
    super::footer::SaveId,
    &'a crate::model::TensorKey,
    &'a [u64],
);

/// Asks the kernel to start writing the file's dirty pages now (without waiting), so the
/// disk works while later files are produced; the fsync before commit then waits less.
pub fn start_writeback(file: &File) {
    // SAFETY: a valid descriptor; the call only schedules I/O. Failure is harmless (the later
    // fsync does the work), so the result is ignored.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, TensorKey};
    use crate::storage::array::TensorArray;
    use crate::storage::meta::{Compression, TensorEntry, tensor_path};

    /// Our writer and zarrs' sharding encoder produce the same bytes.
    #[test]
    fn identical_to_zarrs_encoding() {
        let tmp = tempfile::tempdir().unwrap();
        type Case<'a> = (DType, &'a [u64], &'a [u64], &'a [u64]);
        let cases: &[Case] = &[
            (DType::Float32, &[8, 6], &[4, 6], &[1, 6]),
            (DType::BFloat16, &[8, 12], &[8, 4], &[8, 2]), // thin columns: gathered
            (DType::UInt8, &[5, 3, 4], &[5, 3, 2], &[1, 3, 1]),
            (DType::Int64, &[], &[], &[]),
            (DType::Float8E4M3FN, &[7], &[7], &[7]),
            (DType::Bool, &[9, 2], &[3, 2], &[3, 1]),
        ];
        for (ci, (dtype, shape, chunk, sub)) in cases.iter().enumerate() {
            let key = TensorKey::new(format!("t{ci}")).unwrap();
            let entry = TensorEntry {
                path: tensor_path(&key),
                dtype: *dtype,
                shape: shape.to_vec(),
                chunk_shape: chunk.to_vec(),
                subchunk_shape: sub.to_vec(),
                compression: Compression::None,
            };
            let arr = TensorArray::create(tmp.path(), &key, &entry).unwrap();
            assert!(arr.uncompressed());
            let elem = dtype.size();
            let n: u64 = chunk.iter().product();
            // deterministic data, with the second subchunk (if any) all zero
            let mut data: Vec<u8> = (0..n as usize * elem)
                .map(|i| (i * 7 + ci + 1) as u8)
                .collect();
            let sub_bytes = sub.iter().product::<u64>() as usize * elem;
            let contiguous_second = sub.first().is_some_and(|_| chunk[1..] == sub[1..]);
            if contiguous_second && data.len() >= 2 * sub_bytes {
                data[sub_bytes..2 * sub_bytes].fill(0);
            }
            for all_zero in [false, true] {
                if all_zero {
                    data.fill(0);
                }
                let chunk_box = Region::new(vec![0; chunk.len()], chunk.to_vec()).unwrap();
                let path = tmp.path().join(format!("shard{ci}{all_zero}"));
                let written =
                    write_uncompressed(&path, &data, &chunk_box, &chunk_box, sub, elem, None)
                        .unwrap();
                let ours = std::fs::read(&path).unwrap();
                assert_eq!(written as usize, ours.len());
                let theirs = arr.encode_chunk(&vec![0; chunk.len()], &data).unwrap();
                assert_eq!(ours, theirs.as_ref(), "case {ci} all_zero {all_zero}");
            }
        }
    }

    /// A chunk inside a larger source buffer is taken from the right place.
    #[test]
    fn chunk_inside_a_larger_piece() {
        let tmp = tempfile::tempdir().unwrap();
        let piece = Region::new(vec![4, 0], vec![4, 6]).unwrap();
        let src: Vec<u8> = (0..24u8).collect();
        let chunk_box = Region::new(vec![4, 3], vec![4, 3]).unwrap();
        let mut expect = vec![0u8; 12];
        crate::model::copy::copy_region(&src, &piece, &mut expect, &chunk_box, &chunk_box, 1);
        let a = tmp.path().join("a");
        let b = tmp.path().join("b");
        write_uncompressed(&a, &src, &piece, &chunk_box, &[2, 3], 1, None).unwrap();
        write_uncompressed(&b, &expect, &chunk_box, &chunk_box, &[2, 3], 1, None).unwrap();
        assert_eq!(std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    }
}
