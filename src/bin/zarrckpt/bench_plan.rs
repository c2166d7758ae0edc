//! `zarrckpt bench-plan`: the cost of planning a save and a load on one rank of a very large
//! job, with simulated ranks (no I/O, no network): what each rank gathers and how long it
//! takes to validate the layout and compute its own work.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::bail;
use serde_json::json;
use zarrckpt::plan::cache::{self, CHECK_LEN, CachedPlan, CheckOutcome};
use zarrckpt::plan::exchange::ExchangePlan;
use zarrckpt::plan::layout::{GatheredLayouts, PieceDecl, RankLayout, TensorDecl};
use zarrckpt::plan::load::StoredGeometry;
use zarrckpt::plan::{SavePlan, SavePlanOptions};
use zarrckpt::{DType, Region, TensorKey};

/// Arguments of `zarrckpt bench-plan`.
#[derive(clap::Args)]
pub struct Args {
    /// World sizes to simulate.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    ranks: Vec<u64>,
    /// Tensors in the model.
    #[arg(long, default_value_t = 1000)]
    tensors: u64,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 8)]
    tp: u64,
    /// Pipeline-parallel sizes to simulate: 1 (every rank holds a piece of every tensor) and
    /// more (each stage holds its layers' tensors).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pp: Vec<u64>,
    /// Repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The model: `n` tensors of a hidden-8192 transformer, cycling through column-parallel,
/// row-parallel and replicated (norm) shapes, assigned to pipeline stages in order.
struct Tensor {
    key: TensorKey,
    dtype: DType,
    shape: Vec<u64>,
    split: Option<usize>,
    stage: u64,
}

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

/// The layout of a rank with tensor-parallel rank `t`, stage `s`, data-parallel rank `d`.
fn layout(m: &[Tensor], tp: u64, t: u64, s: u64, d: u64) -> RankLayout {
    let mut l = RankLayout::default();
    for x in m.iter().filter(|x| x.stage == s) {
        let mut region = Region::full(&x.shape);
        let main = match x.split {
            Some(axis) => {
                let size = x.shape[axis] / tp;
                region.offset[axis] = t * size;
                region.shape[axis] = size;
                d == 0
            }
            None => d == 0 && t == 0,
        };
        let idx = u32::try_from(l.tensors.len()).unwrap_or(u32::MAX);
        l.tensors.push(TensorDecl {
            key: x.key.clone(),
            dtype: x.dtype,
            global_shape: x.shape.clone(),
        });
        l.pieces.push(PieceDecl {
            tensor: idx,
            region,
            main,
            auto: false,
        });
    }
    l
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    for &world in &a.ranks {
        for &pp in &a.pp {
            if world % (a.tp * pp) != 0 {
                bail!(
                    "world size {world} is not a multiple of tp {} x pp {pp}",
                    a.tp
                );
            }
            let dp = world / (a.tp * pp);
            let m = model(a.tensors, pp);
            // Distinct layouts: (tp rank, stage, main or not); every rank's hash.
            // (tp rank, stage, main) -> (encoded layout, hash)
            type Distinct = HashMap<(u64, u64, bool), (Vec<u8>, [u8; 16])>;
            let mut distinct: Distinct = HashMap::new();
            let mut hashes = Vec::with_capacity(world as usize);
            let mut sizes = Vec::with_capacity(world as usize);
            for r in 0..world {
                let (t, s, d) = (r % a.tp, (r / a.tp) % pp, r / (a.tp * pp));
                let entry = distinct.entry((t, s, d == 0)).or_insert_with(|| {
                    let enc = layout(&m, a.tp, t, s, d).encode();
                    let h = RankLayout::hash_bytes(&enc);
                    (enc, h)
                });
                hashes.push(entry.1);
                sizes.push(entry.0.len());
            }
            let reps = GatheredLayouts::representatives(&hashes);
            let blobs: Vec<Vec<u8>> = (0..world as usize)
                .map(|r| {
                    if reps[r] {
                        let (t, s, d) = (
                            r as u64 % a.tp,
                            (r as u64 / a.tp) % pp,
                            r as u64 / (a.tp * pp),
                        );
                        distinct[&(t, s, d == 0)].0.clone()
                    } else {
                        Vec::new()
                    }
                })
                .collect();
            let gathered_bytes = world * 16 + blobs.iter().map(|b| b.len() as u64).sum::<u64>();
            let naive_bytes: u64 = sizes.iter().map(|&s| s as u64).sum();
            // One rank's planning: the last rank (a non-main data-parallel replica).
            let me = world - 1;
            let (t, s, d) = (me % a.tp, (me / a.tp) % pp, me / (a.tp * pp));
            let mut save_times = Vec::new();
            let mut load_times = Vec::new();
            let mut writes = 0;
            let mut shared = 0;
            let mut balance = 0.0;
            let mut repeat_times = Vec::new();
            let mut repeat_reused = true;
            for _ in 0..a.reps {
                let t0 = Instant::now();
                let own = layout(&m, a.tp, t, s, d).encode();
                let _ = RankLayout::hash_bytes(&own);
                let g = GatheredLayouts::from_parts(&hashes, &blobs)?;
                let plan = SavePlan::build(&g, &SavePlanOptions::default())?;
                writes = plan
                    .tasks_for(u32::try_from(me).unwrap_or(u32::MAX))
                    .writes
                    .len();
                save_times.push(t0.elapsed().as_secs_f64());
                balance = plan.write_balance();
                // A repeated save of the same structure: the plan agreed above is cached on
                // every rank; each rank sends its status byte and CHECK_LEN-byte check
                // message, receives everyone's, and reuses the plan if nothing changed.
                let cached = CachedPlan::new(
                    SavePlanOptions::default(),
                    hashes.clone(),
                    std::sync::Arc::new(plan.clone()),
                );
                let msgs: Vec<Vec<u8>> = hashes
                    .iter()
                    .map(|h| {
                        let mut m = vec![0u8];
                        m.extend_from_slice(&cache::check_message(Some(&cached), *h));
                        m
                    })
                    .collect();
                let t0 = Instant::now();
                let own = layout(&m, a.tp, t, s, d).encode();
                let own_hash = RankLayout::hash_bytes(&own);
                let mut mine = vec![0u8];
                mine.extend_from_slice(&cache::check_message(Some(&cached), own_hash));
                let refs: Vec<&[u8]> = msgs.iter().map(|m| &m[1..]).collect();
                let outcome = cache::decide(Some(&cached), &refs)?;
                repeat_reused &=
                    matches!(outcome, CheckOutcome::Unchanged(_)) && mine == msgs[me as usize];
                let again = cached
                    .plan()
                    .tasks_for(u32::try_from(me).unwrap_or(u32::MAX))
                    .writes
                    .len();
                repeat_times.push(t0.elapsed().as_secs_f64());
                if again != writes {
                    bail!("the reused plan gives rank {me} {again} writes, the full one {writes}");
                }
                // The load side: the same layout asked back, each box read once per group.
                let geoms: HashMap<&TensorKey, StoredGeometry> = plan
                    .tensors
                    .iter()
                    .map(|tp| {
                        let g = StoredGeometry {
                            global_shape: tp.global_shape.clone(),
                            chunk_shape: tp.chunk_shape.clone(),
                            subchunk_shape: tp.subchunk_shape.clone(),
                            elem: tp.dtype.size(),
                        };
                        (&tp.key, g)
                    })
                    .collect();
                let t0 = Instant::now();
                let g = GatheredLayouts::from_parts(&hashes, &blobs)?;
                let ex = ExchangePlan::build(&g, |k| geoms.get(k).cloned());
                load_times.push(t0.elapsed().as_secs_f64());
                shared = ex.reads.len();
            }
            let row = json!({
                "world": world, "tp": a.tp, "pp": pp, "dp": dp, "tensors": a.tensors,
                "pieces_per_rank": a.tensors / pp, "distinct_layouts": distinct.len(),
                "gathered_bytes": gathered_bytes, "gathered_bytes_without_dedup": naive_bytes,
                "save_plan_secs": median(save_times), "load_plan_secs": median(load_times),
                "rank_writes": writes, "write_balance": balance, "shared_reads": shared,
                "repeat_save_sent_bytes": 1 + CHECK_LEN, "repeat_save_received_bytes": world * (1 + CHECK_LEN as u64),
                "repeat_save_plan_secs": median(repeat_times), "repeat_save_reused": repeat_reused,
            });
            if !a.json {
                println!(
                    "world {world:>5} (tp {} x pp {pp} x dp {dp}), {} tensors ({} per rank): gathers {:.2} MB ({} distinct layouts; {:.1} MB without de-duplication); save plan {:.3} s, load plan {:.3} s per rank; write balance {balance:.3}",
                    a.tp,
                    a.tensors,
                    a.tensors / pp,
                    gathered_bytes as f64 / 1e6,
                    distinct.len(),
                    naive_bytes as f64 / 1e6,
                    row["save_plan_secs"].as_f64().unwrap_or(0.0),
                    row["load_plan_secs"].as_f64().unwrap_or(0.0),
                );
                println!(
                    "             repeated save of the same structure: each rank sends {} B (one all-gather), receives {:.1} KB; plan {:.3} ms per rank (plan reused: {repeat_reused})",
                    1 + CHECK_LEN,
                    (world * (1 + CHECK_LEN as u64)) as f64 / 1e3,
                    row["repeat_save_plan_secs"].as_f64().unwrap_or(0.0) * 1e3,
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
