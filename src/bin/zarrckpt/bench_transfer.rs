//! `zarrckpt bench-transfer`: live weight transfer (spec § 20) measured against the machine's
//! own limits in the same run: a synthetic Llama-shaped model held by trainer ranks at TP x PP
//! goes to vLLM TP engine ranks (threads of this process, over `TcpComm` on 127.0.0.1); the
//! same bytes in the same rounds are then moved by the transport's raw point-to-point exchange
//! (no packing, no copying into buffers). Also: bytes sent by the busiest trainer rank against
//! its share, the agreement bytes of a repeated (cached) transfer, and planning alone for a
//! DeepSeek-V3-shaped job (PP 16 x EP 16 trainer -> vLLM TP 32), per rank as each rank plans.
//! The raw exchange runs three ways: the transfer's own messages (a box of at least 64 KiB
//! alone), one message per pair and round, and one message per pair.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use zarrckpt::comm::{CommError, Communicator, RecvBuf, SendBuf, TcpComm, TcpConfig, TcpMaster};
use zarrckpt::convert::geom::Bx;
use zarrckpt::convert::{self, Layout, Table};
use zarrckpt::transfer::rank as tplan_rank;
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
    /// Only the live transfer (no DeepSeek-V3 planning).
    #[arg(long, conflicts_with = "plan_only")]
    live_only: bool,
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

/// CPU seconds this thread has used (user and system): planning's cost apart from the
/// machine's load.
fn thread_cpu() -> f64 {
    // SAFETY: `getrusage` fills the zeroed struct it is given and reads nothing else.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &raw mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One rank's figures in the live benchmark.
#[derive(Default)]
struct Timed {
    transfer: Vec<f64>,
    frames: Vec<f64>,
    raw: Vec<f64>,
    raw1: Vec<f64>,
    plan: f64,
    rounds: usize,
    sent: u64,
    busiest: u64,
    total: u64,
}

/// Rounds of (peer, bytes) sent and (peer, bytes) received.
type Msgs = Vec<(Vec<(usize, u64)>, Vec<(usize, u64)>)>;

/// Times the raw exchange of `msgs` (buffers allocated and written before the clock starts).
fn time_raw(comm: &dyn Communicator, msgs: &Msgs) -> anyhow::Result<f64> {
    let n = |v: &[(usize, u64)]| usize::try_from(v.iter().map(|x| x.1).sum::<u64>()).unwrap_or(0);
    let most_out = msgs
        .iter()
        .flat_map(|(s, _)| s.iter().map(|x| x.1))
        .max()
        .unwrap_or(0);
    let most_in = msgs.iter().map(|(_, r)| n(r)).max().unwrap_or(0);
    let out = vec![1u8; usize::try_from(most_out).unwrap_or(0)];
    // Written before the clock starts, as the transfer's buffers are (a zeroed allocation is
    // only mapped on first write: its page faults would be timed otherwise).
    let mut inb = vec![1u8; most_in];
    let t = Instant::now();
    for (s, r) in msgs {
        let sends: Vec<SendBuf<'_>> = s
            .iter()
            .map(|(p, k)| SendBuf {
                peer: *p,
                data: &out[..usize::try_from(*k).unwrap_or(0)],
            })
            .collect();
        let mut rest = inb.as_mut_slice();
        let mut recvs = Vec::with_capacity(r.len());
        for (p, k) in r {
            let (head, tail) = rest.split_at_mut(usize::try_from(*k).unwrap_or(0));
            recvs.push(RecvBuf {
                peer: *p,
                buf: head,
            });
            rest = tail;
        }
        comm.exchange(&sends, &mut recvs)?;
    }
    Ok(t.elapsed().as_secs_f64())
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
    // Engine declarations: what the table gives each TP rank.
    let inv: convert::Inventory = m
        .iter()
        .map(|(k, (s, ..))| (k.clone(), ("bfloat16".to_string(), s.clone())))
        .collect();
    let conv = convert::plan_vllm(&table, &cfg, l, &inv, a.engine_tp)?;
    let engine_decl: Vec<Vec<EngineTensor>> = (0..ne)
        .map(|e| {
            conv.dests
                .iter()
                .filter(|d| d.group == e % usize::try_from(a.engine_tp).unwrap_or(1))
                .map(|d| EngineTensor::new(&d.name, d.dtype, d.shape.clone()))
                .collect()
        })
        .collect();
    let model_bytes: u64 = inv
        .values()
        .map(|(_, s)| s.iter().product::<u64>() * 2)
        .sum();
    drop(conv);
    let held: Vec<u64> = per_rank
        .iter()
        .map(|bs| bs.iter().filter(|x| x.2).map(|x| x.1.volume() * 2).sum())
        .collect();
    let results = run_tcp(world, |c| -> anyhow::Result<Timed> {
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
        let mut out = Timed::default();
        for step in 0..=a.rounds {
            comm.barrier()?;
            let t0 = Instant::now();
            let rep = if me < nt {
                t.send(&comm, &pieces)?
            } else {
                let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                t.receive(&comm, &engine_decl[me - nt], &mut refs)?
            };
            let el = t0.elapsed().as_secs_f64();
            if step == 0 {
                out.plan = rep.plan_time.as_secs_f64();
                out.rounds = rep.rounds;
                out.sent = rep.moved.sent;
                out.busiest = rep.busiest_sent;
                out.total = rep.total_bytes;
            }
            let lp = t.local_plan().context("no plan")?;
            let msgs: Vec<_> = (0..lp.rounds()).map(|r| lp.messages(r)).collect();
            let frames: Vec<_> = (0..lp.rounds()).map(|r| lp.frames(r)).collect();
            comm.barrier()?;
            // The raw exchange of the transfer's own messages, round after round.
            let raw_frames = time_raw(&comm, &frames)?;
            comm.barrier()?;
            // The raw exchange of the same bytes in the same rounds, one round after the other.
            let raw = time_raw(&comm, &msgs)?;
            comm.barrier()?;
            // The raw exchange of the same bytes in one message per pair.
            let mut whole: BTreeMap<usize, u64> = BTreeMap::new();
            let mut whole_in: BTreeMap<usize, u64> = BTreeMap::new();
            for (s, r) in &msgs {
                for (p, n) in s {
                    *whole.entry(*p).or_default() += n;
                }
                for (p, n) in r {
                    *whole_in.entry(*p).or_default() += n;
                }
            }
            let one = vec![(
                whole.into_iter().collect::<Vec<_>>(),
                whole_in.into_iter().collect::<Vec<_>>(),
            )];
            let raw1 = time_raw(&comm, &one)?;
            if step > 0 {
                out.transfer.push(el);
                out.frames.push(raw_frames);
                out.raw.push(raw);
                out.raw1.push(raw1);
            }
        }
        Ok(out)
    })?;
    let results: Vec<Timed> = results.into_iter().collect::<anyhow::Result<_>>()?;
    let total = results[0].total;
    let (busiest, bsent) = results[..nt]
        .iter()
        .enumerate()
        .max_by_key(|x| x.1.sent)
        .map(|(r, x)| (r, x.sent))
        .unwrap_or((0, 0));
    println!(
        "transfer: Llama-shaped {:.2} GB (hidden {}, {} layers) from trainer TP{} x PP{} ({nt} ranks) to vLLM TP{} ({ne} ranks), bucket {} bytes: per-rank plans in at most {:.3} s, at most {} rounds on a rank",
        gb(model_bytes),
        a.hidden,
        a.layers,
        a.tp,
        a.pp,
        a.engine_tp,
        bucket,
        results.iter().map(|r| r.plan).fold(0.0, f64::max),
        results.iter().map(|r| r.rounds).max().unwrap_or(0),
    );
    println!(
        "  bytes sent: total {:.3} GB; busiest trainer rank {busiest} sends {:.3} GB (agreed busiest {:.3} GB) = {:.3} x the average share ({:.3} GB) and {:.3} x what it holds as main replica ({:.3} GB); an all-gather-then-send design sends {} x its share from the gathering rank",
        gb(total),
        gb(bsent),
        gb(results[0].busiest),
        bsent as f64 / (total as f64 / nt as f64),
        gb(total / nt as u64),
        bsent as f64 / held[busiest].max(1) as f64,
        gb(held[busiest]),
        a.tp
    );
    // Per timed round, the slowest rank's time.
    let slowest = |f: &dyn Fn(&Timed) -> &Vec<f64>| -> Vec<f64> {
        (0..a.rounds)
            .map(|i| results.iter().map(|x| f(x)[i]).fold(0.0, f64::max))
            .collect()
    };
    let tt = median(slowest(&|x| &x.transfer));
    let ft = median(slowest(&|x| &x.frames));
    let rt = median(slowest(&|x| &x.raw));
    let r1 = median(slowest(&|x| &x.raw1));
    println!(
        "  throughput (cached plan, TcpComm on 127.0.0.1, median of {}, slowest rank): transfer {tt:.3} s = {:.2} GB/s; raw point-to-point of the transfer's own messages in the same rounds {ft:.3} s = {:.2} GB/s (transfer / raw = {:.0}%); of the same bytes in one message per pair and round {rt:.3} s = {:.2} GB/s (transfer / raw = {:.0}%); in one message per pair {r1:.3} s = {:.2} GB/s (transfer / raw = {:.0}%; target 80% of each)",
        a.rounds,
        gb(total) / tt,
        gb(total) / ft,
        100.0 * ft / tt,
        gb(total) / rt,
        100.0 * rt / tt,
        gb(total) / r1,
        100.0 * r1 / tt
    );
    let mut agreement = 0u64;
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
        "  repeated transfer agreement: at most {agreement} bytes received per rank (a 9-byte all-reduce over the tree before the rounds, a 1-byte one after)"
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
    drop(ex);
    // What every rank holds after the gather: each rank's declaration as it was sent.
    let gathered: Vec<Vec<u8>> = decls
        .iter()
        .map(serde_json::to_vec)
        .collect::<Result<_, _>>()?;
    drop(decls);
    let decl_bytes: usize = gathered.iter().map(Vec::len).sum();
    println!(
        "DeepSeek-V3 transfer planning (no data): trainer PP16 x EP16 (256 ranks) -> vLLM TP32 (32 ranks), bucket 512 MiB; gathered declarations {:.1} MiB (every rank receives them once per structure)",
        decl_bytes as f64 / f64::from(1 << 20)
    );
    // Per rank, as `Transfer` does it: parse the gathered declarations, build this rank's
    // part, schedule it (the fan: the largest number of peers, the engine ranks' 256).
    let mut fan = 0;
    for (what, me) in [
        ("engine rank 0", 256usize),
        ("trainer rank 0 (stage 0, embedding)", 0),
        ("trainer rank 255 (last stage, head and MTP)", 255),
        ("trainer rank 100", 100),
    ] {
        let t0 = Instant::now();
        let c0 = thread_cpu();
        let (lp, peak) = peak_of(|| -> anyhow::Result<_> {
            let decls: Vec<Decl> = gathered
                .iter()
                .map(|b| serde_json::from_slice(b))
                .collect::<Result<_, _>>()?;
            let rp = tplan_rank::build_rank(&opts, &decls, me)?;
            drop(decls);
            fan = fan.max(rp.fan as u64);
            let sent = rp.bytes_sent();
            let moves = rp.moves.len();
            let lp = zarrckpt::transfer::LocalPlan::schedule(&rp, (512 << 20) / fan.max(1), 0, 0);
            Ok((lp, moves, sent))
        });
        let (lp, moves, sent) = lp?;
        let secs = t0.elapsed().as_secs_f64();
        let cpu = thread_cpu() - c0;
        println!(
            "  {what}: planned in {secs:.3} s wall, {cpu:.3} s CPU (target < 1 s), peak heap {:.1} MiB with the gathered declarations' parse (target < 64 MiB), {moves} moves, {} rounds, sends {:.2} GB, receives {:.2} GB",
            peak as f64 / f64::from(1 << 20),
            lp.rounds(),
            gb(sent),
            gb(lp.bytes_received())
        );
    }
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
    if !a.live_only {
        plan_deepseek()?;
    }
    Ok(ExitCode::SUCCESS)
}
