//! The collective half of a load: every rank's requests agreed on and planned once (which
//! keys exist, who reads each box that several ranks need), and, after the local reads, the
//! exchange of those boxes. The reads themselves are executed by the local
//! [`Reader`](super::Reader), which knows nothing of communicators.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use super::{LoadOptions, LoadReport, StrictMode, cast};
use crate::comm::{Communicator, RecvBuf, SendBuf};
use crate::coord::{BoxDecl, agree, all_reduce_u64, combine, describe, rank_layout};
use crate::error::{Error, Result};
use crate::model::copy::DisjointBuf;
use crate::model::{DType, LoadTarget, ObjectRequest, ObjectValue, Region, TensorKey};
use crate::plan::exchange::{ExchangePlan, SharedRead};
use crate::plan::layout::RankLayout;
use crate::plan::load::{ShardRead, local_reads};
use crate::plan::rule::World;
use crate::plan::ruled::plan_load;
use crate::storage::CheckpointMeta;
use crate::storage::object::ValueSource;

thread_local! {
    static STEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts a collective step of the load engine started on this thread.
pub(crate) fn note_step() {
    STEPS.with(|c| c.set(c.get() + 1));
}

/// Collective steps (agreeing on the index, planning with the other ranks, exchanging boxes)
/// the load engine has started on the calling thread so far: every collective load and
/// device load adds to it, reads through a [`Reader`](super::Reader) (and so
/// [`crate::Checkpoint`]'s reads, export, `diff`) never do.
#[must_use]
pub fn collective_steps() -> u64 {
    STEPS.with(std::cell::Cell::get)
}

/// One request of a load, without its buffer.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub key: TensorKey,
    /// The data type of the caller's buffer.
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    pub region: Region,
    /// `(stored, target)` data types when the request converts.
    pub cast: Option<(DType, DType)>,
    /// Read by this rank alone, never through the exchange (a converting request, or one a
    /// caller executes in several steps, as the device load's staging rounds).
    pub alone: bool,
}

impl Request {
    /// The request of a target.
    pub(crate) fn of(t: &LoadTarget<'_>, meta: &CheckpointMeta) -> Request {
        let cast = cast::converts_from(t, meta).map(|from| (from, t.dtype()));
        Request {
            key: t.key().clone(),
            dtype: t.dtype(),
            global_shape: t.global_shape().to_vec(),
            region: t.region().clone(),
            cast,
            alone: cast.is_some(),
        }
    }
}

/// This rank's part of a collective load, agreed with every rank: made once, then executed
/// (in one step, or in several by the device load) and exchanged.
#[derive(Debug, Default)]
pub(crate) struct CollectivePlan {
    /// The shared reads this rank takes part in.
    pub exchange: ExchangePlan,
    /// Rounds of group reads (the largest over the ranks).
    pub group_rounds: u32,
    /// The reads this rank does itself, by request index: every shard intersecting a request
    /// whose key is stored, except the boxes another rank reads and sends.
    pub reads: Vec<(usize, ShardRead)>,
    /// For each shared read this rank takes part in, the first of its requests that needs it.
    pub first_target: HashMap<usize, usize>,
    /// Requested keys the checkpoint lacks, under [`StrictMode::AssumeOkUnexpected`] (an
    /// error of this rank when it executes).
    pub absent: Vec<TensorKey>,
    pub unexpected: Vec<TensorKey>,
    pub missing: Vec<TensorKey>,
    pub objects: Vec<Option<ObjectValue>>,
    /// The largest `extra` value passed to [`plan`] over the ranks.
    pub extra_max: u64,
}

impl CollectivePlan {
    /// Fails under [`StrictMode::AssumeOkUnexpected`] when this rank asked for a key the
    /// checkpoint lacks.
    pub(crate) fn check_absent(&self, dir: &Path, me: usize) -> Result<()> {
        if self.absent.is_empty() {
            return Ok(());
        }
        Err(Error::UnexpectedKeys {
            path: dir.to_owned(),
            keys: self.absent.clone(),
            rank: me,
        })
    }

    /// `report` with what the plan found: the objects, and the unexpected and missing keys
    /// when the strict mode returns them.
    pub(crate) fn report(self, strict: StrictMode, report: LoadReport) -> LoadReport {
        let mut report = LoadReport {
            objects: self.objects,
            ..report
        };
        if matches!(strict, StrictMode::ReturnUnexpected | StrictMode::ReturnAll) {
            report.unexpected = self.unexpected;
        }
        if matches!(strict, StrictMode::ReturnAll | StrictMode::LogAll) {
            report.missing = self.missing;
        }
        report
    }

    /// Whether the plan has boxes to exchange.
    pub(crate) fn exchanges(&self) -> bool {
        self.group_rounds > 0 || self.exchange.general_rounds > 0
    }
}

/// Agrees on every rank's requests and plans this rank's part of the load (collective: every
/// rank calls it). `extra` is agreed on alongside (its largest value over the ranks comes back
/// in [`CollectivePlan::extra_max`]; pass 0 when unused).
pub(crate) fn plan(
    requests: &[Request],
    objects: Option<&[ObjectRequest]>,
    (dir, meta, values): (&Path, &CheckpointMeta, ValueSource<'_>),
    comm: &dyn Communicator,
    opts: &LoadOptions,
    extra: u64,
) -> Result<CollectivePlan> {
    note_step();
    let me = comm.rank();
    let me32 = u32::try_from(me).unwrap_or(u32::MAX);
    let layout = agree(comm, request_layout(requests))?;
    // The world's requests: this rank's described by rule, combined up the tree.
    let (world, _) = combine(comm, &describe(comm, &layout))?;
    let (mut unexpected, mut missing) = check_requests(dir, meta, &world, me, opts.strict)?;
    let objects = match objects {
        Some(requests) => {
            let o = crate::objects::load_objects(dir, values, meta, requests, comm, opts.strict)?;
            unexpected.extend(o.unexpected);
            missing.extend(o.missing);
            o.values
        }
        None => Vec::new(),
    };
    let geometry = |key: &TensorKey| super::stored_geometry(meta, key);
    let sharing = opts.exchange && comm.world_size() > 1;
    let (exchange, mine) = if sharing {
        plan_load(&world, me32, &geometry, ROUND_BYTES)?
    } else {
        (ExchangePlan::default(), 0)
    };
    let (group_rounds, extra_max) = if comm.world_size() > 1 && (sharing || extra > 0) {
        let m = all_reduce_u64(comm, &[u64::from(mine), extra], &[u64::max, u64::max])?;
        (u32::try_from(m[0]).unwrap_or(u32::MAX), m[1])
    } else {
        (0, extra)
    };
    let absent: Vec<TensorKey> = if opts.strict == StrictMode::AssumeOkUnexpected {
        requests
            .iter()
            .map(|r| &r.key)
            .filter(|k| !meta.tensors.contains_key(*k))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    let boxes: Vec<(&TensorKey, &Region, bool)> = requests
        .iter()
        .map(|r| (&r.key, &r.region, r.alone))
        .collect();
    let (reads, first_target) = local_reads(&boxes, &geometry, &exchange, me32);
    Ok(CollectivePlan {
        exchange,
        group_rounds,
        reads,
        first_target,
        absent,
        unexpected,
        missing,
        objects,
        extra_max,
    })
}

/// This rank's requests as a layout. A request that converts declares the stored data type;
/// it and every other request read alone are marked so (a converting request's buffer holds
/// another type, so it cannot share boxes with other ranks).
fn request_layout(requests: &[Request]) -> Result<RankLayout> {
    rank_layout(
        requests.iter().map(|r| BoxDecl {
            key: &r.key,
            dtype: r.cast.map_or(r.dtype, |(from, _)| from),
            global_shape: &r.global_shape,
            region: &r.region,
            main: r.alone,
            auto: false,
        }),
        "requests",
    )
}

/// Checks every rank's requests against the index, identically on every rank, so that all
/// ranks fail together (naming the offending rank) instead of some waiting for the others.
fn check_requests(
    dir: &Path,
    meta: &CheckpointMeta,
    w: &World,
    me: usize,
    strict: StrictMode,
) -> Result<(Vec<TensorKey>, Vec<TensorKey>)> {
    let mut my_unexpected = Vec::new();
    let mut first_other: Option<(usize, Vec<TensorKey>)> = None;
    let mut requested: BTreeSet<&TensorKey> = BTreeSet::new();
    let my_template = w.of_rank(me).map(|(t, _)| t);
    for (u, template) in w.templates.iter().enumerate() {
        // Only names a rank in errors; a template no run uses (none in a world built by
        // merging rank summaries) is named by rank 0.
        let lowest = w.some_ranks(u).first().copied().unwrap_or(0) as usize;
        let mine = my_template == Some(u);
        let mut unexpected = Vec::new();
        for t in &template.tensors {
            requested.insert(&t.key);
            match meta.tensors.get(&t.key) {
                None => unexpected.push(t.key.clone()),
                Some(e) => {
                    let path = dir.to_owned();
                    if e.dtype != t.dtype {
                        return Err(Error::DtypeMismatch {
                            key: t.key.clone(),
                            rank: lowest,
                            path,
                            requested: t.dtype,
                            stored: e.dtype,
                        });
                    }
                    if e.shape != t.global_shape {
                        return Err(Error::ShapeMismatch {
                            key: t.key.clone(),
                            rank: lowest,
                            path,
                            requested: t.global_shape.clone(),
                            stored: e.shape.clone(),
                        });
                    }
                }
            }
        }
        if mine {
            my_unexpected = unexpected;
        } else if !unexpected.is_empty() && first_other.as_ref().is_none_or(|(r, _)| lowest < *r) {
            first_other = Some((lowest, unexpected));
        }
    }
    // AssumeOkUnexpected: no check here; a missing key fails when this rank reads it.
    if strict.raises_unexpected() && strict != StrictMode::AssumeOkUnexpected {
        if !my_unexpected.is_empty() {
            return Err(Error::UnexpectedKeys {
                path: dir.to_owned(),
                keys: my_unexpected,
                rank: me,
            });
        }
        if let Some((rank, keys)) = first_other {
            return Err(Error::UnexpectedKeys {
                path: dir.to_owned(),
                keys,
                rank,
            });
        }
    }
    let missing: Vec<TensorKey> = if strict.needs_missing() {
        meta.tensors
            .keys()
            .filter(|k| !requested.contains(k))
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    match strict {
        StrictMode::RaiseAll if !missing.is_empty() => {
            return Err(Error::MissingKeys {
                path: dir.to_owned(),
                keys: missing,
            });
        }
        StrictMode::LogUnexpected | StrictMode::LogAll => {
            if !my_unexpected.is_empty() {
                tracing::warn!(rank = me, keys = ?my_unexpected, "requested keys not in checkpoint {}", dir.display());
            }
            if !missing.is_empty() {
                tracing::warn!(keys = ?missing, "checkpoint keys requested by no rank in {}", dir.display());
            }
        }
        _ => {}
    }
    Ok((my_unexpected, missing))
}

/// Bytes of shared reads moved through one exchange round at most: bounds what a rank stages
/// for boxes that are not contiguous in its buffers.
const ROUND_BYTES: u64 = 32 << 20;

/// Sends the boxes this rank read for others and receives the ones others read for it, in
/// rounds of bounded size. Returns (bytes sent, bytes received).
pub(crate) fn exchange_shared(
    comm: &dyn Communicator,
    plan: &ExchangePlan,
    group_rounds: u32,
    me: u32,
    first_target: &HashMap<usize, usize>,
    dests: &[DisjointBuf<'_>],
    opts: &LoadOptions,
) -> Result<(u64, u64)> {
    note_step();
    let (mut sent, mut received) = (0u64, 0u64);
    let groups = (0..group_rounds).map(|r| (0..plan.general_from, r));
    let general = (0..plan.general_rounds).map(|r| (plan.general_from..plan.reads.len(), r));
    for (range, round) in groups.chain(general) {
        let reads: Vec<(usize, &SharedRead)> = range
            .filter(|&u| plan.round[u] == round)
            .map(|u| (u, &plan.reads[u]))
            .collect();
        // Sends: straight from this rank's buffer when the box is contiguous there.
        let mut packed: Vec<(usize, Vec<u8>)> = Vec::new();
        for &(u, r) in &reads {
            if r.reader == me
                && let Some(&t) = first_target.get(&u)
                && dests[t].contiguous_range(&r.region).is_none()
            {
                let mut v = Vec::new();
                // SAFETY: the exchange only reads this rank's own filled boxes and writes
                // boxes received from others: distinct shards, disjoint bytes.
                unsafe { dests[t].pack(&r.region, &mut v) };
                packed.push((u, v));
            }
        }
        let mut sends: Vec<SendBuf> = Vec::new();
        for &(u, r) in &reads {
            let Some(&t) = first_target.get(&u) else {
                continue;
            };
            if r.reader != me {
                continue;
            }
            let data: &[u8] = match dests[t].contiguous_range(&r.region) {
                // SAFETY: as above.
                Some((start, len)) => unsafe { dests[t].slice(start, len) },
                None => packed
                    .iter()
                    .find(|p| p.0 == u)
                    .map_or(&[][..], |p| p.1.as_slice()),
            };
            for &peer in r.ranks.iter().filter(|&&p| p != me) {
                sends.push(SendBuf {
                    peer: peer as usize,
                    data,
                });
                sent += data.len() as u64;
            }
        }
        // Receives: straight into this rank's buffer when the box is contiguous there.
        let mut staged: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut recvs: Vec<RecvBuf> = Vec::new();
        for &(u, r) in &reads {
            let Some(&t) = first_target.get(&u) else {
                continue;
            };
            if r.reader == me {
                continue;
            }
            if dests[t].contiguous_range(&r.region).is_none() {
                staged.push((u, vec![0u8; crate::model::usize_of(r.bytes)]));
            }
        }
        let mut staged_iter = staged.iter_mut();
        for &(u, r) in &reads {
            let Some(&t) = first_target.get(&u) else {
                continue;
            };
            if r.reader == me {
                continue;
            }
            let buf: &mut [u8] = match dests[t].contiguous_range(&r.region) {
                // SAFETY: as above.
                Some((start, len)) => unsafe { dests[t].slice(start, len) },
                None => staged_iter
                    .next()
                    .map_or(&mut [][..], |s| s.1.as_mut_slice()),
            };
            received += buf.len() as u64;
            recvs.push(RecvBuf {
                peer: r.reader as usize,
                buf,
            });
        }
        comm.exchange(&sends, &mut recvs)?;
        drop(recvs);
        for (u, data) in &staged {
            let t = first_target[u];
            // SAFETY: as above.
            unsafe { dests[t].unpack(&plan.reads[*u].region, data) };
        }
        if let Some(p) = &opts.progress {
            p(reads
                .iter()
                .filter(|(u, r)| r.reader != me && first_target.contains_key(u))
                .map(|(_, r)| r.bytes)
                .sum());
        }
    }
    Ok((sent, received))
}
