//! The collective verdict on a freshly built plan: every rank's refusal (or none) and the
//! figures every rank needs from the others, agreed in one all-reduce, so a refusal found by
//! one rank alone (an engine rank's own buffers) is returned on every rank before any byte
//! moves.

use serde::{Deserialize, Serialize};

use super::error::TransferError;
use super::rank::RankPlan;
use crate::comm::{CommError, Communicator};

/// What the ranks agreed.
#[derive(Debug)]
pub(super) struct Verdict {
    /// The largest number of peers of any rank.
    pub fan: u64,
    /// Bytes sent by the busiest sender.
    pub busiest: u64,
    /// Bytes sent by all.
    pub total: u64,
    /// The refusal of the lowest refusing rank, if any.
    pub error: Option<TransferError>,
}

/// A refusal as it travels.
#[derive(Serialize, Deserialize)]
enum Refusal {
    Engine {
        rank: usize,
        global: usize,
        key: String,
        msg: String,
    },
    Other(String),
}

const HEAD: usize = 32;

fn word(b: &[u8], i: usize) -> u64 {
    b.get(i * 8..i * 8 + 8)
        .and_then(|w| <[u8; 8]>::try_from(w).ok())
        .map_or(0, u64::from_le_bytes)
}

fn merge(a: &[u8], b: &[u8]) -> Result<Vec<u8>, String> {
    if a.len() < HEAD || b.len() < HEAD {
        return Err(format!(
            "verdict of {} and {} bytes, at least {HEAD}",
            a.len(),
            b.len()
        ));
    }
    // The refusal of the lower rank (u64::MAX: none) wins.
    let (ra, rb) = (word(a, 3), word(b, 3));
    let mut out = if ra <= rb { a.to_vec() } else { b.to_vec() };
    out[..8].copy_from_slice(&word(a, 0).max(word(b, 0)).to_le_bytes());
    out[8..16].copy_from_slice(&word(a, 1).max(word(b, 1)).to_le_bytes());
    out[16..24].copy_from_slice(&word(a, 2).saturating_add(word(b, 2)).to_le_bytes());
    Ok(out)
}

/// Agrees on every rank's outcome of [`super::rank::build_rank`].
///
/// # Errors
/// Communication errors.
pub(super) fn agree(
    comm: &dyn Communicator,
    built: &Result<RankPlan, TransferError>,
) -> Result<Verdict, CommError> {
    let mut mine = vec![0u8; HEAD];
    let mut refusal_rank = u64::MAX;
    match built {
        Ok(rp) => {
            let sent = rp.bytes_sent();
            mine[..8].copy_from_slice(&(rp.fan as u64).to_le_bytes());
            mine[8..16].copy_from_slice(&sent.to_le_bytes());
            mine[16..24].copy_from_slice(&sent.to_le_bytes());
        }
        Err(e) => {
            refusal_rank = comm.rank() as u64;
            let r = match e {
                TransferError::Engine {
                    rank,
                    global,
                    key,
                    msg,
                } => Refusal::Engine {
                    rank: *rank,
                    global: *global,
                    key: key.clone(),
                    msg: msg.clone(),
                },
                other => Refusal::Other(other.to_string()),
            };
            mine.extend(serde_json::to_vec(&r).unwrap_or_default());
        }
    }
    mine[24..32].copy_from_slice(&refusal_rank.to_le_bytes());
    let all = comm.all_reduce(&mine, &merge)?;
    let rank = word(&all, 3);
    let error = (rank != u64::MAX).then(|| {
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        match serde_json::from_slice::<Refusal>(all.get(HEAD..).unwrap_or_default()) {
            Ok(Refusal::Engine {
                rank,
                global,
                key,
                msg,
            }) => TransferError::Engine {
                rank,
                global,
                key,
                msg,
            },
            Ok(Refusal::Other(msg)) => TransferError::Peer { rank, msg },
            Err(e) => TransferError::Peer {
                rank,
                msg: format!("an unreadable refusal ({e})"),
            },
        }
    });
    Ok(Verdict {
        fan: word(&all, 0),
        busiest: word(&all, 1),
        total: word(&all, 2),
        error,
    })
}
