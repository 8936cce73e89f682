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
# On the project's machines this pinned CPU build comes from local disk; users keep an unpinned torch.
step 3 "torch ${TORCH_VERSION:-2.13.0} (CPU build; the largest download)"
.venv/bin/python -m pip install --progress-bar on "torch==${TORCH_VERSION:-2.13.0}" || .venv/bin/python -m pip install torch
step 4 "diffusers-trtllm (editable) with its test extras: diffusers, transformers, triton, pytest, ..."
.venv/bin/python -m pip install --progress-bar on -e ".[test]"
echo "==> done: run the demo with .venv/bin/python -m diffusers_trtllm, the tests with bash scripts/test.sh"
