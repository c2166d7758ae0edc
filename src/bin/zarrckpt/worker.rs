//! `zarrckpt worker`: one rank of a synthetic save or load, for `bench --processes`, the
//! multi-process tests and fault injection. Run under `zarrckpt launch` (reads RANK,
//! WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::synth::{Held, SynthModel, Topology, Wanted};
use anyhow::Context;
use serde_json::json;
use zarrckpt::{
    Communicator, LoadOptions, ReadMethod, SaveOptions, SaveRequest, Saver, SaverOptions,
    StrictMode, TcpComm, load, save,
};

use crate::rss;

/// What a worker does.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Job {
    /// Save the synthetic model.
    Save,
    /// Save it twice with `Saver::save_async` (a warm-up, then the measured one), with a
    /// plain memcpy of the same bytes measured in between.
    SaveAsync,
    /// Load it and check every byte.
    Load,
}

/// Arguments of `zarrckpt worker`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Save or load.
    #[arg(value_enum)]
    pub job: Job,
    /// The checkpoint directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// Approximate size of the synthetic model in bytes.
    #[arg(long)]
    pub size: u64,
    /// Hidden size of the synthetic model.
    #[arg(long, default_value_t = 2048)]
    pub hidden: u64,
    /// Tensor-parallel size (WORLD_SIZE must be tp x dp).
    #[arg(long)]
    pub tp: u64,
    /// Data-parallel size.
    #[arg(long, default_value_t = 1)]
    pub dp: u64,
    /// I/O threads.
    #[arg(long, default_value_t = 0)]
    pub io_threads: usize,
    /// Split the row-parallel layers by rows too (every weight split along its first axis).
    #[arg(long)]
    pub rows_only: bool,
    /// Load: read every byte on every rank instead of sharing within data-parallel groups.
    #[arg(long)]
    pub no_exchange: bool,
    /// Save: replace an existing checkpoint.
    #[arg(long)]
    pub overwrite: bool,
    /// Write this rank's report (JSON) to `<report>.<rank>`.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Fault injection: rank `die_rank` exits with status 86 once this many bytes are done.
    #[arg(long)]
    pub die_after_bytes: Option<u64>,
    /// Fault injection: which rank dies.
    #[arg(long, default_value_t = 0)]
    pub die_rank: usize,
    /// Fault injection: rank `stall_rank` stops for this many seconds once its first bytes
    /// are done (a slow disk: alive, its liveness thread answering, just late).
    #[arg(long)]
    pub stall_secs: Option<f64>,
    /// Fault injection: which rank stalls.
    #[arg(long, default_value_t = 0)]
    pub stall_rank: usize,
    /// Load: how shard files are read.
    #[arg(long, value_enum, default_value_t = ReadArg::Pread)]
    pub read_method: ReadArg,
    /// The full training state: fp32 master weights besides bf16 weights and Adam moments.
    #[arg(long)]
    pub full_state: bool,
    /// Save and load objects too (see `objects::declared`).
    #[arg(long)]
    pub objects: bool,
    /// Asynchronous save: background writer threads at the normal CPU priority (not lowered).
    #[arg(long)]
    pub normal_priority: bool,
}

impl Args {
    /// The synthetic model these arguments describe.
    pub fn model(&self) -> SynthModel {
        let axis = if self.rows_only { 0 } else { 1 };
        if self.full_state {
            SynthModel::training_state(self.size, self.hidden, axis)
        } else {
            SynthModel::gpt_with(self.size, self.hidden, axis)
        }
    }
}

/// `--read-method`: see [`ReadMethod`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadArg {
    /// Map shard files and copy from the mapping (one copy per byte; a truncated file or an
    /// I/O error kills the process with SIGBUS).
    Mmap,
    /// pread/preadv only (the default; I/O problems are errors).
    Pread,
}

impl From<ReadArg> for ReadMethod {
    fn from(r: ReadArg) -> ReadMethod {
        match r {
            ReadArg::Mmap => ReadMethod::Mmap,
            ReadArg::Pread => ReadMethod::Pread,
        }
    }
}

fn fault_progress(a: &Args, rank: usize) -> Option<zarrckpt::save::Progress> {
    let die = a.die_after_bytes.filter(|_| rank == a.die_rank);
    let stall = a
        .stall_secs
        .filter(|_| rank == a.stall_rank)
        .map(std::time::Duration::from_secs_f64);
    if die.is_none() && stall.is_none() {
        return None;
    }
    let done = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(std::sync::Once::new());
    Some(Arc::new(move |n| {
        let total = done.fetch_add(n, Ordering::SeqCst) + n;
        if die.is_some_and(|limit| total >= limit) {
            eprintln!("worker: rank {rank} dies now (fault injection)");
            std::process::exit(86);
        }
        if let Some(d) = stall {
            stalled.call_once(|| {
                eprintln!("worker: rank {rank} stalls for {d:?} (fault injection)");
                std::thread::sleep(d);
            });
        }
    }))
}

/// Runs one rank of `a.job` on `comm`; returns its report.
pub fn run_rank(a: &Args, shared: Arc<dyn Communicator>) -> anyhow::Result<serde_json::Value> {
    let comm = &*shared;
    let rank = comm.rank();
    let topo = Topology { tp: a.tp, dp: a.dp };
    anyhow::ensure!(
        topo.world() == comm.world_size() as u64,
        "tp {} x dp {} is not the world size {}",
        a.tp,
        a.dp,
        comm.world_size()
    );
    let model = a.model();
    match a.job {
        Job::Save => {
            let held = Held::generate(&model, topo, rank as u64);
            let pieces = held.sharded(&model);
            let opts = SaveOptions {
                overwrite: a.overwrite,
                io_threads: a.io_threads,
                progress: fault_progress(a, rank),
                ..Default::default()
            };
            comm.barrier()?;
            let t0 = Instant::now();
            let rep = if a.objects {
                let objs = objects::declared(rank)?;
                zarrckpt::save_with_objects(&pieces, &objs, &a.dir, comm, &opts)?
            } else {
                save(&pieces, &a.dir, comm, &opts)?
            };
            let secs = t0.elapsed().as_secs_f64();
            Ok(json!({
                "rank": rank, "secs": secs, "file_bytes": rep.file_bytes, "data_bytes": rep.data_bytes,
                "write_balance": rep.write_balance, "assigned_bytes": rep.assigned_bytes,
                "plan_secs": rep.plan_time.as_secs_f64(), "gathered_bytes": rep.gathered_bytes,
            }))
        }
        Job::SaveAsync => save_async(a, shared, &model),
        Job::Load => {
            let mut wanted = Wanted::allocate(&model, topo, rank as u64);
            let opts = LoadOptions {
                io_threads: a.io_threads,
                exchange: !a.no_exchange,
                strict: StrictMode::RaiseAll,
                progress: fault_progress(a, rank),
                read_method: a.read_method.into(),
            };
            let mut targets = wanted.targets(&model);
            let before = rss::current();
            let reset = rss::reset_peak();
            comm.barrier()?;
            let t0 = Instant::now();
            let rep = if a.objects {
                let reqs = objects::requests(rank)?;
                zarrckpt::load_with_objects(&mut targets, &reqs, &a.dir, comm, &opts)?
            } else {
                load(&mut targets, &a.dir, comm, &opts)?
            };
            let secs = t0.elapsed().as_secs_f64();
            let peak = if reset { rss::peak() } else { 0 };
            drop(targets);
            let verified = wanted.check(&model).and_then(|()| {
                if a.objects {
                    objects::check(rank, &rep.objects)
                } else {
                    Ok(())
                }
            });
            if let Err(e) = &verified {
                eprintln!("worker: rank {rank}: VERIFY FAILED: {e}");
            }
            Ok(json!({
                "rank": rank, "secs": secs, "loaded_bytes": rep.loaded_bytes, "bytes_read": rep.bytes_read,
                "bytes_received": rep.bytes_received, "bytes_sent": rep.bytes_sent,
                "rss_before": before, "peak_rss": peak, "verified": verified.is_ok(),
                "phases": phases_json(&rep.phases),
            }))
        }
    }
}

/// `Job::SaveAsync`: a warm-up save (allocates the staging memory and agrees on the plan, as
/// a job's first checkpoint does), then a plain memcpy of the bytes the save stages into
/// warm memory, then the measured save.
fn save_async(
    a: &Args,
    shared: Arc<dyn Communicator>,
    model: &SynthModel,
) -> anyhow::Result<serde_json::Value> {
    let comm = &*shared;
    let rank = comm.rank();
    let topo = Topology { tp: a.tp, dp: a.dp };
    let held = Held::generate(model, topo, rank as u64);
    let pieces = held.sharded(model);
    let opts = SaveOptions {
        overwrite: a.overwrite,
        io_threads: a.io_threads,
        progress: fault_progress(a, rank),
        ..Default::default()
    };
    let saver_opts = SaverOptions {
        copy_threads: a.io_threads,
        lower_priority: !a.normal_priority,
        ..SaverOptions::default()
    };
    let mut saver = Saver::with_options(Arc::clone(&shared), saver_opts);
    let request = SaveRequest::new().with_tensors(pieces.iter().cloned());
    let warm_dir = a.dir.with_extension("warm");
    let warm = saver.save_async(&request, &warm_dir, &opts)?;
    let staged = usize::try_from(warm.staged_bytes())?;
    warm.wait()?;
    comm.barrier()?;
    if rank == 0 {
        std::fs::remove_dir_all(&warm_dir)
            .with_context(|| format!("remove {}", warm_dir.display()))?;
        // SAFETY: sync takes no arguments and cannot fail.
        unsafe { libc::sync() };
    }
    // The same bytes, from the same buffers, into memory already touched.
    let mut dest = vec![0x5Au8; staged];
    comm.barrier()?;
    let t0 = Instant::now();
    let mut at = 0;
    for p in &pieces {
        let n = p.data().len().min(staged - at);
        dest[at..at + n].copy_from_slice(&p.data()[..n]);
        at += n;
    }
    let memcpy = t0.elapsed().as_secs_f64();
    std::hint::black_box(&dest);
    drop(dest);
    comm.barrier()?;
    let t0 = Instant::now();
    let h = saver.save_async(&request, &a.dir, &opts)?;
    let blocked = t0.elapsed().as_secs_f64();
    let staged_now = h.staged_bytes();
    let rep = h.wait()?;
    let secs = t0.elapsed().as_secs_f64();
    Ok(json!({
        "rank": rank, "secs": secs, "blocked_secs": blocked, "memcpy_secs": memcpy,
        "write_secs": secs - blocked, "staged_bytes": staged_now,
        "file_bytes": rep.file_bytes, "data_bytes": rep.data_bytes,
        "write_balance": rep.write_balance, "plan_reused": rep.plan_reused,
        "plan_secs": rep.plan_time.as_secs_f64(), "gathered_bytes": rep.gathered_bytes,
    }))
}

/// Writes a rank's report next to `path`.
pub fn write_report(path: &Path, rank: usize, report: &serde_json::Value) -> anyhow::Result<()> {
    let p = path.with_extension(format!("{rank}"));
    std::fs::write(&p, serde_json::to_vec(report)?)
        .with_context(|| format!("write {}", p.display()))
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let comm = TcpComm::from_env()
        .context("worker must run under `zarrckpt launch` (or torchrun-style environment)")?;
    let rank = comm.rank();
    let report = run_rank(a, Arc::new(comm))?;
    if let Some(p) = &a.report {
        write_report(p, rank, &report)?;
    }
    let ok = report
        .get("verified")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(true);
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The objects of `worker --objects`: an iteration counter (common), RNG bytes per rank, and
/// a value per pair of ranks (sharded over a grid of 2). Loaders ask for the common value,
/// their own rank's RNG bytes and the shard of `rank % 2`.
mod objects {
    use serde_json::json;
    use zarrckpt::{ObjectRequest, ObjectValue, StateObject};

    fn rng(rank: usize) -> Vec<u8> {
        (0..256u32)
            .map(|i| (i.wrapping_mul(31) ^ (rank as u32).wrapping_mul(97)) as u8)
            .collect()
    }

    pub fn declared(rank: usize) -> anyhow::Result<Vec<StateObject>> {
        let half = rank as u64 % 2;
        Ok(vec![
            StateObject::common("iteration", json!(1234))?,
            StateObject::per_rank("rng", rng(rank))?,
            StateObject::sharded("pair", &[2], &[half], json!({"half": half}))?,
        ])
    }

    pub fn requests(rank: usize) -> anyhow::Result<Vec<ObjectRequest>> {
        Ok(vec![
            ObjectRequest::common("iteration")?,
            ObjectRequest::rank("rng", rank as u64)?,
            ObjectRequest::shard("pair", &[2], &[rank as u64 % 2])?,
        ])
    }

    pub fn check(rank: usize, got: &[Option<ObjectValue>]) -> Result<(), String> {
        let half = rank as u64 % 2;
        let want = [
            Some(ObjectValue::Json(json!(1234))),
            Some(ObjectValue::Bytes(rng(rank))),
            Some(ObjectValue::Json(json!({"half": half}))),
        ];
        if got == want {
            Ok(())
        } else {
            Err(format!("objects differ: {got:?}"))
        }
    }
}

/// A load's phases in seconds: wall time of plan, read and exchange on this rank, and the
/// reading threads' time by step (summed over them).
pub fn phases_json(p: &zarrckpt::LoadPhases) -> serde_json::Value {
    json!({
        "plan_s": p.plan.as_secs_f64(), "read_s": p.read.as_secs_f64(),
        "exchange_s": p.exchange.as_secs_f64(), "io_open_s": p.io.open.as_secs_f64(),
        "io_read_s": p.io.read.as_secs_f64(), "io_checksum_s": p.io.checksum.as_secs_f64(),
        "io_copy_s": p.io.copy.as_secs_f64(),
    })
}
