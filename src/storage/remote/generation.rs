//! The object-store profile of the commit (spec "Object-store profile of the commit"): every
//! save writes a fresh generation `generations/<id>/` and never reuses a key or deletes during
//! the save; the manifest (every object's key, size and crc32c) and then the generation's root
//! `zarr.json` are written with put-if-absent once every object is durable; the pointer
//! `zarrckpt.pointer.json` is then moved to the new generation with put-if-match on the ETag
//! it had when the save began (put-if-absent for the first commit). Readers resolve the
//! pointer and trust only the manifest (no listing on load). Old generations are removed only
//! by [`gc`], after the pointer moved.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::client::{Condition, PutOutcome, RemoteStore};
use super::error::RemoteError;

/// The pointer object, directly under the checkpoint's prefix.
pub const POINTER: &str = "zarrckpt.pointer.json";
pub use super::GENERATIONS;
/// The manifest, in a generation's folder.
pub const MANIFEST: &str = "zarrckpt.manifest.json";
/// The root document of a generation (the checkpoint's index), written last.
pub const ROOT: &str = "zarr.json";

/// Where a generation's tails objects are (spec 20.7), relative to its folder.
pub const TAILS: &str = "tails";

/// The pointer's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pointer {
    /// Format version of the pointer (1).
    pub zarrckpt_pointer: u32,
    /// The committed generation's id.
    pub generation: String,
}

/// The pointer as read, with the ETag a move is conditioned on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PointerState {
    /// Its content.
    pub pointer: Pointer,
    /// Its ETag.
    pub etag: Option<String>,
}

/// One object of a generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Its key relative to the generation's folder (`tensors/w/c/0/0`).
    pub key: String,
    /// Its size in bytes.
    pub size: u64,
    /// The crc32c of its bytes.
    pub crc32c: u32,
    /// For a shard object: where a copy of its tail (footer and index) is (spec 20.7).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail: Option<TailCopy>,
}

/// Where a copy of a shard's tail is: the tails object (a key of the same generation, listed
/// in the manifest) and the offset of the copy in it; the copy is as long as the shard's
/// tail (its array's index and footer bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TailCopy {
    /// The tails object's key, relative to the generation's folder (`tails/0`).
    pub key: String,
    /// Where the copy starts in it.
    pub offset: u64,
}

/// The manifest: every object of a generation but the manifest itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version of the manifest (1).
    pub zarrckpt_manifest: u32,
    /// The generation's id.
    pub generation: String,
    /// The objects, sorted by key; the root `zarr.json` among them.
    pub objects: Vec<ManifestEntry>,
}

/// A fresh generation id: milliseconds since the epoch (13 digits, so ids sort by time) and 64
/// random bits.
#[must_use]
pub fn new_generation() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let id = crate::storage::footer::SaveId::random().hex();
    format!("{ms:013}-{}", &id[..16])
}

/// True for a well-formed generation id (no `/`, no dots: safe as one path segment).
#[must_use]
pub fn valid_generation(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

use super::base::error_chain;
pub use super::base::generation_key;

/// Reads the pointer (`None`: no checkpoint committed here).
///
/// # Errors
/// [`RemoteError::Request`]; [`RemoteError::Corrupt`] for a pointer that does not parse or
/// names a malformed generation.
pub fn read_pointer(store: &RemoteStore) -> Result<Option<PointerState>, RemoteError> {
    let Some((bytes, etag)) = store.get(POINTER)? else {
        return Ok(None);
    };
    let corrupt = |detail: String| RemoteError::Corrupt {
        key: store.url().url_of(POINTER),
        detail,
    };
    let pointer: Pointer = serde_json::from_slice(&bytes)
        .map_err(|e| corrupt(format!("not a zarrckpt pointer: {e}")))?;
    if pointer.zarrckpt_pointer != 1 || !valid_generation(&pointer.generation) {
        return Err(corrupt(format!(
            "pointer version {} naming generation {:?}: not understood",
            pointer.zarrckpt_pointer, pointer.generation
        )));
    }
    Ok(Some(PointerState { pointer, etag }))
}

/// The files of a local checkpoint directory, relative, sorted, that a generation holds: all
/// but the commit's local leftovers (the nonce, temporary root files).
///
/// # Errors
/// [`RemoteError::Io`].
pub fn local_files(dir: &Path) -> Result<Vec<String>, RemoteError> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), RemoteError> {
        for e in std::fs::read_dir(dir).map_err(|e| RemoteError::io(dir, e))? {
            let e = e.map_err(|e| RemoteError::io(dir, e))?;
            let path = e.path();
            let ty = e.file_type().map_err(|e| RemoteError::io(&path, e))?;
            if ty.is_dir() {
                walk(root, &path, out)?;
            } else if ty.is_file() {
                let rel = path
                    .strip_prefix(root)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .into_owned();
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.starts_with(".zarrckpt-nonce") || name.starts_with(".zarr.json.tmp-") {
                    continue;
                }
                out.push(rel);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

/// Uploads `files` (relative to `dir`) into generation `generation`, at most
/// `concurrency` at once; returns their manifest entries. See [`upload_files_as`].
///
/// # Errors
/// As [`upload_files_as`].
pub fn upload_files(
    store: &RemoteStore,
    generation: &str,
    dir: &Path,
    files: &[String],
) -> Result<Vec<ManifestEntry>, RemoteError> {
    upload_files_as(store, generation, None, dir, files)
}

/// Uploads `files` (relative to `dir`) into generation `generation` as rank `rank` of a save,
/// at most `concurrency` at once; returns their manifest entries. Multipart uploads are
/// recorded while open ([`super::multipart`]). An upload that fails for good puts this rank's
/// abort marker, and another rank's marker (looked for before each object and between parts,
/// at most once per `abort_check_interval`) stops this rank early ([`super::abort`]).
/// Progress (bytes done of the total) is logged at most every
/// [`super::base::PROGRESS_EVERY`].
///
/// # Errors
/// The first failed upload's error (the others are dropped: their multipart uploads stay
/// recorded for `gc`; nothing is deleted); [`RemoteError::Abandoned`] when another rank
/// failed first.
pub fn upload_files_as(
    store: &RemoteStore,
    generation: &str,
    rank: Option<usize>,
    dir: &Path,
    files: &[String],
) -> Result<Vec<ManifestEntry>, RemoteError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let n = store.options().concurrency.max(1);
    let watch = super::abort::AbortWatch::new(store, generation, rank);
    let total: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| m.len())
        .sum();
    let done = AtomicU64::new(0);
    let last = std::sync::Mutex::new(std::time::Instant::now());
    let (watch, done, last) = (&watch, &done, &last);
    store.block_on(async {
        let mut tasks = futures::stream::iter(files.iter().map(|rel| async move {
            let key = generation_key(generation, rel);
            let r = store
                .upload_file_watched(&key, &dir.join(rel), Some(watch), rank)
                .await;
            match &r {
                Err(e @ RemoteError::Abandoned { .. }) => {
                    tracing::debug!(error = %e, "upload stopped early");
                }
                Err(e) => {
                    watch
                        .raise(&store.url().url_of(&key), &error_chain(e))
                        .await
                }
                Ok((size, _)) => {
                    let sofar = done.fetch_add(*size, Ordering::Relaxed) + size;
                    let mut l = last
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if l.elapsed() >= super::base::PROGRESS_EVERY {
                        *l = std::time::Instant::now();
                        tracing::info!(
                            rank = ?rank,
                            generation,
                            bytes = sofar,
                            total,
                            "save: upload progress (bytes durable of this rank's total)"
                        );
                    }
                }
            }
            let (size, crc32c) = r?;
            Ok::<_, RemoteError>(ManifestEntry {
                key: rel.clone(),
                size,
                crc32c,
                tail: None,
            })
        }))
        .buffer_unordered(n);
        let mut out = Vec::with_capacity(files.len());
        while let Some(r) = tasks.next().await {
            out.push(r?);
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    })
}

/// Commits generation `generation`, whose objects (all but the root) are durable and listed
/// in `entries`: writes the manifest and the root `zarr.json` (`root`, the index) with
/// put-if-absent, then moves the pointer from `previous` (the state read when the save began;
/// `None`: the first commit) with put-if-match (put-if-absent).
///
/// # Errors
/// [`RemoteError::Conflict`] when another save moved the pointer first (or wrote the first
/// one); [`RemoteError::Corrupt`] when the manifest or root key exists already (a generation
/// id reused); [`RemoteError::Request`], [`RemoteError::Io`].
pub fn commit_generation(
    store: &RemoteStore,
    generation: &str,
    mut entries: Vec<ManifestEntry>,
    root: Vec<u8>,
    previous: Option<&PointerState>,
) -> Result<(), RemoteError> {
    entries.push(ManifestEntry {
        key: ROOT.to_string(),
        size: root.len() as u64,
        crc32c: crc32c::crc32c(&root),
        tail: None,
    });
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    let manifest = Manifest {
        zarrckpt_manifest: 1,
        generation: generation.to_string(),
        objects: entries,
    };
    let bytes = serde_json::to_vec(&manifest).expect("a manifest serialises");
    put_new(
        store,
        &generation_key(generation, MANIFEST),
        Bytes::from(bytes),
    )?;
    put_new(store, &generation_key(generation, ROOT), Bytes::from(root))?;
    let pointer = Pointer {
        zarrckpt_pointer: 1,
        generation: generation.to_string(),
    };
    let data = Bytes::from(serde_json::to_vec(&pointer).expect("a pointer serialises"));
    let cond = match previous {
        None => Condition::Absent,
        Some(p) if store.options().allow_unconditional => {
            let _ = p;
            Condition::None
        }
        Some(PointerState { etag: Some(e), .. }) => Condition::Matches(e.clone()),
        Some(PointerState { etag: None, .. }) => {
            return Err(RemoteError::Corrupt {
                key: store.url().url_of(POINTER),
                detail: "the store reported no ETag for the pointer, so it cannot be moved conditionally".into(),
            });
        }
    };
    match store.put(POINTER, data, &cond)? {
        PutOutcome::Written(_) => Ok(()),
        PutOutcome::Exists | PutOutcome::Changed => Err(RemoteError::Conflict {
            url: store.url().url(),
            generation: generation.to_string(),
        }),
    }
}

fn put_new(store: &RemoteStore, key: &str, data: Bytes) -> Result<(), RemoteError> {
    let cond = if store.options().allow_unconditional {
        Condition::None
    } else {
        Condition::Absent
    };
    match store.put(key, data, &cond)? {
        PutOutcome::Written(_) => Ok(()),
        _ => Err(RemoteError::Corrupt {
            key: store.url().url_of(key),
            detail: "the object exists already: a generation id was reused".into(),
        }),
    }
}

/// A resolved checkpoint: the committed generation and its manifest.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The committed generation's id.
    pub generation: String,
    /// Its manifest.
    pub manifest: Manifest,
}

impl Resolved {
    /// The generation's folder URL (what tensorstore or zarr-python open directly).
    #[must_use]
    pub fn generation_url(&self, store: &RemoteStore) -> String {
        store.url().url_of(&generation_key(&self.generation, ""))
    }

    /// The total size of the generation's objects.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.manifest.objects.iter().map(|e| e.size).sum()
    }
}

/// Resolves the pointer and reads the committed generation's manifest (no listing).
///
/// # Errors
/// [`RemoteError::NotFound`] without a pointer; [`RemoteError::Corrupt`] for a manifest that
/// is missing, does not parse, names another generation, or has unsafe keys.
pub fn resolve(store: &RemoteStore) -> Result<Resolved, RemoteError> {
    resolve_with_bytes(store).map(|(r, _)| r)
}

/// As [`resolve`], with the manifest's bytes as fetched (what a rank that resolved for the
/// others sends them: [`parse_manifest`] reads them back).
///
/// # Errors
/// As [`resolve`].
pub(crate) fn resolve_with_bytes(store: &RemoteStore) -> Result<(Resolved, Vec<u8>), RemoteError> {
    let Some(p) = read_pointer(store)? else {
        return Err(RemoteError::NotFound {
            url: store.url().url(),
            pointer: store.url().url_of(POINTER),
        });
    };
    let generation = p.pointer.generation;
    let key = generation_key(&generation, MANIFEST);
    let Some((bytes, _)) = store.get(&key)? else {
        return Err(RemoteError::Corrupt {
            key: store.url().url_of(&key),
            detail: "the pointer names a generation without a manifest".into(),
        });
    };
    let manifest = parse_manifest(store, &generation, &bytes)?;
    Ok((
        Resolved {
            generation,
            manifest,
        },
        Vec::from(bytes),
    ))
}

/// The manifest of `generation` in `bytes`, checked: version 1, of that generation, every key
/// safe, a root document listed.
///
/// # Errors
/// [`RemoteError::Corrupt`] naming the manifest's URL otherwise.
pub(crate) fn parse_manifest(
    store: &RemoteStore,
    generation: &str,
    bytes: &[u8],
) -> Result<Manifest, RemoteError> {
    let corrupt = |detail: String| RemoteError::Corrupt {
        key: store.url().url_of(&generation_key(generation, MANIFEST)),
        detail,
    };
    let manifest: Manifest = serde_json::from_slice(bytes)
        .map_err(|e| corrupt(format!("not a zarrckpt manifest: {e}")))?;
    if manifest.zarrckpt_manifest != 1 || manifest.generation != generation {
        return Err(corrupt(format!(
            "manifest version {} of generation {:?}, expected version 1 of {generation:?}",
            manifest.zarrckpt_manifest, manifest.generation
        )));
    }
    for e in &manifest.objects {
        if e.key.is_empty()
            || e.key.starts_with('/')
            || e.key
                .split('/')
                .any(|s| s.is_empty() || s == "." || s == "..")
        {
            return Err(corrupt(format!("unsafe object key {:?}", e.key)));
        }
    }
    if !manifest.objects.iter().any(|e| e.key == ROOT) {
        return Err(corrupt("the manifest lists no root zarr.json".into()));
    }
    Ok(manifest)
}

/// Downloads every object of a resolved generation but its tails objects (spec 20.7) into
/// `dest` (created; must not exist), checking each against its manifest size and crc32c, at
/// most `concurrency` at once. The
/// objects go into a temporary sibling first, renamed to `dest` once all arrived, so `dest`
/// never holds part of a generation.
///
/// # Errors
/// [`RemoteError::Request`], [`RemoteError::Corrupt`] naming the object, [`RemoteError::Io`].
pub fn download(store: &RemoteStore, resolved: &Resolved, dest: &Path) -> Result<(), RemoteError> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| RemoteError::io(parent, e))?;
    let tmp = parent.join(format!(
        ".{}.fetch-{}",
        dest.file_name()
            .map_or_else(|| "generation".into(), |n| n.to_string_lossy().into_owned()),
        crate::storage::footer::SaveId::random().hex()
    ));
    let result = download_into(store, resolved, &tmp)
        .and_then(|()| std::fs::rename(&tmp, dest).map_err(|e| RemoteError::io(dest, e)));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn download_into(store: &RemoteStore, resolved: &Resolved, tmp: &Path) -> Result<(), RemoteError> {
    std::fs::create_dir_all(tmp).map_err(|e| RemoteError::io(tmp, e))?;
    // The tails objects (spec 20.7) are the object-store profile's reading aid, no part of
    // the checkpoint: a local copy goes without them.
    let tails = format!("{TAILS}/");
    let objects: Vec<&ManifestEntry> = resolved
        .manifest
        .objects
        .iter()
        .filter(|e| !e.key.starts_with(&tails))
        .collect();
    let mut dirs: Vec<PathBuf> = objects
        .iter()
        .filter_map(|e| tmp.join(&e.key).parent().map(Path::to_path_buf))
        .collect();
    dirs.sort();
    dirs.dedup();
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| RemoteError::io(d, e))?;
    }
    let n = store.options().concurrency.max(1);
    let generation = &resolved.generation;
    store.block_on(async {
        let mut tasks = futures::stream::iter(objects.iter().map(|e| async move {
            store
                .download_file(
                    &generation_key(generation, &e.key),
                    &tmp.join(&e.key),
                    e.size,
                    e.crc32c,
                )
                .await
        }))
        .buffer_unordered(n);
        while let Some(r) = tasks.next().await {
            r?;
        }
        Ok(())
    })
}

/// What [`gc`] removed (or would remove).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// The committed generation (kept).
    pub current: Option<String>,
    /// Generations kept besides the current one.
    pub kept: Vec<String>,
    /// Generations removed.
    pub removed: Vec<String>,
    /// Objects deleted.
    pub objects: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Recorded multipart uploads aborted (left open by killed or failed writers; an upload
    /// that had completed counts too, its abort being a no-op).
    pub uploads_aborted: usize,
}

/// What [`gc_with`] removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcOptions {
    /// Committed generations to keep, the current one included (at least 1).
    pub keep: usize,
    /// Only report; delete and abort nothing.
    pub dry_run: bool,
    /// A generation newer than the committed one (or any, when nothing is committed) whose
    /// id is at least this old is taken for abandoned (its writer killed) and removed, its
    /// recorded uploads aborted. `None`: such generations are left alone unless an abort
    /// marker says their save failed. Only safe when no save of the checkpoint can have
    /// started longer ago than this and still be running.
    pub abandoned_after: Option<std::time::Duration>,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            keep: 1,
            dry_run: false,
            abandoned_after: None,
        }
    }
}

/// [`gc_with`] with `keep` and `dry_run`, leaving generations newer than the committed one
/// alone unless their save failed (an abort marker).
///
/// # Errors
/// As [`gc_with`].
pub fn gc(store: &RemoteStore, keep: usize, dry_run: bool) -> Result<GcReport, RemoteError> {
    gc_with(
        store,
        &GcOptions {
            keep,
            dry_run,
            abandoned_after: None,
        },
    )
}

/// The age of a generation from its id's timestamp (`None` for an id without one).
fn age_of(generation: &str) -> Option<std::time::Duration> {
    let ms: u64 = generation.get(..13)?.parse().ok()?;
    let born = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    Some(
        std::time::SystemTime::now()
            .duration_since(born)
            .unwrap_or_default(),
    )
}

/// Removes old and dead generations and aborts the multipart uploads they left open:
/// - every generation whose id sorts before the committed one (older saves, saves that lost a
///   race or crashed), except the `keep - 1` newest of them that were committed (have a root
///   `zarr.json`);
/// - generations newer than the committed one (or any, when nothing is committed) whose save
///   failed (an abort marker `abort/<rank>`), or, with `abandoned_after`, whose id is at
///   least that old. Others newer than the committed one (a save in progress) are left alone.
///
/// Before a generation's objects are deleted, every multipart upload recorded under its
/// `uploads/` is aborted (spec: upload records); the kept generations' stray records (of
/// completed uploads whose record delete failed) are aborted and deleted too. Leftover probe
/// keys are removed. With `dry_run` nothing is deleted or aborted.
///
/// An upload a writer started but had not recorded yet when it was killed (one request's
/// window) is invisible here: give the bucket a lifecycle rule that aborts incomplete
/// multipart uploads after a day (S3 `AbortIncompleteMultipartUpload`) as a backstop.
///
/// # Errors
/// [`RemoteError::Request`]; [`RemoteError::Corrupt`] for a malformed pointer.
pub fn gc_with(store: &RemoteStore, o: &GcOptions) -> Result<GcReport, RemoteError> {
    let current = read_pointer(store)?.map(|p| p.pointer.generation);
    let objects = store.list(GENERATIONS)?;
    let mut by_gen: std::collections::BTreeMap<String, Vec<(String, u64)>> = Default::default();
    for (key, size) in objects {
        let Some(rest) = key.strip_prefix(&format!("{GENERATIONS}/")) else {
            continue;
        };
        let Some((g, rel)) = rest.split_once('/') else {
            continue;
        };
        by_gen
            .entry(g.to_string())
            .or_default()
            .push((rel.to_string(), size));
    }
    let mut report = GcReport {
        current: current.clone(),
        ..GcReport::default()
    };
    let has = |objs: &[(String, u64)], folder: &str| {
        objs.iter()
            .any(|(rel, _)| rel.strip_prefix(folder).is_some_and(|r| r.starts_with('/')))
    };
    let mut committed_kept = 0usize;
    for (g, objs) in by_gen.iter().rev() {
        let older = current.as_deref().is_some_and(|c| g.as_str() < c);
        let remove = if current.as_deref() == Some(g.as_str()) {
            false
        } else if older {
            let committed = objs.iter().any(|(rel, _)| rel == ROOT);
            if committed && committed_kept + 1 < o.keep {
                committed_kept += 1;
                report.kept.push(g.clone());
                false
            } else {
                true
            }
        } else {
            has(objs, super::abort::ABORT)
                || o.abandoned_after
                    .zip(age_of(g))
                    .is_some_and(|(limit, age)| age >= limit)
        };
        let in_progress = !older && current.as_deref() != Some(g.as_str()) && !remove;
        if in_progress {
            continue;
        }
        report.uploads_aborted += abort_recorded_uploads(store, g, objs, o.dry_run)?;
        if !remove {
            continue;
        }
        for (rel, size) in objs {
            if !o.dry_run {
                store.delete(&generation_key(g, rel))?;
            }
            report.objects += 1;
            report.bytes += size;
        }
        report.removed.push(g.clone());
    }
    for key in store.list_level()?.1 {
        if key.starts_with(super::PROBE_PREFIX) && !o.dry_run {
            store.delete(&key)?;
        }
    }
    report.kept.sort();
    report.removed.sort();
    Ok(report)
}

/// Aborts every upload recorded under generation `g` (`objs`: its objects) and deletes the
/// records; returns how many were recorded.
fn abort_recorded_uploads(
    store: &RemoteStore,
    g: &str,
    objs: &[(String, u64)],
    dry_run: bool,
) -> Result<usize, RemoteError> {
    use super::multipart::{UPLOADS, UploadRecord, abort_recorded};
    let mut n = 0;
    for (rel, _) in objs {
        if !rel
            .strip_prefix(UPLOADS)
            .is_some_and(|r| r.starts_with('/'))
        {
            continue;
        }
        n += 1;
        if dry_run {
            continue;
        }
        let key = generation_key(g, rel);
        let Some((bytes, _)) = store.get(&key)? else {
            continue;
        };
        match serde_json::from_slice::<UploadRecord>(&bytes) {
            Ok(record) => {
                if !store.block_on(abort_recorded(store, g, &record))? {
                    tracing::warn!(
                        record = %store.url().url_of(&key),
                        "this store has no multipart API here: the upload is left to the bucket's lifecycle rule"
                    );
                }
            }
            Err(e) => tracing::warn!(
                record = %store.url().url_of(&key),
                error = %e,
                "an upload record that does not parse: deleted, its upload left to the lifecycle rule"
            ),
        }
        store.delete(&key)?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::remote::RemoteOptions;

    #[test]
    fn staged_uploads_put_a_marker_when_they_fail_and_stop_on_another_ranks_marker() {
        let s = RemoteStore::open("memory://staged-abort/ckpt", &RemoteOptions::builtin()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), b"hello").unwrap();
        let g = "0000000000001-x";
        // Rank 2's upload fails (its file is gone): it puts its marker, naming it.
        let e = upload_files_as(&s, g, Some(2), dir.path(), &["missing".into()]).unwrap_err();
        assert!(matches!(e, RemoteError::Io { .. }), "{e}");
        let (marker, _) = s
            .get(&generation_key(g, "abort/2"))
            .unwrap()
            .expect("rank 2's abort marker");
        let m: crate::storage::remote::AbortMarker = serde_json::from_slice(&marker).unwrap();
        assert_eq!(m.rank, Some(2));
        assert!(
            m.key.ends_with(&format!("generations/{g}/missing")),
            "{m:?}"
        );
        // Rank 0 finds it before its first object and uploads nothing.
        let e = upload_files_as(&s, g, Some(0), dir.path(), &["a".into()]).unwrap_err();
        assert_eq!(e.failed_rank(), Some(2), "{e}");
        assert!(s.head(&generation_key(g, "a")).unwrap().is_none());
        // gc takes the failed save's generation for dead, whatever its age.
        let r = gc(&s, 1, false).unwrap();
        assert_eq!(r.removed, vec![g.to_string()]);
        assert!(s.list(GENERATIONS).unwrap().is_empty());
    }

    #[test]
    fn gc_aborts_the_uploads_recorded_in_an_abandoned_generation_and_leaves_a_live_one() {
        use crate::storage::remote::multipart::{RecordedUpload, UploadRecord};
        let s = RemoteStore::open("memory://gc-records/ckpt", &RemoteOptions::builtin()).unwrap();
        let g = "0000000000003-c";
        let mut up = s
            .block_on(RecordedUpload::begin(
                &s,
                &generation_key(g, "a/c/0"),
                Some(1),
            ))
            .unwrap()
            .unwrap();
        s.block_on(up.write(&vec![7u8; 6 << 20])).unwrap();
        drop(up); // its writer "killed": the upload stays open, recorded
        let records = s.list(&generation_key(g, "uploads")).unwrap();
        assert_eq!(records.len(), 1);
        let rec: UploadRecord =
            serde_json::from_slice(&s.get(&records[0].0).unwrap().unwrap().0).unwrap();
        // A plain gc leaves a newer generation alone (it may be a live save).
        let r = gc(&s, 1, false).unwrap();
        assert_eq!((r.uploads_aborted, r.removed.len()), (0, 0));
        let r = gc_with(
            &s,
            &GcOptions {
                abandoned_after: Some(std::time::Duration::ZERO),
                ..GcOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            (r.uploads_aborted, r.removed.clone()),
            (1, vec![g.to_string()])
        );
        assert!(s.list(GENERATIONS).unwrap().is_empty());
        // The upload is gone from the store: completing it now fails.
        let mp = std::sync::Arc::clone(s.multipart_store().unwrap());
        let path = s.path(&generation_key(g, &rec.key));
        assert!(
            s.block_on(mp.complete_multipart(&path, &rec.upload_id, Vec::new()))
                .is_err()
        );
    }
}
