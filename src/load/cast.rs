//! Load step for targets that asked for a data type conversion ([`Cast::FloatConvert`]):
//! each shard's part is read in the stored data type into a small per-thread staging
//! buffer, a tile at a time, then converted into the caller's buffer. Targets without a
//! conversion never come here: their path is unchanged.

use crate::model::convert::convert;
use crate::model::copy::{DisjointBuf, for_each_run};
use crate::model::{Cast, DType, LoadTarget, Region};
use crate::plan::load::{ShardRead, StoredGeometry};

use crate::storage::{CheckpointMeta, StorageError, TensorArray};

/// Most bytes (stored data type) staged at once by one reading thread, unless a single
/// subchunk is larger.
const STAGE_BYTES: u64 = 4 << 20;

/// The stored data type `t` converts from, when it asks for a conversion the checkpoint
/// needs (`None` for targets read as they are, and for keys the index lacks).
pub(super) fn converts_from(t: &LoadTarget<'_>, meta: &CheckpointMeta) -> Option<DType> {
    let stored = meta.tensors.get(t.key())?.dtype;
    (stored != t.dtype() && t.cast() != Cast::Exact && t.cast().accepts(stored, t.dtype()))
        .then_some(stored)
}

thread_local! {
    static STAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Tiles of `inner` (a box inside the chunk at `origin`) aligned to the subchunk grid, so
/// that every subchunk is read once, each of at most [`STAGE_BYTES`] (or one subchunk).
fn tiles(inner: &Region, origin: &[u64], sub: &[u64], elem: u64) -> Vec<Region> {
    let nd = inner.ndim();
    // Subchunk cells [lo, hi) of `inner` along each axis, and cells per tile.
    let lo: Vec<u64> = (0..nd)
        .map(|d| (inner.offset()[d] - origin[d]) / sub[d])
        .collect();
    let hi: Vec<u64> = (0..nd)
        .map(|d| (inner.offset()[d] + inner.shape()[d] - origin[d]).div_ceil(sub[d]))
        .collect();
    let mut per = vec![1u64; nd];
    let mut acc = elem;
    for d in (0..nd).rev() {
        let cells = hi[d] - lo[d];
        let full = acc.saturating_mul(cells.saturating_mul(sub[d]));
        if full <= STAGE_BYTES {
            per[d] = cells;
            acc = full;
        } else {
            per[d] = (STAGE_BYTES / acc.saturating_mul(sub[d])).clamp(1, cells);
            break;
        }
    }
    let counts: Vec<u64> = (0..nd).map(|d| (hi[d] - lo[d]).div_ceil(per[d])).collect();
    let mut out = Vec::new();
    let mut idx = vec![0u64; nd];
    loop {
        // Subchunk cells of the chunk at `origin` in a checked geometry: inside its grid.
        let tile = Region::from_parts_unchecked(
            (0..nd)
                .map(|d| origin[d] + (lo[d] + idx[d] * per[d]) * sub[d])
                .collect(),
            (0..nd).map(|d| per[d] * sub[d]).collect(),
        );
        if let Some(t) = inner.intersect(&tile) {
            out.push(t);
        }
        let mut d = nd;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < counts[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Fills the parts of `dest` (elements of `to`) in `shard` from a tensor stored as `from`:
/// `read_part` reads a part of the shard (in the stored data type) into a staging buffer, a
/// tile at a time (the local read of a shard file, or a read from fetched bytes).
///
/// # Safety
/// As [`crate::storage::read::read_shard`]: no other thread may touch the bytes of `dest`
/// inside this shard; `read_part` must be safe to call on a buffer this thread owns.
pub(super) unsafe fn read_shard_converted(
    arr: &TensorArray,
    geom: &StoredGeometry,
    shard: &ShardRead,
    dest: DisjointBuf<'_>,
    from: DType,
    to: DType,
    read_part: &dyn Fn(&ShardRead, DisjointBuf<'_>) -> Result<(), StorageError>,
) -> Result<(), StorageError> {
    let origin: Vec<u64> = shard
        .chunk
        .iter()
        .zip(&geom.chunk_shape)
        .map(|(c, s)| c * s)
        .collect();
    // A chunk of the checked geometry's grid.
    let chunk_box = Region::from_parts_unchecked(origin.clone(), geom.chunk_shape.clone());
    let Some(inner) = dest.region().intersect(&chunk_box) else {
        return Ok(());
    };
    let (s, t) = (from.size(), to.size());
    for tile in tiles(&inner, &origin, &geom.subchunk_shape, s as u64) {
        // Invariant: a tile lies inside the target, whose byte size was checked to fit usize.
        let n = crate::model::usize_of(tile.num_elements().unwrap_or(0));
        if n == 0 {
            continue;
        }
        STAGE.with(|stage| -> Result<(), StorageError> {
            let mut stage = stage.borrow_mut();
            stage.resize(n.saturating_mul(s), 0);
            let staged = DisjointBuf::new(&mut stage[..], &tile, s);
            for part in geom.reads_for(&tile) {
                read_part(&part, staged)?;
            }
            // Element offsets (elem 1) of each run, from the staged tile into `dest`.
            let mut bad = None;
            for_each_run(&tile, dest.region(), &tile, 1, |so, d, len| {
                // SAFETY: `tile` lies in this shard's part of `dest` (caller's contract).
                let out = unsafe { dest.slice(d * t, len * t) };
                if let Err(e) = convert(from, &stage[so * s..(so + len) * s], to, out) {
                    bad.get_or_insert(e);
                }
            });
            match bad {
                None => Ok(()),
                Some(e) => Err(StorageError::CorruptChunk {
                    key: arr.key().to_string(),
                    chunk: shard.chunk.clone(),
                    path: arr.chunk_path(&shard.chunk),
                    detail: format!("conversion: {e}"),
                }),
            }
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_the_box_once_aligned_to_subchunks() {
        for (inner, origin, sub, elem) in [
            (
                Region::new(vec![3, 5], vec![1000, 2000]).unwrap(),
                vec![0u64, 0],
                vec![16u64, 64],
                4u64,
            ),
            (
                Region::new(vec![10, 0, 7], vec![50, 3, 900]).unwrap(),
                vec![8, 0, 0],
                vec![4, 3, 1000],
                8,
            ),
            (Region::new(vec![], vec![]).unwrap(), vec![], vec![], 4),
            (
                Region::new(vec![0], vec![5_000_000]).unwrap(),
                vec![0],
                vec![3_000_000],
                2,
            ),
        ] {
            let ts = tiles(&inner, &origin, &sub, elem);
            let total: u64 = ts.iter().map(|t| t.num_elements().unwrap()).sum();
            assert_eq!(total, inner.num_elements().unwrap());
            for (i, t) in ts.iter().enumerate() {
                assert_eq!(inner.intersect(t).as_ref(), Some(t));
                for u in &ts[i + 1..] {
                    assert!(t.intersect(u).is_none(), "{t} overlaps {u}");
                }
                // Within the budget unless one subchunk alone exceeds it.
                let sub_bytes: u64 = sub.iter().product::<u64>() * elem;
                assert!(
                    t.num_elements().unwrap() * elem <= STAGE_BYTES.max(sub_bytes),
                    "{t}"
                );
                // Aligned: a subchunk cell is never split between two tiles.
                for u in &ts[i + 1..] {
                    let cells = |r: &Region| -> Vec<(u64, u64)> {
                        (0..r.ndim())
                            .map(|d| {
                                let a = (r.offset()[d] - origin[d]) / sub[d];
                                let b = (r.offset()[d] + r.shape()[d] - 1 - origin[d]) / sub[d];
                                (a, b)
                            })
                            .collect()
                    };
                    let (x, y) = (cells(t), cells(u));
                    let share = x.iter().zip(&y).all(|(p, q)| p.0 <= q.1 && q.0 <= p.1);
                    assert!(!share || x.is_empty(), "{t} and {u} share a subchunk");
                }
            }
        }
    }
}
