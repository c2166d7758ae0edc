//! The commit protocol of format 1.1: saves over a checkpoint swap in a staging directory,
//! the fallback swap and its recovery rule, the save lock, the same-storage check, a reader of
//! the old index never gets the new shards, and the checkpoint manager.

use std::path::Path;
use std::time::Duration;

use zarrckpt::comm::local::run_local;
use zarrckpt::storage::StorageError;
use zarrckpt::storage::commit::{
    legacy_lock_path, lock_path, old_path, plan_recovery, recover, staging_path, try_lock,
};
use zarrckpt::{
    Checkpoint, CheckpointManager, DType, Error, LoadOptions, LoadTarget, LocalComm,
    ManagerOptions, Region, SaveOptions, ShardedTensor, TensorKey, save,
};

fn data(g: u8) -> Vec<u8> {
    (0..64u32)
        .flat_map(|i| (i * 3 + u32::from(g)).to_le_bytes())
        .collect()
}

fn save_gen(dir: &Path, g: u8, overwrite: bool) -> zarrckpt::Result<()> {
    let d = data(g);
    let p = [ShardedTensor::new(
        TensorKey::new("w").unwrap(),
        DType::UInt32,
        vec![8, 8],
        Region::full(&[8, 8]),
        0,
        &d,
    )
    .unwrap()];
    let opts = SaveOptions {
        overwrite,
        ..Default::default()
    };
    save(&p, dir, &LocalComm::single(), &opts).map(|_| ())
}

fn read_w(dir: &Path) -> zarrckpt::Result<Vec<u8>> {
    Checkpoint::open(dir)?.read_tensor(&TensorKey::new("w").unwrap())
}

fn siblings(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("staging") || n.contains("-old-"))
        .collect()
}

#[test]
fn overwrite_swaps_and_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_gen(&dir, 1, false).unwrap();
    let id1 = Checkpoint::open(&dir).unwrap().meta().save_id.unwrap();
    save_gen(&dir, 2, true).unwrap();
    let id2 = Checkpoint::open(&dir).unwrap().meta().save_id.unwrap();
    assert_ne!(id1, id2);
    assert_eq!(read_w(&dir).unwrap(), data(2));
    assert!(siblings(&dir).is_empty(), "{:?}", siblings(&dir));
    assert!(lock_path(&dir).exists());
}

#[test]
fn shards_or_arrays_of_another_save_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    save_gen(&a, 1, false).unwrap();
    save_gen(&b, 2, false).unwrap();
    // What a reader holding the old index would meet if the new save's files replaced the
    // old ones under it: a shard of another save (equal size, valid checksums).
    let shard = "tensors/w/c.0.0";
    let orig = std::fs::read(a.join(shard)).unwrap();
    std::fs::copy(b.join(shard), a.join(shard)).unwrap();
    let e = read_w(&a).unwrap_err().to_string();
    assert!(e.contains("written by save") && e.contains(shard), "{e}");
    let report = Checkpoint::open(&a).unwrap().verify(1, None).unwrap();
    assert_eq!(report.problems.len(), 1);
    std::fs::write(a.join(shard), orig).unwrap();
    assert_eq!(read_w(&a).unwrap(), data(1));
    std::fs::copy(b.join("tensors/w/zarr.json"), a.join("tensors/w/zarr.json")).unwrap();
    let e = read_w(&a).unwrap_err().to_string();
    assert!(
        e.contains("written by save") && e.contains("tensors/w/zarr.json"),
        "{e}"
    );
}

#[test]
fn fallback_swap_crash_between_renames_is_recovered_by_reader_and_next_save() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_gen(&dir, 1, false).unwrap();
    let id = Checkpoint::open(&dir).unwrap().meta().save_id.unwrap();
    // The state a crash between the two renames of the fallback swap leaves.
    std::fs::rename(&dir, old_path(&dir, id)).unwrap();
    assert_eq!(read_w(&dir).unwrap(), data(1), "reader applies rule R-a");
    assert!(dir.exists());
    std::fs::rename(&dir, old_path(&dir, id)).unwrap();
    save_gen(&dir, 2, true).unwrap();
    assert_eq!(read_w(&dir).unwrap(), data(2));
    assert!(siblings(&dir).is_empty(), "{:?}", siblings(&dir));
}

/// Item 10 of issue 23: what the library keeps next to a checkpoint is hidden (a leading
/// `.`), so that listing checkpoints by name (`step-*`, `ck*`) finds only checkpoints.
#[test]
fn lock_staging_and_old_names_are_hidden() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_gen(&dir, 1, false).unwrap();
    save_gen(&dir, 2, true).unwrap();
    let id = zarrckpt::storage::footer::SaveId([9; 16]);
    for p in [lock_path(&dir), staging_path(&dir, id), old_path(&dir, id)] {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".ck.zarrckpt-"), "{name}");
        assert_eq!(p.parent(), dir.parent());
    }
    let visible: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(visible, vec!["ck".to_owned()]);
    assert!(lock_path(&dir).exists());
    assert!(!legacy_lock_path(&dir).exists());
}

/// Item 7 of issue 23: a reader (Checkpoint::open, and so verify, inspect, export, diff)
/// applies rule R-a only: it puts a parked previous checkpoint back and deletes nothing;
/// staging leftovers are removed by the next save or by `recover`.
#[test]
fn readers_restore_but_never_delete() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_gen(&dir, 1, false).unwrap();
    let id = Checkpoint::open(&dir).unwrap().meta().save_id.unwrap();
    let staging = staging_path(&dir, zarrckpt::storage::footer::SaveId([5; 16]));
    let legacy_staging = tmp.path().join("ck.zarrckpt-staging-0123");
    for s in [&staging, &legacy_staging] {
        std::fs::create_dir_all(s.join("tensors")).unwrap();
    }
    // A missing checkpoint with only staging leftovers: not a checkpoint, nothing deleted.
    std::fs::rename(&dir, tmp.path().join("elsewhere")).unwrap();
    assert!(Checkpoint::open(&dir).is_err());
    assert!(staging.exists() && legacy_staging.exists());
    // Parked by the fallback swap: restored by the reader, leftovers kept.
    std::fs::rename(tmp.path().join("elsewhere"), old_path(&dir, id)).unwrap();
    assert_eq!(read_w(&dir).unwrap(), data(1));
    assert!(staging.exists() && legacy_staging.exists());
    // `recover --dry-run` lists them; `recover` removes them.
    let plan = plan_recovery(&dir).unwrap();
    assert_eq!(plan.restore, None);
    assert_eq!(plan.remove.len(), 2, "{plan:?}");
    let lock = try_lock(&dir).unwrap();
    recover(&dir, &lock).unwrap();
    drop(lock);
    assert!(!staging.exists() && !legacy_staging.exists());
    assert_eq!(read_w(&dir).unwrap(), data(1));
}

/// Section 10.5: several committed previous checkpoints parked next to a missing directory
/// cannot be ordered (save ids are random): readers, `recover` and the next save refuse,
/// naming them, and change nothing. The names of earlier versions are recognised too.
#[test]
fn several_parked_checkpoints_are_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, other) = (tmp.path().join("ck"), tmp.path().join("other"));
    save_gen(&dir, 1, false).unwrap();
    save_gen(&other, 2, false).unwrap();
    let id = Checkpoint::open(&dir).unwrap().meta().save_id.unwrap();
    let a = old_path(&dir, id);
    let b = tmp.path().join("ck.zarrckpt-old-ffff"); // the name earlier versions used
    std::fs::rename(&dir, &a).unwrap();
    std::fs::rename(&other, &b).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(
        e.contains(&*a.to_string_lossy()) && e.contains(&*b.to_string_lossy()),
        "{e}"
    );
    assert!(plan_recovery(&dir).is_err());
    assert!(save_gen(&dir, 3, true).is_err());
    assert!(a.exists() && b.exists() && !dir.exists());
    // With one of them gone, the other (legacy name) is restored.
    std::fs::remove_dir_all(&a).unwrap();
    assert_eq!(read_w(&dir).unwrap(), data(2));
    assert!(!b.exists());
}

/// A save by this version excludes a running save of an earlier version, which locks
/// `<dir>.zarrckpt-lock`.
#[test]
fn the_lock_file_of_earlier_versions_is_honoured() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_gen(&dir, 1, false).unwrap();
    let legacy = std::fs::File::create(legacy_lock_path(&dir)).unwrap();
    // SAFETY: a valid descriptor.
    assert_eq!(
        unsafe {
            libc::flock(
                std::os::unix::io::AsRawFd::as_raw_fd(&legacy),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        },
        0
    );
    let e = save_gen(&dir, 2, true).unwrap_err();
    assert!(
        matches!(e, Error::Storage(StorageError::Locked { .. })),
        "{e}"
    );
    drop(legacy);
    save_gen(&dir, 2, true).unwrap();
    assert_eq!(read_w(&dir).unwrap(), data(2));
}

#[test]
fn fallback_swap_works() {
    // Only this test's process reads the variable at swap time; other tests in this binary
    // work either way.
    // SAFETY: set before the save, read by this thread's save only through std::env.
    unsafe { std::env::set_var("ZARRCKPT_NO_RENAME_EXCHANGE", "1") };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_gen(&dir, 1, false).unwrap();
    save_gen(&dir, 2, true).unwrap();
    assert_eq!(read_w(&dir).unwrap(), data(2));
    assert!(siblings(&dir).is_empty(), "{:?}", siblings(&dir));
    unsafe { std::env::remove_var("ZARRCKPT_NO_RENAME_EXCHANGE") };
}

#[test]
fn a_second_save_to_the_same_path_fails_cleanly_on_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    save_gen(&dir, 1, false).unwrap();
    let held = try_lock(&dir).unwrap();
    let d = data(3);
    let res = run_local(3, Duration::from_secs(20), |comm| {
        let p = [ShardedTensor::new(
            TensorKey::new("w").unwrap(),
            DType::UInt32,
            vec![8, 8],
            Region::full(&[8, 8]),
            u32::try_from(zarrckpt::Communicator::rank(&comm)).unwrap(),
            &d,
        )
        .unwrap()];
        let opts = SaveOptions {
            overwrite: true,
            ..Default::default()
        };
        save(&p, &dir, &comm, &opts)
    });
    for r in &res {
        let e = r.as_ref().unwrap_err().to_string();
        assert!(
            e.contains("another save") || e.contains("rank 0 failed"),
            "{e}"
        );
    }
    assert!(matches!(
        res[0].as_ref().unwrap_err(),
        Error::Storage(StorageError::Locked { .. })
    ));
    drop(held);
    assert_eq!(read_w(&dir).unwrap(), data(1));
    assert!(siblings(&dir).is_empty());
}

#[test]
fn manager_keeps_the_last_n_and_resumes_from_the_latest_complete_step() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("run");
    let one: std::sync::Arc<dyn zarrckpt::Communicator> = std::sync::Arc::new(LocalComm::single());
    let mut m = CheckpointManager::new(
        &root,
        zarrckpt::Saver::new(one),
        ManagerOptions {
            keep_last: 2,
            keep_every: Some(4),
        },
    );
    for step in 1..=6u64 {
        let d = data(step as u8);
        let p = [ShardedTensor::new(
            TensorKey::new("w").unwrap(),
            DType::UInt32,
            vec![8, 8],
            Region::full(&[8, 8]),
            0,
            &d,
        )
        .unwrap()];
        m.save(step, &p.to_vec().into(), &SaveOptions::default())
            .unwrap();
    }
    let steps: Vec<u64> = m.steps().unwrap().iter().map(|s| s.step).collect();
    assert_eq!(steps, vec![4, 5, 6]);
    // An incomplete later step (a crashed save) is skipped; so is a stale pointer.
    std::fs::create_dir_all(m.step_dir(7).join("tensors")).unwrap();
    std::fs::write(root.join("latest"), "step-00000099\n").unwrap();
    assert_eq!(m.latest().unwrap(), Some(6));
    let listed = m.steps().unwrap();
    assert!(!listed.iter().find(|s| s.step == 7).unwrap().complete);
    let mut buf = vec![0u8; 256];
    let mut t = [LoadTarget::new(
        TensorKey::new("w").unwrap(),
        DType::UInt32,
        vec![8, 8],
        Region::full(&[8, 8]),
        &mut buf,
    )
    .unwrap()];
    let (step, _) = m
        .load_latest(&mut t, &[], &LoadOptions::default())
        .unwrap()
        .unwrap();
    assert_eq!(step, 6);
    assert_eq!(buf, data(6));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .arg("ls")
        .arg(&root)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("INCOMPLETE") && text.contains("latest complete step: 6"),
        "{text}"
    );
}

#[test]
fn ranks_that_do_not_share_the_storage_fail_the_save_before_any_data_is_written() {
    // Rank 2 sees another file system at the "same" path: here, another directory.
    let tmp = tempfile::tempdir().unwrap();
    let (shared, local) = (tmp.path().join("ck"), tmp.path().join("elsewhere/ck"));
    let d = data(1);
    let res = run_local(3, Duration::from_secs(20), |comm| {
        let r = zarrckpt::Communicator::rank(&comm);
        let p = [ShardedTensor::new(
            TensorKey::new("w").unwrap(),
            DType::UInt32,
            vec![8, 8],
            Region::full(&[8, 8]),
            u32::try_from(r).unwrap(),
            &d,
        )
        .unwrap()];
        let dir = if r == 2 { &local } else { &shared };
        save(&p, dir, &comm, &SaveOptions::default())
    });
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(e, Error::StorageNotShared { ranks, .. } if ranks == &vec![2]),
            "{e}"
        );
        assert!(e.to_string().contains("shared file system"), "{e}");
    }
    assert!(!shared.join("tensors").exists(), "no data written");
    assert!(Checkpoint::open(&shared).is_err());
}
