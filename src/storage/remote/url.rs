//! Checkpoint URLs (`s3://bucket/prefix`, `gs://`, `az://`, `memory://`) and the stores built
//! from them, their options and the usual environment variables.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::ObjectStore;
use object_store::memory::InMemory;
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
    /// Retries per request on 5xx, `SlowDown` (503), 429, 408 and, for conditional puts, 409,
    /// with exponential backoff and jitter.
    pub max_retries: usize,
    /// The longest one request may take (each try).
    pub request_timeout: Duration,
    /// The longest one request may take including its retries.
    pub retry_timeout: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self {
            config: Vec::new(),
            allow_unconditional: false,
            multipart_threshold: 64 << 20,
            part_size: 16 << 20,
            parts_in_flight: 4,
            concurrency: 8,
            max_retries: 10,
            request_timeout: Duration::from_secs(120),
            retry_timeout: Duration::from_secs(300),
        }
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

/// The in-process stores behind `memory://name`, one per name.
fn memory_store(name: &str) -> Arc<InMemory> {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    let mut stores = STORES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Arc::clone(
        stores
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(InMemory::new())),
    )
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
    match url.scheme {
        Scheme::Memory => Ok((
            memory_store(&url.root) as Arc<dyn ObjectStore>,
            url.root.clone(),
        )),
        Scheme::S3 => build_s3(url, opts),
        Scheme::Gcs => build_gcs(url, opts),
        Scheme::Azure => build_azure(url, opts),
    }
}

#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
fn retry(opts: &RemoteOptions) -> object_store::RetryConfig {
    object_store::RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            base: 2.0,
        },
        max_retries: opts.max_retries,
        retry_timeout: opts.retry_timeout,
    }
}

#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
fn configure_err(url: &RemoteUrl) -> impl Fn(object_store::Error) -> RemoteError + '_ {
    move |source| RemoteError::Configure {
        url: url.url(),
        source,
    }
}

#[cfg(feature = "s3")]
fn build_s3(
    url: &RemoteUrl,
    opts: &RemoteOptions,
) -> Result<(Arc<dyn ObjectStore>, String), RemoteError> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, S3ConditionalPut};
    let mut b = AmazonS3Builder::from_env().with_url(url.root.clone());
    // `AWS_ENDPOINT_URL` (the AWS CLI's and SDKs' name) when `AWS_ENDPOINT` is not set.
    if b.get_config_value(&AmazonS3ConfigKey::Endpoint).is_none()
        && let Ok(e) = std::env::var("AWS_ENDPOINT_URL")
    {
        b = b.with_endpoint(e);
    }
    let timeout = format!("{}ms", opts.request_timeout.as_millis());
    b = b.with_config("timeout".parse().map_err(configure_err(url))?, timeout);
    for (k, v) in &opts.config {
        b = b.with_config(k.parse().map_err(configure_err(url))?, v.clone());
    }
    let endpoint = b
        .get_config_value(&AmazonS3ConfigKey::Endpoint)
        .unwrap_or_else(|| url.root.clone());
    let store = b
        .with_conditional_put(S3ConditionalPut::ETagMatch)
        .with_retry(retry(opts))
        .build()
        .map_err(configure_err(url))?;
    Ok((Arc::new(store), endpoint))
}

#[cfg(feature = "gcs")]
fn build_gcs(
    url: &RemoteUrl,
    opts: &RemoteOptions,
) -> Result<(Arc<dyn ObjectStore>, String), RemoteError> {
    use object_store::gcp::GoogleCloudStorageBuilder;
    let mut b = GoogleCloudStorageBuilder::from_env().with_url(url.root.clone());
    let timeout = format!("{}ms", opts.request_timeout.as_millis());
    b = b.with_config("timeout".parse().map_err(configure_err(url))?, timeout);
    for (k, v) in &opts.config {
        b = b.with_config(k.parse().map_err(configure_err(url))?, v.clone());
    }
    let store = b
        .with_retry(retry(opts))
        .build()
        .map_err(configure_err(url))?;
    Ok((Arc::new(store), url.root.clone()))
}

#[cfg(feature = "azure")]
fn build_azure(
    url: &RemoteUrl,
    opts: &RemoteOptions,
) -> Result<(Arc<dyn ObjectStore>, String), RemoteError> {
    use object_store::azure::MicrosoftAzureBuilder;
    let mut b = MicrosoftAzureBuilder::from_env().with_url(url.root.clone());
    let timeout = format!("{}ms", opts.request_timeout.as_millis());
    b = b.with_config("timeout".parse().map_err(configure_err(url))?, timeout);
    for (k, v) in &opts.config {
        b = b.with_config(k.parse().map_err(configure_err(url))?, v.clone());
    }
    let store = b
        .with_retry(retry(opts))
        .build()
        .map_err(configure_err(url))?;
    Ok((Arc::new(store), url.root.clone()))
}

#[cfg(not(feature = "s3"))]
fn build_s3(
    url: &RemoteUrl,
    _: &RemoteOptions,
) -> Result<(Arc<dyn ObjectStore>, String), RemoteError> {
    Err(not_built(url, "s3"))
}

#[cfg(not(feature = "gcs"))]
fn build_gcs(
    url: &RemoteUrl,
    _: &RemoteOptions,
) -> Result<(Arc<dyn ObjectStore>, String), RemoteError> {
    Err(not_built(url, "gcs"))
}

#[cfg(not(feature = "azure"))]
fn build_azure(
    url: &RemoteUrl,
    _: &RemoteOptions,
) -> Result<(Arc<dyn ObjectStore>, String), RemoteError> {
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
}
