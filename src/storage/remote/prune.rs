//! Removing whole checkpoints from an object store, as the checkpoint manager's retention does
//! once a newer step is committed: the pointer first, so that a crash midway leaves an
//! uncommitted prefix (that a later retention removes), never a committed checkpoint with
//! objects missing; then every object under the checkpoint's prefix, a bounded number of
//! deletes in flight. Never called during a save.

use futures::StreamExt;

use super::client::RemoteStore;
use super::error::RemoteError;
use super::generation::POINTER;
use super::url::RemoteUrl;

/// What [`delete_checkpoint`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Objects deleted (the pointer among them, when there was one).
    pub objects: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// The store of the checkpoint under `name` (one path segment, such as `step-00000100`)
/// below `parent`'s prefix, sharing `parent`'s client and options.
///
/// # Errors
/// [`RemoteError::Url`] when the child's URL does not parse.
pub fn child(parent: &RemoteStore, name: &str) -> Result<RemoteStore, RemoteError> {
    let url = RemoteUrl::parse(&parent.url().url_of(name))?;
    Ok(RemoteStore::from_store(
        std::sync::Arc::clone(parent.inner()),
        url,
        parent.options(),
    ))
}

/// Deletes the checkpoint `store` holds: its pointer, then every object under its prefix
/// (every generation, committed or not), at most [`super::RemoteOptions::concurrency`]
/// deletes at once. An absent object is fine; an empty prefix deletes nothing.
///
/// # Errors
/// [`RemoteError::Request`] naming the object whose LIST or DELETE failed (what was deleted
/// stays deleted; the pointer is gone first, so the checkpoint no longer reads as committed).
pub fn delete_checkpoint(store: &RemoteStore) -> Result<PruneReport, RemoteError> {
    let pointer = store.head(POINTER)?;
    store.delete(POINTER)?;
    let mut report = PruneReport {
        objects: usize::from(pointer.is_some()),
        bytes: pointer.unwrap_or(0),
    };
    let objects = store.list("")?;
    let n = store.options().concurrency.max(1);
    store.block_on(async {
        let mut tasks = futures::stream::iter(objects.iter().map(|(key, size)| async move {
            match store.inner().delete(&store.path(key)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(*size),
                Err(source) => Err(RemoteError::Request {
                    op: "DELETE",
                    key: store.url().url_of(key),
                    source,
                }),
            }
        }))
        .buffer_unordered(n);
        while let Some(r) = tasks.next().await {
            report.bytes += r?;
            report.objects += 1;
        }
        Ok(report)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::remote::{Condition, RemoteOptions};
    use bytes::Bytes;

    #[test]
    fn deletes_the_pointer_and_every_object_of_one_child_only() {
        let opts = RemoteOptions::default();
        let root = RemoteStore::open("memory://prune/run", &opts).unwrap();
        for key in [
            "step-1/zarrckpt.pointer.json",
            "step-1/generations/g/zarr.json",
            "step-1/generations/g/tensors/w/c/0",
            "step-10/zarrckpt.pointer.json",
            "latest",
        ] {
            root.put(key, Bytes::from_static(b"12345"), &Condition::None)
                .unwrap();
        }
        let one = child(&root, "step-1").unwrap();
        assert_eq!(one.url().url(), "memory://prune/run/step-1");
        let r = delete_checkpoint(&one).unwrap();
        assert_eq!(
            r,
            PruneReport {
                objects: 3,
                bytes: 15
            }
        );
        let left: Vec<String> = root.list("").unwrap().into_iter().map(|(k, _)| k).collect();
        assert_eq!(left, ["latest", "step-10/zarrckpt.pointer.json"]);
        // Again: nothing left to delete, no error.
        assert_eq!(delete_checkpoint(&one).unwrap(), PruneReport::default());
    }
}
