//! Zarr group documents: Zarr v3 has no implicit groups, so every directory above an array
//! gets a `zarr.json` naming it a group.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::error::StorageError;
use super::store::{LocalStore, Store};

/// The document of a group with no attributes.
pub const GROUP_JSON: &[u8] = br#"{"zarr_format":3,"node_type":"group","attributes":{}}"#;

/// Adds every group above `path` (its proper `/`-separated prefixes) to `groups`.
pub(crate) fn insert_parents(groups: &mut BTreeSet<String>, path: &str) {
    let mut p = path;
    while let Some((g, _)) = p.rsplit_once('/') {
        groups.insert(g.to_owned());
        p = g;
    }
}

/// The members of a Zarr array document that a zarrckpt reader compares with what the index
/// entry implies (attributes are checked on their own).
pub(crate) const ARRAY_DOC_MEMBERS: [&str; 8] = [
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
];

/// Writes the group document of each of `groups` (paths relative to `dir`), creating the
/// directories, and makes them durable.
///
/// # Errors
/// I/O errors naming the path.
pub fn write_group_documents(dir: &Path, groups: &BTreeSet<PathBuf>) -> Result<(), StorageError> {
    let locations: Vec<String> = groups
        .iter()
        .map(|g| g.to_string_lossy().into_owned())
        .collect();
    write_group_documents_to(&LocalStore::new(dir), &locations)
}

/// [`write_group_documents`] into `store` (holding the checkpoint at its root), the groups
/// given as prefixes.
///
/// # Errors
/// I/O errors naming the object.
pub fn write_group_documents_to(store: &dyn Store, groups: &[String]) -> Result<(), StorageError> {
    for g in groups {
        store.create_prefix(g)?;
        let loc = super::store::join(g, "zarr.json");
        let mut w = store.put_multipart(&loc)?;
        w.write(GROUP_JSON)?;
        w.finish()?;
        store.sync(&loc)?;
    }
    for g in groups {
        store.sync_prefix(g)?;
    }
    Ok(())
}
