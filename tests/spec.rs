//! The format spec (`spec/format.md`) and its JSON Schema (`spec/schema/zarrckpt.schema.json`)
//! agree with the code.
//!
//! Every fenced example in the spec is preceded by a tag `<!-- example {...} -->` whose JSON
//! says what kind of example it is; these tests extract them and check each against the code:
//! root and array documents, key mappings, collisions, chunk grids, and the exact bytes of
//! shard files. Checkpoints written by `zarrckpt::save` are checked against the schema and
//! read back with a small reader written from the spec alone (not from the crate's reader).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use zarrckpt::comm::run_local;
use zarrckpt::model::key::check_collisions;
use zarrckpt::plan::GridOptions;
use zarrckpt::plan::grid;
use zarrckpt::storage::array::{array_metadata, array_metadata_for};
use zarrckpt::storage::meta::tensor_path;
use zarrckpt::storage::{CheckpointMeta, Compression, StorageError};
use zarrckpt::{
    Checkpoint, DType, Error, LocalComm, Region, SaveOptions, ShardedTensor, TensorKey, save,
};

// ---------------------------------------------------------------------------------------------
// Reading the spec
// ---------------------------------------------------------------------------------------------

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One tagged example: the tag's JSON, the fence's info string, its body and where it starts.
#[derive(Debug, Clone)]
struct Example {
    tag: Value,
    info: String,
    body: String,
    line: usize,
}

impl Example {
    fn kind(&self) -> &str {
        self.tag["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("line {}: tag without kind", self.line))
    }
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| {
            panic!(
                "spec line {}: example is not JSON: {e}\n{}",
                self.line, self.body
            )
        })
    }
    /// The bytes of a hex example: whitespace-separated byte pairs, `#` starts a comment.
    fn hex(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for l in self.body.lines() {
            let code = l.split('#').next().unwrap_or("");
            for tok in code.split_whitespace() {
                assert_eq!(
                    tok.len(),
                    2,
                    "spec line {}: `{tok}` is not one hex byte",
                    self.line
                );
                out.push(
                    u8::from_str_radix(tok, 16)
                        .unwrap_or_else(|e| panic!("spec line {}: `{tok}`: {e}", self.line)),
                );
            }
        }
        out
    }
}

fn spec_text() -> String {
    std::fs::read_to_string(manifest().join("spec/format.md")).expect("spec/format.md")
}

/// Extracts every tagged fenced block; panics on a tag not followed by a fence and on a
/// ```json fence without a tag, so no JSON in the spec escapes testing.
fn examples() -> Vec<Example> {
    let text = spec_text();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut pending: Option<(Value, usize)> = None;
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i].trim();
        if let Some(rest) = l.strip_prefix("<!-- example") {
            let inner = rest
                .strip_suffix("-->")
                .unwrap_or_else(|| panic!("line {}: tag not closed", i + 1))
                .trim();
            let tag: Value = serde_json::from_str(inner)
                .unwrap_or_else(|e| panic!("line {}: tag is not JSON: {e}", i + 1));
            assert!(pending.is_none(), "line {}: two tags in a row", i + 1);
            pending = Some((tag, i + 1));
        } else if let Some(info) = l.strip_prefix("```") {
            let start = i + 1;
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && lines[i].trim() != "```" {
                body.push(lines[i]);
                i += 1;
            }
            assert!(i < lines.len(), "line {start}: fence not closed");
            match pending.take() {
                Some((tag, _)) => out.push(Example {
                    tag,
                    info: info.to_owned(),
                    body: body.join("\n"),
                    line: start,
                }),
                None => assert!(
                    !info.starts_with("json"),
                    "line {start}: ```json block without an example tag"
                ),
            }
        } else if !l.is_empty()
            && let Some((_, at)) = &pending
        {
            panic!("line {at}: example tag not followed by a fenced block");
        }
        i += 1;
    }
    assert!(pending.is_none(), "example tag at the end of the spec");
    out
}

fn of_kind(kind: &str) -> Vec<Example> {
    examples()
        .into_iter()
        .filter(|e| e.kind() == kind)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The schema
// ---------------------------------------------------------------------------------------------

fn schema() -> Value {
    let text = std::fs::read_to_string(manifest().join("spec/schema/zarrckpt.schema.json"))
        .expect("schema file");
    serde_json::from_str(&text).expect("schema is JSON")
}

/// A validator for the schema's top level (the `zarrckpt` attribute) or for one of its `$defs`.
fn validator(def: Option<&str>) -> jsonschema::Validator {
    let mut s = schema();
    if let Some(d) = def {
        assert!(s["$defs"].get(d).is_some(), "schema has no $defs/{d}");
        s["$ref"] = Value::from(format!("#/$defs/{d}"));
    }
    jsonschema::draft202012::new(&s).expect("schema compiles")
}

fn schema_errors(v: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    v.iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path))
        .collect()
}

fn assert_valid(v: &jsonschema::Validator, doc: &Value, what: &str) {
    let errors = schema_errors(v, doc);
    assert!(
        errors.is_empty(),
        "{what} does not validate:\n{}\n{doc:#}",
        errors.join("\n")
    );
}

fn parse_root(doc: &Value) -> Result<CheckpointMeta, StorageError> {
    CheckpointMeta::from_root_json(
        &serde_json::to_vec(doc).unwrap(),
        Path::new("spec/zarr.json"),
    )
}

// ---------------------------------------------------------------------------------------------
// Small helpers written from the spec (not from the crate's internals)
// ---------------------------------------------------------------------------------------------

fn dtype(name: &str) -> DType {
    DType::from_name(name).unwrap_or_else(|| panic!("unknown dtype {name}"))
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Element bytes of a JSON number for a data type (only those the examples use).
fn element_bytes(d: DType, v: &Value) -> Vec<u8> {
    match d {
        DType::Bool => vec![u8::from(v.as_bool().unwrap())],
        DType::Int8 => (v.as_i64().unwrap() as i8).to_le_bytes().to_vec(),
        DType::UInt8 => (v.as_u64().unwrap() as u8).to_le_bytes().to_vec(),
        DType::Int16 => (v.as_i64().unwrap() as i16).to_le_bytes().to_vec(),
        DType::UInt16 => (v.as_u64().unwrap() as u16).to_le_bytes().to_vec(),
        DType::Int32 => (v.as_i64().unwrap() as i32).to_le_bytes().to_vec(),
        DType::UInt32 => (v.as_u64().unwrap() as u32).to_le_bytes().to_vec(),
        DType::Int64 => v.as_i64().unwrap().to_le_bytes().to_vec(),
        DType::UInt64 => v.as_u64().unwrap().to_le_bytes().to_vec(),
        DType::Float32 => (v.as_f64().unwrap() as f32).to_le_bytes().to_vec(),
        DType::Float64 => v.as_f64().unwrap().to_le_bytes().to_vec(),
        other => panic!("examples do not use {other}"),
    }
}

/// Row-major strides (in elements) of a shape.
fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Every index of a box `[0, shape)` in C order.
fn indices(shape: &[u64]) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    grid::for_each_index(&vec![0; shape.len()], shape, |i| out.push(i.to_vec()));
    out
}

/// Copies the elements of box `b` (global coordinates) from a C-order buffer of `from_box`
/// into a C-order buffer of `to_box`; both boxes contain `b`.
fn copy_box(
    src: &[u8],
    from_box: &Region,
    dst: &mut [u8],
    to_box: &Region,
    b: &Region,
    elem: usize,
) {
    let (fs, ts) = (strides(&from_box.shape), strides(&to_box.shape));
    for rel in indices(&b.shape) {
        let g: Vec<u64> = rel.iter().zip(&b.offset).map(|(r, o)| r + o).collect();
        let fi: u64 = g
            .iter()
            .zip(&from_box.offset)
            .zip(&fs)
            .map(|((g, o), s)| (g - o) * s)
            .sum();
        let ti: u64 = g
            .iter()
            .zip(&to_box.offset)
            .zip(&ts)
            .map(|((g, o), s)| (g - o) * s)
            .sum();
        let (fi, ti) = (fi as usize * elem, ti as usize * elem);
        dst[ti..ti + elem].copy_from_slice(&src[fi..fi + elem]);
    }
}

fn intersect(a: &Region, b: &Region) -> Option<Region> {
    a.intersect(b)
}

/// The chunk key (file name) of grid index `idx` under the `default` encoding with `.`.
fn chunk_key(idx: &[u64]) -> String {
    std::iter::once("c".to_owned())
        .chain(idx.iter().map(u64::to_string))
        .collect::<Vec<_>>()
        .join(".")
}

/// Encodes one shard exactly as spec section 7 says (uncompressed inner codecs).
fn spec_encode_shard(
    full: &[u8],
    shape: &[u64],
    chunk_shape: &[u64],
    sub_shape: &[u64],
    elem: usize,
    chunk: &[u64],
) -> Vec<u8> {
    let origin: Vec<u64> = chunk.iter().zip(chunk_shape).map(|(i, c)| i * c).collect();
    let chunk_box = Region {
        offset: origin.clone(),
        shape: chunk_shape.to_vec(),
    };
    let tensor_box = Region::full(shape);
    let n: u64 = chunk_shape.iter().product();
    let mut chunk_buf = vec![0u8; n as usize * elem]; // padding is zero
    if let Some(inside) = intersect(&chunk_box, &tensor_box) {
        copy_box(full, &tensor_box, &mut chunk_buf, &chunk_box, &inside, elem);
    }
    let per: Vec<u64> = chunk_shape
        .iter()
        .zip(sub_shape)
        .map(|(c, s)| c / s)
        .collect();
    let mut data = Vec::new();
    let mut index = Vec::new();
    for s in indices(&per) {
        let sub_box = Region {
            offset: s
                .iter()
                .zip(sub_shape)
                .zip(&origin)
                .map(|((i, n), o)| o + i * n)
                .collect(),
            shape: sub_shape.to_vec(),
        };
        let mut sub = vec![0u8; sub_shape.iter().product::<u64>() as usize * elem];
        copy_box(&chunk_buf, &chunk_box, &mut sub, &sub_box, &sub_box, elem);
        if sub.iter().all(|&b| b == 0) {
            index.extend_from_slice(&u64::MAX.to_le_bytes());
            index.extend_from_slice(&u64::MAX.to_le_bytes());
        } else {
            let crc = crc32c::crc32c(&sub);
            index.extend_from_slice(&(data.len() as u64).to_le_bytes());
            index.extend_from_slice(&(sub.len() as u64 + 4).to_le_bytes());
            data.extend_from_slice(&sub);
            data.extend_from_slice(&crc.to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&index);
    data.extend_from_slice(&index);
    data.extend_from_slice(&crc.to_le_bytes());
    data
}

/// Reads a whole tensor of a committed checkpoint following spec section 11 only (raw files,
/// serde_json and crc32c). Compressed subchunks are checked (bounds, crc32c) but not decoded;
/// returns `None` for the data then.
fn spec_read_tensor(dir: &Path, key: &str) -> Result<Option<Vec<u8>>, String> {
    let root: Value =
        serde_json::from_slice(&std::fs::read(dir.join("zarr.json")).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let idx = &root["attributes"]["zarrckpt"];
    if idx["format"] != "zarrckpt" || !idx["version"].as_str().unwrap_or("").starts_with("1.") {
        return Err("not a v1 zarrckpt checkpoint".into());
    }
    let e = &idx["tensors"][key];
    let path = e["path"].as_str().ok_or("no such tensor")?;
    if path != tensor_path(&TensorKey::new(key).map_err(|e| e.to_string())?) {
        return Err(format!("path {path} does not follow the key mapping"));
    }
    let d = dtype(e["dtype"].as_str().unwrap());
    let elem = d.size();
    let (shape, chunk_shape, sub_shape) = (
        u64s(&e["shape"]),
        u64s(&e["chunk_shape"]),
        u64s(&e["subchunk_shape"]),
    );
    let compressed = e["compression"] != "none";
    let array_dir = dir.join(path);
    let arr: Value = serde_json::from_slice(
        &std::fs::read(array_dir.join("zarr.json")).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    // Format 1.1: the index names the save; the array's attributes and every shard's footer
    // must name the same one.
    let save_id = idx["save_id"].as_str().map(str::to_owned);
    let mut expected_arr = array_metadata(
        &TensorKey::new(key).unwrap(),
        &serde_json::from_value(e.clone()).unwrap(),
    );
    if let Some(id) = &save_id {
        expected_arr["attributes"]["zarrckpt"]["save_id"] = json!(id);
    }
    if arr != expected_arr {
        return Err("array zarr.json disagrees with the index".into());
    }
    let tensor_box = Region::full(&shape);
    let mut out = vec![0u8; shape.iter().product::<u64>() as usize * elem];
    let per: Vec<u64> = chunk_shape
        .iter()
        .zip(&sub_shape)
        .map(|(c, s)| c / s)
        .collect();
    let n_sub: u64 = per.iter().product();
    let sub_bytes = sub_shape.iter().product::<u64>() * elem as u64;
    let index_len = 16 * n_sub + 4;
    let footer_len = if save_id.is_some() {
        spec_footer_len(shape.len(), n_sub)
    } else {
        0
    };
    for chunk in indices(&grid::grid_shape(&shape, &chunk_shape)) {
        let file = array_dir.join(chunk_key(&chunk));
        let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let len = bytes.len() as u64;
        if len < index_len + footer_len {
            return Err(format!("{}: shorter than the index", file.display()));
        }
        let data_end = len - index_len - footer_len;
        let index = &bytes[(len - index_len) as usize..(len - 4) as usize];
        let footer_crcs = match &save_id {
            Some(id) => Some(
                spec_check_footer(
                    &bytes[data_end as usize..(len - index_len) as usize],
                    id,
                    key,
                    &chunk,
                    n_sub,
                )
                .map_err(|e| format!("{}: {e}", file.display()))?,
            ),
            None => None,
        };
        let stored = u32::from_le_bytes(bytes[(len - 4) as usize..].try_into().unwrap());
        if crc32c::crc32c(index) != stored {
            return Err(format!("{}: index crc32c mismatch", file.display()));
        }
        let origin: Vec<u64> = chunk.iter().zip(&chunk_shape).map(|(i, c)| i * c).collect();
        for (linear, s) in indices(&per).into_iter().enumerate() {
            let off = u64::from_le_bytes(index[linear * 16..linear * 16 + 8].try_into().unwrap());
            let nbytes =
                u64::from_le_bytes(index[linear * 16 + 8..linear * 16 + 16].try_into().unwrap());
            if off == u64::MAX && nbytes == u64::MAX {
                continue; // absent: all zero, `out` already is
            }
            if off.checked_add(nbytes).is_none_or(|end| end > data_end) || nbytes < 4 {
                return Err(format!(
                    "{}: subchunk {linear} out of bounds",
                    file.display()
                ));
            }
            if !compressed && nbytes != sub_bytes + 4 {
                return Err(format!(
                    "{}: subchunk {linear} has {nbytes} bytes",
                    file.display()
                ));
            }
            let raw = &bytes[off as usize..(off + nbytes) as usize];
            let (payload, crc) = raw.split_at(raw.len() - 4);
            let crc = u32::from_le_bytes(crc.try_into().unwrap());
            if crc32c::crc32c(payload) != crc {
                return Err(format!(
                    "{}: subchunk {linear} crc32c mismatch",
                    file.display()
                ));
            }
            if footer_crcs.as_ref().is_some_and(|f| f[linear] != crc) {
                return Err(format!(
                    "{}: subchunk {linear} is not the one the footer names",
                    file.display()
                ));
            }
            if compressed {
                continue;
            }
            let sub_box = Region {
                offset: s
                    .iter()
                    .zip(&sub_shape)
                    .zip(&origin)
                    .map(|((i, n), o)| o + i * n)
                    .collect(),
                shape: sub_shape.clone(),
            };
            if let Some(inside) = intersect(&sub_box, &tensor_box) {
                copy_box(payload, &sub_box, &mut out, &tensor_box, &inside, elem);
            }
        }
    }
    Ok(if compressed { None } else { Some(out) })
}

/// The footer's length by section 7.2: 52 bytes, 8 per dimension, 4 per subchunk, 4.
fn spec_footer_len(ndim: usize, n_sub: u64) -> u64 {
    52 + 8 * ndim as u64 + 4 * n_sub
}

/// Checks a footer by section 7.2, independently of the crate; returns the subchunk crcs.
fn spec_check_footer(
    f: &[u8],
    save_id: &str,
    key: &str,
    chunk: &[u64],
    n_sub: u64,
) -> Result<Vec<u32>, String> {
    let u32_at = |at: usize| u32::from_le_bytes(f[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(f[at..at + 8].try_into().unwrap());
    let body = &f[..f.len() - 4];
    if crc32c::crc32c(body) != u32_at(f.len() - 4) {
        return Err("footer crc32c mismatch".into());
    }
    if &f[..8] != b"ZCKPFOOT" || u32_at(8) != 1 || u32_at(12) as usize != chunk.len() {
        return Err("bad footer magic, version or dimensions".into());
    }
    let id: String = f[16..32].iter().map(|b| format!("{b:02x}")).collect();
    if id != save_id {
        return Err(format!("footer names save {id}, the index {save_id}"));
    }
    if u64_at(32) != xxhash_rust::xxh3::xxh3_64(key.as_bytes()) || u64_at(40) != n_sub {
        return Err("footer names another tensor or geometry".into());
    }
    for (d, c) in chunk.iter().enumerate() {
        if u64_at(48 + 8 * d) != *c {
            return Err("footer names another chunk".into());
        }
    }
    let start = 48 + 8 * chunk.len();
    Ok((0..n_sub as usize).map(|i| u32_at(start + 4 * i)).collect())
}

/// A 1.1 shard file without its footer: the bytes a 1.0 writer wrote.
fn strip_footer(bytes: &[u8], ndim: usize, n_sub: u64) -> Vec<u8> {
    let (index_len, foot) = (
        (16 * n_sub + 4) as usize,
        spec_footer_len(ndim, n_sub) as usize,
    );
    let data_end = bytes.len() - index_len - foot;
    let mut out = bytes[..data_end].to_vec();
    out.extend_from_slice(&bytes[bytes.len() - index_len..]);
    out
}

/// Every file under `dir`, relative, with `/` separators.
fn list_files(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(
                    p.strip_prefix(dir)
                        .unwrap()
                        .to_string_lossy()
                        .replace('\\', "/"),
                );
            }
        }
    }
    out
}

/// The files spec section 2 says a committed checkpoint with this index has, exactly.
fn expected_files(meta: &CheckpointMeta) -> BTreeSet<String> {
    let mut out = BTreeSet::from(["zarr.json".to_owned(), "tensors/zarr.json".to_owned()]);
    for (key, e) in &meta.tensors {
        assert_eq!(e.path, tensor_path(key));
        let segs: Vec<&str> = e.path.split('/').collect();
        for i in 2..segs.len() {
            out.insert(format!("{}/zarr.json", segs[..i].join("/")));
        }
        out.insert(format!("{}/zarr.json", e.path));
        for c in indices(&grid::grid_shape(&e.shape, &e.chunk_shape)) {
            out.insert(format!("{}/{}", e.path, chunk_key(&c)));
        }
    }
    out
}

/// Checks a committed checkpoint against the spec: schema, index, array documents, groups,
/// exact file set, and (uncompressed) contents read with the spec's algorithm.
fn check_checkpoint(dir: &Path, expect: &BTreeMap<String, Vec<u8>>) -> CheckpointMeta {
    let root: Value =
        serde_json::from_slice(&std::fs::read(dir.join("zarr.json")).unwrap()).unwrap();
    assert_valid(
        &validator(Some("root")),
        &root,
        "root zarr.json of a saved checkpoint",
    );
    assert_valid(
        &validator(None),
        &root["attributes"]["zarrckpt"],
        "zarrckpt attribute of a saved checkpoint",
    );
    let meta = parse_root(&root).unwrap();
    assert_eq!(meta.version, "1.1");
    assert!(meta.save_id.is_some());
    assert_eq!(meta.format, "zarrckpt");
    let files = list_files(dir);
    assert_eq!(
        files,
        expected_files(&meta),
        "file layout of {}",
        dir.display()
    );
    let (groups, arrays) = (validator(Some("group")), validator(Some("array")));
    for f in &files {
        if f == "zarr.json" || !f.ends_with("zarr.json") {
            continue;
        }
        let doc: Value = serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap();
        let node = f.trim_end_matches("/zarr.json");
        match meta.tensors.iter().find(|(_, e)| e.path == node) {
            Some((key, e)) => {
                assert_eq!(doc, array_metadata_for(key, e, meta.save_id), "{f}");
                assert_valid(&arrays, &doc, f);
            }
            None => assert_valid(&groups, &doc, f),
        }
    }
    for (key, want) in expect {
        let got = spec_read_tensor(dir, key).unwrap_or_else(|e| panic!("{key}: {e}"));
        if let Some(got) = got {
            assert_eq!(&got, want, "{key} read back with the spec's algorithm");
        }
    }
    meta
}

/// Deterministic test bytes with runs of zeros, so that some subchunks are absent.
fn test_bytes(seed: u64, n_elems: u64, d: DType) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::new();
    for i in 0..n_elems {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let zero = (i / 7) % 3 == 1;
        for b in &x.to_le_bytes()[..d.size()] {
            out.push(if zero {
                0
            } else if d == DType::Bool {
                b & 1
            } else {
                *b
            });
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn every_example_is_tagged_parses_and_is_counted() {
    let all = examples();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for e in &all {
        *counts.entry(e.kind().to_owned()).or_default() += 1;
        if e.info.starts_with("json") {
            e.json();
        } else {
            assert!(!e.hex().is_empty(), "line {}: empty hex example", e.line);
        }
    }
    let want = [
        ("root", 2),
        ("array", 5),
        ("group", 1),
        ("keys", 1),
        ("collisions", 1),
        ("grid", 1),
        ("shard", 5),
        ("crc32c", 1),
    ];
    for (kind, n) in want {
        assert!(
            counts.get(kind).copied().unwrap_or(0) >= n,
            "expected at least {n} `{kind}` examples, found {counts:?}"
        );
    }
    let known: BTreeSet<&str> = want.iter().map(|(k, _)| *k).collect();
    for k in counts.keys() {
        assert!(known.contains(k.as_str()), "unknown example kind `{k}`");
    }
}

#[test]
fn schema_is_a_valid_draft_2020_12_schema() {
    let s = schema();
    assert_eq!(s["$schema"], "https://json-schema.org/draft/2020-12/schema");
    jsonschema::draft202012::meta::validate(&s)
        .expect("schema validates against the 2020-12 meta-schema");
    for d in ["root", "group", "array", "tensor_entry", "key", "node_path"] {
        validator(Some(d));
    }
}

#[test]
fn root_examples_validate_and_parse() {
    let roots = of_kind("root");
    for ex in &roots {
        let doc = ex.json();
        assert_valid(
            &validator(Some("root")),
            &doc,
            &format!("root example at line {}", ex.line),
        );
        assert_valid(
            &validator(None),
            &doc["attributes"]["zarrckpt"],
            &format!("attribute at line {}", ex.line),
        );
        let meta = parse_root(&doc).unwrap_or_else(|e| panic!("line {}: {e}", ex.line));
        // What the writer would emit for this index is the example itself.
        let again: Value = serde_json::from_slice(&meta.to_root_json()).unwrap();
        assert_eq!(
            again, doc,
            "line {}: the writer's document differs from the example",
            ex.line
        );
        assert!(!meta.tensors.is_empty());
    }
}

fn root_by_id(id: &str) -> Value {
    of_kind("root")
        .into_iter()
        .find(|e| e.tag["id"] == id)
        .unwrap_or_else(|| panic!("no root example with id {id}"))
        .json()
}

#[test]
fn array_examples_equal_what_the_writer_produces() {
    for ex in of_kind("array") {
        let root = root_by_id(ex.tag["root"].as_str().unwrap());
        let key_s = ex.tag["key"].as_str().unwrap();
        let meta = parse_root(&root).unwrap();
        let key = TensorKey::new(key_s).unwrap();
        let entry = meta
            .tensors
            .get(&key)
            .unwrap_or_else(|| panic!("line {}: {key_s} not in its root", ex.line));
        let doc = ex.json();
        assert_eq!(
            doc,
            array_metadata(&key, entry),
            "line {}: array example for {key_s}",
            ex.line
        );
        assert_valid(
            &validator(Some("array")),
            &doc,
            &format!("array example at line {}", ex.line),
        );
    }
}

#[test]
fn group_example_matches_saved_groups() {
    let ex = of_kind("group").pop().unwrap();
    let doc = ex.json();
    assert_valid(&validator(Some("group")), &doc, "group example");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let v = [1u8];
    let pieces = [ShardedTensor::from_slice("a/b", &[1], &[0], &v, &[1], 0).unwrap()];
    save(&pieces, &dir, &LocalComm::single(), &SaveOptions::default()).unwrap();
    for g in ["tensors/zarr.json", "tensors/a/zarr.json"] {
        let saved: Value = serde_json::from_slice(&std::fs::read(dir.join(g)).unwrap()).unwrap();
        assert_eq!(saved, doc, "{g}");
    }
    // Anything else is not the group document.
    assert!(
        !validator(Some("group"))
            .is_valid(&json!({"zarr_format": 3, "node_type": "group", "attributes": {"x": 1}}))
    );
}

#[test]
fn key_examples_map_and_reject_as_specified() {
    for ex in of_kind("keys") {
        for case in ex.json().as_array().unwrap() {
            // `repeat` repeats the key and the path.
            let times = case
                .get("repeat")
                .map_or(1, |n| n.as_u64().unwrap() as usize);
            let key = case["key"].as_str().unwrap().repeat(times);
            let shown: String = key.chars().take(40).collect();
            let keys_schema = validator(Some("key"));
            match (case.get("path"), case.get("error")) {
                (Some(path), None) => {
                    let path = path.as_str().unwrap().repeat(times);
                    let k =
                        TensorKey::new(key.as_str()).unwrap_or_else(|e| panic!("`{shown}`: {e}"));
                    assert_eq!(k.node_path(), path, "`{shown}`");
                    assert_eq!(tensor_path(&k), format!("tensors/{path}"));
                    assert!(
                        keys_schema.is_valid(&Value::from(key.clone())),
                        "schema rejects `{shown}`"
                    );
                    assert!(
                        validator(Some("node_path")).is_valid(&Value::from(tensor_path(&k))),
                        "{shown}"
                    );
                }
                (None, Some(err)) => {
                    let e = TensorKey::new(key.as_str()).expect_err(&shown);
                    let name = format!("{e:?}");
                    assert!(
                        name.starts_with(err.as_str().unwrap()),
                        "`{shown}`: got {name}"
                    );
                    // The schema's pattern catches all but the byte-length limits.
                    if !matches!(err.as_str(), Some("TooLong" | "SegmentTooLong")) {
                        assert!(
                            !keys_schema.is_valid(&Value::from(key.clone())),
                            "schema accepts `{shown}`"
                        );
                    }
                }
                _ => panic!("line {}: case needs `path` or `error`: {case}", ex.line),
            }
        }
    }
}

#[test]
fn collision_examples_behave_as_specified() {
    for ex in of_kind("collisions") {
        for case in ex.json().as_array().unwrap() {
            let keys: Vec<TensorKey> = case["keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| TensorKey::new(k.as_str().unwrap()).unwrap())
                .collect();
            let collides = case["collides"].as_bool().unwrap();
            assert_eq!(check_collisions(&keys).is_err(), collides, "{case}");
        }
    }
}

#[test]
fn grid_examples_are_what_the_planner_chooses() {
    let opts = GridOptions::default();
    assert_eq!(
        opts.subchunk_target_bytes,
        1 << 20,
        "spec section 8 states the defaults"
    );
    assert_eq!(
        opts.min_chunk_bytes,
        1 << 20,
        "spec section 8 states the defaults"
    );
    for ex in of_kind("grid") {
        for case in ex.json().as_array().unwrap() {
            let shape = u64s(&case["shape"]);
            let elem = dtype(case["dtype"].as_str().unwrap()).size();
            let pieces: Vec<Region> = case["pieces"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| Region::new(u64s(&p[0]), u64s(&p[1])).unwrap())
                .collect();
            let refs: Vec<&Region> = pieces.iter().collect();
            let (chunk, aligned) = grid::choose_chunk_shape(&shape, &refs, elem, &opts);
            assert_eq!(chunk, u64s(&case["chunk_shape"]), "{case}");
            assert_eq!(aligned, case["aligned"].as_bool().unwrap(), "{case}");
            let sub = grid::subchunk_shape(&chunk, &shape, elem, opts.subchunk_target_bytes);
            assert_eq!(sub, u64s(&case["subchunk_shape"]), "{case}");
        }
    }
}

#[test]
fn crc32c_check_value() {
    let ex = of_kind("crc32c").pop().unwrap();
    let input = ex.tag["input"].as_str().unwrap();
    assert_eq!(
        crc32c::crc32c(input.as_bytes()).to_le_bytes().to_vec(),
        ex.hex()
    );
}

#[test]
fn shard_examples_are_byte_exact() {
    for ex in of_kind("shard") {
        let t = &ex.tag;
        let d = dtype(t["dtype"].as_str().unwrap());
        let shape = u64s(&t["shape"]);
        let data: Vec<u8> = t["data"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|v| element_bytes(d, v))
            .collect();
        let full = Region::full(&shape);
        let regions: Vec<Region> = t["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| Region::new(u64s(&p[0]), u64s(&p[1])).unwrap())
            .collect();
        let datas: Vec<Vec<u8>> = regions
            .iter()
            .map(|r| {
                let mut out = vec![0u8; r.shape.iter().product::<u64>() as usize * d.size()];
                copy_box(&data, &full, &mut out, r, r, d.size());
                out
            })
            .collect();
        let key = TensorKey::new("t").unwrap();
        let pieces: Vec<ShardedTensor> = regions
            .iter()
            .zip(&datas)
            .map(|(r, b)| {
                ShardedTensor::new(key.clone(), d, shape.clone(), r.clone(), 0, b).unwrap()
            })
            .collect();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let opts = SaveOptions {
            grid: GridOptions {
                subchunk_target_bytes: t["subchunk_target_bytes"].as_u64().unwrap(),
                ..GridOptions::default()
            },
            ..SaveOptions::default()
        };
        save(&pieces, &dir, &LocalComm::single(), &opts).unwrap();
        let meta = check_checkpoint(&dir, &BTreeMap::from([("t".to_owned(), data.clone())]));
        let e = &meta.tensors[&key];
        let (chunk_shape, sub_shape) = (u64s(&t["chunk_shape"]), u64s(&t["subchunk_shape"]));
        assert_eq!(
            (&e.chunk_shape, &e.subchunk_shape),
            (&chunk_shape, &sub_shape),
            "line {}",
            ex.line
        );
        let file = t["file"].as_str().unwrap();
        let n_sub: u64 = chunk_shape
            .iter()
            .zip(&sub_shape)
            .map(|(c, s)| c / s)
            .product();
        let written = strip_footer(
            &std::fs::read(dir.join("tensors/t").join(file)).unwrap(),
            shape.len(),
            n_sub,
        );
        let hex = ex.hex();
        assert_eq!(
            written, hex,
            "line {}: {file} as written differs from the spec's bytes",
            ex.line
        );
        let idx: Vec<u64> = file
            .split('.')
            .skip(1)
            .map(|s| s.parse().unwrap())
            .collect();
        let by_rules = spec_encode_shard(&data, &shape, &chunk_shape, &sub_shape, d.size(), &idx);
        assert_eq!(
            by_rules, hex,
            "line {}: the spec's rules give other bytes than its example",
            ex.line
        );
    }
}

#[test]
fn saved_checkpoints_conform_every_dtype_and_edge_case() {
    // (key, dtype, shape, pieces along axis 0 as (offset, len), or None for one whole piece)
    type Case = (&'static str, DType, Vec<u64>, Option<Vec<(u64, u64)>>);
    let cases: Vec<Case> = vec![
        ("flags/bool", DType::Bool, vec![37], None),
        ("ints/int8", DType::Int8, vec![5, 7], None),
        (
            "ints/int16",
            DType::Int16,
            vec![9, 4],
            Some(vec![(0, 4), (4, 5)]),
        ),
        ("ints/int32", DType::Int32, vec![3, 3, 3], None),
        ("ints/int64", DType::Int64, vec![], None),
        (
            "uints/uint8",
            DType::UInt8,
            vec![300],
            Some(vec![(0, 100), (100, 200)]),
        ),
        ("uints/uint16", DType::UInt16, vec![0, 4], None),
        (
            "uints/uint32",
            DType::UInt32,
            vec![10, 2],
            Some(vec![(0, 3), (3, 3), (6, 3), (9, 1)]),
        ),
        ("uints/uint64", DType::UInt64, vec![4], None),
        ("floats/float16", DType::Float16, vec![33, 5], None),
        (
            "floats/bfloat16",
            DType::BFloat16,
            vec![64, 64],
            Some(vec![(0, 32), (32, 32)]),
        ),
        (
            "floats/float32",
            DType::Float32,
            vec![6, 10],
            Some(vec![(0, 4), (4, 2)]),
        ),
        ("floats/float64", DType::Float64, vec![2, 2, 2, 2], None),
        ("fp8/float8_e4m3fn", DType::Float8E4M3FN, vec![16, 9], None),
        ("fp8/float8_e5m2", DType::Float8E5M2, vec![7, 5, 3], None),
        ("odd keys/__reserved/a b~c", DType::Float32, vec![4], None),
        ("zeros", DType::Float32, vec![128], None),
    ];
    let mut fulls = BTreeMap::new();
    let mut datas: Vec<(usize, Region, Vec<u8>)> = Vec::new();
    for (i, (key, d, shape, split)) in cases.iter().enumerate() {
        let n: u64 = shape.iter().product();
        let full = if *key == "zeros" {
            vec![0u8; n as usize * d.size()]
        } else {
            test_bytes(i as u64, n, *d)
        };
        let whole = Region::full(shape);
        let regions: Vec<Region> = match split {
            None => vec![whole.clone()],
            Some(s) => s
                .iter()
                .map(|&(o, l)| {
                    let mut off = vec![0; shape.len()];
                    let mut sh = shape.clone();
                    off[0] = o;
                    sh[0] = l;
                    Region::new(off, sh).unwrap()
                })
                .collect(),
        };
        for r in regions {
            let mut b = vec![0u8; r.shape.iter().product::<u64>() as usize * d.size()];
            copy_box(&full, &whole, &mut b, &r, &r, d.size());
            datas.push((i, r, b));
        }
        fulls.insert((*key).to_owned(), full);
    }
    let pieces: Vec<ShardedTensor> = datas
        .iter()
        .map(|(i, r, b)| {
            let (key, d, shape, _) = &cases[*i];
            ShardedTensor::new(
                TensorKey::new(*key).unwrap(),
                *d,
                shape.clone(),
                r.clone(),
                0,
                b,
            )
            .unwrap()
        })
        .collect();
    for compression in [Compression::None, Compression::Zstd, Compression::Blosc] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let mut opts = SaveOptions {
            compression,
            grid: GridOptions {
                subchunk_target_bytes: 64,
                ..GridOptions::default()
            },
            ..SaveOptions::default()
        };
        opts.user_metadata.insert("iteration".into(), 7.into());
        save(&pieces, &dir, &LocalComm::single(), &opts).unwrap();
        let meta = check_checkpoint(&dir, &fulls);
        assert_eq!(meta.world_size, 1);
        assert_eq!(meta.user["iteration"], 7);
        assert_eq!(meta.tensors.len(), cases.len());
        assert!(meta.tensors.values().all(|e| e.compression == compression));
        let odd = &meta.tensors[&TensorKey::new("odd keys/__reserved/a b~c").unwrap()];
        assert_eq!(odd.path, "tensors/odd~20keys/~5F_reserved/a~20b~7Ec");
        // An all-zero chunk is still a file: just the index, every entry absent.
        let n_sub = 128 / 16; // 64-byte subchunks of float32
        let zeros = strip_footer(
            &std::fs::read(dir.join("tensors/zeros/c.0")).unwrap(),
            1,
            n_sub as u64,
        );
        assert_eq!(zeros.len(), 16 * n_sub + 4);
        assert!(zeros[..16 * n_sub].iter().all(|&b| b == 0xff));
        // The crate's own reader agrees with the spec's.
        let ck = Checkpoint::open(&dir).unwrap();
        for (key, full) in &fulls {
            assert_eq!(
                &ck.read_tensor(&TensorKey::new(key.as_str()).unwrap())
                    .unwrap(),
                full,
                "{key}"
            );
        }
        // Saving the same state again gives the same bytes, but for the save id (in the
        // metadata and the shard footers).
        let dir2 = tmp.path().join("again");
        save(&pieces, &dir2, &LocalComm::single(), &opts).unwrap();
        let meta2 = Checkpoint::open(&dir2).unwrap().meta().clone();
        assert_ne!(meta.save_id, meta2.save_id);
        let (id1, id2) = (meta.save_id.unwrap().hex(), meta2.save_id.unwrap().hex());
        for f in list_files(&dir) {
            let (a, b) = (
                std::fs::read(dir.join(&f)).unwrap(),
                std::fs::read(dir2.join(&f)).unwrap(),
            );
            if f.ends_with("zarr.json") {
                let b = String::from_utf8(b).unwrap().replace(&id2, &id1);
                assert_eq!(String::from_utf8(a).unwrap(), b, "{f}");
                continue;
            }
            let parent = Path::new(&f).parent().unwrap().to_str().unwrap().to_owned();
            let e = meta.tensors.values().find(|e| e.path == parent);
            let e = e.unwrap();
            let n_sub: u64 = e
                .chunk_shape
                .iter()
                .zip(&e.subchunk_shape)
                .map(|(c, s)| c / s)
                .product();
            let n = e.shape.len();
            assert_eq!(
                strip_footer(&a, n, n_sub),
                strip_footer(&b, n, n_sub),
                "{f}"
            );
        }
    }
}

#[test]
fn multi_rank_checkpoint_conforms() {
    // 3 ranks: a row-split tensor with tiny pieces (unaligned, coarse grid), a replicated
    // bias (main on rank 0, replicas elsewhere), and per-rank tensors.
    let shape = vec![10u64, 16];
    let full = test_bytes(1, 160, DType::Float32);
    let bias = test_bytes(2, 16, DType::Float32);
    let rows = [(0u64, 4u64), (4, 3), (7, 3)];
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let results = run_local(3, Duration::from_secs(60), |comm| {
        let r = zarrckpt::Communicator::rank(&comm);
        let (o, l) = rows[r];
        let region = Region::new(vec![o, 0], vec![l, 16]).unwrap();
        let mut mine = vec![0u8; (l * 16 * 4) as usize];
        copy_box(&full, &Region::full(&shape), &mut mine, &region, &region, 4);
        let own = vec![u8::try_from(r).unwrap(); 8];
        let pieces = vec![
            ShardedTensor::new(
                TensorKey::new("w").unwrap(),
                DType::Float32,
                shape.clone(),
                region,
                0,
                &mine,
            )
            .unwrap(),
            ShardedTensor::new(
                TensorKey::new("b").unwrap(),
                DType::Float32,
                vec![16],
                Region::full(&[16]),
                u32::from(r != 0),
                &bias,
            )
            .unwrap(),
            ShardedTensor::new(
                TensorKey::new(format!("rank/{r}")).unwrap(),
                DType::UInt8,
                vec![8],
                Region::full(&[8]),
                0,
                &own,
            )
            .unwrap(),
        ];
        save(&pieces, &dir, &comm, &SaveOptions::default()).map(|_| ())
    });
    for r in results {
        r.unwrap();
    }
    let mut expect = BTreeMap::from([
        ("w".to_owned(), full.clone()),
        ("b".to_owned(), bias.clone()),
    ]);
    for r in 0..3u8 {
        expect.insert(format!("rank/{r}"), vec![r; 8]);
    }
    let meta = check_checkpoint(&dir, &expect);
    assert_eq!(meta.world_size, 3);
    let w = &meta.tensors[&TensorKey::new("w").unwrap()];
    // gcd(4, 7) = 1 row of 64 bytes is tiny: coarse grid of the largest piece extent (4 rows).
    assert_eq!(w.chunk_shape, vec![4, 16]);
}

#[test]
fn invalid_documents_are_rejected() {
    let base = root_by_id("main");
    let key = "decoder.layers.0.mlp.linear_fc1.weight";
    type Mutation = (&'static str, Box<dyn Fn(&mut Value)>);
    // Rejected by both the schema and the crate's reader.
    let both: Vec<Mutation> = vec![
        (
            "version is a number",
            Box::new(|d| d["attributes"]["zarrckpt"]["version"] = json!(1.0)),
        ),
        (
            "version without minor",
            Box::new(|d| d["attributes"]["zarrckpt"]["version"] = json!("1")),
        ),
        (
            "other major version",
            Box::new(|d| d["attributes"]["zarrckpt"]["version"] = json!("2.0")),
        ),
        (
            "wrong format name",
            Box::new(|d| d["attributes"]["zarrckpt"]["format"] = json!("zarr")),
        ),
        (
            "missing world_size",
            Box::new(|d| {
                d["attributes"]["zarrckpt"]
                    .as_object_mut()
                    .unwrap()
                    .remove("world_size");
            }),
        ),
        (
            "missing tensors",
            Box::new(|d| {
                d["attributes"]["zarrckpt"]
                    .as_object_mut()
                    .unwrap()
                    .remove("tensors");
            }),
        ),
        (
            "missing dtype",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]
                    .as_object_mut()
                    .unwrap()
                    .remove("dtype");
            }),
        ),
        (
            "missing chunk_shape",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]
                    .as_object_mut()
                    .unwrap()
                    .remove("chunk_shape");
            }),
        ),
        (
            "path escapes with ..",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["path"] = json!("../../etc/passwd")
            }),
        ),
        (
            "path escapes inside",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["path"] =
                    json!("tensors/../../outside");
            }),
        ),
        (
            "absolute path",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["path"] = json!("/etc/passwd")
            }),
        ),
        (
            "registry float8_e4m3 is not float8_e4m3fn",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["dtype"] = json!("float8_e4m3");
            }),
        ),
        (
            "zero chunk extent",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["chunk_shape"] = json!([0, 2048])
            }),
        ),
        (
            "negative extent",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["shape"] = json!([-1, 2048])
            }),
        ),
        (
            "33 dimensions",
            Box::new(move |d| {
                let e = &mut d["attributes"]["zarrckpt"]["tensors"][key];
                e["shape"] = json!(vec![1; 33]);
                e["chunk_shape"] = json!(vec![1; 33]);
                e["subchunk_shape"] = json!(vec![1; 33]);
            }),
        ),
        (
            "unknown compression",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["compression"] = json!("lz4")
            }),
        ),
        (
            "key with a dot segment",
            Box::new(|d| {
                d["attributes"]["zarrckpt"]["tensors"]["../x"] = json!({
                "path": "tensors/~2E~2E/x", "dtype": "int8", "shape": [1], "chunk_shape": [1],
                "subchunk_shape": [1], "compression": "none"});
            }),
        ),
        (
            "user is not an object",
            Box::new(|d| d["attributes"]["zarrckpt"]["user"] = json!([1])),
        ),
        ("not a group", Box::new(|d| d["node_type"] = json!("array"))),
    ];
    let root_v = validator(Some("root"));
    assert_valid(&root_v, &base, "the unmodified main example");
    parse_root(&base).unwrap();
    for (what, m) in &both {
        let mut doc = base.clone();
        m(&mut doc);
        assert!(
            !root_v.is_valid(&doc),
            "schema accepts a document with {what}"
        );
        assert!(
            parse_root(&doc).is_err(),
            "reader accepts a document with {what}"
        );
    }
    let mut doc = base.clone();
    doc["attributes"]["zarrckpt"]["version"] = json!("2.0");
    assert!(matches!(
        parse_root(&doc),
        Err(StorageError::UnsupportedVersion { .. })
    ));

    // Rules JSON Schema cannot express: the schema accepts, the reader must reject.
    let semantic: Vec<Mutation> = vec![
        (
            "a path that is not the key's mapping",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["path"] =
                    json!("tensors/optimizer/step");
            }),
        ),
        (
            "subchunks that do not divide chunks",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["subchunk_shape"] = json!([300, 2048]);
            }),
        ),
        (
            "shapes of different rank",
            Box::new(move |d| {
                d["attributes"]["zarrckpt"]["tensors"][key]["chunk_shape"] = json!([4096])
            }),
        ),
        (
            "overflowing size",
            Box::new(move |d| {
                let e = &mut d["attributes"]["zarrckpt"]["tensors"][key];
                e["shape"] = json!([u64::MAX, 2]);
            }),
        ),
        (
            "a key that is a group of another",
            Box::new(|d| {
                d["attributes"]["zarrckpt"]["tensors"]["optimizer"] = json!({
                "path": "tensors/optimizer", "dtype": "int8", "shape": [1], "chunk_shape": [1],
                "subchunk_shape": [1], "compression": "none"});
            }),
        ),
        (
            "keys differing only in case",
            Box::new(|d| {
                d["attributes"]["zarrckpt"]["tensors"]["Optimizer/step"] = json!({
                "path": "tensors/Optimizer/step", "dtype": "int64", "shape": [], "chunk_shape": [],
                "subchunk_shape": [], "compression": "none"});
            }),
        ),
    ];
    for (what, m) in &semantic {
        let mut doc = base.clone();
        m(&mut doc);
        assert!(
            root_v.is_valid(&doc),
            "schema unexpectedly rejects {what}: {:?}",
            schema_errors(&root_v, &doc)
        );
        assert!(
            parse_root(&doc).is_err(),
            "reader accepts a document with {what}"
        );
    }

    // Writers must write every field; this reader defaults the optional ones (section 4).
    let mut doc = base.clone();
    doc["attributes"]["zarrckpt"]["tensors"][key]
        .as_object_mut()
        .unwrap()
        .remove("compression");
    doc["attributes"]["zarrckpt"]
        .as_object_mut()
        .unwrap()
        .remove("user");
    assert!(
        !root_v.is_valid(&doc),
        "schema accepts a document without compression and user"
    );
    let meta = parse_root(&doc).unwrap();
    assert_eq!(
        meta.tensors[&TensorKey::new(key).unwrap()].compression,
        Compression::None
    );

    // A later minor version with fields this reader does not know is accepted by both.
    let mut doc = base.clone();
    doc["attributes"]["zarrckpt"]["version"] = json!("1.7");
    doc["attributes"]["zarrckpt"]["save_id"] = json!("00112233445566778899aabbccddeeff");
    doc["attributes"]["zarrckpt"]["added_in_1_7"] = json!({"x": 1});
    doc["attributes"]["zarrckpt"]["tensors"][key]["also_new"] = json!(true);
    assert_valid(&root_v, &doc, "a 1.7 document with new fields");
    parse_root(&doc).unwrap();
}

#[test]
fn readers_refuse_incomplete_and_damaged_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let data = test_bytes(3, 64, DType::Int32);
    let pieces = [ShardedTensor::new(
        TensorKey::new("x").unwrap(),
        DType::Int32,
        vec![64],
        Region::full(&[64]),
        0,
        &data,
    )
    .unwrap()];
    let opts = SaveOptions {
        grid: GridOptions {
            subchunk_target_bytes: 32,
            ..GridOptions::default()
        },
        ..SaveOptions::default()
    };
    save(&pieces, &dir, &LocalComm::single(), &opts).unwrap();
    let root = std::fs::read(dir.join("zarr.json")).unwrap();
    let shard = std::fs::read(dir.join("tensors/x/c.0")).unwrap();
    let key = TensorKey::new("x").unwrap();

    // No root zarr.json but a tensors/ directory: incomplete.
    std::fs::remove_file(dir.join("zarr.json")).unwrap();
    assert!(matches!(
        Checkpoint::open(&dir),
        Err(Error::Storage(StorageError::Incomplete { .. }))
    ));
    assert!(spec_read_tensor(&dir, "x").is_err());
    // A root group without the zarrckpt attribute: refused.
    std::fs::write(
        dir.join("zarr.json"),
        br#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    assert!(Checkpoint::open(&dir).is_err());
    std::fs::write(dir.join("zarr.json"), &root).unwrap();
    assert_eq!(
        Checkpoint::open(&dir).unwrap().read_tensor(&key).unwrap(),
        data
    );

    // A missing shard file is an error, not fill values.
    std::fs::remove_file(dir.join("tensors/x/c.0")).unwrap();
    let e = Checkpoint::open(&dir)
        .unwrap()
        .read_tensor(&key)
        .unwrap_err();
    assert!(
        matches!(e, Error::Storage(StorageError::MissingChunk { .. })),
        "{e}"
    );
    // A flipped data byte fails the subchunk's crc32c.
    let mut bad = shard.clone();
    bad[0] ^= 1;
    std::fs::write(dir.join("tensors/x/c.0"), &bad).unwrap();
    let e = Checkpoint::open(&dir)
        .unwrap()
        .read_tensor(&key)
        .unwrap_err();
    assert!(
        matches!(e, Error::Storage(StorageError::Checksum { .. })),
        "{e}"
    );
    assert!(spec_read_tensor(&dir, "x").is_err());
    // A flipped index byte fails the index's crc32c.
    let mut bad = shard.clone();
    let n = bad.len();
    bad[n - 10] ^= 1;
    std::fs::write(dir.join("tensors/x/c.0"), &bad).unwrap();
    assert!(Checkpoint::open(&dir).unwrap().read_tensor(&key).is_err());
    assert!(spec_read_tensor(&dir, "x").is_err());
    // A truncated file is refused.
    std::fs::write(dir.join("tensors/x/c.0"), &shard[..10]).unwrap();
    assert!(Checkpoint::open(&dir).unwrap().read_tensor(&key).is_err());
    std::fs::write(dir.join("tensors/x/c.0"), &shard).unwrap();
    assert_eq!(spec_read_tensor(&dir, "x").unwrap().unwrap(), data);

    // An array zarr.json that disagrees with the index is refused.
    let arr_path = dir.join("tensors/x/zarr.json");
    let arr = std::fs::read(&arr_path).unwrap();
    let mut doc: Value = serde_json::from_slice(&arr).unwrap();
    doc["shape"] = json!([65]);
    std::fs::write(&arr_path, serde_json::to_vec(&doc).unwrap()).unwrap();
    assert!(Checkpoint::open(&dir).unwrap().read_tensor(&key).is_err());
    std::fs::write(&arr_path, &arr).unwrap();

    // Overwriting: refused without the flag, and never for a directory that is not a checkpoint.
    assert!(matches!(
        save(&pieces, &dir, &LocalComm::single(), &opts),
        Err(Error::Storage(StorageError::AlreadyExists { .. }))
    ));
    let other = tmp.path().join("not-a-checkpoint");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("notes.txt"), b"keep me").unwrap();
    let over = SaveOptions {
        overwrite: true,
        ..opts.clone()
    };
    assert!(save(&pieces, &other, &LocalComm::single(), &over).is_err());
    assert_eq!(std::fs::read(other.join("notes.txt")).unwrap(), b"keep me");
    save(&pieces, &dir, &LocalComm::single(), &over).unwrap();
    assert_eq!(
        Checkpoint::open(&dir).unwrap().read_tensor(&key).unwrap(),
        data
    );
}
