//! The wire format: a fixed 32-byte header in front of every message, and the payloads of the
//! control messages.
//!
//! Header layout (little endian): magic `ZCK2` (4 bytes), kind (1), operation (1), two zero
//! bytes, two numbers (8 each: a rank in handshakes, message counts in a waiting notice),
//! payload length (8).

use std::time::Duration;

use crate::comm::CommError;

/// Bytes in a header.
pub(crate) const HEADER_LEN: usize = 32;
/// Marks our frames; anything else on a socket is a protocol error, not data.
const MAGIC: [u8; 4] = *b"ZCK2";
/// Largest payload of a control message (handshakes, abort notices); longer ones are refused.
pub(crate) const MAX_CONTROL_LEN: u64 = 16 << 10;
/// Longest error detail carried in an abort notice.
const MAX_DETAIL_LEN: usize = 2048;
/// The culprit field's value for "no particular rank".
const NO_RANK: u64 = u64::MAX;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Payload of an exchange.
    Data = 1,
    /// "I am alive", on a liveness (watch) link; no payload.
    Heartbeat = 2,
    /// The sender failed; the payload says why (see [`Failure::encode`]).
    Abort = 3,
    /// The sender closed its communicator on purpose; no payload.
    Bye = 4,
    /// First frame on a peer link: `arg` = sender's rank, payload = session and world size.
    Hello = 5,
    /// Worker to master at rendezvous: `arg` = rank, payload = world, port, address.
    Register = 6,
    /// Master to worker at rendezvous: the address table.
    Table = 7,
    /// Master to worker at rendezvous: refused; payload = reason.
    Reject = 8,
    /// First frame on a liveness (watch) link: as [`Kind::Hello`].
    Watch = 9,
    /// On a peer link: "this rank waits for a message from you and has nothing more to send
    /// you"; `seq` = data messages it has sent on the link, `arg` = data messages it has
    /// received on it. No payload.
    Waiting = 10,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Data,
            2 => Kind::Heartbeat,
            3 => Kind::Abort,
            4 => Kind::Bye,
            5 => Kind::Hello,
            6 => Kind::Register,
            7 => Kind::Table,
            8 => Kind::Reject,
            9 => Kind::Watch,
            10 => Kind::Waiting,
            _ => return None,
        })
    }
}

/// Which operation a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Handshakes and control frames outside any operation.
    Setup = 0,
    /// [`crate::comm::Communicator::exchange`] (the only operation of the transport: the
    /// collectives are written over it, in [`crate::comm::collective`]).
    Exchange = 4,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            0 => Op::Setup,
            4 => Op::Exchange,
            _ => return None,
        })
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    pub op: Op,
    pub seq: u64,
    pub arg: u64,
    pub len: u64,
}

impl Header {
    /// A header for a control frame outside any operation.
    pub(crate) fn control(kind: Kind, arg: u64, len: usize) -> Header {
        Header {
            kind,
            op: Op::Setup,
            seq: 0,
            arg,
            len: len as u64,
        }
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = self.kind as u8;
        b[5] = self.op as u8;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.arg.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header, refusing anything that is not one of ours.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        if b[0..4] != MAGIC {
            return Err(format!(
                "bad frame magic {:02x?} (not a zarrckpt peer, or a corrupted stream)",
                &b[0..4]
            ));
        }
        let kind = Kind::from_u8(b[4]).ok_or_else(|| format!("unknown frame kind {}", b[4]))?;
        let op = Op::from_u8(b[5]).ok_or_else(|| format!("unknown operation code {}", b[5]))?;
        let seq = u64_at(b, 8);
        let arg = u64_at(b, 16);
        let len = u64_at(b, 24);
        // Data and address tables are bounded by their readers; everything else is small.
        let control = !matches!(kind, Kind::Data | Kind::Table);
        if control && len > MAX_CONTROL_LEN {
            return Err(format!(
                "{kind:?} frame of {len} bytes exceeds the {MAX_CONTROL_LEN}-byte limit"
            ));
        }
        Ok(Header {
            kind,
            op,
            seq,
            arg,
            len,
        })
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

/// A little cursor for decoding payloads without panicking on short input.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, at: 0 }
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        let b = self.bytes(8)?;
        Some(u64_at(b, 0))
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let b = self.buf.get(self.at..end)?;
        self.at = end;
        Some(b)
    }

    /// A `u64` length followed by that many bytes.
    pub(crate) fn blob(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u64()?).ok()?;
        self.bytes(n)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.at == self.buf.len()
    }
}

/// Appends a `u64` length and the bytes.
pub(crate) fn put_blob(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// What kind of failure an abort notice reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailKind {
    Timeout = 1,
    Lost = 2,
    Mismatch = 3,
    Transport = 4,
    TooLarge = 5,
    Silent = 6,
}

/// A failure as it travels between ranks: who saw it first, which rank is to blame, what
/// happened. Every rank that learns of it turns it into a [`CommError`] of the same kind naming
/// the same culprit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub kind: FailKind,
    /// The rank at fault, when known.
    pub culprit: Option<usize>,
    /// For timeouts: how long the detecting rank waited.
    pub after: Duration,
    /// The rank that detected it.
    pub origin: usize,
    pub detail: String,
    /// For messages refused as too large: the size announced and the limit.
    pub sizes: Option<(u64, u64)>,
}

impl Failure {
    pub(crate) fn timeout(
        origin: usize,
        peer: Option<usize>,
        after: Duration,
        detail: String,
    ) -> Failure {
        Failure {
            kind: FailKind::Timeout,
            culprit: peer,
            after,
            origin,
            detail,
            sizes: None,
        }
    }

    /// `peer` sent no heartbeat for `after`.
    pub(crate) fn silent(origin: usize, peer: usize, after: Duration, detail: String) -> Failure {
        Failure {
            kind: FailKind::Silent,
            culprit: Some(peer),
            after,
            origin,
            detail,
            sizes: None,
        }
    }

    /// `peer` announced `declared` bytes where at most `limit` are accepted.
    pub(crate) fn too_large(origin: usize, peer: usize, declared: u64, limit: u64) -> Failure {
        Failure {
            kind: FailKind::TooLarge,
            culprit: Some(peer),
            after: Duration::ZERO,
            origin,
            detail: format!("rank {peer} announced {declared} bytes, above the limit of {limit}"),
            sizes: Some((declared, limit)),
        }
    }

    pub(crate) fn lost(origin: usize, peer: usize, detail: impl Into<String>) -> Failure {
        Failure {
            kind: FailKind::Lost,
            culprit: Some(peer),
            after: Duration::ZERO,
            origin,
            detail: detail.into(),
            sizes: None,
        }
    }

    pub(crate) fn mismatch(origin: usize, detail: impl Into<String>) -> Failure {
        Failure {
            kind: FailKind::Mismatch,
            culprit: None,
            after: Duration::ZERO,
            origin,
            detail: detail.into(),
            sizes: None,
        }
    }

    pub(crate) fn transport(origin: usize, detail: impl Into<String>) -> Failure {
        Failure {
            kind: FailKind::Transport,
            culprit: None,
            after: Duration::ZERO,
            origin,
            detail: detail.into(),
            sizes: None,
        }
    }

    /// The failure standing for `e`, an error rank `me` saw (or learnt of) outside the
    /// transport: a collective written over it failed.
    pub(crate) fn from_error(e: &CommError, me: usize) -> Failure {
        match e {
            CommError::Timeout { peer, after, .. } => {
                Failure::timeout(me, *peer, *after, e.to_string())
            }
            CommError::Unresponsive {
                peer,
                silent_for,
                detail,
                ..
            } => Failure::silent(me, *peer, *silent_for, detail.clone()),
            CommError::PeerLost { peer, detail, .. } => Failure::lost(me, *peer, detail.clone()),
            CommError::Mismatch { detail, .. } => Failure::mismatch(me, detail.clone()),
            CommError::TooLarge {
                peer,
                declared,
                limit,
                ..
            } => Failure::too_large(me, *peer, *declared, *limit),
            CommError::Transport { detail, .. } => Failure::transport(me, detail.clone()),
        }
    }

    /// The error rank `me` reports for this failure while running `op`.
    pub(crate) fn to_error(&self, op: &'static str, me: usize) -> CommError {
        let detail = if self.origin == me {
            self.detail.clone()
        } else {
            format!("reported by rank {}: {}", self.origin, self.detail)
        };
        match (self.kind, self.culprit) {
            (FailKind::Timeout, peer) => CommError::Timeout {
                op,
                rank: me,
                peer,
                after: self.after,
            },
            (FailKind::Lost, Some(peer)) => CommError::PeerLost {
                op,
                rank: me,
                peer,
                detail,
            },
            (FailKind::Silent, Some(peer)) => CommError::Unresponsive {
                op,
                rank: me,
                peer,
                silent_for: self.after,
                detail,
            },
            (FailKind::TooLarge, Some(peer)) => {
                let (declared, limit) = self.sizes.unwrap_or((0, 0));
                CommError::TooLarge {
                    op,
                    rank: me,
                    peer,
                    declared,
                    limit,
                }
            }
            (FailKind::Mismatch, _) => CommError::Mismatch {
                op,
                rank: me,
                detail,
            },
            (FailKind::Lost | FailKind::Transport | FailKind::TooLarge | FailKind::Silent, _) => {
                CommError::Transport {
                    op,
                    rank: me,
                    detail,
                }
            }
        }
    }

    /// The payload of an abort notice.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.detail.len());
        out.push(self.kind as u8);
        out.extend_from_slice(&self.culprit.map_or(NO_RANK, |c| c as u64).to_le_bytes());
        // Saturates: u64::MAX ms is 584 million years.
        let ms = u64::try_from(self.after.as_millis()).unwrap_or(u64::MAX);
        out.extend_from_slice(&ms.to_le_bytes());
        out.extend_from_slice(&(self.origin as u64).to_le_bytes());
        let mut cut = self.detail.len().min(MAX_DETAIL_LEN);
        while !self.detail.is_char_boundary(cut) {
            cut -= 1;
        }
        put_blob(&mut out, &self.detail.as_bytes()[..cut]);
        if let Some((declared, limit)) = self.sizes {
            out.extend_from_slice(&declared.to_le_bytes());
            out.extend_from_slice(&limit.to_le_bytes());
        }
        out
    }

    /// Decodes an abort notice received from `from`.
    pub(crate) fn decode(payload: &[u8], from: usize) -> Failure {
        let parse = || {
            let mut c = Cursor::new(payload);
            let kind = match c.bytes(1)?[0] {
                1 => FailKind::Timeout,
                2 => FailKind::Lost,
                3 => FailKind::Mismatch,
                5 => FailKind::TooLarge,
                6 => FailKind::Silent,
                _ => FailKind::Transport,
            };
            let culprit = c.u64()?;
            let after = Duration::from_millis(c.u64()?);
            let origin = usize::try_from(c.u64()?).ok()?;
            let detail = String::from_utf8_lossy(c.blob()?).into_owned();
            let sizes = match (c.u64(), c.u64()) {
                (Some(d), Some(l)) => Some((d, l)),
                _ => None,
            };
            let culprit = if culprit == NO_RANK {
                None
            } else {
                usize::try_from(culprit).ok()
            };
            Some(Failure {
                kind,
                culprit,
                after,
                origin,
                detail,
                sizes,
            })
        };
        parse().unwrap_or_else(|| {
            Failure::transport(
                from,
                format!("rank {from} aborted with an unreadable notice"),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejects_garbage() {
        let h = Header {
            kind: Kind::Data,
            op: Op::Exchange,
            seq: 7,
            arg: 3,
            len: 1 << 40,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Header::decode(&bad).unwrap_err().contains("magic"));
        let mut bad = h.encode();
        bad[4] = 99;
        assert!(Header::decode(&bad).is_err());
        let huge_control = Header {
            kind: Kind::Abort,
            op: Op::Setup,
            seq: 0,
            arg: 0,
            len: 1 << 30,
        };
        assert!(Header::decode(&huge_control.encode()).is_err());
    }

    #[test]
    fn failure_round_trip() {
        let f = Failure::timeout(2, Some(5), Duration::from_millis(1500), "é".repeat(5000));
        let g = Failure::decode(&f.encode(), 2);
        assert_eq!(
            (g.kind, g.culprit, g.after, g.origin),
            (f.kind, f.culprit, f.after, f.origin)
        );
        assert!(g.detail.len() <= MAX_DETAIL_LEN);
        let e = g.to_error("barrier", 0);
        assert!(
            matches!(
                e,
                CommError::Timeout {
                    peer: Some(5),
                    rank: 0,
                    ..
                }
            ),
            "{e}"
        );
        let e = Failure::lost(1, 3, "gone").to_error("x", 4);
        assert!(e.to_string().contains("reported by rank 1"), "{e}");
        assert!(matches!(
            Failure::decode(&[9, 1], 6).to_error("x", 0),
            CommError::Transport { .. }
        ));
        let big = Failure::too_large(1, 2, 1 << 40, 1 << 30);
        let e = Failure::decode(&big.encode(), 1).to_error("all_gather", 3);
        assert_eq!(
            e,
            CommError::TooLarge {
                op: "all_gather",
                rank: 3,
                peer: 2,
                declared: 1 << 40,
                limit: 1 << 30
            }
        );
    }
}
