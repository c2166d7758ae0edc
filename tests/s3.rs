//! Checkpoints on object stores: against a real S3 server on loopback (SeaweedFS, started here;
//! see `tests/common/s3.rs`) and the in-memory store. Round trips bit-identical to the local
//! path, the generation + pointer commit (two concurrent writers: exactly one commits; a
//! failed overwrite keeps the old checkpoint), multipart uploads, a rank's failure named on
//! every rank, gc, and the conditional-write probe (SeaweedFS passes, the JuiceFS gateway is
//! refused).

mod common;

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::s3;
use common::state::{self, RankState};
use zarrckpt::comm::run_local;
use zarrckpt::remote::{self, RemoteError, RemoteOptions, RemoteStore};
use zarrckpt::{Checkpoint, Communicator, Error, LocalComm, SaveOptions, save};

/// Save options writing to an object store through `ropts`.
fn remote_save_opts(ropts: &RemoteOptions, overwrite: bool) -> SaveOptions {
    SaveOptions {
        overwrite,
        remote: ropts.clone(),
        ..SaveOptions::default()
    }
}

/// Saves the test state of `step` with `world` in-process ranks straight to `url` (the
/// ordinary `save`, given the URL as its path).
fn save_state(
    url: &str,
    world: usize,
    step: u64,
    ropts: &RemoteOptions,
    overwrite: bool,
) -> Vec<zarrckpt::Result<String>> {
    let opts = remote_save_opts(ropts, overwrite);
    run_local(world, Duration::from_secs(60), |comm| {
        let st = RankState::new(world as u64, comm.rank() as u64, step);
        save(&st.sharded(), Path::new(url), &comm, &opts)?;
        committed_generation(url, ropts)
    })
}

/// The generation committed at `url`.
fn committed_generation(url: &str, ropts: &RemoteOptions) -> zarrckpt::Result<String> {
    let store = RemoteStore::open(url, ropts)?;
    Ok(remote::resolve(&store)?.generation)
}

fn round_trip(url: &str, ropts: &RemoteOptions) {
    for r in save_state(url, 2, 3, ropts, false) {
        r.unwrap();
    }
    let local = tempfile::tempdir().unwrap();
    let dir = local.path().join("ckpt");
    run_local(2, Duration::from_secs(60), |comm| {
        let st = RankState::new(2, comm.rank() as u64, 3);
        save(&st.sharded(), &dir, &comm, &SaveOptions::default()).unwrap();
    });
    let fetched = remote::fetch_url(url, ropts, None).unwrap();
    state::check(fetched.dir(), 3);
    common::target::same_tensors(fetched.dir(), &dir);
    let report = Checkpoint::open(fetched.dir())
        .unwrap()
        .verify(2, None)
        .unwrap();
    assert!(
        report.problems.is_empty() && report.chunks > 0,
        "{:?}",
        report.problems
    );
}

#[test]
fn s3_round_trip_is_bit_identical_to_local() {
    if s3::skipped("s3_round_trip_is_bit_identical_to_local") {
        return;
    }
    round_trip(&s3::url("round-trip"), &s3::options());
}

#[test]
fn memory_round_trip_is_bit_identical_to_local() {
    round_trip("memory://rt/a/b", &RemoteOptions::default());
}

#[test]
fn an_existing_checkpoint_is_kept_without_overwrite_and_replaced_with_it() {
    if s3::skipped("an_existing_checkpoint_is_kept_without_overwrite_and_replaced_with_it") {
        return;
    }
    let (url, ropts) = (s3::url("overwrite"), s3::options());
    let g1 = save_state(&url, 1, 1, &ropts, false).remove(0).unwrap();
    let e = save_state(&url, 1, 2, &ropts, false).remove(0).unwrap_err();
    assert!(
        matches!(e, Error::Remote(RemoteError::Exists { .. })),
        "{e}"
    );
    // A save that fails after it started writing (here: its deadline passed) commits
    // nothing and keeps the old checkpoint.
    let comm = LocalComm::single();
    let st = RankState::new(1, 0, 2);
    let late = SaveOptions {
        deadline: Some(Duration::ZERO),
        ..remote_save_opts(&ropts, true)
    };
    let failed = save(&st.sharded(), Path::new(&url), &comm, &late).unwrap_err();
    assert!(failed.to_string().contains("deadline"), "{failed}");
    assert!(
        failed.to_string().contains(&format!("{url}/generations/")),
        "{failed}"
    );
    state::check(remote::fetch_url(&url, &ropts, None).unwrap().dir(), 1);
    let g2 = save_state(&url, 2, 2, &ropts, true).remove(0).unwrap();
    assert!(g2 > g1);
    let f = remote::fetch_url(&url, &ropts, None).unwrap();
    assert_eq!(f.resolved().generation, g2);
    state::check(f.dir(), 2);
    // gc removes the old generation, keeps the committed one.
    let store = RemoteStore::open(&url, &ropts).unwrap();
    let report = remote::gc(&store, 1, false).unwrap();
    assert_eq!(report.removed, vec![g1.clone()]);
    assert_eq!(report.current.as_deref(), Some(g2.as_str()));
    assert!(store.list(&format!("generations/{g1}")).unwrap().is_empty());
    state::check(remote::fetch_url(&url, &ropts, None).unwrap().dir(), 2);
}

#[test]
fn two_concurrent_writers_exactly_one_commits() {
    if s3::skipped("two_concurrent_writers_exactly_one_commits") {
        return;
    }
    let ropts = s3::options();
    for round in 0..20u64 {
        let url = s3::url(&format!("race/{round}"));
        // Both writers read the (absent) pointer before either commits: they meet at a
        // barrier after their first shard is written (the progress callback), which is after
        // the pointer was read and before the commit.
        let barrier = Arc::new(Barrier::new(2));
        let results: Vec<zarrckpt::Result<String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u64)
                .map(|w| {
                    let (barrier, url, ropts) = (Arc::clone(&barrier), url.clone(), ropts.clone());
                    s.spawn(move || {
                        let met = std::sync::atomic::AtomicBool::new(false);
                        let b2 = Arc::clone(&barrier);
                        let opts = SaveOptions {
                            progress: Some(Arc::new(move |_| {
                                if !met.swap(true, std::sync::atomic::Ordering::SeqCst) {
                                    b2.wait();
                                }
                            })),
                            io_threads: 1,
                            ..remote_save_opts(&ropts, false)
                        };
                        let comm = LocalComm::single();
                        let st = RankState::new(1, 0, 10 + w);
                        save(&st.sharded(), Path::new(&url), &comm, &opts)?;
                        committed_generation(&url, &ropts)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let won: Vec<usize> = (0..2).filter(|&i| results[i].is_ok()).collect();
        assert_eq!(won.len(), 1, "round {round}: {results:?}");
        let lost = results[1 - won[0]].as_ref().unwrap_err();
        assert!(
            matches!(lost, Error::Remote(RemoteError::Conflict { .. })),
            "round {round}: {lost}"
        );
        assert!(
            lost.to_string().contains("another save committed"),
            "{lost}"
        );
        let f = remote::fetch_url(&url, &ropts, None).unwrap();
        state::check(f.dir(), 10 + won[0] as u64);
    }
}

#[test]
fn large_shards_go_as_multipart_uploads() {
    if s3::skipped("large_shards_go_as_multipart_uploads") {
        return;
    }
    let ropts = RemoteOptions {
        multipart_threshold: 6 << 20,
        part_size: 5 << 20,
        parts_in_flight: 2,
        ..s3::options()
    };
    let url = s3::url("multipart");
    // One 16 MiB tensor in one shard: 4 parts of 5 MiB (the last shorter).
    let key = zarrckpt::TensorKey::new("big").unwrap();
    let shape = vec![4u64 << 20];
    let full = common::tensor_bytes(7, &shape, zarrckpt::DType::Float32);
    let comm = LocalComm::single();
    let t = zarrckpt::ShardedTensor::new(
        key.clone(),
        zarrckpt::DType::Float32,
        shape.clone(),
        zarrckpt::Region::full(&shape),
        0,
        &full,
    )
    .unwrap();
    save(
        &[t],
        Path::new(&url),
        &comm,
        &remote_save_opts(&ropts, false),
    )
    .unwrap();
    let f = remote::fetch_url(&url, &ropts, None).unwrap();
    let biggest = f
        .resolved()
        .manifest
        .objects
        .iter()
        .map(|e| e.size)
        .max()
        .unwrap();
    assert!(
        biggest > 6 << 20,
        "the shard ({biggest} bytes) should exceed the threshold"
    );
    assert!(
        Checkpoint::open(f.dir())
            .unwrap()
            .read_tensor(&key)
            .unwrap()
            == full
    );
}

#[test]
fn a_rank_whose_upload_fails_is_named_on_every_rank() {
    if s3::skipped("a_rank_whose_upload_fails_is_named_on_every_rank") {
        return;
    }
    let (url, ropts) = (s3::url("rank-failure"), s3::options());
    // Rank 1 reaches the store through a port where nothing listens (a permanent failure of
    // its uploads after its retries); rank 0 reaches SeaweedFS.
    let dead_port = s3::free_ports(1)[0];
    let broken = RemoteOptions {
        max_retries: 1,
        retry_timeout: Duration::from_secs(5),
        ..s3::options_for(&format!("http://127.0.0.1:{dead_port}"))
    };
    // Every rank returns within the save's deadline (no rank waits on the failed one).
    let deadline = Duration::from_secs(30);
    let t0 = std::time::Instant::now();
    let results = run_local(2, Duration::from_secs(60), |comm| {
        let st = RankState::new(2, comm.rank() as u64, 1);
        let ropts = if comm.rank() == 1 { &broken } else { &ropts };
        let opts = SaveOptions {
            deadline: Some(deadline),
            ..remote_save_opts(ropts, false)
        };
        save(&st.sharded(), Path::new(&url), &comm, &opts)
    });
    assert!(t0.elapsed() < deadline, "{:?}", t0.elapsed());
    // Both name the failing key (its full URL) and the cause.
    let store = RemoteStore::open(&url, &ropts).unwrap();
    s3::assert_failure_named(&results, 1, &url, "PUT", &store);
}

#[test]
fn the_probe_passes_seaweedfs_and_refuses_the_juicefs_gateway() {
    if s3::skipped("the_probe_passes_seaweedfs_and_refuses_the_juicefs_gateway") {
        return;
    }
    let store = RemoteStore::open(&s3::url("probe"), &s3::options()).unwrap();
    let r = remote::probe(&store).unwrap();
    assert!(r.if_none_match && r.if_match, "{r:?}");

    let jfs = s3::JuiceGateway::start();
    let jopts = s3::options_for(&jfs.endpoint());
    let url = s3::url("probe");
    let store = RemoteStore::open(&url, &jopts).unwrap();
    // The gateway answers signed requests a moment after its port opens.
    let start = std::time::Instant::now();
    while store.list("").is_err() && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let r = remote::probe(&store).unwrap();
    assert!(
        !r.if_none_match && !r.if_match,
        "the JuiceFS gateway was expected to ignore both: {r:?}"
    );
    let e = save_state(&url, 1, 1, &jopts, false).remove(0).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(e, Error::Remote(RemoteError::Unconditional { .. })),
        "{text}"
    );
    assert!(text.contains(&jfs.endpoint()), "{text}");
    // Under the explicit flag the save goes through on the generation id alone.
    let allowed = RemoteOptions {
        allow_unconditional: true,
        ..jopts
    };
    save_state(&url, 1, 1, &allowed, false).remove(0).unwrap();
    state::check(remote::fetch_url(&url, &allowed, None).unwrap().dir(), 1);
}

#[test]
fn reading_a_missing_or_damaged_checkpoint_names_the_key() {
    let ropts = RemoteOptions::default();
    let e = remote::fetch_url("memory://damaged/none", &ropts, None).unwrap_err();
    assert!(
        e.to_string()
            .contains("memory://damaged/none/zarrckpt.pointer.json"),
        "{e}"
    );
    let url = "memory://damaged/ckpt";
    save_state(url, 1, 1, &ropts, false).remove(0).unwrap();
    let store = RemoteStore::open(url, &ropts).unwrap();
    let g = remote::fetch_url(url, &ropts, None)
        .unwrap()
        .resolved()
        .generation
        .clone();
    // Flip a byte of the largest object: the fetch checks it against the manifest's crc32c.
    let store_objects = remote::fetch_url(url, &ropts, None)
        .unwrap()
        .resolved()
        .manifest
        .objects
        .clone();
    let biggest = store_objects.iter().max_by_key(|e| e.size).unwrap();
    let key = format!("generations/{g}/{}", biggest.key);
    let (bytes, _) = store.get(&key).unwrap().unwrap();
    let mut b = bytes.to_vec();
    b[0] ^= 1;
    store.put(&key, b.into(), &remote::Condition::None).unwrap();
    let e = remote::fetch_url(url, &ropts, None).unwrap_err();
    assert!(
        e.to_string().contains(&key) && e.to_string().contains("crc32c"),
        "{e}"
    );
}

#[test]
fn the_storage_seam_on_seaweedfs() {
    use zarrckpt::storage::StorageError;
    use zarrckpt::storage::store::{Store, UpdateVersion};
    if s3::skipped("the_storage_seam_on_seaweedfs") {
        return;
    }
    let ropts = RemoteOptions {
        part_size: 5 << 20,
        parts_in_flight: 2,
        ..s3::options()
    };
    let s = RemoteStore::open(&s3::url("seam"), &ropts).unwrap();
    let r = Store::put_if_absent(&s, "k", &[b"ab", b"c"]).unwrap();
    assert!(matches!(
        Store::put_if_absent(&s, "k", &[b"x"]),
        Err(StorageError::ObjectExists { .. })
    ));
    let wrong = UpdateVersion {
        e_tag: Some("\"0123\"".into()),
        version: None,
    };
    assert!(matches!(
        Store::put_if_match(&s, "k", &[b"x"], &wrong),
        Err(StorageError::Precondition { .. })
    ));
    Store::put_if_match(&s, "k", &[b"xyz"], &r.update_version()).unwrap();
    // A 12 MiB object in 5 MiB parts, at most 2 in flight; then ranged reads across parts.
    let big: Vec<u8> = (0..12u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut w = Store::put_multipart(&s, "d/big").unwrap();
    for piece in big.chunks(3 << 20) {
        w.write(piece).unwrap();
    }
    w.finish().unwrap();
    let ranges = [
        0..10,
        (5 << 20) - 3..(5 << 20) + 3,
        (12 << 20) - 1..12 << 20,
    ];
    let got = Store::get_ranges(&s, "d/big", &ranges).unwrap();
    for (g, r) in got.iter().zip(&ranges) {
        assert_eq!(g.as_slice(), &big[r.start as usize..r.end as usize]);
    }
    assert_eq!(Store::head(&s, "d/big").unwrap().size, 12 << 20);
    let l = Store::list_with_delimiter(&s, "").unwrap();
    assert_eq!(l.common_prefixes, vec!["d".to_string()]);
    assert!(matches!(
        Store::head(&s, "nope"),
        Err(StorageError::NotFound { .. })
    ));
}

#[test]
fn the_cli_copies_inspects_verifies_lists_and_collects() {
    if s3::skipped("the_cli_copies_inspects_verifies_lists_and_collects") {
        return;
    }
    let _ = s3::options(); // the server is up and answers signed requests
    let tmp = tempfile::tempdir().unwrap();
    let local = tmp.path().join("ckpt");
    run_local(2, Duration::from_secs(60), |comm| {
        let st = RankState::new(2, comm.rank() as u64, 5);
        save(&st.sharded(), &local, &comm, &SaveOptions::default()).unwrap();
    });
    let url = s3::url("cli/step-5");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
            .args(args)
            .envs(s3::shared().env())
            .env("TMPDIR", tmp.path())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "zarrckpt {args:?}: {text}");
        text
    };
    let local_s = local.to_str().unwrap();
    assert!(run(&["cp", local_s, &url]).contains("committed generation"));
    run(&["cp", local_s, &url, "--overwrite"]);
    assert!(run(&["verify", &url]).contains("OK:"));
    assert!(run(&["inspect", &url]).contains("model.rows.weight"));
    let ls = run(&["ls", &s3::url("cli")]);
    assert!(
        ls.contains("step-5") && ls.contains("1 checkpoint(s)"),
        "{ls}"
    );
    let back = tmp.path().join("back");
    run(&["cp", &url, back.to_str().unwrap()]);
    state::check(&back, 5);
    let diff = std::process::Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args(["diff", local_s, &url])
        .envs(s3::shared().env())
        .status()
        .unwrap();
    assert!(diff.success());
    let gc = run(&["gc", &url]);
    assert!(gc.contains("removed 1 generation(s)"), "{gc}");
}

/// tensorstore (from the test venv: `$ZARRCKPT_PYTHON`, else `<repo>/.venv/bin/python`) reads a
/// committed generation straight from SeaweedFS, as the spec's section 20.2 says.
#[test]
fn tensorstore_reads_a_committed_generation_from_s3() {
    if s3::skipped("tensorstore_reads_a_committed_generation_from_s3") {
        return;
    }
    let python = s3::venv_binary("python", "ZARRCKPT_PYTHON");
    let (url, ropts) = (s3::url("tensorstore"), s3::options());
    save_state(&url, 2, 4, &ropts, false).remove(0).unwrap();
    let store = RemoteStore::open(&url, &ropts).unwrap();
    let generation = remote::resolve(&store).unwrap().generation;
    let key = zarrckpt::TensorKey::new(state::specs()[0].key).unwrap();
    let path = format!(
        "tensorstore/generations/{generation}/{}/",
        zarrckpt::storage::meta::tensor_path(&key)
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tensor.bin");
    let script = format!(
        r#"
import tensorstore as ts
spec = {{"driver": "zarr3", "kvstore": {{"driver": "s3", "bucket": "{bucket}", "path": "{path}",
        "endpoint": "{endpoint}", "aws_region": "us-east-1", "aws_credentials": {{"type": "environment"}}}}}}
a = ts.open(spec, read=True).result()
open("{out}", "wb").write(a.read().result().tobytes())
"#,
        bucket = s3::BUCKET,
        endpoint = s3::shared().endpoint(),
        out = out.display()
    );
    let o = std::process::Command::new(python)
        .args(["-c", &script])
        .envs(s3::shared().env())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "tensorstore failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        std::fs::read(&out).unwrap() == state::full(0, 4),
        "tensorstore read other bytes"
    );
}

/// Objects go straight to the store in the same commit as the tensors; a `Saver`'s
/// synchronous save takes a URL too (and reuses its plan), and so does its asynchronous save.
#[test]
fn objects_and_the_saver_save_straight_to_the_store() {
    use serde_json::json;
    use zarrckpt::{ObjectSlot, SaveRequest, Saver, StateObject};
    let url = "memory://direct/objects";
    let ropts = RemoteOptions::default();
    let opts = remote_save_opts(&ropts, false);
    run_local(2, Duration::from_secs(60), |comm| {
        let st = RankState::new(2, comm.rank() as u64, 7);
        let objs = vec![
            StateObject::common("iteration", json!(7)).unwrap(),
            StateObject::per_rank("rng", vec![comm.rank() as u8; 16]).unwrap(),
        ];
        zarrckpt::save_with_objects(&st.sharded(), &objs, Path::new(url), &comm, &opts).unwrap();
    });
    let f = remote::fetch_url(url, &ropts, None).unwrap();
    state::check(f.dir(), 7);
    let ck = Checkpoint::open(f.dir()).unwrap();
    let it = zarrckpt::TensorKey::new("iteration").unwrap();
    assert_eq!(
        format!("{:?}", ck.read_object(&it, &ObjectSlot::Common).unwrap()),
        format!("{:?}", zarrckpt::ObjectValue::from(json!(7)))
    );
    let rng = zarrckpt::TensorKey::new("rng").unwrap();
    assert_eq!(
        format!("{:?}", ck.read_object(&rng, &ObjectSlot::Rank(1)).unwrap()),
        format!("{:?}", zarrckpt::ObjectValue::from(vec![1u8; 16]))
    );

    let url2 = "memory://direct/saver";
    let mut saver = Saver::new(Arc::new(LocalComm::single()));
    let st = RankState::new(1, 0, 8);
    let req = SaveRequest::new().with_tensors(st.sharded());
    saver.save(&req, Path::new(url2), &opts).unwrap();
    let again = SaveOptions {
        overwrite: true,
        ..opts.clone()
    };
    let st9 = RankState::new(1, 0, 9);
    let req9 = SaveRequest::new().with_tensors(st9.sharded());
    assert!(
        saver
            .save(&req9, Path::new(url2), &again)
            .unwrap()
            .plan_reused
    );
    state::check(remote::fetch_url(url2, &ropts, None).unwrap().dir(), 9);
    let st10 = RankState::new(1, 0, 10);
    let req10 = SaveRequest::new().with_tensors(st10.sharded());
    saver
        .save_async(&req10, Path::new(url2), &again)
        .and_then(|h| h.wait())
        .unwrap();
    state::check(remote::fetch_url(url2, &ropts, None).unwrap().dir(), 10);
}
