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

/// The lock file of the checkpoint at `dir`: `.<name>.zarrckpt-lock`, next to it and hidden
/// (a leading `.`), so that listing the checkpoints of a directory (`step-*`) does not find
/// it. Rank 0 of a save holds an exclusive `flock` on it for the whole save (the kernel
/// releases it when the process dies, so a crashed save leaves no stale lock). The file
/// itself is never removed while the checkpoint exists.
#[must_use]
pub fn lock_path(dir: &Path) -> PathBuf {
    hidden_sibling(dir, LOCK)
}

/// The lock file earlier versions used, `<dir>.zarrckpt-lock` (spec section 10: a save also
/// locks it when it exists, so that it excludes a save by such a version).
#[must_use]
pub fn legacy_lock_path(dir: &Path) -> PathBuf {
    sibling(dir, LOCK)
}

/// The staging directory a save over an existing checkpoint at `dir` writes into:
/// `.<name>.zarrckpt-staging-<save id>`, hidden next to it.
#[must_use]
pub fn staging_path(dir: &Path, id: SaveId) -> PathBuf {
    hidden_sibling(dir, &format!("{STAGING}{id}"))
}

/// Where the fallback of the swap (no `RENAME_EXCHANGE`) parks the previous checkpoint:
/// `.<name>.zarrckpt-old-<save id>`, hidden next to it.
#[must_use]
pub fn old_path(dir: &Path, id: SaveId) -> PathBuf {
    hidden_sibling(dir, &format!("{OLD}{id}"))
}

/// The file rank 0 writes into the target directory and every rank reads back, to check
/// that all ranks see the same storage.
pub const NONCE_FILE: &str = ".zarrckpt-nonce";

const LOCK: &str = ".zarrckpt-lock";
const STAGING: &str = ".zarrckpt-staging-";
const OLD: &str = ".zarrckpt-old-";

fn dir_name(dir: &Path) -> String {
    dir.file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned())
}

/// `<name><suffix>` next to `dir`: the names of earlier versions.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    dir.with_file_name(format!("{}{suffix}", dir_name(dir)))
}

/// `.<name><suffix>` next to `dir`.
fn hidden_sibling(dir: &Path, suffix: &str) -> PathBuf {
    dir.with_file_name(format!(".{}{suffix}", dir_name(dir)))
}

fn parent_of(dir: &Path) -> PathBuf {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// An exclusive `flock` on a checkpoint's lock file (and on the lock file of earlier
/// versions, where one exists), released when dropped (or when the process dies).
#[derive(Debug)]
pub struct SaveLock {
    _file: fs::File,
    path: PathBuf,
    legacy: Option<(fs::File, PathBuf)>,
}

impl SaveLock {
    /// The lock file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every lock file held: [`SaveLock::path`], and the lock file of earlier versions when
    /// it exists (a checkpoint manager removing a step removes both).
    #[must_use]
    pub fn paths(&self) -> Vec<&Path> {
        let mut v = vec![self.path.as_path()];
        v.extend(self.legacy.as_ref().map(|(_, p)| p.as_path()));
        v
    }
}

fn flock_nb(file: &fs::File, dir: &Path, path: &Path) -> Result<(), StorageError> {
    // SAFETY: a valid descriptor; flock has no memory effects.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(StorageError::Locked {
                path: dir.to_owned(),
                lock: path.to_owned(),
            });
        }
        return Err(StorageError::io("lock", path)(e));
    }
    Ok(())
}

/// Takes the save lock of the checkpoint at `dir` without waiting (creating the parent
/// directory and the lock file as needed). Where the lock file of earlier versions
/// (`<dir>.zarrckpt-lock`) exists, it is locked too (never created), so that a save by an
/// earlier version and one by this version exclude each other.
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
    flock_nb(&file, dir, &path)?;
    let legacy_path = legacy_lock_path(dir);
    let legacy = match fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&legacy_path)
    {
        Ok(f) => {
            flock_nb(&f, dir, &legacy_path)?;
            Some((f, legacy_path))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(StorageError::io("open lock file", &legacy_path)(e)),
    };
    Ok(SaveLock {
        _file: file,
        path,
        legacy,
    })
}

/// Siblings of `dir` whose names start with `.<dir name><prefix>` or (earlier versions)
/// `<dir name><prefix>`.
fn siblings_with(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Vec::new();
    };
    let (want, hidden) = (format!("{name}{prefix}"), format!(".{name}{prefix}"));
    let Ok(entries) = fs::read_dir(parent_of(dir)) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with(&want) || n.starts_with(&hidden)
        })
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// What the recovery rules of spec section 10.5 do to the checkpoint at `dir` as things stand
/// ([`plan_recovery`]); [`apply_recovery`] does it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovery {
    /// R-a: the previous checkpoint to rename back to `dir` (which is missing).
    pub restore: Option<PathBuf>,
    /// R-b: leftovers of crashed saves to remove (staging directories; previous checkpoints
    /// parked by the fallback swap, once `dir` exists or is restored).
    pub remove: Vec<PathBuf>,
}

impl Recovery {
    /// True when there is nothing to do.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.restore.is_none() && self.remove.is_empty()
    }
}

/// Which parked previous checkpoint rule R-a restores when `dir` is missing: the committed
/// one if exactly one is committed; the only one if none is committed; otherwise none can be
/// chosen (their save ids carry no order), and the error names them all.
fn choose_old(dir: &Path) -> Result<Option<PathBuf>, StorageError> {
    let olds: Vec<PathBuf> = siblings_with(dir, OLD)
        .into_iter()
        .filter(|p| p.is_dir())
        .collect();
    let committed: Vec<&PathBuf> = olds.iter().filter(|p| has_checkpoint_root(p)).collect();
    let candidates: Vec<&PathBuf> = if committed.is_empty() {
        olds.iter().collect()
    } else {
        committed
    };
    match candidates.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some((*one).clone())),
        many => Err(StorageError::NotACheckpoint {
            path: dir.to_owned(),
            reason: format!(
                "it is missing and {} previous checkpoints were parked next to it by interrupted saves ({}); none can be chosen safely: rename the one to keep to {}",
                many.len(),
                many.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                dir.display()
            ),
        }),
    }
}

/// What the recovery rules would do to the checkpoint at `dir` now (nothing is modified).
///
/// # Errors
/// [`StorageError::NotACheckpoint`] when `dir` is missing and several previous checkpoints
/// could be restored (naming them).
pub fn plan_recovery(dir: &Path) -> Result<Recovery, StorageError> {
    let restore = if dir.exists() { None } else { choose_old(dir)? };
    let mut remove = siblings_with(dir, STAGING);
    if dir.exists() || restore.is_some() {
        remove.extend(
            siblings_with(dir, OLD)
                .into_iter()
                .filter(|p| Some(p) != restore.as_ref()),
        );
    }
    Ok(Recovery { restore, remove })
}

/// Applies the recovery rules (spec section 10.5) to the checkpoint at `dir`; the caller
/// holds its save lock. R-a: if `dir` is missing and a previous checkpoint was parked by the
/// fallback swap, it is renamed back ([`plan_recovery`] says which). R-b: leftovers of crashed
/// saves are removed. Run by a save before it writes, and by `zarrckpt recover`; readers
/// apply R-a only ([`restore_previous`]). Returns what was done.
///
/// # Errors
/// As [`plan_recovery`]; I/O errors naming the path.
pub fn recover(dir: &Path, lock: &SaveLock) -> Result<Recovery, StorageError> {
    let plan = plan_recovery(dir)?;
    apply_recovery(dir, &plan, lock)?;
    Ok(plan)
}

/// Does what [`plan_recovery`] planned; the caller holds the save lock.
///
/// # Errors
/// I/O errors naming the path.
pub fn apply_recovery(dir: &Path, plan: &Recovery, _lock: &SaveLock) -> Result<(), StorageError> {
    if let Some(old) = &plan.restore {
        fs::rename(old, dir).map_err(StorageError::io("rename", old))?;
        fsync_dir(&parent_of(dir))?;
    }
    for p in &plan.remove {
        remove_tree(p)?;
    }
    Ok(())
}

/// Rule R-a alone, as readers apply it: if `dir` is missing and a previous checkpoint was
/// parked by the fallback swap, renames it back. Removes nothing. Returns true when it
/// restored one.
///
/// # Errors
/// As [`plan_recovery`]; I/O errors naming the path.
pub fn restore_previous(dir: &Path, _lock: &SaveLock) -> Result<bool, StorageError> {
    if dir.exists() {
        return Ok(false);
    }
    let Some(old) = choose_old(dir)? else {
        return Ok(false);
    };
    fs::rename(&old, dir).map_err(StorageError::io("rename", &old))?;
    fsync_dir(&parent_of(dir))?;
    Ok(true)
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
                // A save died between the two renames of the fallback swap: rule R-a puts
                // the previous checkpoint back if no save is running. A reader removes
                // nothing (R-b belongs to the next save and to `zarrckpt recover`).
                return match try_lock(dir).and_then(|lock| restore_previous(dir, &lock)) {
                    Ok(true) => read_index(dir),
                    Err(e @ StorageError::NotACheckpoint { .. }) => Err(e),
                    _ => Err(StorageError::NotACheckpoint {
                        path: dir.to_owned(),
                        reason: format!(
                            "a save is replacing it (or died while doing so and this process cannot repair it: run `zarrckpt recover`); the previous checkpoint is at {}",
                            siblings_with(dir, OLD)
                                .iter()
                                .map(|p| p.display().to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
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
