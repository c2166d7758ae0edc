//! Pure geometry and decisions: layouts, chunk grids, who writes what, what a load reads.
//! No I/O, no zarrs, no network.

pub mod cache;
mod convert;
pub mod exchange;
pub mod grid;
pub mod layout;
pub mod load;
pub mod objects;
pub mod rule;
pub mod ruled;
pub mod save;
mod strict;

pub use convert::ConvertError;
pub use grid::GridOptions;
pub use layout::{GatheredLayouts, LayoutDecodeError, PieceDecl, RankLayout, TensorDecl};
pub use save::{PlanError, SavePlan, SavePlanOptions, TensorPlan};
pub use strict::StrictMode;

/// The hash map of the planners: keys come from the job's own ranks and the maps are hot
/// (an irregular layout puts world x tensors entries in them), so a fast hasher
/// (foldhash, randomly seeded) instead of SipHash.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
