//! Conversion tables (spec § 19): planning, the checks of § 19.5 (one negative test per bug
//! class), and round trips HF -> Megatron layout -> HF / vLLM on small synthetic models.

use std::collections::BTreeMap;

use serde_json::json;
use zarrckpt::convert::{self, ConvertError, Inventory, Layout, Plan, Table};
use zarrckpt::{Checkpoint, LocalComm, Region, SaveOptions, ShardedTensor, TensorKey};

fn cfg(tied: bool) -> serde_json::Value {
    json!({"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 100,
           "tie_word_embeddings": tied})
}

/// HF tensors of a Llama-style model (name -> shape), as save_pretrained writes them.
fn llama_hf(c: &serde_json::Value) -> BTreeMap<String, Vec<u64>> {
    let g = |k: &str| c[k].as_u64().unwrap();
    let (h, heads, kv, f, v, l) = (
        g("hidden_size"),
        g("num_attention_heads"),
        g("num_key_value_heads"),
        g("intermediate_size"),
        g("vocab_size"),
        g("num_hidden_layers"),
    );
    let hd = h / heads;
    let mut m = BTreeMap::new();
    m.insert("model.embed_tokens.weight".into(), vec![v, h]);
    if !c["tie_word_embeddings"].as_bool().unwrap() {
        m.insert("lm_head.weight".into(), vec![v, h]);
    }
    m.insert("model.norm.weight".into(), vec![h]);
    for i in 0..l {
        let p = format!("model.layers.{i}.");
        m.insert(format!("{p}input_layernorm.weight"), vec![h]);
        m.insert(format!("{p}post_attention_layernorm.weight"), vec![h]);
        m.insert(format!("{p}self_attn.q_proj.weight"), vec![heads * hd, h]);
        m.insert(format!("{p}self_attn.k_proj.weight"), vec![kv * hd, h]);
        m.insert(format!("{p}self_attn.v_proj.weight"), vec![kv * hd, h]);
        m.insert(format!("{p}self_attn.o_proj.weight"), vec![h, heads * hd]);
        m.insert(format!("{p}mlp.gate_proj.weight"), vec![f, h]);
        m.insert(format!("{p}mlp.up_proj.weight"), vec![f, h]);
        m.insert(format!("{p}mlp.down_proj.weight"), vec![h, f]);
    }
    m
}

fn inv(m: &BTreeMap<String, Vec<u64>>) -> Inventory {
    m.iter()
        .map(|(k, s)| (k.clone(), ("bfloat16".to_string(), s.clone())))
        .collect()
}

fn user_table(rules: serde_json::Value) -> Table {
    let t = json!({"format": "zarrckpt-mapping", "version": 1, "name": "user", "extends": "llama", "rules": rules});
    let ext = Table::parse(&t.to_string(), "user").unwrap();
    Table::builtin("llama").unwrap().extend_with(ext)
}

fn import(
    t: &Table,
    c: &serde_json::Value,
    l: Layout,
    i: &Inventory,
) -> Result<Plan, ConvertError> {
    convert::plan_megatron_import(t, c, l, i)
}

fn lay(tp: u64, pp: u64) -> Layout {
    Layout { tp, pp, ep: 1 }
}

#[test]
fn tables_validate_against_the_schema() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("spec/schema/mapping.schema.json")).unwrap(),
    )
    .unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    for e in std::fs::read_dir(root.join("tables")).unwrap() {
        let p = e.unwrap().path();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let errs: Vec<String> = v.iter_errors(&doc).map(|e| e.to_string()).collect();
        assert!(errs.is_empty(), "{}: {errs:?}", p.display());
        // And every built-in resolves and round-trips.
        let name = p.file_stem().unwrap().to_str().unwrap();
        let t = Table::builtin(name).unwrap();
        assert_eq!(Table::parse(&t.to_json(), name).unwrap(), t);
    }
}

#[test]
fn import_plan_matches_megatron_layout() {
    let c = cfg(false);
    let t = Table::builtin("llama").unwrap();
    let p = import(&t, &c, lay(2, 1), &inv(&llama_hf(&c))).unwrap();
    let qkv: Vec<_> = p
        .dests
        .iter()
        .filter(|d| d.name == "decoder.layers.self_attention.linear_qkv.weight")
        .collect();
    // 2 layers x 2 TP ranks; global [2, 2 groups * (2 q + k + v) * 4, 16].
    assert_eq!(qkv.len(), 4);
    assert_eq!(qkv[0].shape, vec![2, 32, 16]);
    assert_eq!(qkv[1].region.off, vec![0, 16, 0]);
    // Group 1 (TP rank 1): q heads 2..3 (rows 8..16 of q), k head 1, v head 1.
    let srcs: Vec<(String, u64, u64)> = qkv[1]
        .pieces
        .iter()
        .map(|pc| {
            (
                p.sources[pc.src].name.clone(),
                pc.sbox.off[0],
                pc.sbox.len[0],
            )
        })
        .collect();
    assert_eq!(
        srcs,
        vec![
            ("model.layers.0.self_attn.q_proj.weight".into(), 8, 8),
            ("model.layers.0.self_attn.k_proj.weight".into(), 4, 4),
            ("model.layers.0.self_attn.v_proj.weight".into(), 4, 4)
        ]
    );
    // fc1 = [gate; up], each rank holding its piece of both halves.
    let fc1: Vec<_> = p
        .dests
        .iter()
        .filter(|d| d.name == "decoder.layers.mlp.linear_fc1.weight" && d.region.off[0] == 0)
        .map(|d| (d.region.off[1], d.region.len[1], d.group))
        .collect();
    assert_eq!(fc1, vec![(0, 12, 0), (24, 12, 0), (12, 12, 1), (36, 12, 1)]);
    // Vocabulary padded to 128 * tp.
    let emb = p
        .dests
        .iter()
        .find(|d| d.name == "embedding.word_embeddings.weight")
        .unwrap();
    assert_eq!(emb.shape, vec![256, 16]);
}

fn msg(e: ConvertError) -> String {
    e.to_string()
}

#[test]
fn impossible_tp_is_refused_with_numbers() {
    let c = cfg(false);
    let t = Table::builtin("llama").unwrap();
    let e = msg(import(&t, &c, lay(4, 1), &inv(&llama_hf(&c))).unwrap_err());
    assert!(
        e.contains("rule `qkv`") && e.contains("= 2 is not divisible by tp = 4"),
        "{e}"
    );
    let e = msg(import(&t, &c, lay(1, 3), &inv(&llama_hf(&c))).unwrap_err());
    assert!(
        e.contains("layers") && e.contains("not divisible by pp = 3"),
        "{e}"
    );
}

#[test]
fn plain_concatenated_qkv_is_refused() {
    let c = cfg(false);
    let t = user_table(
        json!([{"name": "qkv", "megatron": "decoder.layers.self_attention.linear_qkv.weight",
        "stack": [{"capture": "layer", "size": "L"}], "op": "concat", "axis": 0,
        "hf": [{"name": "model.layers.{layer}.self_attn.q_proj.weight", "shape": ["heads * head_dim", "hidden"]},
               {"name": "model.layers.{layer}.self_attn.k_proj.weight", "shape": ["groups * head_dim", "hidden"]},
               {"name": "model.layers.{layer}.self_attn.v_proj.weight", "shape": ["groups * head_dim", "hidden"]}],
        "tp": {"axis": 0, "units": "groups"}}]),
    );
    let e = msg(import(&t, &c, lay(1, 1), &inv(&llama_hf(&c))).unwrap_err());
    assert!(
        e.contains("rule `qkv`") && e.contains("interleaved per query group"),
        "{e}"
    );
    assert!(
        e.contains("unit 0 of 2") && e.contains("16 from `model.layers.0.self_attn.q_proj.weight`"),
        "{e}"
    );
}

#[test]
fn glued_expert_index_is_refused() {
    // In a table: a substitution inside a name component.
    let c = cfg(false);
    let t = user_table(
        json!([{"name": "fc2", "megatron": "decoder.layers.mlp.linear_fc2.weight",
        "stack": [{"capture": "layer", "size": "L"}], "op": "rename",
        "hf": [{"name": "model.layers.mlp.down_proj.weight{layer}", "shape": ["hidden", "ffn"]}]}]),
    );
    let e = msg(import(&t, &c, lay(1, 1), &inv(&llama_hf(&c))).unwrap_err());
    assert!(
        e.contains("`{layer}` is not a whole dot-separated name component"),
        "{e}"
    );
    // In the input: an expert key with its index glued on (verl #2319).
    let mut hf = llama_hf(&c);
    hf.insert(
        "model.layers.0.mlp.gate_proj.weight100".into(),
        vec![24, 16],
    );
    let e = msg(import(&Table::builtin("llama").unwrap(), &c, lay(1, 1), &inv(&hf)).unwrap_err());
    assert!(
        e.contains("`model.layers.0.mlp.gate_proj.weight100`") && e.contains("consumed by no rule"),
        "{e}"
    );
    assert!(e.contains("followed by `100`"), "{e}");
}

#[test]
fn padding_rows_kept_are_refused() {
    let c = cfg(false);
    let t = user_table(
        json!([{"name": "embedding", "megatron": "embedding.word_embeddings.weight",
        "op": "rename", "hf": [{"name": "model.embed_tokens.weight", "shape": ["padded_vocab", "hidden"]}],
        "tp": {"axis": 0}}]),
    );
    let e = msg(import(&t, &c, lay(1, 1), &inv(&llama_hf(&c))).unwrap_err());
    assert!(
        e.contains("model.embed_tokens.weight") && e.contains("padding rows"),
        "{e}"
    );
    assert!(e.contains("[128, 16]"), "{e}");
}

#[test]
fn tied_lm_head_written_twice_is_refused() {
    let c = cfg(true);
    let t = user_table(
        json!([{"name": "lm_head_from_embedding", "megatron": "embedding.word_embeddings.weight",
        "op": "pad", "to": "padded_vocab", "hf": [{"name": "lm_head.weight", "shape": ["vocab", "hidden"]}]}]),
    );
    let mut hf = llama_hf(&c);
    hf.insert("lm_head.weight".into(), vec![100, 16]);
    // Export direction: the embedding consumed twice.
    let ex = convert::expand(&t, &c, lay(1, 1)).unwrap();
    let e = msg(convert::check::check_structure(&ex, convert::Direction::Export).unwrap_err());
    assert!(
        e.contains("embedding.word_embeddings.weight") && e.contains("consumed twice"),
        "{e}"
    );
    assert!(e.contains("`embedding`, `lm_head_from_embedding`"), "{e}");
    // Import direction: the Megatron tensor produced twice.
    let e = msg(import(&t, &c, lay(1, 1), &inv(&hf)).unwrap_err());
    assert!(e.contains("produced 2 times"), "{e}");
}

#[test]
fn split_part_without_target_is_refused() {
    let c = cfg(false);
    let t = user_table(
        json!([{"name": "fc1", "megatron": "decoder.layers.mlp.linear_fc1.weight",
        "stack": [{"capture": "layer", "size": "L"}], "op": "rename",
        "place": {"axis": 0, "at": 0, "size": "2 * ffn"},
        "hf": [{"name": "model.layers.{layer}.mlp.gate_proj.weight", "shape": ["ffn", "hidden"]}]}]),
    );
    let ex = convert::expand(&t, &c, lay(1, 1)).unwrap();
    let e = msg(convert::check::check_structure(&ex, convert::Direction::Export).unwrap_err());
    assert!(
        e.contains("linear_fc1.weight")
            && e.contains("axis 0 [24, 48)")
            && e.contains("consumed by no rule"),
        "{e}"
    );
    let e = msg(import(&t, &c, lay(1, 1), &inv(&llama_hf(&c))).unwrap_err());
    assert!(e.contains("produced by no rule"), "{e}");
    // Without `place`: the HF up_proj is then consumed by nothing.
    let t = user_table(
        json!([{"name": "fc1", "megatron": "decoder.layers.mlp.linear_fc1.weight",
        "stack": [{"capture": "layer", "size": "L"}], "op": "rename",
        "hf": [{"name": "model.layers.{layer}.mlp.gate_proj.weight", "shape": ["ffn", "hidden"]}]}]),
    );
    let e = msg(import(&t, &c, lay(1, 1), &inv(&llama_hf(&c))).unwrap_err());
    assert!(
        e.contains("up_proj.weight") && e.contains("consumed by no rule"),
        "{e}"
    );
}

#[test]
fn shapes_and_missing_tensors_are_refused() {
    let c = cfg(false);
    let t = Table::builtin("llama").unwrap();
    let mut hf = llama_hf(&c);
    hf.insert("model.layers.1.mlp.up_proj.weight".into(), vec![25, 16]);
    let e = msg(import(&t, &c, lay(1, 1), &inv(&hf)).unwrap_err());
    assert!(e.contains("[25, 16]") && e.contains("[24, 16]"), "{e}");
    let mut hf = llama_hf(&c);
    hf.remove("model.norm.weight");
    let e = msg(import(&t, &c, lay(1, 1), &inv(&hf)).unwrap_err());
    assert!(e.contains("`model.norm.weight` is not in the input"), "{e}");
    let mut c2 = cfg(false);
    c2.as_object_mut().unwrap().remove("intermediate_size");
    let e = msg(import(&t, &c2, lay(1, 1), &inv(&hf)).unwrap_err());
    assert!(e.contains("config.json has no `intermediate_size`"), "{e}");
}

/// Deterministic bytes for a tensor.
fn data_of(name: &str, shape: &[u64]) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let seed = name
        .bytes()
        .fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
    (0..n * 2)
        .map(|i| (seed.wrapping_mul(i + 1) >> 7) as u8)
        .collect()
}

/// HF -> Megatron layout (saved) -> HF and vLLM, every byte checked.
#[test]
fn round_trip_through_a_saved_megatron_layout() {
    for (tied, tp) in [(false, 2u64), (true, 1)] {
        let c = cfg(tied);
        let t = Table::builtin("llama").unwrap();
        let hf = llama_hf(&c);
        let data: BTreeMap<String, Vec<u8>> =
            hf.iter().map(|(k, s)| (k.clone(), data_of(k, s))).collect();
        let plan = import(&t, &c, lay(tp, 1), &inv(&hf)).unwrap();
        let src: Vec<&[u8]> = plan
            .sources
            .iter()
            .map(|s| data[&s.name].as_slice())
            .collect();
        let bufs: Vec<Vec<u8>> = (0..plan.dests.len())
            .map(|i| {
                let mut b = vec![0u8; plan.dests[i].nbytes() as usize];
                convert::fill_from_sources(&plan, i, &|k| src[k], &mut b).unwrap();
                b
            })
            .collect();
        let pieces: Vec<ShardedTensor> = plan
            .dests
            .iter()
            .zip(&bufs)
            .map(|(d, b)| {
                let r = Region::new(d.region.off.clone(), d.region.len.clone()).unwrap();
                ShardedTensor::new(
                    TensorKey::new(&d.name).unwrap(),
                    d.dtype,
                    d.shape.clone(),
                    r,
                    0,
                    b,
                )
                .unwrap()
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        zarrckpt::save(&pieces, &ck, &LocalComm::single(), &SaveOptions::default()).unwrap();
        let ck = Checkpoint::open(&ck).unwrap();
        let cinv: Inventory = ck
            .tensors()
            .into_iter()
            .map(|t| (t.key.to_string(), (t.dtype.to_string(), t.shape)))
            .collect();
        // Chunks are Megatron's rank boxes.
        let qkv = ck
            .tensor(&TensorKey::new("decoder.layers.self_attention.linear_qkv.weight").unwrap())
            .unwrap();
        assert_eq!(qkv.chunk_shape, vec![1, 32 / tp, 16]);
        // Export at the saved layout, in two files.
        let ep = convert::plan_hf_export(&t, &c, lay(tp, 1), &cinv, 4000).unwrap();
        assert!(ep.dests.iter().map(|d| d.group).max().unwrap() >= 1);
        let mut read = 0;
        let mut needed = 0;
        for b in ep.batches() {
            let mut out: Vec<Vec<u8>> = ep.dests[b.clone()]
                .iter()
                .map(|d| vec![0u8; d.nbytes() as usize])
                .collect();
            let mut views: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
            let st = convert::fill_from_checkpoint(&ck, &ep, b.clone(), &mut views).unwrap();
            read += st.bytes_read;
            needed += st.bytes_needed;
            for (d, o) in ep.dests[b].iter().zip(&out) {
                assert_eq!(o, &data[&d.name], "{} (tied {tied}, tp {tp})", d.name);
            }
        }
        assert!(read >= needed);
        assert_eq!(ep.dests.len(), hf.len());
        // Exporting at the wrong saved layout names the padded vocabulary.
        if tp == 2 {
            let e = msg(convert::plan_hf_export(&t, &c, lay(3, 1), &cinv, 4000).unwrap_err());
            assert!(
                e.contains("[256, 16]") && e.contains("[384, 16]") && e.contains("--megatron tp=T"),
                "{e}"
            );
        }
        // vLLM TP 2: qkv_proj of rank 1 = [q heads 2..3; k head 1; v head 1].
        let vp = convert::plan_vllm(&t, &c, lay(tp, 1), &cinv, 2).unwrap();
        for b in vp.batches() {
            let mut out: Vec<Vec<u8>> = vp.dests[b.clone()]
                .iter()
                .map(|d| vec![0u8; d.nbytes() as usize])
                .collect();
            let mut views: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
            convert::fill_from_checkpoint(&ck, &vp, b.clone(), &mut views).unwrap();
            for (d, o) in vp.dests[b].iter().zip(&out) {
                if d.name == "model.layers.1.self_attn.qkv_proj.weight" && d.group == 1 {
                    let row = 16 * 2;
                    let q = &data["model.layers.1.self_attn.q_proj.weight"];
                    let k = &data["model.layers.1.self_attn.k_proj.weight"];
                    let v = &data["model.layers.1.self_attn.v_proj.weight"];
                    let want = [
                        &q[8 * row..16 * row],
                        &k[4 * row..8 * row],
                        &v[4 * row..8 * row],
                    ]
                    .concat();
                    assert_eq!(o, &want);
                }
                if d.name == "lm_head.weight" {
                    // Vocabulary padded to a multiple of 64 (128), 64 rows per rank.
                    assert_eq!(d.shape, vec![64, 16]);
                    let src = if tied {
                        "model.embed_tokens.weight"
                    } else {
                        "lm_head.weight"
                    };
                    let s = &data[src];
                    let rows = if d.group == 0 { 0..64 } else { 64..100 };
                    let n = rows.len() * 32;
                    assert_eq!(&o[..n], &s[rows.start * 32..rows.end * 32]);
                    assert!(o[n..].iter().all(|&x| x == 0));
                }
            }
        }
        assert_eq!(
            vp.dests
                .iter()
                .any(|d| d.name == "model.embed_tokens.weight"),
            !tied,
            "tied models carry only lm_head.weight in vLLM's files"
        );
    }
}

/// The inventory of a Llama checkpoint imported at TP1 (shapes only: planning reads nothing).
fn llama_tp1_inventory(c: &serde_json::Value) -> Inventory {
    let t = Table::builtin("llama").unwrap();
    let plan = import(&t, c, lay(1, 1), &inv(&llama_hf(c))).unwrap();
    plan.dests
        .iter()
        .map(|d| (d.name.clone(), ("bfloat16".to_string(), d.shape.clone())))
        .collect()
}

#[test]
fn vllm_tp_that_does_not_divide_is_refused() {
    let c = cfg(false);
    let t = Table::builtin("llama").unwrap();
    let cinv = llama_tp1_inventory(&c);
    let e = msg(convert::plan_vllm(&t, &c, lay(1, 1), &cinv, 3).unwrap_err());
    assert!(e.contains("vLLM tp") && e.contains("by vLLM tp = 3"), "{e}");
    // 8 ranks: 4 heads do not split 8 ways.
    let e = msg(convert::plan_vllm(&t, &c, lay(1, 1), &cinv, 8).unwrap_err());
    assert!(
        e.contains("q_proj") && e.contains("= 4 is not divisible by vLLM tp = 8"),
        "{e}"
    );
}

/// A vLLM stack whose range leaves its axis is refused, naming the vLLM tensor (it was
/// silently clipped once).
#[test]
fn vllm_stack_range_outside_its_axis_is_refused() {
    let c = cfg(false);
    let base = Table::builtin("llama").unwrap();
    let cinv = llama_tp1_inventory(&c);
    let name = "model.layers.{layer}.input_layernorm.weight";
    let ext = json!({"format": "zarrckpt-mapping", "version": 1, "name": "user", "extends": "llama",
        "rules": [], "vllm": {"tensors": [{"name": name,
            "stack": [{"capture": "layer", "size": "L", "stop": "L + 1"}],
            "parts": [{"hf": "model.layers.{layer}.input_layernorm.weight"}]}]}});
    let t = base.extend_with(Table::parse(&ext.to_string(), "user").unwrap());
    let e = msg(convert::plan_vllm(&t, &c, lay(1, 1), &cinv, 1).unwrap_err());
    assert!(
        e.contains(&format!("vllm:{name}")) && e.contains("outside size"),
        "{e}"
    );
}

fn ds_cfg(fp8: bool) -> serde_json::Value {
    let mut c = json!({"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 1000, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": false});
    if fp8 {
        c["quantization_config"] = json!({"quant_method": "fp8", "weight_block_size": [128, 128]});
    }
    c
}

/// The HF inventory a table implies (what a conforming HF directory holds).
fn implied_hf(t: &Table, c: &serde_json::Value, fp8: bool) -> Inventory {
    let ex = convert::expand(t, c, lay(1, 1)).unwrap();
    ex.h.iter()
        .map(|h| {
            let dt = match &h.dtype {
                Some(d) => d.clone(),
                None if fp8
                    && ex.links.iter().any(|l| {
                        l.h == ex.h.iter().position(|x| x.name == h.name).unwrap()
                            && l.scale.is_some()
                    }) =>
                {
                    "float8_e4m3fn".into()
                }
                None => "bfloat16".into(),
            };
            (h.name.clone(), (dt, h.shape.clone()))
        })
        .collect()
}

#[test]
fn deepseek_v3_per_layer_keys_experts_and_mtp() {
    let c = ds_cfg(false);
    let t = Table::builtin("deepseek_v3").unwrap();
    let ex = convert::expand(&t, &c, lay(1, 1)).unwrap();
    let m = |k: &str| ex.m.iter().find(|m| m.key == k).map(|m| m.shape.clone());
    assert_eq!(
        m("decoder.layers.0.mlp.linear_fc1.weight"),
        Some(vec![192, 64])
    );
    assert_eq!(m("decoder.layers.1.mlp.linear_fc1.weight"), None);
    assert_eq!(
        m("decoder.layers.2.mlp.experts.experts.linear_fc1.weight"),
        Some(vec![8, 64, 64])
    );
    assert_eq!(
        m("decoder.layers.1.self_attention.linear_q_up_proj.weight"),
        Some(vec![96, 48])
    );
    assert_eq!(m("decoder.layers.1.mlp.router.expert_bias"), Some(vec![8]));
    assert_eq!(m("mtp.layers.0.eh_proj.weight"), Some(vec![64, 128]));
    assert_eq!(
        m("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight"),
        Some(vec![8, 64, 32])
    );
    assert!(
        ex.h.iter()
            .any(|h| h.name == "model.layers.3.mlp.experts.7.down_proj.weight")
    );
    let inv = implied_hf(&t, &c, false);
    let p = import(
        &t,
        &c,
        Layout {
            tp: 2,
            pp: 1,
            ep: 4,
        },
        &inv,
    )
    .unwrap();
    // Experts: one box per (expert, TP piece of each half).
    let n = p
        .dests
        .iter()
        .filter(|d| d.name == "decoder.layers.1.mlp.experts.experts.linear_fc1.weight")
        .count();
    assert_eq!(n, 8 * 2 * 2);
    let e = msg(import(
        &t,
        &c,
        Layout {
            tp: 1,
            pp: 1,
            ep: 3,
        },
        &inv,
    )
    .unwrap_err());
    assert!(
        e.contains("experts") && e.contains("= 8 is not divisible by ep = 3"),
        "{e}"
    );
    // The MTP layer's copies of the embedding and head are dropped deliberately.
    let mut inv2 = inv.clone();
    inv2.insert(
        "model.layers.3.shared_head.head.weight".into(),
        ("bfloat16".into(), vec![1000, 64]),
    );
    import(&t, &c, lay(1, 1), &inv2).unwrap();
}

#[test]
fn fp8_block_dequantisation_on_import() {
    let c = ds_cfg(true);
    let t = Table::builtin("deepseek_v3").unwrap();
    let inv = implied_hf(&t, &c, true);
    assert_eq!(
        inv["model.layers.0.self_attn.q_b_proj.weight_scale_inv"],
        ("float32".to_string(), vec![1, 1])
    );
    let p = import(&t, &c, lay(1, 1), &inv).unwrap();
    let data: Vec<Vec<u8>> = p
        .sources
        .iter()
        .map(|s| {
            let n: u64 = s.shape.iter().product();
            if s.dtype == zarrckpt::DType::Float32 {
                (0..n)
                    .flat_map(|i| (0.5f32 + i as f32).to_le_bytes())
                    .collect()
            } else {
                (0..n * s.dtype.size() as u64)
                    .map(|i| (i * 7 % 120) as u8)
                    .collect()
            }
        })
        .collect();
    let i = p
        .dests
        .iter()
        .position(|d| d.name == "decoder.layers.0.self_attention.linear_q_up_proj.weight")
        .unwrap();
    let d = &p.dests[i];
    assert_eq!(d.dtype, zarrckpt::DType::BFloat16);
    let mut buf = vec![0u8; d.nbytes() as usize];
    convert::fill_from_sources(&p, i, &|k| data[k].as_slice(), &mut buf).unwrap();
    let s = p
        .sources
        .iter()
        .position(|s| s.name == "model.layers.0.self_attn.q_b_proj.weight")
        .unwrap();
    let want: Vec<f64> = data[s]
        .iter()
        .map(|&b| {
            zarrckpt::model::dtype::float8_value(zarrckpt::DType::Float8E4M3FN, b).unwrap() * 0.5
        })
        .collect();
    let mut wb = vec![0u8; want.len() * 2];
    zarrckpt::model::convert::convert(
        zarrckpt::DType::Float64,
        zarrckpt::model::dtype::as_bytes(&want),
        zarrckpt::DType::BFloat16,
        &mut wb,
    )
    .unwrap();
    assert_eq!(buf, wb);
}

#[test]
fn qwen3_moe_experts_on_an_expert_axis() {
    let c = json!({"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 24, "moe_intermediate_size": 8, "num_local_experts": 4,
        "vocab_size": 100, "tie_word_embeddings": false, "decoder_sparse_step": 1});
    let t = Table::builtin("qwen3_moe").unwrap();
    let inv = implied_hf(&t, &c, false);
    let ex = convert::expand(&t, &c, lay(1, 1)).unwrap();
    let fc1 =
        ex.m.iter()
            .find(|m| m.key == "decoder.layers.mlp.experts.experts.linear_fc1.weight")
            .unwrap();
    assert_eq!(fc1.shape, vec![2, 4, 16, 16]);
    assert!(
        !ex.m
            .iter()
            .any(|m| m.key == "decoder.layers.mlp.linear_fc1.weight")
    );
    import(
        &t,
        &c,
        Layout {
            tp: 1,
            pp: 2,
            ep: 4,
        },
        &inv,
    )
    .unwrap();
    let mut c2 = c.clone();
    c2["decoder_sparse_step"] = json!(2);
    let e = msg(import(&t, &c2, lay(1, 1), &inv).unwrap_err());
    assert!(e.contains("every layer is an MoE layer"), "{e}");
}

fn bin() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
}

/// Writes a tiny HF model directory (config.json, model.safetensors) and returns its tensors.
fn write_hf(dir: &std::path::Path, c: &serde_json::Value) -> BTreeMap<String, Vec<u8>> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let hf = llama_hf(c);
    let data: BTreeMap<String, Vec<u8>> =
        hf.iter().map(|(k, s)| (k.clone(), data_of(k, s))).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = hf
        .iter()
        .map(|(k, s)| {
            let shape: Vec<usize> = s.iter().map(|&d| d as usize).collect();
            (
                k.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape, &data[k])
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    data
}

fn read_hf(dir: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (k, v) in st.tensors() {
                assert!(
                    out.insert(k.clone(), v.data().to_vec()).is_none(),
                    "{k} twice"
                );
            }
        }
    }
    out
}

#[test]
fn cli_import_export_vllm_and_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let c = cfg(false);
    let hf = tmp.path().join("hf");
    let data = write_hf(&hf, &c);
    let mg = tmp.path().join("mg");
    // Dry run: the plan, nothing written.
    let o = bin()
        .args(["import", "--hf"])
        .arg(&hf)
        .args([
            "--map",
            "llama",
            "--megatron",
            "tp=2,pp=2",
            "--dry-run",
            "--out",
        ])
        .arg(&mg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("checks passed")
            && text.contains("decoder.layers.self_attention.linear_qkv.weight"),
        "{text}"
    );
    assert!(!mg.exists());
    // Import, then export in several files.
    let o = bin()
        .args(["import", "--hf"])
        .arg(&hf)
        .args(["--map", "llama", "--megatron", "tp=2,pp=2", "--out"])
        .arg(&mg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(mg.join("metadata.json").exists() && mg.join("zarrckpt/zarr.json").exists());
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(mg.join("metadata.json")).unwrap()).unwrap();
    assert_eq!(meta["sharded_backend"], "zarrckpt");
    let out = tmp.path().join("out");
    let o = bin()
        .args(["export", "--hf", "--map", "llama"])
        .arg(&mg)
        .args(["--max-shard-size", "5KB", "--procs", "2", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(read_hf(&out), data);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let total: usize = data.values().map(Vec::len).sum();
    assert_eq!(index["metadata"]["total_size"], json!(total));
    let wm = index["weight_map"].as_object().unwrap();
    assert_eq!(wm.len(), data.len());
    let files: std::collections::BTreeSet<&str> =
        wm.values().map(|v| v.as_str().unwrap()).collect();
    let n = files.len();
    assert!(n > 1);
    for (i, f) in files.iter().enumerate() {
        assert_eq!(*f, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }
    let cfg_back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg_back, c);
    // vLLM TP 2: two rank files.
    let vl = tmp.path().join("vllm");
    let o = bin()
        .args(["export", "--vllm", "--tp", "2", "--map", "llama"])
        .arg(&mg)
        .arg("--out")
        .arg(&vl)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        vl.join("model-rank-0-part-0.safetensors").exists()
            && vl.join("model-rank-1-part-0.safetensors").exists()
    );
    // Refusals: non-zero exit, the rule, key and numbers on stderr.
    let o = bin()
        .args(["import", "--hf"])
        .arg(&hf)
        .args(["--map", "llama", "--megatron", "tp=4", "--out"])
        .arg(tmp.path().join("x"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("rule `qkv`") && err.contains("not divisible by tp = 4"),
        "{err}"
    );
    let o = bin()
        .args(["export", "--vllm", "--tp", "3", "--map", "llama"])
        .arg(&mg)
        .arg("--out")
        .arg(tmp.path().join("y"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("by vLLM tp = 3"));
}

/// rank -> tensor name -> bytes.
type RankTensors = BTreeMap<u64, BTreeMap<String, Vec<u8>>>;

/// The tensors of each vLLM rank, over all its part files, and the part files with their
/// data bytes and tensor counts.
fn vllm_ranks(dir: &std::path::Path) -> (RankTensors, Vec<(String, u64, usize)>) {
    let mut ranks: RankTensors = BTreeMap::new();
    let mut parts = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_owned();
        let Some(rest) = name.strip_prefix("model-rank-") else {
            continue;
        };
        let rank: u64 = rest.split('-').next().unwrap().parse().unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let data: u64 = st
            .tensors()
            .iter()
            .map(|(_, v)| v.data().len() as u64)
            .sum();
        parts.push((name, data, st.len()));
        for (k, v) in st.tensors() {
            assert!(
                ranks
                    .entry(rank)
                    .or_default()
                    .insert(k.clone(), v.data().to_vec())
                    .is_none()
            );
        }
    }
    parts.sort();
    (ranks, parts)
}

/// `export --vllm`: `--procs` runs that many writers, `--max-shard-size` cuts each rank's
/// tensors into parts, `--copy-from` copies the model's other files (config, tokenizer) and
/// without it `config.json` is written, so vLLM can open the folder; the options that do not
/// apply are refused; `import --dcp` is refused with the Python command that does it.
#[test]
fn cli_vllm_options_do_what_they_say() {
    let tmp = tempfile::tempdir().unwrap();
    let c = cfg(false);
    let hf = tmp.path().join("hf");
    write_hf(&hf, &c);
    std::fs::write(hf.join("tokenizer.json"), "{\"version\": \"1.0\"}").unwrap();
    std::fs::write(hf.join("generation_config.json"), "{\"do_sample\": false}").unwrap();
    let mg = tmp.path().join("mg");
    let ok = |cmd: &mut std::process::Command| {
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    ok(bin()
        .args(["import", "--hf"])
        .arg(&hf)
        .args(["--map", "llama", "--megatron", "tp=2,pp=1", "--out"])
        .arg(&mg));
    // The defaults: one writer, one part per rank, config.json written from the checkpoint's.
    let plain = tmp.path().join("plain");
    ok(bin()
        .args(["export", "--vllm", "--tp", "2", "--map", "llama"])
        .arg(&mg)
        .arg("--out")
        .arg(&plain));
    let (want, parts) = vllm_ranks(&plain);
    assert_eq!(parts.len(), 2, "{parts:?}");
    let cfg_back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plain.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg_back, c);
    assert!(!plain.join("tokenizer.json").exists());
    // Two writers, parts of at most 2 KB, the model's files copied.
    let cut = tmp.path().join("cut");
    let text = ok(bin()
        .args([
            "export", "--vllm", "--tp", "2", "--map", "llama", "--procs", "2",
        ])
        .args(["--max-shard-size", "2KB", "--copy-from"])
        .arg(&hf)
        .arg(&mg)
        .arg("--out")
        .arg(&cut));
    assert!(text.contains(", 2 writers"), "{text}");
    let (got, parts) = vllm_ranks(&cut);
    assert_eq!(got, want);
    assert!(parts.len() > 4, "{parts:?}");
    for (name, data, tensors) in &parts {
        assert!(
            *data <= 2000 || *tensors == 1,
            "{name}: {data} bytes in {tensors} tensors"
        );
    }
    for r in 0..2 {
        let n = parts
            .iter()
            .filter(|p| p.0.starts_with(&format!("model-rank-{r}-")))
            .count();
        for k in 0..n {
            assert!(
                cut.join(format!("model-rank-{r}-part-{k}.safetensors"))
                    .exists()
            );
        }
    }
    for f in ["config.json", "tokenizer.json", "generation_config.json"] {
        assert_eq!(
            std::fs::read(cut.join(f)).unwrap(),
            std::fs::read(hf.join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(!cut.join("model.safetensors").exists());
    // Options that do not apply are refused, not ignored.
    let refused = |args: &[&str], what: &str| {
        let o = bin()
            .args(args)
            .arg(&mg)
            .arg("--out")
            .arg(tmp.path().join("no"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(what), "{args:?}: {err}");
        assert!(!tmp.path().join("no").exists());
    };
    refused(&["export", "--tp", "2"], "--vllm");
    refused(&["export", "--hf", "--map", "llama", "--tp", "2"], "--vllm");
    refused(&["export", "--copy-from", "x"], "--hf");
    refused(&["export", "--procs", "2"], "--hf");
    refused(&["export", "--max-shard-size", "1GB"], "--hf");
    refused(
        &[
            "export",
            "--vllm",
            "--tp",
            "2",
            "--map",
            "llama",
            "--max-shard-size",
            "5XB",
        ],
        "unknown unit",
    );
    // DCP: a folder that is not a DCP checkpoint (no .metadata) is named, nothing written;
    // with --megatron, a folder that is no Megatron `torch_dist` checkpoint (no
    // metadata.json) likewise (tests/dcp_import.rs and tests/megatron_import.rs import real
    // ones).
    let o = bin()
        .args(["import", "--dcp"])
        .arg(&hf)
        .arg("--out")
        .arg(tmp.path().join("dcp"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(".metadata"), "{err}");
    assert!(!tmp.path().join("dcp").exists());
    let o = bin()
        .args(["import", "--dcp"])
        .arg(&hf)
        .args(["--megatron", "--out"])
        .arg(tmp.path().join("dcp"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("metadata.json") && err.contains("not a Megatron"),
        "{err}"
    );
    assert!(!tmp.path().join("dcp").exists());
}

/// The spec's example table (§ 19.2) parses, validates against the schema and extends `llama`.
#[test]
fn the_spec_example_table_works() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = std::fs::read_to_string(root.join("spec/format.md")).unwrap();
    let sec = &spec[spec.find("## 19. Conversion tables").unwrap()..];
    let start = sec.find("```json\n").unwrap() + 8;
    let text = &sec[start..start + sec[start..].find("```").unwrap()];
    let doc: serde_json::Value = serde_json::from_str(text).unwrap();
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("spec/schema/mapping.schema.json")).unwrap(),
    )
    .unwrap();
    assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&doc));
    let t = Table::from_json(text).unwrap();
    assert_eq!(t.name, "my-llama-with-bias");
    assert!(
        t.rules.iter().any(|r| r.name == "qkv") && t.rules.iter().any(|r| r.name == "qkv_bias")
    );
    let c = cfg(false);
    let mut hf = llama_hf(&c);
    for i in 0..2 {
        hf.insert(format!("model.layers.{i}.self_attn.q_proj.bias"), vec![16]);
        hf.insert(format!("model.layers.{i}.self_attn.k_proj.bias"), vec![8]);
        hf.insert(format!("model.layers.{i}.self_attn.v_proj.bias"), vec![8]);
        hf.insert(format!("model.layers.{i}.self_attn.extra_scale"), vec![1]);
    }
    let p = import(&t, &c, lay(2, 1), &inv(&hf)).unwrap();
    assert!(p.dests.iter().any(
        |d| d.name == "decoder.layers.self_attention.linear_qkv.bias" && d.shape == vec![2, 32]
    ));
}

/// `transpose`: Megatron holds the HF tensor transposed; import and the way back agree.
#[test]
fn transpose_round_trips() {
    let c = cfg(false);
    let t = user_table(
        json!([{"name": "attn_proj", "megatron": "decoder.layers.self_attention.linear_proj.weight",
        "stack": [{"capture": "layer", "size": "L"}], "op": "transpose",
        "hf": [{"name": "model.layers.{layer}.self_attn.o_proj.weight", "shape": ["hidden", "heads * head_dim"]}],
        "tp": {"axis": 0}}]),
    );
    let hf = llama_hf(&c);
    let data: BTreeMap<String, Vec<u8>> =
        hf.iter().map(|(k, s)| (k.clone(), data_of(k, s))).collect();
    let plan = import(&t, &c, lay(2, 1), &inv(&hf)).unwrap();
    let src: Vec<&[u8]> = plan
        .sources
        .iter()
        .map(|s| data[&s.name].as_slice())
        .collect();
    let mut pieces_data = Vec::new();
    for (i, d) in plan.dests.iter().enumerate() {
        let mut b = vec![0u8; d.nbytes() as usize];
        convert::fill_from_sources(&plan, i, &|k| src[k], &mut b).unwrap();
        pieces_data.push(b);
    }
    // Layer 1, TP rank 1: rows 8..16 of M = columns 8..16 of o_proj (16 x 16, bf16).
    let i = plan
        .dests
        .iter()
        .position(|d| {
            d.name == "decoder.layers.self_attention.linear_proj.weight"
                && d.region.off == vec![1, 8, 0]
        })
        .unwrap();
    let o = &data["model.layers.1.self_attn.o_proj.weight"];
    let mut want = Vec::new();
    for r in 8..16 {
        for col in 0..16 {
            // M[r, col] = H[col, r]
            let at = (col * 16 + r) * 2;
            want.extend_from_slice(&o[at..at + 2]);
        }
    }
    assert_eq!(pieces_data[i], want);
    // Back: save, export, compare.
    let pieces: Vec<ShardedTensor> = plan
        .dests
        .iter()
        .zip(&pieces_data)
        .map(|(d, b)| {
            let r = Region::new(d.region.off.clone(), d.region.len.clone()).unwrap();
            ShardedTensor::new(
                TensorKey::new(&d.name).unwrap(),
                d.dtype,
                d.shape.clone(),
                r,
                0,
                b,
            )
            .unwrap()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    zarrckpt::save(
        &pieces,
        &dir.path().join("ck"),
        &LocalComm::single(),
        &SaveOptions::default(),
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path().join("ck")).unwrap();
    let cinv: Inventory = ck
        .tensors()
        .into_iter()
        .map(|t| (t.key.to_string(), (t.dtype.to_string(), t.shape)))
        .collect();
    let ep = convert::plan_hf_export(&t, &c, lay(2, 1), &cinv, u64::MAX).unwrap();
    for b in ep.batches() {
        let mut out: Vec<Vec<u8>> = ep.dests[b.clone()]
            .iter()
            .map(|d| vec![0u8; d.nbytes() as usize])
            .collect();
        let mut views: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
        convert::fill_from_checkpoint(&ck, &ep, b.clone(), &mut views).unwrap();
        for (d, o) in ep.dests[b].iter().zip(&out) {
            assert_eq!(o, &data[&d.name], "{}", d.name);
        }
    }
}
