//! The `zarrckpt` command line, end to end: import/export round trips on a real Hugging Face
//! model (fp32, and converted to fp16/bf16 multi-file form), fp8 and bool tensors, verify on a
//! corrupted checkpoint, inspect, demo. The import / verify / export / inspect round trips
//! also with the checkpoint on `s3://` (SeaweedFS; `tests/common/target.rs`; `ls`, `diff`,
//! `cp` and `gc` on `s3://` are in `tests/s3.rs`).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("run zarrckpt");
    if !out.status.success() {
        panic!(
            "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// The real model fetched by scripts/fetch-test-model.sh.
fn real_model() -> Option<PathBuf> {
    let p = std::env::var_os("ZARRCKPT_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("target/test-data/all-MiniLM-L6-v2/model.safetensors")
        });
    if p.is_file() {
        return Some(p);
    }
    if std::env::var_os("ZARRCKPT_SKIP_REAL_MODEL").is_some() {
        eprintln!(
            "SKIPPED: no real model at {} (ZARRCKPT_SKIP_REAL_MODEL is set)",
            p.display()
        );
        return None;
    }
    panic!(
        "no real model at {}: run scripts/fetch-test-model.sh (or scripts/test.sh)",
        p.display()
    );
}

/// name -> (dtype, shape, bytes) of a safetensors file.
fn tensors(path: &Path) -> HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn write_st(
    path: &Path,
    items: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    meta: Option<HashMap<String, String>>,
) {
    let views: Vec<(String, TensorView)> = items
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, meta, path).unwrap();
}

fn f32_to_f16(b: &[u8]) -> Vec<u8> {
    b.chunks_exact(4)
        .flat_map(|c| half::f16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect()
}

fn f32_to_bf16(b: &[u8]) -> Vec<u8> {
    b.chunks_exact(4)
        .flat_map(|c| half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect()
}

on_targets! {
    [local, s3]
    fn real_model_round_trips_bit_identically(target: Target) {
        let Some(model) = real_model() else { return };
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = target.path(tmp.path(), "ckpt");
        let out = tmp.path().join("out.safetensors");
        let o = run(bin()
            .arg("import")
            .arg(&model)
            .arg("--out")
            .arg(&ckpt)
            .args(["--ranks", "3"]));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("imported 104 tensors"),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        );
        run(bin().arg("verify").arg(&ckpt));
        run(bin().arg("export").arg(&ckpt).arg("--out").arg(&out));
        let (a, b) = (tensors(&model), tensors(&out));
        assert_eq!(a.len(), b.len());
        for (name, t) in &a {
            assert_eq!(Some(t), b.get(name), "{name}");
        }
        // safetensors files are canonical: the whole file comes back identical.
        assert_eq!(std::fs::read(&model).unwrap(), std::fs::read(&out).unwrap());
        let o = run(bin().arg("inspect").arg(&ckpt).arg("--json"));
        let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(doc["total_tensors"], 104);
        assert_eq!(doc["world_size"], 3);
        let total: u64 = a.values().map(|t| t.2.len() as u64).sum();
        assert_eq!(doc["total_bytes"], total);
    }
}

on_targets! {
    [local, s3]
    fn multi_file_fp16_bf16_fp8_bool_model_round_trips(target: Target) {
        let tmp = tempfile::tempdir().unwrap();
        let mut items: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        if let Some(model) = real_model() {
            // The real model's weights, converted: fp16 and bf16 halves, int64 position ids.
            let mut src: Vec<_> = tensors(&model).into_iter().collect();
            src.sort_by(|a, b| a.0.cmp(&b.0));
            for (i, (name, (dtype, shape, data))) in src.into_iter().enumerate() {
                let (d, bytes) = match dtype {
                    Dtype::F32 if i % 2 == 0 => (Dtype::F16, f32_to_f16(&data)),
                    Dtype::F32 => (Dtype::BF16, f32_to_bf16(&data)),
                    other => (other, data),
                };
                items.push((name, d, shape, bytes));
            }
        }
        // fp8, bool and odd shapes, every byte value.
        let all: Vec<u8> = (0..=255u8).collect();
        items.push((
            "fp8.e4m3fn".into(),
            Dtype::F8_E4M3,
            vec![16, 16],
            all.clone(),
        ));
        items.push(("fp8.e5m2".into(), Dtype::F8_E5M2, vec![256], all));
        items.push((
            "mask".into(),
            Dtype::BOOL,
            vec![7, 3],
            (0..21).map(|i| (i % 3 == 0) as u8).collect(),
        ));
        items.push((
            "scalar".into(),
            Dtype::I64,
            vec![],
            42i64.to_le_bytes().to_vec(),
        ));
        items.push(("empty".into(), Dtype::F32, vec![0, 5], vec![]));
        // Three files, as a sharded Hugging Face checkpoint.
        let mut files = Vec::new();
        for part in 0..3 {
            let chunk: Vec<_> = items
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 3 == part)
                .map(|(_, t)| t.clone())
                .collect();
            let p = tmp
                .path()
                .join(format!("model-{:05}-of-00003.safetensors", part + 1));
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            write_st(&p, &chunk, Some(meta));
            files.push(p);
        }
        let ckpt = target.path(tmp.path(), "ckpt");
        let out = tmp.path().join("out.safetensors");
        run(bin()
            .arg("import")
            .args(&files)
            .arg("--out")
            .arg(&ckpt)
            .args(["--ranks", "4", "--compression", "zstd"]));
        run(bin().arg("verify").arg(&ckpt));
        run(bin().arg("export").arg(&ckpt).arg("--out").arg(&out));
        let back = tensors(&out);
        assert_eq!(back.len(), items.len());
        for (name, d, s, b) in &items {
            assert_eq!(back.get(name), Some(&(*d, s.clone(), b.clone())), "{name}");
        }
        // The same tensor in two files is refused.
        let dup = tmp.path().join("dup.safetensors");
        write_st(&dup, &items[..1], None);
        let o = bin()
            .arg("import")
            .arg(&files[0])
            .arg(&dup)
            .arg("--out")
            .arg(tmp.path().join("x"))
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("appears in both"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn verify_names_key_chunk_and_file_of_a_corruption() {
    let tmp = tempfile::tempdir().unwrap();
    let st = tmp.path().join("m.safetensors");
    let data: Vec<u8> = (0..64 * 1024u32)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    write_st(
        &st,
        &[("layer.weight".into(), Dtype::F32, vec![256, 256], data)],
        None,
    );
    let ckpt = tmp.path().join("ckpt");
    run(bin()
        .arg("import")
        .arg(&st)
        .arg("--out")
        .arg(&ckpt)
        .args(["--ranks", "2"]));
    let shard = ckpt.join("tensors/layer.weight/c.1.0");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let o = bin().arg("verify").arg(&ckpt).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("layer.weight")
            && err.contains("[1, 0]")
            && err.contains("c.1.0")
            && err.contains("crc32c"),
        "{err}"
    );
    // An export of a corrupted checkpoint fails and leaves no output file behind.
    let out = tmp.path().join("out.safetensors");
    let o = bin()
        .arg("export")
        .arg(&ckpt)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(!out.exists());
    // An incomplete checkpoint is refused by every command.
    std::fs::remove_file(ckpt.join("zarr.json")).unwrap();
    for cmd in ["inspect", "verify"] {
        let o = bin().arg(cmd).arg(&ckpt).output().unwrap();
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("incomplete"),
            "{cmd}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn demo_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let o = run(bin()
        .arg("demo")
        .arg("--dir")
        .arg(&dir)
        .args(["--size", "8000000"]));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("every byte checked"), "{s}");
    run(bin().arg("verify").arg(&dir));
}

/// A checkpoint whose `inspect` listing is far larger than a pipe's buffer (64 KiB), so that
/// a reader that stops early always leaves the writer with output it cannot write.
fn many_tensor_checkpoint(dir: &Path, n: usize) {
    use zarrckpt::{LocalComm, SaveOptions, ShardedTensor, save};
    let data: Vec<Vec<f32>> = (0..n).map(|i| vec![i as f32; 4]).collect();
    let keys: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "model.layers.{i}.{}.weight",
                "a_rather_long_name_for_a_tiny_tensor_".repeat(5)
            )
        })
        .collect();
    let pieces: Vec<ShardedTensor> = (0..n)
        .map(|i| ShardedTensor::from_slice(&keys[i], &[4], &[0], &data[i], &[4], 0).unwrap())
        .collect();
    save(&pieces, dir, &LocalComm::single(), &SaveOptions::default()).unwrap();
}

/// Runs `zarrckpt args` with stdout going to a pipe whose reader reads `read_first` bytes
/// (0: none) and then closes it. The command must end quietly: exit 0, or killed by SIGPIPE
/// (status 141 in a shell), with nothing on stderr.
fn ends_quietly_on_closed_pipe(args: &[&std::ffi::OsStr], read_first: usize) {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let mut child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn zarrckpt");
    let mut stdout = child.stdout.take().expect("stdout");
    if read_first > 0 {
        let mut buf = vec![0u8; read_first];
        stdout.read_exact(&mut buf).expect("first output");
    }
    drop(stdout);
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "{args:?} (read {read_first} bytes, then closed): {} \nstderr:\n{stderr}",
        out.status
    );
    assert!(
        stderr.is_empty(),
        "{args:?} (read {read_first} bytes, then closed) printed on stderr:\n{stderr}"
    );
}

#[test]
fn printing_commands_end_quietly_when_the_reader_goes_away() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    many_tensor_checkpoint(&a, 400);
    let b = tmp.path().join("b");
    many_tensor_checkpoint(&b, 380);
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let cases: Vec<Vec<&std::ffi::OsStr>> = vec![
        vec![os("inspect"), a.as_os_str()],
        vec![os("inspect"), a.as_os_str(), os("--json")],
        vec![os("verify"), a.as_os_str()],
        vec![os("diff"), a.as_os_str(), b.as_os_str()],
        vec![os("diff"), a.as_os_str(), b.as_os_str(), os("--json")],
        vec![
            os("bench-plan"),
            os("--ranks"),
            os("64"),
            os("--tensors"),
            os("50"),
        ],
        vec![os("--help")],
    ];
    for args in &cases {
        ends_quietly_on_closed_pipe(args, 0);
    }
    // Readers that take the first bytes and stop (`| head -c 100`), where the output is
    // larger than the pipe can hold.
    for args in &cases[..2] {
        ends_quietly_on_closed_pipe(args, 100);
    }
}

/// Issue 23, rule 7: read-only commands never delete. `verify` (and `inspect`, `export`,
/// `diff`, `ls`) on a missing checkpoint leave staging and parked directories alone (a parked
/// checkpoint is only renamed back, rule R-a); `recover --dry-run` lists what `recover`
/// then does.
#[test]
fn read_only_commands_never_delete_and_recover_does() {
    use zarrckpt::storage::commit::{old_path, staging_path};
    use zarrckpt::storage::footer::SaveId;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    many_tensor_checkpoint(&dir, 2);
    let id = zarrckpt::Checkpoint::open(&dir)
        .unwrap()
        .meta()
        .save_id
        .unwrap();
    let staging = staging_path(&dir, SaveId([1; 16]));
    let legacy = tmp.path().join("ck.zarrckpt-staging-abc");
    for s in [&staging, &legacy] {
        std::fs::create_dir_all(s.join("tensors")).unwrap();
    }
    let parked = old_path(&dir, id);
    std::fs::rename(&dir, &parked).unwrap();
    let out = tmp.path().join("out.safetensors");
    for args in [
        vec!["verify".into(), dir.clone()],
        vec!["inspect".into(), dir.clone()],
        vec!["export".into(), dir.clone(), "--out".into(), out.clone()],
        vec!["ls".into(), tmp.path().to_owned()],
    ] {
        run(bin().args(&args));
        assert!(staging.exists() && legacy.exists(), "{args:?}");
    }
    assert!(dir.exists() && !parked.exists(), "R-a restored it");
    let o = run(bin().arg("recover").arg(&dir).arg("--dry-run"));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(
        s.contains("would remove") && s.contains(&*staging.to_string_lossy()),
        "{s}"
    );
    assert!(staging.exists() && legacy.exists());
    let o = run(bin().arg("recover").arg(&dir));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("removed"), "{s}");
    assert!(!staging.exists() && !legacy.exists());
    run(bin().arg("verify").arg(&dir));
    let o = run(bin().arg("recover").arg(&dir));
    assert!(String::from_utf8_lossy(&o.stdout).contains("nothing to recover"));
}

#[test]
fn bench_read_times_both_paths_over_the_same_boxes() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    many_tensor_checkpoint(&a, 30);
    let out = bin()
        .args(["bench-read", "--boxes", "60", "--rounds", "1", "--json"])
        .arg(&a)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["boxes"], 60);
    assert_eq!(v["tensors"], 30);
    assert!(v["reader_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["collective_load_s"].as_f64().unwrap() > 0.0, "{v}");
}
