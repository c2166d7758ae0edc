//! Liveness, independent of progress: a second connection to each tree neighbour, served by a
//! background thread that sends heartbeats and watches for the neighbours' ones while the rank
//! does anything else (writing a big shard, reading from a slow disk, computing).
//!
//! A neighbour is dead when its watch connection closes without a goodbye (its process
//! exited or was killed: the kernel closes its sockets) or when nothing arrives from it for
//! the timeout (its process is stopped or hung, or its host vanished). The first such verdict,
//! or the first failure the rank's own operations report, is kept, forwarded to every other
//! neighbour (so it crosses the whole tree in a few hops, whatever the ranks' main threads are
//! doing) and handed to the operations: a wait in progress ends with it at once, later calls
//! fail with it. Lateness alone is never a failure.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::frame::{Failure, Header, Kind, Op};
use super::link::{Event, Link, poll};

/// Longest single sleep of the watch thread.
const MAX_POLL: Duration = Duration::from_millis(500);

/// How often heartbeats go out for a given timeout: four per timeout, at most every 5 s.
pub(crate) fn beat_every(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(5), Duration::from_secs(5))
}

/// What the watch thread and the rank's operations share.
pub(crate) struct Shared {
    /// The first failure known to this rank, and the neighbour it came from (not forwarded
    /// back there).
    verdict: Mutex<Option<(Failure, Option<usize>)>>,
    has_verdict: AtomicBool,
    stop: AtomicBool,
    /// Becomes readable once there is a verdict: operations poll it.
    wake_rx: UnixStream,
    wake_tx: UnixStream,
    /// Wakes the watch thread (stop, or a failure to forward).
    ctl_tx: UnixStream,
}

impl Shared {
    /// The first failure known to this rank, if any.
    pub(crate) fn verdict(&self) -> Option<Failure> {
        if !self.has_verdict.load(Ordering::Acquire) {
            return None;
        }
        self.verdict
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|(f, _)| f.clone())
    }

    /// A descriptor that becomes readable when a verdict arrives.
    pub(crate) fn wake_fd(&self) -> RawFd {
        self.wake_rx.as_raw_fd()
    }

    /// Records `f` unless a failure is known already; returns whether it was the first.
    fn decide(&self, f: Failure, from: Option<usize>) -> bool {
        let mut v = self
            .verdict
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if v.is_some() {
            return false;
        }
        tracing::debug!("rank {}: liveness verdict: {}", f.origin, f.detail);
        *v = Some((f, from));
        self.has_verdict.store(true, Ordering::Release);
        let _ = (&self.wake_tx).write(&[1]);
        true
    }

    /// A failure of this rank's own operations: recorded and forwarded to the neighbours.
    pub(crate) fn report(&self, f: &Failure) {
        if self.decide(f.clone(), None) {
            let _ = (&self.ctl_tx).write(&[1]);
        }
    }
}

/// The watch thread of one communicator; stopping it says goodbye to the neighbours.
pub(crate) struct Watch {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Starts watching `streams` (established watch connections to the tree neighbours).
    ///
    /// # Errors
    /// The socket or thread setup error, as a description.
    pub(crate) fn start(
        me: usize,
        timeout: Duration,
        streams: Vec<(usize, TcpStream)>,
    ) -> Result<Watch, String> {
        let (wake_rx, wake_tx) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
        let (ctl_rx, ctl_tx) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
        for s in [&wake_rx, &wake_tx, &ctl_rx, &ctl_tx] {
            s.set_nonblocking(true)
                .map_err(|e| format!("socketpair: {e}"))?;
        }
        let links = streams
            .into_iter()
            .map(|(p, s)| Link::new(p, s))
            .collect::<Result<Vec<Link>, _>>()
            .map_err(|e| format!("socket setup: {e}"))?;
        let shared = Arc::new(Shared {
            verdict: Mutex::new(None),
            has_verdict: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            wake_rx,
            wake_tx,
            ctl_tx,
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("zarrckpt-watch-{me}"))
            .spawn(move || watch_loop(me, timeout, links, &sh, &ctl_rx))
            .map_err(|e| format!("cannot start the liveness thread: {e}"))?;
        Ok(Watch {
            shared,
            thread: Some(thread),
        })
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = (&self.shared.ctl_tx).write(&[1]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One neighbour as the watch thread sees it.
struct Peer {
    link: Link,
    heard: Instant,
    /// Still expected to send heartbeats (not gone, not said goodbye).
    active: bool,
}

fn watch_loop(
    me: usize,
    timeout: Duration,
    links: Vec<Link>,
    shared: &Shared,
    ctl_rx: &UnixStream,
) {
    let every = beat_every(timeout);
    let start = Instant::now();
    let mut peers: Vec<Peer> = links
        .into_iter()
        .map(|link| Peer {
            link,
            // A neighbour starts its watch once its own setup is done, which may take up to a
            // timeout longer than ours (it waits for its parent to connect): one timeout of grace.
            heard: start + timeout,
            active: true,
        })
        .collect();
    let beat = Header {
        kind: Kind::Heartbeat,
        op: Op::Setup,
        seq: 0,
        arg: 0,
        len: 0,
    };
    let mut next_beat = start;
    let mut forwarded = false;
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(peers.len() + 1);
    loop {
        let mut sink = [0u8; 64];
        while matches!((&*ctl_rx).read(&mut sink), Ok(n) if n > 0) {}
        if shared.stop.load(Ordering::Acquire) {
            // A failure reported just before closing still goes out first.
            forward(&mut peers, shared, &mut forwarded);
            let polite = shared.verdict().is_none();
            for p in &mut peers {
                if polite {
                    p.link.say_last_words(Header::control(Kind::Bye, 0, 0), &[]);
                } else {
                    let _ = p.link.send(&mut std::collections::VecDeque::new());
                    p.link.shut_write();
                }
                p.link.drain();
            }
            return;
        }
        let now = Instant::now();
        for p in peers.iter_mut().filter(|p| p.active) {
            read_peer(me, p, shared, now);
        }
        for p in peers.iter_mut().filter(|p| p.active) {
            if now.saturating_duration_since(p.heard) >= timeout {
                p.active = false;
                let peer = p.link.peer;
                let detail = format!(
                    "no heartbeat from it for {timeout:?} (its process is stopped or hung, or \
                     its host is unreachable)"
                );
                shared.decide(Failure::silent(me, peer, timeout, detail), Some(peer));
            }
        }
        forward(&mut peers, shared, &mut forwarded);
        if now >= next_beat {
            next_beat = now + every;
            for p in peers.iter_mut().filter(|p| p.link.closed.is_none()) {
                if !p.link.has_ctrl() {
                    p.link.queue_control(beat, &[]);
                }
            }
        }
        for p in peers.iter_mut().filter(|p| p.link.has_ctrl()) {
            // A full socket buffer (a stopped peer) just delays; a broken one is seen on read.
            let _ = p.link.send(&mut std::collections::VecDeque::new());
        }
        let mut wake = next_beat.min(now + MAX_POLL);
        for p in peers.iter().filter(|p| p.active) {
            wake = wake.min(p.heard + timeout);
        }
        fds.clear();
        fds.push(libc::pollfd {
            fd: ctl_rx.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for p in &peers {
            let mut events = 0;
            if p.active {
                events |= libc::POLLIN;
            }
            if p.link.has_ctrl() {
                events |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: if events == 0 { -1 } else { p.link.fd() },
                events,
                revents: 0,
            });
        }
        if poll(&mut fds, wake.saturating_duration_since(Instant::now())).is_err() {
            // Only invalid arguments fail poll; do not spin.
            std::thread::sleep(MAX_POLL);
        }
    }
}

/// Queues the verdict, once, as an abort notice to every neighbour but the one it came from.
fn forward(peers: &mut [Peer], shared: &Shared, forwarded: &mut bool) {
    if *forwarded {
        return;
    }
    let verdict = shared
        .verdict
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let Some((f, from)) = verdict else {
        return;
    };
    *forwarded = true;
    let notice = f.encode();
    let h = Header::control(Kind::Abort, 0, notice.len());
    for p in peers
        .iter_mut()
        .filter(|p| p.link.closed.is_none() && Some(p.link.peer) != from)
    {
        p.link.queue_control(h, &notice);
    }
}

/// Reads what a neighbour sent: heartbeats, a goodbye, an abort notice, or the end.
fn read_peer(me: usize, p: &mut Peer, shared: &Shared, now: Instant) {
    let peer = p.link.peer;
    loop {
        match p.link.next_event() {
            Ok(Event::WouldBlock) => return,
            Ok(Event::Heartbeat | Event::Waiting) => p.heard = now,
            Ok(Event::Abort(f)) => {
                p.heard = now;
                shared.decide(f, Some(peer));
            }
            Ok(Event::Closed) => {
                p.active = false;
                if !p.link.said_bye {
                    let why = p
                        .link
                        .closed
                        .clone()
                        .unwrap_or_else(|| "its connection closed".to_owned());
                    shared.decide(Failure::lost(me, peer, why), Some(peer));
                }
                return;
            }
            Ok(Event::Data(_)) => {
                p.active = false;
                let detail = format!("rank {peer} sent data on its liveness connection");
                shared.decide(Failure::transport(me, detail), Some(peer));
                return;
            }
            Err(e) => {
                p.active = false;
                shared.decide(Failure::transport(me, e), Some(peer));
                return;
            }
        }
    }
}
