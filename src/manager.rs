//! A checkpoint manager over step directories, as training loops use it (spec § "Checkpoint
//! manager"): one checkpoint per step under a root (`ROOT/step-00000100`), a pointer file
//! `ROOT/latest` naming the latest committed step (replaced atomically), resume from the
//! latest committed step (skipping incomplete ones), and retention of the last N steps (and
//! every K-th), older steps being removed only once a newer one is committed.

use std::path::{Path, PathBuf};

use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::load::{LoadOptions, LoadReport, load};
use crate::model::{LoadTarget, ShardedTensor};
use crate::save::{SaveOptions, SaveReport, save};
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

/// Checkpoints of a training run, one per step, under one root directory.
#[derive(Debug, Clone)]
pub struct CheckpointManager {
    root: PathBuf,
    opts: ManagerOptions,
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
    /// A manager over `root` (created by the first save).
    #[must_use]
    pub fn new(root: impl AsRef<Path>, opts: ManagerOptions) -> Self {
        CheckpointManager {
            root: root.as_ref().to_owned(),
            opts,
        }
    }

    /// The root directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of `step`: `ROOT/step-` and the step with at least 8 digits.
    #[must_use]
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("{STEP_PREFIX}{step:08}"))
    }

    /// Every step directory under the root, by increasing step, with its state and size.
    ///
    /// # Errors
    /// I/O errors listing the root (an absent root has no steps).
    pub fn steps(&self) -> Result<Vec<StepInfo>> {
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

    /// The step the pointer file names, if it names a committed checkpoint.
    fn pointed(&self) -> Option<u64> {
        let text = std::fs::read_to_string(self.root.join(LATEST_FILE)).ok()?;
        let step = parse_step_dir(text.trim())?;
        let dir = self.step_dir(step);
        commit::read_index(&dir).is_ok().then_some(step)
    }

    /// The latest committed step: the one the pointer file names if it is committed and no
    /// later committed step exists, else the highest committed step found by a scan.
    /// Incomplete steps (crashed or running saves) are skipped.
    ///
    /// # Errors
    /// I/O errors listing the root.
    pub fn latest(&self) -> Result<Option<u64>> {
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

    /// The index of the latest committed step.
    ///
    /// # Errors
    /// As [`CheckpointManager::latest`], and index errors.
    pub fn latest_meta(&self) -> Result<Option<(u64, CheckpointMeta)>> {
        match self.latest()? {
            Some(step) => Ok(Some((step, commit::read_index(&self.step_dir(step))?))),
            None => Ok(None),
        }
    }

    /// Saves `step` (every rank calls it, as [`save`]), then, on rank 0, points `latest` at
    /// it (unless a later step is already committed) and applies the retention rules to older
    /// steps. A step is only ever removed after a newer one is committed.
    ///
    /// # Errors
    /// As [`save`]; I/O errors of the pointer update or the removals (on every rank).
    pub fn save(
        &self,
        step: u64,
        pieces: &[ShardedTensor<'_>],
        comm: &dyn Communicator,
        opts: &SaveOptions,
    ) -> Result<SaveReport> {
        let report = save(pieces, &self.step_dir(step), comm, opts)?;
        let after = if comm.rank() == 0 {
            self.publish(step)
        } else {
            Ok(())
        };
        agree(comm, after)?;
        Ok(report)
    }

    /// Rank 0's part after a committed save of `step`: the pointer, then retention.
    fn publish(&self, step: u64) -> Result<()> {
        if self.pointed().is_none_or(|p| p <= step) {
            let name = format!("{STEP_PREFIX}{step:08}\n");
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
    pub fn apply_retention(&self, newest: u64) -> Result<()> {
        if self.opts.keep_last == 0 {
            return Ok(());
        }
        let steps = self.steps()?;
        let committed: Vec<u64> = steps
            .iter()
            .filter(|s| s.complete && s.step <= newest)
            .map(|s| s.step)
            .collect();
        let keep_from = committed.len().saturating_sub(self.opts.keep_last);
        let kept: Vec<u64> = committed[keep_from..].to_vec();
        let pointed = self.pointed();
        for s in steps.iter().filter(|s| s.step < newest) {
            let keep = kept.contains(&s.step)
                || self
                    .opts
                    .keep_every
                    .is_some_and(|k| k > 0 && s.complete && s.step % k == 0)
                || pointed == Some(s.step);
            if keep {
                continue;
            }
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

    /// Loads the latest committed step into `targets` (every rank calls it, as [`load`]):
    /// rank 0 picks the step and tells the others. Returns the step, or `None` when the root
    /// holds no committed step.
    ///
    /// # Errors
    /// As [`load`].
    pub fn load_latest(
        &self,
        targets: &mut [LoadTarget<'_>],
        comm: &dyn Communicator,
        opts: &LoadOptions,
    ) -> Result<Option<(u64, LoadReport)>> {
        let mine = if comm.rank() == 0 {
            self.latest()
        } else {
            Ok(None)
        };
        let picked = agree(comm, mine)?;
        let msg = picked.map_or_else(Vec::new, |s| s.to_le_bytes().to_vec());
        let got = comm.broadcast(0, &msg)?;
        let step = match got.as_slice() {
            [] => return Ok(None),
            b => u64::from_le_bytes(b.try_into().map_err(|_| Error::RemoteFailure {
                rank: 0,
                message: "malformed step broadcast".into(),
            })?),
        };
        let report = load(targets, &self.step_dir(step), comm, opts)?;
        Ok(Some((step, report)))
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
