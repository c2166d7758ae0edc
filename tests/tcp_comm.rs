//! `TcpComm` with ranks as threads of one process, talking over 127.0.0.1.

use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use zarrckpt::comm::{CommError, Communicator, RecvBuf, SendBuf, TcpComm, TcpConfig, TcpMaster};

fn config(rank: usize, world: usize, port: u16, timeout: Duration) -> TcpConfig {
    let mut cfg = TcpConfig::new(rank, world, "127.0.0.1", port);
    cfg.timeout = timeout;
    cfg
}

/// Runs `f` on `world` ranks, one thread and one `TcpComm` each; rank 0 binds an ephemeral
/// master port and the others learn it before they start. `f` also sees failures to join:
/// a rank that races ahead after setup and fails can abort the others' setup.
fn run_tcp_try<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(Result<TcpComm, CommError>) -> T + Sync,
) -> Vec<T> {
    let master = TcpMaster::bind(config(0, world, 0, timeout)).unwrap();
    let port = master.port().unwrap();
    thread::scope(|s| {
        let f = &f;
        let mut handles = vec![s.spawn(move || f(master.accept()))];
        for r in 1..world {
            handles.push(s.spawn(move || f(TcpComm::connect(config(r, world, port, timeout)))));
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// As [`run_tcp_try`] for runs where joining must succeed.
fn run_tcp<T: Send>(world: usize, timeout: Duration, f: impl Fn(TcpComm) -> T + Sync) -> Vec<T> {
    run_tcp_try(world, timeout, |c| f(c.unwrap()))
}

/// Distinct bytes per seed, cheap to build in debug builds.
fn pattern(seed: usize, len: usize) -> Vec<u8> {
    let block: Vec<u8> = (0..4093)
        .map(|i: usize| (i.wrapping_mul(31) ^ seed.wrapping_mul(131)) as u8)
        .collect();
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        v.extend_from_slice(&block[..block.len().min(len - v.len())]);
    }
    v
}

const T: Duration = Duration::from_secs(20);

#[test]
fn collectives_with_varied_sizes() {
    for world in [2, 5, 8] {
        let sizes = |r: usize| [0, 1, 1000 * r, 3 << 20][r % 4];
        let out = run_tcp(world, T, |c| {
            let me = c.rank();
            for round in 0..2 {
                let all = c.all_gather(&pattern(me + round, sizes(me))).unwrap();
                assert_eq!(all.len(), world);
                for (r, got) in all.iter().enumerate() {
                    assert_eq!(
                        got,
                        &pattern(r + round, sizes(r)),
                        "world {world} rank {me} part {r}"
                    );
                }
                c.barrier().unwrap();
            }
            for root in 0..world {
                let len = [0, 7, 2 << 20][root % 3];
                let mine = if me == root {
                    pattern(root, len)
                } else {
                    b"ignored".to_vec()
                };
                assert_eq!(
                    c.broadcast(root, &mine).unwrap(),
                    pattern(root, len),
                    "root {root}"
                );
            }
            c.all_gather(b"").unwrap()
        });
        assert!(
            out.iter()
                .all(|a| a.len() == world && a.iter().all(Vec::is_empty))
        );
    }
}

#[test]
fn exchange_all_to_all_large_into_caller_buffers() {
    let n = 4;
    let big = 9 << 20;
    let out = run_tcp(n, T, |c| {
        let me = c.rank();
        // To every peer (self included): a big buffer, an empty one and a small one.
        let data: Vec<Vec<Vec<u8>>> = (0..n)
            .map(|p| {
                vec![
                    pattern(me * 10 + p, big),
                    Vec::new(),
                    pattern(me * 100 + p, 5),
                ]
            })
            .collect();
        let sends: Vec<SendBuf> = (0..n)
            .flat_map(|p| data[p].iter().map(move |d| SendBuf { peer: p, data: d }))
            .collect();
        let mut bufs: Vec<Vec<Vec<u8>>> = (0..n)
            .map(|_| vec![vec![0u8; big], Vec::new(), vec![0u8; 5]])
            .collect();
        let mut recvs: Vec<RecvBuf> = bufs
            .iter_mut()
            .enumerate()
            .rev()
            .flat_map(|(p, bs)| bs.iter_mut().map(move |b| RecvBuf { peer: p, buf: b }))
            .collect();
        c.exchange(&sends, &mut recvs).unwrap();
        drop(recvs);
        // Nothing to do is fine, too.
        c.exchange(&[], &mut []).unwrap();
        c.barrier().unwrap();
        (me, bufs)
    });
    for (me, bufs) in out {
        for (p, b) in bufs.iter().enumerate() {
            assert!(b[0] == pattern(p * 10 + me, big), "rank {me} from {p}");
            assert_eq!(b[2], pattern(p * 100 + me, 5));
        }
    }
}

/// A pattern that deadlocks if receives from different peers are served one after another:
/// 0 sends to 1 then 3; 1 receives from 2 then 0; 2 sends to 3 then 1; 3 receives from 0
/// then 2. Buffers are larger than socket buffers.
#[test]
fn exchange_progresses_all_peers_concurrently() {
    let len = 8 << 20;
    let out = run_tcp(4, T, |c| {
        let me = c.rank();
        let a = pattern(me, len);
        let (mut x, mut y) = (vec![0u8; len], vec![0u8; len]);
        match me {
            0 => c.exchange(
                &[SendBuf { peer: 1, data: &a }, SendBuf { peer: 3, data: &a }],
                &mut [],
            ),
            2 => c.exchange(
                &[SendBuf { peer: 3, data: &a }, SendBuf { peer: 1, data: &a }],
                &mut [],
            ),
            1 => c.exchange(
                &[],
                &mut [
                    RecvBuf {
                        peer: 2,
                        buf: &mut x,
                    },
                    RecvBuf {
                        peer: 0,
                        buf: &mut y,
                    },
                ],
            ),
            _ => c.exchange(
                &[],
                &mut [
                    RecvBuf {
                        peer: 0,
                        buf: &mut x,
                    },
                    RecvBuf {
                        peer: 2,
                        buf: &mut y,
                    },
                ],
            ),
        }
        .unwrap();
        (me, x, y)
    });
    assert!(out[1].1 == pattern(2, len) && out[1].2 == pattern(0, len));
    assert!(out[3].1 == pattern(0, len) && out[3].2 == pattern(2, len));
}

#[test]
fn dropped_rank_is_named_quickly() {
    let t0 = Instant::now();
    let out = run_tcp(6, T, |c| {
        c.barrier().unwrap();
        if c.rank() == 1 {
            thread::sleep(Duration::from_millis(200));
            drop(c);
            return None;
        }
        let r = c.all_gather(&[1, 2, 3]);
        // Poisoned: later calls fail at once with the same error.
        let t = Instant::now();
        let again = c.barrier();
        assert!(t.elapsed() < Duration::from_millis(100));
        assert_eq!(again.as_ref().err(), r.as_ref().err());
        Some(r)
    });
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    for (rank, r) in out.into_iter().enumerate() {
        if let Some(r) = r {
            assert!(
                matches!(r, Err(CommError::PeerLost { peer: 1, .. })),
                "rank {rank}: {r:?}"
            );
        }
    }
}

#[test]
fn rank_dropped_during_exchange_is_named() {
    let len = 16 << 20;
    let out = run_tcp(3, T, |c| {
        let me = c.rank();
        let data = pattern(me, len);
        let mut buf = vec![0u8; len];
        c.barrier().unwrap();
        if me == 2 {
            // Starts receiving from 0, then vanishes half-way.
            thread::sleep(Duration::from_millis(100));
            drop(c);
            return None;
        }
        let (to, from) = if me == 0 { (2, 1) } else { (0, 2) };
        Some(c.exchange(
            &[SendBuf {
                peer: to,
                data: &data,
            }],
            &mut [RecvBuf {
                peer: from,
                buf: &mut buf,
            }],
        ))
    });
    for r in out.into_iter().flatten() {
        assert!(
            matches!(r, Err(CommError::PeerLost { peer: 2, .. })),
            "{r:?}"
        );
    }
}

/// A rank far later than the timeout (busy, not dead: its liveness thread keeps answering)
/// is waited for. Ranks that really stop are tested with processes in `tests/liveness.rs`.
#[test]
fn late_rank_is_waited_for() {
    let timeout = Duration::from_millis(300);
    let out = run_tcp(7, timeout, |c| {
        c.barrier().unwrap();
        if c.rank() == 4 {
            thread::sleep(timeout * 6);
        }
        let t = Instant::now();
        let all = c.all_gather(&[c.rank() as u8]).unwrap();
        let mut buf = [0u8; 1];
        // Exchange partners that are not tree neighbours: 3 accepts a link from a late 0.
        if c.rank() == 0 {
            thread::sleep(timeout * 6);
        }
        match c.rank() {
            0 => c
                .exchange(
                    &[SendBuf {
                        peer: 3,
                        data: b"z",
                    }],
                    &mut [],
                )
                .unwrap(),
            3 => c
                .exchange(
                    &[],
                    &mut [RecvBuf {
                        peer: 0,
                        buf: &mut buf,
                    }],
                )
                .unwrap(),
            _ => c.exchange(&[], &mut []).unwrap(),
        }
        c.barrier().unwrap();
        (all, t.elapsed(), buf)
    });
    for (rank, (all, took, buf)) in out.into_iter().enumerate() {
        assert_eq!(all, (0..7u8).map(|r| vec![r]).collect::<Vec<_>>());
        if rank != 0 && rank != 4 {
            assert!(took >= timeout * 6, "rank {rank} waited only {took:?}");
        }
        if rank == 3 {
            assert_eq!(&buf, b"z");
        }
    }
}

#[test]
fn mismatched_operations_are_reported() {
    // A rank that finishes joining first may detect the mismatch while others still join.
    let out = run_tcp_try(4, T, |c| {
        c.and_then(|c| {
            if c.rank() == 0 {
                c.barrier()
            } else {
                c.all_gather(b"x").map(|_| ())
            }
        })
        .err()
    });
    for (rank, e) in out.iter().enumerate() {
        assert!(
            matches!(e, Some(CommError::Mismatch { .. })),
            "rank {rank}: {e:?}"
        );
    }
    // Ranks that got what they expected learn of the mismatch at their next call.
    let out = run_tcp_try(3, T, |c| {
        c.and_then(|c| {
            c.broadcast(if c.rank() == 2 { 1 } else { 0 }, b"x")
                .and_then(|_| c.barrier())
        })
        .err()
    });
    assert!(
        out.iter()
            .all(|e| matches!(e, Some(CommError::Mismatch { .. }))),
        "{out:?}"
    );
}

/// Two live ranks waiting for each other with nothing in flight (a collective on one, a data
/// exchange expecting a message on the other) are a mismatch within moments, not a wait
/// for ever: the liveness timeout here (an hour) never strikes.
#[test]
fn ranks_waiting_for_each_other_are_a_mismatch_not_a_hang() {
    let t0 = Instant::now();
    let out = run_tcp(2, Duration::from_secs(3600), |c| {
        if c.rank() == 0 {
            c.barrier()
        } else {
            let mut buf = [0u8; 8];
            c.exchange(
                &[],
                &mut [RecvBuf {
                    peer: 0,
                    buf: &mut buf,
                }],
            )
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    for (rank, r) in out.iter().enumerate() {
        match r {
            Err(CommError::Mismatch { detail, .. }) => {
                assert!(detail.contains("waits for"), "rank {rank}: {detail}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn exchange_size_mismatch_never_overflows() {
    let out = run_tcp(2, T, |c| {
        let mut small = vec![0u8; 50];
        let r = if c.rank() == 0 {
            c.exchange(
                &[SendBuf {
                    peer: 1,
                    data: &[7u8; 100],
                }],
                &mut [],
            )
        } else {
            c.exchange(
                &[],
                &mut [RecvBuf {
                    peer: 0,
                    buf: &mut small,
                }],
            )
        };
        // The sender may finish before the receiver objects; it learns at the next call.
        r.and_then(|()| c.barrier())
    });
    for (rank, r) in out.iter().enumerate() {
        let e = r.as_ref().unwrap_err();
        assert!(matches!(e, CommError::Mismatch { .. }), "rank {rank}: {e}");
        assert!(e.to_string().contains("100 bytes"), "{e}");
    }
    // Fewer messages than expected: the sender moves on, the receiver notices.
    let out = run_tcp(2, Duration::from_secs(2), |c| {
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        let r = if c.rank() == 0 {
            c.exchange(
                &[SendBuf {
                    peer: 1,
                    data: b"abcd",
                }],
                &mut [],
            )
        } else {
            c.exchange(
                &[],
                &mut [
                    RecvBuf {
                        peer: 0,
                        buf: &mut a,
                    },
                    RecvBuf {
                        peer: 0,
                        buf: &mut b,
                    },
                ],
            )
        };
        r.and_then(|()| c.barrier())
    });
    assert!(
        matches!(out[1], Err(CommError::Mismatch { .. })),
        "{:?}",
        out[1]
    );
}

#[test]
fn workers_may_start_before_the_master() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = Duration::from_secs(10);
    let sums = thread::scope(|s| {
        let workers: Vec<_> = (1..3)
            .map(|r| {
                s.spawn(move || {
                    let c = TcpComm::connect(config(r, 3, port, t)).unwrap();
                    c.all_gather(&[r as u8]).unwrap()
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(300));
        let c = TcpComm::connect(config(0, 3, port, t)).unwrap();
        let mine = c.all_gather(&[0]).unwrap();
        let mut all = vec![mine];
        all.extend(workers.into_iter().map(|h| h.join().unwrap()));
        all
    });
    assert!(sums.iter().all(|a| a == &vec![vec![0], vec![1], vec![2]]));
}

#[test]
fn rendezvous_failures_are_clear() {
    // A rank that never shows up.
    let timeout = Duration::from_millis(800);
    let master = TcpMaster::bind(config(0, 3, 0, timeout)).unwrap();
    let port = master.port().unwrap();
    let (m, w) = thread::scope(|s| {
        let w = s.spawn(move || TcpComm::connect(config(1, 3, port, timeout)).unwrap_err());
        (master.accept().unwrap_err(), w.join().unwrap())
    });
    assert!(matches!(m, CommError::Timeout { peer: Some(2), .. }), "{m}");
    assert!(
        matches!(
            w,
            CommError::PeerLost { peer: 0, .. } | CommError::Timeout { .. }
        ),
        "{w}"
    );
    // Disagreeing world sizes.
    let master = TcpMaster::bind(config(0, 2, 0, T)).unwrap();
    let port = master.port().unwrap();
    let (m, w) = thread::scope(|s| {
        let w = s.spawn(move || TcpComm::connect(config(1, 3, port, T)).unwrap_err());
        (master.accept().unwrap_err(), w.join().unwrap())
    });
    assert!(m.to_string().contains("WORLD_SIZE=3"), "{m}");
    assert!(
        matches!(w, CommError::Transport { .. }) && w.to_string().contains("refused"),
        "{w}"
    );
    // Nobody listening.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t0 = Instant::now();
    let e = TcpComm::connect(config(1, 2, port, Duration::from_millis(300))).unwrap_err();
    assert!(matches!(e, CommError::Timeout { peer: Some(0), .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
}

/// Exchange partners that are not tree neighbours get a link on first use; if the partner is
/// gone by then, the error names it (connecting: refused at once; accepting: within the
/// timeout).
#[test]
fn exchange_with_a_vanished_partner_names_it() {
    let timeout = Duration::from_secs(1);
    for gone in [0, 3] {
        let out = run_tcp(4, timeout, |c| {
            c.barrier().unwrap();
            let me = c.rank();
            if me == gone {
                drop(c);
                return None;
            }
            thread::sleep(Duration::from_millis(100));
            let t = Instant::now();
            let mut buf = [0u8; 3];
            let r = match (me, gone) {
                (3, 0) => c.exchange(
                    &[],
                    &mut [RecvBuf {
                        peer: 0,
                        buf: &mut buf,
                    }],
                ),
                (0, 3) => c.exchange(
                    &[SendBuf {
                        peer: 3,
                        data: b"abc",
                    }],
                    &mut [],
                ),
                _ => return None,
            };
            Some((r, t.elapsed()))
        });
        let (r, took) = out.into_iter().flatten().next().unwrap();
        let e = r.unwrap_err();
        match e {
            CommError::PeerLost { peer, .. } => assert_eq!(peer, gone),
            CommError::Timeout { peer, .. } => assert_eq!(peer, Some(gone)),
            other => panic!("{other}"),
        }
        assert!(took < Duration::from_millis(2500), "{took:?}");
    }
}

/// A frame header as the protocol writes it: magic, kind, operation, sequence, argument,
/// payload length.
fn raw_header(kind: u8, arg: u64, len: u64) -> Vec<u8> {
    let mut h = b"ZCK2".to_vec();
    h.extend_from_slice(&[kind, 0, 0, 0]);
    h.extend_from_slice(&0u64.to_le_bytes());
    h.extend_from_slice(&arg.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// Idle connections, garbage, a half-sent handshake and a registration declaring a huge
/// payload, all made before the ranks join, do not hold the rendezvous up: each connection
/// has its own deadline and they are served concurrently.
#[test]
fn rendezvous_is_not_stalled_by_idle_or_foreign_connections() {
    use std::io::Write;
    use std::net::TcpStream;
    let world = 4;
    let master = TcpMaster::bind(config(0, world, 0, Duration::from_secs(60))).unwrap();
    let port = master.port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut junk: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let mut garbage = TcpStream::connect(&addr).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut half = TcpStream::connect(&addr).unwrap();
    half.write_all(&raw_header(6, 1, 100)[..20]).unwrap();
    let mut huge = TcpStream::connect(&addr).unwrap();
    huge.write_all(&raw_header(6, 1, 1 << 40)).unwrap();
    junk.extend([garbage, half, huge]);
    let t0 = Instant::now();
    let out = thread::scope(|s| {
        let mut hs = vec![s.spawn(move || master.accept().map(|c| c.all_gather(&[0]).unwrap()))];
        for r in 1..world {
            hs.push(s.spawn(move || {
                let c = TcpComm::connect(config(r, world, port, Duration::from_secs(60)))?;
                Ok(c.all_gather(&[r as u8]).unwrap())
            }));
        }
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<Result<_, CommError>>>()
    });
    let took = t0.elapsed();
    for r in out {
        assert_eq!(r.unwrap(), vec![vec![0], vec![1], vec![2], vec![3]]);
    }
    // One connection at a time with a 5 s handshake wait each would take minutes.
    assert!(took < Duration::from_secs(15), "joining took {took:?}");
    drop(junk);
}

/// A process of another job (another job token) reaching the same master port is refused
/// with a clear error, and the job it tried to join goes on.
#[test]
fn rendezvous_refuses_another_job() {
    let world = 2;
    let t = Duration::from_secs(20);
    let cfg = |rank: usize, port: u16, token: &str| {
        let mut c = config(rank, world, port, t);
        c.job_token = token.to_owned();
        c
    };
    let master = TcpMaster::bind(cfg(0, 0, "job-a")).unwrap();
    let port = master.port().unwrap();
    let (foreign, ours) = thread::scope(|s| {
        let m = s.spawn(move || master.accept().map(|c| c.all_gather(b"a").unwrap()));
        let foreign = TcpComm::connect(cfg(1, port, "job-b")).unwrap_err();
        let ours = TcpComm::connect(cfg(1, port, "job-a")).map(|c| c.all_gather(b"b").unwrap());
        assert!(m.join().unwrap().is_ok());
        (foreign, ours)
    });
    assert!(
        matches!(foreign, CommError::Transport { rank: 1, .. })
            && foreign.to_string().contains("another job"),
        "{foreign}"
    );
    assert_eq!(ours.unwrap(), vec![b"a".to_vec(), b"b".to_vec()]);
}

/// Size caps are real: a master announcing a 1 TiB address table, and a peer broadcasting
/// more than `max_message_bytes`, are refused with a typed error before allocating.
#[test]
fn oversized_messages_are_refused_with_a_typed_error() {
    use std::io::{Read, Write};
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = fake.local_addr().unwrap().port();
    let server = thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut reg = [0u8; 32];
        s.read_exact(&mut reg).unwrap();
        s.write_all(&raw_header(7, 0, 1 << 40)).unwrap();
        thread::sleep(Duration::from_millis(500));
    });
    let e = TcpComm::connect(config(1, 2, port, Duration::from_secs(10))).unwrap_err();
    server.join().unwrap();
    assert!(
        matches!(
            e,
            CommError::TooLarge {
                peer: 0,
                declared: 1_099_511_627_776,
                ..
            }
        ),
        "{e}"
    );

    // Rank 1 accepts at most 1000 bytes per message; rank 0 broadcasts 5000.
    let master = TcpMaster::bind(config(0, 2, 0, T)).unwrap();
    let port = master.port().unwrap();
    let (m, w) = thread::scope(|s| {
        let w = s.spawn(move || {
            let mut cfg = config(1, 2, port, T);
            cfg.max_message_bytes = 1000;
            let c = TcpComm::connect(cfg)?;
            c.broadcast(0, b"").and_then(|_| c.barrier())
        });
        let m = master
            .accept()
            .and_then(|c| c.broadcast(0, &[7u8; 5000]).and_then(|_| c.barrier()));
        (m, w.join().unwrap())
    });
    assert_eq!(
        w.unwrap_err(),
        CommError::TooLarge {
            op: "broadcast",
            rank: 1,
            peer: 0,
            declared: 5000,
            limit: 1000
        }
    );
    assert!(
        matches!(m, Err(CommError::TooLarge { peer: 0, .. })),
        "rank 0 learns it too: {m:?}"
    );
}

/// With `deadline` set, a live rank later than it is a timeout naming it.
#[test]
fn optional_deadline_bounds_a_wait_on_a_live_rank() {
    let master_cfg = |r: usize, port: u16| {
        let mut c = config(r, 3, port, Duration::from_secs(20));
        // Only rank 0, which waits for rank 2 directly, has a deadline here: a rank with one
        // that waits for its parent would name the parent, which waits for the late rank.
        if r == 0 {
            c.deadline = Some(Duration::from_millis(400));
        }
        c
    };
    let master = TcpMaster::bind(master_cfg(0, 0)).unwrap();
    let port = master.port().unwrap();
    let out = thread::scope(|s| {
        let run = |c: Result<TcpComm, CommError>| {
            let c = c.unwrap();
            c.barrier().unwrap();
            if c.rank() == 2 {
                thread::sleep(Duration::from_millis(2000));
                return None;
            }
            let t = Instant::now();
            Some((c.barrier(), t.elapsed()))
        };
        let hs = vec![
            s.spawn(move || run(master.accept())),
            s.spawn(move || run(TcpComm::connect(master_cfg(1, port)))),
            s.spawn(move || run(TcpComm::connect(master_cfg(2, port)))),
        ];
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    let (r0, took) = out[0].as_ref().unwrap();
    assert!(
        matches!(r0, Err(CommError::Timeout { peer: Some(2), .. })),
        "{r0:?}"
    );
    assert!(*took < Duration::from_millis(1900), "{took:?}");
    let (r1, _) = out[1].as_ref().unwrap();
    assert!(
        matches!(r1, Err(CommError::Timeout { peer: Some(2), .. })),
        "rank 1 learns it too: {r1:?}"
    );
}
