//! `zarrckpt worker`: one rank of a synthetic save or load, for `bench --processes`, the
//! multi-process tests and fault injection. Run under `zarrckpt launch` (reads RANK,
//! WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::Context;
use serde_json::json;
use zarrckpt::synth::{Held, SynthModel, Topology, Wanted};
use zarrckpt::{
    Communicator, LoadOptions, ReadMethod, SaveOptions, StrictMode, TcpComm, load, save,
};

use crate::rss;

/// What a worker does.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Job {
    /// Save the synthetic model.
    Save,
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
    /// Load: how shard files are read.
    #[arg(long, value_enum, default_value_t = ReadArg::Pread)]
    pub read_method: ReadArg,
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
    let limit = a.die_after_bytes?;
    if rank != a.die_rank {
        return None;
    }
    let done = Arc::new(AtomicU64::new(0));
    Some(Arc::new(move |n| {
        if done.fetch_add(n, Ordering::SeqCst) + n >= limit {
            eprintln!("worker: rank {rank} dies now (fault injection)");
            std::process::exit(86);
        }
    }))
}

/// Runs one rank of `a.job` on `comm`; returns its report.
pub fn run_rank(a: &Args, comm: &dyn Communicator) -> anyhow::Result<serde_json::Value> {
    let rank = comm.rank();
    let topo = Topology { tp: a.tp, dp: a.dp };
    anyhow::ensure!(
        topo.world() == comm.world_size() as u64,
        "tp {} x dp {} is not the world size {}",
        a.tp,
        a.dp,
        comm.world_size()
    );
    let model = SynthModel::gpt_with(a.size, a.hidden, if a.rows_only { 0 } else { 1 });
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
            let rep = save(&pieces, &a.dir, comm, &opts)?;
            let secs = t0.elapsed().as_secs_f64();
            Ok(json!({
                "rank": rank, "secs": secs, "file_bytes": rep.file_bytes, "data_bytes": rep.data_bytes,
                "write_balance": rep.write_balance, "bytes_per_rank": rep.bytes_per_rank,
                "plan_secs": rep.plan_time.as_secs_f64(), "gathered_bytes": rep.gathered_bytes,
            }))
        }
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
            let rep = load(&mut targets, &a.dir, comm, &opts)?;
            let secs = t0.elapsed().as_secs_f64();
            let peak = if reset { rss::peak() } else { 0 };
            drop(targets);
            let verified = wanted.check(&model);
            if let Err(e) = &verified {
                eprintln!("worker: rank {rank}: VERIFY FAILED: {e}");
            }
            Ok(json!({
                "rank": rank, "secs": secs, "loaded_bytes": rep.loaded_bytes, "bytes_read": rep.bytes_read,
                "bytes_received": rep.bytes_received, "bytes_sent": rep.bytes_sent,
                "rss_before": before, "peak_rss": peak, "verified": verified.is_ok(),
            }))
        }
    }
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
    let report = run_rank(a, &comm)?;
    if let Some(p) = &a.report {
        write_report(p, comm.rank(), &report)?;
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
