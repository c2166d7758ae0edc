//! `zarrckpt recover DIR`: the recovery rules of spec section 10.5, applied on request under
//! the save lock. R-a puts back a previous checkpoint that an interrupted save parked next to
//! `DIR`; R-b removes leftovers of crashed saves (staging directories, parked previous
//! checkpoints once `DIR` exists). Read-only commands never do R-b; the next save does.

use std::path::PathBuf;
use std::process::ExitCode;

use zarrckpt::storage::commit;

/// Arguments of `zarrckpt recover`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory (it may be missing, when an interrupted save parked it).
    dir: PathBuf,
    /// Only list what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let plan = if a.dry_run {
        commit::plan_recovery(&a.dir)?
    } else {
        let lock = commit::try_lock(&a.dir)?;
        commit::recover(&a.dir, &lock)?
    };
    let verb = |now: &str, later: &str| if a.dry_run { later } else { now }.to_owned();
    if let Some(old) = &plan.restore {
        println!(
            "{} {} -> {}",
            verb("restored", "would restore"),
            old.display(),
            a.dir.display()
        );
    }
    for p in &plan.remove {
        println!("{} {}", verb("removed", "would remove"), p.display());
    }
    if plan.is_empty() {
        println!("nothing to recover at {}", a.dir.display());
    }
    Ok(ExitCode::SUCCESS)
}
