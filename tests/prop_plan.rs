//! Property tests of the pure plan layer (no I/O): save plans built from random layouts over
//! 1..=8 ranks, the validation errors for broken layouts, and the reads a load plans.
//!
//! Layouts come from `common::gen`: even (`array_split`), `torch.chunk` and arbitrary splits,
//! several axes split at once (grids of boxes), guillotine tilings, data-parallel copies with
//! the main replica on exactly one holder, and small `GridOptions` so that subchunks and the
//! tiny-chunk fallback (unaligned chunks assembled from parts sent between ranks) show up.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};

use common::r#gen::{self as g, SaveCase, for_each_element, inside, linear_in, numel};
use proptest::prelude::*;
use zarrckpt::plan::load::StoredGeometry;
use zarrckpt::plan::save::{RankTasks, Source};
use zarrckpt::plan::{
    GatheredLayouts, GridOptions, PieceDecl, PlanError, RankLayout, SavePlan, SavePlanOptions,
    TensorDecl,
};
use zarrckpt::{DType, Region, TensorKey};

/// Small grid options: tiny subchunks and tiny-chunk thresholds from "never" to "always".
fn grid_options() -> impl Strategy<Value = GridOptions> {
    (
        prop_oneof![1 => Just(0u64), 1 => Just(16), 1 => Just(256), 1 => Just(4096), 4 => Just(1 << 20)],
        prop::sample::select(vec![1u64, 2, 8, 32, 128, 1 << 20]),
    )
        .prop_map(|(min_chunk_bytes, subchunk_target_bytes)| GridOptions { min_chunk_bytes, subchunk_target_bytes })
}

/// Plan options; replica balancing on most of the time.
fn plan_options() -> impl Strategy<Value = SavePlanOptions> {
    (grid_options(), prop::bool::weighted(0.8)).prop_map(|(grid, balance_replicas)| {
        SavePlanOptions {
            grid,
            balance_replicas,
        }
    })
}

fn config(cases: u32) -> ProptestConfig {
    // No regression files in the source tree: bugs found get named tests instead.
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

#[allow(clippy::result_large_err)] // PlanError is the library's type
fn build(layouts: &[RankLayout], opts: &SavePlanOptions) -> Result<SavePlan, PlanError> {
    SavePlan::build(&GatheredLayouts::from_layouts(layouts), opts)
}

/// `(rank, key, region)` for every piece any rank declares (main or copy).
fn held_pieces(layouts: &[RankLayout]) -> HashSet<(u32, String, Region)> {
    let mut held = HashSet::new();
    for (r, l) in layouts.iter().enumerate() {
        for p in &l.pieces {
            held.insert((
                r as u32,
                l.tensors[p.tensor as usize].key.to_string(),
                p.region.clone(),
            ));
        }
    }
    held
}

/// The de-duplicated view describes exactly the input layouts.
fn check_gathered(layouts: &[RankLayout], gl: &GatheredLayouts) -> Result<(), TestCaseError> {
    prop_assert_eq!(gl.world_size(), layouts.len());
    prop_assert_eq!(gl.unique.len(), gl.ranks.len());
    for (r, l) in layouts.iter().enumerate() {
        let u = gl.of_rank[r] as usize;
        prop_assert_eq!(&gl.unique[u], l, "rank {}", r);
        prop_assert!(gl.ranks[u].contains(&(r as u32)));
    }
    for (u, ranks) in gl.ranks.iter().enumerate() {
        prop_assert!(
            ranks.windows(2).all(|w| w[0] < w[1]),
            "ranks of layout {} not ascending",
            u
        );
        prop_assert!(ranks.iter().all(|&r| gl.of_rank[r as usize] as usize == u));
        prop_assert!(
            u == 0 || gl.ranks[u - 1][0] < ranks[0],
            "unique layouts not ordered by lowest rank"
        );
        prop_assert!(
            !gl.unique[..u].contains(&gl.unique[u]),
            "layout {} not unique",
            u
        );
    }
    Ok(())
}

/// Checks one tensor's plan and the writes of every rank for it.
fn check_tensor(
    ti: usize,
    case: &SaveCase,
    plan: &SavePlan,
    tasks: &[RankTasks],
    held: &HashSet<(u32, String, Region)>,
    opts: &SavePlanOptions,
) -> Result<(), TestCaseError> {
    let tp = &plan.tensors[ti];
    let key = tp.key.to_string();
    let tc = case
        .tensors
        .iter()
        .find(|t| t.key == key)
        .expect("planned tensor comes from the case");
    let shape = &tc.shape;
    let nd = shape.len();
    prop_assert_eq!(tp.dtype, tc.dtype);
    prop_assert_eq!(&tp.global_shape, shape);

    // The plan's pieces are exactly the main boxes (identical empty boxes count once), each
    // written by one of its holders.
    let mut want: Vec<&Region> = tc.pieces.iter().map(|p| &p.region).collect();
    want.sort();
    want.dedup();
    let got: Vec<&Region> = tp.pieces.iter().map(|p| &p.region).collect();
    prop_assert_eq!(got, want, "{}: planned pieces are not the main boxes", key);
    for p in &tp.pieces {
        let same = || tc.pieces.iter().filter(|c| c.region == p.region);
        let holders: Vec<u32> = same().flat_map(|c| c.holders.iter().copied()).collect();
        let mains: Vec<u32> = same().map(|c| c.main).collect();
        prop_assert!(
            holders.contains(&p.writer),
            "{}: piece {} written by rank {}, held by {:?}",
            key,
            p.region,
            p.writer,
            holders
        );
        if !opts.balance_replicas {
            prop_assert!(
                mains.contains(&p.writer),
                "{}: without balancing a main replica ({:?}) writes {}",
                key,
                mains,
                p.region
            );
        }
    }

    // The grid: subchunks divide chunks; aligned pieces are unions of whole chunks.
    let (chunk, sub) = (&tp.chunk_shape, &tp.subchunk_shape);
    prop_assert_eq!(chunk.len(), nd);
    prop_assert_eq!(sub.len(), nd);
    for d in 0..nd {
        prop_assert!(
            chunk[d] >= 1 && sub[d] >= 1,
            "{}: zero chunk {:?} / subchunk {:?}",
            key,
            chunk,
            sub
        );
        prop_assert!(
            chunk[d] % sub[d] == 0,
            "{}: subchunk {:?} does not divide chunk {:?}",
            key,
            sub,
            chunk
        );
    }
    if tp.aligned {
        for p in tp.pieces.iter().filter(|p| !p.region.is_empty()) {
            for d in 0..nd {
                let end = p.region.offset()[d] + p.region.shape()[d];
                prop_assert!(
                    p.region.offset()[d] % chunk[d] == 0
                        && (end % chunk[d] == 0 || end == shape[d]),
                    "{}: aligned piece {} is not a union of {:?} chunks",
                    key,
                    p.region,
                    chunk
                );
            }
        }
    }

    // Writes: every chunk exactly once, every element exactly once (by chunk and by part).
    let full = Region::full(shape);
    let grid: Vec<u64> = shape
        .iter()
        .zip(chunk)
        .map(|(s, c)| s.div_ceil(*c))
        .collect();
    let n = numel(shape) as usize;
    let (mut by_chunk, mut by_part) = (vec![0u32; n], vec![0u32; n]);
    let mut chunks: HashMap<Vec<u64>, u32> = HashMap::new();
    for (r, t) in tasks.iter().enumerate() {
        let r = r as u32;
        for w in t.writes.iter().filter(|w| w.tensor == ti) {
            prop_assert_eq!(w.chunk.len(), nd);
            prop_assert!(
                w.chunk.iter().zip(&grid).all(|(i, n)| i < n),
                "{}: chunk {:?} outside grid {:?}",
                key,
                w.chunk,
                grid
            );
            let offset: Vec<u64> = w.chunk.iter().zip(chunk).map(|(i, c)| i * c).collect();
            let clipped = offset
                .iter()
                .zip(chunk)
                .zip(shape)
                .map(|((o, c), s)| (*c).min(s - o))
                .collect();
            prop_assert_eq!(
                &w.region,
                &Region::new(offset, clipped).unwrap(),
                "{}: region of chunk {:?}",
                key,
                w.chunk
            );
            *chunks.entry(w.chunk.clone()).or_default() += 1;
            for_each_element(&w.region, |i| by_chunk[linear_in(i, &full) as usize] += 1);
            if tp.aligned {
                prop_assert!(
                    w.parts.len() == 1
                        && w.parts[0].region == w.region
                        && matches!(w.parts[0].source, Source::Local(_)),
                    "{}: aligned chunk {:?} has parts {:?}",
                    key,
                    w.chunk,
                    w.parts
                );
            }
            for part in &w.parts {
                prop_assert!(
                    !part.region.is_empty() && inside(&part.region, &w.region),
                    "{}: part {} of chunk {}",
                    key,
                    part.region,
                    w.region
                );
                for_each_element(&part.region, |i| by_part[linear_in(i, &full) as usize] += 1);
                match &part.source {
                    Source::Local(piece) => {
                        prop_assert!(
                            held.contains(&(r, key.clone(), piece.clone())),
                            "{}: rank {} writes from {} it does not hold",
                            key,
                            r,
                            piece
                        );
                        prop_assert!(
                            inside(&part.region, piece),
                            "{}: part {} not inside its piece {}",
                            key,
                            part.region,
                            piece
                        );
                        prop_assert!(
                            tp.pieces
                                .iter()
                                .any(|p| &p.region == piece && p.writer == r),
                            "{}: local piece {} is not rank {}'s to write",
                            key,
                            piece,
                            r
                        );
                    }
                    Source::Remote(s) => {
                        prop_assert!(
                            !tp.aligned && *s != r && *s < case.world,
                            "{}: rank {} receives from {}",
                            key,
                            r,
                            s
                        );
                        prop_assert!(
                            tp.pieces
                                .iter()
                                .any(|p| p.writer == *s && inside(&part.region, &p.region)),
                            "{}: part {} is in no piece rank {} writes",
                            key,
                            part.region,
                            s
                        );
                    }
                }
            }
        }
    }
    prop_assert_eq!(
        chunks.len() as u64,
        grid.iter().product::<u64>(),
        "{}: chunks written {:?}",
        key,
        chunks.keys().collect::<Vec<_>>()
    );
    prop_assert!(
        chunks.values().all(|&c| c == 1),
        "{}: a chunk written twice: {:?}",
        key,
        chunks
    );
    prop_assert!(
        by_chunk.iter().all(|&c| c == 1),
        "{}: element write counts {:?}",
        key,
        by_chunk
    );
    prop_assert!(
        by_part.iter().all(|&c| c == 1),
        "{}: element part counts {:?}",
        key,
        by_part
    );

    // Exactly one rank writes the array metadata.
    let meta: Vec<u32> = (0..case.world)
        .filter(|&r| tasks[r as usize].metadata.contains(&ti))
        .collect();
    prop_assert_eq!(meta, vec![tp.metadata_writer], "{}: metadata writers", key);
    Ok(())
}

/// Every remote part is matched by one transfer from its source to the writer, in the same
/// relative order (the exchange pairs sends and receives per ordered pair of ranks by order).
fn check_transfers(
    plan: &SavePlan,
    tasks: &[RankTasks],
    held: &HashSet<(u32, String, Region)>,
) -> Result<(), TestCaseError> {
    let mut expected: BTreeMap<(u32, u32), Vec<(usize, Region)>> = BTreeMap::new();
    for (w, t) in tasks.iter().enumerate() {
        for cw in &t.writes {
            for part in &cw.parts {
                if let Source::Remote(s) = part.source {
                    expected
                        .entry((s, w as u32))
                        .or_default()
                        .push((cw.tensor, part.region.clone()));
                }
            }
        }
    }
    let mut sent: BTreeMap<(u32, u32), Vec<(usize, Region)>> = BTreeMap::new();
    for (s, t) in tasks.iter().enumerate() {
        let s = s as u32;
        for tr in &t.sends {
            let tp = &plan.tensors[tr.tensor];
            prop_assert!(!tp.aligned, "{}: transfer for an aligned tensor", tp.key);
            prop_assert!(
                tr.to != s && (tr.to as usize) < tasks.len(),
                "{}: rank {} sends to {}",
                tp.key,
                s,
                tr.to
            );
            prop_assert!(
                held.contains(&(s, tp.key.to_string(), tr.piece.clone())),
                "{}: rank {} sends from {} it does not hold",
                tp.key,
                s,
                tr.piece
            );
            prop_assert!(
                inside(&tr.region, &tr.piece),
                "{}: sent part {} not inside {}",
                tp.key,
                tr.region,
                tr.piece
            );
            prop_assert!(
                tp.pieces
                    .iter()
                    .any(|p| p.region == tr.piece && p.writer == s),
                "{}: rank {} sends from {}, not its piece",
                tp.key,
                s,
                tr.piece
            );
            sent.entry((s, tr.to))
                .or_default()
                .push((tr.tensor, tr.region.clone()));
        }
    }
    prop_assert_eq!(
        sent,
        expected,
        "(from, to) -> parts sent vs parts expected by the writer"
    );
    Ok(())
}

/// All checks of a valid plan.
fn check_plan(
    case: &SaveCase,
    layouts: &[RankLayout],
    opts: &SavePlanOptions,
    plan: &SavePlan,
) -> Result<(), TestCaseError> {
    let mut keys: Vec<&str> = case.tensors.iter().map(|t| t.key.as_str()).collect();
    keys.sort_unstable();
    let planned: Vec<&str> = plan.tensors.iter().map(|t| t.key.as_str()).collect();
    prop_assert_eq!(planned, keys, "tensors not sorted by key");
    let held = held_pieces(layouts);
    let tasks: Vec<RankTasks> = (0..case.world).map(|r| plan.tasks_for(r)).collect();
    let mut bytes = vec![0u64; case.world as usize];
    for (ti, tp) in plan.tensors.iter().enumerate() {
        check_tensor(ti, case, plan, &tasks, &held, opts)?;
        for p in &tp.pieces {
            bytes[p.writer as usize] += numel(p.region.shape()) * tp.dtype.size() as u64;
        }
    }
    prop_assert_eq!(&plan.bytes_per_rank, &bytes, "bytes per rank");
    check_transfers(plan, &tasks, &held)
}

/// Nonempty pieces of a case, as `(tensor, piece)`.
fn nonempty_pieces(case: &SaveCase) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (ti, t) in case.tensors.iter().enumerate() {
        for (pi, p) in t.pieces.iter().enumerate() {
            if !p.region.is_empty() {
                out.push((ti, pi));
            }
        }
    }
    out
}

/// The index of `key`'s declaration in `layout`, adding one if it has none.
fn decl_of(layout: &mut RankLayout, key: &str, dtype: DType, shape: &[u64]) -> u32 {
    match layout.tensors.iter().position(|t| t.key.as_str() == key) {
        Some(i) => i as u32,
        None => {
            layout.tensors.push(TensorDecl {
                key: TensorKey::new(key).unwrap(),
                dtype,
                global_shape: shape.to_vec(),
            });
            layout.tensors.len() as u32 - 1
        }
    }
}

/// A non-empty sub-box of a non-empty box, from per-axis (start, length) per-mille pairs.
fn sub_box(b: &Region, fr: &[(u16, u16)]) -> Region {
    let mut offset = Vec::new();
    let mut shape = Vec::new();
    for d in 0..b.shape().len() {
        let (s, l) = fr[d % fr.len()];
        let o = (b.shape()[d] - 1) * u64::from(s) / 1000;
        offset.push(b.offset()[d] + o);
        shape.push(1 + (b.shape()[d] - o - 1) * u64::from(l) / 1000);
    }
    Region::new(offset, shape).unwrap()
}

proptest! {
    #![proptest_config(config(256))]

    /// Valid layouts give a plan that writes every element exactly once, from data the writer
    /// holds or receives, deterministically.
    #[test]
    fn save_plan_writes_every_element_once(case in g::save_case(g::PLAN, 1), opts in plan_options()) {
        let layouts = case.layouts();
        let gathered = GatheredLayouts::from_layouts(&layouts);
        check_gathered(&layouts, &gathered)?;
        let plan = SavePlan::build(&gathered, &opts);
        let plan = plan.map_err(|e| TestCaseError::fail(format!("valid layouts rejected: {e}")))?;
        check_plan(&case, &layouts, &opts, &plan)?;
        prop_assert_eq!(&plan, &build(&layouts, &opts).unwrap(), "plan is not deterministic");
    }

    /// The same checks with the tiny-chunk fallback on for every tensor whose aligned chunks
    /// are smaller than its smallest piece (unaligned chunks assembled from parts).
    #[test]
    fn fallback_plans_write_every_element_once(
        case in g::save_case(g::PLAN, 1),
        sub in prop::sample::select(vec![1u64, 8, 1 << 20]),
    ) {
        let grid = GridOptions { min_chunk_bytes: u64::MAX, subchunk_target_bytes: sub };
        let opts = SavePlanOptions { grid, balance_replicas: true };
        let layouts = case.layouts();
        let plan = build(&layouts, &opts).map_err(|e| TestCaseError::fail(format!("valid layouts rejected: {e}")))?;
        check_plan(&case, &layouts, &opts, &plan)?;
    }

    /// Declaring every stored box replicated on all its holders (`Replica::Auto`, no ids)
    /// instead of main on one and copies elsewhere: identical layouts still collapse (more of
    /// them: the main holder's layout now equals its copies'), every element is written
    /// exactly once, and the writers are the same as with explicit ids.
    #[test]
    fn replicated_declarations_plan_like_explicit_ids(case in g::save_case(g::PLAN, 1), grid in grid_options()) {
        let opts = SavePlanOptions { grid, balance_replicas: true };
        let layouts = case.layouts();
        let explicit = build(&layouts, &opts).unwrap();
        let mains: HashSet<(String, Region)> = layouts
            .iter()
            .flat_map(|l| l.pieces.iter().filter(|p| p.main).map(|p| (l.tensors[p.tensor as usize].key.to_string(), p.region.clone())))
            .collect();
        let mut auto_layouts = layouts.clone();
        for l in &mut auto_layouts {
            for p in &mut l.pieces {
                if mains.contains(&(l.tensors[p.tensor as usize].key.to_string(), p.region.clone())) {
                    p.main = false;
                    p.auto = true;
                }
            }
        }
        let g_explicit = GatheredLayouts::from_layouts(&layouts);
        let g_auto = GatheredLayouts::from_layouts(&auto_layouts);
        prop_assert!(g_auto.unique.len() <= g_explicit.unique.len());
        check_gathered(&auto_layouts, &g_auto)?;
        let auto = SavePlan::build(&g_auto, &opts)
            .map_err(|e| TestCaseError::fail(format!("replicated declarations rejected: {e}")))?;
        check_plan(&case, &auto_layouts, &opts, &auto)?;
        for (a, e) in auto.tensors.iter().zip(&explicit.tensors) {
            prop_assert_eq!(&a.pieces, &e.pieces, "writers differ for {}", a.key);
        }
    }

    /// With every box held by every rank, balancing keeps the bytes the ranks write within
    /// one piece of each other.
    #[test]
    fn fully_replicated_writes_are_balanced(
        case in g::save_case_with(g::PLAN, 1, proptest::collection::vec(any::<u8>(), 1..=4)
            .prop_map(|main| g::PlacementRaw::Everywhere { main })),
        grid in grid_options(),
    ) {
        let opts = SavePlanOptions { grid, balance_replicas: true };
        let layouts = case.layouts();
        let plan = build(&layouts, &opts).map_err(|e| TestCaseError::fail(format!("valid layouts rejected: {e}")))?;
        check_plan(&case, &layouts, &opts, &plan)?;
        let largest = plan
            .tensors
            .iter()
            .flat_map(|t| t.pieces.iter().map(|p| numel(p.region.shape()) * t.dtype.size() as u64))
            .max()
            .unwrap_or(0);
        let (lo, hi) = (plan.bytes_per_rank.iter().min().unwrap(), plan.bytes_per_rank.iter().max().unwrap());
        prop_assert!(hi - lo <= largest, "bytes per rank {:?}, largest piece {} bytes", plan.bytes_per_rank, largest);
    }

    /// Removing a main piece (or demoting it to a copy) is a `Gap` naming the tensor and an
    /// element of the missing box.
    #[test]
    fn missing_main_piece_is_a_gap(case in g::save_case(g::PLAN, 1), pick in any::<usize>(), drop in any::<bool>()) {
        let candidates = nonempty_pieces(&case);
        prop_assume!(!candidates.is_empty());
        let (ti, pi) = candidates[pick % candidates.len()];
        let (t, p) = (&case.tensors[ti], &case.tensors[ti].pieces[pi]);
        let mut layouts = case.layouts();
        for &r in &p.holders {
            let l = &mut layouts[r as usize];
            let id = l.tensors.iter().position(|d| d.key.as_str() == t.key).unwrap() as u32;
            if drop {
                l.pieces.retain(|x| !(x.tensor == id && x.region == p.region));
            } else {
                l.pieces.iter_mut().filter(|x| x.tensor == id && x.region == p.region).for_each(|x| x.main = false);
            }
        }
        match build(&layouts, &SavePlanOptions::default()) {
            Err(PlanError::Gap { key, covered, total, missing }) => {
                prop_assert_eq!(key.as_str(), t.key.as_str());
                prop_assert_eq!(total, u128::from(numel(&t.shape)));
                prop_assert_eq!(covered, total - u128::from(numel(p.region.shape())));
                let point = Region::new(missing.clone(), vec![1; missing.len()]).unwrap();
                prop_assert!(
                    inside(&point, &p.region),
                    "missing element {:?} is not in the removed piece {}",
                    missing,
                    p.region
                );
            }
            other => prop_assert!(false, "expected a gap in {} at {}, got {:?}", t.key, p.region, other),
        }
    }

    /// A main piece grown into its neighbours, or a second main copy of (part of) a piece, is
    /// an `Overlap` naming two intersecting main boxes and the ranks holding them.
    #[test]
    fn overlapping_main_pieces_are_an_overlap(
        case in g::save_case(g::PLAN, 1),
        pick in any::<usize>(),
        axis in any::<usize>(),
        grow in any::<u64>(),
        rank in any::<u32>(),
        sub in proptest::collection::vec((0u16..=1000, 0u16..=1000), 4),
    ) {
        let candidates = nonempty_pieces(&case);
        prop_assume!(!candidates.is_empty());
        let (ti, pi) = candidates[pick % candidates.len()];
        let (t, p) = (&case.tensors[ti], &case.tensors[ti].pieces[pi]);
        let mut layouts = case.layouts();
        let nd = t.shape.len();
        let growable: Vec<usize> = (0..nd).filter(|&d| p.region.offset()[d] + p.region.shape()[d] < t.shape[d]).collect();
        if !growable.is_empty() && grow % 2 == 0 {
            // Grow the main holder's piece along one axis into its neighbours.
            let d = growable[axis % growable.len()];
            let room = t.shape[d] - p.region.offset()[d] - p.region.shape()[d];
            let l = &mut layouts[p.main as usize];
            let id = l.tensors.iter().position(|x| x.key.as_str() == t.key).unwrap() as u32;
            let x = l.pieces.iter_mut().find(|x| x.tensor == id && x.region == p.region).unwrap();
            x.region = x.region.with_axis(d, x.region.offset()[d], x.region.shape()[d] + 1 + (grow / 2) % room).unwrap();
        } else {
            // Another rank (or the same one, when alone) also claims part of the piece as main.
            let s = sub_box(&p.region, &sub);
            let mut q = rank % case.world;
            if q == p.main && s == p.region && case.world > 1 {
                q = (q + 1) % case.world;
            }
            let l = &mut layouts[q as usize];
            let id = decl_of(l, &t.key, t.dtype, &t.shape);
            match l.pieces.iter_mut().find(|x| x.tensor == id && x.region == s && !(q == p.main && s == p.region)) {
                Some(x) => x.main = true,
                None => l.pieces.push(PieceDecl { tensor: id, region: s, main: true, auto: false }),
            }
        }
        let mains: HashSet<(u32, Region)> = layouts
            .iter()
            .enumerate()
            .flat_map(|(r, l)| {
                l.pieces
                    .iter()
                    .filter(|x| x.main && l.tensors[x.tensor as usize].key.as_str() == t.key)
                    .map(move |x| (r as u32, x.region.clone()))
            })
            .collect();
        match build(&layouts, &SavePlanOptions::default()) {
            Err(PlanError::Overlap { key, first, first_ranks, second, second_ranks }) => {
                prop_assert_eq!(key.as_str(), t.key.as_str());
                prop_assert!(
                    first.intersect(&second).is_some(),
                    "reported boxes {} and {} do not intersect",
                    first,
                    second
                );
                prop_assert!(!first_ranks.is_empty() && !second_ranks.is_empty());
                for (b, ranks) in [(&first, &first_ranks), (&second, &second_ranks)] {
                    for r in ranks {
                        prop_assert!(mains.contains(&(*r, b.clone())), "rank {} does not hold {} as main", r, b);
                    }
                }
                if first == second {
                    prop_assert!(first_ranks.len() >= 2, "one box main on {:?} is no overlap", first_ranks);
                }
            }
            other => prop_assert!(false, "expected an overlap in {} around {}, got {:?}", t.key, p.region, other),
        }
    }

    /// A rank declaring another data type or global shape for a tensor is a `Disagreement`
    /// listing every variant with the ranks that declared it.
    #[test]
    fn disagreeing_declarations_are_reported(
        case in g::save_case(g::PLAN, 2),
        pick in any::<usize>(),
        other in any::<u32>(),
        change in any::<u8>(),
        by in 1u64..=3,
        shape_change in any::<bool>(),
    ) {
        let ti = pick % case.tensors.len();
        let t = &case.tensors[ti];
        let mut layouts = case.layouts();
        let declares = |l: &RankLayout| l.tensors.iter().any(|x| x.key.as_str() == t.key);
        let declarers: Vec<u32> = (0..case.world).filter(|&r| declares(&layouts[r as usize])).collect();
        let r1 = declarers[0];
        let r2 = (r1 + 1 + other % (case.world - 1)) % case.world;
        let l = &mut layouts[r2 as usize];
        let id = decl_of(l, &t.key, t.dtype, &t.shape) as usize;
        let has_pieces = l.pieces.iter().any(|x| x.tensor as usize == id);
        let decl = &mut l.tensors[id];
        let what = if shape_change && (!t.shape.is_empty() || !has_pieces) {
            if t.shape.is_empty() || (!has_pieces && change % 2 == 0) {
                decl.global_shape.push(by);
            } else {
                let d = usize::from(change) % t.shape.len();
                decl.global_shape[d] += by; // pieces stay inside
            }
            "global shape"
        } else {
            let i = DType::ALL.iter().position(|d| *d == t.dtype).unwrap();
            decl.dtype = DType::ALL[(i + 1 + usize::from(change) % 14) % 15];
            "data type"
        };
        // Expected variants: each distinct declaration with the ranks declaring it.
        let mut expected: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (r, l) in layouts.iter().enumerate() {
            if let Some(d) = l.tensors.iter().find(|x| x.key.as_str() == t.key) {
                let v = if what == "data type" { d.dtype.to_string() } else { format!("{:?}", d.global_shape) };
                expected.entry(v).or_default().push(r as u32);
            }
        }
        match build(&layouts, &SavePlanOptions::default()) {
            Err(e @ PlanError::Disagreement { .. }) => {
                let msg = e.to_string();
                let PlanError::Disagreement { key, what: got_what, variants } = e else { unreachable!() };
                prop_assert_eq!(key.as_str(), t.key.as_str());
                prop_assert_eq!(got_what, what);
                let got: BTreeMap<String, Vec<u32>> =
                    variants.into_iter().map(|(v, mut r)| { r.sort_unstable(); (v, r) }).collect();
                prop_assert_eq!(got, expected);
                prop_assert!(msg.contains(&t.key) && msg.contains("ranks"), "{}", msg);
            }
            other => prop_assert!(false, "expected a disagreement on {} of {}, got {:?}", what, t.key, other),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Load reads
// ---------------------------------------------------------------------------------------------

/// A stored geometry (chunks possibly larger than the tensor, as other tools may write) and a
/// request inside the tensor (sometimes empty).
#[derive(Debug, Clone)]
struct ReadCase {
    geom: StoredGeometry,
    request: Region,
}

fn read_case() -> impl Strategy<Value = ReadCase> {
    let dims = proptest::collection::vec(
        (
            1u64..=12,
            0u64..=14,
            any::<usize>(),
            0u16..=1000,
            0u16..=1000,
        ),
        0..=4,
    );
    (
        dims,
        prop::sample::select(vec![1usize, 2, 4, 8]),
        prop::bool::weighted(0.05),
    )
        .prop_map(|(dims, elem, empty)| {
            let mut global_shape = Vec::new();
            let mut chunk_shape = Vec::new();
            let mut subchunk_shape = Vec::new();
            let mut offset = Vec::new();
            let mut shape = Vec::new();
            for (i, (dim, c, s, a, b)) in dims.into_iter().enumerate() {
                let c = 1 + c % (dim + 2); // 1..=dim+2
                let divisors: Vec<u64> = (1..=c).filter(|x| c % x == 0).collect();
                let o = (dim - 1) * u64::from(a) / 1000;
                global_shape.push(dim);
                chunk_shape.push(c);
                subchunk_shape.push(divisors[s % divisors.len()]);
                offset.push(o);
                shape.push(if empty && i == 0 {
                    0
                } else {
                    1 + (dim - o - 1) * u64::from(b) / 1000
                });
            }
            ReadCase {
                geom: StoredGeometry {
                    global_shape,
                    chunk_shape,
                    subchunk_shape,
                    elem,
                },
                request: Region::new(offset, shape).unwrap(),
            }
        })
}

/// True when the elements of `part` occupy consecutive positions of a C-order buffer holding
/// `within` (checked element by element).
fn contiguous_in(part: &Region, within: &Region) -> bool {
    let mut prev: Option<u64> = None;
    let mut ok = true;
    for_each_element(part, |i| {
        let l = linear_in(i, within);
        ok &= prev.is_none_or(|p| l == p + 1);
        prev = Some(l);
    });
    ok
}

proptest! {
    #![proptest_config(config(512))]

    /// The needed boxes tile the request exactly; every subchunk read intersects it; `direct`
    /// is set exactly for whole subchunks that land contiguously in the buffer.
    #[test]
    fn reads_tile_the_request(case in read_case()) {
        let ReadCase { geom, request } = &case;
        let reads = geom.reads_for(request);
        if request.is_empty() {
            prop_assert!(reads.is_empty());
            return Ok(());
        }
        let per_shard: Vec<u64> = geom.chunk_shape.iter().zip(&geom.subchunk_shape).map(|(c, s)| c / s).collect();
        let mut cover = vec![0u32; numel(request.shape()) as usize];
        let mut prev_chunk: Option<&Vec<u64>> = None;
        for shard in &reads {
            prop_assert!(prev_chunk.is_none_or(|p| p < &shard.chunk), "shards not in C order");
            prev_chunk = Some(&shard.chunk);
            let origin: Vec<u64> = shard.chunk.iter().zip(&geom.chunk_shape).map(|(i, c)| i * c).collect();
            let chunk_box = Region::new(origin.clone(), geom.chunk_shape.clone()).unwrap();
            prop_assert!(!shard.subchunks.is_empty(), "shard {:?} read for nothing", shard.chunk);
            let mut prev_linear: Option<u64> = None;
            for s in &shard.subchunks {
                prop_assert!(prev_linear.is_none_or(|p| p < s.linear), "subchunks not in C order");
                prev_linear = Some(s.linear);
                prop_assert_eq!(s.stored.shape(), &geom.subchunk_shape);
                prop_assert!(inside(&s.stored, &chunk_box), "subchunk {} outside its shard {}", s.stored, chunk_box);
                let idx: Vec<u64> =
                    (0..origin.len()).map(|d| (s.stored.offset()[d] - origin[d]) / geom.subchunk_shape[d]).collect();
                prop_assert!(idx.iter().zip(&per_shard).zip(s.stored.offset()).zip(&origin).zip(&geom.subchunk_shape)
                    .all(|((((i, n), o), g), sub)| i < n && (o - g) % sub == 0), "subchunk {} misplaced", s.stored);
                let linear = idx.iter().zip(&per_shard).fold(0, |acc, (i, n)| acc * n + i);
                prop_assert_eq!(s.linear, linear, "linear index of {}", s.stored);
                prop_assert_eq!(Some(s.needed.clone()), s.stored.intersect(request), "needed part of {}", s.stored);
                for_each_element(&s.needed, |i| cover[linear_in(i, request) as usize] += 1);
                let want_direct = s.needed == s.stored && contiguous_in(&s.needed, request);
                prop_assert_eq!(s.direct, want_direct, "direct flag of {} for {}", s.stored, request);
            }
        }
        prop_assert!(cover.iter().all(|&c| c == 1), "request elements read {:?} times", cover);
    }
}

// ---------------------------------------------------------------------------------------------
// Regressions found by the properties above, as minimal cases
// ---------------------------------------------------------------------------------------------

fn one_tensor_layout(shape: &[u64], pieces: &[(&[u64], &[u64], bool)]) -> RankLayout {
    RankLayout {
        tensors: vec![TensorDecl {
            key: TensorKey::new("w").unwrap(),
            dtype: DType::Float32,
            global_shape: shape.to_vec(),
        }],
        pieces: pieces
            .iter()
            .map(|(o, s, main)| PieceDecl {
                tensor: 0,
                region: Region::new(o.to_vec(), s.to_vec()).unwrap(),
                main: *main,
                auto: false,
            })
            .collect(),
    }
}

/// `torch.chunk`-style sharding of 2 rows over 4 ranks (what `common::chunk_split` and DTensor
/// produce) leaves ranks 2 and 3 with the same empty piece `[2..2]`. Empty pieces hold no
/// element, so they cannot overlap; the plan must accept the layout (it used to report
/// `PlanError::Overlap`).
#[test]
fn identical_empty_main_pieces_do_not_overlap() {
    let layouts: Vec<RankLayout> = common::chunk_split(2, 4)
        .into_iter()
        .map(|(o, l)| one_tensor_layout(&[2, 3], &[(&[o, 0], &[l, 3], true)]))
        .collect();
    assert_eq!(layouts[2], layouts[3]);
    let plan = build(&layouts, &SavePlanOptions::default())
        .expect("rows 0..1 and 1..2 cover the tensor exactly once");
    assert_eq!(
        plan.tensors[0]
            .pieces
            .iter()
            .filter(|p| !p.region.is_empty())
            .count(),
        2
    );
}

/// Every rank's own plan from the world's rule-based description (combined in a tree, as the
/// communicator does), for a case.
#[allow(clippy::result_large_err)] // PlanError is the library's type
fn ruled_plans(
    layouts: &[RankLayout],
    opts: &SavePlanOptions,
) -> Result<Vec<zarrckpt::plan::ruled::RankPlan>, PlanError> {
    use zarrckpt::plan::rule::{Summary, Template, World};
    let leaves: Vec<Summary> = layouts
        .iter()
        .enumerate()
        .map(|(r, l)| {
            let (t, c) = Template::describe(l);
            prop_assert_eq!(
                &t.instantiate(&c, r).unwrap(),
                l,
                "rank {} does not round-trip",
                r
            );
            Ok(Summary::leaf(r as u64, t.encode(), &c))
        })
        .collect::<Result<_, TestCaseError>>()
        .unwrap();
    fn heap(leaves: &[Summary], i: usize) -> Summary {
        let mut s = leaves[i].clone();
        for c in [2 * i + 1, 2 * i + 2] {
            if c < leaves.len() {
                s = s.merge(&heap(leaves, c)).unwrap();
            }
        }
        s
    }
    let s = Summary::decode(&heap(&leaves, 0).encode(), 0).unwrap();
    let w = World::from_summary(&s, layouts.len()).unwrap();
    (0..layouts.len() as u32)
        .map(|r| zarrckpt::plan::ruled::plan_save(&w, r, opts))
        .collect()
}

proptest! {
    #![proptest_config(config(192))]

    /// The rule-based planner (what a save runs) accepts exactly the layouts the general one
    /// accepts, chooses the same grids, and its ranks together write every chunk exactly once,
    /// each from a piece the writer holds, and every array document once.
    #[test]
    fn rule_plans_agree_with_the_general_plan(case in g::save_case(g::PLAN, 1), opts in plan_options()) {
        check_rule_plans(&case, &opts)?;
    }
}

/// The plan each rank builds from the world's rule-based description agrees with the general
/// plan: the same chunk grids, every chunk written once by a rank holding its parts.
fn check_rule_plans(case: &SaveCase, opts: &SavePlanOptions) -> Result<(), TestCaseError> {
    let layouts = case.layouts();
    let general = build(&layouts, opts);
    let ruled = ruled_plans(&layouts, opts);
    let (general, ruled) = match (general, ruled) {
        (Ok(g), Ok(r)) => (g, r),
        (Err(_), Err(_)) => return Ok(()),
        (g, r) => {
            return Err(TestCaseError::fail(format!(
                "general {:?} but rule-based {:?}",
                g.err(),
                r.err()
            )));
        }
    };
    let held = held_pieces(&layouts);
    for (ti, tp) in general.tensors.iter().enumerate() {
        for (r, rp) in ruled.iter().enumerate() {
            let t = &rp.plan.tensors[ti];
            prop_assert_eq!(&t.key, &tp.key);
            if !t.aligned && t.pieces.is_empty() {
                continue; // a flat cut: chunks of whole rows holding whole parts
            }
            prop_assert_eq!(&t.chunk_shape, &tp.chunk_shape, "{} on rank {}", tp.key, r);
            prop_assert_eq!(&t.subchunk_shape, &tp.subchunk_shape, "{}", tp.key);
            prop_assert_eq!(t.aligned, tp.aligned, "{}", tp.key);
        }
        let mut written: HashMap<Vec<u64>, u32> = HashMap::new();
        let mut elements = 0u64;
        let mut documents = 0;
        for (r, rp) in ruled.iter().enumerate() {
            documents += rp.tasks.metadata.iter().filter(|&&m| m == ti).count();
            for w in rp.tasks.writes.iter().filter(|w| w.tensor == ti) {
                prop_assert!(
                    written.insert(w.chunk.clone(), r as u32).is_none(),
                    "{} chunk {:?} written twice",
                    tp.key,
                    w.chunk
                );
                elements += numel(w.region.shape());
                for p in &w.parts {
                    if let Source::Local(piece) = &p.source {
                        prop_assert!(
                            held.contains(&(r as u32, tp.key.to_string(), piece.clone())),
                            "rank {} writes {} from {} it does not hold",
                            r,
                            tp.key,
                            piece
                        );
                    }
                }
            }
        }
        prop_assert_eq!(
            elements,
            numel(&tp.global_shape),
            "{}: elements written",
            tp.key
        );
        prop_assert_eq!(documents, 1, "{}: array documents", tp.key);
    }
    Ok(())
}

/// Found by `rule_plans_agree_with_the_general_plan`: replicated row blocks too small for
/// chunks of their own (an unaligned, refined grid), with replica balancing moving writers
/// because another tensor already loads rank 1. The rule-based plan chose chunks of 4 rows,
/// the general one 7.
#[test]
fn refined_grids_agree_when_balancing_moves_writers() {
    let rows = |o: u64, l: u64, cols: u64, main: u32, holders: &[u32]| g::PieceCase {
        region: Region::new(vec![o, 0], vec![l, cols]).unwrap(),
        main,
        holders: holders.to_vec(),
    };
    let case = SaveCase {
        world: 2,
        rotate: false,
        tensors: vec![
            g::TensorCase {
                key: "layers.0.weight".into(),
                dtype: DType::Bool,
                shape: vec![10, 42],
                pieces: vec![rows(0, 10, 42, 1, &[1])],
                strays: vec![],
            },
            g::TensorCase {
                key: "optimizer/exp_avg/t1".into(),
                dtype: DType::Bool,
                shape: vec![11, 17],
                pieces: vec![
                    rows(0, 1, 17, 1, &[0, 1]),
                    rows(1, 2, 17, 0, &[0, 1]),
                    rows(3, 1, 17, 1, &[0, 1]),
                    rows(4, 7, 17, 0, &[0, 1]),
                ],
                strays: vec![],
            },
        ],
    };
    let opts = SavePlanOptions {
        grid: GridOptions {
            subchunk_target_bytes: 1,
            min_chunk_bytes: 256,
        },
        balance_replicas: true,
    };
    check_rule_plans(&case, &opts).unwrap();
}
