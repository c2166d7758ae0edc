//! A save's view of one fresh generation: the storage seam ([`Store`]) whose locations are
//! relative to the checkpoint (`tensors/w/c/0/0`, `zarr.json`) and land under
//! `generations/<id>/`, so that the ordinary writers (the shard writer, array, group and
//! object documents) write straight to the object store with no local staging copy.
//!
//! Every object is written once, with put-if-absent (a generation never reuses a key); an
//! object below [`super::RemoteOptions::multipart_threshold`] is held in memory and sent with
//! one PUT, a larger one streams as a multipart upload with at most
//! [`super::RemoteOptions::parts_in_flight`] parts of [`super::RemoteOptions::part_size`] in
//! flight. The size and crc32c of every completed object are recorded for the manifest
//! ([`GenerationWriter::take_entries`]). A deadline, when set, fails every write that starts
//! after it with an error naming the object.
//!
//! Objects streamed as multipart uploads are recorded under the generation while open
//! ([`super::multipart`]), so that `gc` can abort those a killed writer left. A write that
//! fails for good puts this rank's abort marker, and every write first looks (at a bounded
//! rate) for another rank's marker, stopping early when it finds one ([`super::abort`]).
//! Progress (bytes and objects durable) is logged per rank at most every
//! [`PROGRESS_EVERY`], so a stalled rank is visible.

use std::io::IoSlice;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::abort::AbortWatch;
use super::base::{PROGRESS_EVERY, error_chain, generation_key};
use super::client::RemoteStore;
use super::error::RemoteError;
use super::generation::{ManifestEntry, TAILS, TailCopy};
use super::multipart::RecordedUpload;
use crate::storage::error::StorageError;
use crate::storage::store::{
    Capabilities, ListResult, MultipartWrite, ObjectMeta, PutMode, PutResult, Store, check_location,
};

/// Writes one generation of a checkpoint through the storage seam (see the module docs).
#[derive(Debug)]
pub struct GenerationWriter<'a> {
    store: &'a RemoteStore,
    generation: String,
    rank: Option<usize>,
    deadline: Option<Instant>,
    entries: Mutex<Vec<ManifestEntry>>,
    tails: Mutex<Vec<(String, Vec<u8>)>>,
    spare: Mutex<Vec<Vec<u8>>>,
    bytes: AtomicU64,
    watch: AbortWatch,
    last_progress: Mutex<Instant>,
}

impl<'a> GenerationWriter<'a> {
    /// A writer of generation `generation` of the checkpoint `store` holds; writes starting
    /// after `deadline` fail.
    #[must_use]
    pub fn new(store: &'a RemoteStore, generation: &str, deadline: Option<Instant>) -> Self {
        GenerationWriter {
            store,
            generation: generation.to_owned(),
            rank: None,
            deadline,
            entries: Mutex::new(Vec::new()),
            tails: Mutex::new(Vec::new()),
            spare: Mutex::new(Vec::new()),
            bytes: AtomicU64::new(0),
            watch: AbortWatch::new(store, generation, None),
            last_progress: Mutex::new(Instant::now()),
        }
    }

    /// The same writer for rank `rank` of the save: its abort marker is
    /// `generations/<id>/abort/<rank>` and names the rank, its upload records and progress
    /// lines too (without it, a random token names the writer).
    #[must_use]
    pub fn with_rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self.watch = AbortWatch::new(self.store, &self.generation, Some(rank));
        self
    }

    /// The generation written.
    #[must_use]
    pub fn generation(&self) -> &str {
        &self.generation
    }

    /// Bytes of completed objects so far.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Writes the tails object of this writer (spec 20.7): a copy of the tail of every shard
    /// it wrote, one after another in key order, at `tails/<rank>` (the abort marker's name),
    /// and notes each copy's place in its shard's manifest entry. Call once every shard is
    /// written and before [`GenerationWriter::take_entries`]; a writer that wrote no shard
    /// writes nothing.
    ///
    /// # Errors
    /// As [`Store::put_opts`].
    pub fn write_tails(&self) -> Result<(), StorageError> {
        let mut tails = std::mem::take(&mut *self.tails.lock().unwrap_or_else(|p| p.into_inner()));
        if tails.is_empty() {
            return Ok(());
        }
        tails.sort_by(|a, b| a.0.cmp(&b.0));
        let key = format!("{TAILS}/{}", self.watch.name());
        let mut at = 0u64;
        let mut places = std::collections::HashMap::with_capacity(tails.len());
        for (loc, t) in &tails {
            places.insert(loc.as_str(), at);
            at += t.len() as u64;
        }
        let payload: Vec<&[u8]> = tails.iter().map(|(_, t)| t.as_slice()).collect();
        Store::put_opts(self, &key, &payload, PutMode::Create)?;
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        for e in entries.iter_mut() {
            if let Some(&offset) = places.get(e.key.as_str()) {
                e.tail = Some(TailCopy {
                    key: key.clone(),
                    offset,
                });
            }
        }
        Ok(())
    }

    /// The manifest entries of every completed object, sorted by key (and forgets them).
    pub fn take_entries(&self) -> Vec<ManifestEntry> {
        let mut v = std::mem::take(&mut *self.entries.lock().unwrap_or_else(|p| p.into_inner()));
        v.sort_by(|a, b| a.key.cmp(&b.key));
        v
    }

    fn key(&self, location: &str) -> String {
        generation_key(&self.generation, location)
    }

    /// Before a write: the deadline, then another rank's abort marker. A passed deadline puts
    /// no marker: every rank has the same deadline and stops on it by itself.
    fn check(&self, location: &str) -> Result<(), StorageError> {
        match self.deadline {
            Some(d) if Instant::now() > d => {
                return Err(StorageError::Io {
                    op: "PUT (save deadline passed)",
                    path: self.display_path(location),
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the save's deadline passed before this object was written",
                    ),
                });
            }
            _ => {}
        }
        self.watch
            .check_blocking()
            .map_err(|e| self.storage_err("PUT (generation abandoned)", location, e))
    }

    fn storage_err(&self, op: &'static str, location: &str, e: RemoteError) -> StorageError {
        StorageError::Io {
            op,
            path: self.display_path(location),
            source: std::io::Error::other(e),
        }
    }

    /// A write that failed for good: this rank's abort marker goes up (unless the failure is
    /// another rank's marker), then the error is returned.
    fn failed(&self, location: &str, e: StorageError) -> StorageError {
        let abandoned = matches!(&e, StorageError::Io { source, .. }
            if source.get_ref().and_then(|s| s.downcast_ref::<RemoteError>())
                .is_some_and(|r| matches!(r, RemoteError::Abandoned { .. })));
        if !abandoned {
            let key = self.display_path(location).display().to_string();
            self.watch.raise_blocking(&key, &error_chain(&e));
        }
        e
    }

    fn record(&self, location: &str, size: u64, crc32c: u32) {
        tracing::debug!(
            generation = %self.generation,
            key = location,
            size,
            "object durable"
        );
        let total = self.bytes.fetch_add(size, Ordering::Relaxed) + size;
        let objects = {
            let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            e.push(ManifestEntry {
                key: location.to_owned(),
                size,
                crc32c,
                tail: None,
            });
            e.len()
        };
        let mut last = self.last_progress.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() >= PROGRESS_EVERY {
            *last = Instant::now();
            tracing::info!(
                rank = ?self.rank,
                generation = %self.generation,
                bytes = total,
                objects,
                "save: progress (bytes durable on this rank)"
            );
        }
    }

    /// An empty buffer to hold an object in: one a finished object gave back when there is
    /// one. Reusing them spares the kernel's page faults and zeroing of fresh memory for every
    /// object, which cost this process more than all its other work on the bytes.
    ///
    /// The largest one kept is taken (the object's size is not known yet): a small buffer
    /// handed to a large shard would grow page by page like a fresh one.
    fn buffer(&self) -> Vec<u8> {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        let largest = (0..spare.len()).max_by_key(|&i| spare[i].capacity());
        largest.map(|i| spare.swap_remove(i)).unwrap_or_default()
    }

    /// Takes back a buffer for the next object: at most one per request in flight are kept
    /// (so buffers kept and buffers in use stay within the memory bound of the module docs),
    /// none larger than the multipart threshold; when that many are kept, the smallest goes.
    fn give_back(&self, mut buf: Vec<u8>) {
        let o = self.store.options();
        if buf.capacity() == 0 || buf.capacity() as u64 > o.multipart_threshold {
            return;
        }
        buf.clear();
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < o.concurrency.max(1) {
            spare.push(buf);
        } else if let Some(smallest) = spare
            .iter_mut()
            .min_by_key(|b| b.capacity())
            .filter(|b| b.capacity() < buf.capacity())
        {
            *smallest = buf;
        }
    }

    fn put_mode(&self) -> PutMode {
        if self.store.options().allow_unconditional {
            PutMode::Overwrite
        } else {
            PutMode::Create
        }
    }
}

impl Store for GenerationWriter<'_> {
    fn display_path(&self, location: &str) -> PathBuf {
        Store::display_path(self.store, &self.key(location))
    }

    fn put_opts(
        &self,
        location: &str,
        payload: &[&[u8]],
        _mode: PutMode,
    ) -> Result<PutResult, StorageError> {
        check_location(location)?;
        self.check(location)?;
        let r = Store::put_opts(self.store, &self.key(location), payload, self.put_mode())
            .map_err(|e| self.failed(location, e))?;
        let (size, crc) = payload.iter().fold((0u64, 0u32), |(n, c), p| {
            (n + p.len() as u64, crc32c::crc32c_append(c, p))
        });
        self.record(location, size, crc);
        Ok(r)
    }

    fn shard_tail(&self, location: &str, tail: &[u8]) {
        self.tails
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((location.to_owned(), tail.to_vec()));
    }

    fn put_multipart(&self, location: &str) -> Result<Box<dyn MultipartWrite + '_>, StorageError> {
        check_location(location)?;
        self.check(location)?;
        Ok(Box::new(ObjectUpload {
            owner: self,
            location: location.to_owned(),
            held: self.buffer(),
            upload: None,
            written: 0,
            crc: 0,
        }))
    }

    fn get_ranges(
        &self,
        location: &str,
        ranges: &[Range<u64>],
    ) -> Result<Vec<Vec<u8>>, StorageError> {
        Store::get_ranges(self.store, &self.key(location), ranges)
    }

    fn head(&self, location: &str) -> Result<ObjectMeta, StorageError> {
        Store::head(self.store, &self.key(location))
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StorageError> {
        Store::list(self.store, &self.key(prefix))
    }

    fn list_with_delimiter(&self, prefix: &str) -> Result<ListResult, StorageError> {
        Store::list_with_delimiter(self.store, &self.key(prefix))
    }

    fn delete(&self, location: &str) -> Result<(), StorageError> {
        // A save never deletes (spec: a generation is written once, removed only by gc).
        Err(self.unsupported("delete during a save", location))
    }

    fn capabilities(&self) -> Capabilities {
        Store::capabilities(self.store)
    }
}

/// The multipart upload of one large object: recorded through the store's explicit multipart
/// API when it has one, else `put_multipart` (unrecorded).
enum Upload<'w> {
    Recorded(Box<RecordedUpload>),
    Plain(Box<dyn MultipartWrite + 'w>),
}

/// One object of a generation being written: held in memory below the multipart threshold,
/// streamed as a multipart upload above it.
struct ObjectUpload<'w> {
    owner: &'w GenerationWriter<'w>,
    location: String,
    held: Vec<u8>,
    upload: Option<Upload<'w>>,
    written: u64,
    crc: u32,
}

impl ObjectUpload<'_> {
    fn threshold(&self) -> u64 {
        self.owner.store.options().multipart_threshold.max(1)
    }

    fn start(&mut self) -> Result<(), StorageError> {
        let store = self.owner.store;
        let key = self.owner.key(&self.location);
        let recorded = store
            .block_on(RecordedUpload::begin(store, &key, self.owner.rank))
            .map_err(|e| self.owner.storage_err("multipart PUT", &self.location, e))?;
        self.upload = Some(match recorded {
            Some(r) => Upload::Recorded(Box::new(r)),
            None => Upload::Plain(Store::put_multipart(store, &key)?),
        });
        if !self.held.is_empty() {
            let held = std::mem::take(&mut self.held);
            self.send(&[IoSlice::new(&held)])?;
            self.owner.give_back(held);
        }
        Ok(())
    }

    fn send(&mut self, parts: &[IoSlice<'_>]) -> Result<(), StorageError> {
        let store = self.owner.store;
        match &mut self.upload {
            Some(Upload::Recorded(up)) => {
                for p in parts {
                    store
                        .block_on(up.write(p))
                        .map_err(|e| self.owner.storage_err("multipart PUT", &self.location, e))?;
                }
                Ok(())
            }
            Some(Upload::Plain(up)) => up.write_vectored(parts),
            None => {
                for p in parts {
                    self.held.extend_from_slice(p);
                }
                Ok(())
            }
        }
    }
}

impl MultipartWrite for ObjectUpload<'_> {
    fn write_vectored(&mut self, parts: &[IoSlice<'_>]) -> Result<(), StorageError> {
        self.owner.check(&self.location)?;
        let n: u64 = parts.iter().map(|p| p.len() as u64).sum();
        for p in parts {
            self.crc = crc32c::crc32c_append(self.crc, p);
        }
        self.written += n;
        let r = if self.upload.is_none() && self.written >= self.threshold() {
            self.start().and_then(|()| self.send(parts))
        } else {
            self.send(parts)
        };
        r.map_err(|e| self.owner.failed(&self.location, e))
    }

    fn written(&self) -> u64 {
        self.written
    }

    fn copies_parts(&self) -> bool {
        // Held for one PUT: appended to `held`. A multipart upload waits per part.
        self.upload.is_none()
    }

    fn reserve(&mut self, additional: u64) {
        if self.upload.is_none() && self.written.saturating_add(additional) < self.threshold() {
            // Below the threshold, so within `usize`.
            self.held
                .reserve_exact(usize::try_from(additional).unwrap_or(0));
        }
    }

    fn finish(mut self: Box<Self>) -> Result<PutResult, StorageError> {
        self.owner.check(&self.location)?;
        let store = self.owner.store;
        let r = match self.upload.take() {
            Some(Upload::Recorded(up)) => store
                .block_on((*up).finish())
                .map(|_| PutResult {
                    e_tag: None,
                    version: None,
                })
                .map_err(|e| self.owner.storage_err("multipart PUT", &self.location, e)),
            Some(Upload::Plain(up)) => up.finish(),
            None => {
                let body = bytes::Bytes::from(std::mem::take(&mut self.held));
                let r = store.put_owned(
                    &self.owner.key(&self.location),
                    body.clone(),
                    self.owner.put_mode(),
                );
                // The request is over: the body is ours alone again, and so is its buffer.
                if let Ok(buf) = body.try_into_mut() {
                    self.owner.give_back(Vec::from(buf));
                }
                r
            }
        }
        .map_err(|e| self.owner.failed(&self.location, e))?;
        self.owner.record(&self.location, self.written, self.crc);
        Ok(r)
    }

    fn abort(mut self: Box<Self>) -> Result<(), StorageError> {
        match self.upload.take() {
            Some(Upload::Recorded(up)) => {
                self.owner.store.block_on((*up).abort());
                Ok(())
            }
            Some(Upload::Plain(up)) => up.abort(),
            None => Ok(()),
        }
    }
}

impl Drop for ObjectUpload<'_> {
    fn drop(&mut self) {
        self.owner.give_back(std::mem::take(&mut self.held));
        if let Some(Upload::Recorded(up)) = self.upload.take() {
            self.owner.store.block_on((*up).abort());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::remote::RemoteOptions;

    #[test]
    fn small_objects_are_one_put_large_ones_multipart_and_all_are_recorded() {
        let opts = RemoteOptions {
            multipart_threshold: 6 << 20,
            part_size: 5 << 20,
            parts_in_flight: 2,
            ..RemoteOptions::default()
        };
        let s = RemoteStore::open("memory://gw/ckpt", &opts).unwrap();
        let w = GenerationWriter::new(&s, "g1", None);
        let mut small = Store::put_multipart(&w, "a/zarr.json").unwrap();
        small.write(b"{}").unwrap();
        small.finish().unwrap();
        let big: Vec<u8> = (0..(13u32 << 20)).map(|i| (i % 251) as u8).collect();
        let mut up = Store::put_multipart(&w, "a/c/0").unwrap();
        for part in big.chunks(1 << 20) {
            up.write(part).unwrap();
        }
        up.finish().unwrap();
        // Written once: a second object at the same key is refused.
        let again = Store::put_multipart(&w, "a/zarr.json").unwrap();
        assert!(matches!(
            again.finish(),
            Err(StorageError::ObjectExists { .. })
        ));
        assert!(Store::delete(&w, "a/c/0").is_err());
        let entries = w.take_entries();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].key, "a/c/0");
        assert_eq!(entries[0].size, big.len() as u64);
        assert_eq!(entries[0].crc32c, crc32c::crc32c(&big));
        assert_eq!(entries[1].crc32c, crc32c::crc32c(b"{}"));
        assert_eq!(
            Store::get(&s, "generations/g1/a/c/0", u64::MAX).unwrap(),
            big
        );
        let late = GenerationWriter::new(&s, "g2", Some(Instant::now()));
        std::thread::sleep(std::time::Duration::from_millis(2));
        let e = Store::put(&late, "x", &[b"1"]).unwrap_err().to_string();
        assert!(e.contains("memory://gw/ckpt/generations/g2/x"), "{e}");
        assert!(e.contains("deadline"), "{e}");
    }

    #[test]
    fn spare_buffers_go_largest_first_and_the_smallest_make_room() {
        let opts = RemoteOptions {
            concurrency: 2,
            multipart_threshold: 1 << 20,
            ..RemoteOptions::default()
        };
        let s = RemoteStore::open("memory://gw-spare/ckpt", &opts).unwrap();
        let w = GenerationWriter::new(&s, "g1", None);
        for cap in [100, 5000, 300, 2 << 20] {
            w.give_back(Vec::with_capacity(cap));
        }
        // Two kept (one per request in flight), none above the threshold: 5000 and 300.
        let a = w.buffer();
        let b = w.buffer();
        assert!(
            a.capacity() >= 5000 && a.capacity() < 1 << 20,
            "{}",
            a.capacity()
        );
        assert!((300..5000).contains(&b.capacity()), "{}", b.capacity());
        assert_eq!(w.buffer().capacity(), 0);
        // Full: a larger buffer replaces the smallest, a smaller one is dropped.
        w.give_back(a);
        w.give_back(b);
        w.give_back(Vec::with_capacity(9000));
        w.give_back(Vec::with_capacity(10));
        let caps = [w.buffer().capacity(), w.buffer().capacity()];
        assert!(
            caps[0] >= 9000 && (5000..9000).contains(&caps[1]),
            "{caps:?}"
        );
    }
}
