//! `zarrckpt import --dcp DIR`: a PyTorch DCP checkpoint (or, with `--megatron`, a Megatron-LM
//! `torch_dist` one) into zarrckpt, through the Python package's importer
//! (`python -m zarrckpt.migrate`): that format is read with torch's own DCP reader.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};

/// What `zarrckpt import --dcp` was asked.
pub struct Request<'a> {
    /// The DCP (or `torch_dist`) checkpoint directory.
    pub dir: &'a Path,
    /// The checkpoint to write.
    pub out: &'a Path,
    /// `dir` is a Megatron-LM `torch_dist` checkpoint.
    pub megatron: bool,
    /// Split every tensor this many ways along its first axis (default: the source's chunks).
    pub ranks: Option<u64>,
    /// Unpickle non-tensor values with torch's unrestricted unpickler.
    pub trust_pickles: bool,
    /// Replace an existing checkpoint.
    pub overwrite: bool,
    /// Chunk compression: none, zstd or blosc.
    pub compression: &'a str,
}

/// The Python interpreter to run: `$ZARRCKPT_PYTHON`, else `python3` on the `PATH`.
fn python() -> PathBuf {
    std::env::var_os("ZARRCKPT_PYTHON")
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from("python3"), PathBuf::from)
}

pub fn run(r: &Request<'_>) -> anyhow::Result<ExitCode> {
    crate::import::parse_compression(r.compression)?;
    if r.ranks == Some(0) {
        bail!("--ranks must be at least 1");
    }
    if !r.dir.is_dir() {
        bail!("{}: not a directory", r.dir.display());
    }
    let py = python();
    let probe = if r.megatron {
        "import zarrckpt.dcp, megatron.core"
    } else {
        "import zarrckpt.dcp"
    };
    let check = Command::new(&py)
        .args(["-c", probe])
        .output()
        .with_context(|| {
            format!(
                "cannot run `{}` (set ZARRCKPT_PYTHON to a Python with the zarrckpt package and \
                 torch; scripts/build-python.sh prints one)",
                py.display()
            )
        })?;
    if !check.status.success() {
        let err = String::from_utf8_lossy(&check.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        bail!(
            "`{}` cannot `{probe}`: {last}\nthe DCP importer runs in Python with the zarrckpt \
             package and torch{}; set ZARRCKPT_PYTHON to such a Python (scripts/build-python.sh \
             prints one)",
            py.display(),
            if r.megatron { " and megatron-core" } else { "" }
        );
    }
    let mut cmd = Command::new(&py);
    cmd.args(["-m", "zarrckpt.migrate"])
        .arg(r.dir)
        .arg("--out")
        .arg(r.out);
    if r.megatron {
        cmd.arg("--megatron");
    }
    if let Some(n) = r.ranks {
        cmd.arg("--ranks").arg(n.to_string());
    }
    if r.trust_pickles {
        cmd.arg("--trust-pickles");
    }
    if r.overwrite {
        cmd.arg("--overwrite");
    }
    cmd.args(["--compression", r.compression]);
    let status = cmd
        .status()
        .with_context(|| format!("run `{}` -m zarrckpt.migrate", py.display()))?;
    Ok(if status.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
