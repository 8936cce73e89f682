#!/usr/bin/env bash
# One device call (under 10 minutes) for the sage-sm90 kernel on an H100/H200: its cubins built on the
# device (one build per core), its GPU tests, the build sweep, and the
# quantizer's launch settings, the kernels' error on a model's activations and an ncu profile. Results under $OUT. Usage (carry .whl): bash benchmarks/sage_sm90_check.sh
set -uo pipefail
source .whl/setup.sh
export PYTHONUNBUFFERED=1 DIFFUSERS_TRTLLM_CACHE="${DIFFUSERS_TRTLLM_CACHE:-$(pwd)/.cubin-cache}"
out="${OUT:-/tmp}"
builds=default,serial-fp32-poly
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# every build the GPU tests and the sweeps below use
python3 benchmarks/bench_sage_sm90.py --build-only --builds "$builds,serial,fp32-poly,nopingpong,2stages" 2>&1 | grep -v "build/s"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_sage_sm90_gpu.py 2>&1 | tee "$out/gpu_tests_sage_sm90.log" | tail -5
timeout 120 python3 benchmarks/bench_sage_sm90.py --shapes wan_14b_480p,wan_14b_720p,flux_1024 --builds "$builds" \
  --iters 10 --out "$out/sage_sm90_sweep.json" | grep -v "skip0"
timeout 90 python3 benchmarks/bench_quantizer.py --v-split 0,1 --v-channels 4,8,16 --v-block 128 --block-t 64,128 --warps 8 \
  --out "$out/quantizer.json" 2>&1 | grep -v "setting/s"
# the kernels' error on a model's own activations (Wan2.1-1.3B, random weights), beside SageAttention2's
timeout 120 python3 benchmarks/sage_error_probe.py --models wan2.1-t2v-1.3b --variant full --calls 0,10,20,29 \
  --device cuda --kernels sage-sm90,triton,sageattn --out "$out/sage_error_probe.json" 2>&1 | grep "^|"
# what bounds the default build: one call under Nsight Compute (speed of light, pipes, stalls, instruction mix)
timeout 100 ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --section SpeedOfLight \
  --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats --section SchedulerStats \
  python3 benchmarks/profile_sage_sm90.py --shape wan_1.3b_480p > "$out/ncu_sage_sm90_default.txt" 2>&1
tail -40 "$out/ncu_sage_sm90_default.txt"
