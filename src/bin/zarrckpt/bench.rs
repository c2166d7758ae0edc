//! `zarrckpt bench` (placeholder while the measurement code lands).

use std::process::ExitCode;

/// Arguments of `zarrckpt bench`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: &Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not yet")
}
