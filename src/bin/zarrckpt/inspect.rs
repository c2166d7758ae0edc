//! `zarrckpt inspect`: what a checkpoint holds, without reading tensor data.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::json;
use zarrckpt::StoredScope;
use zarrckpt::{Checkpoint, Encoding, ObjectInfo, ObjectSlot, ObjectValue};

/// Arguments of `zarrckpt inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory.
    ckpt: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Show the HF export plan of a Megatron-layout checkpoint under this conversion table
    /// (built-in name or JSON file): per destination its sources, bytes, checks passed.
    #[arg(long)]
    map: Option<String>,
    /// HF config.json for `--map` (default: the one the checkpoint holds).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The layout the checkpoint was saved at, for `--map` (default: its metadata).
    #[arg(long)]
    megatron: Option<String>,
}

fn dir_bytes(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

fn dims(v: &[u64]) -> String {
    format!(
        "[{}]",
        v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    )
}

/// Formats bytes for people.
pub fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let local = crate::remote::local(&a.ckpt)?;
    let path = local.path();
    if let Some(map) = &a.map {
        return crate::hf::inspect_map(path, map, a.config.as_deref(), a.megatron.as_deref());
    }
    let ckpt = Checkpoint::open(zarrckpt::convert::hf::ckpt_dir(path))?;
    let tensors = ckpt.tensors();
    let total: u64 = tensors.iter().map(|t| t.nbytes).sum();
    let chunks: u64 = tensors.iter().map(|t| t.num_chunks).sum();
    let on_disk = dir_bytes(path);
    let meta = ckpt.meta();
    let objects = ckpt.objects();
    if a.json {
        let objs: Vec<_> = objects.iter().map(object_json).collect();
        let list: Vec<_> = tensors
            .iter()
            .map(|t| {
                json!({
                    "key": t.key.as_str(), "dtype": t.dtype.name(), "shape": t.shape,
                    "chunk_shape": t.chunk_shape, "subchunk_shape": t.subchunk_shape,
                    "compression": t.compression, "chunks": t.num_chunks, "bytes": t.nbytes,
                })
            })
            .collect();
        let doc = json!({
            "path": a.ckpt.display().to_string(), "format": meta.format, "version": meta.version,
            "writer": meta.writer, "world_size": meta.world_size, "user": meta.user,
            "tensors": list, "total_tensors": tensors.len(), "total_bytes": total,
            "total_chunks": chunks, "bytes_on_disk": on_disk, "objects": objs,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: {} {} written by {} ({} ranks)",
        a.ckpt.display(),
        meta.format,
        meta.version,
        meta.writer,
        meta.world_size
    );
    if !meta.user.is_empty() {
        println!(
            "user metadata: {}",
            serde_json::Value::Object(meta.user.clone())
        );
    }
    let kw = tensors
        .iter()
        .map(|t| t.key.as_str().len())
        .max()
        .unwrap_or(3)
        .clamp(3, 70);
    println!(
        "{:<kw$}  {:<13} {:<18} {:<18} {:<18} {:>6} {:>10}",
        "key", "dtype", "shape", "chunk", "subchunk", "chunks", "size"
    );
    for t in &tensors {
        println!(
            "{:<kw$}  {:<13} {:<18} {:<18} {:<18} {:>6} {:>10}",
            t.key.as_str(),
            t.dtype.name(),
            dims(&t.shape),
            dims(&t.chunk_shape),
            dims(&t.subchunk_shape),
            t.num_chunks,
            human(t.nbytes)
        );
    }
    if !objects.is_empty() {
        print_objects(&ckpt, &objects);
    }
    println!(
        "total: {} tensors, {} chunk files, {} of data, {} objects, {} on disk",
        tensors.len(),
        chunks,
        human(total),
        objects.len(),
        human(on_disk)
    );
    Ok(ExitCode::SUCCESS)
}

fn object_json(o: &ObjectInfo) -> serde_json::Value {
    let mut v = json!({
        "key": o.key.as_str(), "scope": o.scope.name(), "encoding": o.encoding.name(),
        "values": o.values,
    });
    if let Some(s) = o.size {
        v["size"] = json!(s);
    }
    if let Some(w) = o.world_size {
        v["world_size"] = json!(w);
    }
    if let Some(g) = &o.grid {
        v["grid"] = json!(g);
    }
    v
}

/// A short preview of a common JSON object's value (read; common values are small).
fn preview(ckpt: &Checkpoint, o: &ObjectInfo) -> String {
    if o.scope != StoredScope::Common || o.encoding != Encoding::Json {
        return String::new();
    }
    match ckpt.read_object(&o.key, &ObjectSlot::Common) {
        Ok(ObjectValue::Json(v)) => {
            let s = v.to_string();
            if s.chars().count() > 60 {
                format!("{}…", s.chars().take(60).collect::<String>())
            } else {
                s
            }
        }
        Ok(ObjectValue::Bytes(_)) => String::new(),
        Err(e) => format!("(unreadable: {e})"),
    }
}

fn print_objects(ckpt: &Checkpoint, objects: &[ObjectInfo]) {
    let kw = objects
        .iter()
        .map(|o| o.key.as_str().len())
        .max()
        .unwrap_or(3)
        .clamp(3, 70);
    println!(
        "{:<kw$}  {:<8} {:<8} {:<18} {:>6}  value",
        "object", "scope", "encoding", "layout", "values"
    );
    for o in objects {
        let layout = match (&o.size, &o.world_size, &o.grid) {
            (Some(s), _, _) => human(*s),
            (_, Some(w), _) => format!("{w} ranks"),
            (_, _, Some(g)) => format!("grid {}", dims(g)),
            _ => String::new(),
        };
        println!(
            "{:<kw$}  {:<8} {:<8} {:<18} {:>6}  {}",
            o.key.as_str(),
            o.scope.name(),
            o.encoding.name(),
            layout,
            o.values,
            preview(ckpt, o)
        );
    }
}
