//! zarrckpt: distributed training checkpoints as Zarr v3 arrays.
//!
//! Every global tensor is one Zarr v3 array whose outer chunks (shard files) line up with the
//! pieces the ranks held when saving. Each rank writes only its own shard files; any later
//! topology reads exactly the shards and subchunks that intersect what it asks for, straight
//! into its own buffers; zarr-python, tensorstore and zarrs open the checkpoint without this
//! crate. The format is specified in `spec/format.md`.
//!
//! Layers, each depending only on those above it: [`model`] (data types, keys, regions, no
//! I/O), [`plan`] (pure geometry and decisions), [`storage`] (the only user of zarrs and the
//! file system), [`comm`] (how ranks talk), and the front doors [`save()`], [`load()`] and
//! [`Checkpoint`].
#![cfg(target_endian = "little")]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
pub mod error;
pub mod launch;
pub mod load;
pub mod manager;
pub mod model;
pub mod plan;
pub mod save;
pub mod storage;
pub mod synth;

pub use checkpoint::{Checkpoint, TensorInfo};
pub use comm::{CommError, Communicator, LocalComm, TcpComm};
pub use error::{Error, Result};
pub use load::{LoadOptions, LoadReport, StrictMode, load};
pub use manager::{CheckpointManager, ManagerOptions, StepInfo};
pub use model::{DType, LoadTarget, Region, ShardedTensor, TensorKey};
pub use save::{SaveOptions, SaveReport, save};
pub use storage::Compression;
pub use storage::read::ReadMethod;

/// The README's examples, compiled as doc tests so they cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
