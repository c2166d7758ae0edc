//! vLLM's `sharded_state` folders: per tensor-parallel rank, the tensors vLLM's
//! `ShardedStateLoader` reads (`model-rank-{r}-part-{p}.safetensors`, each part at most the
//! largest file size; a tensor larger than it gets a part of its own), with the model's
//! config and tokenizer files beside them so that `LLM(model=DIR,
//! load_format="sharded_state")` can open the folder, as vLLM's own saving script leaves it.

use std::path::Path;

use super::describe::describe;
use super::error::FormatError;
use super::hf::{ExportOptions, ExportReport, ExportSource};
use super::plan::{Plan, plan_vllm};
use super::table::Table;
use super::write::OutFile;

/// A planned vLLM export of a Megatron-layout checkpoint: checked from metadata alone.
pub struct VllmExport {
    src: ExportSource,
    version: String,
    tp: u64,
    plan: Plan,
}

impl VllmExport {
    /// Plans the per-rank files of the checkpoint at `ckpt` for vLLM tensor parallelism `tp`.
    ///
    /// # Errors
    /// [`FormatError::Plan`] for a refused conversion; opening and reading errors.
    pub fn plan(
        ckpt: &Path,
        table: &Table,
        tp: u64,
        opts: ExportOptions,
    ) -> Result<VllmExport, FormatError> {
        let src = ExportSource::open(ckpt, table, opts)?;
        let plan = plan_vllm(table, &src.cfg, src.saved, &src.inventory(), tp)?;
        Ok(VllmExport {
            src,
            version: table
                .vllm
                .as_ref()
                .and_then(|v| v.version.clone())
                .unwrap_or_default(), // optional in the table: empty, as `version` says
            tp,
            plan,
        })
    }

    /// The plan.
    #[must_use]
    pub fn plan_ref(&self) -> &Plan {
        &self.plan
    }

    /// The vLLM version whose layout the table writes; empty when the table names none.
    #[must_use]
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The plan as the dry run prints it.
    #[must_use]
    pub fn describe(&self) -> String {
        describe(
            &self.plan,
            &format!(
                "export {} -> vLLM TP {} ({}) with table `{}`",
                self.src.path.display(),
                self.tp,
                self.version,
                self.src.table_name
            ),
            "rank",
        )
    }

    /// The files: each rank's tensors in plan order, cut into parts of at most the largest
    /// file size.
    #[must_use]
    pub fn files(&self) -> Vec<OutFile> {
        let mut files: Vec<OutFile> = Vec::new();
        let mut size = 0u64;
        for (i, d) in self.plan.dests.iter().enumerate() {
            let n = d.nbytes();
            let part = match files.last() {
                Some(f) if f.group == d.group => {
                    if size > 0 && size.saturating_add(n) > self.src.opts.max_shard_bytes {
                        Some(files.iter().filter(|f| f.group == d.group).count())
                    } else {
                        None
                    }
                }
                _ => Some(0),
            };
            if let Some(p) = part {
                files.push(OutFile {
                    name: format!("model-rank-{}-part-{p}.safetensors", d.group),
                    group: d.group,
                    dests: vec![],
                });
                size = 0;
            }
            size += n;
            if let Some(f) = files.last_mut() {
                f.dests.push(i);
            }
        }
        files
    }

    /// Writes the per-rank files and the model's config (and, with `copy_from`, its other
    /// non-weight files) into `out`.
    ///
    /// # Errors
    /// Reading the checkpoint, writing the files.
    pub fn write(&self, out: &Path) -> Result<ExportReport, FormatError> {
        self.src.write(&self.plan, &self.files(), out)
    }

    /// The summary line of a finished export.
    #[must_use]
    pub fn summary(&self, out: &Path, r: &ExportReport) -> String {
        let s = &r.stats;
        format!(
            "wrote vLLM TP {} per-rank files ({}, {} file(s){}) to {} in {:.2} s: {:.3} GB written, {:.3} GB read (amplification {:.3}); per rank read/written: {}",
            self.tp,
            self.version,
            r.files,
            super::hf::writers(s),
            out.display(),
            r.elapsed.as_secs_f64(),
            s.bytes_written as f64 / 1e9,
            s.bytes_read as f64 / 1e9,
            s.bytes_read as f64 / s.bytes_written.max(1) as f64,
            r.per_group
                .iter()
                .map(|(r, (a, b))| format!("{r}: {a}/{b}"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}
