//! The commit protocol (spec § "Commit"): the root `zarr.json` carrying the index is written
//! last, atomically, after every rank's files are durable. Its absence marks a checkpoint as
//! incomplete.
//!
//! The protocol is written against the storage seam ([`Store`]). Which form a store uses is
//! chosen by its capabilities ([`CommitKind::for_capabilities`]):
//! - [`CommitKind::Rename`], stores that rename directories and lock (the local file system,
//!   [`RenameCommit`]): rank 0 holds a `flock` on a lock file next to the checkpoint for the
//!   whole save; a new checkpoint is written in place, a save over an existing one into a
//!   staging sibling that is swapped in (`renameat2(RENAME_EXCHANGE)`, or two renames and
//!   recovery rules R-a / R-b where the file system lacks the exchange);
//! - [`CommitKind::Pointer`], stores with conditional puts and no rename (object stores):
//!   each save writes a generation prefix, and the commit moves a pointer object to it by
//!   put-if-match. That store's module implements it as another [`CommitProtocol`].
//!
//! The free functions below ([`try_lock`], [`prepare_target`], [`commit_target`], ...) are
//! the rename protocol on the local file system, for callers that hold a directory path.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::error::StorageError;
use super::footer::SaveId;
use super::meta::{ATTRIBUTE, CheckpointMeta, MAX_ROOT_JSON_BYTES, TENSORS_GROUP, tensor_path};
use super::store::{Capabilities, LocalStore, LockMode, RenameMode, Store, StoreLock, join};
use crate::model::TensorKey;

/// The root metadata file, the commit marker.
pub const ROOT_JSON: &str = "zarr.json";

/// The file rank 0 writes into the target directory and every rank reads back, to check
/// that all ranks see the same storage.
pub const NONCE_FILE: &str = ".zarrckpt-nonce";

const LOCK: &str = ".zarrckpt-lock";
const STAGING: &str = ".zarrckpt-staging-";
const OLD: &str = ".zarrckpt-old-";

/// Which commit protocol a store uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitKind {
    /// Lock file, staging sibling, atomic directory swap ([`RenameCommit`]).
    Rename,
    /// Generation prefixes and a pointer object moved by put-if-match (object stores).
    Pointer,
}

impl CommitKind {
    /// The protocol a store with `caps` uses: [`CommitKind::Rename`] where it renames
    /// directories and locks, [`CommitKind::Pointer`] where it has conditional puts, `None`
    /// where it has neither (no safe commit exists on it).
    #[must_use]
    pub fn for_capabilities(caps: Capabilities) -> Option<CommitKind> {
        if caps.rename && caps.lock && caps.directories {
            Some(CommitKind::Rename)
        } else if caps.conditional_put {
            Some(CommitKind::Pointer)
        } else {
            None
        }
    }
}

/// The commit protocol of one checkpoint in one store: every step a save, a reader and
/// `zarrckpt recover` take that depends on how the store makes a save visible atomically.
pub trait CommitProtocol: std::fmt::Debug + Send + Sync {
    /// Which protocol this is.
    fn kind(&self) -> CommitKind;

    /// How the checkpoint is named in messages (its directory or URL).
    fn dir(&self) -> &Path;

    /// Takes the save lock without waiting (rank 0, for the whole save).
    ///
    /// # Errors
    /// [`StorageError::Locked`] when another save holds it; I/O errors otherwise.
    fn try_lock(&self) -> Result<SaveLock, StorageError>;

    /// What recovery would do now (nothing is modified).
    ///
    /// # Errors
    /// [`StorageError::NotACheckpoint`] when no safe choice exists; I/O errors.
    fn plan_recovery(&self) -> Result<Recovery, StorageError>;

    /// Does what [`CommitProtocol::plan_recovery`] planned; the caller holds the save lock.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn apply_recovery(&self, plan: &Recovery, lock: &SaveLock) -> Result<(), StorageError>;

    /// Plans and applies recovery; returns what was done.
    ///
    /// # Errors
    /// As [`CommitProtocol::plan_recovery`] and [`CommitProtocol::apply_recovery`].
    fn recover(&self, lock: &SaveLock) -> Result<Recovery, StorageError> {
        let plan = self.plan_recovery()?;
        self.apply_recovery(&plan, lock)?;
        Ok(plan)
    }

    /// Prepares the target of save `id` (rank 0, holding the lock, before other writes).
    ///
    /// # Errors
    /// [`StorageError::AlreadyExists`], [`StorageError::NotReplaceable`]; I/O errors.
    fn prepare(&self, overwrite: bool, id: SaveId, lock: &SaveLock)
    -> Result<Target, StorageError>;

    /// Writes the nonce of save `id` into the target, durably.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn write_nonce(&self, target: &Target, id: SaveId) -> Result<(), StorageError>;

    /// True when this process sees the nonce of save `id` in the target.
    fn sees_nonce(&self, target: &Target, id: SaveId) -> bool;

    /// Commits a prepared save once every rank's files are durable (rank 0, holding the
    /// lock): after it returns, readers see the new index.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn commit(
        &self,
        target: &Target,
        meta: &CheckpointMeta,
        lock: &SaveLock,
    ) -> Result<(), StorageError>;

    /// Cleans up after a save that failed before committing (best effort; rank 0 passes its
    /// lock, other ranks `None` and do nothing).
    fn abandon(&self, target: &Target, lock: Option<&SaveLock>);

    /// Reads and validates the committed index.
    ///
    /// # Errors
    /// [`StorageError::Incomplete`], [`StorageError::NotACheckpoint`], and the errors of
    /// [`CheckpointMeta::from_root_json`].
    fn read_index(&self) -> Result<CheckpointMeta, StorageError>;
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

/// The save lock: the store locks held for the whole save (released when dropped, or when
/// the process dies).
#[derive(Debug)]
pub struct SaveLock {
    _held: Vec<Box<dyn StoreLock>>,
    path: PathBuf,
    legacy: Option<PathBuf>,
}

impl SaveLock {
    /// A save lock made of the store locks `held`, named by `path` (and, where one was also
    /// locked, the lock file of earlier versions `legacy`). For commit protocols of other
    /// stores, which may hold no store lock at all (`held` empty).
    #[must_use]
    pub fn from_parts(
        held: Vec<Box<dyn StoreLock>>,
        path: PathBuf,
        legacy: Option<PathBuf>,
    ) -> Self {
        SaveLock {
            _held: held,
            path,
            legacy,
        }
    }

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
        v.extend(self.legacy.as_deref());
        v
    }
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

    /// The checkpoint the save commits to.
    #[must_use]
    pub fn dir(&self) -> &Path {
        match self {
            Target::InPlace(d) | Target::Staging { dir: d, .. } => d,
        }
    }
}

/// The rename commit protocol ([`CommitKind::Rename`]) of the checkpoint `name` at the root
/// of `store` (its siblings, the lock file and the staging and parked directories, are next
/// to it in the same store). On the local file system: [`RenameCommit::local`].
#[derive(Debug, Clone)]
pub struct RenameCommit<S: Store = LocalStore> {
    store: S,
    name: String,
    dir: PathBuf,
}

impl RenameCommit<LocalStore> {
    /// The protocol of the checkpoint directory `dir` (a store rooted at its parent).
    #[must_use]
    pub fn local(dir: &Path) -> Self {
        let named = if dir.file_name().is_none() {
            // `..` or `/`: the directory it names, which has a name.
            std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned())
        } else {
            dir.to_owned()
        };
        let (store, name) = LocalStore::around(&named);
        RenameCommit {
            store,
            name,
            dir: dir.to_owned(),
        }
    }
}

impl<S: Store> RenameCommit<S> {
    /// The protocol of checkpoint `name` at the root of `store`.
    ///
    /// # Errors
    /// [`StorageError::Unsupported`] when `store` cannot rename directories or lock.
    pub fn new(store: S, name: String) -> Result<Self, StorageError> {
        let dir = store.display_path(&name);
        if CommitKind::for_capabilities(store.capabilities()) != Some(CommitKind::Rename) {
            return Err(StorageError::Unsupported {
                op: "the rename commit protocol (directory rename and locks)",
                path: dir,
            });
        }
        Ok(RenameCommit { store, name, dir })
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    fn hidden(&self, suffix: &str) -> String {
        format!(".{}{suffix}", self.name)
    }

    /// The location of a sibling named by a path this protocol made.
    fn loc(p: &Path) -> String {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    fn path(&self, loc: &str) -> PathBuf {
        self.store.display_path(loc)
    }

    /// The names at the root of the store (directories and files) that start with
    /// `.<name><prefix>` or (earlier versions) `<name><prefix>`, sorted; with `dirs_only`,
    /// directories only.
    fn siblings_with(&self, prefix: &str, dirs_only: bool) -> Vec<String> {
        let (want, hidden) = (format!("{}{prefix}", self.name), self.hidden(prefix));
        let Ok(list) = self.store.list_with_delimiter("") else {
            return Vec::new();
        };
        let files = list.objects.into_iter().map(|o| o.location);
        let mut v: Vec<String> = list
            .common_prefixes
            .into_iter()
            .chain(files.filter(|_| !dirs_only))
            .filter(|n| n.starts_with(&want) || n.starts_with(&hidden))
            .collect();
        v.sort();
        v
    }

    /// True when `loc` is a prefix (a directory).
    fn is_prefix(&self, loc: &str) -> bool {
        self.store.prefix_exists(loc).unwrap_or(false)
    }

    /// True when `loc` exists, as a prefix or an object.
    fn exists(&self, loc: &str) -> bool {
        self.is_prefix(loc) || self.store.head(loc).is_ok()
    }

    /// Reads a metadata document of at most `max` bytes; `None` when it is absent.
    fn read_doc(&self, loc: &str, max: u64) -> Result<Option<Vec<u8>>, StorageError> {
        if let Some(p) = self.store.local_path(loc) {
            return match super::doc::read_metadata_file(&p, max) {
                Ok(b) => Ok(Some(b)),
                Err(StorageError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    Ok(None)
                }
                Err(e) => Err(e),
            };
        }
        match self.store.get(loc, max) {
            Ok(b) => Ok(Some(b)),
            Err(StorageError::NotFound { .. }) => Ok(None),
            Err(StorageError::TooLarge { path, .. }) => Err(StorageError::Malformed {
                path,
                reason: format!("the file is larger than the {max} bytes a reader accepts"),
            }),
            Err(e) => Err(e),
        }
    }

    /// True when the root `zarr.json` of `prefix` is a group carrying the `zarrckpt`
    /// attribute.
    fn has_checkpoint_root(&self, prefix: &str) -> bool {
        let Ok(Some(bytes)) = self.read_doc(&join(prefix, ROOT_JSON), MAX_ROOT_JSON_BYTES) else {
            return false;
        };
        let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
            return false;
        };
        doc.get("node_type").and_then(|v| v.as_str()) == Some("group")
            && doc
                .get("attributes")
                .and_then(|a| a.get(ATTRIBUTE))
                .is_some()
    }

    /// True when the checkpoint holds a zarrckpt checkpoint, complete or not, and nothing
    /// else: a root `zarr.json` carrying the `zarrckpt` attribute, or no root `zarr.json` but
    /// a `tensors/` directory (or the nonce file); and no top-level entries but `zarr.json`,
    /// `tensors`, `objects`, the nonce file and leftover temporary files of the commit. Only
    /// such a directory is ever replaced by an overwrite.
    fn looks_like_checkpoint(&self) -> bool {
        let n = &self.name;
        let root = join(n, ROOT_JSON);
        let shaped = if self.exists(&root) {
            self.has_checkpoint_root(n)
        } else {
            self.is_prefix(&join(n, TENSORS_GROUP)) || self.store.head(&join(n, NONCE_FILE)).is_ok()
        };
        if !shaped {
            return false;
        }
        let Ok(list) = self.store.list_with_delimiter(n) else {
            return false;
        };
        let files = list.objects.into_iter().map(|o| o.location);
        list.common_prefixes.into_iter().chain(files).all(|loc| {
            let name = super::store::file_name(&loc);
            name == ROOT_JSON
                || name == TENSORS_GROUP
                || name == super::object::OBJECTS_GROUP
                || name.starts_with(".zarr.json.tmp-")
                || name == NONCE_FILE
        })
    }

    /// Which parked previous checkpoint rule R-a restores when the checkpoint is missing:
    /// the committed one if exactly one is committed; the only one if none is committed;
    /// otherwise none can be chosen (their save ids carry no order), and the error names
    /// them all.
    fn choose_old(&self) -> Result<Option<String>, StorageError> {
        let olds = self.siblings_with(OLD, true);
        let committed: Vec<&String> = olds
            .iter()
            .filter(|p| self.has_checkpoint_root(p))
            .collect();
        let candidates: Vec<&String> = if committed.is_empty() {
            olds.iter().collect()
        } else {
            committed
        };
        match candidates.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some((*one).clone())),
            many => Err(StorageError::NotACheckpoint {
                path: self.dir.clone(),
                reason: format!(
                    "it is missing and {} previous checkpoints were parked next to it by interrupted saves ({}); none can be chosen safely: rename the one to keep to {}",
                    many.len(),
                    many.iter()
                        .map(|p| self.path(p).display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.dir.display()
                ),
            }),
        }
    }

    /// Rule R-a alone, as readers apply it: if the checkpoint is missing and a previous
    /// checkpoint was parked by the fallback swap, renames it back. Removes nothing.
    /// Returns true when it restored one.
    ///
    /// # Errors
    /// As [`CommitProtocol::plan_recovery`]; I/O errors naming the path.
    pub fn restore_previous(&self, _lock: &SaveLock) -> Result<bool, StorageError> {
        if self.exists(&self.name) {
            return Ok(false);
        }
        let Some(old) = self.choose_old()? else {
            return Ok(false);
        };
        self.store.rename(&old, &self.name, RenameMode::Replace)?;
        self.store.sync_prefix("")?;
        Ok(true)
    }

    /// Writes `bytes` to `loc` in place and makes it durable (create, write, fsync).
    fn write_durable(&self, loc: &str, bytes: &[u8]) -> Result<(), StorageError> {
        let mut w = self.store.put_multipart(loc)?;
        w.write(bytes)?;
        w.finish()?;
        self.store.sync(loc)
    }

    /// Atomically puts the committed staging prefix `staging` in the place of the
    /// checkpoint and returns where the previous checkpoint now is. With an atomic exchange
    /// ([`RenameMode::Exchange`]) the two names are exchanged in one step (the checkpoint
    /// always names a committed one); where the store cannot, the checkpoint is renamed to
    /// `.<name>.zarrckpt-old-<id>` and then `staging` to its name, and a crash between the
    /// two leaves it missing, which recovery (run by the next save, and by readers that find
    /// it missing) repairs. The parent is synced.
    ///
    /// # Errors
    /// I/O errors naming the path.
    pub fn swap(&self, staging: &str, id: SaveId) -> Result<String, StorageError> {
        if !exchange_disabled() {
            match self.store.rename(staging, &self.name, RenameMode::Exchange) {
                Ok(()) => {
                    self.store.sync_prefix("")?;
                    return Ok(staging.to_owned());
                }
                Err(StorageError::Unsupported { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let old = self.hidden(&format!("{OLD}{id}"));
        self.store.rename(&self.name, &old, RenameMode::Replace)?;
        self.store.sync_prefix("")?;
        self.store
            .rename(staging, &self.name, RenameMode::Replace)?;
        self.store.sync_prefix("")?;
        Ok(old)
    }

    /// The save lock for a reader's repair, waiting up to [`READER_LOCK_WAIT`] while it is
    /// held: a save that is ending, or a child process that inherited the lock's descriptor
    /// between its fork and its exec, holds it for moments; a running save holds it longer,
    /// and the reader then gets [`StorageError::Locked`].
    fn lock_briefly(&self) -> Result<SaveLock, StorageError> {
        let t0 = std::time::Instant::now();
        loop {
            match self.try_lock() {
                Err(StorageError::Locked { .. }) if t0.elapsed() < READER_LOCK_WAIT => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                r => return r,
            }
        }
    }

    fn lock_error(&self, e: StorageError) -> StorageError {
        match e {
            StorageError::Locked { lock, .. } => StorageError::Locked {
                path: self.dir.clone(),
                lock,
            },
            e => e,
        }
    }
}

/// How long a reader that finds a checkpoint parked waits for the save lock before it gives
/// up repairing it.
const READER_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl<S: Store> CommitProtocol for RenameCommit<S> {
    fn kind(&self) -> CommitKind {
        CommitKind::Rename
    }

    fn dir(&self) -> &Path {
        &self.dir
    }

    /// Takes the save lock without waiting (creating the parent directory and the lock file
    /// as needed). Where the lock file of earlier versions (`<dir>.zarrckpt-lock`) exists, it
    /// is locked too (never created), so that a save by an earlier version and one by this
    /// version exclude each other.
    fn try_lock(&self) -> Result<SaveLock, StorageError> {
        self.store.create_prefix("")?;
        let main = self.hidden(LOCK);
        let held = self
            .store
            .try_lock(&main, LockMode::Create)
            .map_err(|e| self.lock_error(e))?;
        let legacy = format!("{}{LOCK}", self.name);
        let legacy_held = self
            .store
            .try_lock(&legacy, LockMode::Existing)
            .map_err(|e| self.lock_error(e))?;
        let legacy_path = legacy_held.as_ref().map(|_| self.path(&legacy));
        Ok(SaveLock::from_parts(
            held.into_iter().chain(legacy_held).collect(),
            self.path(&main),
            legacy_path,
        ))
    }

    fn plan_recovery(&self) -> Result<Recovery, StorageError> {
        let exists = self.exists(&self.name);
        let restore = if exists { None } else { self.choose_old()? };
        let mut remove = self.siblings_with(STAGING, false);
        if exists || restore.is_some() {
            remove.extend(
                self.siblings_with(OLD, false)
                    .into_iter()
                    .filter(|p| Some(p) != restore.as_ref()),
            );
        }
        Ok(Recovery {
            restore: restore.map(|r| self.path(&r)),
            remove: remove.iter().map(|r| self.path(r)).collect(),
        })
    }

    fn apply_recovery(&self, plan: &Recovery, _lock: &SaveLock) -> Result<(), StorageError> {
        if let Some(old) = &plan.restore {
            self.store
                .rename(&Self::loc(old), &self.name, RenameMode::Replace)?;
            self.store.sync_prefix("")?;
        }
        for p in &plan.remove {
            self.store.delete_prefix(&Self::loc(p))?;
        }
        Ok(())
    }

    /// Applies recovery, then uses the checkpoint in place when it is absent or empty, or,
    /// when `overwrite` is set and it holds a checkpoint, creates the staging sibling the new
    /// save writes into. The existing checkpoint is not touched.
    fn prepare(
        &self,
        overwrite: bool,
        id: SaveId,
        lock: &SaveLock,
    ) -> Result<Target, StorageError> {
        self.recover(lock)?;
        let n = &self.name;
        if self.store.head(n).is_ok() {
            // A file where the checkpoint directory goes: never replaced.
            return Err(if overwrite {
                StorageError::NotReplaceable {
                    path: self.dir.clone(),
                }
            } else {
                StorageError::AlreadyExists {
                    path: self.dir.clone(),
                }
            });
        }
        if self.exists(n) {
            let list = self.store.list_with_delimiter(n)?;
            if !list.objects.is_empty() || !list.common_prefixes.is_empty() {
                if !overwrite {
                    return Err(StorageError::AlreadyExists {
                        path: self.dir.clone(),
                    });
                }
                if !self.looks_like_checkpoint() {
                    return Err(StorageError::NotReplaceable {
                        path: self.dir.clone(),
                    });
                }
                let staging = self.hidden(&format!("{STAGING}{id}"));
                self.store.create_prefix(&staging)?;
                return Ok(Target::Staging {
                    staging: self.path(&staging),
                    dir: self.dir.clone(),
                });
            }
            // An empty directory the caller made: written in place.
            return Ok(Target::InPlace(self.dir.clone()));
        }
        // A new directory appears with its nonce file already inside (made under the staging
        // name, then renamed), so that a save killed at any point leaves either nothing or a
        // directory that reads as an incomplete checkpoint.
        let fresh = self.hidden(&format!("{STAGING}{id}"));
        self.store.create_prefix(&fresh)?;
        self.write_durable(&join(&fresh, NONCE_FILE), id.hex().as_bytes())?;
        self.store.sync_prefix(&fresh)?;
        self.store.rename(&fresh, n, RenameMode::Replace)?;
        self.store.sync_prefix("")?;
        Ok(Target::InPlace(self.dir.clone()))
    }

    fn write_nonce(&self, target: &Target, id: SaveId) -> Result<(), StorageError> {
        let w = Self::loc(target.write_dir());
        self.write_durable(&join(&w, NONCE_FILE), id.hex().as_bytes())?;
        self.store.sync_prefix(&w)
    }

    fn sees_nonce(&self, target: &Target, id: SaveId) -> bool {
        let w = Self::loc(target.write_dir());
        self.store
            .get(&join(&w, NONCE_FILE), 64)
            .is_ok_and(|b| b == id.hex().as_bytes())
    }

    /// Removes the nonce file, writes the root `zarr.json` atomically into the target, and,
    /// for a staging target, swaps it with the checkpoint it replaces
    /// ([`RenameCommit::swap`]) and removes the previous checkpoint.
    fn commit(
        &self,
        target: &Target,
        meta: &CheckpointMeta,
        _lock: &SaveLock,
    ) -> Result<(), StorageError> {
        let w = Self::loc(target.write_dir());
        self.store.delete(&join(&w, NONCE_FILE))?;
        self.store
            .put(&join(&w, ROOT_JSON), &[&meta.to_root_json()])?;
        if let Target::Staging { .. } = target {
            let id = meta.save_id.unwrap_or_else(SaveId::random);
            let previous = self.swap(&w, id)?;
            self.store.delete_prefix(&previous)?;
            self.store.sync_prefix("")?;
        }
        Ok(())
    }

    /// Removes a staging directory (the checkpoint it was to replace is untouched). An
    /// in-place target is left incomplete (no root `zarr.json`).
    fn abandon(&self, target: &Target, lock: Option<&SaveLock>) {
        if let (Some(_), Target::Staging { staging, .. }) = (lock, target) {
            let s = Self::loc(staging);
            if !self.has_checkpoint_root(&s) {
                let _ = self.store.delete_prefix(&s);
            }
        }
    }

    fn read_index(&self) -> Result<CheckpointMeta, StorageError> {
        let n = &self.name;
        let root = join(n, ROOT_JSON);
        let path = self.path(&root);
        if let Some(bytes) = self.read_doc(&root, MAX_ROOT_JSON_BYTES)? {
            return CheckpointMeta::from_root_json(&bytes, &path);
        }
        let exists = self.exists(n);
        let olds = self.siblings_with(OLD, false);
        if !exists && !olds.is_empty() {
            // A save died between the two renames of the fallback swap: rule R-a puts the
            // previous checkpoint back if no save is running. A reader removes nothing (R-b
            // belongs to the next save and to `zarrckpt recover`).
            return match self
                .lock_briefly()
                .and_then(|lock| self.restore_previous(&lock))
            {
                Ok(true) => self.read_index(),
                Err(e @ StorageError::NotACheckpoint { .. }) => Err(e),
                _ => Err(StorageError::NotACheckpoint {
                    path: self.dir.clone(),
                    reason: format!(
                        "a save is replacing it (or died while doing so and this process cannot repair it: run `zarrckpt recover`); the previous checkpoint is at {}",
                        self.siblings_with(OLD, false)
                            .iter()
                            .map(|p| self.path(p).display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                }),
            };
        }
        if !exists {
            Err(StorageError::NotACheckpoint {
                path: self.dir.clone(),
                reason: "no such directory".into(),
            })
        } else if self.is_prefix(&join(n, TENSORS_GROUP))
            || self.store.head(&join(n, NONCE_FILE)).is_ok()
        {
            Err(StorageError::Incomplete {
                path: self.dir.clone(),
            })
        } else {
            Err(StorageError::NotACheckpoint {
                path: self.dir.clone(),
                reason: "no root zarr.json".into(),
            })
        }
    }
}

/// True when the fallback swap is forced (for tests): `ZARRCKPT_NO_RENAME_EXCHANGE=1`.
fn exchange_disabled() -> bool {
    std::env::var_os("ZARRCKPT_NO_RENAME_EXCHANGE").is_some_and(|v| v == "1")
}

/// Takes the save lock of the checkpoint at `dir` without waiting
/// ([`CommitProtocol::try_lock`] of [`RenameCommit::local`]).
///
/// # Errors
/// [`StorageError::Locked`] when another save (in this or another process) holds it; I/O
/// errors otherwise.
pub fn try_lock(dir: &Path) -> Result<SaveLock, StorageError> {
    RenameCommit::local(dir).try_lock()
}

/// What the recovery rules would do to the checkpoint at `dir` now (nothing is modified).
///
/// # Errors
/// [`StorageError::NotACheckpoint`] when `dir` is missing and several previous checkpoints
/// could be restored (naming them).
pub fn plan_recovery(dir: &Path) -> Result<Recovery, StorageError> {
    RenameCommit::local(dir).plan_recovery()
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
    RenameCommit::local(dir).recover(lock)
}

/// Does what [`plan_recovery`] planned; the caller holds the save lock.
///
/// # Errors
/// I/O errors naming the path.
pub fn apply_recovery(dir: &Path, plan: &Recovery, lock: &SaveLock) -> Result<(), StorageError> {
    RenameCommit::local(dir).apply_recovery(plan, lock)
}

/// Rule R-a alone, as readers apply it ([`RenameCommit::restore_previous`]).
///
/// # Errors
/// As [`plan_recovery`]; I/O errors naming the path.
pub fn restore_previous(dir: &Path, lock: &SaveLock) -> Result<bool, StorageError> {
    RenameCommit::local(dir).restore_previous(lock)
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
    RenameCommit::local(dir).prepare(overwrite, id, lock)
}

/// Writes the nonce file (the save id) into the target directory, durably.
///
/// # Errors
/// I/O errors naming the path.
pub fn write_nonce(target: &Target, id: SaveId) -> Result<(), StorageError> {
    RenameCommit::local(target.dir()).write_nonce(target, id)
}

/// True when this process sees the nonce file of save `id` in the target directory.
#[must_use]
pub fn sees_nonce(target: &Target, id: SaveId) -> bool {
    RenameCommit::local(target.dir()).sees_nonce(target, id)
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
    lock: &SaveLock,
) -> Result<(), StorageError> {
    RenameCommit::local(target.dir()).commit(target, meta, lock)
}

/// Cleans up after a save that failed before committing (rank 0, best effort): removes a
/// staging directory (the checkpoint it was to replace is untouched). An in-place target is
/// left incomplete (no root `zarr.json`). Other ranks (`lock` is `None`) do nothing.
pub fn abandon(target: &Target, lock: Option<&SaveLock>) {
    RenameCommit::local(target.dir()).abandon(target, lock);
}

/// Atomically puts the committed `staging` directory in the place of `dir` and returns where
/// the previous checkpoint now is ([`RenameCommit::swap`]; `staging` is a sibling of `dir`).
///
/// # Errors
/// I/O errors naming the path.
pub fn swap(staging: &Path, dir: &Path, id: SaveId) -> Result<PathBuf, StorageError> {
    let c = RenameCommit::local(dir);
    let previous = c.swap(&RenameCommit::<LocalStore>::loc(staging), id)?;
    Ok(c.path(&previous))
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
    write_groups_to(&LocalStore::new(dir), keys)
}

/// [`write_groups`] into `store` (holding the checkpoint at its root).
///
/// # Errors
/// I/O errors naming the object.
pub fn write_groups_to<'a>(
    store: &dyn Store,
    keys: impl IntoIterator<Item = &'a TensorKey>,
) -> Result<(), StorageError> {
    let mut groups: BTreeSet<String> = BTreeSet::new();
    groups.insert(TENSORS_GROUP.to_owned());
    for key in keys {
        super::groups::insert_parents(&mut groups, &tensor_path(key));
    }
    let groups: Vec<String> = groups.into_iter().collect();
    super::groups::write_group_documents_to(store, &groups)
}

/// Commits: atomically writes the root `zarr.json` with the index, durably.
///
/// # Errors
/// I/O errors naming the path.
pub fn commit(dir: &Path, meta: &CheckpointMeta) -> Result<(), StorageError> {
    LocalStore::new(dir)
        .put(ROOT_JSON, &[&meta.to_root_json()])
        .map(drop)
}

/// Reads and validates the index of a committed checkpoint
/// ([`CommitProtocol::read_index`] of [`RenameCommit::local`]).
///
/// # Errors
/// [`StorageError::Incomplete`] when the directory holds a save that never committed,
/// [`StorageError::NotACheckpoint`] when it holds no checkpoint at all, and the errors of
/// [`CheckpointMeta::from_root_json`].
pub fn read_index(dir: &Path) -> Result<CheckpointMeta, StorageError> {
    RenameCommit::local(dir).read_index()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_chosen_by_capabilities() {
        let local = LocalStore::new(".").capabilities();
        assert_eq!(
            CommitKind::for_capabilities(local),
            Some(CommitKind::Rename)
        );
        let object_store = Capabilities {
            conditional_put: true,
            ..Capabilities::default()
        };
        assert_eq!(
            CommitKind::for_capabilities(object_store),
            Some(CommitKind::Pointer)
        );
        assert_eq!(CommitKind::for_capabilities(Capabilities::default()), None);
    }

    /// The whole rename protocol through the trait, on a store rooted elsewhere: a new
    /// checkpoint in place, then one over it through staging, each read back.
    #[test]
    fn rename_protocol_through_the_trait() {
        let tmp = tempfile::tempdir().unwrap();
        let c: Box<dyn CommitProtocol> =
            Box::new(RenameCommit::new(LocalStore::new(tmp.path()), "ck".into()).unwrap());
        assert_eq!(c.kind(), CommitKind::Rename);
        assert!(matches!(
            c.read_index(),
            Err(StorageError::NotACheckpoint { .. })
        ));
        for (round, overwrite) in [(0u8, false), (1, true)] {
            let id = SaveId([round + 1; 16]);
            let lock = c.try_lock().unwrap();
            assert!(matches!(c.try_lock(), Err(StorageError::Locked { .. })));
            let t = c.prepare(overwrite, id, &lock).unwrap();
            assert_eq!(matches!(t, Target::Staging { .. }), round == 1);
            c.write_nonce(&t, id).unwrap();
            assert!(c.sees_nonce(&t, id));
            assert!(!c.sees_nonce(&t, SaveId([9; 16])));
            if round == 0 {
                assert!(matches!(
                    c.read_index(),
                    Err(StorageError::Incomplete { .. })
                ));
            }
            let meta = CheckpointMeta::new(1).with_save_id(id);
            c.commit(&t, &meta, &lock).unwrap();
            drop(lock);
            assert_eq!(c.read_index().unwrap().save_id, Some(id));
        }
        let lock = c.try_lock().unwrap();
        assert!(matches!(
            c.prepare(false, SaveId([7; 16]), &lock),
            Err(StorageError::AlreadyExists { .. })
        ));
        assert!(c.plan_recovery().unwrap().is_empty());
        let mut names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".ck.zarrckpt-lock", "ck"], "no staging left");
    }
}
