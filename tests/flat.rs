//! Flat (ZeRO / FSDP1) pieces and replicated declarations, end to end.
//!
//! - The decomposition of a flat range into boxes covers exactly the range, in order, with at
//!   most `2 * ndim - 1` boxes (property test).
//! - Saves of random flat and box splits (mixed on one rank too), loaded back as other flat
//!   splits and as boxes, give back every element; every element is written by exactly one
//!   chunk write (property test over the plan, then through real storage).
//! - Typical flat layouts get sensible chunk grids (no tiny shards, few parts sent between
//!   ranks); the test prints the bytes sent point to point against the bytes saved.
//! - Boxes declared `ShardedTensor::replicated` on every holder are stored once; the error for
//!   a box declared main on several ranks names them and says what to set.
//!
//! The tests through storage also run on `memory://` and `s3://` (SeaweedFS;
//! `tests/common/target.rs`), the property test with fewer cases there.

mod common;

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use common::target::Target;

use proptest::prelude::*;
use zarrckpt::comm::run_local;
use zarrckpt::model::flat::{box_flat_range, flat_boxes};
use zarrckpt::plan::save::Source;
use zarrckpt::plan::{
    GatheredLayouts, GridOptions, PieceDecl, RankLayout, SavePlan, SavePlanOptions, TensorDecl,
};
use zarrckpt::{
    Communicator, Error, LoadOptions, LoadTarget, PlanError, Region, ShardedTensor, load, save,
};
use zarrckpt::{SaveOptions, SaveReport};

const TIMEOUT: Duration = Duration::from_secs(60);

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Flat index of every element of `region` in C order (the order its data is stored in).
fn flat_indices(shape: &[u64], region: &Region) -> Vec<u64> {
    let mut out = Vec::new();
    if region.is_empty() {
        return out;
    }
    let n = region.ndim();
    let mut idx = region.offset().to_vec();
    loop {
        out.push(idx.iter().zip(shape).fold(0u64, |a, (i, s)| a * s + i));
        let mut d = n;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < region.end(d) {
                break;
            }
            idx[d] = region.offset()[d];
        }
    }
}

/// Sorted cut points `0 = c0 <= c1 <= .. <= ck = len` from raw fractions.
fn cuts(len: u64, raw: &[u16]) -> Vec<u64> {
    let mut c: Vec<u64> = raw.iter().map(|&x| u64::from(x) * len / 1000).collect();
    c.push(0);
    c.push(len);
    c.sort_unstable();
    c
}

proptest! {
    #![proptest_config(config(400))]

    /// The boxes cover exactly `[start, end)`, in order, each contiguous in the flattening,
    /// none empty, at most `2 * ndim - 1` of them; their `start`s are running offsets.
    #[test]
    fn decomposition_covers_the_range_in_order(
        shape in proptest::collection::vec(0u64..=6, 0..=5),
        a in 0u16..=1000,
        b in 0u16..=1000,
    ) {
        let len = numel(&shape);
        let (a, b) = (u64::from(a.min(b)) * len / 1000, u64::from(a.max(b)) * len / 1000);
        let boxes = flat_boxes(&shape, a..b).unwrap();
        prop_assert!(boxes.len() <= (2 * shape.len()).saturating_sub(1).max(1));
        let mut next = a;
        for fb in &boxes {
            prop_assert!(!fb.region.is_empty());
            fb.region.check_within(&shape).unwrap();
            prop_assert_eq!(fb.start, next - a);
            for i in flat_indices(&shape, &fb.region) {
                prop_assert_eq!(i, next);
                next += 1;
            }
            let r = box_flat_range(&shape, &fb.region).unwrap();
            prop_assert_eq!(r.start, a + fb.start);
        }
        prop_assert_eq!(next, b);
        if b < len || a > 0 {
            prop_assert!(flat_boxes(&shape, a..len + 1).is_err());
        }
    }
}

/// How one segment of the flattening is declared.
#[derive(Debug, Clone, Copy)]
enum Decl {
    /// One flat piece.
    Flat,
    /// One box piece per box of its decomposition.
    Boxes,
}

/// A save case: a tensor's flattening cut into segments, each held by a rank and declared
/// flat or as boxes; optionally every piece also held as a copy by another rank (explicit
/// replica id or replicated declaration on all holders).
#[derive(Debug, Clone)]
struct FlatCase {
    shape: Vec<u64>,
    world: u32,
    /// (segment, owner, declaration)
    segments: Vec<(Range<u64>, u32, Decl)>,
    /// 0: no copies; 1: copies with replica id 1; 2: every holder declares `Replica::Auto`
    /// (only for segments declared as boxes: identical boxes form a group).
    copies: u8,
}

fn flat_case() -> impl Strategy<Value = FlatCase> {
    (
        proptest::collection::vec(1u64..=7, 1..=3),
        1u32..=4,
        proptest::collection::vec(0u16..=1000, 0..=5),
        proptest::collection::vec((any::<u32>(), any::<bool>()), 7),
        0u8..=2,
    )
        .prop_map(|(shape, world, raw, who, copies)| {
            let c = cuts(numel(&shape), &raw);
            let segments = c
                .windows(2)
                .zip(&who)
                .map(|(w, &(r, flat))| {
                    (
                        w[0]..w[1],
                        r % world,
                        if flat { Decl::Flat } else { Decl::Boxes },
                    )
                })
                .collect();
            FlatCase {
                shape,
                world,
                segments,
                copies: if world > 1 { copies } else { 0 },
            }
        })
}

/// The pieces rank `r` holds, over `data` (the whole tensor, value = flat index).
fn pieces_of<'a>(case: &FlatCase, r: u32, data: &'a [u32]) -> Vec<ShardedTensor<'a>> {
    let mut out = Vec::new();
    for (i, (seg, owner, decl)) in case.segments.iter().enumerate() {
        let copy_holder = (owner + 1 + (i as u32 % (case.world - 1).max(1))) % case.world;
        let replica = if *owner == r {
            0
        } else if case.copies > 0 && copy_holder == r {
            1
        } else {
            continue;
        };
        let slice = &data[seg.start as usize..seg.end as usize];
        let auto = case.copies == 2 && matches!(decl, Decl::Boxes);
        match decl {
            Decl::Flat => out.push(
                ShardedTensor::from_flat_slice("t", &case.shape, seg.clone(), slice, replica)
                    .unwrap(),
            ),
            Decl::Boxes => {
                for fb in flat_boxes(&case.shape, seg.clone()).unwrap() {
                    let s = &data[(seg.start + fb.start) as usize..];
                    let s = &s[..fb.region.num_elements().unwrap() as usize];
                    let p = if auto {
                        ShardedTensor::replicated(
                            "t",
                            &case.shape,
                            fb.region.offset(),
                            s,
                            fb.region.shape(),
                        )
                    } else {
                        ShardedTensor::from_slice(
                            "t",
                            &case.shape,
                            fb.region.offset(),
                            s,
                            fb.region.shape(),
                            replica,
                        )
                    };
                    out.push(p.unwrap());
                }
            }
        }
    }
    out
}

/// The layouts `save` would gather from these pieces.
fn layouts_of(per_rank: &[Vec<ShardedTensor<'_>>]) -> Vec<RankLayout> {
    per_rank
        .iter()
        .map(|pieces| {
            let mut l = RankLayout::default();
            for p in pieces.iter().flat_map(ShardedTensor::box_pieces) {
                if l.tensors.is_empty() {
                    l.tensors.push(TensorDecl {
                        key: p.key().clone(),
                        dtype: p.dtype(),
                        global_shape: p.global_shape().to_vec(),
                    });
                }
                l.pieces.push(PieceDecl {
                    tensor: 0,
                    region: p.region().clone(),
                    main: p.is_main(),
                    auto: p.is_auto_replica(),
                });
            }
            l
        })
        .collect()
}

/// Checks that the plan's chunk writes cover every element exactly once, and that every
/// write's parts cover its chunk exactly once. Returns (bytes sent between ranks, bytes
/// saved, number of chunks).
fn check_written_once(plan: &SavePlan, world: u32) -> (u64, u64, u64) {
    let tp = &plan.tensors[0];
    let elem = tp.dtype.size() as u64;
    let mut count: HashMap<u64, u32> = HashMap::new();
    let (mut sent, mut saved, mut chunks) = (0u64, 0u64, 0u64);
    for r in 0..world {
        let tasks = plan.tasks_for(r);
        for w in &tasks.writes {
            chunks += 1;
            let mut in_chunk: HashMap<u64, u32> = HashMap::new();
            for part in &w.parts {
                assert!(w.region.contains(&part.region));
                for i in flat_indices(&tp.global_shape, &part.region) {
                    *in_chunk.entry(i).or_default() += 1;
                }
                if let Source::Remote(from) = part.source {
                    assert_ne!(from, r);
                    sent += part.region.num_elements().unwrap() * elem;
                }
            }
            let want = flat_indices(&tp.global_shape, &w.region);
            assert_eq!(in_chunk.len(), want.len(), "parts of chunk {:?}", w.chunk);
            assert!(in_chunk.values().all(|&n| n == 1));
            for i in want {
                *count.entry(i).or_default() += 1;
            }
            saved += w.region.num_elements().unwrap() * elem;
        }
    }
    let n = numel(&tp.global_shape);
    assert_eq!(count.len() as u64, n, "every element written");
    assert!(count.values().all(|&c| c == 1), "no element written twice");
    (sent, saved, chunks)
}

fn run_save(
    case: &FlatCase,
    data: &[u32],
    dir: &std::path::Path,
    opts: &SaveOptions,
) -> Vec<Result<SaveReport, Error>> {
    run_local(case.world as usize, TIMEOUT, |comm| {
        let pieces = pieces_of(case, comm.rank() as u32, data);
        save(&pieces, dir, &comm, opts)
    })
}

/// Loads `t` with `world` ranks, rank `r` asking for the flat ranges `flat[r]` and the boxes
/// `boxes[r]`, and checks every element.
fn load_and_check(
    dir: &std::path::Path,
    shape: &[u64],
    flat: &[Vec<Range<u64>>],
    boxes: &[Vec<Region>],
) {
    let world = flat.len();
    let res = run_local(world, TIMEOUT, |comm| {
        let r = comm.rank();
        let mut fbufs: Vec<Vec<u32>> = flat[r]
            .iter()
            .map(|x| vec![u32::MAX; (x.end - x.start) as usize])
            .collect();
        let mut bbufs: Vec<Vec<u32>> = boxes[r]
            .iter()
            .map(|b| vec![u32::MAX; b.num_elements().unwrap() as usize])
            .collect();
        let mut targets = Vec::new();
        for (x, buf) in flat[r].iter().zip(fbufs.iter_mut()) {
            targets.push(LoadTarget::from_flat_slice("t", shape, x.clone(), buf).unwrap());
        }
        for (b, buf) in boxes[r].iter().zip(bbufs.iter_mut()) {
            targets.push(LoadTarget::from_slice("t", shape, b.offset(), buf, b.shape()).unwrap());
        }
        load(&mut targets, dir, &comm, &LoadOptions::default())?;
        drop(targets);
        for (x, buf) in flat[r].iter().zip(&fbufs) {
            let want: Vec<u32> = (x.start..x.end).map(|i| i as u32).collect();
            assert_eq!(buf, &want, "rank {r} flat {x:?}");
        }
        for (b, buf) in boxes[r].iter().zip(&bbufs) {
            let want: Vec<u32> = flat_indices(shape, b).iter().map(|&i| i as u32).collect();
            assert_eq!(buf, &want, "rank {r} box {b}");
        }
        Ok::<(), Error>(())
    });
    for r in res {
        r.unwrap();
    }
}

proptest! {
    #![proptest_config(config(24))]

    /// Random flat and box splits (mixed on one rank, with or without copies), small grid
    /// thresholds so that unaligned chunks show up: the plan writes every element exactly
    /// once, and loading other flat splits and row boxes gives back every element.
    #[test]
    fn flat_and_box_splits_round_trip(
        case in flat_case(),
        load_world in 1usize..=3,
        load_cuts in proptest::collection::vec(0u16..=1000, 0..=4),
        min_chunk_bytes in prop_oneof![Just(0u64), Just(16), Just(1 << 20)],
    ) {
        flat_round_trip(Target::Local, &case, load_world, &load_cuts, min_chunk_bytes);
    }
}

/// One case of `flat_and_box_splits_round_trip` on `target`.
fn flat_round_trip(
    target: Target,
    case: &FlatCase,
    load_world: usize,
    load_cuts: &[u16],
    min_chunk_bytes: u64,
) {
    let n = numel(&case.shape);
    let data: Vec<u32> = (0..n as u32).collect();
    let per_rank: Vec<Vec<ShardedTensor<'_>>> =
        (0..case.world).map(|r| pieces_of(case, r, &data)).collect();
    let grid = GridOptions {
        min_chunk_bytes,
        subchunk_target_bytes: 8,
    };
    let g = GatheredLayouts::from_layouts(&layouts_of(&per_rank));
    let plan = SavePlan::build(
        &g,
        &SavePlanOptions {
            grid,
            balance_replicas: true,
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{case:?}"));
    check_written_once(&plan, case.world);

    let tmp = tempfile::tempdir().unwrap();
    let dir = target.path(tmp.path(), "ck");
    let opts = SaveOptions {
        grid,
        ..SaveOptions::default()
    };
    for r in run_save(case, &data, &dir, &opts) {
        r.unwrap_or_else(|e| panic!("{e}\n{case:?}"));
    }
    // Rank r loads every load_world-th segment of another flat split, and row boxes.
    let c = cuts(n, load_cuts);
    let mut flat = vec![Vec::new(); load_world];
    for (i, w) in c.windows(2).enumerate() {
        flat[i % load_world].push(w[0]..w[1]);
    }
    let rows = case.shape[0];
    let boxes: Vec<Vec<Region>> = (0..load_world as u64)
        .map(|r| {
            let (a, b) = (
                rows * r / load_world as u64,
                rows * (r + 1) / load_world as u64,
            );
            let mut shape = case.shape.clone();
            shape[0] = b - a;
            let mut offset = vec![0; shape.len()];
            offset[0] = a;
            vec![Region::new(offset, shape).unwrap()]
        })
        .collect();
    load_and_check(&dir, &case.shape, &flat, &boxes);
}

on_targets! {
    [memory, s3]
    /// `flat_and_box_splits_round_trip` on the object stores: 6 cases on `memory://` (random),
    /// 2 on `s3://` (SeaweedFS) from a fixed seed, the same on every run.
    fn stores_flat_and_box_splits_round_trip(target: Target) {
        use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
        let cases = if target == Target::S3 { 2 } else { 6 };
        let mut runner = if target == Target::S3 {
            TestRunner::new_with_rng(
                config(cases),
                TestRng::deterministic_rng(RngAlgorithm::ChaCha),
            )
        } else {
            TestRunner::new(config(cases))
        };
        let strategy = (
            flat_case(),
            1usize..=3,
            proptest::collection::vec(0u16..=1000, 0..=4),
            prop_oneof![Just(0u64), Just(16), Just(1 << 20)],
        );
        let result = runner.run(
            &strategy,
            |(case, load_world, load_cuts, min_chunk_bytes)| {
                flat_round_trip(target, &case, load_world, &load_cuts, min_chunk_bytes);
                Ok(())
            },
        );
        if let Err(e) = result {
            panic!("{target:?}: {e}");
        }
    }
}

/// Flat layouts as Megatron's distributed optimizer makes them: a parameter inside a bucket
/// cut evenly across data-parallel ranks, so the cuts fall at `x + i * L` in the parameter's
/// flattening. Prints the grid, the bytes sent point to point and the bytes saved.
#[test]
fn typical_flat_layouts_get_sensible_grids() {
    struct Layout {
        name: &'static str,
        shape: Vec<u64>,
        cuts: Vec<u64>,
    }
    let even = |n: u64, dp: u64| (0..=dp).map(|i| n * i / dp).collect::<Vec<u64>>();
    let shifted = |n: u64, dp: u64, x: u64| {
        let l = n.div_ceil(dp);
        let mut c = vec![0];
        c.extend((0..dp).map(|i| x + i * l).filter(|&v| v > 0 && v < n));
        c.push(n);
        c
    };
    let layouts = [
        Layout {
            name: "1-D bucket, 8 even DP ranges",
            shape: vec![8 << 20],
            cuts: even(8 << 20, 8),
        },
        Layout {
            name: "1-D param, ranges cut at x + i*L",
            shape: vec![3 << 20],
            cuts: shifted(3 << 20, 8, 123_457),
        },
        Layout {
            name: "[4096, 1024] f32, 8 row-aligned ranges",
            shape: vec![4096, 1024],
            cuts: even(4096 * 1024, 8),
        },
        Layout {
            name: "[4096, 1024] f32, 8 ranges cut at x + i*L",
            shape: vec![4096, 1024],
            cuts: shifted(4096 * 1024, 8, 300_001),
        },
        Layout {
            name: "[1024, 64, 64] f32, 6 ranges at odd offsets",
            shape: vec![1024, 64, 64],
            cuts: shifted(1024 * 64 * 64, 6, 77_777),
        },
        Layout {
            name: "[8192, 8192] f32, 8 ranges cut at x + i*L",
            shape: vec![8192, 8192],
            cuts: shifted(8192 * 8192, 8, 12_345_679),
        },
        Layout {
            name: "[32, 1048576] f32, 64 ranges (several per row)",
            shape: vec![32, 1 << 20],
            cuts: shifted(32 << 20, 64, 5_000),
        },
    ];
    println!(
        "{:<48} {:>16} {:>7} {:>8} {:>12} {:>12} {:>7}",
        "layout", "chunk", "chunks", "aligned", "saved B", "p2p B", "p2p %"
    );
    for l in &layouts {
        let world = (l.cuts.len() - 1) as u32;
        let per_rank: Vec<RankLayout> = l
            .cuts
            .windows(2)
            .map(|w| RankLayout {
                tensors: vec![TensorDecl {
                    key: zarrckpt::TensorKey::new("t").unwrap(),
                    dtype: zarrckpt::DType::Float32,
                    global_shape: l.shape.clone(),
                }],
                pieces: flat_boxes(&l.shape, w[0]..w[1])
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
            &GatheredLayouts::from_layouts(&per_rank),
            &SavePlanOptions::default(),
        )
        .unwrap();
        let tp = &plan.tensors[0];
        let (mut sent, mut saved) = (0u64, 0u64);
        let (mut max_parts, mut max_ranks) = (0, 0);
        for r in 0..world {
            for w in plan.tasks_for(r).writes {
                max_parts = max_parts.max(w.parts.len());
                let mut ranks: Vec<u32> = w
                    .parts
                    .iter()
                    .map(|p| match p.source {
                        Source::Remote(from) => from,
                        Source::Local(_) => r,
                    })
                    .collect();
                ranks.sort_unstable();
                ranks.dedup();
                max_ranks = max_ranks.max(ranks.len());
                saved += w.region.num_elements().unwrap() * 4;
                for p in &w.parts {
                    if matches!(p.source, Source::Remote(_)) {
                        sent += p.region.num_elements().unwrap() * 4;
                    }
                }
            }
        }
        let share = numel(&l.shape) * 4 / u64::from(world);
        let chunk_bytes = numel(&tp.chunk_shape) * 4;
        println!(
            "{:<48} {:>16} {:>7} {:>8} {:>12} {:>12} {:>6.2}%",
            l.name,
            format!("{:?}", tp.chunk_shape),
            tp.num_chunks(),
            tp.aligned,
            saved,
            sent,
            100.0 * sent as f64 / saved as f64
        );
        assert_eq!(saved, numel(&l.shape) * 4);
        // No tiny shards: a chunk is at least 1 MiB or a rank's whole share.
        assert!(
            chunk_bytes >= (1 << 20).min(share),
            "{}: chunk {chunk_bytes} B",
            l.name
        );
        // A bounded number of parts per chunk (each rank's range is at most 2 * ndim - 1
        // boxes), of ranks per chunk and of chunks per rank.
        let nd = l.shape.len();
        assert!(max_ranks <= 3, "{}: {max_ranks} ranks in one chunk", l.name);
        assert!(
            max_parts <= 2 * (2 * nd - 1),
            "{}: {max_parts} parts",
            l.name
        );
        assert!(tp.num_chunks() <= 4 * u64::from(world), "{}", l.name);
        // Aligned layouts send nothing; shifted ones at most half of every chunk.
        if tp.aligned {
            assert_eq!(sent, 0);
        }
        assert!(sent <= saved / 2, "{}", l.name);
    }
}

on_targets! {
    /// Flat to box, box to flat and flat to flat with other boundaries, through real storage,
    /// with a multi-dimensional tensor cut at arbitrary flat offsets.
    fn flat_saves_load_in_every_direction(target: Target) {
        let shape = vec![6u64, 5, 4];
        let n = numel(&shape);
        let data: Vec<u32> = (0..n as u32).collect();
        let tmp = tempfile::tempdir().unwrap();
        // flat save by 3 ranks at odd offsets
        let flat_dir = target.path(tmp.path(), "flat");
        let case = FlatCase {
            shape: shape.clone(),
            world: 3,
            segments: vec![
                (0..7, 0, Decl::Flat),
                (7..61, 1, Decl::Flat),
                (61..n, 2, Decl::Flat),
            ],
            copies: 0,
        };
        for r in run_save(&case, &data, &flat_dir, &SaveOptions::default()) {
            r.unwrap();
        }
        // box save by 2 ranks (rows 0..3 and 3..6)
        let box_dir = target.path(tmp.path(), "box");
        let res = run_local(2, TIMEOUT, |comm| {
            let r = comm.rank() as u64;
            let slice = &data[(r * 60) as usize..((r + 1) * 60) as usize];
            let p = ShardedTensor::from_slice("t", &shape, &[3 * r, 0, 0], slice, &[3, 5, 4], 0)?;
            save(&[p], &box_dir, &comm, &SaveOptions::default())
        });
        for r in res {
            r.unwrap();
        }
        let rows = |a: u64, b: u64| Region::new(vec![a, 0, 0], vec![b - a, 5, 4]).unwrap();
        let cols = Region::new(vec![1, 1, 1], vec![4, 3, 2]).unwrap();
        for dir in [&flat_dir, &box_dir] {
            // flat -> flat (other boundaries) and box -> flat
            load_and_check(
                dir,
                &shape,
                &[vec![0..33, 90..91], vec![33..90, 91..n], vec![5..5, 7..7]],
                &[vec![], vec![], vec![]],
            );
            // flat -> box, and box -> box
            load_and_check(
                dir,
                &shape,
                &[vec![], vec![]],
                &[vec![rows(0, 4), cols.clone()], vec![rows(4, 6)]],
            );
        }
    }
}

on_targets! {
    /// Every data-parallel rank declares the same biases `replicated`: stored once each, spread
    /// over the holders, and loaded back; a box declared main on several ranks is an error that
    /// names the ranks and says what to set.
    fn replicated_declarations_store_once_and_errors_say_what_to_set(target: Target) {
        let bias: Vec<f32> = (0..2048).map(|i| i as f32 * 0.5).collect();
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ck");
        let res = run_local(4, TIMEOUT, |comm| {
            let pieces: Vec<ShardedTensor<'_>> = (0..4)
                .map(|i| {
                    ShardedTensor::replicated(&format!("b{i}"), &[2048], &[0], &bias, &[2048]).unwrap()
                })
                .collect();
            save(&pieces, &dir, &comm, &SaveOptions::default())
        });
        let reports: Vec<SaveReport> = res.into_iter().map(Result::unwrap).collect();
        let chunks: Vec<usize> = reports.iter().map(|r| r.chunks_written).collect();
        assert_eq!(
            chunks,
            vec![1, 1, 1, 1],
            "each bias written once, one per rank"
        );
        assert_eq!(reports[0].data_bytes, 2048 * 4);
        let res = run_local(2, TIMEOUT, |comm| {
            let mut out = vec![vec![0f32; 1024]; 4];
            let r = comm.rank() as u64;
            let mut t: Vec<LoadTarget<'_>> = out
                .iter_mut()
                .enumerate()
                .map(|(i, b)| {
                    LoadTarget::from_slice(&format!("b{i}"), &[2048], &[1024 * r], b, &[1024]).unwrap()
                })
                .collect();
            load(&mut t, &dir, &comm, &LoadOptions::default())?;
            drop(t);
            for b in &out {
                assert_eq!(b[..], bias[(1024 * r) as usize..(1024 * (r + 1)) as usize]);
            }
            Ok::<(), Error>(())
        });
        for r in res {
            r.unwrap();
        }

        // Forgetting the declaration: all four claim the main replica.
        let res = run_local(4, TIMEOUT, |comm| {
            let p = ShardedTensor::from_slice("bias", &[2048], &[0], &bias, &[2048], 0)?;
            save(
                &[p],
                &target.path(tmp.path(), "bad"),
                &comm,
                &SaveOptions::default(),
            )
        });
        for r in res {
            let e = r.unwrap_err();
            let Error::Plan(p) = &e else { panic!("{e:?}") };
            assert!(
                matches!(p, PlanError::Overlap { first_ranks, first, second, .. }
                    if first_ranks == &vec![0, 1, 2, 3] && first == second),
                "{p:?}"
            );
            let msg = e.to_string();
            for want in [
                "`bias`",
                "ranks [0, 1, 2, 3] each declare [0..2048] as the main replica",
                "ShardedTensor::replicated",
                "non-zero replica id",
            ] {
                assert!(msg.contains(want), "{want:?} not in {msg}");
            }
        }
    }
}

on_targets! {
    /// ZeRO-3 / FSDP1 style: every rank holds part `r` of its tensor's flattening cut in parts of
    /// `S` elements, cut inside rows (so a part is up to three boxes), the last part shorter. These
    /// are described by one flat rule and planned without instantiating every rank's layout: chunks
    /// of whole rows holding whole parts, written by the holder of their first part. Saved on 7,
    /// 12 and 16 ranks, with data-parallel copies too, and loaded back as the same cut on more
    /// ranks (read groups share reads), as another cut and as row boxes, every element checked.
    fn zero_style_flat_parts_save_and_load_by_rule(target: Target) {
        let shape = [9u64, 10];
        let n = numel(&shape);
        let data: Vec<u32> = (0..n as u32).collect();
        let tmp = tempfile::tempdir().unwrap();
        for (world, copies, size) in [(7u64, 1u64, 13u64), (12, 1, 8), (16, 2, 12)] {
            let parts = world / copies;
            assert!(n.div_ceil(size) <= parts);
            let dir = target.path(tmp.path(), &format!("z{world}-{copies}-{size}"));
            let res = run_local(world as usize, TIMEOUT, |comm| {
                let r = comm.rank() as u64;
                let (part, copy) = (r % parts, r / parts);
                let a = (part * size).min(n);
                let b = (a + size).min(n);
                let piece = ShardedTensor::from_flat_slice(
                    "t",
                    &shape,
                    a..b,
                    &data[a as usize..b as usize],
                    u32::try_from(copy).unwrap(),
                )
                .unwrap();
                save(&[piece], &dir, &comm, &SaveOptions::default())
            });
            for r in res {
                r.unwrap_or_else(|e| panic!("world {world} size {size}: {e}"));
            }
            // Chunks of whole rows holding whole parts: lcm(size, 10) / 10 rows.
            let ck = zarrckpt::Checkpoint::open(&dir).unwrap();
            let entry = &ck.meta().tensors[&zarrckpt::TensorKey::new("t").unwrap()];
            let rows = (size * 10 / gcd(size, 10) / 10).min(shape[0]);
            assert_eq!(entry.chunk_shape, vec![rows, 10], "size {size}");
            // The same cut, every part asked for by two ranks (read once, shared).
            let cut: Vec<Vec<Range<u64>>> = (0..2 * parts)
                .map(|r| {
                    let a = ((r % parts) * size).min(n);
                    std::iter::once(a..(a + size).min(n)).collect()
                })
                .collect();
            load_and_check(&dir, &shape, &cut, &vec![Vec::new(); cut.len()]);
            // Another cut, and rows.
            let other: Vec<Vec<Range<u64>>> = (0..3u64)
                .map(|r| std::iter::once(n * r / 3..n * (r + 1) / 3).collect())
                .collect();
            let rows: Vec<Vec<Region>> = (0..3u64)
                .map(|r| vec![Region::new(vec![3 * r, 0], vec![3, 10]).unwrap()])
                .collect();
            load_and_check(&dir, &shape, &other, &rows);
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}
