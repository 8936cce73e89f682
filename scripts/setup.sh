#!/usr/bin/env bash
# Create .venv with the CPU build of torch and the project installed (editable) with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# On the project's machines this pinned CPU build comes from local disk; users keep an unpinned torch.
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" || .venv/bin/python -m pip install -q torch
.venv/bin/python -m pip install -q -e ".[test]"
