//! The global save plan: validation of what all ranks declared, one writer per piece
//! (replicas written once, spread across holders by bytes), the chunk grid of every tensor,
//! and each rank's own list of chunk files to write.

use std::collections::HashMap;

use super::grid::{self, GridOptions};
use super::layout::GatheredLayouts;
use crate::model::key::check_collisions;
use crate::model::object::linear_index;
use crate::model::{DType, KeyError, Region, TensorKey};

/// Options for save planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavePlanOptions {
    /// Chunk grid choices.
    pub grid: GridOptions,
    /// Spread the writing of replicated pieces across their holders by bytes (true), or let
    /// the main replica write every piece (false).
    pub balance_replicas: bool,
}

impl Default for SavePlanOptions {
    fn default() -> Self {
        SavePlanOptions {
            grid: GridOptions::default(),
            balance_replicas: true,
        }
    }
}

/// Why the ranks' declarations do not form a valid checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// Two keys collide once mapped to paths.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// Ranks disagree on a tensor's data type or global shape.
    #[error("tensor `{key}`: ranks disagree on {what}: {}", describe_variants(.variants))]
    Disagreement {
        /// The tensor.
        key: TensorKey,
        /// `"data type"` or `"global shape"`.
        what: &'static str,
        /// Each variant seen, with (up to 8 of) the ranks that declared it.
        variants: Vec<(String, Vec<u32>)>,
    },
    /// Two main replicas overlap, or the same box is main on several ranks (then `first`
    /// equals `second` and the message says how to declare a replicated box).
    #[error("{}", describe_overlap(.key, .first, .first_ranks, .second, .second_ranks))]
    Overlap {
        /// The tensor.
        key: TensorKey,
        /// One piece.
        first: Region,
        /// Ranks holding it as main.
        first_ranks: Vec<u32>,
        /// The other piece.
        second: Region,
        /// Ranks holding it as main.
        second_ranks: Vec<u32>,
    },
    /// A rank's description does not fit the rule it names.
    #[error(transparent)]
    Describe(#[from] super::layout::LayoutDecodeError),
    /// No chunk grid of the tensor meets a reader limit of the format (spec section 4):
    /// the writer refuses before writing anything, since readers would refuse the
    /// checkpoint.
    #[error("tensor `{key}` cannot be stored: {limit} (a limit every reader enforces)")]
    Limit {
        /// The tensor.
        key: TensorKey,
        /// The limit its grid breaks.
        limit: grid::GridLimit,
    },
    /// The main replicas do not cover every element.
    #[error(
        "tensor `{key}`: main replicas cover {covered} of {total} elements (e.g. element {missing:?} is held by no main replica)"
    )]
    Gap {
        /// The tensor.
        key: TensorKey,
        /// Elements covered.
        covered: u128,
        /// Elements in the tensor.
        total: u128,
        /// One element no main replica holds.
        missing: Vec<u64>,
    },
}

fn describe_overlap(
    key: &TensorKey,
    first: &Region,
    first_ranks: &[u32],
    second: &Region,
    second_ranks: &[u32],
) -> String {
    if first == second {
        format!(
            "tensor `{key}`: ranks {first_ranks:?} each declare {first} as the main replica \
             (replica id 0); if they hold the same data, declare it replicated on every holder \
             (ShardedTensor::replicated, Replica::Auto) or give all of them but one a non-zero \
             replica id; if not, their offsets are wrong"
        )
    } else {
        format!(
            "tensor `{key}`: main replicas overlap: {first} on ranks {first_ranks:?} and {second} \
             on ranks {second_ranks:?}; every element must be held as main (replica id 0, or \
             identical boxes declared replicated) by exactly one rank"
        )
    }
}

fn describe_variants(v: &[(String, Vec<u32>)]) -> String {
    v.iter()
        .map(|(what, ranks)| format!("{what} on ranks {ranks:?}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// One main piece and who writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PiecePlan {
    /// The box.
    pub region: Region,
    /// The rank that writes it (holds it as main or replica).
    pub writer: u32,
}

/// The plan for one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlan {
    /// The key.
    pub key: TensorKey,
    /// The data type.
    pub dtype: DType,
    /// The global shape.
    pub global_shape: Vec<u64>,
    /// Outer chunk (shard file) shape.
    pub chunk_shape: Vec<u64>,
    /// Inner subchunk shape.
    pub subchunk_shape: Vec<u64>,
    /// True when every piece is a union of whole chunks.
    pub aligned: bool,
    /// The main pieces, sorted by region.
    pub pieces: Vec<PiecePlan>,
    /// The rank that writes the array's `zarr.json`.
    pub metadata_writer: u32,
}

/// The plan all ranks compute identically from the gathered layouts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavePlan {
    /// Every tensor, sorted by key.
    pub tensors: Vec<TensorPlan>,
    /// Bytes each rank writes.
    pub bytes_per_rank: Vec<u64>,
}

/// Where the data of one part of a chunk comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// From the local piece with this region.
    Local(Region),
    /// Received from another rank.
    Remote(u32),
}

/// One part of a chunk a rank writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The part's box (inside the chunk).
    pub region: Region,
    /// Where its bytes come from.
    pub source: Source,
}

/// One chunk file a rank writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkWrite {
    /// Index into [`SavePlan::tensors`].
    pub tensor: usize,
    /// Grid index of the chunk.
    pub chunk: Vec<u64>,
    /// The chunk's box (clipped to the tensor).
    pub region: Region,
    /// Its parts; a single local part equal to a piece's sub-box in the aligned case.
    pub parts: Vec<Part>,
}

/// One part a rank sends to a chunk's writer (unaligned tensors only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Index into [`SavePlan::tensors`].
    pub tensor: usize,
    /// The chunk's writer.
    pub to: u32,
    /// The sender's local piece holding the part.
    pub piece: Region,
    /// The part's box.
    pub region: Region,
}

/// Everything one rank does during a save.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankTasks {
    /// Chunk files to write, in plan order.
    pub writes: Vec<ChunkWrite>,
    /// Parts to send, in plan order.
    pub sends: Vec<Transfer>,
    /// Tensors whose `zarr.json` this rank writes.
    pub metadata: Vec<usize>,
}

#[derive(Default)]
struct BoxAcc {
    /// Layout indices holding the box as main.
    main_layouts: Vec<u32>,
    /// Layout indices holding the box declared replicated without an id (`Replica::Auto`).
    auto_layouts: Vec<u32>,
    /// Layout indices holding the box at all.
    holder_layouts: Vec<u32>,
}

struct TensorAcc {
    key: TensorKey,
    dtype: DType,
    shape: Vec<u64>,
    variants_dtype: Vec<(DType, Vec<u32>)>,
    variants_shape: Vec<(Vec<u64>, Vec<u32>)>,
    boxes: HashMap<Region, BoxAcc>,
}

fn note_variant<T: PartialEq + Clone>(v: &mut Vec<(T, Vec<u32>)>, what: &T, ranks: &[u32]) {
    let slot = match v.iter().position(|(x, _)| x == what) {
        Some(i) => &mut v[i].1,
        None => {
            v.push((what.clone(), Vec::new()));
            &mut v.last_mut().expect("just pushed").1
        }
    };
    for &r in ranks {
        if slot.len() < 8 {
            slot.push(r);
        }
    }
}

fn ranks_of(g: &GatheredLayouts, layouts: &[u32]) -> Vec<u32> {
    let mut r: Vec<u32> = layouts
        .iter()
        .flat_map(|&u| g.ranks[u as usize].iter().copied())
        .collect();
    r.sort_unstable();
    r.truncate(8);
    r
}

/// Checks that the boxes are pairwise disjoint and cover every element of `shape`.
fn check_coverage(
    key: &TensorKey,
    shape: &[u64],
    mains: &[(&Region, &[u32])],
    g: &GatheredLayouts,
) -> Result<(), PlanError> {
    // Sort by the first dimension and sweep: only boxes whose first-dimension ranges overlap
    // can intersect.
    let mut order: Vec<usize> = (0..mains.len()).collect();
    // A scalar's box has no first dimension: every such box starts at 0.
    let first = |i: usize| mains[i].0.offset().first().copied().unwrap_or(0);
    order.sort_by_key(|&i| (first(i), mains[i].0.clone()));
    let mut active: Vec<usize> = Vec::new();
    for &i in &order {
        let (ri, li) = mains[i];
        if ri.is_empty() {
            continue;
        }
        if ri.ndim() > 0 {
            active.retain(|&j| mains[j].0.end(0) > ri.offset()[0]);
        }
        if let Some(&j) = active.iter().find(|&&j| mains[j].0.intersect(ri).is_some()) {
            return Err(PlanError::Overlap {
                key: key.clone(),
                first: mains[j].0.clone(),
                first_ranks: ranks_of(g, mains[j].1),
                second: ri.clone(),
                second_ranks: ranks_of(g, li),
            });
        }
        active.push(i);
    }
    let total: u128 = shape.iter().map(|&d| u128::from(d)).product();
    let covered: u128 = mains
        .iter()
        .map(|(r, _)| r.shape().iter().map(|&d| u128::from(d)).product::<u128>())
        .sum();
    if covered != total {
        return Err(PlanError::Gap {
            key: key.clone(),
            covered,
            total,
            missing: find_uncovered(shape, mains.iter().map(|m| m.0)),
        });
    }
    Ok(())
}

/// The least bytes of a tensor that one rank holds as main (the sum of the non-empty main
/// boxes its layout declares, replicated boxes counting for each of their holders), 0 when
/// no rank holds any. A rank holding a flat range declares it as several boxes, some of them
/// small (partial rows); what matters for the tiny-chunk rule is its whole share.
fn smallest_holding_bytes(mains: &[(&Region, &[u32])], elem: usize) -> u64 {
    let mut per_layout: HashMap<u32, u64> = HashMap::new();
    for (region, layouts) in mains {
        // Invariant: a main box lies inside its tensor, whose element count fits `u64`.
        let bytes = region
            .num_elements()
            .unwrap_or(0)
            .saturating_mul(elem as u64);
        for &u in *layouts {
            let e = per_layout.entry(u).or_default();
            *e = e.saturating_add(bytes);
        }
    }
    per_layout
        .into_values()
        .filter(|&b| b > 0)
        .min()
        // No rank holds any bytes: 0, as documented above.
        .unwrap_or(0)
}

/// Finds one element covered by no box (boxes are disjoint and cover less than the tensor).
/// Candidate coordinates per dimension are 0 and every box end; some combination of them is
/// uncovered.
fn find_uncovered<'a>(shape: &[u64], boxes: impl Iterator<Item = &'a Region> + Clone) -> Vec<u64> {
    let cands: Vec<Vec<u64>> = (0..shape.len())
        .map(|d| {
            let mut c: Vec<u64> = std::iter::once(0)
                .chain(boxes.clone().map(|b| b.end(d)))
                .filter(|&x| x < shape[d])
                .collect();
            c.sort_unstable();
            c.dedup();
            c.truncate(64);
            c
        })
        .collect();
    let lo = vec![0u64; shape.len()];
    let hi: Vec<u64> = cands.iter().map(|c| c.len() as u64).collect();
    let mut found = None;
    grid::for_each_index(&lo, &hi, |ix| {
        if found.is_some() {
            return;
        }
        let p: Vec<u64> = ix
            .iter()
            .enumerate()
            .map(|(d, &i)| cands[d][i as usize])
            .collect();
        if !boxes
            .clone()
            .any(|b| (0..p.len()).all(|d| p[d] >= b.offset()[d] && p[d] < b.end(d)))
        {
            found = Some(p);
        }
    });
    // Only an error's detail: empty when the candidates, capped at 64 per dimension, miss
    // the uncovered element.
    found.unwrap_or_default()
}

impl SavePlan {
    /// Builds and validates the plan from every rank's declared layout.
    ///
    /// # Errors
    /// [`PlanError`] when keys collide, ranks disagree on a tensor's data type or shape, or
    /// the main replicas of a tensor do not cover every element exactly once.
    pub fn build(g: &GatheredLayouts, opts: &SavePlanOptions) -> Result<SavePlan, PlanError> {
        let accs = merge_layouts(g)?;
        let (pending, smallest_holding) = validate(&accs, g, opts)?;
        let (pieces, bytes_per_rank) = assign_writers(pending, g, accs.len());
        let tensors = accs
            .into_iter()
            .zip(pieces)
            .zip(smallest_holding)
            .map(|((acc, pieces), smallest)| tensor_grid(acc, pieces, smallest, opts))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SavePlan {
            tensors,
            bytes_per_rank,
        })
    }

    /// The writes, sends and metadata files of one rank.
    #[must_use]
    pub fn tasks_for(&self, rank: u32) -> RankTasks {
        let mut t = RankTasks::default();
        for (ti, tp) in self.tensors.iter().enumerate() {
            if tp.metadata_writer == rank {
                t.metadata.push(ti);
            }
            if tp.aligned {
                for p in tp
                    .pieces
                    .iter()
                    .filter(|p| p.writer == rank && !p.region.is_empty())
                {
                    let (lo, hi) = grid::chunks_overlapping(&p.region, &tp.chunk_shape);
                    grid::for_each_index(&lo, &hi, |c| {
                        let region = grid::chunk_region(&tp.global_shape, &tp.chunk_shape, c);
                        t.writes.push(ChunkWrite {
                            tensor: ti,
                            chunk: c.to_vec(),
                            region: region.clone(),
                            parts: vec![Part {
                                region,
                                source: Source::Local(p.region.clone()),
                            }],
                        });
                    });
                }
            } else {
                tp.for_each_unaligned_chunk(|chunk, region, parts| {
                    let writer = chunk_writer(parts);
                    if writer == rank {
                        t.writes.push(ChunkWrite {
                            tensor: ti,
                            chunk: chunk.to_vec(),
                            region: region.clone(),
                            parts: parts
                                .iter()
                                .map(|(p, part)| Part {
                                    region: part.clone(),
                                    source: if p.writer == rank {
                                        Source::Local(p.region.clone())
                                    } else {
                                        Source::Remote(p.writer)
                                    },
                                })
                                .collect(),
                        });
                    } else {
                        for (p, part) in parts.iter().filter(|(p, _)| p.writer == rank) {
                            t.sends.push(Transfer {
                                tensor: ti,
                                to: writer,
                                piece: p.region.clone(),
                                region: part.clone(),
                            });
                        }
                    }
                });
            }
        }
        t
    }

    /// Largest bytes written by one rank divided by the mean over all ranks (1.0 = perfect).
    #[must_use]
    pub fn write_balance(&self) -> f64 {
        let n = self.bytes_per_rank.len().max(1) as f64;
        let total: u64 = self.bytes_per_rank.iter().sum();
        // No ranks: total is 0 too, handled below.
        let max = self.bytes_per_rank.iter().copied().max().unwrap_or(0);
        if total == 0 {
            1.0
        } else {
            max as f64 / (total as f64 / n)
        }
    }
}

/// A main piece waiting for its writer.
struct Pending {
    tensor: usize,
    region: Region,
    holders: Vec<u32>,
    /// Only the lowest holder rank may write (no balancing, no main holder).
    lowest_only: bool,
    /// The writer before balancing: the lowest rank declaring the box main (else the lowest
    /// declaring it replicated without an id). The chunk grid's cost model uses it, so that a
    /// tensor's grid follows from its own layout, not from how other tensors loaded the ranks.
    nominal: u32,
    n_holders: usize,
    bytes: u64,
}

/// Step 1 of planning: merges the distinct layouts per tensor (sorted by key), noting every
/// data type and shape declared and who holds each box.
fn merge_layouts(g: &GatheredLayouts) -> Result<Vec<TensorAcc>, PlanError> {
    let mut ids: HashMap<TensorKey, usize> = HashMap::new();
    let mut accs: Vec<TensorAcc> = Vec::new();
    for (u, layout) in g.unique.iter().enumerate() {
        let u32_ = u32::try_from(u).unwrap_or(u32::MAX);
        let ranks = &g.ranks[u];
        let local_ids: Vec<usize> = layout
            .tensors
            .iter()
            .map(|t| {
                let id = *ids.entry(t.key.clone()).or_insert_with(|| {
                    accs.push(TensorAcc {
                        key: t.key.clone(),
                        dtype: t.dtype,
                        shape: t.global_shape.clone(),
                        variants_dtype: Vec::new(),
                        variants_shape: Vec::new(),
                        boxes: HashMap::new(),
                    });
                    accs.len() - 1
                });
                let acc = &mut accs[id];
                note_variant(&mut acc.variants_dtype, &t.dtype, ranks);
                note_variant(&mut acc.variants_shape, &t.global_shape, ranks);
                id
            })
            .collect();
        for p in &layout.pieces {
            let acc = &mut accs[local_ids[p.tensor as usize]];
            let b = acc.boxes.entry(p.region.clone()).or_default();
            if p.main {
                b.main_layouts.push(u32_);
            } else if p.auto {
                b.auto_layouts.push(u32_);
            }
            if b.holder_layouts.last() != Some(&u32_) {
                b.holder_layouts.push(u32_);
            }
        }
    }
    check_collisions(accs.iter().map(|a| &a.key))?;
    accs.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(accs)
}

/// Step 2: validates agreement on data type and shape and that the main replicas cover every
/// element exactly once; returns the main pieces to assign and, per tensor, the least bytes
/// one rank holds as main (the tiny-chunk rule's `P`).
fn validate(
    accs: &[TensorAcc],
    g: &GatheredLayouts,
    opts: &SavePlanOptions,
) -> Result<(Vec<Pending>, Vec<u64>), PlanError> {
    let mut pending: Vec<Pending> = Vec::new();
    // Per tensor: the least bytes one rank holds as main (the tiny-chunk rule's `P`).
    let mut smallest_holding: Vec<u64> = Vec::with_capacity(accs.len());
    for (ti, acc) in accs.iter().enumerate() {
        if acc.variants_dtype.len() > 1 {
            return Err(PlanError::Disagreement {
                key: acc.key.clone(),
                what: "data type",
                variants: acc
                    .variants_dtype
                    .iter()
                    .map(|(d, r)| (d.to_string(), r.clone()))
                    .collect(),
            });
        }
        if acc.variants_shape.len() > 1 {
            return Err(PlanError::Disagreement {
                key: acc.key.clone(),
                what: "global shape",
                variants: acc
                    .variants_shape
                    .iter()
                    .map(|(s, r)| (format!("{s:?}"), r.clone()))
                    .collect(),
            });
        }
        let mut mains: Vec<(&Region, &[u32])> = Vec::new();
        for (region, b) in &acc.boxes {
            // A box is stored when some rank holds it as main or declares it replicated
            // without an id; the latter form one replica group with any id-0 holder.
            let declared: &[u32] = if b.main_layouts.is_empty() {
                &b.auto_layouts
            } else {
                &b.main_layouts
            };
            if declared.is_empty() {
                continue;
            }
            let n_main: usize = b
                .main_layouts
                .iter()
                .map(|&u| g.ranks[u as usize].len())
                .sum();
            if n_main > 1 && !region.is_empty() {
                let ranks = ranks_of(g, &b.main_layouts);
                return Err(PlanError::Overlap {
                    key: acc.key.clone(),
                    first: region.clone(),
                    first_ranks: ranks.clone(),
                    second: region.clone(),
                    second_ranks: ranks,
                });
            }
            mains.push((region, declared));
        }
        check_coverage(&acc.key, &acc.shape, &mains, g)?;
        smallest_holding.push(smallest_holding_bytes(&mains, acc.dtype.size()));
        for (region, b) in &acc.boxes {
            if b.main_layouts.is_empty() && b.auto_layouts.is_empty() {
                continue;
            }
            let n_holders = b
                .holder_layouts
                .iter()
                .map(|&u| g.ranks[u as usize].len())
                .sum();
            // Invariant: a piece lies inside its tensor, whose element count fits `u64`.
            let bytes = region
                .num_elements()
                .unwrap_or(0)
                .saturating_mul(acc.dtype.size() as u64);
            let declared = if b.main_layouts.is_empty() {
                &b.auto_layouts
            } else {
                &b.main_layouts
            };
            let nominal = declared
                .iter()
                .filter_map(|&u| g.ranks[u as usize].first().copied())
                .min()
                .unwrap_or(0);
            pending.push(Pending {
                tensor: ti,
                region: region.clone(),
                nominal,
                holders: if opts.balance_replicas {
                    b.holder_layouts.clone()
                } else if b.main_layouts.is_empty() {
                    b.auto_layouts.clone()
                } else {
                    b.main_layouts.clone()
                },
                lowest_only: !opts.balance_replicas && b.main_layouts.is_empty(),
                n_holders,
                bytes,
            });
        }
    }

    Ok((pending, smallest_holding))
}

/// Step 3: assigns writers, fewest holders first, then largest, to the least-loaded holder.
/// Returns the pieces per tensor and the bytes each rank writes.
fn assign_writers(
    mut pending: Vec<Pending>,
    g: &GatheredLayouts,
    n_tensors: usize,
) -> (Vec<Vec<(PiecePlan, u32)>>, Vec<u64>) {
    pending.sort_by(|a, b| {
        (a.n_holders, std::cmp::Reverse(a.bytes), a.tensor, &a.region).cmp(&(
            b.n_holders,
            std::cmp::Reverse(b.bytes),
            b.tensor,
            &b.region,
        ))
    });
    let mut load = vec![0u64; g.world_size()];
    let mut pieces: Vec<Vec<(PiecePlan, u32)>> = vec![Vec::new(); n_tensors];
    for p in pending {
        let mut best: Option<(u64, u32)> = None;
        for &u in &p.holders {
            for &r in &g.ranks[u as usize] {
                let cand = if p.lowest_only {
                    (0, r)
                } else {
                    (load[r as usize], r)
                };
                if best.is_none_or(|b| cand < b) {
                    best = Some(cand);
                }
            }
        }
        let writer = best.map_or(0, |b| b.1);
        load[writer as usize] += p.bytes;
        pieces[p.tensor].push((
            PiecePlan {
                region: p.region,
                writer,
            },
            p.nominal,
        ));
    }

    (pieces, load)
}

/// Step 4: the chunk grid of one tensor from its main pieces (each with its writer and its
/// nominal writer), checked against the readers' limits ([`grid::checked_grid`]). The grid's
/// cost model sees the nominal writers, so the grid depends on this tensor's layout alone.
fn tensor_grid(
    acc: TensorAcc,
    mut pieces: Vec<(PiecePlan, u32)>,
    smallest: u64,
    opts: &SavePlanOptions,
) -> Result<TensorPlan, PlanError> {
    pieces.sort_by(|a, b| a.0.region.cmp(&b.0.region));
    let elem = acc.dtype.size();
    let parts: Vec<(&Region, u32)> = pieces.iter().map(|p| (&p.0.region, p.1)).collect();
    let g =
        grid::checked_grid(&acc.shape, &parts, elem, smallest, &opts.grid).map_err(|limit| {
            PlanError::Limit {
                key: acc.key.clone(),
                limit,
            }
        })?;
    let metadata_writer = pieces.first().map_or(0, |p| p.0.writer);
    Ok(TensorPlan {
        key: acc.key,
        dtype: acc.dtype,
        global_shape: acc.shape,
        chunk_shape: g.chunk_shape,
        subchunk_shape: g.subchunk_shape,
        aligned: g.aligned,
        pieces: pieces.into_iter().map(|p| p.0).collect(),
        metadata_writer,
    })
}

/// The writer of an unaligned chunk: the writer of the piece with the largest part (ties:
/// the first piece in region order).
fn chunk_writer(parts: &[(&PiecePlan, Region)]) -> u32 {
    let mut best: Option<(u64, &PiecePlan)> = None;
    for (p, part) in parts {
        // Invariant: a part of a chunk, inside a tensor whose element count fits `u64`.
        let n = part.num_elements().unwrap_or(0);
        if best.is_none_or(|(bn, _)| n > bn) {
            best = Some((n, p));
        }
    }
    best.map_or(0, |(_, p)| p.writer)
}

impl TensorPlan {
    /// Calls `f(chunk_index, chunk_region, parts)` for every chunk of an unaligned tensor, in
    /// C order, with the pieces overlapping it (in region order) and the overlaps.
    fn for_each_unaligned_chunk(
        &self,
        mut f: impl FnMut(&[u64], &Region, &[(&PiecePlan, Region)]),
    ) {
        let gshape = grid::grid_shape(&self.global_shape, &self.chunk_shape);
        let linear = |c: &[u64]| linear_index(&gshape, c);
        // (chunk, piece) for every chunk each piece touches, so that a chunk meets only its
        // own pieces (not every piece of the tensor: irregular layouts have one per rank).
        let mut touches: Vec<(u64, usize)> = Vec::new();
        for (pi, p) in self.pieces.iter().enumerate() {
            if p.region.is_empty() {
                continue;
            }
            let (lo, hi) = grid::chunks_overlapping(&p.region, &self.chunk_shape);
            grid::for_each_index(&lo, &hi, |c| touches.push((linear(c), pi)));
        }
        touches.sort_unstable();
        let mut next = touches.iter().peekable();
        let lo = vec![0u64; gshape.len()];
        let mut parts = Vec::new();
        grid::for_each_index(&lo, &gshape, |c| {
            let region = grid::chunk_region(&self.global_shape, &self.chunk_shape, c);
            let at = linear(c);
            parts.clear();
            while let Some(&(_, pi)) = next.next_if(|(l, _)| *l == at) {
                let p = &self.pieces[pi];
                if let Some(part) = p.region.intersect(&region) {
                    parts.push((p, part));
                }
            }
            f(c, &region, &parts);
        });
    }

    /// Number of chunk files.
    #[must_use]
    pub fn num_chunks(&self) -> u64 {
        grid::grid_shape(&self.global_shape, &self.chunk_shape)
            .iter()
            .product()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::layout::{PieceDecl, RankLayout, TensorDecl};

    fn decl(key: &str, dtype: DType, shape: &[u64]) -> TensorDecl {
        TensorDecl {
            key: TensorKey::new(key).unwrap(),
            dtype,
            global_shape: shape.to_vec(),
        }
    }
    fn piece(t: u32, o: &[u64], s: &[u64], main: bool) -> PieceDecl {
        PieceDecl {
            tensor: t,
            region: Region::new(o.to_vec(), s.to_vec()).unwrap(),
            main,
            auto: false,
        }
    }

    /// tp x dp layout of one [8, 6] tensor split by rows across tp; dp replicas.
    fn tp_dp(tp: u64, dp: u64) -> Vec<RankLayout> {
        let mut out = Vec::new();
        for d in 0..dp {
            for t in 0..tp {
                let rows = 8 / tp;
                out.push(RankLayout {
                    tensors: vec![
                        decl("w", DType::Float32, &[8, 6]),
                        decl("b", DType::Float32, &[6]),
                    ],
                    pieces: vec![
                        piece(0, &[t * rows, 0], &[rows, 6], d == 0),
                        piece(1, &[0], &[6], d == 0 && t == 0),
                    ],
                });
            }
        }
        out
    }

    #[test]
    fn replicas_written_once_and_balanced() {
        let g = GatheredLayouts::from_layouts(&tp_dp(2, 4));
        let plan = SavePlan::build(&g, &SavePlanOptions::default()).unwrap();
        assert_eq!(plan.tensors.len(), 2);
        let w = &plan.tensors[1];
        assert_eq!(w.key.as_str(), "w");
        assert_eq!(w.chunk_shape, vec![4, 6]);
        assert!(w.aligned);
        let mut writes_per_chunk: HashMap<(usize, Vec<u64>), u32> = HashMap::new();
        for r in 0..8 {
            for cw in plan.tasks_for(r).writes {
                *writes_per_chunk.entry((cw.tensor, cw.chunk)).or_default() += 1;
            }
        }
        assert_eq!(writes_per_chunk.len(), 3);
        assert!(writes_per_chunk.values().all(|&n| n == 1));
        // The two halves of w go to different ranks and the bias to a third.
        let writers: Vec<u32> = w.pieces.iter().map(|p| p.writer).collect();
        assert_ne!(writers[0], writers[1]);
        assert_ne!(plan.tensors[0].pieces[0].writer, writers[0]);
        assert_ne!(plan.tensors[0].pieces[0].writer, writers[1]);
        // Without balancing, main replicas (dp rank 0) write everything.
        let plan = SavePlan::build(
            &g,
            &SavePlanOptions {
                balance_replicas: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(
            plan.tensors
                .iter()
                .flat_map(|t| &t.pieces)
                .all(|p| p.writer < 2)
        );
    }

    #[test]
    fn reports_overlap_gap_and_disagreement() {
        let mut l = tp_dp(2, 1);
        l[1].pieces[0].main = false; // rows 4..8 held by no main replica
        let e = SavePlan::build(
            &GatheredLayouts::from_layouts(&l),
            &SavePlanOptions::default(),
        )
        .unwrap_err();
        match e {
            PlanError::Gap {
                covered: 24,
                total: 48,
                ref missing,
                ..
            } => assert_eq!(missing, &vec![4, 0]),
            ref other => panic!("{other}"),
        }
        let mut l = tp_dp(2, 2);
        l[2].pieces[0].main = true; // dp replica also claims main
        let e = SavePlan::build(
            &GatheredLayouts::from_layouts(&l),
            &SavePlanOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(e, PlanError::Overlap { ref first_ranks, .. } if first_ranks == &vec![0, 2]),
            "{e}"
        );
        let mut l = tp_dp(2, 1);
        l[1].pieces[0].region = Region::new(vec![3, 0], vec![5, 6]).unwrap();
        let e = SavePlan::build(
            &GatheredLayouts::from_layouts(&l),
            &SavePlanOptions::default(),
        )
        .unwrap_err();
        assert!(matches!(e, PlanError::Overlap { .. }), "{e}");
        let mut l = tp_dp(2, 1);
        l[1].tensors[0].dtype = DType::BFloat16;
        let e = SavePlan::build(
            &GatheredLayouts::from_layouts(&l),
            &SavePlanOptions::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("rank"), "{e}");
        assert!(
            matches!(
                e,
                PlanError::Disagreement {
                    what: "data type",
                    ..
                }
            ),
            "{e}"
        );
    }

    fn auto(t: u32, o: &[u64], s: &[u64]) -> PieceDecl {
        PieceDecl {
            auto: true,
            ..piece(t, o, s, false)
        }
    }

    #[test]
    fn replicated_boxes_are_stored_once_and_balanced() {
        // 4 data-parallel ranks, each declaring 4 biases replicated without ids.
        let layout = RankLayout {
            tensors: (0..4)
                .map(|i| decl(&format!("b{i}"), DType::Float32, &[2048]))
                .collect(),
            pieces: (0..4).map(|i| auto(i, &[0], &[2048])).collect(),
        };
        let g = GatheredLayouts::from_layouts(&vec![layout.clone(); 4]);
        assert_eq!(
            g.unique.len(),
            1,
            "identical layouts are still de-duplicated"
        );
        let plan = SavePlan::build(&g, &SavePlanOptions::default()).unwrap();
        let mut writers: Vec<u32> = plan.tensors.iter().map(|t| t.pieces[0].writer).collect();
        writers.sort_unstable();
        assert_eq!(writers, vec![0, 1, 2, 3]);
        let writes: usize = (0..4).map(|r| plan.tasks_for(r).writes.len()).sum();
        assert_eq!(writes, 4);
        // unbalanced: the lowest holder writes
        let plan = SavePlan::build(
            &g,
            &SavePlanOptions {
                balance_replicas: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(plan.tensors.iter().all(|t| t.pieces[0].writer == 0));
        // one explicit main among auto holders: fine, and with balancing off it writes
        let mut l = vec![layout.clone(); 3];
        l[2].pieces[1] = piece(1, &[0], &[2048], true);
        let plan = SavePlan::build(
            &GatheredLayouts::from_layouts(&l),
            &SavePlanOptions {
                balance_replicas: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(plan.tensors[1].pieces[0].writer, 2);
        // replicated boxes that are not identical overlap
        let mut l = vec![layout.clone(); 2];
        l[1].pieces[0] = auto(0, &[0], &[1024]);
        let e = SavePlan::build(
            &GatheredLayouts::from_layouts(&l),
            &SavePlanOptions::default(),
        )
        .unwrap_err();
        assert!(matches!(e, PlanError::Overlap { .. }), "{e}");
        // a replicated box on one rank only is just stored
        let mut l = vec![layout; 2];
        l[1].pieces.clear();
        assert!(
            SavePlan::build(
                &GatheredLayouts::from_layouts(&l),
                &SavePlanOptions::default()
            )
            .is_ok()
        );
    }

    #[test]
    fn same_main_box_on_several_ranks_says_what_to_do() {
        let layout = RankLayout {
            tensors: vec![decl("bias", DType::Float32, &[2048])],
            pieces: vec![piece(0, &[0], &[2048], true)],
        };
        let e = SavePlan::build(
            &GatheredLayouts::from_layouts(&vec![layout; 4]),
            &SavePlanOptions::default(),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("ranks [0, 1, 2, 3] each declare [0..2048] as the main replica"),
            "{msg}"
        );
        assert!(msg.contains("ShardedTensor::replicated"), "{msg}");
        assert!(msg.contains("non-zero replica id"), "{msg}");
        assert!(!msg.contains(" and [0..2048]"), "{msg}");
    }

    #[test]
    fn flat_layouts_get_no_tiny_chunks() {
        // A [64, 4096] f32 tensor (1 MiB) cut into 4 flat ranges at offsets that are not
        // row-aligned: each rank holds a partial row, whole rows and another partial row,
        // some partial rows a single element long.
        let shape = [64u64, 4096];
        let cuts = [
            0u64,
            16 * 4096 + 1,
            32 * 4096 + 4095,
            48 * 4096 - 1,
            64 * 4096,
        ];
        let layouts: Vec<RankLayout> = cuts
            .windows(2)
            .map(|w| RankLayout {
                tensors: vec![decl("w", DType::Float32, &shape)],
                pieces: crate::model::flat::flat_boxes(&shape, w[0]..w[1])
                    .unwrap()
                    .into_iter()
                    .map(|b| PieceDecl {
                        tensor: 0,
                        region: b.region,
                        main: true,
                        auto: false,
                    })
                    .collect(),
            })
            .collect();
        let plan = SavePlan::build(
            &GatheredLayouts::from_layouts(&layouts),
            &SavePlanOptions::default(),
        )
        .unwrap();
        let tp = &plan.tensors[0];
        assert!(!tp.aligned);
        assert_eq!(tp.chunk_shape, vec![16, 4096]);
        assert_eq!(tp.num_chunks(), 4);
    }

    #[test]
    fn unaligned_pieces_get_one_writer_per_chunk() {
        // rows 3,3,2,2 of 64 f32 columns: tiny aligned grid -> coarse 3-row chunks.
        let splits = [(0u64, 3u64), (3, 3), (6, 2), (8, 2)];
        let layouts: Vec<RankLayout> = splits
            .iter()
            .map(|&(o, n)| RankLayout {
                tensors: vec![decl("e", DType::Float32, &[10, 64])],
                pieces: vec![piece(0, &[o, 0], &[n, 64], true)],
            })
            .collect();
        let plan = SavePlan::build(
            &GatheredLayouts::from_layouts(&layouts),
            &SavePlanOptions::default(),
        )
        .unwrap();
        let tp = &plan.tensors[0];
        assert!(!tp.aligned);
        assert_eq!(tp.chunk_shape, vec![3, 64]);
        let tasks: Vec<RankTasks> = (0..4).map(|r| plan.tasks_for(r)).collect();
        let n_writes: usize = tasks.iter().map(|t| t.writes.len()).sum();
        assert_eq!(n_writes, 4);
        // chunk rows 6..9 is written by rank 2 with row 8 coming from rank 3
        let w = tasks[2]
            .writes
            .iter()
            .find(|w| w.chunk == vec![2, 0])
            .unwrap();
        assert_eq!(w.parts.len(), 2);
        assert_eq!(w.parts[1].source, Source::Remote(3));
        assert_eq!(tasks[3].sends.len(), 1);
        assert_eq!(tasks[3].sends[0].to, 2);
    }
}
