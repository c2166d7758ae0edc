//! Sending straight from the sources and receiving straight into the destinations moves the
//! same bytes as packing every message: a transfer's cached plan run with every item packed,
//! with every item a message of its own (direct wherever the memory allows), and in between.

use super::*;
use crate::convert::{self, Layout, Table};
use crate::run_local;
use crate::transfer::{EngineLayout, EngineTensor, Options, Transfer};
use crate::{Region, TensorKey};
use std::time::Duration;

fn cfg() -> serde_json::Value {
    serde_json::json!({"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 256,
        "tie_word_embeddings": false})
}

/// Trainer rank (t, p)'s boxes (key, global shape, box, main): layers over PP, TP tensors in
/// their segments each split over TP, the others on every rank (main on TP rank 0).
fn boxes(table: &Table, l: Layout, t: u64, p: u64) -> Vec<(String, Vec<u64>, Bx, bool)> {
    let ex = convert::expand(table, &cfg(), l).unwrap();
    let mut out = Vec::new();
    for m in &ex.m {
        let mut b = Bx::full(&m.shape);
        if m.stack_axes > 0 {
            let per = m.shape[0] / l.pp;
            b.off[0] = p * per;
            b.len[0] = per;
        }
        match m.tp {
            Some(tp) => {
                let seg = m.shape[tp.axis] / tp.parts;
                let w = seg / l.tp;
                for q in 0..tp.parts {
                    let mut c = b.clone();
                    c.off[tp.axis] = q * seg + t * w;
                    c.len[tp.axis] = w;
                    out.push((
                        m.key.clone(),
                        m.shape.clone(),
                        c,
                        m.stack_axes > 0 || p == 0,
                    ));
                }
            }
            None => out.push((
                m.key.clone(),
                m.shape.clone(),
                b,
                t == 0 && (m.stack_axes > 0 || p == 0),
            )),
        }
    }
    out
}

/// The bf16 bytes of box `b` of a global tensor whose element at flat index `g` is `g + seed`.
fn fill(shape: &[u64], b: &Bx, seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let n = b.len.len();
    let mut idx = vec![0u64; n];
    for _ in 0..b.volume() {
        let mut g = 0;
        for d in 0..n {
            g = g * shape[d] + b.off[d] + idx[d];
        }
        out.extend_from_slice(&u16::try_from((g + seed) % 65_521).unwrap().to_le_bytes());
        for d in (0..n).rev() {
            idx[d] += 1;
            if idx[d] < b.len[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Per engine rank: its buffers after the transfer and after each rerun of the plan with
/// items of at least `own` bytes alone; and per rank the direct messages with `own` 0.
fn reruns(
    l: Layout,
    engine: EngineLayout,
    engines: usize,
    owns: &[u64],
) -> Vec<(Vec<Vec<Vec<u8>>>, usize)> {
    let table = Table::builtin("llama").unwrap();
    let mut opts = Options::new(table.clone(), cfg(), l, engine);
    opts.bucket_bytes = 3000;
    let nt = usize::try_from(l.tp * l.pp).unwrap();
    let ex = convert::expand(&table, &cfg(), l).unwrap();
    let inv: convert::Inventory =
        ex.m.iter()
            .map(|m| (m.key.clone(), ("bfloat16".to_string(), m.shape.clone())))
            .collect();
    let conv = match engine {
        EngineLayout::Vllm { tp } => convert::plan_vllm(&table, &cfg(), l, &inv, tp),
        EngineLayout::Hf => convert::plan_hf_export(&table, &cfg(), l, &inv, u64::MAX),
    }
    .unwrap();
    let decl = |e: usize| -> Vec<EngineTensor> {
        conv.dests
            .iter()
            .filter(|d| match engine {
                EngineLayout::Vllm { tp } => d.group == e % usize::try_from(tp).unwrap(),
                EngineLayout::Hf => true,
            })
            .map(|d| EngineTensor::new(&d.name, d.dtype, d.shape.clone()))
            .collect()
    };
    run_local(nt + engines, Duration::from_secs(20), |comm| {
        let me = comm.rank();
        let mut t = Transfer::new(opts.clone());
        let mut outs = Vec::new();
        if me < nt {
            let bs = boxes(&table, l, me as u64 % l.tp, me as u64 / l.tp);
            let data: Vec<Vec<u8>> = bs
                .iter()
                .map(|(k, s, b, _)| fill(s, b, k.len() as u64 * 131))
                .collect();
            let pieces: Vec<ShardedTensor<'_>> = bs
                .iter()
                .zip(&data)
                .map(|((k, s, b, main), d)| {
                    ShardedTensor::new(
                        TensorKey::new(k).unwrap(),
                        DType::BFloat16,
                        s.clone(),
                        Region::new(b.off.clone(), b.len.clone()).unwrap(),
                        u32::from(!*main),
                        d,
                    )
                    .unwrap()
                })
                .collect();
            t.send(&comm, &pieces).unwrap();
            let lp = t.local_plan().unwrap().clone();
            for &own in owns {
                run_with(&comm, &lp, &pieces, None, own).unwrap();
            }
            let direct = lp
                .sends
                .iter()
                .flat_map(|v| send_messages(v, &pieces, 0))
                .flat_map(|(_, m)| m)
                .filter(|m| m.direct.is_some())
                .count();
            (outs, direct)
        } else {
            let tensors = decl(me - nt);
            let mut bufs: Vec<Vec<u8>> = tensors
                .iter()
                .map(|t| vec![0xAB; usize_of(t.shape.iter().product::<u64>() * 2)])
                .collect();
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            t.receive(&comm, &tensors, &mut refs).unwrap();
            outs.push(refs.iter().map(|b| b.to_vec()).collect::<Vec<_>>());
            let lp = t.local_plan().unwrap().clone();
            for &own in owns {
                for b in refs.iter_mut() {
                    b.fill(0xAB);
                }
                run_with(&comm, &lp, &[], Some(&mut Buffers { bufs: &mut refs }), own).unwrap();
                outs.push(refs.iter().map(|b| b.to_vec()).collect());
            }
            let direct = lp
                .recvs
                .iter()
                .flat_map(|v| recv_messages(v, &lp.dests, 0))
                .flat_map(|(_, m)| m)
                .filter(|m| m.direct.is_some())
                .count();
            (outs, direct)
        }
    })
}

fn check(l: Layout, engine: EngineLayout, engines: usize) {
    let nt = usize::try_from(l.tp * l.pp).unwrap();
    let owns = [u64::MAX, 0, 300, OWN_MESSAGE];
    let res = reruns(l, engine, engines, &owns);
    for (r, (_, direct)) in res.iter().enumerate() {
        assert!(
            *direct > 0,
            "rank {r}: no message sent or received directly"
        );
    }
    for (e, (outs, _)) in res[nt..].iter().enumerate() {
        assert_eq!(outs.len(), owns.len() + 1);
        assert!(
            outs[0].iter().flatten().any(|&b| b != 0xAB),
            "engine rank {e}: nothing received"
        );
        for (i, o) in outs.iter().enumerate().skip(1) {
            assert!(
                o == &outs[0],
                "engine rank {e}: items of at least {} bytes alone differ from the transfer",
                owns[i - 1]
            );
        }
    }
}

#[test]
fn direct_messages_move_the_same_bytes() {
    let l = Layout {
        tp: 2,
        pp: 2,
        ep: 1,
    };
    check(l, EngineLayout::Vllm { tp: 2 }, 2);
    check(l, EngineLayout::Vllm { tp: 1 }, 1);
    check(l, EngineLayout::Hf, 1);
}

#[test]
fn messages_group_small_items_and_contiguity_is_exact() {
    let m = messages(&[10, 20, 100, 5, 100, 1], 50);
    let got: Vec<_> = m.iter().map(|m| (m.items.clone(), m.bytes)).collect();
    assert_eq!(
        got,
        vec![(0..2, 30), (2..3, 100), (3..4, 5), (4..5, 100), (5..6, 1)]
    );
    let b = |off: &[u64], len: &[u64]| Bx {
        off: off.to_vec(),
        len: len.to_vec(),
    };
    // rows of a [4, 6] array: contiguous; a column block: not
    assert_eq!(contiguous_at(&[4, 6], &b(&[1, 0], &[2, 6]), 2), Some(12));
    assert_eq!(contiguous_at(&[4, 6], &b(&[1, 2], &[2, 3]), 2), None);
    // part of one row, and a single element: contiguous
    assert_eq!(contiguous_at(&[4, 6], &b(&[3, 2], &[1, 3]), 2), Some(40));
    assert_eq!(
        contiguous_at(&[2, 4, 6], &b(&[1, 2, 5], &[1, 1, 1]), 1),
        Some(41)
    );
    // leading axes of extent 1 then whole trailing axes
    assert_eq!(
        contiguous_at(&[2, 4, 6], &b(&[1, 1, 0], &[1, 2, 6]), 4),
        Some(120)
    );
    assert_eq!(
        contiguous_at(&[2, 4, 6], &b(&[0, 1, 0], &[2, 2, 6]), 4),
        None
    );
    assert_eq!(contiguous_at(&[4, 6], &b(&[0, 0], &[2, 6, 1]), 4), None);
}
