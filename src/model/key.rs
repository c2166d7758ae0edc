//! Validated tensor keys and the one mapping from keys to paths inside a checkpoint.
//!
//! A key is a name such as `decoder.layers.0.mlp.linear_fc1.weight`. `/` separates levels of a
//! hierarchy (`optimizer/exp_avg/decoder.weight`); dots are ordinary characters. The mapping
//! to a Zarr node path escapes every byte outside `[A-Za-z0-9._-]` as `~XX` (upper-case hex of
//! the UTF-8 byte), so it is injective and the result never leaves the checkpoint directory.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;
/// The longest encoded path segment accepted, in bytes (file systems allow 255).
pub const MAX_SEGMENT_BYTES: usize = 255;

/// Why a key was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    #[error("key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_BYTES`].
    #[error("key `{key}` is {len} bytes long; the limit is {MAX_KEY_BYTES}")]
    TooLong {
        /// The key (truncated for display).
        key: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The key starts with `/`.
    #[error("key `{key}` is absolute (starts with `/`)")]
    Absolute {
        /// The key.
        key: String,
    },
    /// The key has an empty segment (`a//b`) or ends with `/`.
    #[error("key `{key}` has an empty segment")]
    EmptySegment {
        /// The key.
        key: String,
    },
    /// The key has a `.` or `..` segment, or one made only of dots.
    #[error("key `{key}` has a dot segment `{segment}`")]
    DotSegment {
        /// The key.
        key: String,
        /// The offending segment.
        segment: String,
    },
    /// The key contains a control character or a backslash.
    #[error("key `{key}` contains the forbidden character {ch:?}")]
    ForbiddenChar {
        /// The key, with the character escaped.
        key: String,
        /// The character.
        ch: char,
    },
    /// A segment is named `zarr.json` (in any letter case): it would clash with the metadata
    /// file of the group holding it.
    #[error("key `{key}` has the reserved segment `{segment}`")]
    ReservedSegment {
        /// The key.
        key: String,
        /// The segment.
        segment: String,
    },
    /// A segment is too long once encoded as a file name.
    #[error(
        "key `{key}`: segment `{segment}` is {len} bytes once encoded; the limit is {MAX_SEGMENT_BYTES}"
    )]
    SegmentTooLong {
        /// The key.
        key: String,
        /// The segment.
        segment: String,
        /// Its encoded length.
        len: usize,
    },
    /// Two keys map to the same path, or one key's path is inside another's.
    #[error("keys `{first}` and `{second}` collide after mapping to paths ({reason})")]
    Collision {
        /// One key.
        first: String,
        /// The other key.
        second: String,
        /// How they collide.
        reason: &'static str,
    },
}

/// A validated tensor key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TensorKey(String);

impl TensorKey {
    /// Validates `key`.
    ///
    /// # Errors
    /// [`KeyError`] when the key is empty, too long, absolute, has empty or dot segments,
    /// contains control characters or a backslash, or has a segment too long to be a file name.
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        validate(&key)?;
        Ok(TensorKey(key))
    }

    /// The key as given.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key's relative node path below the checkpoint's `tensors` group, e.g.
    /// `optimizer/exp~20avg` for `optimizer/exp avg`.
    #[must_use]
    pub fn node_path(&self) -> String {
        self.0
            .split('/')
            .map(encode_segment)
            .collect::<Vec<_>>()
            .join("/")
    }
}

impl fmt::Display for TensorKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for TensorKey {
    type Error = KeyError;
    fn try_from(s: String) -> Result<Self, KeyError> {
        TensorKey::new(s)
    }
}

impl TryFrom<&str> for TensorKey {
    type Error = KeyError;
    fn try_from(s: &str) -> Result<Self, KeyError> {
        TensorKey::new(s)
    }
}

impl From<TensorKey> for String {
    fn from(k: TensorKey) -> String {
        k.0
    }
}

impl AsRef<str> for TensorKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn shown(key: &str) -> String {
    let mut s: String = key
        .chars()
        .take(120)
        .collect::<String>()
        .escape_debug()
        .to_string();
    if key.chars().count() > 120 {
        s.push('…');
    }
    s
}

fn validate(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong {
            key: shown(key),
            len: key.len(),
        });
    }
    if let Some(ch) = key.chars().find(|c| c.is_control() || *c == '\\') {
        return Err(KeyError::ForbiddenChar {
            key: shown(key),
            ch,
        });
    }
    if key.starts_with('/') {
        return Err(KeyError::Absolute { key: shown(key) });
    }
    for segment in key.split('/') {
        if segment.is_empty() {
            return Err(KeyError::EmptySegment { key: shown(key) });
        }
        if segment.chars().all(|c| c == '.') {
            return Err(KeyError::DotSegment {
                key: shown(key),
                segment: segment.to_owned(),
            });
        }
        if segment.eq_ignore_ascii_case("zarr.json") {
            return Err(KeyError::ReservedSegment {
                key: shown(key),
                segment: segment.to_owned(),
            });
        }
        let len = encode_segment(segment).len();
        if len > MAX_SEGMENT_BYTES {
            return Err(KeyError::SegmentTooLong {
                key: shown(key),
                segment: shown(segment),
                len,
            });
        }
    }
    Ok(())
}

fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// Encodes one key segment as a Zarr node name.
fn encode_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for (i, b) in segment.bytes().enumerate() {
        // Zarr reserves node names starting with `__`: escape the first underscore.
        let reserved = i == 0 && b == b'_' && segment.as_bytes().get(1) == Some(&b'_');
        if is_plain(b) && !reserved {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("~{b:02X}"));
        }
    }
    out
}

/// Checks that no two keys collide once mapped to paths. Identical paths cannot happen (the
/// mapping is injective), but a key's array path may be a group on another key's path
/// (`a` and `a/b`: one node cannot be both), and paths that differ only in letter case would
/// overwrite each other on case-insensitive file systems (`W` and `w`, or `A` and `a/b`).
/// Every array path and every group path above it is compared after lower-casing.
///
/// # Errors
/// [`KeyError::Collision`] naming the first colliding pair found.
pub fn check_collisions<'a>(keys: impl IntoIterator<Item = &'a TensorKey>) -> Result<(), KeyError> {
    // folded path -> (exact path, is_array, a key that needs it)
    let mut nodes: HashMap<String, (String, bool, &TensorKey)> = HashMap::new();
    for key in keys {
        let path = key.node_path();
        let mut prefixes: Vec<(String, bool)> = path
            .match_indices('/')
            .map(|(i, _)| (path[..i].to_owned(), false))
            .collect();
        prefixes.push((path.clone(), true));
        for (p, is_array) in prefixes {
            let folded = p.to_lowercase();
            match nodes.get(&folded) {
                None => {
                    nodes.insert(folded, (p, is_array, key));
                }
                Some((other_path, other_array, other_key)) => {
                    if *other_path == p
                        && *other_array == is_array
                        && (!is_array || *other_key == key)
                    {
                        continue; // the same group, or the same key again
                    }
                    let reason = if *other_path != p {
                        "paths differ only in letter case"
                    } else {
                        "one key's path is a group containing the other"
                    };
                    return Err(KeyError::Collision {
                        first: other_key.to_string(),
                        second: key.to_string(),
                        reason,
                    });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> TensorKey {
        TensorKey::new(s).unwrap()
    }

    #[test]
    fn accepts_real_keys_and_maps_them_readably() {
        assert_eq!(
            k("decoder.layers.0.mlp.linear_fc1.weight").node_path(),
            "decoder.layers.0.mlp.linear_fc1.weight"
        );
        assert_eq!(
            k("optimizer/exp_avg/embedding.weight").node_path(),
            "optimizer/exp_avg/embedding.weight"
        );
        assert_eq!(k("a b/c~d").node_path(), "a~20b/c~7Ed");
        assert_eq!(k("__x").node_path(), "~5F_x");
        assert_eq!(k("_extra_state").node_path(), "_extra_state");
        assert_eq!(k("é").node_path(), "~C3~A9");
    }

    #[test]
    fn rejects_hostile_keys() {
        assert_eq!(TensorKey::new(""), Err(KeyError::Empty));
        assert!(matches!(
            TensorKey::new("/etc/passwd"),
            Err(KeyError::Absolute { .. })
        ));
        assert!(matches!(
            TensorKey::new("a/../../b"),
            Err(KeyError::DotSegment { .. })
        ));
        assert!(matches!(
            TensorKey::new(".."),
            Err(KeyError::DotSegment { .. })
        ));
        assert!(matches!(
            TensorKey::new("a/./b"),
            Err(KeyError::DotSegment { .. })
        ));
        assert!(matches!(
            TensorKey::new("a//b"),
            Err(KeyError::EmptySegment { .. })
        ));
        assert!(matches!(
            TensorKey::new("a/"),
            Err(KeyError::EmptySegment { .. })
        ));
        assert!(matches!(
            TensorKey::new("a\nb"),
            Err(KeyError::ForbiddenChar { ch: '\n', .. })
        ));
        assert!(matches!(
            TensorKey::new("a\0b"),
            Err(KeyError::ForbiddenChar { .. })
        ));
        assert!(matches!(
            TensorKey::new("a\\..\\b"),
            Err(KeyError::ForbiddenChar { .. })
        ));
        assert!(matches!(
            TensorKey::new("x".repeat(2000)),
            Err(KeyError::TooLong { .. })
        ));
        assert!(matches!(
            TensorKey::new("é".repeat(50)),
            Err(KeyError::SegmentTooLong { .. })
        ));
        assert!(matches!(
            TensorKey::new("x/zarr.json"),
            Err(KeyError::ReservedSegment { .. })
        ));
        assert!(matches!(
            TensorKey::new("ZARR.JSON"),
            Err(KeyError::ReservedSegment { .. })
        ));
        TensorKey::new("zarr.json.bak").unwrap();
    }

    #[test]
    fn mapping_is_injective_on_tricky_pairs() {
        let pairs = [("a~20b", "a b"), ("~5F_x", "__x"), ("a.b", "a/b")];
        for (x, y) in pairs {
            assert_ne!(k(x).node_path(), k(y).node_path(), "{x} vs {y}");
        }
    }

    #[test]
    fn detects_collisions() {
        let ok = [k("a.b"), k("a.c"), k("b/x"), k("b/y")];
        check_collisions(&ok).unwrap();
        let nested = [k("a/b"), k("a"), k("c")];
        assert!(matches!(
            check_collisions(&nested),
            Err(KeyError::Collision { .. })
        ));
        let case = [k("Weight"), k("weight")];
        assert!(matches!(
            check_collisions(&case),
            Err(KeyError::Collision { .. })
        ));
        let dup = [k("x"), k("x")];
        check_collisions(&dup).unwrap();
        let groups = [k("g/a"), k("g/b"), k("g/h/c")];
        check_collisions(&groups).unwrap();
        let case_group = [k("A"), k("a/b")];
        assert!(matches!(
            check_collisions(&case_group),
            Err(KeyError::Collision { .. })
        ));
        let case_groups = [k("A/x"), k("a/y")];
        assert!(matches!(
            check_collisions(&case_groups),
            Err(KeyError::Collision { .. })
        ));
        let child_first = [k("a/b"), k("a")];
        assert!(matches!(
            check_collisions(&child_first),
            Err(KeyError::Collision { .. })
        ));
    }

    #[test]
    fn paths_never_escape() {
        for raw in ["a/b/c", "x..y", "...a", "a...", ". a"] {
            if let Ok(key) = TensorKey::new(raw) {
                for seg in key.node_path().split('/') {
                    assert!(!seg.is_empty() && seg != "." && seg != "..", "{raw}");
                    assert!(!seg.starts_with("__"));
                }
            }
        }
    }
}
