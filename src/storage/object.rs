//! Objects on disk (spec § "Objects"): every value is a one-dimensional `uint8` Zarr array
//! with one chunk and the codecs `bytes` + `crc32c`, so any Zarr reader can open it. A common
//! object is an array at `objects/` + the key's node path; a per-rank or sharded object is a
//! group there holding one array per rank (`rank.<r>`) or per shard (`shard.<i>.<j>…`).

use std::collections::BTreeSet;
use std::fs;
use std::io::{IoSlice, Read};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::doc::ATTRIBUTE;
use super::error::StorageError;
use super::footer::SaveId;
use super::store::{LocalStore, Store, join};
use crate::model::TensorKey;
use crate::model::object::{Encoding, MAX_OBJECT_BYTES, MAX_OBJECT_SLOTS, ObjectSlot, check_grid};

/// The group holding objects.
pub const OBJECTS_GROUP: &str = "objects";

/// How an object is stored, in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoredScope {
    /// One value.
    Common,
    /// One value per rank of the saving job.
    PerRank,
    /// One value per cell of a grid.
    Sharded,
}

impl StoredScope {
    /// The name in metadata.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            StoredScope::Common => "common",
            StoredScope::PerRank => "per_rank",
            StoredScope::Sharded => "sharded",
        }
    }
}

/// One object in the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectEntry {
    /// Node path of the array (common) or group (per-rank, sharded): `objects/` + the key's
    /// node path.
    pub path: String,
    /// Scope.
    pub scope: StoredScope,
    /// How the value bytes are to be read.
    pub encoding: Encoding,
    /// Common objects: the value's length in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Per-rank objects: the saving job's world size (one value per rank below it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u64>,
    /// Sharded objects: the grid (one value per cell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grid: Option<Vec<u64>>,
}

/// The node path of an object: `objects/` followed by the key's node path.
#[must_use]
pub fn object_path(key: &TensorKey) -> String {
    format!("{OBJECTS_GROUP}/{}", key.node_path())
}

/// The name of a value's array inside a per-rank or sharded object's group. Contains a `.`
/// followed by digits, which no escaped key segment is, and never collides with another key
/// (the group is the key's own node).
#[must_use]
pub fn slot_name(slot: &ObjectSlot) -> Option<String> {
    match slot {
        ObjectSlot::Common => None,
        ObjectSlot::Rank(r) => Some(format!("rank.{r}")),
        ObjectSlot::Shard(i) => Some(format!(
            "shard.{}",
            i.iter().map(u64::to_string).collect::<Vec<_>>().join(".")
        )),
    }
}

impl ObjectEntry {
    /// Checks the entry against its key (readers call it for every entry of the index).
    ///
    /// # Errors
    /// A description of what is wrong.
    pub fn validate(&self, key: &TensorKey) -> Result<(), String> {
        if self.path != object_path(key) {
            return Err(format!(
                "path {:?} does not follow the key mapping (expected {:?})",
                self.path,
                object_path(key)
            ));
        }
        let (size, ws, grid) = (
            self.size.is_some(),
            self.world_size.is_some(),
            self.grid.is_some(),
        );
        match self.scope {
            StoredScope::Common if size && !ws && !grid => {
                if self.size.is_some_and(|s| s > MAX_OBJECT_BYTES) {
                    return Err(format!("size exceeds {MAX_OBJECT_BYTES} bytes"));
                }
            }
            StoredScope::PerRank if ws && !size && !grid => {
                if self
                    .world_size
                    .is_none_or(|w| w == 0 || w > MAX_OBJECT_SLOTS)
                {
                    return Err(format!("world_size must be 1 to {MAX_OBJECT_SLOTS}"));
                }
            }
            StoredScope::Sharded if grid && !size && !ws => {
                // Invariant: this arm matched `grid`, so the member is present.
                check_grid(key, self.grid.as_deref().unwrap_or_default(), None)
                    .map_err(|e| e.to_string())?;
            }
            s => {
                return Err(format!(
                    "a {} object has exactly the member {}",
                    s.name(),
                    match s {
                        StoredScope::Common => "`size`",
                        StoredScope::PerRank => "`world_size`",
                        StoredScope::Sharded => "`grid`",
                    }
                ));
            }
        }
        Ok(())
    }

    /// Every slot of this object, in order: the common value, each rank's, or each shard's
    /// (grid cells in C order). Lazy: a large grid or world size allocates nothing.
    pub fn slots(&self) -> impl Iterator<Item = ObjectSlot> + '_ {
        // Invariant: entries are validated when the root metadata is parsed (`validate`): a
        // per-rank one has `world_size`, a sharded one a grid whose product fits (`check_grid`).
        let grid: &[u64] = self.grid.as_deref().unwrap_or_default();
        let n = match self.scope {
            StoredScope::Common => 1,
            StoredScope::PerRank => self.world_size.unwrap_or(0),
            StoredScope::Sharded => grid
                .iter()
                .try_fold(1u64, |a, &g| a.checked_mul(g))
                .unwrap_or(0),
        };
        (0..n).map(move |i| match self.scope {
            StoredScope::Common => ObjectSlot::Common,
            StoredScope::PerRank => ObjectSlot::Rank(i),
            StoredScope::Sharded => {
                let mut index = vec![0u64; grid.len()];
                let mut rest = i;
                for (d, &g) in grid.iter().enumerate().rev() {
                    index[d] = rest % g.max(1);
                    rest /= g.max(1);
                }
                ObjectSlot::Shard(index)
            }
        })
    }

    /// True when `slot` is one of this object's values.
    #[must_use]
    pub fn has_slot(&self, slot: &ObjectSlot) -> bool {
        match (self.scope, slot) {
            (StoredScope::Common, ObjectSlot::Common) => true,
            (StoredScope::PerRank, ObjectSlot::Rank(r)) => self.world_size.is_some_and(|w| *r < w),
            (StoredScope::Sharded, ObjectSlot::Shard(i)) => self
                .grid
                .as_ref()
                .is_some_and(|g| i.len() == g.len() && i.iter().zip(g).all(|(i, g)| i < g)),
            _ => false,
        }
    }

    /// The node path of one value's array.
    #[must_use]
    pub fn value_path(&self, slot: &ObjectSlot) -> String {
        match slot_name(slot) {
            None => self.path.clone(),
            Some(n) => format!("{}/{n}", self.path),
        }
    }
}

/// What binds an object value's array to the save that wrote it (format 1.2, spec section
/// 16.3): the save id, and the CRC-32C of the stored bytes (the one its chunk file ends with;
/// 0 for an empty value, which has no chunk file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectBinding {
    /// The save that wrote the value.
    pub save_id: SaveId,
    /// CRC-32C of the stored bytes.
    pub crc32c: u32,
}

/// The `zarr.json` of one object value's array, exactly as zarrckpt writes it (`binding`:
/// format 1.2 and later; `None` gives the 1.1 document).
#[must_use]
pub fn value_metadata(
    key: &TensorKey,
    e: &ObjectEntry,
    slot: &ObjectSlot,
    len: u64,
    binding: Option<ObjectBinding>,
) -> Value {
    let mut attr = json!({
        "kind": "object",
        "key": key.as_str(),
        "scope": e.scope.name(),
        "encoding": e.encoding.name(),
    });
    if let Some(b) = binding {
        attr["save_id"] = json!(b.save_id.hex());
        attr["crc32c"] = json!(b.crc32c);
    }
    match slot {
        ObjectSlot::Common => {}
        ObjectSlot::Rank(r) => attr["rank"] = json!(r),
        ObjectSlot::Shard(i) => {
            attr["grid"] = json!(e.grid);
            attr["index"] = json!(i);
        }
    }
    json!({
        "zarr_format": 3,
        "node_type": "array",
        "shape": [len],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [len.max(1)]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": 0,
        "codecs": [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "crc32c", "configuration": {}}
        ],
        "attributes": {ATTRIBUTE: attr},
    })
}

/// Writes the `zarr.json` of the `objects` group, of every group above an object and of
/// every per-rank or sharded object's own group (one rank, before values are written).
///
/// # Errors
/// I/O errors naming the path.
pub fn write_groups<'a>(
    dir: &Path,
    objects: impl IntoIterator<Item = (&'a TensorKey, &'a ObjectEntry)>,
) -> Result<(), StorageError> {
    write_groups_to(&super::store::LocalStore::new(dir), objects)
}

/// [`write_groups`] into `store` (holding the checkpoint at its root).
///
/// # Errors
/// I/O errors naming the object.
pub fn write_groups_to<'a>(
    store: &dyn Store,
    objects: impl IntoIterator<Item = (&'a TensorKey, &'a ObjectEntry)>,
) -> Result<(), StorageError> {
    let mut groups: BTreeSet<String> = BTreeSet::new();
    for (key, e) in objects {
        let path = object_path(key);
        if e.scope != StoredScope::Common {
            groups.insert(path.clone());
        }
        super::groups::insert_parents(&mut groups, &path);
    }
    let groups: Vec<String> = groups.into_iter().collect();
    super::groups::write_group_documents_to(store, &groups)
}

/// Writes one value: its array's `zarr.json` and, unless it is empty, its one chunk file `c.0`
/// (the bytes followed by their CRC-32C, little endian), each fsynced, then the array's
/// directory. Returns the bytes written to files.
///
/// # Errors
/// I/O errors naming the path.
pub fn write_value(
    dir: &Path,
    key: &TensorKey,
    e: &ObjectEntry,
    slot: &ObjectSlot,
    bytes: &[u8],
    save_id: SaveId,
) -> Result<u64, StorageError> {
    write_value_to(&LocalStore::new(dir), key, e, slot, bytes, save_id)
}

/// [`write_value`] into `store` (holding the checkpoint at its root).
///
/// # Errors
/// I/O errors naming the object.
pub fn write_value_to(
    store: &dyn Store,
    key: &TensorKey,
    e: &ObjectEntry,
    slot: &ObjectSlot,
    bytes: &[u8],
    save_id: SaveId,
) -> Result<u64, StorageError> {
    let adir = e.value_path(slot);
    store.create_prefix(&adir)?;
    let crc = crc32c::crc32c(bytes);
    let binding = ObjectBinding {
        save_id,
        crc32c: crc,
    };
    let doc = value_metadata(key, e, slot, bytes.len() as u64, Some(binding));
    // Invariant: serializing a JSON value (string keys only) cannot fail.
    let doc = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    let write_durable = |name: &str, parts: &[&[u8]]| -> Result<u64, StorageError> {
        let loc = join(&adir, name);
        let mut w = store.put_multipart(&loc)?;
        let iov: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
        w.write_vectored(&iov)?;
        let n = w.written();
        w.finish()?;
        store.sync(&loc)?;
        Ok(n)
    };
    let mut n = write_durable("zarr.json", &[&doc])?;
    if !bytes.is_empty() {
        n += write_durable("c.0", &[bytes, &crc.to_le_bytes()])?;
    }
    store.sync_prefix(&adir)?;
    Ok(n)
}

/// Most bytes of an object value's `zarr.json` a reader reads.
pub const MAX_VALUE_JSON_BYTES: u64 = 1 << 20;

/// Reads one value back, checking its array's `zarr.json` against the index entry, the
/// length (before allocating) and the CRC-32C. With `save_id` (an index of format 1.2 or
/// later: [`super::meta::CheckpointMeta::object_save_id`]), the array's attributes must carry
/// that save id and the CRC-32C its chunk file ends with (spec section 16.5), so that a
/// value of another save is refused, never returned. Returns the stored bytes.
///
/// # Errors
/// [`StorageError::Malformed`] for a `zarr.json` that is not the one prescribed,
/// [`StorageError::MissingChunk`] / [`StorageError::CorruptChunk`] /
/// [`StorageError::Checksum`] for a missing, short or damaged chunk file.
pub fn read_value(
    dir: &Path,
    key: &TensorKey,
    e: &ObjectEntry,
    slot: &ObjectSlot,
    save_id: Option<SaveId>,
) -> Result<Vec<u8>, StorageError> {
    read_value_from(ValueSource::Dir(dir), key, e, slot, save_id)
}

/// Where object values are read from: a checkpoint's directory, or the prefix of a
/// checkpoint in a store without local files (read by whole-object gets).
#[derive(Clone, Copy, Debug)]
pub enum ValueSource<'a> {
    /// A local directory.
    Dir(&'a Path),
    /// The objects of a checkpoint in a store, by location relative to its root.
    Store(&'a dyn CheckpointObjects),
}

/// The whole objects of one checkpoint in a store without local files, by location relative
/// to the checkpoint's root: how object values are read there (a reader over a committed
/// manifest checks each against the manifest's size and crc32c).
pub trait CheckpointObjects: std::fmt::Debug + Sync {
    /// How the object at `rel` is named in messages.
    fn shown(&self, rel: &str) -> std::path::PathBuf;

    /// The whole object at `rel`, of at most `max` bytes.
    ///
    /// # Errors
    /// [`StorageError::TooLarge`] when it is larger; [`StorageError::NotFound`] when absent;
    /// I/O errors naming it.
    fn whole(&self, rel: &str, max: u64) -> Result<Vec<u8>, StorageError>;
}

impl ValueSource<'_> {
    /// The path (or URL) shown for `rel` in errors.
    fn shown(&self, rel: &str) -> std::path::PathBuf {
        match self {
            ValueSource::Dir(d) => d.join(rel),
            ValueSource::Store(s) => s.shown(rel),
        }
    }

    /// The whole object `rel`, of at most `max` bytes (a larger one: [`StorageError::TooLarge`]
    /// from a store, [`StorageError::Malformed`] from a file).
    fn get(&self, rel: &str, max: u64) -> Result<Vec<u8>, StorageError> {
        match self {
            ValueSource::Dir(d) => super::doc::read_metadata_file(&d.join(rel), max),
            ValueSource::Store(s) => s.whole(rel, max),
        }
    }
}

/// The chunk file of an object value of `len` bytes: exactly `len + 4` bytes (the value and
/// its CRC-32C), or `wrong_length` of its length.
fn read_chunk_file(
    path: &Path,
    key: &TensorKey,
    len: u64,
    wrong_length: &dyn Fn(u64) -> StorageError,
) -> Result<Vec<u8>, StorageError> {
    let mut f = match fs::File::open(path) {
        Ok(f) => f,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(StorageError::MissingChunk {
                key: key.to_string(),
                chunk: vec![0],
                path: path.to_owned(),
            });
        }
        Err(err) => return Err(StorageError::io("open", path)(err)),
    };
    let file_len = f.metadata().map_err(StorageError::io("stat", path))?.len();
    if file_len != len + 4 {
        return Err(wrong_length(file_len));
    }
    // `len + 4` equals the file length just checked.
    let mut buf = vec![0u8; crate::model::usize_of(len + 4)];
    f.read_exact(&mut buf)
        .map_err(StorageError::io("read", path))?;
    Ok(buf)
}

/// [`read_value`] from a directory or a store.
///
/// # Errors
/// As [`read_value`].
pub fn read_value_from(
    src: ValueSource<'_>,
    key: &TensorKey,
    e: &ObjectEntry,
    slot: &ObjectSlot,
    save_id: Option<SaveId>,
) -> Result<Vec<u8>, StorageError> {
    let arel = e.value_path(slot);
    let json_rel = join(&arel, "zarr.json");
    let json_path = src.shown(&json_rel);
    let malformed = |reason: String| StorageError::Malformed {
        path: json_path.clone(),
        reason: format!("object `{key}` ({slot}): {reason}"),
    };
    let raw = src.get(&json_rel, MAX_VALUE_JSON_BYTES)?;
    let doc: Value =
        super::doc::parse_json(&raw).map_err(|err| malformed(format!("not JSON: {err}")))?;
    let len = match doc
        .get("shape")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    {
        Some([n]) => n
            .as_u64()
            .ok_or_else(|| malformed("shape is not [length]".into()))?,
        _ => return Err(malformed("shape is not [length]".into())),
    };
    if len > MAX_OBJECT_BYTES {
        return Err(malformed(format!(
            "length {len} exceeds {MAX_OBJECT_BYTES} bytes"
        )));
    }
    if let Some(size) = e.size
        && size != len
    {
        return Err(malformed(format!(
            "length {len} differs from the index's size {size}"
        )));
    }
    let got_attr = doc.get("attributes").and_then(|a| a.get(ATTRIBUTE));
    let binding = match save_id {
        None => None,
        Some(id) => {
            let found = got_attr
                .and_then(|a| a.get("save_id"))
                .and_then(Value::as_str);
            if found != Some(id.hex().as_str()) {
                return Err(malformed(format!(
                    "the value was written by save {}, but the index was committed by save {id} (a mix of two saves, or a save replaced the checkpoint while it was being read)",
                    found.unwrap_or("(none)")
                )));
            }
            let crc = got_attr
                .and_then(|a| a.get("crc32c"))
                .and_then(Value::as_u64)
                .and_then(|c| u32::try_from(c).ok())
                .ok_or_else(|| {
                    malformed("attribute `zarrckpt.crc32c` is not an integer below 2^32".into())
                })?;
            if len == 0 && crc != 0 {
                return Err(malformed(format!(
                    "an empty value has the crc32c 0, the attributes give {crc:#010x}"
                )));
            }
            Some(ObjectBinding {
                save_id: id,
                crc32c: crc,
            })
        }
    };
    let want = value_metadata(key, e, slot, len, binding);
    for member in super::groups::ARRAY_DOC_MEMBERS {
        if doc.get(member) != want.get(member) {
            return Err(malformed(format!(
                "`{member}` is {}, expected {}",
                doc.get(member).unwrap_or(&Value::Null),
                want[member]
            )));
        }
    }
    if doc
        .get("storage_transformers")
        .is_some_and(|s| s.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(malformed("storage_transformers must be empty".into()));
    }
    if let Some(want_attr) = want["attributes"][ATTRIBUTE].as_object() {
        for (k, v) in want_attr {
            if got_attr.and_then(|a| a.get(k)) != Some(v) {
                return Err(malformed(format!("attribute `{ATTRIBUTE}.{k}` is not {v}")));
            }
        }
    }
    if len == 0 {
        return Ok(Vec::new());
    }
    let chunk_rel = join(&arel, "c.0");
    let path = src.shown(&chunk_rel);
    let chunk = vec![0];
    let wrong_length = |file_len: u64| StorageError::CorruptChunk {
        key: key.to_string(),
        chunk: vec![0],
        path: path.clone(),
        detail: format!(
            "object chunk is {file_len} bytes, expected {} (the value and its CRC-32C)",
            len + 4
        ),
    };
    let mut buf = match src {
        ValueSource::Dir(_) => read_chunk_file(&path, key, len, &wrong_length)?,
        ValueSource::Store(..) => match src.get(&chunk_rel, len + 4) {
            Ok(b) if b.len() as u64 == len + 4 => b,
            Ok(b) => return Err(wrong_length(b.len() as u64)),
            Err(StorageError::NotFound { .. }) => {
                return Err(StorageError::MissingChunk {
                    key: key.to_string(),
                    chunk,
                    path,
                });
            }
            Err(StorageError::TooLarge { bytes, .. }) => return Err(wrong_length(bytes)),
            Err(err) => return Err(err),
        },
    };
    let split = buf.len() - 4;
    let stored = u32::from_le_bytes([buf[split], buf[split + 1], buf[split + 2], buf[split + 3]]);
    let computed = crc32c::crc32c(&buf[..split]);
    if stored != computed {
        return Err(StorageError::Checksum {
            key: key.to_string(),
            chunk,
            subchunk: 0,
            path,
            stored,
            computed,
        });
    }
    if let Some(b) = binding
        && b.crc32c != stored
    {
        return Err(StorageError::CorruptChunk {
            key: key.to_string(),
            chunk: vec![0],
            path,
            detail: format!(
                "object value ({slot}): the chunk ends with crc32c {stored:#010x}, but its zarr.json (save {}) gives {:#010x}: the chunk is of another save",
                b.save_id, b.crc32c
            ),
        });
    }
    buf.truncate(split);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_and_paths() {
        let key = TensorKey::new("rng state").unwrap();
        let e = ObjectEntry {
            path: object_path(&key),
            scope: StoredScope::Sharded,
            encoding: Encoding::Bytes,
            size: None,
            world_size: None,
            grid: Some(vec![2, 3]),
        };
        e.validate(&key).unwrap();
        assert_eq!(
            e.value_path(&ObjectSlot::Shard(vec![1, 2])),
            "objects/rng~20state/shard.1.2"
        );
        let slots: Vec<ObjectSlot> = e.slots().collect();
        assert_eq!(slots.len(), 6);
        assert_eq!(slots[4], ObjectSlot::Shard(vec![1, 1]));
        assert!(e.has_slot(&ObjectSlot::Shard(vec![1, 2])));
        assert!(!e.has_slot(&ObjectSlot::Shard(vec![2, 0])));
        assert!(!e.has_slot(&ObjectSlot::Rank(0)));
        let mut bad = e.clone();
        bad.size = Some(3);
        assert!(bad.validate(&key).is_err());
        bad = e.clone();
        bad.grid = Some(vec![0]);
        assert!(bad.validate(&key).is_err());
        bad = e;
        bad.path = "objects/../x".into();
        assert!(bad.validate(&key).is_err());
    }
}
