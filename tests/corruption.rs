//! Damaged shard files after a real save: flipped bytes, truncation, deletion, garbage,
//! crafted indexes. `load` must return the typed error naming the tensor, chunk and file,
//! `Checkpoint::verify` must collect every problem, and nothing may panic or return wrong data.
//! Also replays the fuzz seeds and crash regressions under `fuzz/` as ordinary tests.
//!
//! Shard layout (uncompressed, zarrckpt-written): the subchunks in C order, each its raw
//! little-endian bytes followed by their crc32c; then the index: one little-endian
//! `(offset, nbytes)` u64 pair per subchunk (`u64::MAX` twice for an absent one) followed by
//! the crc32c of those pairs.

#[path = "../fuzz/src/lib.rs"]
mod fuzz_checks;

use std::path::{Path, PathBuf};

use fuzz_checks::{assert_names_file, copy_dir, cut};
use proptest::prelude::*;
use zarrckpt::storage::StorageError;
use zarrckpt::{
    Checkpoint, Compression, DType, Error, LoadOptions, LoadTarget, LocalComm, ReadMethod, Region,
    SaveOptions, ShardedTensor, TensorKey, load, save,
};

// ---------------------------------------------------------------------------------------------
// Fixture: `w` f32 [8, 6] in two shards of two subchunks, `e` u16 [5, 7] in one shard of five
// subchunks, `s` an i64 scalar. Saved once per compression, copied per test.
// ---------------------------------------------------------------------------------------------

struct Spec {
    key: &'static str,
    dtype: DType,
    shape: &'static [u64],
    /// Pieces (offset, shape), all main, all on the one saving rank.
    pieces: &'static [(&'static [u64], &'static [u64])],
}

const SPECS: [Spec; 3] = [
    Spec {
        key: "w",
        dtype: DType::Float32,
        shape: &[8, 6],
        pieces: &[(&[0, 0], &[4, 6]), (&[4, 0], &[4, 6])],
    },
    Spec {
        key: "e",
        dtype: DType::UInt16,
        shape: &[5, 7],
        pieces: &[(&[0, 0], &[5, 7])],
    },
    Spec {
        key: "s",
        dtype: DType::Int64,
        shape: &[],
        pieces: &[(&[], &[])],
    },
];

fn full(spec: &Spec) -> Vec<u8> {
    let n: u64 = spec.shape.iter().product();
    let mut x = spec.key.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |a, b| {
        a.rotate_left(5) ^ u64::from(b)
    }) | 1;
    (0..n * spec.dtype.size() as u64)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn save_fixture(dir: &Path, compression: Compression) {
    let fulls: Vec<Vec<u8>> = SPECS.iter().map(full).collect();
    let mut datas = Vec::new();
    for (spec, f) in SPECS.iter().zip(&fulls) {
        for (o, s) in spec.pieces {
            let region = Region::new(o.to_vec(), s.to_vec()).unwrap();
            datas.push((
                spec,
                region.clone(),
                cut(f, spec.shape, &region, spec.dtype.size()),
            ));
        }
    }
    let pieces: Vec<ShardedTensor> = datas
        .iter()
        .map(|(spec, region, d)| {
            ShardedTensor::new(
                TensorKey::new(spec.key).unwrap(),
                spec.dtype,
                spec.shape.to_vec(),
                region.clone(),
                0,
                d,
            )
            .unwrap()
        })
        .collect();
    let mut opts = SaveOptions {
        compression,
        io_threads: 1,
        ..Default::default()
    };
    opts.grid.subchunk_target_bytes = 48;
    opts.grid.min_chunk_bytes = 0;
    save(&pieces, dir, &LocalComm::single(), &opts).unwrap();
}

/// A fresh checkpoint for `compression`, in a temporary folder of its own (saved for each
/// test: a fixture kept in a static would never be removed, statics are not dropped).
fn fixture(compression: Compression) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_fixture(&dir, compression);
    (tmp, dir)
}

const BOTH: [Compression; 2] = [Compression::None, Compression::Zstd];

/// Runs `f` with each read method; both must give the same outcome (the same bytes, or
/// the same error), which is returned.
fn both_methods<T: PartialEq + std::fmt::Debug>(
    f: impl Fn(ReadMethod) -> Result<T, Error>,
) -> Result<T, Error> {
    let mapped = f(ReadMethod::Mmap);
    let pread = f(ReadMethod::Pread);
    match (&mapped, &pread) {
        (Ok(a), Ok(b)) => assert!(a == b, "mmap and pread loads differ"),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "mmap vs pread error"),
        _ => panic!("mmap gave {mapped:?}, pread gave {pread:?}"),
    }
    mapped
}

fn opts(read_method: ReadMethod) -> LoadOptions {
    LoadOptions {
        io_threads: 1,
        read_method,
        ..Default::default()
    }
}

/// Loads `region` of tensor `key` on one rank, by both read methods.
fn load_box(
    dir: &Path,
    key: &str,
    dtype: DType,
    shape: &[u64],
    region: &Region,
) -> Result<Vec<u8>, Error> {
    let n: u64 = region.shape().iter().product();
    both_methods(|method| {
        let mut buf = vec![0u8; n as usize * dtype.size()];
        let mut t = [LoadTarget::new(
            TensorKey::new(key).unwrap(),
            dtype,
            shape.to_vec(),
            region.clone(),
            &mut buf,
        )
        .unwrap()];
        load(&mut t, dir, &LocalComm::single(), &opts(method))?;
        Ok(buf)
    })
}

/// Loads `region` of tensor `key` (of `SPECS`) on one rank, by both read methods.
fn load_region(dir: &Path, key: &str, region: &Region) -> Result<Vec<u8>, Error> {
    let spec = SPECS.iter().find(|s| s.key == key).unwrap();
    load_box(dir, key, spec.dtype, spec.shape, region)
}

fn load_whole(dir: &Path, key: &str) -> Result<Vec<u8>, Error> {
    let spec = SPECS.iter().find(|s| s.key == key).unwrap();
    load_region(dir, key, &Region::full(spec.shape))
}

/// Loads every tensor in one call (by both read methods); returns their bytes in `SPECS`
/// order.
fn load_all(dir: &Path) -> Result<Vec<Vec<u8>>, Error> {
    both_methods(|method| {
        let mut bufs: Vec<Vec<u8>> = SPECS.iter().map(|s| vec![0u8; full(s).len()]).collect();
        let mut t: Vec<LoadTarget> = SPECS
            .iter()
            .zip(bufs.iter_mut())
            .map(|(s, b)| {
                LoadTarget::new(
                    TensorKey::new(s.key).unwrap(),
                    s.dtype,
                    s.shape.to_vec(),
                    Region::full(s.shape),
                    b,
                )
                .unwrap()
            })
            .collect();
        load(&mut t, dir, &LocalComm::single(), &opts(method))?;
        drop(t);
        Ok(bufs)
    })
}

/// The rows 4..8 of `w`: they live in shard `c.1.0`.
fn w_rows(lo: u64, hi: u64) -> Region {
    Region::new(vec![lo, 0], vec![hi - lo, 6]).unwrap()
}

fn w_shard(dir: &Path) -> PathBuf {
    dir.join("tensors/w/c.1.0")
}

/// Geometry of one shard file, from the checkpoint's index.
struct Shard {
    path: PathBuf,
    n_sub: usize,
    index_len: usize,
    /// The decoded index entries.
    entries: Vec<(u64, u64)>,
    len: usize,
}

fn shard(dir: &Path, key: &str, path: &Path) -> Shard {
    let ck = Checkpoint::open(dir).unwrap();
    let info = ck.tensor(&TensorKey::new(key).unwrap()).unwrap();
    let n_sub: u64 = info
        .chunk_shape
        .iter()
        .zip(&info.subchunk_shape)
        .map(|(c, s)| c / s)
        .product();
    let n_sub = n_sub as usize;
    let index_len = n_sub * 16 + 4;
    let bytes = std::fs::read(path).unwrap();
    let idx = &bytes[bytes.len() - index_len..];
    let (pairs, crc) = idx.split_at(n_sub * 16);
    assert_eq!(
        crc32c::crc32c(pairs).to_le_bytes(),
        crc,
        "the fixture's index layout is as documented"
    );
    let entries = pairs
        .chunks_exact(16)
        .map(|p| {
            (
                u64::from_le_bytes(p[..8].try_into().unwrap()),
                u64::from_le_bytes(p[8..].try_into().unwrap()),
            )
        })
        .collect();
    Shard {
        path: path.to_owned(),
        n_sub,
        index_len,
        entries,
        len: bytes.len(),
    }
}

/// An index with a valid crc32c.
/// The footer a shard of tensor `key` at `chunk` must carry when its subchunks are `subs`
/// (each ending with its crc32c), for hand-made shards that should fail on something other
/// than the footer.
fn footer_for(dir: &Path, key: &str, chunk: &[u64], subs: &[&[u8]]) -> Vec<u8> {
    let id = Checkpoint::open(dir).unwrap().meta().save_id.unwrap();
    let crcs: Vec<u32> = subs
        .iter()
        .map(|s| u32::from_le_bytes(s[s.len() - 4..].try_into().unwrap()))
        .collect();
    zarrckpt::storage::footer::encode(id, &TensorKey::new(key).unwrap(), chunk, &crcs)
}

fn craft_index(entries: &[(u64, u64)]) -> Vec<u8> {
    let mut out: Vec<u8> = entries
        .iter()
        .flat_map(|(o, n)| o.to_le_bytes().into_iter().chain(n.to_le_bytes()))
        .collect();
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn replace_index(sh: &Shard, entries: &[(u64, u64)]) {
    let mut bytes = std::fs::read(&sh.path).unwrap();
    bytes.truncate(sh.len - sh.index_len);
    bytes.extend_from_slice(&craft_index(entries));
    std::fs::write(&sh.path, bytes).unwrap();
}

fn flip(path: &Path, at: usize) {
    let mut b = std::fs::read(path).unwrap();
    b[at] ^= 0x5A;
    std::fs::write(path, b).unwrap();
}

/// Flips a byte of the subchunk at index entry `(off, n)`: in its data, or in its crc32c.
fn flip_subchunk(path: &Path, (off, n): (u64, u64), at_crc: bool) {
    flip(path, (off + if at_crc { n - 1 } else { n / 2 }) as usize);
}

/// `e` is a checksum error naming this tensor, chunk, subchunk and file.
fn assert_checksum(e: &Error, key_: &str, chunk_: &[u64], subchunk_: usize, path_: &Path) {
    match storage(e) {
        StorageError::Checksum {
            key,
            chunk,
            subchunk,
            path,
            stored,
            computed,
        } => {
            assert_eq!(
                (
                    key.as_str(),
                    chunk.as_slice(),
                    *subchunk as usize,
                    path.as_path()
                ),
                (key_, chunk_, subchunk_, path_)
            );
            assert_ne!(stored, computed);
        }
        other => panic!("{other:?}"),
    }
}

fn truncate(path: &Path, len: usize) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(len as u64).unwrap();
}

fn storage(e: &Error) -> &StorageError {
    match e {
        Error::Storage(s) => s,
        other => panic!("expected a storage error, got {other:?}"),
    }
}

fn corrupt_detail<'a>(e: &'a Error, key_: &str, chunk_: &[u64], path_: &Path) -> &'a str {
    match storage(e) {
        StorageError::CorruptChunk {
            key,
            chunk,
            path,
            detail,
        } => {
            assert_eq!(
                (key.as_str(), chunk.as_slice(), path.as_path()),
                (key_, chunk_, path_),
                "{e}"
            );
            detail
        }
        other => panic!("expected CorruptChunk, got {other:?}"),
    }
}

/// `verify` reports exactly `n` problems and they name `path`'s chunks.
fn verify_problems(dir: &Path) -> Vec<zarrckpt::checkpoint::Problem> {
    let report = Checkpoint::open(dir).unwrap().verify(2, None).unwrap();
    assert_eq!(report.tensors, 3);
    assert_eq!(report.chunks, 4);
    report.problems
}

fn assert_one_problem(dir: &Path, key: &str, chunk: &[u64], path: &Path) -> Error {
    let mut problems = verify_problems(dir);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    let p = problems.pop().unwrap();
    assert_eq!((p.key.as_str(), p.chunk.as_deref()), (key, Some(chunk)));
    assert_names_file(&p.error, path);
    p.error
}

// ---------------------------------------------------------------------------------------------
// Sanity
// ---------------------------------------------------------------------------------------------

#[test]
fn pristine_fixture_loads_and_verifies() {
    for c in [Compression::None, Compression::Zstd, Compression::Blosc] {
        let (_t, dir) = fixture(c);
        let got = load_all(&dir).unwrap();
        for (spec, g) in SPECS.iter().zip(&got) {
            assert_eq!(g, &full(spec), "{c:?} {}", spec.key);
        }
        assert!(verify_problems(&dir).is_empty());
        let sh = shard(&dir, "w", &w_shard(&dir));
        assert_eq!(sh.n_sub, 2, "the fixture has two subchunks per `w` shard");
        assert_eq!(shard(&dir, "e", &dir.join("tensors/e/c.0.0")).n_sub, 5);
        assert_eq!(shard(&dir, "s", &dir.join("tensors/s/c")).n_sub, 1);
    }
}

// ---------------------------------------------------------------------------------------------
// Flipped bytes
// ---------------------------------------------------------------------------------------------

#[test]
fn flipped_subchunk_byte_is_a_checksum_error() {
    for s in 0..2usize {
        for at_crc in [false, true] {
            let (_t, dir) = fixture(Compression::None);
            let path = w_shard(&dir);
            let sh = shard(&dir, "w", &path);
            flip_subchunk(&path, sh.entries[s], at_crc);
            let e = load_whole(&dir, "w").unwrap_err();
            assert_checksum(&e, "w", &[1, 0], s, &path);
            let msg = e.to_string();
            for part in [
                "`w`",
                "[1, 0]",
                &format!("subchunk {s}"),
                path.to_str().unwrap(),
                "crc32c",
            ] {
                assert!(msg.contains(part), "{msg} lacks {part}");
            }
            // The damage stays local: the other shard and the other subchunk still load.
            assert_eq!(
                load_region(&dir, "w", &w_rows(0, 4)).unwrap(),
                cut(&full(&SPECS[0]), &[8, 6], &w_rows(0, 4), 4)
            );
            let other = if s == 0 { w_rows(6, 8) } else { w_rows(4, 6) };
            assert_eq!(
                load_region(&dir, "w", &other).unwrap(),
                cut(&full(&SPECS[0]), &[8, 6], &other, 4)
            );
            let e = assert_one_problem(&dir, "w", &[1, 0], &path);
            assert!(
                matches!(storage(&e), StorageError::Checksum { .. }),
                "{e:?}"
            );
        }
    }
}

#[test]
fn flipped_compressed_byte_is_a_typed_error_naming_the_file() {
    for c in [Compression::Zstd, Compression::Blosc] {
        for s in 0..2usize {
            let (_t, dir) = fixture(c);
            let path = w_shard(&dir);
            let sh = shard(&dir, "w", &path);
            let (off, n) = sh.entries[s];
            flip(&path, (off + n / 2) as usize);
            let e = load_whole(&dir, "w").unwrap_err();
            assert_names_file(&e, &path);
            assert!(e.to_string().contains("`w`"), "{e}");
            assert_eq!(
                load_region(&dir, "w", &w_rows(0, 4)).unwrap(),
                cut(&full(&SPECS[0]), &[8, 6], &w_rows(0, 4), 4)
            );
            assert_one_problem(&dir, "w", &[1, 0], &path);
        }
    }
}

#[test]
fn flipped_compressed_byte_is_a_checksum_error() {
    let (_t, dir) = fixture(Compression::Zstd);
    let path = w_shard(&dir);
    let sh = shard(&dir, "w", &path);
    let (off, n) = sh.entries[1];
    flip(&path, (off + n / 2) as usize);
    let e = load_whole(&dir, "w").unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::Checksum { key, chunk, subchunk: 1, .. } if key == "w" && chunk == &vec![1, 0]),
        "{e:?}"
    );
}

#[test]
fn flipped_index_byte_is_a_corrupt_chunk() {
    for c in BOTH {
        let (_t, dir0) = fixture(c);
        let sh = shard(&dir0, "w", &w_shard(&dir0));
        for at in [
            sh.len - sh.index_len,
            sh.len - sh.index_len + 9,
            sh.len - 5,
            sh.len - 1,
        ] {
            let (_t, dir) = fixture(c);
            let path = w_shard(&dir);
            flip(&path, at);
            let e = load_whole(&dir, "w").unwrap_err();
            let detail = corrupt_detail(&e, "w", &[1, 0], &path);
            assert!(detail.contains("index"), "{detail}");
            let msg = e.to_string();
            assert!(
                msg.contains(path.to_str().unwrap()) && msg.contains("[1, 0]"),
                "{msg}"
            );
            let e = assert_one_problem(&dir, "w", &[1, 0], &path);
            assert!(
                matches!(storage(&e), StorageError::CorruptChunk { .. }),
                "{c:?} {at}: {e:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Truncation, deletion, extension
// ---------------------------------------------------------------------------------------------

#[test]
fn truncated_shard_is_a_corrupt_chunk() {
    for c in BOTH {
        let (_t, dir0) = fixture(c);
        let sh = shard(&dir0, "w", &w_shard(&dir0));
        let lens = [
            0,
            1,
            sh.index_len - 1,
            sh.index_len,
            sh.index_len + 1,
            sh.len - sh.index_len,
            sh.len / 2,
            sh.len - 1,
        ];
        for len in lens {
            let (_t, dir) = fixture(c);
            let path = w_shard(&dir);
            truncate(&path, len);
            let e = load_whole(&dir, "w").unwrap_err();
            let detail = corrupt_detail(&e, "w", &[1, 0], &path);
            if len < sh.index_len {
                assert!(
                    detail.contains(&format!("file is {len} bytes")),
                    "{c:?} {len}: {detail}"
                );
            }
            assert_one_problem(&dir, "w", &[1, 0], &path);
            // Reading through `Checkpoint` fails alike, naming the file.
            let ck = Checkpoint::open(&dir).unwrap();
            let e = ck.read_tensor(&TensorKey::new("w").unwrap()).unwrap_err();
            corrupt_detail(&e, "w", &[1, 0], &path);
            // A load of every tensor fails as a whole: no target is reported loaded.
            assert_names_file(&load_all(&dir).unwrap_err(), &path);
            // The other shard is unaffected.
            load_region(&dir, "w", &w_rows(0, 4)).unwrap();
        }
    }
}

/// A shard that exists but cannot be read (replaced by a directory: opening it succeeds,
/// reading fails with `EISDIR`, whatever the user's privileges) is an error naming it on
/// every read path, never zeros or a partial target reported as loaded.
#[test]
fn unreadable_shard_is_an_error_naming_it() {
    for c in BOTH {
        let (_t, dir) = fixture(c);
        let path = w_shard(&dir);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("x"), b"not a shard").unwrap();
        let e = load_whole(&dir, "w").unwrap_err();
        assert_names_file(&e, &path);
        assert_names_file(&load_all(&dir).unwrap_err(), &path);
        let ck = Checkpoint::open(&dir).unwrap();
        let e = ck.read_tensor(&TensorKey::new("w").unwrap()).unwrap_err();
        assert_names_file(&e, &path);
        let mut buf = vec![0u8; 4 * 6 * 4];
        let e = ck
            .read_region(&TensorKey::new("w").unwrap(), &w_rows(4, 8), &mut buf)
            .unwrap_err();
        assert_names_file(&e, &path);
        assert_one_problem(&dir, "w", &[1, 0], &path);
        // The other shard and tensors are unaffected.
        load_region(&dir, "w", &w_rows(0, 4)).unwrap();
        load_whole(&dir, "e").unwrap();
    }
}

#[test]
fn deleted_shard_is_a_missing_chunk() {
    for c in BOTH {
        let (_t, dir) = fixture(c);
        let path = w_shard(&dir);
        std::fs::remove_file(&path).unwrap();
        let e = load_whole(&dir, "w").unwrap_err();
        assert!(
            matches!(storage(&e), StorageError::MissingChunk { key, chunk, path: p } if key == "w" && chunk == &vec![1, 0] && p == &path),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(path.to_str().unwrap()) && msg.contains("missing"),
            "{msg}"
        );
        let e = assert_one_problem(&dir, "w", &[1, 0], &path);
        assert!(matches!(storage(&e), StorageError::MissingChunk { .. }));
        // Scalars have a chunk file too.
        let scalar = dir.join("tensors/s/c");
        std::fs::remove_file(&scalar).unwrap();
        let e = load_whole(&dir, "s").unwrap_err();
        assert!(
            matches!(storage(&e), StorageError::MissingChunk { chunk, .. } if chunk.is_empty()),
            "{e:?}"
        );
        assert_eq!(verify_problems(&dir).len(), 2);
    }
}

#[test]
fn shard_extended_with_garbage_is_a_corrupt_chunk() {
    for c in BOTH {
        for tail in [
            vec![0u8; 1],
            vec![0u8; 100],
            (0..77u8).map(|i| i.wrapping_mul(37)).collect::<Vec<_>>(),
        ] {
            let (_t, dir) = fixture(c);
            let path = w_shard(&dir);
            let mut b = std::fs::read(&path).unwrap();
            b.extend_from_slice(&tail);
            std::fs::write(&path, b).unwrap();
            let e = load_whole(&dir, "w").unwrap_err();
            corrupt_detail(&e, "w", &[1, 0], &path);
            assert_one_problem(&dir, "w", &[1, 0], &path);
        }
        // Garbage in the middle (before the footer) with a valid footer and index re-appended
        // at the end is a valid file; garbage between the footer and the index is not (the
        // footer is not where the geometry puts it).
        let (_t, dir) = fixture(c);
        let path = w_shard(&dir);
        let sh = shard(&dir, "w", &path);
        let foot = zarrckpt::storage::footer::footer_len(2, sh.n_sub as u64).unwrap() as usize;
        let original = std::fs::read(&path).unwrap();
        let mut b = original.clone();
        let tail = b.split_off(sh.len - sh.index_len - foot);
        b.extend_from_slice(&[0xEE; 33]);
        b.extend_from_slice(&tail);
        std::fs::write(&path, b).unwrap();
        assert_eq!(load_whole(&dir, "w").unwrap(), full(&SPECS[0]));
        assert!(verify_problems(&dir).is_empty());
        let mut b = original;
        let index = b.split_off(sh.len - sh.index_len);
        b.extend_from_slice(&[0xEE; 33]);
        b.extend_from_slice(&index);
        std::fs::write(&path, b).unwrap();
        let e = load_whole(&dir, "w").unwrap_err();
        corrupt_detail(&e, "w", &[1, 0], &path);
        assert_one_problem(&dir, "w", &[1, 0], &path);
    }
}

// ---------------------------------------------------------------------------------------------
// Crafted indexes (valid crc32c, hostile entries)
// ---------------------------------------------------------------------------------------------

#[test]
fn index_entries_past_the_end_are_corrupt_chunks() {
    for c in BOTH {
        let (_t, dir0) = fixture(c);
        let sh0 = shard(&dir0, "w", &w_shard(&dir0));
        let data_end = (sh0.len - sh0.index_len) as u64;
        let (o1, n1) = sh0.entries[1];
        let bad: Vec<(&str, (u64, u64))> = vec![
            ("past the end", (data_end - 10, n1)),
            ("into the index", (data_end - n1 + 4, n1)),
            ("far past the end", (1 << 40, n1)),
            ("overflowing end", (u64::MAX - 5, 100)),
            ("huge length", (o1, u64::MAX)),
        ];
        for (what, entry) in bad {
            let (_t, dir) = fixture(c);
            let path = w_shard(&dir);
            let sh = shard(&dir, "w", &path);
            replace_index(&sh, &[sh.entries[0], entry]);
            let e = load_whole(&dir, "w").unwrap_err();
            let detail = corrupt_detail(&e, "w", &[1, 0], &path);
            assert!(
                detail.contains("subchunk 1") && detail.contains("past the data"),
                "{c:?} {what}: {detail}"
            );
            assert_one_problem(&dir, "w", &[1, 0], &path);
            // The whole index is checked (spec section 7.2): subchunk 0 is not read either.
            let e = load_region(&dir, "w", &w_rows(4, 6)).unwrap_err();
            corrupt_detail(&e, "w", &[1, 0], &path);
        }
    }
}

#[test]
fn index_entry_with_wrong_length_is_an_error() {
    for c in BOTH {
        for delta in [-4i64, -1, 1] {
            let (_t, dir) = fixture(c);
            let path = w_shard(&dir);
            let sh = shard(&dir, "w", &path);
            let (o, n) = sh.entries[1];
            let n2 = (n as i64 + delta) as u64;
            replace_index(&sh, &[sh.entries[0], (o, n2)]);
            let e = load_whole(&dir, "w").unwrap_err();
            if delta > 0 {
                // The subchunk is the last one before the index: one byte more reaches into it.
                let detail = corrupt_detail(&e, "w", &[1, 0], &path);
                assert!(detail.contains("past the data"), "{detail}");
            } else if c == Compression::None {
                let detail = corrupt_detail(&e, "w", &[1, 0], &path);
                assert!(
                    detail.contains(&format!("is {n2} bytes, expected {n}")),
                    "{detail}"
                );
            } else {
                assert_names_file(&e, &path);
            }
            assert_one_problem(&dir, "w", &[1, 0], &path);
        }
    }
}

#[test]
fn index_entry_marked_absent_is_refused_by_the_footer() {
    // Zarr semantics: an absent subchunk holds the fill value. A zarrckpt save writes every
    // present subchunk, so this only happens to a file whose index was rewritten with a valid
    // crc; the footer (format 1.1 and later) gives the subchunk a non-zero crc32c, so the
    // reader refuses the shard instead of reading zeros (spec section 7.4).
    for c in BOTH {
        let (_t, dir) = fixture(c);
        let path = w_shard(&dir);
        let sh = shard(&dir, "w", &path);
        replace_index(&sh, &[sh.entries[0], (u64::MAX, u64::MAX)]);
        let e = load_whole(&dir, "w").unwrap_err();
        let detail = corrupt_detail(&e, "w", &[1, 0], &path);
        assert!(detail.contains("absent"), "{detail}");
        assert_one_problem(&dir, "w", &[1, 0], &path);
    }
}

#[test]
fn index_of_the_wrong_size_for_the_geometry() {
    // The `e` shard has five subchunks; an index written for two is garbage at the right end.
    for c in BOTH {
        let (_t, dir) = fixture(c);
        let path = dir.join("tensors/e/c.0.0");
        let sh = shard(&dir, "e", &path);
        let mut b = std::fs::read(&path).unwrap();
        b.truncate(sh.len - sh.index_len);
        b.extend_from_slice(&craft_index(&sh.entries[..2]));
        std::fs::write(&path, b).unwrap();
        let e = load_whole(&dir, "e").unwrap_err();
        corrupt_detail(&e, "e", &[0, 0], &path);
    }
}

// ---------------------------------------------------------------------------------------------
// verify collects every problem
// ---------------------------------------------------------------------------------------------

#[test]
fn verify_collects_every_problem() {
    for c in BOTH {
        let (_t, dir) = fixture(c);
        let w0 = dir.join("tensors/w/c.0.0");
        let w1 = w_shard(&dir);
        let e = dir.join("tensors/e/c.0.0");
        let s = dir.join("tensors/s/c");
        let sh = shard(&dir, "w", &w0);
        flip(&w0, sh.entries[1].0 as usize + 1);
        std::fs::remove_file(&w1).unwrap();
        truncate(&e, 3);
        std::fs::write(&s, b"").unwrap();
        let problems = verify_problems(&dir);
        let got: Vec<(String, Option<Vec<u64>>)> = problems
            .iter()
            .map(|p| (p.key.to_string(), p.chunk.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("e".into(), Some(vec![0, 0])),
                ("s".into(), Some(vec![])),
                ("w".into(), Some(vec![0, 0])),
                ("w".into(), Some(vec![1, 0])),
            ],
            "{c:?}"
        );
        for (p, path) in problems.iter().zip([&e, &s, &w0, &w1]) {
            assert_names_file(&p.error, path);
        }
        assert!(matches!(
            storage(&problems[1].error),
            StorageError::CorruptChunk { .. }
        ));
        assert!(matches!(
            storage(&problems[3].error),
            StorageError::MissingChunk { .. }
        ));
        if c == Compression::None {
            assert!(
                matches!(
                    storage(&problems[2].error),
                    StorageError::Checksum { subchunk: 1, .. }
                ),
                "{:?}",
                problems[2]
            );
        }
        // load stops at the first problem but still names a damaged file.
        let err = load_all(&dir).unwrap_err();
        let msg = err.to_string();
        assert!(
            [&e, &s, &w0, &w1]
                .iter()
                .any(|p| msg.contains(p.to_str().unwrap())),
            "{msg}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Random damage
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Damage {
    /// XOR these (position, non-zero mask) pairs, positions taken modulo the length.
    Flip(Vec<(usize, u8)>),
    /// Cut the file to this fraction of its length (0..=999 per mille).
    Truncate(u16),
    /// Append bytes.
    Extend(Vec<u8>),
    /// Overwrite a run of bytes with a value.
    Smear(usize, usize, u8),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        prop::collection::vec((any::<usize>(), 1u8..=255), 1..4).prop_map(Damage::Flip),
        (0u16..1000).prop_map(Damage::Truncate),
        prop::collection::vec(any::<u8>(), 1..40).prop_map(Damage::Extend),
        (any::<usize>(), 1usize..64, any::<u8>()).prop_map(|(a, n, v)| Damage::Smear(a, n, v)),
    ]
}

fn shard_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for spec in &SPECS {
        let d = dir.join("tensors").join(spec.key);
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap() != "zarr.json" {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Applies `d` to `path`; returns true when the bytes changed.
fn apply(path: &Path, d: &Damage) -> bool {
    let before = std::fs::read(path).unwrap();
    let mut b = before.clone();
    match d {
        Damage::Flip(flips) => {
            for &(at, mask) in flips {
                let i = at % b.len();
                b[i] ^= mask;
            }
        }
        Damage::Truncate(per_mille) => b.truncate(b.len() * usize::from(*per_mille) / 1000),
        Damage::Extend(tail) => b.extend_from_slice(tail),
        Damage::Smear(at, n, v) => {
            let start = at % b.len();
            let end = (start + n).min(b.len());
            b[start..end].fill(*v);
        }
    }
    std::fs::write(path, &b).unwrap();
    b != before
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_damage_never_panics_or_lies(comp in 0usize..3, pick in any::<prop::sample::Index>(), d in damage()) {
        let c = [Compression::None, Compression::Zstd, Compression::Blosc][comp];
        let (_t, dir) = fixture(c);
        let files = shard_files(&dir);
        prop_assert_eq!(files.len(), 4);
        let path = pick.get(&files).clone();
        let changed = apply(&path, &d);
        match load_all(&dir) {
            Ok(got) => {
                for (spec, g) in SPECS.iter().zip(&got) {
                    prop_assert_eq!(g, &full(spec), "{:?} {:?}: Ok with wrong data in `{}`", c, d, spec.key);
                }
            }
            Err(e) => {
                prop_assert!(changed, "an undamaged checkpoint failed: {e}");
                assert_names_file(&e, &path);
                // verify finds the same file.
                let problems = verify_problems(&dir);
                prop_assert_eq!(problems.len(), 1, "{:?}", problems);
                assert_names_file(&problems[0].error, &path);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fuzz seeds and crash regressions, replayed as ordinary tests
// ---------------------------------------------------------------------------------------------

fn fuzz_inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut out = Vec::new();
    for kind in ["seeds", "regressions"] {
        let d = root.join(kind).join(target);
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            let known_bug = p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("bug-"));
            if p.is_file() && p.extension().is_none_or(|x| x != "md") && !known_bug {
                let bytes = std::fs::read(&p).unwrap();
                out.push((p, bytes));
            }
        }
    }
    out.sort();
    out
}

fn replay(target: &str) -> usize {
    let inputs = fuzz_inputs(target);
    for (path, bytes) in &inputs {
        let r = std::panic::catch_unwind(|| fuzz_checks::check(target, bytes));
        assert!(
            r.is_ok(),
            "fuzz input {} of {target} fails its check",
            path.display()
        );
    }
    inputs.len()
}

#[test]
fn fuzz_layout_decode_inputs() {
    assert!(replay("layout_decode") > 0, "seeds exist");
    // A real layout and every prefix of it.
    let layout = zarrckpt::plan::RankLayout {
        tensors: vec![zarrckpt::plan::TensorDecl {
            key: TensorKey::new("w").unwrap(),
            dtype: DType::BFloat16,
            global_shape: vec![8, 300],
        }],
        pieces: vec![zarrckpt::plan::PieceDecl {
            tensor: 0,
            region: Region::new(vec![4, 0], vec![4, 300]).unwrap(),
            main: true,
            auto: false,
        }],
    };
    let enc = layout.encode();
    for cut in 0..=enc.len() {
        fuzz_checks::check_layout_decode(&enc[..cut]);
    }
}

#[test]
fn fuzz_root_metadata_inputs() {
    assert!(replay("root_metadata") > 0, "seeds exist");
    let (_t, dir) = fixture(Compression::None);
    let root = std::fs::read(dir.join("zarr.json")).unwrap();
    for cut in (0..root.len()).step_by(7) {
        fuzz_checks::check_root_metadata(&root[..cut]);
    }
    fuzz_checks::check_root_metadata(&root);
}

#[test]
fn fuzz_tensor_key_inputs() {
    assert!(replay("tensor_key") > 0, "seeds exist");
    for k in ["a/b\u{ff}a", "__x", "~5F_x\u{0}", ". a", "a\\b", "é/É"] {
        fuzz_checks::check_tensor_key(k.as_bytes());
    }
    let mut pair = b"Weight".to_vec();
    pair.push(0xff);
    pair.extend_from_slice(b"weight");
    fuzz_checks::check_tensor_key(&pair);
}

#[test]
fn fuzz_shard_read_inputs() {
    // One test: the shard target rewrites a shared fixture file, so its inputs run in sequence.
    for seed in fuzz_checks::shard_seeds() {
        fuzz_checks::check_shard_read(&seed);
    }
    replay("shard_read");
}

/// Writes the seed corpora under `fuzz/seeds/` (run by hand after format changes:
/// `cargo test --test corruption -- --ignored write_fuzz_seeds`).
#[test]
#[ignore = "tool: regenerates fuzz/seeds, run by hand"]
fn write_fuzz_seeds() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    let write = |target: &str, name: &str, bytes: &[u8]| {
        let d = root.join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(name), bytes).unwrap();
    };
    let layout = zarrckpt::plan::RankLayout {
        tensors: vec![
            zarrckpt::plan::TensorDecl {
                key: TensorKey::new("decoder.w").unwrap(),
                dtype: DType::BFloat16,
                global_shape: vec![8, 300],
            },
            zarrckpt::plan::TensorDecl {
                key: TensorKey::new("opt/step").unwrap(),
                dtype: DType::Int64,
                global_shape: vec![],
            },
        ],
        pieces: vec![
            zarrckpt::plan::PieceDecl {
                tensor: 0,
                region: Region::new(vec![4, 0], vec![4, 300]).unwrap(),
                main: true,
                auto: false,
            },
            zarrckpt::plan::PieceDecl {
                tensor: 1,
                region: Region::full(&[]),
                main: false,
                auto: false,
            },
        ],
    };
    write("layout_decode", "two_tensors", &layout.encode());
    write(
        "layout_decode",
        "empty",
        &zarrckpt::plan::RankLayout::default().encode(),
    );
    let (_t, dir) = fixture(Compression::Zstd);
    write(
        "root_metadata",
        "zstd_checkpoint",
        &std::fs::read(dir.join("zarr.json")).unwrap(),
    );
    let (_t, dir) = fixture(Compression::None);
    write(
        "root_metadata",
        "checkpoint",
        &std::fs::read(dir.join("zarr.json")).unwrap(),
    );
    write(
        "tensor_key",
        "megatron",
        b"decoder.layers.0.mlp.linear_fc1.weight",
    );
    write(
        "tensor_key",
        "nested_pair",
        b"optimizer/exp_avg/w\xffoptimizer/exp_avg",
    );
    write("tensor_key", "escapes", "__a b/~é\u{ff}".as_bytes());
    let names = ["none", "zstd", "none_fixcrc", "zstd_fixcrc"];
    for (name, seed) in names.iter().zip(fuzz_checks::shard_seeds()) {
        write("shard_read", &format!("pristine_{name}"), &seed);
    }
    for (name, seed) in footer_seeds() {
        write("shard_footer", name, &seed);
    }
}

/// Valid footers (1 and 2 dimensions, with and without the harness's fix-ups).
fn footer_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use zarrckpt::storage::footer::{SaveId, encode};
    let key = TensorKey::new("k").unwrap();
    let id = SaveId(fuzz_checks::PLACEHOLDER_ID);
    let mut one = vec![1u8];
    one.extend(encode(id, &key, &[1], &[7, 0, 9]));
    let mut two = vec![0xC2u8];
    two.extend(encode(id, &key, &[1, 2], &[0xdead_beef]));
    vec![("one_dim", one), ("two_dims_fixed", two)]
}

#[test]
fn fuzz_shard_footer_inputs() {
    assert!(replay("shard_footer") > 0, "seeds exist");
    for (_, seed) in footer_seeds() {
        fuzz_checks::check_shard_footer(&seed);
        for cut in 0..seed.len() {
            fuzz_checks::check_shard_footer(&seed[..cut]);
        }
        for i in 1..seed.len() {
            let mut s = seed.clone();
            s[i] ^= 0x20;
            fuzz_checks::check_shard_footer(&s);
        }
    }
}

/// A zstd frame whose header declares `content_size` bytes but holds one empty raw block.
fn zstd_bomb(content_size: u64) -> Vec<u8> {
    let mut f = vec![0x28, 0xB5, 0x2F, 0xFD, 0xE0]; // magic; single segment, 8-byte content size
    f.extend_from_slice(&content_size.to_le_bytes());
    f.extend_from_slice(&[0x01, 0x00, 0x00]); // last block, raw, 0 bytes
    f
}

#[test]
fn zstd_frame_declaring_a_huge_size_is_an_error_not_an_abort() {
    // The crc32c covers the compressed bytes only, so a crafted (or bit-rotted then
    // re-checksummed) subchunk passes it. zarrs' zstd codec sizes its output buffer from the
    // frame header, not from the subchunk's known decoded size: 1 TiB cannot be allocated and
    // the allocation failure aborts. Run in a child process so the abort is observable.
    const CHILD: &str = "ZARRCKPT_TEST_ZSTD_BOMB_CHILD";
    let name = "zstd_frame_declaring_a_huge_size_is_an_error_not_an_abort";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                name,
                "--exact",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the load died: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let (_t, dir) = fixture(Compression::Zstd);
    let path = w_shard(&dir);
    let sh = shard(&dir, "w", &path);
    let bytes = std::fs::read(&path).unwrap();
    let (o0, n0) = sh.entries[0];
    let mut sub = zstd_bomb(1 << 40);
    sub.extend_from_slice(&crc32c::crc32c(&sub).to_le_bytes());
    let mut file = bytes[o0 as usize..(o0 + n0) as usize].to_vec();
    let entries = [(0, n0), (n0, sub.len() as u64)];
    let footer = footer_for(&dir, "w", &[1, 0], &[&file, &sub]);
    file.extend_from_slice(&sub);
    file.extend_from_slice(&footer);
    file.extend_from_slice(&craft_index(&entries));
    std::fs::write(&path, file).unwrap();
    let e = load_whole(&dir, "w").unwrap_err();
    assert_names_file(&e, &path);
    let e = assert_one_problem(&dir, "w", &[1, 0], &path);
    assert_names_file(&e, &path);
}

/// A zstd subchunk made of its own valid frame (declaring exactly the subchunk's size)
/// followed by a second frame declaring 1 TiB, with a valid crc32c: zarrs sizes its output
/// by the sum of every frame's declared size, so the reader must refuse anything but one
/// frame. In a child process, as the allocation failure would abort.
#[test]
fn zstd_second_frame_declaring_a_huge_size_is_an_error_not_an_abort() {
    const CHILD: &str = "ZARRCKPT_TEST_ZSTD_TWO_FRAMES_CHILD";
    let name = "zstd_second_frame_declaring_a_huge_size_is_an_error_not_an_abort";
    if std::env::var_os(CHILD).is_none() {
        let out = in_child(name, CHILD);
        assert!(
            out.status.success(),
            "the load died: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let (_t, dir) = fixture(Compression::Zstd);
    let path = w_shard(&dir);
    let sh = shard(&dir, "w", &path);
    let bytes = std::fs::read(&path).unwrap();
    let (o1, n1) = sh.entries[1];
    let mut sub = bytes[o1 as usize..(o1 + n1 - 4) as usize].to_vec();
    sub.extend_from_slice(&zstd_bomb(1 << 40));
    sub.extend_from_slice(&crc32c::crc32c(&sub).to_le_bytes());
    let mut file = bytes[..o1 as usize].to_vec();
    let entries = [sh.entries[0], (o1, sub.len() as u64)];
    let (o0, n0) = sh.entries[0];
    let footer = footer_for(
        &dir,
        "w",
        &[1, 0],
        &[&bytes[o0 as usize..(o0 + n0) as usize], &sub],
    );
    file.extend_from_slice(&sub);
    file.extend_from_slice(&footer);
    file.extend_from_slice(&craft_index(&entries));
    std::fs::write(&path, file).unwrap();
    let e = load_whole(&dir, "w").unwrap_err();
    assert_names_file(&e, &path);
    assert!(e.to_string().contains("not one frame"), "{e}");
    let e = assert_one_problem(&dir, "w", &[1, 0], &path);
    assert_names_file(&e, &path);
}

/// Fuzz crashes whose library bug is not fixed yet are saved as
/// `fuzz/regressions/<target>/bug-<name>`; each replays in a child process, since some abort.
/// Once the bug is fixed, drop the `bug-` prefix so `fuzz_*_inputs` replays it by default.
#[test]
#[ignore = "tool: replays fuzz crashes not fixed yet (fuzz/regressions/*/bug-*), each in a child process"]
fn fuzz_known_crashes_are_fixed() {
    const CHILD: &str = "ZARRCKPT_TEST_FUZZ_CHILD";
    if let Some(file) = std::env::var_os(CHILD) {
        let file = PathBuf::from(file);
        let target = file
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        fuzz_checks::check(&target, &std::fs::read(&file).unwrap());
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
    let mut failures = Vec::new();
    for target in fuzz_checks::TARGETS {
        let Ok(entries) = std::fs::read_dir(root.join(target)) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            if !p.file_name().unwrap().to_string_lossy().starts_with("bug-") {
                continue;
            }
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "fuzz_known_crashes_are_fixed",
                    "--exact",
                    "--include-ignored",
                    "--test-threads=1",
                ])
                .env(CHILD, &p)
                .output()
                .unwrap();
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                let last: Vec<&str> = err
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .take(3)
                    .collect();
                failures.push(format!(
                    "{}: {:?} {}",
                    p.display(),
                    out.status,
                    last.join(" | ")
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A tensor split by columns: its subchunks are column strips spanning every row, so a whole
/// subchunk is not contiguous in a buffer holding the whole tensor and is copied run by run
/// (with its crc32c computed on the way). A flipped byte in any strip, or in its crc, is a
/// checksum error naming that subchunk, by both read methods; the pristine file loads exactly.
#[test]
fn flipped_byte_in_a_column_strip_is_a_checksum_error() {
    let shape: &[u64] = &[6, 8];
    let spec = Spec {
        key: "col",
        dtype: DType::Float32,
        shape,
        pieces: &[],
    };
    let data = full(&spec);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let halves: Vec<(Region, Vec<u8>)> = [0u64, 4]
        .iter()
        .map(|&c| {
            let r = Region::new(vec![0, c], vec![6, 4]).unwrap();
            let d = cut(&data, shape, &r, 4);
            (r, d)
        })
        .collect();
    let pieces: Vec<ShardedTensor> = halves
        .iter()
        .map(|(r, d)| {
            let key = TensorKey::new("col").unwrap();
            ShardedTensor::new(key, DType::Float32, shape.to_vec(), r.clone(), 0, d).unwrap()
        })
        .collect();
    let mut save_opts = SaveOptions {
        io_threads: 1,
        ..Default::default()
    };
    save_opts.grid.subchunk_target_bytes = 24;
    save_opts.grid.min_chunk_bytes = 0;
    save(&pieces, &dir, &LocalComm::single(), &save_opts).unwrap();
    let info = Checkpoint::open(&dir)
        .unwrap()
        .tensor(&TensorKey::new("col").unwrap())
        .unwrap();
    assert_eq!(
        (info.chunk_shape.as_slice(), info.subchunk_shape.as_slice()),
        (&[6u64, 4][..], &[6u64, 1][..]),
        "the layout this test is about"
    );
    let load_col = |dir: &Path| load_box(dir, "col", DType::Float32, shape, &Region::full(shape));
    assert_eq!(load_col(&dir).unwrap(), data);
    let pristine = tmp.path().join("pristine");
    copy_dir(&dir, &pristine);
    for s in 0..4usize {
        for at_crc in [false, true] {
            std::fs::remove_dir_all(&dir).unwrap();
            copy_dir(&pristine, &dir);
            let path = dir.join("tensors/col/c.0.1");
            let sh = shard(&dir, "col", &path);
            flip_subchunk(&path, sh.entries[s], at_crc);
            assert_checksum(&load_col(&dir).unwrap_err(), "col", &[0, 1], s, &path);
        }
    }
}

/// Runs test `name` again in a child process with `child_env` set and returns how it ended,
/// so that a signal (SIGBUS, an abort) fails the parent visibly instead of killing the
/// harness.
fn in_child(name: &str, child_env: &str) -> std::process::Output {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            name,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(child_env, "1")
        .output()
        .unwrap()
}

/// A shard file truncated (and rewritten) by another program while loads run with the
/// default read method: every load returns the exact data or a typed error naming the file,
/// never a signal (the mapped read path died of SIGBUS here). Runs in a child process.
#[test]
fn shard_truncated_during_default_loads_is_an_error_not_a_signal() {
    const CHILD: &str = "ZARRCKPT_TEST_TRUNCATE_CHILD";
    let name = "shard_truncated_during_default_loads_is_an_error_not_a_signal";
    if std::env::var_os(CHILD).is_none() {
        let out = in_child(name, CHILD);
        assert!(
            out.status.success(),
            "the loading process died: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("truncation trials:"), "{stdout}");
        return;
    }
    // One f32 tensor of 16 MiB in one shard of 64 subchunks (of 256 KiB).
    let shape: &[u64] = &[1024, 4096];
    let key = TensorKey::new("big").unwrap();
    let data: Vec<u8> = (0..shape.iter().product::<u64>() * 4)
        .map(|i| (i.wrapping_mul(0x9E37_79B9) >> 13) as u8)
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let piece = ShardedTensor::new(
        key.clone(),
        DType::Float32,
        shape.to_vec(),
        Region::full(shape),
        0,
        &data,
    )
    .unwrap();
    let mut save_opts = SaveOptions::default();
    save_opts.grid.subchunk_target_bytes = 256 << 10;
    save(&[piece], &dir, &LocalComm::single(), &save_opts).unwrap();
    let path = dir.join("tensors/big/c.0.0");
    let pristine = std::fs::read(&path).unwrap();
    let load_once = || -> Result<Vec<u8>, Error> {
        let mut buf = vec![0u8; data.len()];
        let mut t = [LoadTarget::new(
            key.clone(),
            DType::Float32,
            shape.to_vec(),
            Region::full(shape),
            &mut buf,
        )
        .unwrap()];
        load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default())?;
        drop(t);
        Ok(buf)
    };
    assert_eq!(load_once().unwrap(), data);
    // Truncated just before a load: a typed error.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(pristine.len() as u64 / 2)
        .unwrap();
    assert_names_file(&load_once().unwrap_err(), &path);
    std::fs::write(&path, &pristine).unwrap();
    // Truncated (to a random length) and restored in place while loads run.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (mut ok, mut errors) = (0usize, 0usize);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(x % pristine.len() as u64).unwrap();
                std::thread::sleep(std::time::Duration::from_micros(x % 3000));
                use std::os::unix::fs::FileExt;
                f.write_all_at(&pristine, 0).unwrap();
                std::thread::sleep(std::time::Duration::from_micros((x >> 20) % 3000));
            }
        });
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_secs(3) || errors == 0 {
            match load_once() {
                Ok(buf) => {
                    assert!(buf == data, "a load returned wrong data");
                    ok += 1;
                }
                Err(e) => {
                    assert_names_file(&e, &path);
                    errors += 1;
                }
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "no error in 60 s"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    println!("truncation trials: {ok} exact loads, {errors} typed errors");
}

/// Applies 1 to 8 random mutations to `data` (bit flips, interesting bytes and little-endian
/// words, insertions, deletions, duplicated ranges, splices from `other`).
fn mutate(data: &mut Vec<u8>, other: &[u8], rng: &mut u64) {
    let mut next = || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    };
    const WORDS: [u64; 10] = [
        0,
        1,
        0x7f,
        0xff,
        0xffff,
        1 << 31,
        1 << 32,
        1 << 40,
        u64::MAX,
        u64::MAX - 1,
    ];
    for _ in 0..1 + next() % 8 {
        let len = data.len().max(1);
        let at = (next() as usize) % len;
        match next() % 9 {
            0 if !data.is_empty() => data[at] ^= 1 << (next() % 8),
            1 if !data.is_empty() => {
                data[at] = [0, 1, 0x7f, 0x80, 0xff, b'"', b'{', b'.'][(next() % 8) as usize]
            }
            2 if data.len() >= 8 => {
                let at = at.min(data.len() - 8);
                let w = WORDS[(next() % WORDS.len() as u64) as usize];
                data[at..at + 8].copy_from_slice(&w.to_le_bytes());
            }
            3 if data.len() >= 4 => {
                let at = at.min(data.len() - 4);
                let w = WORDS[(next() % WORDS.len() as u64) as usize] as u32;
                data[at..at + 4].copy_from_slice(&w.to_le_bytes());
            }
            4 => {
                let n = 1 + (next() % 16) as usize;
                let bytes: Vec<u8> = (0..n).map(|_| next() as u8).collect();
                let at = at.min(data.len());
                data.splice(at..at, bytes);
            }
            5 if !data.is_empty() => {
                let n = 1 + (next() as usize) % (data.len() - at).min(64);
                data.drain(at..at + n);
            }
            6 if !data.is_empty() => {
                let n = 1 + (next() as usize) % (data.len() - at).min(64);
                let copy = data[at..at + n].to_vec();
                let to = (next() as usize) % data.len();
                data.splice(to..to, copy);
            }
            7 if !other.is_empty() => {
                let from = (next() as usize) % other.len();
                let n = 1 + (next() as usize) % (other.len() - from).min(256);
                let at = at.min(data.len());
                let end = (at + n).min(data.len());
                data.splice(at..end, other[from..from + n].iter().copied());
            }
            _ => data.truncate(at),
        }
    }
}

/// Mutation fuzzing on stable Rust, without coverage guidance: drives the same checks as the
/// cargo-fuzz targets (`fuzz/src/lib.rs`) with random mutations of the seeds and regressions,
/// each target in its own child process (so an abort is reported, with the target and seed).
/// A failing input is saved under `fuzz/artifacts/stable/<target>/`. Budget per target:
/// `ZARRCKPT_FUZZ_SECS` (default 60), `ZARRCKPT_FUZZ_SEED` picks the random stream,
/// `ZARRCKPT_FUZZ_TARGETS` (comma-separated) restricts the targets. Run:
/// `cargo test --release --test corruption -- --ignored fuzz_mutate_stable --nocapture`.
#[test]
#[ignore = "tool: long mutation-fuzzing run, by hand"]
fn fuzz_mutate_stable() {
    const CHILD: &str = "ZARRCKPT_FUZZ_TARGET";
    let secs: u64 = std::env::var("ZARRCKPT_FUZZ_SECS").map_or(60, |s| s.parse().unwrap());
    let seed: u64 = std::env::var("ZARRCKPT_FUZZ_SEED").map_or(0x5EED, |s| s.parse().unwrap());
    if let Ok(target) = std::env::var(CHILD) {
        let corpus: Vec<Vec<u8>> = fuzz_inputs(&target).into_iter().map(|(_, b)| b).collect();
        assert!(!corpus.is_empty());
        let mut rng = seed | 1;
        let t0 = std::time::Instant::now();
        let mut execs = 0u64;
        while t0.elapsed().as_secs() < secs {
            for _ in 0..64 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let mut data = corpus[(rng % corpus.len() as u64) as usize].clone();
                let other = &corpus[((rng >> 32) % corpus.len() as u64) as usize];
                mutate(&mut data, other, &mut rng);
                let r = std::panic::catch_unwind(|| fuzz_checks::check(&target, &data));
                execs += 1;
                if r.is_err() {
                    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("fuzz/artifacts/stable")
                        .join(&target);
                    std::fs::create_dir_all(&dir).unwrap();
                    let file = dir.join(format!("crash-{:016x}", crc32c::crc32c(&data)));
                    std::fs::write(&file, &data).unwrap();
                    panic!("{target}: failing input saved to {}", file.display());
                }
            }
        }
        println!(
            "FUZZ {target} {execs} executions in {:.1} s, 0 failures",
            t0.elapsed().as_secs_f64()
        );
        return;
    }
    let mut total = 0u64;
    let mut failures = Vec::new();
    let only = std::env::var("ZARRCKPT_FUZZ_TARGETS").unwrap_or_default();
    for target in fuzz_checks::TARGETS {
        if !only.is_empty() && !only.split(',').any(|t| t == target) {
            continue;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "fuzz_mutate_stable",
                "--exact",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, target)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.find("FUZZ ").map(|i| &l[i..]))
            .unwrap_or("");
        println!("{line}");
        if !out.status.success() {
            failures.push(format!(
                "{target} (seed {seed}): {:?}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        } else {
            total += line
                .split_whitespace()
                .nth(2)
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("{target}: no count in {stdout}"));
        }
    }
    println!("FUZZ total {total} executions");
    assert!(failures.is_empty(), "{failures:#?}");
}
