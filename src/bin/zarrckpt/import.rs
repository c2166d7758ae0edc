//! `zarrckpt import`: safetensors files to a checkpoint, written as N in-process ranks.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use memmap2::Mmap;
use safetensors::SafeTensors;
use zarrckpt::comm::run_local;
use zarrckpt::convert::safetensors::from_safetensors;
use zarrckpt::{Communicator, DType, Region, SaveOptions, ShardedTensor, TensorKey, save};

use crate::progress;

/// Arguments of `zarrckpt import`.
#[derive(clap::Args)]
pub struct Args {
    /// safetensors files (a multi-file model: all its shards).
    #[arg(required_unless_present_any = ["dcp", "hf", "megatron"], conflicts_with_all = ["dcp", "hf"])]
    files: Vec<PathBuf>,
    /// A PyTorch DCP checkpoint directory (`FileSystemWriter`'s format): imported by the
    /// library's DCP reader, whose pickle reader runs nothing (non-tensor values must be
    /// bytes or plain data). Prints one JSON line: tensors, objects, tensor_bytes, seconds, out.
    #[arg(long, value_name = "DIR", conflicts_with = "hf")]
    dcp: Option<PathBuf>,
    /// Alone, `--megatron DIR` (or bare, with `--dcp DIR`): DIR is a Megatron-LM `torch_dist`
    /// checkpoint (an `iter_*` directory with `metadata.json`, `common.pt` and DCP files),
    /// imported by the library (no pickle run: objects and `common.pt` may hold tensors, numpy
    /// arrays, plain data, argparse / SimpleNamespace, BytesIO); `--out` becomes a
    /// zarrckpt-backed Megatron checkpoint (`OUT/metadata.json`, `OUT/zarrckpt/`). With `--hf`:
    /// the Megatron layout to write, `tp=T,pp=P[,ep=E]`.
    #[arg(long, num_args = 0..=1, default_missing_value = "", value_name = "LAYOUT")]
    megatron: Option<String>,
    /// Refused, with the command that does it: executing the source's pickles with torch's
    /// unrestricted unpickler (for values the restricted reader refuses, e.g. enum members)
    /// is only in the Python package (`python -m zarrckpt.migrate DIR --out OUT
    /// --trust-pickles`); this tool runs no pickle.
    #[arg(long)]
    trust_pickles: bool,
    /// Import a Hugging Face model directory (config.json and safetensors) into a Megatron
    /// layout (`--megatron tp=T,pp=P`) through a conversion table (`--map`).
    #[arg(long, requires_all = ["map", "megatron"])]
    hf: Option<PathBuf>,
    /// Conversion table: a built-in name or a JSON file.
    #[arg(long)]
    map: Option<String>,
    /// Writer threads (0: one per CPU, at most 8).
    #[arg(long, default_value_t = 0)]
    procs: usize,
    /// Print the plan and write nothing.
    #[arg(long)]
    dry_run: bool,
    /// The checkpoint directory to write.
    #[arg(long)]
    out: PathBuf,
    /// Number of in-process ranks; each tensor is split this many ways along its first axis
    /// (default 1; with `--dcp`, default: the chunks the source saved).
    #[arg(long)]
    ranks: Option<u64>,
    /// Replace an existing checkpoint at `--out`.
    #[arg(long)]
    overwrite: bool,
    /// Compress chunks: none, zstd or blosc.
    #[arg(long, default_value = "none")]
    compression: String,
}

/// Parses a compression name.
pub fn parse_compression(s: &str) -> anyhow::Result<zarrckpt::Compression> {
    Ok(match s {
        "none" => zarrckpt::Compression::None,
        "zstd" => zarrckpt::Compression::Zstd,
        "blosc" => zarrckpt::Compression::Blosc,
        other => bail!("unknown compression `{other}` (none, zstd, blosc)"),
    })
}

struct Source {
    key: TensorKey,
    dtype: DType,
    shape: Vec<u64>,
    file: usize,
    name: String,
}

/// Rank `r`'s box of a tensor split `n` ways along axis 0, torch.chunk style.
fn split_first_axis(shape: &[u64], r: u64, n: u64) -> Region {
    let mut region = Region::full(shape);
    if let Some(&dim) = shape.first() {
        let size = dim.div_ceil(n);
        let o = (r * size).min(dim);
        // Axis 0 exists and o + size.min(dim - o) <= dim: cannot fail.
        region = region
            .with_axis(0, o, size.min(dim - o))
            .expect("a box inside the tensor");
    }
    region
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &a.dcp {
        return import_dcp(a, dir, a.megatron.is_some());
    }
    if a.hf.is_none()
        && let Some(dir) = a.megatron.as_deref().filter(|d| !d.is_empty())
    {
        return import_dcp(a, std::path::Path::new(dir), true);
    }
    if a.trust_pickles {
        bail!("--trust-pickles applies to DCP / Megatron imports (--dcp DIR, --megatron DIR) only");
    }
    if let Some(hf) = &a.hf {
        return crate::hf::import_hf(
            hf,
            a.map.as_deref().unwrap_or_default(),
            a.megatron.as_deref().unwrap_or_default(),
            &a.out,
            a.overwrite,
            a.procs,
            a.dry_run,
        );
    }
    let ranks = a.ranks.unwrap_or(1);
    if ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    let compression = parse_compression(&a.compression)?;
    let maps: Vec<Mmap> = a
        .files
        .iter()
        .map(|p| {
            let f = File::open(p).with_context(|| format!("open {}", p.display()))?;
            // SAFETY: the file is opened read-only; we do not guard against concurrent writers,
            // as every safetensors reader.
            unsafe { Mmap::map(&f) }.with_context(|| format!("map {}", p.display()))
        })
        .collect::<anyhow::Result<_>>()?;
    let parsed: Vec<SafeTensors> = maps
        .iter()
        .zip(&a.files)
        .map(|(m, p)| SafeTensors::deserialize(m).with_context(|| format!("parse {}", p.display())))
        .collect::<anyhow::Result<_>>()?;
    let mut sources: BTreeMap<String, Source> = BTreeMap::new();
    let mut st_meta = serde_json::Map::new();
    for (fi, (st, path)) in parsed.iter().zip(&a.files).enumerate() {
        let (_, header) = SafeTensors::read_metadata(&maps[fi])
            .with_context(|| format!("parse {}", path.display()))?;
        if let Some(m) = header.metadata() {
            for (k, v) in m {
                st_meta.insert(k.clone(), v.clone().into());
            }
        }
        for (name, view) in st.tensors() {
            let dtype = from_safetensors(view.dtype()).with_context(|| {
                format!(
                    "{}: tensor `{name}` has unsupported dtype {:?}",
                    path.display(),
                    view.dtype()
                )
            })?;
            let key = TensorKey::new(name.clone())
                .with_context(|| format!("{}: tensor name `{name}`", path.display()))?;
            let shape = view.shape().iter().map(|&d| d as u64).collect();
            let prev = sources.insert(
                name.clone(),
                Source {
                    key,
                    dtype,
                    shape,
                    file: fi,
                    name: name.clone(),
                },
            );
            if let Some(prev) = prev {
                bail!(
                    "tensor `{name}` appears in both {} and {}",
                    a.files[prev.file].display(),
                    path.display()
                );
            }
        }
    }
    let total: u64 = sources
        .values()
        .map(|s| s.shape.iter().product::<u64>() * s.dtype.size() as u64)
        .sum();
    let pb = progress::bytes(total, "import");
    let mut opts = SaveOptions {
        overwrite: a.overwrite,
        compression,
        progress: Some(progress::callback(&pb)),
        ..Default::default()
    };
    opts.user_metadata
        .insert("source".into(), "safetensors".into());
    opts.user_metadata.insert(
        "files".into(),
        a.files
            .iter()
            .map(|p| {
                p.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
            .collect(),
    );
    if !st_meta.is_empty() {
        opts.user_metadata
            .insert("safetensors_metadata".into(), st_meta.into());
    }
    let t0 = Instant::now();
    let n = ranks;
    let reports = run_local(n as usize, Duration::from_secs(300), |comm| {
        let r = comm.rank() as u64;
        let mut pieces = Vec::with_capacity(sources.len());
        for s in sources.values() {
            let view = parsed[s.file].tensor(&s.name).expect("listed tensor");
            // 0-d tensors: rank 0 holds the main replica, the others hold copies.
            let region = split_first_axis(&s.shape, r, n);
            let replica = u32::from(s.shape.is_empty() && r != 0);
            let elem = s.dtype.size();
            let row: usize = s.shape.iter().skip(1).product::<u64>() as usize * elem;
            let (start, len) = if s.shape.is_empty() {
                (0, elem)
            } else {
                (
                    region.offset()[0] as usize * row,
                    region.shape()[0] as usize * row,
                )
            };
            let data = &view.data()[start..start + len];
            pieces.push(ShardedTensor::new(
                s.key.clone(),
                s.dtype,
                s.shape.clone(),
                region,
                replica,
                data,
            )?);
        }
        save(&pieces, &a.out, &comm, &opts)
    });
    pb.finish_and_clear();
    let mut file_bytes = 0;
    for r in reports {
        file_bytes += r?.file_bytes;
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "imported {} tensors ({:.3} GB) from {} file(s) into {} with {n} ranks in {secs:.2} s ({:.2} GB/s); {:.3} GB on disk",
        sources.len(),
        total as f64 / 1e9,
        a.files.len(),
        a.out.display(),
        total as f64 / 1e9 / secs.max(1e-9),
        file_bytes as f64 / 1e9
    );
    Ok(ExitCode::SUCCESS)
}

/// `import --dcp DIR [--megatron]` / `import --megatron DIR`: the library's DCP and Megatron
/// `torch_dist` importers (no pickle run). `--trust-pickles` asks for torch's unrestricted
/// unpickler, which only the Python package has: refused, naming its command.
fn import_dcp(a: &Args, dir: &std::path::Path, megatron: bool) -> anyhow::Result<ExitCode> {
    if a.trust_pickles {
        bail!(
            "import --trust-pickles: this tool reads pickles with a restricted reader that runs \
             nothing (tensors, numpy arrays, plain data, argparse / SimpleNamespace, BytesIO); \
             executing a checkpoint's pickles (torch.load(weights_only=False), for values such \
             as enum members or your own classes) is done only by the Python package, with \
             torch, and only on checkpoints you trust:\n  python -m zarrckpt.migrate {} --out \
             {}{} --trust-pickles",
            dir.display(),
            a.out.display(),
            if megatron { " --megatron" } else { "" },
        );
    }
    if a.hf.is_some() || a.dry_run || !a.files.is_empty() || a.procs != 0 || a.map.is_some() {
        bail!("import --dcp / --megatron DIR takes no --hf, --map, --procs, --dry-run or files");
    }
    let opts = zarrckpt::convert::DcpImportOptions {
        ranks: a.ranks,
        overwrite: a.overwrite,
        compression: parse_compression(&a.compression)?,
    };
    let t0 = Instant::now();
    let rep = if megatron {
        zarrckpt::convert::import_megatron(dir, &a.out, &opts)?
    } else {
        zarrckpt::convert::import_dcp(dir, &a.out, &opts)?
    };
    let line = serde_json::json!({
        "tensors": rep.tensors,
        "objects": rep.objects,
        "tensor_bytes": rep.tensor_bytes,
        "seconds": (t0.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
        "out": a.out.display().to_string(),
    });
    println!("{line}");
    Ok(ExitCode::SUCCESS)
}
