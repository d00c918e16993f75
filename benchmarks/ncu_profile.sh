# Nsight Compute over benchmarks/ncu_cases.py's cases, on the lent GPU (after gpu_env.sh):
#
#   bash benchmarks/ncu_profile.sh shared_tp1_b64 xla_shared_tp1_b64 ...
#
# One report per case under $OUT (ncu_<case>.txt: speed of light, memory workload, occupancy, launch
# statistics, warp states, per kernel). XLA's command buffers are off so that every kernel launches
# on its own; ncu flushes the L2 before each kernel and leaves the clocks alone (--clock-control
# none: the benchmarks run at the clocks the machine sets). Each case gets CASE_TIMEOUT_S (150) seconds.
# JAX does not preallocate here: ncu backs up the device memory a kernel may write before its replay
# passes, and with JAX's default pool (75% of the 141 GB) two of the tenth session's four cases ran
# out of their time after two kernels (presumably that copy; not checked), and the next process
# found the GPU's memory still held. The exit status is the last failing case's.
set -u
OUT=${OUT:?set OUT to the folder for results}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
export XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}" XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
for case in "$@"; do
  timeout "${CASE_TIMEOUT_S:-150}" "$NCU" --profile-from-start off --clock-control none --cache-control all \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 benchmarks/ncu_cases.py "$case" > "$OUT/ncu_$case.txt" 2>&1
  rc=$?
  [ "$rc" = 0 ] || status=$rc
  echo "== $case (status $rc)"
  grep -E '^  [A-Za-z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|Grid Size|Block Size|Dynamic Shared|Stall' "$OUT/ncu_$case.txt" | head -n 60
done
exit $status
