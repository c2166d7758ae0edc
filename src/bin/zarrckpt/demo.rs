//! `zarrckpt demo`: the main job on an embedded default.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::synth::SynthModel;
use anyhow::{Context, bail};
use zarrckpt::comm::run_local;
use zarrckpt::{Checkpoint, Communicator, LoadOptions, SaveOptions, load, save};

use crate::inspect::human;
use crate::synth::{Held, Topology, Wanted};

/// Arguments of `zarrckpt demo`.
#[derive(clap::Args)]
pub struct Args {
    /// Where to write the checkpoint (replaced if it holds an earlier demo checkpoint).
    #[arg(long, default_value = "zarrckpt-demo")]
    dir: PathBuf,
    /// Approximate size of the model state in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    size: u64,
    /// Ranks saving (tensor-parallel split).
    #[arg(long, default_value_t = 4)]
    save_ranks: u64,
    /// Ranks loading (another tensor-parallel split).
    #[arg(long, default_value_t = 3)]
    load_ranks: u64,
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if a.save_ranks == 0 || a.load_ranks == 0 {
        bail!("rank counts must be at least 1");
    }
    let model = SynthModel::gpt(a.size, 512);
    println!(
        "model: {} tensors, {} (bf16 weights, fp32 Adam moments, fp32 norms, an int64 step)",
        model.tensors.len(),
        human(model.nbytes())
    );
    let save_topo = Topology {
        tp: a.save_ranks,
        dp: 1,
    };
    let t0 = Instant::now();
    let reports = run_local(a.save_ranks as usize, Duration::from_secs(120), |comm| {
        let held = Held::generate(&model, save_topo, comm.rank() as u64);
        let mut opts = SaveOptions {
            overwrite: true,
            ..Default::default()
        };
        opts.user_metadata.insert("step".into(), 1000.into());
        save(&held.sharded(&model), &a.dir, &comm, &opts)
    });
    let mut chunks = 0;
    for r in reports {
        chunks += r.context("save")?.chunks_written;
    }
    println!(
        "saved with {} in-process ranks (each tensor split {}-way, norms replicated and written once): {chunks} shard files in {:.2} s -> {}",
        a.save_ranks,
        a.save_ranks,
        t0.elapsed().as_secs_f64(),
        a.dir.display()
    );

    let load_topo = Topology {
        tp: a.load_ranks,
        dp: 1,
    };
    let t0 = Instant::now();
    let results = run_local(
        a.load_ranks as usize,
        Duration::from_secs(120),
        |comm| -> anyhow::Result<(u64, u64)> {
            let mut wanted = Wanted::allocate(&model, load_topo, comm.rank() as u64);
            let report = load(
                &mut wanted.targets(&model),
                &a.dir,
                &comm,
                &LoadOptions::default(),
            )?;
            wanted.check(&model).map_err(anyhow::Error::msg)?;
            Ok((report.loaded_bytes, report.bytes_read))
        },
    );
    let (mut loaded, mut read) = (0, 0);
    for r in results {
        let (l, rd) = r.context("load")?;
        loaded += l;
        read += rd;
    }
    println!(
        "loaded with {} ranks in a {}-way split in {:.2} s: every byte checked; read {} from storage for {} needed ({:.3}x)",
        a.load_ranks,
        a.load_ranks,
        t0.elapsed().as_secs_f64(),
        human(read),
        human(loaded),
        read as f64 / loaded.max(1) as f64
    );
    let ckpt = Checkpoint::open(&a.dir)?;
    println!(
        "\n{} holds {} Zarr v3 arrays; the first few:",
        a.dir.display(),
        ckpt.tensors().len()
    );
    for t in ckpt.tensors().iter().take(6) {
        println!(
            "  {:<58} {:<9} shape {:?} chunks {:?}",
            t.key.as_str(),
            t.dtype.name(),
            t.shape,
            t.chunk_shape
        );
    }
    println!(
        "\nnext: zarrckpt inspect {d}   |   zarrckpt verify {d}",
        d = a.dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
