//! Multi-process self-test of [`TcpComm`]: every rank checks all-gather, broadcast, exchange
//! and barrier results. Run it through the launcher, e.g.
//!
//! ```text
//! zarrckpt launch -n 4 -- target/debug/examples/comm_selftest
//! ```
//!
//! or any `torchrun`-style launcher (it reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `ZARRCKPT_TIMEOUT_S`).
//!
//! `ZARRCKPT_SELFTEST_DIE_RANK=r` makes rank `r` exit abruptly (status 3) after joining and
//! before the first collective: the other ranks must then fail with an error naming rank `r`.
//!
//! Exit status: 0 on success, 1 on a communication error, 2 if the group cannot be joined, 3
//! for the rank told to die, 4 if data arrived wrong.

use std::process::ExitCode;

use zarrckpt::comm::{Communicator, RecvBuf, SendBuf, TcpComm};

/// Bytes rank `from` sends to rank `to` (or contributes, with `to` = `from`) in round `round`.
fn payload(from: usize, to: usize, round: usize, len: usize) -> Vec<u8> {
    let block: Vec<u8> = (0..251u8)
        .map(|i| i ^ (from as u8).wrapping_mul(17) ^ (to as u8).wrapping_mul(5) ^ round as u8)
        .collect();
    block.iter().copied().cycle().take(len).collect()
}

enum Failure {
    Comm(zarrckpt::CommError),
    Wrong(String),
}

impl From<zarrckpt::CommError> for Failure {
    fn from(e: zarrckpt::CommError) -> Self {
        Failure::Comm(e)
    }
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failure> {
    if ok {
        Ok(())
    } else {
        Err(Failure::Wrong(what()))
    }
}

fn run(c: &TcpComm) -> Result<(), Failure> {
    let (me, n) = (c.rank(), c.world_size());
    // Varied sizes, one rank contributing nothing.
    let size = |r: usize| if r == 1 { 0 } else { 1000 * (r + 1) + 7 };
    let all = c.all_gather(&payload(me, me, 0, size(me)))?;
    check(all.len() == n, || {
        format!("all_gather returned {} parts", all.len())
    })?;
    for (r, part) in all.iter().enumerate() {
        check(*part == payload(r, r, 0, size(r)), || {
            format!("all_gather part of rank {r} is wrong")
        })?;
    }
    for root in 0..n {
        let len = 100_000 * root;
        let got = c.broadcast(
            root,
            &payload(root, root, 1, if me == root { len } else { 3 }),
        )?;
        check(got == payload(root, root, 1, len), || {
            format!("broadcast from rank {root} is wrong")
        })?;
    }
    // All-to-all, 1 MiB per pair.
    let len = 1 << 20;
    let outgoing: Vec<Vec<u8>> = (0..n).map(|p| payload(me, p, 2, len)).collect();
    let sends: Vec<SendBuf<'_>> = outgoing
        .iter()
        .enumerate()
        .map(|(peer, data)| SendBuf { peer, data })
        .collect();
    let mut incoming: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; len]).collect();
    let mut recvs: Vec<RecvBuf<'_>> = incoming
        .iter_mut()
        .enumerate()
        .map(|(peer, buf)| RecvBuf { peer, buf })
        .collect();
    c.exchange(&sends, &mut recvs)?;
    for (p, buf) in incoming.iter().enumerate() {
        check(*buf == payload(p, me, 2, len), || {
            format!("exchange data from rank {p} is wrong")
        })?;
    }
    c.barrier()?;
    Ok(())
}

fn main() -> ExitCode {
    let comm = match TcpComm::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("selftest: cannot join: {e}");
            return ExitCode::from(2);
        }
    };
    let die = std::env::var("ZARRCKPT_SELFTEST_DIE_RANK")
        .ok()
        .and_then(|s| s.parse::<usize>().ok());
    if die == Some(comm.rank()) {
        eprintln!("selftest: rank {} exits abruptly as asked", comm.rank());
        std::process::exit(3);
    }
    match run(&comm) {
        Ok(()) => {
            println!("selftest ok: rank {} of {}", comm.rank(), comm.world_size());
            ExitCode::SUCCESS
        }
        Err(Failure::Comm(e)) => {
            eprintln!("selftest failed: {e}");
            ExitCode::from(1)
        }
        Err(Failure::Wrong(what)) => {
            eprintln!("selftest failed: {what}");
            ExitCode::from(4)
        }
    }
}
