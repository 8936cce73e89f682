#!/usr/bin/env bash
# One device call: the GPU test suite and an import check with FlashInfer present.
# Usage on the H200 (carry .whl and .jit): bash benchmarks/gpu_check.sh
set -uo pipefail
source .whl/setup.sh
if [ -f .jit/flashinfer_sm90_so.tar.xz ]; then  # prebuilt FlashInfer modules from an earlier call
  mkdir -p /tmp/site/flashinfer/data/aot && tar xJf .jit/flashinfer_sm90_so.tar.xz -C /tmp/site/flashinfer/data/aot
fi
export PYTHONUNBUFFERED=1
python3 -c "import flashinfer, diffusers_trtllm; from diffusers_trtllm.routes import route_names; print('import ok with flashinfer', flashinfer.__version__, route_names())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu -rs tests/test_fmha_v2_gpu.py tests/test_triton_attn_gpu.py 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
