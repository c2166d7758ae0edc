//! The commit protocol (spec § "Commit"): the root `zarr.json` carrying the index is written
//! last, atomically, after every rank's files are durable. Its absence marks a checkpoint as
//! incomplete.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::error::StorageError;
use super::fsio::{create_dir_durable, fsync_dir, replace_durable, write_durable};
use super::meta::{CheckpointMeta, TENSORS_GROUP, tensor_path};
use crate::model::TensorKey;

/// The root metadata file, the commit marker.
pub const ROOT_JSON: &str = "zarr.json";

const GROUP_JSON: &[u8] = br#"{"zarr_format":3,"node_type":"group","attributes":{}}"#;

/// True when the root `zarr.json` of `dir` is a group carrying the `zarrckpt` attribute.
fn has_checkpoint_root(dir: &Path) -> bool {
    let Ok(bytes) = fs::read(dir.join(ROOT_JSON)) else {
        return false;
    };
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return false;
    };
    doc.get("node_type").and_then(|v| v.as_str()) == Some("group")
        && doc
            .get("attributes")
            .and_then(|a| a.get(super::meta::ATTRIBUTE))
            .is_some()
}

/// True when `dir` holds a zarrckpt checkpoint, complete or not, and nothing else: a root
/// `zarr.json` carrying the `zarrckpt` attribute, or no root `zarr.json` but a `tensors/`
/// directory; and no top-level entries but `zarr.json`, `tensors` and leftover temporary
/// files of the commit. Only such a directory is ever deleted by an overwrite.
fn looks_like_checkpoint(dir: &Path) -> bool {
    let root = dir.join(ROOT_JSON);
    let shaped = if root.exists() {
        has_checkpoint_root(dir)
    } else {
        dir.join(TENSORS_GROUP).is_dir()
    };
    if !shaped {
        return false;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().all(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name == ROOT_JSON
            || name == TENSORS_GROUP
            || name == super::object::OBJECTS_GROUP
            || name.starts_with(".zarr.json.tmp-")
    })
}

/// Prepares `dir` for a new save (run by one rank before any other writes): creates it, or,
/// when `overwrite` is set and it holds an earlier checkpoint, first removes the commit marker
/// (so a crash from here on leaves an incomplete checkpoint, never a mix passing as complete)
/// and then the rest.
///
/// # Errors
/// [`StorageError::AlreadyExists`] when `dir` is not empty and `overwrite` is not set, or when
/// it is not empty and does not look like a checkpoint (never deleted); I/O errors otherwise.
pub fn prepare(dir: &Path, overwrite: bool) -> Result<(), StorageError> {
    if dir.exists() {
        let mut entries = fs::read_dir(dir).map_err(StorageError::io("list", dir))?;
        if entries.next().is_some() {
            if !overwrite || !looks_like_checkpoint(dir) {
                return Err(StorageError::AlreadyExists {
                    path: dir.to_owned(),
                });
            }
            let marker = dir.join(ROOT_JSON);
            if marker.exists() {
                fs::remove_file(&marker).map_err(StorageError::io("remove", &marker))?;
                fsync_dir(dir)?;
            }
            for entry in fs::read_dir(dir).map_err(StorageError::io("list", dir))? {
                let p = entry.map_err(StorageError::io("list", dir))?.path();
                let r = if p.is_dir() {
                    fs::remove_dir_all(&p)
                } else {
                    fs::remove_file(&p)
                };
                r.map_err(StorageError::io("remove", &p))?;
            }
            fsync_dir(dir)?;
        }
        Ok(())
    } else {
        create_dir_durable(dir)
    }
}

/// Writes the `zarr.json` of the `tensors` group and of every intermediate group implied by
/// hierarchical keys (Zarr v3 has no implicit groups).
///
/// # Errors
/// I/O errors naming the path.
pub fn write_groups<'a>(
    dir: &Path,
    keys: impl IntoIterator<Item = &'a TensorKey>,
) -> Result<(), StorageError> {
    let mut groups: BTreeSet<PathBuf> = BTreeSet::new();
    groups.insert(PathBuf::from(TENSORS_GROUP));
    for key in keys {
        let path = PathBuf::from(tensor_path(key));
        let mut p = path.parent();
        while let Some(g) = p {
            if g.as_os_str().is_empty() {
                break;
            }
            groups.insert(g.to_owned());
            p = g.parent();
        }
    }
    for g in &groups {
        let d = dir.join(g);
        create_dir_durable(&d)?;
        write_durable(&d.join("zarr.json"), &[GROUP_JSON])?;
    }
    for g in &groups {
        fsync_dir(&dir.join(g))?;
    }
    Ok(())
}

/// Commits: atomically writes the root `zarr.json` with the index.
///
/// # Errors
/// I/O errors naming the path.
pub fn commit(dir: &Path, meta: &CheckpointMeta) -> Result<(), StorageError> {
    replace_durable(&dir.join(ROOT_JSON), &meta.to_root_json())
}

/// Reads and validates the index of a committed checkpoint.
///
/// # Errors
/// [`StorageError::Incomplete`] when the directory holds a save that never committed,
/// [`StorageError::NotACheckpoint`] when it holds no checkpoint at all, and the errors of
/// [`CheckpointMeta::from_root_json`].
pub fn read_index(dir: &Path) -> Result<CheckpointMeta, StorageError> {
    let path = dir.join(ROOT_JSON);
    match fs::read(&path) {
        Ok(bytes) => CheckpointMeta::from_root_json(&bytes, &path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !dir.exists() {
                Err(StorageError::NotACheckpoint {
                    path: dir.to_owned(),
                    reason: "no such directory".into(),
                })
            } else if dir.join(TENSORS_GROUP).is_dir() {
                Err(StorageError::Incomplete {
                    path: dir.to_owned(),
                })
            } else {
                Err(StorageError::NotACheckpoint {
                    path: dir.to_owned(),
                    reason: "no root zarr.json".into(),
                })
            }
        }
        Err(e) => Err(StorageError::io("read", &path)(e)),
    }
}
