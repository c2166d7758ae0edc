//! The data model: data types, validated keys, regions and tensor pieces. No I/O.

pub mod convert;
#[doc(hidden)]
pub mod copy;
pub mod dtype;
pub mod flat;
pub mod json;
pub mod key;
pub mod object;
pub mod region;
pub mod state;
pub mod tensor;

pub use convert::Cast;
pub use dtype::{DType, Element};
pub use flat::FlatBox;
pub use key::{KeyError, TensorKey};
pub use object::{
    Encoding, ObjectError, ObjectRequest, ObjectScope, ObjectSlot, ObjectValue, StateObject,
};
pub use region::{Region, RegionError};
pub use state::{StateDict, StateError, StateValue};
pub use tensor::{LoadTarget, Replica, ShardedTensor, TensorError};
