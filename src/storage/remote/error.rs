//! The object-store layer's error: every variant names the URL or key and the cause.

/// An object-store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The URL cannot be used (unknown scheme, missing bucket, a backend not compiled in).
    #[error("{url}: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The store could not be configured from the URL, options and environment.
    #[error("{url}: cannot configure the object store: {source}")]
    Configure {
        /// The URL.
        url: String,
        /// The cause.
        #[source]
        source: object_store::Error,
    },
    /// A request failed (after the retries the client makes on 5xx, `SlowDown` and timeouts).
    #[error("{op} {key}: {source}")]
    Request {
        /// What was attempted: `PUT`, `GET`, `HEAD`, `LIST`, `DELETE`, `multipart PUT`.
        op: &'static str,
        /// The full URL of the object (or prefix).
        key: String,
        /// The cause, with the HTTP status where the server answered.
        #[source]
        source: object_store::Error,
    },
    /// The server does not honour conditional writes, and the generation commit needs them.
    #[error(
        "{endpoint}: the server does not honour {what}; zarrckpt refuses to commit checkpoints there \
         (two writers could both think they committed). Use a server that honours If-None-Match and \
         If-Match (AWS S3, GCS, Azure, MinIO, SeaweedFS), or pass allow_unconditional / \
         --allow-unconditional-writes to rely on the generation id alone"
    )]
    Unconditional {
        /// The endpoint (or URL) probed.
        endpoint: String,
        /// Which precondition was ignored.
        what: &'static str,
    },
    /// Another save moved the pointer first: this save's generation was not committed.
    #[error(
        "{url}: another save committed this checkpoint concurrently (the pointer changed while \
         generation {generation} was written); this save was not committed and its generation is \
         left for `zarrckpt gc`"
    )]
    Conflict {
        /// The checkpoint URL.
        url: String,
        /// This save's (uncommitted) generation.
        generation: String,
    },
    /// A checkpoint exists at the URL and the save did not ask to overwrite it.
    #[error(
        "{url}: a checkpoint already exists (generation {generation}); pass overwrite to replace it"
    )]
    Exists {
        /// The checkpoint URL.
        url: String,
        /// Its committed generation.
        generation: String,
    },
    /// No committed checkpoint at the URL (no pointer object).
    #[error("{url}: no checkpoint here (no pointer object `{pointer}`)")]
    NotFound {
        /// The checkpoint URL.
        url: String,
        /// The pointer key looked for.
        pointer: String,
    },
    /// A pointer, manifest or object does not match what the commit recorded.
    #[error("{key}: {detail}")]
    Corrupt {
        /// The object's full URL.
        key: String,
        /// What does not match.
        detail: String,
    },
    /// A local file (staging or cache) could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The local path.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Another rank's upload into this generation failed for good (its abort marker was
    /// found): this rank stopped before finishing its own uploads.
    #[error(
        "generation {generation} abandoned: rank {} failed for good on {key} (HTTP status {}): {error}; \
         this rank stopped its own uploads early",
        rank.map_or_else(|| "?".to_string(), |r| r.to_string()),
        status.map_or_else(|| "unknown".to_string(), |s| s.to_string())
    )]
    Abandoned {
        /// The generation being written.
        generation: String,
        /// The failed rank (when its writer knew it).
        rank: Option<usize>,
        /// The URL of the object whose upload failed.
        key: String,
        /// Its last HTTP status, when the server answered.
        status: Option<u16>,
        /// Its error, as text.
        error: String,
    },
    /// A rank failed during a collective object-store operation.
    #[error("rank {rank}: {message}")]
    Rank {
        /// The failing rank.
        rank: usize,
        /// Its error, as text.
        message: String,
    },
}

impl RemoteError {
    /// The rank another rank's abort marker names, for [`RemoteError::Abandoned`] (`None`
    /// for every other error, and for a marker of a writer that did not know its rank).
    #[must_use]
    pub fn failed_rank(&self) -> Option<usize> {
        match self {
            Self::Abandoned { rank, .. } => *rank,
            _ => None,
        }
    }

    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
