//! Live weight transfer from a trainer holding HF-named tensors (FSDP-style: each rank a block
//! of rows of every tensor) into whole HF tensors, between threads over `LocalComm`; and the
//! refusals of that source (a missing tensor, a vLLM layout) on every rank.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use zarrckpt::convert::{self, Layout, Table};
use zarrckpt::transfer::{
    EngineLayout, EngineTensor, Options, TrainerNames, Transfer, TransferError,
};
use zarrckpt::{Communicator, DType, Region, ShardedTensor, TensorKey, run_local};

const TIMEOUT: Duration = Duration::from_secs(20);
const ONE: Layout = Layout {
    tp: 1,
    pp: 1,
    ep: 1,
};

fn cfg() -> serde_json::Value {
    json!({"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 250,
           "tie_word_embeddings": false})
}

/// The HF tensors the table expects (name -> (shape, bf16 bytes)), values made up.
fn hf_model(table: &Table) -> BTreeMap<String, (Vec<u64>, Vec<u8>)> {
    let ex = convert::expand(table, &cfg(), ONE).unwrap();
    let aux: Vec<usize> = ex.aux.iter().map(|a| a.1).collect();
    let mut out = BTreeMap::new();
    for (i, h) in ex.h.iter().enumerate() {
        if aux.contains(&i) {
            continue;
        }
        let n: u64 = h.shape.iter().product();
        let bytes: Vec<u8> = (0..n * 2)
            .map(|j| u8::try_from((j * 7 + i as u64 * 13) % 251).unwrap())
            .collect();
        out.insert(h.name.clone(), (h.shape.clone(), bytes));
    }
    out
}

/// Rank `r` of `n`: its block of rows of every tensor (as FSDP2's `Shard(0)`).
fn rows<'a>(
    m: &'a BTreeMap<String, (Vec<u64>, Vec<u8>)>,
    r: u64,
    n: u64,
    skip: Option<&str>,
) -> Vec<ShardedTensor<'a>> {
    let mut out = Vec::new();
    for (name, (shape, bytes)) in m {
        if Some(name.as_str()) == skip {
            continue;
        }
        let per = shape[0].div_ceil(n);
        let start = (per * r).min(shape[0]);
        let end = (per * (r + 1)).min(shape[0]);
        if start == end {
            continue;
        }
        let row: u64 = shape[1..].iter().product::<u64>() * 2;
        let mut len = shape.clone();
        len[0] = end - start;
        let mut off = vec![0; shape.len()];
        off[0] = start;
        let data =
            &bytes[usize::try_from(start * row).unwrap()..usize::try_from(end * row).unwrap()];
        out.push(
            ShardedTensor::new(
                TensorKey::new(name).unwrap(),
                DType::BFloat16,
                shape.clone(),
                Region::new(off, len).unwrap(),
                0,
                data,
            )
            .unwrap(),
        );
    }
    out
}

fn opts(table: &Table, engine: EngineLayout) -> Options {
    let mut o = Options::new(table.clone(), cfg(), ONE, engine);
    o.names = TrainerNames::Hf;
    o.bucket_bytes = 1024;
    o
}

#[test]
fn fsdp_style_rows_to_whole_hf_tensors_then_cached() {
    let table = Table::builtin("llama").unwrap();
    let m = hf_model(&table);
    let o = opts(&table, EngineLayout::Hf);
    let tensors: Vec<EngineTensor> = m
        .iter()
        .map(|(n, (s, _))| EngineTensor::new(n, DType::BFloat16, s.clone()))
        .collect();
    let res = run_local(5, TIMEOUT, |comm| {
        let mut tr = Transfer::new(o.clone());
        let mut reps = Vec::new();
        let mut bufs: Vec<Vec<u8>> = m.values().map(|(_, b)| vec![0u8; b.len()]).collect();
        for _ in 0..2 {
            if comm.rank() < 4 {
                let p = rows(&m, comm.rank() as u64, 4, None);
                reps.push(tr.send(&comm, &p)?);
            } else {
                let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                reps.push(tr.receive(&comm, &tensors, &mut refs)?);
            }
        }
        Ok::<_, TransferError>((reps, bufs))
    });
    let res: Vec<_> = res.into_iter().map(Result::unwrap).collect();
    let total: u64 = m.values().map(|(_, b)| b.len() as u64).sum();
    for ((name, (_, want)), got) in m.iter().zip(&res[4].1) {
        assert_eq!(want, got, "{name}");
    }
    let sent: Vec<u64> = res[..4].iter().map(|(r, _)| r[0].moved.sent).collect();
    assert_eq!(sent.iter().sum::<u64>(), total);
    // each rank sends its own rows: nothing is gathered on a trainer rank
    assert!(sent.iter().all(|&s| s * 4 <= total * 11 / 10), "{sent:?}");
    assert!(res.iter().all(|(r, _)| r[0].planned && !r[1].planned));
    assert!(res[4].0[0].rounds > 1);
}

fn refused(o: &Options, skip: Option<&str>) -> Vec<String> {
    let table = o.table.clone();
    let m = hf_model(&table);
    let tensors: Vec<EngineTensor> = m
        .iter()
        .map(|(n, (s, _))| EngineTensor::new(n, DType::BFloat16, s.clone()))
        .collect();
    run_local(3, TIMEOUT, |comm| {
        let mut tr = Transfer::new(o.clone());
        let mut bufs: Vec<Vec<u8>> = m.values().map(|(_, b)| vec![7u8; b.len()]).collect();
        let r = if comm.rank() < 2 {
            tr.send(&comm, &rows(&m, comm.rank() as u64, 2, skip))
        } else {
            let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            tr.receive(&comm, &tensors, &mut refs)
        };
        assert!(
            bufs.iter().all(|b| b.iter().all(|&x| x == 7)),
            "bytes moved"
        );
        r.unwrap_err().to_string()
    })
}

#[test]
fn missing_hf_tensor_refused_on_every_rank() {
    let table = Table::builtin("llama").unwrap();
    let msgs = refused(&opts(&table, EngineLayout::Hf), Some("model.norm.weight"));
    for m in &msgs {
        assert!(
            m.contains("hf tensor `model.norm.weight` is not in the input") && m.contains("rule `"),
            "{m}"
        );
    }
    assert!(msgs.iter().all(|m| *m == msgs[0]), "{msgs:?}");
}

#[test]
fn hf_names_into_a_vllm_layout_refused_on_every_rank() {
    let table = Table::builtin("llama").unwrap();
    let msgs = refused(&opts(&table, EngineLayout::Vllm { tp: 1 }), None);
    for m in &msgs {
        assert!(
            m.contains("HF-named tensors") && m.contains("vLLM TP 1"),
            "{m}"
        );
    }
}
