//! `zarrckpt bench`: save and load a synthetic model state and compare with the machine's own
//! limits, measured in the same run on the same directory, alternating pair by pair.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;
use zarrckpt::comm::run_local;
use zarrckpt::synth::SynthModel;
use zarrckpt::{Communicator, LoadOptions, SaveOptions, load, save};

use crate::inspect::human;
use crate::workload::{Held, Topology, Wanted};

/// Arguments of `zarrckpt bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Approximate size of the model state in bytes.
    #[arg(long, default_value_t = 2 << 30)]
    size: u64,
    /// Ranks saving (tensor-parallel split).
    #[arg(long, default_value_t = 4)]
    save_ranks: u64,
    /// Ranks loading (another tensor-parallel split).
    #[arg(long, default_value_t = 3)]
    load_ranks: u64,
    /// Directory for the checkpoint and the raw-limit files (removed afterwards).
    #[arg(long, default_value = "zarrckpt-bench")]
    dir: PathBuf,
    /// Rounds of (raw, zarrckpt) pairs for save and for load.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Hidden size of the synthetic model.
    #[arg(long, default_value_t = 2048)]
    hidden: u64,
    /// I/O threads per rank (0: the machine's cores divided among the ranks).
    #[arg(long, default_value_t = 0)]
    io_threads: usize,
    /// Keep the checkpoint afterwards.
    #[arg(long)]
    keep: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, std::num::NonZero::get)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Writes `total` bytes as `streams` files in parallel, each written sequentially from a reused
/// buffer and fsynced; returns the wall time.
fn raw_write(dir: &Path, total: u64, streams: usize) -> anyhow::Result<Duration> {
    fs::create_dir_all(dir)?;
    let per = total.div_ceil(streams as u64);
    let mut block = vec![0u8; 16 << 20];
    let mut x = 0x1234_5678_9abc_def0u64;
    for c in block.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    let t0 = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let path = dir.join(format!("raw-{i}"));
                let block = &block;
                s.spawn(move || -> anyhow::Result<()> {
                    let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(&path)?;
                    let mut left = per;
                    while left > 0 {
                        let n = left.min(block.len() as u64) as usize;
                        f.write_all(&block[..n])?;
                        left -= n as u64;
                    }
                    f.sync_data()?;
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("writer thread panicked"))??;
        }
        Ok(())
    })?;
    let dt = t0.elapsed();
    fs::remove_dir_all(dir)?;
    Ok(dt)
}

/// Every file under `dir` with its size.
fn files_under(dir: &Path, out: &mut Vec<(PathBuf, u64)>) -> std::io::Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            files_under(&e.path(), out)?;
        } else {
            out.push((e.path(), e.metadata()?.len()));
        }
    }
    Ok(())
}

/// Reads `files` with `streams` threads (files dealt round-robin by size) into reused
/// buffers; returns the wall time.
fn raw_read(files: &[(PathBuf, u64)], streams: usize) -> anyhow::Result<Duration> {
    let mut sorted: Vec<&(PathBuf, u64)> = files.iter().collect();
    sorted.sort_by_key(|f| std::cmp::Reverse(f.1));
    let mut lists: Vec<Vec<&Path>> = vec![Vec::new(); streams];
    let mut loads = vec![0u64; streams];
    for f in sorted {
        let i = (0..streams).min_by_key(|&i| loads[i]).unwrap_or(0);
        loads[i] += f.1;
        lists[i].push(&f.0);
    }
    let t0 = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = lists
            .iter()
            .map(|list| {
                s.spawn(move || -> anyhow::Result<()> {
                    let mut buf = vec![0u8; 16 << 20];
                    for p in list {
                        let mut f = File::open(p)?;
                        while f.read(&mut buf)? > 0 {}
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(t0.elapsed())
}

/// Peak resident memory of this process since the last reset, in bytes.
fn peak_rss() -> u64 {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Current resident memory, in bytes.
fn rss() -> u64 {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Resets the peak-RSS counter (Linux `clear_refs` value 5).
fn reset_peak_rss() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

struct Pair {
    raw_s: f64,
    raw_streams: usize,
    ckpt_s: f64,
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if a.save_ranks == 0 || a.load_ranks == 0 || a.rounds == 0 {
        bail!("ranks and rounds must be at least 1");
    }
    let ckpt = a.dir.join("ckpt");
    let rawdir = a.dir.join("raw");
    fs::create_dir_all(&a.dir).with_context(|| format!("create {}", a.dir.display()))?;
    let model = SynthModel::gpt(a.size, a.hidden);
    let bytes = model.nbytes();
    let (n, m) = (a.save_ranks, a.load_ranks);
    let save_threads = if a.io_threads > 0 { a.io_threads } else { (cores() / n as usize).max(1) };
    let load_threads = if a.io_threads > 0 { a.io_threads } else { (cores() / m as usize).max(1) };
    let say = |s: String| {
        if !a.json {
            println!("{s}");
        }
    };
    say(format!(
        "model: {} tensors, {} ({} bytes); save {n} ranks x {save_threads} I/O threads, load {m} ranks x {load_threads}; {} cores; dir {}",
        model.tensors.len(),
        human(bytes),
        bytes,
        cores(),
        a.dir.display()
    ));

    // ---- save phase ----
    let save_topo = Topology { tp: n, dp: 1 };
    let held: Vec<Held> = (0..n).map(|r| Held::generate(&model, save_topo, r)).collect();
    let mut save_pairs = Vec::new();
    let mut file_bytes = 0u64;
    let mut balance = 1.0;
    for round in 0..a.rounds {
        let barrier = Barrier::new(n as usize);
        let results = run_local(n as usize, Duration::from_secs(600), |comm| -> zarrckpt::Result<(f64, zarrckpt::SaveReport)> {
            let pieces = held[comm.rank()].sharded(&model);
            let opts = SaveOptions { overwrite: true, io_threads: save_threads, ..Default::default() };
            barrier.wait();
            let t0 = Instant::now();
            let rep = save(&pieces, &ckpt, &comm, &opts)?;
            Ok((t0.elapsed().as_secs_f64(), rep))
        });
        let mut secs: f64 = 0.0;
        file_bytes = 0;
        for r in results {
            let (s, rep) = r.context("save")?;
            secs = secs.max(s);
            file_bytes += rep.file_bytes;
            balance = rep.write_balance;
        }
        let one = raw_write(&rawdir, file_bytes, 1)?.as_secs_f64();
        let many = raw_write(&rawdir, file_bytes, n as usize)?.as_secs_f64();
        let (raw_s, raw_streams) = if one <= many { (one, 1) } else { (many, n as usize) };
        say(format!(
            "save round {round}: zarrckpt {:.3} s = {:.2} GB/s | raw write+fsync {:.3} s = {:.2} GB/s ({} stream(s); 1: {:.2}, {n}: {:.2} GB/s) | ratio {:.2}",
            secs,
            bytes as f64 / secs / 1e9,
            raw_s,
            file_bytes as f64 / raw_s / 1e9,
            raw_streams,
            file_bytes as f64 / one / 1e9,
            file_bytes as f64 / many / 1e9,
            raw_s / secs
        ));
        save_pairs.push(Pair { raw_s, raw_streams, ckpt_s: secs });
    }
    drop(held);
    // SAFETY: malloc_trim only returns free memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }

    // ---- load phase ----
    let load_topo = Topology { tp: m, dp: 1 };
    let mut files = Vec::new();
    files_under(&ckpt, &mut files)?;
    let mut load_pairs = Vec::new();
    let mut amplification = 0.0;
    let mut loaded_bytes = 0u64;
    let mut peak = 0u64;
    let mut baseline = 0u64;
    let mut verified = true;
    let mut wanted: Vec<Wanted> = (0..m).map(|r| Wanted::allocate(&model, load_topo, r)).collect();
    for round in 0..a.rounds {
        let one = raw_read(&files, 1)?.as_secs_f64();
        let many = raw_read(&files, m as usize)?.as_secs_f64();
        let (raw_s, raw_streams) = if one <= many { (one, 1) } else { (many, m as usize) };
        baseline = rss();
        let reset = reset_peak_rss();
        let barrier = Barrier::new(m as usize);
        let slots: Vec<std::sync::Mutex<Option<Wanted>>> = wanted.drain(..).map(|w| std::sync::Mutex::new(Some(w))).collect();
        let results = run_local(m as usize, Duration::from_secs(600), |comm| -> zarrckpt::Result<(f64, zarrckpt::LoadReport, Wanted)> {
            let mut w = slots[comm.rank()].lock().expect("slot").take().expect("buffers");
            let opts = LoadOptions { io_threads: load_threads, ..Default::default() };
            let mut targets = w.targets(&model);
            barrier.wait();
            let t0 = Instant::now();
            let rep = load(&mut targets, &ckpt, &comm, &opts)?;
            let dt = t0.elapsed().as_secs_f64();
            drop(targets);
            Ok((dt, rep, w))
        });
        let round_peak = if reset { peak_rss() } else { 0 };
        let mut secs: f64 = 0.0;
        let (mut read, mut loaded) = (0u64, 0u64);
        for r in results {
            let (s, rep, w) = r.context("load")?;
            secs = secs.max(s);
            read += rep.bytes_read;
            loaded += rep.loaded_bytes;
            wanted.push(w);
        }
        for w in &wanted {
            if let Err(e) = w.check(&model) {
                verified = false;
                eprintln!("VERIFY FAILED: {e}");
            }
        }
        for w in &mut wanted {
            for p in &mut w.pieces {
                p.2.fill(0x5A);
            }
        }
        amplification = read as f64 / loaded.max(1) as f64;
        loaded_bytes = loaded;
        peak = peak.max(round_peak);
        say(format!(
            "load round {round}: zarrckpt {:.3} s = {:.2} GB/s | raw page-cache read {:.3} s = {:.2} GB/s ({} stream(s); 1: {:.2}, {m}: {:.2} GB/s) | ratio {:.2} | read/needed {:.4} | peak RSS {} (before load {})",
            secs,
            loaded as f64 / secs / 1e9,
            raw_s,
            file_bytes as f64 / raw_s / 1e9,
            raw_streams,
            file_bytes as f64 / one / 1e9,
            file_bytes as f64 / many / 1e9,
            raw_s / secs * loaded as f64 / file_bytes as f64,
            amplification,
            human(round_peak),
            human(baseline)
        ));
        load_pairs.push(Pair { raw_s, raw_streams, ckpt_s: secs });
    }
    if !a.keep {
        fs::remove_dir_all(&a.dir).with_context(|| format!("remove {}", a.dir.display()))?;
    }

    let gbps = |b: u64, s: f64| b as f64 / s / 1e9;
    let mut v: Vec<f64> = save_pairs.iter().map(|p| gbps(bytes, p.ckpt_s)).collect();
    let save_gbps = median(&mut v);
    let mut v: Vec<f64> = save_pairs.iter().map(|p| gbps(file_bytes, p.raw_s)).collect();
    let raw_write_gbps = median(&mut v);
    let mut v: Vec<f64> = save_pairs.iter().map(|p| p.raw_s / p.ckpt_s).collect();
    let save_ratio = median(&mut v);
    let mut v: Vec<f64> = load_pairs.iter().map(|p| gbps(loaded_bytes, p.ckpt_s)).collect();
    let load_gbps = median(&mut v);
    let mut v: Vec<f64> = load_pairs.iter().map(|p| gbps(file_bytes, p.raw_s)).collect();
    let raw_read_gbps = median(&mut v);
    // Rates, not times: the load fills `loaded_bytes` while the raw read moves `file_bytes`.
    let mut v: Vec<f64> = load_pairs.iter().map(|p| gbps(loaded_bytes, p.ckpt_s) / gbps(file_bytes, p.raw_s)).collect();
    let load_ratio = median(&mut v);
    let overhead = peak.saturating_sub(loaded_bytes);
    if a.json {
        let doc = json!({
            "size_bytes": bytes, "file_bytes": file_bytes, "loaded_bytes": loaded_bytes,
            "save_ranks": n, "load_ranks": m, "rounds": a.rounds, "cores": cores(),
            "save_gbps": save_gbps, "raw_write_gbps": raw_write_gbps, "save_ratio": save_ratio,
            "load_gbps": load_gbps, "raw_read_gbps": raw_read_gbps, "load_ratio": load_ratio,
            "read_amplification": amplification, "peak_rss_bytes": peak, "rss_before_load_bytes": baseline,
            "load_overhead_bytes": overhead, "write_balance": balance, "verified": verified,
            "save_rounds": save_pairs.iter().map(|p| json!({"zarrckpt_s": p.ckpt_s, "raw_s": p.raw_s, "raw_streams": p.raw_streams})).collect::<Vec<_>>(),
            "load_rounds": load_pairs.iter().map(|p| json!({"zarrckpt_s": p.ckpt_s, "raw_s": p.raw_s, "raw_streams": p.raw_streams})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "\nmedians: save {save_gbps:.2} GB/s vs raw write+fsync {raw_write_gbps:.2} GB/s -> {:.0}% (target 85%)",
            save_ratio * 100.0
        );
        println!("         load {load_gbps:.2} GB/s vs raw page-cache read {raw_read_gbps:.2} GB/s -> {:.0}% (target 80%)", load_ratio * 100.0);
        println!("         bytes read / bytes needed {amplification:.4} (target <= 1.05)");
        println!(
            "         peak RSS during load {} for {} loaded: {} over (target <= 64 MiB); write balance max/mean {balance:.3}",
            human(peak),
            human(loaded_bytes),
            human(overhead)
        );
        println!("         every loaded byte verified: {}", if verified { "yes" } else { "NO" });
    }
    Ok(if verified { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
