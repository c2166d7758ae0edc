//! Conversion front door: `export --hf`, `export --vllm`, `import --hf`, `inspect --map`
//! (spec § 19). Planning, reading and writing live in `zarrckpt::convert`; this module turns
//! arguments into options and prints plans and summaries.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use zarrckpt::convert::hf::{parse_layout, parse_size};
use zarrckpt::convert::{
    ExportOptions, HfExport, HfImport, VllmExport, WriteOptions, load_checked,
};

/// What `export --hf` and `export --vllm` were asked.
pub struct Export<'a> {
    /// The checkpoint.
    pub ckpt: &'a Path,
    /// The table.
    pub map: &'a str,
    /// The output folder.
    pub out: &'a Path,
    /// config.json.
    pub config: Option<&'a Path>,
    /// The HF folder to copy the model's other files from.
    pub copy_from: Option<&'a Path>,
    /// Largest file.
    pub max_shard_size: &'a str,
    /// The saved layout.
    pub megatron: Option<&'a str>,
    /// Writer threads.
    pub procs: usize,
    /// Print the plan only.
    pub dry_run: bool,
}

impl Export<'_> {
    fn options(&self) -> anyhow::Result<ExportOptions> {
        Ok(ExportOptions {
            config: self.config.map(Path::to_owned),
            copy_from: self.copy_from.map(PathBuf::from),
            max_shard_bytes: parse_size(self.max_shard_size)?,
            layout: self.megatron.map(parse_layout).transpose()?,
            write: WriteOptions {
                writers: self.procs,
                // Measured on 2 shared cores, reading the next batch in a second thread while
                // writing was slower than not (bench-convert), so it is opt-in.
                pipeline: std::env::var("ZARRCKPT_CONVERT_PIPELINE").is_ok_and(|v| v == "1"),
            },
        })
    }
}

/// `export --hf`.
pub fn export_hf(a: &Export<'_>) -> anyhow::Result<ExitCode> {
    let e = HfExport::plan(a.ckpt, &load_checked(a.map)?, a.options()?)?;
    run_export(
        a.dry_run,
        || e.describe(),
        || {
            let r = e.write(a.out)?;
            Ok(e.summary(a.out, &r))
        },
    )
}

/// `export --vllm`.
pub fn export_vllm(a: &Export<'_>, tp: u64) -> anyhow::Result<ExitCode> {
    let e = VllmExport::plan(a.ckpt, &load_checked(a.map)?, tp, a.options()?)?;
    run_export(
        a.dry_run,
        || e.describe(),
        || {
            let r = e.write(a.out)?;
            Ok(e.summary(a.out, &r))
        },
    )
}

/// Prints a planned export's description (`--dry-run`), or writes it and prints its summary.
fn run_export(
    dry_run: bool,
    describe: impl FnOnce() -> String,
    write: impl FnOnce() -> anyhow::Result<String>,
) -> anyhow::Result<ExitCode> {
    if dry_run {
        print!("{}", describe());
    } else {
        println!("{}", write()?);
    }
    Ok(ExitCode::SUCCESS)
}

/// `import --hf`.
pub fn import_hf(
    hf: &Path,
    map: &str,
    megatron: &str,
    out: &Path,
    overwrite: bool,
    procs: usize,
    dry_run: bool,
) -> anyhow::Result<ExitCode> {
    let i = HfImport::plan(hf, &load_checked(map)?, parse_layout(megatron)?)?;
    if dry_run {
        print!("{}", i.describe());
    } else {
        let r = i.write(out, overwrite, procs)?;
        println!("{}", i.summary(out, &r));
    }
    Ok(ExitCode::SUCCESS)
}

/// `inspect --map`: the HF export plan of a checkpoint.
pub fn inspect_map(
    ckpt: &Path,
    map: &str,
    config: Option<&Path>,
    megatron: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let opts = ExportOptions {
        config: config.map(Path::to_owned),
        max_shard_bytes: u64::MAX,
        layout: megatron.map(parse_layout).transpose()?,
        ..ExportOptions::default()
    };
    print!(
        "{}",
        HfExport::plan(ckpt, &load_checked(map)?, opts)?.inspect()
    );
    Ok(ExitCode::SUCCESS)
}
