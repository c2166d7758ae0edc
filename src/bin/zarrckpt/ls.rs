//! `zarrckpt ls ROOT`: the step checkpoints under a manager's root: step, state, size, and
//! which one is the latest committed.

use std::path::PathBuf;
use std::process::ExitCode;

use zarrckpt::{CheckpointManager, ManagerOptions};

/// Arguments of `zarrckpt ls`.
#[derive(clap::Args)]
pub struct Args {
    /// The root directory holding `step-NNNNNNNN` checkpoints.
    root: PathBuf,
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    #[cfg(feature = "object-store")]
    if zarrckpt::remote::is_url(&a.root.to_string_lossy()) {
        return crate::remote::ls(&a.root.to_string_lossy());
    }
    // Listing is local: a one-process saver that never saves.
    let one = std::sync::Arc::new(zarrckpt::LocalComm::single());
    let m = CheckpointManager::new(
        &a.root,
        zarrckpt::Saver::new(one),
        ManagerOptions::default(),
    );
    let steps = m.steps()?;
    let latest = m.latest()?;
    println!("{:>12}  {:<10}  {:>12}  dir", "step", "state", "bytes");
    for s in &steps {
        let state = if s.complete { "complete" } else { "INCOMPLETE" };
        let mark = if Some(s.step) == latest {
            "  <- latest"
        } else {
            ""
        };
        println!(
            "{:>12}  {state:<10}  {:>12}  {}{mark}",
            s.step,
            s.bytes,
            s.dir.display()
        );
    }
    match latest {
        Some(l) => println!("latest complete step: {l}"),
        None => println!("no complete step under {}", a.root.display()),
    }
    Ok(ExitCode::SUCCESS)
}
