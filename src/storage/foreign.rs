//! Reading plain Zarr v3 arrays written by other tools (tensorstore, zarr-python, zarrs):
//! any chunk grid and codecs zarrs supports, for the data types of [`DType`].

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use zarrs::array::{Array, ArrayBytesFixedDisjointView, ArrayMetadata, ArraySubset, CodecOptions};
use zarrs::filesystem::FilesystemStore;

use super::error::StorageError;
use crate::model::DType;
use crate::model::region::num_bytes;

/// Most bytes of one chunk of a foreign array larger than the array itself.
pub const MAX_FOREIGN_CHUNK_BYTES: u64 = 1 << 30;

/// A whole array read from a Zarr v3 array directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignArray {
    /// Data type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Elements in C order, little endian.
    pub data: Vec<u8>,
}

/// Reads the whole Zarr v3 array stored in directory `dir` (the one holding its
/// `zarr.json`), whatever tool wrote it. Missing chunks read as the fill value, as Zarr
/// specifies.
///
/// # Errors
/// [`StorageError::Malformed`] for an unsupported data type; [`StorageError::Zarr`] when
/// zarrs cannot open or decode the array.
pub fn read_array(dir: &Path) -> Result<ForeignArray, StorageError> {
    let key = dir.display().to_string();
    let store = Arc::new(FilesystemStore::new(dir).map_err(StorageError::zarr(&key, dir))?);
    let json_path = dir.join("zarr.json");
    let malformed = |reason: String| StorageError::Malformed {
        path: json_path.clone(),
        reason,
    };
    let bytes = super::meta::read_metadata_file(&json_path, super::meta::MAX_ARRAY_JSON_BYTES)?;
    let mut meta: Value =
        serde_json::from_slice(&bytes).map_err(|e| malformed(format!("not JSON: {e}")))?;
    float8_fill_as_hex(&mut meta);
    let parsed: ArrayMetadata =
        serde_json::from_value(meta).map_err(|e| malformed(e.to_string()))?;
    let array = Array::new_with_metadata(store, "/", parsed)
        .map_err(StorageError::zarr(&key, &json_path))?;
    let name = array
        .data_type()
        .name_v3()
        .map(|n| n.into_owned())
        // A type with no v3 name is no known name: refused just below.
        .unwrap_or_default();
    let dtype = DType::from_name(&name).ok_or_else(|| StorageError::Malformed {
        path: dir.join("zarr.json"),
        reason: format!("data type `{name}` is not supported"),
    })?;
    let shape = array.shape().to_vec();
    let len = num_bytes(&shape, dtype.size()).map_err(|e| StorageError::Malformed {
        path: dir.join("zarr.json"),
        reason: e.to_string(),
    })?;
    // zarrs decodes a whole chunk at a time: a chunk far larger than the array (a crafted
    // chunk grid) is refused rather than allocated.
    if let Ok(chunk) = array.chunk_shape(&vec![0; shape.len()]) {
        let chunk_bytes = chunk
            .iter()
            .try_fold(dtype.size() as u64, |acc, c| acc.checked_mul(c.get()));
        if chunk_bytes.is_none_or(|b| b > MAX_FOREIGN_CHUNK_BYTES.max(len as u64)) {
            return Err(StorageError::Malformed {
                path: dir.join("zarr.json"),
                reason: format!(
                    "a chunk of {chunk:?} elements is larger than both the array and {MAX_FOREIGN_CHUNK_BYTES} bytes"
                ),
            });
        }
    }
    if len == 0 {
        // zarrs rejects a subset of an array with a zero-size dimension; there is nothing to read.
        return Ok(ForeignArray {
            dtype,
            shape,
            data: Vec::new(),
        });
    }
    let mut data: Vec<u8> = super::read::zeroed_buffer(len as u64, &key, &json_path)?;
    let subset = ArraySubset::new_with_shape(shape.clone());
    {
        let cells = unsafe_cell_slice::UnsafeCellSlice::new(&mut data);
        // SAFETY: one view over the whole buffer, used by this call only.
        let mut view = unsafe {
            ArrayBytesFixedDisjointView::new(cells, dtype.size(), &shape, subset.clone())
        }
        .map_err(StorageError::zarr(&key, dir))?;
        array
            .retrieve_array_subset_into_opt(&subset, (&mut view).into(), &CodecOptions::default())
            .map_err(StorageError::zarr(&key, dir))?;
    }
    Ok(ForeignArray { dtype, shape, data })
}

/// Rewrites a float8 `fill_value` given as a number or `"NaN"` / `"Infinity"` /
/// `"-Infinity"` (how tensorstore writes it) as the equivalent raw-bits hex string, which is
/// the only form zarrs (without its `microfloat` feature) parses for `float8_e5m2`.
fn float8_fill_as_hex(meta: &mut Value) {
    let dtype = meta
        .get("data_type")
        .and_then(Value::as_str)
        .and_then(DType::from_name);
    let (Some(dtype), Some(fill)) = (dtype, meta.get("fill_value")) else {
        return;
    };
    if let Some(bits) = crate::model::dtype::float8_bits(dtype, fill) {
        meta["fill_value"] = Value::from(format!("0x{bits:02x}"));
    }
}
