//! `zarrckpt crash-trials`: the crash-consistency harness. Each trial starts a child process
//! that saves (3 in-process ranks) and kills it with SIGKILL at a random moment, then checks
//! that the previous checkpoint loads bit-exactly or the new one is committed (never neither,
//! never a mix), that nothing incomplete is reported complete or loads, that `verify` finds
//! no problem in what opens and names what is incomplete, and that the next save succeeds and
//! leaves no staging leftovers. Trial kinds rotate: a fresh directory, a save over an existing
//! checkpoint, the same with the fallback swap (no `RENAME_EXCHANGE`), and a save through the
//! checkpoint manager: three quarters of the trials replace or add to existing checkpoints.

mod s3;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use zarrckpt::Communicator;
use zarrckpt::comm::local::run_local;
use zarrckpt::storage::StorageError;
use zarrckpt::{
    Checkpoint, CheckpointManager, DType, Error, LoadOptions, LoadTarget, ManagerOptions, Region,
    SaveOptions, ShardedTensor, TensorKey, save,
};

/// Ranks of every save.
const WORLD: usize = 3;
const TENSORS: usize = 4;

/// Arguments of `zarrckpt crash-trials`.
#[derive(clap::Args)]
pub struct Args {
    /// Number of trials.
    #[arg(long, default_value_t = 200)]
    trials: usize,
    /// Approximate bytes of each saved state.
    #[arg(long, default_value_t = 8 << 20)]
    size: u64,
    /// Seed of the random kill times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Directory for the trials' checkpoints (default: a fresh temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Run the trials on an object store instead: overwrites of checkpoints under this URL
    /// (`s3://bucket/prefix`; endpoint and credentials from `AWS_*`), each killed at a random
    /// moment, then loaded, verified and collected with `gc`.
    #[arg(long)]
    url: Option<String>,
}

/// Which save a child runs.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Into a new directory.
    Fresh,
    /// Over an existing checkpoint.
    Overwrite,
    /// Over an existing checkpoint, with the fallback swap.
    Fallback,
    /// Step 3 through the checkpoint manager (steps 1 and 2 exist).
    Manager,
}

/// Arguments of the hidden `zarrckpt crash-child`.
#[derive(clap::Args)]
pub struct ChildArgs {
    #[arg(value_enum)]
    kind: Kind,
    #[arg(long)]
    dir: PathBuf,
    #[arg(long)]
    generation: u64,
    #[arg(long)]
    size: u64,
}

fn rows(size: u64) -> u64 {
    // TENSORS tensors of [rows, 256] u32, rows a multiple of WORLD.
    (size / (TENSORS as u64 * 256 * 4) / WORLD as u64).max(1) * WORLD as u64
}

/// The bytes of tensor `t` of generation `g`, rows `r0..r1`.
fn fill(g: u64, t: usize, r0: u64, r1: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(((r1 - r0) * 256 * 4) as usize);
    let salt = (g.wrapping_mul(0x9E37_79B9) ^ (t as u64).wrapping_mul(0x85EB_CA6B)) as u32;
    for i in r0 * 256..r1 * 256 {
        let v = (i as u32).wrapping_mul(2_654_435_761) ^ salt;
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn key(t: usize) -> TensorKey {
    TensorKey::new(format!("layers.{t}.weight")).unwrap_or_else(|_| unreachable!())
}

/// Saves generation `g` with WORLD in-process ranks.
fn save_generation(kind: Kind, dir: &Path, g: u64, size: u64) -> anyhow::Result<()> {
    let n = rows(size);
    let per = n / WORLD as u64;
    let results = run_local(WORLD, Duration::from_secs(60), |comm| {
        let r = comm.rank() as u64;
        let datas: Vec<Vec<u8>> = (0..TENSORS)
            .map(|t| fill(g, t, r * per, (r + 1) * per))
            .collect();
        let pieces: Vec<ShardedTensor> = datas
            .iter()
            .enumerate()
            .map(|(t, d)| {
                ShardedTensor::new(
                    key(t),
                    DType::UInt32,
                    vec![n, 256],
                    Region::new(vec![r * per, 0], vec![per, 256])
                        .unwrap_or_else(|_| unreachable!()),
                    0,
                    d,
                )
                .map_err(Error::from)
            })
            .collect::<Result<_, _>>()?;
        let opts = SaveOptions {
            overwrite: kind != Kind::Fresh,
            io_threads: 1,
            ..SaveOptions::default()
        };
        if kind == Kind::Manager {
            let saver = zarrckpt::Saver::new(std::sync::Arc::new(comm));
            let request = zarrckpt::SaveRequest::new().with_tensors(pieces);
            CheckpointManager::new(dir, saver, manager_opts())
                .save(g, &request, &opts)
                .map(|_| ())
        } else {
            save(&pieces, dir, &comm, &opts).map(|_| ())
        }
    });
    for r in results {
        r?;
    }
    Ok(())
}

fn manager_opts() -> ManagerOptions {
    ManagerOptions {
        keep_last: 2,
        keep_every: None,
    }
}

/// Loads every tensor of the checkpoint at `dir` and returns the generation it holds, or an
/// error if it matches none of `candidates` exactly.
fn generation_of(dir: &Path, size: u64, candidates: &[u64]) -> anyhow::Result<u64> {
    let ck = Checkpoint::open(dir)?;
    let n = rows(size);
    let mut found: Option<u64> = None;
    for t in 0..TENSORS {
        let got = ck.read_tensor(&key(t))?;
        let g = candidates
            .iter()
            .copied()
            .find(|&g| fill(g, t, 0, n) == got)
            .with_context(|| {
                format!("{}: tensor {t} matches no saved generation", dir.display())
            })?;
        ensure!(
            found.is_none_or(|f| f == g),
            "{}: a mix of generations {found:?} and {g}",
            dir.display()
        );
        found = Some(g);
    }
    let report = ck.verify(1, None)?;
    ensure!(
        report.problems.is_empty(),
        "{}: verify found {:?}",
        dir.display(),
        report.problems
    );
    found.context("no tensors")
}

/// Loads the latest step through the manager and checks it is generation `step`.
fn check_manager(root: &Path, size: u64) -> anyhow::Result<u64> {
    let one = std::sync::Arc::new(zarrckpt::LocalComm::single());
    let mut m = CheckpointManager::new(root, zarrckpt::Saver::new(one), manager_opts());
    let latest = m.latest()?.context("no committed step")?;
    for s in m.steps()? {
        match Checkpoint::open(&s.dir) {
            Ok(_) => {
                ensure!(s.complete, "step {} opens but is listed incomplete", s.step);
                ensure!(generation_of(&s.dir, size, &[s.step])? == s.step);
            }
            Err(e) => {
                ensure!(!s.complete, "step {} is listed complete but: {e}", s.step);
                ensure!(
                    matches!(e, Error::Storage(StorageError::Incomplete { .. })),
                    "step {}: verify does not say incomplete: {e}",
                    s.step
                );
            }
        }
    }
    let n = rows(size);
    let mut bufs: Vec<Vec<u8>> = (0..TENSORS)
        .map(|_| vec![0u8; (n * 256 * 4) as usize])
        .collect();
    let mut targets: Vec<LoadTarget> = bufs
        .iter_mut()
        .enumerate()
        .map(|(t, b)| {
            LoadTarget::new(
                key(t),
                DType::UInt32,
                vec![n, 256],
                Region::full(&[n, 256]),
                b,
            )
        })
        .collect::<Result<_, _>>()?;
    let (step, _) = m
        .load_latest(&mut targets, &[], &LoadOptions::default())?
        .context("load_latest found nothing")?;
    drop(targets);
    ensure!(step == latest);
    for (t, b) in bufs.iter().enumerate() {
        ensure!(
            *b == fill(step, t, 0, n),
            "load_latest: tensor {t} is not step {step}"
        );
    }
    Ok(step)
}

fn leftovers(parent: &Path) -> Vec<String> {
    std::fs::read_dir(parent)
        .map(|e| {
            e.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".zarrckpt-staging-") || n.contains(".zarrckpt-old-"))
                .collect()
        })
        .unwrap_or_default()
}

fn child(kind: Kind, dir: &Path, g: u64, size: u64) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap_or_else(|_| "zarrckpt".into()));
    c.arg("crash-child")
        .arg(match kind {
            Kind::Fresh => "fresh",
            Kind::Overwrite => "overwrite",
            Kind::Fallback => "fallback",
            Kind::Manager => "manager",
        })
        .arg("--dir")
        .arg(dir)
        .arg("--generation")
        .arg(g.to_string())
        .arg("--size")
        .arg(size.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if kind == Kind::Fallback {
        c.env("ZARRCKPT_NO_RENAME_EXCHANGE", "1");
    }
    c
}

/// What one trial ended with.
#[derive(Default, Debug)]
struct Tally {
    passed: usize,
    new_committed: usize,
    old_kept: usize,
    incomplete: usize,
    finished_before_kill: usize,
}

/// One trial: prepare, run the child, kill it after `delay`, check, save again, check.
fn trial(
    kind: Kind,
    dir: &Path,
    size: u64,
    delay: Duration,
    tally: &mut Tally,
) -> anyhow::Result<()> {
    let (target, old, new) = match kind {
        Kind::Fresh => (dir.join("ckpt"), None, 2),
        Kind::Overwrite | Kind::Fallback => {
            let d = dir.join("ckpt");
            save_generation(Kind::Fresh, &d, 1, size)?;
            (d, Some(1), 2)
        }
        Kind::Manager => {
            let root = dir.join("run");
            save_generation(Kind::Manager, &root, 1, size)?;
            save_generation(Kind::Manager, &root, 2, size)?;
            (root, Some(2), 3)
        }
    };
    let mut proc = child(kind, &target, new, size).spawn()?;
    let _out = wait_ready(&mut proc)?;
    let finished = kill_after(&mut proc, delay)?;
    tally.finished_before_kill += usize::from(finished);
    let parent = target.parent().context("no parent")?;
    let got = match kind {
        Kind::Manager => Some(check_manager(&target, size)?),
        _ => match Checkpoint::open(&target) {
            Ok(_) => Some(generation_of(&target, size, &[1, 2])?),
            Err(Error::Storage(
                StorageError::Incomplete { .. } | StorageError::NotACheckpoint { .. },
            )) if old.is_none() => None,
            Err(e) => bail!("neither the previous nor the new checkpoint opens: {e}"),
        },
    };
    match got {
        Some(g) if g == new => tally.new_committed += 1,
        Some(g) if Some(g) == old => {
            ensure!(
                !finished,
                "the save returned success but the old checkpoint is there"
            );
            tally.old_kept += 1;
        }
        Some(g) => bail!("generation {g} found, expected {old:?} or {new}"),
        None => {
            ensure!(
                !finished,
                "the save returned success but nothing is committed"
            );
            tally.incomplete += 1;
        }
    }
    // The next save (the crashed one's lock was released by the kernel) recovers and cleans.
    let next = new + 1;
    let again = if kind == Kind::Fresh {
        Kind::Overwrite
    } else {
        kind
    };
    save_generation(again, &target, next, size)?;
    match kind {
        Kind::Manager => ensure!(check_manager(&target, size)? == next),
        _ => ensure!(generation_of(&target, size, &[next])? == next),
    }
    let left = leftovers(parent);
    ensure!(left.is_empty(), "leftovers after the next save: {left:?}");
    tally.passed += 1;
    Ok(())
}

/// Waits for the child's "ready" line (printed just before it starts saving).
fn wait_ready(
    proc: &mut std::process::Child,
) -> anyhow::Result<std::io::BufReader<std::process::ChildStdout>> {
    use std::io::BufRead;
    let out = proc.stdout.take().context("no stdout")?;
    let mut out = std::io::BufReader::new(out);
    let mut line = String::new();
    out.read_line(&mut line)?;
    ensure!(line.trim() == "ready", "the child did not start: {line:?}");
    Ok(out)
}

/// A small xorshift generator (reproducible kill times, and `corrupt`'s damage).
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    /// A generator from a user's seed (any value, 0 included).
    pub(crate) fn seeded(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A value below `n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n.max(1) as u64).unwrap_or(0)
    }
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if let Some(url) = &a.url {
        return s3::run(a, url);
    }
    let tmp = tempfile_dir(a.dir.as_deref())?;
    // Calibrate: how long does an uninterrupted child save take?
    let cal = tmp.join("calibrate");
    let full = calibrate(&cal.join("ckpt"), a.size)?;
    std::fs::remove_dir_all(&cal).ok();
    println!(
        "crash trials: {} trials, {} MiB per save, {WORLD} ranks, uninterrupted save {:.1} ms (median of 5, from the child's start of saving to the return of save); kill uniformly in [0, 1x] of that",
        a.trials,
        a.size >> 20,
        full.as_secs_f64() * 1e3
    );
    let mut rng = Rng::seeded(a.seed);
    let mut tally = Tally::default();
    let mut failures = Vec::new();
    let kinds = [Kind::Fresh, Kind::Overwrite, Kind::Fallback, Kind::Manager];
    for i in 0..a.trials {
        let kind = kinds[i % kinds.len()];
        let frac = (rng.next() % 1000) as f64 / 1000.0;
        let delay = full.mul_f64(frac);
        let dir = tmp.join(format!("trial-{i}"));
        std::fs::create_dir_all(&dir)?;
        let before = (tally.new_committed, tally.old_kept, tally.incomplete);
        let res = trial(kind, &dir, a.size, delay, &mut tally);
        if std::env::var_os("ZARRCKPT_CRASH_VERBOSE").is_some() {
            let after = (tally.new_committed, tally.old_kept, tally.incomplete);
            let what = if after.0 > before.0 {
                "new"
            } else if after.1 > before.1 {
                "previous"
            } else {
                "incomplete"
            };
            println!(
                "trial {i} {kind:?} kill at {:.1} ms: {what}",
                delay.as_secs_f64() * 1e3
            );
        }
        if let Err(e) = res {
            println!(
                "FAIL trial {i} ({kind:?}, kill at {:.1} ms): {e:#}",
                delay.as_secs_f64() * 1e3
            );
            failures.push(i);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
    println!(
        "passed {}/{} (new committed {}, previous kept {}, fresh left incomplete {}, finished before the kill {})",
        tally.passed,
        a.trials,
        tally.new_committed,
        tally.old_kept,
        tally.incomplete,
        tally.finished_before_kill
    );
    if a.dir.is_none() {
        std::fs::remove_dir_all(&tmp).ok();
    }
    Ok(if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn tempfile_dir(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let d = match given {
        Some(d) => d.to_owned(),
        None => std::env::temp_dir().join(format!("zarrckpt-crash-{}", std::process::id())),
    };
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

pub fn run_child(a: &ChildArgs) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    let mut out = std::io::stdout();
    writeln!(out, "ready")?;
    out.flush()?;
    save_generation(a.kind, &a.dir, a.generation, a.size)?;
    writeln!(out, "saved")?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Lets `proc` run for `delay`, then SIGKILLs it unless it exited. Returns whether it had
/// finished successfully first; an error when it failed on its own.
fn kill_after(proc: &mut std::process::Child, delay: Duration) -> anyhow::Result<bool> {
    let t0 = Instant::now();
    let mut exited = None;
    while t0.elapsed() < delay {
        if let Some(st) = proc.try_wait()? {
            exited = Some(st);
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    if exited.is_none() {
        proc.kill()?; // SIGKILL
    }
    let status = proc.wait()?;
    let finished = exited.is_some_and(|s| s.success());
    if exited.is_some() && !finished {
        let mut err = String::new();
        if let Some(mut e) = proc.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        bail!("the child failed on its own ({status}): {err}");
    }
    Ok(finished)
}

/// How long an uninterrupted child overwrite of `target` takes, from the child's start of
/// saving to the return of save: the median of 5.
fn calibrate(target: &Path, size: u64) -> anyhow::Result<Duration> {
    let mut times = Vec::new();
    for _ in 0..5 {
        use std::io::BufRead;
        let mut p = child(Kind::Overwrite, target, 2, size).spawn()?;
        let mut out = wait_ready(&mut p)?;
        let t0 = Instant::now();
        let mut line = String::new();
        out.read_line(&mut line)?;
        times.push(t0.elapsed());
        ensure!(
            p.wait()?.success() && line.trim() == "saved",
            "calibration save failed"
        );
    }
    times.sort();
    Ok(times[times.len() / 2])
}
