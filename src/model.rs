//! The data model: data types, validated keys, regions and tensor pieces. No I/O.

#[doc(hidden)]
pub mod copy;
pub mod dtype;
pub mod key;
pub mod object;
pub mod region;
pub mod state;
pub mod tensor;

pub use dtype::{DType, Element};
pub use key::{KeyError, TensorKey};
pub use object::{
    Encoding, ObjectError, ObjectRequest, ObjectScope, ObjectSlot, ObjectValue, StateObject,
};
pub use region::{Region, RegionError};
pub use state::{StateDict, StateError, StateValue};
pub use tensor::{LoadTarget, ShardedTensor, TensorError};
