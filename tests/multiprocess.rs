//! Real processes talking TCP on loopback, started by `zarrckpt launch`: save with 4 and load
//! with 3, data-parallel exchange, ranks killed mid-save and mid-load (the others must fail on
//! their own within the timeout, naming the dead rank), deterministic balanced writes. Every
//! test on a local directory and on `s3://` (SeaweedFS; `tests/common/target.rs`: the
//! processes inherit the `AWS_*` environment); `memory://` lives in one process only.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use zarrckpt::remote::RemoteError;
use zarrckpt::storage::StorageError;
use zarrckpt::{Checkpoint, Error};

const SIZE: &str = "4000000";

fn zarrckpt() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zarrckpt"));
    // Short timeouts so failure tests finish quickly.
    c.env("ZARRCKPT_TIMEOUT_S", "10");
    c
}

/// `zarrckpt launch -n N [launch flags] -- zarrckpt worker JOB --dir DIR ...`.
fn launch(n: usize, launch_flags: &[&str], job: &str, dir: &Path, worker_flags: &[&str]) -> Output {
    let mut c = zarrckpt();
    c.arg("launch")
        .arg("-n")
        .arg(n.to_string())
        .args(launch_flags)
        .arg("--");
    c.arg(env!("CARGO_BIN_EXE_zarrckpt"))
        .arg("worker")
        .arg(job)
        .arg("--dir")
        .arg(dir);
    c.args(["--size", SIZE, "--hidden", "64", "--io-threads", "1"])
        .args(worker_flags);
    c.output().expect("run zarrckpt launch")
}

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn reports(base: &Path, n: usize) -> Vec<Value> {
    (0..n)
        .map(|r| {
            serde_json::from_slice(&std::fs::read(base.with_extension(r.to_string())).unwrap())
                .unwrap()
        })
        .collect()
}

fn sum(rs: &[Value], f: &str) -> u64 {
    rs.iter().map(|r| r[f].as_u64().unwrap()).sum()
}

on_targets! {
    [local, s3]
    fn four_processes_save_three_load_and_dp_groups_share_reads(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        let rep = tmp.path().join("save");
        // tp 2 x dp 2: replicated pieces written once, spread over their holders.
        ok(&launch(
            4,
            &[],
            "save",
            &dir,
            &["--tp", "2", "--dp", "2", "--report", rep.to_str().unwrap()],
        ));
        let saves = reports(&rep, 4);
        let balance = saves[0]["write_balance"].as_f64().unwrap();
        assert!(
            saves
                .iter()
                .all(|r| r["write_balance"].as_f64() == Some(balance)),
            "every rank learns the same balance"
        );
        let bytes: Vec<u64> = saves
            .iter()
            .map(|r| r["assigned_bytes"].as_u64().unwrap())
            .collect();
        assert!(
            bytes.iter().all(|&b| b > 0),
            "every replica writes a share: {bytes:?}"
        );
        assert!(balance < 1.1, "{bytes:?}");
        assert_eq!(Checkpoint::open(&dir).unwrap().meta().world_size, 4);

        // 3 processes load in another split and check every byte.
        let rep = tmp.path().join("load3");
        ok(&launch(
            3,
            &[],
            "load",
            &dir,
            &["--tp", "3", "--report", rep.to_str().unwrap()],
        ));
        let loads = reports(&rep, 3);
        assert!(loads.iter().all(|r| r["verified"] == true));

        // dp 2 x tp 2: each box read once per data-parallel group, the copy sent over TCP.
        let rep = tmp.path().join("load4");
        ok(&launch(
            4,
            &[],
            "load",
            &dir,
            &["--tp", "2", "--dp", "2", "--report", rep.to_str().unwrap()],
        ));
        let shared = reports(&rep, 4);
        assert!(shared.iter().all(|r| r["verified"] == true));
        let rep = tmp.path().join("load4-plain");
        ok(&launch(
            4,
            &[],
            "load",
            &dir,
            &[
                "--tp",
                "2",
                "--dp",
                "2",
                "--no-exchange",
                "--report",
                rep.to_str().unwrap(),
            ],
        ));
        let plain = reports(&rep, 4);
        let (read_shared, read_plain) = (sum(&shared, "bytes_read"), sum(&plain, "bytes_read"));
        let loaded = sum(&shared, "loaded_bytes");
        assert_eq!(sum(&plain, "bytes_received"), 0);
        assert_eq!(sum(&shared, "bytes_received"), sum(&shared, "bytes_sent"));
        assert!(
            sum(&shared, "bytes_received") * 2 >= loaded * 9 / 10,
            "about half the bytes arrive over TCP"
        );
        assert!(
            read_shared * 2 <= read_plain + read_plain / 20,
            "shared {read_shared} vs plain {read_plain}"
        );
    }
}

on_targets! {
    [local, s3]
    /// A rank dies mid-save: the others fail by themselves (the launcher does not kill them),
    /// quickly, naming the dead rank; the checkpoint is refused as incomplete; an earlier
    /// checkpoint at another path stays loadable.
    fn a_rank_killed_during_save_fails_the_others_and_never_commits(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let good = target.path(tmp.path(), "good");
        ok(&launch(2, &[], "save", &good, &["--tp", "2"]));
        let dir = target.path(tmp.path(), "ckpt");
        let t0 = Instant::now();
        let o = launch(
            4,
            &["--no-fail-fast"],
            "save",
            &dir,
            &["--tp", "4", "--die-rank", "2", "--die-after-bytes", "1"],
        );
        let took = t0.elapsed();
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("rank 2 failed first"), "{err}");
        for r in [0, 1, 3] {
            let line = err
                .lines()
                .find(|l| l.starts_with(&format!("[rank {r}] error:")));
            let line = line.unwrap_or_else(|| panic!("rank {r} reports no error:\n{err}"));
            assert!(
                line.contains("rank 2"),
                "rank {r} does not name the dead rank: {line}"
            );
        }
        assert!(took < Duration::from_secs(25), "took {took:?}");
        // Locally the parked save is refused as incomplete; on a store nothing was committed,
        // so there is no pointer to resolve.
        match Checkpoint::open(&dir) {
            Err(Error::Storage(StorageError::Incomplete { .. })) if !target.is_remote() => {}
            Err(Error::Remote(RemoteError::NotFound { .. })) if target.is_remote() => {}
            other => panic!("{other:?}"),
        }
        ok(&launch(2, &[], "load", &good, &["--tp", "2"]));
    }
}

on_targets! {
    [local, s3]
    /// A rank dies mid-load: the others fail by themselves within the timeout, naming it.
    fn a_rank_killed_during_load_fails_the_others(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        ok(&launch(2, &[], "save", &dir, &["--tp", "2"]));
        for flags in [
            &["--tp", "2", "--dp", "2"][..],
            &["--tp", "4", "--no-exchange"][..],
        ] {
            let t0 = Instant::now();
            let mut wf = flags.to_vec();
            wf.extend(["--die-rank", "1", "--die-after-bytes", "1"]);
            let o = launch(4, &["--no-fail-fast"], "load", &dir, &wf);
            let took = t0.elapsed();
            assert!(!o.status.success());
            let err = String::from_utf8_lossy(&o.stderr);
            // Which rank the launcher sees exit first is a race when the others fail within
            // microseconds of the dead one (its exit watcher may wake last); what matters is that
            // every other rank fails by itself naming the dead rank.
            assert!(err.contains("failed first"), "{err}");
            for r in [0, 2, 3] {
                let line = err
                    .lines()
                    .find(|l| l.starts_with(&format!("[rank {r}] error:")));
                let line =
                    line.unwrap_or_else(|| panic!("rank {r} reports no error ({flags:?}):\n{err}"));
                assert!(
                    line.contains("rank 1"),
                    "rank {r} does not name the dead rank: {line}"
                );
            }
            assert!(took < Duration::from_secs(25), "took {took:?}");
        }
    }
}

on_targets! {
    [local, s3]
    /// The `reshard` example (built by `cargo test` next to this test's binary), as the README
    /// runs it, and then loaded again by 6 processes as tensor parallel 3 x data parallel 2.
    fn reshard_example_runs_under_launch(target: Target) {
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
        let example = profile_dir.join("examples").join("reshard");
        assert!(
            example.exists(),
            "{} not built (cargo test builds examples)",
            example.display()
        );
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        let run = |n: &str, args: &[&str]| {
            let o = zarrckpt()
                .args(["launch", "-n", n, "--"])
                .arg(&example)
                .arg("--dir")
                .arg(&dir)
                .args(["--size", "3000000"])
                .args(args)
                .output()
                .unwrap();
            ok(&o);
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        let out = run(
            "4",
            &[
                "--save-tp",
                "2",
                "--save-dp",
                "2",
                "--load-tp",
                "4",
                "--load-dp",
                "1",
            ],
        );
        assert_eq!(out.matches("every byte checked").count(), 4, "{out}");
        let out = run("6", &["--save-tp", "0", "--load-tp", "3", "--load-dp", "2"]);
        assert_eq!(out.matches("every byte checked").count(), 6, "{out}");
        assert!(out.contains("received from other ranks"), "{out}");
    }
}

on_targets! {
    [local, s3]
    /// Objects over TCP processes: 4 processes save tensors and objects (common, per-rank,
    /// sharded), 3 load them back in another split; each checks its own values.
    fn processes_save_and_load_objects(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        ok(&launch(
            4,
            &[],
            "save",
            &dir,
            &["--tp", "2", "--dp", "2", "--objects"],
        ));
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(ckpt.objects().len(), 3);
        assert!(ckpt.verify(1, None).unwrap().problems.is_empty());
        let rep = tmp.path().join("load3");
        ok(&launch(
            3,
            &[],
            "load",
            &dir,
            &["--tp", "3", "--objects", "--report", rep.to_str().unwrap()],
        ));
        assert!(reports(&rep, 3).iter().all(|r| r["verified"] == true));
        // Five ranks: rank 4 has no per-rank value in a checkpoint saved by 4; every rank fails.
        let out = launch(5, &[], "load", &dir, &["--tp", "5", "--objects"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no value for rank 4"), "{err}");
    }
}
