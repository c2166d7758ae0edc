//! The storage seam ([`crate::storage::store::Store`]) on an object store: whole-object puts
//! with put-if-absent / put-if-match (retried, and settled by reading back after a lost
//! answer: a conditional put of the bytes the object already holds counts as written, so
//! callers that need mutual exclusion put bytes unique to themselves), a bounded multipart
//! writer, coalesced ranged gets, listing and deletes, all through `object_store`. No rename,
//! no locks, no directories: the commit on such a store is the generation + pointer profile
//! of [`super::generation`].

use std::io::IoSlice;
use std::ops::Range;
use std::path::PathBuf;

use bytes::Bytes;
use futures::StreamExt;
use object_store::{PutPayload, WriteMultipart};

use super::client::{PutOutcome, RemoteStore};
use crate::storage::error::StorageError;
use crate::storage::store::{
    Capabilities, GET_RANGE_BYTES, ListResult, MultipartWrite, ObjectMeta, PutMode, PutResult,
    Store, check_location,
};

fn io(op: &'static str, path: PathBuf) -> impl FnOnce(object_store::Error) -> StorageError {
    move |e| match e {
        object_store::Error::NotFound { .. } => StorageError::NotFound { path },
        e => StorageError::Io {
            op,
            path,
            source: std::io::Error::other(e),
        },
    }
}

fn meta_of(store: &RemoteStore, m: &object_store::ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        location: store.relative_key(&m.location),
        size: m.size,
        e_tag: m.e_tag.clone(),
        version: m.version.clone(),
    }
}

impl RemoteStore {
    /// [`Store::put_opts`] of bytes the caller hands over (no copy: an object a writer held
    /// in memory goes out as it is).
    pub(crate) fn put_owned(
        &self,
        location: &str,
        data: Bytes,
        mode: PutMode,
    ) -> Result<PutResult, StorageError> {
        check_location(location)?;
        let path = self.display_path(location);
        let expected = match &mode {
            PutMode::Update(v) => v.e_tag.clone().unwrap_or_default(),
            _ => String::new(),
        };
        let om = match mode {
            PutMode::Overwrite => object_store::PutMode::Overwrite,
            PutMode::Create => object_store::PutMode::Create,
            PutMode::Update(v) => object_store::PutMode::Update(object_store::UpdateVersion {
                e_tag: v.e_tag,
                version: v.version,
            }),
        };
        let key = self.path(location);
        if !matches!(om, object_store::PutMode::Overwrite) {
            // Conditional: retried and, after a lost answer, settled by reading back (see
            // `RemoteStore::put_resolved`): bytes equal to the object's count as written.
            return match self.block_on(self.put_resolved(&key, data, om)) {
                Ok(PutOutcome::Written(e_tag)) => Ok(PutResult {
                    e_tag,
                    version: None,
                }),
                Ok(PutOutcome::Exists) => Err(StorageError::ObjectExists { path }),
                Ok(PutOutcome::Changed) => Err(StorageError::Precondition {
                    path,
                    expected,
                    found: "another version, or no object".into(),
                }),
                Err(e) => Err(io("PUT", path)(e)),
            };
        }
        let r = self.block_on(
            self.inner()
                .put_opts(&key, PutPayload::from(data), om.into()),
        );
        match r {
            Ok(r) => Ok(PutResult {
                e_tag: r.e_tag,
                version: r.version,
            }),
            Err(object_store::Error::AlreadyExists { .. }) if expected.is_empty() => {
                Err(StorageError::ObjectExists { path })
            }
            Err(
                object_store::Error::Precondition { .. }
                | object_store::Error::AlreadyExists { .. },
            ) => {
                if expected.is_empty() {
                    Err(StorageError::ObjectExists { path })
                } else {
                    Err(StorageError::Precondition {
                        path,
                        expected,
                        found: "another version, or no object".into(),
                    })
                }
            }
            Err(e) => Err(io("PUT", path)(e)),
        }
    }
}

impl Store for RemoteStore {
    fn display_path(&self, location: &str) -> PathBuf {
        PathBuf::from(self.url().url_of(location))
    }

    fn put_opts(
        &self,
        location: &str,
        payload: &[&[u8]],
        mode: PutMode,
    ) -> Result<PutResult, StorageError> {
        // One copy into the request's body, whatever the number of slices.
        let data = match payload {
            [one] => Bytes::copy_from_slice(one),
            many => Bytes::from(many.concat()),
        };
        self.put_owned(location, data, mode)
    }

    fn put_multipart(&self, location: &str) -> Result<Box<dyn MultipartWrite + '_>, StorageError> {
        check_location(location)?;
        let path = self.display_path(location);
        let key = self.path(location);
        let upload = self
            .block_on(self.inner().put_multipart(&key))
            .map_err(io("multipart PUT", path.clone()))?;
        let part = self.options().part_size.max(5 << 20);
        Ok(Box::new(RemoteMultipart {
            store: self,
            path,
            w: Some(WriteMultipart::new_with_chunk_size(upload, part)),
            written: 0,
        }))
    }

    fn get_ranges(
        &self,
        location: &str,
        ranges: &[Range<u64>],
    ) -> Result<Vec<Vec<u8>>, StorageError> {
        check_location(location)?;
        let path = self.display_path(location);
        let key = self.path(location);
        // Each range exactly as asked (callers coalesce to their own gap), cut into pieces of
        // at most GET_RANGE_BYTES bytes, up to `concurrency` pieces in flight, in order, so that one
        // large range is fetched as fast as many small ones.
        let pieces: Vec<(usize, Range<u64>)> = ranges
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                (r.start..r.end)
                    .step_by(usize::try_from(GET_RANGE_BYTES).unwrap_or(usize::MAX))
                    .map(move |at| (i, at..r.end.min(at.saturating_add(GET_RANGE_BYTES))))
            })
            .collect();
        let inner = std::sync::Arc::clone(self.inner());
        let n = self.options().concurrency.max(1);
        let ranges = ranges.to_vec();
        self.run(async move {
            let mut out: Vec<Vec<u8>> = ranges.iter().map(|_| Vec::new()).collect();
            let mut got = futures::stream::iter(pieces.into_iter().map(|(i, r)| {
                let (inner, key) = (&inner, &key);
                async move { inner.get_range(key, r.clone()).await.map(|b| (i, r, b)) }
            }))
            .buffered(n);
            while let Some(piece) = got.next().await {
                let (i, r, b) = piece.map_err(io("GET", path.clone()))?;
                if b.len() as u64 != r.end - r.start {
                    return Err(StorageError::Io {
                        op: "GET",
                        path: path.clone(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!(
                                "asked for bytes {}..{}, got {} bytes",
                                r.start,
                                r.end,
                                b.len()
                            ),
                        ),
                    });
                }
                let whole = &ranges[i];
                if out[i].is_empty() && r.end == whole.end {
                    out[i] = Vec::from(b); // the range in one piece: no copy when unshared
                } else {
                    if out[i].is_empty() {
                        out[i].reserve_exact(usize::try_from(whole.end - whole.start).unwrap_or(0));
                    }
                    out[i].extend_from_slice(&b);
                }
            }
            Ok(out)
        })
    }

    fn head(&self, location: &str) -> Result<ObjectMeta, StorageError> {
        check_location(location)?;
        let key = self.path(location);
        let m = self
            .block_on(self.inner().head(&key))
            .map_err(io("HEAD", self.display_path(location)))?;
        Ok(meta_of(self, &m))
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StorageError> {
        let key = self.path(prefix);
        let path = self.display_path(prefix);
        let mut out = self.block_on(async {
            let mut s = self.inner().list(Some(&key));
            let mut out = Vec::new();
            while let Some(m) = s.next().await {
                out.push(meta_of(self, &m.map_err(io("LIST", path.clone()))?));
            }
            Ok::<_, StorageError>(out)
        })?;
        out.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(out)
    }

    fn list_with_delimiter(&self, prefix: &str) -> Result<ListResult, StorageError> {
        let key = self.path(prefix);
        let r = self
            .block_on(self.inner().list_with_delimiter(Some(&key)))
            .map_err(io("LIST", self.display_path(prefix)))?;
        let mut common_prefixes: Vec<String> = r
            .common_prefixes
            .iter()
            .map(|p| self.relative_key(p))
            .collect();
        let mut objects: Vec<ObjectMeta> = r.objects.iter().map(|m| meta_of(self, m)).collect();
        common_prefixes.sort();
        objects.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(ListResult {
            common_prefixes,
            objects,
        })
    }

    fn delete(&self, location: &str) -> Result<(), StorageError> {
        check_location(location)?;
        match self.block_on(self.inner().delete(&self.path(location))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(io("DELETE", self.display_path(location))(e)),
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            conditional_put: !self.options().allow_unconditional,
            ..Capabilities::default()
        }
    }
}

/// A multipart upload with at most `parts_in_flight` parts of `part_size` in flight.
struct RemoteMultipart<'a> {
    store: &'a RemoteStore,
    path: PathBuf,
    w: Option<WriteMultipart>,
    written: u64,
}

impl MultipartWrite for RemoteMultipart<'_> {
    fn write_vectored(&mut self, parts: &[IoSlice<'_>]) -> Result<(), StorageError> {
        let n = self
            .store
            .options()
            .parts_in_flight
            .max(1)
            .saturating_sub(1);
        let Some(w) = self.w.as_mut() else {
            return Err(StorageError::Unsupported {
                op: "write after finish",
                path: self.path.clone(),
            });
        };
        for p in parts {
            self.store
                .block_on(w.wait_for_capacity(n))
                .map_err(io("multipart PUT", self.path.clone()))?;
            let _in_runtime = self.store.enter();
            w.write(p);
            self.written += p.len() as u64;
        }
        Ok(())
    }

    fn written(&self) -> u64 {
        self.written
    }

    fn finish(mut self: Box<Self>) -> Result<PutResult, StorageError> {
        let w = self.w.take().expect("finish once");
        let r = self
            .store
            .block_on(w.finish())
            .map_err(io("multipart PUT", self.path.clone()))?;
        Ok(PutResult {
            e_tag: r.e_tag,
            version: r.version,
        })
    }

    fn abort(mut self: Box<Self>) -> Result<(), StorageError> {
        match self.w.take() {
            Some(w) => self
                .store
                .block_on(w.abort())
                .map_err(io("multipart abort", self.path.clone())),
            None => Ok(()),
        }
    }
}

impl Drop for RemoteMultipart<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.w.take() {
            let _ = self.store.block_on(w.abort());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::remote::RemoteOptions;
    use crate::storage::store::UpdateVersion;

    #[test]
    fn long_ranges_come_back_whole_from_pieces_fetched_at_once() {
        let s = RemoteStore::open("memory://pieces/ckpt", &RemoteOptions::default()).unwrap();
        let n = usize::try_from(2 * GET_RANGE_BYTES + 12345).unwrap();
        let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        Store::put(&s, "big", &[&data]).unwrap();
        let whole = 0..n as u64;
        let across = GET_RANGE_BYTES - 7..2 * GET_RANGE_BYTES + 100;
        let got = Store::get_ranges(&s, "big", &[whole, 3..3, across.clone(), 10..20]).unwrap();
        assert_eq!(got[0], data);
        assert!(got[1].is_empty());
        let at =
            |r: &Range<u64>| usize::try_from(r.start).unwrap()..usize::try_from(r.end).unwrap();
        assert_eq!(got[2], data[at(&across)]);
        assert_eq!(got[3], data[10..20]);
        // A range past the end is an error naming the object, not short data.
        let past = n as u64 - 5..n as u64 + 5;
        let e = Store::get_ranges(&s, "big", std::slice::from_ref(&past)).unwrap_err();
        assert!(e.to_string().contains("memory://pieces/ckpt/big"), "{e}");
    }

    #[test]
    fn the_seam_on_an_in_memory_object_store() {
        let s = RemoteStore::open("memory://seam/ckpt", &RemoteOptions::default()).unwrap();
        let r = Store::put_if_absent(&s, "a/x", &[b"he", b"llo"]).unwrap();
        assert!(matches!(
            Store::put_if_absent(&s, "a/x", &[b"no"]),
            Err(StorageError::ObjectExists { .. })
        ));
        let wrong = UpdateVersion {
            e_tag: Some("\"nope\"".into()),
            version: None,
        };
        assert!(matches!(
            Store::put_if_match(&s, "a/x", &[b"no"], &wrong),
            Err(StorageError::Precondition { .. })
        ));
        Store::put_if_match(&s, "a/x", &[b"HELLO"], &r.update_version()).unwrap();
        assert_eq!(
            Store::get_ranges(&s, "a/x", &[1..3, 0..5]).unwrap(),
            vec![b"EL".to_vec(), b"HELLO".to_vec()]
        );
        assert_eq!(Store::head(&s, "a/x").unwrap().size, 5);
        let mut w = Store::put_multipart(&s, "a/b/big").unwrap();
        w.write(&vec![7u8; 3 << 20]).unwrap();
        w.write_vectored(&[IoSlice::new(&[1, 2]), IoSlice::new(&[3])])
            .unwrap();
        assert_eq!(w.written(), (3 << 20) + 3);
        w.finish().unwrap();
        assert_eq!(Store::head(&s, "a/b/big").unwrap().size, (3 << 20) + 3);
        let l = Store::list_with_delimiter(&s, "a").unwrap();
        assert_eq!(l.common_prefixes, vec!["a/b".to_string()]);
        assert_eq!(
            l.objects
                .iter()
                .map(|o| o.location.as_str())
                .collect::<Vec<_>>(),
            vec!["a/x"]
        );
        assert_eq!(Store::list(&s, "").unwrap().len(), 2);
        Store::delete(&s, "a/x").unwrap();
        assert!(matches!(
            Store::head(&s, "a/x"),
            Err(StorageError::NotFound { .. })
        ));
        assert!(!Store::capabilities(&s).rename && Store::capabilities(&s).conditional_put);
    }
}
