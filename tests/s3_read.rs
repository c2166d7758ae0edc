//! Reads straight from object stores through the storage seam (no download of the whole
//! generation): `Checkpoint::open` / `zarrckpt::load` on a URL, against the in-memory store and
//! a real S3 server on loopback (SeaweedFS, started here; see `tests/common/s3.rs`). Reads,
//! reshard loads, region reads and verify are bit-identical to the local path; a flipped byte
//! gives the typed checksum error naming tensor, chunk and object; a truncated or missing
//! object a typed error; a reshard load's read amplification (bytes fetched / bytes needed)
//! is printed and bounded; a reader decodes each shard index once.

mod common;
#[path = "common/proxy.rs"]
mod proxy;

use std::path::Path;
use std::time::Duration;

use common::s3;
use common::state::{self, RankState};
use common::{cut, tensor_bytes};
use zarrckpt::StorageError;
use zarrckpt::comm::run_local;
use zarrckpt::load::Reader;
use zarrckpt::remote::{self, RemoteOptions, RemoteStore, SaveTarget};
use zarrckpt::{
    Checkpoint, Communicator, DType, Error, LoadOptions, LoadTarget, Region, SaveOptions,
    ShardedTensor, TensorKey, save,
};

/// Saves the test state of `step` with `world` ranks to `url` and the same to a local
/// directory, returned.
fn save_both(url: &str, ropts: &RemoteOptions, world: usize, step: u64) -> tempfile::TempDir {
    let staging = tempfile::tempdir().unwrap();
    let target = SaveTarget {
        overwrite: false,
        staging_root: Some(staging.path().to_path_buf()),
    };
    let local = tempfile::tempdir().unwrap();
    let dir = local.path().join("ckpt");
    for r in run_local(world, Duration::from_secs(60), |comm| {
        let st = RankState::new(world as u64, comm.rank() as u64, step);
        save(&st.sharded(), &dir, &comm, &SaveOptions::default())?;
        remote::save_to_url(url, &comm, ropts, &target, |d| {
            save(&st.sharded(), d, &comm, &SaveOptions::default())
        })
    }) {
        r.unwrap();
    }
    local
}

/// Opens `url`: with the options given (and the collective load through
/// `load::load_with_reader`), else as a bare URL (`Checkpoint::open`, `zarrckpt::load`).
fn open(url: &str, ropts: Option<&RemoteOptions>) -> Checkpoint {
    match ropts {
        Some(o) => Checkpoint::open_url(url, o).unwrap(),
        None => Checkpoint::open(url).unwrap(),
    }
}

/// Reads, region reads, a reshard load on 3 ranks and verify through `url` equal the local
/// checkpoint at `local`; the shards are read by ranged gets.
fn reads_match_local(url: &str, ropts: Option<&RemoteOptions>, local: &Path) {
    let remote = open(url, ropts);
    assert!(
        remote.reader().fetches(),
        "{url} should be read by ranged gets"
    );
    let here = Checkpoint::open(local).unwrap();
    assert!(!here.reader().fetches());
    assert_eq!(remote.tensors(), here.tensors());
    for t in here.tensors() {
        assert!(
            remote.read_tensor(&t.key).unwrap() == here.read_tensor(&t.key).unwrap(),
            "tensor `{}` differs",
            t.key
        );
        // An inner box, off every chunk boundary where the tensor allows it.
        if t.shape.iter().all(|&d| d >= 3) {
            let off: Vec<u64> = t.shape.iter().map(|d| d / 3).collect();
            let ext: Vec<u64> = t.shape.iter().map(|d| d / 2).collect();
            let r = Region::new(off, ext).unwrap();
            let n = r.num_elements().unwrap() as usize * t.dtype.size();
            let (mut a, mut b) = (vec![0u8; n], vec![1u8; n]);
            remote.read_region(&t.key, &r, &mut a).unwrap();
            here.read_region(&t.key, &r, &mut b).unwrap();
            assert!(a == b, "region of `{}` differs", t.key);
        }
    }
    // A reshard load: 3 ranks, each a third of the rows of every 2-d tensor.
    let infos = here.tensors();
    let got = run_local(3, Duration::from_secs(60), |comm| {
        let mut bufs: Vec<(usize, Region, Vec<u8>)> = infos
            .iter()
            .enumerate()
            .filter(|(_, t)| t.shape.len() == 2)
            .map(|(i, t)| {
                let rows = common::chunk_split(t.shape[0], 3)[comm.rank()];
                let r = Region::new(vec![rows.0, 0], vec![rows.1, t.shape[1]]).unwrap();
                let n = r.num_elements().unwrap() as usize * t.dtype.size();
                (i, r, vec![0u8; n])
            })
            .collect();
        let mut targets: Vec<LoadTarget<'_>> = bufs
            .iter_mut()
            .map(|(i, r, b)| {
                let t = &infos[*i];
                LoadTarget::new(t.key.clone(), t.dtype, t.shape.clone(), r.clone(), b).unwrap()
            })
            .collect();
        let opts = LoadOptions {
            strict: zarrckpt::StrictMode::LogAll,
            ..LoadOptions::default()
        };
        match ropts {
            Some(o) => {
                let reader = Reader::open_url(url, o)?;
                zarrckpt::load::load_with_reader(&mut targets, None, &reader, &comm, &opts)?
            }
            None => zarrckpt::load(&mut targets, Path::new(url), &comm, &opts)?,
        };
        drop(targets);
        Ok::<_, Error>(bufs)
    });
    for rank in got {
        for (i, r, b) in rank.unwrap() {
            let t = &infos[i];
            let mut want = vec![0u8; b.len()];
            here.read_region(&t.key, &r, &mut want).unwrap();
            assert!(b == want, "reshard load of `{}` {r:?} differs", t.key);
        }
    }
    let v = remote.verify(2, None).unwrap();
    assert!(v.problems.is_empty() && v.chunks > 0, "{:?}", v.problems);
    assert_eq!(v.chunks, here.verify(2, None).unwrap().chunks);
}

#[test]
fn memory_reads_are_bit_identical_to_local() {
    let url = "memory://s3-read-identical/ckpt";
    let local = save_both(url, &RemoteOptions::default(), 2, 3);
    reads_match_local(url, None, &local.path().join("ckpt"));
    state::check(&local.path().join("ckpt"), 3);
}

#[test]
fn s3_reads_are_bit_identical_to_local() {
    if s3::skipped("s3_reads_are_bit_identical_to_local") {
        return;
    }
    let ropts = s3::options();
    let url = format!("s3://{}/read-identical", s3::BUCKET);
    let local = save_both(&url, &ropts, 2, 5);
    reads_match_local(&url, Some(&ropts), &local.path().join("ckpt"));
    damaged_objects_give_typed_errors(&url, &ropts);
}

/// The generation's object holding the first shard of `key`, as (store, key in the store).
fn first_shard(url: &str, ropts: &RemoteOptions, key: &str) -> (RemoteStore, String, u64) {
    let store = RemoteStore::open(url, ropts).unwrap();
    let resolved = remote::resolve(&store).unwrap();
    let e = resolved
        .manifest
        .objects
        .iter()
        .find(|e| e.key.starts_with(&format!("tensors/{key}/c")))
        .unwrap_or_else(|| panic!("no shard of {key} in {:?}", resolved.manifest.objects));
    let k = format!("generations/{}/{}", resolved.generation, e.key);
    (store, k, e.size)
}

/// A flipped byte: the checksum error naming tensor, chunk, subchunk and object; a truncated
/// object: a corrupt-chunk error giving both sizes; a deleted one: a missing chunk.
fn damaged_objects_give_typed_errors(url: &str, ropts: &RemoteOptions) {
    let key = TensorKey::new("model.rows.weight").unwrap();
    let (store, k, size) = first_shard(url, ropts, key.as_str());
    let (good, _) = store.get(&k).unwrap().unwrap();
    let mut bad = good.to_vec();
    bad[0] ^= 0x40;
    store.put(&k, bad.into(), &remote::Condition::None).unwrap();
    let err = Checkpoint::open_url(url, ropts)
        .unwrap()
        .read_tensor(&key)
        .unwrap_err();
    match &err {
        Error::Storage(StorageError::Checksum {
            key: k2,
            chunk,
            path,
            ..
        }) => {
            assert_eq!(k2, key.as_str());
            assert!(!chunk.is_empty());
            assert!(
                path.to_string_lossy()
                    .starts_with(url.split('/').next().unwrap()),
                "{path:?}"
            );
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(key.as_str()) && msg.contains("c"), "{msg}");
    let v = Checkpoint::open_url(url, ropts)
        .unwrap()
        .verify(1, None)
        .unwrap();
    assert_eq!(v.problems.len(), 1, "{:?}", v.problems);
    assert_eq!(v.problems[0].key, key);
    // A 0-d tensor's one chunk is checked too.
    let step = TensorKey::new("optimizer.step").unwrap();
    let (_, sk, _) = first_shard(url, ropts, step.as_str());
    let (sgood, _) = store.get(&sk).unwrap().unwrap();
    let mut sbad = sgood.to_vec();
    sbad[0] ^= 0x01;
    store
        .put(&sk, sbad.into(), &remote::Condition::None)
        .unwrap();
    let v = Checkpoint::open_url(url, ropts)
        .unwrap()
        .verify(1, None)
        .unwrap();
    assert_eq!(v.problems.len(), 2, "{:?}", v.problems);
    assert!(v.problems.iter().any(|p| p.key == step), "{:?}", v.problems);
    store.put(&sk, sgood, &remote::Condition::None).unwrap();

    store
        .put(
            &k,
            good.slice(..crate_usize(size / 2)),
            &remote::Condition::None,
        )
        .unwrap();
    let err = Checkpoint::open_url(url, ropts)
        .unwrap()
        .read_tensor(&key)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Storage(StorageError::CorruptChunk { key: k2, detail, .. })
            if k2 == key.as_str() && detail.contains("manifest")),
        "{err:?}"
    );
    store.delete(&k).unwrap();
    let err = Checkpoint::open_url(url, ropts)
        .unwrap()
        .read_tensor(&key)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Storage(StorageError::MissingChunk { key: k2, .. }) if k2 == key.as_str()),
        "{err:?}"
    );
    store.put(&k, good, &remote::Condition::None).unwrap();
    Checkpoint::open_url(url, ropts)
        .unwrap()
        .read_tensor(&key)
        .unwrap();
}

fn crate_usize(n: u64) -> usize {
    usize::try_from(n).unwrap()
}

#[test]
fn memory_damaged_objects_give_typed_errors() {
    let url = "memory://s3-read-damaged/ckpt";
    let _local = save_both(url, &RemoteOptions::default(), 2, 4);
    damaged_objects_give_typed_errors(url, &RemoteOptions::default());
}

/// Saves one 2-d float32 tensor of `rows` x `cols` split by rows over `world` ranks to `url`.
fn save_rows(url: &str, rows: u64, cols: u64, world: usize) -> Vec<u8> {
    let shape = vec![rows, cols];
    let full = tensor_bytes(7, &shape, DType::Float32);
    let staging = tempfile::tempdir().unwrap();
    let target = SaveTarget {
        overwrite: false,
        staging_root: Some(staging.path().to_path_buf()),
    };
    let key = TensorKey::new("w").unwrap();
    for r in run_local(world, Duration::from_secs(60), |comm| {
        let (o, n) = common::chunk_split(rows, world as u64)[comm.rank()];
        let region = Region::new(vec![o, 0], vec![n, cols]).unwrap();
        let bytes = cut(&full, &shape, &region, 4);
        let piece = ShardedTensor::new(
            key.clone(),
            DType::Float32,
            shape.clone(),
            region,
            0,
            &bytes,
        )
        .unwrap();
        remote::save_to_url(url, &comm, &RemoteOptions::default(), &target, |d| {
            save(&[piece], d, &comm, &SaveOptions::default())
        })
    }) {
        r.unwrap();
    }
    full
}

/// Loads rows of `w` on `world` ranks (`parts` distinct row blocks; ranks beyond them load
/// the same blocks again: data-parallel replicas); returns (bytes fetched, bytes needed).
fn load_rows(
    url: &str,
    full: &[u8],
    rows: u64,
    cols: u64,
    world: usize,
    parts: usize,
) -> (u64, u64) {
    let shape = vec![rows, cols];
    let key = TensorKey::new("w").unwrap();
    let reports = run_local(world, Duration::from_secs(60), |comm| {
        let (o, n) = common::chunk_split(rows, parts as u64)[comm.rank() % parts];
        let region = Region::new(vec![o, 0], vec![n, cols]).unwrap();
        let mut buf = vec![0u8; crate_usize(n * cols * 4)];
        let mut t = [LoadTarget::new(
            key.clone(),
            DType::Float32,
            shape.clone(),
            region.clone(),
            &mut buf,
        )
        .unwrap()];
        let rep = zarrckpt::load(&mut t, Path::new(url), &comm, &LoadOptions::default())?;
        assert!(
            buf == cut(full, &shape, &region, 4),
            "rank {} got other bytes",
            comm.rank()
        );
        Ok::<_, Error>(rep)
    });
    let (mut fetched, mut needed) = (0, 0);
    for r in reports {
        let r = r.unwrap();
        fetched += r.bytes_read;
        needed += r.loaded_bytes - r.bytes_received;
    }
    (fetched, needed)
}

#[test]
fn reshard_loads_fetch_each_byte_about_once() {
    let url = "memory://s3-read-amplification/ckpt";
    let (rows, cols) = (1024u64, 512u64);
    let full = save_rows(url, rows, cols, 2);
    // Saved as 2 row blocks; loaded as 4 (each half a shard), 8, and as 2 blocks on 4 ranks
    // (each block wanted by two data-parallel replicas: fetched once, then exchanged).
    for (world, parts) in [(4usize, 4usize), (8, 8), (4, 2)] {
        let (fetched, needed) = load_rows(url, &full, rows, cols, world, parts);
        let amp = fetched as f64 / needed as f64;
        println!(
            "reshard load 2 -> {parts} row blocks on {world} ranks: fetched {fetched} bytes for {needed} needed: amplification {amp:.4}"
        );
        assert_eq!(
            needed,
            rows * cols * 4,
            "each byte read once per replica group"
        );
        assert!(amp <= 1.05, "amplification {amp:.4} above 1.05");
    }
}

#[test]
fn a_reader_decodes_each_shard_index_once() {
    let url = "memory://s3-read-index-cache/ckpt";
    let (rows, cols) = (256u64, 128u64);
    let full = save_rows(url, rows, cols, 2);
    let ck = Checkpoint::open(url).unwrap();
    let key = TensorKey::new("w").unwrap();
    let shape = [rows, cols];
    // 16 boxes of 8 rows, all in the first shard (rows 0..128).
    for i in 0..16u64 {
        let r = Region::new(vec![i * 8, 0], vec![8, cols]).unwrap();
        let mut buf = vec![0u8; crate_usize(8 * cols * 4)];
        ck.read_region(&key, &r, &mut buf).unwrap();
        assert!(buf == cut(&full, &shape, &r, 4));
    }
    assert_eq!(ck.reader().indexes_decoded(), 1);
    let r = Region::new(vec![120, 0], vec![16, cols]).unwrap();
    let mut buf = vec![0u8; crate_usize(16 * cols * 4)];
    ck.read_region(&key, &r, &mut buf).unwrap();
    assert_eq!(
        ck.reader().indexes_decoded(),
        2,
        "the second shard's index, once"
    );
    assert_eq!(ck.reader().arrays_opened(), 1);
}

#[test]
fn a_shards_end_or_a_whole_shard_costs_one_ranged_get() {
    let url = "memory://s3-read-suffix/ckpt";
    let (rows, cols) = (256u64, 512u64); // subchunks of 32 rows
    let full = save_rows(url, rows, cols, 2);
    let key = TensorKey::new("w").unwrap();
    let shape = [rows, cols];
    // (rows, ranged gets a fresh reader makes): the end of shard 0, the whole of shard 1, the
    // start of shard 0 (index, then data), and a box across both (the end of shard 0 in one,
    // the start of shard 1 in two).
    for ((at, n), gets) in [((64, 64), 1), ((128, 128), 1), ((0, 64), 2), ((96, 64), 3)] {
        let ck = Checkpoint::open(url).unwrap();
        let r = Region::new(vec![at, 0], vec![n, cols]).unwrap();
        let mut buf = vec![0u8; crate_usize(n * cols * 4)];
        ck.read_region(&key, &r, &mut buf).unwrap();
        assert!(buf == cut(&full, &shape, &r, 4), "rows {at}..{}", at + n);
        assert_eq!(ck.reader().ranged_gets(), gets, "rows {at}..{}", at + n);
    }
}

/// Saves `full`, the float32 tensor `w` of `shape`, whole from one rank to `url`.
fn save_whole(url: &str, shape: &[u64], full: &[u8], opts: &SaveOptions) {
    let key = TensorKey::new("w").unwrap();
    for r in run_local(1, Duration::from_secs(60), |comm| {
        let region = Region::new(vec![0; shape.len()], shape.to_vec()).unwrap();
        let piece =
            ShardedTensor::new(key.clone(), DType::Float32, shape.to_vec(), region, 0, full)
                .unwrap();
        save(&[piece], Path::new(url), &comm, opts)
    }) {
        r.unwrap();
    }
}

#[test]
fn a_column_band_at_a_shards_end_fetches_only_its_subchunks() {
    // Rows of 2 MiB cut into 32 subchunks of 64 KiB: the last column block of every row is the
    // end of the shard in C order but 31 subchunks (about 2 MiB) apart, so fetching from the
    // first of them to the end would read the whole shard for an eighth of a MiB a row.
    let url = "memory://s3-read-band/ckpt";
    let (rows, cols) = (8u64, 524_288u64);
    let shape = vec![rows, cols];
    let full = tensor_bytes(11, &shape, DType::Float32);
    let key = TensorKey::new("w").unwrap();
    let opts = SaveOptions {
        grid: zarrckpt::GridOptions {
            subchunk_target_bytes: 64 << 10,
            ..zarrckpt::GridOptions::default()
        },
        ..SaveOptions::default()
    };
    save_whole(url, &shape, &full, &opts);
    let ck = Checkpoint::open(url).unwrap();
    assert_eq!(ck.tensor(&key).unwrap().subchunk_shape, vec![1, 16_384]);
    let band = Region::new(vec![0, cols - 16_384], vec![rows, 16_384]).unwrap();
    let mut buf = vec![0u8; crate_usize(rows * 16_384 * 4)];
    let report = ck.read_region(&key, &band, &mut buf).unwrap();
    assert!(buf == cut(&full, &shape, &band, 4));
    let needed = buf.len() as u64;
    assert!(
        report.bytes_read < needed + (64 << 10),
        "read {} bytes for {needed}",
        report.bytes_read
    );
    assert_eq!(
        ck.reader().ranged_gets(),
        2,
        "the tail, then the band's subchunks"
    );
}

#[test]
fn shards_with_absent_subchunks_read_back_whole() {
    // Zero rows leave subchunks absent, so the object is shorter than every subchunk and a
    // guess at offsets from the end would be wrong: the read must not guess.
    let url = "memory://s3-read-absent/ckpt";
    let (rows, cols) = (256u64, 512u64); // subchunks of 32 rows
    let shape = vec![rows, cols];
    let mut full = tensor_bytes(9, &shape, DType::Float32);
    full[..crate_usize(32 * cols * 4)].fill(0);
    let key = TensorKey::new("w").unwrap();
    save_whole(url, &shape, &full, &SaveOptions::default());
    for (at, n) in [(0u64, 256u64), (100, 156), (16, 32)] {
        let ck = Checkpoint::open(url).unwrap();
        let r = Region::new(vec![at, 0], vec![n, cols]).unwrap();
        let mut buf = vec![1u8; crate_usize(n * cols * 4)];
        ck.read_region(&key, &r, &mut buf).unwrap();
        assert!(buf == cut(&full, &shape, &r, 4), "rows {at}..{}", at + n);
    }
}

#[test]
fn ranks_that_resolved_different_generations_refuse_to_load() {
    let url = "memory://s3-read-generations/ckpt";
    let _local = save_both(url, &RemoteOptions::default(), 2, 1);
    let old = Reader::open(url).unwrap();
    let staging = tempfile::tempdir().unwrap();
    let target = SaveTarget {
        overwrite: true,
        staging_root: Some(staging.path().to_path_buf()),
    };
    for r in run_local(2, Duration::from_secs(60), |comm| {
        let st = RankState::new(2, comm.rank() as u64, 2);
        remote::save_to_url(url, &comm, &RemoteOptions::default(), &target, |d| {
            save(&st.sharded(), d, &comm, &SaveOptions::default())
        })
    }) {
        r.unwrap();
    }
    let new = Reader::open(url).unwrap();
    assert_ne!(old.dir(), new.dir(), "the overwrite made a new generation");
    let readers = [old, new];
    let spec = &state::specs()[0];
    let key = TensorKey::new(spec.key).unwrap();
    for r in run_local(2, Duration::from_secs(60), |comm| {
        let region = Region::full(&spec.shape);
        let mut buf = vec![0u8; region.num_elements().unwrap() as usize * spec.dtype.size()];
        let mut t = [LoadTarget::new(
            key.clone(),
            spec.dtype,
            spec.shape.clone(),
            region,
            &mut buf,
        )
        .unwrap()];
        zarrckpt::load::load_with_reader(
            &mut t,
            None,
            &readers[comm.rank()],
            &comm,
            &LoadOptions::default(),
        )
    }) {
        let err = r.unwrap_err();
        assert!(err.to_string().contains("load again"), "{err}");
    }
    // Both readers still read their own generation whole.
    assert!(
        Checkpoint::with_reader(readers.into_iter().next().unwrap())
            .read_tensor(&key)
            .unwrap()
            == state::full(0, 1)
    );
}

#[test]
fn a_local_store_keeps_the_file_paths() {
    let url = "memory://s3-read-local-store/ckpt";
    let local = save_both(url, &RemoteOptions::default(), 2, 6);
    let store = std::sync::Arc::new(zarrckpt::storage::store::LocalStore::new(local.path()));
    let ck = Checkpoint::open_store(store, "ckpt").unwrap();
    assert!(
        !ck.reader().fetches(),
        "a store with local files reads the files"
    );
    let remote = Checkpoint::open(url).unwrap();
    for t in ck.tensors() {
        assert!(ck.read_tensor(&t.key).unwrap() == remote.read_tensor(&t.key).unwrap());
    }
    assert_eq!(ck.reader().indexes_decoded(), 0);
    assert!(remote.reader().indexes_decoded() > 0);
}

#[test]
fn a_converting_read_goes_through_the_same_fetch() {
    let url = "memory://s3-read-cast/ckpt";
    let (rows, cols) = (96u64, 64u64);
    let full = save_rows(url, rows, cols, 2);
    let fetched = remote::fetch_url(url, &RemoteOptions::default(), None).unwrap();
    let region = Region::new(vec![10, 3], vec![70, 50]).unwrap();
    let n = region.num_elements().unwrap() as usize;
    let read = |reader: &Reader| {
        let mut got = vec![zarrckpt::half::bf16::ZERO; n];
        let t = LoadTarget::from_slice("w", &[rows, cols], &[10, 3], &mut got, &[70, 50])
            .unwrap()
            .with_cast(zarrckpt::Cast::FloatConvert);
        reader.read(&mut [t]).unwrap();
        got.iter().map(|v| v.to_bits()).collect::<Vec<u16>>()
    };
    let remote = Reader::open(url).unwrap();
    assert!(remote.fetches());
    let got = read(&remote);
    assert!(
        got == read(&Reader::open(fetched.dir()).unwrap()),
        "differs from the local read"
    );
    // And the conversion is the one asked for (finite values: round to nearest even).
    let stored = cut(&full, &[rows, cols], &region, 4);
    let mut checked = 0;
    for (b, g) in stored.chunks_exact(4).zip(&got) {
        let f = f32::from_le_bytes(b.try_into().unwrap());
        if f.is_finite() {
            assert_eq!(zarrckpt::half::bf16::from_f32(f).to_bits(), *g, "{f}");
            checked += 1;
        }
    }
    assert!(checked > n / 2, "only {checked} finite values of {n}");
}

/// The tensors of [`save_six`]: `t0` to `t5`.
const SIX: usize = 6;

fn six_key(i: usize) -> TensorKey {
    TensorKey::new(format!("t{i}")).unwrap()
}

/// Saves six float32 tensors `t0` to `t5`, each 512 x 1024 and split by rows over 2 ranks (a
/// shard of 256 x 1024 per rank and tensor, subchunks of 16 rows), to `url`: straight to the
/// store (each rank writes its shards and a tails object, spec 20.7), or `staged` through a
/// local directory and an upload (no tails objects). Returns the tensors' bytes.
fn save_six(url: &str, ropts: &RemoteOptions, staged: bool) -> Vec<Vec<u8>> {
    let shape = vec![512u64, 1024];
    let fulls: Vec<Vec<u8>> = (0..SIX as u64)
        .map(|i| tensor_bytes(20 + i, &shape, DType::Float32))
        .collect();
    let staging = tempfile::tempdir().unwrap();
    for r in run_local(2, Duration::from_secs(60), |comm| {
        let region = common::piece(&shape, 0, 2, comm.rank() as u64);
        let bytes: Vec<Vec<u8>> = fulls.iter().map(|f| cut(f, &shape, &region, 4)).collect();
        let pieces: Vec<ShardedTensor<'_>> = bytes
            .iter()
            .enumerate()
            .map(|(i, b)| {
                ShardedTensor::new(
                    six_key(i),
                    DType::Float32,
                    shape.clone(),
                    region.clone(),
                    0,
                    b,
                )
                .unwrap()
            })
            .collect();
        if staged {
            let target = SaveTarget {
                overwrite: false,
                staging_root: Some(staging.path().to_path_buf()),
            };
            remote::save_to_url(url, &comm, ropts, &target, |d| {
                save(&pieces, d, &comm, &SaveOptions::default())
            })
            .map(|_| ())
        } else {
            let opts = SaveOptions {
                remote: ropts.clone(),
                ..SaveOptions::default()
            };
            save(&pieces, Path::new(url), &comm, &opts).map(|_| ())
        }
    }) {
        r.unwrap();
    }
    fulls
}

/// One rank loads, in one load through `reader`, 16 rows from the middle of one shard of each
/// of the six tensors (`t<i>`: rows 32.. of shard `i % 2`, the third of its 16 subchunks), and
/// checks them against `fulls`.
fn load_six_middles(reader: &Reader, fulls: &[Vec<u8>]) {
    let shape = [512u64, 1024];
    let region =
        |i: usize| Region::new(vec![32 + 256 * (i as u64 % 2), 0], vec![16, 1024]).unwrap();
    let mut got = run_local(1, Duration::from_secs(60), |comm| {
        let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 16 * 1024 * 4]; SIX];
        let mut targets: Vec<LoadTarget<'_>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                LoadTarget::new(six_key(i), DType::Float32, shape.to_vec(), region(i), b).unwrap()
            })
            .collect();
        zarrckpt::load::load_with_reader(
            &mut targets,
            None,
            reader,
            &comm,
            &LoadOptions::default(),
        )?;
        drop(targets);
        Ok::<_, Error>(bufs)
    });
    let bufs = got.pop().unwrap().unwrap();
    for (i, (b, f)) in bufs.iter().zip(fulls).enumerate() {
        assert!(*b == cut(f, &shape, &region(i), 4), "t{i} differs");
    }
}

#[test]
fn tail_copies_spare_a_get_per_shard_and_a_damaged_copy_only_costs_requests() {
    let url = "memory://s3-read-tails/ckpt";
    let fulls = save_six(url, &RemoteOptions::default(), false);
    let reader = Reader::open(url).unwrap();
    assert_eq!(
        reader.meta().tensors[&six_key(0)].subchunk_shape,
        vec![16, 1024]
    );
    load_six_middles(&reader, &fulls);
    assert_eq!(
        reader.ranged_gets(),
        2 + 6,
        "one get of each writer's tail copies, then one per shard"
    );
    // Saved without tails objects (the staged path): the tail of every shard, then its data.
    let staged = "memory://s3-read-tails/staged";
    let staged_fulls = save_six(staged, &RemoteOptions::default(), true);
    let reader = Reader::open(staged).unwrap();
    load_six_middles(&reader, &staged_fulls);
    assert_eq!(reader.ranged_gets(), 2 * 6);
    // A damaged tails object (rank 0's, zeroed; the manifest unchanged): its copies fail their
    // checks and those shards' own tails are read instead; the bytes are the same.
    let store = RemoteStore::open(url, &RemoteOptions::default()).unwrap();
    let resolved = remote::resolve(&store).unwrap();
    let objects = &resolved.manifest.objects;
    let tails = objects
        .iter()
        .find(|e| e.key == "tails/0")
        .unwrap_or_else(|| panic!("no tails/0 in {objects:?}"));
    let copies = |k: &str| {
        objects
            .iter()
            .filter(|e| e.tail.as_ref().is_some_and(|t| t.key == k))
            .count()
    };
    assert_eq!((copies("tails/0"), copies("tails/1")), (SIX, SIX));
    let k = format!("generations/{}/tails/0", resolved.generation);
    let zeros = vec![0u8; crate_usize(tails.size)];
    store
        .put(&k, zeros.into(), &remote::Condition::None)
        .unwrap();
    let reader = Reader::open(url).unwrap();
    load_six_middles(&reader, &fulls);
    assert_eq!(reader.ranged_gets(), 2 + 3 * 2 + 3);
}

/// [`save_six`] on SeaweedFS at `s3://<bucket>/<name>`, and a counting proxy in front of the
/// server with the options that reach it: (URL, the tensors' bytes, proxy, options).
fn six_behind_a_counter(name: &str) -> (String, Vec<Vec<u8>>, proxy::Proxy, RemoteOptions) {
    let url = s3::url(name);
    let fulls = save_six(&url, &s3::options(), false);
    let counter = proxy::Proxy::start(s3::shared().port, Vec::new(), Duration::from_secs(300));
    let via = s3::options_for(&format!("http://127.0.0.1:{}", counter.port));
    (url, fulls, counter, via)
}

#[test]
fn s3_a_load_asks_for_the_pointer_manifest_index_tails_and_data_only() {
    if s3::skipped("s3_a_load_asks_for_the_pointer_manifest_index_tails_and_data_only") {
        return;
    }
    let (url, fulls, counter, via) = six_behind_a_counter("read-requests");
    let reader = Reader::open_url(&url, &via).unwrap();
    load_six_middles(&reader, &fulls);
    let seen = counter.seen();
    // The pointer, the manifest, the root zarr.json; both tails objects; one ranged get per
    // shard. No HEAD (sizes come from the manifest), and no array zarr.json (the manifest
    // lists each with the size and crc32c of the document its index entry prescribes).
    assert!(seen.iter().all(|r| r.starts_with("GET ")), "{seen:#?}");
    assert!(
        !seen
            .iter()
            .any(|r| r.contains("/tensors/") && r.ends_with("/zarr.json")),
        "{seen:#?}"
    );
    assert_eq!(
        seen.iter().filter(|r| r.contains("/tails/")).count(),
        2,
        "{seen:#?}"
    );
    assert_eq!(seen.len(), 3 + 2 + 6, "{seen:#?}");
}

#[test]
fn a_root_document_that_is_not_the_committed_one_is_refused() {
    let url = "memory://s3-read-root/ckpt";
    save_six(url, &RemoteOptions::default(), false);
    let store = RemoteStore::open(url, &RemoteOptions::default()).unwrap();
    let resolved = remote::resolve(&store).unwrap();
    let k = format!("generations/{}/zarr.json", resolved.generation);
    let (good, _) = store.get(&k).unwrap().unwrap();
    // Valid JSON, same size, one space moved: still a checkpoint index, but not the bytes the
    // manifest committed.
    let text = String::from_utf8(good.to_vec()).unwrap();
    let at = text.find(": ").unwrap();
    let changed = format!("{} :{}", &text[..at], &text[at + 2..]);
    assert_eq!(changed.len(), text.len());
    store
        .put(&k, changed.into_bytes().into(), &remote::Condition::None)
        .unwrap();
    let err = Reader::open(url).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, Error::Storage(StorageError::Malformed { path, .. })
            if path.to_string_lossy().ends_with("zarr.json")),
        "{err:?}"
    );
    assert!(msg.contains("not the committed one"), "{msg}");
    store.put(&k, good, &remote::Condition::None).unwrap();
    Reader::open(url).unwrap();
}

#[test]
fn s3_ranks_opening_together_ask_for_pointer_manifest_and_index_once() {
    if s3::skipped("s3_ranks_opening_together_ask_for_pointer_manifest_and_index_once") {
        return;
    }
    let (url, fulls, counter, via) = six_behind_a_counter("read-open-shared");
    let dirs = run_local(4, Duration::from_secs(60), |comm| {
        let r = Reader::open_url_shared(&url, &via, &comm)?;
        Ok::<_, Error>((r.dir().to_path_buf(), r.meta().tensors.len()))
    });
    let dirs: Vec<_> = dirs.into_iter().map(Result::unwrap).collect();
    assert!(dirs.iter().all(|d| *d == dirs[0]), "{dirs:?}");
    assert_eq!(dirs[0].1, SIX);
    let seen = counter.seen();
    assert_eq!(
        seen.len(),
        3,
        "rank 0 alone: pointer, manifest, root: {seen:#?}"
    );
    // The readers the others built from rank 0's broadcast read as rank 0's does.
    counter.reset_counters();
    let reader = run_local(2, Duration::from_secs(60), |comm| {
        Reader::open_url_shared(&url, &via, &comm)
    })
    .pop()
    .unwrap()
    .unwrap();
    load_six_middles(&reader, &fulls);
    // Nothing committed at the URL: every rank gets rank 0's error.
    let none = s3::url("read-open-shared-none");
    for r in run_local(3, Duration::from_secs(60), |comm| {
        Reader::open_url_shared(&none, &via, &comm).map(|_| ())
    }) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("rank 0") || e.contains("pointer"), "{e}");
    }
}

/// Loads `region` of the tensor `w` of `shape` (float32) from `reader` on one rank.
fn load_box(reader: &Reader, shape: &[u64], region: &Region) -> Vec<u8> {
    let mut got = run_local(1, Duration::from_secs(120), |comm| {
        let mut buf = vec![0u8; crate_usize(region.num_elements().unwrap() * 4)];
        let mut t = [LoadTarget::new(
            TensorKey::new("w").unwrap(),
            DType::Float32,
            shape.to_vec(),
            region.clone(),
            &mut buf,
        )
        .unwrap()];
        zarrckpt::load::load_with_reader(&mut t, None, reader, &comm, &LoadOptions::default())?;
        Ok::<_, Error>(buf)
    });
    got.pop().unwrap().unwrap()
}

#[test]
fn shards_larger_than_one_range_read_back_whole_and_in_part() {
    // One rank saves a 24 MiB tensor: one shard object, three times GET_RANGE_BYTES. A whole
    // read fetches it from its first subchunk to its end in ranges cut on subchunk
    // boundaries; a read of inner rows fetches coalesced ranges within the limit; both are
    // the saved bytes.
    let url = "memory://s3-read-large/ckpt";
    let shape = vec![6144u64, 1024];
    let full = tensor_bytes(7, &shape, DType::Float32);
    let whole = Region::new(vec![0, 0], shape.clone()).unwrap();
    for r in run_local(1, Duration::from_secs(120), |comm| {
        let p = ShardedTensor::new(
            TensorKey::new("w").unwrap(),
            DType::Float32,
            shape.clone(),
            whole.clone(),
            0,
            &full,
        )
        .unwrap();
        let opts = SaveOptions::default();
        save(&[p], Path::new(url), &comm, &opts).map(|_| ())
    }) {
        r.unwrap();
    }
    let reader = Reader::open(url).unwrap();
    let entry = &reader.meta().tensors[&TensorKey::new("w").unwrap()];
    assert_eq!(entry.chunk_shape, shape, "one shard");
    assert!(
        load_box(&reader, &shape, &whole) == full,
        "whole tensor differs"
    );
    for (rows, n) in [(5u64, 6000u64), (1000, 3000), (4000, 2144)] {
        let r = Region::new(vec![rows, 0], vec![n, 1024]).unwrap();
        let reader = Reader::open(url).unwrap();
        assert!(
            load_box(&reader, &shape, &r) == cut(&full, &shape, &r, 4),
            "rows {rows}..{} differ",
            rows + n
        );
    }
}
