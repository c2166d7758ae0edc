//! Disk full (ENOSPC) and other write errors during a save, on a small size-limited tmpfs the
//! test mounts (needs root; skipped with a printed reason where mounting is not permitted):
//! every rank gets a clean error, nothing is committed, and the previous checkpoint still
//! loads bit-exactly. Each trial runs uncompressed, zstd-compressed, and through the
//! background [`Saver`] (whose error comes from [`zarrckpt::SaveHandle::wait`]).

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use zarrckpt::comm::run_local;
use zarrckpt::storage::StorageError;
use zarrckpt::{
    Checkpoint, Communicator, Compression, DType, Error, Region, SaveOptions, Saver, ShardedTensor,
    TensorKey, save,
};

const RANKS: usize = 4;

/// A tmpfs mounted for the test, unmounted (lazily) on drop.
struct Tmpfs {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` bytes; `Err` says why it could not.
    fn mount(size: u64) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("fs");
        std::fs::create_dir(&path).map_err(|e| e.to_string())?;
        let target = CString::new(path.to_str().unwrap()).unwrap();
        let opts = CString::new(format!("size={size}")).unwrap();
        // SAFETY: valid NUL-terminated strings for the duration of the call.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(format!(
                "mount -t tmpfs: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Tmpfs { _dir: dir, path })
    }

    /// Remounts it read-only (or read-write again).
    fn remount(&self, read_only: bool) {
        let target = CString::new(self.path.to_str().unwrap()).unwrap();
        let flags = libc::MS_REMOUNT | if read_only { libc::MS_RDONLY } else { 0 };
        // SAFETY: as in `mount`.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                flags,
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "remount: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target = CString::new(self.path.to_str().unwrap()).unwrap();
        // SAFETY: as in `mount`.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Mounts a tmpfs or prints why the test is skipped.
fn tmpfs_or_skip(size: u64) -> Option<Tmpfs> {
    match Tmpfs::mount(size) {
        Ok(t) => Some(t),
        Err(why) => {
            println!("SKIPPED: cannot mount a size-limited tmpfs ({why}); run as root");
            None
        }
    }
}

/// Deterministic bytes of tensor `w` f32 `[rows, 1024]`.
fn tensor(rows: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..rows * 1024 * 4)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// How a trial saves.
#[derive(Debug, Clone, Copy)]
enum How {
    /// `save`, uncompressed.
    Plain,
    /// `save`, zstd.
    Zstd,
    /// `Saver::save_async` then `SaveHandle::wait`, uncompressed.
    Async,
}

const HOWS: [How; 3] = [How::Plain, How::Zstd, How::Async];

/// Saves `w` f32 `[rows, 1024]` split by rows over [`RANKS`] in-process ranks, uncompressed;
/// returns each rank's result.
fn save_rows(dir: &Path, rows: u64, seed: u64, overwrite: bool) -> Vec<zarrckpt::Result<()>> {
    save_rows_by(How::Plain, dir, rows, seed, overwrite)
}

/// [`save_rows`] the way `how` says.
fn save_rows_by(
    how: How,
    dir: &Path,
    rows: u64,
    seed: u64,
    overwrite: bool,
) -> Vec<zarrckpt::Result<()>> {
    let data = tensor(rows, seed);
    let shape = vec![rows, 1024];
    run_local(RANKS, Duration::from_secs(30), |comm| {
        let per = rows / RANKS as u64;
        let r = comm.rank() as u64;
        let row_bytes = 1024 * 4;
        let piece = &data[(r * per * row_bytes) as usize..((r + 1) * per * row_bytes) as usize];
        let st = ShardedTensor::new(
            TensorKey::new("w").unwrap(),
            DType::Float32,
            shape.clone(),
            Region::new(vec![r * per, 0], vec![per, 1024]).unwrap(),
            0,
            piece,
        )
        .unwrap();
        let opts = SaveOptions {
            overwrite,
            io_threads: 2,
            compression: match how {
                How::Zstd => Compression::Zstd,
                How::Plain | How::Async => Compression::None,
            },
            ..Default::default()
        };
        match how {
            How::Plain | How::Zstd => save(&[st], dir, &comm, &opts).map(|_| ()),
            How::Async => {
                let comm: Arc<dyn Communicator> = Arc::new(comm);
                let mut saver = Saver::new(comm);
                saver
                    .save_async(&vec![st].into(), dir, &opts)
                    .and_then(zarrckpt::SaveHandle::wait)
                    .map(|_| ())
            }
        }
    })
}

/// The checkpoint at `dir` holds exactly `w` of `rows` rows from `seed`.
fn assert_holds(dir: &Path, rows: u64, seed: u64) {
    let ck = Checkpoint::open(dir).unwrap();
    assert_eq!(
        ck.read_tensor(&TensorKey::new("w").unwrap()).unwrap(),
        tensor(rows, seed),
        "{} does not hold the expected data",
        dir.display()
    );
    let report = ck.verify(1, None).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// Every rank failed; at least one with the operating system's `os_error` on a file under
/// `under`; none panicked.
fn assert_all_failed(results: &[zarrckpt::Result<()>], os_error: i32, under: &Path) {
    let mut direct = 0;
    for (rank, r) in results.iter().enumerate() {
        let Err(e) = r else {
            panic!("rank {rank} succeeded while the save failed elsewhere");
        };
        if let Error::Storage(StorageError::Io { source, path, .. }) = e
            && source.raw_os_error() == Some(os_error)
        {
            assert!(path.starts_with(under), "rank {rank}: {e}");
            direct += 1;
        }
    }
    assert!(
        direct > 0,
        "no rank reported OS error {os_error}: {results:?}"
    );
}

/// The save at `dir` did not commit.
fn assert_not_committed(dir: &Path) {
    let e = Checkpoint::open(dir).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Storage(StorageError::Incomplete { .. } | StorageError::NotACheckpoint { .. })
        ),
        "{e:?}"
    );
}

#[test]
fn disk_full_during_a_save_is_a_clean_error_on_every_rank() {
    let Some(fs) = tmpfs_or_skip(2 << 20) else {
        return;
    };
    // The previous checkpoint: 256 KiB.
    let prev = fs.path.join("prev");
    for r in save_rows(&prev, 64, 1, false) {
        r.unwrap();
    }
    assert_holds(&prev, 64, 1);
    for how in HOWS {
        // 4 MiB (of random bytes: zstd does not shrink them) into what is left of 2 MiB.
        let next = fs.path.join("next");
        let results = save_rows_by(how, &next, 1024, 2, false);
        assert_all_failed(&results, libc::ENOSPC, &fs.path);
        assert_not_committed(&next);
        assert_holds(&prev, 64, 1);
        std::fs::remove_dir_all(&next).unwrap();
        // 1 MiB with the free space cut at every point of the save (shards, array metadata,
        // the commit): it either commits and loads exactly, or fails cleanly on every rank.
        let filler = fs.path.join("filler");
        let (mut ok, mut failed) = (0, 0);
        for step in 0..24u64 {
            std::fs::write(&filler, vec![0u8; ((step * 64) << 10) as usize]).unwrap_or_else(|e| {
                panic!("filler of {step} x 64 KiB: {e}");
            });
            let dir = fs.path.join(format!("trial{step}"));
            let results = save_rows_by(how, &dir, 256, 3 + step, false);
            if results.iter().all(Result::is_ok) {
                assert_holds(&dir, 256, 3 + step);
                ok += 1;
            } else {
                assert_all_failed(&results, libc::ENOSPC, &fs.path);
                assert_not_committed(&dir);
                failed += 1;
            }
            assert_holds(&prev, 64, 1);
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::remove_file(&filler).unwrap();
        }
        println!("disk-full trials ({how:?}): {ok} saves committed, {failed} failed cleanly");
        assert!(
            ok > 0 && failed > 0,
            "{how:?}: {ok} committed, {failed} failed"
        );
    }
}

#[test]
fn disk_full_during_an_overwrite_keeps_the_previous_checkpoint() {
    let Some(fs) = tmpfs_or_skip(2 << 20) else {
        return;
    };
    let ck = fs.path.join("ck");
    for r in save_rows(&ck, 64, 1, false) {
        r.unwrap();
    }
    for how in HOWS {
        let results = save_rows_by(how, &ck, 1024, 2, true);
        assert_all_failed(&results, libc::ENOSPC, &fs.path);
        assert_holds(&ck, 64, 1);
    }
}

#[test]
fn read_only_file_system_during_a_save_is_a_clean_error_on_every_rank() {
    let Some(fs) = tmpfs_or_skip(2 << 20) else {
        return;
    };
    let prev = fs.path.join("prev");
    for r in save_rows(&prev, 64, 1, false) {
        r.unwrap();
    }
    fs.remount(true);
    let next = fs.path.join("next");
    let results = save_rows(&next, 64, 2, false);
    assert_all_failed(&results, libc::EROFS, &fs.path);
    assert_not_committed(&next);
    assert_holds(&prev, 64, 1);
    fs.remount(false);
}
