//! Whatever the writer commits, every reader reads (spec rules W10 to W15): random tensors
//! (prime, 0, 1 and long 1-D extents, many small tensors, every data type) saved by 1 to 7
//! in-process ranks (torch.chunk, numpy.array_split and flat-range splits) with every
//! compression, then opened, verified and read back bit for bit with the reader's own checks.
//! A save may refuse a tensor (naming it and the limit) but must never commit a checkpoint a
//! reader refuses.
//!
//! The default run keeps to [`DEFAULT_CASES`] cases; `ZARRCKPT_PROPTEST_CASES=N` runs N.
//! Explicit tests: the prime-extent tensors of issue 23 and a DeepSeek-V3-sized inventory
//! (about 90,000 keys), at 1 and 3 ranks, through the library and the CLI (`import`,
//! `verify`, `inspect`, `export`).

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{chunk_split, cut, tensor_bytes};
use proptest::prelude::*;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use zarrckpt::comm::run_local;
use zarrckpt::plan::grid::check_geometry;
use zarrckpt::{
    Checkpoint, Compression, DType, Region, SaveOptions, ShardedTensor, TensorKey, save,
};

/// Upper bound on one collective wait.
const TIMEOUT: Duration = Duration::from_secs(300);

/// Cases of the property test in the default run.
const DEFAULT_CASES: u32 = 24;

fn cases() -> u32 {
    std::env::var("ZARRCKPT_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// How a tensor is cut among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// torch.chunk along an axis (trailing pieces short or empty).
    Chunk,
    /// numpy.array_split along an axis.
    Even,
    /// Equal ranges of the C-order flattening (ZeRO / FSDP1 flat shards).
    Flat,
}

#[derive(Debug, Clone)]
struct TensorSpec {
    key: String,
    dtype: DType,
    shape: Vec<u64>,
    split: Split,
    axis: usize,
}

#[derive(Debug, Clone)]
struct Case {
    world: u32,
    compression: Compression,
    tensors: Vec<TensorSpec>,
}

const PRIMES: [u64; 14] = [
    2, 3, 13, 61, 127, 257, 1021, 4099, 8191, 65_537, 70_001, 100_003, 123_457, 131_071,
];

/// One extent: 0, 1, small, or a prime.
fn extent() -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        2 => Just(1u64),
        4 => 2u64..=40,
        3 => prop::sample::select(PRIMES.to_vec()),
    ]
}

/// Halves the largest extent until the tensor has at most 2^18 elements.
fn clamp(mut shape: Vec<u64>) -> Vec<u64> {
    while shape.iter().product::<u64>() > 1 << 18 {
        let i = (0..shape.len()).max_by_key(|&i| shape[i]).unwrap_or(0);
        shape[i] /= 2;
    }
    shape
}

fn shape() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        // long 1-D: a prime or any length up to 2^18
        3 => prop_oneof![2 => prop::sample::select(PRIMES.to_vec()), 1 => 1u64..=(1 << 18)].prop_map(|n| vec![n]),
        3 => prop::collection::vec(extent(), 0..=3).prop_map(clamp),
    ]
}

fn split() -> impl Strategy<Value = Split> {
    prop_oneof![Just(Split::Chunk), Just(Split::Even), Just(Split::Flat)]
}

fn tensor(i: usize) -> impl Strategy<Value = TensorSpec> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        shape(),
        split(),
        0usize..4,
    )
        .prop_map(move |(dtype, shape, split, axis)| TensorSpec {
            key: format!("model.layers.{i}.t"),
            dtype,
            shape,
            split,
            axis,
        })
}

/// Many small tensors: scalars and a few elements each.
fn small_tensor(i: usize) -> impl Strategy<Value = TensorSpec> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        prop::collection::vec(0u64..=3, 0..=2),
    )
        .prop_map(move |(dtype, shape)| TensorSpec {
            key: format!("small/{i}"),
            dtype,
            shape,
            split: Split::Chunk,
            axis: 0,
        })
}

fn case() -> impl Strategy<Value = Case> {
    let tensors = prop_oneof![
        4 => (1usize..=4).prop_flat_map(|n| (0..n).map(tensor).collect::<Vec<_>>()),
        1 => (50usize..=150).prop_flat_map(|n| (0..n).map(small_tensor).collect::<Vec<_>>()),
    ];
    (
        prop_oneof![2 => Just(1u32), 3 => 2u32..=7],
        prop_oneof![
            Just(Compression::None),
            Just(Compression::Zstd),
            Just(Compression::Blosc)
        ],
        tensors,
    )
        .prop_map(|(world, compression, tensors)| Case {
            world,
            compression,
            tensors,
        })
}

/// What rank `rank` of `world` holds of a tensor: (region or flat range, bytes).
enum Held {
    Box(Region),
    Flat(std::ops::Range<u64>),
}

fn held(t: &TensorSpec, world: u32, rank: u32) -> Option<Held> {
    let n = t.shape.iter().product::<u64>();
    if t.shape.is_empty() {
        return (rank == 0).then(|| Held::Box(Region::full(&t.shape)));
    }
    match t.split {
        Split::Flat => {
            let (o, l) = even_split(n, u64::from(world))[rank as usize];
            Some(Held::Flat(o..o + l))
        }
        Split::Chunk | Split::Even => {
            let axis = t.axis % t.shape.len();
            let parts = if t.split == Split::Chunk {
                chunk_split(t.shape[axis], u64::from(world))
            } else {
                even_split(t.shape[axis], u64::from(world))
            };
            let (o, l) = parts[rank as usize];
            let mut offset = vec![0; t.shape.len()];
            let mut shape = t.shape.clone();
            offset[axis] = o;
            shape[axis] = l;
            Some(Held::Box(Region::new(offset, shape).unwrap()))
        }
    }
}

/// numpy.array_split: sizes differ by at most one.
fn even_split(dim: u64, n: u64) -> Vec<(u64, u64)> {
    let (q, r) = (dim / n, dim % n);
    let mut o = 0;
    (0..n)
        .map(|i| {
            let l = q + u64::from(i < r);
            let p = (o, l);
            o += l;
            p
        })
        .collect()
}

/// Saves `tensors` (with their full bytes) from `world` ranks into `dir`.
fn save_all(
    tensors: &[TensorSpec],
    full: &[Vec<u8>],
    world: u32,
    compression: Compression,
    dir: &Path,
) -> Vec<zarrckpt::Result<zarrckpt::SaveReport>> {
    run_local(world as usize, TIMEOUT, |comm| {
        let rank = zarrckpt::Communicator::rank(&comm) as u32;
        let mut datas: Vec<(usize, Held, Vec<u8>)> = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let elem = t.dtype.size();
            match held(t, world, rank) {
                Some(Held::Box(r)) => {
                    let b = cut(&full[i], &t.shape, &r, elem);
                    datas.push((i, Held::Box(r), b));
                }
                Some(Held::Flat(range)) => {
                    let b =
                        full[i][range.start as usize * elem..range.end as usize * elem].to_vec();
                    datas.push((i, Held::Flat(range), b));
                }
                None => {}
            }
        }
        let pieces: Vec<ShardedTensor<'_>> = datas
            .iter()
            .map(|(i, h, b)| {
                let t = &tensors[*i];
                let key = TensorKey::new(t.key.clone()).unwrap();
                match h {
                    Held::Box(r) => {
                        ShardedTensor::new(key, t.dtype, t.shape.clone(), r.clone(), 0, b)
                    }
                    Held::Flat(range) => {
                        ShardedTensor::from_flat(key, t.dtype, t.shape.clone(), range.clone(), 0, b)
                    }
                }
                .unwrap()
            })
            .collect();
        let opts = SaveOptions {
            overwrite: true,
            compression,
            ..SaveOptions::default()
        };
        save(&pieces, dir, &comm, &opts)
    })
}

/// Opens, verifies and reads back every tensor bit for bit; also checks each committed
/// geometry against the readers' limits directly.
fn check_committed(dir: &Path, tensors: &[TensorSpec], full: &[Vec<u8>]) -> Result<(), String> {
    let ck = Checkpoint::open(dir).map_err(|e| format!("open refused a committed save: {e}"))?;
    let report = ck
        .verify(2, None)
        .map_err(|e| format!("verify failed: {e}"))?;
    if !report.problems.is_empty() {
        return Err(format!("verify found {:?}", report.problems));
    }
    if report.tensors != tensors.len() {
        return Err(format!("{} tensors verified", report.tensors));
    }
    for (t, bytes) in tensors.iter().zip(full) {
        let key = TensorKey::new(t.key.clone()).unwrap();
        let e = ck.meta().tensors.get(&key).ok_or("no entry")?;
        check_geometry(&e.shape, &e.chunk_shape, &e.subchunk_shape, e.dtype.size())
            .map_err(|l| format!("{}: {l}", t.key))?;
        let got = ck
            .read_tensor(&key)
            .map_err(|e| format!("read {}: {e}", t.key))?;
        if &got != bytes {
            return Err(format!("{}: bytes differ", t.key));
        }
    }
    Ok(())
}

fn full_bytes(tensors: &[TensorSpec]) -> Vec<Vec<u8>> {
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| tensor_bytes(i as u64 + 1, &t.shape, t.dtype))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// Every committed save opens, verifies and reads back bit for bit.
    #[test]
    fn every_committed_save_is_read_back(c in case()) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ck");
        let full = full_bytes(&c.tensors);
        let results = save_all(&c.tensors, &full, c.world, c.compression, &dir);
        let ok = results.iter().filter(|r| r.is_ok()).count();
        prop_assert!(ok == results.len(), "save failed: {:?}", results.iter().find_map(|r| r.as_ref().err().map(ToString::to_string)));
        if let Err(e) = check_committed(&dir, &c.tensors, &full) {
            prop_assert!(false, "{}", e);
        }
    }
}

fn primes() -> Vec<TensorSpec> {
    [
        ("vocab.float32", DType::Float32, 70_001u64),
        ("mask.bool", DType::Bool, 100_003),
        ("ids.int64", DType::Int64, 123_457),
    ]
    .into_iter()
    .map(|(key, dtype, n)| TensorSpec {
        key: key.into(),
        dtype,
        shape: vec![n],
        split: Split::Chunk,
        axis: 0,
    })
    .collect()
}

#[test]
fn prime_extents_commit_and_read_back_at_one_and_three_ranks() {
    let tensors = primes();
    let full = full_bytes(&tensors);
    for world in [1, 3] {
        for split in [Split::Chunk, Split::Flat] {
            let ts: Vec<TensorSpec> = tensors
                .iter()
                .cloned()
                .map(|mut t| {
                    t.split = split;
                    t
                })
                .collect();
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("ck");
            for r in save_all(&ts, &full, world, Compression::None, &dir) {
                r.unwrap();
            }
            check_committed(&dir, &ts, &full).unwrap();
            if world == 1 {
                // One whole-tensor subchunk each: the rule's one-element subchunks are
                // refused by readers.
                let ck = Checkpoint::open(&dir).unwrap();
                for t in &ts {
                    let e = &ck.meta().tensors[&TensorKey::new(t.key.clone()).unwrap()];
                    assert_eq!(e.subchunk_shape, t.shape, "{}", t.key);
                }
            }
        }
    }
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
}

fn run(cmd: &mut Command) -> Output {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{:?} failed:\n{}\n{}",
        cmd,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::Float32 => Dtype::F32,
        DType::Bool => Dtype::BOOL,
        DType::Int64 => Dtype::I64,
        DType::Float8E4M3FN => Dtype::F8_E4M3,
        other => panic!("no safetensors type for {other}"),
    }
}

fn write_st(path: &Path, tensors: &[TensorSpec], full: &[Vec<u8>]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(full)
        .map(|(t, b)| {
            let shape = t.shape.iter().map(|&d| d as usize).collect();
            (
                t.key.clone(),
                TensorView::new(st_dtype(t.dtype), shape, b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// `import` at `ranks`, then `verify`, `inspect --json` and `export`: every tensor comes back
/// bit for bit. Returns the checkpoint's root zarr.json size.
fn cli_round_trip(tmp: &Path, tensors: &[TensorSpec], full: &[Vec<u8>], ranks: u32) -> u64 {
    let src = tmp.join("in.safetensors");
    if !src.exists() {
        write_st(&src, tensors, full);
    }
    let ckpt = tmp.join(format!("ck{ranks}"));
    let out = tmp.join(format!("out{ranks}.safetensors"));
    let t0 = Instant::now();
    run(bin()
        .arg("import")
        .arg(&src)
        .arg("--out")
        .arg(&ckpt)
        .args(["--ranks", &ranks.to_string()]));
    let t_import = t0.elapsed();
    let t0 = Instant::now();
    run(bin().arg("verify").arg(&ckpt));
    let t_verify = t0.elapsed();
    let o = run(bin().arg("inspect").arg(&ckpt).arg("--json"));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["total_tensors"], tensors.len());
    assert_eq!(doc["world_size"], ranks);
    let t0 = Instant::now();
    run(bin().arg("export").arg(&ckpt).arg("--out").arg(&out));
    let t_export = t0.elapsed();
    let back = std::fs::read(&out).unwrap();
    let back = SafeTensors::deserialize(&back).unwrap();
    assert_eq!(back.len(), tensors.len());
    for (t, b) in tensors.iter().zip(full) {
        let v = back.tensor(&t.key).unwrap();
        assert_eq!(v.dtype(), st_dtype(t.dtype), "{}", t.key);
        assert_eq!(v.data(), b.as_slice(), "{}", t.key);
    }
    let root = std::fs::metadata(ckpt.join("zarr.json")).unwrap().len();
    println!(
        "CLI, {} tensors, {ranks} rank(s): import {t_import:.2?}, verify {t_verify:.2?}, export {t_export:.2?}; root zarr.json {root} bytes",
        tensors.len()
    );
    root
}

#[test]
fn prime_extents_import_verify_inspect_export() {
    let tensors = primes();
    let full = full_bytes(&tensors);
    let tmp = tempfile::tempdir().unwrap();
    for ranks in [1, 3] {
        cli_round_trip(tmp.path(), &tensors, &full, ranks);
    }
}

/// DeepSeek-V3's fp8 Hugging Face inventory, tiny tensors: 61 layers (3 dense, 58 with 256
/// routed experts), weights and their `weight_scale_inv`: 90,000 keys and more.
fn deepseek_inventory() -> Vec<TensorSpec> {
    let mut keys: Vec<(String, DType, Vec<u64>)> = Vec::new();
    let mut linear = |prefix: String| {
        keys.push((format!("{prefix}.weight"), DType::Float8E4M3FN, vec![2, 3]));
        keys.push((
            format!("{prefix}.weight_scale_inv"),
            DType::Float32,
            vec![1, 1],
        ));
    };
    for l in 0..61 {
        let p = format!("model.layers.{l}");
        for a in [
            "q_a_proj",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_b_proj",
            "o_proj",
        ] {
            linear(format!("{p}.self_attn.{a}"));
        }
        if l < 3 {
            for m in ["gate_proj", "up_proj", "down_proj"] {
                linear(format!("{p}.mlp.{m}"));
            }
        } else {
            for e in 0..256 {
                for m in ["gate_proj", "up_proj", "down_proj"] {
                    linear(format!("{p}.mlp.experts.{e}.{m}"));
                }
            }
            for m in ["gate_proj", "up_proj", "down_proj"] {
                linear(format!("{p}.mlp.shared_experts.{m}"));
            }
        }
    }
    for l in 0..61 {
        let p = format!("model.layers.{l}");
        for n in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_a_layernorm.weight",
            "self_attn.kv_a_layernorm.weight",
        ] {
            keys.push((format!("{p}.{n}"), DType::Float32, vec![4]));
        }
        if l >= 3 {
            keys.push((format!("{p}.mlp.gate.weight"), DType::Float32, vec![2, 2]));
            keys.push((
                format!("{p}.mlp.gate.e_score_correction_bias"),
                DType::Float32,
                vec![2],
            ));
        }
    }
    keys.push((
        "model.embed_tokens.weight".into(),
        DType::Float32,
        vec![3, 4],
    ));
    keys.push(("model.norm.weight".into(), DType::Float32, vec![4]));
    keys.push(("lm_head.weight".into(), DType::Float32, vec![3, 4]));
    keys.into_iter()
        .map(|(key, dtype, shape)| TensorSpec {
            key,
            dtype,
            shape,
            split: Split::Chunk,
            axis: 0,
        })
        .collect()
}

/// A scratch directory, on tmpfs where there is one: the 90,000-key saves make some 270,000
/// files and directories durable one by one, which on a loaded virtual disk takes many
/// minutes of fsync alone (measured: 120 s of a 1-rank library save at load 8 on 2 cores).
fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    }
}

/// The index of a DeepSeek-V3-sized inventory passes the writer's check and the reader's
/// limit: it is larger than the old 32 MiB bound, within 32 MiB + 16 KiB per entry. (The
/// whole save, verify, import and export of it is
/// [`deepseek_v3_sized_inventory_commits_and_reads_back`], run with `--ignored`.)
#[test]
fn deepseek_v3_sized_index_is_written_and_read() {
    use zarrckpt::storage::meta::{CheckpointMeta, TensorEntry, root_json_limit, tensor_path};
    let tensors = deepseek_inventory();
    let mut meta = CheckpointMeta::new(3).with_save_id(zarrckpt::storage::footer::SaveId([7; 16]));
    for t in &tensors {
        let key = TensorKey::new(t.key.clone()).unwrap();
        let chunk: Vec<u64> = t.shape.iter().map(|&d| d.max(1)).collect();
        meta.tensors.insert(
            key.clone(),
            TensorEntry {
                path: tensor_path(&key),
                dtype: t.dtype,
                shape: t.shape.clone(),
                chunk_shape: chunk.clone(),
                subchunk_shape: chunk,
                compression: Compression::None,
            },
        );
    }
    meta.check_writable().unwrap();
    let bytes = meta.to_root_json();
    let n = bytes.len() as u64;
    assert!(
        n > 32 << 20 && n <= root_json_limit(tensors.len()),
        "{n} bytes"
    );
    println!("root zarr.json of {} tensors: {n} bytes", tensors.len());
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("zarr.json"), &bytes).unwrap();
    let t0 = Instant::now();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    println!("opened in {:.2?}", t0.elapsed());
    assert_eq!(ck.meta().tensors.len(), tensors.len());
}

/// The root limit bounds what an index of few entries may carry: a reader refuses a padded
/// file, and a save whose user metadata would make one refuses before writing anything.
#[test]
fn oversized_root_is_refused_by_reader_and_writer() {
    use zarrckpt::storage::meta::IndexLimit;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let data = [1f32, 2.0];
    let piece = ShardedTensor::from_slice("w", &[2], &[0], &data, &[2], 0).unwrap();
    let mut opts = SaveOptions::default();
    opts.user_metadata
        .insert("blob".into(), "x".repeat((32 << 20) + (40 << 10)).into());
    let e = save(
        std::slice::from_ref(&piece),
        &dir,
        &zarrckpt::comm::LocalComm::single(),
        &opts,
    )
    .unwrap_err();
    assert!(
        matches!(
            &e,
            zarrckpt::Error::Limit(IndexLimit::RootJson { entries: 1, .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("root zarr.json"), "{e}");
    assert!(!dir.exists(), "the refused save wrote {}", dir.display());
    // The same index written by hand: readers refuse it.
    opts.user_metadata.clear();
    save(&[piece], &dir, &zarrckpt::comm::LocalComm::single(), &opts).unwrap();
    let root = dir.join("zarr.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&root).unwrap()).unwrap();
    doc["attributes"]["zarrckpt"]["user"]["blob"] = "x".repeat((32 << 20) + (40 << 10)).into();
    std::fs::write(&root, serde_json::to_vec(&doc).unwrap()).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(
        e.to_string()
            .contains("a reader accepts for an index of 1 entries"),
        "{e}"
    );
}

#[test]
#[ignore = "minutes of I/O: cargo test --release --test prop_commit -- --ignored"]
fn deepseek_v3_sized_inventory_commits_and_reads_back() {
    let tensors = deepseek_inventory();
    assert!(tensors.len() > 90_000, "{}", tensors.len());
    let full = full_bytes(&tensors);
    let mut sizes = HashMap::new();
    for world in [1u32, 3] {
        let tmp = scratch();
        let dir = tmp.path().join("ck");
        let t0 = Instant::now();
        for r in save_all(&tensors, &full, world, Compression::None, &dir) {
            r.unwrap();
        }
        let t_save = t0.elapsed();
        let t0 = Instant::now();
        check_committed(&dir, &tensors, &full).unwrap();
        let t_check = t0.elapsed();
        let root = std::fs::metadata(dir.join("zarr.json")).unwrap().len();
        assert!(
            root > 32 << 20,
            "{root} bytes: the test must pass the old 32 MiB limit"
        );
        sizes.insert(world, root);
        println!(
            "library, {} tensors, {world} rank(s): save {t_save:.2?}, open + verify + read all {t_check:.2?}; root zarr.json {root} bytes",
            tensors.len()
        );
        drop(tmp);
        let tmp2 = scratch();
        cli_round_trip(tmp2.path(), &tensors, &full, world);
    }
    // Key counts alone make the index: the same at any world size.
    assert_eq!(sizes[&1], sizes[&3]);
}
