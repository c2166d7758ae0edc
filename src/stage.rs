//! The saver's staging engine: bounded memory, reused across saves, filled with parallel
//! host copies and device downloads.
//!
//! A [`StagingPool`] owns [`ARENAS`] arenas, each at most half of the byte cap (or one chunk,
//! when a single chunk is larger than that). The chunks a rank writes are packed, in order,
//! into rounds that each fit one arena ([`pack`]). The caller fills a round's arena
//! ([`fill`]) and hands it to the background writer, which gives the arena back when the
//! round's files are written; while one arena is being written the caller fills the other.
//! So a state up to the cap is staged without waiting for any write, and a larger one makes
//! the caller wait only for the writes that free the memory it needs next. Arenas keep their
//! memory between saves: repeated saves of the same state allocate nothing and copy into
//! pages that are already resident.
//!
//! An arena is host memory, or page-locked memory of a [`Device`] when the save has pieces
//! in device memory: their chunks are downloaded straight into it (one budget for both).

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rayon::prelude::*;

use crate::device::{Device, DeviceError, DevicePiece, PinnedBuf};
use crate::model::Region;
use crate::model::copy::copy_region;

/// Arenas per pool: one being filled while the other is written.
pub const ARENAS: usize = 2;

/// Contiguous copies are split into blocks of this many bytes, copied in parallel.
const COPY_BLOCK: usize = 4 << 20;

/// Default byte cap of a pool: 4 GiB.
pub const DEFAULT_STAGING_BYTES: u64 = 4 << 30;

/// The memory of one arena.
enum Arena {
    /// Host memory.
    Host(Vec<u8>),
    /// Page-locked memory of a device (device pieces download into it).
    Pinned {
        buf: PinnedBuf,
        device: Arc<dyn Device>,
    },
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arena::Host(v) => write!(f, "Host({})", v.len()),
            Arena::Pinned { buf, .. } => write!(f, "Pinned({})", buf.len()),
        }
    }
}

impl Arena {
    fn len(&self) -> usize {
        match self {
            Arena::Host(v) => v.len(),
            Arena::Pinned { buf, .. } => buf.len(),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Arena::Host(v) => v,
            Arena::Pinned { buf, .. } => buf,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Arena::Host(v) => v,
            Arena::Pinned { buf, .. } => buf,
        }
    }
}

/// Whether two handles name the same device object.
fn same_device(a: &Arc<dyn Device>, b: &Arc<dyn Device>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Bounded staging memory, reused across saves.
#[derive(Debug)]
pub struct StagingPool {
    arena_cap: usize,
    state: Mutex<Vec<Arena>>,
    freed: Condvar,
}

impl StagingPool {
    /// A pool of at most `cap` bytes (split between [`ARENAS`] arenas; an arena grows beyond
    /// its share only to hold a single chunk larger than the share). Nothing is allocated
    /// until the first save.
    #[must_use]
    pub fn new(cap: u64) -> Self {
        let share = crate::model::usize_of(cap / ARENAS as u64);
        StagingPool {
            arena_cap: share.max(1),
            state: Mutex::new((0..ARENAS).map(|_| Arena::Host(Vec::new())).collect()),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Arena>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn give_back(&self, arena: Arena) {
        self.lock().push(arena);
        self.freed.notify_all();
    }

    /// The largest round one arena holds.
    #[must_use]
    pub fn arena_cap(&self) -> usize {
        self.arena_cap
    }

    /// Takes a free arena, at least `len` bytes long (grown to `reserve` when it must grow:
    /// the largest round of the save, so that both arenas are sized once), waiting until the
    /// writer gives one back:
    /// page-locked memory of `device` when given (device pieces download into it), else
    /// host memory (a page-locked arena kept from an earlier save serves as well). The arena
    /// comes back to the pool when the returned [`Lease`] is dropped.
    ///
    /// # Errors
    /// [`DeviceError`] when page-locked memory cannot be allocated (the arena slot goes back
    /// to the pool, empty).
    pub fn take(
        self: &Arc<Self>,
        len: usize,
        reserve: usize,
        device: Option<&Arc<dyn Device>>,
    ) -> Result<Lease, DeviceError> {
        let grown = len.max(reserve).max(1);
        let mut free = self.lock();
        let arena = loop {
            if let Some(b) = free.pop() {
                break b;
            }
            free = self
                .freed
                .wait(free)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        };
        drop(free);
        let arena = match (arena, device) {
            (Arena::Pinned { buf, device: d }, Some(want))
                if buf.len() >= len && same_device(&d, want) =>
            {
                Arena::Pinned { buf, device: d }
            }
            (old, Some(want)) => {
                // Grows once (the old arena is freed first); later saves of the same state
                // find it long enough.
                drop(old);
                match want.pinned(grown) {
                    Ok(buf) => Arena::Pinned {
                        buf,
                        device: Arc::clone(want),
                    },
                    Err(e) => {
                        self.give_back(Arena::Host(Vec::new()));
                        return Err(e);
                    }
                }
            }
            (Arena::Pinned { buf, device }, None) if buf.len() >= len => {
                Arena::Pinned { buf, device }
            }
            (Arena::Pinned { .. }, None) => Arena::Host(vec![0; grown]),
            (Arena::Host(mut v), None) => {
                if v.len() < len {
                    v.resize(grown, 0);
                }
                Arena::Host(v)
            }
        };
        Ok(Lease {
            arena: Some(arena),
            pool: Arc::clone(self),
        })
    }

    /// Bytes the pool holds now (arenas out on lease count as they were when taken back).
    #[must_use]
    pub fn held_bytes(&self) -> usize {
        self.lock().iter().map(Arena::len).sum()
    }

    /// Waits until every arena is back (no round in flight).
    pub fn wait_idle(&self) {
        let mut free = self.lock();
        while free.len() < ARENAS {
            free = self
                .freed
                .wait(free)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// An arena taken from a pool; goes back on drop (also when a writer fails or unwinds, so a
/// caller waiting for memory never waits forever).
#[derive(Debug)]
pub struct Lease {
    arena: Option<Arena>,
    pool: Arc<StagingPool>,
}

impl Lease {
    /// The arena's bytes.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        self.arena.as_ref().map_or(&[], Arena::bytes)
    }

    /// The arena's bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.arena.as_mut().map_or(&mut [], Arena::bytes_mut)
    }

    /// The device whose page-locked memory this arena is, if it is.
    fn device(&self) -> Option<&Arc<dyn Device>> {
        match &self.arena {
            Some(Arena::Pinned { device, .. }) => Some(device),
            _ => None,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(a) = self.arena.take() {
            self.pool.give_back(a);
        }
    }
}

/// Splits items of `sizes` bytes, in order, into consecutive rounds of at most `arena_cap`
/// bytes; an item larger than that is a round of its own.
#[must_use]
pub fn pack(sizes: &[usize], arena_cap: usize) -> Vec<Range<usize>> {
    let mut rounds = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes.saturating_add(s) > arena_cap {
            rounds.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(s);
    }
    if start < sizes.len() {
        rounds.push(start..sizes.len());
    }
    rounds
}

/// Where one part of an assembled item comes from.
#[derive(Debug)]
pub enum PartSource<'a> {
    /// A host buffer holding the box `src_box`.
    Host(&'a [u8], &'a Region),
    /// A piece in device memory: the part's box is downloaded into the item's scratch space
    /// first.
    Device(&'a DevicePiece),
}

/// Where one staged item's bytes come from.
#[derive(Debug)]
pub enum ItemSource<'a> {
    /// Exactly these bytes (one contiguous run of a caller's buffer).
    Bytes(&'a [u8]),
    /// The box `full` of a device piece, downloaded whole (`elem` bytes per element).
    Device {
        /// The piece.
        piece: &'a DevicePiece,
        /// The item's box, inside the piece's.
        full: Region,
    },
    /// The box `full` (C order, `elem` bytes per element), zero-filled unless `covered`,
    /// then each part `(source, region)` copied into it.
    Parts {
        /// The item's box.
        full: Region,
        /// Bytes per element.
        elem: usize,
        /// True when the parts cover the whole box (no zero fill needed).
        covered: bool,
        /// Where each part comes from, and the box to copy.
        parts: Vec<(PartSource<'a>, Region)>,
    },
}

fn box_bytes(region: &Region, elem: usize) -> usize {
    // Invariant: a box of a planned tensor, whose element count fits `u64`.
    crate::model::usize_of(region.num_elements().unwrap_or(0)) * elem
}

impl ItemSource<'_> {
    /// Bytes the item takes in the chunk file's layout.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            ItemSource::Bytes(b) => b.len(),
            ItemSource::Device { piece, full } => box_bytes(full, piece.dtype().size()),
            ItemSource::Parts { full, elem, .. } => box_bytes(full, *elem),
        }
    }

    /// Bytes of scratch space after the item: its device parts, downloaded before assembly.
    #[must_use]
    pub fn scratch(&self) -> usize {
        match self {
            ItemSource::Parts { parts, elem, .. } => parts
                .iter()
                .filter(|(s, _)| matches!(s, PartSource::Device(_)))
                .map(|(_, r)| box_bytes(r, *elem))
                .sum(),
            _ => 0,
        }
    }

    /// Whether the item reads device memory.
    #[must_use]
    pub fn reads_device(&self) -> bool {
        matches!(self, ItemSource::Device { .. }) || self.scratch() > 0
    }
}

enum Job<'d, 's> {
    Copy(&'d mut [u8], &'s [u8]),
    Assemble(&'d mut [u8], &'d [u8], &'s ItemSource<'s>),
}

/// The pitched downloads of the device items of a round into an arena.
fn downloads(
    ranges: &[Range<usize>],
    items: &[ItemSource<'_>],
) -> Result<Vec<crate::device::Pitched>, DeviceError> {
    let mut copies = Vec::new();
    for (r, item) in ranges.iter().zip(items) {
        match item {
            ItemSource::Device { piece, full } => copies.extend(piece.copies(full, r.start)?),
            ItemSource::Parts { parts, elem, .. } => {
                let mut at = r.start + item.len();
                for (src, region) in parts {
                    if let PartSource::Device(piece) = src {
                        copies.extend(piece.copies(region, at)?);
                        at += box_bytes(region, *elem);
                    }
                }
            }
            ItemSource::Bytes(_) => {}
        }
    }
    Ok(copies)
}

/// Fills the lease's arena with `items`, item `i` at the front of `ranges[i]` (ascending,
/// disjoint; each [`ItemSource::len`] plus [`ItemSource::scratch`] long): device downloads
/// first (waited for), then host copies in parallel on `threads` (contiguous items in
/// blocks, assembled items whole).
///
/// # Errors
/// [`DeviceError`] when a download fails, or when items read device memory but the arena
/// is not page-locked memory of their device.
///
/// # Panics
/// If a range lies outside the arena or does not match its item's size (a caller bug).
pub fn fill(
    lease: &mut Lease,
    ranges: &[Range<usize>],
    items: &[ItemSource<'_>],
    threads: &rayon::ThreadPool,
) -> Result<(), DeviceError> {
    let copies = downloads(ranges, items)?;
    if !copies.is_empty() {
        let device = lease.device().cloned().ok_or_else(|| {
            DeviceError::Unavailable("device pieces need a page-locked staging arena".into())
        })?;
        let arena = lease.bytes_mut();
        // SAFETY: the copies' host ranges lie in the arena (its items' ranges, checked
        // against its length below by the slicing of the host pass), which is page-locked
        // memory of `device` and borrowed mutably until the wait returns; the device ranges
        // are the pieces' views (DeviceView::new's contract).
        assert!(
            ranges.last().is_none_or(|r| r.end <= arena.len()),
            "staged range"
        );
        let fence = unsafe { device.to_host(arena.as_mut_ptr(), &copies) }?;
        device.wait(fence)?;
    }
    let mut jobs: Vec<Job<'_, '_>> = Vec::new();
    let mut rest = lease.bytes_mut();
    let mut at = 0;
    for (r, item) in ranges.iter().zip(items) {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (dst, tail) = tail.split_at_mut(r.len());
        rest = tail;
        at = r.end;
        match item {
            ItemSource::Bytes(src) => {
                assert_eq!(src.len(), dst.len(), "staged item size");
                for (d, s) in dst.chunks_mut(COPY_BLOCK).zip(src.chunks(COPY_BLOCK)) {
                    jobs.push(Job::Copy(d, s));
                }
            }
            ItemSource::Device { .. } => {}
            ItemSource::Parts { .. } => {
                let (d, scratch) = dst.split_at_mut(item.len());
                jobs.push(Job::Assemble(d, scratch, item));
            }
        }
    }
    threads.install(|| {
        jobs.into_par_iter().for_each(|job| match job {
            Job::Copy(d, s) => d.copy_from_slice(s),
            Job::Assemble(d, scratch, item) => assemble(d, scratch, item),
        });
    });
    Ok(())
}

/// Assembles a [`ItemSource::Parts`] item into `d`, its device parts read from `scratch`.
fn assemble(d: &mut [u8], scratch: &[u8], item: &ItemSource<'_>) {
    let ItemSource::Parts {
        full,
        elem,
        covered,
        parts,
    } = item
    else {
        return;
    };
    if !covered {
        d.fill(0);
    }
    let mut at = 0;
    for (src, region) in parts {
        match src {
            PartSource::Host(src, src_box) => copy_region(src, src_box, d, full, region, *elem),
            PartSource::Device(_) => {
                let n = box_bytes(region, *elem);
                copy_region(&scratch[at..at + n], region, d, full, region, *elem);
                at += n;
            }
        }
    }
}

/// Downloads `region` (inside the piece's box) of a device piece into a new host buffer,
/// through an arena of the pool (page-locked memory of `device`, reused across saves): the
/// parts of unaligned chunks a rank sends to their writers.
///
/// # Errors
/// [`DeviceError`] when the arena cannot be allocated or the download fails.
pub fn download(
    pool: &Arc<StagingPool>,
    device: &Arc<dyn Device>,
    piece: &DevicePiece,
    region: &Region,
) -> Result<Vec<u8>, DeviceError> {
    let len = box_bytes(region, piece.dtype().size());
    let copies = piece.copies(region, 0)?;
    let mut lease = pool.take(len, len, Some(device))?;
    let arena = lease.bytes_mut();
    assert!(
        arena.len() >= len,
        "arena of {} bytes for {len}",
        arena.len()
    );
    if !copies.is_empty() {
        // SAFETY: the host ranges lie in the first `len` bytes of the arena, page-locked
        // memory of `device` borrowed mutably until the wait returns; the device ranges are
        // the piece's view (DeviceView::new's contract).
        let fence = unsafe { device.to_host(arena.as_mut_ptr(), &copies) }?;
        device.wait(fence)?;
    }
    Ok(arena[..len].to_vec())
}

/// A thread pool for staging copies: `threads` threads, or the machine's cores (at most 8)
/// for 0.
///
/// # Errors
/// When the threads cannot be started.
pub fn copy_pool(threads: usize) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    crate::coord::pool_builder(threads, "stage").build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_in_order_within_the_cap() {
        assert_eq!(pack(&[3, 3, 3, 3], 7), vec![0..2, 2..4]);
        assert_eq!(pack(&[10, 1, 1], 4), vec![0..1, 1..3]);
        assert_eq!(pack(&[1, 10, 1], 4), vec![0..1, 1..2, 2..3]);
        assert_eq!(pack(&[], 4), Vec::<Range<usize>>::new());
        assert_eq!(pack(&[0, 0, 4], 4), vec![0..3]);
    }

    #[test]
    fn arenas_are_reused_and_bounded() {
        let pool = Arc::new(StagingPool::new(64));
        assert_eq!(pool.arena_cap(), 32);
        for _ in 0..5 {
            let a = pool.take(20, 0, None).unwrap();
            let b = pool.take(32, 0, None).unwrap();
            assert_eq!((a.bytes().len(), b.bytes().len()), (20, 32));
        }
        // Only what the largest rounds needed, kept for the next save.
        assert_eq!(pool.held_bytes(), 52);
        // A waiting taker gets the arena another thread gives back.
        let a = pool.take(1, 0, None).unwrap();
        let b = pool.take(1, 0, None).unwrap();
        let p2 = Arc::clone(&pool);
        let t = std::thread::spawn(move || p2.take(8, 0, None).unwrap().bytes().len());
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(a);
        assert!(t.join().unwrap() >= 20);
        drop(b);
        pool.wait_idle();
    }

    #[test]
    fn fills_contiguous_and_assembled_items() {
        let threads = copy_pool(2).unwrap();
        let big: Vec<u8> = (0..(COPY_BLOCK * 2 + 5)).map(|i| (i % 251) as u8).collect();
        // A [4, 4] u8 tensor whose [2, 4] top half comes from a buffer; bottom half zeros.
        let piece: Vec<u8> = (1..=8).collect();
        let pbox = Region::new(vec![0, 0], vec![2, 4]).unwrap();
        let full = Region::new(vec![0, 0], vec![4, 4]).unwrap();
        let items = vec![
            ItemSource::Bytes(&big),
            ItemSource::Parts {
                full: full.clone(),
                elem: 1,
                covered: false,
                parts: vec![(PartSource::Host(&piece, &pbox), pbox.clone())],
            },
        ];
        let pool = Arc::new(StagingPool::new(1 << 30));
        let mut lease = pool.take(big.len() + 3 + 16, 0, None).unwrap();
        lease.bytes_mut().fill(0xAA);
        let ranges = [0..big.len(), big.len() + 3..big.len() + 19];
        fill(&mut lease, &ranges, &items, &threads).unwrap();
        let arena = lease.bytes();
        assert_eq!(&arena[..big.len()], &big[..]);
        assert_eq!(&arena[big.len()..big.len() + 3], &[0xAA; 3]);
        let mut expect: Vec<u8> = (1..=8).collect();
        expect.extend([0u8; 8]);
        assert_eq!(&arena[big.len() + 3..], &expect[..]);
    }
}
