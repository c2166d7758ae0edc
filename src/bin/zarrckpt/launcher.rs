//! A local launcher, like `torchrun --standalone`: starts N copies of a command with the
//! environment [`zarrckpt::TcpComm::from_env`] reads, forwards their output with a
//! `[rank N] ` prefix, and fails fast: when one rank fails, the others are stopped.
//!
//! It belongs to the CLI (`zarrckpt launch`, `zarrckpt bench`), not to the library; the
//! tests include this file (`tests/launch.rs`).
//!
//! Each child runs in a process group of its own (so that stopping it also stops what it
//! started), gets `SIGTERM` when its launcher dies (Linux), and reads no standard input.

// Explicit paths, so that the tests that include this file (`tests/launch.rs`) find the
// submodules too.
#[path = "launcher/output.rs"]
mod output;
#[path = "launcher/signals.rs"]
mod signals;

use std::ffi::OsString;
use std::io;
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use output::Sink;

/// How often children are checked.
const TICK: Duration = Duration::from_millis(10);

/// How to launch.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LaunchOptions {
    /// `MASTER_ADDR` given to the children (default `127.0.0.1`).
    pub master_addr: String,
    /// `MASTER_PORT`; by default a free port is picked.
    pub master_port: Option<u16>,
    /// Stop the other ranks as soon as one fails (default true). When false, the launcher
    /// waits for every rank and still reports the first failure.
    pub fail_fast: bool,
    /// Time between `SIGTERM` and `SIGKILL` when stopping ranks (default 5 s).
    pub grace: Duration,
    /// Stop everything after this long (default: no limit).
    pub timeout: Option<Duration>,
    /// Extra environment variables for every child.
    pub env: Vec<(OsString, OsString)>,
    /// Where children's standard output goes, prefixed (default: the launcher's).
    pub stdout: Sink,
    /// Where children's standard error goes, prefixed (default: the launcher's).
    pub stderr: Sink,
    /// Catch `SIGINT`, `SIGTERM` and `SIGHUP` while running and pass them on to the
    /// children, then stop (default true).
    pub handle_signals: bool,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            master_addr: "127.0.0.1".to_owned(),
            master_port: None,
            fail_fast: true,
            grace: Duration::from_secs(5),
            timeout: None,
            env: Vec::new(),
            stdout: Sink::Stdout,
            stderr: Sink::Stderr,
            handle_signals: true,
        }
    }
}

/// A launch in which every rank exited with status 0.
#[derive(Debug, Clone)]
#[allow(dead_code)] // the port and statuses are read by tests/launch.rs, not by the CLI
pub struct ExitSummary {
    /// The `MASTER_PORT` the ranks used.
    pub master_port: u16,
    /// Exit status per rank.
    pub statuses: Vec<ExitStatus>,
    /// Wall time from the first start to the last exit.
    pub elapsed: Duration,
}

/// Why a launch did not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// Zero processes were asked for.
    #[error("launch needs at least one process")]
    NoProcesses,
    /// The command is empty.
    #[error("launch needs a command to run")]
    NoCommand,
    /// No free port could be found for `MASTER_PORT`.
    #[error("cannot find a free port on {addr}: {source}")]
    Port {
        /// The master address.
        addr: String,
        /// The cause.
        source: io::Error,
    },
    /// A child could not be started; the ranks already started were stopped.
    #[error("cannot start rank {rank} ({program:?}): {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: OsString,
        /// The cause.
        source: io::Error,
    },
    /// A rank exited with a non-zero status or was killed.
    #[error("rank {rank} failed first ({}); exit statuses: {}", describe(*status), describe_all(statuses))]
    RankFailed {
        /// The first rank seen failing.
        rank: usize,
        /// Its status.
        status: ExitStatus,
        /// Every rank's status (`None`: could not be reaped even after `SIGKILL`).
        statuses: Vec<Option<ExitStatus>>,
    },
    /// The launch ran past [`LaunchOptions::timeout`] and was stopped.
    #[error("timed out after {after:?}; exit statuses: {}", describe_all(statuses))]
    TimedOut {
        /// The limit.
        after: Duration,
        /// Every rank's status.
        statuses: Vec<Option<ExitStatus>>,
    },
    /// The launcher received a signal, passed it on and stopped the ranks.
    #[error(
        "interrupted by signal {signal}; exit statuses: {}",
        describe_all(statuses)
    )]
    Interrupted {
        /// The signal number.
        signal: i32,
        /// Every rank's status.
        statuses: Vec<Option<ExitStatus>>,
    },
    /// Waiting for a child failed.
    #[error("waiting for rank {rank} failed: {source}")]
    Wait {
        /// The rank.
        rank: usize,
        /// The cause.
        source: io::Error,
    },
}

/// `exit status 3`, `killed by signal 9 (SIGKILL)`.
#[must_use]
pub fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit status {code}");
    }
    match status.signal() {
        Some(sig) => {
            let name = match sig {
                libc::SIGHUP => " (SIGHUP)",
                libc::SIGINT => " (SIGINT)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGBUS => " (SIGBUS)",
                libc::SIGFPE => " (SIGFPE)",
                libc::SIGKILL => " (SIGKILL)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGPIPE => " (SIGPIPE)",
                libc::SIGTERM => " (SIGTERM)",
                _ => "",
            };
            format!("killed by signal {sig}{name}")
        }
        None => format!("{status}"),
    }
}

fn describe_all(statuses: &[Option<ExitStatus>]) -> String {
    let parts: Vec<String> = statuses
        .iter()
        .enumerate()
        .map(|(r, s)| {
            format!(
                "rank {r}: {}",
                s.map_or_else(|| "still running".to_owned(), describe)
            )
        })
        .collect();
    parts.join(", ")
}

/// Picks a port that is free right now on `addr`.
fn free_port(addr: &str) -> Result<u16, LaunchError> {
    let err = |source| LaunchError::Port {
        addr: addr.to_owned(),
        source,
    };
    TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(err)
}

/// Sends `sig` to the process group of every child not yet reaped.
fn signal_all(children: &[Child], statuses: &[Option<ExitStatus>], sig: libc::c_int) {
    for (c, s) in children.iter().zip(statuses) {
        if s.is_none()
            && let Ok(pid) = libc::pid_t::try_from(c.id())
        {
            // SAFETY: plain kill(2) on the child's own process group (it is its leader and
            // has not been reaped, so the id cannot have been reused).
            unsafe { libc::kill(-pid, sig) };
        }
    }
}

/// The job token every rank of this launch gets (`ZARRCKPT_JOB_TOKEN`): the launcher's own if
/// it has one, else one naming this launcher process and port, so that ranks of another launch
/// cannot join this one's rendezvous.
fn job_token(port: u16) -> OsString {
    std::env::var_os("ZARRCKPT_JOB_TOKEN")
        .unwrap_or_else(|| format!("zarrckpt-launch-{}-{port}", std::process::id()).into())
}

fn spawn(
    rank: usize,
    n: usize,
    cmd: &[OsString],
    port: u16,
    opts: &LaunchOptions,
) -> io::Result<Child> {
    let mut c = Command::new(&cmd[0]);
    c.args(&cmd[1..])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", &opts.master_addr)
        .env("MASTER_PORT", port.to_string())
        .env("ZARRCKPT_JOB_TOKEN", job_token(port))
        .envs(opts.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    #[cfg(target_os = "linux")]
    {
        // SAFETY: getpid is async-signal-safe; the closure only calls prctl and getppid.
        let launcher = unsafe { libc::getpid() };
        // SAFETY: runs between fork and exec and only makes async-signal-safe calls.
        unsafe {
            c.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                if libc::getppid() != launcher {
                    return Err(io::Error::other("the launcher exited during start-up"));
                }
                Ok(())
            });
        }
    }
    c.spawn()
}

/// Runs `cmd` as `n` ranks (see the [module docs](self)) and waits for them.
///
/// # Errors
/// [`LaunchError::RankFailed`] naming the first rank that exited non-zero or was killed
/// (the others having been stopped with `SIGTERM`, then `SIGKILL` after the grace period,
/// when `fail_fast`); [`LaunchError::TimedOut`] or [`LaunchError::Interrupted`] after
/// stopping every rank; [`LaunchError::Spawn`] if a child cannot be started;
/// [`LaunchError::NoProcesses`], [`LaunchError::NoCommand`] or [`LaunchError::Port`] before
/// anything starts.
pub fn launch(
    n: usize,
    cmd: &[OsString],
    opts: &LaunchOptions,
) -> Result<ExitSummary, LaunchError> {
    if n == 0 {
        return Err(LaunchError::NoProcesses);
    }
    if cmd.is_empty() {
        return Err(LaunchError::NoCommand);
    }
    let port = match opts.master_port {
        Some(p) => p,
        None => free_port(&opts.master_addr)?,
    };
    let _signals = opts.handle_signals.then(signals::Guard::install);
    let start = Instant::now();
    let mut children: Vec<Child> = Vec::with_capacity(n);
    let mut forwarders: Vec<JoinHandle<()>> = Vec::with_capacity(2 * n);
    for rank in 0..n {
        let mut child = match spawn(rank, n, cmd, port, opts) {
            Ok(c) => c,
            Err(source) => {
                let running = vec![None; children.len()];
                signal_all(&children, &running, libc::SIGKILL);
                for c in &mut children {
                    let _ = c.wait();
                }
                return Err(LaunchError::Spawn {
                    rank,
                    program: cmd[0].clone(),
                    source,
                });
            }
        };
        if let Some(out) = child.stdout.take() {
            let sink = opts.stdout.clone();
            forwarders.push(std::thread::spawn(move || {
                output::forward(rank, out, &sink);
            }));
        }
        if let Some(err) = child.stderr.take() {
            let sink = opts.stderr.clone();
            forwarders.push(std::thread::spawn(move || {
                output::forward(rank, err, &sink);
            }));
        }
        children.push(child);
    }
    let outcome = supervise(&mut children, opts, start);
    // Output still buffered in the pipes is forwarded; a grandchild that escaped its process
    // group and holds a pipe open is not waited for beyond the grace period.
    let until = Instant::now() + opts.grace;
    for f in forwarders {
        while !f.is_finished() && Instant::now() < until {
            std::thread::sleep(TICK);
        }
        if f.is_finished() {
            let _ = f.join();
        }
    }
    let (statuses, stop) = outcome?;
    match stop {
        None => Ok(ExitSummary {
            master_port: port,
            statuses: statuses.into_iter().flatten().collect(),
            elapsed: start.elapsed(),
        }),
        Some(Stop::Failed(rank, status)) => Err(LaunchError::RankFailed {
            rank,
            status,
            statuses,
        }),
        Some(Stop::TimedOut(after)) => Err(LaunchError::TimedOut { after, statuses }),
        Some(Stop::Signal(signal)) => Err(LaunchError::Interrupted { signal, statuses }),
    }
}

/// Why ranks were (or would have been) stopped.
#[derive(Debug, Clone, Copy)]
enum Stop {
    Failed(usize, ExitStatus),
    TimedOut(Duration),
    Signal(i32),
}

/// One thread per child notes when it exits (`waitid` with `WNOWAIT`: the child is not reaped,
/// so its process id stays valid for signals until `try_wait` collects it), so that the rank
/// that failed first is known even when several exit between two polls.
fn exit_watchers(children: &[Child]) -> std::sync::Arc<std::sync::Mutex<Vec<Option<Instant>>>> {
    let died = std::sync::Arc::new(std::sync::Mutex::new(vec![None; children.len()]));
    for (rank, c) in children.iter().enumerate() {
        let pid: libc::id_t = c.id();
        let died = died.clone();
        std::thread::spawn(move || {
            loop {
                // SAFETY: waitid with WNOWAIT only observes the child; `info` is a valid
                // out-parameter.
                let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
                let r = unsafe {
                    libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT)
                };
                if r == 0 {
                    if let Ok(mut d) = died.lock() {
                        d[rank] = Some(Instant::now());
                    }
                    return;
                }
                if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                    return;
                }
            }
        });
    }
    died
}

/// Waits for every child, stopping them all when one fails (with `fail_fast`), on timeout or
/// on a signal. Returns the statuses and the first reason to stop.
fn supervise(
    children: &mut [Child],
    opts: &LaunchOptions,
    start: Instant,
) -> Result<(Vec<Option<ExitStatus>>, Option<Stop>), LaunchError> {
    let n = children.len();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    let mut stop: Option<Stop> = None;
    let died = exit_watchers(children);
    // When stopping: the time SIGKILL is due, and whether it was sent.
    let mut kill_at: Option<Instant> = None;
    let mut killed_at: Option<Instant> = None;
    loop {
        // Failures seen in this pass; the first to die is the one that failed first.
        let mut failed: Vec<(Option<Instant>, usize, ExitStatus)> = Vec::new();
        for (rank, c) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                continue;
            }
            match c.try_wait() {
                Ok(Some(st)) => {
                    statuses[rank] = Some(st);
                    if !st.success() {
                        let at = died.lock().ok().and_then(|d| d[rank]);
                        failed.push((at, rank, st));
                    }
                }
                Ok(None) => {}
                Err(source) => {
                    signal_all(children, &statuses, libc::SIGKILL);
                    return Err(LaunchError::Wait { rank, source });
                }
            }
        }
        if stop.is_none()
            && let Some(&(_, rank, st)) = failed.iter().min_by_key(|f| (f.0.is_none(), f.0, f.1))
        {
            stop = Some(Stop::Failed(rank, st));
        }
        if statuses.iter().all(Option::is_some) {
            return Ok((statuses, stop));
        }
        let now = Instant::now();
        if stop.is_none() {
            if let Some(t) = opts.timeout.filter(|t| now.duration_since(start) >= *t) {
                stop = Some(Stop::TimedOut(t));
            } else if let Some(sig) = opts.handle_signals.then(signals::Guard::received).flatten() {
                stop = Some(Stop::Signal(sig));
            }
        }
        let stopping = match stop {
            Some(Stop::Failed(..)) => opts.fail_fast,
            Some(_) => true,
            None => false,
        };
        if stopping && kill_at.is_none() {
            let sig = if let Some(Stop::Signal(s)) = stop {
                s
            } else {
                libc::SIGTERM
            };
            signal_all(children, &statuses, sig);
            kill_at = Some(now + opts.grace);
        }
        if let Some(at) = kill_at
            && now >= at
            && killed_at.is_none()
        {
            signal_all(children, &statuses, libc::SIGKILL);
            killed_at = Some(now);
        }
        if killed_at.is_some_and(|k| now.duration_since(k) > opts.grace.max(Duration::from_secs(1)))
        {
            // Unkillable (uninterruptible sleep): report what is known.
            return Ok((statuses, stop));
        }
        std::thread::sleep(TICK);
    }
}
