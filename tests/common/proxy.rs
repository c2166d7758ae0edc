//! A failure-injecting HTTP proxy on 127.0.0.1, in front of an S3 server on loopback
//! (SeaweedFS in the tests and `zarrckpt bench-s3`). It forwards each request as it came
//! (the SigV4 signature covers the `Host` header, which is passed on unchanged), one request
//! per connection (it answers `Connection: close`), and on the requests its rules choose it
//! answers `503 SlowDown`, `409 ConditionalRequestConflict` or another status instead, or drops
//! the connection before or after forwarding the request. It counts the body bytes of GET
//! answers (read amplification) and of PUT / POST requests.
//!
//! Bounded: every rule injects at most `limit` faults and only within its time window; every
//! socket has a 60 s read / write timeout; the proxy stops accepting when dropped or when its
//! lifetime ends. Binds 127.0.0.1 only and connects to 127.0.0.1 only.
//!
//! Std only: included with `#[path]` by `tests/s3_faults.rs` and by the CLI's `bench-s3`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a rule does to a request it chooses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `503 Slow Down` with an S3 `SlowDown` error body (the request is not forwarded).
    SlowDown,
    /// `409 Conflict` with an S3 `ConditionalRequestConflict` body (not forwarded).
    Conflict,
    /// Another status with a generic S3 error body (not forwarded).
    Status(u16),
    /// Close the connection without forwarding or answering.
    DropBeforeForward,
    /// Forward the request, let the server act on it, then close the connection without
    /// passing the answer on (the client cannot know whether its request took effect).
    DropAfterForward,
}

/// Which requests a rule injects a fault into.
#[derive(Clone, Debug)]
pub struct Rule {
    /// The fault.
    pub fault: Fault,
    /// Only this method (`PUT`, `GET`, `POST`...); `None`: any.
    pub method: Option<&'static str>,
    /// Only request targets (path and query) containing this; `None`: any.
    pub path_contains: Option<String>,
    /// Only requests with `If-None-Match` or `If-Match` (conditional writes).
    pub conditional_only: bool,
    /// Inject into every `every`-th matching request (1: all of them).
    pub every: u64,
    /// At most this many injections (`u64::MAX`: a permanent failure).
    pub limit: u64,
    /// Only within this long after the proxy started (`None`: its whole lifetime).
    pub window: Option<Duration>,
}

impl Rule {
    /// A rule injecting `fault` into every `every`-th request, at most `limit` times.
    #[must_use]
    pub fn new(fault: Fault, every: u64, limit: u64) -> Self {
        Self {
            fault,
            method: None,
            path_contains: None,
            conditional_only: false,
            every: every.max(1),
            limit,
            window: None,
        }
    }

    /// Only requests with this method.
    #[must_use]
    pub fn method(mut self, m: &'static str) -> Self {
        self.method = Some(m);
        self
    }

    /// Only conditional writes.
    #[must_use]
    pub fn conditional(mut self) -> Self {
        self.conditional_only = true;
        self
    }

    /// Only targets containing `s`.
    #[must_use]
    pub fn path(mut self, s: &str) -> Self {
        self.path_contains = Some(s.to_string());
        self
    }
}

#[derive(Default)]
struct RuleState {
    matched: u64,
    injected: u64,
}

struct Shared {
    upstream: u16,
    started: Instant,
    rules: Mutex<Vec<(Rule, RuleState)>>,
    requests: AtomicU64,
    injected: AtomicU64,
    get_bytes: AtomicU64,
    put_bytes: AtomicU64,
    log: Mutex<Vec<String>>,
    seen: Mutex<Vec<String>>,
}

/// A running proxy; dropping it stops it (open connections finish their request).
pub struct Proxy {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

const IO_TIMEOUT: Duration = Duration::from_secs(60);

impl Proxy {
    /// Starts a proxy to 127.0.0.1:`upstream` with `rules`, accepting for at most `lifetime`.
    ///
    /// # Panics
    /// When 127.0.0.1 cannot be bound.
    #[must_use]
    pub fn start(upstream: u16, rules: Vec<Rule>, lifetime: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let port = listener.local_addr().expect("local address").port();
        let shared = Arc::new(Shared {
            upstream,
            started: Instant::now(),
            rules: Mutex::new(
                rules
                    .into_iter()
                    .map(|r| (r, RuleState::default()))
                    .collect(),
            ),
            requests: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            get_bytes: AtomicU64::new(0),
            put_bytes: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            seen: Mutex::new(Vec::new()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (sh, st) = (Arc::clone(&shared), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let end = Instant::now() + lifetime;
            while !st.load(Ordering::Relaxed) && Instant::now() < end {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let sh = Arc::clone(&sh);
                        std::thread::spawn(move || {
                            let _ = serve(&sh, conn);
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Self {
            port,
            shared,
            stop,
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Requests received.
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Faults injected.
    #[must_use]
    pub fn injected(&self) -> u64 {
        self.shared.injected.load(Ordering::SeqCst)
    }

    /// Body bytes of GET answers passed on to clients.
    #[must_use]
    pub fn get_bytes(&self) -> u64 {
        self.shared.get_bytes.load(Ordering::SeqCst)
    }

    /// Body bytes of PUT / POST requests received.
    #[must_use]
    pub fn put_bytes(&self) -> u64 {
        self.shared.put_bytes.load(Ordering::SeqCst)
    }

    /// Sets the byte and request counters to zero and forgets the requests seen.
    pub fn reset_counters(&self) {
        self.shared.get_bytes.store(0, Ordering::SeqCst);
        self.shared.put_bytes.store(0, Ordering::SeqCst);
        self.shared.requests.store(0, Ordering::SeqCst);
        self.shared.seen.lock().unwrap().clear();
    }

    /// `METHOD target` of every request received (since the last reset), in order of arrival.
    #[must_use]
    pub fn seen(&self) -> Vec<String> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// `METHOD target -> fault` for every injection so far.
    #[must_use]
    pub fn log(&self) -> Vec<String> {
        self.shared.log.lock().unwrap().clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Request {
    method: String,
    target: String,
    head: Vec<u8>,
    conditional: bool,
    body: Vec<u8>,
}

/// Reads one request (head, and a `Content-Length` body); `None` at end of stream.
fn read_request(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<Request>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let target = parts.next().unwrap_or_default().to_string();
    let mut head = line.clone().into_bytes();
    let (mut len, mut conditional) = (0usize, false);
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if h == "\r\n" || h == "\n" {
            break;
        }
        let lower = h.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v
                .trim()
                .parse()
                .map_err(|_| std::io::ErrorKind::InvalidData)?;
        }
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            return Err(std::io::Error::other(
                "chunked request bodies are not supported",
            ));
        }
        if lower.starts_with("if-none-match:") || lower.starts_with("if-match:") {
            conditional = true;
        }
        if lower.starts_with("connection:") {
            continue;
        }
        head.extend_from_slice(h.as_bytes());
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Some(Request {
        method,
        target,
        head,
        conditional,
        body,
    }))
}

fn choose(sh: &Shared, req: &Request) -> Option<Fault> {
    let mut rules = sh.rules.lock().unwrap();
    let elapsed = sh.started.elapsed();
    for (rule, state) in rules.iter_mut() {
        let applies = rule.method.is_none_or(|m| m == req.method)
            && rule
                .path_contains
                .as_deref()
                .is_none_or(|p| req.target.contains(p))
            && (!rule.conditional_only || req.conditional)
            && rule.window.is_none_or(|w| elapsed < w);
        if !applies {
            continue;
        }
        state.matched += 1;
        if state.injected < rule.limit && state.matched % rule.every == 0 {
            state.injected += 1;
            sh.injected.fetch_add(1, Ordering::SeqCst);
            sh.log
                .lock()
                .unwrap()
                .push(format!("{} {} -> {:?}", req.method, req.target, rule.fault));
            return Some(rule.fault);
        }
    }
    None
}

fn error_answer(status: u16, reason: &str, code: &str) -> Vec<u8> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>"
    );
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn serve(sh: &Shared, conn: TcpStream) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut client = conn.try_clone()?;
    let mut reader = BufReader::new(conn);
    let Some(req) = read_request(&mut reader)? else {
        return Ok(());
    };
    sh.requests.fetch_add(1, Ordering::SeqCst);
    sh.seen
        .lock()
        .unwrap()
        .push(format!("{} {}", req.method, req.target));
    if matches!(req.method.as_str(), "PUT" | "POST") {
        sh.put_bytes
            .fetch_add(req.body.len() as u64, Ordering::SeqCst);
    }
    let fault = choose(sh, &req);
    match fault {
        Some(Fault::SlowDown) => {
            return client.write_all(&error_answer(503, "Slow Down", "SlowDown"));
        }
        Some(Fault::Conflict) => {
            return client.write_all(&error_answer(409, "Conflict", "ConditionalRequestConflict"));
        }
        Some(Fault::Status(s)) => {
            return client.write_all(&error_answer(s, "Injected", "InternalError"));
        }
        Some(Fault::DropBeforeForward) => return client.shutdown(Shutdown::Both),
        _ => {}
    }
    let mut up = TcpStream::connect(("127.0.0.1", sh.upstream))?;
    up.set_read_timeout(Some(IO_TIMEOUT))?;
    up.set_write_timeout(Some(IO_TIMEOUT))?;
    up.write_all(&req.head)?;
    up.write_all(&req.body)?;
    let mut up = BufReader::with_capacity(1 << 20, up);
    if fault == Some(Fault::DropAfterForward) {
        // Let the server finish the request, then drop the answer.
        let mut sink = Vec::new();
        let _ = up.read_to_end(&mut sink);
        return client.shutdown(Shutdown::Both);
    }
    // The answer's head (with `Connection: close`), then the body until the server closes.
    let mut head = Vec::new();
    loop {
        let mut h = String::new();
        if up.read_line(&mut h)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if h == "\r\n" || h == "\n" {
            break;
        }
        if h.to_ascii_lowercase().starts_with("connection:") {
            continue;
        }
        head.extend_from_slice(h.as_bytes());
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    client.write_all(&head)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = up.read(&mut buf)?;
        if n == 0 {
            break;
        }
        client.write_all(&buf[..n])?;
        if req.method == "GET" {
            sh.get_bytes.fetch_add(n as u64, Ordering::SeqCst);
        }
    }
    client.shutdown(Shutdown::Both)
}
