//! The invariants the fuzz targets check, shared with the ordinary regression tests
//! (`tests/corruption.rs` includes this file with `#[path]`), so a crash found by fuzzing and
//! saved under `fuzz/regressions/<target>/` is replayed by `cargo test` forever after.
//!
//! Every `check_*` function takes arbitrary bytes and panics when an invariant is broken;
//! returning normally means the input was handled correctly (accepted or rejected with a
//! typed error).
#![allow(dead_code, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use zarrckpt::model::copy::copy_region;
use zarrckpt::plan::RankLayout;
use zarrckpt::storage::StorageError;
use zarrckpt::storage::footer::SaveId;
use zarrckpt::storage::meta::{CheckpointMeta, tensor_path};
use zarrckpt::{
    Compression, DType, Error, LoadOptions, LoadTarget, LocalComm, Region, SaveOptions,
    ShardedTensor, TensorKey,
};

/// The names of the fuzz targets, which are also the folder names under `fuzz/seeds/` and
/// `fuzz/regressions/`.
pub const TARGETS: [&str; 6] = [
    "layout_decode",
    "root_metadata",
    "tensor_key",
    "shard_read",
    "shard_footer",
    "dcp_pickle",
];

/// Runs the check of target `name` on `data`.
pub fn check(name: &str, data: &[u8]) {
    match name {
        "layout_decode" => check_layout_decode(data),
        "root_metadata" => check_root_metadata(data),
        "tensor_key" => check_tensor_key(data),
        "shard_read" => check_shard_read(data),
        "shard_footer" => check_shard_footer(data),
        "dcp_pickle" => check_dcp_pickle(data),
        other => panic!("unknown fuzz target {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// layout_decode
// ---------------------------------------------------------------------------------------------

/// `RankLayout::decode` never panics; what it accepts is valid and round-trips; its errors
/// name the sending rank and a position inside the input.
pub fn check_layout_decode(data: &[u8]) {
    const RANK: usize = 7;
    match RankLayout::decode(data, RANK) {
        Ok(layout) => {
            for t in &layout.tensors {
                TensorKey::new(t.key.as_str()).expect("decoded keys are valid");
                assert!(t.global_shape.len() <= zarrckpt::model::region::MAX_DIMS);
                zarrckpt::model::region::num_elements(&t.global_shape)
                    .expect("decoded shapes do not overflow");
            }
            for piece in &layout.pieces {
                let t = layout
                    .tensors
                    .get(piece.tensor as usize)
                    .expect("piece refers to a declared tensor");
                piece
                    .region
                    .check_within(&t.global_shape)
                    .expect("decoded pieces lie inside their tensor");
            }
            let again =
                RankLayout::decode(&layout.encode(), RANK).expect("re-encoded layout decodes");
            assert_eq!(again, layout, "layout does not round-trip");
        }
        Err(e) => {
            assert_eq!(e.rank, RANK);
            assert!(
                e.at <= data.len(),
                "error position {} past the input ({} bytes)",
                e.at,
                data.len()
            );
            let msg = e.to_string();
            assert!(msg.contains(&format!("rank {RANK}")), "{msg}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// root_metadata
// ---------------------------------------------------------------------------------------------

/// `CheckpointMeta::from_root_json` never panics; what it accepts has paths that follow the
/// key mapping (so never escape the checkpoint), consistent geometry, and round-trips; its
/// errors name the file.
pub fn check_root_metadata(data: &[u8]) {
    let path = Path::new("/fuzz/ckpt/zarr.json");
    match CheckpointMeta::from_root_json(data, path) {
        Ok(meta) => {
            for (key, e) in &meta.tensors {
                assert_eq!(e.path, tensor_path(key));
                assert!(!e.path.starts_with('/'));
                for seg in e.path.split('/') {
                    assert!(
                        !seg.is_empty() && seg != "." && seg != "..",
                        "bad segment in {:?}",
                        e.path
                    );
                }
                let n = e.shape.len();
                assert!(e.chunk_shape.len() == n && e.subchunk_shape.len() == n);
                for d in 0..n {
                    assert!(e.subchunk_shape[d] > 0 && e.chunk_shape[d] % e.subchunk_shape[d] == 0);
                }
                zarrckpt::model::region::num_bytes(&e.shape, e.dtype.size())
                    .expect("accepted shape fits");
                zarrckpt::model::region::num_bytes(&e.chunk_shape, e.dtype.size())
                    .expect("accepted chunk fits");
            }
            let again = CheckpointMeta::from_root_json(&meta.to_root_json(), path)
                .expect("written metadata parses");
            assert_eq!(again, meta, "root metadata does not round-trip");
        }
        Err(e) => {
            assert!(
                matches!(
                    e,
                    StorageError::Malformed { .. }
                        | StorageError::NotACheckpoint { .. }
                        | StorageError::UnsupportedVersion { .. }
                ),
                "unexpected error variant: {e:?}"
            );
            let msg = e.to_string();
            assert!(
                msg.contains("/fuzz/ckpt"),
                "error does not name the file: {msg}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// tensor_key
// ---------------------------------------------------------------------------------------------

fn unescape(segment: &str) -> Vec<u8> {
    let b = segment.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'~' {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).expect("escape is ASCII");
            out.push(u8::from_str_radix(hex, 16).expect("escape is hex"));
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn check_one_key(raw: &str) -> Option<TensorKey> {
    let key = match TensorKey::new(raw) {
        Ok(k) => k,
        Err(e) => {
            let _ = e.to_string();
            return None;
        }
    };
    assert_eq!(key.as_str(), raw);
    let path = key.node_path();
    let segs: Vec<&str> = path.split('/').collect();
    assert_eq!(
        segs.len(),
        raw.split('/').count(),
        "segment count changed: {raw:?} -> {path:?}"
    );
    for (seg, orig) in segs.iter().zip(raw.split('/')) {
        assert!(
            !seg.is_empty() && *seg != "." && *seg != "..",
            "{raw:?} -> {path:?}"
        );
        assert!(
            !seg.starts_with("__"),
            "reserved prefix: {raw:?} -> {path:?}"
        );
        assert!(
            !seg.eq_ignore_ascii_case("zarr.json"),
            "metadata file name: {raw:?} -> {path:?}"
        );
        assert!(
            seg.len() <= zarrckpt::model::key::MAX_SEGMENT_BYTES,
            "{raw:?}"
        );
        assert!(
            seg.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'~')),
            "{raw:?} -> {path:?}"
        );
        assert_eq!(
            unescape(seg),
            orig.as_bytes(),
            "mapping is not invertible: {raw:?} -> {path:?}"
        );
    }
    // The path resolves inside the tensors group.
    let p = Path::new("tensors").join(&path);
    let mut depth = 0i64;
    for c in p.components() {
        match c {
            std::path::Component::Normal(_) => depth += 1,
            other => panic!("{raw:?} -> {path:?}: component {other:?}"),
        }
    }
    assert!(depth >= 2);
    Some(key)
}

/// `TensorKey::new` never panics; accepted keys map to node paths made of plain or escaped
/// bytes, with no empty, `.` or `..` segment, no reserved `__` prefix, that invert back to
/// the key. The input split at its first 0xFF byte gives two keys: when
/// `check_collisions` accepts them, their paths must differ even ignoring case and neither
/// may be an ancestor of the other.
pub fn check_tensor_key(data: &[u8]) {
    let (a, b) = match data.iter().position(|&x| x == 0xff) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    };
    let ka = std::str::from_utf8(a).ok().and_then(check_one_key);
    let kb = b
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(check_one_key);
    if let (Some(ka), Some(kb)) = (ka, kb) {
        let collides = zarrckpt::model::key::check_collisions([&ka, &kb]).is_err();
        let (pa, pb) = (ka.node_path(), kb.node_path());
        if ka != kb {
            assert_ne!(pa, pb, "mapping not injective: {ka:?} {kb:?}");
        }
        if !collides && ka != kb {
            assert_ne!(
                pa.to_lowercase(),
                pb.to_lowercase(),
                "case collision missed: {ka:?} {kb:?}"
            );
            // Neither is an ancestor of the other, even ignoring case.
            let (la, lb) = (pa.to_lowercase(), pb.to_lowercase());
            assert!(
                !lb.starts_with(&format!("{la}/")) && !la.starts_with(&format!("{lb}/")),
                "group collision missed: {ka:?} {kb:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// shard_read
// ---------------------------------------------------------------------------------------------

/// Shape of the fuzzed tensor `a` (float32), saved as two pieces of 4 rows.
pub const SHAPE: [u64; 2] = [8, 6];

/// A small real checkpoint for the shard target: `a` float32 [8, 6], two shards of [4, 6],
/// each of two [2, 6] subchunks.
pub struct Fixture {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// The tensor's bytes.
    pub data: Vec<u8>,
    /// The shard file the fuzzer replaces.
    pub shard: PathBuf,
    /// That shard's original bytes.
    pub pristine: Vec<u8>,
}

/// Deterministic tensor bytes.
#[must_use]
pub fn tensor_data() -> Vec<u8> {
    (0..SHAPE.iter().product::<u64>())
        .flat_map(|i| (i as f32 * 1.5 - 7.0).to_le_bytes())
        .collect()
}

/// Saves the fixture checkpoint under `root` with `compression`.
#[must_use]
pub fn make_fixture(root: &Path, compression: Compression) -> Fixture {
    let dir = root.join(format!("{compression:?}").to_lowercase());
    let data = tensor_data();
    let row = 6 * 4;
    let pieces: Vec<ShardedTensor> = (0..2u64)
        .map(|i| {
            let region = Region::new(vec![4 * i, 0], vec![4, 6]).unwrap();
            let bytes = &data[(4 * i) as usize * row..(4 * i + 4) as usize * row];
            ShardedTensor::new(
                TensorKey::new("a").unwrap(),
                DType::Float32,
                SHAPE.to_vec(),
                region,
                0,
                bytes,
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
    zarrckpt::save(&pieces, &dir, &LocalComm::single(), &opts).expect("fixture saves");
    let shard = dir.join("tensors/a/c.1.0");
    let pristine = std::fs::read(&shard).expect("fixture shard exists");
    Fixture {
        dir,
        data,
        shard,
        pristine,
    }
}

fn fixtures() -> &'static [Fixture; 2] {
    static F: OnceLock<[Fixture; 2]> = OnceLock::new();
    F.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("zarrckpt-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        [
            make_fixture(&root, Compression::None),
            make_fixture(&root, Compression::Zstd),
        ]
    })
}

/// The seed inputs of `shard_read`: each fixture's pristine shard behind its selector byte,
/// with and without the checksum fix-up; the footer carries [`PLACEHOLDER_ID`] in place of
/// the fixture's random save id (see [`check_shard_read`]).
#[must_use]
pub fn shard_seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for fix in [0u8, 2] {
        for (i, f) in fixtures().iter().enumerate() {
            let mut v = vec![u8::try_from(i).unwrap() | fix];
            let mut shard = f.pristine.clone();
            swap_save_id(&mut shard, save_id_of(f), SaveId(PLACEHOLDER_ID));
            v.extend_from_slice(&shard);
            out.push(v);
        }
    }
    out
}

/// The save id stored seeds carry in their footers, replaced by the fixture's own (random)
/// save id before a shard is written, so that seeds stay valid across runs.
pub const PLACEHOLDER_ID: [u8; 16] = [0xAB; 16];

/// Length of the fixture shard's footer (2 dimensions, [`SUBCHUNKS`] subchunks).
pub const FOOTER: usize = 52 + 8 * 2 + 4 * SUBCHUNKS;

fn save_id_of(f: &Fixture) -> SaveId {
    zarrckpt::Checkpoint::open(&f.dir)
        .expect("fixture opens")
        .meta()
        .save_id
        .expect("fixture has a save id")
}

/// If the footer of `shard` carries `from` and its own crc32c is valid, puts `to` there and
/// recomputes the crc32c (anything else is left as it is).
pub fn swap_save_id(shard: &mut [u8], from: SaveId, to: SaveId) {
    let idx_len = SUBCHUNKS * 16 + 4;
    let Some(start) = shard.len().checked_sub(idx_len + FOOTER) else {
        return;
    };
    let foot = &mut shard[start..start + FOOTER];
    let (body, crc) = foot.split_at_mut(FOOTER - 4);
    if body[16..32] != from.0 || crc32c::crc32c(body).to_le_bytes() != *crc {
        return;
    }
    body[16..32].copy_from_slice(&to.0);
    crc.copy_from_slice(&crc32c::crc32c(body).to_le_bytes());
}

/// Rewrites the footer's subchunk crcs from the subchunks' stored crcs (0 for absent ones)
/// and its own crc32c; other footer fields keep the fuzzed bytes.
fn fix_footer(shard: &mut [u8]) {
    let idx_len = SUBCHUNKS * 16 + 4;
    let Some(start) = shard.len().checked_sub(idx_len + FOOTER) else {
        return;
    };
    let index_at = shard.len() - idx_len;
    for i in 0..SUBCHUNKS {
        let at = index_at + 16 * i;
        let off = u64::from_le_bytes(shard[at..at + 8].try_into().unwrap());
        let n = u64::from_le_bytes(shard[at + 8..at + 16].try_into().unwrap());
        let crc = match (usize::try_from(off), usize::try_from(n)) {
            (Ok(off), Ok(n)) if n >= 4 && off.checked_add(n).is_some_and(|e| e <= start) => {
                shard[off + n - 4..off + n].to_vec()
            }
            _ => vec![0; 4],
        };
        let c = start + 48 + 16 + 4 * i;
        shard[c..c + 4].copy_from_slice(&crc);
    }
    let crc = crc32c::crc32c(&shard[start..start + FOOTER - 4]);
    shard[start + FOOTER - 4..start + FOOTER].copy_from_slice(&crc.to_le_bytes());
}

/// What zarrs itself reads for the whole tensor (the oracle for accepted shards).
fn zarrs_read(dir: &Path) -> Option<Vec<u8>> {
    use zarrs::array::Array;
    let store = Arc::new(zarrs::filesystem::FilesystemStore::new(dir).ok()?);
    let array = Array::open(store, "/tensors/a").ok()?;
    let v: Vec<f32> = array.retrieve_array_subset(&array.subset_all()).ok()?;
    Some(v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// Loads the whole of `a` from `dir`.
pub fn load_a(dir: &Path) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; tensor_data().len()];
    let mut t = [LoadTarget::new(
        TensorKey::new("a").unwrap(),
        DType::Float32,
        SHAPE.to_vec(),
        Region::full(&SHAPE),
        &mut buf,
    )
    .unwrap()];
    zarrckpt::load(
        &mut t,
        dir,
        &LocalComm::single(),
        &LoadOptions {
            io_threads: 1,
            ..Default::default()
        },
    )?;
    Ok(buf)
}

/// Asserts `e` is a typed storage error about `file`.
pub fn assert_names_file(e: &Error, file: &Path) {
    let ok = matches!(
        e,
        Error::Storage(
            StorageError::Checksum { .. }
                | StorageError::CorruptChunk { .. }
                | StorageError::MissingChunk { .. }
                | StorageError::Zarr { .. }
                | StorageError::Io { .. }
        )
    );
    assert!(ok, "unexpected error variant: {e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(file.to_str().unwrap()),
        "error does not name {}: {msg}",
        file.display()
    );
}

/// Subchunks per shard of the fixture.
pub const SUBCHUNKS: usize = 2;

/// Recomputes, in place, the crc32c of the index at the end of `shard`, of every subchunk its
/// entries point at (inside the data), and the footer's subchunk crcs and own crc32c, so that
/// fuzzed bytes get past the checksums and reach the footer's field checks, the index
/// geometry checks and the decompressors behind them.
pub fn fix_checksums(shard: &mut [u8]) {
    fix_index_and_subchunks(shard);
    fix_footer(shard);
}

fn fix_index_and_subchunks(shard: &mut [u8]) {
    let idx_len = SUBCHUNKS * 16 + 4;
    let Some(data_end) = shard.len().checked_sub(idx_len) else {
        return;
    };
    for i in 0..SUBCHUNKS {
        let at = data_end + 16 * i;
        let off = u64::from_le_bytes(shard[at..at + 8].try_into().unwrap());
        let n = u64::from_le_bytes(shard[at + 8..at + 16].try_into().unwrap());
        let (Ok(off), Ok(n)) = (usize::try_from(off), usize::try_from(n)) else {
            continue;
        };
        match off.checked_add(n) {
            Some(end) if end <= data_end && n >= 4 => {
                let crc = crc32c::crc32c(&shard[off..end - 4]);
                shard[end - 4..end].copy_from_slice(&crc.to_le_bytes());
            }
            _ => {}
        }
    }
    let crc = crc32c::crc32c(&shard[data_end..data_end + SUBCHUNKS * 16]);
    shard[data_end + SUBCHUNKS * 16..].copy_from_slice(&crc.to_le_bytes());
}

/// Replaces the fixture's second shard (rows 4..8) with `data[1..]` and loads the whole
/// tensor. `data[0]`: bit 0 picks the uncompressed or zstd checkpoint; bit 1 has the harness
/// fix up every checksum first ([`fix_checksums`]). The load must not panic or abort; an
/// error must be a storage error naming the shard file; success must give the first shard's
/// rows intact and the rows zarrs itself decodes from the replaced shard. `verify` must report
/// a problem naming the shard file exactly when the load fails.
pub fn check_shard_read(data: &[u8]) {
    let Some((&sel, bytes)) = data.split_first() else {
        return;
    };
    let f = &fixtures()[usize::from(sel & 1)];
    let mut fixed = bytes.to_vec();
    swap_save_id(&mut fixed, SaveId(PLACEHOLDER_ID), save_id_of(f));
    if sel & 2 != 0 {
        fix_checksums(&mut fixed);
    }
    let bytes = fixed.as_slice();
    std::fs::write(&f.shard, bytes).unwrap();
    let result = load_a(&f.dir);
    // `verify` reads the same subchunks by its own bounded path: it must find a problem
    // exactly when the load fails, and name the shard file.
    let report = zarrckpt::Checkpoint::open(&f.dir)
        .expect("the index is untouched")
        .verify(1, None)
        .expect("verify runs");
    assert_eq!(
        report.problems.is_empty(),
        result.is_ok(),
        "verify and load disagree: load {result:?}, verify {:?}",
        report.problems
    );
    for p in &report.problems {
        assert_names_file(&p.error, &f.shard);
    }
    match result {
        Ok(got) => {
            let half = got.len() / 2;
            assert_eq!(
                got[..half],
                f.data[..half],
                "the untouched shard's rows changed"
            );
            let oracle = zarrs_read(&f.dir).expect("zarrckpt accepted a shard zarrs rejects");
            assert_eq!(
                got, oracle,
                "zarrckpt and zarrs disagree on an accepted shard"
            );
            if bytes == f.pristine.as_slice() {
                assert_eq!(got, f.data);
            }
        }
        Err(e) => {
            assert_ne!(
                bytes,
                f.pristine.as_slice(),
                "the pristine shard failed to load: {e}"
            );
            assert_names_file(&e, &f.shard);
        }
    }
}

/// A copy of `src` (a directory tree) at `dst`.
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).unwrap();
        }
    }
}

/// The bytes of `region` cut from a full C-order tensor of `shape`.
#[must_use]
pub fn cut(full: &[u8], shape: &[u64], region: &Region, elem: usize) -> Vec<u8> {
    let n: u64 = region.shape().iter().product();
    let mut out = vec![0u8; usize::try_from(n).unwrap() * elem];
    copy_region(full, &Region::full(shape), &mut out, region, region, elem);
    out
}

// ---------------------------------------------------------------------------------------------
// shard_footer
// ---------------------------------------------------------------------------------------------

/// `zarrckpt::storage::footer::check` on arbitrary bytes. `data[0]`: bits 0-1 the number of
/// dimensions of the expected chunk `[1, 2, 3][..n]`; bit 7 has the harness recompute the
/// footer's own crc32c (so mutations reach the field checks); bit 6 writes the expected key
/// hash. Expected: save id [`PLACEHOLDER_ID`], key `k`, subchunk count from the length. Never
/// panics; an accepted footer is exactly the encoding of what it was checked against.
pub fn check_shard_footer(data: &[u8]) {
    use zarrckpt::storage::footer;
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let ndim = usize::from(sel & 3);
    let chunk = &[1u64, 2, 3][..ndim];
    let key = TensorKey::new("k").unwrap();
    let mut bytes = rest.to_vec();
    if sel & 0x40 != 0 && bytes.len() >= 40 {
        bytes[32..40].copy_from_slice(&footer::key_hash(&key).to_le_bytes());
    }
    if sel & 0x80 != 0 && bytes.len() >= 4 {
        let n = bytes.len() - 4;
        let crc = crc32c::crc32c(&bytes[..n]);
        bytes[n..].copy_from_slice(&crc.to_le_bytes());
    }
    let fixed = 52 + 8 * ndim;
    let n_sub = bytes.len().saturating_sub(fixed) as u64 / 4;
    if let Ok(crcs) = footer::check(&bytes, SaveId(PLACEHOLDER_ID), &key, chunk, n_sub) {
        assert_eq!(crcs.len() as u64, n_sub);
        assert_eq!(
            footer::encode(SaveId(PLACEHOLDER_ID), &key, chunk, &crcs),
            bytes,
            "an accepted footer is not the encoding of what it was checked against"
        );
    }
    // Any other expectation is refused.
    let _ = footer::check(&bytes, SaveId([0; 16]), &key, chunk, n_sub).map(|_| {
        panic!("a footer was accepted for another save id");
    });
}

/// `dcp_pickle`: arbitrary bytes as a DCP `.metadata` pickle, as a `torch.save` item (zip
/// archive) and as a bare pickle with the item allow-list: each is accepted or refused with a
/// typed error, never a panic, a hang or an unbounded allocation; and no accepted value holds
/// a global outside the allow-lists (`os`, `subprocess`, `builtins.eval`, ...).
pub fn check_dcp_pickle(data: &[u8]) {
    use zarrckpt::convert::dcp::{DcpMetadata, ItemValue, read_item};
    use zarrckpt::convert::pickle::{self, Value};
    let p = Path::new("fuzz");
    let _ = DcpMetadata::parse(p, data);
    if let Ok(ItemValue::Tensor {
        dtype,
        shape,
        data: bytes,
    }) = read_item(p, "x", data)
    {
        let n: u64 = shape.iter().product();
        assert_eq!(
            n * dtype.size() as u64,
            bytes.len() as u64,
            "tensor bytes match the shape"
        );
    }
    fn no_bad_global(v: &Value) {
        match v {
            Value::Global { module, .. } | Value::Object { module, .. } => {
                assert!(
                    module == "torch" || module == "collections" || module == "_codecs",
                    "a global of {module} accepted"
                );
            }
            _ => {}
        }
        match v {
            Value::List(x) | Value::Tuple(x) | Value::Set(x) | Value::FrozenSet(x) => {
                x.iter().for_each(no_bad_global);
            }
            Value::Dict(x) => x.iter().for_each(|(k, v)| {
                no_bad_global(k);
                no_bad_global(v);
            }),
            Value::Object { args, state, .. } => {
                args.iter().for_each(no_bad_global);
                if let Some(s) = state {
                    no_bad_global(s);
                }
            }
            Value::PersId(x) => no_bad_global(x),
            _ => {}
        }
    }
    let allow: pickle::AllowList<'_> = &[("torch", "*"), ("collections", "OrderedDict")];
    if let Ok(v) = pickle::read(data, allow) {
        no_bad_global(&v);
    }
    check_megatron_value(data);
}

/// A `torch.save` archive read as a Megatron object or `common.pt` is: the restricted reader
/// with the Megatron allow-list, then the encoder. Never panics; an encoding it returns is
/// well-formed (magic, a header of whole 8-byte words holding `{"value": ..., "buffers":
/// [...]}` padded with spaces, a body of whole 8-byte words).
pub fn check_megatron_value(data: &[u8]) {
    use zarrckpt::ObjectValue;
    use zarrckpt::convert::dcp::TorchSave;
    use zarrckpt::convert::megatron_value::{MEGATRON_ALLOW, encode};
    let p = Path::new("fuzz");
    let Ok(ts) = TorchSave::read(p, "x", data, MEGATRON_ALLOW) else {
        return;
    };
    if let Ok(ObjectValue::Bytes(b)) = encode(&ts, &ts.value, p, "x", "value") {
        assert_eq!(&b[..8], b"ZCKPTMG\x01");
        let n = usize::try_from(u64::from_le_bytes(b[8..16].try_into().unwrap())).unwrap();
        assert_eq!(n % 8, 0, "header padded to 8 bytes");
        assert_eq!((b.len() - 16 - n) % 8, 0, "buffers padded to 8 bytes");
        let h = std::str::from_utf8(&b[16..16 + n]).expect("an ASCII header");
        let h = h.trim_end_matches(' ');
        assert!(
            h.is_ascii() && h.starts_with("{\"value\": ") && h.ends_with("]}"),
            "{h}"
        );
        assert!(h.contains("\"buffers\": ["), "{h}");
    }
}
