//! A synchronous face on an `object_store` store: one shared tokio runtime, keys relative to
//! the checkpoint's prefix, errors naming the full URL, whole-object puts with a precondition,
//! streamed multipart uploads with a bounded number of parts in flight, streamed downloads
//! checked against their size and crc32c.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload, UpdateVersion, WriteMultipart};

use super::error::RemoteError;
use super::url::{RemoteOptions, RemoteUrl, build_store};

/// The runtime every store shares (object stores are async; the engines are not).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("zarrckpt-objstore")
            .enable_all()
            .build()
            .expect("cannot start the object-store runtime (threads or timers unavailable)")
    })
}

/// What a conditional put found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// Written; the new object's ETag (when the store reports one).
    Written(Option<String>),
    /// Put-if-absent: an object was there already.
    Exists,
    /// Put-if-match: the object's ETag no longer matched (or it was gone).
    Changed,
}

/// A precondition on a put.
#[derive(Clone, Debug)]
pub enum Condition {
    /// Overwrite whatever is there.
    None,
    /// Only if no object has the key (`If-None-Match: *`).
    Absent,
    /// Only if the object's ETag is this one (`If-Match`).
    Matches(String),
}

/// A checkpoint prefix in an object store.
#[derive(Clone)]
pub struct RemoteStore {
    store: Arc<dyn ObjectStore>,
    url: RemoteUrl,
    endpoint: String,
    opts: RemoteOptions,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("url", &self.url.url())
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl RemoteStore {
    /// Opens the store a URL names (no request is made).
    ///
    /// # Errors
    /// See [`RemoteUrl::parse`] and [`build_store`].
    pub fn open(url: &str, opts: &RemoteOptions) -> Result<Self, RemoteError> {
        let url = RemoteUrl::parse(url)?;
        let (store, endpoint) = build_store(&url, opts)?;
        Ok(Self {
            store,
            url,
            endpoint,
            opts: opts.clone(),
        })
    }

    /// Wraps an existing store (tests: a store behind a failure-injecting wrapper).
    #[must_use]
    pub fn from_store(store: Arc<dyn ObjectStore>, url: RemoteUrl, opts: &RemoteOptions) -> Self {
        let endpoint = url.root.clone();
        Self {
            store,
            url,
            endpoint,
            opts: opts.clone(),
        }
    }

    /// The parsed URL.
    #[must_use]
    pub fn url(&self) -> &RemoteUrl {
        &self.url
    }

    /// The endpoint named in messages (`http://127.0.0.1:8333`, or `s3://bucket`).
    #[must_use]
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The options it was opened with.
    #[must_use]
    pub fn options(&self) -> &RemoteOptions {
        &self.opts
    }

    /// The underlying `object_store` store.
    #[must_use]
    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The object path of `key` (relative to the checkpoint's prefix).
    #[must_use]
    pub fn path(&self, key: &str) -> ObjPath {
        let full = match (self.url.prefix.is_empty(), key.is_empty()) {
            (true, _) => key.to_string(),
            (false, true) => self.url.prefix.clone(),
            (false, false) => format!("{}/{key}", self.url.prefix),
        };
        ObjPath::from(full)
    }

    /// The key of an object path relative to the checkpoint's prefix.
    #[must_use]
    pub fn relative_key(&self, path: &ObjPath) -> String {
        let s = path.as_ref();
        if self.url.prefix.is_empty() {
            s.to_string()
        } else {
            s.strip_prefix(&self.url.prefix)
                .map_or(s, |r| r.trim_start_matches('/'))
                .to_string()
        }
    }

    fn err(&self, op: &'static str, key: &str) -> impl Fn(object_store::Error) -> RemoteError + '_ {
        let key = self.url.url_of(key);
        move |source| RemoteError::Request {
            op,
            key: key.clone(),
            source,
        }
    }

    /// Enters the shared runtime's context (for calls that spawn tasks, such as
    /// `WriteMultipart::write`), until the guard is dropped.
    pub fn enter(&self) -> tokio::runtime::EnterGuard<'static> {
        runtime().enter()
    }

    /// Runs a future on the shared runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        runtime().block_on(f)
    }

    /// Reads a whole object: `None` when absent, else its bytes and ETag.
    ///
    /// # Errors
    /// [`RemoteError::Request`] naming the key and the cause.
    pub fn get(&self, key: &str) -> Result<Option<(Bytes, Option<String>)>, RemoteError> {
        let path = self.path(key);
        self.block_on(async {
            match self.store.get(&path).await {
                Ok(r) => {
                    let etag = r.meta.e_tag.clone();
                    let bytes = r.bytes().await.map_err(self.err("GET", key))?;
                    Ok(Some((bytes, etag)))
                }
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err("GET", key)(e)),
            }
        })
    }

    /// The size of an object, `None` when absent.
    ///
    /// # Errors
    /// [`RemoteError::Request`].
    pub fn head(&self, key: &str) -> Result<Option<u64>, RemoteError> {
        let path = self.path(key);
        self.block_on(async {
            match self.store.head(&path).await {
                Ok(m) => Ok(Some(m.size)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err("HEAD", key)(e)),
            }
        })
    }

    /// Writes a whole object under a precondition.
    ///
    /// # Errors
    /// [`RemoteError::Request`] for anything but a failed precondition (reported as
    /// [`PutOutcome::Exists`] / [`PutOutcome::Changed`]).
    pub fn put(&self, key: &str, data: Bytes, cond: &Condition) -> Result<PutOutcome, RemoteError> {
        let path = self.path(key);
        let mode = match cond {
            Condition::None => PutMode::Overwrite,
            Condition::Absent => PutMode::Create,
            Condition::Matches(etag) => PutMode::Update(UpdateVersion {
                e_tag: Some(etag.clone()),
                version: None,
            }),
        };
        self.block_on(async {
            let r = self
                .store
                .put_opts(&path, PutPayload::from(data), PutOptions::from(mode))
                .await;
            match r {
                Ok(r) => Ok(PutOutcome::Written(r.e_tag)),
                Err(object_store::Error::AlreadyExists { .. })
                    if matches!(cond, Condition::Absent) =>
                {
                    Ok(PutOutcome::Exists)
                }
                Err(object_store::Error::Precondition { .. }) => Ok(match cond {
                    Condition::Absent => PutOutcome::Exists,
                    _ => PutOutcome::Changed,
                }),
                Err(e) => Err(self.err("PUT", key)(e)),
            }
        })
    }

    /// Keys (relative to the checkpoint's prefix) of every object under `sub` (`""`: all).
    ///
    /// # Errors
    /// [`RemoteError::Request`].
    pub fn list(&self, sub: &str) -> Result<Vec<(String, u64)>, RemoteError> {
        let path = self.path(sub);
        self.block_on(async {
            let mut out = Vec::new();
            let mut s = self.store.list(Some(&path));
            while let Some(m) = s.next().await {
                let m = m.map_err(self.err("LIST", sub))?;
                out.push((self.relative_key(&m.location), m.size));
            }
            out.sort();
            Ok(out)
        })
    }

    /// One level under the checkpoint's prefix: the child prefixes (relative names, such as
    /// `step-00000100`) and the objects directly there (relative keys).
    ///
    /// # Errors
    /// [`RemoteError::Request`].
    pub fn list_level(&self) -> Result<(Vec<String>, Vec<String>), RemoteError> {
        let path = self.path("");
        self.block_on(async {
            let r = self
                .store
                .list_with_delimiter(if self.url.prefix.is_empty() {
                    None
                } else {
                    Some(&path)
                })
                .await
                .map_err(self.err("LIST", ""))?;
            let mut dirs: Vec<String> = r
                .common_prefixes
                .iter()
                .map(|p| self.relative_key(p))
                .collect();
            let mut objs: Vec<String> = r
                .objects
                .iter()
                .map(|m| self.relative_key(&m.location))
                .collect();
            dirs.sort();
            objs.sort();
            Ok((dirs, objs))
        })
    }

    /// The child prefixes directly under the checkpoint's prefix (not `generations`).
    ///
    /// # Errors
    /// [`RemoteError::Request`].
    pub fn list_children(&self) -> Result<Vec<String>, RemoteError> {
        Ok(self
            .list_level()?
            .0
            .into_iter()
            .filter(|d| d != super::GENERATIONS)
            .collect())
    }

    /// Deletes an object (absent is fine).
    ///
    /// # Errors
    /// [`RemoteError::Request`].
    pub fn delete(&self, key: &str) -> Result<(), RemoteError> {
        let path = self.path(key);
        self.block_on(async {
            match self.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.err("DELETE", key)(e)),
            }
        })
    }

    /// Uploads the local file `src` as `key`: one PUT (if-absent unless
    /// `allow_unconditional`) below the multipart threshold, else a multipart upload of
    /// `part_size` parts with at most `parts_in_flight` in flight, read from the file as they
    /// go (memory: about `parts_in_flight x part_size`). Returns `(size, crc32c)` of what was
    /// sent. A failed multipart upload is aborted.
    ///
    /// # Errors
    /// [`RemoteError::Io`] reading `src`; [`RemoteError::Request`] naming the key;
    /// [`RemoteError::Corrupt`] when the key exists already (a generation key reused).
    pub async fn upload_file(&self, key: &str, src: &Path) -> Result<(u64, u32), RemoteError> {
        let size = std::fs::metadata(src)
            .map_err(|e| RemoteError::io(src, e))?
            .len();
        let path = self.path(key);
        if size < self.opts.multipart_threshold {
            let data = tokio::task::block_in_place(|| std::fs::read(src))
                .map_err(|e| RemoteError::io(src, e))?;
            let crc = crc32c::crc32c(&data);
            let len = data.len() as u64;
            let mode = if self.opts.allow_unconditional {
                PutMode::Overwrite
            } else {
                PutMode::Create
            };
            match self
                .store
                .put_opts(&path, PutPayload::from(data), PutOptions::from(mode))
                .await
            {
                Ok(_) => Ok((len, crc)),
                Err(
                    object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. },
                ) => Err(RemoteError::Corrupt {
                    key: self.url.url_of(key),
                    detail: "the object exists already: a generation key was reused".into(),
                }),
                Err(e) => Err(self.err("PUT", key)(e)),
            }
        } else {
            let upload = self
                .store
                .put_multipart(&path)
                .await
                .map_err(self.err("multipart PUT", key))?;
            let part = self.opts.part_size.max(5 << 20);
            let mut w = WriteMultipart::new_with_chunk_size(upload, part);
            match self.stream_parts(&mut w, src, part).await {
                Ok((len, crc)) => {
                    w.finish().await.map_err(self.err("multipart PUT", key))?;
                    Ok((len, crc))
                }
                Err(e) => {
                    let _ = w.abort().await;
                    Err(e)
                }
            }
        }
    }

    async fn stream_parts(
        &self,
        w: &mut WriteMultipart,
        src: &Path,
        part: usize,
    ) -> Result<(u64, u32), RemoteError> {
        let mut f = std::fs::File::open(src).map_err(|e| RemoteError::io(src, e))?;
        let mut buf = vec![0u8; part];
        let (mut len, mut crc) = (0u64, 0u32);
        loop {
            w.wait_for_capacity(self.opts.parts_in_flight.max(1).saturating_sub(1))
                .await
                .map_err(|e| RemoteError::Request {
                    op: "multipart PUT",
                    key: src.display().to_string(),
                    source: e,
                })?;
            let n = tokio::task::block_in_place(|| read_full(&mut f, &mut buf))
                .map_err(|e| RemoteError::io(src, e))?;
            if n == 0 {
                break;
            }
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            len += n as u64;
            w.write(&buf[..n]);
        }
        Ok((len, crc))
    }

    /// Downloads `key` into the local file `dst`, streamed, checking its size and crc32c
    /// against what the commit recorded.
    ///
    /// # Errors
    /// [`RemoteError::Request`]; [`RemoteError::Corrupt`] on a size or checksum mismatch;
    /// [`RemoteError::Io`] writing `dst`.
    pub async fn download_file(
        &self,
        key: &str,
        dst: &Path,
        size: u64,
        crc32c: u32,
    ) -> Result<(), RemoteError> {
        let path = self.path(key);
        let r = self.store.get(&path).await.map_err(self.err("GET", key))?;
        let mut stream = r.into_stream();
        let mut f = std::fs::File::create(dst).map_err(|e| RemoteError::io(dst, e))?;
        let (mut len, mut crc) = (0u64, 0u32);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(self.err("GET", key))?;
            crc = crc32c::crc32c_append(crc, &chunk);
            len += chunk.len() as u64;
            if len > size {
                break;
            }
            tokio::task::block_in_place(|| f.write_all(&chunk))
                .map_err(|e| RemoteError::io(dst, e))?;
        }
        if len != size || crc != crc32c {
            return Err(RemoteError::Corrupt {
                key: self.url.url_of(key),
                detail: format!(
                    "the object does not match the manifest: {len} bytes with crc32c {crc:#010x}, the commit recorded {size} bytes with crc32c {crc32c:#010x}"
                ),
            });
        }
        Ok(())
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
