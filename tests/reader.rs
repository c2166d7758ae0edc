//! The local reader ([`zarrckpt::load::Reader`], behind [`Checkpoint::read_region`] and
//! [`Checkpoint::read_tensor`]): no communicator anywhere on its path.
//!
//! - Random boxes of a checkpoint saved by 3 ranks (resharded on read: the boxes cut across
//!   the saved pieces and shard files) read the same bytes through the reader as through the
//!   collective `load`, uncompressed and compressed, and as the data that was saved.
//! - A second read of an array does not open its `zarr.json` again: the reader counts one
//!   open per array, and a read after the array's `zarr.json` is deleted still succeeds.
//! - One reader serves reads from several threads at once (it is `Sync`; nothing collective
//!   to wait on).
//! - `Checkpoint::read_region`, `read_tensor` and a Hugging Face export start no collective
//!   step (`zarrckpt::load::collective_steps` stays put), while a collective `load` does.
//!
//! Those four run on a local directory, `memory://` and `s3://` (SeaweedFS; see
//! `tests/common/target.rs`); the tests that delete or damage files in place stay on the local
//! file system (`tests/s3_read.rs` damages objects on the stores).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{cut, tensor_bytes};
use zarrckpt::comm::run_local;
use zarrckpt::convert::{self, Inventory, Layout, Table};
use zarrckpt::load::{Reader, collective_steps};
use zarrckpt::{
    Checkpoint, Communicator, Compression, DType, GridOptions, LoadOptions, LoadTarget, LocalComm,
    Region, SaveOptions, ShardedTensor, TensorKey, load, save,
};

const T: Duration = Duration::from_secs(60);

/// (key, dtype, shape, axis split over the saving ranks).
const TENSORS: &[(&str, DType, &[u64], usize)] = &[
    ("w", DType::Float32, &[37, 23], 0),
    ("e", DType::UInt16, &[5, 7, 11], 2),
    ("b", DType::Float64, &[29], 0),
];

fn full(i: usize) -> Vec<u8> {
    let (_, dt, shape, _) = TENSORS[i];
    tensor_bytes(i as u64 + 7, shape, dt)
}

/// Saves every tensor split over 3 ranks along its axis, with small shard files and
/// subchunks so that a box spans several of each.
fn save3(dir: &Path, compression: Compression) {
    let res = run_local(3, T, |comm| {
        let r = comm.rank() as u64;
        let datas: Vec<(Region, Vec<u8>)> = (0..TENSORS.len())
            .map(|i| {
                let (_, dt, shape, axis) = TENSORS[i];
                let region = common::piece(shape, axis, 3, r);
                let d = cut(&full(i), shape, &region, dt.size());
                (region, d)
            })
            .collect();
        let pieces: Vec<ShardedTensor> = datas
            .iter()
            .enumerate()
            .map(|(i, (region, d))| {
                let (k, dt, shape, _) = TENSORS[i];
                ShardedTensor::new(
                    TensorKey::new(k).unwrap(),
                    dt,
                    shape.to_vec(),
                    region.clone(),
                    0,
                    d,
                )
                .unwrap()
            })
            .collect();
        let opts = SaveOptions {
            compression,
            grid: GridOptions {
                subchunk_target_bytes: 64,
                min_chunk_bytes: 256,
            },
            ..SaveOptions::default()
        };
        save(&pieces, dir, &comm, &opts)
    });
    for r in res {
        r.unwrap();
    }
}

/// A deterministic pseudo-random box of `shape` (never empty).
fn random_box(shape: &[u64], state: &mut u64) -> Region {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    };
    let (offset, size): (Vec<u64>, Vec<u64>) = shape
        .iter()
        .map(|&d| {
            let o = next() % d;
            let s = 1 + next() % (d - o);
            (o, s)
        })
        .unzip();
    Region::new(offset, size).unwrap()
}

fn check_against_load(target: common::target::Target, compression: Compression) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = target.path(tmp.path(), "ck");
    save3(&dir, compression);
    let ck = Checkpoint::open(&dir).unwrap();
    let mut state = 0x1234_5678_9abc_def1u64;
    for (i, &(k, dt, shape, _)) in TENSORS.iter().enumerate() {
        let key = TensorKey::new(k).unwrap();
        let whole = full(i);
        assert!(
            ck.tensor(&key).unwrap().num_chunks > 1,
            "{k}: several shard files"
        );
        for _ in 0..40 {
            let region = random_box(shape, &mut state);
            let n = region.shape().iter().product::<u64>() as usize * dt.size();
            let mut mine = vec![0u8; n];
            let rep = ck.read_region(&key, &region, &mut mine).unwrap();
            assert_eq!(rep.loaded_bytes, n as u64);
            assert!(rep.bytes_read > 0);
            let mut collective = vec![0u8; n];
            let mut t = [LoadTarget::new(
                key.clone(),
                dt,
                shape.to_vec(),
                region.clone(),
                &mut collective,
            )
            .unwrap()];
            load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap();
            assert_eq!(mine, collective, "{k} {region:?}: reader and load differ");
            assert_eq!(
                mine,
                cut(&whole, shape, &region, dt.size()),
                "{k} {region:?}: not the saved data"
            );
        }
        assert_eq!(ck.read_tensor(&key).unwrap(), whole, "{k}: whole tensor");
    }
    // Every array opened once, however many boxes were read.
    assert_eq!(ck.reader().arrays_opened(), TENSORS.len() as u64);
}

on_targets! {
    fn reader_reads_what_collective_load_reads_uncompressed(target: Target) {
        check_against_load(target, Compression::None);
    }
}

on_targets! {
    fn reader_reads_what_collective_load_reads_zstd(target: Target) {
        check_against_load(target, Compression::Zstd);
    }
}

#[test]
fn second_read_does_not_reopen_zarr_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save3(&dir, Compression::None);
    let reader = Reader::open(&dir).unwrap();
    assert_eq!(reader.arrays_opened(), 0, "opening reads only the index");
    let key = TensorKey::new("w").unwrap();
    let region = Region::new(vec![3, 4], vec![20, 9]).unwrap();
    let mut a = vec![0u8; 20 * 9 * 4];
    reader.read_region(&key, &region, &mut a).unwrap();
    assert_eq!(reader.arrays_opened(), 1);
    // The array's zarr.json is gone: a second read does not need it.
    let entry = &reader.meta().tensors[&key];
    std::fs::remove_file(dir.join(&entry.path).join("zarr.json")).unwrap();
    let mut b = vec![0u8; a.len()];
    reader.read_region(&key, &region, &mut b).unwrap();
    assert_eq!(a, b);
    assert_eq!(reader.arrays_opened(), 1, "no second open of `w`");
    // A fresh reader does need it, and says which file is missing.
    let fresh = Reader::open(&dir).unwrap();
    let e = fresh.read_region(&key, &region, &mut b).unwrap_err();
    assert!(e.to_string().contains("zarr.json"), "{e}");
    // Another array is opened on its own first read.
    let mut e_buf = vec![0u8; 5 * 7 * 11 * 2];
    reader
        .read_region(
            &TensorKey::new("e").unwrap(),
            &Region::full(&[5, 7, 11]),
            &mut e_buf,
        )
        .unwrap();
    assert_eq!(reader.arrays_opened(), 2);
    assert_eq!(e_buf, full(1));
}

on_targets! {
    fn one_reader_serves_several_threads(target: Target) {
        fn is_sync<S: Sync + Send>(_: &S) {}
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ck");
        save3(&dir, Compression::Zstd);
        let ck = Checkpoint::open(&dir).unwrap();
        is_sync(ck.reader());
        let whole = full(0);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let ck = &ck;
                let whole = &whole;
                s.spawn(move || {
                    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
                    for _ in 0..25 {
                        let region = random_box(&[37, 23], &mut state);
                        let mut buf = vec![0u8; region.shape().iter().product::<u64>() as usize * 4];
                        ck.read_region(&TensorKey::new("w").unwrap(), &region, &mut buf)
                            .unwrap();
                        assert_eq!(buf, cut(whole, &[37, 23], &region, 4));
                    }
                });
            }
        });
        assert_eq!(ck.reader().arrays_opened(), 1);
    }
}

on_targets! {
    fn reader_refuses_wrong_dtype_shape_and_absent_key(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ck");
        save3(&dir, Compression::None);
        let reader = Reader::open(&dir).unwrap();
        let mut buf = vec![0u8; 37 * 23 * 8];
        let t = LoadTarget::new(
            TensorKey::new("w").unwrap(),
            DType::Int64,
            vec![37, 23],
            Region::full(&[37, 23]),
            &mut buf,
        )
        .unwrap();
        let e = reader.read(&mut [t]).unwrap_err();
        assert!(matches!(e, zarrckpt::Error::DtypeMismatch { .. }), "{e:?}");
        let mut buf = vec![0u8; 37 * 24 * 4];
        let t = LoadTarget::new(
            TensorKey::new("w").unwrap(),
            DType::Float32,
            vec![37, 24],
            Region::full(&[37, 24]),
            &mut buf,
        )
        .unwrap();
        let e = reader.read(&mut [t]).unwrap_err();
        assert!(matches!(e, zarrckpt::Error::ShapeMismatch { .. }), "{e:?}");
        let e = reader
            .read_region(
                &TensorKey::new("absent").unwrap(),
                &Region::full(&[1]),
                &mut [0u8; 4],
            )
            .unwrap_err();
        assert!(matches!(e, zarrckpt::Error::UnexpectedKeys { .. }), "{e:?}");
        assert_eq!(reader.arrays_opened(), 0, "refused before opening anything");
    }
}

/// A Llama-style model (2 layers, hidden 16) saved in the Megatron layout at tensor
/// parallelism 2, as `tests/convert_hf.rs` builds it: (checkpoint dir, HF name -> bytes).
fn saved_megatron(dir: &Path) -> (serde_json::Value, BTreeMap<String, Vec<u8>>) {
    let c = serde_json::json!({"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 100,
           "tie_word_embeddings": false});
    let (h, f, v, hd) = (16u64, 24u64, 100u64, 4u64);
    let mut hf: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    hf.insert("model.embed_tokens.weight".into(), vec![v, h]);
    hf.insert("lm_head.weight".into(), vec![v, h]);
    hf.insert("model.norm.weight".into(), vec![h]);
    for i in 0..2 {
        let p = format!("model.layers.{i}.");
        hf.insert(format!("{p}input_layernorm.weight"), vec![h]);
        hf.insert(format!("{p}post_attention_layernorm.weight"), vec![h]);
        hf.insert(format!("{p}self_attn.q_proj.weight"), vec![4 * hd, h]);
        hf.insert(format!("{p}self_attn.k_proj.weight"), vec![2 * hd, h]);
        hf.insert(format!("{p}self_attn.v_proj.weight"), vec![2 * hd, h]);
        hf.insert(format!("{p}self_attn.o_proj.weight"), vec![h, 4 * hd]);
        hf.insert(format!("{p}mlp.gate_proj.weight"), vec![f, h]);
        hf.insert(format!("{p}mlp.up_proj.weight"), vec![f, h]);
        hf.insert(format!("{p}mlp.down_proj.weight"), vec![h, f]);
    }
    let inventory: Inventory = hf
        .iter()
        .map(|(k, s)| (k.clone(), ("bfloat16".to_string(), s.clone())))
        .collect();
    let data: BTreeMap<String, Vec<u8>> = hf
        .iter()
        .map(|(k, s)| {
            let seed = k
                .bytes()
                .fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
            let n: u64 = s.iter().product();
            let d = (0..n * 2)
                .map(|i| (seed.wrapping_mul(i + 1) >> 7) as u8)
                .collect();
            (k.clone(), d)
        })
        .collect();
    let t = Table::builtin("llama").unwrap();
    let layout = Layout {
        tp: 2,
        pp: 1,
        ep: 1,
    };
    let plan = convert::plan_megatron_import(&t, &c, layout, &inventory).unwrap();
    let src: Vec<&[u8]> = plan
        .sources
        .iter()
        .map(|s| data[&s.name].as_slice())
        .collect();
    let bufs: Vec<Vec<u8>> = (0..plan.dests.len())
        .map(|i| {
            let mut b = vec![0u8; plan.dests[i].nbytes() as usize];
            convert::fill_from_sources(&plan, i, &|k| src[k], &mut b).unwrap();
            b
        })
        .collect();
    let pieces: Vec<ShardedTensor> = plan
        .dests
        .iter()
        .zip(&bufs)
        .map(|(d, b)| {
            let r = Region::new(d.region.off.clone(), d.region.len.clone()).unwrap();
            ShardedTensor::new(
                TensorKey::new(&d.name).unwrap(),
                d.dtype,
                d.shape.clone(),
                r,
                0,
                b,
            )
            .unwrap()
        })
        .collect();
    save(&pieces, dir, &LocalComm::single(), &SaveOptions::default()).unwrap();
    (c, data)
}

on_targets! {
    /// `Checkpoint::read_region`, `read_tensor` and a Hugging Face export (planned by the
    /// library, filled through `fill_from_checkpoint`, as `zarrckpt export` does) start no
    /// collective step of the load engine, while a collective `load` of the same box on a
    /// one-process communicator does (so the count is live, and the test fails if reads are
    /// routed through the collective load again).
    fn checkpoint_reads_and_hf_export_make_no_collective_call(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ck");
        let (c, data) = saved_megatron(&dir);
        let before = collective_steps();
        let ck = Checkpoint::open(&dir).unwrap();
        let key = TensorKey::new("decoder.layers.self_attention.linear_qkv.weight").unwrap();
        let info = ck.tensor(&key).unwrap();
        let whole = ck.read_tensor(&key).unwrap();
        let region = Region::new(vec![0, 3, 2], vec![info.shape[0], 9, 11]).unwrap();
        let mut part = vec![0u8; info.shape[0] as usize * 9 * 11 * 2];
        ck.read_region(&key, &region, &mut part).unwrap();
        assert_eq!(part, cut(&whole, &info.shape, &region, 2));
        // HF export, every byte checked against the model that was imported.
        let inventory: Inventory = ck
            .tensors()
            .into_iter()
            .map(|t| (t.key.to_string(), (t.dtype.to_string(), t.shape)))
            .collect();
        let t = Table::builtin("llama").unwrap();
        let layout = Layout {
            tp: 2,
            pp: 1,
            ep: 1,
        };
        let ep = convert::plan_hf_export(&t, &c, layout, &inventory, 4000).unwrap();
        let mut exported = 0;
        for b in ep.batches() {
            let mut out: Vec<Vec<u8>> = ep.dests[b.clone()]
                .iter()
                .map(|d| vec![0u8; d.nbytes() as usize])
                .collect();
            let mut views: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
            convert::fill_from_checkpoint(&ck, &ep, b.clone(), &mut views).unwrap();
            for (d, o) in ep.dests[b].iter().zip(&out) {
                assert_eq!(o, &data[&d.name], "{}", d.name);
                exported += 1;
            }
        }
        assert_eq!(exported, data.len());
        assert_eq!(
            collective_steps(),
            before,
            "a checkpoint read or the export started a collective step"
        );
        // The same box through the collective load counts.
        let mut again = vec![0u8; part.len()];
        let mut targets = [LoadTarget::new(
            key.clone(),
            info.dtype,
            info.shape.clone(),
            region,
            &mut again,
        )
        .unwrap()];
        load(
            &mut targets,
            &dir,
            &LocalComm::single(),
            &LoadOptions::default(),
        )
        .unwrap();
        assert_eq!(again, part);
        assert!(
            collective_steps() > before,
            "the collective load is counted"
        );
    }
}

/// Column strips long enough to be read straight into place (runs of at least 1 KiB of a
/// box that cuts across the saved pieces): the reader and the collective load read the saved
/// bytes, and a flipped byte inside such a strip is a checksum error naming the tensor.
#[test]
fn column_strips_read_in_place_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let shape = [64u64, 4096];
    let data = tensor_bytes(11, &shape, DType::Float32);
    let res = run_local(2, T, |comm| {
        let r = comm.rank() as u64;
        let region = common::piece(&shape, 1, 2, r);
        let d = cut(&data, &shape, &region, 4);
        let p = ShardedTensor::new(
            TensorKey::new("strips").unwrap(),
            DType::Float32,
            shape.to_vec(),
            region,
            0,
            &d,
        )
        .unwrap();
        let opts = SaveOptions {
            grid: GridOptions {
                subchunk_target_bytes: 64 << 10,
                min_chunk_bytes: 1 << 10,
            },
            ..SaveOptions::default()
        };
        save(&[p], &dir, &comm, &opts)
    });
    for r in res {
        r.unwrap();
    }
    let key = TensorKey::new("strips").unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let info = ck.tensor(&key).unwrap();
    let sub = &info.subchunk_shape;
    assert!(
        sub[1] < shape[1] && sub[1] * 4 >= 1024,
        "column strips of at least 1 KiB a row: {sub:?}"
    );
    // Rows 0..64, columns cutting across both pieces: every subchunk inside is whole but
    // not contiguous in the box.
    let region = Region::new(vec![0, 0], vec![64, 4096]).unwrap();
    let want = cut(&data, &shape, &region, 4);
    let mut got = vec![0u8; want.len()];
    ck.read_region(&key, &region, &mut got).unwrap();
    assert_eq!(got, want);
    let region = Region::new(vec![0, sub[1]], vec![64, 2 * sub[1]]).unwrap();
    let want = cut(&data, &shape, &region, 4);
    let mut got = vec![0u8; want.len()];
    let mut t = [LoadTarget::new(
        key.clone(),
        DType::Float32,
        shape.to_vec(),
        region.clone(),
        &mut got,
    )
    .unwrap()];
    load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap();
    assert_eq!(got, want);
    // Flip one byte in the middle of the first shard's data.
    let entry = &ck.meta().tensors[&key];
    let mut files = Vec::new();
    let mut stack = vec![dir.join(&entry.path)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().unwrap() != "zarr.json" {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut bytes = std::fs::read(&files[0]).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&files[0], &bytes).unwrap();
    let fresh = Checkpoint::open(&dir).unwrap();
    let region = Region::new(vec![0, 0], vec![64, 4096]).unwrap();
    let mut got = vec![0u8; 64 * 4096 * 4];
    let e = fresh.read_region(&key, &region, &mut got).unwrap_err();
    assert!(
        e.to_string().contains("strips") && e.to_string().contains("crc32c"),
        "{e}"
    );
}

/// Subchunks larger than the 256 KiB pieces they are read and checksummed in (rows landing
/// contiguously): read back whole and in part, and a flipped byte in a later piece of a
/// subchunk is a checksum error.
#[test]
fn large_subchunks_are_checked_piece_by_piece() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let shape = [4096u64, 1024];
    let data = tensor_bytes(5, &shape, DType::Float32);
    let key = TensorKey::new("big").unwrap();
    let p = ShardedTensor::new(
        key.clone(),
        DType::Float32,
        shape.to_vec(),
        Region::full(&shape),
        0,
        &data,
    )
    .unwrap();
    let opts = SaveOptions {
        grid: GridOptions {
            subchunk_target_bytes: 1 << 20,
            min_chunk_bytes: 1 << 20,
        },
        ..SaveOptions::default()
    };
    save(&[p], &dir, &LocalComm::single(), &opts).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let info = ck.tensor(&key).unwrap();
    let sub_bytes = info.subchunk_shape.iter().product::<u64>() * 4;
    assert!(sub_bytes > 300 << 10, "subchunks of {sub_bytes} bytes");
    assert_eq!(ck.read_tensor(&key).unwrap(), data);
    let region = Region::new(
        vec![info.subchunk_shape[0], 0],
        vec![info.subchunk_shape[0], 1024],
    )
    .unwrap();
    let mut got = vec![0u8; (info.subchunk_shape[0] * 1024 * 4) as usize];
    ck.read_region(&key, &region, &mut got).unwrap();
    assert_eq!(got, cut(&data, &shape, &region, 4));
    // Flip a byte 300 KiB into the first subchunk's data (its second piece).
    let entry = &ck.meta().tensors[&key];
    let mut files = Vec::new();
    let mut stack = vec![dir.join(&entry.path)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().unwrap() != "zarr.json" {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut bytes = std::fs::read(&files[0]).unwrap();
    bytes[300 << 10] ^= 0x01;
    std::fs::write(&files[0], &bytes).unwrap();
    let e = Checkpoint::open(&dir)
        .unwrap()
        .read_tensor(&key)
        .unwrap_err();
    assert!(
        e.to_string().contains("big") && e.to_string().contains("crc32c"),
        "{e}"
    );
}

/// Column strips under 1 KiB a row (read through the scratch buffer and copied out): whole
/// and partial boxes cutting across the saved pieces read the saved bytes through the reader
/// and the collective load, and a byte flipped deep inside a strip (past its first 64 KiB),
/// or in its stored crc32c, is a checksum error naming the tensor.
#[test]
fn short_column_strips_through_scratch_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let shape = [1024u64, 2048];
    let data = tensor_bytes(13, &shape, DType::Float32);
    let key = TensorKey::new("bands").unwrap();
    let res = run_local(2, T, |comm| {
        let region = common::piece(&shape, 1, 2, comm.rank() as u64);
        let d = cut(&data, &shape, &region, 4);
        let p =
            ShardedTensor::new(key.clone(), DType::Float32, shape.to_vec(), region, 0, &d).unwrap();
        let opts = SaveOptions {
            grid: GridOptions {
                subchunk_target_bytes: 128 << 10,
                min_chunk_bytes: 1 << 10,
            },
            ..SaveOptions::default()
        };
        save(&[p], &dir, &comm, &opts)
    });
    for r in res {
        r.unwrap();
    }
    let ck = Checkpoint::open(&dir).unwrap();
    let sub = ck.tensor(&key).unwrap().subchunk_shape.clone();
    let sub_bytes = sub.iter().product::<u64>() * 4;
    assert!(
        sub[0] == shape[0] && sub[1] * 4 < 1024 && sub_bytes > 64 << 10,
        "column strips under 1 KiB a row, larger than 64 KiB: {sub:?}"
    );
    for region in [
        Region::new(vec![0, 0], vec![512, 2048]).unwrap(),
        Region::new(vec![7, 30], vec![493, 1470]).unwrap(),
        Region::new(vec![300, 1000], vec![212, 100]).unwrap(),
    ] {
        let want = cut(&data, &shape, &region, 4);
        let mut got = vec![0u8; want.len()];
        ck.read_region(&key, &region, &mut got).unwrap();
        assert_eq!(got, want, "reader, {region:?}");
        let mut got = vec![0u8; want.len()];
        let mut t = [LoadTarget::new(
            key.clone(),
            DType::Float32,
            shape.to_vec(),
            region.clone(),
            &mut got,
        )
        .unwrap()];
        load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap();
        assert_eq!(got, want, "load, {region:?}");
    }
    let entry = &ck.meta().tensors[&key];
    let mut files = Vec::new();
    let mut stack = vec![dir.join(&entry.path)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().unwrap() != "zarr.json" {
                files.push(p);
            }
        }
    }
    files.sort();
    let pristine = std::fs::read(&files[0]).unwrap();
    // A byte past the first 64 KiB of the first strip, then a byte of its stored crc32c.
    for at in [(96 << 10) + 5, usize::try_from(sub_bytes).unwrap() + 2] {
        let mut bytes = pristine.clone();
        bytes[at] ^= 0x40;
        std::fs::write(&files[0], &bytes).unwrap();
        let fresh = Checkpoint::open(&dir).unwrap();
        let region = Region::new(vec![0, 0], vec![512, 2048]).unwrap();
        let mut got = vec![0u8; 512 * 2048 * 4];
        let e = fresh.read_region(&key, &region, &mut got).unwrap_err();
        assert!(
            e.to_string().contains("bands") && e.to_string().contains("crc32c"),
            "byte {at}: {e}"
        );
    }
    std::fs::write(&files[0], &pristine).unwrap();
}
