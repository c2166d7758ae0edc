//! The safetensors format: data type names both ways, and the one writer every export uses
//! (whole-checkpoint export, HF shards, vLLM per-rank files).
//!
//! A file is an 8-byte little-endian header length, a JSON header (`__metadata__` first when
//! there is any, then each tensor in file order with `dtype`, `shape` and `data_offsets`,
//! padded with spaces to a multiple of 8 bytes), then the tensors' bytes back to back: the
//! layout the `safetensors` library writes, so a file it wrote comes back byte for byte when
//! the tensors are given in its order ([`canonical_order`]).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use safetensors::Dtype;

use super::error::FormatError;
use crate::model::DType;

/// The safetensors data type of a checkpoint data type (every one has one).
#[must_use]
pub fn to_safetensors(d: DType) -> Dtype {
    match d {
        DType::Bool => Dtype::BOOL,
        DType::UInt8 => Dtype::U8,
        DType::Int8 => Dtype::I8,
        DType::Int16 => Dtype::I16,
        DType::UInt16 => Dtype::U16,
        DType::Float16 => Dtype::F16,
        DType::BFloat16 => Dtype::BF16,
        DType::Int32 => Dtype::I32,
        DType::UInt32 => Dtype::U32,
        DType::Float32 => Dtype::F32,
        DType::Float64 => Dtype::F64,
        DType::Int64 => Dtype::I64,
        DType::UInt64 => Dtype::U64,
        // safetensors' F8_E4M3 is the finite-only e4m3fn of PyTorch and OCP.
        DType::Float8E4M3FN => Dtype::F8_E4M3,
        DType::Float8E5M2 => Dtype::F8_E5M2,
    }
}

/// The checkpoint data type of a safetensors data type, if zarrckpt has it.
#[must_use]
pub fn from_safetensors(d: Dtype) -> Option<DType> {
    DType::ALL.into_iter().find(|&x| to_safetensors(x) == d)
}

/// The name a safetensors header gives a data type (`BF16`, `F8_E4M3`, ...).
#[must_use]
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::Bool => "BOOL",
        DType::UInt8 => "U8",
        DType::Int8 => "I8",
        DType::Int16 => "I16",
        DType::UInt16 => "U16",
        DType::Float16 => "F16",
        DType::BFloat16 => "BF16",
        DType::Int32 => "I32",
        DType::UInt32 => "U32",
        DType::Float32 => "F32",
        DType::Float64 => "F64",
        DType::Int64 => "I64",
        DType::UInt64 => "U64",
        DType::Float8E4M3FN => "F8_E4M3",
        DType::Float8E5M2 => "F8_E5M2",
    }
}

/// One tensor of a file to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Name.
    pub name: String,
    /// Data type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
}

/// Sorts entries as the `safetensors` library lays a file out: larger data types first, then
/// by name.
pub fn canonical_order(entries: &mut [Entry]) {
    entries.sort_by(|a, b| {
        to_safetensors(b.dtype)
            .cmp(&to_safetensors(a.dtype))
            .then_with(|| a.name.cmp(&b.name))
    });
}

/// The header of a file holding `entries` in this order, and each tensor's byte count.
///
/// # Errors
/// [`FormatError::Header`] for a repeated or reserved name or a size beyond 64 bits.
pub fn header(
    path: &Path,
    entries: &[Entry],
    metadata: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<(Vec<u8>, Vec<u64>), FormatError> {
    let bad = |tensor: &str, msg: String| FormatError::Header {
        path: path.to_owned(),
        tensor: tensor.to_owned(),
        msg,
    };
    // serde_json keeps insertion order here (its `preserve_order` feature, which zarrs
    // enables): `__metadata__`, then the tensors in file order.
    let mut h = serde_json::Map::new();
    if let Some(m) = metadata {
        if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_string()) {
            return Err(bad(
                "__metadata__",
                format!("metadata value `{k}` is not a string"),
            ));
        }
        h.insert("__metadata__".into(), m.clone().into());
    }
    let mut sizes = Vec::with_capacity(entries.len());
    let mut off = 0u64;
    for e in entries {
        if e.name == "__metadata__" {
            return Err(bad(&e.name, "the name is reserved for the metadata".into()));
        }
        let n = e
            .shape
            .iter()
            .try_fold(e.dtype.size() as u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(&e.name, format!("shape {:?} overflows 64 bits", e.shape)))?;
        let end = off
            .checked_add(n)
            .ok_or_else(|| bad(&e.name, "the file would exceed 2^64 bytes".into()))?;
        let info = serde_json::json!({
            "dtype": dtype_name(e.dtype),
            "shape": e.shape,
            "data_offsets": [off, end],
        });
        if h.insert(e.name.clone(), info).is_some() {
            return Err(bad(&e.name, "the name appears twice in one file".into()));
        }
        sizes.push(n);
        off = end;
    }
    let mut bytes = serde_json::to_vec(&h).map_err(|e| bad("", e.to_string()))?;
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    Ok((bytes, sizes))
}

/// The writer hands each tensor's bytes to the disk every this many bytes, so the closing
/// fsync waits for the last stretch only.
const WRITEBACK_EVERY: u64 = 32 << 20;

/// Writes one safetensors file at `path` (through `path.safetensors.partial`, fsynced, then
/// renamed): tensor after tensor in `entries`' order, each produced by `fill(i, sink)`, which
/// must hand `sink` exactly the tensor's bytes. Returns the data bytes written. On an error
/// the partial file is removed and `path` is left as it was.
///
/// # Errors
/// [`FormatError::Header`] for a bad entry or a tensor whose bytes differ in length from its
/// header; `fill`'s errors; [`FormatError::Io`].
pub fn write_file(
    path: &Path,
    entries: &[Entry],
    metadata: Option<&serde_json::Map<String, serde_json::Value>>,
    fill: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> Result<(), FormatError>,
) -> Result<u64, FormatError> {
    let tmp = path.with_extension("safetensors.partial");
    let r = write_at(path, &tmp, entries, metadata, fill);
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

fn write_at(
    path: &Path,
    tmp: &Path,
    entries: &[Entry],
    metadata: Option<&serde_json::Map<String, serde_json::Value>>,
    mut fill: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> Result<(), FormatError>,
) -> Result<u64, FormatError> {
    let (h, sizes) = header(path, entries, metadata)?;
    let io = |op| FormatError::io(op, tmp);
    let f = File::create(tmp).map_err(io("create"))?;
    let mut w = BufWriter::with_capacity(8 << 20, f);
    w.write_all(&(h.len() as u64).to_le_bytes())
        .map_err(io("write"))?;
    w.write_all(&h).map_err(io("write"))?;
    let mut pending = 0u64;
    let mut total = 0u64;
    for (i, (e, &n)) in entries.iter().zip(&sizes).enumerate() {
        let mut got = 0u64;
        let mut sink = |b: &[u8]| {
            got += b.len() as u64;
            if got > n {
                return Err(std::io::Error::other("more bytes than the header says"));
            }
            w.write_all(b)
        };
        let filled = fill(i, &mut sink);
        if got > n {
            return Err(FormatError::Header {
                path: path.to_owned(),
                tensor: e.name.clone(),
                msg: format!("more than the {n} bytes the header says were given"),
            });
        }
        filled?;
        if got != n {
            return Err(FormatError::Header {
                path: path.to_owned(),
                tensor: e.name.clone(),
                msg: format!("{got} bytes given, the header says {n}"),
            });
        }
        total += n;
        pending += n;
        if pending >= WRITEBACK_EVERY {
            w.flush().map_err(io("write"))?;
            crate::storage::shard::start_writeback(w.get_ref());
            pending = 0;
        }
    }
    w.flush().map_err(io("write"))?;
    let f = w.into_inner().map_err(|e| io("write")(e.into_error()))?;
    f.sync_all().map_err(io("fsync"))?;
    std::fs::rename(tmp, path).map_err(FormatError::io("rename to", path))?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_the_safetensors_library() {
        for d in DType::ALL {
            let st = to_safetensors(d);
            assert_eq!(from_safetensors(st), Some(d));
            // The name is the one the library's own serialisation writes.
            assert_eq!(
                serde_json::to_value(st).unwrap(),
                serde_json::Value::from(dtype_name(d))
            );
        }
        assert_eq!(from_safetensors(Dtype::F8_E8M0), None);
    }

    #[test]
    fn the_header_is_checked() {
        let p = Path::new("x.safetensors");
        let e = |n: &str, s: Vec<u64>| Entry {
            name: n.into(),
            dtype: DType::Float32,
            shape: s,
        };
        let (h, sizes) = header(p, &[e("a", vec![2, 3]), e("b", vec![])], None).unwrap();
        assert_eq!(sizes, vec![24, 4]);
        assert_eq!(h.len() % 8, 0);
        let text = String::from_utf8(h).unwrap();
        assert!(
            text.starts_with(r#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":"#)
        );
        let twice = header(p, &[e("a", vec![1]), e("a", vec![1])], None).unwrap_err();
        assert!(twice.to_string().contains("twice"), "{twice}");
        let reserved = header(p, &[e("__metadata__", vec![1])], None).unwrap_err();
        assert!(reserved.to_string().contains("reserved"), "{reserved}");
        let huge = header(p, &[e("h", vec![u64::MAX, 2])], None).unwrap_err();
        assert!(huge.to_string().contains("overflows"), "{huge}");
    }

    #[test]
    fn a_short_fill_is_refused_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        let entries = [Entry {
            name: "w".into(),
            dtype: DType::Int32,
            shape: vec![4],
        }];
        let err = write_file(&p, &entries, None, |_, sink| {
            sink(&[0u8; 12]).map_err(FormatError::io("write", Path::new("w")))
        })
        .unwrap_err();
        assert!(err.to_string().contains("12 bytes given"), "{err}");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
        // The same file written whole reads back with the library.
        let n = write_file(&p, &entries, None, |_, sink| {
            sink(&[7u8; 16]).map_err(FormatError::io("write", Path::new("w")))
        })
        .unwrap();
        assert_eq!(n, 16);
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("w").unwrap().data(), &[7u8; 16]);
    }
}
