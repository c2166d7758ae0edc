//! Accepted connections that have not introduced themselves yet. Each reads its first frame
//! without blocking, against a deadline of its own, so that a connection that sends nothing,
//! sends too little or sends garbage never holds up the others: it is dropped when its
//! deadline passes or its first bytes are not a frame of ours.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::frame::{HEADER_LEN, Header};

/// Longest wait for the first frame of one accepted connection.
pub(super) const HELLO_WAIT: Duration = Duration::from_secs(5);
/// Most half-open connections kept at once; the oldest goes when more arrive.
const MAX_PENDING: usize = 1024;

/// A connection's first frame.
pub(super) struct Greeting {
    pub stream: TcpStream,
    pub from: SocketAddr,
    pub header: Header,
    pub payload: Vec<u8>,
}

struct Half {
    stream: TcpStream,
    from: SocketAddr,
    buf: Vec<u8>,
    header: Option<Header>,
    deadline: Instant,
}

/// The connections waiting for their first frame.
pub(super) struct Greeter {
    who: String,
    max_len: u64,
    wait: Duration,
    conns: Vec<Half>,
}

impl Greeter {
    /// `who` names the listener in warnings; first frames may carry at most `max_len` bytes.
    pub(super) fn new(who: impl Into<String>, max_len: u64) -> Greeter {
        Greeter {
            who: who.into(),
            max_len,
            wait: HELLO_WAIT,
            conns: Vec::new(),
        }
    }

    /// Accepts every connection waiting on the (non-blocking) `listener`.
    ///
    /// # Errors
    /// The listener's error other than "nothing to accept" (too many open files, ...).
    pub(super) fn accept_from(&mut self, listener: &TcpListener) -> io::Result<()> {
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    stream.set_nonblocking(true)?;
                    let _ = stream.set_nodelay(true);
                    if self.conns.len() >= MAX_PENDING {
                        let old = self.conns.remove(0);
                        tracing::warn!(
                            "{}: too many connections without a handshake; dropping the one from {}",
                            self.who,
                            old.from
                        );
                    }
                    self.conns.push(Half {
                        stream,
                        from,
                        buf: Vec::with_capacity(HEADER_LEN),
                        header: None,
                        deadline: Instant::now() + self.wait,
                    });
                }
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted =>
                {
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Appends a `poll` entry per waiting connection.
    pub(super) fn poll_set(&self, fds: &mut Vec<libc::pollfd>) {
        fds.extend(self.conns.iter().map(|h| libc::pollfd {
            fd: h.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
    }

    /// The earliest deadline of a waiting connection.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.conns.iter().map(|h| h.deadline).min()
    }

    /// Reads what has arrived; returns the connections whose first frame is complete (never
    /// reading past it) and drops those that failed or ran out of time.
    pub(super) fn progress(&mut self) -> Vec<Greeting> {
        let now = Instant::now();
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.conns.len() {
            match self.read_one(i) {
                Ok(true) => {
                    let h = self.conns.swap_remove(i);
                    if let Some(header) = h.header {
                        done.push(Greeting {
                            stream: h.stream,
                            from: h.from,
                            header,
                            payload: h.buf,
                        });
                    }
                }
                Ok(false) if now < self.conns[i].deadline => i += 1,
                Ok(false) => {
                    let h = self.conns.swap_remove(i);
                    tracing::warn!(
                        "{}: dropping a connection from {} that sent no handshake within {:?}",
                        self.who,
                        h.from,
                        self.wait
                    );
                }
                Err(e) if e.is_empty() => {
                    self.conns.swap_remove(i);
                }
                Err(e) => {
                    let h = self.conns.swap_remove(i);
                    tracing::warn!("{}: dropping a connection from {}: {e}", self.who, h.from);
                }
            }
        }
        done
    }

    /// Reads connection `i` without blocking; `Ok(true)` once its first frame is complete.
    fn read_one(&mut self, i: usize) -> Result<bool, String> {
        let max = self.max_len;
        let h = &mut self.conns[i];
        loop {
            let need = match h.header {
                None => HEADER_LEN - h.buf.len(),
                Some(hdr) => {
                    let total = usize::try_from(hdr.len).map_err(|e| e.to_string())?;
                    total - h.buf.len()
                }
            };
            if need == 0 {
                if h.header.is_some() {
                    return Ok(true);
                }
                let mut raw = [0u8; HEADER_LEN];
                raw.copy_from_slice(&h.buf);
                let hdr = Header::decode(&raw)?;
                if hdr.len > max {
                    return Err(format!(
                        "its first frame declares {} bytes, above the limit of {max}",
                        hdr.len
                    ));
                }
                h.header = Some(hdr);
                h.buf.clear();
                h.buf
                    .try_reserve_exact(usize::try_from(hdr.len).map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?;
                continue;
            }
            let mut tmp = [0u8; 4096];
            let want = need.min(tmp.len());
            match h.stream.read(&mut tmp[..want]) {
                // An empty string: closed before sending anything (a liveness probe).
                Ok(0) if h.buf.is_empty() && h.header.is_none() => return Err(String::new()),
                Ok(0) => return Err("closed before completing its handshake".to_owned()),
                Ok(n) => h.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::super::frame::{Kind, MAX_CONTROL_LEN};
    use super::*;

    /// An idle, a garbage and an oversized connection do not delay a valid one; the idle one
    /// goes at its deadline.
    #[test]
    fn idle_and_foreign_connections_do_not_block_others() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let mut g = Greeter::new("test", MAX_CONTROL_LEN);
        g.wait = Duration::from_millis(300);
        let _idle = TcpStream::connect(addr).unwrap();
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(&[0xAB; 64]).unwrap();
        let mut huge = TcpStream::connect(addr).unwrap();
        huge.write_all(&Header::control(Kind::Hello, 3, 0).encode()[..24])
            .unwrap();
        huge.write_all(&(1u64 << 40).to_le_bytes()).unwrap();
        let mut good = TcpStream::connect(addr).unwrap();
        let h = Header::control(Kind::Hello, 7, 3);
        good.write_all(&h.encode()).unwrap();
        good.write_all(b"abcNEXT").unwrap();
        let t0 = Instant::now();
        let mut got = Vec::new();
        while got.is_empty() && t0.elapsed() < Duration::from_secs(5) {
            g.accept_from(&l).unwrap();
            got.extend(g.progress());
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            t0.elapsed() < Duration::from_millis(250),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].header, got[0].payload.as_slice()), (h, &b"abc"[..]));
        // Nothing past the first frame was consumed.
        let mut rest = [0u8; 4];
        let mut s = &got[0].stream;
        s.set_nonblocking(false).unwrap();
        std::io::Read::read_exact(&mut s, &mut rest).unwrap();
        assert_eq!(&rest, b"NEXT");
        // Garbage and the oversized frame are gone; the idle connection waits out its deadline.
        assert_eq!(g.conns.len(), 1);
        std::thread::sleep(Duration::from_millis(350));
        assert!(g.progress().is_empty());
        assert!(g.conns.is_empty());
    }
}
