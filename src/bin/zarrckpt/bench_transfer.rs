//! `zarrckpt bench-transfer`: live weight transfer (spec § 20) measured against the machine's
//! own limits in the same run: a synthetic Llama-shaped model held by trainer ranks at TP x PP
//! goes to vLLM TP engine ranks (threads of this process, over `TcpComm` on 127.0.0.1); the
//! same bytes in the same rounds are then moved by the transport's raw point-to-point exchange
//! (no packing, no copying into buffers). Also: bytes sent by the busiest trainer rank against
//! its share, the agreement bytes of a repeated (cached) transfer, and planning alone for a
//! DeepSeek-V3-shaped job (PP 16 x EP 16 trainer -> vLLM TP 32).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use zarrckpt::comm::{CommError, Communicator, RecvBuf, SendBuf, TcpComm, TcpConfig, TcpMaster};
use zarrckpt::convert::geom::Bx;
use zarrckpt::convert::{self, Layout, Table};
use zarrckpt::transfer::plan::{self as tplan, GlobalPlan};
use zarrckpt::transfer::{
    Decl, EngineLayout, EngineTensor, Holder, Options, Role, SourceBox, Transfer,
};
use zarrckpt::{DType, Region, ShardedTensor, TensorKey};

use crate::bench_plan::peak_of;

/// Arguments of `zarrckpt bench-transfer`.
#[derive(clap::Args)]
pub struct Args {
    /// Hidden size of the synthetic Llama model (ffn 4x hidden, 16 heads, 4 kv heads, vocab
    /// 32000; hidden 1024 with 8 layers is about 0.37 GB in bf16).
    #[arg(long, default_value_t = 1024)]
    hidden: u64,
    /// Layers.
    #[arg(long, default_value_t = 8)]
    layers: u64,
    /// Trainer TP.
    #[arg(long, default_value_t = 2)]
    tp: u64,
    /// Trainer PP.
    #[arg(long, default_value_t = 2)]
    pp: u64,
    /// Engine (vLLM) TP.
    #[arg(long, default_value_t = 2)]
    engine_tp: u64,
    /// Bucket size (bytes a rank sends / receives per round), e.g. 64MiB, 512MiB.
    #[arg(long, default_value = "64MiB")]
    bucket: String,
    /// Timed transfers (each followed by a raw exchange of the same bytes); medians reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Only the DeepSeek-V3 planning benchmark.
    #[arg(long)]
    plan_only: bool,
}

/// A communicator counting the bytes it receives through `exchange`; with `native` the
/// collectives are the inner communicator's own (uncounted), else the shared tree ones over
/// `exchange` (counted).
struct Counting<C> {
    inner: C,
    native: bool,
    received: AtomicU64,
}

impl<C: Communicator> Communicator for Counting<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        if self.native {
            return self.inner.all_gather(data);
        }
        zarrckpt::comm::collective::all_gather(self, data)
    }
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, CommError> {
        if self.native {
            return self.inner.broadcast(root, data);
        }
        zarrckpt::comm::collective::broadcast(self, root, data)
    }
    fn barrier(&self) -> Result<(), CommError> {
        if self.native {
            return self.inner.barrier();
        }
        zarrckpt::comm::collective::barrier(self)
    }
    fn all_reduce(
        &self,
        data: &[u8],
        merge: &zarrckpt::comm::Merge<'_>,
    ) -> Result<Vec<u8>, CommError> {
        if self.native {
            return self.inner.all_reduce(data, merge);
        }
        zarrckpt::comm::collective::all_reduce(self, data, merge)
    }
    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        let n: usize = recvs.iter().map(|r| r.buf.len()).sum();
        self.received.fetch_add(n as u64, Ordering::Relaxed);
        self.inner.exchange(sends, recvs)
    }
}

fn run_tcp<T: Send>(world: usize, f: impl Fn(TcpComm) -> T + Sync) -> anyhow::Result<Vec<T>> {
    let cfg = |rank: usize, port: u16| {
        let mut c = TcpConfig::new(rank, world, "127.0.0.1", port);
        c.timeout = Duration::from_secs(120);
        c
    };
    let master = TcpMaster::bind(cfg(0, 0)).context("bind 127.0.0.1")?;
    let port = master.port().context("port")?;
    std::thread::scope(|s| {
        let f = &f;
        let mut handles = vec![s.spawn(move || master.accept().map(f))];
        for r in 1..world {
            handles.push(s.spawn(move || TcpComm::connect(cfg(r, port)).map(f)));
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a rank panicked"))?
                    .context("TcpComm")
            })
            .collect()
    })
}

/// Megatron global tensors of the synthetic model: key -> (shape, stack axes, TP axis and
/// parts).
type Model = BTreeMap<String, (Vec<u64>, usize, Option<(usize, u64)>)>;

fn model(table: &Table, cfg: &serde_json::Value, l: Layout) -> anyhow::Result<Model> {
    let ex = convert::expand(table, cfg, l)?;
    Ok(ex
        .m
        .iter()
        .map(|m| {
            (
                m.key.clone(),
                (
                    m.shape.clone(),
                    m.stack_axes,
                    m.tp.map(|t| (t.axis, t.parts)),
                ),
            )
        })
        .collect())
}

/// Trainer rank (t, p)'s boxes (key, box, main): layers split over PP, TP tensors in `parts`
/// segments each split over TP; the others held by every rank, main on TP rank 0; unstacked
/// tensors (embedding, head, final norm) main on the first stage.
fn boxes(m: &Model, l: Layout, t: u64, p: u64) -> Vec<(String, Bx, bool)> {
    let mut out = Vec::new();
    for (k, (shape, stack, tp)) in m {
        let mut b = Bx::full(shape);
        if *stack > 0 {
            let per = shape[0] / l.pp;
            b.off[0] = p * per;
            b.len[0] = per;
        }
        match tp {
            Some((axis, parts)) => {
                let seg = shape[*axis] / parts;
                let w = seg / l.tp;
                for q in 0..*parts {
                    let mut c = b.clone();
                    c.off[*axis] = q * seg + t * w;
                    c.len[*axis] = w;
                    out.push((k.clone(), c, *stack > 0 || p == 0));
                }
            }
            None => out.push((k.clone(), b, t == 0 && (*stack > 0 || p == 0))),
        }
    }
    out
}

fn decl(opts: &Options, bx: &[(String, Bx, bool)], m: &Model) -> Decl {
    Decl {
        options: opts.fingerprint(),
        role: Role::Trainer(
            bx.iter()
                .map(|(k, b, main)| SourceBox {
                    key: k.clone(),
                    dtype: "bfloat16".into(),
                    global_shape: m[k].0.clone(),
                    off: b.off.clone(),
                    len: b.len.clone(),
                    holder: if *main { Holder::Main } else { Holder::Copy },
                })
                .collect(),
        ),
        error: None,
    }
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The engine ranks' tensors, from the plan.
fn engine_tensors(g: &GlobalPlan, rank: usize) -> Vec<EngineTensor> {
    g.dest_of[&rank]
        .iter()
        .map(|&i| {
            let d = &g.conv.dests[i];
            EngineTensor::new(&d.name, d.dtype, d.shape.clone())
        })
        .collect()
}

/// Per round, per (src, dst): the bytes the plan moves.
fn schedule(g: &GlobalPlan) -> Vec<BTreeMap<(usize, usize), u64>> {
    let mut s = vec![BTreeMap::new(); g.rounds];
    for m in &g.moves {
        *s[m.round].entry((m.src, m.dst)).or_insert(0) += m.bytes;
    }
    s
}

fn live(a: &Args) -> anyhow::Result<()> {
    let bucket = convert::hf::parse_size(&a.bucket)?;
    let table = Table::builtin("llama")?;
    let cfg = serde_json::json!({"num_hidden_layers": a.layers, "hidden_size": a.hidden,
        "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 4 * a.hidden,
        "vocab_size": 32000, "tie_word_embeddings": false});
    let l = Layout {
        tp: a.tp,
        pp: a.pp,
        ep: 1,
    };
    let mut opts = Options::new(
        table.clone(),
        cfg.clone(),
        l,
        EngineLayout::Vllm { tp: a.engine_tp },
    );
    opts.bucket_bytes = bucket;
    let m = model(&table, &cfg, l)?;
    let nt = usize::try_from(a.tp * a.pp)?;
    let ne = usize::try_from(a.engine_tp)?;
    let world = nt + ne;
    // Every trainer rank's boxes and data (a byte pattern per rank).
    let per_rank: Vec<Vec<(String, Bx, bool)>> = (0..nt)
        .map(|r| boxes(&m, l, r as u64 % a.tp, r as u64 / a.tp))
        .collect();
    let data: Vec<Vec<Vec<u8>>> = per_rank
        .iter()
        .enumerate()
        .map(|(r, bs)| {
            bs.iter()
                .map(|(_, b, _)| {
                    vec![
                        u8::try_from(r % 251).unwrap_or(0);
                        usize::try_from(b.volume() * 2).unwrap_or(0)
                    ]
                })
                .collect()
        })
        .collect();
    // The global plan, built here once for the engine declarations and the raw schedule
    // (each rank builds its own inside `Transfer`).
    let mut decls: Vec<Decl> = per_rank.iter().map(|b| decl(&opts, b, &m)).collect();
    // Engine declarations: what the table gives each TP rank.
    let inv: convert::Inventory = m
        .iter()
        .map(|(k, (s, ..))| (k.clone(), ("bfloat16".to_string(), s.clone())))
        .collect();
    let conv = convert::plan_vllm(&table, &cfg, l, &inv, a.engine_tp)?;
    for e in 0..ne {
        decls.push(Decl {
            options: opts.fingerprint(),
            role: Role::Engine(
                conv.dests
                    .iter()
                    .filter(|d| d.group == e)
                    .map(|d| EngineTensor::new(&d.name, d.dtype, d.shape.clone()))
                    .collect(),
            ),
            error: None,
        });
    }
    let t0 = Instant::now();
    let g = tplan::build(&opts, decls)?;
    let plan_s = t0.elapsed().as_secs_f64();
    let sched = schedule(&g);
    let sent = g.sent_per_rank();
    let total: u64 = sent.iter().sum();
    let held: Vec<u64> = per_rank
        .iter()
        .map(|bs| bs.iter().filter(|x| x.2).map(|x| x.1.volume() * 2).sum())
        .collect();
    let (busiest, bsent) = sent[..nt]
        .iter()
        .enumerate()
        .max_by_key(|x| *x.1)
        .map(|(r, s)| (r, *s))
        .unwrap_or((0, 0));
    println!(
        "transfer: Llama-shaped {:.2} GB (hidden {}, {} layers) from trainer TP{} x PP{} ({nt} ranks) to vLLM TP{} ({ne} ranks), bucket {} bytes: {} rounds, planned in {plan_s:.3} s",
        gb(inv
            .values()
            .map(|(_, s)| s.iter().product::<u64>() * 2)
            .sum()),
        a.hidden,
        a.layers,
        a.tp,
        a.pp,
        a.engine_tp,
        bucket,
        g.rounds
    );
    println!(
        "  bytes sent: total {:.3} GB; busiest trainer rank {busiest} sends {:.3} GB = {:.3} x the average share ({:.3} GB) and {:.3} x what it holds as main replica ({:.3} GB); an all-gather-then-send design sends {} x its share from the gathering rank",
        gb(total),
        gb(bsent),
        bsent as f64 / (total as f64 / nt as f64),
        gb(total / nt as u64),
        bsent as f64 / held[busiest].max(1) as f64,
        gb(held[busiest]),
        a.tp
    );
    let engine_decl: Vec<Vec<EngineTensor>> = (nt..world).map(|r| engine_tensors(&g, r)).collect();
    let mut tr_times = Vec::new();
    let mut raw_times = Vec::new();
    let mut agreement = 0u64;
    let results = run_tcp(world, |c| -> anyhow::Result<(Vec<f64>, Vec<f64>, u64)> {
        let comm = Counting {
            inner: c,
            native: true,
            received: AtomicU64::new(0),
        };
        let me = comm.rank();
        let mut t = Transfer::new(opts.clone());
        let pieces: Vec<ShardedTensor<'_>> = if me < nt {
            per_rank[me]
                .iter()
                .zip(&data[me])
                .map(|((k, b, main), d)| {
                    ShardedTensor::new(
                        TensorKey::new(k)?,
                        DType::BFloat16,
                        m[k].0.clone(),
                        Region::new(b.off.clone(), b.len.clone())?,
                        u32::from(!*main),
                        d,
                    )
                    .map_err(anyhow::Error::from)
                })
                .collect::<anyhow::Result<_>>()?
        } else {
            Vec::new()
        };
        let mut bufs: Vec<Vec<u8>> = if me >= nt {
            engine_decl[me - nt]
                .iter()
                .map(|t| {
                    vec![0u8; usize::try_from(t.shape.iter().product::<u64>() * 2).unwrap_or(0)]
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut tt = Vec::new();
        let mut rt = Vec::new();
        let agree = 0;
        for step in 0..=a.rounds {
            comm.barrier()?;
            let t0 = Instant::now();
            if me < nt {
                t.send(&comm, &pieces)?;
            } else {
                let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                t.receive(&comm, &engine_decl[me - nt], &mut refs)?;
            }
            let el = t0.elapsed().as_secs_f64();
            comm.barrier()?;
            // The raw exchange of the same bytes in the same rounds.
            let t1 = Instant::now();
            for round in &sched {
                let out: Vec<(usize, Vec<u8>)> = round
                    .iter()
                    .filter(|((s, _), _)| *s == me)
                    .map(|((_, d), n)| (*d, vec![1u8; usize::try_from(*n).unwrap_or(0)]))
                    .collect();
                let mut inb: Vec<(usize, Vec<u8>)> = round
                    .iter()
                    .filter(|((_, d), _)| *d == me)
                    .map(|((s, _), n)| (*s, vec![0u8; usize::try_from(*n).unwrap_or(0)]))
                    .collect();
                let sends: Vec<SendBuf<'_>> = out
                    .iter()
                    .map(|(p, d)| SendBuf { peer: *p, data: d })
                    .collect();
                let mut recvs: Vec<RecvBuf<'_>> = inb
                    .iter_mut()
                    .map(|(p, b)| RecvBuf {
                        peer: *p,
                        buf: b.as_mut_slice(),
                    })
                    .collect();
                comm.exchange(&sends, &mut recvs)?;
            }
            let raw = t1.elapsed().as_secs_f64();
            if step > 0 {
                tt.push(el);
                rt.push(raw);
            }
        }
        Ok((tt, rt, agree))
    })?;
    for r in results {
        let (tt, rt, ag) = r?;
        tr_times.push(tt);
        raw_times.push(rt);
        agreement = agreement.max(ag);
    }
    // Per timed round, the slowest rank's time.
    let slowest = |v: &[Vec<f64>]| -> Vec<f64> {
        (0..v[0].len())
            .map(|i| v.iter().map(|x| x[i]).fold(0.0, f64::max))
            .collect()
    };
    let tt = median(slowest(&tr_times));
    let rt = median(slowest(&raw_times));
    println!(
        "  throughput (cached plan, TcpComm on 127.0.0.1, median of {}): transfer {tt:.3} s = {:.2} GB/s; raw point-to-point of the same bytes in the same rounds {rt:.3} s = {:.2} GB/s; transfer / raw = {:.0}%",
        a.rounds,
        gb(total) / tt,
        gb(total) / rt,
        100.0 * rt / tt
    );
    // The agreement of a repeated transfer, counted over the shared tree collectives.
    let counted = zarrckpt::run_local(
        world,
        Duration::from_secs(120),
        |c| -> anyhow::Result<u64> {
            let comm = Counting {
                inner: c,
                native: false,
                received: AtomicU64::new(0),
            };
            let me = comm.rank();
            let mut t = Transfer::new(opts.clone());
            let mut out = 0;
            for step in 0..2 {
                let before = comm.received.load(Ordering::Relaxed);
                let data_in = if me < nt {
                    let pieces: Vec<ShardedTensor<'_>> = per_rank[me]
                        .iter()
                        .zip(&data[me])
                        .map(|((k, b, main), d)| {
                            ShardedTensor::new(
                                TensorKey::new(k)?,
                                DType::BFloat16,
                                m[k].0.clone(),
                                Region::new(b.off.clone(), b.len.clone())?,
                                u32::from(!*main),
                                d,
                            )
                            .map_err(anyhow::Error::from)
                        })
                        .collect::<anyhow::Result<_>>()?;
                    t.send(&comm, &pieces)?;
                    0
                } else {
                    let mut bufs: Vec<Vec<u8>> = engine_decl[me - nt]
                        .iter()
                        .map(|t| {
                            vec![
                                0u8;
                                usize::try_from(t.shape.iter().product::<u64>() * 2).unwrap_or(0)
                            ]
                        })
                        .collect();
                    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                    t.receive(&comm, &engine_decl[me - nt], &mut refs)?
                        .moved
                        .received
                };
                if step == 1 {
                    out = comm.received.load(Ordering::Relaxed) - before - data_in;
                }
            }
            Ok(out)
        },
    );
    for c in counted {
        agreement = agreement.max(c?);
    }
    println!(
        "  repeated transfer agreement: at most {agreement} bytes received per rank (one 9-byte all-reduce over the tree)"
    );
    Ok(())
}

/// Planning alone for DeepSeek-V3 (671B): trainer PP 16 x EP 16 (256 ranks) -> vLLM TP 32.
fn plan_deepseek() -> anyhow::Result<()> {
    let cfg = serde_json::json!({"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "num_nextn_predict_layers": 1, "tie_word_embeddings": false});
    let table = Table::builtin("deepseek_v3")?;
    let l = Layout {
        tp: 1,
        pp: 16,
        ep: 16,
    };
    let ex = convert::expand(&table, &cfg, l)?;
    let opts = Options::new(table.clone(), cfg.clone(), l, EngineLayout::Vllm { tp: 32 });
    // Trainer rank (p, e): the layers of stage p (by the layer number in the key, `mtp` with
    // the last stage), experts split over EP, everything else replicated over the stage's EP
    // ranks (`auto`).
    let layers = 61u64;
    let stage = |key: &str| -> u64 {
        if key.starts_with("mtp.") {
            return 15;
        }
        if key.starts_with("embedding.") {
            return 0;
        }
        if key.starts_with("output_layer") || key.starts_with("decoder.final") {
            return 15;
        }
        key.strip_prefix("decoder.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<u64>().ok())
            .map_or(0, |i| i * 16 / layers)
    };
    let mut decls = Vec::new();
    for r in 0..256u64 {
        let (p, e) = (r / 16, r % 16);
        let mut bx = Vec::new();
        for m in &ex.m {
            if stage(&m.key) != p {
                continue;
            }
            let mut b = Bx::full(&m.shape);
            // Replicated over the EP group: declared `auto`, one holder per box sends.
            let mut holder = Holder::Auto;
            if let Some(a) = m.ep_axis {
                let per = m.shape[a] / 16;
                b.off[a] = e * per;
                b.len[a] = per;
                holder = Holder::Main;
            }
            bx.push(SourceBox {
                key: m.key.clone(),
                dtype: "bfloat16".into(),
                global_shape: m.shape.clone(),
                off: b.off,
                len: b.len,
                holder,
            });
        }
        decls.push(Decl {
            options: opts.fingerprint(),
            role: Role::Trainer(bx),
            error: None,
        });
    }
    let inv: convert::Inventory =
        ex.m.iter()
            .map(|m| (m.key.clone(), ("bfloat16".to_string(), m.shape.clone())))
            .collect();
    let conv = convert::plan_vllm(&table, &cfg, l, &inv, 32)?;
    for e in 0..32 {
        decls.push(Decl {
            options: opts.fingerprint(),
            role: Role::Engine(
                conv.dests
                    .iter()
                    .filter(|d| d.group == e)
                    .map(|d| EngineTensor::new(&d.name, d.dtype, d.shape.clone()))
                    .collect(),
            ),
            error: None,
        });
    }
    drop(conv);
    let decl_bytes: usize = decls
        .iter()
        .map(|d| serde_json::to_vec(d).map_or(0, |v| v.len()))
        .sum();
    let t0 = Instant::now();
    let (g, peak) = peak_of(|| tplan::build(&opts, decls));
    let g = g?;
    let secs = t0.elapsed().as_secs_f64();
    let (lp0, peak0) = peak_of(|| zarrckpt::transfer::LocalPlan::of(&g, 0));
    let (lpe, peake) = peak_of(|| zarrckpt::transfer::LocalPlan::of(&g, 256));
    let sent = g.sent_per_rank();
    let total: u64 = sent.iter().sum();
    let busiest = sent.iter().copied().max().unwrap_or(0);
    println!(
        "DeepSeek-V3 transfer planning (no data): trainer PP16 x EP16 (256 ranks) -> vLLM TP32 (32 ranks): {} moves in {} rounds of 512 MiB, built (every rank builds the same) in {secs:.2} s, peak heap {:.1} MiB; declarations gathered {:.1} MiB in all",
        g.moves.len(),
        g.rounds,
        peak as f64 / f64::from(1 << 20),
        decl_bytes as f64 / f64::from(1 << 20),
    );
    println!(
        "  kept per rank: trainer rank 0 {} rounds, {:.1} MiB extracted; engine rank 0 {:.1} MiB; bytes moved {:.1} GB, busiest trainer rank {:.2} GB = {:.2} x the average share",
        lp0.rounds(),
        peak0 as f64 / f64::from(1 << 20),
        peake as f64 / f64::from(1 << 20),
        gb(total),
        gb(busiest),
        busiest as f64 / (total as f64 / 256.0)
    );
    drop(lpe);
    Ok(())
}

/// Runs the benchmark.
///
/// # Errors
/// Planning, communication and transfer errors.
pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    if !a.plan_only {
        live(a)?;
    }
    plan_deepseek()?;
    Ok(ExitCode::SUCCESS)
}
