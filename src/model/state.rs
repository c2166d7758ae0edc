//! Nested state dicts: maps and lists whose leaves are tensor pieces (to save), load targets
//! (to fill), objects or JSON scalars, and their flattening to keys (spec § "State dicts").
//!
//! **The flattening.** A leaf's key is the `/`-joined path from the root: map keys as they
//! are, list positions as decimal numbers (`optimizer/param_groups/0/lr`). `/` is the key
//! hierarchy separator (section 3), so framework names with dots
//! (`decoder.layers.0.mlp.weight`) stay single segments and each nesting level becomes a Zarr
//! group. A map key that is empty or contains `/` is an error (never escaped), and so is a
//! path that is not a valid key; two paths can therefore never map to one key (checked
//! anyway, naming both). Empty maps and lists hold no leaf and are not stored. Given the
//! nested structure (which a load supplies), the mapping is reversed by splitting at `/`.
//!
//! Pure: no I/O. The front doors are [`crate::save_state`] and [`crate::load_state`].

use std::collections::{BTreeMap, HashMap};

use super::dtype::DType;
use super::key::{KeyError, TensorKey};
use super::object::{ObjectError, StateObject};
use super::tensor::{LoadTarget, ShardedTensor, TensorError};

/// The separator of flattened state-dict paths.
pub const SEPARATOR: char = '/';

/// What is wrong with a state dict.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// A map key is empty or contains the separator `/`.
    #[error("state dict path `{path}`: map key {segment:?} {reason}")]
    BadSegment {
        /// The path of the map holding the key.
        path: String,
        /// The map key.
        segment: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A flattened path is not a valid key.
    #[error("state dict path `{path}` is not a valid key: {source}")]
    Key {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: KeyError,
    },
    /// Two nested paths map to one key.
    #[error("state dict paths {first} and {second} both map to the key `{key}`")]
    Collision {
        /// The key.
        key: TensorKey,
        /// One path, shown as nested segments.
        first: String,
        /// The other.
        second: String,
    },
    /// A leaf of a kind this operation does not take (a load target in a save, a tensor
    /// piece in a load).
    #[error("state dict key `{key}`: {found} leaf where {wanted} is expected")]
    WrongLeaf {
        /// The flattened key.
        key: TensorKey,
        /// The leaf's kind.
        found: &'static str,
        /// What the operation takes.
        wanted: &'static str,
    },
    /// An object leaf is invalid.
    #[error(transparent)]
    Object(#[from] ObjectError),
}

/// One node of a state dict.
#[derive(Debug)]
pub enum StateValue<'a> {
    /// A map from names to nodes.
    Map(BTreeMap<String, StateValue<'a>>),
    /// A list of nodes; positions become decimal path segments.
    List(Vec<StateValue<'a>>),
    /// A piece of a global tensor to save (its own key is replaced by its path).
    Tensor(ShardedTensor<'a>),
    /// A piece of a global tensor to load into (its own key is replaced by its path).
    Target(LoadTarget<'a>),
    /// An object (common, per-rank or sharded; its own key is replaced by its path). A load
    /// replaces its value with the stored one.
    Object(StateObject),
    /// A JSON value, stored as a common object. A load replaces it with the stored one.
    Scalar(serde_json::Value),
}

impl StateValue<'_> {
    /// The kind of node, for messages.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            StateValue::Map(_) => "a map",
            StateValue::List(_) => "a list",
            StateValue::Tensor(_) => "a tensor piece",
            StateValue::Target(_) => "a load target",
            StateValue::Object(_) => "an object",
            StateValue::Scalar(_) => "a scalar",
        }
    }
}

impl<'a> From<ShardedTensor<'a>> for StateValue<'a> {
    fn from(t: ShardedTensor<'a>) -> Self {
        StateValue::Tensor(t)
    }
}
impl<'a> From<LoadTarget<'a>> for StateValue<'a> {
    fn from(t: LoadTarget<'a>) -> Self {
        StateValue::Target(t)
    }
}
impl From<StateObject> for StateValue<'_> {
    fn from(o: StateObject) -> Self {
        StateValue::Object(o)
    }
}
impl From<serde_json::Value> for StateValue<'_> {
    fn from(v: serde_json::Value) -> Self {
        StateValue::Scalar(v)
    }
}
impl<'a> From<StateDict<'a>> for StateValue<'a> {
    fn from(d: StateDict<'a>) -> Self {
        StateValue::Map(d.root)
    }
}
impl<'a> From<Vec<StateValue<'a>>> for StateValue<'a> {
    fn from(v: Vec<StateValue<'a>>) -> Self {
        StateValue::List(v)
    }
}

/// A nested state dict (the root map).
///
/// ```
/// use zarrckpt::{ShardedTensor, StateDict, StateObject};
/// let w = [1f32, 2.0];
/// let mut sd = StateDict::new();
/// sd.insert("model", StateDict::new().with("decoder.weight",
///     ShardedTensor::from_slice("w", &[2], &[0], &w, &[2], 0).unwrap()));
/// sd.insert("iteration", serde_json::json!(100));
/// sd.insert("rng", StateObject::per_rank("rng", vec![7u8; 4]).unwrap());
/// let keys: Vec<String> = sd.flatten().unwrap().iter().map(|(k, _)| k.to_string()).collect();
/// assert_eq!(keys, ["iteration", "model/decoder.weight", "rng"]);
/// ```
#[derive(Debug, Default)]
pub struct StateDict<'a> {
    root: BTreeMap<String, StateValue<'a>>,
}

/// A path as nested segments, for messages: `["optimizer"]["state"][0]`.
fn show_path(segments: &[Seg<'_>]) -> String {
    segments
        .iter()
        .map(|s| match s {
            Seg::Key(k) => format!("[{k:?}]"),
            Seg::Index(i) => format!("[{i}]"),
        })
        .collect()
}

#[derive(Clone, Copy)]
enum Seg<'s> {
    Key(&'s str),
    Index(usize),
}

impl Seg<'_> {
    fn text(self) -> String {
        match self {
            Seg::Key(k) => k.to_owned(),
            Seg::Index(i) => i.to_string(),
        }
    }
}

fn joined(segments: &[Seg<'_>]) -> String {
    segments
        .iter()
        .map(|s| s.text())
        .collect::<Vec<_>>()
        .join("/")
}

fn check_segment(path: &[Seg<'_>], k: &str) -> Result<(), StateError> {
    let reason = if k.is_empty() {
        "is empty"
    } else if k.contains(SEPARATOR) {
        "contains the separator `/`"
    } else {
        return Ok(());
    };
    Err(StateError::BadSegment {
        path: joined(path),
        segment: k.to_owned(),
        reason,
    })
}

/// Visits the leaves in path order, with shared or exclusive access.
macro_rules! walk_impl {
    ($name:ident, $($mutability:tt)?) => {
        fn $name<'s, 'a>(
            v: &'s $($mutability)? StateValue<'a>,
            path: &mut Vec<Seg<'s>>,
            seen: &mut HashMap<TensorKey, String>,
            out: &mut Vec<(TensorKey, &'s $($mutability)? StateValue<'a>)>,
        ) -> Result<(), StateError> {
            match v {
                StateValue::Map(m) => {
                    for (k, child) in m {
                        check_segment(path, k)?;
                        path.push(Seg::Key(k));
                        $name(child, path, seen, out)?;
                        path.pop();
                    }
                }
                StateValue::List(l) => {
                    for (i, child) in l.into_iter().enumerate() {
                        path.push(Seg::Index(i));
                        $name(child, path, seen, out)?;
                        path.pop();
                    }
                }
                leaf => {
                    let flat = joined(path);
                    let key = TensorKey::new(flat.clone())
                        .map_err(|source| StateError::Key { path: flat, source })?;
                    let shown = show_path(path);
                    if let Some(first) = seen.insert(key.clone(), shown.clone()) {
                        return Err(StateError::Collision {
                            key,
                            first,
                            second: shown,
                        });
                    }
                    out.push((key, leaf));
                }
            }
            Ok(())
        }
    };
}
walk_impl!(walk,);
walk_impl!(walk_mut, mut);

impl<'a> StateDict<'a> {
    /// An empty state dict.
    #[must_use]
    pub fn new() -> Self {
        StateDict::default()
    }

    /// Inserts a node under `name`, replacing any node there.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<StateValue<'a>>) {
        self.root.insert(name.into(), value.into());
    }

    /// Builder form of [`StateDict::insert`].
    #[must_use]
    pub fn with(mut self, name: impl Into<String>, value: impl Into<StateValue<'a>>) -> Self {
        self.insert(name, value);
        self
    }

    /// The node under `name`.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&StateValue<'a>> {
        self.root.get(name)
    }

    /// The node at a flattened path (`optimizer/state/0/step`), if there is one.
    #[must_use]
    pub fn get_path(&self, path: &str) -> Option<&StateValue<'a>> {
        let mut parts = path.split(SEPARATOR);
        let mut node = self.root.get(parts.next()?)?;
        for p in parts {
            node = match node {
                StateValue::Map(m) => m.get(p)?,
                StateValue::List(l) => l.get(p.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        Some(node)
    }

    /// The root map.
    #[must_use]
    pub fn as_map(&self) -> &BTreeMap<String, StateValue<'a>> {
        &self.root
    }

    /// The leaves with their flattened keys, in key order of the nesting (maps sorted by
    /// key, lists in order).
    ///
    /// # Errors
    /// [`StateError`] for a bad map key, an invalid flattened key or a collision.
    pub fn flatten(&self) -> Result<Vec<(TensorKey, &StateValue<'a>)>, StateError> {
        let mut out = Vec::new();
        let mut seen = HashMap::new();
        for (k, v) in &self.root {
            check_segment(&[], k)?;
            walk(v, &mut vec![Seg::Key(k)], &mut seen, &mut out)?;
        }
        Ok(out)
    }

    /// As [`StateDict::flatten`], with the leaves mutable (a load fills them).
    ///
    /// # Errors
    /// As [`StateDict::flatten`].
    pub fn flatten_mut(&mut self) -> Result<Vec<(TensorKey, &mut StateValue<'a>)>, StateError> {
        let mut out = Vec::new();
        let mut seen = HashMap::new();
        for (k, v) in &mut self.root {
            check_segment(&[], k)?;
            walk_mut(v, &mut vec![Seg::Key(k)], &mut seen, &mut out)?;
        }
        Ok(out)
    }
}

impl<'a> ShardedTensor<'a> {
    /// A piece of another tensor laid out like `like`: the same global shape, box or flat
    /// range, and replica (id or automatic), with its own key, data type and data. Optimizer
    /// state (Adam moments, fp32 master weights) declared this way reshards with its parameter.
    ///
    /// # Errors
    /// [`TensorError`] for an invalid key or when `data` is not the piece's size in `dtype`.
    pub fn like(
        like: &ShardedTensor<'_>,
        key: &str,
        dtype: DType,
        data: &'a [u8],
    ) -> Result<Self, TensorError> {
        like.laid_out_for(TensorKey::new(key)?, dtype, data)
    }

    /// The same piece under another key (a state dict's flattened path).
    ///
    /// # Errors
    /// [`TensorError`] only if the piece was invalid to begin with.
    pub fn rekeyed(&self, key: TensorKey) -> Result<Self, TensorError> {
        self.laid_out_for(key, self.dtype(), self.data())
    }

    /// A piece with this one's layout (global shape, box or flat range, replica) for `key`.
    fn laid_out_for<'d>(
        &self,
        key: TensorKey,
        dtype: DType,
        data: &'d [u8],
    ) -> Result<ShardedTensor<'d>, TensorError> {
        let shape = self.global_shape().to_vec();
        let piece = match self.flat_range() {
            Some(range) => ShardedTensor::from_flat(key, dtype, shape, range, 0, data)?,
            None => ShardedTensor::new(key, dtype, shape, self.region().clone(), 0, data)?,
        };
        Ok(piece.with_replica(self.replica()))
    }
}

impl<'a> LoadTarget<'a> {
    /// A request laid out like `like` (same global shape, box or flat range) for another
    /// tensor with its own key, data type and buffer: how optimizer state is loaded with its
    /// parameter. The conversion setting is not copied: set it with [`LoadTarget::with_cast`].
    ///
    /// # Errors
    /// [`TensorError`] for an invalid key or when `buf` is not the request's size in `dtype`.
    pub fn like(
        like: &LoadTarget<'_>,
        key: &str,
        dtype: DType,
        buf: &'a mut [u8],
    ) -> Result<Self, TensorError> {
        laid_out(like, TensorKey::new(key)?, dtype, buf)
    }

    /// The same request under another key, borrowing this target's buffer (conversion
    /// setting included).
    ///
    /// # Errors
    /// [`TensorError`] only if the target was invalid to begin with.
    pub fn rekeyed(&mut self, key: TensorKey) -> Result<LoadTarget<'_>, TensorError> {
        let (dtype, cast) = (self.dtype(), self.cast());
        let (shape, region, flat) = (
            self.global_shape().to_vec(),
            self.region().clone(),
            self.flat_range(),
        );
        let buf = self.buf_mut();
        let t = match flat {
            Some(range) => LoadTarget::from_flat(key, dtype, shape, range, buf)?,
            None => LoadTarget::new(key, dtype, shape, region, buf)?,
        };
        Ok(t.with_cast(cast))
    }
}

/// A request with `like`'s layout (global shape, box or flat range) for `key`.
fn laid_out<'b>(
    like: &LoadTarget<'_>,
    key: TensorKey,
    dtype: DType,
    buf: &'b mut [u8],
) -> Result<LoadTarget<'b>, TensorError> {
    let shape = like.global_shape().to_vec();
    match like.flat_range() {
        Some(range) => LoadTarget::from_flat(key, dtype, shape, range, buf),
        None => LoadTarget::new(key, dtype, shape, like.region().clone(), buf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flattens_with_slashes_and_decimal_indices() {
        let w = [1u16, 2];
        let piece = ShardedTensor::from_slice("x", &[2], &[0], &w, &[2], 0).unwrap();
        let mut sd = StateDict::new();
        sd.insert(
            "optimizer",
            StateDict::new().with(
                "param_groups",
                vec![
                    StateValue::from(json!({"lr": 0.1})),
                    StateValue::from(StateDict::new().with("lr", json!(0.2))),
                ],
            ),
        );
        sd.insert("model", StateDict::new().with("decoder.layers.0.w", piece));
        sd.insert("empty", StateDict::new());
        let keys: Vec<String> = sd
            .flatten()
            .unwrap()
            .into_iter()
            .map(|(k, _)| k.to_string())
            .collect();
        assert_eq!(
            keys,
            [
                "model/decoder.layers.0.w",
                "optimizer/param_groups/0",
                "optimizer/param_groups/1/lr"
            ]
        );
        assert!(matches!(
            sd.get_path("optimizer/param_groups/1/lr"),
            Some(StateValue::Scalar(v)) if v == &json!(0.2)
        ));
        assert!(sd.get_path("optimizer/param_groups/7").is_none());
    }

    #[test]
    fn rejects_bad_segments() {
        for bad in ["", "a/b"] {
            let sd = StateDict::new().with("m", StateDict::new().with(bad, json!(1)));
            let e = sd.flatten().unwrap_err();
            assert!(matches!(e, StateError::BadSegment { .. }), "{e}");
            assert!(e.to_string().contains("`m`"), "{e}");
        }
        let sd = StateDict::new().with("..", json!(1));
        assert!(matches!(sd.flatten(), Err(StateError::Key { .. })));
        let sd = StateDict::new().with("a", StateDict::new().with("zarr.json", json!(1)));
        assert!(matches!(sd.flatten(), Err(StateError::Key { .. })));
    }

    #[test]
    fn like_keeps_flat_ranges_replicas_and_casts() {
        use crate::model::{Cast, Replica};
        let w = [1u16, 2, 3];
        let m = [0f32; 3];
        let p = ShardedTensor::from_flat_slice("w", &[2, 4], 2..5, &w, 0)
            .unwrap()
            .with_replica(Replica::Auto);
        let like = ShardedTensor::like(&p, "m", DType::Float32, crate::model::dtype::as_bytes(&m))
            .unwrap();
        assert_eq!(like.flat_range(), Some(2..5));
        assert_eq!(like.replica(), Replica::Auto);
        assert_eq!(
            like.rekeyed(TensorKey::new("n").unwrap())
                .unwrap()
                .flat_range(),
            Some(2..5)
        );
        let mut wb = [0u16; 3];
        let mut mb = [0f32; 3];
        let mut t = LoadTarget::from_flat_slice("w", &[2, 4], 2..5, &mut wb)
            .unwrap()
            .with_cast(Cast::FloatConvert);
        let lt = LoadTarget::like(
            &t,
            "m",
            DType::Float32,
            crate::model::dtype::as_bytes_mut(&mut mb),
        )
        .unwrap();
        assert_eq!(lt.flat_range(), Some(2..5));
        let r = t.rekeyed(TensorKey::new("x").unwrap()).unwrap();
        assert_eq!((r.flat_range(), r.cast()), (Some(2..5), Cast::FloatConvert));
    }

    #[test]
    fn like_keeps_the_parameters_layout() {
        let w = [0u16; 6];
        let p = ShardedTensor::from_slice("w", &[4, 3], &[2, 0], &w, &[2, 3], 1).unwrap();
        let m = [0f32; 6];
        let s = ShardedTensor::like(
            &p,
            "exp_avg",
            DType::Float32,
            crate::model::dtype::as_bytes(&m),
        )
        .unwrap();
        assert_eq!(
            (s.global_shape(), s.region(), s.replica_id(), s.dtype()),
            (p.global_shape(), p.region(), 1, DType::Float32)
        );
        let short = [0f32; 5];
        assert!(
            ShardedTensor::like(
                &p,
                "exp_avg",
                DType::Float32,
                crate::model::dtype::as_bytes(&short)
            )
            .is_err()
        );
    }
}
