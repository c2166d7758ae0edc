//! `zarrckpt verify`: read every chunk and check every checksum and the coverage.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use zarrckpt::Checkpoint;

use crate::progress;

/// Arguments of `zarrckpt verify`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory.
    ckpt: PathBuf,
    /// Reading threads (0: number of CPUs, at most 8).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let local = crate::remote::local(&a.ckpt)?;
    let ckpt = Checkpoint::open(local.path())?;
    let total: u64 = ckpt.tensors().iter().map(|t| t.nbytes).sum();
    let pb = progress::bytes(total, "verify");
    let t0 = Instant::now();
    let inc = |n| pb.inc(n);
    let report = ckpt.verify(a.threads, Some(&inc))?;
    pb.finish_and_clear();
    for p in &report.problems {
        match &p.chunk {
            Some(chunk) => eprintln!("PROBLEM tensor `{}` chunk {chunk:?}: {}", p.key, p.error),
            None => eprintln!("PROBLEM `{}`: {}", p.key, p.error),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    if report.problems.is_empty() {
        println!(
            "OK: {} tensors, {} chunks, {} object values, {:.3} GB read in {secs:.2} s; every checksum matches and every chunk is present",
            report.tensors,
            report.chunks,
            report.object_values,
            report.bytes_read as f64 / 1e9
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "FAILED: {} problem(s) in {} tensors / {} chunks",
            report.problems.len(),
            report.tensors,
            report.chunks
        );
        if report.skipped_chunks > 0 {
            println!(
                "{} chunks not checked: their tensor already had {} problems",
                report.skipped_chunks,
                zarrckpt::checkpoint::MAX_PROBLEMS_PER_TENSOR
            );
        }
        Ok(ExitCode::FAILURE)
    }
}
