//! One established, non-blocking connection to a peer: buffered frame reading, vectored
//! writes that never raise `SIGPIPE`, and the `poll(2)` wrapper the engine waits in.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use super::frame::{Failure, HEADER_LEN, Header, Kind};

/// Size of the per-link read buffer; payload reads at least half this size bypass it.
const RBUF: usize = 64 << 10;
/// Most buffers handed to one `sendmsg`.
const MAX_IOV: usize = 64;

/// What reading a link produced.
#[derive(Debug)]
pub(crate) enum Event {
    /// A data header; its payload is next on the stream. It stays in [`Link::pending`] until
    /// the payload has been consumed.
    Data(Header),
    /// A heartbeat (liveness links).
    Heartbeat,
    /// A waiting notice, recorded in [`Link::peer_waits`].
    Waiting,
    /// The peer failed.
    Abort(Failure),
    /// The link is closed for reading; [`Link::closed`] says why.
    Closed,
    /// Nothing more to read right now.
    WouldBlock,
}

/// The outcome of a payload read.
pub(crate) enum Got {
    Bytes(usize),
    WouldBlock,
    Eof,
}

/// A frame being sent: the encoded header and the caller's payload, written without copying.
pub(crate) struct OutFrame<'a> {
    pub hdr: [u8; HEADER_LEN],
    pub payload: &'a [u8],
    /// Bytes of header + payload written so far.
    pub done: usize,
}

impl OutFrame<'_> {
    fn total(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }
}

/// A connection to one peer.
pub(crate) struct Link {
    pub peer: usize,
    stream: TcpStream,
    rbuf: Box<[u8]>,
    rstart: usize,
    rend: usize,
    /// A data header whose payload has not been consumed yet.
    pub pending: Option<Header>,
    /// Why reading has ended (goodbye, end of stream, error), once it has.
    pub closed: Option<String>,
    /// The unwritten rest of control frames (heartbeats, notices), always frame-aligned at
    /// its start and sent before any further data frame.
    ctrl_out: Vec<u8>,
    /// A data frame was left half-written by a failed operation: the stream is unusable for
    /// sending.
    pub torn: bool,
    /// The peer said goodbye (closed its communicator on purpose) before its stream ended.
    pub said_bye: bool,
    /// Data messages written completely on this link.
    pub sent: u64,
    /// Data messages received completely on this link.
    pub received: u64,
    /// The peer's last waiting notice, until its next data message: it waits for a message
    /// from this rank, having sent the first count of messages and received the second.
    pub peer_waits: Option<(u64, u64)>,
}

impl Link {
    /// Wraps an established stream that has completed its handshake.
    pub(crate) fn new(peer: usize, stream: TcpStream) -> io::Result<Link> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        Ok(Link {
            peer,
            stream,
            rbuf: vec![0u8; RBUF].into_boxed_slice(),
            rstart: 0,
            rend: 0,
            pending: None,
            closed: None,
            ctrl_out: Vec::new(),
            torn: false,
            said_bye: false,
            sent: 0,
            received: 0,
            peer_waits: None,
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    fn buffered(&self) -> usize {
        self.rend - self.rstart
    }

    /// Reads until at least `need` bytes are buffered. `Ok(false)`: not yet (would block).
    fn fill(&mut self, need: usize) -> io::Result<bool> {
        debug_assert!(need <= RBUF);
        if self.rstart + need > RBUF {
            self.rbuf.copy_within(self.rstart..self.rend, 0);
            self.rend -= self.rstart;
            self.rstart = 0;
        }
        while self.buffered() < need {
            match self.stream.read(&mut self.rbuf[self.rend..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.rend += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    fn close_with(&mut self, why: String) -> Event {
        self.closed.get_or_insert(why);
        Event::Closed
    }

    /// Reads the next frame header without blocking, consuming control frames.
    ///
    /// # Errors
    /// A frame that is not ours, or a control frame that does not belong on a peer link, as a
    /// description.
    pub(crate) fn next_event(&mut self) -> Result<Event, String> {
        if let Some(h) = self.pending {
            return Ok(Event::Data(h));
        }
        if self.closed.is_some() {
            return Ok(Event::Closed);
        }
        match self.fill(HEADER_LEN) {
            Ok(true) => {}
            Ok(false) => return Ok(Event::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                let why = if self.buffered() == 0 {
                    "its connection closed without a goodbye (process exited or crashed?)"
                        .to_owned()
                } else {
                    "its connection closed in the middle of a frame (process exited or crashed?)"
                        .to_owned()
                };
                return Ok(self.close_with(why));
            }
            Err(e) => return Ok(self.close_with(format!("connection error: {e}"))),
        }
        let mut raw = [0u8; HEADER_LEN];
        raw.copy_from_slice(&self.rbuf[self.rstart..self.rstart + HEADER_LEN]);
        let h = Header::decode(&raw)
            .map_err(|e| format!("rank {} sent a bad frame: {e}", self.peer))?;
        if h.kind == Kind::Data {
            self.rstart += HEADER_LEN;
            self.pending = Some(h);
            self.peer_waits = None;
            return Ok(Event::Data(h));
        }
        // Control frames are small (checked by `decode`) and handled only once complete.
        let total = HEADER_LEN + crate::model::usize_of(h.len);
        match self.fill(total) {
            Ok(true) => {}
            Ok(false) => return Ok(Event::WouldBlock),
            Err(e) => {
                return Ok(self.close_with(format!("connection lost inside a control frame: {e}")));
            }
        }
        let payload = &self.rbuf[self.rstart + HEADER_LEN..self.rstart + total];
        let ev = match h.kind {
            Kind::Heartbeat => Event::Heartbeat,
            Kind::Waiting => {
                self.peer_waits = Some((h.seq, h.arg));
                Event::Waiting
            }
            Kind::Abort => Event::Abort(Failure::decode(payload, self.peer)),
            Kind::Bye => {
                self.rstart += total;
                self.said_bye = true;
                return Ok(self.close_with("it closed its communicator".to_owned()));
            }
            other => {
                return Err(format!(
                    "rank {} sent an unexpected {other:?} frame on an established link",
                    self.peer
                ));
            }
        };
        self.rstart += total;
        Ok(ev)
    }

    /// Reads control frames without blocking, to learn of aborts on a link the current step
    /// does not use; stops at a data frame.
    ///
    /// # Errors
    /// The abort notice received, or a malformed frame.
    pub(crate) fn watch(&mut self, me: usize) -> Result<(), Failure> {
        loop {
            match self.next_event().map_err(|e| Failure::transport(me, e))? {
                Event::Abort(f) => return Err(f),
                Event::Heartbeat | Event::Waiting => {}
                Event::Data(_) | Event::Closed | Event::WouldBlock => return Ok(()),
            }
        }
    }

    /// Marks the pending data message as received completely.
    pub(crate) fn finish_payload(&mut self) {
        self.pending = None;
        self.received += 1;
    }

    /// Reads payload bytes of the pending frame into `dst` without blocking.
    pub(crate) fn read_payload(&mut self, dst: &mut [u8]) -> Got {
        if dst.is_empty() {
            return Got::Bytes(0);
        }
        if self.buffered() > 0 {
            let n = self.buffered().min(dst.len());
            dst[..n].copy_from_slice(&self.rbuf[self.rstart..self.rstart + n]);
            self.rstart += n;
            return Got::Bytes(n);
        }
        self.rstart = 0;
        self.rend = 0;
        loop {
            let r = if dst.len() >= RBUF / 2 {
                self.stream.read(dst)
            } else {
                self.stream.read(&mut self.rbuf).map(|n| {
                    self.rend = n;
                    let k = n.min(dst.len());
                    dst[..k].copy_from_slice(&self.rbuf[..k]);
                    self.rstart = k;
                    k
                })
            };
            return match r {
                Ok(0) => {
                    self.closed.get_or_insert_with(|| {
                        "its connection closed in the middle of a message".to_owned()
                    });
                    Got::Eof
                }
                Ok(n) => Got::Bytes(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Got::WouldBlock,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.closed
                        .get_or_insert_with(|| format!("connection error: {e}"));
                    Got::Eof
                }
            };
        }
    }

    /// Whether control bytes wait to be written.
    pub(crate) fn has_ctrl(&self) -> bool {
        !self.ctrl_out.is_empty()
    }

    /// Queues a control frame. The caller makes sure no data frame is half-written.
    pub(crate) fn queue_control(&mut self, h: Header, payload: &[u8]) {
        self.ctrl_out.extend_from_slice(&h.encode());
        self.ctrl_out.extend_from_slice(payload);
    }

    /// Writes queued control bytes, then as much of `frames` as the socket takes, without
    /// blocking. Completed frames are popped. Returns the bytes of data frames written
    /// (control bytes are not progress).
    ///
    /// # Errors
    /// The socket's error (the peer reset the connection, ...).
    pub(crate) fn send(&mut self, frames: &mut VecDeque<OutFrame<'_>>) -> io::Result<usize> {
        let mut written = 0;
        while !self.ctrl_out.is_empty() {
            match send_iov(self.fd(), &[IoSlice::new(&self.ctrl_out)]) {
                Ok(n) => {
                    self.ctrl_out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) => return Err(e),
            }
        }
        while !frames.is_empty() {
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(MAX_IOV);
            for f in frames.iter().take(MAX_IOV / 2) {
                if f.done < HEADER_LEN {
                    iov.push(IoSlice::new(&f.hdr[f.done..]));
                    if !f.payload.is_empty() {
                        iov.push(IoSlice::new(f.payload));
                    }
                } else if f.done < f.total() {
                    iov.push(IoSlice::new(&f.payload[f.done - HEADER_LEN..]));
                }
            }
            let mut n = match send_iov(self.fd(), &iov) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(written),
                Err(e) => return Err(e),
            };
            written += n;
            while n > 0 {
                let Some(f) = frames.front_mut() else { break };
                let step = (f.total() - f.done).min(n);
                f.done += step;
                n -= step;
                if f.done == f.total() {
                    frames.pop_front();
                    self.sent += 1;
                }
            }
            // Zero-length payload frames complete with their header.
            while frames.front().is_some_and(|f| f.done == f.total()) {
                frames.pop_front();
                self.sent += 1;
            }
        }
        Ok(written)
    }

    /// Best effort, never blocking: tells the peer why this rank stops (an abort notice or a
    /// goodbye), then closes the sending side so that it sees end-of-stream right after.
    pub(crate) fn say_last_words(&mut self, h: Header, payload: &[u8]) {
        if !self.torn {
            self.queue_control(h, payload);
            let _ = self.send(&mut VecDeque::new());
        }
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Closes the sending side without a word.
    pub(crate) fn shut_write(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Reads and discards what the peer has sent, so that closing sends an orderly FIN rather
    /// than a reset that could destroy our last words in flight.
    pub(crate) fn drain(&mut self) {
        let mut sink = [0u8; 4096];
        for _ in 0..256 {
            match self.stream.read(&mut sink) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
    }
}

/// `sendmsg` with `MSG_NOSIGNAL`: a vanished peer is an `EPIPE` error, never a `SIGPIPE`.
fn send_iov(fd: RawFd, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    loop {
        // SAFETY: an all-zero msghdr is valid; `IoSlice` is ABI-compatible with `iovec` on
        // Unix, and the slices outlive the call.
        let r = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_ptr().cast_mut().cast();
            msg.msg_iovlen = iov.len() as _;
            libc::sendmsg(fd, &raw const msg, libc::MSG_NOSIGNAL)
        };
        if r >= 0 {
            return Ok(r.unsigned_abs());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `poll(2)` for at most `timeout` (rounded up to a millisecond). Interrupted waits return 0.
///
/// # Errors
/// Only for invalid arguments.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    // Longer waits are cut at i32::MAX ms (24 days): callers poll again until their deadline.
    let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    // SAFETY: `fds` is a valid, exclusively borrowed array of `pollfd`.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if r >= 0 {
        return Ok(r.unsigned_abs() as usize);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::Interrupted {
        Ok(0)
    } else {
        Err(e)
    }
}
