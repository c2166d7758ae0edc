//! `zarrckpt bench-plan`: what agreeing on a save and a load costs each rank of a very large
//! job, with simulated ranks (no network, no data): building the rank's own description, the
//! traffic of the all-reduce that combines the descriptions up the communicator's binary tree
//! (bytes each rank receives and sends, the busiest rank apart from the median), planning on a
//! few ranks (time and peak memory), and reading the index for a load.

use std::collections::HashSet;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::bail;
use serde_json::json;
use zarrckpt::comm::collective::tree_children;
use zarrckpt::plan::SavePlanOptions;
use zarrckpt::plan::exchange::ExchangePlan;
use zarrckpt::plan::layout::{PieceDecl, RankLayout, TensorDecl};
use zarrckpt::plan::load::StoredGeometry;
use zarrckpt::plan::rule::{Summary, Template, World};
use zarrckpt::plan::ruled::{plan_load, plan_save};
use zarrckpt::storage::meta::{CheckpointMeta, TensorEntry, tensor_path};
use zarrckpt::storage::{Compression, commit};
use zarrckpt::{DType, Region, TensorKey};

/// Arguments of `zarrckpt bench-plan`.
#[derive(clap::Args)]
pub struct Args {
    /// World sizes to simulate.
    #[arg(long, value_delimiter = ',', default_value = "8192,65536")]
    ranks: Vec<u64>,
    /// Layouts: `tp-pp-dp` (tensor x pipeline x data parallel, replicas), `fsdp` (every rank
    /// its own rows of every tensor, torch.chunk / DTensor Shard(0)), `zero` (every rank its
    /// own flat range of every tensor, ZeRO-3 style), `irregular` (fsdp with uneven,
    /// rank-dependent cuts no rule describes).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "tp-pp-dp,fsdp,zero,irregular"
    )]
    cases: Vec<String>,
    /// World sizes for the `irregular` case (its cost grows with world x tensors).
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    irregular_ranks: Vec<u64>,
    /// Tensors in the model.
    #[arg(long, default_value_t = 1000)]
    tensors: u64,
    /// Tensor-parallel size (`tp-pp-dp`).
    #[arg(long, default_value_t = 8)]
    tp: u64,
    /// Pipeline-parallel size (`tp-pp-dp`).
    #[arg(long, default_value_t = 8)]
    pp: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Bytes allocated now and at most since the last reset, counted by the tool's allocator.
pub static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
/// See [`ALLOCATED`].
pub static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Counts allocations (for the peak memory of planning).
pub struct Counting;

// SAFETY: forwards to the system allocator, only counting sizes.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        let now = ALLOCATED.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: as the caller promised.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        ALLOCATED.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: as the caller promised.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        if new >= l.size() {
            let now = ALLOCATED.fetch_add(new - l.size(), Ordering::Relaxed) + new - l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        } else {
            ALLOCATED.fetch_sub(l.size() - new, Ordering::Relaxed);
        }
        // SAFETY: as the caller promised.
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
}

/// Peak bytes allocated above the level at the start, while `f` runs.
pub fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = ALLOCATED.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(base))
}

struct Tensor {
    key: TensorKey,
    dtype: DType,
    shape: Vec<u64>,
    /// The tensor-parallel axis (`None`: replicated, a norm).
    split: Option<usize>,
    stage: u64,
}

/// `n` tensors of a hidden-8192 transformer, cycling through column-parallel, row-parallel and
/// replicated (norm) shapes, assigned to `pp` pipeline stages in order.
fn model(n: u64, pp: u64) -> Vec<Tensor> {
    let h = 8192;
    (0..n)
        .map(|i| {
            let (name, dtype, shape, split) = match i % 5 {
                0 => (
                    "self_attention.linear_qkv.weight",
                    DType::BFloat16,
                    vec![3 * h, h],
                    Some(0),
                ),
                1 => (
                    "self_attention.linear_proj.weight",
                    DType::BFloat16,
                    vec![h, h],
                    Some(1),
                ),
                2 => (
                    "mlp.linear_fc1.weight",
                    DType::BFloat16,
                    vec![4 * h, h],
                    Some(0),
                ),
                3 => (
                    "mlp.linear_fc2.weight",
                    DType::BFloat16,
                    vec![h, 4 * h],
                    Some(1),
                ),
                _ => ("input_layernorm.weight", DType::Float32, vec![h], None),
            };
            Tensor {
                key: TensorKey::new(format!("decoder.layers.{}.{name}", i / 5)).expect("valid key"),
                dtype,
                shape,
                split,
                stage: i * pp / n,
            }
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Case {
    TpPpDp { tp: u64, pp: u64 },
    Fsdp,
    Zero,
    Irregular,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::TpPpDp { .. } => "tp-pp-dp",
            Case::Fsdp => "fsdp",
            Case::Zero => "zero",
            Case::Irregular => "irregular",
        }
    }
}

fn decl(t: &Tensor) -> TensorDecl {
    TensorDecl {
        key: t.key.clone(),
        dtype: t.dtype,
        global_shape: t.shape.clone(),
    }
}

/// Rank `r`'s pieces (save: `main` flags as declared; load: every piece a plain request).
fn layout(case: Case, m: &[Tensor], world: u64, r: u64, load: bool) -> RankLayout {
    let mut l = RankLayout::default();
    let mut push = |t: &Tensor, region: Region, main: bool| {
        let idx = match l.tensors.iter().position(|d| d.key == t.key) {
            Some(i) => i,
            None => {
                l.tensors.push(decl(t));
                l.tensors.len() - 1
            }
        };
        l.pieces.push(PieceDecl {
            tensor: u32::try_from(idx).unwrap_or(u32::MAX),
            region,
            main: main && !load,
            auto: false,
        });
    };
    match case {
        Case::TpPpDp { tp, pp } => {
            let (t, s, d) = (r % tp, (r / tp) % pp, r / (tp * pp));
            for x in m.iter().filter(|x| x.stage == s) {
                let mut region = Region::full(&x.shape);
                let main = match x.split {
                    Some(axis) => {
                        let size = x.shape[axis] / tp;
                        region = region
                            .with_axis(axis, t * size, size)
                            .expect("a box inside the tensor");
                        d == 0
                    }
                    None => d == 0 && t == 0,
                };
                push(x, region, main);
            }
        }
        Case::Fsdp => {
            for x in m {
                let d0 = x.shape[0];
                let s = d0.div_ceil(world);
                let o = (r * s).min(d0);
                let region = Region::full(&x.shape)
                    .with_axis(0, o, s.min(d0 - o))
                    .expect("a box inside the tensor");
                push(x, region, true);
            }
        }
        Case::Irregular => {
            for x in m {
                let d0 = x.shape[0];
                let cut = |k: u64| {
                    if k == 0 || k >= world {
                        k.min(world) * d0 / world
                    } else {
                        (k * d0 / world + k % 2).min(d0)
                    }
                };
                let (a, b) = (cut(r), cut(r + 1));
                let region = Region::full(&x.shape)
                    .with_axis(0, a, b.saturating_sub(a))
                    .expect("a box inside the tensor");
                push(x, region, true);
            }
        }
        Case::Zero => {
            for x in m {
                let n: u64 = x.shape.iter().product();
                let s = n.div_ceil(world);
                let (a, b) = ((r * s).min(n), ((r + 1) * s).min(n));
                match zarrckpt::model::flat::flat_boxes(&x.shape, a..b) {
                    Ok(boxes) if !boxes.is_empty() => {
                        for fb in boxes {
                            push(x, fb.region, true);
                        }
                    }
                    _ => {
                        let region = Region::full(&x.shape)
                            .with_axis(0, x.shape[0], 0)
                            .expect("a box inside the tensor");
                        push(x, region, true);
                    }
                }
            }
        }
    }
    l
}

fn leaf(case: Case, m: &[Tensor], world: u64, r: u64, load: bool) -> Vec<u8> {
    let (t, c) = Template::describe(&layout(case, m, world, r, load));
    Summary::leaf(r, t.encode(), &c).encode()
}

/// The all-reduce up the collectives' binary tree rooted at rank 0
/// ([`zarrckpt::comm::collective::tree_children`]), as every communicator runs it through
/// `zarrckpt::comm::collective` (`TcpComm`, `TorchComm`, `LocalComm`, `NcclComm`): each rank
/// merges its own description with its children's results and sends the merge up; the root's
/// result travels down. Returns the result and the payload bytes each rank receives and sends
/// (the shared collectives add a 16-byte header per message).
fn tree_reduce(
    world: u64,
    leaf_of: &(dyn Fn(u64) -> Vec<u8> + Sync),
) -> anyhow::Result<(Vec<u8>, Vec<u64>, Vec<u64>)> {
    let n = world as usize;
    let mut received = vec![0u64; n];
    let mut sent = vec![0u64; n];
    fn up(
        r: usize,
        n: usize,
        leaf_of: &(dyn Fn(u64) -> Vec<u8> + Sync),
        received: &mut [u64],
        sent: &mut [u64],
    ) -> anyhow::Result<Vec<u8>> {
        let mut acc = leaf_of(r as u64);
        for c in tree_children(r, n) {
            let child = up(c, n, leaf_of, received, sent)?;
            received[r] += child.len() as u64;
            sent[c] += child.len() as u64;
            acc = Summary::merge_encoded(&acc, &child).map_err(anyhow::Error::msg)?;
        }
        Ok(acc)
    }
    let result = up(0, n, leaf_of, &mut received, &mut sent)?;
    let len = result.len() as u64;
    for r in 0..n {
        if r > 0 {
            received[r] += len;
        }
        sent[r] += len * tree_children(r, n).count() as u64;
    }
    Ok((result, received, sent))
}

/// A directory under the system's temporary directory, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> anyhow::Result<TempDir> {
        let p = std::env::temp_dir().join(format!("zarrckpt-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&p)?;
        Ok(TempDir(p))
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn stats(v: &[u64]) -> (u64, u64, usize) {
    let mut s = v.to_vec();
    s.sort_unstable();
    let busiest = (0..v.len()).max_by_key(|&i| v[i]).unwrap_or(0);
    (s[s.len() / 2], v[busiest], busiest)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Collectives of a save besides the layout's: each an all-reduce of a few bytes (outcome
/// agreements, the write balance), counted as bytes one rank receives (children's and result).
const SMALL_COLLECTIVES_PER_SAVE: u64 = 8;

fn run_case(case: Case, world: u64, a: &Args) -> anyhow::Result<serde_json::Value> {
    let m = model(
        a.tensors,
        if let Case::TpPpDp { pp, .. } = case {
            pp
        } else {
            1
        },
    );
    let probes: Vec<u64> = {
        let mut p = vec![0, world / 2, world - 1];
        p.dedup();
        p
    };
    // 1. The local description.
    let mut describe_secs = Vec::new();
    for &r in &probes {
        let t0 = Instant::now();
        let l = leaf(case, &m, world, r, false);
        describe_secs.push(t0.elapsed().as_secs_f64());
        drop(l);
    }
    // 2. The all-reduce's traffic.
    let t0 = Instant::now();
    let (summary, received, sent) = tree_reduce(world, &|r| leaf(case, &m, world, r, false))?;
    let simulate_secs = t0.elapsed().as_secs_f64();
    let (recv_median, recv_max, recv_busiest) = stats(&received);
    let (sent_median, sent_max, _) = stats(&sent);
    let decoded = Summary::decode(&summary, 0)?;
    // 3. Planning on the probe ranks: decode, validate, own tasks.
    let opts = SavePlanOptions::default();
    let mut plan_secs = Vec::new();
    let mut plan_peak = 0usize;
    let mut writes = Vec::new();
    let mut general = 0;
    let mut plan0 = None;
    for &r in &probes {
        let t0 = Instant::now();
        let (p, peak) = peak_of(|| -> anyhow::Result<_> {
            let s = Summary::decode(&summary, 0)?;
            let w = World::from_summary(&s, world as usize)?;
            Ok(plan_save(&w, u32::try_from(r)?, &opts)?)
        });
        let p = p?;
        plan_secs.push(t0.elapsed().as_secs_f64());
        plan_peak = plan_peak.max(peak);
        writes.push(p.tasks.writes.len());
        general = p.general;
        if plan0.is_none() {
            plan0 = Some(p);
        }
    }
    let plan0 = plan0.ok_or_else(|| anyhow::anyhow!("no probe"))?;
    // 4. The load: the same pieces asked back, the index read, each prober's shared reads.
    let (lsummary, lreceived, _) = tree_reduce(world, &|r| leaf(case, &m, world, r, true))?;
    let (lrecv_median, lrecv_max, _) = stats(&lreceived);
    let tmp = TempDir::new(&format!("bench-plan-{}-{world}", case.name()))?;
    let mut meta = CheckpointMeta::new(world);
    for tp in &plan0.plan.tensors {
        meta.tensors.insert(
            tp.key.clone(),
            TensorEntry {
                path: tensor_path(&tp.key),
                dtype: tp.dtype,
                shape: tp.global_shape.clone(),
                chunk_shape: tp.chunk_shape.clone(),
                subchunk_shape: tp.subchunk_shape.clone(),
                compression: Compression::None,
            },
        );
    }
    commit::commit(tmp.path(), &meta)?;
    let index_bytes = std::fs::metadata(tmp.path().join("zarr.json"))?.len();
    let mut index_secs = Vec::new();
    let mut load_secs = Vec::new();
    let mut load_peak = 0usize;
    let mut shared = 0;
    for &r in &probes {
        let t0 = Instant::now();
        let meta = commit::read_index(tmp.path())?;
        index_secs.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let (ex, peak) = peak_of(|| -> anyhow::Result<(ExchangePlan, u32)> {
            let s = Summary::decode(&lsummary, 0)?;
            let w = World::from_summary(&s, world as usize)?;
            let geometry = |k: &TensorKey| {
                meta.tensors.get(k).map(|e| StoredGeometry {
                    global_shape: e.shape.clone(),
                    chunk_shape: e.chunk_shape.clone(),
                    subchunk_shape: e.subchunk_shape.clone(),
                    elem: e.dtype.size(),
                })
            };
            Ok(plan_load(&w, u32::try_from(r)?, &geometry, 32 << 20)?)
        });
        let (ex, _) = ex?;
        load_secs.push(t0.elapsed().as_secs_f64());
        load_peak = load_peak.max(peak);
        shared = shared.max(ex.reads.len());
    }
    let small = SMALL_COLLECTIVES_PER_SAVE * 3 * 16;
    let save_recv_max = recv_max + small;
    let save_recv_median = recv_median + small;
    let row = json!({
        "case": case.name(), "world": world, "tensors": a.tensors,
        "templates": decoded.templates.len(), "runs": decoded.runs.len(),
        "summary_bytes": summary.len(),
        "describe_secs": median(describe_secs),
        "save_received_bytes_median": save_recv_median, "save_received_bytes_max": save_recv_max,
        "save_received_busiest_rank": recv_busiest,
        "save_sent_bytes_median": sent_median, "save_sent_bytes_max": sent_max,
        "save_plan_secs_max": plan_secs.iter().copied().fold(0.0, f64::max),
        "save_plan_secs_median": median(plan_secs.clone()),
        "save_plan_peak_bytes": plan_peak, "general_tensors": general,
        "probe_writes": writes,
        "load_received_bytes_median": lrecv_median + small, "load_received_bytes_max": lrecv_max + small,
        "index_bytes": index_bytes, "index_read_secs": median(index_secs),
        "load_plan_secs_max": load_secs.iter().copied().fold(0.0, f64::max),
        "load_plan_peak_bytes": load_peak, "shared_reads_max": shared,
        "simulation_secs": simulate_secs,
    });
    Ok(row)
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    let mut seen = HashSet::new();
    for name in &a.cases {
        let case = match name.as_str() {
            "tp-pp-dp" => Case::TpPpDp { tp: a.tp, pp: a.pp },
            "fsdp" => Case::Fsdp,
            "zero" => Case::Zero,
            "irregular" => Case::Irregular,
            other => bail!("unknown case `{other}` (tp-pp-dp, fsdp, zero, irregular)"),
        };
        let worlds = if case == Case::Irregular {
            &a.irregular_ranks
        } else {
            &a.ranks
        };
        for &world in worlds {
            if !seen.insert((name.clone(), world)) {
                continue;
            }
            if let Case::TpPpDp { tp, pp } = case
                && world % (tp * pp) != 0
            {
                bail!("world size {world} is not a multiple of tp {tp} x pp {pp}");
            }
            let row = run_case(case, world, a)?;
            if !a.json {
                let f = |k: &str| row[k].as_f64().unwrap_or(0.0);
                println!(
                    "{:<9} world {world:>6}, {} tensors: {} templates, {} runs, world description {:.1} KB",
                    case.name(),
                    a.tensors,
                    row["templates"],
                    row["runs"],
                    f("summary_bytes") / 1e3,
                );
                println!(
                    "          save: describe {:.1} ms; received per rank median {:.1} KB, busiest {:.1} KB (rank {}, {:.1}x); plan {:.3} s (max of probes), peak {:.1} MB; {} general tensors",
                    f("describe_secs") * 1e3,
                    f("save_received_bytes_median") / 1e3,
                    f("save_received_bytes_max") / 1e3,
                    row["save_received_busiest_rank"],
                    f("save_received_bytes_max") / f("save_received_bytes_median").max(1.0),
                    f("save_plan_secs_max"),
                    f("save_plan_peak_bytes") / 1e6,
                    row["general_tensors"],
                );
                println!(
                    "          load: received median {:.1} KB, busiest {:.1} KB; index {:.1} KB read in {:.1} ms; plan {:.3} s, peak {:.1} MB; {} shared reads on the busiest probe",
                    f("load_received_bytes_median") / 1e3,
                    f("load_received_bytes_max") / 1e3,
                    f("index_bytes") / 1e3,
                    f("index_read_secs") * 1e3,
                    f("load_plan_secs_max"),
                    f("load_plan_peak_bytes") / 1e6,
                    row["shared_reads_max"],
                );
            }
            rows.push(row);
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "runs": rows }))?
        );
    }
    Ok(ExitCode::SUCCESS)
}
