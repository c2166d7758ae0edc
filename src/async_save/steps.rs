//! The steps of a save that [`super::Saver`] runs separately: planning with the plan cache,
//! and the collective steps around the writes.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::model::ShardedTensor;
use crate::plan::cache::{self, CachedPlan, CheckOutcome};
use crate::plan::layout::{GatheredLayouts, RankLayout};
use crate::plan::save::{RankTasks, SavePlan, SavePlanOptions};
use crate::save::{SaveOptions, SaveReport};
use crate::storage::{CheckpointMeta, TensorArray, commit, fsio, write};

pub(crate) use crate::save::{
    PieceIndex, agree, entry_of, exchange_parts, full_chunk_box, io_pool, local_layout, write_files,
};

/// The outcome of planning on this rank.
pub(crate) struct Planned<'p, 'a> {
    pub plan: Arc<SavePlan>,
    pub local: PieceIndex<'p, 'a>,
    pub plan_time: Duration,
    pub gathered_bytes: u64,
    pub reused: bool,
}

/// Plans a save, reusing `cache` when every rank's structure is unchanged. One all-gather
/// of a fixed-size message per rank ([`cache::CHECK_LEN`] bytes and a status byte) carries
/// local errors, the check, and (when something changed) the first round of the full
/// agreement; a second all-gather of the distinct layouts follows only then. The cache is
/// replaced only by a plan that validated.
pub(crate) fn plan_step<'p, 'a>(
    comm: &dyn Communicator,
    pieces: &'p [ShardedTensor<'a>],
    opts: &SaveOptions,
    cached: &mut Option<CachedPlan>,
) -> Result<Planned<'p, 'a>> {
    let t0 = Instant::now();
    let world = comm.world_size();
    let plan_opts = SavePlanOptions {
        grid: opts.grid,
        balance_replicas: opts.balance_replicas,
    };
    let offered = cached.as_ref().filter(|c| c.fits(world, &plan_opts));
    let local = local_layout(pieces).map(|(layout, index)| {
        let enc = layout.encode();
        let hash = RankLayout::hash_bytes(&enc);
        (enc, hash, index)
    });
    let msg = match &local {
        Ok((_, hash, _)) => {
            let mut m = vec![0u8];
            m.extend_from_slice(&cache::check_message(offered, *hash));
            m
        }
        Err(e) => {
            let mut m = vec![1u8];
            m.extend_from_slice(e.to_string().as_bytes());
            m
        }
    };
    let all = match comm.all_gather(&msg) {
        Ok(all) => all,
        Err(e) => return Err(local.err().unwrap_or(Error::Comm(e))),
    };
    let (encoded, _, index) = local?;
    for (rank, m) in all.iter().enumerate() {
        if m.first() != Some(&0) {
            let message = String::from_utf8_lossy(m.get(1..).unwrap_or_default()).into_owned();
            return Err(Error::RemoteFailure { rank, message });
        }
    }
    let mut gathered_bytes = all.iter().map(|m| m.len() as u64).sum::<u64>();
    let msgs: Vec<&[u8]> = all.iter().map(|m| &m[1..]).collect();
    let (plan, reused) = match cache::decide(offered, &msgs)? {
        CheckOutcome::Unchanged => match offered {
            Some(c) => (Arc::clone(c.plan()), true),
            None => unreachable!("`decide` reuses only an offered plan"),
        },
        CheckOutcome::Changed { hashes } => {
            let reps = GatheredLayouts::representatives(&hashes);
            let mine: &[u8] = if reps[comm.rank()] { &encoded } else { &[] };
            let blobs = comm.all_gather(mine)?;
            gathered_bytes += blobs.iter().map(|b| b.len() as u64).sum::<u64>();
            let g = GatheredLayouts::from_parts(&hashes, &blobs)?;
            let plan = Arc::new(SavePlan::build(&g, &plan_opts)?);
            *cached = Some(CachedPlan::new(plan_opts, hashes, Arc::clone(&plan)));
            (plan, false)
        }
    };
    Ok(Planned {
        plan,
        local: index,
        plan_time: t0.elapsed(),
        gathered_bytes,
        reused,
    })
}

/// Rank 0 prepares the directory; everyone agrees on the outcome.
pub(crate) fn prepare_step(
    comm: &dyn Communicator,
    dir: &Path,
    plan: &SavePlan,
    opts: &SaveOptions,
) -> Result<()> {
    let prepared = if comm.rank() == 0 {
        commit::prepare(dir, opts.overwrite)
            .and_then(|()| commit::write_groups(dir, plan.tensors.iter().map(|t| &t.key)))
            .map_err(Error::from)
    } else {
        Ok(())
    };
    agree(comm, prepared)
}

/// Rank 0 commits once every rank's files are durable; everyone agrees on the outcome.
pub(crate) fn commit_step(
    comm: &dyn Communicator,
    dir: &Path,
    plan: &SavePlan,
    opts: &SaveOptions,
) -> Result<()> {
    let committed = if comm.rank() == 0 {
        let mut meta = CheckpointMeta::new(comm.world_size() as u64);
        meta.user = opts.user_metadata.clone();
        for tp in &plan.tensors {
            meta.tensors
                .insert(tp.key.clone(), entry_of(tp, opts.compression));
        }
        commit::commit(dir, &meta).map_err(Error::from)
    } else {
        Ok(())
    };
    agree(comm, committed)
}

/// The parts of unaligned chunks this rank receives (per write, in order), after sending
/// its own; nothing when every tensor is aligned.
pub(crate) fn receive_parts(
    comm: &dyn Communicator,
    plan: &SavePlan,
    tasks: &RankTasks,
    local: &PieceIndex<'_, '_>,
) -> Result<Vec<Vec<Vec<u8>>>> {
    if plan.tensors.iter().any(|t| !t.aligned) {
        agree(comm, exchange_parts(comm, plan, tasks, local))
    } else {
        Ok(vec![Vec::new(); tasks.writes.len()])
    }
}

/// The arrays this rank writes metadata or chunks of.
pub(crate) fn create_arrays(
    dir: &Path,
    plan: &SavePlan,
    tasks: &RankTasks,
    opts: &SaveOptions,
) -> Result<HashMap<usize, TensorArray>> {
    let mut arrays = HashMap::new();
    for &ti in tasks
        .metadata
        .iter()
        .chain(tasks.writes.iter().map(|w| &w.tensor))
    {
        if let std::collections::hash_map::Entry::Vacant(v) = arrays.entry(ti) {
            let tp = &plan.tensors[ti];
            v.insert(TensorArray::create(
                dir,
                &tp.key,
                &entry_of(tp, opts.compression),
            )?);
        }
    }
    Ok(arrays)
}

/// Writes the arrays' `zarr.json` this rank owns and creates every array directory it
/// writes into; returns those directories (to fsync once their files are written).
pub(crate) fn write_metadata(
    tasks: &RankTasks,
    arrays: &HashMap<usize, TensorArray>,
) -> Result<BTreeSet<PathBuf>> {
    tasks
        .metadata
        .par_iter()
        .try_for_each(|ti| write::write_array_metadata(&arrays[ti]))?;
    let dirs: BTreeSet<PathBuf> = arrays.values().map(|a| a.dir().to_owned()).collect();
    for d in &dirs {
        fsio::create_dir_durable(d)?;
    }
    Ok(dirs)
}

/// A synchronous save with a plan at hand: the steps of [`crate::save()`] after planning.
pub(crate) fn save_planned(
    dir: &Path,
    comm: &dyn Communicator,
    opts: &SaveOptions,
    planned: &Planned<'_, '_>,
) -> Result<SaveReport> {
    let plan = &*planned.plan;
    let tasks = plan.tasks_for(u32::try_from(comm.rank()).unwrap_or(u32::MAX));
    prepare_step(comm, dir, plan, opts)?;
    let received = receive_parts(comm, plan, &tasks, &planned.local)?;
    let written = write_files(dir, plan, &tasks, &planned.local, &received, opts);
    let (data_bytes, file_bytes) = agree(comm, written)?;
    commit_step(comm, dir, plan, opts)?;
    Ok(SaveReport {
        tensors: plan.tensors.len(),
        chunks_written: tasks.writes.len(),
        data_bytes,
        file_bytes,
        write_balance: plan.write_balance(),
        bytes_per_rank: plan.bytes_per_rank.clone(),
        plan_time: planned.plan_time,
        gathered_bytes: planned.gathered_bytes,
        plan_reused: planned.reused,
    })
}
