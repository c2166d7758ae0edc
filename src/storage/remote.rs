//! Object stores (feature `object-store`): S3, GCS, Azure and in-memory stores through the
//! `object_store` crate, and the object-store profile of the commit (spec section
//! "Object-store profile of the commit"): a fresh generation per save, its manifest and root
//! written with put-if-absent once every object is durable, and a pointer moved with
//! put-if-match. Readers resolve the pointer and trust only the manifest.

pub mod abort;
pub mod base;
pub mod client;
pub mod error;
pub mod generation;
mod memory;
pub mod multipart;
pub mod probe;
pub mod prune;
pub mod store;
pub mod upload;
pub mod url;
pub mod writer;

pub use abort::{ABORT, AbortMarker, AbortWatch};
pub use client::{Condition, PutOutcome, RemoteStore};
pub use error::RemoteError;
pub use generation::{
    GcOptions, GcReport, Manifest, ManifestEntry, Pointer, PointerState, Resolved, gc, gc_with,
    resolve,
};
pub use multipart::{UPLOADS, UploadRecord};
pub use probe::{ProbeResult, probe, require_conditional_writes};
pub use url::{RemoteOptions, RemoteUrl, Scheme, is_url};
pub use writer::GenerationWriter;

/// The folder of the generations, under the checkpoint's prefix.
pub const GENERATIONS: &str = "generations";

/// The probe's key, under the checkpoint's prefix (removed after the probe).
pub const PROBE_PREFIX: &str = ".zarrckpt-probe-";
