//! A checkpoint manager over step directories, as training loops use it (spec § "Checkpoint
//! manager"): one checkpoint per step under a root (`ROOT/step-00000100`), a pointer file
//! `ROOT/latest` naming the latest committed step (replaced atomically), resume from the
//! latest committed step (skipping incomplete ones), and retention of the last N steps (and
//! every K-th), older steps being removed only once a newer one is committed.
//!
//! The manager wraps a [`Saver`]: a step saves a whole [`SaveRequest`] (host and device
//! tensors, objects, a nested state dict), synchronously or in the background, and the
//! pointer and retention follow the commit in either case.
//!
//! The root may be an object-store URL (`s3://bucket/run1`, `gs://`, `az://`, `memory://`;
//! feature `object-store`): each step is then a checkpoint under its own sub-prefix, `latest`
//! an object under the root, and retention deletes a dropped step's objects only after the
//! newer step's pointer moved (see the `remote` submodule and the spec).

#[cfg(feature = "object-store")]
mod remote;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::async_save::{SaveHandle, Saver};
use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::load::{LoadOptions, LoadReport, load_with_objects};
use crate::model::{LoadTarget, ObjectRequest, StateDict};
use crate::save::{SaveOptions, SaveReport, SaveRequest};
use crate::storage::commit;
use crate::storage::fsio;
use crate::storage::{CheckpointMeta, StorageError};

/// The pointer file under the root, naming the latest committed step's directory.
pub const LATEST_FILE: &str = "latest";
/// The prefix of step directory names: `step-` and the step, at least 8 digits.
pub const STEP_PREFIX: &str = "step-";

/// What to keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ManagerOptions {
    /// Keep the last this many committed steps (0: keep every step).
    pub keep_last: usize,
    /// Also keep every step that is a multiple of this (`None`: no such rule).
    pub keep_every: Option<u64>,
}

/// One step directory found under the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepInfo {
    /// The step.
    pub step: u64,
    /// Its directory.
    pub dir: PathBuf,
    /// True when the checkpoint is committed (its index reads and validates).
    pub complete: bool,
    /// Bytes of its files.
    pub bytes: u64,
}

/// Checkpoints of a training run, one per step, under one root directory, saved through a
/// [`Saver`]. Every rank creates its own manager over the same root, with a saver on its own
/// communicator, and calls the same methods in the same order (the listing methods,
/// [`CheckpointManager::steps`] and [`CheckpointManager::latest`], are local).
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
/// use zarrckpt::{
///     CheckpointManager, Communicator, ManagerOptions, SaveOptions, SaveRequest, Saver,
///     ShardedTensor, StateObject, run_local,
/// };
///
/// run_local(2, Duration::from_secs(60), |comm| {
///     let comm: Arc<dyn Communicator> = Arc::new(comm);
///     let r = comm.rank() as u64;
///     let opts = ManagerOptions { keep_last: 2, keep_every: None };
///     let mut manager = CheckpointManager::new("run", Saver::new(Arc::clone(&comm)), opts);
///     let weights = vec![r as f32; 6];
///     for step in [100, 200, 300] {
///         let piece = ShardedTensor::from_slice("w", &[4, 3], &[2 * r, 0], &weights, &[2, 3], 0)?;
///         let request = SaveRequest::new()
///             .with_tensors([piece])
///             .with_objects([StateObject::common("step", serde_json::json!(step))?]);
///         // Returns once staged; the `latest` pointer and retention follow the commit.
///         manager.save_async(step, &request, &SaveOptions::default())?.wait()?;
///     }
///     assert_eq!(manager.latest()?, Some(300));
///     Ok::<(), zarrckpt::Error>(())
/// });
/// ```
#[derive(Debug)]
pub struct CheckpointManager {
    root: Root,
    saver: Saver,
}

/// The root and its rules: what a background save needs to publish a step.
#[derive(Debug, Clone)]
struct Root {
    root: PathBuf,
    opts: ManagerOptions,
    /// How listings, `latest` and loads reach an object-store root (a save reaches it with
    /// its own [`SaveOptions::remote`]).
    #[cfg(feature = "object-store")]
    remote: crate::storage::remote::RemoteOptions,
}

/// A step's directory name: `step-` and the step with at least 8 digits.
fn step_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:08}")
}

/// The steps older than `newest` that the rules drop: committed steps beyond the last
/// `keep_last` committed ones up to `newest` (unless a multiple of `keep_every`), and
/// incomplete ones; never the step `pointed` (the one `latest` names).
fn to_remove(
    steps: &[StepInfo],
    opts: ManagerOptions,
    newest: u64,
    pointed: Option<u64>,
) -> Vec<&StepInfo> {
    let committed: Vec<u64> = steps
        .iter()
        .filter(|s| s.complete && s.step <= newest)
        .map(|s| s.step)
        .collect();
    let kept = &committed[committed.len().saturating_sub(opts.keep_last)..];
    steps
        .iter()
        .filter(|s| s.step < newest)
        .filter(|s| {
            !(kept.contains(&s.step)
                || opts
                    .keep_every
                    .is_some_and(|k| k > 0 && s.complete && s.step % k == 0)
                || pointed == Some(s.step))
        })
        .collect()
}

/// The step a directory name stands for: `step-` followed by ASCII digits only.
#[must_use]
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn tree_bytes(p: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(p) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

impl CheckpointManager {
    /// A manager over `root` (created by the first save), saving through `saver`.
    #[must_use]
    pub fn new(root: impl AsRef<Path>, saver: Saver, opts: ManagerOptions) -> Self {
        CheckpointManager {
            root: Root {
                root: root.as_ref().to_owned(),
                opts,
                #[cfg(feature = "object-store")]
                remote: crate::storage::remote::RemoteOptions::default(),
            },
            saver,
        }
    }

    /// The same manager reaching an object-store root with `ropts` for its listings, the
    /// `latest` object and loads (default: [`crate::storage::remote::RemoteOptions::default`],
    /// from the environment). Saves use their own [`SaveOptions::remote`], which the pointer
    /// update and retention after a save use too.
    #[cfg(feature = "object-store")]
    #[must_use]
    pub fn with_remote_options(mut self, ropts: crate::storage::remote::RemoteOptions) -> Self {
        self.root.remote = ropts;
        self
    }

    /// The root directory (or object-store URL).
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root.root
    }

    /// The saver (its communicator, whether a save is in flight).
    #[must_use]
    pub fn saver(&self) -> &Saver {
        &self.saver
    }

    /// The directory of `step`: `ROOT/step-` and the step with at least 8 digits.
    #[must_use]
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.step_dir(step)
    }

    /// Every step directory under the root, by increasing step, with its state and size.
    /// Local (no collective).
    ///
    /// # Errors
    /// I/O errors listing the root (an absent root has no steps).
    pub fn steps(&self) -> Result<Vec<StepInfo>> {
        self.root.steps()
    }

    /// The latest committed step: the one the pointer file names if it is committed and no
    /// later committed step exists, else the highest committed step found by a scan.
    /// Incomplete steps (crashed or running saves) are skipped. Local (no collective).
    ///
    /// # Errors
    /// I/O errors listing the root.
    pub fn latest(&self) -> Result<Option<u64>> {
        self.root.latest()
    }

    /// The index of the latest committed step.
    ///
    /// # Errors
    /// As [`CheckpointManager::latest`], and index errors.
    pub fn latest_meta(&self) -> Result<Option<(u64, CheckpointMeta)>> {
        match self.latest()? {
            Some(step) => Ok(Some((step, self.root.read_index(step)?))),
            None => Ok(None),
        }
    }

    /// Removes steps older than `newest` (committed) that the rules do not keep: committed
    /// steps beyond the last `keep_last` (unless a multiple of `keep_every`) and incomplete
    /// steps whose save is not running. Never removes the step the pointer names. Local.
    ///
    /// # Errors
    /// I/O errors naming the path.
    pub fn apply_retention(&self, newest: u64) -> Result<()> {
        self.root.apply_retention(newest)
    }

    /// Saves `request` as `step` (every rank calls it, as [`Saver::save`]), then, on rank 0,
    /// points `latest` at it (unless a later step is already committed) and applies the
    /// retention rules to older steps. A step is only ever removed after a newer one is
    /// committed.
    ///
    /// # Errors
    /// As [`Saver::save`]; I/O errors of the pointer update or the removals (on every rank).
    pub fn save(
        &mut self,
        step: u64,
        request: &SaveRequest<'_>,
        opts: &SaveOptions,
    ) -> Result<SaveReport> {
        let report = self.saver.save(request, &self.root.step_dir(step), opts)?;
        let comm = Arc::clone(self.saver.communicator());
        agree(&*comm, self.root.publishing(opts).publish_on(&*comm, step))?;
        Ok(report)
    }

    /// Starts saving `request` as `step` (as [`Saver::save_async`]: returns once this rank's
    /// part is staged, with every planning error). The background thread commits the step,
    /// then points `latest` at it and applies retention as [`CheckpointManager::save`] does;
    /// [`SaveHandle::wait`] reports the outcome of all of it.
    ///
    /// # Errors
    /// As [`Saver::save_async`].
    pub fn save_async(
        &mut self,
        step: u64,
        request: &SaveRequest<'_>,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        let root = self.root.publishing(opts);
        let dir = root.step_dir(step);
        self.saver.save_async_then(
            request,
            &dir,
            opts,
            Box::new(move |comm| root.publish_on(comm, step)),
        )
    }

    /// Loads the latest committed step into `targets` and `objects` (every rank calls it, as
    /// [`crate::load_with_objects`]; an empty `objects` is fine): rank 0 picks the step and
    /// tells the others. Waits for a save in flight first. Returns the step and the report
    /// (with the objects' values), or `None` when the root holds no committed step.
    ///
    /// # Errors
    /// As [`crate::load_with_objects`].
    pub fn load_latest(
        &mut self,
        targets: &mut [LoadTarget<'_>],
        objects: &[ObjectRequest],
        opts: &LoadOptions,
    ) -> Result<Option<(u64, LoadReport)>> {
        let Some(step) = self.agreed_latest()? else {
            return Ok(None);
        };
        let comm = Arc::clone(self.saver.communicator());
        let dir = self.step_dir(step);
        #[cfg(feature = "object-store")]
        if let Some(url) = self.root.url() {
            // The manager's own store options (a plain load of a URL uses the defaults).
            let url = format!("{url}/{}", step_name(step));
            let reader = agree(
                &*comm,
                crate::load::Reader::open_url(&url, &self.root.remote),
            )?
            .with_io(opts.io_threads, opts.read_method);
            let report =
                crate::load::load_with_reader(targets, Some(objects), &reader, &*comm, opts)?;
            return Ok(Some((step, report)));
        }
        let report = load_with_objects(targets, objects, &dir, &*comm, opts)?;
        Ok(Some((step, report)))
    }

    /// Loads the latest committed step into a nested state dict (as [`crate::load_state`]).
    /// Waits for a save in flight first; `None` when the root holds no committed step.
    ///
    /// # Errors
    /// As [`crate::load_state`].
    pub fn load_latest_state(
        &mut self,
        state: &mut StateDict<'_>,
        opts: &LoadOptions,
    ) -> Result<Option<(u64, LoadReport)>> {
        let Some(step) = self.agreed_latest()? else {
            return Ok(None);
        };
        let comm = Arc::clone(self.saver.communicator());
        let report = crate::state::load_state(state, &self.step_dir(step), &*comm, opts)?;
        Ok(Some((step, report)))
    }

    /// The latest committed step as rank 0 sees it, told to every rank (collective: every
    /// rank calls it), after any save in flight: what a resume loads, through
    /// [`CheckpointManager::load_latest`] or any other load of [`CheckpointManager::step_dir`].
    ///
    /// # Errors
    /// I/O errors listing the root (on every rank), communication errors.
    pub fn agreed_latest(&mut self) -> Result<Option<u64>> {
        self.saver.wait_idle();
        let comm = Arc::clone(self.saver.communicator());
        let mine = if comm.rank() == 0 {
            self.latest()
        } else {
            Ok(None)
        };
        let picked = agree(&*comm, mine)?;
        let msg = picked.map_or_else(Vec::new, |s| s.to_le_bytes().to_vec());
        let got = comm.broadcast(0, &msg)?;
        match got.as_slice() {
            [] => Ok(None),
            b => Ok(Some(u64::from_le_bytes(b.try_into().map_err(|_| {
                Error::RemoteFailure {
                    rank: 0,
                    message: "malformed step broadcast".into(),
                }
            })?))),
        }
    }
}

impl Root {
    fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(step_name(step))
    }

    /// The root's URL, when it names an object store.
    #[cfg(feature = "object-store")]
    fn url(&self) -> Option<&str> {
        self.root
            .to_str()
            .filter(|s| crate::storage::remote::is_url(s))
            .map(|s| s.trim_end_matches('/'))
    }

    /// This root, reaching an object store as the save with `opts` did (for what follows
    /// the save's commit).
    #[cfg_attr(not(feature = "object-store"), allow(unused_variables))]
    fn publishing(&self, opts: &SaveOptions) -> Root {
        #[allow(unused_mut)]
        let mut root = self.clone();
        #[cfg(feature = "object-store")]
        if self.url().is_some() {
            root.remote = opts.remote.clone();
        }
        root
    }

    fn read_index(&self, step: u64) -> Result<CheckpointMeta> {
        #[cfg(feature = "object-store")]
        if let Some(url) = self.url() {
            return remote::read_index(&format!("{url}/{}", step_name(step)), &self.remote);
        }
        Ok(commit::read_index(&self.step_dir(step))?)
    }

    fn steps(&self) -> Result<Vec<StepInfo>> {
        #[cfg(feature = "object-store")]
        if let Some(url) = self.url() {
            return remote::steps(url, &self.remote);
        }
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StorageError::io("list", &self.root)(e).into()),
        };
        let mut steps: Vec<StepInfo> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| {
                let step = parse_step_dir(&e.file_name().to_string_lossy())?;
                let dir = e.path();
                Some(StepInfo {
                    step,
                    complete: commit::read_index(&dir).is_ok(),
                    bytes: tree_bytes(&dir),
                    dir,
                })
            })
            .collect();
        steps.sort_by_key(|s| s.step);
        Ok(steps)
    }

    /// The step the pointer names, if it names a committed checkpoint.
    fn pointed(&self) -> Option<u64> {
        #[cfg(feature = "object-store")]
        if let Some(url) = self.url() {
            return remote::pointed(url, &self.remote);
        }
        let text = std::fs::read_to_string(self.root.join(LATEST_FILE)).ok()?;
        let step = parse_step_dir(text.trim())?;
        let dir = self.step_dir(step);
        commit::read_index(&dir).is_ok().then_some(step)
    }

    fn latest(&self) -> Result<Option<u64>> {
        let scanned = self
            .steps()?
            .into_iter()
            .filter(|s| s.complete)
            .map(|s| s.step)
            .max();
        Ok(match (self.pointed(), scanned) {
            (Some(p), Some(s)) => Some(p.max(s)),
            (p, s) => p.or(s),
        })
    }

    /// Rank 0's part after a committed save of `step` (a no-op on other ranks): the
    /// pointer, then retention. The caller agrees on the outcome.
    fn publish_on(&self, comm: &dyn Communicator, step: u64) -> Result<()> {
        if comm.rank() != 0 {
            return Ok(());
        }
        #[cfg(feature = "object-store")]
        if let Some(url) = self.url() {
            return remote::publish(url, &self.remote, self.opts, step);
        }
        if self.pointed().is_none_or(|p| p <= step) {
            let name = format!("{}\n", step_name(step));
            fsio::replace_durable(&self.root.join(LATEST_FILE), name.as_bytes())?;
        }
        self.apply_retention(step)
    }

    /// Removes steps older than `newest` (committed) that the rules do not keep: committed
    /// steps beyond the last `keep_last` (unless a multiple of `keep_every`) and incomplete
    /// steps whose save is not running. Never removes the step the pointer names.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn apply_retention(&self, newest: u64) -> Result<()> {
        #[cfg(feature = "object-store")]
        if let Some(url) = self.url() {
            return remote::apply_retention(url, &self.remote, self.opts, newest);
        }
        if self.opts.keep_last == 0 {
            return Ok(());
        }
        let steps = self.steps()?;
        for s in to_remove(&steps, self.opts, newest, self.pointed()) {
            // A running save holds the step's lock: leave it alone.
            let Ok(lock) = commit::try_lock(&s.dir) else {
                continue;
            };
            remove_step(&s.dir)?;
            for p in lock.paths() {
                let _ = std::fs::remove_file(p);
            }
        }
        Ok(())
    }
}

/// Removes a step directory: first its commit marker (so a crash midway leaves an incomplete
/// step, never a damaged one that passes for committed), then the rest.
fn remove_step(dir: &Path) -> std::result::Result<(), StorageError> {
    let marker = dir.join(commit::ROOT_JSON);
    match std::fs::remove_file(&marker) {
        Ok(()) => fsio::fsync_dir(dir)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(StorageError::io("remove", &marker)(e)),
    }
    std::fs::remove_dir_all(dir).map_err(StorageError::io("remove", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names() {
        assert_eq!(parse_step_dir("step-00000100"), Some(100));
        assert_eq!(parse_step_dir("step-123456789"), Some(123_456_789));
        for bad in [
            "step-",
            "step-1a",
            "step--1",
            "step-00000100.zarrckpt-lock",
            ".step-00000100.zarrckpt-lock",
            ".step-00000100.zarrckpt-staging-00",
            "x-1",
        ] {
            assert_eq!(parse_step_dir(bad), None, "{bad}");
        }
    }
}
