//! Ranks as processes on one or many hosts, talking TCP: [`TcpComm`].
//!
//! Configured like `torchrun` ([`TcpComm::from_env`] reads `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `ZARRCKPT_TIMEOUT_S`) or explicitly
//! ([`TcpComm::connect`] with a [`TcpConfig`]; [`TcpMaster`] when rank 0 must pick its port
//! itself).
//!
//! # Protocol
//! - Rendezvous: rank 0 listens on the master address; every rank opens a listener of its own
//!   and registers its address (as seen from the socket it reached the master with) and the
//!   hash of its job token. Rank 0 serves registrations concurrently, each connection with a
//!   handshake deadline of its own (5 s), so idle, half-open or garbage connections never hold
//!   the others up; a registration with another job token is refused ("belongs to another
//!   job") and the job goes on. Rank 0 answers each worker with the addresses of its tree
//!   children as soon as they have registered, and closes that connection.
//! - Links: the lower rank of a pair connects to the higher one and introduces itself, so
//!   simultaneous connects cannot race. Links to tree neighbours open at setup, then the full
//!   address table travels down the tree; links for [`Communicator::exchange`] open the first
//!   time a pair exchanges data.
//! - A transport only: [`TcpComm`] provides [`Communicator::exchange`] (point-to-point
//!   messages, every link progressing concurrently on one thread with `poll(2)`); the
//!   collectives are the shared ones of [`collective`] over it (a binary tree rooted at rank 0:
//!   contributions travel up, merged at every node, results travel down), so each rank holds
//!   at most three links for them whatever the world size, and an all-reduce (what save and
//!   load agree on: outcomes, the world's rule-based layout description) costs each rank the
//!   size of the result, not of the world. The setup sends the address table down the tree
//!   with the shared broadcast.
//! - Every frame has a 32-byte header (kind, operation, two counts, length), checked on
//!   arrival: a data message of another size than the receiving buffer is a
//!   [`CommError::Mismatch`], and a payload never lands outside the caller's buffer. The
//!   collectives cap their messages before anything is allocated, by
//!   [`TcpConfig::max_message_bytes`] (default 4 GiB); control frames are capped at 16 KiB,
//!   address tables by the world size; more is a [`CommError::TooLarge`].
//! - Two ranks waiting for each other with nothing in flight (they called different
//!   collectives, or exchanged different numbers of messages) would wait forever while both
//!   are alive: after 50 ms of waiting, a rank tells the peer it waits in a waiting notice
//!   carrying the link's message counts, and a rank that finds the counts matching its own
//!   wait fails with a [`CommError::Mismatch`].
//!
//! # Liveness: late is fine, dead is an error
//! Liveness does not depend on progress. Each rank opens a second connection to each tree
//! neighbour, served by a background thread that sends a heartbeat every quarter of the
//! timeout ([`TcpConfig::timeout`], `ZARRCKPT_TIMEOUT_S`, at most every 5 s) and watches for the
//! neighbours' ones, whatever the rank's main thread is doing (writing a big shard, reading a
//! slow disk). So:
//! - a rank that is alive but late, by any amount, is waited for (unless
//!   [`TcpConfig::deadline`] / `ZARRCKPT_DEADLINE_S` sets a bound on each exchange, a
//!   collective being a few of them; none by default);
//! - a rank whose process dies is a [`CommError::PeerLost`] naming it at once (the kernel
//!   closes its connections);
//! - a rank that stops answering (process stopped or hung, host vanished or cut off) is a
//!   [`CommError::Unresponsive`] naming it after the timeout.
//!
//! The neighbour that notices forwards the verdict over the liveness connections, so it
//! crosses the tree in a few hops and every rank fails with an error naming the same rank,
//! within about the timeout, even ranks busy outside any collective (they fail at their next
//! call, or at once if they are waiting in one). A rank waiting for an exchange partner that
//! is not its neighbour to connect also probes the partner's listener, so a partner whose
//! communicator was closed is named at once. Close communicators (drop them) before a process
//! exits on purpose: that says goodbye on every connection, and neighbours stop expecting
//! heartbeats.
//!
//! Failure: the first error (of an exchange, or of a collective over it: see
//! [`Communicator::abort`]) poisons the communicator. It sends an abort notice (kind of
//! failure, culprit, detail) to every peer it is linked to and through the liveness
//! connections, and shuts its sockets, so every rank fails fast with an error naming the same
//! culprit. Later calls return the first error at once.
//!
//! # Limits at scale
//! Measured on one host (2 cores, loopback; `tests/liveness.rs` `scale_figures`): 64, 128 and
//! 256 processes join in 0.25, 0.56 and 2.3 s (slowest rank), and hold 15 to 17 descriptors
//! each after setup whatever the world size. Per rank, a communicator needs: its listener,
//! up to 3 tree links and 3 liveness links, 4 wake-up socket ends, and one link per exchange
//! partner (at most `world - 1` for an all-to-all; data-parallel groups in a load); rank 0
//! also holds, during the rendezvous, one connection per registered rank whose children have
//! not registered yet (at worst `world - 1`). [`fds_needed`] says how many descriptors to
//! allow; joining raises the soft `RLIMIT_NOFILE` towards the hard limit when it is lower, and
//! "too many open files" errors say what to raise `ulimit -n` to. Rendezvous traffic is O(1)
//! per rank at rank 0 (registrations, children's addresses) plus the O(world) address table
//! sent down the tree once, at setup (about 40 bytes per rank: 330 KB at 8,192 ranks, 2.6 MB at
//! 65,536). Fan-in at rank 0 is bounded by its accept rate and listen backlog (4,096 pending
//! connections; workers retry until the timeout): joining is serial there, about 9 ms per
//! process on a loaded 2-core host (256 processes in 2.3 s), so tens of seconds at 8,192.
//! Collectives take O(log world) hops (17 at 65,536). `all_gather` delivers O(world) bytes to
//! every rank; save and load use it only for objects. Limits, then: a few thousand processes
//! join in seconds; beyond that (and wherever the network needs RDMA) use the job's own process
//! group as the communicator (torch.distributed through the Python package,
//! `zarrckpt._core.TorchComm`): it provides the same point-to-point transfers, and the same
//! shared collectives run over them, so it agrees with the same bytes per rank.

mod config;
mod engine;
mod frame;
mod greet;
mod link;
mod setup;
mod watch;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use super::{CommError, Communicator, RecvBuf, SendBuf, collective};
pub use config::TcpConfig;
use engine::{OpCtx, Step};
use frame::{Failure, Header, Kind, MAX_CONTROL_LEN};
use greet::Greeter;
use link::Link;
use setup::{AcceptWait, Conns, Table, Want};
use watch::Watch;

/// The default of [`TcpConfig::max_message_bytes`].
pub(crate) const DEFAULT_MAX_MESSAGE: u64 = 4 << 30;

/// File descriptors a rank may need for a world of `world` ranks: rank 0 holds one socket
/// per other rank during the rendezvous, and a rank exchanging with every other rank holds
/// one link per partner; plus a constant for the listener, tree and liveness links, wake-up
/// pipes and the files of the save or load itself.
#[must_use]
pub fn fds_needed(world: usize) -> u64 {
    world as u64 + 256
}

/// Raises this process's soft limit on open files towards its hard limit when it is below
/// what a world of `world` ranks may need (the default soft limit is often 1,024).
fn raise_fd_limit(world: usize) {
    let want = fds_needed(world).max(65_536);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid, exclusively borrowed struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) != 0 {
            return;
        }
        let target = lim.rlim_max.min(want as libc::rlim_t);
        if lim.rlim_cur < target {
            let old = lim.rlim_cur;
            lim.rlim_cur = target;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) == 0 {
                tracing::debug!("raised the open-file limit from {old} to {target}");
            }
        }
    }
}

/// Rank 0's rendezvous listener, bound but not yet serving: lets a program learn the port
/// (when it asked for port 0) before the other ranks are told where to connect.
#[derive(Debug)]
pub struct TcpMaster {
    cfg: TcpConfig,
    master: TcpListener,
    peers: TcpListener,
}

impl TcpMaster {
    /// Binds the rendezvous listener on `cfg.master_port` (0: any free port) and rank 0's
    /// peer listener.
    ///
    /// # Errors
    /// [`CommError::Transport`] if `cfg.rank` is not 0, the configuration is invalid, the
    /// master address does not resolve, or binding fails (port in use, ...).
    pub fn bind(cfg: TcpConfig) -> Result<TcpMaster, CommError> {
        cfg.check("bind")?;
        let err = |detail: String| CommError::Transport {
            op: "bind",
            rank: cfg.rank,
            detail,
        };
        if cfg.rank != 0 {
            return Err(err(format!(
                "only rank 0 binds the master port; this is rank {}",
                cfg.rank
            )));
        }
        let ip = match cfg.bind_addr {
            Some(ip) => ip,
            None => {
                let first = (cfg.master_addr.as_str(), cfg.master_port)
                    .to_socket_addrs()
                    .map_err(|e| {
                        err(format!(
                            "cannot resolve MASTER_ADDR {:?}: {e}",
                            cfg.master_addr
                        ))
                    })?
                    .next()
                    .ok_or_else(|| {
                        err(format!(
                            "MASTER_ADDR {:?} resolves to nothing",
                            cfg.master_addr
                        ))
                    })?;
                setup::unspecified(first.ip())
            }
        };
        let master = setup::bind_listener(ip, cfg.master_port).map_err(|e| {
            err(format!(
                "cannot listen on {ip} port {}: {e}",
                cfg.master_port
            ))
        })?;
        let peers = setup::bind_listener(ip, 0)
            .map_err(|e| err(format!("cannot open a listener for peers: {e}")))?;
        Ok(TcpMaster { cfg, master, peers })
    }

    /// The bound rendezvous address.
    ///
    /// # Errors
    /// [`CommError::Transport`] if the socket cannot say (should not happen).
    pub fn local_addr(&self) -> Result<SocketAddr, CommError> {
        self.master.local_addr().map_err(|e| CommError::Transport {
            op: "bind",
            rank: 0,
            detail: e.to_string(),
        })
    }

    /// The bound rendezvous port, to hand to the other ranks as their `master_port`.
    ///
    /// # Errors
    /// As [`TcpMaster::local_addr`].
    pub fn port(&self) -> Result<u16, CommError> {
        self.local_addr().map(|a| a.port())
    }

    /// Waits until every other rank has registered, then completes the setup like
    /// [`TcpComm::connect`].
    ///
    /// # Errors
    /// [`CommError::Timeout`] naming the first rank that never registered; otherwise as
    /// [`TcpComm::connect`].
    pub fn accept(self) -> Result<TcpComm, CommError> {
        let own = self.peers.local_addr().map_err(|e| CommError::Transport {
            op: "connect",
            rank: 0,
            detail: e.to_string(),
        })?;
        raise_fd_limit(self.cfg.world_size);
        let table = setup::serve_rendezvous(
            &self.master,
            self.cfg.world_size,
            own.port(),
            self.cfg.timeout,
            setup::token_hash(&self.cfg.job_token),
        )
        .map_err(|f| f.to_error("rendezvous", 0))?;
        drop(self.master);
        TcpComm::finish(&self.cfg, table, self.peers)
    }
}

/// What a [`TcpComm`] owns behind its lock.
struct Inner {
    table: Table,
    listener: Option<TcpListener>,
    /// Connections accepted on `listener` that have not introduced themselves yet.
    greeter: Greeter,
    links: HashMap<usize, Link>,
    /// The liveness watch over the tree neighbours (none for a single rank).
    watch: Option<Watch>,
    /// Payload bytes received from other ranks through `exchange`.
    received: u64,
    poison: Option<CommError>,
}

impl Inner {
    /// Remembers the first error and tells every linked peer (and, through the liveness
    /// watch, every rank), then stops listening.
    fn poison(&mut self, failure: &Failure, error: CommError) {
        if self.poison.is_some() {
            return;
        }
        self.poison = Some(error);
        if let Some(w) = &self.watch {
            w.shared().report(failure);
        }
        let notice = failure.encode();
        let h = Header::control(Kind::Abort, 0, notice.len());
        for link in self.links.values_mut() {
            link.say_last_words(h, &notice);
        }
        self.listener = None;
    }
}

/// One rank's handle on a group of processes connected by TCP. See the [module
/// docs](self) for the protocol.
pub struct TcpComm {
    rank: usize,
    world: usize,
    local_rank: Option<usize>,
    timeout: Duration,
    deadline: Option<Duration>,
    max_message: u64,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl TcpComm {
    /// Joins the group described by the `torchrun` environment variables (see
    /// [`TcpConfig::from_env`]).
    ///
    /// # Errors
    /// [`CommError::Transport`] naming a missing or invalid variable; otherwise as
    /// [`TcpComm::connect`].
    pub fn from_env() -> Result<TcpComm, CommError> {
        Self::connect(TcpConfig::from_env()?)
    }

    /// Joins the group: rank 0 binds `master_port` and serves the rendezvous, the others
    /// connect to it (retrying until the timeout, so they may start first). Returns once
    /// every rank has joined and links to tree neighbours are up.
    ///
    /// # Errors
    /// [`CommError::Timeout`] if the master or some rank does not show up in time (naming it);
    /// [`CommError::Transport`] for an invalid configuration, a refused registration
    /// (world size disagreement, duplicate rank) or a socket error;
    /// [`CommError::PeerLost`] if a rank goes away during setup.
    pub fn connect(cfg: TcpConfig) -> Result<TcpComm, CommError> {
        cfg.check("connect")?;
        if cfg.world_size == 1 {
            let table = Table {
                addrs: Vec::new(),
                session: 0,
                master_ip: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
                full: None,
            };
            return Ok(Self::new(&cfg, table, None));
        }
        if cfg.rank == 0 {
            return TcpMaster::bind(cfg)?.accept();
        }
        raise_fd_limit(cfg.world_size);
        let (table, listener) = setup::join_rendezvous(
            cfg.rank,
            cfg.world_size,
            &cfg.master_addr,
            cfg.master_port,
            cfg.bind_addr,
            cfg.timeout,
            setup::token_hash(&cfg.job_token),
        )
        .map_err(|f| f.to_error("rendezvous", cfg.rank))?;
        Self::finish(&cfg, table, listener)
    }

    fn new(cfg: &TcpConfig, table: Table, listener: Option<TcpListener>) -> TcpComm {
        TcpComm {
            rank: cfg.rank,
            world: cfg.world_size,
            local_rank: cfg.local_rank,
            timeout: cfg.timeout,
            deadline: cfg.deadline,
            max_message: cfg.max_message_bytes,
            inner: Mutex::new(Inner {
                table,
                listener,
                greeter: Greeter::new(format!("rank {}: peer listener", cfg.rank), MAX_CONTROL_LEN),
                links: HashMap::new(),
                watch: None,
                received: 0,
                poison: None,
            }),
        }
    }

    /// Opens the tree links and the liveness watch over them, then sends the full address
    /// table (for exchange partners) down the tree with the shared broadcast, so that rank 0
    /// sends it twice rather than to every rank; the broadcast also checks that everyone got
    /// there.
    fn finish(cfg: &TcpConfig, table: Table, listener: TcpListener) -> Result<TcpComm, CommError> {
        let comm = Self::new(cfg, table, Some(listener));
        let in_setup = |e: CommError| match e {
            CommError::Timeout {
                rank, peer, after, ..
            } => CommError::Timeout {
                op: "connect",
                rank,
                peer,
                after,
            },
            CommError::PeerLost {
                rank, peer, detail, ..
            } => CommError::PeerLost {
                op: "connect",
                rank,
                peer,
                detail,
            },
            other => other,
        };
        let full = comm
            .run("connect", |c, inner, _ctx| {
                let near = c.neighbours();
                let mut streams = Vec::new();
                let Inner {
                    table,
                    listener,
                    greeter,
                    links,
                    ..
                } = &mut *inner;
                setup::ensure_links(
                    c.rank,
                    c.world,
                    table,
                    Conns {
                        listener: listener.as_ref(),
                        greeter,
                        links,
                        watch: &mut streams,
                    },
                    &Want {
                        data: &near,
                        watch: &near,
                    },
                    c.timeout,
                    &AcceptWait::Until(std::time::Instant::now() + c.timeout),
                )?;
                let w = Watch::start(c.rank, c.timeout, streams)
                    .map_err(|e| Failure::transport(c.rank, e))?;
                inner.watch = Some(w);
                // Only rank 0 has the full table.
                Ok(inner.table.full.take())
            })
            .map_err(in_setup)?;
        let at_root = full.is_some();
        let got = collective::broadcast_within(
            &comm,
            0,
            &full.unwrap_or_default(),
            setup::table_cap(comm.world),
        )
        .map_err(in_setup)?;
        if !at_root {
            let merged = comm.lock().table.merge(&got, comm.world);
            merged.map_err(|detail| {
                let e = CommError::Mismatch {
                    op: "connect",
                    rank: comm.rank,
                    detail,
                };
                comm.abort(&e);
                e
            })?;
        }
        Ok(comm)
    }

    /// This rank within its host, when the configuration said.
    #[must_use]
    pub fn local_rank(&self) -> Option<usize> {
        self.local_rank
    }

    /// The bound on every wait.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Payload bytes this rank has received from other ranks through
    /// [`Communicator::exchange`], the collectives' messages included (frame headers,
    /// heartbeats and the rendezvous excluded): for tests and benchmarks.
    #[must_use]
    pub fn received_bytes(&self) -> u64 {
        self.lock().received
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The tree neighbours: parent and children.
    fn neighbours(&self) -> Vec<usize> {
        collective::tree_parent(self.rank)
            .into_iter()
            .chain(collective::tree_children(self.rank, self.world))
            .collect()
    }

    /// Runs one operation under the lock, and poisons the communicator if it fails.
    fn run<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Self, &mut Inner, &mut OpCtx) -> Result<T, Failure>,
    ) -> Result<T, CommError> {
        let mut inner = self.lock();
        if let Some(e) = &inner.poison {
            return Err(e.clone());
        }
        let mut ctx = OpCtx::new(self.rank);
        ctx.deadline = self.deadline;
        ctx.live = inner.watch.as_ref().map(|w| w.shared().clone());
        let known = ctx.live.as_ref().and_then(|l| l.verdict());
        let result = match known {
            Some(failure) => Err(failure),
            None => f(self, &mut inner, &mut ctx),
        };
        result.map_err(|failure| {
            let e = failure.to_error(op, self.rank);
            tracing::debug!("rank {}: {e}", self.rank);
            inner.poison(&failure, e.clone());
            e
        })
    }

    /// Opens data links to `peers` (exchange partners), waiting for lower ranks to connect
    /// for as long as they are alive.
    fn links_to(&self, inner: &mut Inner, peers: &[usize]) -> Result<(), Failure> {
        let Inner {
            table,
            listener,
            greeter,
            links,
            watch,
            ..
        } = inner;
        let wait = match watch {
            Some(w) => AcceptWait::WhileAlive {
                live: w.shared(),
                deadline: self.deadline.map(|d| std::time::Instant::now() + d),
            },
            None => AcceptWait::Until(std::time::Instant::now() + self.timeout),
        };
        setup::ensure_links(
            self.rank,
            self.world,
            table,
            Conns {
                listener: listener.as_ref(),
                greeter,
                links,
                watch: &mut Vec::new(),
            },
            &Want {
                data: peers,
                watch: &[],
            },
            self.timeout,
            &wait,
        )
    }

    fn exchange_inner(
        &self,
        inner: &mut Inner,
        ctx: &OpCtx,
        sends: &[SendBuf<'_>],
        recvs: &mut [RecvBuf<'_>],
    ) -> Result<(), Failure> {
        let me = self.rank;
        if let Some(p) = sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
            .find(|&p| p >= self.world)
        {
            return Err(Failure::mismatch(
                me,
                format!("peer {p} out of range for world size {}", self.world),
            ));
        }
        // Messages to self are copied in order.
        let mut own = sends.iter().filter(|s| s.peer == me);
        for (i, r) in recvs.iter_mut().filter(|r| r.peer == me).enumerate() {
            let s = own.next().ok_or_else(|| {
                Failure::mismatch(me, format!("receive {i} from itself has no matching send"))
            })?;
            if s.data.len() != r.buf.len() {
                let detail = format!(
                    "message {i} to itself has {} bytes, its receive expects {}",
                    s.data.len(),
                    r.buf.len()
                );
                return Err(Failure::mismatch(me, detail));
            }
            r.buf.copy_from_slice(s.data);
        }
        if own.next().is_some() {
            return Err(Failure::mismatch(
                me,
                "more sends to itself than receives from itself",
            ));
        }
        let mut peers: Vec<usize> = sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
            .filter(|&p| p != me)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        if peers.is_empty() {
            return Ok(());
        }
        self.links_to(inner, &peers)?;
        let incoming: usize = recvs
            .iter()
            .filter(|r| r.peer != me)
            .map(|r| r.buf.len())
            .sum();
        let step = Step {
            sends: sends
                .iter()
                .filter(|s| s.peer != me)
                .map(|s| (s.peer, s.data))
                .collect(),
            recvs: recvs
                .iter_mut()
                .filter(|r| r.peer != me)
                .map(|r| (r.peer, &mut *r.buf))
                .collect(),
        };
        engine::run(&mut inner.links, ctx, step)?;
        inner.received += incoming as u64;
        Ok(())
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        let inner = self
            .inner
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.listener = None;
        let poisoned = inner.poison.is_some();
        for link in inner.links.values_mut() {
            if !poisoned {
                link.say_last_words(Header::control(Kind::Bye, 0, 0), &[]);
            }
            link.drain();
        }
        // Says goodbye on the liveness links too, so that neighbours stop expecting heartbeats.
        inner.watch = None;
    }
}

/// A transport: point-to-point transfers and the failure of a collective; the collectives are
/// the trait's defaults, written once in [`collective`].
impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn max_message(&self) -> u64 {
        self.max_message
    }

    /// Poisons the communicator: later calls fail at once with `error`, and every rank
    /// learns of it (abort notices to the linked peers, and through the liveness watch).
    fn abort(&self, error: &CommError) {
        let mut inner = self.lock();
        if inner.poison.is_none() {
            let failure = Failure::from_error(error, self.rank);
            inner.poison(&failure, error.clone());
        }
    }

    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        self.run("exchange", |c, inner, ctx| {
            c.exchange_inner(inner, ctx, sends, recvs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_rank_needs_no_network() {
        let c = TcpComm::connect(TcpConfig::new(0, 1, "invalid.invalid", 1)).unwrap();
        assert_eq!(c.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
        assert_eq!(c.broadcast(0, b"y").unwrap(), b"y");
        c.barrier().unwrap();
        let mut out = [0u8; 2];
        c.exchange(
            &[SendBuf {
                peer: 0,
                data: b"ab",
            }],
            &mut [RecvBuf {
                peer: 0,
                buf: &mut out,
            }],
        )
        .unwrap();
        assert_eq!(&out, b"ab");
        assert!(matches!(
            c.broadcast(1, b""),
            Err(CommError::Mismatch { .. })
        ));
        // A world of one sends nothing in a collective; its next exchange sees the poison.
        assert!(
            c.exchange(&[], &mut []).is_err(),
            "poisoned after a failure"
        );
    }
}
