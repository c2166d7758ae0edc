//! Staging for asynchronous saves: bounded host memory, reused across saves, filled with
//! parallel copies.
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

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rayon::prelude::*;

use crate::model::Region;
use crate::model::copy::copy_region;

/// Arenas per pool: one being filled while the other is written.
pub const ARENAS: usize = 2;

/// Contiguous copies are split into blocks of this many bytes, copied in parallel.
const COPY_BLOCK: usize = 4 << 20;

/// Default byte cap of a pool: 4 GiB.
pub const DEFAULT_STAGING_BYTES: u64 = 4 << 30;

/// Bounded staging memory, reused across saves.
#[derive(Debug)]
pub struct StagingPool {
    arena_cap: usize,
    state: Mutex<Vec<Vec<u8>>>,
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
            state: Mutex::new((0..ARENAS).map(|_| Vec::new()).collect()),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Vec<u8>>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The largest round one arena holds.
    #[must_use]
    pub fn arena_cap(&self) -> usize {
        self.arena_cap
    }

    /// Takes a free arena, at least `len` bytes long, waiting until the writer gives one back.
    /// The arena comes back to the pool when the returned [`Lease`] is dropped.
    #[must_use]
    pub fn take(self: &Arc<Self>, len: usize) -> Lease {
        let mut free = self.lock();
        let mut buf = loop {
            if let Some(b) = free.pop() {
                break b;
            }
            free = self
                .freed
                .wait(free)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        };
        drop(free);
        if buf.len() < len {
            // Grows once; later saves of the same state find it long enough.
            buf.resize(len, 0);
        }
        Lease {
            buf,
            pool: Arc::clone(self),
        }
    }

    /// Bytes the pool holds now (arenas out on lease count as they were when taken back).
    #[must_use]
    pub fn held_bytes(&self) -> usize {
        self.lock().iter().map(Vec::capacity).sum()
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
    buf: Vec<u8>,
    pool: Arc<StagingPool>,
}

impl Lease {
    /// The arena's bytes.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The arena's bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        self.pool.lock().push(buf);
        self.pool.freed.notify_all();
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

/// Where one staged item's bytes come from.
#[derive(Debug)]
pub enum ItemSource<'a> {
    /// Exactly these bytes (one contiguous run of a caller's buffer).
    Bytes(&'a [u8]),
    /// The box `full` (C order, `elem` bytes per element), zero-filled unless `covered`,
    /// then each part `(src, src_box, region)` copied into it.
    Parts {
        /// The item's box.
        full: Region,
        /// Bytes per element.
        elem: usize,
        /// True when the parts cover the whole box (no zero fill needed).
        covered: bool,
        /// Source buffer, the box it holds, and the box to copy.
        parts: Vec<(&'a [u8], &'a Region, Region)>,
    },
}

enum Job<'d, 's> {
    Copy(&'d mut [u8], &'s [u8]),
    Assemble(&'d mut [u8], &'s ItemSource<'s>),
}

/// Fills `arena` with `items`, item `i` at `ranges[i]` (ascending, disjoint), copying in
/// parallel on `threads`: contiguous items in blocks, assembled items whole.
///
/// # Panics
/// If a range lies outside the arena or does not match its item's size (a caller bug).
pub fn fill(
    arena: &mut [u8],
    ranges: &[Range<usize>],
    items: &[ItemSource<'_>],
    threads: &rayon::ThreadPool,
) {
    let mut jobs: Vec<Job<'_, '_>> = Vec::new();
    let mut rest = arena;
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
            ItemSource::Parts { .. } => jobs.push(Job::Assemble(dst, item)),
        }
    }
    threads.install(|| {
        jobs.into_par_iter().for_each(|job| match job {
            Job::Copy(d, s) => d.copy_from_slice(s),
            Job::Assemble(d, item) => {
                if let ItemSource::Parts {
                    full,
                    elem,
                    covered,
                    parts,
                } = item
                {
                    if !covered {
                        d.fill(0);
                    }
                    for (src, src_box, region) in parts {
                        copy_region(src, src_box, d, full, region, *elem);
                    }
                }
            }
        });
    });
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
            let a = pool.take(20);
            let b = pool.take(32);
            assert_eq!((a.bytes().len(), b.bytes().len()), (20, 32));
        }
        // Only what the largest rounds needed, kept for the next save.
        assert_eq!(pool.held_bytes(), 52);
        // A waiting taker gets the arena another thread gives back.
        let a = pool.take(1);
        let b = pool.take(1);
        let p2 = Arc::clone(&pool);
        let t = std::thread::spawn(move || p2.take(8).bytes().len());
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
                parts: vec![(&piece, &pbox, pbox.clone())],
            },
        ];
        let mut arena = vec![0xAAu8; big.len() + 3 + 16];
        let ranges = [0..big.len(), big.len() + 3..big.len() + 19];
        fill(&mut arena, &ranges, &items, &threads);
        assert_eq!(&arena[..big.len()], &big[..]);
        assert_eq!(&arena[big.len()..big.len() + 3], &[0xAA; 3]);
        let mut expect: Vec<u8> = (1..=8).collect();
        expect.extend([0u8; 8]);
        assert_eq!(&arena[big.len() + 3..], &expect[..]);
    }
}
