//! The progress engine: runs one exchange (a set of sends and receives over several links)
//! on one thread with non-blocking sockets and `poll(2)`, so every link progresses
//! concurrently and any matching pattern completes.
//!
//! Liveness is not judged here: an exchange waits for as long as its peers are alive, however
//! late they are. It ends early on a closed connection (a [`Failure`] naming the peer), an
//! abort notice, or a verdict of the liveness watch (see [`super::watch`]), which it polls
//! along with its sockets; and, only if the configuration sets one, at the deadline.
//!
//! Two ranks that wait for each other can never go on: each waits for a message the other
//! sends only once it got one (they called different collectives, or exchanged different
//! numbers of messages). A rank that has waited a moment for a peer with nothing left to send
//! it tells the peer so in a waiting notice, with the counts of data messages it has sent and
//! received on the link; a peer that finds itself in the same state with matching counts (no
//! message in flight either way) fails with a [`Failure::mismatch`] instead of waiting
//! forever.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::frame::{Failure, Header, Kind, Op};
use super::link::{Event, Got, Link, OutFrame, poll};
use super::watch::Shared;

/// Longest single sleep in `poll`, so that clocks are re-read regularly.
const MAX_POLL: Duration = Duration::from_millis(500);

/// How long a rank waits for a peer, with nothing to send it, before telling it so.
const NOTICE_AFTER: Duration = Duration::from_millis(50);

/// One exchange: frames to send and buffers to fill, in order per peer.
pub(crate) struct Step<'a> {
    /// Frames to send, in order per peer.
    pub sends: Vec<(usize, &'a [u8])>,
    /// Buffers to receive into, in order per peer; a message must have exactly the length of
    /// its buffer.
    pub recvs: Vec<(usize, &'a mut [u8])>,
}

/// What an exchange runs under.
pub(crate) struct OpCtx {
    pub me: usize,
    /// The liveness watch, once there is one (not during setup).
    pub live: Option<Arc<Shared>>,
    /// Bound on the exchange, if the configuration sets one.
    pub deadline: Option<Duration>,
    started: Instant,
}

impl OpCtx {
    pub(crate) fn new(me: usize) -> OpCtx {
        OpCtx {
            me,
            live: None,
            deadline: None,
            started: Instant::now(),
        }
    }
}

/// Per-peer work of an exchange.
struct Work<'a> {
    peer: usize,
    out: VecDeque<OutFrame<'a>>,
    /// Indices into the receive buffers, in order.
    inq: VecDeque<usize>,
    /// Payload bytes received of the head receive (`None`: header not seen yet).
    got: Option<usize>,
    /// Receives completed from this peer in this exchange (for messages).
    received: usize,
    /// Since when this rank waits for the peer with nothing to send it.
    blocked_since: Option<Instant>,
    /// The link's (sent, received) counts last announced in a waiting notice.
    noticed: Option<(u64, u64)>,
}

impl Work<'_> {
    fn busy(&self) -> bool {
        !self.out.is_empty() || !self.inq.is_empty()
    }

    /// Waits for a message from the peer and has nothing left to send it.
    fn blocked(&self) -> bool {
        self.out.is_empty() && !self.inq.is_empty()
    }
}

/// Runs an exchange to completion.
///
/// # Errors
/// The first failure: a deadline, a lost peer, a mismatch, or an abort notice from a peer.
/// Links that were left with a half-written frame are marked torn.
pub(crate) fn run(
    links: &mut HashMap<usize, Link>,
    ctx: &OpCtx,
    step: Step<'_>,
) -> Result<(), Failure> {
    let mut targets: Vec<&mut [u8]> = Vec::with_capacity(step.recvs.len());
    let mut work: Vec<Work<'_>> = Vec::new();
    let mut index: HashMap<usize, usize> = HashMap::new();
    let mut slot = |peer: usize, work: &mut Vec<Work<'_>>| {
        *index.entry(peer).or_insert_with(|| {
            work.push(Work {
                peer,
                out: VecDeque::new(),
                inq: VecDeque::new(),
                got: None,
                received: 0,
                blocked_since: None,
                noticed: None,
            });
            work.len() - 1
        })
    };
    for (peer, data) in step.sends {
        let i = slot(peer, &mut work);
        let h = Header {
            kind: Kind::Data,
            op: Op::Exchange,
            seq: 0,
            arg: 0,
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
    result
}

fn drive(
    links: &mut HashMap<usize, Link>,
    ctx: &OpCtx,
    work: &mut [Work<'_>],
    targets: &mut [&mut [u8]],
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
        let mut wake = deadline(ctx, work, now)?;
        for (w, &(rd, wr)) in work.iter_mut().zip(&ready) {
            let link = links
                .get_mut(&w.peer)
                .ok_or_else(|| Failure::transport(me, "link vanished"))?;
            if rd {
                receive(link, me, w, targets)?;
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
            wake = wake.min(waiting(link, me, w, now)?);
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

/// Fails once the exchange has run for its deadline, if the configuration sets one, naming a
/// peer it still waits for. Returns when to check again.
fn deadline(ctx: &OpCtx, work: &[Work<'_>], now: Instant) -> Result<Instant, Failure> {
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
        let detail =
            format!("exchange: still waiting for {who} (alive) after the deadline of {limit:?}");
        return Err(Failure::timeout(ctx.me, peer, limit, detail));
    }
    Ok(wake.min(cap))
}

/// Tracks whether this rank waits for `w`'s peer with nothing to send it: after
/// [`NOTICE_AFTER`] it tells the peer (once per state of the link's counts), and if the peer
/// has said the same with counts matching the link's, the two wait for each other forever:
/// a mismatch. Returns when to look again.
fn waiting(link: &mut Link, me: usize, w: &mut Work<'_>, now: Instant) -> Result<Instant, Failure> {
    let far = now + MAX_POLL;
    if !w.blocked() || link.closed.is_some() {
        w.blocked_since = None;
        return Ok(far);
    }
    let counts = (link.sent, link.received);
    if let Some((they_sent, they_received)) = link.peer_waits
        && they_sent == link.received
        && they_received == link.sent
    {
        let detail = format!(
            "rank {} waits for a message from this rank while this rank waits for message {} of \
             this exchange from it, and neither has one in flight ({} messages sent to it, {} \
             received from it): the ranks called different collectives or exchanged different \
             numbers of messages",
            w.peer, w.received, link.sent, link.received
        );
        return Err(Failure::mismatch(me, detail));
    }
    let since = *w.blocked_since.get_or_insert(now);
    if w.noticed == Some(counts) {
        return Ok(far);
    }
    if now < since + NOTICE_AFTER {
        return Ok(far.min(since + NOTICE_AFTER));
    }
    let h = Header {
        kind: Kind::Waiting,
        op: Op::Exchange,
        seq: link.sent,
        arg: link.received,
        len: 0,
    };
    link.queue_control(h, &[]);
    w.noticed = Some(counts);
    // Written at the next turn (the socket is polled for writing while control bytes wait).
    Ok(now)
}

/// The descriptors to wait on: the exchange's links for what they await, the other links for
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
    me: usize,
    w: &mut Work<'_>,
    targets: &mut [&mut [u8]],
) -> Result<(), Failure> {
    let peer = w.peer;
    loop {
        let h = match link.next_event().map_err(|e| Failure::transport(me, e))? {
            Event::WouldBlock | Event::Closed => return Ok(()),
            Event::Abort(f) => return Err(f),
            Event::Heartbeat | Event::Waiting => continue,
            Event::Data(h) => h,
        };
        let Some(&ti) = w.inq.front() else {
            return Ok(());
        };
        let dst = &mut *targets[ti];
        if w.got.is_none() {
            if h.op != Op::Exchange {
                let detail = format!("rank {peer} sent a data frame outside an exchange");
                return Err(Failure::mismatch(me, detail));
            }
            if h.len != dst.len() as u64 {
                let detail = format!(
                    "rank {peer} sends {} bytes in message {} of this exchange, this rank expects {} bytes",
                    h.len,
                    w.received,
                    dst.len()
                );
                return Err(Failure::mismatch(me, detail));
            }
        }
        // A message starts (checked above) with nothing received yet.
        let mut got = *w.got.get_or_insert(0);
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
        link.finish_payload();
        w.got = None;
        w.received += 1;
        w.inq.pop_front();
    }
}
