//! Save a model state in one tensor x data parallel layout and load it into another, checking
//! every byte, across real processes:
//!
//! ```sh
//! cargo build --release --examples
//! target/release/zarrckpt launch -n 4 -- target/release/examples/reshard --dir /tmp/ckpt \
//!     --save-tp 2 --save-dp 2 --load-tp 4 --load-dp 1
//! ```
//!
//! Every rank runs this program (`zarrckpt launch` or torchrun sets RANK, WORLD_SIZE,
//! MASTER_ADDR and MASTER_PORT). The model is GPT-like: bf16 weights split by tensor
//! parallelism along rows (column-parallel layers) or columns (row-parallel layers), fp32 Adam
//! moments split the same way, fp32 norms replicated on every rank (written once), and an int64
//! step counter. Data-parallel replicas hold the same pieces: each piece is written by one of
//! them (spread by bytes), and when loading, each data-parallel group reads each box once and
//! shares it.

// The synthetic GPT-like state is the CLI's (`zarrckpt demo` and `zarrckpt bench` use it).
#[allow(dead_code)]
#[path = "../src/bin/zarrckpt/synth.rs"]
mod synth;

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use synth::{Held, SynthModel, Topology, Wanted};
use zarrckpt::{Communicator, LoadOptions, SaveOptions, StrictMode, TcpComm};

#[derive(Parser)]
struct Args {
    /// Checkpoint directory.
    #[arg(long)]
    dir: PathBuf,
    /// Tensor-parallel size when saving (0: skip saving).
    #[arg(long, default_value_t = 2)]
    save_tp: u64,
    /// Data-parallel size when saving.
    #[arg(long, default_value_t = 2)]
    save_dp: u64,
    /// Tensor-parallel size when loading (0: skip loading).
    #[arg(long, default_value_t = 4)]
    load_tp: u64,
    /// Data-parallel size when loading.
    #[arg(long, default_value_t = 1)]
    load_dp: u64,
    /// Approximate model size in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    size: u64,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let comm = TcpComm::from_env()?;
    let (rank, world) = (comm.rank(), comm.world_size() as u64);
    let model = SynthModel::gpt(a.size, 256);
    if a.save_tp > 0 {
        let topo = Topology {
            tp: a.save_tp,
            dp: a.save_dp,
        };
        anyhow::ensure!(
            topo.world() == world,
            "save tp x dp must equal the world size {world}"
        );
        let held = Held::generate(&model, topo, rank as u64);
        let t0 = Instant::now();
        let opts = SaveOptions {
            overwrite: true,
            ..Default::default()
        };
        let report = zarrckpt::save(&held.sharded(&model), &a.dir, &comm, &opts)?;
        println!(
            "saved as tp {} x dp {}: this rank wrote {} shard files ({} bytes) in {:.2} s; write balance max/mean {:.3}",
            a.save_tp,
            a.save_dp,
            report.chunks_written,
            report.data_bytes,
            t0.elapsed().as_secs_f64(),
            report.write_balance
        );
    }
    if a.load_tp > 0 {
        let topo = Topology {
            tp: a.load_tp,
            dp: a.load_dp,
        };
        anyhow::ensure!(
            topo.world() == world,
            "load tp x dp must equal the world size {world}"
        );
        let mut wanted = Wanted::allocate(&model, topo, rank as u64);
        let t0 = Instant::now();
        let opts = LoadOptions {
            strict: StrictMode::RaiseAll,
            ..Default::default()
        };
        let report = zarrckpt::load(&mut wanted.targets(&model), &a.dir, &comm, &opts)?;
        wanted.check(&model).map_err(anyhow::Error::msg)?;
        println!(
            "loaded as tp {} x dp {} in {:.2} s, every byte checked: {} bytes, {} read from storage, {} received from other ranks",
            a.load_tp,
            a.load_dp,
            t0.elapsed().as_secs_f64(),
            report.loaded_bytes,
            report.bytes_read,
            report.bytes_received
        );
    }
    Ok(())
}
