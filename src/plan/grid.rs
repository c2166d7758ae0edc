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

fn gcd(mut a: u64, mut b: u64) -> u64 {
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
        .unwrap_or(0);
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

/// The subchunk size target for an outer chunk of `chunk_bytes`: a sixteenth of the chunk,
/// clamped to `[min(64 KiB, max_target), max_target]` (`max_target` itself at most
/// [`MAX_SUBCHUNK_BYTES`]). Small enough that a load splitting a
/// chunk reads little it does not need, large enough to keep the index and syscalls few.
#[must_use]
pub fn subchunk_target(chunk_bytes: u64, max_target: u64) -> u64 {
    let max_target = max_target.min(MAX_SUBCHUNK_BYTES);
    let lo = (64u64 << 10).min(max_target);
    (chunk_bytes / 16).clamp(lo, max_target.max(1))
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
    let split = |d: usize| chunk_shape[d] < global_shape[d];
    let order = (0..nd)
        .rev()
        .filter(|&d| !split(d))
        .chain((0..nd).rev().filter(|&d| split(d)));
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
            vec![2048, 32]
        );
        // 2 MiB chunk split along rows: 128 KiB subchunks
        assert_eq!(
            subchunk_shape(&[512, 2048], &[2048, 2048], 2, M),
            vec![32, 2048]
        );
        assert_eq!(subchunk_shape(&[10], &[10], 4, M), vec![10]);
        assert_eq!(subchunk_shape(&[], &[], 4, M), Vec::<u64>::new());
        assert_eq!(
            subchunk_shape(&[3, 1 << 20], &[3, 1 << 20], 2, M),
            vec![1, 1 << 17]
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
