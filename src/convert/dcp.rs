//! Reading what PyTorch DCP's `FileSystemWriter` writes, without Python and without running
//! any pickle: the `.metadata` file (a pickle of `torch.distributed.checkpoint.metadata.Metadata`)
//! and the `.distcp` files, in which every item is a byte range: a tensor chunk or a non-tensor
//! value written by `torch.save` (a stored zip archive: `data.pkl` and `data/N` storages).
//!
//! Pickles are read by the restricted interpreter of [`super::pickle`] with an allow-list of
//! the torch and `collections` classes DCP and `torch.save` use; everything is bounded:
//! [`MAX_METADATA_BYTES`], item ranges inside their files, tensor views inside their storages,
//! every size computed with checked arithmetic. The import engine is [`import_dcp`](super::import_dcp).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use super::error::FormatError;
use super::pickle::{self, AllowList, Value};
use crate::DType;

/// The largest `.metadata` file read, in bytes.
pub const MAX_METADATA_BYTES: u64 = 1 << 30;
/// The most dimensions a DCP tensor may have.
pub const MAX_DCP_DIMS: usize = 32;

/// What the `.metadata` pickle may name.
const METADATA_ALLOW: AllowList<'static> = &[
    ("torch.distributed.checkpoint.metadata", "*"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "*"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("torch", "*"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
];

/// What an item's `data.pkl` (a `torch.save` of a tensor or of plain data) may name.
const ITEM_ALLOW: AllowList<'static> = &[
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch", "FloatStorage"),
    ("torch", "DoubleStorage"),
    ("torch", "HalfStorage"),
    ("torch", "BFloat16Storage"),
    ("torch", "LongStorage"),
    ("torch", "IntStorage"),
    ("torch", "ShortStorage"),
    ("torch", "CharStorage"),
    ("torch", "ByteStorage"),
    ("torch", "BoolStorage"),
    ("torch", "Float8_e4m3fnStorage"),
    ("torch", "Float8_e5m2Storage"),
];

/// One saved chunk of a tensor: its box in the global tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpChunk {
    /// Where the chunk starts.
    pub offsets: Vec<u64>,
    /// Its extent.
    pub sizes: Vec<u64>,
}

/// What `.metadata` says about one state-dict entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DcpEntry {
    /// A tensor, saved as these chunks.
    Tensor {
        /// Its data type.
        dtype: DType,
        /// Its global shape.
        size: Vec<u64>,
        /// The chunks saved.
        chunks: Vec<DcpChunk>,
    },
    /// A non-tensor value, saved with `torch.save` (or raw bytes).
    Bytes,
}

/// Where one item's bytes are: a range of a file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpStorage {
    /// The item's state-dict key.
    pub fqn: String,
    /// A tensor chunk's offset (`None` for a bytes item).
    pub offset: Option<Vec<u64>>,
    /// The file, relative to the checkpoint directory (a plain file name).
    pub file: String,
    /// The first byte.
    pub start: u64,
    /// The length.
    pub length: u64,
}

/// A DCP checkpoint's `.metadata`, read without running it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpMetadata {
    /// Every state-dict entry, by key (DCP's flattened FQN).
    pub entries: BTreeMap<String, DcpEntry>,
    /// Where each item's bytes are.
    pub storage: Vec<DcpStorage>,
    /// DCP's flattening: FQN to the path of the leaf in the nested state dict.
    pub mappings: BTreeMap<String, Vec<String>>,
}

fn bad(path: &Path, item: &str, msg: impl Into<String>) -> FormatError {
    FormatError::Dcp {
        path: path.to_owned(),
        item: item.to_owned(),
        msg: msg.into(),
    }
}

fn uint(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

/// A `torch.Size`, tuple or list of non-negative ints.
fn dims(v: &Value) -> Option<Vec<u64>> {
    let items = match v {
        Value::Object {
            module, name, args, ..
        } if module == "torch" && name == "Size" => match args.first() {
            Some(Value::List(a) | Value::Tuple(a)) => a,
            None => return Some(Vec::new()),
            _ => return None,
        },
        Value::List(a) | Value::Tuple(a) => a,
        _ => return None,
    };
    if items.len() > MAX_DCP_DIMS {
        return None;
    }
    items.iter().map(uint).collect()
}

fn torch_dtype(v: &Value) -> Option<DType> {
    match v {
        Value::Global { module, name } if module == "torch" => DType::from_name(name),
        _ => None,
    }
}

impl DcpMetadata {
    /// Reads `dir/.metadata`.
    ///
    /// # Errors
    /// [`FormatError::Io`] if it cannot be read, [`FormatError::Pickle`] /
    /// [`FormatError::Dcp`] if it is not a DCP metadata pickle (a forbidden global, a
    /// malformed or truncated pickle, a missing field, a size over the limits).
    pub fn read(dir: &Path) -> Result<DcpMetadata, FormatError> {
        let path = dir.join(".metadata");
        let len = std::fs::metadata(&path)
            .map_err(FormatError::io("stat", &path))?
            .len();
        if len > MAX_METADATA_BYTES {
            return Err(bad(
                &path,
                ".metadata",
                format!("{len} bytes, more than the limit of {MAX_METADATA_BYTES}"),
            ));
        }
        let data = std::fs::read(&path).map_err(FormatError::io("read", &path))?;
        Self::parse(&path, &data)
    }

    /// Parses the bytes of a `.metadata` file (`path` names it in errors).
    ///
    /// # Errors
    /// As [`DcpMetadata::read`].
    pub fn parse(path: &Path, data: &[u8]) -> Result<DcpMetadata, FormatError> {
        let v = pickle::read(data, METADATA_ALLOW).map_err(|source| FormatError::Pickle {
            path: path.to_owned(),
            item: ".metadata".into(),
            source,
        })?;
        if v.class().as_deref() != Some("torch.distributed.checkpoint.metadata.Metadata") {
            return Err(bad(
                path,
                ".metadata",
                format!("holds a {}, not a DCP Metadata", v.type_name()),
            ));
        }
        let Some(Value::Dict(sdm)) = v.attr("state_dict_metadata") else {
            return Err(bad(path, ".metadata", "no state_dict_metadata dict"));
        };
        let mut entries = BTreeMap::new();
        for (k, e) in sdm {
            let Value::Str(fqn) = k else {
                return Err(bad(path, ".metadata", "a state-dict key that is not a str"));
            };
            let entry = Self::entry(path, fqn, e)?;
            if entries.insert(fqn.clone(), entry).is_some() {
                return Err(bad(path, fqn, "listed twice"));
            }
        }
        let mut storage = Vec::new();
        match v.attr("storage_data") {
            Some(Value::Dict(sd)) => {
                for (idx, info) in sd {
                    storage.push(Self::storage(path, idx, info)?);
                }
            }
            _ => return Err(bad(path, ".metadata", "no storage_data dict")),
        }
        let mut mappings = BTreeMap::new();
        if let Some(Value::Dict(pd)) = v.attr("planner_data") {
            for (k, p) in pd {
                let (Value::Str(fqn), Value::Tuple(parts) | Value::List(parts)) = (k, p) else {
                    continue;
                };
                let parts: Option<Vec<String>> = parts
                    .iter()
                    .map(|x| match x {
                        Value::Str(s) => Some(s.clone()),
                        Value::Int(i) => Some(i.to_string()),
                        _ => None,
                    })
                    .collect();
                let parts = parts.ok_or_else(|| {
                    bad(
                        path,
                        fqn,
                        "a flattening path element that is not a str or an int",
                    )
                })?;
                mappings.insert(fqn.clone(), parts);
            }
        }
        Ok(DcpMetadata {
            entries,
            storage,
            mappings,
        })
    }

    fn entry(path: &Path, fqn: &str, e: &Value) -> Result<DcpEntry, FormatError> {
        match e.class().as_deref() {
            Some("torch.distributed.checkpoint.metadata.BytesStorageMetadata") => {
                Ok(DcpEntry::Bytes)
            }
            Some("torch.distributed.checkpoint.metadata.TensorStorageMetadata") => {
                // TensorProperties pickles its state as a tuple (dtype, layout, ...) through
                // __getstate__; older versions as a dict.
                let dtype = e
                    .attr("properties")
                    .and_then(|p| match p {
                        Value::Object {
                            state: Some(st), ..
                        } if matches!(st.as_ref(), Value::Tuple(t) if t.len() > 2) => {
                            let Value::Tuple(t) = st.as_ref() else {
                                return None;
                            };
                            t.first()
                        }
                        p => p.attr("dtype"),
                    })
                    .ok_or_else(|| bad(path, fqn, "a tensor without properties.dtype"))?;
                let dtype = torch_dtype(dtype).ok_or_else(|| {
                    bad(
                        path,
                        fqn,
                        format!("data type {} has no zarrckpt equivalent", dtype.type_name()),
                    )
                })?;
                let size = e
                    .attr("size")
                    .and_then(dims)
                    .ok_or_else(|| bad(path, fqn, "a tensor without a valid size"))?;
                let Some(Value::List(cs)) = e.attr("chunks") else {
                    return Err(bad(path, fqn, "a tensor without a chunk list"));
                };
                let chunks = cs
                    .iter()
                    .map(|c| {
                        let offsets = c.attr("offsets").and_then(dims);
                        let sizes = c.attr("sizes").and_then(dims);
                        match (offsets, sizes) {
                            (Some(offsets), Some(sizes))
                                if offsets.len() == size.len() && sizes.len() == size.len() =>
                            {
                                Ok(DcpChunk { offsets, sizes })
                            }
                            _ => Err(bad(path, fqn, "a chunk without valid offsets and sizes")),
                        }
                    })
                    .collect::<Result<_, _>>()?;
                Ok(DcpEntry::Tensor {
                    dtype,
                    size,
                    chunks,
                })
            }
            _ => Err(bad(
                path,
                fqn,
                format!("an entry of type {}", e.type_name()),
            )),
        }
    }

    fn storage(path: &Path, idx: &Value, info: &Value) -> Result<DcpStorage, FormatError> {
        let Some(Value::Str(fqn)) = idx.attr("fqn") else {
            return Err(bad(path, ".metadata", "a storage index without an fqn"));
        };
        let offset = match idx.attr("offset") {
            None | Some(Value::None) => None,
            Some(o) => {
                Some(dims(o).ok_or_else(|| bad(path, fqn, "a storage index with a bad offset"))?)
            }
        };
        let Some(Value::Str(file)) = info.attr("relative_path") else {
            return Err(bad(path, fqn, "storage info without relative_path"));
        };
        if file.is_empty()
            || file.contains('/')
            || file.contains('\\')
            || file == "."
            || file == ".."
            || file.contains('\0')
        {
            return Err(bad(
                path,
                fqn,
                format!("relative_path {file:?} is not a file name in the checkpoint directory"),
            ));
        }
        let (Some(start), Some(length)) = (
            info.attr("offset").and_then(uint),
            info.attr("length").and_then(uint),
        ) else {
            return Err(bad(path, fqn, "storage info without offset and length"));
        };
        if !matches!(info.attr("transform_descriptors"), None | Some(Value::None))
            && !matches!(info.attr("transform_descriptors"), Some(Value::List(l) | Value::Tuple(l)) if l.is_empty())
        {
            return Err(bad(
                path,
                fqn,
                "the item was transformed (compressed or encrypted by a storage extension), which this importer does not undo",
            ));
        }
        Ok(DcpStorage {
            fqn: fqn.clone(),
            offset,
            file: file.clone(),
            start,
            length,
        })
    }

    /// The zarrckpt key of `fqn`: the `/`-joined path of the leaf in the nested state dict, or
    /// the FQN itself for a flat state dict.
    #[must_use]
    pub fn key_of(&self, fqn: &str) -> String {
        self.mappings
            .get(fqn)
            .map_or_else(|| fqn.to_owned(), |p| p.join("/"))
    }
}

/// One item's value as `torch.save` wrote it.
#[derive(Debug)]
pub enum ItemValue<'a> {
    /// A tensor: its data type, shape and bytes in C order.
    Tensor {
        /// The data type.
        dtype: DType,
        /// The shape.
        shape: Vec<u64>,
        /// The bytes, borrowed from the file when the stored view is contiguous.
        data: Cow<'a, [u8]>,
    },
    /// Any other value, as a tree.
    Other(Value),
}

/// Reads one item (the bytes of a `torch.save` archive), `what` naming it in errors.
///
/// # Errors
/// [`FormatError::Dcp`] for an archive that is not a stored zip with one `data.pkl`, a storage
/// that is missing, too short or big-endian, a tensor view outside its storage;
/// [`FormatError::Pickle`] for a pickle refused by the restricted reader.
pub fn read_item<'a>(
    path: &Path,
    what: &str,
    bytes: &'a [u8],
) -> Result<ItemValue<'a>, FormatError> {
    let ts = TorchSave::read(path, what, bytes, ITEM_ALLOW)?;
    match &ts.value {
        Value::Object {
            module, name, args, ..
        } if module == "torch._utils" && name == "_rebuild_tensor_v2" => {
            rebuild_tensor(path, what, &ts.archive, args)
        }
        _ => Ok(ItemValue::Other(ts.value)),
    }
}

/// A tensor rebuilt from a `torch.save` archive: its data type, shape and bytes in C order.
pub type RawTensor<'a> = (DType, Vec<u64>, Cow<'a, [u8]>);

/// A whole `torch.save` archive read without running it: its pickle as a tree, and its
/// storages, from which the tensors the tree references are rebuilt on demand.
pub struct TorchSave<'a> {
    archive: Archive<'a>,
    path: PathBuf,
    what: String,
    /// The pickled value, as a tree (tensors appear as `torch._utils._rebuild_tensor_v2`
    /// objects; see [`TorchSave::tensor`]).
    pub value: Value,
}

impl<'a> TorchSave<'a> {
    /// Reads the archive `bytes` (`path` and `what` name it in errors), accepting the globals
    /// of `allow` in its `data.pkl`.
    ///
    /// # Errors
    /// As [`read_item`].
    pub fn read(
        path: &Path,
        what: &str,
        bytes: &'a [u8],
        allow: AllowList<'_>,
    ) -> Result<TorchSave<'a>, FormatError> {
        let archive = Archive::open(path, what, bytes)?;
        let pkl = archive.entry(path, what, "data.pkl")?;
        let value = pickle::read(pkl, allow).map_err(|source| FormatError::Pickle {
            path: path.to_owned(),
            item: what.to_owned(),
            source,
        })?;
        if archive.find("byteorder").is_some_and(|o| o != b"little") {
            return Err(bad(path, what, "a big-endian torch.save archive"));
        }
        Ok(TorchSave {
            archive,
            path: path.to_owned(),
            what: what.to_owned(),
            value,
        })
    }

    /// The tensor `_rebuild_tensor_v2(args...)` makes: its data type, shape and bytes in C
    /// order, bounded by its storage in the archive.
    ///
    /// # Errors
    /// [`FormatError::Dcp`] for a storage that is missing or too short, a view outside it, an
    /// unknown storage class.
    pub fn tensor(&self, args: &[Value]) -> Result<RawTensor<'a>, FormatError> {
        match rebuild_tensor(&self.path, &self.what, &self.archive, args)? {
            ItemValue::Tensor { dtype, shape, data } => Ok((dtype, shape, data)),
            ItemValue::Other(_) => Err(bad(&self.path, &self.what, "not a tensor record")),
        }
    }
}

/// `_rebuild_tensor_v2(storage, storage_offset, size, stride, ...)` done by hand, bounded.
fn rebuild_tensor<'a>(
    path: &Path,
    what: &str,
    archive: &Archive<'a>,
    args: &[Value],
) -> Result<ItemValue<'a>, FormatError> {
    let e = |m: &str| bad(path, what, format!("tensor record: {m}"));
    let Some(Value::PersId(pid)) = args.first() else {
        return Err(e("no storage reference"));
    };
    let Value::Tuple(pid) = pid.as_ref() else {
        return Err(e("a storage reference that is not a tuple"));
    };
    let (Some(Value::Str(tag)), Some(Value::Global { name: cls, .. }), Some(Value::Str(key))) =
        (pid.first(), pid.get(1), pid.get(2))
    else {
        return Err(e("a storage reference without (\"storage\", class, key)"));
    };
    if tag != "storage" {
        return Err(e("a persistent id that is not a storage"));
    }
    let dtype = storage_dtype(cls).ok_or_else(|| e(&format!("storage class {cls}")))?;
    let (Some(offset), Some(shape), Some(stride)) = (
        args.get(1).and_then(uint),
        args.get(2).and_then(dims),
        args.get(3).and_then(dims),
    ) else {
        return Err(e("no storage offset, size and stride"));
    };
    if shape.len() != stride.len() {
        return Err(e("size and stride of different lengths"));
    }
    if key.contains('/') || key.contains("..") {
        return Err(e("a storage key that is not a plain name"));
    }
    let storage = archive.entry(path, what, &format!("data/{key}"))?;
    let elem = dtype.size() as u64;
    let overflow = || e("sizes overflow");
    let numel = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(overflow)?;
    let storage_elems = storage.len() as u64 / elem;
    let nbytes =
        usize::try_from(numel.checked_mul(elem).ok_or_else(overflow)?).map_err(|_| overflow())?;
    if numel == 0 {
        return Ok(ItemValue::Tensor {
            dtype,
            shape,
            data: Cow::Borrowed(&[]),
        });
    }
    // The last element the view touches must lie inside the storage.
    let mut last = offset;
    for (&d, &s) in shape.iter().zip(&stride) {
        last = (d - 1)
            .checked_mul(s)
            .and_then(|x| last.checked_add(x))
            .ok_or_else(overflow)?;
    }
    if last >= storage_elems {
        return Err(e(&format!(
            "the view (offset {offset}, size {shape:?}, stride {stride:?}) reaches element {last} of a storage of {storage_elems}"
        )));
    }
    let mut contiguous = true;
    let mut want = 1u64;
    for (&d, &s) in shape.iter().zip(&stride).rev() {
        if d != 1 && s != want {
            contiguous = false;
        }
        want = want.saturating_mul(d);
    }
    let elem_us = dtype.size();
    // Inside the storage (checked above): fits a usize.
    let start = usize::try_from(offset * elem).map_err(|_| overflow())?;
    if contiguous {
        return Ok(ItemValue::Tensor {
            dtype,
            shape,
            data: Cow::Borrowed(&storage[start..start + nbytes]),
        });
    }
    let mut out = Vec::with_capacity(nbytes);
    let mut index = vec![0u64; shape.len()];
    for _ in 0..numel {
        let at = index
            .iter()
            .zip(&stride)
            .fold(offset, |a, (&i, &s)| a + i * s);
        let at = usize::try_from(at).map_err(|_| overflow())? * elem_us;
        out.extend_from_slice(&storage[at..at + elem_us]);
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(ItemValue::Tensor {
        dtype,
        shape,
        data: Cow::Owned(out),
    })
}

fn storage_dtype(cls: &str) -> Option<DType> {
    Some(match cls {
        "FloatStorage" => DType::Float32,
        "DoubleStorage" => DType::Float64,
        "HalfStorage" => DType::Float16,
        "BFloat16Storage" => DType::BFloat16,
        "LongStorage" => DType::Int64,
        "IntStorage" => DType::Int32,
        "ShortStorage" => DType::Int16,
        "CharStorage" => DType::Int8,
        "ByteStorage" => DType::UInt8,
        "BoolStorage" => DType::Bool,
        "Float8_e4m3fnStorage" => DType::Float8E4M3FN,
        "Float8_e5m2Storage" => DType::Float8E5M2,
        _ => return None,
    })
}

/// A `torch.save` archive: stored zip entries, by name without the archive's folder prefix.
struct Archive<'a> {
    entries: BTreeMap<String, &'a [u8]>,
}

impl<'a> Archive<'a> {
    fn open(path: &Path, what: &str, bytes: &'a [u8]) -> Result<Archive<'a>, FormatError> {
        let e = |m: String| bad(path, what, format!("not a torch.save archive: {m}"));
        let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|x| e(x.to_string()))?;
        let mut entries = BTreeMap::new();
        let mut prefix: Option<String> = None;
        for i in 0..zip.len() {
            let f = zip.by_index_raw(i).map_err(|x| e(x.to_string()))?;
            let name = f.name().map_err(|x| e(x.to_string()))?.into_owned();
            if f.compression() != zip::CompressionMethod::Stored {
                return Err(e(format!(
                    "entry {name} is compressed (torch stores entries)"
                )));
            }
            let start = f
                .data_start()
                .ok_or_else(|| e(format!("entry {name} has no data offset")))?;
            let size = f.size();
            let end = start
                .checked_add(size)
                .filter(|&x| x <= bytes.len() as u64)
                .ok_or_else(|| e(format!("entry {name} runs past the end of the item")))?;
            // Both inside `bytes` (checked): fit a usize.
            let data = &bytes[start as usize..end as usize];
            let (p, rest) = name.split_once('/').unwrap_or(("", &name));
            match &prefix {
                None => prefix = Some(p.to_owned()),
                Some(q) if q != p => return Err(e(format!("entries under {q}/ and {p}/"))),
                Some(_) => {}
            }
            entries.insert(rest.to_owned(), data);
        }
        Ok(Archive { entries })
    }

    fn find(&self, name: &str) -> Option<&'a [u8]> {
        self.entries.get(name).copied()
    }

    fn entry(&self, path: &Path, what: &str, name: &str) -> Result<&'a [u8], FormatError> {
        self.find(name)
            .ok_or_else(|| bad(path, what, format!("the torch.save archive has no {name}")))
    }
}

/// The path of an item's file in `dir`.
#[must_use]
pub fn item_file(dir: &Path, s: &DcpStorage) -> PathBuf {
    dir.join(&s.file)
}
