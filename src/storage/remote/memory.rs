//! The stores behind `memory://name`: `object_store`'s in-memory store, one per name, whose
//! multipart parts are handed on in order.
//!
//! `object_store` 0.12's `InMemory::put_part` panics (index out of bounds) when a part arrives
//! while a lower-numbered part is still missing (apache/arrow-rs-object-store#682, fixed only
//! in 0.14). A recorded upload ([`super::multipart`]) has several parts in flight on the
//! runtime's worker threads, so its parts arrive in any order, as S3 allows. [`OrderedParts`]
//! holds a part until every part below it has been handed on, and refuses to complete an
//! upload with a part missing (rather than storing the parts before the gap alone).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use futures::lock::Mutex as AsyncMutex;
use object_store::memory::InMemory;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{MultipartId, PutPayload, PutResult, Result};

/// The in-memory store of `memory://name`, shared by every handle on that name in this
/// process, and its multipart front.
pub(crate) fn memory_store(name: &str) -> (Arc<InMemory>, Arc<OrderedParts>) {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<OrderedParts>>>> = OnceLock::new();
    let mut stores = STORES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let parts = Arc::clone(
        stores
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(OrderedParts::new(Arc::new(InMemory::new())))),
    );
    (Arc::clone(&parts.inner), parts)
}

/// [`InMemory`]'s [`MultipartStore`], taking the parts of an upload in any order.
#[derive(Debug)]
pub(crate) struct OrderedParts {
    inner: Arc<InMemory>,
    uploads: AsyncMutex<HashMap<MultipartId, Pending>>,
}

/// An upload started through [`OrderedParts`]: the next part the inner store expects, and
/// the parts above it that came early.
#[derive(Debug, Default)]
struct Pending {
    next: usize,
    held: BTreeMap<usize, PutPayload>,
}

fn refused(message: String) -> object_store::Error {
    object_store::Error::Generic {
        store: "InMemory",
        source: message.into(),
    }
}

impl OrderedParts {
    fn new(inner: Arc<InMemory>) -> Self {
        Self {
            inner,
            uploads: AsyncMutex::new(HashMap::new()),
        }
    }
}

#[async_trait]
impl MultipartStore for OrderedParts {
    async fn create_multipart(&self, path: &Path) -> Result<MultipartId> {
        let id = self.inner.create_multipart(path).await?;
        self.uploads
            .lock()
            .await
            .insert(id.clone(), Pending::default());
        Ok(id)
    }

    async fn put_part(
        &self,
        path: &Path,
        id: &MultipartId,
        part_idx: usize,
        payload: PutPayload,
    ) -> Result<PartId> {
        // Held across the inner store's calls, which never wait: parts are handed on in order.
        let mut uploads = self.uploads.lock().await;
        let Some(up) = uploads.get_mut(id) else {
            // Not an upload in progress: the inner store says so.
            drop(uploads);
            return self.inner.put_part(path, id, part_idx, payload).await;
        };
        if part_idx < up.next || up.held.contains_key(&part_idx) {
            return Err(refused(format!(
                "part {part_idx} of upload {id} of {path} was put twice"
            )));
        }
        up.held.insert(part_idx, payload);
        while let Some(part) = up.held.remove(&up.next) {
            self.inner.put_part(path, id, up.next, part).await?;
            up.next += 1;
        }
        Ok(PartId {
            content_id: part_idx.to_string(),
        })
    }

    async fn complete_multipart(
        &self,
        path: &Path,
        id: &MultipartId,
        parts: Vec<PartId>,
    ) -> Result<PutResult> {
        let mut uploads = self.uploads.lock().await;
        if let Some(up) = uploads.get(id) {
            if !up.held.is_empty() || up.next < parts.len() {
                return Err(refused(format!(
                    "upload {id} of {path} completed with part {} missing",
                    up.next
                )));
            }
            uploads.remove(id);
        }
        drop(uploads);
        self.inner.complete_multipart(path, id, parts).await
    }

    async fn abort_multipart(&self, path: &Path, id: &MultipartId) -> Result<()> {
        self.uploads.lock().await.remove(id);
        self.inner.abort_multipart(path, id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStore;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        futures::executor::block_on(f)
    }

    fn part(i: u8) -> PutPayload {
        PutPayload::from(vec![i; 3])
    }

    #[test]
    fn parts_put_out_of_order_make_the_object_in_part_order() {
        let (store, mp) = memory_store("memory-rs-out-of-order");
        let path = Path::from("a/c/0");
        let id = block_on(mp.create_multipart(&path)).unwrap();
        let mut ids = Vec::new();
        for i in [2u8, 0, 3, 1] {
            ids.push((
                i,
                block_on(mp.put_part(&path, &id, i.into(), part(i))).unwrap(),
            ));
        }
        ids.sort_by_key(|(i, _)| *i);
        let ids = ids.into_iter().map(|(_, p)| p).collect();
        block_on(mp.complete_multipart(&path, &id, ids)).unwrap();
        let got = block_on(async { store.get(&path).await?.bytes().await }).unwrap();
        assert_eq!(&got[..], &[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
    }

    #[test]
    fn a_missing_part_fails_the_completion_and_a_part_put_twice_is_refused() {
        let (store, mp) = memory_store("memory-rs-missing");
        let path = Path::from("x");
        let id = block_on(mp.create_multipart(&path)).unwrap();
        let p0 = block_on(mp.put_part(&path, &id, 0, part(0))).unwrap();
        let p2 = block_on(mp.put_part(&path, &id, 2, part(2))).unwrap();
        let e = block_on(mp.put_part(&path, &id, 2, part(9))).unwrap_err();
        assert!(e.to_string().contains("part 2 of upload"), "{e}");
        let e = block_on(mp.complete_multipart(&path, &id, vec![p0, p2])).unwrap_err();
        assert!(e.to_string().contains("part 1 missing"), "{e}");
        // Nothing was stored, and the upload can still be aborted.
        assert!(block_on(store.head(&path)).is_err());
        block_on(mp.abort_multipart(&path, &id)).unwrap();
        assert!(block_on(mp.put_part(&path, &id, 1, part(1))).is_err());
    }
}
