//! The progress engine: runs one step of an operation (a set of sends and receives over
//! several links) on one thread with non-blocking sockets and `poll(2)`, so every link
//! progresses concurrently and any matching pattern completes.
//!
//! Liveness is not judged here: a step waits for as long as its peers are alive, however late
//! they are. It ends early on a closed connection (a [`Failure`] naming the peer), an abort
//! notice, or a verdict of the liveness watch (see [`super::watch`]), which it polls along with
//! its sockets; and, only if the configuration sets one, at the operation's deadline. During
//! tree collectives ranks also send heartbeats on their data links to the neighbours still
//! taking part: they carry the operation and sequence number, so a neighbour that has moved on
//! to another operation is a mismatch rather than a wait.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::frame::{Failure, Header, Kind, Op, describe_op};
use super::link::{Event, Got, Link, OutFrame, poll};
use super::watch::{Shared, beat_every};

/// Longest single sleep in `poll`, so that clocks are re-read regularly.
const MAX_POLL: Duration = Duration::from_millis(500);

/// Where a received payload goes.
pub(crate) enum Target<'a> {
    /// The caller's buffer; the payload must have exactly its length.
    Into(&'a mut [u8]),
    /// A vector allocated to the announced length, at most `max` bytes.
    Alloc { buf: Vec<u8>, max: u64 },
}

impl Target<'_> {
    fn buf(&mut self) -> &mut [u8] {
        match self {
            Target::Into(b) => b,
            Target::Alloc { buf, .. } => buf,
        }
    }
}

/// One step of an operation.
pub(crate) struct Step<'a> {
    /// Frames to send, in order per peer.
    pub sends: Vec<(usize, &'a [u8])>,
    /// Frames to receive, in order per peer.
    pub recvs: Vec<(usize, Target<'a>)>,
    /// Peers still taking part in the operation (waiting on this rank or awaited by it): they
    /// get heartbeats.
    pub involved: Vec<usize>,
}

/// State of one operation across its steps.
pub(crate) struct OpCtx {
    pub me: usize,
    pub op: Op,
    pub seq: u64,
    pub arg: u64,
    pub timeout: Duration,
    /// Whether to send heartbeats to involved peers.
    pub heartbeats: bool,
    /// The liveness watch, once there is one (not during setup).
    pub live: Option<Arc<Shared>>,
    /// Bound on the whole operation, if the configuration sets one.
    pub deadline: Option<Duration>,
    hb_next: HashMap<usize, Instant>,
    started: Instant,
}

impl OpCtx {
    pub(crate) fn new(
        me: usize,
        op: Op,
        seq: u64,
        arg: u64,
        timeout: Duration,
        heartbeats: bool,
    ) -> OpCtx {
        OpCtx {
            me,
            op,
            seq,
            arg,
            timeout,
            heartbeats,
            live: None,
            deadline: None,
            hb_next: HashMap::new(),
            started: Instant::now(),
        }
    }

    fn describe(&self) -> String {
        describe_op(self.op, self.seq, self.arg)
    }

    fn hb_every(&self) -> Duration {
        beat_every(self.timeout)
    }
}

/// Per-peer work of a step.
struct Work<'a> {
    peer: usize,
    out: VecDeque<OutFrame<'a>>,
    /// Indices into the step's receives, in order.
    inq: VecDeque<usize>,
    /// Payload bytes received of the head receive (`None`: header not seen yet).
    got: Option<usize>,
    /// Receives completed from this peer in this step (for messages).
    received: usize,
    involved: bool,
}

impl Work<'_> {
    fn busy(&self) -> bool {
        !self.out.is_empty() || !self.inq.is_empty()
    }
}

/// Runs a step to completion. Returns the receive targets in the order given.
///
/// # Errors
/// The first failure: a timeout, a lost peer, a mismatch, or an abort notice from a peer.
/// Links that were left with a half-written frame are marked torn.
pub(crate) fn run<'a>(
    links: &mut HashMap<usize, Link>,
    ctx: &mut OpCtx,
    step: Step<'a>,
) -> Result<Vec<Target<'a>>, Failure> {
    let mut targets: Vec<Target<'a>> = Vec::with_capacity(step.recvs.len());
    let mut work: Vec<Work<'a>> = Vec::new();
    let mut index: HashMap<usize, usize> = HashMap::new();
    let mut slot = |peer: usize, work: &mut Vec<Work<'a>>| {
        *index.entry(peer).or_insert_with(|| {
            work.push(Work {
                peer,
                out: VecDeque::new(),
                inq: VecDeque::new(),
                got: None,
                received: 0,
                involved: false,
            });
            work.len() - 1
        })
    };
    for (peer, data) in step.sends {
        let i = slot(peer, &mut work);
        let h = Header {
            kind: Kind::Data,
            op: ctx.op,
            seq: ctx.seq,
            arg: ctx.arg,
            len: data.len() as u64,
        };
        work[i].out.push_back(OutFrame {
            hdr: h.encode(),
            payload: data,
            done: 0,
        });
    }
    for (peer, t) in step.recvs {
        let i = slot(peer, &mut work);
        work[i].inq.push_back(targets.len());
        targets.push(t);
    }
    for peer in step.involved {
        let i = slot(peer, &mut work);
        work[i].involved = true;
    }
    let result = drive(links, ctx, &mut work, &mut targets);
    if result.is_err() {
        for w in &work {
            if w.out.front().is_some_and(|f| f.done > 0)
                && let Some(l) = links.get_mut(&w.peer)
            {
                l.torn = true;
            }
        }
    }
    result.map(|()| targets)
}

fn drive(
    links: &mut HashMap<usize, Link>,
    ctx: &mut OpCtx,
    work: &mut [Work<'_>],
    targets: &mut [Target<'_>],
) -> Result<(), Failure> {
    let me = ctx.me;
    for w in work.iter() {
        if !links.contains_key(&w.peer) {
            return Err(Failure::transport(
                me,
                format!("no connection to rank {} (internal error)", w.peer),
            ));
        }
    }
    let others: Vec<usize> = links
        .keys()
        .copied()
        .filter(|p| !work.iter().any(|w| w.peer == *p))
        .collect();
    // Readiness from the last poll: (readable, writable) per work entry; all at first.
    let mut ready: Vec<(bool, bool)> = vec![(true, true); work.len()];
    let mut other_ready: Vec<bool> = vec![true; others.len()];
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(work.len() + others.len());
    loop {
        let now = Instant::now();
        for (w, &(rd, wr)) in work.iter_mut().zip(&ready) {
            let link = links
                .get_mut(&w.peer)
                .ok_or_else(|| Failure::transport(me, "link vanished"))?;
            if rd {
                receive(link, ctx, w, targets)?;
            }
            if wr && (!w.out.is_empty() || link.has_ctrl()) {
                link.send(&mut w.out).map_err(|e| {
                    Failure::lost(
                        me,
                        w.peer,
                        format!("sending to it failed: {e} (process exited or crashed?)"),
                    )
                })?;
            }
            if w.busy()
                && let Some(why) = link.closed.clone()
            {
                return Err(Failure::lost(me, w.peer, why));
            }
        }
        for (p, r) in others.iter().zip(&mut other_ready) {
            if std::mem::take(r)
                && let Some(link) = links.get_mut(p)
            {
                link.watch(me)?;
            }
        }
        if work.iter().all(|w| !w.busy()) {
            return Ok(());
        }
        if let Some(f) = ctx.live.as_ref().and_then(|l| l.verdict()) {
            return Err(f);
        }
        let mut wake = deadlines(ctx, work, now)?;
        if ctx.heartbeats {
            wake = wake.min(heartbeats(links, ctx, work, now)?);
        }
        poll_set(&mut fds, links, work, &others);
        if let Some(l) = &ctx.live {
            fds.push(libc::pollfd {
                fd: l.wake_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let wait = wake.saturating_duration_since(Instant::now());
        poll(&mut fds, wait).map_err(|e| Failure::transport(me, format!("poll failed: {e}")))?;
        let bad = libc::POLLERR | libc::POLLHUP;
        for (r, f) in ready.iter_mut().zip(&fds) {
            *r = (
                f.revents & (libc::POLLIN | bad) != 0,
                f.revents & (libc::POLLOUT | bad) != 0,
            );
        }
        for (r, f) in other_ready.iter_mut().zip(&fds[work.len()..]) {
            *r = f.revents != 0;
        }
    }
}

/// Fails once the operation has run for its deadline, if the configuration sets one, naming a
/// peer it still waits for. Returns when to check again.
fn deadlines(ctx: &OpCtx, work: &[Work<'_>], now: Instant) -> Result<Instant, Failure> {
    let wake = now + MAX_POLL;
    let Some(limit) = ctx.deadline else {
        return Ok(wake);
    };
    let cap = ctx.started + limit;
    if now >= cap {
        let peer = work
            .iter()
            .find(|w| !w.inq.is_empty())
            .or_else(|| work.iter().find(|w| w.busy()))
            .map(|w| w.peer);
        let who = peer.map_or("its peers".to_owned(), |p| format!("rank {p}"));
        let detail = format!(
            "{}: still waiting for {who} (alive) after the deadline of {limit:?}",
            ctx.describe(),
        );
        return Err(Failure::timeout(ctx.me, peer, limit, detail));
    }
    Ok(wake.min(cap))
}

/// Queues heartbeats that are due to involved peers, between data frames only. Returns when
/// the next one is due.
fn heartbeats(
    links: &mut HashMap<usize, Link>,
    ctx: &mut OpCtx,
    work: &[Work<'_>],
    now: Instant,
) -> Result<Instant, Failure> {
    let every = ctx.hb_every();
    let first = ctx.started + every / 2;
    let mut wake = now + every;
    for w in work.iter().filter(|w| w.involved) {
        let due = ctx.hb_next.entry(w.peer).or_insert(first);
        if *due <= now {
            *due = now + every;
            let link = links
                .get_mut(&w.peer)
                .ok_or_else(|| Failure::transport(ctx.me, "link vanished"))?;
            if !link.has_ctrl() && w.out.front().is_none_or(|f| f.done == 0) {
                let h = Header {
                    kind: Kind::Heartbeat,
                    op: ctx.op,
                    seq: ctx.seq,
                    arg: ctx.arg,
                    len: 0,
                };
                link.queue_control(h, &[]);
            }
        }
        wake = wake.min(*due);
    }
    Ok(wake)
}

/// The descriptors to wait on: the step's links for what they await, the other links for
/// abort notices; links with nothing to wait for are left out (fd -1).
fn poll_set(
    fds: &mut Vec<libc::pollfd>,
    links: &HashMap<usize, Link>,
    work: &[Work<'_>],
    others: &[usize],
) {
    fds.clear();
    for w in work {
        let link = &links[&w.peer];
        let want_in = link.closed.is_none() && (link.pending.is_none() || !w.inq.is_empty());
        let want_out = !w.out.is_empty() || link.has_ctrl();
        let mut events = 0;
        if want_in {
            events |= libc::POLLIN;
        }
        if want_out {
            events |= libc::POLLOUT;
        }
        let fd = if events == 0 { -1 } else { link.fd() };
        fds.push(libc::pollfd {
            fd,
            events,
            revents: 0,
        });
    }
    for p in others {
        let link = &links[p];
        let idle = link.closed.is_some() || link.pending.is_some();
        let fd = if idle { -1 } else { link.fd() };
        fds.push(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
    }
}

/// Reads whatever `link` has for `w`: control frames, and payload into the head receive.
fn receive(
    link: &mut Link,
    ctx: &mut OpCtx,
    w: &mut Work<'_>,
    targets: &mut [Target<'_>],
) -> Result<(), Failure> {
    let me = ctx.me;
    let peer = w.peer;
    loop {
        let h = match link.next_event().map_err(|e| Failure::transport(me, e))? {
            Event::WouldBlock | Event::Closed => return Ok(()),
            Event::Abort(f) => return Err(f),
            Event::Heartbeat(h) => {
                if h.seq == ctx.seq {
                    if h.op != ctx.op || h.arg != ctx.arg {
                        let detail = format!(
                            "rank {peer} is in {} while this rank is in {}",
                            h.describe(),
                            ctx.describe()
                        );
                        return Err(Failure::mismatch(me, detail));
                    }
                } else if h.seq > ctx.seq && !w.inq.is_empty() {
                    let detail = format!(
                        "rank {peer} has moved on to {} without sending the message this rank expects from it in {}",
                        h.describe(),
                        ctx.describe()
                    );
                    return Err(Failure::mismatch(me, detail));
                }
                continue;
            }
            Event::Data(h) => h,
        };
        let Some(&ti) = w.inq.front() else {
            return Ok(());
        };
        let target = &mut targets[ti];
        if w.got.is_none() {
            if h.op != ctx.op || h.seq != ctx.seq || h.arg != ctx.arg {
                let detail = format!(
                    "rank {peer} sent a message of {}, this rank expected one of {} from it",
                    h.describe(),
                    ctx.describe()
                );
                return Err(Failure::mismatch(me, detail));
            }
            match target {
                Target::Into(b) if h.len != b.len() as u64 => {
                    let detail = format!(
                        "rank {peer} sends {} bytes in message {} of {}, this rank expects {} bytes",
                        h.len,
                        w.received,
                        ctx.describe(),
                        b.len()
                    );
                    return Err(Failure::mismatch(me, detail));
                }
                Target::Into(_) => {}
                Target::Alloc { buf, max } => {
                    if h.len > *max {
                        return Err(Failure::too_large(me, peer, h.len, *max));
                    }
                    let len = usize::try_from(h.len)
                        .map_err(|_| Failure::mismatch(me, "message too large"))?;
                    // Probe first, then take zeroed pages from the allocator: `resize` would
                    // write every byte, which is slow in unoptimised builds and stalls the link.
                    Vec::<u8>::new().try_reserve_exact(len).map_err(|_| {
                        Failure::transport(
                            me,
                            format!("cannot allocate {len} bytes for a message from rank {peer}"),
                        )
                    })?;
                    *buf = vec![0u8; len];
                }
            }
        }
        // A message starts (checked above) with nothing received yet.
        let mut got = *w.got.get_or_insert(0);
        let dst = target.buf();
        while got < dst.len() {
            match link.read_payload(&mut dst[got..]) {
                Got::Bytes(n) => got += n,
                Got::WouldBlock => {
                    w.got = Some(got);
                    return Ok(());
                }
                Got::Eof => {
                    let why = link
                        .closed
                        .clone()
                        .unwrap_or_else(|| "its connection closed".to_owned());
                    return Err(Failure::lost(me, peer, why));
                }
            }
        }
        link.pending = None;
        w.got = None;
        w.received += 1;
        w.inq.pop_front();
    }
}
