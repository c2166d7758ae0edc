//! Getting connected: the rendezvous at rank 0 (every rank registers the address of its own
//! listener and receives the full table) and the handshakes that open peer links, the lower
//! rank always connecting to the higher one.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::frame::{Cursor, Failure, HEADER_LEN, Header, Kind, MAX_CONTROL_LEN, put_blob};
use super::greet::{Greeter, Greeting};
use super::link::{Link, poll};
use super::watch::Shared;

/// Backlog of every listener: many ranks may connect at once.
const BACKLOG: libc::c_int = 4096;

/// What the rendezvous yields: the job's session token and the listening addresses this rank
/// knows. The rendezvous tells a worker its tree children's addresses only (so that rank 0
/// answers and closes each registration early and sends O(1) bytes per rank); the full table
/// then travels down the tree (see [`Table::full`]).
pub(super) struct Table {
    pub addrs: Vec<Option<SocketAddr>>,
    pub session: u64,
    /// Rank 0's address as this rank reached it (rank 0's entry in tables is left empty).
    pub master_ip: IpAddr,
    /// At rank 0 until sent: the encoded full table.
    pub full: Option<Vec<u8>>,
}

impl Table {
    /// The listening address of `p`, once known.
    pub(super) fn addr(&self, p: usize) -> Option<SocketAddr> {
        self.addrs.get(p).copied().flatten()
    }

    /// Decodes a table (whole or partial) from rank 0 and adds its entries.
    ///
    /// # Errors
    /// A description of what is malformed: another session or world size, a rank out of
    /// range or listed twice, a bad address.
    pub(super) fn merge(&mut self, payload: &[u8], world: usize) -> Result<(), String> {
        let mut c = Cursor::new(payload);
        let bad = |what: &str| format!("malformed address table from rank 0: {what}");
        let session = c.u64().ok_or_else(|| bad("truncated"))?;
        if c.u64() != Some(world as u64) {
            return Err(bad("another world size"));
        }
        if self.addrs.is_empty() {
            self.session = session;
            self.addrs = vec![None; world];
        } else if session != self.session {
            return Err(bad("another session"));
        }
        let count = c.u64().ok_or_else(|| bad("truncated"))?;
        if count > world as u64 {
            return Err(bad("more entries than ranks"));
        }
        let mut seen = vec![false; world];
        for _ in 0..count {
            let r = c
                .u64()
                .and_then(|r| usize::try_from(r).ok())
                .filter(|&r| r < world)
                .ok_or_else(|| bad("rank out of range"))?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(bad("a rank listed twice"));
            }
            let ip = std::str::from_utf8(c.blob().ok_or_else(|| bad("truncated"))?)
                .map_err(|_| bad("address not UTF-8"))?;
            let port = c
                .u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| bad("bad port"))?;
            let ip: IpAddr = if r == 0 && ip.is_empty() {
                self.master_ip
            } else {
                ip.parse().map_err(|_| bad("bad address"))?
            };
            self.addrs[r] = Some(SocketAddr::new(ip, port));
        }
        if !c.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(())
    }
}

/// Encodes the entries `ranks` of `entries` (rank 0's address left empty).
fn encode_table(
    session: u64,
    entries: &[Option<(String, u16)>],
    ranks: impl Iterator<Item = usize>,
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&session.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    let at = out.len();
    out.extend_from_slice(&0u64.to_le_bytes());
    let mut count = 0u64;
    for r in ranks {
        if let Some((ip, port)) = &entries[r] {
            out.extend_from_slice(&(r as u64).to_le_bytes());
            put_blob(&mut out, if r == 0 { &[] } else { ip.as_bytes() });
            out.extend_from_slice(&u64::from(*port).to_le_bytes());
            count += 1;
        }
    }
    out[at..at + 8].copy_from_slice(&count.to_le_bytes());
    out
}

/// The children of `r` in the collective tree.
fn children(r: usize, world: usize) -> impl Iterator<Item = usize> {
    [2 * r + 1, 2 * r + 2]
        .into_iter()
        .filter(move |&c| c < world)
}

/// The unspecified address of the family of `like`.
pub(super) fn unspecified(like: IpAddr) -> IpAddr {
    match like {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// Binds a listener with a backlog large enough for hundreds of simultaneous connects.
pub(super) fn bind_listener(ip: IpAddr, port: u16) -> io::Result<TcpListener> {
    let l = TcpListener::bind((ip, port))?;
    // SAFETY: re-listening on a listening socket only changes its backlog.
    unsafe { libc::listen(l.as_raw_fd(), BACKLOG) };
    Ok(l)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// A positive wait for blocking socket calls (zero would mean "forever").
fn positive(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

fn write_frame(s: &mut TcpStream, h: Header, payload: &[u8], deadline: Instant) -> io::Result<()> {
    s.set_write_timeout(Some(positive(remaining(deadline))))?;
    let mut buf = h.encode().to_vec();
    buf.extend_from_slice(payload);
    s.write_all(&buf)
}

/// Reads one frame with a blocking socket, refusing payloads over `max`.
fn read_frame(s: &mut TcpStream, max: u64, deadline: Instant) -> io::Result<(Header, Vec<u8>)> {
    s.set_read_timeout(Some(positive(remaining(deadline))))?;
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw)?;
    let h = Header::decode(&raw).map_err(io::Error::other)?;
    if h.len > max {
        return Err(io::Error::other(TooBig {
            declared: h.len,
            limit: max,
        }));
    }
    let mut payload = vec![0u8; usize::try_from(h.len).map_err(io::Error::other)?];
    s.read_exact(&mut payload)?;
    Ok((h, payload))
}

/// A frame announcing more than its reader accepts.
#[derive(Debug)]
struct TooBig {
    declared: u64,
    limit: u64,
}

impl std::fmt::Display for TooBig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a frame of {} bytes exceeds the limit of {}",
            self.declared, self.limit
        )
    }
}

impl std::error::Error for TooBig {}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Rank 0's side: accepts registrations on `master` until all `world - 1` workers are in,
/// then sends each the table. `own` is rank 0's peer listener port; `token` the job token's
/// hash. Connections are served concurrently, each with a deadline of its own: idle, foreign
/// or malformed ones are dropped (or refused) without holding up the others, and a process of
/// another job (a different token) is refused without disturbing this one.
pub(super) fn serve_rendezvous(
    master: &TcpListener,
    world: usize,
    own: u16,
    timeout: Duration,
    token: u64,
) -> Result<Table, Failure> {
    let deadline = Instant::now() + timeout;
    let tr = |e: String| Failure::transport(0, e);
    master
        .set_nonblocking(true)
        .map_err(|e| tr(format!("listener: {e}")))?;
    let mut entries: Vec<Option<(String, u16)>> = vec![None; world];
    entries[0] = Some((String::new(), own));
    let mut conns: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut joined = 1;
    let session = session_token(own);
    let mut greeter = Greeter::new("rank 0: rendezvous", MAX_CONTROL_LEN);
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while joined < world {
        let wait = remaining(deadline);
        if wait.is_zero() {
            let missing: Vec<usize> = (0..world).filter(|&r| entries[r].is_none()).collect();
            let shown: Vec<String> = missing.iter().take(16).map(ToString::to_string).collect();
            let detail = format!(
                "rendezvous: {} of {world} ranks never registered: {}",
                missing.len(),
                shown.join(", ")
            );
            return Err(Failure::timeout(
                0,
                missing.first().copied(),
                timeout,
                detail,
            ));
        }
        fds.clear();
        fds.push(libc::pollfd {
            fd: master.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        greeter.poll_set(&mut fds);
        let mut wake = Instant::now() + wait.min(Duration::from_millis(500));
        if let Some(d) = greeter.next_deadline() {
            wake = wake.min(d);
        }
        poll(&mut fds, wake.saturating_duration_since(Instant::now()))
            .map_err(|e| tr(format!("poll: {e}")))?;
        greeter.accept_from(master).map_err(|e| {
            tr(format!(
                "accepting registrations failed: {}",
                fd_hint(&e, world)
            ))
        })?;
        for g in greeter.progress() {
            let Greeting {
                stream: mut s,
                from,
                header: h,
                payload,
            } = g;
            let _ = s.set_nonblocking(false);
            let parsed = (|| {
                let mut c = Cursor::new(&payload);
                let w = c.u64()?;
                let port = u16::try_from(c.u64()?).ok()?;
                let ip = std::str::from_utf8(c.blob()?).ok()?.to_owned();
                ip.parse::<IpAddr>().ok()?;
                let tok = c.u64()?;
                Some((w, port, ip, tok))
            })();
            let refuse = |s: &mut TcpStream, reason: &str| {
                let _ = write_frame(
                    s,
                    Header::control(Kind::Reject, 0, reason.len()),
                    reason.as_bytes(),
                    Instant::now() + Duration::from_secs(1),
                );
            };
            let (Kind::Register, Some((w, port, ip, tok))) = (h.kind, parsed) else {
                refuse(&mut s, "malformed registration");
                tracing::warn!("rendezvous: ignoring a malformed registration from {from}");
                continue;
            };
            if tok != token {
                let reason = format!(
                    "rank {} at {from} belongs to another job: its job token differs from rank \
                     0's (ZARRCKPT_JOB_TOKEN, else TORCHELASTIC_RUN_ID); two jobs sharing \
                     MASTER_ADDR:MASTER_PORT?",
                    h.arg
                );
                refuse(&mut s, &reason);
                tracing::warn!("rendezvous: refused {reason}");
                continue;
            }
            let problem = if w != world as u64 {
                Some(format!(
                    "rank {} at {from} says WORLD_SIZE={w}, rank 0 has WORLD_SIZE={world}",
                    h.arg
                ))
            } else if h.arg == 0 || h.arg >= world as u64 {
                Some(format!(
                    "a process at {from} registered as rank {}, outside 1..{world}",
                    h.arg
                ))
            } else if let Some((ip0, _)) = usize::try_from(h.arg)
                .ok()
                .and_then(|r| entries[r].as_ref())
            {
                Some(format!(
                    "rank {} registered twice (from {ip0} and from {from}); two jobs sharing MASTER_PORT?",
                    h.arg
                ))
            } else {
                None
            };
            if let Some(reason) = problem {
                refuse(&mut s, &reason);
                for c in conns.iter_mut().flatten() {
                    refuse(c, &reason);
                }
                return Err(tr(format!("rendezvous: {reason}")));
            }
            // Checked above: 0 < h.arg < world.
            let r = crate::model::usize_of(h.arg);
            entries[r] = Some((ip, port));
            conns[r] = Some(s);
            joined += 1;
            // Answer every rank whose children are all known now (this one, its parent), and
            // close its connection: rank 0 keeps sockets only for ranks still waiting.
            for q in [Some(r), (r > 2).then(|| (r - 1) / 2)]
                .into_iter()
                .flatten()
            {
                if conns[q].is_none() || children(q, world).any(|ch| entries[ch].is_none()) {
                    continue;
                }
                if let Some(mut s) = conns[q].take() {
                    let t = encode_table(session, &entries, children(q, world));
                    let h = Header::control(Kind::Table, 0, t.len());
                    write_frame(&mut s, h, &t, Instant::now() + timeout).map_err(|e| {
                        Failure::lost(
                            0,
                            q,
                            format!("sending its children's addresses failed: {e}"),
                        )
                    })?;
                }
            }
        }
    }
    // Rank 0's peers reach it where they reached the master; its own entry is not used.
    let addrs = entries
        .iter()
        .map(|e| {
            e.as_ref().map(|(ip, port)| {
                SocketAddr::new(ip.parse().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)), *port)
            })
        })
        .collect();
    Ok(Table {
        addrs,
        session,
        master_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        full: Some(encode_table(session, &entries, 0..world)),
    })
}

/// The hash of a job token carried in registrations (FNV-1a, stable across builds).
pub(super) fn token_hash(token: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in token.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Largest address table for `world` ranks: session, world and count, then per rank its
/// number and an address of at most 45 characters (IPv6) with its length and port.
pub(super) fn table_cap(world: usize) -> u64 {
    24 + 72 * world as u64
}

/// Adds advice to "too many open files".
pub(super) fn fd_hint(e: &io::Error, world: usize) -> String {
    if e.raw_os_error() == Some(libc::EMFILE) || e.raw_os_error() == Some(libc::ENFILE) {
        format!(
            "{e}: the open-file limit is too low for a world of {world} (raise `ulimit -n` to at \
             least {})",
            super::fds_needed(world)
        )
    } else {
        e.to_string()
    }
}

/// A token that differs between jobs, so that a stray process of an earlier job that reused
/// the same ports cannot join this one.
fn session_token(salt: u16) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u16(salt);
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// A worker's side: connects to the master (retrying until `timeout`, since workers may
/// start first), binds its own listener, registers and receives the table.
pub(super) fn join_rendezvous(
    rank: usize,
    world: usize,
    master_addr: &str,
    master_port: u16,
    bind: Option<IpAddr>,
    timeout: Duration,
    token: u64,
) -> Result<(Table, TcpListener), Failure> {
    let deadline = Instant::now() + timeout;
    let tr = |e: String| Failure::transport(rank, e);
    let mut backoff = Duration::from_millis(10);
    let mut last = String::from("no attempt made");
    let mut s = loop {
        match (master_addr, master_port).to_socket_addrs() {
            Ok(addrs) => {
                let mut found = None;
                for a in addrs {
                    match TcpStream::connect_timeout(
                        &a,
                        positive(remaining(deadline).min(Duration::from_secs(2))),
                    ) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = format!("{a}: {e}"),
                    }
                }
                if let Some(s) = found {
                    break s;
                }
            }
            Err(e) => last = format!("cannot resolve MASTER_ADDR {master_addr:?}: {e}"),
        }
        if remaining(deadline).is_zero() {
            let detail =
                format!("could not reach the master at {master_addr}:{master_port} ({last})");
            return Err(Failure::timeout(rank, Some(0), timeout, detail));
        }
        std::thread::sleep(backoff.min(remaining(deadline)));
        backoff = (backoff * 2).min(Duration::from_millis(250));
    };
    let _ = s.set_nodelay(true);
    let local = s
        .local_addr()
        .map_err(|e| tr(format!("local address: {e}")))?;
    let master = s
        .peer_addr()
        .map_err(|e| tr(format!("master address: {e}")))?;
    let listener = bind_listener(bind.unwrap_or_else(|| unspecified(local.ip())), 0)
        .map_err(|e| tr(format!("cannot open a listener for peers: {e}")))?;
    let port = listener
        .local_addr()
        .map_err(|e| tr(format!("listener address: {e}")))?
        .port();
    let mut reg = Vec::new();
    reg.extend_from_slice(&(world as u64).to_le_bytes());
    reg.extend_from_slice(&u64::from(port).to_le_bytes());
    put_blob(&mut reg, local.ip().to_string().as_bytes());
    reg.extend_from_slice(&token.to_le_bytes());
    let lost = |e: io::Error| {
        if let Some(t) = e.get_ref().and_then(|i| i.downcast_ref::<TooBig>()) {
            Failure::too_large(rank, 0, t.declared, t.limit)
        } else if is_timeout(&e) {
            Failure::timeout(
                rank,
                Some(0),
                timeout,
                format!("rendezvous: no address table from the master: {e}"),
            )
        } else {
            Failure::lost(rank, 0, format!("rendezvous with the master failed: {e}"))
        }
    };
    write_frame(
        &mut s,
        Header::control(Kind::Register, rank as u64, reg.len()),
        &reg,
        deadline,
    )
    .map_err(lost)?;
    let (h, payload) =
        read_frame(&mut s, table_cap(2).max(MAX_CONTROL_LEN), deadline).map_err(lost)?;
    if h.kind == Kind::Reject {
        return Err(tr(format!(
            "the master refused this rank: {}",
            String::from_utf8_lossy(&payload)
        )));
    }
    if h.kind != Kind::Table {
        return Err(tr(
            "rank 0 answered the registration with something else".to_owned()
        ));
    }
    let mut table = Table {
        addrs: Vec::new(),
        session: 0,
        master_ip: master.ip(),
        full: None,
    };
    table.merge(&payload, world).map_err(tr)?;
    Ok((table, listener))
}

fn hello_payload(session: u64, world: usize) -> Vec<u8> {
    let mut p = session.to_le_bytes().to_vec();
    p.extend_from_slice(&(world as u64).to_le_bytes());
    p
}

/// What [`ensure_links`] must open: data links and liveness (watch) links, to the peers named.
pub(super) struct Want<'a> {
    pub data: &'a [usize],
    pub watch: &'a [usize],
}

/// Where [`ensure_links`] keeps what it opens, and what it listens with.
pub(super) struct Conns<'a> {
    pub listener: Option<&'a TcpListener>,
    pub greeter: &'a mut Greeter,
    pub links: &'a mut HashMap<usize, Link>,
    pub watch: &'a mut Vec<(usize, TcpStream)>,
}

/// How long [`ensure_links`] may wait for lower ranks to connect.
pub(super) enum AcceptWait<'a> {
    /// Until this instant (setup: everyone is there).
    Until(Instant),
    /// As long as the peers are alive: a verdict of the liveness watch ends the wait, and so
    /// does a peer whose listener is closed (its communicator was dropped or its process
    /// exited), found by probing it; `deadline`, if any, bounds the wait anyway.
    WhileAlive {
        live: &'a Shared,
        deadline: Option<Instant>,
    },
}

/// Opens links to every peer that has none yet: connecting to higher ranks, accepting from
/// lower ones. Connections from other peers accepted meanwhile are kept; each accepted
/// connection must introduce itself within its own deadline, so idle or foreign connections
/// never hold the others up.
pub(super) fn ensure_links(
    me: usize,
    world: usize,
    table: &Table,
    conns: Conns<'_>,
    want: &Want<'_>,
    timeout: Duration,
    wait: &AcceptWait<'_>,
) -> Result<(), Failure> {
    let Conns {
        listener,
        greeter,
        links,
        watch,
    } = conns;
    let deadline = Instant::now() + timeout;
    let has_watch = |w: &Vec<(usize, TcpStream)>, p: usize| w.iter().any(|(q, _)| *q == p);
    let hello = hello_payload(table.session, world);
    let to_open = want
        .data
        .iter()
        .filter(|&&p| p > me && !links.contains_key(&p))
        .map(|&p| (p, Kind::Hello))
        .chain(
            want.watch
                .iter()
                .filter(|&&p| p > me && !has_watch(watch, p))
                .map(|&p| (p, Kind::Watch)),
        )
        .collect::<Vec<_>>();
    for (p, kind) in to_open {
        let addr = table.addr(p).ok_or_else(|| {
            Failure::transport(
                me,
                format!("no address known for rank {p} (internal error)"),
            )
        })?;
        let mut s = TcpStream::connect_timeout(&addr, positive(remaining(deadline))).map_err(|e| {
            if is_timeout(&e) {
                Failure::timeout(me, Some(p), timeout, format!("connecting to rank {p} at {addr}: {e}"))
            } else {
                Failure::lost(me, p, format!("cannot connect to it at {addr}: {} (its communicator is closed or it exited)", fd_hint(&e, world)))
            }
        })?;
        write_frame(
            &mut s,
            Header::control(kind, me as u64, hello.len()),
            &hello,
            deadline,
        )
        .map_err(|e| Failure::lost(me, p, format!("handshake failed: {e}")))?;
        if kind == Kind::Watch {
            watch.push((p, s));
        } else {
            let link = Link::new(p, s)
                .map_err(|e| Failure::transport(me, format!("socket setup: {e}")))?;
            links.insert(p, link);
        }
    }
    let missing = |links: &HashMap<usize, Link>, watch: &Vec<(usize, TcpStream)>| {
        want.data
            .iter()
            .copied()
            .find(|&p| p < me && !links.contains_key(&p))
            .or_else(|| {
                want.watch
                    .iter()
                    .copied()
                    .find(|&p| p < me && !has_watch(watch, p))
            })
    };
    let Some(listener) = listener else {
        return match missing(links, watch) {
            Some(p) => Err(Failure::lost(
                me,
                p,
                "this communicator no longer accepts connections",
            )),
            None => Ok(()),
        };
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| Failure::transport(me, format!("listener: {e}")))?;
    let started = Instant::now();
    let probe_every = super::watch::beat_every(timeout).max(Duration::from_millis(200));
    let mut next_probe = started + probe_every;
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        for g in greeter.progress() {
            let q = usize::try_from(g.header.arg)
                .ok()
                .filter(|&q| q < me && g.payload == hello);
            match (g.header.kind, q) {
                (Kind::Hello, Some(q)) if !links.contains_key(&q) => {
                    let link = Link::new(q, g.stream)
                        .map_err(|e| Failure::transport(me, format!("socket setup: {e}")))?;
                    links.insert(q, link);
                }
                (Kind::Watch, Some(q)) if want.watch.contains(&q) && !has_watch(watch, q) => {
                    watch.push((q, g.stream));
                }
                _ => tracing::warn!(
                    "rank {me}: ignoring a connection from {} without a valid handshake for this job",
                    g.from
                ),
            }
        }
        let Some(p) = missing(links, watch) else {
            return Ok(());
        };
        let now = Instant::now();
        let mut wake = now + Duration::from_millis(500);
        match wait {
            AcceptWait::Until(d) => {
                if now >= *d {
                    let detail =
                        format!("rank {p} never connected to this rank within {timeout:?}");
                    return Err(Failure::timeout(me, Some(p), timeout, detail));
                }
                wake = wake.min(*d);
            }
            AcceptWait::WhileAlive { live, deadline } => {
                if let Some(f) = live.verdict() {
                    return Err(f);
                }
                if let Some(d) = deadline {
                    if now >= *d {
                        let after = now.saturating_duration_since(started);
                        let detail = format!(
                            "rank {p} is alive but did not connect to this rank within the \
                             deadline of {after:?}"
                        );
                        return Err(Failure::timeout(me, Some(p), after, detail));
                    }
                    wake = wake.min(*d);
                }
                if now >= next_probe {
                    next_probe = now + probe_every;
                    if let Some(a) = table.addr(p) {
                        probe(me, p, a, timeout)?;
                    }
                }
                wake = wake.min(next_probe);
            }
        }
        // Also watch the existing links: an abort notice ends the wait early.
        let watched: Vec<usize> = links
            .iter()
            .filter(|(_, l)| l.closed.is_none() && l.pending.is_none())
            .map(|(&q, _)| q)
            .collect();
        fds.clear();
        fds.extend(
            std::iter::once(listener.as_raw_fd())
                .chain(watched.iter().map(|q| links[q].fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                }),
        );
        if let AcceptWait::WhileAlive { live, .. } = wait {
            fds.push(libc::pollfd {
                fd: live.wake_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        greeter.poll_set(&mut fds);
        if let Some(d) = greeter.next_deadline() {
            wake = wake.min(d);
        }
        poll(&mut fds, wake.saturating_duration_since(Instant::now()))
            .map_err(|e| Failure::transport(me, format!("poll: {e}")))?;
        for (q, f) in watched.iter().zip(&fds[1..]) {
            if f.revents != 0
                && let Some(l) = links.get_mut(q)
            {
                l.watch(me)?;
            }
        }
        greeter.accept_from(listener).map_err(|e| {
            Failure::transport(
                me,
                format!("accepting peer connections failed: {}", fd_hint(&e, world)),
            )
        })?;
    }
}

/// Whether rank `p` still listens: a refused connection means its communicator is closed or
/// its process is gone. A probe that cannot tell (slow network, full backlog) says nothing.
fn probe(me: usize, p: usize, addr: SocketAddr, timeout: Duration) -> Result<(), Failure> {
    match TcpStream::connect_timeout(&addr, positive(timeout.min(Duration::from_secs(2)))) {
        Ok(s) => {
            // Nothing to say: the peer's greeter drops it quietly.
            drop(s);
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Err(Failure::lost(
            me,
            p,
            format!(
                "it no longer accepts connections at {addr} (its communicator was closed or its \
                 process exited) while this rank waits for it to connect"
            ),
        )),
        Err(_) => Ok(()),
    }
}
