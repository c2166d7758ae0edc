//! Megatron-Core <-> Hugging Face <-> vLLM conversion as data (spec § 19).
//!
//! A conversion table (JSON, `tables/*.json` built in) maps Megatron tensors, as
//! `dist_checkpointing` stores them, to HF names through a closed set of index ops (rename,
//! transpose, slice, concat / split, interleave / de-interleave, stack / unstack, pad /
//! unpad) and a few value ops. Planning is pure: [`expand`](expand::expand) a table for a
//! `config.json` and a layout, check it ([`check`]: every destination exactly once, every
//! source consumed or dropped, shapes, divisibility, fused-tensor structure), and
//! [`plan`] per destination the source boxes; then [`exec`] fills destination buffers
//! through [`Checkpoint::read_region`](crate::Checkpoint::read_region) (each merged source
//! box read once) or from caller-provided source bytes.
//!
//! The formats' files are written and read here too, acting on a checkpoint: [`hf`]
//! (safetensors shards and index out, an HF folder into a Megatron layout in), [`vllm`]
//! (per-rank `sharded_state` files), [`dcp`] (PyTorch DCP checkpoints in, and Megatron's
//! `torch_dist` checkpoints with [`import_megatron`] and [`megatron_value`], read by the
//! restricted [`pickle`] reader, which runs nothing), all through the one safetensors writer of
//! [`safetensors`]. The CLI and the Python package only call these.

pub mod check;
pub mod dcp;
mod dcp_import;
pub mod describe;
pub mod error;
pub mod exec;
pub mod expand;
pub mod expr;
pub mod geom;
pub mod hf;
mod hf_import;
mod megatron_import;
pub mod megatron_value;
pub mod pickle;
pub mod plan;
pub mod safetensors;
pub mod table;
pub mod validate;
pub mod vllm;
pub mod write;

pub use check::{Direction, Inventory};
pub use dcp_import::{DcpImportOptions, DcpImportReport, TORCH_SAVE_FLAG, import_dcp};
pub use error::{ConvertError, FormatError};
pub use exec::{FillStats, fill_from_checkpoint, fill_from_sources};
pub use expand::{Expanded, Layout, expand};
pub use hf::{ExportOptions, ExportReport, HfExport};
pub use hf_import::{HfDir, HfImport, ImportReport};
pub use megatron_import::{
    MAX_CONFIG_BYTES, MEGATRON_COMMON_KEY, MEGATRON_SUBDIR, import_megatron,
};
pub use plan::{
    Dest, Part, Piece, Plan, Source, plan_hf_export, plan_megatron_import, plan_vllm,
    plan_vllm_part,
};
pub use table::Table;
pub use validate::load_checked;
pub use vllm::VllmExport;
pub use write::{WriteOptions, WriteStats};
