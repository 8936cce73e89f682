#!/usr/bin/env bash
# Nsight Compute over one attention call per configuration (benchmarks/profile_attention.py):
# speed of light, pipe utilization (tensor cores, MUFU exp2, FMA), warp stalls, occupancy.
# On the H200 (carry .whl and .jit): [PROFILE_CONFIGS="a b"] bash benchmarks/profile_attention.sh [--shape NAME]
# Writes $OUT/profile_<config>.txt (ncu's report) and $OUT/profile_<config>.csv (raw metrics).
set -uo pipefail
source benchmarks/gpu_env.sh
out=${OUT:-/tmp}
python3 benchmarks/profile_attention.py "$@"  # builds JIT modules and Triton kernels outside the profiler
for cfg in ${PROFILE_CONFIGS:-$(python3 benchmarks/profile_attention.py --list)}; do
  # The second call's attention kernel: skip the quantizer and the first call's kernels.
  ncu --kernel-name-base function --kernel-name 'regex:_attn_fwd|[Ff]mha|[Pp]refill|[Ff]lash' --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
      --section WarpStateStats --section Occupancy --section SchedulerStats \
      python3 benchmarks/profile_attention.py --only "$cfg" "$@" > "$out/profile_$cfg.txt" 2>&1
  ncu --kernel-name-base function --kernel-name 'regex:_attn_fwd|[Ff]mha|[Pp]refill|[Ff]lash' --launch-skip 1 --launch-count 1 \
      --csv --page raw --metrics sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
      python3 benchmarks/profile_attention.py --only "$cfg" "$@" > "$out/profile_$cfg.csv" 2>&1
  echo "$cfg: $(grep -E 'Duration|Compute \(SM\) Throughput' "$out/profile_$cfg.txt" | tr -s ' ' | head -2 | tr '\n' ' ')"
done
