//! The checkpoint manager on an object store (feature `object-store`), for a root URL such as
//! `s3://bucket/run1` (spec § "Checkpoint manager", object stores): each step is a checkpoint
//! under its own sub-prefix (`s3://bucket/run1/step-00000100`, with its own generations and
//! pointer, as any save to a URL writes), and the object `latest` directly under the root
//! names the latest committed step (`step-00000100` and a newline, as the local pointer
//! file). A step is committed when its generation pointer resolves to a manifest.
//!
//! After a step's commit (the pointer move), rank 0 points `latest` at it, removes the step's
//! superseded generations (a step saved again) and the older steps the retention rules drop:
//! each removed step loses its pointer first, then every object under its prefix. Nothing is
//! ever deleted during a save. One job saves under a root at a time: an incomplete older step
//! is taken for a crashed save and removed.

use crate::error::Result;
use crate::storage::remote::generation;
use crate::storage::remote::prune::{child, delete_checkpoint};
use crate::storage::remote::{Condition, RemoteOptions, RemoteStore};

use super::{LATEST_FILE, ManagerOptions, StepInfo, parse_step_dir, step_name, to_remove};

/// The root store.
fn open(url: &str, ropts: &RemoteOptions) -> Result<RemoteStore> {
    Ok(RemoteStore::open(url, ropts)?)
}

/// True when the checkpoint `store` holds is committed (its pointer resolves to a manifest).
fn committed(store: &RemoteStore) -> bool {
    generation::resolve(store).is_ok()
}

/// Every step under the root URL, by increasing step, with its state and size (the bytes of
/// every object under its prefix, committed or not).
pub(super) fn steps(url: &str, ropts: &RemoteOptions) -> Result<Vec<StepInfo>> {
    let root = open(url, ropts)?;
    let mut steps = Vec::new();
    for name in root.list_children()? {
        let Some(step) = parse_step_dir(&name) else {
            continue;
        };
        let store = child(&root, &name)?;
        let objects = store.list("")?;
        if objects.is_empty() {
            // A removed step (some stores list an emptied folder as a prefix).
            continue;
        }
        let bytes = objects.iter().map(|(_, n)| n).sum();
        steps.push(StepInfo {
            step,
            dir: store.url().url().into(),
            complete: committed(&store),
            bytes,
        });
    }
    steps.sort_by_key(|s| s.step);
    Ok(steps)
}

/// The step the `latest` object names, if it names a committed step.
pub(super) fn pointed(url: &str, ropts: &RemoteOptions) -> Option<u64> {
    let root = open(url, ropts).ok()?;
    let (bytes, _) = root.get(LATEST_FILE).ok()??;
    let step = parse_step_dir(std::str::from_utf8(&bytes).ok()?.trim())?;
    committed(&child(&root, &step_name(step)).ok()?).then_some(step)
}

/// Rank 0's part after the commit of `step`: `latest` (unless a later step is committed
/// and named), the step's superseded generations, then retention.
pub(super) fn publish(
    url: &str,
    ropts: &RemoteOptions,
    opts: ManagerOptions,
    step: u64,
) -> Result<()> {
    let root = open(url, ropts)?;
    if pointed(url, ropts).is_none_or(|p| p <= step) {
        let name = format!("{}\n", step_name(step));
        root.put(LATEST_FILE, name.into_bytes().into(), &Condition::None)?;
    }
    // A step saved again leaves its earlier generations: only the committed one is kept.
    let gc = generation::gc(&child(&root, &step_name(step))?, 1, false)?;
    if !gc.removed.is_empty() {
        tracing::info!(url, step, removed = ?gc.removed, "manager: superseded generations removed");
    }
    apply_retention(url, ropts, opts, step)
}

/// Removes the steps older than `newest` that the rules drop (never the one `latest`
/// names).
pub(super) fn apply_retention(
    url: &str,
    ropts: &RemoteOptions,
    opts: ManagerOptions,
    newest: u64,
) -> Result<()> {
    if opts.keep_last == 0 {
        return Ok(());
    }
    let steps = steps(url, ropts)?;
    let root = open(url, ropts)?;
    for s in to_remove(&steps, opts, newest, pointed(url, ropts)) {
        let store = child(&root, &step_name(s.step))?;
        let r = delete_checkpoint(&store)?;
        tracing::info!(
            url,
            step = s.step,
            objects = r.objects,
            bytes = r.bytes,
            "manager: step removed"
        );
    }
    Ok(())
}

/// The index of a committed step, read through the store.
pub(super) fn read_index(
    url: &str,
    ropts: &RemoteOptions,
) -> Result<crate::storage::CheckpointMeta> {
    Ok(crate::load::Reader::open_url(url, ropts)?.meta().clone())
}
