//! DCP import in the library: checkpoints written by the venv's torch (`tests/python/make_dcp.py`,
//! Python from `$ZARRCKPT_PYTHON`, else `<repo>/.venv/bin/python`) imported without Python, each
//! tensor compared with what torch's own DCP load returns; hostile sources refused with typed
//! errors and nothing run.

#[path = "../fuzz/src/lib.rs"]
mod fuzz_checks;

use std::path::{Path, PathBuf};
use std::process::Command;

use zarrckpt::convert::{DcpImportOptions, FormatError, import_dcp};
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
        "no Python with torch at {} (set ZARRCKPT_PYTHON or run scripts/setup-venv.sh)",
        p.display()
    );
    p
}

fn make(mode: &str, out: &Path, extra: &[&Path]) {
    let o = Command::new(python())
        .arg(repo().join("tests/python/make_dcp.py"))
        .arg(mode)
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "make_dcp.py {mode}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn check_against_torch(ck: &Path, expect: &Path) {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(expect.join("index.json")).unwrap()).unwrap();
    let ck = Checkpoint::open(ck).unwrap();
    let tensors = index["tensors"].as_object().unwrap();
    assert_eq!(ck.tensors().len(), tensors.len());
    for (key, t) in tensors {
        let want = std::fs::read(expect.join(t["file"].as_str().unwrap())).unwrap();
        let k = TensorKey::new(key.as_str()).unwrap();
        let info = ck.tensor(&k).unwrap_or_else(|| panic!("no tensor {key}"));
        assert_eq!(info.dtype.name(), t["dtype"].as_str().unwrap(), "{key}");
        let mut got = vec![0u8; want.len()];
        ck.read_region(&k, &Region::full(&info.shape), &mut got)
            .unwrap();
        assert_eq!(got, want, "{key}: bytes differ from torch's DCP load");
    }
    for (key, v) in index["objects"].as_object().unwrap() {
        let got = ck
            .read_object(&TensorKey::new(key.as_str()).unwrap(), &ObjectSlot::Common)
            .unwrap();
        assert_eq!(got, ObjectValue::Json(v.clone()), "{key}");
    }
    let blob: Vec<u8> = index["blob"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
        .collect();
    let got = ck
        .read_object(&TensorKey::new("blob").unwrap(), &ObjectSlot::Common)
        .unwrap();
    assert_eq!(got, ObjectValue::Bytes(blob));
}

#[test]
fn a_two_rank_dcp_checkpoint_imports_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("dcp");
    make("good", &src, &[]);
    let expect = tmp.path().join("dcp.expect");
    // The source's chunks: model/w was saved by 2 ranks (Shard(0)), so 2 pieces.
    let out = tmp.path().join("ck");
    let rep = import_dcp(&src, &out, &DcpImportOptions::default()).unwrap();
    assert_eq!((rep.tensors, rep.objects), (4, 7));
    assert_eq!(rep.tensor_bytes, 140 + 24 + 8 + 80);
    check_against_torch(&out, &expect);
    let ck = Checkpoint::open(&out).unwrap();
    let w = ck.tensor(&TensorKey::new("model/w").unwrap()).unwrap();
    assert_eq!(w.shape, vec![7, 5]);
    // Another layout, and zstd: same bytes.
    let out3 = tmp.path().join("ck3");
    let opts = DcpImportOptions {
        ranks: Some(3),
        compression: zarrckpt::Compression::Zstd,
        ..Default::default()
    };
    import_dcp(&src, &out3, &opts).unwrap();
    check_against_torch(&out3, &expect);
    // An existing checkpoint is not replaced unless asked.
    assert!(import_dcp(&src, &out3, &opts).is_err());
    let over = DcpImportOptions {
        overwrite: true,
        ..opts
    };
    import_dcp(&src, &out3, &over).unwrap();
    check_against_torch(&out3, &expect);

    // The CLI: the same importer, one JSON line.
    let cli = tmp.path().join("cli");
    let o = Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args(["import", "--dcp"])
        .arg(&src)
        .arg("--out")
        .arg(&cli)
        .args(["--ranks", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(line["tensors"], 4);
    assert_eq!(line["objects"], 7);
    assert_eq!(line["tensor_bytes"], 252);
    check_against_torch(&cli, &expect);

    // Hostile: a .distcp file cut short: the item ranges past its end are named.
    let bad = tmp.path().join("truncated");
    copy_dir(&src, &bad);
    let f = bad.join("__1_0.distcp");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let e = import_dcp(&bad, &tmp.path().join("x1"), &DcpImportOptions::default()).unwrap_err();
    assert!(
        matches!(&e, FormatError::Dcp { msg, .. } if msg.contains("past the end")),
        "{e}"
    );
    // A .metadata cut short: a typed pickle error.
    let bad2 = tmp.path().join("truncmeta");
    copy_dir(&src, &bad2);
    let m = bad2.join(".metadata");
    let data = std::fs::read(&m).unwrap();
    std::fs::write(&m, &data[..data.len() / 2]).unwrap();
    let e = import_dcp(&bad2, &tmp.path().join("x2"), &DcpImportOptions::default()).unwrap_err();
    assert!(matches!(e, FormatError::Pickle { .. }), "{e}");
    // A chunk whose bytes are garbage (not a torch.save archive).
    let bad3 = tmp.path().join("garbage");
    copy_dir(&src, &bad3);
    std::fs::write(bad3.join("__0_0.distcp"), vec![0x5a; 1641]).unwrap();
    let e = import_dcp(&bad3, &tmp.path().join("x3"), &DcpImportOptions::default()).unwrap_err();
    assert!(
        matches!(&e, FormatError::Dcp { item, .. } if item == "model.w"),
        "{e}"
    );
    for x in ["x1", "x2", "x3"] {
        assert!(!tmp.path().join(x).join("zarr.json").exists());
    }
}

fn copy_dir(a: &Path, b: &Path) {
    std::fs::create_dir_all(b).unwrap();
    for e in std::fs::read_dir(a).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), b.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_metadata_pickle_calling_os_system_runs_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("evil");
    let marker = tmp.path().join("PWNED");
    make("evil", &src, &[&marker]);
    let e = import_dcp(&src, &tmp.path().join("out"), &DcpImportOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, FormatError::Pickle { .. }) && msg.contains("system"),
        "{msg}"
    );
    assert!(!marker.exists(), "the pickle ran");
    assert!(!tmp.path().join("out").exists());
}

#[test]
fn huge_declared_sizes_and_non_plain_values_are_typed_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("huge");
    make("huge", &src, &[]);
    let e = import_dcp(&src, &tmp.path().join("o1"), &DcpImportOptions::default()).unwrap_err();
    assert!(
        matches!(&e, FormatError::Dcp { item, .. } if item == "x"),
        "{e}"
    );
    let src = tmp.path().join("object");
    make("object", &src, &[]);
    let e = import_dcp(&src, &tmp.path().join("o2"), &DcpImportOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, FormatError::Pickle { item, .. } if item == "odd") && msg.contains(".set`"),
        "{msg}"
    );
}

/// The `dcp_pickle` fuzz seeds (and any crash regressions) replayed, and every prefix of the
/// real DCP seeds (truncation at each byte).
#[test]
fn fuzz_dcp_pickle_inputs() {
    let root = repo().join("fuzz");
    let mut n = 0;
    for kind in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(kind).join("dcp_pickle")) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            let bytes = std::fs::read(&p).unwrap();
            fuzz_checks::check_dcp_pickle(&bytes);
            for cut in (0..bytes.len()).step_by(13) {
                fuzz_checks::check_dcp_pickle(&bytes[..cut]);
            }
            n += 1;
        }
    }
    assert!(n >= 5, "seeds exist");
    // The real metadata seed parses, the tensor item decodes to the saved values.
    let md = std::fs::read(root.join("seeds/dcp_pickle/metadata")).unwrap();
    let md = zarrckpt::convert::dcp::DcpMetadata::parse(Path::new("metadata"), &md).unwrap();
    assert_eq!(md.entries.len(), 7);
    let item = std::fs::read(root.join("seeds/dcp_pickle/item_w")).unwrap();
    let zarrckpt::convert::dcp::ItemValue::Tensor { dtype, shape, data } =
        zarrckpt::convert::dcp::read_item(Path::new("item"), "w", &item).unwrap()
    else {
        panic!("not a tensor");
    };
    assert_eq!((dtype, shape), (zarrckpt::DType::Float32, vec![3, 4]));
    let want: Vec<u8> = (0..12).flat_map(|i| (i as f32).to_le_bytes()).collect();
    assert_eq!(&*data, &want[..]);
}
