//! Importing a PyTorch DCP checkpoint directory (`FileSystemWriter`'s format, as torchtitan
//! writes it) into a zarrckpt checkpoint, in this process, without Python and without running
//! any pickle (see [`super::dcp`]).
//!
//! Layout: each tensor is written in the chunks the source saved, or split `ranks` ways along
//! its first axis. Non-tensor values become objects: `bytes` as bytes, plain data (`dict` with
//! `str` keys, `list`, `tuple`, `str`, `int`, `float`, `bool`, `None`) as JSON, a tensor as a
//! tensor; any other pickled value is refused with an error naming its key (this importer
//! cannot run pickles; the Python package's `import_dcp(..., weights_only=False)` can).
//! After the save every tensor chunk and every object is read back and compared, byte for byte.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::dcp::{DcpEntry, DcpMetadata, ItemValue, item_file, read_item};
use super::error::FormatError;
use super::pickle::Value;
use crate::model::copy::copy_region;
use crate::{
    Checkpoint, Compression, DType, LocalComm, ObjectSlot, ObjectValue, Region, SaveOptions,
    SaveReport, ShardedTensor, StateObject, TensorKey, save_with_objects,
};

/// The per-rank object the zarrckpt DCP writer keeps its list of pickled keys in (none here).
pub const TORCH_SAVE_FLAG: &str = "__zarrckpt_dcp__";

/// How to import.
#[derive(Debug, Clone, Default)]
pub struct DcpImportOptions {
    /// Split each tensor this many ways along its first axis (`None`: the source's chunks).
    pub ranks: Option<u64>,
    /// Replace an existing checkpoint.
    pub overwrite: bool,
    /// Chunk compression.
    pub compression: Compression,
}

/// What an import did.
#[derive(Debug, Clone)]
pub struct DcpImportReport {
    /// Tensors written.
    pub tensors: usize,
    /// Objects written (not counting the writer's flag).
    pub objects: usize,
    /// Bytes of tensor data.
    pub tensor_bytes: u64,
    /// The save's report.
    pub save: SaveReport,
}

/// A piece of a tensor: its box and bytes (borrowed from a mapped file when they can be).
pub(super) type Piece<'a> = (Region, Cow<'a, [u8]>);

/// One tensor to write: its pieces.
pub(super) struct Tensor<'a> {
    pub(super) key: TensorKey,
    pub(super) dtype: DType,
    pub(super) shape: Vec<u64>,
    pub(super) pieces: Vec<Piece<'a>>,
}

impl<'a> Tensor<'a> {
    /// A tensor held whole: one piece, its full box.
    pub(super) fn whole(
        key: TensorKey,
        dtype: DType,
        shape: Vec<u64>,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Self {
        let r = Region::full(&shape);
        Tensor {
            key,
            dtype,
            shape,
            pieces: vec![(r, data.into())],
        }
    }

    /// The tensor a DCP tensor entry (`fqn`: `dtype`, `size`, `declared` chunks) describes,
    /// its pieces read from the `.distcp` files in `src` ([`read_tensor`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stored(
        src: &Path,
        md: &DcpMetadata,
        files: &'a Files,
        fqn: &str,
        key: TensorKey,
        dtype: DType,
        size: &[u64],
        declared: usize,
    ) -> Result<Self, FormatError> {
        Ok(Tensor {
            key,
            dtype,
            shape: size.to_vec(),
            pieces: read_tensor(src, md, files, fqn, dtype, size, declared)?,
        })
    }
}

pub(super) fn bad(path: &Path, item: &str, msg: impl Into<String>) -> FormatError {
    FormatError::Dcp {
        path: path.to_owned(),
        item: item.to_owned(),
        msg: msg.into(),
    }
}

fn region(
    path: &Path,
    fqn: &str,
    offset: Vec<u64>,
    shape: Vec<u64>,
) -> Result<Region, FormatError> {
    Region::new(offset, shape).map_err(|e| bad(path, fqn, e.to_string()))
}

fn volume(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

/// The source files, mapped.
pub(super) struct Files {
    dir: PathBuf,
    maps: BTreeMap<String, Mmap>,
}

impl Files {
    pub(super) fn open(dir: &Path, md: &DcpMetadata) -> Result<Files, FormatError> {
        let mut maps = BTreeMap::new();
        for s in &md.storage {
            if maps.contains_key(&s.file) {
                continue;
            }
            let p = item_file(dir, s);
            let f = File::open(&p).map_err(FormatError::io("open", &p))?;
            // SAFETY: mapped read-only; as every checkpoint reader, we do not guard against a
            // writer changing the file underneath (the comparison after the save would see it).
            let m = unsafe { Mmap::map(&f) }.map_err(FormatError::io("map", &p))?;
            maps.insert(s.file.clone(), m);
        }
        Ok(Files {
            dir: dir.to_owned(),
            maps,
        })
    }

    pub(super) fn bytes(&self, s: &super::dcp::DcpStorage) -> Result<&[u8], FormatError> {
        let p = item_file(&self.dir, s);
        let m = &self.maps[&s.file];
        let end = s
            .start
            .checked_add(s.length)
            .filter(|&e| e <= m.len() as u64);
        let Some(end) = end else {
            return Err(bad(
                &p,
                &s.fqn,
                format!(
                    "bytes {}..{}+{} lie past the end of the file ({} bytes)",
                    s.start,
                    s.start,
                    s.length,
                    m.len()
                ),
            ));
        };
        // Inside the mapping (checked): fit a usize.
        Ok(&m[s.start as usize..end as usize])
    }
}

/// Imports the DCP checkpoint directory `src` into a zarrckpt checkpoint at `dst`.
///
/// # Errors
/// [`FormatError`]: a source that does not parse or is inconsistent ([`FormatError::Dcp`],
/// [`FormatError::Pickle`], each naming the file and the item), a value that is not plain
/// data, a save or read-back failure ([`FormatError::Checkpoint`]).
pub fn import_dcp(
    src: &Path,
    dst: &Path,
    opts: &DcpImportOptions,
) -> Result<DcpImportReport, FormatError> {
    check_options(opts)?;
    let md = DcpMetadata::read(src)?;
    let files = Files::open(src, &md)?;
    let mut tensors: BTreeMap<String, Tensor<'_>> = BTreeMap::new();
    let mut objects: Vec<(TensorKey, ObjectValue)> = Vec::new();
    let mut keys: BTreeMap<String, String> = BTreeMap::new();
    for (fqn, entry) in &md.entries {
        let key = md.key_of(fqn);
        if let Some(other) = keys.insert(key.clone(), fqn.clone()) {
            return Err(bad(
                src,
                fqn,
                format!("`{other}` and `{fqn}` map to the same zarrckpt key `{key}`"),
            ));
        }
        let tkey = TensorKey::new(key.as_str()).map_err(|e| bad(src, fqn, e.to_string()))?;
        match entry {
            DcpEntry::Tensor {
                dtype,
                size,
                chunks,
            } => {
                let t = Tensor::stored(src, &md, &files, fqn, tkey, *dtype, size, chunks.len())?;
                tensors.insert(fqn.clone(), t);
            }
            DcpEntry::Bytes => {
                let (p, bytes) = bytes_item(src, &md, &files, fqn)?;
                match read_item(&p, fqn, bytes)? {
                    ItemValue::Tensor { dtype, shape, data } => {
                        tensors.insert(fqn.clone(), Tensor::whole(tkey, dtype, shape, data));
                    }
                    ItemValue::Other(Value::Bytes(b)) => {
                        objects.push((tkey, ObjectValue::Bytes(b)))
                    }
                    ItemValue::Other(v) => {
                        let j = to_json(&v).map_err(|what| {
                            bad(
                                &p,
                                fqn,
                                format!(
                                    "{what} is neither a tensor, bytes nor plain data (dict, list, str, int, float, bool, None); zarrckpt stores no pickles and this importer runs none (the Python package's zarrckpt.dcp.import_dcp(..., weights_only=False) unpickles with torch, running whatever code the pickle holds)"
                                ),
                            )
                        })?;
                        objects.push((tkey, ObjectValue::Json(j)));
                    }
                }
            }
        }
    }
    if let Some(n) = opts.ranks {
        for t in tensors.values_mut() {
            resplit(t, n);
        }
    }
    write(dst, &tensors, &objects, opts, Marks::Dcp)
}

/// `ranks`, if given, is at least 1.
pub(super) fn check_options(opts: &DcpImportOptions) -> Result<(), FormatError> {
    if opts.ranks == Some(0) {
        return Err(FormatError::Option {
            option: "ranks",
            msg: "must be at least 1".into(),
        });
    }
    Ok(())
}

/// The file and the bytes of the bytes item `fqn` (exactly one storage entry).
pub(super) fn bytes_item<'a>(
    src: &Path,
    md: &DcpMetadata,
    files: &'a Files,
    fqn: &str,
) -> Result<(PathBuf, &'a [u8]), FormatError> {
    let mut found = md.storage.iter().filter(|s| s.fqn == fqn);
    let (Some(s), None) = (found.next(), found.next()) else {
        return Err(bad(
            src,
            fqn,
            "a bytes item without exactly one storage entry",
        ));
    };
    Ok((item_file(src, s), files.bytes(s)?))
}

/// Every chunk of tensor `fqn`, checked against the metadata: same shapes, inside the tensor,
/// covering it exactly (by volume; the save checks overlaps).
fn read_tensor<'a>(
    src: &Path,
    md: &DcpMetadata,
    files: &'a Files,
    fqn: &str,
    dtype: DType,
    size: &[u64],
    declared: usize,
) -> Result<Vec<Piece<'a>>, FormatError> {
    let mut pieces = Vec::new();
    let mut covered: u64 = 0;
    for s in md.storage.iter().filter(|s| s.fqn == fqn) {
        let p = item_file(src, s);
        let Some(offset) = s.offset.clone() else {
            return Err(bad(&p, fqn, "a tensor chunk without an offset"));
        };
        let bytes = files.bytes(s)?;
        let ItemValue::Tensor {
            dtype: got,
            shape,
            data,
        } = read_item(&p, fqn, bytes)?
        else {
            return Err(bad(&p, fqn, "a tensor chunk that holds no tensor"));
        };
        if got != dtype {
            return Err(bad(
                &p,
                fqn,
                format!(
                    "chunk at {offset:?} holds {} data, the metadata says {}",
                    got.name(),
                    dtype.name()
                ),
            ));
        }
        let inside = offset.len() == size.len()
            && shape.len() == size.len()
            && offset
                .iter()
                .zip(&shape)
                .zip(size)
                .all(|((&o, &n), &d)| o.checked_add(n).is_some_and(|e| e <= d));
        if !inside {
            return Err(bad(
                &p,
                fqn,
                format!(
                    "chunk at {offset:?} of shape {shape:?} lies outside the tensor's {size:?}"
                ),
            ));
        }
        covered = covered.saturating_add(volume(&shape).unwrap_or(u64::MAX));
        pieces.push((region(&p, fqn, offset, shape)?, data));
    }
    let total = volume(size).ok_or_else(|| bad(src, fqn, "a shape whose volume overflows"))?;
    if covered != total || (pieces.is_empty() && declared > 0) {
        return Err(bad(
            src,
            fqn,
            format!(
                "the saved chunks hold {covered} elements of the tensor's {total} (shape {size:?})"
            ),
        ));
    }
    if pieces.is_empty() {
        // An empty tensor DCP saved no chunk for.
        pieces.push((Region::full(size), Cow::Borrowed(&[][..])));
    }
    Ok(pieces)
}

/// Re-cuts a tensor into `n` parts along its first axis (torch.chunk style: uneven last part,
/// empty parts dropped).
pub(super) fn resplit(t: &mut Tensor<'_>, n: u64) {
    let elem = t.dtype.size();
    let Some(&d0) = t.shape.first() else {
        return;
    };
    let full = Region::full(&t.shape);
    let total: usize = t.pieces.iter().map(|(_, d)| d.len()).sum();
    let mut whole = vec![0u8; total];
    for (r, d) in &t.pieces {
        copy_region(d, r, &mut whole, &full, r, elem);
    }
    let row = total
        .checked_div(usize::try_from(d0).unwrap_or(1))
        .unwrap_or(0);
    let part = d0.div_ceil(n);
    let mut pieces = Vec::new();
    for r in 0..n {
        let lo = (r * part).min(d0);
        let hi = (lo + part).min(d0);
        if hi > lo {
            let reg = full
                .clone()
                .with_axis(0, lo, hi - lo)
                .expect("inside the tensor");
            // Rows lo..hi of a buffer of d0 rows: in bounds.
            let bytes = whole[lo as usize * row..hi as usize * row].to_vec();
            pieces.push((reg, Cow::Owned(bytes)));
        }
    }
    if pieces.is_empty() {
        pieces.push((full, Cow::Owned(Vec::new())));
    }
    t.pieces = pieces;
}

fn to_json(v: &Value) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    Ok(match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(J::Number)
            .ok_or_else(|| format!("the float {f}"))?,
        Value::Str(s) => J::String(s.clone()),
        Value::List(items) | Value::Tuple(items) => {
            J::Array(items.iter().map(to_json).collect::<Result<_, _>>()?)
        }
        Value::Dict(items) => dict_json(items)?,
        Value::Object {
            module,
            name,
            args,
            state,
        } if module == "collections" && name == "OrderedDict" && args.is_empty() => {
            match state.as_deref() {
                None => J::Object(serde_json::Map::new()),
                Some(Value::Dict(items)) => dict_json(items)?,
                Some(_) => return Err("an OrderedDict with unexpected state".into()),
            }
        }
        other => return Err(format!("a {} value", other.type_name())),
    })
}

fn dict_json(items: &[(Value, Value)]) -> Result<serde_json::Value, String> {
    let mut m = serde_json::Map::new();
    for (k, x) in items {
        let Value::Str(k) = k else {
            return Err(format!("a dict with a {} key", k.type_name()));
        };
        m.insert(k.clone(), to_json(x)?);
    }
    Ok(serde_json::Value::Object(m))
}

/// How [`write`] marks the checkpoint: the DCP writer's per-rank flag object and
/// `user_metadata.source = "dcp"` (plain DCP imports), or nothing (Megatron imports, as the
/// Megatron backend writes its checkpoints).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Marks {
    Dcp,
    None,
}

/// Saves the tensors and objects at `dst` in one process, then reads every box and object
/// back and compares it with the source's.
pub(super) fn write(
    dst: &Path,
    tensors: &BTreeMap<String, Tensor<'_>>,
    objects: &[(TensorKey, ObjectValue)],
    opts: &DcpImportOptions,
    marks: Marks,
) -> Result<DcpImportReport, FormatError> {
    let ck_err = |source: crate::Error| FormatError::Checkpoint {
        path: dst.to_owned(),
        source: Box::new(source),
    };
    let mut pieces = Vec::new();
    for t in tensors.values() {
        for (r, d) in &t.pieces {
            pieces.push(
                ShardedTensor::new(t.key.clone(), t.dtype, t.shape.clone(), r.clone(), 0, d)
                    .map_err(|e| ck_err(e.into()))?,
            );
        }
    }
    let mut objs = Vec::with_capacity(objects.len() + 1);
    for (k, v) in objects {
        objs.push(StateObject::common(k.as_str(), v.clone()).map_err(|e| ck_err(e.into()))?);
    }
    let mut so = SaveOptions {
        overwrite: opts.overwrite,
        compression: opts.compression,
        ..Default::default()
    };
    if marks == Marks::Dcp {
        objs.push(
            StateObject::per_rank(TORCH_SAVE_FLAG, serde_json::json!({"torch_save": []}))
                .map_err(|e| ck_err(e.into()))?,
        );
        so.user_metadata.insert("source".into(), "dcp".into());
    }
    let report =
        save_with_objects(&pieces, &objs, dst, &LocalComm::single(), &so).map_err(ck_err)?;
    // Every byte back, compared with the source's.
    let ck = Checkpoint::open(dst).map_err(ck_err)?;
    for t in tensors.values() {
        for (r, d) in &t.pieces {
            let mut buf = vec![0u8; d.len()];
            ck.read_region(&t.key, r, &mut buf).map_err(ck_err)?;
            if buf != **d {
                return Err(bad(
                    dst,
                    t.key.as_str(),
                    format!("the imported box {r:?} differs from the source"),
                ));
            }
        }
    }
    for (k, v) in objects {
        let got = ck.read_object(k, &ObjectSlot::Common).map_err(ck_err)?;
        if &got != v {
            return Err(bad(
                dst,
                k.as_str(),
                "the imported object differs from the source",
            ));
        }
    }
    Ok(DcpImportReport {
        tensors: tensors.len(),
        objects: objects.len(),
        tensor_bytes: tensors
            .values()
            .flat_map(|t| t.pieces.iter().map(|(_, d)| d.len() as u64))
            .sum(),
        save: report,
    })
}
