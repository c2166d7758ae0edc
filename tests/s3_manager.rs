//! Asynchronous saves and the checkpoint manager on object-store URLs: against the in-memory
//! store (`memory://`, fast) and a real S3 server on loopback (SeaweedFS, started here; see
//! `tests/common/s3.rs`). An asynchronous save stages, then writes through the same remote
//! path as a synchronous save and commits through the pointer move; the manager keeps steps
//! as sub-prefixes with `latest`, deletes dropped steps only after the newer step committed,
//! and resumes from the latest committed step; an asynchronous save killed before its commit
//! leaves the previous step loadable.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::s3;
use common::state::{self, RankState};
use serde_json::json;
use zarrckpt::comm::run_local;
use zarrckpt::remote::{self, RemoteOptions, RemoteStore};
use zarrckpt::{
    CheckpointManager, Communicator, LoadOptions, LoadTarget, ManagerOptions, ObjectRequest,
    ObjectValue, SaveOptions, SaveRequest, Saver, ShardedTensor, StateObject,
};

const TIMEOUT: Duration = Duration::from_secs(120);

fn save_opts(ropts: &RemoteOptions, overwrite: bool) -> SaveOptions {
    SaveOptions {
        overwrite,
        remote: ropts.clone(),
        ..SaveOptions::default()
    }
}

fn shared(comm: zarrckpt::LocalComm) -> Arc<dyn Communicator> {
    Arc::new(comm)
}

/// The generations under the checkpoint at `url` (committed or not).
fn generations(url: &str, ropts: &RemoteOptions) -> Vec<String> {
    let store = RemoteStore::open(url, ropts).unwrap();
    let mut g: Vec<String> = store
        .list("generations")
        .unwrap()
        .into_iter()
        .filter_map(|(k, _)| k.split('/').nth(1).map(str::to_owned))
        .collect();
    g.dedup();
    g
}

/// Two ranks save asynchronously to `url` (the caller's buffers scribbled over as soon as
/// the call returns), then overwrite asynchronously: each commit is a new generation and a
/// pointer move, the old generation left in place (nothing is deleted during a save), and the
/// committed checkpoint reads back bit-identical; an existing checkpoint without `overwrite`
/// fails from `wait` with the URL's error, committing nothing.
fn async_round_trip(url: &str, ropts: &RemoteOptions) {
    let (first, again) = (save_opts(ropts, false), save_opts(ropts, true));
    let results = run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let mut saver = Saver::new(Arc::clone(&comm));
        for (step, opts) in [(3, &first), (4, &again)] {
            let mut st = RankState::new(2, comm.rank() as u64, step);
            let req = SaveRequest::new().with_tensors(st.sharded());
            let h = saver.save_async(&req, Path::new(url), opts)?;
            drop(req);
            st.scribble(0xAB); // training goes on at once
            let report = h.wait()?;
            assert!(report.chunks_written > 0 && report.data_bytes > 0);
        }
        let st = RankState::new(2, comm.rank() as u64, 5);
        let req = SaveRequest::new().with_tensors(st.sharded());
        let refused = saver
            .save_async(&req, Path::new(url), &first)
            .and_then(|h| h.wait());
        Ok::<_, zarrckpt::Error>(refused.map(|_| ()).map_err(|e| e.to_string()))
    });
    for r in results {
        let e = r.unwrap().unwrap_err();
        assert!(e.contains(url) && e.contains("already"), "{e}");
    }
    assert_eq!(
        generations(url, ropts).len(),
        2,
        "nothing deleted during a save"
    );
    let fetched = remote::fetch_url(url, ropts, None).unwrap();
    state::check(fetched.dir(), 4);
}

#[test]
fn memory_async_saves_commit_through_the_pointer() {
    async_round_trip("memory://h3-async/ckpt", &RemoteOptions::default());
}

#[test]
fn s3_async_saves_commit_through_the_pointer() {
    if s3::skipped("s3_async_saves_commit_through_the_pointer") {
        return;
    }
    async_round_trip(&s3::url("h3/async"), &s3::options());
}

/// The pieces and objects of `step` on rank `r` of 2.
fn step_data(step: u64, r: u64) -> Vec<f32> {
    (0..6).map(|i| (step * 100 + r * 6 + i) as f32).collect()
}

fn step_objects(step: u64, r: u64) -> Vec<StateObject> {
    vec![
        StateObject::common("step", json!(step)).unwrap(),
        StateObject::per_rank("rng", vec![(step + r) as u8; 4]).unwrap(),
    ]
}

/// Two ranks run a manager over the root URL with keep-last 2: steps 1 to 4 in the background
/// (step 4 twice, the second replacing the first), step 5 synchronously. `latest` names step
/// 5, steps 4 and 5 remain (each with its committed generation only: the superseded one of
/// step 4 removed after the pointer moved), every object of steps 1 to 3 is gone, and a new
/// manager over the root resumes at step 5 with its tensors and objects on every rank.
fn manager_keeps_n_and_resumes(root: &str, ropts: &RemoteOptions) {
    let mopts = ManagerOptions {
        keep_last: 2,
        keep_every: None,
    };
    let opts = save_opts(ropts, true);
    let results = run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let r = comm.rank() as u64;
        let mut m = CheckpointManager::new(root, Saver::new(Arc::clone(&comm)), mopts)
            .with_remote_options(ropts.clone());
        for step in [1u64, 2, 3, 4, 4, 5] {
            let mut data = step_data(step, r);
            let piece =
                ShardedTensor::from_slice("w", &[4, 3], &[2 * r, 0], &data, &[2, 3], 0).unwrap();
            let request = SaveRequest::new()
                .with_tensors([piece])
                .with_objects(step_objects(step, r));
            if step == 5 {
                m.save(step, &request, &opts).unwrap();
            } else {
                let h = m.save_async(step, &request, &opts).unwrap();
                drop(request);
                data.iter_mut().for_each(|x| *x = -1.0); // training goes on
                h.wait().unwrap();
            }
        }
        assert_eq!(m.latest().unwrap(), Some(5));
        let steps = m.steps().unwrap();
        assert_eq!(
            steps
                .iter()
                .map(|s| (s.step, s.complete))
                .collect::<Vec<_>>(),
            vec![(4, true), (5, true)]
        );
        assert!(steps.iter().all(|s| s.bytes > 0));
        assert_eq!(m.latest_meta().unwrap().unwrap().0, 5);
        drop(m);

        // Resume: a new manager (a restarted job) finds step 5 and loads it.
        let mut m = CheckpointManager::new(root, Saver::new(Arc::clone(&comm)), mopts)
            .with_remote_options(ropts.clone());
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
        assert_eq!(step, 5);
        assert_eq!(
            report.objects,
            vec![
                Some(ObjectValue::Json(json!(5))),
                Some(ObjectValue::Bytes(vec![(5 + r) as u8; 4]))
            ]
        );
        drop(t);
        whole
    });
    let want: Vec<f32> = (0..12).map(|i| (500 + i) as f32).collect();
    for got in results {
        assert_eq!(got, want);
    }
    let store = RemoteStore::open(root, ropts).unwrap();
    let (latest, _) = store.get("latest").unwrap().unwrap();
    assert_eq!(&latest[..], b"step-00000005\n");
    let keys: Vec<String> = store
        .list("")
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    for gone in ["step-00000001/", "step-00000002/", "step-00000003/"] {
        assert!(
            !keys.iter().any(|k| k.starts_with(gone)),
            "{gone} left: {keys:?}"
        );
    }
    for step in [4, 5] {
        let url = format!("{root}/step-{step:08}");
        assert_eq!(generations(&url, ropts).len(), 1, "{url}");
    }
}

#[test]
fn memory_manager_keeps_the_last_n_steps_and_resumes() {
    manager_keeps_n_and_resumes("memory://h3-manager/run1", &RemoteOptions::default());
}

#[test]
fn s3_manager_keeps_the_last_n_steps_and_resumes() {
    if s3::skipped("s3_manager_keeps_the_last_n_steps_and_resumes") {
        return;
    }
    manager_keeps_n_and_resumes(&s3::url("h3/run1"), &s3::options());
}

/// The child of the crash test: saves step 1 of the manager at `$H3_CRASH_ROOT` (on the S3
/// endpoint `$H3_CRASH_ENDPOINT`) and commits it, then starts step 2 asynchronously; the
/// background writer's first progress report creates `$H3_CRASH_MARK` and blocks, so that the
/// parent kills this process (SIGKILL) after some of step 2's objects are written and before
/// its commit. Ignored (never a pass in an ordinary run): the crash test runs it with
/// `--ignored`; without those variables it returns at once.
#[test]
#[ignore = "the child process of s3_async_save_killed_before_commit_leaves_the_previous_step"]
fn crash_child() {
    let (Ok(root), Ok(endpoint), Ok(mark)) = (
        std::env::var("H3_CRASH_ROOT"),
        std::env::var("H3_CRASH_ENDPOINT"),
        std::env::var("H3_CRASH_MARK"),
    ) else {
        return;
    };
    let ropts = s3::options_for(&endpoint);
    let comm: Arc<dyn Communicator> = Arc::new(zarrckpt::LocalComm::single());
    let mopts = ManagerOptions {
        keep_last: 1,
        keep_every: None,
    };
    let mut m = CheckpointManager::new(&root, Saver::new(Arc::clone(&comm)), mopts)
        .with_remote_options(ropts.clone());
    let st = RankState::new(1, 0, 1);
    let request = SaveRequest::new().with_tensors(st.sharded());
    m.save(1, &request, &save_opts(&ropts, true)).unwrap();
    let st = RankState::new(1, 0, 2);
    let request = SaveRequest::new().with_tensors(st.sharded());
    let opts = SaveOptions {
        progress: Some(Arc::new(move |_| {
            let _ = std::fs::write(&mark, b"writing");
            std::thread::sleep(Duration::from_secs(600));
        })),
        ..save_opts(&ropts, true)
    };
    let h = m.save_async(2, &request, &opts).unwrap();
    let _ = h.wait();
    panic!("the crash child was not killed");
}

/// An asynchronous manager save killed (SIGKILL) while writing, before its commit: the
/// previous step stays the latest and loads whole; the killed step is incomplete, and the next
/// committed save's retention removes it.
#[test]
fn s3_async_save_killed_before_commit_leaves_the_previous_step() {
    if s3::skipped("s3_async_save_killed_before_commit_leaves_the_previous_step") {
        return;
    }
    let ropts = s3::options();
    let root = s3::url("h3/crash");
    let tmp = tempfile::tempdir().unwrap();
    let mark = tmp.path().join("mark");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--ignored", "--nocapture"])
        .env("H3_CRASH_ROOT", &root)
        .env("H3_CRASH_ENDPOINT", s3::shared().endpoint())
        .env("H3_CRASH_MARK", &mark)
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !mark.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the crash child ended before writing step 2: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the crash child wrote nothing in 120 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let comm: Arc<dyn Communicator> = Arc::new(zarrckpt::LocalComm::single());
    let mopts = ManagerOptions {
        keep_last: 1,
        keep_every: None,
    };
    let mut m = CheckpointManager::new(&root, Saver::new(Arc::clone(&comm)), mopts)
        .with_remote_options(ropts.clone());
    let steps = m.steps().unwrap();
    assert_eq!(
        steps
            .iter()
            .map(|s| (s.step, s.complete))
            .collect::<Vec<_>>(),
        vec![(1, true), (2, false)],
        "step 2 was killed before its commit"
    );
    assert!(steps[1].bytes > 0, "step 2 had written objects");
    assert_eq!(m.agreed_latest().unwrap(), Some(1));
    let fetched = remote::fetch_url(&format!("{root}/step-00000001"), &ropts, None).unwrap();
    state::check(fetched.dir(), 1);
    let report = zarrckpt::Checkpoint::open(fetched.dir())
        .unwrap()
        .verify(1, None)
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    // The next committed save removes step 1 (keep-last 1) and the killed step 2.
    let st = RankState::new(1, 0, 3);
    let request = SaveRequest::new().with_tensors(st.sharded());
    m.save_async(3, &request, &save_opts(&ropts, true))
        .unwrap()
        .wait()
        .unwrap();
    let steps = m.steps().unwrap();
    assert_eq!(
        steps
            .iter()
            .map(|s| (s.step, s.complete))
            .collect::<Vec<_>>(),
        vec![(3, true)]
    );
    let fetched = remote::fetch_url(&format!("{root}/step-00000003"), &ropts, None).unwrap();
    state::check(fetched.dir(), 3);
}

/// Device pieces (the simulated device: host memory behind the device interface) save to a
/// URL through the same staging and generation writer: rank 0 holds its rows on the device,
/// rank 1 in host memory; `Saver::save` (staged, as every save with device pieces) and
/// `Saver::save_async` both commit, and the tensor reads back whole.
#[test]
fn memory_saves_of_device_pieces_go_to_a_url() {
    use zarrckpt::device::{DevicePiece, DeviceView, SimDevice};
    use zarrckpt::{DType, Region, TensorKey};
    let shape = [8u64, 6];
    let full: Vec<u8> = (0..48u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let urls = ["memory://h3-device/sync", "memory://h3-device/async"];
    let results = run_local(2, TIMEOUT, |comm| {
        let comm = shared(comm);
        let r = comm.rank() as u64;
        let dev = Arc::new(SimDevice::new());
        let mut saver = Saver::new(Arc::clone(&comm));
        let rows = Region::new(vec![4 * r, 0], vec![4, 6]).unwrap();
        let mine = full[(r as usize * 96)..(r as usize + 1) * 96].to_vec();
        let key = TensorKey::new("w").unwrap();
        let request = if r == 0 {
            let base = dev.alloc(mine.len());
            dev.write(base, &mine).unwrap();
            // SAFETY: the allocation holds the rows' 96 bytes, contiguous.
            let view = unsafe { DeviceView::contiguous(base, rows.shape()) };
            let p = DevicePiece::new(key, DType::Float32, shape.to_vec(), rows, 0, view)?;
            SaveRequest::new().with_device_tensors(dev.clone(), [p])
        } else {
            let p = ShardedTensor::new(key, DType::Float32, shape.to_vec(), rows, 0, &mine)?;
            SaveRequest::new().with_tensors([p])
        };
        let opts = SaveOptions::default();
        saver.save(&request, Path::new(urls[0]), &opts)?;
        saver
            .save_async(&request, Path::new(urls[1]), &opts)?
            .wait()?;
        Ok::<_, zarrckpt::Error>(())
    });
    for r in results {
        r.unwrap();
    }
    for url in urls {
        let ck = zarrckpt::Checkpoint::open(url).unwrap();
        let got = ck.read_tensor(&TensorKey::new("w").unwrap()).unwrap();
        assert!(got == full, "{url}");
    }
}
