//! Importing a Megatron-LM `torch_dist` checkpoint (an `iter_*` directory: `metadata.json`,
//! `common.pt` and DCP's `.metadata` and `.distcp` files) into a zarrckpt-backed Megatron
//! checkpoint directory, as the Python package's Megatron backend writes it: `metadata.json`
//! naming backend `zarrckpt` and `zarrckpt/` the checkpoint. In this process, without Python
//! and without running any pickle.
//!
//! Tensors keep Megatron's keys and global shapes (layer axes included), in the chunks the
//! source saved or split `ranks` ways along their first axis. A `ShardedObject` (a DCP bytes
//! item: `torch.save` of the list of the values the saving rank held under its unique key,
//! copies of one value) becomes the `common` object named by its unique key, holding the
//! first value; the content of `common.pt` becomes the object `megatron/common`. Both are
//! encoded as the Megatron backend encodes values ([`super::megatron_value`]); a value it
//! cannot read without running the pickle is refused, naming the item, where in the value,
//! and the class. After the save, every tensor box and object is read back and compared.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use super::dcp::{DcpEntry, DcpMetadata, TorchSave};
use super::dcp_import::{
    DcpImportOptions, DcpImportReport, Files, Marks, Tensor, bad, bytes_item, check_options,
    resplit, write,
};
use super::error::FormatError;
use super::megatron_value::{MEGATRON_ALLOW, encode};
use super::pickle::Value;
use crate::{ObjectValue, TensorKey};

/// The folder of a zarrckpt-backed Megatron checkpoint that holds the zarrckpt checkpoint.
pub const MEGATRON_SUBDIR: &str = "zarrckpt";
/// The object holding the common state (`common.pt`).
pub const MEGATRON_COMMON_KEY: &str = "megatron/common";
/// The largest `metadata.json` read, in bytes.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Megatron's `metadata.json` of the result, as megatron-core's `save_config` writes it
/// (`json.dump` of its `CheckpointingConfig`).
const CONFIG: &str = r#"{"sharded_backend": "zarrckpt", "sharded_backend_version": 1, "common_backend": "zarrckpt", "common_backend_version": 1}"#;

/// Imports the Megatron `torch_dist` checkpoint directory `src` into a zarrckpt-backed
/// Megatron checkpoint directory `dst` (created if needed; the checkpoint is `dst/zarrckpt`,
/// replaced only with `opts.overwrite`). `objects` in the report counts the ShardedObjects
/// and the common state.
///
/// # Errors
/// [`FormatError`]: `src` is not a `torch_dist` checkpoint (no or another `metadata.json`),
/// its DCP files do not parse or are inconsistent ([`FormatError::Dcp`],
/// [`FormatError::Pickle`], naming the file and the item), a value that cannot be stored
/// without running its pickle (naming the item, the place in it and its class), a save or
/// read-back failure ([`FormatError::Checkpoint`]), an I/O error.
pub fn import_megatron(
    src: &Path,
    dst: &Path,
    opts: &DcpImportOptions,
) -> Result<DcpImportReport, FormatError> {
    check_options(opts)?;
    check_config(src)?;
    let md = DcpMetadata::read(src)?;
    let files = Files::open(src, &md)?;
    let mut tensors: BTreeMap<String, Tensor<'_>> = BTreeMap::new();
    let mut objects: Vec<(TensorKey, ObjectValue)> = Vec::new();
    for (fqn, entry) in &md.entries {
        let key = TensorKey::new(fqn.as_str()).map_err(|e| bad(src, fqn, e.to_string()))?;
        match entry {
            DcpEntry::Tensor {
                dtype,
                size,
                chunks,
            } => {
                let t = Tensor::stored(src, &md, &files, fqn, key, *dtype, size, chunks.len())?;
                tensors.insert(fqn.clone(), t);
            }
            DcpEntry::Bytes => {
                let (p, bytes) = bytes_item(src, &md, &files, fqn)?;
                let ts = TorchSave::read(&p, fqn, bytes, MEGATRON_ALLOW)?;
                match &ts.value {
                    Value::Object {
                        module, name, args, ..
                    } if module == "torch._utils" && name == "_rebuild_tensor_v2" => {
                        let (dtype, shape, data) = ts.tensor(args)?;
                        tensors.insert(fqn.clone(), Tensor::whole(key, dtype, shape, data));
                    }
                    Value::List(values) if !values.is_empty() => {
                        // Copies of one value: Megatron's loader hands out the first.
                        let v = encode(&ts, &values[0], &p, fqn, fqn)?;
                        objects.push((key, v));
                    }
                    other => {
                        return Err(bad(
                            &p,
                            fqn,
                            format!(
                                "a torch_dist object is a non-empty list, not a {}",
                                other.type_name()
                            ),
                        ));
                    }
                }
            }
        }
    }
    let common = src.join("common.pt");
    if common.exists() {
        let f = File::open(&common).map_err(FormatError::io("open", &common))?;
        // SAFETY: mapped read-only; a writer changing it underneath would be seen by the
        // comparison after the save at worst.
        let m = unsafe { Mmap::map(&f) }.map_err(FormatError::io("map", &common))?;
        let ts = TorchSave::read(&common, "common.pt", &m, MEGATRON_ALLOW)?;
        let v = encode(&ts, &ts.value, &common, "common.pt", "common")?;
        let key = TensorKey::new(MEGATRON_COMMON_KEY)
            .map_err(|e| bad(src, "common.pt", e.to_string()))?;
        objects.push((key, v));
    }
    if let Some(n) = opts.ranks {
        for t in tensors.values_mut() {
            resplit(t, n);
        }
    }
    std::fs::create_dir_all(dst).map_err(FormatError::io("create", dst))?;
    let report = write(
        &dst.join(MEGATRON_SUBDIR),
        &tensors,
        &objects,
        opts,
        Marks::None,
    )?;
    let config = dst.join("metadata.json");
    std::fs::write(&config, CONFIG).map_err(FormatError::io("write", &config))?;
    Ok(report)
}

/// `src/metadata.json` must name the `torch_dist` sharded backend.
fn check_config(src: &Path) -> Result<(), FormatError> {
    let path = src.join("metadata.json");
    let not_megatron = |msg: String| bad(&path, "metadata.json", msg);
    let len = match std::fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(not_megatron(
                "missing: not a Megatron dist_checkpointing directory".into(),
            ));
        }
        Err(e) => return Err(FormatError::io("stat", &path)(e)),
    };
    if len > MAX_CONFIG_BYTES {
        return Err(not_megatron(format!(
            "{len} bytes, more than the limit of {MAX_CONFIG_BYTES}"
        )));
    }
    let text = std::fs::read(&path).map_err(FormatError::io("read", &path))?;
    let doc: serde_json::Value = serde_json::from_slice(&text).map_err(|e| FormatError::Json {
        path: path.clone(),
        msg: e.to_string(),
    })?;
    match doc.get("sharded_backend") {
        Some(serde_json::Value::String(b)) if b == "torch_dist" => Ok(()),
        other => Err(not_megatron(format!(
            "sharded backend {}; only 'torch_dist' checkpoints are imported",
            other.map_or_else(|| "missing".to_owned(), ToString::to_string)
        ))),
    }
}
