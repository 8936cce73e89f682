#!/usr/bin/env bash
# Device calls (each under 10 minutes) for the sage-sm90 kernel on an H100/H200, by section: `build` (the
# cubins, one build per core: every variant by `build-kernels`, and the GPU tests' other builds), `tests` (its GPU
# tests and the triton route's), `first-use` (a cold first int8 call by NVRTC and by nvcc, and what `auto` runs,
# with nvcc hidden as from a plain pip install), `sweep-kmean` (the default beside SageAttention2 and the
# unsmoothed kernel, NVRTC and nvcc builds, on keys with a per-channel mean), `e2e-no-toolkit` (Wan2.1-14B 480p
# forwards with nvcc hidden: no FlashInfer JIT), `sweep` (K blocks of 16 and 128,
# split per thread or not, beside cuDNN and SageAttention2), `sweep-vmean` (the same on V with a per-channel mean), `quantizer` (the
# quantizer's launch settings), `probe` (the kernels' error on a model's activations), `ncu` (what bounds the
# default build), `e2e` (Wan2.1-14B forwards), `skip-curve`, `ncu-skip`, `e2e-skip` and
# `profile-e2e` (issue 34: what skipping tiles saves, and where a forward's time goes).
# Results under $OUT (`e2e` needs FlashInfer's fa3 modules: source benchmarks/gpu_env.sh first, .jit carried).
# Usage (carry .whl and .cubin-cache): bash benchmarks/sage_sm90_check.sh build tests sweep
set -uo pipefail
source .whl/setup.sh
export PYTHONUNBUFFERED=1 DIFFUSERS_TRTLLM_CACHE="${DIFFUSERS_TRTLLM_CACHE:-$(pwd)/.cubin-cache}"
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvcc_path="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
# What a user without the CUDA toolkit has: no nvcc on PATH or under CUDA_HOME (FlashInfer's JIT then cannot build).
no_toolkit=(env CUDA_HOME=/nonexistent "PATH=$(echo "$PATH" | tr ':' '\n' | grep -vi cuda | paste -sd:)")
for section in "$@"; do
  echo "== $section"
  case "$section" in
  build)  # every variant of the default build (the command users run), and the GPU tests' other builds in bf16
    python3 -m diffusers_trtllm build-kernels --jobs 16 2>&1 | tail -1
    PYTHONPATH="tests:$PYTHONPATH" python3 -c "
import torch; from test_sage_sm90_gpu import BUILDS; from diffusers_trtllm.kernels.sage_sm90 import VARIANTS, build_kernels
print(len(build_kernels([v for v in VARIANTS if v.out_dtype == torch.bfloat16], [b for b in BUILDS.values() if b], 16)))
" 2>&1 | tail -1 ;;
  first-use)
    timeout 200 "${no_toolkit[@]}" python3 benchmarks/bench_first_use.py --nvcc "$nvcc_path" \
      --out "$out/first_use.json" 2>&1 | grep -v "^\s*$" | tail -12 ;;
  sweep-kmean)  # the default (k128t-smooth) beside k128t, on keys with a channel mean and on plain structured ones
    timeout 150 python3 benchmarks/bench_sage_sm90.py --shapes wan_14b_480p,wan_14b_720p --builds default \
      --quants k128t,k128t-smooth --k-mean 4 --target-skips "" --iters 10 --nvcc "$nvcc_path" \
      --out "$out/sage_sm90_sweep_kmean.json" | grep -v skip0
    timeout 150 python3 benchmarks/bench_sage_sm90.py --shapes wan_14b_480p,wan_14b_720p --builds default \
      --quants k128t,k128t-smooth --target-skips 0.5 --iters 10 --out "$out/sage_sm90_sweep_smooth.json" | grep -v skip0 ;;
  e2e-no-toolkit)  # Wan2.1-14B 480p, random weights, nvcc hidden: the default (dense), int8 (smoothed) and unsmoothed
    timeout 400 "${no_toolkit[@]}" python3 -m diffusers_trtllm.bench e2e --models wan2.1-t2v-14b --weights random \
      --configs stock,dense,sage-int8,sage-int8-nosmooth,stock-sage2 --warmup 0 --iters 2 --time-limit 300 \
      --out "$out" --name "${E2E_NAME:-e2e_h200_no_toolkit}" --no-progress 2>&1 | grep -v "^\s*$" | tail -20 ;;
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
  e2e-skip)  # issue 34: Wan2.1-14B 480p and 720p forwards, structured weights: int8 SAGE with skip-softmax at a calibrated
             # target_sparsity=0.5, beside int8 SAGE without skip and stock Diffusers on SageAttention2 (nvcc hidden,
             # as from a plain pip install: dense calls on the stock SDPA call, our kernels built by NVRTC)
    timeout 560 "${no_toolkit[@]}" python3 -m diffusers_trtllm.bench e2e --models "${E2E_MODELS:-wan2.1-t2v-14b,wan2.1-t2v-14b-720p}" \
      --weights structured --configs stock,sage-int8,sage-int8+skip-calibrated,stock-sage2 --warmup 0 --iters 2 \
      --time-limit 250 --out "$out" --name "${E2E_NAME:-e2e_h200_sage_skip}" --no-progress 2>&1 | grep -v "^\s*$" | tail -30 ;;
  skip-curve)  # issue 34: speed and the kernel's skipped fraction from nothing skipped to half, on inputs whose heads'
               # reach differs (REACH octaves, default 1) and on the plain structured ones, beside SageAttention2
               # (ALTERNATE=1: skip off against skip on timed in turns too; ALTERNATE_BUILDS=1: each build against the
               # default in turns; with TARGETS=0.4,0.5,0.6 a reach fits the 280 s limit: run 9 took 203 s with three builds)
    for reach in ${REACH:-1 0}; do
      timeout 280 python3 benchmarks/bench_sage_sm90.py --shapes "${SHAPES:-wan_14b_480p,wan_14b_720p}" \
        --builds "${BUILDS:-default}" --quants k128t-smooth --target-skips "${TARGETS:-0.1,0.2,0.3,0.4,0.5,0.6}" --reach-spread "$reach" \
        --iters 10 --no-triton-skip ${NVCC_ROWS:+--nvcc "$nvcc_path"} ${ALTERNATE:+--alternate-skip} \
        ${ALTERNATE_BUILDS:+--alternate-builds} \
        --out "$out/sage_sm90_skip_curve_reach$reach.json"
    done ;;
  profile-e2e)  # issue 34: where a Wan2.1-14B forward's GPU time goes, per kernel (torch.profiler): stock, int8, int8 + skip
    for model in ${PROFILE_MODELS:-wan2.1-t2v-14b wan2.1-t2v-14b-720p}; do
      timeout 200 python3 benchmarks/profile_e2e.py --model "$model" --configs stock,sage-int8,sage-int8+skip \
        --threshold "${THRESHOLD:-0.03}" --out "$out/profile_e2e_$model.json" 2>&1 | grep -v "^\s*$" | tail -50
    done ;;
  ncu-skip)  # issue 34: one wan_14b_480p call (reach spread 1) with nothing skipped and with 40% skipped
    for target in 0 0.4; do
      timeout 140 ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --page raw --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section InstructionStats --section SchedulerStats python3 benchmarks/profile_sage_sm90.py --shape wan_14b_480p \
        --k-block 128 --reach-spread 1 --target-skip "$target" > "$out/ncu_sage_sm90_skip$target.txt" 2>&1
      grep -E "skipped|gpu__time_duration.sum|sm__cycles_elapsed.avg |smsp__inst_executed.sum |lts__t_bytes.sum.per_second|dram__bytes.sum.per_second|sm__pipe_tensor_op_gmma_cycles_active.avg.pct|smsp__average_warp_latency_issue_stalled|l1tex__m_xbar2l1tex_read_bytes.sum.per_second|lts__t_sectors_srcunit_tex_op_read.sum " "$out/ncu_sage_sm90_skip$target.txt" | head -40
    done ;;
  *) echo "unknown section $section" ;;
  esac
done
