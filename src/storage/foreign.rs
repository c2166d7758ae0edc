//! Reading plain Zarr v3 arrays written by other tools (tensorstore, zarr-python, zarrs):
//! any chunk grid and codecs zarrs supports, for the data types of [`DType`].

use std::path::Path;
use std::sync::Arc;

use zarrs::array::{Array, ArrayBytesFixedDisjointView, ArraySubset, CodecOptions};
use zarrs::filesystem::FilesystemStore;

use super::error::StorageError;
use crate::model::DType;
use crate::model::region::num_bytes;

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
    let array = Array::open(store, "/").map_err(StorageError::zarr(&key, dir.join("zarr.json")))?;
    let name = array.data_type().name_v3().map(|n| n.into_owned()).unwrap_or_default();
    let dtype = DType::from_name(&name).ok_or_else(|| StorageError::Malformed {
        path: dir.join("zarr.json"),
        reason: format!("data type `{name}` is not supported"),
    })?;
    let shape = array.shape().to_vec();
    let len = num_bytes(&shape, dtype.size())
        .map_err(|e| StorageError::Malformed { path: dir.join("zarr.json"), reason: e.to_string() })?;
    let mut data = vec![0u8; len];
    let subset = ArraySubset::new_with_shape(shape.clone());
    {
        let cells = unsafe_cell_slice::UnsafeCellSlice::new(&mut data);
        // SAFETY: one view over the whole buffer, used by this call only.
        let mut view = unsafe { ArrayBytesFixedDisjointView::new(cells, dtype.size(), &shape, subset.clone()) }
            .map_err(StorageError::zarr(&key, dir))?;
        array
            .retrieve_array_subset_into_opt(&subset, (&mut view).into(), &CodecOptions::default())
            .map_err(StorageError::zarr(&key, dir))?;
    }
    Ok(ForeignArray { dtype, shape, data })
}
