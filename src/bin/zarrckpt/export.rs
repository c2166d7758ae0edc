//! `zarrckpt export`: a checkpoint's full tensors into one safetensors file.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use safetensors::{Dtype, View};
use zarrckpt::{Checkpoint, TensorKey};

use crate::import::safetensors_dtype;
use crate::progress;

/// Arguments of `zarrckpt export`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory.
    ckpt: PathBuf,
    /// The safetensors file to write (a directory with `--hf` / `--vllm`).
    #[arg(long)]
    out: PathBuf,
    /// Export a Megatron-layout checkpoint as a Hugging Face model (sharded safetensors and
    /// `model.safetensors.index.json`) through a conversion table (`--map`).
    #[arg(long, requires = "map", conflicts_with = "vllm")]
    hf: bool,
    /// Export per-rank files of vLLM's `sharded_state` layout for tensor parallelism `--tp`.
    #[arg(long, requires_all = ["map", "tp"])]
    vllm: bool,
    /// Conversion table: a built-in name (llama, qwen2, qwen3, qwen3_moe, deepseek_v3) or a
    /// JSON file (which may extend a built-in one).
    #[arg(long)]
    map: Option<String>,
    /// HF config.json (default: `--copy-from`'s, else the one the checkpoint holds).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Copy config, tokenizer and other non-weight files from this HF directory.
    #[arg(long)]
    copy_from: Option<PathBuf>,
    /// Largest output file (HF's `max_shard_size`): 5GB, 500MB, 2GiB, ...
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
    /// The layout the checkpoint was saved at, `tp=T,pp=P,ep=E` (default: its metadata),
    /// which fixes the vocabulary padding.
    #[arg(long)]
    megatron: Option<String>,
    /// vLLM tensor parallel size.
    #[arg(long)]
    tp: Option<u64>,
    /// Writer processes, each writing whole files.
    #[arg(long, default_value_t = 1)]
    procs: usize,
    /// Print the plan (per destination: sources, bytes, checks passed) and write nothing.
    #[arg(long)]
    dry_run: bool,
    /// One writer process of `--procs` (internal).
    #[arg(long, hide = true)]
    part: Option<String>,
}

/// A tensor read from the checkpoint only when the writer asks for its bytes, so the export
/// holds one tensor in memory at a time.
struct Lazy<'a> {
    ckpt: &'a Checkpoint,
    key: TensorKey,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    error: &'a RefCell<Option<anyhow::Error>>,
    pb: &'a indicatif::ProgressBar,
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // After the first error nothing more is read, and nothing is made up in its place
        // (the partial file is removed): a damaged index declaring huge tensors costs neither
        // memory nor disk.
        if self.error.borrow().is_some() {
            return Cow::Borrowed(&[]);
        }
        match self.ckpt.read_tensor(&self.key) {
            Ok(v) => {
                self.pb.inc(v.len() as u64);
                Cow::Owned(v)
            }
            Err(e) => {
                self.error.borrow_mut().get_or_insert(anyhow::Error::new(e));
                Cow::Borrowed(&[])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if a.hf {
        return crate::hf::export_hf(
            &a.ckpt,
            // clap requires `--map` with `--hf` and `--vllm`.
            a.map.as_deref().context("--map is required")?,
            &a.out,
            a.config.as_deref(),
            a.copy_from.as_deref(),
            &a.max_shard_size,
            a.megatron.as_deref(),
            a.procs,
            a.part.as_deref(),
            a.dry_run,
        );
    }
    if a.vllm {
        return crate::hf::export_vllm(
            &a.ckpt,
            // clap requires `--map` with `--hf` and `--vllm`.
            a.map.as_deref().context("--map is required")?,
            &a.out,
            a.config.as_deref(),
            a.tp.unwrap_or(1),
            a.megatron.as_deref(),
            a.dry_run,
        );
    }
    let ckpt = Checkpoint::open(&a.ckpt)?;
    let infos = ckpt.tensors();
    let total: u64 = infos.iter().map(|t| t.nbytes).sum();
    let pb = progress::bytes(total, "export");
    let error = RefCell::new(None);
    let views: Vec<(String, Lazy)> = infos
        .iter()
        .map(|t| {
            let lazy = Lazy {
                ckpt: &ckpt,
                key: t.key.clone(),
                dtype: safetensors_dtype(t.dtype),
                shape: t.shape.iter().map(|&d| d as usize).collect(),
                len: t.nbytes as usize,
                error: &error,
                pb: &pb,
            };
            (t.key.to_string(), lazy)
        })
        .collect();
    let meta: Option<HashMap<String, String>> =
        ckpt.meta().user.get("safetensors_metadata").and_then(|m| {
            m.as_object().map(|o| {
                o.iter()
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned())))
                    .collect()
            })
        });
    let t0 = Instant::now();
    let tmp = a.out.with_extension("safetensors.partial");
    let written = safetensors::serialize_to_file(views, meta, &tmp)
        .with_context(|| format!("write {}", tmp.display()));
    pb.finish_and_clear();
    if let Some(e) = error.into_inner() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("reading {}", a.ckpt.display())));
    }
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &a.out).with_context(|| format!("rename to {}", a.out.display()))?;
    println!(
        "exported {} tensors ({:.3} GB) to {} in {:.2} s",
        infos.len(),
        total as f64 / 1e9,
        a.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
