//! Forwarding a child's output line by line with a `[rank N] ` prefix.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};

/// Longest piece forwarded as one line; longer lines are split.
const MAX_LINE: usize = 1 << 20;

/// Where forwarded lines go.
#[derive(Clone)]
pub enum Sink {
    /// The launcher's standard output.
    Stdout,
    /// The launcher's standard error.
    Stderr,
    /// Any writer, shared by all ranks (each line is written whole under the lock).
    #[allow(dead_code)] // tests/launch.rs captures output with it; the CLI forwards to stdio
    Writer(Arc<Mutex<dyn Write + Send>>),
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Sink::Stdout => "Stdout",
            Sink::Stderr => "Stderr",
            Sink::Writer(_) => "Writer(..)",
        })
    }
}

impl Sink {
    /// A sink collecting everything in memory, and a handle to read it back.
    #[must_use]
    #[allow(dead_code)] // used by tests/launch.rs
    pub fn memory() -> (Sink, Arc<Mutex<Vec<u8>>>) {
        let buf = Arc::new(Mutex::new(Vec::new()));
        (Sink::Writer(buf.clone()), buf)
    }

    /// Writes one complete line; errors (a closed terminal, ...) are ignored so that the
    /// child's pipe keeps draining.
    fn write_line(&self, line: &[u8]) {
        let _ = match self {
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(line).and_then(|()| out.flush())
            }
            Sink::Stderr => io::stderr().lock().write_all(line),
            Sink::Writer(w) => {
                let mut w = w.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                w.write_all(line).and_then(|()| w.flush())
            }
        };
    }
}

/// Copies `src` to `sink` until end of stream, prefixing every line with `[rank N] `.
pub(super) fn forward(rank: usize, src: impl Read, sink: &Sink) {
    let prefix = format!("[rank {rank}] ");
    let mut reader = BufReader::with_capacity(64 << 10, src);
    let mut line: Vec<u8> = prefix.as_bytes().to_vec();
    loop {
        let buf = match reader.fill_buf() {
            Ok([]) => break,
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let room = MAX_LINE.saturating_sub(line.len() - prefix.len()).max(1);
        let (take, complete) = match buf.iter().take(room).position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len().min(room), buf.len() >= room),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if complete {
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            sink.write_line(&line);
            line.truncate(prefix.len());
        }
    }
    if line.len() > prefix.len() {
        line.push(b'\n');
        sink.write_line(&line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_every_line_and_terminates_the_last() {
        let (sink, buf) = Sink::memory();
        forward(3, &b"a\n\nbc\nno newline"[..], &sink);
        let out = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        assert_eq!(
            out,
            "[rank 3] a\n[rank 3] \n[rank 3] bc\n[rank 3] no newline\n"
        );
    }

    #[test]
    fn splits_huge_lines() {
        let (sink, buf) = Sink::memory();
        let data = vec![b'x'; MAX_LINE + 10];
        forward(0, &data[..], &sink);
        let out = buf.lock().unwrap().clone();
        assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 2);
    }
}
