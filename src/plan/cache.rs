//! Reusing an agreed save plan while the structure is unchanged.
//!
//! The first save of a structure agrees on it in full (the world's description, every rank's
//! plan derived from it). A later save checks that nothing changed with one all-reduce of a
//! constant-size message ([`CHECK_LEN`] bytes): whether the rank's own description is the one
//! its cached plan was built from, and the digest of the world's description that plan came
//! from. The reduction keeps "unchanged" only when every rank says so with the same digest;
//! since each rank's description is part of the world's, every rank's being unchanged means
//! the world's is, and the plans every rank holds are the ones a full agreement would build.
//! All ranks receive the same reduced message and reach the same decision.

use std::sync::Arc;

use super::ruled::RankPlan;
use super::save::SavePlanOptions;

/// Bytes each rank contributes to the check: a flag, then a digest.
pub const CHECK_LEN: usize = 17;

/// A plan the ranks agreed on, with what it was built from.
#[derive(Debug, Clone)]
pub struct CachedPlan {
    world: usize,
    opts: SavePlanOptions,
    /// Hash of this rank's own description.
    own: [u8; 16],
    /// Digest of the world's description (never all zeros).
    digest: [u8; 16],
    plan: Arc<RankPlan>,
    balance: f64,
}

/// The digest of a world's description under `opts`: never all zeros (zeros mean "no plan").
#[must_use]
pub fn world_digest(world: usize, opts: &SavePlanOptions, summary: &[u8]) -> [u8; 16] {
    let mut bytes = Vec::with_capacity(64 + summary.len());
    bytes.extend_from_slice(b"zarrckpt-plan-2\0");
    bytes.extend_from_slice(&(world as u64).to_le_bytes());
    // Debug covers every option field, present and future.
    bytes.extend_from_slice(format!("{opts:?}").as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(summary);
    let mut d = xxhash_rust::xxh3::xxh3_128(&bytes).to_le_bytes();
    if d == [0; 16] {
        d[0] = 1;
    }
    d
}

impl CachedPlan {
    /// A plan the ranks just agreed on: `own` is the hash of this rank's description,
    /// `digest` the [`world_digest`] of the world's, `balance` the write balance reported.
    #[must_use]
    pub fn new(
        world: usize,
        opts: SavePlanOptions,
        own: [u8; 16],
        digest: [u8; 16],
        plan: Arc<RankPlan>,
        balance: f64,
    ) -> Self {
        CachedPlan {
            world,
            opts,
            own,
            digest,
            plan,
            balance,
        }
    }

    /// True when this plan was built for this world size and these options; a plan for
    /// another world or other options is never offered for reuse.
    #[must_use]
    pub fn fits(&self, world: usize, opts: &SavePlanOptions) -> bool {
        self.world == world && self.opts == *opts
    }

    /// The digest of the world's description the plan was built from.
    #[must_use]
    pub fn digest(&self) -> [u8; 16] {
        self.digest
    }

    /// The plan.
    #[must_use]
    pub fn plan(&self) -> &Arc<RankPlan> {
        &self.plan
    }

    /// The write balance of the agreed plan.
    #[must_use]
    pub fn balance(&self) -> f64 {
        self.balance
    }
}

/// This rank's contribution to the check: 1 and the plan's digest when it offers a plan built
/// from its current description (`own`), else 0 and zeros.
#[must_use]
pub fn check_message(offered: Option<&CachedPlan>, own: [u8; 16]) -> [u8; CHECK_LEN] {
    let mut m = [0u8; CHECK_LEN];
    if let Some(c) = offered.filter(|c| c.own == own) {
        m[0] = 1;
        m[1..].copy_from_slice(&c.digest);
    }
    m
}

/// Combines two check messages (associative and commutative): unchanged only when both are,
/// with the same digest.
///
/// # Errors
/// When a message is not [`CHECK_LEN`] bytes.
pub fn merge_checks(a: &[u8], b: &[u8]) -> Result<Vec<u8>, String> {
    if a.len() != CHECK_LEN || b.len() != CHECK_LEN {
        return Err(format!(
            "plan check message of {} and {} bytes, expected {CHECK_LEN}",
            a.len(),
            b.len()
        ));
    }
    if a == b && a[0] == 1 {
        Ok(a.to_vec())
    } else {
        Ok(vec![0u8; CHECK_LEN])
    }
}

/// Whether the reduced check lets `offered` be reused.
#[must_use]
pub fn reusable<'c>(offered: Option<&'c CachedPlan>, reduced: &[u8]) -> Option<&'c CachedPlan> {
    offered.filter(|c| reduced.len() == CHECK_LEN && reduced[0] == 1 && reduced[1..] == c.digest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::SavePlan;
    use crate::plan::save::RankTasks;

    fn cached(own: u8, digest: u8) -> CachedPlan {
        let plan = Arc::new(RankPlan {
            plan: SavePlan {
                tensors: Vec::new(),
                bytes_per_rank: Vec::new(),
            },
            tasks: RankTasks::default(),
            bytes: 0,
            general: 0,
        });
        CachedPlan::new(
            2,
            SavePlanOptions::default(),
            [own; 16],
            [digest; 16],
            plan,
            1.0,
        )
    }

    fn reduce(msgs: &[[u8; CHECK_LEN]]) -> Vec<u8> {
        msgs[1..]
            .iter()
            .fold(msgs[0].to_vec(), |a, b| merge_checks(&a, b).unwrap())
    }

    #[test]
    fn reuses_only_when_every_rank_is_unchanged() {
        let (a, b) = (cached(1, 7), cached(2, 7));
        let same = reduce(&[
            check_message(Some(&a), [1; 16]),
            check_message(Some(&b), [2; 16]),
        ]);
        assert!(reusable(Some(&a), &same).is_some());
        assert!(reusable(Some(&b), &same).is_some());
        // One rank's description changed.
        let changed = reduce(&[
            check_message(Some(&a), [1; 16]),
            check_message(Some(&b), [3; 16]),
        ]);
        assert!(reusable(Some(&a), &changed).is_none());
        // One rank has no plan (a new process).
        let fresh = reduce(&[
            check_message(Some(&a), [1; 16]),
            check_message(None, [2; 16]),
        ]);
        assert!(reusable(Some(&a), &fresh).is_none());
        // Plans of different worlds.
        let c = cached(2, 8);
        let mixed = reduce(&[
            check_message(Some(&a), [1; 16]),
            check_message(Some(&c), [2; 16]),
        ]);
        assert!(reusable(Some(&a), &mixed).is_none());
        assert!(merge_checks(&same, &same[..3]).is_err());
    }

    #[test]
    fn other_options_or_world_never_match() {
        let opts = SavePlanOptions {
            balance_replicas: false,
            ..SavePlanOptions::default()
        };
        assert_ne!(
            world_digest(2, &opts, b"s"),
            world_digest(2, &SavePlanOptions::default(), b"s")
        );
        assert_ne!(world_digest(3, &opts, b"s"), world_digest(2, &opts, b"s"));
        let a = cached(1, 7);
        assert!(a.fits(2, &SavePlanOptions::default()));
        assert!(!a.fits(3, &SavePlanOptions::default()));
        assert!(!a.fits(2, &opts));
    }
}
