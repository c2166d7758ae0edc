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
    let (fs, ts) = (strides(from_box.shape()), strides(to_box.shape()));
    for rel in indices(b.shape()) {
        let g: Vec<u64> = rel.iter().zip(b.offset()).map(|(r, o)| r + o).collect();
        let fi: u64 = g
            .iter()
            .zip(from_box.offset())
            .zip(&fs)
            .map(|((g, o), s)| (g - o) * s)
            .sum();
        let ti: u64 = g
            .iter()
            .zip(to_box.offset())
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
    let chunk_box = Region::new(origin.clone(), chunk_shape.to_vec()).unwrap();
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
        let sub_box = Region::new(
            s.iter()
                .zip(sub_shape)
                .zip(&origin)
                .map(|((i, n), o)| o + i * n)
                .collect(),
            sub_shape.to_vec(),
        )
        .unwrap();
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
            let sub_box = Region::new(
                s.iter()
                    .zip(&sub_shape)
                    .zip(&origin)
                    .map(|((i, n), o)| o + i * n)
                    .collect(),
                sub_shape.clone(),
            )
            .unwrap();
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
    assert_eq!(
        meta.version,
        format!(
            "{}.{}",
            zarrckpt::storage::meta::FORMAT_MAJOR,
            zarrckpt::storage::meta::FORMAT_MINOR
        )
    );
    assert!(meta.save_id.is_some());
    assert_eq!(meta.format, "zarrckpt");
    let files = list_files(dir);
    assert_eq!(
        files,
        expected_files(&meta),
        "file layout of {}",
        dir.display()
    );
    let (groups, arrays) = (validator(Some("group")), validator(Some("bound_array")));
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
        ("object_array", 2),
        ("object_chunk", 1),
        ("compressed_shard", 2),
        ("safetensors", 1),
        // Conversion tables (§ 19), checked in tests/convert_hf.rs.
        ("mapping", 1),
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

/// Section 13: a key maps to itself exactly when all its characters are `/` or in
/// `[A-Za-z0-9._-]` and no segment begins with `__`. Checked over every key of up to four
/// characters from a small alphabet.
#[test]
fn keys_map_to_themselves_exactly_as_section_13_says() {
    let alphabet = ['a', 'Z', '0', '_', '.', '-', '/', '~', ' ', 'é'];
    let mut keys = vec![String::new()];
    let mut identity = 0;
    for _ in 0..4 {
        let next: Vec<String> = keys
            .iter()
            .flat_map(|k| alphabet.iter().map(move |c| format!("{k}{c}")))
            .collect();
        for key in &next {
            let Ok(k) = TensorKey::new(key.as_str()) else {
                continue;
            };
            let plain = key
                .chars()
                .all(|c| c == '/' || c.is_ascii_alphanumeric() || "._-".contains(c));
            let rule = plain && !key.split('/').any(|seg| seg.starts_with("__"));
            assert_eq!(
                k.node_path() == *key,
                rule,
                "`{key}` maps to `{}`",
                k.node_path()
            );
            identity += usize::from(rule);
        }
        keys = next;
    }
    assert!(identity > 100, "{identity}");
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

/// A grid example where ranks hold several boxes (section 8.4): `holders` names the rank of
/// each piece, or `flat_cuts` gives each rank a flat range. Checked through the whole plan.
fn check_flat_grid_example(case: &Value) {
    use zarrckpt::plan::{GatheredLayouts, PieceDecl, RankLayout, SavePlan, TensorDecl};
    let shape = u64s(&case["shape"]);
    let dt = dtype(case["dtype"].as_str().unwrap());
    let held: Vec<(u32, Region)> = if let Some(cuts) = case.get("flat_cuts") {
        u64s(cuts)
            .windows(2)
            .enumerate()
            .flat_map(|(r, w)| {
                zarrckpt::model::flat::flat_boxes(&shape, w[0]..w[1])
                    .unwrap()
                    .into_iter()
                    .map(move |b| (r as u32, b.region))
            })
            .collect()
    } else {
        let holders = u64s(&case["holders"]);
        let pieces = case["pieces"].as_array().unwrap();
        assert_eq!(holders.len(), pieces.len(), "{case}");
        holders
            .iter()
            .zip(pieces)
            .map(|(&r, p)| (r as u32, Region::new(u64s(&p[0]), u64s(&p[1])).unwrap()))
            .collect()
    };
    let world = held.iter().map(|h| h.0).max().unwrap() + 1;
    let layouts: Vec<RankLayout> = (0..world)
        .map(|r| RankLayout {
            tensors: vec![TensorDecl {
                key: TensorKey::new("t").unwrap(),
                dtype: dt,
                global_shape: shape.clone(),
            }],
            pieces: held
                .iter()
                .filter(|h| h.0 == r)
                .map(|h| PieceDecl {
                    tensor: 0,
                    region: h.1.clone(),
                    main: true,
                    auto: false,
                })
                .collect(),
        })
        .collect();
    let plan = SavePlan::build(
        &GatheredLayouts::from_layouts(&layouts),
        &zarrckpt::plan::SavePlanOptions::default(),
    )
    .unwrap();
    let tp = &plan.tensors[0];
    assert_eq!(tp.chunk_shape, u64s(&case["chunk_shape"]), "{case}");
    assert_eq!(tp.aligned, case["aligned"].as_bool().unwrap(), "{case}");
    assert_eq!(tp.subchunk_shape, u64s(&case["subchunk_shape"]), "{case}");
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
    let mut saved = 0;
    for ex in of_kind("grid") {
        for case in ex.json().as_array().unwrap() {
            if case.get("holders").is_some() || case.get("flat_cuts").is_some() {
                check_flat_grid_example(case);
                continue;
            }
            let shape = u64s(&case["shape"]);
            let elem = dtype(case["dtype"].as_str().unwrap()).size();
            let pieces: Vec<Region> = case["pieces"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| Region::new(u64s(&p[0]), u64s(&p[1])).unwrap())
                .collect();
            // Section 8: the main pieces, leaving out empty ones.
            let refs: Vec<&Region> = pieces.iter().filter(|p| !p.is_empty()).collect();
            let (mut chunk, mut aligned) = grid::choose_chunk_shape(&shape, &refs, elem, &opts);
            let mut sub = grid::subchunk_shape(&chunk, &shape, elem, opts.subchunk_target_bytes);
            // Section 8.3: a geometry readers refuse is replaced by the writer's checked one.
            if grid::check_geometry(&shape, &chunk, &sub, elem).is_err() {
                let parts: Vec<(&Region, u32)> = refs
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (*r, i as u32))
                    .collect();
                let smallest = refs
                    .iter()
                    .map(|r| r.shape().iter().product::<u64>() * elem as u64)
                    .min()
                    .unwrap_or(0);
                let g = grid::checked_grid(&shape, &parts, elem, smallest, &opts).unwrap();
                (chunk, aligned, sub) = (g.chunk_shape, g.aligned, g.subchunk_shape);
            }
            grid::check_geometry(&shape, &chunk, &sub, elem).unwrap();
            assert_eq!(chunk, u64s(&case["chunk_shape"]), "{case}");
            assert_eq!(aligned, case["aligned"].as_bool().unwrap(), "{case}");
            assert_eq!(sub, u64s(&case["subchunk_shape"]), "{case}");
            // The writer itself, given the pieces as they are (empty ones included), where the
            // tensor is small enough to save here.
            let total = shape.iter().product::<u64>() * elem as u64;
            if total <= 1 << 16 {
                let d = dtype(case["dtype"].as_str().unwrap());
                let full = test_bytes(9, shape.iter().product(), d);
                let datas: Vec<Vec<u8>> = pieces
                    .iter()
                    .map(|r| {
                        let mut out = vec![0u8; r.shape().iter().product::<u64>() as usize * elem];
                        copy_box(&full, &Region::full(&shape), &mut out, r, r, elem);
                        out
                    })
                    .collect();
                let key = TensorKey::new("t").unwrap();
                let sharded: Vec<ShardedTensor> = pieces
                    .iter()
                    .zip(&datas)
                    .map(|(r, b)| {
                        ShardedTensor::new(key.clone(), d, shape.clone(), r.clone(), 0, b).unwrap()
                    })
                    .collect();
                let tmp = tempfile::tempdir().unwrap();
                let dir = tmp.path().join("ckpt");
                save(
                    &sharded,
                    &dir,
                    &LocalComm::single(),
                    &SaveOptions::default(),
                )
                .unwrap();
                let meta = check_checkpoint(&dir, &BTreeMap::from([("t".to_owned(), full)]));
                let e = &meta.tensors[&key];
                assert_eq!(
                    (&e.chunk_shape, &e.subchunk_shape),
                    (&u64s(&case["chunk_shape"]), &u64s(&case["subchunk_shape"])),
                    "the writer's grid for {case}"
                );
                saved += 1;
            }
        }
    }
    assert!(saved >= 5, "only {saved} grid examples were saved");
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
                let mut out = vec![0u8; r.shape().iter().product::<u64>() as usize * d.size()];
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
            let mut b = vec![0u8; r.shape().iter().product::<u64>() as usize * d.size()];
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
    // Section 6.3: integers are written as integers.
    let semantic: Vec<Mutation> = semantic
        .into_iter()
        .chain::<Vec<Mutation>>(vec![
            (
                "a shape entry written 8192.0",
                Box::new(move |d| {
                    d["attributes"]["zarrckpt"]["tensors"][key]["shape"] = json!([8192.0, 2048]);
                }),
            ),
            (
                "a subchunk extent written 2048.0",
                Box::new(move |d| {
                    d["attributes"]["zarrckpt"]["tensors"][key]["subchunk_shape"] =
                        json!([256, 2048.0]);
                }),
            ),
            (
                "world_size written 2.0",
                Box::new(|d| d["attributes"]["zarrckpt"]["world_size"] = json!(2.0)),
            ),
        ])
        .collect();
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

    // Every member is required, for readers too (section 4.1): missing, null or mistyped
    // members are refused by both.
    fn entry_of<'a>(d: &'a mut Value, key: &str) -> &'a mut serde_json::Map<String, Value> {
        d["attributes"]["zarrckpt"]["tensors"][key]
            .as_object_mut()
            .unwrap()
    }
    let required: Vec<Mutation> = vec![
        (
            "no compression",
            Box::new(move |d| {
                entry_of(d, key).remove("compression");
            }),
        ),
        (
            "compression null",
            Box::new(move |d| {
                entry_of(d, key).insert("compression".into(), Value::Null);
            }),
        ),
        (
            "no path",
            Box::new(move |d| {
                entry_of(d, key).remove("path");
            }),
        ),
        (
            "no user",
            Box::new(|d| {
                d["attributes"]["zarrckpt"]
                    .as_object_mut()
                    .unwrap()
                    .remove("user");
            }),
        ),
        (
            "no writer",
            Box::new(|d| {
                d["attributes"]["zarrckpt"]
                    .as_object_mut()
                    .unwrap()
                    .remove("writer");
            }),
        ),
        (
            "writer is a number",
            Box::new(|d| d["attributes"]["zarrckpt"]["writer"] = json!(1)),
        ),
        (
            "world_size null",
            Box::new(|d| d["attributes"]["zarrckpt"]["world_size"] = Value::Null),
        ),
        (
            "tensors is an array",
            Box::new(|d| d["attributes"]["zarrckpt"]["tensors"] = json!([])),
        ),
    ];
    for (what, m) in &required {
        let mut doc = base.clone();
        m(&mut doc);
        assert!(
            !root_v.is_valid(&doc),
            "schema accepts a document with {what}"
        );
        let e = parse_root(&doc).expect_err(what);
        assert!(matches!(e, StorageError::Malformed { .. }), "{what}: {e}");
    }

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

// ---------------------------------------------------------------------------------------------
// Objects (section 16)
// ---------------------------------------------------------------------------------------------

#[test]
fn object_array_examples_equal_what_the_writer_produces() {
    use zarrckpt::ObjectSlot;
    use zarrckpt::storage::object::value_metadata;
    for d in ["object_entry", "object_array", "object_path"] {
        validator(Some(d));
    }
    for ex in of_kind("object_array") {
        let root = root_by_id(ex.tag["root"].as_str().unwrap());
        let meta = parse_root(&root).unwrap();
        let key = TensorKey::new(ex.tag["key"].as_str().unwrap()).unwrap();
        let entry = &meta.objects[&key];
        let slot = match (ex.tag.get("rank"), ex.tag.get("index")) {
            (Some(r), _) => ObjectSlot::Rank(r.as_u64().unwrap()),
            (_, Some(i)) => ObjectSlot::Shard(u64s(i)),
            _ => ObjectSlot::Common,
        };
        let doc = ex.json();
        let len = doc["shape"][0].as_u64().unwrap();
        // Format 1.2: the value's array names its save and the CRC-32C of its bytes.
        let crc = doc["attributes"]["zarrckpt"]["crc32c"].as_u64().unwrap();
        if let Some(v) = ex.tag.get("json") {
            let bytes = zarrckpt::ObjectValue::Json(v.clone()).to_stored();
            assert_eq!(crc, u64::from(crc32c::crc32c(&bytes)), "line {}", ex.line);
        }
        let binding = zarrckpt::storage::object::ObjectBinding {
            save_id: meta.object_save_id().unwrap(),
            crc32c: u32::try_from(crc).unwrap(),
        };
        assert_eq!(
            doc,
            value_metadata(&key, entry, &slot, len, Some(binding)),
            "line {}",
            ex.line
        );
        assert_valid(
            &validator(Some("bound_object_array")),
            &doc,
            "object array example",
        );
    }
}

#[test]
fn object_chunk_example_is_what_a_save_writes_and_saved_objects_validate() {
    use zarrckpt::{Communicator, StateObject, save_with_objects};
    let ex = of_kind("object_chunk").pop().unwrap();
    let key = ex.tag["key"].as_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let value = ex.tag["json"].clone();
    for r in run_local(2, Duration::from_secs(30), |c| {
        let objs = [
            StateObject::common(key, value.clone()).unwrap(),
            StateObject::per_rank("rng", vec![c.rank() as u8; 3]).unwrap(),
            StateObject::sharded("pp", &[2, 1], &[c.rank() as u64, 0], json!([c.rank()])).unwrap(),
        ];
        save_with_objects(&[], &objs, &dir, &c, &zarrckpt::SaveOptions::default())
    }) {
        r.unwrap();
    }
    assert_eq!(
        std::fs::read(dir.join("objects").join(key).join("c.0")).unwrap(),
        ex.hex()
    );
    let root: Value =
        serde_json::from_slice(&std::fs::read(dir.join("zarr.json")).unwrap()).unwrap();
    assert_valid(&validator(Some("root")), &root, "root with objects");
    let meta = parse_root(&root).unwrap();
    let (arrays, groups) = (
        validator(Some("bound_object_array")),
        validator(Some("group")),
    );
    let mut n = 0;
    for e in meta.objects.values() {
        for slot in e.slots() {
            let p = dir.join(e.value_path(&slot)).join("zarr.json");
            let doc: Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
            assert_valid(&arrays, &doc, "saved object array");
            n += 1;
        }
    }
    assert_eq!(n, 1 + 2 + 2);
    for g in ["objects", "objects/rng", "objects/pp"] {
        let doc: Value =
            serde_json::from_slice(&std::fs::read(dir.join(g).join("zarr.json")).unwrap()).unwrap();
        assert_valid(&groups, &doc, g);
    }
    // The schema refuses entries a reader refuses.
    let entry = validator(Some("object_entry"));
    for bad in [
        json!({"path": "objects/x", "scope": "common", "encoding": "json"}),
        json!({"path": "objects/x", "scope": "per_rank", "encoding": "json", "world_size": 2, "size": 1}),
        json!({"path": "objects/x", "scope": "sharded", "encoding": "pickle", "grid": [2]}),
        json!({"path": "tensors/x", "scope": "common", "encoding": "json", "size": 1}),
    ] {
        assert!(!schema_errors(&entry, &bad).is_empty(), "{bad}");
    }
}

/// Section 11, step 3: an empty box meets no chunk, even at an offset that is not a multiple
/// of the chunk shape, so reading it opens no shard file: it succeeds with every shard file
/// gone and reads no byte.
#[test]
fn empty_boxes_read_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let shape = vec![10u64, 6];
    let data = test_bytes(4, 60, DType::Int32);
    let halves: Vec<(Region, Vec<u8>)> = [0u64, 5]
        .iter()
        .map(|&o| {
            let r = Region::new(vec![o, 0], vec![5, 6]).unwrap();
            let mut out = vec![0u8; 5 * 6 * 4];
            copy_box(&data, &Region::full(&shape), &mut out, &r, &r, 4);
            (r, out)
        })
        .collect();
    let key = TensorKey::new("t").unwrap();
    let pieces: Vec<ShardedTensor> = halves
        .iter()
        .map(|(r, b)| {
            ShardedTensor::new(key.clone(), DType::Int32, shape.clone(), r.clone(), 0, b).unwrap()
        })
        .collect();
    save(&pieces, &dir, &LocalComm::single(), &SaveOptions::default()).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(ckpt.tensor(&key).unwrap().chunk_shape, vec![5, 6]);
    for f in ["c.0.0", "c.1.0"] {
        std::fs::remove_file(dir.join("tensors/t").join(f)).unwrap();
    }
    // Unaligned offsets: the formula of step 3 would pick chunk 1 (rows) and chunk 0 (columns).
    for (offset, shape) in [
        (vec![7, 0], vec![0, 6]),
        (vec![7, 3], vec![2, 0]),
        (vec![10, 6], vec![0, 0]),
    ] {
        let region = Region::new(offset, shape).unwrap();
        let report = ckpt.read_region(&key, &region, &mut []).unwrap();
        assert_eq!(
            (report.bytes_read, report.loaded_bytes),
            (0, 0),
            "{region:?}"
        );
    }
    // A non-empty box does need the file.
    let one = Region::new(vec![7, 3], vec![1, 1]).unwrap();
    let e = ckpt.read_region(&key, &one, &mut [0; 4]).unwrap_err();
    assert!(
        matches!(e, Error::Storage(StorageError::MissingChunk { .. })),
        "{e}"
    );
}

/// Section 6.3, "Numbers": an array `zarr.json` whose numbers are spelled otherwise than the
/// prescribed document (as the section compares them) is refused with a typed error naming the
/// file; non-integer spellings of +0 for a float fill value are accepted.
#[test]
fn array_documents_compare_numbers_as_section_6_3_says() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let data = test_bytes(5, 12, DType::Float32);
    let ints = test_bytes(6, 3, DType::Int16);
    let key = TensorKey::new("f").unwrap();
    let ikey = TensorKey::new("i").unwrap();
    let pieces = [
        ShardedTensor::new(
            key.clone(),
            DType::Float32,
            vec![3, 4],
            Region::full(&[3, 4]),
            0,
            &data,
        )
        .unwrap(),
        ShardedTensor::new(
            ikey.clone(),
            DType::Int16,
            vec![3],
            Region::full(&[3]),
            0,
            &ints,
        )
        .unwrap(),
    ];
    save(&pieces, &dir, &LocalComm::single(), &SaveOptions::default()).unwrap();
    let path = |k: &str| dir.join("tensors").join(k).join("zarr.json");
    let original = |k: &str| -> String {
        let v: Value = serde_json::from_slice(&std::fs::read(path(k)).unwrap()).unwrap();
        serde_json::to_string(&v).unwrap()
    };
    let (f_doc, i_doc) = (original("f"), original("i"));
    assert!(f_doc.contains(r#""fill_value":0.0"#), "{f_doc}");
    assert!(i_doc.contains(r#""fill_value":0,"#), "{i_doc}");
    let read = |k: &TensorKey| Checkpoint::open(&dir).unwrap().read_tensor(k);
    // (tensor, text to replace, replacement, accepted?)
    let cases = [
        ("f", r#""fill_value":0.0"#, r#""fill_value":-0.0"#, false),
        ("f", r#""fill_value":0.0"#, r#""fill_value":-0"#, false),
        ("f", r#""fill_value":0.0"#, r#""fill_value":0"#, false),
        (
            "f",
            r#""fill_value":0.0"#,
            r#""fill_value":"0x00000000""#,
            false,
        ),
        ("f", r#""fill_value":0.0"#, r#""fill_value":0e0"#, true),
        ("f", r#""fill_value":0.0"#, r#""fill_value":0.000"#, true),
        ("f", r#""shape":[3,4]"#, r#""shape":[3.0,4]"#, false),
        ("f", r#""shape":[3,4]"#, r#""shape":[3e0,4]"#, false),
        ("f", r#""zarr_format":3"#, r#""zarr_format":3.0"#, false),
        ("i", r#""fill_value":0,"#, r#""fill_value":0.0,"#, false),
        ("i", r#""fill_value":0,"#, r#""fill_value":-0,"#, false),
    ];
    for (k, from, to, accepted) in cases {
        let doc = if k == "f" { &f_doc } else { &i_doc };
        let tkey = if k == "f" { &key } else { &ikey };
        assert!(doc.contains(from), "{from} not in {doc}");
        std::fs::write(path(k), doc.replacen(from, to, 1)).unwrap();
        let got = read(tkey);
        if accepted {
            assert_eq!(&got.unwrap(), if k == "f" { &data } else { &ints }, "{to}");
        } else {
            let e = got.expect_err(to);
            assert!(
                matches!(&e, Error::Storage(StorageError::Malformed { path: p, .. }) if *p == path(k)),
                "{to}: {e}"
            );
            // Rule 4 of issue 23: an integer fill value `-0` is refused, and named as written.
            if to.contains(":-0") {
                assert!(e.to_string().contains("negative zero"), "{to}: {e}");
            }
        }
        std::fs::write(path(k), doc).unwrap();
    }
    assert_eq!(read(&key).unwrap(), data);
}

// ---------------------------------------------------------------------------------------------
// Reader rules (sections 4.1, 6.1, 6.3 and 7.2), on crafted documents and bytes
// ---------------------------------------------------------------------------------------------

/// The main example of section 4 as compact JSON text, for byte-level edits.
fn root_text() -> String {
    serde_json::to_string(&root_by_id("main")).unwrap()
}

fn parse_text(text: &[u8]) -> Result<CheckpointMeta, StorageError> {
    CheckpointMeta::from_root_json(text, Path::new("spec/zarr.json"))
}

/// Section 4.1, step 1: RFC 8259 JSON in UTF-8 without a byte-order mark, no duplicate
/// member names at any depth.
#[test]
fn root_documents_are_parsed_strictly() {
    let text = root_text();
    parse_text(text.as_bytes()).unwrap();
    let fmt = r#""format":"zarrckpt","#;
    let user = r#""user":{"iteration":1000,"consumed_samples":2048000}"#;
    let step = r#""optimizer/step":{"#;
    assert!(
        text.contains(fmt) && text.contains(user) && text.contains(step),
        "{text}"
    );
    let edits: Vec<(&str, Vec<u8>)> = vec![
        ("a duplicate index member", text.replacen(fmt, &format!("{fmt}{fmt}"), 1).into_bytes()),
        (
            "a duplicate tensor key",
            text.replacen(
                step,
                r#""optimizer/step":{"path":"tensors/optimizer/step","dtype":"int64","shape":[],"chunk_shape":[],"subchunk_shape":[],"compression":"none","writer":"x"},"optimizer/step":{"#,
                1,
            )
            .into_bytes(),
        ),
        (
            "a duplicate member inside user",
            text.replacen(user, r#""user":{"a":1,"a":2}"#, 1).into_bytes(),
        ),
        (
            "a duplicate member spelled with an escape",
            text.replacen(user, r#""user":{"a":1,"\u0061":1}"#, 1).into_bytes(),
        ),
        (
            "a duplicate top-level member",
            text.replacen(r#""node_type":"group","#, r#""node_type":"group","node_type":"group","#, 1)
                .into_bytes(),
        ),
        ("NaN", text.replacen(user, r#""user":{"x":NaN}"#, 1).into_bytes()),
        ("Infinity", text.replacen(user, r#""user":{"x":Infinity}"#, 1).into_bytes()),
        ("a comment", text.replacen(user, r#""user":{/* c */}"#, 1).into_bytes()),
        ("a trailing comma", text.replacen(user, r#""user":{"x":1,}"#, 1).into_bytes()),
        ("a lone surrogate", text.replacen(user, r#""user":{"x":"\uD800"}"#, 1).into_bytes()),
        ("trailing bytes", format!("{text} x").into_bytes()),
        ("a byte-order mark", [&b"\xEF\xBB\xBF"[..], text.as_bytes()].concat()),
        ("UTF-16", text.encode_utf16().flat_map(u16::to_le_bytes).collect()),
        (
            "invalid UTF-8 in a string",
            text.replacen(user, "\"user\":{\"x\":\"\u{1}\"}", 1)
                .into_bytes()
                .into_iter()
                .map(|b| if b == 1 { 0xFF } else { b })
                .collect(),
        ),
    ];
    for (what, bytes) in &edits {
        let e = parse_text(bytes).expect_err(what);
        assert!(matches!(e, StorageError::Malformed { .. }), "{what}: {e}");
    }
    // Whitespace around the value is fine; a non-ASCII key in UTF-8 is fine.
    parse_text(format!(" \n{text}\n ").as_bytes()).unwrap();
    parse_text(
        text.replacen(user, r#""user":{"é":"\u00e9"}"#, 1)
            .as_bytes(),
    )
    .unwrap();
}

/// Section 4.1, steps 2 and 3: extra top-level members are ignored; format and version are
/// checked before the rest of the index, so another major version is reported as such
/// however broken the rest is.
#[test]
fn root_checks_run_in_the_specified_order() {
    let base = root_by_id("main");
    let mut doc = base.clone();
    doc["consolidated_metadata"] = Value::Null;
    doc["some_extension"] = json!({"must_understand": false});
    parse_root(&doc).unwrap();

    let mut doc = base.clone();
    let z = doc["attributes"]["zarrckpt"].as_object_mut().unwrap();
    z.insert("version".into(), json!("2.0"));
    z.remove("tensors");
    z.insert("writer".into(), json!(5));
    z.insert("world_size".into(), json!(-1));
    let e = parse_root(&doc).unwrap_err();
    assert!(matches!(e, StorageError::UnsupportedVersion { .. }), "{e}");
    // The format name comes first of all.
    doc["attributes"]["zarrckpt"]["format"] = json!("other");
    let e = parse_root(&doc).unwrap_err();
    assert!(matches!(e, StorageError::Malformed { .. }), "{e}");
    // Not a group: not a checkpoint, whatever the attribute holds.
    let mut doc = base.clone();
    doc["node_type"] = json!("array");
    doc["attributes"]["zarrckpt"]["version"] = json!("2.0");
    let e = parse_root(&doc).unwrap_err();
    assert!(matches!(e, StorageError::NotACheckpoint { .. }), "{e}");
}

/// A saved checkpoint with a bool tensor, a nested key and an int32 tensor of two subchunks
/// with equal bytes; returns its directory.
/// Turns a checkpoint this crate wrote (format 1.1) into the format 1.0 it extends: no save id
/// in the index or in the arrays' attributes, no footer in the shard files. The reader rules
/// the tests below exercise with hand-made shard bytes hold for both versions.
fn downgrade_to_1_0(dir: &Path) {
    let root = dir.join("zarr.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&root).unwrap()).unwrap();
    let z = v["attributes"]["zarrckpt"].as_object_mut().unwrap();
    z.insert("version".into(), "1.0".into());
    z.remove("save_id");
    let tensors = z["tensors"].as_object().unwrap().clone();
    std::fs::write(&root, serde_json::to_vec(&v).unwrap()).unwrap();
    for e in tensors.values() {
        let array = dir.join(e["path"].as_str().unwrap());
        let doc_path = array.join("zarr.json");
        let mut doc: Value = serde_json::from_slice(&std::fs::read(&doc_path).unwrap()).unwrap();
        doc["attributes"]["zarrckpt"]
            .as_object_mut()
            .unwrap()
            .remove("save_id");
        std::fs::write(&doc_path, serde_json::to_vec(&doc).unwrap()).unwrap();
        let (chunk, sub) = (u64s(&e["chunk_shape"]), u64s(&e["subchunk_shape"]));
        let n = chunk.len() as u64;
        let subchunks: u64 = chunk.iter().zip(&sub).map(|(c, s)| c / s).product();
        let (footer, index) = (52 + 8 * n + 4 * subchunks, 16 * subchunks + 4);
        for f in std::fs::read_dir(&array).unwrap() {
            let f = f.unwrap().path();
            if f.file_name().unwrap().to_str().unwrap().starts_with("c.") {
                let bytes = std::fs::read(&f).unwrap();
                let len = bytes.len() as u64;
                let cut = usize::try_from(len - index - footer).unwrap();
                let keep = usize::try_from(len - index).unwrap();
                std::fs::write(&f, [&bytes[..cut], &bytes[keep..]].concat()).unwrap();
            }
        }
    }
}

fn small_checkpoint(tmp: &Path) -> PathBuf {
    let dir = tmp.join("ckpt");
    let ints: Vec<u8> = [1i32, 2, 1, 2]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bools = [1u8, 0, 1, 1];
    let pieces = [
        ShardedTensor::new(
            TensorKey::new("g/h/ints").unwrap(),
            DType::Int32,
            vec![4],
            Region::full(&[4]),
            0,
            &ints,
        )
        .unwrap(),
        ShardedTensor::new(
            TensorKey::new("flags").unwrap(),
            DType::Bool,
            vec![4],
            Region::full(&[4]),
            0,
            &bools,
        )
        .unwrap(),
    ];
    let opts = SaveOptions {
        grid: GridOptions {
            subchunk_target_bytes: 8,
            ..GridOptions::default()
        },
        ..SaveOptions::default()
    };
    save(&pieces, &dir, &LocalComm::single(), &opts).unwrap();
    let meta = Checkpoint::open(&dir).unwrap();
    let e = meta.tensor(&TensorKey::new("g/h/ints").unwrap()).unwrap();
    assert_eq!(e.subchunk_shape, vec![2]);
    downgrade_to_1_0(&dir);
    dir
}

/// A shard file: `data` then the index of `entries` (`None` absent) and its CRC-32C.
fn shard_bytes(data: &[u8], entries: &[Option<(u64, u64)>]) -> Vec<u8> {
    let mut out = data.to_vec();
    let mut index = Vec::new();
    for e in entries {
        let (o, n) = e.unwrap_or((u64::MAX, u64::MAX));
        index.extend_from_slice(&o.to_le_bytes());
        index.extend_from_slice(&n.to_le_bytes());
    }
    out.extend_from_slice(&index);
    out.extend_from_slice(&crc32c::crc32c(&index).to_le_bytes());
    out
}

/// A stored subchunk: the bytes and their CRC-32C.
fn stored(bytes: &[u8]) -> Vec<u8> {
    [bytes, &crc32c::crc32c(bytes).to_le_bytes()[..]].concat()
}

fn read_with(
    dir: &Path,
    key: &str,
    region: &Region,
    method: zarrckpt::ReadMethod,
) -> Result<Vec<u8>, Error> {
    let key = TensorKey::new(key).unwrap();
    let ckpt = Checkpoint::open(dir)?;
    let info = ckpt.tensor(&key).unwrap();
    let mut buf = vec![0u8; region.shape().iter().product::<u64>() as usize * info.dtype.size()];
    let mut t = [zarrckpt::LoadTarget::new(
        key,
        info.dtype,
        info.shape,
        region.clone(),
        &mut buf,
    )?];
    let opts = zarrckpt::LoadOptions {
        read_method: method,
        ..zarrckpt::LoadOptions::default()
    };
    zarrckpt::load(&mut t, dir, &LocalComm::single(), &opts)?;
    Ok(buf)
}

const METHODS: [zarrckpt::ReadMethod; 2] =
    [zarrckpt::ReadMethod::Mmap, zarrckpt::ReadMethod::Pread];

fn corrupt_shard(e: &Error) -> bool {
    matches!(e, Error::Storage(StorageError::CorruptChunk { .. }))
}

/// Section 7.2: overlapping entries and entries past the data are refused, for every entry of
/// the index, used or not; unreferenced bytes are not an error.
#[test]
fn shard_entries_must_not_overlap_and_may_leave_gaps() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = small_checkpoint(tmp.path());
    let file = dir.join("tensors/g/h/ints/c.0");
    let (a, b) = (
        stored(&[1, 0, 0, 0, 2, 0, 0, 0]),
        stored(&[1, 0, 0, 0, 2, 0, 0, 0]),
    );
    let want: Vec<u8> = [1i32, 2, 1, 2]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let written = std::fs::read(&file).unwrap();
    assert_eq!(
        written,
        shard_bytes(
            &[a.clone(), b.clone()].concat(),
            &[Some((0, 12)), Some((12, 12))]
        )
    );
    let all = Region::full(&[4]);
    let first = Region::new(vec![0], vec![2]).unwrap();
    // Accepted: a gap before, between and after the subchunks; entries out of file order.
    let junk = [0xEEu8; 5];
    let accepted = [
        shard_bytes(
            &[&junk[..], &a, &b].concat(),
            &[Some((5, 12)), Some((17, 12))],
        ),
        shard_bytes(
            &[&a[..], &junk, &b].concat(),
            &[Some((0, 12)), Some((17, 12))],
        ),
        shard_bytes(
            &[&a[..], &b, &junk].concat(),
            &[Some((0, 12)), Some((12, 12))],
        ),
        shard_bytes(&[&b[..], &a].concat(), &[Some((12, 12)), Some((0, 12))]),
    ];
    for (i, bytes) in accepted.iter().enumerate() {
        std::fs::write(&file, bytes).unwrap();
        for m in METHODS {
            assert_eq!(
                read_with(&dir, "g/h/ints", &all, m).unwrap(),
                want,
                "accepted {i} {m:?}"
            );
        }
    }
    // Refused: both entries on the same bytes (each checksum is right); overlapping by one
    // byte; an entry past the data, or with one value 2^64 - 1, even when only the other
    // subchunk is read; an entry shorter than its checksum.
    let refused = [
        (
            "same bytes",
            shard_bytes(&a, &[Some((0, 12)), Some((0, 12))]),
        ),
        (
            "one byte of overlap",
            shard_bytes(&[&a[..], &b].concat(), &[Some((0, 12)), Some((11, 12))]),
        ),
        (
            "past the data",
            shard_bytes(&a, &[Some((0, 12)), Some((12, 12))]),
        ),
        (
            "half absent",
            shard_bytes(&a, &[Some((0, 12)), Some((u64::MAX, 12))]),
        ),
        (
            "overflowing",
            shard_bytes(&a, &[Some((0, 12)), Some((u64::MAX - 3, 12))]),
        ),
        (
            "too short",
            shard_bytes(&[&a[..], &b].concat(), &[Some((0, 12)), Some((12, 3))]),
        ),
    ];
    for (what, bytes) in &refused {
        std::fs::write(&file, bytes).unwrap();
        for m in METHODS {
            let e = read_with(&dir, "g/h/ints", &first, m).expect_err(what);
            assert!(corrupt_shard(&e), "{what} {m:?}: {e}");
        }
    }
    std::fs::write(&file, &written).unwrap();
}

/// Section 6.1: a bool byte other than 0 and 1 is corruption, on every read path.
#[test]
fn bool_bytes_other_than_0_and_1_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = small_checkpoint(tmp.path());
    let file = dir.join("tensors/flags/c.0");
    let written = std::fs::read(&file).unwrap();
    assert_eq!(
        written,
        shard_bytes(&stored(&[1, 0, 1, 1]), &[Some((0, 8))])
    );
    let all = Region::full(&[4]);
    for m in METHODS {
        assert_eq!(read_with(&dir, "flags", &all, m).unwrap(), vec![1, 0, 1, 1]);
    }
    std::fs::write(&file, shard_bytes(&stored(&[1, 0, 2, 1]), &[Some((0, 8))])).unwrap();
    for m in METHODS {
        let e = read_with(&dir, "flags", &all, m).unwrap_err();
        assert!(corrupt_shard(&e), "{m:?}: {e}");
        // Parts that do not hold the bad byte still read.
        let part = Region::new(vec![0], vec![2]).unwrap();
        assert_eq!(
            read_with(&dir, "flags", &part, m).unwrap(),
            vec![1, 0],
            "{m:?}"
        );
    }
    let report = Checkpoint::open(&dir).unwrap().verify(1, None).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
}

/// Sections 4.1 and 6.3: the array's `attributes.zarrckpt.key` must be the key; array
/// documents are parsed strictly; group documents are not needed.
#[test]
fn array_documents_name_their_key_and_groups_are_optional() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = small_checkpoint(tmp.path());
    let key = TensorKey::new("g/h/ints").unwrap();
    let want: Vec<u8> = [1i32, 2, 1, 2]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let read = || Checkpoint::open(&dir).unwrap().read_tensor(&key);
    let path = dir.join("tensors/g/h/ints/zarr.json");
    let text = serde_json::to_string(
        &serde_json::from_slice::<Value>(&std::fs::read(&path).unwrap()).unwrap(),
    )
    .unwrap();
    let attr = r#""attributes":{"zarrckpt":{"key":"g/h/ints"}}"#;
    assert!(text.contains(attr), "{text}");
    let refused = [
        ("no key", r#""attributes":{"zarrckpt":{}}"#.to_owned()),
        ("no zarrckpt attribute", r#""attributes":{}"#.to_owned()),
        (
            "another key",
            r#""attributes":{"zarrckpt":{"key":"flags"}}"#.to_owned(),
        ),
        (
            "a key that is not a string",
            r#""attributes":{"zarrckpt":{"key":["g/h/ints"]}}"#.to_owned(),
        ),
        (
            "a duplicate member",
            format!(r#"{attr},"attributes":{{"zarrckpt":{{"key":"g/h/ints"}}}}"#),
        ),
        ("NaN", format!(r#"{attr},"x":NaN"#)),
    ];
    for (what, new) in &refused {
        std::fs::write(&path, text.replacen(attr, new, 1)).unwrap();
        let e = read().expect_err(what);
        assert!(
            matches!(e, Error::Storage(StorageError::Malformed { .. })),
            "{what}: {e}"
        );
    }
    // Other members and attributes are ignored.
    let extra = r#""attributes":{"zarrckpt":{"key":"g/h/ints","note":1},"other":2},"dimension_names":["x"]"#;
    std::fs::write(&path, text.replacen(attr, extra, 1)).unwrap();
    assert_eq!(read().unwrap(), want);
    // No group document is needed to read.
    for g in [
        "tensors/zarr.json",
        "tensors/g/zarr.json",
        "tensors/g/h/zarr.json",
    ] {
        std::fs::remove_file(dir.join(g)).unwrap();
    }
    assert_eq!(read().unwrap(), want);
}

// ---------------------------------------------------------------------------------------------
// Compressed payloads (section 7.2) and the worked examples of section 7.3
// ---------------------------------------------------------------------------------------------

/// The rules of section 7.2 for a payload, written from the spec (the frame structure is read
/// by hand; only the zstd frame walk and decompression use libzstd).
fn spec_check_payload(compression: &str, p: &[u8], d: u64, elem: u8) -> Result<Vec<u8>, String> {
    match compression {
        "zstd" => {
            if p.get(..4) != Some(&[0x28, 0xB5, 0x2F, 0xFD][..]) {
                return Err("magic".into());
            }
            let fhd = p[4];
            if fhd & 0x0B != 0 {
                return Err("dictionary or reserved bit".into());
            }
            // Frame_Content_Size: flag in bits 6-7; with flag 0 only single-segment frames
            // (bit 5) carry a 1-byte size.
            let single = fhd & 0x20 != 0;
            let fcs_len = match fhd >> 6 {
                0 if single => 1,
                0 => return Err("no content size".into()),
                1 => 2,
                2 => 4,
                _ => 8,
            };
            let at = 5 + usize::from(!single);
            let mut fcs = [0u8; 8];
            fcs[..fcs_len].copy_from_slice(&p[at..at + fcs_len]);
            let fcs = u64::from_le_bytes(fcs) + if fcs_len == 2 { 256 } else { 0 };
            if fcs != d {
                return Err(format!("content size {fcs}"));
            }
            if zstd::zstd_safe::find_frame_compressed_size(p) != Ok(p.len()) {
                return Err("not exactly one frame".into());
            }
            let out = zstd::bulk::decompress(p, d as usize).map_err(|e| e.to_string())?;
            if out.len() as u64 != d {
                return Err("decompressed length".into());
            }
            Ok(out)
        }
        "blosc" => {
            let w = |i: usize| u64::from(u32::from_le_bytes(p[i..i + 4].try_into().unwrap()));
            let ok = p.len() >= 16
                && p[0] == 2
                && p[2] & 0x0C == 0
                && p[2] >> 5 == 1
                && p[3] == elem
                && w(4) == d
                && (1..=w(4)).contains(&w(8))
                && w(12) == p.len() as u64
                && (p[2] & 0x02 == 0 || w(12) == w(4) + 16);
            if ok {
                Ok(Vec::new())
            } else {
                Err("blosc header".into())
            }
        }
        other => Err(format!("compression {other}")),
    }
}

fn iota_data(ex: &Example) -> (DType, Vec<u64>, Vec<u8>) {
    let t = &ex.tag;
    let d = dtype(t["dtype"].as_str().unwrap());
    assert_eq!(d, DType::Int32);
    let shape = u64s(&t["shape"]);
    let iota = t["iota"].as_u64().unwrap();
    let data: Vec<u8> = (0..shape.iter().product::<u64>())
        .flat_map(|i| {
            i32::try_from(if i < iota { i } else { 0 })
                .unwrap()
                .to_le_bytes()
        })
        .collect();
    (d, shape, data)
}

/// Section 7.3: the example shards satisfy the rules of sections 7 and 7.2 as an independent
/// reading of them checks, and the crate's reader reads them back in place of what its
/// writer wrote.
#[test]
fn compressed_shard_examples_read_back() {
    for ex in of_kind("compressed_shard") {
        let t = &ex.tag;
        let comp = t["compression"].as_str().unwrap();
        let (d, shape, data) = iota_data(&ex);
        let sub_shape = u64s(&t["subchunk_shape"]);
        let sub_bytes = sub_shape.iter().product::<u64>() * d.size() as u64;
        let hex = ex.hex();
        // By the rules: the index, each entry, each payload.
        let n = (u64s(&t["chunk_shape"])[0] / sub_shape[0]) as usize;
        let index_len = 16 * n + 4;
        let (body, index) = hex.split_at(hex.len() - index_len);
        assert_eq!(
            crc32c::crc32c(&index[..16 * n]).to_le_bytes(),
            index[16 * n..],
            "line {}",
            ex.line
        );
        let mut raw = vec![0u8; data.len()];
        for i in 0..n {
            let off = u64::from_le_bytes(index[16 * i..16 * i + 8].try_into().unwrap());
            let nb = u64::from_le_bytes(index[16 * i + 8..16 * i + 16].try_into().unwrap());
            if (off, nb) == (u64::MAX, u64::MAX) {
                continue;
            }
            let stored = &body[off as usize..(off + nb) as usize];
            let (payload, crc) = stored.split_at(stored.len() - 4);
            assert_eq!(
                crc32c::crc32c(payload).to_le_bytes(),
                crc,
                "line {}",
                ex.line
            );
            let out = spec_check_payload(comp, payload, sub_bytes, d.size() as u8)
                .unwrap_or_else(|e| panic!("line {}: {e}", ex.line));
            if comp == "zstd" {
                let at = i * sub_bytes as usize;
                raw[at..at + out.len()].copy_from_slice(&out);
            }
        }
        if comp == "zstd" {
            assert_eq!(raw, data, "line {}", ex.line);
        }
        // By the crate: save the same tensor, then put the example in place of the shard.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let key = TensorKey::new("t").unwrap();
        let piece = [ShardedTensor::new(
            key.clone(),
            d,
            shape.clone(),
            Region::full(&shape),
            0,
            &data,
        )
        .unwrap()];
        let compression = match comp {
            "zstd" => Compression::Zstd,
            _ => Compression::Blosc,
        };
        let opts = SaveOptions {
            compression,
            grid: GridOptions {
                subchunk_target_bytes: sub_bytes,
                ..GridOptions::default()
            },
            ..SaveOptions::default()
        };
        save(&piece, &dir, &LocalComm::single(), &opts).unwrap();
        // The examples are shards without the 1.1 footer: read them as a 1.0 checkpoint.
        downgrade_to_1_0(&dir);
        let info = Checkpoint::open(&dir).unwrap().tensor(&key).unwrap();
        assert_eq!(
            (&info.chunk_shape, &info.subchunk_shape),
            (&u64s(&t["chunk_shape"]), &sub_shape),
            "line {}",
            ex.line
        );
        let file = dir.join("tensors/t").join(t["file"].as_str().unwrap());
        std::fs::write(&file, &hex).unwrap();
        assert_eq!(
            Checkpoint::open(&dir).unwrap().read_tensor(&key).unwrap(),
            data,
            "line {}",
            ex.line
        );

        // The same payload made invalid in ways a CRC-32C does not catch (the CRC-32C and the
        // index are recomputed): every one is refused as a corrupt shard.
        let off0 = u64::from_le_bytes(index[..8].try_into().unwrap()) as usize;
        let nb0 = u64::from_le_bytes(index[8..16].try_into().unwrap()) as usize;
        let payload = body[off0..off0 + nb0 - 4].to_vec();
        let mut bad: Vec<(&str, Vec<u8>)> = Vec::new();
        if comp == "zstd" {
            let mut trailing = payload.clone();
            trailing.push(0);
            bad.push(("a byte after the frame", trailing));
            let mut skip = vec![0x50, 0x2A, 0x4D, 0x18, 0, 0, 0, 0];
            skip.extend_from_slice(&payload);
            bad.push(("a skippable frame first", skip));
            let mut twice = payload.clone();
            twice.extend_from_slice(&payload);
            bad.push(("two frames", twice));
        } else {
            let mut v3 = payload.clone();
            v3[0] = 3;
            bad.push(("a Blosc2 version", v3));
            let mut bit = payload.clone();
            bit[2] |= 0x04;
            bad.push(("bit shuffle", bit));
            let mut ts = payload.clone();
            ts[3] = 2;
            bad.push(("another typesize", ts));
            let mut bs = payload.clone();
            bs[8..12].copy_from_slice(&4096u32.to_le_bytes());
            bad.push(("a block larger than the buffer", bs));
        }
        for (what, p) in bad {
            assert!(
                spec_check_payload(comp, &p, sub_bytes, d.size() as u8).is_err(),
                "{what}"
            );
            let stored = stored(&p);
            let mut entries = vec![None; n];
            entries[0] = Some((0, stored.len() as u64));
            std::fs::write(&file, shard_bytes(&stored, &entries)).unwrap();
            let e = Checkpoint::open(&dir)
                .unwrap()
                .read_tensor(&key)
                .expect_err(what);
            assert!(corrupt_shard(&e), "{comp} {what}: {e}");
        }
    }
}

/// Section 13: the safetensors data type names the command line maps to and from, checked by
/// importing a file with one tensor of each and exporting it back.
#[test]
fn safetensors_dtype_names_are_as_specified() {
    let ex = of_kind("safetensors").pop().unwrap();
    let table = ex.json();
    let table = table.as_object().unwrap();
    assert_eq!(table.len(), 15, "every data type of section 6.1 once");
    let ours: BTreeSet<&str> = table.values().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(ours.len(), 15);
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("in.safetensors");
    let datas: Vec<(String, safetensors::Dtype, Vec<u8>)> = table
        .keys()
        .map(|st| {
            let d: safetensors::Dtype = serde_json::from_value(json!(st)).unwrap();
            let size = dtype(table[st].as_str().unwrap()).size();
            let bytes = (0..3 * size)
                .map(|i| u8::try_from(i % 2).unwrap())
                .collect();
            (format!("t_{st}"), d, bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = datas
        .iter()
        .map(|(n, d, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, vec![3], b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &src).unwrap();
    let ckpt = tmp.path().join("ckpt");
    let bin = env!("CARGO_BIN_EXE_zarrckpt");
    let o = std::process::Command::new(bin)
        .arg("import")
        .arg(&src)
        .arg("--out")
        .arg(&ckpt)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let opened = Checkpoint::open(&ckpt).unwrap();
    for (st, ours) in table {
        let info = opened
            .tensor(&TensorKey::new(format!("t_{st}")).unwrap())
            .unwrap();
        assert_eq!(info.dtype.name(), ours.as_str().unwrap(), "{st}");
    }
    let out = tmp.path().join("out.safetensors");
    let o = std::process::Command::new(bin)
        .arg("export")
        .arg(&ckpt)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&out).unwrap());
}

// ---------------------------------------------------------------------------------------------
// Rules decided for issue 23 ("Trust II"): each test fails on the behaviour before the change
// where the code changed.
// ---------------------------------------------------------------------------------------------

/// A one-rank checkpoint of format 1.2 with a tensor of two present subchunks, a common JSON
/// object `cfg` of 13 bytes and a per-rank bytes object `rng`.
fn bound_checkpoint(dir: &Path, cfg: &Value, rng: &[u8]) {
    use zarrckpt::{StateObject, save_with_objects};
    let ints: Vec<u8> = [1i32, 2, 3, 4]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let pieces = [ShardedTensor::new(
        TensorKey::new("w").unwrap(),
        DType::Int32,
        vec![4],
        Region::full(&[4]),
        0,
        &ints,
    )
    .unwrap()];
    let objs = [
        StateObject::common("cfg", cfg.clone()).unwrap(),
        StateObject::per_rank("rng", rng.to_vec()).unwrap(),
    ];
    let opts = SaveOptions {
        grid: GridOptions {
            subchunk_target_bytes: 8,
            ..GridOptions::default()
        },
        ..SaveOptions::default()
    };
    save_with_objects(&pieces, &objs, dir, &LocalComm::single(), &opts).unwrap();
}

fn set_root(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let p = dir.join("zarr.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut v["attributes"]["zarrckpt"]);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// Rule 1: an object value is bound to its save (format 1.2, section 16.5): a value array or
/// a chunk file of another save, of the same size and with a valid CRC-32C, is refused by
/// reads and by verify. A 1.1 index does not bind its objects (section 12).
#[test]
fn object_values_of_another_save_are_refused() {
    use zarrckpt::ObjectSlot;
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    bound_checkpoint(&a, &json!({"a": 1, "b": 2}), &[1, 2, 3]);
    bound_checkpoint(&b, &json!({"a": 7, "b": 9}), &[4, 5, 6]);
    let cfg = TensorKey::new("cfg").unwrap();
    let read = |d: &Path, key: &TensorKey, slot: &ObjectSlot| {
        Checkpoint::open(d).unwrap().read_object(key, slot)
    };
    assert_eq!(
        read(&a, &cfg, &ObjectSlot::Common).unwrap(),
        zarrckpt::ObjectValue::Json(json!({"a": 1, "b": 2}))
    );
    // The chunk file of another save (same size, its own valid CRC-32C).
    std::fs::copy(b.join("objects/cfg/c.0"), a.join("objects/cfg/c.0")).unwrap();
    let e = read(&a, &cfg, &ObjectSlot::Common).unwrap_err().to_string();
    assert!(
        e.contains("another save") && e.contains("objects/cfg/c.0"),
        "{e}"
    );
    let report = Checkpoint::open(&a).unwrap().verify(1, None).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    // A 1.1 index does not bind objects: the same file reads without complaint there.
    set_root(&a, |z| z["version"] = json!("1.1"));
    assert_eq!(
        read(&a, &cfg, &ObjectSlot::Common).unwrap(),
        zarrckpt::ObjectValue::Json(json!({"a": 7, "b": 9}))
    );
    set_root(&a, |z| z["version"] = json!("1.2"));
    // The value array (zarr.json and chunk) of another save: refused by its save id.
    let rng = TensorKey::new("rng").unwrap();
    for f in ["zarr.json", "c.0"] {
        std::fs::copy(
            b.join("objects/rng/rank.0").join(f),
            a.join("objects/rng/rank.0").join(f),
        )
        .unwrap();
    }
    let e = read(&a, &rng, &ObjectSlot::Rank(0))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("written by save") && e.contains("rank.0/zarr.json"),
        "{e}"
    );
    // Without the attributes a 1.2 index requires: refused.
    let zj = a.join("objects/cfg/zarr.json");
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&zj).unwrap()).unwrap();
    doc["attributes"]["zarrckpt"]
        .as_object_mut()
        .unwrap()
        .remove("crc32c");
    std::fs::write(&zj, serde_json::to_vec(&doc).unwrap()).unwrap();
    let e = read(&a, &cfg, &ObjectSlot::Common).unwrap_err().to_string();
    assert!(e.contains("crc32c"), "{e}");
}

/// Rule 2: an index entry marked absent must have the footer entry 0 (section 7.4). Marking
/// a present subchunk absent and recomputing the index's CRC-32C is refused by reads (every
/// read method) and by verify, instead of reading zeros.
#[test]
fn an_absent_entry_needs_footer_entry_0() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    bound_checkpoint(&dir, &json!({}), &[1]);
    let shard = dir.join("tensors/w/c.0");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    // Two subchunks: index 32 bytes + CRC at the end; entry 1 starts 36 bytes from the end.
    let (start, crc_at) = (n - 36, n - 4);
    bytes[start + 16..crc_at].fill(0xFF);
    let crc = crc32c::crc32c(&bytes[start..crc_at]).to_le_bytes();
    bytes[crc_at..].copy_from_slice(&crc);
    std::fs::write(&shard, &bytes).unwrap();
    for m in METHODS {
        let e = read_with(&dir, "w", &Region::full(&[4]), m).unwrap_err();
        assert!(corrupt_shard(&e), "{e}");
        assert!(e.to_string().contains("absent"), "{e}");
        // A box inside the untouched subchunk is refused too: the index is checked whole.
        let e = read_with(&dir, "w", &Region::new(vec![0], vec![2]).unwrap(), m).unwrap_err();
        assert!(corrupt_shard(&e), "{e}");
    }
    let report = Checkpoint::open(&dir).unwrap().verify(1, None).unwrap();
    assert_eq!(report.problems.len(), 1);
}

/// Rule 3: `world_size` is an integer of at least 1 (section 4.1, step 4).
#[test]
fn world_size_0_is_refused() {
    let mut doc = root_by_id("main");
    doc["attributes"]["zarrckpt"]["world_size"] = json!(0);
    let e = parse_root(&doc).unwrap_err();
    assert!(
        matches!(e, StorageError::Malformed { .. }) && e.to_string().contains("world_size"),
        "{e}"
    );
    assert!(!schema_errors(&validator(None), &doc["attributes"]["zarrckpt"]).is_empty());
    doc["attributes"]["zarrckpt"]["world_size"] = json!(1);
    parse_root(&doc).unwrap();
}

/// Rule 6: the version decides. A 1.0 index carrying a `save_id` (whatever it holds) is read
/// as 1.0: shards without footers, arrays without a save id.
#[test]
fn a_1_0_index_with_a_save_id_is_read_as_1_0() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = small_checkpoint(tmp.path());
    let want = read_with(&dir, "g/h/ints", &Region::full(&[4]), METHODS[1]).unwrap();
    for id in [json!("6f1c0a9d3e2b4c5a8d7e6f1029384756"), json!("not hex")] {
        set_root(&dir, |z| z["save_id"] = id.clone());
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(ckpt.meta().save_id, None);
        for m in METHODS {
            assert_eq!(
                read_with(&dir, "g/h/ints", &Region::full(&[4]), m).unwrap(),
                want
            );
        }
        assert!(ckpt.verify(1, None).unwrap().problems.is_empty());
    }
}

fn nested_user(levels: usize) -> String {
    // `levels` levels counting `user`'s own object.
    let inner = levels - 1;
    format!(
        r#""user":{{"x":{}0{}}}"#,
        "[".repeat(inner),
        "]".repeat(inner)
    )
}

/// Rule 5: `user` is not interpreted but is parsed, with stated limits (section 4.1, step 1):
/// 126 levels in the document (123 counting `user`), numbers within binary64. A save whose
/// `user` breaks them fails before writing anything; object JSON values follow the same
/// rules (duplicate names, lone surrogates, depth).
#[test]
fn user_and_object_json_limits_are_stated_and_checked() {
    let text = root_text();
    let user = r#""user":{"iteration":1000,"consumed_samples":2048000}"#;
    assert!(text.contains(user));
    parse_text(text.replacen(user, &nested_user(123), 1).as_bytes()).unwrap();
    let e = parse_text(text.replacen(user, &nested_user(124), 1).as_bytes()).unwrap_err();
    assert!(e.to_string().contains("nested more than 126"), "{e}");
    let e = parse_text(text.replacen(user, r#""user":{"x":1e400}"#, 1).as_bytes()).unwrap_err();
    assert!(matches!(e, StorageError::Malformed { .. }), "{e}");
    let m = parse_text(
        text.replacen(user, r#""user":{"x":18446744073709551616,"y":-1e308}"#, 1)
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(m.user["x"].as_f64(), Some(18_446_744_073_709_551_616.0));

    // A save with a `user` deeper than readers parse fails before writing anything.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let mut deep = json!(0);
    for _ in 0..123 {
        deep = json!([deep]);
    }
    let mut opts = SaveOptions::default();
    opts.user_metadata.insert("x".into(), deep.clone());
    let e = save(&[], &dir, &LocalComm::single(), &opts).unwrap_err();
    assert!(matches!(e, Error::UserMetadata { .. }), "{e}");
    assert!(!dir.exists());
    opts.user_metadata.insert("x".into(), deep[0].clone());
    save(&[], &dir, &LocalComm::single(), &opts).unwrap();
    assert_eq!(
        Checkpoint::open(&dir).unwrap().meta().user["x"],
        deep[0].clone()
    );

    // Object values: too deep is refused when declared; a stored value with a duplicate
    // member name (written by another writer) is refused when read.
    let mut v = json!(0);
    for _ in 0..127 {
        v = json!([v]);
    }
    let e = zarrckpt::StateObject::common("v", v.clone()).unwrap_err();
    assert!(e.to_string().contains("126"), "{e}");
    zarrckpt::StateObject::common("v", v[0].clone()).unwrap();
    let dir = tmp.path().join("obj");
    bound_checkpoint(&dir, &json!({"a": 1, "bb": 2}), &[1]);
    for bad in [&br#"{"a":1,"a":2}"#[..], &br#"{"a":"\uD800"}"#[..]] {
        let mut padded = bad.to_vec();
        padded.resize(14, b' ');
        let crc = crc32c::crc32c(&padded);
        std::fs::write(
            dir.join("objects/cfg/c.0"),
            [&padded[..], &crc.to_le_bytes()].concat(),
        )
        .unwrap();
        let zj = dir.join("objects/cfg/zarr.json");
        let mut doc: Value = serde_json::from_slice(&std::fs::read(&zj).unwrap()).unwrap();
        doc["attributes"]["zarrckpt"]["crc32c"] = json!(crc);
        std::fs::write(&zj, serde_json::to_vec(&doc).unwrap()).unwrap();
        let e = Checkpoint::open(&dir)
            .unwrap()
            .read_object(
                &TensorKey::new("cfg").unwrap(),
                &zarrckpt::ObjectSlot::Common,
            )
            .unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
    }
}

/// Rule 9: the schema requires `save_id` from version 1.1 on, and in the arrays of such a
/// checkpoint ($defs/bound_array) and (1.2) the object value arrays ($defs/bound_object_array).
#[test]
fn schema_requires_save_ids_from_1_1() {
    let v = validator(None);
    let mut z = root_by_id("objects")["attributes"]["zarrckpt"].clone();
    assert!(schema_errors(&v, &z).is_empty());
    z.as_object_mut().unwrap().remove("save_id");
    for (version, ok) in [
        ("1.0", true),
        ("1.1", false),
        ("1.2", false),
        ("1.10", false),
    ] {
        z["version"] = json!(version);
        assert_eq!(schema_errors(&v, &z).is_empty(), ok, "{version}");
    }
    let arrays = of_kind("array");
    let doc = arrays[0].json();
    assert!(schema_errors(&validator(Some("array")), &doc).is_empty());
    assert!(!schema_errors(&validator(Some("bound_array")), &doc).is_empty());
    let mut doc = of_kind("object_array")[0].json();
    assert!(schema_errors(&validator(Some("bound_object_array")), &doc).is_empty());
    doc["attributes"]["zarrckpt"]
        .as_object_mut()
        .unwrap()
        .remove("crc32c");
    assert!(schema_errors(&validator(Some("object_array")), &doc).is_empty());
    assert!(!schema_errors(&validator(Some("bound_object_array")), &doc).is_empty());
}

/// Trivial parts of rule 9: the members of the index are written in the order of section 4's
/// table.
#[test]
fn index_members_are_written_in_table_order() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    bound_checkpoint(&dir, &json!({}), &[1]);
    let text = std::fs::read_to_string(dir.join("zarr.json")).unwrap();
    let spec = spec_text();
    let table = &spec[spec.find("| member | type | meaning |").unwrap()..];
    let table = &table[..table.find("\n\n").unwrap()];
    let names: Vec<&str> = table
        .lines()
        .skip(2)
        .map(|l| l.split('`').nth(1).unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "format",
            "version",
            "writer",
            "world_size",
            "save_id",
            "tensors",
            "user",
            "objects"
        ]
    );
    let at: Vec<usize> = names
        .iter()
        .map(|n| {
            text.find(&format!("\n      \"{n}\":"))
                .unwrap_or_else(|| panic!("{n}"))
        })
        .collect();
    assert!(at.is_sorted(), "{at:?}\n{text}");
}
