//! `zarrckpt corruption-trials`: the corruption harness. Each trial copies a small checkpoint
//! (uncompressed or zstd, alternately), damages it once at random (a flipped byte, a
//! truncation, a deleted file, garbage appended, two equal-sized subchunks swapped within a
//! shard or between shards, two equal-sized shard files swapped within a tensor or between
//! tensors) in shard data, shard footers, shard indexes or metadata, then loads every tensor
//! and runs `verify`. Every damage to a shard must be detected by both, with an error naming
//! the tensor, the chunk and the file; damage to metadata must be detected naming the file,
//! or leave every tensor bit-exact (free-form fields such as `writer`, and group documents,
//! which readers do not need). Never wrong data, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::crash::Rng;
use anyhow::{bail, ensure};
use zarrckpt::{
    Checkpoint, Compression, DType, Region, SaveOptions, ShardedTensor, TensorKey, save,
};

/// Arguments of `zarrckpt corruption-trials`.
#[derive(clap::Args)]
pub struct Args {
    /// Number of trials.
    #[arg(long, default_value_t = 1000)]
    trials: usize,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
}

const KEYS: [&str; 3] = ["a", "b", "c/d"];

/// Writes the fixture: three tensors of the same geometry ([16, 64] u32, two chunks of
/// [8, 64], subchunks of 2 rows), so that shards and subchunks of equal size exist within and
/// across tensors.
fn fixture(dir: &Path, compression: Compression) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut full = BTreeMap::new();
    let mut datas = Vec::new();
    for (t, k) in KEYS.iter().enumerate() {
        let d: Vec<u8> = (0..16u32 * 64)
            .flat_map(|i| {
                // Compressible but distinct per tensor and row.
                ((i / 7) * 2_654_435_761u32.wrapping_add(t as u32)).to_le_bytes()
            })
            .collect();
        full.insert((*k).to_owned(), d.clone());
        datas.push(d);
    }
    let mut halves = Vec::new();
    for d in &datas {
        halves.push((d[..d.len() / 2].to_vec(), d[d.len() / 2..].to_vec()));
    }
    let mut pieces = Vec::new();
    for (t, k) in KEYS.iter().enumerate() {
        for (h, bytes) in [&halves[t].0, &halves[t].1].into_iter().enumerate() {
            pieces.push(ShardedTensor::new(
                TensorKey::new(*k)?,
                DType::UInt32,
                vec![16, 64],
                Region::new(vec![8 * h as u64, 0], vec![8, 64])?,
                0,
                bytes,
            )?);
        }
    }
    let mut opts = SaveOptions {
        compression,
        ..SaveOptions::default()
    };
    opts.grid.subchunk_target_bytes = 2 * 64 * 4;
    save(&pieces, dir, &zarrckpt::LocalComm::single(), &opts)?;
    Ok(full)
}

fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_tree(&e.path(), &dest)?;
        } else {
            std::fs::copy(e.path(), dest)?;
        }
    }
    Ok(())
}

/// A shard file of the fixture: its path relative to the checkpoint, key and chunk.
#[derive(Clone)]
struct ShardRef {
    rel: String,
    key: &'static str,
    chunk: [u64; 2],
}

fn shards() -> Vec<ShardRef> {
    let mut v = Vec::new();
    for key in KEYS {
        for c in 0..2u64 {
            v.push(ShardRef {
                rel: format!("tensors/{key}/c.{c}.0"),
                key,
                chunk: [c, 0],
            });
        }
    }
    v
}

/// Subchunks per shard and the size of each shard's tail (footer + index).
const N_SUB: usize = 4;
const INDEX: usize = 16 * N_SUB + 4;
const FOOTER: usize = 52 + 8 * 2 + 4 * N_SUB;

/// `(offset, nbytes)` of every subchunk of a shard file.
fn entries(bytes: &[u8]) -> Vec<(usize, usize)> {
    let idx = &bytes[bytes.len() - INDEX..];
    (0..N_SUB)
        .map(|i| {
            let w = |a: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&idx[a..a + 8]);
                usize::try_from(u64::from_le_bytes(b)).unwrap_or(usize::MAX)
            };
            (w(16 * i), w(16 * i + 8))
        })
        .collect()
}

/// What a trial damaged.
struct Damage {
    what: String,
    /// The shard files involved (empty for metadata damage).
    shards: Vec<ShardRef>,
    /// The metadata file involved.
    meta_file: Option<String>,
}

fn damage(ck: &Path, rng: &mut Rng) -> anyhow::Result<Damage> {
    let all = shards();
    let s = all[rng.below(all.len())].clone();
    let path = ck.join(&s.rel);
    let mut bytes = std::fs::read(&path)?;
    let len = bytes.len();
    let kind = rng.below(10);
    let shard_damage = |what: String, shards: Vec<ShardRef>| Damage {
        what,
        shards,
        meta_file: None,
    };
    Ok(match kind {
        // A flipped byte anywhere in the shard; in the footer or the index specifically.
        0..=2 => {
            let at = match kind {
                0 => rng.below(len),
                1 => len - INDEX - FOOTER + rng.below(FOOTER),
                _ => len - INDEX + rng.below(INDEX),
            };
            bytes[at] ^= 1 << rng.below(8);
            std::fs::write(&path, &bytes)?;
            shard_damage(format!("flip {} byte {at}", s.rel), vec![s])
        }
        3 => {
            let n = rng.below(len);
            bytes.truncate(n);
            std::fs::write(&path, &bytes)?;
            shard_damage(format!("truncate {} to {n}", s.rel), vec![s])
        }
        4 => {
            std::fs::remove_file(&path)?;
            shard_damage(format!("delete {}", s.rel), vec![s])
        }
        5 => {
            bytes.extend((0..1 + rng.below(64)).map(|i| i as u8));
            std::fs::write(&path, &bytes)?;
            shard_damage(format!("append to {}", s.rel), vec![s])
        }
        // Two equal-sized subchunks swapped within the shard.
        6 => {
            let e = entries(&bytes);
            let pairs: Vec<(usize, usize)> = (0..N_SUB)
                .flat_map(|i| (i + 1..N_SUB).map(move |j| (i, j)))
                .filter(|&(i, j)| e[i].1 == e[j].1)
                .collect();
            let Some(&(i, j)) = pairs.get(rng.below(pairs.len())) else {
                return damage(ck, rng);
            };
            let (a, b) = (e[i], e[j]);
            let (x, y) = (
                bytes[a.0..a.0 + a.1].to_vec(),
                bytes[b.0..b.0 + b.1].to_vec(),
            );
            bytes[a.0..a.0 + a.1].copy_from_slice(&y);
            bytes[b.0..b.0 + b.1].copy_from_slice(&x);
            std::fs::write(&path, &bytes)?;
            shard_damage(format!("swap subchunks {i} and {j} of {}", s.rel), vec![s])
        }
        // An equal-sized subchunk of another shard copied over one of this shard's.
        7 => {
            let o = all[rng.below(all.len())].clone();
            if o.rel == s.rel {
                return damage(ck, rng);
            }
            let other = std::fs::read(ck.join(&o.rel))?;
            let (e, f) = (entries(&bytes), entries(&other));
            let (i, j) = (rng.below(N_SUB), rng.below(N_SUB));
            if e[i].1 != f[j].1 || bytes[e[i].0..e[i].0 + e[i].1] == other[f[j].0..f[j].0 + f[j].1]
            {
                return damage(ck, rng);
            }
            bytes[e[i].0..e[i].0 + e[i].1].copy_from_slice(&other[f[j].0..f[j].0 + f[j].1]);
            std::fs::write(&path, &bytes)?;
            shard_damage(
                format!("subchunk {j} of {} over subchunk {i} of {}", o.rel, s.rel),
                vec![s],
            )
        }
        // Two equal-sized shard files swapped (within a tensor or across tensors).
        8 => {
            let o = all[rng.below(all.len())].clone();
            let other = std::fs::read(ck.join(&o.rel))?;
            if o.rel == s.rel || other.len() != len {
                return damage(ck, rng);
            }
            std::fs::write(&path, &other)?;
            std::fs::write(ck.join(&o.rel), &bytes)?;
            shard_damage(format!("swap {} and {}", s.rel, o.rel), vec![s, o])
        }
        // Metadata: a flipped byte in the root, an array or a group zarr.json, or a deletion.
        _ => {
            let files = [
                "zarr.json".to_owned(),
                "tensors/zarr.json".to_owned(),
                "tensors/c/zarr.json".to_owned(),
                format!("tensors/{}/zarr.json", KEYS[rng.below(KEYS.len())]),
            ];
            let f = files[rng.below(files.len())].clone();
            let p = ck.join(&f);
            if rng.below(8) == 0 {
                std::fs::remove_file(&p)?;
                Damage {
                    what: format!("delete {f}"),
                    shards: Vec::new(),
                    meta_file: Some(f),
                }
            } else {
                let mut b = std::fs::read(&p)?;
                let at = rng.below(b.len());
                b[at] ^= 1 << rng.below(8);
                std::fs::write(&p, &b)?;
                Damage {
                    what: format!("flip {f} byte {at}"),
                    shards: Vec::new(),
                    meta_file: Some(f),
                }
            }
        }
    })
}

/// True when `msg` names one of the damaged shards (key, chunk and file).
fn names_shard(msg: &str, d: &Damage) -> bool {
    d.shards.iter().any(|s| {
        msg.contains(&s.rel)
            && msg.contains(&format!("`{}`", s.key))
            && msg.contains(&format!("{:?}", s.chunk))
    })
}

/// Outcome counts.
#[derive(Default)]
struct Tally {
    /// Trials by kind of damage.
    kinds: BTreeMap<String, usize>,
    shard_detected: usize,
    meta_detected: usize,
    meta_harmless: usize,
}

fn trial(
    ck: &Path,
    full: &BTreeMap<String, Vec<u8>>,
    rng: &mut Rng,
    tally: &mut Tally,
) -> anyhow::Result<()> {
    let d = damage(ck, rng)?;
    let kind = if d.shards.is_empty() {
        format!("metadata {}", d.what.split(' ').next().unwrap_or(""))
    } else if d.what.starts_with("flip") {
        let at: usize = d
            .what
            .rsplit(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let len = std::fs::metadata(ck.join(&d.shards[0].rel)).map_or(0, |m| m.len() as usize);
        if at >= len.saturating_sub(INDEX) {
            "flip in shard index".into()
        } else if at >= len.saturating_sub(INDEX + FOOTER) {
            "flip in shard footer".into()
        } else {
            "flip in shard data".into()
        }
    } else if d.what.starts_with("swap subchunks") {
        "swap equal subchunks within a shard".into()
    } else if d.what.starts_with("subchunk") {
        "equal subchunk from another shard".into()
    } else if d.what.starts_with("swap") {
        "swap equal shard files".into()
    } else {
        format!("{} shard", d.what.split(' ').next().unwrap_or(""))
    };
    *tally.kinds.entry(kind).or_default() += 1;
    // Load every tensor.
    let mut load_errors = Vec::new();
    let mut wrong = Vec::new();
    match Checkpoint::open(ck) {
        Err(e) => load_errors.push(e.to_string()),
        Ok(c) => {
            for (k, want) in full {
                match c.read_tensor(&TensorKey::new(k.as_str())?) {
                    Ok(got) if &got == want => {}
                    Ok(_) => wrong.push(k.clone()),
                    Err(e) => load_errors.push(e.to_string()),
                }
            }
        }
    }
    ensure!(wrong.is_empty(), "{}: WRONG DATA for {wrong:?}", d.what);
    // Verify.
    let verify_errors: Vec<String> = match Checkpoint::open(ck) {
        Err(e) => vec![e.to_string()],
        Ok(c) => c
            .verify(1, None)?
            .problems
            .iter()
            .map(|p| p.error.to_string())
            .collect(),
    };
    if d.shards.is_empty() {
        let f = d.meta_file.as_deref().unwrap_or("");
        if load_errors.is_empty() && verify_errors.is_empty() {
            tally.meta_harmless += 1;
            return Ok(());
        }
        ensure!(
            !load_errors.is_empty() && !verify_errors.is_empty(),
            "{}: detected by only one of load ({load_errors:?}) and verify ({verify_errors:?})",
            d.what
        );
        let parent = Path::new(f)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        for m in load_errors.iter().chain(&verify_errors) {
            ensure!(
                m.contains(f) || m.contains(&*parent.to_string_lossy()) || f == "zarr.json",
                "{}: error does not name the file: {m}",
                d.what
            );
        }
        tally.meta_detected += 1;
        return Ok(());
    }
    ensure!(!load_errors.is_empty(), "{}: load did not notice", d.what);
    ensure!(
        !verify_errors.is_empty(),
        "{}: verify did not notice",
        d.what
    );
    ensure!(
        load_errors.iter().any(|m| names_shard(m, &d)),
        "{}: no load error names key, chunk and file: {load_errors:?}",
        d.what
    );
    ensure!(
        verify_errors.iter().any(|m| names_shard(m, &d)),
        "{}: no verify problem names key, chunk and file: {verify_errors:?}",
        d.what
    );
    tally.shard_detected += 1;
    Ok(())
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let tmp = match &a.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("zarrckpt-corrupt-{}", std::process::id())),
    };
    std::fs::create_dir_all(&tmp)?;
    let mut fixtures = Vec::new();
    for (i, c) in [Compression::None, Compression::Zstd]
        .into_iter()
        .enumerate()
    {
        let dir = tmp.join(format!("fixture-{i}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        let full = fixture(&dir, c)?;
        let ck = Checkpoint::open(&dir)?;
        ensure!(
            ck.verify(1, None)?.problems.is_empty(),
            "fixture is not sound"
        );
        for t in ck.tensors() {
            ensure!(
                t.chunk_shape == [8, 64] && t.subchunk_shape == [2, 64],
                "fixture geometry changed: {t:?}"
            );
        }
        fixtures.push((dir, full));
    }
    let mut rng = Rng::seeded(a.seed);
    let mut tally = Tally::default();
    let mut failures = 0usize;
    for i in 0..a.trials {
        let (fixture, full) = &fixtures[i % fixtures.len()];
        let ck = tmp.join("trial");
        if ck.exists() {
            std::fs::remove_dir_all(&ck)?;
        }
        copy_tree(fixture, &ck)?;
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            trial(&ck, full, &mut rng, &mut tally)
        }));
        let res = match res {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("PANIC")),
        };
        if let Err(e) = res {
            failures += 1;
            println!("FAIL trial {i}: {e:#}");
        }
    }
    std::fs::remove_dir_all(tmp.join("trial")).ok();
    for (k, n) in &tally.kinds {
        println!("  {n:>5}  {k}");
    }
    println!(
        "corruption trials: {} trials, {} passed: shard damage detected by load and verify naming key, chunk and file {}, metadata damage detected naming the file {}, metadata damage harmless (every tensor bit-exact) {}; {failures} failed",
        a.trials,
        a.trials - failures,
        tally.shard_detected,
        tally.meta_detected,
        tally.meta_harmless
    );
    if a.dir.is_none() {
        std::fs::remove_dir_all(&tmp).ok();
    }
    if failures > 0 {
        bail!("{failures} corruption trials failed");
    }
    Ok(ExitCode::SUCCESS)
}
