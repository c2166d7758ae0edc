//! zarrckpt: distributed training checkpoints as Zarr v3 arrays.
//!
//! Every global tensor is one Zarr v3 array whose outer chunks (shard files) line up with the
//! pieces the ranks held when saving. Each rank writes only its own shard files; any later
//! topology reads exactly the shards and subchunks that intersect what it asks for, straight
//! into its own buffers; zarr-python, tensorstore and zarrs open the checkpoint without this
//! crate. The format is specified in `spec/format.md`.
//!
//! # The API in one screen
//! - Describe what a rank holds with [`ShardedTensor`] (its box of a global tensor, or a
//!   replica of it) and what it wants with [`LoadTarget`] (a box and a buffer to fill).
//!   Either may instead be a flat range of the tensor's C-order flattening (ZeRO / FSDP1
//!   shards: [`ShardedTensor::from_flat_slice`]), and a box every holder declares
//!   [`ShardedTensor::replicated`] is stored once with no replica ids to assign.
//! - [`save()`] and [`load()`] are collective: every rank of a [`Communicator`] calls them
//!   ([`run_local`] runs ranks as threads; [`TcpComm`] joins processes and hosts the way
//!   torchrun configures PyTorch).
//! - [`Saver`] saves a [`SaveRequest`] (host tensors, device tensors, objects, a nested
//!   state dict): synchronously, or in the background ([`Saver::save_async`] returns once
//!   the state is staged in one bounded, reused budget, with every planning error;
//!   [`SaveHandle::wait`] gives the outcome), with the layout agreed once and then checked
//!   with a constant-size exchange while it is unchanged. [`CheckpointManager`] wraps it:
//!   one checkpoint per step, a `latest` pointer, keep-N, resume.
//! - [`Checkpoint::open`] inspects, reads and verifies a checkpoint without a job.
//! - The whole training state: objects ([`StateObject`]: configuration, iteration, RNG
//!   states; JSON or bytes, common, per-rank or sharded) with [`save_with_objects`] /
//!   [`load_with_objects`], and nested state dicts ([`StateDict`]) with [`save_state`] /
//!   [`load_state`].
//! - [`convert`]: Megatron-Core <-> Hugging Face <-> vLLM conversion as data (JSON tables,
//!   every check from metadata alone, plans that fill caller buffers from a checkpoint).
//! - Every failure is an [`Error`] that names the tensor key, chunk, rank and path involved.
//!
//! ```no_run
//! use std::time::Duration;
//! use zarrckpt::{Communicator, LoadOptions, LoadTarget, SaveOptions, ShardedTensor, run_local};
//!
//! let dir = std::path::Path::new("ckpt");
//! // Two ranks each hold half of a [4, 3] float32 weight...
//! run_local(2, Duration::from_secs(60), |comm| {
//!     let r = comm.rank() as u64;
//!     let half: Vec<f32> = (0..6).map(|i| (r * 6 + i) as f32).collect();
//!     let piece = ShardedTensor::from_slice("w", &[4, 3], &[2 * r, 0], &half, &[2, 3], 0)?;
//!     zarrckpt::save(&[piece], dir, &comm, &SaveOptions::default())
//! })
//! .into_iter()
//! .collect::<Result<Vec<_>, _>>()?;
//! // ...and one rank loads it whole.
//! run_local(1, Duration::from_secs(60), |comm| {
//!     let mut all = vec![0f32; 12];
//!     let mut t = [LoadTarget::from_slice("w", &[4, 3], &[0, 0], &mut all, &[4, 3])?];
//!     zarrckpt::load(&mut t, dir, &comm, &LoadOptions::default())
//! })
//! .into_iter()
//! .collect::<Result<Vec<_>, _>>()?;
//! # Ok::<(), zarrckpt::Error>(())
//! ```
//!
//! The modules follow the layers of the README's "Architecture" section: [`model`] (types, no
//! I/O) -> [`plan`] (pure decisions) -> [`storage`] (behind its [`storage::store::Store`]
//! seam), [`comm`] and device memory (I/O behind traits) -> the engines ([`save()`],
//! [`load()`], [`device`], [`convert`], [`manager`], ...) -> the front doors (the `zarrckpt`
//! CLI and the Python package).
#![cfg(target_endian = "little")]
#![warn(missing_docs)]

pub mod async_save;
pub mod checkpoint;
pub mod comm;
pub mod convert;
mod coord;
pub mod device;
mod devmem;
pub mod error;
pub mod load;
pub mod manager;
pub mod model;
mod objects;
pub mod save;
mod stage;
pub mod state;
pub mod transfer;

pub mod plan;
#[cfg(feature = "object-store")]
pub mod remote;
pub mod storage;

pub use async_save::{IfBusy, SaveHandle, Saver, SaverOptions};
pub use checkpoint::{Checkpoint, ObjectInfo, Problem, TensorInfo};
pub use comm::{CommError, Communicator, LocalComm, TcpComm, TcpConfig, run_local};
pub use error::{Error, Result};
/// The `half` crate, whose `bf16` and `f16` are [`Element`]s (stored as bfloat16 and float16):
/// `zarrckpt::half::bf16` needs no dependency of its own.
pub use half;
pub use load::{LoadOptions, LoadPhases, LoadReport, StrictMode, load, load_with_objects};
pub use manager::{CheckpointManager, ManagerOptions, StepInfo};
pub use model::{
    Cast, DType, Element, Encoding, KeyError, LoadTarget, ObjectError, ObjectRequest, ObjectScope,
    ObjectSlot, ObjectValue, Region, RegionError, Replica, ShardedTensor, StateDict, StateError,
    StateObject, StateValue, TensorError, TensorKey,
};
pub use plan::objects::ObjectPlanError;
pub use plan::{GridOptions, LayoutDecodeError, PlanError};
pub use save::{Progress, SaveOptions, SaveReport, SaveRequest, save, save_with_objects};
pub use state::{load_state, save_state};
pub use storage::object::StoredScope;
pub use storage::read::{ReadMethod, ReadPhases};
pub use storage::{Compression, StorageError};

/// The README's Rust examples, compiled and run as doc tests so they cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
