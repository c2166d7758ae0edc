//! Nested state dicts: a small GPT-like model in bf16 with fp32 master weights and two fp32
//! Adam moments (declared from their parameter's piece), plus objects (iteration, per-rank
//! RNG bytes, a per-pipeline-stage sharded object), saved as TP2 x PP2 x DP1 and loaded as
//! TP1 x PP1 x DP3 and TP4 x PP1 x DP1, every byte checked; in-process and TCP ranks. Every
//! test on a local directory, `memory://` and `s3://` (SeaweedFS; `tests/common/target.rs`).

mod common;

use std::path::Path;
use std::time::Duration;

use common::cut;
use serde_json::json;
use zarrckpt::StateError;
use zarrckpt::comm::{TcpComm, TcpConfig, TcpMaster, run_local};
use zarrckpt::{
    Checkpoint, Communicator, DType, Error, LoadOptions, LoadTarget, ObjectSlot, ObjectValue,
    Region, SaveOptions, ShardedTensor, StateDict, StateObject, StateValue, StrictMode, TensorKey,
    load_state, save_state,
};

const T: Duration = Duration::from_secs(60);
const H: u64 = 32;
const V: u64 = 64;
const LAYERS: u64 = 4;

/// One parameter: key, global shape, and the axis it is split along under TP (None:
/// replicated across TP).
struct Param {
    key: String,
    shape: Vec<u64>,
    tp_axis: Option<usize>,
    stage_of_2: u64,
}

fn model() -> Vec<Param> {
    let mut v = vec![Param {
        key: "embedding.word_embeddings.weight".into(),
        shape: vec![V, H],
        tp_axis: Some(0),
        stage_of_2: 0,
    }];
    for l in 0..LAYERS {
        let stage = l / (LAYERS / 2);
        v.push(Param {
            key: format!("decoder.layers.{l}.mlp.linear_fc1.weight"),
            shape: vec![4 * H, H],
            tp_axis: Some(0),
            stage_of_2: stage,
        });
        v.push(Param {
            key: format!("decoder.layers.{l}.mlp.linear_fc2.weight"),
            shape: vec![H, 4 * H],
            tp_axis: Some(1),
            stage_of_2: stage,
        });
        v.push(Param {
            key: format!("decoder.layers.{l}.input_layernorm.weight"),
            shape: vec![H],
            tp_axis: None,
            stage_of_2: stage,
        });
    }
    v.push(Param {
        key: "decoder.final_layernorm.weight".into(),
        shape: vec![H],
        tp_axis: None,
        stage_of_2: 1,
    });
    v
}

/// The four tensors of a parameter: (state-dict group, data type).
const KINDS: [(&str, DType); 4] = [
    ("model", DType::BFloat16),
    ("master", DType::Float32),
    ("exp_avg", DType::Float32),
    ("exp_avg_sq", DType::Float32),
];

/// The whole global tensor of a parameter's kind: fp32 master values derived from the key
/// and index, the bf16 weight their rounding, the moments functions of them.
fn global(p: &Param, kind: &str) -> Vec<u8> {
    let n: u64 = p.shape.iter().product();
    let seed = p
        .key
        .bytes()
        .fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
    let mut out = Vec::new();
    for i in 0..n {
        let m =
            ((seed.wrapping_add(i.wrapping_mul(2_654_435_761))) % 20_011) as f32 / 1000.0 - 10.0;
        match kind {
            "model" => out.extend_from_slice(&half::bf16::from_f32(m).to_le_bytes()),
            "master" => out.extend_from_slice(&m.to_le_bytes()),
            "exp_avg" => out.extend_from_slice(&(m * 0.1).to_le_bytes()),
            _ => out.extend_from_slice(&(m * m + 1e-8).to_le_bytes()),
        }
    }
    out
}

/// The piece of `p` a rank holds under TP x PP (DP replicas have replica ids), or None when
/// its stage does not hold `p`.
fn region_of(p: &Param, tp: u64, tp_rank: u64, pp: u64, pp_rank: u64) -> Option<Region> {
    let stage = if pp == 1 { 0 } else { p.stage_of_2 * pp / 2 };
    if stage != pp_rank {
        return None;
    }
    Some(match p.tp_axis {
        Some(axis) => common::piece(&p.shape, axis, tp, tp_rank),
        None => Region::full(&p.shape),
    })
}

fn rng_of(rank: usize) -> Vec<u8> {
    (0..64u8)
        .map(|i| i ^ (rank as u8).wrapping_mul(37))
        .collect()
}

/// Rank `rank` of a TP x PP x DP job (rank = (dp * PP + pp) * TP + tp) saves its state.
fn save_rank(comm: &dyn Communicator, dir: &Path, tp: u64, pp: u64) -> zarrckpt::Result<()> {
    let rank = comm.rank() as u64;
    let (tp_rank, pp_rank, dp_rank) = (rank % tp, (rank / tp) % pp, rank / (tp * pp));
    let params = model();
    // The bytes every piece points at, owned here.
    let mut held: Vec<(usize, Region, u32, Vec<Vec<u8>>)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        if let Some(region) = region_of(p, tp, tp_rank, pp, pp_rank) {
            let replica = if p.tp_axis.is_some() {
                dp_rank
            } else {
                dp_rank * tp + tp_rank
            };
            let data = KINDS
                .iter()
                .map(|(kind, dtype)| cut(&global(p, kind), &p.shape, &region, dtype.size()))
                .collect();
            held.push((i, region, u32::try_from(replica).unwrap(), data));
        }
    }
    let mut model_sd = StateDict::new();
    let mut opt: Vec<StateDict> = vec![StateDict::new(), StateDict::new(), StateDict::new()];
    for (i, region, replica, data) in &held {
        let p = &params[*i];
        let w = ShardedTensor::new(
            TensorKey::new(p.key.as_str()).unwrap(),
            DType::BFloat16,
            p.shape.clone(),
            region.clone(),
            *replica,
            &data[0],
        )
        .unwrap();
        for (k, sd) in opt.iter_mut().enumerate() {
            let like = ShardedTensor::like(&w, "state", DType::Float32, &data[k + 1]).unwrap();
            sd.insert(p.key.as_str(), like);
        }
        model_sd.insert(p.key.as_str(), w);
    }
    let [master, exp_avg, exp_avg_sq] = <[StateDict; 3]>::try_from(opt).unwrap();
    let state = StateDict::new()
        .with("model", model_sd)
        .with(
            "optimizer",
            StateDict::new()
                .with("fp32_master", master)
                .with("exp_avg", exp_avg)
                .with("exp_avg_sq", exp_avg_sq)
                .with(
                    "param_groups",
                    vec![StateValue::from(
                        json!({"lr": 3e-4, "betas": [0.9, 0.95], "step": 1000}),
                    )],
                ),
        )
        .with("iteration", json!(1000))
        .with(
            "rng",
            StateObject::per_rank("rng", rng_of(rank as usize)).unwrap(),
        )
        .with(
            "pp_stage",
            StateObject::sharded("pp", &[pp], &[pp_rank], json!({"stage": pp_rank, "of": pp}))
                .unwrap(),
        );
    save_state(&state, dir, comm, &SaveOptions::default()).map(|_| ())
}

/// Rank `rank` of a TP x PP=1 x DP job loads the whole model state and checks every byte.
fn load_rank(comm: &dyn Communicator, dir: &Path, tp: u64) -> zarrckpt::Result<usize> {
    let rank = comm.rank() as u64;
    let tp_rank = rank % tp;
    let params = model();
    let regions: Vec<Region> = params
        .iter()
        .map(|p| region_of(p, tp, tp_rank, 1, 0).unwrap())
        .collect();
    let mut bufs: Vec<Vec<Vec<u8>>> = params
        .iter()
        .zip(&regions)
        .map(|(_, r)| {
            KINDS
                .iter()
                .map(|(_, d)| vec![0xAAu8; r.num_elements().unwrap() as usize * d.size()])
                .collect()
        })
        .collect();
    let mut sds: Vec<StateDict> = (0..4).map(|_| StateDict::new()).collect();
    for ((p, region), b) in params.iter().zip(&regions).zip(bufs.iter_mut()) {
        for ((sd, (_, dtype)), buf) in sds.iter_mut().zip(KINDS).zip(b.iter_mut()) {
            let t = LoadTarget::new(
                TensorKey::new("placeholder").unwrap(),
                dtype,
                p.shape.clone(),
                region.clone(),
                buf,
            )
            .unwrap();
            sd.insert(p.key.as_str(), t);
        }
    }
    let [model_sd, master, exp_avg, exp_avg_sq] = <[StateDict; 4]>::try_from(sds).unwrap();
    let mut state = StateDict::new()
        .with("model", model_sd)
        .with(
            "optimizer",
            StateDict::new()
                .with("fp32_master", master)
                .with("exp_avg", exp_avg)
                .with("exp_avg_sq", exp_avg_sq)
                .with("param_groups", vec![StateValue::from(json!(null))]),
        )
        .with("iteration", json!(0))
        .with(
            "rng",
            StateObject::per_rank("rng", Vec::<u8>::new()).unwrap(),
        );
    let report = load_state(
        &mut state,
        dir,
        comm,
        &LoadOptions {
            strict: StrictMode::RaiseUnexpected,
            ..LoadOptions::default()
        },
    )?;
    assert_eq!(report.objects.len(), 3);
    assert!(matches!(state.get("iteration"), Some(StateValue::Scalar(v)) if v == &json!(1000)));
    assert!(matches!(
        state.get_path("optimizer/param_groups/0"),
        Some(StateValue::Scalar(v)) if v["betas"] == json!([0.9, 0.95])
    ));
    match state.get("rng") {
        Some(StateValue::Object(o)) => {
            assert_eq!(o.value(), &ObjectValue::Bytes(rng_of(rank as usize)));
        }
        other => panic!("{other:?}"),
    }
    drop(state);
    let mut checked = 0;
    for ((p, region), b) in params.iter().zip(&regions).zip(&bufs) {
        for ((kind, dtype), buf) in KINDS.iter().zip(b) {
            let want = cut(&global(p, kind), &p.shape, region, dtype.size());
            assert!(buf == &want, "rank {rank}: {kind} of {} differs", p.key);
            checked += buf.len();
        }
    }
    Ok(checked)
}

fn run_tcp<R: Send>(world: usize, f: impl Fn(&dyn Communicator) -> R + Sync) -> Vec<R> {
    let cfg = |rank, port| {
        let mut c = TcpConfig::new(rank, world, "127.0.0.1", port);
        c.timeout = T;
        c
    };
    let master = TcpMaster::bind(cfg(0, 0)).unwrap();
    let port = master.port().unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let mut handles = vec![s.spawn(move || f(&master.accept().unwrap()))];
        for r in 1..world {
            handles.push(s.spawn(move || f(&TcpComm::connect(cfg(r, port)).unwrap())));
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn total_bytes() -> usize {
    model()
        .iter()
        .map(|p| p.shape.iter().product::<u64>() as usize * (2 + 4 + 4 + 4))
        .sum()
}

on_targets! {
    fn tp2_pp2_saves_and_loads_as_dp3_and_tp4(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        for r in run_local(4, T, |c| save_rank(&c, &dir, 2, 2)) {
            r.unwrap();
        }
        let ckpt = Checkpoint::open(&dir).unwrap();
        let keys: Vec<String> = ckpt.tensors().iter().map(|t| t.key.to_string()).collect();
        assert_eq!(keys.len(), model().len() * 4);
        assert!(keys.contains(&"optimizer/exp_avg_sq/decoder.layers.3.mlp.linear_fc2.weight".into()));
        let master = ckpt
            .tensor(&TensorKey::new("optimizer/fp32_master/embedding.word_embeddings.weight").unwrap())
            .unwrap();
        assert_eq!(
            (master.dtype, master.shape.as_slice()),
            (DType::Float32, &[V, H][..])
        );
        let objects: Vec<String> = ckpt.objects().iter().map(|o| o.key.to_string()).collect();
        assert_eq!(
            objects,
            ["iteration", "optimizer/param_groups/0", "pp_stage", "rng"]
        );
        // A job with another pipeline size reads each stage's value explicitly.
        for stage in 0..2u64 {
            assert_eq!(
                ckpt.read_object(
                    &TensorKey::new("pp_stage").unwrap(),
                    &ObjectSlot::Shard(vec![stage])
                )
                .unwrap(),
                ObjectValue::Json(json!({"stage": stage, "of": 2}))
            );
        }
        assert!(ckpt.verify(1, None).unwrap().problems.is_empty());

        // TP1 x PP1 x DP3: every rank loads everything.
        for r in run_local(3, T, |c| load_rank(&c, &dir, 1)) {
            assert_eq!(r.unwrap(), total_bytes());
        }
        // TP4 x PP1 x DP1 over TCP.
        let got: usize = run_tcp(4, |c| load_rank(c, &dir, 4))
            .into_iter()
            .map(|r| r.unwrap())
            .sum();
        let replicated: usize = model()
            .iter()
            .filter(|p| p.tp_axis.is_none())
            .map(|p| p.shape.iter().product::<u64>() as usize * 14)
            .sum();
        assert_eq!(got, total_bytes() + 3 * replicated);
    }
}

on_targets! {
    fn tcp_save_loads_in_process(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        for r in run_tcp(4, |c| save_rank(c, &dir, 2, 2)) {
            r.unwrap();
        }
        for r in run_local(2, T, |c| load_rank(&c, &dir, 2)) {
            r.unwrap();
        }
    }
}

on_targets! {
    fn flattening_errors_fail_every_rank_and_strict_modes_see_flat_keys(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = target.path(tmp.path(), "ckpt");
        let results = run_local(2, T, |c| {
            let inner = if c.rank() == 1 { "a/b" } else { "a" };
            let sd = StateDict::new().with("m", StateDict::new().with(inner, json!(1)));
            save_state(&sd, &dir, &c, &SaveOptions::default())
        });
        assert!(matches!(
            &results[1],
            Err(Error::State(StateError::BadSegment { segment, .. })) if segment == "a/b"
        ));
        assert!(matches!(
            &results[0],
            Err(Error::RemoteFailure { rank: 1, .. })
        ));
        assert!(Checkpoint::open(&dir).is_err());

        // A load target in a save is refused.
        let mut buf = [0f32; 2];
        let sd = StateDict::new().with(
            "t",
            LoadTarget::from_slice("t", &[2], &[0], &mut buf, &[2]).unwrap(),
        );
        let e = run_local(1, T, |c| {
            save_state(&sd, &dir, &c, &SaveOptions::default()).map(|_| ())
        })
        .pop()
        .unwrap()
        .unwrap_err();
        assert!(e.to_string().contains("a load target"), "{e}");

        // Save a small state, then load with an extra key in ReturnUnexpected mode.
        let w = [1f32, 2.0];
        for r in run_local(1, T, |c| {
            let sd = StateDict::new()
                .with(
                    "model",
                    StateDict::new().with(
                        "w",
                        ShardedTensor::from_slice("x", &[2], &[0], &w, &[2], 0).unwrap(),
                    ),
                )
                .with("step", json!(5));
            save_state(&sd, &dir, &c, &SaveOptions::default())
        }) {
            r.unwrap();
        }
        let results = run_local(1, T, |c| {
            let (mut a, mut b) = ([0f32; 2], [7f32; 2]);
            let mut sd = StateDict::new()
                .with(
                    "model",
                    StateDict::new()
                        .with(
                            "w",
                            LoadTarget::from_slice("x", &[2], &[0], &mut a, &[2]).unwrap(),
                        )
                        .with(
                            "extra",
                            LoadTarget::from_slice("x", &[2], &[0], &mut b, &[2]).unwrap(),
                        ),
                )
                .with("step", json!(0))
                .with("sched", json!("untouched"));
            let opts = LoadOptions {
                strict: StrictMode::ReturnUnexpected,
                ..LoadOptions::default()
            };
            let rep = load_state(&mut sd, &dir, &c, &opts).unwrap();
            let step = match sd.get("step") {
                Some(StateValue::Scalar(v)) => v.clone(),
                _ => json!(null),
            };
            let sched = match sd.get("sched") {
                Some(StateValue::Scalar(v)) => v.clone(),
                _ => json!(null),
            };
            drop(sd);
            (rep.unexpected, a, b, step, sched)
        });
        let (unexpected, a, b, step, sched) = results.into_iter().next().unwrap();
        let unexpected: Vec<String> = unexpected.iter().map(ToString::to_string).collect();
        assert_eq!(unexpected, ["model/extra", "sched"]);
        assert_eq!((a, b), ([1.0, 2.0], [7.0, 7.0]));
        assert_eq!((step, sched), (json!(5), json!("untouched")));
    }
}
