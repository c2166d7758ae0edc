//! Save with one topology, load with another, in-process ranks; every test on a local
//! directory, `memory://` and `s3://` (SeaweedFS), see `tests/common/target.rs`: loaded bytes
//! equal the original data on each, and the objects saved to a store equal, byte for byte,
//! the files of the same save to a local directory.

mod common;

use std::time::Duration;

use common::{cut, piece, tensor_bytes};
use zarrckpt::comm::run_local;
use zarrckpt::{
    DType, LoadOptions, LoadTarget, Region, SaveOptions, ShardedTensor, TensorKey, load, save,
};

struct Spec {
    key: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    axis: usize,
}

fn specs() -> Vec<Spec> {
    vec![
        Spec {
            key: "decoder.layers.0.mlp.linear_fc1.weight",
            dtype: DType::BFloat16,
            shape: vec![512, 384],
            axis: 0,
        },
        Spec {
            key: "decoder.layers.0.self_attention.linear_proj.weight",
            dtype: DType::Float32,
            shape: vec![256, 300],
            axis: 1,
        },
        Spec {
            key: "embedding.word_embeddings.weight",
            dtype: DType::Float16,
            shape: vec![1001, 64],
            axis: 0,
        },
        Spec {
            key: "decoder.final_layernorm.weight",
            dtype: DType::Float32,
            shape: vec![384],
            axis: 0,
        },
        Spec {
            key: "optimizer/step",
            dtype: DType::Int64,
            shape: vec![],
            axis: 0,
        },
        Spec {
            key: "fp8/e4m3",
            dtype: DType::Float8E4M3FN,
            shape: vec![64, 33],
            axis: 0,
        },
        Spec {
            key: "fp8/e5m2",
            dtype: DType::Float8E5M2,
            shape: vec![7, 5, 3],
            axis: 2,
        },
        Spec {
            key: "mask",
            dtype: DType::Bool,
            shape: vec![10],
            axis: 0,
        },
        Spec {
            key: "empty",
            dtype: DType::UInt16,
            shape: vec![0, 4],
            axis: 1,
        },
    ]
}

fn save_ranks(dir: &std::path::Path, n: u64) {
    let specs = specs();
    let fulls: Vec<Vec<u8>> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| tensor_bytes(i as u64, &s.shape, s.dtype))
        .collect();
    let results = run_local(n as usize, Duration::from_secs(30), |comm| {
        let r = zarrckpt::Communicator::rank(&comm) as u64;
        let mut datas = Vec::new();
        let mut regions = Vec::new();
        for (s, full) in specs.iter().zip(&fulls) {
            let region = if s.shape.is_empty() {
                Region::full(&[])
            } else {
                piece(&s.shape, s.axis, n, r)
            };
            datas.push(cut(full, &s.shape, &region, s.dtype.size()));
            regions.push(region);
        }
        let pieces: Vec<ShardedTensor> = specs
            .iter()
            .zip(&datas)
            .zip(&regions)
            .map(|((s, d), region)| {
                let replica = if s.shape.is_empty() && r != 0 { 1 } else { 0 };
                ShardedTensor::new(
                    TensorKey::new(s.key).unwrap(),
                    s.dtype,
                    s.shape.clone(),
                    region.clone(),
                    replica,
                    d,
                )
                .unwrap()
            })
            .collect();
        save(&pieces, dir, &comm, &SaveOptions::default())
    });
    for r in results {
        r.unwrap();
    }
}

/// Loads `regions` (one per spec) on this rank, checks every byte against the original data
/// and returns the report.
fn load_and_check(
    comm: &zarrckpt::LocalComm,
    dir: &std::path::Path,
    regions: &[Region],
    opts: &LoadOptions,
) -> zarrckpt::LoadReport {
    let specs = specs();
    let r = zarrckpt::Communicator::rank(comm);
    let mut bufs: Vec<Vec<u8>> = specs
        .iter()
        .zip(regions)
        .map(|(s, reg)| vec![0xAA; reg.shape().iter().product::<u64>() as usize * s.dtype.size()])
        .collect();
    let mut targets: Vec<LoadTarget> = specs
        .iter()
        .zip(regions)
        .zip(bufs.iter_mut())
        .map(|((s, reg), b)| {
            LoadTarget::new(
                TensorKey::new(s.key).unwrap(),
                s.dtype,
                s.shape.clone(),
                reg.clone(),
                b,
            )
            .unwrap()
        })
        .collect();
    let report = load(&mut targets, dir, comm, opts).unwrap();
    drop(targets);
    // The load says where its time went: planning, reading (read calls and checksums of
    // its reading threads) whenever it read anything, on a local directory and on an object
    // store alike (there the read calls are the ranged gets).
    let p = report.phases;
    assert!(p.plan > Duration::ZERO, "{p:?}");
    if report.bytes_read > 0 {
        assert!(p.read > Duration::ZERO, "{p:?}");
        assert!(p.io.open > Duration::ZERO, "{p:?}");
        assert!(p.io.read > Duration::ZERO, "{p:?}");
        assert!(p.io.checksum > Duration::ZERO, "{p:?}");
    }
    for (i, ((s, reg), b)) in specs.iter().zip(regions).zip(&bufs).enumerate() {
        let full = tensor_bytes(i as u64, &s.shape, s.dtype);
        assert_eq!(
            b,
            &cut(&full, &s.shape, reg, s.dtype.size()),
            "{} rank {r} {opts:?}",
            s.key
        );
    }
    report
}

fn load_ranks(dir: &std::path::Path, n: u64) {
    let specs = specs();
    let results = run_local(n as usize, Duration::from_secs(30), |comm| {
        let r = zarrckpt::Communicator::rank(&comm) as u64;
        // load along a different axis where possible
        let regions: Vec<Region> = specs
            .iter()
            .map(|s| {
                if s.shape.is_empty() {
                    Region::full(&[])
                } else {
                    let axis = s.shape.len() - 1 - s.axis.min(s.shape.len() - 1);
                    piece(&s.shape, axis, n, r)
                }
            })
            .collect();
        load_and_check(&comm, dir, &regions, &LoadOptions::default())
    });
    assert_eq!(results.len(), n as usize);
}

on_targets! {
    fn four_save_three_load_every_dtype(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save_ranks(&dir, 4);
        load_ranks(&dir, 3);
        load_ranks(&dir, 1);
        load_ranks(&dir, 5);
        if target.is_remote() {
            let local = tmp.path().join("local");
            save_ranks(&local, 4);
            common::target::assert_same_files(target, &dir, &local);
        }
    }
}

on_targets! {
    /// Data-parallel replicas asking for the same boxes: with exchange on, every shard box is read
    /// from storage once per group and sent to the others; with it off each rank reads its own.
    fn data_parallel_load_reads_once_and_shares(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save_ranks(&dir, 4);
        let specs = specs();
        let (tp, dp) = (3u64, 3u64);
        let mut reads = Vec::new();
        for exchange in [true, false] {
            let reports = run_local((tp * dp) as usize, Duration::from_secs(30), |comm| {
                let r = zarrckpt::Communicator::rank(&comm) as u64;
                let tp_rank = r % tp;
                let regions: Vec<Region> = specs
                    .iter()
                    .map(|s| {
                        if s.shape.is_empty() {
                            Region::full(&[])
                        } else {
                            piece(&s.shape, s.shape.len() - 1, tp, tp_rank)
                        }
                    })
                    .collect();
                let opts = LoadOptions {
                    exchange,
                    io_threads: 1,
                    ..LoadOptions::default()
                };
                load_and_check(&comm, &dir, &regions, &opts)
            });
            let read: u64 = reports.iter().map(|r| r.bytes_read).sum();
            let loaded: u64 = reports.iter().map(|r| r.loaded_bytes).sum();
            let received: u64 = reports.iter().map(|r| r.bytes_received).sum();
            let sent: u64 = reports.iter().map(|r| r.bytes_sent).sum();
            assert_eq!(sent, received);
            if exchange {
                // Every rank but the reader of each box receives it: about (dp-1)/dp of the bytes.
                assert!(
                    received * dp > loaded * (dp - 1) * 9 / 10,
                    "received {received} of {loaded}"
                );
            } else {
                assert_eq!(received, 0);
                assert!(read >= loaded, "read {read} for {loaded}");
            }
            reads.push(read);
        }
        // Each shared box is read once per data-parallel group instead of dp times (the unshared
        // scalar is read by every rank either way).
        assert!(
            reads[0] * dp <= reads[1] + reads[1] / 20,
            "with exchange {} vs without {}",
            reads[0],
            reads[1]
        );
    }
}

on_targets! {
    fn whole_tensors_as_ndarrays(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save_ranks(&dir, 2);
        let ckpt = zarrckpt::Checkpoint::open(&dir).unwrap();
        let key = TensorKey::new("decoder.layers.0.self_attention.linear_proj.weight").unwrap();
        let a = ckpt.read_ndarray::<f32>(&key).unwrap();
        assert_eq!(a.shape(), &[256, 300]);
        let expect = tensor_bytes(1, &[256, 300], DType::Float32);
        let got: Vec<u8> = a.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(got, expect);
        let step = ckpt
            .read_ndarray::<i64>(&TensorKey::new("optimizer/step").unwrap())
            .unwrap();
        assert_eq!(step.ndim(), 0);
        let e = ckpt.read_ndarray::<f64>(&key).unwrap_err();
        assert!(matches!(e, zarrckpt::Error::DtypeMismatch { .. }), "{e}");
    }
}
