//! Megatron `torch_dist` import in the library: checkpoints written by the venv's megatron-core
//! (`tests/python/make_megatron.py`, Python from `$ZARRCKPT_PYTHON`, else
//! `<repo>/.venv/bin/python`) imported without Python; tensors compared with the saved bytes,
//! the common state decoded from the stored encoding; hostile sources refused with typed
//! errors naming the item, and nothing run. (That the result is byte-identical to the Python
//! package's torch-based import is checked in python/tests/test_megatron.py.)

use std::path::{Path, PathBuf};
use std::process::Command;

use zarrckpt::convert::{DcpImportOptions, FormatError, import_megatron};
use zarrckpt::{Checkpoint, ObjectSlot, ObjectValue, Region, TensorKey};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> PathBuf {
    let p = match std::env::var_os("ZARRCKPT_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => repo().join(".venv/bin/python"),
    };
    assert!(
        p.is_file(),
        "no Python with torch and megatron-core at {} (set ZARRCKPT_PYTHON or run scripts/setup-venv.sh)",
        p.display()
    );
    p
}

/// Writes the checkpoint `out`, `out.expect/` and `out.hostile/` (see make_megatron.py).
fn make(out: &Path, marker: &Path) {
    let o = Command::new(python())
        .arg(repo().join("tests/python/make_megatron.py"))
        .arg(out)
        .arg(marker)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "make_megatron.py: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A copy of `good` whose common.pt is `good.hostile/NAME.pt`.
fn with_common(good: &Path, name: &str, out: &Path) {
    copy_dir(good, out);
    let mut h = good.as_os_str().to_owned();
    h.push(".hostile");
    std::fs::copy(
        Path::new(&h).join(format!("{name}.pt")),
        out.join("common.pt"),
    )
    .unwrap();
}

fn copy_dir(a: &Path, b: &Path) {
    std::fs::create_dir_all(b).unwrap();
    for e in std::fs::read_dir(a).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), b.join(e.file_name())).unwrap();
    }
}

const KEYS: [&str; 3] = ["decoder.w", "embedding.e", "scale"];

fn check_tensors(dst: &Path, expect: &Path) {
    let ck = Checkpoint::open(dst.join("zarrckpt")).unwrap();
    assert_eq!(ck.tensors().len(), KEYS.len());
    for key in KEYS {
        let want = std::fs::read(expect.join(format!("{key}.bin"))).unwrap();
        let k = TensorKey::new(key).unwrap();
        let info = ck.tensor(&k).unwrap_or_else(|| panic!("no tensor {key}"));
        let mut got = vec![0u8; want.len()];
        ck.read_region(&k, &Region::full(&info.shape), &mut got)
            .unwrap();
        assert_eq!(got, want, "{key}");
    }
}

/// The stored encoding of a value: its JSON header and the buffers after it.
fn decode(v: &ObjectValue) -> (String, serde_json::Value, Vec<u8>) {
    let ObjectValue::Bytes(b) = v else {
        panic!("not a tagged encoding: {v:?}");
    };
    assert_eq!(&b[..8], b"ZCKPTMG\x01");
    let n = usize::try_from(u64::from_le_bytes(b[8..16].try_into().unwrap())).unwrap();
    assert_eq!(n % 8, 0);
    let text = std::str::from_utf8(&b[16..16 + n]).unwrap().to_owned();
    let header: serde_json::Value = serde_json::from_str(&text).unwrap();
    (text, header, b[16 + n..].to_vec())
}

fn buf<'b>(header: &serde_json::Value, body: &'b [u8], i: &serde_json::Value) -> &'b [u8] {
    let span = &header["buffers"][usize::try_from(i.as_u64().unwrap()).unwrap()];
    let (o, n) = (span[0].as_u64().unwrap(), span[1].as_u64().unwrap());
    &body[usize::try_from(o).unwrap()..usize::try_from(o + n).unwrap()]
}

#[test]
fn a_torch_dist_checkpoint_imports_without_python() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("iter_0000010");
    make(&src, &tmp.path().join("unused-marker"));
    let expect = tmp.path().join("iter_0000010.expect");
    let dst = tmp.path().join("out").join("iter_0000010");
    let rep = import_megatron(&src, &dst, &DcpImportOptions::default()).unwrap();
    assert_eq!((rep.tensors, rep.objects), (3, 2));
    assert_eq!(rep.tensor_bytes, 4 * 6 * 4 + 5 * 2 * 2 + 8);
    check_tensors(&dst, &expect);
    assert_eq!(
        std::fs::read_to_string(dst.join("metadata.json")).unwrap(),
        r#"{"sharded_backend": "zarrckpt", "sharded_backend_version": 1, "common_backend": "zarrckpt", "common_backend_version": 1}"#
    );
    let ck = Checkpoint::open(dst.join("zarrckpt")).unwrap();
    let common = ck
        .read_object(
            &TensorKey::new("megatron/common").unwrap(),
            &ObjectSlot::Common,
        )
        .unwrap();
    let (text, h, body) = decode(&common);
    // Python's json.dumps: ", " and ": " separators, Python's float repr, ASCII escapes.
    assert!(text.starts_with(r#"{"value": {"args": {"__zarrckpt__": "Namespace", "v": {"hidden_size": 64, "params_dtype": {"__zarrckpt__": "torch.dtype", "v": "bfloat16"}, "lr": 0.0003,"#), "{text}");
    assert!(
        text.contains(r#""num_floating_point_operations_so_far": 1.5e+18"#),
        "{text}"
    );
    assert!(text.contains(r#""text": "h\u00e9 \"q\"\n""#), "{text}");
    let v = &h["value"];
    assert_eq!(v["iteration"], 1234);
    assert_eq!(
        v["optimizer"]["param_groups"][0]["betas"],
        serde_json::json!({"__zarrckpt__": "tuple", "v": [0.9, 0.95]})
    );
    let t = &v["rng_tracker"];
    assert_eq!(
        (t["dtype"].as_str(), &t["shape"]),
        (Some("uint8"), &serde_json::json!([3]))
    );
    assert_eq!(buf(&h, &body, &t["buf"]), [1, 2, 3]);
    let a = &v["np"];
    assert_eq!(
        (a["dtype"].as_str(), &a["shape"]),
        (Some("<i4"), &serde_json::json!([2, 3]))
    );
    let want: Vec<u8> = (0..6i32).flat_map(i32::to_le_bytes).collect();
    assert_eq!(buf(&h, &body, &a["buf"]), want);
    // A Fortran-ordered array comes out in C order, as numpy's ascontiguousarray gives it.
    let f = &v["npf"];
    assert_eq!(f["dtype"].as_str(), Some("<f8"));
    let want: Vec<u8> = (0..6).flat_map(|i| f64::from(i).to_le_bytes()).collect();
    assert_eq!(buf(&h, &body, &f["buf"]), want);
    assert_eq!(v["np_scalar"]["dtype"].as_str(), Some("<f4"));
    assert_eq!(buf(&h, &body, &v["np_scalar"]["buf"]), 0.5f32.to_le_bytes());
    assert_eq!(v["np_bool"]["dtype"].as_str(), Some("bool"));
    assert_eq!(v["sets"]["v"][0]["__zarrckpt__"], "set");
    assert_eq!(v["sets"]["v"][1]["__zarrckpt__"], "frozenset");
    assert_eq!(buf(&h, &body, &v["extra"]["buf"]), b"te-extra");
    assert_eq!(v["by_int"]["__zarrckpt__"], "dict");
    assert_eq!(
        v["by_int"]["v"][2],
        serde_json::json!([null, {"__zarrckpt__": "float", "v": "nan"}])
    );
    // The ShardedObject: its first value under its unique key.
    let obj = ck
        .read_object(
            &TensorKey::new("decoder.extra/shard_0_1").unwrap(),
            &ObjectSlot::Common,
        )
        .unwrap();
    let (_, h, body) = decode(&obj);
    assert_eq!(h["value"]["layer"], 1);
    let want: Vec<u8> = (0..3).flat_map(|i| (i as f32).to_le_bytes()).collect();
    assert_eq!(buf(&h, &body, &h["value"]["t"]["buf"]), want);

    // Another layout: same bytes; the target exists: refused without overwrite.
    let dst2 = tmp.path().join("out2");
    let two = DcpImportOptions {
        ranks: Some(2),
        ..Default::default()
    };
    import_megatron(&src, &dst2, &two).unwrap();
    check_tensors(&dst2, &expect);
    let ck2 = Checkpoint::open(dst2.join("zarrckpt")).unwrap();
    let w = ck2.tensor(&TensorKey::new("decoder.w").unwrap()).unwrap();
    assert_eq!(w.chunk_shape[0], 2);
    assert!(import_megatron(&src, &dst2, &two).is_err());

    // The CLI: the same importer, one JSON line; --trust-pickles refused with the command.
    let cli = tmp.path().join("cli");
    let o = Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args(["import", "--megatron"])
        .arg(&src)
        .arg("--out")
        .arg(&cli)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(
        (line["tensors"].as_u64(), line["objects"].as_u64()),
        (Some(3), Some(2))
    );
    check_tensors(&cli, &expect);
    let never = tmp.path().join("never");
    let o = Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args(["import", "--dcp"])
        .arg(&src)
        .args(["--megatron", "--trust-pickles", "--out"])
        .arg(&never)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(&format!(
            "python -m zarrckpt.migrate {} --out {} --megatron --trust-pickles",
            src.display(),
            never.display()
        )),
        "{err}"
    );
    assert!(!never.exists());
}

fn refused(src: &Path, dst: &Path) -> FormatError {
    let e = import_megatron(src, dst, &DcpImportOptions::default()).unwrap_err();
    assert!(!dst.join("zarrckpt").join("zarr.json").exists(), "{e}");
    e
}

#[test]
fn hostile_sources_are_typed_errors_and_run_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let good = t.join("good");
    let marker = t.join("PWNED");
    make(&good, &marker);
    // common.pt calling os.system: refused at the global, nothing run.
    with_common(&good, "evil", &t.join("evil"));
    let e = refused(&t.join("evil"), &t.join("o1"));
    assert!(
        matches!(&e, FormatError::Pickle { item, .. } if item == "common.pt")
            && e.to_string().contains("system"),
        "{e}"
    );
    assert!(!marker.exists(), "the pickle ran");
    // An enum member (a class of the user's): refused, naming it.
    with_common(&good, "enum", &t.join("enum"));
    let e = refused(&t.join("enum"), &t.join("o2"));
    assert!(
        matches!(&e, FormatError::Pickle { item, .. } if item == "common.pt")
            && e.to_string().contains("__main__.Phase"),
        "{e}"
    );
    // A numpy array whose shape claims 2**40 elements over 8 bytes.
    with_common(&good, "lying", &t.join("lying"));
    let e = refused(&t.join("lying"), &t.join("o3"));
    assert!(
        matches!(&e, FormatError::Dcp { item, msg, .. } if item == "common.pt" && msg.contains("at `common.x`") && msg.contains("1099511627776")),
        "{e}"
    );
    // The good checkpoint, spoiled in turn.
    // common.pt that is not a torch.save archive.
    let g1 = t.join("g1");
    copy_dir(&good, &g1);
    std::fs::write(g1.join("common.pt"), b"PK\x03\x04 not a zip at all").unwrap();
    let e = refused(&g1, &t.join("o4"));
    assert!(
        matches!(&e, FormatError::Dcp { item, msg, .. } if item == "common.pt" && msg.contains("not a torch.save archive")),
        "{e}"
    );
    // Another backend, and no metadata.json.
    let g2 = t.join("g2");
    copy_dir(&good, &g2);
    std::fs::write(g2.join("metadata.json"), br#"{"sharded_backend": "zarr"}"#).unwrap();
    let e = refused(&g2, &t.join("o5"));
    assert!(
        matches!(&e, FormatError::Dcp { item, msg, .. } if item == "metadata.json" && msg.contains("torch_dist")),
        "{e}"
    );
    std::fs::remove_file(g2.join("metadata.json")).unwrap();
    let e = refused(&g2, &t.join("o6"));
    assert!(
        matches!(&e, FormatError::Dcp { item, .. } if item == "metadata.json"),
        "{e}"
    );
    // A storage file name in .metadata that escapes the directory (same length, so the
    // pickle stays well-formed).
    let g3 = t.join("g3");
    copy_dir(&good, &g3);
    let md = std::fs::read(g3.join(".metadata")).unwrap();
    let (from, to) = (b"__0_0.distcp", b"../_0.distcp");
    let at = md
        .windows(from.len())
        .position(|w| w == from)
        .expect("a file name");
    let mut bad = md.clone();
    bad[at..at + from.len()].copy_from_slice(to);
    std::fs::write(g3.join(".metadata"), &bad).unwrap();
    let e = refused(&g3, &t.join("o7"));
    assert!(
        matches!(&e, FormatError::Dcp { msg, .. } if msg.contains("not a file name")),
        "{e}"
    );
    // A .distcp file cut short: the item ranges past its end are named.
    let g4 = t.join("g4");
    copy_dir(&good, &g4);
    for f in ["__0_0.distcp", "__0_1.distcp"] {
        let p = g4.join(f);
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    }
    let e = refused(&g4, &t.join("o8"));
    assert!(
        matches!(&e, FormatError::Dcp { msg, .. } if msg.contains("past the end")),
        "{e}"
    );
    // ranks = 0.
    let e = import_megatron(
        &good,
        &t.join("o9"),
        &DcpImportOptions {
            ranks: Some(0),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, FormatError::Option { .. }), "{e}");
}
