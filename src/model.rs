//! The data model: data types, validated keys, regions and tensor pieces. No I/O.

pub mod convert;
pub mod copy;
pub mod dtype;
pub mod flat;
pub mod json;
pub mod key;
pub mod object;
pub mod region;
pub mod state;
pub mod tensor;

// Sizes are `u64` on disk and in the plan, `usize` in memory: the crate builds for 64-bit
// targets only, so that every `u64` offset or length of bytes held in memory fits a `usize`
// (see [`usize_of`]).
#[cfg(not(target_pointer_width = "64"))]
compile_error!("zarrckpt supports 64-bit targets only");

/// `v` as a `usize`, losslessly: `usize` is 64 bits wide on every target the crate builds for
/// (the `compile_error!` above). For offsets and lengths already known to address memory;
/// sizes derived from input still go through checked arithmetic before they are used.
#[inline]
#[must_use]
#[allow(clippy::cast_possible_truncation)]
pub(crate) const fn usize_of(v: u64) -> usize {
    v as usize
}

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
