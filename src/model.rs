//! The data model: data types, validated keys, regions and tensor pieces. No I/O.

#[doc(hidden)]
pub mod copy;
pub mod dtype;
pub mod flat;
pub mod key;
pub mod region;
pub mod tensor;

pub use dtype::{DType, Element};
pub use flat::FlatBox;
pub use key::{KeyError, TensorKey};
pub use region::{Region, RegionError};
pub use tensor::{LoadTarget, Replica, ShardedTensor, TensorError};
