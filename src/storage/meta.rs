//! The checkpoint's own metadata: the `zarrckpt` attribute of the root group's `zarr.json`.
//! See `spec/format.md` § "Root metadata" and `spec/schema/zarrckpt.schema.json`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use super::doc::{ATTRIBUTE, MAX_ARRAY_JSON_BYTES, parse_json, read_metadata_file};
use super::error::StorageError;
use super::footer::SaveId;
use crate::model::region::{MAX_DIMS, num_elements};
use crate::model::{DType, TensorKey};

/// The format's name, the value of `format`.
pub const FORMAT_NAME: &str = "zarrckpt";
/// The major version this crate reads and writes.
pub const FORMAT_MAJOR: u32 = 1;
/// The minor version this crate writes.
pub const FORMAT_MINOR: u32 = 2;
/// The first minor version whose checkpoints carry a save id and shard footers.
pub const SAVE_ID_MINOR: u32 = 1;
/// The first minor version whose object arrays carry the save id and their value's CRC-32C
/// in their attributes (spec section 16.3); readers check them from this version on.
pub const OBJECT_SAVE_ID_MINOR: u32 = 2;
/// Most subchunks one shard may have (its index is 16 bytes per subchunk).
pub const MAX_SUBCHUNKS_PER_SHARD: u64 = crate::plan::grid::MAX_SUBCHUNKS_PER_SHARD;
/// Most shard files one tensor may have.
pub const MAX_CHUNKS_PER_TENSOR: u64 = crate::plan::grid::MAX_CHUNKS_PER_TENSOR;
/// A tensor may have more than [`MAX_SMALL_SUBCHUNKS`] subchunks (all shards together) only
/// when they average at least this many bytes (see
/// [`crate::plan::grid::MIN_BYTES_PER_SUBCHUNK`]).
pub const MIN_BYTES_PER_SUBCHUNK: u64 = crate::plan::grid::MIN_BYTES_PER_SUBCHUNK;
/// Subchunks a tensor may have (all shards together) whatever their size.
pub const MAX_SMALL_SUBCHUNKS: u64 = crate::plan::grid::MAX_SMALL_SUBCHUNKS;
/// Most shard files one checkpoint may have, all tensors together.
pub const MAX_CHUNKS_PER_CHECKPOINT: u64 = 1 << 24;
/// Most bytes one subchunk may hold decoded (writers never exceed it: see
/// [`crate::plan::grid::MAX_SUBCHUNK_BYTES`]); a reader decodes a whole subchunk at a time,
/// so this bounds what one damaged or crafted subchunk can make it allocate.
pub const MAX_SUBCHUNK_BYTES: u64 = crate::plan::grid::MAX_SUBCHUNK_BYTES;
/// Most bytes of a checkpoint's root `zarr.json` a reader reads, whatever its index holds
/// (room for about 500,000 tensors with keys of 60 bytes, written as zarrckpt writes them).
/// See [`root_json_limit`] for the limit an index of a given size must meet.
pub const MAX_ROOT_JSON_BYTES: u64 = 256 << 20;
/// The part of [`root_json_limit`] that does not grow with the index's entries: room for
/// the `user` metadata and the members of a small index.
pub const ROOT_JSON_BASE_BYTES: u64 = 32 << 20;
/// What [`root_json_limit`] adds per tensor or object entry (a zarrckpt entry takes 300 to
/// 600 bytes with real keys; a key of 1024 bytes and 32 dimensions take about 9 KiB).
pub const ROOT_JSON_BYTES_PER_ENTRY: u64 = 16 << 10;

/// The most bytes a root `zarr.json` whose index has `entries` tensor and object entries may
/// have: [`ROOT_JSON_BASE_BYTES`] plus [`ROOT_JSON_BYTES_PER_ENTRY`] per entry, at most
/// [`MAX_ROOT_JSON_BYTES`]. So a small index stays small whatever else a damaged or crafted
/// file adds, and the largest real models (DeepSeek-V3's 90,000 tensors take about 45 MB)
/// fit. Readers refuse a larger file; writers check it before writing anything.
#[must_use]
pub fn root_json_limit(entries: usize) -> u64 {
    (entries as u64)
        .saturating_mul(ROOT_JSON_BYTES_PER_ENTRY)
        .saturating_add(ROOT_JSON_BASE_BYTES)
        .min(MAX_ROOT_JSON_BYTES)
}

/// A reader limit of the format (spec section 4) that an index breaks: the writer refuses
/// such a save before writing anything (rules W10 to W15), since every reader would refuse
/// the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexLimit {
    /// A tensor's grid breaks a limit.
    #[error("tensor `{key}` cannot be stored: {limit} (a limit every reader enforces)")]
    Tensor {
        /// The tensor.
        key: TensorKey,
        /// The limit.
        limit: crate::plan::grid::GridLimit,
    },
    /// Too many shard files in all.
    #[error(
        "the checkpoint would have {chunks} shard files, more than the {MAX_CHUNKS_PER_CHECKPOINT} every reader accepts"
    )]
    ShardFiles {
        /// Shard files of all tensors together (saturating).
        chunks: u64,
    },
    /// The root `zarr.json` is too large.
    #[error(
        "the root zarr.json would be {bytes} bytes, more than the {limit} every reader accepts for an index of {entries} entries ({ROOT_JSON_BASE_BYTES} + {ROOT_JSON_BYTES_PER_ENTRY} per entry, at most {MAX_ROOT_JSON_BYTES}); shorten the keys or the user metadata"
    )]
    RootJson {
        /// The document's size.
        bytes: u64,
        /// The limit for its entries.
        limit: u64,
        /// Tensor and object entries.
        entries: usize,
    },
}
/// The group holding tensors.
pub const TENSORS_GROUP: &str = "tensors";

/// How chunks are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// No compression: inner codecs `bytes` + `crc32c`.
    #[default]
    None,
    /// `zstd` between `bytes` and `crc32c`.
    Zstd,
    /// `blosc` (lz4, byte shuffle) between `bytes` and `crc32c`.
    Blosc,
}

/// One tensor in the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Node path of the array, relative to the checkpoint root.
    pub path: String,
    /// Data type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Outer chunk (shard) shape.
    pub chunk_shape: Vec<u64>,
    /// Inner subchunk shape.
    pub subchunk_shape: Vec<u64>,
    /// Compression of inner chunks.
    pub compression: Compression,
}

impl TensorEntry {
    /// Number of shard files (`None` on overflow or a zero chunk extent).
    #[must_use]
    pub fn num_chunks(&self) -> Option<u64> {
        self.shape
            .iter()
            .zip(&self.chunk_shape)
            .try_fold(1u64, |acc, (&d, &c)| {
                if c == 0 {
                    return None;
                }
                acc.checked_mul(d.div_ceil(c))
            })
    }

    /// Logical size in bytes (elements times element size), saturating.
    #[must_use]
    pub fn nbytes(&self) -> u64 {
        num_elements(&self.shape)
            .unwrap_or(u64::MAX) // saturating, as documented
            .saturating_mul(self.dtype.size() as u64)
    }
}

/// The `zarrckpt` attribute of the root group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Always `"zarrckpt"`.
    pub format: String,
    /// `"MAJOR.MINOR"`.
    pub version: String,
    /// Software that wrote the checkpoint.
    pub writer: String,
    /// Number of ranks that saved it.
    pub world_size: u64,
    /// The random id of the save that committed this index (format 1.1): every shard file
    /// carries it in its footer and every array's `zarr.json` in its attributes. Absent in
    /// 1.0 checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_id: Option<SaveId>,
    /// Every tensor, by key.
    pub tensors: BTreeMap<TensorKey, TensorEntry>,
    /// Caller metadata (training step and the like), free-form JSON.
    pub user: serde_json::Map<String, serde_json::Value>,
    /// Every object (non-tensor state), by key (format 1.1; absent means none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub objects: BTreeMap<TensorKey, super::object::ObjectEntry>,
}

/// The path of a tensor's array: `tensors/` followed by the key's node path.
#[must_use]
pub fn tensor_path(key: &TensorKey) -> String {
    format!("{TENSORS_GROUP}/{}", key.node_path())
}

/// Parses `MAJOR.MINOR`: ASCII digits only, no sign, no leading zeros.
fn parse_version(v: &str) -> Option<(u32, u32)> {
    let (a, b) = v.split_once('.')?;
    let part = |p: &str| {
        let ok = !p.is_empty()
            && p.bytes().all(|c| c.is_ascii_digit())
            && (p == "0" || !p.starts_with('0'));
        if ok { p.parse::<u32>().ok() } else { None }
    };
    Some((part(a)?, part(b)?))
}

impl CheckpointMeta {
    /// Parses and validates the root `zarr.json` of a checkpoint read from `path`.
    ///
    /// # Errors
    /// [`StorageError::NotACheckpoint`] when it is not a zarrckpt root group,
    /// [`StorageError::UnsupportedVersion`] for another major version, and
    /// [`StorageError::Malformed`] for anything inconsistent (bad keys, paths that do not
    /// follow the key mapping, shapes that overflow, grids that do not divide).
    pub fn from_root_json(bytes: &[u8], path: &Path) -> Result<Self, StorageError> {
        let malformed = |reason: String| StorageError::Malformed {
            path: path.to_owned(),
            reason,
        };
        let mut root = parse_json(bytes).map_err(|e| malformed(format!("not JSON: {e}")))?;
        if root.get("zarr_format") != Some(&serde_json::Value::from(3))
            || root.get("node_type") != Some(&"group".into())
        {
            return Err(StorageError::NotACheckpoint {
                path: path.to_owned(),
                reason: "the root zarr.json is not a Zarr v3 group".into(),
            });
        }
        // Taken out of the document (not cloned): the index may be hundreds of MiB.
        let Some(mut attr) = root
            .get_mut("attributes")
            .and_then(|a| a.get_mut(ATTRIBUTE))
            .map(serde_json::Value::take)
        else {
            return Err(StorageError::NotACheckpoint {
                path: path.to_owned(),
                reason: format!("the root group has no `{ATTRIBUTE}` attribute"),
            });
        };
        if attr.get("format").and_then(|f| f.as_str()) != Some(FORMAT_NAME) {
            return Err(malformed(format!(
                "`{ATTRIBUTE}.format` is not \"{FORMAT_NAME}\""
            )));
        }
        let version_value = attr
            .get("version")
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        let version = version_value.as_str().unwrap_or("");
        let Some((major, minor)) = parse_version(version) else {
            return Err(malformed(format!(
                "`{ATTRIBUTE}.version` {version_value} is not a \"MAJOR.MINOR\" string"
            )));
        };
        if major != FORMAT_MAJOR {
            return Err(StorageError::UnsupportedVersion {
                path: path.to_owned(),
                found: version.to_owned(),
                supported: format!("{FORMAT_MAJOR}.x"),
            });
        }
        if minor < SAVE_ID_MINOR
            && let Some(a) = attr.as_object_mut()
        {
            // The version decides (spec section 4): a 1.0 index has no save id, whatever
            // members it carries, and its shards have no footer. A `save_id` member there is
            // a member 1.0 does not define, ignored (section 12).
            a.remove("save_id");
        }
        let meta: CheckpointMeta = serde_path_to_error::deserialize(attr).map_err(|e| {
            use serde_path_to_error::Segment;
            let segments: Vec<&Segment> = e.path().iter().collect();
            let field = |rest: &[&Segment]| {
                rest.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(".")
            };
            match segments.as_slice() {
                [Segment::Map { key: group }, Segment::Map { key }, rest @ ..]
                    if group == "tensors" =>
                {
                    malformed(format!(
                        "tensor `{key}`: field `{}`: {}",
                        field(rest),
                        e.inner()
                    ))
                }
                [Segment::Map { key: group }, Segment::Map { key }, rest @ ..]
                    if group == "objects" =>
                {
                    malformed(format!(
                        "object `{key}`: field `{}`: {}",
                        field(rest),
                        e.inner()
                    ))
                }
                _ => malformed(format!("field `{ATTRIBUTE}.{}`: {}", e.path(), e.inner())),
            }
        })?;
        if meta.world_size == 0 {
            return Err(malformed(format!(
                "`{ATTRIBUTE}.world_size` is 0; it must be at least 1"
            )));
        }
        if minor >= SAVE_ID_MINOR && meta.save_id.is_none() {
            return Err(malformed(format!(
                "`{ATTRIBUTE}.save_id` is required from version {FORMAT_MAJOR}.{SAVE_ID_MINOR} on"
            )));
        }

        for (key, t) in &meta.tensors {
            t.validate(key)
                .map_err(|r| malformed(format!("tensor `{key}`: {r}")))?;
        }
        crate::model::key::check_collisions(meta.tensors.keys())
            .map_err(|e| malformed(e.to_string()))?;
        for (key, o) in &meta.objects {
            o.validate(key)
                .map_err(|r| malformed(format!("object `{key}`: {r}")))?;
        }
        crate::model::key::check_collisions(meta.objects.keys())
            .map_err(|e| malformed(format!("objects: {e}")))?;
        let chunks = meta
            .tensors
            .values()
            .try_fold(0u64, |acc, t| acc.checked_add(t.num_chunks()?));
        if chunks.is_none_or(|n| n > MAX_CHUNKS_PER_CHECKPOINT) {
            return Err(malformed(format!(
                "more than {MAX_CHUNKS_PER_CHECKPOINT} shard files in all"
            )));
        }
        let entries = meta.tensors.len() + meta.objects.len();
        let limit = root_json_limit(entries);
        if bytes.len() as u64 > limit {
            return Err(malformed(format!(
                "the file is {} bytes, more than the {limit} a reader accepts for an index of {entries} entries ({ROOT_JSON_BASE_BYTES} + {ROOT_JSON_BYTES_PER_ENTRY} per entry)",
                bytes.len()
            )));
        }
        Ok(meta)
    }

    /// The root `zarr.json` document.
    #[must_use]
    pub fn to_root_json(&self) -> Vec<u8> {
        let doc = serde_json::json!({
            "zarr_format": 3,
            "node_type": "group",
            "attributes": { ATTRIBUTE: self },
        });
        // Invariant: serializing a JSON value (string keys only) cannot fail.
        serde_json::to_vec_pretty(&doc).unwrap_or_default()
    }

    /// Checks the index against every reader limit that bounds it (spec section 4): each
    /// tensor's geometry, the shard files of all tensors together and the size of the root
    /// `zarr.json` it serialises to ([`root_json_limit`]). A writer calls it before writing
    /// anything, with an index of the final size (a save id of the final length included).
    ///
    /// # Errors
    /// The first [`IndexLimit`] broken.
    pub fn check_writable(&self) -> Result<(), IndexLimit> {
        let mut chunks = 0u64;
        for (key, t) in &self.tensors {
            crate::plan::grid::check_geometry(
                &t.shape,
                &t.chunk_shape,
                &t.subchunk_shape,
                t.dtype.size(),
            )
            .map_err(|limit| IndexLimit::Tensor {
                key: key.clone(),
                limit,
            })?;
            // Too many chunks to count is over the limit below.
            chunks = chunks.saturating_add(t.num_chunks().unwrap_or(u64::MAX));
        }
        if chunks > MAX_CHUNKS_PER_CHECKPOINT {
            return Err(IndexLimit::ShardFiles { chunks });
        }
        let entries = self.tensors.len() + self.objects.len();
        let limit = root_json_limit(entries);
        let bytes = self.to_root_json().len() as u64;
        if bytes > limit {
            return Err(IndexLimit::RootJson {
                bytes,
                limit,
                entries,
            });
        }
        Ok(())
    }

    /// A fresh index without a save id: version 1.0, whose shards have no footer. Saves
    /// call [`CheckpointMeta::with_save_id`], which makes it a version 1.1 index.
    #[must_use]
    pub fn new(world_size: u64) -> Self {
        CheckpointMeta {
            format: FORMAT_NAME.into(),
            version: format!("{FORMAT_MAJOR}.0"),
            writer: format!("zarrckpt {}", env!("CARGO_PKG_VERSION")),
            world_size,
            save_id: None,
            tensors: BTreeMap::new(),
            user: serde_json::Map::new(),
            objects: BTreeMap::new(),
        }
    }
}

impl CheckpointMeta {
    /// The minor version of this index (`None` when `version` is malformed, which
    /// [`CheckpointMeta::from_root_json`] never returns).
    #[must_use]
    pub fn minor(&self) -> Option<u32> {
        parse_version(&self.version).map(|(_, m)| m)
    }

    /// The save id the object arrays of this index must carry (spec section 16.3): the
    /// index's `save_id` from version 1.2 on, `None` before (1.1 object arrays are not bound
    /// to their save).
    #[must_use]
    pub fn object_save_id(&self) -> Option<SaveId> {
        self.save_id
            .filter(|_| self.minor().is_some_and(|m| m >= OBJECT_SAVE_ID_MINOR))
    }

    /// Records the save that commits this index (its shards carry footers with this id): the
    /// index becomes version `1.2` ([`FORMAT_MINOR`]).
    #[must_use]
    pub fn with_save_id(mut self, id: SaveId) -> Self {
        self.save_id = Some(id);
        self.version = format!("{FORMAT_MAJOR}.{FORMAT_MINOR}");
        self
    }
}

impl TensorEntry {
    fn validate(&self, key: &TensorKey) -> Result<(), String> {
        if self.path != tensor_path(key) {
            return Err(format!(
                "path {:?} does not follow the key mapping (expected {:?})",
                self.path,
                tensor_path(key)
            ));
        }
        let n = self.shape.len();
        if n > MAX_DIMS {
            return Err(format!("{n} dimensions exceed {MAX_DIMS}"));
        }
        if self.chunk_shape.len() != n || self.subchunk_shape.len() != n {
            return Err("shape, chunk_shape and subchunk_shape differ in length".into());
        }
        num_elements(&self.shape).map_err(|e| e.to_string())?;
        crate::model::region::num_bytes(&self.shape, self.dtype.size())
            .map_err(|e| e.to_string())?;
        for d in 0..n {
            let (c, s) = (self.chunk_shape[d], self.subchunk_shape[d]);
            if c == 0 || s == 0 || c % s != 0 {
                return Err(format!(
                    "subchunk_shape {:?} does not divide chunk_shape {:?}",
                    self.subchunk_shape, self.chunk_shape
                ));
            }
        }
        crate::model::region::num_bytes(&self.chunk_shape, self.dtype.size())
            .map_err(|e| e.to_string())?;
        crate::plan::grid::check_geometry(
            &self.shape,
            &self.chunk_shape,
            &self.subchunk_shape,
            self.dtype.size(),
        )
        .map_err(|e| e.to_string())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointMeta {
        let mut m = CheckpointMeta::new(4).with_save_id(crate::storage::footer::SaveId([3; 16]));
        let key = TensorKey::new("decoder.weight").unwrap();
        m.tensors.insert(
            key.clone(),
            TensorEntry {
                path: tensor_path(&key),
                dtype: DType::BFloat16,
                shape: vec![8, 4],
                chunk_shape: vec![2, 4],
                subchunk_shape: vec![1, 4],
                compression: Compression::None,
            },
        );
        m.user.insert("step".into(), 100.into());
        m
    }

    #[test]
    fn round_trips() {
        let m = sample();
        let p = Path::new("/ckpt/zarr.json");
        assert_eq!(
            CheckpointMeta::from_root_json(&m.to_root_json(), p).unwrap(),
            m
        );
    }

    #[test]
    fn rejects_bad_versions_and_paths() {
        let p = Path::new("/ckpt/zarr.json");
        let mut v: serde_json::Value = serde_json::from_slice(&sample().to_root_json()).unwrap();
        v["attributes"]["zarrckpt"]["version"] = "2.0".into();
        let e = CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap_err();
        assert!(matches!(e, StorageError::UnsupportedVersion { .. }), "{e}");
        for bad in ["+1.0", "01.0", "1.00", "1", "1.0.0", "1.x", ""] {
            v["attributes"]["zarrckpt"]["version"] = bad.into();
            let e =
                CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap_err();
            assert!(matches!(e, StorageError::Malformed { .. }), "{bad}: {e}");
        }
        // 1.1 and later need a save id; 1.0 does not.
        let id = v["attributes"]["zarrckpt"]["save_id"].take();
        v["attributes"]["zarrckpt"]
            .as_object_mut()
            .unwrap()
            .remove("save_id");
        v["attributes"]["zarrckpt"]["version"] = "1.1".into();
        let e = CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap_err();
        assert!(e.to_string().contains("save_id"), "{e}");
        v["attributes"]["zarrckpt"]["version"] = "1.0".into();
        CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap();
        // 1.0 does not define `save_id`: ignored there, whatever it holds.
        v["attributes"]["zarrckpt"]["save_id"] = "not hex".into();
        let m = CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap();
        assert_eq!(m.save_id, None);
        v["attributes"]["zarrckpt"]["version"] = "1.1".into();
        CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap_err();
        v["attributes"]["zarrckpt"]["save_id"] = id;
        v["attributes"]["zarrckpt"]["version"] = "1.7".into();
        v["attributes"]["zarrckpt"]["future_field"] = 1.into();
        CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap();
        v["attributes"]["zarrckpt"]["tensors"]["decoder.weight"]["path"] = "../../etc".into();
        let e = CheckpointMeta::from_root_json(&serde_json::to_vec(&v).unwrap(), p).unwrap_err();
        assert!(matches!(e, StorageError::Malformed { .. }), "{e}");
        let e = CheckpointMeta::from_root_json(
            b"{\"zarr_format\":3,\"node_type\":\"group\",\"attributes\":{}}",
            p,
        )
        .unwrap_err();
        assert!(matches!(e, StorageError::NotACheckpoint { .. }), "{e}");
        let e = CheckpointMeta::from_root_json(b"{not json", p).unwrap_err();
        assert!(matches!(e, StorageError::Malformed { .. }), "{e}");
    }
}
