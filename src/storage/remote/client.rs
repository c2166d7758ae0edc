//! A synchronous face on an `object_store` store: one shared tokio runtime, keys relative to
//! the checkpoint's prefix, errors naming the full URL, whole-object puts with a precondition,
//! streamed multipart uploads with a bounded number of parts in flight, streamed downloads
//! checked against their size and crc32c.

use std::hash::{BuildHasher, RandomState};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload, UpdateVersion};

use super::error::RemoteError;
use super::url::{RemoteOptions, RemoteUrl, build_stores};

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
    multipart: Option<Arc<dyn MultipartStore>>,
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
    /// See [`RemoteUrl::parse`] and [`super::url::build_store`].
    pub fn open(url: &str, opts: &RemoteOptions) -> Result<Self, RemoteError> {
        let url = RemoteUrl::parse(url)?;
        let built = build_stores(&url, opts)?;
        Ok(Self {
            store: built.store,
            multipart: built.multipart,
            url,
            endpoint: built.endpoint,
            opts: opts.clone(),
        })
    }

    /// Wraps an existing store (tests: a store behind a failure-injecting wrapper). It has no
    /// explicit multipart API until [`RemoteStore::with_multipart_store`] gives it one, so its
    /// large objects go through `put_multipart` unrecorded (see [`super::multipart`]).
    #[must_use]
    pub fn from_store(store: Arc<dyn ObjectStore>, url: RemoteUrl, opts: &RemoteOptions) -> Self {
        let endpoint = url.root.clone();
        Self {
            store,
            multipart: None,
            url,
            endpoint,
            opts: opts.clone(),
        }
    }

    /// The same store with `multipart` as its explicit multipart API (the same bucket seen
    /// through `object_store`'s [`MultipartStore`]): multipart uploads are then recorded
    /// under the generation, so that `gc` can abort those a crash left open.
    #[must_use]
    pub fn with_multipart_store(mut self, multipart: Arc<dyn MultipartStore>) -> Self {
        self.multipart = Some(multipart);
        self
    }

    /// The store's explicit multipart API, when it has one.
    #[must_use]
    pub fn multipart_store(&self) -> Option<&Arc<dyn MultipartStore>> {
        self.multipart.as_ref()
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

    /// Maps an `object_store` error of `op` on `key` to [`RemoteError::Request`].
    pub(crate) fn err(
        &self,
        op: &'static str,
        key: &str,
    ) -> impl Fn(object_store::Error) -> RemoteError + '_ {
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

    /// Runs a future as a task of the shared runtime's workers and waits for its output. A
    /// future that receives response bodies should run so: its body chunks are then taken
    /// where the connections are driven, and the calling thread wakes once, at the end, not
    /// once per chunk (which costs a context switch each when many threads wait on reads).
    ///
    /// # Panics
    /// When the future panics (the panic goes on in the caller).
    pub fn run<F>(&self, f: F) -> F::Output
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let rt = runtime();
        match rt.block_on(rt.spawn(f)) {
            Ok(v) => v,
            Err(e) => match e.try_into_panic() {
                Ok(p) => std::panic::resume_unwind(p),
                // Invariant: the runtime is never shut down and the task never aborted.
                Err(e) => panic!("object-store task ended without a result: {e}"),
            },
        }
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

    /// Writes a whole object under a precondition. An ambiguous answer (a dropped connection,
    /// a 409 while another conditional write is in flight, a 412 on the retry of a try that
    /// had landed) is settled by reading the object back (see [`RemoteStore::put_resolved`]).
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
        self.block_on(self.put_resolved(&path, data, mode))
            .map_err(self.err("PUT", key))
    }

    /// One conditional put, with the client's own retries on top of `object_store`'s (which
    /// retries 5xx, `SlowDown`, 429, 408 and connection errors, but neither a dropped
    /// connection after a conditional PUT was sent nor a 409 on put-if-absent):
    /// - `AlreadyExists` / `Precondition`: the object is read back. Absent after
    ///   put-if-absent: a 409 (a conditional write in flight) -> retried. Holding exactly
    ///   `data`: an earlier try of this put landed -> [`PutOutcome::Written`]. Else
    ///   [`PutOutcome::Exists`] / [`PutOutcome::Changed`]. Sound because the callers' bytes
    ///   are unique to their save (they name its generation).
    /// - a transport error (connection dropped or reset, a try past `request_timeout`) ->
    ///   retried.
    ///
    /// Retries back off exponentially with jitter (`init_backoff` .. `max_backoff`), at most
    /// `max_retries` of them, none started after `retry_timeout`.
    ///
    /// # Errors
    /// The last `object_store` error.
    pub async fn put_resolved(
        &self,
        path: &ObjPath,
        data: Bytes,
        mode: PutMode,
    ) -> Result<PutOutcome, object_store::Error> {
        let mut backoff = Backoff::new(&self.opts);
        loop {
            let r = self
                .store
                .put_opts(
                    path,
                    PutPayload::from(data.clone()),
                    PutOptions::from(mode.clone()),
                )
                .await;
            let e = match r {
                Ok(r) => return Ok(PutOutcome::Written(r.e_tag)),
                Err(e) => e,
            };
            let conditional = !matches!(mode, PutMode::Overwrite);
            if conditional
                && matches!(
                    e,
                    object_store::Error::AlreadyExists { .. }
                        | object_store::Error::Precondition { .. }
                )
            {
                match self.store.get(path).await {
                    Ok(got) => {
                        let etag = got.meta.e_tag.clone();
                        let bytes = got.bytes().await?;
                        if bytes == data {
                            return Ok(PutOutcome::Written(etag));
                        }
                        return Ok(if matches!(mode, PutMode::Create) {
                            PutOutcome::Exists
                        } else {
                            PutOutcome::Changed
                        });
                    }
                    Err(object_store::Error::NotFound { .. })
                        if matches!(mode, PutMode::Update(_)) =>
                    {
                        return Ok(PutOutcome::Changed);
                    }
                    // Put-if-absent refused, yet nothing there: a 409 (another conditional
                    // write to the key was in flight): retry.
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(g) => return Err(g),
                }
            } else if !is_transport(&e) {
                return Err(e);
            }
            match backoff.next() {
                Some(sleep) => tokio::time::sleep(sleep).await,
                None => return Err(e),
            }
        }
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

/// Exponential backoff with decorrelated jitter for the client's own retries (the same policy
/// as `object_store`'s): each sleep is drawn between `init_backoff` and 2x the previous one,
/// capped at `max_backoff`; `None` once `max_retries` are spent or `retry_timeout` has passed.
struct Backoff {
    init: f64,
    max: f64,
    next: f64,
    left: usize,
    deadline: Instant,
    seed: RandomState,
    n: u64,
}

impl Backoff {
    fn new(opts: &RemoteOptions) -> Self {
        let init = opts.init_backoff.as_secs_f64();
        Self {
            init,
            max: opts.max_backoff.as_secs_f64().max(init),
            next: init,
            left: opts.max_retries,
            deadline: Instant::now() + opts.retry_timeout,
            seed: RandomState::new(),
            n: 0,
        }
    }

    fn next(&mut self) -> Option<Duration> {
        if self.left == 0 || Instant::now() >= self.deadline {
            return None;
        }
        self.left -= 1;
        self.n += 1;
        #[allow(clippy::cast_precision_loss)] // a uniform draw in [0, 1)
        let u = (self.seed.hash_one(self.n) >> 11) as f64 / (1u64 << 53) as f64;
        let sleep = self.next;
        let upper = (self.next * 2.0).max(self.init);
        self.next = (self.init + u * (upper - self.init)).min(self.max);
        Some(Duration::from_secs_f64(sleep.min(self.max)))
    }
}

/// True for a transport failure (connection dropped, reset or refused, a try that timed out):
/// worth retrying a conditional put whose outcome is then settled by reading back. A request
/// error of `object_store` that carries no HTTP answer is one (its retry error type is not
/// public, so the answer is recognised by its message: "Server returned ...").
fn is_transport(e: &object_store::Error) -> bool {
    let object_store::Error::Generic { source, .. } = e else {
        return false;
    };
    let mut chain: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
    while let Some(s) = chain {
        if s.to_string().contains("Server returned") {
            return false;
        }
        chain = s.source();
    }
    true
}
