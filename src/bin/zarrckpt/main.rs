//! The `zarrckpt` command-line tool.

mod bench;
mod bench_convert;
#[cfg(feature = "cuda")]
mod bench_gpu;
mod bench_plan;
mod bench_read;
#[cfg(feature = "s3")]
mod bench_s3;
mod bench_transfer;
mod corrupt;
mod crash;
mod demo;
mod diff;
mod export;
mod hf;
mod import;
mod inspect;
mod launch;
mod launcher;
mod ls;
mod progress;
mod recover;
#[cfg(feature = "object-store")]
mod remote;
#[cfg(not(feature = "object-store"))]
#[path = "remote_off.rs"]
mod remote;
mod rss;
mod synth;
mod verify;
mod worker;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: bench_plan::Counting = bench_plan::Counting;

/// Distributed training checkpoints as Zarr v3 arrays.
#[derive(Parser)]
#[command(name = "zarrckpt", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Save a synthetic model state with 4 in-process ranks, load it back with 3 ranks in
    /// another split, check every byte and show what was written.
    Demo(demo::Args),
    /// Write a checkpoint from safetensors files, as N ranks would (each tensor split N ways
    /// along its first axis); or, with `--hf DIR --map TABLE --megatron tp=T,pp=P`, a Hugging
    /// Face model into a Megatron layout; or, with `--dcp DIR` / `--megatron DIR`, a PyTorch
    /// DCP / Megatron `torch_dist` checkpoint (no pickle run).
    Import(import::Args),
    /// Write a checkpoint's full tensors into one safetensors file; or, with `--hf --map
    /// TABLE`, a Megatron-layout checkpoint as a Hugging Face model; or, with `--vllm --tp K`,
    /// vLLM per-rank files.
    Export(export::Args),
    /// List a checkpoint's tensors: data types, shapes, chunking, sizes.
    Inspect(inspect::Args),
    /// List the step checkpoints under a checkpoint manager's root (complete or not, size,
    /// latest).
    Ls(ls::Args),
    /// Read every chunk, check every checksum and that every chunk exists.
    Verify(verify::Args),
    /// Copy a committed checkpoint between a directory and an object-store URL
    /// (`s3://bucket/prefix`, `gs://`, `az://`): to a URL as a new generation committed by a
    /// pointer move (spec section 20), from a URL into a new directory.
    #[cfg(feature = "object-store")]
    Cp(remote::CpArgs),
    /// Remove the old generations of a checkpoint on an object store (`--keep N` committed
    /// ones kept, the current one included; `--dry-run` lists them).
    #[cfg(feature = "object-store")]
    Gc(remote::GcArgs),
    /// Apply the recovery rules to a checkpoint an interrupted save left behind (restore a
    /// parked previous checkpoint, remove staging leftovers) under the save lock;
    /// `--dry-run` lists what it would do. Read-only commands never delete anything.
    Recover(recover::Args),
    /// Compare two checkpoints tensor by tensor, whatever their layouts, in bounded memory:
    /// equal, or how many elements differ and by how much at most. Exit status 0 when
    /// equal, 1 when they differ, 2 on an error.
    Diff(diff::Args),
    /// Measure save and load against the machine's own limits, measured in the same run.
    Bench(bench::Args),
    /// Measure conversion (HF export, vLLM reshard) against the machine's own limits, and
    /// planning alone for a DeepSeek-V3-shaped checkpoint.
    BenchConvert(bench_convert::Args),
    /// Measure live weight transfer (trainer -> engine) against the transport's raw
    /// point-to-point bandwidth, and planning alone for a DeepSeek-V3-shaped job.
    BenchTransfer(bench_transfer::Args),
    /// Time many small `read_region` calls through the local reader against the collective
    /// load on one process, same boxes, same run.
    BenchRead(bench_read::Args),
    /// Save and load a GPT-like state through S3 (SeaweedFS started on 127.0.0.1, or
    /// `--endpoint`) against parallel raw PUT / GET of the same objects in the same run; the
    /// read amplification of a reshard load counted at a proxy; save memory against its bound;
    /// a local-disk `zarrckpt bench` beside it.
    #[cfg(feature = "s3")]
    BenchS3(bench_s3::Args),
    /// Measure one rank's planning cost (save and load) for very large simulated jobs.
    BenchPlan(bench_plan::Args),
    /// Load into and save from GPU memory against the pinned copy bandwidth and the disk
    /// (build with `--features cuda`).
    #[cfg(feature = "cuda")]
    BenchGpu(bench_gpu::Args),
    /// Run N local processes with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
    /// set (as torchrun does), output prefixed by rank; fail fast when one fails.
    Launch(launch::Args),
    /// Crash-consistency harness: kill saving processes (SIGKILL) at random moments and check
    /// that the previous checkpoint or the new one is there, never neither, never a mix.
    CrashTrials(crash::Args),
    /// Corruption harness: damage a checkpoint at random (flips, truncations, deletions,
    /// swaps of equal-sized subchunks and shards, metadata) and check load and verify catch it.
    CorruptionTrials(corrupt::Args),
    /// One save of `crash-trials` (the process that gets killed).
    #[command(hide = true)]
    CrashChild(crash::ChildArgs),
    /// One rank of a synthetic save or load (used by `bench --processes` and tests).
    #[command(hide = true)]
    Worker(worker::Args),
}

fn main() -> std::process::ExitCode {
    // Large buffers (tensor pieces, load targets) come and go in big blocks; with a fixed mmap
    // threshold glibc returns them to the system when freed instead of keeping them in
    // per-thread arenas (which would inflate the memory figures `bench` reports).
    // SAFETY: mallopt only tunes the allocator; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("ZARRCKPT_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Launch(_)) {
        // A closed stdout or stderr (`zarrckpt inspect CKPT | head`) ends the process quietly
        // the Unix way, killed by SIGPIPE (status 141 in a shell), instead of a panic with a
        // backtrace. Sockets are unaffected (the TCP communicator sends with MSG_NOSIGNAL).
        // `launch` keeps ignoring SIGPIPE: it must go on draining its children's output.
        // SAFETY: restoring a signal's default disposition has no other effect on the process.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.command {
        Command::Demo(a) => demo::run(&a),
        Command::Import(a) => import::run(&a),
        Command::Export(a) => export::run(&a),
        Command::Inspect(a) => inspect::run(&a),
        Command::Ls(a) => ls::run(&a),
        Command::Verify(a) => verify::run(&a),
        #[cfg(feature = "object-store")]
        Command::Cp(a) => remote::cp(&a),
        #[cfg(feature = "object-store")]
        Command::Gc(a) => remote::gc(&a),
        Command::Recover(a) => recover::run(&a),
        Command::Diff(a) => diff::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::BenchPlan(a) => bench_plan::run(&a),
        Command::BenchRead(a) => bench_read::run(&a),
        #[cfg(feature = "s3")]
        Command::BenchS3(a) => bench_s3::run(&a),
        Command::BenchConvert(a) => bench_convert::run(&a),
        Command::BenchTransfer(a) => bench_transfer::run(&a),
        #[cfg(feature = "cuda")]
        Command::BenchGpu(a) => bench_gpu::run(&a),
        Command::Launch(a) => launch::run(&a),
        Command::Worker(a) => worker::run(&a),
        Command::CrashTrials(a) => crash::run(&a),
        Command::CorruptionTrials(a) => corrupt::run(&a),
        Command::CrashChild(a) => crash::run_child(&a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
