//! Multipart uploads that a crash cannot hide (spec "Object-store profile of the commit",
//! upload records). `object_store` cannot list a bucket's open multipart uploads, so a writer
//! that streams an object as a multipart upload starts it through the store's explicit
//! multipart API ([`MultipartStore`]: S3, GCS, Azure and the in-memory store have one) and
//! records it at once: the object `generations/<id>/uploads/<token>.json` holds the upload's
//! key and id. The record is deleted once the upload completed or was aborted, so a record
//! left behind names an upload that a killed writer left open, which [`super::gc`] aborts.
//!
//! A crash between the upload's creation and its record (one request) leaks an upload without
//! parts; the bucket lifecycle rule (`AbortIncompleteMultipartUpload`) remains the backstop.
//! Parts go out `part_size` at a time, at most `parts_in_flight` of them in flight.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{MultipartId, PutMode, PutPayload};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use super::base::generation_key;
use super::client::RemoteStore;
use super::error::RemoteError;

/// The folder of a generation's upload records.
pub const UPLOADS: &str = "uploads";

/// One upload record (`generations/<id>/uploads/<token>.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadRecord {
    /// Format version of the record (1).
    pub zarrckpt_upload: u32,
    /// The object's key relative to the generation's folder (`tensors/w/c/0/0`).
    pub key: String,
    /// The store's id of the multipart upload.
    pub upload_id: String,
    /// The rank that started it, when the writer knew its rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
}

/// The generation and the key relative to it of a key inside a generation
/// (`generations/<id>/<rel>`).
#[must_use]
pub fn split_generation(key: &str) -> Option<(&str, &str)> {
    key.strip_prefix(super::GENERATIONS)?
        .strip_prefix('/')?
        .split_once('/')
        .filter(|(g, rel)| !g.is_empty() && !rel.is_empty())
}

type PartTask = JoinHandle<Result<(usize, object_store::multipart::PartId), object_store::Error>>;

/// A recorded multipart upload in progress (see the module docs). Must end with
/// [`RecordedUpload::finish`] or [`RecordedUpload::abort`]; one that is dropped stays open
/// and recorded, for `gc`.
pub struct RecordedUpload {
    mp: Arc<dyn MultipartStore>,
    store: RemoteStore,
    path: ObjPath,
    key: String,
    id: MultipartId,
    record: String,
    part_size: usize,
    in_flight: usize,
    buf: Vec<u8>,
    parts: Vec<Option<object_store::multipart::PartId>>,
    tasks: VecDeque<PartTask>,
    sent: u64,
}

impl std::fmt::Debug for RecordedUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordedUpload")
            .field("key", &self.key)
            .field("id", &self.id)
            .field("record", &self.record)
            .finish_non_exhaustive()
    }
}

impl RecordedUpload {
    /// Starts a multipart upload of `key` (a key inside a generation) and records it;
    /// `None` when the store has no explicit multipart API or `key` is in no generation (the
    /// caller then uses an unrecorded `put_multipart`). Runs on the store's runtime.
    ///
    /// # Errors
    /// [`RemoteError::Request`] naming the key (the upload is aborted when its record could not
    /// be written).
    pub async fn begin(
        store: &RemoteStore,
        key: &str,
        rank: Option<usize>,
    ) -> Result<Option<Self>, RemoteError> {
        let (Some(mp), Some((generation, rel))) = (store.multipart_store(), split_generation(key))
        else {
            return Ok(None);
        };
        let mp = Arc::clone(mp);
        let path = store.path(key);
        let id = mp.create_multipart(&path).await.map_err(request(
            store,
            "multipart PUT (create)",
            key,
        ))?;
        let token = crate::storage::footer::SaveId::random().hex();
        let record = generation_key(generation, &format!("{UPLOADS}/{}.json", &token[..16]));
        let body = UploadRecord {
            zarrckpt_upload: 1,
            key: rel.to_owned(),
            upload_id: id.clone(),
            rank,
        };
        let body = Bytes::from(serde_json::to_vec(&body).expect("a record serialises"));
        if let Err(e) = store
            .put_resolved(&store.path(&record), body, PutMode::Overwrite)
            .await
        {
            let _ = mp.abort_multipart(&path, &id).await;
            return Err(request(store, "PUT (upload record)", &record)(e));
        }
        let opts = store.options();
        Ok(Some(Self {
            mp,
            store: store.clone(),
            path,
            key: key.to_owned(),
            id,
            record,
            part_size: opts.part_size.max(5 << 20),
            in_flight: opts.parts_in_flight.max(1),
            buf: Vec::new(),
            parts: Vec::new(),
            tasks: VecDeque::new(),
            sent: 0,
        }))
    }

    /// The key of its record.
    #[must_use]
    pub fn record_key(&self) -> &str {
        &self.record
    }

    /// Bytes written so far.
    #[must_use]
    pub fn written(&self) -> u64 {
        self.sent + self.buf.len() as u64
    }

    /// Appends bytes; every full part is sent, waiting while `parts_in_flight` are.
    ///
    /// # Errors
    /// [`RemoteError::Request`] of a part that failed (after the client's retries).
    pub async fn write(&mut self, mut data: &[u8]) -> Result<(), RemoteError> {
        while !data.is_empty() {
            let n = (self.part_size - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.buf.len() == self.part_size {
                let part = std::mem::replace(&mut self.buf, Vec::with_capacity(self.part_size));
                self.send(part).await?;
            }
        }
        Ok(())
    }

    async fn send(&mut self, part: Vec<u8>) -> Result<(), RemoteError> {
        while self.tasks.len() >= self.in_flight {
            self.wait_one().await?;
        }
        let idx = self.parts.len();
        self.parts.push(None);
        self.sent += part.len() as u64;
        let (mp, path, id) = (Arc::clone(&self.mp), self.path.clone(), self.id.clone());
        self.tasks.push_back(tokio::spawn(async move {
            mp.put_part(&path, &id, idx, PutPayload::from(part))
                .await
                .map(|p| (idx, p))
        }));
        Ok(())
    }

    async fn wait_one(&mut self) -> Result<(), RemoteError> {
        let Some(task) = self.tasks.pop_front() else {
            return Ok(());
        };
        let got = task.await.unwrap_or_else(|e| {
            Err(object_store::Error::Generic {
                store: "zarrckpt",
                source: Box::new(e),
            })
        });
        match got {
            Ok((idx, part)) => {
                self.parts[idx] = Some(part);
                Ok(())
            }
            Err(e) => Err(request(&self.store, "multipart PUT (part)", &self.key)(e)),
        }
    }

    /// Sends the last part, completes the upload and deletes its record. On failure the
    /// upload is aborted (and its record deleted once it is).
    ///
    /// # Errors
    /// [`RemoteError::Request`] naming the key.
    pub async fn finish(mut self) -> Result<u64, RemoteError> {
        let r = self.complete().await;
        if r.is_err() {
            self.abort_inner().await;
        }
        r
    }

    async fn complete(&mut self) -> Result<u64, RemoteError> {
        if !self.buf.is_empty() || self.parts.is_empty() {
            let last = std::mem::take(&mut self.buf);
            self.send(last).await?;
        }
        while !self.tasks.is_empty() {
            self.wait_one().await?;
        }
        let parts: Vec<_> = self.parts.iter().flatten().cloned().collect();
        let len = self.sent;
        if let Err(e) = self
            .mp
            .complete_multipart(&self.path, &self.id, parts)
            .await
        {
            // The completion's answer was lost and its retry found the upload gone (completed
            // by the first try): the object is there with every byte. The key is fresh in
            // this save's generation, so only this upload can have written it.
            match self.store.inner().head(&self.path).await {
                Ok(m) if m.size == len => {}
                _ => {
                    return Err(request(&self.store, "multipart PUT (complete)", &self.key)(
                        e,
                    ));
                }
            }
        }
        self.delete_record().await;
        Ok(len)
    }

    /// Aborts the upload and deletes its record (kept when the abort failed, for `gc`).
    pub async fn abort(mut self) {
        self.abort_inner().await;
    }

    async fn abort_inner(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        match self.mp.abort_multipart(&self.path, &self.id).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => self.delete_record().await,
            Err(e) => tracing::warn!(
                key = %self.store.url().url_of(&self.key),
                error = %e,
                "cannot abort a multipart upload; its record stays for gc"
            ),
        }
    }

    async fn delete_record(&self) {
        match self
            .store
            .inner()
            .delete(&self.store.path(&self.record))
            .await
        {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => tracing::warn!(
                record = %self.store.url().url_of(&self.record),
                error = %e,
                "cannot delete an upload record; gc removes it"
            ),
        }
    }
}

fn request<'a>(
    store: &'a RemoteStore,
    op: &'static str,
    key: &str,
) -> impl FnOnce(object_store::Error) -> RemoteError + 'a {
    let key = store.url().url_of(key);
    move |source| RemoteError::Request { op, key, source }
}

/// Aborts the upload a record names (an upload already completed or aborted is fine).
///
/// # Errors
/// [`RemoteError::Request`] naming the object.
pub async fn abort_recorded(
    store: &RemoteStore,
    generation: &str,
    record: &UploadRecord,
) -> Result<bool, RemoteError> {
    let Some(mp) = store.multipart_store() else {
        return Ok(false);
    };
    let key = generation_key(generation, &record.key);
    match mp
        .abort_multipart(&store.path(&key), &record.upload_id)
        .await
    {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(true),
        Err(e) => Err(request(store, "multipart abort", &key)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::remote::url::RemoteOptions;

    #[test]
    fn recorded_uploads_leave_no_record_when_done_and_those_left_open_can_be_aborted() {
        let s = RemoteStore::open("memory://recorded/ckpt", &RemoteOptions::builtin()).unwrap();
        let data: Vec<u8> = (0..(11u32 << 20)).map(|i| (i % 253) as u8).collect();
        // Completed: the object is whole and its record is gone.
        let mut up = s
            .block_on(RecordedUpload::begin(
                &s,
                "generations/0000000000001-a/a/c/0",
                Some(2),
            ))
            .unwrap()
            .unwrap();
        assert_eq!(
            s.list("generations/0000000000001-a/uploads").unwrap().len(),
            1
        );
        let done = s.block_on(async {
            for c in data.chunks(3 << 20) {
                up.write(c).await.unwrap();
            }
            up.finish().await.unwrap()
        });
        assert_eq!(done, data.len() as u64);
        assert_eq!(
            s.get("generations/0000000000001-a/a/c/0")
                .unwrap()
                .unwrap()
                .0,
            data
        );
        assert!(
            s.list("generations/0000000000001-a/uploads")
                .unwrap()
                .is_empty()
        );
        // Left open (its writer "killed"): recorded, so gc finds and aborts it.
        let (path, id) = s.block_on(async {
            let mut up = RecordedUpload::begin(&s, "generations/0000000000002-b/a/c/0", Some(1))
                .await
                .unwrap()
                .unwrap();
            up.write(&data[..6 << 20]).await.unwrap();
            while !up.tasks.is_empty() {
                up.wait_one().await.unwrap();
            }
            (up.path.clone(), up.id.clone())
        });
        let records = s.list("generations/0000000000002-b/uploads").unwrap();
        assert_eq!(records.len(), 1);
        let rec: UploadRecord =
            serde_json::from_slice(&s.get(&records[0].0).unwrap().unwrap().0).unwrap();
        assert_eq!((rec.key.as_str(), rec.rank), ("a/c/0", Some(1)));
        assert_eq!(rec.upload_id, id);
        // What gc does with the record: the upload is aborted.
        assert!(
            s.block_on(abort_recorded(&s, "0000000000002-b", &rec))
                .unwrap()
        );
        // The upload is gone from the store: completing it now fails.
        let mp = Arc::clone(s.multipart_store().unwrap());
        assert!(
            s.block_on(mp.complete_multipart(&path, &id, Vec::new()))
                .is_err()
        );
        assert_eq!(split_generation("generations/g/x/y"), Some(("g", "x/y")));
        assert_eq!(split_generation("other/g/x"), None);
    }
}
