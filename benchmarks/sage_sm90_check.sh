#!/usr/bin/env bash
# Device calls (each under 10 minutes) for the sage-sm90 kernel on an H100/H200, by section: `build` (the
# cubins, one build per core), `tests` (its GPU tests and the triton route's), `sweep` (K blocks of 16 and 128,
# split per thread or not, beside cuDNN and SageAttention2), `sweep-vmean` (the same on V with a per-channel mean), `quantizer` (the
# quantizer's launch settings), `probe` (the kernels' error on a model's activations), `ncu` (what bounds the
# default build) and `e2e` (Wan2.1-14B forwards).
# Results under $OUT (`e2e` needs FlashInfer's fa3 modules: source benchmarks/gpu_env.sh first, .jit carried).
# Usage (carry .whl and .cubin-cache): bash benchmarks/sage_sm90_check.sh build tests sweep
set -uo pipefail
source .whl/setup.sh
export PYTHONUNBUFFERED=1 DIFFUSERS_TRTLLM_CACHE="${DIFFUSERS_TRTLLM_CACHE:-$(pwd)/.cubin-cache}"
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for section in "$@"; do
  echo "== $section"
  case "$section" in
  build)  # every build the GPU tests and the sweeps use
    python3 benchmarks/bench_sage_sm90.py --build-only \
      --builds default,serial-fp32-poly,serial,fp32-poly,nopingpong,2stages,softexp2,softexp6 2>&1 | grep -v "build/s" ;;
  tests)  # the kernel's, and the triton and gluon routes' (the same quantizer)
    timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_sage_sm90_gpu.py tests/test_triton_attn_gpu.py \
      tests/test_gluon_attn_gpu.py 2>&1 | tee "$out/gpu_tests_sage_sm90.log" | tail -5 ;;
  e2e)  # Wan2.1-14B forwards at 480p and 720p (random weights): int8 SAGE with K blocks of 128 split per thread
        # (the default) and not split,
        # SageAttention2 (720p alone took 235 s; with 480p, after `sweep`, a 290 s limit cut it: a call of its own)
    timeout 420 python3 -m diffusers_trtllm.bench e2e --models wan2.1-t2v-14b,wan2.1-t2v-14b-720p --weights random \
      --configs stock,sage-int8,sage-int8-k128-blocks,stock-sage2 --warmup 0 --iters 2 --time-limit 240 --out "$out" \
      --name "${E2E_NAME:-e2e_h200_sage}" --no-progress 2>&1 | grep -v "^\s*$" | tail -30 ;;
  sweep)
    timeout 320 python3 benchmarks/bench_sage_sm90.py --shapes wan_14b_480p,wan_14b_720p,flux_1024 --builds default \
      --quants k16,k128,k128t,k16t --iters 10 --out "$out/sage_sm90_sweep.json" | grep -v "skip0" ;;
  sweep-vmean)
    timeout 90 python3 benchmarks/bench_sage_sm90.py --shapes wan_14b_480p,wan_14b_720p --builds default \
      --quants k16,k128 --target-skips "" --v-mean 1.0 --iters 10 --out "$out/sage_sm90_sweep_vmean.json" | grep -v skip0 ;;
  quantizer)  # BASELINE: another triton_quant.py to time beside (git show REV:diffusers_trtllm/kernels/triton_quant.py)
    timeout 200 python3 benchmarks/bench_quantizer.py --k-blocks 16,128 --block-t 64,128 --warps 4,8 \
      ${BASELINE:+--baseline "$BASELINE"} --out "$out/quantizer.json" 2>&1 | grep -v "setting/s" ;;
  probe)  # Wan2.1-1.3B's own activations (random weights), beside SageAttention2
    timeout 150 python3 benchmarks/sage_error_probe.py --models wan2.1-t2v-1.3b --variant full --calls 0,10,20,29 \
      --device cuda --kernels sage-sm90,triton,sageattn --out "$out/sage_error_probe.json" 2>&1 | grep "^|" ;;
  ncu)  # one call under Nsight Compute, every metric of its sections (--page raw): speed of light, each pipe's use,
        # stall reasons per issued instruction, instruction mix
    timeout 100 ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --page raw --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats --section SchedulerStats \
      python3 benchmarks/profile_sage_sm90.py --shape wan_1.3b_480p --k-block 128 > "$out/ncu_sage_sm90.txt" 2>&1
    tail -40 "$out/ncu_sage_sm90.txt" ;;
  *) echo "unknown section $section" ;;
  esac
done
