//! `zarrckpt bench`: save and load a synthetic model state and compare with the machine's own
//! limits, measured in the same run on the same directory, alternating pair by pair.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use zarrckpt::comm::run_local;

use crate::inspect::human;
use crate::rss;
use crate::worker::{self, Job, ReadArg};

/// Arguments of `zarrckpt bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Approximate size of the model state in bytes.
    #[arg(long, default_value_t = 2 << 30)]
    size: u64,
    /// Ranks saving (tensor-parallel split), per data-parallel replica.
    #[arg(long, default_value_t = 4)]
    save_ranks: u64,
    /// Ranks loading (another tensor-parallel split), per data-parallel replica.
    #[arg(long, default_value_t = 3)]
    load_ranks: u64,
    /// Data-parallel replicas (both for saving and loading): world = ranks x dp.
    #[arg(long, default_value_t = 1)]
    dp: u64,
    /// Run the ranks as real processes talking TCP on loopback (through `zarrckpt launch`)
    /// instead of threads of this process.
    #[arg(long)]
    processes: bool,
    /// Directory for the checkpoint and the raw-limit files (removed afterwards).
    #[arg(long, default_value = "zarrckpt-bench")]
    dir: PathBuf,
    /// Rounds of (raw, zarrckpt) pairs for save and for load.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Hidden size of the synthetic model.
    #[arg(long, default_value_t = 2048)]
    hidden: u64,
    /// Split every weight by rows, the row-parallel layers too (default: as Megatron, which
    /// splits the attention output and second MLP weights by columns).
    #[arg(long)]
    rows_only: bool,
    /// I/O threads per rank (0: the machine's cores divided among the ranks).
    #[arg(long, default_value_t = 0)]
    io_threads: usize,
    /// How the loading ranks read shard files.
    #[arg(long, value_enum, default_value_t = ReadArg::Pread)]
    read_method: ReadArg,
    /// Keep the checkpoint afterwards.
    #[arg(long)]
    keep: bool,
    /// Save the full training state: fp32 master weights besides the bf16 weights and fp32
    /// Adam moments.
    #[arg(long)]
    full_state: bool,
    /// Skip the asynchronous save rounds.
    #[arg(long)]
    no_async: bool,
    /// Only the asynchronous save rounds (no synchronous save, no load).
    #[arg(long, conflicts_with = "no_async")]
    async_only: bool,
    /// Asynchronous save: run the background writer threads at the normal CPU priority
    /// (by default they run at a lower one, yielding to ranks still staging).
    #[arg(long)]
    async_normal_priority: bool,
    /// Also time cold loads: before each (and before each raw read it is compared with) the
    /// checkpoint's files are evicted from the page cache (fsync, then
    /// `posix_fadvise(POSIX_FADV_DONTNEED)` on every file, and `1` written to
    /// `/proc/sys/vm/drop_caches` where this process may), with where the time went.
    #[arg(long)]
    cold: bool,
    /// With `--cold`: evict with fsync + `posix_fadvise` only, never through
    /// `/proc/sys/vm/drop_caches` (which empties the whole machine's page cache, other
    /// programs' files included).
    #[arg(long, requires = "cold")]
    no_drop_caches: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Flushes all dirty data (`sync(2)`), so that one measurement's writeback does not slow the
/// next one down.
fn sync_all() {
    // SAFETY: sync takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, std::num::NonZero::get)
}

/// The median (the mean of the middle two for an even count; 0 for none).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Writes `total` bytes as `streams` files in parallel, each written sequentially from a reused
/// buffer and fsynced; returns the wall time.
fn raw_write(dir: &Path, total: u64, streams: usize) -> anyhow::Result<f64> {
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
                    let mut f = OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(true)
                        .open(&path)?;
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
            h.join()
                .map_err(|_| anyhow::anyhow!("writer thread panicked"))??;
        }
        Ok(())
    })?;
    let dt = t0.elapsed().as_secs_f64();
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

/// Reads `files` with `streams` threads (files dealt out by size) into reused 16 MiB buffers
/// (`into_dest` false) or each file into its own place in pre-faulted buffers as large as the
/// data, as a load fills its destination (`into_dest` true); returns the wall time.
fn raw_read(files: &[(PathBuf, u64)], streams: usize, into_dest: bool) -> anyhow::Result<f64> {
    let mut sorted: Vec<&(PathBuf, u64)> = files.iter().collect();
    sorted.sort_by_key(|f| std::cmp::Reverse(f.1));
    let mut lists: Vec<Vec<&Path>> = vec![Vec::new(); streams];
    let mut loads = vec![0u64; streams];
    for f in sorted {
        let i = (0..streams).min_by_key(|&i| loads[i]).unwrap_or(0);
        loads[i] += f.1;
        lists[i].push(&f.0);
    }
    let mut dests: Vec<Vec<u8>> = loads
        .iter()
        .map(|&b| vec![0x5Au8; if into_dest { b as usize } else { 16 << 20 }])
        .collect();
    let t0 = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = lists
            .iter()
            .zip(dests.iter_mut())
            .map(|(list, buf)| {
                s.spawn(move || -> anyhow::Result<()> {
                    let mut at = 0usize;
                    for p in list {
                        let mut f = File::open(p)?;
                        loop {
                            let end = if into_dest {
                                buf.len()
                            } else {
                                buf.len().min(16 << 20)
                            };
                            let window = if into_dest {
                                &mut buf[at..end]
                            } else {
                                &mut buf[..]
                            };
                            let n = f.read(window)?;
                            if n == 0 {
                                break;
                            }
                            if into_dest {
                                at += n;
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Evicts `files` from the page cache: fsync each (so no dirty page stays), then
/// `posix_fadvise(POSIX_FADV_DONTNEED)` over it, then (unless `fadvise_only`) writes `1` to
/// `/proc/sys/vm/drop_caches` where this process may. Returns how it was done.
fn evict(files: &[(PathBuf, u64)], fadvise_only: bool) -> anyhow::Result<&'static str> {
    for (p, _) in files {
        let f = File::open(p).with_context(|| format!("open {}", p.display()))?;
        f.sync_all()
            .with_context(|| format!("fsync {}", p.display()))?;
        // SAFETY: a valid descriptor; offset 0 and length 0 mean the whole file.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            bail!(
                "posix_fadvise(DONTNEED) on {}: {}",
                p.display(),
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
    if !fadvise_only && fs::write("/proc/sys/vm/drop_caches", "1").is_ok() {
        return Ok("fsync + posix_fadvise(DONTNEED) + drop_caches=1");
    }
    Ok("fsync + posix_fadvise(DONTNEED)")
}

/// The fraction of `files`' pages in the page cache (`mincore` over a read-only mapping).
fn resident_fraction(files: &[(PathBuf, u64)]) -> anyhow::Result<f64> {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let (mut resident, mut total) = (0usize, 0usize);
    for (p, len) in files {
        let len = usize::try_from(*len)?;
        if len == 0 {
            continue;
        }
        let f = File::open(p).with_context(|| format!("open {}", p.display()))?;
        // SAFETY: a fresh read-only shared mapping of an open file, unmapped below; its
        // bytes are never read.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            bail!("mmap {}: {}", p.display(), std::io::Error::last_os_error());
        }
        let pages = len.div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: `vec` holds one byte per page of the mapping.
        let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
        let err = std::io::Error::last_os_error();
        // SAFETY: the mapping made above, of `len` bytes.
        unsafe { libc::munmap(addr, len) };
        if rc != 0 {
            bail!("mincore {}: {err}", p.display());
        }
        resident += vec.iter().filter(|&&b| b & 1 == 1).count();
        total += pages;
    }
    Ok(if total == 0 {
        0.0
    } else {
        resident as f64 / total as f64
    })
}

/// One cold round: a raw read of every file (the faster of one stream and `streams`), then
/// the load, each after evicting the files.
struct ColdRound {
    secs: f64,
    raw: f64,
    phases: Phases,
    /// Largest fraction of the files' pages still cached right after an eviction.
    resident: f64,
}

/// The ranks of one save or load: threads of this process or launched processes. Returns
/// every rank's report, and (in-process) the process's peak RSS during the run.
fn run_ranks(a: &Args, w: &worker::Args, world: u64) -> anyhow::Result<(Vec<Value>, u64, u64)> {
    if a.processes {
        let report = a.dir.join("report");
        let mut w = w.clone();
        w.report = Some(report.clone());
        let exe = std::env::current_exe()?;
        let mut cmd: Vec<OsString> = vec![exe.into(), "worker".into()];
        cmd.extend(worker_args(&w));
        let opts = crate::launcher::LaunchOptions {
            stdout: crate::launcher::Sink::Stderr,
            ..Default::default()
        };
        crate::launcher::launch(world as usize, &cmd, &opts).context("launching the ranks")?;
        let reports = (0..world)
            .map(|r| {
                let p = report.with_extension(format!("{r}"));
                let v = serde_json::from_slice(&fs::read(&p)?)?;
                fs::remove_file(&p)?;
                Ok(v)
            })
            .collect::<anyhow::Result<Vec<Value>>>()?;
        Ok((reports, 0, 0))
    } else {
        let before = rss::current();
        let reset = rss::reset_peak();
        let results = run_local(world as usize, Duration::from_secs(600), |comm| {
            worker::run_rank(w, std::sync::Arc::new(comm))
        });
        let peak = if reset { rss::peak() } else { 0 };
        let reports = results
            .into_iter()
            .collect::<anyhow::Result<Vec<Value>>>()?;
        Ok((reports, peak, before))
    }
}

/// The command-line form of worker arguments.
fn worker_args(w: &worker::Args) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec![
        match w.job {
            Job::Save => "save",
            Job::SaveAsync => "save-async",
            Job::Load => "load",
        }
        .into(),
        "--dir".into(),
        w.dir.clone().into(),
        "--size".into(),
        w.size.to_string().into(),
        "--hidden".into(),
        w.hidden.to_string().into(),
        "--tp".into(),
        w.tp.to_string().into(),
        "--dp".into(),
        w.dp.to_string().into(),
        "--io-threads".into(),
        w.io_threads.to_string().into(),
    ];
    if w.no_exchange {
        v.push("--no-exchange".into());
    }
    if w.rows_only {
        v.push("--rows-only".into());
    }
    if w.full_state {
        v.push("--full-state".into());
    }
    if w.normal_priority {
        v.push("--normal-priority".into());
    }
    v.push(
        match w.read_method {
            ReadArg::Pread => "--read-method=pread",
            ReadArg::Mmap => "--read-method=mmap",
        }
        .into(),
    );
    if w.overwrite {
        v.push("--overwrite".into());
    }
    if let Some(r) = &w.report {
        v.push("--report".into());
        v.push(r.clone().into());
    }
    v
}

fn sum(reports: &[Value], field: &str) -> u64 {
    reports
        .iter()
        .filter_map(|r| r.get(field).and_then(Value::as_u64))
        .sum()
}

fn max_secs(reports: &[Value]) -> f64 {
    reports
        .iter()
        .filter_map(|r| r.get("secs").and_then(Value::as_f64))
        .fold(0.0, f64::max)
}

/// Where a load's time went: wall time of the slowest rank's steps, and the reading threads'
/// time by step summed over every rank's threads (seconds).
#[derive(Clone, Copy, Default)]
struct Phases {
    plan: f64,
    read: f64,
    exchange: f64,
    open: f64,
    io_read: f64,
    checksum: f64,
    copy: f64,
}

impl Phases {
    fn of(reports: &[Value]) -> Phases {
        let f = |r: &Value, k: &str| r["phases"][k].as_f64().unwrap_or(0.0);
        let total = |k: &str| reports.iter().map(|r| f(r, k)).sum::<f64>();
        let slowest = reports.iter().max_by(|a, b| {
            f64::total_cmp(
                &a["secs"].as_f64().unwrap_or(0.0),
                &b["secs"].as_f64().unwrap_or(0.0),
            )
        });
        let wall = |k: &str| slowest.map_or(0.0, |r| f(r, k));
        Phases {
            plan: wall("plan_s"),
            read: wall("read_s"),
            exchange: wall("exchange_s"),
            open: total("io_open_s"),
            io_read: total("io_read_s"),
            checksum: total("io_checksum_s"),
            copy: total("io_copy_s"),
        }
    }

    fn median(all: &[Phases]) -> Phases {
        let m = |f: fn(&Phases) -> f64| median(all.iter().map(f).collect());
        Phases {
            plan: m(|p| p.plan),
            read: m(|p| p.read),
            exchange: m(|p| p.exchange),
            open: m(|p| p.open),
            io_read: m(|p| p.io_read),
            checksum: m(|p| p.checksum),
            copy: m(|p| p.copy),
        }
    }

    fn json(&self) -> Value {
        json!({
            "plan_s": self.plan, "read_s": self.read, "exchange_s": self.exchange,
            "io_open_s": self.open, "io_read_s": self.io_read,
            "io_checksum_s": self.checksum, "io_copy_s": self.copy,
        })
    }

    fn describe(&self) -> String {
        format!(
            "slowest rank: plan {:.3} s, read {:.3} s, exchange {:.3} s | I/O threads, all ranks: open+index {:.3} s, read calls {:.3} s, checksum {:.3} s, copy {:.3} s",
            self.plan, self.read, self.exchange, self.open, self.io_read, self.checksum, self.copy
        )
    }
}

struct LoadRun {
    secs: f64,
    phases: Phases,
    loaded: u64,
    read: u64,
    received: u64,
    /// Largest memory over the loaded bytes: the process's (threads) or the worst process's.
    overhead: u64,
    peak: u64,
    verified: bool,
}

fn load_run(a: &Args, w: &worker::Args, world: u64) -> anyhow::Result<LoadRun> {
    let (reports, peak, before) = run_ranks(a, w, world)?;
    let loaded = sum(&reports, "loaded_bytes");
    let (peak, overhead) = if a.processes {
        reports
            .iter()
            .map(|r| {
                let p = r.get("peak_rss").and_then(Value::as_u64).unwrap_or(0);
                (
                    p,
                    p.saturating_sub(r.get("loaded_bytes").and_then(Value::as_u64).unwrap_or(0)),
                )
            })
            .max_by_key(|x| x.1)
            .unwrap_or((0, 0))
    } else {
        // The in-process ranks allocate their buffers inside the run: count them as loaded.
        if std::env::var_os("ZARRCKPT_BENCH_DEBUG").is_some() {
            eprintln!("bench: rss before load {before}, peak {peak}, loaded {loaded}");
        }
        (peak, peak.saturating_sub(loaded))
    };
    Ok(LoadRun {
        secs: max_secs(&reports),
        phases: Phases::of(&reports),
        loaded,
        read: sum(&reports, "bytes_read"),
        received: sum(&reports, "bytes_received"),
        overhead,
        peak,
        verified: reports
            .iter()
            .all(|r| r.get("verified").and_then(Value::as_bool) == Some(true)),
    })
}

/// One round of the asynchronous save: the slowest rank's figures.
struct AsyncRound {
    blocked: f64,
    memcpy: f64,
    write: f64,
    raw: f64,
    staged: u64,
    file_bytes: u64,
    plan_reused: bool,
}

fn max_of(reports: &[Value], field: &str) -> f64 {
    reports
        .iter()
        .filter_map(|r| r.get(field).and_then(Value::as_f64))
        .fold(0.0, f64::max)
}

/// Rounds of (memcpy, asynchronous save, raw write+fsync): each rank saves once to warm up
/// (staging memory allocated, plan agreed), copies the bytes it stages with a plain memcpy
/// into warm memory, then saves again, measured: the time its caller is blocked and the time
/// the background takes to write, fsync and commit.
fn async_save_rounds(
    a: &Args,
    base: &worker::Args,
    ckpt: &Path,
    rawdir: &Path,
    world: u64,
    say: &dyn Fn(String),
) -> anyhow::Result<Vec<AsyncRound>> {
    let args = worker::Args {
        job: Job::SaveAsync,
        ..base.clone()
    };
    let mut rounds = Vec::new();
    for round in 0..a.rounds {
        if ckpt.exists() {
            fs::remove_dir_all(ckpt).with_context(|| format!("remove {}", ckpt.display()))?;
        }
        sync_all();
        let (reports, _, _) = run_ranks(a, &args, world)?;
        let file_bytes = sum(&reports, "file_bytes");
        let r = AsyncRound {
            blocked: max_of(&reports, "blocked_secs"),
            memcpy: max_of(&reports, "memcpy_secs"),
            write: max_of(&reports, "write_secs"),
            raw: 0.0,
            staged: sum(&reports, "staged_bytes"),
            file_bytes,
            plan_reused: reports
                .iter()
                .all(|r| r.get("plan_reused").and_then(Value::as_bool) == Some(true)),
        };
        sync_all();
        let one = raw_write(rawdir, file_bytes, 1)?;
        sync_all();
        let many = raw_write(rawdir, file_bytes, world as usize)?;
        let r = AsyncRound {
            raw: one.min(many),
            ..r
        };
        say(format!(
            "async save round {round}: caller blocked {:.3} s, memcpy of the same {} {:.3} s -> {:.2}x | background write+fsync+commit {:.3} s = {:.2} GB/s | raw write+fsync {:.3} s = {:.2} GB/s | ratio {:.2}{}",
            r.blocked,
            human(r.staged),
            r.memcpy,
            r.blocked / r.memcpy,
            r.write,
            file_bytes as f64 / r.write / 1e9,
            r.raw,
            file_bytes as f64 / r.raw / 1e9,
            r.raw / r.write,
            if r.plan_reused {
                ""
            } else {
                " (plan NOT reused)"
            }
        ));
        rounds.push(r);
    }
    Ok(rounds)
}

/// The asynchronous rounds' medians (empty without rounds).
fn async_summary(rounds: &[AsyncRound]) -> Value {
    let Some(last) = rounds.last() else {
        return json!({});
    };
    let med = |f: &dyn Fn(&AsyncRound) -> f64| median(rounds.iter().map(f).collect());
    json!({
        "async_blocked_s": med(&|r| r.blocked),
        "memcpy_s": med(&|r| r.memcpy),
        "async_block_ratio": med(&|r| r.blocked / r.memcpy),
        "async_staged_bytes": last.staged,
        "async_write_gbps": med(&|r| r.file_bytes as f64 / r.write / 1e9),
        "async_raw_write_gbps": med(&|r| r.file_bytes as f64 / r.raw / 1e9),
        "async_write_ratio": med(&|r| r.raw / r.write),
        "async_plan_reused": rounds.iter().all(|r| r.plan_reused),
        "async_rounds": rounds
            .iter()
            .map(|r| json!({"blocked_s": r.blocked, "memcpy_s": r.memcpy, "write_s": r.write, "raw_s": r.raw}))
            .collect::<Vec<_>>(),
    })
}

fn print_async_summary(doc: &Value) {
    let f = |k: &str| doc[k].as_f64().unwrap_or(0.0);
    println!(
        "         async save: caller blocked {:.3} s vs memcpy of the same bytes {:.3} s -> {:.2}x (target <= 1.2x); background write {:.2} GB/s vs raw write+fsync {:.2} GB/s -> {:.0}% (target 85%)",
        f("async_blocked_s"),
        f("memcpy_s"),
        f("async_block_ratio"),
        f("async_write_gbps"),
        f("async_raw_write_gbps"),
        f("async_write_ratio") * 100.0
    );
}

/// Rounds of (raw cold read, cold load), every one after evicting the checkpoint's files.
/// Returns the rounds, how the files were evicted, and whether every load verified.
fn cold_rounds(
    a: &Args,
    load_args: &worker::Args,
    load_world: u64,
    files: &[(PathBuf, u64)],
    file_bytes: u64,
    streams: usize,
    say: &dyn Fn(String),
) -> anyhow::Result<(Vec<ColdRound>, &'static str, bool)> {
    let mut rounds = Vec::new();
    let mut how = "";
    let mut verified = true;
    let mut evicted = || -> anyhow::Result<f64> {
        how = evict(files, a.no_drop_caches)?;
        resident_fraction(files)
    };
    for round in 0..a.rounds {
        let mut resident = evicted()?;
        let many = raw_read(files, streams, false)?;
        resident = resident.max(evicted()?);
        let one = raw_read(files, 1, false)?;
        let raw = one.min(many);
        resident = resident.max(evicted()?);
        let run = load_run(a, load_args, load_world)?;
        verified &= run.verified;
        let gbps = run.loaded as f64 / run.secs / 1e9;
        let raw_gbps = file_bytes as f64 / raw / 1e9;
        say(format!(
            "cold load round {round}: zarrckpt {:.3} s = {gbps:.2} GB/s | raw cold read {raw:.3} s = {raw_gbps:.2} GB/s (1 stream {:.2}, {streams} streams {:.2}) | ratio {:.2} | pages cached after eviction {:.2}%",
            run.secs,
            file_bytes as f64 / one / 1e9,
            file_bytes as f64 / many / 1e9,
            gbps / raw_gbps,
            resident * 100.0
        ));
        say(format!("         phases: {}", run.phases.describe()));
        rounds.push(ColdRound {
            secs: run.secs,
            raw,
            phases: run.phases,
            resident,
        });
    }
    Ok((rounds, how, verified))
}

/// The cold rounds' medians (empty without rounds).
fn cold_summary(rounds: &[ColdRound], how: &str, loaded: u64, file_bytes: u64) -> Value {
    if rounds.is_empty() {
        return json!({});
    }
    let phases: Vec<Phases> = rounds.iter().map(|r| r.phases).collect();
    json!({
        "cold_eviction": how,
        "cold_resident_after_eviction": rounds.iter().map(|r| r.resident).fold(0.0, f64::max),
        "cold_load_gbps": median(rounds.iter().map(|r| loaded as f64 / r.secs / 1e9).collect()),
        "cold_raw_read_gbps": median(rounds.iter().map(|r| file_bytes as f64 / r.raw / 1e9).collect()),
        "cold_load_ratio": median(rounds.iter().map(|r| (loaded as f64 / r.secs) / (file_bytes as f64 / r.raw)).collect()),
        "cold_load_phases": Phases::median(&phases).json(),
        "cold_rounds": rounds
            .iter()
            .map(|r| json!({"zarrckpt_s": r.secs, "raw_s": r.raw, "resident_after_eviction": r.resident, "phases": r.phases.json()}))
            .collect::<Vec<_>>(),
    })
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if a.save_ranks == 0 || a.load_ranks == 0 || a.rounds == 0 || a.dp == 0 {
        bail!("ranks, dp and rounds must be at least 1");
    }
    fs::create_dir_all(&a.dir).with_context(|| format!("create {}", a.dir.display()))?;
    let ckpt = a.dir.join("ckpt");
    let rawdir = a.dir.join("raw");
    let (n, m, dp) = (a.save_ranks, a.load_ranks, a.dp);
    let (save_world, load_world) = (n * dp, m * dp);
    let threads = |world: u64| {
        if a.io_threads > 0 {
            a.io_threads
        } else {
            (cores() / world as usize).max(1)
        }
    };
    let say = |s: String| {
        if !a.json {
            println!("{s}");
        }
    };
    let base = worker::Args {
        job: Job::Save,
        dir: ckpt.clone(),
        size: a.size,
        hidden: a.hidden,
        tp: n,
        dp,
        io_threads: threads(save_world),
        rows_only: a.rows_only,
        no_exchange: false,
        overwrite: false,
        report: None,
        die_after_bytes: None,
        die_rank: 0,
        stall_secs: None,
        stall_rank: 0,
        read_method: a.read_method,
        full_state: a.full_state,
        objects: false,
        normal_priority: a.async_normal_priority,
    };
    let model = base.model();
    let bytes = model.nbytes();
    say(format!(
        "model: {} tensors, {} ({bytes} bytes); save {n}x{dp} ranks, load {m}x{dp} ranks (tp x dp) as {}; {} cores; dir {}",
        model.tensors.len(),
        human(bytes),
        if a.processes {
            "processes over TCP"
        } else {
            "threads"
        },
        cores(),
        a.dir.display()
    ));

    // ---- save: (zarrckpt, raw) pairs ----
    let mut save_rounds = Vec::new();
    let mut file_bytes = 0;
    let mut balance = 1.0;
    for round in 0..if a.async_only { 0 } else { a.rounds } {
        // A checkpoint goes to a new directory, as training jobs write one per step: remove
        // the previous round's (untimed) and let the kernel finish its writeback first.
        if ckpt.exists() {
            fs::remove_dir_all(&ckpt).with_context(|| format!("remove {}", ckpt.display()))?;
        }
        sync_all();
        let (reports, _, _) = run_ranks(a, &base, save_world)?;
        let secs = max_secs(&reports);
        file_bytes = sum(&reports, "file_bytes");
        balance = reports
            .first()
            .and_then(|r| r.get("write_balance"))
            .and_then(Value::as_f64)
            .unwrap_or(1.0);
        sync_all();
        let one = raw_write(&rawdir, file_bytes, 1)?;
        sync_all();
        let many = raw_write(&rawdir, file_bytes, save_world as usize)?;
        let raw = one.min(many);
        say(format!(
            "save round {round}: zarrckpt {secs:.3} s = {:.2} GB/s | raw write+fsync {raw:.3} s = {:.2} GB/s (1 stream {:.2}, {save_world} streams {:.2}) | ratio {:.2}",
            bytes as f64 / secs / 1e9,
            file_bytes as f64 / raw / 1e9,
            file_bytes as f64 / one / 1e9,
            file_bytes as f64 / many / 1e9,
            raw / secs
        ));
        save_rounds.push((secs, raw));
    }

    // ---- asynchronous save: (memcpy, zarrckpt async, raw) per round ----
    let async_rounds = if a.no_async {
        Vec::new()
    } else {
        async_save_rounds(a, &base, &ckpt, &rawdir, save_world, &say)?
    };
    if a.async_only {
        if !a.keep {
            fs::remove_dir_all(&a.dir).with_context(|| format!("remove {}", a.dir.display()))?;
        }
        let doc = async_summary(&async_rounds);
        if a.json {
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            print_async_summary(&doc);
        }
        return Ok(ExitCode::SUCCESS);
    }

    // ---- load: (raw, zarrckpt[, zarrckpt without exchange]) ----
    let mut files = Vec::new();
    files_under(&ckpt, &mut files)?;
    let load_args = worker::Args {
        job: Job::Load,
        tp: m,
        io_threads: threads(load_world),
        overwrite: false,
        ..base.clone()
    };
    let plain_args = worker::Args {
        no_exchange: true,
        ..load_args.clone()
    };
    let mut load_rounds = Vec::new();
    let mut dest_rounds = Vec::new();
    let mut phase_rounds = Vec::new();
    let mut plain_rounds = Vec::new();
    let mut last = None;
    let mut verified = true;
    for round in 0..a.rounds {
        let streams = load_world.min(cores() as u64 * 2) as usize;
        let one = raw_read(&files, 1, false)?;
        let many = raw_read(&files, streams, false)?;
        let raw = one.min(many);
        let raw_gbps = file_bytes as f64 / raw / 1e9;
        let dest = raw_read(&files, 1, true)?.min(raw_read(&files, streams, true)?);
        let run = load_run(a, &load_args, load_world)?;
        verified &= run.verified;
        let gbps = run.loaded as f64 / run.secs / 1e9;
        say(format!(
            "load round {round}: zarrckpt {:.3} s = {gbps:.2} GB/s | raw page-cache read {raw:.3} s = {raw_gbps:.2} GB/s (into destination-sized buffers {:.2} GB/s) | ratio {:.2} | read/needed {:.4} | peak RSS {} for {} loaded",
            run.secs,
            file_bytes as f64 / dest / 1e9,
            gbps / raw_gbps,
            run.read as f64 / (run.loaded as f64 / dp as f64),
            human(run.peak),
            human(run.loaded)
        ));
        say(format!("         phases: {}", run.phases.describe()));
        load_rounds.push((run.secs, raw));
        phase_rounds.push(run.phases);
        dest_rounds.push(dest);
        if dp > 1 {
            let plain = load_run(a, &plain_args, load_world)?;
            verified &= plain.verified;
            say(format!(
                "         without exchange: {:.3} s = {:.2} GB/s, read/needed {:.4}",
                plain.secs,
                plain.loaded as f64 / plain.secs / 1e9,
                plain.read as f64 / (plain.loaded as f64 / dp as f64)
            ));
            plain_rounds.push((plain.secs, plain.read));
        }
        last = Some(run);
    }
    let (cold, eviction) = if a.cold {
        let streams = load_world.min(cores() as u64 * 2) as usize;
        let (rounds, how, ok) =
            cold_rounds(a, &load_args, load_world, &files, file_bytes, streams, &say)?;
        verified &= ok;
        (rounds, how)
    } else {
        (Vec::new(), "")
    };
    if !a.keep {
        fs::remove_dir_all(&a.dir).with_context(|| format!("remove {}", a.dir.display()))?;
    }
    let run = last.context("no load round ran")?;

    let save_gbps = median(
        save_rounds
            .iter()
            .map(|p| bytes as f64 / p.0 / 1e9)
            .collect(),
    );
    let raw_write_gbps = median(
        save_rounds
            .iter()
            .map(|p| file_bytes as f64 / p.1 / 1e9)
            .collect(),
    );
    let save_ratio = median(save_rounds.iter().map(|p| p.1 / p.0).collect());
    let load_gbps = median(
        load_rounds
            .iter()
            .map(|p| run.loaded as f64 / p.0 / 1e9)
            .collect(),
    );
    let raw_read_gbps = median(
        load_rounds
            .iter()
            .map(|p| file_bytes as f64 / p.1 / 1e9)
            .collect(),
    );
    // Rates, not times: the load fills `loaded` bytes while the raw read moves `file_bytes`.
    let load_ratio = median(
        load_rounds
            .iter()
            .map(|p| (run.loaded as f64 / p.0) / (file_bytes as f64 / p.1))
            .collect(),
    );
    let raw_read_dest_gbps = median(
        dest_rounds
            .iter()
            .map(|&d| file_bytes as f64 / d / 1e9)
            .collect(),
    );
    let load_ratio_dest = median(
        load_rounds
            .iter()
            .zip(&dest_rounds)
            .map(|(p, &d)| (run.loaded as f64 / p.0) / (file_bytes as f64 / d))
            .collect(),
    );
    let needed = run.loaded as f64 / dp as f64;
    let amplification = run.read as f64 / needed;
    let mut doc = json!({
        "size_bytes": bytes, "file_bytes": file_bytes, "loaded_bytes": run.loaded,
        "save_ranks": n, "load_ranks": m, "dp": dp, "processes": a.processes, "read_method": format!("{:?}", a.read_method).to_lowercase(), "rounds": a.rounds, "cores": cores(),
        "save_gbps": save_gbps, "raw_write_gbps": raw_write_gbps, "save_ratio": save_ratio,
        "load_gbps": load_gbps, "raw_read_gbps": raw_read_gbps, "load_ratio": load_ratio,
        "raw_read_into_dest_gbps": raw_read_dest_gbps, "load_ratio_into_dest": load_ratio_dest,
        "read_amplification": amplification, "peak_rss_bytes": run.peak, "load_overhead_bytes": run.overhead,
        "bytes_received": run.received, "write_balance": balance, "verified": verified,
        "save_rounds": save_rounds.iter().map(|p| json!({"zarrckpt_s": p.0, "raw_s": p.1})).collect::<Vec<_>>(),
        "load_rounds": load_rounds.iter().zip(&phase_rounds).zip(&dest_rounds).map(|((p, ph), d)| json!({"zarrckpt_s": p.0, "raw_s": p.1, "raw_into_dest_s": d, "phases": ph.json()})).collect::<Vec<_>>(),
        "load_phases": Phases::median(&phase_rounds).json(),
    });
    if let (Value::Object(d), Value::Object(x)) = (&mut doc, async_summary(&async_rounds)) {
        d.extend(x);
    }
    if let (Value::Object(d), Value::Object(x)) = (
        &mut doc,
        cold_summary(&cold, eviction, run.loaded, file_bytes),
    ) {
        d.extend(x);
    }
    if dp > 1 {
        let plain_gbps = median(
            plain_rounds
                .iter()
                .map(|p| run.loaded as f64 / p.0 / 1e9)
                .collect(),
        );
        let plain_read = plain_rounds.last().map_or(0, |p| p.1);
        doc["load_no_exchange_gbps"] = json!(plain_gbps);
        doc["read_amplification_no_exchange"] = json!(plain_read as f64 / needed);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "\nmedians: save {save_gbps:.2} GB/s vs raw write+fsync {raw_write_gbps:.2} GB/s -> {:.0}% (target 85%)",
            save_ratio * 100.0
        );
        println!(
            "         load {load_gbps:.2} GB/s vs raw page-cache read {raw_read_gbps:.2} GB/s -> {:.0}% (target 80%); vs a read into destination-sized buffers {raw_read_dest_gbps:.2} GB/s -> {:.0}%",
            load_ratio * 100.0,
            load_ratio_dest * 100.0
        );
        println!(
            "         load phases (medians): {}",
            Phases::median(&phase_rounds).describe()
        );
        if !cold.is_empty() {
            let f = |k: &str| doc[k].as_f64().unwrap_or(0.0);
            println!(
                "         cold load {:.2} GB/s vs raw cold read {:.2} GB/s -> {:.0}% (evicted by {eviction}; at most {:.2}% of the pages still cached after an eviction)",
                f("cold_load_gbps"),
                f("cold_raw_read_gbps"),
                f("cold_load_ratio") * 100.0,
                f("cold_resident_after_eviction") * 100.0
            );
            println!(
                "         cold load phases (medians): {}",
                Phases::median(&cold.iter().map(|r| r.phases).collect::<Vec<_>>()).describe()
            );
        }
        println!(
            "         bytes read from storage / bytes needed {amplification:.4} (target <= 1.05)"
        );
        if !async_rounds.is_empty() {
            print_async_summary(&doc);
        }
        if dp > 1 {
            println!(
                "         without exchange: {:.2} GB/s, bytes read / bytes needed {:.4}",
                doc["load_no_exchange_gbps"].as_f64().unwrap_or(0.0),
                doc["read_amplification_no_exchange"]
                    .as_f64()
                    .unwrap_or(0.0)
            );
        }
        println!(
            "         peak RSS during load {} for {} loaded: {} over (target <= 64 MiB); write balance max/mean {balance:.3}",
            human(run.peak),
            human(run.loaded),
            human(run.overhead)
        );
        println!(
            "         every loaded byte verified: {}",
            if verified { "yes" } else { "NO" }
        );
    }
    Ok(if verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
