//! The commit protocol (spec § "Commit"): the root `zarr.json` carrying the index is written
//! last, atomically, after every rank's files are durable. Its absence marks a checkpoint as
//! incomplete.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::error::StorageError;
use std::os::unix::io::AsRawFd;

use super::footer::SaveId;
use super::fsio::{create_dir_durable, fsync_dir, replace_durable, write_durable};
use super::meta::{CheckpointMeta, TENSORS_GROUP, tensor_path};
use crate::model::TensorKey;

/// The root metadata file, the commit marker.
pub const ROOT_JSON: &str = "zarr.json";

const GROUP_JSON: &[u8] = br#"{"zarr_format":3,"node_type":"group","attributes":{}}"#;

/// True when the root `zarr.json` of `dir` is a group carrying the `zarrckpt` attribute.
fn has_checkpoint_root(dir: &Path) -> bool {
    let Ok(bytes) = fs::read(dir.join(ROOT_JSON)) else {
        return false;
    };
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return false;
    };
    doc.get("node_type").and_then(|v| v.as_str()) == Some("group")
        && doc
            .get("attributes")
            .and_then(|a| a.get(super::meta::ATTRIBUTE))
            .is_some()
}

/// True when `dir` holds a zarrckpt checkpoint, complete or not, and nothing else: a root
/// `zarr.json` carrying the `zarrckpt` attribute, or no root `zarr.json` but a `tensors/`
/// directory; and no top-level entries but `zarr.json`, `tensors` and leftover temporary
/// files of the commit. Only such a directory is ever deleted by an overwrite.
fn looks_like_checkpoint(dir: &Path) -> bool {
    let root = dir.join(ROOT_JSON);
    let shaped = if root.exists() {
        has_checkpoint_root(dir)
    } else {
        dir.join(TENSORS_GROUP).is_dir() || dir.join(NONCE_FILE).is_file()
    };
    if !shaped {
        return false;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().all(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name == ROOT_JSON
            || name == TENSORS_GROUP
            || name == super::object::OBJECTS_GROUP
            || name.starts_with(".zarr.json.tmp-")
            || name == NONCE_FILE
    })
}

/// The lock file of the checkpoint at `dir`: `<dir>.zarrckpt-lock`, next to it. Rank 0 of a
/// save holds an exclusive `flock` on it for the whole save (the kernel releases it when the
/// process dies, so a crashed save leaves no stale lock). The file itself is never removed
/// while the checkpoint exists.
#[must_use]
pub fn lock_path(dir: &Path) -> PathBuf {
    sibling(dir, ".zarrckpt-lock")
}

/// The staging directory a save over an existing checkpoint at `dir` writes into:
/// `<dir>.zarrckpt-staging-<save id>`.
#[must_use]
pub fn staging_path(dir: &Path, id: SaveId) -> PathBuf {
    sibling(dir, &format!("{STAGING}{id}"))
}

/// Where the fallback of the swap (no `RENAME_EXCHANGE`) parks the previous checkpoint:
/// `<dir>.zarrckpt-old-<save id>`.
#[must_use]
pub fn old_path(dir: &Path, id: SaveId) -> PathBuf {
    sibling(dir, &format!("{OLD}{id}"))
}

/// The file rank 0 writes into the target directory and every rank reads back, to check
/// that all ranks see the same storage.
pub const NONCE_FILE: &str = ".zarrckpt-nonce";

const STAGING: &str = ".zarrckpt-staging-";
const OLD: &str = ".zarrckpt-old-";

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
    dir.with_file_name(format!("{name}{suffix}"))
}

fn parent_of(dir: &Path) -> PathBuf {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// An exclusive `flock` on a checkpoint's lock file, released when dropped (or when the
/// process dies).
#[derive(Debug)]
pub struct SaveLock {
    _file: fs::File,
    path: PathBuf,
}

impl SaveLock {
    /// The lock file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes the save lock of the checkpoint at `dir` without waiting (creating the parent
/// directory and the lock file as needed).
///
/// # Errors
/// [`StorageError::Locked`] when another save (in this or another process) holds it; I/O
/// errors otherwise.
pub fn try_lock(dir: &Path) -> Result<SaveLock, StorageError> {
    create_dir_durable(&parent_of(dir))?;
    let path = lock_path(dir);
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(StorageError::io("open lock file", &path))?;
    // SAFETY: a valid descriptor; flock has no memory effects.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(StorageError::Locked {
                path: dir.to_owned(),
                lock: path,
            });
        }
        return Err(StorageError::io("lock", &path)(e));
    }
    Ok(SaveLock { _file: file, path })
}

/// Siblings of `dir` whose names start with `<dir name><prefix>`.
fn siblings_with(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Vec::new();
    };
    let want = format!("{name}{prefix}");
    let Ok(entries) = fs::read_dir(parent_of(dir)) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&want))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// Applies the recovery rule (spec § "Recovery") to the checkpoint at `dir`; the caller
/// holds its save lock. If `dir` is missing and a `<dir>.zarrckpt-old-*` directory exists (a
/// save died between the two renames of the fallback swap), that is the last good
/// checkpoint: it is renamed back to `dir` (a committed one is preferred). Then leftovers of
/// crashed saves (`<dir>.zarrckpt-staging-*`, and `<dir>.zarrckpt-old-*` once `dir` exists)
/// are removed. Returns true when a checkpoint was restored.
///
/// # Errors
/// I/O errors naming the path.
pub fn recover(dir: &Path, _lock: &SaveLock) -> Result<bool, StorageError> {
    let mut restored = false;
    if !dir.exists() {
        let olds = siblings_with(dir, OLD);
        let best = olds
            .iter()
            .find(|p| has_checkpoint_root(p))
            .or_else(|| olds.first());
        if let Some(old) = best {
            fs::rename(old, dir).map_err(StorageError::io("rename", old))?;
            fsync_dir(&parent_of(dir))?;
            restored = true;
        }
    }
    let mut leftovers = siblings_with(dir, STAGING);
    if dir.exists() {
        leftovers.extend(siblings_with(dir, OLD));
    }
    for p in leftovers {
        remove_tree(&p)?;
    }
    Ok(restored)
}

fn remove_tree(p: &Path) -> Result<(), StorageError> {
    let r = if p.is_dir() {
        fs::remove_dir_all(p)
    } else {
        fs::remove_file(p)
    };
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StorageError::io("remove", p)(e)),
    }
}

/// Where a save writes its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A new (absent or empty) directory, written in place: a crash leaves it incomplete.
    InPlace(PathBuf),
    /// A staging sibling of an existing checkpoint, swapped with it at commit.
    Staging {
        /// The staging directory the files go to.
        staging: PathBuf,
        /// The checkpoint it replaces.
        dir: PathBuf,
    },
}

impl Target {
    /// The target for save `id` into `dir`, as rank 0 chose it (`staged`).
    #[must_use]
    pub fn new(dir: &Path, id: SaveId, staged: bool) -> Self {
        if staged {
            Target::Staging {
                staging: staging_path(dir, id),
                dir: dir.to_owned(),
            }
        } else {
            Target::InPlace(dir.to_owned())
        }
    }

    /// The directory the save's files go to.
    #[must_use]
    pub fn write_dir(&self) -> &Path {
        match self {
            Target::InPlace(d) => d,
            Target::Staging { staging, .. } => staging,
        }
    }
}

/// Prepares the target of a new save into `dir` (run by rank 0, holding the save lock,
/// before any other writes): applies [`recover`], then creates `dir` when it is absent or
/// empty (written in place), or, when `overwrite` is set and it holds a checkpoint, creates
/// the staging sibling the new save writes into. The existing checkpoint is not touched.
///
/// # Errors
/// [`StorageError::AlreadyExists`] when `dir` is not empty and `overwrite` is not set,
/// [`StorageError::NotReplaceable`] when it is not empty and does not look like a checkpoint
/// (never replaced); I/O errors otherwise.
pub fn prepare_target(
    dir: &Path,
    overwrite: bool,
    id: SaveId,
    lock: &SaveLock,
) -> Result<Target, StorageError> {
    recover(dir, lock)?;
    if dir.exists() {
        let mut entries = fs::read_dir(dir).map_err(StorageError::io("list", dir))?;
        if entries.next().is_some() {
            if !overwrite {
                return Err(StorageError::AlreadyExists {
                    path: dir.to_owned(),
                });
            }
            if !looks_like_checkpoint(dir) {
                return Err(StorageError::NotReplaceable {
                    path: dir.to_owned(),
                });
            }
            let t = Target::new(dir, id, true);
            create_dir_durable(t.write_dir())?;
            return Ok(t);
        }
    }
    if dir.exists() {
        // An empty directory the caller made: written in place.
        return Ok(Target::InPlace(dir.to_owned()));
    }
    // A new directory appears with its nonce file already inside (made under the staging
    // name, then renamed), so that a save killed at any point leaves either nothing or a
    // directory that reads as an incomplete checkpoint.
    let fresh = staging_path(dir, id);
    create_dir_durable(&fresh)?;
    write_durable(&fresh.join(NONCE_FILE), &[id.hex().as_bytes()])?;
    fsync_dir(&fresh)?;
    fs::rename(&fresh, dir).map_err(StorageError::io("rename", &fresh))?;
    fsync_dir(&parent_of(dir))?;
    Ok(Target::InPlace(dir.to_owned()))
}

/// Writes the nonce file (the save id) into the target directory, durably.
///
/// # Errors
/// I/O errors naming the path.
pub fn write_nonce(target: &Target, id: SaveId) -> Result<(), StorageError> {
    write_durable(&target.write_dir().join(NONCE_FILE), &[id.hex().as_bytes()])?;
    fsync_dir(target.write_dir())
}

/// True when this process sees the nonce file of save `id` in the target directory.
#[must_use]
pub fn sees_nonce(target: &Target, id: SaveId) -> bool {
    fs::read(target.write_dir().join(NONCE_FILE)).is_ok_and(|b| b == id.hex().as_bytes())
}

/// Commits a save prepared by [`prepare_target`] (rank 0, holding the save lock, once every
/// rank's files are durable): removes the nonce file, writes the root `zarr.json` atomically
/// into the target directory, and, for a staging target, swaps it with the checkpoint it
/// replaces ([`swap`]) and removes the previous checkpoint.
///
/// # Errors
/// I/O errors naming the path.
pub fn commit_target(
    target: &Target,
    meta: &CheckpointMeta,
    _lock: &SaveLock,
) -> Result<(), StorageError> {
    let w = target.write_dir();
    remove_tree(&w.join(NONCE_FILE))?;
    commit(w, meta)?;
    if let Target::Staging { staging, dir } = target {
        let id = meta.save_id.unwrap_or_else(SaveId::random);
        let previous = swap(staging, dir, id)?;
        remove_tree(&previous)?;
        fsync_dir(&parent_of(dir))?;
    }
    Ok(())
}

/// Cleans up after a save that failed before committing (rank 0, best effort): removes a
/// staging directory (the checkpoint it was to replace is untouched). An in-place target is
/// left incomplete (no root `zarr.json`). Other ranks (`lock` is `None`) do nothing.
pub fn abandon(target: &Target, lock: Option<&SaveLock>) {
    if let (Some(_), Target::Staging { staging, .. }) = (lock, target)
        && !has_checkpoint_root(staging)
    {
        let _ = remove_tree(staging);
    }
}

/// True when the fallback swap is forced (for tests): `ZARRCKPT_NO_RENAME_EXCHANGE=1`.
fn exchange_disabled() -> bool {
    std::env::var_os("ZARRCKPT_NO_RENAME_EXCHANGE").is_some_and(|v| v == "1")
}

/// Atomically puts the committed `staging` directory in the place of `dir` and returns where
/// the previous checkpoint now is. With `renameat2(RENAME_EXCHANGE)` the two names are
/// exchanged in one step (`dir` always names a committed checkpoint); where the file system
/// does not support it, `dir` is renamed to `<dir>.zarrckpt-old-<id>` and then `staging` to
/// `dir`, and a crash between the two leaves `dir` missing, which [`recover`] (run by the
/// next save, and by readers that find `dir` missing) repairs. The parent is fsynced.
///
/// # Errors
/// I/O errors naming the path.
pub fn swap(staging: &Path, dir: &Path, id: SaveId) -> Result<PathBuf, StorageError> {
    let parent = parent_of(dir);
    if !exchange_disabled() {
        match rename_exchange(staging, dir) {
            Ok(()) => {
                fsync_dir(&parent)?;
                return Ok(staging.to_owned());
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
                ) => {}
            Err(e) => return Err(StorageError::io("rename (exchange)", dir)(e)),
        }
    }
    let old = old_path(dir, id);
    fs::rename(dir, &old).map_err(StorageError::io("rename", dir))?;
    fsync_dir(&parent)?;
    fs::rename(staging, dir).map_err(StorageError::io("rename", staging))?;
    fsync_dir(&parent)?;
    Ok(old)
}

fn rename_exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: two valid NUL-terminated paths.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Writes the `zarr.json` of the `tensors` group and of every intermediate group implied by
/// hierarchical keys (Zarr v3 has no implicit groups).
///
/// # Errors
/// I/O errors naming the path.
pub fn write_groups<'a>(
    dir: &Path,
    keys: impl IntoIterator<Item = &'a TensorKey>,
) -> Result<(), StorageError> {
    let mut groups: BTreeSet<PathBuf> = BTreeSet::new();
    groups.insert(PathBuf::from(TENSORS_GROUP));
    for key in keys {
        let path = PathBuf::from(tensor_path(key));
        let mut p = path.parent();
        while let Some(g) = p {
            if g.as_os_str().is_empty() {
                break;
            }
            groups.insert(g.to_owned());
            p = g.parent();
        }
    }
    write_group_documents(dir, &groups)
}

/// Writes the group document of each of `groups` (paths relative to `dir`), creating the
/// directories, and makes them durable.
///
/// # Errors
/// I/O errors naming the path.
pub(crate) fn write_group_documents(
    dir: &Path,
    groups: &BTreeSet<PathBuf>,
) -> Result<(), StorageError> {
    for g in groups {
        let d = dir.join(g);
        create_dir_durable(&d)?;
        write_durable(&d.join("zarr.json"), &[GROUP_JSON])?;
    }
    for g in groups {
        fsync_dir(&dir.join(g))?;
    }
    Ok(())
}

/// Commits: atomically writes the root `zarr.json` with the index.
///
/// # Errors
/// I/O errors naming the path.
pub fn commit(dir: &Path, meta: &CheckpointMeta) -> Result<(), StorageError> {
    replace_durable(&dir.join(ROOT_JSON), &meta.to_root_json())
}

/// Reads and validates the index of a committed checkpoint.
///
/// # Errors
/// [`StorageError::Incomplete`] when the directory holds a save that never committed,
/// [`StorageError::NotACheckpoint`] when it holds no checkpoint at all, and the errors of
/// [`CheckpointMeta::from_root_json`].
pub fn read_index(dir: &Path) -> Result<CheckpointMeta, StorageError> {
    let path = dir.join(ROOT_JSON);
    // Opened first so that a missing file keeps its own branch; read with a size cap.
    let opened = fs::File::open(&path).map(drop);
    match opened.map(|()| super::meta::read_metadata_file(&path, super::meta::MAX_ROOT_JSON_BYTES))
    {
        Ok(bytes) => CheckpointMeta::from_root_json(&bytes?, &path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !dir.exists() && !siblings_with(dir, OLD).is_empty() {
                // A save died between the two renames of the fallback swap: restore the
                // previous checkpoint if no save is running, else say what is going on.
                return match try_lock(dir) {
                    Ok(lock) if recover(dir, &lock).unwrap_or(false) => {
                        drop(lock);
                        read_index(dir)
                    }
                    _ => Err(StorageError::NotACheckpoint {
                        path: dir.to_owned(),
                        reason: format!(
                            "a save is replacing it (or died while doing so and this process cannot repair it); the previous checkpoint is at {}",
                            siblings_with(dir, OLD)
                                .first()
                                .map_or_else(String::new, |p| p.display().to_string())
                        ),
                    }),
                };
            }
            if !dir.exists() {
                Err(StorageError::NotACheckpoint {
                    path: dir.to_owned(),
                    reason: "no such directory".into(),
                })
            } else if dir.join(TENSORS_GROUP).is_dir() || dir.join(NONCE_FILE).exists() {
                Err(StorageError::Incomplete {
                    path: dir.to_owned(),
                })
            } else {
                Err(StorageError::NotACheckpoint {
                    path: dir.to_owned(),
                    reason: "no root zarr.json".into(),
                })
            }
        }
        Err(e) => Err(StorageError::io("read", &path)(e)),
    }
}
