//! Ranks as threads of one process: the communicator for tests, single-node runs and the
//! simulated ranks of the CLI. A transport only: bounded queues between every pair of
//! ranks; the collectives are the shared ones of [`super::collective`].

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{CommError, Communicator, DEFAULT_TIMEOUT, RecvBuf, SendBuf};

/// Bytes a sender may queue for one receiver before it waits.
const QUEUE_BYTES: usize = 16 << 20;
/// Largest message piece moved through a queue.
const PIECE_BYTES: usize = 4 << 20;

/// Pieces of messages from one rank to another; the flag marks a message's last piece.
#[derive(Default)]
struct Queue {
    pieces: VecDeque<(Vec<u8>, bool)>,
    bytes: usize,
}

/// Wakes a receiving rank when any of its queues gets data (the count guards against lost
/// wake-ups).
#[derive(Default)]
struct Doorbell {
    rings: Mutex<u64>,
    cv: Condvar,
}

struct Shared {
    world: usize,
    timeout: Duration,
    /// Ranks whose communicator was dropped.
    gone: Mutex<Vec<bool>>,
    /// `queues[dst * world + src]`; the condvar wakes a sender waiting for space.
    queues: Vec<(Mutex<Queue>, Condvar)>,
    /// One per receiving rank.
    doorbells: Vec<Doorbell>,
}

/// One rank's handle on an in-process group. Dropping it tells the other ranks this rank is
/// gone, so they fail fast instead of waiting for the timeout.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.rank)
            .field("world", &self.shared.world)
            .finish()
    }
}

impl LocalComm {
    /// Handles for a group of `world` ranks with the default timeout.
    #[must_use]
    pub fn group(world: usize) -> Vec<LocalComm> {
        Self::group_with_timeout(world, DEFAULT_TIMEOUT)
    }

    /// Handles for a group of `world` ranks; every wait gives up after `timeout`.
    #[must_use]
    pub fn group_with_timeout(world: usize, timeout: Duration) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            world,
            timeout,
            gone: Mutex::new(vec![false; world]),
            queues: (0..world * world)
                .map(|_| (Mutex::new(Queue::default()), Condvar::new()))
                .collect(),
            doorbells: (0..world).map(|_| Doorbell::default()).collect(),
        });
        (0..world)
            .map(|rank| LocalComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// A group of one.
    #[must_use]
    pub fn single() -> LocalComm {
        Self::group(1).pop().expect("one rank")
    }

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn peer_gone(&self, peer: usize) -> bool {
        Self::lock(&self.shared.gone)[peer]
    }

    fn send_to(&self, peer: usize, data: &[u8]) -> Result<(), CommError> {
        let (q, cv) = &self.shared.queues[peer * self.shared.world + self.rank];
        let pieces: Vec<&[u8]> = if data.is_empty() {
            vec![data]
        } else {
            data.chunks(PIECE_BYTES).collect()
        };
        let last = pieces.len() - 1;
        for (i, piece) in pieces.into_iter().enumerate() {
            let mut deadline = Instant::now() + self.shared.timeout;
            let mut g = Self::lock(q);
            while g.bytes > 0 && g.bytes + piece.len() > QUEUE_BYTES {
                let now = self.still_waiting(peer, deadline)?;
                let before = g.bytes;
                g = cv
                    .wait_timeout(g, (deadline - now).min(Duration::from_millis(100)))
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
                if g.bytes < before {
                    deadline = Instant::now() + self.shared.timeout;
                }
            }
            g.bytes += piece.len();
            g.pieces.push_back((piece.to_vec(), i == last));
            drop(g);
            let bell = &self.shared.doorbells[peer];
            *Self::lock(&bell.rings) += 1;
            bell.cv.notify_all();
        }
        Ok(())
    }

    /// Fills the receive buffers, taking data from whichever peer has some, so that the
    /// order of receives across peers never blocks a pattern that can complete.
    fn recv_all(&self, recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        let world = self.shared.world;
        // Per peer: the indices of its receive buffers in order, a cursor, and bytes filled.
        let mut order: Vec<Vec<usize>> = vec![Vec::new(); world];
        for (i, r) in recvs.iter().enumerate() {
            if r.peer >= world {
                return Err(CommError::Mismatch {
                    op: "exchange",
                    rank: self.rank,
                    detail: format!("peer {} out of range", r.peer),
                });
            }
            order[r.peer].push(i);
        }
        let mut cursor = vec![0usize; world];
        let mut filled = vec![0usize; world];
        let bell = &self.shared.doorbells[self.rank];
        let mut deadline = Instant::now() + self.shared.timeout;
        loop {
            let rings = *Self::lock(&bell.rings);
            let mut progress = false;
            let mut waiting_for = None;
            for peer in 0..world {
                while cursor[peer] < order[peer].len() {
                    let (q, cv) = &self.shared.queues[self.rank * world + peer];
                    let Some((piece, last)) = ({
                        let mut g = Self::lock(q);
                        let p = g.pieces.pop_front();
                        if let Some((data, _)) = &p {
                            g.bytes -= data.len();
                            cv.notify_all();
                        }
                        p
                    }) else {
                        waiting_for = waiting_for.or(Some(peer));
                        break;
                    };
                    progress = true;
                    let buf = &mut *recvs[order[peer][cursor[peer]]].buf;
                    let end = filled[peer] + piece.len();
                    if end > buf.len() || (last && end < buf.len()) {
                        let detail = format!(
                            "rank {peer} sent a message of {} bytes where {} were expected",
                            if last {
                                end.to_string()
                            } else {
                                format!("more than {}", buf.len())
                            },
                            buf.len()
                        );
                        return Err(CommError::Mismatch {
                            op: "exchange",
                            rank: self.rank,
                            detail,
                        });
                    }
                    buf[filled[peer]..end].copy_from_slice(&piece);
                    filled[peer] = end;
                    if last {
                        cursor[peer] += 1;
                        filled[peer] = 0;
                    }
                }
            }
            let Some(peer) = waiting_for else {
                return Ok(());
            };
            if progress {
                deadline = Instant::now() + self.shared.timeout;
                continue;
            }
            let now = self.still_waiting(peer, deadline)?;
            let g = Self::lock(&bell.rings);
            if *g == rings {
                let wait = (deadline - now).min(Duration::from_millis(100));
                drop(
                    bell.cv
                        .wait_timeout(g, wait)
                        .unwrap_or_else(std::sync::PoisonError::into_inner),
                );
            }
        }
    }

    /// The time now, while an exchange with `peer` may go on waiting: an error once `peer`'s
    /// communicator is gone or `deadline` has passed.
    fn still_waiting(&self, peer: usize, deadline: Instant) -> Result<Instant, CommError> {
        if self.peer_gone(peer) {
            return Err(self.lost("exchange", peer));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::Timeout {
                op: "exchange",
                rank: self.rank,
                peer: Some(peer),
                after: self.shared.timeout,
            });
        }
        Ok(now)
    }

    fn lost(&self, op: &'static str, peer: usize) -> CommError {
        CommError::PeerLost {
            op,
            rank: self.rank,
            peer,
            detail: "its communicator was dropped".into(),
        }
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        Self::lock(&self.shared.gone)[self.rank] = true;
        for (_, cv) in &self.shared.queues {
            cv.notify_all();
        }
        for bell in &self.shared.doorbells {
            bell.cv.notify_all();
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        for s in sends {
            if s.peer >= self.shared.world {
                return Err(CommError::Mismatch {
                    op: "exchange",
                    rank: self.rank,
                    detail: format!("peer {} out of range", s.peer),
                });
            }
        }
        // One side only (as in the collectives): no second thread needed.
        if recvs.is_empty() {
            return sends.iter().try_for_each(|s| self.send_to(s.peer, s.data));
        }
        if sends.is_empty() {
            return self.recv_all(recvs);
        }
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| {
                for s in sends {
                    self.send_to(s.peer, s.data)?;
                }
                Ok::<(), CommError>(())
            });
            let result = self.recv_all(recvs);
            let sent = sender.join().unwrap_or_else(|_| {
                Err(CommError::Transport {
                    op: "exchange",
                    rank: self.rank,
                    detail: "sender thread panicked".into(),
                })
            });
            result.and(sent)
        })
    }
}

/// Runs `f` on `world` ranks, one thread each, and returns their results in rank order.
/// A panicking rank drops its communicator, so the others fail fast.
///
/// # Panics
/// Re-raises a rank's panic after every rank has finished.
pub fn run_local<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(LocalComm) -> T + Sync,
) -> Vec<T> {
    let comms = LocalComm::group_with_timeout(world, timeout);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank-{}", c.rank))
                    .spawn_scoped(s, move || f(c))
                    .expect("spawn rank thread")
            })
            .collect();
        let results: Vec<std::thread::Result<T>> = handles.into_iter().map(|h| h.join()).collect();
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives() {
        let out = run_local(4, DEFAULT_TIMEOUT, |c| {
            let all = c.all_gather(&[c.rank() as u8]).unwrap();
            let b = c.broadcast(2, &[c.rank() as u8, 9]).unwrap();
            c.barrier().unwrap();
            (all, b)
        });
        for (all, b) in out {
            assert_eq!(all, vec![vec![0], vec![1], vec![2], vec![3]]);
            assert_eq!(b, vec![2, 9]);
        }
    }

    #[test]
    fn exchange_all_to_all_large() {
        let n = 3;
        let out = run_local(n, DEFAULT_TIMEOUT, |c| {
            let me = c.rank();
            let data: Vec<Vec<u8>> = (0..n).map(|p| vec![(me * 10 + p) as u8; 9 << 20]).collect();
            let sends: Vec<SendBuf> = (0..n)
                .filter(|&p| p != me)
                .map(|p| SendBuf {
                    peer: p,
                    data: &data[p],
                })
                .collect();
            let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 9 << 20]).collect();
            let mut recvs: Vec<RecvBuf> = bufs
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != me)
                .map(|(p, b)| RecvBuf { peer: p, buf: b })
                .collect();
            c.exchange(&sends, &mut recvs).unwrap();
            (me, bufs)
        });
        for (me, bufs) in out {
            for (p, b) in bufs.iter().enumerate() {
                if p != me {
                    assert!(b.iter().all(|&x| x == (p * 10 + me) as u8));
                }
            }
        }
    }

    /// Every rank sends 20 MiB to the next and receives from both neighbours, the previous
    /// one listed last: receiving in list order would wait forever on a full queue.
    #[test]
    fn cyclic_pattern_beyond_queue_capacity_completes() {
        let n = 3;
        let out = run_local(n, Duration::from_secs(20), |c| {
            let me = c.rank();
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let big = vec![me as u8; 20 << 20];
            let small = [me as u8; 8];
            let sends = [
                SendBuf {
                    peer: next,
                    data: &big,
                },
                SendBuf {
                    peer: prev,
                    data: &small,
                },
            ];
            let mut from_next = [0u8; 8];
            let mut from_prev = vec![0u8; 20 << 20];
            let mut recvs = [
                RecvBuf {
                    peer: next,
                    buf: &mut from_next,
                },
                RecvBuf {
                    peer: prev,
                    buf: &mut from_prev,
                },
            ];
            c.exchange(&sends, &mut recvs).unwrap();
            assert!(from_prev.iter().all(|&b| b == prev as u8));
            assert_eq!(from_next, [next as u8; 8]);
        });
        assert_eq!(out.len(), n);
    }

    #[test]
    fn message_boundaries_and_roots_are_checked() {
        let out = run_local(2, Duration::from_secs(5), |c| {
            if c.rank() == 0 {
                let _ = c.exchange(
                    &[
                        SendBuf {
                            peer: 1,
                            data: &[1, 2],
                        },
                        SendBuf {
                            peer: 1,
                            data: &[3, 4],
                        },
                    ],
                    &mut [],
                );
                None
            } else {
                let mut buf = [0u8; 4];
                Some(c.exchange(
                    &[],
                    &mut [RecvBuf {
                        peer: 0,
                        buf: &mut buf,
                    }],
                ))
            }
        });
        let e = out[1].clone().unwrap().unwrap_err();
        assert!(matches!(e, CommError::Mismatch { .. }), "{e}");
        let out = run_local(2, Duration::from_secs(5), |c| {
            c.broadcast(c.rank(), b"x").err()
        });
        assert!(
            out.iter()
                .flatten()
                .any(|e| matches!(e, CommError::Mismatch { .. }))
        );
    }

    #[test]
    fn dead_rank_is_an_error_not_a_hang() {
        let t0 = Instant::now();
        let out = run_local(3, Duration::from_secs(30), |c| {
            if c.rank() == 1 {
                drop(c);
                return None;
            }
            Some(c.all_gather(b"x"))
        });
        assert!(t0.elapsed() < Duration::from_secs(10));
        for r in out.into_iter().flatten() {
            assert!(
                matches!(r, Err(CommError::PeerLost { peer: 1, .. })),
                "{r:?}"
            );
        }
    }

    #[test]
    fn silent_rank_times_out_naming_it() {
        let out = run_local(2, Duration::from_millis(200), |c| {
            if c.rank() == 0 {
                std::thread::sleep(Duration::from_millis(600));
                None
            } else {
                Some(c.barrier())
            }
        });
        let e = out[1].clone().unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                CommError::Timeout {
                    peer: Some(0),
                    rank: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("rank 0"));
    }

    #[test]
    fn mismatched_operations_are_reported() {
        let out = run_local(2, Duration::from_secs(5), |c| {
            if c.rank() == 0 {
                c.barrier().err()
            } else {
                c.all_gather(b"").err()
            }
        });
        assert!(
            out.iter()
                .flatten()
                .any(|e| matches!(e, CommError::Mismatch { .. }))
        );
    }
}
