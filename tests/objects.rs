//! Objects (non-tensor state): common, per-rank and sharded values saved by in-process ranks,
//! listed and read back, loaded on other world sizes, disagreements and damage reported. All
//! but the damage test also on `memory://` and `s3://` (SeaweedFS; `tests/common/target.rs`);
//! the CLI's inspect and verify on a local directory and `s3://`.

mod common;

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use zarrckpt::Communicator;
use zarrckpt::StoredScope;
use zarrckpt::comm::run_local;
use zarrckpt::{
    Checkpoint, Error, LoadOptions, ObjectRequest, ObjectSlot, ObjectValue, SaveOptions,
    ShardedTensor, StateObject, StrictMode, TensorKey, load_with_objects, save_with_objects,
};

const T: Duration = Duration::from_secs(30);

fn rng_bytes(rank: usize) -> Vec<u8> {
    (0..40u8)
        .map(|i| i.wrapping_mul(7).wrapping_add(rank as u8 * 31))
        .collect()
}

/// Rank r of 4 (PP 2: ranks 0-1 stage 0, ranks 2-3 stage 1).
fn objects_of(rank: usize) -> Vec<StateObject> {
    let stage = rank as u64 / 2;
    vec![
        StateObject::common("iteration", json!(1000)).unwrap(),
        StateObject::common(
            "config",
            json!({"lr": 3e-4, "layers": 24, "name": "gpt", "betas": [0.9, 0.95]}),
        )
        .unwrap(),
        StateObject::per_rank("rng/cuda", rng_bytes(rank)).unwrap(),
        StateObject::per_rank("dataloader", json!({"consumed": 512 * (rank + 1)})).unwrap(),
        StateObject::sharded("pp_state", &[2], &[stage], json!({"stage": stage, "mb": 8})).unwrap(),
        StateObject::sharded("empty", &[1], &[0], Vec::<u8>::new()).unwrap(),
    ]
}

fn save4(dir: &Path) {
    let w: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let results = run_local(4, T, |c| {
        let r = c.rank();
        let piece =
            ShardedTensor::from_slice("w", &[16], &[4 * r as u64], &w[4 * r..4 * r + 4], &[4], 0)
                .unwrap();
        save_with_objects(&[piece], &objects_of(r), dir, &c, &SaveOptions::default())
    });
    for r in results {
        r.unwrap();
    }
}

fn k(s: &str) -> TensorKey {
    TensorKey::new(s).unwrap()
}

on_targets! {
    fn objects_round_trip_and_are_listed(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save4(&dir);

        let ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(ckpt.meta().version, "1.2");
        let listed: Vec<(String, StoredScope, u64)> = ckpt
            .objects()
            .into_iter()
            .map(|o| (o.key.to_string(), o.scope, o.values))
            .collect();
        assert_eq!(
            listed,
            [
                ("config".to_string(), StoredScope::Common, 1),
                ("dataloader".to_string(), StoredScope::PerRank, 4),
                ("empty".to_string(), StoredScope::Sharded, 1),
                ("iteration".to_string(), StoredScope::Common, 1),
                ("pp_state".to_string(), StoredScope::Sharded, 2),
                ("rng/cuda".to_string(), StoredScope::PerRank, 4),
            ]
        );
        assert_eq!(
            ckpt.read_object(&k("iteration"), &ObjectSlot::Common)
                .unwrap(),
            ObjectValue::Json(json!(1000))
        );
        for r in 0..4 {
            assert_eq!(
                ckpt.read_object(&k("rng/cuda"), &ObjectSlot::Rank(r))
                    .unwrap(),
                ObjectValue::Bytes(rng_bytes(r as usize))
            );
        }
        assert_eq!(
            ckpt.read_object(&k("pp_state"), &ObjectSlot::Shard(vec![1]))
                .unwrap(),
            ObjectValue::Json(json!({"stage": 1, "mb": 8}))
        );
        assert_eq!(
            ckpt.read_object(&k("empty"), &ObjectSlot::Shard(vec![0]))
                .unwrap(),
            ObjectValue::Bytes(vec![])
        );
        let v = ckpt.verify(1, None).unwrap();
        assert!(v.problems.is_empty(), "{:?}", v.problems);
        assert_eq!(v.object_values, 1 + 4 + 1 + 1 + 2 + 4);
        // Typed errors for slots of another scope or outside the saved job.
        assert!(matches!(
            ckpt.read_object(&k("iteration"), &ObjectSlot::Rank(0)),
            Err(Error::ObjectScopeMismatch { .. })
        ));
        let e = ckpt
            .read_object(&k("rng/cuda"), &ObjectSlot::Rank(4))
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::ObjectRankMissing {
                    rank: 4,
                    world_size: 4,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("read any saved rank"), "{e}");
        assert!(matches!(
            ckpt.read_object(&k("pp_state"), &ObjectSlot::Shard(vec![2])),
            Err(Error::ObjectGridMismatch { .. })
        ));
        assert!(matches!(
            ckpt.read_object(&k("nope"), &ObjectSlot::Common),
            Err(Error::UnexpectedKeys { .. })
        ));

        // Loading on the same world size: each rank gets its own values back.
        let results = run_local(4, T, |c| {
            let r = c.rank();
            let reqs = vec![
                ObjectRequest::common("iteration").unwrap(),
                ObjectRequest::common("config").unwrap(),
                ObjectRequest::rank("rng/cuda", r as u64).unwrap(),
                ObjectRequest::shard("pp_state", &[2], &[r as u64 / 2]).unwrap(),
            ];
            load_with_objects(&mut [], &reqs, &dir, &c, &LoadOptions::default())
        });
        for (r, rep) in results.into_iter().enumerate() {
            let rep = rep.unwrap();
            assert_eq!(rep.objects.len(), 4);
            assert_eq!(rep.objects[0], Some(ObjectValue::Json(json!(1000))));
            assert_eq!(
                rep.objects[1].as_ref().and_then(|v| v.as_json()).unwrap()["betas"],
                json!([0.9, 0.95])
            );
            assert_eq!(rep.objects[2], Some(ObjectValue::Bytes(rng_bytes(r))));
            assert_eq!(
                rep.objects[3],
                Some(ObjectValue::Json(json!({"stage": r / 2, "mb": 8})))
            );
        }
    }
}

on_targets! {
    fn other_world_sizes_get_typed_errors_and_can_redistribute(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save4(&dir);
        // Six ranks asking for their own per-rank value: ranks 4 and 5 have none.
        let results = run_local(6, T, |c| {
            let reqs = [ObjectRequest::rank("rng/cuda", c.rank() as u64).unwrap()];
            load_with_objects(&mut [], &reqs, &dir, &c, &LoadOptions::default())
        });
        assert!(matches!(
            &results[4],
            Err(Error::ObjectRankMissing {
                rank: 4,
                world_size: 4,
                ..
            })
        ));
        for r in [0, 1, 2, 3, 5] {
            assert!(results[r].is_err(), "rank {r} must fail with the others");
        }
        // What such a job can do instead: read a saved rank's value, e.g. rank r % 4.
        let results = run_local(6, T, |c| {
            let reqs = [ObjectRequest::rank("rng/cuda", c.rank() as u64 % 4).unwrap()];
            load_with_objects(&mut [], &reqs, &dir, &c, &LoadOptions::default())
        });
        for (r, rep) in results.into_iter().enumerate() {
            assert_eq!(
                rep.unwrap().objects,
                vec![Some(ObjectValue::Bytes(rng_bytes(r % 4)))]
            );
        }
        // A sharded object asked for with another grid (PP 4 instead of 2).
        let results = run_local(1, T, |c| {
            let reqs = [ObjectRequest::shard("pp_state", &[4], &[1]).unwrap()];
            load_with_objects(&mut [], &reqs, &dir, &c, &LoadOptions::default())
        });
        assert!(matches!(
            &results[0],
            Err(Error::ObjectGridMismatch { requested, stored, .. }) if requested == &[4] && stored == &[2]
        ));
    }
}

on_targets! {
    fn strict_modes_apply_to_object_keys(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save4(&dir);
        let reqs = [
            ObjectRequest::common("iteration").unwrap(),
            ObjectRequest::common("absent").unwrap(),
        ];
        let run = |strict| {
            let opts = LoadOptions {
                strict,
                ..LoadOptions::default()
            };
            run_local(2, T, |c| load_with_objects(&mut [], &reqs, &dir, &c, &opts))
        };
        for r in run(StrictMode::RaiseUnexpected) {
            let e = r.unwrap_err();
            assert!(e.to_string().contains("absent"), "{e}");
        }
        for r in run(StrictMode::ReturnAll) {
            let rep = r.unwrap();
            assert_eq!(
                rep.objects,
                vec![Some(ObjectValue::Json(json!(1000))), None]
            );
            assert_eq!(rep.unexpected, vec![k("absent")]);
            // No rank asked for these objects (nor for the tensor `w`).
            let missing: Vec<String> = rep.missing.iter().map(ToString::to_string).collect();
            assert_eq!(
                missing,
                ["w", "config", "dataloader", "empty", "pp_state", "rng/cuda"]
            );
        }
        for r in run(StrictMode::IgnoreAll) {
            let rep = r.unwrap();
            assert_eq!(rep.objects[1], None);
            assert!(rep.unexpected.is_empty());
        }
        let opts = LoadOptions {
            strict: StrictMode::RaiseAll,
            ..LoadOptions::default()
        };
        let results = run_local(1, T, |c| {
            let reqs = [ObjectRequest::common("iteration").unwrap()];
            let mut buf = vec![0f32; 16];
            let mut t = [zarrckpt::LoadTarget::from_slice("w", &[16], &[0], &mut buf, &[16]).unwrap()];
            load_with_objects(&mut t, &reqs, &dir, &c, &opts)
        });
        let e = results.into_iter().next().unwrap().unwrap_err();
        assert!(
            matches!(&e, Error::MissingKeys { keys, .. } if keys.len() == 5),
            "{e}"
        );
    }
}

on_targets! {
    fn disagreeing_common_values_fail_every_rank_and_commit_nothing(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        let results = run_local(4, T, |c| {
            let lr = if c.rank() == 2 { 1e-3 } else { 3e-4 };
            let objs = [StateObject::common("config", json!({"lr": lr})).unwrap()];
            save_with_objects(&[], &objs, &dir, &c, &SaveOptions::default())
        });
        for r in results {
            let msg = r.unwrap_err().to_string();
            assert!(
                msg.contains("`config`") && msg.contains("[0-1, 3]") && msg.contains("[2]"),
                "{msg}"
            );
        }
        assert!(Checkpoint::open(&dir).is_err());

        // Per-rank objects must be declared by every rank.
        let results = run_local(3, T, |c| {
            let objs: Vec<StateObject> = if c.rank() == 1 {
                vec![]
            } else {
                vec![StateObject::per_rank("rng", vec![1u8]).unwrap()]
            };
            save_with_objects(&[], &objs, &dir, &c, &SaveOptions::default())
        });
        for r in results {
            let msg = r.unwrap_err().to_string();
            assert!(msg.contains("`rng`") && msg.contains("[1]"), "{msg}");
        }
        // Two scopes for one key, and a grid with a shard nobody declares.
        let results = run_local(2, T, |c| {
            let objs = [StateObject::sharded("s", &[3], &[c.rank() as u64], json!(1)).unwrap()];
            save_with_objects(&[], &objs, &dir, &c, &SaveOptions::default())
        });
        for r in results {
            let msg = r.unwrap_err().to_string();
            assert!(msg.contains("shard [2] of grid [3]"), "{msg}");
        }
    }
}

#[test]
fn damaged_object_files_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    save4(&dir);
    let chunk = dir.join("objects/rng/cuda/rank.2/c.0");
    let mut bytes = std::fs::read(&chunk).unwrap();
    assert_eq!(bytes.len(), 40 + 4);
    bytes[5] ^= 1;
    std::fs::write(&chunk, &bytes).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let e = ckpt
        .read_object(&k("rng/cuda"), &ObjectSlot::Rank(2))
        .unwrap_err();
    assert!(e.to_string().contains("crc32c mismatch"), "{e}");
    let v = ckpt.verify(1, None).unwrap();
    assert_eq!(v.problems.len(), 1);
    assert_eq!(v.problems[0].key, k("rng/cuda"));

    // Truncated, then missing.
    std::fs::write(&chunk, &bytes[..10]).unwrap();
    let e = ckpt
        .read_object(&k("rng/cuda"), &ObjectSlot::Rank(2))
        .unwrap_err();
    assert!(e.to_string().contains("corrupt"), "{e}");
    std::fs::remove_file(&chunk).unwrap();
    let e = ckpt
        .read_object(&k("rng/cuda"), &ObjectSlot::Rank(2))
        .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");

    // A hostile zarr.json claiming a huge value is refused before anything is allocated.
    let meta = dir.join("objects/config/zarr.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta).unwrap()).unwrap();
    doc["shape"] = json!([u64::MAX - 3]);
    std::fs::write(&meta, serde_json::to_vec(&doc).unwrap()).unwrap();
    let e = ckpt
        .read_object(&k("config"), &ObjectSlot::Common)
        .unwrap_err();
    assert!(e.to_string().contains("exceeds"), "{e}");
    // A codec swapped for another is refused too.
    doc["shape"] = json!([doc["chunk_grid"]["configuration"]["chunk_shape"][0]]);
    doc["codecs"] = json!([{"name": "bytes", "configuration": {"endian": "little"}}]);
    std::fs::write(&meta, serde_json::to_vec(&doc).unwrap()).unwrap();
    let e = ckpt
        .read_object(&k("config"), &ObjectSlot::Common)
        .unwrap_err();
    assert!(e.to_string().contains("`codecs`"), "{e}");

    // Index entries that are inconsistent refuse the checkpoint.
    let root = dir.join("zarr.json");
    let good = std::fs::read(&root).unwrap();
    for (what, f) in [
        (
            "world_size 0",
            Box::new(|d: &mut serde_json::Value| d["world_size"] = json!(0))
                as Box<dyn Fn(&mut serde_json::Value)>,
        ),
        (
            "size on a per-rank object",
            Box::new(|d: &mut serde_json::Value| d["size"] = json!(3)),
        ),
        (
            "escaping path",
            Box::new(|d: &mut serde_json::Value| d["path"] = json!("objects/../tensors/w")),
        ),
        (
            "unknown scope",
            Box::new(|d: &mut serde_json::Value| d["scope"] = json!("global")),
        ),
    ] {
        let mut doc: serde_json::Value = serde_json::from_slice(&good).unwrap();
        f(&mut doc["attributes"]["zarrckpt"]["objects"]["rng/cuda"]);
        std::fs::write(&root, serde_json::to_vec(&doc).unwrap()).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err();
        assert!(e.to_string().contains("rng/cuda"), "{what}: {e}");
    }
}

on_targets! {
    fn overwriting_a_checkpoint_with_objects_and_plain_saves_stay_as_before(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save4(&dir);
        // Overwrite with a plain tensor save: the objects group goes away with the rest.
        let w = [1f32, 2.0];
        let results = run_local(1, T, |c| {
            let p = ShardedTensor::from_slice("w", &[2], &[0], &w, &[2], 0).unwrap();
            zarrckpt::save(
                &[p],
                &dir,
                &c,
                &SaveOptions {
                    overwrite: true,
                    ..SaveOptions::default()
                },
            )
        });
        results.into_iter().next().unwrap().unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert!(ckpt.objects().is_empty());
        if target.is_remote() {
            return; // the rest edits the files in place
        }
        assert!(!dir.join("objects").exists());
        let root: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("zarr.json")).unwrap()).unwrap();
        assert!(root["attributes"]["zarrckpt"].get("objects").is_none());
        // A 1.0 index (no objects member) reads as before.
        let mut doc = root.clone();
        doc["attributes"]["zarrckpt"]["version"] = json!("1.0");
        std::fs::write(dir.join("zarr.json"), serde_json::to_vec(&doc).unwrap()).unwrap();
        assert_eq!(
            Checkpoint::open(&dir)
                .unwrap()
                .read_tensor(&k("w"))
                .unwrap(),
            [1f32.to_le_bytes(), 2f32.to_le_bytes()].concat()
        );
    }
}

on_targets! {
    [local, s3]
    /// The CLI is another process: it reaches `s3://` (the environment) but not this
    /// process's `memory://`.
    fn inspect_and_verify_show_objects(target: Target) {
        let bin = env!("CARGO_BIN_EXE_zarrckpt");
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        save4(&dir);
        let out = std::process::Command::new(bin)
            .args(["inspect", "--json"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success());
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let objs = doc["objects"].as_array().unwrap();
        assert_eq!(objs.len(), 6);
        assert_eq!(
            objs[5],
            json!({"key": "rng/cuda", "scope": "per_rank", "encoding": "bytes", "values": 4, "world_size": 4})
        );
        assert_eq!(objs[4]["grid"], json!([2]));
        assert_eq!(objs[3]["size"], json!(4));
        let out = std::process::Command::new(bin)
            .arg("inspect")
            .arg(&dir)
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.lines()
                .any(|l| l.starts_with("iteration") && l.contains("common") && l.ends_with("1000")),
            "{text}"
        );
        assert!(text.contains("6 objects"), "{text}");
        let out = std::process::Command::new(bin)
            .arg("verify")
            .arg(&dir)
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            out.status.success() && text.contains("13 object values"),
            "{text}"
        );
        if target.is_remote() {
            return; // the rest damages a file in place (`tests/s3_read.rs` damages objects)
        }
        std::fs::write(dir.join("objects/dataloader/rank.1/c.0"), b"{}").unwrap();
        let out = std::process::Command::new(bin)
            .arg("verify")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("PROBLEM `dataloader`"), "{err}");
    }
}
