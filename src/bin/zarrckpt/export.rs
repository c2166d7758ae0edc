//! `zarrckpt export`: a checkpoint's full tensors into one safetensors file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use zarrckpt::convert::FormatError;
use zarrckpt::convert::safetensors::{Entry, canonical_order, write_file};
use zarrckpt::{Checkpoint, TensorKey};

use crate::progress;

/// Arguments of `zarrckpt export`. The conversion options need `--hf` or `--vllm`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("conversion").args(["hf", "vllm"])))]
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
    #[arg(long, requires = "conversion")]
    map: Option<String>,
    /// HF config.json (default: `--copy-from`'s, else the one the checkpoint holds).
    #[arg(long, requires = "conversion")]
    config: Option<PathBuf>,
    /// Copy config, tokenizer, generation config and the other non-weight files from this
    /// HF directory (default: write `config.json` only).
    #[arg(long, requires = "conversion")]
    copy_from: Option<PathBuf>,
    /// Largest output file (HF's `max_shard_size`; with `--vllm`, each rank's parts):
    /// 5GB, 500MB, 2GiB, ... [default: 5GB]
    #[arg(long, requires = "conversion")]
    max_shard_size: Option<String>,
    /// The layout the checkpoint was saved at, `tp=T,pp=P,ep=E` (default: its metadata),
    /// which fixes the vocabulary padding.
    #[arg(long, requires = "conversion")]
    megatron: Option<String>,
    /// vLLM tensor parallel size.
    #[arg(long, requires = "vllm")]
    tp: Option<u64>,
    /// Parallel writers, each writing whole files (`--hf`) or whole ranks (`--vllm`)
    /// [default: 1].
    #[arg(long, requires = "conversion")]
    procs: Option<usize>,
    /// Print the plan (per destination: sources, bytes, checks passed) and write nothing.
    #[arg(long, requires = "conversion")]
    dry_run: bool,
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    // clap lets `--tp` through next to `--hf` (which conflicts with `--vllm`).
    if a.tp.is_some() && !a.vllm {
        anyhow::bail!("--tp is vLLM's tensor parallel size: it needs --vllm");
    }
    let local = crate::remote::local(&a.ckpt)?;
    if a.hf || a.vllm {
        let req = crate::hf::Export {
            ckpt: local.path(),
            map: a.map.as_deref().unwrap_or_default(),
            out: &a.out,
            config: a.config.as_deref(),
            copy_from: a.copy_from.as_deref(),
            max_shard_size: a.max_shard_size.as_deref().unwrap_or("5GB"),
            megatron: a.megatron.as_deref(),
            procs: a.procs.unwrap_or(1),
            dry_run: a.dry_run,
        };
        return match a.tp {
            Some(tp) if a.vllm => crate::hf::export_vllm(&req, tp),
            _ => crate::hf::export_hf(&req),
        };
    }
    let ckpt = Checkpoint::open(local.path())?;
    let infos = ckpt.tensors();
    let total: u64 = infos.iter().map(|t| t.nbytes).sum();
    let pb = progress::bytes(total, "export");
    // The order and header the safetensors library writes, so that an imported file comes
    // back byte for byte.
    let mut entries: Vec<Entry> = infos
        .iter()
        .map(|t| Entry {
            name: t.key.to_string(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    canonical_order(&mut entries);
    let meta = ckpt
        .meta()
        .user
        .get("safetensors_metadata")
        .and_then(serde_json::Value::as_object);
    let t0 = Instant::now();
    // One tensor in memory at a time; after an error nothing more is read and the partial
    // file is removed, so a damaged index declaring huge tensors costs neither memory nor disk.
    let written = write_file(&a.out, &entries, meta, |i, sink| {
        let key = TensorKey::new(entries[i].name.as_str())
            .map_err(|e| FormatError::ckpt(&a.ckpt)(e.into()))?;
        let v = ckpt.read_tensor(&key).map_err(FormatError::ckpt(&a.ckpt))?;
        pb.inc(v.len() as u64);
        sink(&v).map_err(FormatError::io("write", &a.out))
    });
    pb.finish_and_clear();
    written?;
    println!(
        "exported {} tensors ({:.3} GB) to {} in {:.2} s",
        infos.len(),
        total as f64 / 1e9,
        a.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
