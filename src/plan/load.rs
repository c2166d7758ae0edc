//! What a load reads: for a requested box of a stored tensor, the outer chunks (shard files)
//! and inner subchunks that intersect it, and how each lands in the caller's buffer.

use std::collections::HashMap;

use super::exchange::ExchangePlan;
use super::grid;
use crate::model::copy::is_contiguous;
use crate::model::{Region, TensorKey};

pub use super::grid::StoredGeometry;

/// One subchunk to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubchunkRead {
    /// Index of the subchunk within its shard, C order over the shard's subchunk grid.
    pub linear: u64,
    /// The subchunk's full box in global coordinates (may extend past the tensor's end at
    /// the edge: stored chunks always have the full chunk shape).
    pub stored: Region,
    /// The part of the request inside it.
    pub needed: Region,
    /// True when the whole stored subchunk is needed and lands contiguously in the caller's
    /// buffer, so its bytes can be read straight into place.
    pub direct: bool,
}

/// One shard file to read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardRead {
    /// Grid index of the shard.
    pub chunk: Vec<u64>,
    /// Subchunks to read, in C order (which is also their order in the file when written by
    /// zarrckpt).
    pub subchunks: Vec<SubchunkRead>,
}

impl StoredGeometry {
    /// Subchunks per shard along each dimension.
    #[must_use]
    pub fn subchunks_per_shard(&self) -> Vec<u64> {
        self.chunk_shape
            .iter()
            .zip(&self.subchunk_shape)
            .map(|(c, s)| c / s)
            .collect()
    }

    /// The reads that fill `request` (a non-empty box inside the tensor).
    #[must_use]
    pub fn reads_for(&self, request: &Region) -> Vec<ShardRead> {
        let mut out = Vec::new();
        if request.is_empty() {
            return out;
        }
        let per_shard = self.subchunks_per_shard();
        let (lo, hi) = grid::chunks_overlapping(request, &self.chunk_shape);
        grid::for_each_index(&lo, &hi, |c| {
            let origin: Vec<u64> = c
                .iter()
                .zip(&self.chunk_shape)
                .map(|(i, s)| i * s)
                .collect();
            // A chunk of the checked geometry's grid.
            let chunk_box = Region::from_parts_unchecked(origin.clone(), self.chunk_shape.clone());
            let Some(inner) = request.intersect(&chunk_box) else {
                return;
            };
            let rel = inner.relative_to(&origin);
            let (slo, shi) = grid::chunks_overlapping(&rel, &self.subchunk_shape);
            let mut subchunks = Vec::new();
            grid::for_each_index(&slo, &shi, |s| {
                let offset: Vec<u64> = s
                    .iter()
                    .zip(&self.subchunk_shape)
                    .zip(&origin)
                    .map(|((i, n), o)| o + i * n)
                    .collect();
                // A subchunk of that chunk.
                let stored = Region::from_parts_unchecked(offset, self.subchunk_shape.clone());
                let Some(needed) = inner.intersect(&stored) else {
                    return;
                };
                let direct = needed == stored && is_contiguous(needed.shape(), request.shape());
                let linear = crate::model::object::linear_index(&per_shard, s);
                subchunks.push(SubchunkRead {
                    linear,
                    stored,
                    needed,
                    direct,
                });
            });
            out.push(ShardRead {
                chunk: c.to_vec(),
                subchunks,
            });
        });
        out
    }

    /// Bytes of one stored subchunk.
    #[must_use]
    pub fn subchunk_bytes(&self) -> u64 {
        self.subchunk_shape.iter().product::<u64>() * self.elem as u64
    }
}

/// The shard reads a rank does itself for its requests (`(key, box, read alone)`, in order),
/// given the shared reads `plan` it takes part in: every shard intersecting a request of a
/// stored tensor (`geometry` gives `None` for the others, which are left out), except the
/// boxes another rank of its read group reads and sends. Also returns, for each shared read
/// this rank takes part in, the first of its requests that needs it (where the box is read
/// into, sent from or received into).
#[must_use]
pub fn local_reads(
    requests: &[(&TensorKey, &Region, bool)],
    geometry: &dyn Fn(&TensorKey) -> Option<StoredGeometry>,
    plan: &ExchangePlan,
    me: u32,
) -> (Vec<(usize, ShardRead)>, HashMap<usize, usize>) {
    let mut mine: HashMap<(&TensorKey, &[u64], &Region), usize> = HashMap::new();
    for (u, r) in plan.reads.iter().enumerate() {
        if r.ranks.binary_search(&me).is_ok() {
            mine.insert((&r.key, r.chunk.as_slice(), &r.region), u);
        }
    }
    let mut geoms: HashMap<&TensorKey, Option<StoredGeometry>> = HashMap::new();
    let mut first_target = HashMap::new();
    let mut items = Vec::new();
    for (i, &(key, region, alone)) in requests.iter().enumerate() {
        let Some(geom) = geoms.entry(key).or_insert_with(|| geometry(key)) else {
            continue;
        };
        for shard in geom.reads_for(region) {
            // A request read alone never takes part in shared reads.
            let unit = if alone || mine.is_empty() {
                None
            } else {
                let chunk_box = grid::chunk_box(&geom.chunk_shape, &shard.chunk);
                region
                    .intersect(&chunk_box)
                    .as_ref()
                    .and_then(|b| mine.get(&(key, shard.chunk.as_slice(), b)).copied())
            };
            if let Some(u) = unit
                && !first_target.contains_key(&u)
            {
                first_target.insert(u, i);
                if plan.reads[u].reader != me {
                    continue; // received from the reader
                }
            }
            items.push((i, shard));
        }
    }
    (items, first_target)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o.to_vec(), s.to_vec()).unwrap()
    }

    #[test]
    fn reads_exactly_the_intersecting_subchunks() {
        // 4 shards of 4 rows, 2-row subchunks; load rows 3..9 (a 4->3 style split).
        let g = StoredGeometry {
            global_shape: vec![16, 8],
            chunk_shape: vec![4, 8],
            subchunk_shape: vec![2, 8],
            elem: 4,
        };
        let reads = g.reads_for(&r(&[3, 0], &[6, 8]));
        let chunks: Vec<Vec<u64>> = reads.iter().map(|s| s.chunk.clone()).collect();
        assert_eq!(chunks, vec![vec![0, 0], vec![1, 0], vec![2, 0]]);
        let subs: Vec<(u64, bool)> = reads
            .iter()
            .flat_map(|s| s.subchunks.iter().map(|x| (x.linear, x.direct)))
            .collect();
        // shard 0: subchunk 1 (rows 2..4, partial); shard 1: both full; shard 2: subchunk 0 (rows 8..10, partial)
        assert_eq!(subs, vec![(1, false), (0, true), (1, true), (0, false)]);
        let needed: u64 = reads
            .iter()
            .flat_map(|s| &s.subchunks)
            .map(|x| x.needed.num_elements().unwrap())
            .sum();
        assert_eq!(needed, 48);
    }

    #[test]
    fn column_requests_are_not_direct_and_edges_pad() {
        let g = StoredGeometry {
            global_shape: vec![5, 8],
            chunk_shape: vec![3, 8],
            subchunk_shape: vec![3, 8],
            elem: 2,
        };
        let reads = g.reads_for(&r(&[0, 4], &[5, 4]));
        assert_eq!(reads.len(), 2);
        assert!(reads.iter().flat_map(|s| &s.subchunks).all(|x| !x.direct));
        let edge = &reads[1].subchunks[0];
        assert_eq!(edge.stored, r(&[3, 0], &[3, 8]));
        assert_eq!(edge.needed, r(&[3, 4], &[2, 4]));
        // scalar
        let s = StoredGeometry {
            global_shape: vec![],
            chunk_shape: vec![],
            subchunk_shape: vec![],
            elem: 8,
        };
        let reads = s.reads_for(&r(&[], &[]));
        assert_eq!(reads.len(), 1);
        assert!(reads[0].subchunks[0].direct);
    }
}
