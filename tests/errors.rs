//! One test per error the library can return: the exact variant, and that the message names
//! what it should (key, chunk, path, ranks).
//!
//! Tests marked `#[ignore = "bug: ..."]` document library bugs found while writing them; they
//! fail today and pass once the bug is fixed (run them with `cargo test --test errors --
//! --ignored`).

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use zarrckpt::comm::{CommError, Merge, RecvBuf, SendBuf, run_local};
use zarrckpt::model::copy::copy_region;
use zarrckpt::model::key::{MAX_KEY_BYTES, check_collisions};
use zarrckpt::model::{KeyError, RegionError, TensorError};
use zarrckpt::plan::PlanError;
use zarrckpt::plan::rule::{Summary, Template};
use zarrckpt::storage::StorageError;
use zarrckpt::{
    Checkpoint, Communicator, DType, Error, LoadOptions, LoadReport, LoadTarget, LocalComm, Region,
    SaveOptions, SaveReport, ShardedTensor, StrictMode, TensorKey, load, save,
};

const T: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

/// A piece one rank saves; its bytes are cut from a deterministic full tensor.
#[derive(Clone)]
struct P {
    key: String,
    dtype: DType,
    shape: Vec<u64>,
    offset: Vec<u64>,
    local: Vec<u64>,
    replica: u32,
}

fn p(key: &str, dtype: DType, shape: &[u64], offset: &[u64], local: &[u64], replica: u32) -> P {
    P {
        key: key.into(),
        dtype,
        shape: shape.into(),
        offset: offset.into(),
        local: local.into(),
        replica,
    }
}

/// Deterministic bytes of a whole tensor.
fn tensor_bytes(seed: u64, shape: &[u64], dtype: DType) -> Vec<u8> {
    let n: u64 = shape.iter().product::<u64>() * dtype.size() as u64;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// The bytes of `region` cut from a full tensor.
fn cut(full: &[u8], shape: &[u64], region: &Region, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; region.shape().iter().product::<u64>() as usize * elem];
    copy_region(full, &Region::full(shape), &mut out, region, region, elem);
    out
}

/// Rows of piece `i` of `n` of an [8, 6] tensor, torch.chunk style (ceil size).
fn rows_piece(n: u64, i: u64) -> Region {
    let size = 8u64.div_ceil(n);
    let o = (i * size).min(8);
    Region::new(vec![o, 0], vec![size.min(8 - o), 6]).unwrap()
}

fn seed(key: &str) -> u64 {
    key.bytes()
        .fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)))
}

fn full(key: &str, dtype: DType, shape: &[u64]) -> Vec<u8> {
    tensor_bytes(seed(key), shape, dtype)
}

/// Runs `save` on `world` in-process ranks; `f(rank)` gives each rank's pieces.
fn save_with<C: Communicator>(
    dir: &Path,
    comm: &C,
    opts: &SaveOptions,
    pieces: &[P],
) -> zarrckpt::Result<SaveReport> {
    let datas: Vec<Vec<u8>> = pieces
        .iter()
        .map(|q| {
            let region = Region::new(q.offset.clone(), q.local.clone()).unwrap();
            cut(
                &full(&q.key, q.dtype, &q.shape),
                &q.shape,
                &region,
                q.dtype.size(),
            )
        })
        .collect();
    let st: Vec<ShardedTensor> = pieces
        .iter()
        .zip(&datas)
        .map(|(q, d)| {
            let region = Region::new(q.offset.clone(), q.local.clone()).unwrap();
            ShardedTensor::new(
                TensorKey::new(q.key.as_str()).unwrap(),
                q.dtype,
                q.shape.clone(),
                region,
                q.replica,
                d,
            )
            .unwrap()
        })
        .collect();
    save(&st, dir, comm, opts)
}

fn save_ranks(
    dir: &Path,
    world: usize,
    opts: &SaveOptions,
    f: impl Fn(usize) -> Vec<P> + Sync,
) -> Vec<zarrckpt::Result<SaveReport>> {
    run_local(world, T, |comm| {
        let pieces = f(comm.rank());
        save_with(dir, &comm, opts, &pieces)
    })
}

/// `w`: f32 [8, 6] split by rows over the ranks; `b`: f32 [6], replicated, main on rank 0.
fn standard(world: usize) -> impl Fn(usize) -> Vec<P> + Sync {
    move |r| {
        let w = rows_piece(world as u64, r as u64);
        vec![
            p("w", DType::Float32, &[8, 6], w.offset(), w.shape(), 0),
            p("b", DType::Float32, &[6], &[0], &[6], u32::from(r != 0)),
        ]
    }
}

fn save_standard(dir: &Path, world: usize) {
    for r in save_ranks(dir, world, &SaveOptions::default(), standard(world)) {
        r.unwrap();
    }
}

/// Loads a whole tensor in one process and compares with the fixture's bytes.
fn assert_loads(dir: &Path, key: &str, dtype: DType, shape: &[u64]) {
    let ck = Checkpoint::open(dir).unwrap();
    let got = ck.read_tensor(&TensorKey::new(key).unwrap()).unwrap();
    assert_eq!(got, full(key, dtype, shape), "{key} in {}", dir.display());
}

fn storage(e: &Error) -> &StorageError {
    match e {
        Error::Storage(s) => s,
        other => panic!("expected a storage error, got {other:?}: {other}"),
    }
}

fn plan_err(e: &Error) -> &PlanError {
    match e {
        Error::Plan(p) => p,
        other => panic!("expected a plan error, got {other:?}: {other}"),
    }
}

fn has(msg: &str, parts: &[&str]) {
    for part in parts {
        assert!(msg.contains(part), "message {msg:?} does not name {part:?}");
    }
}

fn root_json(dir: &Path) -> PathBuf {
    dir.join("zarr.json")
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn write_json(path: &Path, v: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

fn open_err(dir: &Path) -> Error {
    Checkpoint::open(dir).unwrap_err()
}

/// Loads `w` whole through `load` on one rank and returns the error.
fn load_w_err(dir: &Path) -> Error {
    let mut buf = vec![0f32; 48];
    let mut t = [LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut buf, &[8, 6]).unwrap()];
    load(&mut t, dir, &LocalComm::single(), &LoadOptions::default()).unwrap_err()
}

// ---------------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------------

/// An edit of a JSON document.
type Edit = Box<dyn Fn(&mut serde_json::Value)>;

#[test]
fn key_empty() {
    assert_eq!(TensorKey::new(""), Err(KeyError::Empty));
    let e = ShardedTensor::from_slice::<f32>("", &[1], &[0], &[0.0], &[1], 0).unwrap_err();
    assert!(matches!(e, TensorError::Key(KeyError::Empty)), "{e:?}");
    assert!(e.to_string().contains("empty"), "{e}");
}

#[test]
fn key_absolute() {
    let e = TensorKey::new("/etc/passwd").unwrap_err();
    assert!(
        matches!(&e, KeyError::Absolute { key } if key == "/etc/passwd"),
        "{e:?}"
    );
    has(&e.to_string(), &["/etc/passwd", "absolute"]);
}

#[test]
fn key_dot_segments() {
    for (raw, seg) in [
        ("..", ".."),
        ("a/../b", ".."),
        ("a/./b", "."),
        ("a/...", "..."),
        ("../../etc/passwd", ".."),
    ] {
        let e = TensorKey::new(raw).unwrap_err();
        assert!(
            matches!(&e, KeyError::DotSegment { key, segment } if key == raw && segment == seg),
            "{raw}: {e:?}"
        );
        has(&e.to_string(), &[raw]);
    }
}

#[test]
fn key_empty_segments() {
    for raw in ["a//b", "a/", "a/b/"] {
        let e = TensorKey::new(raw).unwrap_err();
        assert!(
            matches!(&e, KeyError::EmptySegment { key } if key == raw),
            "{raw}: {e:?}"
        );
    }
}

#[test]
fn key_control_chars_and_backslash() {
    for (raw, ch) in [
        ("a\nb", '\n'),
        ("a\0b", '\0'),
        ("x\u{7f}", '\u{7f}'),
        ("a\u{85}b", '\u{85}'),
        ("..\\..\\w", '\\'),
    ] {
        let e = TensorKey::new(raw).unwrap_err();
        assert!(
            matches!(&e, KeyError::ForbiddenChar { ch: c, .. } if *c == ch),
            "{raw:?}: {e:?}"
        );
        let msg = e.to_string();
        // The key is shown escaped, never with raw control characters.
        assert!(!msg.contains('\n') && !msg.contains('\0'), "{msg:?}");
    }
    // Through the typed constructors too.
    let mut buf = [0f32; 1];
    let e = LoadTarget::from_slice("a\tb", &[1], &[0], &mut buf, &[1]).unwrap_err();
    assert!(
        matches!(
            e,
            TensorError::Key(KeyError::ForbiddenChar { ch: '\t', .. })
        ),
        "{e:?}"
    );
}

#[test]
fn key_too_long() {
    let raw = "k".repeat(MAX_KEY_BYTES + 1);
    let e = TensorKey::new(raw.clone()).unwrap_err();
    assert!(
        matches!(&e, KeyError::TooLong { len, .. } if *len == MAX_KEY_BYTES + 1),
        "{e:?}"
    );
    has(
        &e.to_string(),
        &[&(MAX_KEY_BYTES + 1).to_string(), &MAX_KEY_BYTES.to_string()],
    );
    // Exactly the limit, in segments short enough, is fine.
    let ok: String = (0..MAX_KEY_BYTES / 8)
        .map(|_| "abcdefg/")
        .collect::<String>();
    TensorKey::new(&ok[..MAX_KEY_BYTES - 1]).unwrap();
    // A segment that is short in bytes but long once escaped.
    let e = TensorKey::new("é".repeat(50)).unwrap_err();
    assert!(
        matches!(&e, KeyError::SegmentTooLong { len: 300, .. }),
        "{e:?}"
    );
    has(&e.to_string(), &["300", "255"]);
}

/// Saves `keys[r]` (a full f32 [2] tensor) on rank r and expects every rank to fail with a
/// collision naming both keys.
fn expect_collision(a: &str, b: &str, reason_part: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let keys = [a, b];
    let res = save_ranks(&dir, 2, &SaveOptions::default(), |r| {
        vec![p(keys[r], DType::Float32, &[2], &[0], &[2], 0)]
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = r.unwrap_err();
        match plan_err(&e) {
            PlanError::Key(KeyError::Collision {
                first,
                second,
                reason,
            }) => {
                let mut got = [first.as_str(), second.as_str()];
                got.sort_unstable();
                let mut want = [a, b];
                want.sort_unstable();
                assert_eq!(got, want, "rank {rank}");
                assert!(reason.contains(reason_part), "{reason}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        has(&e.to_string(), &[a, b]);
    }
    assert!(!root_json(&dir).exists(), "nothing may be committed");
}

#[test]
fn key_collision_case_across_ranks() {
    expect_collision("Weight", "weight", "case");
    expect_collision("layer/W", "layer/w", "case");
}

#[test]
fn key_collision_array_and_group_across_ranks() {
    expect_collision("a", "a/b", "group");
    expect_collision("opt/exp_avg", "opt/exp_avg/w", "group");
}

#[test]
fn key_collision_unit() {
    // Same key from many ranks is not a collision; a deep descendant is.
    let k = |s: &str| TensorKey::new(s).unwrap();
    check_collisions(&[k("x"), k("x"), k("x.y"), k("x-y")]).unwrap();
    let e = check_collisions(&[k("a/b/c/d"), k("a.b"), k("a/b")]).unwrap_err();
    assert!(matches!(e, KeyError::Collision { .. }), "{e:?}");
}

#[test]
fn key_collision_case_and_group_prefix() {
    // On a case-insensitive file system `tensors/A/zarr.json` (array) and `tensors/a/zarr.json`
    // (group of `a/b`) are the same file (regression: this pair used to pass).
    expect_collision("A", "a/b", "case");
    let k = |s: &str| TensorKey::new(s).unwrap();
    let e = check_collisions(&[k("A"), k("a/b")]);
    assert!(matches!(e, Err(KeyError::Collision { .. })), "{e:?}");
}

#[test]
fn key_reserved_segment_zarr_json() {
    // `tensors/zarr.json` is the `tensors` group's metadata file: a tensor (or group) of that
    // name would need a directory there. Rejected up front, in any letter case (regression:
    // it used to pass validation and fail with an I/O error after prepare).
    for (raw, seg) in [
        ("zarr.json", "zarr.json"),
        ("opt/ZARR.JSON", "ZARR.JSON"),
        ("a/Zarr.Json/b", "Zarr.Json"),
    ] {
        let e = TensorKey::new(raw).unwrap_err();
        assert!(
            matches!(&e, KeyError::ReservedSegment { key, segment } if key == raw && segment == seg),
            "{raw}: {e:?}"
        );
        has(&e.to_string(), &[raw, "reserved"]);
    }
    TensorKey::new("zarr.jsonx").unwrap();
    TensorKey::new("my.zarr.json.bak").unwrap();
}

// ---------------------------------------------------------------------------------------------
// Pieces and targets
// ---------------------------------------------------------------------------------------------

#[test]
fn sharded_tensor_out_of_bounds() {
    let data = [0u8; 24];
    let e = ShardedTensor::new(
        TensorKey::new("w").unwrap(),
        DType::Float32,
        vec![4, 3],
        Region::new(vec![3, 0], vec![2, 3]).unwrap(),
        0,
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(&e, TensorError::Region { key, source: RegionError::OutOfBounds { shape, .. } } if key == "w" && shape == &vec![4, 3]),
        "{e:?}"
    );
    has(&e.to_string(), &["`w`", "[3..5, 0..3]", "[4, 3]"]);
}

#[test]
fn sharded_tensor_rank_mismatch_and_overflow() {
    let e = ShardedTensor::from_slice::<f32>("w", &[4, 3], &[0], &[0.0; 3], &[3], 0).unwrap_err();
    assert!(
        matches!(
            &e,
            TensorError::Region {
                source: RegionError::RankMismatch { .. },
                ..
            }
        ),
        "{e:?}"
    );
    let e = ShardedTensor::from_slice::<f32>("w", &[4], &[0, 0], &[0.0; 3], &[3], 0).unwrap_err();
    assert!(
        matches!(
            &e,
            TensorError::Region {
                source: RegionError::RankMismatch { .. },
                ..
            }
        ),
        "{e:?}"
    );
    let e = ShardedTensor::from_slice::<f32>("w", &[u64::MAX], &[u64::MAX - 1], &[0.0; 3], &[3], 0)
        .unwrap_err();
    assert!(
        matches!(
            &e,
            TensorError::Region {
                source: RegionError::Overflow { .. },
                ..
            }
        ),
        "{e:?}"
    );
    let e = ShardedTensor::from_slice::<u8>("w", &[1 << 40, 1 << 40], &[0, 0], &[0; 1], &[1, 1], 0)
        .unwrap_err();
    assert!(
        matches!(
            &e,
            TensorError::Region {
                source: RegionError::Overflow { .. },
                ..
            }
        ),
        "{e:?}"
    );
    let dims = vec![1u64; 33];
    let e = ShardedTensor::from_slice::<u8>("w", &dims, &vec![0; 33], &[0], &dims, 0).unwrap_err();
    assert!(
        matches!(
            &e,
            TensorError::Region {
                source: RegionError::TooManyDims { dims: 33 },
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn sharded_tensor_wrong_buffer_size() {
    let data = [0u8; 10];
    let e = ShardedTensor::new(
        TensorKey::new("w").unwrap(),
        DType::BFloat16,
        vec![4, 3],
        Region::new(vec![0, 0], vec![2, 3]).unwrap(),
        0,
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(&e, TensorError::BufferSize { key, expected: 12, got: 10, dtype: DType::BFloat16, .. } if key.as_str() == "w"),
        "{e:?}"
    );
    has(&e.to_string(), &["`w`", "12", "10", "bfloat16"]);
}

#[test]
fn sharded_tensor_invalid_bool_byte() {
    let data = [0u8, 1, 1, 0xFE, 0];
    let e = ShardedTensor::new(
        TensorKey::new("mask").unwrap(),
        DType::Bool,
        vec![5],
        Region::full(&[5]),
        0,
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(&e, TensorError::InvalidBool { key, offset: 3, value: 0xFE } if key.as_str() == "mask"),
        "{e:?}"
    );
    has(&e.to_string(), &["`mask`", "byte 3", "0xfe"]);
    ShardedTensor::new(
        TensorKey::new("mask").unwrap(),
        DType::Bool,
        vec![2],
        Region::full(&[2]),
        0,
        &[0, 1],
    )
    .unwrap();
}

#[test]
fn load_target_out_of_bounds_and_wrong_size() {
    let mut buf = [0u8; 24];
    let e = LoadTarget::new(
        TensorKey::new("w").unwrap(),
        DType::Float32,
        vec![4, 3],
        Region::new(vec![0, 1], vec![2, 3]).unwrap(),
        &mut buf,
    )
    .unwrap_err();
    assert!(
        matches!(&e, TensorError::Region { key, source: RegionError::OutOfBounds { .. } } if key == "w"),
        "{e:?}"
    );
    let e = LoadTarget::new(
        TensorKey::new("w").unwrap(),
        DType::Float32,
        vec![4, 3],
        Region::new(vec![0, 0], vec![2, 2]).unwrap(),
        &mut buf,
    )
    .unwrap_err();
    assert!(
        matches!(
            &e,
            TensorError::BufferSize {
                expected: 16,
                got: 24,
                ..
            }
        ),
        "{e:?}"
    );
    has(&e.to_string(), &["`w`", "16", "24"]);
}

// ---------------------------------------------------------------------------------------------
// Save-time validation across ranks
// ---------------------------------------------------------------------------------------------

#[test]
fn duplicate_piece_on_one_rank_fails_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let res = save_ranks(&dir, 2, &SaveOptions::default(), |r| {
        let mut v = vec![p(
            "w",
            DType::Float32,
            &[8, 6],
            &[4 * r as u64, 0],
            &[4, 6],
            0,
        )];
        if r == 1 {
            v.push(v[0].clone());
        }
        v
    });
    let e1 = res[1].as_ref().unwrap_err();
    assert!(
        matches!(e1, Error::InconsistentPieces { key, detail } if key.as_str() == "w" && detail.contains("twice")),
        "{e1:?}"
    );
    has(&e1.to_string(), &["`w`", "[4..8, 0..6]"]);
    let e0 = res[0].as_ref().unwrap_err();
    assert!(
        matches!(e0, Error::RemoteFailure { rank: 1, message } if message.contains("twice")),
        "{e0:?}"
    );
    has(&e0.to_string(), &["rank 1", "`w`"]);
    assert!(!dir.exists(), "a failure before prepare touches nothing");
}

#[test]
fn inconsistent_declarations_on_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let res = save_ranks(&dir, 1, &SaveOptions::default(), |_| {
        vec![
            p("w", DType::Float32, &[8, 6], &[0, 0], &[4, 6], 0),
            p("w", DType::Float16, &[8, 6], &[4, 0], &[4, 6], 0),
        ]
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(
        matches!(e, Error::InconsistentPieces { key, .. } if key.as_str() == "w"),
        "{e:?}"
    );
    has(&e.to_string(), &["`w`", "float32", "float16"]);
}

#[test]
fn ranks_disagree_on_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let res = save_ranks(&dir, 3, &SaveOptions::default(), |r| {
        let dt = if r == 2 {
            DType::BFloat16
        } else {
            DType::Float32
        };
        vec![p("w", dt, &[9, 2], &[3 * r as u64, 0], &[3, 2], 0)]
    });
    for r in &res {
        let e = r.as_ref().unwrap_err();
        match plan_err(e) {
            PlanError::Disagreement {
                key,
                what,
                variants,
            } => {
                assert_eq!((key.as_str(), *what), ("w", "data type"));
                assert_eq!(
                    variants,
                    &vec![
                        ("float32".to_string(), vec![0, 1]),
                        ("bfloat16".to_string(), vec![2])
                    ]
                );
            }
            other => panic!("{other:?}"),
        }
        has(
            &e.to_string(),
            &["`w`", "float32 on ranks [0, 1]", "bfloat16 on ranks [2]"],
        );
    }
    assert!(!dir.exists());
}

#[test]
fn ranks_disagree_on_global_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let res = save_ranks(&dir, 2, &SaveOptions::default(), |r| {
        let shape: &[u64] = if r == 0 { &[8, 6] } else { &[8, 7] };
        vec![p(
            "w",
            DType::Float32,
            shape,
            &[4 * r as u64, 0],
            &[4, 6],
            0,
        )]
    });
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(
                plan_err(e),
                PlanError::Disagreement {
                    what: "global shape",
                    ..
                }
            ),
            "{e:?}"
        );
        has(
            &e.to_string(),
            &["`w`", "[8, 6] on ranks [0]", "[8, 7] on ranks [1]"],
        );
    }
}

#[test]
fn overlapping_main_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let res = save_ranks(&dir, 2, &SaveOptions::default(), |r| {
        if r == 0 {
            vec![p("w", DType::Float32, &[8, 6], &[0, 0], &[5, 6], 0)]
        } else {
            vec![p("w", DType::Float32, &[8, 6], &[4, 0], &[4, 6], 0)]
        }
    });
    for r in &res {
        let e = r.as_ref().unwrap_err();
        match plan_err(e) {
            PlanError::Overlap {
                key,
                first_ranks,
                second_ranks,
                ..
            } => {
                assert_eq!(key.as_str(), "w");
                assert_eq!(
                    (first_ranks.as_slice(), second_ranks.as_slice()),
                    (&[0u32][..], &[1u32][..])
                );
            }
            other => panic!("{other:?}"),
        }
        has(
            &e.to_string(),
            &[
                "`w`",
                "[0..5, 0..6]",
                "[4..8, 0..6]",
                "ranks [0]",
                "ranks [1]",
            ],
        );
    }
}

#[test]
fn same_piece_main_on_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let res = save_ranks(&dir, 3, &SaveOptions::default(), |r| {
        vec![p("b", DType::Float32, &[6], &[0], &[6], u32::from(r == 1))]
    });
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(plan_err(e), PlanError::Overlap { first_ranks, .. } if first_ranks == &vec![0, 2]),
            "{e:?}"
        );
        has(&e.to_string(), &["`b`", "[0, 2]"]);
    }
}

#[test]
fn coverage_gap_names_missing_element() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let res = save_ranks(&dir, 2, &SaveOptions::default(), |r| {
        // rank 1 holds rows 4..8 only as a replica: no main replica covers them.
        vec![p(
            "w",
            DType::Float32,
            &[8, 6],
            &[4 * r as u64, 0],
            &[4, 6],
            r as u32,
        )]
    });
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(plan_err(e), PlanError::Gap { covered: 24, total: 48, missing, .. } if missing == &vec![4, 0]),
            "{e:?}"
        );
        has(&e.to_string(), &["`w`", "24 of 48", "[4, 0]"]);
    }
    // A 2-D gap in the middle of the tensor.
    let res = save_ranks(&dir, 3, &SaveOptions::default(), |r| {
        let (o, s): (&[u64], &[u64]) = match r {
            0 => (&[0, 0], &[2, 4]),
            1 => (&[2, 0], &[2, 2]),
            _ => (&[4, 0], &[2, 4]),
        };
        vec![p("m", DType::UInt8, &[6, 4], o, s, 0)]
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(
        matches!(plan_err(e), PlanError::Gap { missing, .. } if missing == &vec![2, 2]),
        "{e:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Load-time validation
// ---------------------------------------------------------------------------------------------

#[test]
fn load_wrong_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    let mut buf = vec![0f64; 48];
    let mut t = [LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut buf, &[8, 6]).unwrap()];
    let e = load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, Error::DtypeMismatch { key, path, rank: 0, requested: DType::Float64, stored: DType::Float32 } if key.as_str() == "w" && path == &dir),
        "{e:?}"
    );
    has(
        &e.to_string(),
        &["`w`", "float64", "float32", dir.to_str().unwrap()],
    );
    assert!(buf.iter().all(|&x| x == 0.0), "nothing written");
}

#[test]
fn load_wrong_global_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    let mut buf = vec![0f32; 48];
    let mut t = [LoadTarget::from_slice("w", &[6, 8], &[0, 0], &mut buf, &[6, 8]).unwrap()];
    let e = load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { requested, stored, .. } if requested == &vec![6, 8] && stored == &vec![8, 6]),
        "{e:?}"
    );
    has(&e.to_string(), &["`w`", "[6, 8]", "[8, 6]"]);
}

#[test]
fn load_mismatch_on_another_rank_names_that_rank() {
    // Rank 1 asks for float64; rank 0 asks correctly but is told "requested float64".
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let res = run_local(2, T, |comm| {
        if comm.rank() == 0 {
            let mut buf = vec![0f32; 48];
            let mut t = [LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut buf, &[8, 6]).unwrap()];
            load(&mut t, &dir, &comm, &LoadOptions::default()).map(|_| ())
        } else {
            let mut buf = vec![0f64; 48];
            let mut t = [LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut buf, &[8, 6]).unwrap()];
            load(&mut t, &dir, &comm, &LoadOptions::default()).map(|_| ())
        }
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(matches!(e, Error::DtypeMismatch { .. }), "{e:?}");
    has(&e.to_string(), &["rank 1"]);
}

/// Loads `w` whole plus an absent key `nope` (buffer pre-filled with 0xAB) under `strict`.
fn load_with_unexpected(
    dir: &Path,
    strict: StrictMode,
) -> (zarrckpt::Result<LoadReport>, Vec<f32>, Vec<u8>) {
    let mut w = vec![0f32; 48];
    let mut nope = vec![0xABu8; 3];
    let r = {
        let mut t = [
            LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut w, &[8, 6]).unwrap(),
            LoadTarget::from_slice("nope", &[3], &[0], &mut nope, &[3]).unwrap(),
        ];
        load(
            &mut t,
            dir,
            &LocalComm::single(),
            &LoadOptions {
                strict,
                ..Default::default()
            },
        )
    };
    (r, w, nope)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn unexpected_keys_under_every_strict_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    let want_w = full("w", DType::Float32, &[8, 6]);
    let k = |s: &str| TensorKey::new(s).unwrap();

    for mode in [
        StrictMode::RaiseUnexpected,
        StrictMode::RaiseAll,
        StrictMode::AssumeOkUnexpected,
    ] {
        let (r, w, nope) = load_with_unexpected(&dir, mode);
        let e = r.unwrap_err();
        assert!(
            matches!(&e, Error::UnexpectedKeys { keys, rank: 0, path } if keys == &vec![k("nope")] && path == &dir),
            "{mode:?}: {e:?}"
        );
        has(&e.to_string(), &["`nope`", dir.to_str().unwrap()]);
        assert!(nope.iter().all(|&b| b == 0xAB), "{mode:?}");
        assert!(
            w.iter().all(|&x| x == 0.0),
            "{mode:?}: raised before reading"
        );
    }
    // (mode, expected report.unexpected, expected report.missing)
    let cases: [(StrictMode, &[&str], &[&str]); 5] = [
        (StrictMode::LogUnexpected, &[], &[]),
        (StrictMode::LogAll, &[], &["b"]),
        (StrictMode::ReturnUnexpected, &["nope"], &[]),
        (StrictMode::ReturnAll, &["nope"], &["b"]),
        (StrictMode::IgnoreAll, &[], &[]),
    ];
    for (mode, unexpected, missing) in cases {
        let (r, w, nope) = load_with_unexpected(&dir, mode);
        let report = r.unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_eq!(
            report.unexpected,
            unexpected.iter().map(|s| k(s)).collect::<Vec<_>>(),
            "{mode:?}"
        );
        assert_eq!(
            report.missing,
            missing.iter().map(|s| k(s)).collect::<Vec<_>>(),
            "{mode:?}"
        );
        assert!(
            nope.iter().all(|&b| b == 0xAB),
            "{mode:?}: a skipped buffer must stay untouched"
        );
        assert_eq!(f32_bytes(&w), want_w, "{mode:?}: the other keys still load");
        assert_eq!(report.loaded_bytes, 48 * 4, "{mode:?}");
    }
}

#[test]
fn unexpected_key_of_another_rank_names_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let res = run_local(3, T, |comm| {
        let mut w = vec![0f32; 48];
        let mut x = vec![0f32; 2];
        let mut t = vec![LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut w, &[8, 6]).unwrap()];
        if comm.rank() == 2 {
            t.push(LoadTarget::from_slice("ghost", &[2], &[0], &mut x, &[2]).unwrap());
        }
        load(&mut t, &dir, &comm, &LoadOptions::default()).map(|_| ())
    });
    for (r, res) in res.iter().enumerate() {
        let e = res.as_ref().unwrap_err();
        assert!(
            matches!(e, Error::UnexpectedKeys { rank: 2, keys, .. } if keys[0].as_str() == "ghost"),
            "rank {r}: {e:?}"
        );
        has(&e.to_string(), &["`ghost`"]);
    }
}

#[test]
fn missing_keys_raise_all_and_return_all() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    let load_w = |strict| {
        let mut w = vec![0f32; 48];
        let mut t = [LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut w, &[8, 6]).unwrap()];
        load(
            &mut t,
            &dir,
            &LocalComm::single(),
            &LoadOptions {
                strict,
                ..Default::default()
            },
        )
    };
    let e = load_w(StrictMode::RaiseAll).unwrap_err();
    assert!(
        matches!(&e, Error::MissingKeys { keys, path } if keys.len() == 1 && keys[0].as_str() == "b" && path == &dir),
        "{e:?}"
    );
    has(&e.to_string(), &["`b`", "1 key", dir.to_str().unwrap()]);
    let r = load_w(StrictMode::ReturnAll).unwrap();
    assert_eq!(r.missing, vec![TensorKey::new("b").unwrap()]);
    assert!(r.unexpected.is_empty());
    // The default mode does not care about missing keys.
    let r = load_w(StrictMode::RaiseUnexpected).unwrap();
    assert!(r.missing.is_empty());
    // Missing is global: keys requested by some rank are not missing.
    let res = run_local(2, T, |comm| {
        let mut w = vec![0f32; 48];
        let mut b = vec![0f32; 6];
        let mut t = if comm.rank() == 0 {
            vec![LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut w, &[8, 6]).unwrap()]
        } else {
            vec![LoadTarget::from_slice("b", &[6], &[0], &mut b, &[6]).unwrap()]
        };
        load(
            &mut t,
            &dir,
            &comm,
            &LoadOptions {
                strict: StrictMode::RaiseAll,
                ..Default::default()
            },
        )
    });
    for r in res {
        r.unwrap();
    }
}

#[test]
fn read_region_of_absent_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let ck = Checkpoint::open(&dir).unwrap();
    let e = ck
        .read_tensor(&TensorKey::new("absent").unwrap())
        .unwrap_err();
    assert!(
        matches!(&e, Error::UnexpectedKeys { keys, .. } if keys[0].as_str() == "absent"),
        "{e:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Opening: incomplete checkpoints, foreign directories, versions, malformed metadata
// ---------------------------------------------------------------------------------------------

#[test]
fn incomplete_checkpoint_root_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    std::fs::remove_file(root_json(&dir)).unwrap();
    for e in [open_err(&dir), load_w_err(&dir)] {
        assert!(
            matches!(storage(&e), StorageError::Incomplete { path } if path == &dir),
            "{e:?}"
        );
        has(&e.to_string(), &[dir.to_str().unwrap(), "incomplete"]);
    }
}

#[test]
fn not_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    // No such directory.
    let none = tmp.path().join("none");
    let e = open_err(&none);
    assert!(
        matches!(storage(&e), StorageError::NotACheckpoint { path, .. } if path == &none),
        "{e:?}"
    );
    has(
        &e.to_string(),
        &[none.to_str().unwrap(), "no such directory"],
    );
    // An empty directory, and one with unrelated files.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = open_err(&empty);
    assert!(
        matches!(storage(&e), StorageError::NotACheckpoint { .. }),
        "{e:?}"
    );
    std::fs::write(empty.join("notes.txt"), b"hello").unwrap();
    let e = load_w_err(&empty);
    assert!(
        matches!(storage(&e), StorageError::NotACheckpoint { path, .. } if path == &empty),
        "{e:?}"
    );
    // A plain Zarr v3 group without the zarrckpt attribute.
    let group = tmp.path().join("group");
    std::fs::create_dir(&group).unwrap();
    std::fs::write(
        group.join("zarr.json"),
        br#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    let e = open_err(&group);
    assert!(
        matches!(storage(&e), StorageError::NotACheckpoint { reason, .. } if reason.contains("zarrckpt")),
        "{e:?}"
    );
    has(&e.to_string(), &["zarr.json"]);
    // A Zarr v3 array, and a Zarr v2 group.
    for doc in [
        &br#"{"zarr_format":3,"node_type":"array"}"#[..],
        br#"{"zarr_format":2}"#,
    ] {
        std::fs::write(group.join("zarr.json"), doc).unwrap();
        let e = open_err(&group);
        assert!(
            matches!(storage(&e), StorageError::NotACheckpoint { .. }),
            "{e:?}"
        );
    }
    // A regular file.
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let e = open_err(&file);
    let s = storage(&e);
    assert!(
        matches!(
            s,
            StorageError::NotACheckpoint { .. } | StorageError::Io { .. }
        ),
        "{e:?}"
    );
    has(&e.to_string(), &[file.to_str().unwrap()]);
}

fn set_attr(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v = read_json(&root_json(dir));
    f(&mut v["attributes"]["zarrckpt"]);
    write_json(&root_json(dir), &v);
}

#[test]
fn unsupported_major_version_and_newer_minor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    for v in ["2.0", "0.9", "10.0"] {
        set_attr(&dir, |a| a["version"] = v.into());
        let e = open_err(&dir);
        assert!(
            matches!(storage(&e), StorageError::UnsupportedVersion { found, path, .. } if found == v && path == &root_json(&dir)),
            "{e:?}"
        );
        has(&e.to_string(), &[v, "1.x", "zarr.json"]);
        let e = load_w_err(&dir);
        assert!(
            matches!(storage(&e), StorageError::UnsupportedVersion { .. }),
            "{e:?}"
        );
    }
    for v in ["1", "1.x", "", "v1.0", "1.0.0"] {
        set_attr(&dir, |a| a["version"] = v.into());
        let e = open_err(&dir);
        assert!(
            matches!(storage(&e), StorageError::Malformed { reason, .. } if reason.contains("version")),
            "{v:?}: {e:?}"
        );
    }
    // A newer minor version with fields this reader does not know still loads.
    set_attr(&dir, |a| {
        a["version"] = "1.9".into();
        a["from_the_future"] = serde_json::json!({"x": [1, 2]});
        a["tensors"]["w"]["future_field"] = true.into();
    });
    assert_loads(&dir, "w", DType::Float32, &[8, 6]);
}

#[test]
fn malformed_root_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let good = read_json(&root_json(&dir));
    let rj = root_json(&dir);
    let expect_malformed = |what: &str, reason_part: &str| {
        let e = open_err(&dir);
        match storage(&e) {
            StorageError::Malformed { path, reason } => {
                assert_eq!(path, &rj, "{what}");
                assert!(reason.contains(reason_part), "{what}: {reason}");
            }
            other => panic!("{what}: {other:?}"),
        }
        has(&e.to_string(), &[rj.to_str().unwrap()]);
        write_json(&rj, &good);
    };
    std::fs::write(&rj, b"{not json").unwrap();
    expect_malformed("not JSON", "not JSON");
    std::fs::write(&rj, b"").unwrap();
    expect_malformed("empty", "not JSON");
    std::fs::write(&rj, b"\xff\xfe").unwrap();
    expect_malformed("not UTF-8", "not JSON");

    let edits: Vec<(&str, &str, Edit)> = vec![
        (
            "format",
            "format",
            Box::new(|a| a["format"] = "other".into()),
        ),
        (
            "format type",
            "format",
            Box::new(|a| a["format"] = 1.into()),
        ),
        (
            "version type",
            "version",
            Box::new(|a| a["version"] = 1.0.into()),
        ),
        (
            "world_size type",
            "invalid type",
            Box::new(|a| a["world_size"] = "four".into()),
        ),
        (
            "world_size missing",
            "missing field `world_size`",
            Box::new(|a| {
                a.as_object_mut()
                    .unwrap()
                    .remove("world_size")
                    .map(drop)
                    .unwrap()
            }),
        ),
        (
            "tensors type",
            "invalid type",
            Box::new(|a| a["tensors"] = serde_json::json!([1, 2])),
        ),
        (
            "dtype",
            "float128",
            Box::new(|a| a["tensors"]["w"]["dtype"] = "float128".into()),
        ),
        (
            "shape type",
            "invalid type",
            Box::new(|a| a["tensors"]["w"]["shape"] = "8x6".into()),
        ),
        (
            "negative shape",
            "invalid value",
            Box::new(|a| a["tensors"]["w"]["shape"] = serde_json::json!([-8, 6])),
        ),
        (
            "path escapes",
            "key mapping",
            Box::new(|a| a["tensors"]["w"]["path"] = "../../etc".into()),
        ),
        (
            "path elsewhere",
            "key mapping",
            Box::new(|a| a["tensors"]["w"]["path"] = "tensors/b".into()),
        ),
        (
            "absolute path",
            "key mapping",
            Box::new(|a| a["tensors"]["w"]["path"] = "/etc/passwd".into()),
        ),
        (
            "compression",
            "lzma",
            Box::new(|a| a["tensors"]["w"]["compression"] = "lzma".into()),
        ),
        (
            "rank mismatch",
            "differ in length",
            Box::new(|a| a["tensors"]["w"]["chunk_shape"] = serde_json::json!([4])),
        ),
        (
            "zero chunk",
            "divide",
            Box::new(|a| a["tensors"]["w"]["chunk_shape"] = serde_json::json!([0, 6])),
        ),
        (
            "non-dividing subchunk",
            "divide",
            Box::new(|a| a["tensors"]["w"]["subchunk_shape"] = serde_json::json!([3, 6])),
        ),
        (
            "overflowing shape",
            "overflow",
            Box::new(|a| a["tensors"]["w"]["shape"] = serde_json::json!([u64::MAX, 2])),
        ),
        (
            "overflowing chunk",
            "overflow",
            Box::new(|a| {
                a["tensors"]["w"]["chunk_shape"] = serde_json::json!([1u64 << 62, 6]);
                a["tensors"]["w"]["subchunk_shape"] = serde_json::json!([1u64 << 62, 6]);
            }),
        ),
        (
            "too many dims",
            "dimensions",
            Box::new(|a| {
                let d = vec![1u64; 40];
                a["tensors"]["w"]["shape"] = d.clone().into();
                a["tensors"]["w"]["chunk_shape"] = d.clone().into();
                a["tensors"]["w"]["subchunk_shape"] = d.into();
            }),
        ),
        (
            "invalid key",
            "dot segment",
            Box::new(|a| {
                let e = a["tensors"]["w"].clone();
                a["tensors"]["../x"] = e;
            }),
        ),
        (
            "colliding keys",
            "collide",
            Box::new(|a| {
                let mut e = a["tensors"]["w"].clone();
                e["path"] = "tensors/W".into();
                a["tensors"]["W"] = e;
            }),
        ),
    ];
    for (what, part, edit) in edits {
        set_attr(&dir, edit);
        expect_malformed(what, part);
    }
    // Sanity: the restored metadata still opens.
    Checkpoint::open(&dir).unwrap();
}

#[test]
fn malformed_root_metadata_names_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let rj = root_json(&dir);
    let good = read_json(&rj);
    let edits: Vec<(&str, Edit)> = vec![
        ("world_size", Box::new(|a| a["world_size"] = "four".into())),
        (
            "shape",
            Box::new(|a| a["tensors"]["w"]["shape"] = "8x6".into()),
        ),
        (
            "chunk_shape",
            Box::new(|a| a["tensors"]["w"]["chunk_shape"] = serde_json::json!([-1, 6])),
        ),
        (
            "dtype",
            Box::new(|a| a["tensors"]["w"]["dtype"] = "float128".into()),
        ),
    ];
    let mut vague = Vec::new();
    for (field, edit) in edits {
        set_attr(&dir, edit);
        let msg = open_err(&dir).to_string();
        // The field, and for per-tensor fields the tensor.
        if !msg.contains(field) || (field != "world_size" && !msg.contains("`w`")) {
            vague.push(msg);
        }
        write_json(&rj, &good);
    }
    assert!(vague.is_empty(), "{vague:#?}");
}

#[test]
fn array_metadata_disagrees_with_index() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    let aj = dir.join("tensors/w/zarr.json");
    let good = read_json(&aj);
    let edits: Vec<(&str, Edit)> = vec![
        ("data_type", Box::new(|v| v["data_type"] = "float16".into())),
        (
            "shape",
            Box::new(|v| v["shape"] = serde_json::json!([8, 7])),
        ),
        (
            "chunk_grid",
            Box::new(|v| {
                v["chunk_grid"]["configuration"]["chunk_shape"] = serde_json::json!([8, 6])
            }),
        ),
        ("node_type", Box::new(|v| v["node_type"] = "group".into())),
        (
            "subchunk",
            Box::new(|v| {
                v["codecs"][0]["configuration"]["chunk_shape"] = serde_json::json!([1, 3])
            }),
        ),
        (
            "codecs",
            Box::new(|v| v["codecs"] = serde_json::json!([{"name": "bytes"}])),
        ),
        (
            "index location",
            Box::new(|v| v["codecs"][0]["configuration"]["index_location"] = "start".into()),
        ),
    ];
    for (what, edit) in edits {
        let mut v = good.clone();
        edit(&mut v);
        write_json(&aj, &v);
        let e = load_w_err(&dir);
        assert!(
            matches!(storage(&e), StorageError::Malformed { path, .. } if path == &aj),
            "{what}: {e:?}"
        );
        has(&e.to_string(), &[aj.to_str().unwrap()]);
        // verify collects it as a problem of `w` without a chunk.
        let report = Checkpoint::open(&dir).unwrap().verify(1, None).unwrap();
        assert_eq!(report.problems.len(), 1, "{what}: {:?}", report.problems);
        assert_eq!(
            (report.problems[0].key.as_str(), &report.problems[0].chunk),
            ("w", &None),
            "{what}"
        );
    }
    std::fs::write(&aj, b"[").unwrap();
    let e = load_w_err(&dir);
    assert!(
        matches!(storage(&e), StorageError::Malformed { reason, .. } if reason.contains("not JSON")),
        "{e:?}"
    );
    std::fs::remove_file(&aj).unwrap();
    let e = load_w_err(&dir);
    assert!(
        matches!(storage(&e), StorageError::Io { path, .. } if path == &aj),
        "{e:?}"
    );
    has(&e.to_string(), &[aj.to_str().unwrap()]);
}

#[test]
fn array_metadata_index_codecs_without_checksum_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let aj = dir.join("tensors/w/zarr.json");
    let mut v = read_json(&aj);
    v["codecs"][0]["configuration"]["index_codecs"] =
        serde_json::json!([{"name": "bytes", "configuration": {"endian": "little"}}]);
    write_json(&aj, &v);
    let e = load_w_err(&dir);
    assert!(
        matches!(storage(&e), StorageError::Malformed { .. }),
        "{e:?}"
    );
}

/// Writes root and array metadata for a tensor `h` (uint8) with the given geometry, as a
/// hostile or buggy writer could, consistent between the index and the array's zarr.json.
fn hostile_geometry(dir: &Path, shape: &[u64], chunk: &[u64], sub: &[u64]) {
    use zarrckpt::storage::meta::{CheckpointMeta, TensorEntry, tensor_path};
    let key = TensorKey::new("h").unwrap();
    let entry = TensorEntry {
        path: tensor_path(&key),
        dtype: DType::UInt8,
        shape: shape.to_vec(),
        chunk_shape: chunk.to_vec(),
        subchunk_shape: sub.to_vec(),
        compression: zarrckpt::Compression::None,
    };
    let mut meta = CheckpointMeta::new(1);
    meta.tensors.insert(key.clone(), entry.clone());
    std::fs::create_dir_all(dir.join("tensors/h")).unwrap();
    std::fs::write(
        dir.join("tensors/zarr.json"),
        br#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    write_json(
        &dir.join("tensors/h/zarr.json"),
        &zarrckpt::storage::array::array_metadata(&key, &entry),
    );
    std::fs::write(root_json(dir), meta.to_root_json()).unwrap();
}

/// Loads and verifies a checkpoint with hostile geometry; `Err` describes a panic or an
/// unexpected success.
fn hostile_case(
    root: &Path,
    i: usize,
    shape: &[u64],
    chunk: &[u64],
    sub: &[u64],
) -> Result<(), String> {
    let dir = root.join(format!("h{i}"));
    hostile_geometry(&dir, shape, chunk, sub);
    let n: u64 = shape.iter().product();
    let mut buf = vec![0u8; n as usize];
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut t =
            [LoadTarget::from_slice("h", shape, &vec![0; shape.len()], &mut buf, shape).unwrap()];
        load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default())
    }));
    match outcome {
        Err(_) => return Err(format!("case {i} {chunk:?}/{sub:?}: load panicked")),
        Ok(Ok(_)) => return Err(format!("case {i}: load succeeded without shard files")),
        Ok(Err(e)) if !e.to_string().contains(dir.to_str().unwrap()) => {
            return Err(format!("case {i}: {e}"));
        }
        Ok(Err(_)) => {}
    }
    // Opening may already refuse the geometry (a typed error counts as one problem).
    let outcome = std::panic::catch_unwind(|| match Checkpoint::open(&dir) {
        Ok(c) => c.verify(1, None).map(|r| r.problems.len()),
        Err(_) => Ok(1),
    });
    match outcome {
        Err(_) => Err(format!("case {i} {chunk:?}/{sub:?}: verify panicked")),
        Ok(Ok(0)) => Err(format!("case {i}: verify found no problem")),
        Ok(_) => Ok(()),
    }
}

#[test]
fn large_but_sane_geometry_is_an_error_not_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    hostile_case(
        tmp.path(),
        0,
        &[4, 4],
        &[1 << 20, 1 << 20],
        &[1 << 20, 1 << 20],
    )
    .unwrap();
    hostile_case(tmp.path(), 1, &[4], &[1 << 40], &[1 << 20]).unwrap();
}

#[test]
fn hostile_geometry_is_an_error_not_a_panic() {
    // The index holds 16 bytes per subchunk: 2^62 subchunks per shard overflow u64 while
    // computing its size (zarrs' bytes codec multiplies unchecked).
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&[u64], &[u64], &[u64]); 3] = [
        (&[4, 4], &[1 << 31, 1 << 31], &[1, 1]),
        (&[4], &[1 << 61], &[1]),
        (&[2, 2, 2], &[1 << 21, 1 << 21, 1 << 21], &[1, 1, 1]),
    ];
    let failures: Vec<String> = cases
        .into_iter()
        .enumerate()
        .filter_map(|(i, (shape, chunk, sub))| hostile_case(tmp.path(), i, shape, chunk, sub).err())
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------------------------
// Saving into existing directories
// ---------------------------------------------------------------------------------------------

#[test]
fn save_into_non_empty_directory_without_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    let res = save_ranks(&dir, 2, &SaveOptions::default(), standard(2));
    let e0 = res[0].as_ref().unwrap_err();
    assert!(
        matches!(storage(e0), StorageError::AlreadyExists { path } if path == &dir),
        "{e0:?}"
    );
    has(&e0.to_string(), &[dir.to_str().unwrap(), "overwrite"]);
    let e1 = res[1].as_ref().unwrap_err();
    assert!(
        matches!(e1, Error::RemoteFailure { rank: 0, message } if message.contains("already exists")),
        "{e1:?}"
    );
    assert_loads(&dir, "w", DType::Float32, &[8, 6]);
    // Any non-empty directory.
    let other = tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("keep.txt"), b"keep").unwrap();
    let res = save_ranks(&other, 1, &SaveOptions::default(), standard(1));
    assert!(matches!(
        storage(res[0].as_ref().unwrap_err()),
        StorageError::AlreadyExists { .. }
    ));
    assert_eq!(std::fs::read(other.join("keep.txt")).unwrap(), b"keep");
    // An empty existing directory is fine.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    save_standard(&empty, 1);
    assert_loads(&empty, "b", DType::Float32, &[6]);
}

#[test]
fn overwrite_refuses_a_directory_that_is_not_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("home");
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(dir.join("thesis.tex"), b"precious").unwrap();
    let opts = SaveOptions {
        overwrite: true,
        ..Default::default()
    };
    let res = save_ranks(&dir, 2, &opts, standard(2));
    assert!(
        matches!(storage(res[0].as_ref().unwrap_err()), StorageError::NotReplaceable { path } if path == &dir)
    );
    let e0 = res[0].as_ref().unwrap_err().to_string();
    assert!(
        e0.contains("not a zarrckpt checkpoint") && !e0.contains("pass overwrite"),
        "{e0}"
    );
    assert!(matches!(
        res[1].as_ref().unwrap_err(),
        Error::RemoteFailure { rank: 0, .. }
    ));
    assert_eq!(std::fs::read(dir.join("thesis.tex")).unwrap(), b"precious");
    assert!(dir.join("src").is_dir());
}

#[test]
fn overwrite_refuses_a_plain_zarr_store_or_tensors_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = SaveOptions {
        overwrite: true,
        ..Default::default()
    };
    // A foreign Zarr v3 group: not a zarrckpt checkpoint.
    let zarr = tmp.path().join("dataset.zarr");
    std::fs::create_dir_all(zarr.join("images")).unwrap();
    std::fs::write(
        zarr.join("zarr.json"),
        br#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    std::fs::write(zarr.join("images/c.0"), b"pixels").unwrap();
    let res = save_ranks(&zarr, 1, &opts, standard(1));
    let refused = res[0].is_err();
    let kept = zarr.join("images/c.0").exists();
    // A project folder that happens to have a `tensors` directory.
    let proj = tmp.path().join("project");
    std::fs::create_dir_all(proj.join("tensors")).unwrap();
    std::fs::write(proj.join("README.md"), b"mine").unwrap();
    let res = save_ranks(&proj, 1, &opts, standard(1));
    assert!(refused && kept, "a plain Zarr store was overwritten");
    assert!(
        res[0].is_err() && proj.join("README.md").exists(),
        "a folder with `tensors/` was overwritten"
    );
}

#[test]
fn overwrite_replaces_a_real_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    // First checkpoint has an extra tensor the second does not.
    for r in save_ranks(&dir, 1, &SaveOptions::default(), |_| {
        vec![p("old", DType::Int32, &[3], &[0], &[3], 0)]
    }) {
        r.unwrap();
    }
    let opts = SaveOptions {
        overwrite: true,
        ..Default::default()
    };
    for r in save_ranks(&dir, 2, &opts, standard(2)) {
        r.unwrap();
    }
    assert_loads(&dir, "w", DType::Float32, &[8, 6]);
    let ck = Checkpoint::open(&dir).unwrap();
    assert!(ck.tensor(&TensorKey::new("old").unwrap()).is_none());
    assert!(!dir.join("tensors/old").exists(), "old files are removed");
    // Overwriting an incomplete checkpoint works too.
    std::fs::remove_file(root_json(&dir)).unwrap();
    for r in save_ranks(&dir, 1, &opts, standard(1)) {
        r.unwrap();
    }
    assert_loads(&dir, "b", DType::Float32, &[6]);
}

// ---------------------------------------------------------------------------------------------
// Failing and dying ranks
// ---------------------------------------------------------------------------------------------

/// What a [`Faulty`] rank does at its chosen `agree` step.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// Reports a failure of its own (as if its local step had failed).
    Report,
    /// Drops its communicator, as a process that dies.
    Die,
}

/// A communicator that injects a fault at the `at`-th agreement (a one-byte all-gather `[0]`
/// that save and load use to agree on every step's outcome: for a save 1 layouts, 2 the
/// index's limits, 3 prepare (lock, staging), 4 group documents, 5 files written, 6 commit).
struct Faulty {
    inner: Mutex<Option<LocalComm>>,
    rank: usize,
    world: usize,
    at: usize,
    fault: Fault,
    seen: AtomicUsize,
}

impl Faulty {
    fn new(c: LocalComm, at: usize, fault: Fault) -> Self {
        Faulty {
            rank: c.rank(),
            world: c.world_size(),
            inner: Mutex::new(Some(c)),
            at,
            fault,
            seen: AtomicUsize::new(0),
        }
    }
    fn gone(&self, op: &'static str) -> CommError {
        CommError::Transport {
            op,
            rank: self.rank,
            detail: "injected: this rank died".into(),
        }
    }
}

impl Communicator for Faulty {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let mut g = self.inner.lock().unwrap();
        let mut data = data.to_vec();
        if data == [0] && self.seen.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            match self.fault {
                Fault::Report => data = b"\x01injected failure while writing".to_vec(),
                Fault::Die => {
                    drop(g.take());
                }
            }
        }
        g.as_ref()
            .ok_or_else(|| self.gone("all_gather"))?
            .all_gather(&data)
    }
    fn all_reduce(&self, data: &[u8], merge: &Merge<'_>) -> Result<Vec<u8>, CommError> {
        let mut g = self.inner.lock().unwrap();
        let mut data = data.to_vec();
        // Outcome agreements send a single 0 byte when the rank is fine.
        if data == [0] && self.seen.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            match self.fault {
                Fault::Report => {
                    data = vec![1];
                    data.extend_from_slice(&(self.rank as u64).to_le_bytes());
                    data.extend_from_slice(b"injected failure while writing");
                }
                Fault::Die => {
                    drop(g.take());
                }
            }
        }
        g.as_ref()
            .ok_or_else(|| self.gone("all_reduce"))?
            .all_reduce(&data, merge)
    }
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, CommError> {
        self.inner
            .lock()
            .unwrap()
            .as_ref()
            .ok_or_else(|| self.gone("broadcast"))?
            .broadcast(root, data)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner
            .lock()
            .unwrap()
            .as_ref()
            .ok_or_else(|| self.gone("barrier"))?
            .barrier()
    }
    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        self.inner
            .lock()
            .unwrap()
            .as_ref()
            .ok_or_else(|| self.gone("exchange"))?
            .exchange(sends, recvs)
    }
}

/// Saves the standard fixture on `world` ranks where rank `bad` injects `fault` at step `at`.
fn save_faulty(
    dir: &Path,
    world: usize,
    bad: usize,
    at: usize,
    fault: Fault,
    opts: &SaveOptions,
    timeout: Duration,
) -> Vec<zarrckpt::Result<SaveReport>> {
    let f = standard(world);
    run_local(world, timeout, |comm| {
        let r = comm.rank();
        let pieces = f(r);
        if r == bad {
            let c = Faulty::new(comm, at, fault);
            save_with(dir, &c, opts, &pieces)
        } else {
            save_with(dir, &comm, opts, &pieces)
        }
    })
}

#[test]
fn a_rank_failing_mid_save_fails_every_rank_and_nothing_commits() {
    let tmp = tempfile::tempdir().unwrap();
    for at in 1..=5 {
        let dir = tmp.path().join(format!("fail{at}"));
        let res = save_faulty(&dir, 3, 1, at, Fault::Report, &SaveOptions::default(), T);
        for (r, res) in res.iter().enumerate() {
            let e = res.as_ref().unwrap_err();
            assert!(
                matches!(e, Error::RemoteFailure { rank: 1, message } if message.contains("injected")),
                "step {at} rank {r}: {e:?}"
            );
            has(&e.to_string(), &["rank 1", "injected"]);
        }
        assert!(!root_json(&dir).exists(), "step {at}: committed");
        // Nothing is created before the directory is prepared (step 3).
        assert_eq!(dir.exists(), at > 2, "step {at}");
        if at > 2 {
            let e = open_err(&dir);
            assert!(
                matches!(storage(&e), StorageError::Incomplete { .. }),
                "step {at}: {e:?}"
            );
        }
    }
}

#[test]
fn failed_overwrite_before_prepare_keeps_the_old_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    let opts = SaveOptions {
        overwrite: true,
        ..Default::default()
    };
    // Rank 1 holds a duplicate piece: fails at the first agreement, before rank 0 prepares.
    let res = save_ranks(&dir, 2, &opts, |r| {
        let mut v = standard(2)(r);
        if r == 1 {
            v.push(v[0].clone());
        }
        v
    });
    assert!(res.iter().all(Result::is_err));
    assert_loads(&dir, "w", DType::Float32, &[8, 6]);
    // A failure in or after prepare (the new save writes into a staging directory: rank 0
    // made it when another rank fails the prepare agreement, step 3, or later) leaves the
    // previous checkpoint loadable and removes the staging directory.
    for at in 3..=5 {
        let res = save_faulty(&dir, 2, 1, at, Fault::Report, &opts, T);
        assert!(res.iter().all(Result::is_err), "step {at}");
        assert_loads(&dir, "w", DType::Float32, &[8, 6]);
        let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("staging"))
            .collect();
        assert!(leftovers.is_empty(), "step {at}: {leftovers:?}");
    }
}

#[test]
fn a_rank_dying_mid_save_fails_the_others_fast() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    save_standard(&good, 2);
    let timeout = Duration::from_secs(5);
    for at in 1..=5 {
        let dir = tmp.path().join(format!("dead{at}"));
        let t0 = Instant::now();
        let res = save_faulty(&dir, 3, 2, at, Fault::Die, &SaveOptions::default(), timeout);
        assert!(t0.elapsed() < timeout, "step {at}: took {:?}", t0.elapsed());
        for (r, res) in res.iter().enumerate().take(2) {
            let e = res.as_ref().unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Comm(CommError::PeerLost { peer: 2, .. }) | Error::RemoteFailure { .. }
                ),
                "step {at} rank {r}: {e:?}"
            );
            has(&e.to_string(), &["rank 2"]);
        }
        assert!(res[2].is_err());
        assert!(
            !root_json(&dir).exists(),
            "step {at}: committed without rank 2"
        );
    }
    assert_loads(&good, "w", DType::Float32, &[8, 6]);
    assert_loads(&good, "b", DType::Float32, &[6]);
}

#[test]
fn a_silent_rank_times_out() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let res = run_local(2, timeout, |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        Some(save_with(
            &dir,
            &comm,
            &SaveOptions::default(),
            &standard(2)(0),
        ))
    });
    let e = res[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Comm(CommError::Timeout {
                peer: Some(1),
                rank: 0,
                ..
            })
        ),
        "{e:?}"
    );
    has(&e.to_string(), &["rank 1", "timed out"]);
    // rank 0 gave up long before rank 1 woke up (the thread join waits for the sleeper).
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(!root_json(&dir).exists());
}

#[test]
fn a_rank_dying_mid_load_fails_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 2);
    for at in 1..=3 {
        let t0 = Instant::now();
        let res = run_local(2, Duration::from_secs(5), |comm| {
            let mut w = vec![0f32; 24];
            let r = comm.rank() as u64;
            let mut t =
                [LoadTarget::from_slice("w", &[8, 6], &[4 * r, 0], &mut w, &[4, 6]).unwrap()];
            if r == 1 {
                let c = Faulty::new(comm, at, Fault::Die);
                load(&mut t, &dir, &c, &LoadOptions::default()).map(|_| ())
            } else {
                load(&mut t, &dir, &comm, &LoadOptions::default()).map(|_| ())
            }
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "step {at}");
        let e = res[0].as_ref().unwrap_err();
        assert!(
            matches!(e, Error::Comm(CommError::PeerLost { peer: 1, .. })),
            "step {at}: {e:?}"
        );
        assert!(res[1].is_err());
    }
}

/// A communicator whose rank replaces its layout description (hash and bytes) with `blob`,
/// as a rank running another version of the library, or a corrupting transport, would.
struct Tamper {
    inner: LocalComm,
    /// Replacement for the rank's description of its layout (a one-rank summary).
    blob: Vec<u8>,
}

impl Communicator for Tamper {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.inner.all_gather(data)
    }
    fn all_reduce(&self, data: &[u8], merge: &Merge<'_>) -> Result<Vec<u8>, CommError> {
        if data.starts_with(b"ZCKS1") {
            return self.inner.all_reduce(&self.blob, merge);
        }
        self.inner.all_reduce(data, merge)
    }
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, CommError> {
        self.inner.broadcast(root, data)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        self.inner.exchange(sends, recvs)
    }
}

fn save_tampered(dir: &Path, blob: Vec<u8>) -> Vec<zarrckpt::Result<SaveReport>> {
    let f = standard(2);
    run_local(2, T, |comm| {
        let pieces = f(comm.rank());
        if comm.rank() == 1 {
            let c = Tamper {
                inner: comm,
                blob: blob.clone(),
            };
            save_with(dir, &c, &SaveOptions::default(), &pieces)
        } else {
            save_with(dir, &comm, &SaveOptions::default(), &pieces)
        }
    })
}

#[test]
fn malformed_layout_from_a_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    // A template that does not match the hash it travels with.
    let mut blob = Summary::leaf(1, b"ZCKT1\x00\x00\x00".to_vec(), &[]).encode();
    let at = b"ZCKS1".len() + 1;
    blob[at] ^= 0xff;
    let res = save_tampered(&dir, blob);
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(e, Error::Comm(CommError::Mismatch { detail, .. }) if detail.contains("hash")),
            "{e:?}"
        );
        has(&e.to_string(), &["rank 1", "hash"]);
    }
    // A well-framed description whose template is malformed: names the rank and the byte.
    let blob = Summary::leaf(1, b"ZCKT1\x01\x04../x\x0b\x00\x00\x00".to_vec(), &[]).encode();
    let res = save_tampered(&dir, blob);
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(e, Error::Layout(l) if l.rank == 1 && l.at > 0 && l.reason.contains("..")),
            "{e:?}"
        );
        has(&e.to_string(), &["rank 1", "byte"]);
    }
    // A rank claiming to be another one.
    let (t, c) = Template::describe(&zarrckpt::plan::RankLayout::default());
    let res = save_tampered(&dir, Summary::leaf(0, t.encode(), &c).encode());
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(e, Error::Comm(CommError::Mismatch { detail, .. }) if detail.contains("rank 0 described twice")),
            "{e:?}"
        );
    }
    // Garbage.
    let res = save_tampered(&dir, b"ZCKS1\xff\xff\xff".to_vec());
    for r in &res {
        let e = r.as_ref().unwrap_err();
        has(&e.to_string(), &["rank 1"]);
    }
    assert!(!dir.exists());
}

#[test]
fn ranks_calling_save_and_load_at_once_fail_without_hanging() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    save_standard(&good, 2);
    let dir = tmp.path().join("ck");
    let t0 = Instant::now();
    let res = run_local(2, Duration::from_secs(5), |comm| {
        if comm.rank() == 0 {
            save_with(&dir, &comm, &SaveOptions::default(), &standard(2)(0)).map(|_| ())
        } else {
            let mut w = vec![0f32; 24];
            let mut t = [LoadTarget::from_slice("w", &[8, 6], &[4, 0], &mut w, &[4, 6]).unwrap()];
            load(&mut t, &good, &comm, &LoadOptions::default()).map(|_| ())
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for (r, res) in res.iter().enumerate() {
        assert!(res.is_err(), "rank {r} succeeded");
    }
    assert!(!root_json(&dir).exists());
}

#[test]
fn save_under_a_regular_file_is_an_io_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let dir = file.join("ck");
    let res = save_ranks(&dir, 2, &SaveOptions::default(), standard(2));
    let e = res[0].as_ref().unwrap_err();
    assert!(
        matches!(storage(e), StorageError::Io { path, .. } if path.starts_with(&file)),
        "{e:?}"
    );
    has(&e.to_string(), &[file.to_str().unwrap()]);
    assert!(matches!(
        res[1].as_ref().unwrap_err(),
        Error::RemoteFailure { rank: 0, .. }
    ));
}

#[test]
fn inconsistent_requests_on_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let mut a = vec![0f32; 24];
    let mut b = vec![0u32; 24];
    let mut t = [
        LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut a, &[4, 6]).unwrap(),
        LoadTarget::from_slice("w", &[8, 6], &[4, 0], &mut b, &[4, 6]).unwrap(),
    ];
    let e = load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, Error::InconsistentPieces { key, .. } if key.as_str() == "w"),
        "{e:?}"
    );
    has(&e.to_string(), &["`w`", "float32", "uint32"]);
}

/// A communicator whose first `exchange` fails on this rank alone (a timeout or a size
/// mismatch seen by one side only), without taking part in it.
struct FailExchangeOnce {
    inner: LocalComm,
    failed: AtomicUsize,
}

impl Communicator for FailExchangeOnce {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.inner.all_gather(data)
    }
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, CommError> {
        self.inner.broadcast(root, data)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        if self.failed.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(CommError::Timeout {
                op: "exchange",
                rank: self.rank(),
                peer: Some(0),
                after: Duration::ZERO,
            });
        }
        self.inner.exchange(sends, recvs)
    }
}

#[test]
fn one_sided_exchange_failure_never_commits_an_incomplete_checkpoint() {
    // Unaligned rows 0..2 | 2..5 | 5..10 of [10, 64] f32: coarse chunks of 5 rows; chunk 0 is
    // written by rank 1 with rows 0..2 sent by rank 0. Rank 1's exchange fails; ranks 0 and 2
    // carry on to "files written". Rank 1 returns its error and, as a caller retrying the save
    // on the same communicator would, calls save again: its first agreement pairs with the
    // others' "files written" agreement, and rank 0 commits a checkpoint without chunk 0.
    // (Regression: this committed an incomplete checkpoint until save agreed on the exchange.)
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let retry = tmp.path().join("retry");
    let rows = [(0u64, 2u64), (2, 3), (5, 5)];
    let pieces = |r: usize| {
        vec![p(
            "u",
            DType::Float32,
            &[10, 64],
            &[rows[r].0, 0],
            &[rows[r].1, 64],
            0,
        )]
    };
    let res = run_local(3, Duration::from_secs(5), |comm| {
        let r = comm.rank();
        if r == 1 {
            let c = FailExchangeOnce {
                inner: comm,
                failed: AtomicUsize::new(0),
            };
            let first = save_with(&dir, &c, &SaveOptions::default(), &pieces(1));
            let _second = save_with(&retry, &c, &SaveOptions::default(), &pieces(1));
            first.map(|_| ())
        } else {
            save_with(&dir, &comm, &SaveOptions::default(), &pieces(r)).map(|_| ())
        }
    });
    assert!(res[1].is_err());
    if root_json(&dir).exists() {
        let ck = Checkpoint::open(&dir).unwrap();
        let report = ck.verify(1, None).unwrap();
        assert!(
            report.problems.is_empty(),
            "committed with problems: {:?}",
            report.problems
        );
    }
}

/// `AssumeOkUnexpected` (Megatron's `ASSUME_OK_UNEXPECTED`): no key check before reading; a
/// key the checkpoint lacks fails on the rank that reads it, naming that rank, while the
/// other ranks' reads go ahead and they fail with a `RemoteFailure` naming it. Contrast
/// `unexpected_key_of_another_rank_names_it`, where every rank fails before reading.
#[test]
fn assume_ok_unexpected_fails_when_the_key_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    let want_w = full("w", DType::Float32, &[8, 6]);
    let run = |ghost: bool| {
        run_local(3, T, |comm| {
            let mut w = vec![0f32; 48];
            let mut x = vec![0f32; 2];
            let r = {
                let mut t =
                    vec![LoadTarget::from_slice("w", &[8, 6], &[0, 0], &mut w, &[8, 6]).unwrap()];
                if ghost && comm.rank() == 2 {
                    t.push(LoadTarget::from_slice("ghost", &[2], &[0], &mut x, &[2]).unwrap());
                }
                let opts = LoadOptions {
                    strict: StrictMode::AssumeOkUnexpected,
                    exchange: false,
                    ..Default::default()
                };
                load(&mut t, &dir, &comm, &opts)
            };
            (r, f32_bytes(&w))
        })
    };
    for (rank, (res, w)) in run(true).into_iter().enumerate() {
        let e = res.as_ref().unwrap_err();
        if rank == 2 {
            assert!(
                matches!(e, Error::UnexpectedKeys { rank: 2, keys, path } if keys[0].as_str() == "ghost" && path == &dir),
                "rank {rank}: {e:?}"
            );
            has(&e.to_string(), &["`ghost`", dir.to_str().unwrap()]);
        } else {
            assert!(
                matches!(e, Error::RemoteFailure { rank: 2, message } if message.contains("`ghost`")),
                "rank {rank}: {e:?}"
            );
            assert_eq!(w, want_w, "rank {rank}: no check before reading");
        }
    }
    // With every key present, it loads like any other mode, and reports no key sets.
    for (res, w) in run(false) {
        let report = res.unwrap();
        assert_eq!(w, want_w);
        assert!(report.unexpected.is_empty() && report.missing.is_empty());
    }
}

// ---------------------------------------------------------------------------------------------
// Hostile metadata: a crafted checkpoint of a few KB declaring absurd sizes and counts. Every
// command (inspect, verify, export, and loads through the library) must end with a typed
// error or a correct answer, quickly, in bounded memory: the CLI runs as a child process
// under an address-space limit, so an attempt to allocate gigabytes fails visibly.
// ---------------------------------------------------------------------------------------------

/// Address space the crafted-checkpoint children may use.
const HOSTILE_AS_LIMIT: u64 = 2 << 30;

/// Writes a checkpoint with the given tensors (root index and each array's `zarr.json`,
/// no shard files) under `dir`.
/// A crafted tensor: key, data type, shape, chunk shape, subchunk shape.
type Crafted<'a> = (&'a str, DType, &'a [u64], &'a [u64], &'a [u64]);

fn craft(dir: &Path, tensors: &[Crafted<'_>]) {
    use zarrckpt::storage::meta::{CheckpointMeta, TensorEntry, tensor_path};
    let mut meta = CheckpointMeta::new(1);
    for &(key, dtype, shape, chunk, sub) in tensors {
        let key = TensorKey::new(key).unwrap();
        let entry = TensorEntry {
            path: tensor_path(&key),
            dtype,
            shape: shape.to_vec(),
            chunk_shape: chunk.to_vec(),
            subchunk_shape: sub.to_vec(),
            compression: zarrckpt::Compression::None,
        };
        let array = dir.join(&entry.path);
        std::fs::create_dir_all(&array).unwrap();
        let doc = zarrckpt::storage::array::array_metadata(&key, &entry);
        std::fs::write(array.join("zarr.json"), serde_json::to_vec(&doc).unwrap()).unwrap();
        meta.tensors.insert(key, entry);
    }
    std::fs::write(dir.join("zarr.json"), meta.to_root_json()).unwrap();
}

/// Runs the CLI under [`HOSTILE_AS_LIMIT`] and a 60 s deadline; returns (exit code,
/// stdout + stderr). A signal or the deadline fails the test.
fn cli_bounded(args: &[&str]) -> (i32, String) {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_zarrckpt"));
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: HOSTILE_AS_LIMIT,
                rlim_max: HOSTILE_AS_LIMIT,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("zarrckpt {args:?} still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let Some(code) = status.code() else {
        panic!("zarrckpt {args:?} was killed by a signal: {status:?}\n{text}");
    };
    (code, text)
}

/// Runs `verify`, `export` and `inspect` on a crafted checkpoint; each must end (no signal,
/// no hang) with exit code `expect_ok` for inspect, and 1 with a message containing every
/// part of `verify_has` / `export_has` for the others.
fn hostile_cli(dir: &Path, inspect_ok: bool, verify_has: &[&str], export_has: &[&str]) {
    let d = dir.to_str().unwrap();
    let (code, text) = cli_bounded(&["inspect", d]);
    assert_eq!(code == 0, inspect_ok, "inspect: {text}");
    let (code, text) = cli_bounded(&["verify", d]);
    assert_eq!(code, 1, "verify: {text}");
    has(&text, verify_has);
    let out = dir.with_extension("safetensors");
    let (code, text) = cli_bounded(&["export", d, "--out", out.to_str().unwrap()]);
    assert_eq!(code, 1, "export: {text}");
    has(&text, export_has);
    assert!(!out.exists(), "export left {}", out.display());
    assert!(
        !out.with_extension("safetensors.partial").exists(),
        "export left its partial file"
    );
}

#[test]
fn hostile_terabyte_tensor_is_refused_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    // 1 TiB declared, one shard of 2^20 subchunks of 1 MiB; no file at all.
    craft(
        &dir,
        &[(
            "w",
            DType::Float32,
            &[1 << 20, 1 << 18],
            &[1 << 20, 1 << 18],
            &[1, 1 << 18],
        )],
    );
    hostile_cli(
        &dir,
        true,
        &["tensor `w`", "c.0.0", "missing"],
        &["tensor `w`", "cannot be read into memory"],
    );
    let ck = Checkpoint::open(&dir).unwrap();
    let e = ck.read_tensor(&TensorKey::new("w").unwrap()).unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::TooLarge { key, bytes, .. } if key == "w" && *bytes == 1 << 40),
        "{e:?}"
    );
    let e = ck
        .read_ndarray::<f32>(&TensorKey::new("w").unwrap())
        .unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::TooLarge { .. }),
        "{e:?}"
    );
}

#[test]
fn hostile_gigabyte_tensor_fails_export_without_allocating_it() {
    // 4 GiB declared (less than the machine's memory, more than the child's address
    // space): the export's buffer cannot be allocated, and that is an error, not an abort.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    craft(
        &dir,
        &[(
            "w",
            DType::Float32,
            &[1 << 12, 1 << 18],
            &[1 << 12, 1 << 18],
            &[1, 1 << 18],
        )],
    );
    hostile_cli(&dir, true, &["tensor `w`", "missing"], &["tensor `w`"]);
}

#[test]
fn hostile_sixteen_million_missing_chunks_verify_quickly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    // 16 GiB in 2^24 shard files of 1 KiB, none present.
    craft(
        &dir,
        &[("w", DType::UInt8, &[1 << 24, 1024], &[1, 1024], &[1, 1024])],
    );
    let t0 = Instant::now();
    let ck = Checkpoint::open(&dir).unwrap();
    let report = ck.verify(2, None).unwrap();
    assert_eq!(report.chunks, 1 << 24);
    assert!(
        report.problems.len() as u64 >= zarrckpt::checkpoint::MAX_PROBLEMS_PER_TENSOR
            && report.problems.len() < 200,
        "{} problems",
        report.problems.len()
    );
    assert!(
        report.skipped_chunks > (1 << 24) - 1000,
        "{} skipped",
        report.skipped_chunks
    );
    assert!(
        matches!(&report.problems[0].error, Error::Storage(StorageError::MissingChunk { key, .. }) if key == "w"),
        "{:?}",
        report.problems[0].error
    );
    println!("verify of 2^24 declared chunks: {:?}", t0.elapsed());
    hostile_cli(&dir, true, &["missing", "not checked"], &["tensor `w`"]);
}

#[test]
fn hostile_geometry_is_refused_when_the_index_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    // (name, shape, chunk shape, subchunk shape, part of the reason)
    type Case<'a> = (&'a str, &'a [u64], &'a [u64], &'a [u64], &'a str);
    let cases: [Case<'_>; 5] = [
        // A subchunk of 1 GiB: more than a reader decodes at once.
        (
            "sub",
            &[1 << 15, 1 << 15],
            &[1 << 15, 1 << 15],
            &[1 << 15, 1 << 15],
            "subchunk",
        ),
        // 2^26 subchunks in one shard.
        ("many", &[1 << 26], &[1 << 26], &[1], "subchunks per shard"),
        // 2^26 shard files.
        (
            "files",
            &[1 << 26, 1024],
            &[1, 1024],
            &[1, 1024],
            "shard files",
        ),
        // 2^24 one-byte subchunks: planning a whole read would take gigabytes.
        ("tiny", &[1 << 24], &[1], &[1], "planning"),
        // Dimensions whose product overflows.
        ("overflow", &[u64::MAX, 2], &[1, 1], &[1, 1], "overflow"),
    ];
    for (name, shape, chunk, sub, reason) in cases {
        let dir = tmp.path().join(name);
        craft(&dir, &[("w", DType::UInt8, shape, chunk, sub)]);
        let e = Checkpoint::open(&dir).unwrap_err();
        assert!(
            matches!(storage(&e), StorageError::Malformed { reason: r, .. } if r.contains(reason)),
            "{name}: {e:?}"
        );
        hostile_cli(&dir, false, &["zarr.json", reason], &["zarr.json", reason]);
    }
    // Many tensors each within the limits, too many shard files together.
    let dir = tmp.path().join("together");
    craft(
        &dir,
        &[
            ("a", DType::UInt8, &[1 << 23, 1024], &[1, 1024], &[1, 1024]),
            ("b", DType::UInt8, &[1 << 23, 1024], &[1, 1024], &[1, 1024]),
            ("c", DType::UInt8, &[1 << 23, 1024], &[1, 1024], &[1, 1024]),
        ],
    );
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::Malformed { reason, .. } if reason.contains("shard files in all")),
        "{e:?}"
    );
}

#[test]
fn hostile_huge_array_metadata_file_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    // The array's zarr.json made a sparse 64 GiB file: reading it whole would abort.
    let path = dir.join("tensors/w/zarr.json");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let e = Checkpoint::open(&dir)
        .unwrap()
        .read_tensor(&TensorKey::new("w").unwrap())
        .unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::Malformed { path: p, reason } if p == &path && reason.contains("larger than")),
        "{e:?}"
    );
    hostile_cli(
        &dir,
        true,
        &["tensors/w/zarr.json", "larger than"],
        &["tensors/w/zarr.json", "larger than"],
    );
}

#[test]
fn hostile_huge_root_metadata_file_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_standard(&dir, 1);
    std::fs::OpenOptions::new()
        .write(true)
        .open(root_json(&dir))
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let (code, text) = cli_bounded(&["inspect", dir.to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    has(&text, &["zarr.json", "larger than"]);
}

#[test]
fn hostile_foreign_array_sizes_are_refused() {
    use zarrckpt::storage::foreign::read_array;
    let tmp = tempfile::tempdir().unwrap();
    let doc = |shape: &[u64], chunk: &[u64]| {
        serde_json::json!({
            "zarr_format": 3, "node_type": "array", "shape": shape, "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
            "codecs": [{"name": "bytes"}],
        })
    };
    // 1 TiB declared.
    let a = tmp.path().join("a");
    std::fs::create_dir(&a).unwrap();
    write_json(&a.join("zarr.json"), &doc(&[1 << 40], &[1 << 20]));
    let e = read_array(&a).unwrap_err();
    assert!(matches!(e, StorageError::TooLarge { .. }), "{e:?}");
    // A 1 TiB chunk for a 10-byte array.
    let b = tmp.path().join("b");
    std::fs::create_dir(&b).unwrap();
    write_json(&b.join("zarr.json"), &doc(&[10], &[1 << 40]));
    let e = read_array(&b).unwrap_err();
    assert!(
        matches!(&e, StorageError::Malformed { reason, .. } if reason.contains("chunk")),
        "{e:?}"
    );
    // A sparse 64 GiB zarr.json.
    let c = tmp.path().join("c");
    std::fs::create_dir(&c).unwrap();
    write_json(&c.join("zarr.json"), &doc(&[10], &[10]));
    std::fs::OpenOptions::new()
        .write(true)
        .open(c.join("zarr.json"))
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let e = read_array(&c).unwrap_err();
    assert!(
        matches!(&e, StorageError::Malformed { reason, .. } if reason.contains("larger than")),
        "{e:?}"
    );
    // A sound one still reads.
    let d = tmp.path().join("d");
    std::fs::create_dir(&d).unwrap();
    write_json(&d.join("zarr.json"), &doc(&[10], &[4]));
    assert_eq!(read_array(&d).unwrap().data, vec![0u8; 10]);
}
