#!/usr/bin/env bash
# Creates .venv and installs the pinned CPU stack in the order that works (CPU_STACK.md):
# torch first (local CPU wheel), megatron-core ignoring its Requires-Python, SGLang without its
# CUDA dependencies, then the rest with dependencies under a constraints file that pins torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
REQ=requirements
python3.11 -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -c $REQ/constraints.txt"
$PIP torch==2.13.0
$PIP numpy==2.3.5 packaging==26.4 psutil==7.2.2
$PIP --ignore-requires-python megatron-core==0.19.2
$PIP --no-deps -r $REQ/sglang-0.5.23-cpu-nodeps.txt sglang==0.5.23
$PIP --no-deps triton==3.8.0
$PIP -r $REQ/base.txt
$PIP --no-deps -e .
# A dependency that pulled another torch would be a broken (multi-GB CUDA) install: fail loudly.
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"torch {torch.__version__} installed; need 2.13.0"
PY
touch "$VENV/.installed"
echo "setup done: $VENV"
