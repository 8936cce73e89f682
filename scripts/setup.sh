#!/usr/bin/env bash
# Create .venv with the CPU build of torch and the project installed (editable) with its test extras.
# Prints what it is doing: the torch and dependency steps take a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
step() { echo "==> [setup $1/4] $2 ($(date +%H:%M:%S))"; }
step 1 "virtual environment .venv"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
step 2 "pip"
.venv/bin/python -m pip install -q --upgrade pip
# The pinned CPU build (on the project's machines it comes from local disk). No fallback to an unpinned
# "pip install torch": on Linux that is a multi-GB CUDA build, which nobody asked for here.
TORCH="torch==${TORCH_VERSION:-2.13.0}"
step 3 "$TORCH (CPU build; the largest download)"
if ! .venv/bin/python -m pip install --progress-bar on "$TORCH"; then
    echo "setup.sh: could not install $TORCH. Point pip at a CPU build, e.g." >&2
    echo "  PIP_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh" >&2
    echo "or pick a version your index has: TORCH_VERSION=2.x.y bash scripts/setup.sh" >&2
    exit 1
fi
step 4 "diffusers-trtllm (editable) with its test extras: diffusers, transformers, triton, pytest, ..."
.venv/bin/python -m pip install --progress-bar on -e ".[test]"
echo "==> done: run the demo with .venv/bin/python -m diffusers_trtllm, the tests with bash scripts/test.sh"
