//! Metadata documents as files: the `zarrckpt` attribute's name and the size-capped, strict
//! reading of a `zarr.json` (spec section 4.1). Below [`super::meta`] and
//! [`super::object`], which both read documents.

use std::path::Path;

use super::error::StorageError;

/// The attribute holding the checkpoint's metadata in the root group.
pub const ATTRIBUTE: &str = "zarrckpt";

/// Most bytes of an array's `zarr.json` a reader accepts (zarrckpt's own or a foreign one).
pub const MAX_ARRAY_JSON_BYTES: u64 = 16 << 20;

/// Reads a metadata file of at most `max` bytes, without allocating more than that whatever
/// the file's size (a huge or sparse file is refused after reading `max + 1` bytes).
///
/// # Errors
/// [`StorageError::Io`] when it cannot be read (the I/O error's kind is kept, so a caller can
/// tell a missing file), [`StorageError::Malformed`] when it is larger than `max`.
pub fn read_metadata_file(path: &Path, max: u64) -> Result<Vec<u8>, StorageError> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(StorageError::io("read", path))?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(StorageError::io("read", path))?;
    if bytes.len() as u64 > max {
        return Err(StorageError::Malformed {
            path: path.to_owned(),
            reason: format!("the file is larger than the {max} bytes a reader accepts"),
        });
    }
    Ok(bytes)
}

/// Parses a metadata document (a root or array `zarr.json`) as spec section 4.1 requires:
/// RFC 8259 JSON text (so no `NaN`, `Infinity`, comments or trailing commas) encoded as UTF-8
/// without a byte-order mark, in which no object has two members of the same name (names
/// compared after unescaping), no number is beyond a binary64 and arrays and objects nest at
/// most [`crate::model::json::MAX_JSON_DEPTH`] levels ([`crate::model::json::parse_strict`]).
///
/// # Errors
/// A description of the first violation.
pub fn parse_json(bytes: &[u8]) -> Result<serde_json::Value, String> {
    crate::model::json::parse_strict(bytes)
}
