//! Property tests through real storage: random tensors (0 to 4 dimensions, size-1 and
//! zero-size extents, every data type) saved by 1..=5 in-process ranks in random layouts
//! (uneven and multi-axis splits, data-parallel copies, unaligned tiny-chunk fallbacks, small
//! subchunks, compression) and loaded by 1..=5 ranks asking for other boxes (other splits,
//! overlapping and identical requests). Every loaded byte must equal the original.
//!
//! Cases are kept small (at most 600 elements per tensor, 24 cases per property) so the file
//! runs in seconds in debug builds; a failure prints the resolved save layout, the load
//! requests and the options, and names the first wrong element.
//!
//! The same three properties also run on the object stores (`tests/common/target.rs`), with
//! fewer cases since every case is a commit through the store: 8 cases each on `memory://`
//! (random, as the local ones), 2 each on `s3://` (SeaweedFS), drawn from a fixed seed so the
//! sample is the same on every run.

mod common;

use std::fmt;
use std::path::Path;
use std::time::Duration;

use common::r#gen::{self as g, LoadCase, SaveCase, numel};
use common::target::Target;
use common::{cut, tensor_bytes};
use proptest::collection::vec;
use proptest::prelude::*;
use zarrckpt::comm::run_local;
use zarrckpt::plan::GridOptions;
use zarrckpt::{
    Communicator, Compression, LoadOptions, LoadTarget, ReadMethod, SaveOptions, ShardedTensor,
    TensorKey, load, save,
};

/// Upper bound on one collective wait; a hang fails the case instead of the whole run.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Save and load options that vary between cases.
#[derive(Debug, Clone)]
struct Knobs {
    grid: GridOptions,
    compression: Compression,
    balance_replicas: bool,
    io_threads: usize,
    read_method: ReadMethod,
}

/// One round trip: what is saved how, and what is loaded.
#[derive(Clone)]
struct RoundTrip {
    save: SaveCase,
    load: LoadCase,
    knobs: Knobs,
}

impl fmt::Debug for RoundTrip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\n{:?}\n{:?}\n{:?}\n", self.knobs, self.save, self.load)
    }
}

/// Small grid options: tiny subchunks, tiny-chunk thresholds from "never" to "always".
fn grid_options() -> impl Strategy<Value = GridOptions> {
    (
        prop_oneof![1 => Just(0u64), 1 => Just(16), 1 => Just(256), 3 => Just(1 << 20)],
        prop_oneof![1 => Just(1u64), 1 => Just(8), 1 => Just(64), 1 => Just(1 << 20)],
    )
        .prop_map(|(min_chunk_bytes, subchunk_target_bytes)| GridOptions {
            min_chunk_bytes,
            subchunk_target_bytes,
        })
}

fn knobs(grid: impl Strategy<Value = GridOptions>) -> impl Strategy<Value = Knobs> {
    (
        grid,
        prop_oneof![3 => Just(Compression::None), 1 => Just(Compression::Zstd), 1 => Just(Compression::Blosc)],
        prop::bool::weighted(0.8),
        1usize..=2,
        prop_oneof![Just(ReadMethod::Mmap), Just(ReadMethod::Pread)],
    )
        .prop_map(
            |(grid, compression, balance_replicas, io_threads, read_method)| Knobs {
                grid,
                compression,
                balance_replicas,
                io_threads,
                read_method,
            },
        )
}

/// A save topology, a load topology over the same tensors, and options.
fn round_trip(grid: impl Strategy<Value = GridOptions>) -> impl Strategy<Value = RoundTrip> {
    let l = g::ROUNDTRIP;
    (
        g::save_case(l, 1),
        1..=l.max_world,
        vec(g::load_raw(), l.max_tensors),
        knobs(grid),
    )
        .prop_map(|(save, load_world, raws, knobs)| {
            let shapes: Vec<Vec<u64>> = save.tensors.iter().map(|t| t.shape.clone()).collect();
            RoundTrip {
                load: g::resolve_load(&shapes, load_world, &raws),
                save,
                knobs,
            }
        })
}

/// The flat span of a non-empty box: from its first to just past its last element in the
/// tensor's C-order flattening (the box itself when it is contiguous).
fn flat_span(shape: &[u64], b: &zarrckpt::Region) -> Option<std::ops::Range<u64>> {
    if b.is_empty() {
        return None;
    }
    let lin = |ix: &mut dyn Iterator<Item = u64>| ix.zip(shape).fold(0u64, |a, (i, s)| a * s + i);
    let start = lin(&mut b.offset().iter().copied());
    let last = lin(&mut (0..b.ndim()).map(|d| b.end(d) - 1));
    Some(start..last + 1)
}

/// Saves with every rank of the save case; with `flat`, every piece that is contiguous in the
/// flattening is declared as a flat piece.
fn save_all(
    rt: &RoundTrip,
    fulls: &[Vec<u8>],
    dir: &Path,
    flat: bool,
) -> Result<(), TestCaseError> {
    let case = &rt.save;
    let opts = SaveOptions {
        compression: rt.knobs.compression,
        grid: rt.knobs.grid,
        balance_replicas: rt.knobs.balance_replicas,
        io_threads: rt.knobs.io_threads,
        ..SaveOptions::default()
    };
    let results = run_local(case.world as usize, TIMEOUT, |comm| {
        let r = comm.rank() as u32;
        let held = case.held_by(r);
        let datas: Vec<Vec<u8>> = held
            .iter()
            .map(|h| {
                let t = &case.tensors[h.tensor];
                cut(&fulls[h.tensor], &t.shape, &h.region, t.dtype.size())
            })
            .collect();
        let pieces: Vec<ShardedTensor> = held
            .iter()
            .zip(&datas)
            .map(|(h, data)| {
                let t = &case.tensors[h.tensor];
                let key = TensorKey::new(t.key.as_str()).unwrap();
                let range = zarrckpt::model::flat::box_flat_range(&t.shape, &h.region);
                if let (true, Some(range)) = (flat, range) {
                    return ShardedTensor::from_flat(
                        key,
                        t.dtype,
                        t.shape.clone(),
                        range,
                        h.replica,
                        data,
                    )
                    .unwrap();
                }
                ShardedTensor::new(
                    key,
                    t.dtype,
                    t.shape.clone(),
                    h.region.clone(),
                    h.replica,
                    data,
                )
                .unwrap()
            })
            .collect();
        save(&pieces, dir, &comm, &opts).map_err(|e| e.to_string())
    });
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            return Err(TestCaseError::fail(format!("save failed on rank {r}: {e}")));
        }
    }
    Ok(())
}

/// Loads with every rank of the load case; returns each rank's filled buffers. With `flat`,
/// every non-empty request asks for its flat span instead of its box.
fn load_all(rt: &RoundTrip, dir: &Path, flat: bool) -> Result<Vec<Vec<Vec<u8>>>, TestCaseError> {
    let tensors = &rt.save.tensors;
    let opts = LoadOptions {
        io_threads: rt.knobs.io_threads,
        read_method: rt.knobs.read_method,
        ..LoadOptions::default()
    };
    let results = run_local(rt.load.world as usize, TIMEOUT, |comm| {
        let requests = &rt.load.requests[comm.rank()];
        // Garbage first, so bytes a load forgets to write show up.
        let span =
            |ti: usize, b: &zarrckpt::Region| flat_span(&tensors[ti].shape, b).filter(|_| flat);
        let mut bufs: Vec<Vec<u8>> = requests
            .iter()
            .map(|(ti, b)| {
                let n = span(*ti, b).map_or(numel(b.shape()), |r| r.end - r.start);
                vec![0xA5; n as usize * tensors[*ti].dtype.size()]
            })
            .collect();
        let mut targets: Vec<LoadTarget> = requests
            .iter()
            .zip(bufs.iter_mut())
            .map(|((ti, b), buf)| {
                let t = &tensors[*ti];
                if let Some(range) = span(*ti, b) {
                    let key = TensorKey::new(t.key.as_str()).unwrap();
                    return LoadTarget::from_flat(key, t.dtype, t.shape.clone(), range, buf)
                        .unwrap();
                }
                LoadTarget::new(
                    TensorKey::new(t.key.as_str()).unwrap(),
                    t.dtype,
                    t.shape.clone(),
                    b.clone(),
                    buf,
                )
                .unwrap()
            })
            .collect();
        let res = load(&mut targets, dir, &comm, &opts);
        drop(targets);
        res.map(|_| bufs).map_err(|e| e.to_string())
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            res.map_err(|e| TestCaseError::fail(format!("load failed on rank {r}: {e}")))
        })
        .collect()
}

/// Saves, loads, and compares every loaded buffer with the original bytes; with `flat`,
/// contiguous pieces are saved as flat pieces and requests ask for flat spans.
fn check_round_trip(rt: &RoundTrip, target: Target, flat: bool) -> Result<(), TestCaseError> {
    let tmp = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
    let dir = target.path(tmp.path(), "ckpt");
    let tensors = &rt.save.tensors;
    let fulls: Vec<Vec<u8>> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| tensor_bytes(i as u64 + 1, &t.shape, t.dtype))
        .collect();
    save_all(rt, &fulls, &dir, flat)?;
    let loaded = load_all(rt, &dir, flat)?;
    for (r, bufs) in loaded.iter().enumerate() {
        for ((ti, b), got) in rt.load.requests[r].iter().zip(bufs) {
            let t = &tensors[*ti];
            let elem = t.dtype.size();
            let want = match flat_span(&t.shape, b).filter(|_| flat) {
                Some(r) => fulls[*ti][r.start as usize * elem..r.end as usize * elem].to_vec(),
                None => cut(&fulls[*ti], &t.shape, b, elem),
            };
            if let Some(i) = want.iter().zip(got).position(|(w, g)| w != g) {
                let e = i / elem;
                return Err(TestCaseError::fail(format!(
                    "rank {r}, {} {} {:?}, request {b}: element {e} (C order in the request) is {:02x?}, expected {:02x?}",
                    t.key,
                    t.dtype,
                    t.shape,
                    &got[e * elem..(e + 1) * elem],
                    &want[e * elem..(e + 1) * elem],
                )));
            }
            prop_assert_eq!(got.len(), want.len());
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        max_shrink_iters: 400,
        // No regression files in the source tree: bugs found get named tests instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any save topology, any load topology, random grid options and compression.
    #[test]
    fn save_and_load_in_any_topology(rt in round_trip(grid_options())) {
        check_round_trip(&rt, Target::Local, false)?;
    }

    /// The same with flat declarations: pieces contiguous in the flattening saved as flat
    /// pieces (mixed with box pieces), every request asking for the flat span of its box.
    #[test]
    fn flat_pieces_and_requests_round_trip(rt in round_trip(grid_options())) {
        check_round_trip(&rt, Target::Local, true)?;
    }

    /// The tiny-chunk fallback for every unevenly split tensor: unaligned chunks assembled
    /// from parts that ranks send each other, with data-parallel copies among the senders.
    #[test]
    fn unaligned_fallback_round_trips(
        rt in round_trip(
            prop::sample::select(vec![1u64, 8, 1 << 20])
                .prop_map(|s| GridOptions { min_chunk_bytes: u64::MAX, subchunk_target_bytes: s }),
        ),
    ) {
        check_round_trip(&rt, Target::Local, false)?;
    }
}

/// Runs `check_round_trip` on `target` for a few cases of `strategy` (see the file's doc).
fn on_store(target: Target, flat: bool, strategy: impl Strategy<Value = RoundTrip>) {
    use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
    let config = ProptestConfig {
        cases: if target == Target::S3 { 2 } else { 8 },
        max_shrink_iters: 50,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = if target == Target::S3 {
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
    } else {
        TestRunner::new(config)
    };
    if let Err(e) = runner.run(&strategy, |rt| check_round_trip(&rt, target, flat)) {
        panic!("{target:?}: {e}");
    }
}

on_targets! {
    [memory, s3]
    fn stores_save_and_load_in_any_topology(target: Target) {
        on_store(target, false, round_trip(grid_options()));
    }
}

on_targets! {
    [memory, s3]
    fn stores_flat_pieces_and_requests_round_trip(target: Target) {
        on_store(target, true, round_trip(grid_options()));
    }
}

on_targets! {
    [memory, s3]
    fn stores_unaligned_fallback_round_trips(target: Target) {
        on_store(
            target,
            false,
            round_trip(
                prop::sample::select(vec![1u64, 8, 1 << 20]).prop_map(|s| GridOptions {
                    min_chunk_bytes: u64::MAX,
                    subchunk_target_bytes: s,
                }),
            ),
        );
    }
}
