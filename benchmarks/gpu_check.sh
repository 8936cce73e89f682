#!/usr/bin/env bash
# One device call: the GPU test suite and an import check with FlashInfer present.
# Usage on the H200 (carry .whl and .jit): bash benchmarks/gpu_check.sh [pytest args]
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -c "import flashinfer, diffusers_trtllm; from diffusers_trtllm.routing import route_names; print('import ok with flashinfer', flashinfer.__version__, route_names())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu -rs "${@:-tests}" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
