//! Early abort of a save whose upload failed for good (spec "Object-store profile of the
//! commit", abort markers). The ranks of a save learn each other's outcome only at the
//! agreement after every upload; a rank whose upload failed (after the client's retries)
//! therefore also puts an abort marker `generations/<id>/abort/<rank>` naming its rank, the
//! object and the HTTP status, and every rank's writer looks for markers of others (one LIST
//! of that folder) before each object and between parts, at most once per
//! [`super::RemoteOptions::abort_check_interval`]. A rank that finds one stops with
//! [`RemoteError::Abandoned`] instead of finishing its uploads, so nobody spends its upload
//! and then waits in the agreement.
//!
//! Through the store rather than the communicator: the communicator is busy only in the
//! collectives (the ranks upload independently between two of them, and a communicator
//! moves bytes only inside a collective every rank has entered), while the store is what
//! every rank already talks to during the upload. A marker also tells `gc` that the generation
//! is dead (see `gc_with`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use object_store::PutMode;
use serde::{Deserialize, Serialize};

use super::base::generation_key;
use super::client::RemoteStore;
use super::error::RemoteError;

/// The folder of a generation's abort markers.
pub const ABORT: &str = "abort";

/// An abort marker's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortMarker {
    /// Format version of the marker (1).
    pub zarrckpt_abort: u32,
    /// The rank whose upload failed (absent when its writer did not know its rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// The URL of the object that failed.
    pub key: String,
    /// The last HTTP status, when the server answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The error, as text.
    pub error: String,
}

/// The HTTP status an `object_store` error message reports (`... status code: 503 ...`).
#[must_use]
pub fn http_status(text: &str) -> Option<u16> {
    let (_, rest) = text.split_once("status code: ")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().filter(|s| (100..600).contains(s))
}

/// One rank's view of the abort markers of the generation it writes (see the module docs).
#[derive(Debug)]
pub struct AbortWatch {
    store: RemoteStore,
    generation: String,
    rank: Option<usize>,
    name: String,
    interval: Duration,
    next: Mutex<Option<Instant>>,
    seen: Mutex<Option<AbortMarker>>,
    raised: AtomicBool,
}

impl AbortWatch {
    /// This writer's name: its rank, or its random token.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A watch of generation `generation` for a writer of rank `rank` (`None`: unknown; its
    /// marker is then named by a random token).
    #[must_use]
    pub fn new(store: &RemoteStore, generation: &str, rank: Option<usize>) -> Self {
        let name = match rank {
            Some(r) => r.to_string(),
            None => format!(
                "w-{}",
                &crate::storage::footer::SaveId::random().hex()[..16]
            ),
        };
        Self {
            store: store.clone(),
            generation: generation.to_owned(),
            rank,
            name,
            interval: store.options().abort_check_interval,
            next: Mutex::new(None),
            seen: Mutex::new(None),
            raised: AtomicBool::new(false),
        }
    }

    /// The key of this writer's own marker.
    #[must_use]
    pub fn marker_key(&self) -> String {
        generation_key(&self.generation, &format!("{ABORT}/{}", self.name))
    }

    fn abandoned(&self, m: AbortMarker) -> RemoteError {
        RemoteError::Abandoned {
            generation: self.generation.clone(),
            rank: m.rank,
            key: m.key,
            status: m.status,
            error: m.error,
        }
    }

    /// Fails when another writer's marker is there; looks (one LIST) at most once per
    /// interval, else answers from the last look. A failed look is not an error (the
    /// agreement after the uploads still catches every failure).
    ///
    /// # Errors
    /// [`RemoteError::Abandoned`] naming the failed rank, object and status.
    pub async fn check(&self) -> Result<(), RemoteError> {
        if let Some(m) = lock(&self.seen).clone() {
            return Err(self.abandoned(m));
        }
        {
            let mut next = lock(&self.next);
            let now = Instant::now();
            if next.is_some_and(|n| now < n) {
                return Ok(());
            }
            *next = Some(now + self.interval);
        }
        let own = self.marker_key();
        let prefix = self.store.path(&generation_key(&self.generation, ABORT));
        let mut found = None;
        {
            let mut list = self.store.inner().list(Some(&prefix));
            while let Some(m) = list.next().await {
                match m {
                    Ok(m) => {
                        let k = self.store.relative_key(&m.location);
                        if k != own {
                            found = Some(k);
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot look for abort markers");
                        return Ok(());
                    }
                }
            }
        }
        let Some(key) = found else {
            return Ok(());
        };
        let marker = match self.store.inner().get(&self.store.path(&key)).await {
            Ok(r) => r
                .bytes()
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<AbortMarker>(&b).ok()),
            Err(_) => None,
        }
        .unwrap_or_else(|| AbortMarker {
            zarrckpt_abort: 1,
            rank: None,
            key: self.store.url().url_of(&key),
            status: None,
            error: "an abort marker that cannot be read".into(),
        });
        *lock(&self.seen) = Some(marker.clone());
        Err(self.abandoned(marker))
    }

    /// Puts this writer's marker (once; best effort: a failure is logged) after its upload of
    /// `key` (a URL) failed for good with `error`. Errors that are themselves
    /// [`RemoteError::Abandoned`] raise nothing.
    pub async fn raise(&self, key: &str, error: &str) {
        if self.raised.swap(true, Ordering::SeqCst) {
            return;
        }
        let marker = AbortMarker {
            zarrckpt_abort: 1,
            rank: self.rank,
            key: key.to_owned(),
            status: http_status(error),
            error: error.to_owned(),
        };
        let body = Bytes::from(serde_json::to_vec(&marker).expect("a marker serialises"));
        let own = self.marker_key();
        match self
            .store
            .put_resolved(&self.store.path(&own), body, PutMode::Overwrite)
            .await
        {
            Ok(_) => tracing::warn!(
                rank = ?self.rank,
                generation = %self.generation,
                key,
                "save: an upload failed for good; abort marker put, the other ranks stop"
            ),
            Err(e) => tracing::warn!(
                marker = %self.store.url().url_of(&own),
                error = %e,
                "save: cannot put the abort marker; the other ranks learn of the failure at the agreement"
            ),
        }
    }

    /// [`AbortWatch::check`] from synchronous code (not inside the store's runtime).
    ///
    /// # Errors
    /// As [`AbortWatch::check`].
    pub fn check_blocking(&self) -> Result<(), RemoteError> {
        if let Some(m) = lock(&self.seen).clone() {
            return Err(self.abandoned(m));
        }
        if lock(&self.next).is_some_and(|n| Instant::now() < n) {
            return Ok(());
        }
        self.store.block_on(self.check())
    }

    /// [`AbortWatch::raise`] from synchronous code.
    pub fn raise_blocking(&self, key: &str, error: &str) {
        if !self.raised.load(Ordering::SeqCst) {
            self.store.block_on(self.raise(key, error));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::remote::RemoteOptions;

    #[test]
    fn a_marker_stops_the_other_writers_at_their_next_look_and_names_rank_key_status() {
        let opts = RemoteOptions {
            abort_check_interval: Duration::from_millis(50),
            ..RemoteOptions::builtin()
        };
        let s = RemoteStore::open("memory://abort/ckpt", &opts).unwrap();
        let failed = AbortWatch::new(&s, "g1", Some(3));
        let other = AbortWatch::new(&s, "g1", Some(0));
        let elsewhere = AbortWatch::new(&s, "g2", Some(0));
        other.check_blocking().unwrap();
        failed.raise_blocking(
            "memory://abort/ckpt/generations/g1/tensors/w/c/0",
            "Generic S3 error: Error after 3 retries: Server returned non-2xx status code: 503 Service Unavailable: SlowDown",
        );
        assert_eq!(s.list("generations/g1/abort").unwrap().len(), 1);
        // Its own marker does not stop the failed writer; another generation is unaffected.
        failed.check_blocking().unwrap();
        elsewhere.check_blocking().unwrap();
        // Within the interval the last look stands; after it the marker is seen.
        std::thread::sleep(Duration::from_millis(60));
        let e = other.check_blocking().unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(
                &e,
                RemoteError::Abandoned {
                    rank: Some(3),
                    status: Some(503),
                    ..
                }
            ),
            "{text}"
        );
        assert!(text.contains("rank 3"), "{text}");
        assert!(text.contains("generations/g1/tensors/w/c/0"), "{text}");
        assert!(text.contains("503"), "{text}");
        // Sticky: every later look fails without a request.
        assert!(other.check_blocking().is_err());
        assert_eq!(http_status("no status here"), None);
    }
}
