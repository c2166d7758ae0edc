//! The data model: data types, validated keys, regions and tensor pieces. No I/O.

#[doc(hidden)]
pub mod copy;
pub mod dtype;
pub mod key;
pub mod region;
pub mod tensor;

pub use dtype::{DType, Element};
pub use key::{KeyError, TensorKey};
pub use region::{Region, RegionError};
pub use tensor::{LoadTarget, ShardedTensor, TensorError};
