//! A part of a vLLM conversion plan (`plan_vllm_part`, what one transfer rank builds) against
//! the whole plan: restricted to some TP ranks, to the pieces of some Megatron keys and to the
//! pieces whose Megatron box a predicate accepts (a trainer rank's own sending boxes), it is
//! the whole plan's destinations and pieces filtered the same way, in the same order, with
//! the same refusals.

use serde_json::json;
use zarrckpt::convert::geom::Bx;
use zarrckpt::convert::{self, Inventory, Layout, Part, Plan, Table, plan_vllm, plan_vllm_part};

fn cfg() -> serde_json::Value {
    json!({"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 24, "moe_intermediate_size": 8, "num_local_experts": 4,
        "vocab_size": 100, "tie_word_embeddings": false, "decoder_sparse_step": 1})
}

fn inventory(t: &Table, c: &serde_json::Value, l: Layout) -> Inventory {
    convert::expand(t, c, l)
        .unwrap()
        .m
        .iter()
        .map(|m| (m.key.clone(), ("bfloat16".to_string(), m.shape.clone())))
        .collect()
}

type PieceKey = (usize, Bx, Bx, bool);
type DestKey = (String, usize, Vec<u64>, Vec<PieceKey>);

fn dests(p: &Plan) -> Vec<DestKey> {
    p.dests
        .iter()
        .map(|d| {
            (
                d.name.clone(),
                d.group,
                d.shape.clone(),
                d.pieces
                    .iter()
                    .map(|x| (x.src, x.sbox.clone(), x.dbox.clone(), x.transpose))
                    .collect(),
            )
        })
        .collect()
}

/// A box of `shape` from `s` (xorshift state).
fn some_box(shape: &[u64], s: &mut u64) -> Bx {
    let mut next = |n: u64| {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s % n.max(1)
    };
    let off: Vec<u64> = shape.iter().map(|&n| next(n)).collect();
    let len = shape
        .iter()
        .zip(&off)
        .map(|(&n, &o)| 1 + next(n - o))
        .collect();
    Bx { off, len }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    #[test]
    fn a_part_is_the_whole_plan_filtered(
        tp in 1u64..=2,
        pp in 1u64..=2,
        ep in proptest::sample::select(vec![1u64, 2, 4]),
        k in 1u64..=2,
        one_rank in proptest::bool::ANY,
        seed in 1u64..u64::MAX,
    ) {
        let t = Table::builtin("qwen3_moe").unwrap();
        let c = cfg();
        let l = Layout { tp, pp, ep };
        let inv = inventory(&t, &c, l);
        let whole = plan_vllm(&t, &c, l, &inv, k).unwrap();
        // Some keys kept, and for each kept key one box whose intersecting pieces are kept.
        let mut s = seed;
        let mut boxes: std::collections::BTreeMap<String, Bx> = std::collections::BTreeMap::new();
        for (key, (_, shape)) in &inv {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if s % 3 != 0 {
                boxes.insert(key.clone(), some_box(shape, &mut s));
            }
        }
        let keep = |key: &str| boxes.contains_key(key);
        let accept = |key: &str, b: &Bx| boxes.get(key).is_some_and(|x| x.intersect(b).is_some());
        let rank = [seed % k];
        let part = Part {
            ranks: one_rank.then_some(&rank[..]),
            keep: Some(&keep),
            boxes: Some(&accept),
        };
        let got = plan_vllm_part(&t, &c, l, &inv, k, &part).unwrap();
        let names: Vec<&str> = whole.sources.iter().map(|x| x.name.as_str()).collect();
        let want: Vec<DestKey> = dests(&whole)
            .into_iter()
            .filter(|d| !one_rank || u64::try_from(d.1).unwrap() == rank[0])
            .map(|(n, g, sh, ps)| {
                let ps: Vec<PieceKey> = ps
                    .into_iter()
                    .filter(|p| keep(names[p.0]) && accept(names[p.0], &p.1))
                    .collect();
                (n, g, sh, ps)
            })
            .filter(|d| !d.3.is_empty())
            .collect();
        proptest::prop_assert_eq!(dests(&got), want);
        // The same sources and checks as the whole plan.
        let src = |p: &Plan| p.sources.iter().map(|x| (x.name.clone(), x.shape.clone())).collect::<Vec<_>>();
        proptest::prop_assert_eq!(src(&got), src(&whole));
        proptest::prop_assert_eq!(&got.checks, &whole.checks);
    }
}

/// A layout the engine cannot take is refused by every part, whatever it keeps.
#[test]
fn a_part_refuses_what_the_whole_plan_refuses() {
    let t = Table::builtin("qwen3_moe").unwrap();
    let c = cfg();
    let l = Layout {
        tp: 1,
        pp: 1,
        ep: 1,
    };
    let inv = inventory(&t, &c, l);
    // 4 heads and 2 kv heads over vLLM TP 3: neither divides.
    let whole = plan_vllm(&t, &c, l, &inv, 3).unwrap_err().to_string();
    let none = |_: &str, _: &Bx| false;
    let keep_none = |_: &str| false;
    for ranks in [None, Some(&[0u64][..]), Some(&[2u64][..])] {
        let part = Part {
            ranks,
            keep: Some(&keep_none),
            boxes: Some(&none),
        };
        let e = plan_vllm_part(&t, &c, l, &inv, 3, &part)
            .unwrap_err()
            .to_string();
        assert_eq!(e, whole);
    }
}
