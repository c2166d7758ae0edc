//! Choosing a tensor's chunk grid: outer chunks (one file each) aligned with the pieces held
//! at save time, and inner subchunks sized for partial reads.

use crate::model::Region;

/// Defaults for grid choices; see `spec/format.md` § "Chunk grid".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridOptions {
    /// Target size of an inner subchunk in bytes.
    pub subchunk_target_bytes: u64,
    /// Outer chunks smaller than this (and smaller than the smallest piece) count as tiny.
    pub min_chunk_bytes: u64,
}

impl Default for GridOptions {
    fn default() -> Self {
        GridOptions {
            subchunk_target_bytes: 1 << 20,
            min_chunk_bytes: 1 << 20,
        }
    }
}

/// The greatest common divisor (`gcd(a, 0) = a`).
pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The aligned outer chunk shape: in each dimension, the greatest common divisor of every
/// interior piece boundary (boundaries at 0 and at the tensor's end do not count). With no
/// interior boundary the chunk spans the dimension (at least 1). Every piece is then a union
/// of whole chunks.
#[must_use]
pub fn aligned_chunk_shape(global_shape: &[u64], pieces: &[&Region]) -> Vec<u64> {
    global_shape
        .iter()
        .enumerate()
        .map(|(d, &dim)| {
            let g = pieces.iter().fold(0u64, |g, p| {
                [p.offset()[d], p.end(d)]
                    .into_iter()
                    .filter(|&b| b > 0 && b < dim)
                    .fold(g, gcd)
            });
            if g == 0 { dim.max(1) } else { g }
        })
        .collect()
}

/// The fallback outer chunk shape used when the aligned grid is tiny: in each dimension the
/// largest piece extent (at least 1). Pieces then no longer align with chunks and ranks send
/// each other the parts of a chunk they hold (see the spec's "unaligned pieces").
#[must_use]
pub fn coarse_chunk_shape(global_shape: &[u64], pieces: &[&Region]) -> Vec<u64> {
    (0..global_shape.len())
        .map(|d| {
            pieces
                .iter()
                .map(|p| p.shape()[d])
                .max()
                .unwrap_or(global_shape[d])
                .max(1)
        })
        .collect()
}

/// Number of elements of a shape, saturating (sizes here only steer choices).
fn product(shape: &[u64]) -> u64 {
    shape.iter().fold(1u64, |a, &b| a.saturating_mul(b))
}

/// Picks the chunk grid for one tensor whose pieces are each held by a different rank:
/// returns the outer chunk shape and whether it is aligned with the pieces. The tiny-chunk
/// rule compares with the smallest piece.
#[must_use]
pub fn choose_chunk_shape(
    global_shape: &[u64],
    pieces: &[&Region],
    elem: usize,
    opts: &GridOptions,
) -> (Vec<u64>, bool) {
    let smallest_piece = pieces
        .iter()
        .map(|p| product(p.shape()).saturating_mul(elem as u64))
        .filter(|&b| b > 0)
        .min()
        .unwrap_or(0); // no non-empty piece: no smallest one

    choose_chunk_shape_with(global_shape, pieces, elem, smallest_piece, opts)
}

/// Picks the chunk grid for one tensor: returns the outer chunk shape and whether it is
/// aligned with the pieces. `smallest_holding` is the least bytes of the tensor one rank
/// holds as main (0 if none): the aligned grid is tiny when its chunks are smaller than
/// `opts.min_chunk_bytes` and than that. (A rank holding a flat range holds several boxes,
/// some possibly of a single element; its whole share is what counts.)
#[must_use]
pub fn choose_chunk_shape_with(
    global_shape: &[u64],
    pieces: &[&Region],
    elem: usize,
    smallest_holding: u64,
    opts: &GridOptions,
) -> (Vec<u64>, bool) {
    let aligned = aligned_chunk_shape(global_shape, pieces);
    let chunk_bytes = product(&aligned).saturating_mul(elem as u64);
    if chunk_bytes < opts.min_chunk_bytes && chunk_bytes < smallest_holding {
        let coarse = coarse_chunk_shape(global_shape, pieces);
        if coarse != aligned {
            return (coarse, false);
        }
    }
    (aligned, true)
}

/// The largest number of parts [`refine_unaligned`] divides the coarse extent into.
pub const REFINE_MAX_SPLIT: u64 = 8;

/// [`refine_unaligned`] leaves grids with more chunks than this as they are (it walks every
/// chunk of every candidate).
const REFINE_MAX_CHUNKS: u64 = 1 << 16;

/// Refines the coarse chunk shape of an unaligned tensor whose coarse chunk and main pieces
/// are all contiguous in the C-order flattening (flat pieces, or pieces cut along the first
/// split axis only), where pieces cut at arbitrary flat offsets would otherwise make chunk
/// writers receive a large share of their chunks from other ranks.
///
/// With `a` the first axis where the coarse chunk extent `m` exceeds 1, the candidates divide
/// `m` into `k = 1..=REFINE_MAX_SPLIT` parts (`ceil(m / k)`), keeping chunks of at least
/// `floor_bytes`. Each candidate costs the bytes its chunk writers receive from other ranks
/// (a chunk's writer is the writer of its largest part, as in the plan) plus `file_cost`
/// bytes per chunk; the cheapest wins, ties going to the smaller `k`. `pieces` are the main
/// boxes with their writers; any other input returns `coarse` unchanged.
#[must_use]
pub fn refine_unaligned(
    global_shape: &[u64],
    coarse: &[u64],
    pieces: &[(&Region, u32)],
    elem: usize,
    floor_bytes: u64,
    file_cost: u64,
) -> Vec<u64> {
    let Some(a) = coarse.iter().position(|&c| c > 1) else {
        return coarse.to_vec();
    };
    if coarse[a + 1..] != global_shape[a + 1..] {
        return coarse.to_vec();
    }
    // Every main box as a flat interval with its writer, in flat order.
    let mut intervals = Vec::with_capacity(pieces.len());
    for (region, writer) in pieces {
        if region.is_empty() {
            continue;
        }
        let Some(r) = crate::model::flat::box_flat_range(global_shape, region) else {
            return coarse.to_vec();
        };
        intervals.push((r.start, r.end, *writer));
    }
    intervals.sort_unstable();
    let slab = product(&global_shape[a + 1..]);
    let rows = product(&global_shape[..a]);
    let extent = global_shape[a];
    let elem = elem as u64;
    let mut best: Option<(u64, Vec<u64>)> = None;
    let mut last_m = 0;
    for k in 1..=REFINE_MAX_SPLIT {
        let m = coarse[a].div_ceil(k);
        if m == last_m {
            continue;
        }
        last_m = m;
        let chunk_len = m.saturating_mul(slab);
        if k > 1 && chunk_len.saturating_mul(elem) < floor_bytes {
            break;
        }
        let per_row = extent.div_ceil(m);
        let n_chunks = rows.saturating_mul(per_row);
        if n_chunks > REFINE_MAX_CHUNKS {
            break;
        }
        let mut received = 0u64;
        let mut first = 0usize;
        for row in 0..rows {
            let row_start = row * extent * slab;
            let row_end = row_start + extent * slab;
            for j in 0..per_row {
                let cs = row_start + j * chunk_len;
                let ce = (cs + chunk_len).min(row_end);
                while first < intervals.len() && intervals[first].1 <= cs {
                    first += 1;
                }
                // The chunk's writer: the writer of its largest part (first on ties).
                let mut largest: Option<(u64, u32)> = None;
                let parts = intervals[first..].iter().take_while(|iv| iv.0 < ce);
                for &(s, e, w) in parts.clone() {
                    let n = e.min(ce) - s.max(cs);
                    if largest.is_none_or(|(bn, _)| n > bn) {
                        largest = Some((n, w));
                    }
                }
                let writer = largest.map_or(0, |l| l.1);
                let local: u64 = parts
                    .filter(|iv| iv.2 == writer)
                    .map(|&(s, e, _)| e.min(ce) - s.max(cs))
                    .sum();
                received += (ce - cs).saturating_sub(local);
            }
        }
        let cost = received
            .saturating_mul(elem)
            .saturating_add(n_chunks.saturating_mul(file_cost));
        if best.as_ref().is_none_or(|(c, _)| cost < *c) {
            let mut shape = coarse.to_vec();
            shape[a] = m;
            best = Some((cost, shape));
        }
    }
    best.map_or_else(|| coarse.to_vec(), |(_, s)| s)
}

/// Largest divisor of `n` that is at most `limit` (at least 1).
fn largest_divisor_at_most(n: u64, limit: u64) -> u64 {
    if limit >= n {
        return n;
    }
    let mut best = 1;
    let mut i = 1;
    while i * i <= n {
        if n.is_multiple_of(i) {
            for d in [i, n / i] {
                if d <= limit && d > best {
                    best = d;
                }
            }
        }
        i += 1;
    }
    best
}

/// Most bytes of one subchunk: readers refuse larger ones (a reader decodes a whole
/// subchunk at a time), so the target below never exceeds it.
pub const MAX_SUBCHUNK_BYTES: u64 = 64 << 20;
/// Most subchunks one shard may have (its index is 16 bytes per subchunk).
pub const MAX_SUBCHUNKS_PER_SHARD: u64 = 1 << 24;
/// Most shard files one tensor may have.
pub const MAX_CHUNKS_PER_TENSOR: u64 = 1 << 24;
/// A tensor may have more than [`MAX_SMALL_SUBCHUNKS`] subchunks (all shards together) only
/// when they average at least this many bytes: reading a box plans one entry (a few hundred
/// bytes) per subchunk it touches, so this keeps a whole-tensor read's plan well below the
/// tensor's own size.
pub const MIN_BYTES_PER_SUBCHUNK: u64 = 1024;
/// Subchunks a tensor may have (all shards together) whatever their size.
pub const MAX_SMALL_SUBCHUNKS: u64 = 1 << 16;

/// A reader limit of the format (spec section 4) that a tensor's chunk grid breaks. Readers
/// refuse such a tensor (and its whole checkpoint); writers choose another grid or refuse
/// before writing anything (rules W10 to W13).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GridLimit {
    /// A chunk or tensor whose size in bytes overflows 64 bits.
    #[error("the size of {what} in bytes overflows 64 bits")]
    Overflow {
        /// `"the tensor"` or `"a chunk"`.
        what: &'static str,
    },
    /// More than [`MAX_SUBCHUNKS_PER_SHARD`] subchunks in one shard.
    #[error("more than {MAX_SUBCHUNKS_PER_SHARD} subchunks per shard")]
    SubchunksPerShard,
    /// A subchunk of more than [`MAX_SUBCHUNK_BYTES`] bytes.
    #[error("subchunk_shape {subchunk_shape:?} holds more than {MAX_SUBCHUNK_BYTES} bytes")]
    SubchunkBytes {
        /// The subchunk shape.
        subchunk_shape: Vec<u64>,
    },
    /// More than [`MAX_SMALL_SUBCHUNKS`] subchunks averaging under
    /// [`MIN_BYTES_PER_SUBCHUNK`] bytes.
    #[error(
        "more subchunks than planning reads of it can afford: more than {MAX_SMALL_SUBCHUNKS}, and fewer than {MIN_BYTES_PER_SUBCHUNK} bytes each"
    )]
    SmallSubchunks,
    /// More than [`MAX_CHUNKS_PER_TENSOR`] shard files.
    #[error("more than {MAX_CHUNKS_PER_TENSOR} shard files")]
    ShardFiles,
}

/// Checks a tensor's geometry against the reader limits of spec section 4 that bound a
/// tensor: subchunks per shard, bytes per subchunk, subchunks per tensor (the 2^16 / 1024
/// byte rule) and shard files per tensor, in that order. The shapes must have equal lengths,
/// chunk and subchunk extents at least 1 and each subchunk extent dividing its chunk extent
/// (anything else is reported as an overflow). Readers and writers share this one check.
///
/// # Errors
/// The first limit broken.
pub fn check_geometry(
    global_shape: &[u64],
    chunk_shape: &[u64],
    subchunk_shape: &[u64],
    elem: usize,
) -> Result<(), GridLimit> {
    let elem = elem as u64;
    let bytes = |shape: &[u64]| shape.iter().try_fold(elem, |a, &b| a.checked_mul(b));
    let tensor_bytes = bytes(global_shape).ok_or(GridLimit::Overflow { what: "the tensor" })?;
    bytes(chunk_shape).ok_or(GridLimit::Overflow { what: "a chunk" })?;
    let ok_shapes = chunk_shape.len() == global_shape.len()
        && subchunk_shape.len() == global_shape.len()
        && chunk_shape
            .iter()
            .zip(subchunk_shape)
            .all(|(&c, &s)| s > 0 && c % s == 0);
    if !ok_shapes {
        return Err(GridLimit::Overflow { what: "a chunk" });
    }
    let per_shard = chunk_shape
        .iter()
        .zip(subchunk_shape)
        .try_fold(1u64, |acc, (c, s)| acc.checked_mul(c / s));
    if per_shard.is_none_or(|n| n > MAX_SUBCHUNKS_PER_SHARD) {
        return Err(GridLimit::SubchunksPerShard);
    }
    if bytes(subchunk_shape).is_none_or(|n| n > MAX_SUBCHUNK_BYTES) {
        return Err(GridLimit::SubchunkBytes {
            subchunk_shape: subchunk_shape.to_vec(),
        });
    }
    let chunks = global_shape
        .iter()
        .zip(chunk_shape)
        .try_fold(1u64, |acc, (&d, &c)| acc.checked_mul(d.div_ceil(c)));
    let subchunks = chunks.zip(per_shard).and_then(|(c, p)| c.checked_mul(p));
    let allowed = (tensor_bytes / MIN_BYTES_PER_SUBCHUNK).max(MAX_SMALL_SUBCHUNKS);
    if subchunks.is_none_or(|n| n > allowed) {
        return Err(GridLimit::SmallSubchunks);
    }
    if chunks.is_none_or(|n| n > MAX_CHUNKS_PER_TENSOR) {
        return Err(GridLimit::ShardFiles);
    }
    Ok(())
}

/// Every divisor of `n` greater than `above`, ascending.
fn divisors_above(n: u64, above: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut i = 1u64;
    while i.saturating_mul(i) <= n {
        if n.is_multiple_of(i) {
            small.push(i);
            if i != n / i {
                large.push(n / i);
            }
        }
        i += 1;
    }
    small
        .into_iter()
        .chain(large.into_iter().rev())
        .filter(|&d| d > above)
        .collect()
}

/// The subchunk shape a writer uses: the rule of [`subchunk_shape`] (spec section 8.3) when
/// the result meets every reader limit ([`check_geometry`]), which it does for every chunk
/// that has a divisor near the target. Otherwise (a prime or nearly prime extent makes the
/// rule's subchunks too many and too small) the subchunk grows, in the rule's walk order:
/// the dimension the rule divided takes its next larger divisor, up to its whole extent, then
/// the next dimension of the walk likewise, until the geometry meets the limits; the first
/// such shape (the smallest subchunk) is used.
///
/// # Errors
/// The limit broken when no subchunk shape meets the limits: a subchunk would exceed
/// [`MAX_SUBCHUNK_BYTES`] before the count limits are met, or the chunk grid itself has too
/// many shard files (then a coarser chunk grid is needed).
pub fn checked_subchunk_shape(
    chunk_shape: &[u64],
    global_shape: &[u64],
    elem: usize,
    max_target: u64,
) -> Result<Vec<u64>, GridLimit> {
    let mut cand = subchunk_shape(chunk_shape, global_shape, elem, max_target);
    let mut last = match check_geometry(global_shape, chunk_shape, &cand, elem) {
        Ok(()) => return Ok(cand),
        Err(e) => e,
    };
    if matches!(
        last,
        GridLimit::Overflow { .. } | GridLimit::SubchunkBytes { .. }
    ) {
        return Err(last);
    }
    for d in walk_order(chunk_shape, global_shape) {
        if cand[d] == chunk_shape[d] {
            continue;
        }
        for div in divisors_above(chunk_shape[d], cand[d]) {
            cand[d] = div;
            match check_geometry(global_shape, chunk_shape, &cand, elem) {
                Ok(()) => return Ok(cand),
                Err(e @ (GridLimit::SubchunkBytes { .. } | GridLimit::Overflow { .. })) => {
                    return Err(e);
                }
                Err(e) => last = e,
            }
        }
    }
    Err(last)
}

/// The order [`subchunk_shape`] walks the dimensions in: the dimensions the grid does not
/// split, last to first, then the split ones, last to first.
fn walk_order(chunk_shape: &[u64], global_shape: &[u64]) -> Vec<usize> {
    let nd = chunk_shape.len();
    let split = |d: usize| chunk_shape[d] < global_shape[d];
    (0..nd)
        .rev()
        .filter(|&d| !split(d))
        .chain((0..nd).rev().filter(|&d| split(d)))
        .collect()
}

/// The last resort of [`checked_grid`] for a chunk whose extents have no divisor that makes
/// subchunks meet the limits (a large prime extent): along the first dimension of the walk
/// order that the subchunk target does not hold whole, the chunk extent becomes the largest
/// power of two at most sixteen times what the target leaves for it (and below the extent),
/// so that subchunks are again near the target. `None` when no extent changes.
fn power_of_two_chunk(
    chunk_shape: &[u64],
    global_shape: &[u64],
    elem: usize,
    max_target: u64,
) -> Option<Vec<u64>> {
    let chunk_bytes = product(chunk_shape).saturating_mul(elem as u64);
    let target_elems = (subchunk_target(chunk_bytes, max_target) / elem.max(1) as u64).max(1);
    let mut inner: u64 = 1;
    for d in walk_order(chunk_shape, global_shape) {
        let c = chunk_shape[d];
        if inner.saturating_mul(c) <= target_elems {
            inner = inner.saturating_mul(c);
            continue;
        }
        let want = (target_elems / inner).max(1).saturating_mul(16).min(c);
        let pow = 1u64 << (63 - want.leading_zeros());
        if pow == c {
            return None;
        }
        let mut out = chunk_shape.to_vec();
        out[d] = pow;
        return Some(out);
    }
    None
}

/// A tensor's full grid as a writer chooses it (spec sections 8.1 to 8.3 and 8.4's flat
/// pieces), checked against every reader limit of section 4.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedGrid {
    /// The chunk (shard) shape.
    pub chunk_shape: Vec<u64>,
    /// Whether the chunks are aligned with the pieces.
    pub aligned: bool,
    /// The subchunk shape.
    pub subchunk_shape: Vec<u64>,
}

/// Chooses a tensor's grid: the aligned grid or the coarse fallback of section 8.2 (with its
/// refinement for contiguous pieces), then the subchunk shape of
/// [`checked_subchunk_shape`]. When that grid breaks a reader limit (for instance an aligned
/// grid of more shard files than a tensor may have, or a refined grid with too many small
/// subchunks), the writer falls back in this order: the unrefined coarse grid, then (for an
/// aligned grid) the coarse grid. `pieces` are the non-empty main boxes with their writers.
///
/// # Errors
/// The limit broken by the last grid tried when none meets the limits: the tensor cannot be
/// stored, and the writer refuses before writing anything.
pub fn checked_grid(
    global_shape: &[u64],
    pieces: &[(&Region, u32)],
    elem: usize,
    smallest_holding: u64,
    opts: &GridOptions,
) -> Result<CheckedGrid, GridLimit> {
    let refs: Vec<&Region> = pieces
        .iter()
        .map(|p| p.0)
        .filter(|r| !r.is_empty())
        .collect();
    let (chunk, aligned) =
        choose_chunk_shape_with(global_shape, &refs, elem, smallest_holding, opts);
    let mut tries = Vec::with_capacity(3);
    if aligned {
        tries.push((chunk, true));
        let coarse = coarse_chunk_shape(global_shape, &refs);
        if coarse != tries[0].0 {
            tries.push((coarse, false));
        }
    } else {
        let refined = refine_unaligned(
            global_shape,
            &chunk,
            pieces,
            elem,
            opts.min_chunk_bytes.min(smallest_holding),
            opts.min_chunk_bytes / 4,
        );
        if refined != chunk {
            tries.push((refined, false));
        }
        tries.push((chunk, false));
    }
    if let Some(last) = tries.last().map(|t| t.0.clone())
        && let Some(pow) = power_of_two_chunk(&last, global_shape, elem, opts.subchunk_target_bytes)
    {
        tries.push((pow, false));
    }
    let mut last = GridLimit::ShardFiles;
    for (chunk_shape, aligned) in tries {
        match checked_subchunk_shape(&chunk_shape, global_shape, elem, opts.subchunk_target_bytes) {
            Ok(subchunk_shape) => {
                return Ok(CheckedGrid {
                    chunk_shape,
                    aligned,
                    subchunk_shape,
                });
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The subchunk size target for an outer chunk of `chunk_bytes`: a thirty-second of the chunk,
/// clamped to `[min(64 KiB, max_target), max_target]` (`max_target` itself at most
/// [`MAX_SUBCHUNK_BYTES`]). Small enough that a load splitting a
/// chunk reads little it does not need, large enough to keep the index and syscalls few.
#[must_use]
pub fn subchunk_target(chunk_bytes: u64, max_target: u64) -> u64 {
    let max_target = max_target.min(MAX_SUBCHUNK_BYTES);
    let lo = (64u64 << 10).min(max_target);
    (chunk_bytes / 32).clamp(lo, max_target.max(1))
}

/// The inner subchunk shape for an outer chunk of a tensor of `global_shape`.
///
/// Dimensions are taken in this order: first the dimensions the grid does not split (the
/// chunk spans the tensor), last to first, then the split ones, last to first. Whole extents
/// are kept while the subchunk stays within the target (see [`subchunk_target`]); the first
/// dimension that would exceed it gets the largest divisor of its extent that fits (at least
/// 1), and the remaining dimensions get 1. So subchunks are thin along the axes the pieces
/// were split on (the axes a load in another topology most likely splits too), every entry
/// divides the chunk's extent as sharding requires, and when only the first axis is split
/// subchunks span whole trailing dimensions and are contiguous in memory.
#[must_use]
pub fn subchunk_shape(
    chunk_shape: &[u64],
    global_shape: &[u64],
    elem: usize,
    max_target: u64,
) -> Vec<u64> {
    let chunk_bytes = product(chunk_shape).saturating_mul(elem as u64);
    let target_elems = (subchunk_target(chunk_bytes, max_target) / elem.max(1) as u64).max(1);
    let nd = chunk_shape.len();
    let order = walk_order(chunk_shape, global_shape);
    let mut out = vec![1u64; nd];
    let mut inner: u64 = 1;
    for d in order {
        let c = chunk_shape[d];
        if inner.saturating_mul(c) <= target_elems {
            out[d] = c;
            inner = inner.saturating_mul(c);
        } else {
            out[d] = largest_divisor_at_most(c, (target_elems / inner).max(1));
            break;
        }
    }
    out
}

/// Number of chunks along each dimension of a grid.
#[must_use]
pub fn grid_shape(global_shape: &[u64], chunk_shape: &[u64]) -> Vec<u64> {
    global_shape
        .iter()
        .zip(chunk_shape)
        .map(|(&g, &c)| g.div_ceil(c))
        .collect()
}

/// The region of the chunk at grid index `idx`, clipped to the tensor.
#[must_use]
pub fn chunk_region(global_shape: &[u64], chunk_shape: &[u64], idx: &[u64]) -> Region {
    let offset: Vec<u64> = idx.iter().zip(chunk_shape).map(|(i, c)| i * c).collect();
    let shape = offset
        .iter()
        .zip(chunk_shape)
        .zip(global_shape)
        .map(|((o, c), g)| (*c).min(g - o))
        .collect();
    // Clipped to the tensor: offset < global_shape, shape <= global_shape - offset.
    Region::from_parts_unchecked(offset, shape)
}

/// The range of grid indices (start, end exclusive, per dimension) of chunks of
/// `chunk_shape` that intersect `region` (a non-empty region).
#[must_use]
pub fn chunks_overlapping(region: &Region, chunk_shape: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let lo = region
        .offset()
        .iter()
        .zip(chunk_shape)
        .map(|(o, c)| o / c)
        .collect();
    let hi = (0..region.ndim())
        .map(|d| region.end(d).div_ceil(chunk_shape[d]))
        .collect();
    (lo, hi)
}

/// Iterates every index in the box `lo..hi` in C order.
pub fn for_each_index(lo: &[u64], hi: &[u64], mut f: impl FnMut(&[u64])) {
    if lo.iter().zip(hi).any(|(l, h)| l >= h) {
        return;
    }
    let mut idx = lo.to_vec();
    loop {
        f(&idx);
        let mut d = idx.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// The full (unclipped) box of chunk `idx` of a grid of `chunk_shape` chunks.
#[must_use]
pub fn chunk_box(chunk_shape: &[u64], idx: &[u64]) -> Region {
    // A chunk of a checked grid: its end fits u64 as the grid's does.
    Region::from_parts_unchecked(
        idx.iter().zip(chunk_shape).map(|(i, s)| i * s).collect(),
        chunk_shape.to_vec(),
    )
}

/// The stored geometry of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredGeometry {
    /// Global shape.
    pub global_shape: Vec<u64>,
    /// Outer chunk (shard) shape.
    pub chunk_shape: Vec<u64>,
    /// Inner subchunk shape (divides `chunk_shape`).
    pub subchunk_shape: Vec<u64>,
    /// Bytes per element.
    pub elem: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o.to_vec(), s.to_vec()).unwrap()
    }

    #[test]
    fn aligned_grids() {
        // torch.chunk(10, 4): 3,3,3,1
        let p = [r(&[0], &[3]), r(&[3], &[3]), r(&[6], &[3]), r(&[9], &[1])];
        let refs: Vec<&Region> = p.iter().collect();
        assert_eq!(aligned_chunk_shape(&[10], &refs), vec![3]);
        // uneven arbitrary: 4, 6
        let p = [r(&[0, 0], &[4, 8]), r(&[4, 0], &[6, 8])];
        let refs: Vec<&Region> = p.iter().collect();
        assert_eq!(aligned_chunk_shape(&[10, 8], &refs), vec![4, 8]);
        // column split
        let p = [r(&[0, 0], &[5, 4]), r(&[0, 4], &[5, 4])];
        let refs: Vec<&Region> = p.iter().collect();
        assert_eq!(aligned_chunk_shape(&[5, 8], &refs), vec![5, 4]);
        assert_eq!(
            aligned_chunk_shape(&[0, 3], &[&r(&[0, 0], &[0, 3])]),
            vec![1, 3]
        );
    }

    #[test]
    fn tiny_grid_falls_back_to_coarse() {
        // array_split(10 rows, 4): 3,3,2,2 -> gcd 1; rows of 1 MiB / 4 = tiny
        let p = [
            r(&[0, 0], &[3, 64]),
            r(&[3, 0], &[3, 64]),
            r(&[6, 0], &[2, 64]),
            r(&[8, 0], &[2, 64]),
        ];
        let refs: Vec<&Region> = p.iter().collect();
        let (c, aligned) = choose_chunk_shape(&[10, 64], &refs, 4, &GridOptions::default());
        assert_eq!((c, aligned), (vec![3, 64], false));
        // the same split with 1 MiB rows stays aligned
        let big = [
            r(&[0, 0], &[3, 1 << 18]),
            r(&[3, 0], &[2, 1 << 18]),
            r(&[5, 0], &[5, 1 << 18]),
        ];
        let refs: Vec<&Region> = big.iter().collect();
        let (c, aligned) = choose_chunk_shape(&[10, 1 << 18], &refs, 4, &GridOptions::default());
        assert_eq!((c, aligned), (vec![1, 1 << 18], true));
    }

    #[test]
    fn subchunks_divide_and_fit() {
        const M: u64 = 1 << 20;
        // 64 MiB unsplit chunk: 1 MiB row blocks
        assert_eq!(
            subchunk_shape(&[4096, 4096], &[4096, 4096], 4, M),
            vec![64, 4096]
        );
        // rows split: thin in rows, whole rows (contiguous)
        assert_eq!(
            subchunk_shape(&[6283, 4096], &[25132, 4096], 4, M),
            vec![61, 4096]
        );
        // columns split (row-parallel weight): thin in columns
        assert_eq!(
            subchunk_shape(&[2048, 512], &[2048, 2048], 2, M),
            vec![2048, 16]
        );
        // 2 MiB chunk split along rows: 64 KiB subchunks (a thirty-second, the floor)
        assert_eq!(
            subchunk_shape(&[512, 2048], &[2048, 2048], 2, M),
            vec![16, 2048]
        );
        // 8 MiB chunk: 256 KiB subchunks
        assert_eq!(
            subchunk_shape(&[1024, 2048], &[4096, 2048], 4, M),
            vec![32, 2048]
        );
        assert_eq!(subchunk_shape(&[10], &[10], 4, M), vec![10]);
        assert_eq!(subchunk_shape(&[], &[], 4, M), Vec::<u64>::new());
        assert_eq!(
            subchunk_shape(&[3, 1 << 20], &[3, 1 << 20], 2, M),
            vec![1, 1 << 16]
        );
        assert_eq!(subchunk_target(1 << 30, M), M);
        assert_eq!(subchunk_target(1 << 10, M), 64 << 10);
        assert_eq!(subchunk_target(1 << 10, 1 << 10), 1 << 10);
        for (c, e) in [([7u64, 1 << 20], 4usize), ([13, 17], 8)] {
            let s = subchunk_shape(&c, &[c[0] * 3, c[1]], e, 1 << 10);
            for (ci, si) in c.iter().zip(&s) {
                assert_eq!(ci % si, 0);
            }
        }
    }

    #[test]
    fn prime_extents_get_subchunks_readers_accept() {
        const M: u64 = 1 << 20;
        // The rule alone gives one-element subchunks, which readers refuse.
        for (n, elem) in [(70_001u64, 4usize), (100_003, 1), (123_457, 8)] {
            assert_eq!(subchunk_shape(&[n], &[n], elem, M), vec![1]);
            assert_eq!(
                check_geometry(&[n], &[n], &[1], elem),
                Err(GridLimit::SmallSubchunks)
            );
            assert_eq!(checked_subchunk_shape(&[n], &[n], elem, M), Ok(vec![n]));
            let one = r(&[0], &[n]);
            let g = checked_grid(
                &[n],
                &[(&one, 0)],
                elem,
                n * elem as u64,
                &GridOptions::default(),
            )
            .unwrap();
            assert_eq!(
                (g.chunk_shape, g.aligned, g.subchunk_shape),
                (vec![n], true, vec![n])
            );
        }
        // The next divisor up, not the whole extent: 2 * 70001 bytes give 70001 subchunks of
        // 2 bytes by the rule, then 2 of 70001.
        assert_eq!(subchunk_shape(&[140_002], &[140_002], 1, M), vec![2]);
        assert_eq!(
            checked_subchunk_shape(&[140_002], &[140_002], 1, M),
            Ok(vec![70_001])
        );
        // A prime extent too large for one subchunk: the chunk becomes a power of two.
        let p = 67_108_879u64;
        assert!(matches!(
            checked_subchunk_shape(&[p], &[p], 4, M),
            Err(GridLimit::SubchunkBytes { .. })
        ));
        let one = r(&[0], &[p]);
        let g = checked_grid(&[p], &[(&one, 0)], 4, p * 4, &GridOptions::default()).unwrap();
        assert_eq!(g.chunk_shape, vec![1 << 22]);
        assert_eq!(g.subchunk_shape, vec![1 << 17]);
        assert!(!g.aligned);
        assert_eq!(
            check_geometry(&[p], &g.chunk_shape, &g.subchunk_shape, 4),
            Ok(())
        );
        // Legal rule results are kept as they are.
        assert_eq!(
            checked_subchunk_shape(&[25_129, 1024], &[50_257, 1024], 4, M),
            Ok(vec![13, 1024])
        );
    }

    #[test]
    fn grids_no_reader_accepts_fall_back_or_are_refused() {
        // Pieces of 1 and 70000 bytes: the aligned grid has 70001 one-byte shard files (the
        // one-byte piece is the smallest holding, so the tiny rule keeps it); the coarse grid
        // is used instead.
        let (a, b) = (r(&[0], &[1]), r(&[1], &[70_000]));
        let g = checked_grid(
            &[70_001],
            &[(&a, 0), (&b, 1)],
            1,
            1,
            &GridOptions::default(),
        )
        .unwrap();
        assert_eq!((g.chunk_shape, g.aligned), (vec![70_000], false));
        assert_eq!(g.subchunk_shape, vec![35_000]);
        // 2^17 one-byte pieces: every grid the writer may choose has 2^17 shard files.
        let pieces: Vec<Region> = (0..1u64 << 17).map(|i| r(&[i], &[1])).collect();
        let parts: Vec<(&Region, u32)> = pieces.iter().map(|p| (p, 0)).collect();
        assert_eq!(
            checked_grid(&[1 << 17], &parts, 1, 1, &GridOptions::default()),
            Err(GridLimit::SmallSubchunks)
        );
        assert_eq!(
            check_geometry(&[1 << 26], &[1], &[1], 1),
            Err(GridLimit::SmallSubchunks)
        );
        assert_eq!(
            check_geometry(&[1 << 36], &[1 << 11], &[1 << 11], 1),
            Err(GridLimit::ShardFiles)
        );
        assert!(matches!(
            check_geometry(&[1 << 30], &[1 << 30], &[1 << 27], 1),
            Err(GridLimit::SubchunkBytes { .. })
        ));
        assert_eq!(
            check_geometry(&[1 << 26], &[1 << 26], &[1], 1),
            Err(GridLimit::SubchunksPerShard)
        );
    }

    #[test]
    fn chunk_iteration() {
        assert_eq!(grid_shape(&[10, 8], &[3, 8]), vec![4, 1]);
        assert_eq!(
            chunk_region(&[10, 8], &[3, 8], &[3, 0]),
            r(&[9, 0], &[1, 8])
        );
        let (lo, hi) = chunks_overlapping(&r(&[2, 1], &[5, 2]), &[3, 8]);
        assert_eq!((lo.clone(), hi.clone()), (vec![0, 0], vec![3, 1]));
        let mut seen = Vec::new();
        for_each_index(&[0, 0], &[2, 2], |i| seen.push(i.to_vec()));
        assert_eq!(seen, vec![vec![0, 0], vec![0, 1], vec![1, 0], vec![1, 1]]);
        let mut n = 0;
        for_each_index(&[], &[], |_| n += 1);
        assert_eq!(n, 1);
    }
}
