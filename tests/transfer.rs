//! Live weight transfer (spec § 20) between two worlds of threads over `LocalComm`: trainer
//! ranks holding Megatron boxes (TP x PP, as the table's expansion lays the tensors out) send
//! to engine ranks holding vLLM TP buffers or whole HF tensors. The reference is the
//! conversion engine's own fill from whole Megatron tensors (`fill_from_sources`, the piece
//! copy `export` uses).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::json;
use zarrckpt::comm::{RecvBuf, SendBuf};
use zarrckpt::convert::geom::Bx;
use zarrckpt::convert::{self, Layout, Plan, Table};
use zarrckpt::transfer::plan::{self as tplan, Move};
use zarrckpt::transfer::{
    Decl, EngineLayout, EngineTensor, Holder, LocalPlan, Options, RankPlan, Role, SourceBox,
    Transfer, TransferError, build_rank,
};
use zarrckpt::{
    CommError, Communicator, DType, LocalComm, Region, ShardedTensor, TensorKey, run_local,
};

const TIMEOUT: Duration = Duration::from_secs(20);

fn cfg() -> serde_json::Value {
    json!({"num_hidden_layers": 4, "hidden_size": 16, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 250,
           "tie_word_embeddings": false})
}

/// Global Megatron tensors (key -> (shape, bf16 bytes)) for a layout, values from `seed`.
fn megatron(table: &Table, c: &serde_json::Value, l: Layout, seed: u32) -> Model {
    let ex = convert::expand(table, c, l).unwrap();
    let mut tensors = BTreeMap::new();
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    for m in &ex.m {
        let n: u64 = m.shape.iter().product();
        let mut data = Vec::with_capacity(usize::try_from(n).unwrap() * 2);
        for _ in 0..n {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let v = f32::from(u16::try_from(s >> 20).unwrap()) / 4096.0 - 0.5;
            data.extend_from_slice(&zarrckpt::half::bf16::from_f32(v).to_le_bytes());
        }
        let tp = m.tp.map(|t| (t.axis, t.parts));
        tensors.insert(m.key.clone(), (m.shape.clone(), m.stack_axes, tp, data));
    }
    Model { tensors }
}

type Entry = (Vec<u64>, usize, Option<(usize, u64)>, Vec<u8>);
/// A trainer box: key, offset, extent, replica id, bytes.
type TBox = (String, Vec<u64>, Vec<u64>, u32, Vec<u8>);
/// Engine tensors with their expected bytes.
type Want = Vec<(EngineTensor, Vec<u8>)>;
/// What a test does to an engine rank's declaration.
type DeclFn = dyn Fn(usize, Want) -> Want + Sync;
/// Per rank: per step the engine buffers, and the reports.
type Outcome = Result<(Vec<Vec<Vec<u8>>>, Vec<zarrckpt::transfer::Report>), TransferError>;

struct Model {
    tensors: BTreeMap<String, Entry>,
}

impl Model {
    fn inventory(&self) -> convert::Inventory {
        self.tensors
            .iter()
            .map(|(k, (s, ..))| (k.clone(), ("bfloat16".to_string(), s.clone())))
            .collect()
    }

    /// Trainer rank (t, p)'s boxes: stacked tensors cut by layer over PP, TP tensors cut in
    /// `parts` segments each split over TP (rank t holds slab t of every segment); other
    /// tensors whole on every rank, main on TP rank 0; unstacked tensors main on the first
    /// stage only (the other stages hold copies).
    fn boxes(&self, l: Layout, t: u64, p: u64) -> Vec<TBox> {
        let mut out = Vec::new();
        for (k, (shape, stack, tp, data)) in &self.tensors {
            let mut off = vec![0u64; shape.len()];
            let mut len = shape.clone();
            if *stack > 0 {
                let per = shape[0] / l.pp;
                off[0] = p * per;
                len[0] = per;
            }
            let mut segs = vec![(off.clone(), len.clone())];
            let mut replica = 0;
            match tp {
                Some((axis, parts)) => {
                    let seg = shape[*axis] / parts;
                    let w = seg / l.tp;
                    segs = (0..*parts)
                        .map(|q| {
                            let (mut o, mut n) = (off.clone(), len.clone());
                            o[*axis] = q * seg + t * w;
                            n[*axis] = w;
                            (o, n)
                        })
                        .collect();
                }
                None => {
                    if t != 0 {
                        replica = 1;
                    }
                }
            }
            // unstacked tensors (embedding, head, final norm): the first stage's are main
            if *stack == 0 && p != 0 {
                replica = 1;
            }
            for (o, n) in segs {
                let b = convert::geom::Bx { off: o, len: n };
                let mut buf = vec![0u8; usize::try_from(b.volume()).unwrap() * 2];
                convert::geom::copy_box(
                    data,
                    shape,
                    &b,
                    &mut buf,
                    &b.len,
                    &convert::geom::Bx::full(&b.len),
                    2,
                    false,
                );
                out.push((k.clone(), b.off, b.len, replica, buf));
            }
        }
        out
    }

    /// The engine buffers a conversion plan gives for `group` (vLLM rank), from whole sources.
    fn expected(&self, plan: &Plan, group: Option<usize>) -> Vec<(EngineTensor, Vec<u8>)> {
        let srcs: Vec<&[u8]> = plan
            .sources
            .iter()
            .map(|s| self.tensors[&s.name].3.as_slice())
            .collect();
        plan.dests
            .iter()
            .enumerate()
            .filter(|(_, d)| group.is_none_or(|g| d.group == g))
            .map(|(i, d)| {
                let mut buf = vec![0u8; usize::try_from(d.nbytes()).unwrap()];
                convert::fill_from_sources(plan, i, &|s| srcs[s], &mut buf).unwrap();
                (EngineTensor::new(&d.name, d.dtype, d.shape.clone()), buf)
            })
            .collect()
    }
}

fn pieces(boxes: &[TBox], m: &Model) -> Vec<ShardedTensor<'static>> {
    boxes
        .iter()
        .map(|(k, o, n, r, d)| {
            let data: &'static [u8] = Box::leak(d.clone().into_boxed_slice());
            ShardedTensor::new(
                TensorKey::new(k).unwrap(),
                DType::BFloat16,
                m.tensors[k].0.clone(),
                Region::new(o.clone(), n.clone()).unwrap(),
                *r,
                data,
            )
            .unwrap()
        })
        .collect()
}

/// Runs one transfer (trainer ranks first, then engine ranks) for each model in `steps` with
/// one `Transfer` per rank; returns per engine rank its buffers after each step, and every
/// rank's reports.
fn run_steps(
    trainer: Layout,
    engine: EngineLayout,
    engines: usize,
    bucket: u64,
    steps: &[&Model],
    decl: &DeclFn,
) -> Vec<Outcome> {
    let table = Table::builtin("llama").unwrap();
    let nt = usize::try_from(trainer.tp * trainer.pp).unwrap();
    let mut opts = Options::new(table.clone(), cfg(), trainer, engine);
    opts.bucket_bytes = bucket;
    run_local(nt + engines, TIMEOUT, |comm| {
        let mut tr = Transfer::new(opts.clone());
        let me = comm.rank();
        let mut bufs_per_step = Vec::new();
        let mut reports = Vec::new();
        for m in steps {
            if me < nt {
                let (t, p) = (me as u64 % trainer.tp, me as u64 / trainer.tp);
                let b = m.boxes(trainer, t, p);
                let ps = pieces(&b, m);
                reports.push(tr.send(&comm, &ps)?);
            } else {
                let e = me - nt;
                let inv = m.inventory();
                let plan = match engine {
                    EngineLayout::Vllm { tp } => {
                        convert::plan_vllm(&table, &cfg(), trainer, &inv, tp)
                    }
                    _ => convert::plan_hf_export(&table, &cfg(), trainer, &inv, u64::MAX),
                };
                let group = match engine {
                    EngineLayout::Vllm { tp } => Some(e % usize::try_from(tp).unwrap()),
                    _ => None,
                };
                let want = plan.map(|p| m.expected(&p, group)).unwrap_or_default();
                let want = decl(e, want);
                let tensors: Vec<EngineTensor> = want.iter().map(|(t, _)| t.clone()).collect();
                let mut bufs: Vec<Vec<u8>> = want
                    .iter()
                    .map(|(t, _)| {
                        let n: u64 = t.shape.iter().product();
                        vec![0xAB; usize::try_from(n).unwrap() * dsize(&t.dtype)]
                    })
                    .collect();
                let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                reports.push(tr.receive(&comm, &tensors, &mut refs)?);
                bufs_per_step.push(bufs);
            }
        }
        Ok((bufs_per_step, reports))
    })
}

fn dsize(name: &str) -> usize {
    DType::from_name(name).unwrap().size()
}

fn expected_per_engine(
    m: &Model,
    trainer: Layout,
    engine: EngineLayout,
    engines: usize,
) -> Vec<Vec<Vec<u8>>> {
    let table = Table::builtin("llama").unwrap();
    let inv = m.inventory();
    (0..engines)
        .map(|e| match engine {
            EngineLayout::Vllm { tp } => {
                let p = convert::plan_vllm(&table, &cfg(), trainer, &inv, tp).unwrap();
                m.expected(&p, Some(e % usize::try_from(tp).unwrap()))
            }
            _ => {
                let p = convert::plan_hf_export(&table, &cfg(), trainer, &inv, u64::MAX).unwrap();
                m.expected(&p, None)
            }
        })
        .map(|v| v.into_iter().map(|(_, b)| b).collect())
        .collect()
}

fn same(
    trainer: Layout,
    engine: EngineLayout,
    engines: usize,
    bucket: u64,
) -> Vec<zarrckpt::transfer::Report> {
    let table = Table::builtin("llama").unwrap();
    let m1 = megatron(&table, &cfg(), trainer, 1);
    let m2 = megatron(&table, &cfg(), trainer, 2);
    let res = run_steps(trainer, engine, engines, bucket, &[&m1, &m2], &|_, w| w);
    let nt = usize::try_from(trainer.tp * trainer.pp).unwrap();
    let want1 = expected_per_engine(&m1, trainer, engine, engines);
    let want2 = expected_per_engine(&m2, trainer, engine, engines);
    let mut reports = Vec::new();
    for (g, r) in res.into_iter().enumerate() {
        let (bufs, rep) = r.unwrap_or_else(|e| panic!("rank {g}: {e}"));
        assert!(rep[0].planned, "rank {g}: first step plans");
        assert!(!rep[1].planned, "rank {g}: second step reuses the plan");
        if g >= nt {
            let e = g - nt;
            assert_eq!(bufs[0], want1[e], "engine rank {e}, step 1");
            assert_eq!(bufs[1], want2[e], "engine rank {e}, step 2");
            assert_ne!(bufs[0], bufs[1]);
        }
        reports.push(rep[0]);
    }
    reports
}

/// Bytes the engine needs from the trainer (pieces' source bytes), per engine rank summed.
fn needed(trainer: Layout, engine: EngineLayout, engines: usize) -> u64 {
    let table = Table::builtin("llama").unwrap();
    let m = megatron(&table, &cfg(), trainer, 1);
    let inv = m.inventory();
    (0..engines)
        .map(|e| {
            let (p, g) = match engine {
                EngineLayout::Vllm { tp } => (
                    convert::plan_vllm(&table, &cfg(), trainer, &inv, tp).unwrap(),
                    Some(e % usize::try_from(tp).unwrap()),
                ),
                _ => (
                    convert::plan_hf_export(&table, &cfg(), trainer, &inv, u64::MAX).unwrap(),
                    None,
                ),
            };
            p.dests
                .iter()
                .filter(|d| g.is_none_or(|g| d.group == g))
                .flat_map(|d| &d.pieces)
                .map(|x| x.sbox.volume() * 2)
                .sum::<u64>()
        })
        .sum()
}

#[test]
fn tp2_pp2_to_vllm_tp2_then_cached_step() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    let e = EngineLayout::Vllm { tp: 2 };
    let reps = same(l, e, 2, 1 << 20);
    // every destination byte sent exactly once
    let sent: u64 = reps.iter().map(|r| r.moved.sent).sum();
    assert_eq!(sent, needed(l, e, 2));
    assert_eq!(reps[0].total_bytes, sent);
}

#[test]
fn small_buckets_split_boxes_and_take_rounds() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    let e = EngineLayout::Vllm { tp: 2 };
    let reps = same(l, e, 2, 100);
    assert!(reps[0].rounds > 20, "{} rounds", reps[0].rounds);
    let sent: u64 = reps.iter().map(|r| r.moved.sent).sum();
    assert_eq!(sent, needed(l, e, 2));
}

#[test]
fn tp2_pp2_to_vllm_tp1_tp4_and_two_replicas() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    same(l, EngineLayout::Vllm { tp: 1 }, 1, 1 << 20);
    // TP 4 > 2 kv heads: kv heads replicated on the engine
    same(l, EngineLayout::Vllm { tp: 4 }, 4, 1 << 20);
    // two engine replicas at TP 2: each gets every byte of its rank
    same(l, EngineLayout::Vllm { tp: 2 }, 4, 4096);
}

#[test]
fn tp1_pp4_to_whole_hf_tensors() {
    let l = Layout {
        tp: 1,
        pp: 4,
        ep: 1,
    };
    let reps = same(l, EngineLayout::Hf, 1, 1 << 20);
    let sent: Vec<u64> = reps.iter().map(|r| r.moved.sent).collect();
    // no trainer rank sends more than a little over its share: a PP stage sends its layers,
    // rank 0 also the embedding and head
    assert!(sent[..4].iter().all(|&s| s > 0), "{sent:?}");
}

#[test]
fn tp_sources_are_never_gathered() {
    // TP 2 trainer to one whole-tensor engine: each TP rank sends its own half of every split
    // tensor (a gather-then-send design would send all of it from one rank).
    let l = Layout {
        tp: 2,
        pp: 1,
        ep: 1,
    };
    let reps = same(l, EngineLayout::Hf, 1, 1 << 20);
    let (a, b) = (reps[0].moved.sent, reps[1].moved.sent);
    let total = reps[0].total_bytes;
    assert_eq!(a + b, total);
    // rank 0 also sends the replicated norms (main replica): a little over half
    assert!(a as f64 <= 0.55 * total as f64, "{a} of {total}");
    assert!(b as f64 >= 0.45 * total as f64, "{b} of {total}");
}

fn refusal(trainer: Layout, engine: EngineLayout, engines: usize, decl: &DeclFn) -> Vec<String> {
    let table = Table::builtin("llama").unwrap();
    let m = megatron(&table, &cfg(), trainer, 1);
    run_steps(trainer, engine, engines, 1 << 20, &[&m], decl)
        .into_iter()
        .enumerate()
        .map(|(g, r)| match r {
            Ok(_) => panic!("rank {g} was not refused"),
            Err(e) => e.to_string(),
        })
        .collect()
}

#[test]
fn heads_not_divisible_refused_on_every_rank() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    let msgs = refusal(l, EngineLayout::Vllm { tp: 3 }, 3, &|_, w| w);
    for m in &msgs {
        assert!(m.contains("vLLM tp") && m.contains('3'), "{m}");
    }
    assert!(msgs.iter().all(|m| *m == msgs[0]), "{msgs:?}");
}

#[test]
fn missing_engine_tensor_refused_on_every_rank() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    let msgs = refusal(l, EngineLayout::Vllm { tp: 2 }, 2, &|e, mut w| {
        if e == 1 {
            w.retain(|(t, _)| t.name != "model.layers.3.mlp.down_proj.weight");
        }
        w
    });
    for m in &msgs {
        assert!(
            m.contains("engine rank 1")
                && m.contains("model.layers.3.mlp.down_proj.weight")
                && m.contains("declares no buffer"),
            "{m}"
        );
    }
}

#[test]
fn engine_dtype_refused_and_shape_refused() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    let msgs = refusal(l, EngineLayout::Vllm { tp: 2 }, 2, &|e, mut w| {
        if e == 0 {
            w[0].0.dtype = "float16".into();
        }
        w
    });
    for m in &msgs {
        assert!(
            m.contains("float16") && m.contains("bfloat16") && m.contains("cast"),
            "{m}"
        );
    }
    let msgs = refusal(l, EngineLayout::Vllm { tp: 2 }, 2, &|e, mut w| {
        if e == 1 {
            w[1].0.shape[0] += 1;
        }
        w
    });
    for m in &msgs {
        assert!(m.contains("engine rank 1") && m.contains("shape"), "{m}");
    }
}

#[test]
fn uncovered_trainer_tensor_refused() {
    // every trainer rank marks its boxes of one tensor as copies: nobody holds it as main
    let l = Layout {
        tp: 2,
        pp: 1,
        ep: 1,
    };
    let table = Table::builtin("llama").unwrap();
    let m = megatron(&table, &cfg(), l, 1);
    let opts = Options::new(table.clone(), cfg(), l, EngineLayout::Hf);
    let plan = convert::plan_hf_export(&table, &cfg(), l, &m.inventory(), u64::MAX).unwrap();
    let want = m.expected(&plan, None);
    let res = run_local(3, TIMEOUT, |comm| {
        let mut tr = Transfer::new(opts.clone());
        if comm.rank() < 2 {
            let mut b = m.boxes(l, comm.rank() as u64, 0);
            for x in &mut b {
                if x.0 == "decoder.final_layernorm.weight" {
                    x.3 = 1;
                }
            }
            tr.send(&comm, &pieces(&b, &m)).map(|_| ())
        } else {
            let tensors: Vec<EngineTensor> = want.iter().map(|(t, _)| t.clone()).collect();
            let mut bufs: Vec<Vec<u8>> = want.iter().map(|(_, b)| b.clone()).collect();
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            tr.receive(&comm, &tensors, &mut refs).map(|_| ())
        }
    });
    for r in res {
        let m = r.unwrap_err().to_string();
        assert!(
            m.contains("decoder.final_layernorm.weight") && m.contains("0 of its 16"),
            "{m}"
        );
    }
}

/// A communicator whose exchanges fail after `after` calls, dropping the inner one (a rank
/// that dies mid-transfer).
struct Dying {
    inner: Mutex<Option<LocalComm>>,
    rank: usize,
    world: usize,
    after: Mutex<usize>,
}

impl Communicator for Dying {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn exchange(&self, sends: &[SendBuf<'_>], recvs: &mut [RecvBuf<'_>]) -> Result<(), CommError> {
        let mut n = self.after.lock().unwrap();
        if *n == 0 {
            drop(self.inner.lock().unwrap().take());
            return Err(CommError::Transport {
                op: "exchange",
                rank: self.rank,
                detail: "injected death".into(),
            });
        }
        *n -= 1;
        match self.inner.lock().unwrap().as_ref() {
            Some(c) => c.exchange(sends, recvs),
            None => Err(CommError::Transport {
                op: "exchange",
                rank: self.rank,
                detail: "dead".into(),
            }),
        }
    }
}

#[test]
fn a_rank_dying_mid_transfer_is_an_error_on_the_others() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    let table = Table::builtin("llama").unwrap();
    let m = megatron(&table, &cfg(), l, 1);
    let mut opts = Options::new(table.clone(), cfg(), l, EngineLayout::Vllm { tp: 2 });
    opts.bucket_bytes = 256;
    let plan = convert::plan_vllm(&table, &cfg(), l, &m.inventory(), 2).unwrap();
    let t0 = std::time::Instant::now();
    let res = run_local(6, Duration::from_secs(5), |comm| {
        let rank = comm.rank();
        // rank 1 dies after the planning collectives and a few rounds
        let c = Dying {
            rank,
            world: 6,
            inner: Mutex::new(Some(comm)),
            after: Mutex::new(if rank == 1 { 40 } else { usize::MAX }),
        };
        let mut tr = Transfer::new(opts.clone());
        if rank < 4 {
            let b = m.boxes(l, rank as u64 % 2, rank as u64 / 2);
            tr.send(&c, &pieces(&b, &m)).map(|_| ())
        } else {
            let want = m.expected(&plan, Some(rank - 4));
            let tensors: Vec<EngineTensor> = want.iter().map(|(t, _)| t.clone()).collect();
            let mut bufs: Vec<Vec<u8>> = want.iter().map(|(_, b)| b.clone()).collect();
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            tr.receive(&c, &tensors, &mut refs).map(|_| ())
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(30));
    // the dead rank and the engine rank it sends to (TP rank 1 of both layouts) fail in the
    // rounds; every other rank, its own part done or not, fails in the closing agreement
    assert!(
        matches!(res[1], Err(TransferError::Comm(_))),
        "{:?}",
        res[1]
    );
    assert!(
        matches!(res[5], Err(TransferError::Comm(_))),
        "{:?}",
        res[5]
    );
    for (rank, r) in res.iter().enumerate() {
        assert!(r.is_err(), "rank {rank} returned Ok although rank 1 died");
    }
}

#[test]
fn receive_with_hands_over_whole_tensors_in_buckets() {
    let l = Layout {
        tp: 2,
        pp: 1,
        ep: 1,
    };
    let table = Table::builtin("llama").unwrap();
    let m = megatron(&table, &cfg(), l, 5);
    let mut opts = Options::new(table.clone(), cfg(), l, EngineLayout::Hf);
    opts.bucket_bytes = 2048;
    let plan = convert::plan_hf_export(&table, &cfg(), l, &m.inventory(), u64::MAX).unwrap();
    let want = m.expected(&plan, None);
    let res = run_local(3, TIMEOUT, |comm| {
        let mut tr = Transfer::new(opts.clone());
        if comm.rank() < 2 {
            let b = m.boxes(l, comm.rank() as u64, 0);
            tr.send(&comm, &pieces(&b, &m)).map(|_| Vec::new())
        } else {
            let tensors: Vec<EngineTensor> = want.iter().map(|(t, _)| t.clone()).collect();
            let mut got = Vec::new();
            tr.receive_with(&comm, &tensors, &mut |bucket| {
                got.push(bucket);
                Ok(())
            })?;
            Ok(got)
        }
    });
    let buckets = res.into_iter().nth(2).unwrap().unwrap();
    assert!(buckets.len() > 3, "{} buckets", buckets.len());
    let mut seen = BTreeMap::new();
    for b in buckets {
        for r in b {
            assert!(
                seen.insert(r.name.clone(), r.data).is_none(),
                "{} twice",
                r.name
            );
        }
    }
    assert_eq!(seen.len(), want.len());
    for (t, b) in &want {
        assert_eq!(&seen[&t.name], b, "{}", t.name);
    }
}

/// The declarations of a transfer of the test model from `trainer` to `engines` engine ranks
/// at `engine`: replicated trainer boxes main on one rank (`auto` false) or declared `Auto` by
/// every holder; each engine rank's tensors in an order shuffled by `seed`.
fn declarations(
    opts: &Options,
    trainer: Layout,
    engine: EngineLayout,
    engines: usize,
    auto: bool,
    seed: u64,
) -> Vec<Decl> {
    let table = &opts.table;
    let m = megatron(table, &cfg(), trainer, 1);
    let mut decls = Vec::new();
    for r in 0..trainer.tp * trainer.pp {
        let (t, p) = (r % trainer.tp, r / trainer.tp);
        let sb = m
            .boxes(trainer, t, p)
            .into_iter()
            .map(|(k, off, len, replica, _)| {
                let replicated = m.tensors[&k].2.is_none() || m.tensors[&k].1 == 0;
                SourceBox {
                    dtype: "bfloat16".into(),
                    global_shape: m.tensors[&k].0.clone(),
                    key: k,
                    off,
                    len,
                    holder: match (replica, auto && replicated) {
                        (_, true) => Holder::Auto,
                        (0, false) => Holder::Main,
                        _ => Holder::Copy,
                    },
                }
            })
            .collect();
        decls.push(Decl {
            options: opts.fingerprint(),
            role: Role::Trainer(sb),
            error: None,
        });
    }
    let inv = m.inventory();
    let plan = match engine {
        EngineLayout::Vllm { tp } => convert::plan_vllm(table, &cfg(), trainer, &inv, tp),
        _ => convert::plan_hf_export(table, &cfg(), trainer, &inv, u64::MAX),
    }
    .unwrap();
    let mut s = seed | 1;
    for e in 0..engines {
        let group = match engine {
            EngineLayout::Vllm { tp } => Some(e % usize::try_from(tp).unwrap()),
            _ => None,
        };
        let mut t: Vec<EngineTensor> = plan
            .dests
            .iter()
            .filter(|d| group.is_none_or(|g| d.group == g))
            .map(|d| EngineTensor::new(&d.name, d.dtype, d.shape.clone()))
            .collect();
        for i in (1..t.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            t.swap(i, usize::try_from(s % (i as u64 + 1)).unwrap());
        }
        decls.push(Decl {
            options: opts.fingerprint(),
            role: Role::Engine(t),
            error: None,
        });
    }
    decls
}

type MoveKey = (usize, usize, usize, usize, usize, Bx, Bx, u64);

fn key(m: &Move) -> MoveKey {
    (
        m.src,
        m.dst,
        m.local,
        m.piece,
        m.cut.src,
        m.cut.sbox.clone(),
        m.cut.dbox.clone(),
        m.bytes,
    )
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Per-rank plans against the global plan: the trainer ranks' sends and the engine
    /// ranks' receives are each exactly the global plan's moves, both ends of every pair
    /// derive that pair's moves in the same order, and their schedules put the same bytes in
    /// the same rounds.
    #[test]
    fn per_rank_plans_union_to_the_global_plan(
        tp in 1u64..=2,
        pp in proptest::sample::select(vec![1u64, 2, 4]),
        etp in proptest::sample::select(vec![0u64, 1, 2, 4]),
        replicas in 1usize..=2,
        auto in proptest::bool::ANY,
        seed in 1u64..u64::MAX,
        chunk in proptest::sample::select(vec![64u64, 1000, 1 << 20]),
    ) {
        let trainer = Layout { tp, pp, ep: 1 };
        let (engine, engines) = if etp == 0 {
            (EngineLayout::Hf, replicas)
        } else {
            (EngineLayout::Vllm { tp: etp }, replicas * usize::try_from(etp).unwrap())
        };
        let mut opts = Options::new(Table::builtin("llama").unwrap(), cfg(), trainer, engine);
        // No cut by the bucket in either plan: the moves compare one for one.
        opts.bucket_bytes = u64::MAX / 4;
        let decls = declarations(&opts, trainer, engine, engines, auto, seed);
        let global = tplan::build(&opts, decls.clone()).unwrap();
        let mut want: Vec<MoveKey> = global.moves.iter().map(key).collect();
        want.sort();
        let nt = usize::try_from(tp * pp).unwrap();
        let ranks: Vec<_> = (0..decls.len())
            .map(|me| build_rank(&opts, &decls, me).unwrap())
            .collect();
        let mut sends: Vec<MoveKey> = ranks[..nt].iter().flat_map(|r| r.moves.iter().map(key)).collect();
        let mut recvs: Vec<MoveKey> = ranks[nt..].iter().flat_map(|r| r.moves.iter().map(key)).collect();
        sends.sort();
        recvs.sort();
        proptest::prop_assert_eq!(&sends, &want);
        proptest::prop_assert_eq!(&recvs, &want);
        let fan = ranks.iter().map(|r| r.fan).max().unwrap() as u64;
        let plans: Vec<LocalPlan> = ranks
            .iter()
            .map(|r| LocalPlan::schedule(r, chunk, 0, 0))
            .collect();
        for s in 0..nt {
            for d in nt..decls.len() {
                let of = |r: &RankPlan| -> Vec<MoveKey> {
                    r.moves.iter().filter(|m| m.src == s && m.dst == d).map(key).collect()
                };
                proptest::prop_assert_eq!(of(&ranks[s]), of(&ranks[d]), "pair {} -> {}", s, d);
                let rounds = plans[s].rounds().max(plans[d].rounds());
                for r in 0..rounds {
                    let out: Vec<u64> = plans[s].messages(r).0.iter().filter(|x| x.0 == d).map(|x| x.1).collect();
                    let inb: Vec<u64> = plans[d].messages(r).1.iter().filter(|x| x.0 == s).map(|x| x.1).collect();
                    proptest::prop_assert_eq!(&out, &inb, "pair {} -> {} round {}", s, d, r);
                    proptest::prop_assert!(out.iter().all(|&n| n <= chunk.max(8)));
                }
            }
        }
        // Per round, no rank sends or receives more than the fan's share of a bucket of
        // chunk x fan bytes.
        for p in &plans {
            for r in 0..p.rounds() {
                let (o, i) = p.messages(r);
                proptest::prop_assert!(o.iter().map(|x| x.1).sum::<u64>() <= chunk.max(8) * fan);
                proptest::prop_assert!(i.iter().map(|x| x.1).sum::<u64>() <= chunk.max(8) * fan);
            }
        }
    }
}
