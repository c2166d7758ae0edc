//! Model conversion (Megatron <-> Hugging Face <-> vLLM, spec § 19) for `zarrckpt.convert`:
//! tables, expressions and expansion, plans, and the exports and imports themselves, all
//! through `zarrckpt::convert`. Values cross as JSON text; the GIL is released while files
//! are read and written. A table that does not load, validate or evaluate raises
//! `TableError`; a refused or failed conversion `ConversionError` (both carry the crate's
//! message: rule, key, numbers, file).

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use zarrckpt::convert::expand::{Layout, evaluate, object_keys};
use zarrckpt::convert::expr::Value;
use zarrckpt::convert::hf::{
    hf_config, inventory, open_checkpoint, parse_layout, parse_size, saved_layout,
};
use zarrckpt::convert::table::{ExprText, builtin_names};
use zarrckpt::convert::{
    self, ConvertError, ExportOptions, FormatError, HfExport, HfImport, Inventory, Table,
    VllmExport, WriteOptions, load_checked,
};

use crate::errors::{message, new_error, to_py};

fn table_error(py: Python<'_>, e: &ConvertError) -> PyErr {
    new_error(py, "TableError", "Convert", e.to_string())
}

fn conversion_error(py: Python<'_>, e: &FormatError) -> PyErr {
    match e {
        FormatError::Checkpoint { source, .. } => to_py(py, source, None),
        other => {
            let kind = format!("{other:?}");
            let kind = kind.split([' ', '(', '{']).next().unwrap_or("Format");
            new_error(py, "ConversionError", kind, message(other))
        }
    }
}

/// JSON text handed in from Python, as `T`.
macro_rules! json {
    ($text:expr, $what:expr) => {
        serde_json::from_str($text).map_err(|e| PyValueError::new_err(format!("{}: {e}", $what)))
    };
}

fn load(py: Python<'_>, table: &str) -> PyResult<Table> {
    load_checked(table).map_err(|e| table_error(py, &e))
}

/// The names of the built-in tables.
#[pyfunction]
pub(crate) fn table_builtins() -> Vec<&'static str> {
    builtin_names()
}

/// The table `table` (built-in name, file path or JSON text), validated, `extends` resolved,
/// as JSON text.
#[pyfunction]
pub(crate) fn table_load(py: Python<'_>, table: &str) -> PyResult<String> {
    Ok(load(py, table)?.to_json())
}

/// Validates one table document (JSON text, before `extends`) against the schema and the
/// name-pattern rule; `source` names it in the error.
#[pyfunction]
pub(crate) fn table_validate(py: Python<'_>, doc: &str, source: &str) -> PyResult<()> {
    let v: serde_json::Value = json!(doc, "table")?;
    convert::validate::validate(&v, source).map_err(|e| table_error(py, &e))
}

fn value_of(v: &serde_json::Value, what: &str) -> PyResult<Value> {
    match v {
        serde_json::Value::Bool(b) => Ok(Value::Bool(*b)),
        serde_json::Value::Number(n) => n
            .as_i64()
            .map(Value::Int)
            .ok_or_else(|| PyValueError::new_err(format!("{what} = {n} is not a 64-bit integer"))),
        other => Err(PyValueError::new_err(format!(
            "{what} = {other} is not an integer or a boolean"
        ))),
    }
}

fn value_json(v: Value) -> serde_json::Value {
    match v {
        Value::Int(i) => i.into(),
        Value::Bool(b) => b.into(),
    }
}

/// The value (JSON text) of one expression (JSON: a string, integer or boolean) for `names`
/// (JSON object of integers and booleans) and `config` (JSON text of config.json).
#[pyfunction]
pub(crate) fn table_evaluate(
    py: Python<'_>,
    expr: &str,
    names: &str,
    config: &str,
) -> PyResult<String> {
    let e: ExprText = json!(expr, "expression")?;
    let named: BTreeMap<String, serde_json::Value> = json!(names, "names")?;
    let names = named
        .iter()
        .map(|(k, v)| Ok((k.clone(), value_of(v, k)?)))
        .collect::<PyResult<BTreeMap<_, _>>>()?;
    let cfg: serde_json::Value = json!(config, "config")?;
    let v = evaluate(&e, &names, &cfg).map_err(|e| table_error(py, &e))?;
    Ok(value_json(v).to_string())
}

/// The expansion of `table` for `config` (JSON text) at `layout` (`tp=T,pp=P,ep=E`), the
/// layout checked to divide the model, as JSON text: `params`, `megatron` and `hf` (`[name, shape]` in order), `sources` (Megatron key
/// -> HF names), `drop`, `objects` (the keys an import writes), `vllm_version`.
#[pyfunction]
pub(crate) fn table_expand(
    py: Python<'_>,
    table: &str,
    config: &str,
    layout: &str,
) -> PyResult<String> {
    let t = load(py, table)?;
    let cfg: serde_json::Value = json!(config, "config")?;
    let lay: Layout = layout.parse().map_err(PyValueError::new_err)?;
    let ex = convert::expand(&t, &cfg, lay)
        .and_then(|ex| convert::check::check_layout(&ex, lay).map(|()| ex))
        .map_err(|e| table_error(py, &e))?;
    let objects = object_keys(&t, &cfg, lay).map_err(|e| table_error(py, &e))?;
    let mut params = serde_json::Map::new();
    for (k, v) in [("tp", lay.tp), ("pp", lay.pp), ("ep", lay.ep)] {
        params.insert(k.into(), v.into());
    }
    for (k, v) in &ex.params {
        let parsed = match v.as_str() {
            "true" => true.into(),
            "false" => false.into(),
            s => s.parse::<i64>().map_or_else(|_| s.into(), Into::into),
        };
        params.insert(k.clone(), parsed);
    }
    let mut sources: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for l in &ex.links {
        let names = sources.entry(ex.m[l.m].key.as_str()).or_default();
        let h = ex.h[l.h].name.as_str();
        if !names.contains(&h) {
            names.push(h);
        }
    }
    let pairs = |v: Vec<(&str, &Vec<u64>)>| -> serde_json::Value {
        v.into_iter()
            .map(|(n, s)| serde_json::json!([n, s]))
            .collect()
    };
    let doc = serde_json::json!({
        "table": ex.table,
        "params": params,
        "megatron": pairs(ex.m.iter().map(|m| (m.key.as_str(), &m.shape)).collect()),
        "hf": pairs(ex.h.iter().map(|h| (h.name.as_str(), &h.shape)).collect()),
        "sources": sources,
        "drop": {"megatron": ex.drop_m, "hf": ex.drop_h},
        "objects": objects,
        "vllm_version": t.vllm.as_ref().and_then(|v| v.version.clone()).unwrap_or_default(),
    });
    Ok(doc.to_string())
}

fn export_options(
    config: Option<PathBuf>,
    copy_from: Option<PathBuf>,
    max_shard_size: Option<&str>,
    layout: Option<&str>,
    procs: Option<usize>,
) -> Result<ExportOptions, FormatError> {
    Ok(ExportOptions {
        config,
        copy_from,
        max_shard_bytes: max_shard_size.map_or(Ok(5_000_000_000), parse_size)?,
        layout: layout.map(parse_layout).transpose()?,
        write: WriteOptions {
            writers: procs.unwrap_or(1),
            pipeline: false,
        },
    })
}

/// A Megatron-layout checkpoint exported: `tp` None, as HF safetensors files and index; else
/// as vLLM `sharded_state` per-rank files for TP `tp` with the model's config (and, from
/// `copy_from`, tokenizer) files. Returns the summary line, or the plan with `dry_run`.
#[pyfunction]
#[pyo3(signature = (ckpt, out, table, tp = None, config = None, copy_from = None, max_shard_size = None, layout = None, procs = None, dry_run = false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn export(
    py: Python<'_>,
    ckpt: PathBuf,
    out: PathBuf,
    table: &str,
    tp: Option<u64>,
    config: Option<PathBuf>,
    copy_from: Option<PathBuf>,
    max_shard_size: Option<&str>,
    layout: Option<&str>,
    procs: Option<usize>,
    dry_run: bool,
) -> PyResult<String> {
    let t = load(py, table)?;
    py.detach(|| {
        let opts = export_options(config, copy_from, max_shard_size, layout, procs)?;
        let Some(tp) = tp else {
            let e = HfExport::plan(&ckpt, &t, opts)?;
            return Ok(if dry_run {
                e.describe()
            } else {
                e.summary(&out, &e.write(&out)?)
            });
        };
        let e = VllmExport::plan(&ckpt, &t, tp, opts)?;
        Ok(if dry_run {
            e.describe()
        } else {
            e.summary(&out, &e.write(&out)?)
        })
    })
    .map_err(|e: FormatError| conversion_error(py, &e))
}

/// HF folder -> Megatron-layout checkpoint directory at `layout`; returns the summary line,
/// or the plan with `dry_run`.
#[pyfunction]
#[pyo3(signature = (hf_dir, out, table, layout, procs = None, overwrite = false, dry_run = false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn import_hf(
    py: Python<'_>,
    hf_dir: PathBuf,
    out: PathBuf,
    table: &str,
    layout: &str,
    procs: Option<usize>,
    overwrite: bool,
    dry_run: bool,
) -> PyResult<String> {
    let t = load(py, table)?;
    py.detach(|| {
        let i = HfImport::plan(&hf_dir, &t, parse_layout(layout)?)?;
        if dry_run {
            return Ok(i.describe());
        }
        let r = i.write(&out, overwrite, procs.unwrap_or(0))?;
        Ok(i.summary(&out, &r))
    })
    .map_err(|e: FormatError| conversion_error(py, &e))
}

/// The HF export plan of a checkpoint, as `zarrckpt inspect --map` prints it.
#[pyfunction]
#[pyo3(signature = (ckpt, table, config = None, layout = None))]
pub(crate) fn inspect_map(
    py: Python<'_>,
    ckpt: PathBuf,
    table: &str,
    config: Option<PathBuf>,
    layout: Option<&str>,
) -> PyResult<String> {
    let t = load(py, table)?;
    py.detach(|| {
        let mut opts = export_options(config, None, None, layout, None)?;
        opts.max_shard_bytes = u64::MAX;
        Ok(HfExport::plan(&ckpt, &t, opts)?.inspect())
    })
    .map_err(|e: FormatError| conversion_error(py, &e))
}

fn compression_of(compression: &str) -> PyResult<zarrckpt::Compression> {
    Ok(match compression {
        "none" => zarrckpt::Compression::None,
        "zstd" => zarrckpt::Compression::Zstd,
        "blosc" => zarrckpt::Compression::Blosc,
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown compression `{other}` (none, zstd, blosc)"
            )));
        }
    })
}

/// Runs the library importer `f` with the bindings' arguments; its report as JSON text.
fn run_import(
    py: Python<'_>,
    (src, dst): (PathBuf, PathBuf),
    ranks: Option<u64>,
    overwrite: bool,
    compression: &str,
    f: fn(
        &std::path::Path,
        &std::path::Path,
        &convert::DcpImportOptions,
    ) -> Result<convert::DcpImportReport, FormatError>,
) -> PyResult<String> {
    let opts = convert::DcpImportOptions {
        ranks,
        overwrite,
        compression: compression_of(compression)?,
    };
    let rep = py
        .detach(|| f(&src, &dst, &opts))
        .map_err(|e| conversion_error(py, &e))?;
    Ok(serde_json::json!({
        "tensors": rep.tensors,
        "objects": rep.objects,
        "tensor_bytes": rep.tensor_bytes,
        "save": {
            "chunks_written": rep.save.chunks_written,
            "data_bytes": rep.save.data_bytes,
            "file_bytes": rep.save.file_bytes,
        },
    })
    .to_string())
}

/// Imports the DCP checkpoint directory `src` into a zarrckpt checkpoint at `dst` with the
/// library's importer (no torch, no pickle run: non-tensor values must be bytes or plain
/// data). `ranks`: split each tensor that many ways along its first axis (default: the
/// source's chunks). `compression`: none, zstd or blosc. Returns JSON text: `tensors`,
/// `objects`, `tensor_bytes`, and `save` (`chunks_written`, `data_bytes`, `file_bytes`).
/// Failures raise `ConversionError` naming the file and the item (or the checkpoint error).
#[pyfunction]
#[pyo3(signature = (src, dst, ranks = None, overwrite = false, compression = "none"))]
pub(crate) fn import_dcp(
    py: Python<'_>,
    src: PathBuf,
    dst: PathBuf,
    ranks: Option<u64>,
    overwrite: bool,
    compression: &str,
) -> PyResult<String> {
    let paths = (src, dst);
    run_import(
        py,
        paths,
        ranks,
        overwrite,
        compression,
        convert::import_dcp,
    )
}

/// Imports the Megatron-LM `torch_dist` checkpoint directory `src` into a zarrckpt-backed
/// Megatron checkpoint directory `dst` (`dst/metadata.json`, `dst/zarrckpt/`) with the
/// library's importer (no torch, no pickle run). Arguments and result as `import_dcp`
/// (`objects`: the ShardedObjects and the common state).
#[pyfunction]
#[pyo3(signature = (src, dst, ranks = None, overwrite = false, compression = "none"))]
pub(crate) fn import_megatron(
    py: Python<'_>,
    src: PathBuf,
    dst: PathBuf,
    ranks: Option<u64>,
    overwrite: bool,
    compression: &str,
) -> PyResult<String> {
    let paths = (src, dst);
    run_import(
        py,
        paths,
        ranks,
        overwrite,
        compression,
        convert::import_megatron,
    )
}

/// Plans a conversion (spec § 19) from metadata alone and returns the plan as JSON text.
///
/// `kind`: `"hf"` (export of a Megatron-layout checkpoint to HF names), `"megatron"` (import of
/// HF tensors into a Megatron layout) or `"vllm"` (per-rank tensors for TP `tp`). `table`: a
/// built-in name, a file path, or the JSON text of a table. `config`: the HF config.json text.
/// `inventory`: JSON `{name: [dtype, shape]}` of the source tensors. `layout`: `tp=T,pp=P,ep=E`
/// (the layout to write for `"megatron"`, the saved one otherwise). Refusals raise
/// `PlanError` (kind `Convert`) naming rule, key and numbers.
#[pyfunction]
#[pyo3(signature = (kind, table, config, inventory, layout, tp = 1, max_shard_bytes = 5_000_000_000))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn convert_plan(
    py: Python<'_>,
    kind: &str,
    table: &str,
    config: &str,
    inventory: &str,
    layout: &str,
    tp: u64,
    max_shard_bytes: u64,
) -> PyResult<String> {
    let plan_err = |e: ConvertError| to_py(py, &zarrckpt::Error::Convert(e), None);
    let t = load_checked(table).map_err(plan_err)?;
    let cfg: serde_json::Value = json!(config, "config")?;
    let inv: Inventory = json!(inventory, "inventory")?;
    let lay: Layout = layout.parse().map_err(PyValueError::new_err)?;
    let plan = py
        .detach(|| match kind {
            "hf" => Ok(convert::plan_hf_export(
                &t,
                &cfg,
                lay,
                &inv,
                max_shard_bytes,
            )),
            "megatron" => Ok(convert::plan_megatron_import(&t, &cfg, lay, &inv)),
            "vllm" => Ok(convert::plan_vllm(&t, &cfg, lay, &inv, tp)),
            other => Err(other.to_owned()),
        })
        .map_err(|k| PyValueError::new_err(format!("kind `{k}`: expected hf, megatron or vllm")))?
        .map_err(plan_err)?;
    let mut j = plan.to_json();
    j["vllm_version"] = t.vllm.as_ref().and_then(|v| v.version.clone()).into();
    Ok(j.to_string())
}

/// A conversion plan over a Megatron-layout checkpoint (HF export or vLLM TP `tp`), kept in
/// Rust: `to_json()` describes it, `fill(start, stop, buffers)` fills a batch of destinations
/// into caller-owned buffers (one `(address, nbytes)` per destination, zeroed by the caller),
/// reading each merged source box once. An engine's own loader iterates `batches()`.
#[pyclass(module = "zarrckpt._native")]
pub(crate) struct ConversionPlan {
    plan: convert::Plan,
    ckpt: zarrckpt::Checkpoint,
    vllm_version: Option<String>,
}

#[pymethods]
impl ConversionPlan {
    /// `kind`: `"hf"` or `"vllm"`; `table`: built-in name, path or JSON text; `checkpoint`:
    /// the checkpoint (a Megatron directory or its `zarrckpt` folder); `config`: config.json
    /// text, or None for the one the checkpoint holds; `layout`: the saved layout, or None for
    /// the checkpoint's own.
    #[new]
    #[pyo3(signature = (kind, table, checkpoint, config = None, layout = None, tp = 1, max_shard_bytes = 5_000_000_000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kind: &str,
        table: &str,
        checkpoint: PathBuf,
        config: Option<&str>,
        layout: Option<&str>,
        tp: u64,
        max_shard_bytes: u64,
    ) -> PyResult<Self> {
        let plan_err = |e: ConvertError| to_py(py, &zarrckpt::Error::Convert(e), None);
        let fmt_err = |e: FormatError| conversion_error(py, &e);
        let t = load_checked(table).map_err(plan_err)?;
        let ckpt = open_checkpoint(&checkpoint).map_err(fmt_err)?;
        let cfg: serde_json::Value = match config {
            Some(c) => json!(c, "config")?,
            None => hf_config(Some(&ckpt), None, None).map_err(fmt_err)?,
        };
        let given = layout.map(parse_layout).transpose().map_err(fmt_err)?;
        let lay = saved_layout(&ckpt, given).map_err(fmt_err)?;
        let inv = inventory(&ckpt);
        let plan = match kind {
            "hf" => convert::plan_hf_export(&t, &cfg, lay, &inv, max_shard_bytes),
            "vllm" => convert::plan_vllm(&t, &cfg, lay, &inv, tp),
            other => {
                return Err(PyValueError::new_err(format!(
                    "kind `{other}`: expected hf or vllm"
                )));
            }
        }
        .map_err(plan_err)?;
        Ok(ConversionPlan {
            plan,
            ckpt,
            vllm_version: t.vllm.as_ref().and_then(|v| v.version.clone()),
        })
    }

    /// The plan as JSON text (see `convert_plan`).
    fn to_json(&self) -> String {
        let mut j = self.plan.to_json();
        j["vllm_version"] = self.vllm_version.clone().into();
        j.to_string()
    }

    /// Batches of destinations `(start, stop)` whose source boxes are read together.
    fn batches(&self) -> Vec<(usize, usize)> {
        self.plan
            .batches()
            .into_iter()
            .map(|b| (b.start, b.end))
            .collect()
    }

    /// Fills destinations `start..stop` into `buffers` (`(address, nbytes)` each, exactly the
    /// destination's bytes); returns `(bytes_read, bytes_needed)`. The GIL is released.
    fn fill(
        &self,
        py: Python<'_>,
        start: usize,
        stop: usize,
        buffers: Vec<(usize, usize)>,
    ) -> PyResult<(u64, u64)> {
        if stop < start || stop > self.plan.dests.len() || buffers.len() != stop - start {
            return Err(PyValueError::new_err(format!(
                "fill({start}, {stop}): {} destinations, {} buffers",
                self.plan.dests.len(),
                buffers.len()
            )));
        }
        let mut raws = Vec::with_capacity(buffers.len());
        for (i, (a, n)) in buffers.iter().enumerate() {
            let want = self.plan.dests[start + i].nbytes();
            if *n as u64 != want {
                return Err(PyValueError::new_err(format!(
                    "buffer {i} ({}) holds {n} bytes, the destination {want}",
                    self.plan.dests[start + i].name
                )));
            }
            raws.push(crate::convert::RawMut::new(*a, *n)?);
        }
        let result = py.detach(|| {
            // SAFETY: the caller owns these buffers for the call and does not touch them meanwhile.
            let mut views: Vec<&mut [u8]> = raws.iter().map(|r| unsafe { r.slice() }).collect();
            convert::fill_from_checkpoint(&self.ckpt, &self.plan, start..stop, &mut views)
        });
        let st = result.map_err(|e| to_py(py, &e, None))?;
        Ok((st.bytes_read, st.bytes_needed))
    }
}

/// Registers the conversion functions and classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(convert_plan, m)?)?;
    m.add_class::<ConversionPlan>()?;
    m.add_function(wrap_pyfunction!(table_builtins, m)?)?;
    m.add_function(wrap_pyfunction!(table_load, m)?)?;
    m.add_function(wrap_pyfunction!(table_validate, m)?)?;
    m.add_function(wrap_pyfunction!(table_evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(table_expand, m)?)?;
    m.add_function(wrap_pyfunction!(export, m)?)?;
    m.add_function(wrap_pyfunction!(import_hf, m)?)?;
    m.add_function(wrap_pyfunction!(import_dcp, m)?)?;
    m.add_function(wrap_pyfunction!(import_megatron, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_map, m)?)?;
    Ok(())
}
