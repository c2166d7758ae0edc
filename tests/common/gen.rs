//! Proptest generators shared by the property tests: tensors, tilings of a tensor into boxes,
//! placements of those boxes on ranks (with data-parallel copies), and load requests.
//!
//! Every generator draws *raw* parameters (small integers, cut positions in per-mille of an
//! extent) and resolves them with `prop_map` into a plain, printable case. Proptest therefore
//! shrinks the raw parameters (towards fewer ranks, fewer tensors, fewer dimensions, unsplit
//! axes) while a failure prints resolved shapes, boxes and ranks, e.g.
//! `"g0/t2" float32 [6, 4]: [[0..3, 0..4] main@1 on [1, 3], [3..6, 0..4] main@0 on [0]]`.
#![allow(dead_code)]

use std::fmt;

use proptest::collection::vec;
use proptest::prelude::*;
use zarrckpt::plan::{PieceDecl, RankLayout, TensorDecl};
use zarrckpt::{DType, Region, TensorKey};

// ---------------------------------------------------------------------------------------------
// Limits and small helpers
// ---------------------------------------------------------------------------------------------

/// Size limits of generated cases.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most dimensions of a tensor.
    pub max_dims: usize,
    /// Largest extent of one dimension.
    pub max_dim: u64,
    /// Most elements of one tensor (dimensions are halved until it fits).
    pub max_elems: u64,
    /// Most tensors in one case.
    pub max_tensors: usize,
    /// Most ranks.
    pub max_world: u32,
}

/// Limits for the pure plan tests: many small-to-medium tensors, up to 8 ranks.
pub const PLAN: Limits = Limits {
    max_dims: 4,
    max_dim: 64,
    max_elems: 4096,
    max_tensors: 4,
    max_world: 8,
};

/// Limits for the storage round trips: small tensors, up to 5 ranks.
pub const ROUNDTRIP: Limits = Limits {
    max_dims: 4,
    max_dim: 24,
    max_elems: 600,
    max_tensors: 4,
    max_world: 5,
};

/// Most boxes one tiling makes.
pub const MAX_BOXES: u64 = 16;

/// Number of elements of a shape.
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Calls `f` with every element index of `region`, in C order (an independent odometer: the
/// tests do not use the library's own iteration helpers as their oracle).
pub fn for_each_element(region: &Region, mut f: impl FnMut(&[u64])) {
    if region.shape().contains(&0) {
        return;
    }
    let nd = region.shape().len();
    let mut idx = region.offset().to_vec();
    loop {
        f(&idx);
        let mut d = nd;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < region.offset()[d] + region.shape()[d] {
                break;
            }
            idx[d] = region.offset()[d];
        }
    }
}

/// C-order linear index of `index` inside the box `within`.
pub fn linear_in(index: &[u64], within: &Region) -> u64 {
    index
        .iter()
        .zip(within.offset())
        .zip(within.shape())
        .fold(0, |acc, ((i, o), s)| acc * s + (i - o))
}

/// True when `inner` lies inside `outer` (same rank).
pub fn inside(inner: &Region, outer: &Region) -> bool {
    inner.shape().len() == outer.shape().len()
        && (0..inner.shape().len()).all(|d| {
            inner.offset()[d] >= outer.offset()[d]
                && inner.offset()[d] + inner.shape()[d] <= outer.offset()[d] + outer.shape()[d]
        })
}

/// `frac` per-mille of `len`, rounded down (`frac` is clamped to 0..=1000).
fn permille(len: u64, frac: u16) -> u64 {
    len * u64::from(frac.min(1000)) / 1000
}

/// A cut position in `0..=len`: positions 0 and 1000 cut at the ends (leaving an empty part),
/// every other position cuts strictly inside when `len >= 2`.
fn cut_at(len: u64, pos: u16) -> u64 {
    match pos {
        0 => 0,
        1000.. => len,
        _ if len < 2 => permille(len, pos),
        _ => 1 + (len - 2) * u64::from(pos - 1) / 998,
    }
}

/// Cut positions for `cut_at`: mostly inside, sometimes at either end.
pub fn cut_pos() -> impl Strategy<Value = u16> {
    prop_oneof![12 => 1u16..=999, 1 => Just(0u16), 1 => Just(1000u16)]
}

// ---------------------------------------------------------------------------------------------
// Data types and shapes
// ---------------------------------------------------------------------------------------------

/// Any supported data type.
pub fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

/// One extent: sometimes 0, often 1, mostly small, sometimes larger.
fn extent() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 3 => Just(1u64), 10 => 2u64..=12, 4 => 13u64..=64]
}

/// Clamps every extent to `max_dim`, then halves the largest extent until the tensor has at
/// most `max_elems` elements.
fn clamp_shape(mut shape: Vec<u64>, l: Limits) -> Vec<u64> {
    for d in &mut shape {
        *d = (*d).min(l.max_dim);
    }
    while numel(&shape) > l.max_elems {
        let (i, _) = shape
            .iter()
            .enumerate()
            .max_by_key(|(_, d)| **d)
            .expect("non-scalar");
        shape[i] /= 2;
    }
    shape
}

/// A global shape with 0 to `max_dims` dimensions (mostly 1 to 3; size-1 and zero-size
/// extents included).
pub fn shape(l: Limits) -> impl Strategy<Value = Vec<u64>> {
    let ndim = prop_oneof![1 => Just(0usize), 3 => Just(1usize), 3 => Just(2usize), 2 => Just(3usize), 1 => Just(4usize)];
    (ndim, vec(extent(), l.max_dims)).prop_map(move |(n, mut s)| {
        s.truncate(n.min(l.max_dims));
        clamp_shape(s, l)
    })
}

// ---------------------------------------------------------------------------------------------
// Tilings: sets of disjoint boxes covering a tensor
// ---------------------------------------------------------------------------------------------

/// How one axis of a grid tiling is cut into parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AxisSplit {
    /// `numpy.array_split`: part sizes differ by at most one (an even split when the number
    /// of parts divides the extent); at most one part per element.
    Even,
    /// `torch.chunk` / DTensor `Shard`: parts of `ceil(extent / n)`, trailing parts short or
    /// empty.
    Chunk,
    /// `n - 1` arbitrary cut points; coinciding cuts merge, a cut at either end leaves an
    /// empty part.
    Cuts,
}

/// Raw parameters of a tiling.
#[derive(Debug, Clone)]
pub enum TilingRaw {
    /// A grid of boxes: per axis (split kind, number of parts, cut positions for `cut_at`).
    /// Several axes may be split at once (e.g. tensor x expert parallelism).
    Grid(Vec<(AxisSplit, u64, Vec<u16>)>),
    /// Guillotine cuts: starting from the whole tensor, each `(box, axis, position)` cuts one
    /// existing box in two along one axis. Makes non-grid tilings with T-junctions.
    Guillotine(Vec<(u8, u8, u16)>),
}

/// Raw tiling parameters: mostly grids (with most axes unsplit), sometimes guillotines.
pub fn tiling_raw() -> impl Strategy<Value = TilingRaw> {
    let kind = prop_oneof![2 => Just(AxisSplit::Even), 1 => Just(AxisSplit::Chunk), 2 => Just(AxisSplit::Cuts)];
    let parts = prop_oneof![3 => Just(1u64), 3 => 2u64..=4, 1 => 5u64..=8];
    let axis = (kind, parts, vec(cut_pos(), 7));
    prop_oneof![
        4 => vec(axis, 4).prop_map(TilingRaw::Grid),
        1 => vec((any::<u8>(), any::<u8>(), cut_pos()), 0..=7).prop_map(TilingRaw::Guillotine),
    ]
}

/// Boundaries `0 = b0 <= b1 <= ... <= bn = extent` of one axis cut into `n` parts.
pub fn axis_boundaries(extent: u64, kind: AxisSplit, n: u64, cuts: &[u16]) -> Vec<u64> {
    let n = n.max(1);
    let mut b = vec![0u64];
    match kind {
        AxisSplit::Even => {
            let n = n.min(extent.max(1));
            let (base, rem) = (extent / n, extent % n);
            for i in 0..n {
                let last = *b.last().expect("non-empty");
                b.push(last + base + u64::from(i < rem));
            }
        }
        AxisSplit::Chunk => {
            let size = extent.div_ceil(n);
            for i in 1..=n {
                b.push((i * size).min(extent));
            }
        }
        AxisSplit::Cuts => {
            let n = n.min(extent.max(1));
            let mut c: Vec<u64> = (0..n - 1)
                .map(|i| cut_at(extent, cuts[i as usize % cuts.len()]))
                .collect();
            c.sort_unstable();
            c.dedup();
            b.extend(c);
            b.push(extent);
        }
    }
    debug_assert_eq!(*b.last().expect("non-empty"), extent);
    b
}

/// Resolves a tiling of a tensor of `shape` into boxes.
///
/// Boxes are disjoint and cover the tensor. Empty boxes are kept, identical ones included:
/// uneven sharding leaves some ranks with nothing, e.g. `torch.chunk` of 2 rows over 4 ranks
/// gives rows `0..1, 1..2, 2..2, 2..2`.
pub fn resolve_tiling(shape: &[u64], raw: &TilingRaw) -> Vec<Region> {
    match raw {
        TilingRaw::Grid(axes) => {
            // Per axis boundaries; stop splitting once the grid would exceed MAX_BOXES cells.
            let mut cells = 1u64;
            let bounds: Vec<Vec<u64>> = shape
                .iter()
                .enumerate()
                .map(|(d, &extent)| {
                    let (kind, n, cuts) = &axes[d % axes.len()];
                    let n = if cells * n <= MAX_BOXES { *n } else { 1 };
                    cells *= n;
                    axis_boundaries(extent, *kind, n, cuts)
                })
                .collect();
            grid_boxes(&bounds)
        }
        TilingRaw::Guillotine(ops) => {
            let mut boxes = vec![Region::full(shape)];
            for &(b, a, pos) in ops {
                if shape.is_empty() {
                    break;
                }
                let i = usize::from(b) % boxes.len();
                let a = usize::from(a) % shape.len();
                let whole = boxes[i].clone();
                if whole.shape()[a] < 2 && (1..1000).contains(&pos) {
                    continue; // no room for a cut strictly inside
                }
                let cut = cut_at(whole.shape()[a], pos);
                let (offset, shape) = whole.into_parts();
                let mut lo = (offset.clone(), shape.clone());
                lo.1[a] = cut;
                let mut hi = (offset, shape);
                hi.0[a] += cut;
                hi.1[a] -= cut;
                boxes[i] = Region::new(lo.0, lo.1).unwrap();
                boxes.push(Region::new(hi.0, hi.1).unwrap());
            }
            boxes
        }
    }
}

/// The cells of a grid given per-axis boundaries, in C order.
fn grid_boxes(bounds: &[Vec<u64>]) -> Vec<Region> {
    let counts: Vec<u64> = bounds.iter().map(|b| b.len() as u64 - 1).collect();
    let mut out = Vec::new();
    let all = Region::new(vec![0; counts.len()], counts.clone()).unwrap();
    for_each_element(&all, |cell| {
        let offset = cell
            .iter()
            .zip(bounds)
            .map(|(&c, b)| b[c as usize])
            .collect();
        let shape = cell
            .iter()
            .zip(bounds)
            .map(|(&c, b)| b[c as usize + 1] - b[c as usize])
            .collect();
        out.push(Region::new(offset, shape).unwrap());
    });
    out
}

// ---------------------------------------------------------------------------------------------
// Placements: which ranks hold each box, and which of them holds the main replica
// ---------------------------------------------------------------------------------------------

/// Raw parameters of a placement of boxes on ranks.
#[derive(Debug, Clone)]
pub enum PlacementRaw {
    /// Box `i` on rank `(i + shift) % world`, no copies (ranks may hold several boxes, or none).
    RoundRobin { shift: u8 },
    /// Tensor x data parallel: with `B <= world` boxes, box `i` is held by every rank `r` with
    /// `r % B == i` and the main replica is the `main`-th of them (mod their number), the same
    /// choice for every box; with more boxes than ranks, as `RoundRobin`.
    DataParallel { main: u8 },
    /// Every rank holds every box (biases, norms, scalars); box `i`'s main holder is
    /// `main[i % len] % world`.
    Everywhere { main: Vec<u8> },
    /// Per box `(owner, copies, main)`: held by rank `owner % world` and by every rank whose
    /// bit is set in `copies`; the main replica is holder number `main` (mod their number).
    Random { boxes: Vec<(u8, u8, u8)> },
}

/// Raw placement parameters.
pub fn placement_raw() -> impl Strategy<Value = PlacementRaw> {
    prop_oneof![
        2 => any::<u8>().prop_map(|shift| PlacementRaw::RoundRobin { shift }),
        2 => any::<u8>().prop_map(|main| PlacementRaw::DataParallel { main }),
        1 => vec(any::<u8>(), 1..=4).prop_map(|main| PlacementRaw::Everywhere { main }),
        2 => vec((any::<u8>(), prop_oneof![2 => Just(0u8), 1 => any::<u8>()], any::<u8>()), 1..=MAX_BOXES as usize)
            .prop_map(|boxes| PlacementRaw::Random { boxes }),
    ]
}

/// One main piece of a tensor and every rank holding a copy of it.
#[derive(Clone, PartialEq, Eq)]
pub struct PieceCase {
    /// The box.
    pub region: Region,
    /// The rank holding the main replica.
    pub main: u32,
    /// Every rank holding it, ascending (includes `main`).
    pub holders: Vec<u32>,
}

impl fmt::Debug for PieceCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} main@{} on {:?}",
            self.region, self.main, self.holders
        )
    }
}

/// Resolves a placement of `boxes` on `world` ranks.
pub fn resolve_placement(boxes: Vec<Region>, world: u32, raw: &PlacementRaw) -> Vec<PieceCase> {
    let n = boxes.len() as u32;
    boxes
        .into_iter()
        .enumerate()
        .map(|(i, region)| {
            let i = i as u32;
            let (holders, main): (Vec<u32>, u32) = match raw {
                PlacementRaw::RoundRobin { shift } => {
                    let r = (i + u32::from(*shift)) % world;
                    (vec![r], r)
                }
                PlacementRaw::DataParallel { main } => {
                    if n <= world {
                        let h: Vec<u32> = (0..world).filter(|r| r % n == i).collect();
                        let m = h[usize::from(*main) % h.len()];
                        (h, m)
                    } else {
                        (vec![i % world], i % world)
                    }
                }
                PlacementRaw::Everywhere { main } => (
                    (0..world).collect(),
                    u32::from(main[i as usize % main.len()]) % world,
                ),
                PlacementRaw::Random { boxes } => {
                    let (owner, copies, main) = boxes[i as usize % boxes.len()];
                    let owner = u32::from(owner) % world;
                    let h: Vec<u32> = (0..world)
                        .filter(|&r| r == owner || (r < 8 && copies & (1 << r) != 0))
                        .collect();
                    let m = h[usize::from(main) % h.len()];
                    (h, m)
                }
            };
            PieceCase {
                region,
                main,
                holders,
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Save cases
// ---------------------------------------------------------------------------------------------

/// One tensor of a save case.
#[derive(Clone)]
pub struct TensorCase {
    /// The key.
    pub key: String,
    /// The data type.
    pub dtype: DType,
    /// The global shape.
    pub shape: Vec<u64>,
    /// The main pieces (tiling the tensor) and their holders.
    pub pieces: Vec<PieceCase>,
    /// Stray copies `(rank, box)`: non-main pieces whose box is no main piece's box (valid
    /// input that planning must ignore: only copies of a main box may stand in for it).
    pub strays: Vec<(u32, Region)>,
}

impl fmt::Debug for TensorCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} {} {:?}: {:?}",
            self.key, self.dtype, self.shape, self.pieces
        )?;
        if !self.strays.is_empty() {
            write!(f, " strays:")?;
            for (r, b) in &self.strays {
                write!(f, " {b} on {r};")?;
            }
        }
        Ok(())
    }
}

/// One piece a rank holds, as `SaveCase::held_by` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Index of the tensor in the case.
    pub tensor: usize,
    /// The box.
    pub region: Region,
    /// True for the main replica.
    pub main: bool,
    /// The replica id to save it with: 0 for the main replica, distinct non-zero ids for
    /// copies of a main piece, `u32::MAX` for strays.
    pub replica: u32,
}

/// A save topology: tensors, their pieces and the ranks holding them.
#[derive(Clone)]
pub struct SaveCase {
    /// Number of ranks.
    pub world: u32,
    /// The tensors, distinct keys.
    pub tensors: Vec<TensorCase>,
    /// When true, every rank lists its pieces rotated by its rank (piece order within a rank's
    /// layout must not matter).
    pub rotate: bool,
}

impl fmt::Debug for SaveCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "SaveCase {{ world: {}, rotate: {}, tensors: [",
            self.world, self.rotate
        )?;
        for t in &self.tensors {
            writeln!(f, "    {t:?}")?;
        }
        write!(f, "] }}")
    }
}

/// Keys of generated tensors: distinct and collision-free once mapped to paths; some need
/// escaping on disk.
pub fn key_of(i: usize) -> String {
    match i % 4 {
        0 => format!("layers.{i}.weight"),
        1 => format!("optimizer/exp_avg/t{i}"),
        2 => format!("g{}/t{i}", i % 2),
        _ => format!("emb ed/wört~{i}"),
    }
}

/// Raw parameters of one tensor.
#[derive(Debug, Clone)]
pub struct TensorRaw {
    /// The data type.
    pub dtype: DType,
    /// The global shape.
    pub shape: Vec<u64>,
    /// How it is cut into main pieces.
    pub tiling: TilingRaw,
    /// Where the pieces live.
    pub placement: PlacementRaw,
    /// Stray copies: `(rank, per-axis (start, length) positions)`, see [`TensorCase::strays`].
    pub strays: Vec<(u8, Vec<(u16, u16)>)>,
}

/// Per-axis `(start, length)` positions of a box inside a tensor (see [`box_in`]).
pub fn box_pos() -> impl Strategy<Value = Vec<(u16, u16)>> {
    vec((0u16..=1000, 0u16..=1000), 4)
}

/// A non-empty box of a tensor of `shape` (unless the tensor is empty) from per-axis
/// `(start, length)` positions in per-mille.
pub fn box_in(shape: &[u64], pos: &[(u16, u16)]) -> Region {
    let mut offset = Vec::new();
    let mut len = Vec::new();
    for (d, &extent) in shape.iter().enumerate() {
        let (a, b) = pos[d % pos.len()];
        if extent == 0 {
            offset.push(0);
            len.push(0);
        } else {
            let o = permille(extent - 1, a);
            offset.push(o);
            len.push(1 + permille(extent - o - 1, b));
        }
    }
    Region::new(offset, len).unwrap()
}

/// Raw parameters of one tensor, placed as `placement` draws.
pub fn tensor_raw_with(
    l: Limits,
    placement: impl Strategy<Value = PlacementRaw>,
) -> impl Strategy<Value = TensorRaw> {
    let strays = prop_oneof![4 => Just(Vec::new()), 1 => vec((any::<u8>(), box_pos()), 1..=2)];
    (dtype(), shape(l), tiling_raw(), placement, strays).prop_map(
        |(dtype, shape, tiling, placement, strays)| TensorRaw {
            dtype,
            shape,
            tiling,
            placement,
            strays,
        },
    )
}

/// Resolves one tensor of a save case.
pub fn resolve_tensor(i: usize, world: u32, raw: &TensorRaw) -> TensorCase {
    let boxes = resolve_tiling(&raw.shape, &raw.tiling);
    let pieces = resolve_placement(boxes, world, &raw.placement);
    let mut strays: Vec<(u32, Region)> = Vec::new();
    for (r, pos) in &raw.strays {
        let stray = (u32::from(*r) % world, box_in(&raw.shape, pos));
        if !stray.1.is_empty()
            && !pieces.iter().any(|p| p.region == stray.1)
            && !strays.contains(&stray)
        {
            strays.push(stray);
        }
    }
    TensorCase {
        key: key_of(i),
        dtype: raw.dtype,
        shape: raw.shape.clone(),
        pieces,
        strays,
    }
}

/// Save cases on `min_world..=l.max_world` ranks, any placement.
pub fn save_case(l: Limits, min_world: u32) -> impl Strategy<Value = SaveCase> {
    save_case_with(l, min_world, placement_raw())
}

/// Save cases on `min_world..=l.max_world` ranks, every tensor placed as `placement` draws.
pub fn save_case_with(
    l: Limits,
    min_world: u32,
    placement: impl Strategy<Value = PlacementRaw>,
) -> impl Strategy<Value = SaveCase> {
    (
        min_world..=l.max_world,
        vec(tensor_raw_with(l, placement), 1..=l.max_tensors),
        any::<bool>(),
    )
        .prop_map(|(world, raws, rotate)| {
            let tensors = raws
                .iter()
                .enumerate()
                .map(|(i, raw)| resolve_tensor(i, world, raw))
                .collect();
            SaveCase {
                world,
                tensors,
                rotate,
            }
        })
}

impl SaveCase {
    /// The pieces rank `r` holds (main pieces, copies and strays), in the order its layout
    /// lists them. A rank holds each box of a tensor once: identical empty pieces placed on
    /// the same rank merge into one (main if either is).
    pub fn held_by(&self, r: u32) -> Vec<Held> {
        let mut out: Vec<Held> = Vec::new();
        for (ti, t) in self.tensors.iter().enumerate() {
            for p in &t.pieces {
                if let Some(i) = p.holders.iter().position(|&h| h == r) {
                    let replica = if p.main == r { 0 } else { 1 + i as u32 };
                    let held = Held {
                        tensor: ti,
                        region: p.region.clone(),
                        main: p.main == r,
                        replica,
                    };
                    match out
                        .iter_mut()
                        .find(|h| h.tensor == ti && h.region == p.region)
                    {
                        Some(h) if held.main => *h = held,
                        Some(_) => {}
                        None => out.push(held),
                    }
                }
            }
            for (sr, b) in &t.strays {
                if *sr == r {
                    out.push(Held {
                        tensor: ti,
                        region: b.clone(),
                        main: false,
                        replica: u32::MAX,
                    });
                }
            }
        }
        if self.rotate && !out.is_empty() {
            let k = r as usize % out.len();
            out.rotate_left(k);
        }
        out
    }

    /// Every rank's layout: a rank declares exactly the tensors it holds pieces of (as
    /// `save` does), in the order of its first piece of each.
    pub fn layouts(&self) -> Vec<RankLayout> {
        (0..self.world)
            .map(|r| {
                let mut layout = RankLayout::default();
                let mut ids: Vec<Option<u32>> = vec![None; self.tensors.len()];
                for h in self.held_by(r) {
                    let t = &self.tensors[h.tensor];
                    let id = *ids[h.tensor].get_or_insert_with(|| {
                        layout.tensors.push(TensorDecl {
                            key: TensorKey::new(t.key.as_str()).expect("valid key"),
                            dtype: t.dtype,
                            global_shape: t.shape.clone(),
                        });
                        layout.tensors.len() as u32 - 1
                    });
                    layout.pieces.push(PieceDecl {
                        tensor: id,
                        region: h.region,
                        main: h.main,
                        auto: false,
                    });
                }
                layout
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Load cases
// ---------------------------------------------------------------------------------------------

/// Raw load requests for one tensor.
#[derive(Debug, Clone)]
pub struct LoadRaw {
    /// The tiling whose boxes ranks request (box `i` on rank `(i + shift) % world`).
    pub tiling: TilingRaw,
    /// Rotation of the box-to-rank assignment.
    pub shift: u8,
    /// Every rank also requests the whole tensor (identical requests on all ranks).
    pub whole: bool,
    /// Extra boxes: `(rank, per-axis (start, length) positions for [`box_in`])`; they overlap
    /// the others.
    pub extra: Vec<(u8, Vec<(u16, u16)>)>,
}

/// Raw load requests.
pub fn load_raw() -> impl Strategy<Value = LoadRaw> {
    (
        tiling_raw(),
        any::<u8>(),
        prop::bool::weighted(0.2),
        vec((any::<u8>(), box_pos()), 0..=3),
    )
        .prop_map(|(tiling, shift, whole, extra)| LoadRaw {
            tiling,
            shift,
            whole,
            extra,
        })
}

/// A load topology: for each rank, the boxes it requests, as `(tensor index, box)`.
#[derive(Clone)]
pub struct LoadCase {
    /// Number of ranks.
    pub world: u32,
    /// Per rank, its requests in order.
    pub requests: Vec<Vec<(usize, Region)>>,
}

impl fmt::Debug for LoadCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "LoadCase {{ world: {}, requests: [", self.world)?;
        for (r, reqs) in self.requests.iter().enumerate() {
            write!(f, "    rank {r}:")?;
            for (t, b) in reqs {
                write!(f, " t{t} {b};")?;
            }
            writeln!(f)?;
        }
        write!(f, "] }}")
    }
}

/// Resolves the load requests for tensors of the given shapes on `world` ranks.
pub fn resolve_load(shapes: &[Vec<u64>], world: u32, raws: &[LoadRaw]) -> LoadCase {
    let mut requests: Vec<Vec<(usize, Region)>> = vec![Vec::new(); world as usize];
    for (ti, shape) in shapes.iter().enumerate() {
        let raw = &raws[ti % raws.len()];
        for (i, b) in resolve_tiling(shape, &raw.tiling).into_iter().enumerate() {
            requests[(i + usize::from(raw.shift)) % world as usize].push((ti, b));
        }
        if raw.whole {
            for reqs in &mut requests {
                reqs.push((ti, Region::full(shape)));
            }
        }
        for (r, pos) in &raw.extra {
            requests[usize::from(*r) % world as usize].push((ti, box_in(shape, pos)));
        }
    }
    LoadCase { world, requests }
}
