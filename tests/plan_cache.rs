//! Repeated saves of the same structure reuse the agreed plan after a constant-size check;
//! any change on any rank (or other options) goes back to the full, validated agreement.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::state::{RankState, check};
use zarrckpt::comm::run_local;
use zarrckpt::plan::PlanError;
use zarrckpt::{Communicator, Error, Region, SaveOptions, Saver, ShardedTensor};

const TIMEOUT: Duration = Duration::from_secs(60);
const WORLD: usize = 4;

#[test]
fn unchanged_structure_reuses_the_plan_with_a_constant_size_check() {
    let tmp = tempfile::tempdir().unwrap();
    let reports = run_local(WORLD, TIMEOUT, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        let mut out = Vec::new();
        for step in 1..=3u64 {
            let state = RankState::new(WORLD as u64, rank, step);
            let dir = tmp.path().join(format!("s{step}"));
            let rep = if step == 2 {
                saver
                    .save_async(&state.sharded().into(), &dir, &SaveOptions::default())
                    .unwrap()
                    .wait()
                    .unwrap()
            } else {
                saver
                    .save(&state.sharded().into(), &dir, &SaveOptions::default())
                    .unwrap()
            };
            out.push((rep.plan_reused, rep.gathered_bytes));
        }
        out
    });
    for (rank, r) in reports.iter().enumerate() {
        assert!(!r[0].0, "rank {rank}: the first save agrees in full");
        assert!(r[1].0 && r[2].0, "rank {rank}: later saves reuse the plan");
        // One fixed-size message per rank, whatever the layouts' size.
        assert_eq!(r[1].1, r[2].1);
        assert!(r[1].1 <= 64 * WORLD as u64, "rank {rank}: {} bytes", r[1].1);
        assert!(r[0].1 > r[1].1, "rank {rank}: {:?}", r);
    }
    for step in 1..=3 {
        check(&tmp.path().join(format!("s{step}")), step);
    }
}

/// Rank `who` also holds an extra tensor of its own at this save.
fn with_extra<'a>(
    state: &'a RankState,
    extra: &'a [f32],
    rank: u64,
    who: u64,
) -> Vec<ShardedTensor<'a>> {
    let mut p = state.sharded();
    if rank == who {
        p.push(ShardedTensor::from_slice("rank.extra", &[4], &[0], extra, &[4], 0).unwrap());
    }
    p
}

#[test]
fn a_change_on_one_rank_falls_back_to_the_full_validated_agreement() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = [1f32, 2.0, 3.0, 4.0];
    run_local(WORLD, TIMEOUT, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        let opts = SaveOptions::default();
        let s1 = RankState::new(WORLD as u64, rank, 1);
        let r = saver
            .save(&s1.sharded().into(), &tmp.path().join("a"), &opts)
            .unwrap();
        assert!(!r.plan_reused);

        // Rank 3 adds a tensor: every rank agrees in full, and the new tensor is saved.
        let s2 = RankState::new(WORLD as u64, rank, 2);
        let r = saver
            .save(
                &with_extra(&s2, &extra, rank, 3).into(),
                &tmp.path().join("b"),
                &opts,
            )
            .unwrap();
        assert!(!r.plan_reused, "rank {rank}");
        assert_eq!(r.tensors, 6);
        // Unchanged again: reused.
        let r = saver
            .save(
                &with_extra(&s2, &extra, rank, 3).into(),
                &tmp.path().join("c"),
                &opts,
            )
            .unwrap();
        assert!(r.plan_reused, "rank {rank}");

        // Rank 1 now also claims rank 0's rows of `model.rows.weight` as main: an overlap,
        // which the full agreement still catches on every rank.
        let s3 = RankState::new(WORLD as u64, rank, 3);
        let mut bad = with_extra(&s3, &extra, rank, 3);
        let wide;
        if rank == 1 {
            wide = vec![0u8; 32 * 48 * 4];
            let i = bad
                .iter()
                .position(|p| p.key().as_str() == "model.rows.weight")
                .unwrap();
            bad[i] = ShardedTensor::new(
                bad[i].key().clone(),
                bad[i].dtype(),
                vec![64, 48],
                Region::new(vec![0, 0], vec![32, 48]).unwrap(),
                0,
                &wide,
            )
            .unwrap();
        }
        let e = saver
            .save_async(&bad.into(), &tmp.path().join("d"), &opts)
            .unwrap_err();
        assert!(
            matches!(&e, Error::Plan(PlanError::Overlap { key, .. }) if key.as_str() == "model.rows.weight"),
            "rank {rank}: {e}"
        );

        // Back to the valid structure: the plan cached before the bad save is not trusted
        // blindly, the check runs again and reuses it only if every rank is unchanged.
        let r = saver
            .save(
                &with_extra(&s3, &extra, rank, 3).into(),
                &tmp.path().join("e"),
                &opts,
            )
            .unwrap();
        assert!(r.plan_reused, "rank {rank}");

        // Other options: a plan for other options is never reused.
        let other = SaveOptions {
            balance_replicas: false,
            ..SaveOptions::default()
        };
        let r = saver
            .save(
                &with_extra(&s3, &extra, rank, 3).into(),
                &tmp.path().join("f"),
                &other,
            )
            .unwrap();
        assert!(!r.plan_reused, "rank {rank}");
    });
    check(&tmp.path().join("a"), 1);
    check(&tmp.path().join("b"), 2);
    check(&tmp.path().join("e"), 3);
    check(&tmp.path().join("f"), 3);
    assert!(!tmp.path().join("d").join("zarr.json").exists());
}

#[test]
fn a_new_saver_on_the_same_ranks_agrees_in_full() {
    // One rank restarted (a new process has no plan): everyone agrees in full.
    let tmp = tempfile::tempdir().unwrap();
    run_local(2, TIMEOUT, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank() as u64;
        let s = RankState::new(2, rank, 1);
        let mut a = Saver::new(Arc::clone(&comm));
        a.save(
            &s.sharded().into(),
            &tmp.path().join("x"),
            &SaveOptions::default(),
        )
        .unwrap();
        let mut fresh = if rank == 0 {
            Saver::new(Arc::clone(&comm))
        } else {
            a
        };
        let r = fresh
            .save(
                &s.sharded().into(),
                &tmp.path().join("y"),
                &SaveOptions::default(),
            )
            .unwrap();
        assert!(!r.plan_reused, "rank {rank}");
    });
    check(&tmp.path().join("y"), 1);
}
