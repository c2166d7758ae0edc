//! Non-tensor state: objects (configuration, iteration, RNG state, data-loader position) with
//! their scope (one value for the job, one per rank, or one per shard of a declared grid).
//! Values are JSON or raw bytes; nothing is ever pickled. No I/O.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::key::TensorKey;
use super::region::MAX_DIMS;

/// The largest object value, in bytes (its stored form: UTF-8 JSON text or the raw bytes).
/// Larger state belongs in tensors. Readers refuse larger sizes before allocating.
pub const MAX_OBJECT_BYTES: u64 = 1 << 30;
/// The most shards a sharded object's grid may have, and the most ranks a per-rank object
/// may have values for.
pub const MAX_OBJECT_SLOTS: u64 = 1 << 24;

/// What is wrong with an object a caller handed in or asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ObjectError {
    /// The key is invalid.
    #[error(transparent)]
    Key(#[from] super::key::KeyError),
    /// A sharded object's grid is empty, has a zero extent, too many dimensions or too many
    /// shards, or its index is outside the grid.
    #[error("object `{key}`: shard index {index:?} in grid {grid:?}: {reason}")]
    BadGrid {
        /// The object.
        key: TensorKey,
        /// The declared grid.
        grid: Vec<u64>,
        /// The declared index.
        index: Vec<u64>,
        /// What is wrong.
        reason: &'static str,
    },
    /// The value is larger than [`MAX_OBJECT_BYTES`].
    #[error("object `{key}`: {len} bytes exceed the limit of {MAX_OBJECT_BYTES} bytes")]
    TooLarge {
        /// The object.
        key: TensorKey,
        /// Its stored length.
        len: u64,
    },
    /// This rank declares the same object key twice.
    #[error("object `{key}` is declared twice on this rank")]
    Duplicate {
        /// The object.
        key: TensorKey,
    },
    /// A JSON value nests arrays and objects deeper than readers parse
    /// ([`super::json::MAX_JSON_DEPTH`]).
    #[error(
        "object `{key}`: the JSON value nests {depth} levels deep, more than the {} a reader parses",
        super::json::MAX_JSON_DEPTH
    )]
    TooDeep {
        /// The object.
        key: TensorKey,
        /// Its depth.
        depth: usize,
    },
    /// A stored JSON value is not valid UTF-8 JSON.
    #[error("object `{key}`: the stored value is not valid JSON: {reason}")]
    BadJson {
        /// The object.
        key: TensorKey,
        /// The parser's message.
        reason: String,
    },
}

/// How an object's value is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 JSON text.
    Json,
    /// Raw bytes, stored as given.
    Bytes,
}

impl Encoding {
    /// The name used in metadata: `json` or `bytes`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Json => "json",
            Encoding::Bytes => "bytes",
        }
    }
}

/// An object's value: JSON, or raw bytes (an RNG state, a serialized data-loader position).
#[derive(Debug, Clone, PartialEq)]
pub enum ObjectValue {
    /// A JSON value, stored as UTF-8 JSON text.
    Json(serde_json::Value),
    /// Raw bytes, stored as they are.
    Bytes(Vec<u8>),
}

impl ObjectValue {
    /// How this value is stored.
    #[must_use]
    pub fn encoding(&self) -> Encoding {
        match self {
            ObjectValue::Json(_) => Encoding::Json,
            ObjectValue::Bytes(_) => Encoding::Bytes,
        }
    }

    /// The stored bytes: canonical JSON text (object members sorted by key, no whitespace)
    /// or the raw bytes. Equal values give equal bytes on every rank.
    #[must_use]
    pub fn to_stored(&self) -> Vec<u8> {
        match self {
            ObjectValue::Json(v) => {
                let mut out = Vec::new();
                canonical_json(v, &mut out);
                out
            }
            ObjectValue::Bytes(b) => b.clone(),
        }
    }

    /// Decodes stored bytes of the given encoding.
    ///
    /// # Errors
    /// [`ObjectError::BadJson`] when JSON bytes do not parse.
    pub fn from_stored(
        key: &TensorKey,
        encoding: Encoding,
        bytes: Vec<u8>,
    ) -> Result<Self, ObjectError> {
        match encoding {
            Encoding::Bytes => Ok(ObjectValue::Bytes(bytes)),
            Encoding::Json => super::json::parse_strict(&bytes)
                .map(ObjectValue::Json)
                .map_err(|reason| ObjectError::BadJson {
                    key: key.clone(),
                    reason,
                }),
        }
    }

    /// The JSON value, if this is one.
    #[must_use]
    pub fn as_json(&self) -> Option<&serde_json::Value> {
        match self {
            ObjectValue::Json(v) => Some(v),
            ObjectValue::Bytes(_) => None,
        }
    }

    /// The bytes, if this is a bytes value.
    #[must_use]
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            ObjectValue::Bytes(b) => Some(b),
            ObjectValue::Json(_) => None,
        }
    }
}

impl From<serde_json::Value> for ObjectValue {
    fn from(v: serde_json::Value) -> Self {
        ObjectValue::Json(v)
    }
}

impl From<Vec<u8>> for ObjectValue {
    fn from(v: Vec<u8>) -> Self {
        ObjectValue::Bytes(v)
    }
}

/// Writes `v` as JSON text with object members sorted by key (byte order) and no whitespace,
/// whatever order the map kept them in.
fn canonical_json(v: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            let mut members: Vec<(&String, &Value)> = m.iter().collect();
            members.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(
                    serde_json::to_string(k)
                        .unwrap_or_else(|_| "\"\"".into())
                        .as_bytes(),
                );
                out.push(b':');
                canonical_json(v, out);
            }
            out.push(b'}');
        }
        Value::Array(a) => {
            out.push(b'[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_json(v, out);
            }
            out.push(b']');
        }
        // Scalars serialize the same whatever the map order feature: no members inside.
        other => out.extend_from_slice(
            serde_json::to_string(other)
                .unwrap_or_else(|_| "null".into())
                .as_bytes(),
        ),
    }
}

/// Who holds an object's value(s).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ObjectScope {
    /// One value for the whole job (configuration, iteration, scheduler state). Every rank
    /// that declares it must declare the same value; one rank writes it.
    Common,
    /// One value per rank (RNG state, data-loader position). Every rank declares it; each
    /// writes its own; each loads its own back.
    PerRank,
    /// One value per cell of a declared grid (Megatron's `ShardedObject`), e.g. one per
    /// pipeline stage. Ranks declaring the same index are replicas (they must agree); the
    /// lowest of them writes it. Every index of the grid must be declared by some rank.
    Sharded {
        /// The grid's extent per dimension (1 to 32 dimensions, each at least 1).
        grid: Vec<u64>,
        /// This rank's shard index within the grid.
        index: Vec<u64>,
    },
}

impl ObjectScope {
    /// The scope's name in metadata: `common`, `per_rank` or `sharded`.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            ObjectScope::Common => "common",
            ObjectScope::PerRank => "per_rank",
            ObjectScope::Sharded { .. } => "sharded",
        }
    }
}

/// Checks a sharded object's grid and index.
///
/// # Errors
/// [`ObjectError::BadGrid`] naming what is wrong.
pub fn check_grid(key: &TensorKey, grid: &[u64], index: Option<&[u64]>) -> Result<(), ObjectError> {
    let bad = |reason| ObjectError::BadGrid {
        key: key.clone(),
        grid: grid.to_vec(),
        // A grid without an index is reported with an empty one.
        index: index.map(<[u64]>::to_vec).unwrap_or_default(),
        reason,
    };
    if grid.is_empty() || grid.len() > MAX_DIMS {
        return Err(bad("a grid has 1 to 32 dimensions"));
    }
    if grid.contains(&0) {
        return Err(bad("every grid extent must be at least 1"));
    }
    let n = grid.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    if n.is_none_or(|n| n > MAX_OBJECT_SLOTS) {
        return Err(bad("the grid has more than 2^24 shards"));
    }
    if let Some(index) = index
        && (index.len() != grid.len() || index.iter().zip(grid).any(|(i, g)| i >= g))
    {
        return Err(bad("the index is outside the grid"));
    }
    Ok(())
}

/// The linear (C-order) position of `index` in `grid`; both already checked.
#[must_use]
pub fn linear_index(grid: &[u64], index: &[u64]) -> u64 {
    grid.iter().zip(index).fold(0u64, |acc, (g, i)| acc * g + i)
}

/// One object a rank declares at save time (and, in a state dict, the shape of what it asks
/// for at load time).
#[derive(Debug, Clone, PartialEq)]
pub struct StateObject {
    key: TensorKey,
    scope: ObjectScope,
    value: ObjectValue,
}

impl StateObject {
    fn build(key: &str, scope: ObjectScope, value: ObjectValue) -> Result<Self, ObjectError> {
        let key = TensorKey::new(key)?;
        if let ObjectScope::Sharded { grid, index } = &scope {
            check_grid(&key, grid, Some(index))?;
        }
        if let ObjectValue::Json(v) = &value {
            let depth = super::json::depth(v);
            if depth > super::json::MAX_JSON_DEPTH {
                return Err(ObjectError::TooDeep { key, depth });
            }
        }
        let obj = StateObject { key, scope, value };
        obj.check_size()?;
        Ok(obj)
    }

    fn check_size(&self) -> Result<(), ObjectError> {
        let len = match &self.value {
            ObjectValue::Bytes(b) => b.len() as u64,
            ObjectValue::Json(_) => self.value.to_stored().len() as u64,
        };
        if len > MAX_OBJECT_BYTES {
            return Err(ObjectError::TooLarge {
                key: self.key.clone(),
                len,
            });
        }
        Ok(())
    }

    /// A common object: one value for the whole job.
    ///
    /// # Errors
    /// [`ObjectError`] for an invalid key or a value over [`MAX_OBJECT_BYTES`].
    pub fn common(key: &str, value: impl Into<ObjectValue>) -> Result<Self, ObjectError> {
        Self::build(key, ObjectScope::Common, value.into())
    }

    /// A per-rank object: this rank's own value.
    ///
    /// # Errors
    /// As [`StateObject::common`].
    pub fn per_rank(key: &str, value: impl Into<ObjectValue>) -> Result<Self, ObjectError> {
        Self::build(key, ObjectScope::PerRank, value.into())
    }

    /// One shard of a sharded object: the value at `index` of `grid`.
    ///
    /// # Errors
    /// As [`StateObject::common`], plus [`ObjectError::BadGrid`] for a malformed grid or an
    /// index outside it.
    pub fn sharded(
        key: &str,
        grid: &[u64],
        index: &[u64],
        value: impl Into<ObjectValue>,
    ) -> Result<Self, ObjectError> {
        Self::build(
            key,
            ObjectScope::Sharded {
                grid: grid.to_vec(),
                index: index.to_vec(),
            },
            value.into(),
        )
    }

    /// The same object under another key (used when a state dict is flattened).
    #[must_use]
    pub fn with_key(mut self, key: TensorKey) -> Self {
        self.key = key;
        self
    }

    /// The key.
    #[must_use]
    pub fn key(&self) -> &TensorKey {
        &self.key
    }
    /// The scope.
    #[must_use]
    pub fn scope(&self) -> &ObjectScope {
        &self.scope
    }
    /// The value.
    #[must_use]
    pub fn value(&self) -> &ObjectValue {
        &self.value
    }
    /// Replaces the value (a load fills state-dict objects in place).
    pub fn set_value(&mut self, value: ObjectValue) {
        self.value = value;
    }
}

/// Which stored value of an object: the common one, rank `r`'s, or the shard at an index.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ObjectSlot {
    /// The value of a common object.
    Common,
    /// The value rank `r` saved for a per-rank object.
    Rank(u64),
    /// The value at this index of a sharded object's grid.
    Shard(Vec<u64>),
}

impl fmt::Display for ObjectSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ObjectSlot::Common => f.write_str("common"),
            ObjectSlot::Rank(r) => write!(f, "rank {r}"),
            ObjectSlot::Shard(i) => write!(f, "shard {i:?}"),
        }
    }
}

/// An object a rank asks for at load time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRequest {
    /// The key.
    pub key: TensorKey,
    /// Which stored value.
    pub slot: ObjectSlot,
    /// For a shard: the grid the caller expects; a checkpoint with another grid is an error
    /// (a shard index means something else in another grid). `None` skips the check.
    pub grid: Option<Vec<u64>>,
}

impl ObjectRequest {
    /// Asks for the value of a common object.
    ///
    /// # Errors
    /// [`ObjectError::Key`] for an invalid key.
    pub fn common(key: &str) -> Result<Self, ObjectError> {
        Ok(ObjectRequest {
            key: TensorKey::new(key)?,
            slot: ObjectSlot::Common,
            grid: None,
        })
    }

    /// Asks for the value rank `rank` saved for a per-rank object.
    ///
    /// # Errors
    /// [`ObjectError::Key`] for an invalid key.
    pub fn rank(key: &str, rank: u64) -> Result<Self, ObjectError> {
        Ok(ObjectRequest {
            key: TensorKey::new(key)?,
            slot: ObjectSlot::Rank(rank),
            grid: None,
        })
    }

    /// Asks for the shard at `index` of a sharded object saved with grid `grid`.
    ///
    /// # Errors
    /// [`ObjectError`] for an invalid key, grid or index.
    pub fn shard(key: &str, grid: &[u64], index: &[u64]) -> Result<Self, ObjectError> {
        let key = TensorKey::new(key)?;
        check_grid(&key, grid, Some(index))?;
        Ok(ObjectRequest {
            key,
            slot: ObjectSlot::Shard(index.to_vec()),
            grid: Some(grid.to_vec()),
        })
    }

    /// What a state-dict object asks for when loaded on `rank`: the same scope, this rank's
    /// own value for a per-rank object.
    #[must_use]
    pub fn for_object(obj: &StateObject, rank: u64) -> Self {
        let (slot, grid) = match obj.scope() {
            ObjectScope::Common => (ObjectSlot::Common, None),
            ObjectScope::PerRank => (ObjectSlot::Rank(rank), None),
            ObjectScope::Sharded { grid, index } => {
                (ObjectSlot::Shard(index.clone()), Some(grid.clone()))
            }
        };
        ObjectRequest {
            key: obj.key().clone(),
            slot,
            grid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_json_sorts_members_and_round_trips() {
        let v = json!({"b": [1, 2.5, "x\"y"], "a": {"z": null, "c": true}});
        let s = ObjectValue::Json(v.clone()).to_stored();
        assert_eq!(
            std::str::from_utf8(&s).unwrap(),
            r#"{"a":{"c":true,"z":null},"b":[1,2.5,"x\"y"]}"#
        );
        let k = TensorKey::new("k").unwrap();
        assert_eq!(
            ObjectValue::from_stored(&k, Encoding::Json, s).unwrap(),
            ObjectValue::Json(v)
        );
        assert!(matches!(
            ObjectValue::from_stored(&k, Encoding::Json, b"{nope".to_vec()),
            Err(ObjectError::BadJson { .. })
        ));
    }

    #[test]
    fn grids_are_checked() {
        StateObject::sharded("s", &[2, 3], &[1, 2], vec![1u8]).unwrap();
        for (grid, index) in [
            (vec![], vec![]),
            (vec![0], vec![0]),
            (vec![2], vec![2]),
            (vec![2, 2], vec![1]),
            (vec![1 << 13, 1 << 12], vec![0, 0]),
        ] {
            let e = StateObject::sharded("s", &grid, &index, vec![1u8]).unwrap_err();
            assert!(matches!(e, ObjectError::BadGrid { .. }), "{grid:?}: {e}");
        }
        assert_eq!(linear_index(&[2, 3], &[1, 2]), 5);
        assert!(StateObject::common("../x", json!(1)).is_err());
    }
}
