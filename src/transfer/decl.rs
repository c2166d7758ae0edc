//! What each rank declares before a transfer: its role, and the structure (never the values)
//! of what it holds or wants. Declarations are gathered once per structure and are the only
//! input of the plan.

use serde::{Deserialize, Serialize};

use crate::model::{DType, ShardedTensor};

/// How a trainer box is replicated (Megatron's `replica_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub enum Holder {
    /// The main replica (`replica_id` 0): it sends.
    Main,
    /// A copy of a box another rank holds as main: it never sends.
    Copy,
    /// Replicated without an id: one of the ranks declaring this very box sends.
    Auto,
}

/// A box of a Megatron global tensor one trainer rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub struct SourceBox {
    /// Megatron key.
    pub key: String,
    /// Data type name.
    pub dtype: String,
    /// Global shape.
    pub global_shape: Vec<u64>,
    /// Offset of the box.
    pub off: Vec<u64>,
    /// Extent of the box.
    pub len: Vec<u64>,
    /// Replication.
    pub holder: Holder,
}

/// A tensor one engine rank wants: an HF (or vLLM) name and the shape of its buffer (the
/// rank's slice for a vLLM layout, the whole tensor otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub struct EngineTensor {
    /// Name in the engine's checkpoint format.
    pub name: String,
    /// Data type name of the buffer.
    pub dtype: String,
    /// Shape of the buffer.
    pub shape: Vec<u64>,
}

impl EngineTensor {
    /// An engine tensor.
    #[must_use]
    pub fn new(name: impl Into<String>, dtype: DType, shape: Vec<u64>) -> Self {
        EngineTensor {
            name: name.into(),
            dtype: dtype.to_string(),
            shape,
        }
    }
}

/// A rank's role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub enum Role {
    /// A trainer rank and the boxes it holds (flat pieces already cut into boxes).
    Trainer(Vec<SourceBox>),
    /// An engine rank and the tensors it wants, in its own order.
    Engine(Vec<EngineTensor>),
}

/// One rank's declaration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub struct Decl {
    /// Fingerprint of the options (table, config, layouts, bucket size): equal on every rank.
    pub options: u64,
    /// The role.
    pub role: Role,
    /// A local refusal (bad buffers), reported by every rank.
    pub error: Option<String>,
}

impl Decl {
    /// The structure's fingerprint (xxh3 of the canonical JSON).
    #[must_use]
    pub fn fingerprint(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&serde_json::to_vec(self).unwrap_or_default())
    }
}

/// Trainer pieces as box pieces (flat pieces cut into their boxes, empty boxes left out), in
/// the order the plan indexes them.
#[must_use]
pub fn box_pieces<'a>(pieces: &[ShardedTensor<'a>]) -> Vec<ShardedTensor<'a>> {
    pieces
        .iter()
        .flat_map(ShardedTensor::box_pieces)
        .filter(|b| !b.region().shape().contains(&0))
        .collect()
}

/// The declaration of one box piece.
#[must_use]
pub fn source_box(b: &ShardedTensor<'_>) -> SourceBox {
    let r = b.region();
    let holder = if b.is_auto_replica() {
        Holder::Auto
    } else if b.is_main() {
        Holder::Main
    } else {
        Holder::Copy
    };
    SourceBox {
        key: b.key().to_string(),
        dtype: b.dtype().to_string(),
        global_shape: b.global_shape().to_vec(),
        off: r.offset().to_vec(),
        len: r.shape().to_vec(),
        holder,
    }
}
