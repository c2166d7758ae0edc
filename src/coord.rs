//! What save and load share: agreeing on outcomes (so that no rank runs ahead of a failed
//! one), describing what a rank holds or asks for, gathering those descriptions
//! (de-duplicated), and the I/O thread pool.

use std::collections::HashMap;
use std::sync::Arc;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::model::{DType, Region, TensorKey};
use crate::plan::layout::{PieceDecl, RankLayout, TensorDecl};
use crate::plan::rule::{Summary, Template, World};

/// Called with a number of bytes each time that many more bytes are done.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

/// The number of CPUs, at most 8: the threads of a pool asked for with 0.
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, std::num::NonZero::get)
        .min(8)
}

/// A builder of a pool of `threads` threads, or of the number of CPUs (at most 8) when 0,
/// named `zarrckpt-<what>-<i>`.
pub(crate) fn pool_builder(threads: usize, what: &'static str) -> rayon::ThreadPoolBuilder {
    let n = if threads == 0 {
        default_threads()
    } else {
        threads
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(move |i| format!("zarrckpt-{what}-{i}"))
}

/// The thread pool a rank does its file I/O in: `threads`, or the number of CPUs (at most 8)
/// when 0.
pub(crate) fn io_pool(threads: usize) -> Result<rayon::ThreadPool> {
    pool_builder(threads, "io")
        .build()
        .map_err(|e| Error::ThreadPool(e.to_string()))
}

/// Every rank reports its local outcome; everyone returns an error if anyone failed, so no
/// rank proceeds to a step the others will not reach. One all-reduce that keeps the failure
/// of the lowest failed rank: a few bytes per rank whatever the world size.
pub(crate) fn agree<T>(comm: &dyn Communicator, local: Result<T>) -> Result<T> {
    let msg = match &local {
        Ok(_) => vec![0u8],
        Err(e) => {
            let mut v = vec![1u8];
            v.extend_from_slice(&(comm.rank() as u64).to_le_bytes());
            v.extend_from_slice(e.to_string().as_bytes());
            v
        }
    };
    let all = match comm.all_reduce(&msg, &first_failure) {
        Ok(all) => all,
        Err(e) => return Err(local.err().unwrap_or(Error::Comm(e))),
    };
    let v = local?;
    match failure_of(&all) {
        Some((rank, message)) => Err(Error::RemoteFailure { rank, message }),
        None => Ok(v),
    }
}

/// The failure an [`agree`] message reports: rank and message.
fn failure_of(m: &[u8]) -> Option<(usize, String)> {
    match m {
        [0] => None,
        [1, rest @ ..] => match rest.split_first_chunk::<8>() {
            Some((r, msg)) => Some((
                crate::model::usize_of(u64::from_le_bytes(*r)),
                String::from_utf8_lossy(msg).into_owned(),
            )),
            None => Some((usize::MAX, "malformed outcome message".into())),
        },
        _ => Some((usize::MAX, "malformed outcome message".into())),
    }
}

/// Merge of [`agree`] messages: the failure of the lowest rank, if any.
fn first_failure(a: &[u8], b: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let keep = match (failure_of(a), failure_of(b)) {
        (None, None) | (Some(_), None) => a,
        (None, Some(_)) => b,
        (Some((ra, _)), Some((rb, _))) => {
            if ra <= rb {
                a
            } else {
                b
            }
        }
    };
    Ok(keep.to_vec())
}

/// This rank's layout described by rule, as a one-rank summary (see [`crate::plan::rule`]).
pub(crate) fn describe(comm: &dyn Communicator, layout: &RankLayout) -> Vec<u8> {
    let (template, coords) = Template::describe(layout);
    Summary::leaf(comm.rank() as u64, template.encode(), &coords).encode()
}

/// Every rank's description ([`describe`]) combined up the communicator's tree: the world it
/// describes, and the combined summary's bytes.
pub(crate) fn combine(comm: &dyn Communicator, leaf: &[u8]) -> Result<(World, Vec<u8>)> {
    let combined = comm.all_reduce(leaf, &Summary::merge_encoded)?;
    let summary = Summary::decode(&combined, 0)?;
    Ok((World::from_summary(&summary, comm.world_size())?, combined))
}

/// One all-reduce of fixed-size integers: `values[i]` of every rank combined with `ops[i]`.
pub(crate) fn all_reduce_u64(
    comm: &dyn Communicator,
    values: &[u64],
    ops: &[fn(u64, u64) -> u64],
) -> Result<Vec<u64>> {
    let parse = |m: &[u8]| -> std::result::Result<Vec<u64>, String> {
        if m.len() != 8 * ops.len() {
            return Err(format!("{} bytes, expected {}", m.len(), 8 * ops.len()));
        }
        let (words, _) = m.as_chunks::<8>(); // no remainder: the length was checked
        Ok(words.iter().map(|c| u64::from_le_bytes(*c)).collect())
    };
    let encode = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let out = comm.all_reduce(&encode(values), &|a, b| {
        let (a, b) = (parse(a)?, parse(b)?);
        Ok(encode(
            &ops.iter()
                .zip(a.iter().zip(&b))
                .map(|(op, (&x, &y))| op(x, y))
                .collect::<Vec<_>>(),
        ))
    })?;
    parse(&out).map_err(|detail| {
        Error::Comm(crate::comm::CommError::Mismatch {
            op: "all_reduce",
            rank: comm.rank(),
            detail,
        })
    })
}

/// One box a rank declares: a piece it holds (save) or a box it asks for (load).
pub(crate) struct BoxDecl<'a> {
    pub key: &'a TensorKey,
    pub dtype: DType,
    pub global_shape: &'a [u64],
    pub region: &'a Region,
    /// Main replica (save); for load requests, a box read by this rank alone (converted).
    pub main: bool,
    /// Declared replicated without an id (save, `Replica::Auto`); false for load requests.
    pub auto: bool,
}

/// Builds a rank's layout from the boxes it declares; `what` ("pieces" or "requests") names
/// them in the error when one key is declared with two data types or global shapes.
pub(crate) fn rank_layout<'a>(
    boxes: impl IntoIterator<Item = BoxDecl<'a>>,
    what: &str,
) -> Result<RankLayout> {
    let mut layout = RankLayout::default();
    let mut ids: HashMap<&TensorKey, u32> = HashMap::new();
    for b in boxes {
        let id = if let Some(&id) = ids.get(b.key) {
            let d = &layout.tensors[id as usize];
            if d.dtype != b.dtype || d.global_shape != b.global_shape {
                return Err(Error::InconsistentPieces {
                    key: b.key.clone(),
                    detail: format!(
                        "{what} on this rank declare {} {:?} and {} {:?}",
                        d.dtype, d.global_shape, b.dtype, b.global_shape
                    ),
                });
            }
            id
        } else {
            let id = u32::try_from(layout.tensors.len()).unwrap_or(u32::MAX);
            layout.tensors.push(TensorDecl {
                key: b.key.clone(),
                dtype: b.dtype,
                global_shape: b.global_shape.to_vec(),
            });
            ids.insert(b.key, id);
            id
        };
        layout.pieces.push(PieceDecl {
            tensor: id,
            region: b.region.clone(),
            main: b.main,
            auto: b.auto,
        });
    }
    Ok(layout)
}
