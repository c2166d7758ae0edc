//! Hugging Face folders: export a Megatron-layout checkpoint as safetensors shards and
//! `model.safetensors.index.json` (as `save_pretrained` writes them), import a folder into a
//! Megatron layout, and what both need (the checkpoint's saved layout and HF config, the
//! model's non-weight files).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::check::Inventory;
use super::describe::describe;
use super::error::FormatError;
use super::expand::Layout;
use super::plan::{Plan, plan_hf_export};
use super::table::Table;
use super::write::{WriteOptions, WriteStats, file_per_group, write_files};
use crate::Checkpoint;

/// Where the zarrckpt checkpoint of a Megatron checkpoint directory is: `DIR/zarrckpt` when it
/// is a `zarrckpt.megatron` directory, else `DIR` itself.
#[must_use]
pub fn ckpt_dir(dir: &Path) -> PathBuf {
    let sub = dir.join("zarrckpt");
    if sub.join("zarr.json").exists() {
        sub
    } else {
        dir.to_owned()
    }
}

/// Opens the checkpoint of a Megatron checkpoint directory (see [`ckpt_dir`]).
///
/// # Errors
/// [`FormatError::Checkpoint`].
pub fn open_checkpoint(dir: &Path) -> Result<Checkpoint, FormatError> {
    let d = ckpt_dir(dir);
    Checkpoint::open(&d).map_err(FormatError::ckpt(&d))
}

/// The tensors of a checkpoint as an inventory.
#[must_use]
pub fn inventory(ck: &Checkpoint) -> Inventory {
    ck.tensors()
        .into_iter()
        .map(|t| (t.key.to_string(), (t.dtype.to_string(), t.shape)))
        .collect()
}

/// The layout a checkpoint was saved at: `given`, else its `megatron` metadata (`tp`, `pp`,
/// `ep`; each 1 when absent).
///
/// # Errors
/// [`FormatError::Option`] for a metadata value that is not a positive integer.
pub fn saved_layout(ck: &Checkpoint, given: Option<Layout>) -> Result<Layout, FormatError> {
    if let Some(g) = given {
        return Ok(g);
    }
    let m = ck.meta().user.get("megatron");
    let get = |k: &'static str| {
        match m.and_then(|m| m.get(k)) {
        None => Ok(1),
        Some(v) => v.as_u64().filter(|&n| n > 0).ok_or(FormatError::Option {
            option: "layout",
            msg: format!("the checkpoint's metadata says megatron.{k} = {v}, not a positive integer; pass the layout"),
        }),
    }
    };
    Ok(Layout {
        tp: get("tp")?,
        pp: get("pp")?,
        ep: get("ep")?,
    })
}

/// Reads a JSON file.
///
/// # Errors
/// [`FormatError::Io`], [`FormatError::Json`].
pub fn read_json(p: &Path) -> Result<serde_json::Value, FormatError> {
    let t = std::fs::read_to_string(p).map_err(FormatError::io("read", p))?;
    serde_json::from_str(&t).map_err(|e| FormatError::Json {
        path: p.to_owned(),
        msg: e.to_string(),
    })
}

/// The HF config: `config`, else `copy_from/config.json`, else the checkpoint's `hf_config`
/// metadata (written by an HF import).
///
/// # Errors
/// [`FormatError::NoConfig`] when none is found; reading errors.
pub fn hf_config(
    ck: Option<&Checkpoint>,
    config: Option<&Path>,
    copy_from: Option<&Path>,
) -> Result<serde_json::Value, FormatError> {
    if let Some(c) = config {
        return read_json(c);
    }
    if let Some(d) = copy_from {
        let c = d.join("config.json");
        if c.exists() {
            return read_json(&c);
        }
    }
    ck.and_then(|c| c.meta().user.get("hf_config"))
        .cloned()
        .ok_or(FormatError::NoConfig)
}

/// A size like `5GB`, `500MB`, `1GiB`, `123`.
///
/// # Errors
/// [`FormatError::Option`] for a size that does not parse or exceeds 64 bits.
pub fn parse_size(s: &str) -> Result<u64, FormatError> {
    let bad = |msg: String| FormatError::Option {
        option: "max shard size",
        msg,
    };
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n.parse().map_err(|e| bad(format!("size `{s}`: {e}")))?;
    let m: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        u => {
            return Err(bad(format!(
                "size `{s}`: unknown unit `{u}` (B, KB, MB, GB, KiB, MiB, GiB)"
            )));
        }
    };
    n.checked_mul(m)
        .filter(|&b| b > 0)
        .ok_or_else(|| bad(format!("size `{s}` is zero or exceeds 64 bits")))
}

/// Copies the non-weight files of a model folder (config, tokenizer, generation config, ...:
/// every regular file not hidden, not `*.safetensors` and not the index) into `out`.
///
/// # Errors
/// [`FormatError::Io`].
pub fn copy_model_files(from: &Path, out: &Path) -> Result<(), FormatError> {
    for e in std::fs::read_dir(from).map_err(FormatError::io("read", from))? {
        let e = e.map_err(FormatError::io("read", from))?;
        let n = e.file_name().to_string_lossy().into_owned();
        let is_file = e
            .file_type()
            .map_err(FormatError::io("stat", &e.path()))?
            .is_file();
        if is_file
            && !n.starts_with('.')
            && !n.ends_with(".safetensors")
            && n != "model.safetensors.index.json"
        {
            std::fs::copy(e.path(), out.join(&n)).map_err(FormatError::io("copy", &e.path()))?;
        }
    }
    Ok(())
}

/// Writes `config.json` into `out` unless `copy_from` gives the model's own files.
fn model_files(
    out: &Path,
    copy_from: Option<&Path>,
    cfg: &serde_json::Value,
) -> Result<(), FormatError> {
    match copy_from {
        Some(d) => copy_model_files(d, out),
        None => {
            let p = out.join("config.json");
            let text = serde_json::to_string_pretty(cfg).map_err(|e| FormatError::Json {
                path: p.clone(),
                msg: e.to_string(),
            })? + "\n";
            std::fs::write(&p, text).map_err(FormatError::io("write", &p))
        }
    }
}

/// Options of an export (HF or vLLM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportOptions {
    /// The HF config.json (default: `copy_from`'s, else the one the checkpoint holds).
    pub config: Option<PathBuf>,
    /// Copy the model's non-weight files (config, tokenizer, ...) from this HF folder; without
    /// it `config.json` is written from the config used.
    pub copy_from: Option<PathBuf>,
    /// Largest output file in bytes (HF's `max_shard_size`; a tensor larger than it gets a
    /// file of its own).
    pub max_shard_bytes: u64,
    /// The layout the checkpoint was saved at (default: its metadata), which fixes the
    /// vocabulary padding.
    pub layout: Option<Layout>,
    /// Writers and batch pipelining.
    pub write: WriteOptions,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            config: None,
            copy_from: None,
            max_shard_bytes: 5_000_000_000,
            layout: None,
            write: WriteOptions::default(),
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportReport {
    /// Destination tensors.
    pub tensors: usize,
    /// Files written.
    pub files: usize,
    /// Reading and writing.
    pub stats: WriteStats,
    /// Per group (file, rank): bytes read and written, as planned.
    pub per_group: BTreeMap<usize, (u64, u64)>,
    /// Planning time.
    pub planning: Duration,
    /// The whole export, planning included.
    pub elapsed: Duration,
}

/// The source side of an export (HF or vLLM): the checkpoint opened, the HF config and the
/// saved layout found, the options.
pub(crate) struct ExportSource {
    pub(crate) path: PathBuf,
    pub(crate) ck: Checkpoint,
    pub(crate) table_name: String,
    pub(crate) cfg: serde_json::Value,
    pub(crate) saved: Layout,
    pub(crate) opts: ExportOptions,
    pub(crate) started: Instant,
}

impl ExportSource {
    /// Opens the checkpoint at `ckpt` (a Megatron checkpoint directory or its zarrckpt
    /// folder) for an export through `table`.
    pub(crate) fn open(
        ckpt: &Path,
        table: &Table,
        opts: ExportOptions,
    ) -> Result<ExportSource, FormatError> {
        let started = Instant::now();
        let ck = open_checkpoint(ckpt)?;
        let cfg = hf_config(Some(&ck), opts.config.as_deref(), opts.copy_from.as_deref())?;
        let saved = saved_layout(&ck, opts.layout)?;
        Ok(ExportSource {
            path: ckpt.to_owned(),
            ck,
            table_name: table.name.clone(),
            cfg,
            saved,
            opts,
            started,
        })
    }

    /// The checkpoint's tensors.
    pub(crate) fn inventory(&self) -> Inventory {
        inventory(&self.ck)
    }

    /// Writes `files` of `plan` into `out`, then the model's config (and, with `copy_from`,
    /// its other non-weight files).
    pub(crate) fn write(
        &self,
        plan: &Plan,
        files: &[super::write::OutFile],
        out: &Path,
    ) -> Result<ExportReport, FormatError> {
        let planning = self.started.elapsed();
        std::fs::create_dir_all(out).map_err(FormatError::io("create", out))?;
        let stats = write_files(&self.ck, plan, files, out, self.opts.write)?;
        model_files(out, self.opts.copy_from.as_deref(), &self.cfg)?;
        Ok(ExportReport {
            tensors: plan.dests.len(),
            files: files.len(),
            stats,
            per_group: plan.bytes_per_group(),
            planning,
            elapsed: self.started.elapsed(),
        })
    }
}

/// A planned HF export of a Megatron-layout checkpoint: checked from metadata alone, nothing
/// read or written yet.
pub struct HfExport {
    src: ExportSource,
    plan: Plan,
}

impl HfExport {
    /// Plans the export of the checkpoint at `ckpt` (a Megatron checkpoint directory or its
    /// zarrckpt folder) through `table`.
    ///
    /// # Errors
    /// [`FormatError::Plan`] for a refused conversion (rule, key and numbers); opening and
    /// reading errors.
    pub fn plan(ckpt: &Path, table: &Table, opts: ExportOptions) -> Result<HfExport, FormatError> {
        let src = ExportSource::open(ckpt, table, opts)?;
        let inv = src.inventory();
        let plan = plan_hf_export(table, &src.cfg, src.saved, &inv, src.opts.max_shard_bytes)?;
        Ok(HfExport { src, plan })
    }

    /// The plan.
    #[must_use]
    pub fn plan_ref(&self) -> &Plan {
        &self.plan
    }

    /// The number of files.
    #[must_use]
    pub fn files(&self) -> usize {
        self.plan.dests.last().map_or(0, |d| d.group + 1)
    }

    /// The name of file `g`: `model.safetensors`, or `model-0000k-of-0000N.safetensors`.
    #[must_use]
    pub fn file_name(&self, g: usize) -> String {
        let n = self.files();
        if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", g + 1, n)
        }
    }

    /// The plan as the dry run prints it.
    #[must_use]
    pub fn describe(&self) -> String {
        describe(
            &self.plan,
            &format!(
                "export {} -> HF ({} files) with table `{}`",
                self.src.path.display(),
                self.files(),
                self.src.table_name
            ),
            "file",
        )
    }

    /// The plan as `inspect --map` prints it (the file split aside).
    #[must_use]
    pub fn inspect(&self) -> String {
        describe(
            &self.plan,
            &format!(
                "{} as HF with table `{}` (saved at {})",
                self.src.path.display(),
                self.src.table_name,
                self.src.saved
            ),
            "file",
        )
    }

    /// Writes the files, the index (several files) and the model's other files into `out`.
    ///
    /// # Errors
    /// Reading the checkpoint, writing the files.
    pub fn write(&self, out: &Path) -> Result<ExportReport, FormatError> {
        let files = file_per_group(&self.plan, &|g| self.file_name(g));
        let mut report = self.src.write(&self.plan, &files, out)?;
        if files.len() > 1 {
            let total: u64 = self.plan.dests.iter().map(|d| d.nbytes()).sum();
            let weight_map: BTreeMap<&str, String> = self
                .plan
                .dests
                .iter()
                .map(|d| (d.name.as_str(), self.file_name(d.group)))
                .collect();
            let index =
                serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            let p = out.join("model.safetensors.index.json");
            let text = serde_json::to_string_pretty(&index).map_err(|e| FormatError::Json {
                path: p.clone(),
                msg: e.to_string(),
            })? + "\n";
            std::fs::write(&p, text).map_err(FormatError::io("write", &p))?;
            report.elapsed = self.src.started.elapsed();
        }
        Ok(report)
    }

    /// The summary line of a finished export.
    #[must_use]
    pub fn summary(&self, out: &Path, r: &ExportReport) -> String {
        let total: u64 = self.plan.dests.iter().map(|d| d.nbytes()).sum();
        format!(
            "exported {} tensors ({:.3} GB, {} file(s)) to {} in {:.2} s (planning {:.3} s){}{}",
            r.tensors,
            total as f64 / 1e9,
            r.files,
            out.display(),
            r.elapsed.as_secs_f64(),
            r.planning.as_secs_f64(),
            writers(&r.stats),
            if r.stats.bytes_read > 0 {
                format!(
                    "; read {:.3} GB (amplification {:.3})",
                    r.stats.bytes_read as f64 / 1e9,
                    r.stats.bytes_read as f64 / r.stats.bytes_written.max(1) as f64
                )
            } else {
                String::new()
            }
        )
    }
}

/// `, N writers` for more than one.
pub(crate) fn writers(s: &WriteStats) -> String {
    if s.writers > 1 {
        format!(", {} writers", s.writers)
    } else {
        String::new()
    }
}

/// Why a layout string does not parse, as an option error.
///
/// # Errors
/// [`FormatError::Option`].
pub fn parse_layout(s: &str) -> Result<Layout, FormatError> {
    s.parse::<Layout>().map_err(|msg| FormatError::Option {
        option: "layout",
        msg,
    })
}
