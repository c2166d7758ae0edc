//! Reusing an agreed save plan while the structure is unchanged.
//!
//! The first save of a structure agrees on it in full: every rank learns every rank's layout
//! hash and the distinct layouts, and builds the [`SavePlan`]. A later save checks that
//! nothing changed with one constant-size message per rank ([`CHECK_LEN`] bytes): the digest
//! of the plan the rank holds and the hash of its current layout. The plan is reused only
//! when every rank holds a plan with the same digest and every rank's current layout hash is
//! the one that plan was built from; since the digest covers the whole vector of layout
//! hashes (and the world size and options), that means the gathered layouts are exactly the
//! ones the plan was built from. Every rank decides from the same gathered messages with the
//! same rule, so all ranks reach the same decision. Otherwise the ranks fall back to the full
//! agreement, whose first round (every rank's layout hash) the check already delivered.

use std::sync::Arc;

use super::layout::LayoutDecodeError;
use super::save::{SavePlan, SavePlanOptions};

/// Bytes each rank contributes to the check: its plan digest, then its layout hash.
pub const CHECK_LEN: usize = 32;

/// A plan the ranks agreed on, with what it was built from.
#[derive(Debug, Clone)]
pub struct CachedPlan {
    world: usize,
    opts: SavePlanOptions,
    hashes: Vec<[u8; 16]>,
    digest: [u8; 16],
    plan: Arc<SavePlan>,
}

/// The digest of a plan built from `hashes` (every rank's layout hash, by rank) under
/// `opts`: never all zeros (zeros mean "no plan").
fn plan_digest(world: usize, opts: &SavePlanOptions, hashes: &[[u8; 16]]) -> [u8; 16] {
    let mut bytes = Vec::with_capacity(64 + hashes.len() * 16);
    bytes.extend_from_slice(b"zarrckpt-plan-1\0");
    bytes.extend_from_slice(&(world as u64).to_le_bytes());
    // Debug covers every option field, present and future.
    bytes.extend_from_slice(format!("{opts:?}").as_bytes());
    bytes.push(0);
    for h in hashes {
        bytes.extend_from_slice(h);
    }
    let mut d = xxhash_rust::xxh3::xxh3_128(&bytes).to_le_bytes();
    if d == [0; 16] {
        d[0] = 1;
    }
    d
}

impl CachedPlan {
    /// A plan the ranks just agreed on: `hashes` holds every rank's layout hash, by rank.
    #[must_use]
    pub fn new(opts: SavePlanOptions, hashes: Vec<[u8; 16]>, plan: Arc<SavePlan>) -> Self {
        let world = hashes.len();
        let digest = plan_digest(world, &opts, &hashes);
        CachedPlan {
            world,
            opts,
            hashes,
            digest,
            plan,
        }
    }

    /// True when this plan was built for this world size and these options; a plan for
    /// another world or other options is never offered for reuse.
    #[must_use]
    pub fn fits(&self, world: usize, opts: &SavePlanOptions) -> bool {
        self.world == world && self.opts == *opts
    }

    /// The plan's digest (covers world size, options and every rank's layout hash).
    #[must_use]
    pub fn digest(&self) -> [u8; 16] {
        self.digest
    }

    /// The plan.
    #[must_use]
    pub fn plan(&self) -> &Arc<SavePlan> {
        &self.plan
    }
}

/// This rank's contribution to the check: the digest of the plan it offers for reuse (zeros
/// for none) and the hash of its current layout.
#[must_use]
pub fn check_message(offered: Option<&CachedPlan>, layout_hash: [u8; 16]) -> [u8; CHECK_LEN] {
    let mut m = [0u8; CHECK_LEN];
    if let Some(c) = offered {
        m[..16].copy_from_slice(&c.digest);
    }
    m[16..].copy_from_slice(&layout_hash);
    m
}

/// What the check decided.
#[derive(Debug, Clone)]
pub enum CheckOutcome<'c> {
    /// Every rank holds the same plan and no layout changed: reuse this one.
    Unchanged(&'c CachedPlan),
    /// Something changed (or some rank has no plan): agree in full. Carries every rank's
    /// current layout hash, the first round of the full agreement.
    Changed {
        /// Every rank's layout hash, by rank.
        hashes: Vec<[u8; 16]>,
    },
}

/// Decides from every rank's [`check_message`] (indexed by rank) whether `offered` (this
/// rank's plan, the same `offered` that went into its message) can be reused. Every rank
/// reaches the same decision from the same messages.
///
/// # Errors
/// [`LayoutDecodeError`] naming the rank whose message is not [`CHECK_LEN`] bytes.
pub fn decide<'c>(
    offered: Option<&'c CachedPlan>,
    msgs: &[&[u8]],
) -> Result<CheckOutcome<'c>, LayoutDecodeError> {
    let mut digests = Vec::with_capacity(msgs.len());
    let mut hashes = Vec::with_capacity(msgs.len());
    for (rank, m) in msgs.iter().enumerate() {
        if m.len() != CHECK_LEN {
            return Err(LayoutDecodeError {
                rank,
                at: 0,
                reason: format!(
                    "plan check message is {} bytes, expected {CHECK_LEN}",
                    m.len()
                ),
            });
        }
        let (d, h) = m.split_at(16);
        digests.push(<[u8; 16]>::try_from(d).unwrap_or_default());
        hashes.push(<[u8; 16]>::try_from(h).unwrap_or_default());
    }
    Ok(match offered {
        Some(c)
            if c.world == msgs.len()
                && digests.iter().all(|d| *d == c.digest)
                && hashes == c.hashes =>
        {
            CheckOutcome::Unchanged(c)
        }
        _ => CheckOutcome::Changed { hashes },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Arc<SavePlan> {
        Arc::new(SavePlan {
            tensors: Vec::new(),
            bytes_per_rank: vec![0; 3],
        })
    }

    fn cached(hashes: &[[u8; 16]]) -> CachedPlan {
        CachedPlan::new(SavePlanOptions::default(), hashes.to_vec(), plan())
    }

    fn run<'c>(offers: &[Option<&'c CachedPlan>], layouts: &[[u8; 16]]) -> Vec<CheckOutcome<'c>> {
        let msgs: Vec<[u8; CHECK_LEN]> = offers
            .iter()
            .zip(layouts)
            .map(|(o, h)| check_message(*o, *h))
            .collect();
        let refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
        offers.iter().map(|o| decide(*o, &refs).unwrap()).collect()
    }

    #[test]
    fn reuses_only_when_every_rank_is_unchanged() {
        let h = [[1u8; 16], [2; 16], [1; 16]];
        let c = cached(&h);
        let all = [Some(&c), Some(&c), Some(&c)];
        assert!(
            run(&all, &h)
                .iter()
                .all(|o| matches!(o, CheckOutcome::Unchanged(p) if p.digest() == c.digest()))
        );
        // One rank's layout changed: everyone agrees in full, with the new hashes.
        let mut h2 = h;
        h2[1] = [9; 16];
        let out = run(&all, &h2);
        for o in &out {
            assert!(matches!(o, CheckOutcome::Changed { hashes } if *hashes == h2));
        }
        // One rank has no plan (a new process): everyone agrees in full.
        let out = run(&[Some(&c), None, Some(&c)], &h);
        assert!(
            out.iter()
                .all(|o| matches!(o, CheckOutcome::Changed { .. }))
        );
        // Two ranks swapped layouts: the per-rank hashes differ from the plan's.
        let swapped = [h[1], h[0], h[2]];
        assert!(
            run(&all, &swapped)
                .iter()
                .all(|o| matches!(o, CheckOutcome::Changed { .. }))
        );
        // Nobody has a plan.
        assert!(
            run(&[None, None, None], &h)
                .iter()
                .all(|o| matches!(o, CheckOutcome::Changed { .. }))
        );
    }

    #[test]
    fn other_options_or_world_never_match() {
        let h = [[1u8; 16], [2; 16]];
        let a = cached(&h);
        let opts = SavePlanOptions {
            balance_replicas: false,
            ..SavePlanOptions::default()
        };
        let b = CachedPlan::new(opts, h.to_vec(), plan());
        assert_ne!(a.digest(), b.digest());
        assert!(!b.fits(2, &SavePlanOptions::default()));
        assert!(a.fits(2, &SavePlanOptions::default()));
        assert!(!a.fits(3, &SavePlanOptions::default()));
        // Ranks holding plans for different options do not reuse either.
        let out = run(&[Some(&a), Some(&b)], &h);
        assert!(
            out.iter()
                .all(|o| matches!(o, CheckOutcome::Changed { .. }))
        );
        // A malformed message names its rank.
        let m = check_message(Some(&a), h[0]);
        let e = decide(Some(&a), &[&m, &m[..5]]).unwrap_err();
        assert_eq!(e.rank, 1);
    }
}
