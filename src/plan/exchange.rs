//! Read once, share: which parts of which shards several ranks need, and who reads each.
//!
//! Ranks that need the same bytes (data-parallel replicas, most of all) would each read them
//! from storage. Instead, for every shard and every box of it that two or more ranks need
//! identically, one of those ranks (balanced by bytes, the same choice on every rank) reads it
//! and sends it to the others.

use super::FastMap as HashMap;

use super::grid;
use super::grid::StoredGeometry;
use super::layout::GatheredLayouts;
use crate::model::{Region, TensorKey};

/// One box of one shard that several ranks need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedRead {
    /// The tensor.
    pub key: TensorKey,
    /// Grid index of the shard.
    pub chunk: Vec<u64>,
    /// The box (a request clipped to the shard).
    pub region: Region,
    /// The ranks that need it, ascending.
    pub ranks: Vec<u32>,
    /// The rank that reads it from storage and sends it to the others.
    pub reader: u32,
    /// Bytes of the box.
    pub bytes: u64,
}

/// The shared reads of a load, in the order every rank processes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExchangePlan {
    /// Sorted by (key, chunk, region).
    pub reads: Vec<SharedRead>,
    /// Bytes each rank reads for the group (when planned for every rank).
    pub bytes_per_rank: Vec<u64>,
    /// Per read, its exchange round: among the group reads (`reads[..general_from]`) a round
    /// of the read group, among the others a round of the general plan.
    pub round: Vec<u32>,
    /// Where the reads planned by the general planner start.
    pub general_from: usize,
    /// Rounds of the general plan (the same on every rank).
    pub general_rounds: u32,
}

impl ExchangePlan {
    /// Plans the shared reads for the requests in `g` (load layouts: every piece a request;
    /// those marked `main` are read by their rank alone and left out) against the stored geometry of each tensor (`geometry` returns `None` for keys the
    /// checkpoint lacks, which are left out).
    #[must_use]
    pub fn build(
        g: &GatheredLayouts,
        geometry: impl Fn(&TensorKey) -> Option<StoredGeometry>,
    ) -> ExchangePlan {
        // (tensor, chunk, box) -> distinct layouts needing it
        let mut geoms: HashMap<&TensorKey, Option<StoredGeometry>> = HashMap::default();
        let mut need: HashMap<(&TensorKey, Vec<u64>, Region), Vec<u32>> = HashMap::default();
        for (u, layout) in g.unique.iter().enumerate() {
            let u = u32::try_from(u).unwrap_or(u32::MAX);
            for p in &layout.pieces {
                if p.main {
                    continue; // read by its rank alone (converted to another data type)
                }
                let key = &layout.tensors[p.tensor as usize].key;
                let geom = geoms.entry(key).or_insert_with(|| geometry(key));
                let Some(geom) = geom else { continue };
                if p.region.is_empty() {
                    continue;
                }
                let (lo, hi) = grid::chunks_overlapping(&p.region, &geom.chunk_shape);
                grid::for_each_index(&lo, &hi, |c| {
                    let chunk_box = grid::chunk_box(&geom.chunk_shape, c);
                    if let Some(inner) = p.region.intersect(&chunk_box) {
                        let layouts = need.entry((key, c.to_vec(), inner)).or_default();
                        if layouts.last() != Some(&u) {
                            layouts.push(u);
                        }
                    }
                });
            }
        }
        let mut reads: Vec<SharedRead> = need
            .into_iter()
            .filter_map(|((key, chunk, region), layouts)| {
                let mut ranks: Vec<u32> = layouts
                    .iter()
                    .flat_map(|&u| g.ranks[u as usize].iter().copied())
                    .collect();
                if ranks.len() < 2 {
                    return None;
                }
                ranks.sort_unstable();
                let elem = geoms
                    .get(key)
                    .and_then(Option::as_ref)
                    .map_or(1, |g| g.elem);
                // Invariant: inside a declared tensor, whose element count fits `u64`.
                let bytes = region
                    .num_elements()
                    .unwrap_or(0)
                    .saturating_mul(elem as u64);
                Some(SharedRead {
                    key: key.clone(),
                    chunk,
                    region,
                    ranks,
                    reader: 0,
                    bytes,
                })
            })
            .collect();
        // Largest first to the least-loaded member; ties by rank.
        let mut order: Vec<usize> = (0..reads.len()).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&reads[a], &reads[b]);
            (std::cmp::Reverse(x.bytes), &x.key, &x.chunk, &x.region).cmp(&(
                std::cmp::Reverse(y.bytes),
                &y.key,
                &y.chunk,
                &y.region,
            ))
        });
        let mut load = vec![0u64; g.world_size()];
        for i in order {
            let r = &mut reads[i];
            let reader = r
                .ranks
                .iter()
                .copied()
                .min_by_key(|&k| (load[k as usize], k))
                // Invariant: reads with fewer than two ranks were filtered out above.
                .unwrap_or(0);
            load[reader as usize] += r.bytes;
            r.reader = reader;
        }
        reads.sort_by(|x, y| (&x.key, &x.chunk, &x.region).cmp(&(&y.key, &y.chunk, &y.region)));
        ExchangePlan {
            reads,
            bytes_per_rank: load,
            ..ExchangePlan::default()
        }
    }

    /// Splits the reads into consecutive rounds of at most `max_bytes` each (a read larger
    /// than that is a round of its own), bounding the memory a round may need for staging.
    #[must_use]
    pub fn rounds(&self, max_bytes: u64) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut acc = 0u64;
        for (i, r) in self.reads.iter().enumerate() {
            if i > start && acc + r.bytes > max_bytes {
                out.push(start..i);
                start = i;
                acc = 0;
            }
            acc += r.bytes;
        }
        if start < self.reads.len() {
            out.push(start..self.reads.len());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DType;
    use crate::plan::layout::{PieceDecl, RankLayout, TensorDecl};

    fn geom() -> StoredGeometry {
        StoredGeometry {
            global_shape: vec![8, 4],
            chunk_shape: vec![2, 4],
            subchunk_shape: vec![1, 4],
            elem: 4,
        }
    }

    fn request(rows: (u64, u64)) -> RankLayout {
        RankLayout {
            tensors: vec![TensorDecl {
                key: TensorKey::new("w").unwrap(),
                dtype: DType::Float32,
                global_shape: vec![8, 4],
            }],
            pieces: vec![PieceDecl {
                tensor: 0,
                region: Region::new(vec![rows.0, 0], vec![rows.1, 4]).unwrap(),
                main: false,
                auto: false,
            }],
        }
    }

    #[test]
    fn data_parallel_replicas_read_each_shard_once() {
        // tp 2 x dp 3: ranks 0,2,4 want rows 0..4; ranks 1,3,5 rows 4..8.
        let layouts: Vec<RankLayout> = (0..6)
            .map(|r| {
                if r % 2 == 0 {
                    request((0, 4))
                } else {
                    request((4, 4))
                }
            })
            .collect();
        let g = GatheredLayouts::from_layouts(&layouts);
        let plan = ExchangePlan::build(&g, |_| Some(geom()));
        assert_eq!(plan.reads.len(), 4); // 4 shards, each needed by 3 ranks
        for r in &plan.reads {
            assert_eq!(r.ranks.len(), 3);
            assert!(r.ranks.contains(&r.reader));
        }
        // Balanced: 4 reads of 32 bytes over 6 ranks, no rank reads more than one.
        assert!(
            plan.bytes_per_rank.iter().all(|&b| b <= 32),
            "{:?}",
            plan.bytes_per_rank
        );
        assert_eq!(plan.rounds(64), vec![0..2, 2..4]);
        assert_eq!(plan.rounds(1), vec![0..1, 1..2, 2..3, 3..4]);
    }

    #[test]
    fn no_sharing_without_replicas() {
        let layouts = vec![request((0, 3)), request((3, 5))];
        let g = GatheredLayouts::from_layouts(&layouts);
        assert!(ExchangePlan::build(&g, |_| Some(geom())).reads.is_empty());
        // overlapping but different boxes are not shared either
        let layouts = vec![request((0, 3)), request((1, 3))];
        let g = GatheredLayouts::from_layouts(&layouts);
        assert!(ExchangePlan::build(&g, |_| Some(geom())).reads.is_empty());
        // the same box twice on one rank is not shared with itself
        let mut twice = request((0, 2));
        twice.pieces.push(twice.pieces[0].clone());
        let g = GatheredLayouts::from_layouts(&[twice, request((2, 2))]);
        assert!(ExchangePlan::build(&g, |_| Some(geom())).reads.is_empty());
    }
}
