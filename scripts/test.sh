#!/usr/bin/env bash
# The test suite on the CPU (GPU tests skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=10 tests "$@"
