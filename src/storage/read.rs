//! Reading requested boxes of a tensor straight into caller buffers.
//!
//! zarrs decodes each shard's index (and every subchunk of compressed arrays). Uncompressed
//! subchunks (`bytes` + `crc32c`) are read one of two ways ([`ReadMethod`]):
//! - `pread` (the default): whole subchunks landing contiguously are read in place with one
//!   `preadv` per run of adjacent subchunks and checksummed there; whole subchunks landing
//!   as runs of at least `MIN_IN_PLACE_RUN` (1 KiB; column strips) are read straight
//!   into those runs by `preadv` and checksummed over them; the others are read into a reused
//!   scratch buffer a group of about one core's L2 cache at a time, each checksummed right
//!   after its read and the group copied out while still in cache; an I/O error or a
//!   truncated file
//!   is a typed error;
//! - mapped (opt-in): the part of the shard file holding the needed subchunks is mapped a
//!   window at a time and each subchunk is copied from the page cache straight to where it
//!   belongs in the caller's buffer, its crc32c computed over the copied bytes: one copy per
//!   byte for whole subchunks, but a truncated file or an I/O error raises `SIGBUS`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::array::TensorArray;
use super::checksum::{crc32c_digest, crc32c_value};
use super::error::StorageError;
use super::meta::Compression;
use crate::model::copy::{DisjointBuf as Dest, for_each_run};
use crate::plan::load::{ShardRead, StoredGeometry, SubchunkRead};

/// Most subchunks read by one `preadv`.
const MAX_BATCH: usize = 256;
/// Most bytes read by one `preadv` of several subchunks (checksummed after it, so they
/// should still be in the core's cache).
const MAX_BATCH_BYTES: u64 = 256 << 10;
/// A subchunk larger than this is read and checksummed this many bytes at a time.
const CRC_PIECE: usize = 256 << 10;

/// Counts what a load read from storage, and where its reading threads spent their time.
#[derive(Debug, Default)]
pub struct ReadCounters {
    /// Bytes read from files (indexes and subchunks).
    pub bytes: AtomicU64,
    /// Nanoseconds (summed over the reading threads) opening shard files and reading,
    /// decoding and checking their indexes and footers.
    pub open_ns: AtomicU64,
    /// Nanoseconds in read system calls (`pread` / `preadv`: the kernel's copy from the page
    /// cache or the device), for mapped reads mapping windows of the files, and for object
    /// stores the ranged gets of subchunks.
    pub read_ns: AtomicU64,
    /// Nanoseconds computing and comparing crc32c checksums (and checking `bool` bytes).
    pub checksum_ns: AtomicU64,
    /// Nanoseconds copying in user space: out of the scratch buffer or a mapping (for mapped
    /// reads the crc32c is computed in the same pass and counted here), zero-filling absent
    /// subchunks, decoding compressed ones.
    pub copy_ns: AtomicU64,
}

/// Where the reading threads of a load spent their time, summed over the threads (CPU-side
/// wall time of each step, so with several threads the sum can exceed the load's wall time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadPhases {
    /// Opening shard files, reading and checking their indexes and footers.
    pub open: Duration,
    /// Read system calls (the kernel's copy into the destination or the scratch buffer).
    pub read: Duration,
    /// crc32c checksums.
    pub checksum: Duration,
    /// Copies in user space (scratch or mapping to destination), zero fill, decoding.
    pub copy: Duration,
}

impl std::ops::AddAssign for ReadPhases {
    fn add_assign(&mut self, o: Self) {
        self.open += o.open;
        self.read += o.read;
        self.checksum += o.checksum;
        self.copy += o.copy;
    }
}

impl ReadCounters {
    fn add(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// The time counted so far.
    #[must_use]
    pub fn phases(&self) -> ReadPhases {
        let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        ReadPhases {
            open: d(&self.open_ns),
            read: d(&self.read_ns),
            checksum: d(&self.checksum_ns),
            copy: d(&self.copy_ns),
        }
    }
}

/// Runs `f`, adding the time it took to `slot` (nanoseconds).
#[inline]
pub(crate) fn timed<R>(slot: &AtomicU64, f: impl FnOnce() -> R) -> R {
    let t = Instant::now();
    let r = f();
    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
    slot.fetch_add(ns, Ordering::Relaxed);
    r
}

/// How the subchunks of uncompressed arrays are read.
///
/// Whatever the method, the bytes that land in the caller's buffer are the bytes whose
/// crc32c was checked: they are checksummed where they land (or in a private scratch
/// buffer they are then copied out of), never fetched a second time from the file or a
/// mapping that another process could change between the check and the copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadMethod {
    /// `pread`/`preadv` only (the default): whole subchunks landing contiguously are read
    /// straight into place, the others through a reused scratch buffer (two copies). An I/O
    /// error or a file truncated while it is read is an ordinary error
    /// ([`StorageError::Io`] or [`StorageError::CorruptChunk`]), never a signal.
    #[default]
    Pread,
    /// Map the shard files (a bounded window at a time) and copy from the mapping: one copy
    /// per byte for every layout. **Not safe against truncation or I/O errors:** a shard file
    /// truncated by another program while it is mapped, or a disk error under the mapping,
    /// raises `SIGBUS` and kills the process. Use it only on files nothing else modifies, on
    /// local disks. Falls back to [`ReadMethod::Pread`] for a shard that cannot be mapped.
    Mmap,
}

fn corrupt(arr: &TensorArray, chunk: &[u64], detail: String) -> StorageError {
    StorageError::CorruptChunk {
        key: arr.key().to_string(),
        chunk: chunk.to_vec(),
        path: arr.chunk_path(chunk),
        detail,
    }
}

/// `(offset, nbytes)` of every subchunk of a shard; `None` for absent (all-zero) ones.
type ShardIndex = Vec<Option<(u64, u64)>>;

/// The crc32c of every subchunk in index order given by the shard's footer (format 1.1);
/// `None` for a 1.0 shard, which has no footer.
type FooterCrcs = Option<Vec<u32>>;

/// Checks the footer of a 1.1 shard (`bytes`, read together with the index in one tail
/// read) against the index that committed it: magic, its own crc32c, save id, key hash, chunk
/// coordinates, subchunk count. Returns the subchunk crcs it gives.
fn check_shard_footer(
    arr: &TensorArray,
    chunk: &[u64],
    bytes: &[u8],
) -> Result<FooterCrcs, StorageError> {
    let Some(id) = arr.save_id() else {
        return Ok(None);
    };
    super::footer::check(bytes, id, arr.key(), chunk, arr.subchunks_per_shard())
        .map(Some)
        .map_err(|d| corrupt(arr, chunk, d))
}

/// Opens a shard, reads and decodes its index (and checks its footer), and checks every
/// needed entry fits the file.
fn open_shard(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    counters: &ReadCounters,
) -> Result<(File, ShardIndex, FooterCrcs), StorageError> {
    let (file, index, crcs) = timed(&counters.open_ns, || {
        open_shard_index(arr, geom, &shard.chunk, counters)
    })?;
    check_entries(arr, shard, &index)?;
    Ok((file, index, crcs))
}

/// Opens the shard at `chunk`, reads and decodes its index, checks its footer (format 1.1)
/// and every entry of the index (spec section 7.2); also returns the footer's subchunk
/// checksums.
fn open_shard_index(
    arr: &TensorArray,
    geom: &StoredGeometry,
    chunk: &[u64],
    counters: &ReadCounters,
) -> Result<(File, ShardIndex, FooterCrcs), StorageError> {
    let path = arr.chunk_path(chunk);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(StorageError::MissingChunk {
                key: arr.key().to_string(),
                chunk: chunk.to_vec(),
                path,
            });
        }
        Err(e) => return Err(StorageError::io("open", &path)(e)),
    };
    let len = file
        .metadata()
        .map_err(StorageError::io("stat", &path))?
        .len();
    let idx = arr.index_bytes();
    let foot = arr.footer_bytes();
    let tail = idx.saturating_add(foot);
    if len < tail {
        return Err(corrupt(
            arr,
            chunk,
            format!(
                "file is {len} bytes, shorter than its {idx}-byte index and {foot}-byte footer"
            ),
        ));
    }
    let mut encoded = vec![0u8; crate::model::usize_of(tail)];
    file.read_exact_at(&mut encoded, len - tail)
        .map_err(StorageError::io("read", &path))?;
    counters.add(tail);
    let (index, crcs) = check_tail(arr, geom, chunk, len, &encoded)?;
    Ok((file, index, crcs))
}

/// Decodes and checks a shard's tail (its last `index + footer` bytes, `tail`) of a shard
/// `len` bytes long: index checksum, footer (format 1.1), absent entries against the footer,
/// every entry inside the data, of the right size, none overlapping.
fn check_tail(
    arr: &TensorArray,
    geom: &StoredGeometry,
    chunk: &[u64],
    len: u64,
    tail: &[u8],
) -> Result<(ShardIndex, FooterCrcs), StorageError> {
    let (footer, encoded) = tail.split_at(crate::model::usize_of(arr.footer_bytes()));
    let index = arr.decode_index(chunk, encoded)?;
    let crcs = check_shard_footer(arr, chunk, footer)?;
    if let Some(c) = &crcs {
        check_absent_against_footer(&index, c).map_err(|d| corrupt(arr, chunk, d))?;
    }
    check_index_entries(
        &index,
        len - tail.len() as u64,
        arr.uncompressed().then(|| geom.subchunk_bytes() + 4),
    )
    .map_err(|d| corrupt(arr, chunk, d))?;
    Ok((index, crcs))
}

/// Checks that every subchunk the index says is absent has the footer entry 0 (spec section
/// 7.4): an entry marked absent after the save (and the index's CRC-32C recomputed) would
/// otherwise read as zeros. A present subchunk may have the entry 0 (its CRC-32C can be 0);
/// its stored checksum is compared with the entry when it is read.
fn check_absent_against_footer(index: &ShardIndex, crcs: &[u32]) -> Result<(), String> {
    match index
        .iter()
        .zip(crcs)
        .position(|(e, &c)| e.is_none() && c != 0)
    {
        Some(i) => Err(format!(
            "subchunk {i} is absent in the index, but the shard footer gives it the crc32c {:#010x}: the index was altered after the save",
            crcs[i]
        )),
        None => Ok(()),
    }
}

/// Checks that the index has an entry for every subchunk `shard` needs. (Bounds and sizes of
/// every entry were checked when the index was read, by [`check_index_entries`].)
fn check_entries(
    arr: &TensorArray,
    shard: &ShardRead,
    index: &ShardIndex,
) -> Result<(), StorageError> {
    match shard.subchunks.iter().find(|s| {
        usize::try_from(s.linear)
            .ok()
            .and_then(|i| index.get(i))
            .is_none()
    }) {
        Some(s) => Err(corrupt(
            arr,
            &shard.chunk,
            format!("index has no entry for subchunk {}", s.linear),
        )),
        None => Ok(()),
    }
}

/// Checks every present entry of a shard index (spec section 7.2, "Reading a shard"), used
/// or not: at least the 4 checksum bytes, inside the data part of the file (`data_end` bytes
/// before the index), of the `exact` length for uncompressed arrays, and no two overlapping.
/// Bytes that no entry references are allowed.
fn check_index_entries(
    index: &[Option<(u64, u64)>],
    data_end: u64,
    exact: Option<u64>,
) -> Result<(), String> {
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(index.len());
    for (i, e) in index.iter().enumerate() {
        let Some((off, n)) = *e else { continue };
        let Some(end) = off.checked_add(n).filter(|&end| end <= data_end) else {
            return Err(format!(
                "subchunk {i} at {off}+{n} extends past the data ({data_end} bytes)"
            ));
        };
        if n < 4 || exact.is_some_and(|x| n != x) {
            return Err(format!(
                "subchunk {i} is {n} bytes, expected {}",
                exact.map_or_else(|| "at least 4".to_owned(), |x| x.to_string())
            ));
        }
        spans.push((off, end, i));
    }
    if !spans.is_sorted() {
        spans.sort_unstable();
    }
    match spans.windows(2).find(|w| w[0].1 > w[1].0) {
        Some(w) => Err(format!(
            "subchunks {} ({}..{}) and {} ({}..{}) overlap in the file",
            w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
        )),
        None => Ok(()),
    }
}

/// Checks that the `bool` elements a shard read put into `dest` are 0 or 1 (spec section 6.1).
///
/// # Safety
/// As [`read_shard`]; `dest`'s parts in `shard` have just been filled by this thread.
unsafe fn check_bools(
    arr: &TensorArray,
    shard: &ShardRead,
    dest: Dest<'_>,
) -> Result<(), StorageError> {
    for s in &shard.subchunks {
        for (_, d, len) in runs_of(s, 0, dest) {
            // SAFETY: this thread owns these bytes (caller's contract).
            let bytes = unsafe { dest.slice(d, len) };
            if let Some(b) = bytes.iter().find(|&&b| b > 1) {
                return Err(corrupt(
                    arr,
                    &shard.chunk,
                    format!(
                        "subchunk {}: bool byte {b:#04x} is neither 0 nor 1",
                        s.linear
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Checks a stored subchunk (`stored`: its bytes, then their crc32c; at least 4 bytes) as
/// [`check_crc`] does; returns its bytes without the crc.
fn check_stored<'b>(
    arr: &TensorArray,
    shard: &ShardRead,
    linear: u64,
    stored: &'b [u8],
    footer: Option<&[u32]>,
) -> Result<&'b [u8], StorageError> {
    let (data, crc) = stored.split_at(stored.len() - 4);
    check_crc(
        arr,
        shard,
        linear,
        data,
        [crc[0], crc[1], crc[2], crc[3]],
        footer,
    )?;
    Ok(data)
}

fn check_crc(
    arr: &TensorArray,
    shard: &ShardRead,
    linear: u64,
    data: &[u8],
    stored: [u8; 4],
    footer: Option<&[u32]>,
) -> Result<(), StorageError> {
    check_crc_value(
        arr,
        shard,
        linear,
        super::shard::crc32c(data),
        stored,
        footer,
    )
}

/// [`check_crc`] for a crc computed by the caller. With a footer, the stored crc must also be
/// the one the footer gives for this position (a subchunk moved within or between shards
/// carries a valid crc of its own, but not the one of the place it was moved to).
fn check_crc_value(
    arr: &TensorArray,
    shard: &ShardRead,
    linear: u64,
    computed: u32,
    stored: [u8; 4],
    footer: Option<&[u32]>,
) -> Result<(), StorageError> {
    let stored = u32::from_le_bytes(stored);
    if computed != stored {
        return Err(StorageError::Checksum {
            key: arr.key().to_string(),
            chunk: shard.chunk.clone(),
            subchunk: linear,
            path: arr.chunk_path(&shard.chunk),
            stored,
            computed,
        });
    }
    if let Some(crcs) = footer {
        let expected = usize::try_from(linear).ok().and_then(|i| crcs.get(i));
        if expected != Some(&stored) {
            return Err(corrupt(
                arr,
                &shard.chunk,
                format!(
                    "subchunk {linear} carries crc32c {stored:#010x}, but the shard footer gives {} for this position: subchunks were moved or mixed",
                    expected.map_or("nothing".into(), |e| format!("{e:#010x}"))
                ),
            ));
        }
    }
    Ok(())
}

/// Most iovecs one `preadv` takes (Linux's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Shortest run of a whole subchunk that [`pread_subchunks`] reads straight into its place in
/// the caller's buffer when the subchunk does not land contiguously there (a column strip):
/// shorter runs go through the scratch buffer, where one large read and a user-space copy
/// cost less than the kernel's per-iovec work (measured on a 2-core EPYC: `preadv` into runs
/// of 256 bytes 2.8-7.2 GB/s against 15 GB/s for one `pread` into scratch and a copy out; at
/// 2 KiB runs in place 18.8 against 14.9 GB/s).
const MIN_IN_PLACE_RUN: usize = 1 << 10;

/// `preadv` until every iovec is full.
fn preadv_exact(file: &File, iovs: &mut [libc::iovec], mut offset: u64) -> std::io::Result<()> {
    let mut start = 0;
    while start < iovs.len() {
        let cnt =
            libc::c_int::try_from((iovs.len() - start).min(IOV_MAX)).unwrap_or(libc::c_int::MAX);
        let off =
            libc::off_t::try_from(offset).map_err(|_| std::io::Error::other("offset too large"))?;
        // SAFETY: the iovecs point into live, exclusively borrowed buffers of the stated sizes.
        let n = unsafe { libc::preadv(file.as_raw_fd(), iovs[start..].as_ptr(), cnt, off) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut n = n.unsigned_abs(); // `n >= 0` here
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        offset += n as u64;
        while n > 0 && start < iovs.len() {
            let len = iovs[start].iov_len;
            if n >= len {
                n -= len;
                start += 1;
            } else {
                // SAFETY: advancing within the same buffer.
                iovs[start].iov_base = unsafe { iovs[start].iov_base.cast::<u8>().add(n) }.cast();
                iovs[start].iov_len -= n;
                n = 0;
            }
        }
        while start < iovs.len() && iovs[start].iov_len == 0 {
            start += 1;
        }
    }
    Ok(())
}

/// Fills the parts of `dest` that lie in one shard of an uncompressed array.
///
/// # Safety
/// No other thread may touch the parts of `dest` inside this shard meanwhile (reads of
/// distinct shards of one request touch disjoint bytes).
unsafe fn read_shard_direct(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    dest: Dest<'_>,
    scratch: &mut Vec<u8>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    let (file, index, footer) = open_shard(arr, geom, shard, counters)?;
    // SAFETY: forwarded.
    unsafe {
        pread_subchunks(
            arr,
            geom,
            shard,
            &file,
            &index,
            footer.as_deref(),
            dest,
            scratch,
            counters,
        )
    }
}

/// The reading half of [`read_shard_direct`], on a shard file already opened (and its index
/// checked) by [`open_shard`]: reads `shard.subchunks` by `pread`.
///
/// # Safety
/// As [`read_shard_direct`].
#[allow(clippy::too_many_arguments)]
unsafe fn pread_subchunks(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    file: &File,
    index: &ShardIndex,
    footer: Option<&[u32]>,
    dest: Dest<'_>,
    scratch: &mut Vec<u8>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    let path = arr.chunk_path(&shard.chunk);
    let sub_bytes = crate::model::usize_of(geom.subchunk_bytes());
    let entry = |linear: u64| index[crate::model::usize_of(linear)];

    // Batches of direct subchunks adjacent both in the file and in the destination.
    let mut batch: Vec<(u64, usize)> = Vec::new(); // (linear, dest offset)
    let mut batch_file_start = 0u64;
    let flush = |batch: &mut Vec<(u64, usize)>, file_start: u64| -> Result<(), StorageError> {
        if batch.is_empty() {
            return Ok(());
        }
        if let [(linear, d)] = batch[..]
            && sub_bytes > CRC_PIECE
        {
            // One large subchunk: read a piece at a time, each checksummed right after it
            // is read, while it is still in cache (not in a second pass over memory).
            let mut digest = crc32c_digest();
            let mut crc = [0u8; 4];
            let mut at = 0usize;
            while at < sub_bytes {
                let len = CRC_PIECE.min(sub_bytes - at);
                // SAFETY: disjoint destination ranges of this shard (caller's contract).
                let piece = unsafe { dest.slice(d + at, len) };
                let last = at + len == sub_bytes;
                let mut iovs = [
                    libc::iovec {
                        iov_base: piece.as_mut_ptr().cast(),
                        iov_len: len,
                    },
                    libc::iovec {
                        iov_base: crc.as_mut_ptr().cast(),
                        iov_len: 4,
                    },
                ];
                let n = if last { 2 } else { 1 };
                timed(&counters.read_ns, || {
                    preadv_exact(file, &mut iovs[..n], file_start + at as u64)
                })
                .map_err(StorageError::io("read", &path))?;
                // SAFETY: as above; the read has completed.
                timed(&counters.checksum_ns, || {
                    digest.update(unsafe { dest.slice(d + at, len) });
                });
                at += len;
            }
            counters.add(sub_bytes as u64 + 4);
            batch.clear();
            return check_crc_value(arr, shard, linear, crc32c_value(&digest), crc, footer);
        }
        let mut crcs = vec![[0u8; 4]; batch.len()];
        let mut iovs = Vec::with_capacity(batch.len() * 2);
        for ((_, d), crc) in batch.iter().zip(crcs.iter_mut()) {
            // SAFETY: disjoint destination ranges of this shard (caller's contract).
            let slice = unsafe { dest.slice(*d, sub_bytes) };
            iovs.push(libc::iovec {
                iov_base: slice.as_mut_ptr().cast(),
                iov_len: sub_bytes,
            });
            iovs.push(libc::iovec {
                iov_base: crc.as_mut_ptr().cast(),
                iov_len: 4,
            });
        }
        timed(&counters.read_ns, || {
            preadv_exact(file, &mut iovs, file_start)
        })
        .map_err(StorageError::io("read", &path))?;
        counters.add((sub_bytes as u64 + 4) * batch.len() as u64);
        timed(&counters.checksum_ns, || {
            for ((linear, d), crc) in batch.iter().zip(&crcs) {
                // SAFETY: as above; the reads have completed.
                let data = unsafe { dest.slice(*d, sub_bytes) };
                check_crc(arr, shard, *linear, data, *crc, footer)?;
            }
            Ok::<(), StorageError>(())
        })?;
        batch.clear();
        Ok(())
    };

    // Whole subchunks landing contiguously are read in place (batched); the others are
    // gathered into the scratch buffer in groups and copied out afterwards.
    let mut gathered: Vec<(&SubchunkRead, u64)> = Vec::new();
    for s in &shard.subchunks {
        match entry(s.linear) {
            Some((off, n)) if s.direct => {
                let d = dest.offset_of(s.needed.offset());
                let joins = batch.last().is_some_and(|&(_, last_d)| {
                    let file_end = batch_file_start + (sub_bytes as u64 + 4) * batch.len() as u64;
                    off == file_end
                        && d == last_d + sub_bytes
                        && batch.len() < MAX_BATCH
                        && (batch.len() as u64 + 1) * n <= MAX_BATCH_BYTES
                });
                if !joins {
                    flush(&mut batch, batch_file_start)?;
                    batch_file_start = off;
                }
                batch.push((s.linear, d));
            }
            Some((off, _)) if s.needed == s.stored => {
                let runs = runs_of(s, 0, dest);
                if runs.iter().all(|r| r.2 >= MIN_IN_PLACE_RUN) {
                    // SAFETY: disjoint destination ranges (caller's contract).
                    unsafe {
                        pread_runs(
                            arr, shard, s.linear, file, off, &runs, dest, footer, counters,
                        )?;
                    }
                    counters.add(sub_bytes as u64 + 4);
                } else {
                    gathered.push((s, off));
                }
            }
            Some((off, _)) => gathered.push((s, off)),
            None => {
                // SAFETY: disjoint destination ranges (caller's contract).
                timed(&counters.copy_ns, || unsafe { dest.zero(&s.needed) });
            }
        }
    }
    flush(&mut batch, batch_file_start)?;
    let slot_bytes = sub_bytes + 4;
    let per_group = (GATHER_BYTES / slot_bytes).max(1);
    for group in gathered.chunks(per_group) {
        // Grows once per thread (the scratch buffer is reused): no zeroing afterwards.
        if scratch.len() < group.len() * slot_bytes {
            scratch.resize(group.len() * slot_bytes, 0);
        }
        for (k, (s, off)) in group.iter().enumerate() {
            let slot = &mut scratch[k * slot_bytes..(k + 1) * slot_bytes];
            timed(&counters.read_ns, || file.read_exact_at(slot, *off))
                .map_err(StorageError::io("read", &path))?;
            counters.add(slot_bytes as u64);
            // Checked right after the read, while the slot is in cache, in one call over
            // its contiguous bytes (a crc computed run by run costs more for short runs).
            debug_assert_eq!(slot.len(), sub_bytes + 4);
            timed(&counters.checksum_ns, || {
                check_stored(arr, shard, s.linear, slot, footer)
            })?;
        }
        // Copied out of the private scratch (the bytes checked), still in cache: the group
        // is about one core's L2 cache.
        // SAFETY: disjoint destination ranges (caller's contract).
        timed(&counters.copy_ns, || unsafe {
            scatter(
                group
                    .iter()
                    .enumerate()
                    .map(|(k, (s, _))| (*s, k * slot_bytes)),
                scratch,
                dest,
            );
        });
    }
    Ok(())
}

/// Reads a whole subchunk stored at `off` straight into its runs in `dest` (one `preadv`
/// per [`IOV_MAX`] runs, the last iovec its stored crc32c), then checks the crc over the
/// runs delivered, in order, while they are still in cache.
///
/// # Safety
/// No other thread may touch the runs' bytes of `dest` meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn pread_runs(
    arr: &TensorArray,
    shard: &ShardRead,
    linear: u64,
    file: &File,
    off: u64,
    runs: &[Run],
    dest: Dest<'_>,
    footer: Option<&[u32]>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    let mut crc = [0u8; 4];
    let mut iovs: Vec<libc::iovec> = Vec::with_capacity(runs.len() + 1);
    for &(_, d, len) in runs {
        // SAFETY: disjoint destination ranges (caller's contract).
        let slice = unsafe { dest.slice(d, len) };
        iovs.push(libc::iovec {
            iov_base: slice.as_mut_ptr().cast(),
            iov_len: len,
        });
    }
    iovs.push(libc::iovec {
        iov_base: crc.as_mut_ptr().cast(),
        iov_len: 4,
    });
    timed(&counters.read_ns, || preadv_exact(file, &mut iovs, off))
        .map_err(StorageError::io("read", &arr.chunk_path(&shard.chunk)))?;
    // The runs of a whole subchunk follow each other in its stored bytes: their crc, in
    // order, is the stored bytes' crc, computed over the bytes delivered.
    timed(&counters.checksum_ns, || {
        let mut digest = crc32c_digest();
        for &(_, d, len) in runs {
            // SAFETY: as above; the read has completed.
            digest.update(unsafe { dest.slice(d, len) });
        }
        check_crc_value(arr, shard, linear, crc32c_value(&digest), crc, footer)
    })
}

/// Bytes of gathered subchunks read into the scratch buffer and copied out together: about
/// one core's L2 cache, so that the copy-out reads them from cache.
const GATHER_BYTES: usize = 1 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's reusable scratch buffer (allocated once per thread, so that
/// reads do not fault in fresh pages for every shard).
pub fn with_scratch<R>(f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut v) => f(&mut v),
        Err(_) => f(&mut Vec::new()),
    })
}

/// Copies `run.len()` bytes; short runs with fixed-size moves the compiler inlines.
#[inline]
fn copy_run(dst: &mut [u8], src: &[u8]) {
    if src.len() > 256 {
        dst.copy_from_slice(src);
        return;
    }
    let mut d = dst.chunks_exact_mut(32);
    let mut s = src.chunks_exact(32);
    for (dc, sc) in (&mut d).zip(&mut s) {
        let block: [u8; 32] = sc.try_into().unwrap_or([0; 32]);
        dc.copy_from_slice(&block);
    }
    d.into_remainder().copy_from_slice(s.remainder());
}

/// A run to copy: (offset in the source, offset in the destination, bytes).
type Run = (usize, usize, usize);

/// The runs that copy the needed part of subchunk `s`, whose stored bytes start at `start`
/// in the source, into `dest`, in the subchunk's C order.
fn runs_of(s: &SubchunkRead, start: usize, dest: Dest<'_>) -> Vec<Run> {
    let mut runs = Vec::new();
    for_each_run(
        &s.stored,
        dest.region(),
        &s.needed,
        dest.elem(),
        |so, d, len| runs.push((start + so, d, len)),
    );
    runs
}

/// Copies the needed parts of subchunks held in `src` (each given with the offset of its
/// bytes there) into `dest`. When the subchunks have the same run structure (column strips
/// of the same rows, the common case) their runs are interleaved so that the destination is
/// written in order, row by row.
///
/// # Safety
/// No other thread may touch the needed parts of `dest` meanwhile.
unsafe fn scatter<'s>(
    subs: impl Iterator<Item = (&'s SubchunkRead, usize)>,
    src: &[u8],
    dest: Dest<'_>,
) {
    let lists: Vec<Vec<Run>> = subs.map(|(s, start)| runs_of(s, start, dest)).collect();
    let same = lists.windows(2).all(|w| w[0].len() == w[1].len());
    let mut copy = |(so, d, len): Run| {
        // SAFETY: forwarded to the caller.
        copy_run(unsafe { dest.slice(d, len) }, &src[so..so + len]);
    };
    if same && lists.len() > 1 {
        for i in 0..lists[0].len() {
            for l in &lists {
                copy(l[i]);
            }
        }
    } else {
        for l in lists {
            l.into_iter().for_each(&mut copy);
        }
    }
}

/// Checks that a compressed subchunk declares exactly the decoded size it must have, before
/// anything is allocated for it: a crafted stream with a valid crc32c must not make the
/// decoder allocate what its header claims.
fn check_declared_size(
    compression: Compression,
    payload: &[u8],
    expected: usize,
) -> Result<(), String> {
    let declared = match compression {
        Compression::Zstd => {
            // One frame, exactly: zarrs sizes its output by the sum of every frame's
            // declared size, so a second frame declaring a huge size must be refused too.
            match zstd::zstd_safe::find_frame_compressed_size(payload) {
                Ok(n) if n == payload.len() => {}
                Ok(n) => {
                    return Err(format!(
                        "the zstd stream is not one frame ({n} of its {} bytes are the first)",
                        payload.len()
                    ));
                }
                Err(_) => return Err("not a zstd frame".into()),
            }
            match zstd::zstd_safe::get_frame_content_size(payload) {
                Ok(Some(n)) => n,
                Ok(None) => return Err("zstd frame does not declare its size".into()),
                Err(_) => return Err("not a zstd frame".into()),
            }
        }
        Compression::Blosc => {
            // blosc header: version, versionlz, flags, typesize, nbytes (u32 LE), blocksize, cbytes
            let field = |at: usize| {
                payload
                    .get(at..at + 4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            };
            let (Some(nbytes), Some(cbytes)) = (field(4), field(12)) else {
                return Err("blosc header truncated".into());
            };
            if cbytes as usize != payload.len() {
                return Err(format!(
                    "blosc header says {cbytes} compressed bytes, the subchunk has {}",
                    payload.len()
                ));
            }
            u64::from(nbytes)
        }
        Compression::None => return Ok(()),
    };
    if declared == expected as u64 {
        Ok(())
    } else {
        Err(format!(
            "the compressed stream declares {declared} bytes, expected {expected}"
        ))
    }
}

/// Fills the parts of `dest` in one shard of a compressed array: each needed subchunk is read,
/// its crc32c checked, its declared size checked, then decoded by zarrs and copied out.
///
/// # Safety
/// As [`read_shard_direct`].
unsafe fn read_shard_compressed(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    dest: Dest<'_>,
    scratch: &mut Vec<u8>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    let (file, index, footer) = open_shard(arr, geom, shard, counters)?;
    // SAFETY: forwarded.
    unsafe {
        compressed_subchunks(
            arr,
            geom,
            shard,
            &file,
            &index,
            footer.as_deref(),
            dest,
            scratch,
            counters,
        )
    }
}

/// The reading half of [`read_shard_compressed`], on a shard file already opened (and its
/// index and footer checked).
///
/// # Safety
/// As [`read_shard_direct`].
#[allow(clippy::too_many_arguments)]
unsafe fn compressed_subchunks(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    file: &File,
    index: &ShardIndex,
    footer: Option<&[u32]>,
    dest: Dest<'_>,
    scratch: &mut Vec<u8>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    let path = arr.chunk_path(&shard.chunk);
    for s in &shard.subchunks {
        match index[crate::model::usize_of(s.linear)] {
            None => {
                // SAFETY: disjoint destination ranges (caller's contract).
                unsafe { dest.zero(&s.needed) };
            }
            Some((off, n)) => {
                stored_at_least_crc(arr, shard, s.linear, n)?;
                scratch.resize(crate::model::usize_of(n), 0);
                timed(&counters.read_ns, || file.read_exact_at(scratch, off))
                    .map_err(StorageError::io("read", &path))?;
                counters.add(n);
                // SAFETY: forwarded (caller's contract).
                unsafe { decode_compressed(arr, geom, shard, s, scratch, footer, dest, counters)? };
            }
        }
    }
    Ok(())
}

/// A stored subchunk of `n` bytes holds at least its crc32c.
fn stored_at_least_crc(
    arr: &TensorArray,
    shard: &ShardRead,
    linear: u64,
    n: u64,
) -> Result<(), StorageError> {
    if n < 4 {
        return Err(corrupt(
            arr,
            &shard.chunk,
            format!("subchunk {linear} is only {n} bytes"),
        ));
    }
    Ok(())
}

/// Checks one compressed subchunk's stored bytes (`stored`: the payload, then its crc32c; at
/// least 4 bytes) against its checksum, footer entry, declared size and frame, then decodes
/// it into its place in `dest`.
///
/// # Safety
/// As [`read_shard_direct`].
#[allow(clippy::too_many_arguments)]
unsafe fn decode_compressed(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    s: &SubchunkRead,
    stored: &[u8],
    footer: Option<&[u32]>,
    dest: Dest<'_>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    let payload = timed(&counters.checksum_ns, || {
        check_stored(arr, shard, s.linear, stored, footer)
    })?;
    let sub_bytes = crate::model::usize_of(geom.subchunk_bytes());
    check_declared_size(arr.entry().compression, payload, sub_bytes)
        .map_err(|d| corrupt(arr, &shard.chunk, format!("subchunk {}: {d}", s.linear)))?;
    super::frame::check(
        arr.entry().compression,
        payload,
        geom.subchunk_bytes(),
        geom.elem,
    )
    .map_err(|d| corrupt(arr, &shard.chunk, format!("subchunk {}: {d}", s.linear)))?;
    timed(&counters.copy_ns, || {
        let decoded = arr.decode_subchunk(&shard.chunk, s.linear, stored)?;
        // SAFETY: disjoint destination ranges (caller's contract).
        unsafe { scatter(std::iter::once((s, 0)), &decoded, dest) };
        Ok::<(), StorageError>(())
    })
}

/// Fills the parts of `dest` that lie in `shard`.
///
/// # Safety
/// No other thread may touch the bytes of `dest` inside this shard meanwhile; reads of
/// distinct shards touch disjoint bytes.
pub unsafe fn read_shard(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    dest: Dest<'_>,
    scratch: &mut Vec<u8>,
    counters: &ReadCounters,
    method: ReadMethod,
) -> Result<(), StorageError> {
    // SAFETY: forwarded.
    unsafe {
        if !arr.uncompressed() {
            read_shard_compressed(arr, geom, shard, dest, scratch, counters)
        } else if method == ReadMethod::Mmap {
            read_shard_mapped(arr, geom, shard, dest, scratch, counters)
        } else {
            read_shard_direct(arr, geom, shard, dest, scratch, counters)
        }?;
        if arr.entry().dtype == crate::model::DType::Bool {
            timed(&counters.checksum_ns, || check_bools(arr, shard, dest))?;
        }
    }
    Ok(())
}

/// Most bytes of a shard file mapped at once by one reading thread.
const MAP_WINDOW: u64 = 8 << 20;

/// A read-only, pre-faulted mapping of part of a file, unmapped on drop.
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    /// Maps `[start, start + len)` of `file` (`start` a multiple of the page size).
    fn new(file: &File, start: u64, len: usize) -> std::io::Result<Mapping> {
        let off = libc::off_t::try_from(start).map_err(|_| std::io::Error::other("offset"))?;
        // SAFETY: a fresh private read-only mapping; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_POPULATE,
                file.as_raw_fd(),
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` readable bytes at `ptr` while the mapping lives; a file truncated
        // meanwhile raises SIGBUS on access (documented on `ReadMethod::Mmap`, opt-in).
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// [`read_shard_direct`] through windows of a mapping of the shard file: every subchunk is
/// copied once, from the mapping to its place in `dest`.
///
/// # Safety
/// As [`read_shard_direct`].
unsafe fn read_shard_mapped(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    dest: Dest<'_>,
    scratch: &mut Vec<u8>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    let (file, index, footer) = open_shard(arr, geom, shard, counters)?;
    let footer = footer.as_deref();
    let slot = crate::model::usize_of(geom.subchunk_bytes()) + 4;
    let page = page_size();
    // Present subchunks with their file offsets, in plan order (file order for zarrckpt's
    // own files); absent ones are zeros.
    let mut present: Vec<(&SubchunkRead, u64)> = Vec::with_capacity(shard.subchunks.len());
    for s in &shard.subchunks {
        match index[crate::model::usize_of(s.linear)] {
            Some((off, _)) => present.push((s, off)),
            // SAFETY: disjoint destination ranges (caller's contract).
            None => unsafe { dest.zero(&s.needed) },
        }
    }
    let mut rest = &present[..];
    while !rest.is_empty() {
        // The longest prefix whose bytes fit one window.
        let (mut lo, mut hi) = (u64::MAX, 0u64);
        let mut n = 0;
        for &(_, off) in rest {
            let (l, h) = (lo.min(off & !(page - 1)), hi.max(off + slot as u64));
            if n > 0 && h - l > MAP_WINDOW {
                break;
            }
            (lo, hi, n) = (l, h, n + 1);
        }
        let (window, later) = rest.split_at(n);
        rest = later;
        let len = crate::model::usize_of(hi - lo);
        let Ok(map) = timed(&counters.read_ns, || Mapping::new(&file, lo, len)) else {
            // No mapping (an odd filesystem, or no address space): read these by `pread`.
            let part = ShardRead {
                chunk: shard.chunk.clone(),
                subchunks: window.iter().map(|(s, _)| (*s).clone()).collect(),
            };
            // SAFETY: forwarded.
            unsafe {
                pread_subchunks(
                    arr, geom, &part, &file, &index, footer, dest, scratch, counters,
                )?;
            };
            continue;
        };
        // Copies from the mapping with the crc32c computed in the same pass: counted as copy.
        timed(&counters.copy_ns, || -> Result<(), StorageError> {
            let bytes = map.bytes();
            let at = |off: u64| crate::model::usize_of(off - lo);
            let mut whole: Vec<(&SubchunkRead, usize, [u8; 4])> = Vec::new();
            let mut partial: Vec<(&SubchunkRead, usize)> = Vec::new();
            for &(s, off) in window {
                let (data, crc) = bytes[at(off)..at(off) + slot].split_at(slot - 4);
                let crc = [crc[0], crc[1], crc[2], crc[3]];
                if s.direct {
                    // SAFETY: disjoint destination ranges (caller's contract).
                    let out = unsafe { dest.slice(dest.offset_of(s.needed.offset()), slot - 4) };
                    let mut digest = crc32c_digest();
                    for (o, d) in out.chunks_mut(CRC_BAND).zip(data.chunks(CRC_BAND)) {
                        o.copy_from_slice(d);
                        digest.update(o);
                    }
                    let computed = crc32c_value(&digest);
                    check_crc_value(arr, shard, s.linear, computed, crc, footer)?;
                } else if s.needed == s.stored {
                    whole.push((s, at(off), crc));
                } else {
                    partial.push((s, at(off)));
                }
                counters.add(slot as u64);
            }
            // SAFETY: disjoint destination ranges (caller's contract).
            unsafe { scatter_checked(arr, shard, &whole, bytes, dest, footer)? };
            // Partly needed subchunks: copied whole into private scratch, checked there and
            // copied out from there, so the bytes used are the bytes checked.
            for (s, start) in partial {
                scratch.clear();
                scratch.extend_from_slice(&bytes[start..start + slot]);
                check_stored(arr, shard, s.linear, scratch, footer)?;
                // SAFETY: disjoint destination ranges (caller's contract).
                unsafe { scatter(std::iter::once((s, 0)), scratch, dest) };
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Bytes of each subchunk checksummed and copied out in one step by [`scatter_checked`]
/// (small enough to still be in the L1 cache for the copy).
const CRC_BAND: usize = 16 << 10;

/// Copies whole subchunks held in `src` (each with the offset of its bytes there and its
/// stored crc32c) into `dest`, where they are not contiguous, checking each crc on the way:
/// the subchunks advance together a band of runs at a time, each run checksummed right
/// after it is copied (from the destination, still in cache), so every source byte is
/// fetched once and the crc covers exactly the bytes delivered.
///
/// # Safety
/// No other thread may touch the subchunks' parts of `dest` meanwhile.
unsafe fn scatter_checked(
    arr: &TensorArray,
    shard: &ShardRead,
    subs: &[(&SubchunkRead, usize, [u8; 4])],
    src: &[u8],
    dest: Dest<'_>,
    footer: Option<&[u32]>,
) -> Result<(), StorageError> {
    let lists: Vec<Vec<Run>> = subs
        .iter()
        .map(|&(s, start, _)| runs_of(s, start, dest))
        .collect();
    let longest = lists.iter().flatten().map(|r| r.2).max().unwrap_or(1);
    let band = (CRC_BAND / longest.max(1)).max(1);
    // No subchunks: no bands to run.
    let most = lists.iter().map(Vec::len).max().unwrap_or(0);
    let mut digests: Vec<crc_fast::Digest> = subs.iter().map(|_| crc32c_digest()).collect();
    let mut i = 0;
    while i < most {
        for (list, digest) in lists.iter().zip(digests.iter_mut()) {
            let part = &list[i.min(list.len())..(i + band).min(list.len())];
            // The runs of a whole subchunk follow each other in its stored bytes, so the
            // crc of the copied runs, in order, is the crc of the stored bytes; computing it
            // over the copies checks the bytes actually delivered.
            for &(so, d, len) in part {
                // SAFETY: forwarded to the caller.
                let out = unsafe { dest.slice(d, len) };
                copy_run(out, &src[so..so + len]);
                digest.update(out);
            }
        }
        i += band;
    }
    for (&(s, _, stored), digest) in subs.iter().zip(&digests) {
        let computed = crc32c_value(digest);
        check_crc_value(arr, shard, s.linear, computed, stored, footer)?;
    }
    Ok(())
}

/// Most bytes of one box [`verify_shard`] reads at a time (besides one subchunk, which may
/// be larger, up to [`super::meta::MAX_SUBCHUNK_BYTES`]).
const VERIFY_BOX_BYTES: u64 = 16 << 20;
/// Most subchunks of one box [`verify_shard`] plans and reads at a time (bounds the plan).
const VERIFY_BOX_SUBCHUNKS: u64 = 1 << 14;

/// Reads every subchunk of the shard at `chunk` that holds part of `region` (the chunk's
/// box clipped to the tensor) and checks it: crc32c, index geometry, decoded size. The shard
/// and its index are read once; the data is read a box of whole subchunks at a time into
/// `buf`, so memory stays bounded by 16 MiB (or one subchunk) and planning by 16,384
/// subchunks at a time, whatever the chunk's declared size. Calls `progress` with the
/// bytes of each box checked.
///
/// # Errors
/// The first problem found, as [`read_shard`].
#[allow(clippy::too_many_arguments)]
pub fn verify_shard(
    arr: &TensorArray,
    geom: &StoredGeometry,
    chunk: &[u64],
    region: &crate::model::Region,
    scratch: &mut Vec<u8>,
    buf: &mut Vec<u8>,
    counters: &ReadCounters,
    progress: &dyn Fn(u64),
) -> Result<(), StorageError> {
    let (file, index, footer) = timed(&counters.open_ns, || {
        open_shard_index(arr, geom, chunk, counters)
    })?;
    let footer = footer.as_deref();
    let nd = geom.chunk_shape.len();
    let per_shard: Vec<u64> = geom
        .chunk_shape
        .iter()
        .zip(&geom.subchunk_shape)
        .map(|(c, s)| c / s.max(&1))
        .collect();
    // Box shape in subchunks: whole trailing dimensions while they fit, then part of one.
    let sub_bytes = geom.subchunk_bytes().max(1);
    let most = (VERIFY_BOX_BYTES / sub_bytes).clamp(1, VERIFY_BOX_SUBCHUNKS);
    let mut tile = vec![1u64; nd];
    let mut inner = 1u64;
    for d in (0..nd).rev() {
        if inner.saturating_mul(per_shard[d]) <= most {
            tile[d] = per_shard[d];
            inner = inner.saturating_mul(per_shard[d]);
        } else {
            tile[d] = (most / inner).max(1);
            break;
        }
    }
    let boxes: Vec<u64> = per_shard
        .iter()
        .zip(&tile)
        .map(|(n, t)| n.div_ceil(*t))
        .collect();
    let origin: Vec<u64> = chunk
        .iter()
        .zip(&geom.chunk_shape)
        .map(|(i, c)| i * c)
        .collect();
    let mut result = Ok(());
    crate::plan::grid::for_each_index(&vec![0; nd], &boxes, |b| {
        if result.is_err() {
            return;
        }
        let offset: Vec<u64> = (0..nd)
            .map(|d| origin[d] + b[d] * tile[d] * geom.subchunk_shape[d])
            .collect();
        let shape: Vec<u64> = (0..nd)
            .map(|d| {
                (tile[d] * geom.subchunk_shape[d])
                    .min(geom.chunk_shape[d] - b[d] * tile[d] * geom.subchunk_shape[d])
            })
            .collect();
        // A tile of subchunks inside the chunk of the checked geometry.
        let Some(part) =
            crate::model::Region::from_parts_unchecked(offset, shape).intersect(region)
        else {
            return;
        };
        result = (|| {
            let n = part
                .num_elements()
                .ok()
                .and_then(|n| crate::model::usize_of(n).checked_mul(geom.elem))
                .ok_or_else(|| corrupt(arr, chunk, "box size overflows".into()))?;
            buf.clear();
            buf.resize(n, 0);
            for shard in geom.reads_for(&part) {
                check_entries(arr, &shard, &index)?;
                let dest = Dest::new(&mut buf[..], &part, geom.elem);
                // SAFETY: this thread owns `buf`, and only this read writes it.
                unsafe {
                    if arr.uncompressed() {
                        pread_subchunks(
                            arr, geom, &shard, &file, &index, footer, dest, scratch, counters,
                        )?;
                    } else {
                        compressed_subchunks(
                            arr, geom, &shard, &file, &index, footer, dest, scratch, counters,
                        )?;
                    }
                }
            }
            if arr.entry().dtype == crate::model::DType::Bool
                && let Some(b) = buf.iter().find(|&&b| b > 1)
            {
                return Err(corrupt(
                    arr,
                    chunk,
                    format!("bool byte {b:#04x} is neither 0 nor 1"),
                ));
            }
            progress(n as u64);
            Ok(())
        })();
    });
    result
}

/// This machine's physical memory in bytes (`u64::MAX` when unknown).
fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    u64::try_from(pages).map_or(u64::MAX, |p| p.saturating_mul(page_size()))
}

/// A zeroed buffer of `n` elements for reading a whole tensor or array whose size comes from
/// metadata: refused with [`StorageError::TooLarge`] when it exceeds the machine's physical
/// memory or cannot be allocated (never an abort). The pages are allocated zeroed by the
/// system and only touched as data is read into them.
///
/// # Errors
/// [`StorageError::TooLarge`], naming `key` and `path`.
pub fn zeroed_buffer<T: crate::model::Element>(
    n: u64,
    key: &str,
    path: &std::path::Path,
) -> Result<Vec<T>, StorageError> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>() as u64);
    let too_large = |reason: String| StorageError::TooLarge {
        key: key.to_owned(),
        path: path.to_owned(),
        bytes,
        reason,
    };
    let mem = physical_memory();
    if bytes > mem {
        return Err(too_large(format!(
            "more than this machine's {mem} bytes of memory"
        )));
    }
    let n = usize::try_from(n).map_err(|_| too_large("too many elements".into()))?;
    let layout = std::alloc::Layout::array::<T>(n)
        .map_err(|_| too_large("too large for one allocation".into()))?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: a non-zero-sized layout.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(too_large("the allocation failed".into()));
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `n` `T`s, all
    // zero bytes, which is a valid `T` (`Element` types are plain numeric data).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

// Reads from bytes already in memory (stores without local files: ranged gets). Added for
// the storage seam's readers; the checks and copies are the ones above.

/// A shard's index, decoded and checked, with the subchunk checksums its footer gives:
/// what a reader over a store without local files fetches once per shard (and may keep).
#[derive(Debug, Clone)]
pub struct FetchedIndex {
    index: ShardIndex,
    footer: FooterCrcs,
}

impl FetchedIndex {
    /// `(offset, bytes)` in the shard of subchunk `linear` (checksum included); `None` when
    /// it is absent (all fill value) or beyond the index.
    #[must_use]
    pub fn entry(&self, linear: u64) -> Option<(u64, u64)> {
        usize::try_from(linear)
            .ok()
            .and_then(|i| self.index.get(i))
            .copied()
            .flatten()
    }

    /// Bytes this index holds in memory (for bounding a cache of indexes).
    #[must_use]
    pub fn memory_bytes(&self) -> u64 {
        let n = self.index.len() as u64;
        n * 24 + self.footer.as_ref().map_or(0, |c| c.len() as u64 * 4)
    }
}

/// Bytes at the end of every shard of `arr` that hold its index and footer: what a ranged
/// read of the tail fetches.
#[must_use]
pub fn shard_tail_bytes(arr: &TensorArray) -> u64 {
    arr.index_bytes().saturating_add(arr.footer_bytes())
}

/// Decodes and checks the tail (`tail`, the last [`shard_tail_bytes`] bytes) of the shard at
/// `chunk`, whose object is `len` bytes long, exactly as a local read checks it: index
/// checksum, footer (format 1.1), absent entries against the footer, every entry inside the
/// data, of the right size, none overlapping.
///
/// # Errors
/// [`StorageError::CorruptChunk`] naming key, chunk and object.
pub fn decode_shard_tail(
    arr: &TensorArray,
    geom: &StoredGeometry,
    chunk: &[u64],
    len: u64,
    tail: &[u8],
) -> Result<FetchedIndex, StorageError> {
    let want = shard_tail_bytes(arr);
    if len < want || tail.len() as u64 != want {
        return Err(corrupt(
            arr,
            chunk,
            format!(
                "object is {len} bytes ({} of its tail read), shorter than its {}-byte index and {}-byte footer",
                tail.len(),
                arr.index_bytes(),
                arr.footer_bytes()
            ),
        ));
    }
    let (index, crcs) = check_tail(arr, geom, chunk, len, tail)?;
    Ok(FetchedIndex {
        index,
        footer: crcs,
    })
}

/// Fills the parts of `dest` in `shard` from subchunk bytes already fetched: `fetched` holds
/// `(offset in the shard, bytes)` pieces, sorted by offset, covering every present subchunk
/// `shard` names. Each subchunk's crc32c (and footer entry) is checked before its bytes are
/// copied out, compressed ones are size-checked and decoded by zarrs, absent ones zeroed,
/// `bool` bytes checked: the same checks as a local read, with the same errors. Checksum and
/// copy time go to `counters` (the fetch itself is the caller's to count).
///
/// # Errors
/// [`StorageError::Checksum`] / [`StorageError::CorruptChunk`] naming key, chunk, subchunk
/// and object; a piece missing from `fetched` is a [`StorageError::CorruptChunk`] too.
///
/// # Safety
/// As [`read_shard`].
pub unsafe fn read_shard_from(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    index: &FetchedIndex,
    fetched: &[(u64, &[u8])],
    dest: Dest<'_>,
    counters: &ReadCounters,
) -> Result<(), StorageError> {
    check_entries(arr, shard, &index.index)?;
    let footer = index.footer.as_deref();
    for s in &shard.subchunks {
        let Some((off, n)) = index.entry(s.linear) else {
            // SAFETY: disjoint destination ranges (caller's contract).
            unsafe { dest.zero(&s.needed) };
            continue;
        };
        let piece = fetched
            .partition_point(|(start, _)| *start <= off)
            .checked_sub(1)
            .and_then(|i| {
                let (start, bytes) = fetched[i];
                let at = usize::try_from(off - start).ok()?;
                bytes.get(at..at.checked_add(usize::try_from(n).ok()?)?)
            })
            .ok_or_else(|| {
                corrupt(
                    arr,
                    &shard.chunk,
                    format!(
                        "subchunk {} ({off}+{n}) was not fetched whole: the object is shorter than its index says",
                        s.linear
                    ),
                )
            })?;
        stored_at_least_crc(arr, shard, s.linear, n)?;
        if arr.uncompressed() {
            let payload = timed(&counters.checksum_ns, || {
                check_stored(arr, shard, s.linear, piece, footer)
            })?;
            // SAFETY: disjoint destination ranges (caller's contract).
            timed(&counters.copy_ns, || unsafe {
                scatter(std::iter::once((s, 0)), payload, dest);
            });
            continue;
        }
        // SAFETY: forwarded (caller's contract).
        unsafe { decode_compressed(arr, geom, shard, s, piece, footer, dest, counters)? };
    }
    if arr.entry().dtype == crate::model::DType::Bool {
        // SAFETY: forwarded; this thread just filled these bytes.
        unsafe { check_bools(arr, shard, dest)? };
    }
    Ok(())
}
