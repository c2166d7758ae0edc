//! Layouts described by their rule, and the world's layouts combined without growing with the
//! world size.
//!
//! A rank's layout (the boxes it holds or asks for) is split into a **template**, shared by
//! every rank that follows the same rule, and a few **coordinates** of its own. A box that is
//! "part `i` of a regular grid of parts of `s` elements along an axis" (`torch.chunk` / DTensor
//! `Shard`, the last part possibly shorter) is described as `Split { size: s, slot }` where
//! coordinate `slot` holds `i`; an axis the box spans whole is `Full`; anything else stays an
//! explicit box. Fully sharded ranks (every rank its own part of every tensor) then share one
//! template and differ only in one coordinate.
//!
//! The world's layouts travel as a [`Summary`]: the distinct templates (by hash) and **runs**
//! of consecutive ranks with the same template whose coordinates follow
//! `base + slope * (k mod period)` for the `k`-th rank of the run. Summaries merge
//! (associatively and commutatively) in an all-reduce up a tree, so what a rank receives is the
//! size of the distinct rules, not of the world. Irregular layouts still work: each distinct
//! one is a template of its own, at the cost of its size.

use super::FastMap as HashMap;
use std::collections::{BTreeMap, HashSet};

use super::layout::{
    LayoutDecodeError, PieceDecl, RankLayout, Reader, TensorDecl, decode_tensors, encode_tensors,
    put_region, put_varint,
};
use crate::model::{Region, TensorKey};

/// How a piece of a template spans one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Axis {
    /// The whole axis.
    Full,
    /// Part `coords[slot]` of parts of `size` elements: `[i * size, min((i + 1) * size, dim))`.
    Split {
        /// Elements per part (the last part may be shorter).
        size: u64,
        /// The coordinate holding the part index.
        slot: u32,
    },
}

/// A piece of a template.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Rule {
    /// An explicit box, the same on every rank of the template.
    Box(Region),
    /// A part of a regular grid, per axis.
    Grid(Vec<Axis>),
    /// Part `coords[slot]` of the C-order flattening cut in parts of `size` elements
    /// (`[i * size, min((i + 1) * size, numel))`, the ZeRO / FSDP1 rule), held as the boxes of
    /// its decomposition (`crate::model::flat::flat_boxes`).
    Flat {
        /// Elements per part (the last part may be shorter).
        size: u64,
        /// The coordinate holding the part index.
        slot: u32,
    },
}

/// One piece of a template: a rule and the piece's flags (as in [`PieceDecl`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RulePiece {
    /// Index into [`Template::tensors`].
    pub tensor: u32,
    /// Where the piece lies.
    pub rule: Rule,
    /// Main replica (save) or read alone (load).
    pub main: bool,
    /// Replicated without an id.
    pub auto: bool,
}

/// What ranks following the same rule share.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Template {
    /// The tensors, each key at most once.
    pub tensors: Vec<TensorDecl>,
    /// The pieces.
    pub pieces: Vec<RulePiece>,
    /// Number of coordinates a rank following it has.
    pub slots: u32,
}

const TEMPLATE_MAGIC: &[u8; 5] = b"ZCKT1";
const SUMMARY_MAGIC: &[u8; 5] = b"ZCKS1";

/// The largest number of coordinates a template may use.
pub const MAX_SLOTS: u32 = 64;

impl Template {
    /// Describes a rank's layout: its template and its coordinates.
    ///
    /// Per piece and axis: a box spanning the axis is `Full`; a box of `n > 0` elements at an
    /// offset that is a multiple of `n` is part `offset / n` of parts of `n`; the last, shorter
    /// part of a split (ending at the tensor's end) is recognised when the rank already has a
    /// coordinate `i` with `offset = i * size` and the box no longer than `size`. Coordinates
    /// are the distinct part indices in order of first appearance (at most [`MAX_SLOTS`]);
    /// other pieces stay explicit boxes.
    #[must_use]
    pub fn describe(layout: &RankLayout) -> (Template, Vec<u64>) {
        let mut coords: Vec<u64> = Vec::new();
        let mut slot_of: HashMap<u64, u32> = HashMap::default();
        let mut pieces: Vec<Option<RulePiece>> = Vec::with_capacity(layout.pieces.len());
        // Flat ranges held as several boxes: one flat rule each, when the range is part
        // `start / len` of parts of its length.
        let flat = flat_runs(layout);
        let mut skip = 0usize;
        // First pass: whole parts.
        for (k, p) in layout.pieces.iter().enumerate() {
            if skip > 0 {
                skip -= 1;
                pieces.push(None);
                continue;
            }
            if let Some(&(n_boxes, ref range)) = flat.get(&k) {
                let len = range.end - range.start;
                if range.start.is_multiple_of(len)
                    && let Some(slot) = slot_for(range.start / len, &mut coords, &mut slot_of)
                {
                    skip = n_boxes - 1;
                    pieces.push(Some(RulePiece {
                        tensor: p.tensor,
                        rule: Rule::Flat { size: len, slot },
                        main: p.main,
                        auto: p.auto,
                    }));
                    continue;
                }
                // Not a whole part: left to the second pass, as one range.
                skip = n_boxes - 1;
                pieces.push(None);
                continue;
            }
            // A single box inside one row (or slab) that is a whole part of a flat cut:
            // described as that part, as a flat range of the same length elsewhere would be.
            let shape = &layout.tensors[p.tensor as usize].global_shape;
            if let Some(range) = partial_row_range(shape, &p.region) {
                let len = range.end - range.start;
                // Invariant: a declared shape's element count fits `u64` (checked when the
                // layout is built); 0 would only forgo the flat rule, never misdescribe.
                let numel = crate::model::region::num_elements(shape).unwrap_or(0);
                if range.start.is_multiple_of(len)
                    && range.end < numel
                    && let Some(slot) = slot_for(range.start / len, &mut coords, &mut slot_of)
                {
                    pieces.push(Some(RulePiece {
                        tensor: p.tensor,
                        rule: Rule::Flat { size: len, slot },
                        main: p.main,
                        auto: p.auto,
                    }));
                    continue;
                }
            }
            let shape = &layout.tensors[p.tensor as usize].global_shape;
            let mut axes = Vec::with_capacity(shape.len());
            let mut ok = !p.region.is_empty();
            for (a, &dim) in shape.iter().enumerate() {
                if !ok {
                    break;
                }
                let (o, n) = (p.region.offset()[a], p.region.shape()[a]);
                if o == 0 && n == dim {
                    axes.push(Axis::Full);
                } else if n > 0 && o % n == 0 && o + n <= dim {
                    let Some(slot) = slot_for(o / n, &mut coords, &mut slot_of) else {
                        ok = false;
                        break;
                    };
                    axes.push(Axis::Split { size: n, slot });
                } else {
                    ok = false;
                }
            }
            pieces.push(ok.then_some(RulePiece {
                tensor: p.tensor,
                rule: Rule::Grid(axes),
                main: p.main,
                auto: p.auto,
            }));
        }
        // Second pass: last, shorter parts, from the coordinates found.
        let mut out = Vec::with_capacity(pieces.len());
        let mut k = 0;
        while k < layout.pieces.len() {
            let p = &layout.pieces[k];
            if let Some(done) = pieces[k].take() {
                let boxes = match done.rule {
                    Rule::Flat { .. } => flat.get(&k).map_or(1, |f| f.0),
                    _ => 1,
                };
                out.push(done);
                k += boxes;
                continue;
            }
            let shape = &layout.tensors[p.tensor as usize].global_shape;
            if let Some(&(n_boxes, ref range)) = flat.get(&k) {
                match last_flat_part(range, shape, &coords) {
                    Some(rule) => out.push(RulePiece {
                        tensor: p.tensor,
                        rule,
                        main: p.main,
                        auto: p.auto,
                    }),
                    // Explicit boxes, which planning may still recognise as one part.
                    None => out.extend(layout.pieces[k..k + n_boxes].iter().map(|q| RulePiece {
                        tensor: q.tensor,
                        rule: Rule::Box(q.region.clone()),
                        main: q.main,
                        auto: q.auto,
                    })),
                }
                k += n_boxes;
                continue;
            }
            let rule = last_part(&p.region, shape, &coords)
                .map_or_else(|| Rule::Box(p.region.clone()), Rule::Grid);
            out.push(RulePiece {
                tensor: p.tensor,
                rule,
                main: p.main,
                auto: p.auto,
            });
            k += 1;
        }
        let pieces = out;
        let t = Template {
            tensors: layout.tensors.clone(),
            pieces,
            slots: coords.len() as u32,
        };
        (t, coords)
    }

    /// The boxes of piece `p` for a rank with these coordinates (one, or the decomposition of
    /// a flat part), or `None` when a part index lies beyond the tensor.
    #[must_use]
    pub fn regions_of(&self, p: &RulePiece, coords: &[u64]) -> Option<Vec<Region>> {
        let shape = &self.tensors[p.tensor as usize].global_shape;
        match &p.rule {
            Rule::Box(r) => Some(vec![r.clone()]),
            Rule::Flat { size, slot } => {
                flat_part_regions(shape, *size, *coords.get(*slot as usize)?)
            }
            Rule::Grid(axes) => grid_region(axes, shape, coords).map(|r| vec![r]),
        }
    }

    /// The layout of a rank with these coordinates (the inverse of [`Template::describe`]).
    ///
    /// # Errors
    /// When the coordinates are not as many as the slots, or put a part beyond its tensor.
    pub fn instantiate(
        &self,
        coords: &[u64],
        rank: usize,
    ) -> Result<RankLayout, LayoutDecodeError> {
        let err = |reason: String| LayoutDecodeError {
            rank,
            at: 0,
            reason,
        };
        if coords.len() != self.slots as usize {
            return Err(err(format!(
                "{} coordinates for a template of {} slots",
                coords.len(),
                self.slots
            )));
        }
        let mut pieces = Vec::with_capacity(self.pieces.len());
        for p in &self.pieces {
            let regions = self.regions_of(p, coords).ok_or_else(|| {
                err(format!(
                    "coordinates {coords:?} put a part of `{}` beyond its shape",
                    self.tensors[p.tensor as usize].key
                ))
            })?;
            for region in regions {
                pieces.push(PieceDecl {
                    tensor: p.tensor,
                    region,
                    main: p.main,
                    auto: p.auto,
                });
            }
        }
        Ok(RankLayout {
            tensors: self.tensors.clone(),
            pieces,
        })
    }

    /// Encodes the template as bytes.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.pieces.len() * 8);
        out.extend_from_slice(TEMPLATE_MAGIC);
        encode_tensors(&mut out, &self.tensors);
        put_varint(&mut out, u64::from(self.slots));
        put_varint(&mut out, self.pieces.len() as u64);
        for p in &self.pieces {
            put_varint(&mut out, u64::from(p.tensor));
            let flags = u8::from(p.main) | (u8::from(p.auto) << 1);
            match &p.rule {
                Rule::Box(r) => {
                    out.push(flags);
                    put_region(&mut out, r);
                }
                Rule::Flat { size, slot } => {
                    out.push(flags | 8);
                    put_varint(&mut out, *size);
                    put_varint(&mut out, u64::from(*slot));
                }
                Rule::Grid(axes) => {
                    out.push(flags | 4);
                    for ax in axes {
                        match *ax {
                            Axis::Full => put_varint(&mut out, 0),
                            Axis::Split { size, slot } => {
                                put_varint(&mut out, size);
                                put_varint(&mut out, u64::from(slot));
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Decodes and validates a template sent by `rank` (or by the group `rank` is the lowest
    /// rank of): keys, data types, shapes, boxes inside their tensors, slots in range.
    ///
    /// # Errors
    /// [`LayoutDecodeError`] for anything malformed; never panics on any input.
    pub fn decode(bytes: &[u8], rank: usize) -> Result<Self, LayoutDecodeError> {
        let mut r = Reader::after_magic(bytes, rank, TEMPLATE_MAGIC, "template magic")?;
        let tensors = decode_tensors(&mut r)?;
        let slots = r.varint()?;
        if slots > u64::from(MAX_SLOTS) {
            return Err(r.err("too many coordinate slots"));
        }
        let slots = slots as u32;
        let n_pieces = r.count(2)?;
        let mut pieces = Vec::with_capacity(n_pieces);
        for _ in 0..n_pieces {
            let t = r.varint()?;
            let t = u32::try_from(t).map_err(|_| r.err("tensor index too large"))?;
            let decl = tensors
                .get(t as usize)
                .ok_or_else(|| r.err("tensor index out of range"))?;
            let flags = r.take(1)?[0];
            if flags & !12 > 2 || flags & 12 == 12 {
                return Err(r.err("unknown piece flags"));
            }
            let nd = decl.global_shape.len();
            let rule = if flags & 8 != 0 {
                let size = r.varint()?;
                let slot = r.varint()?;
                if size == 0 || slot >= u64::from(slots) {
                    return Err(r.err("bad flat rule"));
                }
                Rule::Flat {
                    size,
                    slot: slot as u32,
                }
            } else if flags & 4 == 0 {
                Rule::Box(r.region_within(&decl.global_shape)?)
            } else {
                let mut axes = Vec::with_capacity(nd);
                for _ in 0..nd {
                    let size = r.varint()?;
                    if size == 0 {
                        axes.push(Axis::Full);
                    } else {
                        let slot = r.varint()?;
                        if slot >= u64::from(slots) {
                            return Err(r.err("coordinate slot out of range"));
                        }
                        axes.push(Axis::Split {
                            size,
                            slot: slot as u32,
                        });
                    }
                }
                Rule::Grid(axes)
            };
            pieces.push(RulePiece {
                tensor: t,
                rule,
                main: flags & 1 == 1,
                auto: flags & 2 == 2,
            });
        }
        if r.pos != bytes.len() {
            return Err(r.err("trailing bytes"));
        }
        Ok(Template {
            tensors,
            pieces,
            slots,
        })
    }
}

/// The flat range of a non-empty box that lies inside one row of a tensor of two or more
/// dimensions without spanning it (a part of a flat cut finer than a row), if it is one.
fn partial_row_range(shape: &[u64], region: &Region) -> Option<std::ops::Range<u64>> {
    let last = shape.len().checked_sub(1).filter(|&l| l >= 1)?;
    if region.shape()[last] >= shape[last] || region.shape()[..last].iter().any(|&e| e != 1) {
        return None;
    }
    crate::model::flat::box_flat_range(shape, region)
}

/// The boxes of part `i` of a tensor of `shape` whose flattening is cut in parts of `size`
/// elements, or `None` when the part starts beyond the tensor.
#[must_use]
pub fn flat_part_regions(shape: &[u64], size: u64, i: u64) -> Option<Vec<Region>> {
    let n = crate::model::region::num_elements(shape).ok()?;
    let a = i.checked_mul(size).filter(|&a| a < n)?;
    let b = a.saturating_add(size).min(n);
    let boxes = crate::model::flat::flat_boxes(shape, a..b).ok()?;
    Some(boxes.into_iter().map(|f| f.region).collect())
}

/// The box of a grid rule for a rank with these coordinates, or `None` when a part index lies
/// beyond the tensor.
#[must_use]
pub fn grid_region(axes: &[Axis], shape: &[u64], coords: &[u64]) -> Option<Region> {
    let mut offset = Vec::with_capacity(axes.len());
    let mut extent = Vec::with_capacity(axes.len());
    for (ax, &dim) in axes.iter().zip(shape) {
        match *ax {
            Axis::Full => {
                offset.push(0);
                extent.push(dim);
            }
            Axis::Split { size, slot } => {
                let i = *coords.get(slot as usize)?;
                let o = i.checked_mul(size).filter(|&o| o < dim)?;
                offset.push(o);
                extent.push(size.min(dim - o));
            }
        }
    }
    // Inside the tensor: every offset < dim and extent <= dim - offset.
    Some(Region::from_parts_unchecked(offset, extent))
}

/// The coordinate slot holding `i`, adding one when there is room.
fn slot_for(i: u64, coords: &mut Vec<u64>, slot_of: &mut HashMap<u64, u32>) -> Option<u32> {
    if let Some(&s) = slot_of.get(&i) {
        return Some(s);
    }
    if coords.len() as u32 >= MAX_SLOTS {
        return None;
    }
    let s = coords.len() as u32;
    coords.push(i);
    slot_of.insert(i, s);
    Some(s)
}

/// Runs of consecutive pieces (same tensor and flags, at least two) that are exactly the box
/// decomposition of one flat range: first piece's index -> (number of boxes, range).
fn flat_runs(layout: &RankLayout) -> HashMap<usize, (usize, std::ops::Range<u64>)> {
    use crate::model::flat::{box_flat_range, flat_boxes};
    let mut out = HashMap::default();
    let ps = &layout.pieces;
    let mut k = 0;
    while k < ps.len() {
        let p = &ps[k];
        let shape = &layout.tensors[p.tensor as usize].global_shape;
        let max = 2 * shape.len();
        let mut found = None;
        if let Some(first) = box_flat_range(shape, &p.region) {
            let mut end = first.end;
            let mut j = k + 1;
            while j < ps.len() && j - k < max {
                let q = &ps[j];
                if q.tensor != p.tensor || q.main != p.main || q.auto != p.auto {
                    break;
                }
                match box_flat_range(shape, &q.region) {
                    Some(r) if r.start == end => end = r.end,
                    _ => break,
                }
                j += 1;
                let range = first.start..end;
                if flat_boxes(shape, range.clone()).is_ok_and(|b| {
                    b.len() == j - k && b.iter().zip(&ps[k..j]).all(|(b, q)| b.region == q.region)
                }) {
                    found = Some((j - k, range));
                }
            }
        }
        match found {
            Some((n, range)) => {
                out.insert(k, (n, range));
                k += n;
            }
            None => k += 1,
        }
    }
    out
}

/// The last, shorter part of a flat cut, from a coordinate the rank already has.
fn last_flat_part(range: &std::ops::Range<u64>, shape: &[u64], coords: &[u64]) -> Option<Rule> {
    let n = crate::model::region::num_elements(shape).ok()?;
    let len = range.end - range.start;
    if range.end != n {
        return None;
    }
    coords.iter().enumerate().find_map(|(slot, &i)| {
        if i == 0 || !range.start.is_multiple_of(i) {
            return None;
        }
        let size = range.start / i;
        (size >= len).then_some(Rule::Flat {
            size,
            slot: slot as u32,
        })
    })
}

/// The last, shorter part of a split along each axis where the box is not a whole part:
/// the grid rule when every such axis matches a coordinate the rank already has.
fn last_part(region: &Region, shape: &[u64], coords: &[u64]) -> Option<Vec<Axis>> {
    if region.is_empty() {
        return None;
    }
    let mut axes = Vec::with_capacity(shape.len());
    for (a, &dim) in shape.iter().enumerate() {
        let (o, n) = (region.offset()[a], region.shape()[a]);
        if o == 0 && n == dim {
            axes.push(Axis::Full);
            continue;
        }
        let found = coords.iter().enumerate().find_map(|(slot, &i)| {
            if i == 0 || o % i != 0 {
                return None;
            }
            let size = o / i;
            (size >= n && o + n == dim).then_some(Axis::Split {
                size,
                slot: slot as u32,
            })
        });
        // A whole part (first pass) whose index was not taken (slots were full) fails here too.
        axes.push(found?);
    }
    Some(axes)
}

/// Consecutive ranks with one template whose coordinates follow a pattern: rank
/// `start + k` (`k < count`) has coordinate `j` equal to `base[j] + slope[j] * (k % period)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// First rank.
    pub start: u64,
    /// Number of ranks.
    pub count: u64,
    /// Index into [`Summary::templates`].
    pub template: u32,
    /// `period` in `1..=count`.
    pub period: u64,
    /// Per coordinate: base and slope.
    pub coords: Vec<(u64, i64)>,
}

impl Run {
    /// The coordinates of the `k`-th rank of the run.
    fn coords_at(&self, k: u64) -> Option<Vec<u64>> {
        let k = k % self.period.max(1);
        self.coords
            .iter()
            .map(|&(b, s)| {
                let v = i128::from(b) + i128::from(s) * i128::from(k);
                u64::try_from(v).ok()
            })
            .collect()
    }

    /// True when the coordinates are affine in `k` over the whole run (no repetition).
    fn affine(&self) -> bool {
        self.period == self.count || self.coords.iter().all(|c| c.1 == 0)
    }

    fn canonical(mut self) -> Run {
        if self.count <= 1 || self.coords.iter().all(|c| c.1 == 0) {
            self.period = 1;
            for c in &mut self.coords {
                c.1 = 0;
            }
        }
        self
    }

    /// `self` followed by `next` (the ranks right after it, same template) as one run, when
    /// their coordinates continue one pattern.
    fn join(&self, next: &Run) -> Option<Run> {
        if self.template != next.template
            || self.coords.len() != next.coords.len()
            || self.start.checked_add(self.count) != Some(next.start)
        {
            return None;
        }
        let count = self.count.checked_add(next.count)?;
        // Affine continuation: the pattern goes on without repeating.
        if self.affine() && next.affine() {
            let mut coords = Vec::with_capacity(self.coords.len());
            let mut ok = true;
            for (&(a, sa), &(b, sb)) in self.coords.iter().zip(&next.coords) {
                let slope = if self.count >= 2 {
                    sa
                } else if next.count >= 2 {
                    sb
                } else {
                    match i64::try_from(i128::from(b) - i128::from(a)) {
                        Ok(s) => s,
                        Err(_) => {
                            ok = false;
                            break;
                        }
                    }
                };
                let want = i128::from(a) + i128::from(slope) * i128::from(self.count);
                if want != i128::from(b) || (next.count >= 2 && sb != slope) {
                    ok = false;
                    break;
                }
                coords.push((a, slope));
            }
            if ok {
                return Some(
                    Run {
                        start: self.start,
                        count,
                        template: self.template,
                        period: count,
                        coords,
                    }
                    .canonical(),
                );
            }
        }
        // Repetition: `next` goes on with `self`'s period (checked rank by rank when short,
        // else only when it starts a new period with the same pattern).
        let p = self.period;
        let repeats = if next.count <= 64 {
            (0..next.count).all(|k| {
                let want = self.coords_at(self.count + k);
                want.is_some() && next.coords_at(k) == want
            })
        } else {
            self.count.is_multiple_of(p) && next.period == p && next.coords == self.coords
        };
        if repeats {
            return Some(
                Run {
                    start: self.start,
                    count,
                    template: self.template,
                    period: p,
                    coords: self.coords.clone(),
                }
                .canonical(),
            );
        }
        None
    }
}

/// The combined description of a set of ranks: distinct templates and runs of ranks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Distinct templates (encoded), sorted by hash.
    pub templates: Vec<([u8; 16], Vec<u8>)>,
    /// Runs, sorted by first rank, disjoint.
    pub runs: Vec<Run>,
}

/// A 128-bit hash of an encoded template.
#[must_use]
pub fn template_hash(encoded: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128(encoded).to_le_bytes()
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

impl Summary {
    /// The summary of one rank.
    #[must_use]
    pub fn leaf(rank: u64, template: Vec<u8>, coords: &[u64]) -> Summary {
        Summary {
            templates: vec![(template_hash(&template), template)],
            runs: vec![Run {
                start: rank,
                count: 1,
                template: 0,
                period: 1,
                coords: coords.iter().map(|&c| (c, 0)).collect(),
            }],
        }
    }

    /// Encodes the summary as bytes.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(SUMMARY_MAGIC);
        put_varint(&mut out, self.templates.len() as u64);
        for (h, t) in &self.templates {
            out.extend_from_slice(h);
            put_varint(&mut out, t.len() as u64);
            out.extend_from_slice(t);
        }
        put_varint(&mut out, self.runs.len() as u64);
        for r in &self.runs {
            put_varint(&mut out, r.start);
            put_varint(&mut out, r.count);
            put_varint(&mut out, u64::from(r.template));
            put_varint(&mut out, r.period);
            put_varint(&mut out, r.coords.len() as u64);
            for &(b, s) in &r.coords {
                put_varint(&mut out, b);
                put_varint(&mut out, zigzag(s));
            }
        }
        out
    }

    /// Decodes a summary (`rank`: who sent it, for errors). Checks the framing, that every
    /// template matches its hash, that runs are sorted, disjoint and name a template, but not
    /// the templates' contents (see [`Template::decode`]).
    ///
    /// # Errors
    /// [`LayoutDecodeError`] for anything malformed; never panics on any input.
    pub fn decode(bytes: &[u8], rank: usize) -> Result<Summary, LayoutDecodeError> {
        let mut r = Reader::after_magic(bytes, rank, SUMMARY_MAGIC, "summary magic")?;
        let n = r.count(17)?;
        let mut templates: Vec<([u8; 16], Vec<u8>)> = Vec::with_capacity(n);
        for _ in 0..n {
            let h: [u8; 16] = r.take(16)?.try_into().map_err(|_| r.err("truncated"))?;
            let len = r.count(1)?;
            let t = r.take(len)?.to_vec();
            if template_hash(&t) != h {
                return Err(r.err("template does not match its hash"));
            }
            if templates.last().is_some_and(|(p, _)| *p >= h) {
                return Err(r.err("templates not sorted by hash"));
            }
            templates.push((h, t));
        }
        let n = r.count(5)?;
        let mut runs: Vec<Run> = Vec::with_capacity(n);
        for _ in 0..n {
            let start = r.varint()?;
            let count = r.varint()?;
            let template = r.varint()?;
            let period = r.varint()?;
            let nc = r.count(2)?;
            let coords = (0..nc)
                .map(|_| Ok((r.varint()?, unzigzag(r.varint()?))))
                .collect::<Result<Vec<_>, LayoutDecodeError>>()?;
            if count == 0 || period == 0 || period > count {
                return Err(r.err("run with no ranks or a bad period"));
            }
            if template >= templates.len() as u64 {
                return Err(r.err("run names no template"));
            }
            start
                .checked_add(count)
                .ok_or_else(|| r.err("run overflows"))?;
            if runs.last().is_some_and(|p| p.start + p.count > start) {
                return Err(r.err("runs overlap or are not sorted"));
            }
            runs.push(Run {
                start,
                count,
                template: template as u32,
                period,
                coords,
            });
        }
        if r.pos != bytes.len() {
            return Err(r.err("trailing bytes"));
        }
        Ok(Summary { templates, runs })
    }

    /// The union of two summaries of disjoint sets of ranks (associative and commutative).
    ///
    /// # Errors
    /// When both describe the same rank.
    pub fn merge(&self, other: &Summary) -> Result<Summary, String> {
        let mut by_hash: BTreeMap<[u8; 16], &Vec<u8>> = BTreeMap::new();
        for (h, t) in self.templates.iter().chain(&other.templates) {
            by_hash.insert(*h, t);
        }
        let index: HashMap<[u8; 16], u32> = by_hash
            .keys()
            .enumerate()
            .map(|(i, h)| (*h, i as u32))
            .collect();
        let remap = |s: &Summary, r: &Run| {
            let mut r = r.clone();
            r.template = index[&s.templates[r.template as usize].0];
            r
        };
        let mut runs: Vec<Run> = Vec::with_capacity(self.runs.len() + other.runs.len());
        let (mut i, mut j) = (0, 0);
        loop {
            let next = match (self.runs.get(i), other.runs.get(j)) {
                (Some(x), Some(y)) if x.start <= y.start => {
                    i += 1;
                    remap(self, x)
                }
                (_, Some(y)) => {
                    j += 1;
                    remap(other, y)
                }
                (Some(x), None) => {
                    i += 1;
                    remap(self, x)
                }
                (None, None) => break,
            };
            if let Some(last) = runs.last_mut() {
                if last.start + last.count > next.start {
                    return Err(format!("rank {} described twice", next.start));
                }
                if let Some(j) = last.join(&next) {
                    *last = j;
                    continue;
                }
            }
            runs.push(next);
        }
        Ok(Summary {
            templates: by_hash.into_iter().map(|(h, t)| (h, t.clone())).collect(),
            runs,
        })
    }

    /// [`Summary::merge`] on encoded summaries, for [`crate::Communicator::all_reduce`].
    ///
    /// # Errors
    /// When either does not decode or both describe the same rank.
    pub fn merge_encoded(a: &[u8], b: &[u8]) -> Result<Vec<u8>, String> {
        let a = Summary::decode(a, 0).map_err(|e| e.to_string())?;
        let b = Summary::decode(b, 0).map_err(|e| e.to_string())?;
        Ok(a.merge(&b)?.encode())
    }
}

/// The layouts of the whole world, decoded from a complete [`Summary`].
#[derive(Debug, Clone)]
pub struct World {
    /// Distinct templates.
    pub templates: Vec<Template>,
    /// Runs of ranks, sorted, covering `0..size` exactly.
    pub runs: Vec<Run>,
    /// Number of ranks.
    pub size: usize,
    /// Per template, the indices of its runs.
    pub runs_of: Vec<Vec<usize>>,
}

impl World {
    /// Decodes and checks a summary of every rank of a world of `size` ranks.
    ///
    /// # Errors
    /// [`LayoutDecodeError`] (naming the lowest rank concerned) for a malformed template,
    /// runs that do not cover every rank exactly once, or coordinates that do not fit their
    /// template.
    pub fn from_summary(s: &Summary, size: usize) -> Result<World, LayoutDecodeError> {
        let mut runs_of: Vec<Vec<usize>> = vec![Vec::new(); s.templates.len()];
        let mut next = 0u64;
        for (i, r) in s.runs.iter().enumerate() {
            if r.start != next {
                return Err(LayoutDecodeError {
                    rank: crate::model::usize_of(next),
                    at: 0,
                    reason: "no description for this rank".into(),
                });
            }
            // `Summary`'s fields are public: a summary built by hand (not by `decode`, which
            // checks both) may name a missing template or run past `u64`.
            next = r
                .start
                .checked_add(r.count)
                .filter(|&n| n <= size as u64)
                .ok_or_else(|| LayoutDecodeError {
                    rank: crate::model::usize_of(r.start),
                    at: 0,
                    reason: format!(
                        "a run of {} ranks from rank {} leaves a world of {size}",
                        r.count, r.start
                    ),
                })?;
            let Some(of) = runs_of.get_mut(r.template as usize) else {
                return Err(LayoutDecodeError {
                    rank: crate::model::usize_of(r.start),
                    at: 0,
                    reason: format!("run names template {}, which is absent", r.template),
                });
            };
            of.push(i);
        }
        if next != size as u64 {
            return Err(LayoutDecodeError {
                rank: crate::model::usize_of(next.min(size as u64)),
                at: 0,
                reason: format!("descriptions cover {next} ranks of {size}"),
            });
        }
        let mut templates = Vec::with_capacity(s.templates.len());
        for (ti, (_, bytes)) in s.templates.iter().enumerate() {
            let lowest = runs_of[ti]
                .first()
                .map_or(0, |&i| crate::model::usize_of(s.runs[i].start));
            let t = Template::decode(bytes, lowest)?;
            for &i in &runs_of[ti] {
                let r = &s.runs[i];
                if r.coords.len() != t.slots as usize {
                    return Err(LayoutDecodeError {
                        rank: crate::model::usize_of(r.start),
                        at: 0,
                        reason: format!(
                            "{} coordinates for a template of {} slots",
                            r.coords.len(),
                            t.slots
                        ),
                    });
                }
            }
            templates.push(t);
        }
        Ok(World {
            templates,
            runs: s.runs.clone(),
            size,
            runs_of,
        })
    }

    /// Calls `f(rank, coords)` for every rank of template `t`, in rank order.
    ///
    /// # Errors
    /// When a rank's coordinates leave `u64`.
    pub fn for_each_rank(
        &self,
        t: usize,
        mut f: impl FnMut(u32, &[u64]),
    ) -> Result<(), LayoutDecodeError> {
        for &i in &self.runs_of[t] {
            let r = &self.runs[i];
            for k in 0..r.count {
                let c = r.coords_at(k).ok_or_else(|| LayoutDecodeError {
                    rank: crate::model::usize_of(r.start + k),
                    at: 0,
                    reason: "coordinates out of range".into(),
                })?;
                f(u32::try_from(r.start + k).unwrap_or(u32::MAX), &c);
            }
        }
        Ok(())
    }

    /// The template and coordinates of `rank`.
    #[must_use]
    pub fn of_rank(&self, rank: usize) -> Option<(usize, Vec<u64>)> {
        let rank = rank as u64;
        let i = self.runs.partition_point(|r| r.start + r.count <= rank);
        let r = self.runs.get(i).filter(|r| r.start <= rank)?;
        Some((r.template as usize, r.coords_at(rank - r.start)?))
    }

    /// Up to 8 of the lowest ranks following template `t`.
    #[must_use]
    pub fn some_ranks(&self, t: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for &i in &self.runs_of[t] {
            let r = &self.runs[i];
            for k in 0..r.count.min(8) {
                out.push(u32::try_from(r.start + k).unwrap_or(u32::MAX));
            }
            if out.len() >= 8 {
                break;
            }
        }
        out.truncate(8);
        out
    }

    /// Every rank's layout (restricted to `keys` when given), de-duplicated: the general (and
    /// costly) view, for tensors no rule describes and for tests.
    ///
    /// # Errors
    /// When a rank's coordinates do not fit its template.
    pub fn gathered(
        &self,
        keys: Option<&HashSet<&TensorKey>>,
    ) -> Result<super::GatheredLayouts, LayoutDecodeError> {
        let w = self;
        let mut unique: Vec<RankLayout> = Vec::new();
        let mut ranks: Vec<Vec<u32>> = Vec::new();
        let mut of_rank = vec![0u32; w.size];
        let mut index: HashMap<RankLayout, u32> = HashMap::default();
        for (ti, t) in w.templates.iter().enumerate() {
            let wanted: Vec<bool> = t
                .tensors
                .iter()
                .map(|d| keys.is_none_or(|k| k.contains(&d.key)))
                .collect();
            let mut err = None;
            w.for_each_rank(ti, |rank, coords| {
                if err.is_some() {
                    return;
                }
                let mut l = RankLayout::default();
                let mut new_id: HashMap<u32, u32> = HashMap::default();
                for p in &t.pieces {
                    if !wanted[p.tensor as usize] {
                        continue;
                    }
                    let Some(regions) = t.regions_of(p, coords) else {
                        err = Some(LayoutDecodeError {
                            rank: rank as usize,
                            at: 0,
                            reason: "a part index lies beyond its tensor".into(),
                        });
                        return;
                    };
                    let id = *new_id.entry(p.tensor).or_insert_with(|| {
                        l.tensors.push(t.tensors[p.tensor as usize].clone());
                        (l.tensors.len() - 1) as u32
                    });
                    for region in regions {
                        l.pieces.push(PieceDecl {
                            tensor: id,
                            region,
                            main: p.main,
                            auto: p.auto,
                        });
                    }
                }
                // Tensors declared without pieces still take part in the agreement on type and shape.
                for (i, d) in t.tensors.iter().enumerate() {
                    if wanted[i] && !new_id.contains_key(&(i as u32)) {
                        l.tensors.push(d.clone());
                    }
                }
                let id = match index.get(&l) {
                    Some(&id) => id,
                    None => {
                        let id = unique.len() as u32;
                        index.insert(l.clone(), id);
                        unique.push(l);
                        ranks.push(Vec::new());
                        id
                    }
                };
                ranks[id as usize].push(rank);
                of_rank[rank as usize] = id;
            })?;
            if let Some(e) = err {
                return Err(e);
            }
        }
        // Ordered by lowest rank, each rank list ascending.
        for r in &mut ranks {
            r.sort_unstable();
        }
        let mut order: Vec<usize> = (0..unique.len()).collect();
        order.sort_by_key(|&u| ranks[u].first().copied().unwrap_or(u32::MAX));
        let mut new_id = vec![0u32; unique.len()];
        for (n, &u) in order.iter().enumerate() {
            new_id[u] = n as u32;
        }
        let mut slots: Vec<Option<RankLayout>> = unique.into_iter().map(Some).collect();
        let unique = order
            .iter()
            // Invariant: `order` is a permutation, so each slot is taken exactly once.
            .map(|&u| slots[u].take().unwrap_or_default())
            .collect();
        let ranks = order
            .iter()
            .map(|&u| std::mem::take(&mut ranks[u]))
            .collect();
        for o in &mut of_rank {
            *o = new_id[*o as usize];
        }
        Ok(super::GatheredLayouts {
            unique,
            ranks,
            of_rank,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, TensorKey};

    fn decl(key: &str, shape: &[u64]) -> TensorDecl {
        TensorDecl {
            key: TensorKey::new(key).unwrap(),
            dtype: DType::Float32,
            global_shape: shape.to_vec(),
        }
    }

    /// Rank `r` of `n` holding torch.chunk part `r` of rows of two tensors, and the norm whole.
    fn fsdp(r: u64, n: u64) -> RankLayout {
        let part = |d: u64| {
            let s = d.div_ceil(n);
            let o = (r * s).min(d);
            (o, s.min(d - o))
        };
        let (o1, n1) = part(10);
        let (o2, n2) = part(64);
        RankLayout {
            tensors: vec![decl("a", &[10, 3]), decl("b", &[64]), decl("n", &[5])],
            pieces: vec![
                PieceDecl {
                    tensor: 0,
                    region: Region::new(vec![o1, 0], vec![n1, 3]).unwrap(),
                    main: true,
                    auto: false,
                },
                PieceDecl {
                    tensor: 1,
                    region: Region::new(vec![o2], vec![n2]).unwrap(),
                    main: true,
                    auto: false,
                },
                PieceDecl {
                    tensor: 2,
                    region: Region::full(&[5]),
                    main: false,
                    auto: true,
                },
            ],
        }
    }

    #[test]
    fn describe_round_trips_and_shares_templates() {
        let n = 4;
        let mut hashes = std::collections::HashSet::new();
        for r in 0..n {
            let l = fsdp(r, n);
            let (t, c) = Template::describe(&l);
            let enc = t.encode();
            assert_eq!(Template::decode(&enc, 0).unwrap(), t);
            assert_eq!(t.instantiate(&c, r as usize).unwrap(), l, "rank {r}");
            for cut in 0..enc.len() {
                assert!(Template::decode(&enc[..cut], 0).is_err());
            }
            hashes.insert(template_hash(&enc));
        }
        // Ranks 0..2 hold whole parts; rank 3 the shorter last part of `a` (rows 9..10) and
        // of nothing else: at most two templates for four ranks.
        assert!(hashes.len() <= 2, "{}", hashes.len());
    }

    #[test]
    fn summaries_merge_in_any_order_into_few_runs() {
        let n = 64u64;
        let leaves: Vec<Summary> = (0..n)
            .map(|r| {
                let (t, c) = Template::describe(&fsdp(r, n));
                Summary::leaf(r, t.encode(), &c)
            })
            .collect();
        // Left fold and a tree (heap order) give summaries of the same world.
        let left = leaves[1..]
            .iter()
            .fold(leaves[0].clone(), |a, b| a.merge(b).unwrap());
        fn heap(leaves: &[Summary], i: usize) -> Summary {
            let mut s = leaves[i].clone();
            for c in [2 * i + 1, 2 * i + 2] {
                if c < leaves.len() {
                    s = s.merge(&heap(leaves, c)).unwrap();
                }
            }
            s
        }
        let tree = heap(&leaves, 0);
        for s in [&left, &tree] {
            let dec = Summary::decode(&s.encode(), 0).unwrap();
            assert_eq!(&dec, s);
            let w = World::from_summary(s, n as usize).unwrap();
            let g = w.gathered(None).unwrap();
            for r in 0..n as usize {
                assert_eq!(
                    g.unique[g.of_rank[r] as usize],
                    fsdp(r as u64, n),
                    "rank {r}"
                );
            }
            assert!(s.runs.len() <= 8, "{} runs", s.runs.len());
        }
        assert!(leaves[0].merge(&leaves[0]).is_err());
    }

    #[test]
    fn periodic_coordinates_make_one_run() {
        // tp 4 x dp 16: rank r holds part r % 4.
        let leaves: Vec<Summary> = (0..64u64)
            .map(|r| Summary::leaf(r, b"t".to_vec(), &[r % 4]))
            .collect();
        let s = leaves[1..]
            .iter()
            .fold(leaves[0].clone(), |a, b| a.merge(b).unwrap());
        assert_eq!(s.runs.len(), 1, "{:?}", s.runs);
        for k in 0..64 {
            assert_eq!(s.runs[0].coords_at(k).unwrap(), vec![k % 4]);
        }
    }

    #[test]
    fn hostile_summaries_are_errors() {
        let s = Summary::leaf(3, b"x".to_vec(), &[1, 2]);
        let enc = s.encode();
        for cut in 0..enc.len() {
            assert!(Summary::decode(&enc[..cut], 0).is_err());
        }
        let mut bad = enc.clone();
        bad[SUMMARY_MAGIC.len() + 1] ^= 1; // hash no longer matches
        assert!(Summary::decode(&bad, 0).is_err());
        // A summary of rank 3 alone is not a world of 4 ranks.
        assert!(World::from_summary(&s, 4).is_err());
    }

    #[test]
    fn hand_built_summaries_past_u64_or_template_are_errors() {
        // A valid template and its coordinates, so that only the runs are wrong.
        let (t, c) = Template::describe(&fsdp(0, 1));
        let t = t.encode();
        let run = |start: u64, count: u64, template: u32| Run {
            start,
            count,
            template,
            period: count,
            coords: c.iter().map(|&b| (b, 0)).collect(),
        };
        let templates = vec![(template_hash(&t), t)];
        // Runs whose end wraps past u64 back to the world's size.
        let wrap = Summary {
            templates: templates.clone(),
            runs: vec![run(0, u64::MAX, 0), run(u64::MAX, 5, 0)],
        };
        assert!(World::from_summary(&wrap, 4).is_err());
        // A run naming a template that is not there.
        let absent = Summary {
            templates: templates.clone(),
            runs: vec![run(0, 4, 7)],
        };
        assert!(World::from_summary(&absent, 4).is_err());
        // The same runs, well formed, are a world.
        let good = Summary {
            templates,
            runs: vec![run(0, 4, 0)],
        };
        assert!(World::from_summary(&good, 4).is_ok());
    }
}
