//! Conversion front door: `export --hf`, `export --vllm`, `import --hf`, `inspect --map`
//! (spec § 19). Planning and filling live in `zarrckpt::convert`; this module reads HF
//! safetensors (mapped), writes sharded safetensors and the index, and saves Megatron
//! layouts through `zarrckpt::save_with_objects`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use memmap2::Mmap;
use safetensors::SafeTensors;
use zarrckpt::convert::{self, Inventory, Layout, Plan, Table};
use zarrckpt::{Checkpoint, LocalComm, SaveOptions, ShardedTensor, StateObject, TensorKey};

use crate::import::{dtype_of, safetensors_dtype};

/// Where the zarrckpt checkpoint of a Megatron checkpoint directory is: `DIR/zarrckpt` when
/// it is a `zarrckpt.megatron` directory, else `DIR` itself.
pub fn ckpt_dir(dir: &Path) -> PathBuf {
    let sub = dir.join("zarrckpt");
    if sub.join("zarr.json").exists() {
        sub
    } else {
        dir.to_owned()
    }
}

/// A size like `5GB`, `500MB`, `1GiB`, `123`.
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n.parse().with_context(|| format!("size `{s}`"))?;
    let m: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        u => bail!("size `{s}`: unknown unit `{u}` (B, KB, MB, GB, KiB, MiB, GiB)"),
    };
    Ok(n * m)
}

fn read_json(p: &Path) -> anyhow::Result<serde_json::Value> {
    let t = std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
    serde_json::from_str(&t).with_context(|| format!("parse {}", p.display()))
}

/// The tensors of a checkpoint as an inventory.
pub fn ckpt_inventory(ck: &Checkpoint) -> Inventory {
    ck.tensors()
        .into_iter()
        .map(|t| (t.key.to_string(), (t.dtype.to_string(), t.shape)))
        .collect()
}

/// The layout a checkpoint was saved at (its `megatron` metadata), or `given`.
fn saved_layout(ck: &Checkpoint, given: Option<&str>) -> anyhow::Result<Layout> {
    if let Some(g) = given {
        return g.parse::<Layout>().map_err(anyhow::Error::msg);
    }
    let m = ck.meta().user.get("megatron");
    let get = |k: &str| {
        m.and_then(|m| m.get(k))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(1)
    };
    Ok(Layout {
        tp: get("tp"),
        pp: get("pp"),
        ep: get("ep"),
    })
}

/// The HF config: `--config`, else `COPY_FROM/config.json`, else the checkpoint's
/// `hf_config` metadata (written by `import --hf`).
fn hf_config(
    ck: Option<&Checkpoint>,
    config: Option<&Path>,
    copy_from: Option<&Path>,
) -> anyhow::Result<serde_json::Value> {
    if let Some(c) = config {
        return read_json(c);
    }
    if let Some(d) = copy_from {
        let c = d.join("config.json");
        if c.exists() {
            return read_json(&c);
        }
    }
    if let Some(v) = ck.and_then(|c| c.meta().user.get("hf_config")) {
        return Ok(v.clone());
    }
    bail!(
        "no config.json: pass --config FILE or --copy-from HFDIR (a checkpoint written by `import --hf` holds its own)"
    )
}

/// Prints a plan (dry run, inspect).
pub fn print_plan(plan: &Plan, what: &str, group_name: &str) {
    println!("plan: {what}");
    println!("params:");
    for (k, v) in &plan.params {
        println!("  {k} = {v}");
    }
    println!("destinations ({}):", plan.dests.len());
    for d in &plan.dests {
        let srcs: Vec<String> = d
            .pieces
            .iter()
            .map(|p| {
                format!(
                    "{}{}{}",
                    plan.sources[p.src].name,
                    p.sbox,
                    if p.transpose { "^T" } else { "" }
                )
            })
            .collect();
        let shown = if srcs.len() > 6 {
            format!("{} ... ({} pieces)", srcs[..6].join(" + "), srcs.len())
        } else {
            srcs.join(" + ")
        };
        println!(
            "  [{group_name} {}] {} {}{:?} {} <- {}",
            d.group,
            d.name,
            d.dtype,
            d.shape,
            if d.region.volume() == d.shape.iter().product::<u64>() {
                String::new()
            } else {
                format!("box {}", d.region)
            },
            if shown.is_empty() {
                "zeros".into()
            } else {
                shown
            }
        );
    }
    println!("bytes per {group_name}:");
    for (g, (r, w)) in plan.bytes_per_group() {
        println!("  {group_name} {g}: reads {r} bytes, writes {w} bytes");
    }
    println!("checks passed:");
    for c in &plan.checks {
        println!("  ok: {c}");
    }
}

/// Writes one safetensors file, tensor after tensor in `order`, each produced by `fill`.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, safetensors::Dtype, Vec<u64>, u64)],
    mut fill: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> anyhow::Result<()>,
) -> anyhow::Result<u64> {
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    header.insert("__metadata__".into(), meta.into());
    let mut off = 0u64;
    for (name, dt, shape, n) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": format!("{dt:?}"), "shape": shape, "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    let mut h = serde_json::to_vec(&header)?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let tmp = path.with_extension("safetensors.partial");
    let f = File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
    let mut w = BufWriter::with_capacity(8 << 20, f);
    w.write_all(&(h.len() as u64).to_le_bytes())?;
    w.write_all(&h)?;
    // The disk starts writing each stretch of the file while the next tensors are read, so
    // the fsync below waits for the last stretch only.
    const WRITEBACK_EVERY: u64 = 32 << 20;
    let mut pending = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let mut sink = |b: &[u8]| w.write_all(b);
        fill(i, &mut sink)?;
        pending += t.3;
        if pending >= WRITEBACK_EVERY {
            w.flush()?;
            zarrckpt::storage::shard::start_writeback(w.get_ref());
            pending = 0;
        }
    }
    w.flush()?;
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(off)
}

/// Writes the files of `plan` whose group index satisfies `mine`, reading from `ck`.
/// Returns (bytes read, bytes written, peak batch memory).
pub fn write_files(
    ck: &Checkpoint,
    plan: &Plan,
    names: &dyn Fn(usize) -> String,
    out: &Path,
    mine: &dyn Fn(usize) -> bool,
) -> anyhow::Result<(u64, u64, u64)> {
    // Measured on 2 shared cores, reading the next batch in a second thread while writing
    // was slower than not (bench-convert), so it is opt-in.
    let pipeline = std::env::var("ZARRCKPT_CONVERT_PIPELINE").is_ok_and(|v| v == "1");
    write_files_with(ck, plan, names, out, mine, pipeline)
}

type Filled = anyhow::Result<(std::ops::Range<usize>, Vec<Vec<u8>>, convert::FillStats)>;

fn fill_batch(ck: &Checkpoint, plan: &Plan, b: std::ops::Range<usize>) -> Filled {
    let mut bufs: Vec<Vec<u8>> = b
        .clone()
        .map(|i| vec![0u8; plan.dests[i].nbytes() as usize])
        .collect();
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let st = convert::fill_from_checkpoint(ck, plan, b.clone(), &mut views)?;
    Ok((b, bufs, st))
}

/// [`write_files`], with the reading of the next batch overlapping the writing of the current
/// one (`pipeline`: a reader thread and a rendezvous channel, at most two batches in memory)
/// or not.
pub fn write_files_with(
    ck: &Checkpoint,
    plan: &Plan,
    names: &dyn Fn(usize) -> String,
    out: &Path,
    mine: &dyn Fn(usize) -> bool,
    pipeline: bool,
) -> anyhow::Result<(u64, u64, u64)> {
    let batches = plan.batches();
    let groups: Vec<usize> = {
        let mut g: Vec<usize> = plan.dests.iter().map(|d| d.group).collect();
        g.dedup();
        g.retain(|g| mine(*g));
        g
    };
    let order: Vec<std::ops::Range<usize>> = groups
        .iter()
        .flat_map(|g| {
            batches
                .iter()
                .filter(move |b| plan.dests[b.start].group == *g)
                .cloned()
        })
        .collect();
    if !pipeline {
        let mut it = order.into_iter();
        let mut next = || match it.next() {
            Some(b) => fill_batch(ck, plan, b),
            None => anyhow::bail!("no batch left"),
        };
        return consume(plan, names, out, &groups, &mut next, false);
    }
    std::thread::scope(|sc| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Filled>(0);
        sc.spawn(move || {
            for b in order {
                let r = fill_batch(ck, plan, b);
                let failed = r.is_err();
                if tx.send(r).is_err() || failed {
                    break;
                }
            }
        });
        let mut next = || rx.recv().context("the reader thread stopped")?;
        consume(plan, names, out, &groups, &mut next, true)
    })
}

/// Writes the files of `groups`, taking filled batches in order from `next`.
fn consume(
    plan: &Plan,
    names: &dyn Fn(usize) -> String,
    out: &Path,
    groups: &[usize],
    next: &mut dyn FnMut() -> Filled,
    pipeline: bool,
) -> anyhow::Result<(u64, u64, u64)> {
    let mut read = 0;
    let mut written = 0;
    let mut peak = 0u64;
    let mut prev_held = 0u64;
    for &g in groups {
        let idx: Vec<usize> = (0..plan.dests.len())
            .filter(|&i| plan.dests[i].group == g)
            .collect();
        let tensors: Vec<(String, safetensors::Dtype, Vec<u64>, u64)> = idx
            .iter()
            .map(|&i| {
                let d = &plan.dests[i];
                (
                    d.name.clone(),
                    safetensors_dtype(d.dtype),
                    d.shape.clone(),
                    d.nbytes(),
                )
            })
            .collect();
        let mut bufs: Vec<Vec<u8>> = Vec::new();
        let mut cur: Option<std::ops::Range<usize>> = None;
        let path = out.join(names(g));
        written += write_safetensors(&path, &tensors, |k, sink| {
            let di = idx[k];
            if cur.as_ref().is_none_or(|c| !c.contains(&di)) {
                let (b, filled, st) = next()?;
                read += st.bytes_read;
                let held: u64 =
                    st.bytes_needed + filled.iter().map(|b| b.len() as u64).sum::<u64>();
                // With the pipeline, this batch and the one the reader fills meanwhile.
                peak = peak.max(held + if pipeline { prev_held } else { 0 });
                prev_held = held;
                bufs = filled;
                cur = Some(b);
            }
            let c = cur.as_ref().expect("current batch");
            let buf = std::mem::take(&mut bufs[di - c.start]);
            sink(&buf)?;
            Ok(())
        })?;
    }
    Ok((read, written, peak))
}

/// `export --hf`.
#[allow(clippy::too_many_arguments)]
pub fn export_hf(
    ckpt: &Path,
    map: &str,
    out: &Path,
    config: Option<&Path>,
    copy_from: Option<&Path>,
    max_shard: &str,
    megatron: Option<&str>,
    procs: usize,
    part: Option<&str>,
    dry_run: bool,
) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let ck = Checkpoint::open(ckpt_dir(ckpt))?;
    let table = Table::load(map)?;
    let cfg = hf_config(Some(&ck), config, copy_from)?;
    let saved = saved_layout(&ck, megatron)?;
    let plan = convert::plan_hf_export(
        &table,
        &cfg,
        saved,
        &ckpt_inventory(&ck),
        parse_size(max_shard)?,
    )?;
    let nfiles = plan.dests.last().map_or(0, |d| d.group + 1);
    let name = |g: usize| {
        if nfiles == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", g + 1, nfiles)
        }
    };
    if dry_run {
        print_plan(
            &plan,
            &format!(
                "export {} -> HF ({} files) with table `{}`",
                ckpt.display(),
                nfiles,
                table.name
            ),
            "file",
        );
        return Ok(ExitCode::SUCCESS);
    }
    let planned = t0.elapsed().as_secs_f64();
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    // A child process of `--procs`: its files only.
    if let Some(p) = part {
        let (i, n) = p
            .split_once('/')
            .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?)))
            .context("--part I/N")?;
        write_files(&ck, &plan, &name, out, &|g| g % n == i)?;
        return Ok(ExitCode::SUCCESS);
    }
    let (read, written) = if procs > 1 {
        let exe = std::env::current_exe()?;
        let args: Vec<String> = std::env::args().skip(1).collect();
        let children: Vec<std::process::Child> = (0..procs)
            .map(|i| {
                std::process::Command::new(&exe)
                    .args(&args)
                    .arg("--part")
                    .arg(format!("{i}/{procs}"))
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .context("spawn a writer process")
            })
            .collect::<anyhow::Result<_>>()?;
        for (i, mut c) in children.into_iter().enumerate() {
            let st = c.wait()?;
            if !st.success() {
                bail!("writer process {i} of {procs} failed ({st})");
            }
        }
        (0, plan.dests.iter().map(|d| d.nbytes()).sum())
    } else {
        let (r, w, _) = write_files(&ck, &plan, &name, out, &|_| true)?;
        (r, w)
    };
    let total: u64 = plan.dests.iter().map(|d| d.nbytes()).sum();
    if nfiles > 1 {
        let weight_map: BTreeMap<&str, String> = plan
            .dests
            .iter()
            .map(|d| (d.name.as_str(), name(d.group)))
            .collect();
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            out.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)? + "\n",
        )?;
    }
    // Config and tokenizer files.
    if let Some(d) = copy_from {
        for e in std::fs::read_dir(d).with_context(|| format!("read {}", d.display()))? {
            let e = e?;
            let n = e.file_name().to_string_lossy().into_owned();
            if e.file_type()?.is_file()
                && !n.starts_with('.')
                && !n.ends_with(".safetensors")
                && n != "model.safetensors.index.json"
            {
                std::fs::copy(e.path(), out.join(&n))?;
            }
        }
    } else {
        std::fs::write(
            out.join("config.json"),
            serde_json::to_string_pretty(&cfg)? + "\n",
        )?;
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "exported {} tensors ({:.3} GB, {} file(s)) to {} in {secs:.2} s (planning {planned:.3} s){}",
        plan.dests.len(),
        total as f64 / 1e9,
        nfiles,
        out.display(),
        if read > 0 {
            format!(
                "; read {:.3} GB (amplification {:.3})",
                read as f64 / 1e9,
                read as f64 / written.max(1) as f64
            )
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// `export --vllm`.
pub fn export_vllm(
    ckpt: &Path,
    map: &str,
    out: &Path,
    config: Option<&Path>,
    tp: u64,
    megatron: Option<&str>,
    dry_run: bool,
) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let ck = Checkpoint::open(ckpt_dir(ckpt))?;
    let table = Table::load(map)?;
    let cfg = hf_config(Some(&ck), config, None)?;
    let saved = saved_layout(&ck, megatron)?;
    let plan = convert::plan_vllm(&table, &cfg, saved, &ckpt_inventory(&ck), tp)?;
    let version = table
        .vllm
        .as_ref()
        .and_then(|v| v.version.clone())
        .unwrap_or_default();
    if dry_run {
        print_plan(
            &plan,
            &format!(
                "export {} -> vLLM TP {tp} ({version}) with table `{}`",
                ckpt.display(),
                table.name
            ),
            "rank",
        );
        return Ok(ExitCode::SUCCESS);
    }
    std::fs::create_dir_all(out)?;
    let name = |r: usize| format!("model-rank-{r}-part-0.safetensors");
    let (read, written, _) = write_files(&ck, &plan, &name, out, &|_| true)?;
    let per = plan.bytes_per_group();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "wrote vLLM TP {tp} per-rank files ({version}) to {} in {secs:.2} s: {:.3} GB written, {:.3} GB read (amplification {:.3}); per rank read/written: {}",
        out.display(),
        written as f64 / 1e9,
        read as f64 / 1e9,
        read as f64 / written.max(1) as f64,
        per.iter()
            .map(|(r, (a, b))| format!("{r}: {a}/{b}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(ExitCode::SUCCESS)
}

/// HF safetensors files of a directory, mapped.
pub struct HfDir {
    maps: Vec<Mmap>,
    /// name -> (file, dtype, shape)
    pub tensors: BTreeMap<String, (usize, zarrckpt::DType, Vec<u64>)>,
}

impl HfDir {
    /// Maps every `*.safetensors` of `dir`.
    pub fn open(dir: &Path) -> anyhow::Result<HfDir> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("read {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("{}: no .safetensors files", dir.display());
        }
        let mut maps = Vec::new();
        let mut tensors = BTreeMap::new();
        for (fi, p) in files.iter().enumerate() {
            let f = File::open(p).with_context(|| format!("open {}", p.display()))?;
            // SAFETY: read-only mapping of a file we do not modify (as every safetensors reader).
            let m = unsafe { Mmap::map(&f) }.with_context(|| format!("map {}", p.display()))?;
            let st =
                SafeTensors::deserialize(&m).with_context(|| format!("parse {}", p.display()))?;
            for (name, v) in st.tensors() {
                let dt = dtype_of(v.dtype()).with_context(|| {
                    format!("{}: `{name}` has dtype {:?}", p.display(), v.dtype())
                })?;
                let shape = v.shape().iter().map(|&d| d as u64).collect();
                if tensors.insert(name.clone(), (fi, dt, shape)).is_some() {
                    bail!("tensor `{name}` appears in two files of {}", dir.display());
                }
            }
            maps.push(m);
        }
        Ok(HfDir { maps, tensors })
    }

    /// The inventory.
    pub fn inventory(&self) -> Inventory {
        self.tensors
            .iter()
            .map(|(k, (_, d, s))| (k.clone(), (d.to_string(), s.clone())))
            .collect()
    }

    /// A tensor's bytes.
    pub fn data(&self, name: &str) -> &[u8] {
        let (fi, _, _) = &self.tensors[name];
        let st = SafeTensors::deserialize(&self.maps[*fi]).expect("parsed before");
        let v = st.tensor(name).expect("listed");
        let d = v.data();
        // Re-borrow from the map itself (the view borrows the map).
        let base = self.maps[*fi].as_ptr() as usize;
        let start = d.as_ptr() as usize - base;
        &self.maps[*fi][start..start + d.len()]
    }
}

/// `import --hf`.
#[allow(clippy::too_many_arguments)]
pub fn import_hf(
    hf: &Path,
    map: &str,
    megatron: &str,
    out: &Path,
    overwrite: bool,
    procs: usize,
    dry_run: bool,
) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let layout: Layout = megatron.parse().map_err(anyhow::Error::msg)?;
    let table = Table::load(map)?;
    let cfg = read_json(&hf.join("config.json"))?;
    let dir = HfDir::open(hf)?;
    let plan = convert::plan_megatron_import(&table, &cfg, layout, &dir.inventory())?;
    if dry_run {
        print_plan(
            &plan,
            &format!(
                "import {} -> Megatron {layout} with table `{}`",
                hf.display(),
                table.name
            ),
            "tp rank",
        );
        return Ok(ExitCode::SUCCESS);
    }
    let planned = t0.elapsed().as_secs_f64();
    // Source bytes, by source index.
    let src: Vec<&[u8]> = plan.sources.iter().map(|s| dir.data(&s.name)).collect();
    // Destination boxes: borrowed from the mapped HF files where they are one contiguous run;
    // the others are assembled one at a time into a scratch file next to the output, mapped
    // back read-only, so that the heap holds one box at a time and the page cache the rest.
    let nonempty = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if nonempty && !overwrite {
        bail!(
            "{} exists and is not empty (pass --overwrite to replace it)",
            out.display()
        );
    }
    std::fs::create_dir_all(out)?;
    let scratch_path = out.join(".zarrckpt-import-scratch");
    let mut at: Vec<Option<(usize, usize)>> = vec![None; plan.dests.len()];
    let mut borrowed = 0u64;
    let mut assembled = 0usize;
    for (i, slot) in at.iter_mut().enumerate() {
        if convert::exec::borrowable(&plan, i).is_some() {
            borrowed += plan.dests[i].nbytes();
        } else {
            let n = plan.dests[i].nbytes() as usize;
            *slot = Some((assembled, n));
            assembled += n.next_multiple_of(8);
        }
    }
    let scratch_map = {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&scratch_path)
            .with_context(|| format!("create {}", scratch_path.display()))?;
        f.set_len(assembled as u64)?;
        for (i, slot) in at.iter().enumerate() {
            if let Some((off, n)) = slot {
                let mut buf = vec![0u8; *n];
                convert::fill_from_sources(&plan, i, &|k| src[k], &mut buf)?;
                f.write_all_at(&buf, *off as u64)?;
            }
        }
        if assembled == 0 {
            None
        } else {
            // SAFETY: a private scratch file this process created and no longer writes.
            Some(
                unsafe { Mmap::map(&f) }
                    .with_context(|| format!("map {}", scratch_path.display()))?,
            )
        }
    };
    let mut pieces = Vec::with_capacity(plan.dests.len());
    for (i, d) in plan.dests.iter().enumerate() {
        let data: &[u8] = match (&at[i], &scratch_map) {
            (Some((off, n)), Some(m)) => &m[*off..*off + *n],
            _ => {
                let (s, r) = convert::exec::borrowable(&plan, i).expect("borrowable");
                &src[s][r]
            }
        };
        let region = zarrckpt::Region::new(d.region.off.clone(), d.region.len.clone())?;
        pieces.push(ShardedTensor::new(
            TensorKey::new(&d.name)?,
            d.dtype,
            d.shape.clone(),
            region,
            0,
            data,
        )?);
    }
    // Megatron's objects: the common state and the extra state of linear layers.
    let env = convert::expand::Env::new(&table, &cfg, layout);
    let mut objects = vec![StateObject::common(
        "megatron/common",
        serde_json::json!({}),
    )?];
    for o in &table.objects {
        if let Some(w) = &o.when
            && !env.eval_bool(w, &[])?
        {
            continue;
        }
        let pat = convert::expand::Pattern::parse(&o.name)?;
        let ranges = convert::expand::stack_ranges(&o.stack, &env)?;
        for idx in convert::expand::stack_indices(&ranges) {
            let caps: Vec<(String, i64)> = ranges
                .iter()
                .zip(&idx)
                .map(|((n, ..), &i)| {
                    let v = i64::try_from(i).with_context(|| format!("capture {n} = {i}"))?;
                    Ok((n.clone(), v))
                })
                .collect::<anyhow::Result<_>>()?;
            let name = pat.render(&convert::expand::CapScope {
                env: &env,
                caps: &caps,
            })?;
            let axes: Vec<(u64, u64)> = o
                .stack
                .iter()
                .zip(ranges.iter().zip(&idx))
                .filter(|(s, _)| !s.in_name)
                .map(|(_, ((_, size, ..), &i))| (i, *size))
                .collect();
            let (off, shape) = if axes.is_empty() {
                ("0".to_string(), "1".to_string())
            } else {
                (
                    axes.iter()
                        .map(|a| a.0.to_string())
                        .collect::<Vec<_>>()
                        .join("."),
                    axes.iter()
                        .map(|a| a.1.to_string())
                        .collect::<Vec<_>>()
                        .join("."),
                )
            };
            objects.push(StateObject::common(
                &format!("{name}/shard_{off}_{shape}"),
                serde_json::Value::Null,
            )?);
        }
    }
    let mut opts = SaveOptions {
        overwrite,
        io_threads: procs,
        ..Default::default()
    };
    opts.user_metadata.insert(
        "megatron".into(),
        serde_json::json!({"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "table": table.name, "source": "zarrckpt import --hf"}),
    );
    opts.user_metadata.insert("hf_config".into(), cfg.clone());
    let _ = std::fs::remove_file(out.join("metadata.json"));
    let rep = zarrckpt::save_with_objects(
        &pieces,
        &objects,
        &out.join("zarrckpt"),
        &LocalComm::single(),
        &opts,
    );
    drop(pieces);
    drop(scratch_map);
    let _ = std::fs::remove_file(&scratch_path);
    let rep = rep?;
    let cfgm = serde_json::json!({"sharded_backend": "zarrckpt", "sharded_backend_version": 1, "common_backend": "zarrckpt", "common_backend_version": 1});
    std::fs::write(out.join("metadata.json"), serde_json::to_string(&cfgm)?)?;
    let total: u64 = plan.dests.iter().map(|d| d.nbytes()).sum();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "imported {} HF tensors into {} Megatron tensors ({} rank boxes, {:.3} GB: {:.3} GB saved straight from the mapped HF files, the rest assembled through a scratch file one box at a time) at {layout} into {} in {secs:.2} s (planning {planned:.3} s); {} shard files",
        plan.sources.len(),
        plan.expanded.m.len(),
        plan.dests.len(),
        total as f64 / 1e9,
        borrowed as f64 / 1e9,
        out.display(),
        rep.chunks_written
    );
    Ok(ExitCode::SUCCESS)
}

/// `inspect --map`: the HF export plan of a checkpoint.
pub fn inspect_map(
    ckpt: &Path,
    map: &str,
    config: Option<&Path>,
    megatron: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let ck = Checkpoint::open(ckpt_dir(ckpt))?;
    let table = Table::load(map)?;
    let cfg = hf_config(Some(&ck), config, None)?;
    let saved = saved_layout(&ck, megatron)?;
    let plan = convert::plan_hf_export(&table, &cfg, saved, &ckpt_inventory(&ck), u64::MAX)?;
    print_plan(
        &plan,
        &format!(
            "{} as HF with table `{}` (saved at {saved})",
            ckpt.display(),
            table.name
        ),
        "file",
    );
    Ok(ExitCode::SUCCESS)
}
