//! `zarrckpt bench-gpu` (feature `cuda`): loading into and saving from GPU memory against the
//! machine's own limits, measured in the same run: pinned host-to-device and device-to-host
//! copy bandwidth, and a warm page-cache read of the same files.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use zarrckpt::device::{
    CudaDevice, Device, DevicePiece, DeviceStaging, DeviceTarget, DeviceView, Pitched,
    load_to_device,
};
use zarrckpt::{
    Communicator, Compression, DType, LoadOptions, LocalComm, Region, SaveOptions, ShardedTensor,
    TensorKey, save,
};

/// Arguments of `zarrckpt bench-gpu`.
#[derive(clap::Args)]
pub struct Args {
    /// Bytes of the state (bf16 matrices of `--cols` columns).
    #[arg(long, default_value_t = 4 << 30)]
    size: u64,
    /// Columns of each matrix.
    #[arg(long, default_value_t = 4096)]
    cols: u64,
    /// Tensors.
    #[arg(long, default_value_t = 16)]
    tensors: u64,
    /// Pinned staging for loads, in bytes (two buffers of half each).
    #[arg(long, default_value_t = 1 << 30)]
    staging: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Directory for the checkpoints (removed afterwards).
    #[arg(long, default_value = "zarrckpt-bench-gpu")]
    dir: PathBuf,
    /// Repetitions of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Runs the benchmark.
pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if !CudaDevice::available() {
        bail!("no CUDA driver or GPU on this machine");
    }
    let dev = Arc::new(CudaDevice::new(a.device)?);
    let rows = (a.size / a.tensors / a.cols / 2).max(1);
    let shape = vec![rows, a.cols];
    let per = usize::try_from(rows * a.cols * 2)?;
    let total = per as u64 * a.tensors;
    println!(
        "state: {} tensors of bf16 [{rows}, {}] = {:.2} GB",
        a.tensors,
        a.cols,
        total as f64 / 1e9
    );
    std::fs::create_dir_all(&a.dir)?;

    // Device memory for the state, and a pinned host copy of it.
    let mut bases = Vec::new();
    for _ in 0..a.tensors {
        bases.push(dev.alloc(per)?);
    }
    let mut host = dev.pinned(per)?;
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(151);
    }

    // Raw limits: pinned host -> device and device -> host of the whole state.
    let mut h2d = f64::MAX;
    let mut d2h = f64::MAX;
    for _ in 0..a.reps {
        let t = Instant::now();
        for &b in &bases {
            // SAFETY: `host` outlives the wait below; `b` is a device allocation of `per`.
            let f = unsafe { dev.to_device(host.as_ptr(), &[Pitched::linear(0, b, per)]) }?;
            dev.wait(f)?;
        }
        h2d = h2d.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for &b in &bases {
            // SAFETY: as above.
            let f = unsafe { dev.to_host(host.as_mut_ptr(), &[Pitched::linear(0, b, per)]) }?;
            dev.wait(f)?;
        }
        d2h = d2h.min(t.elapsed().as_secs_f64());
    }
    println!("raw pinned host->device: {:.2} GB/s", gbps(total, h2d));
    println!("raw device->host (pinned): {:.2} GB/s", gbps(total, d2h));

    // The checkpoint, saved from host memory (no compression: the disk path is measured).
    let ckpt = a.dir.join("state");
    let comm = LocalComm::single();
    let keys: Vec<TensorKey> = (0..a.tensors)
        .map(|i| TensorKey::new(format!("layers.{i}.weight")))
        .collect::<Result<_, _>>()?;
    let opts = SaveOptions {
        overwrite: true,
        compression: Compression::None,
        ..SaveOptions::default()
    };
    {
        let full = Region::new(vec![0, 0], shape.clone())?;
        let pieces: Vec<ShardedTensor<'_>> = keys
            .iter()
            .map(|k| {
                ShardedTensor::new(
                    k.clone(),
                    DType::BFloat16,
                    shape.clone(),
                    full.clone(),
                    0,
                    &host,
                )
            })
            .collect::<Result<_, _>>()?;
        save(&pieces, &ckpt, &comm, &opts)?;
    }
    // Warm page cache read of the same files: the storage side's limit here.
    let mut read = f64::MAX;
    let mut file_bytes = 0u64;
    for _ in 0..a.reps {
        let t = Instant::now();
        file_bytes = read_tree(&ckpt)?;
        read = read.min(t.elapsed().as_secs_f64());
    }
    println!(
        "raw warm read of the checkpoint's files (parallel): {:.2} GB/s",
        gbps(file_bytes, read)
    );

    // Load into device memory.
    let full = Region::new(vec![0, 0], shape.clone())?;
    let targets: Vec<DeviceTarget> = keys
        .iter()
        .zip(&bases)
        .map(|(k, &b)| {
            // SAFETY: `b` holds `per` bytes of device memory, the whole tensor.
            let view = unsafe { DeviceView::contiguous(b, &shape) };
            DeviceTarget::new(
                k.clone(),
                DType::BFloat16,
                shape.clone(),
                full.clone(),
                view,
            )
        })
        .collect::<Result<_, _>>()?;
    let mut staging = DeviceStaging::new(dev.clone(), a.staging);
    let mut load_s = f64::MAX;
    let mut rep = None;
    for _ in 0..a.reps {
        let t = Instant::now();
        rep = Some(load_to_device(
            &mut [],
            &targets,
            &mut staging,
            &ckpt,
            &comm,
            &LoadOptions::default(),
        )?);
        load_s = load_s.min(t.elapsed().as_secs_f64());
    }
    let rep = rep.context("no load ran")?;
    let bound = h2d.max(read);
    println!(
        "load into device memory: {:.2} GB/s = {:.0}% of pinned host->device ({:.0}% of min(read, H2D)); {} rounds, read {:.2}s, copy waits {:.2}s, read amplification {:.3}",
        gbps(total, load_s),
        100.0 * h2d / load_s,
        100.0 * bound / load_s,
        rep.rounds,
        rep.read_seconds,
        rep.copy_wait_seconds,
        rep.load.bytes_read as f64 / total as f64
    );

    // Save from device memory, synchronously and asynchronously.
    let comm_arc: Arc<dyn Communicator> = Arc::new(LocalComm::single());
    let mut saver = zarrckpt::Saver::new(comm_arc);
    let pieces: Vec<DevicePiece> = keys
        .iter()
        .zip(&bases)
        .map(|(k, &b)| {
            // SAFETY: as above.
            let view = unsafe { DeviceView::contiguous(b, &shape) };
            DevicePiece::new(
                k.clone(),
                DType::BFloat16,
                shape.clone(),
                full.clone(),
                0,
                view,
            )
        })
        .collect::<Result<_, _>>()?;
    let request = zarrckpt::SaveRequest::new().with_device_tensors(dev.clone(), pieces);
    let mut sync_s = f64::MAX;
    let mut blocked = f64::MAX;
    let mut async_total = f64::MAX;
    for i in 0..a.reps {
        let t = Instant::now();
        saver.save(&request, &a.dir.join(format!("sync{i}")), &opts)?;
        sync_s = sync_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let h = saver.save_async(&request, &a.dir.join(format!("async{i}")), &opts)?;
        blocked = blocked.min(h.blocked().as_secs_f64());
        h.wait()?;
        async_total = async_total.min(t.elapsed().as_secs_f64());
        std::fs::remove_dir_all(a.dir.join(format!("sync{i}")))?;
        std::fs::remove_dir_all(a.dir.join(format!("async{i}")))?;
    }
    let mut write = f64::MAX;
    for i in 0..a.reps {
        let per_file = usize::try_from(total / a.tensors.max(1))?;
        write = write.min(write_tree(
            &a.dir.join(format!("raw{i}")),
            a.tensors as usize,
            per_file,
        )?);
    }
    println!(
        "raw durable write of the same bytes (parallel write + fsync): {:.2} GB/s",
        gbps(total, write)
    );
    println!(
        "save from device memory: {:.2} GB/s ({:.0}% of device->host, {:.0}% of min(write, D2H))",
        gbps(total, sync_s),
        100.0 * d2h / sync_s,
        100.0 * write.max(d2h) / sync_s
    );
    println!(
        "async save from device memory: blocked {:.3}s = {:.2}x a plain device->host copy of the same bytes ({:.3}s); whole save {:.2}s",
        blocked,
        blocked / d2h,
        d2h,
        async_total
    );
    drop(staging);
    for b in bases {
        // SAFETY: allocated above; nothing uses them any more.
        unsafe { dev.free(b) }?;
    }
    std::fs::remove_dir_all(&a.dir)?;
    Ok(ExitCode::SUCCESS)
}

/// Every file under `dir`.
fn files_under(dir: &std::path::Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            files_under(&e.path(), out)?;
        } else {
            out.push(e.path());
        }
    }
    Ok(())
}

/// Reads every file under `dir` in parallel (one file per task, 8 MiB reads into a reused
/// buffer, as many threads as the load uses), returns the bytes read: the page cache's own
/// limit for these files on this machine.
fn read_tree(dir: &std::path::Path) -> anyhow::Result<u64> {
    use rayon::prelude::*;
    use std::io::Read;
    let mut files = Vec::new();
    files_under(dir, &mut files)?;
    files
        .par_iter()
        .map(|p| -> anyhow::Result<u64> {
            let mut f = std::fs::File::open(p)?;
            let mut buf = vec![0u8; 8 << 20];
            let mut n = 0u64;
            loop {
                let k = f.read(&mut buf)?;
                if k == 0 {
                    return Ok(n);
                }
                n += k as u64;
            }
        })
        .sum()
}

/// Writes `parts` files of `len` bytes each under `dir` in parallel and makes them durable
/// (write, fsync, fsync of the directory): the disk's own limit for a save of that size.
fn write_tree(dir: &std::path::Path, parts: usize, len: usize) -> anyhow::Result<f64> {
    use rayon::prelude::*;
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let data = vec![0x5au8; len];
    let t = Instant::now();
    (0..parts)
        .into_par_iter()
        .try_for_each(|i| -> anyhow::Result<()> {
            let mut f = std::fs::File::create(dir.join(format!("part{i}")))?;
            f.write_all(&data)?;
            f.sync_all()?;
            Ok(())
        })?;
    std::fs::File::open(dir)?.sync_all()?;
    let secs = t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(dir)?;
    Ok(secs)
}
