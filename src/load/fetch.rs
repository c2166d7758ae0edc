//! Reads over a store without local files (object stores, in-memory stores): each shard's
//! tail (index and footer) from the writer's tails object when the committed manifest locates
//! a copy (many in one ranged get, before a load's reads: [`Fetcher::prefetch_tails`]), else
//! by one ranged get of the shard's end, decoded once and kept; then the needed
//! subchunks by ranged gets coalesced on subchunk boundaries, a bounded batch at a time,
//! checked and copied by the same code as a local read
//! ([`crate::storage::read::read_shard_from`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::model::copy::DisjointBuf;
use crate::model::{Region, TensorKey};
use crate::plan::load::{ShardRead, StoredGeometry, SubchunkRead};
use crate::storage::read::{
    FetchedIndex, ReadCounters, decode_shard_tail, read_shard_from, shard_tail_bytes, timed,
};
use crate::storage::store::{GET_RANGE_BYTES, Store, join};
use crate::storage::{StorageError, TensorArray};

/// Subchunks of one shard at most this many bytes apart are fetched by one ranged get (the
/// gap with them). The same distance as `object_store`'s own coalescing, so that the bytes
/// counted here are the bytes requested from the server.
pub(crate) const COALESCE_GAP: u64 = 1 << 20;

/// Most bytes one reading thread fetches into memory at once (besides one subchunk, which may
/// be larger): a reader's fetch buffers stay below its I/O threads x this.
pub(crate) const BATCH_BYTES: u64 = 32 << 20;

/// Most bytes of decoded shard indexes a reader keeps; indexes beyond it are decoded again
/// when read again.
pub(crate) const INDEX_CACHE_BYTES: u64 = 64 << 20;

/// Bytes of a shard fetched together with its index: where each piece starts, and its bytes,
/// in order.
type Head = Vec<(u64, Vec<u8>)>;

/// A shard: its tensor and grid index.
type ShardId = (TensorKey, Vec<u64>);

/// Decoded shard indexes, by tensor and chunk, with a count of the decodes.
#[derive(Debug, Default)]
pub(crate) struct IndexCache {
    map: Mutex<HashMap<ShardId, Arc<FetchedIndex>>>,
    bytes: AtomicU64,
    decoded: AtomicU64,
    gets: AtomicU64,
}

impl IndexCache {
    /// How many shard indexes were fetched and decoded so far.
    pub(crate) fn decoded(&self) -> u64 {
        self.decoded.load(Ordering::Relaxed)
    }

    /// How many ranged gets of shard bytes (each of one or more ranges) were made so far.
    pub(crate) fn gets(&self) -> u64 {
        self.gets.load(Ordering::Relaxed)
    }
}

/// What a committed manifest says of one object: its size and crc32c, and for a shard where a copy of
/// its tail is (the tails object's location and the offset of the copy in it; spec 20.7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Listed {
    pub(crate) size: u64,
    pub(crate) crc32c: u32,
    pub(crate) tail: Option<(String, u64)>,
}

/// Where shards are fetched from: a store, the checkpoint's prefix in it, the objects as a
/// committed manifest lists them, by location (no `HEAD` per shard then), and the index
/// cache.
#[derive(Debug)]
pub(crate) struct Fetcher {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) prefix: String,
    pub(crate) listed: Option<HashMap<String, Listed>>,
    pub(crate) cache: IndexCache,
}

impl crate::storage::object::CheckpointObjects for Fetcher {
    fn shown(&self, rel: &str) -> std::path::PathBuf {
        self.store.display_path(&join(&self.prefix, rel))
    }

    fn whole(&self, rel: &str, max: u64) -> Result<Vec<u8>, StorageError> {
        Fetcher::whole(self, &join(&self.prefix, rel), max)
    }
}

/// One shard a rank is about to read: its array, stored geometry and shard read.
pub(crate) type Planned<'a> = (&'a TensorArray, &'a StoredGeometry, &'a ShardRead);

/// A copy of one shard's tail in a tails object (spec 20.7), about to be fetched.
struct TailAt<'a> {
    /// The shard.
    shard: Planned<'a>,
    /// The shard object's committed size.
    size: u64,
    /// Where the copy starts in the tails object, and its length.
    at: Range<u64>,
}

/// Whether the byte range `next` joins the range `last` in one range of a get: it starts at
/// most [`COALESCE_GAP`] bytes after `last` ends, and the two together stay within
/// [`GET_RANGE_BYTES`] (so that a store fetches the range as one request, with nothing to join).
fn joins(last: &Range<u64>, next: &Range<u64>) -> bool {
    next.start.saturating_sub(last.end) <= COALESCE_GAP
        && next.end.max(last.end).saturating_sub(last.start) <= GET_RANGE_BYTES
}

/// Adds `next` to `ranges` (sorted by start): joined to the last one when [`joins`], else
/// as a range of its own.
fn coalesce(ranges: &mut Vec<Range<u64>>, next: Range<u64>) {
    match ranges.last_mut() {
        Some(r) if joins(r, &next) => r.end = r.end.max(next.end),
        _ => ranges.push(next),
    }
}

fn missing(arr: &TensorArray, chunk: &[u64]) -> StorageError {
    StorageError::MissingChunk {
        key: arr.key().to_string(),
        chunk: chunk.to_vec(),
        path: arr.chunk_path(chunk),
    }
}

impl Fetcher {
    /// The object at `location` read whole (at most `max` bytes): one get of the size the
    /// committed manifest gives, the bytes checked against its size and crc32c (spec 20.2);
    /// without a manifest, as [`Store::get`].
    ///
    /// # Errors
    /// [`StorageError::Malformed`] naming the object when the bytes are not the committed
    /// ones; [`StorageError::TooLarge`]; as [`Store::get_ranges`].
    pub(crate) fn whole(&self, location: &str, max: u64) -> Result<Vec<u8>, StorageError> {
        let Some(l) = self.listed.as_ref().and_then(|m| m.get(location)) else {
            return self.store.get(location, max);
        };
        if l.size > max {
            return Err(StorageError::TooLarge {
                key: location.to_owned(),
                path: self.store.display_path(location),
                bytes: l.size,
                reason: format!("larger than the limit of {max} bytes for this object"),
            });
        }
        let all = 0..l.size;
        let bytes = if l.size == 0 {
            Vec::new()
        } else {
            self.store
                .get_ranges(location, std::slice::from_ref(&all))?
                .pop()
                .unwrap_or_default()
        };
        self.committed(location, bytes)
    }

    /// `bytes`, given as the object at `location`, when the committed manifest lists it with
    /// their size and crc32c (or does not list it: no manifest to check against).
    ///
    /// # Errors
    /// [`StorageError::Malformed`] naming the object when they are not the committed bytes.
    pub(crate) fn committed(
        &self,
        location: &str,
        bytes: Vec<u8>,
    ) -> Result<Vec<u8>, StorageError> {
        let Some(l) = self.listed.as_ref().and_then(|m| m.get(location)) else {
            return Ok(bytes);
        };
        let crc = crc32c::crc32c(&bytes);
        if l.size != bytes.len() as u64 || l.crc32c != crc {
            return Err(StorageError::Malformed {
                path: self.store.display_path(location),
                reason: format!(
                    "the object ({} bytes, crc32c {crc:#010x}) is not the committed one ({} bytes, crc32c {:#010x}, by the manifest)",
                    bytes.len(),
                    l.size,
                    l.crc32c
                ),
            });
        }
        Ok(bytes)
    }

    /// Whether the committed manifest lists `location` with the size and crc32c of `bytes`.
    fn committed_as(&self, location: &str, bytes: &[u8]) -> bool {
        self.listed
            .as_ref()
            .and_then(|m| m.get(location))
            .is_some_and(|l| l.size == bytes.len() as u64 && l.crc32c == crc32c::crc32c(bytes))
    }

    /// Opens the array of `key` (index entry `entry`, the index's `save_id`) and checks its
    /// `zarr.json` (spec 6.3). When the committed manifest lists that document with the size
    /// and crc32c of the document prescribed for the entry, it is that document, and it is
    /// not fetched (spec 20.2); otherwise it is read whole and checked.
    ///
    /// # Errors
    /// As [`TensorArray::open_for`], naming the object; as [`Fetcher::whole`].
    pub(crate) fn open_array(
        &self,
        key: &TensorKey,
        entry: &crate::storage::meta::TensorEntry,
        save_id: Option<crate::storage::footer::SaveId>,
    ) -> Result<TensorArray, StorageError> {
        let location = join(&self.prefix, &format!("{}/zarr.json", entry.path));
        let prescribed = crate::storage::array::array_metadata_bytes(key, entry, save_id);
        let bytes = if self.committed_as(&location, &prescribed) {
            prescribed
        } else {
            self.whole(&location, crate::storage::meta::MAX_ARRAY_JSON_BYTES)?
        };
        let root = self.store.display_path(&self.prefix);
        TensorArray::from_json(&root, key, entry, &bytes, save_id)
    }

    /// The store location of the shard at `chunk`.
    fn location(&self, arr: &TensorArray, chunk: &[u64]) -> String {
        join(&self.prefix, &arr.chunk_location(chunk))
    }

    /// Ranged get of `ranges` of the shard at `chunk`, counted; an absent object is a
    /// missing chunk.
    fn get(
        &self,
        arr: &TensorArray,
        chunk: &[u64],
        location: &str,
        ranges: &[Range<u64>],
        counters: &ReadCounters,
    ) -> Result<Vec<Vec<u8>>, StorageError> {
        let got = self
            .store
            .get_ranges(location, ranges)
            .map_err(|e| match e {
                StorageError::NotFound { .. } => missing(arr, chunk),
                e => e,
            })?;
        let n: u64 = got.iter().map(|b| b.len() as u64).sum();
        counters.bytes.fetch_add(n, Ordering::Relaxed);
        self.cache.gets.fetch_add(1, Ordering::Relaxed);
        Ok(got)
    }

    /// The size of the shard object at `location`: from the committed manifest, else a `HEAD`.
    fn size(&self, arr: &TensorArray, chunk: &[u64], location: &str) -> Result<u64, StorageError> {
        match self.listed.as_ref().and_then(|s| s.get(location)) {
            Some(l) => Ok(l.size),
            None => match self.store.head(location) {
                Ok(m) => Ok(m.size),
                Err(StorageError::NotFound { .. }) => Err(missing(arr, chunk)),
                Err(e) => Err(e),
            },
        }
    }

    /// The decoded index of the shard `shard` reads: from the cache, else by one ranged get of
    /// its tail. When the subchunks `shard` needs are the last ones of an uncompressed shard
    /// laid out as zarrckpt writes it (every subchunk present, in C order, each with its
    /// crc32c: the object's size says so), that one get starts at the first of them instead,
    /// and the bytes before the tail come back too, in pieces of at most [`GET_RANGE_BYTES`]
    /// (`(offset, bytes)` each, see [`suffix_ranges`]): a read of a shard's end, or of a whole
    /// shard, costs one get, not two. The offsets are a guess until the index is decoded; what
    /// the pieces do not cover is fetched as usual.
    fn index(
        &self,
        arr: &TensorArray,
        geom: &StoredGeometry,
        shard: &ShardRead,
        counters: &ReadCounters,
    ) -> Result<(Arc<FetchedIndex>, Option<Head>), StorageError> {
        let chunk = shard.chunk.as_slice();
        let id = (arr.key().clone(), chunk.to_vec());
        let cached = self
            .cache
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&id)
            .cloned();
        if let Some(i) = cached {
            return Ok((i, None));
        }
        let location = self.location(arr, chunk);
        let size = timed(&counters.open_ns, || self.size(arr, chunk, &location))?;
        let tail = shard_tail_bytes(arr);
        let start = suffix_start(arr, geom, shard, size, tail).unwrap_or(size.saturating_sub(tail));
        // A get that brings data counts as a read, a get of the tail alone as opening.
        let clock = if start < size.saturating_sub(tail) {
            &counters.read_ns
        } else {
            &counters.open_ns
        };
        // The get, cut on the guessed subchunk boundaries into ranges of at most
        // GET_RANGE_BYTES (each one request; the last one holds the tail).
        let stored = arr
            .uncompressed()
            .then(|| geom.subchunk_bytes().saturating_add(4));
        let ranges = suffix_ranges(stored, start, size, tail);
        let mut bufs = if size < tail {
            Vec::new()
        } else {
            match timed(clock, || self.get(arr, chunk, &location, &ranges, counters)) {
                Ok(b) => b,
                Err(e) => return Err(self.explain(arr, chunk, &location, size, e)),
            }
        };
        let mut last = bufs.pop().unwrap_or_default();
        let at = last
            .len()
            .saturating_sub(usize::try_from(tail).unwrap_or(usize::MAX));
        let index = timed(&counters.open_ns, || {
            decode_shard_tail(arr, geom, chunk, size, &last[at..])
        })
        .map(Arc::new)?;
        self.keep(id, &index);
        // The tail is decoded: what is left of the last range is data, like the others.
        last.truncate(at);
        bufs.push(last);
        let head: Head = ranges
            .iter()
            .map(|r| r.start)
            .zip(bufs)
            .filter(|(_, b)| !b.is_empty())
            .collect();
        Ok((index, (!head.is_empty()).then_some(head)))
    }

    /// Counts a decoded index and keeps it while the cache has room.
    fn keep(&self, id: ShardId, index: &Arc<FetchedIndex>) {
        self.cache.decoded.fetch_add(1, Ordering::Relaxed);
        let added = index.memory_bytes();
        if self.cache.bytes.fetch_add(added, Ordering::Relaxed) + added <= INDEX_CACHE_BYTES {
            self.cache
                .map
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(id, Arc::clone(index));
        } else {
            self.cache.bytes.fetch_sub(added, Ordering::Relaxed);
        }
    }

    /// Before `shards` are read: fetches the copies of their tails that the manifest locates
    /// (spec 20.7), one coalesced ranged get per tails object, and decodes them into the
    /// index cache, so that each shard then costs only its data's gets, not a get of its tail
    /// first. Shards whose index is cached, whose one get of their end brings their index
    /// anyway (see [`Fetcher::index`]), or that have no copy are left alone; so is everything
    /// when fewer than two shards would gain. At most the cache's room is fetched. A copy that
    /// cannot be fetched or does not decode and check is skipped (logged): its shard's own
    /// tail is read as usual, and checked as always.
    pub(crate) fn prefetch_tails(&self, shards: &[Planned<'_>], counters: &ReadCounters) {
        let Some(listed) = &self.listed else { return };
        let mut seen = std::collections::HashSet::new();
        let mut by_object: HashMap<&str, Vec<TailAt<'_>>> = HashMap::new();
        let mut budget = INDEX_CACHE_BYTES.saturating_sub(self.cache.bytes.load(Ordering::Relaxed));
        let mut count = 0usize;
        {
            let map = self
                .cache
                .map
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for &(arr, geom, shard) in shards {
                let id = (arr.key().clone(), shard.chunk.clone());
                if map.contains_key(&id) || !seen.insert(id) {
                    continue;
                }
                let Some(l) = listed.get(&self.location(arr, &shard.chunk)) else {
                    continue;
                };
                let Some((object, offset)) = &l.tail else {
                    continue;
                };
                let tail = shard_tail_bytes(arr);
                if suffix_start(arr, geom, shard, l.size, tail).is_some() || tail > budget {
                    continue;
                }
                let Some(end) = offset.checked_add(tail) else {
                    continue;
                };
                budget -= tail;
                count += 1;
                by_object.entry(object.as_str()).or_default().push(TailAt {
                    shard: (arr, geom, shard),
                    size: l.size,
                    at: *offset..end,
                });
            }
        }
        if count < 2 {
            return;
        }
        let fetch_one = |(object, mut copies): (&str, Vec<TailAt<'_>>)| {
            copies.sort_unstable_by_key(|c| c.at.start);
            let object_size = listed.get(object).map_or(0, |l| l.size);
            // A copy that would end past its object is no copy.
            copies.retain(|c| c.at.end <= object_size);
            let mut ranges: Vec<Range<u64>> = Vec::new();
            for c in &copies {
                coalesce(&mut ranges, c.at.clone());
            }
            if ranges.is_empty() {
                return;
            }
            let got = timed(&counters.open_ns, || self.store.get_ranges(object, &ranges));
            let bufs = match got {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(object, error = %e, "tail copies not fetched; reading shard tails instead");
                    return;
                }
            };
            self.cache.gets.fetch_add(1, Ordering::Relaxed);
            let n: u64 = bufs.iter().map(|b| b.len() as u64).sum();
            counters.bytes.fetch_add(n, Ordering::Relaxed);
            for TailAt {
                shard: (arr, geom, shard),
                size,
                at,
            } in copies
            {
                let Some((r, b)) = ranges
                    .iter()
                    .zip(&bufs)
                    .find(|(r, _)| r.start <= at.start && at.end <= r.end)
                else {
                    continue;
                };
                let from = usize::try_from(at.start - r.start).unwrap_or(usize::MAX);
                let to = usize::try_from(at.end - r.start).unwrap_or(usize::MAX);
                let Some(copy) = b.get(from..to) else {
                    continue;
                };
                let decoded = timed(&counters.open_ns, || {
                    decode_shard_tail(arr, geom, &shard.chunk, size, copy)
                });
                match decoded {
                    Ok(index) => {
                        self.keep((arr.key().clone(), shard.chunk.clone()), &Arc::new(index));
                    }
                    Err(e) => tracing::warn!(
                        object,
                        error = %e,
                        "a tail copy does not check; reading the shard's own tail instead"
                    ),
                }
            }
        };
        let groups: Vec<_> = by_object.into_iter().collect();
        if groups.len() == 1 {
            groups.into_iter().for_each(fetch_one);
        } else {
            use rayon::prelude::*;
            groups.into_par_iter().for_each(fetch_one);
        }
    }

    /// A failed tail read of an object the manifest sized: a typed error when the object's
    /// size is not the committed one (truncated or replaced), else the failure itself.
    fn explain(
        &self,
        arr: &TensorArray,
        chunk: &[u64],
        location: &str,
        expected: u64,
        e: StorageError,
    ) -> StorageError {
        match self.store.head(location) {
            Ok(m) if m.size != expected => StorageError::CorruptChunk {
                key: arr.key().to_string(),
                chunk: chunk.to_vec(),
                path: arr.chunk_path(chunk),
                detail: format!(
                    "object is {} bytes, but the committed manifest says {expected}",
                    m.size
                ),
            },
            Err(StorageError::NotFound { .. }) => missing(arr, chunk),
            _ => e,
        }
    }

    /// Fills the parts of `dest` in `shard`: the index (once), then the needed subchunks by
    /// coalesced ranged gets, at most [`BATCH_BYTES`] (or one subchunk) in memory at a time.
    ///
    /// # Safety
    /// As [`crate::storage::read::read_shard`].
    pub(crate) unsafe fn read_shard(
        &self,
        arr: &TensorArray,
        geom: &StoredGeometry,
        shard: &ShardRead,
        dest: DisjointBuf<'_>,
        counters: &ReadCounters,
    ) -> Result<(), StorageError> {
        let (index, head) = self.index(arr, geom, shard, counters)?;
        let location = self.location(arr, &shard.chunk);
        // What came with the index is read from it; the rest as usual.
        let rest = match &head {
            None => std::borrow::Cow::Borrowed(shard),
            Some(pieces) => {
                let (with, rest): (Vec<SubchunkRead>, Vec<SubchunkRead>) =
                    shard.subchunks.iter().cloned().partition(|s| {
                        index.entry(s.linear).is_some_and(|(off, n)| {
                            pieces.iter().any(|(start, b)| {
                                off >= *start
                                    && off.saturating_add(n) <= start.saturating_add(b.len() as u64)
                            })
                        })
                    });
                let part = ShardRead {
                    chunk: shard.chunk.clone(),
                    subchunks: with,
                };
                let fetched: Vec<(u64, &[u8])> =
                    pieces.iter().map(|(s, b)| (*s, b.as_slice())).collect();
                // SAFETY: forwarded to the caller.
                unsafe { read_shard_from(arr, geom, &part, &index, &fetched, dest, counters) }?;
                std::borrow::Cow::Owned(ShardRead {
                    chunk: shard.chunk.clone(),
                    subchunks: rest,
                })
            }
        };
        for (ranges, subs) in batches(&rest, &index) {
            let part = ShardRead {
                chunk: rest.chunk.clone(),
                subchunks: subs.iter().map(|&i| rest.subchunks[i].clone()).collect(),
            };
            let bufs = if ranges.is_empty() {
                Vec::new()
            } else {
                timed(&counters.read_ns, || {
                    self.get(arr, &rest.chunk, &location, &ranges, counters)
                })?
            };
            let fetched: Vec<(u64, &[u8])> = ranges
                .iter()
                .zip(&bufs)
                .map(|(r, b)| (r.start, b.as_slice()))
                .collect();
            // SAFETY: forwarded to the caller.
            unsafe { read_shard_from(arr, geom, &part, &index, &fetched, dest, counters) }?;
        }
        Ok(())
    }

    /// Checks every subchunk of the shard at `chunk` that holds part of `region` (the chunk's
    /// box clipped to the tensor): reads it a slab of subchunk rows at a time into `buf`
    /// (about 16 MiB, at least one row of subchunks).
    ///
    /// # Errors
    /// As [`Fetcher::read_shard`].
    pub(crate) fn verify_shard(
        &self,
        arr: &TensorArray,
        geom: &StoredGeometry,
        region: &Region,
        buf: &mut Vec<u8>,
        counters: &ReadCounters,
        progress: &dyn Fn(u64),
    ) -> Result<(), StorageError> {
        let shape = region.shape();
        // A 0-d tensor is one tile; others go a slab of whole subchunk rows at a time.
        let rows = shape.first().copied().unwrap_or(1);
        let row_bytes = shape
            .iter()
            .skip(1)
            .fold(geom.elem as u64, |a, &d| a.saturating_mul(d));
        let step = geom.subchunk_shape.first().copied().unwrap_or(1).max(1);
        let per = ((16u64 << 20) / row_bytes.max(1) / step).max(1) * step;
        let mut at = 0;
        while at < rows {
            let n = per.min(rows - at);
            let tile = if shape.is_empty() {
                region.clone()
            } else {
                let mut offset = region.offset().to_vec();
                offset[0] += at;
                let mut extent = shape.to_vec();
                extent[0] = n;
                Region::from_parts_unchecked(offset, extent)
            };
            let bytes = crate::model::usize_of(n.saturating_mul(row_bytes));
            buf.clear();
            buf.resize(bytes, 0);
            let dest = DisjointBuf::new(&mut buf[..], &tile, geom.elem);
            for shard in geom.reads_for(&tile) {
                // SAFETY: this thread owns `buf`, and only this read writes it.
                unsafe { self.read_shard(arr, geom, &shard, dest, counters) }?;
            }
            progress(bytes as u64);
            at += n;
        }
        Ok(())
    }
}

/// Where the tail's ranged get of `shard` starts when the subchunks it needs end the shard (see
/// [`Fetcher::index`]): the guessed offset of the first of them, when the array is
/// uncompressed, the object's `size` is exactly every subchunk (with its crc32c) plus the
/// `tail`, the last subchunk in C order is needed, and the get stays within [`BATCH_BYTES`].
fn suffix_start(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    size: u64,
    tail: u64,
) -> Option<u64> {
    if !arr.uncompressed() {
        return None;
    }
    let count: u64 = geom.subchunks_per_shard().iter().product();
    let stored = geom.subchunk_bytes().checked_add(4)?;
    if count.checked_mul(stored)?.checked_add(tail)? != size {
        return None;
    }
    let mut linear: Vec<u64> = shard.subchunks.iter().map(|s| s.linear).collect();
    linear.sort_unstable();
    let (first, last) = (*linear.first()?, *linear.last()?);
    // One run as the usual batches would coalesce it: no gap between needed subchunks wider
    // than COALESCE_GAP (a column band of a 2-D subchunk grid may have wide ones).
    let one_run = linear
        .windows(2)
        .all(|w| (w[1] - w[0]).saturating_sub(1).saturating_mul(stored) <= COALESCE_GAP);
    let start = first.checked_mul(stored)?;
    (one_run && last + 1 == count && size - start <= BATCH_BYTES.saturating_add(tail))
        .then_some(start)
}

/// The ranges of the get [`Fetcher::index`] makes of a shard's bytes from `start` to its
/// end (`size`, its last `tail` bytes the tail): `start..size` cut where the guessed subchunk
/// boundaries keep each range within [`GET_RANGE_BYTES`] (every subchunk `stored` bytes from
/// `start`, as [`suffix_start`] found; `None`: compressed, no such guess). One range when only
/// the tail is read; the last range always holds the whole tail.
fn suffix_ranges(stored: Option<u64>, start: u64, size: u64, tail: u64) -> Vec<Range<u64>> {
    let data_end = size.saturating_sub(tail);
    let Some(stored) = stored.filter(|&s| s > 0 && start < data_end) else {
        return std::iter::once(start..size).collect();
    };
    let per = (GET_RANGE_BYTES / stored).max(1).saturating_mul(stored);
    let mut out = Vec::new();
    let mut at = start;
    while data_end.saturating_sub(at) > per {
        out.push(at..at + per);
        at += per;
    }
    out.push(at..size);
    out
}

/// One batch of a shard's reads: the byte ranges fetched together, and the positions in the
/// shard read's subchunks of the subchunks they hold.
type Batch = (Vec<Range<u64>>, Vec<usize>);

/// The subchunks of `shard` in batches: each batch's byte ranges (subchunks of the shard
/// sorted by offset, coalesced when at most [`COALESCE_GAP`] apart, at most [`BATCH_BYTES`]
/// per batch unless one subchunk is larger) and the positions in `shard.subchunks` of the
/// subchunks it holds. Absent subchunks (zeros, nothing to fetch) go with the first batch.
fn batches(shard: &ShardRead, index: &FetchedIndex) -> Vec<Batch> {
    let mut present: Vec<(u64, u64, usize)> = Vec::with_capacity(shard.subchunks.len());
    let mut absent = Vec::new();
    for (i, s) in shard.subchunks.iter().enumerate() {
        match index.entry(s.linear) {
            Some((off, n)) => present.push((off, off.saturating_add(n), i)),
            None => absent.push(i),
        }
    }
    present.sort_unstable();
    let mut out: Vec<Batch> = vec![(Vec::new(), absent)];
    let mut held = 0u64;
    for (start, end, i) in present {
        let (ranges, subs) = out.last_mut().expect("never empty");
        let grow = match ranges.last() {
            Some(r) if joins(r, &(start..end)) => end.saturating_sub(r.end),
            _ => end - start,
        };
        if !ranges.is_empty() && held.saturating_add(grow) > BATCH_BYTES {
            out.push((std::iter::once(start..end).collect(), vec![i]));
            held = end - start;
            continue;
        }
        coalesce(ranges, start..end);
        subs.push(i);
        held = held.saturating_add(grow);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffix_reads_are_cut_on_subchunk_boundaries_within_the_range_limit() {
        let mib = 1u64 << 20;
        // Only the tail: one range.
        assert_eq!(suffix_ranges(Some(mib), 100, 164, 64), vec![100..164]);
        assert_eq!(suffix_ranges(None, 0, 30 * mib, 64), vec![0..30 * mib]);
        // 20 subchunks of 1 MiB + 4 bytes from 0, a 100-byte tail: 7 per range (7 x (1 MiB +
        // 4) <= 8 MiB < 8 x (1 MiB + 4)); the last range holds the rest and the tail.
        let stored = mib + 4;
        let size = 20 * stored + 100;
        let r = suffix_ranges(Some(stored), 0, size, 100);
        assert_eq!(
            r,
            vec![0..7 * stored, 7 * stored..14 * stored, 14 * stored..size]
        );
        assert!(r.iter().all(|r| r.end - r.start <= GET_RANGE_BYTES + 100));
        // From the middle of the shard, every cut on a subchunk boundary from `start`.
        let r = suffix_ranges(Some(stored), 3 * stored, size, 100);
        assert_eq!(r.first().map(|r| r.start), Some(3 * stored));
        assert!(
            r.iter()
                .all(|r| (r.start - 3 * stored).is_multiple_of(stored))
        );
        assert_eq!(r.last().map(|r| r.end), Some(size));
        // Subchunks larger than the limit: one per range.
        let big = 9 * mib;
        let r = suffix_ranges(Some(big), 0, 3 * big + 10, 10);
        assert_eq!(r, vec![0..big, big..2 * big, 2 * big..3 * big + 10]);
    }

    #[test]
    fn ranges_join_within_the_gap_and_the_range_limit() {
        let mut ranges = Vec::new();
        coalesce(&mut ranges, 0..100);
        coalesce(&mut ranges, 100 + COALESCE_GAP..200 + COALESCE_GAP);
        assert_eq!(ranges, vec![0..200 + COALESCE_GAP]);
        coalesce(&mut ranges, 201 + 2 * COALESCE_GAP..300 + 2 * COALESCE_GAP);
        assert_eq!(
            ranges.len(),
            2,
            "a gap wider than COALESCE_GAP starts a range"
        );
        let start = ranges[1].start;
        coalesce(&mut ranges, start + 10..start + GET_RANGE_BYTES);
        assert_eq!(ranges.len(), 2);
        coalesce(
            &mut ranges,
            start + GET_RANGE_BYTES..start + GET_RANGE_BYTES + 1,
        );
        assert_eq!(ranges.len(), 3, "no range longer than GET_RANGE_BYTES");
    }
}
