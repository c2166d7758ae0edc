//! One tensor's Zarr array: its `zarr.json`, encoding a shard with zarrs, and decoding a
//! shard's index with zarrs. The only place that builds zarrs arrays and codec chains.

use std::borrow::Cow;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Value, json};
use zarrs::array::codec::{ShardingCodecOptions, SubchunkWriteOrder};
use zarrs::array::{
    Array, ArrayBytes, ArrayMetadata, ArrayToBytesCodecTraits, BytesRepresentation, CodecChain,
    CodecOptions, CodecSpecificOptions, data_type,
};
use zarrs::filesystem::FilesystemStore;
use zarrs::metadata::v3::MetadataV3;

use super::dtype::{to_zarrs, zero_fill};
use super::error::StorageError;
use super::footer::{SaveId, footer_len};
use super::meta::{ATTRIBUTE, Compression, TensorEntry};
use crate::model::{DType, TensorKey};

/// zstd level used when compression is asked for.
pub const ZSTD_LEVEL: i64 = 3;

fn bytes_codec() -> Value {
    json!({"name": "bytes", "configuration": {"endian": "little"}})
}

fn crc32c_codec() -> Value {
    json!({"name": "crc32c", "configuration": {}})
}

/// The inner codecs for a compression choice.
fn inner_codecs(compression: Compression, dtype: DType) -> Vec<Value> {
    let mut c = vec![bytes_codec()];
    match compression {
        Compression::None => {}
        Compression::Zstd => c.push(json!({"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": false}})),
        Compression::Blosc => c.push(json!({"name": "blosc", "configuration": {
            "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": dtype.size(), "blocksize": 0}})),
    }
    c.push(crc32c_codec());
    c
}

/// The zero fill value in the notation each data type's `fill_value` takes.
fn fill_value(dtype: DType) -> Value {
    match dtype {
        DType::Bool => json!(false),
        DType::Float16 | DType::BFloat16 | DType::Float32 | DType::Float64 => json!(0.0),
        DType::Float8E4M3FN | DType::Float8E5M2 => json!("0x00"),
        _ => json!(0),
    }
}

/// The `zarr.json` document of a tensor's array, as a 1.0 writer wrote it (no save id).
#[must_use]
pub fn array_metadata(key: &TensorKey, e: &TensorEntry) -> Value {
    array_metadata_for(key, e, None)
}

/// The bytes of [`array_metadata_for`] as zarrckpt writes them (pretty-printed JSON).
#[must_use]
pub fn array_metadata_bytes(key: &TensorKey, e: &TensorEntry, save_id: Option<SaveId>) -> Vec<u8> {
    // Invariant: serializing a JSON value (string keys only) cannot fail.
    serde_json::to_vec_pretty(&array_metadata_for(key, e, save_id)).unwrap_or_default()
}

/// The `zarr.json` document of a tensor's array, exactly as zarrckpt writes it; the save id
/// (format 1.1) goes into the `zarrckpt` attribute.
#[must_use]
pub fn array_metadata_for(key: &TensorKey, e: &TensorEntry, save_id: Option<SaveId>) -> Value {
    let mut attr = json!({"key": key.as_str()});
    if let Some(id) = save_id {
        attr["save_id"] = json!(id.hex());
    }
    json!({
        "zarr_format": 3,
        "node_type": "array",
        "shape": e.shape,
        "data_type": e.dtype.name(),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": e.chunk_shape}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": fill_value(e.dtype),
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": e.subchunk_shape,
                "codecs": inner_codecs(e.compression, e.dtype),
                "index_codecs": [bytes_codec(), crc32c_codec()],
                "index_location": "end",
            }
        }],
        "attributes": {ATTRIBUTE: attr},
    })
}

/// Equality of JSON values as spec section 6.3 defines it: numbers are equal when both are
/// integers (written without fraction or exponent) of equal value, or both are not and have
/// equal value and sign; so `5` and `5.0` differ, and so do `0.0` and `-0.0`.
fn same_json(a: Option<&Value>, b: Option<&Value>) -> bool {
    fn eq(a: &Value, b: &Value) -> bool {
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
                _ if x.is_f64() != y.is_f64() => false,
                (Some(p), Some(q)) if x.is_f64() => p.to_bits() == q.to_bits(),
                _ => x == y,
            },
            (Value::Array(x), Value::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| eq(p, q))
            }
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| eq(v, w)))
            }
            _ => a == b,
        }
    }
    match (a, b) {
        (Some(a), Some(b)) => eq(a, b),
        (None, None) => true,
        _ => false,
    }
}

/// A value for an error message. A negative zero (parsed from `-0` or `-0.0`, which the JSON
/// parser does not tell apart) is named as such rather than printed as `-0.0`.
fn shown(v: &Value) -> String {
    match v {
        Value::Number(n) if n.as_f64().is_some_and(|f| f == 0.0 && f.is_sign_negative()) => {
            "a negative zero (`-0` or `-0.0`, refused for every data type: spec section 6.3)".into()
        }
        _ => v.to_string(),
    }
}

/// A tensor's array, ready to encode chunks or decode shard indexes.
pub struct TensorArray {
    key: TensorKey,
    entry: TensorEntry,
    root: PathBuf,
    dir: PathBuf,
    array: Array<FilesystemStore>,
    /// True when the inner codecs are `bytes` + `crc32c` exactly (the direct read path).
    uncompressed: bool,
    index_chain: Arc<CodecChain>,
    index_shape: Vec<NonZeroU64>,
    index_bytes: u64,
    inner_chain: Arc<CodecChain>,
    /// The save id of the index this array belongs to (format 1.1: shards have footers).
    save_id: Option<SaveId>,
}

impl std::fmt::Debug for TensorArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorArray")
            .field("key", &self.key)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn nonzero(shape: &[u64]) -> Vec<NonZeroU64> {
    shape
        .iter()
        .map(|&d| NonZeroU64::new(d).unwrap_or(NonZeroU64::MIN))
        .collect()
}

impl TensorArray {
    /// The array described by `metadata` (a parsed `zarr.json`) for tensor `key` under
    /// checkpoint `root`. Does no I/O.
    ///
    /// # Errors
    /// [`StorageError::Zarr`] when zarrs rejects the metadata, [`StorageError::Malformed`]
    /// when it is not a `sharding_indexed` array whose index codecs are `bytes` + `crc32c`.
    pub fn from_metadata(
        root: &Path,
        key: &TensorKey,
        entry: &TensorEntry,
        metadata: Value,
    ) -> Result<Self, StorageError> {
        let dir = root.join(&entry.path);
        let json_path = dir.join("zarr.json");
        let malformed = |reason: String| StorageError::Malformed {
            path: json_path.clone(),
            reason,
        };
        let sharding = metadata
            .get("codecs")
            .and_then(|c| c.as_array())
            .filter(|c| c.len() == 1)
            .and_then(|c| c.first())
            .filter(|c| c.get("name").and_then(Value::as_str) == Some("sharding_indexed"))
            .and_then(|c| c.get("configuration"))
            .cloned()
            .ok_or_else(|| malformed("codecs must be a single sharding_indexed codec".into()))?;
        let index_codecs: Vec<MetadataV3> =
            serde_json::from_value(sharding.get("index_codecs").cloned().unwrap_or(Value::Null))
                .map_err(|e| malformed(format!("index_codecs: {e}")))?;
        let inner_codecs_meta: Vec<MetadataV3> =
            serde_json::from_value(sharding.get("codecs").cloned().unwrap_or(Value::Null))
                .map_err(|e| malformed(format!("codecs: {e}")))?;
        if sharding
            .get("index_location")
            .and_then(Value::as_str)
            .unwrap_or("end")
            != "end"
        {
            return Err(malformed("index_location must be \"end\"".into()));
        }
        let uncompressed = sharding.get("codecs")
            == Some(&Value::from(inner_codecs(Compression::None, entry.dtype)));
        let store =
            Arc::new(FilesystemStore::new(root).map_err(StorageError::zarr(key.as_str(), root))?);
        let parsed: ArrayMetadata =
            serde_json::from_value(metadata).map_err(|e| malformed(e.to_string()))?;
        let node_path = format!("/{}", entry.path);
        let array = Array::new_with_metadata(store, &node_path, parsed)
            .map_err(StorageError::zarr(key.as_str(), &json_path))?
            .with_codec_specific_options(&CodecSpecificOptions::default().with_option(
                ShardingCodecOptions::default().with_subchunk_write_order(SubchunkWriteOrder::C),
            ));
        let index_chain = Arc::new(
            CodecChain::from_metadata(&index_codecs)
                .map_err(StorageError::zarr(key.as_str(), &json_path))?,
        );
        let inner_chain = Arc::new(
            CodecChain::from_metadata(&inner_codecs_meta)
                .map_err(StorageError::zarr(key.as_str(), &json_path))?,
        );
        let per_shard: Vec<u64> = entry
            .chunk_shape
            .iter()
            .zip(&entry.subchunk_shape)
            .map(|(c, s)| c / s)
            .collect();
        let mut index_shape = nonzero(&per_shard);
        index_shape.push(NonZeroU64::new(2).unwrap_or(NonZeroU64::MIN));
        let index_bytes = match index_chain
            .encoded_representation(&index_shape, &data_type::uint64(), &u64::MAX.into())
            .map_err(StorageError::zarr(key.as_str(), &json_path))?
        {
            BytesRepresentation::FixedSize(n) => n,
            _ => {
                return Err(malformed(
                    "index codecs must have a fixed encoded size".into(),
                ));
            }
        };
        Ok(TensorArray {
            key: key.clone(),
            entry: entry.clone(),
            root: root.to_owned(),
            dir,
            array,
            uncompressed,
            index_chain,
            index_shape,
            index_bytes,
            inner_chain,
            save_id: None,
        })
    }

    /// The array zarrckpt writes for `entry`.
    ///
    /// # Errors
    /// As [`TensorArray::from_metadata`].
    pub fn create(root: &Path, key: &TensorKey, entry: &TensorEntry) -> Result<Self, StorageError> {
        Self::from_metadata(root, key, entry, array_metadata(key, entry))
    }

    /// The array a save with id `save_id` writes for `entry` (shards with footers).
    ///
    /// # Errors
    /// As [`TensorArray::from_metadata`].
    pub fn create_for(
        root: &Path,
        key: &TensorKey,
        entry: &TensorEntry,
        save_id: SaveId,
    ) -> Result<Self, StorageError> {
        let mut a = Self::from_metadata(
            root,
            key,
            entry,
            array_metadata_for(key, entry, Some(save_id)),
        )?;
        a.save_id = Some(save_id);
        Ok(a)
    }

    /// [`TensorArray::open`] for an index committed by save `save_id` (`None` for a 1.0
    /// index): the array's `zarr.json` must carry the same save id, and its shards are read
    /// with their footers checked.
    ///
    /// # Errors
    /// As [`TensorArray::open`], and [`StorageError::Malformed`] when the save id differs.
    pub fn open_for(
        root: &Path,
        key: &TensorKey,
        entry: &TensorEntry,
        save_id: Option<SaveId>,
    ) -> Result<Self, StorageError> {
        let path = root.join(&entry.path).join("zarr.json");
        let bytes = super::meta::read_metadata_file(&path, super::meta::MAX_ARRAY_JSON_BYTES)?;
        Self::from_json(root, key, entry, &bytes, save_id)
    }

    /// [`TensorArray::open_for`] of the checkpoint under `prefix` in `store`: through the
    /// file system where the store has local files, else by reading the array's `zarr.json`
    /// object (at most [`super::meta::MAX_ARRAY_JSON_BYTES`]). Shards of an array opened on a
    /// store without local files are named by the store's URLs in messages
    /// ([`TensorArray::chunk_path`]) and read with ranged gets.
    ///
    /// # Errors
    /// As [`TensorArray::open_for`]; [`StorageError::NotFound`] when the object is absent.
    pub fn open_in(
        store: &dyn super::store::Store,
        prefix: &str,
        key: &TensorKey,
        entry: &TensorEntry,
        save_id: Option<SaveId>,
    ) -> Result<Self, StorageError> {
        if let Some(root) = store.local_path(prefix) {
            return Self::open_for(&root, key, entry, save_id);
        }
        let location = super::store::join(prefix, &format!("{}/zarr.json", entry.path));
        let bytes = store.get(&location, super::meta::MAX_ARRAY_JSON_BYTES)?;
        Self::from_json(&store.display_path(prefix), key, entry, &bytes, save_id)
    }

    /// The array whose `zarr.json` holds `bytes`, checked against the index entry (and the
    /// save id of the index, when it has one); `root` names the checkpoint in messages.
    pub(crate) fn from_json(
        root: &Path,
        key: &TensorKey,
        entry: &TensorEntry,
        bytes: &[u8],
        save_id: Option<SaveId>,
    ) -> Result<Self, StorageError> {
        let path = root.join(&entry.path).join("zarr.json");
        let meta: Value = super::meta::parse_json(bytes).map_err(|e| StorageError::Malformed {
            path: path.clone(),
            reason: format!("not JSON: {e}"),
        })?;
        let found = meta
            .get("attributes")
            .and_then(|a| a.get(ATTRIBUTE))
            .and_then(|a| a.get("save_id"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let mut a = Self::checked(root, key, entry, meta, &path)?;
        if let Some(id) = save_id {
            if found.as_deref() != Some(id.hex().as_str()) {
                return Err(StorageError::Malformed {
                    path,
                    reason: format!(
                        "tensor `{key}`: the array was written by save {}, but the index was committed by save {id} (a mix of two saves, or a save replaced the checkpoint while it was being read)",
                        found.as_deref().unwrap_or("(none)")
                    ),
                });
            }
            a.save_id = Some(id);
        }
        Ok(a)
    }

    /// The save id its shards' footers must carry (`None`: a 1.0 array, no footers).
    #[must_use]
    pub fn save_id(&self) -> Option<SaveId> {
        self.save_id
    }

    /// Subchunks per shard.
    #[must_use]
    pub fn subchunks_per_shard(&self) -> u64 {
        self.index_shape
            .iter()
            .take(self.index_shape.len().saturating_sub(1))
            .map(|d| d.get())
            .product()
    }

    /// Size of each shard's footer: 0 for a 1.0 array.
    #[must_use]
    pub fn footer_bytes(&self) -> u64 {
        match self.save_id {
            Some(_) => footer_len(self.entry.chunk_shape.len(), self.subchunks_per_shard())
                // A footer too large to size is larger than any file: readers refuse it.
                .unwrap_or(u64::MAX),
            None => 0,
        }
    }

    /// Opens the array of `entry` from its `zarr.json` and checks it agrees with the index.
    ///
    /// # Errors
    /// [`StorageError::Io`] if `zarr.json` cannot be read, [`StorageError::Malformed`] if it
    /// does not parse or disagrees with the checkpoint index on data type, shape or grid.
    pub fn open(root: &Path, key: &TensorKey, entry: &TensorEntry) -> Result<Self, StorageError> {
        Self::open_for(root, key, entry, None)
    }

    /// Checks a parsed `zarr.json` (`meta`, read from `path`) against the index entry, then
    /// builds the array.
    fn checked(
        root: &Path,
        key: &TensorKey,
        entry: &TensorEntry,
        meta: Value,
        path: &Path,
    ) -> Result<Self, StorageError> {
        let path = path.to_owned();
        let expected = array_metadata(key, entry);
        for field in super::groups::ARRAY_DOC_MEMBERS {
            if !same_json(meta.get(field), expected.get(field)) {
                return Err(StorageError::Malformed {
                    path,
                    reason: format!(
                        "`{field}` is {} but a zarrckpt array with this index entry has {}",
                        shown(meta.get(field).unwrap_or(&Value::Null)),
                        expected.get(field).unwrap_or(&Value::Null)
                    ),
                });
            }
        }
        let stored_key = meta
            .get("attributes")
            .and_then(|a| a.get(ATTRIBUTE))
            .and_then(|z| z.get("key"));
        if stored_key.and_then(Value::as_str) != Some(key.as_str()) {
            return Err(StorageError::Malformed {
                path,
                reason: format!(
                    "`attributes.{ATTRIBUTE}.key` is {} but the index has this array under the key {:?}",
                    stored_key.map_or_else(|| "absent".to_owned(), ToString::to_string),
                    key.as_str()
                ),
            });
        }
        if meta
            .get("storage_transformers")
            .and_then(Value::as_array)
            .is_some_and(|t| !t.is_empty())
        {
            return Err(StorageError::Malformed {
                path,
                reason: "storage transformers are not allowed".into(),
            });
        }
        Self::from_metadata(root, key, entry, meta)
    }

    /// The tensor's key.
    #[must_use]
    pub fn key(&self) -> &TensorKey {
        &self.key
    }
    /// The index entry.
    #[must_use]
    pub fn entry(&self) -> &TensorEntry {
        &self.entry
    }
    /// The array's directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// True when subchunks are stored as raw little-endian bytes followed by a crc32c.
    #[must_use]
    pub fn uncompressed(&self) -> bool {
        self.uncompressed
    }
    /// Encoded size of a shard index in bytes.
    #[must_use]
    pub fn index_bytes(&self) -> u64 {
        self.index_bytes
    }

    /// The file of the shard at grid index `chunk`.
    #[must_use]
    pub fn chunk_path(&self, chunk: &[u64]) -> PathBuf {
        self.root.join(self.array.chunk_key(chunk).as_str())
    }

    /// The store location (relative to the checkpoint's root) of the shard at grid index
    /// `chunk`.
    #[must_use]
    pub fn chunk_location(&self, chunk: &[u64]) -> String {
        self.array.chunk_key(chunk).as_str().to_owned()
    }

    /// The store location (relative to the checkpoint's root) of the array's `zarr.json`.
    #[must_use]
    pub fn metadata_location(&self) -> String {
        format!("{}/zarr.json", self.entry.path)
    }

    /// The checkpoint's root directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Encodes one subchunk (`raw`, its bytes in C order) with the array's inner codecs, as
    /// zarrs' sharding encoder does for each subchunk: the result ends with the crc32c of
    /// the bytes before it. `linear` is its index in the shard at grid index `chunk` (for
    /// messages).
    ///
    /// # Errors
    /// [`StorageError::Zarr`] when zarrs fails to encode.
    pub fn encode_subchunk(
        &self,
        chunk: &[u64],
        linear: u64,
        raw: &[u8],
    ) -> Result<Vec<u8>, StorageError> {
        let shape = nonzero(&self.entry.subchunk_shape);
        let options = CodecOptions::default().with_concurrent_target(1);
        self.inner_chain
            .encode(
                ArrayBytes::from(raw),
                &shape,
                &to_zarrs(self.entry.dtype),
                &zero_fill(self.entry.dtype),
                &options,
            )
            .map(Cow::into_owned)
            .map_err(|e| StorageError::Zarr {
                key: self.key.to_string(),
                path: self.chunk_path(chunk),
                source: format!("subchunk {linear}: {e}").into(),
            })
    }

    /// Encodes one whole shard with zarrs' sharding encoder (no footer): the reference the
    /// shard writer ([`super::shard`]) is tested against. `bytes` holds the full chunk shape
    /// in C order (edge chunks padded with zeros).
    ///
    /// # Errors
    /// [`StorageError::Zarr`] when zarrs fails to encode.
    pub fn encode_chunk<'a>(
        &self,
        chunk: &[u64],
        bytes: &'a [u8],
    ) -> Result<Cow<'a, [u8]>, StorageError> {
        let shape = nonzero(&self.entry.chunk_shape);
        let options = CodecOptions::default()
            .with_concurrent_target(1)
            .with_store_empty_chunks(true);
        self.array
            .codecs()
            .encode(
                ArrayBytes::from(bytes),
                &shape,
                &to_zarrs(self.entry.dtype),
                &zero_fill(self.entry.dtype),
                &options,
            )
            .map_err(StorageError::zarr(
                self.key.as_str(),
                self.chunk_path(chunk),
            ))
    }

    /// Decodes one encoded subchunk (compressed arrays) with zarrs' inner codec chain, which
    /// checks its crc32c again and decompresses it. The caller has checked the crc32c and the
    /// decoded size the compressed stream declares.
    ///
    /// # Errors
    /// [`StorageError::CorruptChunk`] when zarrs cannot decode it or the size is wrong.
    pub fn decode_subchunk(
        &self,
        chunk: &[u64],
        linear: u64,
        encoded: &[u8],
    ) -> Result<Vec<u8>, StorageError> {
        let corrupt = |detail: String| StorageError::CorruptChunk {
            key: self.key.to_string(),
            chunk: chunk.to_vec(),
            path: self.chunk_path(chunk),
            detail,
        };
        let shape = nonzero(&self.entry.subchunk_shape);
        let decoded = self
            .inner_chain
            .decode(
                Cow::Borrowed(encoded),
                &shape,
                &to_zarrs(self.entry.dtype),
                &zero_fill(self.entry.dtype),
                &CodecOptions::default(),
            )
            .map_err(|e| corrupt(format!("subchunk {linear}: {e}")))?;
        let raw = decoded
            .into_fixed()
            .map_err(|e| corrupt(format!("subchunk {linear}: {e}")))?
            .into_owned();
        let expected =
            self.entry.subchunk_shape.iter().product::<u64>() as usize * self.entry.dtype.size();
        if raw.len() != expected {
            return Err(corrupt(format!(
                "subchunk {linear} decodes to {} bytes, expected {expected}",
                raw.len()
            )));
        }
        Ok(raw)
    }

    /// Decodes a shard index (the file's last [`TensorArray::index_bytes`] bytes) with zarrs,
    /// checking its crc32c, into `(offset, length)` per subchunk; `None` marks an absent
    /// subchunk (all fill value).
    ///
    /// # Errors
    /// [`StorageError::CorruptChunk`] when the index does not decode or its checksum fails.
    pub fn decode_index(
        &self,
        chunk: &[u64],
        encoded: &[u8],
    ) -> Result<Vec<Option<(u64, u64)>>, StorageError> {
        let corrupt = |detail: String| StorageError::CorruptChunk {
            key: self.key.to_string(),
            chunk: chunk.to_vec(),
            path: self.chunk_path(chunk),
            detail,
        };
        let decoded = self
            .index_chain
            .decode(
                Cow::Borrowed(encoded),
                &self.index_shape,
                &data_type::uint64(),
                &u64::MAX.into(),
                &CodecOptions::default(),
            )
            .map_err(|e| corrupt(format!("shard index: {e}")))?;
        let raw = decoded
            .into_fixed()
            .map_err(|e| corrupt(format!("shard index: {e}")))?;
        let words: Vec<u64> = raw
            .chunks_exact(8)
            .map(|w| u64::from_ne_bytes(w.try_into().unwrap_or([0xff; 8])))
            .collect();
        Ok(words
            .chunks_exact(2)
            .map(|p| {
                if p[0] == u64::MAX && p[1] == u64::MAX {
                    None
                } else {
                    Some((p[0], p[1]))
                }
            })
            .collect())
    }
}
