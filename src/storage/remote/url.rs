//! Checkpoint URLs (`s3://bucket/prefix`, `gs://`, `az://`, `memory://`) and the stores built
//! from them, their options and the usual environment variables.

use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;

use super::error::RemoteError;

/// True when `s` names an object store (`s3://`, `gs://`, `az://`, `abfs://`, `memory://`)
/// rather than a local path.
#[must_use]
pub fn is_url(s: &str) -> bool {
    Scheme::of(s).is_some()
}

/// The kinds of object store a URL can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Scheme {
    /// `s3://bucket/prefix` (AWS S3 and compatible servers; feature `s3`).
    S3,
    /// `gs://bucket/prefix` (Google Cloud Storage; feature `gcs`).
    Gcs,
    /// `az://container/prefix` or `abfs://` (Azure Blob Storage; feature `azure`).
    Azure,
    /// `memory://name/prefix`: an in-process store shared by every URL with the same name
    /// (tests, and a fast stand-in for S3).
    Memory,
}

impl Scheme {
    /// The scheme of `url`, or `None` for a local path.
    #[must_use]
    pub fn of(url: &str) -> Option<Self> {
        let (scheme, _) = url.split_once("://")?;
        Some(match scheme {
            "s3" | "s3a" => Self::S3,
            "gs" => Self::Gcs,
            "az" | "abfs" | "abfss" | "azure" => Self::Azure,
            "memory" => Self::Memory,
            _ => return None,
        })
    }
}

/// How a store is reached and how hard the client tries.
///
/// [`RemoteOptions::default`] is the built-in defaults below, each overridden by its
/// environment variable when that is set (explicit fields set by the caller win over both):
///
/// | field | default | environment variable |
/// |---|---|---|
/// | `multipart_threshold` | 64 MiB | `ZARRCKPT_REMOTE_MULTIPART_THRESHOLD` (bytes) |
/// | `part_size` | 16 MiB | `ZARRCKPT_REMOTE_PART_SIZE` (bytes) |
/// | `parts_in_flight` | 4 | `ZARRCKPT_REMOTE_PARTS_IN_FLIGHT` |
/// | `concurrency` | 8 | `ZARRCKPT_REMOTE_CONCURRENCY` |
/// | `max_retries` | 10 | `ZARRCKPT_REMOTE_MAX_RETRIES` |
/// | `init_backoff` | 100 ms | `ZARRCKPT_REMOTE_BACKOFF_INIT` (seconds) |
/// | `max_backoff` | 10 s | `ZARRCKPT_REMOTE_BACKOFF_MAX` (seconds) |
/// | `request_timeout` | 120 s | `ZARRCKPT_REMOTE_REQUEST_TIMEOUT` (seconds) |
/// | `retry_timeout` | 300 s | `ZARRCKPT_REMOTE_RETRY_TIMEOUT` (seconds) |
/// | `abort_check_interval` | 1 s | `ZARRCKPT_REMOTE_ABORT_CHECK` (seconds) |
///
/// A malformed variable is ignored by `default()` and reported by [`build_store`] (opening a
/// store), naming the variable.
#[derive(Clone, Debug)]
pub struct RemoteOptions {
    /// Builder options (`object_store` config keys such as `aws_endpoint`, `aws_region`,
    /// `aws_allow_http`, `google_service_account`, `azure_storage_account_name`), applied over
    /// the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
    pub config: Vec<(String, String)>,
    /// Commit on a server that ignores `If-None-Match` / `If-Match` (uniqueness then rests on
    /// the random generation id alone, and two concurrent writers may both believe they
    /// committed). Off by default: such a server is refused by the probe.
    pub allow_unconditional: bool,
    /// Objects at least this large are uploaded as multipart uploads.
    pub multipart_threshold: u64,
    /// The part size of a multipart upload (S3: 5 MiB to 5 GiB).
    pub part_size: usize,
    /// Parts of one multipart upload in flight at once (memory: this x `part_size`).
    pub parts_in_flight: usize,
    /// Objects uploaded or fetched at once per rank.
    pub concurrency: usize,
    /// Retries per request on 5xx (`SlowDown` is a 503), 429, 408, connection errors and
    /// dropped connections, and on 409 (a conditional write in flight elsewhere), with
    /// exponential backoff and decorrelated jitter (`object_store`'s `RetryConfig`, plus the
    /// client's own retries of conditional puts, see [`super::client`]).
    pub max_retries: usize,
    /// The first backoff; each next one is drawn between it and 2x the previous one, capped
    /// at `max_backoff`.
    pub init_backoff: Duration,
    /// The longest backoff between two tries.
    pub max_backoff: Duration,
    /// The deadline of one try of one request (connect, send, answer, body).
    pub request_timeout: Duration,
    /// The deadline of one request including its retries: after it no retry starts, and the
    /// error names the key and the last HTTP status.
    pub retry_timeout: Duration,
    /// How often, at most, a writer looks for another rank's abort marker (spec "Object-store
    /// profile of the commit": a rank whose upload failed for good puts
    /// `generations/<id>/abort/<rank>`, and the others stop at their next look). One LIST of
    /// that folder per look and rank.
    pub abort_check_interval: Duration,
}

/// The environment variables [`RemoteOptions::default`] reads, with the field each sets.
pub const OPTION_VARIABLES: [&str; 10] = [
    "ZARRCKPT_REMOTE_MULTIPART_THRESHOLD",
    "ZARRCKPT_REMOTE_PART_SIZE",
    "ZARRCKPT_REMOTE_PARTS_IN_FLIGHT",
    "ZARRCKPT_REMOTE_CONCURRENCY",
    "ZARRCKPT_REMOTE_MAX_RETRIES",
    "ZARRCKPT_REMOTE_BACKOFF_INIT",
    "ZARRCKPT_REMOTE_BACKOFF_MAX",
    "ZARRCKPT_REMOTE_REQUEST_TIMEOUT",
    "ZARRCKPT_REMOTE_RETRY_TIMEOUT",
    "ZARRCKPT_REMOTE_ABORT_CHECK",
];

impl RemoteOptions {
    /// The built-in defaults, without the environment.
    #[must_use]
    pub fn builtin() -> Self {
        Self {
            config: Vec::new(),
            allow_unconditional: false,
            multipart_threshold: 64 << 20,
            part_size: 16 << 20,
            parts_in_flight: 4,
            concurrency: 8,
            max_retries: 10,
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            request_timeout: Duration::from_secs(120),
            retry_timeout: Duration::from_secs(300),
            abort_check_interval: Duration::from_secs(1),
        }
    }

    /// `self` with every set variable of [`OPTION_VARIABLES`] applied, reading them through
    /// `var`.
    ///
    /// # Errors
    /// The name of the first variable that does not parse (a non-negative integer, or for the
    /// durations a non-negative number of seconds) and its value.
    pub fn with_env_from(
        mut self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, (String, String)> {
        for name in OPTION_VARIABLES {
            let Some(v) = var(name) else { continue };
            let bad = || (name.to_string(), v.clone());
            let int = || v.trim().parse::<usize>().map_err(|_| bad());
            let secs = || {
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                    .ok_or_else(bad)
            };
            match name {
                "ZARRCKPT_REMOTE_MULTIPART_THRESHOLD" => {
                    self.multipart_threshold = u64::try_from(int()?).map_err(|_| bad())?;
                }
                "ZARRCKPT_REMOTE_PART_SIZE" => self.part_size = int()?,
                "ZARRCKPT_REMOTE_PARTS_IN_FLIGHT" => self.parts_in_flight = int()?,
                "ZARRCKPT_REMOTE_CONCURRENCY" => self.concurrency = int()?,
                "ZARRCKPT_REMOTE_MAX_RETRIES" => self.max_retries = int()?,
                "ZARRCKPT_REMOTE_BACKOFF_INIT" => self.init_backoff = secs()?,
                "ZARRCKPT_REMOTE_BACKOFF_MAX" => self.max_backoff = secs()?,
                "ZARRCKPT_REMOTE_REQUEST_TIMEOUT" => self.request_timeout = secs()?,
                "ZARRCKPT_REMOTE_ABORT_CHECK" => self.abort_check_interval = secs()?,
                _ => self.retry_timeout = secs()?,
            }
        }
        Ok(self)
    }

    /// `object_store`'s retry policy for these options.
    #[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
    #[must_use]
    pub fn retry_config(&self) -> object_store::RetryConfig {
        object_store::RetryConfig {
            backoff: object_store::BackoffConfig {
                init_backoff: self.init_backoff,
                max_backoff: self.max_backoff.max(self.init_backoff),
                base: 2.0,
            },
            max_retries: self.max_retries,
            retry_timeout: self.retry_timeout,
        }
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl Default for RemoteOptions {
    /// [`RemoteOptions::builtin`] with the environment applied (a malformed variable is left
    /// to [`build_store`] to report).
    fn default() -> Self {
        let builtin = Self::builtin();
        builtin.clone().with_env_from(env_var).unwrap_or(builtin)
    }
}

/// A parsed checkpoint URL: the store's root (`s3://bucket`) and the checkpoint's prefix in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteUrl {
    /// The kind of store.
    pub scheme: Scheme,
    /// `scheme://bucket`.
    pub root: String,
    /// The checkpoint's prefix inside the bucket (no leading or trailing `/`; may be empty).
    pub prefix: String,
}

impl RemoteUrl {
    /// Parses `scheme://bucket[/prefix]`.
    ///
    /// # Errors
    /// [`RemoteError::Url`] for a local path, an unknown scheme, no bucket, or a prefix that is
    /// not a valid object path (empty segments, `.` or `..`).
    pub fn parse(url: &str) -> Result<Self, RemoteError> {
        let bad = |reason: &str| RemoteError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let scheme = Scheme::of(url)
            .ok_or_else(|| bad("not an object-store URL (s3://, gs://, az://, memory://)"))?;
        let (s, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
        let rest = rest.trim_end_matches('/');
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad("no bucket (expected scheme://bucket/prefix)"));
        }
        if prefix
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
            && !prefix.is_empty()
        {
            return Err(bad("the prefix has an empty, `.` or `..` segment"));
        }
        ObjPath::parse(prefix).map_err(|e| bad(&format!("invalid prefix: {e}")))?;
        Ok(Self {
            scheme,
            root: format!("{s}://{bucket}"),
            prefix: prefix.to_string(),
        })
    }

    /// The URL of `key` under the checkpoint's prefix, for messages.
    #[must_use]
    pub fn url_of(&self, key: &str) -> String {
        match (self.prefix.is_empty(), key.is_empty()) {
            (true, true) => self.root.clone(),
            (true, false) => format!("{}/{key}", self.root),
            (false, true) => format!("{}/{}", self.root, self.prefix),
            (false, false) => format!("{}/{}/{key}", self.root, self.prefix),
        }
    }

    /// The checkpoint URL (`root/prefix`).
    #[must_use]
    pub fn url(&self) -> String {
        self.url_of("")
    }
}

/// Builds the store for `url`: `(store, endpoint named in messages)`.
///
/// # Errors
/// [`RemoteError::Url`] when the backend is not compiled in; [`RemoteError::Configure`] when
/// the builder rejects the options or environment (missing region, credentials...).
pub fn build_store(
    url: &RemoteUrl,
    opts: &RemoteOptions,
) -> Result<(Arc<dyn ObjectStore>, String), RemoteError> {
    build_stores(url, opts).map(|b| (b.store, b.endpoint))
}

/// A store as [`build_stores`] builds it.
pub(crate) struct Built {
    pub store: Arc<dyn ObjectStore>,
    /// The same store's explicit multipart API (every backend here has one).
    pub multipart: Option<Arc<dyn MultipartStore>>,
    pub endpoint: String,
}

impl Built {
    #[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
    fn of<S: ObjectStore + MultipartStore>(store: S, endpoint: String) -> Self {
        let store = Arc::new(store);
        Self {
            store: Arc::clone(&store) as Arc<dyn ObjectStore>,
            multipart: Some(store as Arc<dyn MultipartStore>),
            endpoint,
        }
    }
}

/// [`build_store`], keeping the store's [`MultipartStore`] face too (the recorded multipart
/// uploads of [`super::multipart`]).
pub(crate) fn build_stores(url: &RemoteUrl, opts: &RemoteOptions) -> Result<Built, RemoteError> {
    match url.scheme {
        Scheme::Memory => {
            let (store, parts) = super::memory::memory_store(&url.root);
            Ok(Built {
                store: store as Arc<dyn ObjectStore>,
                multipart: Some(parts as Arc<dyn MultipartStore>),
                endpoint: url.root.clone(),
            })
        }
        Scheme::S3 => check_env(url).and_then(|()| build_s3(url, opts)),
        Scheme::Gcs => check_env(url).and_then(|()| build_gcs(url, opts)),
        Scheme::Azure => check_env(url).and_then(|()| build_azure(url, opts)),
    }
}

#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
fn configure_err(url: &RemoteUrl) -> impl Fn(object_store::Error) -> RemoteError + '_ {
    move |source| RemoteError::Configure {
        url: url.url(),
        source,
    }
}

/// What the three cloud builders share: `from_env`, the URL, the per-try timeout, the
/// caller's config keys and the retry policy.
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
trait CloudBuilder: Sized {
    type Key: std::str::FromStr<Err = object_store::Error>;
    fn from_env() -> Self;
    fn with_url(self, url: String) -> Self;
    fn with_config(self, key: Self::Key, value: String) -> Self;
    fn with_retry(self, retry: object_store::RetryConfig) -> Self;
}

#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
macro_rules! cloud_builder {
    ($builder:ty, $key:ty) => {
        impl CloudBuilder for $builder {
            type Key = $key;
            fn from_env() -> Self {
                <$builder>::from_env()
            }
            fn with_url(self, url: String) -> Self {
                <$builder>::with_url(self, url)
            }
            fn with_config(self, key: $key, value: String) -> Self {
                <$builder>::with_config(self, key, value)
            }
            fn with_retry(self, retry: object_store::RetryConfig) -> Self {
                <$builder>::with_retry(self, retry)
            }
        }
    };
}

#[cfg(feature = "s3")]
cloud_builder!(
    object_store::aws::AmazonS3Builder,
    object_store::aws::AmazonS3ConfigKey
);
#[cfg(feature = "gcs")]
cloud_builder!(
    object_store::gcp::GoogleCloudStorageBuilder,
    object_store::gcp::GoogleConfigKey
);
#[cfg(feature = "azure")]
cloud_builder!(
    object_store::azure::MicrosoftAzureBuilder,
    object_store::azure::AzureConfigKey
);

/// A builder from the environment, configured for `url` with `opts`; `adjust` runs after
/// `from_env` and before the caller's keys (the S3 endpoint fallback).
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
fn configured<B: CloudBuilder>(
    url: &RemoteUrl,
    opts: &RemoteOptions,
    adjust: impl FnOnce(B) -> B,
) -> Result<B, RemoteError> {
    let key = |k: &str| k.parse::<B::Key>().map_err(configure_err(url));
    let mut b = adjust(B::from_env().with_url(url.root.clone()));
    let timeout = format!("{}ms", opts.request_timeout.as_millis());
    b = b.with_config(key("timeout")?, timeout);
    for (k, v) in &opts.config {
        b = b.with_config(key(k)?, v.clone());
    }
    Ok(b.with_retry(opts.retry_config()))
}

/// Reports a malformed `ZARRCKPT_REMOTE_*` variable (which `default()` ignored).
fn check_env(url: &RemoteUrl) -> Result<(), RemoteError> {
    RemoteOptions::builtin()
        .with_env_from(env_var)
        .map(drop)
        .map_err(|(name, value)| RemoteError::Url {
            url: url.url(),
            reason: format!(
                "environment variable {name}={value:?} is not a non-negative number (bytes, a count, or seconds)"
            ),
        })
}

#[cfg(feature = "s3")]
fn build_s3(url: &RemoteUrl, opts: &RemoteOptions) -> Result<Built, RemoteError> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, S3ConditionalPut};
    let b = configured(url, opts, |b: AmazonS3Builder| {
        // `AWS_ENDPOINT_URL` (the AWS CLI's and SDKs' name) when `AWS_ENDPOINT` is not set.
        match std::env::var("AWS_ENDPOINT_URL") {
            Ok(e) if b.get_config_value(&AmazonS3ConfigKey::Endpoint).is_none() => {
                b.with_endpoint(e)
            }
            _ => b,
        }
    })?;
    let endpoint = b
        .get_config_value(&AmazonS3ConfigKey::Endpoint)
        .unwrap_or_else(|| url.root.clone());
    let store = b
        .with_conditional_put(S3ConditionalPut::ETagMatch)
        .build()
        .map_err(configure_err(url))?;
    Ok(Built::of(store, endpoint))
}

#[cfg(feature = "gcs")]
fn build_gcs(url: &RemoteUrl, opts: &RemoteOptions) -> Result<Built, RemoteError> {
    let b = configured(
        url,
        opts,
        |b: object_store::gcp::GoogleCloudStorageBuilder| b,
    )?;
    let store = b.build().map_err(configure_err(url))?;
    Ok(Built::of(store, url.root.clone()))
}

#[cfg(feature = "azure")]
fn build_azure(url: &RemoteUrl, opts: &RemoteOptions) -> Result<Built, RemoteError> {
    let b = configured(url, opts, |b: object_store::azure::MicrosoftAzureBuilder| b)?;
    let store = b.build().map_err(configure_err(url))?;
    Ok(Built::of(store, url.root.clone()))
}

#[cfg(not(feature = "s3"))]
fn build_s3(url: &RemoteUrl, _: &RemoteOptions) -> Result<Built, RemoteError> {
    Err(not_built(url, "s3"))
}

#[cfg(not(feature = "gcs"))]
fn build_gcs(url: &RemoteUrl, _: &RemoteOptions) -> Result<Built, RemoteError> {
    Err(not_built(url, "gcs"))
}

#[cfg(not(feature = "azure"))]
fn build_azure(url: &RemoteUrl, _: &RemoteOptions) -> Result<Built, RemoteError> {
    Err(not_built(url, "azure"))
}

#[cfg(not(all(feature = "s3", feature = "gcs", feature = "azure")))]
fn not_built(url: &RemoteUrl, feature: &str) -> RemoteError {
    RemoteError::Url {
        url: url.url(),
        reason: format!(
            "this build of zarrckpt has no `{feature}` backend (cargo feature `{feature}`)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let u = RemoteUrl::parse("s3://bucket/a/b/").unwrap();
        assert_eq!(
            (u.scheme, u.root.as_str(), u.prefix.as_str()),
            (Scheme::S3, "s3://bucket", "a/b")
        );
        assert_eq!(u.url_of("x"), "s3://bucket/a/b/x");
        let u = RemoteUrl::parse("memory://m").unwrap();
        assert_eq!((u.prefix.as_str(), u.url()), ("", "memory://m".to_string()));
        assert!(RemoteUrl::parse("/tmp/x").is_err());
        assert!(RemoteUrl::parse("s3:///x").is_err());
        assert!(RemoteUrl::parse("s3://b/a//c").is_err());
        assert!(RemoteUrl::parse("s3://b/a/../c").is_err());
        assert!(!is_url("/tmp/x") && is_url("gs://b/x"));
    }

    #[test]
    fn options_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_string())
            }
        };
        let o = RemoteOptions::builtin()
            .with_env_from(env(&[
                ("ZARRCKPT_REMOTE_MAX_RETRIES", "3"),
                ("ZARRCKPT_REMOTE_RETRY_TIMEOUT", "2.5"),
                ("ZARRCKPT_REMOTE_BACKOFF_INIT", "0.01"),
                ("ZARRCKPT_REMOTE_PART_SIZE", "5242880"),
            ]))
            .unwrap();
        assert_eq!(o.max_retries, 3);
        assert_eq!(o.retry_timeout, Duration::from_millis(2500));
        assert_eq!(o.init_backoff, Duration::from_millis(10));
        assert_eq!(o.part_size, 5 << 20);
        assert_eq!(o.request_timeout, RemoteOptions::builtin().request_timeout);
        let bad = RemoteOptions::builtin()
            .with_env_from(env(&[("ZARRCKPT_REMOTE_REQUEST_TIMEOUT", "-1")]))
            .unwrap_err();
        assert_eq!(bad.0, "ZARRCKPT_REMOTE_REQUEST_TIMEOUT");
        assert!(
            RemoteOptions::builtin()
                .with_env_from(env(&[("ZARRCKPT_REMOTE_CONCURRENCY", "many")]))
                .is_err()
        );
    }
}
