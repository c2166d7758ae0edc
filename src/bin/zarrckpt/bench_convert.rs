//! `zarrckpt bench-convert`: conversion against the machine's own limits, measured in the
//! same run: HF export and vLLM TP-K reshard of a synthetic Llama-shaped Megatron-layout
//! checkpoint (read amplification, peak heap memory, throughput vs a raw read + write of the
//! same bytes, alternated round by round), and planning alone for a DeepSeek-V3-shaped
//! (671B) checkpoint.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use zarrckpt::convert::safetensors::{Entry, write_file};
use zarrckpt::convert::write::{file_per_group, write_files};
use zarrckpt::convert::{self, FormatError, HfImport, Layout, Table, WriteOptions};
use zarrckpt::{Checkpoint, DType};

use crate::bench_plan::peak_of;

/// Arguments of `zarrckpt bench-convert`.
#[derive(clap::Args)]
pub struct Args {
    /// Working directory (default: a temporary directory, removed afterwards).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Hidden size of the synthetic Llama model (layers 8, ffn 4x hidden, 16 heads, 4 kv heads,
    /// vocab 32000; hidden 1024 is about 0.37 GB in bf16).
    #[arg(long, default_value_t = 1024)]
    hidden: u64,
    /// Layers of the synthetic model.
    #[arg(long, default_value_t = 8)]
    layers: u64,
    /// TP of the saved Megatron layout.
    #[arg(long, default_value_t = 2)]
    save_tp: u64,
    /// vLLM TP sizes to reshard to.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    vllm_tp: Vec<u64>,
    /// Rounds (medians reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Only the DeepSeek-V3 planning benchmark.
    #[arg(long)]
    plan_only: bool,
}

/// A benchmark job: its name, its plan, and the name of its output file `g`.
type Job = (String, convert::Plan, Box<dyn Fn(usize) -> String>);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn synth_hf(dir: &Path, hidden: u64, layers: u64) -> anyhow::Result<u64> {
    std::fs::create_dir_all(dir)?;
    let heads = 16u64;
    let cfg = serde_json::json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 4, "vocab_size": 32000,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"});
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    let t = Table::builtin("llama")?;
    let ex = convert::expand(&t, &cfg, Layout::default())?;
    let tensors: Vec<Entry> =
        ex.h.iter()
            .map(|h| Entry {
                name: h.name.clone(),
                dtype: DType::BFloat16,
                shape: h.shape.clone(),
            })
            .collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let meta: serde_json::Map<String, serde_json::Value> =
        [("format".to_string(), "pt".into())].into_iter().collect();
    let path = dir.join("model.safetensors");
    let written = write_file(&path, &tensors, Some(&meta), |i, sink| {
        let n = tensors[i].shape.iter().product::<u64>() as usize * 2;
        let mut buf = vec![0u8; n];
        for c in buf.chunks_mut(8) {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let b = seed.to_le_bytes();
            c.copy_from_slice(&b[..c.len()]);
        }
        sink(&buf).map_err(FormatError::io("write", &path))
    })?;
    Ok(written)
}

/// Reads every file under `src` (reused 16 MiB buffer) and writes as many bytes to a file in
/// `dst` (fsync), returning the seconds taken.
fn raw_read_write(src: &Path, dst: &Path, bytes: u64) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let mut buf = vec![0u8; 16 << 20];
    let mut stack = vec![src.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            } else {
                let mut f = std::fs::File::open(e.path())?;
                loop {
                    let n = f.read(&mut buf)?;
                    if n == 0 {
                        break;
                    }
                }
            }
        }
    }
    std::fs::create_dir_all(dst)?;
    let p = dst.join("raw.bin");
    let mut f = std::fs::File::create(&p)?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    drop(f);
    std::fs::remove_file(&p)?;
    Ok(t0.elapsed().as_secs_f64())
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    plan_deepseek()?;
    if a.plan_only {
        return Ok(ExitCode::SUCCESS);
    }
    let tmp;
    let root = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile_dir()?;
            tmp.clone()
        }
    };
    let hfdir = root.join("hf");
    let mg = root.join("megatron");
    let total = synth_hf(&hfdir, a.hidden, a.layers)?;
    println!(
        "synthetic Llama: hidden {}, {} layers: {:.3} GB of bf16 HF tensors",
        a.hidden,
        a.layers,
        total as f64 / 1e9
    );
    let t0 = Instant::now();
    let (r, peak) = peak_of(|| {
        let layout = Layout {
            tp: a.save_tp,
            pp: 1,
            ep: 1,
        };
        HfImport::plan(&hfdir, &Table::builtin("llama")?, layout)?.write(&mg, true, 0)
    });
    r?;
    println!(
        "import HF -> Megatron tp={}: {:.2} s, peak heap {:.1} MiB (the HF files and the scratch file are mapped, not on the heap)",
        a.save_tp,
        t0.elapsed().as_secs_f64(),
        peak as f64 / (1 << 20) as f64
    );
    let ck = Checkpoint::open(mg.join("zarrckpt"))?;
    let table = Table::builtin("llama")?;
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hfdir.join("config.json"))?)?;
    let inv = convert::hf::inventory(&ck);
    let saved = Layout {
        tp: a.save_tp,
        pp: 1,
        ep: 1,
    };
    let mut jobs: Vec<Job> = Vec::new();
    let hp = convert::plan_hf_export(&table, &cfg, saved, &inv, 5_000_000_000)?;
    let n = hp.dests.last().map_or(0, |d| d.group + 1);
    jobs.push((
        "HF export".into(),
        hp,
        Box::new(move |g| {
            if n == 1 {
                "model.safetensors".into()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", g + 1)
            }
        }),
    ));
    for &k in &a.vllm_tp {
        jobs.push((
            format!("vLLM TP {k} reshard"),
            convert::plan_vllm(&table, &cfg, saved, &inv, k)?,
            Box::new(|r| format!("model-rank-{r}-part-0.safetensors")),
        ));
    }
    println!(
        "| job | bytes written | read amplification | largest output tensor | peak heap | bound 2x largest + 64 MiB | job GB/s | raw read+write GB/s | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (name, plan, names) in &jobs {
        for pipeline in [false, true] {
            let out = root.join("out");
            let mut job_s = Vec::new();
            let mut raw_s = Vec::new();
            let mut ampl = 0.0;
            let mut peak = 0usize;
            let mut written = 0;
            for _ in 0..a.rounds {
                let _ = std::fs::remove_dir_all(&out);
                std::fs::create_dir_all(&out)?;
                let t = Instant::now();
                let (r, p) = peak_of(|| {
                    let files = file_per_group(plan, names.as_ref());
                    let opts = WriteOptions {
                        writers: 1,
                        pipeline,
                    };
                    write_files(&ck, plan, &files, &out, opts)
                });
                let st = r?;
                let (read, w) = (st.bytes_read, st.bytes_written);
                job_s.push(t.elapsed().as_secs_f64());
                written = w;
                ampl = read as f64 / w.max(1) as f64;
                peak = peak.max(p);
                let _ = std::fs::remove_dir_all(&out);
                raw_s.push(raw_read_write(
                    &mg.join("zarrckpt").join("tensors"),
                    &out,
                    w,
                )?);
            }
            let largest = plan
                .dests
                .iter()
                .map(convert::Dest::nbytes)
                .max()
                .unwrap_or(0);
            let (j, r) = (median(job_s.clone()), median(raw_s.clone()));
            let ratios: Vec<f64> = job_s.iter().zip(&raw_s).map(|(a, b)| b / a).collect();
            println!(
                "| {name}{} | {:.3} GB | {ampl:.4} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.2} | {:.2} | {:.2} |",
                if pipeline { " (reader thread)" } else { "" },
                written as f64 / 1e9,
                largest as f64 / (1 << 20) as f64,
                peak as f64 / (1 << 20) as f64,
                (2 * largest + (64 << 20)) as f64 / (1 << 20) as f64,
                written as f64 / 1e9 / j,
                written as f64 / 1e9 / r,
                median(ratios)
            );
        }
        if name.starts_with("vLLM") {
            let per = plan.bytes_per_group();
            println!(
                "  per rank (reads / writes, bytes): {}",
                per.iter()
                    .map(|(g, (r, w))| format!("{g}: {r} / {w}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(ExitCode::SUCCESS)
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("zarrckpt-bench-convert-{}", std::process::id()));
    std::fs::create_dir_all(&d).context("temporary directory")?;
    Ok(d)
}

/// Planning alone for DeepSeek-V3 (671B) saved at PP16 x EP16, resharded to TP32.
fn plan_deepseek() -> anyhow::Result<()> {
    let cfg = serde_json::json!({"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "num_nextn_predict_layers": 1, "tie_word_embeddings": false});
    let table = match Table::builtin("deepseek_v3") {
        Ok(t)
            if !t.rules.is_empty()
                && t.rules
                    .iter()
                    .any(|r| r.megatron.contains("linear_q_down_proj")) =>
        {
            t
        }
        _ => {
            println!("DeepSeek-V3 planning: no deepseek_v3 table in this build; skipped");
            return Ok(());
        }
    };
    let saved = Layout {
        tp: 1,
        pp: 16,
        ep: 16,
    };
    // The checkpoint's metadata: the Megatron tensors the table implies at the saved layout.
    let ex = convert::expand(&table, &cfg, saved)?;
    let inv: convert::Inventory =
        ex.m.iter()
            .map(|m| (m.key.clone(), ("bfloat16".to_string(), m.shape.clone())))
            .collect();
    let params: u64 = ex.m.iter().map(|m| m.shape.iter().product::<u64>()).sum();
    let t0 = Instant::now();
    let (plan, peak) = peak_of(|| convert::plan_vllm(&table, &cfg, saved, &inv, 32));
    let plan = plan?;
    let secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let per = plan.bytes_per_group();
    let per_secs = t1.elapsed().as_secs_f64();
    let reads: Vec<u64> = per.values().map(|v| v.0).collect();
    println!(
        "DeepSeek-V3 planning (no data): {:.1}B parameters in {} Megatron tensors saved at PP16 x EP16, resharded to vLLM TP32: {} destination tensors, planned and checked in {secs:.2} s (target < 10 s), peak heap {:.1} MiB",
        params as f64 / 1e9,
        ex.m.len(),
        plan.dests.len(),
        peak as f64 / (1 << 20) as f64
    );
    println!(
        "  bytes per destination rank (bf16, the merged boxes each rank reads, counted in {per_secs:.2} s): min {:.2} GB, max {:.2} GB, total {:.1} GB; rank 0 reads {} bytes",
        *reads.iter().min().unwrap_or(&0) as f64 / 1e9,
        *reads.iter().max().unwrap_or(&0) as f64 / 1e9,
        reads.iter().sum::<u64>() as f64 / 1e9,
        reads.first().unwrap_or(&0)
    );
    Ok(())
}
