//! What one rank saves, as one value: [`SaveRequest`].

use std::sync::Arc;

use crate::device::{Device, DevicePiece};
use crate::error::Result;
use crate::model::state::{StateDict, StateError, StateValue};
use crate::model::{ShardedTensor, StateObject};

/// Everything one rank saves in one checkpoint: tensor pieces in host memory, tensor pieces
/// in device memory (with the [`Device`] that reads them), and objects (non-tensor state).
/// [`crate::Saver::save`] and [`crate::Saver::save_async`] take it; so does
/// [`crate::CheckpointManager`].
///
/// Every rank of a save passes objects (possibly none: [`SaveRequest::with_objects`] with an
/// empty list), or no rank does: the two run different collectives. A request built from a
/// nested state dict ([`SaveRequest::from_state`]) always has objects.
///
/// ```
/// use zarrckpt::{SaveRequest, ShardedTensor, StateObject};
///
/// let w = vec![0f32; 6];
/// let piece = ShardedTensor::from_slice("w", &[2, 3], &[0, 0], &w, &[2, 3], 0)?;
/// let request = SaveRequest::new()
///     .with_tensors([piece])
///     .with_objects([StateObject::common("iteration", serde_json::json!(100))?]);
/// assert_eq!(request.tensors().len(), 1);
/// # Ok::<(), zarrckpt::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct SaveRequest<'a> {
    pub(crate) tensors: Vec<ShardedTensor<'a>>,
    pub(crate) device: Option<Arc<dyn Device>>,
    pub(crate) device_tensors: Vec<DevicePiece>,
    pub(crate) objects: Option<Vec<StateObject>>,
}

impl<'a> SaveRequest<'a> {
    /// An empty request (no tensors, no objects).
    #[must_use]
    pub fn new() -> Self {
        SaveRequest::default()
    }

    /// The request with these tensor pieces in host memory added (box or flat pieces).
    #[must_use]
    pub fn with_tensors(mut self, pieces: impl IntoIterator<Item = ShardedTensor<'a>>) -> Self {
        self.tensors.extend(pieces);
        self
    }

    /// The request with these objects added; it now saves objects, even if `objects` is
    /// empty (see the type's documentation).
    #[must_use]
    pub fn with_objects(mut self, objects: impl IntoIterator<Item = StateObject>) -> Self {
        self.objects.get_or_insert_with(Vec::new).extend(objects);
        self
    }

    /// The request with these tensor pieces in the memory of `device` added. They are read
    /// during the save call itself, into the saver's staging memory (page-locked memory of
    /// `device`), so the caller may change them once the call returns. One device per
    /// request: a later call replaces the device of earlier pieces.
    #[must_use]
    pub fn with_device_tensors(
        mut self,
        device: Arc<dyn Device>,
        pieces: impl IntoIterator<Item = DevicePiece>,
    ) -> Self {
        self.device = Some(device);
        self.device_tensors.extend(pieces);
        self
    }

    /// A nested state dict, flattened: every leaf under its flattened key (`/`-joined path,
    /// list positions in decimal; see [`crate::model::state`]). Tensor pieces become
    /// tensors, objects stay objects and scalars become common JSON objects.
    ///
    /// # Errors
    /// [`crate::Error::State`] for a state dict that does not flatten (bad map keys,
    /// colliding paths, load targets among the leaves). The check is local: every rank
    /// should flatten the same structure, or use [`crate::save_state`], which agrees on it.
    pub fn from_state(state: &StateDict<'a>) -> Result<Self> {
        let mut pieces = Vec::new();
        let mut objects = Vec::new();
        for (key, leaf) in state.flatten()? {
            match leaf {
                StateValue::Tensor(t) => pieces.push(t.rekeyed(key)?),
                StateValue::Object(o) => objects.push(o.clone().with_key(key)),
                StateValue::Scalar(v) => {
                    objects.push(StateObject::common(key.as_str(), v.clone())?);
                }
                other => {
                    return Err(StateError::WrongLeaf {
                        key,
                        found: other.kind(),
                        wanted: "a tensor piece, an object or a scalar",
                    }
                    .into());
                }
            }
        }
        Ok(SaveRequest::new()
            .with_tensors(pieces)
            .with_objects(objects))
    }

    /// The host tensor pieces.
    #[must_use]
    pub fn tensors(&self) -> &[ShardedTensor<'a>] {
        &self.tensors
    }

    /// The device tensor pieces.
    #[must_use]
    pub fn device_tensors(&self) -> &[DevicePiece] {
        &self.device_tensors
    }

    /// The objects, if the request saves objects.
    #[must_use]
    pub fn objects(&self) -> Option<&[StateObject]> {
        self.objects.as_deref()
    }
}

impl<'a> From<Vec<ShardedTensor<'a>>> for SaveRequest<'a> {
    /// A request of these host tensor pieces, without objects.
    fn from(pieces: Vec<ShardedTensor<'a>>) -> Self {
        SaveRequest::new().with_tensors(pieces)
    }
}

impl<'a> From<&[ShardedTensor<'a>]> for SaveRequest<'a> {
    /// A request of these host tensor pieces (copied descriptions; the data stays
    /// borrowed), without objects.
    fn from(pieces: &[ShardedTensor<'a>]) -> Self {
        SaveRequest::new().with_tensors(pieces.iter().cloned())
    }
}
