#!/usr/bin/env bash
# Device calls of issue 57 (attention at image-model lengths, 4-16k tokens), by section; results under $OUT.
#   `profile`: benchmarks/profile_call.py on flux_1024 and Flux 2048² (16,896 tokens): each call's time, host and
#              GPU, per launch (with BASE=.base: the package copy there timed first, in the same run);
#   `long`:    the same on wan_14b_480p (LONG_SHAPES), four calls, this copy beside BASE's;
#   `sweep`:   benchmarks/bench_sage_sm90.py's whole-call, quantizer-only and kernel-only rows on those shapes
#              (SHAPES to change them), keys with a per-channel mean;
#   `build`:   the sage-sm90 cubins, built in parallel ahead of the rest;
#   `tests`:   the GPU tests of the quantizer, the sage-sm90 and triton routes and the fast path;
#   `compile`: benchmarks/compile_check.py (our processor under torch.compile's three uses);
#   `e2e`:     Flux.1-dev / Qwen-Image forwards (random weights) beside stock and SageAttention2, eager and compiled;
#   `slack`:   the SAGE_SM90_RESCALE_SLACK builds (O rescaled only where a row's max passed the exponent's by more than
#              1 / 2, log2 units) against the default, kernel alone in alternating rounds and whole calls, SHAPES;
#   `one-consumer`: the SAGE_SM90_CONSUMERS=1 build (CTAs of 64 query rows, two an SM) built, GPU-tested and timed
#              against the default, kernel alone, in alternating rounds;
#   `capture`: benchmarks/capture_probe.py (which copy breaks a CUDA graph capture of a served call);
#   `e2e-profile`: where Flux.1-dev 1024²'s regional-compiled forward spends its GPU time, stock against our
#              defaults, and our processor on cuDNN (`--backend sdpa`);
#   `host`:    benchmarks/host_profile.py on flux_1024: each part's CPU time behind a busy GPU, each launch's time in
#              an int8 call and a cProfile of it (where the host time before the first launch goes); BASE's first;
#   `cta`:     benchmarks/cta_cost.py: the kernel alone at fixed grids (4,608 and 16,896 queries) with 1-72 KV tiles a
#              CTA, and the fit of what a CTA pays once (DEFINES: a build's -D knobs, comma-separated);
#   `kernel-ab`: the kernel alone (cta_cost.py, GPU-bound) with BASE's package and this one taken in turn, ROUNDS times,
#              at each Q:HEADS of AB_SHAPES (32760:40 4608:24: Wan-14B 480p, Flux 1024²);
#   `key-mean`: benchmarks/key_mean_sample.py (the quantizer's time and the call's accuracy per K mean sample size);
#   `ncu-quant`: the quantizer's two launches at flux_1024 under Nsight Compute (speed of light, memory workload,
#              occupancy): how far from the memory's bandwidth each pass runs;
#   `ncu-cta`: one call of 4,608 queries x KV_KEYS keys (128: one KV tile a CTA) under Nsight Compute: speed of light
#              and warp states, then the stall samples per SASS instruction (benchmarks/ncu_hotspots.py).
# Carry .whl (and .jit, .cubin-cache where earlier calls returned them):
#   bash benchmarks/image_lengths_check.sh profile sweep
set -uo pipefail
source benchmarks/gpu_env.sh
export DIFFUSERS_TRTLLM_CACHE="${DIFFUSERS_TRTLLM_CACHE:-$(pwd)/.cubin-cache}"
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
shapes="${SHAPES:-flux_1024,flux_2048=1:16896:24:128}"
for section in "$@"; do
  echo "== $section $(date +%T)"
  case "$section" in
  profile)
    if [ -n "${BASE:-}" ]; then
      PYTHONPATH="$BASE:$PYTHONPATH" timeout "${BASE_TIMEOUT:-150}" python3 benchmarks/profile_call.py --shapes "${BASE_SHAPES:-$shapes}" \
        --label baseline --trace-dir /tmp/traces --out "$out/profile_call.json" 2>&1 | grep -v "^    " | grep -v "^|\|^- \|^$"
    fi
    timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/profile_call.py --shapes "$shapes" --label "${LABEL:-this}" ${CALLS:+--calls "$CALLS"} \
      --trace-dir /tmp/traces --out "$out/profile_call.json" 2>&1 | grep -v "^|\|^- \|^$"
    tar czf "$out/traces.tar.gz" -C /tmp traces ;;
  long)  # the long rows (wan_14b_480p): cuDNN, SageAttention2, our default and int8, this copy beside BASE's
    long_calls=cudnn,sageattn,ours-default,ours-int8-sage-sm90
    for label in ${BASE:+baseline} this; do
      PYTHONPATH="$([ "$label" = baseline ] && echo "$BASE:")$PYTHONPATH" timeout "${LONG_TIMEOUT:-80}" \
        python3 benchmarks/profile_call.py --shapes "${LONG_SHAPES:-wan_14b_480p}" --calls "$long_calls" --iters 10 \
        --trace-calls 2 --label "$label" --out "$out/profile_call_long.json" 2>&1 | grep -v "^    \|^|\|^- \|^$"
    done ;;
  sweep)
    timeout "${SWEEP_TIMEOUT:-150}" python3 benchmarks/bench_sage_sm90.py --shapes "$shapes" --builds default \
      --quants k128t-smooth --k-mean 4 --target-skips "" --iters 20 --out "$out/sage_sm90_sweep.json" 2>&1 | tail -30 ;;
  build)  # every sage-sm90 variant and the GPU tests' builds, 16 at a time (as sage_sm90_check.sh builds them)
    timeout "${BUILD_TIMEOUT:-120}" bash benchmarks/sage_sm90_check.sh build 2>&1 | tail -3 ;;
  tests)
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_sage_sm90_gpu.py \
      tests/test_triton_attn_gpu.py tests/test_triton_launch_gpu.py} 2>&1 | tee "$out/gpu_tests.log" | tail -8 ;;
  e2e)
    timeout "${E2E_TIMEOUT:-400}" python3 -m diffusers_trtllm.bench e2e --models "${E2E_MODELS:-flux.1-dev}" --weights random \
      --configs "${E2E_CONFIGS:-stock,dense,sage-int8,stock-sage2}" --warmup 1 --iters 3 --time-limit 300 --out "$out" \
      --name "${E2E_NAME:-e2e}" --no-progress ${E2E_ARGS:-} 2>&1 | grep -v "^\s*$" | tail -30 ;;
  compile)  # regional / max-autotune-no-cudagraphs / reduce-overhead on a small Flux, defaults and int8
    timeout "${COMPILE_TIMEOUT:-240}" python3 benchmarks/compile_check.py --settings "${COMPILE_SETTINGS:-defaults,int8}" \
      --out "$out/compile_check.json" 2>&1 | grep "^{" ;;
  slack)  # SAGE_SM90_RESCALE_SLACK=1 / 2 against the default: kernel alone in alternating rounds, and whole calls
    timeout "${SLACK_TIMEOUT:-170}" python3 benchmarks/bench_sage_sm90.py --shapes "$shapes" --builds default,slack1,slack2 \
      --quants k128t-smooth --k-mean 4 --target-skips "" --iters 20 --kernel-only-builds --alternate-builds \
      --out "$out/sage_sm90_slack.json" 2>&1 | grep -v "^\s*$" | tail -24 ;;
  one-consumer)
    timeout 120 python3 -c "
import torch; from diffusers_trtllm.kernels.sage_sm90 import VARIANTS, build_kernels
print(len(build_kernels([v for v in VARIANTS if v.out_dtype == torch.bfloat16], [(), ('SAGE_SM90_CONSUMERS=1',)], 16)))
" 2>&1 | tail -1
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_sage_sm90_gpu.py -k "one_consumer or default" 2>&1 \
      | tee "$out/gpu_tests_one_consumer.log" | tail -4
    timeout 150 python3 benchmarks/bench_sage_sm90.py --shapes "${SHAPES},mid_8704=1:8704:24:128" \
      --builds default,one_consumer --quants k128t-smooth --k-mean 4 --target-skips "" --iters 20 --kernel-only-builds \
      --alternate-builds --out "$out/sage_sm90_one_consumer.json" 2>&1 | grep -v "^\s*$" | tail -16 ;;
  capture)
    timeout 60 python3 benchmarks/capture_probe.py 2>&1 | tee "$out/capture_probe.log" | tail -14 ;;
  e2e-profile)
    for backend in auto sdpa; do
      timeout 200 python3 benchmarks/profile_e2e.py --model flux.1-dev --weights random --compile regional \
        --configs "$([ $backend = auto ] && echo stock,dense || echo dense)" --backend $backend --top 12 \
        --out "$out/profile_e2e_flux_regional_$backend.json" 2>&1 | grep -v "^\s*$" | tail -34
    done ;;
  host)  # with BASE: BASE's package first, then this one (host_profile_baseline.*, host_profile.*)
    for label in ${BASE:+baseline} this; do
      name="$out/host_profile$([ "$label" = baseline ] && echo _baseline)"
      PYTHONPATH="$([ "$label" = baseline ] && echo "$BASE:")$PYTHONPATH" timeout 60 python3 benchmarks/host_profile.py \
        --shapes "${HOST_SHAPES:-flux_1024}" --calls 100 --top 40 --out "$name.json" > "$name.log" 2>&1
      grep '^{' "$name.log"
    done ;;
  cta)
    timeout 120 python3 benchmarks/cta_cost.py --queries 4608,16896 --keys 128,512,1152,2304,4608,9216 \
      ${DEFINES:+--defines "$DEFINES"} --out "$out/cta_cost.json" 2>&1 | grep '^{' ;;
  kernel-ab)
    for round in $(seq "${ROUNDS:-2}"); do for label in baseline this; do for qh in ${AB_SHAPES:-32760:40 4608:24}; do
      PYTHONPATH="$([ "$label" = baseline ] && echo "${BASE:?kernel-ab needs BASE}:")$PYTHONPATH" timeout 60 \
        python3 benchmarks/cta_cost.py --queries "${qh%:*}" --keys "${qh%:*}" --heads "${qh#*:}" --iters 15 2>&1 \
        | grep '^{' | sed "s/^{/{\"label\": \"$label\", \"round\": $round, /" | tee -a "$out/kernel_ab.jsonl"
    done; done; done ;;
  key-mean)
    timeout 120 python3 benchmarks/key_mean_sample.py --shapes "${KEY_MEAN_SHAPES:-$shapes,wan_14b_480p}" \
      --samples 4096,1024,512 --out "$out/key_mean_sample.json" 2>&1 | tail -10 ;;
  ncu-quant)
    timeout 120 ncu --clock-control none -k regex:"_q_and_stats|_kv_quant" --launch-skip 2 -c 2 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      python3 benchmarks/key_mean_sample.py --shapes flux_1024 --samples 1024 --iters 3 > "$out/ncu_quantizer.txt" 2>&1
    grep -E "Profiling|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per|Grid Size|Block Size" \
      "$out/ncu_quantizer.txt" ;;
  ncu-cta)
    for kv in ${KV_KEYS:-128 4608}; do
      timeout 100 ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --section SpeedOfLight \
        --section WarpStateStats --section LaunchStats --section Occupancy \
        python3 benchmarks/cta_cost.py --queries 4608 --keys "$kv" --iters 3 > "$out/ncu_cta_kv$kv.txt" 2>&1
      grep -E "Duration|Elapsed Cycles|Throughput|Warp Cycles Per Issued|Achieved Occupancy|Waves Per SM" "$out/ncu_cta_kv$kv.txt"
      timeout 100 ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --section SourceCounters \
        --section WarpStateStats --page source --print-source sass --csv \
        python3 benchmarks/cta_cost.py --queries 4608 --keys "$kv" --iters 3 > /tmp/ncu_cta_kv$kv.csv 2>&1
      python3 benchmarks/ncu_hotspots.py /tmp/ncu_cta_kv$kv.csv --top 45 > "$out/ncu_cta_kv${kv}_hotspots.txt" 2>&1
      head -60 "$out/ncu_cta_kv${kv}_hotspots.txt"
    done ;;
  pack)  # the cubins built here, for the next call's carry
    tar czf "$out/cubin-cache.tar.gz" .cubin-cache 2>/dev/null; save_jit ;;
  *) echo "unknown section $section" ;;
  esac
done
