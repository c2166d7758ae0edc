//! The one shard writer, for every codec.
//!
//! A shard is the concatenation, in C order, of every subchunk that is not all zeros (the fill
//! value), each encoded by the array's inner codecs (`bytes`, then `zstd` or `blosc` where the
//! array is compressed, then `crc32c`, which appends the crc32c of the bytes before it); then,
//! for a format 1.1 array, the shard footer ([`super::footer`]); then the index: one
//! little-endian `(offset, nbytes)` u64 pair per subchunk (`u64::MAX` twice for an omitted
//! one) and the index's own crc32c. Without the footer, that is exactly what zarrs'
//! `sharding_indexed` encoder produces with C subchunk order (tests check the two byte for
//! byte, for every compression).
//!
//! Everything goes to the store through one [`MultipartWrite`], vectored: uncompressed
//! subchunks straight from the source buffer, checksummed in place, with no intermediate copy
//! of the shard (subchunks that are not contiguous in the source are gathered into a small
//! staging buffer first); compressed subchunks as the encoder returns them. The footer's
//! per-subchunk crc32c values are those just computed (for a compressed subchunk, the crc32c
//! its `crc32c` codec appended), so no index is decoded to build it.

use std::io::IoSlice;

use super::error::StorageError;
use super::footer::SaveId;
use super::store::MultipartWrite;
use crate::model::copy::for_each_run;
use crate::model::{Region, TensorKey};
use crate::plan::grid;

pub use super::checksum::crc32c;
pub use super::store::local::start_writeback;

/// Staging capacity for gathered (non-contiguous) subchunks and for encoded subchunks held
/// before one vectored write.
const STAGING_BYTES: usize = 8 << 20;
/// Segments held before one vectored write.
const MAX_SEGS: usize = 2048;

/// What a shard footer binds the shard to: the save id, the tensor key and the chunk's grid
/// index.
pub type FooterFor<'a> = (SaveId, &'a TensorKey, &'a [u64]);

/// Encodes one subchunk (its raw bytes, in C order) with the array's inner codecs, the
/// trailing crc32c included; called with the subchunk's linear index in the shard.
pub type EncodeSubchunk<'a> = &'a dyn Fn(u64, &[u8]) -> Result<Vec<u8>, StorageError>;

/// One shard's geometry and encoding.
#[derive(Clone, Copy)]
pub struct ShardSpec<'a> {
    /// The subchunk (inner chunk) shape.
    pub subchunk_shape: &'a [u64],
    /// Bytes per element.
    pub elem: usize,
    /// The inner codecs for a compressed array; `None` when they are `bytes` + `crc32c`.
    pub encode: Option<EncodeSubchunk<'a>>,
    /// The footer (format 1.1 arrays), or none (1.0).
    pub footer: Option<FooterFor<'a>>,
}

enum Seg {
    /// A contiguous range of the source, and its crc32c.
    Src(usize, usize, [u8; 4]),
    /// A range of the source, one run of a subchunk handed over without gathering.
    Run(usize, usize),
    /// The crc32c ending a subchunk handed over as runs.
    Crc([u8; 4]),
    /// A range of the staging buffer, and its crc32c.
    Staged(usize, usize, [u8; 4]),
    /// An encoded subchunk, its crc32c included.
    Encoded(Vec<u8>),
}

/// The segments of a shard waiting for one vectored write.
struct Pending<'s> {
    src: &'s [u8],
    staging: Vec<u8>,
    segs: Vec<Seg>,
    held: usize,
}

impl Pending<'_> {
    fn flush(&mut self, out: &mut dyn MultipartWrite) -> Result<(), StorageError> {
        let mut iov: Vec<IoSlice> = Vec::with_capacity(self.segs.len() * 2);
        for seg in &self.segs {
            match seg {
                Seg::Src(a, b, crc) => {
                    iov.push(IoSlice::new(&self.src[*a..*b]));
                    iov.push(IoSlice::new(crc));
                }
                Seg::Run(a, b) => iov.push(IoSlice::new(&self.src[*a..*b])),
                Seg::Crc(crc) => iov.push(IoSlice::new(crc)),
                Seg::Staged(a, b, crc) => {
                    iov.push(IoSlice::new(&self.staging[*a..*b]));
                    iov.push(IoSlice::new(crc));
                }
                Seg::Encoded(v) => iov.push(IoSlice::new(v)),
            }
        }
        out.write_vectored(&iov)?;
        self.segs.clear();
        self.staging.clear();
        self.held = 0;
        Ok(())
    }
}

/// Whether the bytes of `parts`, whose crc32c is `crc`, are all zero. `zero_crc`, the crc32c
/// of an all-zero subchunk when known, rules out most subchunks before any byte is looked at.
fn all_zero<'a>(
    zero_crc: Option<u32>,
    crc: u32,
    mut parts: impl Iterator<Item = &'a [u8]>,
) -> bool {
    zero_crc.is_none_or(|z| z == crc) && parts.all(|p| p.iter().all(|&x| x == 0))
}

/// A shard's index as it is built: each subchunk's place, and the crc32c list of the footer
/// when the shard has one.
struct IndexBuilder {
    bytes: Vec<u8>,
    crcs: Option<Vec<u32>>,
    /// Where the next subchunk starts.
    offset: u64,
}

impl IndexBuilder {
    /// Enters the next subchunk: empty when it is all zero, else `len` bytes at the offset,
    /// which moves past them.
    fn place(&mut self, all_zero: bool, len: usize, crc: u32) {
        let (at, n, crc) = if all_zero {
            (u64::MAX, u64::MAX, 0)
        } else {
            (self.offset, len as u64, crc)
        };
        self.bytes.extend_from_slice(&at.to_le_bytes());
        self.bytes.extend_from_slice(&n.to_le_bytes());
        if !all_zero {
            self.offset += len as u64;
        }
        if let Some(c) = &mut self.crcs {
            c.push(crc);
        }
    }
}

/// Writes the shard holding `chunk_box` (the full, unclipped chunk) to `out`, taking the data
/// from `src`, a C-order buffer holding `src_box` (which contains `chunk_box`). Does not
/// finish `out`. Returns the bytes written and the shard's tail (footer and index, its last
/// bytes).
///
/// # Errors
/// Encoding or I/O errors (naming the tensor, chunk and object).
///
/// # Panics
/// If `src` is smaller than `src_box` or `chunk_box` is not inside it (caller bugs).
pub fn write_shard(
    out: &mut dyn MultipartWrite,
    src: &[u8],
    src_box: &Region,
    chunk_box: &Region,
    spec: &ShardSpec<'_>,
) -> Result<(u64, Vec<u8>), StorageError> {
    let (subchunk_shape, elem) = (spec.subchunk_shape, spec.elem);
    let per_shard: Vec<u64> = chunk_box
        .shape()
        .iter()
        .zip(subchunk_shape)
        .map(|(c, s)| c / s)
        .collect();
    let n_sub = per_shard.iter().product::<u64>() as usize;
    let sub_bytes = subchunk_shape.iter().product::<u64>() as usize * elem;
    // The crc32c of an all-zero subchunk, to skip the zero test of most subchunks.
    let zero_crc = (sub_bytes <= 1 << 20).then(|| crc32c(&vec![0u8; sub_bytes]));

    let mut index = IndexBuilder {
        bytes: Vec::with_capacity(n_sub * 16 + 4),
        crcs: spec.footer.map(|_| Vec::with_capacity(n_sub)),
        offset: 0,
    };
    let mut p = Pending {
        src,
        staging: Vec::new(),
        segs: Vec::new(),
        held: 0,
    };
    if spec.encode.is_none() {
        // At most every subchunk with its crc32c, then the index and the footer.
        let footer = spec.footer.map_or(Some(0), |(_, _, chunk)| {
            super::footer::footer_len(chunk.len(), n_sub as u64)
        });
        let most = footer.map(|f| (n_sub * (sub_bytes + 4 + 16) + 4) as u64 + f);
        out.reserve(most.unwrap_or(0));
    }

    let mut sub_indices = Vec::with_capacity(n_sub);
    grid::for_each_index(&vec![0; per_shard.len()], &per_shard, |s| {
        sub_indices.push(s.to_vec());
    });
    for (linear, s) in sub_indices.iter().enumerate() {
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
            runs.push((so, len));
        });
        if runs.len() > 1 && spec.encode.is_none() && out.copies_parts() {
            // The writer copies what it is given: the runs go to it as they are, not through
            // the staging buffer (a second copy, into fresh memory).
            let run = |&(so, len): &(usize, usize)| &src[so..so + len];
            let crc = super::checksum::crc32c_of_parts(runs.iter().map(run));
            let zero = all_zero(zero_crc, crc, runs.iter().map(run));
            index.place(zero, sub_bytes + 4, crc);
            if !zero {
                p.segs
                    .extend(runs.iter().map(|&(so, len)| Seg::Run(so, so + len)));
                p.segs.push(Seg::Crc(crc.to_le_bytes()));
                if p.segs.len() >= MAX_SEGS {
                    p.flush(out)?;
                }
            }
            continue;
        }
        let (a, b, staged) = if let [(so, len)] = runs[..] {
            (so, so + len, false)
        } else {
            if p.staging.capacity() == 0 {
                p.staging
                    .reserve_exact(STAGING_BYTES.min(n_sub * sub_bytes));
            }
            if p.staging.len() + sub_bytes > p.staging.capacity() && !p.staging.is_empty() {
                p.flush(out)?;
            }
            let start = p.staging.len();
            for (so, len) in &runs {
                p.staging.extend_from_slice(&src[*so..so + len]);
            }
            (start, p.staging.len(), true)
        };
        let data = if staged { &p.staging[a..b] } else { &src[a..b] };
        let (all_zero, seg, crc, len) = match spec.encode {
            None => {
                let crc = crc32c(data);
                let zero = all_zero(zero_crc, crc, std::iter::once(data));
                let seg = if staged {
                    Seg::Staged(a, b, crc.to_le_bytes())
                } else {
                    Seg::Src(a, b, crc.to_le_bytes())
                };
                (zero, seg, crc, sub_bytes + 4)
            }
            Some(encode) => {
                if data.iter().all(|&x| x == 0) {
                    (true, Seg::Encoded(Vec::new()), 0, 0)
                } else {
                    let enc = encode(linear as u64, data)?;
                    let crc = enc
                        .len()
                        .checked_sub(4)
                        .and_then(|at| enc.get(at..))
                        .map_or(0, |c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                    let n = enc.len();
                    if staged {
                        // The raw bytes are encoded: the staging space is free again.
                        p.staging.truncate(a);
                    }
                    (false, Seg::Encoded(enc), crc, n)
                }
            }
        };
        index.place(all_zero, len, crc);
        if all_zero {
            if staged {
                p.staging.truncate(a);
            }
            continue;
        }
        if let Seg::Encoded(_) = seg {
            p.held += len;
        }
        p.segs.push(seg);
        if p.segs.len() >= MAX_SEGS || p.held >= STAGING_BYTES {
            p.flush(out)?;
        }
    }
    p.flush(out)?;
    let IndexBuilder {
        bytes: mut index,
        crcs,
        offset,
    } = index;
    let crc = crc32c(&index);
    index.extend_from_slice(&crc.to_le_bytes());
    let mut tail = match (spec.footer, crcs) {
        (Some(f), Some(crcs)) => super::footer::encode(f.0, f.1, f.2, &crcs),
        _ => Vec::new(),
    };
    tail.extend_from_slice(&index);
    out.write(&tail)?;
    Ok((offset + tail.len() as u64, tail))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, TensorKey};
    use crate::storage::array::TensorArray;
    use crate::storage::meta::{Compression, TensorEntry, tensor_path};
    use crate::storage::store::{LocalStore, Store};

    fn write_to(
        store: &LocalStore,
        loc: &str,
        src: &[u8],
        src_box: &Region,
        chunk_box: &Region,
        spec: &ShardSpec<'_>,
    ) -> Vec<u8> {
        let mut w = store.put_multipart(loc).unwrap();
        let (n, tail) = write_shard(&mut *w, src, src_box, chunk_box, spec).unwrap();
        w.finish().unwrap();
        let bytes = store.get(loc, u64::MAX).unwrap();
        assert_eq!(n as usize, bytes.len());
        assert!(
            bytes.ends_with(&tail),
            "the tail returned is the object's end"
        );
        bytes
    }

    /// Our writer and zarrs' sharding encoder produce the same bytes, for every compression.
    #[test]
    fn identical_to_zarrs_encoding() {
        let tmp = tempfile::tempdir().unwrap();
        let store = LocalStore::new(tmp.path());
        type Case<'a> = (DType, &'a [u64], &'a [u64], &'a [u64]);
        let cases: &[Case] = &[
            (DType::Float32, &[8, 6], &[4, 6], &[1, 6]),
            (DType::BFloat16, &[8, 12], &[8, 4], &[8, 2]), // thin columns: gathered
            (DType::UInt8, &[5, 3, 4], &[5, 3, 2], &[1, 3, 1]),
            (DType::Int64, &[], &[], &[]),
            (DType::Float8E4M3FN, &[7], &[7], &[7]),
            (DType::Bool, &[9, 2], &[3, 2], &[3, 1]),
            (DType::Float32, &[64, 32], &[64, 32], &[16, 8]),
        ];
        for compression in [Compression::None, Compression::Zstd, Compression::Blosc] {
            for (ci, (dtype, shape, chunk, sub)) in cases.iter().enumerate() {
                let key = TensorKey::new(format!("t{ci}")).unwrap();
                let entry = TensorEntry {
                    path: tensor_path(&key),
                    dtype: *dtype,
                    shape: shape.to_vec(),
                    chunk_shape: chunk.to_vec(),
                    subchunk_shape: sub.to_vec(),
                    compression,
                };
                let arr = TensorArray::create(tmp.path(), &key, &entry).unwrap();
                assert_eq!(arr.uncompressed(), compression == Compression::None);
                let elem = dtype.size();
                let n: u64 = chunk.iter().product();
                // deterministic data, compressible in part, with the second subchunk (if
                // any) all zero
                let mut data: Vec<u8> = (0..n as usize * elem)
                    .map(|i| {
                        if i % 5 == 0 {
                            (i * 7 + ci + 1) as u8
                        } else {
                            3
                        }
                    })
                    .collect();
                let sub_bytes = sub.iter().product::<u64>() as usize * elem;
                let contiguous_second = sub.first().is_some_and(|_| chunk[1..] == sub[1..]);
                if contiguous_second && data.len() >= 2 * sub_bytes {
                    data[sub_bytes..2 * sub_bytes].fill(0);
                }
                let grid = vec![0; chunk.len()];
                for all_zero in [false, true] {
                    if all_zero {
                        data.fill(0);
                    }
                    let chunk_box = Region::new(vec![0; chunk.len()], chunk.to_vec()).unwrap();
                    let encode = |l: u64, raw: &[u8]| arr.encode_subchunk(&grid, l, raw);
                    let spec = ShardSpec {
                        subchunk_shape: sub,
                        elem,
                        encode: (!arr.uncompressed()).then_some(&encode as EncodeSubchunk),
                        footer: None,
                    };
                    let loc = format!("shard{ci}{all_zero}{compression:?}");
                    let ours = write_to(&store, &loc, &data, &chunk_box, &chunk_box, &spec);
                    let theirs = arr.encode_chunk(&grid, &data).unwrap();
                    assert_eq!(
                        ours,
                        theirs.as_ref(),
                        "case {ci} all_zero {all_zero} {compression:?}"
                    );
                }
            }
        }
    }

    /// A chunk inside a larger source buffer is taken from the right place.
    #[test]
    fn chunk_inside_a_larger_piece() {
        let tmp = tempfile::tempdir().unwrap();
        let store = LocalStore::new(tmp.path());
        let piece = Region::new(vec![4, 0], vec![4, 6]).unwrap();
        let src: Vec<u8> = (0..24u8).collect();
        let chunk_box = Region::new(vec![4, 3], vec![4, 3]).unwrap();
        let mut expect = vec![0u8; 12];
        crate::model::copy::copy_region(&src, &piece, &mut expect, &chunk_box, &chunk_box, 1);
        let spec = ShardSpec {
            subchunk_shape: &[2, 3],
            elem: 1,
            encode: None,
            footer: None,
        };
        let a = write_to(&store, "a", &src, &piece, &chunk_box, &spec);
        let b = write_to(&store, "b", &expect, &chunk_box, &chunk_box, &spec);
        assert_eq!(a, b);
    }

    /// An object held in memory, as an object-store writer below the multipart threshold
    /// holds it; `copies` says whether it offers to take pieces ungathered.
    struct Held {
        bytes: Vec<u8>,
        copies: bool,
        /// Pieces given, and the room the writer was told to reserve.
        pieces: usize,
        reserved: u64,
    }

    impl MultipartWrite for Held {
        fn write_vectored(&mut self, parts: &[IoSlice<'_>]) -> Result<(), StorageError> {
            for p in parts {
                self.bytes.extend_from_slice(p);
            }
            self.pieces += parts.len();
            Ok(())
        }
        fn written(&self) -> u64 {
            self.bytes.len() as u64
        }
        fn copies_parts(&self) -> bool {
            self.copies
        }
        fn reserve(&mut self, additional: u64) {
            self.reserved += additional;
        }
        fn finish(self: Box<Self>) -> Result<crate::storage::store::PutResult, StorageError> {
            unreachable!("not finished here")
        }
        fn abort(self: Box<Self>) -> Result<(), StorageError> {
            Ok(())
        }
    }

    /// Thin columns of a larger piece, some subchunks all zero, with a footer: a writer that
    /// takes the runs ungathered gets the same bytes as one that is given gathered
    /// subchunks, and as a file; the hint reserved room for all of them at once.
    #[test]
    fn runs_handed_over_ungathered_make_the_same_shard() {
        let tmp = tempfile::tempdir().unwrap();
        let store = LocalStore::new(tmp.path());
        let piece = Region::new(vec![0, 0], vec![8, 12]).unwrap();
        let elem = 2;
        let mut src: Vec<u8> = (0..8 * 12 * elem)
            .map(|i| (i * 7 % 253) as u8 + 1)
            .collect();
        // The first subchunk (rows 0-1, columns 4-6) is all zero.
        for r in 0..2 {
            src[(r * 12 + 4) * elem..(r * 12 + 7) * elem].fill(0);
        }
        let chunk_box = Region::new(vec![0, 4], vec![8, 6]).unwrap();
        let key = TensorKey::new("w").unwrap();
        let id = SaveId::random();
        let spec = ShardSpec {
            subchunk_shape: &[2, 3],
            elem,
            encode: None,
            footer: Some((id, &key, &[0, 1])),
        };
        let file = write_to(&store, "f", &src, &piece, &chunk_box, &spec);
        let mut outs = Vec::new();
        for copies in [false, true] {
            let mut held = Held {
                bytes: Vec::new(),
                copies,
                pieces: 0,
                reserved: 0,
            };
            let (n, tail) = write_shard(&mut held, &src, &piece, &chunk_box, &spec).unwrap();
            assert_eq!(n as usize, held.bytes.len());
            assert!(held.bytes.ends_with(&tail));
            assert!(held.reserved >= n, "the hint covers the shard: {copies}");
            outs.push((held.bytes, held.pieces));
        }
        assert_eq!(outs[0].0, file);
        assert_eq!(outs[1].0, file);
        // Gathered: each subchunk and its crc32c (and the tail); ungathered: its two rows too.
        assert_eq!(outs[0].1, 7 * 2 + 1);
        assert_eq!(outs[1].1, 7 * 3 + 1);
        // 8 subchunks, one empty: 7 written with their crc32c.
        let index_at = file.len() - (8 * 16 + 4);
        assert_eq!(&file[index_at..index_at + 16], &[0xff; 16]);
        assert!(file.len() > 7 * (2 * 3 * elem + 4));
    }
}
