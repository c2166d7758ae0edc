//! Knowing the server: a save probes once (per endpoint and process) that put-if-absent and
//! put-if-match are honoured, since the generation commit rests on them.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;

use super::client::{Condition, PutOutcome, RemoteStore};
use super::error::RemoteError;

/// What the probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeResult {
    /// A second put-if-absent of the same key was refused.
    pub if_none_match: bool,
    /// A put-if-match with a wrong ETag was refused and one with the right ETag accepted.
    pub if_match: bool,
}

impl ProbeResult {
    /// Both preconditions honoured.
    #[must_use]
    pub fn ok(self) -> bool {
        self.if_none_match && self.if_match
    }
}

pub use super::PROBE_PREFIX;

/// Probes the server behind `store`: creates a fresh key twice with put-if-absent (the second
/// must be refused), overwrites it with a wrong ETag (refused) and the right one (accepted),
/// then deletes it.
///
/// # Errors
/// [`RemoteError::Request`] when a probe request fails outright (no permission, no bucket).
pub fn probe(store: &RemoteStore) -> Result<ProbeResult, RemoteError> {
    let key = format!(
        "{PROBE_PREFIX}{}",
        crate::storage::footer::SaveId::random().hex()
    );
    let first = store.put(&key, Bytes::from_static(b"1"), &Condition::Absent)?;
    let result = (|| {
        let PutOutcome::Written(etag) = first else {
            // A fresh random key exists already: treat as unconditional (cannot tell).
            return Ok(ProbeResult {
                if_none_match: false,
                if_match: false,
            });
        };
        let again = store.put(&key, Bytes::from_static(b"2"), &Condition::Absent)?;
        let if_none_match = again == PutOutcome::Exists;
        // The ETag now on the server (the second put may have replaced it).
        let current = match store.get(&key)? {
            Some((_, Some(e))) => e,
            _ => etag.unwrap_or_default(),
        };
        let wrong = store.put(
            &key,
            Bytes::from_static(b"3"),
            &Condition::Matches("\"zarrckpt-wrong-etag\"".into()),
        )?;
        let right = store.put(&key, Bytes::from_static(b"4"), &Condition::Matches(current))?;
        let if_match = wrong == PutOutcome::Changed && matches!(right, PutOutcome::Written(_));
        Ok(ProbeResult {
            if_none_match,
            if_match,
        })
    })();
    let _ = store.delete(&key);
    result
}

/// Probes once per endpoint and process and refuses a server that ignores a precondition,
/// unless the store's options allow unconditional writes.
///
/// # Errors
/// [`RemoteError::Unconditional`] naming the endpoint; errors of [`probe`].
pub fn require_conditional_writes(store: &RemoteStore) -> Result<(), RemoteError> {
    static PASSED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let seen = PASSED.get_or_init(Default::default);
    let id = format!("{} {}", store.endpoint(), store.url().root);
    if seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .contains(&id)
    {
        return Ok(());
    }
    let r = probe(store)?;
    if !r.ok() {
        if store.options().allow_unconditional {
            tracing::warn!(
                endpoint = store.endpoint(),
                "the server ignores conditional writes; committing on the generation id alone (allow_unconditional)"
            );
            return Ok(());
        }
        return Err(RemoteError::Unconditional {
            endpoint: store.endpoint().to_string(),
            what: match (r.if_none_match, r.if_match) {
                (false, false) => "If-None-Match (put-if-absent) nor If-Match (put-if-match)",
                (false, true) => "If-None-Match (put-if-absent)",
                _ => "If-Match (put-if-match)",
            },
        });
    }
    seen.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(id);
    Ok(())
}
