# Every GPU check and benchmark of the project in one run on a GPU, from the repository root:
#
#   OUT=/tmp/out bash benchmarks/run_all.sh
#
# Installs the checkout (gpu_env.sh), runs the GPU-marked tests, the main job with the Pallas
# kernels, then each stage's benchmark beside XLA, and draws front.png from their results. Each step's
# log goes to $OUT/<step>.log; the tables print last. A failing step is reported and the rest still run;
# the exit status is the number of steps that failed. Knobs, for a run that must fit a time limit:
#   BENCHES="front route"       the benchmarks to run, in order (default: all single-GPU ones;
#                               BENCHES="" none)
#   ARGS_front="--tps 1,8"      extra arguments of bench_front.py (likewise ARGS_route, ...)
#   TESTS="test_permute.py"     the GPU test files, run first (default: all); DECODE=0 skips the main job
#   STEP_LIMIT=120              seconds each step may run before it is stopped (default: no limit);
#                               LIMIT_<step>=60 for one step (LIMIT_bench_route, LIMIT_gpu_tests, ...)
#   BUNDLE=1                    pack $OUT into $OUT/run_all.tgz (the device tool brings back 8 files)
set -u
OUT=${OUT:?set OUT to the folder for results}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader || true
failed=0
limit=${STEP_LIMIT:-0}

step() {  # step NAME COMMAND...: run under the step limit, log to $OUT/NAME.log, say how long it took
  local name=$1; shift
  local start=$SECONDS own=LIMIT_$name
  local limit=${!own:-$limit}
  echo "== $name: $*"
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - start)) s"
  else
    local status=$?
    [ "$status" = 124 ] && echo "   STOPPED at the step limit of $limit s" >> "$OUT/$name.log"
    echo "   FAILED (status $status) in $((SECONDS - start)) s; last lines:"; tail -n 15 "$OUT/$name.log"
    failed=$((failed + 1))
  fi
}

# pytest runs from tests/ so that `import moe_front_jax` is the copy gpu_env.sh installed.
# (test_notebook.py holds no GPU test and needs nbformat, which the GPU image lacks.) Each test's
# name is logged, and a test still running after 60 s dumps every thread's stack: a kernel that
# hangs shows where.
step gpu_tests bash -c "cd tests && python3 -m pytest -v -m gpu -rs -p no:cacheprovider \
  -o faulthandler_timeout=60 --ignore=test_notebook.py ${TESTS:-.}"
[ "${DECODE:-1}" = 1 ] && step decode python3 examples/decode.py --batch 1 64 --steps 3 --backend pallas
BENCHES=${BENCHES-front route front_gemm shared_expert plan mailbox}
for bench in $BENCHES; do
  extra=ARGS_$bench
  step "bench_$bench" python3 "benchmarks/bench_$bench.py" --out "$OUT" ${!extra:-}
done
# Where "auto" would run the GEMM kernels by this run alone (the shipped table needs every run it names).
if [ -f "$OUT/bench_front_gemm.json" ] && [ -f "$OUT/bench_shared_expert.json" ]; then
  step auto_table python3 benchmarks/auto_table.py --front "$OUT/bench_front_gemm.json" \
    --shared "$OUT/bench_shared_expert.json" --out "$OUT/auto.json"
fi
# The stages timed against XLA (the mailbox has no XLA counterpart on one GPU: its table says what it adds).
plotted=$(for b in route front_gemm shared_expert plan; do [ -f "$OUT/bench_$b.json" ] && echo "$OUT/bench_$b.json"; done)
[ -n "$plotted" ] && step plot python3 benchmarks/plot.py $plotted -o "$OUT/front.png" --table

for log in gpu_tests decode; do
  [ -f "$OUT/$log.log" ] && { echo; echo "== $log (tail)"; tail -n 12 "$OUT/$log.log"; }
done
for bench in $BENCHES; do
  echo; echo "== bench_$bench (table)"; sed -n '/^$/,$p' "$OUT/bench_$bench.log" | tail -n 45
done
[ -f "$OUT/plot.log" ] && { echo; echo "== plot"; cat "$OUT/plot.log"; }
if [ "${BUNDLE:-0}" = 1 ]; then
  (cd "$OUT" && tar czf /tmp/run_all.tgz . && find . -mindepth 1 -delete && mv /tmp/run_all.tgz .)
fi
exit $failed
