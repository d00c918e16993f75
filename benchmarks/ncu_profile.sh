# Nsight Compute over benchmarks/ncu_cases.py's cases, on the lent GPU (after gpu_env.sh):
#
#   bash benchmarks/ncu_profile.sh shared_tp1_b64 xla_shared_tp1_b64 ...
#
# One report per case under $OUT (ncu_<case>.txt: speed of light, memory workload, occupancy, launch
# statistics, warp states, per kernel). XLA's command buffers are off so that every kernel launches
# on its own; ncu flushes the L2 before each kernel and leaves the clocks alone (--clock-control
# none: the benchmarks run at the clocks the machine sets). Each case gets CASE_TIMEOUT_S (150) seconds.
set -u
OUT=${OUT:?set OUT to the folder for results}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
export XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}"
status=0
for case in "$@"; do
  timeout "${CASE_TIMEOUT_S:-150}" "$NCU" --profile-from-start off --clock-control none --cache-control all \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 benchmarks/ncu_cases.py "$case" > "$OUT/ncu_$case.txt" 2>&1 || status=$?
  echo "== $case (status $status)"
  grep -E '^  [A-Za-z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|Grid Size|Block Size|Dynamic Shared|Stall' "$OUT/ncu_$case.txt" | head -n 60
done
exit $status
