//! `zarrckpt diff A B`, end to end: checkpoints of the same tensors saved by different
//! topologies and chunkings are equal; one changed element is found with the right largest
//! absolute difference and count; keys on one side only, other data types and other shapes
//! are reported; exit status 0 / 1 / 2 as `diff(1)`; and a tensor larger than the memory
//! budget is compared with the child's peak resident memory under a bound well below what
//! reading whole tensors would need.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{cut, piece, tensor_bytes};
use serde_json::Value;
use zarrckpt::comm::run_local;
use zarrckpt::plan::GridOptions;
use zarrckpt::{Communicator, DType, Region, SaveOptions, ShardedTensor, TensorKey, save};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
}

struct Tensor {
    key: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

impl Tensor {
    fn new(key: &'static str, dtype: DType, shape: &[u64], seed: u64) -> Tensor {
        Tensor {
            key,
            dtype,
            shape: shape.to_vec(),
            data: tensor_bytes(seed, shape, dtype),
        }
    }
    /// Overwrites element `i` with `bytes`.
    fn set(&mut self, i: usize, bytes: &[u8]) {
        let n = self.dtype.size();
        self.data[i * n..(i + 1) * n].copy_from_slice(bytes);
    }
}

/// Saves `tensors` with `ranks` in-process ranks, each tensor split along `axis` (the last
/// axis when the tensor has fewer).
fn save_split(dir: &Path, tensors: &[Tensor], ranks: u64, axis: usize, grid: GridOptions) {
    let results = run_local(ranks as usize, Duration::from_secs(120), |comm| {
        let r = comm.rank() as u64;
        let parts: Vec<(Region, Vec<u8>)> = tensors
            .iter()
            .map(|t| {
                let region = piece(&t.shape, axis.min(t.shape.len() - 1), ranks, r);
                let bytes = cut(&t.data, &t.shape, &region, t.dtype.size());
                (region, bytes)
            })
            .collect();
        let pieces: Vec<ShardedTensor> = tensors
            .iter()
            .zip(&parts)
            .map(|(t, (region, bytes))| {
                ShardedTensor::new(
                    TensorKey::new(t.key).unwrap(),
                    t.dtype,
                    t.shape.clone(),
                    region.clone(),
                    0,
                    bytes,
                )
                .unwrap()
            })
            .collect();
        let opts = SaveOptions {
            grid,
            ..SaveOptions::default()
        };
        save(&pieces, dir, &comm, &opts).map(|_| ())
    });
    for r in results {
        r.unwrap();
    }
}

fn model() -> Vec<Tensor> {
    vec![
        Tensor::new("w.f32", DType::Float32, &[37, 21], 1),
        Tensor::new("w.bf16", DType::BFloat16, &[10, 6, 5], 2),
        Tensor::new("i.i64", DType::Int64, &[13], 3),
        Tensor::new("m.bool", DType::Bool, &[9, 2], 4),
        Tensor::new("e.fp8", DType::Float8E4M3FN, &[6, 4], 5),
        Tensor::new("u.u16", DType::UInt16, &[5, 0, 3], 6),
    ]
}

/// Runs `zarrckpt diff --json a b`; returns the exit code and the parsed report.
fn diff(a: &Path, b: &Path, extra: &[&str]) -> (i32, Value, String) {
    let out = bin()
        .arg("diff")
        .arg(a)
        .arg(b)
        .arg("--json")
        .args(extra)
        .output()
        .expect("run zarrckpt diff");
    let code = out.status.code().expect("exit code");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (code, v, format!("{stdout}\n{stderr}"))
}

fn entry<'a>(report: &'a Value, key: &str) -> &'a Value {
    report["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["key"] == key)
        .unwrap_or_else(|| panic!("no entry for {key} in {report}"))
}

/// Small subchunks, so that the two sides differ in subchunks as well as in chunks.
fn small_subchunks() -> GridOptions {
    GridOptions {
        subchunk_target_bytes: 64,
        ..GridOptions::default()
    }
}

#[test]
fn same_tensors_saved_by_other_topologies_are_equal_and_one_change_is_found() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    let mut t = model();
    save_split(&a, &t, 4, 0, GridOptions::default());
    save_split(&b, &t, 3, 1, small_subchunks());
    let ia = zarrckpt::Checkpoint::open(&a).unwrap().tensors();
    let ib = zarrckpt::Checkpoint::open(&b).unwrap().tensors();
    assert_ne!(
        ia.iter().map(|t| &t.chunk_shape).collect::<Vec<_>>(),
        ib.iter().map(|t| &t.chunk_shape).collect::<Vec<_>>(),
        "the two layouts must differ"
    );
    let (code, report, all) = diff(&a, &b, &[]);
    assert_eq!(code, 0, "{all}");
    assert_eq!(report["equal"], true, "{all}");
    assert_eq!(report["tensors_compared"], 6);
    for x in &t {
        let e = entry(&report, x.key);
        assert_eq!(e["status"], "equal", "{e}");
        assert_eq!(e["elements"], x.shape.iter().product::<u64>());
    }
    // Text mode says the same.
    let out = bin().arg("diff").arg(&a).arg(&b).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("equal: 6 tensors, 0 objects"));

    // One element of two tensors changed, saved by a third layout.
    t[0].set(7 * 21 + 13, &1.5f32.to_le_bytes());
    save_split(&c, &t, 2, 1, GridOptions::default());
    let mut t2 = model();
    t2[0].set(7 * 21 + 13, &2.0f32.to_le_bytes());
    t2[2].set(11, &100i64.to_le_bytes());
    let d = tmp.path().join("d");
    save_split(&d, &t2, 3, 0, small_subchunks());
    t[2].set(11, &93i64.to_le_bytes());
    let e = tmp.path().join("e");
    save_split(&e, &t, 4, 1, GridOptions::default());
    let (code, report, all) = diff(&e, &d, &[]);
    assert_eq!(code, 1, "{all}");
    assert_eq!(report["equal"], false);
    assert_eq!(report["tensors_differing"], 2, "{all}");
    let f = entry(&report, "w.f32");
    assert_eq!(f["status"], "differ");
    assert_eq!(f["differing"], 1);
    assert_eq!(f["max_abs_diff"], 0.5);
    let i = entry(&report, "i.i64");
    assert_eq!(i["differing"], 1);
    assert_eq!(i["max_abs_diff"], 7.0);
    for k in ["w.bf16", "m.bool", "e.fp8", "u.u16"] {
        assert_eq!(entry(&report, k)["status"], "equal");
    }
    let out = bin().arg("diff").arg(&e).arg(&d).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text.contains("~ w.f32: 1 of 777 elements differ, max |a - b| = 0.5"),
        "{text}"
    );
    // c (only w.f32 changed) against e (w.f32 and i.i64 changed): i.i64 only.
    let (code, report, all) = diff(&c, &e, &[]);
    assert_eq!(code, 1, "{all}");
    assert_eq!(entry(&report, "i.i64")["differing"], 1);
    assert_eq!(entry(&report, "w.f32")["status"], "equal");
}

#[test]
fn keys_dtypes_and_shapes_that_differ_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let ta = vec![
        Tensor::new("only.a", DType::Float32, &[4], 1),
        Tensor::new("shape", DType::Float32, &[4, 3], 2),
        Tensor::new("same", DType::Int8, &[8], 3),
        Tensor::new("dtype", DType::Float32, &[3], 4),
    ];
    let mut tb = vec![
        Tensor::new("only.b", DType::Float32, &[4], 1),
        Tensor::new("shape", DType::Float32, &[3, 4], 2),
        Tensor::new("same", DType::Int8, &[8], 3),
        Tensor::new("dtype", DType::BFloat16, &[3], 4),
    ];
    let mut ta = ta;
    // dtype: float32 [1, 2, 3] against bfloat16 [1, 2, 3.5].
    for (i, v) in [1.0f32, 2.0, 3.0].iter().enumerate() {
        ta[3].set(i, &v.to_le_bytes());
    }
    for (i, v) in [0x3F80u16, 0x4000, 0x4060].iter().enumerate() {
        tb[3].set(i, &v.to_le_bytes());
    }
    save_split(&a, &ta, 2, 0, GridOptions::default());
    save_split(&b, &tb, 1, 0, GridOptions::default());
    let (code, report, all) = diff(&a, &b, &[]);
    assert_eq!(code, 1, "{all}");
    assert_eq!(entry(&report, "only.a")["status"], "only_a");
    assert_eq!(entry(&report, "only.b")["status"], "only_b");
    let s = entry(&report, "shape");
    assert_eq!(s["status"], "shape");
    assert_eq!(s["shape_a"], serde_json::json!([4, 3]));
    assert_eq!(s["shape_b"], serde_json::json!([3, 4]));
    assert_eq!(entry(&report, "same")["status"], "equal");
    let d = entry(&report, "dtype");
    assert_eq!(d["status"], "dtype");
    assert_eq!(d["dtype_a"], "float32");
    assert_eq!(d["dtype_b"], "bfloat16");
    assert_eq!(d["differing"], 1);
    assert_eq!(d["max_abs_diff"], 0.5);
    let out = bin().arg("diff").arg(&a).arg(&b).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "< only.a: only in A",
        "> only.b: only in B",
        "! shape: shape [4, 3] vs [3, 4]",
        "! dtype: data type float32 vs bfloat16",
        "= same",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
    // Errors exit with 2.
    let out = bin()
        .arg("diff")
        .arg(&a)
        .arg(tmp.path().join("nowhere"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error"));
}

/// Runs `zarrckpt diff --json` and returns (exit code, the child's own peak resident memory
/// in bytes as it reports it, the report). The child reads its `VmHWM` (`/proc/self/status`,
/// mapped file pages included) at the end: `wait4`'s `ru_maxrss` would not do, since it also
/// counts the parent's memory shared with the child between the fork and the exec.
fn diff_peak_rss(a: &Path, b: &Path, memory_mib: u64) -> (i32, u64, Value) {
    let (code, report, all) = diff(a, b, &["--memory-mib", &memory_mib.to_string()]);
    let peak = report["peak_rss_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no peak_rss_bytes: {all}"));
    (code, peak, report)
}

#[test]
fn a_tensor_larger_than_the_budget_is_compared_in_bounded_memory() {
    const MIB: u64 = 1 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    // 96 MiB of float32, saved split by rows on one side and by columns on the other, with
    // its very last element changed on one side.
    let shape = [6144u64, 4096];
    let mut t = vec![Tensor::new("big", DType::Float32, &shape, 9)];
    for v in t[0].data.chunks_exact_mut(4) {
        v.copy_from_slice(&0.25f32.to_le_bytes());
    }
    save_split(&a, &t, 2, 0, GridOptions::default());
    t[0].set(6144 * 4096 - 1, &1.0f32.to_le_bytes());
    save_split(&b, &t, 3, 1, GridOptions::default());
    drop(t);
    let tensor_bytes = 6144 * 4096 * 4;
    // A budget of 8 MiB: peak well below one side's tensor, let alone both.
    let (code, peak, report) = diff_peak_rss(&a, &b, 8);
    assert_eq!(code, 1, "{report}");
    let e = entry(&report, "big");
    assert_eq!(e["differing"], 1, "{report}");
    assert_eq!(e["elements"], 6144 * 4096);
    assert_eq!(e["max_abs_diff"], 0.75);
    let bound = 64 * MIB;
    eprintln!(
        "diff of two {} MiB tensors with --memory-mib 8: peak RSS {:.1} MiB (bound {} MiB)",
        tensor_bytes / MIB,
        peak as f64 / MIB as f64,
        bound / MIB
    );
    assert!(
        peak < bound,
        "peak RSS {peak} bytes with an 8 MiB budget (bound {bound})"
    );
    // The measurement sees memory: with a budget holding both tensors whole, the peak is
    // above both tensors' size.
    let (code, big_peak, _) = diff_peak_rss(&a, &b, 512);
    assert_eq!(code, 1);
    eprintln!(
        "the same with --memory-mib 512: peak RSS {:.1} MiB",
        big_peak as f64 / MIB as f64
    );
    assert!(big_peak > 2 * tensor_bytes, "{big_peak}");
}

#[test]
fn objects_are_compared_value_by_value() {
    use zarrckpt::{StateObject, save_with_objects};
    let tmp = tempfile::tempdir().unwrap();
    // (config, per-rank rng, sharded stage state, an object only on one side, one whose scope
    // differs), saved by 2 ranks; `b` changes rank 1's rng and shard [1]'s value.
    let save_objects = |dir: &Path, changed: bool| {
        for r in run_local(2, Duration::from_secs(60), |comm| {
            let r = comm.rank() as u64;
            let mut objs = vec![
                StateObject::common("config", serde_json::json!({"lr": 0.1, "layers": 4})).unwrap(),
                StateObject::per_rank(
                    "rng",
                    vec![r as u8, 7, if changed && r == 1 { 9 } else { 8 }],
                )
                .unwrap(),
                StateObject::sharded(
                    "stage",
                    &[2],
                    &[r],
                    serde_json::json!({"stage": r, "x": if changed && r == 1 { 2 } else { 1 }}),
                )
                .unwrap(),
            ];
            if changed {
                objs.push(StateObject::common("extra", serde_json::json!(1)).unwrap());
                objs.push(StateObject::per_rank("scope", serde_json::json!(0)).unwrap());
            } else {
                objs.push(StateObject::common("scope", serde_json::json!(0)).unwrap());
            }
            save_with_objects(&[], &objs, dir, &comm, &SaveOptions::default()).map(|_| ())
        }) {
            r.unwrap();
        }
    };
    let (a, a2, b) = (
        tmp.path().join("a"),
        tmp.path().join("a2"),
        tmp.path().join("b"),
    );
    save_objects(&a, false);
    save_objects(&a2, false);
    save_objects(&b, true);
    let (code, report, all) = diff(&a, &a2, &[]);
    assert_eq!(code, 0, "{all}");
    assert_eq!(report["objects_compared"], 4, "{all}");
    let (code, report, all) = diff(&a, &b, &[]);
    assert_eq!(code, 1, "{all}");
    let obj = |k: &str| {
        report["objects"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["key"] == k)
            .unwrap_or_else(|| panic!("{k}: {all}"))
            .clone()
    };
    assert_eq!(obj("config")["status"], "equal");
    assert_eq!(obj("rng")["status"], "differ");
    assert_eq!(obj("rng")["differing"], serde_json::json!(["rank 1"]));
    assert_eq!(obj("rng")["values"], 2);
    assert_eq!(obj("stage")["differing"], serde_json::json!(["shard [1]"]));
    assert_eq!(obj("extra")["status"], "only_b");
    assert_eq!(obj("scope")["status"], "layout");
    assert_eq!(report["objects_differing"], 4, "{all}");
    let out = bin().arg("diff").arg(&a).arg(&b).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "= object config",
        "~ object rng: 1 of 2 values differ (rank 1)",
        "> object extra: only in B",
        "! object scope: common json vs per_rank json of 2 ranks",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
}
