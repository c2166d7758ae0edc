//! `zarrckpt launch -n N -- COMMAND ...`: N local processes with torchrun's environment.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use crate::launcher::{LaunchError, LaunchOptions, launch};

/// Arguments of `zarrckpt launch`.
#[derive(clap::Args)]
pub struct Args {
    /// Number of processes (ranks).
    #[arg(short = 'n', long = "nproc", default_value_t = 1)]
    n: usize,
    /// `MASTER_PORT` for the ranks (default: a free port).
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks after a failure.
    #[arg(long, default_value_t = 5)]
    grace: u64,
    /// Let the other ranks run on when one fails (they must notice the failure themselves);
    /// the exit status still reports the first failure.
    #[arg(long)]
    no_fail_fast: bool,
    /// Stop everything after this many seconds.
    #[arg(long)]
    timeout: Option<u64>,
    /// The command every rank runs, after `--`.
    #[arg(required = true, last = true)]
    command: Vec<OsString>,
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let opts = LaunchOptions {
        master_port: a.master_port,
        grace: Duration::from_secs(a.grace),
        timeout: a.timeout.map(Duration::from_secs),
        fail_fast: !a.no_fail_fast,
        ..Default::default()
    };
    match launch(a.n, &a.command, &opts) {
        Ok(summary) => {
            eprintln!(
                "launch: {} ranks exited 0 in {:.2} s",
                a.n,
                summary.elapsed.as_secs_f64()
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ LaunchError::RankFailed { .. }) => {
            eprintln!("launch: {e}");
            Ok(ExitCode::FAILURE)
        }
        Err(e) => Err(e.into()),
    }
}
