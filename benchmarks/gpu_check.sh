#!/usr/bin/env bash
# One device call: every GPU test and an import check with FlashInfer present.
# Usage on the H200 (carry .whl and .jit): bash benchmarks/gpu_check.sh [test files]
# The test files run as concurrent pytest processes, so FlashInfer's first builds (about 80 s each; FlashInfer
# locks each build across processes) overlap; with no JIT modules carried the whole call takes about 6-9 minutes.
# What comes back: one log, "$OUT/gpu_tests.log" (each file's tail, then each file's whole log), and the JIT
# modules built here, one archive each (the device returns at most 8 files: carry them back in .jit/).
set -uo pipefail
source benchmarks/gpu_env.sh
out="${OUT:-/tmp}"
python3 -c "import flashinfer, diffusers_trtllm; from diffusers_trtllm.routing import route_names; print('import ok with flashinfer', flashinfer.__version__, route_names())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
files=("$@")
[ ${#files[@]} -gt 0 ] || files=($(grep -l "pytest.mark.gpu\|pytestmark" tests/test_*.py))
logs=$(mktemp -d)
for f in "${files[@]}"; do
  timeout "${GPU_TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs "$f" > "$logs/$(basename "$f" .py).log" 2>&1 &
done
wait
{ for l in "$logs"/*.log; do echo "== $(basename "$l" .log): $(tail -n 1 "$l")"; done
  for l in "$logs"/*.log; do echo; echo "==== $(basename "$l" .log)"; cat "$l"; done; } > "$out/gpu_tests.log"
head -n ${#files[@]} "$out/gpu_tests.log"
