//! Save planning for one rank from the world's rule-based description ([`World`]), in time and
//! memory that grow with the number of tensors and distinct rules, not with world × tensors.
//!
//! A tensor is **regular** when every rank's piece of it (at most one per rank) is a part of
//! one regular grid (parts of `s_a` elements along each axis), given by a rule or an explicit
//! box that is such a part. Its chunks are the grid's parts. Validation counts, per part, the
//! ranks holding it as main or replicated-without-id, once per distinct combination of rules
//! (shared by every tensor with the same rules and part counts): every part stored, none by two
//! main holders. Replicated parts are written by one of their holders: the parts with the same
//! holder set form a group that each holder enumerates identically from its own parts, and
//! assigns by bytes, largest first, to the least-loaded holder. Each rank derives only its own
//! writes.
//!
//! Every other tensor (irregular pieces, several pieces on one rank) goes through the general
//! planner ([`SavePlan::build`]) on the instantiated layouts of those tensors alone.

use super::FastMap as HashMap;
use std::collections::HashSet;

use super::exchange::{ExchangePlan, SharedRead};
use super::grid;
use super::grid::StoredGeometry;
use super::layout::LayoutDecodeError;
use super::rule::{Axis, Rule, World};
use super::save::{
    ChunkWrite, Part, PlanError, RankTasks, SavePlan, SavePlanOptions, Source, TensorPlan, Transfer,
};
use crate::model::key::check_collisions;
use crate::model::{DType, Region, TensorKey};

/// One rank's share of a save plan.
#[derive(Debug, Clone)]
pub struct RankPlan {
    /// Every tensor's geometry, sorted by key (pieces listed only for tensors planned by the
    /// general planner).
    pub plan: SavePlan,
    /// What this rank does.
    pub tasks: RankTasks,
    /// Tensor bytes this rank writes.
    pub bytes: u64,
    /// Tensors planned by the general planner (not described by one regular grid).
    pub general: usize,
}

/// How a family's piece picks its part along one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Pick {
    Fixed(u64),
    Slot(u32),
}

/// One template's piece of a regular tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Family {
    template: usize,
    picks: Vec<Pick>,
    main: bool,
    auto: bool,
}

/// Per part (linear index in the grid of parts), who holds it.
#[derive(Debug, Default)]
struct Holders {
    main: Vec<u32>,
    auto: Vec<u32>,
    /// Holders neither main nor replicated without id (plain replicas).
    other: Vec<u32>,
}

impl Holders {
    /// Notes `rank` holding the part through a piece with these flags.
    fn add(&mut self, rank: u32, main: bool, auto: bool) {
        if main {
            self.main.push(rank);
        } else if auto {
            self.auto.push(rank);
        } else {
            self.other.push(rank);
        }
    }

    /// Sorts the holders once every rank is in.
    fn finish(&mut self) {
        self.main.sort_unstable();
        self.auto.sort_unstable();
        self.other.sort_unstable();
    }

    /// Every holder, ascending (allocated only when asked).
    fn all(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .main
            .iter()
            .chain(&self.auto)
            .chain(&self.other)
            .copied()
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The lowest holder.
    fn lowest(&self) -> Option<u32> {
        [self.main.first(), self.auto.first(), self.other.first()]
            .into_iter()
            .flatten()
            .min()
            .copied()
    }

    /// True when exactly one rank holds the part.
    fn single(&self) -> bool {
        self.main.len() + self.auto.len() + self.other.len() == 1
    }
}

struct TensorInfo<'w> {
    key: &'w TensorKey,
    dtype: DType,
    shape: &'w [u64],
    dtypes: Vec<(DType, Vec<usize>)>,
    shapes: Vec<(&'w [u64], Vec<usize>)>,
    /// (template, piece index).
    pieces: Vec<(usize, usize)>,
}

fn note<T: PartialEq>(v: &mut Vec<(T, Vec<usize>)>, what: T, t: usize) {
    match v.iter_mut().find(|(x, _)| *x == what) {
        Some((_, ts)) => ts.push(t),
        None => v.push((what, vec![t])),
    }
}

fn ranks_of_templates(w: &World, ts: &[usize]) -> Vec<u32> {
    let mut r: Vec<u32> = ts.iter().flat_map(|&t| w.some_ranks(t)).collect();
    r.sort_unstable();
    r.dedup();
    r.truncate(8);
    r
}

/// The regular grid of a tensor: part sizes and the families, or `None` when it is not one.
fn regular(w: &World, info: &TensorInfo<'_>) -> Option<(Vec<u64>, Vec<Family>)> {
    let shape = info.shape;
    let mut sizes: Option<Vec<u64>> = None;
    let mut seen_templates = HashSet::new();
    // Grid rules fix the sizes; boxes must then be parts of that grid.
    for &(t, p) in &info.pieces {
        let piece = &w.templates[t].pieces[p];
        if let Rule::Grid(axes) = &piece.rule {
            let s: Vec<u64> = axes
                .iter()
                .zip(shape)
                .map(|(a, &d)| match *a {
                    Axis::Full => d.max(1),
                    Axis::Split { size, .. } => size.min(d).max(1),
                })
                .collect();
            match &sizes {
                None => sizes = Some(s),
                Some(x) if *x == s => {}
                Some(_) => return None,
            }
        }
    }
    let sizes = sizes?;
    let mut families = Vec::with_capacity(info.pieces.len());
    for &(t, p) in &info.pieces {
        let piece = &w.templates[t].pieces[p];
        let picks = match &piece.rule {
            Rule::Flat { .. } => return None,
            Rule::Box(r) if r.is_empty() => continue,
            Rule::Box(r) => {
                let mut picks = Vec::with_capacity(shape.len());
                for (a, &s) in sizes.iter().enumerate() {
                    let (o, n) = (r.offset()[a], r.shape()[a]);
                    if o % s != 0 || n != s.min(shape[a] - o) {
                        return None;
                    }
                    picks.push(Pick::Fixed(o / s));
                }
                picks
            }
            Rule::Grid(axes) => axes
                .iter()
                .map(|a| match *a {
                    Axis::Full => Pick::Fixed(0),
                    Axis::Split { slot, .. } => Pick::Slot(slot),
                })
                .collect(),
        };
        // One piece per rank: a template with two pieces of the tensor goes the general way.
        if !seen_templates.insert(t) {
            return None;
        }
        families.push(Family {
            template: t,
            picks,
            main: piece.main,
            auto: piece.auto,
        });
    }
    Some((sizes, families))
}

/// Parts per axis.
fn part_counts(shape: &[u64], sizes: &[u64]) -> Vec<u64> {
    shape
        .iter()
        .zip(sizes)
        .map(|(&d, &s)| d.div_ceil(s))
        .collect()
}

fn linear(idx: &[u64], n: &[u64]) -> u64 {
    crate::model::object::linear_index(n, idx)
}

fn unlinear(mut l: u64, n: &[u64]) -> Vec<u64> {
    let mut idx = vec![0u64; n.len()];
    for a in (0..n.len()).rev() {
        let k = n[a].max(1);
        idx[a] = l % k;
        l /= k;
    }
    idx
}

fn part_region(shape: &[u64], sizes: &[u64], idx: &[u64]) -> Region {
    let offset: Vec<u64> = idx.iter().zip(sizes).map(|(&i, &s)| i * s).collect();
    let extent = offset
        .iter()
        .zip(sizes)
        .zip(shape)
        .map(|((&o, &s), &d)| s.min(d - o))
        .collect();
    // Inside the tensor: extent <= dim - offset (part indices lie in the grid).
    Region::from_parts_unchecked(offset, extent)
}

/// The part a family's rank holds, from its coordinates.
fn pick_part(f: &Family, coords: &[u64]) -> Vec<u64> {
    f.picks
        .iter()
        .map(|p| match *p {
            Pick::Fixed(v) => v,
            // Invariant: `Template::decode` keeps every slot below the template's slot count,
            // and `World::from_summary` gives each rank exactly that many coordinates. Were
            // it not so, `u64::MAX` is beyond every part count, so `holders` refuses the rank
            // before any caller reaches `part_region`.
            Pick::Slot(s) => coords.get(s as usize).copied().unwrap_or(u64::MAX),
        })
        .collect()
}

/// Who holds each part, for one combination of families and part counts.
fn holders(
    w: &World,
    n: &[u64],
    families: &[Family],
) -> Result<HashMap<u64, Holders>, LayoutDecodeError> {
    let mut parts: HashMap<u64, Holders> = HashMap::default();
    let mut bad: Option<u32> = None;
    for f in families {
        w.for_each_rank(f.template, |rank, coords| {
            let idx = pick_part(f, coords);
            if idx.iter().zip(n).any(|(&i, &k)| i >= k) {
                bad.get_or_insert(rank);
                return;
            }
            parts
                .entry(linear(&idx, n))
                .or_default()
                .add(rank, f.main, f.auto);
        })?;
    }
    if let Some(rank) = bad {
        return Err(LayoutDecodeError {
            rank: rank as usize,
            at: 0,
            reason: "a part index lies beyond its tensor".into(),
        });
    }
    parts.values_mut().for_each(Holders::finish);
    Ok(parts)
}

/// Checks that every part is stored, none by two main holders.
fn validate_parts(
    key: &TensorKey,
    shape: &[u64],
    total: u128,
    parts: &HashMap<u64, Holders>,
    region_of: &dyn Fn(u64) -> Region,
) -> Result<(), PlanError> {
    let mut stored: u128 = 0;
    let mut doubly: Option<u64> = None;
    for (&l, h) in parts {
        if h.main.len() > 1 && doubly.is_none_or(|d| l < d) {
            doubly = Some(l);
        }
        if !h.main.is_empty() || !h.auto.is_empty() {
            stored += 1;
        }
    }
    if let Some(l) = doubly {
        let region = region_of(l);
        let ranks: Vec<u32> = parts[&l].main.iter().copied().take(8).collect();
        return Err(PlanError::Overlap {
            key: key.clone(),
            first: region.clone(),
            first_ranks: ranks.clone(),
            second: region,
            second_ranks: ranks,
        });
    }
    if stored != total {
        // The first part nobody stores (at most `parts.len() + 1` candidates).
        let missing = (0u64..)
            .find(|l| {
                parts
                    .get(l)
                    .is_none_or(|h| h.main.is_empty() && h.auto.is_empty())
            })
            // Invariant: an unbounded range always holds a part not in the finite map.
            .unwrap_or(0);
        let elem_total: u128 = shape.iter().map(|&d| u128::from(d)).product();
        let region = region_of(missing);
        // Invariant: a part lies inside its tensor, whose element count fits `u64`.
        let missing_elems = u128::from(region.num_elements().unwrap_or(0));
        return Err(PlanError::Gap {
            key: key.clone(),
            covered: elem_total
                .saturating_sub(missing_elems * (total - stored))
                .min(elem_total),
            total: elem_total,
            missing: region.offset().to_vec(),
        });
    }
    Ok(())
}

/// One regular tensor's part this rank holds, waiting for its writer.
struct Held {
    tensor: usize,
    part: u64,
    region: Region,
    bytes: u64,
    group: usize,
}

/// The plan entry of a tensor the general planner takes over (its grid is chosen there).
fn placeholder(info: &TensorInfo<'_>) -> TensorPlan {
    TensorPlan {
        key: info.key.clone(),
        dtype: info.dtype,
        global_shape: info.shape.to_vec(),
        chunk_shape: Vec::new(),
        subchunk_shape: Vec::new(),
        aligned: false,
        pieces: Vec::new(),
        metadata_writer: 0,
    }
}

/// Plans a save for rank `me` of the world described by `w`.
///
/// # Errors
/// [`PlanError`] when keys collide, ranks disagree on a tensor's data type or shape, or the
/// main replicas of a tensor do not cover every element exactly once;
/// [`PlanError::Describe`] for coordinates that do not fit their template.
pub fn plan_save(w: &World, me: u32, opts: &SavePlanOptions) -> Result<RankPlan, PlanError> {
    // Step 1: tensors across templates.
    let mut infos: Vec<TensorInfo<'_>> = Vec::new();
    let mut ids: HashMap<&TensorKey, usize> = HashMap::default();
    for (ti, t) in w.templates.iter().enumerate() {
        let mut local = Vec::with_capacity(t.tensors.len());
        for d in &t.tensors {
            let id = *ids.entry(&d.key).or_insert_with(|| {
                infos.push(TensorInfo {
                    key: &d.key,
                    dtype: d.dtype,
                    shape: &d.global_shape,
                    dtypes: Vec::new(),
                    shapes: Vec::new(),
                    pieces: Vec::new(),
                });
                infos.len() - 1
            });
            note(&mut infos[id].dtypes, d.dtype, ti);
            note(&mut infos[id].shapes, d.global_shape.as_slice(), ti);
            local.push(id);
        }
        for (pi, p) in t.pieces.iter().enumerate() {
            infos[local[p.tensor as usize]].pieces.push((ti, pi));
        }
    }
    check_collisions(infos.iter().map(|i| i.key))?;
    infos.sort_by(|a, b| a.key.cmp(b.key));
    for info in &infos {
        if info.dtypes.len() > 1 {
            return Err(PlanError::Disagreement {
                key: info.key.clone(),
                what: "data type",
                variants: info
                    .dtypes
                    .iter()
                    .map(|(d, ts)| (d.to_string(), ranks_of_templates(w, ts)))
                    .collect(),
            });
        }
        if info.shapes.len() > 1 {
            return Err(PlanError::Disagreement {
                key: info.key.clone(),
                what: "global shape",
                variants: info
                    .shapes
                    .iter()
                    .map(|(s, ts)| (format!("{s:?}"), ranks_of_templates(w, ts)))
                    .collect(),
            });
        }
    }
    let (my_template, my_coords) = w.of_rank(me as usize).ok_or_else(|| LayoutDecodeError {
        rank: me as usize,
        at: 0,
        reason: "no description for this rank".into(),
    })?;

    // Step 2: regular tensors, validated per distinct combination of rules.
    let mut memo: HashMap<(Vec<u64>, Vec<Family>), usize> = HashMap::default();
    let mut tables: Vec<HashMap<u64, Holders>> = Vec::new();
    let mut plans: Vec<TensorPlan> = Vec::with_capacity(infos.len());
    let mut general: Vec<usize> = Vec::new();
    let mut held: Vec<Held> = Vec::new();
    let mut group_ids: HashMap<Vec<u32>, usize> = HashMap::default();
    let mut solo: Vec<(usize, u64, Region, u64)> = Vec::new();
    let mut flat_memo: FlatMemo = HashMap::default();
    // Holders tables already validated (validity depends on the table alone).
    let mut valid: HashSet<usize> = HashSet::new();
    let mut flat_sends: Vec<Transfer> = Vec::new();
    let mut flat_writes: Vec<ChunkWrite> = Vec::new();
    let mut flat_bytes: u64 = 0;
    for (ix, info) in infos.iter().enumerate() {
        if let Some(done) = plan_flat(
            w,
            info,
            ix,
            (me, my_template, &my_coords),
            opts,
            (&mut flat_memo, &mut tables, &mut valid),
        )? {
            plans.push(done.plan);
            flat_writes.extend(done.writes);
            flat_sends.extend(done.sends);
            flat_bytes += done.bytes;
            continue;
        }
        let Some((sizes, families)) = regular(w, info) else {
            general.push(ix);
            plans.push(placeholder(info));
            continue;
        };
        let n = part_counts(info.shape, &sizes);
        let chunk_shape: Vec<u64> = sizes
            .iter()
            .zip(&n)
            .zip(info.shape)
            .map(|((&s, &k), &d)| if k >= 2 { s } else { d.max(1) })
            .collect();
        let elem = info.dtype.size();
        // A grid that breaks a reader limit goes the general way, which chooses another
        // (or refuses the tensor, naming the limit).
        let Ok(subchunk_shape) = grid::checked_subchunk_shape(
            &chunk_shape,
            info.shape,
            elem,
            opts.grid.subchunk_target_bytes,
        ) else {
            general.push(ix);
            plans.push(placeholder(info));
            continue;
        };
        let key = (n.clone(), families);
        let table = match memo.get(&key) {
            Some(&m) => m,
            None => {
                let t = holders(w, &n, &key.1)?;
                tables.push(t);
                memo.insert(key.clone(), tables.len() - 1);
                tables.len() - 1
            }
        };
        let parts = &tables[table];
        let total: u128 = n.iter().map(|&k| u128::from(k)).product();
        let region_of = |l: u64| part_region(info.shape, &sizes, &unlinear(l, &n));
        if !valid.contains(&table) {
            validate_parts(info.key, info.shape, total, parts, &region_of)?;
            valid.insert(table);
        }
        // Part 0 is stored (`validate_parts` passed) unless the tensor has no parts (a
        // dimension of 0): then nothing is written and rank 0 writes the metadata.
        let metadata_writer = parts.get(&0).and_then(Holders::lowest).unwrap_or(0);
        plans.push(TensorPlan {
            key: info.key.clone(),
            dtype: info.dtype,
            global_shape: info.shape.to_vec(),
            chunk_shape,
            subchunk_shape,
            aligned: true,
            pieces: Vec::new(),
            metadata_writer,
        });
        // This rank's part, if it holds one that is stored.
        let Some(f) = key.1.iter().find(|f| f.template == my_template) else {
            continue;
        };
        let idx = pick_part(f, &my_coords);
        let l = linear(&idx, &n);
        let Some(h) = parts.get(&l) else { continue };
        if h.main.is_empty() && h.auto.is_empty() {
            continue;
        }
        let region = part_region(info.shape, &sizes, &idx);
        if region.is_empty() {
            continue;
        }
        // Invariant: a part lies inside its tensor, whose element count fits `u64`.
        let bytes = region
            .num_elements()
            .unwrap_or(0)
            .saturating_mul(elem as u64);
        let writer = if !opts.balance_replicas {
            // Invariant: parts with neither a main nor an auto holder were skipped above.
            Some(h.main.first().or(h.auto.first()).copied().unwrap_or(0))
        } else if h.single() {
            h.lowest()
        } else {
            None
        };
        match writer {
            Some(wr) if wr == me => solo.push((ix, l, region, bytes)),
            Some(_) => {}
            None => {
                let next = group_ids.len();
                let group = *group_ids.entry(h.all()).or_insert(next);
                held.push(Held {
                    tensor: ix,
                    part: l,
                    region,
                    bytes,
                    group,
                });
            }
        }
    }

    // Step 3: replicated parts, assigned within their holder group.
    let mut groups: Vec<Vec<u32>> = vec![Vec::new(); group_ids.len()];
    for (h, g) in group_ids {
        groups[g] = h;
    }
    held.sort_by(|a, b| {
        (a.group, std::cmp::Reverse(a.bytes), a.tensor, a.part).cmp(&(
            b.group,
            std::cmp::Reverse(b.bytes),
            b.tensor,
            b.part,
        ))
    });
    let mut load: HashMap<u32, u64> = HashMap::default();
    let mut current_group = usize::MAX;
    for h in held {
        if h.group != current_group {
            current_group = h.group;
            load.clear();
        }
        let writer = groups[h.group]
            .iter()
            .copied()
            // A rank given nothing yet carries 0 bytes.
            .min_by_key(|r| (load.get(r).copied().unwrap_or(0), *r))
            // Invariant: a group is the holders of a replicated part, at least two ranks.
            .unwrap_or(0);
        *load.entry(writer).or_default() += h.bytes;
        if writer == me {
            solo.push((h.tensor, h.part, h.region, h.bytes));
        }
    }

    // Step 4: the general planner for the other tensors.
    let mut tasks = RankTasks::default();
    let mut bytes: u64 = 0;
    if !general.is_empty() {
        let keys: HashSet<&TensorKey> = general.iter().map(|&i| infos[i].key).collect();
        let g = w.gathered(Some(&keys))?;
        let gp = SavePlan::build(&g, opts)?;
        let index: HashMap<&TensorKey, usize> =
            general.iter().map(|&i| (infos[i].key, i)).collect();
        let remap: Vec<usize> = gp.tensors.iter().map(|t| index[&t.key]).collect();
        let mut t = gp.tasks_for(me);
        for wr in &mut t.writes {
            wr.tensor = remap[wr.tensor];
        }
        for s in &mut t.sends {
            s.tensor = remap[s.tensor];
        }
        for m in &mut t.metadata {
            *m = remap[*m];
        }
        // Invariant: one entry per rank of the world, and `me` is one (`of_rank` above).
        bytes += gp.bytes_per_rank.get(me as usize).copied().unwrap_or(0);
        tasks = t;
        for (tp, &i) in gp.tensors.into_iter().zip(&remap) {
            plans[i] = tp;
        }
    }

    // Step 5: this rank's writes of regular tensors, in plan order.
    solo.sort_by_key(|a| (a.0, a.1));
    for (ti, l, region, b) in solo {
        let tp = &plans[ti];
        let n = part_counts(&tp.global_shape, &tp.chunk_shape);
        bytes += b;
        tasks.writes.push(ChunkWrite {
            tensor: ti,
            chunk: unlinear(l, &n),
            region: region.clone(),
            parts: vec![Part {
                region: region.clone(),
                source: Source::Local(region),
            }],
        });
    }
    bytes += flat_bytes;
    tasks.writes.extend(flat_writes);
    tasks.sends.extend(flat_sends);
    tasks
        .writes
        .sort_by(|a, b| (a.tensor, &a.chunk).cmp(&(b.tensor, &b.chunk)));
    // Per destination, sends go in the order the writer lists its remote parts: by tensor
    // (each rank sends parts of one chunk per tensor), boxes in order.
    tasks.sends.sort_by_key(|t| t.tensor);
    let mut is_general = vec![false; plans.len()];
    for &i in &general {
        is_general[i] = true;
    }
    for (ti, tp) in plans.iter().enumerate() {
        if tp.metadata_writer == me && !is_general[ti] {
            tasks.metadata.push(ti);
        }
    }
    tasks.metadata.sort_unstable();
    tasks.metadata.dedup();
    Ok(RankPlan {
        plan: SavePlan {
            tensors: plans,
            bytes_per_rank: Vec::new(),
        },
        tasks,
        bytes,
        general: general.len(),
    })
}

/// The shared reads of a load that rank `me` takes part in, from the world's description of
/// the requests (`w`) and the stored geometry of each tensor (`None`: not in the checkpoint).
///
/// Ranks that ask for the identical box of a regular tensor (data-parallel replicas, most of
/// all) form a read group: each box of each shard they need is read once, by the member with
/// the least bytes so far in that group (largest first), and sent to the others; each group is
/// cut into rounds of at most `round_bytes` on its own, identically on each member. Requests of
/// other tensors are planned by [`ExchangePlan::build`] on their instantiated layouts, in
/// rounds after the groups'. Requests marked `main` (converted) are read alone.
///
/// Returns the plan and the number of group rounds this rank takes part in (the caller agrees
/// on the largest).
///
/// # Errors
/// [`LayoutDecodeError`] for coordinates that do not fit their template.
pub fn plan_load(
    w: &World,
    me: u32,
    geometry: &dyn Fn(&TensorKey) -> Option<StoredGeometry>,
    round_bytes: u64,
) -> Result<(ExchangePlan, u32), LayoutDecodeError> {
    let Some((my_template, my_coords)) = w.of_rank(me as usize) else {
        return Err(LayoutDecodeError {
            rank: me as usize,
            at: 0,
            reason: "no description for this rank".into(),
        });
    };
    // Every requested tensor, with every template's pieces of it.
    let mine: HashSet<&TensorKey> = w.templates[my_template]
        .tensors
        .iter()
        .map(|d| &d.key)
        .collect();
    let mut infos: HashMap<&TensorKey, TensorInfo<'_>> = HashMap::default();
    for (ti, t) in w.templates.iter().enumerate() {
        for (pi, p) in t.pieces.iter().enumerate() {
            let d = &t.tensors[p.tensor as usize];
            let info = infos.entry(&d.key).or_insert_with(|| TensorInfo {
                key: &d.key,
                dtype: d.dtype,
                shape: &d.global_shape,
                dtypes: Vec::new(),
                shapes: Vec::new(),
                pieces: Vec::new(),
            });
            if !p.main {
                info.pieces.push((ti, pi));
            }
        }
    }
    let mut keys: Vec<&TensorKey> = infos.keys().copied().collect();
    keys.sort();
    // Tensors no regular grid describes, the same set on every rank.
    let mut general: HashSet<&TensorKey> = HashSet::new();
    let mut grids: HashMap<&TensorKey, (Vec<u64>, Vec<Family>)> = HashMap::default();
    let mut flats: HashMap<&TensorKey, (u64, Vec<FlatFamily>, usize)> = HashMap::default();
    let mut flat_memo: FlatMemo = HashMap::default();
    let mut tables: Vec<HashMap<u64, Holders>> = Vec::new();
    for &key in &keys {
        let info = &infos[key];
        if geometry(key).is_none_or(|g| g.global_shape.as_slice() != info.shape) {
            continue;
        }
        if let Some((size, families, table, _, _)) = flat_cut(w, info, &mut flat_memo, &mut tables)?
        {
            flats.insert(key, (size, families, table));
            continue;
        }
        match regular(w, info) {
            Some(r) => {
                grids.insert(key, r);
            }
            None => {
                general.insert(key);
            }
        }
    }
    keys.retain(|k| mine.contains(k) && (grids.contains_key(k) || flats.contains_key(k)));
    let mut memo: HashMap<(Vec<u64>, Vec<Family>), usize> = HashMap::default();
    let mut group_ids: HashMap<Vec<u32>, usize> = HashMap::default();
    let mut items: Vec<(usize, SharedRead)> = Vec::new();
    for key in keys {
        let info = &infos[key];
        let Some(geom) = geometry(key) else { continue };
        // The boxes this rank asks for, and who else asks for exactly them.
        let (regions, table, part) = if let Some((size, families, table)) = flats.get(key) {
            let Some(f) = families.iter().find(|f| f.template == my_template) else {
                continue;
            };
            // Invariant: a decoded shape's element count fits `u64` (`decode_tensors` checks it).
            let numel = crate::model::region::num_elements(info.shape).unwrap_or(0);
            let Some(l) = flat_pick(f, &my_coords, info.shape, *size, numel) else {
                continue;
            };
            (flat_part_boxes(info.shape, *size, l), *table, l)
        } else {
            let (sizes, families) = &grids[key];
            let Some(f) = families.iter().find(|f| f.template == my_template) else {
                continue;
            };
            let idx = pick_part(f, &my_coords);
            let n = part_counts(info.shape, sizes);
            let memo_key = (n.clone(), families.clone());
            let table = match memo.get(&memo_key) {
                Some(&m) => m,
                None => {
                    tables.push(holders(w, &n, families)?);
                    memo.insert(memo_key, tables.len() - 1);
                    tables.len() - 1
                }
            };
            let region = part_region(info.shape, sizes, &idx);
            (vec![region], table, linear(&idx, &n))
        };
        let Some(h) = tables[table].get(&part) else {
            continue;
        };
        if h.single() || h.lowest().is_none() {
            continue;
        }
        let next = group_ids.len();
        let ranks = h.all();
        let group = *group_ids.entry(ranks.clone()).or_insert(next);
        for region in regions.iter().filter(|r| !r.is_empty()) {
            let (lo, hi) = grid::chunks_overlapping(region, &geom.chunk_shape);
            grid::for_each_index(&lo, &hi, |c| {
                let chunk_box = grid::chunk_box(&geom.chunk_shape, c);
                if let Some(inner) = region.intersect(&chunk_box) {
                    // Invariant: inside a tensor whose element count fits `u64`.
                    let bytes = inner
                        .num_elements()
                        .unwrap_or(0)
                        .saturating_mul(geom.elem as u64);
                    items.push((
                        group,
                        SharedRead {
                            key: key.clone(),
                            chunk: c.to_vec(),
                            region: inner,
                            ranks: ranks.clone(),
                            reader: 0,
                            bytes,
                        },
                    ));
                }
            });
        }
    }
    // Readers: per group, largest first to the least-loaded member.
    items.sort_by(|(ga, a), (gb, b)| {
        (ga, std::cmp::Reverse(a.bytes), &a.key, &a.chunk, &a.region).cmp(&(
            gb,
            std::cmp::Reverse(b.bytes),
            &b.key,
            &b.chunk,
            &b.region,
        ))
    });
    let mut load: HashMap<u32, u64> = HashMap::default();
    let mut current = usize::MAX;
    for (g, r) in &mut items {
        if *g != current {
            current = *g;
            load.clear();
        }
        let reader = r
            .ranks
            .iter()
            .copied()
            // A rank given nothing yet carries 0 bytes.
            .min_by_key(|k| (load.get(k).copied().unwrap_or(0), *k))
            // Invariant: shared reads have at least two ranks (single holders are skipped).
            .unwrap_or(0);
        *load.entry(reader).or_default() += r.bytes;
        r.reader = reader;
    }
    // Rounds: per group, in (key, chunk, region) order.
    items.sort_by(|(ga, a), (gb, b)| {
        (ga, &a.key, &a.chunk, &a.region).cmp(&(gb, &b.key, &b.chunk, &b.region))
    });
    let mut reads = Vec::with_capacity(items.len());
    let mut rounds = Vec::with_capacity(items.len());
    let (mut current, mut round, mut acc) = (usize::MAX, 0u32, 0u64);
    let mut n_rounds = 0u32;
    for (g, r) in items {
        if g != current {
            (current, round, acc) = (g, 0, 0);
        } else if acc > 0 && acc + r.bytes > round_bytes {
            round += 1;
            acc = 0;
        }
        acc += r.bytes;
        n_rounds = n_rounds.max(round + 1);
        rounds.push(round);
        reads.push(r);
    }
    let mut plan = ExchangePlan {
        reads,
        bytes_per_rank: Vec::new(),
        round: rounds,
        general_from: 0,
        general_rounds: 0,
    };
    plan.general_from = plan.reads.len();
    // Other tensors: the general planner on their layouts (the same on every rank); their
    // rounds follow the groups'.
    if !general.is_empty() {
        let g = w.gathered(Some(&general))?;
        let gp = ExchangePlan::build(&g, |k| geometry(k));
        let rounds = gp.rounds(round_bytes);
        plan.general_rounds = rounds.len() as u32;
        for (ri, range) in rounds.into_iter().enumerate() {
            for r in &gp.reads[range] {
                if r.ranks.binary_search(&me).is_ok() {
                    plan.reads.push(r.clone());
                    plan.round.push(ri as u32);
                }
            }
        }
    }
    Ok((plan, n_rounds))
}

/// How one template's piece of a flat-regular tensor picks its part.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum FlatPick {
    /// `coords[slot]` (a flat rule).
    Slot(u32),
    /// Always this part (an explicit box that is one).
    Fixed(u64),
    /// A grid rule whose box must be one part (checked rank by rank).
    Grid(Vec<Axis>),
}

/// One template's piece of a flat-regular tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FlatFamily {
    template: usize,
    pick: FlatPick,
    main: bool,
    auto: bool,
}

/// The most parts one chunk of a flat-regular tensor gathers (its writer receives the others).
const FLAT_MAX_PARTS_PER_CHUNK: u64 = 64;

/// A tensor whose pieces are parts of one flat cut (at least one flat rule, every other piece
/// a box that may be such a part, at most one per rank): the part size and the families.
fn flat_regular(w: &World, info: &TensorInfo<'_>) -> Option<(u64, Vec<FlatFamily>)> {
    let mut size = None;
    for &(t, p) in &info.pieces {
        if let Rule::Flat { size: s, .. } = w.templates[t].pieces[p].rule {
            match size {
                None => size = Some(s),
                Some(x) if x == s => {}
                Some(_) => return None,
            }
        }
    }
    let size = size?;
    let numel = crate::model::region::num_elements(info.shape).ok()?;
    // Per template, its pieces of the tensor (in template order).
    let mut by_template: Vec<(usize, Vec<usize>)> = Vec::new();
    for &(t, p) in &info.pieces {
        match by_template.iter_mut().find(|(x, _)| *x == t) {
            Some((_, ps)) => ps.push(p),
            None => by_template.push((t, vec![p])),
        }
    }
    let mut families = Vec::with_capacity(by_template.len());
    for (t, ps) in by_template {
        let pieces: Vec<&super::rule::RulePiece> = ps
            .iter()
            .map(|&p| &w.templates[t].pieces[p])
            .filter(|p| !matches!(&p.rule, Rule::Box(r) if r.is_empty()))
            .collect();
        let Some(first) = pieces.first() else {
            continue;
        };
        if pieces
            .iter()
            .any(|p| p.main != first.main || p.auto != first.auto)
        {
            return None;
        }
        let pick = match &first.rule {
            _ if pieces.len() > 1 => {
                // Explicit boxes that together are one part (a last, shorter flat part whose
                // rank had no coordinate to name it by).
                let mut ranges = pieces
                    .iter()
                    .map(|p| match &p.rule {
                        Rule::Box(r) => crate::model::flat::box_flat_range(info.shape, r),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?;
                ranges.sort_by_key(|r| r.start);
                if ranges.windows(2).any(|x| x[0].end != x[1].start) {
                    return None;
                }
                let range = ranges[0].start..ranges[ranges.len() - 1].end;
                FlatPick::Fixed(flat_part(&range, size, numel)?)
            }
            Rule::Box(r) => {
                let range = crate::model::flat::box_flat_range(info.shape, r)?;
                FlatPick::Fixed(flat_part(&range, size, numel)?)
            }
            Rule::Flat { slot, .. } => FlatPick::Slot(*slot),
            Rule::Grid(axes) => FlatPick::Grid(axes.clone()),
        };
        families.push(FlatFamily {
            template: t,
            pick,
            main: first.main,
            auto: first.auto,
        });
    }
    Some((size, families))
}

/// The part index of a flat range that is one part of parts of `size`.
fn flat_part(range: &std::ops::Range<u64>, size: u64, numel: u64) -> Option<u64> {
    let len = range.end - range.start;
    (range.start.is_multiple_of(size) && (len == size || (range.end == numel && len < size)))
        .then(|| range.start / size)
}

/// The part a family's rank holds, or `None` when its box is not a part.
fn flat_pick(f: &FlatFamily, coords: &[u64], shape: &[u64], size: u64, numel: u64) -> Option<u64> {
    match &f.pick {
        FlatPick::Slot(s) => coords.get(*s as usize).copied(),
        FlatPick::Fixed(v) => Some(*v),
        FlatPick::Grid(axes) => {
            let r = super::rule::grid_region(axes, shape, coords)?;
            let range = crate::model::flat::box_flat_range(shape, &r)?;
            flat_part(&range, size, numel)
        }
    }
}

/// Who holds each part of a flat cut, or `None` when a grid piece is not a part.
fn flat_holders(
    w: &World,
    shape: &[u64],
    size: u64,
    families: &[FlatFamily],
) -> Result<Option<HashMap<u64, Holders>>, LayoutDecodeError> {
    // Invariant: a decoded shape's element count fits `u64` (`decode_tensors` checks it).
    let numel = crate::model::region::num_elements(shape).unwrap_or(0);
    let n = numel.div_ceil(size);
    let mut parts: HashMap<u64, Holders> = HashMap::default();
    let mut bad: Option<u32> = None;
    let mut irregular = false;
    for f in families {
        w.for_each_rank(f.template, |rank, coords| {
            match flat_pick(f, coords, shape, size, numel) {
                None => irregular = true,
                Some(i) if i >= n => {
                    bad.get_or_insert(rank);
                }
                Some(i) => {
                    parts.entry(i).or_default().add(rank, f.main, f.auto);
                }
            }
        })?;
    }
    if irregular {
        return Ok(None);
    }
    if let Some(rank) = bad {
        return Err(LayoutDecodeError {
            rank: rank as usize,
            at: 0,
            reason: "a flat part lies beyond its tensor".into(),
        });
    }
    parts.values_mut().for_each(Holders::finish);
    Ok(Some(parts))
}

/// A flat-regular tensor's cut: part size, families, holders table, rows and parts per chunk.
type FlatCut = (u64, Vec<FlatFamily>, usize, u64, u64);

/// Holders tables of flat cuts, memoized by (part size, shape, families); `None`: not
/// flat-regular.
type FlatMemo = HashMap<(u64, Vec<u64>, Vec<FlatFamily>), Option<usize>>;

/// What a rank does for one flat-regular tensor.
struct FlatDone {
    plan: TensorPlan,
    writes: Vec<ChunkWrite>,
    sends: Vec<Transfer>,
    bytes: u64,
}

/// The boxes of flat part `i` of parts of `size` (none beyond the tensor).
fn flat_part_boxes(shape: &[u64], size: u64, i: u64) -> Vec<Region> {
    // `None` only for a part beyond the tensor, which has no boxes.
    super::rule::flat_part_regions(shape, size, i).unwrap_or_default()
}

/// A flat-regular tensor's cut: part size, holders table (index into the tables), parts,
/// rows per chunk and parts per chunk; `None` when the tensor is not flat-regular or a chunk
/// would gather more than [`FLAT_MAX_PARTS_PER_CHUNK`] parts.
fn flat_cut(
    w: &World,
    info: &TensorInfo<'_>,
    memo: &mut FlatMemo,
    tables: &mut Vec<HashMap<u64, Holders>>,
) -> Result<Option<FlatCut>, LayoutDecodeError> {
    let shape = info.shape;
    if shape.len() < 2 {
        return Ok(None);
    }
    let Some((size, families)) = flat_regular(w, info) else {
        return Ok(None);
    };
    let row: u64 = shape[1..].iter().product();
    if row == 0 {
        return Ok(None);
    }
    let Some(lcm) = (size / grid::gcd(size, row)).checked_mul(row) else {
        return Ok(None);
    };
    let (rows, m) = (lcm / row, lcm / size);
    if m > FLAT_MAX_PARTS_PER_CHUNK {
        return Ok(None);
    }
    let key = (size, shape.to_vec(), families);
    let table = match memo.get(&key) {
        Some(&t) => t,
        None => {
            let t = flat_holders(w, shape, size, &key.2)?.map(|parts| {
                tables.push(parts);
                tables.len() - 1
            });
            memo.insert(key.clone(), t);
            t
        }
    };
    Ok(table.map(|t| (size, key.2, t, rows, m)))
}

/// Plans a flat-regular tensor (ZeRO / FSDP1 flat ranges cut inside rows): chunks of `R`
/// whole rows holding `m` whole parts (`R * row = lcm(size, row) = m * size`), written by the
/// writer of their first part, which receives the other parts. A part is written by its main
/// holder (else the lowest replicated holder).
fn plan_flat(
    w: &World,
    info: &TensorInfo<'_>,
    ix: usize,
    (me, my_template, my_coords): (u32, usize, &[u64]),
    opts: &SavePlanOptions,
    (memo, tables, valid): (
        &mut FlatMemo,
        &mut Vec<HashMap<u64, Holders>>,
        &mut HashSet<usize>,
    ),
) -> Result<Option<FlatDone>, PlanError> {
    let Some((size, families, table, rows, m)) = flat_cut(w, info, memo, tables)? else {
        return Ok(None);
    };
    let shape = info.shape;
    // Invariant: a decoded shape's element count fits `u64` (`decode_tensors` checks it).
    let numel = crate::model::region::num_elements(shape).unwrap_or(0);
    let parts = &tables[table];
    let n = numel.div_ceil(size);
    let region_of = |l: u64| {
        flat_part_boxes(shape, size, l)
            .into_iter()
            .next()
            .unwrap_or_else(|| Region::full(shape))
    };
    if !valid.contains(&table) {
        validate_parts(info.key, shape, u128::from(n), parts, &region_of)?;
        valid.insert(table);
    }
    let writer = |l: u64| {
        parts
            .get(&l)
            .and_then(|h| h.main.first().or(h.auto.first()).copied())
            // Invariant: asked only for parts below `n`, each of which has a main or auto
            // holder once `validate_parts` passed (or for part 0 of a tensor with no
            // elements, whose metadata rank 0 writes).
            .unwrap_or(0)
    };
    let elem = info.dtype.size();
    let mut chunk_shape = shape.to_vec();
    chunk_shape[0] = rows.min(shape[0]).max(1);
    // A grid that breaks a reader limit goes the general way (which chooses another or
    // refuses the tensor, naming the limit).
    let Ok(subchunk_shape) =
        grid::checked_subchunk_shape(&chunk_shape, shape, elem, opts.grid.subchunk_target_bytes)
    else {
        return Ok(None);
    };
    let mut done = FlatDone {
        plan: TensorPlan {
            key: info.key.clone(),
            dtype: info.dtype,
            global_shape: shape.to_vec(),
            chunk_shape: chunk_shape.clone(),
            subchunk_shape,
            aligned: false,
            pieces: Vec::new(),
            metadata_writer: writer(0),
        },
        writes: Vec::new(),
        sends: Vec::new(),
        bytes: 0,
    };
    let Some(f) = families.iter().find(|f| f.template == my_template) else {
        return Ok(Some(done));
    };
    let Some(l) = flat_pick(f, my_coords, shape, size, numel) else {
        return Ok(Some(done));
    };
    if writer(l) != me || !parts.contains_key(&l) {
        return Ok(Some(done));
    }
    let boxes = flat_part_boxes(shape, size, l);
    done.bytes = boxes
        .iter()
        // Invariant: inside a tensor whose element count fits `u64`.
        .map(|b| b.num_elements().unwrap_or(0))
        .sum::<u64>()
        .saturating_mul(elem as u64);
    let k = l / m;
    let wk = writer(k * m);
    if wk == me {
        let mut chunk = vec![0u64; shape.len()];
        chunk[0] = k;
        let region = grid::chunk_region(shape, &chunk_shape, &chunk);
        let mut chunk_parts = Vec::new();
        for j in k * m..((k + 1) * m).min(n) {
            let wj = writer(j);
            for b in flat_part_boxes(shape, size, j) {
                chunk_parts.push(Part {
                    region: b.clone(),
                    source: if wj == me {
                        Source::Local(b)
                    } else {
                        Source::Remote(wj)
                    },
                });
            }
        }
        done.writes.push(ChunkWrite {
            tensor: ix,
            chunk,
            region,
            parts: chunk_parts,
        });
    } else {
        for b in boxes {
            done.sends.push(Transfer {
                tensor: ix,
                to: wk,
                piece: b.clone(),
                region: b,
            });
        }
    }
    Ok(Some(done))
}
