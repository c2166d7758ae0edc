//! Asynchronous saves: staged state is what gets saved, errors surface on wait and commit
//! nothing, staging memory is bounded and reused, a second save waits or fails.

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::state::{RankState, check};
use zarrckpt::comm::run_local;
use zarrckpt::{
    Checkpoint, Communicator, DType, Error, IfBusy, Region, SaveOptions, SaveRequest, Saver,
    SaverOptions, ShardedTensor, TensorKey,
};

const TIMEOUT: Duration = Duration::from_secs(60);

fn shared(comm: zarrckpt::LocalComm) -> Arc<dyn Communicator> {
    Arc::new(comm)
}

#[test]
fn mutations_after_return_do_not_change_what_is_saved() {
    let tmp = tempfile::tempdir().unwrap();
    for world in [1u64, 2, 3] {
        let dir = tmp.path().join(format!("w{world}"));
        run_local(world as usize, TIMEOUT, |comm| {
            let comm = shared(comm);
            let rank = comm.rank() as u64;
            let mut saver = Saver::new(Arc::clone(&comm));
            let mut state = RankState::new(world, rank, 1);
            let h = saver
                .save_async(&state.sharded().into(), &dir, &SaveOptions::default())
                .unwrap();
            // Training goes on at once: every byte the caller holds changes.
            state.scribble(0xEE);
            let rep = h.wait().unwrap();
            assert_eq!(rep.tensors, 5);
            assert!(!rep.plan_reused);
        });
        check(&dir, 1);
    }
}

#[test]
fn state_larger_than_the_cap_is_staged_in_rounds() {
    let tmp = tempfile::tempdir().unwrap();
    // Two tensors of 64 rows of 1 KiB, in blocks of 4 rows dealt out to 2 ranks: each rank
    // stages 16 chunks of 4 KiB (64 KiB) through two 8 KiB arenas.
    let cap: u64 = 16 << 10;
    let shape = [64u64, 256];
    let keys = ["model.many.a", "model.many.b"];
    let full =
        |k: usize, step: u64| common::tensor_bytes(k as u64 + 10 * step, &shape, DType::Float32);
    run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let opts = SaverOptions {
            staging_bytes: cap,
            copy_threads: 2,
            lower_priority: false,
            ..SaverOptions::default()
        };
        let mut saver = Saver::with_options(Arc::clone(&comm), opts);
        for step in 1..=3 {
            let mut bufs: Vec<(usize, Region, Vec<u8>)> = Vec::new();
            for k in 0..keys.len() {
                let whole = full(k, step);
                for b in (rank..16).step_by(2) {
                    let r = Region::new(vec![4 * b, 0], vec![4, 256]).unwrap();
                    bufs.push((k, r.clone(), common::cut(&whole, &shape, &r, 4)));
                }
            }
            let pieces: Vec<ShardedTensor<'_>> = bufs
                .iter()
                .map(|(k, r, b)| {
                    let key = TensorKey::new(keys[*k]).unwrap();
                    ShardedTensor::new(key, DType::Float32, shape.to_vec(), r.clone(), 0, b)
                        .unwrap()
                })
                .collect();
            let dir = tmp.path().join(format!("step{step}"));
            let h = saver
                .save_async(
                    &SaveRequest::from(&pieces[..]),
                    &dir,
                    &SaveOptions::default(),
                )
                .unwrap();
            assert_eq!(h.staged_bytes(), 64 << 10);
            drop(pieces);
            for (_, _, b) in &mut bufs {
                b.fill(step as u8);
            }
            h.wait().unwrap();
            assert_eq!(saver.staging_bytes_held() as u64, cap, "rank {rank}");
        }
    });
    for step in 1..=3 {
        let ck = Checkpoint::open(tmp.path().join(format!("step{step}"))).unwrap();
        for (k, key) in keys.iter().enumerate() {
            let got = ck.read_tensor(&TensorKey::new(*key).unwrap()).unwrap();
            assert!(got == full(k, step), "step {step}: `{key}` differs");
        }
    }
}

fn vm_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

#[test]
fn twenty_async_saves_keep_memory_flat() {
    let tmp = tempfile::tempdir().unwrap();
    let rss = Mutex::new(Vec::new());
    let held = Mutex::new(Vec::new());
    run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        // About 8 MiB per rank besides the small state: a big row-split tensor.
        let big: Vec<f32> = (0..(2u64 << 20)).map(|i| (i + rank) as f32).collect();
        let mut state = RankState::new(2, rank, 1);
        for step in 0..20u64 {
            let dir = tmp.path().join(format!("step{step}"));
            let mut pieces = state.sharded();
            pieces.push(
                zarrckpt::ShardedTensor::from_slice(
                    "model.big",
                    &[2, 2 << 20],
                    &[rank, 0],
                    &big,
                    &[1, 2 << 20],
                    0,
                )
                .unwrap(),
            );
            let h = saver
                .save_async(
                    &SaveRequest::from(&pieces[..]),
                    &dir,
                    &SaveOptions::default(),
                )
                .unwrap();
            drop(pieces);
            state.scribble(step as u8);
            let rep = h.wait().unwrap();
            assert_eq!(rep.plan_reused, step > 0);
            comm.barrier().unwrap();
            if rank == 0 {
                rss.lock().unwrap().push(vm_rss());
                held.lock().unwrap().push(saver.staging_bytes_held());
                // Keep the disk use flat too (not timed, not what is measured).
                if step > 0 {
                    std::fs::remove_dir_all(tmp.path().join(format!("step{}", step - 1))).unwrap();
                }
            }
            comm.barrier().unwrap();
        }
    });
    let rss = rss.into_inner().unwrap();
    let held = held.into_inner().unwrap();
    assert!(
        held.iter().all(|&h| h == held[0] && h >= 8 << 20),
        "{held:?}"
    );
    // After two saves everything is allocated; the rest may wobble by allocator noise only.
    let base = rss[2];
    let max = *rss[2..].iter().max().unwrap();
    assert!(
        max <= base + (6 << 20),
        "resident memory grew from {base} to {max} over 20 saves: {rss:?}"
    );
}

#[test]
fn errors_surface_on_wait_and_commit_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("not-a-checkpoint");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("precious.txt"), b"keep me").unwrap();
    let results = run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        let state = RankState::new(2, rank, 1);
        let h = saver
            .save_async(&state.sharded().into(), &dir, &SaveOptions::default())
            .unwrap();
        h.wait()
    });
    for (rank, r) in results.into_iter().enumerate() {
        let e = r.expect_err("saving over a directory that is not a checkpoint must fail");
        match (rank, &e) {
            (0, Error::Storage(_)) | (1, Error::RemoteFailure { rank: 0, .. }) => {}
            _ => panic!("rank {rank}: unexpected error {e}"),
        }
    }
    assert!(!dir.join("zarr.json").exists());
    assert_eq!(std::fs::read(dir.join("precious.txt")).unwrap(), b"keep me");

    // A failure after staging: rank 1's files vanish while its writer is at work.
    let dir2 = tmp.path().join("vanished");
    let results = run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        let gate = Arc::new(Gate::default());
        let g = Arc::clone(&gate);
        let opts = SaveOptions {
            progress: (rank == 1)
                .then(|| -> zarrckpt::save::Progress { Arc::new(move |_| g.wait()) }),
            ..SaveOptions::default()
        };
        let state = RankState::new(2, rank, 1);
        let h = saver
            .save_async(&state.sharded().into(), &dir2, &opts)
            .unwrap();
        if rank == 1 {
            gate.wait_reached();
            // Rank 0 may still be writing into the tree: retry until it is gone.
            while let Err(e) = std::fs::remove_dir_all(dir2.join("tensors")) {
                assert_eq!(e.kind(), std::io::ErrorKind::DirectoryNotEmpty, "{e}");
            }
            gate.release();
        }
        h.wait()
    });
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.is_err(),
            "rank {rank} must fail when rank 1 cannot make its files durable"
        );
    }
    assert!(
        matches!(results[1], Err(Error::Storage(_))),
        "{:?}",
        results[1]
    );
    assert!(!dir2.join("zarr.json").exists());
}

/// Blocks the background writer (from its progress callback) until released.
#[derive(Default)]
struct Gate {
    /// (reached, open)
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Gate {
    fn wait(&self) {
        let mut g = self.state.lock().unwrap();
        g.0 = true;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).unwrap();
        }
    }
    fn wait_reached(&self) {
        let mut g = self.state.lock().unwrap();
        while !g.0 {
            g = self.cv.wait(g).unwrap();
        }
    }
    fn release(&self) {
        self.state.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

#[test]
fn a_second_save_waits_or_fails_as_asked() {
    let tmp = tempfile::tempdir().unwrap();
    run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let gate = Arc::new(Gate::default());
        let g = Arc::clone(&gate);
        let slow = SaveOptions {
            progress: Some(Arc::new(move |_| g.wait())),
            ..SaveOptions::default()
        };
        let opts = SaverOptions {
            if_busy: IfBusy::Fail,
            ..SaverOptions::default()
        };
        let mut saver = Saver::with_options(Arc::clone(&comm), opts);
        let state = RankState::new(2, rank, 1);
        let first = saver
            .save_async(&state.sharded().into(), &tmp.path().join("a"), &slow)
            .unwrap();
        assert!(saver.is_busy() && !first.is_done());
        let e = saver
            .save_async(
                &state.sharded().into(),
                &tmp.path().join("b"),
                &SaveOptions::default(),
            )
            .unwrap_err();
        assert!(
            matches!(&e, Error::SaveInFlight { rank: r, .. } if *r == rank as usize),
            "{e}"
        );
        assert!(e.to_string().contains("still in flight"), "{e}");
        gate.release();
        first.wait().unwrap();
        assert!(!saver.is_busy());
    });
    check(&tmp.path().join("a"), 1);
    assert!(!tmp.path().join("b").exists());

    // Waiting: the second save starts once the first is done, and both commit.
    run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let gate = Arc::new(Gate::default());
        let g = Arc::clone(&gate);
        let slow = SaveOptions {
            progress: Some(Arc::new(move |_| g.wait())),
            ..SaveOptions::default()
        };
        let mut saver = Saver::new(Arc::clone(&comm));
        let s1 = RankState::new(2, rank, 1);
        let first = saver
            .save_async(&s1.sharded().into(), &tmp.path().join("c"), &slow)
            .unwrap();
        let releaser = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                gate.release();
            })
        };
        let s2 = RankState::new(2, rank, 2);
        let second = saver
            .save_async(
                &s2.sharded().into(),
                &tmp.path().join("d"),
                &SaveOptions::default(),
            )
            .unwrap();
        assert!(
            first.is_done(),
            "the second save started before the first was done"
        );
        first.wait().unwrap();
        assert!(second.wait().unwrap().plan_reused);
        releaser.join().unwrap();
    });
    check(&tmp.path().join("c"), 1);
    check(&tmp.path().join("d"), 2);
}

#[test]
fn over_tcp_the_background_owns_the_communicator_until_done() {
    use zarrckpt::comm::{TcpComm, TcpConfig, TcpMaster};
    let world = 3;
    let cfg = |rank: usize, port: u16| {
        let mut c = TcpConfig::new(rank, world, "127.0.0.1", port);
        c.timeout = TIMEOUT;
        c
    };
    let tmp = tempfile::tempdir().unwrap();
    let master = TcpMaster::bind(cfg(0, 0)).unwrap();
    let port = master.port().unwrap();
    let run = |comm: TcpComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        for step in 1..=3u64 {
            let mut state = RankState::new(world as u64, rank, step);
            let dir = tmp.path().join(format!("tcp{step}"));
            let h = saver
                .save_async(&state.sharded().into(), &dir, &SaveOptions::default())
                .unwrap();
            state.scribble(0x11);
            let rep = h.wait().unwrap();
            assert_eq!(rep.plan_reused, step > 1, "rank {rank} step {step}");
            // Free again for the caller's own collectives.
            comm.barrier().unwrap();
        }
    };
    std::thread::scope(|s| {
        let run = &run;
        let mut hs = vec![s.spawn(move || run(master.accept().unwrap()))];
        for r in 1..world {
            hs.push(s.spawn(move || run(TcpComm::connect(cfg(r, port)).unwrap())));
        }
        for h in hs {
            h.join().unwrap();
        }
    });
    for step in 1..=3 {
        check(&tmp.path().join(format!("tcp{step}")), step);
    }
}

/// Objects go with an asynchronous save: copied and agreed on during the call (the caller
/// may change them at once), written in the background, committed with the tensors; a common
/// value that differs between ranks fails the call itself on every rank (a planning error,
/// not left for `wait`) and commits nothing.
#[test]
fn objects_are_saved_asynchronously_with_the_tensors() {
    use zarrckpt::{ObjectSlot, ObjectValue, StateObject};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("objs");
    run_local(3, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        let state = RankState::new(3, rank, 1);
        let mut objects = [
            StateObject::common("iteration", serde_json::json!(1000)).unwrap(),
            StateObject::per_rank("rng", vec![rank as u8; 8]).unwrap(),
        ];
        let request = SaveRequest::from(state.sharded()).with_objects(objects.iter().cloned());
        let h = saver
            .save_async(&request, &dir, &SaveOptions::default())
            .unwrap();
        // Training goes on: the caller's objects change at once.
        objects[0] = StateObject::common("iteration", serde_json::json!(1001)).unwrap();
        h.wait().unwrap();
    });
    check(&dir, 1);
    let ck = Checkpoint::open(&dir).unwrap();
    let key = |k: &str| TensorKey::new(k).unwrap();
    assert_eq!(
        ck.read_object(&key("iteration"), &ObjectSlot::Common)
            .unwrap(),
        ObjectValue::Json(serde_json::json!(1000))
    );
    for r in 0..3u64 {
        assert_eq!(
            ck.read_object(&key("rng"), &ObjectSlot::Rank(r)).unwrap(),
            ObjectValue::Bytes(vec![r as u8; 8])
        );
    }

    let bad = tmp.path().join("bad");
    let results = run_local(3, TIMEOUT, |comm| {
        let comm = shared(comm);
        let rank = comm.rank() as u64;
        let mut saver = Saver::new(Arc::clone(&comm));
        let state = RankState::new(3, rank, 1);
        let objects = [StateObject::common("iteration", serde_json::json!(rank)).unwrap()];
        let request = SaveRequest::from(state.sharded()).with_objects(objects);
        // A planning error: returned by the call itself, not left for `wait`.
        saver
            .save_async(&request, &bad, &SaveOptions::default())
            .map(|_| ())
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::ObjectPlan(_) | Error::RemoteFailure { .. }),
            "{e}"
        );
        assert!(e.to_string().contains("iteration"), "{e}");
    }
    assert!(Checkpoint::open(&bad).is_err(), "nothing committed");
}

#[test]
fn flat_pieces_save_through_a_saver() {
    // Three ranks hold uneven flat ranges of a [5, 7] tensor (cut inside rows), saved with
    // `Saver::save` and `Saver::save_async`; the whole tensor reads back bit-exactly.
    let tmp = tempfile::tempdir().unwrap();
    let shape = [5u64, 7];
    let whole: Vec<f32> = (0..35).map(|i| i as f32 * 1.5 - 3.0).collect();
    let cuts = [0u64, 9, 23, 35];
    for asynchronous in [false, true] {
        let dir = tmp.path().join(format!("flat-{asynchronous}"));
        run_local(3, TIMEOUT, |comm| {
            let comm = shared(comm);
            let r = comm.rank();
            let (a, b) = (cuts[r], cuts[r + 1]);
            let mine = &whole[a as usize..b as usize];
            let piece = ShardedTensor::from_flat_slice("w", &shape, a..b, mine, 0).unwrap();
            let mut saver = Saver::new(Arc::clone(&comm));
            if asynchronous {
                saver
                    .save_async(&vec![piece].into(), &dir, &SaveOptions::default())
                    .unwrap()
                    .wait()
                    .unwrap();
            } else {
                saver
                    .save(&vec![piece].into(), &dir, &SaveOptions::default())
                    .unwrap();
            }
        });
        let ck = Checkpoint::open(&dir).unwrap();
        let mut got = vec![0u8; 35 * 4];
        ck.read_region(
            &TensorKey::new("w").unwrap(),
            &Region::full(&shape),
            &mut got,
        )
        .unwrap();
        let want: Vec<u8> = whole.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(got, want, "asynchronous: {asynchronous}");
    }
}

#[test]
fn synchronous_saves_with_objects_reuse_the_plan() {
    // Every rank saves a request with objects, one of them with no objects at all: the
    // ranks stay in step, the second save reuses the plan, and the objects read back.
    let tmp = tempfile::tempdir().unwrap();
    let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
    for step in 0..2u64 {
        let dir = tmp.path().join(format!("s{step}"));
        let reps = run_local(3, TIMEOUT, |comm| {
            let comm = shared(comm);
            let r = comm.rank() as u64;
            let rows = &data[(4 * r) as usize..(4 * r + 4) as usize];
            let piece = ShardedTensor::new(
                TensorKey::new("w").unwrap(),
                DType::Float32,
                vec![3, 4],
                Region::new(vec![r, 0], vec![1, 4]).unwrap(),
                0,
                bytemuck_f32(rows),
            )
            .unwrap();
            let mut objects =
                vec![zarrckpt::StateObject::common("step", serde_json::json!(step)).unwrap()];
            if r == 1 {
                objects.clear();
                objects
                    .push(zarrckpt::StateObject::common("step", serde_json::json!(step)).unwrap());
                objects.push(zarrckpt::StateObject::common("note", vec![1u8, 1, 1]).unwrap());
            }
            if r == 2 {
                objects.clear();
            }
            let mut saver = Saver::new(Arc::clone(&comm));
            let request = SaveRequest::new()
                .with_tensors([piece])
                .with_objects(objects);
            let first = saver
                .save(&request, &dir.join("a"), &SaveOptions::default())
                .unwrap();
            let second = saver
                .save(&request, &dir.join("b"), &SaveOptions::default())
                .unwrap();
            (first.plan_reused, second.plan_reused)
        });
        for (first, second) in reps {
            assert!(!first && second);
        }
        for sub in ["a", "b"] {
            let ck = Checkpoint::open(dir.join(sub)).unwrap();
            let v = ck
                .read_object(
                    &TensorKey::new("step").unwrap(),
                    &zarrckpt::ObjectSlot::Common,
                )
                .unwrap();
            assert_eq!(v, zarrckpt::ObjectValue::Json(serde_json::json!(step)));
            let v = ck
                .read_object(
                    &TensorKey::new("note").unwrap(),
                    &zarrckpt::ObjectSlot::Common,
                )
                .unwrap();
            assert_eq!(v, zarrckpt::ObjectValue::Bytes(vec![1, 1, 1]));
        }
    }
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any bytes are valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The checkpoint manager over a saver: every step saved in the background with tensors and
/// objects; the commit, the `latest` pointer and retention follow in the background thread;
/// resuming loads the latest step's tensors and objects on every rank.
#[test]
fn manager_saves_steps_in_the_background_and_resumes() {
    use zarrckpt::{
        CheckpointManager, LoadOptions, LoadTarget, ManagerOptions, ObjectRequest, ObjectValue,
        StateObject,
    };
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("run");
    let results = run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let r = comm.rank() as u64;
        let opts = ManagerOptions {
            keep_last: 2,
            keep_every: None,
        };
        let mut m = CheckpointManager::new(&root, Saver::new(Arc::clone(&comm)), opts);
        for step in 1..=4u64 {
            let mut data: Vec<f32> = (0..6).map(|i| (step * 100 + r * 6 + i) as f32).collect();
            let piece =
                ShardedTensor::from_slice("w", &[4, 3], &[2 * r, 0], &data, &[2, 3], 0).unwrap();
            let request = SaveRequest::new().with_tensors([piece]).with_objects([
                StateObject::common("step", serde_json::json!(step)).unwrap(),
                StateObject::per_rank("rng", vec![(step + r) as u8; 4]).unwrap(),
            ]);
            let h = m
                .save_async(step, &request, &SaveOptions::default())
                .unwrap();
            drop(request);
            data.iter_mut().for_each(|x| *x = -1.0); // training goes on
            h.wait().unwrap();
        }
        assert_eq!(m.latest().unwrap(), Some(4));
        let kept: Vec<u64> = m.steps().unwrap().iter().map(|s| s.step).collect();
        assert_eq!(kept, vec![3, 4]);
        let mut whole = vec![0f32; 12];
        let mut t = [LoadTarget::from_slice("w", &[4, 3], &[0, 0], &mut whole, &[4, 3]).unwrap()];
        let requests = [
            ObjectRequest::common("step").unwrap(),
            ObjectRequest::rank("rng", r).unwrap(),
        ];
        let (step, report) = m
            .load_latest(&mut t, &requests, &LoadOptions::default())
            .unwrap()
            .unwrap();
        assert_eq!(step, 4);
        assert_eq!(
            report.objects,
            vec![
                Some(ObjectValue::Json(serde_json::json!(4))),
                Some(ObjectValue::Bytes(vec![(4 + r) as u8; 4]))
            ]
        );
        drop(t);
        whole
    });
    let want: Vec<f32> = (0..12).map(|i| (400 + i) as f32).collect();
    for got in results {
        assert_eq!(got, want);
    }
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap(),
        "step-00000004\n"
    );
}
